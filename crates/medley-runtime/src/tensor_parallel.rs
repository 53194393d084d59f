//! A tensor-parallel stage's group over the job's communicator: the collectives of its members'
//! passes (each model chunk of the worker holds a handle), the sum of the gradients of
//! parameters several members hold, and the whole tensors a checkpoint writes.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use medley_comm::{CommError, Communicator, ReduceOp};
use medley_model::params::ParamGroup;
use medley_model::tensor_parallel::{Combine, TensorCollectives, TensorSeat};
use medley_model::{HostTensor, ModelConfig, ModelError, ParamSpec, StageState, parameter_of};

use crate::RuntimeError;
use crate::emulation::Pacer;
use crate::error::CommContext;
use crate::reduction::{flatten_gradients, unflatten_gradients};

/// One worker's tensor-parallel group, shared by its model chunks.
#[derive(Clone)]
pub(crate) struct TensorGroup {
    comm: Arc<Mutex<Communicator>>,
    /// Paces the passes' computing around the collectives to the emulated device's speed.
    pacer: Pacer,
}

fn failed(what: &'static str) -> impl FnOnce(CommError) -> ModelError {
    move |error| ModelError::Collective { what: what.into(), source: Box::new(error) }
}

impl TensorGroup {
    pub fn new(comm: Communicator, pacer: Pacer) -> TensorGroup {
        TensorGroup { comm: Arc::new(Mutex::new(comm)), pacer }
    }

    fn comm(&self) -> MutexGuard<'_, Communicator> {
        // The chunks run one at a time on the worker's thread; a panic leaves no half-made state.
        self.comm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `collective` on the group's communicator as a pause in the pass's computing.
    fn run<T>(&self, collective: impl FnOnce(&mut Communicator) -> Result<T, CommError>) -> Result<T, CommError> {
        let mut comm = self.comm();
        self.pacer.around(|| collective(&mut comm))
    }

    /// Sums over the group the gradients of the parameters in `groups` several members hold
    /// (norm gains, KV heads shared by members), each member's placed in the whole tensor: the
    /// same sum on every member holding them. Megatron-LM all-reduces its sequence-parallel norms'
    /// gradients alike.
    pub fn sum_replicated_grads(
        &self,
        stages: &mut [StageState],
        select: impl Fn(ParamGroup) -> bool + Copy,
    ) -> Result<(), RuntimeError> {
        let replicated = move |spec: &ParamSpec| spec.shard.as_ref().is_some_and(|shard| shard.replicated);
        sum_whole_gradients(&mut self.comm(), stages, move |spec| replicated(spec) && select(spec.group))
            .during(|| "summing the gradients of the norms over the tensor-parallel group".into())
    }

    /// Whole checkpoint tensors from `tensors`, this member's shards of those of the stages
    /// holding `chunks` (member `seat` of the group), placed together with every other member's.
    pub fn whole_tensors(
        &self,
        config: &ModelConfig,
        seat: TensorSeat,
        chunks: &[Range<usize>],
        tensors: Vec<(String, HostTensor)>,
    ) -> Result<Vec<(String, HostTensor)>, RuntimeError> {
        let members: Vec<HashMap<String, ParamSpec>> = (0..seat.size)
            .map(|member| {
                let seat = TensorSeat { member, ..seat };
                let specs = chunks.iter().flat_map(|layers| seat.stage_params(config, layers.clone()));
                specs.map(|spec| (spec.name.clone(), spec)).collect()
            })
            .collect();
        let mut comm = self.comm();
        let mut whole_tensors = Vec::with_capacity(tensors.len());
        for (name, tensor) in tensors {
            let theirs: Vec<&ParamSpec> = members.iter().map(|specs| &specs[parameter_of(&name)]).collect();
            let counts: Vec<usize> = theirs.iter().map(|spec| spec.numel()).collect();
            let mut parts = vec![0f32; counts.iter().sum()];
            comm.all_gather(&tensor.data, &mut parts, &counts)
                .during(|| format!("gathering the tensor-parallel shards of {name}"))?;
            let full_shape = theirs[0].full_shape().to_vec();
            let mut whole = vec![0f32; full_shape.iter().product()];
            let mut at = 0;
            for (their, count) in theirs.iter().zip(&counts) {
                let shard = their.shard.as_ref().expect("a member's parameters are shards");
                shard.place(&parts[at..at + count], &mut whole);
                at += count;
            }
            whole_tensors.push((name, HostTensor::new(full_shape, whole)));
        }
        Ok(whole_tensors)
    }
}

impl TensorCollectives for TensorGroup {
    fn all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let mut output = vec![0f32; counts.iter().sum()];
        self.run(|comm| comm.all_gather(input, &mut output, counts))
            .map_err(failed("the tensor-parallel group's all-gather of the sequence"))?;
        Ok(output)
    }

    fn reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let member = self.comm().rank();
        let mut output = vec![0f32; counts[member]];
        self.run(|comm| comm.reduce_scatter(input, &mut output, counts, ReduceOp::Sum))
            .map_err(failed("the tensor-parallel group's reduce-scatter of the sequence"))?;
        Ok(output)
    }

    fn all_reduce(&mut self, values: &mut [f32], combine: Combine) -> Result<(), ModelError> {
        let op = match combine {
            Combine::Sum => ReduceOp::Sum,
            Combine::Max => ReduceOp::Max,
        };
        let input = values.to_vec();
        self.run(|comm| comm.all_reduce(&input, values, op))
            .map_err(failed("the tensor-parallel group's all-reduce of the cross-entropy"))
    }
}

/// Sums over `comm` the gradients of the parameters of `stages` that `pick` picks, each
/// member's placed in the whole tensor (a shard among zeros), and keeps each its own part of the
/// sum: the parameters several members of a TP group hold. Every member picks alike, so all or
/// none call the collective.
pub(crate) fn sum_whole_gradients(
    comm: &mut Communicator,
    stages: &mut [StageState],
    pick: impl Fn(&ParamSpec) -> bool + Copy,
) -> Result<(), CommError> {
    let whole = flatten_gradients(stages, pick, true);
    if whole.is_empty() {
        return Ok(());
    }
    let mut summed = vec![0f32; whole.len()];
    comm.all_reduce(&whole, &mut summed, ReduceOp::Sum)?;
    unflatten_gradients(stages, pick, true, &summed);
    Ok(())
}

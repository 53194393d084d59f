//! A tensor-parallel stage's group over the job's communicator: the collectives of its members'
//! passes (each model chunk of the worker holds a handle), the sum of the gradients of
//! parameters several members hold, and the whole tensors a checkpoint writes.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use medley_comm::{CommError, Communicator, ReduceOp};
use medley_model::tensor_parallel::{Combine, TensorCollectives, TensorSeat};
use medley_model::{HostTensor, ModelConfig, ModelError, ParamSpec, StageState};

use crate::RuntimeError;
use crate::error::CommContext;
use crate::long_context::Pacer;

/// One worker's tensor-parallel group, shared by its model chunks.
#[derive(Clone)]
pub(crate) struct TensorGroup {
    comm: Arc<Mutex<Communicator>>,
    /// Paces the passes' computing around the collectives to the emulated device's speed.
    pacer: Pacer,
    /// Bytes the group's collectives have sent, for the worker to report.
    sent: Arc<AtomicU64>,
}

fn failed(what: &'static str) -> impl FnOnce(CommError) -> ModelError {
    move |error| ModelError::Collective { what: what.into(), source: Box::new(error) }
}

impl TensorGroup {
    pub fn new(comm: Communicator, pacer: Pacer, sent: Arc<AtomicU64>) -> TensorGroup {
        TensorGroup { comm: Arc::new(Mutex::new(comm)), pacer, sent }
    }

    fn comm(&self) -> MutexGuard<'_, Communicator> {
        // The chunks run one at a time on the worker's thread; a panic leaves no half-made state.
        self.comm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `collective` on the group's communicator as a pause in the pass's computing.
    fn run<T>(&self, collective: impl FnOnce(&mut Communicator) -> Result<T, CommError>) -> Result<T, CommError> {
        let mut comm = self.comm();
        let result = self.pacer.around(|| collective(&mut comm));
        self.sent.store(comm.bytes_sent(), Ordering::Relaxed);
        result
    }

    /// Sums over the group the gradients of the parameters several members hold (norm gains, KV
    /// heads shared by members), each member's placed in the whole tensor: the same sum on every
    /// member holding them. Megatron-LM all-reduces its sequence-parallel norms' gradients alike.
    pub fn sum_replicated_grads(&self, stages: &mut [StageState]) -> Result<(), RuntimeError> {
        let mut whole = Vec::new();
        for stage in stages.iter_mut() {
            for (spec, grad) in stage.replicated_grads_mut() {
                let shard = spec.shard.as_ref().expect("replicated parameters are shards");
                let at = whole.len();
                whole.resize(at + shard.full_numel(), 0.0);
                shard.place(&grad.data, &mut whole[at..]);
            }
        }
        let mut summed = vec![0f32; whole.len()];
        self.comm()
            .all_reduce(&whole, &mut summed, ReduceOp::Sum)
            .during(|| "summing the gradients of the norms over the tensor-parallel group".into())?;
        let mut at = 0;
        for stage in stages.iter_mut() {
            for (spec, grad) in stage.replicated_grads_mut() {
                let shard = spec.shard.as_ref().expect("replicated parameters are shards");
                grad.data = shard.slice(&summed[at..at + shard.full_numel()]);
                at += shard.full_numel();
            }
        }
        Ok(())
    }

    /// The whole checkpoint tensors of `stages` (one per layer range of `chunks`, held by member
    /// `seat` of the group), placed together from every member's shards, in the order
    /// [`StageState::checkpoint_tensors`] lists them.
    pub fn whole_tensors(
        &self,
        config: &ModelConfig,
        seat: TensorSeat,
        chunks: &[Range<usize>],
        stages: &[StageState],
    ) -> Result<Vec<(String, HostTensor)>, RuntimeError> {
        let mut comm = self.comm();
        let mut tensors = Vec::new();
        for (layers, stage) in chunks.iter().zip(stages) {
            let members: Vec<Vec<ParamSpec>> = (0..seat.size)
                .map(|member| TensorSeat { member, ..seat }.stage_params(config, layers.clone()))
                .collect();
            for (idx, (name, tensor, spec)) in stage.checkpoint_entries().into_iter().enumerate() {
                let theirs: Vec<&ParamSpec> = members.iter().map(|specs| &specs[idx % specs.len()]).collect();
                let counts: Vec<usize> = theirs.iter().map(|spec| spec.numel()).collect();
                let mut parts = vec![0f32; counts.iter().sum()];
                comm.all_gather(&tensor.data, &mut parts, &counts)
                    .during(|| format!("gathering the tensor-parallel shards of {name}"))?;
                let mut whole = vec![0f32; spec.full_shape().iter().product()];
                let mut at = 0;
                for (their, count) in theirs.iter().zip(&counts) {
                    their
                        .shard
                        .as_ref()
                        .expect("a member's parameters are shards")
                        .place(&parts[at..at + count], &mut whole);
                    at += count;
                }
                tensors.push((name, HostTensor::new(spec.full_shape().to_vec(), whole)));
            }
        }
        Ok(tensors)
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

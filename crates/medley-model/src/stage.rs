//! One rank's share of the model on the host: parameters, accumulated gradients and optimizer
//! state, driving a [`StageCompute`].

use std::ops::Range;

use crate::params::{ParamGroup, ParamSpec, stage_params};
use crate::{
    AdamW, AdamWState, HostTensor, MicroBatch, ModelConfig, ModelError, Moments, NamedTensors, StageCompute,
    StageOutput,
};

/// Checkpoint names of the optimizer moments: `adamw.m.<param>` and `adamw.v.<param>`.
pub const MOMENT_PREFIXES: [&str; 2] = ["adamw.m.", "adamw.v."];

/// The parameter a checkpoint tensor belongs to: its own name, or its moment's.
pub fn parameter_of(checkpoint_name: &str) -> &str {
    MOMENT_PREFIXES.iter().find_map(|prefix| checkpoint_name.strip_prefix(prefix)).unwrap_or(checkpoint_name)
}

/// The training state of one stage's (or chunk's) layers: what a plan's `Stage` places on its
/// devices, here with its weights.
pub struct StageState {
    specs: Vec<ParamSpec>,
    params: Vec<HostTensor>,
    grads: Vec<HostTensor>,
    optimizer: AdamWState,
    /// Parameters whose optimizer moments another owner holds and updates (ZeRO-1 shards them
    /// over the data-parallel group); their moments here are empty.
    moments_elsewhere: Vec<bool>,
    compute: Box<dyn StageCompute>,
}

impl StageState {
    /// The stage holding `layers`, at its seeded initial weights.
    pub fn new(
        config: &ModelConfig,
        layers: Range<usize>,
        seed: u64,
        compute: Box<dyn StageCompute>,
    ) -> Result<Self, ModelError> {
        StageState::with_specs(stage_params(config, layers), seed, compute)
    }

    /// The stage holding the parameters `specs` (a tensor-parallel member's shards), at their
    /// seeded initial weights.
    pub fn with_specs(
        specs: Vec<ParamSpec>,
        seed: u64,
        mut compute: Box<dyn StageCompute>,
    ) -> Result<Self, ModelError> {
        let params: Vec<HostTensor> = specs.iter().map(|spec| spec.initial_value(seed)).collect();
        compute.load_parameters(&params)?;
        let grads = params.iter().map(|p| HostTensor::zeros(p.shape.clone())).collect();
        let optimizer = AdamWState::zeros_like(&params);
        let moments_elsewhere = vec![false; params.len()];
        Ok(StageState { specs, params, grads, optimizer, moments_elsewhere, compute })
    }

    pub fn params(&self) -> &[HostTensor] {
        &self.params
    }

    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Gradients summed over the micro-batches since the last optimizer step.
    pub fn grads(&self) -> &[HostTensor] {
        &self.grads
    }

    pub fn optimizer_step_count(&self) -> u64 {
        self.optimizer.step
    }

    pub fn forward(
        &mut self,
        micro_batch: u32,
        batch: &MicroBatch,
        input: Option<HostTensor>,
    ) -> Result<StageOutput, ModelError> {
        self.compute.forward(micro_batch, batch, input)
    }

    pub fn backward(
        &mut self,
        micro_batch: u32,
        upstream: Option<HostTensor>,
    ) -> Result<Option<HostTensor>, ModelError> {
        self.compute.backward(micro_batch, upstream, &mut self.grads)
    }

    /// The gradients of the parameters `select` picks, with their specs.
    pub fn grads_with_specs_mut(
        &mut self,
        select: impl Fn(&ParamSpec) -> bool,
    ) -> impl Iterator<Item = (&ParamSpec, &mut HostTensor)> {
        self.specs.iter().zip(self.grads.iter_mut()).filter(move |(spec, _)| select(spec))
    }

    /// The parameters in `groups` with their specs, for an owner of their optimizer states.
    pub fn params_of_mut(
        &mut self,
        select: impl Fn(ParamGroup) -> bool,
    ) -> impl Iterator<Item = (&ParamSpec, &mut HostTensor)> {
        self.specs.iter().zip(self.params.iter_mut()).filter(move |(spec, _)| select(spec.group))
    }

    /// Hands the optimizer moments of the parameters in `groups` to another owner, which updates
    /// those parameters from then on: their moments `(m, v)`, in canonical order.
    pub fn release_moments(&mut self, select: impl Fn(ParamGroup) -> bool) -> Vec<(HostTensor, HostTensor)> {
        let mut released = Vec::new();
        for idx in (0..self.specs.len()).filter(|&idx| select(self.specs[idx].group)) {
            self.moments_elsewhere[idx] = true;
            let empty = || HostTensor::zeros(vec![0]);
            let m = std::mem::replace(&mut self.optimizer.m[idx], empty());
            let v = std::mem::replace(&mut self.optimizer.v[idx], empty());
            released.push((m, v));
        }
        released
    }

    /// Applies AdamW to the accumulated gradients of the parameters whose moments it holds,
    /// zeroes every gradient and hands the new weights (the others' as their owner left them)
    /// to the compute library.
    pub fn optimizer_step(&mut self, adamw: &AdamW) -> Result<(), ModelError> {
        self.optimizer.step += 1;
        for (idx, param) in self.params.iter_mut().enumerate().filter(|(idx, _)| !self.moments_elsewhere[*idx]) {
            let moments = Moments { m: &mut self.optimizer.m[idx].data, v: &mut self.optimizer.v[idx].data };
            adamw.update_slice(
                self.optimizer.step,
                &mut param.data,
                &self.grads[idx].data,
                moments,
                self.specs[idx].decays(),
            );
        }
        self.grads.iter_mut().for_each(|grad| grad.data.fill(0.0));
        self.compute.load_parameters(&self.params)
    }

    /// Every tensor a checkpoint of this stage holds: parameters under their names, then the
    /// optimizer moments (a tensor-parallel member's shards of them).
    pub fn checkpoint_tensors(&self) -> Vec<(String, &HostTensor)> {
        self.checkpoint_entries().into_iter().map(|(name, tensor, _)| (name, tensor)).collect()
    }

    /// [`Self::checkpoint_tensors`] with the spec of the parameter each belongs to.
    pub fn checkpoint_entries(&self) -> Vec<(String, &HostTensor, &ParamSpec)> {
        let params = self.specs.iter().zip(&self.params).map(|(spec, p)| (spec.name.clone(), p, spec));
        let moments =
            MOMENT_PREFIXES.iter().zip([&self.optimizer.m, &self.optimizer.v]).flat_map(|(prefix, moments)| {
                self.specs.iter().zip(moments.iter()).map(move |(spec, m)| (format!("{prefix}{}", spec.name), m, spec))
            });
        params.chain(moments).collect()
    }

    /// Whether `name` is one of the checkpoint tensors [`StageState::restore`] takes.
    pub fn restores(&self, name: &str) -> bool {
        self.specs.iter().any(|spec| spec.name == parameter_of(name))
    }

    /// Restores this stage's parameters and optimizer state from checkpoint tensors by name, from
    /// however many stage files they came, each whole: a checkpoint taken under another plan
    /// re-shards here, a tensor-parallel member taking its shard.
    pub fn restore(&mut self, tensors: &NamedTensors, optimizer_steps: u64) -> Result<(), ModelError> {
        let find = |name: String, spec: &ParamSpec| -> Result<HostTensor, ModelError> {
            let tensor = tensors.get(&name).ok_or_else(|| ModelError::MissingTensor { name: name.clone() })?;
            tensor.expect_shape(&name, spec.full_shape())?;
            Ok(match &spec.shard {
                Some(shard) => HostTensor::new(spec.shape.clone(), shard.slice(&tensor.data)),
                None => tensor.clone(),
            })
        };
        let mut state = AdamWState { step: optimizer_steps, m: Vec::new(), v: Vec::new() };
        let mut params = Vec::new();
        for spec in &self.specs {
            params.push(find(spec.name.clone(), spec)?);
            state.m.push(find(format!("{}{}", MOMENT_PREFIXES[0], spec.name), spec)?);
            state.v.push(find(format!("{}{}", MOMENT_PREFIXES[1], spec.name), spec)?);
        }
        self.compute.load_parameters(&params)?;
        self.params = params;
        self.optimizer = state;
        self.moments_elsewhere.fill(false);
        self.grads.iter_mut().for_each(|grad| grad.data.fill(0.0));
        Ok(())
    }
}

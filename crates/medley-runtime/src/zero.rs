//! ZeRO-1, Megatron-LM's distributed optimizer, over one data-parallel group: the group's
//! gradients are reduce-scattered, each member updates its run of the group's flattened
//! parameters with the AdamW moments only it holds, and the parameters are all-gathered. The runs
//! split the flattened parameters evenly over the members, whatever their batch shares or
//! devices: the split the cost model prices ([`medley_plan::state_shards`]).

use std::ops::Range;

use medley_comm::Communicator;
use medley_model::params::ParamGroup;
use medley_model::tensor_parallel::even_run;
use medley_model::{AdamW, HostTensor, Moments, StageState};

use crate::RuntimeError;
use crate::error::CommContext;
use crate::reduction::{Keep, overlap};

/// One member's share of a data-parallel group's optimizer states.
pub(crate) struct ZeroShard {
    /// Every member's run length of the group's flattened parameters, in member order.
    counts: Vec<usize>,
    /// This member's run.
    run: Range<usize>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// This member's run of the summed gradients, from the last reduction.
    grads: Vec<f32>,
}

/// The parameters of `stages` that `select` picks, flattened in canonical order: each one's
/// offset in the flattened parameters, with its tensor.
fn flattened<'a>(
    stages: &'a mut [StageState],
    select: &'a impl Fn(ParamGroup) -> bool,
) -> impl Iterator<Item = (usize, bool, &'a mut HostTensor)> {
    let mut offset = 0;
    stages.iter_mut().flat_map(move |stage| stage.params_of_mut(select)).map(move |(spec, param)| {
        let at = offset;
        offset += param.data.len();
        (at, spec.decays(), param)
    })
}

impl ZeroShard {
    /// Takes over the moments of the parameters of `stages` that `select` picks, keeping member
    /// `member`'s run of them among `members`.
    pub fn take(
        stages: &mut [StageState],
        select: impl Fn(ParamGroup) -> bool,
        member: usize,
        members: usize,
    ) -> ZeroShard {
        let released: Vec<(HostTensor, HostTensor)> =
            stages.iter_mut().flat_map(|stage| stage.release_moments(&select)).collect();
        let total = released.iter().map(|(m, _)| m.data.len()).sum();
        let run = even_run(total, member, members);
        let flat = |moment: fn(&(HostTensor, HostTensor)) -> &HostTensor| -> Vec<f32> {
            released.iter().flat_map(|pair| &moment(pair).data).skip(run.start).take(run.len()).copied().collect()
        };
        let (m, v) = (flat(|pair| &pair.0), flat(|pair| &pair.1));
        let counts = (0..members).map(|other| even_run(total, other, members).len()).collect();
        ZeroShard { counts, grads: vec![0.0; run.len()], run, m, v }
    }

    /// What this member keeps of its group's gradient sum: its run, into the buffer of the last
    /// one's (until [`Self::set_gradients`] gives it back).
    pub fn keep(&mut self) -> Keep {
        let mut at = 0;
        let runs = self
            .counts
            .iter()
            .map(|&count| {
                at += count;
                at - count..at
            })
            .collect::<Vec<_>>();
        let member = runs.iter().position(|run| *run == self.run).expect("the member's run is among the group's");
        Keep::Run { runs, member, buffer: std::mem::take(&mut self.grads) }
    }

    /// Takes this member's run of the summed gradients, from a reduction that kept [`Self::keep`].
    pub fn set_gradients(&mut self, run: Vec<f32>) {
        debug_assert_eq!(run.len(), self.run.len());
        self.grads = run;
    }

    /// Update number `step` of this member's run of the parameters, then every member's run
    /// all-gathered into every member's parameters.
    pub fn step(
        &mut self,
        stages: &mut [StageState],
        select: impl Fn(ParamGroup) -> bool,
        adamw: &AdamW,
        step: u64,
        comm: &mut Communicator,
    ) -> Result<(), RuntimeError> {
        let mut mine = Vec::with_capacity(self.run.len());
        for (offset, decays, param) in flattened(stages, &select) {
            let Some((in_param, in_run)) = overlap(&self.run, offset, param.data.len()) else { continue };
            let moments = Moments { m: &mut self.m[in_run.clone()], v: &mut self.v[in_run.clone()] };
            adamw.update_slice(step, &mut param.data[in_param.clone()], &self.grads[in_run], moments, decays);
            mine.extend_from_slice(&param.data[in_param]);
        }
        let mut all = vec![0f32; self.counts.iter().sum()];
        comm.all_gather(&mine, &mut all, &self.counts)
            .during(|| "all-gathering the updated parameters over the data-parallel group (ZeRO-1)".into())?;
        for (offset, _, param) in flattened(stages, &select) {
            let len = param.data.len();
            param.data.copy_from_slice(&all[offset..offset + len]);
        }
        Ok(())
    }

    /// The whole moments `(m, v)` of the parameters `select` picks, in canonical order, gathered
    /// from every member's run (for a checkpoint).
    pub fn whole_moments(
        &self,
        stages: &[StageState],
        select: impl Fn(ParamGroup) -> bool,
        comm: &mut Communicator,
    ) -> Result<Vec<(HostTensor, HostTensor)>, RuntimeError> {
        let mut gather = |mine: &[f32]| -> Result<Vec<f32>, RuntimeError> {
            let mut all = vec![0f32; self.counts.iter().sum()];
            comm.all_gather(mine, &mut all, &self.counts)
                .during(|| "gathering the optimizer states of the data-parallel group (ZeRO-1)".into())?;
            Ok(all)
        };
        let (m, v) = (gather(&self.m)?, gather(&self.v)?);
        let specs = stages.iter().flat_map(|stage| stage.specs()).filter(|spec| select(spec.group));
        let mut offset = 0;
        Ok(specs
            .map(|spec| {
                let run = offset..offset + spec.numel();
                offset = run.end;
                let part = |all: &[f32]| HostTensor::new(spec.shape.clone(), all[run.clone()].to_vec());
                (part(&m), part(&v))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_overlaps_the_tensors_it_spans() {
        let run = 5..12;
        assert_eq!(overlap(&run, 0, 5), None);
        assert_eq!(overlap(&run, 0, 8), Some((5..8, 0..3)));
        assert_eq!(overlap(&run, 8, 10), Some((0..4, 3..7)));
        assert_eq!(overlap(&run, 12, 3), None);
    }
}

//! A replica's pipeline geometry: which virtual stage each rank's chunks run, who its
//! neighbours are, and which data-parallel groups it synchronises.

use medley_plan::{Plan, Replica};
use medley_spec::ScheduleKind;

use crate::error::ScheduleError;
use crate::program::RankId;

/// Whether `schedule` runs `plan`'s chunks per rank.
pub(crate) fn check_chunks(plan: &Plan, schedule: ScheduleKind) -> Result<(), ScheduleError> {
    if schedule.runs_chunks(plan.virtual_stages()) {
        Ok(())
    } else {
        Err(ScheduleError::ChunkMismatch { schedule, virtual_stages: plan.virtual_stages() })
    }
}

/// A replica's pipeline as ranks and chunks: virtual stage j = chunk·p + rank, so chunk c of
/// rank i feeds chunk c of rank i + 1, and the last rank's chunk c feeds rank 0's chunk c + 1.
#[derive(Clone, Copy, Debug)]
pub(crate) struct VirtualPipeline {
    pub n_ranks: usize,
    pub n_chunks: u32,
}

impl VirtualPipeline {
    pub fn of(plan: &Plan, replica: &Replica) -> Self {
        VirtualPipeline { n_ranks: plan.n_ranks(replica), n_chunks: plan.virtual_stages() }
    }

    /// The virtual stage chunk `chunk` of rank `rank_idx` runs.
    pub fn stage_idx(self, rank_idx: usize, chunk: u32) -> usize {
        chunk as usize * self.n_ranks + rank_idx
    }

    /// The (rank, chunk) running virtual stage `stage_idx`, if the pipeline has it.
    fn position(self, stage_idx: usize) -> Option<(usize, u32)> {
        (stage_idx < self.n_ranks * self.n_chunks as usize)
            .then(|| (stage_idx % self.n_ranks, (stage_idx / self.n_ranks) as u32))
    }

    /// Who feeds rank `rank_idx`'s chunk `chunk` its activations.
    pub fn previous(self, rank_idx: usize, chunk: u32) -> Option<(usize, u32)> {
        self.stage_idx(rank_idx, chunk).checked_sub(1).and_then(|stage_idx| self.position(stage_idx))
    }

    /// Who rank `rank_idx`'s chunk `chunk` feeds its activations.
    pub fn next(self, rank_idx: usize, chunk: u32) -> Option<(usize, u32)> {
        self.position(self.stage_idx(rank_idx, chunk) + 1)
    }
}

/// The data-parallel groups whose layers rank `rank` holds in any of its chunks, ascending.
pub(crate) fn rank_dp_groups(plan: &Plan, rank: RankId) -> Vec<u32> {
    (0..plan.dp_groups().len() as u32).filter(|&dp_group| dp_group_chunk(plan, rank, dp_group).is_some()).collect()
}

/// The chunk of rank `rank` that holds data-parallel group `dp_group`'s layers, if any does.
pub(crate) fn dp_group_chunk(plan: &Plan, rank: RankId, dp_group: u32) -> Option<u32> {
    let replica = &plan.replicas()[rank.replica as usize];
    let layers = plan.dp_groups().get(dp_group as usize)?.layers;
    let mut chunks = replica.stages.iter().skip(rank.pp_rank as usize).step_by(plan.n_ranks(replica));
    chunks.position(|stage| stage.layers.contains(layers)).map(|chunk| chunk as u32)
}

//! A replica's pipeline geometry: which virtual stage each rank's chunks run, who its
//! neighbours are, and which data-parallel groups it synchronises.

use medley_plan::{Plan, Replica};
use medley_spec::ScheduleKind;

use crate::error::ScheduleError;

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

/// A replica's geometry, computed once for all its ranks: its pipeline, and for each rank the
/// data-parallel groups whose layers it holds, ascending, each with the chunk that holds them.
#[derive(Clone, Debug)]
pub(crate) struct ReplicaGeometry {
    pub pipeline: VirtualPipeline,
    rank_groups: Vec<Vec<(u32, u32)>>,
}

impl ReplicaGeometry {
    pub fn of(plan: &Plan, replica: &Replica) -> Self {
        let pipeline = VirtualPipeline::of(plan, replica);
        let mut rank_groups = vec![Vec::new(); pipeline.n_ranks];
        for (dp_group, group) in plan.dp_groups().iter().enumerate() {
            // The first stage holding the group's layers, as a rank and chunk.
            if let Some(stage_idx) = replica.stages.iter().position(|stage| stage.layers.contains(group.layers)) {
                let (rank_idx, chunk) = (stage_idx % pipeline.n_ranks, (stage_idx / pipeline.n_ranks) as u32);
                rank_groups[rank_idx].push((dp_group as u32, chunk));
            }
        }
        ReplicaGeometry { pipeline, rank_groups }
    }

    /// Rank `rank_idx`'s data-parallel groups, ascending, each with the chunk holding its layers.
    pub fn groups(&self, rank_idx: usize) -> &[(u32, u32)] {
        &self.rank_groups[rank_idx]
    }

    /// The chunk of rank `rank_idx` that holds data-parallel group `dp_group`'s layers, if any.
    pub fn group_chunk(&self, rank_idx: usize, dp_group: u32) -> Option<u32> {
        self.groups(rank_idx).iter().find(|&&(group, _)| group == dp_group).map(|&(_, chunk)| chunk)
    }
}

//! A worker's communicators for its groups, split from the job's: one per data-parallel group
//! it belongs to, a long-context stage's head groups and lanes, and a tensor-parallel stage's
//! group.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use medley_comm::Communicator;
use medley_plan::Plan;

use crate::emulation::Pacer;
use crate::error::CommContext;
use crate::layout::mixed_tp_groups;
use crate::long_context::CommCollectives;
use crate::tensor_parallel::TensorGroup;
use crate::{RankLayout, RuntimeError};

/// One communicator per DP group: every worker of the stage of each replica that holds the
/// group's layers (a long-context stage's devices each hold the whole stage; a tensor-parallel
/// stage's members split by their shard, each with the members holding the same), in job-rank
/// order; none for a group of one worker. Every rank takes part in every split.
pub(crate) fn split_dp_groups(
    plan: &Plan,
    layouts: &[RankLayout],
    layout: &RankLayout,
    world: &mut Communicator,
) -> Result<Vec<Option<Communicator>>, RuntimeError> {
    let holds = |group_idx: usize, worker: &RankLayout| {
        let holder = plan.holders(group_idx)[worker.id.replica as usize];
        let replica = &plan.replicas()[worker.id.replica as usize];
        plan.rank_of(replica, holder) == worker.id.pp_rank as usize
    };
    let mixed_tp = mixed_tp_groups(plan);
    let mut communicators = Vec::new();
    for (group_idx, group) in plan.dp_groups().iter().enumerate() {
        // Holders of different TP degrees reduce whole tensors together (see
        // [`mixed_tp_groups`]), holders of one each shard with the members holding the same.
        let mixed = mixed_tp[group_idx];
        let shard = |worker: &RankLayout| if mixed { 0 } else { worker.tensor.map_or(0, |seat| seat.member as u32) };
        if layouts.iter().filter(|worker| holds(group_idx, worker) && shard(worker) == 0).count() < 2 {
            communicators.push(None);
            continue;
        }
        let color = holds(group_idx, layout).then_some(shard(layout));
        let communicator = world
            .split(color, layout.job_rank as i64)
            .during(|| format!("forming the data-parallel group of layers {}", group.layers))?;
        communicators.push(communicator);
    }
    Ok(communicators)
}

/// A long-context worker's head-group and lane communicators; none for other workers. Every
/// rank takes part in both splits.
pub(crate) fn split_context_groups(
    layouts: &[RankLayout],
    layout: &RankLayout,
    world: &mut Communicator,
    pacer: Option<Pacer>,
    sent: Arc<AtomicU64>,
) -> Result<Option<CommCollectives>, RuntimeError> {
    let seat = layout.context.as_ref();
    // Colours name a group and a lane by a job rank of theirs: the rank's first worker's, plus
    // the group's first member or the lane's member.
    let first = layouts.iter().position(|other| other.id == layout.id).unwrap_or(layout.job_rank);
    let place = seat.map(|seat| seat.placement.group_and_member());
    let size = seat.map_or(1, |seat| seat.placement.group_size());
    let group_color = place.map(|(group, _)| (first + group * size) as u32);
    let lane_color = place.map(|(_, member)| (first + member) as u32);
    let (group_key, lane_key) = place.map_or((0, 0), |(group, member)| (member as i64, group as i64));
    let group = world.split(group_color, group_key).during(|| "forming the head-parallel groups".into())?;
    let lane = world.split(lane_color, lane_key).during(|| "forming the context-parallel lanes".into())?;
    Ok(group.zip(lane).zip(pacer).map(|((group, lane), pacer)| CommCollectives { group, lane, pacer, sent }))
}

/// A tensor-parallel worker's group: its stage's members, in member order; none for other
/// workers. Every rank takes part in the split.
pub(crate) fn split_tensor_group(
    layouts: &[RankLayout],
    layout: &RankLayout,
    world: &mut Communicator,
    pacer: Option<Pacer>,
) -> Result<Option<TensorGroup>, RuntimeError> {
    // A group is named by its first member's job rank.
    let first = layouts.iter().position(|other| other.id == layout.id).unwrap_or(layout.job_rank);
    let color = layout.tensor.map(|_| first as u32);
    let key = layout.tensor.map_or(0, |seat| seat.member as i64);
    let comm = world.split(color, key).during(|| "forming the tensor-parallel groups".into())?;
    Ok(comm.zip(pacer).map(|(comm, pacer)| TensorGroup::new(comm, pacer)))
}

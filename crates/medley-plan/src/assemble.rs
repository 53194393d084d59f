//! Turns a layout (which devices hold which layers, and batch shares) into a complete Plan by
//! choosing the cheapest route for every pipeline boundary and gradient group.

use medley_cost::{CostModel, Setting};
use medley_spec::{Cluster, DeviceSlot, JobSpec, Schedule, Vendor};

use crate::evaluate::{best_boundary_route, best_dp_route, dp_group_bytes};
use crate::layers::LayerRange;
use std::collections::BTreeSet;

use crate::plan::{
    DpGroup, PLAN_VERSION_PER_STAGE_TP, PLAN_VERSION_WITHOUT_CONTEXT, PlanParts, Replica, Stage, dp_layer_ranges,
};

/// One replica before routing: its batch share and its (virtual) stages in model order.
pub struct ReplicaLayout {
    pub n_micro_batches: u32,
    pub stages: Vec<Stage>,
}

/// Stages holding `counts[i]` consecutive layers on `device_groups[i]`.
pub fn stages_from_counts(device_groups: Vec<Vec<u32>>, counts: &[u32]) -> Vec<Stage> {
    let mut start = 0;
    device_groups
        .into_iter()
        .zip(counts)
        .map(|(devices, &count)| {
            let layers = LayerRange { start, end: start + count };
            start += count;
            Stage { devices, layers, context: None }
        })
        .collect()
}

/// The parts of the plan of `layouts` with `schedule` over `virtual_stages` chunks per rank, each
/// boundary's and data-parallel group's route chosen; [`Plan::new`](crate::Plan::new) makes them a plan.
/// Each stage's TP degree is its device count (`setting`'s micro-batch and recomputation are
/// every stage's); stages that differ make a version 3 plan.
pub fn assemble(
    cluster: &Cluster,
    cost: &CostModel,
    job: &JobSpec,
    setting: Setting,
    schedule: Schedule,
    virtual_stages: u32,
    layouts: Vec<ReplicaLayout>,
) -> PlanParts {
    let slots = cluster.devices();
    let vendor_of = |stage: &Stage| -> (DeviceSlot, Vendor) {
        let slot = slots[stage.devices[0] as usize];
        (slot, cluster.groups()[slot.group_idx].device.vendor)
    };
    // A long-context stage's devices split each sequence: TP 1.
    let tp_of = |stage: &Stage| if stage.context.is_some() { 1 } else { stage.devices.len() as u32 };
    // Sequence parallelism splits a boundary's activations over the smaller group's members.
    let boundary_bytes =
        |pair: &[Stage]| cost.boundary_bytes(Setting { tp: tp_of(&pair[0]).min(tp_of(&pair[1])), ..setting });
    let replicas: Vec<Replica> = layouts
        .into_iter()
        .map(|layout| Replica {
            n_micro_batches: layout.n_micro_batches,
            boundaries: layout
                .stages
                .windows(2)
                .map(|pair| {
                    best_boundary_route(cluster, vendor_of(&pair[0]), vendor_of(&pair[1]), boundary_bytes(pair))
                })
                .collect(),
            stages: layout.stages,
        })
        .collect();
    let dp_groups = dp_layer_ranges(&replicas)
        .into_iter()
        .map(|layers| {
            let holders: Vec<&Stage> = replicas
                .iter()
                .map(|replica| replica.stages.iter().find(|stage| stage.layers.contains(layers)).expect("ranges cover"))
                .collect();
            let members: Vec<(DeviceSlot, Vendor)> = holders.iter().map(|stage| vendor_of(stage)).collect();
            // A holder of a smaller TP degree holds the larger shard.
            let tp = holders.iter().map(|stage| tp_of(stage)).min().unwrap_or(1);
            let bytes = dp_group_bytes(cost, tp, layers, job.grad_reduce());
            let (route, algorithm) = best_dp_route(cluster, &members, bytes);
            DpGroup { layers, route, algorithm }
        })
        .collect();
    let degrees: BTreeSet<u32> = replicas.iter().flat_map(|replica| replica.stages.iter().map(tp_of)).collect();
    let version = if degrees.len() > 1 { PLAN_VERSION_PER_STAGE_TP } else { PLAN_VERSION_WITHOUT_CONTEXT };
    PlanParts {
        version,
        cluster: cluster.clone(),
        model: cost.model().clone(),
        seq_len: cost.seq_len(),
        global_batch: job.global_batch(),
        micro_batch: setting.micro_batch,
        schedule,
        recompute: setting.recompute,
        attention: job.attention(),
        overlap_grad_reduce: job.overlap_grad_reduce(),
        zero1: job.zero1(),
        shard_gradients: job.shard_gradients(),
        precision: job.precision(),
        grad_reduce: job.grad_reduce(),
        memory_headroom: job.memory_headroom(),
        tp: degrees.last().copied().unwrap_or(setting.tp),
        virtual_stages,
        replicas,
        dp_groups,
    }
}

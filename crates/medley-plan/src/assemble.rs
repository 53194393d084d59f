//! Turns a layout (which devices hold which layers, and batch shares) into a complete Plan by
//! choosing the cheapest route for every pipeline boundary and gradient group.

use medley_cost::{CostModel, Setting};
use medley_spec::{Cluster, DeviceSlot, JobSpec, Schedule, Vendor};

use crate::evaluate::{best_boundary_route, best_dp_route, dp_group_bytes};
use crate::layers::LayerRange;
use crate::plan::{DpGroup, PLAN_VERSION_WITHOUT_CONTEXT, PlanParts, Replica, Stage, dp_layer_ranges};

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
    let boundary_bytes = cost.boundary_bytes(setting);
    let replicas: Vec<Replica> = layouts
        .into_iter()
        .map(|layout| Replica {
            n_micro_batches: layout.n_micro_batches,
            boundaries: layout
                .stages
                .windows(2)
                .map(|pair| best_boundary_route(cluster, vendor_of(&pair[0]), vendor_of(&pair[1]), boundary_bytes))
                .collect(),
            stages: layout.stages,
        })
        .collect();
    let dp_groups = dp_layer_ranges(&replicas)
        .into_iter()
        .map(|layers| {
            let members: Vec<(DeviceSlot, Vendor)> = replicas
                .iter()
                .map(|replica| {
                    let stage =
                        replica.stages.iter().find(|stage| stage.layers.contains(layers)).expect("ranges cover");
                    vendor_of(stage)
                })
                .collect();
            let bytes = dp_group_bytes(cost, setting.tp, layers, job.grad_reduce());
            let (route, algorithm) = best_dp_route(cluster, &members, bytes);
            DpGroup { layers, route, algorithm }
        })
        .collect();
    PlanParts {
        version: PLAN_VERSION_WITHOUT_CONTEXT,
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
        tp: setting.tp,
        virtual_stages,
        replicas,
        dp_groups,
    }
}

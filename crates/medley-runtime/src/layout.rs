//! Where each worker stands in a plan: its pipeline rank, the layers of its model chunks, and the
//! device it stands in for.

use std::ops::Range;

use medley_cost::{Calibration, CostModel, Setting};
use medley_plan::Plan;
use medley_schedule::RankId;
use medley_spec::{Recompute, Vendor};

use crate::RuntimeError;

/// The device a worker stands in for. Speeds are emulated: every worker computes on this
/// machine's CPU, and a slower device's passes are stretched by `slowdown`.
#[derive(Clone, Debug, PartialEq)]
pub struct EmulatedDevice {
    /// The catalog device, e.g. `H100-SXM`.
    pub name: String,
    pub vendor: Vendor,
    /// Pass time relative to the cluster's fastest device type, which an emulation profile
    /// prices at this machine's speed (1 for the fastest).
    pub slowdown: f64,
}

/// One worker's share of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct RankLayout {
    pub id: RankId,
    pub job_rank: usize,
    /// Physical pipeline ranks in this worker's replica, p.
    pub n_pipeline_ranks: usize,
    /// The layers of each model chunk; chunk c is the replica's virtual stage c·p + stage.
    pub chunks: Vec<Range<usize>>,
    pub device: EmulatedDevice,
}

/// The pipeline ranks of a plan in job-rank order: replica by replica, stage by stage (the order
/// of the schedule crate's programs).
pub fn rank_ids(plan: &Plan) -> Vec<RankId> {
    plan.replicas()
        .iter()
        .enumerate()
        .flat_map(|(replica_idx, replica)| (0..plan.n_ranks(replica)).map(move |stage| RankId::new(replica_idx, stage)))
        .collect()
}

/// Checks what the runtime supports: one process per pipeline rank, so no tensor, context or
/// head parallelism.
pub fn check_runnable(plan: &Plan) -> Result<(), RuntimeError> {
    if plan.has_context() {
        return Err(RuntimeError::Unsupported(
            "context and head parallelism (a stage with `context`) are not implemented in the runtime yet".into(),
        ));
    }
    if plan.tp() != 1 {
        return Err(RuntimeError::Unsupported(format!(
            "tensor parallelism (tp = {}) is not implemented in the runtime; plan with one GPU per node (`medley train --fleet ...` does) or fix tp=1",
            plan.tp()
        )));
    }
    Ok(())
}

impl RankLayout {
    /// Every worker's layout, in job-rank order, each device slowed down as the cost model (with
    /// `calibration`) prices it against the cluster's fastest device type.
    pub fn all(plan: &Plan, calibration: &Calibration) -> Result<Vec<RankLayout>, RuntimeError> {
        check_runnable(plan)?;
        let fastest_s = fastest_pass_time_s(plan, calibration);
        let layouts = rank_ids(plan).into_iter().enumerate().map(|(job_rank, id)| {
            let replica = &plan.replicas()[id.replica as usize];
            let p = plan.n_ranks(replica);
            let chunks: Vec<Range<usize>> = (id.pp_rank as usize..replica.stages.len())
                .step_by(p)
                .map(|virtual_stage| {
                    let layers = replica.stages[virtual_stage].layers;
                    layers.start as usize..layers.end as usize
                })
                .collect();
            let group = plan.stage_group(&replica.stages[id.pp_rank as usize]);
            let slowdown = pass_time_s(plan, group, calibration) / fastest_s;
            let device = EmulatedDevice { name: group.device.name.clone(), vendor: group.device.vendor, slowdown };
            RankLayout { id, job_rank, n_pipeline_ranks: p, chunks, device }
        });
        Ok(layouts.collect())
    }

    /// Whether chunk `chunk` is the replica's first virtual stage (it embeds tokens).
    pub fn is_first(&self, chunk: u32) -> bool {
        chunk == 0 && self.id.pp_rank == 0
    }

    /// Whether chunk `chunk` is the replica's last virtual stage (it computes the loss).
    pub fn is_last(&self, chunk: u32) -> bool {
        chunk as usize + 1 == self.chunks.len() && self.id.pp_rank as usize + 1 == self.n_pipeline_ranks
    }

    /// The sending chunk of the activations chunk `chunk` consumes (the previous virtual stage).
    pub fn input_sender_chunk(&self, chunk: u32) -> u32 {
        if self.id.pp_rank == 0 { chunk - 1 } else { chunk }
    }

    /// The sending chunk of the gradient chunk `chunk`'s backward consumes (the next virtual stage).
    pub fn gradient_sender_chunk(&self, chunk: u32) -> u32 {
        if self.id.pp_rank as usize + 1 == self.n_pipeline_ranks { chunk + 1 } else { chunk }
    }
}

/// One layer's forward and backward on `group`'s device at the plan's micro-batch.
fn pass_time_s(plan: &Plan, group: &medley_spec::NodeGroup, calibration: &Calibration) -> f64 {
    let setting = Setting { micro_batch: plan.micro_batch(), tp: 1, recompute: Recompute::None };
    CostModel::new(plan.model(), plan.seq_len(), calibration).layer_time(group, setting).total_s()
}

fn fastest_pass_time_s(plan: &Plan, calibration: &Calibration) -> f64 {
    plan.cluster().groups().iter().map(|group| pass_time_s(plan, group, calibration)).fold(f64::INFINITY, f64::min)
}

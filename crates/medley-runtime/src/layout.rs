//! Where each worker stands in a plan: its pipeline rank, the layers of its model chunks, and the
//! device it stands in for.

use std::ops::Range;

use medley_cost::long_context::KvExchange;
use medley_cost::{Calibration, CostModel, Setting};
use medley_model::ModelConfig;
use medley_model::long_context::{ContextGroup, ContextPlacement};
use medley_model::tensor_parallel::{TensorSeat, even_run};
use medley_plan::{Plan, Stage, StageContext};
use medley_schedule::RankId;
use medley_spec::{GradReduce, Recompute, Vendor};

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
    /// On a long-context stage, the worker's device among the stage's and its place in the
    /// split of the sequence; one worker per device.
    pub context: Option<ContextSeat>,
    /// On a tensor-parallel stage, the worker's device in the stage's group; one worker per
    /// device.
    pub tensor: Option<TensorSeat>,
}

/// A worker of a long-context stage.
#[derive(Clone, Debug, PartialEq)]
pub struct ContextSeat {
    /// The device's index among its stage's devices.
    pub device_index: usize,
    pub placement: ContextPlacement,
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

/// The workers a plan runs on, in job-rank order: each pipeline rank's, one per device of a
/// long-context stage, else one.
pub fn worker_count(plan: &Plan) -> usize {
    rank_ids(plan).into_iter().map(|id| workers_of(plan, id)).sum()
}

/// How many workers pipeline rank `id` runs on: one per device of its stage (the devices of a
/// tensor-parallel group, or of a long-context stage).
fn workers_of(plan: &Plan, id: RankId) -> usize {
    plan.replicas()[id.replica as usize].stages[id.pp_rank as usize].devices.len()
}

/// The seat of device `device_index` of `stage` in its tensor-parallel group, if it has one.
fn tensor_seat(plan: &Plan, stage: &Stage, device_index: usize) -> Result<Option<TensorSeat>, RuntimeError> {
    if stage.context.is_some() || stage.devices.len() < 2 {
        return Ok(None);
    }
    let config = ModelConfig::from_spec(plan.model(), plan.seq_len())?;
    Ok(Some(TensorSeat::new(&config, device_index, stage.devices.len())?))
}

/// Each group's positions, token runs and heads in a long-context stage of `seq_len` tokens.
pub fn context_groups(context: &StageContext, seq_len: u32) -> Vec<ContextGroup> {
    let shards = context.shards(seq_len);
    context
        .groups
        .iter()
        .enumerate()
        .map(|(idx, group)| ContextGroup {
            positions: shards.ranges(idx).into_iter().flatten().map(|p| p as usize).collect(),
            device_tokens: group.device_tokens.iter().map(|&t| t as usize).collect(),
            q_heads: group.heads.iter().map(|&h| h as usize).collect(),
        })
        .collect()
}

/// The seat of device `device_index` of `stage`, a long-context stage.
fn context_seat(plan: &Plan, stage: &Stage, device_index: usize) -> Result<Option<ContextSeat>, RuntimeError> {
    let Some(context) = &stage.context else { return Ok(None) };
    let members = context.groups[0].device_tokens.len();
    let config = ModelConfig::from_spec(plan.model(), plan.seq_len())?;
    let groups = context_groups(context, plan.seq_len());
    let placement = ContextPlacement::new(&config, groups, device_index / members, device_index % members)?;
    Ok(Some(ContextSeat { device_index, placement }))
}

/// The plan as the runtime trains it, and what that changed, each said in a sentence; refuses,
/// naming it, what the runtime cannot run at all ([`check_runnable`]). It all-gathers keys and
/// values (no ring attention yet): a plan asking for a ring is trained, and priced, that way.
pub fn as_trained(plan: Plan) -> Result<(Plan, Vec<&'static str>), RuntimeError> {
    let mut changes = Vec::new();
    let stages = plan.replicas().iter().flat_map(|replica| &replica.stages);
    let ring = stages.filter_map(|stage| stage.context.as_ref()).any(|context| context.kv_exchange == KvExchange::Ring);
    let plan = match ring {
        true => {
            changes.push(
                "the runtime all-gathers keys and values (no ring attention yet): training the plan with that exchange",
            );
            plan.with_kv_exchange(KvExchange::AllGather).map_err(|err| RuntimeError::Unsupported(err.to_string()))?
        }
        false => plan,
    };
    check_runnable(&plan)?;
    Ok((plan, changes))
}

/// Checks that the runtime can train `plan`: the one place that says so. It trains every plan the
/// planner writes (TP with sequence parallelism per stage, PP with any chunking, uneven DP,
/// long-context stages, ZeRO-1, overlapped reduction) but these, each refused naming it:
/// - a ring exchange of keys and values: its stages all-gather them ([`as_trained`] switches);
/// - a long-context stage whose groups split the heads differently: keys and values travel
///   between the devices holding the same heads;
/// - gradients reduced in 16 bits: the communicator sums fp32;
/// - ZeRO-1 over replicas whose stages differ in TP degree: their shards of a parameter differ;
/// - ZeRO-2: every replica keeps its gradients whole.
///
/// Zero-bubble schedules, a training option rather than the plan's, are refused when a step
/// starts: its stages have no split backward.
pub fn check_runnable(plan: &Plan) -> Result<(), RuntimeError> {
    for stage in plan.replicas().iter().flat_map(|replica| &replica.stages) {
        let Some(context) = &stage.context else { continue };
        if context.kv_exchange == KvExchange::Ring {
            return Err(RuntimeError::Unsupported(format!(
                "a ring exchange of keys and values ({}): the runtime all-gathers them and reduce-scatters their \
                 gradients, which the simulator prices as `kv_exchange: all-gather`; train the plan with that \
                 exchange (`medley train` switches it)",
                plan.stage_label(stage)
            )));
        }
        if context.groups.iter().any(|group| group.heads != context.groups[0].heads) {
            return Err(RuntimeError::Unsupported(format!(
                "a long-context stage whose groups split the heads differently ({}): keys and values travel between \
                 the devices holding the same heads, so every group needs the same split",
                plan.stage_label(stage)
            )));
        }
    }
    let reduces_gradients = plan.replicas().len() > 1 || plan.has_context();
    if reduces_gradients && plan.grad_reduce() != GradReduce::Fp32 {
        return Err(RuntimeError::Unsupported(format!(
            "gradients reduced in {} (`grad_reduce`): the runtime's communicator sums them in fp32; plan with \
             `--grad-reduce fp32`",
            plan.grad_reduce()
        )));
    }
    if plan.zero1() && mixed_tp_groups(plan).into_iter().any(|mixed| mixed) {
        return Err(RuntimeError::Unsupported(
            "ZeRO-1 over replicas whose stages differ in TP degree: their shards of a parameter differ, which the \
             runtime's distributed optimizer does not split; plan those replicas with one TP degree, or without \
             ZeRO-1 (`--no-zero1`)"
                .into(),
        ));
    }
    if plan.shard_gradients() {
        return Err(RuntimeError::Unsupported(
            "gradients sharded over the replicas (ZeRO-2): the runtime keeps every replica's gradients whole; plan \
             without --shard-gradients"
                .into(),
        ));
    }
    Ok(())
}

impl RankLayout {
    /// Every worker's layout, in job-rank order, each device slowed down as the cost model (with
    /// `calibration`) prices it against the cluster's fastest device type.
    pub fn all(plan: &Plan, calibration: &Calibration) -> Result<Vec<RankLayout>, RuntimeError> {
        check_runnable(plan)?;
        let fastest_s = fastest_pass_time_s(plan, calibration);
        let mut layouts = Vec::new();
        for id in rank_ids(plan) {
            let replica = &plan.replicas()[id.replica as usize];
            let p = plan.n_ranks(replica);
            let chunks: Vec<Range<usize>> = (id.pp_rank as usize..replica.stages.len())
                .step_by(p)
                .map(|virtual_stage| {
                    let layers = replica.stages[virtual_stage].layers;
                    layers.start as usize..layers.end as usize
                })
                .collect();
            let stage = &replica.stages[id.pp_rank as usize];
            for device_index in 0..workers_of(plan, id) {
                let group = plan.device_group(stage.devices[device_index]);
                let slowdown = pass_time_s(plan, group, calibration) / fastest_s;
                let device = EmulatedDevice { name: group.device.name.clone(), vendor: group.device.vendor, slowdown };
                let context = context_seat(plan, stage, device_index)?;
                let tensor = tensor_seat(plan, stage, device_index)?;
                let job_rank = layouts.len();
                let chunks = chunks.clone();
                layouts.push(RankLayout { id, job_rank, n_pipeline_ranks: p, chunks, device, context, tensor });
            }
        }
        Ok(layouts)
    }

    /// The positions of each sequence this worker holds between its stage's blocks: its run of a
    /// long-context stage's shard or of a tensor-parallel group's sequence, else all of them.
    pub fn positions(&self, seq_len: usize) -> Vec<usize> {
        match (&self.context, self.tensor) {
            (Some(seat), _) => seat.placement.positions().to_vec(),
            (None, Some(seat)) => even_run(seq_len, seat.member, seat.size).collect(),
            (None, None) => (0..seq_len).collect(),
        }
    }

    /// Whether this worker reports its stage's loss: a tensor-parallel group's members all
    /// compute the same, and the first reports it.
    pub fn reports_loss(&self) -> bool {
        self.tensor.is_none_or(|seat| seat.member == 0)
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
    CostModel::new(plan.model(), plan.seq_len(), calibration)
        .with_attention(plan.attention())
        .with_states(plan.state_format())
        .layer_time(group, setting)
        .total_s()
}

fn fastest_pass_time_s(plan: &Plan, calibration: &Calibration) -> f64 {
    plan.cluster().groups().iter().map(|group| pass_time_s(plan, group, calibration)).fold(f64::INFINITY, f64::min)
}

/// Per DP group, whether its holders differ in TP degree: their shards of a parameter differ, so
/// every worker of every holder reduces the whole tensors, its shard placed among zeros.
pub(crate) fn mixed_tp_groups(plan: &Plan) -> Vec<bool> {
    (0..plan.dp_groups().len())
        .map(|group_idx| {
            let mut degrees = plan
                .holders(group_idx)
                .into_iter()
                .zip(plan.replicas())
                .map(|(stage_idx, replica)| plan.stage_tp(&replica.stages[stage_idx]));
            let first = degrees.next();
            degrees.any(|tp| Some(tp) != first)
        })
        .collect()
}

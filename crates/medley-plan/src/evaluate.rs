//! Prices an explicit plan with the cost model: the one place a plan's predicted step time,
//! throughput, utilisation and memory come from. The search ranks its finalists with this too.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use medley_cost::comm::{self, DomainPart, Link};
use medley_cost::memory::usable;
use medley_cost::{Calibration, CostModel, GIB, PassTime, Setting, StageShape, flops, params};
use medley_spec::{BridgeMode, Cluster, DeviceId, DeviceSlot, DeviceSpec, GradReduce, Schedule, ScheduleKind, Vendor};
use serde::Serialize;

use crate::layers::LayerRange;
use crate::long_context_price::ContextPricer;
use crate::plan::{GradientAlgorithm, Plan, Replica, Route, Stage};

/// What a plan is predicted to do per optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub step_time_s: f64,
    /// The slowest replica's pipeline: forward and backward of all its micro-batches.
    pub pipeline_s: f64,
    /// Gradient synchronisation after the pipeline drains: with overlapped reduction, the part
    /// of it the rank's last backward pass does not hide.
    pub dp_sync_s: f64,
    pub optimizer_s: f64,
    #[serde(flatten)]
    pub utilisation: Utilisation,
    /// Pipeline bubble time over pipeline compute time, averaged over ranks (Narayanan et al.
    /// 2021's definition: uniform GPipe/1F1B gives (p − 1)/m).
    pub bubble_fraction: f64,
    pub n_gpus_used: u32,
    /// Highest predicted memory per device type, GiB.
    pub peak_memory_by_device_gib: BTreeMap<String, f64>,
    pub capacity_gib: BTreeMap<String, f64>,
    pub fits: bool,
}

/// Throughput and utilisation of a plan whose step takes `step_time_s`: what both engines report.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Utilisation {
    pub tokens_per_s: f64,
    pub model_tflops_per_gpu: f64,
    pub hardware_tflops_per_gpu: f64,
    /// Model FLOPs utilisation over the peak of the devices the plan uses (Megatron/PaLM).
    pub mfu: f64,
    /// Hardware FLOPs utilisation, counting recomputation.
    pub hfu: f64,
}

impl Utilisation {
    pub fn of(plan: &Plan, step_time_s: f64) -> Self {
        let n_gpus_used = plan.used_devices().len() as f64;
        let peak_flops: f64 = plan
            .replicas()
            .iter()
            .flat_map(|replica| &replica.stages[..plan.n_ranks(replica)])
            .flat_map(|stage| &stage.devices)
            .map(|&id| {
                let device = &plan.device_group(id).device;
                device.tensor_tflops(plan.precision()).expect("a plan's devices have its precision") * 1e12
            })
            .sum();
        let model_flops = flops::model_flops_per_step(plan.model(), plan.seq_len(), plan.global_batch());
        let hardware_flops =
            flops::hardware_flops_per_step(plan.model(), plan.seq_len(), plan.global_batch(), plan.recompute());
        Utilisation {
            tokens_per_s: f64::from(plan.seq_len()) * f64::from(plan.global_batch()) / step_time_s,
            model_tflops_per_gpu: model_flops / step_time_s / n_gpus_used / 1e12,
            hardware_tflops_per_gpu: hardware_flops / step_time_s / n_gpus_used / 1e12,
            mfu: model_flops / step_time_s / peak_flops,
            hfu: hardware_flops / step_time_s / peak_flops,
        }
    }
}

/// Prices `plan` (valid by construction).
pub fn evaluate(plan: &Plan, calibration: &Calibration) -> Prediction {
    let cost = &CostModel::new(plan.model(), plan.seq_len(), calibration)
        .with_attention(plan.attention())
        .with_states(plan.state_format());
    let slots = plan.cluster().devices();
    let mut layers = LayerTimes::default();
    let prices: Vec<ReplicaPrice> =
        plan.replicas().iter().map(|replica| price_replica(plan, cost, &slots, replica, &mut layers)).collect();
    let pipeline_s = prices.iter().map(|price| price.time_s).fold(0.0, f64::max);
    let optimizer_s = prices.iter().map(|price| price.optimizer_s).fold(0.0, f64::max);
    let busy: Vec<f64> = prices.iter().flat_map(|price| price.busy_fractions.iter().copied()).collect();
    let memory = MemoryPeaks::of(plan, cost, &slots);
    let dp_sync_s = dp_sync_s(plan, cost, &slots, &prices);
    let step_time_s = pipeline_s + dp_sync_s + optimizer_s;
    Prediction {
        step_time_s,
        pipeline_s,
        dp_sync_s,
        optimizer_s,
        utilisation: Utilisation::of(plan, step_time_s),
        bubble_fraction: busy.iter().map(|busy| 1.0 / busy - 1.0).sum::<f64>() / busy.len() as f64,
        n_gpus_used: plan.used_devices().len() as u32,
        fits: memory.fits(),
        peak_memory_by_device_gib: memory.peak_gib,
        capacity_gib: memory.capacity_gib,
    }
}

/// One replica's pipeline time, the share of it each rank computes, and its slowest
/// optimizer step.
struct ReplicaPrice {
    time_s: f64,
    busy_fractions: Vec<f64>,
    optimizer_s: f64,
    /// Per rank, one micro-batch's backward over all its chunks: what overlapped gradient
    /// reduction hides behind.
    backward_s: Vec<f64>,
}

/// One layer's and the head's pass on each node group at each TP degree, priced once per plan:
/// replicas repeat the same stages, and a big plan has thousands of them.
#[derive(Default)]
struct LayerTimes {
    by_group: BTreeMap<(usize, u32), (PassTime, PassTime)>,
}

impl LayerTimes {
    fn stage_time(
        &mut self,
        plan: &Plan,
        cost: &CostModel,
        slot: DeviceSlot,
        stage: &Stage,
        shape: StageShape,
    ) -> PassTime {
        let setting = plan.stage_setting(stage);
        let (layer, head) = *self.by_group.entry((slot.group_idx, setting.tp)).or_insert_with(|| {
            let group = plan.stage_group(stage);
            (cost.layer_time(group, setting), cost.head_time(group, setting))
        });
        cost.stage_pass(shape, layer, head)
    }
}

fn price_replica(
    plan: &Plan,
    cost: &CostModel,
    slots: &[DeviceSlot],
    replica: &Replica,
    layers: &mut LayerTimes,
) -> ReplicaPrice {
    let pricer = ContextPricer { cost, cluster: plan.cluster(), slots, memory_headroom: plan.memory_headroom() };
    let passes: Vec<PassTime> = replica
        .stages
        .iter()
        .zip(stage_shapes(replica))
        .map(|(stage, shape)| match &stage.context {
            Some(context) => pricer.stage_pass(&pricer.device_works(context, &stage.devices), shape, plan.recompute()),
            None => layers.stage_time(plan, cost, slots[stage.devices[0] as usize], stage, shape),
        })
        .collect();
    let boundary_s: Vec<f64> = replica
        .stages
        .windows(2)
        .zip(&replica.boundaries)
        .map(|(pair, route)| {
            let (from, to) = (slots[pair[0].devices[0] as usize], slots[pair[1].devices[0] as usize]);
            // Each device sends its own tokens; the fullest sends the most, on the side of the
            // smaller TP group (sequence parallelism splits them over its members).
            let share = largest_token_share(plan, &pair[0]).max(largest_token_share(plan, &pair[1]));
            let setting = plan.stage_setting(&pair[0]);
            let setting = Setting { tp: setting.tp.min(plan.stage_tp(&pair[1])), ..setting };
            comm::link_between(plan.cluster(), from, to, route_mode(*route))
                .transfer_s(share * cost.boundary_bytes(setting))
        })
        .collect();
    let time_s =
        PipelineTiming::interleaved(&passes, &boundary_s, plan.virtual_stages()).time_s(replica.n_micro_batches);
    let optimizer_s = replica
        .stages
        .iter()
        .zip(rank_shapes(plan, replica))
        .map(|(stage, shape)| {
            let params = cost.stage_params(shape) / f64::from(plan.stage_tp(stage) * plan.stage_state_shards(stage));
            let device_s = |&id: &DeviceId| cost.optimizer_step_s(plan.device_group(id), params);
            stage.devices.iter().map(device_s).fold(0.0, f64::max)
        })
        .fold(0.0, f64::max);
    let n_ranks = plan.n_ranks(replica);
    let busy_fractions = (0..n_ranks)
        .map(|rank| {
            let rank_s: f64 = passes.iter().skip(rank).step_by(n_ranks).map(|pass| pass.total_s()).sum();
            rank_s * f64::from(replica.n_micro_batches) / time_s
        })
        .collect();
    let backward_s =
        (0..n_ranks).map(|rank| passes.iter().skip(rank).step_by(n_ranks).map(|pass| pass.backward_s).sum()).collect();
    ReplicaPrice { time_s, busy_fractions, optimizer_s, backward_s }
}

/// The largest share of each sequence one device of `stage` holds across a pipeline boundary:
/// all of it (split by sequence parallelism inside a TP group, which `boundary_bytes` counts),
/// or a long-context device's tokens.
fn largest_token_share(plan: &Plan, stage: &Stage) -> f64 {
    let Some(context) = &stage.context else { return 1.0 };
    let most = context.groups.iter().flat_map(|group| &group.device_tokens).copied().max().unwrap_or(0);
    f64::from(most) / f64::from(plan.seq_len())
}

/// Peak memory of each device of `stage` (of `shape`) with `in_flight` micro-batches' activations:
/// one entry for a TP group's devices, which hold alike, one a device for a long-context stage.
fn stage_memories<'a>(
    plan: &'a Plan,
    cost: &CostModel,
    slots: &[DeviceSlot],
    stage: &Stage,
    shape: StageShape,
    in_flight: f64,
) -> Vec<(&'a DeviceSpec, f64)> {
    let shards = plan.stage_state_shards(stage);
    let Some(context) = &stage.context else {
        let bytes = cost.stage_memory(shape, plan.stage_setting(stage), in_flight, shards).total();
        return vec![(&plan.stage_group(stage).device, bytes)];
    };
    let pricer = ContextPricer { cost, cluster: plan.cluster(), slots, memory_headroom: plan.memory_headroom() };
    pricer
        .device_works(context, &stage.devices)
        .iter()
        .map(|work| {
            let bytes = pricer.device_memory(work, shape, plan.recompute(), in_flight, shards).total();
            (&plan.device_group(work.device).device, bytes)
        })
        .collect()
}

/// The highest predicted memory and the capacity of each device type, in GiB, and the share of
/// it the plan leaves free.
struct MemoryPeaks {
    peak_gib: BTreeMap<String, f64>,
    capacity_gib: BTreeMap<String, f64>,
    headroom: f64,
}

impl MemoryPeaks {
    fn of(plan: &Plan, cost: &CostModel, slots: &[DeviceSlot]) -> Self {
        let mut peaks =
            MemoryPeaks { peak_gib: BTreeMap::new(), capacity_gib: BTreeMap::new(), headroom: plan.memory_headroom() };
        for replica in plan.replicas() {
            let n_ranks = plan.n_ranks(replica);
            for (rank, (stage, shape)) in replica.stages.iter().zip(rank_shapes(plan, replica)).enumerate() {
                let in_flight = micro_batches_in_flight(plan, replica, rank, n_ranks);
                for (device, bytes) in stage_memories(plan, cost, slots, stage, shape, in_flight) {
                    let peak = peaks.peak_gib.entry(device.name.clone()).or_insert(0.0);
                    *peak = peak.max(bytes / GIB);
                    peaks.capacity_gib.insert(device.name.clone(), device.hbm_gib);
                }
            }
        }
        peaks
    }

    fn fits(&self) -> bool {
        self.peak_gib.iter().all(|(name, peak)| *peak <= usable(self.capacity_gib[name], self.headroom))
    }
}

/// Micro-batches' worth of rank `rank`'s layers' activations it holds at its peak: the schedule's
/// chunk-micro-batches in flight, each priced at the rank's largest chunk (an uneven split makes
/// chunks differ by a layer, and the warm-up fills the first chunks first).
fn micro_batches_in_flight(plan: &Plan, replica: &Replica, rank: usize, n_ranks: usize) -> f64 {
    let chunks = plan.schedule().in_flight(rank, n_ranks, plan.virtual_stages(), replica.n_micro_batches);
    let chunk_layers = replica.stages.iter().skip(rank).step_by(n_ranks).map(|stage| stage.layers.len());
    let (largest, total) = chunk_layers.fold((0, 0), |(largest, total), layers| (largest.max(layers), total + layers));
    f64::from(chunks) * f64::from(largest) / f64::from(total.max(1))
}

/// The largest k whose kFkB in-flight activations fit every device of `plan` (at least 1, at
/// most the largest micro-batch count, beyond which k changes nothing): how far an adaptive
/// schedule may raise k. The simulator and the runtime both bound their `StepSchedules` by it.
pub fn max_k_within_memory(plan: &Plan, calibration: &Calibration) -> u32 {
    let cost = CostModel::new(plan.model(), plan.seq_len(), calibration)
        .with_attention(plan.attention())
        .with_states(plan.state_format());
    let slots = plan.cluster().devices();
    let memories = |stage, shape, in_flight| stage_memories(plan, &cost, &slots, stage, shape, in_flight);
    // Per device of each rank: (the rank's index and the pipeline's depth, micro-batches, bytes
    // held with nothing in flight, bytes one more micro-batch through every chunk adds, capacity).
    let mut ranks = Vec::new();
    for replica in plan.replicas() {
        let n_ranks = plan.n_ranks(replica);
        let stages = stage_shapes(replica);
        for (rank, (stage, shape)) in replica.stages.iter().zip(rank_shapes(plan, replica)).enumerate() {
            // Every chunk of a rank runs on the rank's devices, in the same order.
            let chunks: Vec<(&Stage, StageShape)> =
                replica.stages.iter().zip(stages.iter().copied()).skip(rank).step_by(n_ranks).collect();
            for (device_idx, (device, held)) in memories(stage, shape, 0.0).into_iter().enumerate() {
                let per_micro_batch: f64 = chunks
                    .iter()
                    .map(|&(chunk, chunk_shape)| {
                        memories(chunk, chunk_shape, 1.0)[device_idx].1
                            - memories(chunk, chunk_shape, 0.0)[device_idx].1
                    })
                    .sum();
                ranks.push((
                    rank,
                    n_ranks,
                    replica.n_micro_batches,
                    held,
                    per_micro_batch,
                    usable(device.hbm_gib * GIB, plan.memory_headroom()),
                ));
            }
        }
    }
    let fits = |k: u32| {
        ranks.iter().all(|&(rank, n_ranks, m, held, per_micro_batch, capacity)| {
            let kfkb = Schedule::Fixed(ScheduleKind::Kfkb { k: NonZeroU32::new(k).expect("k ≥ 1") });
            held + f64::from(kfkb.in_flight(rank, n_ranks, 1, m)) * per_micro_batch <= capacity
        })
    };
    let max_m = plan.replicas().iter().map(|replica| replica.n_micro_batches).max().unwrap_or(1);
    (1..=max_m.max(1)).take_while(|&k| k == 1 || fits(k)).last().unwrap_or(1)
}

/// What each (virtual) stage of a replica holds: the embedding on the first, the head on the last.
fn stage_shapes(replica: &Replica) -> Vec<StageShape> {
    let n_stages = replica.stages.len();
    replica
        .stages
        .iter()
        .enumerate()
        .map(|(idx, stage)| StageShape::in_pipeline(idx, n_stages, stage.layers.len()))
        .collect()
}

/// What each physical rank of a replica holds: its chunks' layers, the embedding on rank 0 (it
/// holds virtual stage 0) and the head on rank p − 1 (it holds the last virtual stage).
fn rank_shapes(plan: &Plan, replica: &Replica) -> Vec<StageShape> {
    let n_ranks = plan.n_ranks(replica);
    (0..n_ranks)
        .map(|rank| {
            let n_layers = replica.stages.iter().skip(rank).step_by(n_ranks).map(|stage| stage.layers.len()).sum();
            StageShape::in_pipeline(rank, n_ranks, n_layers)
        })
        .collect()
}

/// A pipeline's fill-and-drain time and its steady-state cycle per micro-batch, for GPipe and
/// 1F1B alike: T(m) = Σ(F + B) + 2·Σ transfers + (m − 1)·max over stages of (F + B + its transfers).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PipelineTiming {
    pub fill_s: f64,
    pub cycle_s: f64,
}

impl PipelineTiming {
    /// `boundary_s[i]` is one transfer between stage i and i + 1.
    pub fn new(passes: &[PassTime], boundary_s: &[f64]) -> Self {
        PipelineTiming::interleaved(passes, boundary_s, 1)
    }

    /// Interleaved 1F1B with `n_chunks` = v chunks per rank: `passes` and `boundary_s` run along
    /// the p·v virtual stages, virtual stage j on rank j mod p. The ranks form a pipeline whose
    /// unit is one chunk-micro-batch, u_i = Σ over rank i's chunks of (F + B + the transfers on
    /// either side) / v, and each micro-batch is v units: T(m) = Σ u_i + (m·v − 1)·max u_i. With
    /// even ranks the bubble is (p − 1)/v of a micro-batch's rank time (Narayanan et al. SC'21,
    /// arXiv 2104.04473: bubble fraction (p − 1)/(v·m)); with v = 1 this is [`PipelineTiming::new`].
    pub fn interleaved(passes: &[PassTime], boundary_s: &[f64], n_chunks: u32) -> Self {
        let v = n_chunks as usize;
        let n_ranks = passes.len() / v;
        let unit_s: Vec<f64> = (0..n_ranks)
            .map(|rank| {
                let rank_s: f64 = (rank..passes.len())
                    .step_by(n_ranks)
                    .map(|idx| {
                        let before = if idx > 0 { boundary_s[idx - 1] } else { 0.0 };
                        passes[idx].total_s() + before + boundary_s.get(idx).copied().unwrap_or(0.0)
                    })
                    .sum();
                rank_s / f64::from(n_chunks)
            })
            .collect();
        let max_unit_s = unit_s.iter().copied().fold(0.0, f64::max);
        // Rewritten per micro-batch so that `time_s(m)` = Σ u + (m·v − 1)·max u.
        let fill_s = unit_s.iter().sum::<f64>() + (f64::from(n_chunks) - 1.0) * max_unit_s;
        PipelineTiming { fill_s, cycle_s: f64::from(n_chunks) * max_unit_s }
    }

    pub fn time_s(&self, n_micro_batches: u32) -> f64 {
        self.fill_s + f64::from(n_micro_batches.saturating_sub(1)) * self.cycle_s
    }
}

fn route_mode(route: Route) -> BridgeMode {
    match route {
        Route::Bridge { mode } => mode,
        // Unused within one vendor.
        Route::Native { .. } => BridgeMode::DeviceDirect,
    }
}

/// The slowest device's exposed gradient synchronisation time: the DP groups its chunks take
/// part in, less what its last backward hides when reduction overlaps it, then its long-context
/// stage's own reduction.
fn dp_sync_s(plan: &Plan, cost: &CostModel, slots: &[DeviceSlot], prices: &[ReplicaPrice]) -> f64 {
    // Per (replica, rank): the summed time of the DP groups its chunks take part in, and their
    // buckets.
    let mut per_rank: BTreeMap<(usize, usize), (f64, u32)> = BTreeMap::new();
    for (group_idx, group) in plan.dp_groups().iter().enumerate() {
        let holders = plan.holders(group_idx);
        let holder_stages: Vec<&Stage> =
            holders.iter().zip(plan.replicas()).map(|(&stage_idx, replica)| &replica.stages[stage_idx]).collect();
        let members: Vec<(DeviceSlot, Vendor)> =
            holder_stages.iter().map(|stage| (slots[stage.devices[0] as usize], plan.stage_vendor(stage))).collect();
        // A long-context holder reduced over its own devices first: each shares its share. A
        // holder of a smaller TP degree holds the larger shard.
        let shares = holder_stages.iter().map(|stage| sequence_holders(stage)).min().unwrap_or(1);
        let tp = holder_stages.iter().map(|stage| plan.stage_tp(stage)).min().unwrap_or(1);
        let bytes = dp_group_bytes(cost, tp, group.layers, plan.grad_reduce()) / f64::from(shares);
        let time_s = dp_group_time_s(plan.cluster(), &members, bytes, group.route, group.algorithm);
        let buckets = comm::gradient_buckets(bytes / plan.grad_reduce().bytes(), members.len());
        for ((replica_idx, &stage_idx), replica) in holders.iter().enumerate().zip(plan.replicas()) {
            let rank = per_rank.entry((replica_idx, plan.rank_of(replica, stage_idx))).or_insert((0.0, 0));
            *rank = (rank.0 + time_s, rank.1 + buckets);
        }
    }
    let mut per_rank: BTreeMap<(usize, usize), f64> = per_rank
        .into_iter()
        .map(|((replica_idx, rank), (sync_s, buckets))| {
            let exposed_s = match plan.overlap_grad_reduce() {
                true => comm::exposed_reduction_s(sync_s, buckets, prices[replica_idx].backward_s[rank]),
                false => sync_s,
            };
            ((replica_idx, rank), exposed_s)
        })
        .collect();
    // Each long-context rank reduces its whole stage's gradients over its devices.
    let pricer = ContextPricer { cost, cluster: plan.cluster(), slots, memory_headroom: plan.memory_headroom() };
    for (replica_idx, replica) in plan.replicas().iter().enumerate() {
        for (rank, (stage, shape)) in replica.stages.iter().zip(rank_shapes(plan, replica)).enumerate() {
            if stage.context.is_some() {
                let bytes = plan.grad_reduce().bytes() * cost.stage_params(shape);
                *per_rank.entry((replica_idx, rank)).or_insert(0.0) +=
                    pricer.stage_gradient_sync_s(&stage.devices, bytes);
            }
        }
    }
    // The first and the last rank of each replica exchange a tied embedding's gradients.
    let tied_syncs_s = tied_embedding_syncs_s(plan, cost, slots);
    for ((replica_idx, replica), sync_s) in plan.replicas().iter().enumerate().zip(tied_syncs_s) {
        if sync_s > 0.0 {
            for rank in [0, plan.n_ranks(replica) - 1] {
                *per_rank.entry((replica_idx, rank)).or_insert(0.0) += sync_s;
            }
        }
    }
    per_rank.into_values().fold(0.0, f64::max)
}

/// Per replica, the all-reduce of a tied embedding's gradients between its first and its last
/// pipeline rank, which hold the input embedding and the output head as copies of one matrix
/// (Megatron-LM's embedding group, DeepSpeed's tied modules), after the data-parallel reduction
/// and before the optimizer step; each TP rank its vocabulary shard. Across nodes, a node's NICs
/// are shared by the exchanges of every replica whose first or last rank sits there, not by all
/// its GPUs. Zero for an untied model or a pipeline of one rank.
pub fn tied_embedding_syncs_s(plan: &Plan, cost: &CostModel, slots: &[DeviceSlot]) -> Vec<f64> {
    let ends: Vec<Option<TiedEnds>> = plan.replicas().iter().map(|replica| tied_ends(plan, slots, replica)).collect();
    // TP ranks exchanging through each node's NICs.
    let mut exchanges_on: BTreeMap<u32, u32> = BTreeMap::new();
    for ends in ends.iter().flatten() {
        for (slot, tp) in [(ends.first, ends.first_tp), (ends.last, ends.last_tp)] {
            *exchanges_on.entry(slot.node_idx).or_insert(0) += tp;
        }
    }
    let mode = plan.cluster().bridge().modes()[0];
    let embedding_bytes = plan.grad_reduce().bytes() * params::embedding_params(cost.model()) as f64;
    let sync_s = |ends: TiedEnds| {
        // The larger of the two vocabulary shards.
        let bytes = embedding_bytes / f64::from(ends.first_tp.min(ends.last_tp));
        let (a, b) = (ends.first, ends.last);
        let mut link = comm::link_between(plan.cluster(), a, b, mode);
        if a.node_idx != b.node_idx {
            let groups = plan.cluster().groups();
            let gpus = groups[a.group_idx].gpus_per_node.max(groups[b.group_idx].gpus_per_node);
            let busy = exchanges_on[&a.node_idx].max(exchanges_on[&b.node_idx]);
            let lane = comm::lane_link(plan.cluster(), a, b, mode);
            link.gb_s = (link.gb_s * f64::from(gpus) / f64::from(busy)).min(lane.gb_s);
        }
        comm::ring_all_reduce_s(bytes, 2, link)
    };
    ends.into_iter().map(|ends| ends.map_or(0.0, sync_s)).collect()
}

/// Where a replica's tied embedding's two copies sit, and their stages' TP degrees.
#[derive(Clone, Copy)]
struct TiedEnds {
    first: DeviceSlot,
    first_tp: u32,
    last: DeviceSlot,
    last_tp: u32,
}

/// Where `replica`'s tied embedding's two copies sit: its first and its last rank, when the model
/// ties them and the pipeline has more than one rank.
fn tied_ends(plan: &Plan, slots: &[DeviceSlot], replica: &Replica) -> Option<TiedEnds> {
    let n_ranks = plan.n_ranks(replica);
    if !plan.model().tie_embeddings() || n_ranks < 2 {
        return None;
    }
    let (first, last) = (&replica.stages[0], &replica.stages[n_ranks - 1]);
    let slot = |stage: &Stage| slots[stage.devices[0] as usize];
    Some(TiedEnds {
        first: slot(first),
        first_tp: plan.stage_tp(first),
        last: slot(last),
        last_tp: plan.stage_tp(last),
    })
}

/// Devices of `stage` that each hold all of its parameters: a long-context stage's, or one (a
/// TP group's ranks hold shards).
fn sequence_holders(stage: &Stage) -> u32 {
    if stage.context.is_some() { stage.devices.len() as u32 } else { 1 }
}

/// Gradient bytes each TP rank contributes for a DP group's layers (plus the embedding or head
/// when the range touches the model's ends), reduced in `grad_reduce`.
pub(crate) fn dp_group_bytes(cost: &CostModel, tp: u32, layers: LayerRange, grad_reduce: GradReduce) -> f64 {
    let shape = StageShape {
        n_layers: layers.len(),
        embedding: layers.start == 0,
        head: layers.end == cost.model().n_layers(),
    };
    grad_reduce.bytes() * cost.stage_params(shape) / f64::from(tp)
}

/// All-reduce (or ZeRO-1's reduce-scatter plus all-gather, the same volume) of `bytes` over
/// `members`, in replica order.
pub fn dp_group_time_s(
    cluster: &Cluster,
    members: &[(DeviceSlot, Vendor)],
    bytes: f64,
    route: Route,
    algorithm: GradientAlgorithm,
) -> f64 {
    let mode = route_mode(route);
    match algorithm {
        GradientAlgorithm::Ring => {
            let slots: Vec<DeviceSlot> = members.iter().map(|(slot, _)| *slot).collect();
            comm::ring_all_reduce_s(bytes, members.len() as u32, ring_link(cluster, &slots, mode))
        }
        GradientAlgorithm::Hierarchical => {
            let mut vendors: Vec<Vendor> = members.iter().map(|(_, vendor)| *vendor).collect();
            vendors.sort();
            vendors.dedup();
            let domains: Vec<Vec<DeviceSlot>> = vendors
                .iter()
                .map(|vendor| members.iter().filter(|(_, v)| v == vendor).map(|(slot, _)| *slot).collect())
                .collect();
            let parts: Vec<DomainPart> = domains
                .iter()
                .map(|slots| DomainPart { n_ranks: slots.len() as u32, link: ring_link(cluster, slots, mode) })
                .collect();
            let borders: Vec<DeviceSlot> = domains.iter().map(|slots| slots[0]).collect();
            comm::hierarchical_all_reduce_s(bytes, &parts, ring_link(cluster, &borders, mode))
        }
    }
}

/// The link a ring through `slots` in order is held back by.
fn ring_link(cluster: &Cluster, slots: &[DeviceSlot], mode: BridgeMode) -> Link {
    let n = slots.len();
    (0..n)
        .map(|idx| comm::link_between(cluster, slots[idx], slots[(idx + 1) % n], mode))
        .reduce(Link::slowest)
        .unwrap_or(Link { gb_s: f64::INFINITY, latency_us: 0.0 })
}

/// The cheapest route and algorithm for a DP group whose members are `members`.
pub fn best_dp_route(cluster: &Cluster, members: &[(DeviceSlot, Vendor)], bytes: f64) -> (Route, GradientAlgorithm) {
    let first = members[0].1;
    if members.iter().all(|(_, vendor)| *vendor == first) {
        return (Route::Native { vendor: first }, GradientAlgorithm::Ring);
    }
    let mut best: Option<(f64, Route, GradientAlgorithm)> = None;
    for mode in cluster.bridge().modes() {
        for algorithm in [GradientAlgorithm::Hierarchical, GradientAlgorithm::Ring] {
            let route = Route::Bridge { mode };
            let time_s = dp_group_time_s(cluster, members, bytes, route, algorithm);
            if best.is_none_or(|(best_s, _, _)| time_s < best_s) {
                best = Some((time_s, route, algorithm));
            }
        }
    }
    let (_, route, algorithm) = best.expect("a bridge offers at least one mode");
    (route, algorithm)
}

/// The cheapest route between two adjacent stages.
pub fn best_boundary_route(cluster: &Cluster, a: (DeviceSlot, Vendor), b: (DeviceSlot, Vendor), bytes: f64) -> Route {
    if a.1 == b.1 {
        return Route::Native { vendor: a.1 };
    }
    let modes = cluster.bridge().modes();
    let mode = modes
        .iter()
        .copied()
        .min_by(|x, y| {
            let time = |mode| comm::link_between(cluster, a.0, b.0, mode).transfer_s(bytes);
            time(*x).total_cmp(&time(*y))
        })
        .expect("a bridge offers at least one mode");
    Route::Bridge { mode }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_divides_the_bubble_by_the_chunks() {
        // 4 ranks of 2 chunks, 1 s of work per chunk per micro-batch (2 s per rank), no
        // transfers, 8 micro-batches: m·t + (p − 1)·t/v = 16 + 3 = 19 s (Narayanan et al.).
        let chunk = PassTime { forward_s: 0.25, backward_s: 0.75, weight_grad_s: 0.25 };
        let timing = PipelineTiming::interleaved(&[chunk; 8], &[0.0; 7], 2);
        assert_eq!(timing.time_s(8), 19.0);
        // Without interleaving the same ranks (2 s each) leave a (p − 1)·t = 6 s bubble.
        let rank = PassTime { forward_s: 0.5, backward_s: 1.5, weight_grad_s: 0.5 };
        assert_eq!(PipelineTiming::new(&[rank; 4], &[0.0; 3]).time_s(8), 22.0);
    }
}

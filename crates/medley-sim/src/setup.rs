//! What a plan fixes for every step: each rank's pass times, memory and network ports, and the
//! members of each gradient group. Built once per simulation from the plan and the cost model.

use std::collections::BTreeMap;

use medley_cost::comm::{self, Link};
use medley_cost::{Calibration, CostModel, GIB, PassTime, StageShape};
use medley_plan::long_context_price::ContextPricer;
use medley_plan::{Plan, Route, Stage, tied_embedding_syncs_s};
use medley_schedule::RankId;
use medley_spec::{BridgeMode, DeviceSlot, Vendor};

use crate::links::{Endpoint, SharedLinks};
use crate::long_context::{DevicePass, PhaseSpan, chunk_pass, simulate_context_layer};
use crate::network::{Network, Path};
use crate::{SimError, ns};

/// One micro-batch's passes on one model chunk, in nanoseconds, and the activation memory the
/// micro-batch holds on the chunk from its forward until its backward ends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ChunkCost {
    pub forward_ns: u64,
    pub backward_ns: u64,
    pub input_grad_ns: u64,
    pub weight_grad_ns: u64,
    pub activation_bytes: f64,
    /// For a long-context chunk, one layer's forward and backward on its slowest device.
    pub context_layer: Option<(DevicePass, DevicePass)>,
}

impl ChunkCost {
    fn of(pass: PassTime, activation_bytes: f64, context_layer: Option<(DevicePass, DevicePass)>) -> Self {
        ChunkCost {
            forward_ns: ns(pass.forward_s),
            backward_ns: ns(pass.backward_s),
            input_grad_ns: ns(pass.backward_s - pass.weight_grad_s),
            weight_grad_ns: ns(pass.weight_grad_s),
            activation_bytes,
            context_layer,
        }
    }
}

/// One pipeline rank: a TP group running one program.
#[derive(Clone, Debug)]
pub(crate) struct RankSetup {
    pub id: RankId,
    pub slot: DeviceSlot,
    pub vendor: Vendor,
    pub device_name: String,
    pub devices: Vec<u32>,
    pub chunks: Vec<ChunkCost>,
    pub optimizer_ns: u64,
    /// Gradient reductions before the optimizer step that are not the DP groups': a
    /// long-context rank's over its own devices (each holds every parameter), and the first and
    /// last rank's of a tied embedding; priced by the α–β model like TP collectives.
    pub stage_sync_ns: u64,
    /// Bytes its fullest device sends across a pipeline boundary per micro-batch and direction.
    pub boundary_bytes: f64,
    /// A long-context rank's layer, phase by phase: forward and backward.
    pub layer_phases: Option<[Vec<PhaseSpan>; 2]>,
    /// Weights, gradients, optimizer states and workspace: held all step.
    pub static_bytes: f64,
    pub capacity_bytes: f64,
    /// Where its GPUs meet the links.
    pub endpoint: Endpoint,
}

pub(crate) struct Setup<'p> {
    pub plan: &'p Plan,
    /// In [`RankId`] order, as programs are.
    pub ranks: Vec<RankSetup>,
    /// Per DP group: its members' rank indices in replica order.
    pub dp_members: Vec<Vec<usize>>,
    /// Bytes per TP rank (per device of a long-context stage, which reduced them over the
    /// stage's devices first) of each DP group's gradients.
    pub dp_bytes: Vec<f64>,
    pub links: SharedLinks,
}

/// What a rank's setup holds beside its identity and ports.
struct RankParts {
    device_name: String,
    layer_phases: Option<[Vec<PhaseSpan>; 2]>,
    chunks: Vec<ChunkCost>,
    optimizer_ns: u64,
    stage_sync_ns: u64,
    static_bytes: f64,
    capacity_bytes: f64,
    boundary_bytes: f64,
}

/// A long-context rank: one layer simulated on its devices (`crate::long_context`), its memory that
/// of the device with the least room to spare at `in_flight` micro-batches.
fn context_rank(
    plan: &Plan,
    cost: &CostModel,
    slots: &[DeviceSlot],
    stage: &Stage,
    shape: StageShape,
    in_flight: f64,
) -> Result<RankParts, SimError> {
    let cluster = plan.cluster();
    let layer = simulate_context_layer(cost, cluster, stage, plan.recompute())?;
    let pass = chunk_pass(cost, cluster, stage, &layer, shape);
    let pricer = ContextPricer { cost, cluster, slots, memory_headroom: plan.memory_headroom() };
    let context = stage.context.as_ref().expect("a context stage");
    let shards = plan.stage_state_shards(stage);
    let works = pricer.device_works(context, &stage.devices);
    let tightest = works
        .iter()
        .map(|work| {
            let memory = |in_flight| pricer.device_memory(work, shape, plan.recompute(), in_flight, shards).total();
            let device = &plan.device_group(work.device).device;
            (device, memory(0.0), memory(1.0) - memory(0.0), device.hbm_gib * GIB)
        })
        .max_by(|a, b| ((a.1 + in_flight * a.2) / a.3).total_cmp(&((b.1 + in_flight * b.2) / b.3)))
        .expect("a stage has devices");
    let slowest = layer.devices.iter().max_by_key(|(_, forward, backward)| forward.end_ns + backward.end_ns);
    let context_layer = slowest.map(|&(_, forward, backward)| (forward, backward));
    let params = cost.stage_params(shape);
    let groups = stage.devices.iter().map(|&id| plan.device_group(id));
    let optimizer_s = groups.map(|group| cost.optimizer_step_s(group, params / f64::from(shards))).fold(0.0, f64::max);
    let most_tokens = context.groups.iter().flat_map(|group| &group.device_tokens).copied().max().unwrap_or(0);
    Ok(RankParts {
        device_name: tightest.0.name.clone(),
        layer_phases: Some(layer.phases.clone()),
        chunks: vec![ChunkCost::of(pass, tightest.2, context_layer)],
        optimizer_ns: ns(optimizer_s),
        stage_sync_ns: ns(pricer.stage_gradient_sync_s(&stage.devices, plan.grad_reduce().bytes() * params)),
        static_bytes: tightest.1,
        capacity_bytes: tightest.3,
        boundary_bytes: plan.precision().element_bytes() * f64::from(most_tokens) * f64::from(plan.model().hidden()),
    })
}

impl<'p> Setup<'p> {
    /// `network` receives every rank's ports.
    pub(crate) fn new<P>(
        plan: &'p Plan,
        calibration: &Calibration,
        network: &mut Network<P>,
    ) -> Result<Self, SimError> {
        let cost = CostModel::new(plan.model(), plan.seq_len(), calibration)
            .with_attention(plan.attention())
            .with_states(plan.state_format());
        let slots = plan.cluster().devices();
        let links = SharedLinks::new(plan.cluster(), network);
        let mut ranks = Vec::new();
        for (replica_idx, replica) in plan.replicas().iter().enumerate() {
            let n_ranks = plan.n_ranks(replica);
            let n_stages = replica.stages.len();
            for rank_idx in 0..n_ranks {
                let stage = &replica.stages[rank_idx];
                let group = plan.stage_group(stage);
                let setting = plan.stage_setting(stage);
                // Virtual stages rank_idx, rank_idx + p, ...: the rank's chunks in order.
                let chunk_shapes: Vec<StageShape> = (rank_idx..n_stages)
                    .step_by(n_ranks)
                    .map(|stage_idx| {
                        StageShape::in_pipeline(stage_idx, n_stages, replica.stages[stage_idx].layers.len())
                    })
                    .collect();
                let n_layers = chunk_shapes.iter().map(|shape| shape.n_layers).sum();
                let rank_shape = StageShape::in_pipeline(rank_idx, n_ranks, n_layers);
                let slot = slots[stage.devices[0] as usize];
                let stage_slots: Vec<DeviceSlot> = stage.devices.iter().map(|&id| slots[id as usize]).collect();
                let rank = match &stage.context {
                    Some(_) => {
                        let m = replica.n_micro_batches;
                        let in_flight = f64::from(plan.schedule().in_flight(rank_idx, n_ranks, 1, m));
                        context_rank(plan, &cost, &slots, stage, rank_shape, in_flight)?
                    }
                    None => {
                        let shards = plan.stage_state_shards(stage);
                        let memory = |shape, in_flight| cost.stage_memory(shape, setting, in_flight, shards).total();
                        let chunks = chunk_shapes
                            .iter()
                            .map(|&shape| {
                                let activation_bytes = memory(shape, 1.0) - memory(shape, 0.0);
                                ChunkCost::of(cost.stage_time(group, shape, setting), activation_bytes, None)
                            })
                            .collect();
                        let params_per_device = cost.stage_params(rank_shape) / f64::from(setting.tp * shards);
                        RankParts {
                            device_name: group.device.name.clone(),
                            layer_phases: None,
                            chunks,
                            optimizer_ns: ns(cost.optimizer_step_s(group, params_per_device)),
                            stage_sync_ns: 0,
                            static_bytes: memory(rank_shape, 0.0),
                            capacity_bytes: group.device.hbm_gib * GIB,
                            boundary_bytes: cost.boundary_bytes(setting),
                        }
                    }
                };
                ranks.push(RankSetup {
                    id: RankId::new(replica_idx, rank_idx),
                    slot,
                    vendor: group.device.vendor,
                    device_name: rank.device_name,
                    devices: stage.devices.clone(),
                    chunks: rank.chunks,
                    optimizer_ns: rank.optimizer_ns,
                    stage_sync_ns: rank.stage_sync_ns,
                    boundary_bytes: rank.boundary_bytes,
                    layer_phases: rank.layer_phases,
                    static_bytes: rank.static_bytes,
                    capacity_bytes: rank.capacity_bytes,
                    endpoint: links.endpoint(plan.cluster(), &stage_slots),
                });
            }
        }
        let index: BTreeMap<RankId, usize> = ranks.iter().enumerate().map(|(idx, rank)| (rank.id, idx)).collect();
        let tied_syncs_s = tied_embedding_syncs_s(plan, &cost, &slots);
        for ((replica_idx, replica), sync_s) in plan.replicas().iter().enumerate().zip(tied_syncs_s) {
            let sync_ns = ns(sync_s);
            if sync_ns > 0 {
                for rank_idx in [0, plan.n_ranks(replica) - 1] {
                    ranks[index[&RankId::new(replica_idx, rank_idx)]].stage_sync_ns += sync_ns;
                }
            }
        }
        let dp_members = (0..plan.dp_groups().len())
            .map(|group_idx| {
                plan.holders(group_idx)
                    .iter()
                    .copied()
                    .zip(plan.replicas())
                    .enumerate()
                    .map(|(replica_idx, (stage_idx, replica))| {
                        index[&RankId::new(replica_idx, plan.rank_of(replica, stage_idx))]
                    })
                    .collect()
            })
            .collect();
        let dp_bytes = (0..plan.dp_groups().len())
            .map(|group_idx| {
                let layers = plan.dp_groups()[group_idx].layers;
                let shape = StageShape {
                    n_layers: layers.len(),
                    embedding: layers.start == 0,
                    head: layers.end == plan.model().n_layers(),
                };
                let holders: Vec<&Stage> = plan
                    .holders(group_idx)
                    .iter()
                    .zip(plan.replicas())
                    .map(|(&stage_idx, replica)| &replica.stages[stage_idx])
                    .collect();
                // A long-context holder reduced over its devices first: each holds a share. A
                // holder of a smaller TP degree holds the larger shard.
                let holder_devices = holders
                    .iter()
                    .map(|stage| if stage.context.is_some() { stage.devices.len() } else { 1 })
                    .min()
                    .unwrap_or(1);
                let tp = holders.iter().map(|stage| plan.stage_tp(stage)).min().unwrap_or(1);
                plan.grad_reduce().bytes() * cost.stage_params(shape) / f64::from(tp) / holder_devices as f64
            })
            .collect();
        Ok(Setup { plan, ranks, dp_members, dp_bytes, links })
    }

    /// The rank index of `id`, if the plan has that rank.
    pub(crate) fn rank_index(&self, id: RankId) -> Option<usize> {
        self.ranks.binary_search_by_key(&id, |rank| rank.id).ok()
    }

    /// What one lane of a transfer from rank `from` to rank `to` reaches alone, and the
    /// resources on its way ([`SharedLinks::path`]).
    pub(crate) fn path(&self, from: usize, to: usize, route: Route) -> (Link, Path) {
        let (a, b) = (&self.ranks[from], &self.ranks[to]);
        let mode = match route {
            Route::Bridge { mode } => mode,
            Route::Native { .. } => BridgeMode::DeviceDirect,
        };
        let cluster = self.plan.cluster();
        (comm::lane_link(cluster, a.slot, b.slot, mode), self.links.path(cluster, &a.endpoint, &b.endpoint))
    }

    /// The route of a pipeline transfer that `sender` makes from its chunk `chunk`: forward to
    /// the next virtual stage, or backward to the previous one.
    pub(crate) fn boundary_route(&self, sender: RankId, chunk: u32, forward: bool) -> Route {
        let replica = &self.plan.replicas()[sender.replica as usize];
        let virtual_stage = chunk as usize * self.plan.n_ranks(replica) + sender.pp_rank as usize;
        replica.boundaries[if forward { virtual_stage } else { virtual_stage - 1 }]
    }
}

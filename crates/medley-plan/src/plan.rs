//! The Plan: explicit, versioned data saying which devices run which layers of which replica, and
//! how every parallel group communicates. The planner writes it; the schedule, simulator and
//! runtime read it. The schema (version 3) is documented field by field on [`PlanParts`] and in
//! ARCHITECTURE.md. A [`Plan`] is its parts once checked: outside this crate it cannot be made,
//! read from a file or edited without passing [`Plan::new`], so nothing downstream checks it
//! again.

use std::collections::BTreeSet;
use std::fmt;

use medley_cost::long_context::KvExchange;
use medley_cost::{Setting, StateFormat};
use medley_spec::{
    AttentionKernel, BridgeMode, Cluster, DeviceId, GradReduce, ModelSpec, Precision, Recompute, Schedule,
    ScheduleKind, Vendor,
};
use serde::{Deserialize, Serialize};

use crate::error::{ContextProblem, InvalidPlan, PlanError, ReplicaProblem, RouteProblem};
use crate::layers::LayerRange;
use crate::long_context_stage::StageContext;

/// The newest plan schema this build reads and writes. Version 2 added long-context stages
/// ([`Stage::context`]), version 3 a TP degree per stage (each stage's device count); a plan
/// says the oldest version that describes it, so older builds read what they can.
pub const PLAN_VERSION: u32 = 3;

/// The version of plans with long-context stages and one TP degree.
pub const PLAN_VERSION_WITH_CONTEXT: u32 = 2;

/// The version of plans whose stages differ in TP degree.
pub const PLAN_VERSION_PER_STAGE_TP: u32 = 3;

/// The oldest plan schema this build reads, and the version of plans without a context.
pub const PLAN_VERSION_WITHOUT_CONTEXT: u32 = 1;

/// A complete training layout for one cluster, model and job, every invariant checked: built
/// through [`Plan::new`], which a plan file goes through too when it is read (the planner's own
/// assemblies, correct by construction, are checked in debug builds). Nothing downstream
/// re-checks it, and nothing changes it but the edit methods, which check again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "PlanParts", into = "PlanParts")]
pub struct Plan {
    parts: PlanParts,
}

impl TryFrom<PlanParts> for Plan {
    type Error = PlanError;
    fn try_from(parts: PlanParts) -> Result<Self, PlanError> {
        Plan::new(parts)
    }
}

impl From<Plan> for PlanParts {
    fn from(plan: Plan) -> Self {
        plan.parts
    }
}

/// A plan's parts as a plan file holds them, unchecked: [`Plan::new`] checks them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanParts {
    /// Schema version: [`PLAN_VERSION_WITHOUT_CONTEXT`] for a plan without long-context stages,
    /// [`PLAN_VERSION`] for one with them.
    pub version: u32,
    pub cluster: Cluster,
    pub model: ModelSpec,
    pub seq_len: u32,
    /// Sequences per optimizer step, summed over replicas.
    pub global_batch: u32,
    /// Sequences per micro-batch.
    pub micro_batch: u32,
    pub schedule: Schedule,
    pub recompute: Recompute,
    /// How the attention core runs; plans written before it was a setting read as fused.
    #[serde(default)]
    pub attention: AttentionKernel,
    /// Gradients of a model chunk are reduced bucket by bucket during its last backward pass
    /// (the programs place each all-reduce right after that pass); off, after the whole
    /// backward. Plans written before it was a setting read as off, as they were priced.
    #[serde(default)]
    pub overlap_grad_reduce: bool,
    /// Optimizer states sharded over the data-parallel replicas (ZeRO-1).
    pub zero1: bool,
    /// Gradients sharded with them (ZeRO-2); plans written before it was a setting read as off,
    /// and plans without it leave it out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shard_gradients: bool,
    /// Plans written before it was a setting read as bf16, as they were priced.
    #[serde(default)]
    pub precision: Precision,
    /// Plans written before it was a setting read as 16-bit, as they were priced.
    #[serde(default = "GradReduce::unstated")]
    pub grad_reduce: GradReduce,
    /// The share of each device's memory the plan leaves free; plans written before it was a
    /// setting read as none, as they were checked.
    #[serde(default)]
    pub memory_headroom: f64,
    /// Tensor-parallel degree of every stage (versions 1 and 2); from version 3, a stage's is its
    /// device count and this is the largest. Sequence parallelism is on where it exceeds 1.
    pub tp: u32,
    /// Model chunks per pipeline rank, v (Megatron's virtual pipeline size). With v > 1 each
    /// replica's `stages` are its p·v *virtual* stages in model order, and virtual stage j runs
    /// on the devices of rank j mod p (rank i holds chunks i, i + p, i + 2p, …), the layout the
    /// `interleaved` schedule needs. Omitted from plan files when 1.
    #[serde(default = "one_chunk", skip_serializing_if = "is_one_chunk")]
    pub virtual_stages: u32,
    /// Data-parallel replicas, each a pipeline; they may differ in devices, depth and batch share.
    pub replicas: Vec<Replica>,
    /// Gradient synchronisation across replicas, one group per range of layers whose holders
    /// are the same stages.
    pub dp_groups: Vec<DpGroup>,
}

fn one_chunk() -> u32 {
    1
}

fn is_one_chunk(virtual_stages: &u32) -> bool {
    *virtual_stages == 1
}

/// One data-parallel replica: a pipeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replica {
    /// Micro-batches this replica runs per step: its batch share.
    pub n_micro_batches: u32,
    /// Its stages in model order; virtual stages when the plan's `virtual_stages` exceeds 1.
    pub stages: Vec<Stage>,
    /// `boundaries[i]` carries activations from stage i to i + 1 and gradients back (for virtual
    /// stages, from the last rank to the first rank's next chunk where i + 1 is a multiple of p).
    pub boundaries: Vec<Route>,
}

/// One pipeline stage: a tensor-parallel group of identical devices in one node, or, for a long
/// context, the devices that split each sequence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// The TP group, `tp` devices; with `context`, its groups' devices, group after group.
    pub devices: Vec<DeviceId>,
    /// Transformer layers `layers.start..layers.end`; the first stage also holds the embedding,
    /// the last the final norm and output head.
    pub layers: LayerRange,
    /// How the stage splits each sequence over its devices (context and head parallelism);
    /// absent for a stage whose devices each hold whole sequences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<StageContext>,
}

/// How a point-to-point transfer or collective travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Route {
    /// Inside one vendor domain, over its native library (NCCL or RCCL).
    Native { vendor: Vendor },
    /// Between vendor domains, over the bridge in `mode`.
    Bridge { mode: BridgeMode },
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Route::Native { vendor } => f.write_str(vendor.native_library()),
            Route::Bridge { mode: BridgeMode::DeviceDirect } => f.write_str("bridge(device-direct)"),
            Route::Bridge { mode: BridgeMode::CpuForward } => f.write_str("bridge(cpu-forward)"),
        }
    }
}

/// Collective algorithm for a gradient synchronisation group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GradientAlgorithm {
    /// One ring through every member.
    Ring,
    /// Reduce-scatter inside each vendor domain, exchange 1/n shares across the bridge, all-gather.
    Hierarchical,
}

impl From<GradientAlgorithm> for medley_collective::Algorithm {
    /// The collective algorithm that runs a gradient group: the simulator lowers it, the
    /// runtime's communicator executes it.
    fn from(algorithm: GradientAlgorithm) -> Self {
        match algorithm {
            GradientAlgorithm::Ring => medley_collective::Algorithm::Ring,
            GradientAlgorithm::Hierarchical => medley_collective::Algorithm::Hierarchical,
        }
    }
}

/// A data-parallel gradient group: every replica's stage that holds `layers`, one member per
/// replica (times `tp` parallel groups, one per TP rank).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpGroup {
    pub layers: LayerRange,
    pub route: Route,
    pub algorithm: GradientAlgorithm,
}

/// Ranks that share each optimizer state of a stage's parameters (and each gradient, with
/// ZeRO-2): with ZeRO-1, every one of `n_replicas` copies of the stage times the
/// `holding_every_parameter` devices of each copy that hold all of its parameters (a long-context
/// stage's devices; a tensor-parallel group's ranks each hold their own part, so 1), as Megatron-LM
/// shards its distributed optimizer over dp × cp; without ZeRO-1, none. The one rule the search,
/// the evaluator and the simulator price memory and optimizer steps by.
pub fn state_shards(zero1: bool, n_replicas: u32, holding_every_parameter: u32) -> u32 {
    if zero1 { n_replicas * holding_every_parameter } else { 1 }
}

impl Plan {
    /// Checks every structural invariant of `parts` and makes them a plan.
    pub fn new(parts: PlanParts) -> Result<Plan, PlanError> {
        let plan = Plan { parts };
        plan.validate()?;
        Ok(plan)
    }

    /// A plan the planner assembled from its own layouts, correct by construction: checked only
    /// in debug builds (the search assembles many plans, and checking each cost the planner a
    /// quarter of its time on 8,192 GPUs).
    pub(crate) fn assembled(parts: PlanParts) -> Plan {
        debug_assert!(Plan::new(parts.clone()).is_ok(), "the planner assembled an invalid plan: {parts:?}");
        Plan { parts }
    }

    /// The plan's parts, to edit and check again with [`Plan::new`].
    pub fn into_parts(self) -> PlanParts {
        self.parts
    }

    /// The same layout under another schedule, if it can run it.
    pub fn with_schedule(self, schedule: Schedule) -> Result<Plan, PlanError> {
        Plan::new(PlanParts { schedule, ..self.parts })
    }

    /// The plan with every long-context stage exchanging keys and values by `exchange`.
    pub fn with_kv_exchange(self, exchange: KvExchange) -> Result<Plan, PlanError> {
        let mut parts = self.parts;
        let stages = parts.replicas.iter_mut().flat_map(|replica| replica.stages.iter_mut());
        stages.filter_map(|stage| stage.context.as_mut()).for_each(|context| context.kv_exchange = exchange);
        Plan::new(parts)
    }

    pub fn version(&self) -> u32 {
        self.parts.version
    }
    pub fn cluster(&self) -> &Cluster {
        &self.parts.cluster
    }
    pub fn model(&self) -> &ModelSpec {
        &self.parts.model
    }
    pub fn seq_len(&self) -> u32 {
        self.parts.seq_len
    }
    /// Sequences per optimizer step, summed over replicas.
    pub fn global_batch(&self) -> u32 {
        self.parts.global_batch
    }
    /// Sequences per micro-batch.
    pub fn micro_batch(&self) -> u32 {
        self.parts.micro_batch
    }
    pub fn schedule(&self) -> Schedule {
        self.parts.schedule
    }
    pub fn recompute(&self) -> Recompute {
        self.parts.recompute
    }
    pub fn attention(&self) -> AttentionKernel {
        self.parts.attention
    }
    pub fn precision(&self) -> Precision {
        self.parts.precision
    }
    /// The format gradients are reduced in over data-parallel replicas.
    pub fn grad_reduce(&self) -> GradReduce {
        self.parts.grad_reduce
    }
    pub fn memory_headroom(&self) -> f64 {
        self.parts.memory_headroom
    }
    pub fn overlap_grad_reduce(&self) -> bool {
        self.parts.overlap_grad_reduce
    }
    /// Optimizer states sharded over the data-parallel replicas (ZeRO-1).
    pub fn zero1(&self) -> bool {
        self.parts.zero1
    }

    /// Gradients sharded over the replicas with the optimizer states (ZeRO-2).
    pub fn shard_gradients(&self) -> bool {
        self.parts.shard_gradients
    }

    /// Ranks that share each optimizer state (and gradient, with ZeRO-2) of `stage`'s parameters:
    /// [`state_shards`] of this plan's replicas and, on a long-context stage, its devices.
    pub fn stage_state_shards(&self, stage: &Stage) -> u32 {
        let holding_every_parameter = if stage.context.is_some() { stage.devices.len() as u32 } else { 1 };
        state_shards(self.parts.zero1, self.parts.replicas.len() as u32, holding_every_parameter)
    }

    /// How the plan keeps each parameter's states, as the cost model prices them.
    pub fn state_format(&self) -> StateFormat {
        StateFormat {
            precision: self.parts.precision,
            grad_reduce: self.parts.grad_reduce,
            shard_gradients: self.parts.shard_gradients,
        }
    }
    /// The largest tensor-parallel degree of any stage ([`Plan::stage_tp`] is each one's).
    pub fn tp(&self) -> u32 {
        self.parts.tp
    }

    /// The tensor-parallel degree of `stage`: its device count (1 on a long-context stage, whose
    /// devices split each sequence instead).
    pub fn stage_tp(&self, stage: &Stage) -> u32 {
        if stage.context.is_some() { 1 } else { stage.devices.len() as u32 }
    }

    /// The TP degree of the plan's stages as people read it: `2`, or `1–4` where they differ.
    pub fn tp_label(&self) -> String {
        match self.uniform_tp() {
            Some(tp) => tp.to_string(),
            None => {
                let degrees: BTreeSet<u32> = self.stages().map(|stage| self.stage_tp(stage)).collect();
                let (low, high) = (degrees.first().copied().unwrap_or(1), degrees.last().copied().unwrap_or(1));
                format!("{low}–{high}")
            }
        }
    }

    /// The setting `stage` runs with: the plan's micro-batch and recomputation at its TP degree.
    pub fn stage_setting(&self, stage: &Stage) -> Setting {
        Setting { micro_batch: self.parts.micro_batch, tp: self.stage_tp(stage), recompute: self.parts.recompute }
    }

    /// The TP degree every stage shares, if they do.
    pub fn uniform_tp(&self) -> Option<u32> {
        let mut degrees = self.stages().map(|stage| self.stage_tp(stage));
        let first = degrees.next()?;
        degrees.all(|tp| tp == first).then_some(first)
    }
    /// Model chunks per pipeline rank (see [`PlanParts::virtual_stages`]).
    pub fn virtual_stages(&self) -> u32 {
        self.parts.virtual_stages
    }
    pub fn replicas(&self) -> &[Replica] {
        &self.parts.replicas
    }
    pub fn dp_groups(&self) -> &[DpGroup] {
        &self.parts.dp_groups
    }

    /// Micro-batches per step over all replicas.
    pub fn n_micro_batches(&self) -> u32 {
        self.replicas().iter().map(|replica| replica.n_micro_batches).sum()
    }

    /// Devices the plan uses, sorted, each once.
    pub fn used_devices(&self) -> Vec<DeviceId> {
        let mut used: Vec<DeviceId> = self.stages().flat_map(|stage| stage.devices.iter().copied()).collect();
        used.sort_unstable();
        used.dedup();
        used
    }

    /// Physical pipeline ranks of `replica`: p, its stages over the chunks per rank.
    pub fn n_ranks(&self, replica: &Replica) -> usize {
        replica.stages.len() / self.virtual_stages() as usize
    }

    /// The physical rank that runs (virtual) stage `stage_idx` of `replica`.
    pub fn rank_of(&self, replica: &Replica, stage_idx: usize) -> usize {
        stage_idx % self.n_ranks(replica)
    }

    /// Devices of the cluster the plan leaves idle.
    pub fn idle_devices(&self) -> Vec<DeviceId> {
        let used: BTreeSet<DeviceId> = self.used_devices().into_iter().collect();
        (0..self.cluster().n_gpus()).filter(|id| !used.contains(id)).collect()
    }

    fn stages(&self) -> impl Iterator<Item = &Stage> {
        self.replicas().iter().flat_map(|replica| replica.stages.iter())
    }

    /// The stage index of each replica that holds data-parallel group `group_idx`'s layers: a
    /// virtual stage index when the plan has several chunks per rank ([`Plan::rank_of`] gives
    /// its rank).
    pub fn holders(&self, group_idx: usize) -> Vec<usize> {
        let layers = self.parts.dp_groups[group_idx].layers;
        let holder = |replica: &Replica| replica.stages.iter().position(|stage| stage.layers.contains(layers));
        // A checked plan cuts its groups wherever any replica's stages are cut.
        self.replicas()
            .iter()
            .map(|replica| holder(replica).expect("a checked plan's group lies in one stage"))
            .collect()
    }

    /// Checks every structural invariant.
    fn validate(&self) -> Result<(), PlanError> {
        let parts = &self.parts;
        if !(PLAN_VERSION_WITHOUT_CONTEXT..=PLAN_VERSION).contains(&parts.version) {
            let (found, oldest, newest) = (parts.version, PLAN_VERSION_WITHOUT_CONTEXT, PLAN_VERSION);
            return Err(InvalidPlan::Version { found, oldest, newest }.into());
        }
        if parts.version < PLAN_VERSION_WITH_CONTEXT && self.has_context() {
            let needed = PLAN_VERSION_WITH_CONTEXT;
            return Err(InvalidPlan::ContextVersion { found: parts.version, needed }.into());
        }
        if parts.replicas.is_empty() {
            return Err(InvalidPlan::NoReplicas.into());
        }
        if let Err(err) = medley_spec::check_memory_headroom(parts.memory_headroom, "plan") {
            return Err(InvalidPlan::MemoryHeadroom(err.to_string()).into());
        }
        if let Err(err) = parts.cluster.check_precision(parts.precision) {
            return Err(InvalidPlan::Precision(err.to_string()).into());
        }
        if let Err(reason) = parts.grad_reduce.check_for(parts.precision) {
            return Err(InvalidPlan::Precision(format!("grad_reduce: {reason}")).into());
        }
        if let Err(reason) = medley_spec::check_shard_gradients(parts.shard_gradients, parts.zero1) {
            return Err(InvalidPlan::Precision(format!("shard_gradients: {reason}")).into());
        }
        if parts.tp == 0 || !tp_splits_heads(&parts.model, parts.tp) {
            let (heads, kv_heads) = (parts.model.n_heads(), parts.model.n_kv_heads());
            return Err(InvalidPlan::Tp { tp: parts.tp, heads, kv_heads }.into());
        }
        for (field, value) in [("virtual_stages", parts.virtual_stages), ("seq_len", parts.seq_len)] {
            if value == 0 {
                return Err(InvalidPlan::Zero { field }.into());
            }
        }
        if (parts.schedule == Schedule::Fixed(ScheduleKind::Interleaved)) != (parts.virtual_stages > 1) {
            return Err(PlanError::ScheduleMismatch { schedule: parts.schedule, virtual_stages: parts.virtual_stages });
        }
        let sequences: u64 = parts.replicas.iter().map(|replica| u64::from(replica.n_micro_batches)).sum::<u64>()
            * u64::from(parts.micro_batch);
        if parts.micro_batch == 0 || sequences != u64::from(parts.global_batch) {
            let (micro_batch, global_batch) = (parts.micro_batch, parts.global_batch);
            return Err(InvalidPlan::GlobalBatch { sequences, micro_batch, global_batch }.into());
        }
        let devices = parts.cluster.devices();
        let mut seen = BTreeSet::new();
        for (replica, shape) in parts.replicas.iter().enumerate() {
            self.validate_replica(shape, &devices, &mut seen)
                .map_err(|problem| InvalidPlan::Replica { replica, problem })?;
        }
        self.validate_dp_groups()?;
        let largest = self.stages().map(|stage| self.stage_tp(stage)).max().unwrap_or(1);
        if largest != parts.tp {
            return Err(InvalidPlan::LargestTp { tp: parts.tp, largest }.into());
        }
        Ok(())
    }

    fn validate_replica(
        &self,
        replica: &Replica,
        devices: &[medley_spec::DeviceSlot],
        seen: &mut BTreeSet<DeviceId>,
    ) -> Result<(), ReplicaProblem> {
        if replica.n_micro_batches == 0 {
            return Err(ReplicaProblem::NoMicroBatches);
        }
        if replica.boundaries.len() + 1 != replica.stages.len() {
            return Err(ReplicaProblem::Boundaries { stages: replica.stages.len(), found: replica.boundaries.len() });
        }
        self.validate_chunks(replica)?;
        let n_ranks = self.n_ranks(replica);
        let mut next_layer = 0;
        for (stage, shape) in replica.stages.iter().enumerate() {
            if shape.layers.start != next_layer || shape.layers.is_empty() {
                return Err(ReplicaProblem::Layers { stage, layers: shape.layers, from: next_layer });
            }
            next_layer = shape.layers.end;
            // A context needs one chunk per rank: on a later chunk its check fails at once.
            if let Some(context) = &shape.context {
                self.validate_context(context, &shape.devices, devices, seen)
                    .map_err(|problem| ReplicaProblem::Context { stage, problem })?;
                continue;
            }
            // Later chunks repeat their rank's devices, checked in `validate_chunks`.
            if stage >= n_ranks {
                continue;
            }
            let tp = shape.devices.len() as u32;
            if self.parts.version < PLAN_VERSION_PER_STAGE_TP && tp != self.parts.tp {
                let needed = PLAN_VERSION_PER_STAGE_TP;
                return Err(ReplicaProblem::TpGroup { stage, found: shape.devices.len(), tp: self.parts.tp, needed });
            }
            if tp == 0 || !tp_splits_heads(&self.parts.model, tp) {
                let (heads, kv_heads) = (self.parts.model.n_heads(), self.parts.model.n_kv_heads());
                return Err(ReplicaProblem::StageTp { stage, tp, heads, kv_heads });
            }
            let mut node = None;
            for &id in &shape.devices {
                let Some(slot) = devices.get(id as usize) else {
                    return Err(ReplicaProblem::UnknownDevice { stage, id, n_gpus: devices.len() });
                };
                if !seen.insert(id) {
                    return Err(ReplicaProblem::DeviceTwice { stage, id });
                }
                if *node.get_or_insert((slot.node_idx, slot.group_idx)) != (slot.node_idx, slot.group_idx) {
                    return Err(ReplicaProblem::TpAcrossNodes { stage });
                }
            }
        }
        if next_layer != self.parts.model.n_layers() {
            return Err(ReplicaProblem::Coverage { covered: next_layer, n_layers: self.parts.model.n_layers() });
        }
        for (boundary, route) in replica.boundaries.iter().enumerate() {
            let vendors =
                [&replica.stages[boundary], &replica.stages[boundary + 1]].map(|stage| self.stage_vendor(stage));
            self.check_route(*route, &vendors)
                .map_err(|problem| ReplicaProblem::BoundaryRoute { boundary, problem })?;
        }
        Ok(())
    }

    /// A long-context stage: tp = 1, one chunk per rank, known devices used once, a valid split.
    fn validate_context(
        &self,
        context: &StageContext,
        stage_devices: &[DeviceId],
        slots: &[medley_spec::DeviceSlot],
        seen: &mut BTreeSet<DeviceId>,
    ) -> Result<(), ContextProblem> {
        let (tp, virtual_stages) = (self.parts.tp, self.parts.virtual_stages);
        if tp != 1 || virtual_stages != 1 {
            return Err(ContextProblem::Degrees { tp, virtual_stages });
        }
        for &id in stage_devices {
            if (id as usize) >= slots.len() {
                return Err(ContextProblem::UnknownDevice { id, n_gpus: slots.len() });
            }
            if !seen.insert(id) {
                return Err(ContextProblem::DeviceTwice { id });
            }
        }
        context.check(stage_devices, &self.parts.cluster, slots, &self.parts.model, self.parts.seq_len)
    }

    /// Whether any stage splits its sequences (context or head parallelism).
    pub fn has_context(&self) -> bool {
        self.stages().any(|stage| stage.context.is_some())
    }

    /// With v > 1: the virtual stages split into v chunks over at least two ranks, and virtual
    /// stage j runs on rank j mod p's devices.
    fn validate_chunks(&self, replica: &Replica) -> Result<(), ReplicaProblem> {
        let (n_stages, v) = (replica.stages.len(), self.parts.virtual_stages as usize);
        if v == 1 {
            return Ok(());
        }
        if !n_stages.is_multiple_of(v) || n_stages / v < 2 {
            return Err(ReplicaProblem::Chunks { n_stages, virtual_stages: v });
        }
        let n_ranks = n_stages / v;
        for (stage, shape) in replica.stages.iter().enumerate().skip(n_ranks) {
            let rank_devices = &replica.stages[stage % n_ranks].devices;
            if shape.devices != *rank_devices {
                return Err(ReplicaProblem::ChunkDevices {
                    stage,
                    found: shape.devices.clone(),
                    n_ranks,
                    expected: rank_devices.clone(),
                });
            }
        }
        Ok(())
    }

    /// The groups cover the layer ranges where holders change, each over routes its holders can
    /// take.
    fn validate_dp_groups(&self) -> Result<(), InvalidPlan> {
        let expected = dp_layer_ranges(&self.parts.replicas);
        let found: Vec<LayerRange> = self.parts.dp_groups.iter().map(|group| group.layers).collect();
        if found != expected {
            return Err(InvalidPlan::DpGroupRanges { expected, found });
        }
        for group in &self.parts.dp_groups {
            // Every range lies inside one stage of each replica: the ranges are cut wherever any
            // replica's stages are, and the stages cover the model.
            let stages: Vec<usize> = self
                .parts
                .replicas
                .iter()
                .map(|replica| replica.stages.iter().position(|stage| stage.layers.contains(group.layers)))
                .collect::<Option<_>>()
                .ok_or(InvalidPlan::DpGroupRanges { expected: expected.clone(), found: found.clone() })?;
            let vendors: Vec<Vendor> = stages
                .iter()
                .zip(&self.parts.replicas)
                .map(|(&stage, replica)| self.stage_vendor(&replica.stages[stage]))
                .collect();
            self.check_route(group.route, &vendors)
                .map_err(|problem| InvalidPlan::DpGroupRoute { layers: group.layers, problem })?;
        }
        Ok(())
    }

    /// The vendor of each replica's stage that holds data-parallel group `group_idx`.
    pub fn holder_vendors(&self, group_idx: usize) -> Vec<Vendor> {
        self.holders(group_idx)
            .iter()
            .zip(self.replicas())
            .map(|(&stage_idx, replica)| self.stage_vendor(&replica.stages[stage_idx]))
            .collect()
    }

    /// The vendor of a stage's devices.
    pub fn stage_vendor(&self, stage: &Stage) -> Vendor {
        self.stage_group(stage).device.vendor
    }

    /// The node group a stage's devices belong to (a long-context stage's first device's: its
    /// groups may be of several device types, [`Plan::device_group`] tells each).
    pub fn stage_group(&self, stage: &Stage) -> &medley_spec::NodeGroup {
        self.device_group(stage.devices[0])
    }

    /// What a stage runs on, as a person reads it: a TP group's device type, or a long-context
    /// stage's groups, `cp8·hp4(H100-SXM×4+A100-80GB×4)`: 8 groups of 4 devices, 4 of each type.
    pub fn stage_label(&self, stage: &Stage) -> String {
        let Some(context) = &stage.context else { return self.stage_group(stage).device.name.clone() };
        let mut kinds: Vec<(&str, usize)> = Vec::new();
        for group in 0..context.groups.len() {
            let name = self.device_group(context.group_devices(&stage.devices, group)[0]).device.name.as_str();
            match kinds.iter_mut().find(|(kind, _)| *kind == name) {
                Some((_, count)) => *count += 1,
                None => kinds.push((name, 1)),
            }
        }
        let sizes: BTreeSet<usize> = context.groups.iter().map(|group| group.device_tokens.len()).collect();
        let hp = match sizes.len() {
            1 => format!("·hp{}", sizes.first().expect("one size")),
            _ => String::new(),
        };
        let kinds: Vec<String> = kinds.iter().map(|(name, count)| format!("{name}×{count}")).collect();
        format!("cp{}{hp}({})", context.groups.len(), kinds.join("+"))
    }

    /// The node group device `id` belongs to.
    pub fn device_group(&self, id: DeviceId) -> &medley_spec::NodeGroup {
        let cluster = &self.parts.cluster;
        let group_idx = cluster.group_first_ids().partition_point(|&first| first <= id) - 1;
        &cluster.groups()[group_idx]
    }

    fn check_route(&self, route: Route, vendors: &[Vendor]) -> Result<(), RouteProblem> {
        let mixed = vendors.iter().any(|vendor| *vendor != vendors[0]);
        match route {
            Route::Native { vendor } if !mixed && vendor == vendors[0] => Ok(()),
            Route::Native { vendor } => Err(RouteProblem::NativeAcrossVendors { vendor, vendors: vendors.to_vec() }),
            Route::Bridge { mode } if mixed && self.parts.cluster.bridge().modes().contains(&mode) => Ok(()),
            Route::Bridge { mode } if mixed => Err(RouteProblem::BridgeMode { mode }),
            Route::Bridge { .. } => Err(RouteProblem::BridgeInsideVendor),
        }
    }
}

/// Whether tensor parallelism `tp` splits the model's attention heads evenly (kv heads may be
/// split or replicated, as Megatron-LM does for grouped-query attention).
pub(crate) fn tp_splits_heads(model: &ModelSpec, tp: u32) -> bool {
    model.n_heads().is_multiple_of(tp)
        && (model.n_kv_heads().is_multiple_of(tp) || tp.is_multiple_of(model.n_kv_heads()))
}

/// The layer ranges of data-parallel groups: cut the model wherever any replica has a stage
/// boundary, so every range has exactly one holder stage per replica.
pub fn dp_layer_ranges(replicas: &[Replica]) -> Vec<LayerRange> {
    let cuts: BTreeSet<u32> = replicas
        .iter()
        .flat_map(|replica| replica.stages.iter().flat_map(|stage| [stage.layers.start, stage.layers.end]))
        .collect();
    let cuts: Vec<u32> = cuts.into_iter().collect();
    cuts.windows(2).map(|pair| LayerRange { start: pair[0], end: pair[1] }).collect()
}

#[cfg(test)]
mod tests {
    use super::state_shards;

    /// ZeRO-1 shards over every copy of a stage's parameters: the replicas times a long-context
    /// stage's devices (dp × cp), never over a tensor-parallel group's distinct parts.
    #[test]
    fn states_shard_over_every_holder_of_the_same_parameters() {
        assert_eq!(state_shards(true, 4, 1), 4);
        assert_eq!(state_shards(true, 4, 8), 32);
        assert_eq!(state_shards(false, 4, 8), 1);
    }
}

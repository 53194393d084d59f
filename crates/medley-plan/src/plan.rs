//! The Plan: explicit, versioned data saying which devices run which layers of which replica, and
//! how every parallel group communicates. The planner writes it; the schedule, simulator and
//! runtime read it. Schema version 1 is documented field by field below and in ARCHITECTURE.md.

use std::collections::BTreeSet;
use std::fmt;

use medley_spec::{BridgeMode, Cluster, DeviceId, ModelSpec, Recompute, Schedule, Vendor};
use serde::{Deserialize, Serialize};

use crate::error::PlanError;

/// The plan schema this build reads and writes.
pub const PLAN_VERSION: u32 = 1;

/// A complete training layout for one cluster, model and job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Schema version, [`PLAN_VERSION`].
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
    /// Optimizer states sharded over the data-parallel replicas (ZeRO-1).
    pub zero1: bool,
    /// Tensor-parallel degree of every stage; sequence parallelism is on when it exceeds 1.
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

/// One pipeline stage: a tensor-parallel group of identical devices in one node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// The TP group, `tp` devices.
    pub devices: Vec<DeviceId>,
    /// Transformer layers `layers.start..layers.end`; the first stage also holds the embedding,
    /// the last the final norm and output head.
    pub layers: LayerRange,
}

/// A half-open range of transformer layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRange {
    pub start: u32,
    pub end: u32,
}

impl LayerRange {
    pub fn len(self) -> u32 {
        self.end - self.start
    }

    pub fn is_empty(self) -> bool {
        self.end <= self.start
    }

    pub fn contains(self, other: LayerRange) -> bool {
        self.start <= other.start && other.end <= self.end
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
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
pub enum Algorithm {
    /// One ring through every member.
    Ring,
    /// Reduce-scatter inside each vendor domain, exchange 1/n shares across the bridge, all-gather.
    Hierarchical,
}

impl From<Algorithm> for medley_collective::Algorithm {
    /// The collective algorithm that runs a gradient group: the simulator lowers it, the
    /// runtime's communicator executes it.
    fn from(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::Ring => medley_collective::Algorithm::Ring,
            Algorithm::Hierarchical => medley_collective::Algorithm::Hierarchical,
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
    pub algorithm: Algorithm,
}

impl Plan {
    /// Micro-batches per step over all replicas.
    pub fn n_micro_batches(&self) -> u32 {
        self.replicas.iter().map(|replica| replica.n_micro_batches).sum()
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
        replica.stages.len() / self.virtual_stages as usize
    }

    /// The physical rank that runs (virtual) stage `stage_idx` of `replica`.
    pub fn rank_of(&self, replica: &Replica, stage_idx: usize) -> usize {
        stage_idx % self.n_ranks(replica)
    }

    /// Devices of the cluster the plan leaves idle.
    pub fn idle_devices(&self) -> Vec<DeviceId> {
        let used: BTreeSet<DeviceId> = self.used_devices().into_iter().collect();
        (0..self.cluster.n_gpus()).filter(|id| !used.contains(id)).collect()
    }

    fn stages(&self) -> impl Iterator<Item = &Stage> {
        self.replicas.iter().flat_map(|replica| replica.stages.iter())
    }

    /// The stage index of each replica that holds `layers`: a virtual stage index when the plan
    /// has several chunks per rank ([`Plan::rank_of`] gives its rank).
    pub fn holders(&self, layers: LayerRange) -> Vec<usize> {
        self.replicas
            .iter()
            .map(|replica| {
                replica.stages.iter().position(|stage| stage.layers.contains(layers)).expect("validated plan")
            })
            .collect()
    }

    /// Checks every structural invariant; a plan read from a file must pass this before use.
    pub fn validate(&self) -> Result<(), PlanError> {
        let invalid = |message: String| Err(PlanError::Invalid(message));
        if self.version != PLAN_VERSION {
            return invalid(format!(
                "plan version {} is not supported; this build reads version {PLAN_VERSION}",
                self.version
            ));
        }
        if self.replicas.is_empty() {
            return invalid("a plan needs at least one replica".into());
        }
        if self.tp == 0 || !tp_splits_heads(&self.model, self.tp) {
            return invalid(format!(
                "tp={} must be at least 1 and divide the model's {} heads and {} kv heads",
                self.tp,
                self.model.n_heads(),
                self.model.n_kv_heads()
            ));
        }
        if self.virtual_stages == 0 {
            return invalid("virtual_stages must be at least 1".into());
        }
        if (self.schedule == Schedule::Interleaved) != (self.virtual_stages > 1) {
            return Err(PlanError::ScheduleMismatch { schedule: self.schedule, virtual_stages: self.virtual_stages });
        }
        if self.seq_len == 0 {
            return invalid("seq_len must be at least 1".into());
        }
        let sequences: u64 = self.replicas.iter().map(|replica| u64::from(replica.n_micro_batches)).sum::<u64>()
            * u64::from(self.micro_batch);
        if self.micro_batch == 0 || sequences != u64::from(self.global_batch) {
            return invalid(format!(
                "replicas run {sequences} sequences in micro-batches of {}, which is not the global batch {}",
                self.micro_batch, self.global_batch
            ));
        }
        let devices = self.cluster.devices();
        let mut seen = BTreeSet::new();
        for (replica_idx, replica) in self.replicas.iter().enumerate() {
            self.validate_replica(replica_idx, replica, &devices, &mut seen)?;
        }
        self.validate_dp_groups()
    }

    fn validate_replica(
        &self,
        replica_idx: usize,
        replica: &Replica,
        devices: &[medley_spec::DeviceSlot],
        seen: &mut BTreeSet<DeviceId>,
    ) -> Result<(), PlanError> {
        let invalid = |message: String| Err(PlanError::Invalid(format!("replica {replica_idx}: {message}")));
        if replica.n_micro_batches == 0 {
            return invalid("runs no micro-batches".into());
        }
        if replica.boundaries.len() + 1 != replica.stages.len() {
            return invalid(format!(
                "{} stages need {} boundaries, found {}",
                replica.stages.len(),
                replica.stages.len().saturating_sub(1),
                replica.boundaries.len()
            ));
        }
        self.validate_chunks(replica)
            .map_err(|message| PlanError::Invalid(format!("replica {replica_idx}: {message}")))?;
        let n_ranks = self.n_ranks(replica);
        let mut next_layer = 0;
        for (stage_idx, stage) in replica.stages.iter().enumerate() {
            if stage.layers.start != next_layer || stage.layers.is_empty() {
                return invalid(format!(
                    "stage {stage_idx} holds layers {}, expected a non-empty range from {next_layer}",
                    stage.layers
                ));
            }
            next_layer = stage.layers.end;
            // Later chunks repeat their rank's devices, checked in `validate_chunks`.
            if stage_idx >= n_ranks {
                continue;
            }
            if stage.devices.len() != self.tp as usize {
                return invalid(format!("stage {stage_idx} has {} devices for tp={}", stage.devices.len(), self.tp));
            }
            let mut node = None;
            for &id in &stage.devices {
                let Some(slot) = devices.get(id as usize) else {
                    return invalid(format!(
                        "stage {stage_idx}: device {id} is not in the {}-GPU cluster",
                        devices.len()
                    ));
                };
                if !seen.insert(id) {
                    return invalid(format!("stage {stage_idx}: device {id} is used twice"));
                }
                if *node.get_or_insert((slot.node_idx, slot.group_idx)) != (slot.node_idx, slot.group_idx) {
                    return invalid(format!("stage {stage_idx}: a tensor-parallel group must sit in one node"));
                }
            }
        }
        if next_layer != self.model.n_layers() {
            return invalid(format!("stages cover layers 0..{next_layer} of the model's {}", self.model.n_layers()));
        }
        for (boundary_idx, route) in replica.boundaries.iter().enumerate() {
            let vendors = [&replica.stages[boundary_idx], &replica.stages[boundary_idx + 1]]
                .map(|stage| self.stage_vendor(stage));
            self.check_route(*route, &vendors).map_err(|message| {
                PlanError::Invalid(format!("replica {replica_idx}: boundary {boundary_idx}: {message}"))
            })?;
        }
        Ok(())
    }

    /// With v > 1: the virtual stages split into v chunks over at least two ranks, and virtual
    /// stage j runs on rank j mod p's devices.
    fn validate_chunks(&self, replica: &Replica) -> Result<(), String> {
        let (n_stages, v) = (replica.stages.len(), self.virtual_stages as usize);
        if v == 1 {
            return Ok(());
        }
        if !n_stages.is_multiple_of(v) || n_stages / v < 2 {
            return Err(format!(
                "{n_stages} virtual stages do not split into virtual_stages={v} chunks on each of at least 2 ranks"
            ));
        }
        let n_ranks = n_stages / v;
        for (stage_idx, stage) in replica.stages.iter().enumerate().skip(n_ranks) {
            let rank_devices = &replica.stages[stage_idx % n_ranks].devices;
            if stage.devices != *rank_devices {
                return Err(format!(
                    "virtual stage {stage_idx} runs on devices {:?}, but rank {} (virtual stage {stage_idx} mod {n_ranks}) has {:?}",
                    stage.devices,
                    stage_idx % n_ranks,
                    rank_devices
                ));
            }
        }
        Ok(())
    }

    fn validate_dp_groups(&self) -> Result<(), PlanError> {
        let expected = dp_layer_ranges(&self.replicas);
        let found: Vec<LayerRange> = self.dp_groups.iter().map(|group| group.layers).collect();
        if found != expected {
            return Err(PlanError::Invalid(format!(
                "dp_groups must cover the layer ranges where holders change, {expected:?}; found {found:?}"
            )));
        }
        for group in &self.dp_groups {
            let vendors = self.holder_vendors(group.layers);
            self.check_route(group.route, &vendors)
                .map_err(|message| PlanError::Invalid(format!("dp group {}: {message}", group.layers)))?;
        }
        Ok(())
    }

    /// The vendor of each replica's stage that holds `layers`.
    pub fn holder_vendors(&self, layers: LayerRange) -> Vec<Vendor> {
        self.holders(layers)
            .iter()
            .zip(&self.replicas)
            .map(|(&stage_idx, replica)| self.stage_vendor(&replica.stages[stage_idx]))
            .collect()
    }

    /// The vendor of a stage's devices.
    pub fn stage_vendor(&self, stage: &Stage) -> Vendor {
        self.stage_group(stage).device.vendor
    }

    /// The node group a stage's devices belong to.
    pub fn stage_group(&self, stage: &Stage) -> &medley_spec::NodeGroup {
        let first_ids = self.cluster.group_first_ids();
        let group_idx = first_ids.partition_point(|&first| first <= stage.devices[0]) - 1;
        &self.cluster.groups()[group_idx]
    }

    fn check_route(&self, route: Route, vendors: &[Vendor]) -> Result<(), String> {
        let mixed = vendors.iter().any(|vendor| *vendor != vendors[0]);
        match route {
            Route::Native { vendor } if !mixed && vendor == vendors[0] => Ok(()),
            Route::Native { vendor } => Err(format!("native {vendor} route for members of vendors {vendors:?}")),
            Route::Bridge { mode } if mixed && self.cluster.bridge().modes().contains(&mode) => Ok(()),
            Route::Bridge { mode } if mixed => Err(format!("the cluster's bridge does not offer {mode:?}")),
            Route::Bridge { .. } => Err("a bridge route for members of one vendor".into()),
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

/// Replicas that look alike: the same device type and layer count at every stage.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaShape {
    /// (device type, layers) per stage.
    pub stages: Vec<(String, u32)>,
    pub n_replicas: u32,
    /// Distinct batch shares among these replicas, ascending.
    pub micro_batches: Vec<u32>,
}

impl Plan {
    /// The replicas grouped by shape, in order of first appearance.
    pub fn replica_shapes(&self) -> Vec<ReplicaShape> {
        let mut shapes: Vec<ReplicaShape> = Vec::new();
        for replica in &self.replicas {
            let stages: Vec<(String, u32)> = replica
                .stages
                .iter()
                .map(|stage| (self.stage_group(stage).device.name.clone(), stage.layers.len()))
                .collect();
            match shapes.iter_mut().find(|shape| shape.stages == stages) {
                Some(shape) => {
                    shape.n_replicas += 1;
                    if let Err(at) = shape.micro_batches.binary_search(&replica.n_micro_batches) {
                        shape.micro_batches.insert(at, replica.n_micro_batches);
                    }
                }
                None => {
                    shapes.push(ReplicaShape { stages, n_replicas: 1, micro_batches: vec![replica.n_micro_batches] })
                }
            }
        }
        shapes
    }
}

//! Planner errors.

use medley_spec::{BridgeMode, DeviceId, Schedule, Vendor};
use thiserror::Error;

use crate::layers::LayerRange;

#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    /// A plan's structure is broken (usually a hand-edited plan file). The message quotes the
    /// problem, which is therefore not also its source: `{:#}` would print it twice.
    #[error("invalid plan: {0}")]
    Invalid(InvalidPlan),
    /// The job cannot run on the cluster at all (a precision some devices lack); the message
    /// says what to do.
    #[error("{0}")]
    Job(String),
    /// No layout of the cluster fits the model and job; the message says what would.
    #[error("nothing fits: {0}")]
    NothingFits(String),
    /// More node groups than the search enumerates.
    #[error(
        "the cluster has {groups} node groups; the search takes at most {max}: merge groups of the same device and node shape"
    )]
    TooManyGroups { groups: usize, max: usize },
    /// A schedule that cannot run a plan with this many model chunks per rank.
    #[error(
        "schedule {schedule} does not run plans with {virtual_stages} virtual stage(s) per rank: interleaved needs more than one (e.g. --fix ...,vpp=2), every other schedule exactly one"
    )]
    ScheduleMismatch { schedule: Schedule, virtual_stages: u32 },
    /// A fixed layout that cannot be built on this cluster.
    #[error("layout {layout}: {message}")]
    Layout { layout: String, message: String },
}

/// Refuses a job whose precision some of the cluster's devices lack: where a job meets a cluster,
/// before anything is priced.
pub(crate) fn check_precision(cluster: &medley_spec::Cluster, job: &medley_spec::JobSpec) -> Result<(), PlanError> {
    cluster.check_precision(job.precision()).map_err(|err| PlanError::Job(err.to_string()))
}

impl From<InvalidPlan> for PlanError {
    fn from(problem: InvalidPlan) -> Self {
        PlanError::Invalid(problem)
    }
}

/// What is wrong with a plan's parts, naming the field.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum InvalidPlan {
    #[error("plan version {found} is not supported; this build reads versions {oldest} to {newest}")]
    Version { found: u32, oldest: u32, newest: u32 },
    #[error("a stage with `context` needs plan version {needed}; the plan says {found}")]
    ContextVersion { found: u32, needed: u32 },
    #[error("a plan needs at least one replica")]
    NoReplicas,
    /// A device of the cluster lacks the plan's precision, or its gradients reduce in a format the
    /// precision has not (the message says which and what to do).
    #[error("{0}")]
    Precision(String),
    /// The plan's headroom is out of range (the message says the range).
    #[error("{0}")]
    MemoryHeadroom(String),
    #[error("tp={tp} must be at least 1 and divide the model's {heads} heads and {kv_heads} kv heads")]
    Tp { tp: u32, heads: u32, kv_heads: u32 },
    #[error("{field} must be at least 1")]
    Zero { field: &'static str },
    #[error("tp={tp}, but the largest stage TP degree (a stage's device count) is {largest}")]
    LargestTp { tp: u32, largest: u32 },
    #[error(
        "replicas run {sequences} sequences in micro-batches of {micro_batch}, which is not the global batch {global_batch}"
    )]
    GlobalBatch { sequences: u64, micro_batch: u32, global_batch: u32 },
    #[error("replica {replica}: {problem}")]
    Replica { replica: usize, problem: ReplicaProblem },
    #[error("dp_groups must cover the layer ranges where holders change, {expected:?}; found {found:?}")]
    DpGroupRanges { expected: Vec<LayerRange>, found: Vec<LayerRange> },
    #[error("dp group {layers}: {problem}")]
    DpGroupRoute { layers: LayerRange, problem: RouteProblem },
}

/// What is wrong with one replica of a plan.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ReplicaProblem {
    #[error("runs no micro-batches")]
    NoMicroBatches,
    #[error("{stages} stages need {} boundaries, found {found}", .stages.saturating_sub(1))]
    Boundaries { stages: usize, found: usize },
    #[error(
        "{n_stages} virtual stages do not split into virtual_stages={virtual_stages} chunks on each of at least 2 ranks"
    )]
    Chunks { n_stages: usize, virtual_stages: usize },
    #[error(
        "virtual stage {stage} runs on devices {found:?}, but rank {} (virtual stage {stage} mod {n_ranks}) has {expected:?}",
        .stage % .n_ranks
    )]
    ChunkDevices { stage: usize, found: Vec<DeviceId>, n_ranks: usize, expected: Vec<DeviceId> },
    #[error("stage {stage} holds layers {layers}, expected a non-empty range from {from}")]
    Layers { stage: usize, layers: LayerRange, from: u32 },
    #[error("stage {stage} has {found} devices for tp={tp}: stages of their own TP degree need plan version {needed}")]
    TpGroup { stage: usize, found: usize, tp: u32, needed: u32 },
    #[error("stage {stage}: tp={tp} (its device count) must divide the model's {heads} heads and {kv_heads} kv heads")]
    StageTp { stage: usize, tp: u32, heads: u32, kv_heads: u32 },
    #[error("stage {stage}: device {id} is not in the {n_gpus}-GPU cluster")]
    UnknownDevice { stage: usize, id: DeviceId, n_gpus: usize },
    #[error("stage {stage}: device {id} is used twice")]
    DeviceTwice { stage: usize, id: DeviceId },
    #[error("stage {stage}: a tensor-parallel group must sit in one node")]
    TpAcrossNodes { stage: usize },
    #[error("stages cover layers 0..{covered} of the model's {n_layers}")]
    Coverage { covered: u32, n_layers: u32 },
    #[error("boundary {boundary}: {problem}")]
    BoundaryRoute { boundary: usize, problem: RouteProblem },
    #[error("stage {stage}: context: {problem}")]
    Context { stage: usize, problem: ContextProblem },
}

/// What is wrong with a long-context stage's split of the sequence.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ContextProblem {
    #[error(
        "context and head parallelism need tp=1 and virtual_stages=1 (found tp={tp}, virtual_stages={virtual_stages})"
    )]
    Degrees { tp: u32, virtual_stages: u32 },
    #[error("groups hold {in_groups} devices (one device_tokens entry each), the stage {stage_devices}")]
    Devices { stage_devices: usize, in_groups: usize },
    #[error(
        "groups hold {tokens} tokens in {block}-token blocks; the sequence has {seq_len} (block must be at least 1)"
    )]
    Tokens { block: u32, tokens: u64, seq_len: u32 },
    #[error("device {id} is not in the {n_gpus}-GPU cluster")]
    UnknownDevice { id: DeviceId, n_gpus: usize },
    #[error("device {id} is used twice")]
    DeviceTwice { id: DeviceId },
    #[error("group {group}: its devices must sit in one node")]
    GroupAcrossNodes { group: usize },
    #[error("groups of different vendors: keys and values would cross the bridge, which is not priced yet")]
    MixedVendors,
    #[error("group {group}: a head–tail shard of {tokens} tokens must be a positive multiple of {unit} (two blocks)")]
    Shard { group: usize, tokens: u32, unit: u64 },
    #[error("group {group} has no devices")]
    EmptyGroup { group: usize },
    #[error("group {group}: device_tokens add up to {held}, the group's shard to {tokens} (each device at least 1)")]
    DeviceTokens { group: usize, held: u64, tokens: u32 },
    #[error("group {group}: {heads} heads entries for {devices} devices")]
    HeadCount { group: usize, devices: usize, heads: usize },
    #[error("group {group}: heads: {reason}")]
    Heads { group: usize, reason: String },
}

/// A route its endpoints cannot take.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum RouteProblem {
    #[error("native {vendor} route for members of vendors {vendors:?}")]
    NativeAcrossVendors { vendor: Vendor, vendors: Vec<Vendor> },
    #[error("the cluster's bridge does not offer {mode:?}")]
    BridgeMode { mode: BridgeMode },
    #[error("a bridge route for members of one vendor")]
    BridgeInsideVendor,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error and its sources as `{:#}` prints them (anyhow's chain, joined by ": ").
    pub(crate) fn chain(err: &dyn std::error::Error) -> String {
        let mut text = err.to_string();
        let mut source = err.source();
        while let Some(next) = source {
            text += &format!(": {next}");
            source = next.source();
        }
        text
    }

    /// Issue 31: `medley plan --plan` with a broken plan printed its problem twice, the message
    /// quoting it and its source being it.
    #[test]
    fn an_invalid_plan_prints_its_problem_once() {
        let chain = chain(&PlanError::from(InvalidPlan::NoReplicas));
        assert_eq!(chain, "invalid plan: a plan needs at least one replica");
    }
}

//! medley's Plan and its planner.
//!
//! A [`Plan`] says, explicitly, which devices form each data-parallel replica's pipeline stages,
//! which layers each stage holds, each replica's batch share, and how every parallel group
//! communicates (native library or cross-vendor bridge). [`search`] finds fast plans for a mixed
//! cluster; [`baselines`] builds the layouts they are compared with; [`evaluate`] prices any plan.

mod assemble;
pub mod baselines;
mod candidates;
mod error;
mod evaluate;
mod layers;
pub mod long_context;
pub mod long_context_price;
mod long_context_stage;
mod partition;
mod plan;
mod replica_shape;
mod search;
pub mod shard_split;

pub use assemble::{ReplicaLayout, assemble, stages_from_counts};
pub use candidates::{Candidate, SearchOutcome};
pub use error::{ContextProblem, InvalidPlan, PlanError, ReplicaProblem, RouteProblem};
pub use evaluate::{PipelineTiming, Prediction, Utilisation, evaluate, max_k_within_memory, tied_embedding_syncs_s};
pub use layers::LayerRange;
pub use long_context_stage::{HeadGroup, StageContext};
pub use partition::{ClassShare, MAX_GROUPS, ReplicaClass, StageLoad, min_max_layers, split_micro_batches};
pub use plan::{
    DpGroup, GradientAlgorithm, PLAN_VERSION, PLAN_VERSION_PER_STAGE_TP, PLAN_VERSION_WITH_CONTEXT,
    PLAN_VERSION_WITHOUT_CONTEXT, Plan, PlanParts, Replica, Route, Stage, state_shards,
};
pub use replica_shape::ReplicaShape;
pub use search::{SearchOptions, search};

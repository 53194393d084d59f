//! Planner errors.

use medley_spec::Schedule;
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    /// A plan's structure is broken (usually a hand-edited plan file).
    #[error("invalid plan: {0}")]
    Invalid(String),
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

//! A plan as the frameworks people run take it, or an exact refusal: what a framework cannot
//! express (uneven batch shares, replicas with different stages, a job across vendors, ...) is
//! never approximated.
//!
//! - [`megatron`]: Megatron-LM's arguments (parallel sizes, the uneven stages as
//!   `--pipeline-model-parallel-layout`, batch, recompute, model shape) and a torchrun launch
//!   script whose rank order puts each rank on the device the plan chose.
//! - [`expressible`]: the search restricted to plans a framework can run.
//! - [`placement`]: a framework's fixed rank order against the plan's devices: which host and GPU
//!   each rank must run on, and whether hosts can be listed so that it does.

mod common;
pub mod expressible;
pub mod megatron;
pub mod placement;
pub mod torchtitan;

pub use common::Arg;
pub use expressible::{Framework, Restricted, restrict};

/// The frameworks' names, as refusals name them.
pub const MEGATRON: &str = "Megatron-LM";
pub const TORCHTITAN: &str = "torchtitan";

/// Why a plan cannot be exported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    /// The framework cannot run the plan as it is.
    #[error("{framework} cannot run this plan: {reason}")]
    NotExpressible { framework: &'static str, reason: String },
}

impl ExportError {
    pub(crate) fn refused(framework: &'static str, reason: impl Into<String>) -> ExportError {
        ExportError::NotExpressible { framework, reason: reason.into() }
    }
}

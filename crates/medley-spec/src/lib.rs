//! medley's input specifications: device types, clusters, models and jobs.
//!
//! Everything is parsed and validated here, once: downstream crates receive types whose
//! invariants hold and never re-check them. Parsers take text plus a source name (a path or a flag)
//! so errors can say where; reading files is the caller's business.

mod cluster;
mod device;
mod error;
mod job;
mod model;
mod schedule;

pub use cluster::{
    Bridge, BridgeMode, Cluster, DEFAULT_GPUS_PER_NODE, DeviceId, DeviceSlot, Fabric, GroupLink, MAX_GPUS, NodeGroup,
};
pub use device::{
    Architecture, DeviceSpec, LinkKind, Package, StatedEfficiency, Vendor, catalog_device, catalog_devices,
    devices_per_counted,
};
pub use error::{Echo, MAX_ECHO_CHARS, SpecError, echo};
pub use job::{
    AttentionKernel, DEFAULT_MEMORY_HEADROOM, GradReduce, JobParts, JobSpec, Precision, Recompute,
    check_memory_headroom, check_shard_gradients,
};
pub use model::{Experts, MlpKind, ModelParts, ModelSpec, RopeScaling, catalog_model, catalog_model_names};
pub use schedule::{Schedule, ScheduleKind};

/// A link bandwidth as a flag gives it: a positive, finite number of GB/s.
pub fn parse_gb_s(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(gb_s) if gb_s.is_finite() && gb_s > 0.0 => Ok(gb_s),
        _ => Err(format!("{text:?} is not a positive number of GB/s")),
    }
}

//! The same stages, from the same source, on burn 0.21's CUDA and ROCm backends.

#[path = "backend_gpu.rs"]
mod backend;
// The CPU build (cpu.rs) loads the same files: that is the point.
#[allow(clippy::duplicate_mod)]
#[path = "burn_stage/mod.rs"]
pub(crate) mod stage;

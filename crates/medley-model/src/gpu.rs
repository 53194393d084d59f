//! The same stages, from the same source, on burn 0.21's CUDA and ROCm backends.

#[path = "backend_gpu.rs"]
mod backend;
#[path = "burn_stage/mod.rs"]
pub(crate) mod stage;

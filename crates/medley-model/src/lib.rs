//! The model medley trains: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query
//! attention) cut into pipeline stages, with everything a worker needs around it.
//!
//! - [`ModelConfig`]: the trainable shape, from the same [`medley_spec::ModelSpec`] the planner
//!   prices, plus the sequence length.
//! - [`params`]: every parameter's name and shape per layer range, and its seeded initial value,
//!   which depends only on the seed and the name, so any plan starts from the same weights.
//! - [`StageCompute`]: the thin trait a tensor library implements (forward, backward with an
//!   external upstream gradient, accumulated parameter gradients, loading parameters).
//!   [`stage_compute`] builds it on a [`ComputeDevice`]: one model source on burn, compiled
//!   against burn 0.22 for the CPU and against burn 0.21 for CUDA and ROCm GPUs.
//! - [`long_context`]: where a device of a long-context stage stands (its tokens, its heads, its
//!   group and lane) and the collectives its passes run; [`context_compute`] is its compute.
//! - [`StageState`]: one rank's parameters, gradients and AdamW state on the host, with safetensors
//!   checkpoints, driving a `StageCompute`.
//! - [`data`]: the byte-level tokenizer, the shipped corpus and deterministic sample indexing.
//!
//! Parameters live on the host as `f32` between steps: gradients are all-reduced and the optimizer
//! runs there, so the compute library only ever sees one step's tensors.

// Checkpoints are memory-mapped to read only each stage's tensors.
#![allow(unsafe_code)]

mod checkpoint;
mod compute;
mod compute_device;
mod config;
mod cpu;
pub mod data;
mod device;
mod error;
mod fused;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod gpu;
mod kernels;
pub mod long_context;
mod optim;
pub mod params;
mod row_split;
mod stage;
pub mod tensor_parallel;

pub use checkpoint::{NamedTensors, load_tensors, load_tensors_where, save_tensors, write_atomically};
pub use compute::{HostTensor, MicroBatch, StageCompute, StageOutput};
pub use compute_device::ComputeDevice;
pub use config::ModelConfig;
pub use device::{context_compute, matmul_seconds, stage_compute, tensor_parallel_compute};
pub use error::ModelError;
pub use optim::{AdamW, AdamWState, Moments};
pub use params::ParamSpec;
pub use stage::{MOMENT_PREFIXES, StageState, parameter_of};

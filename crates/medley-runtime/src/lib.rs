//! The runtime: trains for real by executing a plan's per-rank programs.
//!
//! One [`Worker`] per pipeline rank of a [`medley_plan::Plan`] (a process, or a thread in tests)
//! joins the job through `medley-comm`, builds its model chunks as `medley-model` stages and runs
//! the very [`medley_schedule::CheckedPrograms`] the simulator executes: forward and backward passes per
//! micro-batch, activations and gradients to and from neighbour stages as asynchronous sends and
//! tagged receives, one gradient all-reduce per data-parallel group over a communicator split
//! for it (in the plan's algorithm, hierarchical across vendor domains), the optimizer step.
//! Replicas take consecutive slices of each step's global batch and every loss is scaled by the
//! global batch's token count, so the summed gradients are the sample-weighted mean whatever the
//! replicas' shares.
//!
//! Each worker computes where [`WorkerOptions::device`] says: this machine's CPU cores (the
//! default, on as many threads as the worker owns cores), or a CUDA or ROCm GPU through the same
//! model code. Heterogeneity is emulated: every worker stands in for the
//! plan's device at its rank ([`EmulatedDevice`]), joins that device's vendor domain, and with
//! [`WorkerOptions::emulate_speed`] stretches each pass by the device's cost-model slowdown
//! relative to the cluster's fastest device type.

mod calibrate;
mod checkpoint;
mod device;
mod emulation;
mod error;
mod groups;
mod host_available;
mod host_memory;
mod layout;
mod long_context;
mod metrics;
mod native;
mod p2p;
mod reduction;
pub mod run_dir;
mod tensor_parallel;
mod train;
mod worker;
mod zero;

pub use calibrate::{Measured, emulation_calibration, measure_model_pass};
pub use checkpoint::{
    FileChecksum, Manifest, check_resumable, read_latest, sweep_incomplete, unfinished_later_checkpoints,
    verify_checkpoint,
};
pub use device::DeviceChoice;
pub use emulation::time_dilation;
pub use error::RuntimeError;
pub use host_available::check_memory;
pub use host_memory::{HostMemory, calibration_memory, peak_rss_mib, worker_memory};
pub use layout::{
    ContextSeat, EmulatedDevice, RankLayout, as_trained, check_runnable, context_groups, rank_ids, worker_count,
};
pub use metrics::{RankMetrics, StepMetrics};
pub use run_dir::{ClaimedRun, Emulation, RunDir};
pub use train::{StopRequest, TrainEnd, TrainOptions};
pub use worker::{LinkEmulation, Worker, WorkerOptions};

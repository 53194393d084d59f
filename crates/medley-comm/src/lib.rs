//! The medley communicator: collectives and point-to-point messages between the ranks of a job,
//! across vendor domains.
//!
//! A collective is planned by [`medley_collective::plan_steps`] (ring, tree, hierarchical across
//! domains, pairwise) and this rank's step list is executed over its links: single-copy shared
//! memory between ranks of one domain on one host (the native backend here), TCP with parallel
//! striped streams between hosts and across the bridge between domains. Ranks meet through a
//! token-checked TCP store at MASTER_ADDR:MASTER_PORT ([`LaunchEnv`], torchrun's variables).
//! A dead or silent peer, a mismatched call or a malformed frame fails the operation on every
//! rank with an error naming the rank to blame, within [`Config::timeout`]; nothing hangs.
//!
//! A native NCCL/RCCL backend would be one more implementation of the crate's `Transport` trait
//! (point-to-point send/receive with tickets; see `transport/mod.rs`): the algorithms and the
//! executor do not change.

// Shared-memory transport and the bridge's device copies map and share memory across processes.
#![allow(unsafe_code)]

// The transports rest on Linux system calls: process_vm_readv for single-copy shared memory,
// futex for waits, sched_setaffinity for core binding.
#[cfg(not(target_os = "linux"))]
compile_error!("medley runs on Linux only: its communicator uses process_vm_readv, futex and sched_setaffinity");

mod bind;
mod comm;
mod dtype;
mod env;
mod error;
mod exec;
mod mesh;
mod session;
mod store;
mod transport;
mod untrusted;
mod wait;
mod wire;

pub use comm::Communicator;
pub use dtype::{DType, Element};
pub use env::{Config, CpuBinding, LaunchEnv, StoreHost, TransportKind};
pub use error::CommError;
pub use half::{bf16, f16};
pub use medley_collective::{Algorithm, Counts, Op, ReduceOp};
pub use store::StoreServer;
pub use transport::shm::remove_job_shared_memory;
#[doc(hidden)]
pub use untrusted::{decode_untrusted, greeting_bytes};

//! GPUs through their vendors' own libraries, every one loaded at run time, so that medley builds
//! and tests on machines with no GPU toolkit and finds the libraries where a GPU is.
//!
//! - [`Gpu`]: one device of a vendor — NVIDIA through the CUDA driver (`libcuda.so.1`), AMD
//!   through the HIP runtime (`libamdhip64.so`) — with device memory ([`DeviceBuffer`]) and a
//!   stream; [`Gpu::count`] says how many a machine has without failing where it has none.
//! - [`NativeComm`]: a communicator over the vendor's collective library inside one vendor
//!   domain, NCCL (`libnccl.so.2`) or RCCL (`librccl.so.1`, the same C API), bootstrapped through
//!   medley's rendezvous store: the unique id travels in it.
//! - [`forward_all_reduce`]: the CPU-forwarding bridge between domains whose libraries cannot talk
//!   to each other: device → host → medley's shared-memory/TCP transport → host → device, in
//!   chunks, the next chunk's copy off the device overlapping the current chunk's reduction. Any
//!   [`DeviceMemory`] takes part; [`HostStandIn`] is host memory standing in for a device, which
//!   is how the bridge is tested on machines without one.

// The GPU driver and communication libraries are C libraries loaded at run time.
#![allow(unsafe_code)]

mod bridge;
mod device;
mod error;
mod library;
mod nccl;

pub use bridge::{DeviceMemory, HostStandIn, forward_all_reduce};
pub use device::{DeviceBuffer, Gpu};
pub use error::GpuError;
pub use nccl::NativeComm;

/// Whose GPU, and so which libraries drive it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Vendor {
    /// CUDA driver and NCCL.
    Nvidia,
    /// HIP runtime and RCCL.
    Amd,
}

impl std::fmt::Display for Vendor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Vendor::Nvidia => "NVIDIA",
            Vendor::Amd => "AMD",
        })
    }
}

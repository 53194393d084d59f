//! Where a worker's stage computes.

use serde::{Deserialize, Serialize};

/// The device of one worker's stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ComputeDevice {
    /// burn's flex backend on the CPU, on as many threads as the worker owns cores.
    Cpu,
    /// NVIDIA GPU `index` (CUDA's numbering), kernels compiled by NVRTC at run time.
    Cuda(usize),
    /// AMD GPU `index` (HIP's numbering), kernels compiled by hiprtc at run time.
    Rocm(usize),
}

impl ComputeDevice {
    /// The cargo feature this build needs for the device, if any.
    pub fn feature(self) -> Option<&'static str> {
        match self {
            ComputeDevice::Cpu => None,
            ComputeDevice::Cuda(_) => Some("cuda"),
            ComputeDevice::Rocm(_) => Some("rocm"),
        }
    }

    /// Whether this binary was built with the device's backend.
    pub fn is_built(self) -> bool {
        match self {
            ComputeDevice::Cpu => true,
            ComputeDevice::Cuda(_) => cfg!(feature = "cuda"),
            ComputeDevice::Rocm(_) => cfg!(feature = "rocm"),
        }
    }
}

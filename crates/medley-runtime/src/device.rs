//! Which device a worker computes on: what `--device` asks for, resolved against what this build
//! has and what this machine has.

use std::fmt;
use std::str::FromStr;

use medley_gpu::{Gpu, Vendor};
use medley_model::ComputeDevice;

use crate::RuntimeError;

/// What a run asks its workers to compute on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceChoice {
    /// A GPU when this build has its backend and the machine has one (CUDA first), else the CPU.
    Auto,
    /// The CPU: emulation's default, whatever the machine has.
    #[default]
    Cpu,
    Cuda,
    Rocm,
}

impl DeviceChoice {
    /// The device of the worker that is `local_rank` on its host: GPU `local_rank` modulo the
    /// host's count, so workers spread over the host's GPUs.
    pub fn resolve(self, local_rank: usize) -> Result<ComputeDevice, RuntimeError> {
        let gpu = |vendor: Vendor, device: fn(usize) -> ComputeDevice| -> Result<ComputeDevice, RuntimeError> {
            let wanted = device(0);
            if !wanted.is_built() {
                return Err(RuntimeError::Model(medley_model::ModelError::NotBuilt { device: wanted }));
            }
            match Gpu::count(vendor) {
                Ok(0) => Err(RuntimeError::Device(format!("--device {self}: this machine has no {vendor} GPU"))),
                Ok(count) => Ok(device(local_rank % count)),
                Err(err) => Err(RuntimeError::Device(format!("--device {self}: {err}"))),
            }
        };
        match self {
            DeviceChoice::Cpu => Ok(ComputeDevice::Cpu),
            DeviceChoice::Cuda => gpu(Vendor::Nvidia, ComputeDevice::Cuda),
            DeviceChoice::Rocm => gpu(Vendor::Amd, ComputeDevice::Rocm),
            DeviceChoice::Auto => Ok(DeviceChoice::Cuda
                .resolve(local_rank)
                .or_else(|_| DeviceChoice::Rocm.resolve(local_rank))
                .unwrap_or(ComputeDevice::Cpu)),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
            DeviceChoice::Rocm => "rocm",
        })
    }
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda),
            "rocm" => Ok(DeviceChoice::Rocm),
            _ => Err(format!("unknown device `{text}`: expected auto, cpu, cuda or rocm")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_falls_back_to_the_cpu_and_a_missing_gpu_is_an_error() {
        let has = |vendor| Gpu::count(vendor).is_ok_and(|count| count > 0);
        let (cuda, rocm) = (has(Vendor::Nvidia) && cfg!(feature = "cuda"), has(Vendor::Amd) && cfg!(feature = "rocm"));
        let auto = DeviceChoice::Auto.resolve(0).unwrap();
        match auto {
            ComputeDevice::Cpu => assert!(!cuda && !rocm),
            ComputeDevice::Cuda(_) => assert!(cuda),
            ComputeDevice::Rocm(_) => assert!(rocm && !cuda),
        }
        assert_eq!(DeviceChoice::Cpu.resolve(3).unwrap(), ComputeDevice::Cpu);
        if !cuda {
            let message = DeviceChoice::Cuda.resolve(0).unwrap_err().to_string();
            assert!(message.contains("--features cuda") || message.contains("no NVIDIA GPU"), "{message}");
        }
    }

    #[test]
    fn choices_read_back_what_they_print() {
        for choice in [DeviceChoice::Auto, DeviceChoice::Cpu, DeviceChoice::Cuda, DeviceChoice::Rocm] {
            assert_eq!(choice.to_string().parse(), Ok(choice));
        }
        assert!("gpu".parse::<DeviceChoice>().unwrap_err().contains("auto, cpu, cuda or rocm"));
    }
}

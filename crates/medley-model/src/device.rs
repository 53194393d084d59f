//! Where a stage computes: this machine's CPU cores, or one CUDA or ROCm GPU. Every device runs
//! the same model code through burn's dispatch backend, which picks the kernels at run time.

use std::fmt;
use std::str::FromStr;

use burn::DispatchDevice;
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// The backend every stage's tensors live on; the device inside decides where they compute.
pub(crate) type Backend = burn::Dispatch;

/// The parameter gradients one backward pass produces.
pub(crate) type Gradients = <Backend as burn::tensor::backend::AutodiffBackend>::Gradients;

/// A tensor of the model on whichever device its stage runs.
pub(crate) type Tensor<const D: usize, K = burn::tensor::Float> = burn::tensor::Tensor<Backend, D, K>;

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

    /// The device with automatic differentiation on it, as the stages build their tensors.
    pub(crate) fn autodiff(self) -> Result<DispatchDevice, ModelError> {
        let device: DispatchDevice = match self {
            ComputeDevice::Cpu => burn::backend::flex::FlexDevice.into(),
            #[cfg(feature = "cuda")]
            ComputeDevice::Cuda(index) => burn::backend::cuda::CudaDevice::new(index).into(),
            #[cfg(feature = "rocm")]
            ComputeDevice::Rocm(index) => burn::backend::rocm::RocmDevice::new(index).into(),
            #[allow(unreachable_patterns)]
            device => return Err(ModelError::NotBuilt { device }),
        };
        Ok(DispatchDevice::autodiff(device))
    }
}

impl fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ComputeDevice::Cpu => write!(f, "cpu"),
            ComputeDevice::Cuda(index) => write!(f, "cuda:{index}"),
            ComputeDevice::Rocm(index) => write!(f, "rocm:{index}"),
        }
    }
}

impl FromStr for ComputeDevice {
    type Err = String;

    /// `cpu`, `cuda`, `cuda:1`, `rocm`, `rocm:0`.
    fn from_str(text: &str) -> Result<Self, String> {
        let (kind, index) = match text.split_once(':') {
            Some((kind, index)) => {
                let index = index.parse().map_err(|_| format!("`{index}` is not a device index in `{text}`"))?;
                (kind, index)
            }
            None => (text, 0),
        };
        match kind {
            "cpu" if index == 0 => Ok(ComputeDevice::Cpu),
            "cuda" => Ok(ComputeDevice::Cuda(index)),
            "rocm" => Ok(ComputeDevice::Rocm(index)),
            _ => Err(format!("unknown compute device `{text}`: expected cpu, cuda[:N] or rocm[:N]")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_read_back_what_they_print() {
        for device in [ComputeDevice::Cpu, ComputeDevice::Cuda(0), ComputeDevice::Cuda(3), ComputeDevice::Rocm(1)] {
            assert_eq!(device.to_string().parse::<ComputeDevice>(), Ok(device));
        }
        assert_eq!("cuda".parse::<ComputeDevice>(), Ok(ComputeDevice::Cuda(0)));
        assert!("cuda:x".parse::<ComputeDevice>().unwrap_err().contains("not a device index"));
        assert!("tpu".parse::<ComputeDevice>().unwrap_err().contains("cpu, cuda[:N] or rocm[:N]"));
        assert!("cpu:1".parse::<ComputeDevice>().is_err());
    }

    #[test]
    fn a_device_this_build_lacks_is_refused_naming_its_feature() {
        let cpu = ComputeDevice::Cpu;
        assert!(cpu.is_built() && cpu.autodiff().is_ok());
        for device in [ComputeDevice::Cuda(0), ComputeDevice::Rocm(0)] {
            if !device.is_built() {
                let message = device.autodiff().unwrap_err().to_string();
                assert!(message.contains(device.feature().unwrap()), "{message}");
            }
        }
    }
}

//! Where a stage computes: this machine's CPU cores, or one CUDA or ROCm GPU, and the stage
//! code built for it.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::long_context::{ContextCollectives, ContextPlacement};
use crate::tensor_parallel::{TensorCollectives, TensorSeat};
use crate::{ComputeDevice, ModelConfig, ModelError, StageCompute};

/// A stage holding `layers`, computing on `device`: on the CPU, on every thread of the rayon pool
/// it runs in (blocks of each micro-batch's samples in parallel).
pub fn stage_compute(
    config: &ModelConfig,
    layers: Range<usize>,
    device: ComputeDevice,
) -> Result<Box<dyn StageCompute>, ModelError> {
    Ok(match device {
        ComputeDevice::Cpu => Box::new(crate::row_split::RowSplit::new(config, layers)?),
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        _ => Box::new(crate::gpu::stage::BurnStage::new(config, layers, device)?),
        #[cfg(not(any(feature = "cuda", feature = "rocm")))]
        _ => return Err(ModelError::NotBuilt { device }),
    })
}

/// The device at `placement` of a long-context stage holding `layers`, exchanging keys and
/// values through `collectives`, computing on `device`.
pub fn context_compute(
    config: &ModelConfig,
    layers: Range<usize>,
    placement: ContextPlacement,
    collectives: Box<dyn ContextCollectives>,
    device: ComputeDevice,
) -> Result<Box<dyn StageCompute>, ModelError> {
    Ok(match device {
        ComputeDevice::Cpu => {
            Box::new(crate::cpu::stage::ContextStage::new(config, layers, placement, collectives, device)?)
        }
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        _ => Box::new(crate::gpu::stage::ContextStage::new(config, layers, placement, collectives, device)?),
        #[cfg(not(any(feature = "cuda", feature = "rocm")))]
        _ => return Err(ModelError::NotBuilt { device }),
    })
}

/// Member `seat` of a tensor-parallel stage holding `layers`, exchanging activations through
/// `collectives`, computing on `device`.
pub fn tensor_parallel_compute(
    config: &ModelConfig,
    layers: Range<usize>,
    seat: TensorSeat,
    collectives: Box<dyn TensorCollectives>,
    device: ComputeDevice,
) -> Result<Box<dyn StageCompute>, ModelError> {
    Ok(match device {
        ComputeDevice::Cpu => {
            Box::new(crate::cpu::stage::TensorParallelStage::new(config, layers, seat, collectives, device)?)
        }
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        _ => Box::new(crate::gpu::stage::TensorParallelStage::new(config, layers, seat, collectives, device)?),
        #[cfg(not(any(feature = "cuda", feature = "rocm")))]
        _ => return Err(ModelError::NotBuilt { device }),
    })
}

/// Seconds one `n`×`n` matrix multiply takes on `device`, in bf16 or f32 (the median of
/// `repeats`): the rate the device reaches on the kernel that dominates training.
pub fn matmul_seconds(device: ComputeDevice, n: usize, bf16: bool, repeats: usize) -> Result<f64, ModelError> {
    match device {
        ComputeDevice::Cpu => crate::cpu::stage::matmul_seconds(device, n, bf16, repeats),
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        _ => crate::gpu::stage::matmul_seconds(device, n, bf16, repeats),
        #[cfg(not(any(feature = "cuda", feature = "rocm")))]
        _ => Err(ModelError::NotBuilt { device }),
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
        let config = ModelConfig::from_spec(&medley_spec::catalog_model("tiny").unwrap(), 16).unwrap();
        assert!(ComputeDevice::Cpu.is_built() && stage_compute(&config, 0..1, ComputeDevice::Cpu).is_ok());
        for device in [ComputeDevice::Cuda(0), ComputeDevice::Rocm(0)] {
            if !device.is_built() {
                let message = stage_compute(&config, 0..1, device).err().unwrap().to_string();
                assert!(message.contains(&format!("--features {}", device.feature().unwrap())), "{message}");
            }
        }
    }
}

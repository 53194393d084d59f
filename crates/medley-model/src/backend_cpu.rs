//! The stage code's view of burn 0.22 (the CPU backend, flex): what differs between the burn
//! versions the same model source is compiled against.

pub(crate) use ::burn;
pub(crate) use burn::tensor::{Device, Gradients, Tensor, TensorData};

pub(crate) use crate::fused::{fused_rms_norm, fused_rope, fused_softmax_last, fused_swiglu};
use crate::{ComputeDevice, ModelError};

/// The device without autodiff, for timing kernels alone.
pub(crate) fn plain_device(device: ComputeDevice) -> Result<Device, ModelError> {
    match device {
        ComputeDevice::Cpu => Ok(Device::flex()),
        device => Err(ModelError::NotBuilt { device }),
    }
}

/// The autodiff device the stage's tensors live on.
pub(crate) fn device(device: ComputeDevice) -> Result<Device, ModelError> {
    Ok(plain_device(device)?.autodiff())
}

pub(crate) fn floats(data: TensorData) -> Result<Vec<f32>, ModelError> {
    data.try_into_vec::<f32>().map_err(|err| ModelError::Compute(format!("{err:?}")))
}

pub(crate) fn scalar(tensor: Tensor<1>) -> f32 {
    tensor.into_scalar::<f32>()
}

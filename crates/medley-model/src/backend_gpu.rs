//! The stage code's view of burn 0.21 (the GPU backends, CUDA and ROCm, through its dispatch
//! backend): what differs between the burn versions the same model source is compiled against.

pub(crate) use ::burn_gpu as burn;
pub(crate) use burn::DispatchDevice as Device;
pub(crate) use burn::tensor::TensorData;

use crate::{ComputeDevice, ModelError};

type Backend = burn::Dispatch;

/// A tensor on whichever device the dispatch backend holds it.
pub(crate) type Tensor<const D: usize, K = burn::tensor::Float> = burn::tensor::Tensor<Backend, D, K>;

/// The gradients one backward pass produces.
pub(crate) type Gradients = <Backend as burn::tensor::backend::AutodiffBackend>::Gradients;

/// The device without autodiff, for timing kernels alone.
pub(crate) fn plain_device(device: ComputeDevice) -> Result<Device, ModelError> {
    Ok(match device {
        #[cfg(feature = "cuda")]
        ComputeDevice::Cuda(index) => burn::backend::cuda::CudaDevice::new(index).into(),
        #[cfg(feature = "rocm")]
        ComputeDevice::Rocm(index) => burn::backend::rocm::RocmDevice::new(index).into(),
        device => return Err(ModelError::NotBuilt { device }),
    })
}

/// The autodiff device the stage's tensors live on.
pub(crate) fn device(device: ComputeDevice) -> Result<Device, ModelError> {
    Ok(Device::autodiff(plain_device(device)?))
}

pub(crate) fn floats(data: TensorData) -> Result<Vec<f32>, ModelError> {
    data.into_vec::<f32>().map_err(|err| ModelError::Compute(format!("{err:?}")))
}

pub(crate) fn scalar(tensor: Tensor<1>) -> f32 {
    tensor.into_scalar()
}

// No fused kernels on the GPU backends: the stage composes each function from burn's operations.

pub(crate) fn fused_softmax_last<const D: usize>(_x: &Tensor<D>) -> Option<Tensor<D>> {
    None
}

pub(crate) fn fused_swiglu<const D: usize>(_gate: &Tensor<D>, _up: &Tensor<D>) -> Option<Tensor<D>> {
    None
}

pub(crate) fn fused_rms_norm(_x: &Tensor<2>, _gain: &Tensor<1>, _eps: f32) -> Option<Tensor<2>> {
    None
}

pub(crate) fn fused_rope(_x: &Tensor<4>, _cos: &Tensor<4>, _sin: &Tensor<4>) -> Option<Tensor<4>> {
    None
}

//! Which path a data-parallel group's gradients take when its workers compute on GPUs: the
//! vendor's collective library (NCCL or RCCL) when every member is in one vendor domain and can
//! load it; medley's own transports otherwise. Parameters and gradients live on the host between
//! passes, so across vendors medley's all-reduce of the host copies is the CPU-forwarding bridge.

use medley_comm::{Communicator, ReduceOp};
use medley_gpu::{DeviceBuffer, DeviceMemory, Gpu, GpuError, NativeComm, Vendor};
use medley_model::ComputeDevice;

use crate::RuntimeError;
use crate::error::CommContext;

/// A DP group's communicator of the vendor's library, with a device buffer for its gradients.
pub(crate) struct NativeGroup {
    gpu: Gpu,
    comm: NativeComm,
    buffer: Option<DeviceBuffer>,
}

/// The native communicator of `group` when it fits (see the module's note), else none. Every
/// member calls it, and all decide alike: the job's `--device` is the same everywhere (checked at
/// join), and whether every member can load the library is agreed by an all-reduce.
pub(crate) fn native_group(
    group: &mut Communicator,
    device: ComputeDevice,
    key: &str,
) -> Result<Option<NativeGroup>, RuntimeError> {
    let (vendor, index) = match device {
        ComputeDevice::Cpu => return Ok(None),
        ComputeDevice::Cuda(index) => (Vendor::Nvidia, index),
        ComputeDevice::Rocm(index) => (Vendor::Amd, index),
    };
    let fits = group.group().n_domains() == 1 && NativeComm::available(vendor);
    let mut all_fit = [0f64];
    group
        .all_reduce(&[f64::from(u8::from(fits))], &mut all_fit, ReduceOp::Min)
        .during(|| format!("agreeing on the native collective library of {key}"))?;
    if all_fit[0] == 0.0 {
        return Ok(None);
    }
    let native = |err: GpuError| RuntimeError::Device(format!("{key}'s native communicator: {err}"));
    let gpu = Gpu::open(vendor, index).map_err(native)?;
    let comm = NativeComm::init(group, &gpu, key).map_err(native)?;
    Ok(Some(NativeGroup { gpu, comm, buffer: None }))
}

impl NativeGroup {
    /// `summed` = the group's sum of `flat`, through the device.
    pub(crate) fn all_reduce(&mut self, flat: &[f32], summed: &mut [f32]) -> Result<(), GpuError> {
        let bytes = size_of_val(flat);
        let buffer = match self.buffer.take() {
            Some(buffer) if buffer.len_bytes() == bytes => buffer,
            _ => self.gpu.alloc(bytes)?,
        };
        let buffer = self.buffer.insert(buffer);
        buffer.copy_from_host(0, bytemuck::cast_slice(flat))?;
        self.comm.all_reduce_sum_f32(buffer)?;
        buffer.copy_to_host(0, bytemuck::cast_slice_mut(summed))
    }
}

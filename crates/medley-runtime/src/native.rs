//! Which path a data-parallel group's gradients take when its workers compute on GPUs: the
//! vendor's collective library (NCCL or RCCL) when every member is in one vendor domain and can
//! load it; medley's own transports otherwise. Parameters and gradients live on the host between
//! passes, so across vendors medley's all-reduce of the host copies is the CPU-forwarding bridge.

use medley_comm::Communicator;
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

/// The native communicator of `group` when it fits (see the module's note) and no two members
/// share a GPU (NCCL refuses that), else none. Every member calls it, and all decide alike: the
/// job's `--device` is the same everywhere (checked at join), and each member's library and
/// device are gathered by all.
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
    // NCCL refuses two ranks on one GPU, which is what several workers on a one-GPU host get.
    let mine = [i64::from(fits), host_id(), index as i64];
    let mut all = vec![0i64; 3 * group.n_ranks()];
    group
        .all_gather(&mine, &mut all, &vec![3; group.n_ranks()])
        .during(|| format!("agreeing on the native collective library of {key}"))?;
    let seats: Vec<&[i64]> = all.chunks_exact(3).collect();
    if !seats.iter().all(|seat| seat[0] == 1) || !distinct_devices(&seats) {
        return Ok(None);
    }
    let native = |err: GpuError| RuntimeError::Device(format!("{key}'s native communicator: {err}"));
    let gpu = Gpu::open(vendor, index).map_err(native)?;
    let comm = NativeComm::init(group, &gpu, key).map_err(native)?;
    Ok(Some(NativeGroup { gpu, comm, buffer: None }))
}

/// This host, as a number every worker on it computes alike.
fn host_id() -> i64 {
    use sha2::Digest;
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let digest = sha2::Sha256::digest(name.trim().as_bytes());
    i64::from_le_bytes(digest[..8].try_into().expect("eight bytes"))
}

/// Whether no two members (`[_, host, device index]` each) share a GPU.
fn distinct_devices(seats: &[&[i64]]) -> bool {
    let devices: std::collections::BTreeSet<(i64, i64)> = seats.iter().map(|seat| (seat[1], seat[2])).collect();
    devices.len() == seats.len()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_sharing_a_gpu_do_not_take_the_native_path() {
        let (a, b, c) = ([1, 7, 0], [1, 7, 1], [1, 8, 0]);
        assert!(distinct_devices(&[&a, &b, &c]));
        assert!(!distinct_devices(&[&a, &b, &a]));
        assert_eq!(host_id(), host_id());
    }
}

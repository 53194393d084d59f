//! The CPU-forwarding bridge: a collective across vendor domains, whose native libraries cannot
//! talk to each other, through host memory and medley's own transports.

use std::ops::Range;
use std::sync::Mutex;

use medley_comm::{Communicator, ReduceOp};

use crate::GpuError;

/// Memory the bridge copies through the host: a device buffer, or host memory standing in for
/// one. Copies take `&self` because device memory is not Rust memory: the bridge copies one
/// chunk off the device while it writes another back.
pub trait DeviceMemory: Sync {
    fn len_bytes(&self) -> usize;
    /// Copies `into.len()` bytes at `offset` to the host.
    fn copy_to_host(&self, offset: usize, into: &mut [u8]) -> Result<(), GpuError>;
    /// Copies `data` to `offset`.
    fn copy_from_host(&self, offset: usize, data: &[u8]) -> Result<(), GpuError>;
}

/// Host memory standing in for a device buffer, so the bridge runs where there is no GPU.
pub struct HostStandIn {
    bytes: Mutex<Vec<u8>>,
}

impl HostStandIn {
    pub fn new(floats: &[f32]) -> Self {
        HostStandIn { bytes: Mutex::new(floats.iter().flat_map(|x| x.to_le_bytes()).collect()) }
    }

    pub fn floats(&self) -> Vec<f32> {
        let bytes = self.bytes.lock().expect("no copy panics while holding the lock");
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    fn range(&self, what: &'static str, offset: usize, len: usize) -> Result<Range<usize>, GpuError> {
        let total = self.len_bytes();
        match offset.checked_add(len) {
            Some(end) if end <= total => Ok(offset..end),
            _ => Err(GpuError::OutOfRange { what, offset, end: offset.saturating_add(len), len: total }),
        }
    }
}

impl DeviceMemory for HostStandIn {
    fn len_bytes(&self) -> usize {
        self.bytes.lock().expect("no copy panics while holding the lock").len()
    }

    fn copy_to_host(&self, offset: usize, into: &mut [u8]) -> Result<(), GpuError> {
        let range = self.range("copy to host", offset, into.len())?;
        into.copy_from_slice(&self.bytes.lock().expect("no copy panics while holding the lock")[range]);
        Ok(())
    }

    fn copy_from_host(&self, offset: usize, data: &[u8]) -> Result<(), GpuError> {
        let range = self.range("copy from host", offset, data.len())?;
        self.bytes.lock().expect("no copy panics while holding the lock")[range].copy_from_slice(data);
        Ok(())
    }
}

/// Sums `buffer`'s float32 elements over every rank of `comm`, in place, through the host: chunk
/// by chunk of `chunk_bytes`, each copied off the device, all-reduced by medley's communicator
/// (shared memory inside a host, TCP across) and copied back, while the next chunk is already
/// being copied off. Every rank passes a buffer of the same size and the same chunk size.
pub fn forward_all_reduce(
    comm: &mut Communicator,
    buffer: &dyn DeviceMemory,
    chunk_bytes: usize,
) -> Result<(), GpuError> {
    let len = buffer.len_bytes();
    if !len.is_multiple_of(4) {
        return Err(GpuError::NotFloats { what: "forwarded all-reduce", len });
    }
    let chunk = (chunk_bytes / 4).max(1) * 4;
    let chunks: Vec<Range<usize>> = (0..len).step_by(chunk).map(|start| start..(start + chunk).min(len)).collect();
    let Some(first) = chunks.first() else { return Ok(()) };
    let mut current = vec![0f32; first.len() / 4];
    buffer.copy_to_host(first.start, bytemuck::cast_slice_mut(&mut current))?;
    let mut next = Vec::new();
    let mut reduced = Vec::new();
    for (i, range) in chunks.iter().enumerate() {
        let following = chunks.get(i + 1);
        std::thread::scope(|scope| -> Result<(), GpuError> {
            let copy_off = following.map(|range| {
                next.resize(range.len() / 4, 0.0);
                let next = &mut next;
                scope.spawn(move || buffer.copy_to_host(range.start, bytemuck::cast_slice_mut(next)))
            });
            reduced.resize(current.len(), 0.0);
            let result = comm
                .all_reduce(&current, &mut reduced, ReduceOp::Sum)
                .map_err(GpuError::from)
                .and_then(|()| buffer.copy_from_host(range.start, bytemuck::cast_slice(&reduced)));
            let copied = copy_off.map_or(Ok(()), |copy| copy.join().expect("a device copy does not panic"));
            result.and(copied)
        })?;
        std::mem::swap(&mut current, &mut next);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stand_in_refuses_copies_outside_it() {
        let buffer = HostStandIn::new(&[1.0, 2.0]);
        let mut out = [0u8; 4];
        buffer.copy_to_host(4, &mut out).unwrap();
        assert_eq!(f32::from_le_bytes(out), 2.0);
        assert!(matches!(buffer.copy_to_host(6, &mut out), Err(GpuError::OutOfRange { end: 10, len: 8, .. })));
        assert!(buffer.copy_from_host(usize::MAX, &out).is_err());
        buffer.copy_from_host(0, &3f32.to_le_bytes()).unwrap();
        assert_eq!(buffer.floats(), vec![3.0, 2.0]);
    }
}

//! NCCL (NVIDIA) and RCCL (AMD) communicators over device buffers, inside one vendor domain.
//! RCCL implements NCCL's C API under the same names, so one table serves both.

use std::ffi::{c_char, c_void};

use medley_comm::Communicator;

use crate::device::{DeviceBuffer, Gpu};
use crate::library::{api, call_failed, open_first};
use crate::{GpuError, Vendor};

/// `ncclUniqueId`: 128 opaque bytes that rank 0 makes and every rank passes to init.
const UNIQUE_ID_BYTES: usize = 128;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; UNIQUE_ID_BYTES],
}

type Status = i32;
type Handle = *mut c_void;

api!(CollectiveLibrary from "NCCL/RCCL" {
    version = "ncclGetVersion": fn(*mut i32) -> Status;
    unique_id = "ncclGetUniqueId": fn(*mut UniqueId) -> Status;
    init_rank = "ncclCommInitRank": fn(*mut Handle, i32, UniqueId, i32) -> Status;
    all_reduce = "ncclAllReduce": fn(*const c_void, *mut c_void, usize, i32, i32, Handle, Handle) -> Status;
    destroy = "ncclCommDestroy": fn(Handle) -> Status;
    error_string = "ncclGetErrorString": fn(Status) -> *const c_char;
});

/// `ncclDataType_t`'s float32 and `ncclRedOp_t`'s sum, from `nccl.h` (NCCL 2.10 on; RCCL alike).
const NCCL_FLOAT32: i32 = 7;
const NCCL_SUM: i32 = 0;

/// The library names: pip's NCCL wheel and the CUDA packages ship `libnccl.so.2`; ROCm ships
/// `librccl.so.1`.
fn library_names(vendor: Vendor) -> (&'static str, &'static [&'static str]) {
    match vendor {
        Vendor::Nvidia => ("NCCL", &["libnccl.so.2", "libnccl.so"]),
        Vendor::Amd => ("RCCL", &["librccl.so.1", "librccl.so"]),
    }
}

/// One rank's communicator of its vendor's collective library.
pub struct NativeComm {
    library: CollectiveLibrary,
    comm: Handle,
    gpu: Gpu,
    rank: usize,
    n_ranks: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `&mut self` on
// every collective guarantees that.
unsafe impl Send for NativeComm {}

impl NativeComm {
    /// Whether this machine has `vendor`'s collective library where the loader finds it.
    pub fn available(vendor: Vendor) -> bool {
        let (what, names) = library_names(vendor);
        open_first(what, names).is_ok_and(|library| CollectiveLibrary::load(library).is_ok())
    }

    /// Joins the vendor library's communicator of `group`'s ranks on `gpu`: rank 0 makes the
    /// unique id, which reaches the others through the job's rendezvous store under `key`. Every
    /// rank of `group` calls it with the same key.
    pub fn init(group: &Communicator, gpu: &Gpu, key: &str) -> Result<NativeComm, GpuError> {
        let (what, names) = library_names(gpu.vendor());
        let library = CollectiveLibrary::load(open_first(what, names)?)?;
        let id = group.share_via_store(&format!("nccl-unique-id/{key}"), 0, || {
            let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
            // SAFETY: the library writes the id into `id`, a struct of its declared size.
            check(&library, "ncclGetUniqueId", unsafe { (library.unique_id)(&mut id) })?;
            Ok::<_, GpuError>(id.internal.iter().map(|&byte| byte as u8).collect())
        })?;
        let bytes: [u8; UNIQUE_ID_BYTES] =
            id.as_slice().try_into().map_err(|_| GpuError::BadUniqueId { expected: UNIQUE_ID_BYTES, got: id.len() })?;
        let id = UniqueId { internal: bytes.map(|byte| byte as c_char) };
        gpu.make_current()?;
        let (rank, n_ranks) = (group.rank(), group.n_ranks());
        let mut comm: Handle = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; every rank passes the same id, its own
        // rank and the group's size, with its device current.
        check(&library, "ncclCommInitRank", unsafe {
            (library.init_rank)(&mut comm, n_ranks as i32, id, rank as i32)
        })?;
        Ok(NativeComm { library, comm, gpu: gpu.clone(), rank, n_ranks })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn n_ranks(&self) -> usize {
        self.n_ranks
    }

    /// The library's version as it reports it (NCCL's 22005 is 2.20.5).
    pub fn version(&self) -> Result<i32, GpuError> {
        let mut version = 0;
        // SAFETY: the library writes its version into `version`.
        check(&self.library, "ncclGetVersion", unsafe { (self.library.version)(&mut version) })?;
        Ok(version)
    }

    /// Sums `buffer`'s float32 elements over every rank, in place, and waits for the result.
    pub fn all_reduce_sum_f32(&mut self, buffer: &mut DeviceBuffer) -> Result<(), GpuError> {
        let bytes = crate::bridge::DeviceMemory::len_bytes(buffer);
        if !bytes.is_multiple_of(4) {
            return Err(GpuError::NotFloats { what: "native all-reduce", len: bytes });
        }
        self.gpu.make_current()?;
        let ptr = buffer.device_ptr();
        // SAFETY: send and receive are the same device allocation of `bytes / 4` floats (in place
        // is allowed), on this communicator's device; the stream belongs to that device.
        let status = unsafe {
            (self.library.all_reduce)(ptr, ptr, bytes / 4, NCCL_FLOAT32, NCCL_SUM, self.comm, self.gpu.stream())
        };
        check(&self.library, "ncclAllReduce", status)?;
        self.gpu.synchronize()
    }
}

impl Drop for NativeComm {
    fn drop(&mut self) {
        // SAFETY: the communicator came from ncclCommInitRank and is destroyed once, here.
        unsafe {
            (self.library.destroy)(self.comm);
        }
    }
}

fn check(library: &CollectiveLibrary, call: &'static str, status: Status) -> Result<(), GpuError> {
    call_failed(call, status, library.error_string)
}

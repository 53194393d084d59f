//! One GPU through its vendor's runtime: the CUDA driver API on NVIDIA, the HIP runtime on AMD.
//! Only what medley needs of them: counting devices, device memory, copies and a stream.

use std::ffi::{CStr, c_char, c_void};
use std::sync::{Arc, OnceLock};

use crate::bridge::DeviceMemory;
use crate::library::{api, call_failed, open_first};
use crate::{GpuError, Vendor};

type Status = i32;
type Handle = *mut c_void;

api!(CudaDriver from "the CUDA driver (libcuda)" {
    init = "cuInit": fn(u32) -> Status;
    device_count = "cuDeviceGetCount": fn(*mut i32) -> Status;
    device_get = "cuDeviceGet": fn(*mut i32, i32) -> Status;
    device_name = "cuDeviceGetName": fn(*mut c_char, i32, i32) -> Status;
    primary_context = "cuDevicePrimaryCtxRetain": fn(*mut Handle, i32) -> Status;
    set_context = "cuCtxSetCurrent": fn(Handle) -> Status;
    malloc = "cuMemAlloc_v2": fn(*mut u64, usize) -> Status;
    free = "cuMemFree_v2": fn(u64) -> Status;
    copy_to_device = "cuMemcpyHtoD_v2": fn(u64, *const c_void, usize) -> Status;
    copy_to_host = "cuMemcpyDtoH_v2": fn(*mut c_void, u64, usize) -> Status;
    stream_create = "cuStreamCreate": fn(*mut Handle, u32) -> Status;
    stream_synchronize = "cuStreamSynchronize": fn(Handle) -> Status;
    error_string = "cuGetErrorString": fn(Status, *mut *const c_char) -> Status;
});

api!(HipRuntime from "the HIP runtime (libamdhip64)" {
    device_count = "hipGetDeviceCount": fn(*mut i32) -> Status;
    set_device = "hipSetDevice": fn(i32) -> Status;
    device_name = "hipDeviceGetName": fn(*mut c_char, i32, i32) -> Status;
    malloc = "hipMalloc": fn(*mut Handle, usize) -> Status;
    free = "hipFree": fn(Handle) -> Status;
    memcpy = "hipMemcpy": fn(Handle, *const c_void, usize, i32) -> Status;
    stream_create = "hipStreamCreate": fn(*mut Handle) -> Status;
    stream_synchronize = "hipStreamSynchronize": fn(Handle) -> Status;
    error_string = "hipGetErrorString": fn(Status) -> *const c_char;
});

/// hipMemcpyKind's values from `hip_runtime_api.h`.
const HIP_HOST_TO_DEVICE: i32 = 1;
const HIP_DEVICE_TO_HOST: i32 = 2;

/// The CUDA driver's library names, the versioned one first (as the driver package installs it).
const CUDA_DRIVER: &[&str] = &["libcuda.so.1", "libcuda.so"];
const HIP_RUNTIME: &[&str] = &["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];

enum Runtime {
    Cuda(CudaDriver),
    Hip(HipRuntime),
}

/// Each vendor's runtime, loaded (and for CUDA initialised) once per process.
fn runtime(vendor: Vendor) -> Result<&'static Runtime, GpuError> {
    static CUDA: OnceLock<Result<Runtime, String>> = OnceLock::new();
    static HIP: OnceLock<Result<Runtime, String>> = OnceLock::new();
    let (cell, load): (_, fn() -> Result<Runtime, GpuError>) = match vendor {
        Vendor::Nvidia => (&CUDA, || {
            let driver = CudaDriver::load(open_first("the CUDA driver", CUDA_DRIVER)?)?;
            // SAFETY: cuInit takes flags, which must be 0.
            check_cuda(&driver, "cuInit", unsafe { (driver.init)(0) })?;
            Ok(Runtime::Cuda(driver))
        }),
        Vendor::Amd => (&HIP, || Ok(Runtime::Hip(HipRuntime::load(open_first("the HIP runtime", HIP_RUNTIME)?)?))),
    };
    // Loading fails the same way every time: keep the message, rebuild the error per caller.
    match cell.get_or_init(|| load().map_err(|err| err.to_string())) {
        Ok(runtime) => Ok(runtime),
        Err(message) => Err(GpuError::Call { call: "loading the GPU runtime", code: -1, message: message.clone() }),
    }
}

fn check_cuda(driver: &CudaDriver, call: &'static str, status: Status) -> Result<(), GpuError> {
    if status == 0 {
        return Ok(());
    }
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves null for an unknown
    // code); the string is read only when the call succeeded and the pointer is not null.
    let message = unsafe {
        if (driver.error_string)(status, &mut text) == 0 && !text.is_null() {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        } else {
            "unknown error".into()
        }
    };
    Err(GpuError::Call { call, code: status, message })
}

fn check_hip(hip: &HipRuntime, call: &'static str, status: Status) -> Result<(), GpuError> {
    call_failed(call, status, hip.error_string)
}

/// One GPU, current on whichever thread calls into it.
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<GpuInner>,
}

struct GpuInner {
    vendor: Vendor,
    index: usize,
    name: String,
    /// CUDA's primary context of the device (null on HIP, which keys on the device index).
    context: Handle,
    stream: Handle,
}

// SAFETY: a CUDA context and stream, and a HIP device index and stream, may be used from any
// thread once made current there, which every call here does first (`Gpu::make_current`).
unsafe impl Send for GpuInner {}
// SAFETY: as above; the handles are never mutated after creation.
unsafe impl Sync for GpuInner {}

impl Gpu {
    /// How many GPUs of `vendor` this machine has; an error only when its runtime is missing or
    /// broken (a machine without the driver).
    pub fn count(vendor: Vendor) -> Result<usize, GpuError> {
        let mut count = 0i32;
        match runtime(vendor)? {
            // SAFETY: the driver writes the count into `count`.
            Runtime::Cuda(cuda) => check_cuda(cuda, "cuDeviceGetCount", unsafe { (cuda.device_count)(&mut count) })?,
            // SAFETY: as above, the HIP runtime writes the count.
            Runtime::Hip(hip) => check_hip(hip, "hipGetDeviceCount", unsafe { (hip.device_count)(&mut count) })?,
        }
        Ok(count.max(0) as usize)
    }

    /// GPU `index` of `vendor`, with a stream of its own.
    pub fn open(vendor: Vendor, index: usize) -> Result<Gpu, GpuError> {
        let count = Gpu::count(vendor)?;
        if index >= count {
            return Err(GpuError::NoDevice { vendor, index, count });
        }
        let ordinal = index as i32;
        let mut name = [0 as c_char; 256];
        let (mut context, mut stream): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
        match runtime(vendor)? {
            Runtime::Cuda(cuda) => {
                let mut device = 0i32;
                // SAFETY: each call writes only through the out-pointer it is given, sized as the
                // driver API declares (an int, a name buffer of the given length, a handle).
                unsafe {
                    check_cuda(cuda, "cuDeviceGet", (cuda.device_get)(&mut device, ordinal))?;
                    check_cuda(cuda, "cuDeviceGetName", (cuda.device_name)(name.as_mut_ptr(), 255, device))?;
                    check_cuda(cuda, "cuDevicePrimaryCtxRetain", (cuda.primary_context)(&mut context, device))?;
                    check_cuda(cuda, "cuCtxSetCurrent", (cuda.set_context)(context))?;
                    check_cuda(cuda, "cuStreamCreate", (cuda.stream_create)(&mut stream, 0))?;
                }
            }
            // SAFETY: as above, for the HIP runtime's declarations.
            Runtime::Hip(hip) => unsafe {
                check_hip(hip, "hipSetDevice", (hip.set_device)(ordinal))?;
                check_hip(hip, "hipDeviceGetName", (hip.device_name)(name.as_mut_ptr(), 255, ordinal))?;
                check_hip(hip, "hipStreamCreate", (hip.stream_create)(&mut stream))?;
            },
        }
        // SAFETY: `name` is zeroed beyond what the runtime wrote (at most 255 bytes of 256), so it
        // holds a terminating zero.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        Ok(Gpu { inner: Arc::new(GpuInner { vendor, index, name, context, stream }) })
    }

    pub fn vendor(&self) -> Vendor {
        self.inner.vendor
    }

    pub fn index(&self) -> usize {
        self.inner.index
    }

    /// The device's name as its driver reports it ("NVIDIA H200", "AMD Instinct MI300X").
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's stream, as the collective library takes it.
    pub(crate) fn stream(&self) -> Handle {
        self.inner.stream
    }

    /// Makes the device current on the calling thread: CUDA's context and HIP's device are
    /// per thread.
    pub(crate) fn make_current(&self) -> Result<(), GpuError> {
        match self.runtime() {
            Runtime::Cuda(cuda) => {
                // SAFETY: the context was retained in `open` and is never released while `self` lives.
                let status = unsafe { (cuda.set_context)(self.inner.context) };
                check_cuda(cuda, "cuCtxSetCurrent", status)
            }
            Runtime::Hip(hip) => {
                // SAFETY: the index was checked against the device count in `open`.
                let status = unsafe { (hip.set_device)(self.inner.index as i32) };
                check_hip(hip, "hipSetDevice", status)
            }
        }
    }

    /// Waits until the device's stream has done everything queued on it.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.make_current()?;
        match self.runtime() {
            Runtime::Cuda(cuda) => {
                // SAFETY: the stream was created in `open` on this device.
                let status = unsafe { (cuda.stream_synchronize)(self.inner.stream) };
                check_cuda(cuda, "cuStreamSynchronize", status)
            }
            Runtime::Hip(hip) => {
                // SAFETY: the stream was created in `open` on this device.
                let status = unsafe { (hip.stream_synchronize)(self.inner.stream) };
                check_hip(hip, "hipStreamSynchronize", status)
            }
        }
    }

    /// `bytes` of device memory, uninitialised.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, GpuError> {
        self.make_current()?;
        let ptr = match self.runtime() {
            Runtime::Cuda(cuda) => {
                let mut ptr = 0u64;
                // SAFETY: the driver writes the allocation's address into `ptr`.
                check_cuda(cuda, "cuMemAlloc", unsafe { (cuda.malloc)(&mut ptr, bytes.max(1)) })?;
                ptr
            }
            Runtime::Hip(hip) => {
                let mut ptr: Handle = std::ptr::null_mut();
                // SAFETY: the runtime writes the allocation's address into `ptr`.
                check_hip(hip, "hipMalloc", unsafe { (hip.malloc)(&mut ptr, bytes.max(1)) })?;
                ptr as u64
            }
        };
        Ok(DeviceBuffer { gpu: self.clone(), ptr, bytes })
    }

    fn runtime(&self) -> &'static Runtime {
        runtime(self.inner.vendor).expect("a Gpu exists only once its runtime loaded")
    }
}

/// Memory on one GPU, freed when dropped.
pub struct DeviceBuffer {
    gpu: Gpu,
    ptr: u64,
    bytes: usize,
}

impl DeviceBuffer {
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The device address, as the collective library takes it.
    pub(crate) fn device_ptr(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }

    fn check(&self, what: &'static str, offset: usize, len: usize) -> Result<(), GpuError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(GpuError::OutOfRange { what, offset, end: offset.saturating_add(len), len: self.bytes }),
        }
    }
}

impl DeviceMemory for DeviceBuffer {
    fn len_bytes(&self) -> usize {
        self.bytes
    }

    fn copy_to_host(&self, offset: usize, into: &mut [u8]) -> Result<(), GpuError> {
        self.check("copy to host", offset, into.len())?;
        self.gpu.make_current()?;
        let src = self.ptr + offset as u64;
        match self.gpu.runtime() {
            // SAFETY: `check` keeps src..src + len inside the allocation, and `into` is that long.
            Runtime::Cuda(cuda) => check_cuda(cuda, "cuMemcpyDtoH", unsafe {
                (cuda.copy_to_host)(into.as_mut_ptr().cast(), src, into.len())
            }),
            // SAFETY: as above.
            Runtime::Hip(hip) => check_hip(hip, "hipMemcpy", unsafe {
                (hip.memcpy)(into.as_mut_ptr().cast(), src as *const c_void, into.len(), HIP_DEVICE_TO_HOST)
            }),
        }
    }

    fn copy_from_host(&self, offset: usize, data: &[u8]) -> Result<(), GpuError> {
        self.check("copy from host", offset, data.len())?;
        self.gpu.make_current()?;
        let dst = self.ptr + offset as u64;
        match self.gpu.runtime() {
            // SAFETY: `check` keeps dst..dst + len inside the allocation, and `data` is that long.
            Runtime::Cuda(cuda) => check_cuda(cuda, "cuMemcpyHtoD", unsafe {
                (cuda.copy_to_device)(dst, data.as_ptr().cast(), data.len())
            }),
            // SAFETY: as above.
            Runtime::Hip(hip) => check_hip(hip, "hipMemcpy", unsafe {
                (hip.memcpy)(dst as Handle, data.as_ptr().cast(), data.len(), HIP_HOST_TO_DEVICE)
            }),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // A failure to free leaks device memory only; there is nothing better to do in a drop.
        if self.gpu.make_current().is_err() {
            return;
        }
        match self.gpu.runtime() {
            // SAFETY: the address came from cuMemAlloc and is freed once, here.
            Runtime::Cuda(cuda) => unsafe {
                (cuda.free)(self.ptr);
            },
            // SAFETY: the address came from hipMalloc and is freed once, here.
            Runtime::Hip(hip) => unsafe {
                (hip.free)(self.ptr as Handle);
            },
        }
    }
}

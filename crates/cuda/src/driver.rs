//! Every call into the CUDA driver and NVRTC, and every `unsafe` block of
//! braid-cuda (the crate denies `unsafe_code` everywhere else). Three
//! layers, bottom up:
//!
//! 1. **Raw FFI**: cudarc's `sys` bindings (CUDA 12.4 API), loaded at run
//!    time (`dynamic-loading`).
//! 2. **`Result` wrappers**: cudarc's `result` functions and `check` /
//!    `driver_err` here turn a `CUresult` into [`CudaError::Driver`]
//!    naming the call.
//! 3. **Safe types**: the probe, [`Device`] (primary context),
//!    [`DeviceBuffer`], [`HostFlag`] (pinned, device-mapped word),
//!    [`CudaStream`] (copies, fills, stream memory operations), [`Event`],
//!    CUDA IPC ([`DeviceBuffer::ipc_handle`], [`IpcMapping`]) and the
//!    NVRTC-compiled [`Kernels`]. What cannot be made safe (device
//!    addresses whose validity the driver cannot check) is an `unsafe fn`
//!    with a `# Safety` section.
//!
//! cudarc panics if a library is missing when its first function is called,
//! so [`probe`] checks `is_culib_present` for the driver and NVRTC before
//! anything else, and every constructor here calls [`probe`] first. Absence
//! is [`CudaError::Unavailable`], never a panic.
//!
//! Raw handles (`CUstream`, `CUevent`, ...) are wrapped in owning types that
//! release them on drop. Device addresses are plain `u64` (`CUdeviceptr`).

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use braid_core::{DataType, RedOp};
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::nvrtc::result as rtc;

use crate::error::{CudaError, Result};
use crate::ipc::{IpcMemHandle, HANDLE_BYTES};
use crate::kernels;

/// Turn a driver status into our error, naming the call.
fn check(call: &'static str, r: std::result::Result<(), cu::DriverError>) -> Result<()> {
    r.map_err(|e| driver_err(call, e))
}

fn driver_err(call: &'static str, e: cu::DriverError) -> CudaError {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    CudaError::Driver { call, name, text }
}

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeInfo {
    /// Number of CUDA devices visible to this process.
    pub devices: u32,
    /// Driver API version (`12040` for 12.4).
    pub driver_version: i32,
}

/// Check that the CUDA driver and NVRTC libraries can be loaded, initialise
/// the driver and count the devices. Cached: cheap after the first call.
/// `Err(CudaError::Unavailable)` says why CUDA cannot be used here.
pub fn probe() -> Result<ProbeInfo> {
    static PROBE: OnceLock<std::result::Result<ProbeInfo, String>> = OnceLock::new();
    PROBE
        .get_or_init(probe_uncached)
        .clone()
        .map_err(CudaError::Unavailable)
}

fn probe_uncached() -> std::result::Result<ProbeInfo, String> {
    let config = braid_core::config::process_env;
    match braid_core::config::flag(&config, "BRAID_CUDA_DISABLE", false) {
        Ok(true) => return Err("disabled by BRAID_CUDA_DISABLE".into()),
        Ok(false) => {}
        Err(e) => return Err(e.to_string()),
    }
    // SAFETY: is_culib_present only tries to open the library by its
    // candidate names; it calls no CUDA function.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "the CUDA driver library (libcuda.so / libcuda.so.1) is not installed or not on the library path"
                .into(),
        );
    }
    // SAFETY: as above, for NVRTC.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "NVRTC (libnvrtc.so.12 or libnvrtc.so) is not installed or not on the library path; braid compiles its reduction kernels with it"
                .into(),
        );
    }
    cu::init().map_err(|e| format!("cuInit failed: {}", driver_err("cuInit", e)))?;
    let devices =
        cu::device::get_count().map_err(|e| driver_err("cuDeviceGetCount", e).to_string())?;
    if devices <= 0 {
        return Err("the driver sees no CUDA device (check CUDA_VISIBLE_DEVICES)".into());
    }
    let mut version = 0i32;
    // SAFETY: cuInit succeeded; the pointer is a valid out-parameter.
    let r = unsafe { sys::cuDriverGetVersion(&mut version) }.result();
    r.map_err(|e| driver_err("cuDriverGetVersion", e).to_string())?;
    Ok(ProbeInfo {
        devices: devices as u32,
        driver_version: version,
    })
}

/// What the driver says about a device, without creating a context.
struct DeviceFacts {
    dev: sys::CUdevice,
    name: String,
    bus_id: String,
    cc: (i32, i32),
}

fn device_facts(ordinal: u32) -> Result<DeviceFacts> {
    let dev = cu::device::get(ordinal as i32).map_err(|e| driver_err("cuDeviceGet", e))?;
    let name = cu::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer holds 32 chars, as passed.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev).result()
    })?;
    // SAFETY: the driver wrote a NUL-terminated string into `buf`.
    let bus_id = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .to_ascii_lowercase();
    // SAFETY: `dev` came from cuDeviceGet.
    let major = unsafe {
        cu::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )
    }
    .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
    // SAFETY: as above.
    let minor = unsafe {
        cu::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        )
    }
    .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
    Ok(DeviceFacts {
        dev,
        name,
        bus_id,
        cc: (major, minor),
    })
}

/// Every visible GPU as (ordinal, PCI bus id in lower case, compute
/// capability × 10, name), from the driver alone (no context is created).
pub fn list_gpus() -> Result<Vec<(u32, String, u32, String)>> {
    let info = probe()?;
    (0..info.devices)
        .map(|o| {
            let f = device_facts(o)?;
            Ok((o, f.bus_id, (f.cc.0 * 10 + f.cc.1).max(0) as u32, f.name))
        })
        .collect()
}

/// One GPU with its primary context. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Device {
    ordinal: u32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    bus_id: String,
    name: String,
    cc: (i32, i32),
}

// SAFETY: a CUcontext and a CUdevice are process-wide handles the driver
// lets any thread use (after cuCtxSetCurrent, which `bind` does).
unsafe impl Send for Device {}
// SAFETY: as above; Device is immutable after creation.
unsafe impl Sync for Device {}

impl Device {
    /// Open device `ordinal` (retaining its primary context).
    pub fn open(ordinal: u32) -> Result<Arc<Device>> {
        let info = probe()?;
        if ordinal >= info.devices {
            return Err(CudaError::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist: this process sees {} device(s)",
                info.devices
            )));
        }
        let facts = device_facts(ordinal)?;
        let dev = facts.dev;
        // SAFETY: `dev` came from cuDeviceGet.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: `ctx` is the context just retained.
        check("cuCtxSetCurrent", unsafe { cu::ctx::set_current(ctx) })?;
        let (name, bus_id, (major, minor)) = (facts.name, facts.bus_id, facts.cc);
        Ok(Arc::new(Device {
            ordinal,
            dev,
            ctx,
            bus_id,
            name,
            cc: (major, minor),
        }))
    }

    /// Make this device's context current on the calling thread. Every
    /// entry point that calls the driver does this first.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is a primary context retained until `self` drops.
        check("cuCtxSetCurrent", unsafe { cu::ctx::set_current(self.ctx) })
    }

    /// Device ordinal in this process.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// PCI bus id, lower case (`0000:3b:00.0`).
    pub fn bus_id(&self) -> &str {
        &self.bus_id
    }

    /// Marketing name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`.
        let _ = unsafe { cu::primary_ctx::release(self.dev) };
    }
}

/// Device memory (`cuMemAlloc`), freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    dev: Arc<Device>,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Allocate `len` bytes (at least 1) on `dev`. Contents are undefined.
    pub fn alloc(dev: &Arc<Device>, len: usize) -> Result<DeviceBuffer> {
        dev.bind()?;
        // SAFETY: the context is current; the size is positive.
        let ptr =
            unsafe { cu::malloc_sync(len.max(1)) }.map_err(|e| driver_err("cuMemAlloc", e))?;
        Ok(DeviceBuffer {
            dev: dev.clone(),
            ptr,
            len,
        })
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Copy `src` to the start of the buffer (synchronous).
    pub fn write(&self, src: &[u8]) -> Result<()> {
        if src.len() > self.len {
            return Err(CudaError::InvalidArgument(format!(
                "writing {} bytes into a device buffer of {}",
                src.len(),
                self.len
            )));
        }
        self.dev.bind()?;
        // SAFETY: the buffer holds at least src.len() bytes (checked).
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr() as *const c_void, src.len()).result()
        })
    }

    /// Copy `src` to byte `offset` of the buffer (synchronous).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        if offset
            .checked_add(src.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(CudaError::InvalidArgument(format!(
                "writing {} bytes at offset {offset} into a device buffer of {}",
                src.len(),
                self.len
            )));
        }
        self.dev.bind()?;
        // SAFETY: `offset + src.len()` lies inside the buffer (checked).
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset as u64,
                src.as_ptr() as *const c_void,
                src.len(),
            )
            .result()
        })
    }

    /// Copy the start of the buffer to `dst` (synchronous).
    pub fn read(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() > self.len {
            return Err(CudaError::InvalidArgument(format!(
                "reading {} bytes from a device buffer of {}",
                dst.len(),
                self.len
            )));
        }
        self.dev.bind()?;
        // SAFETY: the buffer holds at least dst.len() bytes (checked).
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, self.ptr, dst.len()).result()
        })
    }

    /// A CUDA IPC handle for this allocation (another process maps it with
    /// [`IpcMapping::open`]).
    pub fn ipc_handle(&self) -> Result<IpcMemHandle> {
        self.dev.bind()?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `ptr` is the base of a cuMemAlloc allocation; `h` is an
        // out-parameter of the right type.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(h.as_mut_ptr(), self.ptr).result()
        })?;
        // SAFETY: the driver filled the handle.
        let h = unsafe { h.assume_init() };
        let mut out = [0u8; HANDLE_BYTES];
        for (o, c) in out.iter_mut().zip(h.reserved.iter()) {
            *o = *c as u8;
        }
        Ok(IpcMemHandle(out))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

/// Another process's device allocation, mapped into this one through CUDA
/// IPC; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    dev: Arc<Device>,
    ptr: u64,
}

impl IpcMapping {
    /// Map the allocation named by `h` (made by another process of this host)
    /// on `dev`, enabling peer access when it lives on another GPU.
    pub fn open(dev: &Arc<Device>, h: &IpcMemHandle) -> Result<IpcMapping> {
        dev.bind()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; HANDLE_BYTES],
        };
        for (r, b) in raw.reserved.iter_mut().zip(h.0.iter()) {
            *r = *b as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `raw` is a handle from cuIpcGetMemHandle of another process
        // (a bad one makes the driver return an error, not UB); `ptr` is an
        // out-parameter.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
            .result()
        })?;
        Ok(IpcMapping {
            dev: dev.clone(),
            ptr,
        })
    }

    /// Device address of the mapped allocation in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// A 32-bit word of pinned host memory that the GPU can read
/// (`cuMemHostAlloc` with `DEVICEMAP`): the host writes it, a stream waits
/// on it with [`CudaStream::wait_value_geq`].
#[derive(Debug)]
pub struct HostFlag {
    dev: Arc<Device>,
    host: *mut u32,
    dptr: u64,
}

// SAFETY: the word is only accessed with volatile loads/stores of a u32
// through `load`/`store`; the pointer stays valid until drop.
unsafe impl Send for HostFlag {}
// SAFETY: as above.
unsafe impl Sync for HostFlag {}

impl HostFlag {
    /// Allocate the word, set to 0.
    pub fn new(dev: &Arc<Device>) -> Result<HostFlag> {
        dev.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is current; 64 bytes keep the word alone on
        // its cache line.
        let host = unsafe { cu::malloc_host(64, flags) }
            .map_err(|e| driver_err("cuMemHostAlloc", e))? as *mut u32;
        // SAFETY: `host` points to 64 writable bytes.
        unsafe { std::ptr::write_volatile(host, 0) };
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP in this context.
        let r = unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, host as *mut c_void, 0).result()
        };
        if let Err(e) = r {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once.
            let _ = unsafe { cu::free_host(host as *mut c_void) };
            return Err(driver_err("cuMemHostGetDevicePointer", e));
        }
        Ok(HostFlag {
            dev: dev.clone(),
            host,
            dptr,
        })
    }

    /// Write `v` (visible to the GPU).
    pub fn store(&self, v: u32) {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: `host` is valid until drop and only accessed as a u32.
        unsafe { std::ptr::write_volatile(self.host, v) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Read the word.
    pub fn load(&self) -> u32 {
        // SAFETY: as for `store`.
        unsafe { std::ptr::read_volatile(self.host) }
    }

    /// The device address of the word.
    pub fn device_ptr(&self) -> u64 {
        self.dptr
    }
}

impl Drop for HostFlag {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once.
            let _ = unsafe { cu::free_host(self.host as *mut c_void) };
        }
    }
}

/// A CUDA stream: created by braid (destroyed on drop) or borrowed from the
/// caller ([`CudaStream::borrowed`]).
#[derive(Debug)]
pub struct CudaStream {
    dev: Arc<Device>,
    raw: sys::CUstream,
    owned: bool,
}

// SAFETY: CUstream handles may be used from any thread of the process.
unsafe impl Send for CudaStream {}
// SAFETY: the driver serialises calls on a stream internally.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// A new non-blocking stream on `dev`.
    pub fn new(dev: &Arc<Device>) -> Result<CudaStream> {
        dev.bind()?;
        let raw = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_err("cuStreamCreate", e))?;
        Ok(CudaStream {
            dev: dev.clone(),
            raw,
            owned: true,
        })
    }

    /// Wrap a stream the caller created (a `CUstream`/`cudaStream_t` of
    /// `dev`'s primary context, or null for the legacy default stream).
    ///
    /// # Safety
    ///
    /// `raw` must be a valid stream of `dev`'s primary context and outlive
    /// the returned value, which never destroys it.
    pub unsafe fn borrowed(dev: &Arc<Device>, raw: *mut c_void) -> CudaStream {
        CudaStream {
            dev: dev.clone(),
            raw: raw as sys::CUstream,
            owned: false,
        }
    }

    /// The raw handle (`CUstream`).
    pub fn raw(&self) -> *mut c_void {
        self.raw as *mut c_void
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Block until all work on the stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: `raw` is a valid stream (constructor contract).
        check("cuStreamSynchronize", unsafe {
            cu::stream::synchronize(self.raw)
        })
    }

    /// Record `ev` at the current end of the stream.
    pub fn record(&self, ev: &Event) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: both handles are valid.
        check("cuEventRecord", unsafe {
            cu::event::record(ev.raw, self.raw)
        })
    }

    /// Make later work on this stream wait for `ev`.
    pub fn wait_event(&self, ev: &Event) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: both handles are valid.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, ev.raw, 0).result()
        })
    }

    /// Make later work on this stream wait until the 32-bit word `flag` is
    /// at least `value` (wrap-around aware: `(int32)(*flag - value) >= 0`).
    pub fn wait_value_geq(&self, flag: &HostFlag, value: u32) -> Result<()> {
        // SAFETY: the flag's device pointer maps pinned host memory that
        // lives as long as the HostFlag (the caller keeps it alive until the
        // stream passed the wait); it is a 4-byte aligned word.
        unsafe { self.wait_value_geq_at(flag.dptr, value) }
    }

    /// Make later work on this stream wait until the 32-bit word at device
    /// address `dptr` is at least `value` (wrap-around aware, as
    /// [`CudaStream::wait_value_geq`]).
    ///
    /// # Safety
    ///
    /// `dptr` must be a 4-byte aligned device address (own memory, an IPC
    /// mapping, or device-mapped host memory) that stays valid until the
    /// stream has passed the wait.
    pub unsafe fn wait_value_geq_at(&self, dptr: u64, value: u32) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: forwarded from this function's contract.
        check("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(
                self.raw,
                dptr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
            .result()
        })
    }

    /// Write the 32-bit `value` to device address `dptr` once the stream
    /// gets there, after a memory fence: everything the stream wrote before
    /// is visible to whoever sees the value.
    ///
    /// # Safety
    ///
    /// As for [`CudaStream::wait_value_geq_at`].
    pub unsafe fn write_value(&self, dptr: u64, value: u32) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: forwarded from this function's contract.
        check("cuStreamWriteValue32", unsafe {
            sys::cuStreamWriteValue32_v2(
                self.raw,
                dptr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
            .result()
        })
    }

    /// Enqueue a copy of `len` bytes between device addresses (this or a
    /// peer GPU, or IPC-mapped memory).
    ///
    /// # Safety
    ///
    /// `src` and `dst` must be device addresses valid for `len` bytes until
    /// the copy has run, and must not overlap.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: forwarded from this function's contract.
        check("cuMemcpyDtoDAsync", unsafe {
            cu::memcpy_dtod_async(dst, src, len, self.raw)
        })
    }

    /// Enqueue a copy of `len` bytes from host memory to a device address.
    ///
    /// # Safety
    ///
    /// `src` valid for reads of `len` bytes and `dst` for `len` device bytes
    /// until the copy has run (synchronise the stream before reusing `src`).
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: forwarded from this function's contract.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, self.raw).result()
        })
    }

    /// Enqueue a copy of `len` bytes from a device address to host memory.
    ///
    /// # Safety
    ///
    /// As for [`CudaStream::copy_htod`], the other way round.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: forwarded from this function's contract.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, self.raw).result()
        })
    }

    /// Enqueue a fill of `len` bytes at `dst` with `byte`.
    ///
    /// # Safety
    ///
    /// `dst` valid for `len` device bytes until the fill has run.
    pub unsafe fn memset(&self, dst: u64, byte: u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: forwarded from this function's contract.
        check("cuMemsetD8Async", unsafe {
            cu::memset_d8_async(dst, byte, len, self.raw)
        })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if self.owned && self.dev.bind().is_ok() {
            // SAFETY: an owned stream is destroyed once.
            let _ = unsafe { cu::stream::destroy(self.raw) };
        }
    }
}

/// A CUDA event, destroyed on drop.
#[derive(Debug)]
pub struct Event {
    dev: Arc<Device>,
    raw: sys::CUevent,
}

// SAFETY: CUevent handles may be used from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event; `timing` for [`Event::elapsed_ms`], otherwise timing is
    /// disabled (cheaper to record and wait on).
    pub fn new(dev: &Arc<Device>, timing: bool) -> Result<Event> {
        dev.bind()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let raw = cu::event::create(flags).map_err(|e| driver_err("cuEventCreate", e))?;
        Ok(Event {
            dev: dev.clone(),
            raw,
        })
    }

    /// Block until the event's recorded work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: `raw` is a valid event.
        check("cuEventSynchronize", unsafe {
            cu::event::synchronize(self.raw)
        })
    }

    /// Milliseconds between `start` and this event (both recorded, with
    /// timing).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32> {
        self.dev.bind()?;
        // SAFETY: both events are valid.
        unsafe { cu::event::elapsed(start.raw, self.raw) }
            .map_err(|e| driver_err("cuEventElapsedTime", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: destroyed once; the driver defers the release while the
            // event is still pending on a stream.
            let _ = unsafe { cu::event::destroy(self.raw) };
        }
    }
}

/// Compile braid's reduction kernels ([`kernels::source`]) with NVRTC to
/// PTX for the virtual architecture `arch` (`compute_80`): the device-free
/// half of [`Kernels`]' compile, which loads the result for its device's
/// `compute_XY`; `examples/kernel-check.rs` assembles it with ptxas. Needs
/// NVRTC only (no driver, no GPU). Returns the PTX text (no trailing NUL)
/// and NVRTC's log (its warnings; empty when it had nothing to say).
pub fn compile_ptx(arch: &str) -> Result<(String, String)> {
    // SAFETY: is_culib_present only tries to open the library by its
    // candidate names; it calls no NVRTC function (cudarc panics on a
    // missing library, so this comes first).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "NVRTC (libnvrtc.so.12 or libnvrtc.so) is not installed or not on the library path; braid compiles its reduction kernels with it"
                .into(),
        ));
    }
    let src = CString::new(kernels::source())
        .map_err(|_| CudaError::InvalidArgument("kernel source holds a NUL".into()))?;
    let nvrtc_err = |what: String, log: String| CudaError::Nvrtc {
        arch: arch.to_string(),
        what,
        log,
    };
    // NVRTC's strings, up to their NUL.
    let until_nul = |v: &[std::ffi::c_char]| -> Vec<u8> {
        v.iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect()
    };
    let prog = rtc::create_program(&src, Some(c"braid_kernels.cu"))
        .map_err(|e| nvrtc_err(format!("nvrtcCreateProgram: {e:?}"), String::new()))?;
    let opts = [format!("--gpu-architecture={arch}")];
    // SAFETY: `prog` was just created and is destroyed below, once.
    let compiled = unsafe { rtc::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { rtc::get_program_log(prog) }
        .map(|v| String::from_utf8_lossy(&until_nul(&v)).trim().to_string())
        .unwrap_or_default();
    let ptx = match compiled {
        // SAFETY: as above.
        Ok(()) => unsafe { rtc::get_ptx(prog) },
        Err(e) => {
            // SAFETY: as above.
            let _ = unsafe { rtc::destroy_program(prog) };
            return Err(nvrtc_err(format!("nvrtcCompileProgram: {e:?}"), log));
        }
    };
    // SAFETY: `prog` is destroyed once.
    let _ = unsafe { rtc::destroy_program(prog) };
    let ptx = ptx.map_err(|e| nvrtc_err(format!("nvrtcGetPTX: {e:?}"), log.clone()))?;
    let ptx = String::from_utf8(until_nul(&ptx))
        .map_err(|_| nvrtc_err("nvrtcGetPTX: the PTX is not UTF-8".into(), log.clone()))?;
    Ok((ptx, log))
}

/// The reduction kernels, compiled by NVRTC for one device.
#[derive(Debug)]
pub struct Kernels {
    dev: Arc<Device>,
    module: sys::CUmodule,
    funcs: HashMap<String, usize>,
}

// SAFETY: modules and functions are process-wide handles usable from any
// thread once loaded.
unsafe impl Send for Kernels {}
// SAFETY: as above; Kernels is immutable after loading.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Compile (once per device and process) and load the kernels.
    pub fn get(dev: &Arc<Device>) -> Result<Arc<Kernels>> {
        static CACHE: OnceLock<Mutex<HashMap<u32, Arc<Kernels>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        let mut c = cache
            .lock()
            .map_err(|_| CudaError::InvalidArgument("kernel cache poisoned".into()))?;
        if let Some(k) = c.get(&dev.ordinal) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::compile(dev)?);
        c.insert(dev.ordinal, k.clone());
        Ok(k)
    }

    fn compile(dev: &Arc<Device>) -> Result<Kernels> {
        probe()?;
        dev.bind()?;
        let (major, minor) = dev.cc;
        let arch = format!("compute_{major}{minor}");
        let (ptx, log) = compile_ptx(&arch)?;
        if !log.is_empty() {
            tracing::debug!(arch, log, "braid: NVRTC warnings");
        }
        let mut ptx = ptx.into_bytes();
        ptx.push(0);
        // SAFETY: `ptx` is NUL-terminated PTX text; the context is current.
        let module = unsafe { cu::module::load_data(ptx.as_ptr() as *const c_void) }
            .map_err(|e| driver_err("cuModuleLoadData", e))?;
        let mut funcs = HashMap::new();
        for name in kernels::all_names() {
            let cname = CString::new(name.clone()).expect("kernel names hold no NUL");
            // SAFETY: `module` was just loaded; the name is NUL-terminated.
            let f = unsafe { cu::module::get_function(module, cname) }
                .map_err(|e| driver_err("cuModuleGetFunction", e))?;
            funcs.insert(name, f as usize);
        }
        tracing::debug!(arch, kernels = funcs.len(), "braid: CUDA kernels compiled");
        Ok(Kernels {
            dev: dev.clone(),
            module,
            funcs,
        })
    }

    fn func(&self, name: &str) -> Result<sys::CUfunction> {
        self.funcs
            .get(name)
            .map(|&f| f as sys::CUfunction)
            .ok_or_else(|| CudaError::InvalidArgument(format!("no kernel {name}")))
    }

    /// Enqueue `dst[i] = a[i] (op) b[i]` for `n` elements of `dt` (Avg
    /// reduces as Sum; finish it with [`Kernels::divide`]).
    ///
    /// # Safety
    ///
    /// `dst`, `a`, `b` must be device addresses (this GPU, a peer or
    /// IPC-mapped) valid for `n` elements until the kernel has run, aligned
    /// for `dt`; `dst` may equal `a` or `b` but not partly overlap them.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        stream: &CudaStream,
        dt: DataType,
        op: RedOp,
        dst: u64,
        a: u64,
        b: u64,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.func(&kernels::reduce_name(dt, op))?;
        let (mut d, mut a, mut b, mut n64) = (dst, a, b, n as u64);
        let mut params: [*mut c_void; 4] = [
            &mut d as *mut u64 as *mut c_void,
            &mut a as *mut u64 as *mut c_void,
            &mut b as *mut u64 as *mut c_void,
            &mut n64 as *mut u64 as *mut c_void,
        ];
        self.dev.bind()?;
        // SAFETY: `f` takes (T*, const T*, const T*, unsigned long long),
        // matching `params`; the driver copies the parameters before
        // returning; memory validity is the caller's contract.
        check("cuLaunchKernel", unsafe {
            cu::launch_kernel(
                f,
                (kernels::grid_for(n), 1, 1),
                (kernels::BLOCK_THREADS, 1, 1),
                0,
                stream.raw,
                &mut params,
            )
        })
    }

    /// Enqueue `d[i] = d[i] / divisor` for `n` elements of `dt` (Avg).
    ///
    /// # Safety
    ///
    /// `d` valid for `n` elements of `dt` until the kernel has run.
    pub unsafe fn divide(
        &self,
        stream: &CudaStream,
        dt: DataType,
        d: u64,
        n: usize,
        divisor: u32,
    ) -> Result<()> {
        if n == 0 || divisor <= 1 {
            return Ok(());
        }
        let f = self.func(&kernels::divide_name(dt))?;
        let (mut d, mut n64, mut div) = (d, n as u64, divisor);
        let mut params: [*mut c_void; 3] = [
            &mut d as *mut u64 as *mut c_void,
            &mut n64 as *mut u64 as *mut c_void,
            &mut div as *mut u32 as *mut c_void,
        ];
        self.dev.bind()?;
        // SAFETY: `f` takes (T*, unsigned long long, unsigned int), matching
        // `params`; memory validity is the caller's contract.
        check("cuLaunchKernel", unsafe {
            cu::launch_kernel(
                f,
                (kernels::grid_for(n), 1, 1),
                (kernels::BLOCK_THREADS, 1, 1),
                0,
                stream.raw,
                &mut params,
            )
        })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: the module is unloaded once.
            let _ = unsafe { cu::module::unload(self.module) };
        }
    }
}

/// Device-to-device copy bandwidth of `dev` in GB/s (10^9 bytes copied per
/// second): `iters` copies of `bytes` between two fresh buffers on one
/// stream, timed with events after one warm-up copy.
pub fn d2d_copy_bandwidth(dev: &Arc<Device>, bytes: usize, iters: u32) -> Result<f64> {
    let bytes = bytes.max(1);
    let iters = iters.max(1);
    let a = DeviceBuffer::alloc(dev, bytes)?;
    let b = DeviceBuffer::alloc(dev, bytes)?;
    let s = CudaStream::new(dev)?;
    let (e0, e1) = (Event::new(dev, true)?, Event::new(dev, true)?);
    // SAFETY: both buffers hold `bytes` bytes, live until the stream is
    // synchronised below, and do not overlap.
    unsafe {
        s.memset(a.ptr(), 0x5a, bytes)?;
        s.copy_dtod(b.ptr(), a.ptr(), bytes)?;
    }
    s.record(&e0)?;
    for i in 0..iters {
        let (src, dst) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        // SAFETY: as above.
        unsafe { s.copy_dtod(dst.ptr(), src.ptr(), bytes)? };
    }
    s.record(&e1)?;
    s.synchronize()?;
    let ms = f64::from(e1.elapsed_ms(&e0)?);
    if ms <= 0.0 {
        return Err(CudaError::InvalidArgument(
            "the copies took no measurable time".into(),
        ));
    }
    Ok(bytes as f64 * f64::from(iters) / (ms * 1e-3) / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without CUDA (CI), everything reports "CUDA unavailable"
    /// with a reason, and nothing panics. On a GPU machine this test checks
    /// that the probe and a device open succeed instead.
    #[test]
    fn absence_is_an_error_not_a_panic() {
        match probe() {
            Err(e) => {
                let s = e.to_string();
                assert!(s.starts_with("CUDA unavailable: "), "{s}");
                assert!(matches!(Device::open(0), Err(CudaError::Unavailable(_))));
            }
            Ok(info) => {
                assert!(info.devices > 0);
                let d = Device::open(0).expect("device 0");
                assert!(!d.bus_id().is_empty());
            }
        }
    }

    /// Without NVRTC the device-free compile says so; with it, it compiles
    /// every kernel (scripts/cuda-kernels.sh also assembles them).
    #[test]
    fn compile_ptx_without_nvrtc_is_an_error_with_it_compiles() {
        match compile_ptx("compute_80") {
            Err(CudaError::Unavailable(s)) => assert!(s.contains("NVRTC"), "{s}"),
            Err(e) => panic!("{e}"),
            Ok((ptx, _log)) => {
                for name in kernels::all_names() {
                    assert!(ptx.contains(&format!(".entry {name}(")), "{name}");
                }
            }
        }
    }
}

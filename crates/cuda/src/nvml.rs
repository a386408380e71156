//! NVML, loaded at run time from `libnvidia-ml.so.1`: the answers to
//! [`braid_core::topo::nvml::NvmlQueries`] (GPUs, their NVLinks and what
//! is at the other end), for [`braid_core::topo::nvml::NvmlGpus`].
//!
//! This is braid-cuda's only module besides `driver` with `unsafe` code:
//! the `dlopen` of the library, the lookup of its symbols and the calls
//! through them. Nothing here panics: a missing library, a missing symbol,
//! a failed `nvmlInit_v2` or `BRAID_NVML_DISABLE=1` make [`Nvml::open`]
//! return "NVML unavailable: ...", and callers fall back (the CUDA driver
//! for the GPU list, a topology file or sysfs for the rest).
//!
//! The structures and constants are those of NVML's public header
//! (`nvml.h`, API version 12): `nvmlPciInfo_t` is 16 bytes of legacy bus
//! id, five `unsigned int`s and a 32-byte bus id; `nvmlFieldValue_t` is two
//! `unsigned int`s, two `long long`s, two enums and an 8-byte union.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use braid_core::topo::nvml::{NvLinkRemote, NvmlQueries};

type Ret = c_int; // nvmlReturn_t
type Device = *mut c_void; // nvmlDevice_t

const NVML_SUCCESS: Ret = 0;
const NVML_NVLINK_CAP_P2P_SUPPORTED: c_uint = 0;
const NVML_FEATURE_ENABLED: c_uint = 1;
const NVML_FI_DEV_NVLINK_GET_STATE: c_uint = 165;
const NVML_FI_DEV_C2C_LINK_COUNT: c_uint = 170;
const NVML_FI_DEV_C2C_LINK_GET_STATUS: c_uint = 171;
const NVML_FI_DEV_C2C_LINK_GET_MAX_BW: c_uint = 172;
const NVML_NVLINK_DEVICE_TYPE_GPU: c_uint = 0;
const NVML_NVLINK_DEVICE_TYPE_IBMNPU: c_uint = 1;
const NVML_NVLINK_DEVICE_TYPE_SWITCH: c_uint = 2;

/// `nvmlPciInfo_t` (v3).
#[repr(C)]
#[derive(Clone, Copy)]
struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

impl PciInfo {
    fn zeroed() -> PciInfo {
        PciInfo {
            bus_id_legacy: [0; 16],
            domain: 0,
            bus: 0,
            device: 0,
            pci_device_id: 0,
            pci_sub_system_id: 0,
            bus_id: [0; 32],
        }
    }

    /// The bus id string (`00000000:18:00.0`); empty when NVML gave none.
    fn bus_id(&self) -> String {
        let bytes: Vec<u8> = self
            .bus_id
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// `nvmlFieldValue_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct FieldValue {
    field_id: c_uint,
    scope_id: c_uint,
    timestamp: i64,
    latency_usec: i64,
    value_type: c_uint,
    nvml_return: Ret,
    value: u64, // the union; the fields asked here are unsigned ints
}

impl FieldValue {
    fn new(field_id: c_uint, scope_id: c_uint) -> FieldValue {
        FieldValue {
            field_id,
            scope_id,
            timestamp: 0,
            latency_usec: 0,
            value_type: 0,
            nvml_return: 0,
            value: 0,
        }
    }
    /// The `uiVal` member of the union (its low 32 bits: every target is
    /// little-endian where NVML exists).
    fn ui(&self) -> u32 {
        self.value as u32
    }
}

/// The entry points braid uses, resolved once.
struct Api {
    init: unsafe extern "C" fn() -> Ret,
    shutdown: unsafe extern "C" fn() -> Ret,
    error_string: unsafe extern "C" fn(Ret) -> *const c_char,
    device_count: unsafe extern "C" fn(*mut c_uint) -> Ret,
    handle_by_index: unsafe extern "C" fn(c_uint, *mut Device) -> Ret,
    pci_info: unsafe extern "C" fn(Device, *mut PciInfo) -> Ret,
    compute_capability: unsafe extern "C" fn(Device, *mut c_int, *mut c_int) -> Ret,
    nvlink_capability: unsafe extern "C" fn(Device, c_uint, c_uint, *mut c_uint) -> Ret,
    nvlink_state: unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> Ret,
    nvlink_remote_pci: unsafe extern "C" fn(Device, c_uint, *mut PciInfo) -> Ret,
    nvlink_remote_type: Option<unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> Ret>,
    field_values: Option<unsafe extern "C" fn(Device, c_int, *mut FieldValue) -> Ret>,
}

/// An initialised NVML (`nvmlInit_v2` done; `nvmlShutdown` on drop).
pub struct Nvml {
    api: Api,
    /// Keeps the library mapped while `api` points into it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvml")
    }
}

/// The library's file name.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// What the dynamic loader said (`dlerror`'s text, which names the file),
/// not only libloading's "dlopen failed".
fn dl_text(e: &libloading::Error) -> String {
    std::error::Error::source(e).map_or_else(|| format!("{LIBRARY}: {e}"), |s| s.to_string())
}

impl Nvml {
    /// Load and initialise NVML. Err says why it is unavailable
    /// ("NVML unavailable: ...").
    pub fn open() -> Result<Nvml, String> {
        let unavailable = |why: String| format!("NVML unavailable: {why}");
        let env = braid_core::config::process_env;
        match braid_core::config::flag(&env, "BRAID_NVML_DISABLE", false) {
            Ok(true) => return Err(unavailable("disabled by BRAID_NVML_DISABLE".into())),
            Ok(false) => {}
            Err(e) => return Err(unavailable(e.to_string())),
        }
        // SAFETY: loading NVML runs its initialisers; NVML is a library made
        // to be loaded into any process (NCCL and nvidia-smi dlopen it too).
        let lib =
            unsafe { libloading::Library::new(LIBRARY) }.map_err(|e| unavailable(dl_text(&e)))?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is NVML's function of that name, and the
                // field's type is its C signature from nvml.h; the pointer is
                // only used while `lib` is alive (it is kept in `Nvml`).
                let s = unsafe { lib.get($name) }.map_err(|e| {
                    unavailable(format!(
                        "{}: {}",
                        String::from_utf8_lossy($name),
                        dl_text(&e)
                    ))
                })?;
                *s
            }};
        }
        macro_rules! opt_sym {
            ($name:literal) => {{
                // SAFETY: as for `sym!`; absent in older drivers, hence optional.
                unsafe { lib.get($name) }.ok().map(|s| *s)
            }};
        }
        let api = Api {
            init: sym!(b"nvmlInit_v2"),
            shutdown: sym!(b"nvmlShutdown"),
            error_string: sym!(b"nvmlErrorString"),
            device_count: sym!(b"nvmlDeviceGetCount_v2"),
            handle_by_index: sym!(b"nvmlDeviceGetHandleByIndex_v2"),
            pci_info: sym!(b"nvmlDeviceGetPciInfo_v3"),
            compute_capability: sym!(b"nvmlDeviceGetCudaComputeCapability"),
            nvlink_capability: sym!(b"nvmlDeviceGetNvLinkCapability"),
            nvlink_state: sym!(b"nvmlDeviceGetNvLinkState"),
            nvlink_remote_pci: sym!(b"nvmlDeviceGetNvLinkRemotePciInfo_v2"),
            nvlink_remote_type: opt_sym!(b"nvmlDeviceGetNvLinkRemoteDeviceType"),
            field_values: opt_sym!(b"nvmlDeviceGetFieldValues"),
        };
        // SAFETY: nvmlInit_v2 takes no arguments; it may be called from any
        // thread and is reference counted (balanced by nvmlShutdown in Drop).
        let r = unsafe { (api.init)() };
        if r != NVML_SUCCESS {
            // Not initialised: no shutdown owed; the library is unloaded.
            return Err(unavailable(format!("nvmlInit_v2: {}", error_text(&api, r))));
        }
        Ok(Nvml { api, _lib: lib })
    }

    fn error(&self, r: Ret) -> String {
        error_text(&self.api, r)
    }

    fn check(&self, call: &str, r: Ret) -> Result<(), String> {
        if r == NVML_SUCCESS {
            Ok(())
        } else {
            Err(format!("{call}: {}", self.error(r)))
        }
    }

    fn handle(&self, dev: u32) -> Result<Device, String> {
        let mut h: Device = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; NVML is initialised.
        let r = unsafe { (self.api.handle_by_index)(dev, &mut h) };
        self.check("nvmlDeviceGetHandleByIndex_v2", r)?;
        Ok(h)
    }

    /// One field value of a device (`nvmlDeviceGetFieldValues`), as an
    /// unsigned int.
    fn field(&self, h: Device, field: c_uint, scope: c_uint) -> Result<u32, String> {
        let f = self
            .api
            .field_values
            .ok_or("nvmlDeviceGetFieldValues is not in this driver")?;
        let mut v = FieldValue::new(field, scope);
        // SAFETY: one value, `v` is a valid nvmlFieldValue_t; `h` came from
        // nvmlDeviceGetHandleByIndex_v2.
        let r = unsafe { f(h, 1, &mut v) };
        self.check("nvmlDeviceGetFieldValues", r)?;
        self.check("nvmlDeviceGetFieldValues (value)", v.nvml_return)?;
        Ok(v.ui())
    }
}

/// NVML's text for a return code.
fn error_text(api: &Api, r: Ret) -> String {
    // SAFETY: nvmlErrorString returns a pointer to a static string for any
    // code (it needs no initialisation), or null.
    let p = unsafe { (api.error_string)(r) };
    if p.is_null() {
        return format!("NVML error {r}");
    }
    // SAFETY: not null, and NVML's strings are NUL-terminated and static.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: balanced with the successful nvmlInit_v2 in `open`.
        let _ = unsafe { (self.api.shutdown)() };
    }
}

impl NvmlQueries for Nvml {
    fn describe(&self) -> String {
        format!("NVML ({LIBRARY})")
    }

    fn device_count(&self) -> Result<u32, String> {
        let mut n: c_uint = 0;
        // SAFETY: `n` is a valid out-pointer; NVML is initialised.
        let r = unsafe { (self.api.device_count)(&mut n) };
        self.check("nvmlDeviceGetCount_v2", r)?;
        Ok(n)
    }

    fn pci_bus_id(&self, dev: u32) -> Result<String, String> {
        let h = self.handle(dev)?;
        let mut p = PciInfo::zeroed();
        // SAFETY: `p` is a valid nvmlPciInfo_t (v3 layout); `h` is a handle.
        let r = unsafe { (self.api.pci_info)(h, &mut p) };
        self.check("nvmlDeviceGetPciInfo_v3", r)?;
        Ok(p.bus_id())
    }

    fn compute_capability(&self, dev: u32) -> Result<(u32, u32), String> {
        let h = self.handle(dev)?;
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: two valid out-pointers; `h` is a handle.
        let r = unsafe { (self.api.compute_capability)(h, &mut major, &mut minor) };
        self.check("nvmlDeviceGetCudaComputeCapability", r)?;
        Ok((major.max(0) as u32, minor.max(0) as u32))
    }

    fn nvlink_p2p_supported(&self, dev: u32, link: u32) -> Result<bool, String> {
        let h = self.handle(dev)?;
        let mut v: c_uint = 0;
        // SAFETY: valid out-pointer; `h` is a handle; NVML checks `link`.
        let r =
            unsafe { (self.api.nvlink_capability)(h, link, NVML_NVLINK_CAP_P2P_SUPPORTED, &mut v) };
        self.check("nvmlDeviceGetNvLinkCapability", r)?;
        Ok(v != 0)
    }

    fn nvlink_active(&self, dev: u32, link: u32) -> Result<bool, String> {
        let h = self.handle(dev)?;
        // From sm90 on, NCCL reads the link state as a field value.
        let (major, _) = self.compute_capability(dev)?;
        if major >= 9 && self.api.field_values.is_some() {
            return Ok(self.field(h, NVML_FI_DEV_NVLINK_GET_STATE, link)? == NVML_FEATURE_ENABLED);
        }
        let mut v: c_uint = 0;
        // SAFETY: valid out-pointer; `h` is a handle; NVML checks `link`.
        let r = unsafe { (self.api.nvlink_state)(h, link, &mut v) };
        self.check("nvmlDeviceGetNvLinkState", r)?;
        Ok(v == NVML_FEATURE_ENABLED)
    }

    fn nvlink_remote_bus_id(&self, dev: u32, link: u32) -> Result<String, String> {
        let h = self.handle(dev)?;
        let mut p = PciInfo::zeroed();
        // SAFETY: `p` is a valid nvmlPciInfo_t; `h` is a handle.
        let r = unsafe { (self.api.nvlink_remote_pci)(h, link, &mut p) };
        self.check("nvmlDeviceGetNvLinkRemotePciInfo_v2", r)?;
        Ok(p.bus_id())
    }

    fn nvlink_remote_type(&self, dev: u32, link: u32) -> Result<NvLinkRemote, String> {
        let Some(f) = self.api.nvlink_remote_type else {
            return Ok(NvLinkRemote::Unknown);
        };
        let h = self.handle(dev)?;
        let mut v: c_uint = 0xff;
        // SAFETY: valid out-pointer; `h` is a handle.
        let r = unsafe { f(h, link, &mut v) };
        self.check("nvmlDeviceGetNvLinkRemoteDeviceType", r)?;
        Ok(match v {
            NVML_NVLINK_DEVICE_TYPE_GPU => NvLinkRemote::Gpu,
            NVML_NVLINK_DEVICE_TYPE_IBMNPU => NvLinkRemote::Cpu,
            NVML_NVLINK_DEVICE_TYPE_SWITCH => NvLinkRemote::Switch,
            _ => NvLinkRemote::Unknown,
        })
    }

    fn c2c(&self, dev: u32) -> Result<Option<(u32, u32)>, String> {
        if self.api.field_values.is_none() || self.compute_capability(dev)?.0 < 9 {
            return Ok(None);
        }
        let h = self.handle(dev)?;
        let Ok(links) = self.field(h, NVML_FI_DEV_C2C_LINK_COUNT, 0) else {
            return Ok(None);
        };
        let (mut count, mut bw) = (0, 0);
        for l in 0..links {
            let up = self.field(h, NVML_FI_DEV_C2C_LINK_GET_STATUS, l);
            let max = self.field(h, NVML_FI_DEV_C2C_LINK_GET_MAX_BW, l);
            if let (Ok(1), Ok(b)) = (up, max) {
                count += 1;
                bw = b;
            }
        }
        Ok((count > 0).then_some((count, bw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layouts NVML's header gives.
    #[test]
    fn structures_have_nvml_layout() {
        assert_eq!(std::mem::size_of::<PciInfo>(), 68);
        assert_eq!(std::mem::size_of::<FieldValue>(), 40);
        assert_eq!(std::mem::align_of::<FieldValue>(), 8);
    }

    /// Without NVML (this machine, or BRAID_NVML_DISABLE) opening says why,
    /// without a panic; with it, the answers go through braid's NVML logic.
    #[test]
    fn open_never_panics() {
        match Nvml::open() {
            Err(e) => assert!(e.starts_with("NVML unavailable: "), "{e}"),
            Ok(n) => {
                let gpus = braid_core::topo::nvml::NvmlGpus { q: n };
                let (list, notes) = gpus.read();
                println!("NVML here: {} GPU(s), notes {notes:?}", list.len());
            }
        }
    }
}

//! libibverbs, loaded at run time: the library is opened with `dlopen` the
//! first time a communicator looks for RDMA devices, and every entry point
//! braid calls is looked up once. A host without the library (or with one
//! older than braid needs) gets an error that says so, and IB is
//! "unavailable" there; nothing RDMA-related is needed to build or to run
//! elsewhere. Like NCCL's `ibvwrap`, the inline functions of verbs.h
//! (`ibv_poll_cq`, `ibv_post_send`, ...) are not symbols: they go through
//! the context's ops table (see `abi::ibv_context_ops`).

use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use super::abi::*;

/// The library's file name (its soname: rdma-core's ABI 1).
pub(crate) const LIBRARY: &str = "libibverbs.so.1";

/// The exported functions of libibverbs braid calls, with verbs.h's
/// signatures (the default symbol versions, which are those of the current
/// headers: `IBVERBS_1.1` for the classic verbs).
pub(crate) struct Api {
    pub(crate) get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub(crate) free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub(crate) get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub(crate) open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub(crate) close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub(crate) query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub(crate) query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut PortAttrRoom) -> c_int,
    pub(crate) query_gid_table:
        unsafe extern "C" fn(*mut ibv_context, *mut ibv_gid_entry, usize, u32, usize) -> isize,
    pub(crate) alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub(crate) dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub(crate) reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub(crate) dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub(crate) wc_status_str: unsafe extern "C" fn(c_uint) -> *const c_char,
    pub(crate) create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub(crate) destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub(crate) create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub(crate) destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub(crate) get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub(crate) ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    pub(crate) create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub(crate) modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub(crate) destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(LIBRARY)
    }
}

/// libibverbs' entry points, loaded on first use (once per process; the
/// library then stays loaded, as its providers expect). Err says why IB
/// cannot be used here: "libibverbs.so.1: cannot open shared object file
/// ..." or the missing symbol.
pub(crate) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| load(LIBRARY))
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens `file` (the verbs library, by soname or path) and looks up every
/// entry point.
fn load(file: &str) -> Result<Api, String> {
    // SAFETY: loading libibverbs runs its initialisers, which only set up
    // the library's own state; it is made to be loaded into any process
    // (NCCL, UCX and MPI libraries dlopen it the same way).
    let lib = unsafe { libloading::Library::new(file) }.map_err(|e| dl_text(&e))?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol is libibverbs' function of that name and
            // the field's type is its C signature in verbs.h; the library is
            // never unloaded (leaked below), so the pointer stays valid.
            let s = unsafe { lib.get($name) }.map_err(|e| {
                format!(
                    "{file} has no {} (rdma-core older than v32?): {}",
                    String::from_utf8_lossy($name),
                    dl_text(&e)
                )
            })?;
            *s
        }};
    }
    let api = Api {
        get_device_list: sym!(b"ibv_get_device_list"),
        free_device_list: sym!(b"ibv_free_device_list"),
        get_device_name: sym!(b"ibv_get_device_name"),
        open_device: sym!(b"ibv_open_device"),
        close_device: sym!(b"ibv_close_device"),
        query_device: sym!(b"ibv_query_device"),
        query_port: sym!(b"ibv_query_port"),
        query_gid_table: sym!(b"_ibv_query_gid_table"),
        alloc_pd: sym!(b"ibv_alloc_pd"),
        dealloc_pd: sym!(b"ibv_dealloc_pd"),
        reg_mr: sym!(b"ibv_reg_mr"),
        dereg_mr: sym!(b"ibv_dereg_mr"),
        wc_status_str: sym!(b"ibv_wc_status_str"),
        create_comp_channel: sym!(b"ibv_create_comp_channel"),
        destroy_comp_channel: sym!(b"ibv_destroy_comp_channel"),
        create_cq: sym!(b"ibv_create_cq"),
        destroy_cq: sym!(b"ibv_destroy_cq"),
        get_cq_event: sym!(b"ibv_get_cq_event"),
        ack_cq_events: sym!(b"ibv_ack_cq_events"),
        create_qp: sym!(b"ibv_create_qp"),
        modify_qp: sym!(b"ibv_modify_qp"),
        destroy_qp: sym!(b"ibv_destroy_qp"),
    };
    // Providers loaded by the library keep pointers into it, and contexts
    // may outlive any one owner: it stays mapped for the process's life.
    std::mem::forget(lib);
    Ok(api)
}

/// What the dynamic loader said (`dlerror`'s text: "libibverbs.so.1:
/// cannot open shared object file: ..."), not only "dlopen failed".
fn dl_text(e: &libloading::Error) -> String {
    std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let e = load("libibverbs-braid-test-absent.so.1").err().unwrap();
        assert!(
            e.contains("libibverbs-braid-test-absent.so.1: cannot open shared object file"),
            "{e}"
        );
    }

    /// Every entry point exists in the installed rdma-core. The layout
    /// check's build (feature `abi-check`) installs it, so there it must
    /// load; elsewhere a machine without it skips.
    #[test]
    fn every_entry_point_is_in_the_installed_library() {
        match load(LIBRARY) {
            Ok(_) => {}
            Err(e) if cfg!(feature = "abi-check") => panic!("{e}"),
            Err(e) => eprintln!("skipped: needs {LIBRARY}: {e}"),
        }
    }
}

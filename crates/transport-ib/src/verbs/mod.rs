//! The one module with `unsafe`: owned, thread-safe handles over the verbs
//! library, which is loaded at run time (`load.rs`: `dlopen` of
//! libibverbs.so.1, its entry points looked up once; `abi.rs`: the C types
//! of verbs.h written out, checked against rdma-core's headers by a test).
//!
//! Why a loader of our own and not a crate: `ibverbs`/`ibverbs-sys` (and
//! `rdma-sys`) link libibverbs at build time and run cmake and bindgen over
//! rdma-core's headers; `rdma-mummy-sys` (sideway's) loads it at run time
//! but still needs cmake and clang to build, and wraps hundreds of entry
//! points. braid calls 22 functions and four ops-table entries, so a table
//! of its own (as NCCL's `ibvwrap`) keeps the build free of any RDMA or C
//! tool and every unsafe call in this one module.
//!
//! Ownership makes the verbs' lifetime rules hold by construction: a
//! [`Mr`], [`Cq`] and [`Qp`] each hold an `Arc` of the [`Device`] (context and
//! protection domain), a [`Qp`] holds its [`Cq`] and every [`Mr`] it ever
//! posted from, so a QP is destroyed before its CQ and before the memory its
//! work requests read, and the device context is closed last. Failures of
//! destroy verbs in `Drop` are logged, never panicked on.

use std::io;
use std::os::raw::c_void;
use std::ptr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abi::*;

mod abi;
mod load;

pub(crate) use abi::ibv_wc;
pub(crate) use load::LIBRARY;

/// Loads libibverbs if that was not done yet: Err says why it cannot be.
pub(crate) fn library() -> Result<(), String> {
    load::api().map(|_| ())
}

/// The loaded library, or why there is none.
fn lib() -> io::Result<&'static load::Api> {
    load::api().map_err(|e| io::Error::new(io::ErrorKind::NotFound, e))
}

use crate::info::Addr;
use crate::probe::{GidDesc, GidKind, LinkLayer, PortDesc};

fn errno_result(what: &str, rc: i32) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        let e = io::Error::from_raw_os_error(rc.abs());
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    }
}

fn null_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Every port of every RDMA device the verbs library lists. An error when
/// the library reports no RDMA support at all (no kernel support, no
/// `/sys/class/infiniband`).
pub(crate) fn list_ports() -> io::Result<Vec<PortDesc>> {
    let names = device_names()?;
    let mut out = Vec::new();
    for name in names {
        match Device::open(&name) {
            Ok(dev) => out.extend(dev.ports()?),
            Err(e) => tracing::warn!("IB: cannot open {name}: {e}"),
        }
    }
    Ok(out)
}

/// The names of the devices the library lists (an error when it reports
/// no RDMA support at all).
fn device_names() -> io::Result<Vec<String>> {
    let mut names = Vec::new();
    walk_devices(lib()?, |_, name| {
        names.push(name.to_string_lossy().into_owned());
        None::<()>
    })?;
    Ok(names)
}

/// Walks the library's device list: `visit` sees each device with its name
/// (both valid only during the call) and ends the walk by returning `Some`.
/// The list is freed before this returns.
fn walk_devices<T>(
    api: &load::Api,
    mut visit: impl FnMut(*mut ibv_device, &std::ffi::CStr) -> Option<T>,
) -> io::Result<Option<T>> {
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { (api.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(null_err("ibv_get_device_list"));
    }
    let mut found = None;
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let d = unsafe { *list.add(i) };
        // SAFETY: `d` is a valid device; the name is owned by the list.
        let dn = unsafe { (api.get_device_name)(d) };
        if dn.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated string from the library, valid while
        // the list is (the visitor copies what it keeps).
        let dn = unsafe { std::ffi::CStr::from_ptr(dn) };
        found = visit(d, dn);
        if found.is_some() {
            break;
        }
    }
    // SAFETY: the list came from ibv_get_device_list; contexts opened from
    // it stay valid after it is freed.
    unsafe { (api.free_device_list)(list) };
    Ok(found)
}

/// An open device context and one protection domain on it.
#[derive(Debug)]
pub(crate) struct Device {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    name: String,
    api: &'static load::Api,
}

// SAFETY: verbs contexts and PDs may be used from any thread (libibverbs
// serialises internally); the pointers are only freed in Drop.
unsafe impl Send for Device {}
// SAFETY: as above; no method takes `&mut self`.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device called `name` and allocates a protection domain.
    pub(crate) fn open(name: &str) -> io::Result<Arc<Device>> {
        let api = lib()?;
        let opened = walk_devices(api, |d, dn| {
            (dn.to_bytes() == name.as_bytes()).then(|| {
                // SAFETY: `d` is valid while the list is.
                let ctx = unsafe { (api.open_device)(d) };
                if ctx.is_null() {
                    Err(null_err("ibv_open_device"))
                } else {
                    Ok(ctx)
                }
            })
        })?;
        let ctx = opened.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no RDMA device named {name}"),
            )
        })??;
        // SAFETY: `ctx` is an open context.
        let pd = unsafe { (api.alloc_pd)(ctx) };
        if pd.is_null() {
            let e = null_err("ibv_alloc_pd");
            // SAFETY: nothing else uses the context.
            unsafe { (api.close_device)(ctx) };
            return Err(e);
        }
        Ok(Arc::new(Device {
            ctx,
            pd,
            name: name.to_owned(),
            api,
        }))
    }

    /// Describes every port.
    pub(crate) fn ports(&self) -> io::Result<Vec<PortDesc>> {
        let api = self.api;
        let mut da = ibv_device_attr::default();
        // SAFETY: valid context and out-pointer.
        errno_result("ibv_query_device", unsafe {
            (api.query_device)(self.ctx, &mut da)
        })?;
        let numa = crate::probe::device_numa_node(&self.name);
        let mut out = Vec::new();
        for port in 1..=da.phys_port_cnt {
            let mut room = PortAttrRoom::default();
            // SAFETY: valid context and port number; the out-pointer has
            // room for any version of the structure.
            errno_result("ibv_query_port", unsafe {
                (api.query_port)(self.ctx, port, &mut room)
            })?;
            let pa = room.attr;
            let active = pa.state == IBV_PORT_ACTIVE;
            let link_layer = match pa.link_layer {
                IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                l => LinkLayer::Other(l),
            };
            let mut gids = Vec::new();
            if active && pa.gid_tbl_len > 0 {
                let mut tbl = vec![
                    ibv_gid_entry::default();
                    pa.gid_tbl_len as usize * da.phys_port_cnt as usize
                ];
                // SAFETY: `tbl` has room for `tbl.len()` entries of the
                // size passed.
                let got = unsafe {
                    (api.query_gid_table)(
                        self.ctx,
                        tbl.as_mut_ptr(),
                        tbl.len(),
                        0,
                        std::mem::size_of::<ibv_gid_entry>(),
                    )
                };
                if got < 0 {
                    tracing::debug!("IB: {}: GID table query failed ({got})", self.name);
                }
                for e in tbl.iter().take(got.max(0) as usize) {
                    if e.port_num != u32::from(port) {
                        continue;
                    }
                    let raw = e.gid.raw;
                    if raw == [0; 16] {
                        continue;
                    }
                    gids.push(GidDesc {
                        index: e.gid_index,
                        gid: raw,
                        kind: if e.gid_type == IBV_GID_TYPE_ROCE_V2 {
                            GidKind::RoceV2
                        } else {
                            GidKind::IbOrRoceV1
                        },
                    });
                }
                gids.sort_by_key(|g| g.index);
            }
            out.push(PortDesc {
                device: self.name.clone(),
                port,
                active,
                link_layer,
                lid: pa.lid,
                mtu: pa.active_mtu as u8,
                gids,
                numa_node: numa,
            });
        }
        Ok(out)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every Mr, Cq and Qp holds an Arc of this device, so none
        // is left; the PD and context are freed once.
        let rc = unsafe { (self.api.dealloc_pd)(self.pd) };
        if rc != 0 {
            tracing::warn!("IB: ibv_dealloc_pd on {}: errno {rc}", self.name);
        }
        // SAFETY: as above.
        let rc = unsafe { (self.api.close_device)(self.ctx) };
        if rc != 0 {
            tracing::warn!("IB: ibv_close_device on {}: errno {rc}", self.name);
        }
    }
}

/// Page-aligned, zeroed memory registered with the device.
#[derive(Debug)]
pub(crate) struct Mr {
    _dev: Arc<Device>,
    mr: *mut ibv_mr,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the registration may be used from any thread; the memory is only
// accessed through raw pointers (by the engine, the HCA and the bounded
// copies below).
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Maps `len` bytes (rounded up to a page) and registers them for local
    /// writes and, with `remote_write`, for RDMA writes from peers.
    pub(crate) fn alloc(dev: &Arc<Device>, len: usize, remote_write: bool) -> io::Result<Arc<Mr>> {
        let len = len.max(1).div_ceil(4096) * 4096;
        // SAFETY: an anonymous private mapping; no existing memory touched.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(null_err("mmap"));
        }
        let mut access = IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: valid PD; `p` is mapped for `len` bytes and stays mapped
        // until Drop, after deregistration.
        let mr = unsafe { (dev.api.reg_mr)(dev.pd, p, len, access) };
        if mr.is_null() {
            let e = null_err("ibv_reg_mr (is `ulimit -l` large enough?)");
            // SAFETY: the mapping made above, never shared.
            unsafe { libc::munmap(p, len) };
            return Err(e);
        }
        Ok(Arc::new(Mr {
            _dev: dev.clone(),
            mr,
            ptr: p.cast(),
            len,
        }))
    }

    /// Start of the memory.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Start as the address peers write to.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Mapped length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Local key.
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: `mr` is valid until Drop.
        unsafe { (*self.mr).lkey }
    }

    /// Remote key.
    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: `mr` is valid until Drop.
        unsafe { (*self.mr).rkey }
    }

    /// Copies `data` to offset `off` (bounds-checked; false if it does not
    /// fit).
    pub(crate) fn write_at(&self, off: usize, data: &[u8]) -> bool {
        if off.checked_add(data.len()).is_none_or(|e| e > self.len) {
            return false;
        }
        // SAFETY: in bounds of the mapping; raw byte copy, no reference to
        // the mapped memory is formed.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
        true
    }

    /// Copies `len` bytes at offset `off` out (clamped to the mapping).
    pub(crate) fn read_at(&self, off: usize, len: usize) -> Vec<u8> {
        let off = off.min(self.len);
        let len = len.min(self.len - off);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds of the mapping; the peer wrote these bytes
        // before the completion that made the caller read them.
        unsafe { ptr::copy_nonoverlapping(self.ptr.add(off), v.as_mut_ptr(), len) };
        v
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once; every QP that posted from it is gone
        // (each holds an Arc), so no work request still reads it.
        let rc = unsafe { (self._dev.api.dereg_mr)(self.mr) };
        if rc != 0 {
            tracing::warn!("IB: ibv_dereg_mr: errno {rc}");
            // The HCA may still own the pages: leak them rather than unmap.
            return;
        }
        // SAFETY: the mapping made in `alloc`, no longer registered.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A work completion, decoded.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wc {
    /// The work request id.
    pub wr_id: u64,
    /// `None` on success, else the status and the vendor error.
    pub error: Option<(u32, u32)>,
    /// Bytes written (receive side of a write with immediate).
    pub byte_len: u32,
    /// The immediate, in host order.
    pub imm: Option<u32>,
}

/// The text of a completion status (`transport retry counter exceeded`).
pub(crate) fn status_str(status: u32) -> String {
    let Ok(api) = lib() else {
        return format!("status {status}");
    };
    // SAFETY: returns a static string for any value.
    let p = unsafe { (api.wc_status_str)(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// Status value of a retry-exceeded completion.
pub(crate) const WC_RETRY_EXC_ERR: u32 = IBV_WC_RETRY_EXC_ERR;
/// Status value of a flushed work request (the QP went to the error state).
pub(crate) const WC_WR_FLUSH_ERR: u32 = IBV_WC_WR_FLUSH_ERR;

/// A completion queue with its own completion channel, so a progress thread
/// can sleep until something completes.
#[derive(Debug)]
pub(crate) struct Cq {
    _dev: Arc<Device>,
    ch: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
}

// SAFETY: polling and arming a CQ are thread-safe in libibverbs providers;
// only the progress thread polls, other threads only create QPs on it.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// A CQ of at least `cqe` entries.
    pub(crate) fn new(dev: &Arc<Device>, cqe: usize) -> io::Result<Arc<Cq>> {
        // SAFETY: valid context.
        let ch = unsafe { (dev.api.create_comp_channel)(dev.ctx) };
        if ch.is_null() {
            return Err(null_err("ibv_create_comp_channel"));
        }
        // SAFETY: `ch` is valid; its fd is made non-blocking so a spurious
        // wake-up never blocks in ibv_get_cq_event.
        let fd = unsafe { (*ch).fd };
        // SAFETY: fcntl on a descriptor this channel owns.
        unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        // SAFETY: valid context and channel.
        let cq = unsafe { (dev.api.create_cq)(dev.ctx, cqe as i32, ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            let e = null_err("ibv_create_cq");
            // SAFETY: the channel has no CQ.
            unsafe { (dev.api.destroy_comp_channel)(ch) };
            return Err(e);
        }
        Ok(Arc::new(Cq {
            _dev: dev.clone(),
            ch,
            cq,
        }))
    }

    /// Non-blocking: moves up to `out.len()` completions into `out`.
    pub(crate) fn poll(&self, buf: &mut [ibv_wc], out: &mut Vec<Wc>) -> io::Result<()> {
        out.clear();
        // SAFETY: `cq` is valid; the provider's poll function writes at most
        // `buf.len()` entries.
        let n = unsafe {
            let ctx = (*self.cq).context;
            let poll = (*ctx)
                .ops
                .poll_cq
                .ok_or_else(|| io::Error::other("no poll_cq"))?;
            poll(self.cq, buf.len() as i32, buf.as_mut_ptr())
        };
        if n < 0 {
            return Err(io::Error::other("ibv_poll_cq failed"));
        }
        for wc in &buf[..n as usize] {
            out.push(Wc {
                wr_id: wc.wr_id,
                error: (wc.status != IBV_WC_SUCCESS).then_some((wc.status, wc.vendor_err)),
                byte_len: wc.byte_len,
                imm: (wc.wc_flags & IBV_WC_WITH_IMM != 0).then(|| u32::from_be(wc.imm_data)),
            });
        }
        Ok(())
    }

    /// Asks for an event on the next completion.
    pub(crate) fn arm(&self) -> io::Result<()> {
        // SAFETY: `cq` is valid; the provider's notify function.
        let rc = unsafe {
            let ctx = (*self.cq).context;
            let f = (*ctx)
                .ops
                .req_notify_cq
                .ok_or_else(|| io::Error::other("no req_notify_cq"))?;
            f(self.cq, 0)
        };
        errno_result("ibv_req_notify_cq", rc)
    }

    /// The completion channel's descriptor (readable once an armed event
    /// arrived), for a thread that sleeps on several CQs at once.
    pub(crate) fn channel_fd(&self) -> std::os::fd::RawFd {
        // SAFETY: the channel is valid until Drop.
        unsafe { (*self.ch).fd }
    }

    /// The device this CQ lives on.
    pub(crate) fn device_name(&self) -> &str {
        &self._dev.name
    }

    /// Takes and acknowledges the channel's event, if one arrived (never
    /// blocks: the descriptor is non-blocking).
    pub(crate) fn ack_event(&self) {
        let api = self._dev.api;
        let mut cq: *mut ibv_cq = ptr::null_mut();
        let mut ctx: *mut c_void = ptr::null_mut();
        // SAFETY: valid channel and out-pointers; the fd is non-blocking, so
        // without an event this returns an error at once.
        let got = unsafe { (api.get_cq_event)(self.ch, &mut cq, &mut ctx) };
        if got == 0 && !cq.is_null() {
            // SAFETY: the event was for this CQ (the only one on the channel).
            unsafe { (api.ack_cq_events)(cq, 1) };
        }
    }
}

/// Sleeps until one of `cqs` gets an armed event or `timeout` passes, and
/// acknowledges the events that arrived (one thread sleeping on every CQ
/// of a device).
pub(crate) fn wait_any(cqs: &[&Cq], timeout: Duration) {
    let mut fds: Vec<libc::pollfd> = cqs
        .iter()
        .map(|c| libc::pollfd {
            fd: c.channel_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: `fds` is a valid array of pollfds over descriptors the CQs
    // own, which the caller's borrows keep open during the call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc > 0 {
        for (c, f) in cqs.iter().zip(&fds) {
            if f.revents != 0 {
                c.ack_event();
            }
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP on this CQ holds an Arc of it, so none is left;
        // every event was acknowledged in `wait`.
        let rc = unsafe { (self._dev.api.destroy_cq)(self.cq) };
        if rc != 0 {
            tracing::warn!("IB: ibv_destroy_cq: errno {rc}");
        }
        // SAFETY: its only CQ is gone.
        let rc = unsafe { (self._dev.api.destroy_comp_channel)(self.ch) };
        if rc != 0 {
            tracing::warn!("IB: ibv_destroy_comp_channel: errno {rc}");
        }
    }
}

/// Parameters of the RTR/RTS transitions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpParams {
    /// Port number.
    pub port: u8,
    /// Local GID index for the address vector.
    pub gid_index: u8,
    /// Whether the link layer is Ethernet (RoCE: always a GRH).
    pub roce: bool,
    /// Path MTU (verbs enum).
    pub mtu: u8,
    /// Local ACK timeout exponent (4.096 us * 2^timeout).
    pub timeout: u8,
    /// Retries before a retry-exceeded completion.
    pub retry_cnt: u8,
    /// Traffic class / service level.
    pub sl: u8,
    /// Traffic class (RoCE).
    pub tclass: u8,
}

/// A reliable-connected queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    qp: *mut ibv_qp,
    /// Every memory region a work request read from: released only after
    /// the QP is destroyed.
    pinned: Mutex<Vec<Arc<Mr>>>,
    _cq: Arc<Cq>,
    _dev: Arc<Device>,
}

// SAFETY: posting to a QP is thread-safe in libibverbs providers (they lock
// the queues); state changes happen before the QP is shared.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// An RC QP on `cq` (sends and receives), in state RESET.
    pub(crate) fn new(
        dev: &Arc<Device>,
        cq: &Arc<Cq>,
        max_send: u32,
        max_recv: u32,
    ) -> io::Result<Qp> {
        let mut attr = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq.cq,
            recv_cq: cq.cq,
            srq: ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: max_send,
                max_recv_wr: max_recv,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid PD and attributes.
        let qp = unsafe { (dev.api.create_qp)(dev.pd, &mut attr) };
        if qp.is_null() {
            return Err(null_err("ibv_create_qp"));
        }
        Ok(Qp {
            qp,
            pinned: Mutex::new(Vec::new()),
            _cq: cq.clone(),
            _dev: dev.clone(),
        })
    }

    /// The QP number.
    pub(crate) fn qpn(&self) -> u32 {
        // SAFETY: valid until Drop.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(&self, what: &str, attr: &mut ibv_qp_attr, mask: i32) -> io::Result<()> {
        // SAFETY: valid QP and attributes for the mask.
        let rc = unsafe { (self._dev.api.modify_qp)(self.qp, attr, mask) };
        errno_result(what, rc)
    }

    /// RESET → INIT on `port`, accepting RDMA writes.
    pub(crate) fn init(&self, port: u8) -> io::Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as u32,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(INIT)",
            &mut a,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
        )
    }

    /// INIT → RTR towards `remote`'s QP `qpn`, then RTR → RTS.
    pub(crate) fn connect(
        &self,
        p: &QpParams,
        remote: &Addr,
        qpn: u32,
        remote_psn: u32,
        local_psn: u32,
    ) -> io::Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: u32::from(p.mtu.min(remote.mtu)),
            dest_qp_num: qpn,
            rq_psn: remote_psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.port_num = p.port;
        a.ah_attr.sl = p.sl;
        a.ah_attr.dlid = remote.lid;
        if p.roce || remote.lid == 0 {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = p.gid_index;
            a.ah_attr.grh.hop_limit = 255;
            a.ah_attr.grh.traffic_class = p.tclass;
        }
        self.modify(
            "ibv_modify_qp(RTR)",
            &mut a,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: p.timeout,
            retry_cnt: p.retry_cnt,
            rnr_retry: 7,
            sq_psn: local_psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(RTS)",
            &mut a,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Moves the QP to the error state: outstanding work requests are
    /// flushed and the peer's next packets go unanswered.
    pub(crate) fn to_error(&self) {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        let _ = self.modify("ibv_modify_qp(ERR)", &mut a, IBV_QP_STATE);
    }

    /// Posts one receive without buffers (writes with immediate consume
    /// it; their data lands where the writer said).
    pub(crate) fn post_recv(&self, wr_id: u64) -> io::Result<()> {
        let mut wr = ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP; the WR has no buffers.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            let f = (*ctx)
                .ops
                .post_recv
                .ok_or_else(|| io::Error::other("no post_recv"))?;
            f(self.qp, &mut wr, &mut bad)
        };
        errno_result("ibv_post_recv", rc)
    }

    /// Posts a signalled RDMA WRITE (WITH IMMEDIATE when `imm` is set) of
    /// `len` bytes at `off` in `local` (none when `local` is `None`) to
    /// `remote_addr` under `rkey`. The remote side checks the address and key;
    /// locally the range is bounds-checked and `local` stays registered until
    /// this QP is destroyed.
    pub(crate) fn post_write(
        &self,
        wr_id: u64,
        local: Option<(&Arc<Mr>, usize, usize)>,
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    ) -> io::Result<()> {
        let mut sge = ibv_sge::default();
        let mut nsge = 0;
        if let Some((mr, off, len)) = local {
            if off.checked_add(len).is_none_or(|e| e > mr.len()) || len > u32::MAX as usize {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "write of {len} bytes at {off} outside a {}-byte region",
                        mr.len()
                    ),
                ));
            }
            {
                let mut pins = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
                if !pins.iter().any(|p| Arc::ptr_eq(p, mr)) {
                    pins.push(mr.clone());
                }
            }
            if len > 0 {
                sge = ibv_sge {
                    addr: mr.addr() + off as u64,
                    length: len as u32,
                    lkey: mr.lkey(),
                };
                nsge = 1;
            }
        }
        let mut wr = ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: if nsge == 1 { &mut sge } else { ptr::null_mut() },
            num_sge: nsge,
            opcode: if imm.is_some() {
                IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                IBV_WR_RDMA_WRITE
            },
            send_flags: IBV_SEND_SIGNALED,
            ..Default::default()
        };
        wr.imm_data = imm.unwrap_or(0).to_be();
        wr.rdma.remote_addr = remote_addr;
        wr.rdma.rkey = rkey;
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP; the SGE points into a registered region pinned
        // by this QP; the provider copies the WR before returning.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            let f = (*ctx)
                .ops
                .post_send
                .ok_or_else(|| io::Error::other("no post_send"))?;
            f(self.qp, &mut wr, &mut bad)
        };
        errno_result("ibv_post_send", rc)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: destroyed once; afterwards no work request reads the
        // pinned regions, which are released after this.
        let rc = unsafe { (self._dev.api.destroy_qp)(self.qp) };
        if rc != 0 {
            tracing::warn!("IB: ibv_destroy_qp: errno {rc}");
            // The HCA may still read the pinned regions: keep them.
            let pins = std::mem::take(&mut *self.pinned.lock().unwrap_or_else(|p| p.into_inner()));
            std::mem::forget(pins);
        }
    }
}

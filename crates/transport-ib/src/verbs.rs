//! The one module with `unsafe`: owned, thread-safe handles over the verbs
//! library (`ibverbs-sys`, the `ffi` of the `ibverbs` crate).
//!
//! Why not `ibverbs`' safe API for these: it opens port 1 only, ties queue
//! pairs and memory regions to borrowed lifetimes (they could not live in
//! the transport's long-lived link objects), panics in `Drop` when a verb
//! fails, registers only memory it allocates itself, and posts only SEND and
//! RECV. braid needs any port, RDMA WRITE and RDMA WRITE WITH IMMEDIATE,
//! registration of its own page-aligned buffers, completion channels, and
//! teardown that never panics. What the safe API does offer (the device list
//! and the work-completion type) is used from it.
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

use ibverbs_sys as ffi;

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
    // The safe API's device list: it turns a NULL list into an error.
    let list = ibverbs::devices()?;
    let names: Vec<String> = list
        .iter()
        .filter_map(|d| d.name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    drop(list);
    let mut out = Vec::new();
    for name in names {
        match Device::open(&name) {
            Ok(dev) => out.extend(dev.ports()?),
            Err(e) => tracing::warn!("IB: cannot open {name}: {e}"),
        }
    }
    Ok(out)
}

/// An open device context and one protection domain on it.
#[derive(Debug)]
pub(crate) struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    name: String,
}

// SAFETY: verbs contexts and PDs may be used from any thread (libibverbs
// serialises internally); the pointers are only freed in Drop.
unsafe impl Send for Device {}
// SAFETY: as above; no method takes `&mut self`.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device called `name` and allocates a protection domain.
    pub(crate) fn open(name: &str) -> io::Result<Arc<Device>> {
        let mut n = 0i32;
        // SAFETY: `n` is a valid out-pointer; the list is freed below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(null_err("ibv_get_device_list"));
        }
        let mut ctx = ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers.
            let d = unsafe { *list.add(i) };
            // SAFETY: `d` is a valid device; the name is a C string owned
            // by the list.
            let dn = unsafe { ffi::ibv_get_device_name(d) };
            if dn.is_null() {
                continue;
            }
            // SAFETY: a NUL-terminated string from the library.
            let dn = unsafe { std::ffi::CStr::from_ptr(dn) };
            if dn.to_bytes() == name.as_bytes() {
                // SAFETY: `d` is valid while the list is.
                ctx = unsafe { ffi::ibv_open_device(d) };
                if ctx.is_null() {
                    let e = null_err("ibv_open_device");
                    // SAFETY: the list came from ibv_get_device_list.
                    unsafe { ffi::ibv_free_device_list(list) };
                    return Err(e);
                }
                break;
            }
        }
        // SAFETY: the list came from ibv_get_device_list; an opened
        // context stays valid after it is freed.
        unsafe { ffi::ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no RDMA device named {name}"),
            ));
        }
        // SAFETY: `ctx` is an open context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx) };
        if pd.is_null() {
            let e = null_err("ibv_alloc_pd");
            // SAFETY: nothing else uses the context.
            unsafe { ffi::ibv_close_device(ctx) };
            return Err(e);
        }
        Ok(Arc::new(Device {
            ctx,
            pd,
            name: name.to_owned(),
        }))
    }

    /// Describes every port.
    pub(crate) fn ports(&self) -> io::Result<Vec<PortDesc>> {
        let mut da = ffi::ibv_device_attr::default();
        // SAFETY: valid context and out-pointer.
        errno_result("ibv_query_device", unsafe {
            ffi::ibv_query_device(self.ctx, &mut da)
        })?;
        let numa = crate::probe::device_numa_node(&self.name);
        let mut out = Vec::new();
        for port in 1..=da.phys_port_cnt {
            let mut pa = ffi::ibv_port_attr::default();
            // SAFETY: valid context, port number and out-pointer.
            errno_result("ibv_query_port", unsafe {
                ffi::ibv_query_port(self.ctx, port, &mut pa as *mut _ as *mut _)
            })?;
            let active = pa.state == ffi::ibv_port_state::IBV_PORT_ACTIVE;
            let link_layer = match u32::from(pa.link_layer) {
                ffi::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                ffi::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                l => LinkLayer::Other(l as u8),
            };
            let mut gids = Vec::new();
            if active && pa.gid_tbl_len > 0 {
                let mut tbl = vec![
                    ffi::ibv_gid_entry::default();
                    pa.gid_tbl_len as usize * da.phys_port_cnt as usize
                ];
                // SAFETY: `tbl` has room for `tbl.len()` entries of the
                // size passed.
                let got = unsafe {
                    ffi::_ibv_query_gid_table(
                        self.ctx,
                        tbl.as_mut_ptr(),
                        tbl.len(),
                        0,
                        std::mem::size_of::<ffi::ibv_gid_entry>(),
                    )
                };
                if got < 0 {
                    tracing::debug!("IB: {}: GID table query failed ({got})", self.name);
                }
                for e in tbl.iter().take(got.max(0) as usize) {
                    if e.port_num != u32::from(port) {
                        continue;
                    }
                    // SAFETY: `raw` covers the whole union.
                    let raw = unsafe { e.gid.raw };
                    if raw == [0; 16] {
                        continue;
                    }
                    gids.push(GidDesc {
                        index: e.gid_index,
                        gid: raw,
                        kind: if e.gid_type == ffi::IBV_GID_TYPE_ROCE_V2 {
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
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::warn!("IB: ibv_dealloc_pd on {}: errno {rc}", self.name);
        }
        // SAFETY: as above.
        let rc = unsafe { ffi::ibv_close_device(self.ctx) };
        if rc != 0 {
            tracing::warn!("IB: ibv_close_device on {}: errno {rc}", self.name);
        }
    }
}

/// Page-aligned, zeroed memory registered with the device.
#[derive(Debug)]
pub(crate) struct Mr {
    _dev: Arc<Device>,
    mr: *mut ffi::ibv_mr,
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
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: valid PD; `p` is mapped for `len` bytes and stays mapped
        // until Drop, after deregistration.
        let mr = unsafe { ffi::ibv_reg_mr(dev.pd, p, len, access.0 as i32) };
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
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
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
    // SAFETY: returns a static string for any value.
    let p = unsafe { ffi::ibv_wc_status_str(status as _) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// Status value of a retry-exceeded completion.
pub(crate) const WC_RETRY_EXC_ERR: u32 = ffi::ibv_wc_status::IBV_WC_RETRY_EXC_ERR;
/// Status value of a flushed work request (the QP went to the error state).
pub(crate) const WC_WR_FLUSH_ERR: u32 = ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;

/// A completion queue with its own completion channel, so a progress thread
/// can sleep until something completes.
#[derive(Debug)]
pub(crate) struct Cq {
    _dev: Arc<Device>,
    ch: *mut ffi::ibv_comp_channel,
    cq: *mut ffi::ibv_cq,
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
        let ch = unsafe { ffi::ibv_create_comp_channel(dev.ctx) };
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
        let cq = unsafe { ffi::ibv_create_cq(dev.ctx, cqe as i32, ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            let e = null_err("ibv_create_cq");
            // SAFETY: the channel has no CQ.
            unsafe { ffi::ibv_destroy_comp_channel(ch) };
            return Err(e);
        }
        Ok(Arc::new(Cq {
            _dev: dev.clone(),
            ch,
            cq,
        }))
    }

    /// Non-blocking: moves up to `out.len()` completions into `out`.
    pub(crate) fn poll(&self, buf: &mut [ffi::ibv_wc], out: &mut Vec<Wc>) -> io::Result<()> {
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
                wr_id: wc.wr_id(),
                error: wc.error(),
                byte_len: wc.len() as u32,
                imm: wc.imm_data().map(u32::from_be),
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
        let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
        let mut ctx: *mut c_void = ptr::null_mut();
        // SAFETY: valid channel and out-pointers; the fd is non-blocking, so
        // without an event this returns an error at once.
        let got = unsafe { ffi::ibv_get_cq_event(self.ch, &mut cq, &mut ctx) };
        if got == 0 && !cq.is_null() {
            // SAFETY: the event was for this CQ (the only one on the channel).
            unsafe { ffi::ibv_ack_cq_events(cq, 1) };
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
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq) };
        if rc != 0 {
            tracing::warn!("IB: ibv_destroy_cq: errno {rc}");
        }
        // SAFETY: its only CQ is gone.
        let rc = unsafe { ffi::ibv_destroy_comp_channel(self.ch) };
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
    qp: *mut ffi::ibv_qp,
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
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq.cq,
            recv_cq: cq.cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: max_send,
                max_recv_wr: max_recv,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid PD and attributes.
        let qp = unsafe { ffi::ibv_create_qp(dev.pd, &mut attr) };
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

    fn modify(
        &self,
        what: &str,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> io::Result<()> {
        // SAFETY: valid QP and attributes for the mask.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        errno_result(what, rc)
    }

    /// RESET → INIT on `port`, accepting RDMA writes.
    pub(crate) fn init(&self, port: u8) -> io::Result<()> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        self.modify(
            "ibv_modify_qp(INIT)",
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
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
        use ffi::ibv_qp_attr_mask as M;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
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
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = p.gid_index;
            a.ah_attr.grh.hop_limit = 255;
            a.ah_attr.grh.traffic_class = p.tclass;
        }
        self.modify(
            "ibv_modify_qp(RTR)",
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
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
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Moves the QP to the error state: outstanding work requests are
    /// flushed and the peer's next packets go unanswered.
    pub(crate) fn to_error(&self) {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        };
        let _ = self.modify(
            "ibv_modify_qp(ERR)",
            &mut a,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
        );
    }

    /// Posts one receive without buffers (writes with immediate consume
    /// it; their data lands where the writer said).
    pub(crate) fn post_recv(&self, wr_id: u64) -> io::Result<()> {
        let mut wr = ffi::ibv_recv_wr {
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
        let mut sge = ffi::ibv_sge::default();
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
                sge = ffi::ibv_sge {
                    addr: mr.addr() + off as u64,
                    length: len as u32,
                    lkey: mr.lkey(),
                };
                nsge = 1;
            }
        }
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: if nsge == 1 { &mut sge } else { ptr::null_mut() },
            num_sge: nsge,
            opcode: if imm.is_some() {
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
            },
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.imm_data = imm.unwrap_or(0).to_be();
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
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
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::warn!("IB: ibv_destroy_qp: errno {rc}");
            // The HCA may still read the pinned regions: keep them.
            let pins = std::mem::take(&mut *self.pinned.lock().unwrap_or_else(|p| p.into_inner()));
            std::mem::forget(pins);
        }
    }
}

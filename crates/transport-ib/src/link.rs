//! One connected end of a directed link: queue pairs, registered memory,
//! the progress thread (one per device and process, for every end on it),
//! and the seam's `SendChannel` / `RecvChannel`.
//! Safe code over `verbs.rs`; the protocol is described in the crate docs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Weak;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{RecvChannel, Resume, SendChannel, SlotBuf};
use braid_core::types::MemKind;

use crate::info::{unwrap_credit, Arrivals, Imm, CREDIT_MASK, MAX_SLOTS, TAG_MASK};

/// How long a resume after an abort waits for the old link's writes to
/// finish (sending end) or for the sender's resync notices (receiving end).
const RESYNC_WAIT: Duration = Duration::from_secs(10);
use crate::verbs::{self, Cq, Mr, Qp, Wc};
use crate::NAME;

/// Bytes of the control buffer's incoming half (abort reasons land here);
/// the outgoing half is the source of this end's own abort reason.
pub(crate) const REASON_BYTES: usize = 512;
/// Offset in the control buffer of the per-slot message lengths (8 bytes
/// each): the sender writes a slot's length there with the notice that
/// completes the slot.
pub(crate) const LENS_AT: usize = 2 * REASON_BYTES;
/// Size of the control buffer.
pub(crate) const CTRL_BYTES: usize = LENS_AT + 8 * crate::info::MAX_SLOTS;
/// Pieces of a message are at least this long (smaller messages travel
/// whole on one QP; consecutive ones rotate over the QPs).
pub(crate) const STRIPE_MIN_BYTES: usize = 64 * 1024;
/// How often an idle end that is being waited on checks that its peer is
/// alive (a zero-length RDMA WRITE that the peer's HCA must acknowledge).
pub(crate) const KEEPALIVE_EVERY: Duration = Duration::from_millis(500);

const OP_RECV: u64 = 1;
const OP_DATA: u64 = 2;
const OP_CREDIT: u64 = 3;
const OP_READY: u64 = 4;
const OP_CLOSE: u64 = 5;
const OP_ABORT: u64 = 6;
const OP_KEEPALIVE: u64 = 7;
const OP_RESYNC: u64 = 8;

fn wr_id(op: u64, qp: usize, aux: u64) -> u64 {
    (op << 56) | ((qp as u64 & 0xff) << 48) | (aux & 0xffff_ffff_ffff)
}

fn op_name(op: u64) -> &'static str {
    match op {
        OP_RECV => "receive",
        OP_DATA => "RDMA write of data",
        OP_CREDIT => "RDMA write of a credit",
        OP_READY => "RDMA write of the connect handshake",
        OP_CLOSE => "RDMA write of the close notice",
        OP_ABORT => "RDMA write of the abort notice",
        OP_KEEPALIVE => "keep-alive RDMA write",
        OP_RESYNC => "RDMA write of the resync notice",
        _ => "work request",
    }
}

/// Why a link failed.
#[derive(Clone, Debug)]
enum Failure {
    Verbs(String),
    Flushed(String),
    PeerAborted(String),
    Protocol(String),
}

/// State shared by an end's owner (the engine's thread) and its progress
/// thread.
pub(crate) struct Shared {
    /// Queue pairs: declared first, so they are destroyed before the
    /// registered memory below.
    qps: Vec<Qp>,
    cq: Arc<Cq>,
    ctrl: Arc<Mr>,
    /// The rank at the other end (renamed when a new communicator keeps
    /// the link).
    peer: AtomicU32,
    remote_ctrl_addr: u64,
    remote_ctrl_rkey: u32,
    max_send: u32,
    slots: usize,
    /// Sender: the receiver's count of released slots.
    released: AtomicU64,
    /// Sender: READY notices received (one per QP).
    ready_in: AtomicU32,
    /// Receiver: READY notices acknowledged by the sender's HCA.
    ready_acked: AtomicU32,
    /// Receiver: per slot, the message length + 1 once every piece landed.
    slot_len: Vec<AtomicU64>,
    /// Send work requests in flight, per QP.
    outstanding: Vec<AtomicU32>,
    peer_closed: AtomicBool,
    notice_done: AtomicBool,
    keepalive_inflight: AtomicBool,
    failed: AtomicBool,
    failure: Mutex<Option<Failure>>,
    stop: AtomicBool,
    /// A resume after an abort: the QPs (bit per QP) whose peer's resync
    /// notice has not come yet; every other notice on them is the old
    /// link's and is skipped.
    seeking: AtomicU32,
    /// Receiver: the sender's count the resumed link goes on from, once
    /// its first resync notice came.
    resync_at: AtomicU64,
    /// Completion polling state: whoever holds the lock polls (the
    /// progress thread, or the engine's thread inline from the `poll_*`
    /// calls, so progress never waits for a thread to be scheduled when
    /// the CPUs are busy).
    poller: Mutex<Poller>,
}

/// Buffers for polling, and the receiver's per-slot piece counts.
struct Poller {
    buf: Vec<verbs::ibv_wc>,
    wcs: Vec<Wc>,
    /// Receiver: the data notices seen so far.
    got: Arrivals,
    /// Receiver resuming after an abort: the count it stood at, until the
    /// sender's first resync notice says where the link goes on (then the
    /// notices are counted afresh from there).
    resync_base: Option<u64>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("peer", &self.peer())
            .field("qps", &self.qps.len())
            .finish()
    }
}

/// What phase 1 built for one end.
pub(crate) struct Parts {
    pub qps: Vec<Qp>,
    pub cq: Arc<Cq>,
    pub ctrl: Arc<Mr>,
    pub max_send: u32,
}

impl Shared {
    fn new(
        parts: Parts,
        peer: u32,
        remote_ctrl_addr: u64,
        remote_ctrl_rkey: u32,
        slots: usize,
    ) -> Arc<Shared> {
        let n = parts.qps.len();
        Arc::new(Shared {
            qps: parts.qps,
            cq: parts.cq,
            ctrl: parts.ctrl,
            peer: AtomicU32::new(peer),
            remote_ctrl_addr,
            remote_ctrl_rkey,
            max_send: parts.max_send,
            slots,
            released: AtomicU64::new(0),
            ready_in: AtomicU32::new(0),
            ready_acked: AtomicU32::new(0),
            slot_len: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            outstanding: (0..n).map(|_| AtomicU32::new(0)).collect(),
            peer_closed: AtomicBool::new(false),
            notice_done: AtomicBool::new(false),
            keepalive_inflight: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
            seeking: AtomicU32::new(0),
            resync_at: AtomicU64::new(0),
            poller: Mutex::new(Poller {
                buf: vec![verbs::ibv_wc::default(); 32],
                wcs: Vec::with_capacity(32),
                got: Arrivals::new(slots),
                resync_base: None,
            }),
        })
    }

    /// The rank at the other end.
    fn peer(&self) -> u32 {
        self.peer.load(Ordering::Relaxed)
    }

    /// Whether the link is whole: no failure, the peer did not close.
    fn whole(&self) -> bool {
        !self.failed.load(Ordering::Acquire)
            && self.error().is_none()
            && !self.peer_closed.load(Ordering::Acquire)
    }

    /// Whether the link can be resynchronised after an abort: nothing
    /// failed but an abort (the peer's, or none), the peer did not close.
    fn resumable(&self) -> bool {
        let g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        matches!(*g, None | Some(Failure::PeerAborted(_)))
            && !self.peer_closed.load(Ordering::Acquire)
    }

    /// Whether the peer said it aborted.
    fn peer_aborted(&self) -> bool {
        let g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        matches!(*g, Some(Failure::PeerAborted(_)))
    }

    /// Forgets the peer's abort (a resynchronised resume).
    fn forget_abort(&self) {
        let mut g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*g, Some(Failure::PeerAborted(_))) {
            *g = None;
            self.failed.store(false, Ordering::Release);
        }
    }

    /// Every QP's bit in [`Shared::seeking`].
    fn all_qps(&self) -> u32 {
        (1u32 << self.qps.len()) - 1
    }

    /// Waits (polling) until `done` or a failure other than the peer's
    /// abort, at most [`RESYNC_WAIT`]; `what` names the wait in the error.
    fn wait_resync(&self, what: &'static str, done: impl Fn() -> bool) -> Result<()> {
        let start = Instant::now();
        while !done() {
            if !self.resumable() {
                return Err(self.error().unwrap_or_else(|| self.closed_err()));
            }
            if start.elapsed() >= RESYNC_WAIT {
                return Err(CoreError::Timeout {
                    transport: NAME,
                    peer: self.peer(),
                    waiting_for: what,
                    after: start.elapsed(),
                });
            }
            if self.progress_once() == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Ok(())
    }

    fn fail(&self, f: Failure) {
        let mut g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        // A flushed work request only says that the QP broke: the error
        // that broke it, when it comes, says why.
        let weak = |f: &Option<Failure>| matches!(f, Some(Failure::Flushed(_)));
        if g.is_none() || (weak(&g) && !matches!(f, Failure::Flushed(_))) {
            tracing::debug!(peer = self.peer(), "IB link failed: {f:?}");
            *g = Some(f);
            self.failed.store(true, Ordering::Release);
        }
    }

    fn error(&self) -> Option<CoreError> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        let g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        Some(match g.clone()? {
            Failure::Verbs(what) => CoreError::Peer {
                transport: NAME,
                peer: self.peer(),
                what,
                source: None,
            },
            // Only flushes: the queue pair went to the error state without
            // a failed request of this end, so this end's HCA rejected a
            // request from the peer (its NAK fails the peer's request).
            Failure::Flushed(what) => CoreError::Peer {
                transport: NAME,
                peer: self.peer(),
                what: format!(
                    "{what}; the queue pair broke without an error of its own, so this end's \
                     HCA rejected a request from the peer (Soft-RoCE does after retransmissions, \
                     see BRAID_IB_TIMEOUT), or the peer reset its end"
                ),
                source: None,
            },
            Failure::PeerAborted(reason) => CoreError::PeerAborted {
                transport: NAME,
                peer: self.peer(),
                reason,
            },
            Failure::Protocol(detail) => CoreError::Protocol {
                peer: self.peer(),
                detail,
            },
        })
    }

    fn closed_err(&self) -> CoreError {
        CoreError::PeerAborted {
            transport: NAME,
            peer: self.peer(),
            reason: "closed its end".into(),
        }
    }

    /// Posts a write on QP `q` (counted against its send queue).
    fn post(
        &self,
        q: usize,
        op: u64,
        aux: u64,
        local: Option<(&Arc<Mr>, usize, usize)>,
        (addr, rkey): (u64, u32),
        imm: Option<Imm>,
    ) -> Result<()> {
        self.outstanding[q].fetch_add(1, Ordering::AcqRel);
        let r = self.qps[q].post_write(wr_id(op, q, aux), local, addr, rkey, imm.map(Imm::encode));
        if let Err(e) = r {
            self.outstanding[q].fetch_sub(1, Ordering::AcqRel);
            let what = format!("posting an {} on QP {q}: {e}", op_name(op));
            self.fail(Failure::Verbs(what.clone()));
            return Err(CoreError::Peer {
                transport: NAME,
                peer: self.peer(),
                what,
                source: Some(Box::new(e)),
            });
        }
        Ok(())
    }

    fn has_room(&self, q: usize, extra: u32) -> bool {
        self.outstanding[q].load(Ordering::Acquire) + extra < self.max_send
    }

    /// A zero-length write with a notice immediate to the peer's control
    /// buffer.
    fn notice(&self, q: usize, op: u64, imm: Imm) -> Result<()> {
        self.post(
            q,
            op,
            0,
            None,
            (self.remote_ctrl_addr, self.remote_ctrl_rkey),
            Some(imm),
        )
    }

    /// Liveness: a zero-length plain write now and then, whose
    /// acknowledgement proves the peer's QP is still there. A dead peer
    /// shows up as a retry-exceeded completion.
    fn keepalive(&self, last: &mut Instant) {
        if self.failed.load(Ordering::Acquire)
            || self.peer_closed.load(Ordering::Acquire)
            || self.keepalive_inflight.load(Ordering::Acquire)
            || last.elapsed() < KEEPALIVE_EVERY
            || !self.has_room(0, 2)
        {
            return;
        }
        *last = Instant::now();
        self.keepalive_inflight.store(true, Ordering::Release);
        if self
            .post(
                0,
                OP_KEEPALIVE,
                0,
                None,
                (self.remote_ctrl_addr, self.remote_ctrl_rkey),
                None,
            )
            .is_err()
        {
            self.keepalive_inflight.store(false, Ordering::Release);
        }
    }

    /// Sends a close or abort notice and waits a little for it to be
    /// acknowledged (best effort).
    fn final_notice(&self, abort_reason: Option<&str>, wait: Duration) {
        if self.failed.load(Ordering::Acquire) || self.peer_closed.load(Ordering::Acquire) {
            return;
        }
        self.notice_done.store(false, Ordering::Release);
        let r = match abort_reason {
            Some(reason) => {
                let mut b = reason.as_bytes().to_vec();
                b.truncate(REASON_BYTES);
                if !self.ctrl.write_at(REASON_BYTES, &b) {
                    return;
                }
                self.post(
                    0,
                    OP_ABORT,
                    0,
                    Some((&self.ctrl, REASON_BYTES, b.len())),
                    (self.remote_ctrl_addr, self.remote_ctrl_rkey),
                    Some(Imm::Abort),
                )
            }
            None => self.notice(0, OP_CLOSE, Imm::Close),
        };
        if r.is_err() {
            return;
        }
        let end = Instant::now() + wait;
        while !self.notice_done.load(Ordering::Acquire)
            && !self.failed.load(Ordering::Acquire)
            && Instant::now() < end
        {
            if self.progress_once() == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

impl Shared {
    /// Polls the CQ once and handles what it returns, unless another
    /// thread is polling right now. Returns the number of completions.
    fn progress_once(&self) -> usize {
        let Ok(mut p) = self.poller.try_lock() else {
            return 0;
        };
        // A stopped end is only waiting for its last references to go.
        if self.stop.load(Ordering::Acquire) {
            return 0;
        }
        let p = &mut *p;
        if let Err(e) = self.cq.poll(&mut p.buf, &mut p.wcs) {
            self.fail(Failure::Verbs(format!("polling the completion queue: {e}")));
            return 0;
        }
        for wc in p.wcs.iter().copied() {
            handle(self, wc, &mut p.got, &mut p.resync_base);
        }
        p.wcs.len()
    }
}

/// The progress thread of one device: polls the CQ of every end on it,
/// spins briefly when idle, then sleeps on all their completion channels
/// (so idle links cost no CPU). One per device and process, whatever the
/// number of peers: it starts with the first end and ends (joined) when the
/// last is dropped.
pub(crate) struct DeviceProgress {
    ends: Mutex<Vec<Arc<Shared>>>,
    /// Bumped whenever `ends` changes (the thread takes a new snapshot).
    generation: AtomicU64,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The progress threads of this process, by device.
static DEVICES: Mutex<Option<HashMap<String, Weak<DeviceProgress>>>> = Mutex::new(None);

/// How long the thread sleeps at most (it notices new ends and its stop
/// flag within this).
const PROGRESS_SLEEP: Duration = Duration::from_millis(20);

impl DeviceProgress {
    /// The progress thread of `device`, started if there is none.
    fn of(device: &str) -> Result<Arc<DeviceProgress>> {
        let mut g = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
        let map = g.get_or_insert_with(HashMap::new);
        if let Some(p) = map.get(device).and_then(Weak::upgrade) {
            return Ok(p);
        }
        map.retain(|_, w| w.strong_count() > 0);
        let p = Arc::new(DeviceProgress {
            ends: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let weak = Arc::downgrade(&p);
        let t = std::thread::Builder::new()
            .name(format!("braid-ib-{device}"))
            .spawn(move || run_progress(weak))
            .map_err(|e| CoreError::Unavailable {
                transport: NAME,
                reason: format!("cannot start the IB progress thread: {e}"),
            })?;
        *p.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
        map.insert(device.to_string(), Arc::downgrade(&p));
        Ok(p)
    }

    fn add(&self, sh: &Arc<Shared>) {
        self.ends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(sh.clone());
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn remove(&self, sh: &Arc<Shared>) {
        self.ends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|e| !Arc::ptr_eq(e, sh));
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for DeviceProgress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        // The thread itself may hold the last reference for a moment (it
        // upgrades its weak one each turn): it then just ends.
        if let Some(t) = t.filter(|t| t.thread().id() != std::thread::current().id()) {
            let _ = t.join();
        }
    }
}

fn run_progress(me: Weak<DeviceProgress>) {
    let mut ends: Vec<Arc<Shared>> = Vec::new();
    let mut seen = u64::MAX;
    let mut idle = 0u32;
    loop {
        {
            let Some(p) = me.upgrade() else { break };
            if p.stop.load(Ordering::Acquire) {
                break;
            }
            let g = p.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                ends = p.ends.lock().unwrap_or_else(|e| e.into_inner()).clone();
            }
        }
        let n: usize = ends.iter().map(|e| e.progress_once()).sum();
        if n > 0 {
            idle = 0;
            continue;
        }
        idle += 1;
        // The engine also polls inline while it waits, so this thread
        // spins only briefly before sleeping (on emulated or busy CPUs a
        // spinning thread takes time from the ones doing the work).
        if idle < 8 {
            std::thread::yield_now();
            continue;
        }
        if ends.is_empty() {
            std::thread::sleep(PROGRESS_SLEEP);
            continue;
        }
        if ends.iter().any(|e| e.cq.arm().is_err()) {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        // Completions that raced with arming are handled first.
        if ends.iter().map(|e| e.progress_once()).sum::<usize>() > 0 {
            continue;
        }
        let cqs: Vec<&Cq> = ends.iter().map(|e| &*e.cq).collect();
        verbs::wait_any(&cqs, PROGRESS_SLEEP);
    }
}

fn handle(sh: &Shared, wc: Wc, got: &mut Arrivals, resync_base: &mut Option<u64>) {
    tracing::trace!(peer = sh.peer(), "IB completion {wc:?}");
    let op = wc.wr_id >> 56;
    let q = ((wc.wr_id >> 48) & 0xff) as usize;
    let stopping = sh.stop.load(Ordering::Acquire);
    if let Some((status, vendor)) = wc.error {
        if op != OP_RECV {
            if let Some(o) = sh.outstanding.get(q) {
                o.fetch_sub(1, Ordering::AcqRel);
            }
        }
        // Flushes follow the first error (or our own teardown).
        if status == verbs::WC_WR_FLUSH_ERR && (stopping || sh.failed.load(Ordering::Acquire)) {
            return;
        }
        let hint = if status == verbs::WC_RETRY_EXC_ERR {
            ": the peer's HCA stopped acknowledging (the peer process died, its link is down, \
             or it is unreachable); see BRAID_IB_TIMEOUT and BRAID_IB_RETRY_CNT"
        } else {
            ""
        };
        let what = format!(
            "{} on QP {q} failed: {} (verbs status {status}, vendor error {vendor:#x}){hint}",
            op_name(op),
            verbs::status_str(status),
        );
        sh.fail(if status == verbs::WC_WR_FLUSH_ERR {
            Failure::Flushed(what)
        } else {
            Failure::Verbs(what)
        });
        return;
    }
    if op != OP_RECV {
        if let Some(o) = sh.outstanding.get(q) {
            o.fetch_sub(1, Ordering::AcqRel);
        }
        match op {
            OP_READY => {
                sh.ready_acked.fetch_add(1, Ordering::AcqRel);
            }
            OP_KEEPALIVE => sh.keepalive_inflight.store(false, Ordering::Release),
            OP_CLOSE | OP_ABORT => sh.notice_done.store(true, Ordering::Release),
            _ => {}
        }
        return;
    }
    // A receive consumed by a write with immediate: put it back first.
    if !stopping {
        if let Some(qp) = sh.qps.get(q) {
            if let Err(e) = qp.post_recv(wr_id(OP_RECV, q, 0)) {
                sh.fail(Failure::Verbs(format!(
                    "re-posting a receive on QP {q}: {e}"
                )));
                return;
            }
        }
    }
    let Some(imm) = wc.imm else {
        sh.fail(Failure::Protocol(
            "a receive completed without an immediate".into(),
        ));
        return;
    };
    let bit = 1u32 << q;
    if sh.seeking.load(Ordering::Acquire) & bit != 0 {
        // A resume after an abort: the notices before the peer's resync on
        // this QP are the old link's.
        match Imm::decode(imm) {
            Ok(Imm::Resync(v)) => {
                if let Some(base) = resync_base.take() {
                    // The first: what follows on a QP that has its resync
                    // is the new link's, counted from the sender's count.
                    let at = unwrap_credit(base, v);
                    *got = Arrivals::starting_at(sh.slots, at);
                    for l in &sh.slot_len {
                        l.store(0, Ordering::Release);
                    }
                    sh.resync_at.store(at, Ordering::Release);
                }
                sh.seeking.fetch_and(!bit, Ordering::AcqRel);
            }
            // A peer that dropped its end instead of resuming.
            Ok(Imm::Close) => sh.peer_closed.store(true, Ordering::Release),
            _ => {}
        }
        return;
    }
    match Imm::decode(imm) {
        Ok(Imm::Data { slot, pieces, tag }) => match got.note(slot, pieces, tag) {
            Ok(false) => {}
            Ok(true) => {
                // Every QP that carried a piece delivered its notice after
                // the piece (in order on each QP): the data and the length
                // the notices wrote are all in place.
                let s = slot as usize;
                let b = sh.ctrl.read_at(LENS_AT + 8 * s, 8);
                let mut a = [0u8; 8];
                a.copy_from_slice(&b);
                sh.slot_len[s].store(u64::from_le_bytes(a) + 1, Ordering::Release);
            }
            Err(e) => sh.fail(Failure::Protocol(e)),
        },
        Ok(Imm::Credit(c)) => {
            // Serial-number arithmetic: a credit can only move forward, by at
            // most a window; an older value (seen once between two emulated
            // guests, a duplicate delivery) is ignored instead of being
            // taken as a jump of 2^28.
            let prev = sh.released.load(Ordering::Acquire);
            let next = unwrap_credit(prev, c);
            if next - prev <= MAX_SLOTS as u64 {
                sh.released.store(next, Ordering::Release);
            } else {
                tracing::debug!(
                    peer = sh.peer(),
                    "IB: stale credit {c} ignored (have {prev})"
                );
            }
        }
        Ok(Imm::Ready) => {
            sh.ready_in.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Imm::Close) => sh.peer_closed.store(true, Ordering::Release),
        Ok(Imm::Resync(_)) => sh.fail(Failure::Protocol(
            "a resync notice on a link that is not resuming".into(),
        )),
        Ok(Imm::Abort) => {
            let b = sh.ctrl.read_at(0, (wc.byte_len as usize).min(REASON_BYTES));
            sh.fail(Failure::PeerAborted(
                String::from_utf8_lossy(&b).into_owned(),
            ));
        }
        Err(e) => sh.fail(Failure::Protocol(e)),
    }
}

/// Starts an end: its device's progress thread polls it until it stops.
fn start(sh: &Arc<Shared>) -> Result<Arc<DeviceProgress>> {
    let p = DeviceProgress::of(sh.cq.device_name())?;
    p.add(sh);
    Ok(p)
}

/// Stops an end: its QPs go to the error state and the progress thread
/// lets go of it (a poll of it under way finishes first: it holds the
/// polling lock, which this waits for).
fn stop(sh: &Arc<Shared>, progress: &DeviceProgress) {
    sh.stop.store(true, Ordering::Release);
    for qp in &sh.qps {
        qp.to_error();
    }
    progress.remove(sh);
    drop(sh.poller.lock());
}

/// Where the receiver's FIFO is.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RemoteFifo {
    pub addr: u64,
    pub rkey: u32,
    pub slot_bytes: usize,
    pub slots: usize,
}

/// The sending end.
pub(crate) struct IbSend {
    sh: Arc<Shared>,
    progress: Arc<DeviceProgress>,
    staging: Arc<Mr>,
    fifo: RemoteFifo,
    committed: u64,
    aborted: bool,
    /// A resume point after an abort was given: the link waits for a
    /// resync.
    resyncing: bool,
    last_keepalive: Instant,
}

impl std::fmt::Debug for IbSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbSend")
            .field("peer", &self.sh.peer())
            .field("committed", &self.committed)
            .finish()
    }
}

impl IbSend {
    /// Wraps connected parts: `staging` holds the slots the engine fills.
    pub(crate) fn start(
        parts: Parts,
        peer: u32,
        remote_ctrl: (u64, u32),
        staging: Arc<Mr>,
        fifo: RemoteFifo,
    ) -> Result<IbSend> {
        let sh = Shared::new(parts, peer, remote_ctrl.0, remote_ctrl.1, fifo.slots);
        let progress = start(&sh)?;
        Ok(IbSend {
            sh,
            progress,
            staging,
            fifo,
            committed: 0,
            aborted: false,
            resyncing: false,
            last_keepalive: Instant::now(),
        })
    }

    fn check(&self) -> Result<()> {
        if let Some(e) = self.sh.error() {
            return Err(e);
        }
        if self.aborted {
            return Err(CoreError::Aborted("this end aborted the link".into()));
        }
        if self.sh.peer_closed.load(Ordering::Acquire) {
            return Err(self.sh.closed_err());
        }
        Ok(())
    }

    fn credit(&self) -> bool {
        self.committed
            .saturating_sub(self.sh.released.load(Ordering::Acquire))
            < self.fifo.slots as u64
    }

    fn pieces(&self, len: usize) -> (usize, usize) {
        let nqps = self.sh.qps.len();
        let want = if len < 2 * STRIPE_MIN_BYTES {
            1
        } else {
            nqps.min(len.div_ceil(STRIPE_MIN_BYTES))
        };
        let piece = len.div_ceil(want).div_ceil(4096) * 4096;
        let n = if len == 0 { 1 } else { len.div_ceil(piece) };
        (n, piece.max(1))
    }
}

impl SendChannel for IbSend {
    fn peer(&self) -> u32 {
        self.sh.peer()
    }
    fn transport(&self) -> &'static str {
        NAME
    }
    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }
    fn slot_bytes(&self) -> usize {
        self.fifo.slot_bytes
    }
    fn slots(&self) -> usize {
        self.fifo.slots
    }

    fn poll_acquire(&mut self) -> Result<Option<SlotBuf>> {
        self.sh.progress_once();
        self.check()?;
        // The receiver says READY on every QP once its QPs accept writes.
        if (self.sh.ready_in.load(Ordering::Acquire) as usize) < self.sh.qps.len() {
            return Ok(None);
        }
        if !self.credit() {
            return Ok(None);
        }
        let (n, _) = self.pieces(self.fifo.slot_bytes);
        let nq = self.sh.qps.len();
        if (0..n.min(nq)).any(|j| !self.sh.has_room((self.committed as usize + j) % nq, 4)) {
            return Ok(None);
        }
        let s = (self.committed % self.fifo.slots as u64) as usize;
        Ok(Some(SlotBuf {
            ptr: self.staging.ptr().wrapping_add(s * self.fifo.slot_bytes),
            cap: self.fifo.slot_bytes,
        }))
    }

    fn commit(&mut self, len: usize) -> Result<()> {
        self.check()?;
        if len > self.fifo.slot_bytes {
            return Err(CoreError::InvalidArgument(format!(
                "commit of {len} bytes into a {}-byte IB slot (link to rank {})",
                self.fifo.slot_bytes,
                self.sh.peer()
            )));
        }
        if !self.credit() {
            return Err(CoreError::InvalidArgument(format!(
                "commit without a free slot on the IB link to rank {}",
                self.sh.peer()
            )));
        }
        let sb = self.fifo.slot_bytes;
        let s = (self.committed % self.fifo.slots as u64) as usize;
        let (n, piece) = self.pieces(len);
        let nq = self.sh.qps.len();
        // Each piece is a plain RDMA WRITE on its QP, followed on the same
        // QP by an 8-byte WRITE WITH IMMEDIATE of the message length into
        // the receiver's control buffer (the notice). Writing the data
        // with the immediate itself was seen to end in "remote invalid
        // request" errors under sustained load between two Soft-RoCE
        // guests (multi-packet writes with immediate); notices are single
        // packets.
        let lens_at = LENS_AT + 8 * s;
        if !self.sh.ctrl.write_at(lens_at, &(len as u64).to_le_bytes()) {
            return Err(CoreError::InvalidArgument(format!("slot {s} out of range")));
        }
        for j in 0..n {
            let q = (self.committed as usize + j) % nq;
            let off = j * piece;
            let plen = piece.min(len - off.min(len));
            let at = s * sb + off;
            if plen > 0 {
                self.sh.post(
                    q,
                    OP_DATA,
                    self.committed,
                    Some((&self.staging, at, plen)),
                    (self.fifo.addr + at as u64, self.fifo.rkey),
                    None,
                )?;
            }
            self.sh.post(
                q,
                OP_DATA,
                self.committed,
                Some((&self.sh.ctrl, lens_at, 8)),
                (
                    self.sh.remote_ctrl_addr + lens_at as u64,
                    self.sh.remote_ctrl_rkey,
                ),
                Some(Imm::Data {
                    slot: s as u16,
                    pieces: n as u8,
                    tag: (self.committed as u32 & TAG_MASK) as u16,
                }),
            )?;
        }
        self.committed += 1;
        Ok(())
    }

    fn poll_drained(&mut self) -> Result<bool> {
        self.sh.progress_once();
        // Everything sent was consumed: drained, even if the peer closed
        // its end right after its last credit (both can arrive in one poll;
        // the close follows the credit on QP 0, so the credit is seen).
        if self.sh.released.load(Ordering::Acquire) == self.committed
            && self.sh.error().is_none()
            && !self.aborted
        {
            return Ok(true);
        }
        self.check()?;
        Ok(false)
    }

    fn check_peer(&mut self) -> Result<()> {
        self.sh.progress_once();
        self.check()?;
        self.sh.keepalive(&mut self.last_keepalive);
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if !self.aborted {
            self.sh
                .final_notice(Some(reason), Duration::from_millis(50));
            self.aborted = true;
        }
    }

    /// An idle link goes on from where it stands: nothing failed or
    /// aborted, every message released (the last credits get up to 200 ms
    /// to arrive). After an abort (this end's or the peer's, nothing else
    /// failed) it goes on through a resync, from what it committed; from
    /// here on the receiver's notices are skipped up to its resync.
    fn resume_point(&mut self) -> Option<Resume> {
        self.sh.progress_once();
        if self.aborted || self.sh.peer_aborted() {
            if !self.sh.resumable() {
                return None;
            }
            if !self.resyncing {
                // Once per resume: a second call must not wait for a
                // resync that came already.
                self.resyncing = true;
                // Under the poller's lock: a completion the progress thread
                // is handling right now (the receiver's abort, read before
                // this store) sets its failure before the resync forgets
                // it, and every later one sees the bit and is skipped.
                let _p = self.sh.poller.lock().unwrap_or_else(|e| e.into_inner());
                self.sh.seeking.store(1, Ordering::Release);
            }
            return Some(Resume {
                count: self.committed,
                drop_max: 0,
                resync: true,
            });
        }
        let until = Instant::now() + Duration::from_millis(200);
        loop {
            self.sh.progress_once();
            if self.aborted || !self.sh.whole() {
                return None;
            }
            if self.sh.released.load(Ordering::Acquire) == self.committed {
                return Some(Resume::at(self.committed));
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        if self.resyncing || self.aborted || self.sh.peer_aborted() {
            if !self.resyncing {
                let _ = self.resume_point();
            }
            self.resync(at)?;
        } else {
            Resume::expect(self.resume_point(), at, NAME, "the sending end")?;
        }
        self.sh.peer.store(peer, Ordering::Relaxed);
        Ok(())
    }
}

impl IbSend {
    /// Goes on after an abort from message `at`: waits until every write
    /// of the old link has landed (so none lands in a slot after the new
    /// link's), then posts a resync notice on every QP, behind which the
    /// receiver counts the new link's notices from `at`; every slot is
    /// free (the receiver drops what it did not release).
    fn resync(&mut self, at: u64) -> Result<()> {
        Resume::expect(
            Some(Resume::at(self.committed)),
            at,
            NAME,
            "the sending end",
        )?;
        let sh = &self.sh;
        sh.wait_resync("the old link's writes to finish", || {
            sh.outstanding
                .iter()
                .all(|o| o.load(Ordering::Acquire) == 0)
        })?;
        sh.forget_abort();
        sh.released.store(at, Ordering::Release);
        for q in 0..sh.qps.len() {
            sh.notice(
                q,
                OP_RESYNC,
                Imm::Resync((at & u64::from(CREDIT_MASK)) as u32),
            )?;
        }
        self.aborted = false;
        self.resyncing = false;
        Ok(())
    }
}

impl Drop for IbSend {
    fn drop(&mut self) {
        if !self.aborted {
            self.sh.final_notice(None, Duration::from_millis(100));
        }
        stop(&self.sh, &self.progress);
    }
}

/// The receiving end.
pub(crate) struct IbRecv {
    sh: Arc<Shared>,
    progress: Arc<DeviceProgress>,
    fifo: Arc<Mr>,
    slot_bytes: usize,
    head: u64,
    credit_pending: bool,
    aborted: bool,
    /// As for the sending end.
    resyncing: bool,
    last_keepalive: Instant,
}

impl std::fmt::Debug for IbRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbRecv")
            .field("peer", &self.sh.peer())
            .field("head", &self.head)
            .finish()
    }
}

/// How a receiving end's connect ended.
pub(crate) enum RecvStart {
    /// Connected.
    Ready(Box<IbRecv>),
    /// The sender's QPs did not answer by the deadline (the verbs error, if
    /// one came, for the log).
    NoSender(Option<String>),
    /// Something else failed.
    Failed(CoreError),
}

impl IbRecv {
    /// Starts the progress thread, says READY on every QP and waits until
    /// the sender's HCA acknowledged all of them, or `deadline`.
    pub(crate) fn start(
        parts: Parts,
        peer: u32,
        remote_ctrl: (u64, u32),
        fifo: Arc<Mr>,
        slot_bytes: usize,
        slots: usize,
        deadline: Instant,
    ) -> RecvStart {
        let sh = Shared::new(parts, peer, remote_ctrl.0, remote_ctrl.1, slots);
        let progress = match start(&sh) {
            Ok(p) => p,
            Err(e) => return RecvStart::Failed(e),
        };
        let mut me = IbRecv {
            sh,
            progress,
            fifo,
            slot_bytes,
            head: 0,
            credit_pending: false,
            aborted: false,
            resyncing: false,
            last_keepalive: Instant::now(),
        };
        for q in 0..me.sh.qps.len() {
            if let Err(e) = me.sh.notice(q, OP_READY, Imm::Ready) {
                return RecvStart::Failed(e);
            }
        }
        let n = me.sh.qps.len() as u32;
        loop {
            me.sh.progress_once();
            if me.sh.ready_acked.load(Ordering::Acquire) >= n {
                return RecvStart::Ready(Box::new(me));
            }
            if me.sh.failed.load(Ordering::Acquire) {
                let why = me.sh.error().map(|e| e.to_string());
                // The sender may still come: the contract lets a receiver
                // wait until its deadline, and then it is a timeout.
                let left = deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(left);
                me.aborted = true;
                return RecvStart::NoSender(why);
            }
            if Instant::now() >= deadline {
                me.aborted = true;
                return RecvStart::NoSender(None);
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    fn check(&self) -> Result<()> {
        if let Some(e) = self.sh.error() {
            return Err(e);
        }
        if self.aborted {
            return Err(CoreError::Aborted("this end aborted the link".into()));
        }
        if self.sh.peer_closed.load(Ordering::Acquire) {
            return Err(self.sh.closed_err());
        }
        Ok(())
    }

    fn flush_credit(&mut self) -> Result<()> {
        if !self.credit_pending || !self.sh.has_room(0, 3) {
            return Ok(());
        }
        self.credit_pending = false;
        self.sh.notice(
            0,
            OP_CREDIT,
            Imm::Credit((self.head & u64::from(CREDIT_MASK)) as u32),
        )
    }
}

impl RecvChannel for IbRecv {
    fn peer(&self) -> u32 {
        self.sh.peer()
    }
    fn transport(&self) -> &'static str {
        NAME
    }
    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn poll_peek(&mut self) -> Result<Option<(SlotBuf, usize)>> {
        let s = (self.head % self.sh.slots as u64) as usize;
        let mut v = self.sh.slot_len[s].load(Ordering::Acquire);
        if v == 0 {
            self.sh.progress_once();
            v = self.sh.slot_len[s].load(Ordering::Acquire);
        }
        if v != 0 && !self.aborted {
            return Ok(Some((
                SlotBuf {
                    ptr: self.fifo.ptr().wrapping_add(s * self.slot_bytes),
                    cap: self.slot_bytes,
                },
                (v - 1) as usize,
            )));
        }
        self.check()?;
        self.flush_credit()?;
        Ok(None)
    }

    fn release(&mut self) -> Result<()> {
        let s = (self.head % self.sh.slots as u64) as usize;
        if self.sh.slot_len[s].swap(0, Ordering::AcqRel) == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "release without a peeked slot on the IB link from rank {}",
                self.sh.peer()
            )));
        }
        self.head += 1;
        self.credit_pending = true;
        if self.sh.error().is_some() || self.aborted {
            return Ok(());
        }
        // The credit goes at once (the seam's contract: a release gives the
        // sender its slot back without further calls on this end).
        self.flush_credit()
    }

    fn check_peer(&mut self) -> Result<()> {
        self.sh.progress_once();
        self.check()?;
        self.flush_credit()?;
        self.sh.keepalive(&mut self.last_keepalive);
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if !self.aborted {
            self.sh
                .final_notice(Some(reason), Duration::from_millis(50));
            self.aborted = true;
        }
    }

    /// An idle link goes on from where it stands: nothing failed or
    /// aborted, nothing landed that was not released; the last credit goes
    /// out first. After an abort (this end's or the peer's, nothing else
    /// failed) it goes on through a resync, dropping what it did not
    /// release; from here on the sender's notices are skipped up to its
    /// resync on each QP.
    fn resume_point(&mut self) -> Option<Resume> {
        self.sh.progress_once();
        if self.aborted || self.sh.peer_aborted() {
            if !self.sh.resumable() {
                return None;
            }
            if !self.resyncing {
                // Once per resume, under the poller's lock (as for the
                // sending end).
                self.resyncing = true;
                let mut p = self.sh.poller.lock().unwrap_or_else(|e| e.into_inner());
                p.resync_base = Some(self.head);
                self.sh.seeking.store(self.sh.all_qps(), Ordering::Release);
            }
            return Some(Resume {
                count: self.head,
                drop_max: u64::MAX,
                resync: true,
            });
        }
        if self.aborted || !self.sh.whole() {
            return None;
        }
        let s = (self.head % self.sh.slots as u64) as usize;
        if self.sh.slot_len[s].load(Ordering::Acquire) != 0 {
            return None;
        }
        let until = Instant::now() + Duration::from_millis(100);
        while self.credit_pending {
            if self.flush_credit().is_err() || Instant::now() >= until {
                return None;
            }
            if self.credit_pending {
                self.sh.progress_once();
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Some(Resume::at(self.head))
    }

    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        if self.resyncing || self.aborted || self.sh.peer_aborted() {
            if !self.resyncing {
                let _ = self.resume_point();
            }
            self.resync(at)?;
        } else {
            Resume::expect(self.resume_point(), at, NAME, "the receiving end")?;
        }
        self.sh.peer.store(peer, Ordering::Relaxed);
        Ok(())
    }
}

impl IbRecv {
    /// Goes on after an abort from the sender's message `at`: posts a
    /// resync notice on QP 0 (the sender skips this end's old credits and
    /// abort up to it) and waits for the sender's on every QP; the first
    /// of them started counting the new link's notices from `at` (the
    /// progress thread did, see `handle`).
    fn resync(&mut self, at: u64) -> Result<()> {
        let sh = &self.sh;
        sh.wait_resync("room on QP 0 for the resync notice", || sh.has_room(0, 1))?;
        sh.notice(
            0,
            OP_RESYNC,
            Imm::Resync((at & u64::from(CREDIT_MASK)) as u32),
        )?;
        sh.wait_resync("the sender's resync notices", || {
            sh.seeking.load(Ordering::Acquire) == 0
        })?;
        let theirs = sh.resync_at.load(Ordering::Acquire);
        if theirs != at {
            return Err(CoreError::Protocol {
                peer: sh.peer(),
                detail: format!("IB link: the sender resumed at message {theirs}, not {at}"),
            });
        }
        sh.forget_abort();
        self.head = at;
        self.credit_pending = false;
        self.aborted = false;
        self.resyncing = false;
        Ok(())
    }
}

impl Drop for IbRecv {
    fn drop(&mut self) {
        if !self.aborted {
            // The last credit goes before the close notice (same QP, in
            // order): a sender waiting for its messages to drain sees them
            // consumed, not a closed peer. It waits for room on QP 0 as
            // long as the close notice would.
            let end = Instant::now() + Duration::from_millis(100);
            while self.credit_pending
                && self.sh.error().is_none()
                && !self.sh.peer_closed.load(Ordering::Acquire)
                && Instant::now() < end
            {
                if self.flush_credit().is_err() {
                    break;
                }
                if self.credit_pending && self.sh.progress_once() == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            self.sh.final_notice(None, Duration::from_millis(100));
        }
        stop(&self.sh, &self.progress);
    }
}

//! The sending end of a socket link and its writer threads.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{DirectSend, SendChannel, SlotBuf};
use braid_core::types::MemKind;

use super::ctrl::{check_credit, ctrl_reader, CtrlOut};
use super::health::Health;
use super::{lock, npieces, shut, spawn, stripes};
use crate::info::{CtrlKind, FrameHeader};
use crate::sys::{self, SlotMem};
use crate::NAME;

/// How long dropping a sender waits for queued pieces to leave.
const DROP_FLUSH: Duration = Duration::from_secs(1);

/// How long stopping a sender waits for a writer to leave a write on its
/// shut socket.
const WRITER_EXIT: Duration = Duration::from_secs(2);

/// Longest direct message (the frame header's lengths are 32-bit).
const MAX_DIRECT: usize = u32::MAX as usize;

#[derive(Debug)]
struct Piece {
    seq: u64,
    slot: usize,
    total: u32,
    offset: u32,
    len: u32,
    /// Address of the piece's payload: in the slot, or in the caller's
    /// memory for a direct message.
    src: usize,
    direct: bool,
    /// Bytes of header + payload already written.
    sent: usize,
}

#[derive(Debug, Default)]
struct TxState {
    items: VecDeque<Piece>,
    /// Someone (the helper or `commit`) is writing to the socket.
    busy: bool,
    closing: bool,
}

#[derive(Debug)]
struct TxQueue {
    st: Mutex<TxState>,
    cv: Condvar,
}

struct SendShared {
    mem: SlotMem,
    /// Pieces of each slot not yet written to a socket.
    inflight: Box<[AtomicU32]>,
    /// Slots released by the receiver (cumulative).
    released: AtomicU64,
    /// Slots committed (cumulative), for validating credits.
    committed: AtomicU64,
}

/// Writes one piece (resuming at `p.sent`).
fn write_piece(sock: &TcpStream, p: &Piece, dontwait: bool) -> io::Result<usize> {
    let hdr = FrameHeader {
        seq: p.seq,
        total: p.total,
        offset: p.offset,
        len: p.len,
        direct: p.direct,
    }
    .encode();
    // SAFETY: a slot piece: the slot's bytes were written by the engine
    // before `commit` (which happens-before this call through the queue
    // mutex or program order) and the engine does not touch the slot again
    // until `poll_acquire` sees `inflight == 0`, which this piece's
    // decrement (after the write) precedes. A direct piece: `commit_direct`'s
    // contract keeps the caller's bytes valid and unchanged until
    // `poll_drained` is true, which needs the receiver to have read every
    // byte, so after this write; an abort drops queued pieces and waits for
    // the writers to leave theirs before it returns (`SocketSend::stop`).
    unsafe {
        sys::send_head_payload(
            sock.as_raw_fd(),
            &hdr,
            p.src as *const u8,
            p.len as usize,
            p.sent,
            dontwait,
        )
    }
}

fn piece_bytes(p: &Piece) -> usize {
    FrameHeader::LEN + p.len as usize
}

fn writer(sock: TcpStream, q: Arc<TxQueue>, sh: Arc<SendShared>, health: Arc<Health>, idx: usize) {
    loop {
        let piece = {
            let mut st = lock(&q.st);
            loop {
                if !st.busy {
                    if let Some(p) = st.items.pop_front() {
                        st.busy = true;
                        break Some(p);
                    }
                    if st.closing {
                        break None;
                    }
                }
                st = q.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(p) = piece else { return };
        let res = write_piece(&sock, &p, false);
        if res.is_ok() {
            sh.inflight[p.slot].fetch_sub(1, Ordering::Release);
        }
        lock(&q.st).busy = false;
        q.cv.notify_all();
        if let Err(e) = res {
            if !health.local_closing.load(Ordering::Acquire) {
                health.await_verdict();
                health.lost(&format!("sending on data socket {idx}"), &e);
            }
            return;
        }
    }
}

/// The sending end of a socket link.
pub struct SocketSend {
    peer: u32,
    slot_bytes: usize,
    slots: usize,
    nsocks: usize,
    shared: Arc<SendShared>,
    committed: u64,
    queues: Vec<Arc<TxQueue>>,
    data: Vec<TcpStream>,
    ctrl: CtrlOut,
    health: Arc<Health>,
    threads: Vec<JoinHandle<()>>,
    aborted: Option<String>,
    /// Offer direct (zero-copy) sends.
    direct: bool,
}

impl std::fmt::Debug for SocketSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketSend")
            .field("peer", &self.peer)
            .field("slot_bytes", &self.slot_bytes)
            .field("slots", &self.slots)
            .field("nsocks", &self.nsocks)
            .field("committed", &self.committed)
            .finish_non_exhaustive()
    }
}

impl SocketSend {
    /// Starts the helpers of a connected sending end. `data` are the data
    /// sockets in index order, `ctrl` the control socket.
    pub(crate) fn start(
        peer: u32,
        slot_bytes: usize,
        slots: usize,
        data: Vec<TcpStream>,
        ctrl: TcpStream,
        direct: bool,
    ) -> Result<SocketSend> {
        let nsocks = data.len();
        let mem = SlotMem::new(slot_bytes, slots).map_err(|reason| CoreError::Unavailable {
            transport: NAME,
            reason,
        })?;
        let shared = Arc::new(SendShared {
            mem,
            inflight: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            released: AtomicU64::new(0),
            committed: AtomicU64::new(0),
        });
        let health = Health::new(peer);
        let clone = |s: &TcpStream| {
            s.try_clone().map_err(|e| CoreError::Peer {
                transport: NAME,
                peer,
                what: format!("cannot duplicate a socket: {e}"),
                source: Some(Box::new(e)),
            })
        };
        let mut me = SocketSend {
            peer,
            slot_bytes,
            slots,
            nsocks,
            shared: shared.clone(),
            committed: 0,
            queues: Vec::new(),
            data: Vec::new(),
            ctrl: CtrlOut {
                sock: clone(&ctrl)?,
                pending: Vec::new(),
                credit_owed: None,
            },
            health: health.clone(),
            threads: Vec::new(),
            aborted: None,
            direct,
        };
        // From here on, an early return drops `me`, which stops whatever
        // was started.
        me.data = data.iter().map(clone).collect::<Result<_>>()?;
        let ctrl_sock = ctrl;
        {
            let sh = shared.clone();
            let h = health.clone();
            let on_credit = Box::new(move |v: u64| {
                let committed = sh.committed.load(Ordering::Acquire);
                let old = sh.released.load(Ordering::Relaxed);
                check_credit(v, old, committed)?;
                sh.released.store(v, Ordering::Release);
                Ok(())
            });
            me.threads
                .push(spawn(format!("braid-sock-ctl>{peer}"), move || {
                    ctrl_reader(ctrl_sock, h, Some(on_credit), true)
                })?);
        }
        for (i, s) in data.into_iter().enumerate() {
            let q = Arc::new(TxQueue {
                st: Mutex::new(TxState::default()),
                cv: Condvar::new(),
            });
            me.queues.push(q.clone());
            let (sh, h) = (shared.clone(), health.clone());
            me.threads
                .push(spawn(format!("braid-sock-tx{i}>{peer}"), move || {
                    writer(s, q, sh, h, i)
                })?);
        }
        Ok(me)
    }

    fn check(&self) -> Result<()> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        match self.health.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn has_credit(&self) -> bool {
        let released = self.shared.released.load(Ordering::Acquire);
        self.committed - released < self.slots as u64
            && self.shared.inflight[(self.committed % self.slots as u64) as usize]
                .load(Ordering::Acquire)
                == 0
    }

    /// Queues piece `p` on socket `s`; a lone piece on an idle socket is
    /// written right here (no helper wake-up) as far as the socket buffer
    /// takes it.
    fn queue_piece(&mut self, s: usize, mut p: Piece, try_inline: bool) {
        let q = &self.queues[s];
        {
            let mut st = lock(&q.st);
            if !try_inline || !st.items.is_empty() || st.busy || st.closing {
                st.items.push_back(p);
                drop(st);
                q.cv.notify_all();
                return;
            }
            st.busy = true;
        }
        let res = write_piece(&self.data[s], &p, true);
        let mut st = lock(&q.st);
        st.busy = false;
        match res {
            Ok(n) if n == piece_bytes(&p) => {
                self.shared.inflight[p.slot].fetch_sub(1, Ordering::Release);
            }
            Ok(n) => {
                p.sent = n;
                st.items.push_front(p);
            }
            Err(e) => {
                drop(st);
                self.health.lost(&format!("sending on data socket {s}"), &e);
                return;
            }
        }
        drop(st);
        q.cv.notify_all();
    }

    fn stop(&mut self, goodbye: Option<(CtrlKind, &str)>) {
        self.health.local_closing.store(true, Ordering::Release);
        if let Some((kind, reason)) = goodbye {
            self.ctrl.goodbye(kind, reason);
        }
        // Queued pieces are dropped unwritten: direct ones point into the
        // caller's memory, which is the caller's again once we return.
        for q in &self.queues {
            let mut st = lock(&q.st);
            st.closing = true;
            st.items.clear();
            drop(st);
            q.cv.notify_all();
        }
        for s in &self.data {
            shut(s);
        }
        shut(&self.ctrl.sock);
        // A writer still inside a write (of a slot or of the caller's
        // memory) fails promptly on the shut socket; wait for it, bounded.
        let until = Instant::now() + WRITER_EXIT;
        for q in &self.queues {
            let mut st = lock(&q.st);
            while st.busy {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    tracing::warn!(
                        peer = self.peer,
                        "socket transport: a writer did not leave its write within {WRITER_EXIT:?}"
                    );
                    break;
                }
                st =
                    q.cv.wait_timeout(st, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
            }
        }
    }

    /// Publishes message `committed` of `len` bytes: from the slot, or from
    /// the caller's memory at `direct`.
    fn publish(&mut self, len: usize, direct: Option<*const u8>) -> Result<()> {
        if !self.has_credit() {
            return Err(CoreError::InvalidArgument(
                "commit without a slot from poll_acquire (no credit left)".into(),
            ));
        }
        let seq = self.committed;
        let slot = (seq % self.slots as u64) as usize;
        let base = match direct {
            Some(p) => p as usize,
            None => self.shared.mem.slot_ptr(slot) as usize,
        };
        let n = npieces(len, self.nsocks);
        self.shared.inflight[slot].store(n as u32, Ordering::Relaxed);
        self.committed += 1;
        // Release: a credit for this slot (validated against `committed` by
        // the control reader) can only come after this store.
        self.shared
            .committed
            .store(self.committed, Ordering::Release);
        for (s, offset, plen) in stripes(seq, len, self.nsocks) {
            let p = Piece {
                seq,
                slot,
                total: len as u32,
                offset: offset as u32,
                len: plen as u32,
                src: base + offset,
                direct: direct.is_some(),
                sent: 0,
            };
            self.queue_piece(s, p, n == 1);
        }
        Ok(())
    }
}

impl SendChannel for SocketSend {
    fn peer(&self) -> u32 {
        self.peer
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
    fn slots(&self) -> usize {
        self.slots
    }

    fn poll_acquire(&mut self) -> Result<Option<SlotBuf>> {
        self.check()?;
        if !self.has_credit() {
            return Ok(None);
        }
        let i = (self.committed % self.slots as u64) as usize;
        Ok(Some(SlotBuf {
            ptr: self.shared.mem.slot_ptr(i),
            cap: self.slot_bytes,
        }))
    }

    fn commit(&mut self, len: usize) -> Result<()> {
        self.check()?;
        if len > self.slot_bytes {
            return Err(CoreError::InvalidArgument(format!(
                "commit of {len} bytes into a {}-byte socket slot",
                self.slot_bytes
            )));
        }
        self.publish(len, None)
    }

    fn poll_drained(&mut self) -> Result<bool> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        if self.shared.released.load(Ordering::Acquire) == self.committed {
            return Ok(true);
        }
        self.check()?;
        Ok(false)
    }

    fn check_peer(&mut self) -> Result<()> {
        match self.health.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_owned());
            self.stop(Some((CtrlKind::Abort, reason)));
        }
    }

    fn direct(&mut self) -> Option<&mut dyn DirectSend> {
        if self.direct {
            Some(self)
        } else {
            None
        }
    }
}

impl DirectSend for SocketSend {
    fn costs_receiver(&self) -> bool {
        // The helpers write from the caller's memory instead of a slot; the
        // receiver reads the same bytes from its sockets either way.
        false
    }

    unsafe fn commit_direct(&mut self, ptr: *const u8, len: usize) -> Result<()> {
        self.check()?;
        if !self.direct {
            return Err(CoreError::Unavailable {
                transport: NAME,
                reason: format!("direct sends are switched off ({})", crate::ENV_DIRECT),
            });
        }
        if len > MAX_DIRECT {
            return Err(CoreError::InvalidArgument(format!(
                "direct commit of {len} bytes: at most {MAX_DIRECT} per message"
            )));
        }
        self.publish(len, Some(ptr))
    }
}

impl Drop for SocketSend {
    fn drop(&mut self) {
        if self.aborted.is_none() {
            // Let queued pieces leave (normally there are none: the engine
            // waits for poll_drained), bounded.
            for q in &self.queues {
                lock(&q.st).closing = true;
                q.cv.notify_all();
            }
            let until = Instant::now() + DROP_FLUSH;
            while Instant::now() < until
                && !self.health.failed.load(Ordering::Acquire)
                && self.threads.iter().skip(1).any(|t| !t.is_finished())
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.stop(Some((CtrlKind::Close, "the sender closed its end")));
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

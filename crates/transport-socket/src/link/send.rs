//! The sending end of a socket link. Its data sockets' queues of pieces are
//! written by `commit` itself as far as the sockets take them, the rest by
//! the progress thread when the sockets drain; the control socket's
//! credits are read by the progress thread, or inline by `poll_acquire`
//! when it finds no credit.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{DirectSend, Resume, SendChannel, SlotBuf, WakeWord};
use braid_core::types::MemKind;

use super::ctrl::{check_credit, CtrlIn, CtrlOut};
use super::health::Health;
use super::poller::{poller, Armer, Poller, Source, IN, OUT};
use super::{lock, nonblocking, npieces, shut, slot_mem, stripes};
use crate::info::{CtrlKind, FrameHeader};
use crate::sys::{self, SlotMem};
use crate::NAME;

/// How long dropping a sender waits for queued pieces to leave.
const DROP_FLUSH: Duration = Duration::from_secs(1);

/// Longest direct message (the frame header's lengths are 32-bit).
const MAX_DIRECT_BYTES: usize = u32::MAX as usize;

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

/// A data socket and the pieces queued on it, in order.
#[derive(Debug)]
struct TxSock {
    sock: TcpStream,
    items: VecDeque<Piece>,
    /// This end is stopping: nothing more is written (queued direct pieces
    /// point into the caller's memory, which is the caller's again).
    closing: bool,
    /// The progress thread watches the socket for room (the queue is not
    /// empty).
    armed: bool,
    /// Bytes the socket took since the link started: where a resume after
    /// an abort cuts the stream.
    written: u64,
}

/// The control socket of a sending end: credits and the peer's abort or
/// close come in, this end's abort or close goes out.
#[derive(Debug)]
struct CtrlSock {
    sock: TcpStream,
    input: CtrlIn,
    out: CtrlOut,
}

struct SendShared {
    mem: SlotMem,
    /// Pieces of each slot not yet written to a socket.
    inflight: Box<[AtomicU32]>,
    /// Slots released by the receiver (cumulative).
    released: AtomicU64,
    /// Slots committed (cumulative), for validating credits.
    committed: AtomicU64,
    health: Arc<Health>,
    data: Box<[Mutex<TxSock>]>,
    ctrl: Mutex<CtrlSock>,
    /// Set once registered with the progress thread.
    armer: OnceLock<Armer>,
}

/// Writes one piece (resuming at `p.sent`), never blocking.
fn write_piece(sock: &TcpStream, p: &Piece) -> io::Result<usize> {
    let hdr = FrameHeader {
        seq: p.seq,
        total: p.total,
        offset: p.offset,
        len: p.len,
        direct: p.direct,
    }
    .encode();
    // SAFETY: a slot piece: the slot's bytes were written by the engine
    // before `commit` (which happens-before this call through the socket's
    // mutex or program order) and the engine does not touch the slot again
    // until `poll_acquire` sees `inflight == 0`, which this piece's
    // decrement (after the write) precedes. A direct piece: `commit_direct`'s
    // contract keeps the caller's bytes valid and unchanged until
    // `poll_drained` is true, which needs the receiver to have read every
    // byte, so after this write; an abort or drop empties the queues and
    // sets `closing` under the same mutex as this write, so no piece is
    // written from the caller's memory once it returns.
    unsafe {
        sys::send_head_payload(
            sock.as_raw_fd(),
            &hdr,
            p.src as *const u8,
            p.len as usize,
            p.sent,
            true,
        )
    }
}

fn piece_bytes(p: &Piece) -> usize {
    FrameHeader::LEN + p.len as usize
}

impl SendShared {
    /// Has the progress thread write socket `i`'s queue when it has room.
    fn arm_out(&self, i: usize, tx: &mut TxSock) {
        if !tx.armed && !tx.items.is_empty() && !tx.closing {
            if let Some(a) = self.armer.get() {
                a.arm(i, tx.sock.as_fd(), OUT);
                tx.armed = true;
            }
        }
    }

    /// Writes the queued pieces of data socket `i` until the socket is full
    /// (then the progress thread is asked to go on when it has room).
    /// `event`: called for the progress thread's event (which disarmed it).
    fn flush_data(&self, i: usize, event: bool) {
        let mut guard = lock(&self.data[i]);
        let tx = &mut *guard;
        if event {
            tx.armed = false;
        }
        let mut sent = false;
        while !tx.closing {
            let Some(p) = tx.items.front_mut() else { break };
            match write_piece(&tx.sock, p) {
                Ok(n) if n == piece_bytes(p) => {
                    tx.written += (n - p.sent) as u64;
                    let slot = p.slot;
                    tx.items.pop_front();
                    self.inflight[slot].fetch_sub(1, Ordering::Release);
                    sent = true;
                }
                Ok(n) => {
                    // The socket is full: the next writable edge goes on.
                    tx.written += (n - p.sent) as u64;
                    p.sent = n;
                    break;
                }
                Err(e) => {
                    self.health.lost_later(
                        &format!("sending on data socket {i}"),
                        e.kind(),
                        &e.to_string(),
                    );
                    tx.items.clear();
                    tx.closing = true;
                    break;
                }
            }
        }
        self.arm_out(i, tx);
        drop(guard);
        if sent {
            self.health.ring();
        }
    }

    /// Reads what the control socket has (credits, the peer's abort or
    /// close) and sends what is pending on it.
    fn pump_ctrl(&self, c: &mut CtrlSock) {
        if !c.input.done() {
            let mut on_credit = |v: u64| {
                let committed = self.committed.load(Ordering::Acquire);
                let old = self.released.load(Ordering::Relaxed);
                check_credit(v, old, committed)?;
                self.released.store(v, Ordering::Release);
                self.health.ring();
                Ok(())
            };
            let sock = &c.sock;
            let mut read = |b: &mut [u8]| (&*sock).read(b);
            c.input
                .pump(&mut read, &self.health, Some(&mut on_credit), true);
        }
        if !c.out.pending.is_empty() && c.out.flush(&c.sock).is_err() {
            // A broken socket takes nothing more: do not watch it for room.
            c.out.pending.clear();
            c.out.credit_owed = None;
        }
    }

    /// Watches the control socket again (after its event).
    fn arm_ctrl(&self, c: &CtrlSock) {
        // Input until the peer's abort or close (or the end); output while
        // frames wait (an abort's goodbye may outlive the peer's).
        let mut want = nix::sys::epoll::EpollFlags::empty();
        if !c.input.done() {
            want |= IN;
        }
        if !c.out.pending.is_empty() {
            want |= OUT;
        }
        if want.is_empty() {
            return;
        }
        if let Some(a) = self.armer.get() {
            a.arm(self.data.len(), c.sock.as_fd(), want);
        }
    }
}

impl Source for SendShared {
    fn poke(&self) {
        for (i, d) in self.data.iter().enumerate() {
            if d.try_lock().is_ok_and(|tx| !tx.items.is_empty()) {
                self.flush_data(i, false);
            }
        }
    }

    fn ready(&self, idx: usize) {
        if idx < self.data.len() {
            self.flush_data(idx, true);
        } else {
            let mut c = lock(&self.ctrl);
            self.pump_ctrl(&mut c);
            self.arm_ctrl(&c);
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
    poller: Arc<Poller>,
    id: u64,
    aborted: Option<String>,
    stopped: bool,
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
    /// Starts a connected sending end. `data` are the data sockets in index
    /// order, `ctrl` the control socket; the process's progress thread
    /// drives them from now on.
    pub(crate) fn start(
        peer: u32,
        slot_bytes: usize,
        slots: usize,
        data: Vec<TcpStream>,
        ctrl: TcpStream,
        direct: bool,
    ) -> Result<SocketSend> {
        let nsocks = data.len();
        let mem = slot_mem(slot_bytes, slots)?;
        for s in data.iter().chain(std::iter::once(&ctrl)) {
            nonblocking(peer, s)?;
        }
        let shared = Arc::new(SendShared {
            mem,
            inflight: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            released: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            health: Health::new(peer),
            data: data
                .into_iter()
                .map(|sock| {
                    Mutex::new(TxSock {
                        sock,
                        items: VecDeque::new(),
                        closing: false,
                        armed: false,
                        written: 0,
                    })
                })
                .collect(),
            ctrl: Mutex::new(CtrlSock {
                sock: ctrl,
                input: CtrlIn::default(),
                out: CtrlOut::new(),
            }),
            armer: OnceLock::new(),
        });
        let poller = poller()?;
        let id = {
            let guards: Vec<_> = shared.data.iter().map(lock).collect();
            let c = lock(&shared.ctrl);
            let mut fds: Vec<BorrowedFd<'_>> = guards.iter().map(|g| g.sock.as_fd()).collect();
            fds.push(c.sock.as_fd());
            // The data sockets are watched once pieces wait in their queues;
            // the control socket always (credits, the peer's abort).
            let mut want = vec![nix::sys::epoll::EpollFlags::empty(); guards.len()];
            want.push(IN);
            let id = poller.register(shared.clone(), &fds, &want)?;
            let _ = shared.armer.set(poller.armer(id));
            id
        };
        Ok(SocketSend {
            peer,
            slot_bytes,
            slots,
            nsocks,
            shared,
            committed: 0,
            poller,
            id,
            aborted: None,
            stopped: false,
            direct,
        })
    }

    fn check(&self) -> Result<()> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        match self.shared.health.error() {
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

    /// Reads credits and writes queued pieces inline, as far as the
    /// sockets allow, and does what else the progress thread has pending
    /// (the engine waits on this end: it makes progress itself).
    fn pump_ctrl(&self) {
        if let Ok(mut c) = self.shared.ctrl.try_lock() {
            self.shared.pump_ctrl(&mut c);
        }
        // Our queues, and every other link's of this process.
        self.poller.help();
    }

    /// Queues piece `p` on socket `s`; on an idle socket it is written
    /// right here as far as the socket buffer takes it (the progress thread
    /// writes the rest when the socket drains).
    fn queue_piece(&mut self, s: usize, mut p: Piece) {
        let sh = &self.shared;
        let mut tx = lock(&sh.data[s]);
        if tx.closing {
            return;
        }
        if !tx.items.is_empty() {
            tx.items.push_back(p);
            return;
        }
        match write_piece(&tx.sock, &p) {
            Ok(n) if n == piece_bytes(&p) => {
                tx.written += n as u64;
                sh.inflight[p.slot].fetch_sub(1, Ordering::Release);
            }
            Ok(n) => {
                // The rest when the socket has room.
                tx.written += n as u64;
                p.sent = n;
                tx.items.push_back(p);
                sh.arm_out(s, &mut tx);
            }
            Err(e) => {
                tx.closing = true;
                drop(tx);
                sh.health.lost_later(
                    &format!("sending on data socket {s}"),
                    e.kind(),
                    &e.to_string(),
                );
            }
        }
    }

    /// Stops the end: no more writes (queued pieces are dropped), an
    /// optional goodbye on the control socket, sockets shut, the progress
    /// thread forgets it.
    fn stop(&mut self, goodbye: Option<(CtrlKind, &str)>) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let sh = &self.shared;
        sh.health.local_closing.store(true, Ordering::Release);
        let mut data: Vec<_> = sh.data.iter().map(lock).collect();
        for tx in data.iter_mut() {
            tx.closing = true;
            tx.items.clear();
        }
        let mut guard = lock(&sh.ctrl);
        let c = &mut *guard;
        if let Some((kind, reason)) = goodbye {
            c.out.goodbye(&c.sock, kind, reason);
        }
        for tx in &data {
            shut(&tx.sock);
        }
        shut(&c.sock);
        let mut fds: Vec<BorrowedFd<'_>> = data.iter().map(|g| g.sock.as_fd()).collect();
        fds.push(c.sock.as_fd());
        self.poller.deregister(self.id, &fds);
    }

    /// An abort: nothing more is written (queued pieces are dropped, so the
    /// caller's memory is not read after this returns), the peer is told
    /// why, and the sockets stay open for a resume
    /// ([`SendChannel::resume`]): a stream may stop in the middle of a
    /// frame, and a resume starts the new link where each stopped.
    fn halt(&mut self, reason: &str) {
        let sh = &self.shared;
        for d in sh.data.iter() {
            let mut tx = lock(d);
            tx.closing = true;
            tx.items.clear();
        }
        let mut guard = lock(&sh.ctrl);
        let c = &mut *guard;
        c.out.goodbye(&c.sock, CtrlKind::Abort, reason);
        // What the socket did not take goes when it has room.
        sh.arm_ctrl(c);
    }

    /// Goes on after an abort (ours or the peer's) from message `at`: the
    /// data streams restart where this end stopped writing them, which the
    /// resync frame tells the receiver (it drops what it has not read of
    /// the old link up to there); the receiver's frames up to its own
    /// resync are skipped.
    fn resync(&mut self, at: u64) -> Result<()> {
        Resume::expect(
            Some(Resume::at(self.committed)),
            at,
            NAME,
            "the sending end",
        )?;
        let sh = &self.shared;
        if !sh.health.resumable() {
            // Something else failed since the resume point (a lost socket).
            return Err(sh.health.error().unwrap_or(CoreError::Unavailable {
                transport: NAME,
                reason: "the link failed since its resume point: it cannot be kept".into(),
            }));
        }
        let mut cut = Vec::with_capacity(8 * sh.data.len());
        for d in sh.data.iter() {
            let mut tx = lock(d);
            // Pieces a healthy end still had queued belong to the old link.
            tx.items.clear();
            tx.closing = false;
            cut.extend(tx.written.to_le_bytes());
        }
        for f in sh.inflight.iter() {
            f.store(0, Ordering::Relaxed);
        }
        // Every slot is free: the receiver drops what it did not release.
        sh.released.store(at, Ordering::Release);
        let mut guard = lock(&sh.ctrl);
        let c = &mut *guard;
        c.out.credit_owed = None;
        c.out
            .pending
            .extend(crate::info::ctrl_frame(CtrlKind::Resync, at, &cut));
        // The receiver's frames before its resync (credits, an abort of the
        // old link) are skipped. The old abort is forgotten only now, under
        // the control lock: the progress thread reads frames under it, so a
        // peer's abort still on its way can no longer fail the new link
        // (forgotten before the lock, one read in between came back).
        c.input.seek_resync();
        sh.health.reset();
        sh.pump_ctrl(c);
        sh.arm_ctrl(c);
        self.aborted = None;
        Ok(())
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
            self.queue_piece(s, p);
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
            self.pump_ctrl();
            if !self.has_credit() {
                return Ok(None);
            }
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
        self.pump_ctrl();
        if self.shared.released.load(Ordering::Acquire) == self.committed {
            return Ok(true);
        }
        self.check()?;
        Ok(false)
    }

    fn check_peer(&mut self) -> Result<()> {
        self.pump_ctrl();
        match self.shared.health.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Rung when a credit arrives, a queued piece leaves, or the link
    /// fails or closes: the progress thread is made to watch the control
    /// socket and every data socket with pieces queued.
    fn arm_wake(&mut self) -> Option<WakeWord> {
        let sh = &self.shared;
        let w = sh.health.bell.arm(false);
        for (i, d) in sh.data.iter().enumerate() {
            sh.arm_out(i, &mut lock(d));
        }
        sh.arm_ctrl(&lock(&sh.ctrl));
        Some(w)
    }

    fn disarm_wake(&mut self) {
        self.shared.health.bell.disarm();
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() && !self.stopped {
            self.aborted = Some(reason.to_owned());
            self.halt(reason);
        }
    }

    fn direct(&mut self) -> Option<&mut dyn DirectSend> {
        if self.direct {
            Some(self)
        } else {
            None
        }
    }

    /// An idle link goes on from where it stands: nothing failed or
    /// aborted, every message released. After an abort (this end's or the
    /// peer's, and nothing else failed) it goes on through a resync, from
    /// what it committed.
    fn resume_point(&mut self) -> Option<Resume> {
        if self.stopped {
            return None;
        }
        self.pump_ctrl();
        if self.aborted.is_some() || self.shared.health.peer_aborted() {
            return self.shared.health.resumable().then_some(Resume {
                count: self.committed,
                drop_max: 0,
                resync: true,
            });
        }
        // The last credits may still be on their way (the receiver
        // released its messages before it came here): up to 200 ms.
        let until = std::time::Instant::now() + std::time::Duration::from_millis(200);
        loop {
            self.pump_ctrl();
            if !self.shared.health.whole() {
                return None;
            }
            if self.shared.released.load(Ordering::Acquire) == self.committed {
                return Some(Resume::at(self.committed));
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        if self.stopped {
            return Resume::expect(None, at, NAME, "the sending end");
        }
        // The mode its resume point gave (which stays: an abort is not
        // forgotten until a resume).
        if self.aborted.is_some() || self.shared.health.peer_aborted() {
            self.resync(at)?;
        } else {
            Resume::expect(self.resume_point(), at, NAME, "the sending end")?;
        }
        self.peer = peer;
        self.shared.health.set_peer(peer);
        Ok(())
    }
}

impl DirectSend for SocketSend {
    fn costs_receiver(&self) -> bool {
        // The progress thread writes from the caller's memory instead of a
        // slot; the receiver reads the same bytes from its sockets either way.
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
        if len > MAX_DIRECT_BYTES {
            return Err(CoreError::InvalidArgument(format!(
                "direct commit of {len} bytes: at most {MAX_DIRECT_BYTES} per message"
            )));
        }
        self.publish(len, Some(ptr))
    }
}

impl Drop for SocketSend {
    fn drop(&mut self) {
        if self.aborted.is_none() && !self.stopped {
            // Let queued pieces leave (normally there are none: the engine
            // waits for poll_drained), bounded.
            let until = Instant::now() + DROP_FLUSH;
            while Instant::now() < until
                && self.shared.health.error().is_none()
                && self.shared.data.iter().any(|d| !lock(d).items.is_empty())
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.stop(Some((CtrlKind::Close, "the sender closed its end")));
        }
        self.stop(None);
    }
}

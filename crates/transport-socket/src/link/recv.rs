//! The receiving end of a socket link. Each data socket is read by a small
//! state machine ([`Rx`]: a frame header, then its payload into the slot
//! the striping rule gives it), run by the progress thread when the socket
//! becomes readable and by the engine inline while it waits for data; a
//! direct piece's payload is left in the socket for the engine to read
//! straight into its destination.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{DirectRecv, Incoming, RecvChannel, Resume, SlotBuf, WakeWord};
use braid_core::types::MemKind;

use super::ctrl::{CtrlIn, CtrlOut};
use super::health::{Fail, Health};
use super::poller::{poller, Armer, Poller, Source, IN, OUT};
use super::{lock, nonblocking, npieces, piece_size, shut, slot_mem, stripes};
use crate::info::{CtrlKind, FrameHeader};
use crate::sys::{self, SlotMem};
use crate::NAME;

/// A data socket's read buffer: headers and small payloads arrive through
/// it (one `recv` for a small message); larger payloads are read straight
/// into their slot.
const READ_BUF: usize = 8 * 1024;

/// Payload bytes still missing below which they are read through the
/// buffer (with the next header) rather than straight into the slot.
const SMALL_READ_BYTES: usize = 4 * 1024;

/// How long a blocking `read_remote` waits without a byte arriving.
const REMOTE_STALL: Duration = Duration::from_secs(60);

/// How long a resume after an abort waits for the sender's resync (which
/// the sender writes when it resumes, at about the same time) and the old
/// link's bytes before its cut.
const RESYNC_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
pub(super) struct Fill {
    /// The message being assembled in this slot.
    seq: Option<u64>,
    total: usize,
    /// Data sockets whose piece has been claimed.
    mask: u64,
    /// Pieces fully read (or, for a direct message, handed over).
    done: usize,
    /// A direct message.
    direct: bool,
}

/// Where a data socket's reading stands.
#[derive(Debug)]
enum RxState {
    /// Between frames: the next header is arriving.
    Header,
    /// A piece's payload is arriving into its slot.
    Payload {
        slot: usize,
        seq: u64,
        off: usize,
        len: usize,
        got: usize,
    },
    /// A direct piece's payload waits in the socket for the engine;
    /// `prefix` is what the buffer already held of it.
    Handed { seq: u64, prefix: Vec<u8> },
    /// Nothing more comes: the stream ended or failed.
    Done,
}

/// The reading state of one data socket, independent of the socket (the
/// fuzzing harness feeds it plain bytes).
#[derive(Debug)]
pub(super) struct Rx {
    buf: Box<[u8]>,
    lo: usize,
    hi: usize,
    st: RxState,
}

impl Default for Rx {
    fn default() -> Self {
        Rx {
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            lo: 0,
            hi: 0,
            st: RxState::Header,
        }
    }
}

/// A data socket and its reading state.
#[derive(Debug)]
pub(super) struct DataSock {
    sock: TcpStream,
    rx: Rx,
    /// The progress thread watches the socket (its reading is between or
    /// inside slot frames, not waiting for the engine).
    armed: bool,
    /// Bytes read from the socket since the link started (by its reading
    /// and by the engine's direct reads): where a resume after an abort
    /// finds the sender's cut.
    taken: u64,
}

#[derive(Debug)]
struct CtrlSock {
    sock: TcpStream,
    input: CtrlIn,
    out: CtrlOut,
}

pub(super) struct RecvShared {
    pub(super) mem: SlotMem,
    pub(super) slots: usize,
    pub(super) nsocks: usize,
    pub(super) slot_bytes: usize,
    /// `seq + 1` once message `seq` is complete in slot `seq % slots`; 0
    /// while the slot is free or filling.
    pub(super) ready: Box<[AtomicU64]>,
    pub(super) lens: Box<[AtomicUsize]>,
    /// The ready message in the slot is direct (its payload is still in the
    /// sockets).
    pub(super) remote: Box<[AtomicBool]>,
    pub(super) fill: Box<[Mutex<Fill>]>,
    /// Direct messages may arrive (not in the fuzzing harness, which has no
    /// engine to read them).
    pub(super) accept_direct: bool,
    /// Slots released by the engine (cumulative).
    pub(super) released: AtomicU64,
    /// Data sockets whose stream ended cleanly.
    pub(super) readers_done: AtomicUsize,
    /// The data sockets are not read (an abort, or a resume point after
    /// one): what comes next may be the new link's, after the sender's cut.
    pub(super) paused: AtomicBool,
    pub(super) health: Arc<Health>,
    /// The data sockets (none in the fuzzing harness).
    pub(super) data: Box<[Mutex<DataSock>]>,
    ctrl: Option<Mutex<CtrlSock>>,
    /// Set once registered with the progress thread.
    armer: OnceLock<Armer>,
}

impl RecvShared {
    /// Shared state for `nsocks` data sockets and no sockets yet.
    pub(super) fn new(
        mem: SlotMem,
        slot_bytes: usize,
        slots: usize,
        nsocks: usize,
        accept_direct: bool,
        health: Arc<Health>,
    ) -> RecvShared {
        RecvShared {
            mem,
            slots,
            nsocks,
            slot_bytes,
            ready: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            lens: (0..slots).map(|_| AtomicUsize::new(0)).collect(),
            remote: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            fill: (0..slots).map(|_| Mutex::new(Fill::default())).collect(),
            accept_direct,
            released: AtomicU64::new(0),
            readers_done: AtomicUsize::new(0),
            paused: AtomicBool::new(false),
            health,
            data: Box::new([]),
            ctrl: None,
            armer: OnceLock::new(),
        }
    }

    /// Reads what data socket `i` has; then has the progress thread watch
    /// it, unless the engine reads a direct payload from it (or it ended).
    fn pump_data(&self, d: &mut DataSock, i: usize) {
        if self.paused.load(Ordering::Acquire) {
            return;
        }
        let sock = &d.sock;
        let taken = &mut d.taken;
        let mut read = |b: &mut [u8]| {
            let n = (&*sock).read(b)?;
            *taken += n as u64;
            Ok(n)
        };
        d.rx.pump(i, self, &mut read);
        let wanted = matches!(d.rx.st, RxState::Header | RxState::Payload { .. });
        if wanted && !d.armed {
            if let Some(a) = self.armer.get() {
                a.arm(i, d.sock.as_fd(), IN);
                d.armed = true;
            }
        }
    }

    /// Reads the control socket (the sender's abort or close) and sends
    /// what is pending on it (credits).
    fn pump_ctrl(&self, c: &mut CtrlSock) {
        if !c.input.done() {
            let sock = &c.sock;
            let mut read = |b: &mut [u8]| (&*sock).read(b);
            c.input.pump(&mut read, &self.health, None, false);
        }
        if !c.out.pending.is_empty() && c.out.flush(&c.sock).is_err() {
            // A broken socket takes nothing more: do not watch it for room.
            c.out.pending.clear();
            c.out.credit_owed = None;
        }
    }
}

impl Source for RecvShared {
    fn ready(&self, idx: usize) {
        if let Some(d) = self.data.get(idx) {
            let mut d = lock(d);
            // The event disarmed it.
            d.armed = false;
            if matches!(d.rx.st, RxState::Handed { .. }) {
                // A direct payload the engine reads itself has bytes (it
                // armed the socket before it went to sleep).
                drop(d);
                self.health.ring();
                return;
            }
            self.pump_data(&mut d, idx);
        } else if let Some(c) = &self.ctrl {
            let mut c = lock(c);
            self.pump_ctrl(&mut c);
            self.arm_ctrl(&c);
        }
    }
}

impl RecvShared {
    /// Watches the control socket again (after its event, or when credits
    /// wait for room).
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

/// Validates a frame header read from data socket `idx` and claims its
/// piece: returns the slot to read the payload into.
fn claim(sh: &RecvShared, idx: usize, h: &FrameHeader) -> std::result::Result<usize, String> {
    let total = h.total as usize;
    if h.direct && !sh.accept_direct {
        return Err(format!("direct message {} where none may arrive", h.seq));
    }
    if total > sh.slot_bytes && !h.direct {
        return Err(format!(
            "message {} of {total} bytes does not fit a {}-byte slot (mismatched BRAID_SOCKET_SLOT_BYTES?)",
            h.seq, sh.slot_bytes
        ));
    }
    let n = sh.nsocks;
    let j = (idx + n - (h.seq % n as u64) as usize) % n;
    let piece = piece_size(total, n);
    let want_off = j * piece;
    if j >= npieces(total, n)
        || h.offset as usize != want_off
        || h.len as usize != piece.min(total - want_off.min(total))
    {
        return Err(format!(
            "piece {}+{} of message {} ({total} bytes) on data socket {idx} does not follow the striping rule",
            h.offset, h.len, h.seq
        ));
    }
    let released = sh.released.load(Ordering::Acquire);
    if h.seq < released || h.seq >= released + sh.slots as u64 {
        return Err(format!(
            "message {} arrived with {released} slots released of {} (the sender overran its credits or repeated a message)",
            h.seq, sh.slots
        ));
    }
    let slot = (h.seq % sh.slots as u64) as usize;
    let mut f = lock(&sh.fill[slot]);
    // Under the fill lock, which `piece_done` holds while it publishes.
    if sh.ready[slot].load(Ordering::Acquire) == h.seq + 1 {
        return Err(format!("message {} arrived twice", h.seq));
    }
    match f.seq {
        None => {
            *f = Fill {
                seq: Some(h.seq),
                total,
                mask: 0,
                done: 0,
                direct: h.direct,
            }
        }
        Some(s) if s == h.seq && f.total == total && f.direct == h.direct => {}
        Some(s) => {
            return Err(format!(
                "message {} collides with message {s} ({} bytes) in slot {slot}",
                h.seq, f.total
            ))
        }
    }
    let bit = 1u64 << idx;
    if f.mask & bit != 0 {
        return Err(format!(
            "message {} sent two pieces on data socket {idx}",
            h.seq
        ));
    }
    f.mask |= bit;
    Ok(slot)
}

/// Marks one piece of `seq` in `slot` read; publishes the slot when it was
/// the last.
fn piece_done(sh: &RecvShared, slot: usize, seq: u64) {
    let mut f = lock(&sh.fill[slot]);
    f.done += 1;
    if f.done == npieces(f.total, sh.nsocks) {
        sh.lens[slot].store(f.total, Ordering::Relaxed);
        sh.remote[slot].store(f.direct, Ordering::Relaxed);
        *f = Fill::default();
        // Release: the payload written by every reader (ordered before this
        // through the fill mutex) and the length are visible to an engine
        // that loads `ready` with Acquire.
        sh.ready[slot].store(seq + 1, Ordering::Release);
        drop(f);
        sh.health.ring();
    }
}

impl Rx {
    /// Moves the buffered bytes to the front, to read more behind them.
    fn compact(&mut self) {
        if self.lo > 0 {
            self.buf.copy_within(self.lo..self.hi, 0);
            self.hi -= self.lo;
            self.lo = 0;
        }
    }

    /// Reads into the buffer: `Ok(true)` if bytes came, `Ok(false)` when
    /// there are none now; `Err` at the end of the stream (`None`) or on a
    /// failure.
    fn fill(
        &mut self,
        read: &mut dyn FnMut(&mut [u8]) -> io::Result<usize>,
    ) -> std::result::Result<bool, Option<io::Error>> {
        self.compact();
        loop {
            match read(&mut self.buf[self.hi..]) {
                Ok(0) => return Err(None),
                Ok(n) => {
                    self.hi += n;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(Some(e)),
            }
        }
    }

    /// The stream of data socket `idx` ended (`None`) or failed.
    fn ended(&mut self, idx: usize, sh: &RecvShared, e: Option<io::Error>) {
        let mid = !matches!(self.st, RxState::Header) || self.hi > self.lo;
        self.st = RxState::Done;
        match e {
            None if !mid => {
                sh.readers_done.fetch_add(1, Ordering::AcqRel);
                if !sh.health.peer_closed.load(Ordering::Acquire) {
                    sh.health.lost_later(
                        &format!("data socket {idx} was closed (peer process exited?)"),
                        io::ErrorKind::UnexpectedEof,
                        "end of stream",
                    );
                }
            }
            None => sh.health.lost_later(
                &format!("receiving on data socket {idx}"),
                io::ErrorKind::UnexpectedEof,
                "the peer closed the socket in the middle of a frame",
            ),
            Some(e) => sh.health.lost_later(
                &format!("receiving on data socket {idx}"),
                e.kind(),
                &e.to_string(),
            ),
        }
    }

    /// Reads frames of data socket `idx` with `read` (which says
    /// `WouldBlock` when the socket is empty) until it would block, a direct
    /// piece waits for the engine, or the stream ends.
    pub(super) fn pump(
        &mut self,
        idx: usize,
        sh: &RecvShared,
        read: &mut dyn FnMut(&mut [u8]) -> io::Result<usize>,
    ) {
        loop {
            match self.st {
                RxState::Done | RxState::Handed { .. } => return,
                RxState::Header => {
                    if self.hi - self.lo < FrameHeader::LEN {
                        match self.fill(read) {
                            Ok(true) => continue,
                            Ok(false) => return,
                            Err(e) => return self.ended(idx, sh, e),
                        }
                    }
                    let mut hb = [0u8; FrameHeader::LEN];
                    hb.copy_from_slice(&self.buf[self.lo..self.lo + FrameHeader::LEN]);
                    self.lo += FrameHeader::LEN;
                    let Some(h) = FrameHeader::decode(&hb) else {
                        self.st = RxState::Done;
                        return sh.health.fail(Fail::Protocol(format!(
                            "corrupt frame header on data socket {idx}"
                        )));
                    };
                    let slot = match claim(sh, idx, &h) {
                        Ok(s) => s,
                        Err(e) => {
                            self.st = RxState::Done;
                            return sh.health.fail(Fail::Protocol(e));
                        }
                    };
                    if h.direct {
                        // The engine reads the payload straight from the
                        // socket into its destination (`poll_read_remote`).
                        let k = (self.hi - self.lo).min(h.len as usize);
                        let prefix = self.buf[self.lo..self.lo + k].to_vec();
                        self.lo += k;
                        self.st = RxState::Handed { seq: h.seq, prefix };
                        piece_done(sh, slot, h.seq);
                        return;
                    }
                    self.st = RxState::Payload {
                        slot,
                        seq: h.seq,
                        off: h.offset as usize,
                        len: h.len as usize,
                        got: 0,
                    };
                }
                RxState::Payload {
                    slot,
                    seq,
                    off,
                    len,
                    mut got,
                } => {
                    let k = (self.hi - self.lo).min(len - got);
                    if k > 0 {
                        // SAFETY: `claim` checked that this range is this
                        // socket's piece of message `seq` under the striping
                        // rule (pieces of one message are disjoint and each
                        // socket's bit is claimed once), that it lies inside
                        // the slot, and that the engine has released the
                        // slot's previous message (the Acquire load of
                        // `released`) and will not read it before `ready`
                        // is published after this write; this socket's state
                        // is locked by its only writer.
                        let dst = unsafe { sh.mem.slice_mut(slot, off + got, k) };
                        dst.copy_from_slice(&self.buf[self.lo..self.lo + k]);
                        self.lo += k;
                        got += k;
                    }
                    if got < len {
                        let res = if len - got < SMALL_READ_BYTES {
                            self.st = RxState::Payload {
                                slot,
                                seq,
                                off,
                                len,
                                got,
                            };
                            match self.fill(read) {
                                Ok(true) => continue,
                                Ok(false) => return,
                                Err(e) => return self.ended(idx, sh, e),
                            }
                        } else {
                            // SAFETY: as above, for the rest of the piece.
                            let dst = unsafe { sh.mem.slice_mut(slot, off + got, len - got) };
                            read(dst)
                        };
                        match res {
                            Ok(0) => {
                                self.st = RxState::Payload {
                                    slot,
                                    seq,
                                    off,
                                    len,
                                    got,
                                };
                                return self.ended(idx, sh, None);
                            }
                            Ok(n) => got += n,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                                self.st = RxState::Payload {
                                    slot,
                                    seq,
                                    off,
                                    len,
                                    got,
                                };
                                return;
                            }
                            Err(e) => {
                                self.st = RxState::Done;
                                return self.ended(idx, sh, Some(e));
                            }
                        }
                        self.st = RxState::Payload {
                            slot,
                            seq,
                            off,
                            len,
                            got,
                        };
                        continue;
                    }
                    self.st = RxState::Header;
                    piece_done(sh, slot, seq);
                }
            }
        }
    }
}

/// Records a failure of data socket `s` seen by the engine (after giving
/// the control socket a moment to explain it) and returns the error.
fn read_failed(health: &Health, peer: u32, s: usize, e: io::Error) -> CoreError {
    health.await_verdict();
    health.lost(&format!("receiving on data socket {s}"), &e);
    health.error().unwrap_or_else(|| CoreError::Peer {
        transport: NAME,
        peer,
        what: format!("connection lost: receiving on data socket {s}: {e}"),
        source: Some(Box::new(e)),
    })
}

/// The receiving end of a socket link.
pub struct SocketRecv {
    peer: u32,
    slot_bytes: usize,
    slots: usize,
    shared: Arc<RecvShared>,
    head: u64,
    poller: Arc<Poller>,
    id: u64,
    aborted: Option<String>,
    stopped: bool,
    /// The direct read of the head message in progress or done.
    rd: Option<RemoteRead>,
}

/// The engine's read of a direct message from the sockets.
#[derive(Debug)]
struct RemoteRead {
    seq: u64,
    dst: usize,
    len: usize,
    /// `(data socket, offset, length, bytes read)` per piece.
    pieces: Vec<(usize, usize, usize, usize)>,
    done: bool,
}

impl std::fmt::Debug for SocketRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketRecv")
            .field("peer", &self.peer)
            .field("slot_bytes", &self.slot_bytes)
            .field("slots", &self.slots)
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

impl SocketRecv {
    /// Starts a connected receiving end: the process's progress thread
    /// reads its sockets from now on.
    pub(crate) fn start(
        peer: u32,
        slot_bytes: usize,
        slots: usize,
        data: Vec<TcpStream>,
        ctrl: TcpStream,
    ) -> Result<SocketRecv> {
        let nsocks = data.len();
        let mem = slot_mem(slot_bytes, slots)?;
        for s in data.iter().chain(std::iter::once(&ctrl)) {
            nonblocking(peer, s)?;
        }
        let mut sh = RecvShared::new(mem, slot_bytes, slots, nsocks, true, Health::new(peer));
        sh.data = data
            .into_iter()
            .map(|sock| {
                Mutex::new(DataSock {
                    sock,
                    rx: Rx::default(),
                    armed: true,
                    taken: 0,
                })
            })
            .collect();
        sh.ctrl = Some(Mutex::new(CtrlSock {
            sock: ctrl,
            input: CtrlIn::default(),
            out: CtrlOut::new(),
        }));
        let shared = Arc::new(sh);
        let poller = poller()?;
        let id = {
            let guards: Vec<_> = shared.data.iter().map(lock).collect();
            let c = shared.ctrl.as_ref().map(lock);
            let mut fds: Vec<BorrowedFd<'_>> = guards.iter().map(|g| g.sock.as_fd()).collect();
            fds.extend(c.as_ref().map(|c| c.sock.as_fd()));
            let want = vec![IN; fds.len()];
            let id = poller.register(shared.clone(), &fds, &want)?;
            let _ = shared.armer.set(poller.armer(id));
            id
        };
        Ok(SocketRecv {
            peer,
            slot_bytes,
            slots,
            shared,
            head: 0,
            poller,
            id,
            aborted: None,
            stopped: false,
            rd: None,
        })
    }

    /// Waits up to `wait` for a byte of the direct message being read.
    fn wait_readable(&self, wait: Duration) {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let Some(rd) = &self.rd else { return };
        let socks: Vec<TcpStream> = rd
            .pieces
            .iter()
            .filter(|p| p.3 < p.2)
            .filter_map(|p| lock(&self.shared.data[p.0]).sock.try_clone().ok())
            .collect();
        let mut fds: Vec<PollFd<'_>> = socks
            .iter()
            .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
            .collect();
        let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX);
        let _ = poll(&mut fds, PollTimeout::from(ms));
    }

    fn head_ready(&self) -> Option<usize> {
        let i = (self.head % self.slots as u64) as usize;
        (self.shared.ready[i].load(Ordering::Acquire) == self.head + 1).then_some(i)
    }

    /// Reads the data sockets inline (those the progress thread is not
    /// reading now).
    fn pump_inline(&self) {
        for (i, d) in self.shared.data.iter().enumerate() {
            if let Ok(mut d) = d.try_lock() {
                self.shared.pump_data(&mut d, i);
            }
        }
        // And whatever else the progress thread has pending (this rank's
        // queued sends above all): the engine waits, so it moves the bytes.
        self.poller.help();
    }

    /// Moves what has arrived of the head's direct message into `dst`:
    /// `Ok(Some(progressed))` while bytes are missing, `Ok(None)` once all
    /// are there.
    ///
    /// # Safety
    ///
    /// As for [`DirectRecv::poll_read_remote`].
    unsafe fn pump(&mut self, dst: *mut u8, len: usize) -> Result<Option<bool>> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        let Some(i) = self.head_ready() else {
            return Err(CoreError::InvalidArgument(
                "read_remote without a direct slot from poll_peek_any".into(),
            ));
        };
        let total = self.shared.lens[i].load(Ordering::Relaxed);
        if !self.shared.remote[i].load(Ordering::Relaxed) || len != total {
            return Err(CoreError::InvalidArgument(format!(
                "read_remote of {len} bytes, but the head slot is not a direct message of that length"
            )));
        }
        let head = self.head;
        let nsocks = self.shared.nsocks;
        match &self.rd {
            Some(rd) if rd.seq == head => {
                if rd.dst != dst as usize || rd.len != len {
                    return Err(CoreError::InvalidArgument(
                        "read_remote continued with another destination".into(),
                    ));
                }
                if rd.done {
                    return Ok(None);
                }
            }
            _ => {
                let mut pieces = Vec::new();
                for (s, off, plen) in stripes(head, len, nsocks) {
                    let mut d = lock(&self.shared.data[s]);
                    let prefix = match &mut d.rx.st {
                        RxState::Handed { seq, prefix } if *seq == head && prefix.len() <= plen => {
                            std::mem::take(prefix)
                        }
                        _ => {
                            return Err(CoreError::Protocol {
                                peer: self.peer,
                                detail: format!(
                                    "socket link: direct message {head} is not waiting on data socket {s}"
                                ),
                            })
                        }
                    };
                    // SAFETY: `off + prefix.len() <= off + plen <= len`, inside
                    // `dst` (caller's contract); the prefix is our own Vec.
                    unsafe { sys::copy_to(&prefix, dst.wrapping_add(off)) };
                    pieces.push((s, off, plen, prefix.len()));
                }
                self.rd = Some(RemoteRead {
                    seq: head,
                    dst: dst as usize,
                    len,
                    pieces,
                    done: false,
                });
            }
        }
        let Some(rd) = self.rd.as_mut() else {
            return Ok(None);
        };
        let mut progressed = false;
        let mut missing = false;
        for (s, off, plen, got) in rd.pieces.iter_mut() {
            let mut d = lock(&self.shared.data[*s]);
            if !matches!(d.rx.st, RxState::Handed { seq, .. } if seq == head) {
                // This piece is in already.
                continue;
            }
            while *got < *plen {
                let fd = d.sock.as_raw_fd();
                // SAFETY: `off + got .. off + plen` lies inside `dst`, which
                // the caller lends us for this call; this socket's state
                // says `Handed` (locked here), so nobody else reads it.
                let r = unsafe { sys::recv_some(fd, dst.wrapping_add(*off + *got), *plen - *got) };
                match r {
                    Ok(Some(0)) => {
                        d.rx.st = RxState::Done;
                        drop(d);
                        let e = io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the peer closed the socket in the middle of a frame",
                        );
                        return Err(read_failed(&self.shared.health, self.peer, *s, e));
                    }
                    Ok(Some(n)) => {
                        d.taken += n as u64;
                        *got += n;
                        progressed = true;
                    }
                    Ok(None) => {
                        missing = true;
                        break;
                    }
                    Err(e) => {
                        d.rx.st = RxState::Done;
                        drop(d);
                        return Err(read_failed(&self.shared.health, self.peer, *s, e));
                    }
                }
            }
            if *got == *plen {
                // This socket's piece is in: its reading goes on (the next
                // frames may be there already, without a new edge).
                d.rx.st = RxState::Header;
                self.shared.pump_data(&mut d, *s);
            }
        }
        if missing {
            if !progressed {
                if let Some(e) = self.shared.health.error() {
                    return Err(e);
                }
                // While the payload is on its way, keep this process's
                // other sockets moving (our own sends to the peer above all).
                self.poller.help();
            }
            return Ok(Some(progressed));
        }
        rd.done = true;
        Ok(None)
    }

    /// An error if the link is dead and nothing more can arrive.
    fn check_live(&mut self) -> Result<()> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        if let Some(c) = &self.shared.ctrl {
            if let Ok(mut c) = c.try_lock() {
                self.shared.pump_ctrl(&mut c);
                let c = &mut *c;
                if let Err(e) = c.out.flush(&c.sock) {
                    // A sender that closed normally may have shut its sockets
                    // before we read its Close: the verdict comes later.
                    self.shared
                        .health
                        .lost_later("sending credits", e.kind(), &e.to_string());
                }
            }
        }
        if let Some(e) = self.shared.health.error() {
            return Err(e);
        }
        if self.shared.health.peer_closed.load(Ordering::Acquire)
            && self.shared.readers_done.load(Ordering::Acquire) == self.shared.nsocks
            && self.head_ready().is_none()
        {
            return Err(CoreError::PeerAborted {
                transport: NAME,
                peer: self.peer,
                reason: "the sender closed its end".into(),
            });
        }
        Ok(())
    }

    /// Goes on after an abort from the sender's message `at`: tells the
    /// sender where this end's old control frames end, waits (at most
    /// [`RESYNC_WAIT`]) for the sender's resync, which says where it cut
    /// each data stream, drops what it did not read up to there, and
    /// starts reading the new link's frames with every slot free.
    fn resync(&mut self, at: u64) -> Result<()> {
        let sh = self.shared.clone();
        let Some(ctrl) = &sh.ctrl else {
            return Err(CoreError::Unavailable {
                transport: NAME,
                reason: "a link without a control socket cannot resynchronise".into(),
            });
        };
        let until = Instant::now() + RESYNC_WAIT;
        let late = |waiting_for: &'static str| CoreError::Timeout {
            transport: NAME,
            peer: self.peer,
            waiting_for,
            after: RESYNC_WAIT,
        };
        let failed = |what: String| CoreError::Peer {
            transport: NAME,
            peer: self.peer,
            what: format!("resuming the link: {what}"),
            source: None,
        };
        sh.paused.store(true, Ordering::Release);
        if !sh.health.resumable() {
            // Something else failed since the resume point (a lost socket).
            return Err(sh.health.error().unwrap_or(CoreError::Unavailable {
                transport: NAME,
                reason: "the link failed since its resume point: it cannot be kept".into(),
            }));
        }
        {
            let mut guard = lock(ctrl);
            let c = &mut *guard;
            c.out.credit_owed = None;
            c.out
                .pending
                .extend(crate::info::ctrl_frame(CtrlKind::Resync, at, &[]));
            // As the sender's resync: the old abort is forgotten under the
            // control lock, once frames before the peer's resync are
            // skipped.
            c.input.seek_resync();
            sh.health.reset();
            sh.pump_ctrl(c);
            sh.arm_ctrl(c);
        }
        // The sender's cut: where each data stream of the new link begins.
        let cut = loop {
            {
                let mut guard = lock(ctrl);
                let c = &mut *guard;
                sh.pump_ctrl(c);
                if let Some((value, payload)) = c.input.take_resynced() {
                    if value != at || payload.len() != 8 * sh.data.len() {
                        return Err(CoreError::Protocol {
                            peer: self.peer,
                            detail: format!(
                                "socket link: the sender resumed at message {value} with {} stream positions, not at {at} with {}",
                                payload.len() / 8,
                                sh.data.len()
                            ),
                        });
                    }
                    break payload
                        .chunks_exact(8)
                        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
                        .collect::<Vec<u64>>();
                }
                sh.arm_ctrl(c);
            }
            if let Some(e) = sh.health.error() {
                return Err(e);
            }
            if Instant::now() >= until {
                return Err(late("the sender's resync"));
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        let mut junk = vec![0u8; 64 * 1024];
        for (i, (d, &w)) in sh.data.iter().zip(&cut).enumerate() {
            // The lock is not held while waiting (the progress thread may
            // take it for an event of this socket, and finds it paused).
            let watch = lock(d)
                .sock
                .try_clone()
                .map_err(|e| failed(format!("data socket {i}: {e}")))?;
            loop {
                let mut d = lock(d);
                if w < d.taken {
                    return Err(CoreError::Protocol {
                        peer: self.peer,
                        detail: format!(
                            "socket link: the sender cut data socket {i} at byte {w}, but {} were read",
                            d.taken
                        ),
                    });
                }
                if d.taken == w {
                    // What the buffer held was read before the cut: the
                    // old link's.
                    d.rx = Rx::default();
                    break;
                }
                let n = ((w - d.taken) as usize).min(junk.len());
                match (&d.sock).read(&mut junk[..n]) {
                    Ok(0) => return Err(failed(format!("data socket {i} ended"))),
                    Ok(k) => d.taken += k as u64,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        drop(d);
                        if Instant::now() >= until {
                            return Err(late("the old link's bytes before the sender's cut"));
                        }
                        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
                        let mut fds = [PollFd::new(watch.as_fd(), PollFlags::POLLIN)];
                        let _ = poll(&mut fds, PollTimeout::from(10u16));
                    }
                    Err(e) => return Err(failed(format!("data socket {i}: {e}"))),
                }
            }
        }
        for i in 0..sh.slots {
            *lock(&sh.fill[i]) = Fill::default();
            sh.ready[i].store(0, Ordering::Relaxed);
            sh.lens[i].store(0, Ordering::Relaxed);
            sh.remote[i].store(false, Ordering::Relaxed);
        }
        self.head = at;
        self.rd = None;
        self.aborted = None;
        // Release: the cleared slots before a reader's Acquire in `claim`.
        sh.released.store(at, Ordering::Release);
        sh.paused.store(false, Ordering::Release);
        for (i, d) in sh.data.iter().enumerate() {
            let mut d = lock(d);
            d.armed = false;
            sh.pump_data(&mut d, i);
        }
        Ok(())
    }

    fn stop(&mut self, goodbye: Option<(CtrlKind, &str)>) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let sh = &self.shared;
        sh.health.local_closing.store(true, Ordering::Release);
        let data: Vec<_> = sh.data.iter().map(lock).collect();
        let mut ctrl = sh.ctrl.as_ref().map(lock);
        if let (Some(c), Some((kind, reason))) = (ctrl.as_deref_mut(), goodbye) {
            c.out.goodbye(&c.sock, kind, reason);
        }
        for d in &data {
            shut(&d.sock);
        }
        let mut fds: Vec<BorrowedFd<'_>> = data.iter().map(|d| d.sock.as_fd()).collect();
        if let Some(c) = &ctrl {
            shut(&c.sock);
            fds.push(c.sock.as_fd());
        }
        self.poller.deregister(self.id, &fds);
    }
}

impl RecvChannel for SocketRecv {
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

    fn poll_peek(&mut self) -> Result<Option<(SlotBuf, usize)>> {
        match self.poll_peek_any()? {
            None => Ok(None),
            Some(Incoming::Inline(slot, len)) => Ok(Some((slot, len))),
            Some(Incoming::Remote(_)) => Err(CoreError::Protocol {
                peer: self.peer,
                detail: "a direct (zero-copy) message reached a receiver that reads slots only"
                    .into(),
            }),
        }
    }

    fn poll_peek_any(&mut self) -> Result<Option<Incoming>> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        if self.head_ready().is_none() {
            self.pump_inline();
        }
        if let Some(i) = self.head_ready() {
            let len = self.shared.lens[i].load(Ordering::Relaxed);
            if self.shared.remote[i].load(Ordering::Relaxed) {
                return Ok(Some(Incoming::Remote(len)));
            }
            return Ok(Some(Incoming::Inline(
                SlotBuf {
                    ptr: self.shared.mem.slot_ptr(i),
                    cap: self.slot_bytes,
                },
                len,
            )));
        }
        self.check_live()?;
        Ok(None)
    }

    fn release(&mut self) -> Result<()> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        let Some(i) = self.head_ready() else {
            return Err(CoreError::InvalidArgument(
                "release without a slot from poll_peek".into(),
            ));
        };
        if self.shared.remote[i].load(Ordering::Relaxed) {
            if !self
                .rd
                .as_ref()
                .is_some_and(|rd| rd.seq == self.head && rd.done)
            {
                return Err(CoreError::InvalidArgument(
                    "release of a direct slot before read_remote read it".into(),
                ));
            }
            self.rd = None;
            self.shared.remote[i].store(false, Ordering::Relaxed);
        }
        self.shared.ready[i].store(0, Ordering::Relaxed);
        self.head += 1;
        // Release: the engine's reads of the slot and the reset of `ready`
        // happen before a reader (Acquire in `claim`) refills it.
        self.shared.released.store(self.head, Ordering::Release);
        if let Some(c) = &self.shared.ctrl {
            let mut c = lock(c);
            let c = &mut *c;
            match c.out.credit(&c.sock, self.head) {
                // The socket is full: the progress thread sends the rest.
                Ok(()) if !c.out.pending.is_empty() => self.shared.arm_ctrl(c),
                Ok(()) => {}
                // As in `check_live`: a normal close may still be on its way.
                Err(e) => {
                    self.shared
                        .health
                        .lost_later("sending a credit", e.kind(), &e.to_string())
                }
            }
        }
        Ok(())
    }

    fn check_peer(&mut self) -> Result<()> {
        self.check_live()
    }

    /// Rung once a message is complete, the bytes of a direct message the
    /// engine reads can be read, or the link fails or closes: the progress
    /// thread is made to watch every data socket that is not ended.
    fn arm_wake(&mut self) -> Option<WakeWord> {
        let w = self.shared.health.bell.arm(false);
        if self.shared.paused.load(Ordering::Acquire) {
            return Some(w);
        }
        if let Some(a) = self.shared.armer.get() {
            for (i, d) in self.shared.data.iter().enumerate() {
                let mut d = lock(d);
                if !d.armed && !matches!(d.rx.st, RxState::Done) {
                    a.arm(i, d.sock.as_fd(), IN);
                    d.armed = true;
                }
            }
        }
        Some(w)
    }

    fn disarm_wake(&mut self) {
        self.shared.health.bell.disarm();
    }

    /// Stops reading the data sockets (the sender's cut may be followed by
    /// the new link's frames after a resume) and tells the peer why; the
    /// sockets stay open for [`RecvChannel::resume`].
    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() && !self.stopped {
            self.aborted = Some(reason.to_owned());
            self.shared.paused.store(true, Ordering::Release);
            if let Some(c) = &self.shared.ctrl {
                let mut guard = lock(c);
                let c = &mut *guard;
                c.out.goodbye(&c.sock, CtrlKind::Abort, reason);
                self.shared.arm_ctrl(c);
            }
        }
    }

    fn direct(&mut self) -> Option<&mut dyn DirectRecv> {
        Some(self)
    }

    /// An idle link goes on from where it stands: nothing failed or
    /// aborted, nothing arrived that was not released. After an abort (this
    /// end's or the peer's, and nothing else failed) it goes on through a
    /// resync, dropping whatever it did not release; it stops reading the
    /// data sockets from here on (after the sender's cut come the new
    /// link's frames).
    fn resume_point(&mut self) -> Option<Resume> {
        if self.stopped {
            return None;
        }
        if let Some(c) = &self.shared.ctrl {
            self.shared.pump_ctrl(&mut lock(c));
        }
        if self.aborted.is_some() || self.shared.health.peer_aborted() {
            self.shared.paused.store(true, Ordering::Release);
            return self.shared.health.resumable().then_some(Resume {
                count: self.head,
                drop_max: u64::MAX,
                resync: true,
            });
        }
        if self.rd.is_some() {
            return None;
        }
        self.pump_inline();
        (self.shared.health.whole() && self.head_ready().is_none()).then(|| Resume::at(self.head))
    }

    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        if self.stopped {
            return Resume::expect(None, at, NAME, "the receiving end");
        }
        // The mode its resume point gave (which stays: an abort is not
        // forgotten until a resume).
        if self.aborted.is_some() || self.shared.health.peer_aborted() {
            self.resync(at)?;
        } else {
            Resume::expect(self.resume_point(), at, NAME, "the receiving end")?;
        }
        self.peer = peer;
        self.shared.health.set_peer(peer);
        Ok(())
    }
}

impl DirectRecv for SocketRecv {
    unsafe fn read_remote(&mut self, dst: *mut u8, len: usize) -> Result<()> {
        let mut last = Instant::now();
        loop {
            // SAFETY: forwarded from this function's contract.
            match unsafe { self.pump(dst, len)? } {
                None => return Ok(()),
                Some(true) => last = Instant::now(),
                Some(false) => {
                    self.check_live()?;
                    if last.elapsed() >= REMOTE_STALL {
                        return Err(CoreError::Timeout {
                            transport: NAME,
                            peer: self.peer,
                            waiting_for: "the rest of a direct message",
                            after: last.elapsed(),
                        });
                    }
                    self.wait_readable(Duration::from_millis(10));
                }
            }
        }
    }

    unsafe fn poll_read_remote(&mut self, dst: *mut u8, len: usize) -> Result<bool> {
        // SAFETY: forwarded from this function's contract.
        Ok(unsafe { self.pump(dst, len)? }.is_none())
    }
}

impl Drop for SocketRecv {
    fn drop(&mut self) {
        self.stop(Some((CtrlKind::Close, "the receiver closed its end")));
    }
}

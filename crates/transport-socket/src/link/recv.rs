//! The receiving end of a socket link and its reader threads.

use std::io::{self, BufRead, BufReader, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{DirectRecv, Incoming, RecvChannel, SlotBuf};
use braid_core::types::MemKind;

use super::ctrl::{ctrl_reader, CtrlOut};
use super::health::{Fail, Health};
use super::{lock, npieces, piece_size, read_full, shut, spawn, stripes};
use crate::info::{CtrlKind, FrameHeader};
use crate::sys::{self, SlotMem};
use crate::NAME;

/// A receiving helper's read buffer.
const READ_BUF: usize = 8 * 1024;

/// How long a blocking `read_remote` waits without a byte arriving.
const REMOTE_STALL: Duration = Duration::from_secs(60);

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

/// A data socket whose reader handed the payload of a direct piece over to
/// the engine: the reader waits until the engine has read it.
#[derive(Debug, Default)]
struct HandState {
    /// The message whose piece is waiting in the socket.
    seq: Option<u64>,
    /// Payload bytes the reader had already buffered.
    prefix: Vec<u8>,
}

#[derive(Debug, Default)]
pub(super) struct Hand {
    st: Mutex<HandState>,
    cv: Condvar,
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
    /// Per data socket.
    pub(super) hands: Box<[Hand]>,
    /// Direct messages may arrive (not in the fuzzing harness, which has no
    /// engine to read them).
    pub(super) accept_direct: bool,
    /// Slots released by the engine (cumulative).
    pub(super) released: AtomicU64,
    /// Data readers that saw a clean end of stream.
    pub(super) readers_done: AtomicUsize,
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
    }
}

pub(super) fn reader<R: Read>(sock: R, sh: Arc<RecvShared>, health: Arc<Health>, idx: usize) {
    // Small: what it buffered of a direct piece's payload is copied once
    // more (payloads of this size or more are read around the buffer).
    let mut r = BufReader::with_capacity(READ_BUF, sock);
    let res: io::Result<()> = loop {
        let mut hb = [0u8; FrameHeader::LEN];
        match read_full(&mut r, &mut hb) {
            Ok(true) => {}
            Ok(false) => break Ok(()),
            Err(e) => break Err(e),
        }
        let Some(h) = FrameHeader::decode(&hb) else {
            health.fail(Fail::Protocol(format!(
                "corrupt frame header on data socket {idx}"
            )));
            return;
        };
        let slot = match claim(&sh, idx, &h) {
            Ok(s) => s,
            Err(e) => {
                health.fail(Fail::Protocol(e));
                return;
            }
        };
        if h.direct {
            // The engine reads the payload straight from the socket into its
            // destination (`poll_read_remote`); hand over what we buffered.
            let buffered = r.buffer();
            let k = buffered.len().min(h.len as usize);
            let hand = &sh.hands[idx];
            {
                let mut st = lock(&hand.st);
                st.prefix.clear();
                st.prefix.extend_from_slice(&buffered[..k]);
                st.seq = Some(h.seq);
            }
            r.consume(k);
            piece_done(&sh, slot, h.seq);
            let mut st = lock(&hand.st);
            while st.seq.is_some() {
                if health.local_closing.load(Ordering::Acquire)
                    || health.failed.load(Ordering::Acquire)
                {
                    return;
                }
                st = hand
                    .cv
                    .wait_timeout(st, Duration::from_millis(100))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            continue;
        }
        if h.len > 0 {
            // SAFETY: `claim` checked that this range is this socket's piece
            // of message `seq` under the striping rule (pieces of one
            // message are disjoint and each socket's bit is claimed once),
            // that the range lies inside the slot, and that the engine has
            // released the slot's previous message (the Acquire load of
            // `released`) and will not read it before `ready` is published
            // after this write.
            let dst = unsafe { sh.mem.slice_mut(slot, h.offset as usize, h.len as usize) };
            match read_full(&mut r, dst) {
                Ok(true) => {}
                Ok(false) => {
                    break Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the socket in the middle of a frame",
                    ))
                }
                Err(e) => break Err(e),
            }
        }
        piece_done(&sh, slot, h.seq);
    };
    if health.local_closing.load(Ordering::Acquire) {
        return;
    }
    health.await_verdict();
    match res {
        Ok(()) => {
            if !health.peer_closed.load(Ordering::Acquire) {
                health.fail(Fail::Lost {
                    what: format!("data socket {idx} was closed (peer process exited?)"),
                    kind: io::ErrorKind::UnexpectedEof,
                    cause: "end of stream".into(),
                });
            }
        }
        Err(e) => health.lost(&format!("receiving on data socket {idx}"), &e),
    }
    sh.readers_done.fetch_add(1, Ordering::AcqRel);
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
    data: Vec<TcpStream>,
    ctrl: CtrlOut,
    health: Arc<Health>,
    threads: Vec<JoinHandle<()>>,
    aborted: Option<String>,
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
    /// Starts the helpers of a connected receiving end.
    pub(crate) fn start(
        peer: u32,
        slot_bytes: usize,
        slots: usize,
        data: Vec<TcpStream>,
        ctrl: TcpStream,
    ) -> Result<SocketRecv> {
        let nsocks = data.len();
        let mem = SlotMem::new(slot_bytes, slots).map_err(|reason| CoreError::Unavailable {
            transport: NAME,
            reason,
        })?;
        let shared = Arc::new(RecvShared {
            mem,
            slots,
            nsocks,
            slot_bytes,
            ready: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            lens: (0..slots).map(|_| AtomicUsize::new(0)).collect(),
            remote: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            fill: (0..slots).map(|_| Mutex::new(Fill::default())).collect(),
            hands: (0..nsocks).map(|_| Hand::default()).collect(),
            accept_direct: true,
            released: AtomicU64::new(0),
            readers_done: AtomicUsize::new(0),
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
        let mut me = SocketRecv {
            peer,
            slot_bytes,
            slots,
            shared: shared.clone(),
            head: 0,
            data: Vec::new(),
            ctrl: CtrlOut {
                sock: clone(&ctrl)?,
                pending: Vec::new(),
                credit_owed: None,
            },
            health: health.clone(),
            threads: Vec::new(),
            aborted: None,
            rd: None,
        };
        me.data = data.iter().map(clone).collect::<Result<_>>()?;
        {
            let h = health.clone();
            me.threads
                .push(spawn(format!("braid-sock-ctl<{peer}"), move || {
                    ctrl_reader(ctrl, h, None, false)
                })?);
        }
        for (i, s) in data.into_iter().enumerate() {
            let (sh, h) = (shared.clone(), health.clone());
            me.threads
                .push(spawn(format!("braid-sock-rx{i}<{peer}"), move || {
                    reader(s, sh, h, i)
                })?);
        }
        Ok(me)
    }

    /// Waits up to `wait` for a byte of the direct message being read.
    fn wait_readable(&self, wait: Duration) {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        let Some(rd) = &self.rd else { return };
        let mut fds: Vec<PollFd<'_>> = rd
            .pieces
            .iter()
            .filter(|p| p.3 < p.2)
            .map(|p| PollFd::new(self.data[p.0].as_fd(), PollFlags::POLLIN))
            .collect();
        let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX);
        let _ = poll(&mut fds, PollTimeout::from(ms));
    }

    fn head_ready(&self) -> Option<usize> {
        let i = (self.head % self.slots as u64) as usize;
        (self.shared.ready[i].load(Ordering::Acquire) == self.head + 1).then_some(i)
    }

    /// Wakes readers waiting for a direct payload to be read (they exit:
    /// this end is closing).
    fn wake_hands(&self) {
        for h in self.shared.hands.iter() {
            let _g = lock(&h.st);
            h.cv.notify_all();
        }
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
                for (s, off, plen) in stripes(head, len, self.data.len()) {
                    let mut st = lock(&self.shared.hands[s].st);
                    if st.seq != Some(head) || st.prefix.len() > plen {
                        return Err(CoreError::Protocol {
                            peer: self.peer,
                            detail: format!(
                                "socket link: direct message {head} is not waiting on data socket {s}"
                            ),
                        });
                    }
                    // SAFETY: `off + prefix.len() <= off + plen <= len`, inside
                    // `dst` (caller's contract); the prefix is our own Vec.
                    unsafe { sys::copy_to(&st.prefix, dst.wrapping_add(off)) };
                    let got = st.prefix.len();
                    st.prefix.clear();
                    pieces.push((s, off, plen, got));
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
            while *got < *plen {
                let fd = self.data[*s].as_raw_fd();
                // SAFETY: `off + got .. off + plen` lies inside `dst`, which
                // the caller lends us for this call; the reader of socket
                // `s` waits (hand state) while we read its payload.
                let r = unsafe { sys::recv_some(fd, dst.wrapping_add(*off + *got), *plen - *got) };
                match r {
                    Ok(Some(0)) => {
                        let e = io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the peer closed the socket in the middle of a frame",
                        );
                        return Err(read_failed(&self.health, self.peer, *s, e));
                    }
                    Ok(Some(n)) => {
                        *got += n;
                        progressed = true;
                    }
                    Ok(None) => {
                        missing = true;
                        break;
                    }
                    Err(e) => return Err(read_failed(&self.health, self.peer, *s, e)),
                }
            }
        }
        if missing {
            if !progressed {
                if let Some(e) = self.health.error() {
                    return Err(e);
                }
            }
            return Ok(Some(progressed));
        }
        rd.done = true;
        // Every byte is in; the readers may go on with their sockets.
        for (s, ..) in &rd.pieces {
            let hand = &self.shared.hands[*s];
            lock(&hand.st).seq = None;
            hand.cv.notify_all();
        }
        Ok(None)
    }

    /// An error if the link is dead and nothing more can arrive.
    fn check_live(&mut self) -> Result<()> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        if let Err(e) = self.ctrl.flush() {
            // A sender that closed normally may have shut its sockets
            // before our control reader saw its Close: wait for the verdict.
            self.health.await_verdict();
            if !self.health.peer_closed.load(Ordering::Acquire) {
                self.health.lost("sending credits", &e);
            }
        }
        if let Some(e) = self.health.error() {
            return Err(e);
        }
        if self.health.peer_closed.load(Ordering::Acquire)
            && self.shared.readers_done.load(Ordering::Acquire) == self.data.len()
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
        if let Err(e) = self.ctrl.credit(self.head) {
            // As in `check_live`: a normal close may still be on its way.
            self.health.await_verdict();
            if !self.health.peer_closed.load(Ordering::Acquire) {
                self.health.lost("sending a credit", &e);
            }
        }
        Ok(())
    }

    fn check_peer(&mut self) -> Result<()> {
        self.check_live()
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_owned());
            self.health.local_closing.store(true, Ordering::Release);
            self.ctrl.goodbye(CtrlKind::Abort, reason);
            for s in &self.data {
                shut(s);
            }
            shut(&self.ctrl.sock);
            self.wake_hands();
        }
    }

    fn direct(&mut self) -> Option<&mut dyn DirectRecv> {
        Some(self)
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
        if self.aborted.is_none() {
            self.health.local_closing.store(true, Ordering::Release);
            self.ctrl
                .goodbye(CtrlKind::Close, "the receiver closed its end");
            for s in &self.data {
                shut(s);
            }
            shut(&self.ctrl.sock);
        }
        self.wake_hands();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

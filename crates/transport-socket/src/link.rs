//! The data path of one connected link: the sending end, the receiving end
//! and their helper threads. See the crate docs for the protocol.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, IoSlice, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{Incoming, RecvChannel, SendChannel, SlotBuf};
use braid_core::types::MemKind;
use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, SockaddrStorage};

use crate::info::{ctrl_decode, ctrl_frame, CtrlKind, FrameHeader, CTRL_LEN};
use crate::sys::{self, SlotMem};
use crate::NAME;

/// Messages are striped over the data sockets in pieces of at least this
/// many bytes (NCCL's `NCCL_SOCKET_MIN_TASKSIZE`); smaller ones travel whole
/// on one socket.
pub const STRIPE_MIN: usize = 64 * 1024;

/// How long a helper that saw its socket fail waits for the control socket
/// to explain why (an abort reason or a normal close) before it reports
/// "connection lost".
const VERDICT_GRACE: Duration = Duration::from_millis(200);

/// A receiving helper's read buffer.
const READ_BUF: usize = 8 * 1024;

/// How long a blocking `read_remote` waits without a byte arriving.
const REMOTE_STALL: Duration = Duration::from_secs(60);

/// How long dropping a sender waits for queued pieces to leave.
const DROP_FLUSH: Duration = Duration::from_secs(1);

/// How long stopping a sender waits for a writer to leave a write on its
/// shut socket.
const WRITER_EXIT: Duration = Duration::from_secs(2);

/// Longest direct message (the frame header's lengths are 32-bit).
pub const MAX_DIRECT: usize = u32::MAX as usize;

/// Piece size for a message of `total` bytes over `nsocks` sockets.
pub fn piece_size(total: usize, nsocks: usize) -> usize {
    total
        .div_ceil(nsocks.max(1))
        .next_multiple_of(4096)
        .max(STRIPE_MIN)
}

/// Number of pieces of a message of `total` bytes (at least 1).
pub fn npieces(total: usize, nsocks: usize) -> usize {
    total.div_ceil(piece_size(total, nsocks)).max(1)
}

/// The pieces of message `seq` of `total` bytes: `(data socket, offset,
/// length)` in order.
pub fn stripes(
    seq: u64,
    total: usize,
    nsocks: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let piece = piece_size(total, nsocks);
    (0..npieces(total, nsocks)).map(move |j| {
        let offset = j * piece;
        (
            socket_of(seq, j, nsocks),
            offset,
            piece.min(total - offset.min(total)),
        )
    })
}

/// The data socket that carries piece `j` of message `seq`.
pub fn socket_of(seq: u64, j: usize, nsocks: usize) -> usize {
    ((seq % nsocks as u64) as usize + j) % nsocks
}

/// Locks, ignoring poisoning (no code holding these locks panics, and the
/// data they guard stays consistent at every unlock).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ------------------------------------------------------------------ health

#[derive(Debug)]
enum Fail {
    Lost {
        what: String,
        kind: io::ErrorKind,
        cause: String,
    },
    PeerAborted(String),
    Protocol(String),
}

#[derive(Debug, Default)]
struct HealthState {
    fail: Option<Fail>,
    /// The control reader has finished: it saw an abort, a close, EOF or an
    /// error.
    ctrl_finished: bool,
}

/// What one end knows about its link's liveness; shared with its helpers.
#[derive(Debug)]
struct Health {
    peer: u32,
    failed: AtomicBool,
    /// The peer closed its end normally (a `Close` control frame).
    peer_closed: AtomicBool,
    /// This end is shutting its sockets down (drop or abort): helpers exit
    /// quietly.
    local_closing: AtomicBool,
    st: Mutex<HealthState>,
    cv: Condvar,
}

impl Health {
    fn new(peer: u32) -> Arc<Health> {
        Arc::new(Health {
            peer,
            failed: AtomicBool::new(false),
            peer_closed: AtomicBool::new(false),
            local_closing: AtomicBool::new(false),
            st: Mutex::new(HealthState::default()),
            cv: Condvar::new(),
        })
    }

    fn fail(&self, f: Fail) {
        let mut st = lock(&self.st);
        let replace = match (&st.fail, &f) {
            (None, _) => true,
            // The peer's own reason beats our view of the broken socket.
            (Some(Fail::Lost { .. }), Fail::PeerAborted(_)) => true,
            _ => false,
        };
        if replace {
            if !matches!(f, Fail::PeerAborted(_)) {
                tracing::debug!(peer = self.peer, "socket link failed: {f:?}");
            }
            st.fail = Some(f);
            self.failed.store(true, Ordering::Release);
        }
        drop(st);
        self.cv.notify_all();
    }

    fn lost(&self, what: &str, e: &io::Error) {
        self.fail(Fail::Lost {
            what: what.to_owned(),
            kind: e.kind(),
            cause: e.to_string(),
        });
    }

    fn ctrl_finished(&self) {
        lock(&self.st).ctrl_finished = true;
        self.cv.notify_all();
    }

    /// A data helper saw its socket fail or close: give the control socket a
    /// moment to say why, unless we are closing ourselves.
    fn await_verdict(&self) {
        if self.local_closing.load(Ordering::Acquire) {
            return;
        }
        let st = lock(&self.st);
        let _unused = self
            .cv
            .wait_timeout_while(st, VERDICT_GRACE, |s| !s.ctrl_finished && s.fail.is_none());
    }

    fn error(&self) -> Option<CoreError> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        let st = lock(&self.st);
        let peer = self.peer;
        st.fail.as_ref().map(|f| match f {
            Fail::Lost { what, kind, cause } => CoreError::Peer {
                transport: NAME,
                peer,
                what: format!("connection lost: {what}: {cause}"),
                source: Some(Box::new(io::Error::new(*kind, cause.clone()))),
            },
            Fail::PeerAborted(reason) => CoreError::PeerAborted {
                transport: NAME,
                peer,
                reason: reason.clone(),
            },
            Fail::Protocol(detail) => CoreError::Protocol {
                peer,
                detail: format!("socket link: {detail}"),
            },
        })
    }
}

// ----------------------------------------------------------- socket helpers

fn is_retry(e: Errno) -> bool {
    e == Errno::EINTR
}

fn errno_io(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Writes all of `parts` (resuming `skip` bytes in) with `sendmsg`;
/// `MSG_NOSIGNAL` so a closed peer is an error, never SIGPIPE. With
/// `dontwait`, returns how far it got when the socket buffer is full.
fn send_parts(
    sock: &TcpStream,
    parts: &[&[u8]],
    mut skip: usize,
    dontwait: bool,
) -> io::Result<usize> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut flags = MsgFlags::MSG_NOSIGNAL;
    if dontwait {
        flags |= MsgFlags::MSG_DONTWAIT;
    }
    while skip < total {
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len());
        let mut s = skip;
        for p in parts {
            if s >= p.len() {
                s -= p.len();
            } else {
                iov.push(IoSlice::new(&p[s..]));
                s = 0;
            }
        }
        match nix::sys::socket::sendmsg::<SockaddrStorage>(sock.as_raw_fd(), &iov, &[], flags, None)
        {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "socket accepted no bytes",
                ))
            }
            Ok(n) => skip += n,
            Err(e) if is_retry(e) => {}
            Err(Errno::EAGAIN) if dontwait => return Ok(skip),
            Err(e) => return Err(errno_io(e)),
        }
    }
    Ok(skip)
}

/// Shuts a socket down both ways (wakes every thread blocked on it).
fn shut(s: &TcpStream) {
    let _ = s.shutdown(Shutdown::Both);
}

/// Reads exactly `buf.len()` bytes. `Ok(false)` on EOF before the first
/// byte (a clean close between frames).
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the socket in the middle of a frame",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Control-socket output of the API thread, written without blocking.
#[derive(Debug)]
struct CtrlOut {
    sock: TcpStream,
    pending: Vec<u8>,
    /// A credit is owed but could not be queued yet (cumulative, so only the
    /// latest value matters).
    credit_owed: Option<u64>,
}

impl CtrlOut {
    /// Sends what is pending; `Err` on a broken socket.
    fn flush(&mut self) -> io::Result<()> {
        loop {
            if self.pending.is_empty() {
                match self.credit_owed.take() {
                    Some(v) => self.pending = ctrl_frame(CtrlKind::Credit, v, &[]),
                    None => return Ok(()),
                }
            }
            let n = send_parts(&self.sock, &[&self.pending], 0, true)?;
            self.pending.drain(..n);
            if !self.pending.is_empty() {
                return Ok(()); // socket buffer full; try again later
            }
        }
    }

    fn credit(&mut self, released: u64) -> io::Result<()> {
        self.credit_owed = Some(released);
        self.flush()
    }

    /// Best effort: queue an abort or close frame behind what is pending and
    /// try to send it now; never blocks.
    fn goodbye(&mut self, kind: CtrlKind, reason: &str) {
        let _ = self.flush();
        self.credit_owed = None;
        self.pending.extend(ctrl_frame(kind, 0, reason.as_bytes()));
        let _ = self.flush();
        if !self.pending.is_empty() {
            // Give a busy socket a moment, never long.
            let until = Instant::now() + Duration::from_millis(50);
            while !self.pending.is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
                if self.flush().is_err() {
                    break;
                }
            }
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("cannot start a socket helper thread: {e}"),
        })
}

/// Handles a credit on the sender's control reader.
type OnCredit = Box<dyn FnMut(u64) -> std::result::Result<(), String> + Send>;

/// Checks a credit (cumulative slots released) against what this end
/// committed and what was released before.
fn check_credit(v: u64, old: u64, committed: u64) -> std::result::Result<(), String> {
    if v < old || v > committed {
        return Err(format!(
            "credit for {v} slots released, but {committed} were committed and {old} already released"
        ));
    }
    Ok(())
}

/// Reads control frames until the peer aborts, closes, or the socket fails.
/// `on_credit` handles credits (the sender's end); on the receiver's end a
/// credit is a protocol error.
fn ctrl_reader<R: Read>(
    sock: R,
    health: Arc<Health>,
    mut on_credit: Option<OnCredit>,
    closed_is_failure: bool,
) {
    let mut r = BufReader::with_capacity(4096, sock);
    loop {
        let mut hdr = [0u8; CTRL_LEN];
        let res = read_full(&mut r, &mut hdr).and_then(|more| {
            if !more {
                return Ok(None);
            }
            let (kind, len, value) =
                ctrl_decode(&hdr).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let mut payload = vec![0u8; len];
            if len > 0 && !read_full(&mut r, &mut payload)? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            Ok(Some((kind, value, payload)))
        });
        let closing = health.local_closing.load(Ordering::Acquire);
        match res {
            Ok(Some((CtrlKind::Credit, v, _))) => match on_credit.as_mut() {
                Some(f) => {
                    if let Err(e) = f(v) {
                        health.fail(Fail::Protocol(e));
                        break;
                    }
                }
                None => {
                    health.fail(Fail::Protocol("the sender sent a credit".into()));
                    break;
                }
            },
            Ok(Some((CtrlKind::Abort, _, reason))) => {
                let reason = String::from_utf8_lossy(&reason).into_owned();
                health.fail(Fail::PeerAborted(if reason.is_empty() {
                    "aborted (no reason given)".into()
                } else {
                    reason
                }));
                break;
            }
            Ok(Some((CtrlKind::Close, _, _))) => {
                health.peer_closed.store(true, Ordering::Release);
                if closed_is_failure {
                    health.fail(Fail::PeerAborted("the receiver closed its end".into()));
                }
                break;
            }
            Ok(None) => {
                if !closing && !health.peer_closed.load(Ordering::Acquire) {
                    health.fail(Fail::Lost {
                        what: "the control socket was closed (peer process exited?)".into(),
                        kind: io::ErrorKind::UnexpectedEof,
                        cause: "end of stream".into(),
                    });
                }
                break;
            }
            Err(e) => {
                if !closing && !health.peer_closed.load(Ordering::Acquire) {
                    if e.kind() == io::ErrorKind::InvalidData {
                        health.fail(Fail::Protocol(format!("control socket: {e}")));
                    } else {
                        health.lost("control socket", &e);
                    }
                }
                break;
            }
        }
    }
    health.ctrl_finished();
}

// ------------------------------------------------------------------- sender

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

    fn can_send_direct(&mut self) -> bool {
        self.direct
    }

    fn direct_costs_receiver(&mut self) -> bool {
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

// ----------------------------------------------------------------- receiver

#[derive(Debug, Default)]
struct Fill {
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
struct Hand {
    st: Mutex<HandState>,
    cv: Condvar,
}

struct RecvShared {
    mem: SlotMem,
    slots: usize,
    nsocks: usize,
    slot_bytes: usize,
    /// `seq + 1` once message `seq` is complete in slot `seq % slots`; 0
    /// while the slot is free or filling.
    ready: Box<[AtomicU64]>,
    lens: Box<[AtomicUsize]>,
    /// The ready message in the slot is direct (its payload is still in the
    /// sockets).
    remote: Box<[AtomicBool]>,
    fill: Box<[Mutex<Fill>]>,
    /// Per data socket.
    hands: Box<[Hand]>,
    /// Direct messages may arrive (not in the fuzzing harness, which has no
    /// engine to read them).
    accept_direct: bool,
    /// Slots released by the engine (cumulative).
    released: AtomicU64,
    /// Data readers that saw a clean end of stream.
    readers_done: AtomicUsize,
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

fn reader<R: Read>(sock: R, sh: Arc<RecvShared>, health: Arc<Health>, idx: usize) {
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
    /// As for [`RecvChannel::poll_read_remote`].
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

    unsafe fn poll_read_remote(&mut self, dst: *mut u8, len: usize) -> Result<bool> {
        // SAFETY: forwarded from this function's contract.
        Ok(unsafe { self.pump(dst, len)? }.is_none())
    }

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

// ----------------------------------------------------------------- fuzzing

/// A receiving end's stream readers over plain bytes, for the fuzz targets
/// in `fuzz/`. Not part of the API.
pub(crate) mod fuzzing {
    use super::*;

    /// Runs a receiving end's data-socket readers, one after the other,
    /// over `streams` (one per data socket, in index order), with `slots`
    /// slots of `slot_bytes` and no slot released by the engine. Returns the
    /// messages published, `(seq, bytes)` by slot, and the failure reported.
    #[allow(clippy::type_complexity)]
    pub fn data_streams(
        streams: &[&[u8]],
        slot_bytes: usize,
        slots: usize,
    ) -> std::result::Result<(Vec<(u64, Vec<u8>)>, Option<String>), String> {
        let nsocks = streams.len();
        crate::info::check_geometry(slot_bytes, slots, nsocks)?;
        let sh = Arc::new(RecvShared {
            mem: SlotMem::new(slot_bytes, slots)?,
            slots,
            nsocks,
            slot_bytes,
            ready: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            lens: (0..slots).map(|_| AtomicUsize::new(0)).collect(),
            remote: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            fill: (0..slots).map(|_| Mutex::new(Fill::default())).collect(),
            hands: (0..nsocks).map(|_| Hand::default()).collect(),
            accept_direct: false,
            released: AtomicU64::new(0),
            readers_done: AtomicUsize::new(0),
        });
        let health = Health::new(0);
        // No control socket here: nobody to wait for at the end.
        health.ctrl_finished();
        for (idx, stream) in streams.iter().enumerate() {
            reader(io::Cursor::new(*stream), sh.clone(), health.clone(), idx);
        }
        let mut out = Vec::new();
        for slot in 0..slots {
            let r = sh.ready[slot].load(Ordering::Acquire);
            if r != 0 {
                let len = sh.lens[slot].load(Ordering::Relaxed);
                // SAFETY: every reader has returned; nothing else touches
                // the slot memory.
                let b = unsafe { sh.mem.slice(slot, 0, len) };
                out.push((r - 1, b.to_vec()));
            }
        }
        Ok((out, health.error().map(|e| e.to_string())))
    }

    /// Runs a control-socket reader over `stream`: a sender's (credits are
    /// checked against `committed` slots) or, with `None`, a receiver's.
    /// Returns the credits accepted, whether the peer closed, and the
    /// failure reported.
    pub fn ctrl_stream(stream: &[u8], committed: Option<u64>) -> (Vec<u64>, bool, Option<String>) {
        let health = Health::new(0);
        let credits = Arc::new(Mutex::new(Vec::new()));
        let on_credit: Option<OnCredit> = committed.map(|c| {
            let credits = credits.clone();
            Box::new(move |v: u64| {
                let mut got = lock(&credits);
                check_credit(v, got.last().copied().unwrap_or(0), c)?;
                got.push(v);
                Ok(())
            }) as OnCredit
        });
        ctrl_reader(
            io::Cursor::new(stream),
            health.clone(),
            on_credit,
            committed.is_some(),
        );
        let got = lock(&credits).clone();
        (
            got,
            health.peer_closed.load(Ordering::Acquire),
            health.error().map(|e| e.to_string()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striping_rule_covers_every_byte_once() {
        for n in 1..=8 {
            for total in [
                0usize,
                1,
                4095,
                65536,
                65537,
                200_000,
                512 * 1024,
                4 << 20,
                3 * 65536 + 5,
            ] {
                let piece = piece_size(total, n);
                assert!(piece >= STRIPE_MIN);
                let k = npieces(total, n);
                assert!(k <= n, "{total} over {n}: {k} pieces");
                let mut covered = 0;
                let mut socks = Vec::new();
                for j in 0..k {
                    let off = j * piece;
                    let len = piece.min(total - off.min(total));
                    assert_eq!(off, covered);
                    covered += len;
                    socks.push(socket_of(7, j, n));
                }
                assert_eq!(covered, total);
                socks.sort_unstable();
                socks.dedup();
                assert_eq!(socks.len(), k, "pieces share a socket");
            }
        }
        // Small messages rotate over the sockets.
        let used: Vec<usize> = (0..4).map(|s| socket_of(s, 0, 4)).collect();
        assert_eq!(used, vec![0, 1, 2, 3]);
    }
}

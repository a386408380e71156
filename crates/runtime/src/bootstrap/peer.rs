//! The rank-to-rank layer of the bootstrap (protocol v3): every rank
//! listens on a socket of its own; the ranks form a ring (each connects to
//! its successor, whose address the root handed out) and all-gather round
//! it, so the root sends O(p) bytes in all; and any two ranks exchange
//! messages point to point ([`Peers::exchange`]: the lower rank connects
//! to the higher, sends its message and reads the answer on the same
//! connection), which is how links connect on first use.
//!
//! Every frame between ranks carries a proof of the job's secret
//! ([`PeerFrame`]); a connection whose first frame does not prove it is
//! dropped. Every wait has a deadline and looks at the abort flag; a rank
//! that is gone is named: its ring connection ends (and the root, which
//! sees its connection end too, says who left), or connecting to its
//! listener is refused.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};

use super::door::{first_frame, AfterFailure, Door, FirstFrame};
use super::exchange::{gone_msg, Ask, Exchange, ExchangeError};
use super::id::random_bytes;
use super::ring::Ring;
use super::warnings::Level;
use super::wire::{FrameBuf, PeerFrame, K_ERROR, K_LEFT, K_PROBE, K_RING_HELLO, MAX_PEER_FRAME};
use super::{fmt_dur, poll_ms, remaining};
use crate::error::{Error, Result};

/// Connections to a rank's listener whose first frame is still arriving,
/// at most (the oldest makes room); fewer in a process allowed fewer than
/// eight times as many descriptors.
const MAX_ARRIVALS: usize = 256;
/// How long a connection may take to send its first frame.
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest single wait in a loop (the abort flag is looked at between).
const TICK: Duration = Duration::from_millis(50);
/// How long a probe waits for a rank's listener to take its connection.
const PROBE_WAIT: Duration = Duration::from_millis(100);
/// The listener's backlog (the kernel caps it at `somaxconn`): every rank
/// of a large job may connect to one rank at once.
const BACKLOG: i32 = 4096;
/// Bytes read from a socket at a time.
const READ_BUF: usize = 64 << 10;
/// The pause before connecting again when the process is out of
/// descriptors.
const DIAL_PAUSE: Duration = Duration::from_millis(20);

/// A connection to our listener whose first frame is arriving.
struct Arrival {
    sock: TcpStream,
    buf: FrameBuf,
    since: Instant,
}

/// A proven exchange request, waiting for this rank to want it.
struct Request {
    sock: TcpStream,
    nonce: [u8; 16],
    payload: Vec<u8>,
}

/// The root connection, watched while a round waits on the ring: the root
/// says why a round failed (a rank left, a rank is late).
pub(super) struct RootWatch<'a> {
    pub stream: &'a mut TcpStream,
    pub addr: SocketAddr,
    pub rbuf: FrameBuf,
    /// The root's last word was [`K_LEFT`]: a rank left after its last
    /// round, which fails no round under way.
    pub left: bool,
}

impl RootWatch<'_> {
    /// Reads what the root sent (the stream is readable): its error, or
    /// "closed".
    fn read(&mut self, what: &str) -> Error {
        let mut b = [0u8; 4096];
        loop {
            match self.stream.read(&mut b) {
                Ok(0) => {
                    return Error::Bootstrap(format!(
                        "the bootstrap root at {} closed the connection while {what} (did the \
                         root process exit?)",
                        self.addr
                    ))
                }
                Ok(n) => {
                    self.rbuf.buf.extend_from_slice(&b[..n]);
                    match self.rbuf.next_frame() {
                        Ok(Some((k @ (K_ERROR | K_LEFT), body))) => {
                            self.left = k == K_LEFT;
                            return Error::Bootstrap(format!(
                                "{} (reported by the bootstrap root at {})",
                                String::from_utf8_lossy(&body),
                                self.addr
                            ));
                        }
                        Ok(Some((kind, _))) => {
                            return Error::Bootstrap(format!(
                                "the bootstrap root at {} sent an unexpected message (kind \
                                 {kind}) while {what} (protocol error)",
                                self.addr
                            ))
                        }
                        Ok(None) => {
                            // Only part of a frame: the rest follows at once.
                            let _ = self.stream.set_read_timeout(Some(TICK));
                        }
                        Err(e) => {
                            return Error::Bootstrap(format!(
                                "the bootstrap root at {} sent garbage ({e}) while {what}",
                                self.addr
                            ))
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Error::BootstrapIo {
                        what: format!(
                            "reading from the bootstrap root at {} while {what}",
                            self.addr
                        ),
                        source: e,
                    }
                }
            }
        }
    }
}

/// A rank's listener, its ring connections, and the requests other ranks
/// sent it.
pub(super) struct Peers {
    rank: u32,
    nranks: u32,
    secret: [u8; 16],
    listener: TcpListener,
    /// This rank's listening address.
    pub addr: SocketAddr,
    /// Every rank's listening address (after the first round).
    pub addrs: Vec<SocketAddr>,
    /// To the successor.
    next: Option<TcpStream>,
    /// From the predecessor.
    prev: Option<TcpStream>,
    /// The rounds on the ring (`ring.rs`).
    ring: Ring,
    /// The listener's policy (`door.rs`).
    door: Door,
    arrivals: Vec<Arrival>,
    /// Connections still sending their first frame held at most.
    max_arrivals: usize,
    /// A proven ring hello from the predecessor, before the ring is up,
    /// and the bytes that followed it.
    early_prev: Option<(TcpStream, Vec<u8>)>,
    requests: BTreeMap<(u32, u64), Request>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("rank", &self.rank)
            .field("addr", &self.addr)
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

fn io_err(what: String) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::BootstrapIo { what, source }
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::TimedOut
    )
}

/// The ranks of `addrs` (other than `me`) whose listener refuses
/// connections, or does not answer within `wait`; several probed at once.
pub(super) fn gone(addrs: &[SocketAddr], me: u32, wait: Duration) -> Vec<u32> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..addrs.len().clamp(1, 16) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(addr) = addrs.get(i) else { break };
                if i as u32 == me {
                    continue;
                }
                if knock(addr, wait).is_err() {
                    if let Ok(mut o) = out.lock() {
                        o.push(i as u32);
                    }
                }
            });
        }
    });
    let mut v = out.into_inner().unwrap_or_default();
    v.sort_unstable();
    v
}

/// Connects to a rank's listener within `wait` and says it is a probe (the
/// listener drops it): an error if nothing listens there any more
/// (refused) or the host does not answer in time.
fn knock(addr: &SocketAddr, wait: Duration) -> io::Result<()> {
    let mut s = TcpStream::connect_timeout(addr, wait)?;
    let _ = s.set_nonblocking(true);
    let _ = s.write(&super::wire::frame_header(K_PROBE, 0));
    Ok(())
}

/// Writes what is left of `buf` from `*at` without blocking; `Ok(true)`
/// once all of it is out.
fn flush(sock: &mut TcpStream, buf: &[u8], at: &mut usize) -> io::Result<bool> {
    while *at < buf.len() {
        match sock.write(&buf[*at..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *at += n,
            Err(e) if would_block(&e) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads what is there into `buf` without blocking: `Ok(false)` at the end
/// of the stream.
fn fill(sock: &mut TcpStream, buf: &mut FrameBuf) -> io::Result<bool> {
    let mut b = vec![0u8; READ_BUF];
    loop {
        match sock.read(&mut b) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                buf.buf.extend_from_slice(&b[..n]);
                if n < b.len() {
                    return Ok(true);
                }
            }
            Err(e) if would_block(&e) => return Ok(true),
            Err(e) => return Err(e),
        }
    }
}

fn poll(fds: &mut [PollFd<'_>], wait: Duration) -> Result<()> {
    match nix::poll::poll(fds, poll_ms(wait)) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(Error::BootstrapIo {
            what: "poll in the bootstrap".into(),
            source: e.into(),
        }),
    }
}

fn readable(fd: &PollFd<'_>) -> bool {
    fd.revents().is_some_and(|r| !r.is_empty())
}

impl Peers {
    /// Listens on `ip` (the address this rank reaches the root from, which
    /// the other ranks reach it at), port 0.
    pub(super) fn bind(rank: u32, nranks: u32, secret: [u8; 16], ip: IpAddr) -> Result<Peers> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(io_err(format!(
            "rank {rank}: cannot listen on {ip} for other ranks"
        )))?;
        // A larger backlog than std's: every rank may connect at once.
        let _ = nix::sys::socket::listen(
            &listener,
            nix::sys::socket::Backlog::new(BACKLOG).unwrap_or(nix::sys::socket::Backlog::MAXCONN),
        );
        listener
            .set_nonblocking(true)
            .map_err(io_err("a nonblocking bootstrap listener".into()))?;
        let addr = listener
            .local_addr()
            .map_err(io_err("the bootstrap listener's address".into()))?;
        Ok(Peers {
            rank,
            nranks,
            secret,
            listener,
            addr,
            addrs: Vec::new(),
            next: None,
            prev: None,
            ring: Ring::new(rank, nranks),
            door: Door::new(rank),
            arrivals: Vec::new(),
            max_arrivals: ((super::fd_limit() / 8) as usize).clamp(8, MAX_ARRIVALS),
            early_prev: None,
            requests: BTreeMap::new(),
        })
    }

    fn prev_rank(&self) -> u32 {
        (self.rank + self.nranks - 1) % self.nranks
    }

    fn next_rank(&self) -> u32 {
        (self.rank + 1) % self.nranks
    }

    fn nonce() -> Result<[u8; 16]> {
        random_bytes()
    }

    fn stranger(&mut self, why: &str) {
        self.door.handle_stranger(Instant::now(), why);
        self.emit_logs();
    }

    /// Emits what the listener's policy has to say.
    fn emit_logs(&mut self) {
        while let Some(line) = self.door.poll_log() {
            match line.level {
                Level::Warn => tracing::warn!(rank = self.rank, "{}", line.msg),
                Level::Debug => tracing::debug!(rank = self.rank, "{}", line.msg),
            }
        }
    }

    /// How long a wait that would end after `wait` may last so that the
    /// listener's paused `accept` resumes (and its counts are said) on time.
    fn door_wait(&self, now: Instant, wait: Duration) -> Duration {
        self.door
            .poll_timeout()
            .map_or(wait, |t| wait.min(t.saturating_duration_since(now)))
    }

    /// Accepts what is queued (unless `accept` is paused after failing)
    /// and reads the first frames that are arriving; files proven ring
    /// hellos and exchange requests, drops the rest.
    fn pump(&mut self) {
        let now = Instant::now();
        self.door.handle_timeout(now);
        while self.door.accepting(now) {
            match self.listener.accept() {
                Ok((sock, _)) => {
                    self.door.handle_accepted();
                    if sock.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if self.arrivals.len() >= self.max_arrivals {
                        self.arrivals.remove(0);
                    }
                    self.arrivals.push(Arrival {
                        sock,
                        buf: FrameBuf::default(),
                        since: now,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // ECONNABORTED: that connection is lost, its sender will say.
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    let oldest = self.arrivals.first().map(|a| a.since);
                    let after =
                        self.door
                            .handle_accept_failed(now, out_of_fds(&e), &e.to_string(), oldest);
                    if after == AfterFailure::EvictOldest && !self.arrivals.is_empty() {
                        self.arrivals.remove(0);
                    }
                    if matches!(after, AfterFailure::Pause(_)) {
                        break;
                    }
                }
            }
        }
        self.emit_logs();
        let mut i = 0;
        while i < self.arrivals.len() {
            let a = &mut self.arrivals[i];
            let open = fill(&mut a.sock, &mut a.buf).unwrap_or(false);
            let frame = a.buf.next_frame();
            let done = match frame {
                Ok(Some(f)) => Some(Ok(f)),
                Ok(None) if !open => Some(Err(String::new())),
                Ok(None) if now.duration_since(a.since) >= ARRIVAL_TIMEOUT => Some(Err(format!(
                    "no complete first frame within {}",
                    fmt_dur(ARRIVAL_TIMEOUT)
                ))),
                Ok(None) if a.buf.buf.len() > MAX_PEER_FRAME + 5 => {
                    Some(Err("a first frame over the limit".into()))
                }
                Ok(None) => None,
                Err(e) => Some(Err(e)),
            };
            let Some(done) = done else {
                i += 1;
                continue;
            };
            let a = self.arrivals.swap_remove(i);
            match done {
                Ok((kind, body)) => self.file(a.sock, kind, &body, a.buf.buf),
                // A probe or a sender that gave up: nothing to say.
                Err(e) if e.is_empty() => {}
                Err(e) => self.stranger(&e),
            }
        }
    }

    /// Files one connection by its first frame (the policy in `door.rs`).
    fn file(&mut self, sock: TcpStream, kind: u8, body: &[u8], rest: Vec<u8>) {
        let ring_open = self.prev.is_none();
        match first_frame(self.rank, self.nranks, &self.secret, ring_open, kind, body) {
            FirstFrame::Probe => {}
            // The ring's first round may follow at once.
            FirstFrame::RingHello => self.early_prev = Some((sock, rest)),
            FirstFrame::Request {
                from,
                tag,
                nonce,
                payload,
            } => {
                self.requests.insert(
                    (from, tag),
                    Request {
                        sock,
                        nonce,
                        payload,
                    },
                );
            }
            FirstFrame::Stranger(why) => self.stranger(&why),
        }
    }

    fn listener_fd(&self) -> PollFd<'_> {
        PollFd::new(self.listener.as_fd(), PollFlags::POLLIN)
    }

    /// Connects to the successor at `next_addr`, says who we are, and waits
    /// for the predecessor's connection.
    pub(super) fn setup_ring(
        &mut self,
        next_addr: SocketAddr,
        deadline: Instant,
        root: &mut RootWatch<'_>,
        abort: Option<&AtomicBool>,
    ) -> Result<()> {
        if self.nranks == 1 {
            return Ok(());
        }
        let next = self.next_rank();
        let what = format!(
            "connecting the bootstrap ring (rank {} of {})",
            self.rank, self.nranks
        );
        let mut sock = self
            .dial(next, next_addr, deadline, abort)
            .map_err(Error::from)?;
        let hello = PeerFrame::sealed(
            K_RING_HELLO,
            &self.secret,
            self.rank,
            next,
            u64::from(self.nranks),
            Self::nonce()?,
            &[],
        );
        let mut at = 0;
        loop {
            match flush(&mut sock, &hello, &mut at) {
                Ok(true) => break,
                Ok(false) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => {
                    return Err(Error::Bootstrap(format!(
                    "rank {next} closed its bootstrap connection while {what} ({e}); did it exit?"
                )))
                }
            }
            if remaining(deadline).is_none() {
                return Err(Error::Bootstrap(format!(
                    "rank {next} did not take the ring connection within the timeout while {what}"
                )));
            }
        }
        self.next = Some(sock);
        let prev = self.prev_rank();
        loop {
            self.pump();
            if let Some((s, rest)) = self.early_prev.take() {
                self.prev = Some(s);
                self.ring.handle_data(Instant::now(), &rest);
                return Ok(());
            }
            if abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                return Err(Error::Unusable(format!(
                    "aborted by the caller while {what}"
                )));
            }
            let Some(left) = remaining(deadline) else {
                return Err(Error::Bootstrap(format!(
                    "rank {prev} did not connect to rank {} within the timeout while {what}",
                    self.rank
                )));
            };
            let now = Instant::now();
            let mut fds = vec![PollFd::new(root.stream.as_fd(), PollFlags::POLLIN)];
            if self.door.accepting(now) {
                fds.push(self.listener_fd());
            }
            for a in &self.arrivals {
                fds.push(PollFd::new(a.sock.as_fd(), PollFlags::POLLIN));
            }
            poll(&mut fds, self.door_wait(now, left.min(TICK)))?;
            let root_said = readable(&fds[0]);
            drop(fds);
            if root_said {
                return Err(root.read(&what));
            }
        }
    }

    /// Connects to rank `peer` at `addr`: refused means it is gone.
    fn dial(
        &self,
        peer: u32,
        addr: SocketAddr,
        deadline: Instant,
        abort: Option<&AtomicBool>,
    ) -> std::result::Result<TcpStream, ExchangeError> {
        let start = Instant::now();
        loop {
            if abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                return Err(ExchangeError::Aborted);
            }
            let Some(left) = remaining(deadline) else {
                return Err(ExchangeError::Peer {
                    peer,
                    what: format!(
                        "rank {peer} could not be reached at its bootstrap address {addr} within {}",
                        fmt_dur(start.elapsed())
                    ),
                    timed_out: Some(start.elapsed()),
                });
            };
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    s.set_nonblocking(true)
                        .map_err(|e| ExchangeError::Local(io_err("nonblocking".into())(e)))?;
                    return Ok(s);
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    return Err(ExchangeError::Peer {
                        peer,
                        what: gone_msg(peer, addr),
                        timed_out: None,
                    })
                }
                Err(e) if would_block(&e) => {}
                Err(e) if out_of_fds(&e) => {
                    // Descriptors may come free (a root closing strangers):
                    // try again within the deadline, then say why.
                    if remaining(deadline).is_none_or(|l| l <= DIAL_PAUSE) {
                        return Err(ExchangeError::Local(Error::Bootstrap(format!(
                            "rank {}: cannot connect to rank {peer} at {addr}: {e}; this process \
                             is out of file descriptors (limit {}): raise it (`ulimit -n`) or \
                             close what holds them",
                            self.rank,
                            super::fd_limit()
                        ))));
                    }
                    std::thread::sleep(DIAL_PAUSE);
                }
                Err(e) => {
                    return Err(ExchangeError::Peer {
                        peer,
                        what: format!("rank {peer} cannot be reached at {addr}: {e}"),
                        timed_out: None,
                    })
                }
            }
        }
    }

    /// One all-gather round over the ring (the machine in `ring.rs`):
    /// sends `data` on, forwards what arrives from the predecessor, until
    /// every rank's contribution is here (in rank order).
    ///
    /// Watches the root too: when it reports a failure (a rank that left,
    /// a rank late for the round), the round still completes if the ring
    /// keeps moving (the ranks of a finished job leave one by one, each
    /// after its last round, while others finish theirs); once the ring
    /// stands still for `grace`, or the predecessor's connection ends, the
    /// root's word is the error. It is kept for the next round. `since`:
    /// when the caller began to wait (for the messages).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ring_allgather(
        &mut self,
        round: u64,
        data: &[u8],
        since: Instant,
        deadline: Instant,
        grace: Duration,
        root: &mut RootWatch<'_>,
        abort: Option<&AtomicBool>,
    ) -> Result<Vec<Vec<u8>>> {
        let what = format!(
            "in bootstrap round {round} (rank {} of {})",
            self.rank, self.nranks
        );
        self.ring
            .start(Instant::now(), round, data, since, deadline + grace, grace);
        let mut chunk = vec![0u8; READ_BUF];
        loop {
            if let Some(o) = self.ring.poll_outcome() {
                return o.map_err(Error::Bootstrap);
            }
            let now = Instant::now();
            // Out to the successor.
            if let Some(s) = self.next.as_mut() {
                let out = self.ring.transmit();
                if !out.is_empty() {
                    let failed = match s.write(out) {
                        Ok(0) => Some("wrote nothing".to_string()),
                        Ok(n) => {
                            self.ring.handle_sent(now, n);
                            None
                        }
                        Err(e) if would_block(&e) => None,
                        Err(e) => Some(e.to_string()),
                    };
                    if let Some(e) = failed {
                        self.ring.handle_send_failed(now, &e);
                        // A broken socket polls ready for ever: stop
                        // watching it while the root's word is awaited.
                        self.next = None;
                    }
                }
            }
            // In from the predecessor.
            let mut ended = false;
            match self.prev.as_mut() {
                None => self.ring.handle_prev_closed(now),
                Some(s) => loop {
                    match s.read(&mut chunk) {
                        Ok(0) => {
                            ended = true;
                            break;
                        }
                        Ok(n) => {
                            self.ring.handle_data(now, &chunk[..n]);
                            if n < chunk.len() {
                                break;
                            }
                        }
                        Err(e) if would_block(&e) => break,
                        Err(_) => {
                            ended = true;
                            break;
                        }
                    }
                },
            }
            if ended {
                self.ring.handle_prev_closed(now);
                // Its end of stream polls ready for ever: stop watching it.
                self.prev = None;
            }
            self.ring.handle_timeout(now);
            if self.ring.has_outcome() {
                continue;
            }
            if abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                return Err(Error::Unusable(format!("aborted by the caller {what}")));
            }
            let wake = self
                .ring
                .poll_timeout()
                .map_or(TICK, |t| t.saturating_duration_since(now))
                .min(TICK);
            let watch_root = self.ring.wants_root();
            let send = !self.ring.transmit().is_empty();
            let mut fds = Vec::with_capacity(4);
            let listen = self.door.accepting(now);
            if listen {
                fds.push(self.listener_fd());
            }
            if watch_root {
                fds.push(PollFd::new(root.stream.as_fd(), PollFlags::POLLIN));
            }
            if let Some(s) = self.prev.as_ref() {
                fds.push(PollFd::new(s.as_fd(), PollFlags::POLLIN));
            }
            if let (Some(s), true) = (self.next.as_ref(), send) {
                fds.push(PollFd::new(s.as_fd(), PollFlags::POLLOUT));
            }
            poll(&mut fds, self.door_wait(now, wake))?;
            let listener_ready = listen && readable(&fds[0]);
            let root_ready = watch_root && readable(&fds[usize::from(listen)]);
            drop(fds);
            if root_ready {
                let word = match root.read(&what) {
                    Error::Bootstrap(m) => m,
                    e => e.to_string(),
                };
                self.ring.handle_root(Instant::now(), word, root.left);
            }
            if listener_ready || !self.arrivals.is_empty() || self.door.poll_timeout().is_some() {
                self.pump();
            }
        }
    }

    /// What the root reported in an earlier round (its connection is gone
    /// since): every later round fails with it.
    pub(super) fn root_said(&self) -> Option<&str> {
        self.ring.root_said()
    }

    /// Exchanges one message with each peer of `asks` (none twice): the
    /// lower rank of each pair connects and sends, the higher answers on the
    /// same connection. Returns the peers' messages in the order of `asks`.
    /// Waits for all of them together, so ranks that need each other in any
    /// order all get through; a peer that is gone is named at once (with
    /// the other peers of the exchange that are gone too), one that does
    /// not answer within `deadline` is named then. The machine in
    /// `exchange.rs` decides; this drives it with sockets and the clock.
    pub(super) fn exchange(
        &mut self,
        asks: &[Ask],
        deadline: Instant,
        abort: Option<&AtomicBool>,
    ) -> std::result::Result<Vec<Vec<u8>>, ExchangeError> {
        let mut x = Exchange::new(
            self.rank,
            self.nranks,
            self.secret,
            &self.addrs,
            asks,
            Instant::now(),
            deadline,
        )?;
        let mut socks: Vec<Option<TcpStream>> = asks.iter().map(|_| None).collect();
        while let Some((i, peer, addr)) = x.poll_dial() {
            match self.dial(peer, addr, deadline, abort) {
                Ok(sock) => match Self::nonce() {
                    Ok(nonce) => {
                        socks[i] = Some(sock);
                        x.handle_connected(i, nonce);
                    }
                    Err(e) => x.handle_dial_failed(ExchangeError::Local(e)),
                },
                Err(e) => x.handle_dial_failed(e),
            }
        }
        loop {
            self.pump();
            self.exchange_io(&mut x, &mut socks);
            if abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                x.handle_abort();
            }
            x.handle_timeout(Instant::now());
            // Ranks we wait for (or, after a failure, the others): still
            // there?
            while let Some((peer, addr)) = x.poll_probe() {
                let refused = matches!(
                    knock(&addr, PROBE_WAIT),
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused
                );
                x.handle_probe(peer, refused);
            }
            if let Some(o) = x.poll_outcome() {
                return o;
            }
            let now = Instant::now();
            let mut fds = Vec::new();
            if self.door.accepting(now) {
                fds.push(self.listener_fd());
            }
            for a in &self.arrivals {
                fds.push(PollFd::new(a.sock.as_fd(), PollFlags::POLLIN));
            }
            for (i, sock) in socks.iter().enumerate() {
                let Some(sock) = sock else { continue };
                let mut f = PollFlags::empty();
                if x.wants_read(i) {
                    f |= PollFlags::POLLIN;
                }
                if !x.transmit(i).is_empty() {
                    f |= PollFlags::POLLOUT;
                }
                if !f.is_empty() {
                    fds.push(PollFd::new(sock.as_fd(), f));
                }
            }
            let wait = x
                .poll_timeout()
                .map_or(TICK, |t| t.saturating_duration_since(now))
                .min(TICK);
            poll(&mut fds, self.door_wait(now, wait)).map_err(ExchangeError::Local)?;
        }
    }

    /// One pass of an exchange over its connections, in the order of its
    /// asks: hands the machine the requests it waits for, writes what it
    /// has to send, reads the answers, drops the connections it is done
    /// with.
    fn exchange_io(&mut self, x: &mut Exchange<'_>, socks: &mut [Option<TcpStream>]) {
        for i in 0..socks.len() {
            if let Some(key) = x.wants_request(i) {
                if let Some(r) = self.requests.remove(&key) {
                    socks[i] = Some(r.sock);
                    x.handle_request(i, r.nonce, r.payload);
                }
            }
            let Some(sock) = socks[i].as_mut() else {
                continue;
            };
            let out = x.transmit(i);
            if !out.is_empty() {
                let mut at = 0;
                let r = flush(sock, out, &mut at);
                x.handle_sent(i, at);
                if let Err(e) = r {
                    x.handle_closed(i, Some(e.to_string()));
                }
            }
            if x.wants_read(i) {
                let mut got = FrameBuf::default();
                match fill(sock, &mut got) {
                    Err(e) => x.handle_closed(i, Some(e.to_string())),
                    Ok(open) => {
                        x.handle_data(i, &got.buf);
                        if !open {
                            x.handle_closed(i, None);
                        }
                    }
                }
            }
            while let Some(c) = x.poll_close() {
                if let Some(s) = socks[c.slot].take() {
                    if c.shutdown {
                        let _ = s.shutdown(Shutdown::Write);
                    }
                }
            }
        }
    }

    /// Shuts the ring connections (after a failed round): the neighbours
    /// see it at once.
    pub(super) fn shut_ring(&mut self) {
        for s in [self.next.as_ref(), self.prev.as_ref()]
            .into_iter()
            .flatten()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Whether `accept` or `connect` failed for want of descriptors or memory
/// (closing something helps, retrying at once does not).
pub(super) fn out_of_fds(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

impl Drop for Peers {
    fn drop(&mut self) {
        self.door.handle_close(Instant::now());
        self.emit_logs();
    }
}

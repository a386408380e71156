//! The root's socket driver: a thin loop that polls the listener and the
//! connections, accepts, reads and writes without blocking, and feeds the
//! pure [`Rendezvous`] machine what happened. It holds each connection's
//! queue of bytes to write and closes connections gently (what is queued
//! goes out first, then a FIN, then a short wait for the peer's).
//!
//! Once the machine has finished, the driver delivers what it queued (the
//! error frames that say why) within [`LINGER`] before the thread ends;
//! [`Shared`] lets the [`super::RootServer`] wait for that delivery when it
//! is dropped, so that an owner that exits right after its own rank got the
//! error does not cut the others' messages off.

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::id::random_bytes;
use super::poll_ms;
use super::rendezvous::{AcceptFailure, ConnId, Level, Rendezvous};
use super::wire::READ_CHUNK;
use crate::error::{Error, Result};

/// How long the root keeps delivering its last messages once it has
/// finished (at most the bootstrap timeout).
pub(crate) const LINGER: Duration = Duration::from_secs(2);
/// How long a connection closed during the run may take to read what it
/// was told and hang up.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// Connections accepted at most per wake-up (the others wait a turn).
const ACCEPT_BATCH: usize = 64;

/// Where the root's thread is, for its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Running the rendezvous.
    Serving,
    /// Finished; delivering the last messages until then at the latest.
    Delivering { until: Instant },
    /// The thread is done.
    Ended,
}

/// The root thread's phase, shared with its [`super::RootServer`].
#[derive(Debug)]
pub(crate) struct Shared {
    phase: Mutex<Phase>,
    cv: Condvar,
}

impl Shared {
    pub(super) fn new() -> Arc<Shared> {
        Arc::new(Shared {
            phase: Mutex::new(Phase::Serving),
            cv: Condvar::new(),
        })
    }

    fn set(&self, p: Phase) {
        let mut g = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if *g != Phase::Ended {
            *g = p;
        }
        self.cv.notify_all();
    }

    /// The phase now.
    pub(super) fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits while the root delivers its last messages (bounded by their
    /// deadline and a little more); returns at once while it serves.
    pub(super) fn wait_delivered(&self) {
        let mut g = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let until = match *g {
                Phase::Delivering { until } => until + Duration::from_millis(200),
                Phase::Serving | Phase::Ended => return,
            };
            let Some(left) = super::remaining(until) else {
                return;
            };
            g = match self.cv.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

/// Marks the thread ended however it leaves (a panic included).
struct EndGuard(Arc<Shared>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        let mut g = self.0.phase.lock().unwrap_or_else(|e| e.into_inner());
        *g = Phase::Ended;
        self.0.cv.notify_all();
    }
}

/// One connection's socket and what is queued for it.
#[derive(Debug)]
struct Sock {
    stream: TcpStream,
    out: VecDeque<Arc<[u8]>>,
    /// Bytes of `out.front()` already written.
    sent: usize,
    /// Closing: give up on it then.
    closing: Option<Instant>,
    /// Our side is shut for writing: waiting for the peer's FIN.
    write_shut: bool,
}

impl Sock {
    /// Writes what it can without blocking. `Err`: the connection broke.
    fn flush(&mut self) -> io::Result<()> {
        let mut s = &self.stream;
        while let Some(front) = self.out.front() {
            match s.write(&front[self.sent..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.sent += n;
                    if self.sent == front.len() {
                        self.out.pop_front();
                        self.sent = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Once everything is written: a FIN after it.
    fn shut_when_flushed(&mut self) {
        if self.out.is_empty() && !self.write_shut {
            let _ = self.stream.shutdown(Shutdown::Write);
            self.write_shut = true;
        }
    }

    /// Reads and discards what the peer sends while closing. `true`: it
    /// hung up (or the connection broke).
    fn drain(&mut self, chunk: &mut [u8]) -> bool {
        let mut s = &self.stream;
        for _ in 0..16 {
            match s.read(chunk) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    }
}

/// What one nonblocking read got.
enum Got {
    Data(usize),
    Nothing,
    Eof,
    Failed(io::Error),
}

fn read_some(stream: &TcpStream, buf: &mut [u8]) -> Got {
    let mut s = stream;
    loop {
        return match s.read(buf) {
            Ok(0) => Got::Eof,
            Ok(n) => Got::Data(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Got::Nothing,
            Err(e) => Got::Failed(e),
        };
    }
}

/// The root's event loop around a [`Rendezvous`].
#[derive(Debug)]
pub(crate) struct Driver {
    listener: Option<TcpListener>,
    addr: SocketAddr,
    wake: Option<UnixStream>,
    machine: Rendezvous,
    socks: BTreeMap<ConnId, Sock>,
    shared: Arc<Shared>,
    linger: Duration,
    chunk: Vec<u8>,
    /// The process's open-file limit: a connection whose descriptor leaves
    /// fewer than [`super::fd_reserve`] free is refused.
    fd_limit: Option<u64>,
}

impl Driver {
    pub(super) fn new(
        listener: TcpListener,
        addr: SocketAddr,
        wake: UnixStream,
        machine: Rendezvous,
        shared: Arc<Shared>,
        timeout: Duration,
    ) -> Driver {
        Driver {
            listener: Some(listener),
            addr,
            wake: Some(wake),
            machine,
            socks: BTreeMap::new(),
            shared,
            linger: LINGER.min(timeout),
            chunk: vec![0u8; READ_CHUNK],
            fd_limit: None,
        }
    }

    /// Refuse connections that would leave fewer than a reserve of the
    /// process's `limit` descriptors free.
    pub(super) fn set_fd_limit(&mut self, limit: u64) {
        self.fd_limit = Some(limit);
    }

    /// Runs the rendezvous to its end, delivers the last messages, and
    /// returns the outcome.
    pub(super) fn run(mut self) -> Result<()> {
        let _ended = EndGuard(self.shared.clone());
        loop {
            let now = Instant::now();
            self.machine.handle_timeout(now);
            self.pump(now);
            if self.machine.is_finished() {
                break;
            }
            self.wait_and_serve();
        }
        self.deliver();
        match self.machine.result() {
            Some(Ok(())) | None => Ok(()),
            Some(Err(msg)) => Err(Error::Bootstrap(msg.clone())),
        }
    }

    /// Carries out what the machine asks for, and writes what can be
    /// written, until neither has more to do.
    fn pump(&mut self, now: Instant) {
        loop {
            self.apply(now);
            if !self.write_all(now) {
                break;
            }
        }
        self.mark_delivering(now);
    }

    /// A failed rendezvous: the owner's drop of its RootServer waits for
    /// the error frames (a clean end, where the others are only told that
    /// a rank left, does not hold the owner up).
    fn mark_delivering(&self, now: Instant) {
        let failed = matches!(self.machine.result(), Some(Err(_)));
        if failed && self.shared.phase() == Phase::Serving {
            self.shared.set(Phase::Delivering {
                until: now + self.linger,
            });
        }
    }

    /// Takes the machine's outputs: bytes to queue, connections to close,
    /// log lines.
    fn apply(&mut self, now: Instant) {
        // Before the first byte of the last messages goes out, so that an
        // owner dropping its RootServer waits for all of them.
        self.mark_delivering(now);
        while let Some(t) = self.machine.poll_transmit() {
            if let Some(s) = self.socks.get_mut(&t.conn) {
                if !s.write_shut {
                    s.out.push_back(t.bytes);
                }
            }
        }
        while let Some(id) = self.machine.poll_close() {
            let Some(s) = self.socks.get_mut(&id) else {
                continue;
            };
            if s.out.is_empty() && !self.machine.is_finished() {
                // Nothing to deliver (an evicted stranger): free it now.
                if let Some(s) = self.socks.remove(&id) {
                    close_now(s, &mut self.chunk);
                }
            } else if s.closing.is_none() {
                s.closing = Some(now + CLOSE_LINGER.min(self.linger));
            }
        }
        while let Some(line) = self.machine.poll_log() {
            match line.level {
                Level::Warn => tracing::warn!(root = %self.addr, "{}", line.msg),
                Level::Debug => tracing::debug!(root = %self.addr, "{}", line.msg),
            }
        }
    }

    /// Writes what is queued without blocking; closes what is done closing.
    /// `true`: the machine was told of a broken connection (it may have
    /// more to say).
    fn write_all(&mut self, now: Instant) -> bool {
        let mut told = false;
        let ids: Vec<ConnId> = self.socks.keys().copied().collect();
        for id in ids {
            let Some(s) = self.socks.get_mut(&id) else {
                continue;
            };
            let res = if s.out.is_empty() { Ok(()) } else { s.flush() };
            match res {
                Err(e) => {
                    let closing = s.closing.is_some();
                    self.socks.remove(&id);
                    if !closing {
                        self.machine.handle_closed(now, id, Some(e.to_string()));
                        told = true;
                    }
                }
                Ok(()) => {
                    if s.closing.is_some() {
                        s.shut_when_flushed();
                    }
                    if s.closing.is_some_and(|t| now >= t) {
                        self.socks.remove(&id);
                    }
                }
            }
        }
        told
    }

    /// Polls the listener, the wake-up socket and the connections until
    /// something happens or the machine's next deadline, and serves what
    /// is ready.
    fn wait_and_serve(&mut self) {
        let now = Instant::now();
        let accepting = self.machine.accepting(now) && self.listener.is_some();
        let ids: Vec<ConnId> = self.socks.keys().copied().collect();
        let deadline = self
            .socks
            .values()
            .filter_map(|s| s.closing)
            .chain(self.machine.poll_timeout())
            .min();
        let wait = match deadline {
            Some(d) => poll_ms(d.saturating_duration_since(now)),
            None => PollTimeout::NONE,
        };
        let (ready_listener, ready_wake, ready): (bool, bool, Vec<(ConnId, PollFlags)>) = {
            let mut fds = Vec::with_capacity(2 + ids.len());
            let mut slots = Vec::with_capacity(ids.len());
            let listener_at = match (&self.listener, accepting) {
                (Some(l), true) => {
                    fds.push(PollFd::new(l.as_fd(), PollFlags::POLLIN));
                    Some(fds.len() - 1)
                }
                _ => None,
            };
            let wake_at = self.wake.as_ref().map(|w| {
                fds.push(PollFd::new(w.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            for id in &ids {
                let Some(s) = self.socks.get(id) else {
                    continue;
                };
                let mut ev = PollFlags::empty();
                if !s.out.is_empty() {
                    ev |= PollFlags::POLLOUT;
                }
                let reading = if s.closing.is_some() {
                    s.write_shut
                } else {
                    self.machine.read_limit(*id) > 0
                };
                if reading {
                    ev |= PollFlags::POLLIN;
                }
                fds.push(PollFd::new(s.stream.as_fd(), ev));
                slots.push(*id);
            }
            match nix::poll::poll(&mut fds, wait) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    let msg = format!("the bootstrap root cannot poll its sockets: {e}");
                    drop(fds);
                    self.machine.handle_fatal(Instant::now(), msg);
                    return;
                }
            }
            let revents = |f: &PollFd| f.revents().unwrap_or(PollFlags::empty());
            let rl = listener_at.is_some_and(|i| !revents(&fds[i]).is_empty());
            let rw = wake_at.is_some_and(|i| !revents(&fds[i]).is_empty());
            let base = fds.len() - slots.len();
            let ready = slots
                .iter()
                .enumerate()
                .map(|(i, id)| (*id, revents(&fds[base + i])))
                .filter(|(_, r)| !r.is_empty())
                .collect();
            (rl, rw, ready)
        };
        let now = Instant::now();
        if ready_wake {
            self.check_wake(now);
        }
        for (id, ev) in ready {
            let readable = ev.intersects(
                PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL,
            );
            if readable {
                self.read(now, id);
            }
        }
        if ready_listener {
            self.accept(now);
        }
    }

    fn check_wake(&mut self, now: Instant) {
        let mut b = [0u8; 16];
        let got = match &self.wake {
            Some(w) => {
                let mut w = w;
                w.read(&mut b)
            }
            None => return,
        };
        match got {
            Ok(n) if n > 0 => self.machine.handle_shutdown(now),
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted => {}
            // The RootServer was dropped (detached): keep serving.
            _ => self.wake = None,
        }
    }

    fn read(&mut self, now: Instant, id: ConnId) {
        let Some(s) = self.socks.get_mut(&id) else {
            return;
        };
        if s.closing.is_some() {
            if s.drain(&mut self.chunk) {
                self.socks.remove(&id);
            }
            return;
        }
        let limit = self.machine.read_limit(id).clamp(1, self.chunk.len());
        match read_some(&s.stream, &mut self.chunk[..limit]) {
            Got::Data(n) => self.machine.handle_data(now, id, &self.chunk[..n]),
            Got::Nothing => {}
            Got::Eof => {
                self.socks.remove(&id);
                self.machine.handle_closed(now, id, None);
            }
            Got::Failed(e) => {
                self.socks.remove(&id);
                self.machine.handle_closed(now, id, Some(e.to_string()));
            }
        }
    }

    fn accept(&mut self, now: Instant) {
        for _ in 0..ACCEPT_BATCH {
            if !self.machine.accepting(now) {
                return;
            }
            let Some(listener) = &self.listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, peer)) => {
                    if let Some(limit) = self.fd_limit {
                        // Descriptors are handed out lowest first: every
                        // one below this is in use.
                        let fd = stream.as_raw_fd().max(0) as u64;
                        let reserve = super::fd_reserve(limit);
                        if fd + reserve >= limit {
                            drop(stream);
                            let why = AcceptFailure {
                                out_of_fds: true,
                                msg: format!(
                                    "fewer than {reserve} of this process's {limit} file \
                                     descriptors would stay free for its ranks"
                                ),
                            };
                            self.machine.handle_accept_failed(now, why);
                            self.apply(now);
                            continue;
                        }
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let nonce = match random_bytes() {
                        Ok(n) => n,
                        Err(e) => {
                            let why = AcceptFailure {
                                out_of_fds: false,
                                msg: e.to_string(),
                            };
                            self.machine.handle_accept_failed(now, why);
                            return;
                        }
                    };
                    let id = self.machine.handle_connect(now, peer, nonce);
                    self.socks.insert(
                        id,
                        Sock {
                            stream,
                            out: VecDeque::new(),
                            sent: 0,
                            closing: None,
                            write_shut: false,
                        },
                    );
                    // Evictions free their descriptors before the next accept.
                    self.apply(now);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let out_of_fds = matches!(
                        e.raw_os_error(),
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                    );
                    let why = AcceptFailure {
                        out_of_fds,
                        msg: e.to_string(),
                    };
                    self.machine.handle_accept_failed(now, why);
                    self.apply(now);
                }
            }
        }
    }

    /// After the end: no new connections; what is queued goes out, then a
    /// FIN, then a wait for the peers to hang up, all within the linger.
    fn deliver(&mut self) {
        self.listener = None;
        let until = match self.shared.phase() {
            Phase::Delivering { until } => until,
            _ => Instant::now() + self.linger,
        };
        loop {
            let now = Instant::now();
            self.apply(now);
            let ids: Vec<ConnId> = self.socks.keys().copied().collect();
            for id in &ids {
                let Some(s) = self.socks.get_mut(id) else {
                    continue;
                };
                if s.closing.is_none() {
                    s.closing = Some(until);
                }
                let broken = s.flush().is_err();
                s.shut_when_flushed();
                if broken || (s.write_shut && s.drain(&mut self.chunk)) {
                    self.socks.remove(id);
                }
            }
            if self.socks.is_empty() || now >= until {
                break;
            }
            let mut fds: Vec<PollFd> = self
                .socks
                .values()
                .map(|s| {
                    let ev = if s.out.is_empty() {
                        PollFlags::POLLIN
                    } else {
                        PollFlags::POLLOUT
                    };
                    PollFd::new(s.stream.as_fd(), ev)
                })
                .collect();
            let wait = poll_ms(
                until
                    .saturating_duration_since(now)
                    .min(Duration::from_millis(50)),
            );
            let _ = nix::poll::poll(&mut fds, wait);
        }
        let left = std::mem::take(&mut self.socks);
        for (_, s) in left {
            close_now(s, &mut self.chunk);
        }
    }
}

/// Closes at once: a FIN (reading what is pending first, so that the peer
/// gets a FIN rather than a reset).
fn close_now(s: Sock, chunk: &mut [u8]) {
    let mut s = s;
    let _ = s.stream.shutdown(Shutdown::Write);
    let _ = s.drain(chunk);
}

//! [`Bootstrap`]: a rank's side of the rendezvous, with blocking I/O
//! bounded by deadlines.
//!
//! A connection that the root closes before it accepted this rank (no
//! error frame: the root was making room for others, or dropped a slow
//! handshake) is tried again, with a growing pause, within the rank's own
//! deadline. An error frame from the root always wins over a closed
//! connection: it says why.
//!
//! Protocol v3: the hello's payload is this rank's listening address; once
//! all ranks joined the root sends each its successor's, the ranks connect
//! into a ring and every all-gather (the first carries the callers'
//! payloads and the addresses) goes round it (`peer.rs`). The root only
//! hears that a rank starts a round (a `CONTRIB` frame without data), so it
//! can name ranks that are late or leave.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::exchange::{Ask, ExchangeError};
use super::id::{random_bytes, UniqueId};
use super::peer::{Peers, RootWatch};
use super::wire::{
    client_mac, contrib_header, ct_eq, decode_addr, encode_addr, hello_header, parse_challenge,
    read_frame_with, root_mac, ChallengeError, FrameBuf, FrameError, HelloFixed, K_ACCEPT, K_ERROR,
    K_LEFT, K_RING, MAX_PAYLOAD, MAX_RANKS, NONCE_LEN, VERSION,
};
use super::{fmt_dur, grace, remaining, MAX_TIMEOUT};
use crate::error::{Error, Result};

/// How often a blocked read looks at the abort flag.
const ABORT_POLL: Duration = Duration::from_millis(50);
/// The first pause before connecting again after the root closed the
/// connection before accepting this rank; it doubles up to
/// [`RETRY_PAUSE_MAX`].
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(10);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(500);

/// A rank's side of the bootstrap: its connection to the root, its ring
/// connections and its listener for the other ranks.
#[derive(Debug)]
pub(crate) struct Bootstrap {
    rank: u32,
    nranks: u32,
    root: SocketAddr,
    timeout: Duration,
    abort: Option<Arc<AtomicBool>>,
    state: Mutex<ClientState>,
}

#[derive(Debug)]
struct ClientState {
    stream: TcpStream,
    round: u64,
    broken: Option<String>,
    peers: Peers,
}

/// Blocking frame I/O with deadlines and messages that name the root.
pub(super) struct Wire<'a> {
    pub stream: &'a mut TcpStream,
    pub root: SocketAddr,
    pub timeout: Duration,
    /// Set from another thread to give up (init abort); polled every 50 ms.
    pub abort: Option<&'a AtomicBool>,
    /// The last failure was the root closing the connection (end of
    /// stream, reset), with no error frame before it.
    pub closed: bool,
}

fn aborted_error() -> io::Error {
    io::Error::other("aborted by the caller")
}

impl<'a> Wire<'a> {
    pub(super) fn new(
        stream: &'a mut TcpStream,
        root: SocketAddr,
        timeout: Duration,
        abort: Option<&'a AtomicBool>,
    ) -> Wire<'a> {
        Wire {
            stream,
            root,
            timeout,
            abort,
            closed: false,
        }
    }

    fn io_error(&mut self, e: io::Error, what: &str) -> Error {
        if self.abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
            return Error::Unusable(format!("aborted by the caller while {what}"));
        }
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::Bootstrap(format!(
                "no answer from the bootstrap root at {} within {} while {what}",
                self.root,
                fmt_dur(self.timeout)
            )),
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => {
                self.closed = true;
                Error::Bootstrap(format!(
                    "the bootstrap root at {} closed the connection while {what} (did the root \
                     process exit?)",
                    self.root
                ))
            }
            _ => Error::BootstrapIo {
                what: format!("{what} (bootstrap root at {})", self.root),
                source: e,
            },
        }
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        let mut off = 0;
        while off < buf.len() {
            let Some(left) = remaining(deadline) else {
                return Err(io::ErrorKind::TimedOut.into());
            };
            if self.abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                return Err(aborted_error());
            }
            let slice = if self.abort.is_some() {
                left.min(ABORT_POLL)
            } else {
                left
            };
            self.stream.set_read_timeout(Some(slice))?;
            match self.stream.read(&mut buf[off..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => off += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted
                            | io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub(super) fn write_all(
        &mut self,
        bufs: &[&[u8]],
        deadline: Instant,
        what: &str,
    ) -> Result<()> {
        for buf in bufs {
            let mut off = 0;
            while off < buf.len() {
                let Some(left) = remaining(deadline) else {
                    return Err(self.io_error(io::ErrorKind::TimedOut.into(), what));
                };
                if let Err(e) = self.stream.set_write_timeout(Some(left)) {
                    return Err(self.io_error(e, what));
                }
                match self.stream.write(&buf[off..]) {
                    Ok(0) => return Err(self.io_error(io::ErrorKind::WriteZero.into(), what)),
                    Ok(n) => off += n,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::Interrupted
                                | io::ErrorKind::WouldBlock
                                | io::ErrorKind::TimedOut
                        ) => {}
                    Err(e) => return Err(self.io_error(e, what)),
                }
            }
        }
        Ok(())
    }

    /// Reads one frame; an `ERROR` frame becomes `Err` with the root's message.
    pub(super) fn read_frame(&mut self, deadline: Instant, what: &str) -> Result<(u8, Vec<u8>)> {
        let (kind, body) = self.read_raw_frame(deadline, what)?;
        if kind == K_ERROR || kind == K_LEFT {
            return Err(self.root_error(&body));
        }
        Ok((kind, body))
    }

    fn root_error(&self, body: &[u8]) -> Error {
        let msg = String::from_utf8_lossy(body);
        Error::Bootstrap(format!(
            "{msg} (reported by the bootstrap root at {})",
            self.root
        ))
    }

    /// After a failed write: the root may have said why it closed the
    /// connection. Returns its message if one is waiting.
    fn pending_root_error(&mut self) -> Option<Error> {
        let deadline = Instant::now() + self.timeout.min(Duration::from_millis(500));
        let closed = self.closed;
        let got = self.read_raw_frame(deadline, "reading the root's last message");
        self.closed = closed;
        match got {
            Ok((K_ERROR | K_LEFT, body)) => {
                self.closed = false;
                Some(self.root_error(&body))
            }
            _ => None,
        }
    }

    /// Writes a message; if that fails, prefers the root's explanation.
    pub(super) fn send(&mut self, bufs: &[&[u8]], deadline: Instant, what: &str) -> Result<()> {
        match self.write_all(bufs, deadline, what) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.pending_root_error().unwrap_or(e)),
        }
    }

    pub(super) fn read_raw_frame(
        &mut self,
        deadline: Instant,
        what: &str,
    ) -> Result<(u8, Vec<u8>)> {
        match read_frame_with(|b| self.read_exact(b, deadline)) {
            Ok(f) => Ok(f),
            Err(FrameError::Io(e)) => Err(self.io_error(e, what)),
            Err(FrameError::Length(n)) => Err(Error::Bootstrap(format!(
                "the peer at {} does not speak the braid bootstrap protocol (frame length {n}) \
                 while {what}; is the unique id's address really a braid root?",
                self.root
            ))),
        }
    }

    fn protocol(&self, what: &str, got: &str) -> Error {
        Error::Bootstrap(format!(
            "the bootstrap root at {} sent {got} while {what} (protocol error)",
            self.root
        ))
    }
}

fn aborted() -> Error {
    Error::Unusable("communicator creation aborted by the caller".into())
}

fn connect_retry(
    addr: SocketAddr,
    timeout: Duration,
    deadline: Instant,
    abort: Option<&AtomicBool>,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    loop {
        if abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
            return Err(aborted());
        }
        let left = remaining(deadline).unwrap_or(Duration::ZERO);
        let err = if left.is_zero() {
            io::Error::new(io::ErrorKind::TimedOut, "deadline reached")
        } else {
            match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => return Ok(s),
                Err(e) => e,
            }
        };
        let Some(left) = remaining(deadline) else {
            return Err(Error::BootstrapIo {
                what: format!(
                    "could not reach the bootstrap root at {addr} within {} (is rank 0 / the root \
                     running, and is the address in the unique id reachable from this host?)",
                    fmt_dur(timeout)
                ),
                source: err,
            });
        };
        tracing::trace!(root = %addr, "bootstrap connect failed ({err}); retrying");
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// The handshake on a fresh connection, up to the root's `ACCEPT`.
fn handshake(
    wire: &mut Wire<'_>,
    id: &UniqueId,
    rank: u32,
    nranks: u32,
    payload: &[u8],
    deadline: Instant,
) -> Result<()> {
    let root = id.addr;
    // 1. challenge
    let (kind, body) = wire.read_frame(deadline, "waiting for the root's challenge")?;
    let rnonce = match parse_challenge(kind, &body) {
        Ok(n) => n,
        Err(ChallengeError::NotBraid) => {
            return Err(Error::Bootstrap(format!(
                "the peer at {root} does not speak the braid bootstrap protocol; is the \
                 unique id's address really a braid root?"
            )))
        }
        Err(ChallengeError::Version(version)) => {
            return Err(Error::Bootstrap(format!(
                "bootstrap protocol version mismatch: the root at {root} speaks v{version}, \
                 this rank v{VERSION}; all ranks must run the same braid version"
            )))
        }
    };

    // 2. hello
    let cnonce: [u8; NONCE_LEN] = random_bytes()?;
    let hello = HelloFixed {
        rank,
        nranks,
        cnonce,
        mac: client_mac(&id.secret, &rnonce, &cnonce, rank, nranks),
    }
    .encode();
    let hdr = hello_header(payload.len());
    wire.send(&[&hdr, &hello, payload], deadline, "sending hello")?;

    // 3. accept, with the root's proof
    let (kind, proof) = wire.read_frame(deadline, "waiting for the root to accept this rank")?;
    if kind != K_ACCEPT || !ct_eq(&proof, &root_mac(&id.secret, &cnonce, &rnonce, rank)) {
        return Err(Error::Bootstrap(format!(
            "the bootstrap root at {root} could not prove that it knows the secret: check \
             that every rank uses the same UniqueId"
        )));
    }
    Ok(())
}

impl Bootstrap {
    /// [`Bootstrap::connect_abortable`] without an abort flag; only the
    /// tests join this way.
    #[cfg(test)]
    pub(crate) fn connect(
        id: &UniqueId,
        rank: u32,
        nranks: u32,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(Bootstrap, Vec<Vec<u8>>)> {
        Self::connect_abortable(id, rank, nranks, payload, timeout, None)
    }

    /// Joins the bootstrap at `id`: connects to the root (retrying while it
    /// is not up yet, or while it closes the connection before accepting
    /// this rank), proves the secret, and waits until all `nranks` ranks
    /// have joined. Returns every rank's `payload` in rank order.
    ///
    /// Fails within about `timeout` with an error naming the root or the
    /// ranks concerned, and within about 50 ms once `abort` is set (from
    /// any thread), here and in every later round.
    pub(crate) fn connect_abortable(
        id: &UniqueId,
        rank: u32,
        nranks: u32,
        payload: &[u8],
        timeout: Duration,
        abort: Option<Arc<AtomicBool>>,
    ) -> Result<(Bootstrap, Vec<Vec<u8>>)> {
        if nranks == 0 || nranks > MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "nranks={nranks} is out of range (1..={MAX_RANKS})"
            )));
        }
        if rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is out of range for nranks={nranks} (ranks are 0..={})",
                nranks - 1
            )));
        }
        check_payload(payload)?;
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the bootstrap timeout must be greater than zero".into(),
            ));
        }
        if id.addr.port() == 0 {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: the unique id's address {} has port 0, which is not a root \
                 address (port 0 only asks the OS for a free port when binding); give every \
                 rank the id with the root's real port (RootServer::addr() once bound)",
                id.addr
            )));
        }
        let timeout = timeout.min(MAX_TIMEOUT);
        let start = Instant::now();
        let deadline = start + timeout;
        let root = id.addr;
        // Raise the soft limit of open files (once per process).
        super::fd_limit();
        let mut pause = RETRY_PAUSE_MIN;
        let mut closes = 0u32;
        let mut peers: Option<Peers> = None;
        let mut stream = loop {
            let mut stream =
                connect_retry(root, timeout, deadline, abort.as_deref()).map_err(|e| match e {
                    Error::BootstrapIo { what, source } if closes > 0 => Error::BootstrapIo {
                        what: format!(
                            "{what}; before that it closed this rank's connection {closes} \
                                 times before accepting it"
                        ),
                        source,
                    },
                    e => e,
                })?;
            stream.set_nodelay(true).map_err(|e| Error::BootstrapIo {
                what: format!(
                    "cannot set TCP_NODELAY on the connection to the bootstrap root at {root}"
                ),
                source: e,
            })?;
            // This rank's listener, on the address it reaches the root
            // from (which the other ranks reach it at).
            if peers.is_none() {
                let ip = stream.local_addr().map_err(|e| Error::BootstrapIo {
                    what: "the local address of the connection to the root".into(),
                    source: e,
                })?;
                peers = Some(Peers::bind(rank, nranks, id.secret, ip.ip())?);
            }
            let me = peers
                .as_ref()
                .map(|p| encode_addr(&p.addr))
                .unwrap_or_default();
            let mut wire = Wire::new(&mut stream, root, timeout, abort.as_deref());
            let e = match handshake(&mut wire, id, rank, nranks, &me, deadline) {
                Ok(()) => break stream,
                Err(e) => e,
            };
            // Closed before this rank was accepted, without a word: the
            // root did not count it (it was making room, or the handshake
            // was slow). Connect again while there is time.
            let Some(left) = remaining(deadline).filter(|_| wire.closed) else {
                return Err(match (e, closes) {
                    (Error::Bootstrap(m), n) if n > 0 => Error::Bootstrap(format!(
                        "{m}; it had closed this rank's connection {n} times before accepting it \
                         (rank {rank}: is the root overloaded by other connections?)"
                    )),
                    (e, _) => e,
                });
            };
            closes += 1;
            tracing::debug!(root = %root,
                "rank {rank}: the bootstrap root closed the connection before accepting it \
                 ({e}); connecting again");
            if abort.as_deref().is_some_and(|a| a.load(Ordering::Relaxed)) {
                return Err(aborted());
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(RETRY_PAUSE_MAX);
        };

        let Some(mut peers) = peers else {
            return Err(Error::Bootstrap("no listener (unreachable)".into()));
        };
        // The successor's address, once all joined.
        let mut wire = Wire::new(&mut stream, root, timeout, abort.as_deref());
        let what = format!("waiting for all {nranks} ranks to join (this is rank {rank})");
        let (kind, body) = wire.read_frame(deadline + grace(timeout), &what)?;
        let next = match (kind, decode_addr(&body)) {
            (K_RING, Some((a, n))) if n == body.len() => a,
            _ => return Err(wire.protocol(&what, &format!("a message of kind {kind}"))),
        };
        // The ring, then everyone's payloads and addresses round it.
        let mut watch = RootWatch {
            stream: &mut stream,
            addr: root,
            rbuf: FrameBuf::default(),
            left: false,
        };
        let ab = abort.as_deref();
        let ring = peers
            .setup_ring(next, deadline + grace(timeout), &mut watch, ab)
            .and_then(|()| {
                let mut mine = encode_addr(&peers.addr);
                mine.extend_from_slice(payload);
                peers.ring_allgather(0, &mine, start, deadline, grace(timeout), &mut watch, ab)
            });
        let all = match ring {
            Ok(a) => a,
            Err(e) => {
                peers.shut_ring();
                return Err(e);
            }
        };
        let mut addrs = Vec::with_capacity(all.len());
        let mut payloads = Vec::with_capacity(all.len());
        for (r, b) in all.into_iter().enumerate() {
            let Some((a, n)) = decode_addr(&b) else {
                return Err(Error::Bootstrap(format!(
                    "rank {r} sent a malformed bootstrap address (protocol error)"
                )));
            };
            addrs.push(a);
            payloads.push(b[n..].to_vec());
        }
        peers.addrs = addrs;
        let all = payloads;
        tracing::debug!(root = %root, "rank {rank}/{nranks} bootstrapped in {:?}", start.elapsed());
        Ok((
            Bootstrap {
                rank,
                nranks,
                root,
                timeout,
                abort,
                state: Mutex::new(ClientState {
                    stream,
                    round: 0,
                    broken: None,
                    peers,
                }),
            },
            all,
        ))
    }

    /// This rank.
    #[cfg(test)]
    pub(crate) fn rank(&self) -> u32 {
        self.rank
    }

    /// The number of ranks.
    #[cfg(test)]
    pub(crate) fn nranks(&self) -> u32 {
        self.nranks
    }

    /// The local address of this rank's connection to the root: an address
    /// the other ranks can reach this host at, as they reach the root.
    pub(crate) fn local_ip(&self) -> Option<IpAddr> {
        let st = self.state.lock().ok()?;
        st.stream.local_addr().ok().map(|a| a.ip())
    }

    /// Every rank contributes `data`; all get all contributions in rank order.
    /// All ranks must call this the same number of times. After an error the
    /// bootstrap is unusable.
    pub(crate) fn allgather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        check_payload(data)?;
        let mut st = self
            .state
            .lock()
            .map_err(|_| Error::Unusable("a bootstrap round panicked on another thread".into()))?;
        if let Some(why) = &st.broken {
            return Err(Error::Unusable(format!(
                "an earlier bootstrap round failed: {why}"
            )));
        }
        if let Some(word) = st.peers.root_said() {
            let e = Error::Bootstrap(word.to_string());
            st.broken = Some(e.to_string());
            return Err(e);
        }
        let round = st.round + 1;
        let st = &mut *st;
        let since = Instant::now();
        let deadline = since + self.timeout;
        let what = format!(
            "in bootstrap round {round} (rank {} of {})",
            self.rank, self.nranks
        );
        // The root hears that this rank started the round (it names late
        // ranks); the data goes round the ring.
        let hdr = contrib_header(round, 0);
        let res = Wire::new(
            &mut st.stream,
            self.root,
            self.timeout,
            self.abort.as_deref(),
        )
        .send(&[&hdr], deadline, &what)
        .and_then(|()| {
            let mut watch = RootWatch {
                stream: &mut st.stream,
                addr: self.root,
                rbuf: FrameBuf::default(),
                left: false,
            };
            st.peers.ring_allgather(
                round,
                data,
                since,
                deadline,
                grace(self.timeout),
                &mut watch,
                self.abort.as_deref(),
            )
        });
        match res {
            Ok(v) => {
                st.round = round;
                Ok(v)
            }
            Err(e) => {
                st.broken = Some(e.to_string());
                let _ = st.stream.shutdown(Shutdown::Both);
                st.peers.shut_ring();
                Err(e)
            }
        }
    }

    /// Exchanges one message with each rank of `asks` point to point (no
    /// round: only the ranks concerned take part, each with the same `tag`
    /// for the other), within the bootstrap timeout. Returns their messages
    /// in the order of `asks`. A failure names the rank and leaves the
    /// bootstrap usable.
    pub(crate) fn exchange(
        &self,
        asks: &[Ask],
    ) -> std::result::Result<Vec<Vec<u8>>, ExchangeError> {
        self.exchange_until_aborted(asks, self.abort.as_deref())
    }

    /// [`Bootstrap::exchange`] that the communicator's abort flag does not
    /// stop: repairs of an aborted or revoked communicator (shrink) still
    /// talk to the survivors, within the bootstrap timeout.
    pub(crate) fn exchange_past_abort(
        &self,
        asks: &[Ask],
    ) -> std::result::Result<Vec<Vec<u8>>, ExchangeError> {
        self.exchange_until_aborted(asks, None)
    }

    fn exchange_until_aborted(
        &self,
        asks: &[Ask],
        abort: Option<&AtomicBool>,
    ) -> std::result::Result<Vec<Vec<u8>>, ExchangeError> {
        let mut st = self.state.lock().map_err(|_| {
            ExchangeError::Local(Error::Unusable(
                "a bootstrap round panicked on another thread".into(),
            ))
        })?;
        let deadline = Instant::now() + self.timeout;
        st.peers.exchange(asks, deadline, abort)
    }

    /// The ranks whose process is gone: nothing listens at their bootstrap
    /// address any more (a refused connection), or their host does not
    /// answer within `wait`. A stopped (SIGSTOP) or stuck process still
    /// counts as alive: its kernel accepts the connection.
    pub(crate) fn gone_ranks(&self, wait: Duration) -> Result<Vec<u32>> {
        let addrs = {
            let st = self.state.lock().map_err(|_| {
                Error::Unusable("a bootstrap round panicked on another thread".into())
            })?;
            st.peers.addrs.clone()
        };
        Ok(super::peer::gone(&addrs, self.rank, wait))
    }

    /// Waits until every rank has called `barrier`.
    pub(crate) fn barrier(&self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }
}

fn check_payload(p: &[u8]) -> Result<()> {
    if p.len() > MAX_PAYLOAD {
        return Err(Error::InvalidArgument(format!(
            "bootstrap payload of {} bytes exceeds the limit of {MAX_PAYLOAD} bytes",
            p.len()
        )));
    }
    Ok(())
}

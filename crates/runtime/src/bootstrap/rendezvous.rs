//! The root's rendezvous as a pure, deterministic state machine (in the
//! manner of quinn-proto): no sockets, no clock, no randomness. The driver
//! ([`super::io`]) feeds it what happened and carries out what it asks for:
//!
//! - inputs: [`Rendezvous::handle_connect`] (a connection arrived, with the
//!   nonce to challenge it with), [`Rendezvous::handle_data`] (bytes arrived
//!   on connection k), [`Rendezvous::handle_closed`] (connection k ended),
//!   [`Rendezvous::handle_accept_failed`], [`Rendezvous::handle_timeout`] (a
//!   timer tick at `now`) and [`Rendezvous::handle_shutdown`]; every one
//!   takes the time as an argument;
//! - outputs: [`Rendezvous::poll_transmit`] (bytes to write to connection k,
//!   in order), [`Rendezvous::poll_close`] (connections to close once their
//!   bytes are written), [`Rendezvous::poll_log`] (log lines, rate-limited),
//!   [`Rendezvous::poll_timeout`] (when to tick next),
//!   [`Rendezvous::accepting`] (whether to accept now),
//!   [`Rendezvous::read_limit`] (how much to read from connection k) and
//!   [`Rendezvous::result`] (finished or failed).
//!
//! The same inputs give the same outputs, so the tests in `sim.rs` play
//! ranks, strangers, slow senders and failures in memory.
//!
//! What the root sends is O(p) bytes in all: a challenge and an accept per
//! rank and, once all joined, each rank its successor's hello payload (its
//! listening address; [`K_RING`]). The all-gathers after that go round the
//! ring of ranks; the root only counts them: every rank tells it when it
//! starts round `r` (a `CONTRIB` frame, a few bytes), so the root can name
//! the ranks that do not reach a round within the timeout, and tell every
//! rank when one leaves in the middle of one (an `ERROR` frame each). A rank
//! that leaves after the last round it started (the end of a job; the
//! others' word that they started it may still be on its way) is told as a
//! `LEFT` frame: rounds under way still complete on the ring, the next one
//! fails with it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::warnings::Warnings;
pub(crate) use super::warnings::{Level, LogLine};
use super::wire::{
    accept_frame, challenge_frame, error_frame, frame_header, hello_prefix, left_frame,
    parse_contrib, parse_hello, root_mac, FrameBuf, HelloError, HelloFixed, HELLO_PREFIX,
    K_CONTRIB, K_RING, MAX_FRAME, MAX_RANKS, NONCE_LEN, READ_CHUNK, VERSION,
};
use super::{fmt_dur, fmt_ranks};

/// Connections in the handshake that have not proven the secret yet, at
/// most. When full, the oldest of them makes room for a new one.
pub(crate) const MAX_PENDING: usize = 1024;
/// How long a connection may take to prove the secret (at most the
/// bootstrap timeout). Real ranks answer the challenge at once.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// An unproven connection younger than this is not evicted to make room:
/// a rank that just connected gets the time to answer its challenge.
pub(crate) const EVICT_MIN_AGE: Duration = Duration::from_millis(250);
/// The first wait after a failed `accept`; it doubles up to
/// [`ACCEPT_BACKOFF_MAX`] while `accept` keeps failing.
pub(crate) const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest wait between two `accept` attempts that failed.
pub(crate) const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// A connection, numbered by the machine in arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ConnId(pub u64);

/// Bytes to write to a connection, after those of earlier transmits to it.
#[derive(Clone, Debug)]
pub(crate) struct Transmit {
    pub conn: ConnId,
    /// Shared: several connections may get the same bytes (an error).
    pub bytes: Arc<[u8]>,
}

/// Why `accept` failed.
#[derive(Clone, Debug)]
pub(crate) struct AcceptFailure {
    /// Out of file descriptors (EMFILE, ENFILE): closing a connection
    /// helps.
    pub out_of_fds: bool,
    /// What the OS said; also the key of the warnings' rate limit.
    pub msg: String,
}

/// The machine's settings.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// The root's address, for messages.
    pub addr: SocketAddr,
    pub secret: [u8; 16],
    /// All ranks must join within this of the start; every rank must
    /// reach a round within this of the first rank that reached it.
    pub timeout: Duration,
    /// How long an unproven connection may stay (see [`HANDSHAKE_TIMEOUT`]).
    pub handshake_timeout: Duration,
    /// Unproven connections held at most (see [`MAX_PENDING`]).
    pub max_pending: usize,
}

impl Settings {
    /// The defaults for a root at `addr`.
    pub(super) fn new(addr: SocketAddr, secret: [u8; 16], timeout: Duration) -> Settings {
        Settings {
            addr,
            secret,
            timeout,
            handshake_timeout: HANDSHAKE_TIMEOUT.min(timeout),
            max_pending: MAX_PENDING,
        }
    }
}

#[derive(Debug)]
enum ConnState {
    /// Challenged; the hello's proof has not arrived.
    Unproven,
    /// The hello's fixed part proved the secret; its payload is arriving.
    Proven,
    /// A rank.
    Rank(u32),
}

#[derive(Debug)]
struct Conn {
    peer: SocketAddr,
    nonce: [u8; NONCE_LEN],
    opened: Instant,
    /// The handshake must be done by then (not for ranks).
    deadline: Instant,
    rbuf: FrameBuf,
    state: ConnState,
}

/// The root's side of the bootstrap. See the module documentation.
#[derive(Debug)]
pub(crate) struct Rendezvous {
    cfg: Settings,
    next_id: u64,
    conns: BTreeMap<ConnId, Conn>,
    /// Unproven connections, oldest first (ids grow with arrival).
    unproven: BTreeSet<ConnId>,
    proven: BTreeSet<ConnId>,
    ranks: BTreeMap<u32, ConnId>,
    /// (nranks, the rank that first said so)
    nranks: Option<(u32, u32)>,
    rendezvous_deadline: Instant,
    /// All ranks joined (the rounds on the ring have begun).
    joined: bool,
    /// During the rendezvous, each rank's hello payload (its address).
    payloads: BTreeMap<u32, Vec<u8>>,
    /// After it, the last round each rank said it started (0: none).
    at: BTreeMap<u32, u64>,
    /// When the first rank started each round that some rank has not.
    first: BTreeMap<u64, Instant>,
    /// Ranks that left after starting a round that the root has not yet
    /// heard every other rank start (their contributions travel on other
    /// connections, so they may simply be late): the rank, that round, and
    /// the message. Settled when the others reach it (the end of a job),
    /// failed when one goes past it or the round's deadline passes.
    gone: Vec<(u32, u64, String)>,
    /// `accept` failed: the next attempt waits until then.
    accept_resume: Option<Instant>,
    accept_backoff: Duration,
    transmits: VecDeque<Transmit>,
    closes: VecDeque<ConnId>,
    logs: Warnings,
    result: Option<Result<(), String>>,
}

impl Rendezvous {
    /// A rendezvous that starts at `now`.
    pub(super) fn new(cfg: Settings, now: Instant) -> Rendezvous {
        let rendezvous_deadline = now + cfg.timeout;
        Rendezvous {
            cfg,
            next_id: 0,
            conns: BTreeMap::new(),
            unproven: BTreeSet::new(),
            proven: BTreeSet::new(),
            ranks: BTreeMap::new(),
            nranks: None,
            rendezvous_deadline,
            joined: false,
            payloads: BTreeMap::new(),
            at: BTreeMap::new(),
            first: BTreeMap::new(),
            gone: Vec::new(),
            accept_resume: None,
            accept_backoff: Duration::ZERO,
            transmits: VecDeque::new(),
            closes: VecDeque::new(),
            logs: Warnings::default(),
            result: None,
        }
    }

    // ------------------------------------------------------------- outputs

    /// The next bytes to write.
    pub(super) fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next connection to close, once the bytes queued for it are
    /// written.
    pub(super) fn poll_close(&mut self) -> Option<ConnId> {
        self.closes.pop_front()
    }

    /// The next log line.
    pub(super) fn poll_log(&mut self) -> Option<LogLine> {
        self.logs.poll_log()
    }

    /// When [`Rendezvous::handle_timeout`] must be called next (`None`:
    /// only when something happens).
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        if self.result.is_some() {
            return None;
        }
        let phase = if !self.joined {
            Some(self.rendezvous_deadline)
        } else {
            self.round_deadline()
        };
        let oldest = self
            .unproven
            .first()
            .and_then(|id| self.conns.get(id))
            .map(|c| c.deadline);
        let proven = self
            .proven
            .iter()
            .filter_map(|id| self.conns.get(id))
            .map(|c| c.deadline)
            .min();
        [
            phase,
            oldest,
            proven,
            self.accept_resume,
            self.logs.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether the driver should accept connections at `now` (not while
    /// backing off after a failed `accept`, nor once finished).
    pub(super) fn accepting(&self, now: Instant) -> bool {
        self.result.is_none() && self.accept_resume.is_none_or(|t| now >= t)
    }

    /// How many bytes to read from `conn` now: before the proof of the
    /// secret no more than the hello's fixed part, so that a stranger costs
    /// a few bytes; 0 for a connection the machine no longer reads.
    pub(super) fn read_limit(&self, conn: ConnId) -> usize {
        if self.result.is_some() {
            return 0;
        }
        match self.conns.get(&conn) {
            None => 0,
            Some(c) => match c.state {
                ConnState::Unproven => HELLO_PREFIX.saturating_sub(c.rbuf.buf.len()).max(1),
                ConnState::Proven | ConnState::Rank(_) => READ_CHUNK,
            },
        }
    }

    /// The outcome once finished: `Ok` when the ranks completed and left
    /// (or the root was shut down), the message sent to the ranks otherwise.
    pub(super) fn result(&self) -> Option<&Result<(), String>> {
        self.result.as_ref()
    }

    /// Whether the rendezvous has ended (the driver then delivers what is
    /// queued and stops).
    pub(super) fn is_finished(&self) -> bool {
        self.result.is_some()
    }

    /// Unproven connections held now.
    #[cfg(test)]
    pub(super) fn unproven_count(&self) -> usize {
        self.unproven.len()
    }

    /// Connections held now (ranks and handshakes).
    #[cfg(test)]
    pub(super) fn conn_count(&self) -> usize {
        self.conns.len()
    }

    // -------------------------------------------------------------- inputs

    /// A connection from `peer` arrived at `now`; it is challenged with
    /// `nonce` (random, from the driver). Returns its id. When the machine
    /// holds [`Settings::max_pending`] unproven connections, the oldest makes
    /// room if it has had [`EVICT_MIN_AGE`], or else the new one is closed.
    pub(super) fn handle_connect(
        &mut self,
        now: Instant,
        peer: SocketAddr,
        nonce: [u8; NONCE_LEN],
    ) -> ConnId {
        let id = ConnId(self.next_id);
        self.next_id += 1;
        if self.result.is_some() {
            self.closes.push_back(id);
            return id;
        }
        self.accept_backoff = Duration::ZERO;
        if self.unproven.len() >= self.cfg.max_pending.max(1) {
            // Held to a quarter of a low descriptor limit: say how to hold
            // more.
            let hint = if self.cfg.max_pending < MAX_PENDING {
                " (at most a quarter of this process's open-file limit is held: raise it, \
                 e.g. `ulimit -n 65536`, to hold more)"
            } else {
                ""
            };
            let oldest = self.unproven.first().copied();
            let evictable = oldest
                .and_then(|o| self.conns.get(&o))
                .is_some_and(|c| now.saturating_duration_since(c.opened) >= EVICT_MIN_AGE);
            match oldest {
                Some(o) if evictable => {
                    let old_peer = self.conns.get(&o).map(|c| c.peer);
                    self.drop_conn(o);
                    let max = self.cfg.max_pending;
                    self.warn(now, "evicted", || {
                        format!(
                            "{max} connections were in the bootstrap handshake without proving \
                             the secret; closed the oldest (from {}) to make room for \
                             {peer}{hint}",
                            old_peer.map_or_else(|| "?".into(), |p| p.to_string())
                        )
                    });
                }
                _ => {
                    self.closes.push_back(id);
                    let max = self.cfg.max_pending;
                    self.warn(now, "full", || {
                        format!(
                            "{max} connections arrived within {} and none proved the secret; \
                             closed the new one from {peer} (a rank retries){hint}",
                            fmt_dur(EVICT_MIN_AGE)
                        )
                    });
                    return id;
                }
            }
        }
        self.conns.insert(
            id,
            Conn {
                peer,
                nonce,
                opened: now,
                deadline: now + self.cfg.handshake_timeout,
                rbuf: FrameBuf::default(),
                state: ConnState::Unproven,
            },
        );
        self.unproven.insert(id);
        self.send(id, challenge_frame(&nonce));
        id
    }

    /// `accept` failed at `now`. Accepting pauses, for longer while it keeps
    /// failing; out of file descriptors, the oldest unproven connection is
    /// closed (if it has had its chance) so that the next one fits.
    pub(super) fn handle_accept_failed(&mut self, now: Instant, why: AcceptFailure) {
        if self.result.is_some() {
            return;
        }
        self.accept_backoff =
            (self.accept_backoff * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
        let mut freed = None;
        if why.out_of_fds {
            let oldest = self.unproven.first().copied();
            if let Some(o) = oldest {
                let old = self.conns.get(&o).map(|c| (c.peer, c.opened));
                if let Some((p, opened)) = old {
                    if now.saturating_duration_since(opened) >= EVICT_MIN_AGE {
                        self.drop_conn(o);
                        freed = Some(p);
                    }
                }
            }
        }
        let wait = if freed.is_some() {
            Duration::ZERO
        } else {
            self.accept_backoff
        };
        self.accept_resume = Some(now + wait);
        let addr = self.cfg.addr;
        let hint = if why.out_of_fds {
            " (out of file descriptors: raise the limit, e.g. `ulimit -n 65536`, or find who holds \
             connections to the root)"
        } else {
            ""
        };
        let msg = why.msg.clone();
        self.warn(now, &format!("accept: {}", why.msg), || {
            let then = match freed {
                Some(p) => format!("closed the oldest unproven connection (from {p}) to make room"),
                None => format!("retrying in {}", fmt_dur(wait)),
            };
            format!("the bootstrap root at {addr} cannot accept a connection: {msg}{hint}; {then}")
        });
    }

    /// Bytes arrived on `conn` at `now`.
    pub(super) fn handle_data(&mut self, now: Instant, conn: ConnId, bytes: &[u8]) {
        if self.result.is_some() {
            return;
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.rbuf.buf.extend_from_slice(bytes);
        match c.state {
            ConnState::Unproven | ConnState::Proven => self.advance_handshake(now, conn),
            ConnState::Rank(r) => self.advance_rank(now, r, conn),
        }
    }

    /// `conn` ended at `now` (end of stream, or the error that broke it).
    pub(super) fn handle_closed(&mut self, now: Instant, conn: ConnId, error: Option<String>) {
        if self.result.is_some() {
            return;
        }
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        match c.state {
            ConnState::Rank(r) => self.departed(now, r, error),
            ConnState::Unproven | ConnState::Proven => {
                let peer = c.peer;
                self.drop_conn(conn);
                let why = error.map(|e| format!(" ({e})")).unwrap_or_default();
                self.debug(format!(
                    "connection from {peer} closed during the bootstrap handshake{why}"
                ));
            }
        }
    }

    /// The clock reached `now`: handshakes, the rendezvous and the round
    /// past their deadlines end; a paused `accept` resumes.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        if self.result.is_some() {
            return;
        }
        if self.accept_resume.is_some_and(|t| now >= t) {
            self.accept_resume = None;
        }
        self.logs.handle_timeout(now);
        // Unproven connections expire in arrival order.
        let mut expired: Vec<ConnId> = Vec::new();
        for id in &self.unproven {
            match self.conns.get(id) {
                Some(c) if c.deadline > now => break,
                _ => expired.push(*id),
            }
        }
        expired.extend(
            self.proven
                .iter()
                .copied()
                .filter(|id| self.conns.get(id).is_none_or(|c| c.deadline <= now)),
        );
        for id in expired {
            let Some(c) = self.conns.get(&id) else {
                self.drop_conn(id);
                continue;
            };
            let (peer, proven) = (c.peer, matches!(c.state, ConnState::Proven));
            self.drop_conn(id);
            let (cause, t) = if proven {
                ("slow hello", self.cfg.timeout)
            } else {
                ("no proof", self.cfg.handshake_timeout)
            };
            self.warn(now, cause, || {
                let what = if proven {
                    "proved the secret but did not send its whole hello"
                } else {
                    "did not prove the secret"
                };
                format!(
                    "connection from {peer} {what} within {}; closed",
                    fmt_dur(t)
                )
            });
        }
        let t = fmt_dur(self.cfg.timeout);
        if !self.joined && now >= self.rendezvous_deadline {
            let addr = self.cfg.addr;
            let msg = match self.nranks {
                None => format!("no rank joined the bootstrap root at {addr} within {t}"),
                Some((n, _)) => {
                    let missing: Vec<u32> =
                        (0..n).filter(|r| !self.ranks.contains_key(r)).collect();
                    format!(
                        "{} did not join within {t} ({} of {n} joined)",
                        fmt_ranks(&missing),
                        self.ranks.len()
                    )
                }
            };
            return self.fail(now, msg, None, false);
        }
        if self.round_deadline().is_some_and(|d| now >= d) {
            let low = self.lowest_round();
            let missing: Vec<u32> = self
                .at
                .iter()
                .filter(|&(_, &r)| r == low)
                .map(|(&k, _)| k)
                .collect();
            let mut msg = format!(
                "{} did not reach bootstrap round {} within {t} (the other ranks did)",
                fmt_ranks(&missing),
                low + 1
            );
            if let Some((_, _, gone)) = self.gone.first() {
                msg.push_str(&format!("; {gone}"));
            }
            self.fail(now, msg, None, false);
        }
    }

    /// The owner stopped the root: connected ranks are told, and the outcome
    /// is `Ok`.
    pub(super) fn handle_shutdown(&mut self, now: Instant) {
        if self.result.is_none() {
            let msg = format!("the bootstrap root at {} was shut down", self.cfg.addr);
            self.fail(now, msg, None, true);
        }
    }

    /// The driver cannot go on (its poll failed): the ranks are told.
    pub(super) fn handle_fatal(&mut self, now: Instant, msg: String) {
        if self.result.is_none() {
            self.fail(now, msg, None, false);
        }
    }

    // ----------------------------------------------------------- internals

    fn send(&mut self, conn: ConnId, bytes: impl Into<Arc<[u8]>>) {
        self.transmits.push_back(Transmit {
            conn,
            bytes: bytes.into(),
        });
    }

    /// Forgets `conn` and asks the driver to close it.
    fn drop_conn(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            if let ConnState::Rank(r) = c.state {
                self.ranks.remove(&r);
            }
        }
        self.unproven.remove(&conn);
        self.proven.remove(&conn);
        self.closes.push_back(conn);
    }

    fn debug(&mut self, msg: String) {
        self.logs.debug(msg);
    }

    /// A warning, at most one per `cause` per interval (see `warnings.rs`).
    fn warn(&mut self, now: Instant, cause: &str, msg: impl FnOnce() -> String) {
        self.logs.warn(now, cause, msg);
    }

    /// Closes a connection that failed the handshake; it never counts as a
    /// rank. `tell`: the message it gets first.
    fn reject(&mut self, now: Instant, conn: ConnId, why: &str, tell: Option<Vec<u8>>) {
        let peer = self.conns.get(&conn).map(|c| c.peer);
        if let Some(frame) = tell {
            self.send(conn, frame);
        }
        self.drop_conn(conn);
        let peer = peer.map_or_else(|| "?".into(), |p| p.to_string());
        self.warn(now, "rejected", || {
            format!("rejected a bootstrap connection from {peer}: {why}")
        });
    }

    fn reject_hello(&mut self, now: Instant, conn: ConnId, e: HelloError) {
        let addr = self.cfg.addr;
        let mismatch = |theirs: u32| {
            format!(
                "bootstrap protocol version mismatch: the root at {addr} speaks v{VERSION}, this \
                 rank v{theirs}; all ranks must run the same braid version"
            )
        };
        match e {
            HelloError::Length(n) => self.reject(
                now,
                conn,
                &format!("frame of {n} bytes (the limit is {MAX_FRAME} bytes)"),
                None,
            ),
            HelloError::NotHello => self.reject(now, conn, "not a braid bootstrap hello", None),
            HelloError::Magic => self.reject(
                now,
                conn,
                "wrong magic (not a braid bootstrap client)",
                None,
            ),
            HelloError::Version(v) => {
                let msg = mismatch(v);
                self.reject(now, conn, &msg, Some(error_frame(&msg)));
            }
            HelloError::Truncated => self.reject(now, conn, "truncated hello", None),
        }
    }

    fn reject_wrong_secret(&mut self, now: Instant, conn: ConnId, rank: u32) {
        let why = format!("a client claiming rank {rank} did not prove the secret");
        let tell = format!(
            "the secret did not match: the bootstrap root at {} does not accept this rank's \
             secret; check that every rank uses the same UniqueId (BRAID_UNIQUE_ID or BRAID_SECRET)",
            self.cfg.addr
        );
        self.reject(now, conn, &why, Some(error_frame(&tell)));
    }

    fn advance_handshake(&mut self, now: Instant, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if matches!(c.state, ConnState::Unproven) {
            match hello_prefix(&c.rbuf.buf) {
                Ok(None) => return,
                Ok(Some(h)) if h.proves(&self.cfg.secret, &c.nonce) => {
                    c.state = ConnState::Proven;
                    // The payload may be large: the whole timeout for it.
                    c.deadline = c.opened + self.cfg.timeout;
                    self.unproven.remove(&conn);
                    self.proven.insert(conn);
                }
                Ok(Some(h)) => return self.reject_wrong_secret(now, conn, h.rank),
                Err(e) => return self.reject_hello(now, conn, e),
            }
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        match c.rbuf.next_frame() {
            Ok(None) => {}
            Ok(Some((kind, body))) => {
                if !c.rbuf.buf.is_empty() {
                    return self.reject(now, conn, "sent data after its hello", None);
                }
                self.handle_hello(now, conn, kind, &body);
            }
            Err(why) => self.reject(now, conn, &why, None),
        }
    }

    fn handle_hello(&mut self, now: Instant, conn: ConnId, kind: u8, body: &[u8]) {
        let (fixed, payload) = match parse_hello(kind, body) {
            Ok(h) => h,
            Err(e) => return self.reject_hello(now, conn, e),
        };
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if !fixed.proves(&self.cfg.secret, &c.nonce) {
            return self.reject_wrong_secret(now, conn, fixed.rank);
        }
        let (peer, rnonce) = (c.peer, c.nonce);
        let HelloFixed {
            rank,
            nranks,
            cnonce,
            ..
        } = fixed;
        if self.joined {
            let msg = format!(
                "rank {rank} tried to join after all {} ranks had joined (a duplicate rank or a \
                 restarted process?)",
                self.ranks.len()
            );
            return self.reject(now, conn, &msg, Some(error_frame(&msg)));
        }
        if nranks == 0 || nranks > MAX_RANKS {
            let msg = format!(
                "rank {rank} says nranks={nranks}, which is out of range (1..={MAX_RANKS})"
            );
            return self.fail(now, msg, Some(conn), false);
        }
        if let Some((n0, r0)) = self.nranks {
            if n0 != nranks {
                let msg = format!("rank {rank} says nranks={nranks}, rank {r0} says {n0}");
                return self.fail(now, msg, Some(conn), false);
            }
        }
        if rank >= nranks {
            let msg = format!(
                "rank {rank} is out of range: nranks={nranks}, so ranks are 0..={}",
                nranks - 1
            );
            return self.fail(now, msg, Some(conn), false);
        }
        if let Some(first) = self.ranks.get(&rank) {
            let first = self
                .conns
                .get(first)
                .map_or_else(|| "?".into(), |c| c.peer.to_string());
            let msg = format!("rank {rank} joined twice (from {first} and from {peer})");
            return self.fail(now, msg, Some(conn), false);
        }
        self.send(
            conn,
            accept_frame(&root_mac(&self.cfg.secret, &cnonce, &rnonce, rank)),
        );
        self.debug(format!("rank {rank}/{nranks} joined from {peer}"));
        self.nranks.get_or_insert((nranks, rank));
        self.proven.remove(&conn);
        self.unproven.remove(&conn);
        if let Some(c) = self.conns.get_mut(&conn) {
            c.state = ConnState::Rank(rank);
        }
        self.ranks.insert(rank, conn);
        self.payloads.insert(rank, payload.to_vec());
        if self.ranks.len() == nranks as usize {
            self.all_joined();
        }
    }

    fn advance_rank(&mut self, now: Instant, rank: u32, conn: ConnId) {
        loop {
            if self.result.is_some() {
                return;
            }
            let Some(c) = self.conns.get_mut(&conn) else {
                return;
            };
            let (kind, body) = match c.rbuf.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => return,
                Err(why) => {
                    let msg = format!("rank {rank} sent a malformed bootstrap message ({why})");
                    return self.fail(now, msg, None, false);
                }
            };
            self.handle_rank_frame(now, rank, kind, &body);
        }
    }

    fn handle_rank_frame(&mut self, now: Instant, rank: u32, kind: u8, body: &[u8]) {
        if kind != K_CONTRIB || !self.joined {
            let msg = format!("rank {rank} sent an unexpected bootstrap message (kind {kind})");
            return self.fail(now, msg, None, false);
        }
        let Some((round, _)) = parse_contrib(body) else {
            let msg = format!("rank {rank} sent a truncated bootstrap contribution");
            return self.fail(now, msg, None, false);
        };
        let was = self.at.get(&rank).copied().unwrap_or(0);
        if round != was + 1 {
            let msg = if round <= was {
                format!("rank {rank} contributed twice to bootstrap round {round}")
            } else {
                format!(
                    "rank {rank} is at bootstrap round {round} but the others are at round {}",
                    was + 1
                )
            };
            return self.fail(now, msg, None, false);
        }
        self.at.insert(rank, round);
        if let Some((_, left_at, msg)) = self.gone.iter().find(|g| g.1 < round) {
            // A round the rank that left will never take part in.
            let msg = format!("{msg} (after round {left_at}; rank {rank} started round {round})");
            return self.fail(now, msg, None, false);
        }
        if self.settle(now) {
            return;
        }
        let low = self.lowest_round();
        if round > low {
            self.first.entry(round).or_insert(now);
        }
        // Rounds every rank has started need no deadline any more.
        self.first.retain(|&r, _| r > low);
    }

    /// The lowest round any rank has started.
    fn lowest_round(&self) -> u64 {
        self.at.values().copied().min().unwrap_or(0)
    }

    /// When the ranks that have not started the next round must have.
    fn round_deadline(&self) -> Option<Instant> {
        self.first
            .values()
            .copied()
            .min()
            .map(|t| t + self.cfg.timeout)
    }

    /// All ranks joined: each gets its successor's hello payload (one
    /// frame each, O(p) bytes in all); the rounds go round the ring.
    fn all_joined(&mut self) {
        let payloads = std::mem::take(&mut self.payloads);
        let n = self.ranks.len() as u32;
        let conns: Vec<(u32, ConnId)> = self.ranks.iter().map(|(&r, &c)| (r, c)).collect();
        for (r, conn) in conns {
            let next = payloads.get(&((r + 1) % n)).map_or(&[][..], |p| &p[..]);
            let mut f = frame_header(K_RING, next.len()).to_vec();
            f.extend_from_slice(next);
            self.send(conn, f);
            self.at.insert(r, 0);
        }
        self.debug(format!(
            "all {n} ranks joined; their rounds go round the ring"
        ));
        self.joined = true;
    }

    fn departed(&mut self, now: Instant, rank: u32, err: Option<String>) {
        // The connection is gone: nothing more goes to it.
        if let Some(conn) = self.ranks.remove(&rank) {
            self.conns.remove(&conn);
        }
        let why = err.map(|e| format!(" ({e})")).unwrap_or_default();
        if !self.joined {
            let msg = format!("rank {rank} left the bootstrap before all ranks joined{why}");
            return self.fail(now, msg, None, false);
        }
        let msg = format!("rank {rank} left the bootstrap{why}");
        let left_at = self.at.remove(&rank).unwrap_or(0);
        // It left before a round another rank started: the others wait for
        // what it would have sent on.
        let behind = self
            .at
            .values()
            .chain(self.gone.iter().map(|g| &g.1))
            .any(|&r| r > left_at);
        if behind {
            return self.fail(now, msg, None, false);
        }
        // It may have finished its last round: the others' contributions
        // to it may still be on their way here. Ranks leave one by one at
        // the end of a job: not a failure once every other rank is seen to
        // have started that round.
        self.gone.push((rank, left_at, msg));
        self.settle(now);
    }

    /// Ends the rendezvous as the end of a job when every rank still here
    /// started the round that the ranks that left had reached. The others
    /// are told (a `K_LEFT` frame), in case they call another round.
    fn settle(&mut self, now: Instant) -> bool {
        let Some(last) = self.gone.iter().map(|g| g.1).max() else {
            return false;
        };
        if self.at.values().any(|&r| r != last) {
            return false;
        }
        let (rank, _, msg) = self.gone.swap_remove(0);
        self.debug(format!("rank {rank} left; the bootstrap root ends"));
        self.fail(now, msg, None, true);
        true
    }

    /// Ends the rendezvous: every rank, every connection that proved the
    /// secret and `extra` get `msg`; every connection is closed. `ok`: the
    /// outcome is `Ok` (a shutdown, or the end of the job).
    fn fail(&mut self, now: Instant, msg: String, extra: Option<ConnId>, ok: bool) {
        if !ok {
            self.logs
                .warn(now, "failed", || format!("bootstrap failed: {msg}"));
        }
        // A departure that fails nothing is said as such: rounds under way
        // on the ring still complete.
        let frame: Arc<[u8]> = if ok {
            left_frame(&msg)
        } else {
            error_frame(&msg)
        }
        .into();
        let mut order: Vec<ConnId> = self.ranks.values().copied().collect();
        let mut seen: BTreeSet<ConnId> = order.iter().copied().collect();
        for conn in self.proven.iter().copied().chain(extra) {
            if seen.insert(conn) {
                order.push(conn);
            }
        }
        for conn in order {
            self.send(conn, frame.clone());
        }
        let all: Vec<ConnId> = self.conns.keys().copied().collect();
        for conn in all {
            self.drop_conn(conn);
        }
        self.logs.flush(now);
        self.result = Some(if ok { Ok(()) } else { Err(msg) });
    }
}

//! A rank's point-to-point exchange with a few other ranks, as a pure state
//! machine: no sockets, no clock, no randomness, like the root's
//! `rendezvous.rs`. `peer.rs` dials, reads, writes, probes and files the
//! requests its listener receives; `rank_sim.rs` checks the machine in
//! memory, several ranks at once.
//!
//! For each [`Ask`] the lower rank of the pair connects to the higher one's
//! listener, sends its message (an `XCHG` frame) and reads the answer (an
//! `XREPLY` frame bound to its nonce) on the same connection; the higher
//! rank waits for that request and answers it. All asks of one exchange are
//! waited for together, so ranks that need each other in any order all get
//! through. A peer this rank waits for is probed every [`PROBE_EVERY`]
//! (nothing listening: it is gone). A peer that fails the exchange (gone,
//! closed, garbage) is named at once, together with the other peers of the
//! exchange that are gone too (a rank that gave up because a third one is
//! gone exits and so looks gone itself: the first cause is among them); one
//! that does not answer by the deadline is named then.
//!
//! Inputs are `handle_*`, outputs `poll_*`, [`Exchange::transmit`],
//! [`Exchange::wants_request`] and [`Exchange::wants_read`]; each slot (an ask,
//! by its index) has at most one connection, which the driver holds.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::wire::{FrameBuf, PeerFrame, K_XCHG, K_XREPLY};
use super::{fmt_dur, fmt_ranks};
use crate::error::Error;

/// How often a rank waiting for another's exchange request checks that the
/// other's listener is still there.
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(250);

/// Why an exchange failed.
#[derive(Debug)]
pub(crate) enum ExchangeError {
    /// `peer` is gone, closed the connection, broke the protocol or did not
    /// answer in time (`timed_out`).
    Peer {
        peer: u32,
        what: String,
        timed_out: Option<Duration>,
    },
    /// The caller's abort flag was set.
    Aborted,
    /// Something local (a socket, the clock).
    Local(Error),
}

impl std::fmt::Display for ExchangeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExchangeError::Peer { what, .. } => f.write_str(what),
            ExchangeError::Aborted => f.write_str("aborted by the caller"),
            ExchangeError::Local(e) => write!(f, "{e}"),
        }
    }
}

impl From<ExchangeError> for Error {
    fn from(e: ExchangeError) -> Error {
        match e {
            ExchangeError::Local(e) => e,
            ExchangeError::Aborted => Error::Unusable("aborted by the caller".into()),
            e => Error::Bootstrap(e.to_string()),
        }
    }
}

/// One message for an exchange: `msg` to `peer`, whose answer is the
/// result; both ranks must call with the same `tag` for each other.
#[derive(Clone, Debug)]
pub(crate) struct Ask {
    pub peer: u32,
    pub tag: u64,
    pub msg: Vec<u8>,
}

/// How an exchange ended: the peers' messages in the order of the asks, or
/// why not.
pub(super) type Outcome = Result<Vec<Vec<u8>>, ExchangeError>;

/// The error of a peer whose listener refuses connections.
pub(super) fn gone_msg(peer: u32, addr: SocketAddr) -> String {
    format!(
        "rank {peer} is gone: nothing listens at its bootstrap address {addr} any more (its \
         process exited or was killed)"
    )
}

/// A connection the driver is done with: it drops it, after shutting its
/// write side if `shutdown` (an answer that is out: the asker sees its end
/// at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Close {
    pub slot: usize,
    pub shutdown: bool,
}

/// Where one ask stands.
#[derive(Debug)]
enum State {
    /// This rank is the lower: a connection to the peer is to be made.
    Dial,
    /// We asked on our connection; the answer arrives into `buf`.
    Asked {
        nonce: [u8; 16],
        out: Vec<u8>,
        at: usize,
        buf: FrameBuf,
    },
    /// We wait for the peer's request.
    Waiting,
    /// We answer on the request's connection.
    Answering {
        out: Vec<u8>,
        at: usize,
        theirs: Vec<u8>,
    },
    Done(Vec<u8>),
}

/// A peer's failure whose other gone peers are being looked for (probes
/// under way) before it is the outcome.
#[derive(Debug)]
struct Naming {
    peer: u32,
    what: String,
    /// Peers still to probe, and those found gone.
    to_probe: VecDeque<u32>,
    probing: usize,
    gone: Vec<u32>,
}

/// One exchange of this rank. See the module documentation.
#[derive(Debug)]
pub(super) struct Exchange<'a> {
    rank: u32,
    secret: [u8; 16],
    asks: &'a [Ask],
    addrs: Vec<SocketAddr>,
    states: Vec<State>,
    start: Instant,
    deadline: Instant,
    next_probe: Instant,
    /// Peers to probe now (the periodic probe of the peers waited for).
    to_probe: VecDeque<u32>,
    naming: Option<Naming>,
    closes: VecDeque<Close>,
    outcome: Option<Outcome>,
    /// The outcome was taken.
    over: bool,
}

impl<'a> Exchange<'a> {
    /// An exchange of `rank` of `nranks` (whose listeners are at `addrs`,
    /// by rank) started at `now`, failing at `deadline`. Refuses asks of a
    /// rank out of range or of this one, and asks before the addresses are
    /// known, before anything is sent.
    pub(super) fn new(
        rank: u32,
        nranks: u32,
        secret: [u8; 16],
        addrs: &[SocketAddr],
        asks: &'a [Ask],
        now: Instant,
        deadline: Instant,
    ) -> Result<Exchange<'a>, ExchangeError> {
        let mut peer_addrs = Vec::with_capacity(asks.len());
        let mut states = Vec::with_capacity(asks.len());
        for a in asks {
            if a.peer >= nranks || a.peer == rank {
                return Err(ExchangeError::Local(Error::InvalidArgument(format!(
                    "bootstrap exchange with rank {} (this is rank {rank} of {nranks})",
                    a.peer
                ))));
            }
            let Some(&addr) = addrs.get(a.peer as usize) else {
                return Err(ExchangeError::Local(Error::Bootstrap(
                    "exchange before the ranks' addresses are known".into(),
                )));
            };
            peer_addrs.push(addr);
            states.push(if a.peer > rank {
                State::Dial
            } else {
                State::Waiting
            });
        }
        let mut x = Exchange {
            rank,
            secret,
            asks,
            addrs: peer_addrs,
            states,
            start: now,
            deadline,
            next_probe: now + PROBE_EVERY,
            to_probe: VecDeque::new(),
            naming: None,
            closes: VecDeque::new(),
            outcome: None,
            over: false,
        };
        x.check_done();
        Ok(x)
    }

    /// Whether the exchange has failed or ended: inputs change nothing any
    /// more (a failure may still be looking for other gone peers).
    fn ended(&self) -> bool {
        self.outcome.is_some() || self.naming.is_some() || self.over
    }

    /// The next ask whose connection the driver must make (to its peer's
    /// listener at the address given): it answers with
    /// [`Exchange::handle_connected`] or [`Exchange::handle_dial_failed`]
    /// before it polls again.
    pub(super) fn poll_dial(&self) -> Option<(usize, u32, SocketAddr)> {
        if self.ended() {
            return None;
        }
        let i = self.states.iter().position(|s| matches!(s, State::Dial))?;
        Some((i, self.asks[i].peer, self.addrs[i]))
    }

    /// Ask `slot`'s message as a frame of `kind`, bound to `nonce`.
    fn seal(&self, slot: usize, kind: u8, nonce: [u8; 16]) -> Vec<u8> {
        let a = &self.asks[slot];
        PeerFrame::sealed(kind, &self.secret, self.rank, a.peer, a.tag, nonce, &a.msg)
    }

    /// Ask `slot`'s connection is made; `nonce` (random) binds the answer
    /// to it.
    pub(super) fn handle_connected(&mut self, slot: usize, nonce: [u8; 16]) {
        if self.ended() || !matches!(self.states[slot], State::Dial) {
            return;
        }
        let out = self.seal(slot, K_XCHG, nonce);
        self.states[slot] = State::Asked {
            nonce,
            out,
            at: 0,
            buf: FrameBuf::default(),
        };
    }

    /// Making a connection (or its nonce) failed: the exchange fails with
    /// `e`.
    pub(super) fn handle_dial_failed(&mut self, e: ExchangeError) {
        self.fail(e);
    }

    /// Whether ask `slot` waits for its peer's request: `(peer, tag)`. The
    /// driver hands a request that matches to [`Exchange::handle_request`].
    pub(super) fn wants_request(&self, slot: usize) -> Option<(u32, u64)> {
        let a = &self.asks[slot];
        (!self.ended() && matches!(self.states[slot], State::Waiting)).then_some((a.peer, a.tag))
    }

    /// The peer's proven request for ask `slot` arrived (its `nonce` and
    /// `payload`); the driver now holds its connection for the slot.
    pub(super) fn handle_request(&mut self, slot: usize, nonce: [u8; 16], payload: Vec<u8>) {
        if self.ended() || !matches!(self.states[slot], State::Waiting) {
            return;
        }
        let out = self.seal(slot, K_XREPLY, nonce);
        self.states[slot] = State::Answering {
            out,
            at: 0,
            theirs: payload,
        };
    }

    /// The bytes to write to ask `slot`'s connection now (empty: nothing).
    pub(super) fn transmit(&self, slot: usize) -> &[u8] {
        if self.ended() {
            return &[];
        }
        match &self.states[slot] {
            State::Asked { out, at, .. } | State::Answering { out, at, .. } => &out[*at..],
            _ => &[],
        }
    }

    /// `n` bytes of [`Exchange::transmit`] were written to `slot`'s
    /// connection.
    pub(super) fn handle_sent(&mut self, slot: usize, n: usize) {
        if self.ended() {
            return;
        }
        match &mut self.states[slot] {
            State::Asked { out, at, .. } => *at = (*at + n).min(out.len()),
            State::Answering { out, at, theirs } => {
                *at = (*at + n).min(out.len());
                if *at == out.len() {
                    let theirs = std::mem::take(theirs);
                    self.states[slot] = State::Done(theirs);
                    self.closes.push_back(Close {
                        slot,
                        shutdown: true,
                    });
                    self.check_done();
                }
            }
            _ => {}
        }
    }

    /// Whether the driver should read `slot`'s connection (the answer is
    /// awaited).
    pub(super) fn wants_read(&self, slot: usize) -> bool {
        !self.ended() && matches!(self.states[slot], State::Asked { .. })
    }

    /// Bytes arrived on `slot`'s connection.
    pub(super) fn handle_data(&mut self, slot: usize, bytes: &[u8]) {
        if self.ended() {
            return;
        }
        let (peer, tag) = (self.asks[slot].peer, self.asks[slot].tag);
        let State::Asked { nonce, buf, .. } = &mut self.states[slot] else {
            return;
        };
        buf.buf.extend_from_slice(bytes);
        let what = match buf.next_frame() {
            Ok(None) => return,
            Ok(Some((K_XREPLY, body))) => {
                let f = PeerFrame::parse(&body).ok().filter(|f| {
                    f.proves(K_XREPLY, &self.secret)
                        && f.from == peer
                        && f.to == self.rank
                        && f.word == tag
                        && f.nonce == *nonce
                });
                match f {
                    Some(f) => {
                        self.states[slot] = State::Done(f.payload);
                        self.closes.push_back(Close {
                            slot,
                            shutdown: false,
                        });
                        self.check_done();
                        return;
                    }
                    None => {
                        format!("rank {peer} answered with an invalid message (protocol error)")
                    }
                }
            }
            Ok(Some((kind, _))) => {
                format!("rank {peer} answered with a message of kind {kind} (protocol error)")
            }
            Err(e) => format!("rank {peer} answered with garbage ({e})"),
        };
        self.fail_peer(peer, what);
    }

    /// `slot`'s connection ended (`error`: how writing or reading it failed;
    /// `None`: the peer closed it) before the exchange on it was done.
    pub(super) fn handle_closed(&mut self, slot: usize, error: Option<String>) {
        if self.ended()
            || !matches!(
                self.states[slot],
                State::Asked { .. } | State::Answering { .. }
            )
        {
            return;
        }
        let peer = self.asks[slot].peer;
        let e = error.unwrap_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof).to_string());
        self.fail_peer(
            peer,
            format!(
                "rank {peer} closed its bootstrap connection before answering ({e}); did it exit?"
            ),
        );
    }

    /// The caller's abort flag is set: the exchange ends, unless it is
    /// over already.
    pub(super) fn handle_abort(&mut self) {
        if !self.ended() {
            self.outcome = Some(Err(ExchangeError::Aborted));
        }
    }

    /// The clock reached `now`: past the deadline the first ask not done
    /// names its peer; every [`PROBE_EVERY`] the peers waited for are to
    /// be probed.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        if self.ended() {
            return;
        }
        if now >= self.deadline {
            let (peer, asked) = self
                .asks
                .iter()
                .zip(&self.states)
                .find(|(_, s)| !matches!(s, State::Done(_)))
                .map(|(a, s)| (a.peer, matches!(s, State::Asked { .. })))
                .unwrap_or((0, false));
            let waited = now.saturating_duration_since(self.start);
            self.outcome = Some(Err(ExchangeError::Peer {
                peer,
                what: format!(
                    "rank {peer} did not {} within {} (is it stuck, or in another operation?)",
                    if asked {
                        "answer this rank's connection request"
                    } else {
                        "send its connection request"
                    },
                    fmt_dur(waited)
                ),
                timed_out: Some(waited),
            }));
            return;
        }
        if now >= self.next_probe {
            self.next_probe = now + PROBE_EVERY;
            for (a, s) in self.asks.iter().zip(&self.states) {
                if matches!(s, State::Waiting) {
                    self.to_probe.push_back(a.peer);
                }
            }
        }
    }

    /// When [`Exchange::handle_timeout`] must be called next.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        (!self.ended()).then(|| self.deadline.min(self.next_probe))
    }

    /// A peer whose listener the driver must probe now (at its address):
    /// it answers with [`Exchange::handle_probe`].
    pub(super) fn poll_probe(&mut self) -> Option<(u32, SocketAddr)> {
        let peer = match self.naming.as_mut() {
            Some(n) => {
                let p = n.to_probe.pop_front()?;
                n.probing += 1;
                p
            }
            None if self.outcome.is_some() || self.over => return None,
            None => self.to_probe.pop_front()?,
        };
        Some((peer, self.addr_of(peer)))
    }

    /// The probe of `peer` found nothing listening (`refused`), or found
    /// it there (or could not tell in time: the deadline decides).
    pub(super) fn handle_probe(&mut self, peer: u32, refused: bool) {
        if let Some(n) = self.naming.as_mut() {
            n.probing = n.probing.saturating_sub(1);
            if refused {
                n.gone.push(peer);
            }
            self.check_named();
            return;
        }
        if refused && !self.ended() {
            self.to_probe.clear();
            let what = gone_msg(peer, self.addr_of(peer));
            self.fail_peer(peer, what);
        }
    }

    /// A connection the driver is done with.
    pub(super) fn poll_close(&mut self) -> Option<Close> {
        self.closes.pop_front()
    }

    /// The exchange's outcome, once.
    pub(super) fn poll_outcome(&mut self) -> Option<Outcome> {
        let o = self.outcome.take();
        self.over |= o.is_some();
        o
    }

    fn addr_of(&self, peer: u32) -> SocketAddr {
        let i = self.asks.iter().position(|a| a.peer == peer).unwrap_or(0);
        self.addrs[i]
    }

    fn fail_peer(&mut self, peer: u32, what: String) {
        self.fail(ExchangeError::Peer {
            peer,
            what,
            timed_out: None,
        });
    }

    /// Ends the exchange with `e`; a peer's failure first looks for the
    /// other peers of the exchange (not done yet) that are gone too.
    fn fail(&mut self, e: ExchangeError) {
        if self.ended() {
            return;
        }
        match e {
            ExchangeError::Peer {
                peer,
                what,
                timed_out: None,
            } => {
                let to_probe = self
                    .asks
                    .iter()
                    .zip(&self.states)
                    .filter(|(a, s)| !matches!(s, State::Done(_)) && a.peer != peer)
                    .map(|(a, _)| a.peer)
                    .collect();
                self.naming = Some(Naming {
                    peer,
                    what,
                    to_probe,
                    probing: 0,
                    gone: Vec::new(),
                });
                self.check_named();
            }
            e => self.outcome = Some(Err(e)),
        }
    }

    /// The failure's probes are all answered: it is the outcome.
    fn check_named(&mut self) {
        if !self
            .naming
            .as_ref()
            .is_some_and(|n| n.to_probe.is_empty() && n.probing == 0)
        {
            return;
        }
        let Some(mut n) = self.naming.take() else {
            return;
        };
        if !n.gone.is_empty() {
            n.what += &format!(
                "; {} of this exchange {} gone too",
                fmt_ranks(&n.gone),
                if n.gone.len() == 1 { "is" } else { "are" }
            );
        }
        self.outcome = Some(Err(ExchangeError::Peer {
            peer: n.peer,
            what: n.what,
            timed_out: None,
        }));
    }

    fn check_done(&mut self) {
        if self.ended() || !self.states.iter().all(|s| matches!(s, State::Done(_))) {
            return;
        }
        let v = self
            .states
            .iter_mut()
            .map(|s| match s {
                State::Done(v) => std::mem::take(v),
                _ => Vec::new(),
            })
            .collect();
        self.outcome = Some(Ok(v));
    }
}

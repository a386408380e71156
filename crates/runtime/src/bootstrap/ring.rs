//! A rank's all-gather rounds on the bootstrap ring as a pure state
//! machine: no sockets and no clock, like the root's `rendezvous.rs`.
//! `peer.rs` feeds it what the sockets and the root say and writes what it
//! asks for; `sim.rs` checks it in memory.
//!
//! Each rank sends its contribution to its successor and forwards what its
//! predecessor sends (except the successor's own), so contributions arrive
//! nearest first: the predecessor's, then the one before it, and so on.
//! That order is what lets a rank that times out name the rank that holds
//! the ring up instead of listing the contributions it misses: if rank `s`'s
//! own contribution arrived but not that of the rank before `s`, then `s`
//! (which had it to forward, unless its predecessor never sent it) is the
//! one stopped or stuck.
//!
//! Inputs are `handle_*`, outputs `transmit` (bytes for the successor),
//! `poll_outcome` and `poll_timeout`.

use std::time::{Duration, Instant};

use super::wire::{data_header, parse_data, FrameBuf, K_DATA, K_ERROR};
use super::{fmt_dur, fmt_ranks};

/// How a round ended: every rank's contribution in rank order, or why not.
pub(super) type Outcome = Result<Vec<Vec<u8>>, String>;

/// One round under way.
#[derive(Debug)]
struct Round {
    round: u64,
    got: Vec<Option<Vec<u8>>>,
    have: usize,
    /// When the caller began to wait for this round (for round 0: when the
    /// rank began to join), for messages.
    since: Instant,
    /// The round fails then (the caller's deadline plus its grace).
    deadline: Instant,
    /// How long the ring may stand still after the root reported a failure
    /// before that failure ends the round; also how long a failure seen on
    /// the ring waits for the root's word (which names the cause).
    grace: Duration,
    /// When a byte last moved on the ring.
    moved: Instant,
    /// A failure seen on the ring, reported as such at the given time
    /// unless the root says more first.
    failing: Option<(String, Instant)>,
}

/// A rank's side of the ring, across rounds.
#[derive(Debug)]
pub(super) struct Ring {
    rank: u32,
    nranks: u32,
    /// From the predecessor, not yet taken: frames of the next round may
    /// wait here.
    inbuf: FrameBuf,
    /// For the successor; the first `out_at` bytes are written.
    out: Vec<u8>,
    out_at: usize,
    /// What the root reported during a round (kept for the next).
    root_said: Option<String>,
    /// `root_said` is a rank leaving after its last round: rounds that
    /// still move are not failed by it.
    root_said_left: bool,
    round: Option<Round>,
    outcome: Option<Outcome>,
}

impl Ring {
    pub(super) fn new(rank: u32, nranks: u32) -> Ring {
        Ring {
            rank,
            nranks,
            inbuf: FrameBuf::default(),
            out: Vec::new(),
            out_at: 0,
            root_said: None,
            root_said_left: false,
            round: None,
            outcome: None,
        }
    }

    fn p(&self) -> usize {
        self.nranks as usize
    }

    fn prev(&self) -> u32 {
        (self.rank + self.nranks - 1) % self.nranks
    }

    fn next(&self) -> u32 {
        (self.rank + 1) % self.nranks
    }

    fn what(&self, round: u64) -> String {
        format!(
            "in bootstrap round {round} (rank {} of {})",
            self.rank, self.nranks
        )
    }

    /// Starts round `round` with this rank's `data` at `now`; it fails at
    /// `deadline` (which includes `grace`). `since`: when the caller began
    /// to wait, for the messages.
    pub(super) fn start(
        &mut self,
        now: Instant,
        round: u64,
        data: &[u8],
        since: Instant,
        deadline: Instant,
        grace: Duration,
    ) {
        let p = self.p();
        let mut got = vec![None; p];
        got[self.rank as usize] = Some(data.to_vec());
        self.outcome = None;
        if p == 1 {
            self.outcome = Some(Ok(got.into_iter().flatten().collect()));
            return;
        }
        self.out.drain(..self.out_at);
        self.out_at = 0;
        self.out
            .extend_from_slice(&data_header(round, self.rank, data.len()));
        self.out.extend_from_slice(data);
        self.round = Some(Round {
            round,
            got,
            have: 1,
            since,
            deadline,
            grace,
            moved: now,
            failing: None,
        });
        // Frames of this round that arrived with the last one.
        self.take_frames();
        self.check_done();
    }

    /// The bytes to write to the successor now (empty: nothing).
    pub(super) fn transmit(&self) -> &[u8] {
        &self.out[self.out_at..]
    }

    /// `n` bytes of [`Ring::transmit`] were written at `now`.
    pub(super) fn handle_sent(&mut self, now: Instant, n: usize) {
        self.out_at = (self.out_at + n).min(self.out.len());
        if self.out_at == self.out.len() {
            self.out.clear();
            self.out_at = 0;
        }
        if n > 0 {
            if let Some(r) = self.round.as_mut() {
                r.moved = now;
            }
        }
        self.check_done();
    }

    /// Writing to the successor failed at `now`.
    pub(super) fn handle_send_failed(&mut self, now: Instant, error: &str) {
        let Some(r) = self.round.as_ref() else {
            return;
        };
        let msg = format!(
            "rank {} left the bootstrap (its ring connection failed: {error}) {}",
            self.next(),
            self.what(r.round)
        );
        self.fail_soon(now, msg);
    }

    /// Bytes arrived from the predecessor at `now`.
    pub(super) fn handle_data(&mut self, now: Instant, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.inbuf.buf.extend_from_slice(bytes);
        if let Some(r) = self.round.as_mut() {
            r.moved = now;
        }
        self.take_frames();
        self.check_done();
    }

    /// The predecessor's connection ended at `now`.
    pub(super) fn handle_prev_closed(&mut self, now: Instant) {
        let Some(r) = self.round.as_ref() else {
            return;
        };
        if r.have == self.p() {
            return;
        }
        let msg = format!(
            "rank {} left the bootstrap (its ring connection to rank {} closed) {}",
            self.prev(),
            self.rank,
            self.what(r.round)
        );
        self.fail_soon(now, msg);
    }

    /// The root said `word` at `now` (its error, or that its connection
    /// closed); `left`: it is only that a rank left after its last round.
    pub(super) fn handle_root(&mut self, now: Instant, word: String, left: bool) {
        self.root_said = Some(word.clone());
        self.root_said_left = left;
        if self.round.as_ref().is_some_and(|r| r.failing.is_some()) {
            self.finish(Err(word));
            return;
        }
        self.handle_timeout(now);
    }

    /// The clock reached `now`.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        let Some(r) = self.round.as_ref() else {
            return;
        };
        if let Some((msg, at)) = &r.failing {
            if now >= *at {
                let msg = msg.clone();
                self.finish(Err(msg));
            }
            return;
        }
        if let (Some(word), false) = (&self.root_said, self.root_said_left) {
            // A failure the root reported (a late rank) ends the round once
            // the ring stands still; a round that still moves may complete.
            if now.saturating_duration_since(r.moved) >= r.grace {
                let word = word.clone();
                self.finish(Err(word));
                return;
            }
        }
        if now >= r.deadline {
            let msg = self.overdue(now);
            self.finish(Err(msg));
        }
    }

    /// When [`Ring::handle_timeout`] must be called next.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        let r = self.round.as_ref()?;
        if let Some((_, at)) = &r.failing {
            return Some(*at);
        }
        let still = match (&self.root_said, self.root_said_left) {
            (Some(_), false) => Some(r.moved + r.grace),
            _ => None,
        };
        Some(still.map_or(r.deadline, |s| s.min(r.deadline)))
    }

    /// Whether the driver should read the root's connection (nothing heard
    /// from it yet).
    pub(super) fn wants_root(&self) -> bool {
        self.root_said.is_none()
    }

    /// Whether a round's outcome waits to be taken.
    pub(super) fn has_outcome(&self) -> bool {
        self.outcome.is_some()
    }

    /// The round's outcome, once (then no round is under way).
    pub(super) fn poll_outcome(&mut self) -> Option<Outcome> {
        self.outcome.take()
    }

    /// What the root reported in an earlier round.
    pub(super) fn root_said(&self) -> Option<&str> {
        self.root_said.as_deref()
    }

    fn finish(&mut self, o: Result<(), String>) {
        if let Some(r) = self.round.take() {
            self.outcome = Some(match o {
                Ok(()) => Ok(r.got.into_iter().flatten().collect()),
                Err(e) => Err(e),
            });
        }
    }

    /// A failure seen on the ring: the root's word if it has spoken, or
    /// else this message once `grace` passes without it.
    fn fail_soon(&mut self, now: Instant, msg: String) {
        if let Some(w) = &self.root_said {
            let w = w.clone();
            self.finish(Err(w));
            return;
        }
        if let Some(r) = self.round.as_mut() {
            if r.failing.is_none() {
                r.failing = Some((msg, now + r.grace));
            }
        }
    }

    fn check_done(&mut self) {
        let done = self
            .round
            .as_ref()
            .is_some_and(|r| r.have == self.p() && self.out.is_empty());
        if done {
            self.finish(Ok(()));
        }
    }

    /// Takes this round's frames from the predecessor's bytes, forwarding
    /// them to the successor.
    fn take_frames(&mut self) {
        let p = self.p();
        let (me, next, prev) = (self.rank as usize, self.next() as usize, self.prev());
        loop {
            let Some(r) = self.round.as_mut() else {
                return;
            };
            if r.have == p || r.failing.is_some() {
                return;
            }
            let round = r.round;
            let (kind, body) = match self.inbuf.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => return,
                Err(e) => {
                    let what = self.what(round);
                    return self.finish(Err(format!("rank {prev} sent garbage ({e}) {what}")));
                }
            };
            if kind == K_ERROR {
                return self.finish(Err(String::from_utf8_lossy(&body).into_owned()));
            }
            let (src, bytes) = match parse_round_data(kind, &body, round, p) {
                Ok(d) => d,
                Err(e) => {
                    let what = self.what(round);
                    return self
                        .finish(Err(format!("rank {prev} sent {e} {what} (protocol error)")));
                }
            };
            let Some(r) = self.round.as_mut() else {
                return;
            };
            if src == me || r.got[src].is_some() {
                let what = self.what(round);
                return self.finish(Err(format!(
                    "rank {prev} forwarded rank {src}'s contribution twice {what} (protocol error)"
                )));
            }
            if src != next {
                self.out
                    .extend_from_slice(&data_header(round, src as u32, bytes.len()));
                self.out.extend_from_slice(bytes);
            }
            r.got[src] = Some(bytes.to_vec());
            r.have += 1;
        }
    }

    /// The error of a round past its deadline: which rank holds the ring
    /// up, and how long this rank waited.
    fn overdue(&self, now: Instant) -> String {
        let Some(r) = self.round.as_ref() else {
            return String::new();
        };
        let p = self.p();
        let me = self.rank as usize;
        let waited = fmt_dur(now.saturating_duration_since(r.since));
        let head = format!(
            "bootstrap round {} did not complete within {waited}",
            r.round
        );
        if r.have == p {
            let next = self.next();
            return format!(
                "{head}: every rank's contribution arrived at rank {me}, but rank {next} has not \
                 taken the {} bytes rank {me} still has to pass on (is rank {next} stopped or \
                 stuck?)",
                self.transmit().len()
            );
        }
        let at = |d: usize| (me + p - d) % p;
        let missing: Vec<u32> = (0..p)
            .filter(|&s| r.got[s].is_none())
            .map(|s| s as u32)
            .collect();
        // The nearest rank (going back round the ring) whose contribution
        // is missing; everything nearer arrived.
        let d = (1..p).find(|&d| r.got[at(d)].is_none()).unwrap_or(1);
        let blame = if d == 1 {
            let prev = self.prev();
            format!(
                "nothing arrived from rank {prev}, not even its own contribution (is rank \
                 {prev} stopped or stuck?)"
            )
        } else {
            let (s, y) = (at(d - 1), at(d));
            format!(
                "rank {s} passed on its own contribution but not rank {y}'s (is rank {s} \
                 stopped or stuck, or did rank {y} never send its own?)"
            )
        };
        format!(
            "{head}: the contributions of {} did not arrive at rank {me}; {blame}",
            fmt_ranks(&missing)
        )
    }
}

/// One ring `DATA` frame of `round` from any rank below `p`: its rank and
/// bytes.
fn parse_round_data(
    kind: u8,
    body: &[u8],
    round: u64,
    p: usize,
) -> std::result::Result<(usize, &[u8]), String> {
    if kind != K_DATA || body.len() < 12 {
        return Err(format!("a message of kind {kind}"));
    }
    let src = u32::from_le_bytes([body[8], body[9], body[10], body[11]]);
    if src as usize >= p {
        return Err(format!("a contribution of rank {src}"));
    }
    parse_data(kind, body, round, src).map(|d| (src as usize, d))
}

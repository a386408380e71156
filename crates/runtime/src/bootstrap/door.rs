//! A rank's listener under load, as a pure policy (no sockets, no clock):
//! when to call `accept`, how long to pause after it failed, which waiting
//! connection to give up to free a descriptor, what a connection is by its
//! first frame ([`first_frame`]), and the rate-limited warnings about
//! connections that are dropped. `peer.rs` holds the sockets and asks;
//! `rank_sim.rs` checks it in memory.
//!
//! Before this policy a failing `accept` (EMFILE: the process at its
//! descriptor limit, as when strangers hold the root's connections) left
//! the connection queued, so the listener stayed readable and the rank's
//! wait loop called `accept` and `poll` tens of thousands of times a second.
//! Now `accept` pauses, 10 ms doubling to 1 s while it keeps failing, and
//! the listener is not polled while it pauses; out of descriptors, the
//! oldest connection still sending its first frame is closed (if it has
//! had [`EVICT_MIN_AGE`]) so that the next `accept` fits.

use std::time::{Duration, Instant};

use super::fmt_dur;
use super::rendezvous::{ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN, EVICT_MIN_AGE};
use super::warnings::{LogLine, Warnings};
use super::wire::{PeerFrame, K_PROBE, K_RING_HELLO, K_XCHG};

/// What to do after a failed `accept`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AfterFailure {
    /// Close the oldest waiting connection and accept again at once.
    EvictOldest,
    /// Accept again at the given time.
    Pause(Instant),
}

/// The listener's policy. See the module documentation.
#[derive(Debug)]
pub(super) struct Door {
    rank: u32,
    /// `accept` failed: the next attempt waits until then.
    resume: Option<Instant>,
    backoff: Duration,
    logs: Warnings,
}

impl Door {
    pub(super) fn new(rank: u32) -> Door {
        Door {
            rank,
            resume: None,
            backoff: Duration::ZERO,
            logs: Warnings::default(),
        }
    }

    /// Whether the driver should poll the listener and `accept` at `now`.
    pub(super) fn accepting(&self, now: Instant) -> bool {
        self.resume.is_none_or(|t| now >= t)
    }

    /// When [`Door::handle_timeout`] must be called next.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        [self.resume, self.logs.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    /// The clock reached `now`.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        if self.resume.is_some_and(|t| now >= t) {
            self.resume = None;
        }
        self.logs.handle_timeout(now);
    }

    /// `accept` gave a connection: the pause after failures starts over.
    pub(super) fn handle_accepted(&mut self) {
        self.backoff = Duration::ZERO;
    }

    /// `accept` failed at `now` with `msg`; `out_of_fds`: EMFILE or the
    /// like. `oldest`: when the oldest connection still sending its first
    /// frame arrived (if one is held).
    pub(super) fn handle_accept_failed(
        &mut self,
        now: Instant,
        out_of_fds: bool,
        msg: &str,
        oldest: Option<Instant>,
    ) -> AfterFailure {
        self.backoff = (self.backoff * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
        let evict =
            out_of_fds && oldest.is_some_and(|t| now.saturating_duration_since(t) >= EVICT_MIN_AGE);
        let rank = self.rank;
        let hint = if out_of_fds {
            " (this process is out of file descriptors: raise its limit, e.g. `ulimit -n 65536`, \
             or find who holds connections to it)"
        } else {
            ""
        };
        let then = if evict {
            "closed the oldest connection still sending its first frame to make room".to_string()
        } else {
            format!("pausing accept for {}", fmt_dur(self.backoff))
        };
        self.logs.warn(now, &format!("accept: {msg}"), || {
            format!("rank {rank}: the bootstrap listener cannot accept a connection: {msg}{hint}; {then}")
        });
        if evict {
            self.resume = None;
            return AfterFailure::EvictOldest;
        }
        let at = now + self.backoff;
        self.resume = Some(at);
        AfterFailure::Pause(at)
    }

    /// A connection to the listener was dropped at `now` for `why`.
    pub(super) fn handle_stranger(&mut self, now: Instant, why: &str) {
        let rank = self.rank;
        self.logs.warn(now, "dropped", || {
            format!("rank {rank}: bootstrap: dropped a connection to this rank's listener: {why}")
        });
    }

    /// The listener closes at `now`: every count of left-out warnings is
    /// said.
    pub(super) fn handle_close(&mut self, now: Instant) {
        self.logs.flush(now);
    }

    /// The next log line.
    pub(super) fn poll_log(&mut self) -> Option<LogLine> {
        self.logs.poll_log()
    }
}

/// What a connection to a rank's listener is, by its first frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum FirstFrame {
    /// A probe: dropped, nothing to say.
    Probe,
    /// The predecessor's proven ring hello: the ring's first round may
    /// follow at once.
    RingHello,
    /// A lower rank's proven exchange request.
    Request {
        from: u32,
        tag: u64,
        nonce: [u8; 16],
        payload: Vec<u8>,
    },
    /// Anything else: dropped, for this reason.
    Stranger(String),
}

/// Files a connection to the listener of `rank` of `nranks` by its first
/// frame (`kind`, `body`); `ring_open`: the predecessor's ring connection
/// is still awaited.
pub(super) fn first_frame(
    rank: u32,
    nranks: u32,
    secret: &[u8; 16],
    ring_open: bool,
    kind: u8,
    body: &[u8],
) -> FirstFrame {
    if kind == K_PROBE {
        return FirstFrame::Probe;
    }
    if kind != K_RING_HELLO && kind != K_XCHG {
        return FirstFrame::Stranger(format!("a first frame of kind {kind}"));
    }
    let f = match PeerFrame::parse(body) {
        Ok(f) => f,
        Err(e) => return FirstFrame::Stranger(e),
    };
    if !f.proves(kind, secret) {
        return FirstFrame::Stranger("it did not prove the secret (another job's rank?)".into());
    }
    if f.to != rank || f.from >= nranks {
        return FirstFrame::Stranger(format!(
            "a message from rank {} to rank {} reached rank {rank} (ranks disagree on their \
             addresses?)",
            f.from, f.to
        ));
    }
    if kind == K_RING_HELLO {
        let prev = (rank + nranks - 1) % nranks;
        if f.from == prev && f.word == u64::from(nranks) && ring_open {
            return FirstFrame::RingHello;
        }
        return FirstFrame::Stranger(format!(
            "an unexpected ring connection from rank {}",
            f.from
        ));
    }
    if f.from >= rank {
        return FirstFrame::Stranger(format!(
            "an exchange request from rank {}, which is not below this rank",
            f.from
        ));
    }
    FirstFrame::Request {
        from: f.from,
        tag: f.word,
        nonce: f.nonce,
        payload: f.payload,
    }
}

//! The rank side of the bootstrap in memory: the ring's rounds (`ring.rs`)
//! and the listener's policy (`door.rs`) driven by a simulated clock and
//! simulated sockets, for the cases a hostile or unlucky peer makes —
//! a rank stopped in the middle of a round, a successor that takes
//! nothing, a process out of descriptors — without a socket or a sleep.

use std::time::{Duration, Instant};

use super::door::{AfterFailure, Door};
use super::ring::{Outcome, Ring};
use super::warnings::Level;

/// `p` ring machines joined by simulated sockets.
struct RingSim {
    now: Instant,
    m: Vec<Ring>,
    /// A stopped rank neither sends nor reads (SIGSTOP).
    stopped: Vec<bool>,
    /// A deaf rank sends what it has but reads nothing (stopped right after
    /// sending its own contribution).
    deaf: Vec<bool>,
    /// Bytes written by rank r, not yet read by r + 1, and how many the
    /// connection holds at most (the kernel's buffers).
    inflight: Vec<Vec<u8>>,
    cap: Vec<usize>,
    outcomes: Vec<Option<Outcome>>,
}

const TIMEOUT: Duration = Duration::from_secs(5);
const GRACE: Duration = Duration::from_millis(500);

impl RingSim {
    fn new(p: u32) -> RingSim {
        RingSim {
            now: Instant::now(),
            m: (0..p).map(|r| Ring::new(r, p)).collect(),
            stopped: vec![false; p as usize],
            deaf: vec![false; p as usize],
            inflight: vec![Vec::new(); p as usize],
            cap: vec![1 << 20; p as usize],
            outcomes: (0..p).map(|_| None).collect(),
        }
    }

    fn p(&self) -> usize {
        self.m.len()
    }

    /// Every rank starts `round` now with `data(r)`; `since`: how long
    /// before now the ranks began waiting.
    fn start(&mut self, round: u64, data: impl Fn(usize) -> Vec<u8>, since: Duration) {
        let now = self.now;
        for r in 0..self.p() {
            if self.stopped[r] {
                continue;
            }
            self.m[r].start(
                now,
                round,
                &data(r),
                now - since,
                now + TIMEOUT + GRACE,
                GRACE,
            );
        }
        self.step();
    }

    /// Moves bytes until nothing moves.
    fn step(&mut self) {
        let p = self.p();
        loop {
            let mut moved = false;
            for r in 0..p {
                if self.stopped[r] {
                    continue;
                }
                let out = self.m[r].transmit().to_vec();
                let room = self.cap[r].saturating_sub(self.inflight[r].len());
                let n = out.len().min(room);
                if n > 0 {
                    self.inflight[r].extend_from_slice(&out[..n]);
                    self.m[r].handle_sent(self.now, n);
                    moved = true;
                }
                let prev = (r + p - 1) % p;
                if !self.deaf[r] && !self.inflight[prev].is_empty() {
                    // In two pieces: frames split across reads.
                    let b = std::mem::take(&mut self.inflight[prev]);
                    let half = b.len() / 2;
                    self.m[r].handle_data(self.now, &b[..half]);
                    self.m[r].handle_data(self.now, &b[half..]);
                    moved = true;
                }
            }
            self.collect();
            if !moved {
                break;
            }
        }
    }

    fn collect(&mut self) {
        for r in 0..self.p() {
            if let Some(o) = self.m[r].poll_outcome() {
                assert!(self.outcomes[r].is_none(), "rank {r} ended twice");
                self.outcomes[r] = Some(o);
            }
        }
    }

    /// Runs the clock to each machine's next timeout until `until`.
    fn run_until(&mut self, until: Instant) {
        loop {
            let next = (0..self.p())
                .filter(|&r| !self.stopped[r])
                .filter_map(|r| self.m[r].poll_timeout())
                .filter(|&t| t <= until)
                .min();
            let Some(t) = next else { break };
            self.now = self.now.max(t);
            for r in 0..self.p() {
                if !self.stopped[r] {
                    self.m[r].handle_timeout(self.now);
                }
            }
            self.step();
        }
        self.now = self.now.max(until);
    }

    fn ok(&self, r: usize) -> &Vec<Vec<u8>> {
        match &self.outcomes[r] {
            Some(Ok(v)) => v,
            other => panic!("rank {r}: {other:?}"),
        }
    }

    fn err(&self, r: usize) -> &str {
        match &self.outcomes[r] {
            Some(Err(e)) => e,
            other => panic!("rank {r}: expected an error, got {other:?}"),
        }
    }
}

fn contribution(round: u64) -> impl Fn(usize) -> Vec<u8> {
    move |r| vec![r as u8 + round as u8; 3 + r * 100]
}

#[test]
fn rounds_complete_with_every_contribution_in_rank_order() {
    for p in [1, 2, 3, 5, 8] {
        let mut s = RingSim::new(p);
        for round in 0..4 {
            s.outcomes = (0..p).map(|_| None).collect();
            s.start(round, contribution(round), Duration::ZERO);
            let want: Vec<Vec<u8>> = (0..p as usize).map(contribution(round)).collect();
            for r in 0..p as usize {
                assert_eq!(s.ok(r), &want, "p={p} round {round} rank {r}");
            }
        }
    }
}

/// Item 4: rank 2 of 4 stops right after sending its own contribution of
/// the round. Ranks 3 and 0 wait for rank 1's (and rank 0's), which rank 2
/// holds; both must name rank 2, not the ranks whose data is missing.
#[test]
fn a_rank_stopped_mid_round_is_the_one_named() {
    let mut s = RingSim::new(4);
    s.deaf[2] = true;
    s.start(3, contribution(3), Duration::ZERO);
    // Rank 1 has everything (rank 2's arrived through 3 and 0).
    assert_eq!(s.ok(1).len(), 4);
    let deadline = s.now + TIMEOUT + GRACE;
    s.run_until(deadline);
    for r in [3, 0] {
        let e = s.err(r);
        assert!(
            e.contains("rank 2 passed on its own contribution but not rank 1's")
                && e.contains("is rank 2 stopped or stuck"),
            "rank {r}: {e}"
        );
        assert!(e.contains("within 5.5s"), "rank {r}: {e}");
    }
    assert!(s
        .err(3)
        .contains("the contributions of ranks 0, 1 did not arrive at rank 3"));
    assert!(s
        .err(0)
        .contains("the contributions of rank 1 did not arrive at rank 0"));
}

/// A rank stopped before it sent anything in the round: its successor
/// names it as the predecessor that sent nothing.
#[test]
fn a_rank_stopped_before_the_round_is_named() {
    let mut s = RingSim::new(3);
    s.stopped[1] = true;
    s.start(1, contribution(1), Duration::ZERO);
    let deadline = s.now + TIMEOUT + GRACE;
    s.run_until(deadline);
    let e = s.err(2);
    assert!(
        e.contains("nothing arrived from rank 1, not even its own contribution"),
        "{e}"
    );
    let e = s.err(0);
    assert!(
        e.contains("rank 2 passed on its own contribution but not rank 1's"),
        "{e}"
    );
}

/// Item 3: every contribution arrived, only the send to the successor is
/// stuck (it stopped after sending its own and reads nothing). The error
/// names the successor, lists no empty set of ranks, and gives the time
/// actually waited (the round began 5 s after the rank began to join, so
/// it waited 10.5 s, not 0 ms).
#[test]
fn a_stuck_send_names_the_successor_and_the_real_wait() {
    let mut s = RingSim::new(2);
    s.deaf[1] = true;
    s.cap[0] = 100;
    s.start(0, |r| vec![r as u8; 1000], Duration::from_secs(5));
    let deadline = s.now + TIMEOUT + GRACE;
    s.run_until(deadline);
    let e = s.err(0);
    assert!(
        e.contains("every rank's contribution arrived at rank 0, but rank 1 has not taken")
            && e.contains("is rank 1 stopped or stuck"),
        "{e}"
    );
    assert!(!e.contains("ranks  "), "{e}");
    assert!(e.contains("within 10.5s"), "{e}");
}

/// The root's word: a rank that left after its last round fails no round
/// that still moves; a failure it reports ends a round once the ring stands
/// still for the grace; a closed predecessor waits that long for the root
/// to say why, and says so itself if the root does not.
#[test]
fn the_roots_word_and_a_closed_predecessor() {
    // Left: the round completes.
    let mut s = RingSim::new(3);
    s.stopped[2] = true;
    s.start(1, contribution(1), Duration::ZERO);
    s.m[0].handle_root(s.now, "rank 2 left".into(), true);
    s.stopped[2] = false;
    let now = s.now;
    s.m[2].start(now, 1, &contribution(1)(2), now, now + TIMEOUT, GRACE);
    s.step();
    assert_eq!(s.ok(0).len(), 3);
    assert_eq!(s.ok(1).len(), 3);

    // A late rank reported by the root: the error once the ring is still.
    let mut s = RingSim::new(3);
    s.stopped[2] = true;
    s.start(2, contribution(2), Duration::ZERO);
    let t = s.now;
    s.m[1].handle_root(t, "rank 2 did not reach bootstrap round 2".into(), false);
    s.run_until(t + GRACE);
    assert_eq!(s.err(1), "rank 2 did not reach bootstrap round 2");
    assert!(s.outcomes[0].is_none(), "rank 0 ended before its deadline");

    // The predecessor's connection closed: the root's word wins within the
    // grace, else the ring's own message.
    let mut r = Ring::new(1, 3);
    let t = Instant::now();
    r.start(t, 1, b"x", t, t + TIMEOUT, GRACE);
    r.handle_prev_closed(t);
    assert!(r.poll_outcome().is_none());
    r.handle_root(t + GRACE / 2, "rank 0 was killed".into(), false);
    assert_eq!(r.poll_outcome(), Some(Err("rank 0 was killed".into())));
    let mut r = Ring::new(1, 3);
    r.start(t, 1, b"x", t, t + TIMEOUT, GRACE);
    r.handle_prev_closed(t);
    r.handle_timeout(t + GRACE);
    let e = r.poll_outcome().expect("an outcome").unwrap_err();
    assert!(e.contains("rank 0 left the bootstrap"), "{e}");
}

/// Frames of the next round that arrive with this one wait for it.
#[test]
fn early_frames_of_the_next_round_wait() {
    let mut s = RingSim::new(3);
    s.start(1, contribution(1), Duration::ZERO);
    // Ranks 0 and 1 start round 2 before rank 2 does.
    let now = s.now;
    s.outcomes = vec![None, None, None];
    for r in 0..2 {
        s.m[r].start(now, 2, &contribution(2)(r), now, now + TIMEOUT, GRACE);
    }
    s.step();
    s.m[2].start(now, 2, &contribution(2)(2), now, now + TIMEOUT, GRACE);
    s.step();
    let want: Vec<Vec<u8>> = (0..3).map(contribution(2)).collect();
    for r in 0..3 {
        assert_eq!(s.ok(r), &want);
    }
}

/// Item 1: a listener whose `accept` fails (EMFILE) pauses instead of
/// spinning: 10 ms doubling to 1 s between attempts, about 27 attempts in
/// 20 s where the old loop made ~78,000 a second; one warning a second,
/// with the count of the others said.
#[test]
fn a_failing_accept_pauses_and_warns_once_a_second() {
    let mut d = Door::new(0);
    let start = Instant::now();
    let mut now = start;
    let mut attempts = 0;
    let mut warns = Vec::new();
    while now < start + Duration::from_secs(20) {
        d.handle_timeout(now);
        if d.accepting(now) {
            // The listener is readable all the time.
            attempts += 1;
            let after =
                d.handle_accept_failed(now, true, "Too many open files (os error 24)", None);
            assert!(matches!(after, AfterFailure::Pause(t) if t > now));
        }
        now = d.poll_timeout().expect("a time to go on").max(now);
        while let Some(l) = d.poll_log() {
            if l.level == Level::Warn {
                warns.push(l.msg);
            }
        }
    }
    assert!((15..=40).contains(&attempts), "{attempts} attempts");
    assert!(warns.len() <= 22, "{} warnings", warns.len());
    assert!(
        warns[0].contains("rank 0: the bootstrap listener cannot accept")
            && warns[0].contains("ulimit -n"),
        "{}",
        warns[0]
    );
    assert!(warns
        .iter()
        .any(|w| w.contains("more bootstrap warnings (accept: ")));

    // Out of descriptors with an old waiting connection: it makes room.
    let mut d = Door::new(1);
    let t = Instant::now();
    assert_eq!(
        d.handle_accept_failed(t + Duration::from_secs(1), true, "EMFILE", Some(t)),
        AfterFailure::EvictOldest
    );
    assert!(d.accepting(t + Duration::from_secs(1)));
    // A young one is left its chance; another error never evicts.
    let young = d.handle_accept_failed(t, true, "EMFILE", Some(t));
    assert!(matches!(young, AfterFailure::Pause(_)));
    let other = d.handle_accept_failed(t + Duration::from_secs(9), false, "EPERM", Some(t));
    assert!(matches!(other, AfterFailure::Pause(_)));
    // A successful accept starts the pause over at 10 ms.
    d.handle_accepted();
    let AfterFailure::Pause(at) = d.handle_accept_failed(t, false, "EPERM", None) else {
        panic!("no pause")
    };
    assert_eq!(at, t + Duration::from_millis(10));
}

/// Item 4: dropped connections are warned about once a second and every
/// one is counted, also when the listener closes soon after.
#[test]
fn dropped_connections_are_all_counted() {
    let mut d = Door::new(2);
    let t = Instant::now();
    for i in 0..40u64 {
        d.handle_stranger(t + Duration::from_millis(i), "it did not prove the secret");
    }
    d.handle_close(t + Duration::from_millis(50));
    let warns: Vec<String> = std::iter::from_fn(|| d.poll_log())
        .filter(|l| l.level == Level::Warn)
        .map(|l| l.msg)
        .collect();
    assert_eq!(warns.len(), 2, "{warns:?}");
    assert!(warns[0].contains("rank 2: bootstrap: dropped a connection"));
    assert!(
        warns[1].starts_with("39 more bootstrap warnings (dropped)"),
        "{warns:?}"
    );
}

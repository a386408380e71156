//! The rank side of the bootstrap in memory: the ring's rounds (`ring.rs`),
//! the point-to-point exchanges (`exchange.rs`) and the listener's policy
//! (`door.rs`) driven by a simulated clock and simulated sockets, for the
//! cases a hostile or unlucky peer makes — a rank stopped in the middle of
//! a round, a successor that takes nothing, a peer that never asks or is
//! gone or lies, a process out of descriptors — without a socket or a
//! sleep.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::door::{first_frame, AfterFailure, Door, FirstFrame};
use super::exchange::{gone_msg, Ask, Exchange, ExchangeError, Outcome, PROBE_EVERY};
use super::ring::{Outcome as RingOutcome, Ring};
use super::warnings::Level;
use super::wire::{FrameBuf, PeerFrame, K_PROBE, K_RING_HELLO, K_XCHG};

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
    outcomes: Vec<Option<RingOutcome>>,
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

// ---------------------------------------------------------------------------
// Point-to-point exchanges (`exchange.rs`), with the listener's filing of
// the requests (`door.rs`'s `first_frame`): ranks asking each other in any
// order, silent, gone or lying peers, on simulated connections that carry
// bytes in pieces of random sizes.

const SECRET: [u8; 16] = [9; 16];

/// A change to a rank's answers (all of an answer at once).
type Tamper = fn(&mut Vec<u8>);

/// A request a listener filed: its connection, nonce and payload.
struct Filed {
    conn: usize,
    nonce: [u8; 16],
    payload: Vec<u8>,
}

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// A connection from an asking rank's slot to another rank's listener.
struct Conn {
    asker: (usize, usize),
    answerer: usize,
    /// Asker → answerer: the request, read by the listener.
    up: FrameBuf,
    filed: bool,
    /// Answerer → asker, not yet read.
    down: Vec<u8>,
    /// The answerer is done with it (its answer is all in `down`).
    answer_closed: bool,
    asker_closed: bool,
}

/// One exchange per rank, joined by simulated connections and listeners.
struct ExchangeSim<'a> {
    now: Instant,
    rng: Rng,
    asks: &'a [Vec<Ask>],
    addrs: Vec<SocketAddr>,
    m: Vec<Option<Exchange<'a>>>,
    /// Nothing listens at a gone rank's address (connecting is refused).
    gone: Vec<bool>,
    /// A stopped rank's kernel still takes connections, but it does
    /// nothing.
    stopped: Vec<bool>,
    /// A rank whose answers are changed (all of an answer at once).
    tamper: Vec<Option<Tamper>>,
    conns: Vec<Conn>,
    /// Each rank's slots' connections.
    slot_conn: Vec<Vec<Option<usize>>>,
    /// Requests each rank's listener filed, by (from, tag).
    requests: Vec<BTreeMap<(u32, u64), Filed>>,
    /// Probes each rank made.
    probes: Vec<usize>,
    outcomes: Vec<Option<Outcome>>,
}

impl<'a> ExchangeSim<'a> {
    fn new(asks: &'a [Vec<Ask>], seed: u64) -> ExchangeSim<'a> {
        let p = asks.len();
        ExchangeSim {
            now: Instant::now(),
            rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            asks,
            addrs: (0..p)
                .map(|r| SocketAddr::from(([127, 0, 0, 1], 1000 + r as u16)))
                .collect(),
            m: (0..p).map(|_| None).collect(),
            gone: vec![false; p],
            stopped: vec![false; p],
            tamper: vec![None; p],
            conns: Vec::new(),
            slot_conn: asks.iter().map(|a| vec![None; a.len()]).collect(),
            requests: (0..p).map(|_| BTreeMap::new()).collect(),
            probes: vec![0; p],
            outcomes: (0..p).map(|_| None).collect(),
        }
    }

    fn p(&self) -> usize {
        self.asks.len()
    }

    /// Rank `r` calls its exchange now, to end by the `timeout`.
    fn start(&mut self, r: usize, timeout: Duration) {
        let m = Exchange::new(
            r as u32,
            self.p() as u32,
            SECRET,
            &self.addrs,
            &self.asks[r],
            self.now,
            self.now + timeout,
        )
        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        self.m[r] = Some(m);
    }

    /// A piece of `n` bytes: its length, 1 to `n`.
    fn piece(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            1 + self.rng.below(n)
        }
    }

    /// Moves bytes, files requests and answers probes until nothing moves.
    fn step(&mut self) {
        loop {
            let mut moved = self.listen();
            let mut order: Vec<usize> = (0..self.p()).collect();
            for k in (1..order.len()).rev() {
                order.swap(k, self.rng.below(k + 1));
            }
            for r in order {
                if !self.stopped[r] && !self.gone[r] {
                    moved |= self.drive(r);
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Every listener files the requests whose first frame is in.
    fn listen(&mut self) -> bool {
        let mut moved = false;
        for c in 0..self.conns.len() {
            let conn = &mut self.conns[c];
            if conn.filed {
                continue;
            }
            let Ok(Some((kind, body))) = conn.up.next_frame() else {
                continue;
            };
            conn.filed = true;
            moved = true;
            let to = conn.answerer;
            match first_frame(to as u32, self.p() as u32, &SECRET, false, kind, &body) {
                FirstFrame::Request {
                    from,
                    tag,
                    nonce,
                    payload,
                } => {
                    let filed = Filed {
                        conn: c,
                        nonce,
                        payload,
                    };
                    self.requests[to].insert((from, tag), filed);
                }
                other => panic!("rank {to}'s listener: {other:?}"),
            }
        }
        moved
    }

    /// One pass of rank `r`'s driver over its exchange, as `peer.rs` does.
    fn drive(&mut self, r: usize) -> bool {
        let Some(mut m) = self.m[r].take() else {
            return false;
        };
        let mut moved = false;
        while let Some((i, peer, addr)) = m.poll_dial() {
            moved = true;
            let peer_ = peer as usize;
            if self.gone[peer_] {
                m.handle_dial_failed(ExchangeError::Peer {
                    peer,
                    what: gone_msg(peer, addr),
                    timed_out: None,
                });
                continue;
            }
            self.conns.push(Conn {
                asker: (r, i),
                answerer: peer_,
                up: FrameBuf::default(),
                filed: false,
                down: Vec::new(),
                answer_closed: false,
                asker_closed: false,
            });
            self.slot_conn[r][i] = Some(self.conns.len() - 1);
            m.handle_connected(i, [(r * 16 + i) as u8; 16]);
        }
        for i in 0..self.asks[r].len() {
            if let Some(key) = m.wants_request(i) {
                if let Some(f) = self.requests[r].remove(&key) {
                    self.slot_conn[r][i] = Some(f.conn);
                    m.handle_request(i, f.nonce, f.payload);
                    moved = true;
                }
            }
            let Some(c) = self.slot_conn[r][i] else {
                continue;
            };
            let asker = self.conns[c].asker == (r, i);
            let out = m.transmit(i).to_vec();
            let n = self.piece(out.len());
            if n > 0 {
                let conn = &mut self.conns[c];
                if asker {
                    conn.up.buf.extend_from_slice(&out[..n]);
                } else {
                    conn.down.extend_from_slice(&out[..n]);
                }
                m.handle_sent(i, n);
                moved = true;
            }
            if m.wants_read(i) {
                let (answerer, closed, len) = {
                    let conn = &self.conns[c];
                    (conn.answerer, conn.answer_closed, conn.down.len())
                };
                // A tampered answer travels once it is all written.
                let held = self.tamper[answerer].is_some() && !closed;
                if !held {
                    let n = self.piece(len);
                    if n > 0 {
                        let got: Vec<u8> = self.conns[c].down.drain(..n).collect();
                        m.handle_data(i, &got);
                        moved = true;
                    } else if closed {
                        m.handle_closed(i, None);
                        moved = true;
                    }
                }
            }
            while let Some(close) = m.poll_close() {
                let Some(c) = self.slot_conn[r][close.slot] else {
                    panic!("rank {r} closed slot {} without a connection", close.slot);
                };
                let conn = &mut self.conns[c];
                if conn.asker == (r, close.slot) {
                    assert!(!close.shutdown, "the asker shuts nothing");
                    conn.asker_closed = true;
                } else {
                    assert!(close.shutdown, "an answer that is out is shut");
                    conn.answer_closed = true;
                    if let Some(f) = self.tamper[r] {
                        f(&mut conn.down);
                    }
                }
                moved = true;
            }
        }
        while let Some((peer, addr)) = m.poll_probe() {
            assert_eq!(addr, self.addrs[peer as usize]);
            self.probes[r] += 1;
            m.handle_probe(peer, self.gone[peer as usize]);
            moved = true;
        }
        if let Some(o) = m.poll_outcome() {
            assert!(self.outcomes[r].is_none(), "rank {r} ended twice");
            self.outcomes[r] = Some(o);
            moved = true;
        }
        self.m[r] = Some(m);
        moved
    }

    /// Runs the clock to each machine's next timeout until `until`.
    fn run_until(&mut self, until: Instant) {
        loop {
            self.step();
            let next = (0..self.p())
                .filter(|&r| !self.stopped[r] && !self.gone[r])
                .filter_map(|r| self.m[r].as_ref()?.poll_timeout())
                .filter(|&t| t <= until)
                .min();
            let Some(t) = next else { break };
            self.now = self.now.max(t);
            for r in 0..self.p() {
                if !self.stopped[r] && !self.gone[r] {
                    if let Some(m) = self.m[r].as_mut() {
                        m.handle_timeout(self.now);
                    }
                }
            }
        }
        self.now = self.now.max(until);
    }

    fn ok(&self, r: usize) -> &Vec<Vec<u8>> {
        match &self.outcomes[r] {
            Some(Ok(v)) => v,
            other => panic!("rank {r}: {other:?}"),
        }
    }

    /// Rank `r`'s failure: the peer named, the message, the time waited.
    fn err(&self, r: usize) -> (u32, &str, Option<Duration>) {
        match &self.outcomes[r] {
            Some(Err(ExchangeError::Peer {
                peer,
                what,
                timed_out,
            })) => (*peer, what, *timed_out),
            other => panic!("rank {r}: expected a peer's failure, got {other:?}"),
        }
    }
}

/// What rank `from` sends rank `to` (lengths from empty to several pieces).
fn xmsg(from: usize, to: usize, seed: u64) -> Vec<u8> {
    let len = match (from + to + seed as usize) % 4 {
        0 => 0,
        1 => 7,
        2 => 300,
        _ => 70_000,
    };
    (0..len)
        .map(|k| (k as u64 ^ seed ^ (from as u64 * 31 + to as u64)) as u8)
        .collect()
}

fn ask(from: usize, to: usize, tag: u64, seed: u64) -> Ask {
    Ask {
        peer: to as u32,
        tag,
        msg: xmsg(from, to, seed),
    }
}

/// Asks between every two ranks of `pairs`, tag `7 + a + b`.
fn asks_of(p: usize, pairs: &[(usize, usize)]) -> Vec<Vec<Ask>> {
    let mut v = vec![Vec::new(); p];
    for &(a, b) in pairs {
        v[a].push(ask(a, b, 7 + (a + b) as u64, 0));
        v[b].push(ask(b, a, 7 + (a + b) as u64, 0));
    }
    v
}

/// Ranks that ask each other in any order, some of them late (their
/// requests are filed before they ask), get every peer's message in the
/// order of their asks, and close every connection.
#[test]
fn exchanges_complete_in_any_order() {
    for seed in 0..60u64 {
        let mut rng = Rng(seed * 7919 + 1);
        let p = 2 + rng.below(6);
        let mut asks: Vec<Vec<Ask>> = vec![Vec::new(); p];
        for a in 0..p {
            for b in a + 1..p {
                if rng.below(4) != 0 {
                    let tag = rng.below(1 << 30) as u64;
                    asks[a].push(ask(a, b, tag, seed));
                    asks[b].push(ask(b, a, tag, seed));
                }
            }
        }
        for v in asks.iter_mut() {
            for k in (1..v.len()).rev() {
                v.swap(k, rng.below(k + 1));
            }
        }
        let mut s = ExchangeSim::new(&asks, seed);
        let mut late: Vec<usize> = (0..p).filter(|_| rng.below(3) == 0).collect();
        for r in 0..p {
            if !late.contains(&r) {
                s.start(r, TIMEOUT);
            }
        }
        s.step();
        while let Some(r) = late.pop() {
            s.now += Duration::from_millis(10);
            s.start(r, TIMEOUT);
            s.step();
        }
        let until = s.now + Duration::from_secs(1);
        s.run_until(until);
        for (r, mine) in asks.iter().enumerate() {
            let want: Vec<Vec<u8>> = mine
                .iter()
                .map(|a| xmsg(a.peer as usize, r, seed))
                .collect();
            assert_eq!(s.ok(r), &want, "seed {seed}, p={p}, rank {r}");
        }
        for c in &s.conns {
            assert!(
                c.filed && c.answer_closed && c.asker_closed && c.down.is_empty(),
                "seed {seed}: a connection left behind"
            );
        }
    }
}

/// A peer that never asks, and one that never answers, are named at the
/// deadline, with the time waited; the peers waited for are probed every
/// PROBE_EVERY meanwhile (their listeners are there: stopped, not gone).
#[test]
fn a_silent_peer_is_named_at_the_deadline() {
    let asks = asks_of(4, &[(0, 2), (1, 3)]);
    let mut s = ExchangeSim::new(&asks, 1);
    s.stopped[0] = true;
    s.stopped[3] = true;
    s.start(1, TIMEOUT);
    s.start(2, TIMEOUT);
    let t0 = s.now;
    s.run_until(t0 + TIMEOUT - Duration::from_millis(1));
    assert!(s.outcomes[1].is_none() && s.outcomes[2].is_none());
    s.run_until(t0 + TIMEOUT);
    let (peer, what, waited) = s.err(1);
    assert_eq!(peer, 3);
    assert_eq!(
        what,
        "rank 3 did not answer this rank's connection request within 5s (is it stuck, or in \
         another operation?)"
    );
    assert_eq!(waited, Some(TIMEOUT));
    let (peer, what, waited) = s.err(2);
    assert_eq!(peer, 0);
    assert_eq!(
        what,
        "rank 0 did not send its connection request within 5s (is it stuck, or in another \
         operation?)"
    );
    assert_eq!(waited, Some(TIMEOUT));
    // Rank 2 waits for rank 0 and probes it; rank 1 waits for nobody.
    let every = (TIMEOUT.as_millis() / PROBE_EVERY.as_millis()) as usize;
    assert!(
        (every - 1..=every).contains(&s.probes[2]),
        "{} probes",
        s.probes[2]
    );
    assert_eq!(s.probes[1], 0);
}

/// A gone peer is named at once (dialing it is refused) or at the first
/// probe (waiting for it), with the other peers of the exchange that are
/// gone too, but not the ones it is done with.
#[test]
fn a_gone_peer_is_named_with_the_others_gone_too() {
    // Rank 4 waits for ranks 3, 0, 2, 1: 3 answers and then leaves, 0 and 1
    // are gone, 2 is stopped.
    let asks = asks_of(5, &[(3, 4), (0, 4), (2, 4), (1, 4)]);
    let mut s = ExchangeSim::new(&asks, 2);
    s.gone[0] = true;
    s.gone[1] = true;
    s.stopped[2] = true;
    s.start(3, TIMEOUT);
    s.start(4, TIMEOUT);
    let t0 = s.now;
    s.step();
    assert_eq!(s.ok(3).len(), 1);
    s.gone[3] = true;
    s.run_until(t0 + PROBE_EVERY - Duration::from_millis(1));
    assert!(s.outcomes[4].is_none(), "named before the first probe");
    s.run_until(t0 + PROBE_EVERY);
    let (peer, what, waited) = s.err(4);
    assert_eq!((peer, waited), (0, None));
    assert_eq!(
        what,
        "rank 0 is gone: nothing listens at its bootstrap address 127.0.0.1:1000 any more (its \
         process exited or was killed); rank 1 of this exchange is gone too"
    );

    // Rank 0 asks ranks 1 and 2 (gone) and 3 (there): the refused dial
    // names rank 1 at once, and rank 2 with it.
    let asks = asks_of(4, &[(0, 1), (0, 2), (0, 3)]);
    let mut s = ExchangeSim::new(&asks, 3);
    s.gone[1] = true;
    s.gone[2] = true;
    s.start(0, TIMEOUT);
    s.start(3, TIMEOUT);
    s.step();
    let (peer, what, _) = s.err(0);
    assert_eq!(peer, 1);
    assert!(
        what.starts_with("rank 1 is gone: nothing listens"),
        "{what}"
    );
    assert!(
        what.ends_with("; rank 2 of this exchange is gone too"),
        "{what}"
    );
    assert!(s.outcomes[3].is_none(), "rank 0 never sent rank 3 anything");
}

/// An answer cut short, forged, of another kind or garbage names the peer
/// that sent it.
#[test]
fn a_broken_answer_names_the_peer() {
    let cases: [(Tamper, &str); 4] = [
        (
            |v| v.truncate(10),
            "rank 1 closed its bootstrap connection before answering (unexpected end of file); \
             did it exit?",
        ),
        (
            |v| v[30] ^= 1,
            "rank 1 answered with an invalid message (protocol error)",
        ),
        (
            |v| v[4] = K_XCHG,
            "rank 1 answered with a message of kind 9 (protocol error)",
        ),
        (
            |v| *v = vec![0; 8],
            "rank 1 answered with garbage (empty frame)",
        ),
    ];
    for (k, (tamper, want)) in cases.into_iter().enumerate() {
        let asks = asks_of(2, &[(0, 1)]);
        let mut s = ExchangeSim::new(&asks, k as u64);
        s.tamper[1] = Some(tamper);
        s.start(0, TIMEOUT);
        s.start(1, TIMEOUT);
        s.step();
        assert_eq!(s.ok(1).len(), 1, "case {k}: rank 1 got its message");
        let (peer, what, waited) = s.err(0);
        assert_eq!((peer, what, waited), (1, want, None), "case {k}");
    }
}

/// Bad asks fail before anything is sent; no asks end at once; the abort
/// flag ends an exchange under way, not one that is over.
#[test]
fn bad_asks_no_asks_and_abort() {
    let addrs: Vec<SocketAddr> = (0..3)
        .map(|r| SocketAddr::from(([127, 0, 0, 1], 1000 + r)))
        .collect();
    let t = Instant::now();
    let new = |rank: u32, addrs: &[SocketAddr], asks: &[Ask]| {
        Exchange::new(rank, 3, SECRET, addrs, asks, t, t + TIMEOUT)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let to = |peer: u32| vec![ask(0, peer as usize, 1, 0)];
    assert_eq!(
        new(0, &addrs, &to(5)),
        Err("invalid argument: bootstrap exchange with rank 5 (this is rank 0 of 3)".into())
    );
    assert!(new(0, &addrs, &to(0)).is_err());
    let e = new(0, &[], &to(1)).unwrap_err();
    assert!(
        e.contains("exchange before the ranks' addresses are known"),
        "{e}"
    );

    let none: Vec<Ask> = Vec::new();
    let mut m = Exchange::new(0, 3, SECRET, &addrs, &none, t, t + TIMEOUT).unwrap();
    m.handle_abort();
    assert!(matches!(m.poll_outcome(), Some(Ok(v)) if v.is_empty()));

    let asks = to(1);
    let mut m = Exchange::new(0, 3, SECRET, &addrs, &asks, t, t + TIMEOUT).unwrap();
    assert_eq!(m.poll_dial(), Some((0, 1, addrs[1])));
    m.handle_connected(0, [1; 16]);
    assert!(!m.transmit(0).is_empty());
    m.handle_abort();
    assert!(matches!(
        m.poll_outcome(),
        Some(Err(ExchangeError::Aborted))
    ));
    assert_eq!(m.poll_outcome().map(|_| ()), None);
    assert!(m.transmit(0).is_empty() && m.poll_timeout().is_none());
}

/// What the listener makes of a connection's first frame.
#[test]
fn the_listener_files_first_frames() {
    let file = |kind: u8, from: u32, to: u32, word: u64, secret: &[u8; 16], ring_open: bool| {
        let f = PeerFrame::sealed(kind, secret, from, to, word, [5; 16], b"hi");
        let mut b = FrameBuf { buf: f };
        let (kind, body) = b.next_frame().unwrap().unwrap();
        first_frame(2, 4, &SECRET, ring_open, kind, &body)
    };
    let stranger = |f: FirstFrame| match f {
        FirstFrame::Stranger(why) => why,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        file(K_XCHG, 0, 2, 77, &SECRET, false),
        FirstFrame::Request {
            from: 0,
            tag: 77,
            nonce: [5; 16],
            payload: b"hi".to_vec()
        }
    );
    assert!(stranger(file(K_XCHG, 3, 2, 77, &SECRET, false)).contains("not below this rank"));
    assert!(stranger(file(K_XCHG, 0, 2, 77, &[1; 16], false)).contains("did not prove the secret"));
    assert!(stranger(file(K_XCHG, 0, 1, 77, &SECRET, false)).contains("reached rank 2"));
    assert_eq!(
        file(K_RING_HELLO, 1, 2, 4, &SECRET, true),
        FirstFrame::RingHello
    );
    for (from, word, open) in [(1, 4, false), (0, 4, true), (1, 3, true)] {
        let why = stranger(file(K_RING_HELLO, from, 2, word, &SECRET, open));
        assert!(why.contains("an unexpected ring connection"), "{why}");
    }
    assert_eq!(
        first_frame(2, 4, &SECRET, true, K_PROBE, &[]),
        FirstFrame::Probe
    );
    assert_eq!(
        stranger(first_frame(2, 4, &SECRET, true, 5, &[])),
        "a first frame of kind 5"
    );
}

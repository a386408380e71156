//! The root's state machine ([`Rendezvous`]) played in memory, without
//! sockets or a clock: ranks, strangers, slow senders, floods and failures,
//! with simulated time.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use super::rendezvous::{
    AcceptFailure, ConnId, Level, LogLine, Rendezvous, Settings, ACCEPT_BACKOFF_MAX, EVICT_MIN_AGE,
    HANDSHAKE_TIMEOUT, MAX_PENDING,
};
use super::wire::{
    client_mac, contrib_header, error_frame, hello_header, parse_challenge, root_mac, FrameBuf,
    HelloFixed, HELLO_PREFIX, K_ACCEPT, K_ERROR, K_HELLO, K_LEFT, K_RING, MAGIC, MAX_FRAME,
    NONCE_LEN, READ_CHUNK,
};

const SECRET: [u8; 16] = *b"sim-secret-01234";
const ROOT: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), 29500);

/// The machine and everything it asked for, per connection.
struct Sim {
    m: Rendezvous,
    now: Instant,
    nonces: u64,
    /// Bytes written to each connection, in order.
    out: BTreeMap<ConnId, Vec<u8>>,
    /// Connections the machine closed, and how many bytes had been written
    /// to them then.
    closed: BTreeMap<ConnId, usize>,
    logs: Vec<LogLine>,
}

impl Sim {
    fn new(timeout: Duration) -> Sim {
        Sim::with(Settings::new(ROOT, SECRET, timeout))
    }

    fn with(cfg: Settings) -> Sim {
        let now = Instant::now();
        Sim {
            m: Rendezvous::new(cfg, now),
            now,
            nonces: 0,
            out: BTreeMap::new(),
            closed: BTreeMap::new(),
            logs: Vec::new(),
        }
    }

    /// Takes every output of the machine.
    fn step(&mut self) {
        while let Some(t) = self.m.poll_transmit() {
            assert!(
                !self.closed.contains_key(&t.conn),
                "bytes for {:?} after it was closed",
                t.conn
            );
            self.out
                .entry(t.conn)
                .or_default()
                .extend_from_slice(&t.bytes);
        }
        while let Some(c) = self.m.poll_close() {
            let n = self.out.get(&c).map_or(0, Vec::len);
            self.closed.entry(c).or_insert(n);
        }
        while let Some(l) = self.m.poll_log() {
            self.logs.push(l);
        }
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.m.handle_timeout(self.now);
        self.step();
    }

    fn connect(&mut self) -> ConnId {
        self.nonces += 1;
        let mut nonce = [0u8; NONCE_LEN];
        nonce[..8].copy_from_slice(&self.nonces.to_le_bytes());
        let peer = SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(10, 0, 1, 2)),
            (self.nonces % 60000) as u16 + 1024,
        );
        let c = self.m.handle_connect(self.now, peer, nonce);
        self.step();
        c
    }

    /// Feeds `bytes` as the driver would: at most `read_limit` at a time.
    fn send(&mut self, c: ConnId, bytes: &[u8]) {
        let mut at = 0;
        while at < bytes.len() {
            let k = self.m.read_limit(c);
            if k == 0 {
                break;
            }
            let k = k.min(bytes.len() - at);
            self.m.handle_data(self.now, c, &bytes[at..at + k]);
            at += k;
            self.step();
        }
    }

    fn hang_up(&mut self, c: ConnId) {
        self.m.handle_closed(self.now, c, None);
        self.step();
    }

    fn frames(&self, c: ConnId) -> Vec<(u8, Vec<u8>)> {
        let mut fb = FrameBuf {
            buf: self.out.get(&c).cloned().unwrap_or_default(),
        };
        let mut v = Vec::new();
        while let Some(f) = fb.next_frame().expect("the root writes valid frames") {
            v.push(f);
        }
        assert!(fb.buf.is_empty(), "a partial frame to {c:?}");
        v
    }

    fn nonce(&self, c: ConnId) -> [u8; NONCE_LEN] {
        let f = self.frames(c);
        parse_challenge(f[0].0, &f[0].1).expect("a challenge first")
    }

    /// The error messages sent to `c`.
    fn errors(&self, c: ConnId) -> Vec<String> {
        self.frames(c)
            .into_iter()
            .filter(|f| f.0 == K_ERROR || f.0 == K_LEFT)
            .map(|f| String::from_utf8_lossy(&f.1).into_owned())
            .collect()
    }

    fn warnings(&self) -> Vec<&str> {
        self.logs
            .iter()
            .filter(|l| l.level == Level::Warn)
            .map(|l| l.msg.as_str())
            .collect()
    }

    /// A rank: connects and sends its hello (in one piece).
    fn join(&mut self, rank: u32, nranks: u32, payload: &[u8]) -> ConnId {
        let c = self.connect();
        let h = self.hello(c, &SECRET, rank, nranks, payload);
        self.send(c, &h);
        c
    }

    fn hello(
        &self,
        c: ConnId,
        secret: &[u8; 16],
        rank: u32,
        nranks: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        hello_for(&self.nonce(c), secret, rank, nranks, payload)
    }

    /// What `c` got once all ranks joined: its successor's hello payload
    /// (protocol v3; the rounds go round the ring, not through the root).
    fn ring(&self, c: ConnId) -> Vec<u8> {
        let frames = self.frames(c);
        let at = frames
            .iter()
            .position(|f| f.0 == K_ACCEPT)
            .expect("accepted")
            + 1;
        let (k, b) = &frames[at];
        assert_eq!(*k, K_RING, "the successor's address after the accept");
        assert_eq!(frames.len(), at + 1, "nothing but the successor's address");
        b.clone()
    }
}

fn cnonce() -> [u8; NONCE_LEN] {
    [0x5a; NONCE_LEN]
}

fn hello_for(
    rnonce: &[u8; NONCE_LEN],
    secret: &[u8; 16],
    rank: u32,
    nranks: u32,
    payload: &[u8],
) -> Vec<u8> {
    let h = HelloFixed {
        rank,
        nranks,
        cnonce: cnonce(),
        mac: client_mac(secret, rnonce, &cnonce(), rank, nranks),
    };
    [&hello_header(payload.len())[..], &h.encode(), payload].concat()
}

fn contrib(round: u64, data: &[u8]) -> Vec<u8> {
    [contrib_header(round, data.len()), data.to_vec()].concat()
}

const T: Duration = Duration::from_secs(30);

#[test]
fn ranks_rendezvous_run_rounds_and_leave_without_warnings() {
    let mut s = Sim::new(T);
    let n = 4;
    let conns: Vec<ConnId> = (0..n)
        .map(|r| s.join(r, n, format!("p{r}").as_bytes()))
        .collect();
    for (r, &c) in conns.iter().enumerate() {
        let f = s.frames(c);
        assert_eq!(f[1].0, K_ACCEPT);
        let proof = root_mac(&SECRET, &cnonce(), &s.nonce(c), r as u32);
        assert_eq!(f[1].1, proof);
        // Its successor's payload (its address), nothing more.
        let next = (r as u32 + 1) % n;
        assert_eq!(s.ring(c), format!("p{next}").into_bytes());
    }
    let sent: usize = s.out.values().map(Vec::len).sum();
    for round in 1..=3u64 {
        for &c in &conns {
            s.send(c, &contrib(round, &[]));
        }
        // The rounds' data go round the ring: the root only counts them.
        assert_eq!(s.out.values().map(Vec::len).sum::<usize>(), sent);
        assert_eq!(s.m.poll_timeout(), None);
    }
    // Between rounds there is no deadline.
    assert_eq!(s.m.poll_timeout(), None);
    s.advance(Duration::from_secs(3600));
    assert!(s.m.result().is_none());
    // The end of the job: rank 2 leaves first. Not a failure, no warning;
    // the others are told, in case they call another round.
    s.hang_up(conns[2]);
    assert_eq!(s.m.result(), Some(&Ok(())));
    assert!(s.warnings().is_empty(), "{:?}", s.warnings());
    for (r, &c) in conns.iter().enumerate() {
        if r != 2 {
            assert_eq!(s.errors(c), ["rank 2 left the bootstrap"]);
            assert!(s.closed.contains_key(&c));
        }
    }
}

#[test]
fn the_machine_is_deterministic() {
    let play = || {
        let mut s = Sim::new(T);
        let a = s.join(1, 2, b"one");
        let stranger = s.connect();
        s.send(stranger, b"GET / HTTP/1.1\r\n\r\n");
        s.advance(Duration::from_millis(10));
        let b = s.join(0, 2, b"zero");
        s.send(a, &contrib(1, b"x"));
        s.advance(Duration::from_secs(31));
        (s.out, s.closed, s.logs, s.m.result().cloned(), b)
    };
    let (o1, c1, l1, r1, _) = play();
    let (o2, c2, l2, r2, _) = play();
    assert_eq!((o1, c1, l1, r1), (o2, c2, l2, r2));
}

#[test]
fn hello_in_pieces_and_slow_senders() {
    let mut s = Sim::new(T);
    // Rank 0 sends its hello one byte every 50 ms: slow but within time.
    let c0 = s.connect();
    let h = s.hello(c0, &SECRET, 0, 2, &[7; 300]);
    for b in &h {
        s.send(c0, std::slice::from_ref(b));
        s.advance(Duration::from_millis(1));
    }
    let c1 = s.join(1, 2, b"");
    assert_eq!(s.ring(c0), Vec::<u8>::new());
    assert_eq!(s.ring(c1), vec![7; 300]);

    // A hello that proves the secret but whose payload never completes is
    // closed at the bootstrap timeout (not the short handshake one).
    let mut s = Sim::new(T);
    let c = s.connect();
    let h = s.hello(c, &SECRET, 0, 2, &[1; 1000]);
    s.send(c, &h[..h.len() - 10]);
    assert_eq!(s.m.read_limit(c), READ_CHUNK);
    s.advance(HANDSHAKE_TIMEOUT + Duration::from_secs(1));
    assert!(!s.closed.contains_key(&c));
    s.advance(T - HANDSHAKE_TIMEOUT);
    assert!(s.closed.contains_key(&c));
    assert!(s
        .warnings()
        .iter()
        .any(|w| w.contains("did not send its whole hello")));
}

#[test]
fn strangers_garbage_wrong_secrets_and_replays_never_count() {
    let mut s = Sim::new(T);
    // Before the proof the root reads no more than a hello's fixed part.
    let c = s.connect();
    assert_eq!(s.m.read_limit(c), HELLO_PREFIX);
    s.send(c, &[0; 10]);
    assert!(s.closed.contains_key(&c), "an empty frame");
    assert!(s.errors(c).is_empty());

    let http = s.connect();
    s.send(http, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(s.closed.contains_key(&http));

    // An oversized length, a wrong magic, other versions.
    let big = s.connect();
    s.send(big, &[0xff, 0xff, 0xff, 0x7f, K_HELLO]);
    assert!(s.closed.contains_key(&big));
    let magic = s.connect();
    let mut h = s.hello(magic, &SECRET, 0, 2, b"");
    h[5] ^= 1;
    s.send(magic, &h);
    assert!(s.closed.contains_key(&magic) && s.errors(magic).is_empty());
    let v4 = s.connect();
    let mut h = s.hello(v4, &SECRET, 0, 2, b"");
    h[5 + 8] = 4;
    s.send(v4, &h);
    let e = s.errors(v4);
    assert!(
        e[0].contains("version mismatch") && e[0].contains("this rank v4"),
        "{e:?}"
    );
    // An older braid that frames the same way (v2) is told the versions;
    // v1's big-endian framing (never released) is a stranger's bad length.
    let v2 = s.connect();
    let mut h = s.hello(v2, &SECRET, 0, 2, b"");
    h[5 + 8] = 2;
    s.send(v2, &h);
    let e = s.errors(v2);
    assert!(
        e[0].contains("version mismatch") && e[0].contains("speaks v3, this rank v2"),
        "{e:?}"
    );
    let v1 = s.connect();
    let mut old = 93u32.to_be_bytes().to_vec();
    old.push(K_HELLO);
    old.extend_from_slice(&MAGIC);
    old.extend_from_slice(&1u32.to_be_bytes());
    s.send(v1, &old);
    assert!(s.closed.contains_key(&v1) && s.errors(v1).is_empty());

    // A wrong secret claiming rank 0 is told so; a proof replayed from
    // another connection (another nonce) does not prove anything.
    let wrong = s.connect();
    let h = s.hello(wrong, &[0; 16], 0, 2, b"evil");
    s.send(wrong, &h);
    assert!(s.errors(wrong)[0].contains("secret did not match"));
    let victim = s.connect();
    let replayed = s.hello(victim, &SECRET, 1, 2, b"");
    let thief = s.connect();
    s.send(thief, &replayed);
    assert!(s.errors(thief)[0].contains("secret did not match"));
    // A stranger that announces a 16 MiB hello with a bad proof is refused
    // after the fixed part, without the root buffering the rest.
    let liar = s.connect();
    let mut h = s.hello(liar, &[1; 16], 0, 2, b"");
    h[..4].copy_from_slice(&(MAX_FRAME as u32).to_le_bytes());
    s.send(liar, &[h, vec![0; 4096]].concat());
    assert!(s.errors(liar)[0].contains("secret did not match"));
    // Data after the hello, before being accepted: refused.
    let eager = s.connect();
    let h = s.hello(eager, &SECRET, 0, 2, b"p");
    s.send(eager, &[h, contrib(1, b"early")].concat());
    assert!(s.closed.contains_key(&eager));

    // None of them counted: the real ranks (0 and 1 included) join.
    let r0 = s.join(0, 2, b"a");
    let r1 = s.join(1, 2, b"b");
    assert_eq!(s.ring(r0), b"b".to_vec());
    assert_eq!(s.ring(r1), b"a".to_vec());
    // Rejections are warned about at most once per second (with a count).
    let rejected = s
        .warnings()
        .iter()
        .filter(|w| w.contains("rejected"))
        .count();
    assert_eq!(rejected, 1, "{:?}", s.warnings());
    // The others are counted within a second, with no later rejection
    // needed to say so (a flood that stops loses none of them).
    s.advance(Duration::from_secs(2));
    let last_warning = |s: &Sim| {
        s.warnings()
            .last()
            .map(|w| w.to_string())
            .unwrap_or_default()
    };
    let counted = last_warning(&s);
    assert!(
        counted.contains("more bootstrap warnings (rejected)"),
        "{counted}"
    );
    // The next rejection is shown at once.
    let late = s.connect();
    s.send(late, b"junk-junk-junk-junk");
    let last = last_warning(&s);
    assert!(
        last.starts_with("rejected a bootstrap connection"),
        "{last}"
    );
    assert!(s.m.result().is_none());
}

/// Item 1 of the hostile-load review: 1,100 idle connections opened before
/// the ranks arrive must not lock the ranks out.
#[test]
fn idle_strangers_do_not_lock_the_ranks_out() {
    let mut s = Sim::new(Duration::from_secs(60));
    let strangers: Vec<ConnId> = (0..1100).map(|_| s.connect()).collect();
    assert_eq!(s.m.unproven_count(), MAX_PENDING);
    // Those beyond the limit arrived within EVICT_MIN_AGE of the oldest:
    // closed at once, before a challenge.
    let refused: Vec<&ConnId> = strangers
        .iter()
        .filter(|c| s.closed.contains_key(c))
        .collect();
    assert_eq!(refused.len(), 1100 - MAX_PENDING);
    assert!(refused.iter().all(|c| !s.out.contains_key(c)));
    assert!(s.warnings().len() <= 2, "{:?}", s.warnings());

    // The ranks arrive later: the first makes room by closing the oldest
    // stranger; once it has proven the secret, its place is free for the
    // next rank.
    s.advance(Duration::from_secs(1));
    let ranks: Vec<ConnId> = (0..8).map(|r| s.join(r, 8, &[r as u8])).collect();
    for (r, &c) in ranks.iter().enumerate() {
        assert_eq!(s.ring(c), vec![((r + 1) % 8) as u8]);
    }
    assert!(s.closed.contains_key(&strangers[0]));
    assert!(!s.closed.contains_key(&strangers[1]));
    // Ranks that connect at the same time, before proving: each evicts one.
    let mut s2 = Sim::new(Duration::from_secs(60));
    let held: Vec<ConnId> = (0..MAX_PENDING).map(|_| s2.connect()).collect();
    s2.advance(Duration::from_secs(1));
    let cs: Vec<ConnId> = (0..4).map(|_| s2.connect()).collect();
    for (r, &c) in cs.iter().enumerate() {
        let h = s2.hello(c, &SECRET, r as u32, 4, b"");
        s2.send(c, &h);
    }
    assert!(held[..4].iter().all(|c| s2.closed.contains_key(c)));
    assert!(s2.ring(cs[3]).is_empty());
    assert!(s.m.unproven_count() <= MAX_PENDING);

    // The strangers left are closed once they have had HANDSHAKE_TIMEOUT
    // to prove the secret.
    s.advance(HANDSHAKE_TIMEOUT);
    assert_eq!(s.m.unproven_count(), 0);
    assert_eq!(s.m.conn_count(), 8);
    assert!(s.m.result().is_none());
    let w = s.warnings();
    assert!(
        w.iter().any(|w| w.contains("did not prove the secret")),
        "{w:?}"
    );
    assert!(w.len() <= 6, "{w:?}");
}

/// The handshake deadline is short but never past the bootstrap timeout.
#[test]
fn unproven_connections_expire_at_their_own_deadline() {
    let mut s = Sim::new(Duration::from_secs(3));
    let c = s.connect();
    s.advance(Duration::from_millis(2999));
    assert!(!s.closed.contains_key(&c));
    // At 3 s the rendezvous itself fails (nobody joined), closing it too.
    s.advance(Duration::from_millis(1));
    assert!(s.closed.contains_key(&c));
    assert!(s
        .m
        .result()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .contains("no rank joined"));

    let mut cfg = Settings::new(ROOT, SECRET, T);
    cfg.handshake_timeout = Duration::from_secs(1);
    cfg.max_pending = 2;
    let mut s = Sim::with(cfg);
    let a = s.connect();
    s.advance(Duration::from_millis(600));
    assert!(!s.closed.contains_key(&a));
    s.advance(Duration::from_millis(400));
    assert!(s.closed.contains_key(&a));
    // Full of young connections: the new one is refused, no eviction.
    let b = s.connect();
    let c = s.connect();
    let d = s.connect();
    assert!(s.closed.contains_key(&d) && !s.closed.contains_key(&c));
    // Once the oldest is EVICT_MIN_AGE old, a rank takes its place.
    s.advance(EVICT_MIN_AGE);
    let r = s.join(0, 1, b"solo");
    assert!(s.closed.contains_key(&b));
    assert_eq!(s.ring(r), b"solo".to_vec());
}

/// Item 2: a failing `accept` (EMFILE) backs off and warns at most once a
/// second, with a count of the others.
#[test]
fn failing_accept_backs_off_and_warns_once_a_second() {
    let mut s = Sim::new(Duration::from_secs(60));
    let emfile = || AcceptFailure {
        out_of_fds: true,
        msg: "Too many open files (os error 24)".into(),
    };
    let start = s.now;
    let mut attempts = 0;
    while s.now < start + Duration::from_secs(20) {
        if s.m.accepting(s.now) {
            // The listener is readable all the time: every turn accepts.
            attempts += 1;
            s.m.handle_accept_failed(s.now, emfile());
            s.step();
        } else {
            let next = s.m.poll_timeout().expect("a time to accept again");
            assert!(next > s.now);
            s.now = next;
            s.m.handle_timeout(s.now);
            s.step();
        }
    }
    // 10 ms, 20 ms, ... up to 1 s between attempts: about 27 in 20 s, not
    // hundreds of thousands.
    assert!((15..=40).contains(&attempts), "{attempts} attempts");
    let w = s.warnings();
    assert!(w.len() <= 21, "{} warnings", w.len());
    assert!(
        w[0].contains("cannot accept") && w[0].contains("ulimit -n"),
        "{}",
        w[0]
    );
    assert!(w[1].contains("more bootstrap warnings (accept: "), "{w:?}");

    // A successful accept resets the pause.
    s.connect();
    s.m.handle_accept_failed(s.now, emfile());
    assert_eq!(s.m.poll_timeout(), Some(s.now + Duration::from_millis(10)));
    assert!(ACCEPT_BACKOFF_MAX <= Duration::from_secs(1));

    // Out of descriptors with old unproven connections held: the oldest is
    // closed to make room and accepting resumes at once.
    let mut s = Sim::new(Duration::from_secs(60));
    let old = s.connect();
    s.advance(EVICT_MIN_AGE);
    s.m.handle_accept_failed(s.now, emfile());
    s.step();
    assert!(s.closed.contains_key(&old));
    assert!(s.m.accepting(s.now));
}

/// Item 3: on failure, every connected rank (and the rank that caused it)
/// gets the reason before its connection is closed.
#[test]
fn failures_reach_every_rank_before_the_close() {
    let mut s = Sim::new(T);
    let r0 = s.join(0, 4, b"");
    let r1 = s.join(1, 4, b"");
    // A rank whose hello proved the secret but is still arriving.
    let r2 = s.connect();
    let h = s.hello(r2, &SECRET, 2, 4, &[0; 5000]);
    s.send(r2, &h[..200]);
    let stranger = s.connect();
    let r3 = s.join(3, 5, b"");
    let want = "rank 3 says nranks=5, rank 0 says 4";
    assert_eq!(s.m.result(), Some(&Err(want.to_string())));
    for c in [r0, r1, r2, r3] {
        assert_eq!(s.errors(c), [want], "{c:?}");
        // The error frame is the last thing written, and the close comes
        // after it (the driver delivers before closing).
        let out = &s.out[&c];
        assert!(out.ends_with(&error_frame(want)));
        assert_eq!(s.closed[&c], out.len());
    }
    assert!(s.closed.contains_key(&stranger) && s.errors(stranger).is_empty());
    assert_eq!(s.warnings(), [format!("bootstrap failed: {want}")]);
    // Nothing more happens once finished.
    s.send(r0, &contrib(1, b"late"));
    s.advance(T);
    assert_eq!(s.m.poll_timeout(), None);
    assert!(!s.m.accepting(s.now));
}

#[test]
fn missing_ranks_and_slow_rounds_are_named() {
    let mut s = Sim::new(Duration::from_millis(1500));
    let a = s.join(0, 4, b"");
    let b = s.join(2, 4, b"");
    s.advance(Duration::from_millis(1499));
    assert!(s.m.result().is_none());
    s.advance(Duration::from_millis(1));
    let want = "ranks 1, 3 did not join within 1.5s (2 of 4 joined)";
    assert_eq!(s.errors(a), [want]);
    assert_eq!(s.errors(b), [want]);

    let mut s = Sim::new(Duration::from_secs(1));
    let c: Vec<ConnId> = (0..3).map(|r| s.join(r, 3, b"")).collect();
    // Between rounds: no deadline. The round's clock starts with its first
    // contribution.
    s.advance(Duration::from_secs(5));
    s.send(c[0], &contrib(1, b"x"));
    s.send(c[2], &contrib(1, b"x"));
    s.advance(Duration::from_millis(999));
    assert!(s.m.result().is_none());
    s.advance(Duration::from_millis(1));
    let want = "rank 1 did not reach bootstrap round 1 within 1s (the other ranks did)";
    for &x in &c {
        assert_eq!(s.errors(x), [want]);
    }
}

/// The end of a job as the root may see it: a rank finishes its last round
/// and leaves before the others' word that they started that round reaches
/// the root (each comes on its own connection). Not a failure once they
/// arrive; a failure when one goes past the round the rank left after, or
/// never starts it.
#[test]
fn a_rank_that_leaves_before_the_others_are_seen_in_its_round() {
    let rounds_sent_before_leaving = |s: &mut Sim, c: &[ConnId]| {
        s.send(c[0], &contrib(1, &[]));
        s.send(c[2], &contrib(1, &[]));
        s.hang_up(c[2]);
    };
    // The late word arrives: the end of the job, told as K_LEFT.
    let mut s = Sim::new(T);
    let c: Vec<ConnId> = (0..3).map(|r| s.join(r, 3, b"")).collect();
    rounds_sent_before_leaving(&mut s, &c);
    assert!(s.m.result().is_none());
    assert!(s.errors(c[0]).is_empty());
    s.send(c[1], &contrib(1, &[]));
    assert_eq!(s.m.result(), Some(&Ok(())));
    assert!(s.warnings().is_empty(), "{:?}", s.warnings());
    for x in [c[0], c[1]] {
        let left: Vec<_> = s.frames(x).into_iter().filter(|f| f.0 == K_LEFT).collect();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].1, b"rank 2 left the bootstrap");
    }
    // A rank goes on to a round the one that left will not join.
    let mut s = Sim::new(T);
    let c: Vec<ConnId> = (0..3).map(|r| s.join(r, 3, b"")).collect();
    rounds_sent_before_leaving(&mut s, &c);
    s.send(c[0], &contrib(2, &[]));
    let e = s.m.result().cloned().expect("an outcome").unwrap_err();
    assert!(
        e.contains("rank 2 left the bootstrap") && e.contains("round 2"),
        "{e}"
    );
    assert!(s.frames(c[1]).iter().any(|f| f.0 == K_ERROR));
    // The late word never comes: the round's deadline names the late rank
    // and the one that left.
    let mut s = Sim::new(T);
    let c: Vec<ConnId> = (0..3).map(|r| s.join(r, 3, b"")).collect();
    rounds_sent_before_leaving(&mut s, &c);
    s.advance(T);
    let e = s.m.result().cloned().expect("an outcome").unwrap_err();
    assert!(
        e.contains("rank 1 did not reach bootstrap round 1") && e.contains("rank 2 left"),
        "{e}"
    );
}

#[test]
fn departures_duplicates_and_latecomers() {
    // Leaving before all joined, and mid-round, are failures.
    let mut s = Sim::new(T);
    let a = s.join(0, 3, b"");
    let b = s.join(1, 3, b"");
    s.m.handle_closed(s.now, b, Some("Connection reset by peer".into()));
    s.step();
    let e = &s.errors(a)[0];
    assert!(
        e.contains("rank 1 left the bootstrap before all ranks joined"),
        "{e}"
    );
    assert!(e.contains("reset"), "{e}");

    let mut s = Sim::new(T);
    let c: Vec<ConnId> = (0..3).map(|r| s.join(r, 3, b"")).collect();
    s.send(c[0], &contrib(1, b"x"));
    s.hang_up(c[2]);
    assert_eq!(s.errors(c[0]), ["rank 2 left the bootstrap"]);
    assert_eq!(
        s.m.result(),
        Some(&Err("rank 2 left the bootstrap".to_string()))
    );
    assert_eq!(s.warnings().len(), 1);

    // A rank joining twice.
    let mut s = Sim::new(T);
    let a = s.join(2, 3, b"");
    let b = s.join(2, 3, b"");
    for c in [a, b] {
        assert!(s.errors(c)[0].starts_with("rank 2 joined twice (from 10.0.1.2:"));
    }

    // Out of range, and a wrong round / unexpected message from a rank.
    let mut s = Sim::new(T);
    let a = s.join(0, 2, b"");
    let bad = s.join(5, 2, b"");
    for c in [a, bad] {
        assert_eq!(
            s.errors(c),
            ["rank 5 is out of range: nranks=2, so ranks are 0..=1"]
        );
    }
    let mut s = Sim::new(T);
    let c: Vec<ConnId> = (0..2).map(|r| s.join(r, 2, b"")).collect();
    s.send(c[1], &contrib(2, b""));
    assert!(s.errors(c[0])[0].contains("rank 1 is at bootstrap round 2"));

    // After the rendezvous, a late rank with the secret is told, and the
    // others carry on.
    let mut s = Sim::new(T);
    let c: Vec<ConnId> = (0..2).map(|r| s.join(r, 2, b"")).collect();
    let late = s.join(1, 2, b"");
    assert!(s.errors(late)[0].contains("tried to join after all 2 ranks had joined"));
    assert!(s.m.result().is_none());
    s.send(c[0], &contrib(1, b""));
    s.send(c[1], &contrib(1, b""));
    assert!(s.m.result().is_none());
    assert!(s.errors(c[0]).is_empty() && s.errors(c[1]).is_empty());
}

#[test]
fn shutdown_tells_the_ranks_and_ends_well() {
    let mut s = Sim::new(T);
    let a = s.join(0, 2, b"");
    s.m.handle_shutdown(s.now);
    s.step();
    assert_eq!(s.m.result(), Some(&Ok(())));
    assert_eq!(
        s.errors(a),
        ["the bootstrap root at 10.0.0.1:29500 was shut down"]
    );
    assert!(s.closed.contains_key(&a));
    assert!(s.warnings().is_empty());
    // Connections after the end are closed at once.
    let late = s.m.handle_connect(s.now, ROOT, [0; NONCE_LEN]);
    s.step();
    assert!(s.closed.contains_key(&late) && !s.out.contains_key(&late));
}

/// What the root sends grows with p, not p²: a challenge, an accept and
/// the successor's address per rank, and nothing per round.
#[test]
fn the_root_sends_o_of_p_bytes() {
    let mut per_rank = Vec::new();
    for n in [16u32, 256, 1024] {
        let mut s = Sim::new(T);
        let addr = [6u8; 23]; // an IPv6 address as a hello payload
        let conns: Vec<ConnId> = (0..n).map(|r| s.join(r, n, &addr)).collect();
        for round in 1..=5 {
            for &c in &conns {
                s.send(c, &contrib(round, &[]));
            }
        }
        let sent: usize = s.out.values().map(Vec::len).sum();
        per_rank.push(sent as f64 / n as f64);
        assert!(s.m.result().is_none());
    }
    // The same bytes per rank at every size (challenge, accept, address).
    assert!(per_rank.windows(2).all(|w| w[0] == w[1]), "{per_rank:?}");
    assert!(per_rank[0] < 200.0, "{per_rank:?}");
}

// ---------------------------------------------------------------------------
// A whole job's bootstrap over a simulated network

/// The simulated network: every message costs its sender's link `bytes /
/// bandwidth` (one message at a time per sender), then `latency` on the
/// wire, then `per_message` of its receiver's time (one at a time per
/// receiver). The root is the real [`Rendezvous`] machine, fed the real
/// frames at the simulated times.
#[derive(Clone, Copy, Debug)]
struct Network {
    latency: Duration,
    bytes_per_s: f64,
    per_message: Duration,
}

impl Network {
    fn wire(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_s)
    }
}

/// What a job's creation sends through the bootstrap after the rendezvous:
/// the all-gathers of a communicator's creation (peer descriptions with
/// the addresses, the topology round, the piece summary, the barrier, the
/// single-copy agreement), as bytes per rank.
const INIT_ROUNDS: [usize; 5] = [120, 300, 24, 0, 1];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum JobEv {
    /// `bytes` of a frame reach the root on `conn` (index into `conns`).
    AtRoot { conn: usize, frame: usize },
    /// The root's bytes `[from, to)` of its output to `rank` arrive.
    FromRoot { rank: usize, len: usize },
    /// Round `round`'s contribution of rank `src` arrives at `rank`.
    Item {
        rank: usize,
        round: usize,
        src: usize,
    },
}

/// The outcome of a simulated bootstrap of `p` ranks.
#[derive(Debug)]
struct JobOutcome {
    /// Until every rank finished the last round.
    elapsed: Duration,
    root_sent: usize,
    root_received: usize,
}

/// Plays the bootstrap of a `p`-rank communicator (protocol v3): every rank
/// connects to the root at once, proves the secret and sends its address;
/// the root hands each its successor's; then the rounds of
/// [`INIT_ROUNDS`] go round the ring, each announced to the root.
fn simulate_job(p: usize, net: Network) -> JobOutcome {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let t0 = Instant::now();
    let mut m = Rendezvous::new(Settings::new(ROOT, SECRET, Duration::from_secs(3600)), t0);
    let mut q: BinaryHeap<Reverse<(Duration, u64, JobEv)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |q: &mut BinaryHeap<_>, at: Duration, ev: JobEv| {
        seq += 1;
        q.push(Reverse((at, seq, ev)));
    };
    // Connections: rank r's is conns[r]; frames waiting to reach the root.
    let mut conns: Vec<ConnId> = Vec::with_capacity(p);
    let mut frames: Vec<Vec<u8>> = Vec::new();
    let mut root_busy = Duration::ZERO;
    let mut root_link = Duration::ZERO;
    let mut rank_link = vec![Duration::ZERO; p];
    let mut rank_busy = vec![Duration::ZERO; p];
    let (mut root_sent, mut root_received) = (0usize, 0usize);
    let mut got_from_root: Vec<Vec<u8>> = vec![Vec::new(); p];
    let mut hello_sent = vec![false; p];
    let mut ring_at: Vec<Option<Duration>> = vec![None; p];
    // Per rank: the round it is in, items of each round received, and
    // when it finished the last round.
    let rounds = INIT_ROUNDS.len();
    let mut items: Vec<Vec<usize>> = vec![vec![0; rounds]; p];
    let mut round_of = vec![0usize; p];
    let mut early: Vec<Vec<(usize, usize)>> = vec![Vec::new(); p];
    let mut done_at = vec![Duration::ZERO; p];
    // Every rank connects at 0 (a round trip), the root challenges it.
    for r in 0..p {
        let mut nonce = [0u8; NONCE_LEN];
        nonce[..8].copy_from_slice(&(r as u64).to_le_bytes());
        let c = m.handle_connect(t0 + 2 * net.latency, ROOT, nonce);
        conns.push(c);
    }
    let conn_rank: BTreeMap<ConnId, usize> =
        conns.iter().enumerate().map(|(r, &c)| (c, r)).collect();
    // Sends what the root queued, over its link.
    macro_rules! root_out {
        ($now:expr) => {{
            while let Some(t) = m.poll_transmit() {
                let Some(&r) = conn_rank.get(&t.conn) else {
                    continue;
                };
                root_link = root_link.max($now) + net.wire(t.bytes.len());
                root_sent += t.bytes.len();
                got_from_root[r].extend_from_slice(&t.bytes);
                let len = got_from_root[r].len();
                push(
                    &mut q,
                    root_link + net.latency,
                    JobEv::FromRoot { rank: r, len },
                );
            }
            while m.poll_close().is_some() {}
            while m.poll_log().is_some() {}
        }};
    }
    root_out!(2 * net.latency);
    // A rank starts round `k` at `at`: it tells the root and sends its
    // contribution to its successor.
    macro_rules! start_round {
        ($r:expr, $k:expr, $at:expr) => {{
            let (r, k, at): (usize, usize, Duration) = ($r, $k, $at);
            round_of[r] = k;
            if k > 0 {
                let f = contrib(k as u64, &[]);
                rank_link[r] = rank_link[r].max(at) + net.wire(f.len());
                frames.push(f);
                push(
                    &mut q,
                    rank_link[r] + net.latency,
                    JobEv::AtRoot {
                        conn: r,
                        frame: frames.len() - 1,
                    },
                );
            }
            let next = (r + 1) % p;
            rank_link[r] = rank_link[r].max(at) + net.wire(INIT_ROUNDS[k] + 17);
            push(
                &mut q,
                rank_link[r] + net.latency,
                JobEv::Item {
                    rank: next,
                    round: k,
                    src: r,
                },
            );
            let held = std::mem::take(&mut early[r]);
            for (round, src) in held {
                push(
                    &mut q,
                    at,
                    JobEv::Item {
                        rank: r,
                        round,
                        src,
                    },
                );
            }
        }};
    }
    let mut finished = 0;
    while let Some(Reverse((at, _, ev))) = q.pop() {
        match ev {
            JobEv::AtRoot { conn, frame } => {
                root_busy = root_busy.max(at) + net.per_message;
                let now = root_busy;
                root_received += frames[frame].len();
                let f = std::mem::take(&mut frames[frame]);
                // As the driver reads: at most `read_limit` at a time.
                let mut off = 0;
                while off < f.len() {
                    let k = m.read_limit(conns[conn]).min(f.len() - off);
                    if k == 0 {
                        break;
                    }
                    m.handle_data(t0 + now, conns[conn], &f[off..off + k]);
                    off += k;
                }
                root_out!(now);
            }
            JobEv::FromRoot { rank: r, len } => {
                rank_busy[r] = rank_busy[r].max(at) + net.per_message;
                let now = rank_busy[r];
                let mut fb = FrameBuf {
                    buf: got_from_root[r][..len].to_vec(),
                };
                let mut kinds = Vec::new();
                while let Ok(Some((k, b))) = fb.next_frame() {
                    kinds.push((k, b));
                }
                if !hello_sent[r] {
                    if let Some(rnonce) =
                        kinds.first().and_then(|(k, b)| parse_challenge(*k, b).ok())
                    {
                        hello_sent[r] = true;
                        let h = hello_for(&rnonce, &SECRET, r as u32, p as u32, &[6u8; 23]);
                        rank_link[r] = rank_link[r].max(now) + net.wire(h.len());
                        frames.push(h);
                        push(
                            &mut q,
                            rank_link[r] + net.latency,
                            JobEv::AtRoot {
                                conn: r,
                                frame: frames.len() - 1,
                            },
                        );
                    }
                }
                if ring_at[r].is_none() && kinds.iter().any(|(k, _)| *k == K_RING) {
                    // Connect to the successor (a round trip), then round 0.
                    let start = now + 2 * net.latency;
                    ring_at[r] = Some(start);
                    start_round!(r, 0, start);
                }
            }
            JobEv::Item {
                rank: r,
                round: k,
                src,
            } => {
                if ring_at[r].is_none() || k > round_of[r] {
                    early[r].push((k, src));
                    continue;
                }
                rank_busy[r] = rank_busy[r].max(at) + net.per_message;
                let now = rank_busy[r];
                let next = (r + 1) % p;
                if next != src {
                    rank_link[r] = rank_link[r].max(now) + net.wire(INIT_ROUNDS[k] + 17);
                    push(
                        &mut q,
                        rank_link[r] + net.latency,
                        JobEv::Item {
                            rank: next,
                            round: k,
                            src,
                        },
                    );
                }
                items[r][k] += 1;
                if items[r][k] == p - 1 {
                    let end = now.max(rank_link[r]);
                    if k + 1 < rounds {
                        start_round!(r, k + 1, end);
                    } else {
                        done_at[r] = end;
                        finished += 1;
                    }
                }
            }
        }
    }
    assert_eq!(finished, p, "every rank finished");
    assert!(m.result().is_none(), "{:?}", m.result());
    JobOutcome {
        elapsed: done_at.iter().copied().max().unwrap_or_default(),
        root_sent,
        root_received,
    }
}

/// A datacenter network: 25 µs one way, 10 Gb/s, 5 µs per message.
const DC: Network = Network {
    latency: Duration::from_micros(25),
    bytes_per_s: 1.25e9,
    per_message: Duration::from_micros(5),
};

/// What the root sent for the same rounds when every round went through it
/// (protocol v2): every rank got every contribution of every round.
fn star_root_bytes(p: usize) -> usize {
    let per_rank_hello = 45 + 37;
    let rounds: usize = std::iter::once(120)
        .chain(INIT_ROUNDS.iter().skip(1).copied())
        .map(|s| p * p * (s + 17))
        .sum();
    p * per_rank_hello + rounds
}

/// Issue 23: the bootstrap of 1,024 ranks over a simulated network. The
/// root sends O(p) bytes (a constant per rank; the old star sent every
/// contribution to every rank, O(p²)) and receives O(p) (the hellos and
/// one small frame per rank and round); creation time grows linearly (the
/// rounds go round the ring). Prints the curve.
#[test]
fn a_1024_rank_bootstrap_over_a_simulated_network() {
    let mut rows = Vec::new();
    for p in [2usize, 8, 32, 128, 512, 1024] {
        let o = simulate_job(p, DC);
        println!(
            "bootstrap sim p={p:5}: {:8.2} ms, root sent {:9} B ({:.0} per rank; star would send {}), received {:9} B",
            o.elapsed.as_secs_f64() * 1e3,
            o.root_sent,
            o.root_sent as f64 / p as f64,
            star_root_bytes(p),
            o.root_received
        );
        rows.push((p, o));
    }
    let per_rank: Vec<f64> = rows
        .iter()
        .map(|(p, o)| o.root_sent as f64 / *p as f64)
        .collect();
    assert!(per_rank.windows(2).all(|w| w[0] == w[1]), "{per_rank:?}");
    for (p, o) in &rows {
        assert!(
            o.root_received < p * 400,
            "p={p}: root received {}",
            o.root_received
        );
    }
    // Linear, not quadratic: 1024 ranks take about twice as long as 512.
    let t = |p: usize| {
        rows.iter()
            .find(|r| r.0 == p)
            .map(|r| r.1.elapsed.as_secs_f64())
            .unwrap_or(0.0)
    };
    let ratio = t(1024) / t(512);
    assert!((1.5..2.5).contains(&ratio), "t(1024)/t(512) = {ratio}");
}

/// The same curve up to 4,096 ranks (a minute: `cargo test -p braid --lib
/// bootstrap_curve -- --ignored --nocapture`).
#[test]
#[ignore]
fn bootstrap_curve_to_4096_ranks() {
    for p in [2048usize, 4096] {
        let o = simulate_job(p, DC);
        println!(
            "bootstrap sim p={p:5}: {:8.2} ms, root sent {:9} B ({:.0} per rank; star would send {}), received {:9} B",
            o.elapsed.as_secs_f64() * 1e3,
            o.root_sent,
            o.root_sent as f64 / p as f64,
            star_root_bytes(p),
            o.root_received
        );
    }
}

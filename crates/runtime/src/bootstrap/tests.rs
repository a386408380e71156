//! The bootstrap over real sockets: root thread, driver and clients
//! together. The root's logic alone is tested without sockets in `sim.rs`.

use std::fmt;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::Barrier as StdBarrier;
use std::time::{Duration, Instant};

use super::client::Wire;
use super::wire::{
    client_mac, frame_header, hello_header, parse_challenge, HelloFixed, K_DATA, K_ERROR, K_HELLO,
    MAC_LEN, MAGIC, MAX_PAYLOAD, NONCE_LEN, VERSION,
};
use super::{Bootstrap, RootServer, UniqueId};
use crate::error::{Error, Result};

const LOCAL4: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

fn payload_for(rank: u32) -> Vec<u8> {
    match rank {
        0 => Vec::new(),
        1 => (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect(),
        r => format!("rank-{r}").into_bytes(),
    }
}

fn root(timeout: Duration) -> (UniqueId, RootServer) {
    RootServer::create(LOCAL4, timeout).expect("root")
}

type Joined = Result<(Bootstrap, Vec<Vec<u8>>)>;

fn spawn_rank(
    id: UniqueId,
    rank: u32,
    nranks: u32,
    payload: Vec<u8>,
    t: Duration,
) -> std::thread::JoinHandle<Joined> {
    std::thread::spawn(move || Bootstrap::connect(&id, rank, nranks, &payload, t))
}

fn err_text<T: fmt::Debug>(r: Result<T>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn four_ranks_roundtrip(bind: SocketAddr) {
    let t = Duration::from_secs(10);
    let (id, server) = RootServer::create(bind, t).expect("root");
    assert_ne!(id.addr.port(), 0);
    let n = 4;
    let handles: Vec<_> = (0..n)
        .map(|r| {
            std::thread::spawn(move || -> Result<()> {
                let (b, all) = Bootstrap::connect(&id, r, n, &payload_for(r), t)?;
                assert_eq!(b.rank(), r);
                assert_eq!(b.nranks(), n);
                let want: Vec<Vec<u8>> = (0..n).map(payload_for).collect();
                assert_eq!(all, want);
                for round in 0..5u32 {
                    let mine = format!("r{r}x{round}").into_bytes();
                    let got = b.allgather(&mine)?;
                    let want: Vec<Vec<u8>> = (0..n)
                        .map(|s| format!("r{s}x{round}").into_bytes())
                        .collect();
                    assert_eq!(got, want);
                    b.barrier()?;
                }
                // a big round: 1 MiB from everyone
                let big = vec![r as u8; 1 << 20];
                let got = b.allgather(&big)?;
                for (s, g) in got.iter().enumerate() {
                    assert_eq!(g.len(), 1 << 20);
                    assert!(g.iter().all(|&x| x == s as u8));
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread").expect("rank");
    }
    // All ranks left after finishing: the root ends cleanly.
    server.join().expect("root outcome");
}

#[test]
fn four_ranks_allgather_ipv4() {
    four_ranks_roundtrip(LOCAL4);
}

#[test]
fn four_ranks_allgather_ipv6() {
    let a6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 0);
    if TcpListener::bind(a6).is_err() {
        println!("skipping: cannot bind [::1]");
        return;
    }
    four_ranks_roundtrip(a6);
}

#[test]
fn single_rank() {
    let t = Duration::from_secs(5);
    let (id, server) = root(t);
    let (b, all) = Bootstrap::connect(&id, 0, 1, b"solo", t).unwrap();
    assert_eq!(all, vec![b"solo".to_vec()]);
    assert_eq!(b.allgather(b"x").unwrap(), vec![b"x".to_vec()]);
    let max = vec![7u8; MAX_PAYLOAD];
    assert_eq!(b.allgather(&max).unwrap(), vec![max.clone()]);
    drop(b);
    server.join().unwrap();
    // The largest payload also fits in the hello.
    let (id, server) = root(t);
    let (b, all) = Bootstrap::connect(&id, 0, 1, &max, t).unwrap();
    assert_eq!(all, vec![max]);
    drop(b);
    server.join().unwrap();
}

#[test]
fn root_started_after_clients() {
    let t = Duration::from_secs(10);
    let listener = TcpListener::bind(LOCAL4).unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener); // free the port; the root binds it later
    let id = UniqueId::generate(addr).unwrap();
    let hs: Vec<_> = (0..3)
        .map(|r| spawn_rank(id, r, 3, vec![r as u8], t))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let server = RootServer::bind(&id, t).unwrap();
    for h in hs {
        let (_, all) = h.join().unwrap().unwrap();
        assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
    }
    server.join().unwrap();
}

#[test]
fn wrong_secret_rejected_others_succeed() {
    let t = Duration::from_secs(10);
    let (id, server) = root(t);
    let mut bad = id;
    bad.secret[0] ^= 1;
    // The impostor claims rank 1 and arrives first.
    let e = err_text(Bootstrap::connect(&bad, 1, 3, b"evil", t));
    assert!(e.contains("secret did not match"), "{e}");
    assert!(e.contains("UniqueId"), "{e}");
    let hs: Vec<_> = (0..3)
        .map(|r| spawn_rank(id, r, 3, vec![r as u8], t))
        .collect();
    for h in hs {
        let (b, all) = h.join().unwrap().unwrap();
        assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        drop(b);
    }
    server.join().unwrap();
}

#[test]
fn disagreeing_nranks_reported_to_all() {
    let t = Duration::from_secs(5);
    let (id, server) = root(t);
    let start = Instant::now();
    let r0 = spawn_rank(id, 0, 4, vec![], t);
    let r1 = spawn_rank(id, 1, 4, vec![], t);
    std::thread::sleep(Duration::from_millis(300));
    let r3 = spawn_rank(id, 3, 5, vec![], t);
    for h in [r0, r1, r3] {
        let e = err_text(h.join().unwrap());
        assert!(e.contains("rank 3 says nranks=5"), "{e}");
        assert!(e.contains("says 4"), "{e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let e = err_text(server.join());
    assert!(e.contains("rank 3 says nranks=5"), "{e}");
}

#[test]
fn duplicate_rank_reported() {
    let t = Duration::from_secs(5);
    let (id, server) = root(t);
    let a = spawn_rank(id, 2, 3, vec![], t);
    let b0 = spawn_rank(id, 0, 3, vec![], t);
    std::thread::sleep(Duration::from_millis(300));
    let b = spawn_rank(id, 2, 3, vec![], t);
    for h in [a, b0, b] {
        let e = err_text(h.join().unwrap());
        assert!(e.contains("rank 2 joined twice"), "{e}");
    }
    assert!(err_text(server.join()).contains("rank 2 joined twice"));
}

#[test]
fn out_of_range_rank_rejected_locally() {
    let id = UniqueId::generate(LOCAL4).unwrap();
    let e = Bootstrap::connect(&id, 4, 4, b"", Duration::from_secs(1)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)));
    assert!(e.to_string().contains("rank 4 is out of range"), "{e}");
    let e = Bootstrap::connect(&id, 0, 0, b"", Duration::from_secs(1)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// A misbehaving client that passes the handshake with a rank >= nranks.
#[test]
fn out_of_range_rank_reported_by_root() {
    let t = Duration::from_secs(5);
    let (id, server) = root(t);
    let r0 = spawn_rank(id, 0, 2, vec![], t);
    std::thread::sleep(Duration::from_millis(200));
    let mut s = TcpStream::connect(id.addr).unwrap();
    let mut w = Wire::new(&mut s, id.addr, t, None);
    let dl = Instant::now() + t;
    let (_, body) = w.read_frame(dl, "test").unwrap();
    let rnonce = &body[12..];
    let cnonce = [7u8; NONCE_LEN];
    let (rank, nranks) = (5u32, 2u32);
    let mut hello = Vec::new();
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&rank.to_le_bytes());
    hello.extend_from_slice(&nranks.to_le_bytes());
    hello.extend_from_slice(&cnonce);
    hello.extend_from_slice(&client_mac(&id.secret, rnonce, &cnonce, rank, nranks));
    let hdr = frame_header(K_HELLO, hello.len());
    w.write_all(&[&hdr, &hello], dl, "test").unwrap();
    let e = err_text(w.read_frame(dl, "test"));
    assert!(e.contains("rank 5 is out of range"), "{e}");
    let e = err_text(r0.join().unwrap());
    assert!(e.contains("rank 5 is out of range"), "{e}");
    drop(server);
}

#[test]
fn missing_ranks_named_within_timeout() {
    let t = Duration::from_millis(1500);
    let (id, server) = root(t);
    let start = Instant::now();
    let hs: Vec<_> = [0u32, 2]
        .iter()
        .map(|&r| spawn_rank(id, r, 4, vec![], t))
        .collect();
    for h in hs {
        let e = err_text(h.join().unwrap());
        assert!(e.contains("ranks 1, 3 did not join within 1.5s"), "{e}");
    }
    let el = start.elapsed();
    assert!(
        el >= Duration::from_millis(1400) && el < Duration::from_millis(2500),
        "{el:?}"
    );
    assert!(err_text(server.join()).contains("ranks 1, 3 did not join"));
}

#[test]
fn client_without_root_times_out_naming_root() {
    let listener = TcpListener::bind(LOCAL4).unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let id = UniqueId::generate(addr).unwrap();
    let start = Instant::now();
    let e = err_text(Bootstrap::connect(
        &id,
        0,
        2,
        b"",
        Duration::from_millis(700),
    ));
    assert!(e.contains(&addr.to_string()), "{e}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn root_that_vanishes_is_reported() {
    // A "root" that accepts and then says nothing.
    let listener = TcpListener::bind(LOCAL4).unwrap();
    let addr = listener.local_addr().unwrap();
    let id = UniqueId::generate(addr).unwrap();
    let silent = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        drop(s);
    });
    let start = Instant::now();
    let e = err_text(Bootstrap::connect(
        &id,
        0,
        2,
        b"",
        Duration::from_millis(800),
    ));
    assert!(
        e.contains(&addr.to_string()) && e.contains("no answer"),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_millis(1400));
    silent.join().unwrap();
}

#[test]
fn garbage_and_oversized_frames_do_not_break_root() {
    let t = Duration::from_secs(10);
    let (id, server) = root(t);
    let addr = id.addr;
    // Strangers: HTTP, an oversized length, a truncated frame, a wrong magic,
    // a silent connection.
    let mut strangers = Vec::new();
    for junk in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        {
            let mut v = u32::MAX.to_le_bytes().to_vec();
            v.extend_from_slice(&[K_HELLO; 100]);
            v
        },
        {
            let mut v = 1000u32.to_le_bytes().to_vec();
            v.extend_from_slice(&[K_HELLO; 10]);
            v
        },
        {
            let mut v = frame_header(K_HELLO, 100).to_vec();
            v.extend_from_slice(&[0x55; 100]);
            v
        },
        Vec::new(),
    ] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&junk).unwrap();
        strangers.push(s);
    }
    let hs: Vec<_> = (0..4u32)
        .map(|r| {
            std::thread::spawn(move || -> Result<Vec<Vec<u8>>> {
                let (b, _) = Bootstrap::connect(&id, r, 4, &[r as u8], t)?;
                b.allgather(&[r as u8 + 10])
            })
        })
        .collect();
    for h in hs {
        let got = h.join().unwrap().unwrap();
        assert_eq!(got, vec![vec![10], vec![11], vec![12], vec![13]]);
    }
    // The oversized-length stranger was dropped by the root: its read sees EOF.
    let mut s = &strangers[1];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = vec![0u8; 4096];
    let mut total = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(e) => panic!("expected EOF from the root, got {e}"),
        }
    }
    assert!(
        total > 0 && total < 200,
        "challenge only, got {total} bytes"
    );
    server.join().unwrap();
}

/// A complete hello with a valid proof.
fn hello_frame(
    secret: &[u8; 16],
    rnonce: &[u8; NONCE_LEN],
    rank: u32,
    nranks: u32,
    payload: &[u8],
) -> Vec<u8> {
    let cnonce = [9; NONCE_LEN];
    let h = HelloFixed {
        rank,
        nranks,
        cnonce,
        mac: client_mac(secret, rnonce, &cnonce, rank, nranks),
    };
    [&hello_header(payload.len())[..], &h.encode(), payload].concat()
}

/// A stranger that connects and reads the root's challenge.
fn stranger(id: &UniqueId, t: Duration) -> (TcpStream, [u8; NONCE_LEN]) {
    let mut s = TcpStream::connect(id.addr).unwrap();
    let mut w = Wire::new(&mut s, id.addr, t, None);
    let (kind, body) = w.read_frame(Instant::now() + t, "test").unwrap();
    let nonce = parse_challenge(kind, &body).unwrap();
    (s, nonce)
}

/// Reads what the root says to a stranger: its error message, or
/// "EOF" when it closes without one. Fails if nothing comes within `t`.
fn root_verdict(s: &mut TcpStream, id: &UniqueId, t: Duration) -> String {
    let mut w = Wire::new(s, id.addr, t, None);
    match w.read_raw_frame(Instant::now() + t, "test") {
        Ok((K_ERROR, body)) => String::from_utf8_lossy(&body).into_owned(),
        Ok((kind, _)) => panic!("the root answered a stranger with a frame of kind {kind}"),
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("closed the connection"), "{e}");
            "EOF".into()
        }
    }
}

#[test]
fn strangers_are_refused_early_and_ranks_still_join() {
    let t = Duration::from_secs(10);
    let (id, server) = root(t);
    let quick = Duration::from_secs(3);

    // A wrong secret in a hello that announces the largest frame: the
    // root answers after the hello's fixed part, without waiting for
    // (or buffering) the 16 MiB it announced.
    let (mut a, _) = stranger(&id, t);
    let fixed = HelloFixed {
        rank: 0,
        nranks: 3,
        cnonce: [7; NONCE_LEN],
        mac: [0; MAC_LEN],
    };
    a.write_all(&hello_header(MAX_PAYLOAD)).unwrap();
    a.write_all(&fixed.encode()).unwrap();
    let start = Instant::now();
    let v = root_verdict(&mut a, &id, quick);
    assert!(v.contains("secret did not match"), "{v}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );

    // The right secret, but the hello is cut short and the stranger
    // leaves: it never counts as rank 1.
    let (mut b, nonce) = stranger(&id, t);
    let hello = hello_frame(&id.secret, &nonce, 1, 3, &[1; 100]);
    b.write_all(&hello[..hello.len() - 10]).unwrap();
    b.shutdown(Shutdown::Write).unwrap();
    assert_eq!(root_verdict(&mut b, &id, quick), "EOF");

    // Another protocol version is told so.
    let (mut c, _) = stranger(&id, t);
    let mut v2 = hello_header(0).to_vec();
    v2.extend_from_slice(&fixed.encode());
    v2[5 + 8] = 4;
    c.write_all(&v2).unwrap();
    let v = root_verdict(&mut c, &id, quick);
    assert!(
        v.contains("version mismatch") && v.contains("this rank v4"),
        "{v}"
    );

    // An empty frame, a frame of another kind, a hello too short to be
    // one: dropped without an answer.
    for junk in [
        vec![0, 0, 0, 0],
        frame_header(K_DATA, 3)
            .iter()
            .chain(&[1, 2, 3])
            .copied()
            .collect(),
        {
            let mut v = frame_header(K_HELLO, 40).to_vec();
            v.extend_from_slice(&fixed.encode()[..40]);
            v
        },
    ] {
        let (mut d, _) = stranger(&id, t);
        d.write_all(&junk).unwrap();
        assert_eq!(root_verdict(&mut d, &id, quick), "EOF", "{junk:?}");
    }

    // The real ranks, rank 1 included, still join and work.
    let hs: Vec<_> = (0..3u32)
        .map(|r| {
            std::thread::spawn(move || -> Result<Vec<Vec<u8>>> {
                let (b, all) = Bootstrap::connect(&id, r, 3, &[r as u8], t)?;
                assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
                b.allgather(&[r as u8 + 10])
            })
        })
        .collect();
    for h in hs {
        assert_eq!(
            h.join().unwrap().unwrap(),
            vec![vec![10], vec![11], vec![12]]
        );
    }
    server.join().unwrap();
}

#[test]
fn rank_leaving_mid_allgather_is_named() {
    let t = Duration::from_secs(5);
    let (id, server) = root(t);
    let sync = Arc::new(StdBarrier::new(4));
    let hs: Vec<_> = (0..4u32)
        .map(|r| {
            let sync = sync.clone();
            std::thread::spawn(move || -> Result<()> {
                let (b, _) = Bootstrap::connect(&id, r, 4, &[], t)?;
                b.allgather(b"one")?;
                sync.wait();
                if r == 2 {
                    drop(b);
                    return Ok(());
                }
                // Make sure the others are mid-round when rank 2 leaves.
                b.allgather(b"two").map(|_| ())
            })
        })
        .collect();
    let start = Instant::now();
    for (r, h) in hs.into_iter().enumerate() {
        let out = h.join().unwrap();
        if r == 2 {
            out.unwrap();
        } else {
            let e = err_text(out);
            assert!(e.contains("rank 2 left the bootstrap"), "rank {r}: {e}");
        }
    }
    assert!(start.elapsed() < Duration::from_secs(4));
    // The root may see rank 2 leave before or after the others' contributions.
    let _ = server.join();
}

#[test]
fn round_timeout_names_the_missing_rank() {
    let t = Duration::from_millis(1000);
    let (id, server) = root(t);
    let sync = Arc::new(StdBarrier::new(3));
    let hs: Vec<_> = (0..3u32)
        .map(|r| {
            let sync = sync.clone();
            std::thread::spawn(move || -> Result<()> {
                let (b, _) = Bootstrap::connect(&id, r, 3, &[], t)?;
                sync.wait();
                if r == 1 {
                    // Rank 1 stays connected but never contributes in time.
                    std::thread::sleep(Duration::from_millis(2000));
                    return Ok(());
                }
                b.allgather(b"x").map(|_| ())
            })
        })
        .collect();
    let start = Instant::now();
    for (r, h) in hs.into_iter().enumerate() {
        let out = h.join().unwrap();
        if r != 1 {
            let e = err_text(out);
            assert!(e.contains("rank 1 did not reach bootstrap round 1"), "{e}");
        }
    }
    assert!(start.elapsed() < Duration::from_millis(2600));
    assert!(err_text(server.join()).contains("rank 1 did not reach"));
}

#[test]
fn bind_address_in_use_says_so() {
    let l = TcpListener::bind(LOCAL4).unwrap();
    let id = UniqueId::generate(l.local_addr().unwrap()).unwrap();
    let e = RootServer::bind(&id, Duration::from_secs(1)).unwrap_err();
    assert!(e.to_string().contains("address in use"), "{e}");
}

#[test]
fn huge_timeouts_do_not_overflow() {
    let (id, server) = root(Duration::MAX);
    let (b, _) = Bootstrap::connect(&id, 0, 1, b"", Duration::MAX).unwrap();
    b.barrier().unwrap();
    drop(b);
    server.join().unwrap();
}

#[test]
fn shutdown_and_drop_do_not_hang() {
    let t = Duration::from_secs(60);
    let (_id, server) = root(t);
    let start = Instant::now();
    server.shutdown().unwrap();
    assert!(start.elapsed() < Duration::from_secs(2));
    let (_id, server) = root(t);
    drop(server);
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn oversized_payload_rejected() {
    let id = UniqueId::generate(LOCAL4).unwrap();
    let big = vec![0u8; MAX_PAYLOAD + 1];
    let e = Bootstrap::connect(&id, 0, 1, &big, Duration::from_secs(1)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// Raises this process's soft limit of open files to at least `want` (the
/// hard limit allowing); returns whether it is there now.
pub(super) fn ensure_open_files(want: u64) -> bool {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limits into `r`, a valid rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return false;
    }
    if r.rlim_cur >= want {
        return true;
    }
    if r.rlim_max < want {
        return false;
    }
    r.rlim_cur = want;
    // SAFETY: setrlimit reads the limits from `r`, a valid rlimit; raising
    // the soft limit up to the hard one only lets this process open more.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) == 0 }
}

/// Item 1 of the hostile-load review, over real sockets: 1,100 idle
/// connections opened before the ranks arrive do not lock them out. The
/// root closes the newest ones while it is full of young connections (the
/// ranks connect again) and then the oldest to make room.
#[test]
fn idle_connections_do_not_lock_the_ranks_out() {
    if !ensure_open_files(4096) {
        println!("skipping: cannot open 4096 files (ulimit -n)");
        return;
    }
    let t = Duration::from_secs(20);
    let (id, server) = root(t);
    let idle: Vec<TcpStream> = (0..1100)
        .filter_map(|_| TcpStream::connect_timeout(&id.addr, Duration::from_secs(2)).ok())
        .collect();
    assert!(idle.len() >= 1000, "{} connections", idle.len());
    let start = Instant::now();
    let hs: Vec<_> = (0..4)
        .map(|r| spawn_rank(id, r, 4, vec![r as u8], t))
        .collect();
    for h in hs {
        let (b, all) = h.join().unwrap().expect("a rank locked out");
        assert_eq!(all, vec![vec![0], vec![1], vec![2], vec![3]]);
        drop(b);
    }
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    server.join().unwrap();
    drop(idle);
}

/// A rank whose connection the root closes before the challenge (it was
/// full, or not quite up) connects again within its deadline.
#[test]
fn client_connects_again_when_closed_before_the_challenge() {
    let t = Duration::from_secs(10);
    let listener = TcpListener::bind(LOCAL4).unwrap();
    let id = UniqueId::generate(listener.local_addr().unwrap()).unwrap();
    let door = std::thread::spawn(move || {
        for _ in 0..3 {
            let (s, _) = listener.accept().unwrap();
            drop(s);
        }
        RootServer::spawn(listener, id.secret, t).unwrap()
    });
    let (b, all) = Bootstrap::connect(&id, 0, 1, b"again", t).unwrap();
    assert_eq!(all, vec![b"again".to_vec()]);
    drop(b);
    door.join().unwrap().join().unwrap();

    // A peer that always closes at once: the rank gives up at its deadline
    // and says how often it was turned away.
    let listener = TcpListener::bind(LOCAL4).unwrap();
    let id = UniqueId::generate(listener.local_addr().unwrap()).unwrap();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            drop(s);
        }
    });
    let start = Instant::now();
    let e = err_text(Bootstrap::connect(
        &id,
        1,
        2,
        b"",
        Duration::from_millis(800),
    ));
    assert!(
        e.contains("closed") && e.contains("times before accepting"),
        "{e}"
    );
    assert!(e.contains(&id.addr.to_string()), "{e}");
    assert!(start.elapsed() < Duration::from_millis(1500));
}

/// Item 4: an id with port 0 is not a root address; it fails at once.
#[test]
fn port_zero_fails_at_once() {
    let id = UniqueId::generate(LOCAL4).unwrap();
    let start = Instant::now();
    let e = Bootstrap::connect(&id, 1, 2, b"", Duration::from_secs(30)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("port 0") && e.contains("not a root address"),
        "{e}"
    );
    assert!(e.contains("rank 1"), "{e}");
    assert!(start.elapsed() < Duration::from_millis(100));
}

/// Item 3: when the rendezvous fails, every rank gets the root's reason,
/// including when the owner drops the root as soon as its own rank failed.
#[test]
fn every_rank_hears_why_even_when_the_owner_drops_the_root() {
    for _ in 0..3 {
        let t = Duration::from_secs(5);
        let (id, server) = root(t);
        let others: Vec<_> = (1..4).map(|r| spawn_rank(id, r, 5, vec![], t)).collect();
        let odd = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            Bootstrap::connect(&id, 4, 6, b"", t)
        });
        let e = err_text(Bootstrap::connect(&id, 0, 5, b"", t));
        drop(server);
        // Who said which count first depends on who came first.
        let said =
            |e: &str| e.contains("says nranks=") && e.contains("reported by the bootstrap root");
        assert!(said(&e), "{e}");
        for h in others.into_iter().chain([odd]) {
            let e = err_text(h.join().unwrap());
            assert!(said(&e), "{e}");
        }
    }
}

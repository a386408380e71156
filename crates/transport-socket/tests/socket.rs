//! Socket-specific checks beyond the conformance suite: striping and
//! reassembly across many message sizes, abort reasons, drop with a stuck
//! peer, configuration.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use braid_conformance::{connect_pair, desc};
use braid_core::error::CoreError;
use braid_core::transport::{Incoming, RecvChannel, Transport};
use braid_transport_socket::{SocketConfig, SocketTransport};

fn loopback(slot_bytes: usize, slots: usize, nsocks: usize) -> SocketTransport {
    SocketTransport::new(
        SocketConfig::default()
            .with_addr("127.0.0.1".parse().unwrap())
            .with_geometry(slot_bytes, slots)
            .with_nsocks(nsocks),
    )
    .unwrap()
}

fn byte(seq: u64, i: usize) -> u8 {
    (seq as u8).wrapping_mul(151) ^ (i as u8) ^ ((i >> 9) as u8).wrapping_mul(7) ^ (i >> 17) as u8
}

fn wait<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

/// Messages from 0 B to a full 4 MiB slot, striped over 4 sockets, arrive
/// intact and in order while sender and receiver run concurrently.
#[test]
fn striping_reassembles_every_size() {
    const SB: usize = 4 << 20;
    let (t0, t1) = (loopback(SB, 4, 4), loopback(SB, 4, 4));
    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    let sizes = [
        0usize,
        1,
        63,
        4095,
        65_535,
        65_536,
        65_537,
        100_000,
        3 * 65_536 + 1,
        262_144,
        262_145,
        1 << 20,
        3 * (1 << 20) + 7,
        SB - 1,
        SB,
        17,
    ];
    let rounds = 5u64;
    let n = sizes.len() as u64 * rounds;
    let len_of = move |seq: u64| sizes[(seq as usize * 7) % sizes.len()];
    let sender = std::thread::spawn(move || {
        for seq in 0..n {
            let buf = wait("a credit", || tx.poll_acquire().unwrap());
            let len = len_of(seq);
            // SAFETY: a host slot of `cap >= len` bytes owned by us until commit.
            let s = unsafe { std::slice::from_raw_parts_mut(buf.ptr, len) };
            for (i, b) in s.iter_mut().enumerate() {
                *b = byte(seq, i);
            }
            tx.commit(len).unwrap();
        }
        wait("drain", || tx.poll_drained().unwrap().then_some(()));
        tx
    });
    for seq in 0..n {
        let (buf, len) = wait("a message", || rx.poll_peek().unwrap());
        assert_eq!(len, len_of(seq), "message {seq}: wrong length (reordered?)");
        // SAFETY: the slot holds `len` readable bytes until release.
        let s = unsafe { std::slice::from_raw_parts(buf.ptr, len) };
        if let Some(i) = s.iter().enumerate().position(|(i, b)| *b != byte(seq, i)) {
            panic!("message {seq} ({len} bytes) corrupted at byte {i}");
        }
        rx.release().unwrap();
    }
    let _tx = sender.join().unwrap();
    assert!(rx.poll_peek().unwrap().is_none());
}

/// The peer sees the reason given to abort, both ways.
#[test]
fn abort_reason_reaches_the_peer() {
    let (t0, t1) = (loopback(65536, 4, 2), loopback(65536, 4, 2));
    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    tx.abort("rank 0 ran out of patience");
    let e = wait("the abort", || rx.check_peer().err());
    match &e {
        CoreError::PeerAborted { peer, reason, .. } => {
            assert_eq!(*peer, 0);
            assert!(reason.contains("out of patience"), "{e}");
        }
        other => panic!("expected PeerAborted, got {other:?}"),
    }
    assert!(matches!(tx.poll_acquire(), Err(CoreError::Aborted(_))));

    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    rx.abort("bad data");
    let e = wait("the abort", || tx.check_peer().err());
    assert!(
        matches!(&e, CoreError::PeerAborted { peer: 1, reason, .. } if reason.contains("bad data")),
        "{e:?}"
    );
    assert!(tx.poll_acquire().is_err());
}

/// Dropping either end returns quickly even while the other end holds
/// unreleased data and the sender has more queued than the receiver took.
#[test]
fn drop_does_not_hang_with_a_stuck_peer() {
    let (t0, t1) = (loopback(1 << 20, 2, 2), loopback(1 << 20, 2, 2));
    let (mut tx, rx) = connect_pair(&t0, &t1, 0, 1);
    for _ in 0..2 {
        let _ = wait("a credit", || tx.poll_acquire().unwrap());
        tx.commit(1 << 20).unwrap();
    }
    let start = Instant::now();
    drop(rx);
    drop(tx);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "drop took {:?}",
        start.elapsed()
    );

    // Receiver alive and not reading, sender dropped.
    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    for _ in 0..2 {
        let _ = wait("a credit", || tx.poll_acquire().unwrap());
        tx.commit(1 << 20).unwrap();
    }
    let start = Instant::now();
    drop(tx);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "drop took {:?}",
        start.elapsed()
    );
    // What was committed before the close is still delivered, then the
    // close is reported.
    for _ in 0..2 {
        let (_, len) = wait("a message sent before the close", || {
            rx.poll_peek().unwrap()
        });
        assert_eq!(len, 1 << 20);
        rx.release().unwrap();
    }
    let e = wait("the close", || rx.poll_peek().err());
    assert!(matches!(e, CoreError::PeerAborted { .. }), "{e:?}");
}

/// Interface choice from the configuration.
#[test]
fn interface_choice() {
    let root: SocketAddr = "127.0.0.1:29500".parse().unwrap();
    let t = SocketTransport::new(SocketConfig::default().with_root(root)).unwrap();
    assert!(t.local_addr().ip().is_loopback(), "{:?}", t.local_addr());
    let t = SocketTransport::new(SocketConfig::default().with_ifname("=lo")).unwrap();
    assert!(t.local_addr().ip().is_loopback());
    assert_eq!(t.interface(), "lo");
    match SocketTransport::new(SocketConfig::default().with_ifname("=no-such-if0")) {
        Err(CoreError::Unavailable { reason, .. }) => {
            assert!(reason.contains("BRAID_SOCKET_IFNAME"), "{reason}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // The chosen interface works end to end.
    let t0 = SocketTransport::new(SocketConfig::default().with_root(root)).unwrap();
    let t1 = SocketTransport::new(SocketConfig::default().with_root(root)).unwrap();
    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    let _ = wait("a credit", || tx.poll_acquire().unwrap());
    tx.commit(5).unwrap();
    assert_eq!(wait("the message", || rx.poll_peek().unwrap()).1, 5);
    rx.release().unwrap();
}

/// `BRAID_SOCKET_*` variables (the only test in this binary that sets them).
#[test]
fn config_from_env() {
    let vars = [
        ("BRAID_SOCKET_NSOCKS", "3"),
        ("BRAID_SOCKET_SLOT_BYTES", "131072"),
        ("BRAID_SOCKET_SLOTS", "5"),
        ("BRAID_SOCKET_IFNAME", "^docker"),
        ("BRAID_SOCKET_FAMILY", "AF_INET"),
    ];
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let c = SocketConfig::from_env(&braid_core::config::process_env);
    std::env::set_var("BRAID_SOCKET_SLOTS", "many");
    let bad = SocketConfig::from_env(&braid_core::config::process_env);
    std::env::set_var("BRAID_SOCKET_SLOTS", "5");
    std::env::set_var("BRAID_SOCKET_SLOT_BYTES", "100");
    let bad_geometry = SocketConfig::from_env(&braid_core::config::process_env);
    for (k, _) in vars {
        std::env::remove_var(k);
    }
    let c = c.unwrap();
    assert_eq!((c.nsocks(), c.slot_bytes(), c.slots()), (3, 131072, 5));
    assert_eq!(
        c,
        SocketConfig::default()
            .with_nsocks(3)
            .with_geometry(131072, 5)
            .with_ifname("^docker")
            .with_family(braid_transport_socket::Family::V4)
    );
    assert!(matches!(bad, Err(e) if e.to_string().contains("BRAID_SOCKET_SLOTS")));
    assert!(matches!(bad_geometry, Err(e) if e.var == "BRAID_SOCKET_SLOT_BYTES"));
    let d = SocketConfig::default();
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(
        (d.nsocks(), d.slot_bytes(), d.slots(), d.direct()),
        ((cores / 4).clamp(1, 4), 512 * 1024, 8, true)
    );
    std::env::set_var("BRAID_SOCKET_DIRECT", "0");
    let off = SocketConfig::from_env(&braid_core::config::process_env);
    std::env::set_var("BRAID_SOCKET_DIRECT", "maybe");
    let bad_direct = SocketConfig::from_env(&braid_core::config::process_env);
    std::env::remove_var("BRAID_SOCKET_DIRECT");
    assert!(!off.unwrap().direct());
    assert!(matches!(bad_direct, Err(e) if e.to_string().contains("BRAID_SOCKET_DIRECT")));
}

/// Blobs meant for another pair of ranks are refused.
#[test]
fn blobs_for_other_ranks_are_refused() {
    let (t0, t1) = (loopback(65536, 2, 1), loopback(65536, 2, 1));
    let (_prx, rinfo) = t1.listen(&desc(1), &desc(0)).unwrap();
    let (ptx, _) = t0.prepare_send(&desc(2), &desc(1)).unwrap();
    let e = ptx
        .connect(&rinfo, Instant::now() + Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(matches!(e, CoreError::Protocol { .. }), "{e:?}");
    let (prx, _) = t1.listen(&desc(1), &desc(0)).unwrap();
    let (_, sinfo) = t0.prepare_send(&desc(0), &desc(3)).unwrap();
    let e = prx
        .connect(&sinfo, Instant::now() + Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(matches!(e, CoreError::Protocol { .. }), "{e:?}");
}

/// Reads the head direct message into `out`, polling as the engine does.
fn read_direct(rx: &mut dyn RecvChannel, out: &mut [u8]) -> Result<(), CoreError> {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        // SAFETY: `out` is valid for `out.len()` writes and not touched
        // otherwise until this returns.
        if unsafe {
            rx.direct()
                .unwrap()
                .poll_read_remote(out.as_mut_ptr(), out.len())
        }? {
            return Ok(());
        }
        assert!(Instant::now() < end, "timed out reading a direct message");
        std::thread::yield_now();
    }
}

/// Direct (zero-copy) messages from 0 B to several slots, mixed with slot
/// messages, striped over 1, 3 and 4 sockets, arrive intact and in order:
/// direct ones as `Incoming::Remote`, read with `poll_read_remote`.
#[test]
fn direct_and_slot_messages_interleave() {
    const SB: usize = 64 * 1024;
    for nsocks in [1usize, 3, 4] {
        let (t0, t1) = (loopback(SB, 4, nsocks), loopback(SB, 4, nsocks));
        let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
        assert!(tx.direct().is_some());
        assert!(!tx.direct().unwrap().costs_receiver());
        let sizes = [
            1usize,
            SB,
            SB + 1,
            3 * SB + 7,
            0,
            (3 << 20) + 5,
            65_537,
            4095,
            1 << 20,
        ];
        let n = 3 * sizes.len() as u64;
        let len_of = move |seq: u64| sizes[seq as usize % sizes.len()];
        // Every third message goes through a slot (those must fit one).
        let is_direct = move |seq: u64| seq % 3 != 1 || len_of(seq) > SB;
        let sender = std::thread::spawn(move || {
            // The direct buffers live until the receiver released them all.
            let mut keep: Vec<Vec<u8>> = Vec::new();
            for seq in 0..n {
                let buf = wait("a credit", || tx.poll_acquire().unwrap());
                let len = len_of(seq);
                if is_direct(seq) {
                    let v: Vec<u8> = (0..len).map(|i| byte(seq, i)).collect();
                    // SAFETY: `v` stays alive and unchanged in `keep` until
                    // poll_drained below.
                    unsafe { tx.direct().unwrap().commit_direct(v.as_ptr(), len) }.unwrap();
                    keep.push(v);
                } else {
                    // SAFETY: a host slot of `cap >= len` bytes, ours until commit.
                    let s = unsafe { std::slice::from_raw_parts_mut(buf.ptr, len) };
                    for (i, b) in s.iter_mut().enumerate() {
                        *b = byte(seq, i);
                    }
                    tx.commit(len).unwrap();
                }
            }
            wait("drain", || tx.poll_drained().unwrap().then_some(()));
            drop(keep);
            tx
        });
        for seq in 0..n {
            let inc = wait("a message", || rx.poll_peek_any().unwrap());
            let len = len_of(seq);
            let got = match inc {
                Incoming::Remote(l) => {
                    assert!(is_direct(seq), "message {seq}: slot message came as Remote");
                    assert_eq!(l, len, "message {seq}: wrong length");
                    // Releasing before reading is refused (the payload is
                    // still in the sockets).
                    assert!(rx.release().is_err());
                    let mut out = vec![0xAAu8; len];
                    read_direct(&mut *rx, &mut out).unwrap();
                    // SAFETY: as in read_direct; done already.
                    assert!(unsafe {
                        rx.direct().unwrap().poll_read_remote(out.as_mut_ptr(), len)
                    }
                    .unwrap());
                    let mut other = vec![0u8; len];
                    if len > 0 {
                        // SAFETY: as above.
                        let r = unsafe {
                            rx.direct()
                                .unwrap()
                                .poll_read_remote(other.as_mut_ptr(), len)
                        };
                        assert!(r.is_err(), "another destination mid-read is refused");
                    }
                    out
                }
                Incoming::Inline(buf, l) => {
                    assert!(!is_direct(seq), "message {seq}: direct message came inline");
                    assert_eq!(l, len, "message {seq}: wrong length");
                    // SAFETY: the slot holds `l` readable bytes until release.
                    unsafe { std::slice::from_raw_parts(buf.ptr, l) }.to_vec()
                }
            };
            if let Some(i) = got.iter().enumerate().position(|(i, b)| *b != byte(seq, i)) {
                panic!("{nsocks} sockets: message {seq} ({len} bytes) corrupted at byte {i}");
            }
            rx.release().unwrap();
        }
        let _tx = sender.join().unwrap();
        assert!(rx.poll_peek_any().unwrap().is_none());
    }
}

/// `BRAID_SOCKET_DIRECT=0` (here: the config) switches direct sends off;
/// `commit_direct` is then an error and the link keeps working.
#[test]
fn direct_can_be_switched_off() {
    let cfg = SocketConfig::default()
        .with_addr("127.0.0.1".parse().unwrap())
        .with_geometry(65536, 4)
        .with_nsocks(2)
        .with_direct(false);
    let (t0, t1) = (
        SocketTransport::new(cfg.clone()).unwrap(),
        SocketTransport::new(cfg).unwrap(),
    );
    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    assert!(tx.direct().is_none(), "single copy switched off");
    let _ = wait("a credit", || tx.poll_acquire().unwrap());
    tx.commit(3).unwrap();
    let inc = wait("a message", || rx.poll_peek_any().unwrap());
    assert!(matches!(inc, Incoming::Inline(_, 3)), "{inc:?}");
}

/// A sender that aborts while its writers are blocked on full sockets
/// writing the caller's memory (the receiver has not read yet): the abort
/// returns promptly, after which the buffer may go; the receiver reading
/// the message gets the sender's reason, not "connection lost".
#[test]
fn sender_abort_during_a_direct_transfer() {
    for nsocks in [1usize, 3] {
        let (t0, t1) = (loopback(65536, 4, nsocks), loopback(65536, 4, nsocks));
        let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
        let len = 256 << 20;
        let v = vec![7u8; len];
        let _ = wait("a credit", || tx.poll_acquire().unwrap());
        // SAFETY: `v` outlives every use: `abort` below waits for the
        // writers to leave it before returning.
        unsafe { tx.direct().unwrap().commit_direct(v.as_ptr(), len) }.unwrap();
        let inc = wait("the direct message", || rx.poll_peek_any().unwrap());
        assert!(matches!(inc, Incoming::Remote(l) if l == len), "{inc:?}");
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        tx.abort("the sender lost its GPU");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "abort took {:?}",
            start.elapsed()
        );
        drop(v);
        let mut out = vec![0u8; len];
        let e = read_direct(&mut *rx, &mut out).unwrap_err();
        assert!(
            matches!(&e, CoreError::PeerAborted { peer: 0, reason, .. } if reason.contains("lost its GPU")),
            "{nsocks} sockets: {e:?}"
        );
        drop(tx);
    }
}

/// A receiver that aborts in the middle of a direct message: the sender
/// sees its reason, never reports the message drained, and its own abort
/// and drop return promptly.
#[test]
fn receiver_abort_during_a_direct_transfer() {
    let (t0, t1) = (loopback(65536, 4, 2), loopback(65536, 4, 2));
    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    let len = 128 << 20;
    let v = vec![9u8; len];
    let _ = wait("a credit", || tx.poll_acquire().unwrap());
    // SAFETY: `v` outlives every use: `abort` below waits for the writers.
    unsafe { tx.direct().unwrap().commit_direct(v.as_ptr(), len) }.unwrap();
    let _ = wait("the direct message", || rx.poll_peek_any().unwrap());
    let mut out = vec![0u8; len];
    // SAFETY: `out` is valid for `len` writes.
    let _ = unsafe { rx.direct().unwrap().poll_read_remote(out.as_mut_ptr(), len) }.unwrap();
    rx.abort("the receiver saw a bad checksum");
    let e = wait("the abort", || match tx.poll_drained() {
        Ok(true) => panic!("drained although the receiver never read it all"),
        Ok(false) => None,
        Err(e) => Some(e),
    });
    assert!(
        matches!(&e, CoreError::PeerAborted { peer: 1, reason, .. } if reason.contains("bad checksum")),
        "{e:?}"
    );
    let start = Instant::now();
    tx.abort("giving up too");
    drop(tx);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    drop(v);
}

/// Sends messages `seq` in `from..to` (slot messages, with every fourth a
/// direct one of several slots), as far as credits allow; returns the next.
fn send_mixed(
    tx: &mut dyn braid_core::transport::SendChannel,
    from: u64,
    to: u64,
    keep: &mut Vec<Vec<u8>>,
) -> u64 {
    let mut seq = from;
    while seq < to {
        let Some(buf) = tx.poll_acquire().unwrap() else {
            break;
        };
        if seq % 4 == 3 {
            let v: Vec<u8> = (0..3 * buf.cap + 5).map(|i| byte(seq, i)).collect();
            // SAFETY: `v` is kept in `keep` until the link drained.
            unsafe { tx.direct().unwrap().commit_direct(v.as_ptr(), v.len()) }.unwrap();
            keep.push(v);
        } else {
            let len = [5, buf.cap / 2 + 1, buf.cap][seq as usize % 3];
            // SAFETY: a host slot of `cap >= len` bytes owned by us until commit.
            let s = unsafe { std::slice::from_raw_parts_mut(buf.ptr, len) };
            for (i, b) in s.iter_mut().enumerate() {
                *b = byte(seq, i);
            }
            tx.commit(len).unwrap();
        }
        seq += 1;
    }
    seq
}

/// After a resume: messages `base..base + 20` arrive intact and in order,
/// and nothing of the old link arrives.
fn resumed_carries(
    tx: &mut dyn braid_core::transport::SendChannel,
    rx: &mut dyn RecvChannel,
    base: u64,
) {
    let mut keep = Vec::new();
    let (mut next, mut got) = (base, base);
    let end = Instant::now() + Duration::from_secs(20);
    while got < base + 20 {
        assert!(Instant::now() < end, "the resumed link is stuck at {got}");
        next = send_mixed(tx, next, base + 20, &mut keep);
        match rx.poll_peek_any().unwrap() {
            None => std::thread::yield_now(),
            Some(Incoming::Inline(slot, len)) => {
                // SAFETY: the peeked slot holds `len` bytes until release.
                let s = unsafe { std::slice::from_raw_parts(slot.ptr, len) };
                let want = [5, slot.cap / 2 + 1, slot.cap][got as usize % 3];
                assert_eq!(len, want, "message {got}: length");
                assert!(
                    s.iter().enumerate().all(|(i, &b)| b == byte(got, i)),
                    "message {got}: bytes"
                );
                rx.release().unwrap();
                got += 1;
            }
            Some(Incoming::Remote(len)) => {
                assert_eq!(got % 4, 3, "message {got} came direct");
                let mut out = vec![0u8; len];
                read_direct(rx, &mut out).unwrap();
                assert!(
                    out.iter().enumerate().all(|(i, &b)| b == byte(got, i)),
                    "direct message {got}: bytes"
                );
                rx.release().unwrap();
                got += 1;
            }
        }
    }
    wait("drain", || tx.poll_drained().unwrap().then_some(()));
}

/// A link aborted in the middle of frames (a large direct message half
/// written, half read; slot messages unread) goes on after a resume: both
/// ends give resync points that fit, the receiver drops the old link's
/// bytes up to the sender's cut, and new messages arrive intact — whether
/// both ends aborted, only the sender (the receiver saw its abort), or only
/// the receiver.
#[test]
fn a_link_resumes_after_an_abort_in_the_middle_of_frames() {
    for nsocks in [1usize, 3] {
        for who in ["both", "sender", "receiver"] {
            let (t0, t1) = (loopback(65536, 4, nsocks), loopback(65536, 4, nsocks));
            let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
            // Two slot messages; the receiver takes the first.
            let mut keep = Vec::new();
            assert_eq!(send_mixed(&mut *tx, 0, 2, &mut keep), 2);
            let _ = wait("message 0", || rx.poll_peek().unwrap());
            rx.release().unwrap();
            let _ = wait("message 1", || rx.poll_peek().unwrap());
            rx.release().unwrap();
            // A direct message far larger than the socket buffers.
            let big = vec![3u8; 256 << 20];
            let _ = wait("a credit", || tx.poll_acquire().unwrap());
            // SAFETY: `big` outlives the sender's writes: the sender aborts
            // (which stops them) or resumes (which drops them) before it goes.
            unsafe { tx.direct().unwrap().commit_direct(big.as_ptr(), big.len()) }.unwrap();
            let inc = wait("the direct message", || rx.poll_peek_any().unwrap());
            assert!(
                matches!(inc, Incoming::Remote(l) if l == big.len()),
                "{inc:?}"
            );
            let mut out = vec![0u8; big.len()];
            // Read a part of it (a few socket buffers' worth).
            for _ in 0..4 {
                std::thread::sleep(Duration::from_millis(1));
                // SAFETY: `out` is valid for its length and not touched
                // otherwise until the receiver resumed.
                let done = unsafe {
                    rx.direct()
                        .unwrap()
                        .poll_read_remote(out.as_mut_ptr(), out.len())
                }
                .unwrap();
                if done {
                    // All of it came (one call reads while bytes come): the
                    // message is read and not released, another old state.
                    break;
                }
            }
            match who {
                "both" => {
                    tx.abort("the operation failed here");
                    rx.abort("the operation failed there");
                }
                "sender" => {
                    tx.abort("the sender gave up");
                    let _ = wait("the sender's abort", || rx.check_peer().err());
                }
                _ => {
                    rx.abort("the receiver gave up");
                    let _ = wait("the receiver's abort", || tx.check_peer().err());
                }
            }
            let (s, r) = (tx.resume_point(), rx.resume_point());
            let (Some(s), Some(r)) = (s, r) else {
                panic!("{who} aborted, {nsocks} sockets: no resume point: {s:?} {r:?}");
            };
            assert!(s.resync && r.resync, "{who}: {s:?} {r:?}");
            assert!(
                braid_core::transport::Resume::fits(s, r),
                "{who}: {s:?} {r:?}"
            );
            assert_eq!((s.count, r.count), (3, 2), "{who}");
            tx.resume(7, s.count).unwrap();
            rx.resume(6, s.count).unwrap();
            drop(big);
            tx.check_peer().unwrap();
            rx.check_peer().unwrap();
            assert_eq!((tx.peer(), rx.peer()), (7, 6));
            resumed_carries(&mut *tx, &mut *rx, 3);
            // And once more: an abort of the resumed link resumes again.
            tx.abort("again");
            rx.abort("again");
            let (Some(s), Some(r)) = (tx.resume_point(), rx.resume_point()) else {
                panic!("{who}: no resume point the second time");
            };
            assert!(
                braid_core::transport::Resume::fits(s, r),
                "{who}: {s:?} {r:?}"
            );
            tx.resume(7, s.count).unwrap();
            rx.resume(6, s.count).unwrap();
            resumed_carries(&mut *tx, &mut *rx, s.count);
            drop(keep);
        }
    }
}

/// A resume needs the sender's resync: a receiver whose sender never
/// resumes (dropped its end) gets an error naming the peer, not a hang.
#[test]
fn a_resume_without_the_senders_resync_fails() {
    let (t0, t1) = (loopback(65536, 4, 2), loopback(65536, 4, 2));
    let (mut tx, mut rx) = connect_pair(&t0, &t1, 0, 1);
    tx.abort("gone");
    rx.abort("gone too");
    let r = rx.resume_point().expect("a resume point after an abort");
    assert!(r.resync);
    drop(tx);
    let start = Instant::now();
    let e = rx.resume(0, 0).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(11),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(
            e,
            CoreError::PeerAborted { peer: 0, .. } | CoreError::Peer { peer: 0, .. }
        ),
        "{e:?}"
    );
}

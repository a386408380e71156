//! shm-specific tests: segment lifetime in /dev/shm, environment parameters,
//! and a real second process that is killed with SIGKILL.
//!
//! Tests that count this process's segments hold `LOCK`, because the test
//! harness runs tests on parallel threads of one process.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use braid_conformance::{connect_pair, desc, wait_for};
use braid_core::error::CoreError;
use braid_core::transport::{SlotBuf, Transport};
use braid_transport_shm::{leftover_segments, ShmConfig, ShmTransport};

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Segments in /dev/shm created by process `pid`.
fn segments_of(pid: u32) -> Vec<String> {
    let prefix = format!("braid-{pid}-");
    leftover_segments()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

fn mine() -> Vec<String> {
    segments_of(std::process::id())
}

fn small() -> ShmTransport {
    ShmTransport::with_params(16 * 1024, 4).unwrap()
}

fn write(buf: SlotBuf, data: &[u8]) {
    assert!(data.len() <= buf.cap);
    // SAFETY: shm slots are host memory; `buf` was just returned by
    // poll_acquire, so `buf.cap` bytes are ours to write until commit.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr, data.len()) }
}

fn read(buf: SlotBuf, len: usize) -> Vec<u8> {
    assert!(len <= buf.cap);
    let mut v = vec![0; len];
    // SAFETY: shm slots are host memory; `buf` was just returned by
    // poll_peek with `len` valid bytes, stable until release.
    unsafe { std::ptr::copy_nonoverlapping(buf.ptr, v.as_mut_ptr(), len) }
    v
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn segment_unlinked_once_both_mapped_and_after_drop() {
    let _g = lock();
    assert!(mine().is_empty(), "stale segments: {:?}", mine());
    let (t0, t1) = (small(), small());
    let (prx, rinfo) = t1.listen(&desc(1), &desc(0)).unwrap();
    let (ptx, sinfo) = t0.prepare_send(&desc(0), &desc(1)).unwrap();
    let names = mine();
    assert_eq!(names.len(), 1, "listen must create one segment: {names:?}");
    assert!(
        names[0].ends_with("-0-1"),
        "name must end with -<from>-<to>: {}",
        names[0]
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut tx = ptx.connect(&rinfo, deadline).unwrap();
    let mut rx = prx.connect(&sinfo, deadline).unwrap();
    assert!(
        mine().is_empty(),
        "segment still linked after connect: {:?}",
        mine()
    );

    // The unlinked mapping still carries data.
    let buf = tx.poll_acquire().unwrap().unwrap();
    write(buf, b"after unlink");
    tx.commit(12).unwrap();
    let (buf, len) = rx.poll_peek().unwrap().unwrap();
    assert_eq!(read(buf, len), b"after unlink");
    rx.release().unwrap();
    drop(tx);
    drop(rx);
    assert!(mine().is_empty(), "segment left after drop: {:?}", mine());
}

#[test]
fn pending_receiver_unlinks_on_drop_and_on_failure() {
    let _g = lock();
    let t = small();
    let (prx, _) = t.listen(&desc(1), &desc(0)).unwrap();
    assert_eq!(mine().len(), 1);
    drop(prx);
    assert!(
        mine().is_empty(),
        "dropped pending receiver leaked {:?}",
        mine()
    );

    // Failed connect: garbage sender info.
    let (prx, _) = t.listen(&desc(1), &desc(0)).unwrap();
    let err = prx
        .connect(b"garbage", Instant::now() + Duration::from_secs(1))
        .err()
        .expect("garbage accepted");
    assert!(
        matches!(err, CoreError::Protocol { peer: 0, .. }),
        "{err:?}"
    );
    assert!(mine().is_empty(), "failed connect leaked {:?}", mine());

    // Failed connect: timeout; the message names the peer.
    let (prx, _) = t.listen(&desc(1), &desc(0)).unwrap();
    let (_ptx, sinfo) = t.prepare_send(&desc(0), &desc(1)).unwrap();
    let err = prx
        .connect(&sinfo, Instant::now() + Duration::from_millis(100))
        .err()
        .expect("connected without a sender");
    assert!(matches!(err, CoreError::Timeout { peer: 0, .. }), "{err:?}");
    assert!(err.to_string().contains("rank 0"), "{err}");
    assert!(mine().is_empty(), "timed-out connect leaked {:?}", mine());
}

#[test]
fn second_sender_cannot_attach() {
    let _g = lock();
    let t = small();
    let (prx, rinfo) = t.listen(&desc(1), &desc(0)).unwrap();
    let (ptx, sinfo) = t.prepare_send(&desc(0), &desc(1)).unwrap();
    let (ptx2, _) = t.prepare_send(&desc(0), &desc(1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let _tx = ptx.connect(&rinfo, deadline).unwrap();
    assert!(ptx2.connect(&rinfo, deadline).is_err());
    let _rx = prx.connect(&sinfo, deadline).unwrap();
    assert!(mine().is_empty());
}

#[test]
fn blob_for_another_pair_is_rejected() {
    let _g = lock();
    let t = small();
    // Receiver 1 listening for rank 0; a sender of rank 2 must not use it.
    let (_prx, rinfo) = t.listen(&desc(1), &desc(0)).unwrap();
    let (ptx, _) = t.prepare_send(&desc(2), &desc(1)).unwrap();
    let err = ptx
        .connect(&rinfo, Instant::now() + Duration::from_secs(1))
        .err()
        .expect("wrong pair accepted");
    assert!(matches!(err, CoreError::Protocol { .. }), "{err:?}");
}

#[test]
fn env_parameters() {
    let _g = lock();
    std::env::set_var("BRAID_SHM_SLOT_BYTES", "8192");
    std::env::set_var("BRAID_SHM_SLOTS", "3");
    let t = ShmTransport::from_env().unwrap();
    assert_eq!((t.slot_bytes(), t.slots()), (8192, 3));
    let (tx, _rx) = connect_pair(&t, &t, 0, 1);
    assert_eq!((tx.slot_bytes(), tx.slots()), (8192, 3));
    std::env::set_var("BRAID_SHM_SLOT_BYTES", "4100");
    assert!(ShmTransport::from_env().is_err());
    // A bad value is reported, naming the variable (it used to be logged
    // and replaced by the default).
    let e = ShmConfig::from_env(&braid_core::config::process_env).unwrap_err();
    assert_eq!(e.var, "BRAID_SHM_SLOT_BYTES", "{e}");
    std::env::set_var("BRAID_SHM_SLOT_BYTES", "lots");
    assert!(ShmTransport::from_env().is_err());
    std::env::remove_var("BRAID_SHM_SLOT_BYTES");
    std::env::set_var("BRAID_SHM_SLOTS", "1");
    assert!(ShmTransport::from_env().is_err());
    std::env::remove_var("BRAID_SHM_SLOTS");
    let t = ShmTransport::from_env().unwrap();
    let d = ShmTransport::default();
    assert_eq!((t.slot_bytes(), t.slots()), (d.slot_bytes(), d.slots()));
    assert_eq!(
        ShmTransport::new(ShmConfig::default()).unwrap(),
        ShmTransport::default()
    );
}

const CHILD_ENV: &str = "BRAID_SHM_TEST_RECEIVER_INFO";

/// Not a test of its own: the sending process of
/// `killed_sender_is_reported_gone`, run by re-executing this binary.
#[test]
fn child_sender() {
    let Ok(info) = std::env::var(CHILD_ENV) else {
        return; // ordinary test run: nothing to do
    };
    let rinfo = unhex(info.trim());
    let t = ShmTransport::from_env().unwrap();
    let (ptx, sinfo) = t.prepare_send(&desc(0), &desc(1)).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nSENDER_INFO {}", hex(&sinfo)).unwrap();
    out.flush().unwrap();
    let mut tx = ptx
        .connect(&rinfo, Instant::now() + Duration::from_secs(10))
        .unwrap();
    let msg = format!("hello from {}", std::process::id());
    let buf = tx.poll_acquire().unwrap().unwrap();
    write(buf, msg.as_bytes());
    tx.commit(msg.len()).unwrap();
    // A second message, still unread when the parent kills us.
    let last = format!("last from {}", std::process::id());
    let buf = tx.poll_acquire().unwrap().unwrap();
    write(buf, last.as_bytes());
    tx.commit(last.len()).unwrap();
    writeln!(out, "SENT").unwrap();
    out.flush().unwrap();
    // Wait to be killed (bounded, in case the parent died).
    std::thread::sleep(Duration::from_secs(60));
}

/// Kills the child if the test fails half-way.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn killed_sender_is_reported_gone() {
    let _g = lock();
    let t = small();
    let (prx, rinfo) = t.listen(&desc(1), &desc(0)).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_sender", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, hex(&rinfo))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let child_pid = child.0.id();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let sinfo = loop {
        let line = lines
            .next()
            .expect("child exited before printing its connect-info")
            .unwrap();
        // libtest may print "test child_sender ... " before it on the line.
        if let Some(i) = line.find("SENDER_INFO ") {
            let h = line[i + "SENDER_INFO ".len()..].split_whitespace().next();
            break unhex(h.expect("hex after SENDER_INFO"));
        }
    };
    let mut rx = prx
        .connect(&sinfo, Instant::now() + Duration::from_secs(10))
        .expect("receiver connect with the child sender");
    assert!(mine().is_empty(), "segment still linked: {:?}", mine());
    let (buf, len) = wait_for("the child's message", Duration::from_secs(10), || {
        rx.poll_peek().unwrap()
    });
    assert_eq!(read(buf, len), format!("hello from {child_pid}").as_bytes());
    rx.release().unwrap();
    rx.check_peer().expect("child is alive");
    loop {
        let l = lines.next().expect("child exited before SENT").unwrap();
        if l.contains("SENT") {
            break;
        }
    }

    // SIGKILL: the child cannot set any flag. Not reaped yet: a zombie.
    child.0.kill().unwrap();
    // The message it published before it died is still delivered, and its
    // death is not an error while that message waits.
    std::thread::sleep(Duration::from_millis(100));
    rx.check_peer()
        .expect("a dead sender's published message is still there to read");
    let (buf, len) = rx.poll_peek().unwrap().expect("the last message");
    assert_eq!(read(buf, len), format!("last from {child_pid}").as_bytes());
    rx.release().unwrap();
    let start = Instant::now();
    let err = wait_for(
        "check_peer to report the killed child",
        Duration::from_secs(5),
        || rx.check_peer().err(),
    );
    let waited = start.elapsed();
    match &err {
        CoreError::Peer { peer: 0, what, .. } => {
            assert!(
                what.contains(&format!("process {child_pid} is gone")),
                "{err}"
            )
        }
        other => panic!("expected Peer(process gone), got {other:?}"),
    }
    assert!(waited < Duration::from_secs(5));
    // Reaped: kill(pid, 0) says ESRCH now.
    child.0.wait().unwrap();
    let err = rx.check_peer().expect_err("dead peer reported alive");
    assert!(err.to_string().contains("is gone"), "{err}");
    assert!(mine().is_empty(), "segment left: {:?}", mine());
    assert!(segments_of(child_pid).is_empty());
    drop(rx);
    assert!(mine().is_empty());
}

/// Single-copy transfers are on by default where this process may read its
/// peer's memory (same user; here the peer is this very process), and off
/// with `BRAID_SHM_DIRECT=0`: the conformance case then covers the refusal.
#[test]
fn direct_transfers_probe_succeeds_between_processes_of_one_user() {
    let _g = lock();
    let (t0, t1) = (small(), small());
    let (prx, rinfo) = t1.listen(&desc(1), &desc(0)).unwrap();
    let (ptx, sinfo) = t0.prepare_send(&desc(0), &desc(1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut tx = ptx.connect(&rinfo, deadline).unwrap();
    let _rx = prx.connect(&sinfo, deadline).unwrap();
    if !t1.config().direct() {
        assert!(tx.direct().is_none());
    } else {
        assert!(
            tx.direct().is_some(),
            "process_vm_readv probe failed on this machine"
        );
    }
}

/// Peeks the next slot, which must be a direct one of `len` bytes, and
/// reads it into `dst` with `poll_read_remote` (not released).
fn read_direct(rx: &mut dyn braid_core::transport::RecvChannel, dst: &mut [u8], len: usize) {
    use braid_core::transport::Incoming;
    assert!(dst.len() >= len);
    let got = wait_for("a direct slot", Duration::from_secs(10), || {
        rx.poll_peek_any().unwrap()
    });
    assert!(
        matches!(got, Incoming::Remote(l) if l == len),
        "got {got:?}"
    );
    wait_for("the read", Duration::from_secs(10), || {
        // SAFETY: `dst` holds at least `len` writable bytes (checked), which
        // we leave alone until this returns true.
        unsafe { rx.direct().unwrap().poll_read_remote(dst.as_mut_ptr(), len) }
            .unwrap()
            .then_some(())
    });
}

/// A direct transfer of many chunks is shared: while the receiver reads,
/// a sender thread calling `poll_help` writes chunks of its own into the
/// receiver's destination. The bytes arrive exactly, `poll_read_remote`
/// says done only when the sender's chunks are in, and the sender is
/// drained only after the release. With `BRAID_SHM_HELP=0` the sender
/// never gets a chunk. (Whether the sender thread wins a chunk depends on
/// scheduling, so up to 20 transfers run until one was shared.)
#[test]
fn direct_transfers_are_shared_with_the_sender() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let _g = lock();
    let t = ShmTransport::with_params(64 * 1024, 4).unwrap();
    let (mut tx, mut rx) = connect_pair(&t, &t, 0, 1);
    if tx.direct().is_none() {
        eprintln!("skipped: direct transfers are off (BRAID_SHM_DIRECT=0)");
        return;
    }
    let off = t.config().help_chunk().is_none();
    // Five small messages first, so that the direct transfers' boxes
    // (message number mod 256) and slots (mod 4) differ: the sender finds
    // the slot of the offered box.
    for i in 0..5u8 {
        let buf = wait_for("a box", Duration::from_secs(10), || {
            tx.poll_acquire_small(1).unwrap()
        });
        write(buf, &[i]);
        tx.commit(1).unwrap();
        let (buf, len) = wait_for("the small message", Duration::from_secs(10), || {
            rx.poll_peek().unwrap()
        });
        assert_eq!(read(buf, len), [i]);
        rx.release().unwrap();
    }
    // 64 chunks of 256 KiB and a short one.
    let len = (16 << 20) + 4097;
    let mut shared = 0;
    for round in 0..20u32 {
        let data: Vec<u8> = (0..len).map(|i| (i as u32 * 31 + round) as u8).collect();
        let mut out = vec![0u8; len];
        wait_for("a free slot", Duration::from_secs(10), || {
            tx.poll_acquire().unwrap()
        });
        // SAFETY: `data` stays alive and unchanged until the drain below.
        unsafe { tx.direct().unwrap().commit_direct(data.as_ptr(), len) }.unwrap();
        let stop = AtomicBool::new(false);
        let helped = AtomicUsize::new(0);
        std::thread::scope(|s| {
            let tx = &mut tx;
            let (stop, helped) = (&stop, &helped);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if tx.direct().unwrap().poll_help().unwrap() {
                        helped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            read_direct(&mut *rx, &mut out, len);
            stop.store(true, Ordering::Relaxed);
        });
        if let Some(i) = (0..len).find(|&i| out[i] != data[i]) {
            panic!(
                "round {round}: byte {i} of {len} is {} not {}",
                out[i], data[i]
            );
        }
        assert!(!tx.poll_drained().unwrap(), "drained before release");
        rx.release().unwrap();
        wait_for("drain", Duration::from_secs(10), || {
            tx.poll_drained().unwrap().then_some(())
        });
        shared += helped.load(Ordering::Relaxed);
        if off || shared > 0 {
            break;
        }
    }
    if off {
        assert_eq!(shared, 0, "the sender helped with BRAID_SHM_HELP=0");
    } else {
        assert!(shared > 0, "the sender never got a chunk in 20 transfers");
    }
}

/// A finished shared transfer leaves no offer behind: when its slot
/// carries the next, longer direct transfer, a `poll_help` before the
/// receiver offered that one does nothing (it used to take the old,
/// exhausted claim for an offer of the new length and write past the old
/// destination).
#[test]
fn finished_shared_transfer_leaves_no_offer() {
    use braid_core::transport::Incoming;
    let _g = lock();
    let t = ShmTransport::with_params(64 * 1024, 2).unwrap();
    let (mut tx, mut rx) = connect_pair(&t, &t, 0, 1);
    if tx.direct().is_none() {
        eprintln!("skipped: direct transfers are off (BRAID_SHM_DIRECT=0)");
        return;
    }
    let short = 1 << 20; // 4 chunks of 256 KiB
    let long = 16 << 20;
    let a: Vec<u8> = (0..short).map(|i| (i * 13 + 1) as u8).collect();
    let c: Vec<u8> = (0..long).map(|i| (i * 17 + 5) as u8).collect();
    // The short transfer's destination, followed by a guard band.
    let mut out = vec![0u8; long];
    let recv = |rx: &mut Box<dyn braid_core::transport::RecvChannel>, dst: &mut [u8], len| {
        read_direct(&mut **rx, dst, len);
        rx.release().unwrap();
    };
    // Slot 0: the short transfer, read (and offered) by the receiver alone.
    wait_for("slot", Duration::from_secs(10), || {
        tx.poll_acquire().unwrap()
    });
    // SAFETY: `a` outlives the drain below.
    unsafe { tx.direct().unwrap().commit_direct(a.as_ptr(), short) }.unwrap();
    recv(&mut rx, &mut out, short);
    assert!(out[..short] == a[..], "short transfer corrupted");
    // Slot 1: an inline message; slot 0 again: the long transfer.
    wait_for("slot", Duration::from_secs(10), || {
        tx.poll_acquire().unwrap()
    });
    tx.commit(1).unwrap();
    wait_for("slot", Duration::from_secs(10), || {
        tx.poll_acquire().unwrap()
    });
    // SAFETY: `c` outlives the drain below.
    unsafe { tx.direct().unwrap().commit_direct(c.as_ptr(), long) }.unwrap();
    for _ in 0..100 {
        assert!(
            !tx.direct().unwrap().poll_help().unwrap(),
            "helped a transfer nobody offered"
        );
    }
    assert!(
        out[short..].iter().all(|&b| b == 0),
        "the sender wrote past the finished transfer's destination"
    );
    let got = wait_for("inline", Duration::from_secs(10), || {
        rx.poll_peek_any().unwrap()
    });
    assert!(matches!(got, Incoming::Inline(_, 1)), "got {got:?}");
    rx.release().unwrap();
    let mut out2 = vec![0u8; long];
    recv(&mut rx, &mut out2, long);
    assert!(out2 == c, "long transfer corrupted");
    wait_for("drain", Duration::from_secs(10), || {
        tx.poll_drained().unwrap().then_some(())
    });
}

/// Messages of at most 48 bytes need a box, not a slot: on a link of 4
/// slots (256 boxes) a sender whose receiver does not run commits 256 small
/// messages, then no more; meanwhile an ordinary acquisition (or a small
/// one of 49 bytes) waits for a slot, which it gets once fewer than 4
/// messages are outstanding. Everything arrives in order.
#[test]
fn small_messages_run_ahead_of_the_slots() {
    let _g = lock();
    let t = small();
    let (mut tx, mut rx) = connect_pair(&t, &t, 0, 1);
    let mut n = 0u64;
    while let Some(buf) = tx.poll_acquire_small(8).unwrap() {
        assert_eq!(buf.cap, 48, "a small message's buffer is its box");
        write(buf, &n.to_le_bytes());
        tx.commit(8).unwrap();
        n += 1;
        assert!(n <= 256, "more than 256 small messages outstanding");
    }
    assert_eq!(n, 256, "small messages outstanding on a link of 4 slots");
    assert!(
        tx.poll_acquire().unwrap().is_none(),
        "a slot with 256 messages outstanding"
    );
    assert!(
        tx.poll_acquire_small(49).unwrap().is_none(),
        "49 bytes do not fit a box"
    );
    let mut next = 0u64;
    let mut expect = |rx: &mut Box<dyn braid_core::transport::RecvChannel>, want: &[u8]| {
        let (buf, len) = wait_for("a message", Duration::from_secs(10), || {
            rx.poll_peek().unwrap()
        });
        assert_eq!(read(buf, len), want, "message {next}");
        rx.release().unwrap();
        next += 1;
    };
    expect(&mut rx, &0u64.to_le_bytes());
    // One box free, still no slot.
    assert!(
        tx.poll_acquire().unwrap().is_none(),
        "a slot with 255 messages outstanding"
    );
    let buf = tx.poll_acquire_small(8).unwrap().expect("the released box");
    write(buf, &256u64.to_le_bytes());
    tx.commit(8).unwrap();
    for i in 1..=253u64 {
        expect(&mut rx, &i.to_le_bytes());
    }
    // Three outstanding (254, 255, 256): a slot again.
    let big: Vec<u8> = (0..1000).map(|i| (i * 7) as u8).collect();
    let buf = tx
        .poll_acquire()
        .unwrap()
        .expect("a slot with 3 of 4 outstanding");
    write(buf, &big);
    tx.commit(big.len()).unwrap();
    for i in 254..=256u64 {
        expect(&mut rx, &i.to_le_bytes());
    }
    expect(&mut rx, &big);
    wait_for("drain", Duration::from_secs(10), || {
        tx.poll_drained().unwrap().then_some(())
    });
}

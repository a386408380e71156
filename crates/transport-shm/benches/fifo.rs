//! Round trip of the shm slot FIFO, two ends in one process.
//!
//! - `shm_pingpong/8B`: latency of one 8-byte message there and back. A
//!   thread echoes every slot it receives on `0 → 1` back on `1 → 0`; the
//!   bench thread sends one slot and spins until the echo arrives. One
//!   iteration is one full round trip (two commits, two peeks, two releases).
//! - `shm_stream/<size>`: throughput of slot-sized messages from a sender
//!   thread (copies a buffer into each slot) to the bench thread (copies each
//!   slot out into a buffer), reported as payload bytes per second.
//!
//! Channels are connected the way the runtime does it (see
//! `braid_conformance::connect_pair`), and every wait spins
//! with `std::hint::spin_loop`, yielding now and then so that two spinning
//! threads on a busy machine still make progress, and panics after a generous
//! deadline so a bug cannot hang the bench. Segments are unlinked from
//! `/dev/shm` as soon as both ends are connected.
//!
//! `cargo bench -p braid-transport-shm --bench fifo` (optionally with a
//! filter, e.g. `-- pingpong`).

use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use braid_conformance::{connect_pair, WAIT};
use braid_core::transport::{RecvChannel, SendChannel, SlotBuf};
use braid_transport_shm::{leftover_segments, ShmConfig, ShmTransport};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// Failed polls between two deadline/liveness checks (each followed by a
/// `yield_now`); a power of two.
const CHECK_EVERY: u32 = 1 << 12;
/// Longest a thread waits for the next message while idle (between criterion
/// phases); much longer than any gap the bench itself produces.
const IDLE_WAIT: Duration = Duration::from_secs(60);

/// Bookkeeping of one spin-wait. Free to create: the clock is read only once
/// the wait has lasted `CHECK_EVERY` polls, so fast waits cost no syscall and
/// no `Instant::now`.
struct Spin {
    what: &'static str,
    timeout: Duration,
    spins: u32,
    deadline: Option<Instant>,
}

impl Spin {
    fn new(what: &'static str, timeout: Duration) -> Spin {
        Spin {
            what,
            timeout,
            spins: 0,
            deadline: None,
        }
    }

    /// Called after a poll that found nothing. Returns true when the caller
    /// should check the peer's liveness; panics past the deadline.
    fn pause(&mut self) -> bool {
        self.spins = self.spins.wrapping_add(1);
        if self.spins & (CHECK_EVERY - 1) != 0 {
            std::hint::spin_loop();
            return false;
        }
        let now = Instant::now();
        let deadline = *self.deadline.get_or_insert(now + self.timeout);
        if now >= deadline {
            panic!(
                "fifo bench: timed out after {:?} waiting for {}",
                self.timeout, self.what
            );
        }
        std::thread::yield_now();
        true
    }
}

/// Spins until the sender gets a free slot.
fn acquire(tx: &mut dyn SendChannel, what: &'static str) -> SlotBuf {
    let mut spin = Spin::new(what, WAIT);
    loop {
        if let Some(slot) = tx.poll_acquire().expect("poll_acquire") {
            return slot;
        }
        if spin.pause() {
            tx.check_peer()
                .unwrap_or_else(|e| panic!("fifo bench: waiting for {what}: {e}"));
        }
    }
}

/// Spins until the receiver sees a committed slot.
fn peek(rx: &mut dyn RecvChannel, what: &'static str, timeout: Duration) -> (SlotBuf, usize) {
    let mut spin = Spin::new(what, timeout);
    loop {
        if let Some(msg) = rx.poll_peek().expect("poll_peek") {
            return msg;
        }
        if spin.pause() {
            rx.check_peer()
                .unwrap_or_else(|e| panic!("fifo bench: waiting for {what}: {e}"));
        }
    }
}

/// The two directed connections between simulated ranks 0 and 1.
#[allow(clippy::type_complexity)]
fn connect_both(
    t: &ShmTransport,
) -> (
    (Box<dyn SendChannel>, Box<dyn RecvChannel>),
    (Box<dyn SendChannel>, Box<dyn RecvChannel>),
) {
    let (t0, t1) = (t.clone(), t.clone());
    (connect_pair(&t0, &t1, 0, 1), connect_pair(&t1, &t0, 1, 0))
}

/// Echoes every message of `rx` on `tx` until a zero-length message arrives.
fn echo(mut rx: Box<dyn RecvChannel>, mut tx: Box<dyn SendChannel>) {
    loop {
        let (inb, len) = peek(&mut *rx, "the next ping", IDLE_WAIT);
        if len == 0 {
            rx.release().expect("release");
            return;
        }
        let out = acquire(&mut *tx, "a slot for the pong");
        assert!(len <= out.cap, "fifo bench: ping larger than a pong slot");
        // SAFETY: `inb` is a committed slot valid for reads of `len` bytes
        // until `release`; `out` is our acquired slot, valid for writes of
        // `out.cap >= len` bytes until `commit`; they are different segments.
        unsafe { std::ptr::copy_nonoverlapping(inb.ptr, out.ptr, len) };
        tx.commit(len).expect("commit");
        rx.release().expect("release");
    }
}

/// Ping-pong latency of one 8-byte message.
fn pingpong(c: &mut Criterion) {
    let t = ShmTransport::with_params(ShmConfig::DEFAULT_SLOT_BYTES, ShmConfig::DEFAULT_SLOTS)
        .expect("shm geometry");
    let mut g = c.benchmark_group("shm_pingpong");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    // Channels live inside the scope: if the bench panics they are dropped
    // before the scope joins, so the echo thread sees its peer close.
    std::thread::scope(|s| {
        let ((mut tx, rx_echo), (tx_echo, mut rx)) = connect_both(&t);
        s.spawn(move || echo(rx_echo, tx_echo));
        let mut seq = 0u64;
        g.bench_function("8B", |b| {
            b.iter(|| {
                seq += 1;
                let out = acquire(&mut *tx, "a slot for the ping");
                // SAFETY: our acquired slot is at least 4096 bytes and
                // 64-byte aligned, so an aligned u64 write fits.
                unsafe { out.ptr.cast::<u64>().write(seq) };
                tx.commit(8).expect("commit");
                let (inb, len) = peek(&mut *rx, "the pong", WAIT);
                assert_eq!(len, 8, "fifo bench: pong length");
                // SAFETY: a committed 8-byte message in a 64-byte aligned
                // slot, valid for reads until `release`.
                let got = unsafe { inb.ptr.cast::<u64>().read() };
                rx.release().expect("release");
                assert_eq!(got, seq, "fifo bench: pong out of order");
                black_box(got)
            })
        });
        // Zero length tells the echo thread to stop; scope joins it.
        acquire(&mut *tx, "a slot for the stop message");
        tx.commit(0).expect("commit");
    });
    g.finish();
}

/// Streaming throughput of slot-sized messages, sender thread → bench thread.
fn stream(c: &mut Criterion) {
    let mut g = c.benchmark_group("shm_stream");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for slot_bytes in [64 << 10, ShmConfig::DEFAULT_SLOT_BYTES] {
        let t =
            ShmTransport::with_params(slot_bytes, ShmConfig::DEFAULT_SLOTS).expect("shm geometry");
        g.throughput(Throughput::Bytes(slot_bytes as u64));
        std::thread::scope(|s| {
            let (mut tx, mut rx) = connect_pair(&t, &t.clone(), 0, 1);
            // Each command asks the sender for that many messages; dropping
            // `cmd` ends the sender thread.
            let (cmd, cmds) = mpsc::channel::<u64>();
            s.spawn(move || {
                let src: Vec<u8> = (0..slot_bytes).map(|i| (i % 251) as u8).collect();
                let mut seq = 0u64;
                for n in cmds {
                    for _ in 0..n {
                        let out = acquire(&mut *tx, "a free slot (credit)");
                        // SAFETY: our acquired slot is valid for writes of
                        // `out.cap == slot_bytes` bytes until `commit`, and
                        // 64-byte aligned; `src` holds `slot_bytes` bytes.
                        unsafe {
                            std::ptr::copy_nonoverlapping(src.as_ptr(), out.ptr, slot_bytes);
                            out.ptr.cast::<u64>().write(seq);
                        }
                        tx.commit(slot_bytes).expect("commit");
                        seq += 1;
                    }
                }
            });
            let mut dst = vec![0u8; slot_bytes];
            let mut seq = 0u64;
            g.bench_function(BenchmarkId::from_parameter(size_label(slot_bytes)), |b| {
                b.iter_custom(|iters| receive_stream(&mut *rx, &cmd, &mut dst, &mut seq, iters))
            });
            drop(cmd);
        });
    }
    g.finish();
}

/// Streaming rate of 24-byte messages, each in the line of its box's `seq`
/// (where braid's 8-byte piece travels behind its 32-byte operation
/// header), sender thread → bench thread: the transport's floor under a
/// stream of small Broadcasts.
fn stream_small(c: &mut Criterion) {
    const LEN: usize = 24;
    let mut g = c.benchmark_group("shm_stream");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let t = ShmTransport::with_params(ShmConfig::DEFAULT_SLOT_BYTES, ShmConfig::DEFAULT_SLOTS)
        .expect("shm geometry");
    g.throughput(Throughput::Elements(1));
    std::thread::scope(|s| {
        let (mut tx, mut rx) = connect_pair(&t, &t.clone(), 0, 1);
        let (cmd, cmds) = mpsc::channel::<u64>();
        s.spawn(move || {
            let mut seq = 0u64;
            for n in cmds {
                for _ in 0..n {
                    let mut spin = Spin::new("a free box", WAIT);
                    let out = loop {
                        if let Some(b) = tx.poll_acquire_small(LEN).expect("poll_acquire_small") {
                            break b;
                        }
                        if spin.pause() {
                            tx.check_peer().expect("check_peer");
                        }
                    };
                    // SAFETY: an acquired box holds at least LEN bytes and is
                    // 64-byte aligned.
                    unsafe {
                        std::ptr::write_bytes(out.ptr, 7, LEN);
                        out.ptr.cast::<u64>().write(seq);
                    }
                    tx.commit(LEN).expect("commit");
                    seq += 1;
                }
            }
        });
        let mut dst = [0u8; LEN];
        let mut seq = 0u64;
        g.bench_function("24B_inline", |b| {
            b.iter_custom(|iters| receive_stream(&mut *rx, &cmd, &mut dst, &mut seq, iters))
        });
        drop(cmd);
    });
    g.finish();
}

/// Asks the sender for `iters` messages of `dst.len()` bytes and receives
/// them in order into `dst` (each starts with its number, `seq` on);
/// returns how long that took.
fn receive_stream(
    rx: &mut dyn RecvChannel,
    cmd: &mpsc::Sender<u64>,
    dst: &mut [u8],
    seq: &mut u64,
    iters: u64,
) -> Duration {
    let start = Instant::now();
    cmd.send(iters).expect("sender thread is gone");
    for _ in 0..iters {
        let (inb, len) = peek(rx, "the next message", WAIT);
        assert_eq!(len, dst.len(), "fifo bench: message length");
        // SAFETY: a committed message valid for reads of `len` bytes until
        // `release`; `dst` holds `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(inb.ptr, dst.as_mut_ptr(), len) };
        rx.release().expect("release");
        let got = u64::from_ne_bytes(dst[..8].try_into().unwrap());
        assert_eq!(got, *seq, "fifo bench: message out of order");
        *seq += 1;
    }
    black_box(&dst);
    start.elapsed()
}

fn size_label(bytes: usize) -> String {
    if bytes & ((1 << 20) - 1) == 0 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

fn benches(c: &mut Criterion) {
    pingpong(c);
    stream_small(c);
    stream(c);
    // Every segment was unlinked at connect and every channel is dropped.
    let mine = format!("braid-{}-", std::process::id());
    let left: Vec<String> = leftover_segments()
        .into_iter()
        .filter(|n| n.starts_with(&mine))
        .collect();
    assert!(
        left.is_empty(),
        "fifo bench left segments in /dev/shm: {left:?}"
    );
}

criterion_group!(fifo, benches);
criterion_main!(fifo);

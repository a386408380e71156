//! braid-conformance: the transport seam's contract as executable checks.
//!
//! Test support, not part of braid's library surface: transport crates use
//! it as a dev-dependency.
//!
//! Every transport crate runs the same cases against its implementation. A
//! case is a plain function taking a [`Factory`] (anything callable that
//! makes a fresh transport) and panicking with a message that names the
//! violated rule; it is test code, meant to be called from `#[test]`s. The
//! suite calls the factory once per simulated rank, so each rank has its own
//! transport instance, as separate processes would.
//!
//! Enable the whole suite with one line in `tests/conformance.rs`:
//!
//! ```text
//! braid_conformance::transport_conformance_tests!(|| MyTransport::new());
//! ```
//!
//! The expression must evaluate to something callable with no arguments that
//! returns either a `T: Transport + 'static` or a `Box<dyn Transport>` (see
//! [`IntoTransport`]); it must not capture local variables. The macro
//! expands to one `#[test]` per case (names start with `conformance_`), so use
//! it once per module.
//!
//! Set-up follows the runtime: two ranks 0 and 1 in this process, both with
//! `PeerDesc { host_id: "braid-conformance-host", pid: std::process::id() }`;
//! phase 1 (`listen` / `prepare_send`) on both, blobs exchanged in memory,
//! then phase 2: every send-side `connect` first, then every receive-side
//! `connect` (a receiver that waits for its sender to attach works in one
//! thread because the sender has attached by then).
//!
//! Slot contents are written and checked only when the channels report
//! [`MemKind::Host`]; for device memory the suite checks lengths, order,
//! credits and liveness. Every wait is bounded (10 s, 60 s for the stress
//! case) and a timeout fails the case instead of hanging it. Small slots make
//! the suite fast: transport crates should pass a factory with small
//! geometry (e.g. 4 slots of 64 KiB).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::error::CoreError;
use braid_core::transport::{
    sleep_any, PeerDesc, PendingRecv, PendingSend, RecvChannel, Resume, SendChannel, SlotBuf,
    Transport, WakeWord, Woken,
};
use braid_core::types::MemKind;

/// Makes a fresh transport instance (one per simulated rank).
pub type Factory = dyn Fn() -> Box<dyn Transport>;

/// What a factory passed to [`transport_conformance_tests!`](crate::transport_conformance_tests) may return.
pub trait IntoTransport {
    /// Box it as a trait object.
    fn into_transport(self) -> Box<dyn Transport>;
}

impl<T: Transport + 'static> IntoTransport for T {
    fn into_transport(self) -> Box<dyn Transport> {
        Box::new(self)
    }
}

/// Bound on every ordinary wait in the suite.
pub const WAIT: Duration = Duration::from_secs(10);
/// Bound on the concurrent stress case.
pub const STRESS_WAIT: Duration = Duration::from_secs(60);
/// Host id both simulated ranks share.
pub const HOST_ID: &str = "braid-conformance-host";

/// The description of simulated rank `rank`.
pub fn desc(rank: u32) -> PeerDesc {
    PeerDesc {
        rank,
        host_id: HOST_ID.to_owned(),
        pid: std::process::id(),
        fabrics: Vec::new(),
    }
}

/// [`desc`] with the fabric that transport `t` announces, as the runtime
/// fills it in.
pub fn desc_on(t: &dyn Transport, rank: u32) -> PeerDesc {
    let mut d = desc(rank);
    if let Some(f) = t.fabric() {
        d.fabrics.push((t.name().to_owned(), f));
    }
    d
}

/// Polls `f` until it returns `Some`, panicking after `timeout` with `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    let mut spins = 0u32;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("conformance: timed out after {timeout:?} waiting for {what}");
        }
        spins += 1;
        if spins & 63 == 0 {
            std::thread::sleep(Duration::from_micros(100));
        } else {
            std::thread::yield_now();
        }
    }
}

/// Phase 1 for one directed connection `from → to`: `(pending send, its
/// blob, pending recv, its blob)`.
#[allow(clippy::type_complexity)]
fn phase1(
    ts: &dyn Transport,
    tr: &dyn Transport,
    from: u32,
    to: u32,
) -> (Box<dyn PendingSend>, Vec<u8>, Box<dyn PendingRecv>, Vec<u8>) {
    let (s, r) = (desc_on(ts, from), desc_on(tr, to));
    assert!(
        ts.can_connect(&s, &r) && tr.can_connect(&r, &s),
        "conformance: transport {} refuses to connect two ranks with host_id {HOST_ID:?} in one process",
        ts.name()
    );
    let (prx, rinfo) = tr
        .listen(&r, &s)
        .unwrap_or_else(|e| panic!("conformance: listen({to} <- {from}) failed: {e}"));
    let (ptx, sinfo) = ts
        .prepare_send(&s, &r)
        .unwrap_or_else(|e| panic!("conformance: prepare_send({from} -> {to}) failed: {e}"));
    (ptx, sinfo, prx, rinfo)
}

fn check_channels(
    t: &dyn Transport,
    tx: &dyn SendChannel,
    rx: &dyn RecvChannel,
    from: u32,
    to: u32,
) {
    assert_eq!(tx.peer(), to, "conformance: SendChannel::peer");
    assert_eq!(rx.peer(), from, "conformance: RecvChannel::peer");
    assert_eq!(
        tx.transport(),
        t.name(),
        "conformance: SendChannel::transport"
    );
    assert_eq!(
        rx.transport(),
        t.name(),
        "conformance: RecvChannel::transport"
    );
    assert_eq!(
        tx.mem_kind(),
        t.mem_kind(),
        "conformance: SendChannel::mem_kind"
    );
    assert_eq!(
        rx.mem_kind(),
        t.mem_kind(),
        "conformance: RecvChannel::mem_kind"
    );
    assert_eq!(
        tx.slot_bytes(),
        rx.slot_bytes(),
        "conformance: both ends must agree on slot_bytes"
    );
    assert!(tx.slot_bytes() >= 64, "conformance: slot_bytes < 64");
    assert!(tx.slots() >= 1, "conformance: slots must be at least 1");
}

/// Connects `from → to` the way the runtime does (send side first), with
/// `ts` the sender's transport and `tr` the receiver's.
pub fn connect_pair(
    ts: &dyn Transport,
    tr: &dyn Transport,
    from: u32,
    to: u32,
) -> (Box<dyn SendChannel>, Box<dyn RecvChannel>) {
    let (ptx, sinfo, prx, rinfo) = phase1(ts, tr, from, to);
    let deadline = Instant::now() + WAIT;
    let tx = ptx
        .connect(&rinfo, deadline)
        .unwrap_or_else(|e| panic!("conformance: send-side connect({from} -> {to}) failed: {e}"));
    let rx = prx
        .connect(&sinfo, deadline)
        .unwrap_or_else(|e| panic!("conformance: recv-side connect({from} -> {to}) failed: {e}"));
    check_channels(ts, &*tx, &*rx, from, to);
    (tx, rx)
}

/// Connects `0 → 1` with two fresh transports from `factory`.
pub fn fresh_pair(factory: &Factory) -> (Box<dyn SendChannel>, Box<dyn RecvChannel>) {
    let (t0, t1) = (factory(), factory());
    connect_pair(&*t0, &*t1, 0, 1)
}

// ---------------------------------------------------------------- contents

/// Byte `i` of message `seq` from rank `src`.
fn pattern(src: u32, seq: u64, i: usize) -> u8 {
    let x = seq
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(src) << 40);
    (x >> 56) as u8 ^ (i as u8).wrapping_mul(31) ^ (i >> 8) as u8 ^ (i >> 16) as u8
}

fn fill(src: u32, seq: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = pattern(src, seq, i);
    }
}

fn first_mismatch(src: u32, seq: u64, data: &[u8]) -> Option<usize> {
    data.iter()
        .enumerate()
        .position(|(i, b)| *b != pattern(src, seq, i))
}

/// Copies `data` into a host slot.
fn write_slot(buf: SlotBuf, data: &[u8]) {
    assert!(
        data.len() <= buf.cap,
        "conformance: message of {} bytes does not fit a {}-byte slot",
        data.len(),
        buf.cap
    );
    assert!(!buf.ptr.is_null(), "conformance: null slot pointer");
    // SAFETY: the seam promises `buf.ptr` points to `buf.cap` writable bytes
    // of host memory (we only call this for MemKind::Host) owned by the
    // sender between poll_acquire and commit; `data.len() <= cap` and `data`
    // is a separate Rust allocation, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr, data.len()) }
}

/// Copies `len` bytes out of a host slot.
fn read_slot(buf: SlotBuf, len: usize) -> Vec<u8> {
    assert!(
        len <= buf.cap,
        "conformance: poll_peek reported {len} bytes in a {}-byte slot",
        buf.cap
    );
    assert!(!buf.ptr.is_null(), "conformance: null slot pointer");
    let mut v = vec![0u8; len];
    // SAFETY: the seam promises `buf.ptr` points to `buf.cap` readable bytes
    // of host memory (only called for MemKind::Host) that the sender does not
    // touch between poll_peek and release; `len <= cap`; `v` is a separate
    // allocation of `len` bytes.
    unsafe { std::ptr::copy_nonoverlapping(buf.ptr, v.as_mut_ptr(), len) }
    v
}

/// Sends message `seq` (pattern from rank `src`) of `len` bytes through an
/// acquired slot.
fn put(tx: &mut dyn SendChannel, buf: SlotBuf, src: u32, seq: u64, len: usize) {
    assert_eq!(
        buf.cap,
        tx.slot_bytes(),
        "conformance: SlotBuf::cap != slot_bytes"
    );
    assert_eq!(
        buf.ptr as usize % 64,
        0,
        "conformance: slot pointer not 64-byte aligned"
    );
    if tx.mem_kind() == MemKind::Host {
        let mut data = vec![0u8; len];
        fill(src, seq, &mut data);
        write_slot(buf, &data);
    }
    tx.commit(len)
        .unwrap_or_else(|e| panic!("conformance: commit({len}) of message {seq} failed: {e}"));
}

/// Checks a peeked slot holds message `seq` from `src` of `want_len` bytes.
fn check_msg(rx: &dyn RecvChannel, buf: SlotBuf, len: usize, src: u32, seq: u64, want_len: usize) {
    assert_eq!(
        len, want_len,
        "conformance: message {seq} arrived with {len} bytes, {want_len} were committed (out of order or wrong length)"
    );
    assert!(
        (len..=rx.slot_bytes()).contains(&buf.cap),
        "conformance: a peeked slot's cap {} is not between the message's {len} bytes and slot_bytes {}",
        buf.cap,
        rx.slot_bytes()
    );
    assert_eq!(
        buf.ptr as usize % 64,
        0,
        "conformance: slot pointer not 64-byte aligned"
    );
    if rx.mem_kind() == MemKind::Host {
        let data = read_slot(buf, len);
        if let Some(i) = first_mismatch(src, seq, &data) {
            panic!(
                "conformance: message {seq} ({len} bytes) corrupted at byte {i}: got {:#04x}, want {:#04x}",
                data[i],
                pattern(src, seq, i)
            );
        }
    }
}

/// Receives and checks up to `budget` messages that have arrived (pattern
/// from rank 0, message `seq` of `len_of(seq)` bytes), advancing `got`;
/// `sent` messages were committed so far.
fn receive_some(
    rx: &mut dyn RecvChannel,
    budget: u64,
    got: &mut u64,
    sent: u64,
    len_of: impl Fn(u64) -> usize,
) {
    for _ in 0..budget {
        let Some((buf, len)) = rx.poll_peek().expect("conformance: poll_peek") else {
            break;
        };
        assert!(
            *got < sent,
            "conformance: received message {got} that was never sent"
        );
        check_msg(rx, buf, len, 0, *got, len_of(*got));
        rx.release().expect("conformance: release");
        *got += 1;
    }
}

fn wait_acquire(tx: &mut dyn SendChannel, what: &str) -> SlotBuf {
    wait_for(what, WAIT, || {
        tx.poll_acquire()
            .unwrap_or_else(|e| panic!("conformance: poll_acquire failed ({what}): {e}"))
    })
}

fn wait_peek(rx: &mut dyn RecvChannel, what: &str) -> (SlotBuf, usize) {
    wait_for(what, WAIT, || {
        rx.poll_peek()
            .unwrap_or_else(|e| panic!("conformance: poll_peek failed ({what}): {e}"))
    })
}

fn wait_drained(tx: &mut dyn SendChannel) {
    wait_for("the sender to see every slot released", WAIT, || {
        tx.poll_drained()
            .unwrap_or_else(|e| panic!("conformance: poll_drained failed: {e}"))
            .then_some(())
    })
}

// ------------------------------------------------------------------- cases

/// Case 1: many messages (at least 10 × slots, wrapping around the ring)
/// with lengths 0, 1, 40, 48, 49, 63, 112, 113, slot_bytes − 1 and slot_bytes arrive in
/// order and intact.
pub fn ordered_delivery(factory: &Factory) {
    let (mut tx, mut rx) = fresh_pair(factory);
    let sb = tx.slot_bytes();
    let slots = tx.slots();
    // 40, 48, 49 and 112, 113: around the places a transport may carry
    // small messages in (shm: 48 bytes in the line of a box's `seq`, 112
    // in its two lines).
    let lens = [0, 1, 40, 48, 49, 63, 112, 113, sb - 1, sb];
    let n = (10 * slots).max(5 * lens.len()) as u64 + 3;
    let deadline = Instant::now() + WAIT;
    let (mut sent, mut got, mut round) = (0u64, 0u64, 0u64);
    while got < n {
        assert!(
            Instant::now() < deadline,
            "conformance: ordered delivery stuck: {sent} sent, {got} received of {n}"
        );
        while sent < n {
            let Some(buf) = tx.poll_acquire().expect("conformance: poll_acquire") else {
                break;
            };
            put(&mut *tx, buf, 0, sent, lens[sent as usize % lens.len()]);
            sent += 1;
        }
        // Consume a varying number per round so that head and tail meet at
        // every offset of the ring.
        let budget = 1 + round % slots as u64;
        round += 1;
        receive_some(&mut *rx, budget, &mut got, sent, |seq| {
            lens[seq as usize % lens.len()]
        });
    }
    wait_drained(&mut *tx);
    assert!(
        rx.poll_peek().expect("conformance: poll_peek").is_none(),
        "conformance: a message arrived that was never sent"
    );
}

/// Case 2: credits. After `slots` commits without a release there is no free
/// slot; one release returns one credit; `poll_drained` stays false until
/// every committed slot is released.
pub fn credits(factory: &Factory) {
    let (mut tx, mut rx) = fresh_pair(factory);
    let slots = tx.slots();
    assert!(
        rx.poll_peek().expect("conformance: poll_peek").is_none(),
        "conformance: poll_peek returned a slot before anything was committed"
    );
    assert!(
        tx.poll_drained().expect("conformance: poll_drained"),
        "conformance: poll_drained is false before anything was committed"
    );
    for i in 0..slots {
        let buf = wait_acquire(&mut *tx, &format!("credit {i} of {slots} on a fresh link"));
        put(&mut *tx, buf, 0, i as u64, 1 + i);
    }
    // No credit may appear while nothing is released (check for a while, in
    // case credits travel asynchronously).
    let until = Instant::now() + Duration::from_millis(50);
    while Instant::now() < until {
        assert!(
            tx.poll_acquire().expect("conformance: poll_acquire").is_none(),
            "conformance: poll_acquire returned a slot with all {slots} slots committed and none released"
        );
        std::thread::yield_now();
    }
    assert!(
        !tx.poll_drained().expect("conformance: poll_drained"),
        "conformance: poll_drained is true with {slots} slots unreleased"
    );
    let mut spare: Option<SlotBuf> = None;
    for i in 0..slots {
        let (buf, len) = wait_peek(&mut *rx, &format!("committed message {i}"));
        check_msg(&*rx, buf, len, 0, i as u64, 1 + i);
        rx.release().expect("conformance: release");
        if i == 0 {
            spare = Some(wait_acquire(
                &mut *tx,
                "the credit returned by the first release",
            ));
            assert!(
                tx.poll_acquire()
                    .expect("conformance: poll_acquire")
                    .is_some(),
                "conformance: poll_acquire lost the slot it had just returned"
            );
        }
        if i + 1 < slots {
            assert!(
                !tx.poll_drained().expect("conformance: poll_drained"),
                "conformance: poll_drained is true with {} slots unreleased",
                slots - i - 1
            );
        }
    }
    // The acquired but uncommitted slot does not count as outstanding.
    wait_drained(&mut *tx);
    // The credit taken after the first release still works.
    let buf = spare.expect("acquired above");
    put(&mut *tx, buf, 0, slots as u64, 7);
    let (buf, len) = wait_peek(&mut *rx, "the message sent in the recycled slot");
    check_msg(&*rx, buf, len, 0, slots as u64, 7);
    rx.release().expect("conformance: release");
    wait_drained(&mut *tx);
}

/// Case 3: `poll_acquire` twice before `commit` gives the same slot, and
/// `poll_peek` twice before `release` gives the same slot and length.
pub fn repeated_polls_return_same_slot(factory: &Factory) {
    let (mut tx, mut rx) = fresh_pair(factory);
    let rounds = 2 * tx.slots() as u64 + 1;
    for seq in 0..rounds {
        let a = wait_acquire(&mut *tx, "a free slot");
        let b = tx
            .poll_acquire()
            .expect("conformance: poll_acquire")
            .unwrap_or_else(|| {
                panic!("conformance: second poll_acquire before commit returned None")
            });
        assert_eq!(
            (a.ptr, a.cap),
            (b.ptr, b.cap),
            "conformance: poll_acquire twice before commit returned different slots"
        );
        let len = 100 + seq as usize;
        put(&mut *tx, b, 0, seq, len);
        let (p, l) = wait_peek(&mut *rx, "the committed message");
        let (q, m) = rx
            .poll_peek()
            .expect("conformance: poll_peek")
            .unwrap_or_else(|| {
                panic!("conformance: second poll_peek before release returned None")
            });
        assert_eq!(
            (p.ptr, p.cap, l),
            (q.ptr, q.cap, m),
            "conformance: poll_peek twice before release returned different slots"
        );
        check_msg(&*rx, q, m, 0, seq, len);
        rx.release().expect("conformance: release");
    }
    wait_drained(&mut *tx);
}

/// Length of stress message `seq` for slots of `sb` bytes.
fn stress_len(seq: u64, sb: usize) -> usize {
    let small_max = sb.min(4096);
    match (seq % 97, seq % 251) {
        (0, _) => 0,
        (_, 1) => sb,
        _ => {
            let h = seq.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33;
            16 + (h as usize) % (small_max - 15)
        }
    }
}

fn fnv1a(data: &[u8]) -> u32 {
    data.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// Builds stress message `seq`: `[seq u64][len u32][fnv1a(payload) u32]`
/// then the pattern; messages shorter than 16 bytes are pattern only.
fn stress_msg(src: u32, seq: u64, len: usize) -> Vec<u8> {
    let mut m = vec![0u8; len];
    fill(src, seq, &mut m);
    if len >= 16 {
        let sum = fnv1a(&m[16..]);
        m[..8].copy_from_slice(&seq.to_le_bytes());
        m[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        m[12..16].copy_from_slice(&sum.to_le_bytes());
    }
    m
}

fn check_stress_msg(src: u32, seq: u64, data: &[u8]) -> Result<(), String> {
    let len = data.len();
    if len >= 16 {
        let got_seq = u64::from_le_bytes(data[..8].try_into().unwrap());
        let got_len = u32::from_le_bytes(data[8..12].try_into().unwrap()) as usize;
        let got_sum = u32::from_le_bytes(data[12..16].try_into().unwrap());
        if got_seq != seq {
            return Err(format!(
                "expected message {seq}, got message {got_seq} (reordered, lost or duplicated)"
            ));
        }
        if got_len != len {
            return Err(format!(
                "message {seq}: header says {got_len} bytes, slot holds {len}"
            ));
        }
        if fnv1a(&data[16..]) != got_sum {
            return Err(format!(
                "message {seq}: checksum mismatch (payload corrupted)"
            ));
        }
    }
    let want = stress_msg(src, seq, len);
    if data != want.as_slice() {
        let i = data
            .iter()
            .zip(&want)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        return Err(format!("message {seq} ({len} bytes) differs at byte {i}"));
    }
    Ok(())
}

/// Sends `n` stress messages from `src`; returns the channel once drained.
fn stress_sender(
    mut tx: Box<dyn SendChannel>,
    src: u32,
    n: u64,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Box<dyn SendChannel>, String> {
    let sb = tx.slot_bytes();
    let host = tx.mem_kind() == MemKind::Host;
    let mut idle = 0u32;
    let mut seq = 0u64;
    while seq < n {
        match tx
            .poll_acquire()
            .map_err(|e| format!("poll_acquire: {e}"))?
        {
            Some(buf) => {
                idle = 0;
                let len = stress_len(seq, sb);
                if host {
                    write_slot(buf, &stress_msg(src, seq, len));
                }
                tx.commit(len).map_err(|e| format!("commit: {e}"))?;
                seq += 1;
            }
            None => {
                idle += 1;
                if idle & 1023 == 0 {
                    if stop.load(Ordering::Relaxed) {
                        return Err("stopped: the other side failed".into());
                    }
                    if Instant::now() >= deadline {
                        return Err(format!("timed out with {seq} of {n} sent"));
                    }
                    tx.check_peer()
                        .map_err(|e| format!("check_peer on a live link: {e}"))?;
                    std::thread::yield_now();
                }
            }
        }
    }
    loop {
        if tx
            .poll_drained()
            .map_err(|e| format!("poll_drained: {e}"))?
        {
            return Ok(tx);
        }
        if stop.load(Ordering::Relaxed) {
            return Err("stopped: the other side failed".into());
        }
        if Instant::now() >= deadline {
            return Err("timed out waiting for poll_drained".into());
        }
        std::thread::yield_now();
    }
}

/// Receives `n` stress messages from `src`.
fn stress_receiver(
    mut rx: Box<dyn RecvChannel>,
    src: u32,
    n: u64,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Box<dyn RecvChannel>, String> {
    let sb = rx.slot_bytes();
    let host = rx.mem_kind() == MemKind::Host;
    let mut idle = 0u32;
    let mut seq = 0u64;
    while seq < n {
        match rx.poll_peek().map_err(|e| format!("poll_peek: {e}"))? {
            Some((buf, len)) => {
                idle = 0;
                let want = stress_len(seq, sb);
                if len != want {
                    return Err(format!(
                        "message {seq}: {len} bytes arrived, {want} were sent (reordered or wrong length)"
                    ));
                }
                if host {
                    check_stress_msg(src, seq, &read_slot(buf, len))?;
                }
                rx.release().map_err(|e| format!("release: {e}"))?;
                seq += 1;
            }
            None => {
                idle += 1;
                if idle & 1023 == 0 {
                    if stop.load(Ordering::Relaxed) {
                        return Err("stopped: the other side failed".into());
                    }
                    if Instant::now() >= deadline {
                        return Err(format!("timed out with {seq} of {n} received"));
                    }
                    rx.check_peer()
                        .map_err(|e| format!("check_peer on a live link: {e}"))?;
                    std::thread::yield_now();
                }
            }
        }
    }
    Ok(rx)
}

fn run_flagged<T>(stop: &AtomicBool, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into()))
    });
    if r.is_err() {
        stop.store(true, Ordering::Relaxed);
    }
    r
}

/// Case 4: a sender thread and a receiver thread exchange 20 000 messages of
/// varying length carrying sequence numbers and checksums.
pub fn concurrent_stress(factory: &Factory) {
    const N: u64 = 20_000;
    let (tx, rx) = fresh_pair(factory);
    let deadline = Instant::now() + STRESS_WAIT;
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let sender =
        std::thread::spawn(move || run_flagged(&s2, || stress_sender(tx, 0, N, deadline, &s2)));
    let r = run_flagged(&stop, || stress_receiver(rx, 0, N, deadline, &stop));
    let s = sender.join().expect("sender thread");
    match (s, r) {
        (Ok(_tx), Ok(_rx)) => {}
        (s, r) => panic!(
            "conformance: concurrent stress failed: sender: {:?}; receiver: {:?}",
            s.err().unwrap_or_else(|| "ok".into()),
            r.err().unwrap_or_else(|| "ok".into())
        ),
    }
}

fn wait_peer_error(
    what: &str,
    mut check: impl FnMut() -> braid_core::error::Result<()>,
) -> CoreError {
    let e = wait_for(what, WAIT, || check().err());
    assert!(
        matches!(e, CoreError::PeerAborted { .. } | CoreError::Peer { .. }),
        "conformance: {what}: expected PeerAborted or Peer, got {e:?}"
    );
    e
}

/// Length of the abort reasons case 5 sends: every transport delivers at
/// least this much of a reason, enough for an error message that nests the
/// aborting rank's own cause.
pub const ABORT_REASON_MIN_BYTES: usize = 400;

/// Case 5: `abort` on one end makes the other end's `check_peer` fail, with
/// the whole reason (of [`ABORT_REASON_MIN_BYTES`]) in the error.
pub fn abort_is_seen_by_peer(factory: &Factory) {
    let reason = |tag: &str| {
        let head = format!("conformance abort {tag} ");
        let tail = " end of reason";
        let fill = ABORT_REASON_MIN_BYTES - head.len() - tail.len();
        format!(
            "{head}{}{tail}",
            "é".repeat(fill / 2) + &"r".repeat(fill % 2)
        )
    };
    let (mut tx, mut rx) = fresh_pair(factory);
    tx.check_peer()
        .expect("conformance: sender check_peer on a live link");
    rx.check_peer()
        .expect("conformance: receiver check_peer on a live link");
    let x = reason("x");
    assert_eq!(x.len(), ABORT_REASON_MIN_BYTES);
    tx.abort(&x);
    let e = wait_peer_error("receiver check_peer to report the sender's abort", || {
        rx.check_peer()
    });
    assert!(
        e.to_string().contains(&x),
        "conformance: the receiver's error lacks the sender's {}-byte reason: {e}",
        x.len()
    );

    let (mut tx, mut rx) = fresh_pair(factory);
    tx.check_peer()
        .expect("conformance: sender check_peer on a live link");
    let y = reason("y");
    rx.abort(&y);
    let e = wait_peer_error("sender check_peer to report the receiver's abort", || {
        tx.check_peer()
    });
    assert!(
        e.to_string().contains(&y),
        "conformance: the sender's error lacks the receiver's {}-byte reason: {e}",
        y.len()
    );
}

/// Sends messages `from..to` (pattern from rank 0, lengths cycling through
/// small, mid and full slots) as far as credits allow; returns the next.
fn send_upto(tx: &mut dyn SendChannel, from: u64, to: u64) -> u64 {
    let sb = tx.slot_bytes();
    let mut seq = from;
    while seq < to {
        let Some(buf) = tx.poll_acquire().expect("conformance: poll_acquire") else {
            break;
        };
        put(tx, buf, 0, seq, [3, sb / 2, sb][seq as usize % 3]);
        seq += 1;
    }
    seq
}

/// Sends messages 0.. up to `to` on a fresh link: waits for the first
/// slot (a link may need a moment after `connect` before it takes writes:
/// IB's receiver says when its queue pairs are ready), then sends while
/// credit lasts. Returns the number sent, at least 1.
fn send_fresh(tx: &mut dyn SendChannel, to: u64) -> u64 {
    let buf = wait_acquire(tx, "the first slot of a fresh link");
    put(tx, buf, 0, 0, 3);
    send_upto(tx, 1, to)
}

/// Case 5b: keeping a link for a new communicator
/// ([`SendChannel::resume_point`] / [`SendChannel::resume`]). A transport
/// that cannot keep links returns `None` from both ends and its `resume`
/// fails. One that can: an idle link resumes where it is; a link whose
/// ends aborted with messages committed and not received resumes too, the
/// receiver dropping them ([`Resume::fits`]); after `resume` both ends
/// name their new peers, no abort is reported, the dropped messages never
/// arrive and new ones arrive intact, in order, with full credits.
pub fn kept_links_resume(factory: &Factory) {
    // An idle link: everything sent was received.
    let (mut tx, mut rx) = fresh_pair(factory);
    let sent = send_fresh(&mut *tx, 2);
    let mut got = 0;
    while got < sent {
        let (buf, len) = wait_peek(&mut *rx, "a message before the link is kept");
        check_msg(
            &*rx,
            buf,
            len,
            0,
            got,
            [3, rx.slot_bytes() / 2, rx.slot_bytes()][got as usize % 3],
        );
        rx.release().expect("conformance: release");
        got += 1;
    }
    wait_drained(&mut *tx);
    let (ps, pr) = (tx.resume_point(), rx.resume_point());
    match (ps, pr) {
        (None, None) => {
            assert!(
                tx.resume(5, sent).is_err() && rx.resume(4, sent).is_err(),
                "conformance: resume must fail on a transport whose ends give no resume point"
            );
            return;
        }
        (Some(s), Some(r)) => {
            assert!(
                Resume::fits(s, r),
                "conformance: an idle link's ends must fit: sender {s:?}, receiver {r:?}"
            );
            assert_eq!(
                s.count, r.count,
                "conformance: an idle link's counts differ"
            );
            tx.resume(5, s.count).expect("conformance: sender resume");
            rx.resume(4, s.count).expect("conformance: receiver resume");
        }
        other => panic!(
            "conformance: one end of a link gives a resume point and the other not: {other:?}"
        ),
    }
    assert_eq!(
        (tx.peer(), rx.peer()),
        (5, 4),
        "conformance: resumed ends name their new peers"
    );
    resumed_link_carries(&mut *tx, &mut *rx, 100);

    // Both ends aborted with messages committed and not received.
    let (mut tx, mut rx) = fresh_pair(factory);
    let slots = tx.slots() as u64;
    send_fresh(&mut *tx, slots);
    tx.abort("conformance: the operation failed here");
    rx.abort("conformance: the operation failed there");
    // A transport that keeps idle links keeps aborted ones too (every one
    // of ours does: shm drops what was not read, socket and IB
    // resynchronise).
    let (Some(s), Some(r)) = (tx.resume_point(), rx.resume_point()) else {
        panic!(
            "conformance: a transport that keeps idle links gives no resume point after an abort"
        );
    };
    assert!(
        Resume::fits(s, r),
        "conformance: the ends of an aborted link do not fit: sender {s:?}, receiver {r:?}"
    );
    tx.resume(2, s.count)
        .expect("conformance: sender resume after abort");
    rx.resume(3, s.count)
        .expect("conformance: receiver resume after abort");
    tx.check_peer()
        .expect("conformance: a resumed sender still sees the old abort");
    rx.check_peer()
        .expect("conformance: a resumed receiver still sees the old abort");
    resumed_link_carries(&mut *tx, &mut *rx, 200);
}

/// After a resume: no old message arrives, and `slots` + 3 new ones
/// (numbered from `base`) arrive intact and in order.
fn resumed_link_carries(tx: &mut dyn SendChannel, rx: &mut dyn RecvChannel, base: u64) {
    assert!(
        rx.poll_peek()
            .expect("conformance: poll_peek after resume")
            .is_none(),
        "conformance: a message committed before the resume arrived after it"
    );
    let n = tx.slots() as u64 + 3;
    let sb = rx.slot_bytes();
    let (mut next, mut got) = (base, base);
    let deadline = Instant::now() + WAIT;
    while got < base + n {
        assert!(
            Instant::now() < deadline,
            "conformance: a resumed link is stuck at {got}"
        );
        next = send_upto(tx, next, base + n);
        if let Some((buf, len)) = rx.poll_peek().expect("conformance: poll_peek") {
            check_msg(rx, buf, len, 0, got, [3, sb / 2, sb][got as usize % 3]);
            rx.release().expect("conformance: release");
            got += 1;
        }
    }
    wait_drained(tx);
}

/// Case 6: dropping one end makes the other end's `check_peer` fail.
pub fn drop_is_seen_by_peer(factory: &Factory) {
    let (tx, mut rx) = fresh_pair(factory);
    rx.check_peer()
        .expect("conformance: receiver check_peer on a live link");
    drop(tx);
    wait_peer_error("receiver check_peer to report the dropped sender", || {
        rx.check_peer()
    });

    let (mut tx, rx) = fresh_pair(factory);
    tx.check_peer()
        .expect("conformance: sender check_peer on a live link");
    drop(rx);
    wait_peer_error("sender check_peer to report the dropped receiver", || {
        tx.check_peer()
    });
}

/// Case 7: a receive-side `connect` whose sender never connects returns
/// `CoreError::Timeout` at about its deadline instead of hanging; a sender
/// connecting afterwards gets an error (at connect or from `check_peer`).
pub fn recv_connect_times_out(factory: &Factory) {
    let (t0, t1) = (factory(), factory());
    let (ptx, sinfo, prx, rinfo) = phase1(&*t0, &*t1, 0, 1);
    let wait = Duration::from_millis(300);
    let start = Instant::now();
    let res = prx.connect(&sinfo, start + wait);
    let took = start.elapsed();
    match res {
        Err(CoreError::Timeout { .. }) => {}
        Err(e) => panic!("conformance: recv connect without a sender: expected Timeout, got {e:?}"),
        Ok(_) => panic!("conformance: recv connect succeeded although the sender never connected"),
    }
    assert!(
        took + Duration::from_millis(5) >= wait,
        "conformance: recv connect gave up after {took:?}, before its {wait:?} deadline"
    );
    assert!(
        took < wait + Duration::from_secs(3),
        "conformance: recv connect overran its {wait:?} deadline: returned after {took:?}"
    );
    match ptx.connect(&rinfo, Instant::now() + WAIT) {
        Err(_) => {}
        Ok(mut tx) => {
            wait_for(
                "a sender that connected after the receiver timed out to see an error",
                WAIT,
                || tx.check_peer().err(),
            );
        }
    }
}

/// Deterministic junk.
fn junk(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Blobs derived from a valid one that no transport may accept.
fn bad_blobs(valid: &[u8], all_prefixes: bool) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = vec![
        ("empty".into(), vec![]),
        ("one zero byte".into(), vec![0]),
        ("zeros of the valid length".into(), vec![0; valid.len()]),
        ("0xff of the valid length".into(), vec![0xff; valid.len()]),
        ("junk of the valid length".into(), junk(valid.len(), 1)),
        ("4 KiB of junk".into(), junk(4096, 2)),
        ("1 MiB of junk".into(), junk(1 << 20, 3)),
    ];
    let mut longer = valid.to_vec();
    longer.push(0xa5);
    v.push(("valid blob plus one trailing byte".into(), longer));
    let mut huge = valid.to_vec();
    huge.extend(junk(1 << 16, 4));
    v.push(("valid blob plus 64 KiB".into(), huge));
    if all_prefixes {
        for n in 1..valid.len() {
            v.push((
                format!("first {n} of {} bytes", valid.len()),
                valid[..n].to_vec(),
            ));
        }
    } else {
        for n in [1, valid.len() / 2, valid.len().saturating_sub(1)] {
            if n > 0 && n < valid.len() {
                v.push((
                    format!("first {n} of {} bytes", valid.len()),
                    valid[..n].to_vec(),
                ));
            }
        }
    }
    v
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Case 8: garbage, truncated, empty and oversized connect-info blobs make
/// `connect` return an error, never panic; the link still works afterwards.
pub fn bad_connect_info_rejected(factory: &Factory) {
    let (t0, t1) = (factory(), factory());
    let (s, r) = (desc(0), desc(1));
    let (prx, rinfo) = t1.listen(&r, &s).expect("conformance: listen");
    // Send side: every truncation of the receiver's blob, and junk.
    for (what, blob) in bad_blobs(&rinfo, true) {
        let (ptx, _) = t0.prepare_send(&s, &r).expect("conformance: prepare_send");
        let res = catch_unwind(AssertUnwindSafe(|| {
            ptx.connect(&blob, Instant::now() + WAIT).map(|_| ())
        }));
        match res {
            Err(p) => panic!(
                "conformance: send-side connect panicked on a bad receiver blob ({what}): {}",
                panic_text(&*p)
            ),
            Ok(Ok(())) => {
                panic!("conformance: send-side connect accepted a bad receiver blob ({what})")
            }
            Ok(Err(_)) => {}
        }
    }
    // Receive side: junk and truncations of a sender's blob. A short
    // deadline keeps a transport that waits before parsing from being slow.
    let (_ptx, sinfo) = t0.prepare_send(&s, &r).expect("conformance: prepare_send");
    for (what, blob) in bad_blobs(&sinfo, false) {
        let (prx_bad, _) = t1.listen(&r, &s).expect("conformance: listen");
        let start = Instant::now();
        let res = catch_unwind(AssertUnwindSafe(|| {
            prx_bad
                .connect(&blob, start + Duration::from_millis(200))
                .map(|_| ())
        }));
        match res {
            Err(p) => panic!(
                "conformance: recv-side connect panicked on a bad sender blob ({what}): {}",
                panic_text(&*p)
            ),
            Ok(Ok(())) => {
                panic!("conformance: recv-side connect accepted a bad sender blob ({what})")
            }
            Ok(Err(_)) => {}
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "conformance: recv-side connect with a bad blob ({what}) overran its deadline"
        );
    }
    // The rejected attempts left the original listener usable.
    let (ptx, sinfo) = t0.prepare_send(&s, &r).expect("conformance: prepare_send");
    let deadline = Instant::now() + WAIT;
    let mut tx = ptx
        .connect(&rinfo, deadline)
        .unwrap_or_else(|e| panic!("conformance: connect after rejected blobs failed: {e}"));
    let mut rx = prx
        .connect(&sinfo, deadline)
        .unwrap_or_else(|e| panic!("conformance: recv connect after rejected blobs failed: {e}"));
    let buf = wait_acquire(&mut *tx, "a slot after rejected blobs");
    put(&mut *tx, buf, 0, 0, 64);
    let (buf, len) = wait_peek(&mut *rx, "a message after rejected blobs");
    check_msg(&*rx, buf, len, 0, 0, 64);
    rx.release().expect("conformance: release");
}

/// Case 9: connections 0 → 1 and 1 → 0 set up together work independently,
/// one-sided and concurrently.
pub fn both_directions(factory: &Factory) {
    let (t0, t1) = (factory(), factory());
    // Phase 1 for both directions, then all send-side connects, then all
    // receive-side connects, as the runtime does.
    let (ptx01, s01, prx01, r01) = phase1(&*t0, &*t1, 0, 1);
    let (ptx10, s10, prx10, r10) = phase1(&*t1, &*t0, 1, 0);
    let deadline = Instant::now() + WAIT;
    let mut tx01 = ptx01
        .connect(&r01, deadline)
        .expect("conformance: connect 0 -> 1 (send)");
    let mut tx10 = ptx10
        .connect(&r10, deadline)
        .expect("conformance: connect 1 -> 0 (send)");
    let mut rx01 = prx01
        .connect(&s01, deadline)
        .expect("conformance: connect 0 -> 1 (recv)");
    let mut rx10 = prx10
        .connect(&s10, deadline)
        .expect("conformance: connect 1 -> 0 (recv)");
    check_channels(&*t0, &*tx01, &*rx01, 0, 1);
    check_channels(&*t1, &*tx10, &*rx10, 1, 0);

    // Filling 0 -> 1 takes nothing from 1 -> 0.
    let slots = tx01.slots();
    for i in 0..slots {
        let buf = wait_acquire(&mut *tx01, "a credit on 0 -> 1");
        put(&mut *tx01, buf, 0, i as u64, 32);
    }
    assert!(
        rx10.poll_peek().expect("conformance: poll_peek").is_none(),
        "conformance: data sent 0 -> 1 showed up on 1 -> 0"
    );
    let buf = wait_acquire(&mut *tx10, "a credit on 1 -> 0 while 0 -> 1 is full");
    put(&mut *tx10, buf, 1, 0, 48);
    let (buf, len) = wait_peek(&mut *rx10, "the message on 1 -> 0");
    check_msg(&*rx10, buf, len, 1, 0, 48);
    rx10.release().expect("conformance: release");
    for i in 0..slots {
        let (buf, len) = wait_peek(&mut *rx01, "a message on 0 -> 1");
        check_msg(&*rx01, buf, len, 0, i as u64, 32);
        rx01.release().expect("conformance: release");
    }
    wait_drained(&mut *tx01);
    wait_drained(&mut *tx10);

    // Both directions at once, one thread per rank.
    const N: u64 = 3000;
    let deadline = Instant::now() + STRESS_WAIT;
    let stop = Arc::new(AtomicBool::new(false));
    let rank =
        |tx: Box<dyn SendChannel>, rx: Box<dyn RecvChannel>, me: u32, stop: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                run_flagged(&stop, || {
                    let st = stop.clone();
                    let other = 1 - me;
                    let sender = std::thread::spawn(move || {
                        run_flagged(&st, || stress_sender(tx, me, N, deadline, &st))
                    });
                    let r = stress_receiver(rx, other, N, deadline, &stop);
                    let s = sender
                        .join()
                        .map_err(|_| "sender thread panicked".to_string())?;
                    s.map_err(|e| format!("rank {me} sending: {e}"))?;
                    r.map_err(|e| format!("rank {me} receiving: {e}"))?;
                    Ok(())
                })
            })
        };
    let h0 = rank(tx01, rx10, 0, stop.clone());
    let h1 = rank(tx10, rx01, 1, stop.clone());
    let r0 = h0.join().expect("rank 0 thread");
    let r1 = h1.join().expect("rank 1 thread");
    if r0.is_err() || r1.is_err() {
        panic!("conformance: both directions at once failed: rank 0: {r0:?}; rank 1: {r1:?}");
    }
}

/// Case 10: `commit` of more than `slot_bytes` is an error, not a panic or a
/// delivered message; the link keeps working.
pub fn oversized_commit_rejected(factory: &Factory) {
    let (mut tx, mut rx) = fresh_pair(factory);
    let sb = tx.slot_bytes();
    let _ = wait_acquire(&mut *tx, "a free slot");
    let res = catch_unwind(AssertUnwindSafe(|| tx.commit(sb + 1)));
    match res {
        Err(p) => panic!(
            "conformance: commit(slot_bytes + 1) panicked: {}",
            panic_text(&*p)
        ),
        Ok(Ok(())) => panic!("conformance: commit(slot_bytes + 1) was accepted"),
        Ok(Err(_)) => {}
    }
    assert!(
        rx.poll_peek().expect("conformance: poll_peek").is_none(),
        "conformance: a rejected commit delivered a message"
    );
    let buf = wait_acquire(&mut *tx, "a slot after the rejected commit");
    put(&mut *tx, buf, 0, 0, sb);
    let (buf, len) = wait_peek(&mut *rx, "the message after the rejected commit");
    check_msg(&*rx, buf, len, 0, 0, sb);
    rx.release().expect("conformance: release");
    wait_drained(&mut *tx);
}

/// Case 11: direct (single-copy) transfers, where the transport offers them:
/// a reference to a buffer larger than a slot arrives as
/// [`Incoming::Remote`](braid_core::transport::Incoming::Remote), reads back exactly, and `poll_drained` turns true
/// only after the receiver released it. A transport without them
/// (`SendChannel::direct` is `None`) keeps working with ordinary slots.
pub fn direct_transfers_when_offered(factory: &Factory) {
    use braid_core::transport::Incoming;
    let (mut tx, mut rx) = fresh_pair(factory);
    let len = tx.slot_bytes() * 3 + 7;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    let _ = wait_for("a free slot", Duration::from_secs(10), || {
        tx.poll_acquire().unwrap()
    });
    if tx.direct().is_none() {
        // Without the capability nothing can be sent by reference (the
        // type says so); the link works with ordinary slots.
        tx.commit(1)
            .expect("a link without single copy commits ordinary slots");
        let got = wait_for("the inline slot", Duration::from_secs(10), || {
            rx.poll_peek_any().unwrap()
        });
        assert!(matches!(got, Incoming::Inline(_, 1)), "got {got:?}");
        rx.release().unwrap();
        return;
    }
    let d = tx.direct().expect("checked above");
    // SAFETY: `data` stays alive and unchanged until poll_drained below.
    unsafe { d.commit_direct(data.as_ptr(), len) }.expect("commit_direct");
    assert!(
        !tx.poll_drained().unwrap(),
        "drained before the receiver read"
    );
    let got = wait_for("the direct slot", Duration::from_secs(10), || {
        rx.poll_peek_any().unwrap()
    });
    match got {
        Incoming::Remote(l) => assert_eq!(l, len, "direct length"),
        other => panic!("expected a remote slot, got {other:?}"),
    }
    let mut out = vec![0u8; len];
    let r = rx
        .direct()
        .expect("a receiver that reports remote slots must read them (RecvChannel::direct)");
    // SAFETY: `out` holds `len` writable bytes.
    unsafe { r.read_remote(out.as_mut_ptr(), len) }.expect("read_remote");
    assert!(out == data, "direct transfer corrupted the data");
    assert!(!tx.poll_drained().unwrap(), "drained before release");
    rx.release().unwrap();
    wait_for("drain", Duration::from_secs(10), || {
        tx.poll_drained().unwrap().then_some(())
    });
    // The FIFO keeps working inline afterwards.
    let slot = wait_for("a free slot", Duration::from_secs(10), || {
        tx.poll_acquire().unwrap()
    });
    if braid_core::types::MemKind::Host == tx.mem_kind() {
        // SAFETY: host slot of at least one byte.
        unsafe { slot.ptr.write(42) };
    }
    tx.commit(1).unwrap();
    let got = wait_for("the inline slot", Duration::from_secs(10), || {
        rx.poll_peek_any().unwrap()
    });
    assert!(matches!(got, Incoming::Inline(_, 1)), "got {got:?}");
    rx.release().unwrap();
}

/// Writes message `seq` of `len` bytes into a buffer from
/// `poll_acquire_small(len)` and commits it.
fn put_small(tx: &mut dyn SendChannel, buf: SlotBuf, seq: u64, len: usize) {
    assert!(
        (len..=tx.slot_bytes()).contains(&buf.cap),
        "conformance: poll_acquire_small({len}) returned a {}-byte buffer",
        buf.cap
    );
    assert_eq!(
        buf.ptr as usize % 64,
        0,
        "conformance: small buffer not 64-byte aligned"
    );
    if tx.mem_kind() == MemKind::Host {
        let mut data = vec![0u8; len];
        fill(0, seq, &mut data);
        write_slot(buf, &data);
    }
    tx.commit(len).unwrap_or_else(|e| {
        panic!("conformance: commit({len}) of small message {seq} failed: {e}")
    });
}

/// Case 12: `poll_acquire_small`. A sender of small messages (0 to 112
/// bytes, what a transport may carry outside its slots) takes every credit
/// it is granted without a release (at least `slots`), and then an
/// ordinary `poll_acquire` grants nothing: small messages never let a
/// sender overrun the slots. They all arrive in order and intact. Then
/// small and ordinary acquisitions, mixed (small ones also of 113 and 200
/// bytes, which a transport must serve like ordinary ones), over many
/// more messages than slots and than 256 (where the shm transport's
/// boxes wrap), arrive in order and intact. Last, small messages committed
/// shorter than asked for, each asked for twice before its commit (the
/// same buffer both times).
pub fn small_acquisitions(factory: &Factory) {
    let (mut tx, mut rx) = fresh_pair(factory);
    let slots = tx.slots();
    let sb = tx.slot_bytes();
    let small = [8usize, 40, 48, 0, 96, 112];
    let mut sent = 0u64;
    loop {
        let len = small[sent as usize % small.len()];
        let buf = if (sent as usize) < slots {
            wait_for(
                &format!("small credit {sent} of {slots} on a fresh link"),
                WAIT,
                || {
                    tx.poll_acquire_small(len)
                        .expect("conformance: poll_acquire_small")
                },
            )
        } else {
            match tx
                .poll_acquire_small(len)
                .expect("conformance: poll_acquire_small")
            {
                Some(b) => b,
                None => break,
            }
        };
        put_small(&mut *tx, buf, sent, len);
        sent += 1;
        assert!(
            sent <= 1 << 16,
            "conformance: {sent} small messages committed without a release"
        );
    }
    assert!(
        tx.poll_acquire().expect("conformance: poll_acquire").is_none(),
        "conformance: poll_acquire returned a slot with {sent} messages outstanding ({slots} slots)"
    );
    for seq in 0..sent {
        let (buf, len) = wait_peek(&mut *rx, &format!("small message {seq} of {sent}"));
        check_msg(&*rx, buf, len, 0, seq, small[seq as usize % small.len()]);
        rx.release().expect("conformance: release");
    }
    wait_drained(&mut *tx);

    // Mixed: (length, acquired with poll_acquire_small).
    let kinds = [
        (0, true),
        (8, true),
        (sb, false),
        (48, true),
        (49, true),
        (40, false),
        (200, true),
        (112, true),
        (113, true),
        (1, true),
        (sb - 1, false),
    ];
    let n = sent + (10 * slots).max(600) as u64;
    let first = sent;
    let kind = |seq: u64| kinds[((seq - first) % kinds.len() as u64) as usize];
    let deadline = Instant::now() + WAIT;
    let (mut got, mut round) = (first, 0u64);
    while got < n {
        assert!(
            Instant::now() < deadline,
            "conformance: mixed delivery stuck: {sent} sent, {got} received of {n}"
        );
        while sent < n {
            let (len, small) = kind(sent);
            let buf = if small {
                tx.poll_acquire_small(len)
            } else {
                tx.poll_acquire()
            }
            .expect("conformance: poll_acquire(_small)");
            let Some(buf) = buf else {
                break;
            };
            if small {
                put_small(&mut *tx, buf, sent, len);
            } else {
                put(&mut *tx, buf, 0, sent, len);
            }
            sent += 1;
        }
        let budget = 1 + round % (2 * slots as u64 + 3);
        round += 1;
        receive_some(&mut *rx, budget, &mut got, sent, |seq| kind(seq).0);
    }
    wait_drained(&mut *tx);

    // Committed shorter than asked for (the contract's "at most `len`"),
    // across the sizes where a transport may place small messages
    // differently (the shm transport: 48 and 112 bytes), each asked for
    // twice before its commit.
    for (asked, committed) in [
        (100, 20),
        (112, 112),
        (64, 49),
        (49, 48),
        (200, 40),
        (48, 0),
    ] {
        let seq = sent;
        let what = format!("a credit for small message {seq} ({asked} bytes asked)");
        let first = wait_for(&what, WAIT, || {
            tx.poll_acquire_small(asked)
                .expect("conformance: poll_acquire_small")
        });
        let buf = tx
            .poll_acquire_small(asked)
            .expect("conformance: poll_acquire_small")
            .unwrap_or_else(|| panic!("conformance: {what}: granted, then withdrawn"));
        assert_eq!(
            (buf.ptr, buf.cap),
            (first.ptr, first.cap),
            "conformance: poll_acquire_small({asked}) asked twice before the commit returned another buffer"
        );
        put_small(&mut *tx, buf, seq, committed);
        sent += 1;
        let (got, len) = wait_peek(&mut *rx, &format!("small message {seq}"));
        check_msg(&*rx, got, len, 0, seq, committed);
        rx.release().expect("conformance: release");
    }
    wait_drained(&mut *tx);
}

/// Case 13: a receiver that consumed every message and is dropped at once
/// leaves its sender drained, not failed: `poll_drained` turns true (the
/// last credits count even when the close comes right behind them, as when
/// a rank finishes a collective and tears its links down).
pub fn drained_after_peer_closes(factory: &Factory) {
    let (mut tx, mut rx) = fresh_pair(factory);
    let slots = tx.slots();
    for round in 0..2u64 {
        for i in 0..slots as u64 {
            let buf = wait_acquire(&mut *tx, "a credit");
            put(&mut *tx, buf, 0, round * slots as u64 + i, 40);
        }
        if round == 0 {
            for i in 0..slots as u64 {
                let (buf, len) = wait_peek(&mut *rx, "a message");
                check_msg(&*rx, buf, len, 0, i, 40);
                rx.release().expect("conformance: release");
            }
            wait_drained(&mut *tx);
        }
    }
    // The second round: received and released, then the receiver is
    // dropped before the sender looks again.
    for i in 0..slots as u64 {
        let (buf, len) = wait_peek(&mut *rx, "a message");
        check_msg(&*rx, buf, len, 0, slots as u64 + i, 40);
        rx.release().expect("conformance: release");
    }
    drop(rx);
    wait_for(
        "the sender to see every slot released after the receiver closed",
        WAIT,
        || {
            tx.poll_drained()
                .unwrap_or_else(|e| {
                    panic!(
                        "conformance: poll_drained failed although the receiver released every \
                     message before it closed: {e}"
                    )
                })
                .then_some(())
        },
    );
}

/// Sleeps on `word` (armed on an end of a live channel) until it is rung,
/// failing the case if it is not rung within [`WAIT`].
fn sleep_until_rung(word: WakeWord, what: &str) {
    let t0 = Instant::now();
    loop {
        // SAFETY: the caller keeps the armed end alive during the call.
        let r = unsafe { sleep_any(&[word], Duration::from_millis(100)) };
        if r != Woken::TimedOut {
            return;
        }
        assert!(
            t0.elapsed() < WAIT,
            "conformance: an end armed with arm_wake was not woken by {what} within {WAIT:?}"
        );
    }
}

/// Case 14: an end that has a doorbell ([`SendChannel::arm_wake`]) is woken
/// by what it waits for — the receiver by a commit and by the sender's
/// abort, the sender by a release — when it armed before its last poll and
/// sleeps after; and a change made between the arm and the sleep is not
/// lost. Ends without a doorbell (`None`) pass: the engine polls them.
pub fn sleepers_are_woken(factory: &Factory) {
    let (mut tx, mut rx) = fresh_pair(factory);
    // A commit made between the arm and the sleep: the sleep ends at once.
    if let Some(w) = rx.arm_wake() {
        let buf = wait_acquire(&mut *tx, "a credit");
        put(&mut *tx, buf, 0, 0, 40);
        sleep_until_rung(w, "a commit made after the arm");
        rx.disarm_wake();
        let (buf, len) = wait_peek(&mut *rx, "the message");
        check_msg(&*rx, buf, len, 0, 0, 40);
        rx.release().expect("conformance: release");
    }
    // The receiver asleep, the sender commits from another thread.
    if let Some(w) = rx.arm_wake() {
        assert!(
            rx.poll_peek().expect("conformance: poll_peek").is_none(),
            "conformance: a message nobody sent"
        );
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let buf = wait_acquire(&mut *tx, "a credit");
            put(&mut *tx, buf, 0, 1, 40);
            tx
        });
        sleep_until_rung(w, "the sender's commit");
        rx.disarm_wake();
        tx = sender.join().expect("conformance: sender thread");
        let (buf, len) = wait_peek(&mut *rx, "the message");
        check_msg(&*rx, buf, len, 0, 1, 40);
        rx.release().expect("conformance: release");
    }
    // The sender asleep without credit, the receiver releases.
    let slots = tx.slots() as u64;
    for i in 0..slots {
        let buf = wait_acquire(&mut *tx, "a credit");
        put(&mut *tx, buf, 0, 2 + i, 40);
    }
    if let Some(w) = tx.arm_wake() {
        // Still full: the sender has nothing to do but sleep.
        let full = tx
            .poll_acquire()
            .expect("conformance: poll_acquire")
            .is_none();
        let receiver = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let (buf, len) = wait_peek(&mut *rx, "a message");
            check_msg(&*rx, buf, len, 0, 2, 40);
            rx.release().expect("conformance: release");
            rx
        });
        if full {
            sleep_until_rung(w, "the receiver's release");
        }
        tx.disarm_wake();
        rx = receiver.join().expect("conformance: receiver thread");
        wait_acquire(&mut *tx, "the released slot");
        for i in 1..slots {
            let (buf, len) = wait_peek(&mut *rx, "a message");
            check_msg(&*rx, buf, len, 0, 2 + i, 40);
            rx.release().expect("conformance: release");
        }
    }
    // The receiver asleep, the sender aborts.
    if let Some(w) = rx.arm_wake() {
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            tx.abort("conformance: abort while the peer sleeps");
            tx
        });
        sleep_until_rung(w, "the sender's abort");
        rx.disarm_wake();
        let _tx = aborter.join().expect("conformance: aborting thread");
        wait_for("the receiver to see the abort", WAIT, || {
            rx.check_peer().err()
        });
    }
}

/// Expands to one `#[test]` per conformance case for the transport made by
/// `$factory` (a non-capturing closure or fn returning a `Transport` or a
/// `Box<dyn Transport>`). Use once per module. For hardware that may be
/// absent, `transport_conformance_tests!(if ready, factory)` first calls
/// `ready` (a closure returning `bool`, which says why when it returns
/// false) and passes each case that it turns down.
#[macro_export]
macro_rules! transport_conformance_tests {
    (@cases $($test:ident => $case:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                if !__braid_conformance_ready() {
                    return;
                }
                $crate::$case(&__braid_conformance_factory)
            }
        )*
    };
    (if $ready:expr, $factory:expr) => {
        fn __braid_conformance_ready() -> bool {
            ($ready)()
        }
        fn __braid_conformance_factory() -> ::std::boxed::Box<dyn ::braid_core::transport::Transport> {
            $crate::IntoTransport::into_transport(($factory)())
        }
        $crate::transport_conformance_tests!(@cases
            conformance_ordered_delivery => ordered_delivery,
            conformance_credits => credits,
            conformance_repeated_polls_return_same_slot => repeated_polls_return_same_slot,
            conformance_concurrent_stress => concurrent_stress,
            conformance_abort_is_seen_by_peer => abort_is_seen_by_peer,
            conformance_kept_links_resume => kept_links_resume,
            conformance_drop_is_seen_by_peer => drop_is_seen_by_peer,
            conformance_recv_connect_times_out => recv_connect_times_out,
            conformance_bad_connect_info_rejected => bad_connect_info_rejected,
            conformance_both_directions => both_directions,
            conformance_oversized_commit_rejected => oversized_commit_rejected,
            conformance_direct_transfers_when_offered => direct_transfers_when_offered,
            conformance_small_acquisitions => small_acquisitions,
            conformance_drained_after_peer_closes => drained_after_peer_closes,
            conformance_sleepers_are_woken => sleepers_are_woken,
        );
    };
    ($factory:expr) => {
        $crate::transport_conformance_tests!(if || true, $factory);
    };
}

//! A receiving end's stream readers over plain bytes, for the fuzz targets
//! in `fuzz/` (only with the `fuzzing` feature). Not part of the API.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::ctrl::{check_credit, ctrl_reader, OnCredit};
use super::health::Health;
use super::lock;
use super::recv::{reader, Fill, Hand, RecvShared};
use crate::sys::SlotMem;

/// Runs a receiving end's data-socket readers, one after the other,
/// over `streams` (one per data socket, in index order), with `slots`
/// slots of `slot_bytes` and no slot released by the engine. Returns the
/// messages published, `(seq, bytes)` by slot, and the failure reported.
#[allow(clippy::type_complexity)]
pub fn data_streams(
    streams: &[&[u8]],
    slot_bytes: usize,
    slots: usize,
) -> std::result::Result<(Vec<(u64, Vec<u8>)>, Option<String>), String> {
    let nsocks = streams.len();
    crate::info::check_geometry(slot_bytes, slots, nsocks)?;
    let sh = Arc::new(RecvShared {
        mem: SlotMem::new(slot_bytes, slots)?,
        slots,
        nsocks,
        slot_bytes,
        ready: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        lens: (0..slots).map(|_| AtomicUsize::new(0)).collect(),
        remote: (0..slots).map(|_| AtomicBool::new(false)).collect(),
        fill: (0..slots).map(|_| Mutex::new(Fill::default())).collect(),
        hands: (0..nsocks).map(|_| Hand::default()).collect(),
        accept_direct: false,
        released: AtomicU64::new(0),
        readers_done: AtomicUsize::new(0),
    });
    let health = Health::new(0);
    // No control socket here: nobody to wait for at the end.
    health.ctrl_finished();
    for (idx, stream) in streams.iter().enumerate() {
        reader(io::Cursor::new(*stream), sh.clone(), health.clone(), idx);
    }
    let mut out = Vec::new();
    for slot in 0..slots {
        let r = sh.ready[slot].load(Ordering::Acquire);
        if r != 0 {
            let len = sh.lens[slot].load(Ordering::Relaxed);
            // SAFETY: every reader has returned; nothing else touches
            // the slot memory.
            let b = unsafe { sh.mem.slice(slot, 0, len) };
            out.push((r - 1, b.to_vec()));
        }
    }
    Ok((out, health.error().map(|e| e.to_string())))
}

/// Runs a control-socket reader over `stream`: a sender's (credits are
/// checked against `committed` slots) or, with `None`, a receiver's.
/// Returns the credits accepted, whether the peer closed, and the
/// failure reported.
pub fn ctrl_stream(stream: &[u8], committed: Option<u64>) -> (Vec<u64>, bool, Option<String>) {
    let health = Health::new(0);
    let credits = Arc::new(Mutex::new(Vec::new()));
    let on_credit: Option<OnCredit> = committed.map(|c| {
        let credits = credits.clone();
        Box::new(move |v: u64| {
            let mut got = lock(&credits);
            check_credit(v, got.last().copied().unwrap_or(0), c)?;
            got.push(v);
            Ok(())
        }) as OnCredit
    });
    ctrl_reader(
        io::Cursor::new(stream),
        health.clone(),
        on_credit,
        committed.is_some(),
    );
    let got = lock(&credits).clone();
    (
        got,
        health.peer_closed.load(Ordering::Acquire),
        health.error().map(|e| e.to_string()),
    )
}

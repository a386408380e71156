//! A receiving end's stream readers over plain bytes, for the fuzz targets
//! in `fuzz/` (only with the `fuzzing` feature). Not part of the API.

use std::io::{self, Read};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::ctrl::{check_credit, CtrlIn};
use super::health::Health;
use super::lock;
use super::recv::{RecvShared, Rx};
use crate::sys::SlotMem;

/// Bytes handed to a reader per call, cycling, as a socket delivers them in
/// pieces (with "would block" between them).
const CHUNKS: [usize; 5] = [1, 7, 4096, 24, 100_000];

/// A reader over `stream` that says `WouldBlock` after every chunk and the
/// end of the stream after the last byte.
fn chunked(stream: &[u8]) -> impl FnMut(&mut [u8]) -> io::Result<usize> + '_ {
    let mut cur = io::Cursor::new(stream);
    let mut i = 0usize;
    let mut blocked = false;
    move |b: &mut [u8]| {
        if blocked {
            blocked = false;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        blocked = true;
        let k = CHUNKS[i % CHUNKS.len()].min(b.len());
        i += 1;
        cur.read(&mut b[..k])
    }
}

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
    let health = Health::new(0);
    // No control socket here: nobody to wait for at the end.
    health.ctrl_finished();
    let sh = RecvShared::new(
        SlotMem::new(slot_bytes, slots)?,
        slot_bytes,
        slots,
        nsocks,
        false,
        health.clone(),
    );
    for (idx, stream) in streams.iter().enumerate() {
        let mut rx = Rx::default();
        let mut read = chunked(stream);
        // Until the stream ends (or fails): each call reads what one
        // readable edge would.
        for _ in 0..=2 * stream.len() + 2 {
            rx.pump(idx, &sh, &mut read);
        }
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
    let credits = Arc::new(Mutex::new(Vec::<u64>::new()));
    let mut input = CtrlIn::default();
    let mut read = chunked(stream);
    let mut on_credit = |v: u64| {
        let mut got = lock(&credits);
        check_credit(v, got.last().copied().unwrap_or(0), committed.unwrap_or(0))?;
        got.push(v);
        Ok(())
    };
    for _ in 0..=2 * stream.len() + 2 {
        if input.done() {
            break;
        }
        let cb: Option<&mut dyn FnMut(u64) -> std::result::Result<(), String>> =
            if committed.is_some() {
                Some(&mut on_credit)
            } else {
                None
            };
        input.pump(&mut read, &health, cb, committed.is_some());
    }
    let got = lock(&credits).clone();
    (
        got,
        health.peer_closed.load(Ordering::Acquire),
        health.error().map(|e| e.to_string()),
    )
}

//! The channel ends of a connected segment ([`ShmSend`] in `link/send.rs`,
//! [`ShmRecv`] in `link/recv.rs`) and what they share: the length word's
//! flags, the words of a direct slot, the claim word of a shared direct
//! transfer, and the abort and liveness checks. The protocol is described
//! in the crate docs.

use std::sync::atomic::Ordering;

use braid_core::error::{CoreError, Result};

use crate::probe::process_alive;
use crate::segment::{self, SegError, Side};
use crate::NAME;

mod recv;
mod send;

pub(crate) use recv::ShmRecv;
pub(crate) use send::ShmSend;

/// Marks a slot length word whose slot holds the sender-side address of the
/// payload (a direct transfer) instead of the payload.
const DIRECT_FLAG: u64 = 1 << 63;
/// Length-word flag: the payload is in the slot's box, not in the slot
/// (messages of at most [`segment::INLINE_BYTES`]).
const INLINE_FLAG: u64 = 1 << 62;

/// Word of a direct slot holding the payload's address in the sender's
/// memory (written by the sender).
const ADDR_WORD: usize = 0;
/// Word of a direct slot holding the receiver's destination address while
/// it shares the transfer (written by the receiver).
const DST_WORD: usize = 1;
/// Word of a direct slot holding the chunk size of a shared transfer
/// (written by the receiver).
const CHUNK_WORD: usize = 2;
/// First of the four words of a direct slot that name the registered host
/// buffer the piece lies in (inode, descriptor, base, size; inode 0: none;
/// see [`crate::HostBuffer`]). Words 1 and 2 are the receiver's (help
/// offers).
const REGION_WORD: usize = 4;

/// A shared direct transfer is cut into at most this many chunks.
const HELP_CHUNKS_MAX: usize = 64;
/// Transfers of fewer chunks are not shared: side by side, sharing 512 KiB
/// pieces in two chunks made a 1 MiB AllGather on 2 ranks 10% slower (20.7
/// against 22.7 µs; two system calls instead of one, and the offer), while
/// Broadcast's 1 MiB pieces (four chunks) gain from it.
const HELP_CHUNKS_MIN: usize = 4;

/// How the receiver cuts a shared direct transfer of `len` bytes with
/// chunks of at least `min`: (chunk bytes, chunks). The chunk size travels
/// in the slot, so only the receiver decides it.
fn help_split(len: usize, min: usize) -> (usize, usize) {
    let chunk = len
        .div_ceil(HELP_CHUNKS_MAX)
        .next_multiple_of(4096)
        .max(min);
    (chunk, len.div_ceil(chunk))
}

/// The claim word of [`segment::Help`]. Chunks `front..back` are
/// unclaimed: the receiver claims from the front, the sender from the back.
/// Generations (22 bits, never 0 for an offer) only need to differ between
/// offers the sender can confuse: at most `slots` offers happen while the
/// sender is inside one `poll_help`, since each needs a slot it committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Claim {
    generation: u32,
    /// Box index of the offered message (10 bits: at most `MAX_SLOTS`,
    /// 1024, boxes).
    slot: usize,
    /// First unclaimed chunk (16 bits: at most [`HELP_CHUNKS_MAX`] chunks).
    front: u32,
    /// One past the last unclaimed chunk.
    back: u32,
}

impl Claim {
    fn pack(self) -> u64 {
        (u64::from(self.generation) & 0x3f_ffff) << 42
            | ((self.slot as u64) & 0x3ff) << 32
            | u64::from(self.front & 0xffff) << 16
            | u64::from(self.back & 0xffff)
    }

    fn unpack(w: u64) -> Claim {
        Claim {
            generation: (w >> 42) as u32,
            slot: ((w >> 32) & 0x3ff) as usize,
            front: ((w >> 16) & 0xffff) as u32,
            back: (w & 0xffff) as u32,
        }
    }
}

/// The slot after `i` of a ring of `slots`.
#[inline]
fn next_slot(i: usize, slots: u64) -> usize {
    if i as u64 + 1 == slots {
        0
    } else {
        i + 1
    }
}

fn peer_err(peer: u32, what: String) -> CoreError {
    CoreError::Peer {
        transport: NAME,
        peer,
        what,
        source: None,
    }
}

/// A segment error while talking to `peer`.
pub(crate) fn seg_err(peer: u32, doing: &str, e: SegError) -> CoreError {
    peer_err(peer, format!("{doing}: {e}"))
}

/// A protocol violation by `peer`.
pub(crate) fn protocol(peer: u32, detail: String) -> CoreError {
    CoreError::Protocol { peer, detail }
}

/// Reads a side's abort reason, if it aborted.
fn abort_reason(side: &Side) -> Option<String> {
    match side.abort.load(Ordering::Acquire) {
        segment::ABORT_NONE => None,
        segment::ABORT_SET => {
            let n = (side.reason_len.load(Ordering::Relaxed) as usize).min(segment::REASON_BYTES);
            let bytes: Vec<u8> = side.reason[..n]
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect();
            Some(String::from_utf8_lossy(&bytes).into_owned())
        }
        _ => Some("aborted (no reason given yet)".into()),
    }
}

/// Publishes this side's abort with `reason` (first call wins).
fn publish_abort(side: &Side, reason: &str) {
    if side
        .abort
        .compare_exchange(
            segment::ABORT_NONE,
            segment::ABORT_WRITING,
            Ordering::Relaxed,
            Ordering::Relaxed,
        )
        .is_err()
    {
        return;
    }
    let mut n = reason.len().min(segment::REASON_BYTES);
    while !reason.is_char_boundary(n) {
        n -= 1;
    }
    for (dst, src) in side.reason.iter().zip(&reason.as_bytes()[..n]) {
        dst.store(*src, Ordering::Relaxed);
    }
    side.reason_len.store(n as u32, Ordering::Relaxed);
    // Release: a reader that sees ABORT_SET (Acquire) sees the reason.
    side.abort.store(segment::ABORT_SET, Ordering::Release);
}

/// Takes back this side's abort when the link goes on in a new
/// communicator (both ends are between operations).
fn clear_abort(side: &Side) {
    side.reason_len.store(0, Ordering::Relaxed);
    // Release: pairs with the peer's Acquire load in `abort_reason`.
    side.abort.store(segment::ABORT_NONE, Ordering::Release);
}

/// Whether the process at the other end can still take part in a kept
/// link: alive, and its end not closed.
fn peer_stays(peer_side: &Side, peer_pid: u32) -> bool {
    peer_side.closed.load(Ordering::Acquire) == 0 && process_alive(peer_pid).is_ok()
}

/// The checks both ends share: peer abort, then peer process liveness.
pub(crate) fn check_abort_and_process(peer_side: &Side, peer: u32, peer_pid: u32) -> Result<()> {
    if let Some(reason) = abort_reason(peer_side) {
        return Err(CoreError::PeerAborted {
            transport: NAME,
            peer,
            reason,
        });
    }
    process_alive(peer_pid).map_err(|what| match abort_reason(peer_side) {
        // It aborted and exited between the two checks: the abort is the cause.
        Some(reason) => CoreError::PeerAborted {
            transport: NAME,
            peer,
            reason,
        },
        None => peer_err(peer, what),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_words_round_trip_and_split_transfers() {
        for c in [
            Claim {
                generation: 1,
                slot: 0,
                front: 0,
                back: 64,
            },
            Claim {
                generation: 0x3f_ffff,
                slot: 1023,
                front: 63,
                back: 64,
            },
            Claim {
                generation: 77,
                slot: 5,
                front: 0,
                back: 0,
            },
        ] {
            assert_eq!(Claim::unpack(c.pack()), c);
        }
        assert_eq!(Claim::unpack(0).generation, 0);
        // Chunks of at least `min`, at most 64 of them, 4 KiB multiples.
        assert_eq!(help_split(2 << 20, 256 << 10), (256 << 10, 8));
        assert_eq!(help_split(256 << 10, 256 << 10), (256 << 10, 1));
        assert_eq!(help_split((64 << 20) + 1, 256 << 10), (1028 << 10, 64));
        assert_eq!(help_split(64 << 10, 4096), (4096, 16));
        assert_eq!(help_split(5000, 4096), (4096, 2));
    }
}

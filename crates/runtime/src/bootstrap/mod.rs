//! Bootstrap: the rendezvous of all ranks through a root over TCP.
//!
//! A [`UniqueId`] is the root's address plus a random 128-bit secret. One
//! process (usually rank 0) hosts a [`RootServer`]; every rank, rank 0
//! included, joins with the same id, its rank, the number of ranks and a
//! payload (typically its connect-info blob) through
//! `Bootstrap::connect_abortable`. Once all ranks have joined, the root
//! gives each the address of its successor; the ranks connect into a ring
//! and all-gather round it — the first round carries the payloads (every
//! rank gets them in rank order), later rounds ([`Bootstrap::allgather`],
//! [`Bootstrap::barrier`]) too. The root only hears that a rank starts a
//! round, so that it can name ranks that are late or leave; two ranks
//! exchange messages point to point without a round (links connecting on
//! first use).
//!
//! # Files
//!
//! - `id.rs`: the [`UniqueId`] and the OS randomness;
//! - `wire.rs`: frames, their encoders and decoders, the proofs (MACs);
//! - `rendezvous.rs`: the root as a pure state machine (no sockets, no
//!   clock), tested in memory by `sim.rs`;
//! - `io.rs`: the driver that feeds it from real sockets (poll, accept,
//!   read, write, closing gently);
//! - `root.rs`: [`RootServer`], the root's thread and its handle;
//! - `client.rs`: [`Bootstrap`], a rank's side; `peer.rs`, its listener,
//!   ring and point-to-point exchanges over sockets, driving three pure
//!   machines tested in memory by `rank_sim.rs`: `ring.rs` (the rounds on
//!   the ring, and which rank a stuck round names), `exchange.rs` (a
//!   point-to-point exchange with a few ranks, and which rank a failed one
//!   names) and `door.rs` (the listener under load: pausing a failing
//!   `accept`, making room; what a connection is by its first frame);
//! - `warnings.rs`: the machines' rate-limited warnings, whose left-out
//!   counts are said within a second;
//! - descriptors: the first bootstrap in a process raises its soft limit
//!   of open files toward the hard one ([`fd_limit`]); a root holds at most
//!   a quarter of the limit in unproven connections and refuses any that
//!   would leave less than a quarter free for the ranks (`hostile_tests.rs`
//!   floods one in a process allowed 512);
//! - `fuzzing.rs`: the decoders over plain bytes for `fuzz/` (feature
//!   `internals`).
//!
//! # Protocol (version 3)
//!
//! Every message is a frame: a little-endian `u32` length `n` (at most
//! [`wire::MAX_FRAME`]), then `n` bytes: one kind byte and the body.
//! Integers are little-endian.
//!
//! With the root:
//!
//! 1. root → client `CHALLENGE`: magic, protocol version, 32-byte nonce.
//! 2. client → root `HELLO`: magic, version, rank, nranks, the client's
//!    nonce, `SHA-256("braid-bootstrap-client" ‖ secret ‖ root nonce ‖
//!    client nonce ‖ rank ‖ nranks)`, payload (the rank's listening
//!    address). The secret itself never travels.
//! 3. root → client `ACCEPT` with `SHA-256("braid-bootstrap-root" ‖ secret ‖
//!    client nonce ‖ root nonce ‖ rank)`, so the client knows the root holds
//!    the secret too; or `ERROR` with a message.
//! 4. root → client `RING` (the successor's address) once all ranks joined.
//! 5. client → root `CONTRIB` (round, no data) when the rank starts a round
//!    after the first; root → clients `LEFT` when a rank left after its last
//!    round (rounds under way still complete).
//!
//! Between ranks (each frame carries a proof of the secret, `PeerFrame`):
//! `RING_HELLO` opens the connection to the successor, `DATA` frames (round,
//! rank, bytes) go round the ring; `XCHG`/`XREPLY` are a point-to-point
//! exchange (the lower rank connects); `PROBE` checks that a listener is
//! still there.
//!
//! The root sends an `ERROR` frame to every connected rank before it gives
//! up (ranks that disagree on nranks, a rank that joined twice, ranks missing
//! at the deadline, a rank that left), and delivers it (within a short
//! linger) before its thread ends or its [`RootServer`] is dropped, so no
//! rank waits for nothing or gets a bare "connection closed". Connections
//! that fail the handshake (garbage, oversized frames, a wrong secret) are
//! closed and logged (at most one warning per cause per second); they never
//! count as ranks. Connections that do not prove the secret within
//! [`rendezvous::HANDSHAKE_TIMEOUT`] are closed, and when
//! [`rendezvous::MAX_PENDING`] of them are held the oldest makes room for a
//! new one; a rank whose connection is closed before it was accepted
//! connects again, within its own deadline.
//!
//! Every wait has a deadline: the `timeout` given to [`RootServer::spawn`]
//! and [`Bootstrap::connect_abortable`] (communicator creation's way in;
//! `Bootstrap::connect`, the same without an abort flag, is the tests').
//! Between rounds the root waits without a deadline (the ranks may compute
//! for as long as they like); it ends as soon as a rank disconnects.

use std::time::{Duration, Instant};

use nix::poll::PollTimeout;

mod client;
mod door;
mod exchange;
#[cfg(feature = "internals")]
pub mod fuzzing;
#[cfg(test)]
mod hostile_tests;
mod id;
mod io;
mod peer;
#[cfg(test)]
mod rank_sim;
mod rendezvous;
mod ring;
mod root;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
mod warnings;
mod wire;

pub(crate) use client::Bootstrap;
pub(crate) use exchange::{Ask, ExchangeError};
pub(crate) use id::parse_secret_hex;
pub use id::UniqueId;
pub use root::RootServer;
pub(crate) use root::{create_unique_id, create_unique_id_with_timeout};
pub(crate) use wire::ct_eq;

/// Timeouts are capped at a year so that deadlines never overflow.
pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The most the soft limit of open files is raised to at the start.
const FD_LIMIT_RAISE: u64 = 1 << 16;

/// This process's limit of open files. The first call raises the soft
/// limit toward the hard one (to at most 65,536), as servers do: the
/// usual soft limit of 1,024 is what a flood of connections to a root
/// exhausts first.
pub(crate) fn fd_limit() -> u64 {
    static RAISED: std::sync::Once = std::sync::Once::new();
    let get = || {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the limits into `r`, a valid rlimit.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
        ok.then_some(r)
    };
    RAISED.call_once(|| {
        if let Some(mut r) = get() {
            let want = r.rlim_max.min(FD_LIMIT_RAISE);
            if r.rlim_cur < want {
                let was = r.rlim_cur;
                r.rlim_cur = want;
                // SAFETY: setrlimit reads `r`, a valid rlimit; raising the
                // soft limit up to the hard one only lets us open more.
                if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } == 0 {
                    tracing::debug!("braid: raised the open-file limit from {was} to {want}");
                }
            }
        }
    });
    get().map_or(1024, |r| r.rlim_cur)
}

/// Unproven connections a root holds at most in a process allowed `limit`
/// descriptors: a quarter of them (and no more than
/// [`rendezvous::MAX_PENDING`]), so that strangers alone cannot exhaust it.
pub(crate) fn pending_cap(limit: u64) -> usize {
    ((limit / 4) as usize).clamp(8, rendezvous::MAX_PENDING)
}

/// Descriptors a root leaves free for the ranks' own connections, links
/// and files: it refuses a connection that would leave fewer.
pub(crate) fn fd_reserve(limit: u64) -> u64 {
    (limit / 4).max(16)
}

/// Formats a duration for messages: `5s`, `2.5s`, `300ms`.
pub(crate) fn fmt_dur(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        let s = format!("{:.3}", d.as_secs_f64());
        format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
    }
}

/// `rank 3`, `ranks 1, 3`, `ranks 0-7, 9` (runs of three or more collapse).
pub(crate) fn fmt_ranks(ranks: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        if j >= i + 2 {
            parts.push(format!("{}-{}", ranks[i], ranks[j]));
        } else {
            for r in &ranks[i..=j] {
                parts.push(r.to_string());
            }
        }
        i = j + 1;
    }
    let word = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", parts.join(", "))
}

/// Time left until `deadline`, `None` once it has passed.
pub(crate) fn remaining(deadline: Instant) -> Option<Duration> {
    let r = deadline.saturating_duration_since(Instant::now());
    (!r.is_zero()).then_some(r)
}

/// A poll timeout of at least `d` (rounded up to whole milliseconds).
pub(crate) fn poll_ms(d: Duration) -> PollTimeout {
    let ms = d.as_millis().saturating_add(1).min(i32::MAX as u128) as i32;
    PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
}

/// Extra time a client waits for the root's verdict beyond its own timeout,
/// so that the root's message (which names the ranks concerned) arrives
/// before the client gives up with a vaguer one.
pub(crate) fn grace(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(2))
}

#[cfg(test)]
mod helper_tests {
    use super::*;

    #[test]
    fn formatting_helpers() {
        assert_eq!(fmt_ranks(&[3]), "rank 3");
        assert_eq!(fmt_ranks(&[1, 3]), "ranks 1, 3");
        assert_eq!(fmt_ranks(&[0, 1, 2, 3, 5, 6, 9]), "ranks 0-3, 5, 6, 9");
        assert_eq!(fmt_dur(Duration::from_secs(5)), "5s");
        assert_eq!(fmt_dur(Duration::from_millis(2500)), "2.5s");
        assert_eq!(fmt_dur(Duration::from_millis(300)), "300ms");
    }
}

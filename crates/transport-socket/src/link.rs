//! The data path of one connected link, by job: the sending end
//! (`link/send.rs`), the receiving end (`link/recv.rs`), what both ends
//! know about the link's liveness (`link/health.rs`), the control socket
//! (`link/ctrl.rs`) and the process's one progress thread that drives every
//! link's sockets (`link/poller.rs`); here, the striping rule and small
//! helpers. See the crate docs for the protocol.

use std::net::{Shutdown, TcpStream};
use std::sync::{Mutex, MutexGuard};

use crate::sys::SlotMem;

mod ctrl;
#[cfg(feature = "fuzzing")]
pub(crate) mod fuzzing;
mod health;
mod poller;
mod recv;
mod send;

pub use recv::SocketRecv;
pub use send::SocketSend;

/// Messages are striped over the data sockets in pieces of at least this
/// many bytes (NCCL's `NCCL_SOCKET_MIN_TASKSIZE`); smaller ones travel whole
/// on one socket.
pub const STRIPE_MIN_BYTES: usize = 64 * 1024;

/// Piece size for a message of `total` bytes over `nsocks` sockets.
pub fn piece_size(total: usize, nsocks: usize) -> usize {
    total
        .div_ceil(nsocks.max(1))
        .next_multiple_of(4096)
        .max(STRIPE_MIN_BYTES)
}

/// Number of pieces of a message of `total` bytes (at least 1).
pub fn npieces(total: usize, nsocks: usize) -> usize {
    total.div_ceil(piece_size(total, nsocks)).max(1)
}

/// The pieces of message `seq` of `total` bytes: `(data socket, offset,
/// length)` in order.
pub fn stripes(
    seq: u64,
    total: usize,
    nsocks: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let piece = piece_size(total, nsocks);
    (0..npieces(total, nsocks)).map(move |j| {
        let offset = j * piece;
        (
            socket_of(seq, j, nsocks),
            offset,
            piece.min(total - offset.min(total)),
        )
    })
}

/// The data socket that carries piece `j` of message `seq`.
pub fn socket_of(seq: u64, j: usize, nsocks: usize) -> usize {
    ((seq % nsocks as u64) as usize + j) % nsocks
}

/// Locks, ignoring poisoning (no code holding these locks panics, and the
/// data they guard stays consistent at every unlock).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Shuts a socket down both ways (wakes every thread blocked on it).
fn shut(s: &TcpStream) {
    let _ = s.shutdown(Shutdown::Both);
}

/// The slot memory of a new end.
fn slot_mem(slot_bytes: usize, slots: usize) -> braid_core::error::Result<SlotMem> {
    SlotMem::new(slot_bytes, slots).map_err(|reason| braid_core::CoreError::Unavailable {
        transport: crate::NAME,
        reason,
    })
}

/// Makes a socket of a new end (to `peer`) nonblocking: the progress thread
/// and the engine never wait on it.
fn nonblocking(peer: u32, s: &TcpStream) -> braid_core::error::Result<()> {
    s.set_nonblocking(true)
        .map_err(|e| braid_core::CoreError::Peer {
            transport: crate::NAME,
            peer,
            what: format!("cannot make a socket nonblocking: {e}"),
            source: Some(Box::new(e)),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striping_rule_covers_every_byte_once() {
        for n in 1..=8 {
            for total in [
                0usize,
                1,
                4095,
                65536,
                65537,
                200_000,
                512 * 1024,
                4 << 20,
                3 * 65536 + 5,
            ] {
                let piece = piece_size(total, n);
                assert!(piece >= STRIPE_MIN_BYTES);
                let k = npieces(total, n);
                assert!(k <= n, "{total} over {n}: {k} pieces");
                let mut covered = 0;
                let mut socks = Vec::new();
                for j in 0..k {
                    let off = j * piece;
                    let len = piece.min(total - off.min(total));
                    assert_eq!(off, covered);
                    covered += len;
                    socks.push(socket_of(7, j, n));
                }
                assert_eq!(covered, total);
                socks.sort_unstable();
                socks.dedup();
                assert_eq!(socks.len(), k, "pieces share a socket");
            }
        }
        // Small messages rotate over the sockets.
        let used: Vec<usize> = (0..4).map(|s| socket_of(s, 0, 4)).collect();
        assert_eq!(used, vec![0, 1, 2, 3]);
    }
}

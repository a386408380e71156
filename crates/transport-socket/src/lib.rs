//! TCP socket transport: for ranks on hosts without RDMA (and a fallback for
//! any pair).
//!
//! # How the seam maps to TCP
//!
//! Each directed connection sender → receiver is `nsocks` **data sockets**
//! plus one **control socket**, all opened by the sender to a listener of
//! the receiver. Both ends keep `slots` slot buffers of `slot_bytes` each in
//! their own (heap) memory; the seam's slot FIFO is mirrored between them.
//!
//! - **Set-up.** [`Transport::listen`] (receiving end) binds a `TcpListener`
//!   on the chosen local address, port 0, and returns a blob with a magic,
//!   the wire version, the two ranks, the address, a random 128-bit token
//!   and the geometry (slot size, slots, data sockets) — the receiver's
//!   geometry is the link's. [`Transport::prepare_send`] returns a blob with
//!   the ranks and a random 128-bit nonce. The sender's `connect` dials
//!   `nsocks + 1` sockets (connect with the deadline; a refused connection is
//!   retried for up to a second — the listener exists before its blob is
//!   published, so a longer refusal means it is gone) and writes a 48-byte
//!   hello on each (token, nonce, ranks, socket kind and index). It waits for
//!   nothing but TCP's handshake, which the kernel completes into the accept
//!   queue. The receiver's `connect` accepts until its deadline, reading the
//!   hellos without blocking on any one socket; a socket with a wrong token,
//!   nonce, rank, index or a duplicate index is dropped (a stranger cannot
//!   take a stream's place) and waiting goes on. Missing sockets at the
//!   deadline give [`CoreError::Timeout`] naming the peer. Blobs have one
//!   exact length and every field is validated: garbage is an error, never a
//!   panic.
//! - **Data.** Message `seq` lives in slot `seq % slots` on both ends. The
//!   sender's `commit` cuts it into pieces of at least 64 KiB (NCCL's
//!   `NCCL_SOCKET_MIN_TASKSIZE`; `ceil(len / nsocks)` rounded up to 4 KiB),
//!   at most one per data socket, piece `j` on socket `(seq + j) % nsocks`;
//!   so a message below 64 KiB travels whole on one socket and consecutive
//!   small messages rotate over the sockets. Each piece is a 24-byte header
//!   (sequence number, message length, offset, piece length, check word)
//!   followed by the payload, written with one `sendmsg` (header and payload
//!   as two iovecs). `commit` writes a piece on an idle socket itself
//!   (non-blocking), so a small message costs one system call on each side
//!   and no round trip or thread wake-up on the sending side; what does not
//!   fit the socket buffer waits in the socket's queue, which the
//!   **progress thread** writes when the socket drains. On the receiving end
//!   each data socket is read by a state machine (headers through an 8 KiB
//!   buffer, larger payloads straight into the slot), run by the progress
//!   thread when the socket becomes readable and by the engine inline while
//!   `poll_peek` finds nothing; the last piece of a message to land
//!   publishes the slot (an atomic store). Pieces of one message arrive on
//!   different sockets in any order; the sequence number puts them in their
//!   slot and `poll_peek` hands slots out strictly in sequence order.
//! - **Credits.** `release` sends the cumulative number of released slots
//!   (16 bytes) over the control socket, without blocking (anything the
//!   socket buffer does not take goes out with the next call or the next
//!   writable edge); the sender's progress thread, or `poll_acquire` inline
//!   when it finds no credit, stores it in an atomic. A slot is free for the sender when
//!   `committed - released < slots` and its pieces have left the slot
//!   buffer; `poll_drained` is `released == committed`. So `poll_acquire`,
//!   `poll_peek` and `poll_drained` are atomic loads, no system call.
//! - **Striping is validated**: the receiver checks that each piece is
//!   exactly the one the rule assigns to its socket, within the credit
//!   window, not yet received; a violation is [`CoreError::Protocol`], and
//!   no two pieces are ever written into the same bytes.
//! - **Failures.** EOF, `ECONNRESET` or any I/O error on any socket of a link
//!   is recorded by whoever saw it; `check_peer` and every poll then return
//!   [`CoreError::Peer`] "connection lost: `<cause>`" (with the I/O error as
//!   source). `abort(reason)` sends an abort frame with the reason over the
//!   control socket (best effort, at most ~50 ms), stops writing (queued
//!   pieces are dropped) and reading the data sockets, and keeps the
//!   sockets for a resume; the peer reports [`CoreError::PeerAborted`] with
//!   that reason (a
//!   data socket's failure counts only once the control socket has had
//!   200 ms to explain it, so the peer's reason wins over "connection
//!   lost"; the progress thread never waits for that, it notes the time).
//!   Dropping an end sends a close frame: the peer's `check_peer` reports
//!   [`CoreError::PeerAborted`] "closed its end"; a receiver whose sender
//!   closed keeps delivering the slots that arrived before the close and
//!   errors only once nothing more can come. Drop empties the queues, shuts
//!   the sockets down and takes them off the progress thread (a dropped
//!   sender first gives queued pieces up to a second to leave). Writes use
//!   `MSG_NOSIGNAL`: a dead peer never raises SIGPIPE.
//! - **Kept links** (a shrink): an idle link (nothing failed or aborted,
//!   every message released; the sender waits up to 200 ms for the last
//!   credits) goes on under its new peer rank from where it stands. A link
//!   that either end aborted (nothing else failed: no lost socket, no
//!   close) goes on through a **resync**, whatever it was in the middle of:
//!   each end counts the bytes each data socket took or gave since the
//!   link started; the sender's `resume` drops what it still had queued
//!   and writes a resync control frame carrying where it cut each data
//!   stream, the receiver's `resume` writes one of its own (the sender
//!   skips its old credits and abort up to it), waits for the sender's (at
//!   most 10 s), reads and drops the old link's bytes up to each cut and
//!   starts the new link's frames with every slot free (what it had not
//!   released is dropped). Frames never straddle the cut: a stream may stop
//!   in the middle of a piece, and the new link starts at the byte after.
//!   Both ends offer [`Resume`](braid_core::transport::Resume)`::resync`
//!   then, so the two ends of a kept link always go on the same way.
//! - **Direct (zero-copy) transfers.** `can_send_direct` is true (unless
//!   `BRAID_SOCKET_DIRECT` is off) and `direct_costs_receiver` false: the
//!   receiver reads the same bytes from its sockets either way, so the
//!   engine also sends data the receiver reduces by reference. A message
//!   committed with `commit_direct` is striped like any other (it may be
//!   longer than a slot) and its frames carry a direct bit (the top bit of
//!   the sequence word); `commit` itself, or the progress thread, sends
//!   each piece straight from the caller's memory (raw `sendmsg`, no slot
//!   copy). It still takes a credit and a sequence number. On the receiving
//!   end the reading of each socket takes the piece's header, hands what it
//!   had buffered of the payload (under 8 KiB) to the engine and pauses;
//!   once every piece's header is in, `poll_peek_any` reports
//!   [`Incoming::Remote`](braid_core::transport::Incoming::Remote) and the
//!   engine's `poll_read_remote` reads the payloads from the sockets itself
//!   with non-blocking `recv` into the destination (the user's buffer for a
//!   plain receive): no slot copy and no thread wake-up on the data path.
//!   It returns false when the sockets are empty, so every wait stays the
//!   engine's (deadline, abort flag, liveness); the transport writes the
//!   destination only inside those calls, so an error or abort leaves
//!   nothing writing user memory. A socket failure or EOF in the middle of
//!   a payload is reported like any other (the abort reason wins within
//!   200 ms). `release` of a direct slot that was not read is refused (its
//!   payload is still in the sockets). `abort` and drop on the sending end
//!   empty the queues under the sockets' locks, which every write holds
//!   (writes never block), so the caller's memory is not read after the
//!   abort returns. The blocking `read_remote` is the same loop with a 60 s
//!   stall limit.
//!
//! All sockets have `TCP_NODELAY`. Socket buffer sizes are left to Linux's
//! autotuning (setting `SO_SNDBUF`/`SO_RCVBUF` would switch it off).
//!
//! # Choosing the interface
//!
//! See [`probe`]: `BRAID_SOCKET_IFNAME` with `NCCL_SOCKET_IFNAME`'s syntax
//! (prefix list, `^` to exclude, `=` for exact names); otherwise the address
//! the kernel would use to reach the root given with
//! [`SocketConfig::with_root`] (loopback only when the root is loopback);
//! otherwise `ib*` first, then anything but `lo` and `docker*`. IPv4 first
//! unless the root is IPv6 or `BRAID_SOCKET_FAMILY` says otherwise. IPv6
//! link-local addresses keep their scope id.
//!
//! # Environment
//!
//! [`SocketConfig::from_env`] reads these (booleans as
//! `1/0/true/false/on/off/yes/no`, like every braid variable); a value it
//! cannot use is an error naming the variable.
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `BRAID_SOCKET_IFNAME` | interfaces to use (NCCL syntax) | route to the root |
//! | `BRAID_SOCKET_FAMILY` | `4`/`AF_INET` or `6`/`AF_INET6` only | either, IPv4 first |
//! | `BRAID_SOCKET_NSOCKS` | data sockets per connection, 1–64 | cores / 4, 1 to 4 |
//! | `BRAID_SOCKET_SLOT_BYTES` | bytes per slot, a multiple of 64 | 512 KiB |
//! | `BRAID_SOCKET_SLOTS` | slots per connection | 8 |
//! | `BRAID_SOCKET_DIRECT` | off: no direct (zero-copy) sends | on |
//!
//! The threads: one per process, whatever the number of links and sockets
//! (`braid-sock-poll`, `link/poller.rs`): it sleeps in `epoll_wait`
//! (edge-triggered) and does, without blocking, what its sockets allow. It
//! starts with the first link and ends when the last one is dropped. Like
//! NCCL's proxy thread it drives every network link of the process; the
//! engine does the same work inline while it waits, so a waiting rank does
//! not need the thread to be scheduled.
//!
//! # Files
//!
//! | file | holds |
//! | --- | --- |
//! | `lib.rs` | this contract, [`SocketConfig`], re-exports |
//! | `transport.rs` | [`SocketTransport`] (the `Transport` impl): listeners, dialling, hellos |
//! | `link.rs` | the striping rule; `link/send.rs` the sending end, `link/recv.rs` the receiving end, `link/poller.rs` the progress thread, `link/health.rs` a link's liveness, `link/ctrl.rs` the control socket, `link/fuzzing.rs` the readers over plain bytes (feature `fuzzing`) |
//! | `info.rs` | wire formats: connect-info blobs, hellos, frame headers |
//! | `probe.rs` | what the host offers: interfaces, the route to the root, the choice of address |
//! | `sys.rs` | the FFI module |
//!
//! # Where `unsafe` lives
//!
//! `sys.rs` holds the slot memory and the system calls on raw memory
//! (`sendmsg` from a slot or the caller's memory, non-blocking `recv` into
//! a destination). Outside it only the channel ends have `unsafe` blocks,
//! each with its `SAFETY:` reason: `link/send.rs` where a piece (slot or
//! memory lent through `commit_direct`) goes to `sendmsg`, and
//! `link/recv.rs` where a socket's reading fills its part of a slot and where
//! `read_remote` / `poll_read_remote` write the engine's destination (and,
//! with the `fuzzing` feature, `link/fuzzing.rs`, which reads the slots its
//! readers filled). `transport.rs` has `unsafe` in its tests only.

use std::net::{IpAddr, SocketAddr};

use braid_core::config::{self, ConfigError, NameList};
// For the links in the docs above.
#[cfg(doc)]
use braid_core::{error::CoreError, transport::Transport};

// Their wire-format items are public for the `fuzzing` feature's
// re-exports (below), which name some of them; the rest stay as they were.
#[allow(unreachable_pub)]
mod info;
#[allow(unreachable_pub)]
mod link;
pub mod probe;
mod sys;
mod transport;

pub use link::{SocketRecv, SocketSend, STRIPE_MIN_BYTES};
pub use probe::{Family, IfAddr};
pub use transport::SocketTransport;

/// The wire formats and stream readers over plain bytes, for the fuzz
/// targets in `fuzz/` and their seed corpus. Not part of the API: the
/// signatures follow the wire format and change with it.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::info::{
        check_geometry, ctrl_decode, ctrl_frame, CtrlKind, FrameHeader, Hello, RecvInfo, SendInfo,
        CTRL_LEN, KIND_CTRL, KIND_DATA, MAX_NSOCKS, MAX_REASON, MAX_SLOTS, MAX_SLOT_BYTES,
    };
    pub use crate::link::fuzzing::{ctrl_stream, data_streams};
    pub use crate::link::{npieces, piece_size, stripes};

    /// The receiver's check of a socket's hello against the two blobs:
    /// `(kind, data socket index)`. `data` says which data sockets arrived
    /// already, `have_ctrl` whether the control socket did.
    pub fn check_hello(
        buf: &[u8; Hello::LEN],
        ri: &RecvInfo,
        si: &SendInfo,
        data: &[bool],
        have_ctrl: bool,
    ) -> Result<(u8, usize), String> {
        let data: Vec<Option<()>> = data.iter().map(|&d| d.then_some(())).collect();
        crate::transport::check_hello(buf, ri, si, &data, have_ctrl)
    }
}

/// The transport's name (`BRAID_TRANSPORT=socket`).
const NAME: &str = "socket";

/// Environment variable: interfaces to use (`NCCL_SOCKET_IFNAME` syntax).
pub const ENV_IFNAME: &str = "BRAID_SOCKET_IFNAME";
/// Environment variable: address family (`4`, `6`, `AF_INET`, `AF_INET6`).
pub const ENV_FAMILY: &str = "BRAID_SOCKET_FAMILY";
/// Environment variable: data sockets per connection.
pub const ENV_NSOCKS: &str = "BRAID_SOCKET_NSOCKS";
/// Environment variable: bytes per slot.
pub const ENV_SLOT_BYTES: &str = "BRAID_SOCKET_SLOT_BYTES";
/// Environment variable: slots per connection.
pub const ENV_SLOTS: &str = "BRAID_SOCKET_SLOTS";
/// Environment variable: off switches direct (zero-copy) sends off.
pub const ENV_DIRECT: &str = "BRAID_SOCKET_DIRECT";

/// Configuration of a [`SocketTransport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketConfig {
    ifname: Option<NameList>,
    family: Option<Family>,
    addr: Option<IpAddr>,
    root: Option<SocketAddr>,
    nsocks: usize,
    slot_bytes: usize,
    slots: usize,
    direct: bool,
}

impl Default for SocketConfig {
    fn default() -> Self {
        SocketConfig {
            ifname: None,
            family: None,
            addr: None,
            root: None,
            nsocks: SocketConfig::default_nsocks(),
            slot_bytes: SocketConfig::DEFAULT_SLOT_BYTES,
            slots: SocketConfig::DEFAULT_SLOTS,
            direct: true,
        }
    }
}

impl SocketConfig {
    /// Most data sockets per connection by default.
    pub const DEFAULT_NSOCKS: usize = 4;

    /// Default data sockets per connection: one per 4 cores, 1 to
    /// [`SocketConfig::DEFAULT_NSOCKS`]. With a helper thread per socket
    /// (before the progress thread), on 2 cores, side by side between two
    /// network namespaces, a 64 MiB AllReduce ran at about 1.3 GB/s with 1
    /// socket, 1.0 with 2 and 0.75 with 4.
    pub fn default_nsocks() -> usize {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        (cores / 4).clamp(1, Self::DEFAULT_NSOCKS)
    }
    /// Default bytes per slot.
    pub const DEFAULT_SLOT_BYTES: usize = 512 * 1024;
    /// Default slots per connection.
    pub const DEFAULT_SLOTS: usize = 8;

    /// Defaults overridden by `BRAID_SOCKET_*` as `env` gives them
    /// ([`braid_core::config::process_env`] for the process environment);
    /// an error names a variable that is set but not usable.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<SocketConfig, ConfigError> {
        let d = SocketConfig::default();
        let family = match config::value(env, ENV_FAMILY) {
            None => None,
            Some(f) => Some(Family::parse(&f).ok_or_else(|| {
                ConfigError::new(ENV_FAMILY, &f, "expected 4, 6, AF_INET or AF_INET6")
            })?),
        };
        let c = SocketConfig {
            ifname: config::value(env, ENV_IFNAME).map(|s| NameList::parse(&s)),
            family,
            nsocks: config::number(env, ENV_NSOCKS)?.unwrap_or(d.nsocks),
            slot_bytes: config::number(env, ENV_SLOT_BYTES)?.unwrap_or(d.slot_bytes),
            slots: config::number(env, ENV_SLOTS)?.unwrap_or(d.slots),
            direct: config::flag(env, ENV_DIRECT, d.direct)?,
            ..d
        };
        c.validate()?;
        Ok(c)
    }

    /// The root's address: the default interface is the one that routes to
    /// it (loopback only if the root is loopback).
    pub fn with_root(mut self, root: SocketAddr) -> Self {
        self.root = Some(root);
        self
    }

    /// Interfaces to choose from, in `NCCL_SOCKET_IFNAME` syntax.
    pub fn with_ifname(mut self, spec: &str) -> Self {
        self.ifname = Some(NameList::parse(spec));
        self
    }

    /// Only this address family.
    pub fn with_family(mut self, family: Family) -> Self {
        self.family = Some(family);
        self
    }

    /// Listen on exactly this local address (skips interface selection).
    pub fn with_addr(mut self, addr: IpAddr) -> Self {
        self.addr = Some(addr);
        self
    }

    /// Data sockets per connection (1 to 64).
    pub fn with_nsocks(mut self, nsocks: usize) -> Self {
        self.nsocks = nsocks;
        self
    }

    /// Slot geometry of the connections this end receives on.
    pub fn with_geometry(mut self, slot_bytes: usize, slots: usize) -> Self {
        self.slot_bytes = slot_bytes;
        self.slots = slots;
        self
    }

    /// Whether sending ends offer direct (zero-copy) sends.
    pub fn with_direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// Whether sending ends offer direct (zero-copy) sends.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Data sockets per connection.
    pub fn nsocks(&self) -> usize {
        self.nsocks
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots per connection.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Checks the geometry; the error names the variable that sets the
    /// value out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |var: &str, v: usize, e: String| ConfigError::new(var, &v.to_string(), e);
        info::check_slot_bytes(self.slot_bytes)
            .map_err(|e| bad(ENV_SLOT_BYTES, self.slot_bytes, e))?;
        info::check_slots(self.slots).map_err(|e| bad(ENV_SLOTS, self.slots, e))?;
        info::check_nsocks(self.nsocks).map_err(|e| bad(ENV_NSOCKS, self.nsocks, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<SocketConfig, ConfigError> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        SocketConfig::from_env(&move |k: &str| {
            pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn environment_is_parsed_and_bad_values_name_their_variable() {
        assert_eq!(cfg(&[]).unwrap(), SocketConfig::default());
        let c = cfg(&[
            (ENV_NSOCKS, "3"),
            (ENV_SLOT_BYTES, "131072"),
            (ENV_SLOTS, "5"),
            (ENV_IFNAME, "^docker"),
            (ENV_FAMILY, "6"),
            (ENV_DIRECT, "no"),
        ])
        .unwrap();
        assert_eq!(
            c,
            SocketConfig::default()
                .with_nsocks(3)
                .with_geometry(131072, 5)
                .with_ifname("^docker")
                .with_family(Family::V6)
                .with_direct(false)
        );
        for (k, v) in [
            (ENV_NSOCKS, "0"),
            (ENV_NSOCKS, "65"),
            (ENV_SLOT_BYTES, "100"),
            (ENV_SLOT_BYTES, "lots"),
            (ENV_SLOTS, "0"),
            (ENV_SLOTS, "many"),
            (ENV_FAMILY, "7"),
            (ENV_DIRECT, "maybe"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err();
            assert_eq!(e.var, k, "{k}={v}: {e}");
            assert!(e.to_string().starts_with(&format!("{k}=")), "{e}");
        }
    }
}

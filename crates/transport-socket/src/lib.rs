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
//!   as two iovecs). One **helper thread per data socket** writes the queued
//!   pieces, so striping spreads the copy into the kernel over cores; a
//!   message of one piece whose socket is idle is written directly by
//!   `commit` (non-blocking; whatever does not fit the socket buffer is left
//!   to the helper), so a small message costs one system call on each side
//!   and no round trip or thread wake-up on the sending side. On the
//!   receiving end one helper thread per data socket reads headers through
//!   an 8 KiB buffer and larger payloads straight into the slot; the last
//!   piece of a message to land publishes the slot (an atomic store), so
//!   `poll_peek` is a single atomic load. Pieces of one message arrive on
//!   different sockets in any order; the sequence number puts them in their
//!   slot and `poll_peek` hands slots out strictly in sequence order.
//! - **Credits.** `release` sends the cumulative number of released slots
//!   (16 bytes) over the control socket, without blocking (anything the
//!   socket buffer does not take is retried on the next call); a helper on
//!   the sender stores it in an atomic. A slot is free for the sender when
//!   `committed - released < slots` and its pieces have left the slot
//!   buffer; `poll_drained` is `released == committed`. So `poll_acquire`,
//!   `poll_peek` and `poll_drained` are atomic loads, no system call.
//! - **Striping is validated**: the receiver checks that each piece is
//!   exactly the one the rule assigns to its socket, within the credit
//!   window, not yet received; a violation is [`CoreError::Protocol`], and
//!   no two helpers ever write the same bytes.
//! - **Failures.** EOF, `ECONNRESET` or any I/O error on any socket of a link
//!   is recorded by the helper that saw it; `check_peer` and every poll then
//!   return [`CoreError::Peer`] "connection lost: `<cause>`" (with the I/O
//!   error as source). `abort(reason)` sends an abort frame with the reason
//!   over the control socket (best effort, at most ~50 ms) and shuts every
//!   socket down; the peer reports [`CoreError::PeerAborted`] with that
//!   reason (a helper that sees a socket fail waits up to 200 ms for the
//!   control socket to explain, so the peer's reason wins over "connection
//!   lost"). Dropping an end sends a close frame: the peer's `check_peer`
//!   reports [`CoreError::PeerAborted`] "closed its end"; a receiver whose
//!   sender closed keeps delivering the slots that arrived before the close
//!   and errors only once nothing more can come. Drop shuts the sockets
//!   down, which wakes every helper blocked in a read or write, then joins
//!   the helpers (a dropped sender first gives queued pieces up to a second
//!   to leave). Writes use `MSG_NOSIGNAL`: a dead peer never raises SIGPIPE.
//! - **Direct (zero-copy) transfers.** `can_send_direct` is true (unless
//!   `BRAID_SOCKET_DIRECT=0`) and `direct_costs_receiver` false: the
//!   receiver reads the same bytes from its sockets either way, so the
//!   engine also sends data the receiver reduces by reference. A message
//!   committed with `commit_direct` is striped like any other (it may be
//!   longer than a slot) and its frames carry a direct bit (the top bit of
//!   the sequence word); the writers, or `commit` itself, send each piece
//!   straight from the caller's memory (raw `sendmsg`, no slot copy). It
//!   still takes a credit and a sequence number. On the receiving end the
//!   reader of each socket reads the piece's header, hands what it had
//!   buffered of the payload (under 8 KiB) to the engine and waits; once
//!   every piece's header is in, `poll_peek_any` reports
//!   [`Incoming::Remote`](braid_core::transport::Incoming::Remote) and the
//!   engine's `poll_read_remote` reads the payloads from the sockets itself
//!   with non-blocking `recv` into the destination (the user's buffer for a
//!   plain receive): no slot copy and no thread wake-up on the data path.
//!   It returns false when the sockets are empty, so every wait stays the
//!   engine's (deadline, abort flag, liveness); the transport writes the
//!   destination only inside those calls, so an error or abort leaves no
//!   helper writing user memory. A socket failure or EOF in the middle of a
//!   payload is reported like a reader's (the abort reason wins within
//!   200 ms). `release` of a direct slot that was not read is refused (its
//!   payload is still in the sockets). `abort` and drop on the sending end
//!   drop queued pieces and wait (at most 2 s; a shut socket ends a blocked
//!   write at once) for the writers to leave theirs, so the caller's memory
//!   is not read after the abort returns. The blocking `read_remote` is the
//!   same loop with a 60 s stall limit.
//!
//! All sockets have `TCP_NODELAY`. Socket buffer sizes are left to Linux's
//! autotuning (setting `SO_SNDBUF`/`SO_RCVBUF` would switch it off).
//!
//! # Choosing the interface
//!
//! See [`iface`]: `BRAID_SOCKET_IFNAME` with `NCCL_SOCKET_IFNAME`'s syntax
//! (prefix list, `^` to exclude, `=` for exact names); otherwise the address
//! the kernel would use to reach the root given with
//! [`SocketConfig::with_root`] (loopback only when the root is loopback);
//! otherwise `ib*` first, then anything but `lo` and `docker*`. IPv4 first
//! unless the root is IPv6 or `BRAID_SOCKET_FAMILY` says otherwise. IPv6
//! link-local addresses keep their scope id.
//!
//! # Environment
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `BRAID_SOCKET_IFNAME` | interfaces to use (NCCL syntax) | route to the root |
//! | `BRAID_SOCKET_FAMILY` | `4`/`AF_INET` or `6`/`AF_INET6` only | either, IPv4 first |
//! | `BRAID_SOCKET_NSOCKS` | data sockets (and helper threads per end) per connection, 1–64 | cores / 4, 1 to 4 |
//! | `BRAID_SOCKET_SLOT_BYTES` | bytes per slot, a multiple of 64 | 512 KiB |
//! | `BRAID_SOCKET_SLOTS` | slots per connection | 8 |
//! | `BRAID_SOCKET_DIRECT` | `0`: no direct (zero-copy) sends | `1` |
//!
//! The threads: per connection, `nsocks` writers + 1 control reader on the
//! sending end, `nsocks` readers + 1 control reader on the receiving end
//! (NCCL's `NCCL_SOCKET_NTHREADS` × `NCCL_NSOCKS_PERTHREAD` with one socket
//! per thread). Helpers sleep in blocking socket calls, never spin.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{
    PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, Transport,
};
use braid_core::types::MemKind;

pub mod iface;
mod info;
mod link;
mod sys;

pub use iface::{Family, IfAddr, IfSpec};
pub use link::{SocketRecv, SocketSend, STRIPE_MIN};

/// The wire formats and stream readers over plain bytes, for the fuzz
/// targets in `fuzz/` and their seed corpus. Not part of the API: the
/// signatures follow the wire format and change with it.
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
        crate::check_hello(buf, ri, si, &data, have_ctrl)
    }
}

use info::{check_geometry, Hello, RecvInfo, SendInfo, KIND_CTRL, KIND_DATA};

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
/// Environment variable: `0` switches direct (zero-copy) sends off.
pub const ENV_DIRECT: &str = "BRAID_SOCKET_DIRECT";

/// How long a refused connection is retried.
const REFUSED_RETRY: Duration = Duration::from_secs(1);

/// Configuration of a [`SocketTransport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketConfig {
    ifname: Option<String>,
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
    /// [`SocketConfig::DEFAULT_NSOCKS`]. Every socket is a helper thread at
    /// each end (and a reader wake-up per direct piece); on 2 cores, side by
    /// side between two network namespaces, a 64 MiB AllReduce ran at about
    /// 1.3 GB/s with 1 socket, 1.0 with 2 and 0.75 with 4.
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

    /// Defaults overridden by `BRAID_SOCKET_*`; an error names a variable
    /// that is set but invalid.
    pub fn from_env() -> Result<SocketConfig> {
        let mut c = SocketConfig::default();
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
        };
        let num = |name: &str, default: usize| -> Result<usize> {
            match var(name) {
                None => Ok(default),
                Some(s) => s.parse().map_err(|_| {
                    CoreError::InvalidArgument(format!("{name}={s:?} is not a number"))
                }),
            }
        };
        c.ifname = var(ENV_IFNAME);
        if let Some(f) = var(ENV_FAMILY) {
            c.family = Some(Family::parse(&f).ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "{ENV_FAMILY}={f:?}: use 4, 6, AF_INET or AF_INET6"
                ))
            })?);
        }
        c.nsocks = num(ENV_NSOCKS, c.nsocks)?;
        c.slot_bytes = num(ENV_SLOT_BYTES, c.slot_bytes)?;
        c.slots = num(ENV_SLOTS, c.slots)?;
        if let Some(d) = var(ENV_DIRECT) {
            c.direct = match d.as_str() {
                "0" => false,
                "1" => true,
                _ => {
                    return Err(CoreError::InvalidArgument(format!(
                        "{ENV_DIRECT}={d:?}: use 0 or 1"
                    )))
                }
            };
        }
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
        self.ifname = Some(spec.to_owned());
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

    fn validate(&self) -> Result<()> {
        check_geometry(self.slot_bytes, self.slots, self.nsocks).map_err(|e| {
            CoreError::InvalidArgument(format!(
                "socket transport: {e} ({ENV_SLOT_BYTES}, {ENV_SLOTS}, {ENV_NSOCKS})"
            ))
        })
    }
}

/// The TCP socket transport.
#[derive(Clone, Debug)]
pub struct SocketTransport {
    cfg: SocketConfig,
    local: SocketAddr,
    ifname: String,
}

impl SocketTransport {
    /// Validates `cfg` and chooses the local address to listen on;
    /// [`CoreError::Unavailable`] if no interface fits.
    pub fn new(cfg: SocketConfig) -> Result<SocketTransport> {
        cfg.validate()?;
        let unavailable = |reason: String| CoreError::Unavailable {
            transport: NAME,
            reason,
        };
        let (local, ifname) = match cfg.addr {
            Some(ip) => (SocketAddr::new(ip, 0), String::from("(given address)")),
            None => {
                let ifaces = iface::list().map_err(unavailable)?;
                let spec = cfg.ifname.as_deref().map(IfSpec::parse);
                let route = cfg.root.and_then(iface::route_source);
                let a = iface::choose(&ifaces, spec.as_ref(), cfg.family, cfg.root, route)
                    .map_err(unavailable)?;
                (a.socket_addr(), a.name)
            }
        };
        tracing::debug!("socket transport: listening on {ifname} {}", local.ip());
        Ok(SocketTransport { cfg, local, ifname })
    }

    /// [`SocketConfig::from_env`] then [`SocketTransport::new`].
    pub fn from_env() -> Result<SocketTransport> {
        SocketTransport::new(SocketConfig::from_env()?)
    }

    /// The local address (port 0) listeners bind to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The interface it belongs to.
    pub fn interface(&self) -> &str {
        &self.ifname
    }

    /// The configuration.
    pub fn config(&self) -> &SocketConfig {
        &self.cfg
    }
}

fn random16() -> Result<[u8; 16]> {
    let mut b = [0u8; 16];
    while b == [0; 16] {
        getrandom::getrandom(&mut b).map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("no randomness for the connection token: {e}"),
        })?;
    }
    Ok(b)
}

fn peer_io(peer: u32, what: String, e: std::io::Error) -> CoreError {
    CoreError::Peer {
        transport: NAME,
        peer,
        what: format!("{what}: {e}"),
        source: Some(Box::new(e)),
    }
}

fn bad_info(peer: u32, which: &str, e: String) -> CoreError {
    CoreError::Protocol {
        peer,
        detail: format!("invalid socket connect-info from the {which}: {e}"),
    }
}

impl Transport for SocketTransport {
    fn kind(&self) -> braid_core::transport::TransportKind {
        braid_core::transport::TransportKind::Socket
    }

    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }

    fn can_connect(&self, _me: &PeerDesc, _peer: &PeerDesc) -> bool {
        true
    }

    fn listen(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        let listener = TcpListener::bind(self.local).map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("cannot listen on {} ({}): {e}", self.local, self.ifname),
        })?;
        let addr = listener.local_addr().map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("getsockname on a listener: {e}"),
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| peer_io(peer.rank, "listener".into(), e))?;
        let token = random16()?;
        let info = RecvInfo {
            from: peer.rank,
            to: me.rank,
            addr,
            token,
            slot_bytes: self.cfg.slot_bytes,
            slots: self.cfg.slots,
            nsocks: self.cfg.nsocks,
        };
        let blob = info.encode();
        Ok((Box::new(PendingSocketRecv { listener, info }), blob))
    }

    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)> {
        let info = SendInfo {
            from: me.rank,
            to: peer.rank,
            nonce: random16()?,
        };
        let blob = info.encode();
        Ok((
            Box::new(PendingSocketSend {
                info,
                direct: self.cfg.direct,
            }),
            blob,
        ))
    }
}

/// A sending end before `connect`.
#[derive(Debug)]
struct PendingSocketSend {
    info: SendInfo,
    /// Offer direct (zero-copy) sends.
    direct: bool,
}

/// Connects to `addr`; a refusal is retried until `refused_until`.
fn dial(
    addr: SocketAddr,
    deadline: Instant,
    refused_until: Instant,
    peer: u32,
) -> Result<TcpStream> {
    let start = Instant::now();
    loop {
        let now = Instant::now();
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() {
            return Err(CoreError::Timeout {
                transport: NAME,
                peer,
                waiting_for: "a TCP connection to the receiver",
                after: now - start,
            });
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && now < refused_until => {
                std::thread::sleep(Duration::from_millis(20).min(left));
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(CoreError::Timeout {
                    transport: NAME,
                    peer,
                    waiting_for: "a TCP connection to the receiver",
                    after: Instant::now() - start,
                })
            }
            Err(e) => return Err(peer_io(peer, format!("cannot connect to {addr}"), e)),
        }
    }
}

impl PendingSend for PendingSocketSend {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn SendChannel>> {
        let me = self.info;
        let peer = me.to;
        let ri = RecvInfo::decode(receiver_info).map_err(|e| bad_info(peer, "receiver", e))?;
        if ri.from != me.from || ri.to != me.to {
            return Err(bad_info(
                peer,
                "receiver",
                format!(
                    "it describes link {} -> {}, this is {} -> {}",
                    ri.from, ri.to, me.from, me.to
                ),
            ));
        }
        let mut data = Vec::with_capacity(ri.nsocks);
        let mut ctrl = None;
        let refused_until = Instant::now() + REFUSED_RETRY;
        for i in 0..=ri.nsocks {
            let s = dial(ri.addr, deadline, refused_until, peer)?;
            let io = |what: &str, e| peer_io(peer, format!("{what} ({})", ri.addr), e);
            s.set_nodelay(true).map_err(|e| io("TCP_NODELAY", e))?;
            let is_ctrl = i == ri.nsocks;
            let hello = Hello {
                kind: if is_ctrl { KIND_CTRL } else { KIND_DATA },
                index: if is_ctrl { 0 } else { i as u8 },
                from: me.from,
                to: me.to,
                token: ri.token,
                nonce: me.nonce,
            };
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            s.set_write_timeout(Some(left))
                .map_err(|e| io("set timeout", e))?;
            (&s).write_all(&hello.encode())
                .map_err(|e| io("sending the hello", e))?;
            s.set_write_timeout(None)
                .map_err(|e| io("set timeout", e))?;
            if is_ctrl {
                ctrl = Some(s);
            } else {
                data.push(s);
            }
        }
        let ctrl = ctrl.ok_or_else(|| CoreError::Protocol {
            peer,
            detail: "no control socket".into(),
        })?;
        let ch = SocketSend::start(peer, ri.slot_bytes, ri.slots, data, ctrl, self.direct)?;
        Ok(Box::new(ch))
    }
}

/// A receiving end before `connect`.
#[derive(Debug)]
struct PendingSocketRecv {
    listener: TcpListener,
    info: RecvInfo,
}

/// An accepted socket whose hello is still arriving.
struct Arrival {
    sock: TcpStream,
    buf: [u8; Hello::LEN],
    got: usize,
}

impl PendingRecv for PendingSocketRecv {
    fn connect(
        self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn RecvChannel>> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::io::Read;

        let start = Instant::now();
        let ri = self.info;
        let peer = ri.from;
        let si = SendInfo::decode(sender_info).map_err(|e| bad_info(peer, "sender", e))?;
        if si.from != ri.from || si.to != ri.to {
            return Err(bad_info(
                peer,
                "sender",
                format!(
                    "it describes link {} -> {}, this is {} -> {}",
                    si.from, si.to, ri.from, ri.to
                ),
            ));
        }
        let n = ri.nsocks;
        let mut data: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let mut ctrl: Option<TcpStream> = None;
        let mut pending: Vec<Arrival> = Vec::new();
        loop {
            if ctrl.is_some() && data.iter().all(Option::is_some) {
                break;
            }
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                let got = data.iter().filter(|d| d.is_some()).count() + usize::from(ctrl.is_some());
                tracing::debug!(
                    peer,
                    "socket connect: {got} of {} sockets arrived by the deadline",
                    n + 1
                );
                return Err(CoreError::Timeout {
                    transport: NAME,
                    peer,
                    waiting_for: "the sender's sockets to connect",
                    after: now - start,
                });
            }
            // Wait for a connection or hello bytes, at most 100 ms.
            let wait_ms = left
                .min(Duration::from_millis(100))
                .as_micros()
                .div_ceil(1000) as u16;
            {
                let mut fds = Vec::with_capacity(1 + pending.len());
                fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
                for p in &pending {
                    fds.push(PollFd::new(p.sock.as_fd(), PollFlags::POLLIN));
                }
                match poll(&mut fds, PollTimeout::from(wait_ms)) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => {
                        return Err(peer_io(peer, "poll".into(), std::io::Error::from(e)));
                    }
                }
            }
            // Accept whatever is queued.
            loop {
                match self.listener.accept() {
                    Ok((sock, _)) => {
                        if sock.set_nonblocking(true).is_ok() {
                            if pending.len() >= 64 {
                                pending.remove(0);
                            }
                            pending.push(Arrival {
                                sock,
                                buf: [0; Hello::LEN],
                                got: 0,
                            });
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // ECONNABORTED and friends: that connection is gone.
                        tracing::debug!(peer, "accept: {e}");
                        break;
                    }
                }
            }
            // Read hellos.
            let mut i = 0;
            while i < pending.len() {
                let p = &mut pending[i];
                let keep = match p.sock.read(&mut p.buf[p.got..]) {
                    Ok(0) => false,
                    Ok(k) => {
                        p.got += k;
                        true
                    }
                    Err(e) => matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ),
                };
                if !keep {
                    pending.swap_remove(i);
                    continue;
                }
                if p.got < Hello::LEN {
                    i += 1;
                    continue;
                }
                let p = pending.swap_remove(i);
                match check_hello(&p.buf, &ri, &si, &data, ctrl.is_some()) {
                    Ok((kind, idx)) => {
                        if kind == KIND_CTRL {
                            ctrl = Some(p.sock);
                        } else {
                            data[idx] = Some(p.sock);
                        }
                    }
                    Err(why) => {
                        tracing::warn!(
                            peer,
                            "socket transport: rejected a connection from {:?}: {why}",
                            p.sock.peer_addr().ok()
                        );
                    }
                }
            }
        }
        let socks: Vec<TcpStream> = data.into_iter().flatten().collect();
        let ctrl = ctrl.ok_or_else(|| CoreError::Protocol {
            peer,
            detail: "no control socket".into(),
        })?;
        for s in socks.iter().chain(std::iter::once(&ctrl)) {
            s.set_nonblocking(false)
                .and_then(|()| s.set_nodelay(true))
                .map_err(|e| peer_io(peer, "socket options".into(), e))?;
        }
        drop(self.listener);
        let ch = SocketRecv::start(peer, ri.slot_bytes, ri.slots, socks, ctrl)?;
        Ok(Box::new(ch))
    }
}

/// Checks a hello against what this receiver expects: `(kind, index)`.
fn check_hello<T>(
    buf: &[u8; Hello::LEN],
    ri: &RecvInfo,
    si: &SendInfo,
    data: &[Option<T>],
    have_ctrl: bool,
) -> std::result::Result<(u8, usize), String> {
    let h = Hello::decode(buf)?;
    if h.token != ri.token {
        return Err("wrong token (a stray or foreign connection)".into());
    }
    if h.nonce != si.nonce || h.from != si.from || h.to != si.to {
        return Err(format!(
            "hello for link {} -> {} from another sender attempt",
            h.from, h.to
        ));
    }
    let idx = h.index as usize;
    match h.kind {
        KIND_CTRL if idx == 0 && !have_ctrl => Ok((KIND_CTRL, 0)),
        KIND_DATA if idx < data.len() && data[idx].is_none() => Ok((KIND_DATA, idx)),
        k => Err(format!(
            "unexpected or duplicate socket kind {k} index {idx}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_conformance::desc;
    use braid_core::transport::Incoming;

    fn lo() -> SocketTransport {
        SocketTransport::new(
            SocketConfig::default()
                .with_addr("127.0.0.1".parse().unwrap())
                .with_geometry(65536, 4)
                .with_nsocks(2),
        )
        .unwrap()
    }

    fn raw_hello(ri: &RecvInfo, si: &SendInfo, kind: u8, index: u8) -> TcpStream {
        let mut s = TcpStream::connect(ri.addr).unwrap();
        let h = Hello {
            kind,
            index,
            from: si.from,
            to: si.to,
            token: ri.token,
            nonce: si.nonce,
        };
        s.write_all(&h.encode()).unwrap();
        s
    }

    /// Polls `f` until it gives something (10 s at most).
    fn wait<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(Instant::now() < end, "waited 10 s for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn wait_err(mut f: impl FnMut() -> Result<()>) -> CoreError {
        wait("an error", || f().err())
    }

    /// Strangers (wrong token, garbage, silence, a duplicate index) are
    /// dropped; the real sender still gets through.
    #[test]
    fn strangers_are_rejected() {
        let t = lo();
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (ptx, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let mut wrong = ri.clone();
        wrong.token[0] ^= 1;
        let _a = raw_hello(&wrong, &si, KIND_DATA, 0);
        let mut b = TcpStream::connect(ri.addr).unwrap();
        b.write_all(&[0x55; Hello::LEN]).unwrap();
        let _silent = TcpStream::connect(ri.addr).unwrap();
        let mut other = si.clone();
        other.nonce[3] ^= 1;
        let _c = raw_hello(&ri, &other, KIND_DATA, 1);
        let _d = raw_hello(&ri, &si, KIND_DATA, 7);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut tx = ptx.connect(&rblob, deadline).unwrap();
        let mut rx = prx.connect(&sblob, deadline).unwrap();
        let slot = tx.poll_acquire().unwrap().unwrap();
        // SAFETY: a host slot of at least one byte.
        unsafe { slot.ptr.write(9) };
        tx.commit(1).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let (buf, len) = loop {
            if let Some(x) = rx.poll_peek().unwrap() {
                break x;
            }
            assert!(Instant::now() < end);
        };
        assert_eq!(len, 1);
        // SAFETY: the peeked slot holds one byte.
        assert_eq!(unsafe { buf.ptr.read() }, 9);
        rx.release().unwrap();
    }

    /// The receiver's timeout names the peer and what was missing.
    #[test]
    fn timeout_names_the_peer() {
        let t = lo();
        let (prx, rblob) = t.listen(&desc(1), &desc(5)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_ptx, sblob) = t.prepare_send(&desc(5), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        // Only some sockets arrive.
        let _s = raw_hello(&ri, &si, KIND_DATA, 0);
        let e = prx
            .connect(&sblob, Instant::now() + Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(matches!(e, CoreError::Timeout { peer: 5, .. }), "{e:?}");
        assert!(e.to_string().contains("rank 5"), "{e}");
    }

    /// A sender that vanishes without a goodbye (a crash) is "connection
    /// lost" at the receiver.
    #[test]
    fn crashed_sender_is_connection_lost() {
        let t = lo();
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_ptx, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let socks: Vec<TcpStream> = (0..ri.nsocks)
            .map(|i| raw_hello(&ri, &si, KIND_DATA, i as u8))
            .chain(std::iter::once(raw_hello(&ri, &si, KIND_CTRL, 0)))
            .collect();
        let mut rx = prx
            .connect(&sblob, Instant::now() + Duration::from_secs(10))
            .unwrap();
        rx.check_peer().unwrap();
        drop(socks);
        let e = wait_err(|| rx.check_peer());
        assert!(
            matches!(&e, CoreError::Peer { peer: 0, what, .. } if what.contains("connection lost")),
            "{e:?}"
        );
        assert!(rx.poll_peek().is_err());
    }

    /// A receiver that vanishes without a goodbye is "connection lost" at
    /// the sender; a frame that breaks the striping rule is a protocol
    /// error at the receiver.
    #[test]
    fn crashed_receiver_and_bad_frames() {
        let t = lo();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ri = RecvInfo {
            from: 0,
            to: 1,
            addr: listener.local_addr().unwrap(),
            token: [3; 16],
            slot_bytes: 65536,
            slots: 2,
            nsocks: 1,
        };
        let (ptx, _) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let mut tx = ptx
            .connect(&ri.encode(), Instant::now() + Duration::from_secs(10))
            .unwrap();
        let a = listener.accept().unwrap();
        let b = listener.accept().unwrap();
        tx.check_peer().unwrap();
        drop((a, b));
        let e = wait_err(|| tx.check_peer());
        assert!(
            matches!(&e, CoreError::Peer { peer: 1, what, .. } if what.contains("connection lost")),
            "{e:?}"
        );

        // A piece at the wrong offset.
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_p, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let mut socks: Vec<TcpStream> = (0..ri.nsocks)
            .map(|i| raw_hello(&ri, &si, KIND_DATA, i as u8))
            .chain(std::iter::once(raw_hello(&ri, &si, KIND_CTRL, 0)))
            .collect();
        let mut rx = prx
            .connect(&sblob, Instant::now() + Duration::from_secs(10))
            .unwrap();
        let h = info::FrameHeader {
            seq: 0,
            total: 10,
            offset: 5,
            len: 5,
            direct: false,
        };
        socks[0].write_all(&h.encode()).unwrap();
        socks[0].write_all(&[0; 5]).unwrap();
        let e = wait_err(|| rx.check_peer());
        assert!(matches!(e, CoreError::Protocol { peer: 0, .. }), "{e:?}");
    }
    /// A receiver fed by raw sockets (a hand-made sender): `(receiver,
    /// data sockets, control socket)`.
    fn raw_link(t: &SocketTransport) -> (Box<dyn RecvChannel>, Vec<TcpStream>, TcpStream) {
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_ptx, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let data: Vec<TcpStream> = (0..ri.nsocks)
            .map(|i| raw_hello(&ri, &si, KIND_DATA, i as u8))
            .collect();
        let ctrl = raw_hello(&ri, &si, KIND_CTRL, 0);
        let rx = prx
            .connect(&sblob, Instant::now() + Duration::from_secs(10))
            .unwrap();
        (rx, data, ctrl)
    }

    /// Writes the start of direct message 0 of `total` bytes (2 sockets):
    /// all of piece 0 and `part` bytes of piece 1. Returns the message.
    fn half_direct(data: &mut [TcpStream], total: usize, part: usize) -> Vec<u8> {
        let msg: Vec<u8> = (0..total).map(|i| (i * 13 + 1) as u8).collect();
        let pieces: Vec<_> = link::stripes(0, total, data.len()).collect();
        assert_eq!(pieces.len(), 2);
        for (j, &(s, off, len)) in pieces.iter().enumerate() {
            let h = info::FrameHeader {
                seq: 0,
                total: total as u32,
                offset: off as u32,
                len: len as u32,
                direct: true,
            };
            data[s].write_all(&h.encode()).unwrap();
            let n = if j == 0 { len } else { part };
            data[s].write_all(&msg[off..off + n]).unwrap();
        }
        msg
    }

    /// Reads the direct message at the head as far as it has arrived:
    /// `(done, bytes of out that match msg from the start of each piece)`.
    fn read_partly(rx: &mut dyn RecvChannel, out: &mut [u8]) -> Result<bool> {
        let inc = wait_for_incoming(rx);
        assert!(
            matches!(inc, Incoming::Remote(l) if l == out.len()),
            "{inc:?}"
        );
        let mut done = false;
        for _ in 0..50 {
            // SAFETY: `out` is valid for its length of writes.
            done = unsafe { rx.poll_read_remote(out.as_mut_ptr(), out.len()) }?;
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(done)
    }

    fn wait_for_incoming(rx: &mut dyn RecvChannel) -> Incoming {
        wait("a message", || rx.poll_peek_any().unwrap())
    }

    /// A sender that dies in the middle of a direct payload: the bytes that
    /// came are in place, the read does not finish, and then the receiver
    /// reports "connection lost" naming the rank.
    #[test]
    fn sender_death_during_a_direct_payload() {
        let t = lo();
        let (mut rx, mut data, ctrl) = raw_link(&t);
        let total = 200_000;
        let msg = half_direct(&mut data, total, 1000);
        let mut out = vec![0u8; total];
        assert!(
            !read_partly(&mut *rx, &mut out).unwrap(),
            "finished without the bytes"
        );
        let pieces: Vec<_> = link::stripes(0, total, 2).collect();
        let (_, off1, _) = pieces[1];
        assert!(out[..off1] == msg[..off1], "piece 0 corrupted");
        assert!(
            out[off1..off1 + 1000] == msg[off1..off1 + 1000],
            "piece 1 corrupted"
        );
        assert!(rx.release().is_err(), "released a half-read direct slot");
        drop((data, ctrl));
        // SAFETY: `out` is valid for `total` writes.
        let e = wait_err(|| unsafe { rx.poll_read_remote(out.as_mut_ptr(), total) }.map(|_| ()));
        assert!(
            matches!(&e, CoreError::Peer { peer: 0, what, .. } if what.contains("connection lost")),
            "{e:?}"
        );
        assert!(rx.check_peer().is_err());
    }

    /// A sender that aborts in the middle of a direct payload: the receiver
    /// gets its reason, not "connection lost".
    #[test]
    fn sender_abort_during_a_direct_payload() {
        let t = lo();
        let (mut rx, mut data, mut ctrl) = raw_link(&t);
        let total = 300_000;
        let _ = half_direct(&mut data, total, 4096);
        let mut out = vec![0u8; total];
        assert!(!read_partly(&mut *rx, &mut out).unwrap());
        ctrl.write_all(&info::ctrl_frame(
            info::CtrlKind::Abort,
            0,
            b"rank 0 hit NaNs",
        ))
        .unwrap();
        drop((data, ctrl));
        // SAFETY: `out` is valid for `total` writes.
        let e = wait_err(|| unsafe { rx.poll_read_remote(out.as_mut_ptr(), total) }.map(|_| ()));
        assert!(
            matches!(&e, CoreError::PeerAborted { peer: 0, reason, .. } if reason.contains("NaNs")),
            "{e:?}"
        );
    }

    /// A receiver that aborts (or is dropped) in the middle of a direct
    /// payload stops promptly; its helpers waiting for the engine exit.
    #[test]
    fn receiver_abort_during_a_direct_payload() {
        let t = lo();
        let (mut rx, mut data, _ctrl) = raw_link(&t);
        let total = 200_000;
        let _ = half_direct(&mut data, total, 10);
        let mut out = vec![0u8; total];
        assert!(!read_partly(&mut *rx, &mut out).unwrap());
        rx.abort("enough");
        // SAFETY: `out` is valid for `total` writes.
        let r = unsafe { rx.poll_read_remote(out.as_mut_ptr(), total) };
        assert!(matches!(r, Err(CoreError::Aborted(_))), "{r:?}");
        let start = Instant::now();
        drop(rx);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "drop took {:?}",
            start.elapsed()
        );

        let (mut rx, mut data, _ctrl) = raw_link(&t);
        let _ = half_direct(&mut data, total, 10);
        assert!(!read_partly(&mut *rx, &mut out).unwrap());
        let start = Instant::now();
        drop(rx);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "drop took {:?}",
            start.elapsed()
        );
    }
}

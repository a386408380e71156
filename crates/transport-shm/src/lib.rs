//! Shared-memory transport: POSIX shm slot FIFOs between processes of one host.
//!
//! # How the seam maps to shared memory
//!
//! Each directed connection sender → receiver is one POSIX shared-memory
//! object, created by the **receiver** in [`Transport::listen`] and named
//! `/braid-<receiver pid>-<random hex>-<from>-<to>`. It holds a control block
//! of atomics followed by `slots` slots of `slot_bytes` each (every slot
//! page-aligned); see the `segment` module for the exact layout.
//!
//! - **Set-up.** `listen` creates, sizes, maps and pre-faults the segment and
//!   returns a blob with its name, geometry, a random nonce and the receiver's
//!   pid. `prepare_send` allocates nothing and returns the sender's pid. The
//!   sender's `connect` opens and maps the segment, checks it against the blob
//!   (geometry, nonce), sets its `attached` flag and returns at once — it
//!   never waits for the receiver. The receiver's `connect` waits (sleeping,
//!   bounded by the deadline, watching the sender's pid) until `attached` is
//!   set, then `shm_unlink`s the name: from then on nothing is left in
//!   `/dev/shm`, whatever happens to either process. The sender unlinks too
//!   right after attaching (best effort, `ENOENT` ignored), which closes the
//!   window in which a receiver crash would leak the name. If set-up fails or
//!   a pending receiver is dropped, the receiver unlinks.
//! - **Credits.** `head` counts messages the sender committed, `tail`
//!   messages the receiver released; both only grow, and messages are
//!   released in order. Message `n` is announced in *box* `n % boxes` (one
//!   cache line each, at least 256 of them: see `segment::boxes_for`),
//!   which holds its length word and `n + 1` (`seq`), stored last; the
//!   receiver polls that one line instead of `head`. A message of at most
//!   48 bytes (an 8-byte AllReduce with its operation header is 40) travels
//!   inside the box, so it reaches the receiver in a single cache-line
//!   transfer, as in Open MPI's fast boxes, and needs only a free box:
//!   `head - tail < boxes` ([`SendChannel::poll_acquire_small`]). Any other
//!   message also takes slot `n % slots`, free iff `head - tail < slots`
//!   (message `n - slots`, its last user, was released).
//! - **Data path.** `poll_acquire`/`commit`/`poll_peek`/`release`/
//!   `poll_drained` are plain loads and stores on the mapping, never a system
//!   call, so the engine can spin on them.
//! - **Liveness.** Each side has `closed` and `abort` flags (plus a short
//!   abort reason) in the segment. `check_peer` reports the peer's abort or
//!   close as [`CoreError::PeerAborted`], and a dead peer process
//!   (`kill(pid, 0)` fails with `ESRCH`, or `/proc/<pid>/stat` says zombie) as
//!   [`CoreError::Peer`] "process `<pid>` is gone". A receiver whose sender
//!   closed normally keeps working until it has read every committed slot.
//! - **Direct (single-copy) transfers.** At connect time the receiver probes
//!   whether it may read the sender's memory (`process_vm_readv` of a known
//!   word). If so, `commit_direct` publishes a slot whose length word has
//!   the top bit set and whose first word is the address of the bytes in
//!   the sender's memory; the receiver copies them with `process_vm_readv`
//!   straight into their destination, then releases the slot. When the
//!   bytes lie in a registered [`HostBuffer`], words 4–7 of the slot name
//!   its memory file (inode, descriptor, base, size) and the receiver
//!   copies from its own read-only mapping of that file instead, with no
//!   system call per transfer (see the `host` module; any check that fails
//!   falls back to `process_vm_readv`).
//! - **Shared direct transfers.** A direct transfer of at least four chunks
//!   (`BRAID_SHM_HELP_CHUNK`, default 256 KiB, at most 64 chunks) is split
//!   between both processes, since the sender's core is otherwise idle
//!   while the receiver copies: the receiver writes its destination address
//!   and the chunk size into the slot's second and third words and opens a
//!   claim word (`generation | slot | front | back`: the unclaimed chunks)
//!   in the control block. Both sides claim with compare-and-swap (which
//!   fails if the offer changed): the receiver from the front, half of what
//!   is left at a time (all of it once a first read passed without the
//!   sender taking a chunk), the sender one chunk from the back; the
//!   receiver reads its chunks, the sender — from `poll_help`, which the
//!   engine calls while it waits for a slot or for its references to drain
//!   (not while it waits for data: then it has work of its own) — writes its own with
//!   `process_vm_writev` and counts them in `done`. The receiver reports
//!   the transfer complete once it ran out of chunks and `done` covers the
//!   sender's, and clears the claim word before it releases the slot (so
//!   the sender never mistakes it for an offer of the slot's next
//!   transfer); a chunk the sender could not write is flagged in `failed`
//!   and copied by the receiver. Before the receiver gives up on a transfer
//!   (an error, `abort`, drop) it closes the claim word and waits for the
//!   sender's claimed chunks (at most one second, or until the sender's
//!   process is gone), so nothing writes the destination after the engine
//!   got it back. Side by side on 2 ranks, Broadcast of 16 and 64 MiB ran
//!   1.3-1.6x faster with sharing than without; `BRAID_SHM_HELP=0` turns it
//!   off.
//!
//! # Memory orderings
//!
//! The sender writes the payload into the slot (or the box) and the length
//! word into the box, then publishes with `seq.store(Release)` in the box
//! (and `head.store(Release)`, which only the receiver's slow path reads).
//! The receiver loads `seq` with `Acquire`; once it reads the message's
//! number, payload and length are visible, so the length load itself can be
//! `Relaxed`.
//! The receiver's `tail.store(Release)` after reading a slot pairs with the
//! sender's `tail.load(Acquire)` before it reuses that slot, so the
//! receiver's reads of the old message happen before the sender overwrites
//! it. `poll_drained` loads `tail` with `Acquire` for the same reason (after
//! it says true, the sender may reuse or free whatever it sent from). Flags
//! are stored with `Release` after the data they describe (the abort reason,
//! the final `head`) and loaded with `Acquire`.
//!
//! # Tuning
//!
//! `BRAID_SHM_SLOT_BYTES` (default 128 KiB; at least 4096, a multiple of 64)
//! and `BRAID_SHM_SLOTS` (default 16; 2 to 1024), read by
//! [`ShmTransport::new`]. The segment is mapped with `MAP_POPULATE`, touched
//! page by page on creation and advised `MADV_HUGEPAGE`, so the hot path does
//! not take first-use page faults.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{
    Incoming, PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, SlotBuf, Transport,
};
use braid_core::types::MemKind;

mod host;
mod info;
mod segment;

pub use host::{HostBuffer, MAPS_PER_PEER};

use info::{RecvInfo, SendInfo};
use segment::{Layout, SegError, Segment, Side};

/// The connect-info blobs over plain bytes, for the fuzz targets in `fuzz/`
/// and their seed corpus. Not part of the API: the signatures follow the
/// wire format and change with it.
#[doc(hidden)]
pub mod fuzzing {
    use crate::info;

    /// A receiver blob's fields and the segment geometry it implies.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct RecvBlob {
        pub pid: u32,
        pub from: u32,
        pub to: u32,
        pub slots: u32,
        pub slot_bytes: u64,
        pub nonce: u64,
        pub name: String,
        /// Bytes of the segment the blob describes.
        pub segment_bytes: usize,
    }

    /// Decodes a receiver blob as a sender's `connect` does.
    pub fn decode_recv(b: &[u8]) -> Result<RecvBlob, String> {
        let (r, layout) = info::RecvInfo::decode(b)?;
        Ok(RecvBlob {
            pid: r.pid,
            from: r.from,
            to: r.to,
            slots: r.slots,
            slot_bytes: r.slot_bytes,
            nonce: r.nonce,
            name: r.name,
            segment_bytes: layout.total,
        })
    }

    /// Encodes a receiver blob as `listen` does.
    pub fn encode_recv(r: &RecvBlob) -> Vec<u8> {
        info::RecvInfo {
            pid: r.pid,
            from: r.from,
            to: r.to,
            slots: r.slots,
            slot_bytes: r.slot_bytes,
            nonce: r.nonce,
            name: r.name.clone(),
        }
        .encode()
    }

    /// Decodes a sender blob as a receiver's `connect` does: `(pid, from, to)`.
    pub fn decode_send(b: &[u8]) -> Result<(u32, u32, u32), String> {
        info::SendInfo::decode(b).map(|s| (s.pid, s.from, s.to))
    }

    /// Encodes a sender blob as `prepare_send` does.
    pub fn encode_send(pid: u32, from: u32, to: u32) -> Vec<u8> {
        info::SendInfo { pid, from, to }.encode()
    }

    /// Whether `name` is a segment name this crate could have made.
    pub fn valid_name(name: &str) -> bool {
        info::valid_name(name)
    }

    /// Largest segment name, in bytes.
    pub const MAX_NAME: usize = info::MAX_NAME;
}

const NAME: &str = "shm";

/// Environment variable: bytes per slot.
pub const ENV_SLOT_BYTES: &str = "BRAID_SHM_SLOT_BYTES";
/// Environment variable: slots per connection.
pub const ENV_SLOTS: &str = "BRAID_SHM_SLOTS";
/// Environment variable: `0` disables direct (single-copy) transfers.
pub const ENV_DIRECT: &str = "BRAID_SHM_DIRECT";

/// Marks a slot length word whose slot holds the sender-side address of the
/// payload (a direct transfer) instead of the payload.
const DIRECT_FLAG: u64 = 1 << 63;
/// Length-word flag: the payload is in the slot's box, not in the slot
/// (messages of at most [`segment::INLINE_BYTES`]).
const INLINE_FLAG: u64 = 1 << 62;
/// First of the four words of a direct slot that name the registered host
/// buffer the piece lies in (inode, descriptor, base, size; inode 0: none;
/// see [`HostBuffer`]). Words 1 and 2 are the receiver's (help offers).
const REGION_WORD: usize = 4;

/// Environment variable: `0` stops receivers from sharing the copy of a
/// direct transfer with its sender (see the crate docs, "Shared direct transfers").
pub const ENV_HELP: &str = "BRAID_SHM_HELP";

/// Environment variable: the smallest chunk of a shared direct transfer
/// (bytes, a multiple of 4096; default 256 KiB). Transfers shorter than four
/// chunks are not shared. Small values are for tests.
pub const ENV_HELP_CHUNK: &str = "BRAID_SHM_HELP_CHUNK";

/// Default smallest chunk of a shared direct transfer: side by side, 256 KiB
/// pieces of a 2 MiB transfer split between two processes ran 1.5-1.8x
/// faster than one reader.
const HELP_CHUNK_MIN: usize = 256 * 1024;
/// A shared direct transfer is cut into at most this many chunks.
const HELP_CHUNKS_MAX: usize = 64;
/// Transfers of fewer chunks are not shared: side by side, sharing 512 KiB
/// pieces in two chunks made a 1 MiB AllGather on 2 ranks 10% slower (20.7
/// against 22.7 µs; two system calls instead of one, and the offer), while
/// Broadcast's 1 MiB pieces (four chunks) gain from it.
const HELP_CHUNKS_MIN: usize = 4;

/// The receiver's smallest chunk, or `None` when sharing is off
/// ([`ENV_HELP`] is `0`).
fn help_chunk_min() -> Result<Option<usize>> {
    if std::env::var(ENV_HELP).is_ok_and(|v| v.trim() == "0") {
        return Ok(None);
    }
    match std::env::var(ENV_HELP_CHUNK) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<usize>() {
            Ok(n) if n >= 4096 && n % 4096 == 0 => Ok(Some(n)),
            _ => Err(CoreError::InvalidArgument(format!(
                "{ENV_HELP_CHUNK}={v:?}: give a multiple of 4096 bytes, e.g. 262144"
            ))),
        },
        _ => Ok(Some(HELP_CHUNK_MIN)),
    }
}

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

fn direct_enabled() -> bool {
    std::env::var(ENV_DIRECT)
        .map(|v| v.trim() != "0")
        .unwrap_or(true)
}

/// The shared-memory transport. Cheap to clone; holds only its parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmTransport {
    slot_bytes: usize,
    slots: usize,
}

impl Default for ShmTransport {
    fn default() -> Self {
        ShmTransport {
            slot_bytes: Self::DEFAULT_SLOT_BYTES,
            slots: Self::DEFAULT_SLOTS,
        }
    }
}

impl ShmTransport {
    /// Default bytes per slot. 128 KiB pieces stay in the L2 cache between
    /// the copy into and out of a slot; with 16 slots the ring (2 MiB) gives
    /// enough slack to pipeline (measured with braid-perf, 2 ranks, against
    /// 512 KiB × 8 and 64 KiB × 32: best or equal for AllReduce, AllGather,
    /// Broadcast from 1 to 64 MiB).
    pub const DEFAULT_SLOT_BYTES: usize = 128 * 1024;
    /// Default slots per connection.
    pub const DEFAULT_SLOTS: usize = 16;

    /// Parameters from `BRAID_SHM_SLOT_BYTES` / `BRAID_SHM_SLOTS`, defaults
    /// where unset. An invalid value is logged and replaced by the default;
    /// use [`ShmTransport::from_env`] to get the error instead.
    pub fn new() -> Self {
        match Self::from_env() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("{e}; using the shm defaults");
                Self::default()
            }
        }
    }

    /// Parameters from the environment; an error if a variable is set but
    /// invalid.
    pub fn from_env() -> Result<Self> {
        fn var(name: &str, default: usize) -> Result<usize> {
            match std::env::var(name) {
                Err(_) => Ok(default),
                Ok(s) => s.trim().parse().map_err(|_| {
                    CoreError::InvalidArgument(format!(
                        "{name}={s:?} is not a number of {}",
                        if name == ENV_SLOTS { "slots" } else { "bytes" }
                    ))
                }),
            }
        }
        Self::with_params(
            var(ENV_SLOT_BYTES, Self::DEFAULT_SLOT_BYTES)?,
            var(ENV_SLOTS, Self::DEFAULT_SLOTS)?,
        )
    }

    /// Explicit parameters: `slot_bytes` a multiple of 64, 4096 to 1 GiB;
    /// `slots` 2 to 1024.
    pub fn with_params(slot_bytes: usize, slots: usize) -> Result<Self> {
        if Layout::new(slot_bytes, slots).is_none() {
            return Err(CoreError::InvalidArgument(format!(
                "shm geometry {slots} slots x {slot_bytes} bytes is invalid: \
                 {ENV_SLOT_BYTES} must be a multiple of 64 between 4096 and {} \
                 and {ENV_SLOTS} between 2 and {}",
                segment::MAX_SLOT_BYTES,
                segment::MAX_SLOTS
            )));
        }
        Ok(ShmTransport { slot_bytes, slots })
    }

    /// Bytes per slot of the connections this transport listens for.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots per connection this transport listens for.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// Names in `/dev/shm` that start with `braid-` (for leak checks).
pub fn leftover_segments() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with("braid-"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn peer_err(peer: u32, what: String) -> CoreError {
    CoreError::Peer {
        transport: NAME,
        peer,
        what,
        source: None,
    }
}

fn seg_err(peer: u32, doing: &str, e: SegError) -> CoreError {
    peer_err(peer, format!("{doing}: {e}"))
}

fn protocol(peer: u32, detail: String) -> CoreError {
    CoreError::Protocol { peer, detail }
}

fn random_u64() -> Result<u64> {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).map_err(|e| CoreError::Unavailable {
        transport: NAME,
        reason: format!("no randomness for segment names: {e}"),
    })?;
    Ok(u64::from_le_bytes(b))
}

impl Transport for ShmTransport {
    fn kind(&self) -> braid_core::transport::TransportKind {
        braid_core::transport::TransportKind::Shm
    }

    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }

    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool {
        me.host_id == peer.host_id
    }

    fn listen(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        let layout = Layout::new(self.slot_bytes, self.slots)
            .ok_or_else(|| CoreError::InvalidArgument("invalid shm geometry".into()))?;
        let pid = std::process::id();
        let nonce = random_u64()?;
        let name = format!(
            "/braid-{pid}-{:016x}-{}-{}",
            random_u64()?,
            peer.rank,
            me.rank
        );
        let seg = Segment::create(&name, layout, nonce, pid).map_err(|e| {
            seg_err(
                peer.rank,
                &format!(
                    "creating shared memory {name} ({} bytes; is /dev/shm full?)",
                    layout.total
                ),
                e,
            )
        })?;
        tracing::debug!(segment = %name, from = peer.rank, to = me.rank, "shm listen");
        let blob = RecvInfo {
            pid,
            from: peer.rank,
            to: me.rank,
            slots: layout.slots as u32,
            slot_bytes: layout.slot_bytes as u64,
            nonce,
            name,
        }
        .encode();
        let pending = ShmPendingRecv {
            seg: Some(seg),
            me: me.rank,
            peer: peer.rank,
        };
        Ok((Box::new(pending), blob))
    }

    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)> {
        let blob = SendInfo {
            pid: std::process::id(),
            from: me.rank,
            to: peer.rank,
        }
        .encode();
        Ok((
            Box::new(ShmPendingSend {
                me: me.rank,
                peer: peer.rank,
            }),
            blob,
        ))
    }
}

/// Liveness of a process: `Err(what)` if it is gone.
fn process_alive(pid: u32) -> std::result::Result<(), String> {
    use nix::sys::signal::kill;
    use nix::unistd::Pid;
    // `pid` was validated to be in 1..=i32::MAX when the blob was parsed.
    // EPERM means it exists but belongs to someone else; only ESRCH is proof.
    if let Err(nix::errno::Errno::ESRCH) = kill(Pid::from_raw(pid as i32), None) {
        return Err(format!("process {pid} is gone"));
    }
    // A killed child that its parent has not reaped yet still answers
    // kill(2); /proc tells us it is a zombie.
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Format: "pid (comm) S ..."; comm may contain spaces and parens.
        if let Some(state) = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
        {
            if state == "Z" || state == "X" {
                return Err(format!("process {pid} is gone (exited, not yet reaped)"));
            }
        }
    }
    Ok(())
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

/// The checks both ends share: peer abort, then peer process liveness.
fn check_abort_and_process(peer_side: &Side, peer: u32, peer_pid: u32) -> Result<()> {
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

/// A receiving end between `listen` and `connect`.
#[derive(Debug)]
struct ShmPendingRecv {
    /// `Some` until connect takes it; dropping it unlinks the name.
    seg: Option<Segment>,
    me: u32,
    peer: u32,
}

impl Drop for ShmPendingRecv {
    fn drop(&mut self) {
        if let Some(seg) = &self.seg {
            // Tell a sender that may have attached that nobody will read.
            seg.header().receiver.0.closed.store(1, Ordering::Release);
        }
        // Segment's drop unmaps and (still owning the name) unlinks.
    }
}

impl PendingRecv for ShmPendingRecv {
    fn connect(
        mut self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn RecvChannel>> {
        let peer = self.peer;
        let start = Instant::now();
        let info = SendInfo::decode(sender_info)
            .map_err(|e| protocol(peer, format!("shm sender connect-info: {e}")))?;
        if info.from != peer || info.to != self.me {
            return Err(protocol(
                peer,
                format!(
                    "shm sender connect-info is for {} -> {}, expected {} -> {}",
                    info.from, info.to, peer, self.me
                ),
            ));
        }
        let seg = self.seg.as_ref().expect("pending receiver used twice");
        let hdr = seg.header();
        let sender = &hdr.sender.0;
        let mut spins = 0u32;
        let mut last_pid_check = start;
        // Acquire: pairs with the sender's Release store of `attached`, so
        // its pid store is visible below.
        while sender.attached.load(Ordering::Acquire) == 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(CoreError::Timeout {
                    transport: NAME,
                    peer,
                    waiting_for: "the sender to attach to the shared-memory segment",
                    after: now - start,
                });
            }
            if now - last_pid_check >= Duration::from_millis(50) {
                last_pid_check = now;
                check_abort_and_process(sender, peer, info.pid)?;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                let nap = Duration::from_micros(if spins < 1024 { 50 } else { 1000 });
                std::thread::sleep(nap.min(deadline.saturating_duration_since(now)));
            }
        }
        let attached_pid = sender.pid.load(Ordering::Relaxed);
        if attached_pid != info.pid {
            return Err(protocol(
                peer,
                format!(
                    "shm segment {} was attached by process {attached_pid}, but rank {peer} is process {}",
                    seg.name(),
                    info.pid
                ),
            ));
        }
        // Single-copy transfers need this process to read the sender's
        // memory (same user, ptrace not forbidden by Yama or seccomp):
        // prove it on the word the sender advertised before enabling them.
        let probe = sender.probe_addr.load(Ordering::Relaxed);
        let mut word = 0u64;
        // SAFETY: `word` is a local u64, valid for 8 bytes of writes.
        let readable = direct_enabled()
            && probe != 0
            && unsafe { segment::read_process(info.pid, probe, (&mut word as *mut u64).cast(), 8) }
                .is_ok()
            && word == segment::HEADER_MAGIC;
        if readable {
            // Release: pairs with the sender's Acquire in can_send_direct.
            hdr.receiver.0.direct_ok.store(1, Ordering::Release);
        }
        tracing::debug!(peer, direct = readable, "shm single-copy probe");
        let mut seg = self.seg.take().expect("checked above");
        let layout = seg.layout();
        // Both processes have it mapped: the name is no longer needed.
        seg.unlink()
            .map_err(|e| seg_err(peer, "unlinking the shm segment", e))?;
        tracing::debug!(segment = %seg.name(), peer, "shm receiver connected");
        Ok(Box::new(ShmRecv {
            seg,
            peer,
            peer_pid: info.pid,
            slots: layout.slots as u64,
            boxes: layout.boxes as u64,
            slot_bytes: layout.slot_bytes,
            tail: 0,
            tail_slot: 0,
            tail_box: 0,
            head_cache: 0,
            peeked: false,
            remote: None,
            remote_region: None,
            files: host::PeerFiles::new(peer, info.pid),
            stream: false,
            aborted: None,
            help_chunk: help_chunk_min()?,
            generation: 0,
            sharing: None,
        }))
    }
}

/// A sending end between `prepare_send` and `connect` (holds no resources).
#[derive(Debug)]
struct ShmPendingSend {
    me: u32,
    peer: u32,
}

impl PendingSend for ShmPendingSend {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        _deadline: Instant,
    ) -> Result<Box<dyn SendChannel>> {
        let peer = self.peer;
        let (info, layout) = RecvInfo::decode(receiver_info)
            .map_err(|e| protocol(peer, format!("shm receiver connect-info: {e}")))?;
        if info.from != self.me || info.to != peer {
            return Err(protocol(
                peer,
                format!(
                    "shm receiver connect-info is for {} -> {}, expected {} -> {}",
                    info.from, info.to, self.me, peer
                ),
            ));
        }
        let mut seg = Segment::open(&info.name, layout, info.nonce)
            .map_err(|e| seg_err(peer, "attaching to the receiver's shm segment", e))?;
        let hdr = seg.header();
        check_abort_and_process(&hdr.receiver.0, peer, info.pid)?;
        if hdr.receiver.0.closed.load(Ordering::Acquire) != 0 {
            return Err(CoreError::PeerAborted {
                transport: NAME,
                peer,
                reason: "the receiver gave up before the sender attached".into(),
            });
        }
        let me = &hdr.sender.0;
        me.pid.store(std::process::id(), Ordering::Relaxed);
        // Our address of the header's magic word: the receiver's probe.
        me.probe_addr
            .store(&hdr.magic as *const _ as u64, Ordering::Relaxed);
        // Release: the receiver that sees `attached` (Acquire) sees our pid.
        if me
            .attached
            .compare_exchange(0, 1, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            return Err(protocol(
                peer,
                format!("shm segment {} already has a sender attached", info.name),
            ));
        }
        // Best effort: both sides have it mapped now; the receiver unlinks
        // too and ignores ENOENT.
        let _ = seg.unlink();
        tracing::debug!(segment = %info.name, peer, "shm sender connected");
        Ok(Box::new(ShmSend {
            seg,
            peer,
            peer_pid: info.pid,
            slots: layout.slots as u64,
            boxes: layout.boxes as u64,
            slot_bytes: layout.slot_bytes,
            head: 0,
            head_slot: 0,
            head_box: 0,
            tail_cache: 0,
            acquired: Acquired::Nothing,
            direct: false,
            help_failed: false,
            aborted: None,
        }))
    }
}

/// What [`ShmSend`] handed out for the message it is about to commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Acquired {
    Nothing,
    /// Slot `head % slots` (and box `head % boxes`).
    Slot,
    /// Only the inline payload of box `head % boxes`.
    Inline,
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

/// The sending end of a connected segment.
#[derive(Debug)]
struct ShmSend {
    seg: Segment,
    peer: u32,
    peer_pid: u32,
    slots: u64,
    boxes: u64,
    slot_bytes: usize,
    /// Messages committed (only this side writes the shared `head`).
    head: u64,
    /// `head % slots`, kept without a division (the hot path's index).
    head_slot: usize,
    /// `head % boxes`.
    head_box: usize,
    /// Last `tail` seen.
    tail_cache: u64,
    /// What was handed out for the next message and not committed yet.
    acquired: Acquired,
    /// The receiver proved it can read our memory (cached once seen).
    direct: bool,
    /// A write into the receiver's memory failed: no more helping.
    help_failed: bool,
    /// Set by our own `abort`.
    aborted: Option<String>,
}

impl ShmSend {
    /// Publish the acquired message with length word `word`.
    fn publish(&mut self, word: u64) -> Result<()> {
        self.not_aborted()?;
        if self.acquired == Acquired::Nothing {
            return Err(CoreError::InvalidArgument(
                "shm commit without a slot from poll_acquire".into(),
            ));
        }
        let idx = self.head_box;
        // Relaxed: ordered before the receiver's read by the Release below.
        self.seg.len_word(idx).store(word, Ordering::Relaxed);
        self.head += 1;
        self.head_slot = next_slot(self.head_slot, self.slots);
        self.head_box = next_slot(self.head_box, self.boxes);
        // Release: the payload (or address) and length written before become
        // visible to the receiver's Acquire load of the box's `seq` that
        // sees this message number — the one line the receiver polls.
        self.seg.box_seq(idx).store(self.head, Ordering::Release);
        // `head` is read only by the receiver's `check_peer` (its slow path:
        // a line it rarely reads).
        self.seg.header().head.0.store(self.head, Ordering::Release);
        self.acquired = Acquired::Nothing;
        Ok(())
    }

    fn not_aborted(&self) -> Result<()> {
        match &self.aborted {
            Some(r) => Err(CoreError::Aborted(r.clone())),
            None => Ok(()),
        }
    }

    /// Whether fewer than `limit` messages are outstanding (`slots` for a
    /// message that takes a slot, `boxes` for one that fits its box); the
    /// shared `tail` is loaded only when the cached one says no.
    fn credit(&mut self, limit: u64) -> Result<bool> {
        Ok(self.head - self.tail_cache < limit || self.head - self.load_tail()? < limit)
    }

    /// Loads `tail` (Acquire: the receiver's reads of released slots happen
    /// before our next writes to them) and validates it.
    fn load_tail(&mut self) -> Result<u64> {
        let t = self.seg.header().tail.0.load(Ordering::Acquire);
        if t > self.head || t < self.tail_cache {
            return Err(protocol(
                self.peer,
                format!(
                    "shm receiver released {t} slots but {} were committed (corrupt segment)",
                    self.head
                ),
            ));
        }
        self.tail_cache = t;
        Ok(t)
    }
}

impl SendChannel for ShmSend {
    fn peer(&self) -> u32 {
        self.peer
    }

    fn transport(&self) -> &'static str {
        NAME
    }

    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slots(&self) -> usize {
        self.slots as usize
    }

    fn poll_acquire(&mut self) -> Result<Option<SlotBuf>> {
        self.not_aborted()?;
        if !self.credit(self.slots)? {
            return Ok(None);
        }
        self.acquired = Acquired::Slot;
        Ok(Some(SlotBuf {
            ptr: self.seg.slot_ptr(self.head_slot),
            cap: self.slot_bytes,
        }))
    }

    /// A message of at most [`segment::INLINE_BYTES`] is written straight
    /// into its box and needs a free box only (`boxes` ≥ `slots` of them):
    /// a sender of small messages runs further ahead of a receiver that is
    /// not running.
    fn poll_acquire_small(&mut self, len: usize) -> Result<Option<SlotBuf>> {
        if len > segment::INLINE_BYTES {
            return self.poll_acquire();
        }
        self.not_aborted()?;
        if !self.credit(self.boxes)? {
            return Ok(None);
        }
        self.acquired = Acquired::Inline;
        Ok(Some(SlotBuf {
            ptr: self.seg.inline_ptr(self.head_box),
            cap: segment::INLINE_BYTES,
        }))
    }

    fn commit(&mut self, len: usize) -> Result<()> {
        if self.acquired == Acquired::Inline {
            // Written in place by the caller.
            if len > segment::INLINE_BYTES {
                return Err(CoreError::InvalidArgument(format!(
                    "shm commit of {len} bytes into a box acquired for at most {}",
                    segment::INLINE_BYTES
                )));
            }
            return self.publish(len as u64 | INLINE_FLAG);
        }
        if len > self.slot_bytes {
            return Err(CoreError::InvalidArgument(format!(
                "shm commit of {len} bytes into a {}-byte slot",
                self.slot_bytes
            )));
        }
        if len <= segment::INLINE_BYTES && self.acquired == Acquired::Slot {
            // A small message travels in the box line the receiver polls.
            // SAFETY: the acquired slot and box are ours to write until
            // published; both hold at least `len` bytes and do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.seg.slot_ptr(self.head_slot),
                    self.seg.inline_ptr(self.head_box),
                    len,
                )
            };
            return self.publish(len as u64 | INLINE_FLAG);
        }
        self.publish(len as u64)
    }

    fn can_send_direct(&mut self) -> bool {
        if !self.direct {
            // Acquire: pairs with the receiver's Release after its probe.
            self.direct = self
                .seg
                .header()
                .receiver
                .0
                .direct_ok
                .load(Ordering::Acquire)
                != 0;
        }
        self.direct
    }

    unsafe fn commit_direct(&mut self, ptr: *const u8, len: usize) -> Result<()> {
        if !self.can_send_direct() {
            return Err(CoreError::Unavailable {
                transport: NAME,
                reason: format!("rank {} cannot read this process's memory", self.peer),
            });
        }
        if self.acquired != Acquired::Slot || len as u64 >= DIRECT_FLAG {
            return Err(CoreError::InvalidArgument(
                "shm direct commit without a slot, or of an impossible length".into(),
            ));
        }
        let slot = self.seg.slot_ptr(self.head_slot).cast::<u64>();
        // A piece in a registered host buffer: name its file too (words
        // REGION_WORD.., after the receiver's help words), so the receiver
        // can map it and copy without the kernel.
        let r = host::region_of(ptr, len);
        let words = r.map_or([0; 4], |r| [r.ino, r.fd, r.base, r.len]);
        // SAFETY: the acquired slot is ours to write until published; slots
        // are page-aligned and at least 4096 bytes, so these aligned u64s
        // (words 0 and REGION_WORD..REGION_WORD+4) fit.
        unsafe {
            slot.write(ptr as u64);
            for (i, w) in words.into_iter().enumerate() {
                slot.add(REGION_WORD + i).write(w);
            }
        }
        self.publish(len as u64 | DIRECT_FLAG)
    }

    fn poll_drained(&mut self) -> Result<bool> {
        self.not_aborted()?;
        Ok(self.load_tail()? == self.head)
    }

    /// Writes one chunk of the direct transfer the receiver offered to share
    /// (see `ShmRecv::poll_read_remote`), if a chunk is left.
    fn poll_help(&mut self) -> Result<bool> {
        if !self.direct || self.aborted.is_some() || self.help_failed {
            return Ok(false);
        }
        // Acquire: pairs with the receiver's Release store of the claim
        // word, after it wrote the destination into the slot.
        let w = self.seg.header().help.0.claim.load(Ordering::Acquire);
        let c = Claim::unpack(w);
        let bx = c.slot;
        if c.generation == 0 || bx >= self.boxes as usize || c.front >= c.back {
            return Ok(false);
        }
        // Only a message we committed and the receiver has not released can
        // be on offer; anything else is a stale word: leave it.
        let tail = self.load_tail()?;
        let t = tail + (bx as u64 + self.boxes - tail % self.boxes) % self.boxes;
        if t >= self.head {
            return Ok(false);
        }
        // The last unclaimed chunk is ours to take.
        let k = c.back - 1;
        // Relaxed: our own store (this thread) when we committed message t.
        let word = self.seg.len_word(bx).load(Ordering::Relaxed);
        if word & DIRECT_FLAG == 0 {
            return Ok(false);
        }
        let len = (word & !DIRECT_FLAG) as usize;
        let slot = self.seg.slot_ptr((t % self.slots) as usize).cast::<u64>();
        // SAFETY: slots are page-aligned and at least 4096 bytes; the third
        // word holds the receiver's chunk size, written before the claim
        // word we loaded with Acquire (an offer of a released message was
        // rejected above; one replaced since fails the claim below, before
        // anything is written).
        let chunk = unsafe { slot.add(2).read_volatile() } as usize;
        if chunk < 4096 || k as usize >= len.div_ceil(chunk) {
            return Ok(false);
        }
        let h = &self.seg.header().help.0;
        // Claim chunk k; losing the race (the receiver claimed more, or a
        // new offer replaced this one) is not an error: try again next time.
        let mine = Claim { back: k, ..c }.pack();
        if h.claim
            .compare_exchange(w, mine, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return Ok(false);
        }
        // SAFETY: the slot is committed and not released (checked above), so
        // it holds our address in word 0 (our own write) and the receiver's
        // destination in word 1 (written before the claim word we loaded
        // with Acquire; not rewritten while the claim stays open).
        let (src, dst) = unsafe { (slot.read_volatile(), slot.add(1).read_volatile()) };
        let off = k as usize * chunk;
        let n = chunk.min(len - off);
        // SAFETY: `src..src+len` is the memory we passed to `commit_direct`,
        // valid and unchanged until the receiver released the slot (its
        // contract), which it does only after this chunk is counted done.
        let res = unsafe {
            segment::write_process(
                self.peer_pid,
                dst + off as u64,
                (src as usize + off) as *const u8,
                n,
            )
        };
        if res.is_err() {
            // The receiver copies the chunk itself (whatever the reason:
            // a permission quirk or a receiver that went away); stop helping
            // on this channel.
            self.help_failed = true;
            h.failed.store(
                u64::from(c.generation) << 32 | u64::from(k),
                Ordering::Release,
            );
        }
        // Release: our writes into the destination happen before the
        // receiver's Acquire load that sees this count.
        h.done.fetch_add(1, Ordering::Release);
        Ok(true)
    }

    fn check_peer(&mut self) -> Result<()> {
        let hdr = self.seg.header();
        let recv = &hdr.receiver.0;
        check_abort_and_process(recv, self.peer, self.peer_pid)?;
        if recv.closed.load(Ordering::Acquire) != 0 {
            // A peer that aborted and then exited published its reason
            // before it closed (Acquire above pairs with its Release): the
            // check before the `closed` load may have run just before that.
            let reason = abort_reason(recv).unwrap_or_else(|| "the receiver closed its end".into());
            return Err(CoreError::PeerAborted {
                transport: NAME,
                peer: self.peer,
                reason,
            });
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_owned());
        }
        publish_abort(&self.seg.header().sender.0, reason);
    }
}

impl Drop for ShmSend {
    fn drop(&mut self) {
        // Release: after our last `head` store, so a receiver that sees
        // `closed` (Acquire) also sees every committed slot.
        self.seg
            .header()
            .sender
            .0
            .closed
            .store(1, Ordering::Release);
    }
}

/// The receiving end of a connected segment.
#[derive(Debug)]
struct ShmRecv {
    seg: Segment,
    peer: u32,
    peer_pid: u32,
    slots: u64,
    boxes: u64,
    slot_bytes: usize,
    /// Messages released (only this side writes the shared `tail`).
    tail: u64,
    /// `tail % slots`, kept without a division.
    tail_slot: usize,
    /// `tail % boxes` (polled in a spin loop).
    tail_box: usize,
    /// Last `head` seen.
    head_cache: u64,
    /// A slot was handed out by `poll_peek` and not released yet.
    peeked: bool,
    /// The peeked slot is a direct transfer: (sender address, length).
    remote: Option<(u64, usize)>,
    /// The registered host buffer the peeked direct transfer lies in, if
    /// the sender named one.
    remote_region: Option<host::Region>,
    /// Peer host buffers mapped here.
    files: host::PeerFiles,
    /// Copies from them use streaming stores (`RecvChannel::stream_hint`).
    stream: bool,
    /// Set by our own `abort`.
    aborted: Option<String>,
    /// Smallest chunk of a direct transfer shared with the sender; `None`:
    /// not shared ([`ENV_HELP`], [`ENV_HELP_CHUNK`]).
    help_chunk: Option<usize>,
    /// Generation of the last shared transfer (22 bits, never 0).
    generation: u32,
    /// The direct transfer being shared with the sender, if any.
    sharing: Option<Sharing>,
}

/// A direct transfer the receiver offered to share ([`segment::Help`]).
#[derive(Debug)]
struct Sharing {
    dst: *mut u8,
    len: usize,
    chunk: usize,
    chunks: u32,
    /// Chunks this side claimed (and copied).
    mine: u32,
    /// No chunk is left unclaimed: the rest is the sender's.
    exhausted: bool,
}

// SAFETY: `dst` is only a destination address the engine lent us for the
// transfer (`poll_read_remote`'s contract); the channel, like every channel,
// is used by one thread at a time.
unsafe impl Send for Sharing {}

impl ShmRecv {
    /// Loads `head` (Acquire: pairs with the sender's Release in `commit`,
    /// making every committed payload and length visible) and validates it.
    fn load_head(&mut self) -> Result<u64> {
        let h = self.seg.header().head.0.load(Ordering::Acquire);
        if h < self.head_cache || h - self.tail > self.boxes {
            return Err(protocol(
                self.peer,
                format!(
                    "shm sender committed {h} messages with {} released and {} boxes (corrupt segment)",
                    self.tail, self.boxes
                ),
            ));
        }
        self.head_cache = h;
        Ok(h)
    }

    /// The error for a failed read of the sender's memory.
    fn read_error(&self, e: nix::errno::Errno) -> CoreError {
        // A peer that gave up before it died said why: that reason is the
        // cause to report, not the failed read that followed.
        if let Some(reason) = abort_reason(&self.seg.header().sender.0) {
            return CoreError::PeerAborted {
                transport: NAME,
                peer: self.peer,
                reason,
            };
        }
        if e == nix::errno::Errno::ESRCH {
            CoreError::Peer {
                transport: NAME,
                peer: self.peer,
                what: format!("process {} is gone", self.peer_pid),
                source: None,
            }
        } else {
            CoreError::Peer {
                transport: NAME,
                peer: self.peer,
                what: format!("reading its memory (process_vm_readv) failed: {e}"),
                source: Some(Box::new(e)),
            }
        }
    }

    /// The (sender address, length) of the peeked direct slot, checked
    /// against the `len` the engine expects.
    fn direct_slot(&self, len: usize) -> Result<u64> {
        let Some((addr, rlen)) = self.remote.filter(|_| self.peeked) else {
            return Err(CoreError::InvalidArgument(
                "shm read_remote without a direct slot from poll_peek_any".into(),
            ));
        };
        if len != rlen {
            return Err(protocol(
                self.peer,
                format!("direct slot of {rlen} bytes read as {len}"),
            ));
        }
        Ok(addr)
    }

    /// Copies the peeked direct transfer (`len` bytes at the sender's
    /// `addr`) to `dst` through a mapping of the sender's registered host
    /// buffer, if the sender named one and it can be mapped; false: nothing
    /// copied, read it with `process_vm_readv`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `len` bytes.
    unsafe fn read_mapped(&mut self, addr: u64, dst: *mut u8, len: usize) -> bool {
        let Some(region) = self.remote_region else {
            return false;
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.files.read(region, addr, dst, len, self.stream) }
    }

    /// Offers the peeked direct slot (`len` bytes from `addr` to `dst`) to
    /// the sender: `dst` goes into the slot's second word, then a fresh
    /// claim word opens the chunks to both sides.
    fn offer(&mut self, dst: *mut u8, len: usize, chunk: usize, chunks: usize) {
        self.generation = (self.generation % 0x3f_ffff) + 1;
        let slot = self.seg.slot_ptr(self.tail_slot).cast::<u64>();
        // SAFETY: the peeked slot is published and not released, page-aligned
        // and at least 4096 bytes: its second and third u64 are ours to write
        // (the sender wrote only the first word and rewrites the slot only
        // after we release it).
        unsafe {
            slot.add(1).write_volatile(dst as u64);
            slot.add(2).write_volatile(chunk as u64);
        }
        let h = &self.seg.header().help.0;
        h.done.store(0, Ordering::Relaxed);
        h.failed.store(0, Ordering::Relaxed);
        // Release: the destination word and the reset counters are visible
        // to the sender's Acquire load of a claim word of this generation.
        let open = Claim {
            generation: self.generation,
            slot: self.tail_box,
            front: 0,
            back: chunks as u32,
        };
        h.claim.store(open.pack(), Ordering::Release);
        self.sharing = Some(Sharing {
            dst,
            len,
            chunk,
            chunks: chunks as u32,
            mine: 0,
            exhausted: false,
        });
    }

    /// Takes back an offer (error, abort, drop): no chunk can be claimed
    /// any more, and the chunks the sender claimed are waited for (until it
    /// finished them, or its process is gone, or one second passed: a
    /// sender stopped in the middle of a chunk for longer than that could
    /// still write the destination afterwards; its bytes are the right ones).
    fn withdraw(&mut self) {
        let Some(sh) = self.sharing.take() else {
            return;
        };
        let h = &self.seg.header().help.0;
        // The offer's generation and box stay ours while it is open
        // (`release` refuses to move `tail` meanwhile).
        let closed = Claim {
            generation: self.generation,
            slot: self.tail_box,
            front: 0,
            back: 0,
        };
        let c = Claim::unpack(h.claim.swap(closed.pack(), Ordering::AcqRel));
        // The sender claimed the chunks from `back` on. (A word of another
        // generation means a corrupt segment: nothing of ours to wait for.)
        let theirs = if c.generation == self.generation {
            u64::from(sh.chunks.saturating_sub(c.back))
        } else {
            0
        };
        let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let mut spins = 0u32;
        while h.done.load(Ordering::Acquire) < theirs
            && std::time::Instant::now() < until
            && process_alive(self.peer_pid).is_ok()
        {
            spins += 1;
            if spins > 100 {
                std::thread::sleep(std::time::Duration::from_micros(20));
            } else {
                std::thread::yield_now();
            }
        }
        h.claim.store(0, Ordering::Release);
    }

    /// Copies chunks `k..k + count` of the shared transfer from the sender
    /// (one system call).
    fn read_chunks(&self, sh: &Sharing, addr: u64, k: u32, count: u32) -> Result<()> {
        let off = k as usize * sh.chunk;
        let n = (count as usize * sh.chunk).min(sh.len - off);
        // SAFETY: `off + n <= len` and `dst` is valid for `len` bytes
        // (`poll_read_remote`'s contract).
        unsafe { segment::read_process(self.peer_pid, addr + off as u64, sh.dst.add(off), n) }
            .map_err(|e| self.read_error(e))
    }

    /// One step of the shared transfer: claim and copy chunks until none is
    /// left, then report whether the sender's chunks are all done.
    fn step_shared(&mut self, addr: u64) -> Result<bool> {
        let Some(mut sh) = self.sharing.take() else {
            return Ok(true);
        };
        let h = &self.seg.header().help.0;
        while !sh.exhausted {
            // Claim from the front: half of what is left (fewer, larger
            // reads while the sender takes chunks from the back), or all of
            // it once a first read passed without the sender taking any
            // (it is busy: no point cutting the rest into pieces).
            // Relaxed load, then AcqRel CAS: pairs with the sender's claims.
            let w = h.claim.load(Ordering::Relaxed);
            let c = Claim::unpack(w);
            if c.generation != self.generation || c.slot != self.tail_box {
                self.sharing = Some(sh);
                return Err(protocol(
                    self.peer,
                    "the shared transfer's claim word changed generation".into(),
                ));
            }
            if c.front >= c.back {
                sh.exhausted = true;
                break;
            }
            let left = c.back - c.front;
            let take = if sh.mine > 0 && c.back == sh.chunks {
                left
            } else {
                left.div_ceil(2)
            };
            let next = Claim {
                front: c.front + take,
                ..c
            };
            if h.claim
                .compare_exchange(w, next.pack(), Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            sh.mine += take;
            if let Err(e) = self.read_chunks(&sh, addr, c.front, take) {
                self.sharing = Some(sh);
                return Err(e);
            }
        }
        let theirs = u64::from(sh.chunks - sh.mine);
        // Acquire: the sender's writes into `dst` happen before its Release
        // increment of `done` that we see here.
        if h.done.load(Ordering::Acquire) < theirs {
            self.sharing = Some(sh);
            return Ok(false);
        }
        let f = h.failed.load(Ordering::Acquire);
        if f != 0 && (f >> 32) as u32 == self.generation {
            // The sender could not write this chunk: copy it ourselves.
            if let Err(e) = self.read_chunks(&sh, addr, f as u32, 1) {
                self.sharing = Some(sh);
                return Err(e);
            }
        }
        // No offer any more. Stored before the slot's release (Release
        // there), so the sender, which reuses the slot only after it saw
        // that release, never takes this word for an offer of the slot's
        // next transfer (whose length may differ from the destination
        // still written in the slot).
        h.claim.store(0, Ordering::Release);
        Ok(true)
    }
}

impl RecvChannel for ShmRecv {
    fn peer(&self) -> u32 {
        self.peer
    }

    fn transport(&self) -> &'static str {
        NAME
    }

    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn poll_peek(&mut self) -> Result<Option<(SlotBuf, usize)>> {
        match self.poll_peek_any()? {
            None => Ok(None),
            Some(Incoming::Inline(slot, len)) => Ok(Some((slot, len))),
            Some(Incoming::Remote(_)) => Err(protocol(
                self.peer,
                "a direct (single-copy) slot reached a receiver that reads slots only".into(),
            )),
        }
    }

    fn poll_peek_any(&mut self) -> Result<Option<Incoming>> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        let bx = self.tail_box;
        // Acquire: pairs with the sender's Release store of the message
        // number, after the payload (slot or box) and the length word.
        if self.seg.box_seq(bx).load(Ordering::Acquire) != self.tail + 1 {
            return Ok(None);
        }
        let word = self.seg.len_word(bx).load(Ordering::Relaxed);
        let slot = SlotBuf {
            ptr: self.seg.slot_ptr(self.tail_slot),
            cap: self.slot_bytes,
        };
        self.peeked = true;
        if word & DIRECT_FLAG != 0 {
            let len = (word & !DIRECT_FLAG) as usize;
            // SAFETY: the slot is published (its box's `seq` says so),
            // page-aligned and at least 4096 bytes; the sender wrote the
            // address and the region words before its Release store of
            // `seq`.
            let (addr, region) = unsafe {
                let w = slot.ptr.cast::<u64>();
                let r = |i: usize| w.add(REGION_WORD + i).read();
                (w.read(), [r(0), r(1), r(2), r(3)])
            };
            self.remote = Some((addr, len));
            self.remote_region = (region[0] != 0).then_some(host::Region {
                ino: region[0],
                fd: region[1],
                base: region[2],
                len: region[3],
            });
            return Ok(Some(Incoming::Remote(len)));
        }
        if word & INLINE_FLAG != 0 {
            let len = (word & !INLINE_FLAG) as usize;
            if len > segment::INLINE_BYTES {
                self.peeked = false;
                return Err(protocol(
                    self.peer,
                    format!("shm box holds {len} bytes, more than 48 (corrupt segment)"),
                ));
            }
            self.remote = None;
            return Ok(Some(Incoming::Inline(
                SlotBuf {
                    ptr: self.seg.inline_ptr(bx),
                    cap: segment::INLINE_BYTES,
                },
                len,
            )));
        }
        if word > self.slot_bytes as u64 {
            self.peeked = false;
            return Err(protocol(
                self.peer,
                format!(
                    "shm slot holds {word} bytes, more than its {} (corrupt segment)",
                    self.slot_bytes
                ),
            ));
        }
        self.remote = None;
        Ok(Some(Incoming::Inline(slot, word as usize)))
    }

    fn stream_hint(&mut self, streaming: bool) {
        self.stream = streaming;
    }

    unsafe fn read_remote(&mut self, dst: *mut u8, len: usize) -> Result<()> {
        let addr = self.direct_slot(len)?;
        // SAFETY: forwarded from this function's contract.
        if unsafe { self.read_mapped(addr, dst, len) } {
            return Ok(());
        }
        // SAFETY: `dst` is valid for `len` bytes (this method's contract).
        unsafe { segment::read_process(self.peer_pid, addr, dst, len) }
            .map_err(|e| self.read_error(e))
    }

    /// Like `read_remote`, but a transfer of at least [`HELP_CHUNKS_MIN`]
    /// chunks is shared
    /// with the sender: both sides claim chunks from the segment's claim
    /// word; we read ours, the sender (in `poll_help`, while its engine
    /// waits) writes its own into `dst`. Returns false while chunks the
    /// sender claimed are still being written.
    unsafe fn poll_read_remote(&mut self, dst: *mut u8, len: usize) -> Result<bool> {
        let addr = self.direct_slot(len)?;
        if self.sharing.is_none() {
            // SAFETY: forwarded from this function's contract.
            if unsafe { self.read_mapped(addr, dst, len) } {
                return Ok(true);
            }
            let split = self.help_chunk.map(|min| help_split(len, min));
            let Some((chunk, chunks)) = split.filter(|&(_, n)| n >= HELP_CHUNKS_MIN) else {
                // SAFETY: forwarded from this function's contract.
                unsafe { self.read_remote(dst, len)? };
                return Ok(true);
            };
            self.offer(dst, len, chunk, chunks);
        } else if self
            .sharing
            .as_ref()
            .is_some_and(|s| s.dst != dst || s.len != len)
        {
            return Err(CoreError::InvalidArgument(
                "shm poll_read_remote called for another destination before the last finished"
                    .into(),
            ));
        }
        let res = self.step_shared(addr);
        if res.is_err() {
            self.withdraw();
        }
        res
    }

    fn release(&mut self) -> Result<()> {
        if let Some(r) = &self.aborted {
            return Err(CoreError::Aborted(r.clone()));
        }
        if !self.peeked {
            return Err(CoreError::InvalidArgument(
                "shm release without a slot from poll_peek".into(),
            ));
        }
        if self.sharing.is_some() {
            return Err(CoreError::InvalidArgument(
                "shm release while the sender may still write the slot's destination".into(),
            ));
        }
        self.tail += 1;
        self.tail_slot = next_slot(self.tail_slot, self.slots);
        self.tail_box = next_slot(self.tail_box, self.boxes);
        self.peeked = false;
        self.remote = None;
        self.remote_region = None;
        // Release: our reads of the slot happen before the sender's Acquire
        // load of `tail` that lets it overwrite the slot.
        self.seg.header().tail.0.store(self.tail, Ordering::Release);
        Ok(())
    }

    fn check_peer(&mut self) -> Result<()> {
        let sender = &self.seg.header().sender.0;
        check_abort_and_process(sender, self.peer, self.peer_pid)?;
        // Acquire: pairs with the Release in ShmSend::drop, so the `head`
        // loaded next is the sender's final one.
        let closed = sender.closed.load(Ordering::Acquire) != 0;
        if closed && self.load_head()? == self.tail {
            // The abort check above may have run just before the peer
            // aborted and exited; its reason was published before `closed`.
            let reason = abort_reason(&self.seg.header().sender.0)
                .unwrap_or_else(|| "the sender closed its end".into());
            return Err(CoreError::PeerAborted {
                transport: NAME,
                peer: self.peer,
                reason,
            });
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_owned());
        }
        self.withdraw();
        publish_abort(&self.seg.header().receiver.0, reason);
    }
}

impl Drop for ShmRecv {
    fn drop(&mut self) {
        self.withdraw();
        self.seg
            .header()
            .receiver
            .0
            .closed
            .store(1, Ordering::Release);
    }
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

    #[test]
    fn params() {
        assert!(ShmTransport::with_params(4096, 2).is_ok());
        assert!(ShmTransport::with_params(4096 + 64, 3).is_ok());
        assert!(ShmTransport::with_params(4000, 8).is_err());
        assert!(ShmTransport::with_params(4096, 1).is_err());
        let d = ShmTransport::default();
        assert_eq!((d.slot_bytes(), d.slots()), (128 * 1024, 16));
    }

    #[test]
    fn own_process_is_alive() {
        assert!(process_alive(std::process::id()).is_ok());
    }
}

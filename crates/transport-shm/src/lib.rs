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
//!   released in order. Message `n` is announced in *box* `n % boxes` (two
//!   cache lines each, at least 256 of them: see `segment::boxes_for`),
//!   whose second line ends with its length word and `n + 1` (`seq`),
//!   stored last; the receiver polls that one line instead of `head`. A message of
//!   at most 48 bytes (an 8-byte AllReduce with its operation header is 40)
//!   travels in that line, so it reaches the receiver in a single
//!   cache-line transfer, as in Open MPI's fast boxes; one of at most 112
//!   (a 64-byte Broadcast with its header is 96) takes the box's second
//!   line too. Either needs only a free box: `head - tail < boxes`
//!   ([`SendChannel::poll_acquire_small`]). Any other message also takes
//!   slot `n % slots`, free iff `head - tail < slots` (message `n - slots`,
//!   its last user, was released).
//! - **Data path.** `poll_acquire`/`commit`/`poll_peek`/`release`/
//!   `poll_drained` are plain loads and stores on the mapping, never a system
//!   call, so the engine can spin on them.
//! - **Liveness.** Each side has `closed` and `abort` flags (plus a short
//!   abort reason) in the segment. `check_peer` reports the peer's abort or
//!   close as [`CoreError::PeerAborted`], and a dead peer process
//!   (`kill(pid, 0)` fails with `ESRCH`, or `/proc/<pid>/stat` says zombie) as
//!   [`CoreError::Peer`] "process `<pid>` is gone". A receiver whose sender
//!   closed normally keeps working until it has read every committed slot.
//! - **Kept links** (a shrink). A link whose two processes are alive goes
//!   on in a new communicator even after an abort: the sender's point is
//!   `head`, the receiver's `tail` with up to `boxes` messages it may drop;
//!   on `resume` the receiver moves `tail` to the sender's `head` (the
//!   messages in between are never read), clears the help words, and each
//!   side takes back its own abort flag. Both sides are between operations
//!   and the runtime lets neither use the link until both resumed.
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
//! # Configuration
//!
//! [`ShmConfig::from_env`] reads the variables below (booleans as
//! `1/0/true/false/on/off/yes/no`, like every braid variable); a value it
//! cannot use is an error naming the variable, never a silent default.
//! [`ShmTransport::new`] takes the configuration. The segment is mapped
//! with `MAP_POPULATE`, touched page by page on creation and advised
//! `MADV_HUGEPAGE`, so the hot path does not take first-use page faults.
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `BRAID_SHM_SLOT_BYTES` | bytes per slot, a multiple of 64 from 4096 to 1 GiB | 128 KiB |
//! | `BRAID_SHM_SLOTS` | slots per connection, 2 to 1024 | 16 |
//! | `BRAID_SHM_DIRECT` | off: no direct (single-copy) transfers | on |
//! | `BRAID_SHM_HELP` | off: receivers do not share direct transfers with the sender | on |
//! | `BRAID_SHM_HELP_CHUNK` | smallest chunk of a shared direct transfer, a multiple of 4096 | 256 KiB |
//!
//! # Files
//!
//! | file | holds |
//! | --- | --- |
//! | `lib.rs` | this contract, [`ShmConfig`], re-exports |
//! | `transport.rs` | [`ShmTransport`] (the `Transport` impl) and the pending ends of set-up |
//! | `link.rs` | what both channel ends share: length-word flags, claim words, abort and liveness checks; `link/send.rs` the sending end, `link/recv.rs` the receiving end |
//! | `info.rs` | the connect-info blobs |
//! | `probe.rs` | what this host allows: `/dev/shm`, reading a peer's memory, a peer's liveness |
//! | `segment.rs` | the FFI/memory module: segment layout and mapping, memory-file mappings, `process_vm_readv`/`writev` |
//! | `host.rs` | [`HostBuffer`] and the receiver's cache of peers' buffers |
//!
//! # Where `unsafe` lives
//!
//! `segment.rs` holds every system call on raw memory and every raw
//! pointer access, behind safe accessors (atomics, bounds-checked copies,
//! slices of this process's own buffers). Outside it only the channel ends
//! have `unsafe` blocks, each with its `SAFETY:` reason, where they pass on
//! memory the engine lent them through the seam's `unsafe fn`s:
//! `link/send.rs` (`commit_direct`, and `poll_help` writing from that
//! memory into the receiver) and `link/recv.rs` (`read_remote` /
//! `poll_read_remote` copying into the engine's destination). `host.rs` has
//! `unsafe` in its tests only.

use braid_core::config::{self, ConfigError};
// For the links in the docs above.
#[cfg(doc)]
use braid_core::{
    error::CoreError,
    transport::{SendChannel, Transport},
};

mod host;
mod info;
mod link;
mod probe;
mod segment;
mod transport;

pub use host::{HostBuffer, MAPS_PER_PEER};
pub use probe::leftover_segments;
pub use transport::ShmTransport;

/// The connect-info blobs over plain bytes, for the fuzz targets in `fuzz/`
/// and their seed corpus. Not part of the API: the signatures follow the
/// wire format and change with it.
#[cfg(feature = "fuzzing")]
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

/// The transport's name (`BRAID_TRANSPORT=shm`).
const NAME: &str = "shm";

/// Environment variable: bytes per slot.
pub const ENV_SLOT_BYTES: &str = "BRAID_SHM_SLOT_BYTES";
/// Environment variable: slots per connection.
pub const ENV_SLOTS: &str = "BRAID_SHM_SLOTS";
/// Environment variable: off disables direct (single-copy) transfers.
pub const ENV_DIRECT: &str = "BRAID_SHM_DIRECT";
/// Environment variable: off stops receivers from sharing the copy of a
/// direct transfer with its sender (see the crate docs, "Shared direct
/// transfers").
pub const ENV_HELP: &str = "BRAID_SHM_HELP";
/// Environment variable: the smallest chunk of a shared direct transfer
/// (bytes, a multiple of 4096; default 256 KiB). Transfers shorter than four
/// chunks are not shared. Small values are for tests.
pub const ENV_HELP_CHUNK: &str = "BRAID_SHM_HELP_CHUNK";

/// Configuration of a [`ShmTransport`]: the slot geometry of the
/// connections it receives on, and the single-copy settings of its
/// receiving ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    slot_bytes: usize,
    slots: usize,
    direct: bool,
    help_chunk: Option<usize>,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            slot_bytes: Self::DEFAULT_SLOT_BYTES,
            slots: Self::DEFAULT_SLOTS,
            direct: true,
            help_chunk: Some(Self::DEFAULT_HELP_CHUNK),
        }
    }
}

impl ShmConfig {
    /// Default bytes per slot. 128 KiB pieces stay in the L2 cache between
    /// the copy into and out of a slot; with 16 slots the ring (2 MiB) gives
    /// enough slack to pipeline (measured with braid-perf, 2 ranks, against
    /// 512 KiB × 8 and 64 KiB × 32: best or equal for AllReduce, AllGather,
    /// Broadcast from 1 to 64 MiB).
    pub const DEFAULT_SLOT_BYTES: usize = 128 * 1024;
    /// Default slots per connection.
    pub const DEFAULT_SLOTS: usize = 16;
    /// Default smallest chunk of a shared direct transfer: side by side,
    /// 256 KiB pieces of a 2 MiB transfer split between two processes ran
    /// 1.5-1.8x faster than one reader.
    pub const DEFAULT_HELP_CHUNK: usize = 256 * 1024;

    /// Defaults overridden by `BRAID_SHM_*` as `env` gives them
    /// ([`braid_core::config::process_env`] for the process environment);
    /// an error names a variable that is set but not usable.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<ShmConfig, ConfigError> {
        let d = ShmConfig::default();
        let slot_bytes = config::number(env, ENV_SLOT_BYTES)?.unwrap_or(d.slot_bytes);
        let slots = config::number(env, ENV_SLOTS)?.unwrap_or(d.slots);
        let c = d.with_geometry(slot_bytes, slots).copy_from_env(env)?;
        c.validate()?;
        Ok(c)
    }

    /// `self` with the single-copy settings (`BRAID_SHM_DIRECT`,
    /// `BRAID_SHM_HELP`, `BRAID_SHM_HELP_CHUNK`) from `env`.
    fn copy_from_env(self, env: &dyn Fn(&str) -> Option<String>) -> Result<ShmConfig, ConfigError> {
        let direct = config::flag(env, ENV_DIRECT, self.direct)?;
        let chunk = match config::value(env, ENV_HELP_CHUNK) {
            None => Self::DEFAULT_HELP_CHUNK,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if help_chunk_ok(n) => n,
                _ => return Err(help_chunk_error(&v)),
            },
        };
        let help = config::flag(env, ENV_HELP, self.help_chunk.is_some())?;
        Ok(self
            .with_direct(direct)
            .with_help_chunk(help.then_some(chunk)))
    }

    /// Slot geometry of the connections this end receives on: `slot_bytes`
    /// a multiple of 64 from 4096 to 1 GiB, `slots` 2 to 1024.
    pub fn with_geometry(mut self, slot_bytes: usize, slots: usize) -> Self {
        self.slot_bytes = slot_bytes;
        self.slots = slots;
        self
    }

    /// Whether receiving ends offer direct (single-copy) transfers, where
    /// they may read the sender's memory.
    pub fn with_direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// The smallest chunk of a direct transfer that a receiving end shares
    /// with its sender (a multiple of 4096); `None`: it copies alone.
    pub fn with_help_chunk(mut self, chunk: Option<usize>) -> Self {
        self.help_chunk = chunk;
        self
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots per connection.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether receiving ends offer direct transfers.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// The smallest chunk of a shared direct transfer, if sharing is on.
    pub fn help_chunk(&self) -> Option<usize> {
        self.help_chunk
    }

    /// Checks every value; the error names the variable that sets it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let sb = self.slot_bytes;
        if !(segment::PAGE..=segment::MAX_SLOT_BYTES).contains(&sb) || !sb.is_multiple_of(64) {
            return Err(ConfigError::new(
                ENV_SLOT_BYTES,
                &sb.to_string(),
                format!(
                    "expected a multiple of 64 from {} to {} bytes",
                    segment::PAGE,
                    segment::MAX_SLOT_BYTES
                ),
            ));
        }
        if segment::Layout::new(sb, self.slots).is_none() {
            return Err(ConfigError::new(
                ENV_SLOTS,
                &self.slots.to_string(),
                format!("expected 2 to {} slots", segment::MAX_SLOTS),
            ));
        }
        match self.help_chunk {
            Some(n) if !help_chunk_ok(n) => Err(help_chunk_error(&n.to_string())),
            _ => Ok(()),
        }
    }
}

fn help_chunk_ok(n: usize) -> bool {
    n >= 4096 && n.is_multiple_of(4096)
}

fn help_chunk_error(v: &str) -> ConfigError {
    ConfigError::new(
        ENV_HELP_CHUNK,
        v,
        "expected a multiple of 4096 bytes, e.g. 262144",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<ShmConfig, ConfigError> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ShmConfig::from_env(&move |k: &str| {
            pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn environment_is_parsed_and_bad_values_name_their_variable() {
        assert_eq!(cfg(&[]).unwrap(), ShmConfig::default());
        let d = ShmConfig::default();
        assert_eq!(
            (d.slot_bytes(), d.slots(), d.direct(), d.help_chunk()),
            (128 * 1024, 16, true, Some(256 * 1024))
        );
        let c = cfg(&[
            (ENV_SLOT_BYTES, "8192"),
            (ENV_SLOTS, "3"),
            (ENV_DIRECT, "off"),
            (ENV_HELP_CHUNK, "4096"),
        ])
        .unwrap();
        assert_eq!(
            c,
            ShmConfig::default()
                .with_geometry(8192, 3)
                .with_direct(false)
                .with_help_chunk(Some(4096))
        );
        assert_eq!(cfg(&[(ENV_HELP, "0")]).unwrap().help_chunk(), None);
        assert!(!cfg(&[(ENV_DIRECT, "no")]).unwrap().direct());
        assert!(
            cfg(&[(ENV_DIRECT, " ")]).unwrap().direct(),
            "empty is unset"
        );
        for (k, v) in [
            (ENV_SLOT_BYTES, "4100"),
            (ENV_SLOT_BYTES, "lots"),
            (ENV_SLOT_BYTES, "2048"),
            (ENV_SLOTS, "1"),
            (ENV_SLOTS, "1025"),
            (ENV_DIRECT, "maybe"),
            (ENV_HELP, "2"),
            (ENV_HELP_CHUNK, "5000"),
            (ENV_HELP_CHUNK, "0"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err();
            assert_eq!(e.var, k, "{k}={v}: {e}");
            assert!(e.to_string().starts_with(&format!("{k}=")), "{e}");
        }
    }
}

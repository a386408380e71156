//! The shared-memory segment and every other piece of raw memory the crate
//! touches: creation, mapping, layout and raw access; the memory files
//! behind [`crate::host::HostBuffer`]; and the process-memory system calls
//! (`process_vm_readv`/`process_vm_writev`).
//!
//! This is the crate's one FFI/memory module: the rest reads and writes
//! shared memory through the safe accessors here (atomics of the control
//! block and boxes, slot words as atomics, bounds-checked copies). Only
//! the channel ends keep an `unsafe` block where they pass on memory the
//! engine lent them through the seam's `unsafe fn`s (see the crate docs).
//!
//! Everything the two processes share lives in one `MAP_SHARED` mapping of
//! a POSIX shm object; the control block ([`Header`]) consists of atomics
//! only, so either process may read or write it at any time without a data
//! race. Slot memory is handed out as raw pointers ([`Segment::slot_ptr`]);
//! who may touch which slot when is decided by the `head`/`tail` protocol
//! in `link.rs`.
//!
//! Layout (offsets from the start of the mapping):
//!
//! | offset | what | written by |
//! | --- | --- | --- |
//! | 0 | identity line: magic, version, slots, slot_bytes, stride, data offset, nonce, receiver pid | creator, once |
//! | 128 | `head`: slots committed by the sender | sender |
//! | 256 | `tail`: slots released by the receiver | receiver |
//! | 384 | sender side: pid, attached, closed, abort, abort reason, probe address | sender |
//! | 896 | receiver side: pid, attached, closed, abort, abort reason, direct_ok | receiver |
//! | 1408 | `help`: the direct transfer shared with the sender (claim, done, failed) | both |
//! | 1536 | `recv_bell`: the receiver's doorbell (the sender rings it after publishing a message, a helped chunk, its abort or close) | both |
//! | 1664 | `send_bell`: the sender's doorbell (the receiver rings it after releasing, its abort or close) | both |
//! | 1792 | `boxes[boxes]` ([`boxes_for`]`(slots)` of them), 128 bytes each: up to 112 bytes of inline payload (a message of at most 48 starts in the second line), then the length word and the message number (`seq`) of each message, both in the second line; message `n` is announced in box `n % boxes` | sender |
//! | `data_offset` (multiple of 4096) | `slots` slots, each `stride` bytes apart (`stride` = `slot_bytes` rounded up to 4096) | sender writes, receiver reads |
//!
//! Fields that different processes write sit on separate 128-byte lines (two
//! cache lines, so that the adjacent-line prefetcher does not couple them).

use std::mem::size_of;
use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{self, MapFlags, MmapAdvise, ProtFlags};
use nix::sys::stat::Mode;

use braid_core::transport::Doorbell;
use braid_core::types::Element;

/// `"BRAIDSHM"` in ASCII: the first word of every segment.
pub(crate) const HEADER_MAGIC: u64 = u64::from_be_bytes(*b"BRAIDSHM");
/// Version of the in-memory layout (bumped on any change to [`Header`]).
pub(crate) const LAYOUT_VERSION: u32 = 8;
/// Page size the layout aligns to.
pub(crate) const PAGE: usize = 4096;
/// Payload bytes a message may carry inside its slot's box (see [`SlotBox`]).
pub(crate) const INLINE_BYTES: usize = 112;
/// Inline bytes that share the line of a box's `seq` word (its second).
pub(crate) const SEQ_LINE_BYTES: usize = 48;
/// Bytes of abort reason kept in the segment (longer reasons are cut): room
/// for a whole error message with the peer's own cause nested in it (the
/// RDMA link keeps 512).
pub(crate) const REASON_BYTES: usize = 480;
/// Most slots a segment may have.
pub(crate) const MAX_SLOTS: usize = 1024;
/// Largest slot.
pub(crate) const MAX_SLOT_BYTES: usize = 1 << 30;
/// Fewest boxes a segment has (see [`boxes_for`]).
pub(crate) const MIN_BOXES: usize = 256;
/// Words at the start of every slot that [`Segment::slot_word`] reaches
/// (a slot holds at least [`PAGE`] bytes).
pub(crate) const SLOT_WORDS: usize = PAGE / 8;

/// Boxes of a segment with `slots` slots: at least [`MIN_BOXES`], and at
/// least one per slot. A message that fits its box
/// ([`INLINE_BYTES`]) needs a free box only, not a free slot, so a sender
/// of small messages can run up to `boxes` messages ahead of its receiver
/// (32 KiB of boxes instead of 32 MiB of slots). That is what a stream of
/// small Broadcasts or Reduces needs where ranks share cores and the
/// receiver runs only now and then: 4 ranks on 2 cores, 8-byte Broadcast,
/// 0.7-1.2 µs per operation with 16 boxes against 0.4-0.5 with 256.
pub(crate) fn boxes_for(slots: usize) -> usize {
    slots.max(MIN_BOXES)
}

/// Values of [`Side::abort`].
pub(crate) const ABORT_NONE: u32 = 0;
/// The aborting side is still writing its reason.
pub(crate) const ABORT_WRITING: u32 = 1;
/// The reason is complete.
pub(crate) const ABORT_SET: u32 = 2;

/// Aligns its content to 128 bytes (two cache lines).
#[repr(C, align(128))]
pub(crate) struct Padded<T>(pub T);

/// State one end of the connection publishes about itself.
#[repr(C)]
pub(crate) struct Side {
    /// Process id of this end (0 until it attaches).
    pub pid: AtomicU32,
    /// Non-zero once this end has mapped the segment.
    pub attached: AtomicU32,
    /// Non-zero once this end dropped its channel (normal close).
    pub closed: AtomicU32,
    /// `ABORT_NONE`, `ABORT_WRITING` or `ABORT_SET`.
    pub abort: AtomicU32,
    /// Valid bytes in `reason` once `abort == ABORT_SET`.
    pub reason_len: AtomicU32,
    /// Receiver side only: non-zero once the receiver proved it can read the
    /// sender's memory (`process_vm_readv`), enabling direct transfers.
    pub direct_ok: AtomicU32,
    /// UTF-8 abort reason (possibly cut).
    pub reason: [AtomicU8; REASON_BYTES],
    /// Sender side only: address, in the sender's address space, of a word
    /// holding [`HEADER_MAGIC`] (its mapping of this header): the receiver's
    /// direct-read probe.
    pub probe_addr: AtomicU64,
}

/// A direct transfer the receiver shares with the sender (see
/// `ShmRecv::poll_read_remote` and `ShmSend::poll_help`): the referenced
/// bytes are cut into chunks that either side claims from `claim`; the
/// receiver reads its chunks with `process_vm_readv`, the sender writes its
/// chunks with `process_vm_writev` into the destination the receiver put in
/// the slot's second word.
#[repr(C)]
pub(crate) struct Help {
    /// `generation << 42 | slot << 32 | front << 16 | back`: chunks
    /// `front..back` are unclaimed (see `Claim`); generation 0: nothing
    /// offered.
    pub claim: AtomicU64,
    /// Chunks the sender finished (or gave up on, see `failed`) in the
    /// current generation.
    pub done: AtomicU64,
    /// `generation << 32 | chunk` of a chunk the sender could not write (the
    /// receiver copies it itself); 0 if none.
    pub failed: AtomicU64,
}

/// The control block at the start of every segment. All fields are atomics:
/// the peer process may write any of them at any time.
#[repr(C)]
pub(crate) struct Header {
    /// [`HEADER_MAGIC`], stored last by the creator (Release).
    pub magic: AtomicU64,
    /// [`LAYOUT_VERSION`].
    pub version: AtomicU32,
    /// Number of slots.
    pub slots: AtomicU32,
    /// Capacity of one slot.
    pub slot_bytes: AtomicU64,
    /// Distance between two slots.
    pub stride: AtomicU64,
    /// Offset of slot 0.
    pub data_offset: AtomicU64,
    /// Random value also carried by the connect-info blob.
    pub nonce: AtomicU64,
    /// Process id of the creator (the receiver).
    pub receiver_pid: AtomicU32,
    /// Slots committed by the sender so far (monotonic).
    pub head: Padded<AtomicU64>,
    /// Slots released by the receiver so far (monotonic).
    pub tail: Padded<AtomicU64>,
    /// The sender's side.
    pub sender: Padded<Side>,
    /// The receiver's side.
    pub receiver: Padded<Side>,
    /// The direct transfer being shared.
    pub help: Padded<Help>,
    /// Where the receiver sleeps while it waits (see `braid_core::transport::Doorbell`).
    pub recv_bell: Padded<Doorbell>,
    /// Where the sender sleeps while it waits.
    pub send_bell: Padded<Doorbell>,
}

/// The two cache lines that announce a slot's message. The receiver
/// polls `seq`, in the second line, alone. A message of at most
/// [`SEQ_LINE_BYTES`] (an 8-byte piece behind its 32-byte operation
/// header) travels in that line, at its start, so it costs one cache-line
/// transfer from sender to receiver; one of at most [`INLINE_BYTES`] (a
/// 64-byte Broadcast with its header) starts at the first line, and needs
/// neither a slot nor a slot's credit. Either start is 64-byte aligned,
/// like a slot ([`Segment::inline_at`]).
#[repr(C, align(64))]
pub(crate) struct SlotBox {
    /// Inline payload (raw bytes, handed out by [`Segment::inline_at`]).
    pub inline: [u8; INLINE_BYTES],
    /// Byte length and flags of the message (see `link.rs`).
    pub word: AtomicU64,
    /// `n + 1` once message `n` (announced in box `n % boxes`; its data,
    /// if it does not fit the box, in slot `n % slots`) is published
    /// (stored last, Release).
    pub seq: AtomicU64,
}

/// Sizes and offsets of a segment, derived from `(slot_bytes, slots)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub slots: usize,
    /// Boxes: [`boxes_for`]`(slots)`.
    pub boxes: usize,
    pub slot_bytes: usize,
    pub stride: usize,
    pub boxes_offset: usize,
    pub data_offset: usize,
    pub total: usize,
}

fn round_up(v: usize, to: usize) -> Option<usize> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

impl Layout {
    /// The layout for these parameters, or `None` if they are out of range
    /// (`slot_bytes` a multiple of 64 in `4096..=1 GiB`, `slots` in `2..=1024`).
    pub(crate) fn new(slot_bytes: usize, slots: usize) -> Option<Layout> {
        if !(PAGE..=MAX_SLOT_BYTES).contains(&slot_bytes)
            || slot_bytes & 63 != 0
            || !(2..=MAX_SLOTS).contains(&slots)
        {
            return None;
        }
        let stride = round_up(slot_bytes, PAGE)?;
        let boxes_offset = size_of::<Header>();
        let boxes = boxes_for(slots);
        let data_offset = round_up(boxes_offset + boxes * size_of::<SlotBox>(), PAGE)?;
        let total = stride.checked_mul(slots)?.checked_add(data_offset)?;
        // Keep the mapping addressable as off_t on every target.
        if total > (i64::MAX as usize) {
            return None;
        }
        Some(Layout {
            slots,
            boxes,
            slot_bytes,
            stride,
            boxes_offset,
            data_offset,
            total,
        })
    }
}

/// Why a segment could not be created or opened.
#[derive(Debug)]
pub(crate) enum SegError {
    /// A system call failed.
    Sys(&'static str, Errno),
    /// The object exists but does not hold what the connect-info promised.
    Mismatch(String),
}

impl std::fmt::Display for SegError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SegError::Sys(call, e) => write!(f, "{call} failed: {e}"),
            SegError::Mismatch(s) => f.write_str(s),
        }
    }
}

/// One mapping of a shm object. Unmapped on drop; unlinked on drop too while
/// this process is responsible for the name (see [`Segment::unlink`]).
pub(crate) struct Segment {
    base: NonNull<u8>,
    layout: Layout,
    name: String,
    /// Whether drop must `shm_unlink` the name.
    owns_name: bool,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("name", &self.name)
            .field("layout", &self.layout)
            .field("owns_name", &self.owns_name)
            .finish()
    }
}

// SAFETY: `Segment` owns its mapping (nothing else in this process unmaps
// it); the raw base pointer is only turned into `&Header`/`&AtomicU64`
// (atomics, safe to share) or handed out as a raw slot pointer whose use is
// governed by the head/tail protocol. Moving it to another thread is fine.
unsafe impl Send for Segment {}

/// How much of a mapping to allocate and map up front.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Populate {
    /// All of it, as transparent huge pages where the system allows
    /// (`MAP_POPULATE`: a new object's pages are allocated and zeroed here,
    /// not on first use): a user's buffer.
    All,
    /// Nothing: pages are allocated when first touched, so memory follows
    /// use (a link's slots).
    OnUse,
}

/// Maps all `len` bytes of `fd` shared — read-write when `write`, else
/// read-only — pre-faulting as `populate` says.
fn map_shared(
    fd: &std::os::fd::OwnedFd,
    len: usize,
    write: bool,
    populate: Populate,
) -> Result<NonNull<u8>, SegError> {
    let length = NonZeroUsize::new(len).ok_or(SegError::Sys("mmap", Errno::EINVAL))?;
    let prot = if write {
        ProtFlags::PROT_READ | ProtFlags::PROT_WRITE
    } else {
        ProtFlags::PROT_READ
    };
    // SAFETY: we map a fresh region chosen by the kernel (addr = None), so no
    // existing Rust object is affected; `fd` is an shm object or sealed
    // memory file at least `len` bytes long that cannot shrink while mapped
    // (checked or set by the callers), so no access inside the mapping
    // faults.
    let ptr = unsafe {
        mman::mmap(
            None,
            length,
            prot,
            match populate {
                Populate::All => MapFlags::MAP_SHARED | MapFlags::MAP_POPULATE,
                Populate::OnUse => MapFlags::MAP_SHARED,
            },
            fd,
            0,
        )
    }
    .map_err(|e| SegError::Sys("mmap", e))?;
    if populate == Populate::All {
        // SAFETY: `ptr..ptr+len` is the mapping we just created;
        // MADV_HUGEPAGE is advice only and does not change its contents.
        // Failure (THP for shmem disabled, old kernel) is ignored.
        let _ = unsafe { mman::madvise(ptr, len, MmapAdvise::MADV_HUGEPAGE) };
    }
    Ok(ptr.cast())
}

impl Segment {
    /// Creates the shm object `name` (`O_EXCL`, mode 0600), sizes it, maps
    /// it and writes the identity line. Only the control block and the
    /// boxes take memory now; a slot's pages are allocated when a message
    /// first goes through them (a link that only ever carries small
    /// messages costs a few pages, not the whole ring: 2 MiB by default,
    /// for every pair of ranks that ever exchanged a byte). The returned
    /// segment unlinks `name` when dropped (until [`Segment::unlink`]).
    pub(crate) fn create(
        name: &str,
        layout: Layout,
        nonce: u64,
        receiver_pid: u32,
    ) -> Result<Segment, SegError> {
        let fd = mman::shm_open(
            name,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|e| SegError::Sys("shm_open(create)", e))?;
        // From here on, failures must unlink: build the guard first.
        let unlink_guard = UnlinkOnError(name);
        nix::unistd::ftruncate(&fd, layout.total as i64)
            .map_err(|e| SegError::Sys("ftruncate", e))?;
        let base = map_shared(&fd, layout.total, true, Populate::OnUse)?;
        drop(fd); // the mapping keeps the object alive
        std::mem::forget(unlink_guard);
        let seg = Segment {
            base,
            layout,
            name: name.to_owned(),
            owns_name: true,
        };
        let h = seg.header();
        h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        h.slots.store(layout.slots as u32, Ordering::Relaxed);
        h.slot_bytes
            .store(layout.slot_bytes as u64, Ordering::Relaxed);
        h.stride.store(layout.stride as u64, Ordering::Relaxed);
        h.data_offset
            .store(layout.data_offset as u64, Ordering::Relaxed);
        h.nonce.store(nonce, Ordering::Relaxed);
        h.receiver_pid.store(receiver_pid, Ordering::Relaxed);
        h.receiver.0.pid.store(receiver_pid, Ordering::Relaxed);
        h.receiver.0.attached.store(1, Ordering::Relaxed);
        // Release: whoever reads the magic with Acquire also sees the fields
        // above. (In practice the connect-info travels through the bootstrap,
        // whose system calls already order this; the magic makes it explicit.)
        h.magic.store(HEADER_MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Opens and maps the existing shm object `name`, which must be at least
    /// as large as `layout` says and carry the same identity line.
    pub(crate) fn open(name: &str, layout: Layout, nonce: u64) -> Result<Segment, SegError> {
        let fd = mman::shm_open(name, OFlag::O_RDWR, Mode::empty())
            .map_err(|e| SegError::Sys("shm_open", e))?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| SegError::Sys("fstat", e))?;
        // A mapping longer than the object would SIGBUS on access: refuse.
        if st.st_size < 0 || (st.st_size as u64) < layout.total as u64 {
            return Err(SegError::Mismatch(format!(
                "segment {name} is {} bytes, expected at least {}",
                st.st_size, layout.total
            )));
        }
        let base = map_shared(&fd, layout.total, true, Populate::OnUse)?;
        drop(fd);
        let seg = Segment {
            base,
            layout,
            name: name.to_owned(),
            owns_name: false,
        };
        let h = seg.header();
        let checks: [(&str, u64, u64); 7] = [
            ("magic", h.magic.load(Ordering::Acquire), HEADER_MAGIC),
            (
                "layout version",
                h.version.load(Ordering::Relaxed).into(),
                LAYOUT_VERSION.into(),
            ),
            (
                "slots",
                h.slots.load(Ordering::Relaxed).into(),
                layout.slots as u64,
            ),
            (
                "slot_bytes",
                h.slot_bytes.load(Ordering::Relaxed),
                layout.slot_bytes as u64,
            ),
            (
                "stride",
                h.stride.load(Ordering::Relaxed),
                layout.stride as u64,
            ),
            (
                "data offset",
                h.data_offset.load(Ordering::Relaxed),
                layout.data_offset as u64,
            ),
            ("nonce", h.nonce.load(Ordering::Relaxed), nonce),
        ];
        for (what, got, want) in checks {
            if got != want {
                return Err(SegError::Mismatch(format!(
                    "segment {name}: {what} is {got:#x}, connect-info says {want:#x}"
                )));
            }
        }
        Ok(seg)
    }

    /// Touches every page of the slot area so that first use does not fault.
    /// Asks for transparent huge pages for the slots, once the link moves
    /// bulk data (advice: where the system gives shared memory huge pages
    /// on request, slot pages touched from now on come in 2 MiB pages).
    pub(crate) fn advise_huge_slots(&self) {
        let len = self.layout.total - self.layout.data_offset;
        // SAFETY: `data_offset..total` lies inside our mapping (Layout::new);
        // MADV_HUGEPAGE is advice only and does not change its contents.
        // Failure (THP for shmem disabled, old kernel) is ignored.
        let _ = unsafe {
            mman::madvise(
                self.base.add(self.layout.data_offset).cast(),
                len,
                MmapAdvise::MADV_HUGEPAGE,
            )
        };
    }

    /// The shared control block.
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the mapping starts with `size_of::<Header>()` bytes reserved
        // for the header (Layout::new), is page-aligned (≥ align_of Header),
        // lives as long as `self`, and every field is an atomic (valid for any
        // bit pattern, shared mutation is allowed), so a shared reference is
        // sound even while the peer process writes.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }

    fn box_ptr(&self, i: usize) -> *mut SlotBox {
        assert!(i < self.layout.boxes, "box index out of range");
        // SAFETY: `boxes_offset + 128 * i` lies inside the box area reserved
        // by Layout::new (i < boxes); creating the pointer accesses nothing.
        unsafe {
            self.base
                .as_ptr()
                .add(self.layout.boxes_offset + i * size_of::<SlotBox>())
                .cast::<SlotBox>()
        }
    }

    /// The message number of box `i` (`i < boxes`).
    pub(crate) fn box_seq(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the box lies inside the mapping (box_ptr) and is 64-aligned
        // (boxes_offset is a multiple of 128, boxes 128 bytes each), so the
        // field is 8-aligned;
        // AtomicU64 is valid for any bit pattern; the reference lives as
        // long as `self`.
        unsafe { &(*self.box_ptr(i)).seq }
    }

    /// The length word of box `i` (`i < boxes`).
    pub(crate) fn len_word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: as in `box_seq`.
        unsafe { &(*self.box_ptr(i)).word }
    }

    /// Where a message of `len` bytes (at most [`INLINE_BYTES`]) lies in
    /// box `i` (`i < boxes`), and the bytes from there to the end of the
    /// payload area: in the line of `seq` if it fits there (at most
    /// [`SEQ_LINE_BYTES`]), else from the box's start. Both are 64-byte
    /// aligned. Sender and receiver place a message by its committed
    /// length alike. Like slot memory, who may touch it when is decided by
    /// the protocol in `link.rs`.
    pub(crate) fn inline_at(&self, i: usize, len: usize) -> (*mut u8, usize) {
        let off = if len <= SEQ_LINE_BYTES {
            INLINE_BYTES - SEQ_LINE_BYTES
        } else {
            0
        };
        // SAFETY: the field lies inside the box, inside the mapping, and
        // `off < INLINE_BYTES` stays inside the field; `addr_of_mut!`
        // creates no reference, and nothing is accessed.
        let p = unsafe {
            std::ptr::addr_of_mut!((*self.box_ptr(i)).inline)
                .cast::<u8>()
                .add(off)
        };
        (p, INLINE_BYTES - off)
    }

    /// Start of slot `i` (`i < slots`), page-aligned, `slot_bytes` long.
    pub(crate) fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.layout.slots, "slot index out of range");
        // SAFETY: `data_offset + i * stride + stride <= total` for i < slots
        // (Layout::new), so the pointer stays inside the mapping. Creating
        // the pointer does not access memory.
        unsafe {
            self.base
                .as_ptr()
                .add(self.layout.data_offset + i * self.layout.stride)
        }
    }

    /// Word `w` of slot `i` (`i < slots`, `w <` [`SLOT_WORDS`]) as an
    /// atomic: a direct slot carries addresses and sizes there instead of
    /// a payload (see `link.rs`). Who writes which word when is decided by
    /// the protocol; the words are published and read back through the
    /// Release/Acquire pairs on `seq` and the claim word, so `Relaxed`
    /// accesses suffice.
    pub(crate) fn slot_word(&self, i: usize, w: usize) -> &AtomicU64 {
        assert!(w < SLOT_WORDS, "slot word {w} out of range");
        // SAFETY: slot_ptr checks `i < slots`; slots are page-aligned and at
        // least PAGE (4096) bytes, so word `w < 512` is 8-aligned and inside
        // the slot, inside the mapping, which lives as long as `self`.
        // AtomicU64 is valid for any bit pattern and allows shared mutation
        // (the peer process writes these words too).
        unsafe { &*self.slot_ptr(i).cast::<AtomicU64>().add(w) }
    }

    /// Copies the first `len` bytes of slot `slot` into box `bx`, where a
    /// message of `len` bytes lies ([`Segment::inline_at`]; `len <=`
    /// [`INLINE_BYTES`]): a small message written into a slot travels in
    /// the box the receiver polls.
    pub(crate) fn copy_slot_to_box(&self, slot: usize, bx: usize, len: usize) {
        assert!(len <= INLINE_BYTES, "{len} bytes do not fit a box");
        let (src, dst) = (self.slot_ptr(slot), self.inline_at(bx, len).0);
        // SAFETY: both ranges lie inside the mapping (slot_ptr and
        // inline_at check the indices; a slot holds at least 4096 bytes, a
        // box from the returned start INLINE_BYTES or SEQ_LINE_BYTES, at
        // least `len`) and do not overlap (boxes end before
        // `data_offset`). No reference to either range exists: this process
        // reaches slot and box memory only through raw pointers, and
        // `Segment` is not `Sync`, so no other thread uses these accessors
        // meanwhile; which message owns them is the protocol's decision.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }

    /// The shm name (with leading `/`).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The layout.
    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// Removes the name from `/dev/shm` (the mappings stay valid). After this
    /// (successful or not: `ENOENT` means the peer did it) drop no longer
    /// unlinks.
    pub(crate) fn unlink(&mut self) -> Result<(), SegError> {
        self.owns_name = false;
        match mman::shm_unlink(self.name.as_str()) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(SegError::Sys("shm_unlink", e)),
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base..base+total` is the mapping created in create/open and
        // not unmapped elsewhere; references handed out by `header` and
        // `len_word`/`box_seq` borrow `self`, so none outlives this call. Slot pointers
        // given to the engine must not be used after the channel is dropped
        // (the seam's contract).
        let _ = unsafe { mman::munmap(self.base.cast(), self.layout.total) };
        if self.owns_name {
            let _ = mman::shm_unlink(self.name.as_str());
        }
    }
}

/// Unlinks a freshly created name unless forgotten.
struct UnlinkOnError<'a>(&'a str);

impl Drop for UnlinkOnError<'_> {
    fn drop(&mut self) {
        let _ = mman::shm_unlink(self.0);
    }
}

/// A shared mapping of a whole memory file: unmapped on drop.
struct FileMapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: an exclusively owned mapping (like a Box<[u8]>); what is read or
// written through it is governed by the types below.
unsafe impl Send for FileMapping {}
// SAFETY: `&FileMapping` only hands out the base address.
unsafe impl Sync for FileMapping {}

impl std::fmt::Debug for FileMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({:p}, {} bytes)", self.base, self.len)
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is the mapping created by `map_shared`
        // for this value, unmapped only here; its owners hand out no
        // reference that outlives them.
        let _ = unsafe { mman::munmap(self.base.cast(), self.len) };
    }
}

/// This process's own memory file (a [`crate::host::HostBuffer`]), mapped
/// read-write. Peers map it read-only, so only this process writes it:
/// through `&mut self`, which makes the byte views sound.
#[derive(Debug)]
pub(crate) struct OwnMap(FileMapping);

impl OwnMap {
    /// Maps all `len` bytes of `fd` read-write (see `map_shared`); `fd` must
    /// be sealed against shrinking.
    pub(crate) fn new(fd: &std::os::fd::OwnedFd, len: usize) -> Result<OwnMap, SegError> {
        Ok(OwnMap(FileMapping {
            base: map_shared(fd, len, true, Populate::All)?,
            len,
        }))
    }

    /// First byte of the mapping (page-aligned).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.0.base.as_ptr()
    }

    /// The whole mapping as elements of `T` (a trailing partial element is
    /// left out).
    pub(crate) fn typed<T: Element>(&self) -> &[T] {
        // SAFETY: the mapping is page-aligned (so aligned for every
        // `Element`), holds `len` initialised (zeroed by the kernel) bytes
        // and lives as long as `self`; `Element` types have no padding and
        // every bit pattern is a value; only this process writes the file,
        // and only through `&mut self`.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr().cast::<T>(),
                self.0.len / std::mem::size_of::<T>(),
            )
        }
    }

    /// [`OwnMap::typed`], writable.
    pub(crate) fn typed_mut<T: Element>(&mut self) -> &mut [T] {
        // SAFETY: as in `typed`; `&mut self` makes this the only borrow.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr().cast::<T>(),
                self.0.len / std::mem::size_of::<T>(),
            )
        }
    }
}

/// A peer's memory file mapped read-only. Its owner may write it at any
/// time, so it only copies out ([`PeerMap::read_at`]).
#[derive(Debug)]
pub(crate) struct PeerMap(FileMapping);

impl PeerMap {
    /// Maps all `len` bytes of `fd` read-only (see `map_shared`); `fd` must
    /// be at least `len` bytes long and sealed against shrinking.
    pub(crate) fn new(fd: &std::os::fd::OwnedFd, len: usize) -> Result<PeerMap, SegError> {
        Ok(PeerMap(FileMapping {
            base: map_shared(fd, len, false, Populate::All)?,
            len,
        }))
    }

    /// Copies `len` bytes at offset `off` of the mapping to `dst` — with
    /// streaming stores when `stream` (see `DirectRecv::stream_hint`) —
    /// or returns false when `off..off+len` is not inside.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `len` bytes and not overlap the
    /// mapping.
    pub(crate) unsafe fn read_at(
        &self,
        off: usize,
        dst: *mut u8,
        len: usize,
        stream: bool,
    ) -> bool {
        if off.checked_add(len).is_none_or(|end| end > self.0.len) {
            return false;
        }
        // SAFETY: `off..off+len` is inside the mapping (checked above), which
        // lives as long as `self`; `dst` is the caller's (contract).
        unsafe {
            let src = self.0.base.as_ptr().add(off);
            if stream {
                braid_core::copy::copy_streaming(dst, src, len);
            } else {
                std::ptr::copy_nonoverlapping(src, dst, len);
            }
        }
        true
    }
}

/// Reads the `u64` at `remote` in process `pid` with `process_vm_readv`:
/// the receiver's proof that it may read its sender's memory.
pub(crate) fn read_process_word(pid: u32, remote: u64) -> Result<u64, Errno> {
    let mut word = 0u64;
    // SAFETY: `word` is a local u64, valid for 8 bytes of writes.
    unsafe { read_process(pid, remote, (&mut word as *mut u64).cast(), 8) }?;
    Ok(word)
}

/// Copy `len` bytes at `remote` in process `pid` to `dst` with
/// `process_vm_readv` (one copy, done by the kernel), looping over short reads.
///
/// # Safety
///
/// `dst` must be valid for writes of `len` bytes.
pub(crate) unsafe fn read_process(
    pid: u32,
    remote: u64,
    dst: *mut u8,
    len: usize,
) -> Result<(), Errno> {
    // SAFETY: forwarded from this function's contract.
    unsafe { copy_process(pid, remote, dst, len, false) }
}

/// Copy `len` bytes at `src` (ours) to `remote` in process `pid` with
/// `process_vm_writev`, looping over short writes. The kernel checks the
/// remote range and fails with `EFAULT`/`ESRCH`/`EPERM` rather than write
/// outside that process's mappings.
///
/// # Safety
///
/// `src` must be valid for reads of `len` bytes.
pub(crate) unsafe fn write_process(
    pid: u32,
    remote: u64,
    src: *const u8,
    len: usize,
) -> Result<(), Errno> {
    // SAFETY: forwarded from this function's contract; with `write` the
    // local range is only read.
    unsafe { copy_process(pid, remote, src as *mut u8, len, true) }
}

/// # Safety
///
/// `local` must be valid for `len` bytes: for writes when `!write`, for
/// reads when `write`.
unsafe fn copy_process(
    pid: u32,
    remote: u64,
    local: *mut u8,
    len: usize,
    write: bool,
) -> Result<(), Errno> {
    let mut done = 0usize;
    while done < len {
        let here = libc::iovec {
            // SAFETY: done < len, inside the caller's buffer.
            iov_base: unsafe { local.add(done) } as *mut libc::c_void,
            iov_len: len - done,
        };
        let there = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: one local iovec describing memory valid as the caller's
        // contract says (written only by readv, only read by writev) and one
        // remote iovec, which the kernel checks, failing with
        // EFAULT/ESRCH/EPERM instead of touching anything else.
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid as libc::pid_t, &here, 1, &there, 1, 0)
            } else {
                libc::process_vm_readv(pid as libc::pid_t, &here, 1, &there, 1, 0)
            }
        };
        if n < 0 {
            return Err(Errno::last());
        }
        if n == 0 {
            return Err(Errno::EFAULT);
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_separates_writers() {
        assert_eq!(std::mem::offset_of!(Header, head), 128);
        assert_eq!(std::mem::offset_of!(Header, tail), 256);
        assert_eq!(std::mem::offset_of!(Header, sender), 384);
        assert_eq!(std::mem::offset_of!(Header, receiver), 896);
        assert_eq!(std::mem::offset_of!(Header, help), 1408);
        assert_eq!(std::mem::offset_of!(Header, recv_bell), 1536);
        assert_eq!(std::mem::offset_of!(Header, send_bell), 1664);
        assert_eq!(size_of::<Header>(), 1792);
        assert_eq!(size_of::<SlotBox>(), 128);
        assert_eq!(std::mem::align_of::<SlotBox>(), 64);
        assert_eq!(std::mem::offset_of!(SlotBox, inline), 0);
        // A message in the second line shares it with `seq`, nothing more.
        assert_eq!(std::mem::offset_of!(SlotBox, word), 64 + SEQ_LINE_BYTES);
        assert_eq!(std::mem::offset_of!(SlotBox, seq), 120);
        assert_eq!(Layout::new(4096, 2).unwrap().boxes_offset, 1792);
    }

    #[test]
    fn layout_bounds() {
        assert!(Layout::new(4096, 2).is_some());
        assert!(Layout::new(4096 + 64, 2).is_some());
        assert!(Layout::new(4096 + 1, 2).is_none());
        assert!(Layout::new(2048, 8).is_none());
        assert!(Layout::new(4096, 1).is_none());
        assert!(Layout::new(4096, MAX_SLOTS + 1).is_none());
        assert!(Layout::new(MAX_SLOT_BYTES + 64, 2).is_none());
        let l = Layout::new(512 * 1024, 8).unwrap();
        assert_eq!(l.data_offset % PAGE, 0);
        assert_eq!(l.stride, 512 * 1024);
        assert_eq!(l.total, l.data_offset + 8 * 512 * 1024);
        let l = Layout::new(4096 + 64, 3).unwrap();
        assert_eq!(l.stride, 8192);
    }

    #[test]
    fn boxes_outnumber_small_rings_and_fit_before_the_slots() {
        for (slots, boxes) in [
            (2, MIN_BOXES),
            (16, MIN_BOXES),
            (300, 300),
            (MAX_SLOTS, MAX_SLOTS),
        ] {
            let l = Layout::new(4096, slots).unwrap();
            assert_eq!(l.boxes, boxes, "{slots} slots");
            assert!(l.boxes >= l.slots);
            // Every box lies before the first slot.
            assert!(l.boxes_offset + l.boxes * size_of::<SlotBox>() <= l.data_offset);
            assert_eq!(l.total, l.data_offset + slots * 4096);
        }
    }
}

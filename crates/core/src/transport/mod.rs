//! The transport seam.
//!
//! A transport moves bytes between two ranks. Each *directed* connection
//! (sender → receiver) is a bounded FIFO of fixed-size slots with credit-based
//! flow control: the sender acquires a free slot, fills it and commits it; the
//! receiver peeks the oldest committed slot, consumes it and releases it, which
//! returns the credit to the sender. The transport declares where its slot
//! memory lives ([`MemKind`]); only the engine touches slot memory.
//!
//! Set-up is two-phase and I/O-free from the runtime's point of view:
//!
//! 1. Each side of each directed connection calls [`Transport::listen`]
//!    (receiving end) or [`Transport::prepare_send`] (sending end), which
//!    allocates resources and returns an opaque *connect-info* blob.
//! 2. The runtime exchanges the blobs through the bootstrap, then calls
//!    [`PendingSend::connect`] on every sending end **first** and
//!    [`PendingRecv::connect`] on every receiving end afterwards. A send-side
//!    connect must never wait for the peer; a receive-side connect may wait (up
//!    to its deadline) for the sender to attach.
//!
//! All data-path calls are non-blocking polls: the engine owns the waiting
//! policy (spin, then yield, deadline, abort), so it is written once.
//!
//! Every transport implements the core of [`SendChannel`] and
//! [`RecvChannel`]. What only some links can do is a capability with a
//! default that is right for every other transport:
//!
//! - small messages outside the slots ([`SendChannel::poll_acquire_small`],
//!   default: an ordinary slot);
//! - single-copy transfers ([`DirectSend`] / [`DirectRecv`], reached through
//!   `direct()`, default `None`): shared memory and sockets;
//! - the link as a ring in GPU memory driven from a CUDA stream
//!   ([`SendChannel::device_ring`], default `None`): nvlink and pcie P2P;
//! - a doorbell to sleep on while the end cannot move
//!   ([`SendChannel::arm_wake`], default `None`: the engine polls): shared
//!   memory and sockets (see [`Doorbell`]).

mod kind;
mod wake;

use std::time::Instant;

pub use kind::TransportKind;
pub use wake::{sleep_any, Doorbell, WakeWord, Woken};

use crate::error::Result;
use crate::types::MemKind;

/// What the runtime knows about a rank when it sets up a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerDesc {
    /// The rank in the communicator.
    pub rank: u32,
    /// Identity of the memory domain the rank runs in: ranks with equal
    /// `host_id` can share memory.
    pub host_id: String,
    /// Operating-system process id.
    pub pid: u32,
    /// Network fabrics the rank is attached to, as `(transport name, fabric
    /// id)` from each transport's [`Transport::fabric`] (e.g. `("ib",
    /// "ib:fe80000000000000")`); a network transport connects two ranks
    /// only when both list the same fabric for it.
    pub fabrics: Vec<(String, String)>,
}

impl PeerDesc {
    /// The fabric id this rank announced for `transport`.
    pub fn fabric(&self, transport: &str) -> Option<&str> {
        self.fabrics
            .iter()
            .find(|(t, _)| t == transport)
            .map(|(_, f)| f.as_str())
    }
}

/// Memory of one slot, in the transport's [`MemKind`].
#[derive(Clone, Copy, Debug)]
pub struct SlotBuf {
    /// Start of the slot (aligned to at least 64 bytes).
    pub ptr: *mut u8,
    /// Capacity in bytes: the transport's `slot_bytes` for a slot to fill
    /// (`poll_acquire`); for a peeked slot at least the message's length
    /// (a transport may carry small messages in a smaller place).
    pub cap: usize,
}

/// What the oldest committed slot of a receiving end holds.
#[derive(Clone, Copy, Debug)]
pub enum Incoming {
    /// `len` bytes of payload in the slot itself.
    Inline(SlotBuf, usize),
    /// A reference to `len` bytes in the sender's memory: copy them out with
    /// [`DirectRecv::read_remote`] (single-copy transfer).
    Remote(usize),
}

/// A transport implementation: one per crate (`braid-transport-*`).
pub trait Transport: Send + Sync {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;
    /// Short name used in logs and errors (`shm`, `socket`, ...).
    fn name(&self) -> &'static str {
        self.kind().name()
    }
    /// Where this transport's slot memory lives.
    fn mem_kind(&self) -> MemKind;
    /// The fabric this end is attached to (what [`PeerDesc::fabrics`]
    /// carries to the other ranks), for transports that need a common
    /// network (an InfiniBand subnet, say); `None` for the others.
    fn fabric(&self) -> Option<String> {
        None
    }
    /// Whether this transport can connect `me` and `peer` (pure decision).
    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool;
    /// Bytes per slot of the links this end will receive on (a link has
    /// its receiver's geometry), known before any link exists: a
    /// communicator agrees on its piece size from these, then connects most
    /// links only when an operation first uses them. `None` (the default)
    /// where the transport cannot say; the runtime then takes the slot
    /// size of the links it connected.
    fn recv_slot_bytes(&self) -> Option<usize> {
        None
    }
    /// Phase 1, receiving end of `peer → me`: allocate and describe.
    fn listen(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<(Box<dyn PendingRecv>, Vec<u8>)>;
    /// Phase 1, sending end of `me → peer`: allocate and describe.
    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)>;
}

/// A boxed transport is a transport (so code generic over `Transport` takes
/// the runtime's table entries as they are).
impl<T: Transport + ?Sized> Transport for Box<T> {
    fn kind(&self) -> TransportKind {
        (**self).kind()
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn mem_kind(&self) -> MemKind {
        (**self).mem_kind()
    }
    fn fabric(&self) -> Option<String> {
        (**self).fabric()
    }
    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool {
        (**self).can_connect(me, peer)
    }
    fn recv_slot_bytes(&self) -> Option<usize> {
        (**self).recv_slot_bytes()
    }
    fn listen(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        (**self).listen(me, peer)
    }
    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)> {
        (**self).prepare_send(me, peer)
    }
}

/// A link whose slots are a ring in GPU memory with two 32-bit counters
/// beside it, as seen from one end: what a device engine needs to drive the
/// link from a GPU stream (stream memory operations) instead of through
/// [`SendChannel::commit`] / [`RecvChannel::release`]. All addresses are
/// device addresses valid in this process while the channel lives. Both ends
/// of a link must use the same way; the counters start at 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRing {
    /// Address of slot 0; slot `i` starts at `base + i * slot_bytes`.
    pub base: u64,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Number of slots.
    pub slots: usize,
    /// Counter written by the sender: pieces posted so far (mod 2^32).
    pub posted: u64,
    /// Counter written by the receiver: pieces consumed so far (mod 2^32).
    pub freed: u64,
}

/// A sending end between phase 1 and phase 2.
pub trait PendingSend: Send {
    /// Phase 2: attach to the receiver described by `receiver_info`. Must not
    /// wait for the receiver to act.
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn SendChannel>>;
}

/// A receiving end between phase 1 and phase 2.
pub trait PendingRecv: Send {
    /// Phase 2: finish the connection with the sender described by
    /// `sender_info`; may wait until `deadline` for the sender to attach.
    fn connect(
        self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn RecvChannel>>;
}

/// The sending end of a connected FIFO.
pub trait SendChannel: Send {
    /// The receiving rank.
    fn peer(&self) -> u32;
    /// Transport name for errors.
    fn transport(&self) -> &'static str;
    /// Where slot memory lives.
    fn mem_kind(&self) -> MemKind;
    /// Bytes per slot.
    fn slot_bytes(&self) -> usize;
    /// Number of slots (the most credits the sender can hold).
    fn slots(&self) -> usize;
    /// Non-blocking: the next free slot, or `None` while no credit is left.
    /// Calling it again before `commit` returns the same slot.
    fn poll_acquire(&mut self) -> Result<Option<SlotBuf>>;
    /// Like [`SendChannel::poll_acquire`], for a message the caller will
    /// commit with at most `len` bytes: the returned buffer may hold just
    /// `len` bytes (`cap ≥ len`), and a transport that carries small
    /// messages outside its slots may grant it while every slot is taken
    /// (the shm transport writes them into the cache line the receiver
    /// polls, and keeps more of those lines than slots), so a sender of
    /// small messages can run further ahead of its receiver. The default
    /// is `poll_acquire`.
    fn poll_acquire_small(&mut self, len: usize) -> Result<Option<SlotBuf>> {
        let _ = len;
        self.poll_acquire()
    }
    /// Publish the slot last returned by `poll_acquire` (or
    /// `poll_acquire_small`), holding `len` bytes (`len <= slot_bytes`, and
    /// at most what `poll_acquire_small` was asked for).
    fn commit(&mut self, len: usize) -> Result<()>;
    /// Non-blocking: true once the receiver has released every committed slot.
    fn poll_drained(&mut self) -> Result<bool>;
    /// Liveness check, called now and then while waiting: an error if the peer
    /// is known to be dead or to have aborted.
    fn check_peer(&mut self) -> Result<()>;
    /// Tell the peer that this side gave up (best effort, never blocks).
    fn abort(&mut self, reason: &str);
    /// Sleeping (see [`Doorbell`]): count the caller as asleep on this
    /// end's doorbell, which the transport rings whenever the end may be
    /// able to move (the receiver released slots, a queued piece left, the
    /// peer aborted or closed), and return the word to sleep on; `None`
    /// (the default) where the transport has no doorbell and the engine
    /// must poll. The caller polls the end once more before it sleeps, and
    /// calls [`SendChannel::disarm_wake`] once for every armed call.
    fn arm_wake(&mut self) -> Option<WakeWord> {
        None
    }
    /// Undo one [`SendChannel::arm_wake`] that returned a word.
    fn disarm_wake(&mut self) {}
    /// The link as a device ring, where it is one (see [`DeviceRing`]).
    fn device_ring(&self) -> Option<DeviceRing> {
        None
    }
    /// The single-copy capability of this end, where the link has it now
    /// (see [`DirectSend`]); `None` (the default) where it does not, or not
    /// yet (shm: until the receiver's probe found it can read this process).
    fn direct(&mut self) -> Option<&mut dyn DirectSend> {
        None
    }
    /// Keeping the link for a new communicator of the same processes (a
    /// shrink): where this end stands, or `None` (the default) where it
    /// cannot go on and a fresh link must replace it. Called only while no
    /// operation uses the link. See [`Resume`].
    fn resume_point(&mut self) -> Option<Resume> {
        None
    }
    /// Go on as the link to rank `peer` of the new communicator, after both
    /// ends' [`resume_point`](SendChannel::resume_point)s were found to fit
    /// ([`Resume::fits`]): `at` is the sender's own count. Whatever an
    /// earlier operation left (its abort, an unfinished message) is
    /// forgotten; both ends must resume before either uses the link.
    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        let _ = peer;
        Resume::expect(None, at, self.transport(), "the sending end")
    }
}

/// Where one end of a link stands, for keeping the link in a new
/// communicator ([`SendChannel::resume_point`],
/// [`RecvChannel::resume_point`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resume {
    /// Messages committed (sending end) or released (receiving end).
    pub count: u64,
    /// Receiving end: how many committed messages it can still drop on
    /// [`RecvChannel::resume`] (the ones it has not released: 0 where the
    /// end can only go on from where it is). Sending end: 0.
    pub drop_max: u64,
    /// The end goes on only through its transport's resynchronisation with
    /// the other end (after an abort left the link in the middle of a
    /// message: a socket link cuts its streams where each side stopped
    /// writing); false where it goes on from where it stands. Both ends of
    /// a kept link must say the same.
    pub resync: bool,
}

impl Resume {
    /// An end that goes on from where it stands, at `count` with nothing to
    /// drop.
    pub fn at(count: u64) -> Resume {
        Resume {
            count,
            drop_max: 0,
            resync: false,
        }
    }

    /// Whether a sending end at `send` and a receiving end at `recv` of the
    /// same link can go on together: the receiver released no more than
    /// was committed and can drop the rest, and both ends go on the same
    /// way (both resynchronise, or neither).
    pub fn fits(send: Resume, recv: Resume) -> bool {
        recv.count <= send.count
            && send.count - recv.count <= recv.drop_max
            && send.resync == recv.resync
    }

    /// For an end that goes on only from where it stands (an idle link):
    /// `Ok` when its resume point now (`point`) is at `at`, else
    /// [`CoreError::Unavailable`](crate::error::CoreError::Unavailable)
    /// naming `end` of `transport`.
    pub fn expect(
        point: Option<Resume>,
        at: u64,
        transport: &'static str,
        end: &str,
    ) -> Result<()> {
        match point {
            Some(p) if p.count == at => Ok(()),
            Some(p) => Err(crate::error::CoreError::Unavailable {
                transport,
                reason: format!("{end} stands at message {}, not {at}: it cannot be kept", p.count),
            }),
            None => Err(crate::error::CoreError::Unavailable {
                transport,
                reason: format!("{end} cannot be kept (failed, aborted, busy, or a transport that keeps no links)"),
            }),
        }
    }
}

/// The receiving end of a connected FIFO.
pub trait RecvChannel: Send {
    /// The sending rank.
    fn peer(&self) -> u32;
    /// Transport name for errors.
    fn transport(&self) -> &'static str;
    /// Where slot memory lives.
    fn mem_kind(&self) -> MemKind;
    /// Bytes per slot.
    fn slot_bytes(&self) -> usize;
    /// Non-blocking: the oldest committed slot and its length, or `None`.
    /// Calling it again before `release` returns the same slot.
    fn poll_peek(&mut self) -> Result<Option<(SlotBuf, usize)>>;
    /// Give the slot last returned by `poll_peek` back to the sender.
    fn release(&mut self) -> Result<()>;
    /// Liveness check, called now and then while waiting.
    fn check_peer(&mut self) -> Result<()>;
    /// Tell the peer that this side gave up (best effort). It does not
    /// wait for the peer, with one exception: a peer that may still be
    /// writing into memory this side lent it (the shm transport's shared
    /// reads, [`DirectSend::poll_help`]) is given up to a second to finish
    /// that write, so nothing lands in the caller's buffer afterwards.
    fn abort(&mut self, reason: &str);
    /// Sleeping (see [`Doorbell`]): count the caller as asleep on this
    /// end's doorbell, which the transport rings whenever the end may be
    /// able to move (a message arrived, bytes of a
    /// direct message can be read, the peer aborted or closed), and return the word to sleep on; `None`
    /// (the default) where the transport has no doorbell and the engine
    /// must poll. The caller polls the end once more before it sleeps, and
    /// calls [`RecvChannel::disarm_wake`] once for every armed call.
    fn arm_wake(&mut self) -> Option<WakeWord> {
        None
    }
    /// Undo one [`RecvChannel::arm_wake`] that returned a word.
    fn disarm_wake(&mut self) {}
    /// The link as a device ring, where it is one (see [`DeviceRing`]).
    fn device_ring(&self) -> Option<DeviceRing> {
        None
    }
    /// Like `poll_peek`, but also reports slots published with
    /// [`DirectSend::commit_direct`]. Transports without direct transfers
    /// keep this default.
    fn poll_peek_any(&mut self) -> Result<Option<Incoming>> {
        Ok(self.poll_peek()?.map(|(s, l)| Incoming::Inline(s, l)))
    }
    /// The single-copy capability of this end (see [`DirectRecv`]): a
    /// transport whose [`RecvChannel::poll_peek_any`] may return
    /// [`Incoming::Remote`] must return it. `None` by default.
    fn direct(&mut self) -> Option<&mut dyn DirectRecv> {
        None
    }
    /// Keeping the link for a new communicator: like
    /// [`SendChannel::resume_point`].
    fn resume_point(&mut self) -> Option<Resume> {
        None
    }
    /// Go on as the link from rank `peer` of the new communicator, like
    /// [`SendChannel::resume`]: `at` is the sender's count, and the
    /// messages between this end's count and `at` are dropped unread.
    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        let _ = peer;
        Resume::expect(None, at, self.transport(), "the receiving end")
    }
}

/// Single-copy sending, a capability of some links (shared memory, where
/// the receiver reads this process's memory; sockets, whose helper threads
/// write the bytes from it): the sender publishes a reference to its own
/// memory instead of a copy in a slot. Reached through
/// [`SendChannel::direct`].
pub trait DirectSend {
    /// Whether the receiver pays for a reference: true where the receiver
    /// copies the bytes out of this process itself (shared memory), so a
    /// reference only moves a copy from the sender to the receiver; false
    /// where the transport moves the bytes anyway (a socket's helpers write
    /// them from the caller's memory instead of from a slot), so a reference
    /// saves the sender a copy at no cost to the receiver. The engine sends
    /// data the receiver reduces by reference only when this is false.
    fn costs_receiver(&self) -> bool {
        true
    }

    /// Publish the slot last returned by [`SendChannel::poll_acquire`] as a
    /// reference to `len` bytes at `ptr` in this process's memory instead of
    /// a copy: the data moves once instead of twice. `len` may exceed the
    /// slot size.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads of `len` bytes, and the memory must stay
    /// allocated and unchanged until [`SendChannel::poll_drained`] returns
    /// true (the receiver reads it at a time of its choosing).
    unsafe fn commit_direct(&mut self, ptr: *const u8, len: usize) -> Result<()>;

    /// Non-blocking, called by an engine that waits (for a slot, or for its
    /// direct slots to drain) while it has direct slots outstanding on this
    /// channel: take a share of the receiver's copy of one of them (the shm
    /// transport writes a chunk of the referenced bytes into the receiver's
    /// destination, so two cores move the data of one transfer). True if it
    /// did some work. The memory is already pinned by
    /// [`DirectSend::commit_direct`]'s contract. Links whose receivers copy
    /// alone keep the default.
    fn poll_help(&mut self) -> Result<bool> {
        Ok(false)
    }
}

/// Single-copy receiving, the other end of [`DirectSend`]: reading the
/// bytes a [`Incoming::Remote`] slot refers to. Reached through
/// [`RecvChannel::direct`].
pub trait DirectRecv {
    /// Whether the copies this end makes itself should use streaming stores
    /// (the operation's buffers exceed the cache, so the destination would
    /// only evict what is cached) or ordinary ones (the data is used again
    /// while cached). The engine says so before each read; links whose
    /// reads are not CPU copies keep the default, which ignores it.
    fn stream_hint(&mut self, streaming: bool) {
        let _ = streaming;
    }

    /// Copy the payload of the current [`Incoming::Remote`] slot (all `len`
    /// bytes) to `dst`, before `release`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `len` bytes of host memory.
    unsafe fn read_remote(&mut self, dst: *mut u8, len: usize) -> Result<()>;

    /// Non-blocking form of [`DirectRecv::read_remote`]: moves what it can of
    /// the current [`Incoming::Remote`] slot to `dst` and returns true once
    /// all `len` bytes are there. Calls after a `false` must pass the same
    /// `dst` and `len` and continue the same slot; the engine calls it again
    /// (waiting with its own deadline, abort and liveness checks) until it
    /// returns true, then `release`s. The default does the whole read at
    /// once.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `len` bytes of host memory, and
    /// nothing else may access it until this returns true or an error. The
    /// transport (or the sender, helping: [`DirectSend::poll_help`]) writes
    /// `dst` until then, and not after: an error, or the channel's `abort`
    /// or drop, first makes sure no write is still under way.
    unsafe fn poll_read_remote(&mut self, dst: *mut u8, len: usize) -> Result<bool> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.read_remote(dst, len)? };
        Ok(true)
    }
}

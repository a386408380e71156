//! The sending end of a connected segment.

use std::sync::atomic::Ordering;

use braid_core::error::{CoreError, Result};
use braid_core::transport::{DirectSend, Resume, SendChannel, SlotBuf, WakeWord};
use braid_core::types::MemKind;

use super::{
    abort_reason, check_abort_and_process, clear_abort, next_slot, peer_stays, protocol,
    publish_abort, Claim, ADDR_WORD, CHUNK_WORD, DIRECT_FLAG, DST_WORD, INLINE_FLAG, REGION_WORD,
};
use crate::segment::{self, Segment};
use crate::{host, NAME};

/// What [`ShmSend`] handed out for the message it is about to commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Acquired {
    Nothing,
    /// Slot `head % slots` (and box `head % boxes`).
    Slot,
    /// Only the inline payload of box `head % boxes`, placed for a
    /// message of this many bytes ([`Segment::inline_at`]).
    Inline(usize),
}

/// The sending end of a connected segment.
#[derive(Debug)]
pub(crate) struct ShmSend {
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
    /// Huge pages were asked for the slots (the link moved bulk data).
    huge: bool,
}

impl ShmSend {
    /// The sending end of `seg`, to which it just attached.
    pub(crate) fn new(seg: Segment, peer: u32, peer_pid: u32) -> ShmSend {
        let layout = seg.layout();
        ShmSend {
            seg,
            peer,
            peer_pid,
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
            huge: false,
        }
    }

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
        self.seg.header().recv_bell.0.ring(true);
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

    /// Whether the receiver can read this process (its probe said so).
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
    /// not running. Where in the box depends on `len`
    /// ([`Segment::inline_at`]); a shorter commit moves it (`commit`).
    fn poll_acquire_small(&mut self, len: usize) -> Result<Option<SlotBuf>> {
        if len > segment::INLINE_BYTES {
            return self.poll_acquire();
        }
        self.not_aborted()?;
        if !self.credit(self.boxes)? {
            return Ok(None);
        }
        // Asked again before the commit: the same place, if it holds `len`.
        let asked = match self.acquired {
            Acquired::Inline(prev) if len <= self.seg.inline_at(self.head_box, prev).1 => prev,
            _ => len,
        };
        self.acquired = Acquired::Inline(asked);
        let (ptr, cap) = self.seg.inline_at(self.head_box, asked);
        Ok(Some(SlotBuf { ptr, cap }))
    }

    fn commit(&mut self, len: usize) -> Result<()> {
        if let Acquired::Inline(asked) = self.acquired {
            // Written in place by the caller.
            let (at, cap) = self.seg.inline_at(self.head_box, asked);
            if len > cap {
                return Err(CoreError::InvalidArgument(format!(
                    "shm commit of {len} bytes into a box acquired for at most {cap}"
                )));
            }
            let (to, _) = self.seg.inline_at(self.head_box, len);
            if to != at {
                // Acquired for more than the line of `seq` holds, committed
                // for less: the receiver looks for it in that line.
                // SAFETY: both ranges lie in the box's payload area
                // (`inline_at`, `len <= cap`), which is ours until published;
                // `copy` allows overlap.
                unsafe { std::ptr::copy(at, to, len) };
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
            // A small message travels in the box line the receiver polls
            // (the acquired slot and box are ours until published).
            self.seg
                .copy_slot_to_box(self.head_slot, self.head_box, len);
            return self.publish(len as u64 | INLINE_FLAG);
        }
        if !self.huge && len >= self.slot_bytes / 2 {
            // Bulk data: from now on the slots' pages may come as huge
            // pages (until then they cost only what was touched).
            self.huge = true;
            self.seg.advise_huge_slots();
        }
        self.publish(len as u64)
    }

    fn poll_drained(&mut self) -> Result<bool> {
        self.not_aborted()?;
        Ok(self.load_tail()? == self.head)
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
        self.seg.header().recv_bell.0.ring(true);
    }

    /// The receiver rings it after every release, and on its abort and
    /// close; the caller's next poll sees whatever came before the arm.
    fn arm_wake(&mut self) -> Option<WakeWord> {
        Some(self.seg.header().send_bell.0.arm(true))
    }

    fn disarm_wake(&mut self) {
        self.seg.header().send_bell.0.disarm();
    }

    fn direct(&mut self) -> Option<&mut dyn DirectSend> {
        if self.can_send_direct() {
            Some(self)
        } else {
            None
        }
    }

    /// Any sending end whose receiver is still there can go on: what an
    /// aborted operation left in the segment, the receiver drops.
    fn resume_point(&mut self) -> Option<Resume> {
        peer_stays(&self.seg.header().receiver.0, self.peer_pid).then_some(Resume::at(self.head))
    }

    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        if at != self.head {
            return Err(protocol(
                self.peer,
                format!(
                    "keeping the shm link: told to go on from message {at}, but {} were committed",
                    self.head
                ),
            ));
        }
        self.peer = peer;
        self.acquired = Acquired::Nothing;
        self.aborted = None;
        self.help_failed = false;
        clear_abort(&self.seg.header().sender.0);
        Ok(())
    }
}

impl DirectSend for ShmSend {
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
        // A piece in a registered host buffer: name its file too (words
        // REGION_WORD.., after the receiver's help words), so the receiver
        // can map it and copy without the kernel. The acquired slot is ours
        // to write until published; Relaxed: the Release store of the box's
        // `seq` in `publish` publishes the words.
        let r = host::region_of(ptr, len);
        let words = r.map_or([0; 4], |r| [r.ino, r.fd, r.base, r.len]);
        let slot = self.head_slot;
        self.seg
            .slot_word(slot, ADDR_WORD)
            .store(ptr as u64, Ordering::Relaxed);
        for (i, w) in words.into_iter().enumerate() {
            self.seg
                .slot_word(slot, REGION_WORD + i)
                .store(w, Ordering::Relaxed);
        }
        self.publish(len as u64 | DIRECT_FLAG)
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
        let slot = (t % self.slots) as usize;
        // The receiver's chunk size, written before the claim word we loaded
        // with Acquire (an offer of a released message was rejected above;
        // one replaced since fails the claim below, before anything is
        // written).
        let chunk = self.seg.slot_word(slot, CHUNK_WORD).load(Ordering::Relaxed) as usize;
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
        // The slot is committed and not released (checked above), so it
        // holds our address (our own write) and the receiver's destination
        // (written before the claim word we loaded with Acquire; not
        // rewritten while the claim stays open).
        let src = self.seg.slot_word(slot, ADDR_WORD).load(Ordering::Relaxed);
        let dst = self.seg.slot_word(slot, DST_WORD).load(Ordering::Relaxed);
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
        self.seg.header().recv_bell.0.ring(true);
        Ok(true)
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
        self.seg.header().recv_bell.0.ring(true);
    }
}

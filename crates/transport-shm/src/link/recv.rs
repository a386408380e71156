//! The receiving end of a connected segment.

use std::sync::atomic::Ordering;

use braid_core::error::{CoreError, Result};
use braid_core::transport::{DirectRecv, Incoming, RecvChannel, Resume, SlotBuf, WakeWord};
use braid_core::types::MemKind;

use super::{
    abort_reason, check_abort_and_process, clear_abort, help_split, next_slot, peer_stays,
    protocol, publish_abort, Claim, ADDR_WORD, CHUNK_WORD, DIRECT_FLAG, DST_WORD, HELP_CHUNKS_MIN,
    INLINE_FLAG, REGION_WORD,
};
use crate::probe::process_alive;
use crate::segment::{self, Segment};
use crate::{host, NAME};

/// The receiving end of a connected segment.
#[derive(Debug)]
pub(crate) struct ShmRecv {
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
    /// Copies from them use streaming stores (`DirectRecv::stream_hint`).
    stream: bool,
    /// Set by our own `abort`.
    aborted: Option<String>,
    /// Smallest chunk of a direct transfer shared with the sender; `None`:
    /// not shared ([`crate::ENV_HELP`], [`crate::ENV_HELP_CHUNK`]).
    help_chunk: Option<usize>,
    /// Generation of the last shared transfer (22 bits, never 0).
    generation: u32,
    /// The direct transfer being shared with the sender, if any.
    sharing: Option<Sharing>,
}

/// A direct transfer the receiver offered to share ([`segment::Help`]).
#[derive(Debug)]
struct Sharing {
    /// The destination the engine lent `poll_read_remote` (an address: it
    /// is written only through `read_chunks` and the sender's chunks).
    dst: usize,
    len: usize,
    chunk: usize,
    chunks: u32,
    /// Chunks this side claimed (and copied).
    mine: u32,
    /// No chunk is left unclaimed: the rest is the sender's.
    exhausted: bool,
}

impl ShmRecv {
    /// The receiving end of `seg`, whose sender (rank `peer`, process
    /// `peer_pid`) attached; direct transfers of at least
    /// [`HELP_CHUNKS_MIN`] chunks of `help_chunk` are shared with it.
    pub(crate) fn new(
        seg: Segment,
        peer: u32,
        peer_pid: u32,
        help_chunk: Option<usize>,
    ) -> ShmRecv {
        let layout = seg.layout();
        ShmRecv {
            seg,
            peer,
            peer_pid,
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
            files: host::PeerFiles::new(peer, peer_pid),
            stream: false,
            aborted: None,
            help_chunk,
            generation: 0,
            sharing: None,
        }
    }

    /// Whether the next message is published and lies in the segment (not
    /// peeked yet, not a direct message, which lives in the sender's
    /// memory and needs the sender alive), so it can be read whatever
    /// became of its sender.
    fn message_waits(&self) -> bool {
        if self.peeked || self.aborted.is_some() {
            return false;
        }
        let bx = self.tail_box;
        // Acquire: as in `poll_peek_any`.
        self.seg.box_seq(bx).load(Ordering::Acquire) == self.tail + 1
            && self.seg.len_word(bx).load(Ordering::Relaxed) & DIRECT_FLAG == 0
    }

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
        let Some((map, off)) = self.files.locate(region, addr, len) else {
            return false;
        };
        // SAFETY: forwarded from this function's contract; `read_at` checks
        // the range against the mapping.
        unsafe { map.read_at(off, dst, len, self.stream) }
    }

    /// Offers the peeked direct slot (`len` bytes from `addr` to `dst`) to
    /// the sender: `dst` goes into the slot's second word, then a fresh
    /// claim word opens the chunks to both sides.
    fn offer(&mut self, dst: *mut u8, len: usize, chunk: usize, chunks: usize) {
        self.generation = (self.generation % 0x3f_ffff) + 1;
        // The peeked slot is published and not released: its destination
        // and chunk words are ours to write (the sender wrote the address
        // and region words and rewrites the slot only after we release it).
        // Relaxed: published by the Release store of the claim word below.
        let slot = self.tail_slot;
        self.seg
            .slot_word(slot, DST_WORD)
            .store(dst as u64, Ordering::Relaxed);
        self.seg
            .slot_word(slot, CHUNK_WORD)
            .store(chunk as u64, Ordering::Relaxed);
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
            dst: dst as usize,
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
        let dst = (sh.dst + off) as *mut u8;
        // SAFETY: `off + n <= len`, and the engine lent `dst` for `len`
        // bytes of writes until `poll_read_remote` returns true or an error
        // (its contract); a transfer being shared is not finished.
        unsafe { segment::read_process(self.peer_pid, addr + off as u64, dst, n) }
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
            // The slot is published (its box's `seq` says so): the sender
            // wrote the address and the region words before its Release
            // store of `seq`.
            let w = |i: usize| {
                self.seg
                    .slot_word(self.tail_slot, i)
                    .load(Ordering::Relaxed)
            };
            let addr = w(ADDR_WORD);
            let region = [
                w(REGION_WORD),
                w(REGION_WORD + 1),
                w(REGION_WORD + 2),
                w(REGION_WORD + 3),
            ];
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
                    format!(
                        "shm box holds {len} bytes, more than {} (corrupt segment)",
                        segment::INLINE_BYTES
                    ),
                ));
            }
            self.remote = None;
            let (ptr, cap) = self.seg.inline_at(bx, len);
            return Ok(Some(Incoming::Inline(SlotBuf { ptr, cap }, len)));
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
        self.seg.header().send_bell.0.ring(true);
        Ok(())
    }

    fn check_peer(&mut self) -> Result<()> {
        // A message that is published and in the segment can still be
        // read whatever became of its sender (which may have finished the
        // operation and exited): only its absence makes a dead or aborted
        // sender an error.
        if self.message_waits() {
            return Ok(());
        }
        let sender = &self.seg.header().sender.0;
        if let Err(e) = check_abort_and_process(sender, self.peer, self.peer_pid) {
            // It may have published its last message and exited between
            // the look above and this check (its stores came before its
            // exit): look again before calling it an error.
            if self.message_waits() {
                return Ok(());
            }
            return Err(e);
        }
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
        self.seg.header().send_bell.0.ring(true);
    }

    /// The sender rings it after every message it publishes, every chunk
    /// of a shared transfer it finishes, and on its abort and close.
    fn arm_wake(&mut self) -> Option<WakeWord> {
        Some(self.seg.header().recv_bell.0.arm(true))
    }

    fn disarm_wake(&mut self) {
        self.seg.header().recv_bell.0.disarm();
    }

    fn direct(&mut self) -> Option<&mut dyn DirectRecv> {
        Some(self)
    }

    /// Messages the sender committed and this end did not release (at most
    /// `boxes`) are dropped unread when the link goes on.
    fn resume_point(&mut self) -> Option<Resume> {
        peer_stays(&self.seg.header().sender.0, self.peer_pid).then_some(Resume {
            count: self.tail,
            drop_max: self.boxes,
            resync: false,
        })
    }

    fn resume(&mut self, peer: u32, at: u64) -> Result<()> {
        // Acquire: pairs with the sender's Release store of `head`.
        let head = self.seg.header().head.0.load(Ordering::Acquire);
        if at != head || at < self.tail || at - self.tail > self.boxes {
            return Err(protocol(
                self.peer,
                format!(
                    "keeping the shm link: told to go on from message {at}, but the sender committed {head} and {} were released",
                    self.tail
                ),
            ));
        }
        // No transfer is shared any more; the words the sender reads to
        // help start afresh.
        self.withdraw();
        let h = &self.seg.header().help.0;
        h.done.store(0, Ordering::Relaxed);
        h.failed.store(0, Ordering::Relaxed);
        h.claim.store(0, Ordering::Release);
        self.tail = at;
        self.tail_slot = (at % self.slots) as usize;
        self.tail_box = (at % self.boxes) as usize;
        self.head_cache = at;
        self.peeked = false;
        self.remote = None;
        self.remote_region = None;
        self.aborted = None;
        if peer != self.peer {
            self.files = host::PeerFiles::new(peer, self.peer_pid);
            self.peer = peer;
        }
        clear_abort(&self.seg.header().receiver.0);
        // Release: as in `release`: the sender may reuse every slot.
        self.seg.header().tail.0.store(at, Ordering::Release);
        self.seg.header().send_bell.0.ring(true);
        Ok(())
    }
}

impl ShmRecv {
    /// After reading a direct message from the sender's memory: the read
    /// stands only if the sender had not aborted. A sender whose operation
    /// failed (because of a third rank) publishes its abort, returns the
    /// error and may reuse or free the buffer we were reading; its abort,
    /// published before that, is visible here after the read (Acquire).
    fn read_stands(&self) -> Result<()> {
        match abort_reason(&self.seg.header().sender.0) {
            None => Ok(()),
            Some(reason) => Err(CoreError::PeerAborted {
                transport: NAME,
                peer: self.peer,
                reason,
            }),
        }
    }
}

impl DirectRecv for ShmRecv {
    fn stream_hint(&mut self, streaming: bool) {
        self.stream = streaming;
    }

    unsafe fn read_remote(&mut self, dst: *mut u8, len: usize) -> Result<()> {
        let addr = self.direct_slot(len)?;
        // SAFETY: forwarded from this function's contract.
        if unsafe { self.read_mapped(addr, dst, len) } {
            return self.read_stands();
        }
        // SAFETY: `dst` is valid for `len` bytes (this method's contract).
        unsafe { segment::read_process(self.peer_pid, addr, dst, len) }
            .map_err(|e| self.read_error(e))?;
        self.read_stands()
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
                return self.read_stands().map(|()| true);
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
            .is_some_and(|s| s.dst != dst as usize || s.len != len)
        {
            return Err(CoreError::InvalidArgument(
                "shm poll_read_remote called for another destination before the last finished"
                    .into(),
            ));
        }
        let res = self
            .step_shared(addr)
            .and_then(|done| self.read_stands().map(|()| done));
        if res.is_err() {
            self.withdraw();
        }
        res
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
        self.seg.header().send_bell.0.ring(true);
    }
}

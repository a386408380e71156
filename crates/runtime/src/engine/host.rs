//! The host engine: runs a [`Program`] on host memory over connected
//! transport channels, on the caller's thread. Slots must be host memory
//! ([`MemKind::Device`] slots are the device engines'). Programs go through
//! the stage runner ([`run_stages`]) op by op ([`HostRun::run_op`]), with
//! single-copy transfers and operation headers. Small programs (every piece at most
//! [`SMALL_PIECE_BYTES`], one op per stage: the latency-bound collectives)
//! take a fast path of the same ops ([`HostRun::run_small`]): one op after
//! the other, without retries, and since their pieces never go by
//! reference, an output is a slot just large enough for the piece and its
//! header (`poll_acquire_small`), without the single-copy decision.

use std::ops::ControlFlow;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use braid_core::plan::{Op, Program, Region};
use braid_core::reduce;
use braid_core::transport::{Incoming, SlotBuf};
use braid_core::types::MemKind;
use braid_core::{CoreError, DataType, RedOp};

use super::{run_stages, Blocked, Channels, OpRunner, RawBuf, WaitPolicy, Waiter};
use crate::fingerprint::{self, Headers, HEADER_BYTES};
use crate::progress::Progress;
use crate::slot_stores::SlotStores;

/// Everything `execute` needs besides the program.
#[derive(Debug)]
pub(crate) struct Exec<'a> {
    /// The operation's buffers, by buffer index.
    pub bufs: &'a [RawBuf],
    /// Waiting policy.
    pub policy: &'a WaitPolicy,
    /// Set from any thread to make waits fail promptly.
    pub abort: &'a AtomicBool,
    /// Pieces of at least this many bytes of pure data movement go by
    /// reference where the link allows it (single copy); `usize::MAX` never.
    pub direct_min: usize,
    /// The same for links whose receiver does not pay for a reference
    /// ([`DirectSend::costs_receiver`] false: sockets, whose writes then
    /// come from the caller's memory instead of a slot copy), whether or not
    /// the call goes single-copy: a reference there only saves a copy.
    ///
    /// [`DirectSend::costs_receiver`]: braid_core::transport::DirectSend::costs_receiver
    pub free_direct_min: usize,
    /// Copies between the caller's buffers use streaming stores (the
    /// operation's buffers exceed the cache; `braid_core::copy`).
    pub stream_copies: bool,
    /// Per link, whether pieces go into slots with ordinary or streaming
    /// stores when `stream_copies` does not decide (`None`: ordinary).
    pub slot_stores: Option<&'a SlotStores>,
    /// This rank (for messages).
    pub rank: u32,
    /// Operation headers to send and to check (mismatch detection); `None`
    /// turns the check off.
    pub headers: Option<&'a Headers>,
    /// Where blocked waits are published (hang localisation).
    pub progress: Option<&'a Progress>,
    /// The program's [`small_max`], computed once with its plan.
    pub small_max: Option<usize>,
}

/// Per peer, what of the operation headers the running operation has
/// checked and sent ([`GOT`], [`SENT`], [`PREFIX`] bits), kept from one
/// operation to the next (no allocation on the hot path). Each entry is
/// stamped with the operation it belongs to, so a new operation starts
/// with every peer clear without touching the entries: clearing them took
/// a `memset` of one byte per rank on every call.
#[derive(Debug, Default)]
pub(crate) struct HeaderFlags {
    /// The running operation's stamp (never 0 once one ran).
    epoch: u32,
    /// Per peer: `epoch << 8 | bits`.
    per_peer: Vec<u32>,
}

impl HeaderFlags {
    /// Clear every peer's bits for a new operation on `n` ranks.
    fn start(&mut self, n: usize) {
        if self.per_peer.len() != n {
            self.per_peer.clear();
            self.per_peer.resize(n, 0);
        }
        self.epoch = (self.epoch + 1) & 0x00ff_ffff;
        if self.epoch == 0 {
            // Wrapped: stamps of 2^24 operations ago would read as current.
            self.per_peer.fill(0);
            self.epoch = 1;
        }
    }

    fn bits(&self, peer: u32) -> Option<u8> {
        let &e = self.per_peer.get(peer as usize)?;
        Some(if e >> 8 == self.epoch { e as u8 } else { 0 })
    }

    fn len(&self) -> usize {
        self.per_peer.len()
    }
}

/// Operation headers in flight: which peers' headers were checked and sent
/// so far in this operation. A header travels in front of the first piece to
/// a peer when both fit one slot, else as a message of its own.
struct HeaderCheck<'a> {
    headers: Option<&'a Headers>,
    flags: &'a mut HeaderFlags,
}

/// The peer's header was checked.
const GOT: u8 = 1;
/// Our header to the peer was sent.
const SENT: u8 = 2;
/// The slot peeked from this peer starts with its (checked) header.
const PREFIX: u8 = 4;

impl HeaderCheck<'_> {
    fn flag(&self, peer: u32, bit: u8) -> bool {
        self.flags.bits(peer).is_some_and(|f| f & bit != 0)
    }

    fn set(&mut self, peer: u32, bit: u8, on: bool) {
        let Some(f) = self.flags.bits(peer) else {
            return;
        };
        let f = if on { f | bit } else { f & !bit };
        self.flags.per_peer[peer as usize] = self.flags.epoch << 8 | f as u32;
    }

    /// Our header for `to`, if it still has to be sent.
    fn unsent(&self, to: u32) -> Option<[u8; HEADER_BYTES]> {
        let h = self.headers?;
        if self.flag(to, SENT) || to as usize >= self.flags.len() {
            return None;
        }
        h.to_peer(to)
    }

    /// Whether a header from `from` must still be read before its data.
    fn pending(&self, from: u32) -> bool {
        (from as usize) < self.flags.len()
            && !self.flag(from, GOT)
            && self
                .headers
                .is_some_and(|h| h.expected_from(from).is_some())
    }
}

/// Run `prog` to completion.
///
/// # Safety
///
/// Every buffer of `ex.bufs` must be valid for reads and writes of `len` bytes
/// for the whole call, aligned for the program's datatype, and not accessed
/// by anything else meanwhile (buffers may alias each other as the plans
/// allow). The regions of `prog` must lie inside those buffers (the runtime
/// checks this when it builds the buffers from the caller's slices).
pub(crate) unsafe fn execute(
    prog: &Program,
    chans: &mut Channels,
    ex: &Exec<'_>,
    flags: &mut HeaderFlags,
) -> Result<(), CoreError> {
    let mut waiter = Waiter::new(ex.policy, ex.abort, ex.progress);
    flags.start(ex.headers.map(|h| h.nranks()).unwrap_or(0));
    let mut run = HostRun {
        prog,
        ex,
        small: ex
            .small_max
            .is_some_and(|m| m < ex.direct_min.min(ex.free_direct_min)),
        direct: Vec::new(),
        scratch_owner: None,
        hdr: HeaderCheck {
            headers: ex.headers,
            flags,
        },
    };
    if run.small {
        // SAFETY: forwarded from this function's contract.
        let r = unsafe { run.run_small(chans, &mut waiter) };
        if r.is_err() {
            waiter.disarm(chans);
        }
        return r;
    }
    run_stages(prog, chans, &mut waiter, &mut run)?;
    // Peers sent references into the caller's buffers must finish reading
    // them before the caller gets its buffers back.
    let r = drain_direct(chans, &mut waiter, &run.direct);
    if r.is_err() {
        waiter.disarm(chans);
    }
    r
}

/// Waits until every peer in `direct` has read what we sent it by reference.
fn drain_direct(
    chans: &mut Channels,
    waiter: &mut Waiter<'_>,
    direct: &[u32],
) -> Result<(), CoreError> {
    for &peer in direct {
        while !chans.sender(peer)?.poll_drained()? {
            waiter.idle(chans, Blocked::drain(peer), direct)?;
        }
        waiter.progressed(chans);
    }
    Ok(())
}

/// Largest piece (and local copy) of a small program ([`small_program`]).
const SMALL_PIECE_BYTES: usize = 1024;

/// Writes one piece of `len` bytes into `to`'s slot with `write(stream)`.
/// Operations larger than the cache (`ex.stream_copies`) take `big` and are
/// not timed; the others take what the link's [`SlotStores`] chooses, and
/// pieces it times are timed here.
#[inline(always)]
fn slot_write(ex: &Exec, to: u32, len: usize, big: bool, write: impl FnOnce(bool)) {
    if len < crate::slot_stores::TIMED_MIN_BYTES {
        // Never timed (`SlotStores::choose` picks ordinary stores).
        return write(ex.stream_copies && big);
    }
    match ex.slot_stores {
        Some(s) if !ex.stream_copies => {
            let stream = s.choose(to, len);
            let t0 = Instant::now();
            write(stream);
            s.record(to, stream, len, t0.elapsed().as_nanos() as u64);
        }
        _ => write(ex.stream_copies && big),
    }
}

/// The largest piece (or local copy) of `prog` if it is small: one op per
/// stage and every piece and copy at most [`SMALL_PIECE_BYTES`]. A call
/// runs it on the small path when that piece is also below its
/// single-copy threshold (so that no piece goes by reference). Computed
/// once per plan (`Planned`); O(1) for large programs (their first op is
/// large).
pub(crate) fn small_max(prog: &Program) -> Option<usize> {
    if prog.stage_ends.len() != prog.ops.len() {
        return None;
    }
    let mut max = 0;
    for op in &prog.ops {
        let len = match *op {
            Op::Copy { src, .. } => src.len,
            _ => op.wire_len(),
        };
        if len > SMALL_PIECE_BYTES {
            return None;
        }
        max = max.max(len);
    }
    Some(max)
}

/// The error for a piece of the wrong length.
fn wrong_piece(from: u32, got: usize, len: usize) -> CoreError {
    CoreError::Protocol {
        peer: from,
        detail: format!(
            "rank {from} sent a piece of {got} bytes where {len} were expected: the ranks called different operations, counts or datatypes"
        ),
    }
}

fn region_ptr(ex: &Exec<'_>, r: Region) -> Result<*mut u8, CoreError> {
    let b = ex
        .bufs
        .get(r.buf as usize)
        .ok_or_else(|| CoreError::InvalidArgument(format!("program names buffer {}", r.buf)))?;
    match r.offset.checked_add(r.len) {
        Some(end) if end <= b.len => {
            // SAFETY: offset + len lies within the buffer (checked above).
            Ok(unsafe { b.ptr.add(r.offset) })
        }
        _ => Err(CoreError::InvalidArgument(format!(
            "region {}+{} outside buffer {} of {} bytes",
            r.offset, r.len, r.buf, b.len
        ))),
    }
}

fn host_slot(kind: MemKind, peer: u32) -> Result<(), CoreError> {
    match kind {
        MemKind::Host => Ok(()),
        MemKind::Device(d) => Err(CoreError::InvalidArgument(format!(
            "the link with rank {peer} keeps its slots on GPU {d}; the host engine cannot run it"
        ))),
    }
}

fn dtype_op(prog: &Program) -> Result<(DataType, RedOp), CoreError> {
    match (prog.dtype, prog.red_op) {
        (Some(d), Some(o)) => Ok((d, o)),
        _ => Err(CoreError::InvalidArgument(
            "a reducing op in a program without datatype and operator".into(),
        )),
    }
}

/// One operation on the host engine, driven op by op by [`run_stages`].
/// Only [`execute`] makes one, so its contract covers every buffer and
/// region the program names.
struct HostRun<'a> {
    prog: &'a Program,
    ex: &'a Exec<'a>,
    /// The program is small ([`small_program`]): its pieces travel in
    /// slots acquired for just their bytes.
    small: bool,
    /// Peers that were sent a direct (single-copy) reference: the operation
    /// waits for them to finish reading before it returns.
    direct: Vec<u32>,
    /// The peer whose direct input is being read into the scratch buffer (a
    /// read may take several calls).
    scratch_owner: Option<u32>,
    hdr: HeaderCheck<'a>,
}

impl OpRunner for HostRun<'_> {
    fn try_op(&mut self, op: &Op, chans: &mut Channels) -> Result<Option<Blocked>, CoreError> {
        // SAFETY: a HostRun is made only by `execute`, whose contract
        // covers every buffer and region of the program.
        unsafe { self.run_op(op, chans) }
    }

    fn helping(&self) -> &[u32] {
        &self.direct
    }
}

/// Where an op's output goes: a slot to fill (after `extra` bytes of
/// operation header), or a direct reference to the caller's memory.
#[derive(Clone, Copy)]
enum Output {
    Slot(SlotBuf),
    Direct,
}

/// Go on with the value, or return the op as blocked.
macro_rules! ready {
    ($e:expr) => {
        match $e {
            ControlFlow::Continue(v) => v,
            ControlFlow::Break(b) => return Ok(Some(b)),
        }
    };
}

impl HostRun<'_> {
    /// Try to run one op: take its input, take its output, read a direct
    /// input, then move the data and publish. An op that has to wait does
    /// so before it changes anything visible: its input stays unreleased
    /// and its output slot uncommitted (a direct input read into its
    /// destination is read again into the same place), so the retry starts
    /// over.
    ///
    /// # Safety
    ///
    /// As for [`execute`].
    unsafe fn run_op(
        &mut self,
        op: &Op,
        chans: &mut Channels,
    ) -> Result<Option<Blocked>, CoreError> {
        let len = op.wire_len();
        let input = match op.recv_peer() {
            Some(from) => Some((from, ready!(self.take_input(chans, from, len)?))),
            None => None,
        };
        let (output, extra) = match op.send_peer() {
            Some(to) => {
                let (out, extra) = ready!(self.take_output(chans, op, to, len)?);
                (Some((to, out)), extra)
            }
            None => (None, 0),
        };
        let remote_at = match input {
            Some((from, Incoming::Remote(_))) => {
                // SAFETY: forwarded from this function's contract.
                let read = unsafe { self.read_direct(chans, op, from, len)? };
                Some(ready!(read))
            }
            _ => None,
        };
        let io = OpIo {
            len,
            input: input.map(|(_, inc)| inc),
            remote_at,
            output,
            extra,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.perform(op, chans, &io)? };
        self.complete(chans, op, extra)?;
        Ok(None)
    }

    /// After an op ran: its input is released, and a header sent in front
    /// of its output (`extra` bytes) counts as sent.
    #[inline(always)]
    fn complete(&mut self, chans: &mut Channels, op: &Op, extra: usize) -> Result<(), CoreError> {
        if let Some(from) = op.recv_peer() {
            chans.receiver(from)?.release()?;
            self.hdr.set(from, PREFIX, false);
            if self.scratch_owner == Some(from) {
                self.scratch_owner = None;
            }
        }
        if let Some(to) = op.send_peer() {
            if extra > 0 {
                self.hdr.set(to, SENT, true);
            }
        }
        Ok(())
    }

    /// The fast path of a small program ([`small_program`]: one op per
    /// stage, every piece in a slot): the same ops as [`HostRun::run_op`],
    /// one after the other, each waiting for its input, then (holding the
    /// input, as a retried op does) for its output, without retrying whole
    /// ops. Waits go through `waiter`. The steps it shares with `run_op`
    /// are inlined (`#[inline(always)]`): called as functions, they made an
    /// 8-byte AllReduce on 2 ranks 0.35-0.39 µs instead of 0.25-0.29
    /// (medians of 9 runs alternated with the earlier executor of its own).
    ///
    /// # Safety
    ///
    /// As for [`execute`].
    unsafe fn run_small(
        &mut self,
        chans: &mut Channels,
        waiter: &mut Waiter<'_>,
    ) -> Result<(), CoreError> {
        for (si, op) in self.prog.ops.iter().enumerate() {
            waiter.stage = si;
            let len = op.wire_len();
            // Each wait that ends starts the next afresh.
            let input = match op.recv_peer() {
                Some(from) => Some(loop {
                    match self.take_input(chans, from, len)? {
                        ControlFlow::Continue(inc) => break inc,
                        ControlFlow::Break(b) => waiter.idle(chans, b, &[])?,
                    }
                }),
                None => None,
            };
            if input.is_some() {
                waiter.progressed(chans);
            }
            let (output, extra) = match op.send_peer() {
                Some(to) => loop {
                    match self.take_small_output(chans, to, len)? {
                        ControlFlow::Continue((out, extra)) => break (Some((to, out)), extra),
                        ControlFlow::Break(b) => waiter.idle(chans, b, &[])?,
                    }
                },
                None => (None, 0),
            };
            if output.is_some() {
                waiter.progressed(chans);
            }
            let io = OpIo {
                len,
                input,
                remote_at: None,
                output,
                extra,
            };
            // SAFETY: forwarded from this function's contract.
            unsafe { self.perform(op, chans, &io)? };
            self.complete(chans, op, extra)?;
        }
        Ok(())
    }

    /// The incoming piece of `len` bytes from `from`, its operation header
    /// checked first on the same peek and skipped where it precedes the
    /// piece (a header that came alone frees its slot, and we look for the
    /// piece).
    #[inline(always)]
    fn take_input(
        &mut self,
        chans: &mut Channels,
        from: u32,
        len: usize,
    ) -> Result<ControlFlow<Blocked, Incoming>, CoreError> {
        loop {
            let pending = self.hdr.pending(from);
            let ch = chans.receiver(from)?;
            let Some(inc) = ch.poll_peek_any()? else {
                return Ok(ControlFlow::Break(Blocked::data(from)));
            };
            let kind = ch.mem_kind();
            host_slot(kind, from)?;
            let prefixed = if pending {
                if !accept_header(self.ex, &mut self.hdr, from, inc, kind)? {
                    ch.release()?;
                    continue;
                }
                true
            } else {
                self.hdr.flag(from, PREFIX)
            };
            let inc = match inc {
                Incoming::Inline(slot, l) if prefixed => Incoming::Inline(
                    SlotBuf {
                        // SAFETY: the slot held a header and more.
                        ptr: unsafe { slot.ptr.add(HEADER_BYTES) },
                        cap: slot.cap - HEADER_BYTES,
                    },
                    l - HEADER_BYTES,
                ),
                Incoming::Remote(l) if self.small => {
                    // Our plan moves this piece through a slot; a peer
                    // whose plan sends it by reference runs another
                    // configuration (the one the plans must share).
                    return Err(CoreError::Protocol {
                        peer: from,
                        detail: format!(
                            "rank {from} sent a piece of {l} bytes by reference where a small piece in a slot was expected: set BRAID_SINGLE_COPY_MIN_BYTES alike on every rank"
                        ),
                    });
                }
                other => other,
            };
            let got = match inc {
                Incoming::Inline(_, l) | Incoming::Remote(l) => l,
            };
            if got != len {
                return Err(wrong_piece(from, got, len));
            }
            return Ok(ControlFlow::Continue(inc));
        }
    }

    /// A slot to `to` for the op's `len` bytes, or the decision to send them
    /// by reference; our operation header goes in front of the data when it
    /// has not been sent yet and fits (the second value: its bytes), else in
    /// a message of its own.
    fn take_output(
        &mut self,
        chans: &mut Channels,
        op: &Op,
        to: u32,
        len: usize,
    ) -> Result<ControlFlow<Blocked, (Output, usize)>, CoreError> {
        let ex = self.ex;
        let ch = chans.sender(to)?;
        let Some(mut slot) = ch.poll_acquire()? else {
            return Ok(ControlFlow::Break(Blocked::slot(to)));
        };
        host_slot(ch.mem_kind(), to)?;
        // Not for RecvReduceSend: its output exists only in the slot it
        // reduces into. Not for data a receiver reduces (Send in a reducing
        // collective) where the receiver pays for the reference (it would
        // only move the copy from us to it). Nor for data this op has just
        // written (a relay, a reduced piece) where the link streams into
        // slots and the piece fits one (single-copy plans may cut larger
        // ones): the receiver's read would fetch every line from our cache
        // across dies (2 ranks, 1 MiB AllReduce across dies: 68-130 µs
        // through slots against 330-400 µs by reference).
        let fresh = len <= slot.cap
            && matches!(op, Op::RecvCopySend { .. } | Op::RecvReduceCopySend { .. });
        // The link's single-copy capability, and whether the receiver pays
        // for a reference (None: no single copy on this link now).
        let costs_receiver = match ch.direct().map(|d| d.costs_receiver()) {
            Some(true) if len >= ex.direct_min => Some(true),
            Some(false) if len >= ex.direct_min.min(ex.free_direct_min) => Some(false),
            _ => None,
        };
        let direct_ok = costs_receiver.is_some()
            && !matches!(op, Op::RecvReduceSend { .. })
            && (self.prog.red_op.is_none()
                || !matches!(op, Op::Send { .. })
                || costs_receiver == Some(false))
            && !(fresh && ex.slot_stores.is_some_and(|s| s.streaming(to)));
        let mut extra = 0;
        if let Some(hb) = self.hdr.unsent(to) {
            // SAFETY: a host slot holds at least 4096 bytes.
            unsafe { std::ptr::copy_nonoverlapping(hb.as_ptr(), slot.ptr, HEADER_BYTES) };
            if !direct_ok && slot.cap >= len + HEADER_BYTES {
                // In front of the data, in the same slot (marked sent once
                // the slot is committed: a retry writes it again).
                extra = HEADER_BYTES;
                slot = SlotBuf {
                    // SAFETY: cap ≥ len + HEADER_BYTES.
                    ptr: unsafe { slot.ptr.add(HEADER_BYTES) },
                    cap: slot.cap - HEADER_BYTES,
                };
            } else {
                // A message of its own; the data needs the next slot.
                ch.commit(HEADER_BYTES)?;
                self.hdr.set(to, SENT, true);
                match ch.poll_acquire()? {
                    None => return Ok(ControlFlow::Break(Blocked::slot(to))),
                    Some(next) => slot = next,
                }
            }
        }
        // Single copy: the transport takes the bytes straight from our
        // buffer.
        if direct_ok && extra == 0 {
            Ok(ControlFlow::Continue((Output::Direct, 0)))
        } else if slot.cap < len {
            Err(CoreError::InvalidArgument(format!(
                "piece of {len} bytes does not fit the {}-byte slots of the link to rank {to}",
                slot.cap
            )))
        } else {
            Ok(ControlFlow::Continue((Output::Slot(slot), extra)))
        }
    }

    /// The output of an op of a small program: a slot for the piece and
    /// our operation header in front of it if not sent yet (which the
    /// transport may grant beyond its slots, letting small messages run
    /// further ahead: `poll_acquire_small`).
    #[inline(always)]
    fn take_small_output(
        &mut self,
        chans: &mut Channels,
        to: u32,
        len: usize,
    ) -> Result<ControlFlow<Blocked, (Output, usize)>, CoreError> {
        let header = self.hdr.unsent(to);
        let extra = header.map_or(0, |_| HEADER_BYTES);
        let ch = chans.sender(to)?;
        let Some(slot) = ch.poll_acquire_small(len + extra)? else {
            return Ok(ControlFlow::Break(Blocked::slot(to)));
        };
        host_slot(ch.mem_kind(), to)?;
        if slot.cap < len + extra {
            return Err(CoreError::InvalidArgument(format!(
                "piece of {len} bytes does not fit the {}-byte slots of the link to rank {to}",
                slot.cap
            )));
        }
        if let Some(hb) = header {
            // SAFETY: the slot holds at least len + HEADER_BYTES bytes.
            unsafe { std::ptr::copy_nonoverlapping(hb.as_ptr(), slot.ptr, HEADER_BYTES) };
        }
        let slot = SlotBuf {
            // SAFETY: cap ≥ extra + len.
            ptr: unsafe { slot.ptr.add(extra) },
            cap: slot.cap - extra,
        };
        Ok(ControlFlow::Continue((Output::Slot(slot), extra)))
    }

    /// Read a direct input of `len` bytes from `from` (without blocking; it
    /// may take several tries) into where the op wants it: the destination
    /// region of a plain receive, else the scratch buffer (which one peer's
    /// read holds at a time). Only then does the op run, so a wait leaves
    /// nothing half done.
    ///
    /// # Safety
    ///
    /// As for [`execute`].
    unsafe fn read_direct(
        &mut self,
        chans: &mut Channels,
        op: &Op,
        from: u32,
        len: usize,
    ) -> Result<ControlFlow<Blocked, *mut u8>, CoreError> {
        let dest = match *op {
            Op::Recv { dst, .. } | Op::RecvCopySend { dst, .. } => region_ptr(self.ex, dst)?,
            _ => {
                if self.scratch_owner.is_some_and(|o| o != from) {
                    return Ok(ControlFlow::Break(Blocked::data(from)));
                }
                let words = len.div_ceil(8);
                if chans.scratch.len() < words {
                    chans.scratch.resize(words, 0);
                }
                self.scratch_owner = Some(from);
                chans.scratch.as_mut_ptr() as *mut u8
            }
        };
        let rx = chans.receiver(from)?;
        let transport = rx.transport();
        let rx = rx.direct().ok_or_else(|| CoreError::Protocol {
            peer: from,
            detail: format!(
                "the {transport} link from rank {from} announced a single-copy piece but has no single-copy reads"
            ),
        })?;
        rx.stream_hint(self.ex.stream_copies);
        // SAFETY: `dest` is a region pointer valid for `len` bytes (caller's
        // contract) or the scratch buffer of at least `len` bytes, which
        // nothing else touches until this read completes (`scratch_owner`).
        if !unsafe { rx.poll_read_remote(dest, len)? } {
            return Ok(ControlFlow::Break(Blocked::data(from)));
        }
        Ok(ControlFlow::Continue(dest))
    }

    /// Move and reduce the op's data between its input, the caller's
    /// buffers and its output, and publish the output.
    ///
    /// # Safety
    ///
    /// As for [`execute`].
    #[inline(always)]
    unsafe fn perform(
        &mut self,
        op: &Op,
        chans: &mut Channels,
        io: &OpIo,
    ) -> Result<(), CoreError> {
        let (prog, ex, len) = (self.prog, self.ex, io.len);
        // SAFETY: region pointers are inside the caller's buffers (region_ptr
        // checks) and valid by this function's contract; slot and scratch
        // pointers hold `len` bytes; slots never overlap user buffers.
        unsafe {
            match *op {
                Op::Copy { src, dst, finalize } => {
                    let (s, d) = (region_ptr(ex, src)?, region_ptr(ex, dst)?);
                    let n = src.len;
                    if s != d {
                        let apart = s as usize + n <= d as usize || d as usize + n <= s as usize;
                        if ex.stream_copies && apart {
                            braid_core::copy::copy_streaming(d, s, n);
                        } else {
                            std::ptr::copy(s, d, n);
                        }
                    }
                    if finalize {
                        finalize_region(prog, d, src.len)?;
                    }
                }
                Op::Send { src, .. } => self.emit(chans, io, region_ptr(ex, src)?)?,
                Op::Recv { dst, .. } => io.fetch_into(region_ptr(ex, dst)?)?,
                Op::RecvReduceSend { src, .. } => {
                    let (dt, rop) = dtype_op(prog)?;
                    let i = io.fetch_ptr()?;
                    let Some((to, Output::Slot(slot))) = io.output else {
                        return Err(CoreError::InvalidArgument(
                            "reduce-send without a slot".into(),
                        ));
                    };
                    let a = region_ptr(ex, src)?;
                    let n = len / dt.size();
                    // Streaming means reducing into a scratch buffer (in our
                    // cache) and streaming that into the slot; operations
                    // larger than the cache reduce straight into the slot
                    // (through scratch measured no faster there).
                    slot_write(ex, to, len, false, |stream| match ex.slot_stores {
                        Some(s) if stream => {
                            let tmp = s.scratch(len);
                            reduce::reduce_raw(tmp, i, a, n, dt, rop);
                            braid_core::copy::copy_streaming(slot.ptr, tmp, len);
                        }
                        _ => reduce::reduce_raw(slot.ptr, i, a, n, dt, rop),
                    });
                    chans.sender(to)?.commit(len + io.extra)?;
                }
                Op::RecvReduceCopy {
                    src, dst, finalize, ..
                } => {
                    let (dt, rop) = dtype_op(prog)?;
                    let i = io.fetch_ptr()?;
                    let d = region_ptr(ex, dst)?;
                    reduce::reduce_raw(d, i, region_ptr(ex, src)?, len / dt.size(), dt, rop);
                    if finalize {
                        finalize_region(prog, d, len)?;
                    }
                }
                Op::RecvCopySend { dst, .. } => {
                    let d = region_ptr(ex, dst)?;
                    io.fetch_into(d)?;
                    self.emit(chans, io, d)?;
                }
                Op::RecvReduceCopySend {
                    src, dst, finalize, ..
                } => {
                    let (dt, rop) = dtype_op(prog)?;
                    let i = io.fetch_ptr()?;
                    let d = region_ptr(ex, dst)?;
                    reduce::reduce_raw(d, i, region_ptr(ex, src)?, len / dt.size(), dt, rop);
                    if finalize {
                        finalize_region(prog, d, len)?;
                    }
                    self.emit(chans, io, d)?;
                }
            }
        }
        Ok(())
    }

    /// Send the `len` bytes at `p` (user memory that stays unchanged until
    /// the operation ends) to the op's output.
    ///
    /// # Safety
    ///
    /// `p` is valid for reads of `io.len` bytes until the operation ends.
    #[inline(always)]
    unsafe fn emit(
        &mut self,
        chans: &mut Channels,
        io: &OpIo,
        p: *const u8,
    ) -> Result<(), CoreError> {
        let (ex, len) = (self.ex, io.len);
        match io.output {
            Some((to, Output::Direct)) => {
                let tx = chans.sender(to)?;
                let transport = tx.transport();
                let tx = tx.direct().ok_or_else(|| CoreError::Unavailable {
                    transport,
                    reason: format!("the link to rank {to} lost its single-copy capability"),
                })?;
                // SAFETY: `p` points into the caller's buffers, which stay
                // valid and unmodified (plans never rewrite a region they
                // sent) until `execute` has waited for the peer to drain.
                unsafe { tx.commit_direct(p, len)? };
                if !self.direct.contains(&to) {
                    self.direct.push(to);
                }
                Ok(())
            }
            Some((to, Output::Slot(slot))) => {
                // An operation larger than the cache streams into the slots:
                // the receiver reads them from memory either way, and
                // ordinary stores would first fetch every line back from the
                // receiver's cache, where its last read left it. Side by
                // side, 2 ranks, 64 MiB: AllReduce 13.6-16.1 ms against
                // 13.8-26.3, Reduce 9.5-11.0 against 8.4-29.5. Smaller
                // operations stream where ordinary stores have been much
                // slower on this link (`slot_stores`: the receiver's cache
                // is on another die).
                slot_write(ex, to, len, ex.stream_copies, |stream| {
                    if stream {
                        // SAFETY: the slot holds at least `len` bytes
                        // (checked) and never overlaps user memory; the copy
                        // ends with a store fence, so the commit's Release
                        // store follows the streaming stores.
                        unsafe { braid_core::copy::copy_streaming(slot.ptr, p, len) };
                    } else {
                        // SAFETY: the slot holds at least `len` bytes
                        // (checked).
                        unsafe { std::ptr::copy_nonoverlapping(p, slot.ptr, len) };
                    }
                });
                chans.sender(to)?.commit(len + io.extra)
            }
            None => Err(CoreError::InvalidArgument("op without output".into())),
        }
    }
}

/// An op's input and output once both are in hand.
struct OpIo {
    len: usize,
    /// The incoming piece, if the op receives.
    input: Option<Incoming>,
    /// Where a direct input was read to.
    remote_at: Option<*mut u8>,
    /// The peer sent to and where the bytes go.
    output: Option<(u32, Output)>,
    /// Header bytes in front of the data in the output slot.
    extra: usize,
}

impl OpIo {
    /// Where the incoming bytes are readable: the slot itself, or where the
    /// direct read put them.
    fn fetch_ptr(&self) -> Result<*const u8, CoreError> {
        match (self.input, self.remote_at) {
            (Some(Incoming::Inline(slot, _)), _) => Ok(slot.ptr as *const u8),
            (Some(Incoming::Remote(_)), Some(p)) => Ok(p as *const u8),
            _ => Err(CoreError::InvalidArgument("op without input".into())),
        }
    }

    /// Copy the incoming bytes to `d`.
    ///
    /// # Safety
    ///
    /// `d` is valid for writes of `self.len` bytes and overlaps no slot.
    unsafe fn fetch_into(&self, d: *mut u8) -> Result<(), CoreError> {
        match (self.input, self.remote_at) {
            // SAFETY: the slot holds `len` bytes; `d` is valid for `len`
            // bytes (this function's contract); they never overlap.
            (Some(Incoming::Inline(slot, _)), _) => unsafe {
                std::ptr::copy_nonoverlapping(slot.ptr as *const u8, d, self.len);
                Ok(())
            },
            // Already read into `d`.
            (Some(Incoming::Remote(_)), Some(p)) if p == d => Ok(()),
            _ => Err(CoreError::InvalidArgument(
                "direct input read to the wrong place".into(),
            )),
        }
    }
}

/// Check the message `inc` from `from`, which must start with its operation
/// header (pending in `hdr`); whether data follows the header in the same
/// slot (else the caller releases the header's slot).
fn accept_header(
    ex: &Exec<'_>,
    hdr: &mut HeaderCheck<'_>,
    from: u32,
    inc: Incoming,
    kind: MemKind,
) -> Result<bool, CoreError> {
    let Some((want, want_bytes)) = hdr.headers.and_then(|h| h.expected_from(from)) else {
        return Ok(true);
    };
    let mut b = [0u8; HEADER_BYTES];
    let with_data = match inc {
        Incoming::Inline(slot, len) if len >= HEADER_BYTES && kind == MemKind::Host => {
            // SAFETY: the host slot holds at least HEADER_BYTES bytes (copied
            // out: the peer's memory is not ours to reference).
            unsafe {
                std::ptr::copy_nonoverlapping(slot.ptr as *const u8, b.as_mut_ptr(), HEADER_BYTES)
            };
            len > HEADER_BYTES
        }
        Incoming::Inline(_, len) | Incoming::Remote(len) => {
            return Err(CoreError::Protocol {
                peer: from,
                detail: fingerprint::not_a_header(from, len),
            });
        }
    };
    // The common case, a match, by comparing bytes; decoding (for the error
    // message) only when they differ.
    if b != *want_bytes {
        fingerprint::check(from, ex.rank, &b, want)
            .map_err(|detail| CoreError::Protocol { peer: from, detail })?;
    }
    hdr.set(from, GOT, true);
    if with_data {
        // The first piece follows the header in this slot.
        hdr.set(from, PREFIX, true);
    }
    Ok(with_data)
}

/// Apply the Avg division to `len` bytes at `d`.
///
/// # Safety
///
/// `d` valid for reads and writes of `len` bytes, aligned for the datatype.
unsafe fn finalize_region(prog: &Program, d: *mut u8, len: usize) -> Result<(), CoreError> {
    if prog.divisor > 1 {
        if let Some(dt) = prog.dtype {
            // SAFETY: forwarded from this function's contract.
            unsafe { reduce::divide_raw(d, len / dt.size(), dt, prog.divisor) };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<'a>(flags: &'a mut HeaderFlags) -> HeaderCheck<'a> {
        HeaderCheck {
            headers: None,
            flags,
        }
    }

    #[test]
    fn header_flags_start_clear_for_every_operation() {
        let mut f = HeaderFlags::default();
        f.start(4);
        let mut c = check(&mut f);
        c.set(1, SENT, true);
        c.set(3, GOT, true);
        c.set(3, PREFIX, true);
        c.set(3, PREFIX, false);
        assert!(c.flag(1, SENT) && !c.flag(1, GOT));
        assert!(c.flag(3, GOT) && !c.flag(3, PREFIX));
        // A peer out of range has no bits and takes none.
        c.set(9, SENT, true);
        assert!(!c.flag(9, SENT));
        f.start(4);
        let c = check(&mut f);
        for peer in 0..4 {
            for bit in [GOT, SENT, PREFIX] {
                assert!(!c.flag(peer, bit), "peer {peer} bit {bit} survived");
            }
        }
        // Another size: every peer starts clear.
        f.start(6);
        assert_eq!(f.len(), 6);
        assert!((0..6).all(|p| f.bits(p) == Some(0)));
    }

    #[test]
    fn header_flags_stamps_from_before_a_wrap_read_clear() {
        let mut f = HeaderFlags::default();
        f.start(2);
        assert_eq!(f.epoch, 1);
        check(&mut f).set(0, SENT, true);
        // 2^24 - 1 operations later the stamp wraps back to 1: the entry
        // written by operation 1 must not read as the new operation's.
        f.epoch = 0x00ff_ffff;
        f.start(2);
        assert_eq!(f.epoch, 1);
        assert_eq!(f.bits(0), Some(0));
    }
}

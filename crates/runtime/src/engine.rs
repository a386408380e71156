//! The host engine: runs a [`Program`] on host memory over connected
//! transport channels, on the caller's thread.
//!
//! The engine is the only layer that touches memory: user buffers and slot
//! memory (which must be host memory here; a device engine will handle
//! [`MemKind::Device`] slots). It owns the waiting policy for every transport:
//! spin first (a spinning shared-memory flag costs ~0.1 µs, waking a sleeping
//! thread 25–30 µs), then yield the CPU (ranks may outnumber cores), then
//! sleep briefly; it checks the abort flag and the peers' liveness now and
//! then, and gives up with [`CoreError::Timeout`] after `timeout` without
//! progress.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use braid_core::plan::{Op, Program, Region};
use braid_core::reduce;
use braid_core::transport::{Incoming, RecvChannel, SendChannel, SlotBuf};
use braid_core::types::MemKind;
use braid_core::{CoreError, DataType, RedOp};

use crate::fingerprint::{self, Headers, HEADER_BYTES};
use crate::progress::{Progress, Waiting};
use crate::slot_stores::SlotStores;

/// A caller buffer as the engine sees it.
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    /// Start of the buffer.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

/// The channels of one communicator, indexed by peer rank.
#[derive(Default)]
pub struct Channels {
    /// Sending ends, `send[peer]`.
    pub send: Vec<Option<Box<dyn SendChannel>>>,
    /// Receiving ends, `recv[peer]`.
    pub recv: Vec<Option<Box<dyn RecvChannel>>>,
    /// Where direct (single-copy) input is copied before it is reduced.
    pub scratch: Vec<u64>,
}

impl std::fmt::Debug for Channels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = |v: Vec<Option<&'static str>>| {
            v.into_iter()
                .enumerate()
                .filter_map(|(r, t)| t.map(|t| format!("{r}:{t}")))
                .collect::<Vec<_>>()
                .join(" ")
        };
        f.debug_struct("Channels")
            .field(
                "send",
                &names(
                    self.send
                        .iter()
                        .map(|c| c.as_ref().map(|c| c.transport()))
                        .collect(),
                ),
            )
            .field(
                "recv",
                &names(
                    self.recv
                        .iter()
                        .map(|c| c.as_ref().map(|c| c.transport()))
                        .collect(),
                ),
            )
            .finish()
    }
}

impl Channels {
    /// Tell every peer that this side gave up.
    pub fn abort_all(&mut self, reason: &str) {
        for c in self.send.iter_mut().flatten() {
            c.abort(reason);
        }
        for c in self.recv.iter_mut().flatten() {
            c.abort(reason);
        }
    }

    fn sender(&mut self, peer: u32) -> Result<&mut Box<dyn SendChannel>, CoreError> {
        self.send
            .get_mut(peer as usize)
            .and_then(|c| c.as_mut())
            .ok_or_else(|| CoreError::InvalidArgument(format!("no connection to rank {peer}")))
    }

    fn receiver(&mut self, peer: u32) -> Result<&mut Box<dyn RecvChannel>, CoreError> {
        self.recv
            .get_mut(peer as usize)
            .and_then(|c| c.as_mut())
            .ok_or_else(|| CoreError::InvalidArgument(format!("no connection from rank {peer}")))
    }

    /// The smallest slot size over all connected channels (the plans' piece).
    pub fn min_slot_bytes(&self) -> Option<usize> {
        let s = self.send.iter().flatten().map(|c| c.slot_bytes());
        let r = self.recv.iter().flatten().map(|c| c.slot_bytes());
        s.chain(r).min()
    }
}

/// How long and how hard to wait.
#[derive(Clone, Copy, Debug)]
pub struct WaitPolicy {
    /// Give up after this long without progress.
    pub timeout: Duration,
    /// Busy-poll iterations before yielding.
    pub spin: u32,
    /// Log a wait at WARN once it lasts this long.
    pub stall_warn: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy {
            timeout: Duration::from_secs(120),
            spin: 2000,
            stall_warn: Duration::from_secs(10),
        }
    }
}

/// Tracks one wait with no progress.
struct Waiter<'a> {
    policy: &'a WaitPolicy,
    abort: &'a AtomicBool,
    progress: Option<&'a Progress>,
    iters: u32,
    since: Option<Instant>,
    last_check: Option<Instant>,
    /// The stage being run (for the progress record).
    stage: usize,
    /// The current wait was published / logged as a stall.
    published: bool,
    warned: bool,
}

impl<'a> Waiter<'a> {
    fn new(policy: &'a WaitPolicy, abort: &'a AtomicBool, progress: Option<&'a Progress>) -> Self {
        Waiter {
            policy,
            abort,
            progress,
            iters: 0,
            since: None,
            last_check: None,
            stage: 0,
            published: false,
            warned: false,
        }
    }

    fn progressed(&mut self) {
        self.iters = 0;
        self.since = None;
        if self.published {
            self.published = false;
            self.warned = false;
            if let Some(p) = self.progress {
                p.wait_ends();
            }
        }
    }

    /// Called when nothing could move. `blocked` names what we wait for;
    /// `helping` are the peers this operation sent direct slots to, whose
    /// copies we take a share of meanwhile ([`SendChannel::poll_help`]) —
    /// unless we wait for data: then we have work of our own coming, and
    /// side by side (AllGather on 2 ranks, 16 MiB) helping there made the
    /// operation 12% slower, while helping from slot and drain waits made
    /// Broadcast on 2 ranks 1.6x faster.
    fn idle(
        &mut self,
        chans: &mut Channels,
        blocked: (u32, &'static str),
        helping: &[u32],
    ) -> Result<(), CoreError> {
        if !helping.is_empty() && blocked.1 != WAIT_DATA {
            for &peer in helping {
                if chans.sender(peer)?.poll_help()? {
                    return Ok(());
                }
            }
        }
        self.iters = self.iters.saturating_add(1);
        if self.iters < self.policy.spin {
            // A PAUSE costs ~40 ns on recent x86 cores, as much as seeing a
            // peer's flag: polling without one took an 8-byte AllReduce on
            // 2 ranks from 0.20 to 0.18 µs (median of 20 runs side by
            // side). One in 16 keeps a hyperthread sibling breathing.
            if self.iters.is_multiple_of(16) {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        if !self.iters.is_multiple_of(64) {
            std::thread::yield_now();
            return Ok(());
        }
        let now = Instant::now();
        let since = match self.since {
            Some(t) => t,
            None => {
                if let Some(p) = self.progress {
                    p.stamp();
                }
                *self.since.insert(now)
            }
        };
        if self.abort.load(Ordering::Relaxed) {
            return Err(CoreError::Aborted("the communicator was aborted".into()));
        }
        let (peer, what) = blocked;
        if self
            .last_check
            .is_none_or(|t| now.duration_since(t) >= Duration::from_millis(2))
        {
            self.last_check = Some(now);
            if what != WAIT_DATA {
                chans.sender(peer)?.check_peer()?;
            } else {
                chans.receiver(peer)?.check_peer()?;
            }
        }
        let waited = now.duration_since(since);
        let mut transport = || -> Result<&'static str, CoreError> {
            Ok(if what != WAIT_DATA {
                chans.sender(peer)?.transport()
            } else {
                chans.receiver(peer)?.transport()
            })
        };
        if !self.published && waited >= Duration::from_millis(1) {
            self.published = true;
            if let Some(p) = self.progress {
                p.wait_begins(
                    self.stage,
                    Waiting {
                        peer,
                        transport: transport()?,
                        what,
                        since,
                    },
                );
            }
        }
        if !self.warned && waited >= self.policy.stall_warn {
            self.warned = true;
            tracing::warn!(
                peer,
                transport = transport()?,
                waiting_for = what,
                waited_s = waited.as_secs_f64(),
                "braid: stalled: {}",
                self.progress.map(|p| p.describe()).unwrap_or_default()
            );
        }
        if waited >= self.policy.timeout {
            let transport = transport()?;
            return Err(CoreError::Timeout {
                transport,
                peer,
                waiting_for: what,
                after: waited,
            });
        }
        if waited > Duration::from_millis(20) {
            // Long waits (a slow peer, oversubscription): stop burning a core.
            std::thread::sleep(Duration::from_micros(50));
        } else {
            std::thread::yield_now();
        }
        Ok(())
    }
}

/// Everything `execute` needs besides the program.
#[derive(Debug)]
pub struct Exec<'a> {
    /// The operation's buffers, by buffer index.
    pub bufs: &'a [RawBuf],
    /// Waiting policy.
    pub policy: &'a WaitPolicy,
    /// Set from any thread to make waits fail promptly.
    pub abort: &'a AtomicBool,
    /// Pieces of at least this many bytes of pure data movement go by
    /// reference where the link allows it (single copy); `usize::MAX` never.
    pub direct_min: usize,
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
}

/// Operation headers in flight: which peers' headers were checked and sent
/// so far in this operation. A header travels in front of the first piece to
/// a peer when both fit one slot, else as a message of its own.
struct HeaderCheck<'a> {
    headers: Option<&'a Headers>,
    /// Per peer: [`GOT`], [`SENT`], [`PREFIX`] bits (reused memory).
    flags: &'a mut Vec<u8>,
}

/// The peer's header was checked.
const GOT: u8 = 1;
/// Our header to the peer was sent.
const SENT: u8 = 2;
/// The slot peeked from this peer starts with its (checked) header.
const PREFIX: u8 = 4;

impl HeaderCheck<'_> {
    fn flag(&self, peer: u32, bit: u8) -> bool {
        self.flags.get(peer as usize).is_some_and(|f| f & bit != 0)
    }

    fn set(&mut self, peer: u32, bit: u8, on: bool) {
        if let Some(f) = self.flags.get_mut(peer as usize) {
            if on {
                *f |= bit;
            } else {
                *f &= !bit;
            }
        }
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
            && self.headers.is_some_and(|h| h.from_peer(from).is_some())
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
pub unsafe fn execute(
    prog: &Program,
    chans: &mut Channels,
    ex: &Exec<'_>,
    flags: &mut Vec<u8>,
) -> Result<(), CoreError> {
    if small_program(prog, ex.direct_min) {
        // SAFETY: forwarded from this function's contract.
        return unsafe { execute_small(prog, chans, ex, flags) };
    }
    let mut waiter = Waiter::new(ex.policy, ex.abort, ex.progress);
    let n = ex.headers.map(|h| h.nranks()).unwrap_or(0);
    flags.clear();
    flags.resize(n, 0);
    let mut hdr = HeaderCheck {
        headers: ex.headers,
        flags,
    };
    let mut direct: Vec<u32> = Vec::new();
    let mut scratch_owner: Option<u32> = None;
    let mut pending: Vec<bool> = Vec::new();
    let mut claimed: Vec<(Option<u32>, Option<u32>)> = Vec::new();
    for (si, stage) in prog.stages().enumerate() {
        waiter.stage = si;
        if let [op] = stage {
            // The common case: one op, retried until it runs.
            // SAFETY: forwarded from this function's contract.
            while let Some(blocked) = unsafe {
                try_op(
                    prog,
                    op,
                    chans,
                    ex,
                    &mut direct,
                    &mut scratch_owner,
                    &mut hdr,
                )?
            } {
                waiter.idle(chans, blocked, &direct)?;
            }
            waiter.progressed();
            continue;
        }
        pending.clear();
        pending.resize(stage.len(), true);
        let mut left = stage.len();
        while left > 0 {
            let mut blocked = None;
            let mut moved = false;
            // Pieces to or from one peer must keep their order: once an op is
            // blocked, later ops of the stage that use its peers wait too.
            claimed.clear();
            for (i, op) in stage.iter().enumerate() {
                if !pending[i] || claims_overlap(&claimed, op) {
                    continue;
                }
                // SAFETY: forwarded from this function's contract.
                match unsafe {
                    try_op(
                        prog,
                        op,
                        chans,
                        ex,
                        &mut direct,
                        &mut scratch_owner,
                        &mut hdr,
                    )?
                } {
                    None => {
                        pending[i] = false;
                        left -= 1;
                        moved = true;
                    }
                    Some(b) => {
                        blocked = Some(b);
                        claimed.push((op.recv_peer(), op.send_peer()));
                    }
                }
            }
            match (moved, blocked) {
                (true, _) | (_, None) => waiter.progressed(),
                (false, Some(b)) => waiter.idle(chans, b, &direct)?,
            }
        }
    }
    // Peers sent references into the caller's buffers must finish reading
    // them before the caller gets its buffers back.
    for &peer in &direct {
        while !chans.sender(peer)?.poll_drained()? {
            waiter.idle(chans, (peer, WAIT_DRAIN), &direct)?;
        }
        waiter.progressed();
    }
    Ok(())
}

/// Largest piece (and local copy) of a program that [`execute_small`] runs.
const SMALL_PIECE_BYTES: usize = 1024;

/// Writes one piece of `len` bytes into `to`'s slot with `write(stream)`.
/// Operations larger than the cache (`ex.stream_copies`) take `big` and are
/// not timed; the others take what the link's [`SlotStores`] chooses, and
/// pieces it times are timed here.
fn slot_write(ex: &Exec, to: u32, len: usize, big: bool, write: impl FnOnce(bool)) {
    match ex.slot_stores {
        Some(s) if !ex.stream_copies && len >= crate::slot_stores::TIMED_MIN_BYTES => {
            let stream = s.choose(to, len);
            let t0 = Instant::now();
            write(stream);
            s.record(to, stream, len, t0.elapsed().as_nanos() as u64);
        }
        _ => write(ex.stream_copies && big),
    }
}

/// Whether [`execute_small`] can run `prog`: one op per stage, every piece
/// and copy at most [`SMALL_PIECE_BYTES`] and below the single-copy
/// threshold. O(1) for large programs (their first op is large).
fn small_program(prog: &Program, direct_min: usize) -> bool {
    prog.stage_ends.len() == prog.ops.len()
        && prog.ops.iter().all(|op| {
            let len = match *op {
                Op::Copy { src, .. } => src.len,
                _ => op.wire_len(),
            };
            len <= SMALL_PIECE_BYTES && len < direct_min
        })
}

/// The executor of small programs (small AllReduce, Broadcast, Reduce: the
/// latency-bound ones): the semantics of [`execute`] for programs of one op
/// per stage whose pieces travel in slots, without the generic path's
/// single-copy reads, retries of whole ops and stage bookkeeping. Each op
/// waits for its input, then for its output slot (holding the input, as
/// the generic path does), then runs.
///
/// # Safety
///
/// As for [`execute`].
unsafe fn execute_small(
    prog: &Program,
    chans: &mut Channels,
    ex: &Exec<'_>,
    flags: &mut Vec<u8>,
) -> Result<(), CoreError> {
    let mut waiter = Waiter::new(ex.policy, ex.abort, ex.progress);
    let n = ex.headers.map(|h| h.nranks()).unwrap_or(0);
    flags.clear();
    flags.resize(n, 0);
    let mut hdr = HeaderCheck {
        headers: ex.headers,
        flags,
    };
    for (si, op) in prog.ops.iter().enumerate() {
        waiter.stage = si;
        if let &Op::Copy { src, dst, finalize } = op {
            let (s, d) = (region_ptr(ex, src)?, region_ptr(ex, dst)?);
            // SAFETY: both regions lie in the caller's buffers (checked);
            // `copy` allows the in-place overlap plans may produce.
            unsafe { std::ptr::copy(s, d, src.len) };
            if finalize {
                // SAFETY: `d` holds `src.len` bytes of the datatype.
                unsafe { finalize_region(prog, d, src.len)? };
            }
            continue;
        }
        let len = op.wire_len();
        let input = match op.recv_peer() {
            Some(from) => Some(small_input(chans, ex, &mut hdr, &mut waiter, from, len)?),
            None => None,
        };
        let output = match op.send_peer() {
            Some(to) => Some(small_output(chans, &mut hdr, &mut waiter, to, len)?),
            None => None,
        };
        let i = || input.ok_or_else(|| CoreError::InvalidArgument("op without input".into()));
        let o = || output.ok_or_else(|| CoreError::InvalidArgument("op without output".into()));
        // SAFETY: region pointers lie in the caller's buffers (checked) and
        // hold `len` bytes; the input (a peeked slot or `remote`) and the
        // output slot hold at least `len` bytes and overlap neither.
        unsafe {
            match op {
                Op::Copy { .. } => {}
                &Op::Send { src, .. } => {
                    std::ptr::copy_nonoverlapping(region_ptr(ex, src)?, o()?.1, len)
                }
                &Op::Recv { dst, .. } => {
                    std::ptr::copy_nonoverlapping(i()?, region_ptr(ex, dst)?, len)
                }
                &Op::RecvCopySend { dst, .. } => {
                    let d = region_ptr(ex, dst)?;
                    std::ptr::copy_nonoverlapping(i()?, d, len);
                    std::ptr::copy_nonoverlapping(d, o()?.1, len);
                }
                &Op::RecvReduceSend { src, .. } => {
                    let (dt, rop) = dtype_op(prog)?;
                    reduce::reduce_raw(
                        o()?.1,
                        i()?,
                        region_ptr(ex, src)?,
                        len / dt.size(),
                        dt,
                        rop,
                    );
                }
                &Op::RecvReduceCopy {
                    src, dst, finalize, ..
                }
                | &Op::RecvReduceCopySend {
                    src, dst, finalize, ..
                } => {
                    let (dt, rop) = dtype_op(prog)?;
                    let d = region_ptr(ex, dst)?;
                    reduce::reduce_raw(d, i()?, region_ptr(ex, src)?, len / dt.size(), dt, rop);
                    if finalize {
                        finalize_region(prog, d, len)?;
                    }
                    if output.is_some() {
                        std::ptr::copy_nonoverlapping(d, o()?.1, len);
                    }
                }
            }
        }
        if let Some(from) = op.recv_peer() {
            chans.receiver(from)?.release()?;
            hdr.set(from, PREFIX, false);
        }
        if let Some((to, _, extra)) = output {
            chans.sender(to)?.commit(len + extra)?;
            if extra > 0 {
                hdr.set(to, SENT, true);
            }
        }
    }
    Ok(())
}

/// Wait for the small piece of `len` bytes from `from` (checking the
/// operation header in front of it first); where it can be read until the
/// channel's `release`.
fn small_input(
    chans: &mut Channels,
    ex: &Exec<'_>,
    hdr: &mut HeaderCheck<'_>,
    waiter: &mut Waiter<'_>,
    from: u32,
    len: usize,
) -> Result<*const u8, CoreError> {
    loop {
        let pending = hdr.pending(from);
        let ch = chans.receiver(from)?;
        if let Some(inc) = ch.poll_peek_any()? {
            let kind = ch.mem_kind();
            host_slot(kind, from)?;
            // The header in front of the first piece: checked on the same
            // peek; a header that came alone frees its slot and we look for
            // the piece.
            let prefixed = if pending {
                if !accept_header(ex, hdr, from, inc, kind)? {
                    chans.receiver(from)?.release()?;
                    continue;
                }
                true
            } else {
                hdr.flag(from, PREFIX)
            };
            let (p, got) = match inc {
                Incoming::Inline(slot, l) if prefixed => {
                    // SAFETY: the slot held a header and more.
                    (
                        unsafe { slot.ptr.add(HEADER_BYTES) } as *const u8,
                        l - HEADER_BYTES,
                    )
                }
                Incoming::Inline(slot, l) => (slot.ptr as *const u8, l),
                Incoming::Remote(l) => {
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
            };
            if got != len {
                return Err(wrong_piece(from, got, len));
            }
            waiter.progressed();
            return Ok(p);
        }
        waiter.idle(chans, (from, WAIT_DATA), &[])?;
    }
}

/// Wait for a slot to `to`; returns where the piece goes and how many bytes
/// of operation header lie in front of it.
fn small_output(
    chans: &mut Channels,
    hdr: &mut HeaderCheck<'_>,
    waiter: &mut Waiter<'_>,
    to: u32,
    len: usize,
) -> Result<(u32, *mut u8, usize), CoreError> {
    loop {
        // The operation header goes in front of the piece if not sent yet.
        let header = hdr.unsent(to);
        let need = len + header.map_or(0, |_| HEADER_BYTES);
        let ch = chans.sender(to)?;
        if let Some(slot) = ch.poll_acquire_small(need)? {
            host_slot(ch.mem_kind(), to)?;
            if slot.cap < need {
                return Err(CoreError::InvalidArgument(format!(
                    "piece of {len} bytes does not fit the {}-byte slots of the link to rank {to}",
                    slot.cap
                )));
            }
            let extra = need - len;
            if let Some(hb) = header {
                // SAFETY: the slot holds `need` = len + HEADER_BYTES bytes.
                unsafe { std::ptr::copy_nonoverlapping(hb.as_ptr(), slot.ptr, HEADER_BYTES) };
            }
            waiter.progressed();
            // SAFETY: cap ≥ extra + len.
            return Ok((to, unsafe { slot.ptr.add(extra) }, extra));
        }
        waiter.idle(chans, (to, WAIT_SLOT), &[])?;
    }
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

/// Whether `op` uses a link that an earlier, blocked op of its stage uses.
fn claims_overlap(claimed: &[(Option<u32>, Option<u32>)], op: &Op) -> bool {
    let (r, s) = (op.recv_peer(), op.send_peer());
    claimed
        .iter()
        .any(|&(cr, cs)| (r.is_some() && r == cr) || (s.is_some() && s == cs))
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

/// What a blocked op waits for (the waiter checks the matching channel).
const WAIT_DATA: &str = "data";
const WAIT_SLOT: &str = "a free slot";
const WAIT_DRAIN: &str = "its single-copy read of our buffer";

/// Try to run one op. `Ok(None)` when done, `Ok(Some((peer, what)))` when it
/// must wait for `peer`. Peers that were sent a direct (single-copy)
/// reference are added to `direct`; the caller waits for them to finish
/// reading before the operation returns. `scratch_owner` is the peer whose
/// direct input is being read into the scratch buffer (a read may take
/// several calls).
///
/// An op that has to wait does so before it changes anything visible: its
/// input stays unreleased and its output slot uncommitted (a direct input
/// read into its destination is read again into the same place), so the
/// retry starts over.
///
/// # Safety
///
/// As for [`execute`].
unsafe fn try_op(
    prog: &Program,
    op: &Op,
    chans: &mut Channels,
    ex: &Exec<'_>,
    direct: &mut Vec<u32>,
    scratch_owner: &mut Option<u32>,
    hdr: &mut HeaderCheck<'_>,
) -> Result<Option<(u32, &'static str)>, CoreError> {
    let len = op.wire_len();
    let input: Option<(u32, Incoming)> = match op.recv_peer() {
        Some(from) => {
            if hdr.pending(from) && !check_header(chans, ex, hdr, from)? {
                return Ok(Some((from, WAIT_DATA)));
            }
            let prefixed = hdr.flag(from, PREFIX);
            let ch = chans.receiver(from)?;
            match ch.poll_peek_any()? {
                None => return Ok(Some((from, WAIT_DATA))),
                Some(inc) => {
                    // Skip the header in front of the first piece.
                    let inc = match inc {
                        Incoming::Inline(slot, l) if prefixed => Incoming::Inline(
                            SlotBuf {
                                // SAFETY: the slot held a header and more.
                                ptr: unsafe { slot.ptr.add(HEADER_BYTES) },
                                cap: slot.cap - HEADER_BYTES,
                            },
                            l - HEADER_BYTES,
                        ),
                        other => other,
                    };
                    let got = match inc {
                        Incoming::Inline(_, l) | Incoming::Remote(l) => l,
                    };
                    if got != len {
                        return Err(wrong_piece(from, got, len));
                    }
                    host_slot(ch.mem_kind(), from)?;
                    Some((from, inc))
                }
            }
        }
        None => None,
    };
    // The output: a slot to fill, or a direct reference to user memory.
    // `extra`: header bytes in front of the data in the output slot.
    let mut extra = 0usize;
    let output: Option<(u32, Option<SlotBuf>)> = match op.send_peer() {
        Some(to) => {
            let ch = chans.sender(to)?;
            match ch.poll_acquire()? {
                None => return Ok(Some((to, WAIT_SLOT))),
                Some(mut slot) => {
                    host_slot(ch.mem_kind(), to)?;
                    // Not for RecvReduceSend: its output exists only in the
                    // slot it reduces into. Not for data a receiver reduces
                    // (Send in a reducing collective) where the receiver
                    // pays for the reference (it would only move the copy
                    // from us to it).
                    // Nor for data this op has just written (a relay, a
                    // reduced piece) where the link streams into slots and
                    // the piece fits one (single-copy plans may cut larger
                    // ones): the receiver's read would fetch every line
                    // from our cache across dies (2 ranks, 1 MiB AllReduce
                    // across dies: 68-130 µs through slots against
                    // 330-400 µs by reference).
                    let fresh = len <= slot.cap
                        && matches!(op, Op::RecvCopySend { .. } | Op::RecvReduceCopySend { .. });
                    let direct_ok = len >= ex.direct_min
                        && !matches!(op, Op::RecvReduceSend { .. })
                        && ch.can_send_direct()
                        && (prog.red_op.is_none()
                            || !matches!(op, Op::Send { .. })
                            || !ch.direct_costs_receiver())
                        && !(fresh && ex.slot_stores.is_some_and(|s| s.streaming(to)));
                    if let Some(hb) = hdr.unsent(to) {
                        // SAFETY: a host slot holds at least 4096 bytes.
                        unsafe {
                            std::ptr::copy_nonoverlapping(hb.as_ptr(), slot.ptr, HEADER_BYTES)
                        };
                        if !direct_ok && slot.cap >= len + HEADER_BYTES {
                            // In front of the data, in the same slot (marked
                            // sent once the slot is committed: a retry
                            // writes it again).
                            extra = HEADER_BYTES;
                            slot = SlotBuf {
                                // SAFETY: cap ≥ len + HEADER_BYTES.
                                ptr: unsafe { slot.ptr.add(HEADER_BYTES) },
                                cap: slot.cap - HEADER_BYTES,
                            };
                        } else {
                            // A message of its own; the data needs the next slot.
                            ch.commit(HEADER_BYTES)?;
                            hdr.set(to, SENT, true);
                            match ch.poll_acquire()? {
                                None => return Ok(Some((to, WAIT_SLOT))),
                                Some(next) => slot = next,
                            }
                        }
                    }
                    // Single copy: the transport takes the bytes straight
                    // from our buffer.
                    let by_reference = direct_ok && extra == 0;
                    if by_reference {
                        Some((to, None))
                    } else if slot.cap < len {
                        return Err(CoreError::InvalidArgument(format!(
                            "piece of {len} bytes does not fit the {}-byte slots of the link to rank {to}",
                            slot.cap
                        )));
                    } else {
                        Some((to, Some(slot)))
                    }
                }
            }
        }
        None => None,
    };

    // A direct input is read (without blocking; it may take several tries)
    // into where the op wants it: the destination region of a plain
    // receive, else the scratch buffer (which one peer's read holds at a
    // time). Only then does the op run, so a wait leaves nothing half done.
    let mut remote_at: Option<*mut u8> = None;
    if let Some((from, Incoming::Remote(_))) = input {
        let dest = match *op {
            Op::Recv { dst, .. } | Op::RecvCopySend { dst, .. } => region_ptr(ex, dst)?,
            _ => {
                if scratch_owner.is_some_and(|o| o != from) {
                    return Ok(Some((from, WAIT_DATA)));
                }
                let words = len.div_ceil(8);
                if chans.scratch.len() < words {
                    chans.scratch.resize(words, 0);
                }
                *scratch_owner = Some(from);
                chans.scratch.as_mut_ptr() as *mut u8
            }
        };
        let rx = chans.receiver(from)?;
        rx.stream_hint(ex.stream_copies);
        // SAFETY: `dest` is a region pointer valid for `len` bytes (caller's
        // contract) or the scratch buffer of at least `len` bytes, which
        // nothing else touches until this read completes (`scratch_owner`).
        if !unsafe { rx.poll_read_remote(dest, len)? } {
            return Ok(Some((from, WAIT_DATA)));
        }
        remote_at = Some(dest);
    }
    // Where the incoming bytes are readable: the slot itself, or where the
    // direct read put them.
    let fetch_ptr = |_: &mut Channels| -> Result<*const u8, CoreError> {
        match (input, remote_at) {
            (Some((_, Incoming::Inline(slot, _))), _) => Ok(slot.ptr as *const u8),
            (Some((_, Incoming::Remote(_))), Some(p)) => Ok(p as *const u8),
            _ => Err(CoreError::InvalidArgument("op without input".into())),
        }
    };
    // Copy the incoming bytes to `d`.
    let fetch_into = |_: &mut Channels, d: *mut u8| -> Result<(), CoreError> {
        match (input, remote_at) {
            // SAFETY: the slot holds `len` bytes; `d` is a region pointer
            // valid for `len` bytes (caller's contract); they never overlap.
            (Some((_, Incoming::Inline(slot, _))), _) => unsafe {
                std::ptr::copy_nonoverlapping(slot.ptr as *const u8, d, len);
                Ok(())
            },
            // Already read into `d` above.
            (Some((_, Incoming::Remote(_))), Some(p)) if p == d => Ok(()),
            _ => Err(CoreError::InvalidArgument(
                "direct input read to the wrong place".into(),
            )),
        }
    };
    // Send the `len` bytes at `p` (user memory that stays unchanged until the
    // operation ends).
    let emit =
        |chans: &mut Channels, direct: &mut Vec<u32>, p: *const u8| -> Result<(), CoreError> {
            match output {
                Some((to, None)) => {
                    // SAFETY: `p` points into the caller's buffers, which stay
                    // valid and unmodified (plans never rewrite a region they
                    // sent) until `execute` has waited for the peer to drain.
                    unsafe { chans.sender(to)?.commit_direct(p, len)? };
                    if !direct.contains(&to) {
                        direct.push(to);
                    }
                    Ok(())
                }
                Some((to, Some(slot))) => {
                    // An operation larger than the cache streams into the
                    // slots: the receiver reads them from memory either way,
                    // and ordinary stores would first fetch every line back
                    // from the receiver's cache, where its last read left
                    // it. Side by side, 2 ranks, 64 MiB: AllReduce 13.6-16.1
                    // ms against 13.8-26.3, Reduce 9.5-11.0 against 8.4-29.5.
                    // Smaller operations stream where ordinary stores have
                    // been much slower on this link (`slot_stores`: the
                    // receiver's cache is on another die).
                    slot_write(ex, to, len, ex.stream_copies, |stream| {
                        if stream {
                            // SAFETY: the slot holds at least `len` bytes
                            // (checked) and never overlaps user memory; the
                            // copy ends with a store fence, so the commit's
                            // Release store follows the streaming stores.
                            unsafe { braid_core::copy::copy_streaming(slot.ptr, p, len) };
                        } else {
                            // SAFETY: the slot holds at least `len` bytes
                            // (checked).
                            unsafe { std::ptr::copy_nonoverlapping(p, slot.ptr, len) };
                        }
                    });
                    chans.sender(to)?.commit(len + extra)
                }
                None => Err(CoreError::InvalidArgument("op without output".into())),
            }
        };
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
            Op::Send { src, .. } => emit(chans, direct, region_ptr(ex, src)?)?,
            Op::Recv { dst, .. } => fetch_into(chans, region_ptr(ex, dst)?)?,
            Op::RecvReduceSend { src, .. } => {
                let (dt, rop) = dtype_op(prog)?;
                let i = fetch_ptr(chans)?;
                let Some((to, Some(slot))) = output else {
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
                chans.sender(to)?.commit(len + extra)?;
            }
            Op::RecvReduceCopy {
                src, dst, finalize, ..
            } => {
                let (dt, rop) = dtype_op(prog)?;
                let i = fetch_ptr(chans)?;
                let d = region_ptr(ex, dst)?;
                reduce::reduce_raw(d, i, region_ptr(ex, src)?, len / dt.size(), dt, rop);
                if finalize {
                    finalize_region(prog, d, len)?;
                }
            }
            Op::RecvCopySend { dst, .. } => {
                let d = region_ptr(ex, dst)?;
                fetch_into(chans, d)?;
                emit(chans, direct, d)?;
            }
            Op::RecvReduceCopySend {
                src, dst, finalize, ..
            } => {
                let (dt, rop) = dtype_op(prog)?;
                let i = fetch_ptr(chans)?;
                let d = region_ptr(ex, dst)?;
                reduce::reduce_raw(d, i, region_ptr(ex, src)?, len / dt.size(), dt, rop);
                if finalize {
                    finalize_region(prog, d, len)?;
                }
                emit(chans, direct, d)?;
            }
        }
    }
    if let Some((from, _)) = input {
        chans.receiver(from)?.release()?;
        hdr.set(from, PREFIX, false);
        if *scratch_owner == Some(from) {
            *scratch_owner = None;
        }
    }
    if let Some((to, _)) = output {
        if extra > 0 {
            hdr.set(to, SENT, true);
        }
    }
    Ok(None)
}

/// Read and check the operation header from `from`: `Ok(false)` while it has
/// not arrived, an error naming both sides' operations when it differs.
fn check_header(
    chans: &mut Channels,
    ex: &Exec<'_>,
    hdr: &mut HeaderCheck<'_>,
    from: u32,
) -> Result<bool, CoreError> {
    let ch = chans.receiver(from)?;
    let Some(inc) = ch.poll_peek_any()? else {
        return Ok(false);
    };
    if !accept_header(ex, hdr, from, inc, ch.mem_kind())? {
        ch.release()?;
    }
    Ok(true)
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
    let Some((want, want_bytes)) = hdr.headers.and_then(|h| h.from_peer(from)) else {
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

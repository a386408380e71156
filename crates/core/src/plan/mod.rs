//! Pure collective plans.
//!
//! [`plan`] turns a [`Collective`] and a rank's [`PlanParams`] into that rank's
//! [`Program`]: a list of primitive [`Op`]s in the manner of NCCL's primitives
//! (send, recv, recv-reduce-send, recv-reduce-copy, recv-copy-send,
//! recv-reduce-copy-send, local copy) over byte [`Region`]s of the caller's
//! buffers. No I/O, no threads, no clock: the same program runs in the
//! in-memory simulator ([`crate::sim`]) and in the runtime's engine.
//!
//! Every op that moves data moves at most one transport slot (`piece_bytes`;
//! `move_piece_bytes` for collectives that only move data over links that
//! pass references),
//! and the ring and chain algorithms are ordered so that every op of a rank
//! depends only on ops that come earlier on its neighbours: with FIFOs of two
//! slots they cannot deadlock (a ring step holds its input slot while it fills
//! an output slot, so one slot is not enough), and with deeper FIFOs
//! consecutive pieces overlap (pipelining).
//!
//! Ops are grouped in *stages*. Ops of one stage are independent and may run
//! in any order (the executor polls them all); stages run in sequence. Ring
//! and chain algorithms use one op per stage; pairwise exchange (AllToAll) and
//! point-to-point groups put one piece of every transfer in each stage, and
//! the direct AllGather and Broadcast ([`PlanParams::direct_moves`]) put
//! everything in one stage.
//!
//! Buffers: collectives use buffer 0 (send) and 1 (recv); a point-to-point
//! group names one buffer per operation. In-place forms alias these buffers as
//! NCCL defines them (AllGather: send = recv + rank·count; ReduceScatter: recv
//! = send + rank·recvcount); the plans are written to be correct under that
//! aliasing, and a copy whose source and destination coincide is a no-op.
//!
//! Algorithms: [`plan`] makes braid's default plans (rings and chains,
//! recursive doubling for small AllReduce, the direct AllGather and
//! Broadcast where [`PlanParams::direct_moves`] says so); [`plan_with`]
//! makes the plan of a named [`Algo`] — ring, direct, recursive doubling,
//! Rabenseifner, double binary tree / binomial tree, Bruck, hierarchical —
//! one file each (`ring.rs`, `halving.rs`, `tree.rs`, `bruck.rs`,
//! `hier.rs`; `algo.rs` names them and says which collective each runs).
//! Some algorithms keep partial results in a scratch buffer, buffer
//! [`SCRATCH`], which the executor provides ([`Program::scratch_bytes`]).

mod algo;
mod bruck;
mod halving;
mod hier;
mod ring;
mod tree;

pub use algo::{Algo, Choice, CollKind};

use crate::error::{CoreError, Result};
use crate::types::{DataType, RedOp};

/// Buffer index of the send buffer of a collective.
pub const SEND: u16 = 0;
/// Buffer index of the receive buffer of a collective.
pub const RECV: u16 = 1;
/// Buffer index of the scratch buffer some algorithms keep partial
/// results in (binomial Reduce, Bruck ReduceScatter): memory of the
/// executor's, [`Program::scratch_bytes`] long, that no other rank sees.
pub const SCRATCH: u16 = 2;

/// A byte range of one of the operation's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// Buffer index (see the module docs).
    pub buf: u16,
    /// Offset in bytes.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// One primitive step. `in` is the slot received from `from`, `out` the slot
/// sent to `to`; `(+)` is the operation's pairwise reduction. `finalize`
/// applies the Avg division (by the program's `divisor`) to what is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `dst = src` (skipped when `src` and `dst` are the same memory).
    Copy {
        src: Region,
        dst: Region,
        finalize: bool,
    },
    /// `out = src`.
    Send { to: u32, src: Region },
    /// `dst = in`.
    Recv { from: u32, dst: Region },
    /// `out = in (+) src`.
    RecvReduceSend { from: u32, to: u32, src: Region },
    /// `dst = in (+) src`.
    RecvReduceCopy {
        from: u32,
        src: Region,
        dst: Region,
        finalize: bool,
    },
    /// `dst = in; out = in`.
    RecvCopySend { from: u32, to: u32, dst: Region },
    /// `dst = in (+) src; out = dst`.
    RecvReduceCopySend {
        from: u32,
        to: u32,
        src: Region,
        dst: Region,
        finalize: bool,
    },
}

impl Op {
    /// The peer this op receives from, if any.
    pub fn recv_peer(&self) -> Option<u32> {
        match *self {
            Op::Recv { from, .. }
            | Op::RecvReduceSend { from, .. }
            | Op::RecvReduceCopy { from, .. }
            | Op::RecvCopySend { from, .. }
            | Op::RecvReduceCopySend { from, .. } => Some(from),
            Op::Copy { .. } | Op::Send { .. } => None,
        }
    }

    /// The peer this op sends to, if any.
    pub fn send_peer(&self) -> Option<u32> {
        match *self {
            Op::Send { to, .. }
            | Op::RecvReduceSend { to, .. }
            | Op::RecvCopySend { to, .. }
            | Op::RecvReduceCopySend { to, .. } => Some(to),
            _ => None,
        }
    }

    /// The buffer regions this op reads or writes.
    pub fn regions(&self) -> impl Iterator<Item = Region> {
        let (a, b) = match *self {
            Op::Copy { src, dst, .. }
            | Op::RecvReduceCopy { src, dst, .. }
            | Op::RecvReduceCopySend { src, dst, .. } => (Some(src), Some(dst)),
            Op::Send { src, .. } | Op::RecvReduceSend { src, .. } => (Some(src), None),
            Op::Recv { dst, .. } | Op::RecvCopySend { dst, .. } => (Some(dst), None),
        };
        a.into_iter().chain(b)
    }

    /// Bytes this op moves through a transport (the piece length).
    pub fn wire_len(&self) -> usize {
        match *self {
            Op::Copy { .. } => 0,
            Op::Send { src, .. } | Op::RecvReduceSend { src, .. } => src.len,
            Op::Recv { dst, .. } | Op::RecvCopySend { dst, .. } => dst.len,
            Op::RecvReduceCopy { dst, .. } | Op::RecvReduceCopySend { dst, .. } => dst.len,
        }
    }
}

/// Kind of a point-to-point operation in a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum P2pKind {
    Send,
    Recv,
}

/// One point-to-point operation of a group; it uses buffer number `index`
/// (its position in the group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct P2p {
    pub kind: P2pKind,
    pub peer: u32,
    pub count: usize,
}

/// A collective operation as the caller describes it (counts in elements, as
/// NCCL's API takes them).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    AllReduce {
        count: usize,
        op: RedOp,
    },
    /// Each rank receives `recv_count` elements of the reduced array of
    /// `nranks · recv_count`.
    ReduceScatter {
        recv_count: usize,
        op: RedOp,
    },
    /// Each rank contributes `send_count` elements.
    AllGather {
        send_count: usize,
    },
    Broadcast {
        count: usize,
        root: u32,
    },
    Reduce {
        count: usize,
        op: RedOp,
        root: u32,
    },
    /// `count` elements go to each peer (send and recv hold `nranks · count`).
    AllToAll {
        count: usize,
    },
    /// Point-to-point operations issued together (Send/Recv is a group of one).
    Group(Vec<P2p>),
    /// No rank leaves before every rank entered. Planned as the small
    /// AllReduce (maximum) of a one-element token, so it runs over the data
    /// links like any collective; `Communicator::barrier` supplies the token,
    /// the untyped API takes one element of any datatype as each buffer.
    Barrier,
}

impl Collective {
    /// Short name used in logs, errors and fingerprints.
    #[inline]
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce { .. } => "AllReduce",
            Collective::ReduceScatter { .. } => "ReduceScatter",
            Collective::AllGather { .. } => "AllGather",
            Collective::Broadcast { .. } => "Broadcast",
            Collective::Reduce { .. } => "Reduce",
            Collective::AllToAll { .. } => "AllToAll",
            Collective::Group(ops) if ops.len() == 1 => match ops[0].kind {
                P2pKind::Send => "Send",
                P2pKind::Recv => "Recv",
            },
            Collective::Group(_) => "Group",
            Collective::Barrier => "Barrier",
        }
    }

    /// The reduction operator, if the collective reduces.
    #[inline]
    pub fn red_op(&self) -> Option<RedOp> {
        match self {
            Collective::AllReduce { op, .. }
            | Collective::ReduceScatter { op, .. }
            | Collective::Reduce { op, .. } => Some(*op),
            _ => None,
        }
    }

    /// The root, for rooted collectives.
    #[inline]
    pub fn root(&self) -> Option<u32> {
        match self {
            Collective::Broadcast { root, .. } | Collective::Reduce { root, .. } => Some(*root),
            _ => None,
        }
    }

    /// Element counts of each buffer, in buffer-index order (send, recv for
    /// collectives; one per operation for groups).
    pub fn buffer_counts(&self, nranks: u32) -> Result<Vec<usize>> {
        match self {
            Collective::Group(ops) => Ok(ops.iter().map(|o| o.count).collect()),
            _ => Ok(self.collective_counts(nranks)?.to_vec()),
        }
    }

    /// Element counts of a collective's send and receive buffers, without
    /// allocating (the per-call checks use it). A group has no such pair:
    /// `[0, 0]` (see [`Collective::buffer_counts`]).
    #[inline]
    pub fn collective_counts(&self, nranks: u32) -> Result<[usize; 2]> {
        let p = nranks as usize;
        let times = |c: usize| c.checked_mul(p).ok_or_else(|| count_overflow(c, p));
        Ok(match *self {
            Collective::AllReduce { count, .. }
            | Collective::Broadcast { count, .. }
            | Collective::Reduce { count, .. } => [count, count],
            Collective::ReduceScatter { recv_count, .. } => [times(recv_count)?, recv_count],
            Collective::AllGather { send_count } => [send_count, times(send_count)?],
            Collective::AllToAll { count } => [times(count)?, times(count)?],
            Collective::Group(_) => [0, 0],
            Collective::Barrier => [1, 1],
        })
    }

    /// Check the description against the communicator size: roots and peers
    /// in range, byte sizes that fit in memory. Nothing is sent before this
    /// passes.
    pub fn validate(&self, dtype: DataType, rank: u32, nranks: u32) -> Result<()> {
        self.validated_counts(dtype, rank, nranks).map(|_| ())
    }

    /// [`Collective::validate`], returning [`Collective::collective_counts`]
    /// (computed once: this runs for every operation, so its messages are
    /// built out of line).
    #[inline]
    pub fn validated_counts(&self, dtype: DataType, rank: u32, nranks: u32) -> Result<[usize; 2]> {
        if nranks == 0 || rank >= nranks {
            return Err(rank_out_of_range(rank, nranks));
        }
        if let Some(root) = self.root() {
            if root >= nranks {
                return Err(self.root_out_of_range(root, nranks));
            }
        }
        if let Collective::Group(ops) = self {
            self.validate_group(ops, dtype, rank, nranks)?;
            return Ok([0, 0]);
        }
        let counts = self.collective_counts(nranks)?;
        for c in counts {
            if !fits_memory(c, dtype) {
                return Err(too_large(c, dtype));
            }
        }
        Ok(counts)
    }

    #[cold]
    #[inline(never)]
    fn root_out_of_range(&self, root: u32, nranks: u32) -> CoreError {
        CoreError::InvalidArgument(format!(
            "{}: root {root} out of range: the communicator has ranks 0..{}",
            self.name(),
            nranks - 1
        ))
    }

    /// The checks of a group's operations (peers in range, sends to itself
    /// paired with receives, sizes).
    fn validate_group(&self, ops: &[P2p], dtype: DataType, rank: u32, nranks: u32) -> Result<()> {
        for (i, o) in ops.iter().enumerate() {
            if o.peer >= nranks {
                return Err(CoreError::InvalidArgument(format!(
                    "{} #{i}: peer {} out of range: the communicator has ranks 0..{}",
                    self.name(),
                    o.peer,
                    nranks - 1
                )));
            }
        }
        let mut to_self = ops.iter().filter(|o| o.peer == rank);
        let sends: Vec<_> = to_self
            .clone()
            .filter(|o| o.kind == P2pKind::Send)
            .collect();
        let recvs: Vec<_> = to_self
            .by_ref()
            .filter(|o| o.kind == P2pKind::Recv)
            .collect();
        if sends.len() != recvs.len() {
            return Err(CoreError::InvalidArgument(format!(
                "rank {rank}: the group has {} send(s) to itself but {} receive(s) from itself; pair them",
                sends.len(),
                recvs.len()
            )));
        }
        if let Some((s, r)) = sends.iter().zip(&recvs).find(|(s, r)| s.count != r.count) {
            return Err(CoreError::InvalidArgument(format!(
                "rank {rank}: a send to itself of {} elements is paired with a receive of {}",
                s.count, r.count
            )));
        }
        if ops.len() > u16::MAX as usize {
            return Err(CoreError::InvalidArgument(format!(
                "a group holds at most {} operations, got {}",
                u16::MAX,
                ops.len()
            )));
        }
        match ops.iter().find(|o| !fits_memory(o.count, dtype)) {
            Some(o) => Err(too_large(o.count, dtype)),
            None => Ok(()),
        }
    }
}

/// Whether `count` elements of `dtype` fit in the address space.
#[inline]
fn fits_memory(count: usize, dtype: DataType) -> bool {
    count
        .checked_mul(dtype.size())
        .is_some_and(|b| b <= isize::MAX as usize)
}

#[cold]
#[inline(never)]
fn too_large(count: usize, dtype: DataType) -> CoreError {
    CoreError::InvalidArgument(format!(
        "count {count} of {dtype} overflows the address space; use a smaller count"
    ))
}

#[cold]
#[inline(never)]
fn count_overflow(count: usize, p: usize) -> CoreError {
    CoreError::InvalidArgument(format!(
        "count {count} × {p} ranks overflows the address space; use a smaller count"
    ))
}

#[cold]
#[inline(never)]
fn rank_out_of_range(rank: u32, nranks: u32) -> CoreError {
    if nranks == 0 {
        CoreError::InvalidArgument("nranks must be at least 1".into())
    } else {
        CoreError::InvalidArgument(format!("rank {rank} out of range for {nranks} ranks"))
    }
}

/// What a plan depends on besides the collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanParams {
    /// This rank.
    pub rank: u32,
    /// Ring order: every rank exactly once; a rank sends to the next one.
    pub ring: Vec<u32>,
    /// Largest transfer per op: the transport's slot size.
    pub piece_bytes: usize,
    /// Largest transfer per op for collectives that only move data
    /// (AllGather, Broadcast, AllToAll, point-to-point): larger than
    /// `piece_bytes` when every link moves such pieces by reference (single
    /// copy), where bigger pieces mean fewer, cheaper system calls.
    pub move_piece_bytes: usize,
    /// AllReduce of at most this many bytes (and at most one piece) uses
    /// recursive doubling, which takes log2(p) exchange steps instead of the
    /// ring's 2(p−1) hops: latency-bound sizes. 0 means always the ring.
    pub small_allreduce_bytes: usize,
    /// AllGather and Broadcast on more than two ranks have every rank read
    /// each block straight from the rank that owns it (one stage, no relay
    /// along the ring), which keeps a descheduled rank from holding up the
    /// ranks behind it on the ring and takes one step instead of p−1. The
    /// runtime sets it where every link passes pieces by reference (single
    /// copy: a piece sent to many peers costs the sender nothing per peer),
    /// and for small AllGathers over slots (same volume as the ring); not
    /// for Broadcast over slots, where the root would copy its buffer once
    /// per peer.
    pub direct_moves: bool,
}

impl PlanParams {
    /// Parameters with the identity ring `0, 1, …, nranks−1`.
    pub fn new(rank: u32, nranks: u32, piece_bytes: usize) -> Self {
        PlanParams {
            rank,
            ring: (0..nranks).collect(),
            piece_bytes,
            move_piece_bytes: piece_bytes,
            small_allreduce_bytes: 0,
            direct_moves: false,
        }
    }

    /// Number of ranks.
    pub fn nranks(&self) -> u32 {
        self.ring.len() as u32
    }

    fn check(&self) -> Result<usize> {
        let p = self.ring.len();
        if p == 0 {
            return Err(CoreError::InvalidArgument("empty ring".into()));
        }
        let mut seen = vec![false; p];
        for &r in &self.ring {
            let slot = seen
                .get_mut(r as usize)
                .ok_or_else(|| CoreError::InvalidArgument(format!("ring names rank {r} of {p}")))?;
            if *slot {
                return Err(CoreError::InvalidArgument(format!(
                    "ring names rank {r} twice"
                )));
            }
            *slot = true;
        }
        if self.piece_bytes < 64 {
            return Err(CoreError::InvalidArgument(format!(
                "piece size {} is too small (at least 64 bytes)",
                self.piece_bytes
            )));
        }
        self.ring
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| CoreError::InvalidArgument(format!("rank {} not in ring", self.rank)))
    }
}

/// A rank's program for one operation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Program {
    /// The ops, stage after stage.
    pub ops: Vec<Op>,
    /// End index (exclusive) in `ops` of each stage.
    pub stage_ends: Vec<u32>,
    /// Element type.
    pub dtype: Option<DataType>,
    /// Pairwise reduction (Avg appears as Sum here; see `divisor`).
    pub red_op: Option<RedOp>,
    /// Divisor applied by `finalize` (nranks for Avg, else 1).
    pub divisor: u32,
}

impl Program {
    fn new(dtype: DataType, op: Option<RedOp>, nranks: u32) -> Self {
        Program {
            ops: Vec::new(),
            stage_ends: Vec::new(),
            dtype: Some(dtype),
            red_op: op.map(RedOp::pairwise),
            divisor: if op == Some(RedOp::Avg) { nranks } else { 1 },
        }
    }

    /// Append an op as its own stage. Ops that move nothing are dropped (both
    /// ends of a transfer compute the same lengths, so they agree on that).
    fn push(&mut self, op: Op) {
        if self.moves_nothing(&op) {
            return;
        }
        self.ops.push(op);
        self.stage_ends.push(self.ops.len() as u32);
    }

    /// Append ops to the current open stage (closed with `end_stage`).
    fn push_in_stage(&mut self, op: Op) {
        if !self.moves_nothing(&op) {
            self.ops.push(op);
        }
    }

    fn end_stage(&mut self) {
        let end = self.ops.len() as u32;
        if self.stage_ends.last().copied().unwrap_or(0) != end {
            self.stage_ends.push(end);
        }
    }

    fn moves_nothing(&self, op: &Op) -> bool {
        match *op {
            Op::Copy { src, dst, finalize } => {
                src.len == 0 || (src == dst && !(finalize && self.divisor > 1))
            }
            other => other.wire_len() == 0,
        }
    }

    /// Iterate over stages as slices of ops.
    pub fn stages(&self) -> impl Iterator<Item = &[Op]> {
        let mut start = 0usize;
        self.stage_ends.iter().map(move |&end| {
            let s = &self.ops[start..end as usize];
            start = end as usize;
            s
        })
    }

    /// Bytes this program sends through transports.
    pub fn bytes_sent(&self) -> u64 {
        self.ops
            .iter()
            .filter(|o| o.send_peer().is_some())
            .map(|o| o.wire_len() as u64)
            .sum()
    }

    /// The links this program uses: the peers it sends to and the peers it
    /// receives from (each sorted, without repeats). A rank must have these
    /// connected to run it; the runtime connects what is missing on first
    /// use, so a new algorithm gets its links by planning its ops.
    pub fn peers(&self) -> (Vec<u32>, Vec<u32>) {
        let mut send: Vec<u32> = self.ops.iter().filter_map(Op::send_peer).collect();
        let mut recv: Vec<u32> = self.ops.iter().filter_map(Op::recv_peer).collect();
        for v in [&mut send, &mut recv] {
            v.sort_unstable();
            v.dedup();
        }
        (send, recv)
    }

    /// Bytes of [`SCRATCH`] the program uses (0: none): the end of the
    /// furthest scratch region.
    pub fn scratch_bytes(&self) -> usize {
        self.ops
            .iter()
            .flat_map(|o| o.regions())
            .filter(|r| r.buf == SCRATCH)
            .map(|r| r.offset + r.len)
            .max()
            .unwrap_or(0)
    }
}

/// Plan one rank's part of `coll` on elements of `dtype`.
pub fn plan(coll: &Collective, dtype: DataType, params: &PlanParams) -> Result<Program> {
    let pos = params.check()?;
    let p = params.nranks();
    coll.validate(dtype, params.rank, p)?;
    let es = dtype.size();
    // Pieces hold whole elements.
    let moves_only = coll.red_op().is_none();
    let piece_bytes = if moves_only {
        params.move_piece_bytes.max(params.piece_bytes)
    } else {
        params.piece_bytes
    };
    let piece = (piece_bytes / es).max(1);
    // A barrier reduces its token with the maximum (any operator would do).
    let op = match coll {
        Collective::Barrier => Some(RedOp::Max),
        _ => coll.red_op(),
    };
    let mut prog = Program::new(dtype, op, p);
    let ctx = Ctx {
        ring: &params.ring,
        pos,
        p: p as usize,
        es,
        piece,
        sbuf: SEND,
        rbuf: RECV,
    };
    match *coll {
        Collective::AllReduce { count, .. }
            if count * es <= params.small_allreduce_bytes.min(params.piece_bytes) =>
        {
            ctx.all_reduce_rd(&mut prog, count)
        }
        Collective::AllReduce { count, .. } => ctx.all_reduce(&mut prog, count),
        Collective::ReduceScatter { recv_count, .. } => ctx.reduce_scatter(&mut prog, recv_count),
        Collective::AllGather { send_count } if params.direct_moves && p > 2 => {
            ctx.all_gather_direct(&mut prog, params.rank, send_count)
        }
        Collective::AllGather { send_count } => ctx.all_gather(&mut prog, send_count),
        Collective::Broadcast { count, root } if params.direct_moves && p > 2 => {
            ctx.broadcast_direct(&mut prog, params.rank, count, root)
        }
        Collective::Broadcast { count, root } => ctx.broadcast(&mut prog, count, root),
        Collective::Reduce { count, root, .. } => ctx.reduce(&mut prog, count, root),
        Collective::AllToAll { count } => ctx.all_to_all(&mut prog, params.rank, count),
        Collective::Group(ref ops) => ctx.group(&mut prog, params.rank, ops),
        Collective::Barrier => ctx.all_reduce_rd(&mut prog, 1),
    }
    Ok(prog)
}

/// Plan one rank's part of `coll` with the algorithm `choice` names (see
/// [`Algo`]): the tuner's and `BRAID_ALGO`'s entry point. `hosts` gives
/// the host (any index) of every rank; empty means a host per rank.
/// Point-to-point groups, AllToAll and the barrier have one plan each, as
/// [`plan`] makes it, whatever the choice. An algorithm that cannot run
/// `coll` is an error saying which can.
///
/// Algorithms other than the ring ignore [`PlanParams::small_allreduce_bytes`]
/// and [`PlanParams::direct_moves`]; trees, halving and Bruck number the
/// ranks by their ring position (so ranks of a host, adjacent on the ring,
/// exchange with each other first). `hosts` shapes [`Algo::Hier`] (a
/// leader per host) and, where there are several hosts and one holds more
/// than one rank, the trees: rail-aligned as NCCL's, every message between
/// hosts goes between ranks of the same local index (position among their
/// host's ranks, in ring order: the NIC the ring planner gives them) —
/// the double binary tree with a chain inside each host and the binary
/// trees across hosts on two rails, the binomial trees across hosts on the
/// root's rail, then inside each host (see `tree.rs`).
pub fn plan_with(
    coll: &Collective,
    dtype: DataType,
    params: &PlanParams,
    choice: Choice,
    hosts: &[u32],
) -> Result<Program> {
    let Some(kind) = CollKind::of(coll) else {
        return plan(coll, dtype, params);
    };
    choice.check(kind)?;
    let pos = params.check()?;
    let p = params.nranks();
    coll.validate(dtype, params.rank, p)?;
    if !hosts.is_empty() && hosts.len() != p as usize {
        return Err(CoreError::InvalidArgument(format!(
            "hosts names {} ranks, the communicator has {p}",
            hosts.len()
        )));
    }
    let es = dtype.size();
    let piece_bytes = if coll.red_op().is_none() {
        params.move_piece_bytes.max(params.piece_bytes)
    } else {
        params.piece_bytes
    };
    let mut prog = Program::new(dtype, coll.red_op(), p);
    let ctx = Ctx {
        ring: &params.ring,
        pos,
        p: p as usize,
        es,
        piece: (piece_bytes / es).max(1),
        sbuf: SEND,
        rbuf: RECV,
    };
    let rank = params.rank;
    let pr = &mut prog;
    match (choice.algo, coll) {
        (Algo::Ring, &Collective::AllReduce { count, .. }) => ctx.all_reduce(pr, count),
        (Algo::Ring, &Collective::ReduceScatter { recv_count, .. }) => {
            ctx.reduce_scatter(pr, recv_count)
        }
        (Algo::Ring, &Collective::AllGather { send_count }) => ctx.all_gather(pr, send_count),
        (Algo::Ring, &Collective::Broadcast { count, root }) => ctx.broadcast(pr, count, root),
        (Algo::Ring, &Collective::Reduce { count, root, .. }) => ctx.reduce(pr, count, root),
        (Algo::Direct, &Collective::AllGather { send_count }) => {
            ctx.all_gather_direct(pr, rank, send_count)
        }
        (Algo::Direct, &Collective::Broadcast { count, root }) => {
            ctx.broadcast_direct(pr, rank, count, root)
        }
        (Algo::Rd, &Collective::AllReduce { count, .. }) => ctx.all_reduce_rd(pr, count),
        (Algo::Rabenseifner, &Collective::AllReduce { count, .. }) => {
            ctx.all_reduce_rabenseifner(pr, count)
        }
        (Algo::Rabenseifner, &Collective::Reduce { count, root, .. }) => {
            ctx.reduce_rabenseifner(pr, count, root)
        }
        (Algo::Tree, &Collective::AllReduce { count, .. }) => ctx.all_reduce_tree(pr, count, hosts),
        (Algo::Tree, &Collective::Broadcast { count, root }) => {
            ctx.broadcast_binomial(pr, count, root, hosts)
        }
        (Algo::Tree, &Collective::Reduce { count, root, .. }) => {
            ctx.reduce_binomial(pr, count, root, hosts)
        }
        (Algo::Bruck, &Collective::AllGather { send_count }) => {
            ctx.all_gather_bruck(pr, send_count)
        }
        (Algo::Bruck, &Collective::ReduceScatter { recv_count, .. }) => {
            ctx.reduce_scatter_bruck(pr, recv_count)
        }
        (Algo::Hier, &Collective::AllReduce { count, .. }) => {
            ctx.all_reduce_hier(pr, count, hosts, choice.inner.unwrap_or(Algo::Ring))
        }
        _ => return Err(choice.algo.unsupported(kind)),
    }
    Ok(prog)
}

/// What an algorithm's code needs: the team it runs among (`ring`, in the
/// algorithm's order: a ring, or the ranks whose virtual index is their
/// position), this rank's position in it, the element size, the piece
/// (elements) and the buffers AllReduce reads and writes (`sbuf`, `rbuf`:
/// send and receive, or the receive buffer twice for the leaders' step of
/// the hierarchical AllReduce).
struct Ctx<'a> {
    ring: &'a [u32],
    pos: usize,
    p: usize,
    es: usize,
    piece: usize,
    sbuf: u16,
    rbuf: u16,
}

/// The largest power of two not above `p` (`p` ≥ 1).
fn pow2_floor(p: usize) -> usize {
    1usize << (usize::BITS - 1 - p.leading_zeros())
}

impl Ctx<'_> {
    /// Region of `n` elements at element offset `off` of buffer `buf`.
    fn reg(&self, buf: u16, off: usize, n: usize) -> Region {
        Region {
            buf,
            offset: off * self.es,
            len: n * self.es,
        }
    }

    /// The rank `d` positions after this one on the ring.
    fn at(&self, d: isize) -> usize {
        (self.pos as isize + d).rem_euclid(self.p as isize) as usize
    }

    fn next(&self) -> u32 {
        self.ring[self.at(1)]
    }

    fn prev(&self) -> u32 {
        self.ring[self.at(-1)]
    }

    fn whole_copy(&self, prog: &mut Program, count: usize) {
        prog.push(Op::Copy {
            src: self.reg(self.sbuf, 0, count),
            dst: self.reg(self.rbuf, 0, count),
            finalize: true,
        });
    }
}

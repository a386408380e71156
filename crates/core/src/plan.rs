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

use crate::error::{CoreError, Result};
use crate::types::{DataType, RedOp};

/// Buffer index of the send buffer of a collective.
pub const SEND: u16 = 0;
/// Buffer index of the receive buffer of a collective.
pub const RECV: u16 = 1;

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
        let times = |c: usize| {
            c.checked_mul(p).ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "count {c} × {p} ranks overflows the address space; use a smaller count"
                ))
            })
        };
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
    /// (computed once: this runs for every operation).
    #[inline]
    pub fn validated_counts(&self, dtype: DataType, rank: u32, nranks: u32) -> Result<[usize; 2]> {
        if nranks == 0 {
            return Err(CoreError::InvalidArgument(
                "nranks must be at least 1".into(),
            ));
        }
        if rank >= nranks {
            return Err(CoreError::InvalidArgument(format!(
                "rank {rank} out of range for {nranks} ranks"
            )));
        }
        if let Some(root) = self.root() {
            if root >= nranks {
                return Err(CoreError::InvalidArgument(format!(
                    "{}: root {root} out of range: the communicator has ranks 0..{}",
                    self.name(),
                    nranks - 1
                )));
            }
        }
        if let Collective::Group(ops) = self {
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
        }
        let fits = |c: usize| {
            c.checked_mul(dtype.size())
                .filter(|b| *b <= isize::MAX as usize)
                .map(|_| ())
                .ok_or_else(|| {
                    CoreError::InvalidArgument(format!(
                        "count {c} of {dtype} overflows the address space; use a smaller count"
                    ))
                })
        };
        match self {
            Collective::Group(ops) => {
                ops.iter().try_for_each(|o| fits(o.count))?;
                Ok([0, 0])
            }
            _ => {
                let counts = self.collective_counts(nranks)?;
                counts.into_iter().try_for_each(fits)?;
                Ok(counts)
            }
        }
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

struct Ctx<'a> {
    ring: &'a [u32],
    pos: usize,
    p: usize,
    es: usize,
    piece: usize,
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
            src: self.reg(SEND, 0, count),
            dst: self.reg(RECV, 0, count),
            finalize: true,
        });
    }

    /// Ring AllReduce = ring ReduceScatter followed by ring AllGather, done
    /// loop by loop over `p` chunks of at most one piece each so the two
    /// phases pipeline.
    fn all_reduce(&self, prog: &mut Program, count: usize) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let (next, prev) = (self.next(), self.prev());
        let loop_size = p * self.piece;
        let mut base = 0;
        while base < count {
            let rem = count - base;
            let real = self.piece.min(rem.div_ceil(p));
            // Chunk `c` (a ring position) of this loop.
            let chunk = |c: usize| {
                let start = (c * real).min(rem);
                let n = real.min(rem - start);
                (base + start, n)
            };
            let region = |buf: u16, c: usize| {
                let (o, n) = chunk(c);
                self.reg(buf, o, n)
            };
            // Reduce-scatter phase.
            prog.push(Op::Send {
                to: next,
                src: region(SEND, self.at(-1)),
            });
            for k in 1..p - 1 {
                let c = self.at(-1 - k as isize);
                prog.push(Op::RecvReduceSend {
                    from: prev,
                    to: next,
                    src: region(SEND, c),
                });
            }
            let c = self.pos;
            prog.push(Op::RecvReduceCopySend {
                from: prev,
                to: next,
                src: region(SEND, c),
                dst: region(RECV, c),
                finalize: true,
            });
            // All-gather phase.
            for k in 1..p - 1 {
                let c = self.at(-(k as isize));
                prog.push(Op::RecvCopySend {
                    from: prev,
                    to: next,
                    dst: region(RECV, c),
                });
            }
            prog.push(Op::Recv {
                from: prev,
                dst: region(RECV, self.at(1)),
            });
            base += loop_size.min(rem);
        }
    }

    /// Recursive doubling for small AllReduce (the whole buffer is one
    /// piece). With p not a power of two, the `p − p'` ranks above the largest
    /// power of two `p'` first hand their data to a partner below it and get
    /// the result back at the end. Every rank combines the same operands in
    /// the same bracketing, so floating-point results agree bit for bit.
    fn all_reduce_rd(&self, prog: &mut Program, count: usize) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let pp = 1usize << (usize::BITS - 1 - p.leading_zeros());
        let pos = self.pos;
        let (send, recv) = (self.reg(SEND, 0, count), self.reg(RECV, 0, count));
        if pos >= pp {
            let partner = self.ring[pos - pp];
            prog.push(Op::Send {
                to: partner,
                src: send,
            });
            prog.push(Op::Recv {
                from: partner,
                dst: recv,
            });
            return;
        }
        let extra = (pos + pp < p).then(|| self.ring[pos + pp]);
        let mut cur = send;
        if let Some(e) = extra {
            prog.push(Op::RecvReduceCopy {
                from: e,
                src: cur,
                dst: recv,
                finalize: false,
            });
            cur = recv;
        }
        let mut mask = 1;
        while mask < pp {
            let partner = self.ring[pos ^ mask];
            // Separate stages: the send reads `cur` before the reduction
            // overwrites it.
            prog.push(Op::Send {
                to: partner,
                src: cur,
            });
            prog.push(Op::RecvReduceCopy {
                from: partner,
                src: cur,
                dst: recv,
                finalize: mask * 2 == pp,
            });
            cur = recv;
            mask *= 2;
        }
        if let Some(e) = extra {
            prog.push(Op::Send { to: e, src: recv });
        }
    }

    /// Ring ReduceScatter: block `b` of the result ends on rank `b`.
    fn reduce_scatter(&self, prog: &mut Program, rc: usize) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, rc);
        }
        let (next, prev) = (self.next(), self.prev());
        let mut off = 0;
        while off < rc {
            let n = self.piece.min(rc - off);
            let src = |c: usize| self.reg(SEND, self.ring[c] as usize * rc + off, n);
            prog.push(Op::Send {
                to: next,
                src: src(self.at(-1)),
            });
            for k in 1..p - 1 {
                prog.push(Op::RecvReduceSend {
                    from: prev,
                    to: next,
                    src: src(self.at(-1 - k as isize)),
                });
            }
            prog.push(Op::RecvReduceCopy {
                from: prev,
                src: src(self.pos),
                dst: self.reg(RECV, off, n),
                finalize: true,
            });
            off += n;
        }
    }

    /// Ring AllGather: block `b` of the result comes from rank `b`.
    fn all_gather(&self, prog: &mut Program, sc: usize) {
        let p = self.p;
        let me = self.ring[self.pos] as usize;
        if p == 1 {
            return prog.push(Op::Copy {
                src: self.reg(SEND, 0, sc),
                dst: self.reg(RECV, me * sc, sc),
                finalize: false,
            });
        }
        let (next, prev) = (self.next(), self.prev());
        let mut off = 0;
        while off < sc {
            let n = self.piece.min(sc - off);
            let dst = |c: usize| self.reg(RECV, self.ring[c] as usize * sc + off, n);
            prog.push(Op::Send {
                to: next,
                src: self.reg(SEND, off, n),
            });
            // Our own block, piece by piece while the piece is in cache (a
            // no-op in place: the send buffer is that block).
            prog.push(Op::Copy {
                src: self.reg(SEND, off, n),
                dst: self.reg(RECV, me * sc + off, n),
                finalize: false,
            });
            for k in 1..p - 1 {
                prog.push(Op::RecvCopySend {
                    from: prev,
                    to: next,
                    dst: dst(self.at(-(k as isize))),
                });
            }
            prog.push(Op::Recv {
                from: prev,
                dst: dst(self.at(1)),
            });
            off += n;
        }
    }

    /// Position of this rank in the chain that starts at ring position
    /// `start`, and the chain's length.
    fn chain_index(&self, start: usize) -> usize {
        (self.pos + self.p - start) % self.p
    }

    fn ring_pos(&self, rank: u32) -> usize {
        self.ring.iter().position(|&r| r == rank).unwrap_or(0)
    }

    /// Pipelined chain from the root along the ring.
    fn broadcast(&self, prog: &mut Program, count: usize, root: u32) {
        let p = self.p;
        let ci = self.chain_index(self.ring_pos(root));
        let (next, prev) = (self.next(), self.prev());
        let mut off = 0;
        while p > 1 && off < count {
            let n = self.piece.min(count - off);
            if ci == 0 {
                // The root's own copy piece by piece, while it is in cache
                // (a no-op in place).
                prog.push(Op::Send {
                    to: next,
                    src: self.reg(SEND, off, n),
                });
                prog.push(Op::Copy {
                    src: self.reg(SEND, off, n),
                    dst: self.reg(RECV, off, n),
                    finalize: false,
                });
                off += n;
                continue;
            }
            prog.push(if ci < p - 1 {
                Op::RecvCopySend {
                    from: prev,
                    to: next,
                    dst: self.reg(RECV, off, n),
                }
            } else {
                Op::Recv {
                    from: prev,
                    dst: self.reg(RECV, off, n),
                }
            });
            off += n;
        }
        if p == 1 {
            prog.push(Op::Copy {
                src: self.reg(SEND, 0, count),
                dst: self.reg(RECV, 0, count),
                finalize: false,
            });
        }
    }

    /// Pipelined chain along the ring that ends at the root.
    fn reduce(&self, prog: &mut Program, count: usize, root: u32) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let ci = self.chain_index((self.ring_pos(root) + 1) % p);
        let (next, prev) = (self.next(), self.prev());
        let mut off = 0;
        while off < count {
            let n = self.piece.min(count - off);
            let src = self.reg(SEND, off, n);
            prog.push(if ci == 0 {
                Op::Send { to: next, src }
            } else if ci < p - 1 {
                Op::RecvReduceSend {
                    from: prev,
                    to: next,
                    src,
                }
            } else {
                Op::RecvReduceCopy {
                    from: prev,
                    src,
                    dst: self.reg(RECV, off, n),
                    finalize: true,
                }
            });
            off += n;
        }
    }

    /// Pieces of at most one piece each covering `count` elements from
    /// element offset `base`: `(offset, len)` in elements.
    fn pieces(&self, base: usize, count: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::with_capacity(count.div_ceil(self.piece));
        let mut off = 0;
        while off < count {
            let n = self.piece.min(count - off);
            v.push((base + off, n));
            off += n;
        }
        v
    }

    /// The send buffer's `count` elements, piece by piece, to every peer in
    /// the pairwise order `rank + s`, then our own copy of them to element
    /// `at` of the receive buffer (while the peers read): the first half
    /// of a direct plan's stage.
    fn send_to_all(&self, prog: &mut Program, r: usize, count: usize, at: usize) {
        let p = self.p;
        for s in 1..p {
            for (off, n) in self.pieces(0, count) {
                prog.push_in_stage(Op::Send {
                    to: ((r + s) % p) as u32,
                    src: self.reg(SEND, off, n),
                });
            }
        }
        prog.push_in_stage(Op::Copy {
            src: self.reg(SEND, 0, count),
            dst: self.reg(RECV, at, count),
            finalize: false,
        });
    }

    /// Direct AllGather (see [`PlanParams::direct_moves`]): our block goes
    /// by reference to every peer, in the pairwise order `rank + s`; our own
    /// copy runs while the peers read; then every peer's block is read from
    /// that peer, `rank − s`. One stage, as in [`Ctx::all_to_all`].
    fn all_gather_direct(&self, prog: &mut Program, rank: u32, sc: usize) {
        let p = self.p;
        let r = rank as usize;
        self.send_to_all(prog, r, sc, r * sc);
        for s in 1..p {
            let from = (r + p - s) % p;
            for (at, n) in self.pieces(from * sc, sc) {
                prog.push_in_stage(Op::Recv {
                    from: from as u32,
                    dst: self.reg(RECV, at, n),
                });
            }
        }
        prog.end_stage();
    }

    /// Direct Broadcast (see [`PlanParams::direct_moves`]): the root sends
    /// every piece to every peer by reference, starting with the peer after
    /// it, and copies its own buffer meanwhile; every other rank reads from
    /// the root.
    fn broadcast_direct(&self, prog: &mut Program, rank: u32, count: usize, root: u32) {
        if rank == root {
            self.send_to_all(prog, rank as usize, count, 0);
        } else {
            for (at, n) in self.pieces(0, count) {
                prog.push_in_stage(Op::Recv {
                    from: root,
                    dst: self.reg(RECV, at, n),
                });
            }
        }
        prog.end_stage();
    }

    /// Every piece to and from every peer in one stage: the executor moves
    /// whichever is ready (pieces to or from one peer keep their order), so
    /// a rank that is late — descheduled, when ranks outnumber cores — holds
    /// up only its own pieces, not a lock-step of pairwise exchanges. Sends
    /// come first (by reference they cost nothing until read), peers in the
    /// pairwise order `rank + s`; our own block is copied while the peers
    /// read; then the receives, from `rank − s`.
    fn all_to_all(&self, prog: &mut Program, rank: u32, count: usize) {
        let p = self.p;
        let r = rank as usize;
        let pieces = |peer: usize| self.pieces(peer * count, count);
        for s in 1..p {
            let to = (r + s) % p;
            for (at, n) in pieces(to) {
                prog.push_in_stage(Op::Send {
                    to: to as u32,
                    src: self.reg(SEND, at, n),
                });
            }
        }
        prog.push_in_stage(Op::Copy {
            src: self.reg(SEND, r * count, count),
            dst: self.reg(RECV, r * count, count),
            finalize: false,
        });
        for s in 1..p {
            let from = (r + p - s) % p;
            for (at, n) in pieces(from) {
                prog.push_in_stage(Op::Recv {
                    from: from as u32,
                    dst: self.reg(RECV, at, n),
                });
            }
        }
        prog.end_stage();
    }

    /// A group of sends and receives: transfers to and from oneself become
    /// copies (the i-th send to self feeds the i-th receive from self); the
    /// rest advance one piece of every transfer per stage.
    fn group(&self, prog: &mut Program, rank: u32, ops: &[P2p]) {
        let self_sends = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| o.peer == rank && o.kind == P2pKind::Send);
        let self_recvs = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| o.peer == rank && o.kind == P2pKind::Recv);
        for ((si, s), (ri, r)) in self_sends.zip(self_recvs) {
            let n = s.count.min(r.count);
            prog.push(Op::Copy {
                src: self.reg(si as u16, 0, n),
                dst: self.reg(ri as u16, 0, n),
                finalize: false,
            });
        }
        let rounds = ops
            .iter()
            .filter(|o| o.peer != rank)
            .map(|o| o.count.div_ceil(self.piece))
            .max()
            .unwrap_or(0);
        for j in 0..rounds {
            let off = j * self.piece;
            for (i, o) in ops.iter().enumerate() {
                if o.peer == rank || off >= o.count {
                    continue;
                }
                let region = self.reg(i as u16, off, self.piece.min(o.count - off));
                prog.push_in_stage(match o.kind {
                    P2pKind::Send => Op::Send {
                        to: o.peer,
                        src: region,
                    },
                    P2pKind::Recv => Op::Recv {
                        from: o.peer,
                        dst: region,
                    },
                });
            }
            prog.end_stage();
        }
    }
}

//! The ring and chain algorithms (every collective), braid's first plans:
//! ring AllReduce, ReduceScatter and AllGather, chain Broadcast and Reduce,
//! the single-piece recursive doubling of small AllReduce, the direct
//! ("flat") AllGather and Broadcast that read each block from its owner,
//! the pairwise AllToAll and point-to-point groups.

use super::*;

/// The largest AllToAll block planned one op per stage (see
/// [`Ctx::all_to_all`]): the host engine's small-message fast path takes
/// pieces up to 1 KiB. 2 ranks, braid-perf alltoall against Open MPI 5:
/// 32 B 0.64 µs and 1 KiB 1.43 µs in one stage, where AllGather, the same
/// exchange on the fast path, took 0.37 µs at 1 KiB.
pub(super) const SMALL_ALLTOALL_BYTES: usize = 1024;

impl Ctx<'_> {
    /// Ring AllReduce = ring ReduceScatter followed by ring AllGather, done
    /// loop by loop over `p` chunks of at most one piece each so the two
    /// phases pipeline.
    pub(super) fn all_reduce(&self, prog: &mut Program, count: usize) {
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
                src: region(self.sbuf, self.at(-1)),
            });
            for k in 1..p - 1 {
                let c = self.at(-1 - k as isize);
                prog.push(Op::RecvReduceSend {
                    from: prev,
                    to: next,
                    src: region(self.sbuf, c),
                });
            }
            let c = self.pos;
            prog.push(Op::RecvReduceCopySend {
                from: prev,
                to: next,
                src: region(self.sbuf, c),
                dst: region(self.rbuf, c),
                finalize: true,
            });
            // All-gather phase.
            for k in 1..p - 1 {
                let c = self.at(-(k as isize));
                prog.push(Op::RecvCopySend {
                    from: prev,
                    to: next,
                    dst: region(self.rbuf, c),
                });
            }
            prog.push(Op::Recv {
                from: prev,
                dst: region(self.rbuf, self.at(1)),
            });
            base += loop_size.min(rem);
        }
    }

    /// Recursive doubling's and halving's first step when p is not a power
    /// of two: the rank `pp` places after this one (if any) sends its whole
    /// buffer, which this rank reduces with its own into the receive buffer.
    /// Returns that extra rank and the buffer holding this rank's partial
    /// result (the receive buffer if it reduced, else the send buffer).
    pub(super) fn fold_in_extra(
        &self,
        prog: &mut Program,
        pp: usize,
        pieces: &[(usize, usize)],
    ) -> (Option<u32>, u16) {
        let (pos, rb) = (self.pos, self.rbuf);
        let extra = (pos + pp < self.p).then(|| self.ring[pos + pp]);
        let Some(e) = extra else {
            return (None, self.sbuf);
        };
        for &(o, n) in pieces {
            prog.push_in_stage(Op::RecvReduceCopy {
                from: e,
                src: self.reg(self.sbuf, o, n),
                dst: self.reg(rb, o, n),
                finalize: false,
            });
        }
        prog.end_stage();
        (extra, rb)
    }

    /// Recursive doubling AllReduce: log2(p) exchange steps of the whole
    /// buffer (latency-bound sizes). With p not a power of two, the
    /// `p − p'` ranks above the largest power of two `p'` first hand their
    /// data to a partner below it and get the result back at the end. Every
    /// rank combines the same operands in the same bracketing, so
    /// floating-point results agree bit for bit. A buffer of several pieces
    /// is exchanged piece by piece, each piece sent one stage before it is
    /// overwritten by the reduction (the send reads it first). The sends of
    /// later steps are rewritten by the reductions of the same step, so this
    /// plan must not send by reference ([`Algo::single_copy_safe`]).
    pub(super) fn all_reduce_rd(&self, prog: &mut Program, count: usize) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let pp = pow2_floor(p);
        let pos = self.pos;
        let (sb, rb) = (self.sbuf, self.rbuf);
        let pieces = self.pieces(0, count);
        if pos >= pp {
            let partner = self.ring[pos - pp];
            for &(o, n) in &pieces {
                prog.push_in_stage(Op::Send {
                    to: partner,
                    src: self.reg(sb, o, n),
                });
            }
            prog.end_stage();
            for &(o, n) in &pieces {
                prog.push_in_stage(Op::Recv {
                    from: partner,
                    dst: self.reg(rb, o, n),
                });
            }
            prog.end_stage();
            return;
        }
        let (extra, mut cur) = self.fold_in_extra(prog, pp, &pieces);
        let mut mask = 1;
        while mask < pp {
            let partner = self.ring[pos ^ mask];
            let last = mask * 2 == pp;
            // Stage j reduces piece j − 1 and sends piece j: a piece is sent
            // one stage before the reduction overwrites it.
            for j in 0..=pieces.len() {
                if let Some(&(o, n)) = j.checked_sub(1).and_then(|i| pieces.get(i)) {
                    prog.push_in_stage(Op::RecvReduceCopy {
                        from: partner,
                        src: self.reg(cur, o, n),
                        dst: self.reg(rb, o, n),
                        finalize: last,
                    });
                }
                if let Some(&(o, n)) = pieces.get(j) {
                    prog.push_in_stage(Op::Send {
                        to: partner,
                        src: self.reg(cur, o, n),
                    });
                }
                prog.end_stage();
            }
            cur = rb;
            mask *= 2;
        }
        if let Some(e) = extra {
            for &(o, n) in &pieces {
                prog.push_in_stage(Op::Send {
                    to: e,
                    src: self.reg(rb, o, n),
                });
            }
            prog.end_stage();
        }
    }

    /// Ring ReduceScatter: block `b` of the result ends on rank `b`.
    pub(super) fn reduce_scatter(&self, prog: &mut Program, rc: usize) {
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
    pub(super) fn all_gather(&self, prog: &mut Program, sc: usize) {
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
    pub(super) fn chain_index(&self, start: usize) -> usize {
        (self.pos + self.p - start) % self.p
    }

    pub(super) fn ring_pos(&self, rank: u32) -> usize {
        self.ring.iter().position(|&r| r == rank).unwrap_or(0)
    }

    /// Pipelined chain from the root along the ring.
    pub(super) fn broadcast(&self, prog: &mut Program, count: usize, root: u32) {
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
    pub(super) fn reduce(&self, prog: &mut Program, count: usize, root: u32) {
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
    pub(super) fn pieces(&self, base: usize, count: usize) -> Vec<(usize, usize)> {
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
    pub(super) fn send_to_all(&self, prog: &mut Program, r: usize, count: usize, at: usize) {
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
    pub(super) fn all_gather_direct(&self, prog: &mut Program, rank: u32, sc: usize) {
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
    pub(super) fn broadcast_direct(&self, prog: &mut Program, rank: u32, count: usize, root: u32) {
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
    ///
    /// Blocks of at most [`SMALL_ALLTOALL_BYTES`] take one op per stage
    /// instead, in the same order: each send takes one slot of its own
    /// link, so no rank waits on a send, and the host engine runs such
    /// programs on its small-message fast path.
    pub(super) fn all_to_all(&self, prog: &mut Program, rank: u32, count: usize) {
        let p = self.p;
        let r = rank as usize;
        let small = count * self.es <= SMALL_ALLTOALL_BYTES && count <= self.piece;
        let add = |prog: &mut Program, op: Op| {
            if small {
                prog.push(op);
            } else {
                prog.push_in_stage(op);
            }
        };
        let pieces = |peer: usize| self.pieces(peer * count, count);
        for s in 1..p {
            let to = (r + s) % p;
            for (at, n) in pieces(to) {
                add(
                    prog,
                    Op::Send {
                        to: to as u32,
                        src: self.reg(SEND, at, n),
                    },
                );
            }
        }
        add(
            prog,
            Op::Copy {
                src: self.reg(SEND, r * count, count),
                dst: self.reg(RECV, r * count, count),
                finalize: false,
            },
        );
        for s in 1..p {
            let from = (r + p - s) % p;
            for (at, n) in pieces(from) {
                add(
                    prog,
                    Op::Recv {
                        from: from as u32,
                        dst: self.reg(RECV, at, n),
                    },
                );
            }
        }
        prog.end_stage();
    }

    /// A group of sends and receives: transfers to and from oneself become
    /// copies (the i-th send to self feeds the i-th receive from self); the
    /// rest advance one piece of every transfer per stage.
    pub(super) fn group(&self, prog: &mut Program, rank: u32, ops: &[P2p]) {
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

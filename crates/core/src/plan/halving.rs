//! Rabenseifner's AllReduce: a reduce-scatter by recursive halving, then an
//! all-gather by recursive doubling (Thakur, Rabenseifner and Gropp,
//! "Optimization of collective communication operations in MPICH", 2005).
//! 2·log2 p steps, and every rank sends 2(p−1)/p of the buffer, as the ring
//! does. Its Reduce: the same reduce-scatter, then a binomial gather to the
//! root (the large-message Reduce of MPICH's paper above).

use super::*;

impl Ctx<'_> {
    /// Rabenseifner's AllReduce over the team (ring positions), from
    /// `sbuf` into `rbuf`.
    ///
    /// The buffer is cut into `p'` blocks (`p'` the largest power of two
    /// not above p; the `p − p'` ranks above it fold their data into a
    /// partner first and get the result back at the end, as in recursive
    /// doubling). Halving step `m = 1, 2, 4, …`: a rank and its partner
    /// `pos ^ m` share a range of blocks; each sends the partner the half
    /// the partner keeps (the upper half goes to the rank with bit `m`
    /// set) and reduces the other half with what it receives. After log2 p'
    /// steps a rank holds one block, reduced over every rank (finalized
    /// there). Doubling steps run the halving steps backwards, each rank
    /// sending what it has and receiving its partner's range.
    ///
    /// Ranks exchange with their nearest ring neighbours first, where the
    /// pieces are largest (ranks of a host are adjacent on the ring). A
    /// step is one stage: its sends and reductions touch disjoint halves.
    /// A range is rewritten only with data that comes from the partner it
    /// was sent to, after the partner reduced it, so pieces may go by
    /// reference.
    pub(super) fn all_reduce_rabenseifner(&self, prog: &mut Program, count: usize) {
        self.rabenseifner(prog, count, None)
    }

    /// Rabenseifner's Reduce: the AllReduce's reduce-scatter (and fold),
    /// then a binomial gather of the reduced blocks toward the root instead
    /// of the doubling steps. At gather step `m` (the halving steps
    /// backwards) the rank on the far side of bit `m` from the root (or
    /// from the partner a root above `p'` folded into) sends what it holds
    /// and is done; its partner receives it. The root reduces a `1/p'`
    /// share of the buffer where the ring's chain has it reduce all of it.
    /// Other ranks keep their partial results in [`SCRATCH`]: their
    /// receive buffer is not theirs to write.
    pub(super) fn reduce_rabenseifner(&self, prog: &mut Program, count: usize, root: u32) {
        let mine = self.ring_pos(root) == self.pos;
        let ctx = Ctx {
            ring: self.ring,
            pos: self.pos,
            p: self.p,
            es: self.es,
            piece: self.piece,
            sbuf: self.sbuf,
            rbuf: if mine { self.rbuf } else { SCRATCH },
        };
        ctx.rabenseifner(prog, count, Some(root))
    }

    /// Rabenseifner's AllReduce (`root` `None`) or Reduce (see above).
    fn rabenseifner(&self, prog: &mut Program, count: usize, root: Option<u32>) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let pp = pow2_floor(p);
        let pos = self.pos;
        let (sb, rb) = (self.sbuf, self.rbuf);
        let all = self.pieces(0, count);
        // Reduce: the root's ring position (`vroot` below: the rank under
        // p' that gathers the result for it).
        let rpos = root.map(|r| self.ring_pos(r));
        let gets_result = rpos.is_none_or(|r| r == pos);
        if pos >= pp {
            let partner = self.ring[pos - pp];
            self.stage_sends(prog, partner, sb, &all);
            if gets_result {
                self.stage_recvs(prog, partner, rb, &all);
            }
            return;
        }
        let vroot = rpos.map(|r| if r >= pp { r - pp } else { r });
        let (extra, mut cur) = self.fold_in_extra(prog, pp, &all);
        // Element offset of block b of pp.
        let start = |b: usize| b * count / pp;
        let range = |lo: usize, hi: usize| self.pieces(start(lo), start(hi) - start(lo));
        let (mut lo, mut hi) = (0usize, pp);
        let mut ranges = Vec::new();
        let mut mask = 1;
        while mask < pp {
            let partner = self.ring[pos ^ mask];
            let mid = (lo + hi) / 2;
            let (keep, give) = if pos & mask == 0 {
                ((lo, mid), (mid, hi))
            } else {
                ((mid, hi), (lo, mid))
            };
            ranges.push((lo, hi));
            for (o, n) in range(give.0, give.1) {
                prog.push_in_stage(Op::Send {
                    to: partner,
                    src: self.reg(cur, o, n),
                });
            }
            for (o, n) in range(keep.0, keep.1) {
                prog.push_in_stage(Op::RecvReduceCopy {
                    from: partner,
                    src: self.reg(cur, o, n),
                    dst: self.reg(rb, o, n),
                    finalize: mask * 2 == pp,
                });
            }
            prog.end_stage();
            cur = rb;
            (lo, hi) = keep;
            mask *= 2;
        }
        while mask > 1 {
            mask /= 2;
            let partner = self.ring[pos ^ mask];
            let (plo, phi) = ranges.pop().unwrap_or((0, pp));
            let (olo, ohi) = if lo == plo { (hi, phi) } else { (plo, lo) };
            // A Reduce's rank across bit `mask` from the root's gatherer
            // hands its blocks over and is done.
            let hands_over = vroot.is_some_and(|v| (pos ^ v) & mask != 0);
            if vroot.is_none() || hands_over {
                for (o, n) in range(lo, hi) {
                    prog.push_in_stage(Op::Send {
                        to: partner,
                        src: self.reg(rb, o, n),
                    });
                }
            }
            if !hands_over {
                for (o, n) in range(olo, ohi) {
                    prog.push_in_stage(Op::Recv {
                        from: partner,
                        dst: self.reg(rb, o, n),
                    });
                }
            }
            prog.end_stage();
            if hands_over {
                return;
            }
            (lo, hi) = (plo, phi);
        }
        if let Some(e) = extra {
            if rpos.is_none_or(|r| r == pos + pp) {
                self.stage_sends(prog, e, rb, &all);
            }
        }
    }

    /// One stage sending `pieces` of buffer `buf` to `to`.
    pub(super) fn stage_sends(
        &self,
        prog: &mut Program,
        to: u32,
        buf: u16,
        pieces: &[(usize, usize)],
    ) {
        for &(o, n) in pieces {
            prog.push_in_stage(Op::Send {
                to,
                src: self.reg(buf, o, n),
            });
        }
        prog.end_stage();
    }

    /// One stage receiving `pieces` of buffer `buf` from `from`.
    pub(super) fn stage_recvs(
        &self,
        prog: &mut Program,
        from: u32,
        buf: u16,
        pieces: &[(usize, usize)],
    ) {
        for &(o, n) in pieces {
            prog.push_in_stage(Op::Recv {
                from,
                dst: self.reg(buf, o, n),
            });
        }
        prog.end_stage();
    }
}

//! Rabenseifner's AllReduce: a reduce-scatter by recursive halving, then an
//! all-gather by recursive doubling (Thakur, Rabenseifner and Gropp,
//! "Optimization of collective communication operations in MPICH", 2005).
//! 2·log2 p steps, and every rank sends 2(p−1)/p of the buffer, as the ring
//! does.

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
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let pp = pow2_floor(p);
        let pos = self.pos;
        let (sb, rb) = (self.sbuf, self.rbuf);
        let all = self.pieces(0, count);
        if pos >= pp {
            let partner = self.ring[pos - pp];
            self.stage_sends(prog, partner, sb, &all);
            self.stage_recvs(prog, partner, rb, &all);
            return;
        }
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
            for (o, n) in range(lo, hi) {
                prog.push_in_stage(Op::Send {
                    to: partner,
                    src: self.reg(rb, o, n),
                });
            }
            for (o, n) in range(olo, ohi) {
                prog.push_in_stage(Op::Recv {
                    from: partner,
                    dst: self.reg(rb, o, n),
                });
            }
            prog.end_stage();
            (lo, hi) = (plo, phi);
        }
        if let Some(e) = extra {
            self.stage_sends(prog, e, rb, &all);
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

//! Bruck's AllGather (Bruck, Ho, Kipnis, Upfal and Weathersby, "Efficient
//! algorithms for all-to-all communications in multiport message-passing
//! systems", 1997) and its transpose for ReduceScatter: ⌈log2 p⌉ steps for
//! any p, each rank sending p − 1 blocks in all, as the ring does.
//!
//! Blocks are numbered by ring position (virtual index); block `v` of the
//! result is rank `ring[v]`'s, at that rank's place in the buffer, so
//! received blocks go straight where they belong (no final rotation).

use super::*;

impl Ctx<'_> {
    /// Runs of the blocks at ring positions `v0, v0 + 1, …, v0 + cnt − 1`
    /// (mod p), each `(first index i, count)` with `i` relative to `v0`,
    /// cut where the blocks stop being contiguous in the buffer (their
    /// ranks stop counting up by one) and at the `cuts` given (indices
    /// relative to `v0`). Both ends of a transfer compute the same runs.
    fn runs(&self, v0: usize, cnt: usize, cuts: &[usize]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut start = 0;
        for i in 1..=cnt {
            let split = i == cnt
                || cuts.contains(&i)
                || self.ring[(v0 + i) % self.p] != self.ring[(v0 + i - 1) % self.p] + 1;
            if split {
                out.push((start, i - start));
                start = i;
            }
        }
        out
    }

    /// Bruck AllGather: at step `d = 1, 2, 4, …` a rank sends the blocks it
    /// has — its own and the `d − 1` after it on the ring — to the rank `d`
    /// before it, and receives the next `min(d, p − d)` blocks from the rank
    /// `d` after it. One stage per step; its own block goes out from the
    /// send buffer at the first step while it is copied into place.
    pub(super) fn all_gather_bruck(&self, prog: &mut Program, sc: usize) {
        let p = self.p;
        let me = self.pos;
        let own = self.ring[me] as usize * sc;
        prog.push_in_stage(Op::Copy {
            src: self.reg(SEND, 0, sc),
            dst: self.reg(RECV, own, sc),
            finalize: false,
        });
        let mut d = 1;
        while d < p {
            let cnt = d.min(p - d);
            let to = self.ring[(me + p - d) % p];
            let from = self.ring[(me + d) % p];
            for (i, k) in self.runs(me, cnt, &[]) {
                let at = self.ring[(me + i) % p] as usize * sc;
                for (o, n) in self.pieces(0, k * sc) {
                    let src = if d == 1 {
                        self.reg(SEND, o, n)
                    } else {
                        self.reg(RECV, at + o, n)
                    };
                    prog.push_in_stage(Op::Send { to, src });
                }
            }
            let v0 = (me + d) % p;
            for (i, k) in self.runs(v0, cnt, &[]) {
                let at = self.ring[(v0 + i) % p] as usize * sc;
                for (o, n) in self.pieces(at, k * sc) {
                    prog.push_in_stage(Op::Recv {
                        from,
                        dst: self.reg(RECV, o, n),
                    });
                }
            }
            prog.end_stage();
            d *= 2;
        }
        prog.end_stage();
    }

    /// Bruck ReduceScatter, the AllGather transposed: steps `d = 2^k` for
    /// `k = ⌈log2 p⌉ − 1` down to 0. Before step `k` a rank holds partial
    /// sums for the `min(2d, p)` blocks from its own on; it sends the upper
    /// `min(d, p − d)` of them to the rank `d` after it and reduces what the
    /// rank `d` before it sends into its lower ones. Partial sums live in
    /// [`SCRATCH`] at their distance from the rank (`2^(⌈log2 p⌉−1)` blocks
    /// at most); blocks not yet received are read from the send buffer. The
    /// last step leaves the rank's own block, finalized, in the receive
    /// buffer.
    pub(super) fn reduce_scatter_bruck(&self, prog: &mut Program, rc: usize) {
        let p = self.p;
        let me = self.pos;
        let block = |v: usize| self.ring[v % p] as usize * rc;
        if p == 1 {
            prog.push(Op::Copy {
                src: self.reg(SEND, block(me), rc),
                dst: self.reg(RECV, 0, rc),
                finalize: true,
            });
            return;
        }
        let steps = (usize::BITS - (p - 1).leading_zeros()) as usize;
        let cnt = |k: usize| (1usize << k).min(p - (1 << k));
        for k in (0..steps).rev() {
            let d = 1usize << k;
            let c = cnt(k);
            // Blocks at distance below `held` have partial sums in scratch.
            let held = (k + 1..steps).map(cnt).max().unwrap_or(0);
            let cuts = [held.saturating_sub(d), held];
            let (to, from) = (self.ring[(me + d) % p], self.ring[(me + p - d) % p]);
            // Sends: distances d..d+c from this rank.
            for (i, n) in self.runs(me + d, c, &cuts) {
                let r = d + i;
                let src_at = |j: usize| {
                    if r < held {
                        (SCRATCH, r * rc + j)
                    } else {
                        (SEND, block(me + r) + j)
                    }
                };
                for (o, len) in self.pieces(0, n * rc) {
                    let (buf, at) = src_at(o);
                    prog.push_in_stage(Op::Send {
                        to,
                        src: self.reg(buf, at, len),
                    });
                }
            }
            // Receives: distances 0..c, reduced into what is held.
            for (i, n) in self.runs(me, c, &cuts) {
                for (o, len) in self.pieces(0, n * rc) {
                    let src = if i < held {
                        self.reg(SCRATCH, i * rc + o, len)
                    } else {
                        self.reg(SEND, block(me + i) + o, len)
                    };
                    let (dst, finalize) = if k == 0 {
                        (self.reg(RECV, o, len), true)
                    } else {
                        (self.reg(SCRATCH, i * rc + o, len), false)
                    };
                    prog.push_in_stage(Op::RecvReduceCopy {
                        from,
                        src,
                        dst,
                        finalize,
                    });
                }
            }
            prog.end_stage();
        }
    }
}

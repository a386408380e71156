//! Trees: NCCL's double binary tree for AllReduce (Sanders, Speck and
//! Träff, "Two-tree algorithms for full bandwidth broadcast, reduction and
//! scan", 2009), binomial trees for Broadcast and Reduce.

use super::*;

/// Parent and children (at most two, smaller first) of node `v` in the
/// in-order binary tree over `0..n` rooted at 0: a node's level is its
/// lowest set bit `b`; its parent is the node with that bit cleared and the
/// next one set (`(v ^ b) | 2b`), or with it just cleared when that is out
/// of range; the root 0 has one child, the largest power of two below `n`.
/// Depth ⌈log2 n⌉.
pub(super) fn btree(n: usize, v: usize) -> (Option<usize>, Vec<usize>) {
    let mut kids = Vec::with_capacity(2);
    if n <= 1 {
        return (None, kids);
    }
    let b = if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    };
    let parent = (v != 0).then(|| {
        let up = (v ^ b) | (b << 1);
        if up < n {
            up
        } else {
            v ^ b
        }
    });
    let half = b / 2;
    if half >= 1 {
        if v != 0 {
            kids.push(v - half);
        }
        let mut c = half;
        while c >= 1 && v + c >= n {
            c /= 2;
        }
        if c >= 1 {
            kids.push(v + c);
        }
    }
    (parent, kids)
}

/// Node `v` in the second tree of the double binary tree: the first tree
/// mirrored (`n − 1 − v`) when `n` is even — every inner node of one tree is
/// a leaf of the other — and shifted by one when it is odd.
pub(super) fn btree_second(n: usize, v: usize) -> (Option<usize>, Vec<usize>) {
    let even = n.is_multiple_of(2);
    let to = |x: usize| if even { n - 1 - x } else { (x + 1) % n };
    let from = |x: usize| if even { n - 1 - x } else { (x + n - 1) % n };
    let (p, k) = btree(n, to(v));
    (p.map(&from), k.into_iter().map(&from).collect())
}

impl Ctx<'_> {
    /// Double binary tree AllReduce over the team (ring positions), from
    /// `sbuf` into `rbuf`: the first half of the buffer is reduced up the
    /// first tree to its root and broadcast back down, the second half
    /// likewise in the second tree, piece by piece. A rank with two
    /// children reduces the first child's piece into `rbuf` and passes the
    /// second child's, reduced on the fly, to its parent; roots finalize.
    ///
    /// Order, one op per stage: the up steps of every piece (piece `j` of
    /// tree 0, then of tree 1, for `j = 0, 1, …`), then the down steps in
    /// the same order, so every link carries its messages in the same order
    /// on both ends. Up and down steps do not overlap: with one op at a
    /// time, a rank interleaving them would wait for each piece's round
    /// trip to the root before sending the next one up (the timed
    /// simulator showed it), which costs more than the overlap gains.
    pub(super) fn all_reduce_tree(&self, prog: &mut Program, count: usize) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let h0 = count.div_ceil(2);
        let halves = [self.pieces(0, h0), self.pieces(h0, count - h0)];
        let nodes = [btree(p, self.pos), btree_second(p, self.pos)];
        let rank = |v: usize| self.ring[v];
        let steps: Vec<Vec<(Vec<Op>, Vec<Op>)>> = (0..2)
            .map(|t| {
                let (par, kids) = &nodes[t];
                let par = par.map(rank);
                let kids: Vec<u32> = kids.iter().map(|&k| rank(k)).collect();
                halves[t]
                    .iter()
                    .map(|&(o, n)| {
                        let s = self.reg(self.sbuf, o, n);
                        let d = self.reg(self.rbuf, o, n);
                        tree_piece_ops(par, &kids, s, d)
                    })
                    .collect()
            })
            .collect();
        let np = halves[0].len().max(halves[1].len());
        for phase in 0..2 {
            for j in 0..np {
                for tree in &steps {
                    if let Some(ops) = tree.get(j).map(|s| if phase == 0 { &s.0 } else { &s.1 }) {
                        ops.iter().for_each(|&op| prog.push(op));
                    }
                }
            }
        }
    }

    /// Position of `root` relative to this rank's: the binomial trees'
    /// virtual index (the root is 0).
    fn rel(&self, root: u32) -> usize {
        (self.pos + self.p - self.ring_pos(root)) % self.p
    }

    /// The rank at virtual index `v` of a binomial tree rooted at `root`.
    fn rank_at_rel(&self, root: u32, v: usize) -> u32 {
        self.ring[(self.ring_pos(root) + v) % self.p]
    }

    /// Binomial-tree Broadcast: virtual index `v` (ring distance from the
    /// root) receives from `v − 2^⌊log2 v⌋` and sends to `v + 2^k` for every
    /// `2^k > v`, nearest first (the nearest child heads the largest
    /// subtree); ⌈log2 p⌉ steps. Stage `k` receives piece `k` and forwards
    /// piece `k − 1`.
    pub(super) fn broadcast_binomial(&self, prog: &mut Program, count: usize, root: u32) {
        let p = self.p;
        let v = self.rel(root);
        let pieces = self.pieces(0, count);
        let (parent, kids) = binomial(p, v);
        let parent = parent.map(|u| self.rank_at_rel(root, u));
        let kids: Vec<u32> = kids.iter().map(|&k| self.rank_at_rel(root, k)).collect();
        for k in 0..=pieces.len() {
            match parent {
                Some(par) => {
                    if let Some(&(o, n)) = pieces.get(k) {
                        prog.push_in_stage(Op::Recv {
                            from: par,
                            dst: self.reg(RECV, o, n),
                        });
                    }
                    if let Some(&(o, n)) = k.checked_sub(1).and_then(|i| pieces.get(i)) {
                        for &c in &kids {
                            prog.push_in_stage(Op::Send {
                                to: c,
                                src: self.reg(RECV, o, n),
                            });
                        }
                    }
                }
                None => {
                    if let Some(&(o, n)) = pieces.get(k) {
                        for &c in &kids {
                            prog.push_in_stage(Op::Send {
                                to: c,
                                src: self.reg(SEND, o, n),
                            });
                        }
                        prog.push_in_stage(Op::Copy {
                            src: self.reg(SEND, o, n),
                            dst: self.reg(RECV, o, n),
                            finalize: false,
                        });
                    }
                }
            }
            prog.end_stage();
        }
    }

    /// Binomial-tree Reduce, the Broadcast's tree run backwards: a rank
    /// reduces its children's pieces (farthest first: the smallest
    /// subtrees finish first) into its
    /// accumulator and passes the last one on to its parent reduced on the
    /// fly. The root accumulates in the receive buffer; other ranks with
    /// two or more children in [`SCRATCH`] (a non-root rank's receive
    /// buffer is not the caller's to write).
    pub(super) fn reduce_binomial(&self, prog: &mut Program, count: usize, root: u32) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let v = self.rel(root);
        let (parent, kids) = binomial(p, v);
        let parent = parent.map(|u| self.rank_at_rel(root, u));
        let kids: Vec<u32> = kids
            .iter()
            .rev()
            .map(|&k| self.rank_at_rel(root, k))
            .collect();
        let acc_buf = if parent.is_none() { RECV } else { SCRATCH };
        for (o, n) in self.pieces(0, count) {
            let s = self.reg(SEND, o, n);
            let acc = self.reg(acc_buf, o, n);
            let Some((&last, first)) = kids.split_last() else {
                if let Some(par) = parent {
                    prog.push(Op::Send { to: par, src: s });
                }
                continue;
            };
            let mut cur = s;
            for &c in first {
                prog.push(Op::RecvReduceCopy {
                    from: c,
                    src: cur,
                    dst: acc,
                    finalize: false,
                });
                cur = acc;
            }
            prog.push(match parent {
                Some(par) => Op::RecvReduceSend {
                    from: last,
                    to: par,
                    src: cur,
                },
                None => Op::RecvReduceCopy {
                    from: last,
                    src: cur,
                    dst: self.reg(RECV, o, n),
                    finalize: true,
                },
            });
        }
    }
}

/// Up and down steps of one piece at a node of a reduce-then-broadcast
/// tree with parent `par` and children `kids` (at most two), over the
/// piece's source `s` and destination `d`.
fn tree_piece_ops(par: Option<u32>, kids: &[u32], s: Region, d: Region) -> (Vec<Op>, Vec<Op>) {
    let up = match (kids, par) {
        ([], Some(to)) => vec![Op::Send { to, src: s }],
        ([], None) => vec![Op::Copy {
            src: s,
            dst: d,
            finalize: true,
        }],
        ([c], Some(to)) => vec![Op::RecvReduceSend {
            from: *c,
            to,
            src: s,
        }],
        ([c], None) => vec![Op::RecvReduceCopy {
            from: *c,
            src: s,
            dst: d,
            finalize: true,
        }],
        ([c0, c1, ..], par) => vec![
            Op::RecvReduceCopy {
                from: *c0,
                src: s,
                dst: d,
                finalize: false,
            },
            match par {
                Some(to) => Op::RecvReduceSend {
                    from: *c1,
                    to,
                    src: d,
                },
                None => Op::RecvReduceCopy {
                    from: *c1,
                    src: d,
                    dst: d,
                    finalize: true,
                },
            },
        ],
    };
    let down = match (par, kids) {
        (None, kids) => kids.iter().map(|&to| Op::Send { to, src: d }).collect(),
        (Some(from), []) => vec![Op::Recv { from, dst: d }],
        (Some(from), [c0, rest @ ..]) => {
            let mut v = vec![Op::RecvCopySend {
                from,
                to: *c0,
                dst: d,
            }];
            v.extend(rest.iter().map(|&to| Op::Send { to, src: d }));
            v
        }
    };
    (up, down)
}

/// Parent and children of virtual index `v` in the binomial tree over
/// `0..p` rooted at 0: the parent clears `v`'s highest bit; the children
/// are `v + 2^k` for every `2^k > v` below `p`, nearest first (the
/// nearest heads the largest subtree).
pub(super) fn binomial(p: usize, v: usize) -> (Option<usize>, Vec<usize>) {
    let parent = (v > 0).then(|| v - (1usize << (usize::BITS - 1 - v.leading_zeros())));
    let mut kids = Vec::new();
    let mut m = 1usize;
    while m <= v {
        m *= 2;
    }
    while v + m < p {
        kids.push(v + m);
        m *= 2;
    }
    (parent, kids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tree is a tree: one root, every other node's parent lists it
    /// as a child, depth at most ⌈log2 n⌉ + 1; in the double binary tree of
    /// an even `n`, no node is an inner node of both trees.
    #[test]
    fn trees_are_trees() {
        for n in 1..200usize {
            for (name, f) in [
                ("btree", btree as fn(usize, usize) -> _),
                ("second", btree_second),
                ("binomial", binomial),
            ] {
                let nodes: Vec<_> = (0..n).map(|v| f(n, v)).collect();
                assert_eq!(
                    nodes.iter().filter(|x| x.0.is_none()).count(),
                    1,
                    "{name} n={n}: one root"
                );
                for (v, (par, kids)) in nodes.iter().enumerate() {
                    if let Some(u) = par {
                        assert!(nodes[*u].1.contains(&v), "{name} n={n}: {u} -> {v}");
                    }
                    for &k in kids {
                        assert_eq!(nodes[k].0, Some(v), "{name} n={n}: child {k} of {v}");
                    }
                    let mut d = 0;
                    let mut x = v;
                    while let Some(u) = nodes[x].0 {
                        x = u;
                        d += 1;
                        assert!(d <= 64, "{name} n={n}: cycle");
                    }
                    let bound = (usize::BITS - n.leading_zeros()) as usize + 1;
                    assert!(d <= bound, "{name} n={n}: depth {d} of {v}");
                }
                if name != "binomial" {
                    assert!(nodes.iter().all(|x| x.1.len() <= 2), "{name} n={n}");
                }
            }
            if n.is_multiple_of(2) && n > 2 {
                for v in 0..n {
                    let inner0 = !btree(n, v).1.is_empty();
                    let inner1 = !btree_second(n, v).1.is_empty();
                    assert!(!(inner0 && inner1), "n={n}: {v} inner in both trees");
                }
            }
        }
    }
}

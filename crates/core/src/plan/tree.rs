//! Trees: NCCL's double binary tree for AllReduce (Sanders, Speck and
//! Träff, "Two-tree algorithms for full bandwidth broadcast, reduction and
//! scan", 2009), binomial trees for Broadcast and Reduce.
//!
//! Without hosts (or with one host, or one rank per host) the trees are
//! over ring positions. With hosts of several ranks they are rail-aligned,
//! as NCCL's are: rail-optimised clusters wire NIC k of every host to one
//! switch, and a rank's NIC is its local index (see [`HostGroups`]), so
//! every message between hosts goes between ranks of one local index.
//!
//! - Double binary tree: tree t has a head on every host, of local index
//!   0 (t = 0) or ⌊m_min/2⌋ (t = 1, m_min the fewest ranks on a host: a
//!   second rail whenever hosts hold two ranks or more); a host's ranks
//!   form a chain from its head, and the heads form the binary tree
//!   ([`btree`], [`btree_second`]) over the hosts.
//! - Binomial trees: a binomial tree over the hosts among the ranks of the
//!   root's local index (the root's host first), then one inside each host
//!   from that rank. A host with fewer ranks joins through its last rank.

use super::hier::HostGroups;
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
    /// likewise in the second tree, piece by piece. A rank reduces its
    /// children's pieces into `rbuf` one after the other and passes the
    /// last child's, reduced on the fly, to its parent; roots finalize.
    /// With `hosts` of several ranks the trees are rail-aligned (module
    /// docs, [`Ctx::dbt_hosts_node`]).
    ///
    /// Order, one op per stage: the up steps of every piece (piece `j` of
    /// tree 0, then of tree 1, for `j = 0, 1, …`), then the down steps in
    /// the same order, so every link carries its messages in the same order
    /// on both ends. Up and down steps do not overlap: with one op at a
    /// time, a rank interleaving them would wait for each piece's round
    /// trip to the root before sending the next one up (the timed
    /// simulator showed it), which costs more than the overlap gains.
    pub(super) fn all_reduce_tree(&self, prog: &mut Program, count: usize, hosts: &[u32]) {
        let p = self.p;
        if p == 1 {
            return self.whole_copy(prog, count);
        }
        let h0 = count.div_ceil(2);
        let halves = [self.pieces(0, h0), self.pieces(h0, count - h0)];
        let g = (!hosts.is_empty())
            .then(|| self.host_groups(hosts))
            .filter(HostGroups::is_hierarchical);
        let nodes: Vec<TreeNode> = (0..2)
            .map(|t| match &g {
                Some(g) => self.dbt_hosts_node(g, t),
                None => {
                    let (par, kids) = if t == 0 {
                        btree(p, self.pos)
                    } else {
                        btree_second(p, self.pos)
                    };
                    let kids: Vec<u32> = kids.iter().map(|&k| self.ring[k]).collect();
                    TreeNode {
                        parent: par.map(|v| self.ring[v]),
                        up: kids.clone(),
                        down: kids,
                    }
                }
            })
            .collect();
        let steps: Vec<Vec<(Vec<Op>, Vec<Op>)>> = (0..2)
            .map(|t| {
                halves[t]
                    .iter()
                    .map(|&(o, n)| {
                        let s = self.reg(self.sbuf, o, n);
                        let d = self.reg(self.rbuf, o, n);
                        tree_piece_ops(&nodes[t], s, d)
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

    /// This rank's node in tree `t` of the rail-aligned double binary tree
    /// (module docs). A head's children are the next rank of its chain and
    /// the heads of its child hosts (up to three); the chain's child comes
    /// first up (its piece comes in first, over shared memory; the hosts',
    /// from deeper subtrees, are reduced last) and last down (the hosts'
    /// subtrees are deeper, so they get each piece first).
    fn dbt_hosts_node(&self, g: &HostGroups, t: usize) -> TreeNode {
        let head = if t == 0 { 0 } else { g.min_size() / 2 };
        let mine = &g.groups[g.host];
        let m = mine.len();
        let chain = |c: usize| mine[(head + c) % m];
        let c = (g.local + m - head) % m;
        if c > 0 {
            let kids: Vec<u32> = (c + 1 < m).then(|| chain(c + 1)).into_iter().collect();
            return TreeNode {
                parent: Some(chain(c - 1)),
                up: kids.clone(),
                down: kids,
            };
        }
        let nh = g.groups.len();
        let (par, host_kids) = if t == 0 {
            btree(nh, g.host)
        } else {
            btree_second(nh, g.host)
        };
        // `head` < m_min: every host has a rank of that local index.
        let head_of = |h: usize| g.groups[h][head];
        let host_kids: Vec<u32> = host_kids.into_iter().map(head_of).collect();
        let next: Option<u32> = (m > 1).then(|| chain(1));
        TreeNode {
            parent: par.map(head_of),
            up: next.iter().chain(&host_kids).copied().collect(),
            down: host_kids.iter().chain(&next).copied().collect(),
        }
    }

    /// Parent and children (nearest first: the nearest child heads the
    /// largest subtree) of this rank in the binomial tree rooted at
    /// `root`. Without hosts (or when they do not matter, see
    /// [`HostGroups::is_hierarchical`]) the tree is over the ring distance
    /// from the root. With hosts it is hierarchical and rail-aligned: a
    /// binomial tree over the hosts (numbered from the root's host, in
    /// ring order) among their ranks of the root's local index — or their
    /// last rank, on a host with fewer ranks — and a binomial tree inside
    /// each host from that rank. That rank's children across hosts come
    /// before those inside its host: their subtrees are the larger.
    fn binomial_node(&self, root: u32, hosts: &[u32]) -> (Option<u32>, Vec<u32>) {
        let g = (!hosts.is_empty())
            .then(|| self.host_groups(hosts))
            .filter(HostGroups::is_hierarchical);
        let Some(g) = g else {
            let p = self.p;
            let rp = self.ring_pos(root);
            let at = |v: usize| self.ring[(rp + v) % p];
            let (parent, kids) = binomial(p, (self.pos + p - rp) % p);
            return (parent.map(at), kids.into_iter().map(at).collect());
        };
        let nh = g.groups.len();
        let (rh, rl) = g
            .groups
            .iter()
            .enumerate()
            .find_map(|(h, ranks)| ranks.iter().position(|&r| r == root).map(|l| (h, l)))
            .unwrap_or((0, 0));
        let rail = |h: usize| rl.min(g.groups[h].len() - 1);
        let mine = &g.groups[g.host];
        let m = mine.len();
        let base = rail(g.host);
        let local_at = |v: usize| mine[(base + v) % m];
        let (lpar, lkids) = binomial(m, (g.local + m - base) % m);
        let lkids = lkids.into_iter().map(local_at);
        if let Some(u) = lpar {
            return (Some(local_at(u)), lkids.collect());
        }
        let host_at = |v: usize| {
            let h = (rh + v) % nh;
            g.groups[h][rail(h)]
        };
        let (hpar, hkids) = binomial(nh, (g.host + nh - rh) % nh);
        (
            hpar.map(host_at),
            hkids.into_iter().map(host_at).chain(lkids).collect(),
        )
    }

    /// Binomial-tree Broadcast: virtual index `v` (ring distance from the
    /// root) receives from `v − 2^⌊log2 v⌋` and sends to `v + 2^k` for every
    /// `2^k > v`, nearest first (the nearest child heads the largest
    /// subtree); ⌈log2 p⌉ steps. With hosts, the hierarchical tree of
    /// [`Ctx::binomial_node`]. Stage `k` receives piece `k` and forwards
    /// piece `k − 1`.
    pub(super) fn broadcast_binomial(
        &self,
        prog: &mut Program,
        count: usize,
        root: u32,
        hosts: &[u32],
    ) {
        let pieces = self.pieces(0, count);
        let (parent, kids) = self.binomial_node(root, hosts);
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
    /// buffer is not the caller's to write). With hosts, the tree of
    /// [`Ctx::binomial_node`]: inside each host toward its rail rank, then
    /// across hosts toward the root.
    pub(super) fn reduce_binomial(
        &self,
        prog: &mut Program,
        count: usize,
        root: u32,
        hosts: &[u32],
    ) {
        if self.p == 1 {
            return self.whole_copy(prog, count);
        }
        let (parent, mut kids) = self.binomial_node(root, hosts);
        kids.reverse();
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

/// A rank's place in one tree of a reduce-then-broadcast AllReduce: its
/// parent (none at the root) and its children, in the order the up phase
/// reduces their pieces and in the order the down phase sends to them.
struct TreeNode {
    parent: Option<u32>,
    up: Vec<u32>,
    down: Vec<u32>,
}

/// Up and down steps of one piece at `node`, over the piece's source `s`
/// and destination `d`. Up: every child's piece but the last is reduced
/// into `d` in `node.up`'s order, the last one on the fly into the message
/// to the parent (or into `d`, finalized, at the root). Down: receive from
/// the parent (the root has the result), then send to every child in
/// `node.down`'s order.
fn tree_piece_ops(node: &TreeNode, s: Region, d: Region) -> (Vec<Op>, Vec<Op>) {
    let mut up = Vec::with_capacity(node.up.len() + 1);
    match node.up.split_last() {
        None => up.push(match node.parent {
            Some(to) => Op::Send { to, src: s },
            None => Op::Copy {
                src: s,
                dst: d,
                finalize: true,
            },
        }),
        Some((&last, first)) => {
            let mut cur = s;
            for &from in first {
                up.push(Op::RecvReduceCopy {
                    from,
                    src: cur,
                    dst: d,
                    finalize: false,
                });
                cur = d;
            }
            up.push(match node.parent {
                Some(to) => Op::RecvReduceSend {
                    from: last,
                    to,
                    src: cur,
                },
                None => Op::RecvReduceCopy {
                    from: last,
                    src: cur,
                    dst: d,
                    finalize: true,
                },
            });
        }
    }
    let down = match (node.parent, node.down.as_slice()) {
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

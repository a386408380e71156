//! The hierarchical AllReduce for jobs over several hosts (Open MPI's han,
//! NCCL's CollNet in spirit): reduce inside each host to a leader, an
//! AllReduce among the leaders only, and a broadcast back inside each host.
//! Only one rank per host talks to the network, and the network sees
//! 2(h−1) or 2·log2 h steps for h hosts instead of the flat algorithm's
//! steps over every rank.

use super::*;

impl Ctx<'_> {
    /// Hierarchical AllReduce. `hosts[r]` is rank `r`'s host (empty: one
    /// host per rank). A host's ranks, in ring order, form a chain whose
    /// first rank is the host's leader: pieces are reduced along the chain
    /// toward the leader (into its receive buffer), the leaders — in ring
    /// order — run `inner` in place on their receive buffers (which
    /// finalizes), and the result flows back down each chain. Phases follow
    /// each other on every rank; each uses its own links, so their
    /// messages never mix.
    pub(super) fn all_reduce_hier(
        &self,
        prog: &mut Program,
        count: usize,
        hosts: &[u32],
        inner: Algo,
    ) {
        let host = |r: u32| hosts.get(r as usize).copied().unwrap_or(r);
        let mine = host(self.ring[self.pos]);
        let local: Vec<u32> = self
            .ring
            .iter()
            .copied()
            .filter(|&r| host(r) == mine)
            .collect();
        let mut leaders: Vec<u32> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for &r in self.ring {
            if seen.insert(host(r)) {
                leaders.push(r);
            }
        }
        let me = self.ring[self.pos];
        let li = local.iter().position(|&r| r == me).unwrap_or(0);
        let m = local.len();
        let (s, d) = (self.sbuf, self.rbuf);
        let pieces = self.pieces(0, count);
        // Up the host's chain, toward the leader.
        for &(o, n) in &pieces {
            let (src, dst) = (self.reg(s, o, n), self.reg(d, o, n));
            prog.push(if m == 1 {
                Op::Copy {
                    src,
                    dst,
                    finalize: false,
                }
            } else if li == m - 1 {
                Op::Send {
                    to: local[li - 1],
                    src,
                }
            } else if li > 0 {
                Op::RecvReduceSend {
                    from: local[li + 1],
                    to: local[li - 1],
                    src,
                }
            } else {
                Op::RecvReduceCopy {
                    from: local[1],
                    src,
                    dst,
                    finalize: false,
                }
            });
        }
        if li == 0 {
            let lpos = leaders.iter().position(|&r| r == me).unwrap_or(0);
            let lead = Ctx {
                ring: &leaders,
                pos: lpos,
                p: leaders.len(),
                es: self.es,
                piece: self.piece,
                sbuf: d,
                rbuf: d,
            };
            match inner {
                Algo::Rd => lead.all_reduce_rd(prog, count),
                Algo::Rabenseifner => lead.all_reduce_rabenseifner(prog, count),
                Algo::Tree => lead.all_reduce_tree(prog, count),
                _ => lead.all_reduce(prog, count),
            }
        }
        // Back down the chain.
        if m > 1 {
            for &(o, n) in &pieces {
                let dst = self.reg(d, o, n);
                prog.push(if li == 0 {
                    Op::Send {
                        to: local[1],
                        src: dst,
                    }
                } else if li + 1 < m {
                    Op::RecvCopySend {
                        from: local[li - 1],
                        to: local[li + 1],
                        dst,
                    }
                } else {
                    Op::Recv {
                        from: local[li - 1],
                        dst,
                    }
                });
            }
        }
    }
}

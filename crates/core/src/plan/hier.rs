//! The hierarchical AllReduce for jobs over several hosts (Open MPI's han,
//! NCCL's CollNet in spirit): reduce inside each host to a leader, an
//! AllReduce among the leaders only, and a broadcast back inside each host.
//! Only one rank per host talks to the network, and the network sees
//! 2(h−1) or 2·log2 h steps for h hosts instead of the flat algorithm's
//! steps over every rank.

use super::*;

/// The ranks of a job grouped by host, as the host-aware plans (the
/// hierarchical AllReduce, the trees) see them: hosts numbered in ring
/// order of first appearance, each host's ranks in ring order. A rank's
/// *local index* is its position in its host's group — its rail (NIC), as
/// the ring planner assigns them.
pub(super) struct HostGroups {
    /// The ranks of every host.
    pub(super) groups: Vec<Vec<u32>>,
    /// This rank's host (an index into `groups`).
    pub(super) host: usize,
    /// This rank's local index.
    pub(super) local: usize,
}

impl HostGroups {
    /// Whether hosts matter to a tree: more than one host, and a host with
    /// more than one rank (otherwise the flat plans already send every
    /// message between hosts, each on the only rail there is).
    pub(super) fn is_hierarchical(&self) -> bool {
        self.groups.len() > 1 && self.groups.iter().any(|g| g.len() > 1)
    }

    /// The fewest ranks on any host.
    pub(super) fn min_size(&self) -> usize {
        self.groups.iter().map(Vec::len).min().unwrap_or(1)
    }
}

impl Ctx<'_> {
    /// Group the team by `hosts` (`hosts[r]` is rank `r`'s host, any index;
    /// empty: one host per rank).
    pub(super) fn host_groups(&self, hosts: &[u32]) -> HostGroups {
        let host = |r: u32| hosts.get(r as usize).copied().unwrap_or(r);
        let mut index = std::collections::HashMap::new();
        let mut groups: Vec<Vec<u32>> = Vec::new();
        let (mut mine, mut local) = (0, 0);
        for (i, &r) in self.ring.iter().enumerate() {
            let h = *index.entry(host(r)).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            if i == self.pos {
                (mine, local) = (h, groups[h].len());
            }
            groups[h].push(r);
        }
        HostGroups {
            groups,
            host: mine,
            local,
        }
    }

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
        let g = self.host_groups(hosts);
        let local = &g.groups[g.host];
        let leaders: Vec<u32> = g.groups.iter().map(|h| h[0]).collect();
        let me = self.ring[self.pos];
        let li = g.local;
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
                Algo::Tree => lead.all_reduce_tree(prog, count, &[]),
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

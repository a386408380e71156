//! The tree plans on several hosts are rail-aligned: on a rail-optimised
//! cluster NIC k of every host hangs off one switch, and a rank's NIC is
//! its local index (its position among its host's ranks, in ring order), so
//! a message between hosts should go between ranks of one local index. The
//! checks read the programs' send peers; `sim_algos.rs` checks the results.
//!
//! - Every message between hosts of the double binary tree and of the
//!   binomial Broadcast and Reduce goes between ranks of equal local index
//!   whenever both hosts have that index.
//! - The double binary tree puts its two trees on rails 0 and ⌊m_min/2⌋ (two
//!   rails when every host has two ranks or more); the binomial trees on
//!   the root's rail (a host without it uses its last rank).
//! - Where hosts do not matter (none given, one rank per host, one host),
//!   the plans are the flat ones, unchanged.
//! - The flat plans break the rule on the same layouts (so the check can
//!   fail).

use std::collections::{BTreeSet, HashMap};

use braid_core::plan::{plan_with, Algo, Choice, Collective, Op, PlanParams, Program};
use braid_core::{DataType, RedOp};

/// A job's layout: ring order and host of every rank.
struct Layout {
    ring: Vec<u32>,
    hosts: Vec<u32>,
}

impl Layout {
    fn blocks(sizes: &[usize]) -> Layout {
        let hosts: Vec<u32> = sizes
            .iter()
            .enumerate()
            .flat_map(|(h, &m)| std::iter::repeat_n(h as u32, m))
            .collect();
        Layout {
            ring: (0..hosts.len() as u32).collect(),
            hosts,
        }
    }

    fn p(&self) -> usize {
        self.ring.len()
    }

    /// Local index of every rank, and the size of every rank's host.
    fn local(&self) -> (Vec<usize>, Vec<usize>) {
        let mut seen: HashMap<u32, usize> = HashMap::new();
        let mut local = vec![0; self.p()];
        for &r in &self.ring {
            let n = seen.entry(self.hosts[r as usize]).or_default();
            local[r as usize] = *n;
            *n += 1;
        }
        let size = (0..self.p()).map(|r| seen[&self.hosts[r]]).collect();
        (local, size)
    }

    fn programs(&self, coll: &Collective, hosts: &[u32]) -> Vec<Program> {
        (0..self.p() as u32)
            .map(|r| {
                let params = PlanParams {
                    ring: self.ring.clone(),
                    ..PlanParams::new(r, self.p() as u32, 256)
                };
                plan_with(coll, DataType::F32, &params, Choice::of(Algo::Tree), hosts)
                    .expect("plan")
            })
            .collect()
    }
}

/// A message between hosts: sender, receiver, and the element offset of
/// what it carries.
struct Cross {
    from: usize,
    to: usize,
    elem: usize,
}

fn cross_host_messages(l: &Layout, progs: &[Program]) -> Vec<Cross> {
    let mut v = Vec::new();
    for (r, prog) in progs.iter().enumerate() {
        for op in &prog.ops {
            let Some(to) = op.send_peer() else { continue };
            let to = to as usize;
            if l.hosts[r] != l.hosts[to] {
                let reg = op.regions().next().expect("a region");
                v.push(Cross {
                    from: r,
                    to,
                    elem: reg.offset / 4,
                });
            }
        }
    }
    v
}

/// Messages between hosts whose ends have different local indices though
/// both hosts have both (a rail-aligned choice existed).
fn off_rail(l: &Layout, msgs: &[Cross]) -> Vec<String> {
    let (local, size) = l.local();
    msgs.iter()
        .filter(|m| {
            let (i, j) = (local[m.from], local[m.to]);
            i != j && i < size[m.to] && j < size[m.from]
        })
        .map(|m| {
            format!(
                "{} (host {}, local {}) -> {} (host {}, local {})",
                m.from, l.hosts[m.from], local[m.from], m.to, l.hosts[m.to], local[m.to]
            )
        })
        .collect()
}

fn layouts() -> Vec<Layout> {
    let mut v: Vec<Layout> = [
        &[2, 2][..],
        &[3, 3],
        &[4, 4, 4],
        &[8, 8, 8, 8],
        &[3, 2, 4],
        &[1, 3],
        &[4, 1, 2, 3, 5],
        &[6, 6, 6, 6, 6, 6, 6],
    ]
    .iter()
    .map(|s| Layout::blocks(s))
    .collect();
    v.push(Layout {
        ring: (0..8).collect(),
        hosts: (0..8).map(|r| r % 2).collect(),
    });
    v.push(Layout {
        ring: vec![5, 2, 7, 0, 3, 6, 1, 4, 8],
        hosts: vec![0, 1, 0, 2, 1, 2, 0, 1, 2],
    });
    v
}

fn allreduce(count: usize) -> Collective {
    Collective::AllReduce {
        count,
        op: RedOp::Sum,
    }
}

/// Double binary tree: tree 0 (the first half of the buffer) crosses hosts
/// on rail 0 only, tree 1 (the second half) on rail ⌊m_min/2⌋ only; with two
/// ranks or more on every host these are two rails, and at most two ranks
/// of a host use the network.
#[test]
fn double_binary_tree_crosses_hosts_on_two_rails() {
    for l in layouts() {
        let count = 4000;
        let progs = l.programs(&allreduce(count), &l.hosts);
        let msgs = cross_host_messages(&l, &progs);
        let name = format!("hosts={:?} ring={:?}", l.hosts, l.ring);
        assert!(!msgs.is_empty(), "{name}: no message between hosts");
        let bad = off_rail(&l, &msgs);
        assert!(bad.is_empty(), "{name}: off-rail messages: {bad:?}");
        let (local, size) = l.local();
        let m_min = *size.iter().min().unwrap();
        let h0 = count.div_ceil(2);
        for (t, rail) in [(0, 0), (1, m_min / 2)] {
            let rails: BTreeSet<(usize, usize)> = msgs
                .iter()
                .filter(|m| (m.elem >= h0) == (t == 1))
                .map(|m| (local[m.from], local[m.to]))
                .collect();
            assert_eq!(
                rails,
                BTreeSet::from([(rail, rail)]),
                "{name}: tree {t} crosses hosts on {rails:?}"
            );
        }
        let rails: BTreeSet<usize> = msgs.iter().map(|m| local[m.from]).collect();
        assert_eq!(
            rails.len(),
            if m_min >= 2 { 2 } else { 1 },
            "{name}: {rails:?}"
        );
        let mut users: HashMap<u32, BTreeSet<usize>> = HashMap::new();
        for m in &msgs {
            users.entry(l.hosts[m.from]).or_default().insert(m.from);
            users.entry(l.hosts[m.to]).or_default().insert(m.to);
        }
        assert!(
            users.values().all(|u| u.len() <= 2),
            "{name}: network users per host {users:?}"
        );
    }
}

/// Binomial Broadcast and Reduce from every root: every message between
/// hosts goes between the hosts' rail ranks — local index that of the root,
/// or a host's last rank where it has fewer ranks — and so one rank per
/// host uses the network.
#[test]
fn binomial_trees_cross_hosts_on_the_roots_rail() {
    for l in layouts() {
        let (local, size) = l.local();
        for root in 0..l.p() {
            let rail = local[root];
            for coll in [
                Collective::Broadcast {
                    count: 3000,
                    root: root as u32,
                },
                Collective::Reduce {
                    count: 3000,
                    op: RedOp::Sum,
                    root: root as u32,
                },
            ] {
                let name = format!(
                    "{} root={root} hosts={:?} ring={:?}",
                    coll.name(),
                    l.hosts,
                    l.ring
                );
                let progs = l.programs(&coll, &l.hosts);
                let msgs = cross_host_messages(&l, &progs);
                assert!(!msgs.is_empty(), "{name}: no message between hosts");
                let bad = off_rail(&l, &msgs);
                assert!(bad.is_empty(), "{name}: off-rail messages: {bad:?}");
                for m in &msgs {
                    for r in [m.from, m.to] {
                        assert_eq!(
                            local[r],
                            rail.min(size[r] - 1),
                            "{name}: rank {r} crosses hosts ({} -> {})",
                            m.from,
                            m.to
                        );
                    }
                }
            }
        }
    }
}

/// Where hosts do not matter the plans are the flat ones: no hosts, one
/// rank per host (any host indices), one host (the binomial trees; the
/// double binary tree too, unlike the hierarchical chain it would be).
#[test]
fn without_hosts_that_matter_the_plans_are_flat() {
    for p in [1usize, 2, 3, 5, 8, 12] {
        let l = Layout {
            ring: (0..p as u32).map(|i| (i * 5 + 1) % p as u32).collect(),
            hosts: Vec::new(),
        };
        let l = if (0..p as u32).all(|r| l.ring.contains(&r)) {
            l
        } else {
            Layout {
                ring: (0..p as u32).collect(),
                hosts: Vec::new(),
            }
        };
        let mut colls = vec![allreduce(1000)];
        for root in [0, p as u32 / 2, p as u32 - 1] {
            colls.push(Collective::Broadcast { count: 1000, root });
            colls.push(Collective::Reduce {
                count: 1000,
                op: RedOp::Sum,
                root,
            });
        }
        let one_each: Vec<u32> = (0..p as u32).map(|r| 100 + 3 * r).collect();
        let one_host = vec![7; p];
        for coll in &colls {
            let flat = l.programs(coll, &[]);
            assert_eq!(
                l.programs(coll, &one_each),
                flat,
                "{} p={p}: one rank per host",
                coll.name()
            );
            assert_eq!(
                l.programs(coll, &one_host),
                flat,
                "{} p={p}: one host",
                coll.name()
            );
        }
    }
}

/// The flat trees break the rule on these layouts (the check above can
/// fail): the double binary tree always, the binomial trees where a host's
/// rank count is not a power of two.
#[test]
fn the_flat_trees_are_not_rail_aligned() {
    for sizes in [&[2, 2][..], &[3, 3], &[4, 4, 4], &[3, 2, 4]] {
        let l = Layout::blocks(sizes);
        let flat = l.programs(&allreduce(4000), &[]);
        assert!(
            !off_rail(&l, &cross_host_messages(&l, &flat)).is_empty(),
            "{sizes:?}: the flat double binary tree"
        );
    }
    for sizes in [&[3, 3][..], &[3, 3, 3, 3], &[3, 2, 4]] {
        let l = Layout::blocks(sizes);
        let any_off = (0..l.p() as u32).any(|root| {
            let flat = l.programs(&Collective::Broadcast { count: 3000, root }, &[]);
            !off_rail(&l, &cross_host_messages(&l, &flat)).is_empty()
        });
        assert!(any_off, "{sizes:?}: the flat binomial Broadcast");
    }
}

/// With hosts, a head of the double binary tree may have three children (its
/// chain's next rank and two child hosts' heads): on 4 hosts of 8, host 2
/// is an inner node of the first tree, and its head receives each piece of
/// the first half from three peers in the up phase.
#[test]
fn a_head_reduces_three_children() {
    let l = Layout::blocks(&[8, 8, 8, 8]);
    let progs = l.programs(&allreduce(64), &l.hosts);
    // Host 2's head (local index 0) is rank 16; one piece per half.
    let reduces_from: BTreeSet<u32> = progs[16]
        .ops
        .iter()
        .filter(|op| {
            matches!(op, Op::RecvReduceCopy { .. } | Op::RecvReduceSend { .. })
                && op.regions().all(|r| r.offset < 32 * 4)
        })
        .filter_map(Op::recv_peer)
        .collect();
    assert_eq!(reduces_from, BTreeSet::from([17, 8, 24]));
}

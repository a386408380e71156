//! Every algorithm of `plan_with` (ring, direct, recursive doubling,
//! Rabenseifner, double binary tree, binomial trees, Bruck, hierarchical),
//! run by the in-memory simulator for 1..=64 ranks, counts that do not
//! divide by p, every datatype and operator, in and out of place, checked
//! against the independent reference, the volume each algorithm must move,
//! the piece size, and — for the algorithms that may send by reference —
//! that no rank rewrites a region before its receiver read it. Each case
//! runs twice, the ranks taking their turns forwards and backwards.

use braid_core::plan::{plan_with, Algo, Choice, CollKind, Collective, PlanParams, SCRATCH};
use braid_core::reference::{assert_elems_eq, gen, reduced, Kind, GARBAGE};
use braid_core::sim::{run_with, RankSetup, SimOptions};
use braid_core::{DataType, RedOp};

#[derive(Clone)]
struct Case {
    kind: Kind,
    choice: Choice,
    p: usize,
    count: usize,
    dt: DataType,
    op: RedOp,
    root: usize,
    in_place: bool,
    piece: usize,
    depth: usize,
    /// Host of each rank (empty: one per rank).
    hosts: Vec<u32>,
    /// Ring order (empty: identity).
    ring: Vec<u32>,
}

const MOVE_FACTOR: usize = 3;

impl Case {
    fn new(kind: Kind, algo: Algo, p: usize, count: usize) -> Case {
        Case {
            kind,
            choice: Choice::of(algo),
            p,
            count,
            dt: DataType::F32,
            op: RedOp::Sum,
            root: (p * 5 + 3) % p,
            in_place: false,
            piece: 64,
            depth: 2,
            hosts: Vec::new(),
            ring: Vec::new(),
        }
    }

    fn coll(&self) -> Collective {
        self.kind.collective(self.count, self.op, self.root as u32)
    }

    fn name(&self) -> String {
        format!(
            "{} {} p={} count={} {} {} root={} in_place={} piece={} depth={} hosts={:?} ring={:?}",
            self.choice,
            self.coll().name(),
            self.p,
            self.count,
            self.dt,
            self.op,
            self.root,
            self.in_place,
            self.piece,
            self.depth,
            self.hosts,
            self.ring
        )
    }

    fn run(&self) {
        for reverse in [false, true] {
            self.run_once(reverse);
        }
    }

    fn run_once(&self, reverse: bool) {
        let name = format!("{} reverse={reverse}", self.name());
        let (p, n, dt, op, es) = (self.p, self.count, self.dt, self.op, self.dt.size());
        let coll = self.coll();
        let counts = coll.buffer_counts(p as u32).unwrap();
        let inputs: Vec<Vec<u8>> = (0..p).map(|r| gen(dt, op, r, counts[0])).collect();
        let garbage = |len: usize| vec![GARBAGE; len * es];
        let setups: Vec<RankSetup> = (0..p)
            .map(|r| {
                let mut params = PlanParams::new(r as u32, p as u32, self.piece);
                params.move_piece_bytes = self.piece * MOVE_FACTOR;
                if !self.ring.is_empty() {
                    params.ring = self.ring.clone();
                }
                let program = plan_with(&coll, dt, &params, self.choice, &self.hosts)
                    .unwrap_or_else(|e| panic!("{name}: plan: {e}"));
                let (mut storages, mut buffers) = if !self.in_place {
                    (
                        vec![inputs[r].clone(), garbage(counts[1])],
                        vec![(0, 0), (1, 0)],
                    )
                } else {
                    match self.kind {
                        Kind::AllGather => {
                            let mut s = garbage(counts[1]);
                            s[r * n * es..(r + 1) * n * es].copy_from_slice(&inputs[r]);
                            (vec![s], vec![(0, r * n * es), (0, 0)])
                        }
                        Kind::ReduceScatter => {
                            (vec![inputs[r].clone()], vec![(0, 0), (0, r * n * es)])
                        }
                        _ => (vec![inputs[r].clone()], vec![(0, 0), (0, 0)]),
                    }
                };
                let scratch = program.scratch_bytes();
                if scratch > 0 {
                    buffers.push((storages.len(), 0));
                    storages.push(vec![GARBAGE; scratch]);
                }
                assert!(
                    program
                        .ops
                        .iter()
                        .all(|o| o.regions().all(|g| g.buf <= SCRATCH)),
                    "{name}: unknown buffer"
                );
                RankSetup {
                    program,
                    storages,
                    buffers,
                }
            })
            .collect();
        let opts = SimOptions {
            fifo_depth: self.depth,
            check_references: self.choice.single_copy_safe(),
            reverse,
        };
        let report = run_with(setups, opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let full_red = |len: usize, base: usize| reduced(dt, op, p, base, len);
        for r in 0..p {
            let st = &report.storages[r];
            let recv: &[u8] = if !self.in_place {
                &st[1]
            } else {
                match self.kind {
                    Kind::ReduceScatter => &st[0][r * n * es..(r + 1) * n * es],
                    _ => &st[0],
                }
            };
            let what = format!("{name}: rank {r}");
            match self.kind {
                Kind::AllReduce => assert_elems_eq(dt, op, recv, &full_red(n, 0), &what),
                Kind::ReduceScatter => assert_elems_eq(dt, op, recv, &full_red(n, r * n), &what),
                Kind::AllGather => assert_eq!(recv, &inputs.concat()[..], "{what}"),
                Kind::Broadcast => assert_eq!(recv, &inputs[self.root][..], "{what}"),
                Kind::Reduce => {
                    if r == self.root {
                        assert_elems_eq(dt, op, recv, &full_red(n, 0), &what)
                    } else if self.in_place {
                        assert_eq!(recv, &inputs[r][..], "{what}: non-root buffer changed");
                    } else {
                        assert!(
                            recv.iter().all(|&b| b == GARBAGE),
                            "{what}: non-root recv written"
                        );
                    }
                }
                Kind::AllToAll => unreachable!(),
            }
            if !self.in_place {
                assert_eq!(st[0], inputs[r], "{what}: send buffer changed");
            }
        }
        self.check_volume(&name, &report.bytes_sent);
        let limit = match self.kind {
            Kind::AllGather | Kind::Broadcast => self.piece * MOVE_FACTOR,
            _ => self.piece,
        };
        assert!(
            report.max_message <= limit,
            "{name}: message of {} above the piece",
            report.max_message
        );
    }

    fn check_volume(&self, name: &str, sent: &[u64]) {
        let p = self.p as u64;
        let bytes = (self.count * self.dt.size()) as u64;
        let total: u64 = sent.iter().sum();
        let core = |x: u64| {
            if x == 0 {
                0
            } else {
                1u64 << (63 - x.leading_zeros())
            }
        };
        // Recursive doubling over x ranks: the power-of-two core sends S per
        // step, the rest send S once and get S back.
        let rd =
            |x: u64| core(x) * core(x).trailing_zeros() as u64 * bytes + 2 * (x - core(x)) * bytes;
        let flat = |algo: Algo, x: u64| match algo {
            Algo::Rd => rd(x),
            _ => 2 * x.saturating_sub(1) * bytes,
        };
        match (self.kind, self.choice.algo) {
            (Kind::AllReduce, Algo::Hier) => {
                let h = if self.hosts.is_empty() {
                    p
                } else {
                    let mut hs = self.hosts.clone();
                    hs.sort_unstable();
                    hs.dedup();
                    hs.len() as u64
                };
                let inner = flat(self.choice.inner.unwrap_or(Algo::Ring), h);
                assert_eq!(total, 2 * (p - h) * bytes + inner, "{name}: total volume");
            }
            (Kind::AllReduce, a) => {
                assert_eq!(total, flat(a, p), "{name}: total volume");
                if a == Algo::Rabenseifner
                    && p.is_power_of_two()
                    && self.count.is_multiple_of(self.p)
                {
                    for (r, &s) in sent.iter().enumerate() {
                        assert_eq!(s, 2 * (p - 1) * bytes / p, "{name}: rank {r} sent");
                    }
                }
            }
            (Kind::ReduceScatter | Kind::AllGather, _) => {
                for (r, &s) in sent.iter().enumerate() {
                    assert_eq!(s, (p - 1) * bytes, "{name}: rank {r} sent");
                }
            }
            (Kind::Broadcast, _) => assert_eq!(total, (p - 1) * bytes, "{name}: volume"),
            (Kind::Reduce, Algo::Rabenseifner) => {
                // The reduce-scatter: the power-of-two core's pairs send
                // each range once per halving step, (p' − 1)·S in all; the
                // binomial gather: S/2 per step (blocks of equal size);
                // the ranks above p' fold S each into the core, and the
                // root gets S back if it is one of them.
                let pp = core(p);
                let pos = if self.ring.is_empty() {
                    self.root
                } else {
                    self.ring
                        .iter()
                        .position(|&r| r as usize == self.root)
                        .unwrap()
                };
                let root_extra = pos as u64 >= pp;
                if self.count.is_multiple_of(pp as usize) {
                    let want = (p - pp) * bytes
                        + (pp - 1) * bytes
                        + pp.trailing_zeros() as u64 * bytes / 2
                        + if root_extra { bytes } else { 0 };
                    assert_eq!(total, want, "{name}: total volume");
                    let root_sent = if root_extra {
                        bytes
                    } else {
                        (pp - 1) * bytes / pp
                    };
                    assert_eq!(sent[self.root], root_sent, "{name}: root sent");
                }
            }
            (Kind::Reduce, _) => {
                assert_eq!(sent[self.root], 0, "{name}: root sends nothing");
                assert_eq!(total, (p - 1) * bytes, "{name}: volume");
            }
            (Kind::AllToAll, _) => unreachable!(),
        }
    }
}

fn kind_of(k: CollKind) -> Kind {
    match k {
        CollKind::AllReduce => Kind::AllReduce,
        CollKind::ReduceScatter => Kind::ReduceScatter,
        CollKind::AllGather => Kind::AllGather,
        CollKind::Broadcast => Kind::Broadcast,
        CollKind::Reduce => Kind::Reduce,
    }
}

/// Every (algorithm, collective) pair, 1..=64 ranks, f32 sum, counts that
/// do and do not divide by p, one and several pieces, in and out of place.
#[test]
fn every_algorithm_1_to_64_ranks() {
    for algo in Algo::ALL {
        for &k in algo.collectives() {
            for p in (1..=24).chain([31, 32, 33, 48, 63, 64]) {
                for (i, count) in [0, 1, 7, 3 * p + 1, 200].into_iter().enumerate() {
                    let mut c = Case::new(kind_of(k), algo, p, count);
                    c.in_place = (i + p) % 2 == 1;
                    c.depth = 2 + (i % 2) * 2;
                    if algo == Algo::Hier {
                        c.hosts = (0..p as u32).map(|r| r / (1 + (i as u32 % 4))).collect();
                    }
                    c.run();
                }
            }
        }
    }
}

#[test]
fn every_datatype_and_operator() {
    for algo in Algo::ALL {
        for &k in algo.collectives() {
            if !matches!(
                k,
                CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce
            ) {
                continue;
            }
            for p in [1, 2, 3, 5, 8, 13] {
                for dt in DataType::ALL {
                    for op in RedOp::ALL {
                        for count in [1, 13, 100] {
                            let mut c = Case::new(kind_of(k), algo, p, count);
                            c.dt = dt;
                            c.op = op;
                            c.root = p / 2;
                            c.in_place = count == 13;
                            c.piece = 128;
                            if algo == Algo::Hier {
                                c.hosts = (0..p as u32).map(|r| r / 2).collect();
                            }
                            c.run();
                        }
                    }
                }
            }
        }
    }
}

/// Several pieces per step, deeper FIFOs, every root, a shuffled ring.
#[test]
fn many_pieces_every_root_and_a_shuffled_ring() {
    let ring: Vec<u32> = vec![5, 2, 7, 0, 3, 6, 1, 4, 8];
    for algo in Algo::ALL {
        for &k in algo.collectives() {
            for root in 0..ring.len() {
                if root > 0 && !matches!(k, CollKind::Broadcast | CollKind::Reduce) {
                    continue;
                }
                for depth in [2, 3] {
                    let mut c = Case::new(kind_of(k), algo, ring.len(), 4 * 1024 + 3);
                    c.dt = DataType::I32;
                    c.op = RedOp::Max;
                    c.root = root;
                    c.piece = 1024;
                    c.depth = depth;
                    c.ring = ring.clone();
                    c.in_place = root % 2 == 1;
                    if algo == Algo::Hier {
                        c.hosts = vec![0, 1, 0, 2, 1, 2, 0, 1, 2];
                    }
                    c.run();
                }
            }
        }
    }
}

/// The hierarchical AllReduce with every leaders' algorithm, hosts of
/// different sizes, ranks of a host adjacent or interleaved on the ring.
#[test]
fn hierarchical_with_every_leaders_algorithm() {
    for inner in [Algo::Ring, Algo::Rd, Algo::Rabenseifner, Algo::Tree] {
        for (p, hosts) in [
            (8, vec![0, 0, 0, 0, 1, 1, 1, 1]),
            (8, vec![0, 1, 0, 1, 0, 1, 0, 1]),
            (7, vec![0, 0, 0, 1, 1, 2, 3]),
            (12, (0..12).map(|r| r / 3).collect()),
            (16, (0..16).map(|r| r / 4).collect()),
            (5, vec![0; 5]),
            (6, (0..6).collect()),
        ] {
            for count in [1, 100, 1000] {
                for op in [RedOp::Sum, RedOp::Avg] {
                    let mut c = Case::new(Kind::AllReduce, Algo::Hier, p, count);
                    c.choice = Choice::hier(inner);
                    c.hosts = hosts.clone();
                    c.op = op;
                    c.in_place = count == 100;
                    c.run();
                }
            }
        }
    }
}

/// Host layouts for the rail-aligned trees: (ring, hosts), ranks of a host
/// adjacent on the ring (2×2, 2×3, 3×4, 4×8, uneven hosts, a host of one
/// rank, which leaves the double binary tree one rail) or not (hosts
/// interleaved on a shuffled ring).
fn tree_host_layouts() -> Vec<(Vec<u32>, Vec<u32>)> {
    let blocks = |sizes: &[u32]| -> Vec<u32> {
        sizes
            .iter()
            .enumerate()
            .flat_map(|(h, &m)| std::iter::repeat_n(h as u32, m as usize))
            .collect()
    };
    let ident = |p: usize| (0..p as u32).collect::<Vec<u32>>();
    let mut v: Vec<(Vec<u32>, Vec<u32>)> = [
        &[2, 2][..],
        &[3, 3],
        &[4, 4, 4],
        &[8, 8, 8, 8],
        &[3, 2, 4],
        &[1, 3],
        &[4, 1, 2, 3, 5],
        &[2, 2, 2, 2, 2],
    ]
    .iter()
    .map(|s| {
        let h = blocks(s);
        (ident(h.len()), h)
    })
    .collect();
    // Hosts interleaved on the ring, and a shuffled ring over 3 hosts of 3.
    v.push((ident(8), (0..8).map(|r| r % 2).collect()));
    v.push((
        vec![5, 2, 7, 0, 3, 6, 1, 4, 8],
        vec![0, 1, 0, 2, 1, 2, 0, 1, 2],
    ));
    // Host indices that are neither dense nor in ring order.
    v.push((ident(7), vec![9, 9, 4, 4, 4, 7, 7]));
    v
}

/// The tree algorithms with hosts (rail-aligned: `tree.rs`): AllReduce,
/// and Broadcast and Reduce from every root, on every layout of
/// [`tree_host_layouts`], for counts that do not divide by p and many
/// pieces, in and out of place, FIFOs of two and three slots, Sum, Avg,
/// Max.
#[test]
fn rail_aligned_trees_on_every_host_layout_and_root() {
    for (ring, hosts) in tree_host_layouts() {
        let p = ring.len();
        for k in [CollKind::AllReduce, CollKind::Broadcast, CollKind::Reduce] {
            let roots = if k == CollKind::AllReduce { 1 } else { p };
            for root in 0..roots {
                for (i, count) in [1, 7, 3 * p + 1, 1000].into_iter().enumerate() {
                    let mut c = Case::new(kind_of(k), Algo::Tree, p, count);
                    c.ring = ring.clone();
                    c.hosts = hosts.clone();
                    c.root = root;
                    c.op = [RedOp::Sum, RedOp::Avg, RedOp::Max][(i + root) % 3];
                    c.dt = if c.op == RedOp::Max {
                        DataType::I32
                    } else {
                        DataType::F32
                    };
                    c.in_place = (i + root) % 2 == 1;
                    c.depth = 2 + (i + root) % 2;
                    c.run();
                }
            }
        }
    }
}

/// The rail-aligned trees for every datatype and operator.
#[test]
fn rail_aligned_trees_every_datatype_and_operator() {
    for hosts in [vec![0, 0, 1, 1, 1], vec![0, 0, 0, 1, 1, 2, 2, 2, 2]] {
        let p = hosts.len();
        for k in [CollKind::AllReduce, CollKind::Reduce] {
            for dt in DataType::ALL {
                for op in RedOp::ALL {
                    for count in [1, 13, 100] {
                        let mut c = Case::new(kind_of(k), Algo::Tree, p, count);
                        c.hosts = hosts.clone();
                        c.dt = dt;
                        c.op = op;
                        c.root = (count + 1) % p;
                        c.in_place = count == 13;
                        c.piece = 128;
                        c.run();
                    }
                }
            }
        }
    }
}

#[test]
fn unsupported_pairs_and_bad_hosts_are_errors() {
    let params = PlanParams::new(0, 4, 1024);
    let ag = Collective::AllGather { send_count: 4 };
    let e = plan_with(&ag, DataType::F32, &params, Choice::of(Algo::Tree), &[]).unwrap_err();
    assert!(e.to_string().contains("tree cannot run allgather"), "{e}");
    let ar = Collective::AllReduce {
        count: 4,
        op: RedOp::Sum,
    };
    assert!(plan_with(&ar, DataType::F32, &params, Choice::of(Algo::Hier), &[0, 1]).is_err());
    // Groups and AllToAll ignore the choice.
    let a2a = Collective::AllToAll { count: 2 };
    assert!(plan_with(&a2a, DataType::F32, &params, Choice::of(Algo::Bruck), &[]).is_ok());
}

/// Determinism (docs/algorithms.md): with inputs whose sums round (random
/// f32), every AllReduce algorithm gives every rank the same bits, and the
/// same bits whichever order the ranks take their turns in (arrival order
/// never decides a bracketing). Different algorithms may differ.
#[test]
fn floating_point_results_are_the_same_bits_on_every_rank_and_schedule() {
    let p = 7usize;
    let n = 1000usize;
    let input = |r: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| {
                let x = ((r * 7919 + i * 104_729) % 1_000_003) as f32 / 997.0 + 1e-3 * i as f32;
                x.to_ne_bytes()
            })
            .collect()
    };
    let coll = Collective::AllReduce {
        count: n,
        op: RedOp::Sum,
    };
    let hosts: Vec<u32> = (0..p as u32).map(|r| r / 3).collect();
    for choice in [
        Choice::of(Algo::Ring),
        Choice::of(Algo::Rd),
        Choice::of(Algo::Rabenseifner),
        Choice::of(Algo::Tree),
        Choice::hier(Algo::Rabenseifner),
    ] {
        let mut seen: Option<Vec<u8>> = None;
        for reverse in [false, true] {
            for depth in [2, 5] {
                let setups = (0..p)
                    .map(|r| RankSetup {
                        program: plan_with(
                            &coll,
                            DataType::F32,
                            &PlanParams::new(r as u32, p as u32, 256),
                            choice,
                            &hosts,
                        )
                        .unwrap(),
                        storages: vec![input(r), vec![0; n * 4]],
                        buffers: vec![(0, 0), (1, 0)],
                    })
                    .collect();
                let opts = SimOptions {
                    fifo_depth: depth,
                    check_references: false,
                    reverse,
                };
                let rep = run_with(setups, opts).unwrap();
                for r in 0..p {
                    let got = &rep.storages[r][1];
                    match &seen {
                        None => seen = Some(got.clone()),
                        Some(s) => assert_eq!(
                            got, s,
                            "{choice}: rank {r}, reverse={reverse} depth={depth}"
                        ),
                    }
                }
            }
        }
    }
}

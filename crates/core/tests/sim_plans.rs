//! Every plan, run by the in-memory simulator for 1..=16 ranks, checked
//! against an independent reference (plain loops over f64 / i128) and against
//! the seed's volume formulas.

use braid_core::plan::{plan, Collective, P2p, P2pKind, PlanParams};
use braid_core::sim::{run, RankSetup};
use braid_core::{DataType, RedOp};

use braid_core::reference::{assert_elems_eq, gen, reduced, Kind, GARBAGE};

struct Case {
    kind: Kind,
    p: usize,
    count: usize,
    dt: DataType,
    op: RedOp,
    root: usize,
    in_place: bool,
    piece: usize,
    depth: usize,
    /// Recursive-doubling threshold (0: ring).
    small: usize,
    /// Plans for links that pass references ([`PlanParams::direct_moves`]).
    direct: bool,
}

/// Piece size for data-movement collectives in the simulated cases: a
/// different value from `piece` exercises plans whose two piece sizes differ.
const MOVE_PIECE_FACTOR: usize = 3;

impl Case {
    fn coll(&self) -> Collective {
        self.kind.collective(self.count, self.op, self.root as u32)
    }

    fn name(&self) -> String {
        format!(
            "{} p={} count={} {} {} root={} in_place={} piece={} depth={} direct={}",
            self.coll().name(),
            self.p,
            self.count,
            self.dt,
            self.op,
            self.root,
            self.in_place,
            self.piece,
            self.depth,
            self.direct
        )
    }

    fn run(&self) {
        let name = self.name();
        let (p, n, dt, op, es) = (self.p, self.count, self.dt, self.op, self.dt.size());
        let coll = self.coll();
        let counts = coll.buffer_counts(p as u32).unwrap();
        let inputs: Vec<Vec<u8>> = (0..p).map(|r| gen(dt, op, r, counts[0])).collect();
        let garbage = |len: usize| vec![GARBAGE; len * es];
        let setups: Vec<RankSetup> = (0..p)
            .map(|r| {
                let mut params = PlanParams::new(r as u32, p as u32, self.piece);
                params.small_allreduce_bytes = self.small;
                params.move_piece_bytes = self.piece * MOVE_PIECE_FACTOR;
                params.direct_moves = self.direct;
                let program =
                    plan(&coll, dt, &params).unwrap_or_else(|e| panic!("{name}: plan: {e}"));
                let (storages, buffers) = if !self.in_place {
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
                RankSetup {
                    program,
                    storages,
                    buffers,
                }
            })
            .collect();
        let report = run(setups, self.depth).unwrap_or_else(|e| panic!("{name}: {e}"));
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
                Kind::AllGather => {
                    let want: Vec<u8> = inputs.concat();
                    assert_eq!(recv, &want[..], "{what}");
                }
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
                Kind::AllToAll => {
                    let want: Vec<u8> = (0..p)
                        .flat_map(|q| inputs[q][r * n * es..(r + 1) * n * es].to_vec())
                        .collect();
                    assert_eq!(recv, &want[..], "{what}");
                }
            }
        }
        // Volumes: S is the full array (nccl-tests' convention).
        let pp = p as u64;
        let sent = &report.bytes_sent;
        let total: u64 = sent.iter().sum();
        let bytes = (n * es) as u64;
        match self.kind {
            Kind::AllReduce if n * es <= self.small.min(self.piece) && p > 1 => {
                // Recursive doubling: every rank of the power-of-two core
                // sends S per step; the others send S once and get S back.
                let core = 1u64 << (63 - pp.leading_zeros());
                let steps = core.trailing_zeros() as u64;
                let want = core * steps * bytes + 2 * (pp - core) * bytes;
                assert_eq!(total, want, "{name}: recursive-doubling volume");
            }
            Kind::AllReduce => {
                assert_eq!(
                    total,
                    2 * (pp - 1) * bytes,
                    "{name}: total AllReduce volume"
                );
                if n % p == 0 && (n / p) <= self.piece / es {
                    for (r, &s) in sent.iter().enumerate() {
                        assert_eq!(s, 2 * (pp - 1) * bytes / pp, "{name}: rank {r} sent");
                    }
                }
            }
            Kind::ReduceScatter | Kind::AllGather | Kind::AllToAll => {
                let s_full = bytes * pp;
                for (r, &s) in sent.iter().enumerate() {
                    assert_eq!(s, (pp - 1) * s_full / pp, "{name}: rank {r} sent");
                }
            }
            Kind::Broadcast => assert_eq!(total, (pp - 1) * bytes, "{name}: chain volume"),
            Kind::Reduce => {
                assert_eq!(sent[self.root], 0, "{name}: root sends nothing");
                assert_eq!(total, (pp - 1) * bytes, "{name}: chain volume");
            }
        }
        let limit = match self.kind {
            Kind::AllGather | Kind::Broadcast | Kind::AllToAll => self.piece * MOVE_PIECE_FACTOR,
            _ => self.piece,
        };
        assert!(
            report.max_message <= limit,
            "{name}: message above piece size"
        );
    }
}

#[test]
fn all_collectives_1_to_16_ranks_f32_sum() {
    for p in 1..=16 {
        for kind in Kind::ALL {
            for count in [0, 1, 7, 3 * p, 1023] {
                for in_place in [false, true] {
                    if in_place && kind == Kind::AllToAll {
                        continue;
                    }
                    for depth in [2, 4] {
                        Case {
                            kind,
                            p,
                            count,
                            dt: DataType::F32,
                            op: RedOp::Sum,
                            root: (p * 5 + 3) % p,
                            in_place,
                            piece: 64,
                            depth,
                            small: 0,
                            direct: false,
                        }
                        .run();
                    }
                }
            }
        }
    }
}

#[test]
fn reductions_every_datatype_and_op() {
    for p in [1, 2, 3, 5, 8] {
        for kind in [Kind::AllReduce, Kind::ReduceScatter, Kind::Reduce] {
            for dt in DataType::ALL {
                for op in RedOp::ALL {
                    for count in [1, 13, 100] {
                        Case {
                            kind,
                            p,
                            count,
                            dt,
                            op,
                            root: p / 2,
                            in_place: count == 13,
                            piece: 128,
                            depth: 2,
                            small: 0,
                            direct: false,
                        }
                        .run();
                    }
                }
            }
        }
    }
}

#[test]
fn many_loops_with_large_pieces_and_every_root() {
    for p in [2, 3, 4, 7] {
        for root in 0..p {
            for kind in Kind::ALL {
                Case {
                    kind,
                    p,
                    count: 4 * 1024 + 3,
                    dt: DataType::I32,
                    op: RedOp::Max,
                    root,
                    in_place: root % 2 == 1 && kind != Kind::AllToAll,
                    piece: 1024,
                    depth: 3,
                    small: 0,
                    direct: root % 2 == 0,
                }
                .run();
            }
        }
    }
}

#[test]
fn allreduce_divisible_counts_have_exact_per_rank_volume() {
    for p in 2..=16 {
        Case {
            kind: Kind::AllReduce,
            p,
            count: p * 16,
            dt: DataType::F32,
            op: RedOp::Sum,
            root: 0,
            in_place: false,
            piece: 16 * 4,
            depth: 2,
            small: 0,
            direct: false,
        }
        .run();
    }
}

#[test]
fn non_identity_ring_orders_give_the_same_results() {
    let p = 6u32;
    let ring = vec![3u32, 0, 5, 1, 4, 2];
    let n = 50usize;
    let coll = Collective::AllReduce {
        count: n,
        op: RedOp::Sum,
    };
    let inputs: Vec<Vec<u8>> = (0..p as usize)
        .map(|r| gen(DataType::I32, RedOp::Sum, r, n))
        .collect();
    let setups = (0..p)
        .map(|r| RankSetup {
            program: plan(
                &coll,
                DataType::I32,
                &PlanParams {
                    rank: r,
                    ring: ring.clone(),
                    piece_bytes: 64,
                    move_piece_bytes: 64,
                    small_allreduce_bytes: 0,
                    direct_moves: false,
                },
            )
            .unwrap(),
            storages: vec![inputs[r as usize].clone(), vec![0; n * 4]],
            buffers: vec![(0, 0), (1, 0)],
        })
        .collect();
    let report = run(setups, 2).unwrap();
    let want = reduced(DataType::I32, RedOp::Sum, p as usize, 0, n);
    for r in 0..p as usize {
        assert_eq!(report.storages[r][1], want, "rank {r}");
    }
    // AllGather blocks still land by rank, not by ring position.
    let coll = Collective::AllGather { send_count: 5 };
    let setups = (0..p)
        .map(|r| RankSetup {
            program: plan(
                &coll,
                DataType::U8,
                &PlanParams {
                    rank: r,
                    ring: ring.clone(),
                    piece_bytes: 64,
                    move_piece_bytes: 64,
                    small_allreduce_bytes: 0,
                    direct_moves: false,
                },
            )
            .unwrap(),
            storages: vec![vec![r as u8; 5], vec![0; 5 * p as usize]],
            buffers: vec![(0, 0), (1, 0)],
        })
        .collect();
    let report = run(setups, 2).unwrap();
    let want: Vec<u8> = (0..p as u8).flat_map(|r| vec![r; 5]).collect();
    for r in 0..p as usize {
        assert_eq!(report.storages[r][1], want, "AllGather rank {r}");
    }
}

/// A p2p group: every rank sends to the next two ranks and to itself, and
/// receives from the previous two and from itself, with sizes that differ
/// per pair, several transfers to the same peer, over FIFOs of one slot.
#[test]
fn point_to_point_groups() {
    for p in 1..=6usize {
        let size = |from: usize, to: usize, k: usize| 3 + (from * 31 + to * 7 + k * 13) % 200;
        let setups: Vec<RankSetup> = (0..p)
            .map(|r| {
                let mut ops = Vec::new();
                let mut storages = Vec::new();
                for k in 0..2 {
                    let to = (r + 1 + k) % p;
                    let n = size(r, to, k);
                    ops.push(P2p {
                        kind: P2pKind::Send,
                        peer: to as u32,
                        count: n,
                    });
                    storages.push((0..n).map(|i| (r * 100 + to * 10 + k + i) as u8).collect());
                    let from = (r + 2 * p - 1 - k) % p;
                    let n = size(from, r, k);
                    ops.push(P2p {
                        kind: P2pKind::Recv,
                        peer: from as u32,
                        count: n,
                    });
                    storages.push(vec![GARBAGE; n]);
                }
                let buffers = (0..storages.len()).map(|i| (i, 0)).collect();
                RankSetup {
                    program: plan(
                        &Collective::Group(ops),
                        DataType::U8,
                        &PlanParams::new(r as u32, p as u32, 64),
                    )
                    .unwrap(),
                    storages,
                    buffers,
                }
            })
            .collect();
        let report = run(setups, 1).unwrap_or_else(|e| panic!("p={p}: {e}"));
        for r in 0..p {
            for k in 0..2 {
                let from = (r + 2 * p - 1 - k) % p;
                let n = size(from, r, k);
                let want: Vec<u8> = (0..n)
                    .map(|i| (from * 100 + r * 10 + k + i) as u8)
                    .collect();
                assert_eq!(
                    report.storages[r][2 * k + 1],
                    want,
                    "p={p} rank {r} recv #{k} from {from}"
                );
            }
        }
    }
}

/// A barrier's plan carries every rank's token to every rank: with rank
/// `k`'s token the only non-zero one, every rank ends with it, for every
/// `k` — so no rank can finish before rank `k` started.
#[test]
fn barrier_reaches_every_rank_from_every_rank() {
    for p in 1..=16usize {
        for k in 0..p {
            let setups: Vec<RankSetup> = (0..p)
                .map(|r| RankSetup {
                    program: plan(
                        &Collective::Barrier,
                        DataType::U8,
                        &PlanParams::new(r as u32, p as u32, 64),
                    )
                    .unwrap(),
                    storages: vec![vec![u8::from(r == k)], vec![GARBAGE]],
                    buffers: vec![(0, 0), (1, 0)],
                })
                .collect();
            let report = run(setups, 1).unwrap_or_else(|e| panic!("p={p} k={k}: {e}"));
            for r in 0..p {
                assert_eq!(
                    report.storages[r][1],
                    vec![1],
                    "p={p}: rank {r} missed rank {k}"
                );
            }
        }
    }
}

#[test]
fn invalid_descriptions_are_rejected_before_planning() {
    let params = PlanParams::new(0, 4, 1024);
    let bad = [
        Collective::Broadcast { count: 4, root: 4 },
        Collective::Reduce {
            count: 4,
            op: RedOp::Sum,
            root: 9,
        },
        Collective::AllGather {
            send_count: usize::MAX / 2,
        },
        Collective::AllReduce {
            count: usize::MAX / 2,
            op: RedOp::Sum,
        },
        Collective::Group(vec![P2p {
            kind: P2pKind::Send,
            peer: 7,
            count: 1,
        }]),
        Collective::Group(vec![P2p {
            kind: P2pKind::Send,
            peer: 0,
            count: 1,
        }]),
    ];
    for c in bad {
        let err = plan(&c, DataType::F32, &params).expect_err(&format!("{c:?} accepted"));
        assert!(
            matches!(err, braid_core::CoreError::InvalidArgument(_)),
            "{c:?}: {err}"
        );
    }
    let dup = PlanParams {
        rank: 0,
        ring: vec![0, 1, 1],
        piece_bytes: 1024,
        move_piece_bytes: 1024,
        small_allreduce_bytes: 0,
        direct_moves: false,
    };
    assert!(plan(&Collective::AllGather { send_count: 1 }, DataType::U8, &dup).is_err());
}

#[test]
fn small_allreduce_by_recursive_doubling() {
    for p in 1..=16 {
        for dt in DataType::ALL {
            for op in RedOp::ALL {
                for count in [0, 1, 2, 5] {
                    Case {
                        kind: Kind::AllReduce,
                        p,
                        count,
                        dt,
                        op,
                        root: 0,
                        in_place: (count + p) % 2 == 0,
                        piece: 64,
                        depth: 2,
                        small: 64,
                        direct: false,
                    }
                    .run();
                }
            }
        }
    }
}

#[test]
fn direct_all_gather_and_broadcast_read_from_the_owner() {
    for p in 1..=9 {
        for kind in [Kind::AllGather, Kind::Broadcast] {
            for count in [0, 1, 7, 3 * p, 1023] {
                for in_place in [false, true] {
                    for depth in [2, 4] {
                        Case {
                            kind,
                            p,
                            count,
                            dt: DataType::U8,
                            op: RedOp::Sum,
                            root: (p * 5 + 3) % p,
                            in_place,
                            piece: 64,
                            depth,
                            small: 0,
                            direct: true,
                        }
                        .run();
                    }
                }
            }
        }
    }
}

#[test]
fn direct_plans_take_one_stage_and_read_from_the_owner() {
    // What makes them direct: no relay (every receive names the block's
    // owner) and one stage, so no rank waits on a rank behind it.
    let p = 4u32;
    let all_gather = |params: &PlanParams| {
        plan(
            &Collective::AllGather { send_count: 100 },
            DataType::U8,
            params,
        )
        .unwrap()
    };
    for r in 0..p {
        let mut params = PlanParams::new(r, p, 64);
        params.direct_moves = true;
        let ag = all_gather(&params);
        assert_eq!(ag.stage_ends.len(), 1, "AllGather rank {r}");
        for op in &ag.ops {
            if let braid_core::plan::Op::Recv { from, dst } = *op {
                assert_eq!(
                    dst.offset / 100,
                    from as usize,
                    "rank {r}: block from its owner"
                );
            }
        }
        let bc = plan(
            &Collective::Broadcast {
                count: 100,
                root: 1,
            },
            DataType::U8,
            &params,
        )
        .unwrap();
        assert_eq!(bc.stage_ends.len(), 1, "Broadcast rank {r}");
        assert!(bc
            .ops
            .iter()
            .all(|op| op.recv_peer().is_none_or(|f| f == 1)));
        let sends = bc.ops.iter().filter(|op| op.send_peer().is_some()).count();
        assert_eq!(sends, if r == 1 { 6 } else { 0 }, "rank {r}: sends");
        // Two ranks keep the ring plan.
        let mut two = PlanParams::new(r % 2, 2, 64);
        two.direct_moves = true;
        assert_eq!(all_gather(&two), all_gather(&PlanParams::new(r % 2, 2, 64)));
    }
}

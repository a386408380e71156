//! The stream-mode schedules of every collective, run by the in-memory
//! stream simulator in several interleavings, checked against the
//! independent reference (plain loops) — results, freedom from deadlock with
//! two slots per link, the protocol (no slot reused before it was consumed,
//! none read before it was posted), counters that wrap around, and several
//! collectives back to back on one cursor.

use braid_core::plan::{plan, Collective, PlanParams};
use braid_core::reference::{assert_elems_eq, gen, gen_at, reduced, Kind, GARBAGE};
use braid_core::{DataType, RedOp};
use braid_cuda::schedule::{schedule, simulate, Cmd, Cursor, Interleave, Links, Loc, SimRank};

/// Element offset of repetition `i`'s inputs in the generator (so that
/// back-to-back collectives move different data).
fn rep_base(i: usize) -> usize {
    i * 1_000_003
}

struct Case {
    kind: Kind,
    p: u32,
    count: usize,
    dt: DataType,
    op: RedOp,
    root: u32,
    slots: u32,
    piece: usize,
    small: usize,
    /// Collectives run back to back on the same cursors.
    repeat: usize,
    /// Pieces already moved on every link (counter wrap-around).
    start: u64,
}

/// Move a command's buffer indices by `by` (repetition `i` uses buffers
/// 2i and 2i + 1).
fn shift(cmd: Cmd, by: u16) -> Cmd {
    let s = |l: Loc| match l {
        Loc::Buf { buf, offset } => Loc::Buf {
            buf: buf + by,
            offset,
        },
        other => other,
    };
    match cmd {
        Cmd::Copy { dst, src, len } => Cmd::Copy {
            dst: s(dst),
            src: s(src),
            len,
        },
        Cmd::Reduce { dst, a, b, len } => Cmd::Reduce {
            dst: s(dst),
            a: s(a),
            b: s(b),
            len,
        },
        Cmd::Divide { dst, len } => Cmd::Divide { dst: s(dst), len },
        other => other,
    }
}

impl Case {
    fn run(&self, order: Interleave) {
        let (p, n, dt, op) = (self.p as usize, self.count, self.dt, self.op);
        let es = dt.size();
        let c = self.kind.collective(n, op, self.root);
        let counts = c.buffer_counts(self.p).unwrap();
        let name = format!(
            "{} p={p} n={n} {dt} {op} root={} slots={} piece={} small={} start={} {order:?}",
            c.name(),
            self.root,
            self.slots,
            self.piece,
            self.small,
            self.start
        );
        let links: Vec<Links> = (0..self.p)
            .map(|r| Links::uniform(r, self.p, self.slots, self.piece.max(4096)))
            .collect();
        let mut cursors: Vec<Cursor> = (0..p).map(|_| Cursor::at(self.p, self.start)).collect();
        let mut ranks: Vec<SimRank> = Vec::new();
        let mut inputs: Vec<Vec<Vec<u8>>> = Vec::new();
        for r in 0..p {
            let mut params = PlanParams::new(r as u32, self.p, self.piece);
            params.small_allreduce_bytes = self.small;
            let prog = plan(&c, dt, &params).unwrap_or_else(|e| panic!("{name}: {e}"));
            let mut cmds = Vec::new();
            let mut storages = Vec::new();
            let mut mine = Vec::new();
            for i in 0..self.repeat {
                let part = schedule(&prog, &links[r], &mut cursors[r])
                    .unwrap_or_else(|e| panic!("{name}: schedule: {e}"));
                cmds.extend(part.into_iter().map(|c| shift(c, 2 * i as u16)));
                // Fresh inputs per repetition; the receive buffer poisoned.
                let input = gen_at(dt, op, r, rep_base(i), counts[0]);
                storages.push(input.clone());
                storages.push(vec![GARBAGE; counts[1] * es]);
                mine.push(input);
            }
            inputs.push(mine);
            ranks.push(SimRank {
                cmds,
                storages,
                buffers: (0..2 * self.repeat).map(|b| (b, 0)).collect(),
                reduction: prog
                    .dtype
                    .zip(prog.red_op)
                    .map(|(d, o)| (d, o, prog.divisor)),
            });
        }
        let (out, counters) =
            simulate(ranks, &links, order, self.start).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Both ends of every link agree on the pieces it moved.
        for (from, to, posted, freed) in counters {
            assert_eq!(posted, freed, "{name}: link {from}->{to}");
            assert_eq!(
                posted, cursors[from as usize].sent[to as usize] as u32,
                "{name}"
            );
            assert_eq!(
                posted, cursors[to as usize].recvd[from as usize] as u32,
                "{name}"
            );
        }
        for i in 0..self.repeat {
            let full = |len: usize, base: usize| reduced(dt, op, p, rep_base(i) + base, len);
            for (r, st) in out.iter().enumerate() {
                let recv = &st[2 * i + 1];
                let what = format!("{name}: rank {r}, collective {i}");
                match self.kind {
                    Kind::AllReduce => assert_elems_eq(dt, op, recv, &full(n, 0), &what),
                    Kind::ReduceScatter => assert_elems_eq(dt, op, recv, &full(n, r * n), &what),
                    Kind::AllGather => {
                        let want: Vec<u8> = (0..p).flat_map(|q| inputs[q][i].clone()).collect();
                        assert_eq!(recv, &want, "{what}");
                    }
                    Kind::Broadcast => {
                        assert_eq!(recv, &inputs[self.root as usize][i], "{what}")
                    }
                    Kind::Reduce => {
                        if r == self.root as usize {
                            assert_elems_eq(dt, op, recv, &full(n, 0), &what)
                        } else {
                            assert!(recv.iter().all(|&b| b == GARBAGE), "{what}");
                        }
                    }
                    Kind::AllToAll => {
                        let want: Vec<u8> = (0..p)
                            .flat_map(|q| inputs[q][i][r * n * es..(r + 1) * n * es].to_vec())
                            .collect();
                        assert_eq!(recv, &want, "{what}");
                    }
                }
            }
        }
    }
}

const ORDERS: [Interleave; 4] = [
    Interleave::Greedy,
    Interleave::RoundRobin,
    Interleave::Random(7),
    Interleave::Random(0x5eed),
];

#[test]
fn every_collective_two_slots_every_interleaving() {
    for kind in Kind::ALL {
        for p in 1..=5u32 {
            for order in ORDERS {
                Case {
                    kind,
                    p,
                    count: 1000 + p as usize,
                    dt: DataType::F32,
                    op: RedOp::Sum,
                    root: p / 2,
                    slots: 2,
                    piece: 256,
                    small: 0,
                    repeat: 1,
                    start: 0,
                }
                .run(order);
            }
        }
    }
}

#[test]
fn operators_datatypes_and_avg() {
    for (dt, op) in [
        (DataType::F32, RedOp::Avg),
        (DataType::F16, RedOp::Max),
        (DataType::Bf16, RedOp::Min),
        (DataType::I32, RedOp::Prod),
        (DataType::U8, RedOp::Sum),
        (DataType::F64, RedOp::Avg),
    ] {
        for kind in [Kind::AllReduce, Kind::ReduceScatter, Kind::Reduce] {
            Case {
                kind,
                p: 4,
                count: 777,
                dt,
                op,
                root: 3,
                slots: 3,
                piece: 512,
                small: 0,
                repeat: 1,
                start: 0,
            }
            .run(Interleave::Random(11));
        }
    }
}

#[test]
fn back_to_back_collectives_deep_fifos_and_counter_wrap() {
    for kind in Kind::ALL {
        for (slots, start) in [(2, u32::MAX as u64 - 5), (8, 0), (3, (1u64 << 32) - 1)] {
            Case {
                kind,
                p: 3,
                count: 2000,
                dt: DataType::I32,
                op: RedOp::Sum,
                root: 1,
                slots,
                piece: 1024,
                small: 0,
                repeat: 3,
                start,
            }
            .run(Interleave::Random(start ^ slots as u64));
        }
    }
}

#[test]
fn small_allreduce_recursive_doubling() {
    for p in [2u32, 3, 4, 5, 8] {
        Case {
            kind: Kind::AllReduce,
            p,
            count: 64,
            dt: DataType::F32,
            op: RedOp::Sum,
            root: 0,
            slots: 2,
            piece: 4096,
            small: 1 << 20,
            repeat: 2,
            start: 0,
        }
        .run(Interleave::Greedy);
    }
}

/// The simulator catches a schedule that skips a wait: without rank 0's
/// first WaitPosted, rank 0 (run first) reads a slot nothing was posted to.
#[test]
fn a_missing_wait_is_caught() {
    let p = 2u32;
    let c = Collective::AllReduce {
        count: 4096,
        op: RedOp::Sum,
    };
    let links: Vec<Links> = (0..p).map(|r| Links::uniform(r, p, 2, 4096)).collect();
    let mut ranks = Vec::new();
    for r in 0..p {
        let prog = plan(&c, DataType::F32, &PlanParams::new(r, p, 1024)).unwrap();
        let mut cmds = schedule(&prog, &links[r as usize], &mut Cursor::new(p)).unwrap();
        if r == 0 {
            let i = cmds
                .iter()
                .position(|c| matches!(c, Cmd::WaitPosted { .. }))
                .unwrap();
            cmds.remove(i);
        }
        ranks.push(SimRank {
            cmds,
            storages: vec![
                gen(DataType::F32, RedOp::Sum, r as usize, 4096),
                vec![0; 4 * 4096],
            ],
            buffers: vec![(0, 0), (1, 0)],
            reduction: Some((DataType::F32, RedOp::Sum, 1)),
        });
    }
    // Greedy runs rank 0 first, until it blocks: it reaches the read of
    // rank 1's first piece before rank 1 ran at all.
    let e = simulate(ranks, &links, Interleave::Greedy, 0)
        .expect_err("a schedule without its first wait went through unnoticed")
        .to_string();
    assert!(e.contains("before piece"), "{e}");
}

/// Point-to-point groups (what `braid-perf sendrecv` runs on the GPU, and
/// all-pairs exchanges with a different count per pair): every stage of a
/// group holds one piece of every transfer, so this is where the stream's
/// serialisation in rounds matters.
#[test]
fn point_to_point_groups() {
    use braid_core::plan::{P2p, P2pKind};
    let count = |from: u32, to: u32| 100 + 37 * from as usize + 11 * to as usize;
    for p in 1..=5u32 {
        for all_pairs in [false, true] {
            for order in ORDERS {
                let links: Vec<Links> = (0..p).map(|r| Links::uniform(r, p, 2, 4096)).collect();
                let mut ranks = Vec::new();
                let mut groups = Vec::new();
                for r in 0..p {
                    let peers: Vec<u32> = if all_pairs {
                        (0..p).filter(|&q| q != r).collect()
                    } else {
                        vec![(r + 1) % p]
                    };
                    let mut ops = Vec::new();
                    for &q in &peers {
                        ops.push(P2p {
                            kind: P2pKind::Send,
                            peer: q,
                            count: count(r, q),
                        });
                    }
                    let froms: Vec<u32> = if all_pairs {
                        (0..p).filter(|&q| q != r).collect()
                    } else {
                        vec![(r + p - 1) % p]
                    };
                    for &q in &froms {
                        ops.push(P2p {
                            kind: P2pKind::Recv,
                            peer: q,
                            count: count(q, r),
                        });
                    }
                    let prog = plan(
                        &Collective::Group(ops.clone()),
                        DataType::I32,
                        &PlanParams::new(r, p, 256),
                    )
                    .unwrap();
                    let cmds = schedule(&prog, &links[r as usize], &mut Cursor::new(p))
                        .unwrap_or_else(|e| panic!("p={p}: {e}"));
                    let storages: Vec<Vec<u8>> = ops
                        .iter()
                        .map(|o| match o.kind {
                            P2pKind::Send => gen_at(
                                DataType::I32,
                                RedOp::Sum,
                                r as usize,
                                1000 * o.peer as usize,
                                o.count,
                            ),
                            P2pKind::Recv => vec![GARBAGE; 4 * o.count],
                        })
                        .collect();
                    ranks.push(SimRank {
                        cmds,
                        buffers: (0..storages.len()).map(|b| (b, 0)).collect(),
                        storages,
                        reduction: None,
                    });
                    groups.push(ops);
                }
                let (out, _) = simulate(ranks, &links, order, 0)
                    .unwrap_or_else(|e| panic!("p={p} all_pairs={all_pairs} {order:?}: {e}"));
                for r in 0..p {
                    for (i, o) in groups[r as usize].iter().enumerate() {
                        if o.kind == P2pKind::Recv && o.peer != r {
                            let want = gen_at(
                                DataType::I32,
                                RedOp::Sum,
                                o.peer as usize,
                                1000 * r as usize,
                                o.count,
                            );
                            assert_eq!(
                                out[r as usize][i], want,
                                "p={p} all_pairs={all_pairs} {order:?}: rank {r} from {}",
                                o.peer
                            );
                        }
                    }
                }
            }
        }
    }
}

//! The links a program uses ([`Program::peers`]): what the runtime connects
//! on first use. Both ends of every link must agree that an operation uses
//! it (rank a sends to b exactly when b receives from a), or a rank would
//! wait for a peer that never connects; and the default collectives must
//! stay on the ring neighbours and the recursive-doubling partners, which
//! is all a communicator connects at creation.

use braid_core::plan::{plan, Collective, PlanParams, Program};
use braid_core::{DataType, RedOp};

fn programs(coll: &Collective, p: u32, small: usize, direct: bool) -> Vec<Program> {
    // A ring that is not the identity, as the topology planner makes them.
    let ring: Vec<u32> = (0..p).map(|i| (i * 3 + 1) % p).collect();
    let ring = if (0..p).all(|r| ring.contains(&r)) {
        ring
    } else {
        (0..p).collect()
    };
    (0..p)
        .map(|r| {
            let params = PlanParams {
                ring: ring.clone(),
                small_allreduce_bytes: small,
                direct_moves: direct,
                move_piece_bytes: 8192,
                ..PlanParams::new(r, p, 4096)
            };
            plan(coll, DataType::F32, &params).expect("plan")
        })
        .collect()
}

#[test]
fn both_ends_of_every_link_agree_that_it_is_used() {
    for p in 1..=12u32 {
        let mut colls = vec![
            Collective::AllReduce {
                count: 3,
                op: RedOp::Sum,
            },
            Collective::AllReduce {
                count: 100_000,
                op: RedOp::Sum,
            },
            Collective::ReduceScatter {
                recv_count: 5000,
                op: RedOp::Max,
            },
            Collective::AllGather { send_count: 7 },
            Collective::AllToAll { count: 3 },
            Collective::Barrier,
        ];
        for root in [0, p / 2, p - 1] {
            colls.push(Collective::Broadcast { count: 9000, root });
            colls.push(Collective::Reduce {
                count: 9000,
                op: RedOp::Sum,
                root,
            });
        }
        for coll in &colls {
            for (small, direct) in [(0, false), (16384, false), (16384, true)] {
                let progs = programs(coll, p, small, direct);
                let peers: Vec<(Vec<u32>, Vec<u32>)> = progs.iter().map(Program::peers).collect();
                for (a, (send, recv)) in peers.iter().enumerate() {
                    let a = a as u32;
                    assert!(!send.contains(&a) && !recv.contains(&a), "{coll:?} p={p}");
                    for &b in send {
                        assert!(
                            peers[b as usize].1.contains(&a),
                            "{coll:?} p={p} small={small} direct={direct}: rank {a} sends to {b}, which does not receive from it"
                        );
                    }
                    for &b in recv {
                        assert!(
                            peers[b as usize].0.contains(&a),
                            "{coll:?} p={p}: rank {a} receives from {b}, which does not send to it"
                        );
                    }
                }
            }
        }
    }
}

/// The ring AllReduce uses one link out (to the next rank on the ring) and
/// one in; recursive doubling log2(p) partners and the ring's fold-in; so a
/// communicator connects O(log p) links per rank at creation, not p − 1.
#[test]
fn default_collectives_use_few_links() {
    for p in [2u32, 3, 8, 13, 32, 48, 128] {
        let large = Collective::AllReduce {
            count: 1 << 20,
            op: RedOp::Sum,
        };
        let small = Collective::AllReduce {
            count: 2,
            op: RedOp::Sum,
        };
        let log = 32 - (p - 1).leading_zeros();
        for (r, prog) in programs(&large, p, 16384, false).iter().enumerate() {
            let (send, recv) = prog.peers();
            assert_eq!((send.len(), recv.len()), (1, 1), "p={p} rank {r}");
        }
        for coll in [small, Collective::Barrier] {
            for (r, prog) in programs(&coll, p, 16384, false).iter().enumerate() {
                let (send, recv) = prog.peers();
                assert!(
                    send.len() as u32 <= log + 1 && recv.len() as u32 <= log + 1,
                    "{coll:?} p={p} rank {r}: {send:?} {recv:?}"
                );
            }
        }
    }
}

/// A small AllToAll (blocks up to 1 KiB) is one op per stage, in the
/// pairwise order (sends to `rank + s`, our own copy, receives from
/// `rank − s`), so the host engine's small-message fast path runs it; a
/// larger one stays one stage, where the executor moves whichever piece is
/// ready (a rank's sends through slots must not wait for its receives).
#[test]
fn small_alltoall_is_one_op_per_stage_and_large_one_stage() {
    use braid_core::plan::Op;
    for p in 2..=6u32 {
        for (count, small) in [(1usize, true), (256, true), (257, false), (100_000, false)] {
            for r in 0..p {
                let prog = plan(
                    &Collective::AllToAll { count },
                    DataType::F32,
                    &PlanParams::new(r, p, 4096),
                )
                .expect("plan");
                if small {
                    assert_eq!(prog.stage_ends.len(), prog.ops.len(), "p={p} count={count}");
                    let want: Vec<String> = (1..p)
                        .map(|s| format!("send {}", (r + s) % p))
                        .chain(std::iter::once("copy".to_string()))
                        .chain((1..p).map(|s| format!("recv {}", (r + p - s) % p)))
                        .collect();
                    let got: Vec<String> = prog
                        .ops
                        .iter()
                        .map(|op| match op {
                            Op::Send { to, .. } => format!("send {to}"),
                            Op::Recv { from, .. } => format!("recv {from}"),
                            Op::Copy { .. } => "copy".to_string(),
                            other => format!("{other:?}"),
                        })
                        .collect();
                    assert_eq!(got, want, "p={p} r={r} count={count}");
                } else {
                    assert_eq!(prog.stage_ends.len(), 1, "p={p} count={count}");
                }
            }
        }
    }
}

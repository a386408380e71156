//! Exploration (work in progress).

use braid_core::plan::{plan_with, Algo, Choice, CollKind, Collective, PlanParams};
use braid_core::sim::clock::{run, Link, Machine};
use braid_core::{DataType, RedOp};

fn coll(kind: CollKind, bytes: usize, p: usize) -> Collective {
    let n = (bytes / 4).max(1);
    match kind {
        CollKind::AllReduce => Collective::AllReduce {
            count: n,
            op: RedOp::Sum,
        },
        CollKind::ReduceScatter => Collective::ReduceScatter {
            recv_count: (n / p).max(1),
            op: RedOp::Sum,
        },
        CollKind::AllGather => Collective::AllGather {
            send_count: (n / p).max(1),
        },
        CollKind::Broadcast => Collective::Broadcast { count: n, root: 0 },
        CollKind::Reduce => Collective::Reduce {
            count: n,
            op: RedOp::Sum,
            root: 0,
        },
    }
}

fn time(m: &Machine, kind: CollKind, choice: Choice, bytes: usize, piece: usize) -> f64 {
    let p = m.nranks();
    let c = coll(kind, bytes, p);
    let hosts = m.hosts.clone();
    run(m, |r| {
        let params = PlanParams::new(r, p as u32, piece);
        plan_with(&c, DataType::F32, &params, choice, &hosts)
    })
    .unwrap()
    .time_us
}

#[test]
#[ignore]
fn explore() {
    let net = Link {
        latency_us: 5.0,
        gbps: 12.5,
        overhead_us: 1.0,
    };
    let shm = Link {
        latency_us: 0.5,
        gbps: 20.0,
        overhead_us: 0.2,
    };
    let sizes = [8usize, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];
    for ppn in [1usize, 8] {
        for h in [2usize, 4, 8, 16, 64, 256] {
            let m = Machine::uniform(h, ppn, shm, net);
            let piece = if ppn > 1 { 128 << 10 } else { 512 << 10 };
            for kind in [CollKind::AllReduce] {
                for &b in &sizes {
                    let t0 = std::time::Instant::now();
                    let mut line = format!("{kind} h={h} ppn={ppn} bytes={b}:");
                    for algo in kind.algorithms() {
                        let choice = if algo == Algo::Hier {
                            Choice::hier(Algo::Ring)
                        } else {
                            Choice::of(algo)
                        };
                        line += &format!(" {choice}={:.1}", time(&m, kind, choice, b, piece));
                    }
                    println!("{line}  ({:.2}s)", t0.elapsed().as_secs_f64());
                }
            }
        }
    }
}

#[test]
#[ignore]
fn tiny() {
    let net = Link {
        latency_us: 5.0,
        gbps: 12.5,
        overhead_us: 1.0,
    };
    let m = Machine::uniform(2, 1, net, net);
    for algo in CollKind::AllReduce.algorithms() {
        println!("{algo}: start");
        println!(
            "{algo}: {}",
            time(&m, CollKind::AllReduce, Choice::of(algo), 1024, 4096)
        );
    }
}

#[test]
#[ignore]
fn compare() {
    use braid_core::tune::{candidates, estimate, Costs, Shape};
    let net = Link {
        latency_us: 5.0,
        gbps: 12.5,
        overhead_us: 1.0,
    };
    let shm = Link {
        latency_us: 0.5,
        gbps: 20.0,
        overhead_us: 0.2,
    };
    let sizes = [8usize, 1 << 10, 64 << 10, 1 << 20, 16 << 20];
    let mut bad = 0;
    let emu = Link {
        latency_us: 500.0,
        gbps: 0.025,
        overhead_us: 20.0,
    };
    for (net, hs, ppns) in [
        (net, &[2usize, 4, 8, 16, 64, 256][..], &[1usize, 8][..]),
        (emu, &[2, 4, 8, 16][..], &[1, 4][..]),
    ] {
        for &ppn in ppns {
            for &h in hs {
                if std::env::var("SKIP_BIG").is_ok() && h * ppn > 256 {
                    continue;
                }
                let m = Machine::uniform(h, ppn, shm, net);
                let piece = if ppn > 1 { 128 << 10 } else { 512 << 10 };
                let shape = Shape::uniform(h, ppn, piece);
                let costs = Costs::of_machine(&m);
                for kind in CollKind::ALL {
                    for &b in &sizes {
                        let mut line = format!("{kind} h={h} ppn={ppn} bytes={b}:");
                        let mut rows = Vec::new();
                        for c in candidates(kind, &shape) {
                            let sim = time(&m, kind, c, b, piece);
                            let est = estimate(&costs, &shape, kind, c, b);
                            rows.push((c, sim, est));
                            line += &format!(" {c}={sim:.0}/{:.2}", est / sim);
                        }
                        let best = rows.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
                        let pick = rows
                            .iter()
                            .min_by(|a, b| a.2.partial_cmp(&b.2).unwrap())
                            .unwrap();
                        let ok = pick.1 <= 1.1 * best;
                        if !ok {
                            bad += 1;
                        }
                        println!("{line} pick={} {}", pick.0, if ok { "ok" } else { "BAD" });
                    }
                }
            }
        }
    }
    println!("bad cells: {bad}");
}

#[test]
#[ignore]
fn bcast_probe() {
    let net = Link {
        latency_us: 5.0,
        gbps: 12.5,
        overhead_us: 1.0,
    };
    let shm = Link {
        latency_us: 0.5,
        gbps: 20.0,
        overhead_us: 0.2,
    };
    for (h, ppn) in [(4, 8), (32, 1), (1, 32)] {
        let m = Machine::uniform(h, ppn, shm, net);
        for piece in [128usize << 10, 1 << 20] {
            for algo in [Algo::Tree, Algo::Ring, Algo::Direct] {
                println!(
                    "h={h} ppn={ppn} piece={piece} {algo}: {:.0}",
                    time(&m, CollKind::Broadcast, Choice::of(algo), 1 << 20, piece)
                );
            }
        }
    }
}

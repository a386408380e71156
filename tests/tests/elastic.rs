//! Elastic communicators on ranks that are threads of this process: shrink
//! after a rank left in the middle of an operation, revoke (pending and
//! idle ranks), grow with new ranks, and the errors of each. The same with
//! processes killed for real is in `faults.rs` (`elastic_matrix`).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use braid::{Communicator, Config, ErrorKind, RedOp};

fn config(secs: f64) -> Config {
    Config {
        timeout: Duration::from_secs_f64(secs),
        abort: None,
    }
}

/// Runs `f(rank's communicator, shared barrier)` on every rank of an
/// `n`-rank communicator, one thread each.
fn on_ranks<R: Send + 'static>(
    n: u32,
    timeout: f64,
    f: impl Fn(Communicator, Arc<Barrier>) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let comms = Communicator::init_threads(n, &config(timeout)).expect("init_threads");
    let bar = Arc::new(Barrier::new(n as usize));
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let (f, bar) = (f.clone(), bar.clone());
            std::thread::spawn(move || f(c, bar))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// AllReduce of each rank's `tag`: the plain sum over `tags`.
fn check_sum(c: &Communicator, tag: u64, tags: &[u64]) {
    let mut v = vec![tag; 1000];
    c.all_reduce_in_place(&mut v, RedOp::Sum)
        .unwrap_or_else(|e| panic!("rank {}: {e}", c.rank()));
    let want: u64 = tags.iter().sum();
    assert!(
        v.iter().all(|&x| x == want),
        "rank {}: {} != {want}",
        c.rank(),
        v[0]
    );
}

#[test]
fn shrink_after_a_rank_left_mid_operation() {
    // Rank 2 aborts and leaves while the others wait for it in an
    // AllReduce; they fail, find it gone, shrink it out and go on.
    let out = on_ranks(4, 20.0, |c, bar| {
        let r = c.rank();
        if r == 2 {
            c.abort();
            drop(c);
            bar.wait();
            return None;
        }
        let mut v = vec![1u32; 64 << 10];
        let e = c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::PeerFailed | ErrorKind::Timeout),
            "rank {r}: {e}"
        );
        bar.wait();
        let gone = c.gone_ranks().unwrap();
        assert_eq!(gone, vec![2], "rank {r}");
        let t0 = Instant::now();
        let s = c.shrink(&gone).unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(s.nranks(), 3);
        assert_eq!(s.rank(), if r < 2 { r } else { r - 1 });
        // The new ranks' sum: old ranks 0, 1, 3 contribute old rank + 1.
        check_sum(&s, r as u64 + 1, &[1, 2, 4]);
        Some(t0.elapsed())
    });
    let took: Vec<Duration> = out.into_iter().flatten().collect();
    assert_eq!(took.len(), 3);
    eprintln!("shrink 4 -> 3 and the first AllReduce: {took:?}");
}

#[test]
fn shrink_of_nobody_rebuilds_and_drops_lists_normalised() {
    on_ranks(3, 20.0, |c, _| {
        let s = c.shrink(&[]).unwrap();
        assert_eq!((s.rank(), s.nranks()), (c.rank(), 3));
        check_sum(&s, 1, &[1, 1, 1]);
        // The old communicator is still usable after a shrink of a healthy
        // one.
        check_sum(&c, 2, &[2, 2, 2]);
    });
    // The same list in another order, with a repeat, is the same list.
    on_ranks(5, 20.0, |c, _| {
        let r = c.rank();
        if r == 1 || r == 3 {
            return;
        }
        let list: &[u32] = if r == 0 { &[3, 1, 1] } else { &[1, 3] };
        let s = c.shrink(list).unwrap();
        assert_eq!(s.nranks(), 3);
        check_sum(&s, r as u64, &[0, 2, 4]);
    });
}

#[test]
fn shrink_lists_that_disagree_name_the_rank() {
    let out = on_ranks(4, 10.0, |c, _| {
        let r = c.rank();
        let list: &[u32] = match r {
            0 | 1 => &[3],
            2 => &[1, 3],
            _ => return None,
        };
        Some(c.shrink(list).map(|_| ()).unwrap_err())
    });
    for (r, e) in out.into_iter().enumerate() {
        let Some(e) = e else { continue };
        let m = e.to_string();
        // Rank 2 drops rank 1 and so waits for rank 0 as leader too.
        assert!(m.contains("rank 2") || r == 2, "rank {r}: {m}");
        assert!(m.contains("different list"), "rank {r}: {m}");
    }
}

#[test]
fn shrink_rejects_bad_lists_before_anything_is_sent() {
    on_ranks(2, 10.0, |c, _| {
        let r = c.rank();
        let e = c.shrink(&[r]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("only the ranks that stay"), "{e}");
        let e = c.shrink(&[7]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("rank 7 is not a rank"), "{e}");
        // Nothing was sent: the communicator still works.
        check_sum(&c, 1, &[1, 1]);
    });
}

#[test]
fn revoke_fails_pending_and_idle_ranks_then_shrink_recovers() {
    let out = on_ranks(4, 30.0, |c, bar| {
        let r = c.rank();
        let t0 = Instant::now();
        match r {
            // Waiting in an AllReduce that ranks 1 and 3 never join.
            0 | 2 => {
                let mut v = vec![1u8; 4096];
                let e = c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Revoked, "rank {r}: {e}");
                assert!(e.to_string().contains("rank 1 revoked"), "rank {r}: {e}");
                bar.wait();
            }
            1 => {
                std::thread::sleep(Duration::from_millis(300));
                c.revoke();
                assert!(c.is_revoked());
                bar.wait();
            }
            // Idle: learns it without an operation under way.
            _ => {
                bar.wait();
                let until = Instant::now() + Duration::from_secs(5);
                while !c.is_revoked() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
                assert!(c.is_revoked(), "rank 3 never heard of the revocation");
                let t = Instant::now();
                let e = c.barrier().unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Revoked, "{e}");
                assert!(
                    t.elapsed() < Duration::from_millis(500),
                    "{:?}",
                    t.elapsed()
                );
            }
        }
        let waited = t0.elapsed();
        let s = c.shrink(&[]).unwrap_or_else(|e| panic!("rank {r}: {e}"));
        check_sum(&s, r as u64, &[0, 1, 2, 3]);
        waited
    });
    // The pending ranks failed long before the 30 s timeout.
    assert!(
        out[0] < Duration::from_secs(10) && out[2] < Duration::from_secs(10),
        "{out:?}"
    );
    eprintln!("revoke: ranks failed after {out:?}");
}

#[test]
fn grow_adds_ranks_after_the_old_ones() {
    let comms = Communicator::init_threads(2, &config(20.0)).unwrap();
    let id = comms[0].grow_id().unwrap();
    let e = comms[1].grow_id().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = comms[1].grow(1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let mut hs = Vec::new();
    for c in comms {
        hs.push(std::thread::spawn(move || {
            let g = c
                .grow(4)
                .unwrap_or_else(|e| panic!("old rank {}: {e}", c.rank()));
            assert_eq!((g.rank(), g.nranks()), (c.rank(), 4));
            check_sum(&g, 10 + g.rank() as u64, &[10, 11, 12, 13]);
        }));
    }
    for r in 2..4u32 {
        hs.push(std::thread::spawn(move || {
            let g = Communicator::init(&id, r, 4, &config(20.0)).unwrap();
            check_sum(&g, 10 + r as u64, &[10, 11, 12, 13]);
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn grow_without_an_id_is_an_error_on_every_rank() {
    let out = on_ranks(3, 10.0, |c, _| {
        c.grow(4).map(|_| ()).unwrap_err().to_string()
    });
    for (r, m) in out.iter().enumerate() {
        assert!(m.contains("call grow_id on rank 0 first"), "rank {r}: {m}");
    }
}

//! Communicators whose ranks are threads of this process: the typed API,
//! streams, timeouts, abort and init errors.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use braid::{Communicator, Config, Error, RedOp, Stream};

fn config(secs: f64) -> Config {
    Config {
        timeout: Duration::from_secs_f64(secs),
        abort: None,
    }
}

/// Run `f` on every rank of a fresh `n`-rank communicator, one thread each.
fn on_ranks<R: Send + 'static>(
    n: u32,
    timeout: f64,
    f: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let comms = Communicator::init_threads(n, &config(timeout)).expect("init_threads");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

#[test]
fn typed_collectives_on_threads() {
    let n = 4u32;
    on_ranks(n, 30.0, move |c| {
        let r = c.rank();
        let p = c.nranks() as usize;
        // AllReduce, out of place and in place, several types.
        let send: Vec<i64> = (0..1000).map(|i| i * (r as i64 + 1)).collect();
        let mut recv = vec![0i64; 1000];
        c.all_reduce(&send, &mut recv, RedOp::Sum).unwrap();
        let tri = (n * (n + 1) / 2) as i64;
        assert!(recv.iter().enumerate().all(|(i, &x)| x == i as i64 * tri));
        let mut m = vec![r as f64; 77];
        c.all_reduce_in_place(&mut m, RedOp::Max).unwrap();
        assert!(m.iter().all(|&x| x == (n - 1) as f64));
        let mut h = vec![braid::f16::from_f32(r as f32); 33];
        c.all_reduce_in_place(&mut h, RedOp::Avg).unwrap();
        let avg = (0..n).sum::<u32>() as f32 / n as f32;
        assert!(h.iter().all(|x| x.to_f32() == avg), "f16 avg");
        // AllGather in place.
        let mut g = vec![0u32; 5 * p];
        g[r as usize * 5..(r as usize + 1) * 5].fill(r + 100);
        c.all_gather_in_place(&mut g).unwrap();
        for q in 0..p {
            assert!(g[q * 5..(q + 1) * 5].iter().all(|&x| x == q as u32 + 100));
        }
        // ReduceScatter in place.
        let mut rs = vec![1u8; 3 * p];
        c.reduce_scatter_in_place(&mut rs, RedOp::Sum).unwrap();
        let me = r as usize;
        assert!(rs[me * 3..(me + 1) * 3].iter().all(|&x| x == n as u8));
        // Broadcast from the last rank, Reduce to rank 1.
        let mut b = vec![if r == n - 1 { 9.5f32 } else { 0.0 }; 4096];
        c.broadcast(&mut b, n - 1).unwrap();
        assert!(b.iter().all(|&x| x == 9.5));
        let mut out = vec![0i32; if r == 1 { 10 } else { 0 }];
        c.reduce(&[2i32; 10], &mut out, RedOp::Prod, 1).unwrap();
        if r == 1 {
            assert!(out.iter().all(|&x| x == 1 << n));
        }
        // AllToAll.
        let send: Vec<u32> = (0..p * 2)
            .map(|i| (r as usize * 100 + i / 2) as u32)
            .collect();
        let mut recv = vec![0u32; p * 2];
        c.all_to_all(&send, &mut recv).unwrap();
        for q in 0..p {
            assert!(recv[q * 2..q * 2 + 2]
                .iter()
                .all(|&x| x == (q * 100 + me) as u32));
        }
    });
}

#[test]
fn streams_run_in_order_and_return_buffers() {
    on_ranks(3, 30.0, |c| {
        let s = Stream::new(&c).unwrap();
        let r = c.rank() as f32;
        // Submitted back to back; each depends on the previous one's order
        // being the same on every rank.
        let h1 = s.all_reduce_in_place(vec![r; 100_000], RedOp::Sum);
        let h2 = s.broadcast(vec![r + 1.0; 10], 2);
        let h3 = s.all_gather(vec![r as u64; 3], vec![0u64; 9]);
        let a = h1.wait().unwrap();
        assert!(a.iter().all(|&x| x == 3.0));
        let b = h2.wait().unwrap();
        assert!(b.iter().all(|&x| x == 3.0));
        let (_, g) = h3.wait().unwrap();
        assert_eq!(g, vec![0, 0, 0, 1, 1, 1, 2, 2, 2]);
        s.synchronize().unwrap();
    });
}

#[test]
fn a_missing_peer_is_a_timeout_naming_it() {
    let res = on_ranks(2, 1.0, |c| {
        if c.rank() == 0 {
            let t0 = Instant::now();
            let mut v = vec![1.0f32; 1 << 20];
            let e = c
                .all_reduce_in_place(&mut v, RedOp::Sum)
                .expect_err("rank 1 never joins the AllReduce");
            (t0.elapsed(), e.to_string(), c.async_error())
        } else {
            // Rank 1 never calls; it waits long enough for rank 0 to time out.
            std::thread::sleep(Duration::from_millis(2500));
            (Duration::ZERO, String::new(), None)
        }
    });
    let (elapsed, msg, async_err) = &res[0];
    assert!(
        *elapsed >= Duration::from_millis(900),
        "gave up early: {elapsed:?}"
    );
    assert!(*elapsed < Duration::from_secs(5), "took {elapsed:?}");
    assert!(msg.contains("rank 1"), "{msg}");
    assert!(msg.contains("AllReduce #0"), "{msg}");
    assert!(msg.contains("timed out"), "{msg}");
    assert!(
        async_err.is_some(),
        "the communicator should report itself broken"
    );
}

#[test]
fn abort_from_another_thread_stops_a_blocked_rank_and_its_peer() {
    let res = on_ranks(2, 60.0, |c| {
        let t0 = Instant::now();
        if c.rank() == 0 {
            let aborter = c.clone();
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                aborter.abort();
            });
            // Rank 1 never joins this one: only the abort can end it.
            let mut v = vec![0u32; 1000];
            let e = c.recv(&mut v, 1).expect_err("aborted");
            t.join().unwrap();
            let later = c
                .all_reduce_in_place(&mut v, RedOp::Sum)
                .expect_err("unusable");
            (
                t0.elapsed(),
                e.to_string(),
                matches!(later, Error::Unusable(_)),
            )
        } else {
            // Rank 1 waits for data that never comes; it learns of the abort
            // through the link, long before its 60 s timeout.
            let mut v = vec![0u32; 1000];
            let e = c.recv(&mut v, 0).expect_err("peer aborted");
            (t0.elapsed(), e.to_string(), true)
        }
    });
    for (r, (elapsed, msg, unusable)) in res.iter().enumerate() {
        assert!(
            *elapsed < Duration::from_secs(10),
            "rank {r} took {elapsed:?}: {msg}"
        );
        assert!(unusable, "rank {r}: later operations must fail");
        println!("rank {r}: {msg}");
    }
    assert!(res[0].1.contains("aborted"), "{}", res[0].1);
    assert!(res[1].1.contains("rank 0"), "{}", res[1].1);
}

#[test]
fn init_names_ranks_that_never_arrive() {
    let (id, root) =
        Communicator::unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).unwrap();
    let cfg = config(1.0);
    let t0 = Instant::now();
    // Ranks 0 and 2 of 3 join; rank 1 never does.
    let hs: Vec<_> = [0u32, 2]
        .into_iter()
        .map(|r| {
            let cfg = cfg.clone();
            std::thread::spawn(move || Communicator::init(&id, r, 3, &cfg).map(|_| ()))
        })
        .collect();
    for h in hs {
        let e = h.join().unwrap().expect_err("rank 1 is missing");
        let msg = e.to_string();
        assert!(msg.contains('1'), "error should name rank 1: {msg}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t0.elapsed()
    );
    drop(root);
}

#[test]
fn wrong_secret_cannot_join() {
    let (id, _root) =
        Communicator::unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).unwrap();
    let mut bad = id;
    bad.secret[0] ^= 0xff;
    let cfg = config(1.5);
    let good = std::thread::spawn({
        let cfg = cfg.clone();
        move || Communicator::init(&id, 0, 2, &cfg).map(|_| ())
    });
    let e = Communicator::init(&bad, 1, 2, &cfg).expect_err("wrong secret must not join");
    assert!(e.to_string().contains("secret"), "{e}");
    let e0 = good
        .join()
        .unwrap()
        .expect_err("rank 1 never joined properly");
    assert!(e0.to_string().contains('1'), "{e0}");
}

#[test]
fn one_rank_communicator_copies() {
    let c = Communicator::init_threads(1, &config(5.0))
        .unwrap()
        .remove(0);
    let mut out = vec![0f64; 10];
    c.all_reduce(&[2.5f64; 10], &mut out, RedOp::Avg).unwrap();
    assert_eq!(out, vec![2.5; 10]);
    let mut g = vec![0u8; 4];
    c.all_gather(&[1, 2, 3, 4], &mut g).unwrap();
    assert_eq!(g, vec![1, 2, 3, 4]);
    c.barrier().expect("a one-rank barrier returns at once");
}

/// No rank leaves a barrier before every rank entered it: each round one
/// rank arrives late, every rank counts itself in before the barrier and
/// checks after it that all ranks of the round had. An AllReduce after each
/// barrier checks that barriers and collectives keep their order. 2 ranks
/// and 5 (recursive doubling with ranks beyond the power of two).
#[test]
fn barrier_waits_for_the_last_rank() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    for n in [2u32, 5] {
        let arrived = Arc::new(AtomicUsize::new(0));
        let rounds = 2 * n as usize;
        on_ranks(n, 30.0, move |c| {
            let r = c.rank() as usize;
            for round in 0..rounds {
                if round % n as usize == r {
                    std::thread::sleep(Duration::from_millis(20));
                }
                arrived.fetch_add(1, Ordering::SeqCst);
                c.barrier().expect("barrier");
                let seen = arrived.load(Ordering::SeqCst);
                assert!(
                    seen >= (round + 1) * n as usize,
                    "{n} ranks, round {round}: rank {r} left the barrier when only {seen} arrivals were counted"
                );
                let mut v = [1u32];
                c.all_reduce_in_place(&mut v, RedOp::Sum)
                    .expect("allreduce");
                assert_eq!(v[0], n);
            }
        });
    }
}

/// A stream's barrier completes only once every rank reached it, after the
/// stream's earlier operations.
#[test]
fn stream_barrier_waits_for_every_rank() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let arrived = Arc::new(AtomicUsize::new(0));
    on_ranks(3, 30.0, move |c| {
        let s = Stream::new(&c).unwrap();
        let h = s.all_reduce_in_place(vec![1u32; 1000], RedOp::Sum);
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(30));
        }
        arrived.fetch_add(1, Ordering::SeqCst);
        s.barrier().wait().expect("stream barrier");
        assert_eq!(arrived.load(Ordering::SeqCst), 3, "rank {}", c.rank());
        assert!(h.wait().unwrap().iter().all(|&x| x == 3));
    });
}

/// A rank that never reaches the barrier is an error on the others within
/// the timeout, naming it and the barrier.
#[test]
fn a_missing_rank_at_a_barrier_is_named() {
    let res = on_ranks(3, 1.0, |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(2500));
            return (Duration::ZERO, String::new());
        }
        let t0 = Instant::now();
        let e = c.barrier().expect_err("rank 2 never arrives");
        (t0.elapsed(), e.to_string())
    });
    for (r, (elapsed, msg)) in res.iter().take(2).enumerate() {
        assert!(
            *elapsed < Duration::from_secs(5),
            "rank {r} took {elapsed:?}"
        );
        assert!(msg.contains("Barrier #0"), "rank {r}: {msg}");
        assert!(msg.contains("timed out"), "rank {r}: {msg}");
    }
    // Rank 0 waits on rank 2 itself. Rank 1 waits on rank 0 (its partner in
    // the recursive doubling): it times out on rank 0 too, or first receives
    // rank 0's abort, which carries rank 0's reason naming rank 2.
    let m1 = &res[1].1;
    assert!(res[0].1.contains("waiting for rank 2"), "{}", res[0].1);
    assert!(
        m1.contains("waiting for rank 0")
            || m1.contains("rank 0 closed or aborted the shm link: rank 0: timed out after")
                && m1.contains("waiting for rank 2"),
        "{m1}"
    );
}

/// Polls `watch`'s progress record (for at most 20 s) until it waits for a
/// peer in operation `op`; returns that peer, the operation's sequence
/// number and the process-wide dump taken then.
fn wait_in(watch: &Communicator, op: &str) -> (u32, u64, String) {
    let start = Instant::now();
    loop {
        let snap = watch.pending();
        if let Some(r) = snap.running.as_ref().filter(|r| r.op == op) {
            if let Some(w) = r.waiting.as_ref() {
                return (w.peer, r.seq, braid::dump_pending());
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "rank {} never waited in {op}: {snap:?}",
            watch.rank()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Hang localisation: while rank 0 waits in an AllReduce that rank 1 has not
/// joined, its progress record (and the process-wide dump) names the
/// operation, its sequence number, the peer and the transport; once rank 1
/// joins, both finish and the record goes back to idle.
#[test]
fn pending_operation_names_the_peer_it_waits_for() {
    let mut comms = Communicator::init_threads(2, &config(30.0)).expect("init");
    let c1 = comms.pop().expect("rank 1");
    let c0 = comms.pop().expect("rank 0");
    let watch = c0.clone();
    let t0 = std::thread::spawn(move || {
        let mut a = vec![1.0f32; 1000];
        c0.all_reduce_in_place(&mut a, RedOp::Sum).unwrap();
        c0.all_reduce_in_place(&mut a, RedOp::Sum).unwrap();
        c0.barrier().unwrap();
        a[0]
    });
    // Rank 1 takes part in the first operation only after a while.
    let mut a = vec![1.0f32; 1000];
    c1.all_reduce_in_place(&mut a, RedOp::Sum).unwrap();
    let (peer, seq, line) = wait_in(&watch, "AllReduce");
    assert_eq!((peer, seq), (1, 1));
    assert!(
        line.contains("rank 0/2")
            && line.contains("AllReduce #1")
            && line.contains("from rank 1 over"),
        "{line}"
    );
    c1.all_reduce_in_place(&mut a, RedOp::Sum).unwrap();
    // Then rank 0 waits in a barrier that rank 1 joins late.
    let (peer, seq, line) = wait_in(&watch, "Barrier");
    assert_eq!((peer, seq), (1, 2));
    assert!(
        line.contains("Barrier #2") && line.contains("from rank 1 over"),
        "{line}"
    );
    c1.barrier().unwrap();
    assert_eq!(t0.join().unwrap(), 4.0);
    let snap = watch.pending();
    assert!(snap.running.is_none() && snap.finished == 3, "{snap:?}");
}

/// `split(color, key)`: ranks of one color form a communicator ordered by key;
/// `None` takes no part. The children run collectives on their own, survive
/// the parent, and `abort_with_splits` reaches them; an aborted parent cannot
/// be split.
#[test]
fn split_by_color_and_key() {
    let out = on_ranks(5, 30.0, |c| {
        let r = c.rank();
        // Rank 4 stays out; evens and odds split, ordered by descending rank.
        let color = (r != 4).then_some(r % 2);
        let child = c.split(color, 100 - r).expect("split");
        let mut sum = None;
        if let Some(child) = &child {
            let mut v = vec![r as u64 + 1; 1000];
            child
                .all_reduce_in_place(&mut v, RedOp::Sum)
                .expect("child allreduce");
            sum = Some(v[0]);
        }
        // The parent still works after the split.
        let mut p = vec![1u32; 10];
        c.all_reduce_in_place(&mut p, RedOp::Sum)
            .expect("parent allreduce");
        assert_eq!(p[0], 5);
        (r, child.map(|ch| (ch.rank(), ch.nranks())), sum)
    });
    for (r, place, sum) in out {
        match r {
            // Evens 0, 2: keys 100, 98 → rank 2 first.
            0 => assert_eq!((place, sum), (Some((1, 2)), Some(1 + 3))),
            2 => assert_eq!((place, sum), (Some((0, 2)), Some(1 + 3))),
            1 => assert_eq!((place, sum), (Some((1, 2)), Some(2 + 4))),
            3 => assert_eq!((place, sum), (Some((0, 2)), Some(2 + 4))),
            _ => assert_eq!((place, sum), (None, None)),
        }
    }
}

#[test]
fn aborted_parent_cannot_split_and_abort_reaches_splits() {
    let out = on_ranks(2, 30.0, |c| {
        let child = c.split(Some(0), 0).expect("split").expect("member");
        c.barrier().expect("barrier");
        if c.rank() == 0 {
            c.abort_with_splits();
            let e = c
                .split(Some(0), 0)
                .expect_err("split of an aborted communicator");
            assert!(e.to_string().contains("cannot split an aborted"), "{e}");
        }
        // Rank 0's child is aborted; rank 1's child sees rank 0 leave.
        let mut v = vec![1.0f32; 100];
        let res = child.all_reduce_in_place(&mut v, RedOp::Sum);
        (c.rank(), res.map_err(|e| e.to_string()))
    });
    for (r, res) in out {
        let e = res.expect_err("child operation after abort_with_splits");
        if r == 0 {
            assert!(e.contains("abort"), "rank 0: {e}");
        } else {
            assert!(e.contains("rank 0"), "rank 1 must name rank 0: {e}");
        }
    }
}

/// Communicator creation is abortable: rank 0 waits in the rendezvous for a
/// rank 1 that never comes; setting the config's abort flag ends the wait
/// within well under a second, long before the 60 s timeout.
#[test]
fn init_is_abortable() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (id, root) =
        Communicator::unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).expect("root");
    let flag = Arc::new(AtomicBool::new(false));
    let cfg = config(60.0).with_abort(flag.clone());
    let t = std::thread::spawn(move || {
        let start = Instant::now();
        let r = Communicator::init_hosting(&id, root, 0, 2, &cfg);
        (r.map(|_| ()), start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let set = Instant::now();
    flag.store(true, Ordering::SeqCst);
    let (res, _) = t.join().expect("init thread");
    let after = set.elapsed();
    let e = res.expect_err("init must fail once aborted").to_string();
    assert!(e.contains("aborted"), "{e}");
    assert!(
        after < Duration::from_secs(5),
        "init took {after:?} to notice the abort"
    );
}

/// Ranks run as threads see their own thread's CPU binding: two rank
/// threads bound to the same CPU share it (oversubscribed, so waits yield),
/// two bound to different CPUs do not.
#[test]
fn rank_threads_bound_one_by_one_are_seen_bound() {
    let me = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).expect("affinity");
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&c| me.is_set(c).unwrap_or(false))
        .collect();
    if cpus.len() < 2 {
        eprintln!("SKIP: needs 2 CPUs (this process may use {})", cpus.len());
        return;
    }
    let run = |bind: [usize; 2]| -> Vec<bool> {
        let (id, _root) =
            Communicator::unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
                .expect("root");
        let handles: Vec<_> = (0..2u32)
            .map(|r| {
                let cpu = bind[r as usize];
                std::thread::spawn(move || {
                    let mut set = nix::sched::CpuSet::new();
                    set.set(cpu).expect("cpu id");
                    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                        .expect("bind the rank thread");
                    let c = Communicator::init(&id, r, 2, &config(30.0)).expect("init");
                    let mut v = vec![1.0f32; 3];
                    c.all_reduce_in_place(&mut v, RedOp::Sum)
                        .expect("all_reduce");
                    assert_eq!(v, [2.0; 3]);
                    c.oversubscribed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    };
    assert_eq!(run([cpus[0], cpus[1]]), [false, false]);
    assert_eq!(run([cpus[0], cpus[0]]), [true, true]);
}

/// Registered host buffers (`braid::HostBuffer`) as collective buffers:
/// AllGather, AllToAll and Broadcast large enough to go single-copy (16 MiB
/// per rank: above every default threshold) give what a plain loop says,
/// for ranks that are threads of one process (the peer maps its own
/// process's file through /proc/self/fd).
#[test]
fn host_buffers_as_collective_buffers() {
    let n: usize = 4 << 20; // u32 per rank
    let got = on_ranks(2, 60.0, move |c| {
        let r = c.rank() as usize;
        let p = c.nranks() as usize;
        let mut send = braid::HostBuffer::new(n * 4).unwrap();
        let mut recv = braid::HostBuffer::new(n * 4 * p).unwrap();
        for (i, x) in send.typed_mut::<u32>().iter_mut().enumerate() {
            *x = (r * n + i) as u32;
        }
        c.all_gather(send.typed::<u32>(), &mut recv.typed_mut::<u32>()[..n * p])
            .unwrap();
        let gathered = recv
            .typed::<u32>()
            .iter()
            .enumerate()
            .all(|(i, &x)| x == i as u32);
        // AllToAll: block q of rank r's send is r*p+q; rank r receives q*p+r
        // in block q.
        let b = n / p;
        for q in 0..p {
            send.typed_mut::<u32>()[q * b..(q + 1) * b].fill((r * p + q) as u32);
        }
        c.all_to_all(send.typed::<u32>(), &mut recv.typed_mut::<u32>()[..n])
            .unwrap();
        let exchanged = (0..p).all(|q| {
            recv.typed::<u32>()[q * b..(q + 1) * b]
                .iter()
                .all(|&x| x == (q * p + r) as u32)
        });
        // Broadcast from rank 1, in place.
        let mut buf = braid::HostBuffer::new(n * 4).unwrap();
        if r == 1 {
            for (i, x) in buf.typed_mut::<u32>().iter_mut().enumerate() {
                *x = (i as u32).wrapping_mul(7);
            }
        }
        c.broadcast(buf.typed_mut::<u32>(), 1).unwrap();
        let broadcast = buf
            .typed::<u32>()
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i as u32).wrapping_mul(7));
        (gathered, exchanged, broadcast)
    });
    assert_eq!(got, vec![(true, true, true); 2]);
}

/// Small collectives (the latency path: pieces of at most 1 KiB run on the
/// engine's small-program executor) and sizes just past it, back to back,
/// on 2 to 5 ranks (powers of two and not), against plain loops.
#[test]
fn small_collectives_around_the_small_path_limit() {
    for n in 2u32..=5 {
        on_ranks(n, 30.0, move |c| {
            let r = c.rank() as i64;
            let p = c.nranks() as usize;
            let ranks = 0..n as i64;
            for count in [1usize, 3, 127, 128, 129, 256, 1000] {
                let send: Vec<i64> = (0..count as i64).map(|i| i * 7 + r).collect();
                let mut recv = vec![0i64; count];
                c.all_reduce(&send, &mut recv, RedOp::Sum).unwrap();
                for (i, &x) in recv.iter().enumerate() {
                    let want: i64 = ranks.clone().map(|q| i as i64 * 7 + q).sum();
                    assert_eq!(x, want, "AllReduce n={n} count={count} i={i}");
                }
                let mut m = send.clone();
                c.all_reduce_in_place(&mut m, RedOp::Max).unwrap();
                for (i, &x) in m.iter().enumerate() {
                    assert_eq!(x, i as i64 * 7 + n as i64 - 1, "Max n={n} count={count}");
                }
                let root = (count % p) as u32;
                let mut b: Vec<i64> = if c.rank() == root {
                    send.clone()
                } else {
                    vec![-1; count]
                };
                c.broadcast(&mut b, root).unwrap();
                for (i, &x) in b.iter().enumerate() {
                    assert_eq!(
                        x,
                        i as i64 * 7 + root as i64,
                        "Broadcast n={n} count={count}"
                    );
                }
                let mut out = vec![0i64; if c.rank() == root { count } else { 0 }];
                c.reduce(&send, &mut out, RedOp::Sum, root).unwrap();
                for (i, &x) in out.iter().enumerate() {
                    let want: i64 = ranks.clone().map(|q| i as i64 * 7 + q).sum();
                    assert_eq!(x, want, "Reduce n={n} count={count}");
                }
                let mut g = vec![0i64; count * p];
                c.all_gather(&send, &mut g).unwrap();
                for q in 0..p {
                    for i in 0..count {
                        assert_eq!(g[q * count + i], i as i64 * 7 + q as i64, "AllGather n={n}");
                    }
                }
                let big: Vec<i64> = (0..(count * p) as i64).map(|i| i + r).collect();
                let mut rs = vec![0i64; count];
                c.reduce_scatter(&big, &mut rs, RedOp::Sum).unwrap();
                for (i, &x) in rs.iter().enumerate() {
                    let at = (c.rank() as usize * count + i) as i64;
                    let want: i64 = ranks.clone().map(|q| at + q).sum();
                    assert_eq!(x, want, "ReduceScatter n={n} count={count}");
                }
            }
        });
    }
}

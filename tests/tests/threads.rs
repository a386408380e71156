//! Communicators whose ranks are threads of this process: the typed API,
//! streams, timeouts, abort and init errors.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use braid::{Communicator, Config, Error, RedOp, Stream};

fn config(secs: f64) -> Config {
    Config {
        timeout: Duration::from_secs_f64(secs),
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
}

//! One rank of the multi-process test suite. The test process hosts the
//! bootstrap root and starts N of these with
//! `braid-testrank SUITE ID RANK NRANKS [ARGS...]`. With ID `env` the rank
//! joins through the launcher environment instead (`BRAID_UNIQUE_ID`,
//! `BRAID_RANK`, `BRAID_NRANKS`, ...; RANK and NRANKS are then ignored):
//! that is how ranks in separate RDMA guests meet (scripts/rdma-tests.sh).
//!
//! Suites:
//! - `matrix SIZES`: every collective × datatype × op × size, in place and
//!   out of place, checked against `braid_core::reference`; prints one line
//!   per failure and exits 1 if any; then prints the algorithm an
//!   AllReduce of each size runs (`rank R allreduce N f32: ALGO by SOURCE`).
//! - `quick-matrix SIZES`: the same over three datatypes (f32, i8, f64) and
//!   the operators sum and avg.
//! - `loop ITERS COUNT`: AllReduce over and over (the kill test kills one rank
//!   in the middle); prints `ready` after the first, and on error prints
//!   `error: ...` and exits 3.
//! - `p2p`: Send/Recv and groups (ring exchange, alltoallv-like group);
//!   Gather and Scatter from every root, AllToAllv with uneven blocks and
//!   AllToAll in place, against plain loops.
//! - `badinput`: bad arguments give InvalidArgument and leave the
//!   communicator usable.
//!
//! With `BRAID_TEST_CPU=N` in its environment a rank binds itself to CPU N
//! before it joins (as `mpirun --bind-to core` or `taskset` would).

use std::process::ExitCode;
use std::time::Instant;

use braid::{Collective, Communicator, Config, DataType, Error, RedOp, UniqueId};
use braid_core::reference::{first_wrong, gen, gen_at, reduced, Kind, GARBAGE};

/// A byte buffer aligned for every datatype (backed by u64s).
struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize, fill: u8) -> Self {
        let word = u64::from_ne_bytes([fill; 8]);
        AlignedBuf {
            words: vec![word; len.div_ceil(8)],
            len,
        }
    }
    fn from(bytes: &[u8]) -> Self {
        let mut b = AlignedBuf::new(bytes.len(), 0);
        b.bytes_mut().copy_from_slice(bytes);
        b
    }
    fn bytes(&self) -> &[u8] {
        let all: &[u8] = bytemuck_bytes(&self.words);
        &all[..self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        let all: &mut [u8] = bytemuck_bytes_mut(&mut self.words);
        &mut all[..len]
    }
}

fn bytemuck_bytes(w: &[u64]) -> &[u8] {
    let mut out: &[u8] = &[];
    if !w.is_empty() {
        // SAFETY: u64 has no padding; the byte view covers the same memory
        // for the same lifetime.
        out = unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, w.len() * 8) };
    }
    out
}

fn bytemuck_bytes_mut(w: &mut [u64]) -> &mut [u8] {
    if w.is_empty() {
        return &mut [];
    }
    // SAFETY: as above; every byte pattern is a valid u64.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, w.len() * 8) }
}

/// A case's input and expected receive buffer (None: not checked), computed
/// once by the reference for both the in-place and out-of-place runs.
struct Prepared {
    input: Vec<u8>,
    expect: Option<Vec<u8>>,
}

fn prepare(
    comm: &Communicator,
    kind: Kind,
    dt: DataType,
    op: RedOp,
    n: usize,
) -> Result<Prepared, String> {
    let (r, p) = (comm.rank() as usize, comm.nranks() as usize);
    let root = (n % p) as u32;
    let counts = collective(kind, n, op, root)
        .buffer_counts(p as u32)
        .map_err(|e| e.to_string())?;
    let input = gen(dt, op, r, counts[0]);
    let expect = match kind {
        Kind::AllReduce => Some(reduced(dt, op, p, 0, n)),
        Kind::ReduceScatter => Some(reduced(dt, op, p, r * n, n)),
        Kind::AllGather => Some((0..p).flat_map(|q| gen(dt, op, q, n)).collect()),
        Kind::Broadcast => Some(gen(dt, op, root as usize, n)),
        Kind::Reduce if r == root as usize => Some(reduced(dt, op, p, 0, n)),
        Kind::Reduce => None,
        Kind::AllToAll => Some((0..p).flat_map(|q| gen_at(dt, op, q, r * n, n)).collect()),
    };
    Ok(Prepared { input, expect })
}

/// The collective of `kind` as braid's API takes it (the reference's
/// [`Kind::collective`] is the planner's description).
fn collective(kind: Kind, count: usize, op: RedOp, root: u32) -> Collective {
    match kind {
        Kind::AllReduce => Collective::AllReduce { count, op },
        Kind::ReduceScatter => Collective::ReduceScatter {
            recv_count: count,
            op,
        },
        Kind::AllGather => Collective::AllGather { send_count: count },
        Kind::Broadcast => Collective::Broadcast { count, root },
        Kind::Reduce => Collective::Reduce { count, op, root },
        Kind::AllToAll => Collective::AllToAll { count },
    }
}

/// Run one case; `Err` describes a wrong result or an operation error.
fn case(
    comm: &Communicator,
    kind: Kind,
    dt: DataType,
    op: RedOp,
    n: usize,
    in_place: bool,
    prep: &Prepared,
) -> Result<(), String> {
    let (r, p) = (comm.rank() as usize, comm.nranks() as usize);
    let es = dt.size();
    let root = (n % p) as u32;
    let c = collective(kind, n, op, root);
    let counts = c.buffer_counts(p as u32).map_err(|e| e.to_string())?;
    let input = &prep.input;
    let (got, untouched): (Vec<u8>, Option<Vec<u8>>) = if in_place {
        let mut buf = match kind {
            Kind::AllGather => {
                let mut b = AlignedBuf::new(counts[1] * es, GARBAGE);
                b.bytes_mut()[r * n * es..(r + 1) * n * es].copy_from_slice(input);
                b
            }
            _ => AlignedBuf::from(input),
        };
        comm.run_bytes_in_place(&c, dt, buf.bytes_mut())
            .map_err(|e| format!("error: {e}"))?;
        let out = buf.bytes().to_vec();
        match kind {
            Kind::ReduceScatter => (out[r * n * es..(r + 1) * n * es].to_vec(), None),
            Kind::Reduce if r != root as usize => (out, Some(input.clone())),
            _ => (out, None),
        }
    } else {
        let send = AlignedBuf::from(input);
        let mut recv = AlignedBuf::new(counts[1] * es, GARBAGE);
        comm.run_bytes(&c, dt, send.bytes(), recv.bytes_mut())
            .map_err(|e| format!("error: {e}"))?;
        let out = recv.bytes().to_vec();
        let untouched =
            (kind == Kind::Reduce && r != root as usize).then(|| vec![GARBAGE; counts[1] * es]);
        (out, untouched)
    };
    if let Some(want) = &prep.expect {
        if let Some(w) = first_wrong(dt, op, &got, want) {
            return Err(format!("wrong result: {w}"));
        }
    }
    if let Some(orig) = untouched {
        if got != orig {
            return Err("a non-root buffer was modified".into());
        }
    }
    Ok(())
}

fn matrix(comm: &Communicator, sizes: &[usize], quick: bool) -> u32 {
    let mut failures = 0;
    let mut cases = 0;
    let t0 = Instant::now();
    for &n in sizes {
        for kind in Kind::ALL {
            let ops: &[RedOp] = match kind {
                Kind::AllReduce | Kind::ReduceScatter | Kind::Reduce if quick => {
                    &[RedOp::Sum, RedOp::Avg]
                }
                Kind::AllReduce | Kind::ReduceScatter | Kind::Reduce => &RedOp::ALL,
                _ => &[RedOp::Sum],
            };
            let dts: &[DataType] = if quick {
                &[DataType::F32, DataType::I8, DataType::F64]
            } else {
                &DataType::ALL
            };
            for &dt in dts {
                for &op in ops {
                    let prep = match prepare(comm, kind, dt, op, n) {
                        Ok(p) => p,
                        Err(e) => {
                            println!("FAIL rank {}: {e}", comm.rank());
                            return failures + 1;
                        }
                    };
                    for in_place in [false, true] {
                        if in_place && kind == Kind::AllToAll {
                            continue;
                        }
                        cases += 1;
                        if let Err(e) = case(comm, kind, dt, op, n, in_place, &prep) {
                            failures += 1;
                            println!(
                                "FAIL rank {} {:?} {dt} {op} n={n} in_place={in_place}: {e}",
                                comm.rank(),
                                kind
                            );
                            if e.starts_with("error") {
                                // The communicator is broken after an error.
                                return failures;
                            }
                        }
                    }
                }
            }
            // A heartbeat for the test harness: slow is not hung.
            println!("progress rank {}: {kind:?} n={n} done", comm.rank());
        }
    }
    println!(
        "rank {}: {cases} cases, {failures} failed, {:.1}s",
        comm.rank(),
        t0.elapsed().as_secs_f64()
    );
    failures
}

/// Every collective once per size: f32, Sum, out of place.
fn matrix_once(comm: &Communicator, sizes: &[usize]) -> u32 {
    let mut failures = 0;
    for &n in sizes {
        for kind in Kind::ALL {
            let (dt, op) = (DataType::F32, RedOp::Sum);
            let res = prepare(comm, kind, dt, op, n)
                .and_then(|prep| case(comm, kind, dt, op, n, false, &prep));
            if let Err(e) = res {
                failures += 1;
                println!("FAIL rank {} {kind:?} n={n}: {e}", comm.rank());
                return failures;
            }
        }
    }
    failures
}

/// Kilobytes of braid shared-memory segments mapped in this process, as
/// its proportional share (`Pss` in /proc/self/smaps).
fn shm_pss_kib() -> std::io::Result<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut total = 0;
    let mut in_braid = false;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            // A mapping's first line: range, perms, offset, dev, inode, path.
            in_braid = line.contains("/dev/shm/braid-");
        } else if in_braid && first == "Pss:" {
            total += f.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    Ok(total)
}

fn p2p(comm: &Communicator) -> Result<(), String> {
    let (r, p) = (comm.rank(), comm.nranks());
    let next = (r + 1) % p;
    let prev = (r + p - 1) % p;
    // Ring exchange in a group, sizes that cross several slots.
    for n in [0usize, 1, 1000, 300_000] {
        let send: Vec<u32> = (0..n as u32).map(|i| i ^ (r << 20)).collect();
        let mut recv = vec![0u32; n];
        let mut g = comm.group();
        g.send(&send, next);
        g.recv(&mut recv, prev);
        g.run().map_err(|e| e.to_string())?;
        let want: Vec<u32> = (0..n as u32).map(|i| i ^ (prev << 20)).collect();
        if recv != want {
            return Err(format!("ring exchange of {n} wrong"));
        }
    }
    // AllToAllv as a group: rank r sends r+q+1 elements to rank q.
    let mut g = comm.group();
    let sends: Vec<Vec<i64>> = (0..p)
        .map(|q| {
            (0..(r + q + 1) as i64)
                .map(|i| i * 1000 + r as i64 * 10 + q as i64)
                .collect()
        })
        .collect();
    let mut recvs: Vec<Vec<i64>> = (0..p).map(|q| vec![-1; (q + r + 1) as usize]).collect();
    for (q, s) in sends.iter().enumerate() {
        g.send(s, q as u32);
    }
    for (q, b) in recvs.iter_mut().enumerate() {
        g.recv(b, q as u32);
    }
    g.run().map_err(|e| e.to_string())?;
    for (q, b) in recvs.iter().enumerate() {
        let want: Vec<i64> = (0..(q as u32 + r + 1) as i64)
            .map(|i| i * 1000 + q as i64 * 10 + r as i64)
            .collect();
        if *b != want {
            return Err(format!("alltoallv block from {q} wrong"));
        }
    }
    // Plain send then recv: even ranks send first, odd ranks receive first.
    if p > 1 {
        let data = vec![r as f32; 5000];
        let mut got = vec![0f32; 5000];
        let partner = r ^ 1;
        if partner < p {
            if r % 2 == 0 {
                comm.send(&data, partner).map_err(|e| e.to_string())?;
                comm.recv(&mut got, partner).map_err(|e| e.to_string())?;
            } else {
                comm.recv(&mut got, partner).map_err(|e| e.to_string())?;
                comm.send(&data, partner).map_err(|e| e.to_string())?;
            }
            if got.iter().any(|&x| x != partner as f32) {
                return Err("send/recv pair wrong".into());
            }
        }
    }
    Ok(())
}

/// Element `i` of what rank `from` has for rank `to` (the reference of
/// [`rooted_and_v`]).
fn for_rank(from: u32, to: u32, i: usize) -> u32 {
    (from << 24) ^ (to << 16) ^ ((i as u32).wrapping_mul(2654435761) >> 16)
}

/// Gather, Scatter, AllToAllv and in-place AllToAll, each result compared
/// with what a plain loop over `for_rank` says it must be.
fn rooted_and_v(comm: &Communicator) -> Result<(), String> {
    let (r, p) = (comm.rank(), comm.nranks());
    let pu = p as usize;
    let e = |e: Error| e.to_string();
    for n in [0usize, 3, 100_000] {
        for root in 0..p {
            let send: Vec<u32> = (0..n).map(|i| for_rank(r, root, i)).collect();
            let mut all = vec![u32::MAX; if r == root { pu * n } else { 0 }];
            comm.gather(&send, &mut all, root).map_err(e)?;
            for (k, &x) in all.iter().enumerate() {
                if x != for_rank((k / n) as u32, root, k % n) {
                    return Err(format!("gather n={n} root={root}: element {k} is {x:#x}"));
                }
            }
            let whole: Vec<u32> = if r == root {
                (0..pu * n)
                    .map(|k| for_rank(root, (k / n) as u32, k % n))
                    .collect()
            } else {
                Vec::new()
            };
            let mut mine = vec![u32::MAX; n];
            comm.scatter(&whole, &mut mine, root).map_err(e)?;
            if (0..n).any(|i| mine[i] != for_rank(root, r, i)) {
                return Err(format!("scatter n={n} root={root} wrong"));
            }
        }
        // AllToAllv: rank a sends (a + b) % 3 * n / 2 elements to rank b.
        let cnt = |a: u32, b: u32| (a + b) as usize % 3 * n / 2;
        let sc: Vec<usize> = (0..p).map(|q| cnt(r, q)).collect();
        let rc: Vec<usize> = (0..p).map(|q| cnt(q, r)).collect();
        let send: Vec<u32> = (0..p)
            .flat_map(|q| (0..cnt(r, q)).map(move |i| for_rank(r, q, i)))
            .collect();
        let mut recv = vec![u32::MAX; rc.iter().sum()];
        let (sb, rb) = (braid::Blocks::packed(&sc), braid::Blocks::packed(&rc));
        comm.all_to_all_v(&send, sb, &mut recv, rb).map_err(e)?;
        let want: Vec<u32> = (0..p)
            .flat_map(|q| (0..cnt(q, r)).map(move |i| for_rank(q, r, i)))
            .collect();
        if recv != want {
            return Err(format!("all_to_all_v n={n} wrong"));
        }
        let mut buf: Vec<u32> = (0..pu * n)
            .map(|k| for_rank(r, (k / n) as u32, k % n))
            .collect();
        comm.all_to_all_in_place(&mut buf).map_err(e)?;
        if (0..pu * n).any(|k| buf[k] != for_rank((k / n) as u32, r, k % n)) {
            return Err(format!("all_to_all in place n={n} wrong"));
        }
    }
    Ok(())
}

fn badinput(comm: &Communicator) -> Result<(), String> {
    let p = comm.nranks();
    let expect_invalid = |what: &str, r: braid::Result<()>| -> Result<(), String> {
        match r {
            Err(Error::InvalidArgument(m)) => {
                println!("rank {}: {what}: rejected: {m}", comm.rank());
                Ok(())
            }
            other => Err(format!("{what}: expected InvalidArgument, got {other:?}")),
        }
    };
    let a = vec![1.0f32; 10];
    let mut b = vec![0.0f32; 9];
    expect_invalid("length mismatch", comm.all_reduce(&a, &mut b, RedOp::Sum))?;
    let mut c = vec![0.0f32; 10];
    expect_invalid("root out of range", comm.broadcast(&mut c, p))?;
    expect_invalid(
        "reduce root out of range",
        comm.reduce(&a, &mut c, RedOp::Sum, p + 7),
    )?;
    let mut g = vec![0.0f32; 10 * p as usize + 1];
    expect_invalid("allgather recv length", comm.all_gather(&a, &mut g))?;
    let huge = Collective::AllGather {
        send_count: usize::MAX / 3,
    };
    expect_invalid(
        "count overflow",
        comm.run_bytes(&huge, DataType::F32, &[], &mut []),
    )?;
    // 8-aligned storage, one byte in: certainly misaligned for f32.
    let mut storage = AlignedBuf::new(17, 0);
    let odd = &mut storage.bytes_mut()[1..9];
    let c2 = Collective::AllReduce {
        count: 2,
        op: RedOp::Sum,
    };
    expect_invalid(
        "misaligned buffer",
        comm.run_bytes_in_place(&c2, DataType::F32, odd),
    )?;
    expect_invalid("send to a rank out of range", comm.send(&a, p + 1))?;
    // Still usable: a real AllReduce works afterwards.
    let mut v = vec![1u64; 100];
    comm.all_reduce_in_place(&mut v, RedOp::Sum)
        .map_err(|e| format!("communicator unusable after bad input: {e}"))?;
    if v.iter().any(|&x| x != p as u64) {
        return Err("AllReduce after bad input gave a wrong result".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: braid-testrank SUITE ID RANK NRANKS [ARGS...]");
        return ExitCode::from(2);
    }
    let parse = |s: &str| s.parse::<u32>().ok();
    if let Some(cpu) = std::env::var("BRAID_TEST_CPU")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        let mut set = nix::sched::CpuSet::new();
        if let Err(e) = set
            .set(cpu)
            .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set))
        {
            eprintln!("cannot bind to CPU {cpu}: {e}");
            return ExitCode::from(2);
        }
    }
    let joined = if args[2] == "env" {
        Communicator::from_env()
    } else {
        let (Ok(id), Some(rank), Some(nranks)) = (
            args[2].parse::<UniqueId>(),
            parse(&args[3]),
            parse(&args[4]),
        ) else {
            eprintln!("bad arguments: {:?}", &args[1..]);
            return ExitCode::from(2);
        };
        let config = match Config::from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        };
        Communicator::init(&id, rank, nranks, &config)
    };
    let comm = match joined {
        Ok(c) => c,
        Err(e) => {
            println!("error: init: {e}");
            return ExitCode::from(4);
        }
    };
    let (rank, nranks) = (comm.rank(), comm.nranks());
    // One line the multi-host tests read: the transport to each peer.
    println!("rank {rank} transports: {}", comm.transports().join(","));
    println!("rank {rank} oversubscribed: {}", comm.oversubscribed());
    println!(
        "rank {rank} ring: {:?} nic: {}",
        comm.ring(),
        comm.nic().unwrap_or("-")
    );
    let extra: Vec<usize> = args[5..].iter().filter_map(|s| s.parse().ok()).collect();
    match args[1].as_str() {
        suite @ ("matrix" | "quick-matrix") => {
            if matrix(&comm, &extra, suite == "quick-matrix") > 0 {
                return ExitCode::from(1);
            }
            // The algorithm an AllReduce of each size runs, and what chose
            // it (run once more: the matrix's many calls evict plans).
            for &n in &extra {
                let c = Collective::AllReduce {
                    count: n,
                    op: RedOp::Sum,
                };
                let (send, mut recv) = (vec![1.0f32; n], vec![0.0f32; n]);
                if let Err(e) = comm.all_reduce(&send, &mut recv, RedOp::Sum) {
                    println!("error: {e}");
                    return ExitCode::from(1);
                }
                if let Some((name, by)) = comm.algorithm(&c, DataType::F32) {
                    println!("rank {rank} allreduce {n} f32: {name} by {by}");
                }
            }
        }
        "memory" => {
            // Every collective once per size (f32 Sum, checked against the
            // reference), then this rank's share of the braid shared memory
            // mapped in it (proportional set size: summed over the ranks,
            // every page counts once), measured while every rank is between
            // the same two barriers.
            if matrix_once(&comm, &extra) > 0 {
                return ExitCode::from(1);
            }
            let pss = match comm.barrier().map(|()| shm_pss_kib()) {
                Ok(p) => p,
                Err(e) => {
                    println!("error: {e}");
                    return ExitCode::from(1);
                }
            };
            if let Err(e) = comm.barrier() {
                println!("error: {e}");
                return ExitCode::from(1);
            }
            match pss {
                Ok(kib) => println!("rank {rank} shm_pss_kib {kib}"),
                Err(e) => {
                    println!("error: reading /proc/self/smaps: {e}");
                    return ExitCode::from(1);
                }
            }
        }
        "loop" => {
            let iters = extra.first().copied().unwrap_or(1000);
            let n = extra.get(1).copied().unwrap_or(1 << 16);
            let mut buf = vec![1.0f32; n];
            for i in 0..iters {
                if let Err(e) = comm.all_reduce_in_place(&mut buf, RedOp::Max) {
                    println!("error: {e}");
                    return ExitCode::from(3);
                }
                if i == 0 {
                    println!("ready");
                }
            }
        }
        "inplace-sum" => {
            // In-place Sum AllReduce, again and again with new values in
            // the buffer each time (as DDP's buckets), each result checked
            // against a plain sum over ranks (small integers: exact in f32).
            let iters = extra.first().copied().unwrap_or(100);
            let n = extra.get(1).copied().unwrap_or(1 << 18);
            let value =
                |r: u32, it: usize, i: usize| ((r as usize * 7 + it * 13 + i) % 1021) as f32;
            let mut buf = vec![0.0f32; n];
            for it in 0..iters {
                for (i, x) in buf.iter_mut().enumerate() {
                    *x = value(rank, it, i);
                }
                if let Err(e) = comm.all_reduce_in_place(&mut buf, RedOp::Sum) {
                    println!("error: {e}");
                    return ExitCode::from(3);
                }
                let want = |i: usize| (0..nranks).map(|r| value(r, it, i)).sum::<f32>();
                let wrong: Vec<usize> = (0..n).filter(|&i| buf[i] != want(i)).collect();
                if let Some(&i) = wrong.first() {
                    println!(
                        "rank {rank} inplace-sum: iteration {it}: {} of {n} elements wrong (first at {i}: {} instead of {})",
                        wrong.len(),
                        buf[i],
                        want(i)
                    );
                    return ExitCode::from(5);
                }
            }
            println!("rank {rank} inplace-sum: {iters} x {n} ok");
        }
        "mixed" => {
            // A long series of mixed collectives (fault tests): prints
            // "ready" once the first round completed.
            let iters = extra.first().copied().unwrap_or(1000);
            if let Err(e) = braid_tests::workload::mixed(&comm, iters, |i| {
                if i == 6 {
                    println!("ready");
                }
            }) {
                println!("error: {e}");
                return ExitCode::from(3);
            }
        }
        "elastic" => {
            // AllReduces until one fails (the harness kills or stops
            // `victim`), then shrink to the survivors and go on.
            let victim = extra.first().copied().unwrap_or(usize::MAX) as u32;
            let stall = extra.get(1) == Some(&1);
            return elastic(comm, victim, stall);
        }
        "resources" => {
            // What this rank holds after the default collectives (8-byte
            // and 1 MiB AllReduce), then after an AllToAll (every link):
            // threads, and shared-memory segments mapped (each link maps
            // its segment at both ends).
            let held = |when: &str| {
                let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
                let threads = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Threads:"))
                    .map(|v| v.trim().to_string())
                    .unwrap_or_default();
                let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
                let mut segs: Vec<&str> = maps
                    .lines()
                    .filter_map(|l| l.split_whitespace().nth(5))
                    .filter(|f| f.starts_with("/dev/shm/braid-"))
                    .collect();
                segs.sort_unstable();
                segs.dedup();
                println!(
                    "rank {rank} {when}: threads={threads} segments={}",
                    segs.len()
                );
            };
            let mut a = vec![1.0f32; 1 << 18];
            let mut small = [1u64];
            for _ in 0..3 {
                let r = comm
                    .all_reduce_in_place(&mut a, RedOp::Sum)
                    .and_then(|()| comm.all_reduce_in_place(&mut small, RedOp::Sum));
                if let Err(e) = r {
                    println!("error: {e}");
                    return ExitCode::from(3);
                }
            }
            held("allreduce");
            let p = nranks as usize;
            let send: Vec<u32> = (0..p * 3).map(|k| rank * 1000 + k as u32).collect();
            let mut out = vec![0u32; p * 3];
            if let Err(e) = comm.all_to_all(&send, &mut out) {
                println!("error: {e}");
                return ExitCode::from(3);
            }
            if out
                .iter()
                .enumerate()
                .any(|(k, &x)| x != (k / 3) as u32 * 1000 + rank * 3 + (k % 3) as u32)
            {
                println!("FAIL rank {rank}: wrong AllToAll result");
                return ExitCode::from(1);
            }
            held("alltoall");
        }
        "lazy" => {
            // AllReduces only (ring neighbours, recursive-doubling
            // partners: the links of creation), "ready", an idle pause
            // (the fault tests kill a rank then), then an AllToAll, whose
            // other links connect on first use.
            let pause = extra.first().copied().unwrap_or(1500);
            let mut a = vec![1.0f32; 1 << 16];
            let mut small = [1u32; 2];
            for i in 0..8 {
                let r = comm
                    .all_reduce_in_place(&mut a, RedOp::Sum)
                    .and_then(|()| comm.all_reduce_in_place(&mut small, RedOp::Sum));
                if let Err(e) = r {
                    println!("error: {e}");
                    return ExitCode::from(3);
                }
                if i == 0 {
                    println!("ready");
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(pause as u64));
            let p = nranks as usize;
            let send: Vec<u32> = (0..p * 4).map(|k| rank * 1000 + k as u32).collect();
            let mut out = vec![0u32; p * 4];
            if let Err(e) = comm.all_to_all(&send, &mut out) {
                println!("error: {e}");
                return ExitCode::from(3);
            }
            if out
                .iter()
                .enumerate()
                .any(|(k, &x)| x != (k / 4) as u32 * 1000 + rank * 4 + (k % 4) as u32)
            {
                println!("FAIL rank {rank}: wrong AllToAll result");
                return ExitCode::from(1);
            }
        }
        "late" => {
            // The last rank joins an AllReduce of 1 Mi f32 (ring) late.
            if rank == nranks - 1 {
                let ms = extra.first().copied().unwrap_or(2000);
                std::thread::sleep(std::time::Duration::from_millis(ms as u64));
            }
            let mut buf = vec![1.0f32; 1 << 20];
            if let Err(e) = comm.all_reduce_in_place(&mut buf, RedOp::Sum) {
                println!("error: {e}");
                return ExitCode::from(3);
            }
            if buf.iter().any(|&x| x != nranks as f32) {
                println!("FAIL rank {rank}: wrong AllReduce result");
                return ExitCode::from(1);
            }
        }
        "p2p" => {
            if let Err(e) = p2p(&comm).and_then(|()| rooted_and_v(&comm)) {
                println!("FAIL rank {rank}: {e}");
                return ExitCode::from(1);
            }
        }
        "mismatch" => {
            // 0: ranks call different collectives; 1: different counts;
            // 2: different roots; 3: rank 0 calls Barrier, the others the
            // one-byte AllReduce a barrier is planned as. Then an AllReduce
            // that everyone agrees on.
            let variant = extra.first().copied().unwrap_or(0);
            let mut a = vec![1.0f32; 100 + if variant == 1 { rank as usize } else { 0 }];
            let first = match variant {
                0 if rank == 0 => comm.all_reduce_in_place(&mut a, RedOp::Sum),
                0 => {
                    let mut g = vec![0f32; a.len() * nranks as usize];
                    comm.all_gather(&a, &mut g)
                }
                1 => comm.all_reduce_in_place(&mut a, RedOp::Sum),
                3 if rank == 0 => comm.barrier(),
                3 => comm.all_reduce_in_place(&mut [0u8], RedOp::Max),
                _ => comm.broadcast(&mut a, rank % 2),
            };
            let second = first.and_then(|_| comm.all_reduce_in_place(&mut [1u64; 8], RedOp::Sum));
            match second {
                Ok(()) => {
                    println!("FAIL rank {rank}: the mismatch went unnoticed");
                    return ExitCode::from(1);
                }
                Err(e) => {
                    println!("error: {e}");
                    return ExitCode::from(3);
                }
            }
        }
        "badinput" => {
            if let Err(e) = badinput(&comm) {
                println!("FAIL rank {rank}: {e}");
                return ExitCode::from(1);
            }
        }
        other => {
            eprintln!("unknown suite {other}");
            return ExitCode::from(2);
        }
    }
    println!("rank {rank}: ok");
    ExitCode::SUCCESS
}

/// The `elastic` suite: AllReduces of `rank + 1` (checked) until one fails;
/// then the ranks to drop: the ones whose process is gone (a kill), or, for
/// a stall, `victim` (a stalled process is alive: the job names it, as a
/// training job's own health check would); a rank whose wait timed out
/// revokes the communicator so that the others stop waiting at once. Then
/// shrink, three checked AllReduces on the survivors, and
/// `rank R recovered N after MS ms` (from the failure).
fn elastic(comm: Communicator, victim: u32, stall: bool) -> ExitCode {
    let (rank, n) = (comm.rank(), comm.nranks());
    let sum = |ranks: &mut dyn Iterator<Item = u32>| ranks.map(|r| r as u64 + 1).sum::<u64>();
    let mut done = 0u64;
    let err = loop {
        let mut v = vec![rank as u64 + 1; 4096];
        match comm.all_reduce_in_place(&mut v, RedOp::Sum) {
            Ok(()) => {
                let want = sum(&mut (0..n));
                if v.iter().any(|&x| x != want) {
                    println!("error: AllReduce #{done} gave {} instead of {want}", v[0]);
                    return ExitCode::from(5);
                }
                done += 1;
                if done == 20 {
                    println!("ready");
                }
            }
            Err(e) => break e,
        }
    };
    let t0 = Instant::now();
    println!("rank {rank} failed ({:?}): {err}", err.kind());
    let dropped = if stall {
        if err.kind() == braid::ErrorKind::Timeout {
            comm.revoke();
        }
        vec![victim]
    } else {
        // The victim's listener closes when the kernel reaps its sockets:
        // look again for a moment if it is not gone yet.
        let until = Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match comm.gone_ranks() {
                Ok(g) if !g.is_empty() => break g,
                Ok(_) if Instant::now() < until => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Ok(_) => {
                    println!("error: no rank is gone after the failure");
                    return ExitCode::from(3);
                }
                Err(e) => {
                    println!("error: gone_ranks: {e}");
                    return ExitCode::from(3);
                }
            }
        }
    };
    let t1 = Instant::now();
    let new = match comm.shrink(&dropped) {
        Ok(c) => c,
        Err(e) => {
            println!("error: shrink: {e}");
            return ExitCode::from(3);
        }
    };
    let t2 = Instant::now();
    let want = sum(&mut (0..n).filter(|r| !dropped.contains(r)));
    for k in 0..3 {
        let mut v = vec![rank as u64 + 1; 4096];
        if let Err(e) = new.all_reduce_in_place(&mut v, RedOp::Sum) {
            println!("error: AllReduce #{k} after the shrink: {e}");
            return ExitCode::from(3);
        }
        if v.iter().any(|&x| x != want) {
            println!(
                "error: AllReduce #{k} after the shrink gave {} instead of {want}",
                v[0]
            );
            return ExitCode::from(5);
        }
    }
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    println!(
        "rank {rank} recovered {} after {:.1} ms (finding the ranks {:.1}, shrink {:.1}, first AllReduces {:.1})",
        new.nranks(),
        ms(t0.elapsed()),
        ms(t1 - t0),
        ms(t2 - t1),
        ms(t2.elapsed())
    );
    drop(comm);
    ExitCode::SUCCESS
}

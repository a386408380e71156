//! A real N-rank AllReduce on this machine, one process per rank over shared
//! memory: checks the result, then measures bus bandwidth at 64 MiB, the
//! latency of an 8-byte AllReduce and that of a barrier.
//!
//! ```text
//! cargo run --release --example allreduce -- -n 4
//! ```
//!
//! The first process is a small launcher: it hosts the bootstrap root and
//! starts `-n` copies of itself as the ranks (what `braid-run` does for any
//! program).

use std::process::{Command, ExitCode};
use std::time::Instant;

use braid::{Communicator, Config, RedOp, UniqueId};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let result = if args.get(1).map(String::as_str) == Some("--rank") {
        rank_main(&args)
    } else {
        launcher(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn launcher(args: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    let mut n = 4u32;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "-n" | "--np" => n = it.next().ok_or("-n needs a number")?.parse()?,
            "-h" | "--help" => {
                println!("usage: allreduce [-n RANKS]   (default 4)");
                return Ok(());
            }
            other => {
                return Err(format!("unknown argument {other}; usage: allreduce [-n RANKS]").into())
            }
        }
    }
    if n == 0 {
        return Err("-n must be at least 1".into());
    }
    let (id, _root) = Communicator::unique_id("127.0.0.1:0".parse()?)?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for r in 0..n {
        children.push(
            Command::new(&exe)
                .args(["--rank", &r.to_string(), &n.to_string(), &id.to_string()])
                .spawn()?,
        );
    }
    let mut failed = false;
    for (r, mut c) in children.into_iter().enumerate() {
        let st = c.wait()?;
        if !st.success() {
            eprintln!("rank {r} failed: {st}");
            failed = true;
        }
    }
    if failed {
        return Err("some ranks failed".into());
    }
    Ok(())
}

fn rank_main(args: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    let rank: u32 = args.get(2).ok_or("missing rank")?.parse()?;
    let n: u32 = args.get(3).ok_or("missing nranks")?.parse()?;
    let id: UniqueId = args.get(4).ok_or("missing id")?.parse()?;
    let comm = Communicator::init(&id, rank, n, &Config::from_env()?)?;

    // 1. Correctness: rank r contributes r + 1 everywhere.
    let count = (64 << 20) / 4; // 64 MiB of f32
    let send = vec![(rank + 1) as f32; count];
    let mut recv = vec![0f32; count];
    comm.all_reduce(&send, &mut recv, RedOp::Sum)?;
    let want = (n * (n + 1) / 2) as f32;
    let wrong = recv.iter().filter(|&&x| x != want).count();
    if rank == 0 {
        println!(
            "braid AllReduce, {n} ranks (processes) over {}, f32 sum of 64 MiB:",
            comm.transports()
                .iter()
                .find(|t| **t != "self")
                .unwrap_or(&"nothing")
        );
        println!(
            "  result: every element = {} (expected {want}), {wrong} wrong",
            recv[0]
        );
    }
    if wrong > 0 {
        return Err(format!("rank {rank}: {wrong} wrong elements").into());
    }

    // 2. Bandwidth at 64 MiB (nccl-tests' algbw and busbw), slowest rank.
    let iters = 10;
    for _ in 0..2 {
        comm.all_reduce(&send, &mut recv, RedOp::Sum)?;
    }
    comm.barrier()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        comm.all_reduce(&send, &mut recv, RedOp::Sum)?;
    }
    let mut t = [t0.elapsed().as_secs_f64() / iters as f64];
    comm.all_reduce_in_place(&mut t, RedOp::Max)?;
    let bytes = (count * 4) as f64;
    let algbw = bytes / t[0] / 1e9;
    let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
    if rank == 0 {
        println!(
            "  64 MiB: {:.2} ms per AllReduce, algbw {algbw:.2} GB/s, busbw {busbw:.2} GB/s",
            t[0] * 1e3
        );
    }

    // 3. Latency of an 8-byte AllReduce (2 × f32).
    let mut small = [rank as f32, 1.0];
    let iters = 2000;
    for _ in 0..100 {
        comm.all_reduce_in_place(&mut small, RedOp::Sum)?;
    }
    comm.barrier()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        comm.all_reduce_in_place(&mut small, RedOp::Sum)?;
    }
    let mut t = [t0.elapsed().as_secs_f64() / iters as f64];
    comm.all_reduce_in_place(&mut t, RedOp::Max)?;
    if rank == 0 {
        println!("  8 bytes: {:.2} µs per AllReduce", t[0] * 1e6);
    }

    // 4. Latency of a barrier (over the same links).
    for _ in 0..100 {
        comm.barrier()?;
    }
    let t0 = Instant::now();
    for _ in 0..iters {
        comm.barrier()?;
    }
    let mut t = [t0.elapsed().as_secs_f64() / iters as f64];
    comm.all_reduce_in_place(&mut t, RedOp::Max)?;
    if rank == 0 {
        println!("  barrier: {:.2} µs", t[0] * 1e6);
    }
    Ok(())
}

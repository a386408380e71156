//! One rank of the resource measurement (`scripts/scale-table.sh`): joins
//! the communicator from the launcher's environment (`braid-run`), times the
//! creation, runs 8-byte and 1 MiB AllReduces, and prints one line with what
//! this rank holds:
//!
//! ```text
//! scale rank=3 nranks=16 init_ms=41.2 ar8_us=23.1 ar1m_us=912.0 threads=5 rss_kib=20480 hwm_kib=24576 shm_peak_kib=0
//! ```
//!
//! `threads` and `rss_kib` are read after the operations (every link they
//! need is connected by then); `hwm_kib` is the peak resident set. Rank 0
//! also samples the used space of `/dev/shm` every 5 ms from before the
//! creation to the end (`shm_peak_kib`, minus what was used at the start);
//! its sampler thread is not counted in `threads`. Only the public API is
//! used, so the same source measures any braid version.
//!
//! `braid-scale [ITERS_8B] [ITERS_1M]` (defaults 200 and 20).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid::{Communicator, RedOp};

fn status_field(name: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// KiB used in /dev/shm (tmpfs pages actually allocated).
fn shm_used_kib() -> u64 {
    match nix::sys::statvfs::statvfs("/dev/shm") {
        Ok(s) => {
            let used = s.blocks().saturating_sub(s.blocks_free());
            used * s.fragment_size() / 1024
        }
        Err(_) => 0,
    }
}

fn main() -> ExitCode {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let iters8 = args.first().copied().unwrap_or(200);
    let iters1m = args.get(1).copied().unwrap_or(20);
    let rank0 = std::env::var("BRAID_RANK").is_ok_and(|r| r == "0");
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let base = shm_used_kib();
    let sampler = rank0.then(|| {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(shm_used_kib().saturating_sub(base), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    });
    let t0 = Instant::now();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("braid-scale: init failed: {e}");
            return ExitCode::from(3);
        }
    };
    let init = t0.elapsed();
    let (rank, n) = (comm.rank(), comm.nranks());
    let run = || -> braid::Result<(f64, f64)> {
        let mut small = [1u64];
        for _ in 0..20 {
            comm.all_reduce_in_place(&mut small, RedOp::Sum)?;
        }
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters8 {
            comm.all_reduce_in_place(&mut small, RedOp::Sum)?;
        }
        let ar8 = t.elapsed().as_secs_f64() * 1e6 / iters8.max(1) as f64;
        let mut big = vec![1.0f32; (1 << 20) / 4];
        for _ in 0..3 {
            comm.all_reduce_in_place(&mut big, RedOp::Sum)?;
        }
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters1m {
            comm.all_reduce_in_place(&mut big, RedOp::Sum)?;
        }
        let ar1m = t.elapsed().as_secs_f64() * 1e6 / iters1m.max(1) as f64;
        comm.barrier()?;
        Ok((ar8, ar1m))
    };
    let (ar8, ar1m) = match run() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("braid-scale: rank {rank}: {e}");
            return ExitCode::from(3);
        }
    };
    let threads = status_field("Threads:") - u64::from(sampler.is_some());
    let rss = status_field("VmRSS:");
    let hwm = status_field("VmHWM:");
    // Everyone has measured before rank 0 stops sampling.
    let _ = comm.barrier();
    stop.store(true, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.join();
    }
    println!(
        "scale rank={rank} nranks={n} init_ms={:.1} ar8_us={ar8:.2} ar1m_us={ar1m:.1} threads={threads} rss_kib={rss} hwm_kib={hwm} shm_peak_kib={}",
        init.as_secs_f64() * 1e3,
        peak.load(Ordering::Relaxed)
    );
    ExitCode::SUCCESS
}

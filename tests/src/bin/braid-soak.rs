//! Soak: many thousands of mixed collectives on several communicators at
//! once, each rank a thread, every result checked; the process's resident
//! memory is sampled throughout and must stay flat after warm-up.
//!
//! ```text
//! cargo run --release -p braid-tests --bin braid-soak -- [COMMS] [RANKS] [ROUNDS]
//! ```
//!
//! Defaults: 3 communicators of 3 ranks (9 threads), 3000 rounds each. Half
//! of the communicators are split off a parent that also keeps running.
//! Exit status 1 on a wrong result or an error, 2 when memory grew.

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid::{Communicator, Config};
use braid_tests::workload::mixed;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() -> ExitCode {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let comms = args.first().copied().unwrap_or(3).max(1);
    let ranks = args.get(1).copied().unwrap_or(3).max(1) as u32;
    let rounds = args.get(2).copied().unwrap_or(3000).max(10);
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    // Communicators: even ones fresh, odd ones split off a fresh parent of
    // twice the size (the parent's other half is the next split's members).
    let mut groups: Vec<Vec<Communicator>> = Vec::new();
    while groups.len() < comms {
        match Communicator::init_threads(ranks, &config) {
            Ok(g) => groups.push(g),
            Err(e) => {
                eprintln!("error: init: {e}");
                return ExitCode::from(1);
            }
        }
        if groups.len() < comms {
            // A split of the group just made, keyed in reverse order.
            let parent = groups.last().cloned().unwrap_or_default();
            let hs: Vec<_> = parent
                .into_iter()
                .map(|c| std::thread::spawn(move || c.split(Some(0), u32::MAX - c.rank())))
                .collect();
            let mut kids = Vec::new();
            for h in hs {
                match h.join() {
                    Ok(Ok(Some(c))) => kids.push(c),
                    other => {
                        eprintln!("error: split: {other:?}");
                        return ExitCode::from(1);
                    }
                }
            }
            kids.sort_by_key(|c| c.rank());
            groups.push(kids);
        }
    }
    let done = Arc::new(AtomicUsize::new(0));
    let total = comms * ranks as usize * rounds;
    let start = Instant::now();
    let mut threads = Vec::new();
    for g in &groups {
        for c in g {
            let (c, done) = (c.clone(), done.clone());
            threads.push(std::thread::spawn(move || {
                mixed(&c, rounds, |_| {
                    done.fetch_add(1, Ordering::Relaxed);
                })
            }));
        }
    }
    // Sample resident memory against progress.
    let mut samples: Vec<(usize, u64)> = Vec::new();
    while threads.iter().any(|t| !t.is_finished()) {
        samples.push((done.load(Ordering::Relaxed), rss_kib()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let secs = start.elapsed().as_secs_f64();
    let mut failed = false;
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!("error: {e}");
                failed = true;
            }
            Err(_) => {
                eprintln!("error: a rank thread panicked");
                failed = true;
            }
        }
    }
    samples.push((done.load(Ordering::Relaxed), rss_kib()));
    let window = |lo: f64, hi: f64| {
        samples
            .iter()
            .filter(|(d, _)| (*d as f64) >= lo * total as f64 && (*d as f64) <= hi * total as f64)
            .map(|s| s.1)
            .max()
            .unwrap_or(0)
    };
    let warm = window(0.1, 0.3);
    let last = window(0.8, 1.0);
    let grew = last.saturating_sub(warm);
    println!(
        "soak: {comms} communicators x {ranks} ranks ({} threads), {} collectives in {secs:.1} s ({:.0}/s); \
         RSS after warm-up {} MiB, at the end {} MiB (growth {} KiB)",
        comms * ranks as usize,
        done.load(Ordering::Relaxed),
        done.load(Ordering::Relaxed) as f64 / secs,
        warm / 1024,
        last / 1024,
        grew
    );
    if failed {
        println!("soak: FAILED (wrong result or error above)");
        return ExitCode::from(1);
    }
    // Flat: under 8 MiB or 10 % of the warm size, whichever is larger.
    if warm == 0 || grew > (8 * 1024).max(warm / 10) {
        println!("soak: memory grew ({warm} KiB -> {last} KiB)");
        return ExitCode::from(2);
    }
    println!("soak: ok, every result checked, memory flat");
    ExitCode::SUCCESS
}

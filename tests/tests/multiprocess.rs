//! Multi-process tests over shared memory: each rank is its own process
//! (`braid-testrank`), the test process hosts the bootstrap root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use braid::{Communicator, RootServer, UniqueId};
use braid_tests::ranks::{assert_all_ok, braid_segments, fault_run, read_stderr, wait_all};

/// Multi-process tests run one at a time: each already starts several
/// processes on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn root() -> (UniqueId, RootServer) {
    Communicator::unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).expect("root")
}

fn spawn_rank(
    suite: &str,
    id: &UniqueId,
    rank: u32,
    n: u32,
    args: &[String],
    timeout_s: u32,
) -> Child {
    spawn_rank_env(suite, id, rank, n, args, timeout_s, &[])
}

fn spawn_rank_env(
    suite: &str,
    id: &UniqueId,
    rank: u32,
    n: u32,
    args: &[String],
    timeout_s: u32,
    env: &[(&str, &str)],
) -> Child {
    Command::new(env!("CARGO_BIN_EXE_braid-testrank"))
        .envs(env.iter().copied())
        .arg(suite)
        .arg(id.to_string())
        .arg(rank.to_string())
        .arg(n.to_string())
        .args(args)
        .env("BRAID_TIMEOUT", timeout_s.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn braid-testrank")
}

fn run_suite(suite: &str, n: u32, args: &[&str], limit: Duration) -> Vec<(Option<i32>, String)> {
    run_suite_env(suite, n, args, limit, &[])
}

fn run_suite_env(
    suite: &str,
    n: u32,
    args: &[&str],
    limit: Duration,
    env: &[(&str, &str)],
) -> Vec<(Option<i32>, String)> {
    let (id, _root) = root();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let kids = (0..n)
        .map(|r| spawn_rank_env(suite, &id, r, n, &args, 60, env))
        .collect();
    wait_all(kids, limit)
}

const SIZES: [&str; 5] = ["0", "1", "7", "1023", "1048579"]; // 2^20 + 3

fn matrix(n: u32) {
    matrix_env(n, &[]);
}

fn matrix_env(n: u32, env: &[(&str, &str)]) {
    let _g = serial();
    let res = run_suite_env("matrix", n, &SIZES, Duration::from_secs(600), env);
    for (_, out) in &res {
        print!("{out}");
    }
    assert_all_ok(&format!("matrix with {n} ranks"), &res);
}

#[test]
fn matrix_1_rank() {
    matrix(1);
}

#[test]
fn matrix_2_ranks() {
    matrix(2);
}

/// Three ranks with single-copy transfers off: every byte goes through the
/// slots (as for every collective below 8 MiB by default).
#[test]
fn matrix_3_ranks_two_copy() {
    // Every copy into a slot with streaming stores, as operations larger
    // than the cache do.
    matrix_env(
        3,
        &[
            ("BRAID_DIRECT_MIN_BYTES", "18446744073709551615"),
            ("BRAID_STREAM_MIN_BYTES", "0"),
        ],
    );
}

/// Four ranks with single copy for every collective (by default only
/// collectives of 8 MiB and more use it): pieces of 64 KiB and more are
/// read from the sender's memory.
#[test]
fn matrix_4_ranks_single_copy() {
    // Also every local copy with streaming stores (braid_core::copy), which
    // by default only collectives larger than the cache use, and direct
    // transfers shared with their senders in chunks of 4 KiB (by default
    // only transfers of 512 KiB and more are shared, in 256 KiB chunks).
    matrix_env(
        4,
        &[
            ("BRAID_SINGLE_COPY_MIN_BYTES", "0"),
            ("BRAID_STREAM_MIN_BYTES", "0"),
            ("BRAID_SHM_HELP_CHUNK", "4096"),
        ],
    );
}

/// Three ranks single-copy with the ring plans for AllGather and Broadcast
/// (`BRAID_DIRECT_MOVES=0`); single-copy, they read each block straight from
/// its owner (the matrix above covers that). Also every piece of 64 KiB and
/// more streamed into its slot, as links across dies do
/// (`BRAID_SLOT_STREAM=1`: reductions into a scratch buffer first, relayed
/// and reduced pieces through slots instead of by reference).
#[test]
fn matrix_3_ranks_single_copy_ring() {
    matrix_env(
        3,
        &[
            ("BRAID_SINGLE_COPY_MIN_BYTES", "0"),
            ("BRAID_DIRECT_MOVES", "0"),
            ("BRAID_SLOT_STREAM", "1"),
        ],
    );
}

#[test]
fn matrix_8_ranks() {
    matrix(8);
}

#[test]
fn point_to_point_and_groups() {
    let _g = serial();
    for n in [1, 2, 3, 4] {
        let res = run_suite("p2p", n, &[], Duration::from_secs(120));
        assert_all_ok(&format!("p2p with {n} ranks"), &res);
    }
    let single_copy = [("BRAID_DIRECT_MIN_BYTES", "4096")];
    let res = run_suite_env("p2p", 3, &[], Duration::from_secs(120), &single_copy);
    assert_all_ok("p2p with 3 ranks, single copy", &res);
}

/// `BRAID_TOPO_FILE` is read by every rank and merged with detection, as
/// NCCL merges `NCCL_TOPO_FILE`: with the 8-GPU server's file the
/// collectives still run over shm, and the file's InfiniBand ports, which
/// detection does not find on this VM, are dropped (the ring leaves through
/// a detected port, never `mlx5_*`). A file that cannot be parsed is an
/// error on every rank naming the file: the ranks read it.
#[test]
fn topology_file_is_merged_with_detection() {
    let _g = serial();
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/core/tests/fixtures/topo/nvswitch8.xml"
    );
    let res = run_suite_env(
        "matrix",
        3,
        &["1", "1023"],
        Duration::from_secs(120),
        &[("BRAID_TOPO_FILE", file)],
    );
    assert_all_ok("3 ranks with BRAID_TOPO_FILE", &res);
    for (r, (_, out)) in res.iter().enumerate() {
        assert!(out.contains("nic: "), "{out}");
        assert!(
            !out.contains("nic: mlx5_"),
            "rank {r} planned over a port detection did not find:\n{out}"
        );
        let line = out
            .lines()
            .find(|l| l.contains("transports: "))
            .unwrap_or("");
        assert!(
            line.contains("shm") && !line.contains("socket"),
            "rank {r}: {line}"
        );
    }
    let bad = std::env::temp_dir().join(format!("braid-bad-topo-{}.xml", std::process::id()));
    std::fs::write(&bad, "<system version=\"1\"><cpu numaid=\"0\"").unwrap();
    let res = run_suite_env(
        "matrix",
        2,
        &["1"],
        Duration::from_secs(120),
        &[("BRAID_TOPO_FILE", bad.to_str().unwrap())],
    );
    std::fs::remove_file(&bad).unwrap();
    for (r, (code, out)) in res.iter().enumerate() {
        assert_ne!(
            *code,
            Some(0),
            "rank {r} ran with a malformed topology file:\n{out}"
        );
        assert!(
            out.contains("braid-bad-topo-"),
            "rank {r}'s error does not name the file:\n{out}"
        );
    }
}

/// Ranks started bound to CPUs (each with the CPU list from
/// `BRAID_TEST_CPU`, `None`: unbound), run through a small matrix; returns
/// what each rank reported as `oversubscribed`.
fn oversubscription_seen(cpus: &[Option<usize>]) -> Vec<bool> {
    oversubscription_seen_in(cpus, "matrix", &["1", "1023"])
}

/// The same, through `suite` at `sizes` (elements).
fn oversubscription_seen_in(cpus: &[Option<usize>], suite: &str, sizes: &[&str]) -> Vec<bool> {
    let (id, _root) = root();
    let n = cpus.len() as u32;
    let args: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let kids = cpus
        .iter()
        .enumerate()
        .map(|(r, cpu)| {
            let c = cpu.map(|c| c.to_string());
            let env: Vec<(&str, &str)> = c.iter().map(|c| ("BRAID_TEST_CPU", c.as_str())).collect();
            spawn_rank_env(suite, &id, r as u32, n, &args, 60, &env)
        })
        .collect();
    let res = wait_all(kids, Duration::from_secs(300));
    assert_all_ok(&format!("ranks bound to {cpus:?}"), &res);
    res.iter()
        .enumerate()
        .map(|(r, (_, out))| {
            let line = out
                .lines()
                .find_map(|l| l.strip_prefix(&format!("rank {r} oversubscribed: ")))
                .unwrap_or_else(|| panic!("rank {r} printed no oversubscribed line:\n{out}"));
            line.trim() == "true"
        })
        .collect()
}

/// Whether ranks wait by spinning or yield at once follows how they share
/// CPUs, not how many CPUs each may use: ranks bound one per core (mpirun's
/// default for two ranks) spin, ranks bound to one core or more ranks than
/// cores yield.
#[test]
fn bound_ranks_are_not_taken_for_oversubscribed() {
    let _g = serial();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("SKIP: needs 2 CPUs to bind two ranks apart (this process may use {cores})");
        return;
    }
    // The CPUs this test may use (CI may restrict them).
    let mut mine = Vec::new();
    let all = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).expect("affinity");
    for c in 0..nix::sched::CpuSet::count() {
        if all.is_set(c).unwrap_or(false) {
            mine.push(c);
        }
    }
    let (a, b) = (mine[0], mine[1]);
    assert_eq!(oversubscription_seen(&[Some(a), Some(b)]), [false, false]);
    assert_eq!(oversubscription_seen(&[Some(a), Some(a)]), [true, true]);
    // Two on one core, a third alone on another.
    assert_eq!(
        oversubscription_seen(&[Some(a), Some(b), Some(a)]),
        [true, false, true]
    );
    // Unbound: oversubscribed exactly when there are more ranks than CPUs.
    let n = mine.len() + 1;
    assert_eq!(oversubscription_seen(&vec![None; n]), vec![true; n]);
    // Where they disagree, the single-copy threshold that follows from it
    // (`tuning::direct_min_default`: 16 KiB per rank on free CPUs, else 64)
    // must still be one for all, or plans cut pieces differently: 40000
    // elements put the 160 KB f32 Broadcast, AllGather and AllToAll on 3
    // ranks between 3 x 16 KiB and 3 x 64 KiB, single-copy on the rank with
    // a core of its own and not on the others had each kept its own (a
    // wrong piece, every rank failing).
    assert_eq!(
        oversubscription_seen_in(&[Some(a), Some(b), Some(a)], "quick-matrix", &["40000"]),
        [true, false, true]
    );
}

/// Single-copy settings that differ between ranks are an error at creation
/// on every rank, naming the variable and the ranks, within seconds: plans
/// cut pieces by them, and different pieces left every rank waiting to the
/// timeout for one that never came.
#[test]
fn different_single_copy_settings_are_named_at_creation() {
    let _g = serial();
    for var in ["BRAID_SINGLE_COPY_MIN_BYTES", "BRAID_DIRECT_MIN_BYTES"] {
        let (id, _root) = root();
        let args: Vec<String> = vec!["40000".into()];
        let t0 = std::time::Instant::now();
        let kids = (0..2u32)
            .map(|r| {
                let env: &[(&str, &str)] = if r == 1 { &[(var, "1048576")] } else { &[] };
                spawn_rank_env("quick-matrix", &id, r, 2, &args, 60, env)
            })
            .collect();
        let res = wait_all(kids, Duration::from_secs(120));
        for (r, (code, out)) in res.iter().enumerate() {
            assert_ne!(
                *code,
                Some(0),
                "rank {r} ran with {var} set on rank 1 only:\n{out}"
            );
            assert!(
                out.contains(var) && out.contains("rank 0") && out.contains("rank 1"),
                "rank {r}'s error does not name {var} and both ranks:\n{out}"
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{var}: {:?}",
            t0.elapsed()
        );
    }
}

/// A topology file that cannot be read is an error on every rank, naming the
/// file; nothing falls back to detection silently.
#[test]
fn unreadable_topology_file_is_an_error() {
    let _g = serial();
    let res = run_suite_env(
        "matrix",
        2,
        &["1"],
        Duration::from_secs(120),
        &[("BRAID_TOPO_FILE", "/nonexistent/braid-topo.xml")],
    );
    for (r, (code, out)) in res.iter().enumerate() {
        assert_eq!(*code, Some(4), "rank {r}: {out}");
        assert!(
            out.contains("topology") && out.contains("/nonexistent/braid-topo.xml"),
            "rank {r}: {out}"
        );
    }
}

/// `BRAID_DUMP_SIGNAL=USR1`: the signal makes a rank print what each of its
/// communicators is doing. Rank 2 joins an AllReduce late; a dump taken
/// meanwhile shows rank 0 inside AllReduce #0 waiting for a peer, and rank 2
/// idle; a stall past `BRAID_STALL_WARN` is logged at WARN too.
#[test]
fn dump_signal_shows_who_waits_for_whom() {
    let _g = serial();
    let (id, _root) = root();
    let mut kids: Vec<Child> = (0..3)
        .map(|r| {
            Command::new(env!("CARGO_BIN_EXE_braid-testrank"))
                .args(["late", &id.to_string(), &r.to_string(), "3", "3000"])
                .env("BRAID_TIMEOUT", "60")
                .env("BRAID_DUMP_SIGNAL", "USR1")
                .env("BRAID_DEBUG", "WARN")
                .env("BRAID_STALL_WARN", "0.5")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    for k in &kids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(k.id() as i32),
            nix::sys::signal::Signal::SIGUSR1,
        );
    }
    let errs = read_stderr(&mut kids);
    let res = wait_all(kids, Duration::from_secs(60));
    let errs: Vec<String> = errs
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    assert_all_ok("late rank", &res);
    print!("{}{}", errs[0], errs[2]);
    assert!(
        errs[0].contains("rank 0/3")
            && errs[0].contains("AllReduce #0 running")
            && errs[0].contains("waiting"),
        "rank 0's dump:\n{}",
        errs[0]
    );
    assert!(
        errs[2].contains("rank 2/3") && errs[2].contains("idle after 0"),
        "rank 2's dump:\n{}",
        errs[2]
    );
    assert!(
        errs[0].contains("stalled"),
        "rank 0 logged no stall:\n{}",
        errs[0]
    );
}

#[test]
fn bad_input_is_rejected_before_anything_is_sent() {
    let _g = serial();
    let res = run_suite("badinput", 3, &[], Duration::from_secs(120));
    assert_all_ok("bad input", &res);
    for (r, (_, out)) in res.iter().enumerate() {
        assert!(
            out.contains("length mismatch: rejected"),
            "rank {r}:\n{out}"
        );
        assert!(
            out.contains("root out of range: rejected"),
            "rank {r}:\n{out}"
        );
        assert!(out.contains("count overflow: rejected"), "rank {r}:\n{out}");
    }
}

/// kill -9 one rank in the middle of a long series of AllReduces: every
/// other rank returns an error well within the timeout, and /dev/shm holds
/// nothing of braid afterwards.
#[test]
fn killed_rank_gives_errors_not_hangs() {
    let _g = serial();
    let n = 4u32;
    let victim = 2u32;
    let timeout_s = 20;
    let (id, _root) = root();
    let args = vec!["1000000".to_string(), "65536".to_string()];
    let kids: Vec<Child> = (0..n)
        .map(|r| spawn_rank("loop", &id, r, n, &args, timeout_s))
        .collect();
    let out = fault_run(
        kids,
        |k| {
            let _ = k[victim as usize].kill();
        },
        Duration::from_secs(timeout_s as u64 + 10),
    );
    for (r, (code, text)) in out.ranks.iter().enumerate() {
        if r as u32 == victim {
            continue;
        }
        println!("rank {r}: {text}");
        assert_eq!(*code, Some(3), "rank {r} should fail its AllReduce: {text}");
        // The ring neighbours see the victim directly; the others learn it
        // from a neighbour's abort, which carries the cause along.
        assert!(
            text.contains("rank 2"),
            "rank {r} does not name the dead rank: {text}"
        );
    }
    assert!(
        out.elapsed < Duration::from_secs(timeout_s as u64),
        "survivors took {:?}; they should notice the dead peer before the timeout",
        out.elapsed
    );
    assert_eq!(
        braid_segments(),
        Vec::<String>::new(),
        "segments left in /dev/shm"
    );
}

/// Ranks that call different collectives, counts or roots get an error that
/// says what each side called, instead of a hang or garbage.
#[test]
fn mismatched_calls_are_errors_naming_both_sides() {
    let _g = serial();
    for (variant, n, want) in [
        ("0", 2, "AllGather"),
        ("1", 3, "count=10"),
        ("2", 2, ""),
        ("3", 3, "uint8, max) #0"),
    ] {
        let res = run_suite("mismatch", n, &[variant], Duration::from_secs(60));
        for (r, (code, out)) in res.iter().enumerate() {
            println!("variant {variant} rank {r}: {out}");
            assert_eq!(*code, Some(3), "variant {variant} rank {r}: {out}");
            assert!(out.contains(want), "variant {variant} rank {r}: {out}");
        }
        assert!(
            res.iter().any(|(_, o)| o.contains("called")),
            "variant {variant}: no rank said what the other called"
        );
        // A peer's abort reason can be cut short; rank 0's own error says
        // what it called.
        if variant == "3" {
            assert!(res[0].1.contains("called Barrier #0"), "{}", res[0].1);
        }
    }
}

/// The fault tests' mixed workload (every collective, sizes up to 160 KB,
/// back to back) with every piece of 64 KiB and more single-copy and shared
/// with its sender in 4 KiB chunks, 4 ranks on 2 cores.
#[test]
fn mixed_workload_with_shared_copies() {
    let _g = serial();
    let env = [
        ("BRAID_SINGLE_COPY_MIN_BYTES", "0"),
        ("BRAID_SHM_HELP_CHUNK", "4096"),
    ];
    let res = run_suite_env("mixed", 4, &["1400"], Duration::from_secs(300), &env);
    assert_all_ok("mixed workload, shared single copies, 4 ranks", &res);
}

/// The numbers `rank R WHEN: threads=T segments=S` of every rank.
fn held(res: &[(Option<i32>, String)], when: &str) -> Vec<(u32, u32)> {
    res.iter()
        .map(|(code, out)| {
            assert_eq!(*code, Some(0), "{out}");
            let line = out
                .lines()
                .find(|l| l.contains(&format!(" {when}: threads=")))
                .unwrap_or_else(|| panic!("no {when} line in {out}"));
            let num = |k: &str| -> u32 {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{k} in {line}"))
            };
            (num("threads="), num("segments="))
        })
        .collect()
}

/// What a rank holds grows with the links it uses (issue 23, the small
/// case of its goals): 8 ranks over shared memory map the segments of the
/// ring and recursive-doubling links after AllReduces (2 x 4 at most: each
/// link at both ends), all 2 x 7 once an AllToAll has used every link, and
/// all of them from the start with `BRAID_CONNECT=eager`; over forced
/// sockets a rank has as many threads with 6 ranks as with 3 (one progress
/// thread for all its sockets).
#[test]
fn what_a_rank_holds_grows_with_the_links_it_uses() {
    let _g = serial();
    let limit = Duration::from_secs(120);
    let res = run_suite("resources", 8, &[], limit);
    let lazy = held(&res, "allreduce");
    let all = held(&res, "alltoall");
    println!("shm, 8 ranks (threads, segments): after AllReduce {lazy:?}, after AllToAll {all:?}");
    for (r, (&(_, l), &(_, a))) in lazy.iter().zip(&all).enumerate() {
        assert!(l <= 8, "rank {r}: {l} segments after AllReduce (lazy)");
        assert_eq!(a, 14, "rank {r}: every link after AllToAll");
    }
    let res = run_suite_env("resources", 8, &[], limit, &[("BRAID_CONNECT", "eager")]);
    for (r, &(_, s)) in held(&res, "allreduce").iter().enumerate() {
        assert_eq!(s, 14, "rank {r}: eager connects every pair at creation");
    }
    let sock = [("BRAID_TRANSPORT", "socket")];
    let three = held(
        &run_suite_env("resources", 3, &[], limit, &sock),
        "alltoall",
    );
    let six = held(
        &run_suite_env("resources", 6, &[], limit, &sock),
        "alltoall",
    );
    println!("socket, threads per rank: 3 ranks {three:?}, 6 ranks {six:?}");
    let most = |v: &[(u32, u32)]| v.iter().map(|x| x.0).max().unwrap_or(0);
    assert!(
        most(&six) <= most(&three) && most(&six) <= 4,
        "threads per rank: {three:?} with 3 ranks, {six:?} with 6"
    );
}

/// Shared memory follows use (issue 32, item 1): 16 ranks run every
/// collective once at 8 B, 4 KiB, 64 KiB and 1 MiB, AllToAll included, so
/// every pair of ranks exchanges data. Each rank reports its share of the
/// braid segments mapped in it (Pss), measured between two barriers; the
/// shares add up to the job's shared memory. Before, each link allocated
/// its whole slot ring (2 MiB) when it was created: about 480 MiB here.
/// Now a slot's pages are allocated when a message first goes through
/// them; the bound is the 400 MiB at 32 ranks scaled to 16 (links
/// grow with the square of the ranks).
#[test]
fn shared_memory_follows_use() {
    let _g = serial();
    let sizes = ["2", "1024", "16384", "262144"];
    let res = run_suite("memory", 16, &sizes, Duration::from_secs(300));
    assert_all_ok("memory", &res);
    let kib: u64 = res
        .iter()
        .map(|(_, out)| {
            out.lines()
                .find_map(|l| l.split_once(" shm_pss_kib ").map(|(_, v)| v.trim()))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no shm_pss_kib line in:\n{out}"))
        })
        .sum();
    println!(
        "16 ranks, every collective once up to 1 MiB: {:.1} MiB of shared memory",
        kib as f64 / 1024.0
    );
    assert!(
        kib > 0,
        "no braid segment mapped: the measurement is broken"
    );
    assert!(
        kib <= 96 * 1024,
        "16 ranks hold {kib} KiB of shared memory after every collective once"
    );
}

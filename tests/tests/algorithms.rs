//! Every algorithm end to end: ranks as processes (`braid-testrank`'s
//! quick matrix: every collective, in and out of place, over f32, i8 and
//! f64 with sum and avg, checked against the reference — the simulator's
//! tests cover every datatype and operator) with `BRAID_ALGO` forcing each one, on
//! one host and across emulated hosts; the tuner's own picks across hosts;
//! bad settings rejected at creation. The measured comparison of the
//! algorithms lives in `braid-algo-bench` (scripts/algo-bench.sh); a small
//! timed case of it runs here.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use braid::{Communicator, RootServer, UniqueId};
use braid_tests::netns::Hosts;
use braid_tests::ranks::{assert_all_ok, wait_all};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn root_at(ip: IpAddr) -> (UniqueId, RootServer) {
    Communicator::unique_id(SocketAddr::new(ip, 0)).expect("root")
}

/// A rules file (`BRAID_TUNING_FILE`) in a directory of this test
/// process's own, removed when dropped.
struct RulesFile {
    dir: std::path::PathBuf,
    file: std::path::PathBuf,
}

impl RulesFile {
    fn new(tag: &str, text: &str) -> RulesFile {
        let dir = std::env::temp_dir().join(format!("braid-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = RulesFile {
            file: dir.join("rules.json"),
            dir,
        };
        r.write(text);
        r
    }

    fn write(&self, text: &str) {
        std::fs::write(&self.file, text).unwrap();
    }

    fn path(&self) -> &str {
        self.file.to_str().unwrap()
    }
}

impl Drop for RulesFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `matrix` over `sizes` on ranks placed on `hosts` (`None`: this
/// host), with `env`; returns each rank's exit code and output.
fn matrix(
    h: Option<&Hosts>,
    placement: &[usize],
    sizes: &[&str],
    env: &[(&str, &str)],
) -> Vec<(Option<i32>, String)> {
    suite(h, placement, "quick-matrix", sizes, env)
}

/// Runs `braid-testrank`'s suite `name` with `args` on ranks placed on
/// `hosts` (`None`: this host), with `env`; returns each rank's exit code
/// and output.
fn suite(
    h: Option<&Hosts>,
    placement: &[usize],
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Vec<(Option<i32>, String)> {
    let ip = h.map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |h| h.root_addr());
    let (id, _root) = root_at(ip);
    let n = placement.len();
    let exe = env!("CARGO_BIN_EXE_braid-testrank");
    let kids = placement
        .iter()
        .enumerate()
        .map(|(r, &host)| {
            let mut c = match h {
                Some(h) => h.command(host, exe),
                None => Command::new(exe),
            };
            c.arg(name)
                .arg(id.to_string())
                .arg(r.to_string())
                .arg(n.to_string())
                .args(args)
                .env("BRAID_TIMEOUT", "60")
                .env_remove("BRAID_HOST_ID")
                .env_remove("BRAID_TRANSPORT")
                .env_remove("BRAID_ALGO")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn braid-testrank")
        })
        .collect();
    wait_all(kids, Duration::from_secs(600))
}

/// The `allreduce N f32: ALGO by SOURCE` lines of rank 0.
fn picks(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("rank 0 allreduce"))
        .map(str::to_string)
        .collect()
}

const FORCED: [&str; 7] = [
    "ring",
    "direct",
    "rd",
    "rabenseifner",
    "tree",
    "bruck",
    "hier",
];

/// Three ranks on this host (not a power of two), each algorithm forced:
/// those that cannot run a collective leave it to braid's defaults.
#[test]
fn every_algorithm_forced_on_one_host() {
    let _g = serial();
    for algo in FORCED {
        let res = matrix(None, &[0; 3], &["7", "65539"], &[("BRAID_ALGO", algo)]);
        assert_all_ok(&format!("BRAID_ALGO={algo}, 3 ranks"), &res);
        if ["ring", "rd", "rabenseifner", "tree"].contains(&algo) {
            let p = picks(&res[0].1);
            assert!(
                !p.is_empty()
                    && p.iter()
                        .all(|l| l.ends_with(&format!(": {algo} by forced"))),
                "{algo}: {p:?}"
            );
        }
    }
    // Large enough for single-copy moves (the matrix's 8-byte types at
    // 2^20 + 3 elements exceed 8 MiB), with the algorithms that send by
    // reference.
    for algo in ["rabenseifner", "bruck,tree"] {
        let res = matrix(None, &[0; 3], &["1048579"], &[("BRAID_ALGO", algo)]);
        assert_all_ok(&format!("BRAID_ALGO={algo}, 3 ranks, 8 MiB"), &res);
    }
}

/// Per-collective forcing and a rules file; an unknown algorithm, an
/// algorithm that cannot run the collective it is given, and a bad rules
/// file are errors at creation that say what would do.
#[test]
fn forcing_per_collective_rules_and_bad_settings() {
    let _g = serial();
    let res = matrix(
        None,
        &[0; 3],
        &["5"],
        &[("BRAID_ALGO", "allreduce:hier(rd),allgather:bruck,tree")],
    );
    assert_all_ok("per-collective BRAID_ALGO", &res);
    assert_eq!(
        picks(&res[0].1),
        vec!["rank 0 allreduce 5 f32: hier(rd) by forced"]
    );
    let rules = RulesFile::new(
        "rules",
        r#"{ "rules": [ { "collective": "allreduce", "max_bytes": 64, "algorithm": "tree" },
                        { "collective": "allreduce", "algorithm": "rabenseifner" } ] }"#,
    );
    let path = rules.path();
    let res = matrix(
        None,
        &[0; 3],
        &["5", "1000"],
        &[("BRAID_TUNING_FILE", path)],
    );
    assert_all_ok("rules file", &res);
    assert_eq!(
        picks(&res[0].1),
        vec![
            "rank 0 allreduce 5 f32: tree by rule",
            "rank 0 allreduce 1000 f32: rabenseifner by rule"
        ]
    );
    rules.write(r#"{ "rules": [ { "collective": "allgather", "algorithm": "rd" } ] }"#);
    for (env, want) in [
        (
            ("BRAID_ALGO", "butterfly"),
            "known ones are ring, direct, rd, rabenseifner, tree, bruck, hier",
        ),
        (
            ("BRAID_ALGO", "broadcast:bruck"),
            "bruck cannot run broadcast",
        ),
        (("BRAID_TUNING_FILE", path), "rd cannot run allgather"),
    ] {
        let res = matrix(None, &[0; 2], &["1"], &[env]);
        for (r, (code, out)) in res.iter().enumerate() {
            assert_eq!(*code, Some(4), "{env:?}: rank {r}: {out}");
            assert!(out.contains(want), "{env:?}: rank {r}: {out}");
        }
    }
}

fn hosts(n: usize) -> Option<Hosts> {
    if let Err(why) = Hosts::available() {
        println!("skipping: emulated hosts unavailable: {why}");
        return None;
    }
    Some(Hosts::new(n).expect("creating emulated hosts"))
}

/// Two emulated hosts of two ranks: the hierarchical AllReduce over shm
/// inside and sockets across, every algorithm forced, and the tuner's own
/// picks (which measure the network at the first call).
#[test]
fn across_emulated_hosts() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    let placement = [0, 0, 1, 1];
    for algo in ["hier", "rabenseifner", "tree", "bruck"] {
        let res = matrix(
            Some(&h),
            &placement,
            &["7", "65539"],
            &[("BRAID_ALGO", algo)],
        );
        assert_all_ok(&format!("BRAID_ALGO={algo}, 2 hosts x 2"), &res);
    }
    let res = matrix(
        Some(&h),
        &placement,
        &["1", "300000"],
        &[("BRAID_DEBUG", "INFO")],
    );
    assert_all_ok("tuner, 2 hosts x 2", &res);
    let p = picks(&res[0].1);
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(
        p.iter()
            .all(|l| l.ends_with("by model") || l.ends_with("by timed")),
        "{p:?}"
    );
    // A rules file's wide trial margin times every collective's leading
    // candidates at every size, single-copy ones included: a trial runs
    // each as the call would (it failed once on a plan cut for references
    // run through slots: 'piece of 2097152 bytes does not fit').
    let rules = RulesFile::new("wide", r#"{ "trial_margin": 100 }"#);
    let res = matrix(
        Some(&h),
        &placement,
        &["1", "300000"],
        &[("BRAID_DEBUG", "INFO"), ("BRAID_TUNING_FILE", rules.path())],
    );
    assert_all_ok("tuner timing everything, 2 hosts x 2", &res);
    let p = picks(&res[0].1);
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p.iter().all(|l| l.ends_with("by timed")), "{p:?}");
}

/// Pieces go by reference over sockets (from 64 KiB) only in plans that
/// leave a region they sent unchanged until the receiver has it: recursive
/// doubling reduces the partner's reply into the region it has just sent,
/// which may still be on its way out of the progress thread. In-place Sum
/// AllReduce with new values each time (as DDP's buckets), 2 hosts of one
/// rank, each algorithm forced, every result checked (without the rule,
/// `rd` gave wrong sums at 1 MiB).
#[test]
fn sent_regions_stay_unchanged_until_read() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    for algo in ["rd", "ring", "rabenseifner"] {
        for n in ["262144", "40000"] {
            let res = suite(
                Some(&h),
                &[0, 1],
                "inplace-sum",
                &["600", n],
                &[("BRAID_ALGO", algo)],
            );
            assert_all_ok(&format!("BRAID_ALGO={algo}, {n} f32, 2 hosts"), &res);
        }
    }
}

/// Two emulated hosts of one rank, with the model's link costs given by a
/// rules file (1 µs, 1 GB/s between hosts: on two ranks recursive
/// doubling, the ring and Rabenseifner then move the same bytes and differ
/// by a latency or two, far inside the trial margin): the tuner times them
/// at the first call of each size, and every rank runs the same pick; the
/// matrix checks every collective's results against the reference with
/// whatever was picked. With the rules file's `trial_margin` at 0 nothing
/// is timed, nor where the first runs of the candidates overrun its
/// `trial_budget_ms`.
#[test]
fn the_tuner_times_close_candidates_alike_on_every_rank() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    let rules = RulesFile::new("trials", "{}");
    let sizes = ["65539", "300000"];
    let links = r#""links": { "net": { "latency_us": 1, "gbps": 1, "overhead_us": 0.1 } }"#;
    // The default margin times the close candidates; a margin of 0 times
    // nothing, leaving the model's pick.
    for (margin, source) in [("", "by timed"), (r#", "trial_margin": 0"#, "by model")] {
        rules.write(&format!("{{ {links}{margin} }}"));
        let res = matrix(
            Some(&h),
            &[0, 1],
            &sizes,
            &[("BRAID_DEBUG", "INFO"), ("BRAID_TUNING_FILE", rules.path())],
        );
        assert_all_ok("tuner, 2 hosts x 1", &res);
        let lines = |r: usize| -> Vec<String> {
            let head = format!("rank {r} allreduce");
            res[r]
                .1
                .lines()
                .filter_map(|l| l.strip_prefix(&head).map(str::to_string))
                .collect()
        };
        let (p0, p1) = (lines(0), lines(1));
        assert_eq!(p0.len(), sizes.len(), "{p0:?}");
        assert_eq!(p0, p1, "the ranks run different algorithms");
        assert!(p0.iter().all(|l| l.ends_with(source)), "{margin}: {p0:?}");
    }
    // A budget that the estimates of one-element AllReduces on links said
    // to be nearly free fit by far, but that the real first runs (over
    // sockets: tens of µs at least) do not: the model's pick stands.
    let fast = r#"{ "links": { "net": { "latency_us": 0.001, "gbps": 100000, "overhead_us": 0 } },
                    "trial_margin": 100, "trial_budget_ms": 0.005 }"#;
    let file = braid_core::tune::Rules::parse(fast).unwrap();
    let mut costs = braid_core::tune::Costs::defaults(braid_core::transport::TransportKind::Socket);
    costs.net = file.links.and_then(|l| l.net).unwrap();
    let shape = braid_core::tune::Shape::uniform(2, 1, 1 << 19);
    let kind = braid_core::plan::CollKind::AllReduce;
    let planned = braid_core::tune::trial(&costs, &shape, kind, 4, file.trial_limits());
    assert!(planned.is_some(), "the estimates must allow a trial");
    rules.write(fast);
    let res = matrix(
        Some(&h),
        &[0, 1],
        &["1"],
        &[("BRAID_DEBUG", "INFO"), ("BRAID_TUNING_FILE", rules.path())],
    );
    assert_all_ok("tuner, trial budget, 2 hosts x 1", &res);
    let p = picks(&res[0].1);
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].ends_with("by model"), "{p:?}");
}

/// The emulated-host measurement in small (the full table is
/// `scripts/algo-bench.sh`): four hosts of one rank, each link delayed
/// 0.5 ms each way and limited to 200 Mbit/s, every algorithm forced and
/// then the tuner. At latency-bound sizes the tuner, calibrated on these
/// links at its first call, must pick a log2 p-step algorithm, not the ring
/// (2(p − 1) steps), and every forced run must complete. The times are
/// printed, not asserted: one round of a few milliseconds on a shared VM
/// swings by 1.7× (a CI run saw the tuner's recursive doubling at 2.1 ms
/// and the same algorithm forced at 1.3 ms); the comparison of times is
/// the benchmark's job.
#[test]
fn emulated_hosts_the_tuner_picks_a_log_step_algorithm_when_latency_bound() {
    use braid_tests::algobench::{make_hosts, measure_cell, table, Cell, Setup};
    let _g = serial();
    if let Err(why) = Hosts::available() {
        println!("skipping: emulated hosts unavailable: {why}");
        return;
    }
    let delayer = std::path::PathBuf::from(env!("CARGO_BIN_EXE_braid-netdelay"));
    let perf = delayer.with_file_name("braid-perf");
    if !perf.exists() {
        println!(
            "skipping: {} not built (cargo build -p braid-perf)",
            perf.display()
        );
        return;
    }
    let s = Setup {
        hosts: 4,
        per_host: 1,
        delay_us: 500,
        rate_mbit: 200,
        perf,
        delayer,
        iters: |_| 10,
        alone: true,
        workdir: std::env::temp_dir().join(format!("braid-algo-ci-{}", std::process::id())),
    };
    std::fs::create_dir_all(&s.workdir).unwrap();
    let h = make_hosts(&s).expect("emulated hosts");
    let mut port = 21000 + (std::process::id() % 10000) as u16;
    let mut rows = Vec::new();
    for cell in ["all_reduce:8", "all_reduce:1K"] {
        let cell = Cell::parse(cell).unwrap();
        let ms = measure_cell(&h, &s, &cell, &mut port, 1).unwrap_or_else(|e| panic!("{e}"));
        rows.push((cell, ms));
    }
    println!("{}", table(&s, &rows));
    for (cell, ms) in &rows {
        for algo in ["ring", "rd", "rabenseifner", "tree"] {
            assert!(
                ms.iter().any(|m| m.forced.as_deref() == Some(algo)),
                "{}: no run with {algo} forced",
                cell.name()
            );
        }
        let tuner = ms
            .iter()
            .find(|m| m.forced.is_none())
            .unwrap_or_else(|| panic!("{}: no tuner run", cell.name()));
        // "rd (model)": the algorithm, then what chose it.
        let picked = tuner.algorithm.split_whitespace().next().unwrap_or("");
        assert!(
            ["rd", "rabenseifner", "tree"].contains(&picked),
            "{}: the tuner picked {:?} on latency-bound links",
            cell.name(),
            tuner.algorithm
        );
    }
    let _ = std::fs::remove_dir_all(&s.workdir);
}

/// Ranks on three emulated hosts that call different collectives, counts
/// or roots (`braid-testrank mismatch`) get the error that says what each
/// side called, also where the tuner runs programs of its own for the call
/// (its trials, timing every candidate with a wide margin): those carry the
/// call's headers. Before, the trials ran apart until a wrong piece ('sent
/// a piece of 432 bytes where 8 were expected') or the deadline.
#[test]
fn mismatched_calls_across_hosts_are_errors_naming_both_sides() {
    let _g = serial();
    let Some(h) = hosts(3) else { return };
    let rules = RulesFile::new("mismatch", r#"{ "trial_margin": 100 }"#);
    let wide = [("BRAID_TUNING_FILE", rules.path())];
    for env in [&wide[..], &[]] {
        for (variant, want) in [
            ("0", "AllGather(count=100"),
            ("1", "count=102"),
            // Two roots that only send can both finish: the next call
            // finds the mismatch (as on one host).
            ("2", "float, root="),
            ("3", "called Barrier #0"),
        ] {
            let res = suite(Some(&h), &[0, 1, 2], "mismatch", &[variant], env);
            for (r, (code, out)) in res.iter().enumerate() {
                println!("{env:?} variant {variant} rank {r}: {out}");
                assert_eq!(*code, Some(3), "variant {variant} rank {r}: {out}");
                assert!(
                    out.contains(want) && out.contains(" where rank "),
                    "{env:?} variant {variant} rank {r}: {out}"
                );
            }
        }
    }
}

//! Multi-process tests over shared memory: each rank is its own process
//! (`braid-testrank`), the test process hosts the bootstrap root.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use braid::{Communicator, RootServer, UniqueId};

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

/// Wait for every child up to `limit`; kill all of them past it.
fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<(Option<i32>, String)> {
    let start = Instant::now();
    let mut children: Vec<(Child, std::thread::JoinHandle<String>)> = children
        .into_iter()
        .map(|mut c| {
            let out = c.stdout.take().expect("stdout");
            let reader = std::thread::spawn(move || {
                let mut s = String::new();
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    s.push_str(&line);
                    s.push('\n');
                }
                s
            });
            (c, reader)
        })
        .collect();
    let mut status: Vec<Option<Option<i32>>> = vec![None; children.len()];
    while status.iter().any(|s| s.is_none()) {
        for (i, (c, _)) in children.iter_mut().enumerate() {
            if status[i].is_none() {
                if let Ok(Some(st)) = c.try_wait() {
                    status[i] = Some(st.code());
                }
            }
        }
        if start.elapsed() > limit {
            for (c, _) in children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!("ranks still running after {limit:?}: a hang");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    children
        .into_iter()
        .zip(status)
        .map(|((_, r), st)| (st.flatten(), r.join().unwrap_or_default()))
        .collect()
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

fn assert_all_ok(what: &str, res: &[(Option<i32>, String)]) {
    for (r, (code, out)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "{what}: rank {r} failed:\n{out}");
        assert!(
            out.contains(&format!("rank {r}: ok")),
            "{what}: rank {r}:\n{out}"
        );
    }
}

fn braid_segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("braid-"))
                .collect()
        })
        .unwrap_or_default()
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
/// slots (the other rank counts use single copy for pieces of 64 KiB and
/// more, the default).
#[test]
fn matrix_3_ranks_two_copy() {
    matrix_env(3, &[("BRAID_DIRECT_MIN_BYTES", "18446744073709551615")]);
}

#[test]
fn matrix_4_ranks() {
    matrix(4);
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
    let mut kids: Vec<Child> = (0..n)
        .map(|r| spawn_rank("loop", &id, r, n, &args, timeout_s))
        .collect();
    // Wait until every rank finished its first AllReduce.
    let mut readers = Vec::new();
    for c in kids.iter_mut() {
        let mut out = BufReader::new(c.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "ready", "rank did not start: {line}");
        readers.push(std::thread::spawn(move || {
            let mut rest = String::new();
            for l in out.lines().map_while(Result::ok) {
                rest.push_str(&l);
                rest.push('\n');
            }
            rest
        }));
    }
    std::thread::sleep(Duration::from_millis(200));
    let killed_at = Instant::now();
    kids[victim as usize].kill().expect("kill");
    let _ = kids[victim as usize].wait();
    let mut outputs = Vec::new();
    for (r, c) in kids.iter_mut().enumerate() {
        if r as u32 == victim {
            outputs.push(String::new());
            continue;
        }
        loop {
            if let Some(st) = c.try_wait().expect("wait") {
                assert_eq!(st.code(), Some(3), "rank {r} should fail its AllReduce");
                break;
            }
            if killed_at.elapsed() > Duration::from_secs(timeout_s as u64 + 10) {
                for c in kids.iter_mut() {
                    let _ = c.kill();
                }
                panic!("rank {r} still running after the victim died: a hang");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        outputs.push(String::new());
    }
    let elapsed = killed_at.elapsed();
    for (r, h) in readers.into_iter().enumerate() {
        outputs[r] = h.join().unwrap_or_default();
    }
    for (r, out) in outputs.iter().enumerate() {
        if r as u32 == victim {
            continue;
        }
        println!("rank {r}: {out}");
        assert!(out.contains("error:"), "rank {r}: {out}");
        // The ring neighbours see the victim directly; the others learn it
        // from a neighbour's abort, which carries the cause along.
        assert!(
            out.contains("rank 2"),
            "rank {r} does not name the dead rank: {out}"
        );
    }
    assert!(
        elapsed < Duration::from_secs(timeout_s as u64),
        "survivors took {elapsed:?}; they should notice the dead peer before the timeout"
    );
    assert_eq!(
        braid_segments(),
        Vec::<String>::new(),
        "segments left in /dev/shm"
    );
}

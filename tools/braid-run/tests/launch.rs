//! Runs the built `braid-run` binary with small shell commands.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_braid-run");

fn braid_run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run braid-run")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Lines `[r] rest` of `out` as (r, rest).
fn prefixed(out: &str) -> Vec<(usize, String)> {
    out.lines()
        .map(|l| {
            let rest = l
                .strip_prefix('[')
                .unwrap_or_else(|| panic!("no prefix: {l:?}"));
            let (r, rest) = rest
                .split_once("] ")
                .unwrap_or_else(|| panic!("bad prefix: {l:?}"));
            (
                r.parse().unwrap_or_else(|_| panic!("bad rank: {l:?}")),
                rest.to_owned(),
            )
        })
        .collect()
}

/// Pids of live (non-zombie) processes whose process group is `pgid`.
fn group_members(pgid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the `(comm)`: state ppid pgrp ...
        let Some((_, after)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = after.split_whitespace().collect();
        if fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string() {
            found.push(pid);
        }
    }
    found
}

/// Asserts that neither `pid` nor anything in its process group is alive
/// (waiting a little for the kernel to finish tearing them down).
fn assert_gone(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let members = group_members(pid);
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
        let alive = state
            .as_deref()
            .and_then(|s| s.rsplit_once(')'))
            .map(|(_, after)| !after.trim_start().starts_with('Z'))
            .unwrap_or(false);
        if members.is_empty() && !alive {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "rank pid {pid} (alive: {alive}) or its group members {members:?} outlived braid-run"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pids printed by the ranks as `pid <n>` lines.
fn pids(stdout: &str) -> Vec<(usize, i32)> {
    prefixed(stdout)
        .into_iter()
        .filter_map(|(r, l)| {
            l.strip_prefix("pid ")
                .map(|p| (r, p.trim().parse().expect("pid")))
        })
        .collect()
}

#[test]
fn environment_per_rank() {
    let out = braid_run(&[
        "-n",
        "4",
        "--",
        "sh",
        "-c",
        "echo \"$BRAID_RANK $BRAID_NRANKS $BRAID_LOCAL_RANK $BRAID_LOCAL_SIZE $BRAID_UNIQUE_ID\"",
    ]);
    assert!(
        out.status.success(),
        "status {:?}, stderr {}",
        out.status,
        text(&out.stderr)
    );
    let lines = prefixed(&text(&out.stdout));
    assert_eq!(lines.len(), 4, "{lines:?}");
    let mut ranks = BTreeSet::new();
    let mut ids = BTreeSet::new();
    for (prefix_rank, line) in &lines {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f.len(), 5, "{line:?}");
        let rank: usize = f[0].parse().expect("rank");
        assert_eq!(
            rank, *prefix_rank,
            "prefix does not match BRAID_RANK: {line:?}"
        );
        assert_eq!(f[1], "4");
        assert_eq!(f[2], f[0], "BRAID_LOCAL_RANK != BRAID_RANK");
        assert_eq!(f[3], "4");
        ranks.insert(rank);
        ids.insert(f[4].to_owned());
    }
    assert_eq!(ranks, (0..4).collect::<BTreeSet<_>>());
    assert_eq!(ids.len(), 1, "ranks got different unique ids: {ids:?}");
    let id = ids.into_iter().next().expect("id");
    let (addr, secret) = id.split_once('/').expect("`/` in unique id");
    let addr: SocketAddr = addr.parse().expect("socket address in unique id");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    assert_eq!(secret.len(), 32, "{secret}");
    assert!(
        secret
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
        "{secret}"
    );
}

#[test]
fn fresh_unique_id_even_if_set() {
    let out = Command::new(BIN)
        .args(["-n", "1", "sh", "-c", "echo $BRAID_UNIQUE_ID"])
        .env(
            "BRAID_UNIQUE_ID",
            "1.2.3.4:5/00000000000000000000000000000000",
        )
        .output()
        .expect("run");
    assert!(out.status.success());
    let s = text(&out.stdout);
    assert!(s.starts_with("[0] 127.0.0.1:"), "{s:?}");
}

#[test]
fn output_is_prefixed_per_stream() {
    let out = braid_run(&[
        "-n",
        "2",
        "sh",
        "-c",
        "echo out $BRAID_RANK; echo err $BRAID_RANK >&2; printf 'tail %s' $BRAID_RANK",
    ]);
    assert!(out.status.success(), "{:?}", out.status);
    let mut so: Vec<String> = text(&out.stdout).lines().map(String::from).collect();
    so.sort();
    assert_eq!(so, ["[0] out 0", "[0] tail 0", "[1] out 1", "[1] tail 1"]);
    assert!(text(&out.stdout).ends_with('\n'));
    let mut se: Vec<String> = text(&out.stderr).lines().map(String::from).collect();
    se.sort();
    assert_eq!(se, ["[0] err 0", "[1] err 1"]);

    let out = braid_run(&["--no-prefix", "-n", "1", "echo", "plain"]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout), "plain\n");
}

#[test]
fn lines_do_not_interleave() {
    // Each rank writes many long lines; every output line must be exactly
    // one of them, whole.
    let script = "i=0; while [ $i -lt 200 ]; do echo \"$BRAID_RANK-$(printf '%0500d' $i)-end\"; i=$((i+1)); done";
    let out = braid_run(&["-n", "4", "sh", "-c", script]);
    assert!(out.status.success());
    let lines = prefixed(&text(&out.stdout));
    assert_eq!(lines.len(), 800);
    for (r, l) in lines {
        assert!(
            l.starts_with(&format!("{r}-")) && l.ends_with("-end") && l.len() == 500 + 6,
            "{l:?}"
        );
    }
}

#[test]
fn failing_rank_stops_the_job_quickly() {
    let start = Instant::now();
    let out = braid_run(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "echo pid $$; if [ $BRAID_RANK = 1 ]; then sleep 1; exit 3; fi; sleep 60",
    ]);
    let took = start.elapsed();
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert_eq!(out.status.code(), Some(3), "stderr: {}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("braid-run: rank 1 exited with status 3; stopping the other ranks"),
        "{err}"
    );
    let pids = pids(&text(&out.stdout));
    assert_eq!(
        pids.iter().map(|p| p.0).collect::<BTreeSet<_>>(),
        (0..3).collect(),
        "{pids:?}"
    );
    for (_, pid) in pids {
        assert_gone(pid);
    }
}

#[test]
fn killed_rank_gives_128_plus_signal() {
    let out = braid_run(&[
        "-n",
        "2",
        "sh",
        "-c",
        "if [ $BRAID_RANK = 0 ]; then kill -9 $$; fi; sleep 60",
    ]);
    assert_eq!(out.status.code(), Some(137));
    let err = text(&out.stderr);
    assert!(err.contains("rank 0 killed by signal 9 (SIGKILL)"), "{err}");
}

#[test]
fn rank_ignoring_sigterm_is_killed_after_grace() {
    let start = Instant::now();
    let out = braid_run(&[
        "--grace",
        "0.5",
        "-n",
        "2",
        "sh",
        "-c",
        "trap '' TERM; echo pid $$; if [ $BRAID_RANK = 1 ]; then sleep 1; exit 5; fi; sleep 60",
    ]);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    for (_, pid) in pids(&text(&out.stdout)) {
        assert_gone(pid);
    }
}

#[test]
fn background_children_do_not_keep_the_job_alive() {
    // The rank succeeds but leaves a child holding its stdout open.
    let start = Instant::now();
    let out = braid_run(&["-n", "2", "sh", "-c", "sleep 60 & echo pid $$"]);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert!(
        out.status.success(),
        "{:?} {}",
        out.status,
        text(&out.stderr)
    );
    let pids = pids(&text(&out.stdout));
    assert_eq!(pids.len(), 2);
    for (_, pid) in pids {
        assert_gone(pid);
    }
}

#[test]
fn timeout_stops_the_job() {
    let start = Instant::now();
    let out = braid_run(&[
        "--timeout",
        "1",
        "-n",
        "2",
        "sh",
        "-c",
        "echo pid $$; sleep 60",
    ]);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(out.status.code(), Some(124));
    assert!(
        text(&out.stderr).contains("--timeout"),
        "{}",
        text(&out.stderr)
    );
    for (_, pid) in pids(&text(&out.stdout)) {
        assert_gone(pid);
    }
}

#[test]
fn sigterm_to_braid_run_is_forwarded() {
    let mut child = Command::new(BIN)
        .args([
            "--timeout",
            "30",
            "-n",
            "2",
            "sh",
            "-c",
            "echo pid $$; sleep 60",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut seen = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        reader.read_line(&mut line).expect("read");
        seen.push(line);
    }
    let pids = pids(&seen.concat());
    assert_eq!(pids.len(), 2, "{seen:?}");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("kill");
    let status = child.wait().expect("wait");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(status.code(), Some(128 + 15));
    for (_, pid) in pids {
        assert_gone(pid);
    }
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &[][..],
        &["sh"][..],
        &["-n", "0", "true"][..],
        &["-n", "x", "true"][..],
        &["-n", "2"][..],
        &["--bogus", "-n", "1", "true"][..],
        &["--timeout", "-1", "-n", "1", "true"][..],
    ] {
        let out = braid_run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(
            err.starts_with("braid-run: error: ") && err.contains("--help"),
            "{args:?}: {err}"
        );
        assert!(out.stdout.is_empty());
    }
    let out = braid_run(&["--help"]);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("Usage: braid-run -n N"));
    let out = braid_run(&["--version"]);
    assert!(out.status.success());
    assert!(text(&out.stdout).starts_with("braid-run "));
}

#[test]
fn missing_command_is_reported() {
    let out = braid_run(&["-n", "2", "/nonexistent/braid-test-program"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(
        text(&out.stderr).contains("cannot start rank 0"),
        "{}",
        text(&out.stderr)
    );
}

//! Starting and collecting rank processes in tests.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Wait for every child. A hang is `limit` without a line of output from
/// any child (ranks that print progress may take longer in all, on a
/// loaded machine), and at most three times `limit` in all: past either,
/// kill them all and panic.
pub fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<(Option<i32>, String)> {
    let start = Instant::now();
    let last_line = Arc::new(Mutex::new(Instant::now()));
    let mut children: Vec<(Child, std::thread::JoinHandle<String>)> = children
        .into_iter()
        .map(|mut c| {
            let out = c.stdout.take().expect("stdout");
            let last_line = last_line.clone();
            let reader = std::thread::spawn(move || {
                let mut s = String::new();
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    s.push_str(&line);
                    s.push('\n');
                    if let Ok(mut t) = last_line.lock() {
                        *t = Instant::now();
                    }
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
        let quiet = last_line.lock().map(|t| t.elapsed()).unwrap_or_default();
        if quiet > limit || start.elapsed() > 3 * limit {
            for (c, _) in children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!(
                "ranks still running after {:?}, the last output {quiet:?} ago: a hang",
                start.elapsed()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    children
        .into_iter()
        .zip(status)
        .map(|((_, r), st)| (st.flatten(), r.join().unwrap_or_default()))
        .collect()
}

/// Every rank exited 0 and said so; on failure the message holds every
/// rank's output (the first cause is often another rank's).
pub fn assert_all_ok(what: &str, res: &[(Option<i32>, String)]) {
    let all = || {
        res.iter()
            .enumerate()
            .map(|(r, (code, out))| format!("--- rank {r} (exit {code:?}):\n{out}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    for (r, (code, out)) in res.iter().enumerate() {
        assert!(
            *code == Some(0) && out.contains(&format!("rank {r}: ok")),
            "{what}: rank {r} failed (exit {code:?}); every rank's output:\n{}",
            all()
        );
    }
}

pub fn braid_segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("braid-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Start-up, a fault, and what every rank did afterwards.
#[derive(Debug)]
pub struct FaultOutcome {
    /// Time from the fault until the last surviving rank exited.
    pub elapsed: Duration,
    /// Exit code (None: killed by a signal) and stdout of every rank.
    pub ranks: Vec<(Option<i32>, String)>,
}

/// Wait until every rank printed `ready` (a line of its own), apply `fault`,
/// then wait up to `limit` for all of them to exit; past it, kill them all
/// and panic (a hang).
pub fn fault_run(
    mut kids: Vec<Child>,
    fault: impl FnOnce(&mut [Child]),
    limit: Duration,
) -> FaultOutcome {
    let mut readers = Vec::new();
    for (r, c) in kids.iter_mut().enumerate() {
        let mut out = BufReader::new(c.stdout.take().expect("stdout"));
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            match out.read_line(&mut line) {
                Ok(0) | Err(_) => panic!("rank {r} never got ready:\n{seen}"),
                Ok(_) if line.trim() == "ready" => break,
                Ok(_) => seen.push_str(&line),
            }
        }
        readers.push(std::thread::spawn(move || {
            let mut rest = seen;
            for l in out.lines().map_while(Result::ok) {
                rest.push_str(&l);
                rest.push('\n');
            }
            rest
        }));
    }
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    fault(&mut kids);
    let mut codes = vec![None; kids.len()];
    let mut done = vec![false; kids.len()];
    while done.iter().any(|d| !d) {
        for (i, c) in kids.iter_mut().enumerate() {
            if !done[i] {
                if let Ok(Some(st)) = c.try_wait() {
                    codes[i] = st.code();
                    done[i] = true;
                }
            }
        }
        if t0.elapsed() > limit {
            for c in kids.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!("ranks still running {limit:?} after the fault: a hang");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let elapsed = t0.elapsed();
    let ranks = readers
        .into_iter()
        .zip(codes)
        .map(|(h, c)| (c, h.join().unwrap_or_default()))
        .collect();
    FaultOutcome { elapsed, ranks }
}

/// Read each child's standard error on a thread of its own (so no child
/// blocks on a full pipe); join the handles for the text.
pub fn read_stderr(kids: &mut [Child]) -> Vec<std::thread::JoinHandle<String>> {
    kids.iter_mut()
        .map(|k| {
            let e = k.stderr.take();
            std::thread::spawn(move || {
                let mut s = String::new();
                if let Some(mut e) = e {
                    let _ = std::io::Read::read_to_string(&mut e, &mut s);
                }
                s
            })
        })
        .collect()
}

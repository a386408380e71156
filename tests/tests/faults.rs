//! The fault matrix: for each transport this machine has, kill -9 a random
//! rank at a random point of a long series of mixed collectives, stall one
//! (SIGSTOP), and (across emulated hosts) take a host's link down. Every
//! surviving rank must exit with an error naming the lost rank within the
//! timeout (plus slack); no rank may hang; no shared-memory segment, process
//! or namespace may be left. The matrix is printed; the test fails on any
//! hang, leak or unexpected outcome.
//!
//! The elastic matrix (`elastic_matrix`): the same faults on 4, 8 and 16
//! ranks (shm, forced sockets) and on 2 emulated hosts x 2, after which the
//! survivors shrink the victim out (revoking first when it stalled) and run
//! checked AllReduces; it prints how long each case took from the fault to
//! the last survivor's recovery.
//!
//! Random choices come from `BRAID_FAULT_SEED` (default: the clock), printed
//! so that a failing case can be replayed.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use braid::{Communicator, RootServer, UniqueId};
use braid_tests::netns::Hosts;
use braid_tests::ranks::{braid_segments, read_stderr};

/// The matrices run one at a time: each counts this build's rank processes
/// left behind, and must not count the other's.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `BRAID_FAULT_SEED`, or one from the clock (printed by each matrix, so
/// that a failing run can be replayed).
fn fault_seed() -> u64 {
    std::env::var("BRAID_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1
        })
}

/// Tiny deterministic generator (xorshift), seeded per run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Kill,
    Stop,
    LinkDown,
}

/// Where the ranks run.
enum Place<'a> {
    /// All ranks on this host, with extra environment.
    Local(&'a [(&'a str, &'a str)]),
    /// Rank r on emulated host `hosts[r]`.
    Hosts(&'a Hosts, &'a [usize]),
}

#[derive(Default)]
struct Row {
    cases: u32,
    expected: u32,
    hangs: u32,
    leaks: u32,
    notes: Vec<String>,
}

impl Row {
    /// Ends a case: what it `leaked` counts against it; returns whether it
    /// went as expected.
    fn close(&mut self, label: &str, ok: bool, leaked: &[String]) -> bool {
        if !leaked.is_empty() {
            self.leaks += 1;
            self.notes.push(format!("{label}: left behind {leaked:?}"));
        }
        let ok = ok && leaked.is_empty();
        if ok {
            self.expected += 1;
        }
        ok
    }
}

const TIMEOUT_S: u64 = 4;

/// The rank binary's workload: `mixed` collectives back to back, or `lazy`
/// (AllReduces, an idle pause in which the fault strikes, then an AllToAll
/// whose links connect on first use: the lost rank is named by ranks that
/// never had a link with it).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Work {
    Mixed,
    Lazy,
    /// AllReduces, then shrink past `victim` and go on (`elastic_matrix`).
    Elastic {
        victim: usize,
        stall: bool,
    },
}

fn spawn(place: &Place, id: &UniqueId, r: usize, n: usize, work: Work) -> Child {
    let bin = env!("CARGO_BIN_EXE_braid-testrank");
    let mut cmd = match place {
        Place::Local(env) => {
            let mut c = Command::new(bin);
            c.envs(env.iter().copied());
            c
        }
        Place::Hosts(h, hosts) => {
            let mut c = h.command(hosts[r], bin);
            c.env_remove("BRAID_HOST_ID").env_remove("BRAID_TRANSPORT");
            c
        }
    };
    let (suite, args) = match work {
        Work::Mixed => ("mixed", vec!["100000000".to_string()]),
        Work::Lazy => ("lazy", vec!["1500".to_string()]),
        Work::Elastic { victim, stall } => (
            "elastic",
            vec![victim.to_string(), (stall as u8).to_string()],
        ),
    };
    cmd.args([suite, &id.to_string(), &r.to_string(), &n.to_string()])
        .args(&args)
        .env("BRAID_TIMEOUT", TIMEOUT_S.to_string())
        .env_remove("BRAID_DEBUG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn braid-testrank")
}

fn signal(c: &Child, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), sig);
}

/// Processes still running this test's rank binary (this build's: another
/// checkout's test run on the same machine is not ours to count).
fn stray_ranks() -> Vec<String> {
    let me = std::process::id().to_string();
    let bin = std::fs::canonicalize(env!("CARGO_BIN_EXE_braid-testrank")).ok();
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.chars().all(|c| c.is_ascii_digit()) || pid == me {
            continue;
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let first = cmdline.split(|&b| b == 0).next().unwrap_or_default();
        if !String::from_utf8_lossy(first).ends_with("braid-testrank") {
            continue;
        }
        // The executable behind it; one we cannot read (it exited, or it
        // belongs to another user) counts as ours, to be safe.
        let exe = std::fs::read_link(e.path().join("exe")).ok();
        let exe = exe.map(|p| {
            p.to_string_lossy()
                .trim_end_matches(" (deleted)")
                .to_string()
        });
        let ours = match (&bin, exe) {
            (Some(b), Some(x)) => std::path::Path::new(&x) == b.as_path(),
            _ => true,
        };
        if ours {
            out.push(pid);
        }
    }
    out
}

/// Segments in /dev/shm of this host, or of emulated host `h`.
fn segments(place: &Place, host: Option<usize>) -> Vec<String> {
    match (place, host) {
        (Place::Hosts(h, _), Some(x)) => h
            .command(x, "sh")
            .args(["-c", "ls /dev/shm | grep '^braid-' || true"])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default(),
        _ => braid_segments(),
    }
}

/// What a case left behind: its segments on every host (on this host only
/// those its ranks created: other jobs may hold segments of their own),
/// and this build's rank processes.
fn leftovers(place: &Place, pids: &[u32]) -> Vec<String> {
    let mut leaked: Vec<String> = match place {
        Place::Local(_) => segments(place, None)
            .into_iter()
            .filter(|name| {
                pids.iter()
                    .any(|p| name.starts_with(&format!("braid-{p}-")))
            })
            .collect(),
        Place::Hosts(_, hosts) => {
            let mut v = Vec::new();
            let mut seen = Vec::new();
            for &x in hosts.iter() {
                if !seen.contains(&x) {
                    seen.push(x);
                    v.extend(segments(place, Some(x)));
                }
            }
            v
        }
    };
    leaked.extend(stray_ranks().into_iter().map(|p| format!("process {p}")));
    leaked
}

/// One case: start `n` ranks, wait until all run collectives, apply the
/// fault to `victim` after `delay`, then check every other rank.
fn case(
    row: &mut Row,
    label: &str,
    place: &Place,
    n: usize,
    fault: Fault,
    victim: usize,
    delay: Duration,
) {
    case_with(row, label, place, n, fault, victim, delay, Work::Mixed)
}

#[allow(clippy::too_many_arguments)]
fn case_with(
    row: &mut Row,
    label: &str,
    place: &Place,
    n: usize,
    fault: Fault,
    victim: usize,
    delay: Duration,
    work: Work,
) {
    row.cases += 1;
    let (id, _root): (UniqueId, RootServer) = match place {
        Place::Local(_) => {
            Communicator::unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
        }
        Place::Hosts(h, _) => Communicator::unique_id(SocketAddr::new(h.root_addr(), 0)),
    }
    .expect("root");
    let mut kids: Vec<Child> = (0..n).map(|r| spawn(place, &id, r, n, work)).collect();
    // This case's ranks (on one host, the creators named in segment names).
    let pids: Vec<u32> = kids.iter().map(|k| k.id()).collect();
    // Wait for "ready" from every rank (bounded).
    let mut outs = Vec::new();
    let start = Instant::now();
    let mut ready = true;
    for (r, k) in kids.iter_mut().enumerate() {
        let out = k.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            let mut all = String::new();
            let mut rd = BufReader::new(out);
            let mut line = String::new();
            while rd.read_line(&mut line).map(|k| k > 0).unwrap_or(false) {
                if line.trim() == "ready" {
                    let _ = tx.send(());
                }
                all.push_str(&line);
                line.clear();
            }
            all
        });
        let left = Duration::from_secs(60).saturating_sub(start.elapsed());
        if rx.recv_timeout(left).is_err() {
            ready = false;
            row.notes.push(format!("{label}: rank {r} never got ready"));
        }
        outs.push(h);
    }
    let errs = read_stderr(&mut kids);
    std::thread::sleep(delay);
    let t0 = Instant::now();
    if ready {
        match fault {
            Fault::Kill => signal(&kids[victim], nix::sys::signal::Signal::SIGKILL),
            Fault::Stop => signal(&kids[victim], nix::sys::signal::Signal::SIGSTOP),
            Fault::LinkDown => {
                if let Place::Hosts(h, hosts) = place {
                    h.set_link(hosts[victim], false).expect("link down");
                }
            }
        }
    }
    // Every wait is bounded by the timeout; an error relayed through the
    // ring may take one more timeout; beyond that it is a hang.
    let limit = Duration::from_secs(TIMEOUT_S * 3 + 10);
    let mut codes: Vec<Option<Option<i32>>> = vec![None; n];
    let mut hang = false;
    loop {
        for (r, k) in kids.iter_mut().enumerate() {
            if codes[r].is_none() && !(r == victim && fault == Fault::Stop) {
                if let Ok(Some(st)) = k.try_wait() {
                    codes[r] = Some(st.code());
                }
            }
        }
        let survivors_done = (0..n).all(|r| {
            codes[r].is_some() || (r == victim && matches!(fault, Fault::Stop | Fault::Kill))
        });
        if survivors_done {
            break;
        }
        if t0.elapsed() > limit {
            hang = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let elapsed = t0.elapsed();
    for k in kids.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
    if let (Fault::LinkDown, Place::Hosts(h, hosts)) = (fault, place) {
        let _ = h.set_link(hosts[victim], true);
    }
    let outs: Vec<String> = outs
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    let errs: Vec<String> = errs
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    let mut ok = ready && !hang;
    if hang {
        row.hangs += 1;
        row.notes.push(format!(
            "{label}: HANG, survivors still running after {limit:?}"
        ));
    }
    let lost = format!("rank {victim}");
    let mut someone_named_it = false;
    for r in (0..n).filter(|&r| r != victim || fault == Fault::LinkDown) {
        let text = format!("{}{}", outs[r], errs[r]);
        let code = codes[r].flatten();
        someone_named_it |= text.contains(&lost);
        // Kill: the lost rank must be named (directly or in the relayed
        // cause). Stop: a stalled rank is alive, so every rank times out on
        // the peer it waits for, which is the stalled rank only for its
        // neighbours (checked below). Link down: the ranks on the cut host
        // lose the others, so any rank may be named.
        let named = match fault {
            Fault::Kill => text.contains(&lost),
            Fault::Stop => text.contains("timed out") || text.contains("aborted"),
            Fault::LinkDown => text.contains("rank "),
        };
        if code != Some(3) || !named {
            ok = false;
            row.notes.push(format!(
                "{label}: rank {r} exit {code:?}, names {lost}: {named}: {}",
                text.lines()
                    .filter(|l| l.contains("error"))
                    .collect::<Vec<_>>()
                    .join(" | ")
            ));
        }
    }
    if fault == Fault::Stop && !someone_named_it {
        ok = false;
        row.notes
            .push(format!("{label}: no survivor named the stalled {lost}"));
    }
    // Leaks: segments on every host, processes.
    std::thread::sleep(Duration::from_millis(100));
    let leaked = leftovers(place, &pids);
    let ok = row.close(label, ok, &leaked);
    println!(
        "  {label}: victim rank {victim}, fault after {delay:?}, survivors done in {:.2} s: {}",
        elapsed.as_secs_f64(),
        if ok { "ok" } else { "UNEXPECTED" }
    );
}

#[test]
fn fault_matrix() {
    let _g = serial();
    let seed = fault_seed();
    println!("fault matrix, BRAID_FAULT_SEED={seed}");
    let mut rng = Rng(seed);
    let mut rows: Vec<(String, Row)> = Vec::new();
    let delay = |rng: &mut Rng| Duration::from_millis(rng.below(400));

    // shm: 4 ranks on this host.
    let mut row = Row::default();
    let shm = Place::Local(&[]);
    for i in 0..3 {
        let v = rng.below(4) as usize;
        let d = delay(&mut rng);
        case(
            &mut row,
            &format!("shm kill #{i}"),
            &shm,
            4,
            Fault::Kill,
            v,
            d,
        );
    }
    let v = rng.below(4) as usize;
    let d = delay(&mut rng);
    case(&mut row, "shm stop", &shm, 4, Fault::Stop, v, d);
    // Every piece of 64 KiB and more single-copy and shared with its sender
    // in 4 KiB chunks: a victim dies or stops with its peers' destinations
    // half written by it, or with its own half written by them.
    let shared = [
        ("BRAID_SINGLE_COPY_MIN_BYTES", "0"),
        ("BRAID_SHM_HELP_CHUNK", "4096"),
    ];
    let shared = Place::Local(&shared);
    for (label, fault) in [
        ("shm kill, shared copies", Fault::Kill),
        ("shm stop, shared copies", Fault::Stop),
    ] {
        let v = rng.below(4) as usize;
        let d = delay(&mut rng);
        case(&mut row, label, &shared, 4, fault, v, d);
    }
    // A rank killed before its peers' first use of a link with it (5 ranks:
    // AllReduce connects ring neighbours and recursive-doubling partners
    // only; the AllToAll after the pause connects the rest): every
    // survivor still names it.
    let v = rng.below(5) as usize;
    let d = delay(&mut rng);
    case_with(
        &mut row,
        "shm kill before a lazy link",
        &shm,
        5,
        Fault::Kill,
        v,
        d,
        Work::Lazy,
    );
    rows.push(("shm (1 host x 4, x 5 lazy)".into(), row));

    // socket on one host (forced), 3 ranks.
    let mut row = Row::default();
    let env = [("BRAID_TRANSPORT", "socket")];
    let sock = Place::Local(&env);
    for i in 0..2 {
        let v = rng.below(3) as usize;
        let d = delay(&mut rng);
        case(
            &mut row,
            &format!("socket kill #{i}"),
            &sock,
            3,
            Fault::Kill,
            v,
            d,
        );
    }
    let v = rng.below(3) as usize;
    let d = delay(&mut rng);
    case(&mut row, "socket stop", &sock, 3, Fault::Stop, v, d);
    let v = rng.below(5) as usize;
    let d = delay(&mut rng);
    case_with(
        &mut row,
        "socket kill before a lazy link",
        &sock,
        5,
        Fault::Kill,
        v,
        d,
        Work::Lazy,
    );
    rows.push(("socket (1 host x 3, x 5 lazy, forced)".into(), row));

    // Across emulated hosts: shm inside, socket across.
    match Hosts::available() {
        Err(why) => println!("emulated hosts unavailable ({why}): netns rows skipped"),
        Ok(()) => {
            let h = Hosts::new(2).expect("emulated hosts");
            let placement = [0, 0, 1, 1];
            let mut row = Row::default();
            let place = Place::Hosts(&h, &placement);
            for i in 0..2 {
                let v = rng.below(4) as usize;
                let d = delay(&mut rng);
                case(
                    &mut row,
                    &format!("netns kill #{i}"),
                    &place,
                    4,
                    Fault::Kill,
                    v,
                    d,
                );
            }
            let v = rng.below(4) as usize;
            let d = delay(&mut rng);
            case(&mut row, "netns stop", &place, 4, Fault::Stop, v, d);
            let v = rng.below(4) as usize;
            let d = delay(&mut rng);
            case(
                &mut row,
                "netns link down",
                &place,
                4,
                Fault::LinkDown,
                v,
                d,
            );
            rows.push(("shm+socket (2 netns hosts x 2)".into(), row));
            drop(h);
            let left = Hosts::leftovers(std::process::id());
            if !left.is_empty() {
                if let Some((_, r)) = rows.last_mut() {
                    r.leaks += 1;
                    r.notes.push(format!("namespaces left behind: {left:?}"));
                }
            }
        }
    }

    println!();
    println!(
        "{:<32} {:>6} {:>9} {:>6} {:>6}",
        "transport", "cases", "expected", "hangs", "leaks"
    );
    let mut bad = Vec::new();
    for (name, r) in &rows {
        println!(
            "{name:<32} {:>6} {:>9} {:>6} {:>6}",
            r.cases, r.expected, r.hangs, r.leaks
        );
        if r.expected != r.cases || r.hangs > 0 || r.leaks > 0 {
            bad.extend(r.notes.iter().cloned());
        }
    }
    assert!(
        bad.is_empty(),
        "fault matrix (BRAID_FAULT_SEED={seed}):\n{}",
        bad.join("\n")
    );
}

/// One elastic case: `n` ranks run AllReduces; `victim` is killed or
/// stopped; every survivor must shrink it out and print that it recovered.
/// Returns the time from the fault to the last survivor's recovery line.
fn elastic_case(
    row: &mut Row,
    label: &str,
    place: &Place,
    n: usize,
    fault: Fault,
    victim: usize,
) -> Option<Duration> {
    row.cases += 1;
    let root_ip = match place {
        Place::Local(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Place::Hosts(h, _) => h.root_addr(),
    };
    let (id, _root) = Communicator::unique_id(SocketAddr::new(root_ip, 0)).expect("root");
    let work = Work::Elastic {
        victim,
        stall: fault == Fault::Stop,
    };
    let mut kids: Vec<Child> = (0..n).map(|r| spawn(place, &id, r, n, work)).collect();
    let pids: Vec<u32> = kids.iter().map(|k| k.id()).collect();
    // Every line, stamped when read: "ready" and "recovered" are timed.
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Instant, String)>();
    let outs: Vec<_> = kids
        .iter_mut()
        .enumerate()
        .map(|(r, k)| {
            let out = k.stdout.take().expect("stdout");
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut all = String::new();
                for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                    let _ = tx.send((r, Instant::now(), line.clone()));
                    all.push_str(&line);
                    all.push('\n');
                }
                all
            })
        })
        .collect();
    drop(tx);
    let errs = read_stderr(&mut kids);
    let start = Instant::now();
    let mut ready = vec![false; n];
    let mut recovered: Vec<Option<Instant>> = vec![None; n];
    while !ready.iter().all(|&x| x) && start.elapsed() < Duration::from_secs(90) {
        if let Ok((r, _, l)) = rx.recv_timeout(Duration::from_millis(50)) {
            ready[r] |= l.trim() == "ready";
        }
    }
    let all_ready = ready.iter().all(|&x| x);
    if !all_ready {
        row.notes.push(format!("{label}: not every rank got ready"));
    }
    let t0 = Instant::now();
    if all_ready {
        let sig = match fault {
            Fault::Stop => nix::sys::signal::Signal::SIGSTOP,
            _ => nix::sys::signal::Signal::SIGKILL,
        };
        signal(&kids[victim], sig);
    }
    // A kill is found at once; a stall after one timeout (then revoke).
    let limit = Duration::from_secs(TIMEOUT_S * 3 + 20);
    let mut codes: Vec<Option<Option<i32>>> = vec![None; n];
    let mut hang = false;
    loop {
        while let Ok((r, at, l)) = rx.try_recv() {
            if l.contains(" recovered ") {
                recovered[r] = Some(at);
            }
        }
        for (r, k) in kids.iter_mut().enumerate() {
            if r != victim && codes[r].is_none() {
                if let Ok(Some(st)) = k.try_wait() {
                    codes[r] = Some(st.code());
                }
            }
        }
        if (0..n).all(|r| r == victim || codes[r].is_some()) || !all_ready {
            break;
        }
        if t0.elapsed() > limit {
            hang = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for k in kids.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
    let outs: Vec<String> = outs
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    while let Ok((r, at, l)) = rx.try_recv() {
        if l.contains(" recovered ") {
            recovered[r] = Some(at);
        }
    }
    let errs: Vec<String> = errs
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    let mut ok = all_ready && !hang;
    if hang {
        row.hangs += 1;
        row.notes.push(format!(
            "{label}: HANG, survivors still running after {limit:?}"
        ));
    }
    let want = format!(" recovered {} ", n - 1);
    let mut worst = Duration::ZERO;
    for r in (0..n).filter(|&r| r != victim) {
        let good = codes[r] == Some(Some(0)) && outs[r].contains(&want);
        match recovered[r] {
            Some(at) if good => worst = worst.max(at.saturating_duration_since(t0)),
            _ => {
                ok = false;
                row.notes.push(format!(
                    "{label}: rank {r} exit {:?}: {}",
                    codes[r].flatten(),
                    format!("{}{}", outs[r], errs[r])
                        .lines()
                        .filter(|l| l.contains("error") || l.contains("failed"))
                        .collect::<Vec<_>>()
                        .join(" | ")
                ));
            }
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let leaked = leftovers(place, &pids);
    let ok = row.close(label, ok, &leaked);
    let first = outs
        .iter()
        .find_map(|o| o.lines().find(|l| l.contains(" recovered ")));
    println!(
        "  {label}: victim rank {victim}, last survivor recovered {:.0} ms after the fault: {} ({})",
        worst.as_secs_f64() * 1e3,
        if ok { "ok" } else { "UNEXPECTED" },
        first.unwrap_or("-")
    );
    ok.then_some(worst)
}

#[test]
fn elastic_matrix() {
    let _g = serial();
    let seed = fault_seed();
    println!("elastic matrix, BRAID_FAULT_SEED={seed}");
    let mut rng = Rng(seed);
    let sock_env = [("BRAID_TRANSPORT", "socket")];
    let places = [
        ("shm", Place::Local(&[])),
        ("socket", Place::Local(&sock_env)),
    ];
    let mut rows: Vec<(String, Row, Vec<Duration>)> = Vec::new();
    for (name, place) in &places {
        let mut row = Row::default();
        let mut times = Vec::new();
        // Rank 0 hosts the first rendezvous: lose it once on purpose.
        for (n, victim) in [
            (4, 0),
            (4, 1 + rng.below(3) as usize),
            (8, rng.below(8) as usize),
            (16, rng.below(16) as usize),
        ] {
            let label = format!("{name} {n} ranks, kill");
            times.extend(elastic_case(
                &mut row,
                &label,
                place,
                n,
                Fault::Kill,
                victim,
            ));
        }
        let v = rng.below(4) as usize;
        let label = format!("{name} 4 ranks, stop");
        elastic_case(&mut row, &label, place, 4, Fault::Stop, v);
        rows.push((format!("{name} (kill 4, 4, 8, 16; stop 4)"), row, times));
    }
    // Across emulated hosts (shm inside, sockets across): the agreement
    // and the new rendezvous cross hosts.
    match Hosts::available() {
        Err(why) => println!("emulated hosts unavailable ({why}): the netns row is skipped"),
        Ok(()) => {
            let h = Hosts::new(2).expect("emulated hosts");
            let placement = [0, 0, 1, 1];
            let place = Place::Hosts(&h, &placement);
            let mut row = Row::default();
            let mut times = Vec::new();
            for i in 0..2 {
                let v = rng.below(4) as usize;
                let label = format!("netns 2 hosts x 2, kill #{i}");
                times.extend(elastic_case(&mut row, &label, &place, 4, Fault::Kill, v));
            }
            // The revocation crosses hosts too.
            let v = rng.below(4) as usize;
            elastic_case(
                &mut row,
                "netns 2 hosts x 2, stop",
                &place,
                4,
                Fault::Stop,
                v,
            );
            rows.push((
                "shm+socket (2 netns hosts x 2, kill x2, stop)".into(),
                row,
                times,
            ));
        }
    }
    println!();
    println!(
        "{:<46} {:>6} {:>9} {:>6} {:>6}  kill to recovered (ms)",
        "transport", "cases", "expected", "hangs", "leaks"
    );
    let mut bad = Vec::new();
    for (name, r, times) in &rows {
        let ms: Vec<String> = times
            .iter()
            .map(|t| format!("{:.0}", t.as_secs_f64() * 1e3))
            .collect();
        println!(
            "{name:<46} {:>6} {:>9} {:>6} {:>6}  {}",
            r.cases,
            r.expected,
            r.hangs,
            r.leaks,
            ms.join(", ")
        );
        if r.expected != r.cases || r.hangs > 0 || r.leaks > 0 {
            bad.extend(r.notes.iter().cloned());
        }
    }
    assert!(
        bad.is_empty(),
        "elastic matrix (BRAID_FAULT_SEED={seed}):\n{}",
        bad.join("\n")
    );
}

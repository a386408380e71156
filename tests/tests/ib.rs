//! Multi-process tests with every link forced onto the IB transport
//! (`BRAID_TRANSPORT=ib`): several ranks in one host, which would otherwise
//! use shared memory. They need an RDMA device and run inside
//! `tools/rdma-vm/run` (Soft-RoCE): `scripts/rdma-tests.sh` builds them
//! and runs them there. Without a device each test prints "skipped: needs
//! an RDMA device" and passes, unless `BRAID_REQUIRE_IB=1` asks for the
//! hardware (the guests set it), when it fails. The tests across two
//! guests are in that script.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use braid::{Communicator, RootServer, UniqueId};
use braid_tests::ranks::{assert_all_ok, fault_run, wait_all};

static SERIAL: Mutex<()> = Mutex::new(());

/// Whether this host can run these tests (see the module docs).
fn ib_here(test: &str) -> bool {
    braid_transport_ib::available_for_tests(test).unwrap_or_else(|e| panic!("{e}"))
}

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn root() -> (UniqueId, RootServer) {
    Communicator::unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).expect("root")
}

/// Small sizes: the guests emulate their CPU, so a collective costs
/// milliseconds (70001 f64 elements span two 512 KiB slots).
const SIZES: [&str; 5] = ["0", "1", "7", "1023", "70001"];

fn spawn(suite: &str, id: &UniqueId, rank: u32, n: u32, args: &[&str], timeout_s: u32) -> Child {
    Command::new(env!("CARGO_BIN_EXE_braid-testrank"))
        .arg(suite)
        .arg(id.to_string())
        .arg(rank.to_string())
        .arg(n.to_string())
        .args(args)
        .env("BRAID_TRANSPORT", "ib")
        .env("BRAID_TIMEOUT", timeout_s.to_string())
        // A long ACK timeout (4.3 s): a timer that fires while an ACK is
        // only late makes Soft-RoCE retransmit, which can break the
        // connection (crate docs of braid-transport-ib). A dead peer is
        // reported within about 17 s (4 tries).
        .env("BRAID_IB_TIMEOUT", "20")
        .env("BRAID_IB_RETRY_CNT", "3")
        .env("BRAID_SPIN", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn braid-testrank")
}

fn run(suite: &str, n: u32, args: &[&str]) -> Vec<(Option<i32>, String)> {
    let (id, _root) = root();
    let kids = (0..n).map(|r| spawn(suite, &id, r, n, args, 120)).collect();
    wait_all(kids, Duration::from_secs(600))
}

fn assert_ib_everywhere(res: &[(Option<i32>, String)]) {
    for (r, (_, out)) in res.iter().enumerate() {
        let line = out
            .lines()
            .find(|l| l.contains("transports:"))
            .unwrap_or_else(|| panic!("rank {r} printed no transports line:\n{out}"));
        let t = line.split("transports:").nth(1).unwrap_or("").trim();
        assert!(
            t.split(',').all(|x| x == "ib" || x == "self"),
            "rank {r} did not use IB for every peer: {line}"
        );
    }
}

/// Every collective, datatype and operator, in place and out of place, on
/// three ranks whose links are all IB.
#[test]
fn ib_matrix_3_ranks() {
    if !ib_here("ib_matrix_3_ranks") {
        return;
    }
    let _g = serial();
    let res = run("matrix", 3, &SIZES);
    for (_, out) in &res {
        print!("{out}");
    }
    assert_all_ok("matrix over IB with 3 ranks", &res);
    assert_ib_everywhere(&res);
}

/// Send/Recv and groups over IB.
#[test]
fn ib_point_to_point_and_groups() {
    if !ib_here("ib_point_to_point_and_groups") {
        return;
    }
    let _g = serial();
    let res = run("p2p", 3, &[]);
    assert_all_ok("p2p over IB with 3 ranks", &res);
    assert_ib_everywhere(&res);
}

/// `n` ranks running a long series of 64 KiB AllReduces (they print `ready`
/// first), for the fault tests.
fn long_loop(id: &UniqueId, n: u32, timeout_s: u32) -> Vec<Child> {
    (0..n)
        .map(|r| spawn("loop", id, r, n, &["1000000", "65536"], timeout_s))
        .collect()
}

/// kill -9 one rank in the middle of a long series of AllReduces: every
/// other rank returns an error that names it, well before BRAID_TIMEOUT.
#[test]
fn ib_killed_rank_gives_errors_not_hangs() {
    if !ib_here("ib_killed_rank_gives_errors_not_hangs") {
        return;
    }
    let _g = serial();
    let n = 3u32;
    let victim = 1u32;
    let timeout_s = 60;
    let (id, _root) = root();
    let kids = long_loop(&id, n, timeout_s);
    let out = fault_run(
        kids,
        |k| {
            let _ = k[victim as usize].kill();
        },
        Duration::from_secs(timeout_s as u64 + 30),
    );
    for (r, (code, text)) in out.ranks.iter().enumerate() {
        if r as u32 == victim {
            continue;
        }
        println!("rank {r}: {text}");
        assert_eq!(*code, Some(3), "rank {r} should fail its AllReduce: {text}");
        assert!(
            text.contains("rank 1"),
            "rank {r} does not name the dead rank: {text}"
        );
    }
    assert!(
        out.elapsed < Duration::from_secs(timeout_s as u64),
        "survivors took {:?}; they should notice the dead peer before the timeout",
        out.elapsed
    );
}

/// SIGSTOP one rank in the middle of a long series of AllReduces: its queue
/// pairs live in the kernel and keep answering, so nothing fails at the
/// verbs level; every other rank must still return an error within the
/// timeout (the stalled peer stops granting credits and sending data), a
/// neighbour naming it, not hang.
#[test]
fn ib_stalled_rank_gives_errors_not_hangs() {
    if !ib_here("ib_stalled_rank_gives_errors_not_hangs") {
        return;
    }
    let _g = serial();
    let n = 3u32;
    let victim = 1usize;
    let timeout_s = 15;
    let limit = Duration::from_secs(3 * timeout_s as u64 + 30);
    let (id, _root) = root();
    let kids = long_loop(&id, n, timeout_s);
    let out = fault_run(
        kids,
        |k| {
            let pid = nix::unistd::Pid::from_raw(k[victim].id() as i32);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
            // The survivors must exit by themselves; then the stalled rank
            // goes (fault_run waits for every rank).
            let t0 = std::time::Instant::now();
            while t0.elapsed() < limit {
                let running = k
                    .iter_mut()
                    .enumerate()
                    .any(|(r, c)| r != victim && matches!(c.try_wait(), Ok(None)));
                if !running {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = k[victim].kill();
        },
        limit + Duration::from_secs(10),
    );
    // A stalled rank is alive: each survivor times out on the peer it waits
    // for (or hears a peer's abort), which is the stalled rank only for its
    // neighbours; at least one of them must name it.
    let mut named = false;
    for (r, (code, text)) in out.ranks.iter().enumerate() {
        if r == victim {
            continue;
        }
        println!("rank {r}: {text}");
        assert_eq!(*code, Some(3), "rank {r} should fail its AllReduce: {text}");
        assert!(
            text.contains("timed out") || text.contains("aborted"),
            "rank {r} neither timed out nor heard an abort: {text}"
        );
        named |= text.contains("waiting for rank 1");
    }
    assert!(named, "no survivor named the stalled rank 1");
    assert!(
        out.elapsed < limit,
        "survivors took {:?} with BRAID_TIMEOUT={timeout_s}: a hang",
        out.elapsed
    );
}

/// The threads of a rank whose links are all IB do not grow with the
/// ranks (issue 23): one progress thread per device and process drives
/// every end. The most any rank has after an AllToAll (every link used),
/// with 2 and with 4 ranks; before, each link end had its own thread
/// (2 and 6 of them).
#[test]
fn ib_threads_do_not_grow_with_the_ranks() {
    if !ib_here("ib_threads_do_not_grow_with_the_ranks") {
        return;
    }
    let _g = serial();
    let threads = |n: u32| -> u32 {
        let res = run("resources", n, &[]);
        assert_all_ok(&format!("resources over IB with {n} ranks"), &res);
        assert_ib_everywhere(&res);
        res.iter()
            .map(|(_, out)| {
                let line = out
                    .lines()
                    .find(|l| l.contains(" alltoall: threads="))
                    .unwrap_or_else(|| panic!("no alltoall line in {out}"));
                line.split("threads=")
                    .nth(1)
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("threads in {line}"))
            })
            .max()
            .unwrap_or(0)
    };
    let two = threads(2);
    let four = threads(4);
    println!("IB, most threads of a rank: {two} with 2 ranks, {four} with 4");
    assert!(four <= two, "{four} threads with 4 ranks, {two} with 2");
}

/// kill -9 one of three ranks in the middle of AllReduces over IB: the two
/// survivors shrink it out, keep the IB link between them (an aborted link
/// resynchronises: the shrink's log says `kept_links=2` on each), and their
/// AllReduces on the new communicator give the right sums.
#[test]
fn ib_shrink_after_a_killed_rank_keeps_the_survivors_link() {
    if !ib_here("ib_shrink_after_a_killed_rank_keeps_the_survivors_link") {
        return;
    }
    let _g = serial();
    let (n, victim) = (3u32, 2u32);
    let dir = std::env::temp_dir().join(format!("braid-ib-shrink-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("log dir");
    let (id, _root) = root();
    let kids = (0..n)
        .map(|r| {
            let log = std::fs::File::create(dir.join(format!("rank{r}.log"))).expect("log");
            Command::new(env!("CARGO_BIN_EXE_braid-testrank"))
                .args(["elastic", &id.to_string(), &r.to_string(), &n.to_string()])
                .arg(victim.to_string())
                .arg("0")
                .env("BRAID_TRANSPORT", "ib")
                .env("BRAID_TIMEOUT", "60")
                .env("BRAID_IB_TIMEOUT", "20")
                .env("BRAID_IB_RETRY_CNT", "3")
                .env("BRAID_SPIN", "0")
                .env("BRAID_DEBUG", "INFO")
                .stdout(Stdio::piped())
                .stderr(Stdio::from(log))
                .spawn()
                .expect("spawn braid-testrank")
        })
        .collect();
    let out = fault_run(
        kids,
        |k| {
            let _ = k[victim as usize].kill();
        },
        Duration::from_secs(120),
    );
    for (r, (code, text)) in out.ranks.iter().enumerate() {
        if r as u32 == victim {
            continue;
        }
        let log = std::fs::read_to_string(dir.join(format!("rank{r}.log"))).unwrap_or_default();
        println!("rank {r}: {text}");
        assert_eq!(*code, Some(0), "rank {r} did not recover: {text}\n{log}");
        assert!(text.contains("recovered 2"), "rank {r}: {text}");
        assert!(
            log.lines()
                .any(|l| l.contains("braid: shrink") && l.contains("kept_links=2")),
            "rank {r} did not keep its IB link with the other survivor:\n{log}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

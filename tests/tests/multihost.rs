//! Runs across emulated hosts: network namespaces with their own /dev/shm,
//! joined through a bridge (see `braid_tests::netns`). Shared memory inside a
//! host, sockets across hosts, chosen by braid itself from what really shares
//! memory. Needs root and iproute2; without them each test says so and
//! returns (CI runs as root and installs iproute2).

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use braid::{Communicator, RootServer, UniqueId};
use braid_tests::netns::{Delay, Hosts};
use braid_tests::ranks::{assert_all_ok, fault_run, wait_all};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn hosts(n: usize) -> Option<Hosts> {
    if let Err(why) = Hosts::available() {
        println!("skipping: emulated hosts unavailable: {why}");
        return None;
    }
    Some(Hosts::new(n).expect("creating emulated hosts"))
}

/// Rendezvous root in the test's namespace, on the bridge address.
fn root(h: &Hosts) -> (UniqueId, RootServer) {
    Communicator::unique_id(SocketAddr::new(h.root_addr(), 0)).expect("root")
}

/// Start rank `r` of `n` on host `host`.
#[allow(clippy::too_many_arguments)]
fn spawn(
    h: &Hosts,
    host: usize,
    id: &UniqueId,
    suite: &str,
    r: usize,
    n: usize,
    args: &[&str],
    timeout_s: u32,
) -> Child {
    h.command(host, env!("CARGO_BIN_EXE_braid-testrank"))
        .arg(suite)
        .arg(id.to_string())
        .arg(r.to_string())
        .arg(n.to_string())
        .args(args)
        .env("BRAID_TIMEOUT", timeout_s.to_string())
        .env_remove("BRAID_HOST_ID")
        .env_remove("BRAID_TRANSPORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn braid-testrank in a host")
}

/// Run `suite` with rank r on host `placement[r]`.
fn run(h: &Hosts, placement: &[usize], suite: &str, args: &[&str]) -> Vec<(Option<i32>, String)> {
    let (id, _root) = root(h);
    let n = placement.len();
    let kids = placement
        .iter()
        .enumerate()
        .map(|(r, &host)| spawn(h, host, &id, suite, r, n, args, 60))
        .collect();
    wait_all(kids, Duration::from_secs(600))
}

/// The transports rank `r` reported, one per peer.
fn transports(out: &str, r: usize) -> Vec<String> {
    let prefix = format!("rank {r} transports: ");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("rank {r} printed no transports:\n{out}"))
        .split(',')
        .map(str::to_string)
        .collect()
}

const SIZES: [&str; 4] = ["0", "1", "7", "65539"];

#[test]
fn two_hosts_two_ranks_each_shm_inside_socket_across() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    let placement = [0, 0, 1, 1];
    let res = run(&h, &placement, "matrix", &SIZES);
    for (_, out) in &res {
        print!("{out}");
    }
    assert_all_ok("2 hosts × 2 ranks", &res);
    for (r, (_, out)) in res.iter().enumerate() {
        let t = transports(out, r);
        for (q, name) in t.iter().enumerate() {
            let want = if q == r {
                "self"
            } else if placement[q] == placement[r] {
                "shm"
            } else {
                "socket"
            };
            assert_eq!(name, want, "rank {r} → rank {q}");
        }
    }
}

/// Ranks interleaved over hosts (0 and 2 on host 0, 1 and 3 on host 1):
/// braid's ring keeps each host's ranks adjacent; results stay exact.
#[test]
fn interleaved_ranks_over_two_hosts() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    let res = run(&h, &[0, 1, 0, 1], "matrix", &["1", "7", "65539"]);
    assert_all_ok("interleaved placement", &res);
}

#[test]
fn four_hosts_one_rank_each() {
    let _g = serial();
    let Some(h) = hosts(4) else { return };
    let res = run(&h, &[0, 1, 2, 3], "matrix", &SIZES);
    assert_all_ok("4 hosts × 1 rank", &res);
    let res = run(&h, &[0, 1, 2, 3], "p2p", &[]);
    assert_all_ok("4 hosts × 1 rank, p2p", &res);
}

#[test]
fn delayed_and_rate_limited_link() {
    let _g = serial();
    let Some(mut h) = hosts(2) else { return };
    let how = h
        .netem(1, 2, 400, env!("CARGO_BIN_EXE_braid-netdelay"))
        .expect("delaying host 1's link");
    println!("host 1's link: 2 ms delay and 400 Mbit/s by {how:?}");
    let res = run(&h, &[0, 1, 1], "p2p", &[]);
    assert_all_ok("netem p2p", &res);
    let res = run(&h, &[0, 1, 1], "matrix", &["1", "4099", "70000"]);
    assert_all_ok("netem matrix", &res);
    if how == Delay::Queue {
        let held = h.stop_delayers().expect("stopping the delayer");
        println!("packets held back 2 ms: {held:?}");
        assert!(
            held.iter().all(|&n| n > 0),
            "the delayer saw no packets: {held:?}"
        );
    }
}

#[test]
fn killed_rank_across_hosts_is_an_error_everywhere() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    let (id, _root) = root(&h);
    let placement = [0, 0, 1, 1];
    let timeout_s = 20;
    let kids = placement
        .iter()
        .enumerate()
        .map(|(r, &host)| {
            spawn(
                &h,
                host,
                &id,
                "loop",
                r,
                4,
                &["1000000", "65536"],
                timeout_s,
            )
        })
        .collect();
    let victim = 2;
    let out = fault_run(
        kids,
        |k| {
            let _ = k[victim].kill();
        },
        Duration::from_secs(timeout_s as u64 + 15),
    );
    for (r, (code, text)) in out.ranks.iter().enumerate() {
        if r == victim {
            continue;
        }
        println!("rank {r}: {text}");
        assert_eq!(*code, Some(3), "rank {r}: {text}");
        assert!(
            text.contains("rank 2"),
            "rank {r} does not name the lost rank: {text}"
        );
    }
    assert!(
        out.elapsed < Duration::from_secs(timeout_s as u64),
        "took {:?}",
        out.elapsed
    );
}

#[test]
fn link_down_mid_collective_is_an_error_naming_the_peer() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    let (id, _root) = root(&h);
    let timeout_s = 5;
    let kids = [0, 1]
        .iter()
        .enumerate()
        .map(|(r, &host)| {
            spawn(
                &h,
                host,
                &id,
                "loop",
                r,
                2,
                &["1000000", "262144"],
                timeout_s,
            )
        })
        .collect();
    let out = fault_run(
        kids,
        |_| h.set_link(1, false).expect("link down"),
        Duration::from_secs(timeout_s as u64 * 3 + 10),
    );
    for (r, (code, text)) in out.ranks.iter().enumerate() {
        println!("rank {r}: {text}");
        assert_eq!(*code, Some(3), "rank {r}: {text}");
        let peer = format!("rank {}", 1 - r);
        assert!(
            text.contains(&peer),
            "rank {r} does not name {peer}: {text}"
        );
    }
    // Bounded by the timeout (no progress for BRAID_TIMEOUT), with slack for
    // the abort reaching the other side.
    assert!(
        out.elapsed < Duration::from_secs(timeout_s as u64 * 3),
        "took {:?}",
        out.elapsed
    );
}

#[test]
fn nothing_is_left_behind() {
    let _g = serial();
    let Some(h) = hosts(2) else { return };
    drop(h);
    let left = Hosts::leftovers(std::process::id());
    assert!(left.is_empty(), "left behind: {left:?}");
}

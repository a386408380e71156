//! Emulated hosts for multi-host tests: each "host" is a network namespace
//! with its own `/dev/shm` (a private mount namespace holding a fresh tmpfs),
//! joined to the others by a veth pair through a bridge in the test's own
//! namespace. Addresses live only inside these namespaces (10.213.N.0/24).
//! Ranks start inside a host with `nsenter`, so ranks of one host share
//! memory and ranks of different hosts do not — exactly what braid's host
//! identity has to tell apart. Everything is removed on drop.
//!
//! Needs root and iproute2 (`ip`, `tc`) and util-linux (`unshare`,
//! `nsenter`); [`Hosts::available`] says why not when they are missing.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Child, Command, Stdio};

/// How [`Hosts::netem`] delayed a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delay {
    /// tc netem (delay and rate).
    Netem,
    /// tbf for the rate, `braid-netdelay` on a netfilter queue for the delay.
    Queue,
}

/// A set of emulated hosts.
#[derive(Debug)]
pub struct Hosts {
    tag: String,
    subnet: u8,
    holders: Vec<Child>,
    /// `braid-netdelay` processes (see [`Hosts::netem`]), ended on drop.
    delayers: Vec<Child>,
    names: Vec<String>,
    bridge: String,
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    run(Command::new("ip").args(args))
}

impl Hosts {
    /// Why emulated hosts cannot be made here, if they cannot.
    pub fn available() -> Result<(), String> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err("needs root (network namespaces)".into());
        }
        for tool in ["ip", "tc", "unshare", "nsenter"] {
            let found = Command::new(tool)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok();
            if !found {
                return Err(format!(
                    "needs `{tool}` (apt-get install iproute2 util-linux)"
                ));
            }
        }
        Ok(())
    }

    /// Create `n` hosts.
    pub fn new(n: usize) -> Result<Hosts, String> {
        Self::available()?;
        sweep_dead();
        let pid = std::process::id();
        // The whole pid (at most 7 digits: interface names stay within 15
        // bytes), so [`sweep_dead`] can tell whose leftovers a name is.
        let tag = format!("{pid}");
        // A subnet per test process, so concurrent runs do not collide.
        let subnet = (pid % 200) as u8 + 20;
        let mut hosts = Hosts {
            bridge: format!("bb{tag}"),
            tag,
            subnet,
            holders: Vec::new(),
            delayers: Vec::new(),
            names: Vec::new(),
        };
        hosts.setup(n)?;
        Ok(hosts)
    }

    fn setup(&mut self, n: usize) -> Result<(), String> {
        let br = self.bridge.clone();
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", self.root_addr()),
            "dev",
            &br,
        ])?;
        ip(&["link", "set", &br, "up"])?;
        for h in 0..n {
            let ns = format!("braid-{}-h{h}", self.tag);
            ip(&["netns", "add", &ns])?;
            self.names.push(ns.clone());
            let veth = format!("bv{}h{h}", self.tag);
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &veth, "master", &br, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", self.addr(h)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            // The holder keeps the host's private /dev/shm mount namespace.
            let mut holder = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &ns,
                    "unshare",
                    "-m",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                ])
                .arg("mount -t tmpfs braid-shm /dev/shm && echo ready && exec sleep 100000")
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("starting the holder of {ns}: {e}"))?;
            let mut line = String::new();
            if let Some(out) = holder.stdout.take() {
                let _ = BufReader::new(out).read_line(&mut line);
            }
            self.holders.push(holder);
            if line.trim() != "ready" {
                return Err(format!("host {ns}: could not mount a private /dev/shm"));
            }
        }
        Ok(())
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// True when there are no hosts.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Address of host `h`.
    pub fn addr(&self, h: usize) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 213, self.subnet, h as u8 + 1))
    }

    /// Address of the bridge in the test's own namespace (where the test
    /// hosts the bootstrap root).
    pub fn root_addr(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 213, self.subnet, 254))
    }

    /// Network namespace name of host `h`.
    pub fn netns(&self, h: usize) -> &str {
        &self.names[h]
    }

    /// A command that runs `program` inside host `h` (its network and mount
    /// namespaces).
    pub fn command(&self, h: usize, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t")
            .arg(self.holders[h].id().to_string())
            .args(["-m", "-n", "--"])
            .arg(program);
        c
    }

    /// Take host `h`'s link down (or up).
    pub fn set_link(&self, h: usize, up: bool) -> Result<(), String> {
        ip(&[
            "-n",
            &self.names[h],
            "link",
            "set",
            "eth0",
            if up { "up" } else { "down" },
        ])
    }

    /// Add delay and a rate limit to the packets host `h` sends, with tc
    /// netem. Kernels built without `sch_netem` (this project's VMs) get the
    /// rate limit from tbf and the delay from `delayer` (the
    /// `braid-netdelay` binary) holding each packet in a netfilter queue,
    /// which needs `iptables`. Says how the delay was applied.
    pub fn netem(
        &mut self,
        h: usize,
        delay_ms: u32,
        rate_mbit: u32,
        delayer: &str,
    ) -> Result<Delay, String> {
        self.netem_us(h, delay_ms * 1000, rate_mbit, delayer)
    }

    /// [`Hosts::netem`] with the delay in microseconds (half a millisecond
    /// each way makes a 1 ms round trip).
    pub fn netem_us(
        &mut self,
        h: usize,
        delay_us: u32,
        rate_mbit: u32,
        delayer: &str,
    ) -> Result<Delay, String> {
        let ns = self.names[h].clone();
        let in_ns = |prog: &str, args: &[&str]| {
            run(Command::new("ip")
                .args(["netns", "exec", &ns, prog])
                .args(args))
        };
        let root = ["qdisc", "add", "dev", "eth0", "root"];
        let rate = format!("{rate_mbit}mbit");
        let delay = format!("{delay_us}us");
        let netem = [&root[..], &["netem", "delay", &delay, "rate", &rate]].concat();
        match in_ns("tc", &netem) {
            Ok(()) => return Ok(Delay::Netem),
            Err(e) if e.contains("unknown") => {}
            Err(e) => return Err(e),
        }
        let tbf = [
            &root[..],
            &["tbf", "rate", &rate, "burst", "256kb", "latency", "100ms"],
        ]
        .concat();
        in_ns("tc", &tbf)?;
        let queue = (1000 + h).to_string();
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns,
                delayer,
                &queue,
                &(f64::from(delay_us) / 1e3).to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {delayer}: {e}"))?;
        let mut line = String::new();
        if let Some(out) = child.stdout.as_mut() {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        if line.trim() != "ready" {
            drop(child.stdin.take());
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!(
                "{delayer} did not start: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        self.delayers.push(child);
        let rule = [
            "-A",
            "OUTPUT",
            "-o",
            "eth0",
            "-j",
            "NFQUEUE",
            "--queue-num",
            &queue,
        ];
        in_ns("iptables", &rule).map_err(|e| {
            format!("{e} (the delay without sch_netem needs iptables: apt-get install iptables)")
        })?;
        Ok(Delay::Queue)
    }

    /// Stop the delayers [`Hosts::netem`] started; returns how many packets
    /// each held back (from its last line, `delayed N packets`).
    pub fn stop_delayers(&mut self) -> Result<Vec<u64>, String> {
        let mut counts = Vec::new();
        for mut child in self.delayers.drain(..) {
            drop(child.stdin.take());
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&out.stdout);
            let n = text
                .lines()
                .filter_map(|l| l.strip_prefix("delayed "))
                .filter_map(|l| l.strip_suffix(" packets"))
                .find_map(|n| n.parse::<u64>().ok())
                .ok_or_else(|| {
                    format!(
                        "the delayer ended without a count: {}{}",
                        text.trim(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    )
                })?;
            counts.push(n);
        }
        Ok(counts)
    }

    /// Names of every namespace, bridge and veth this set created that still
    /// exist (for leak checks).
    pub fn leftovers(tag_of_pid: u32) -> Vec<String> {
        let tag = format!("{}", tag_of_pid % 100_000);
        let mut left = Vec::new();
        if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
            for l in String::from_utf8_lossy(&out.stdout).lines() {
                if l.starts_with(&format!("braid-{tag}-")) {
                    left.push(l.split_whitespace().next().unwrap_or("").to_string());
                }
            }
        }
        if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
            for l in String::from_utf8_lossy(&out.stdout).lines() {
                if l.contains(&format!("bb{tag}")) || l.contains(&format!("bv{tag}h")) {
                    left.push(l.to_string());
                }
            }
        }
        left
    }
}

/// Remove the namespaces, bridge and veth pairs that a test process killed
/// before its drop ran left behind (named `braid-<pid>-h<n>`, `bb<pid>`,
/// `bv<pid>h<n>`), when that process no longer exists. Leftovers of live
/// processes are theirs and stay.
fn sweep_dead() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    let list = String::from_utf8_lossy(&out.stdout);
    let mut dead = std::collections::BTreeSet::new();
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some((pid, host)) = name
            .strip_prefix("braid-")
            .and_then(|rest| rest.split_once("-h"))
        else {
            continue;
        };
        let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), host.parse::<u32>()) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let _ = ip(&["link", "del", &format!("bv{pid}h{host}")]);
        let _ = ip(&["netns", "del", name]);
        dead.insert(pid);
    }
    for pid in dead {
        let _ = ip(&["link", "del", &format!("bb{pid}")]);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // A delayer exits when its standard input closes.
        for mut d in self.delayers.drain(..) {
            drop(d.stdin.take());
            let _ = d.wait();
        }
        for h in &mut self.holders {
            let _ = h.kill();
            let _ = h.wait();
        }
        // Delete the veth pairs explicitly: a namespace's deletion removes
        // its end only asynchronously.
        for h in 0..self.names.len() {
            let _ = ip(&["link", "del", &format!("bv{}h{h}", self.tag)]);
        }
        for ns in &self.names {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

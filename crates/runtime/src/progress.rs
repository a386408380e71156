//! Hang localisation: what each communicator of this process is doing.
//!
//! Every communicator publishes a small [`Snapshot`]: the operation it runs
//! (kind, sequence number, since when) and, once the engine has to wait, the
//! peer it waits for, over which transport and for what (data, a free slot,
//! the peer's single-copy read). The engine writes it only when an operation
//! starts or ends and when a wait leaves the spinning phase, so the hot path
//! pays two uncontended lock pairs per operation.
//!
//! Three ways to look at it:
//! - [`dump`] (or [`crate::Communicator::pending`]) from any thread: an
//!   application's health endpoint can serve it;
//! - `BRAID_DUMP_SIGNAL=USR1` (or `USR2`): the signal makes the process write
//!   the dump to stderr, so `pkill -USR1 -f my_job` on every host shows which
//!   rank waits for whom;
//! - a wait that lasts longer than `BRAID_STALL_WARN` seconds (default 10, or
//!   half the timeout when that is shorter) is logged once at WARN with the
//!   same details, long before the timeout turns it into an error.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The operation a communicator is running.
#[derive(Clone, Debug)]
pub struct Running {
    /// Operation kind (`AllReduce`, `Group`, ...).
    pub op: &'static str,
    /// Its sequence number on this communicator (as in errors).
    pub seq: u64,
    /// When it started.
    pub started: Instant,
    /// Stages of the program, and the one the engine is in when it waits.
    pub stages: usize,
    pub stage: usize,
    /// What the engine waits for, once it stopped spinning.
    pub waiting: Option<Waiting>,
}

/// One blocked wait.
#[derive(Clone, Debug)]
pub struct Waiting {
    /// The rank waited for.
    pub peer: u32,
    /// The transport of the link.
    pub transport: &'static str,
    /// What is awaited (`data`, `a free slot`, ...).
    pub what: &'static str,
    /// Since when.
    pub since: Instant,
}

/// What a communicator is doing.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The running operation, if any.
    pub running: Option<Running>,
    /// Operations finished so far (successfully or not).
    pub finished: u64,
    /// Set once an operation failed: the communicator is unusable.
    pub broken: Option<String>,
}

/// A communicator's published progress.
#[derive(Debug)]
pub(crate) struct Progress {
    /// `rank r/n` and the communicator's label, for the dump.
    pub rank: u32,
    pub nranks: u32,
    pub label: String,
    /// Start and end of each operation: plain atomic stores (the hot path).
    seq: AtomicU64,
    op: AtomicUsize,
    /// Address and length of the name `op` was looked up for: a loop of
    /// the same call skips the lookup. Only `start` touches them, and one
    /// thread at a time calls it on a record (the communicator's, under its
    /// operation lock; a device proxy's, on the proxy's thread), so the
    /// pair and `op` stay consistent.
    op_name: (AtomicUsize, AtomicUsize),
    stages: AtomicUsize,
    started_ns: AtomicU64,
    finished: AtomicU64,
    /// Waits and failures (slow path only).
    slow: Mutex<Slow>,
}

#[derive(Debug, Default)]
struct Slow {
    stage: usize,
    waiting: Option<Waiting>,
    broken: Option<String>,
}

/// `seq` value while no operation runs.
const IDLE: u64 = u64::MAX;

/// Operation names by index (what `Collective::name` returns).
const OPS: [&str; 14] = [
    "AllReduce",
    "ReduceScatter",
    "AllGather",
    "Broadcast",
    "Reduce",
    "AllToAll",
    "Send",
    "Recv",
    "Group",
    "Barrier",
    "Gather",
    "Scatter",
    "AllToAllv",
    "Mailbox",
];

/// A coarse monotonic clock (the kernel's last tick, a few milliseconds
/// fine): an operation's start time is only shown by the dump in tenths of
/// a second, and the precise clock cost ~14% of an 8-byte operation's
/// software path on the VMs measured.
fn coarse_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC_COARSE)
        .map(|t| {
            u64::try_from(t.tv_sec())
                .unwrap_or(0)
                .saturating_mul(1_000_000_000)
                .saturating_add(u64::try_from(t.tv_nsec()).unwrap_or(0))
        })
        .unwrap_or(0)
}

impl Progress {
    /// A registered progress record (listed by [`dump`] while it lives).
    pub(crate) fn register(rank: u32, nranks: u32, label: String) -> Arc<Progress> {
        let p = Arc::new(Progress {
            rank,
            nranks,
            label,
            seq: AtomicU64::new(IDLE),
            op: AtomicUsize::new(0),
            op_name: (AtomicUsize::new(0), AtomicUsize::new(0)),
            stages: AtomicUsize::new(0),
            started_ns: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            slow: Mutex::new(Slow::default()),
        });
        if let Ok(mut r) = REGISTRY.lock() {
            r.retain(|w| w.strong_count() > 0);
            r.push(Arc::downgrade(&p));
        }
        p
    }

    fn slow(&self, f: impl FnOnce(&mut Slow)) {
        if let Ok(mut s) = self.slow.lock() {
            f(&mut s);
        }
    }

    /// A copy of the current state (fields read one by one: an operation
    /// that starts or ends meanwhile may show half-updated).
    pub(crate) fn snapshot(&self) -> Snapshot {
        let seq = self.seq.load(Ordering::Acquire);
        let (stage, waiting, broken) = self
            .slow
            .lock()
            .map(|s| (s.stage, s.waiting.clone(), s.broken.clone()))
            .unwrap_or_default();
        let running = (seq != IDLE).then(|| Running {
            op: OPS
                .get(self.op.load(Ordering::Relaxed))
                .copied()
                .unwrap_or("?"),
            seq,
            started: {
                let now = Instant::now();
                // 0: not stamped yet (a small operation still spinning).
                let ago = match self.started_ns.load(Ordering::Relaxed) {
                    0 => 0,
                    t => coarse_ns().saturating_sub(t),
                };
                now.checked_sub(Duration::from_nanos(ago)).unwrap_or(now)
            },
            stages: self.stages.load(Ordering::Relaxed),
            stage,
            waiting,
        });
        Snapshot {
            running,
            finished: self.finished.load(Ordering::Relaxed),
            broken,
        }
    }

    /// An operation starts. `stamp`: read the clock now; otherwise the
    /// start time is taken when the engine first stops spinning
    /// ([`Progress::stamp`]): even the coarse clock is ~10 ns through the
    /// VM's vDSO, a twentieth of an 8-byte AllReduce, and a small operation
    /// that is not waiting is over within microseconds, long before anyone
    /// could look.
    pub(crate) fn start(&self, op: &'static str, seq: u64, stages: usize, stamp: bool) {
        // Comparing the name with every entry of `OPS` was a fifth of this
        // function's instructions on an 8-byte call (`callgrind`).
        let (at, len) = (op.as_ptr() as usize, op.len());
        if self.op_name.0.load(Ordering::Relaxed) != at
            || self.op_name.1.load(Ordering::Relaxed) != len
        {
            let i = OPS.iter().position(|&o| o == op).unwrap_or(OPS.len());
            self.op.store(i, Ordering::Relaxed);
            self.op_name.0.store(at, Ordering::Relaxed);
            self.op_name.1.store(len, Ordering::Relaxed);
        }
        self.stages.store(stages, Ordering::Relaxed);
        self.started_ns
            .store(if stamp { coarse_ns() } else { 0 }, Ordering::Relaxed);
        self.seq.store(seq, Ordering::Release);
    }

    /// Record the running operation's start time if `start` did not.
    pub(crate) fn stamp(&self) {
        if self.started_ns.load(Ordering::Relaxed) == 0 {
            self.started_ns.store(coarse_ns(), Ordering::Relaxed);
        }
    }

    pub(crate) fn finish(&self, error: Option<&str>) {
        self.seq.store(IDLE, Ordering::Release);
        // One writer (the thread running the operation, under the
        // communicator's lock): no read-modify-write needed.
        self.finished.store(
            self.finished.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
        if let Some(e) = error {
            self.slow(|s| {
                s.waiting = None;
                s.broken.get_or_insert_with(|| e.to_string());
            });
        }
    }

    pub(crate) fn wait_begins(&self, stage: usize, w: Waiting) {
        self.slow(|s| {
            s.stage = stage;
            s.waiting = Some(w);
        });
    }

    pub(crate) fn wait_ends(&self) {
        self.slow(|s| s.waiting = None);
    }

    /// One line about this communicator (the dump's line without its prefix).
    pub(crate) fn describe(&self) -> String {
        describe(self, &self.snapshot(), Instant::now())
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn describe(p: &Progress, s: &Snapshot, now: Instant) -> String {
    let mut o = format!("rank {}/{} {}: ", p.rank, p.nranks, p.label);
    match &s.running {
        None => {
            let _ = write!(o, "idle after {} operation(s)", s.finished);
        }
        Some(r) => {
            let _ = write!(
                o,
                "{} #{} running for {}",
                r.op,
                r.seq,
                secs(now.saturating_duration_since(r.started))
            );
            match &r.waiting {
                Some(w) => {
                    let _ = write!(
                        o,
                        ", waiting {} for {} from rank {} over {} (stage {}/{})",
                        secs(now.saturating_duration_since(w.since)),
                        w.what,
                        w.peer,
                        w.transport,
                        r.stage + 1,
                        r.stages
                    );
                }
                None => o.push_str(", moving data"),
            }
        }
    }
    if let Some(b) = &s.broken {
        let _ = write!(o, "; unusable since: {b}");
    }
    o
}

static REGISTRY: Mutex<Vec<Weak<Progress>>> = Mutex::new(Vec::new());

/// What every live communicator of this process is doing, one line each.
pub fn dump() -> String {
    let live: Vec<Arc<Progress>> = REGISTRY
        .lock()
        .map(|r| r.iter().filter_map(Weak::upgrade).collect())
        .unwrap_or_default();
    if live.is_empty() {
        return format!(
            "braid: process {}: no live communicator\n",
            std::process::id()
        );
    }
    let now = Instant::now();
    let mut o = String::new();
    for p in live {
        o.push_str("braid: ");
        o.push_str(&describe(&p, &p.snapshot(), now));
        o.push('\n');
    }
    o
}

/// How long a wait may last before it is logged at WARN: `BRAID_STALL_WARN`
/// (`set`, see `settings`), else 10 s or half of `timeout` when shorter.
pub(crate) fn stall_warn(set: Option<Duration>, timeout: Duration) -> Duration {
    set.unwrap_or_else(|| Duration::from_secs(10).min(timeout / 2))
}

static DUMP_REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_dump_signal(_: libc::c_int) {
    // Async-signal-safe: one atomic store; the watcher thread does the rest.
    DUMP_REQUESTED.store(true, Ordering::SeqCst);
}

/// Install the `BRAID_DUMP_SIGNAL` handler and its watcher thread, once per
/// process. An unknown signal name is an error the caller reports.
pub(crate) fn install_dump_signal() -> Result<(), String> {
    use std::sync::OnceLock;
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            let Some(v) = braid_core::config::process_env(crate::settings::process::DUMP_SIGNAL)
            else {
                return Ok(());
            };
            let sig = match v
                .trim()
                .trim_start_matches("SIG")
                .to_ascii_uppercase()
                .as_str()
            {
                "" | "0" | "NONE" => return Ok(()),
                "USR1" => nix::sys::signal::Signal::SIGUSR1,
                "USR2" => nix::sys::signal::Signal::SIGUSR2,
                _ => {
                    return Err(format!(
                        "BRAID_DUMP_SIGNAL={v} is not supported; use USR1 or USR2"
                    ))
                }
            };
            std::thread::Builder::new()
                .name("braid-dump".into())
                .spawn(|| loop {
                    std::thread::sleep(Duration::from_millis(50));
                    if DUMP_REQUESTED.swap(false, Ordering::SeqCst) {
                        eprint!("{}", dump());
                    }
                })
                .map_err(|e| format!("cannot start the dump thread: {e}"))?;
            let action = nix::sys::signal::SigAction::new(
                nix::sys::signal::SigHandler::Handler(on_dump_signal),
                nix::sys::signal::SaFlags::SA_RESTART,
                nix::sys::signal::SigSet::empty(),
            );
            // SAFETY: the handler only stores to an atomic, which is
            // async-signal-safe; it replaces the default action of a user
            // signal the caller asked braid to own.
            unsafe { nix::sys::signal::sigaction(sig, &action) }
                .map_err(|e| format!("cannot install the {sig} handler: {e}"))?;
            Ok(())
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every operation name the communicator reports has a slot in `OPS`
    /// (else a hang dump would show "?").
    #[test]
    fn every_operation_name_is_recorded() {
        use braid_core::plan::{Collective, P2p, P2pKind};
        use braid_core::RedOp;
        let p2p = |kind| P2p {
            kind,
            peer: 0,
            count: 1,
        };
        let all = [
            Collective::AllReduce {
                count: 1,
                op: RedOp::Sum,
            },
            Collective::ReduceScatter {
                recv_count: 1,
                op: RedOp::Sum,
            },
            Collective::AllGather { send_count: 1 },
            Collective::Broadcast { count: 1, root: 0 },
            Collective::Reduce {
                count: 1,
                op: RedOp::Sum,
                root: 0,
            },
            Collective::AllToAll { count: 1 },
            Collective::Group(vec![p2p(P2pKind::Send)]),
            Collective::Group(vec![p2p(P2pKind::Recv)]),
            Collective::Group(vec![p2p(P2pKind::Send), p2p(P2pKind::Recv)]),
            Collective::Barrier,
        ];
        let p = Progress::register(0, 1, "names".into());
        for c in &all {
            p.start(c.name(), 1, 1, false);
            let snap = p.snapshot();
            assert_eq!(snap.running.map(|r| r.op), Some(c.name()));
            p.finish(None);
        }
        // The names of the operations built from point-to-point ones
        // (comm/exchange.rs, the mailbox of comm/p2p.rs), one after the
        // other, and a name at another address than the literal's (`start`
        // skips the lookup only for the name it looked up last).
        let copy: &'static str = Box::leak(String::from("Broadcast").into_boxed_str());
        for name in [
            "Gather",
            "Scatter",
            "AllToAllv",
            "Mailbox",
            "Broadcast",
            "AllReduce",
            copy,
            "Broadcast",
            "Broadcast",
        ] {
            p.start(name, 1, 1, false);
            assert_eq!(p.snapshot().running.map(|r| r.op), Some(name));
            p.finish(None);
        }
    }

    #[test]
    fn description_names_op_peer_transport_and_stage() {
        let p = Progress::register(2, 4, "comm x".into());
        assert!(p.describe().contains("idle after 0 operation(s)"));
        p.start("AllReduce", 7, 12, true);
        assert!(
            p.describe().contains("AllReduce #7 running"),
            "{}",
            p.describe()
        );
        assert!(p.describe().contains("moving data"));
        let t0 = Instant::now();
        p.wait_begins(
            4,
            Waiting {
                peer: 3,
                transport: "shm",
                what: "data",
                since: t0,
            },
        );
        let line = describe(&p, &p.snapshot(), t0 + Duration::from_secs(3));
        assert!(
            line.contains("rank 2/4 comm x: AllReduce #7")
                && line.contains("waiting 3.0 s for data from rank 3 over shm (stage 5/12)"),
            "{line}"
        );
        assert!(dump().contains("rank 2/4 comm x"));
        p.wait_ends();
        p.finish(Some("boom"));
        let line = p.describe();
        assert!(
            line.contains("idle after 1") && line.contains("unusable since: boom"),
            "{line}"
        );
        drop(p);
        assert!(!dump().contains("rank 2/4 comm x"));
    }

    #[test]
    fn small_operations_take_their_start_time_when_they_wait() {
        let p = Progress::register(0, 2, "lazy".into());
        p.start("Broadcast", 1, 1, false);
        assert_eq!(p.started_ns.load(Ordering::Relaxed), 0);
        // Unstamped, the dump says it just started (not 0 = boot time).
        let s = p.snapshot();
        let started = s.running.expect("running").started;
        assert!(started.elapsed() < Duration::from_secs(1));
        p.stamp();
        let t = p.started_ns.load(Ordering::Relaxed);
        assert_ne!(t, 0);
        std::thread::sleep(Duration::from_millis(30));
        p.stamp();
        assert_eq!(p.started_ns.load(Ordering::Relaxed), t, "stamped once");
        p.finish(None);
        p.start("Broadcast", 2, 1, true);
        assert!(p.started_ns.load(Ordering::Relaxed) >= t);
    }

    #[test]
    fn stall_warning_defaults_to_half_a_short_timeout() {
        let secs = Duration::from_secs;
        assert_eq!(stall_warn(None, secs(4)), secs(2));
        assert_eq!(stall_warn(None, secs(120)), secs(10));
        assert_eq!(stall_warn(Some(secs(30)), secs(4)), secs(30), "set wins");
    }
}

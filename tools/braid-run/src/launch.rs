//! Starting the ranks, watching them, and stopping them.

use std::fmt;
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};
use nix::unistd::Pid;

use crate::cli::Config;
use crate::output;

/// Exit code when `--timeout` expires (as timeout(1)).
pub(crate) const EXIT_TIMEOUT: i32 = 124;
/// How often the supervisor looks at the ranks, the clock and signals.
const TICK: Duration = Duration::from_millis(10);
/// How long to wait for output threads once every rank is gone (a process
/// that left the rank's process group may still hold its pipes).
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// `<socketaddr>/<32 lowercase hex digits>`.
pub(crate) fn format_unique_id(addr: SocketAddr, secret: &[u8; 16]) -> String {
    let mut s = format!("{addr}/");
    for b in secret {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Picks a free port on 127.0.0.1 and returns the listener holding it (to be
/// dropped just before the ranks start) and a fresh unique id naming it.
pub(crate) fn new_unique_id() -> io::Result<(TcpListener, String)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    let mut secret = [0u8; 16];
    getrandom::getrandom(&mut secret).map_err(|e| io::Error::other(format!("getrandom: {e}")))?;
    Ok((listener, format_unique_id(addr, &secret)))
}

/// How a rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RankStatus {
    /// Exited with this code.
    Exited(i32),
    /// Killed by this signal number.
    Signaled { signal: i32, core_dumped: bool },
}

impl RankStatus {
    /// Whether this counts as success.
    pub(crate) fn success(self) -> bool {
        self == RankStatus::Exited(0)
    }

    /// braid-run's exit code when this is the first failure.
    pub(crate) fn exit_code(self) -> i32 {
        match self {
            RankStatus::Exited(c) => c,
            RankStatus::Signaled { signal, .. } => 128 + signal,
        }
    }
}

/// `SIGKILL`, or `signal 40` for numbers nix has no name for.
pub(crate) fn signal_name(signal: i32) -> String {
    match Signal::try_from(signal) {
        Ok(s) => s.as_str().to_owned(),
        Err(_) => format!("SIG{signal}"),
    }
}

impl fmt::Display for RankStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RankStatus::Exited(c) => write!(f, "exited with status {c}"),
            RankStatus::Signaled {
                signal,
                core_dumped,
            } => {
                write!(f, "killed by signal {signal} ({})", signal_name(signal))?;
                if core_dumped {
                    f.write_str(" (core dumped)")?;
                }
                Ok(())
            }
        }
    }
}

/// Whether `pid` has ended, without reaping it: the zombie keeps the pid
/// (and so its process group id) reserved until we reap it, so signalling
/// the group afterwards cannot hit an unrelated process.
fn peek_exit(pid: Pid) -> io::Result<Option<RankStatus>> {
    loop {
        // SAFETY: siginfo_t is plain old data for which all-zero bytes are a
        // valid value; zeroing also makes si_pid 0 when nothing has exited.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid, writable siginfo_t; waitid only writes it.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid.as_raw() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: after a successful waitid with WEXITED the kernel filled
        // the SIGCHLD fields (si_pid, si_status) of the union, or left it all
        // zero when no child has exited; both are valid to read.
        let (si_pid, si_status) = unsafe { (info.si_pid(), info.si_status()) };
        if si_pid == 0 {
            return Ok(None);
        }
        return Ok(Some(match info.si_code {
            libc::CLD_EXITED => RankStatus::Exited(si_status),
            libc::CLD_DUMPED => RankStatus::Signaled {
                signal: si_status,
                core_dumped: true,
            },
            _ => RankStatus::Signaled {
                signal: si_status,
                core_dumped: false,
            },
        }));
    }
}

/// The last SIGINT/SIGTERM received (0: none yet), and how many.
static SIGNAL_SEEN: AtomicI32 = AtomicI32::new(0);
static SIGNAL_COUNT: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only atomics here: async-signal-safe.
    SIGNAL_SEEN.store(sig, Ordering::SeqCst);
    SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
}

fn install_signal_handlers() -> nix::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: `on_signal` only touches atomics, which is
        // async-signal-safe, and it does not reenter any other code.
        unsafe { signal::sigaction(sig, &action) }?;
    }
    Ok(())
}

/// Sends `sig` to the whole process group led by `pid` (the rank and any
/// children it started). A group that is already gone is not an error.
fn signal_group(pid: Pid, sig: Signal) {
    match signal::killpg(pid, sig) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => eprintln!("braid-run: cannot send {sig} to process group {pid}: {e}"),
    }
}

struct Rank {
    child: Child,
    pid: Pid,
    status: Option<RankStatus>,
}

/// Why the job is being stopped; decides the exit code.
#[derive(Debug, Clone, Copy)]
enum Stop {
    Failed(RankStatus),
    Timeout,
    Signal(i32),
    SpawnFailed(i32),
}

fn spawn_rank(
    cfg: &Config,
    rank: usize,
    unique_id: &str,
    parent: libc::pid_t,
) -> io::Result<Child> {
    let mut cmd = Command::new(&cfg.command[0]);
    cmd.args(&cfg.command[1..])
        .env("BRAID_UNIQUE_ID", unique_id)
        .env("BRAID_RANK", rank.to_string())
        .env("BRAID_NRANKS", cfg.nranks.to_string())
        .env("BRAID_LOCAL_RANK", rank.to_string())
        .env("BRAID_LOCAL_SIZE", cfg.nranks.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Own process group: we can kill the rank with all its children, and
        // a Ctrl-C on the terminal reaches braid-run only, which forwards it.
        .process_group(0);
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (prctl, getppid, kill, getpid); it touches
    // no locks and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // Die with braid-run, even if it is SIGKILLed. (Grandchildren are
            // not covered; the process-group kill handles them otherwise.)
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // braid-run died before prctl: no signal will come, so go now.
            if libc::getppid() != parent {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            Ok(())
        });
    }
    cmd.spawn()
}

fn spawn_pump<R: io::Read + Send + 'static, W: Write + Send + 'static>(
    input: R,
    prefix: Vec<u8>,
    out: Arc<Mutex<W>>,
    done: mpsc::Sender<()>,
) {
    let _ = thread::Builder::new()
        .name("braid-run-output".into())
        .spawn(move || {
            if let Err(e) = output::pump(input, &prefix, &out, output::MAX_LINE) {
                eprintln!("braid-run: reading rank output: {e}");
            }
            let _ = done.send(());
        })
        .map_err(|e| eprintln!("braid-run: cannot start an output thread: {e}"));
}

/// Runs the job; returns braid-run's exit code.
pub(crate) fn run(cfg: &Config) -> i32 {
    if let Err(e) = install_signal_handlers() {
        eprintln!("braid-run: cannot install signal handlers: {e}");
        return 1;
    }
    let (listener, unique_id) = match new_unique_id() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("braid-run: cannot pick a bootstrap port on 127.0.0.1: {e}");
            return 1;
        }
    };
    let stdout = Arc::new(Mutex::new(io::stdout()));
    let stderr = Arc::new(Mutex::new(io::stderr()));
    let (done_tx, done_rx) = mpsc::channel();
    let mut pumps = 0usize;
    let parent = std::process::id() as libc::pid_t;

    // Free the port for rank 0 to bind.
    drop(listener);
    let mut ranks: Vec<Rank> = Vec::with_capacity(cfg.nranks);
    let mut stop: Option<Stop> = None;
    for rank in 0..cfg.nranks {
        match spawn_rank(cfg, rank, &unique_id, parent) {
            Ok(mut child) => {
                let prefix = output::prefix_for(rank, cfg.prefix);
                if let Some(o) = child.stdout.take() {
                    spawn_pump(o, prefix.clone(), Arc::clone(&stdout), done_tx.clone());
                    pumps += 1;
                }
                if let Some(e) = child.stderr.take() {
                    spawn_pump(e, prefix, Arc::clone(&stderr), done_tx.clone());
                    pumps += 1;
                }
                let pid = Pid::from_raw(child.id() as libc::pid_t);
                ranks.push(Rank {
                    child,
                    pid,
                    status: None,
                });
            }
            Err(e) => {
                let code = match e.kind() {
                    io::ErrorKind::NotFound => 127,
                    io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
                eprintln!(
                    "braid-run: cannot start rank {rank} ({}): {e}{}",
                    cfg.command[0].to_string_lossy(),
                    if ranks.is_empty() {
                        ""
                    } else {
                        "; stopping the other ranks"
                    }
                );
                stop = Some(Stop::SpawnFailed(code));
                break;
            }
        }
        if SIGNAL_COUNT.load(Ordering::SeqCst) > 0 {
            break; // handled by the loop below
        }
    }
    drop(done_tx);

    let code = supervise(cfg, &mut ranks, stop);

    // Every rank has ended. Kill what is left in their process groups (e.g.
    // background jobs of a rank) so they release the output pipes, then reap.
    for r in &ranks {
        signal_group(r.pid, Signal::SIGKILL);
    }
    for r in &mut ranks {
        if let Err(e) = r.child.wait() {
            eprintln!("braid-run: waiting for rank pid {}: {e}", r.pid);
        }
    }
    let deadline = Instant::now() + DRAIN_WAIT;
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            eprintln!("braid-run: some rank output is still held open by a process that left its process group; not waiting for it");
            break;
        }
    }
    let _ = io::stdout().flush();
    code
}

/// Watches the ranks until all have ended, stopping them on the first
/// failure, on timeout or on SIGINT/SIGTERM. Returns the exit code.
fn supervise(cfg: &Config, ranks: &mut [Rank], mut stop: Option<Stop>) -> i32 {
    let start = Instant::now();
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let mut signals_handled = 0;
    let nranks = ranks.len();

    let stop_all = |ranks: &[Rank], sig: Signal| {
        for r in ranks {
            signal_group(r.pid, sig);
        }
    };
    if stop.is_some() {
        stop_all(ranks, Signal::SIGTERM);
        kill_at = Some(Instant::now() + cfg.grace);
    }

    loop {
        // Signals sent to braid-run.
        let count = SIGNAL_COUNT.load(Ordering::SeqCst);
        if count != signals_handled {
            signals_handled = count;
            let sig = SIGNAL_SEEN.load(Ordering::SeqCst);
            let forwarded = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
            if kill_at.is_none() {
                eprintln!(
                    "braid-run: received {}; stopping the ranks",
                    signal_name(sig)
                );
                stop.get_or_insert(Stop::Signal(sig));
                stop_all(ranks, forwarded);
                kill_at = Some(Instant::now() + cfg.grace);
            } else if !killed {
                eprintln!(
                    "braid-run: received {} again; killing the ranks",
                    signal_name(sig)
                );
                stop_all(ranks, Signal::SIGKILL);
                killed = true;
            }
        }

        // Ranks that ended.
        let mut running = 0;
        for i in 0..nranks {
            if ranks[i].status.is_some() {
                continue;
            }
            let status = match peek_exit(ranks[i].pid) {
                Ok(Some(s)) => s,
                Ok(None) => {
                    running += 1;
                    continue;
                }
                Err(e) => {
                    // Not our child any more (cannot happen); count it as failed.
                    eprintln!("braid-run: cannot wait for rank {i}: {e}");
                    RankStatus::Exited(1)
                }
            };
            ranks[i].status = Some(status);
            if !status.success() && stop.is_none() {
                let others = ranks.iter().any(|r| r.status.is_none());
                eprintln!(
                    "braid-run: rank {i} {status}{}",
                    if others {
                        "; stopping the other ranks"
                    } else {
                        ""
                    }
                );
                stop = Some(Stop::Failed(status));
                // The failed rank's own group too: its children may live on.
                stop_all(ranks, Signal::SIGTERM);
                kill_at = Some(Instant::now() + cfg.grace);
            }
        }
        if running == 0 {
            break;
        }

        // The job's time limit.
        if let Some(limit) = cfg.timeout {
            if stop.is_none() && start.elapsed() >= limit {
                eprintln!(
                    "braid-run: the job ran longer than --timeout {}s; stopping the ranks",
                    limit.as_secs_f64()
                );
                stop = Some(Stop::Timeout);
                stop_all(ranks, Signal::SIGTERM);
                kill_at = Some(Instant::now() + cfg.grace);
            }
        }

        // Escalation after the grace period.
        if let Some(at) = kill_at {
            if !killed && Instant::now() >= at {
                stop_all(ranks, Signal::SIGKILL);
                killed = true;
            }
        }
        thread::sleep(TICK);
    }

    match stop {
        None => 0,
        Some(Stop::Failed(s)) => match s.exit_code() {
            0 => 1,
            c => c,
        },
        Some(Stop::Timeout) => EXIT_TIMEOUT,
        Some(Stop::Signal(sig)) => 128 + sig,
        Some(Stop::SpawnFailed(code)) => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_format() {
        let secret = [
            0x00, 0x01, 0xab, 0xff, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0,
            0xb0, 0xc0,
        ];
        let v4: SocketAddr = "127.0.0.1:41234".parse().expect("addr");
        assert_eq!(
            format_unique_id(v4, &secret),
            "127.0.0.1:41234/0001abff102030405060708090a0b0c0"
        );
        let v6: SocketAddr = "[::1]:41234".parse().expect("addr");
        assert!(format_unique_id(v6, &secret).starts_with("[::1]:41234/0001abff"));

        let (l, id) = new_unique_id().expect("unique id");
        let (addr, secret) = id.split_once('/').expect("slash");
        let addr: SocketAddr = addr.parse().expect("socket addr");
        assert_eq!(addr, l.local_addr().expect("local addr"));
        assert_ne!(addr.port(), 0);
        assert_eq!(secret.len(), 32);
        assert!(secret
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        let (_, id2) = new_unique_id().expect("unique id");
        assert_ne!(
            id.split_once('/').map(|x| x.1),
            id2.split_once('/').map(|x| x.1)
        );
    }

    #[test]
    fn statuses() {
        assert!(RankStatus::Exited(0).success());
        assert!(!RankStatus::Exited(3).success());
        assert_eq!(RankStatus::Exited(3).exit_code(), 3);
        let k = RankStatus::Signaled {
            signal: 9,
            core_dumped: false,
        };
        assert_eq!(k.exit_code(), 137);
        assert_eq!(k.to_string(), "killed by signal 9 (SIGKILL)");
        assert_eq!(RankStatus::Exited(3).to_string(), "exited with status 3");
        let d = RankStatus::Signaled {
            signal: 11,
            core_dumped: true,
        };
        assert_eq!(d.to_string(), "killed by signal 11 (SIGSEGV) (core dumped)");
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(40), "SIG40");
    }
}

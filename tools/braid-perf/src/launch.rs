//! `-np N`: this process hosts the rendezvous root and runs N copies of
//! itself as the ranks, passing each its rank, the rank count and the
//! unique id through hidden flags (the children never host a root). Unless
//! `--bind none`, each rank is bound to a core of its own first, as `mpirun`
//! binds two ranks (`braid_core::topo::bind`).

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use braid_core::topo::bind;
use braid_core::topo::CpuSet;

use crate::cli::Opts;

/// An error line for stderr: `braid-perf: <msg>`, with the prefix once
/// even when `msg` already has it.
pub fn error_line(msg: &str) -> String {
    let mut m = msg.trim_start();
    while let Some(rest) = m.strip_prefix("braid-perf:") {
        m = rest.trim_start();
    }
    format!("braid-perf: {m}")
}

/// `rank <r>: <msg>`, unless `msg` already starts by naming this rank
/// (braid's operation errors do).
pub fn for_rank(rank: u32, msg: &str) -> String {
    let m = error_line(msg);
    let m = m.strip_prefix("braid-perf: ").unwrap_or(&m);
    let me = format!("rank {rank}:");
    if m.starts_with(&me) {
        m.to_string()
    } else {
        format!("{me} {m}")
    }
}

/// Where the ranks' binding is described to them (for the header).
pub const BINDING_ENV: &str = "BRAID_PERF_BINDING";

/// The CPUs for each of `np` ranks, or `None` (unbound), and a line saying
/// which and why.
fn binding(np: usize, wanted: bool) -> (Option<Vec<CpuSet>>, String) {
    if !wanted {
        return (None, "none (--bind none)".into());
    }
    let Some(allowed) = bind::allowed_cpus() else {
        return (None, "none (this process's CPUs are unknown)".into());
    };
    let cores = bind::cores(
        |rel| std::fs::read_to_string(std::path::Path::new("/").join(rel)).ok(),
        &allowed,
    );
    // cpu_set_t holds CPU ids below CPU_SETSIZE.
    let fits = |c: &CpuSet| {
        c.0.iter()
            .all(|&x| (x as usize) < libc::CPU_SETSIZE as usize)
    };
    match bind::by_core(np, &cores) {
        Some(b) if b.iter().all(fits) => {
            let d = b
                .iter()
                .enumerate()
                .map(|(r, c)| format!("{r}:{}", c.to_list()))
                .collect::<Vec<_>>()
                .join(" ");
            (Some(b), format!("one core per rank (rank:CPUs) {d}"))
        }
        Some(_) => (None, "none (CPU ids beyond cpu_set_t)".into()),
        None => (
            None,
            format!(
                "none ({np} ranks for {} cores: left to the scheduler)",
                cores.len()
            ),
        ),
    }
}

/// Make `cmd`'s process run only on `cpus` from its start.
fn bind_to(cmd: &mut Command, cpus: &CpuSet) {
    // SAFETY: cpu_set_t is a plain bit array, valid all-zero.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in &cpus.0 {
        // SAFETY: `c` is below CPU_SETSIZE (`binding` checked), so the bit
        // lies inside `set`.
        unsafe { libc::CPU_SET(c as usize, &mut set) };
    }
    // SAFETY: the closure runs in the forked child before exec; it only
    // makes one system call (async-signal-safe) on a set built before the
    // fork, and neither allocates nor takes locks.
    unsafe {
        cmd.pre_exec(move || {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The arguments without `-np N` (`-np N`, `--np N`, `--np=N`).
pub fn strip_np(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "-np" || a == "--np" {
            i += 2;
            continue;
        }
        if a.starts_with("--np=") {
            i += 1;
            continue;
        }
        out.push(args[i].clone());
        i += 1;
    }
    out
}

/// How a child ended, as an exit code of ours (128 + signal if killed).
fn code_of(st: std::process::ExitStatus) -> i32 {
    if let Some(c) = st.code() {
        return c;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = st.signal() {
            return 128 + s;
        }
    }
    1
}

/// Start `opts.np` ranks and wait for them. Returns the exit code: 0 when
/// all succeed, else the first failing rank's code (the others are stopped
/// after a short grace period, so that their own error messages get out).
pub fn launch(opts: &Opts) -> Result<i32, String> {
    let np = opts.np.unwrap_or(1);
    let timeout = match opts.timeout {
        Some(t) => crate::cli::timeout_duration(t),
        None => {
            braid::Config::from_env()
                .map_err(|e| e.to_string())?
                .timeout
        }
    };
    let addr: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 0));
    let (id, root) = braid::RootServer::create(addr, timeout)
        .map_err(|e| format!("cannot host the rendezvous on 127.0.0.1: {e}"))?;
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find this program to start the ranks: {e}"))?;
    let args = strip_np(&opts.raw_args);
    let (cpus, described) = binding(np as usize, opts.bind);
    let mut children: Vec<Option<Child>> = Vec::new();
    for r in 0..np {
        let mut cmd = Command::new(&exe);
        cmd.arg(opts.bench.name())
            .args(&args)
            .args(["--child-rank", &r.to_string()])
            .args(["--child-nranks", &np.to_string()])
            .args(["--child-id", &id.to_string()])
            .env(BINDING_ENV, &described)
            .stdin(Stdio::null());
        if let Some(c) = cpus.as_ref().and_then(|b| b.get(r as usize)) {
            bind_to(&mut cmd, c);
        }
        let child = cmd.spawn();
        match child {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                stop_all(&mut children);
                return Err(format!("cannot start rank {r} ({}): {e}", exe.display()));
            }
        }
    }
    let mut failed: Option<(usize, i32)> = None;
    let mut deadline: Option<Instant> = None;
    loop {
        let mut running = 0;
        for (r, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait() {
                Ok(Some(st)) => {
                    *slot = None;
                    if !st.success() && failed.is_none() {
                        failed = Some((r, code_of(st)));
                        deadline = Some(Instant::now() + Duration::from_secs(2));
                    }
                }
                Ok(None) => running += 1,
                Err(e) => {
                    eprintln!("braid-perf: cannot wait for rank {r}: {e}");
                    running += 1;
                }
            }
        }
        if running == 0 {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            stop_all(&mut children);
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(root);
    Ok(match failed {
        Some((r, code)) => {
            eprintln!("braid-perf: rank {r} of {np} failed (exit status {code})");
            if code == 0 {
                1
            } else {
                code
            }
        }
        None => 0,
    })
}

fn stop_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
    }
    for slot in children.iter_mut() {
        if let Some(mut c) = slot.take() {
            let _ = c.wait();
        }
    }
}

/// Ask the kernel to kill this process when its parent (the `-np`
/// launcher) dies, so that no rank outlives an interrupted run.
pub fn die_with_parent() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl(PR_SET_PDEATHSIG, SIGKILL) takes plain integers, touches
    // no memory of ours and only changes this process's own attributes.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn np_is_removed_in_every_spelling() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            strip_np(&s(&["-b", "8", "-np", "2", "-e", "1K"])),
            s(&["-b", "8", "-e", "1K"])
        );
        assert_eq!(strip_np(&s(&["--np", "3", "-n", "1"])), s(&["-n", "1"]));
        assert_eq!(strip_np(&s(&["--np=3", "-n", "1"])), s(&["-n", "1"]));
    }

    /// One `braid-perf:` and one `rank N:` per line, whatever the message
    /// already says.
    #[test]
    fn error_prefixes_appear_once() {
        assert_eq!(error_line("no such file"), "braid-perf: no such file");
        assert_eq!(
            error_line("braid-perf: braid-perf: rank 1: gone"),
            "braid-perf: rank 1: gone"
        );
        assert_eq!(for_rank(1, "bootstrap: x"), "rank 1: bootstrap: x");
        assert_eq!(
            for_rank(0, "rank 0: AllGather #0 failed: shm link with rank 1"),
            "rank 0: AllGather #0 failed: shm link with rank 1"
        );
        assert_eq!(for_rank(1, "braid-perf: rank 1: y"), "rank 1: y");
        // Another rank named first is not this rank's prefix.
        assert_eq!(for_rank(1, "rank 10: z"), "rank 1: rank 10: z");
        assert_eq!(
            error_line(&for_rank(2, "braid-perf: boom")),
            "braid-perf: rank 2: boom"
        );
    }
}

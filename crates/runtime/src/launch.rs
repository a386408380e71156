//! The launch environment: rank, size and bootstrap root from the variables
//! that launchers set.
//!
//! | source | rank / size / local | root address | port | secret |
//! | --- | --- | --- | --- | --- |
//! | `braid` (`braid-run`, or by hand) | `BRAID_RANK`, `BRAID_NRANKS`, `BRAID_LOCAL_RANK`, `BRAID_LOCAL_SIZE` | `BRAID_UNIQUE_ID` | `BRAID_UNIQUE_ID` | `BRAID_UNIQUE_ID` |
//! | `torchrun` (also DeepSpeed, accelerate) | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | `BRAID_ROOT_ADDR`, else `MASTER_ADDR` | `BRAID_PORT`, else `MASTER_PORT + 1` | `BRAID_SECRET`, else derived |
//! | `openmpi` (`mpirun`) | `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}` | `BRAID_ROOT_ADDR`, else `MASTER_ADDR`, else `127.0.0.1` on one host | `BRAID_PORT`, else derived from the job id | `BRAID_SECRET`, else derived |
//! | `slurm` (`srun`) | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, tasks per node | `BRAID_ROOT_ADDR`, else `MASTER_ADDR`, else the first host of the step's node list | `BRAID_PORT`, else derived from the job id | `BRAID_SECRET`, else derived |
//!
//! Precedence: `BRAID_RANK`/`BRAID_NRANKS` first, then torchrun, Open MPI,
//! Slurm. Open MPI comes before Slurm because `mpirun` inside a Slurm
//! allocation starts its daemons with `srun`, so its processes inherit the
//! daemon's `SLURM_PROCID` (one per node, not the MPI rank). A set
//! `BRAID_UNIQUE_ID` always gives the root address and secret, whichever
//! launcher gives the ranks. Empty variables count as unset.
//!
//! Rank 0 hosts the bootstrap root ([`LaunchInfo::host_root`]).
//!
//! **torchrun's port**: `MASTER_PORT` belongs to torch's own TCP store, so the
//! braid root listens on `MASTER_PORT + 1` unless `BRAID_PORT` says otherwise.
//!
//! **Derived ports** (Slurm, Open MPI) lie in `20000..30000`, below Linux's
//! ephemeral range: Slurm uses `20000 + (SLURM_JOB_ID + 7919 * SLURM_STEP_ID)
//! mod 10000` (consecutive jobs on a node get different ports); Open MPI hashes
//! the job id (`OMPI_MCA_ess_base_jobid` or `PMIX_NAMESPACE`). Set `BRAID_PORT`
//! if the port is taken.
//!
//! **Derived secrets** are a hash of the job's identity (run id, master
//! address and port; Slurm job and step id; Open MPI job id). Anyone who can
//! see the job's identity can compute them: they keep ranks of different jobs
//! from joining each other by accident, but they do not protect against an
//! attacker on the network. For a real secret set `BRAID_SECRET` (32 hex
//! digits, the same in every rank, e.g. from `openssl rand -hex 16`) or
//! `BRAID_UNIQUE_ID`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::bootstrap::{parse_secret_hex, RootServer, UniqueId};
use crate::error::{Error, Result};

/// The default bootstrap and communication timeout when `BRAID_TIMEOUT` is
/// unset: 120 s — long enough for slow starts of large jobs, short enough that
/// a hang is noticed.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Reads `BRAID_TIMEOUT` (seconds, fractions allowed, e.g. `2.5`); the
/// default is [`DEFAULT_TIMEOUT`] (120 s).
pub fn timeout_from_env() -> Result<Duration> {
    timeout_from_vars(braid_core::config::process_env)
}

/// [`timeout_from_env`] over any variable source. Accepts 1 ms to a year;
/// anything else is an error that names `BRAID_TIMEOUT`.
pub fn timeout_from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Duration> {
    const MIN: Duration = Duration::from_millis(1);
    const MAX: Duration = Duration::from_secs(365 * 24 * 3600);
    let Some(v) = var(&get, "BRAID_TIMEOUT") else {
        return Ok(DEFAULT_TIMEOUT);
    };
    let bad = |why: &str| {
        Error::Env(format!(
            "BRAID_TIMEOUT={v:?} is not a timeout{why}: give a positive number of seconds from \
             0.001 to {} (a year), e.g. BRAID_TIMEOUT=120 or BRAID_TIMEOUT=2.5 (unset means {}s)",
            MAX.as_secs(),
            DEFAULT_TIMEOUT.as_secs()
        ))
    };
    let secs: f64 = v.parse().map_err(|_| bad(""))?;
    if !secs.is_finite() || secs <= 0.0 {
        return Err(bad(""));
    }
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d < MIN => Err(bad(" (below 1 ms)")),
        Ok(d) if d <= MAX => Ok(d),
        _ => Err(bad(" (over a year)")),
    }
}

/// The value of `name` through `get`, trimmed; empty counts as unset.
use braid_core::config::value as var;

/// `name` as a count (`u32`), or `None` when unset; a bad value says what
/// the launcher should give (`hint`).
fn opt_u32(get: &impl Fn(&str) -> Option<String>, name: &str, hint: &str) -> Result<Option<u32>> {
    braid_core::config::number::<u32>(get, name).map_err(|e| {
        Error::Env(format!(
            "{name}={:?} is not a non-negative integer; {hint}",
            e.value
        ))
    })
}

fn req_u32(get: &impl Fn(&str) -> Option<String>, name: &str, hint: &str) -> Result<u32> {
    opt_u32(get, name, hint)?.ok_or_else(|| Error::Env(format!("{name} is not set; {hint}")))
}

fn port_var(get: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<u16>> {
    let Some(v) = var(get, name) else {
        return Ok(None);
    };
    match v.parse::<u16>() {
        Ok(p) if p != 0 => Ok(Some(p)),
        _ => Err(Error::Env(format!(
            "{name}={v:?} is not a TCP port: give a number in 1..=65535"
        ))),
    }
}

/// Where a process learns who it is and where the bootstrap root is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchInfo {
    /// This process's rank.
    pub rank: u32,
    /// The number of ranks.
    pub nranks: u32,
    /// The rank among the processes of this host.
    pub local_rank: u32,
    /// The number of ranks on this host, when the launcher says.
    pub local_size: Option<u32>,
    /// The bootstrap root and secret.
    pub id: UniqueId,
    /// True if this process must host the [`RootServer`] (rank 0).
    pub host_root: bool,
    /// The address the root should listen on when this process hosts it:
    /// `id.addr` for an explicit `BRAID_UNIQUE_ID` or a loopback address,
    /// otherwise the unspecified address of the same family with the id's
    /// port (a host name may resolve differently on the root's own host,
    /// e.g. to 127.0.1.1).
    pub bind_addr: SocketAddr,
    /// Which launcher: `"braid"`, `"torchrun"`, `"slurm"` or `"openmpi"`.
    pub source: &'static str,
}

const NO_LAUNCHER: &str = "no launch environment found: run under braid-run, torchrun, srun \
     or mpirun, or set BRAID_UNIQUE_ID=<ip>:<port>/<32 hex>, BRAID_RANK and BRAID_NRANKS";

impl LaunchInfo {
    /// Reads the process environment. See the module documentation.
    pub fn from_env() -> Result<LaunchInfo> {
        LaunchInfo::from_vars(braid_core::config::process_env)
    }

    /// Reads the launch information from any variable source (testable).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchInfo> {
        let get = &get;
        let explicit_id = match var(get, "BRAID_UNIQUE_ID") {
            Some(v) => Some(v.parse::<UniqueId>().map_err(|e| {
                Error::Env(format!(
                    "BRAID_UNIQUE_ID: {}",
                    e.to_string().trim_start_matches("invalid argument: ")
                ))
            })?),
            None => None,
        };
        let has = |n: &str| var(get, n).is_some();

        let (ranks, source) = if has("BRAID_RANK") || has("BRAID_NRANKS") {
            (braid_ranks(get)?, "braid")
        } else if has("RANK") && has("WORLD_SIZE") {
            (torchrun_ranks(get)?, "torchrun")
        } else if has("OMPI_COMM_WORLD_RANK") && has("OMPI_COMM_WORLD_SIZE") {
            (openmpi_ranks(get)?, "openmpi")
        } else if has("SLURM_PROCID") && (has("SLURM_NTASKS") || has("SLURM_NPROCS")) {
            (slurm_ranks(get)?, "slurm")
        } else if explicit_id.is_some() {
            return Err(Error::Env(
                "BRAID_UNIQUE_ID is set but this process's rank is not: set BRAID_RANK and \
                 BRAID_NRANKS (or run under torchrun, srun or mpirun)"
                    .into(),
            ));
        } else {
            return Err(Error::Env(NO_LAUNCHER.into()));
        };

        let (id, bind_addr) = match explicit_id {
            Some(id) => (id, id.addr),
            None => {
                let id = match source {
                    "torchrun" => torchrun_root(get)?,
                    "openmpi" => openmpi_root(get, &ranks)?,
                    "slurm" => slurm_root(get)?,
                    _ => {
                        return Err(Error::Env(
                            "BRAID_RANK/BRAID_NRANKS are set but BRAID_UNIQUE_ID is not; set \
                             BRAID_UNIQUE_ID=<ip>:<port>/<32 hex> (braid-run does this)"
                                .into(),
                        ))
                    }
                };
                let bind = if id.addr.ip().is_loopback() {
                    id.addr
                } else {
                    let any = match id.addr {
                        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                    };
                    SocketAddr::new(any, id.addr.port())
                };
                (id, bind)
            }
        };

        Ok(LaunchInfo {
            rank: ranks.rank,
            nranks: ranks.nranks,
            local_rank: ranks.local_rank,
            local_size: ranks.local_size,
            id,
            host_root: ranks.rank == 0,
            bind_addr,
            source,
        })
    }

    /// Starts the bootstrap root if this process hosts it ([`Self::host_root`]),
    /// listening on [`Self::bind_addr`] with the id's secret.
    pub fn host_root_server(&self, timeout: Duration) -> Result<Option<RootServer>> {
        if !self.host_root {
            return Ok(None);
        }
        RootServer::listen(self.bind_addr, self.id.secret, timeout).map(Some)
    }
}

#[derive(Debug)]
struct Ranks {
    rank: u32,
    nranks: u32,
    local_rank: u32,
    local_size: Option<u32>,
}

/// Checks the numbers and names the variables when they disagree.
fn check_ranks(r: Ranks, names: [&str; 4]) -> Result<Ranks> {
    let [rank_v, size_v, lrank_v, lsize_v] = names;
    if r.nranks == 0 {
        return Err(Error::Env(format!(
            "{size_v}=0: the number of ranks must be at least 1"
        )));
    }
    if r.rank >= r.nranks {
        return Err(Error::Env(format!(
            "{rank_v}={} is not below {size_v}={}: ranks are 0..{size_v}-1; check the launcher's variables",
            r.rank, r.nranks
        )));
    }
    if let Some(ls) = r.local_size {
        if ls == 0 || ls > r.nranks {
            return Err(Error::Env(format!(
                "{lsize_v}={ls} must be in 1..={size_v}={}",
                r.nranks
            )));
        }
        if r.local_rank >= ls {
            return Err(Error::Env(format!(
                "{lrank_v}={} is not below {lsize_v}={ls}",
                r.local_rank
            )));
        }
    }
    Ok(r)
}

fn braid_ranks(get: &impl Fn(&str) -> Option<String>) -> Result<Ranks> {
    let hint = "set BRAID_RANK (0-based) and BRAID_NRANKS for every process (braid-run does this)";
    let rank = req_u32(get, "BRAID_RANK", hint)?;
    let nranks = req_u32(get, "BRAID_NRANKS", hint)?;
    let lhint = "set BRAID_LOCAL_RANK and BRAID_LOCAL_SIZE to the rank and size on this host";
    // braid-run launches one host: without BRAID_LOCAL_RANK the rank is local.
    let local_rank = opt_u32(get, "BRAID_LOCAL_RANK", lhint)?.unwrap_or(rank);
    let local_size = opt_u32(get, "BRAID_LOCAL_SIZE", lhint)?;
    check_ranks(
        Ranks {
            rank,
            nranks,
            local_rank,
            local_size,
        },
        [
            "BRAID_RANK",
            "BRAID_NRANKS",
            "BRAID_LOCAL_RANK",
            "BRAID_LOCAL_SIZE",
        ],
    )
}

fn torchrun_ranks(get: &impl Fn(&str) -> Option<String>) -> Result<Ranks> {
    let hint =
        "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT";
    check_ranks(
        Ranks {
            rank: req_u32(get, "RANK", hint)?,
            nranks: req_u32(get, "WORLD_SIZE", hint)?,
            local_rank: req_u32(get, "LOCAL_RANK", hint)?,
            local_size: opt_u32(get, "LOCAL_WORLD_SIZE", hint)?,
        },
        ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    )
}

fn openmpi_ranks(get: &impl Fn(&str) -> Option<String>) -> Result<Ranks> {
    let hint = "mpirun sets OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK and _LOCAL_SIZE";
    check_ranks(
        Ranks {
            rank: req_u32(get, "OMPI_COMM_WORLD_RANK", hint)?,
            nranks: req_u32(get, "OMPI_COMM_WORLD_SIZE", hint)?,
            local_rank: req_u32(get, "OMPI_COMM_WORLD_LOCAL_RANK", hint)?,
            local_size: opt_u32(get, "OMPI_COMM_WORLD_LOCAL_SIZE", hint)?,
        },
        [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
    )
}

fn slurm_ranks(get: &impl Fn(&str) -> Option<String>) -> Result<Ranks> {
    let hint = "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID for every task";
    let size_var = if var(get, "SLURM_NTASKS").is_some() {
        "SLURM_NTASKS"
    } else {
        "SLURM_NPROCS"
    };
    let rank = req_u32(get, "SLURM_PROCID", hint)?;
    let nranks = req_u32(get, size_var, hint)?;
    let local_rank = req_u32(get, "SLURM_LOCALID", hint)?;
    let local_size = slurm_local_size(get);
    check_ranks(
        Ranks {
            rank,
            nranks,
            local_rank,
            local_size,
        },
        [
            "SLURM_PROCID",
            size_var,
            "SLURM_LOCALID",
            "SLURM_STEP_TASKS_PER_NODE",
        ],
    )
}

/// Tasks on this node from `SLURM_STEP_TASKS_PER_NODE` (or
/// `SLURM_TASKS_PER_NODE`), e.g. `4(x2),3`, indexed by `SLURM_NODEID`.
fn slurm_local_size(get: &impl Fn(&str) -> Option<String>) -> Option<u32> {
    let spec =
        var(get, "SLURM_STEP_TASKS_PER_NODE").or_else(|| var(get, "SLURM_TASKS_PER_NODE"))?;
    let node: u64 = var(get, "SLURM_NODEID")?.parse().ok()?;
    let mut seen: u64 = 0;
    for item in spec.split(',') {
        let (count, reps) = match item.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')')?.parse::<u64>().ok()?),
            None => (item, 1),
        };
        let count: u32 = count.trim().parse().ok()?;
        seen += reps;
        if node < seen {
            return Some(count);
        }
    }
    None
}

/// BRAID_SECRET, or a secret derived from the job's identity (see the module
/// documentation: it protects against accidents, not attackers).
fn secret(
    get: &impl Fn(&str) -> Option<String>,
    launcher: &str,
    identity: &[&str],
) -> Result<[u8; 16]> {
    if let Some(v) = var(get, "BRAID_SECRET") {
        return parse_secret_hex(&v).ok_or_else(|| {
            Error::Env(format!(
                "BRAID_SECRET must be 32 hex digits (16 bytes, e.g. from `openssl rand -hex 16`), \
                 got {} characters",
                v.len()
            ))
        });
    }
    let mut h = Sha256::new();
    h.update(b"braid-derived-secret-v1");
    h.update((launcher.len() as u64).to_be_bytes());
    h.update(launcher.as_bytes());
    for part in identity {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let d: [u8; 32] = h.finalize().into();
    let mut out = [0u8; 16];
    out.copy_from_slice(&d[..16]);
    Ok(out)
}

/// Resolves `host` (a name or an IP, IPv6 with or without brackets) with
/// `port`, preferring IPv4.
fn resolve(host_var: &str, host: &str, port: u16) -> Result<SocketAddr> {
    let h = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = h.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let addrs: Vec<SocketAddr> = (h, port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::Env(format!(
                "cannot resolve {host_var}={host:?}: {e}; set BRAID_ROOT_ADDR to the IP address of the host of rank 0"
            ))
        })?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| {
            Error::Env(format!(
                "{host_var}={host:?} resolves to no address; set BRAID_ROOT_ADDR to the IP address of the host of rank 0"
            ))
        })
}

fn torchrun_root(get: &impl Fn(&str) -> Option<String>) -> Result<UniqueId> {
    let hint = "torchrun sets MASTER_ADDR and MASTER_PORT; set them, or BRAID_UNIQUE_ID";
    let master_addr = var(get, "MASTER_ADDR")
        .ok_or_else(|| Error::Env(format!("MASTER_ADDR is not set; {hint}")))?;
    let master_port = port_var(get, "MASTER_PORT")?
        .ok_or_else(|| Error::Env(format!("MASTER_PORT is not set; {hint}")))?;
    let port = match port_var(get, "BRAID_PORT")? {
        Some(p) => p,
        None => master_port.checked_add(1).ok_or_else(|| {
            Error::Env(
                "MASTER_PORT=65535 leaves no port for braid's root (MASTER_PORT + 1); set BRAID_PORT"
                    .into(),
            )
        })?,
    };
    let (host_var, host) = match var(get, "BRAID_ROOT_ADDR") {
        Some(h) => ("BRAID_ROOT_ADDR", h),
        None => ("MASTER_ADDR", master_addr.clone()),
    };
    let addr = resolve(host_var, &host, port)?;
    let run_id = var(get, "TORCHELASTIC_RUN_ID").unwrap_or_default();
    let secret = secret(
        get,
        "torchrun",
        &[&run_id, &master_addr, &master_port.to_string()],
    )?;
    Ok(UniqueId { addr, secret })
}

fn slurm_root(get: &impl Fn(&str) -> Option<String>) -> Result<UniqueId> {
    let job = var(get, "SLURM_JOB_ID").or_else(|| var(get, "SLURM_JOBID"));
    let step = var(get, "SLURM_STEP_ID").or_else(|| var(get, "SLURM_STEPID"));
    let port = match port_var(get, "BRAID_PORT")? {
        Some(p) => p,
        None => {
            let job = job.as_deref().ok_or_else(|| {
                Error::Env(
                    "SLURM_JOB_ID is not set, so braid cannot derive a port; set BRAID_PORT".into(),
                )
            })?;
            let j: u64 = job.parse().map_err(|_| {
                Error::Env(format!(
                    "SLURM_JOB_ID={job:?} is not a number, so braid cannot derive a port; set BRAID_PORT"
                ))
            })?;
            let s: u64 = step.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0);
            slurm_port(j, s)
        }
    };
    let (host_var, host) = if let Some(h) = var(get, "BRAID_ROOT_ADDR") {
        ("BRAID_ROOT_ADDR", h)
    } else if let Some(h) = var(get, "MASTER_ADDR") {
        ("MASTER_ADDR", h)
    } else {
        let (list_var, list) = [
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]
        .iter()
        .find_map(|n| var(get, n).map(|v| (*n, v)))
        .ok_or_else(|| {
            Error::Env(
                "cannot find the root's host: none of BRAID_ROOT_ADDR, MASTER_ADDR, \
                     SLURM_STEP_NODELIST, SLURM_JOB_NODELIST is set; set BRAID_ROOT_ADDR"
                    .into(),
            )
        })?;
        let first = first_host(&list)
            .map_err(|e| Error::Env(format!("{list_var}: {e}; set BRAID_ROOT_ADDR")))?;
        (list_var, first)
    };
    let addr = resolve(host_var, &host, port)?;
    let cluster = var(get, "SLURM_CLUSTER_NAME").unwrap_or_default();
    let secret = secret(
        get,
        "slurm",
        &[
            &cluster,
            job.as_deref().unwrap_or(""),
            step.as_deref().unwrap_or(""),
        ],
    )?;
    Ok(UniqueId { addr, secret })
}

/// `20000 + (job + 7919 * step) mod 10000`.
fn slurm_port(job: u64, step: u64) -> u16 {
    let off = job.wrapping_add(step.wrapping_mul(7919)) % 10_000;
    20_000 + off as u16
}

fn hashed_port(job: &str) -> u16 {
    let d: [u8; 32] = Sha256::digest(job.as_bytes()).into();
    let v = u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
    20_000 + (v % 10_000) as u16
}

fn openmpi_root(get: &impl Fn(&str) -> Option<String>, ranks: &Ranks) -> Result<UniqueId> {
    let job = [
        "OMPI_MCA_ess_base_jobid",
        "PMIX_NAMESPACE",
        "OMPI_MCA_orte_ess_jobid",
    ]
    .iter()
    .find_map(|n| var(get, n));
    let port = match port_var(get, "BRAID_PORT")? {
        Some(p) => p,
        None => hashed_port(job.as_deref().ok_or_else(|| {
            Error::Env(
                "cannot find Open MPI's job id (OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE) to \
                 derive a port; set BRAID_PORT"
                    .into(),
            )
        })?),
    };
    let (host_var, host) = if let Some(h) = var(get, "BRAID_ROOT_ADDR") {
        ("BRAID_ROOT_ADDR", h)
    } else if let Some(h) = var(get, "MASTER_ADDR") {
        ("MASTER_ADDR", h)
    } else if ranks.local_size == Some(ranks.nranks) {
        ("(single host)", "127.0.0.1".to_string())
    } else {
        return Err(Error::Env(
            "the Open MPI job spans several hosts (or OMPI_COMM_WORLD_LOCAL_SIZE is unset), so \
             braid cannot guess the root's address: set BRAID_ROOT_ADDR to the IP address of \
             the host of rank 0 (and BRAID_PORT if the derived port is taken)"
                .into(),
        ));
    };
    let addr = resolve(host_var, &host, port)?;
    let secret = secret(get, "openmpi", &[job.as_deref().unwrap_or(""), &host])?;
    Ok(UniqueId { addr, secret })
}

// ---------------------------------------------------------------------------
// Slurm host lists

/// Most host names a host list may expand to.
const MAX_HOSTS: usize = 1 << 20;
/// Most bytes of host names a host list may expand to, all names together.
const MAX_HOSTLIST_BYTES: usize = 64 << 20;
/// Longest host name (a DNS name has at most 253 characters).
const MAX_HOST_NAME: usize = 255;

/// Expands a Slurm host list: `node[01-04,07],gpu3` → `node01`, `node02`,
/// `node03`, `node04`, `node07`, `gpu3`. Zero padding is kept (the width of
/// the range's first number); several bracket groups in one name expand as a
/// product (`r[1-2]n[1-2]` → `r1n1`, `r1n2`, `r2n1`, `r2n2`).
pub fn parse_hostlist(list: &str) -> Result<Vec<String>> {
    let bad = |why: &str| Error::Env(format!("bad Slurm host list {list:?}: {why}"));
    let mut out = Vec::new();
    // Bytes of the names in `out`.
    let mut out_bytes = 0usize;
    for item in split_top(list).map_err(|w| bad(&w))? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    if rest.contains(']') {
                        return Err(bad("']' without '['"));
                    }
                    grow(&names, rest.len(), &[""], out_bytes).map_err(|w| bad(&w))?;
                    names.iter_mut().for_each(|n| n.push_str(rest));
                    rest = "";
                }
                Some(open) => {
                    let prefix = &rest[..open];
                    if prefix.contains(']') {
                        return Err(bad("']' without '['"));
                    }
                    let close = rest[open..]
                        .find(']')
                        .map(|c| open + c)
                        .ok_or_else(|| bad("'[' without ']'"))?;
                    let inner = &rest[open + 1..close];
                    let alts = expand_ranges(inner).map_err(|w| bad(&w))?;
                    if names
                        .len()
                        .saturating_mul(alts.len())
                        .saturating_add(out.len())
                        > MAX_HOSTS
                    {
                        return Err(bad("expands to too many hosts"));
                    }
                    grow(&names, prefix.len(), &alts, out_bytes).map_err(|w| bad(&w))?;
                    let mut next = Vec::with_capacity(names.len() * alts.len());
                    for n in &names {
                        for a in &alts {
                            next.push(format!("{n}{prefix}{a}"));
                        }
                    }
                    names = next;
                    rest = &rest[close + 1..];
                }
            }
        }
        out_bytes += names.iter().map(String::len).sum::<usize>();
        out.extend(names);
    }
    if out.is_empty() {
        return Err(bad("no hosts"));
    }
    Ok(out)
}

/// Checks that appending `mid` bytes and then each of `alts` to each of
/// `names` keeps every name within [`MAX_HOST_NAME`] and all names, with the
/// `done` bytes already expanded, within [`MAX_HOSTLIST_BYTES`], before
/// anything is allocated.
fn grow(
    names: &[String],
    mid: usize,
    alts: &[impl AsRef<str>],
    done: usize,
) -> std::result::Result<(), String> {
    let longest = names.iter().map(String::len).max().unwrap_or(0);
    let longest_alt = alts.iter().map(|a| a.as_ref().len()).max().unwrap_or(0);
    if longest + mid + longest_alt > MAX_HOST_NAME {
        return Err(format!("a host name is longer than {MAX_HOST_NAME} bytes"));
    }
    let name_bytes: usize = names.iter().map(String::len).sum();
    let alt_bytes: usize = alts.iter().map(|a| a.as_ref().len()).sum();
    // Sum over names n and alternatives a of |n| + mid + |a|.
    let total = names
        .len()
        .saturating_mul(mid)
        .saturating_add(name_bytes)
        .saturating_mul(alts.len())
        .saturating_add(names.len().saturating_mul(alt_bytes))
        .saturating_add(done);
    if total > MAX_HOSTLIST_BYTES {
        return Err(format!(
            "expands to more than {} MiB of host names",
            MAX_HOSTLIST_BYTES >> 20
        ));
    }
    Ok(())
}

/// The first host of a Slurm host list, without expanding the rest.
pub fn first_host(list: &str) -> Result<String> {
    let first = split_top(list)
        .map_err(|w| Error::Env(format!("bad Slurm host list {list:?}: {w}")))?
        .into_iter()
        .map(str::trim)
        .find(|s| !s.is_empty())
        .ok_or_else(|| Error::Env(format!("bad Slurm host list {list:?}: no hosts")))?;
    // Keep only the first alternative of every bracket group.
    let mut reduced = String::new();
    let mut rest = first;
    while let Some(open) = rest.find('[') {
        reduced.push_str(&rest[..=open]);
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or_else(|| Error::Env(format!("bad Slurm host list {list:?}: '[' without ']'")))?;
        let inner = &rest[open + 1..close];
        let alt = inner.split(',').next().unwrap_or("");
        let lo = alt.split('-').next().unwrap_or("");
        reduced.push_str(lo);
        reduced.push(']');
        rest = &rest[close + 1..];
    }
    reduced.push_str(rest);
    parse_hostlist(&reduced)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::Env(format!("bad Slurm host list {list:?}: no hosts")))
}

/// Splits at commas outside brackets.
fn split_top(s: &str) -> std::result::Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' => {
                depth += 1;
                if depth > 1 {
                    return Err("nested '['".into());
                }
            }
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err("']' without '['".into());
                }
            }
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("'[' without ']'".into());
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// `01-04,07` → `01 02 03 04 07`.
fn expand_ranges(inner: &str) -> std::result::Result<Vec<String>, String> {
    let mut out = Vec::new();
    // Upper bound of the bytes in `out`.
    let mut bytes = 0usize;
    for part in inner.split(',') {
        let part = part.trim();
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit() || b == b'-') {
            return Err(format!("{part:?} is not a number or a range like 01-04"));
        }
        let (lo_s, hi_s) = part.split_once('-').unwrap_or((part, part));
        let (Ok(lo), Ok(hi)) = (lo_s.parse::<u64>(), hi_s.parse::<u64>()) else {
            return Err(format!("{part:?} is not a number or a range like 01-04"));
        };
        if lo > hi {
            return Err(format!("range {part:?} goes backwards"));
        }
        if (hi - lo) as usize >= MAX_HOSTS || out.len() + ((hi - lo) as usize) >= MAX_HOSTS {
            return Err("expands to too many hosts".into());
        }
        let width = lo_s.len();
        // Every number is printed with at least `width` digits and at most
        // as many as `hi` has (or `width`).
        let digits = width.max(hi.to_string().len());
        if digits > MAX_HOST_NAME {
            return Err(format!(
                "{part:?}: a host name is longer than {MAX_HOST_NAME} bytes"
            ));
        }
        bytes = ((hi - lo) as usize + 1)
            .saturating_mul(digits)
            .saturating_add(bytes);
        if bytes > MAX_HOSTLIST_BYTES {
            return Err(format!(
                "expands to more than {} MiB of host names",
                MAX_HOSTLIST_BYTES >> 20
            ));
        }
        for v in lo..=hi {
            out.push(format!("{v:0width$}"));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn env_err(r: Result<LaunchInfo>) -> String {
        match r {
            Ok(l) => panic!("expected an error, got {l:?}"),
            Err(e) => {
                assert!(matches!(e, Error::Env(_)), "{e:?}");
                e.to_string()
            }
        }
    }

    const SECRET: &str = "00112233445566778899aabbccddeeff";

    #[test]
    fn timeout_values() {
        assert_eq!(
            timeout_from_vars(vars(&[])).unwrap(),
            Duration::from_secs(120)
        );
        assert_eq!(
            timeout_from_vars(vars(&[("BRAID_TIMEOUT", "")])).unwrap(),
            DEFAULT_TIMEOUT
        );
        assert_eq!(
            timeout_from_vars(vars(&[("BRAID_TIMEOUT", "2.5")])).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            timeout_from_vars(vars(&[("BRAID_TIMEOUT", " 30 ")])).unwrap(),
            Duration::from_secs(30)
        );
        for bad in [
            "0", "-1", "abc", "nan", "inf", "1e300", "5s", "1e-12", "0.0009", "1e20",
        ] {
            let e = timeout_from_vars(vars(&[("BRAID_TIMEOUT", bad)])).unwrap_err();
            assert!(matches!(e, Error::Env(_)), "{bad}");
            assert!(e.to_string().contains("positive number of seconds"), "{e}");
            assert!(e.to_string().contains("BRAID_TIMEOUT="), "{e}");
        }
        let e = timeout_from_vars(vars(&[("BRAID_TIMEOUT", "1e-12")])).unwrap_err();
        assert!(e.to_string().contains("below 1 ms"), "{e}");
        let e = timeout_from_vars(vars(&[("BRAID_TIMEOUT", "1e20")])).unwrap_err();
        assert!(e.to_string().contains("over a year"), "{e}");
        assert_eq!(
            timeout_from_vars(vars(&[("BRAID_TIMEOUT", "0.001")])).unwrap(),
            Duration::from_millis(1)
        );
        assert_eq!(
            timeout_from_vars(vars(&[("BRAID_TIMEOUT", "31536000")])).unwrap(),
            Duration::from_secs(31_536_000)
        );
    }

    #[test]
    fn braid_launch() {
        let id = format!("10.1.2.3:4000/{SECRET}");
        let l = LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &id),
            ("BRAID_RANK", "0"),
            ("BRAID_NRANKS", "4"),
            ("BRAID_LOCAL_SIZE", "4"),
            // torchrun variables lose against BRAID_*.
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
        ]))
        .unwrap();
        assert_eq!(l.source, "braid");
        assert_eq!(
            (l.rank, l.nranks, l.local_rank, l.local_size),
            (0, 4, 0, Some(4))
        );
        assert!(l.host_root);
        assert_eq!(l.id.to_string(), id);
        assert_eq!(l.bind_addr, l.id.addr);

        let l = LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &id),
            ("BRAID_RANK", "2"),
            ("BRAID_NRANKS", "4"),
            ("BRAID_LOCAL_RANK", "1"),
        ]))
        .unwrap();
        assert!(!l.host_root);
        assert_eq!((l.rank, l.local_rank, l.local_size), (2, 1, None));
        // Without BRAID_LOCAL_RANK the rank is the local rank (one host).
        let l = LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &id),
            ("BRAID_RANK", "3"),
            ("BRAID_NRANKS", "4"),
        ]))
        .unwrap();
        assert_eq!(l.local_rank, 3);
    }

    #[test]
    fn braid_launch_errors() {
        let id = format!("10.1.2.3:4000/{SECRET}");
        let e = env_err(LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &id),
            ("BRAID_RANK", "4"),
            ("BRAID_NRANKS", "4"),
        ])));
        assert!(
            e.contains("BRAID_RANK=4") && e.contains("BRAID_NRANKS=4"),
            "{e}"
        );
        let e = env_err(LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &id),
            ("BRAID_RANK", "1"),
        ])));
        assert!(e.contains("BRAID_NRANKS is not set"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &id),
            ("BRAID_RANK", "x"),
            ("BRAID_NRANKS", "2"),
        ])));
        assert!(e.contains("BRAID_RANK=\"x\""), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&[
            ("BRAID_RANK", "1"),
            ("BRAID_NRANKS", "2"),
        ])));
        assert!(e.contains("BRAID_UNIQUE_ID is not"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", "nonsense"),
            ("BRAID_RANK", "1"),
            ("BRAID_NRANKS", "2"),
        ])));
        assert!(
            e.contains("BRAID_UNIQUE_ID") && e.contains("<ip>:<port>/<32 hex digits>"),
            "{e}"
        );
        let e = env_err(LaunchInfo::from_vars(vars(&[("BRAID_UNIQUE_ID", &id)])));
        assert!(e.contains("BRAID_RANK"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&[])));
        assert!(e.contains("no launch environment"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &id),
            ("BRAID_RANK", "1"),
            ("BRAID_NRANKS", "4"),
            ("BRAID_LOCAL_RANK", "2"),
            ("BRAID_LOCAL_SIZE", "2"),
        ])));
        assert!(
            e.contains("BRAID_LOCAL_RANK=2") && e.contains("BRAID_LOCAL_SIZE=2"),
            "{e}"
        );
    }

    fn torch(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v = vec![
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ];
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn torchrun_launch() {
        let l = LaunchInfo::from_vars(vars(&torch(&[]))).unwrap();
        assert_eq!(l.source, "torchrun");
        assert_eq!(
            (l.rank, l.nranks, l.local_rank, l.local_size),
            (1, 4, 1, Some(2))
        );
        assert!(!l.host_root);
        assert_eq!(l.id.addr, "10.0.0.7:29501".parse().unwrap());
        assert_eq!(l.bind_addr, "0.0.0.0:29501".parse().unwrap());
        // Same job → same derived secret on every rank; another run id → another.
        let l2 =
            LaunchInfo::from_vars(vars(&torch(&[("RANK", "0"), ("LOCAL_RANK", "0")]))).unwrap();
        assert!(l2.host_root);
        assert_eq!(l.id, l2.id);
        let l3 = LaunchInfo::from_vars(vars(&torch(&[("TORCHELASTIC_RUN_ID", "other")]))).unwrap();
        assert_ne!(l.id.secret, l3.id.secret);
        // BRAID_PORT, BRAID_SECRET, BRAID_ROOT_ADDR override.
        let l = LaunchInfo::from_vars(vars(&torch(&[
            ("BRAID_PORT", "31000"),
            ("BRAID_SECRET", SECRET),
            ("BRAID_ROOT_ADDR", "::1"),
        ])))
        .unwrap();
        assert_eq!(l.id.to_string(), format!("[::1]:31000/{SECRET}"));
        assert_eq!(l.bind_addr, l.id.addr, "loopback binds exactly");
        // BRAID_UNIQUE_ID gives root and secret, torchrun the ranks.
        let id = format!("10.9.9.9:5000/{SECRET}");
        let v: Vec<(&str, &str)> = torch(&[])
            .into_iter()
            .chain([("BRAID_UNIQUE_ID", id.as_str())])
            .collect();
        let l = LaunchInfo::from_vars(vars(&v)).unwrap();
        assert_eq!(l.source, "torchrun");
        assert_eq!(l.id.to_string(), id);
        // Localhost names resolve.
        let l = LaunchInfo::from_vars(vars(&torch(&[("MASTER_ADDR", "localhost")]))).unwrap();
        assert!(l.id.addr.ip().is_loopback(), "{:?}", l.id.addr);
        assert_eq!(l.id.addr.port(), 29501);
    }

    #[test]
    fn torchrun_errors() {
        let without = |name: &str| -> Vec<(&'static str, &'static str)> {
            torch(&[]).into_iter().filter(|(k, _)| *k != name).collect()
        };
        let e = env_err(LaunchInfo::from_vars(vars(&without("LOCAL_RANK"))));
        assert!(e.contains("LOCAL_RANK is not set"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&without("MASTER_ADDR"))));
        assert!(e.contains("MASTER_ADDR is not set"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&torch(&[(
            "MASTER_PORT",
            "65535",
        )]))));
        assert!(e.contains("BRAID_PORT"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&torch(&[(
            "MASTER_PORT",
            "http",
        )]))));
        assert!(e.contains("MASTER_PORT=\"http\""), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&torch(&[("RANK", "4")]))));
        assert!(e.contains("RANK=4 is not below WORLD_SIZE=4"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&torch(&[(
            "BRAID_SECRET",
            "abc",
        )]))));
        assert!(e.contains("BRAID_SECRET must be 32 hex digits"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&torch(&[("BRAID_PORT", "0")]))));
        assert!(e.contains("BRAID_PORT"), "{e}");
    }

    fn slurm(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v = vec![
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2),4"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NODELIST", "127.0.0.[1-3]"),
            ("SLURM_JOB_NODELIST", "ignored[1-9]"),
        ];
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn slurm_launch() {
        let l = LaunchInfo::from_vars(vars(&slurm(&[]))).unwrap();
        assert_eq!(l.source, "slurm");
        assert_eq!(
            (l.rank, l.nranks, l.local_rank, l.local_size),
            (5, 8, 1, Some(4))
        );
        assert_eq!(l.id.addr, "127.0.0.1:23456".parse().unwrap());
        let step1 = LaunchInfo::from_vars(vars(&slurm(&[("SLURM_STEP_ID", "1")]))).unwrap();
        assert_eq!(
            step1.id.addr.port(),
            20000 + ((123456 + 7919) % 10000) as u16
        );
        assert_ne!(step1.id.secret, l.id.secret);
        let l = LaunchInfo::from_vars(vars(&slurm(&[
            ("BRAID_PORT", "20001"),
            ("MASTER_ADDR", "10.0.0.1"),
        ])))
        .unwrap();
        assert_eq!(l.id.addr, "10.0.0.1:20001".parse().unwrap());
        assert_eq!(l.bind_addr, "0.0.0.0:20001".parse().unwrap());
        // Node 0 of "2(x2),4" has 2 tasks; no NODEID → unknown.
        let l = LaunchInfo::from_vars(vars(&slurm(&[
            ("SLURM_NODEID", "0"),
            ("SLURM_LOCALID", "0"),
        ])))
        .unwrap();
        assert_eq!(l.local_size, Some(2));
        let v: Vec<_> = slurm(&[])
            .into_iter()
            .filter(|(k, _)| *k != "SLURM_NODEID")
            .collect();
        assert_eq!(LaunchInfo::from_vars(vars(&v)).unwrap().local_size, None);
        // Open MPI inside a Slurm allocation: the MPI ranks win.
        let l = LaunchInfo::from_vars(vars(&slurm(&[
            ("OMPI_COMM_WORLD_RANK", "6"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_MCA_ess_base_jobid", "77"),
            ("BRAID_ROOT_ADDR", "10.0.0.2"),
        ])))
        .unwrap();
        assert_eq!((l.source, l.rank), ("openmpi", 6));
    }

    #[test]
    fn slurm_errors() {
        let e = env_err(LaunchInfo::from_vars(vars(&slurm(&[(
            "SLURM_PROCID",
            "8",
        )]))));
        assert!(
            e.contains("SLURM_PROCID=8 is not below SLURM_NTASKS=8"),
            "{e}"
        );
        let v: Vec<_> = slurm(&[])
            .into_iter()
            .filter(|(k, _)| !k.ends_with("NODELIST"))
            .collect();
        let e = env_err(LaunchInfo::from_vars(vars(&v)));
        assert!(e.contains("BRAID_ROOT_ADDR"), "{e}");
        let v: Vec<_> = slurm(&[])
            .into_iter()
            .filter(|(k, _)| *k != "SLURM_JOB_ID")
            .collect();
        let e = env_err(LaunchInfo::from_vars(vars(&v)));
        assert!(
            e.contains("SLURM_JOB_ID") && e.contains("BRAID_PORT"),
            "{e}"
        );
        let e = env_err(LaunchInfo::from_vars(vars(&slurm(&[(
            "SLURM_STEP_NODELIST",
            "node[01-",
        )]))));
        assert!(e.contains("SLURM_STEP_NODELIST"), "{e}");
    }

    fn ompi(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v = vec![
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_MCA_ess_base_jobid", "12345"),
        ];
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn openmpi_launch() {
        let l = LaunchInfo::from_vars(vars(&ompi(&[]))).unwrap();
        assert_eq!(l.source, "openmpi");
        assert!(l.host_root);
        assert_eq!(l.id.addr.ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!((20000..30000).contains(&l.id.addr.port()));
        let other =
            LaunchInfo::from_vars(vars(&ompi(&[("OMPI_MCA_ess_base_jobid", "999")]))).unwrap();
        assert_ne!(other.id.secret, l.id.secret);
        let l = LaunchInfo::from_vars(vars(&ompi(&[
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("BRAID_ROOT_ADDR", "10.0.0.3"),
            ("BRAID_PORT", "25000"),
        ])))
        .unwrap();
        assert_eq!(l.id.addr, "10.0.0.3:25000".parse().unwrap());
        let v: Vec<_> = ompi(&[("PMIX_NAMESPACE", "prterun-host-1234@1")])
            .into_iter()
            .filter(|(k, _)| *k != "OMPI_MCA_ess_base_jobid")
            .collect();
        assert!(LaunchInfo::from_vars(vars(&v)).is_ok());
    }

    #[test]
    fn openmpi_errors() {
        let e = env_err(LaunchInfo::from_vars(vars(&ompi(&[(
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "2",
        )]))));
        assert!(e.contains("set BRAID_ROOT_ADDR"), "{e}");
        let v: Vec<_> = ompi(&[])
            .into_iter()
            .filter(|(k, _)| *k != "OMPI_MCA_ess_base_jobid")
            .collect();
        let e = env_err(LaunchInfo::from_vars(vars(&v)));
        assert!(e.contains("BRAID_PORT"), "{e}");
        let e = env_err(LaunchInfo::from_vars(vars(&ompi(&[(
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "4",
        )]))));
        assert!(e.contains("OMPI_COMM_WORLD_LOCAL_RANK=4"), "{e}");
    }

    #[test]
    fn hostlists() {
        let h = |s: &str| parse_hostlist(s).unwrap();
        assert_eq!(
            h("node[01-04,07],gpu3"),
            ["node01", "node02", "node03", "node04", "node07", "gpu3"]
        );
        assert_eq!(h("a1"), ["a1"]);
        assert_eq!(h("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(h("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(h("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(h("x[1]-ib,y"), ["x1-ib", "y"]);
        assert_eq!(h("host-a,host-b"), ["host-a", "host-b"]);
        for bad in [
            "",
            "n[1-",
            "n]1",
            "n[a-b]",
            "n[3-1]",
            "n[[1]]",
            "n[0-99999999]",
        ] {
            assert!(matches!(parse_hostlist(bad), Err(Error::Env(_))), "{bad}");
        }
        assert_eq!(first_host("node[01-04,07],gpu3").unwrap(), "node01");
        assert_eq!(first_host("gpu[0-999999999999]").unwrap(), "gpu0");
        assert_eq!(first_host(",z[5,1]").unwrap(), "z5");
    }

    /// Found reading the decoder, confirmed with the `slurm_hostlist` fuzz target: a 3 KB host list (a long
    /// name times a million numbers) expanded to 3 GB of names.
    #[test]
    fn hostlist_expansion_is_bounded_in_bytes() {
        let long_name = format!("{}[0-999999]", "a".repeat(3000));
        let e = parse_hostlist(&long_name).unwrap_err();
        assert!(e.to_string().contains("longer than 255 bytes"), "{e}");
        // The same through the width of the numbers.
        let wide = format!("n[{}-999999]", "0".repeat(3000));
        let e = parse_hostlist(&wide).unwrap_err();
        assert!(e.to_string().contains("longer than 255 bytes"), "{e}");
        // Names of legal length, but too many bytes of them in all.
        let many = format!("{}[0-999999]", "b".repeat(200));
        let e = parse_hostlist(&many).unwrap_err();
        assert!(e.to_string().contains("MiB of host names"), "{e}");
        let product = format!("{}[0-999]x[0-999]", "c".repeat(100));
        let e = parse_hostlist(&product).unwrap_err();
        assert!(e.to_string().contains("MiB of host names"), "{e}");
        // Large lists of ordinary names still expand.
        let v = parse_hostlist("node[0-999999]").unwrap();
        assert_eq!((v.len(), v[999_999].as_str()), (1_000_000, "node999999"));
        let name = "d".repeat(250);
        assert_eq!(
            parse_hostlist(&format!("{name}[10-11]")).unwrap()[1],
            format!("{name}11")
        );
        // first_host expands only the first host.
        assert_eq!(first_host(&many).unwrap(), format!("{}0", "b".repeat(200)));
    }

    #[test]
    fn hosting_the_root_from_launch_info() {
        let l = LaunchInfo::from_vars(vars(&[
            ("BRAID_UNIQUE_ID", &format!("127.0.0.1:0/{SECRET}")),
            ("BRAID_RANK", "0"),
            ("BRAID_NRANKS", "1"),
        ]))
        .unwrap();
        let server = l.host_root_server(Duration::from_secs(5)).unwrap().unwrap();
        let mut id = l.id;
        id.addr = server.addr();
        let (_b, all) =
            crate::bootstrap::Bootstrap::connect(&id, 0, 1, b"p", Duration::from_secs(5)).unwrap();
        assert_eq!(all, vec![b"p".to_vec()]);
        let mut l1 = l.clone();
        l1.host_root = false;
        assert!(l1
            .host_root_server(Duration::from_secs(5))
            .unwrap()
            .is_none());
    }
}

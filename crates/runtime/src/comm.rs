//! The communicator: creation, connection set-up, and the operations.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_core::plan::{self, Collective, P2p, P2pKind, PlanParams, Program};
use braid_core::topo::{CpuSet, TransportPolicy};
use braid_core::transport::{PeerDesc, PendingRecv, PendingSend};
use braid_core::types::Element;
use braid_core::{CoreError, DataType, RedOp};
use tracing::{debug, info, info_span};

use crate::bootstrap::{
    create_unique_id, create_unique_id_with_timeout, Bootstrap, RootServer, UniqueId,
};
use crate::engine::host::{self, Exec};
use crate::engine::{Channels, RawBuf, WaitPolicy};
use crate::env::{timeout_from_env, LaunchInfo};
use crate::error::{Error, Result};
use crate::fingerprint::Headers;
use crate::oplock::{OpGuard, OpLock};
use crate::progress::{self, Progress, Snapshot};
use crate::select::{self, TransportTable};
use crate::slot_stores::{self, SlotStores};
use crate::topology;

/// Options for creating a communicator.
#[derive(Clone, Debug)]
pub struct Config {
    /// Bound on every wait without progress (bootstrap, connection set-up,
    /// operations). Default: `BRAID_TIMEOUT` or 120 s.
    pub timeout: Duration,
    /// Abort flag: setting it (from any thread) makes communicator creation
    /// give up within about 50 ms while it waits in the rendezvous or a
    /// bootstrap round (link set-up waits stay bounded by `timeout`), and,
    /// once created, works as [`Communicator::abort`]. Communicators created
    /// with one flag share it: setting it aborts all of them (the threads of
    /// [`Communicator::init_threads`], say). `None`: a flag of its own.
    pub abort: Option<Arc<AtomicBool>>,
}

impl Config {
    /// Defaults, overridden by the environment (`BRAID_TIMEOUT`).
    pub fn from_env() -> Result<Config> {
        Ok(Config {
            timeout: timeout_from_env()?,
            abort: None,
        })
    }

    /// This configuration with an abort flag (see [`Config::abort`]).
    pub fn with_abort(mut self, flag: Arc<AtomicBool>) -> Config {
        self.abort = Some(flag);
        self
    }
}

/// A group of ranks that run collectives together. Cheap to clone: clones
/// share the same connections, and operations issued through any clone are
/// serialised in the order they take the communicator's lock.
///
/// Every rank must issue the same operations in the same order (as with NCCL
/// and MPI); a mismatch is reported as an error when the ranks notice it.
#[derive(Clone, Debug)]
pub struct Communicator {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    rank: u32,
    nranks: u32,
    ring: Vec<u32>,
    piece: usize,
    small_allreduce: usize,
    move_piece: usize,
    /// Every link passes references: single-copy AllGather and Broadcast
    /// on more than two ranks read each block from its owner
    /// ([`PlanParams::direct_moves`]). `BRAID_DIRECT_MOVES=0` keeps the ring.
    direct_moves: bool,
    /// Ranks on this host share CPUs ([`oversubscribed`]): waits yield.
    oversubscribed: bool,
    direct_min: usize,
    /// Collectives whose largest buffer is smaller than this move their
    /// data through the slots (two copies that stay in cache) instead of
    /// single-copy.
    single_copy_min: usize,
    /// Collectives whose buffers (this rank's, all together) take at least
    /// this many bytes copy with streaming stores (`braid_core::copy`).
    stream_min: usize,
    check_headers: bool,
    policy: WaitPolicy,
    abort: Arc<AtomicBool>,
    state: OpLock<State>,
    bootstrap: Mutex<Bootstrap>,
    transports: Vec<&'static str>,
    topo_plan: braid_core::topo::Plan,
    /// The fused topology of every rank (without GPUs) and the transport
    /// policy it was planned under, for device communicators.
    topo_cluster: braid_core::topo::Cluster,
    transport_policy: TransportPolicy,
    progress: Arc<Progress>,
    /// Communicators split from this one ([`Communicator::abort_with_splits`]).
    children: Mutex<Vec<std::sync::Weak<Shared>>>,
    _root: Option<RootServer>,
}

impl Shared {
    fn abort(&self, why: &str) {
        self.abort.store(true, Ordering::SeqCst);
        if let Some(Ok(mut st)) = self.state.try_lock() {
            st.broken.get_or_insert_with(|| why.into());
            st.chans.abort_all(why);
        }
    }
}

#[derive(Debug)]
struct State {
    chans: Channels,
    seq: u64,
    /// Collectives issued so far (the header sequence number).
    coll_seq: u64,
    /// Point-to-point transfers to / from each peer so far.
    p2p_send_seq: Vec<u64>,
    p2p_recv_seq: Vec<u64>,
    /// Reused per operation (no allocation on the hot path).
    headers: Headers,
    header_flags: Vec<u8>,
    /// Per peer: ordinary or streaming stores into its slots.
    slot_stores: SlotStores,
    broken: Option<String>,
    cache: HashMap<(Collective, DataType), Planned>,
    /// The last collective run and its plan: a loop of the same call skips
    /// hashing.
    last: Option<(Collective, DataType, Planned)>,
}

/// A collective's plan and whether it moves data single-copy.
#[derive(Clone, Debug)]
struct Planned {
    prog: Arc<Program>,
    single_copy: bool,
}

/// AllGathers over slots of at most this many bytes (the whole result) read
/// every block from its owner instead of relaying it along the ring (see
/// `PlanParams::direct_moves`): 4 ranks on the 2-core VM, side by side,
/// 64 bytes 2.4-2.5 against 3.1-5.0 µs, 4 KiB 2.6-4.8 against 3.6-7.5 µs;
/// at 256 KiB no difference beyond the noise.
const FLAT_ALLGATHER_MAX_BYTES: usize = 64 * 1024;

/// How long a waiting rank spins before it yields the CPU. Spinning is what
/// makes small operations fast (a flag in shared memory is seen in ~0.1 µs,
/// a woken thread in 25–30 µs), but when ranks on this host share CPUs (more
/// ranks than cores, see [`oversubscribed`]) a spinning rank steals the core
/// from the rank it waits for, so it yields at once. `BRAID_SPIN` overrides
/// (iterations).
fn spin_budget(oversubscribed: bool) -> u32 {
    if let Some(v) = std::env::var("BRAID_SPIN")
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        return v;
    }
    if oversubscribed {
        0
    } else {
        WaitPolicy::default().spin
    }
}

/// Whether this rank shares CPUs with more ranks than those CPUs can run at
/// once. `sets` holds the CPUs each rank on this host may run on (`None`:
/// unknown, taken as all `online` CPUs); `me` indexes ours. The ranks whose
/// sets overlap ours, directly or through other such ranks, are counted
/// against the CPUs of their sets together: four unbound ranks on two cores
/// are oversubscribed, two ranks bound one per core (mpirun's default for
/// two ranks, `srun --cpu-bind=cores`, `taskset`) are not, though each sees
/// a single CPU. (Counting the CPUs a rank sees took bound ranks for
/// oversubscribed and made them yield at every wait: an 8-byte AllReduce on
/// 2 ranks bound to one core each took 0.42-0.58 µs instead of 0.17-0.27.)
fn oversubscribed(me: usize, sets: &[Option<CpuSet>], online: u32) -> bool {
    let all: Vec<u32> = (0..online.max(1)).collect();
    let cpus = |i: usize| -> &[u32] {
        match &sets[i] {
            Some(s) if !s.0.is_empty() => &s.0,
            _ => &all,
        }
    };
    let mut member = vec![false; sets.len()];
    let Some(m) = member.get_mut(me) else {
        return false;
    };
    *m = true;
    let mut union: std::collections::BTreeSet<u32> = cpus(me).iter().copied().collect();
    let mut grew = true;
    while grew {
        grew = false;
        for (j, m) in member.iter_mut().enumerate() {
            if !*m && cpus(j).iter().any(|c| union.contains(c)) {
                *m = true;
                union.extend(cpus(j).iter().copied());
                grew = true;
            }
        }
    }
    member.iter().filter(|&&m| m).count() > union.len()
}

/// CPUs online on this host (`/sys/devices/system/cpu/online`), whatever
/// this process may run on.
fn online_cpus() -> u32 {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|l| CpuSet::from_list(&l))
        .map(|s| s.0.len() as u32)
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32))
}

/// Where the kernel says whether anonymous memory gets transparent huge
/// pages (`always`, `madvise` or `never`, the chosen one in brackets).
const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// The smallest largest-buffer size at which collectives read peers'
/// buffers with `process_vm_readv` instead of passing data through slots.
///
/// What decides it is the page size of the callers' buffers, which braid
/// cannot see: `process_vm_readv` pins every page it reads, which on 4 KiB
/// pages ran at 14 GB/s on these VMs against memcpy's 52 GB/s, but at
/// 39-48 GB/s on 2 MiB pages (`scripts/cma-pages.c`, 1 MiB reads).
/// Side by side on 2 ranks (Broadcast, AllGather, AllToAll): on 4 KiB-page
/// buffers the slot path was about 2x faster up to 4 MiB and single-copy
/// won from 16 MiB; on 2 MiB-aligned huge-page buffers single-copy was
/// faster from 512 KiB (1.3-2x at 1-4 MiB) and even at 128-256 KiB. So:
/// 512 KiB where every anonymous mapping gets huge pages (THP `always`),
/// else 8 MiB. Callers whose buffers are on huge pages under THP `madvise`
/// (e.g. glibc's `hugetlb` tunable, or `madvise(MADV_HUGEPAGE)`) should set
/// `BRAID_SINGLE_COPY_MIN_BYTES=524288`.
fn single_copy_default(thp_file: &str) -> usize {
    let always = std::fs::read_to_string(thp_file)
        .map(|s| s.contains("[always]"))
        .unwrap_or(false);
    if always {
        512 << 10
    } else {
        8 << 20
    }
}

/// Where Linux describes CPU 0's caches (`index*/level`, `index*/size`).
const CPU0_CACHES: &str = "/sys/devices/system/cpu/cpu0/cache";

/// The size of the largest cache CPU 0 has (its last level), from `dir`
/// laid out as [`CPU0_CACHES`]; `None` if it says nothing usable.
fn last_level_cache(dir: &std::path::Path) -> Option<usize> {
    let mut best: Option<(u32, usize)> = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let Ok(level) = level.trim().parse::<u32>() else {
            continue;
        };
        let size = size.trim();
        let (digits, unit) = match size.strip_suffix('K') {
            Some(d) => (d, 1 << 10),
            None => match size.strip_suffix('M') {
                Some(d) => (d, 1 << 20),
                None => (size, 1),
            },
        };
        let Ok(n) = digits.parse::<usize>() else {
            continue;
        };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, n.saturating_mul(unit)));
        }
    }
    best.map(|(_, b)| b)
}

/// The default of `BRAID_STREAM_MIN_BYTES` for `local` ranks on this host:
/// collectives whose buffers, times the ranks sharing the last-level cache,
/// exceed that cache copy with streaming stores (their destinations would
/// not stay cached anyway; `braid_core::copy`). 32 MiB when sysfs says
/// nothing.
fn stream_default(caches: &std::path::Path, local: usize) -> usize {
    last_level_cache(caches).unwrap_or(32 << 20) / local.max(1)
}

/// A byte count from the environment, or `default` when unset.
fn env_bytes(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|_| {
            Error::Env(format!(
                "{name}={v} is not a byte count; use a plain number such as 65536"
            ))
        }),
        _ => Ok(default),
    }
}

/// AllReduce up to this size uses recursive doubling (latency-bound sizes);
/// `BRAID_ALLREDUCE_RD_BYTES` overrides, 0 forces the ring.
fn small_allreduce_bytes() -> Result<usize> {
    env_bytes("BRAID_ALLREDUCE_RD_BYTES", 16 * 1024)
}

/// Default slot size when a communicator has no links (one rank).
const DEFAULT_PIECE: usize = 512 * 1024;

impl Communicator {
    /// Join the communicator named by `id` as `rank` of `nranks`. Some process
    /// must host the id's root ([`Communicator::unique_id`] does).
    pub fn init(id: &UniqueId, rank: u32, nranks: u32, config: &Config) -> Result<Communicator> {
        Self::init_inner(id, rank, nranks, config, None)
    }

    /// Create a unique id whose rendezvous root runs in this process, on
    /// `addr` (port 0 picks a free port). Hand the id's text form to the other
    /// ranks; keep the returned server alive until they have all joined, or
    /// pass it to [`Communicator::init_hosting`].
    pub fn unique_id(addr: SocketAddr) -> Result<(UniqueId, RootServer)> {
        create_unique_id(addr)
    }

    /// Like [`Communicator::init`], and keep `root` alive as long as this
    /// communicator.
    pub fn init_hosting(
        id: &UniqueId,
        root: RootServer,
        rank: u32,
        nranks: u32,
        config: &Config,
    ) -> Result<Communicator> {
        Self::init_inner(id, rank, nranks, config, Some(root))
    }

    /// Create the communicator from the launcher's environment: `braid-run`
    /// (`BRAID_*`), torchrun, Slurm or Open MPI.
    pub fn from_env() -> Result<Communicator> {
        crate::init_logging();
        let info = LaunchInfo::from_env()?;
        let config = Config::from_env()?;
        let root = info.host_root_server(config.timeout)?;
        info!(
            rank = info.rank,
            nranks = info.nranks,
            launcher = info.source,
            "braid: joining communicator"
        );
        Self::init_inner(&info.id, info.rank, info.nranks, &config, root)
    }

    /// Create all `nranks` ranks as threads of this process (tests, and
    /// programs that drive several devices from one process).
    pub fn init_threads(nranks: u32, config: &Config) -> Result<Vec<Communicator>> {
        if nranks == 0 {
            return Err(Error::InvalidArgument("nranks must be at least 1".into()));
        }
        let (id, root) = create_unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))?;
        let root = Arc::new(Mutex::new(Some(root)));
        let handles: Vec<_> = (0..nranks)
            .map(|r| {
                let (id, config, root) = (id, config.clone(), root.clone());
                std::thread::Builder::new()
                    .name(format!("braid-init-{r}"))
                    .spawn(move || {
                        let root = if r == 0 {
                            root.lock().ok().and_then(|mut g| g.take())
                        } else {
                            None
                        };
                        Self::init_inner(&id, r, nranks, &config, root)
                    })
            })
            .collect();
        let mut out = Vec::new();
        let mut first_err = None;
        for h in handles {
            match h {
                Ok(h) => match h.join() {
                    Ok(Ok(c)) => out.push(c),
                    Ok(Err(e)) => first_err = first_err.or(Some(e)),
                    Err(_) => {
                        first_err =
                            first_err.or(Some(Error::Unusable("an init thread panicked".into())))
                    }
                },
                Err(e) => {
                    first_err = first_err.or(Some(Error::BootstrapIo {
                        what: "spawning an init thread".into(),
                        source: e,
                    }))
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn init_inner(
        id: &UniqueId,
        rank: u32,
        nranks: u32,
        config: &Config,
        root: Option<RootServer>,
    ) -> Result<Communicator> {
        crate::init_logging();
        progress::install_dump_signal().map_err(Error::Env)?;
        if nranks == 0 || rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} out of range for {nranks} ranks: ranks are 0..nranks-1"
            )));
        }
        let timeout = config.timeout;
        // The table first: network transports probe their fabric, which
        // every rank needs to know about the others.
        let policy = TransportPolicy::from_env(&braid_core::config::process_env)?;
        let table = TransportTable::from_env(id.addr, &policy)?;
        let me = PeerDesc {
            rank,
            host_id: select::host_id(),
            pid: std::process::id(),
            fabrics: table.fabrics(),
        };
        let abort = config
            .abort
            .clone()
            .unwrap_or_else(|| Arc::new(AtomicBool::new(false)));
        let (boot, infos) = Bootstrap::connect_abortable(
            id,
            rank,
            nranks,
            &encode_peer(&me),
            timeout,
            Some(abort.clone()),
        )?;
        let peers: Vec<PeerDesc> = infos
            .iter()
            .enumerate()
            .map(|(r, b)| decode_peer(b, r as u32))
            .collect::<Result<_>>()?;

        // The CPUs this rank may run on: its NUMA node in the topology round,
        // the oversubscription test after link set-up.
        let allowed = braid_core::topo::bind::allowed_cpus();
        let placement = topology::place(&boot, &me, &peers, &table, &policy, allowed.as_ref())?;
        let (choice, ring, topo_plan) = (placement.choice, placement.ring, placement.plan);
        let topo_cluster = placement.cluster;

        // Phase 1: allocate both ends of every link, collect connect-info.
        let p = nranks as usize;
        let mut links = LinkSetup::new(rank, p);
        for q in 0..p {
            if let Some(t) = choice[q] {
                links.add(q, table.get(t), &me, &peers[q])?;
            }
        }
        let mut chans = links.connect(|b| boot.allgather(b), timeout)?;
        boot.barrier()?;
        // After the barrier every receiver has run its single-copy probe.
        // Plans must cut pieces the same way on every rank, so agree on the
        // smallest slot of any link anywhere, and on whether every link
        // passes references (then pieces of pure data movement can be much
        // larger than a slot: fewer system calls; pieces below `direct_min`
        // still fit a slot).
        let direct_min = env_bytes("BRAID_DIRECT_MIN_BYTES", 64 * 1024)?;
        let slot_mode = slot_stores::Mode::parse(std::env::var(slot_stores::ENV).ok().as_deref())
            .map_err(Error::Env)?;
        let local_piece = chans.min_slot_bytes().unwrap_or(usize::MAX) as u64;
        let local_direct = chans.send.iter_mut().flatten().all(|c| c.can_send_direct());
        // With them, the CPUs this rank may run on (a hex mask; empty when
        // unknown), for the oversubscription test.
        let mut mine = local_piece.to_le_bytes().to_vec();
        mine.push(local_direct as u8);
        mine.extend(
            allowed
                .as_ref()
                .map(|s| s.to_mask())
                .unwrap_or_default()
                .bytes(),
        );
        let all = boot.allgather(&mine)?;
        let mut piece = u64::MAX;
        let mut all_direct = true;
        let mut local_cpus: Vec<Option<CpuSet>> = Vec::new();
        let mut me_local = 0;
        for (r, b) in all.iter().enumerate() {
            let (Some(p), Some(&d), Some(mask)) = (b.get(0..8), b.get(8), b.get(9..)) else {
                return Err(Error::Bootstrap(format!(
                    "rank {r} sent a malformed link summary"
                )));
            };
            let mut a = [0u8; 8];
            a.copy_from_slice(p);
            piece = piece.min(u64::from_le_bytes(a));
            all_direct &= d != 0;
            if peers.get(r).is_some_and(|p| p.host_id == me.host_id) {
                if r == rank as usize {
                    me_local = local_cpus.len();
                }
                local_cpus.push(std::str::from_utf8(mask).ok().and_then(CpuSet::from_mask));
            }
        }
        let oversub = oversubscribed(me_local, &local_cpus, online_cpus());
        info!(
            rank,
            local_ranks = local_cpus.len(),
            oversubscribed = oversub,
            "braid: waits {}",
            if oversub {
                "yield at once (ranks here share CPUs)"
            } else {
                "spin before yielding"
            }
        );
        let piece = if piece == u64::MAX {
            DEFAULT_PIECE
        } else {
            piece as usize
        };
        let move_piece = if all_direct && direct_min <= piece {
            piece.max(env_bytes("BRAID_DIRECT_PIECE_BYTES", 2 << 20)?)
        } else {
            piece
        };
        let transports = choice
            .iter()
            .map(|c| c.map(|i| table.get(i).name()).unwrap_or("self"))
            .collect();
        info!(rank, nranks, piece, "braid: communicator ready");
        Ok(Communicator {
            shared: Arc::new(Shared {
                rank,
                nranks,
                ring,
                piece,
                small_allreduce: small_allreduce_bytes()?,
                // process_vm_readv runs at about half the speed of memcpy on
                // the VMs measured (page pinning), but it replaces two copies
                // and leaves the sender free: side by side it was faster for
                // Broadcast, AllGather and AllToAll from 1 to 64 MiB.
                direct_min,
                // See `single_copy_default`.
                single_copy_min: env_bytes(
                    "BRAID_SINGLE_COPY_MIN_BYTES",
                    single_copy_default(THP_ENABLED),
                )?,
                stream_min: env_bytes(
                    "BRAID_STREAM_MIN_BYTES",
                    stream_default(
                        std::path::Path::new(CPU0_CACHES),
                        peers.iter().filter(|p| p.host_id == me.host_id).count(),
                    ),
                )?,
                move_piece,
                direct_moves: all_direct
                    && direct_min <= piece
                    && std::env::var("BRAID_DIRECT_MOVES").map_or(true, |v| v.trim() != "0"),
                oversubscribed: oversub,
                // Mismatch detection (one 32-byte header per link per
                // operation); BRAID_CHECK_MISMATCH=0 turns it off.
                check_headers: std::env::var("BRAID_CHECK_MISMATCH")
                    .map(|v| v.trim() != "0")
                    .unwrap_or(true),
                policy: WaitPolicy {
                    timeout,
                    spin: spin_budget(oversub),
                    stall_warn: progress::stall_warn(timeout),
                },
                abort,
                state: OpLock::new(State {
                    chans,
                    seq: 0,
                    coll_seq: 0,
                    p2p_send_seq: vec![0; p],
                    p2p_recv_seq: vec![0; p],
                    headers: Headers::default(),
                    header_flags: Vec::new(),
                    slot_stores: SlotStores::new(p, slot_mode),
                    broken: None,
                    cache: HashMap::new(),
                    last: None,
                }),
                bootstrap: Mutex::new(boot),
                transports,
                topo_plan,
                topo_cluster,
                transport_policy: policy,
                children: Mutex::new(Vec::new()),
                progress: Progress::register(rank, nranks, format!("comm@{}", id.addr)),
                _root: root,
            }),
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.shared.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> u32 {
        self.shared.nranks
    }

    /// The ring order used by ring algorithms.
    pub fn ring(&self) -> &[u32] {
        &self.shared.ring
    }

    /// The transport used to reach each rank (`"self"` for this rank).
    pub fn transports(&self) -> &[&'static str] {
        &self.shared.transports
    }

    /// Whether this rank shares its CPUs with more ranks of this host than
    /// those CPUs can run at once (decided at creation from every local
    /// rank's CPU affinity). Then a waiting rank yields its CPU at once
    /// instead of spinning first (`BRAID_SPIN` overrides either way).
    pub fn oversubscribed(&self) -> bool {
        self.shared.oversubscribed
    }

    /// What this communicator is doing now: the running operation and the
    /// peer it waits for, if any (see [`crate::dump_pending`] for every
    /// communicator of the process).
    pub fn pending(&self) -> Snapshot {
        self.shared.progress.snapshot()
    }

    /// The topology plan this communicator was built from: the transport of
    /// every rank pair and the ring of every channel (the engine runs
    /// channel 0's ring).
    pub fn topology_plan(&self) -> &braid_core::topo::Plan {
        &self.shared.topo_plan
    }

    /// The fused topology (ranks placed without GPUs) and the environment's
    /// transport policy, for a device communicator to plan its GPU links.
    pub(crate) fn topology_inputs(&self) -> (&braid_core::topo::Cluster, &TransportPolicy) {
        (&self.shared.topo_cluster, &self.shared.transport_policy)
    }

    /// Make every pending and later operation fail promptly. Callable from any
    /// thread; the peers see the abort as an error naming this rank.
    /// Communicators split from this one are not affected (see
    /// [`Communicator::abort_with_splits`]).
    pub fn abort(&self) {
        self.shared.abort("aborted by the caller");
    }

    /// [`Communicator::abort`] this communicator and every communicator split
    /// from it (recursively), e.g. when a job tears down after a failure.
    pub fn abort_with_splits(&self) {
        let mut todo = vec![self.shared.clone()];
        while let Some(sh) = todo.pop() {
            sh.abort("aborted by the caller (with its splits)");
            if let Ok(kids) = sh.children.lock() {
                todo.extend(kids.iter().filter_map(std::sync::Weak::upgrade));
            }
        }
    }

    /// Split this communicator like `ncclCommSplit` / `MPI_Comm_split`: every
    /// rank calls it (a collective over the parent's bootstrap); ranks with
    /// the same `color` form a new communicator, ordered by `key` and then
    /// by their rank here; `color: None` takes no part and gets `Ok(None)`.
    ///
    /// The new communicator has its own rendezvous (hosted by its new rank
    /// 0), links, transports and ring, and lives independently of the parent
    /// (dropping or aborting the parent leaves it usable, unless
    /// [`Communicator::abort_with_splits`] is used).
    ///
    /// The rule after a failure: a communicator that was aborted or broken by
    /// a failed operation cannot be split (an error, at once): its ranks may
    /// be dead or stuck anywhere in an operation, so no collective over it can
    /// be trusted. Survivors create a fresh communicator from a new unique
    /// id instead.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>> {
        let sh = &*self.shared;
        if sh.abort.load(Ordering::SeqCst) {
            return Err(Error::Unusable(
                "cannot split an aborted communicator; create a new one from a fresh unique id"
                    .into(),
            ));
        }
        if let Some(why) = self.lock()?.broken.clone() {
            return Err(Error::Unusable(format!(
                "cannot split a communicator broken by an earlier error ({why}); create a new one from a fresh unique id"
            )));
        }
        let boot = sh
            .bootstrap
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked while holding the bootstrap".into()))?;
        let mut mine = vec![color.is_some() as u8];
        mine.extend_from_slice(&color.unwrap_or(0).to_le_bytes());
        mine.extend_from_slice(&key.to_le_bytes());
        let all = boot.allgather(&mine)?;
        let mut wanted = Vec::with_capacity(all.len());
        for (r, b) in all.iter().enumerate() {
            let (Some(&has), Some(c), Some(k)) = (b.first(), b.get(1..5), b.get(5..9)) else {
                return Err(Error::Bootstrap(format!(
                    "rank {r} sent a malformed split request"
                )));
            };
            let c = u32::from_le_bytes(c.try_into().unwrap_or_default());
            let k = u32::from_le_bytes(k.try_into().unwrap_or_default());
            wanted.push(((has != 0).then_some(c), k, r as u32));
        }
        let Some(color) = color else {
            boot.allgather(&[])?;
            return Ok(None);
        };
        let mut members: Vec<(u32, u32)> = wanted
            .iter()
            .filter(|w| w.0 == Some(color))
            .map(|w| (w.1, w.2))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|m| m.1 == sh.rank)
            .ok_or_else(|| Error::Unusable("this rank is missing from its own split".into()))?
            as u32;
        let leader = members[0].1;
        let timeout = sh.policy.timeout;
        // The new rank 0 hosts the rendezvous on the address it reaches the
        // parent's root from; it always answers the second round, so a
        // failure to listen reaches the others as an error, not a timeout.
        let (text, root, failure) = if new_rank == 0 {
            let ip = boot.local_ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
            match create_unique_id_with_timeout(SocketAddr::new(ip, 0), timeout) {
                Ok((id, root)) => (id.to_string(), Some(root), None),
                Err(e) => (String::new(), None, Some(e)),
            }
        } else {
            (String::new(), None, None)
        };
        let ids = boot.allgather(text.as_bytes())?;
        drop(boot);
        if let Some(e) = failure {
            return Err(e);
        }
        let id: UniqueId = std::str::from_utf8(&ids[leader as usize])
            .ok()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Error::Bootstrap(format!(
                    "rank {leader}, new rank 0 of split color {color}, could not host the new rendezvous (its log says why)"
                ))
            })?
            .parse()?;
        info!(
            rank = sh.rank,
            color,
            key,
            new_rank,
            size = members.len(),
            "braid: split"
        );
        let config = Config {
            timeout,
            abort: None,
        };
        let child = Self::init_inner(&id, new_rank, members.len() as u32, &config, root)?;
        if let Ok(mut kids) = sh.children.lock() {
            kids.retain(|w| w.strong_count() > 0);
            kids.push(Arc::downgrade(&child.shared));
        }
        Ok(Some(child))
    }

    /// The error that broke this communicator, if any (like
    /// `ncclCommGetAsyncError`).
    pub fn async_error(&self) -> Option<String> {
        if self.shared.abort.load(Ordering::SeqCst) {
            return Some("aborted by the caller".into());
        }
        self.lock().ok().and_then(|st| st.broken.clone())
    }

    /// Every rank contributes `data` through the bootstrap; all get all
    /// contributions in rank order (set-up of device communicators).
    pub(crate) fn allgather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.shared
            .bootstrap
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked while holding the bootstrap".into()))?
            .allgather(data)
    }

    /// Plan parameters other than the piece size: (waiting policy, AllReduce
    /// recursive-doubling threshold).
    pub(crate) fn plan_knobs(&self) -> (WaitPolicy, usize) {
        (self.shared.policy, self.shared.small_allreduce)
    }

    /// Returns once every rank of the communicator called `barrier`, like
    /// `MPI_Barrier`: a collective over the data links (the small AllReduce
    /// of a one-byte token, [`Collective::Barrier`]), so it costs about what
    /// a one-element AllReduce costs, it has the collectives' deadline (a
    /// rank that never arrives is an error naming it) and, like any
    /// collective, every rank must call it in the same order relative to
    /// the others.
    pub fn barrier(&self) -> Result<()> {
        let (send, mut recv) = ([0u8], [0u8]);
        self.run_bytes(&Collective::Barrier, DataType::U8, &send, &mut recv)
    }

    fn lock(&self) -> Result<OpGuard<'_, State>> {
        self.shared
            .state
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked inside an operation".into()))
    }

    /// Plan and run one operation over raw buffers (validated by the caller).
    fn run(&self, coll: Collective, dt: DataType, bufs: &[RawBuf]) -> Result<()> {
        let sh = &*self.shared;
        let mut st = self.lock()?;
        if let Some(why) = &st.broken {
            return Err(Error::Unusable(why.clone()));
        }
        if sh.abort.load(Ordering::SeqCst) {
            return Err(Error::Unusable("aborted by the caller".into()));
        }
        let seq = st.seq;
        st.seq += 1;
        let name = coll.name();
        let _span = info_span!("op", op = name, seq, rank = sh.rank).entered();
        let planned = self.program(&mut st, &coll, dt)?;
        let (prog, single_copy) = (&*planned.prog, planned.single_copy);
        debug!(ops = prog.ops.len(), "start");
        let st = &mut *st;
        let use_headers = if !sh.check_headers {
            false
        } else if let Collective::Group(_) = coll {
            st.headers = Headers::for_group(
                &coll,
                dt,
                sh.rank,
                prog,
                &mut st.p2p_send_seq,
                &mut st.p2p_recv_seq,
            );
            true
        } else {
            st.headers
                .fill_collective(&coll, dt, st.coll_seq, sh.nranks);
            st.coll_seq += 1;
            true
        };
        let buf_bytes = bufs.iter().map(|b| b.len).sum::<usize>();
        let ex = Exec {
            bufs,
            policy: &sh.policy,
            abort: &sh.abort,
            direct_min: if single_copy {
                sh.direct_min
            } else {
                usize::MAX
            },
            stream_copies: buf_bytes >= sh.stream_min,
            slot_stores: Some(&st.slot_stores),
            rank: sh.rank,
            headers: use_headers.then_some(&st.headers),
            progress: Some(&sh.progress),
        };
        // Operations that may run a while without waiting (long copies and
        // reductions) take their start time now; small ones once they wait.
        sh.progress
            .start(name, seq, prog.stage_ends.len(), buf_bytes >= 64 * 1024);
        // SAFETY: the typed entry points built `bufs` from live slices of the
        // right lengths (checked), borrowed for this whole call, aligned for
        // `dt`, aliasing only as the in-place plans allow.
        let res = unsafe { host::execute(prog, &mut st.chans, &ex, &mut st.header_flags) };
        if !matches!(coll, Collective::Group(_)) {
            // Put the plan back where the next identical call finds it
            // (moved, not cloned: an Arc's count is two atomic operations).
            st.last = Some((coll, dt, planned));
        }
        sh.progress
            .finish(res.as_ref().err().map(|e| e.to_string()).as_deref());
        match res {
            Ok(()) => Ok(()),
            Err(source) => {
                let msg = format!("{name} #{seq} failed: {source}");
                tracing::error!(rank = sh.rank, "{msg}");
                // Tell the peers the original cause, not a chain of relays:
                // a rank that failed because a peer aborted passes that
                // peer's reason on unchanged.
                let origin = match &source {
                    CoreError::PeerAborted { reason, .. } => reason.clone(),
                    other => format!("rank {}: {other}", sh.rank),
                };
                st.chans.abort_all(&origin);
                st.broken = Some(msg);
                Err(Error::Operation {
                    rank: sh.rank,
                    op: name.to_string(),
                    seq,
                    source,
                })
            }
        }
    }

    /// Whether this collective may move its data single-copy: groups
    /// always (their pieces are cut per message), collectives when their
    /// largest buffer reaches `single_copy_min`. The same answer on every
    /// rank, since the plans must cut pieces alike.
    fn single_copy(&self, coll: &Collective, dt: DataType) -> bool {
        if matches!(coll, Collective::Group(_)) {
            return true;
        }
        let largest = coll
            .collective_counts(self.shared.nranks)
            .map(|[s, r]| s.max(r))
            .unwrap_or(0);
        largest.saturating_mul(dt.size()) >= self.shared.single_copy_min
    }

    fn program(&self, st: &mut State, coll: &Collective, dt: DataType) -> Result<Planned> {
        let sh = &*self.shared;
        let cacheable = !matches!(coll, Collective::Group(_));
        if cacheable {
            // The previous call's plan (moved out; `run` puts it back).
            if let Some((c, d, _)) = &st.last {
                if *d == dt && c == coll {
                    if let Some((_, _, p)) = st.last.take() {
                        return Ok(p);
                    }
                }
            }
            if let Some(p) = st.cache.get(&(coll.clone(), dt)) {
                return Ok(p.clone());
            }
        }
        let single_copy = self.single_copy(coll, dt);
        let params = PlanParams {
            rank: sh.rank,
            ring: sh.ring.clone(),
            piece_bytes: sh.piece,
            move_piece_bytes: if single_copy { sh.move_piece } else { sh.piece },
            small_allreduce_bytes: sh.small_allreduce,
            direct_moves: sh.direct_moves
                && (single_copy
                    || matches!(*coll, Collective::AllGather { send_count }
                        if send_count
                            .saturating_mul(sh.nranks as usize)
                            .saturating_mul(dt.size())
                            <= FLAT_ALLGATHER_MAX_BYTES)),
        };
        let planned = Planned {
            prog: Arc::new(plan::plan(coll, dt, &params)?),
            single_copy,
        };
        if cacheable {
            if st.cache.len() >= 256 {
                st.cache.clear();
            }
            st.cache.insert((coll.clone(), dt), planned.clone());
        }
        Ok(planned)
    }

    /// Run a collective described by `coll` on byte buffers holding elements
    /// of `dt` (the untyped API, like NCCL's `void*` + datatype). Buffer sizes
    /// follow [`Collective::buffer_counts`]; on non-root ranks a Broadcast's
    /// `send` and a Reduce's `recv` are not used and may be empty.
    pub fn run_bytes(
        &self,
        coll: &Collective,
        dt: DataType,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<()> {
        let rank = self.shared.rank;
        let counts = self.check_coll(coll, dt)?;
        let non_root = coll.root().is_some_and(|r| r != rank);
        let send_used = !(non_root && matches!(coll, Collective::Broadcast { .. }));
        let recv_used = !(non_root && matches!(coll, Collective::Reduce { .. }));
        let r = raw_bytes(recv);
        let s = if send_used { raw_bytes(send) } else { r };
        if send_used {
            self.check_buf(coll, "send", s, counts[0], dt)?;
        }
        if recv_used {
            self.check_buf(coll, "recv", r, counts[1], dt)?;
        } else {
            self.check_align(coll, "recv", r, dt)?;
        }
        self.run(coll.clone(), dt, &[s, r])
    }

    /// Run a collective in place on `buf` (see [`Communicator::run_bytes`]):
    /// AllReduce, Broadcast and Reduce use `buf` as both buffers; AllGather
    /// takes this rank's contribution from block `rank` of `buf`;
    /// ReduceScatter leaves this rank's result in block `rank` of `buf`.
    /// AllToAll has no in-place form.
    pub fn run_bytes_in_place(
        &self,
        coll: &Collective,
        dt: DataType,
        buf: &mut [u8],
    ) -> Result<()> {
        let counts = self.check_coll(coll, dt)?;
        let b = raw_bytes(buf);
        let es = dt.size();
        let block = |n: usize| RawBuf {
            // SAFETY: the caller checked that `buf` holds nranks · n
            // elements, so block `rank` lies inside it.
            ptr: unsafe { b.ptr.add(self.shared.rank as usize * n * es) },
            len: n * es,
        };
        let bufs = match *coll {
            Collective::AllReduce { .. }
            | Collective::Broadcast { .. }
            | Collective::Reduce { .. }
            | Collective::Barrier => {
                self.check_buf(coll, "buffer", b, counts[0], dt)?;
                [b, b]
            }
            Collective::AllGather { send_count } => {
                self.check_buf(coll, "buffer", b, counts[1], dt)?;
                [block(send_count), b]
            }
            Collective::ReduceScatter { recv_count, .. } => {
                self.check_buf(coll, "buffer", b, counts[0], dt)?;
                [b, block(recv_count)]
            }
            Collective::AllToAll { .. } | Collective::Group(_) => {
                return Err(Error::InvalidArgument(format!(
                    "{} has no in-place form: pass separate send and receive buffers",
                    coll.name()
                )))
            }
        };
        self.run(coll.clone(), dt, &bufs)
    }

    fn check_coll(&self, coll: &Collective, dt: DataType) -> Result<[usize; 2]> {
        if let Collective::Group(_) = coll {
            return Err(Error::InvalidArgument(
                "point-to-point operations go through Communicator::group()".into(),
            ));
        }
        let inv = |e: CoreError| match e {
            CoreError::InvalidArgument(m) => {
                Error::InvalidArgument(format!("rank {}: {m}", self.shared.rank))
            }
            other => Error::Core(other),
        };
        coll.validated_counts(dt, self.shared.rank, self.shared.nranks)
            .map_err(inv)
    }

    fn check_align(&self, coll: &Collective, what: &str, b: RawBuf, dt: DataType) -> Result<()> {
        if b.len > 0 && !(b.ptr as usize).is_multiple_of(dt.size()) {
            return Err(Error::InvalidArgument(format!(
                "rank {}: {} {what} buffer at {:p} is not aligned for {dt} ({} bytes)",
                self.shared.rank,
                coll.name(),
                b.ptr,
                dt.size()
            )));
        }
        Ok(())
    }

    fn check_buf(
        &self,
        coll: &Collective,
        what: &str,
        b: RawBuf,
        count: usize,
        dt: DataType,
    ) -> Result<()> {
        self.check_align(coll, what, b, dt)?;
        let want = count * dt.size();
        if b.len != want {
            let p = self.shared.nranks;
            return Err(Error::InvalidArgument(format!(
                "rank {}: {} {what} buffer holds {} bytes ({} elements of {dt}) but {want} bytes ({count} elements) are needed with {p} ranks",
                self.shared.rank,
                coll.name(),
                b.len,
                b.len / dt.size(),
            )));
        }
        Ok(())
    }

    /// AllReduce: `recv[i] = op over ranks of send[i]`.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        let coll = Collective::AllReduce {
            count: send.len(),
            op,
        };
        self.run_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// AllReduce in place.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        let coll = Collective::AllReduce {
            count: buf.len(),
            op,
        };
        self.run_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// ReduceScatter: `send` holds `nranks · n` elements, `recv` receives the
    /// `n` elements of block `rank` of the reduced array.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        let coll = Collective::ReduceScatter {
            recv_count: recv.len(),
            op,
        };
        self.run_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// ReduceScatter in place: `buf` holds `nranks · n` elements; the result
    /// lands in block `rank` of it.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        let recv_count = self.block_count("ReduceScatter", buf.len())?;
        let coll = Collective::ReduceScatter { recv_count, op };
        self.run_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// AllGather: `recv` receives every rank's `send`, in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let coll = Collective::AllGather {
            send_count: send.len(),
        };
        self.run_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// AllGather in place: this rank's contribution is already in block
    /// `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let send_count = self.block_count("AllGather", buf.len())?;
        let coll = Collective::AllGather { send_count };
        self.run_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// Broadcast in place: the root's `buf` is copied to every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: u32) -> Result<()> {
        let coll = Collective::Broadcast {
            count: buf.len(),
            root,
        };
        self.run_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// Broadcast out of place: `send` is read on the root only (other ranks
    /// may pass an empty slice).
    pub fn broadcast_from<T: Element>(&self, send: &[T], recv: &mut [T], root: u32) -> Result<()> {
        let coll = Collective::Broadcast {
            count: recv.len(),
            root,
        };
        self.run_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// Reduce to `root`: the root's `recv` receives the reduction of every
    /// rank's `send`; other ranks' `recv` is not used (may be empty).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: RedOp,
        root: u32,
    ) -> Result<()> {
        let coll = Collective::Reduce {
            count: send.len(),
            op,
            root,
        };
        self.run_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// Reduce in place: the root's `buf` receives the result; other ranks'
    /// buffers are left as they are.
    pub fn reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp, root: u32) -> Result<()> {
        let coll = Collective::Reduce {
            count: buf.len(),
            op,
            root,
        };
        self.run_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// AllToAll: block `j` of `send` goes to rank `j`, landing in block
    /// `rank` of its `recv`. Both hold `nranks · n` elements.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let count = self.block_count("AllToAll", send.len())?;
        self.run_bytes(
            &Collective::AllToAll { count },
            T::DTYPE,
            bytes(send),
            bytes_mut(recv),
        )
    }

    fn block_count(&self, op: &str, len: usize) -> Result<usize> {
        let p = self.shared.nranks as usize;
        if !len.is_multiple_of(p) {
            return Err(Error::InvalidArgument(format!(
                "rank {}: {op}: a buffer of {len} elements does not split into {p} equal blocks",
                self.shared.rank
            )));
        }
        Ok(len / p)
    }

    /// Send `buf` to `peer` (which must call [`Communicator::recv`]). Two
    /// ranks that send to each other must use a [`Group`].
    pub fn send<T: Element>(&self, buf: &[T], peer: u32) -> Result<()> {
        let mut g = self.group();
        g.send(buf, peer);
        g.run()
    }

    /// Receive `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: u32) -> Result<()> {
        let mut g = self.group();
        g.recv(buf, peer);
        g.run()
    }

    /// Start a group of point-to-point operations that progress together
    /// (the building block of AllToAllv, gather, scatter, halo exchanges).
    pub fn group<'a>(&'a self) -> Group<'a> {
        Group {
            comm: self,
            ops: Vec::new(),
            bufs: Vec::new(),
            dtype: None,
            error: None,
            _borrows: std::marker::PhantomData,
        }
    }
}

/// Point-to-point operations issued together; run them with [`Group::run`].
/// All operations of a group share one datatype.
#[derive(Debug)]
pub struct Group<'a> {
    comm: &'a Communicator,
    ops: Vec<P2p>,
    bufs: Vec<RawBuf>,
    dtype: Option<DataType>,
    error: Option<String>,
    _borrows: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Group<'a> {
    fn add<T: Element>(&mut self, kind: P2pKind, peer: u32, b: RawBuf, count: usize) {
        match self.dtype {
            Some(d) if d != T::DTYPE => {
                self.error.get_or_insert(format!(
                    "a group mixes datatypes {d} and {}; issue one group per datatype",
                    T::DTYPE
                ));
            }
            _ => self.dtype = Some(T::DTYPE),
        }
        self.ops.push(P2p { kind, peer, count });
        self.bufs.push(b);
    }

    /// Add a send of `buf` to `peer`.
    pub fn send<T: Element>(&mut self, buf: &'a [T], peer: u32) -> &mut Self {
        self.add::<T>(P2pKind::Send, peer, raw_bytes(bytes(buf)), buf.len());
        self
    }

    /// Add a receive into `buf` from `peer`.
    pub fn recv<T: Element>(&mut self, buf: &'a mut [T], peer: u32) -> &mut Self {
        let n = buf.len();
        self.add::<T>(P2pKind::Recv, peer, raw_bytes(bytes_mut(buf)), n);
        self
    }

    /// Run every operation of the group; returns when all are done.
    pub fn run(self) -> Result<()> {
        if let Some(e) = self.error {
            return Err(Error::InvalidArgument(e));
        }
        let Some(dt) = self.dtype else { return Ok(()) };
        let coll = Collective::Group(self.ops);
        coll.validate(dt, self.comm.rank(), self.comm.nranks())
            .map_err(|e| match e {
                CoreError::InvalidArgument(m) => Error::InvalidArgument(m),
                other => Error::Core(other),
            })?;
        self.comm.run(coll, dt, &self.bufs)
    }
}

/// The bytes of a typed slice.
fn bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: Element types are plain numbers without padding; the byte view
    // covers exactly the slice's memory and borrows it for the same lifetime.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

/// The bytes of a typed slice, writable.
fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes`; moreover every bit pattern is a valid value of
    // each Element type (integers, IEEE floats), so writes through the byte
    // view cannot produce invalid values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

/// A byte slice as the engine's raw buffer (writable only if it came from a
/// `&mut`: the plans never write a send buffer).
fn raw_bytes(s: &[u8]) -> RawBuf {
    RawBuf {
        ptr: s.as_ptr() as *mut u8,
        len: s.len(),
    }
}

fn encode_peer(p: &PeerDesc) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&p.rank.to_le_bytes());
    v.extend_from_slice(&p.pid.to_le_bytes());
    let mut field = |b: &[u8]| {
        v.extend_from_slice(&(b.len() as u16).to_le_bytes());
        v.extend_from_slice(b);
    };
    field(p.host_id.as_bytes());
    for (t, f) in &p.fabrics {
        field(t.as_bytes());
        field(f.as_bytes());
    }
    v
}

fn decode_peer(b: &[u8], from: u32) -> Result<PeerDesc> {
    let bad = || Error::Bootstrap(format!("rank {from} sent a malformed peer description"));
    if b.len() < 8 || b.len() > 8 + 16384 {
        return Err(bad());
    }
    let rank = u32::from_le_bytes(b[0..4].try_into().map_err(|_| bad())?);
    let pid = u32::from_le_bytes(b[4..8].try_into().map_err(|_| bad())?);
    let mut at = 8;
    let field = |at: &mut usize| -> Result<String> {
        let l = b.get(*at..*at + 2).ok_or_else(bad)?;
        let l = u16::from_le_bytes([l[0], l[1]]) as usize;
        let s = b.get(*at + 2..*at + 2 + l).ok_or_else(bad)?;
        *at += 2 + l;
        String::from_utf8(s.to_vec()).map_err(|_| bad())
    };
    let host_id = field(&mut at)?;
    let mut fabrics = Vec::new();
    while at < b.len() {
        let t = field(&mut at)?;
        let f = field(&mut at)?;
        fabrics.push((t, f));
    }
    if rank != from {
        return Err(Error::Bootstrap(format!(
            "slot {from} of the rendezvous holds rank {rank}'s description"
        )));
    }
    Ok(PeerDesc {
        rank,
        host_id,
        pid,
        fabrics,
    })
}

/// Setting up the links of a communicator: phase 1 allocates both ends of
/// each link and collects their connect-info; phase 2 exchanges it among all
/// ranks and connects. Shared by the host and the device communicators.
pub(crate) struct LinkSetup {
    rank: u32,
    recv: Vec<Option<Box<dyn PendingRecv>>>,
    send: Vec<Option<Box<dyn PendingSend>>>,
    blobs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl LinkSetup {
    pub(crate) fn new(rank: u32, nranks: usize) -> LinkSetup {
        LinkSetup {
            rank,
            recv: (0..nranks).map(|_| None).collect(),
            send: (0..nranks).map(|_| None).collect(),
            blobs: vec![(Vec::new(), Vec::new()); nranks],
        }
    }

    /// Phase 1 for the two links with rank `q`, over transport `t`.
    pub(crate) fn add(
        &mut self,
        q: usize,
        t: &dyn braid_core::transport::Transport,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<()> {
        let (pr, rb) = t.listen(me, peer)?;
        let (ps, sb) = t.prepare_send(me, peer)?;
        self.recv[q] = Some(pr);
        self.send[q] = Some(ps);
        self.blobs[q] = (rb, sb);
        Ok(())
    }

    /// Phase 2: `allgather` every rank's connect-info, then connect the send
    /// ends first (they never wait), then the receive ends, within `timeout`.
    pub(crate) fn connect(
        self,
        allgather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>>,
        timeout: Duration,
    ) -> Result<Channels> {
        let p = self.blobs.len();
        let all = allgather(&encode_blobs(&self.blobs))?;
        let all: Vec<Vec<(Vec<u8>, Vec<u8>)>> = all
            .iter()
            .enumerate()
            .map(|(r, b)| decode_blobs(b, p, r as u32))
            .collect::<Result<_>>()?;
        if all.len() != p {
            return Err(Error::Bootstrap(format!(
                "connect-info from {} ranks, expected {p}",
                all.len()
            )));
        }
        let deadline = Instant::now() + timeout;
        let me = self.rank as usize;
        let mut chans = Channels {
            send: (0..p).map(|_| None).collect(),
            recv: (0..p).map(|_| None).collect(),
            scratch: Vec::new(),
        };
        for (q, ps) in self.send.into_iter().enumerate() {
            if let Some(ps) = ps {
                // q's receive end for the link me → q.
                chans.send[q] = Some(ps.connect(&all[q][me].0, deadline)?);
            }
        }
        for (q, pr) in self.recv.into_iter().enumerate() {
            if let Some(pr) = pr {
                chans.recv[q] = Some(pr.connect(&all[q][me].1, deadline)?);
            }
        }
        Ok(chans)
    }
}

pub(crate) fn encode_blobs(blobs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut v = Vec::new();
    for (a, b) in blobs {
        for x in [a, b] {
            v.extend_from_slice(&(x.len() as u32).to_le_bytes());
            v.extend_from_slice(x);
        }
    }
    v
}

pub(crate) fn decode_blobs(b: &[u8], p: usize, from: u32) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let bad = || Error::Bootstrap(format!("rank {from} sent malformed connect-info"));
    let mut out = Vec::with_capacity(p);
    let mut at = 0usize;
    let mut take = || -> Result<Vec<u8>> {
        let l = b.get(at..at + 4).ok_or_else(bad)?;
        let l = u32::from_le_bytes(l.try_into().map_err(|_| bad())?) as usize;
        let x = b.get(at + 4..at + 4 + l).ok_or_else(bad)?.to_vec();
        at += 4 + l;
        Ok(x)
    };
    for _ in 0..p {
        let r = take()?;
        let s = take()?;
        out.push((r, s));
    }
    Ok(out)
}

#[cfg(test)]
mod peer_desc_tests {
    use super::*;

    fn cpus(list: &str) -> Option<CpuSet> {
        Some(CpuSet::from_list(list).unwrap())
    }

    #[test]
    fn ranks_bound_one_per_core_are_not_oversubscribed() {
        // mpirun's default for two ranks: one core each.
        let bound = [cpus("0"), cpus("1")];
        assert!(!oversubscribed(0, &bound, 2));
        assert!(!oversubscribed(1, &bound, 2));
        // Unbound: each may run anywhere, two ranks for two CPUs.
        let free = [cpus("0-1"), cpus("0-1")];
        assert!(!oversubscribed(0, &free, 2));
        // Eight ranks bound to eight distinct CPUs of a 64-CPU host.
        let spread: Vec<_> = (0..8).map(|c| cpus(&(c * 8).to_string())).collect();
        assert!((0..8).all(|r| !oversubscribed(r, &spread, 64)));
    }

    #[test]
    fn ranks_sharing_cpus_are_oversubscribed() {
        // Four unbound ranks on two CPUs.
        let four = vec![cpus("0-1"); 4];
        assert!((0..4).all(|r| oversubscribed(r, &four, 2)));
        // Four ranks bound round-robin to two cores: two per core.
        let rr = [cpus("0"), cpus("1"), cpus("0"), cpus("1")];
        assert!((0..4).all(|r| oversubscribed(r, &rr, 2)));
        // Two ranks bound to the same core, a third alone on another.
        let same = [cpus("3"), cpus("3"), cpus("5")];
        assert!(oversubscribed(0, &same, 8));
        assert!(oversubscribed(1, &same, 8));
        assert!(!oversubscribed(2, &same, 8));
        // Sharing through a third rank: B on CPU 0 and C on CPU 1 do not
        // overlap, but A may run on both, so three ranks share two CPUs.
        let chain = [cpus("0-1"), cpus("0"), cpus("1")];
        assert!((0..3).all(|r| oversubscribed(r, &chain, 4)));
    }

    #[test]
    fn unknown_cpu_sets_count_as_every_online_cpu() {
        let unknown = [None, None, None];
        assert!(oversubscribed(0, &unknown, 2));
        assert!(!oversubscribed(0, &unknown, 4));
        // One rank bound, the other unknown (may run anywhere): 2 ranks, 2 CPUs.
        assert!(!oversubscribed(0, &[cpus("1"), None], 2));
        // An empty set is as good as unknown.
        assert!(!oversubscribed(
            0,
            &[Some(CpuSet(Vec::new())), cpus("0")],
            2
        ));
        // A rank alone never is.
        assert!(!oversubscribed(0, &[None], 1));
    }

    #[test]
    fn single_copy_threshold_follows_the_thp_mode() {
        let dir = std::env::temp_dir().join(format!("braid-thp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("enabled");
        let at = |text: &str| {
            std::fs::write(&f, text).unwrap();
            single_copy_default(f.to_str().unwrap())
        };
        assert_eq!(at("[always] madvise never\n"), 512 << 10);
        assert_eq!(at("always [madvise] never\n"), 8 << 20);
        assert_eq!(at("always madvise [never]\n"), 8 << 20);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(single_copy_default("/nonexistent/braid/thp"), 8 << 20);
    }

    /// The streaming threshold is the largest (last-level) cache of a
    /// recorded sysfs tree, shared by the local ranks; unreadable or
    /// malformed entries are skipped.
    #[test]
    fn streaming_threshold_is_the_last_level_cache_per_local_rank() {
        let dir = std::env::temp_dir().join(format!("braid-caches-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // This VM's CPU 0: L1d, L1i, L2 and L3 (listed out of order).
        for (idx, level, size) in [
            ("index3", "3", "32768K\n"),
            ("index0", "1", "48K\n"),
            ("index1", "1", "32K\n"),
            ("index2", "2", "1024K\n"),
            ("index9", "4", "lots\n"),
        ] {
            let d = dir.join(idx);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("level"), level).unwrap();
            std::fs::write(d.join("size"), size).unwrap();
        }
        std::fs::create_dir_all(dir.join("index7")).unwrap(); // no files
        assert_eq!(last_level_cache(&dir), Some(32 << 20));
        assert_eq!(stream_default(&dir, 1), 32 << 20);
        assert_eq!(stream_default(&dir, 2), 16 << 20);
        assert_eq!(stream_default(&dir, 0), 32 << 20);
        std::fs::write(dir.join("index3/size"), "2M").unwrap();
        assert_eq!(last_level_cache(&dir), Some(2 << 20));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            last_level_cache(std::path::Path::new("/nonexistent/braid")),
            None
        );
        assert_eq!(
            stream_default(std::path::Path::new("/nonexistent/braid"), 4),
            8 << 20
        );
    }

    #[test]
    fn peer_descriptions_round_trip_with_fabrics() {
        let p = PeerDesc {
            rank: 3,
            host_id: "host/a:b/pid:[1]".into(),
            pid: 77,
            fabrics: vec![("ib".into(), "ib:fe80000000000000".into())],
        };
        assert_eq!(decode_peer(&encode_peer(&p), 3).unwrap(), p);
        let q = PeerDesc {
            fabrics: Vec::new(),
            ..p.clone()
        };
        assert_eq!(decode_peer(&encode_peer(&q), 3).unwrap(), q);
        // Wrong slot, truncation.
        assert!(decode_peer(&encode_peer(&p), 2).is_err());
        let b = encode_peer(&p);
        for n in [0, 7, 9, b.len() - 1] {
            assert!(decode_peer(&b[..n], 3).is_err(), "prefix {n}");
        }
    }
}

/// The rendezvous payloads' decoders over plain bytes, for the fuzz targets
/// in `fuzz/`. Not part of the API.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// A rank's description as the rendezvous carries it: rank, pid, host
    /// id and the (transport, fabric) pairs.
    pub type Peer = (u32, u32, String, Vec<(String, String)>);

    /// Decodes slot `from` of the rendezvous.
    pub fn decode_peer(b: &[u8], from: u32) -> std::result::Result<Peer, String> {
        super::decode_peer(b, from)
            .map(|p| (p.rank, p.pid, p.host_id, p.fabrics))
            .map_err(|e| e.to_string())
    }

    /// Encodes a rank's description as it joins.
    pub fn encode_peer(
        rank: u32,
        pid: u32,
        host_id: &str,
        fabrics: &[(String, String)],
    ) -> Vec<u8> {
        super::encode_peer(&PeerDesc {
            rank,
            host_id: host_id.to_string(),
            pid,
            fabrics: fabrics.to_vec(),
        })
    }

    /// Decodes rank `from`'s connect-info for `p` ranks.
    #[allow(clippy::type_complexity)]
    pub fn decode_blobs(
        b: &[u8],
        p: usize,
        from: u32,
    ) -> std::result::Result<Vec<(Vec<u8>, Vec<u8>)>, String> {
        super::decode_blobs(b, p, from).map_err(|e| e.to_string())
    }

    /// Encodes a rank's connect-info blobs.
    pub fn encode_blobs(blobs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        super::encode_blobs(blobs)
    }
}

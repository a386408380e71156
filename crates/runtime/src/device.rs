//! Collectives on GPU buffers: the device communicator.
//!
//! [`CudaComm::new`] (collective over an existing [`Communicator`]) opens
//! this rank's GPU (`BRAID_CUDA_DEVICE`, else the local rank modulo the
//! devices), asks the topology planner for a link per peer (the host
//! communicator's fused topology with every rank placed on its GPU: NVLink
//! or the same GPU → `nvlink`, PCIe P2P → `pcie` over CUDA IPC, else `pcie`
//! staged through shared host memory), takes those transports from its
//! transport table, connects them through the bootstrap (the IPC handles
//! travel in the connect-info), and starts its engine's thread. The host
//! communicator and its links are untouched: host collectives keep running
//! over shm/socket, device collectives over these links.
//!
//! Two engines (in `crate::engine`); every rank of a communicator uses the
//! same one:
//!
//! - **stream** (the default when every link is a device ring: NVLink, PCIe
//!   P2P, or ranks sharing one GPU): the whole collective goes on the
//!   caller's CUDA stream with GPU-side synchronisation between the ranks
//!   (stream memory operations on counters beside each slot ring; see
//!   [`braid_cuda::schedule`]); a watchdog thread turns dead or stalled
//!   peers into errors and drains the stream so it never hangs.
//! - **proxy** (links staged through host memory, or
//!   `BRAID_CUDA_ENGINE=proxy`): the caller's thread records an event on
//!   its stream, hands the program to the proxy thread, and enqueues a wait
//!   (`cuStreamWaitValue32`) for a completion word the proxy writes when the
//!   program is done, so the collective is ordered with the caller's other
//!   work and the caller's host thread never blocks. If an operation fails,
//!   the stream is still released, the communicator is marked broken, the
//!   peers are told, and every later call (and [`CudaComm::synchronize`])
//!   returns the error.
//!
//! `BRAID_CUDA_ENGINE=stream|proxy` forces one (stream fails at set-up,
//! naming the rank, where some link is not a device ring). Mismatch
//! detection headers are not sent on device links.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid_core::plan::{self, Collective, PlanParams, Program};
use braid_core::topo::{Cluster, GpuLink, TransportPolicy};
use braid_core::transport::{PeerDesc, Transport};
use braid_core::{CoreError, DataType, RedOp};
use braid_cuda::schedule::Cursor;
use braid_cuda::{CudaStream, Device, DeviceBuffer, Event, HostFlag, Kernels};
use braid_transport_nvlink::{Geometry, NvlinkTransport};
use braid_transport_pcie::PcieTransport;
use tracing::info;

use crate::comm::{Communicator, LinkSetup};
use crate::engine::proxy::{Job, Proxy};
use crate::engine::stream::{self as cuda_stream, DevBuf, Rings, Shared, Watchdog};
use crate::engine::Channels;
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::transports::TransportTable;

/// A communicator's device side. Cheap to clone.
#[derive(Clone, Debug)]
pub struct CudaComm {
    inner: Arc<Inner>,
}

struct Inner {
    rank: u32,
    nranks: u32,
    ring: Vec<u32>,
    /// The size pieces are cut to: the smallest slot of any rank's links.
    piece_bytes: usize,
    /// Up to this many bytes an AllReduce runs recursive doubling.
    small_allreduce_bytes: usize,
    dev: Arc<Device>,
    flag: Arc<HostFlag>,
    state: Mutex<Issue>,
    /// `Some` in stream mode.
    stream_mode: Option<StreamMode>,
    broken: Arc<Mutex<Option<String>>>,
    abort: Arc<AtomicBool>,
    worker: Mutex<Option<JoinHandle<()>>>,
    transports: Vec<&'static str>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaComm")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("device", &self.dev.bus_id())
            .field("transports", &self.transports)
            .finish()
    }
}

/// What the caller's side keeps: the queue to the proxy (proxy mode), the
/// piece cursor and the last collective's completion event (stream mode),
/// and the sequence.
struct Issue {
    tx: Option<mpsc::Sender<Job>>,
    cursor: Cursor,
    last: Option<Event>,
    seq: u32,
}

/// The stream engine's fixed parts.
struct StreamMode {
    rings: Rings,
    kernels: Arc<Kernels>,
    shared: Arc<Shared>,
}

/// `Some(true)`: stream forced, `Some(false)`: proxy forced, `None`: auto.
fn parse_engine(v: Option<String>) -> Result<Option<bool>> {
    match v {
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(None),
            "stream" => Ok(Some(true)),
            "proxy" => Ok(Some(false)),
            _ => Err(Error::Env(format!(
                "BRAID_CUDA_ENGINE={v}: use stream, proxy or auto"
            ))),
        },
        None => Ok(None),
    }
}

/// What one rank says of its GPU at set-up.
#[derive(Clone, Debug, PartialEq, Eq)]
struct GpuFacts {
    /// It can use CUDA.
    usable: bool,
    /// Its host.
    host: String,
    /// Its GPU's PCI bus id (empty in the first round).
    bus: String,
    /// Why it cannot use CUDA.
    why: String,
}

/// Per-rank facts exchanged at set-up.
fn encode_gpu(host: &str, bus: &str, ok: bool, why: &str) -> Vec<u8> {
    let mut v = vec![ok as u8];
    for s in [host, bus, why] {
        v.extend_from_slice(&(s.len() as u32).to_le_bytes());
        v.extend_from_slice(s.as_bytes());
    }
    v
}

fn decode_gpu(b: &[u8], from: u32) -> Result<GpuFacts> {
    let bad = || Error::Bootstrap(format!("rank {from} sent a malformed GPU description"));
    let ok = *b.first().ok_or_else(bad)? != 0;
    let mut at = 1usize;
    let mut take = || -> Result<String> {
        let l = b.get(at..at + 4).ok_or_else(bad)?;
        let l = u32::from_le_bytes(l.try_into().map_err(|_| bad())?) as usize;
        let s = b.get(at + 4..at + 4 + l).ok_or_else(bad)?;
        at += 4 + l;
        String::from_utf8(s.to_vec()).map_err(|_| bad())
    };
    let host = take()?;
    let bus = take()?;
    let why = take()?;
    Ok(GpuFacts {
        usable: ok,
        host,
        bus,
        why,
    })
}

/// The device link from `rank` to every rank (its own entry is unused):
/// the planner's transports for the fused topology with every rank placed
/// on its GPU (`busids`), under the environment's policy. A GPU missing from
/// its host's model has no peer-to-peer path (staged), except to ranks on
/// the same GPU.
fn device_links(
    cluster: &Cluster,
    policy: &TransportPolicy,
    busids: &[&str],
    rank: u32,
) -> Result<Vec<GpuLink>> {
    let mut cluster = cluster.clone();
    for (place, bus) in cluster.ranks.iter_mut().zip(busids) {
        place.gpu = Some(bus.to_string());
    }
    let plan = braid_core::topo::plan(&cluster, policy)?;
    for n in &plan.notes {
        info!(rank, "braid: device topology plan: {n}");
    }
    let me = rank as usize;
    (0..busids.len())
        .map(|q| {
            if q == me {
                return Ok(GpuLink::Nvlink);
            }
            plan.gpu_link(me, q).ok_or_else(|| {
                let t = plan.transports[me][q].map_or("none", |t| t.name());
                Error::InvalidArgument(format!(
                    "the transport policy leaves only {t} between ranks {me} and {q}, which cannot carry device memory; unset BRAID_TRANSPORT or the BRAID_*_DISABLE variables that remove nvlink, pcie and shm"
                ))
            })
        })
        .collect()
}

/// Two rounds over `comm`: first who has CUDA and the host of each rank
/// (an error naming the first rank without CUDA), then, with this rank's
/// GPU opened (`BRAID_CUDA_DEVICE`, else its place among the ranks of its
/// host), every rank's GPU; every rank must be on this host.
fn open_gpu(comm: &Communicator, host: &str) -> Result<OpenedGpu> {
    let rank = comm.rank();
    // Round 1: who has CUDA, and the host of each rank (local ranks).
    let probe = braid_cuda::probe();
    let why = match &probe {
        Err(braid_cuda::CudaError::Unavailable(why)) => why.clone(),
        Err(e) => e.to_string(),
        Ok(_) => String::new(),
    };
    let facts = gather_gpu_facts(comm, &encode_gpu(host, "", probe.is_ok(), &why))?;
    if let Some((r, f)) = facts.iter().enumerate().find(|(_, f)| !f.usable) {
        return Err(Error::Cuda(braid_cuda::CudaError::Unavailable(format!(
            "rank {r} cannot use CUDA: {}",
            f.why
        ))));
    }
    let info = probe?;
    let local = facts[..rank as usize]
        .iter()
        .filter(|f| f.host == host)
        .count() as u32;
    let ordinal = braid_cuda::device_for_rank(local, info.devices)?;
    let dev = Device::open(ordinal)?;
    let kernels = Kernels::get(&dev)?;
    // Round 2: every rank's GPU.
    let gpus = gather_gpu_facts(comm, &encode_gpu(host, dev.bus_id(), true, ""))?;
    for (q, g) in gpus.iter().enumerate() {
        let qhost = &g.host;
        if *qhost != host {
            return Err(Error::InvalidArgument(format!(
                "rank {q} runs on another host ({qhost}): device collectives across hosts need a GPU network transport, which this build lacks"
            )));
        }
    }
    Ok(OpenedGpu { dev, kernels, gpus })
}

/// Every rank's [`GpuFacts`], from this rank's `mine` ([`encode_gpu`]).
fn gather_gpu_facts(comm: &Communicator, mine: &[u8]) -> Result<Vec<GpuFacts>> {
    let all = comm.allgather_bytes(mine)?;
    all.iter()
        .enumerate()
        .map(|(r, b)| decode_gpu(b, r as u32))
        .collect()
}

/// The device link to every rank ([`device_links`] on the host
/// communicator's topology and policy), each logged.
fn plan_links(comm: &Communicator, dev: &Device, busids: &[&str]) -> Result<Vec<GpuLink>> {
    let rank = comm.rank();
    let (cluster, policy) = comm.topology_inputs();
    let links = device_links(cluster, policy, busids, rank)?;
    for (q, link) in links.iter().enumerate() {
        if q as u32 != rank {
            info!(
                rank,
                peer = q,
                gpu = dev.bus_id(),
                peer_gpu = busids[q],
                link = link.describe(),
                "braid: device link selected (topology plan)"
            );
        }
    }
    Ok(links)
}

/// The set-up of a link to every peer over the transport of its device
/// link, and the transport's name per rank (`"self"` for this one).
fn add_links(
    rank: u32,
    host: &str,
    gpus: &[GpuFacts],
    links: &[GpuLink],
    table: &TransportTable,
) -> Result<(LinkSetup, Vec<&'static str>)> {
    let me = PeerDesc {
        rank,
        host_id: host.to_string(),
        pid: std::process::id(),
        fabrics: Vec::new(),
    };
    let peer_desc = |q: usize| PeerDesc {
        rank: q as u32,
        host_id: gpus[q].host.clone(),
        pid: 0,
        fabrics: Vec::new(),
    };
    let p = gpus.len();
    let mut setup = LinkSetup::new(rank, p);
    let mut transports = vec!["self"; p];
    for q in 0..p {
        if q as u32 == rank {
            continue;
        }
        let peer = peer_desc(q);
        let kind = links[q].transport();
        let t = table.get(kind).ok_or_else(|| {
            crate::topology::planner_inconsistent(format!(
                "{kind} is {}",
                table.why_off(kind).unwrap_or_default()
            ))
        })?;
        if !t.can_connect(&me, &peer) {
            return Err(Error::Core(CoreError::Unavailable {
                transport: t.name(),
                reason: format!("cannot connect rank {rank} to rank {q}"),
            }));
        }
        setup.add(q, t, &me, &peer)?;
        transports[q] = t.name();
    }
    Ok((setup, transports))
}

/// The piece size every rank cuts collectives into: the smallest slot of
/// any rank's links (`default_bytes` where no rank has a link).
fn agree_piece(comm: &Communicator, chans: &Channels, default_bytes: usize) -> Result<usize> {
    let mine = chans.min_slot_bytes().unwrap_or(usize::MAX) as u64;
    let all = comm.allgather_bytes(&mine.to_le_bytes())?;
    let mut piece = u64::MAX;
    for (r, b) in all.iter().enumerate() {
        let a: [u8; 8] = b
            .as_slice()
            .try_into()
            .map_err(|_| Error::Bootstrap(format!("rank {r} sent a malformed slot size")))?;
        piece = piece.min(u64::from_le_bytes(a));
    }
    Ok(if piece == u64::MAX {
        default_bytes
    } else {
        piece as usize
    })
}

/// The engine every rank uses: the device rings of `chans` for the stream
/// engine when every rank can use it (every link of every rank a device
/// ring, and no rank forced to proxy), else None (the proxy engine).
/// `BRAID_CUDA_ENGINE=stream` (from the host communicator's settings)
/// where some rank cannot is an error.
fn choose_engine(comm: &Communicator, chans: &Channels) -> Result<Option<Rings>> {
    let forced = parse_engine(comm.settings().cuda_engine.clone())?;
    let rings = Rings::of(chans, comm.rank(), comm.nranks());
    let can = forced != Some(false) && rings.is_some();
    let all = comm.allgather_bytes(&[can as u8])?;
    let unable = all.iter().position(|b| b.first() != Some(&1));
    if forced == Some(true) {
        if let Some(q) = unable {
            return Err(Error::InvalidArgument(format!(
                "BRAID_CUDA_ENGINE=stream, but rank {q} has a device link that is not a ring in GPU memory (staged through host memory) or chose the proxy engine"
            )));
        }
    }
    Ok(if unable.is_none() { rings } else { None })
}

/// Start the stream engine: its watchdog's thread.
fn start_stream(dog: Watchdog, rings: Rings, kernels: Arc<Kernels>) -> Result<Engine> {
    let shared = dog.shared.clone();
    let worker = std::thread::Builder::new()
        .name(format!("braid-cuda-watchdog-{}", dog.rank))
        .spawn(move || dog.run());
    Ok(Engine {
        worker: spawned(worker, "stream")?,
        stream_mode: Some(StreamMode {
            rings,
            kernels,
            shared,
        }),
        tx: None,
        name: "stream",
    })
}

/// Start the proxy engine: its thread, fed through a queue.
fn start_proxy(mut proxy: Proxy) -> Result<Engine> {
    let (tx, rx) = mpsc::channel::<Job>();
    let worker = std::thread::Builder::new()
        .name(format!("braid-cuda-proxy-{}", proxy.rank))
        .spawn(move || proxy.run(rx));
    Ok(Engine {
        worker: spawned(worker, "proxy")?,
        stream_mode: None,
        tx: Some(tx),
        name: "proxy",
    })
}

/// The engine thread `worker` (of the `engine` engine), or why it did not start.
fn spawned(worker: std::io::Result<JoinHandle<()>>, engine: &str) -> Result<JoinHandle<()>> {
    worker.map_err(|e| {
        Error::InvalidArgument(format!("cannot start the {engine} engine's thread: {e}"))
    })
}

/// This rank's GPU, opened: the device, its kernels, and every rank's
/// facts (host and GPU bus id).
struct OpenedGpu {
    dev: Arc<Device>,
    kernels: Arc<Kernels>,
    gpus: Vec<GpuFacts>,
}

/// The engine's thread and what the caller's side keeps of it.
struct Engine {
    worker: JoinHandle<()>,
    /// `Some` in stream mode.
    stream_mode: Option<StreamMode>,
    /// The queue to the proxy (proxy mode).
    tx: Option<mpsc::Sender<Job>>,
    /// `"stream"` or `"proxy"`.
    name: &'static str,
}

impl CudaComm {
    /// Open this rank's GPU and connect device links to every peer. Every
    /// rank of `comm` must call it (a collective). On a machine without
    /// CUDA every rank gets `Error::Cuda(CudaError::Unavailable)` naming the
    /// rank(s) without it.
    pub fn new(comm: &Communicator) -> Result<CudaComm> {
        let rank = comm.rank();
        let nranks = comm.nranks();
        let host = crate::topology::host_id(comm.settings().host_id.as_deref());
        let OpenedGpu { dev, kernels, gpus } = open_gpu(comm, &host)?;
        let busids: Vec<&str> = gpus.iter().map(|g| g.bus.as_str()).collect();
        let links = plan_links(comm, &dev, &busids)?;
        let geo = Geometry::from_env()?;
        let (_, policy) = comm.topology_inputs();
        let table = TransportTable::device(
            NvlinkTransport::new(Some(dev.clone()), geo, links.clone()),
            PcieTransport::new(Some(dev.clone()), geo, links.clone())?,
            policy,
        )?;
        let knobs = comm.plan_knobs();
        let (policy_wait, small_allreduce_bytes) = (knobs.wait, knobs.small_allreduce_bytes);
        let (setup, transports) = add_links(rank, &host, &gpus, &links, &table)?;
        let chans = setup.connect(|b| comm.allgather_bytes(b), policy_wait.timeout)?;
        let piece_bytes = agree_piece(comm, &chans, geo.slot_bytes)?;
        let rings = choose_engine(comm, &chans)?;
        let flag = Arc::new(HostFlag::new(&dev)?);
        let broken: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let abort = Arc::new(AtomicBool::new(false));
        // The engine's thread: the watchdog (stream) or the proxy.
        let engine = match rings {
            Some(rings) => {
                let dog = Watchdog {
                    rank,
                    dev: dev.clone(),
                    rings: rings.clone(),
                    chans,
                    flag: flag.clone(),
                    shared: Arc::new(Shared::new(nranks)),
                    policy: policy_wait,
                    abort: abort.clone(),
                    broken: broken.clone(),
                };
                start_stream(dog, rings, kernels)?
            }
            None => {
                let proxy = Proxy {
                    rank,
                    dev: dev.clone(),
                    kernels,
                    stream: CudaStream::new(&dev)?,
                    scratch_in: DeviceBuffer::alloc(&dev, piece_bytes)?,
                    scratch_out: DeviceBuffer::alloc(&dev, piece_bytes)?,
                    chans,
                    policy: policy_wait,
                    abort: abort.clone(),
                    broken: broken.clone(),
                    flag: flag.clone(),
                    progress: Progress::register(rank, nranks, format!("cuda@{}", dev.bus_id())),
                };
                start_proxy(proxy)?
            }
        };
        info!(
            rank,
            device = dev.bus_id(),
            piece = piece_bytes,
            engine = engine.name,
            "braid: device communicator ready"
        );
        Ok(CudaComm {
            inner: Arc::new(Inner {
                rank,
                nranks,
                ring: comm.ring().to_vec(),
                piece_bytes,
                small_allreduce_bytes,
                dev,
                flag,
                state: Mutex::new(Issue {
                    tx: engine.tx,
                    cursor: Cursor::new(nranks),
                    last: None,
                    seq: 0,
                }),
                stream_mode: engine.stream_mode,
                broken,
                abort,
                worker: Mutex::new(Some(engine.worker)),
                transports,
            }),
        })
    }

    /// The GPU this rank uses.
    pub fn device(&self) -> &Arc<Device> {
        &self.inner.dev
    }

    /// The transport used to reach each rank (`"self"` for this rank).
    pub fn transports(&self) -> &[&'static str] {
        &self.inner.transports
    }

    /// The engine in use: `"stream"` (GPU-side synchronisation) or
    /// `"proxy"` (a host thread per communicator drives the steps).
    pub fn engine(&self) -> &'static str {
        if self.inner.stream_mode.is_some() {
            "stream"
        } else {
            "proxy"
        }
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> u32 {
        self.inner.nranks
    }

    /// The error that broke this communicator, if any.
    pub fn async_error(&self) -> Option<String> {
        self.inner.broken.lock().ok().and_then(|b| b.clone())
    }

    /// Make pending and later operations fail promptly (their streams are
    /// still released).
    pub fn abort(&self) {
        self.inner.abort.store(true, Ordering::SeqCst);
    }

    /// Block until every operation issued so far is done (the proxy ran it,
    /// or in stream mode the GPU passed its end); the
    /// error that broke the communicator, if any. (The caller's streams
    /// still need their own synchronisation for the data.)
    pub fn synchronize(&self) -> Result<()> {
        let target = self.lock()?.seq;
        let deadline = Instant::now() + Duration::from_secs(24 * 3600);
        while (self.inner.flag.load().wrapping_sub(target) as i32) < 0 {
            if let Some(b) = self.async_error() {
                return Err(Error::Unusable(b));
            }
            if Instant::now() > deadline {
                return Err(Error::Unusable("device proxy did not finish".into()));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        match self.async_error() {
            Some(b) => Err(Error::Unusable(b)),
            None => Ok(()),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Issue>> {
        self.inner
            .state
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked while issuing".into()))
    }

    /// Enqueue `coll` on `stream` over device buffers holding elements of
    /// `dt` and return at once. Sizes follow [`crate::Collective::buffer_counts`];
    /// on non-root ranks a Broadcast's `send` and a Reduce's `recv` are not
    /// used (pass any buffer). Pass the same buffer twice for AllReduce,
    /// Broadcast and Reduce in place. The buffers stay allocated until the
    /// operation is done; the result is in `recv` once `stream` passes it.
    pub fn run(
        &self,
        coll: &crate::Collective,
        dt: DataType,
        send: &Arc<DeviceBuffer>,
        recv: &Arc<DeviceBuffer>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.run_plan(&coll.plan(), dt, send, recv, stream)
    }

    /// Send `count` elements of `dt` from `send` to rank `to` and receive
    /// as many from rank `from` into `recv`, enqueued on `stream` like
    /// [`CudaComm::run`] (one group of two point-to-point operations; `to`
    /// and `from` must make the same call with this rank as `from` and `to`).
    #[allow(clippy::too_many_arguments)]
    pub fn send_recv(
        &self,
        send: &Arc<DeviceBuffer>,
        to: u32,
        recv: &Arc<DeviceBuffer>,
        from: u32,
        count: usize,
        dt: DataType,
        stream: &CudaStream,
    ) -> Result<()> {
        use braid_core::plan::{P2p, P2pKind};
        let group = Collective::Group(vec![
            P2p {
                kind: P2pKind::Send,
                peer: to,
                count,
            },
            P2p {
                kind: P2pKind::Recv,
                peer: from,
                count,
            },
        ]);
        self.run_plan(&group, dt, send, recv, stream)
    }

    /// [`CudaComm::run`] with the planner's description (a group too).
    fn run_plan(
        &self,
        coll: &Collective,
        dt: DataType,
        send: &Arc<DeviceBuffer>,
        recv: &Arc<DeviceBuffer>,
        stream: &CudaStream,
    ) -> Result<()> {
        let counts = coll.buffer_counts(self.inner.nranks)?;
        coll.validate(dt, self.inner.rank, self.inner.nranks)?;
        let rank = self.inner.rank;
        let non_root = coll.root().is_some_and(|r| r != rank);
        let send_used = !(non_root && matches!(coll, Collective::Broadcast { .. }));
        let recv_used = !(non_root && matches!(coll, Collective::Reduce { .. }));
        for (used, what, b, c) in [
            (send_used, "send", send, counts[0]),
            (recv_used, "recv", recv, counts[1]),
        ] {
            let need = c
                .checked_mul(dt.size())
                .ok_or_else(|| Error::InvalidArgument(format!("{what} count {c} overflows")))?;
            if used && b.len() < need {
                return Err(Error::InvalidArgument(format!(
                    "{}: {what} buffer holds {} bytes, {need} needed ({c} x {dt})",
                    coll.name(),
                    b.len()
                )));
            }
            if !Arc::ptr_eq(b.device(), &self.inner.dev)
                && b.device().ordinal() != self.inner.dev.ordinal()
            {
                return Err(Error::InvalidArgument(format!(
                    "{what} buffer lives on GPU {}, the communicator on GPU {}",
                    b.device().ordinal(),
                    self.inner.dev.ordinal()
                )));
            }
        }
        let r = DevBuf {
            ptr: recv.ptr(),
            len: recv.len(),
        };
        let s = if send_used {
            DevBuf {
                ptr: send.ptr(),
                len: send.len(),
            }
        } else {
            r
        };
        self.enqueue(coll, dt, [s, r], vec![send.clone(), recv.clone()], stream)
    }

    /// AllReduce of `count` elements (see [`CudaComm::run`]).
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &self,
        send: &Arc<DeviceBuffer>,
        recv: &Arc<DeviceBuffer>,
        count: usize,
        dt: DataType,
        op: RedOp,
        stream: &CudaStream,
    ) -> Result<()> {
        self.run_plan(&Collective::AllReduce { count, op }, dt, send, recv, stream)
    }

    fn enqueue(
        &self,
        coll: &Collective,
        dt: DataType,
        bufs: [DevBuf; 2],
        keep: Vec<Arc<DeviceBuffer>>,
        stream: &CudaStream,
    ) -> Result<()> {
        if let Some(b) = self.async_error() {
            return Err(Error::Unusable(b));
        }
        let params = PlanParams {
            rank: self.inner.rank,
            ring: self.inner.ring.clone(),
            piece_bytes: self.inner.piece_bytes,
            move_piece_bytes: self.inner.piece_bytes,
            small_allreduce_bytes: self.inner.small_allreduce_bytes,
            direct_moves: false,
        };
        let prog = Arc::new(plan::plan(coll, dt, &params)?);
        if let Some(m) = &self.inner.stream_mode {
            return self.enqueue_stream(m, &prog, bufs, keep, stream);
        }
        let start = Event::new(&self.inner.dev, false)?;
        let mut st = self.lock()?;
        let seq = st.seq.wrapping_add(1);
        stream.record(&start)?;
        let tx = st
            .tx
            .as_ref()
            .ok_or_else(|| Error::Unusable("the device communicator was shut down".into()))?;
        tx.send(Job {
            prog,
            name: coll.name(),
            bufs,
            _keep: keep,
            start,
            seq,
        })
        .map_err(|_| Error::Unusable("the device proxy thread is gone".into()))?;
        st.seq = seq;
        // The caller's stream continues once the proxy wrote `seq`.
        stream.wait_value_geq(&self.inner.flag, seq)?;
        Ok(())
    }
}

impl CudaComm {
    /// Stream mode: queue the whole collective on `stream`.
    fn enqueue_stream(
        &self,
        m: &StreamMode,
        prog: &Program,
        bufs: [DevBuf; 2],
        keep: Vec<Arc<DeviceBuffer>>,
        stream: &CudaStream,
    ) -> Result<()> {
        let mut guard = self.lock()?;
        let st = &mut *guard;
        let mut cursor = st.cursor.clone();
        // Nothing is queued before the schedule is known to be valid.
        let cmds = braid_cuda::schedule::schedule(prog, &m.rings.links, &mut cursor)?;
        // One event per communicator, re-recorded at the end of each
        // collective: the previous collective comes first, on whatever
        // stream it was issued (a wait on a never-recorded event is a no-op;
        // a wait takes the event's state when it is queued).
        let ev: &Event = match &mut st.last {
            Some(ev) => ev,
            slot @ None => slot.insert(Event::new(&self.inner.dev, false)?),
        };
        stream.wait_event(ev)?;
        let seq = st.seq.wrapping_add(1);
        let queued = cuda_stream::issue(&cmds, prog, &bufs, &m.rings, &m.kernels, stream);
        // From here the cursor has moved for every peer: a partly queued
        // collective is drained by the watchdog's rescue.
        st.cursor = cursor;
        st.seq = seq;
        // SAFETY: the completion word lives as long as the communicator,
        // whose watchdog outlives all queued work.
        let fin = unsafe { stream.write_value(self.inner.flag.device_ptr(), seq) }
            .map_err(Error::from)
            .and_then(|_| stream.record(ev).map_err(Error::from));
        m.shared.queued(seq, &st.cursor, keep);
        let r = queued.map_err(Error::from).and(fin);
        if let Err(e) = &r {
            let msg = format!(
                "queuing a device collective failed on rank {}: {e}",
                self.inner.rank
            );
            if let Ok(mut b) = self.inner.broken.lock() {
                b.get_or_insert(msg);
            }
        }
        r
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(mut st) = self.state.lock() {
            st.tx = None;
        }
        if let Some(m) = &self.stream_mode {
            m.shared
                .shutdown
                .store(true, std::sync::atomic::Ordering::Release);
        }
        if let Some(w) = self.worker.lock().ok().and_then(|mut w| w.take()) {
            let _ = w.join();
        }
    }
}

/// The proxy thread's state.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_facts_round_trip_and_reject_garbage() {
        let b = encode_gpu("host/a", "0000:3b:00.0", true, "");
        assert_eq!(
            decode_gpu(&b, 0).unwrap(),
            GpuFacts {
                usable: true,
                host: "host/a".into(),
                bus: "0000:3b:00.0".into(),
                why: String::new(),
            }
        );
        for n in 0..b.len() {
            assert!(decode_gpu(&b[..n], 3).is_err(), "{n}");
        }
    }

    /// GPUs missing from the host's model (detection without GPUs) are not
    /// assumed peer-to-peer capable: staged, except ranks on one GPU; a
    /// policy leaving only a network transport is an error naming it.
    #[test]
    fn unknown_gpu_pairs_are_not_assumed_p2p() {
        let sys = braid_core::topo::System {
            cpus: vec![braid_core::topo::Cpu::default()],
            ..Default::default()
        };
        let host = braid_core::topo::plan::Host {
            name: "h".into(),
            topo: braid_core::topo::Topology::new(sys),
        };
        let place = braid_core::topo::RankPlace {
            host: 0,
            gpu: None,
            numa: None,
        };
        let cluster = Cluster {
            hosts: vec![host],
            ranks: vec![place.clone(), place.clone(), place],
        };
        let bus = ["0000:01:00.0", "0000:01:00.0", "0000:02:00.0"];
        let links = device_links(&cluster, &TransportPolicy::default(), &bus, 0).unwrap();
        assert_eq!(links[1], GpuLink::Nvlink, "same GPU");
        assert_eq!(links[2], GpuLink::PcieStaged, "unknown path");
        let net = TransportPolicy {
            forced: Some(braid_core::topo::TransportKind::Socket),
            ..TransportPolicy::default()
        };
        let e = device_links(&cluster, &net, &bus, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("only socket between ranks 0 and 1"), "{e}");
    }

    /// Without CUDA every rank of a communicator gets "CUDA unavailable"
    /// naming a rank, promptly and without a panic. (Skipped where CUDA
    /// works: ranks that are threads of one process cannot open each
    /// other's IPC handles.)
    #[test]
    fn every_rank_reports_cuda_unavailable() {
        if braid_cuda::probe().is_ok() {
            eprintln!("skipped: CUDA is available here");
            return;
        }
        let cfg = crate::Config {
            timeout: Duration::from_secs(20),
            abort: None,
        };
        let comms = Communicator::init_threads(3, &cfg).expect("host communicator");
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| std::thread::spawn(move || CudaComm::new(&c).map(|_| ())))
            .collect();
        for h in hs {
            let e = h.join().expect("no panic").expect_err("no CUDA here");
            let s = e.to_string();
            assert!(
                s.starts_with("CUDA unavailable: rank 0 cannot use CUDA: "),
                "{s}"
            );
        }
    }

    #[test]
    fn engine_choice_parses_and_rejects_garbage() {
        assert_eq!(parse_engine(None).unwrap(), None);
        assert_eq!(parse_engine(Some(" Auto ".into())).unwrap(), None);
        assert_eq!(parse_engine(Some("stream".into())).unwrap(), Some(true));
        assert_eq!(parse_engine(Some("PROXY".into())).unwrap(), Some(false));
        let e = parse_engine(Some("gpu".into())).unwrap_err().to_string();
        assert!(
            e.contains("BRAID_CUDA_ENGINE=gpu") && e.contains("stream, proxy"),
            "{e}"
        );
    }
}

//! The communicator: what it holds and the path every operation takes.
//!
//! - [`config`]: the options of communicator creation.
//! - [`create`]: creation (rendezvous, topology, transport choice, links).
//! - [`tuning`]: defaults read from the host (`/sys`: CPU sharing, huge
//!   pages, caches) and their `BRAID_*` overrides.
//! - [`links`]: the peer descriptions and the two-phase link set-up shared
//!   with the device communicator.
//! - [`connect`]: links on demand (those of the default collectives at
//!   creation, the others on first use; `BRAID_CONNECT`).
//! - [`ops`]: the typed collective API and its argument checks.
//! - [`exchange`]: Gather, Scatter and AllToAllv, run as one group of
//!   point-to-point operations each.
//! - [`p2p`]: tagged point-to-point messages ([`Mailbox`]: matched by
//!   source and tag, received from any source).

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
use tracing::{debug, info, info_span, warn};

use crate::bootstrap::{
    create_unique_id, create_unique_id_with_timeout, Bootstrap, RootServer, UniqueId,
};
use crate::engine::host::{self, Exec};
use crate::engine::{Channels, RawBuf, WaitPolicy};
use crate::error::{Error, Result};
use crate::fingerprint::Headers;
use crate::launch::{timeout_from_env, LaunchInfo};
use crate::oplock::{OpGuard, OpLock};
use crate::progress::{self, Progress, Snapshot};
use crate::settings::Settings;
use crate::slot_stores::SlotStores;
use crate::topology;
use crate::transports::TransportTable;

mod algo;
mod config;
mod connect;
mod create;
mod elastic;
mod exchange;
pub(crate) mod links;
mod ops;
mod p2p;
mod revoke;
mod run;
mod tuning;

pub use config::Config;
pub(crate) use connect::{ConnectMode, ENV_CONNECT};
pub(crate) use elastic::REVOKED;
pub use exchange::Blocks;
pub(crate) use links::LinkSetup;
use links::*;
use ops::raw_bytes;
pub use ops::Group;
pub use p2p::{MailBatch, Mailbox};
use run::*;
use tuning::*;

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
    /// The ranks of this host that share CPUs with this one, and those
    /// CPUs ([`cpu_share`]); more ranks than CPUs: waits yield.
    cpu_share: CpuShare,
    direct_min: usize,
    /// Collectives whose buffers (this rank's, all together) take at least
    /// this many bytes copy with streaming stores (`braid_core::copy`).
    stream_min: usize,
    check_headers: bool,
    policy: WaitPolicy,
    abort: Arc<AtomicBool>,
    /// Why `abort` was set (first reason wins): the caller, or a revocation.
    abort_why: std::sync::OnceLock<String>,
    /// The rendezvous secret: proves revocation notices.
    secret: [u8; 16],
    /// Where this rank hears revocations (`None` if it could not listen).
    door: Option<revoke::Door>,
    /// Every rank's door, once known (after creation's last round).
    doors: std::sync::OnceLock<Vec<Option<SocketAddr>>>,
    /// The rendezvous [`Communicator::grow_id`] made, until the grow.
    grow_root: Mutex<Option<(UniqueId, RootServer)>>,
    /// Shrinks and grows so far (their bootstrap tags).
    repairs: std::sync::atomic::AtomicU64,
    state: OpLock<State>,
    bootstrap: Mutex<Bootstrap>,
    transports: Vec<&'static str>,
    topo_plan: braid_core::topo::Plan,
    /// `BRAID_ALGO`, the rules file and the job's shape for the tuner.
    algos: algo::Algos,
    /// The fused topology of every rank (without GPUs) and the transport
    /// policy it was planned under, for device communicators.
    topo_cluster: braid_core::topo::Cluster,
    transport_policy: TransportPolicy,
    progress: Arc<Progress>,
    /// Communicators split from this one ([`Communicator::abort_with_splits`]).
    children: Mutex<Vec<std::sync::Weak<Shared>>>,
    /// The `BRAID_*` settings it was created with.
    settings: Settings,
    _root: Option<RootServer>,
}

/// How pure data movement runs, decided once the first links are connected
/// (until then, through slots in pieces of `Shared::piece`).
#[derive(Clone, Copy, Debug)]
struct Moves {
    /// The piece of single-copy data movement.
    piece: usize,
    /// Every link passes references: single-copy AllGather and Broadcast
    /// on more than two ranks read each block from its owner
    /// ([`PlanParams::direct_moves`]). `BRAID_DIRECT_MOVES=0` keeps the ring.
    direct: bool,
    /// Pieces of single-copy operations from this size go by reference
    /// (the same on every rank: [`tuning::agree_copy`]).
    direct_min: usize,
    /// Collectives whose largest buffer reaches this may move data
    /// single-copy ([`single_copy_threshold`]; the same on every rank).
    single_copy_min: usize,
}

impl Shared {
    fn abort(&self, why: &str) {
        let _ = self.abort_why.set(why.to_string());
        self.abort.store(true, Ordering::SeqCst);
        if let Some(Ok(mut st)) = self.state.try_lock() {
            st.broken.get_or_insert_with(|| why.into());
            st.chans.abort_all(why);
        }
    }
}

impl Shared {
    /// Why this communicator was aborted, if it was.
    fn aborted_why(&self) -> Option<String> {
        if !self.abort.load(Ordering::SeqCst) {
            return None;
        }
        Some(
            self.abort_why
                .get()
                .cloned()
                .unwrap_or_else(|| "aborted by the caller".into()),
        )
    }

    /// A revocation learned from an operation's failure (a peer's abort
    /// naming it): marks this communicator revoked, as the revoker's notice
    /// does, without touching the links (the failing operation aborts
    /// them).
    fn revoked_here(&self, why: &str) {
        let _ = self.abort_why.set(why.to_string());
        self.abort.store(true, Ordering::SeqCst);
    }

    /// A notice from rank `from` that it revoked this communicator.
    fn revoked_by(&self, from: u32, reason: &str) {
        if from < self.nranks && from != self.rank && reason.contains(elastic::REVOKED) {
            info!(rank = self.rank, from, "braid: revoked by another rank");
            self.abort(reason);
        }
    }

    /// An operation's failure, with a local abort's reason in place of the
    /// engine's generic "aborted": the caller's, or a revocation's.
    fn failure_cause(&self, source: CoreError) -> CoreError {
        match (&source, self.abort_why.get()) {
            (CoreError::Aborted(_), Some(why)) => CoreError::Aborted(why.clone()),
            _ => source,
        }
    }
}

#[derive(Debug)]
struct State {
    chans: Channels,
    /// Pieces and reads of pure data movement.
    moves: Moves,
    /// What connects the links not connected yet.
    links: connect::Connector,
    seq: u64,
    /// Collectives issued so far (the header sequence number).
    coll_seq: u64,
    /// Point-to-point transfers to / from each peer so far.
    p2p_send_seq: Vec<u64>,
    p2p_recv_seq: Vec<u64>,
    /// Reused per operation (no allocation on the hot path).
    headers: Headers,
    header_flags: crate::engine::host::HeaderFlags,
    /// Per peer: ordinary or streaming stores into its slots.
    slot_stores: SlotStores,
    broken: Option<String>,
    cache: HashMap<(Collective, DataType), Planned>,
    /// The last collective run and its plan: a loop of the same call skips
    /// hashing.
    last: Option<(Collective, DataType, Planned)>,
    /// The tuner's measured link costs.
    tune: algo::TuneState,
    /// Scratch memory of plans that keep partial results (`plan::SCRATCH`).
    plan_scratch: Vec<u64>,
}

/// The largest buffer from which `coll` moves its data single-copy on
/// `nranks` ranks. Collectives that reduce: `single_copy_min`, since a
/// single-copy read only moves the receiver's copy out of the slots there
/// and slots stay in cache. Collectives that only move data (Broadcast,
/// AllGather, AllToAll) pay two copies through slots and one single-copy,
/// so they go single-copy once each rank's share reaches `direct_min` (the
/// size a piece must have to go by reference), or from `single_copy_min`
/// if that is smaller. 2 ranks, this VM, buffers on 4 KiB pages:
/// AllGather 256 KiB 13-14 µs single-copy against 20-23 through slots,
/// Broadcast 1 MiB 66-86 against 99-132; with one busy process per core
/// and buffers on huge pages, AllGather 128 KiB 5.9 against 34 µs.
fn single_copy_threshold(
    coll: &Collective,
    nranks: u32,
    single_copy_min: usize,
    direct_min: usize,
) -> usize {
    if coll.red_op().is_some() {
        single_copy_min
    } else {
        single_copy_min.min((nranks as usize).saturating_mul(direct_min))
    }
}

/// Plan parameters other than the piece size, for the device engines.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PlanKnobs {
    /// How waits spin, sleep and time out.
    pub wait: WaitPolicy,
    /// Up to this many bytes an AllReduce runs recursive doubling.
    pub small_allreduce_bytes: usize,
}

impl Communicator {
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
    /// rank's CPU affinity). Then a waiting rank sleeps at once
    /// instead of spinning first (`BRAID_SPIN` overrides either way).
    pub fn oversubscribed(&self) -> bool {
        self.shared.cpu_share.oversubscribed()
    }

    /// The ranks of this host that may run on this rank's CPUs (itself
    /// included; ranks whose CPU affinities overlap, directly or through
    /// another such rank) and how many CPUs they have together, decided at
    /// creation. Two unbound ranks on a 2-CPU host: `(2, 2)`; two ranks
    /// bound one per core: `(1, 1)` each. A program that runs more threads
    /// per rank than `cpus / ranks` (torch's intra-op threads, OpenMP)
    /// oversubscribes those CPUs.
    pub fn cpu_share(&self) -> (u32, u32) {
        let s = self.shared.cpu_share;
        (s.ranks, s.cpus)
    }

    /// What this communicator is doing now: the running operation and the
    /// peer it waits for, if any (see [`crate::dump_pending`] for every
    /// communicator of the process).
    pub fn pending(&self) -> Snapshot {
        self.shared.progress.snapshot()
    }

    /// The network port this rank leaves and enters its host by (the one
    /// nearest its GPU, the first when it uses several), as the topology
    /// names it (`mlx5_0`, `eth0`, ...); `None` when it has none.
    pub fn nic(&self) -> Option<&str> {
        let plan = &self.shared.topo_plan;
        plan.nearest_nic.get(self.shared.rank as usize)?.as_deref()
    }

    /// The fused topology (ranks placed without GPUs) and the environment's
    /// transport policy, for a device communicator to plan its GPU links.
    /// The `BRAID_*` settings this communicator was created with.
    pub(crate) fn settings(&self) -> &Settings {
        &self.shared.settings
    }

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
        let boot = self.boot()?;
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
        let child = Self::init_inner(
            &id,
            new_rank,
            members.len() as u32,
            &config,
            root,
            self.shared.settings.clone(),
            None,
        )?;
        if let Ok(mut kids) = sh.children.lock() {
            kids.retain(|w| w.strong_count() > 0);
            kids.push(Arc::downgrade(&child.shared));
        }
        Ok(Some(child))
    }

    /// The error that broke this communicator, if any (like
    /// `ncclCommGetAsyncError`).
    pub fn async_error(&self) -> Option<String> {
        if let Some(why) = self.shared.aborted_why() {
            return Some(why);
        }
        self.lock().ok().and_then(|st| st.broken.clone())
    }

    /// Every rank contributes `data` through the bootstrap; all get all
    /// contributions in rank order (set-up of device communicators).
    pub(crate) fn allgather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.boot()?.allgather(data)
    }

    /// Plan parameters other than the piece size.
    pub(crate) fn plan_knobs(&self) -> PlanKnobs {
        PlanKnobs {
            wait: self.shared.policy,
            small_allreduce_bytes: self.shared.small_allreduce,
        }
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
        self.run_coll_bytes(&Collective::Barrier, DataType::U8, &send, &mut recv)
    }

    /// The bootstrap (its rounds and point-to-point exchanges).
    fn boot(&self) -> Result<std::sync::MutexGuard<'_, Bootstrap>> {
        self.shared
            .bootstrap
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked while holding the bootstrap".into()))
    }

    fn lock(&self) -> Result<OpGuard<'_, State>> {
        self.shared
            .state
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked inside an operation".into()))
    }

    /// Run a collective described by `coll` on byte buffers holding elements
    /// of `dt` (the untyped API, like NCCL's `void*` + datatype). Buffer sizes
    /// follow [`crate::Collective::buffer_counts`]; on non-root ranks a Broadcast's
    /// `send` and a Reduce's `recv` are not used and may be empty.
    pub fn run_bytes(
        &self,
        coll: &crate::Collective,
        dt: DataType,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<()> {
        self.run_coll_bytes(&coll.plan(), dt, send, recv)
    }

    /// [`Communicator::run_bytes`] with the planner's description.
    pub(super) fn run_coll_bytes(
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
    /// ReduceScatter leaves this rank's result in block `rank` of `buf`;
    /// AllToAll sends the blocks of `buf` and replaces them with the blocks
    /// received (braid copies the send side first).
    pub fn run_bytes_in_place(
        &self,
        coll: &crate::Collective,
        dt: DataType,
        buf: &mut [u8],
    ) -> Result<()> {
        self.run_coll_bytes_in_place(&coll.plan(), dt, buf)
    }

    /// [`Communicator::run_bytes_in_place`] with the planner's description.
    pub(super) fn run_coll_bytes_in_place(
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
            Collective::AllToAll { .. } => {
                // Blocks land before others are read: the send side is a
                // copy (8-byte aligned, as every datatype needs).
                self.check_buf(coll, "buffer", b, counts[1], dt)?;
                let mut words = vec![0u64; buf.len().div_ceil(8)];
                let copy = &mut ops::bytes_mut(&mut words)[..buf.len()];
                copy.copy_from_slice(buf);
                return self.run(coll.clone(), dt, &[raw_bytes(copy), b]);
            }
            Collective::Group(_) => {
                return Err(Error::InvalidArgument(format!(
                    "{} has no in-place form: pass separate send and receive buffers",
                    coll.name()
                )))
            }
        };
        self.run(coll.clone(), dt, &bufs)
    }
}

/// The rendezvous payloads' decoders over plain bytes, for the fuzz targets
/// in `fuzz/`. Not part of the API.
#[cfg(feature = "internals")]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Data movement goes single-copy once each rank's share reaches the
    /// by-reference size; reductions keep the single-copy threshold.
    #[test]
    fn moves_go_single_copy_sooner_than_reductions() {
        let (eight_mib, direct) = (8 << 20, 64 << 10);
        let t = |c: &Collective, p| single_copy_threshold(c, p, eight_mib, direct);
        let gather = Collective::AllGather { send_count: 1 };
        let bcast = Collective::Broadcast { count: 1, root: 0 };
        let reduce = Collective::AllReduce {
            count: 1,
            op: RedOp::Sum,
        };
        assert_eq!(t(&gather, 2), 128 << 10);
        assert_eq!(t(&bcast, 4), 256 << 10);
        assert_eq!(t(&reduce, 2), eight_mib);
        // Capped by the single-copy threshold (many ranks; huge pages).
        assert_eq!(t(&gather, 1024), eight_mib);
        assert_eq!(
            single_copy_threshold(&bcast, 2, 512 << 10, 1 << 20),
            512 << 10
        );
    }
}

//! The planner: transports per rank pair and ring orders, as pure functions of
//! the fused topology of all ranks.
//!
//! Per pair, best first: inside a host NVLink (GPUs joined by NVLink, directly
//! or through NVSwitch), PCIe P2P (GPUs whose PCIe path is no worse than the
//! P2P level, PXB by default: never through the CPU), shared memory, then the
//! network transports (only when forced or the others are disabled); across
//! hosts RDMA (`ib`, InfiniBand or RoCE, when both hosts have an active RDMA
//! port) and sockets. `BRAID_TRANSPORT=<name>` forces one transport (an error
//! where it cannot connect a pair), `BRAID_<NAME>_DISABLE=1` removes one and
//! `BRAID_P2P_LEVEL` moves the PCIe P2P cut-off (as `NCCL_P2P_LEVEL`).
//!
//! Rings: inside a host, the order of its ranks that maximises the narrowest
//! link, then minimises the worst path type, then maximises the total
//! bandwidth (exhaustive up to 9 ranks a host, greedy beyond), which keeps
//! NVLink neighbours adjacent. Across hosts each channel enters a host at the
//! rank nearest to that channel's NIC (rails in turn) and leaves it from the
//! last rank of the host's path through the NIC nearest that rank's GPU.
//! Channels: across hosts one per NIC rail (the fewest over the hosts); inside
//! one host one per 12 GB/s of the ring's narrowest GPU link, at most 16 (1
//! for rings through host memory).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::graph::{PathType, Topology, LOC_BW};
use super::TopoError;
use crate::config;
use crate::transport::TransportKind;

/// What the environment allows: parsed once, here, for host and device
/// communicators alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportPolicy {
    /// `BRAID_TRANSPORT`: use only this one.
    pub forced: Option<TransportKind>,
    /// `BRAID_<NAME>_DISABLE` (and `BRAID_P2P_DISABLE`, which removes
    /// nvlink and pcie peer-to-peer).
    pub disabled: BTreeSet<TransportKind>,
    /// `BRAID_P2P_LEVEL`: the worst path between two GPUs that peer-to-peer
    /// (NVLink or PCIe) may take (default PXB: never through a CPU).
    pub p2p_level: PathType,
}

impl Default for TransportPolicy {
    fn default() -> Self {
        TransportPolicy {
            forced: None,
            disabled: BTreeSet::new(),
            p2p_level: PathType::Pxb,
        }
    }
}

impl TransportPolicy {
    /// Read `BRAID_TRANSPORT`, `BRAID_<NAME>_DISABLE`, `BRAID_P2P_DISABLE`
    /// and `BRAID_P2P_LEVEL` through `env` (e.g. [`config::process_env`]).
    /// A value braid cannot use is an error naming the variable.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, TopoError> {
        let bad = |e: config::ConfigError| TopoError::Invalid(e.to_string());
        let mut p = TransportPolicy::default();
        if let Some(v) = config::value(env, "BRAID_TRANSPORT") {
            p.forced =
                Some(v.parse().map_err(|e: String| {
                    bad(config::ConfigError::new("BRAID_TRANSPORT", &v, e))
                })?);
        }
        for t in TransportKind::ALL {
            if config::flag(env, &t.disable_var(), false).map_err(bad)? {
                p.disabled.insert(t);
            }
        }
        if config::flag(env, "BRAID_P2P_DISABLE", false).map_err(bad)? {
            p.disabled.insert(TransportKind::Nvlink);
            p.disabled.insert(TransportKind::Pcie);
        }
        if let Some(v) = config::value(env, "BRAID_P2P_LEVEL") {
            let expected = "use LOC, NVL, NVB, PIX, PXB, PHB or SYS (or NCCL's numbers 0-4)";
            let level: PathType = v.parse().map_err(|e: String| {
                bad(config::ConfigError::new(
                    "BRAID_P2P_LEVEL",
                    &v,
                    format!("{e}; {expected}"),
                ))
            })?;
            if level > PathType::Sys {
                return Err(bad(config::ConfigError::new(
                    "BRAID_P2P_LEVEL",
                    &v,
                    "peer-to-peer never crosses the network; use at most SYS",
                )));
            }
            p.p2p_level = level;
        }
        Ok(p)
    }
}

/// One host of the fused topology.
#[derive(Clone, Debug)]
pub struct Host {
    pub name: String,
    pub topo: Topology,
}

/// Where a rank runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlace {
    /// Index into [`Cluster::hosts`].
    pub host: usize,
    /// Bus id of the rank's GPU; None for a CPU-only rank.
    pub gpu: Option<String>,
    /// NUMA node a CPU-only rank is bound to (first node when None).
    pub numa: Option<i32>,
}

/// The fused topology of all ranks.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub hosts: Vec<Host>,
    pub ranks: Vec<RankPlace>,
}

impl Cluster {
    /// `nranks` ranks spread over `nhosts` copies of one host (ranks in blocks:
    /// host 0 gets the first ranks), each rank on the next GPU of its host, or
    /// CPU-only ranks spread over the NUMA nodes when the host has no GPU.
    pub fn uniform(
        topo: &Topology,
        name: &str,
        nranks: usize,
        nhosts: usize,
    ) -> Result<Cluster, TopoError> {
        if nranks == 0 || nhosts == 0 || nhosts > nranks {
            return Err(TopoError::Invalid(format!(
                "cannot place {nranks} ranks on {nhosts} hosts (need 1 ≤ hosts ≤ ranks)"
            )));
        }
        let per = nranks.div_ceil(nhosts);
        let gpus: Vec<String> = topo
            .gpus
            .iter()
            .map(|&g| topo.nodes[g].id.clone())
            .collect();
        let numas: Vec<i32> = topo.system.cpus.iter().map(|c| c.numaid).collect();
        let hosts = (0..nhosts)
            .map(|h| Host {
                name: if nhosts == 1 {
                    name.to_string()
                } else {
                    format!("{name}#{h}")
                },
                topo: topo.clone(),
            })
            .collect();
        let mut ranks = Vec::new();
        for r in 0..nranks {
            let h = (r / per).min(nhosts - 1);
            let local = r - h * per;
            ranks.push(RankPlace {
                host: h,
                gpu: (!gpus.is_empty()).then(|| gpus[local % gpus.len()].clone()),
                numa: if gpus.is_empty() && !numas.is_empty() {
                    Some(numas[local % numas.len()])
                } else {
                    None
                },
            });
        }
        Ok(Cluster { hosts, ranks })
    }
}

/// One step of a ring.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hop {
    pub from: u32,
    pub to: u32,
    pub transport: TransportKind,
    /// Path class between the two ends (NET across hosts).
    pub path: PathType,
    /// Bottleneck GB/s of the hop.
    pub bw: f64,
    /// Across hosts: the port the sender leaves through.
    pub nic_out: Option<String>,
    /// Across hosts: the port the receiver comes in through.
    pub nic_in: Option<String>,
}

/// One channel's ring.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ring {
    pub order: Vec<u32>,
    pub hops: Vec<Hop>,
}

impl Ring {
    /// The narrowest hop, GB/s.
    pub fn bottleneck(&self) -> f64 {
        self.hops.iter().map(|h| h.bw).fold(f64::INFINITY, f64::min)
    }
}

/// The transports and rings for a communicator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// `transports[a][b]`: how rank a talks to rank b (None on the diagonal).
    pub transports: Vec<Vec<Option<TransportKind>>>,
    /// One ring per channel.
    pub rings: Vec<Ring>,
    /// Per rank: the port it uses to leave / enter its host (nearest its GPU).
    pub nearest_nic: Vec<Option<String>>,
    /// What the planner assumed where the inputs were incomplete (a GPU
    /// missing from its host's model, say), for the log.
    #[serde(default)]
    pub notes: Vec<String>,
}

/// How the device engines of two GPU ranks of one host move data: the
/// device side of the planner's transport for the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuLink {
    /// CUDA IPC into the peer's GPU memory over NVLink (or one shared GPU):
    /// `braid-transport-nvlink`.
    Nvlink,
    /// CUDA IPC over PCIe peer-to-peer: `braid-transport-pcie`.
    PcieP2p,
    /// Staged through pinned shared host memory (where the planner chose
    /// shared memory for the pair): `braid-transport-pcie`.
    PcieStaged,
}

impl GpuLink {
    /// The transport that serves the link.
    pub fn transport(self) -> TransportKind {
        match self {
            GpuLink::Nvlink => TransportKind::Nvlink,
            GpuLink::PcieP2p | GpuLink::PcieStaged => TransportKind::Pcie,
        }
    }

    /// Short description for logs.
    pub fn describe(self) -> &'static str {
        match self {
            GpuLink::Nvlink => "nvlink (CUDA IPC)",
            GpuLink::PcieP2p => "pcie (CUDA IPC, P2P)",
            GpuLink::PcieStaged => "pcie (staged through host memory)",
        }
    }
}

impl Plan {
    /// The device link between GPU ranks `a` and `b`: NVLink and PCIe as
    /// planned, shared memory as PCIe staged through host memory; `None` for
    /// a network transport (the ranks are on different hosts, or only a
    /// network transport was allowed) or `a == b`.
    pub fn gpu_link(&self, a: usize, b: usize) -> Option<GpuLink> {
        match self.transports.get(a)?.get(b).copied().flatten()? {
            TransportKind::Nvlink => Some(GpuLink::Nvlink),
            TransportKind::Pcie => Some(GpuLink::PcieP2p),
            TransportKind::Shm => Some(GpuLink::PcieStaged),
            TransportKind::Ib | TransportKind::Socket => None,
        }
    }
}

struct Ctx<'a> {
    c: &'a Cluster,
    policy: &'a TransportPolicy,
    /// Per rank: GPU node (if any and in the host's model) and CPU node.
    gpu: Vec<Option<usize>>,

    cpu: Vec<usize>,
    near_rdma: Vec<Option<usize>>,
    near_any: Vec<Option<usize>>,
}

impl Ctx<'_> {
    fn topo(&self, r: usize) -> &Topology {
        &self.c.hosts[self.c.ranks[r].host].topo
    }
    /// Whether ranks `a` and `b` (of one host) use the same GPU.
    fn same_gpu(&self, a: usize, b: usize) -> bool {
        let (ra, rb) = (&self.c.ranks[a], &self.c.ranks[b]);
        match (&ra.gpu, &rb.gpu) {
            (Some(x), Some(y)) => ra.host == rb.host && x.eq_ignore_ascii_case(y),
            _ => false,
        }
    }
    fn host_has_rdma(&self, r: usize) -> bool {
        self.near_rdma[r].is_some_and(|n| {
            let t = self.topo(r);
            let i = t.nets.iter().position(|&x| x == n);
            i.and_then(|i| t.system.nets().get(i).map(|x| x.net.is_up()))
                .unwrap_or(false)
        })
    }
    /// (path type, GB/s) between two ranks of one host over `t`.
    fn link(&self, a: usize, b: usize, t: TransportKind) -> (PathType, f64) {
        let topo = self.topo(a);
        if t == TransportKind::Nvlink && self.same_gpu(a, b) {
            return (PathType::Loc, LOC_BW);
        }
        match (t, self.gpu[a], self.gpu[b]) {
            (TransportKind::Nvlink, Some(x), Some(y)) => topo
                .path(x, y)
                .map_or((PathType::Dis, 0.0), |p| (p.kind, p.bw)),
            (TransportKind::Pcie, Some(x), Some(y)) => topo
                .pci_path(x, y)
                .map_or((PathType::Dis, 0.0), |p| (p.kind, p.bw)),
            _ => {
                // Through host memory: each end to its CPU, and between the CPUs.
                let mut kind = if self.cpu[a] == self.cpu[b] {
                    PathType::Loc
                } else {
                    PathType::Sys
                };
                let mut bw = if self.cpu[a] == self.cpu[b] {
                    LOC_BW
                } else {
                    topo.path(self.cpu[a], self.cpu[b]).map_or(0.0, |p| p.bw)
                };
                for (g, c) in [(self.gpu[a], self.cpu[a]), (self.gpu[b], self.cpu[b])] {
                    if let Some(p) = g.and_then(|g| topo.pci_path(g, c)) {
                        kind = kind.max(p.kind);
                        bw = bw.min(p.bw);
                    }
                }
                (kind, bw)
            }
        }
    }
    fn choose(&self, a: usize, b: usize) -> Result<TransportKind, TopoError> {
        let (ra, rb) = (&self.c.ranks[a], &self.c.ranks[b]);
        let mut cands = Vec::new();
        if ra.host == rb.host {
            let topo = self.topo(a);
            let level = self.policy.p2p_level;
            if self.same_gpu(a, b) {
                // Ranks sharing one GPU share its memory through CUDA IPC,
                // whatever the P2P level (NCCL's LOC level means no P2P
                // between different GPUs).
                cands.push(TransportKind::Nvlink);
            } else if let (Some(x), Some(y)) = (self.gpu[a], self.gpu[b]) {
                // The P2P level bounds NVLink paths too (NVL: NVLink only).
                if topo
                    .path(x, y)
                    .is_some_and(|p| p.kind <= PathType::Nvb && p.kind <= level)
                {
                    cands.push(TransportKind::Nvlink);
                }
                if topo.pci_path(x, y).is_some_and(|p| p.kind <= level) {
                    cands.push(TransportKind::Pcie);
                }
            }
            cands.push(TransportKind::Shm);
        }
        // Network transports connect any two ranks, on one host too (after
        // the host-local ones: used there only when forced or when those are
        // disabled, as NCCL falls back to NET inside a node).
        // Forced IB is tried even where the model shows no RDMA port (the
        // transport's own probe found one, or it would not be in the table;
        // virtual devices such as Soft-RoCE may have no PCI parent).
        if (self.host_has_rdma(a) && self.host_has_rdma(b))
            || self.policy.forced == Some(TransportKind::Ib)
        {
            cands.push(TransportKind::Ib);
        }
        cands.push(TransportKind::Socket);
        let what = || {
            format!(
                "ranks {a} ({}) and {b} ({})",
                self.c.hosts[ra.host].name, self.c.hosts[rb.host].name
            )
        };
        if let Some(f) = self.policy.forced {
            return if cands.contains(&f) {
                Ok(f)
            } else {
                Err(TopoError::Invalid(format!(
                    "BRAID_TRANSPORT={f} cannot connect {}: possible here: {}",
                    what(),
                    names(&cands)
                )))
            };
        }
        cands
            .iter()
            .copied()
            .find(|t| !self.policy.disabled.contains(t))
            .ok_or_else(|| {
                TopoError::Invalid(format!(
                    "every transport that can connect {} is disabled ({}); unset one of the BRAID_*_DISABLE variables",
                    what(),
                    names(&cands)
                ))
            })
    }
}

fn names(ts: &[TransportKind]) -> String {
    ts.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

/// Plan transports and rings for the ranks of `c` under `policy`.
pub fn plan(c: &Cluster, policy: &TransportPolicy) -> Result<Plan, TopoError> {
    let n = c.ranks.len();
    if n == 0 {
        return Err(TopoError::Invalid("no ranks to plan for".into()));
    }
    let mut gpu = Vec::with_capacity(n);
    let mut notes = Vec::new();
    let mut cpu = Vec::with_capacity(n);
    for (r, p) in c.ranks.iter().enumerate() {
        let host = c.hosts.get(p.host).ok_or_else(|| {
            TopoError::Invalid(format!(
                "rank {r} is on host {} but there are {} hosts",
                p.host,
                c.hosts.len()
            ))
        })?;
        let t = &host.topo;
        let g = p.gpu.as_deref().and_then(|b| t.gpu_by_busid(b));
        if let (Some(b), None) = (&p.gpu, g) {
            // Not in the model (a topology file without it, or detection
            // that failed): nothing is known of its paths, so it gets no
            // peer-to-peer except with ranks on the same GPU.
            notes.push(format!(
                "rank {r}: GPU {b} is not in the model of host {}; assuming no peer-to-peer path to other GPUs",
                host.name
            ));
        }

        let cn = match (g, p.numa) {
            (Some(g), _) => t.cpu_of(g),
            (None, Some(numa)) => t.cpus.iter().copied().find(|&x| t.nodes[x].numaid == numa),
            (None, None) => t.cpus.first().copied(),
        }
        .ok_or_else(|| {
            TopoError::Invalid(format!(
                "rank {r}: host {} has no NUMA node for it",
                host.name
            ))
        })?;
        gpu.push(g);
        cpu.push(cn);
    }
    let near_rdma = (0..n)
        .map(|r| {
            c.hosts[c.ranks[r].host]
                .topo
                .nearest_net(gpu[r].unwrap_or(cpu[r]), true)
        })
        .collect();
    let near_any = (0..n)
        .map(|r| {
            c.hosts[c.ranks[r].host]
                .topo
                .nearest_net(gpu[r].unwrap_or(cpu[r]), false)
        })
        .collect();
    let cx = Ctx {
        c,
        policy,
        gpu,
        cpu,
        near_rdma,
        near_any,
    };
    let mut transports = vec![vec![None; n]; n];
    for (a, row) in transports.iter_mut().enumerate() {
        for (b, slot) in row.iter_mut().enumerate() {
            if a != b {
                *slot = Some(cx.choose(a, b)?);
            }
        }
    }
    let nearest_nic: Vec<Option<String>> = (0..n)
        .map(|r| {
            let ib = transports[r].contains(&Some(TransportKind::Ib));
            let net = if ib { cx.near_rdma[r] } else { cx.near_any[r] };
            net.map(|x| cx.topo(r).nodes[x].id.clone())
        })
        .collect();

    // Hosts in order of their first rank.
    let mut hosts: Vec<usize> = Vec::new();
    for p in &c.ranks {
        if !hosts.contains(&p.host) {
            hosts.push(p.host);
        }
    }
    let members = |h: usize| -> Vec<usize> { (0..n).filter(|&r| c.ranks[r].host == h).collect() };
    let mut rings = Vec::new();
    if hosts.len() == 1 {
        let rs = members(hosts[0]);
        let order = best_order(&cx, &transports, &rs, None, true, &|_| 0);
        let ring = make_ring(&cx, &transports, &order, &nearest_nic);
        let all_gpu_links = ring
            .hops
            .iter()
            .all(|h| matches!(h.transport, TransportKind::Nvlink | TransportKind::Pcie));
        let nch = if all_gpu_links && n > 1 {
            ((ring.bottleneck() / 12.0).floor() as usize).clamp(1, 16)
        } else {
            1
        };
        rings = vec![ring; nch];
    } else {
        // Rails: per host, the distinct nearest NICs of its ranks.
        let rails: Vec<Vec<Option<String>>> = hosts
            .iter()
            .map(|&h| {
                let mut v: Vec<Option<String>> = Vec::new();
                for r in members(h) {
                    if !v.contains(&nearest_nic[r]) {
                        v.push(nearest_nic[r].clone());
                    }
                }
                v
            })
            .collect();
        let nch = rails.iter().map(Vec::len).min().unwrap_or(1).max(1);
        for ch in 0..nch {
            let mut order = Vec::new();
            for (hi, &h) in hosts.iter().enumerate() {
                let rs = members(h);
                let rail = &rails[hi][ch % rails[hi].len()];
                let next_rail = &rails[hi][(ch + 1) % rails[hi].len()];
                let entry = rs
                    .iter()
                    .copied()
                    .find(|&r| &nearest_nic[r] == rail)
                    .unwrap_or(rs[0]);
                let exit_pref = |last: usize| -> u8 {
                    if last != entry && &nearest_nic[last] == rail {
                        0
                    } else if &nearest_nic[last] == next_rail {
                        1
                    } else {
                        2
                    }
                };
                order.extend(best_order(
                    &cx,
                    &transports,
                    &rs,
                    Some(entry),
                    false,
                    &exit_pref,
                ));
            }
            rings.push(make_ring(&cx, &transports, &order, &nearest_nic));
        }
    }
    Ok(Plan {
        transports,
        rings,
        nearest_nic,
        notes,
    })
}

fn make_ring(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    order: &[usize],
    nearest_nic: &[Option<String>],
) -> Ring {
    let n = order.len();
    let mut hops = Vec::new();
    if n > 1 {
        for i in 0..n {
            let (a, b) = (order[i], order[(i + 1) % n]);
            let t = transports[a][b].unwrap_or(TransportKind::Shm);
            let (path, bw, nic_out, nic_in) =
                if matches!(t, TransportKind::Ib | TransportKind::Socket) {
                    let bw_of = |r: usize, nic: &Option<String>| {
                        let topo = cx.topo(r);
                        let sys_nets = topo.system.nets();
                        nic.as_ref()
                            .and_then(|name| sys_nets.iter().find(|x| &x.net.name == name))
                            .and_then(|x| x.net.bw())
                            .unwrap_or(super::graph::NET_BW_FALLBACK)
                    };
                    let bw = bw_of(a, &nearest_nic[a]).min(bw_of(b, &nearest_nic[b]));
                    (
                        PathType::Net,
                        bw,
                        nearest_nic[a].clone(),
                        nearest_nic[b].clone(),
                    )
                } else {
                    let (k, bw) = cx.link(a, b, t);
                    (k, bw, None, None)
                };
            hops.push(Hop {
                from: a as u32,
                to: b as u32,
                transport: t,
                path,
                bw,
                nic_out,
                nic_in,
            });
        }
    }
    Ring {
        order: order.iter().map(|&r| r as u32).collect(),
        hops,
    }
}

/// Score of an ordering: narrowest GB/s, worst path class, total GB/s, and
/// where the path ends (0: another rank on the entry NIC, 1: a rank on the
/// next rail, so every NIC carries one channel out and one in; 2: elsewhere).
#[derive(Clone, Copy, PartialEq)]
struct Score {
    min_bw: f64,
    worst: PathType,
    sum_bw: f64,
    exit: u8,
}

impl Score {
    fn better(&self, o: &Score) -> bool {
        const EPS: f64 = 1e-9;
        if (self.min_bw - o.min_bw).abs() > EPS {
            return self.min_bw > o.min_bw;
        }
        if self.worst != o.worst {
            return self.worst < o.worst;
        }
        if (self.sum_bw - o.sum_bw).abs() > EPS {
            return self.sum_bw > o.sum_bw;
        }
        self.exit < o.exit
    }
}

/// The best order of the ranks `rs` of one host: a cycle (`cycle`) or a path
/// from `start`.
fn best_order(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    rs: &[usize],
    start: Option<usize>,
    cycle: bool,
    exit_pref: &dyn Fn(usize) -> u8,
) -> Vec<usize> {
    let m = rs.len();
    if m <= 1 {
        return rs.to_vec();
    }
    let edge = |a: usize, b: usize| cx.link(a, b, transports[a][b].unwrap_or(TransportKind::Shm));
    let first = start.unwrap_or(rs[0]);
    let score = |order: &[usize]| {
        let mut s = Score {
            min_bw: f64::INFINITY,
            worst: PathType::Loc,
            sum_bw: 0.0,
            exit: exit_pref(*order.last().unwrap_or(&first)),
        };
        let k = if cycle { order.len() } else { order.len() - 1 };
        for i in 0..k {
            let (t, bw) = edge(order[i], order[(i + 1) % order.len()]);
            s.min_bw = s.min_bw.min(bw);
            s.worst = s.worst.max(t);
            s.sum_bw += bw;
        }
        s
    };
    let rest: Vec<usize> = rs.iter().copied().filter(|&r| r != first).collect();
    if m <= 9 {
        // Exhaustive, in lexicographic order so ties keep the smallest order.
        let mut best: Option<(Score, Vec<usize>)> = None;
        let mut cur = vec![first];
        let mut used = vec![false; rest.len()];
        permute(&rest, &mut used, &mut cur, &mut |o| {
            let s = score(o);
            if best.as_ref().is_none_or(|(b, _)| s.better(b)) {
                best = Some((s, o.to_vec()));
            }
        });
        return best.map(|(_, o)| o).unwrap_or_else(|| rs.to_vec());
    }
    // Greedy: always the best next neighbour.
    let mut order = vec![first];
    let mut left = rest;
    while !left.is_empty() {
        let last = *order.last().unwrap_or(&first);
        let mut bi = 0;
        for i in 1..left.len() {
            let (ti, bwi) = edge(last, left[i]);
            let (tb, bwb) = edge(last, left[bi]);
            if bwi > bwb + 1e-9 || ((bwi - bwb).abs() <= 1e-9 && ti < tb) {
                bi = i;
            }
        }
        order.push(left.remove(bi));
    }
    order
}

fn permute(rest: &[usize], used: &mut [bool], cur: &mut Vec<usize>, f: &mut impl FnMut(&[usize])) {
    if cur.len() == rest.len() + 1 {
        f(cur);
        return;
    }
    for i in 0..rest.len() {
        if !used[i] {
            used[i] = true;
            cur.push(rest[i]);
            permute(rest, used, cur, f);
            cur.pop();
            used[i] = false;
        }
    }
}

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
//! Ports: each rank uses the ports nearest its GPU as NCCL picks them
//! ([`Topology::spread_net`]): highest bandwidth, then best path class, and
//! GPUs equally near several ports (or the two ports of one NIC) share them
//! out, so that all of them carry traffic.
//!
//! Rings: inside a host, the order of its ranks that maximises the narrowest
//! link, then minimises the worst path type, then maximises the total
//! bandwidth (exhaustive up to 9 ranks a host, greedy beyond), which keeps
//! NVLink neighbours adjacent. Across hosts, one channel per rail (a port
//! index, NCCL's `dev`, or the `rail` attribute when the model has one):
//! channel k enters every host at a rank using the port of rail k and
//! leaves it through the port of rail k too, from the last rank of the
//! host's path (chosen for its path to that port: next to it, then through
//! an NVLink peer next to it, PXN), so that every hop between hosts stays on
//! one rail, as NCCL's rings do (`NCCL_CROSS_NIC`). `BRAID_CROSS_NIC`
//! (see [`CrossNic`]) allows leaving through another port. Channels: across
//! hosts one per rail common to all hosts; inside one host one per 12 GB/s
//! of the ring's narrowest GPU link, at most 16 (1 for rings through host
//! memory).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::graph::{PathType, Topology, LOC_BW, NET_BW_FALLBACK};
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
    /// `BRAID_CROSS_NIC`: whether a ring may leave a host through another
    /// port (rail) than it entered by.
    pub cross_nic: CrossNic,
}

impl Default for TransportPolicy {
    fn default() -> Self {
        TransportPolicy {
            forced: None,
            disabled: BTreeSet::new(),
            p2p_level: PathType::Pxb,
            cross_nic: CrossNic::Auto,
        }
    }
}

/// `BRAID_CROSS_NIC`, as `NCCL_CROSS_NIC`: whether the hops of a ring
/// between hosts may change rail (port index).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CrossNic {
    /// `0`: every hop between hosts stays on one rail: a ring leaves each
    /// host through the port of the rail it entered by, even when its last
    /// rank is far from that port (rail-optimised fabrics, where different
    /// rails may not even be connected).
    Never,
    /// `1`: a ring leaves each host through the port nearest its last rank,
    /// whatever the rail.
    Allow,
    /// `2` (default): like `0`, except where the port of the rail is slower
    /// to reach from the last rank than that rank's own port: then that hop
    /// changes rail (and the plan's notes say where and why).
    #[default]
    Auto,
}

impl CrossNic {
    /// The number `NCCL_CROSS_NIC` uses for it.
    pub fn value(self) -> u8 {
        match self {
            CrossNic::Never => 0,
            CrossNic::Allow => 1,
            CrossNic::Auto => 2,
        }
    }
}

impl TransportPolicy {
    /// Read `BRAID_TRANSPORT`, `BRAID_<NAME>_DISABLE`, `BRAID_P2P_DISABLE`,
    /// `BRAID_P2P_LEVEL` and `BRAID_CROSS_NIC` through `env` (e.g. [`config::process_env`]).
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
        if let Some(v) = config::value(env, "BRAID_CROSS_NIC") {
            p.cross_nic = match v.trim() {
                "0" => CrossNic::Never,
                "1" => CrossNic::Allow,
                "2" => CrossNic::Auto,
                _ => {
                    return Err(bad(config::ConfigError::new(
                        "BRAID_CROSS_NIC",
                        &v,
                        "use 0 (hops between hosts stay on one rail), 1 (any port) or 2 (one rail unless that is slower), as NCCL_CROSS_NIC",
                    )))
                }
            };
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
        // CPU-only ranks go to NUMA nodes that have CPUs (not to
        // memory-only nodes).
        let numas: Vec<i32> = topo.system.cpu_nodes().map(|c| c.numaid).collect();
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
    /// Across hosts: the rail of `nic_out` (the `rail` attribute, else the
    /// port's `dev`, else its place among the host's ports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_out: Option<u32>,
    /// Across hosts: the rail of `nic_in`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rail_in: Option<u32>,
    /// Across hosts: the path class from the sender's GPU (or CPU) to `nic_out`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_out: Option<PathType>,
    /// Across hosts: the path class from `nic_in` to the receiver's GPU (or CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_in: Option<PathType>,
}

impl Hop {
    /// Across hosts: whether the hop stays on one rail (None inside a host
    /// or where a port is unknown).
    pub fn same_rail(&self) -> Option<bool> {
        Some(self.rail_out? == self.rail_in?)
    }
}

/// One rail: a port index that every host (that has it) uses for the same
/// channels, so that hops between hosts connect port k to port k.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rail {
    pub id: u32,
    /// Per host (in [`Cluster::hosts`] order), its port on this rail.
    pub ports: Vec<Option<String>>,
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
    /// Per rank: the port it uses to leave / enter its host (nearest its
    /// GPU; its first one when it uses several).
    pub nearest_nic: Vec<Option<String>>,
    /// Per rank: every port it uses, in channel order (GPUs equally near
    /// several ports use them all, as NCCL shares them out).
    #[serde(default)]
    pub rank_nics: Vec<Vec<String>>,
    /// Per rank: the rail of each port of [`Plan::rank_nics`].
    #[serde(default)]
    pub rank_rails: Vec<Vec<u32>>,
    /// Per rank: its host (index into [`Cluster::hosts`]).
    #[serde(default)]
    pub rank_host: Vec<usize>,
    /// The rails of the hosts (across hosts only).
    #[serde(default)]
    pub rails: Vec<Rail>,
    /// The `BRAID_CROSS_NIC` the plan was made with.
    #[serde(default)]
    pub cross_nic: CrossNic,
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
    /// The ports a hop from rank `a` to rank `b` on another host uses on
    /// channel `channel` (for trees and other patterns than the rings): `a`
    /// leaves through its port for that channel; `b` enters through its
    /// host's port on the same rail when it has one (unless
    /// `BRAID_CROSS_NIC=1`), else through its own port. None when the ranks
    /// share a host or a port is unknown.
    pub fn net_pair(&self, a: usize, b: usize, channel: usize) -> Option<(String, String)> {
        let (ha, hb) = (*self.rank_host.get(a)?, *self.rank_host.get(b)?);
        if ha == hb {
            return None;
        }
        let pick = |r: usize| -> Option<(String, u32)> {
            let n = self.rank_nics.get(r)?;
            let i = channel % n.len().max(1);
            Some((n.get(i)?.clone(), *self.rank_rails.get(r)?.get(i)?))
        };
        let (out, rail) = pick(a)?;
        let same = (self.cross_nic != CrossNic::Allow)
            .then(|| {
                self.rails
                    .iter()
                    .find(|x| x.id == rail)
                    .and_then(|x| x.ports.get(hb).cloned().flatten())
            })
            .flatten();
        let inp = match same {
            Some(p) => p,
            None => pick(b)?.0,
        };
        Some((out, inp))
    }

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
}

impl Ctx<'_> {
    fn topo(&self, r: usize) -> &Topology {
        &self.c.hosts[self.c.ranks[r].host].topo
    }
    /// The node a rank's traffic starts from: its GPU, else its CPU.
    fn from(&self, r: usize) -> usize {
        self.gpu[r].unwrap_or(self.cpu[r])
    }
    /// Whether ranks `a` and `b` (of one host) use the same GPU.
    fn same_gpu(&self, a: usize, b: usize) -> bool {
        let (ra, rb) = (&self.c.ranks[a], &self.c.ranks[b]);
        match (&ra.gpu, &rb.gpu) {
            (Some(x), Some(y)) => ra.host == rb.host && x.eq_ignore_ascii_case(y),
            _ => false,
        }
    }
    /// Whether rank `r`'s host has an RDMA port that is up.
    fn host_has_rdma(&self, r: usize) -> bool {
        let t = self.topo(r);
        t.ports(Some(true)).is_some_and(|ports| {
            ports
                .iter()
                .any(|&n| t.net_of(n).is_some_and(|x| x.is_up()))
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

/// The ports of rank `r` (node indices of its host's topology), in channel
/// order: NCCL's spreading for a GPU; for a CPU-only rank the ports nearest
/// its NUMA node shared out among the CPU ranks of that node.
fn rank_ports(cx: &Ctx, r: usize, ports: &[usize]) -> Vec<usize> {
    let t = cx.topo(r);
    let mut out: Vec<usize> = Vec::new();
    match cx.gpu[r] {
        Some(g) => {
            let local = t.local_nets(g, ports);
            let Some(&first) = local.first() else {
                return out;
            };
            let near = t.local_gpus(first).len().max(1);
            let per = local.len().div_ceil(near).max(1);
            for ch in 0..per {
                if let Some(n) = t.spread_net(g, ports, ch) {
                    if !out.contains(&n) {
                        out.push(n);
                    }
                }
            }
        }
        None => {
            let local = t.local_nets(cx.cpu[r], ports);
            if local.is_empty() {
                return out;
            }
            let peers: Vec<usize> = (0..cx.c.ranks.len())
                .filter(|&x| {
                    cx.c.ranks[x].host == cx.c.ranks[r].host
                        && cx.gpu[x].is_none()
                        && cx.cpu[x] == cx.cpu[r]
                })
                .collect();
            let idx = peers.iter().position(|&x| x == r).unwrap_or(0);
            let per = local.len().div_ceil(peers.len().max(1)).max(1);
            for ch in 0..per {
                let n = local[(idx * per + ch) % local.len()];
                if !out.contains(&n) {
                    out.push(n);
                }
            }
        }
    }
    out
}

/// The rail of port node `net` in `topo`: its `rail` attribute, else its
/// `dev` (NCCL's device index), else its place among `ports`.
fn rail_of(topo: &Topology, ports: &[usize], net: usize) -> u32 {
    let info = topo.net_of(net);
    info.and_then(|n| n.attrs.get("rail").and_then(|r| r.trim().parse().ok()))
        .or(info.and_then(|n| n.dev))
        .unwrap_or_else(|| ports.iter().position(|&x| x == net).unwrap_or(0) as u32)
}

/// Why the ranks of a host talk socket to other hosts rather than ib, for
/// the log (NCCL logs each transport decision): once per such host, the
/// host's ports and why none is an RDMA port that is up; else, where the
/// policy ruled ib out, that.
fn why_not_ib(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    ib_allowed: bool,
    notes: &mut Vec<String>,
) {
    let c = cx.c;
    let n = c.ranks.len();
    let mut noted: Vec<usize> = Vec::new();
    let mut policy_noted = false;
    for (a, row) in transports.iter().enumerate() {
        let h = c.ranks[a].host;
        let socket_out =
            (0..n).any(|b| c.ranks[b].host != h && row[b] == Some(TransportKind::Socket));
        if !socket_out || noted.contains(&h) {
            continue;
        }
        if cx.host_has_rdma(a) {
            if !ib_allowed && !policy_noted {
                policy_noted = true;
                notes.push(
                    "socket between hosts, not ib: ib is disabled or another transport forced (BRAID_IB_DISABLE, BRAID_TRANSPORT, or ib not available on every rank)"
                        .into(),
                );
            }
            // Otherwise the host at the other end has no RDMA port: its
            // own note says why.
            continue;
        }
        noted.push(h);
        let t = cx.topo(a);
        let ports: Vec<String> = (0..t.nets.len())
            .map(|i| {
                let net = &t.net_info[i];
                let at = t
                    .nic_of_net(t.nets[i])
                    .map(|x| t.nodes[x].id.clone())
                    .filter(|id| *id != net.name)
                    .unwrap_or_else(|| "not on PCI".into());
                let why = if net.is_rdma() {
                    format!(
                        "an RDMA device, but {}",
                        net.state.as_deref().unwrap_or("down")
                    )
                } else if net.rdma == Some(false) {
                    "a kernel interface with no RDMA device".to_string()
                } else if net.port == Some(0) {
                    "no RDMA device (port 0: a socket port in NCCL's files)".to_string()
                } else {
                    "no RDMA device (no verbs device name, port or GUID)".to_string()
                };
                format!("{} ({at}): {why}", net.name)
            })
            .collect();
        let ports = if ports.is_empty() {
            "it has no network port in its model".to_string()
        } else {
            ports.join("; ")
        };
        notes.push(format!(
            "host {}: socket to other hosts, not ib: no RDMA port up: {ports}",
            c.hosts[h].name
        ));
    }
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
        // A node with CPUs: memory-only nodes get no ranks.
        let first_cpu_node = || {
            t.cpus.iter().copied().find(|&x| {
                let numa = t.nodes[x].numaid;
                t.system.cpu_nodes().any(|c| c.numaid == numa)
            })
        };
        let cn = match (g, p.numa) {
            (Some(g), _) => t.cpu_of(g),
            (None, Some(numa)) => t.cpus.iter().copied().find(|&x| t.nodes[x].numaid == numa),
            (None, None) => first_cpu_node().or(t.cpus.first().copied()),
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
    let cx = Ctx {
        c,
        policy,
        gpu,
        cpu,
    };
    let mut transports = vec![vec![None; n]; n];
    for (a, row) in transports.iter_mut().enumerate() {
        for (b, slot) in row.iter_mut().enumerate() {
            if a != b {
                *slot = Some(cx.choose(a, b)?);
            }
        }
    }
    // Ports per rank: the RDMA ports where it talks ib to another host (or,
    // with no other host, where it would: its host has an RDMA port up and
    // the policy allows ib), kernel interfaces otherwise (RDMA ports when
    // the host has no other).
    let ib_allowed = !policy.disabled.contains(&TransportKind::Ib)
        && policy.forced.is_none_or(|f| f == TransportKind::Ib);
    let kind_ports: Vec<Vec<usize>> = (0..n)
        .map(|r| {
            let t = cx.topo(r);
            let remote = (0..n).any(|b| c.ranks[b].host != c.ranks[r].host);
            let ib = transports[r].contains(&Some(TransportKind::Ib))
                || (!remote && ib_allowed && cx.host_has_rdma(r));
            let ports = if ib {
                t.ports(Some(true))
            } else {
                t.ports(Some(false)).or_else(|| t.ports(None))
            };
            ports.unwrap_or_default()
        })
        .collect();
    why_not_ib(&cx, &transports, ib_allowed, &mut notes);
    let port_nodes: Vec<Vec<usize>> = (0..n).map(|r| rank_ports(&cx, r, &kind_ports[r])).collect();
    let name_of = |r: usize, net: usize| cx.topo(r).nodes[net].id.clone();
    let nearest_nic: Vec<Option<String>> = (0..n)
        .map(|r| port_nodes[r].first().map(|&x| name_of(r, x)))
        .collect();
    let rank_nics: Vec<Vec<String>> = (0..n)
        .map(|r| port_nodes[r].iter().map(|&x| name_of(r, x)).collect())
        .collect();
    let rank_rails: Vec<Vec<u32>> = (0..n)
        .map(|r| {
            port_nodes[r]
                .iter()
                .map(|&x| rail_of(cx.topo(r), &kind_ports[r], x))
                .collect()
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
    let mut rails_out: Vec<Rail> = Vec::new();
    if hosts.len() == 1 {
        let rs = members(hosts[0]);
        let order = best_order(&cx, &transports, &rs, None, true, &|_| (f64::INFINITY, 0));
        let ring = make_ring(&cx, &transports, &order, &[]);
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
        // Per host: its rails, each with the port on it (the ports its
        // ranks use), ordered by rail.
        let host_rails: Vec<Vec<(u32, usize)>> = hosts
            .iter()
            .map(|&h| {
                let mut v: Vec<(u32, usize)> = Vec::new();
                for r in members(h) {
                    for (i, &port) in port_nodes[r].iter().enumerate() {
                        let rail = rank_rails[r][i];
                        if !v.iter().any(|x| x.0 == rail) {
                            v.push((rail, port));
                        }
                    }
                }
                v.sort();
                v
            })
            .collect();
        let common: Vec<u32> = host_rails
            .first()
            .map(|first| {
                first
                    .iter()
                    .map(|x| x.0)
                    .filter(|k| host_rails.iter().all(|hr| hr.iter().any(|x| x.0 == *k)))
                    .collect()
            })
            .unwrap_or_default();
        let mut all_rails: Vec<u32> = host_rails.iter().flatten().map(|x| x.0).collect();
        all_rails.sort();
        all_rails.dedup();
        for &k in &all_rails {
            let mut ports = vec![None; c.hosts.len()];
            for (hi, &h) in hosts.iter().enumerate() {
                if let Some(&(_, node)) = host_rails[hi].iter().find(|x| x.0 == k) {
                    let r0 = members(h)[0];
                    ports[h] = Some(name_of(r0, node));
                }
            }
            rails_out.push(Rail { id: k, ports });
        }
        let same_rail = policy.cross_nic != CrossNic::Allow && !common.is_empty();
        if policy.cross_nic != CrossNic::Allow
            && common.is_empty()
            && host_rails.iter().any(|r| !r.is_empty())
        {
            notes.push(
                "the hosts have no rail (port index) in common: hops between hosts change rail"
                    .into(),
            );
        }
        let nch = if same_rail {
            common.len()
        } else {
            host_rails.iter().map(Vec::len).min().unwrap_or(1).max(1)
        };
        for ch in 0..nch {
            let mut order = Vec::new();
            // Per host: (entry port, exit port) for this channel.
            let mut ends: Vec<(Option<usize>, Option<usize>)> = Vec::new();
            for (hi, &h) in hosts.iter().enumerate() {
                let rs = members(h);
                let hr = &host_rails[hi];
                // The port this channel enters by (and, on one rail, leaves by).
                let rail_port: Option<usize> = if same_rail {
                    hr.iter().find(|x| x.0 == common[ch]).map(|x| x.1)
                } else if hr.is_empty() {
                    None
                } else {
                    Some(hr[ch % hr.len()].1)
                };
                let next_port: Option<usize> = (!hr.is_empty()).then(|| hr[(ch + 1) % hr.len()].1);
                // Entry: the rank that uses that port on the earliest channel.
                let entry = rail_port
                    .and_then(|p| {
                        rs.iter()
                            .copied()
                            .filter_map(|r| {
                                port_nodes[r].iter().position(|&x| x == p).map(|i| (i, r))
                            })
                            .min()
                            .map(|(_, r)| r)
                    })
                    .unwrap_or(rs[0]);
                let own_port = |r: usize| -> Option<usize> {
                    let v = &port_nodes[r];
                    (!v.is_empty()).then(|| v[ch % v.len()])
                };
                let class = |k: PathType| -> u8 {
                    if k <= PathType::Pxb {
                        0
                    } else if k <= PathType::Pxn {
                        1
                    } else {
                        2
                    }
                };
                let t = cx.topo(rs[0]);
                let exit_score = |last: usize| -> (f64, u8) {
                    if same_rail {
                        match rail_port.and_then(|p| t.net_path(cx.from(last), p)) {
                            Some(p) => (p.bw, class(p.kind)),
                            None => (f64::INFINITY, 2),
                        }
                    } else {
                        // Any rail: leave from a rank on the next rail, so
                        // that every port carries one channel out and one in.
                        let own = own_port(last);
                        let bw = own
                            .and_then(|p| t.net_path(cx.from(last), p))
                            .map_or(f64::INFINITY, |p| p.bw);
                        let pref = if last != entry && own == rail_port && own.is_some() {
                            0
                        } else if own == next_port {
                            1
                        } else {
                            2
                        };
                        (bw, pref)
                    }
                };
                let seg = best_order(&cx, &transports, &rs, Some(entry), false, &exit_score);
                let last = *seg.last().unwrap_or(&entry);
                let mut exit_port = if same_rail { rail_port } else { own_port(last) };
                if same_rail && policy.cross_nic == CrossNic::Auto {
                    if let (Some(rp), Some(op)) = (rail_port, own_port(last)) {
                        let bw = |p: usize| t.net_path(cx.from(last), p).map_or(0.0, |x| x.bw);
                        if op != rp && bw(op) > bw(rp) + 1e-9 {
                            let kind = |p: usize| {
                                t.net_path(cx.from(last), p)
                                    .map_or("?".to_string(), |x| x.kind.to_string())
                            };
                            notes.push(format!(
                                "channel {ch}: rank {last} on host {} leaves through {} (rail {}) instead of {} (rail {}): {} {:.1} GB/s against {} {:.1} GB/s (BRAID_CROSS_NIC=2; 0 keeps the rail)",
                                c.hosts[h].name,
                                t.nodes[op].id,
                                rail_of(t, &kind_ports[last], op),
                                t.nodes[rp].id,
                                rail_of(t, &kind_ports[last], rp),
                                kind(op),
                                bw(op),
                                kind(rp),
                                bw(rp),
                            ));
                            exit_port = Some(op);
                        }
                    }
                }
                ends.push((rail_port, exit_port));
                order.extend(seg);
            }
            rings.push(make_ring(
                &cx,
                &transports,
                &order,
                &ends_by_rank(&hosts, &ends, &c.ranks, &order),
            ));
        }
    }
    notes.dedup();
    Ok(Plan {
        transports,
        rings,
        nearest_nic,
        rank_nics,
        rank_rails,
        rank_host: c.ranks.iter().map(|p| p.host).collect(),
        rails: rails_out,
        cross_nic: policy.cross_nic,
        notes,
    })
}

/// Per rank of `order`: the port it enters its host by (first rank of its
/// host's segment) and the port it leaves by (last rank), for [`make_ring`].
fn ends_by_rank(
    hosts: &[usize],
    ends: &[(Option<usize>, Option<usize>)],
    ranks: &[RankPlace],
    order: &[usize],
) -> Vec<(usize, Option<usize>, Option<usize>)> {
    let mut out = Vec::new();
    for (hi, &h) in hosts.iter().enumerate() {
        let seg: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&r| ranks[r].host == h)
            .collect();
        if let (Some(&first), Some(&last)) = (seg.first(), seg.last()) {
            out.push((first, ends[hi].0, None));
            out.push((last, None, ends[hi].1));
        }
    }
    out
}

fn make_ring(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    order: &[usize],
    ends: &[(usize, Option<usize>, Option<usize>)],
) -> Ring {
    let n = order.len();
    let mut hops = Vec::new();
    let port_in = |r: usize| ends.iter().filter(|e| e.0 == r).find_map(|e| e.1);
    let port_out = |r: usize| ends.iter().filter(|e| e.0 == r).find_map(|e| e.2);
    if n > 1 {
        for i in 0..n {
            let (a, b) = (order[i], order[(i + 1) % n]);
            let t = transports[a][b].unwrap_or(TransportKind::Shm);
            let mut hop = Hop {
                from: a as u32,
                to: b as u32,
                transport: t,
                path: PathType::Net,
                bw: 0.0,
                nic_out: None,
                nic_in: None,
                rail_out: None,
                rail_in: None,
                path_out: None,
                path_in: None,
            };
            if matches!(t, TransportKind::Ib | TransportKind::Socket) {
                let mut bw = f64::INFINITY;
                for (r, port, out) in [(a, port_out(a), true), (b, port_in(b), false)] {
                    let topo = cx.topo(r);
                    let Some(p) = port else {
                        bw = bw.min(NET_BW_FALLBACK);
                        continue;
                    };
                    let path = topo.net_path(cx.from(r), p);
                    bw = bw.min(path.as_ref().map_or(NET_BW_FALLBACK, |x| x.bw));
                    let ports = topo
                        .ports(topo.net_of(p).map(|x| x.is_rdma()))
                        .unwrap_or_default();
                    let rail = Some(rail_of(topo, &ports, p));
                    let name = Some(topo.nodes[p].id.clone());
                    let kind = path.map(|x| x.kind);
                    if out {
                        (hop.nic_out, hop.rail_out, hop.path_out) = (name, rail, kind);
                    } else {
                        (hop.nic_in, hop.rail_in, hop.path_in) = (name, rail, kind);
                    }
                }
                hop.bw = bw;
            } else {
                let (k, bw) = cx.link(a, b, t);
                hop.path = k;
                hop.bw = bw;
            }
            hops.push(hop);
        }
    }
    Ring {
        order: order.iter().map(|&r| r as u32).collect(),
        hops,
    }
}

/// Score of an ordering: narrowest GB/s (the hop to the port the path
/// leaves by included), GB/s of that hop, worst path class, total GB/s,
/// and how the last rank reaches that port (0: next to it, 1: through a
/// relay, 2: otherwise).
#[derive(Clone, Copy, PartialEq)]
struct Score {
    min_bw: f64,
    exit_bw: f64,
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
        if (self.exit_bw - o.exit_bw).abs() > EPS {
            return self.exit_bw > o.exit_bw;
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
/// from `start` whose last rank is rated by `exit` (GB/s to the port it
/// leaves by, class of that path).
fn best_order(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    rs: &[usize],
    start: Option<usize>,
    cycle: bool,
    exit: &dyn Fn(usize) -> (f64, u8),
) -> Vec<usize> {
    let m = rs.len();
    if m <= 1 {
        return rs.to_vec();
    }
    let edge = |a: usize, b: usize| cx.link(a, b, transports[a][b].unwrap_or(TransportKind::Shm));
    let first = start.unwrap_or(rs[0]);
    // The exit rating depends on the last rank only: once per rank.
    let exits: Vec<(usize, (f64, u8))> = rs.iter().map(|&r| (r, exit(r))).collect();
    let exit = |r: usize| {
        exits
            .iter()
            .find(|x| x.0 == r)
            .map_or((f64::INFINITY, 2), |x| x.1)
    };
    let score = |order: &[usize]| {
        let (exit_bw, exit_class) = exit(*order.last().unwrap_or(&first));
        let mut s = Score {
            min_bw: exit_bw,
            exit_bw,
            worst: PathType::Loc,
            sum_bw: 0.0,
            exit: exit_class,
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
    // Greedy: always the best next neighbour, keeping the rank that leaves
    // best for last when the path is not a cycle.
    let keep_last = (!cycle)
        .then(|| {
            rest.iter().copied().min_by(|&a, &b| {
                let (ea, eb) = (exit(a), exit(b));
                (ea.1, -ea.0)
                    .partial_cmp(&(eb.1, -eb.0))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
        })
        .flatten();
    let mut order = vec![first];
    let mut left: Vec<usize> = rest
        .iter()
        .copied()
        .filter(|&r| Some(r) != keep_last)
        .collect();
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
    order.extend(keep_last);
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

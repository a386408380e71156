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
//!
//! The planner's parts, after NCCL's `graph/`: `policy` (what the
//! environment allows), `paths` (where ranks sit, and the transport of
//! every pair), `ports` (each rank's network ports and rails), `search`
//! (the best order of one host's ranks) and `rings` (the channels).

mod paths;
mod policy;
mod ports;
mod rings;
mod search;

use serde::{Deserialize, Serialize};

pub use policy::{CrossNic, TransportPolicy};

use super::graph::{PathType, Topology};
use super::TopoError;
use crate::transport::TransportKind;

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

/// Plan transports and rings for the ranks of `c` under `policy`.
pub fn plan(c: &Cluster, policy: &TransportPolicy) -> Result<Plan, TopoError> {
    if c.ranks.is_empty() {
        return Err(TopoError::Invalid("no ranks to plan for".into()));
    }
    let mut notes = Vec::new();
    let cx = paths::Ctx::new(c, policy, &mut notes)?;
    let transports = cx.transports()?;
    let ports = ports::Ports::of(&cx, &transports, &mut notes);
    let single_host = c.ranks.iter().all(|p| p.host == c.ranks[0].host);
    let channels = if single_host {
        rings::one_host(&cx, &transports)
    } else {
        rings::across_hosts(&cx, &transports, &ports, &mut notes)
    };
    notes.dedup();
    Ok(Plan {
        transports,
        rings: channels.rings,
        nearest_nic: ports.nearest_nic,
        rank_nics: ports.rank_nics,
        rank_rails: ports.rank_rails,
        rank_host: c.ranks.iter().map(|p| p.host).collect(),
        rails: channels.rails,
        cross_nic: policy.cross_nic,
        notes,
    })
}

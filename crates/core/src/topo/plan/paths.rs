//! Paths: where each rank sits in its host's topology, the path and
//! bandwidth between two ranks over a transport, and the transport of every
//! rank pair (as NCCL's `graph/paths.cc` decides P2P, SHM or NET per pair).

use super::{Cluster, TransportPolicy};
use crate::topo::graph::{PathType, Topology, LOC_BW};
use crate::topo::TopoError;
use crate::transport::TransportKind;

/// The transport of every ordered rank pair: `transports[a][b]` is how rank
/// `a` talks to rank `b` (None on the diagonal).
pub(super) type Transports = Vec<Vec<Option<TransportKind>>>;

/// The cluster and policy being planned, with every rank placed on the
/// nodes of its host's topology.
pub(super) struct Ctx<'a> {
    pub(super) c: &'a Cluster,
    pub(super) policy: &'a TransportPolicy,
    /// Per rank: GPU node (if any and in the host's model) and CPU node.
    pub(super) gpu: Vec<Option<usize>>,
    pub(super) cpu: Vec<usize>,
}

impl<'a> Ctx<'a> {
    /// Place every rank of `c`: its GPU node (a GPU missing from its host's
    /// model gets a note in `notes` and no node) and its CPU node (its
    /// GPU's, else its NUMA node's, else the first node with CPUs).
    pub(super) fn new(
        c: &'a Cluster,
        policy: &'a TransportPolicy,
        notes: &mut Vec<String>,
    ) -> Result<Ctx<'a>, TopoError> {
        let n = c.ranks.len();
        let mut gpu = Vec::with_capacity(n);
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
        Ok(Ctx {
            c,
            policy,
            gpu,
            cpu,
        })
    }

    /// The transport of every rank pair ([`Ctx::choose`]).
    pub(super) fn transports(&self) -> Result<Transports, TopoError> {
        let n = self.c.ranks.len();
        let mut transports = vec![vec![None; n]; n];
        for (a, row) in transports.iter_mut().enumerate() {
            for (b, slot) in row.iter_mut().enumerate() {
                if a != b {
                    *slot = Some(self.choose(a, b)?);
                }
            }
        }
        Ok(transports)
    }
}

impl Ctx<'_> {
    /// The topology of rank `r`'s host.
    pub(super) fn topo(&self, r: usize) -> &Topology {
        &self.c.hosts[self.c.ranks[r].host].topo
    }
    /// The node a rank's traffic starts from: its GPU, else its CPU.
    pub(super) fn from(&self, r: usize) -> usize {
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
    pub(super) fn host_has_rdma(&self, r: usize) -> bool {
        let t = self.topo(r);
        t.ports(Some(true)).is_some_and(|ports| {
            ports
                .iter()
                .any(|&n| t.net_of(n).is_some_and(|x| x.is_up()))
        })
    }
    /// (path type, GB/s) between two ranks of one host over `t`.
    pub(super) fn link(&self, a: usize, b: usize, t: TransportKind) -> (PathType, f64) {
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
    /// The transport between ranks `a` and `b`: the forced one if it can
    /// connect them, else the best candidate the policy leaves (NVLink,
    /// PCIe P2P, shared memory inside a host; then ib, socket).
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

/// The transports' names, comma-separated, for messages.
fn names(ts: &[TransportKind]) -> String {
    ts.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

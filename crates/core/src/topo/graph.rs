//! The topology as a graph, and NCCL's path rules over it.
//!
//! Nodes are NUMA nodes (CPU), PCI switches/bridges, GPUs, NICs, network
//! ports and one NVSwitch node that all NVSwitches collapse into. Links carry
//! a type and a bandwidth (GB/s):
//!
//! - CPU ↔ CPU: SYS, by CPU vendor (Intel 10 (Skylake-class QPI/UPI), AMD 16,
//!   ARM 6, POWER 32).
//! - parent ↔ child in the PCI tree: PCI, the child's `link_width × per-lane /
//!   80` (NCCL's rule), 12 GB/s (Gen3 x16) when unknown.
//! - GPU → peer over NVLink: NVL, `count ×` per-link bandwidth of the GPU's
//!   generation (sm70 20, sm80 20, sm86 12, sm90 20.6, sm100 40.1 GB/s).
//! - GPU ↔ CPU over NVLink-C2C: C2C, `count × bw / 1000` (NCCL's `c2c`).
//! - NIC → network port: NET, `speed / 8000` (12 GB/s when unknown).
//!
//! PCI links of unknown or 0 width count 16 lanes and links of unknown speed
//! 6 Gbit/s a lane, as NCCL reads them ([`Pci::nccl_link_bw`]).
//!
//! A path's type is the worst hop (PCI↔PCI counts PXB, a PCI hop touching a
//! CPU PHB, CPU↔CPU SYS, NVLink through an intermediate GPU NVB, C2C for
//! the GPU↔CPU C2C link, other PCI hops PIX) and its bandwidth the narrowest
//! link. Among the paths between two nodes the best type wins, then the
//! higher bandwidth, then fewer hops. Paths never cross a GPU except
//! NVLink-to-NVLink, and never cross a NIC.
//!
//! From a GPU to a NIC, [`Topology::gpu_nic_path`] adds NCCL's two relayed
//! classes: PXN (through an NVLink peer that sits next to the NIC, when that
//! is faster or avoids the CPU) and P2C (over C2C to the CPU the NIC hangs
//! from).
//!
//! NIC-class PCI endpoints without a `nic` element (partial vendor files)
//! get one placeholder port each ([`Topology::net_info`]), so that a file
//! alone can be planned for: assumed RDMA, as vendors list the NICs NCCL's
//! IB or EFA transports use.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::model::{Net, Pci, System};

/// Bandwidth of a local (same-device) path, GB/s.
pub const LOC_BW: f64 = 5000.0;
/// Fallback PCIe bandwidth (Gen3 x16), GB/s.
pub const PCI_BW_FALLBACK: f64 = 12.0;
/// Fallback network bandwidth, GB/s.
pub const NET_BW_FALLBACK: f64 = 12.0;

/// Path classes, best first (NCCL's `PATH_*`, in NCCL's order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PathType {
    /// Same device.
    Loc,
    /// Direct NVLink (also through NVSwitch).
    Nvl,
    /// NVLink through an intermediate GPU.
    Nvb,
    /// NVLink-C2C between a GPU and its CPU (Grace).
    C2c,
    /// At most one PCIe switch.
    Pix,
    /// Several PCIe switches, no host bridge.
    Pxb,
    /// GPU → C2C → CPU → PCIe → NIC.
    P2c,
    /// GPU → NVLink peer GPU → its NIC (a rail-local relay).
    Pxn,
    /// Through a PCIe host bridge (the CPU).
    Phb,
    /// Across NUMA nodes (QPI/UPI/Infinity Fabric).
    Sys,
    /// Through the network.
    Net,
    /// Disconnected.
    Dis,
}

impl PathType {
    pub fn name(self) -> &'static str {
        match self {
            PathType::Loc => "LOC",
            PathType::Nvl => "NVL",
            PathType::Nvb => "NVB",
            PathType::C2c => "C2C",
            PathType::Pix => "PIX",
            PathType::Pxb => "PXB",
            PathType::P2c => "P2C",
            PathType::Pxn => "PXN",
            PathType::Phb => "PHB",
            PathType::Sys => "SYS",
            PathType::Net => "NET",
            PathType::Dis => "DIS",
        }
    }
}

impl fmt::Display for PathType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PathType {
    type Err = String;
    /// Names (`NVL`, `PIX`, ...) or NCCL's legacy integers (0=LOC, 1=PIX, 2=PXB, 3=PHB, 4=SYS).
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.trim().to_ascii_uppercase().as_str() {
            "LOC" | "0" => PathType::Loc,
            "NVL" => PathType::Nvl,
            "NVB" => PathType::Nvb,
            "C2C" => PathType::C2c,
            "PIX" | "1" => PathType::Pix,
            "PXB" | "2" => PathType::Pxb,
            "P2C" => PathType::P2c,
            "PXN" => PathType::Pxn,
            "PHB" | "3" => PathType::Phb,
            "SYS" | "4" => PathType::Sys,
            "NET" => PathType::Net,
            "DIS" => PathType::Dis,
            other => {
                return Err(format!(
                    "unknown path type '{other}' (LOC, NVL, NVB, C2C, PIX, PXB, P2C, PXN, PHB, SYS, NET)"
                ))
            }
        })
    }
}

/// Link classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkType {
    Nvl,
    C2c,
    Pci,
    Sys,
    Net,
}

/// Node classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeKind {
    Cpu,
    Pci,
    Gpu,
    Nic,
    Net,
    NvSwitch,
}

/// A graph node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Node {
    pub kind: NodeKind,
    /// Bus id (PCI, GPU, NIC), port name (Net), `numa<N>` (CPU), `nvswitch`.
    pub id: String,
    /// The NUMA node the device hangs from.
    pub numaid: i32,
    /// The PCI host bridge, when known.
    pub hostbridge: Option<String>,
}

/// A directed link.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Link {
    pub to: usize,
    pub kind: LinkType,
    /// GB/s.
    pub bw: f64,
    /// NVLink count (NVL links only).
    pub count: u32,
}

/// The best path between two nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Path {
    #[serde(rename = "type")]
    pub kind: PathType,
    /// Bottleneck bandwidth, GB/s.
    pub bw: f64,
    /// Node indices from source to destination.
    pub nodes: Vec<usize>,
}

impl Path {
    pub fn hops(&self) -> usize {
        self.nodes.len().saturating_sub(1)
    }
}

/// A [`System`] turned into a graph with every best path computed.
#[derive(Clone, Debug)]
pub struct Topology {
    pub system: System,
    pub nodes: Vec<Node>,
    pub links: Vec<Vec<Link>>,
    /// GPU node indices in [`System::gpus`] order (device index, then bus id).
    pub gpus: Vec<usize>,
    /// NIC node indices in model order.
    pub nics: Vec<usize>,
    /// Network-port node indices in [`System::nets`] order.
    pub nets: Vec<usize>,
    /// CPU node indices in model order.
    pub cpus: Vec<usize>,
    /// Per network port (aligned with [`Topology::nets`]): the port as the
    /// model has it, or a placeholder for a NIC-class PCI endpoint without
    /// a `nic` element (named after its bus id, attribute `placeholder`).
    pub net_info: Vec<Net>,
    paths: Vec<Vec<Option<Path>>>,
    pci_paths: Vec<Vec<Option<Path>>>,
}

/// NVLink bandwidth per link for a GPU generation, GB/s.
pub fn nvlink_bw_per_link(sm: Option<u32>) -> f64 {
    match sm.unwrap_or(0) {
        100.. => 40.1,
        90..=99 => 20.6,
        86..=89 => 12.0,
        80..=85 => 20.0,
        70..=79 => 20.0,
        60..=69 => 18.0,
        _ => 20.0,
    }
}

/// Inter-socket bandwidth by CPU vendor / architecture, GB/s.
pub fn inter_cpu_bw(arch: Option<&str>, vendor: Option<&str>) -> f64 {
    match (arch.unwrap_or(""), vendor.unwrap_or("")) {
        (a, _) if a.starts_with("ppc") => 32.0,
        (a, _) if a.starts_with("arm") || a.starts_with("aarch") => 6.0,
        (_, "AuthenticAMD") => 16.0,
        _ => 10.0,
    }
}

struct Builder {
    nodes: Vec<Node>,
    links: BTreeMap<(usize, usize), Link>,
    nets: Vec<usize>,
    net_info: Vec<Net>,
}

impl Builder {
    /// A network port of NIC node `nic`.
    fn net(&mut self, nic: usize, net: Net, numaid: i32, hb: Option<String>) {
        let id = self.node(NodeKind::Net, net.name.clone(), numaid, hb);
        let bw = net.bw().unwrap_or(NET_BW_FALLBACK);
        self.both(nic, id, LinkType::Net, bw, 0);
        self.nets.push(id);
        self.net_info.push(net);
    }
    fn node(&mut self, kind: NodeKind, id: String, numaid: i32, hb: Option<String>) -> usize {
        self.nodes.push(Node {
            kind,
            id,
            numaid,
            hostbridge: hb,
        });
        self.nodes.len() - 1
    }
    fn link(&mut self, a: usize, b: usize, kind: LinkType, bw: f64, count: u32) {
        let e = self.links.entry((a, b)).or_insert(Link {
            to: b,
            kind,
            bw,
            count,
        });
        if bw > e.bw {
            *e = Link {
                to: b,
                kind,
                bw,
                count,
            };
        }
    }
    fn both(&mut self, a: usize, b: usize, kind: LinkType, bw: f64, count: u32) {
        self.link(a, b, kind, bw, count);
        self.link(b, a, kind, bw, count);
    }
}

impl Topology {
    /// Build the graph of `system` and compute all paths.
    pub fn new(system: System) -> Topology {
        let mut b = Builder {
            nodes: Vec::new(),
            links: BTreeMap::new(),
            nets: Vec::new(),
            net_info: Vec::new(),
        };
        let mut cpus = Vec::new();
        let mut nics = Vec::new();
        let mut gpu_by_bus: BTreeMap<String, usize> = BTreeMap::new();
        let mut nvlinks: Vec<(usize, usize, &super::model::Gpu)> = Vec::new();
        for (ci, cpu) in system.cpus.iter().enumerate() {
            let c = b.node(
                NodeKind::Cpu,
                format!("numa{}", cpu.numaid),
                cpu.numaid,
                None,
            );
            cpus.push(c);
            for p in &cpu.pci {
                add_pci(
                    &mut b,
                    c,
                    cpu.numaid,
                    p.hostbridge.clone(),
                    p,
                    ci,
                    &mut nics,
                    &mut gpu_by_bus,
                    &mut nvlinks,
                );
            }
            for nic in &cpu.nics {
                let n = b.node(NodeKind::Nic, String::new(), cpu.numaid, None);
                nics.push(n);
                // A NIC outside the PCI tree hangs from its CPU (NCCL: LOC bw).
                b.both(c, n, LinkType::Pci, LOC_BW, 0);
                for net in &nic.nets {
                    b.nodes[n].id.clone_from(&net.name);
                    b.net(n, net.clone(), cpu.numaid, None);
                }
            }
        }
        for (i, &a) in cpus.iter().enumerate() {
            for (j, &c) in cpus.iter().enumerate() {
                if i != j {
                    let ca = &system.cpus[i];
                    let bw = inter_cpu_bw(ca.arch.as_deref(), ca.vendor.as_deref());
                    b.link(a, c, LinkType::Sys, bw, 0);
                }
            }
        }
        let mut nvs: Option<usize> = None;
        for (g, ci, gpu) in nvlinks {
            let per = nvlink_bw_per_link(gpu.sm);
            // Links to the same peer add up (all NVSwitches are one node).
            let mut per_peer: BTreeMap<usize, u32> = BTreeMap::new();
            for l in &gpu.nvlinks {
                let peer = if l.tclass == Some(0x068001) {
                    Some(cpus[ci])
                } else if let Some(&p) = gpu_by_bus.get(&l.target) {
                    Some(p)
                } else if l.tclass.is_none_or(|c| c == 0x068000) {
                    // NVSwitch (or a peer we cannot see, as NCCL assumes in VMs).
                    let s = *nvs.get_or_insert_with(|| {
                        b.node(NodeKind::NvSwitch, "nvswitch".into(), -1, None)
                    });
                    Some(s)
                } else {
                    None
                };
                if let Some(p) = peer.filter(|&p| p != g) {
                    *per_peer.entry(p).or_default() += l.count;
                }
            }
            for (p, count) in per_peer {
                let bw = per * count as f64;
                b.link(g, p, LinkType::Nvl, bw, count);
                // The peer's own list (if any) sets the reverse direction; a
                // switch or CPU has none, and a peer GPU that omits it gets ours.
                b.link(p, g, LinkType::Nvl, bw, count);
            }
            // NVLink-C2C to the GPU's CPU.
            let c2c: f64 = gpu.c2c.iter().map(|c| c.total_bw()).sum();
            let count: u32 = gpu.c2c.iter().map(|c| c.count).sum();
            if c2c > 0.0 {
                b.both(g, cpus[ci], LinkType::C2c, c2c, count);
            }
        }
        let n = b.nodes.len();
        let mut links = vec![Vec::new(); n];
        for ((a, _), l) in b.links {
            links[a].push(l);
        }
        let gpus = system
            .gpus()
            .iter()
            .filter_map(|g| gpu_by_bus.get(&g.pci.busid).copied())
            .collect();
        let mut t = Topology {
            system,
            nodes: b.nodes,
            links,
            gpus,
            nics,
            nets: b.nets,
            cpus,
            net_info: b.net_info,
            paths: Vec::new(),
            pci_paths: Vec::new(),
        };
        t.paths = (0..n).map(|s| t.bfs(s, true)).collect();
        t.pci_paths = (0..n).map(|s| t.bfs(s, false)).collect();
        t
    }

    fn bfs(&self, src: usize, nvlink: bool) -> Vec<Option<Path>> {
        #[derive(Clone)]
        struct Label {
            kind: PathType,
            bw: f64,
            hops: usize,
            prev: usize,
            via_nvl: bool,
        }
        let better = |a: &Label, b: &Label| {
            (a.kind, -a.bw, a.hops)
                .partial_cmp(&(b.kind, -b.bw, b.hops))
                .is_some_and(|o| o == std::cmp::Ordering::Less)
        };
        let n = self.nodes.len();
        let mut best: Vec<Option<Label>> = vec![None; n];
        best[src] = Some(Label {
            kind: PathType::Loc,
            bw: LOC_BW,
            hops: 0,
            prev: src,
            via_nvl: false,
        });
        let mut queue = VecDeque::from([src]);
        let mut budget = n * n * 8 + 64;
        while let Some(u) = queue.pop_front() {
            budget = budget.saturating_sub(1);
            if budget == 0 {
                break;
            }
            let Some(lu) = best[u].clone() else { continue };
            let un = &self.nodes[u];
            for l in &self.links[u] {
                if !nvlink && l.kind == LinkType::Nvl {
                    continue;
                }
                if u != src {
                    let ok = match un.kind {
                        NodeKind::Cpu | NodeKind::Pci | NodeKind::NvSwitch => true,
                        NodeKind::Gpu => lu.via_nvl && l.kind == LinkType::Nvl,
                        NodeKind::Nic => l.kind == LinkType::Net,
                        NodeKind::Net => false,
                    };
                    if !ok {
                        continue;
                    }
                }
                let vn = &self.nodes[l.to];
                let hop = match l.kind {
                    LinkType::Nvl if u != src && un.kind == NodeKind::Gpu => PathType::Nvb,
                    LinkType::Nvl => PathType::Nvl,
                    LinkType::C2c => PathType::C2c,
                    LinkType::Sys => PathType::Sys,
                    LinkType::Net => PathType::Loc,
                    LinkType::Pci if un.kind == NodeKind::Cpu || vn.kind == NodeKind::Cpu => {
                        PathType::Phb
                    }
                    LinkType::Pci if un.kind == NodeKind::Pci && vn.kind == NodeKind::Pci => {
                        PathType::Pxb
                    }
                    LinkType::Pci => PathType::Pix,
                };
                let cand = Label {
                    kind: lu.kind.max(hop),
                    bw: lu.bw.min(l.bw),
                    hops: lu.hops + 1,
                    prev: u,
                    via_nvl: l.kind == LinkType::Nvl,
                };
                if l.to != src && best[l.to].as_ref().is_none_or(|b| better(&cand, b)) {
                    best[l.to] = Some(cand);
                    queue.push_back(l.to);
                }
            }
        }
        (0..n)
            .map(|d| {
                let l = best[d].as_ref()?;
                let mut nodes = vec![d];
                let mut cur = d;
                while cur != src && nodes.len() <= n {
                    cur = best[cur].as_ref()?.prev;
                    nodes.push(cur);
                }
                nodes.reverse();
                Some(Path {
                    kind: l.kind,
                    bw: l.bw,
                    nodes,
                })
            })
            .collect()
    }

    /// The best path from node `a` to node `b` (None when disconnected).
    pub fn path(&self, a: usize, b: usize) -> Option<&Path> {
        self.paths.get(a)?.get(b)?.as_ref()
    }

    /// The best path that uses no NVLink (what PCIe alone offers).
    pub fn pci_path(&self, a: usize, b: usize) -> Option<&Path> {
        self.pci_paths.get(a)?.get(b)?.as_ref()
    }

    /// NVLinks between two GPUs: direct links, or through the NVSwitch the
    /// smaller of the two GPUs' link counts. 0 when none.
    pub fn nvlink_count(&self, a: usize, b: usize) -> u32 {
        let direct = self.links[a]
            .iter()
            .find(|l| l.to == b && l.kind == LinkType::Nvl)
            .map_or(0, |l| l.count);
        if direct > 0 {
            return direct;
        }
        let to_nvs = |g: usize| {
            self.links[g]
                .iter()
                .find(|l| l.kind == LinkType::Nvl && self.nodes[l.to].kind == NodeKind::NvSwitch)
                .map_or(0, |l| l.count)
        };
        to_nvs(a).min(to_nvs(b))
    }

    /// The NIC node a network port belongs to.
    pub fn nic_of_net(&self, net: usize) -> Option<usize> {
        self.links[net]
            .iter()
            .find(|l| l.kind == LinkType::Net)
            .map(|l| l.to)
    }

    /// The CPU (NUMA) node a device hangs from.
    pub fn cpu_of(&self, node: usize) -> Option<usize> {
        let numa = self.nodes[node].numaid;
        self.cpus
            .iter()
            .copied()
            .find(|&c| self.nodes[c].numaid == numa)
    }

    /// The GPU node with this bus id.
    pub fn gpu_by_busid(&self, busid: &str) -> Option<usize> {
        self.gpus
            .iter()
            .copied()
            .find(|&g| self.nodes[g].id.eq_ignore_ascii_case(busid))
    }

    /// The network port nearest to `from` (a GPU or CPU node): NCCL's
    /// first local port ([`Topology::local_nets`]) among the RDMA ports
    /// (`rdma`) or the kernel interfaces (not `rdma`; RDMA ports when there
    /// are none).
    pub fn nearest_net(&self, from: usize, rdma: bool) -> Option<usize> {
        let ports = self
            .ports(Some(rdma))
            .or_else(|| if rdma { None } else { self.ports(None) })?;
        self.local_nets(from, &ports).first().copied()
    }

    /// The ports of one kind (`Some(true)` RDMA, `Some(false)` kernel
    /// interfaces, `None` all) as node indices, in model order; only the
    /// ones that are up when any is (NCCL's transports list active ports
    /// only). None when there is no port of that kind.
    pub fn ports(&self, rdma: Option<bool>) -> Option<Vec<usize>> {
        let of_kind: Vec<usize> = (0..self.nets.len())
            .filter(|&i| rdma.is_none_or(|r| self.net_info[i].is_rdma() == r))
            .collect();
        let up: Vec<usize> = of_kind
            .iter()
            .copied()
            .filter(|&i| self.net_info[i].is_up())
            .collect();
        let pick = if up.is_empty() { of_kind } else { up };
        (!pick.is_empty()).then(|| pick.into_iter().map(|i| self.nets[i]).collect())
    }

    /// The info of a network-port node.
    pub fn net_of(&self, net: usize) -> Option<&Net> {
        let i = self.nets.iter().position(|&x| x == net)?;
        self.net_info.get(i)
    }

    /// The path from `from` (GPU or CPU node) to a network port, as NCCL
    /// rates it: the best path to the port's NIC ([`Topology::gpu_nic_path`]
    /// from a GPU), its bandwidth capped by the port's speed.
    pub fn net_path(&self, from: usize, net: usize) -> Option<Path> {
        let nic = self.nic_of_net(net)?;
        let mut p = if self.nodes[from].kind == NodeKind::Gpu {
            self.gpu_nic_path(from, nic)?
        } else {
            self.pci_path(from, nic).or(self.path(from, nic))?.clone()
        };
        let port_bw = self
            .net_of(net)
            .and_then(Net::bw)
            .unwrap_or(NET_BW_FALLBACK);
        p.bw = p.bw.min(port_bw);
        p.nodes.push(net);
        Some(p)
    }

    /// The ports among `ports` that are nearest to `from`, NCCL's way
    /// (`ncclTopoGetLocal`): the highest bandwidth, then the best path
    /// class; in the order of `ports`.
    pub fn local_nets(&self, from: usize, ports: &[usize]) -> Vec<usize> {
        let rated: Vec<(usize, f64, PathType)> = ports
            .iter()
            .filter_map(|&n| self.net_path(from, n).map(|p| (n, p.bw, p.kind)))
            .collect();
        best_of(&rated)
    }

    /// The GPUs nearest to port `net` (NCCL: the GPUs whose path from the
    /// port has the highest bandwidth, then the best class), in GPU order.
    pub fn local_gpus(&self, net: usize) -> Vec<usize> {
        let rated: Vec<(usize, f64, PathType)> = self
            .gpus
            .iter()
            .filter_map(|&g| self.net_path(g, net).map(|p| (g, p.bw, p.kind)))
            .collect();
        best_of(&rated)
    }

    /// The port GPU `gpu` uses on channel `channel`, NCCL's way
    /// (`ncclTopoGetLocalNet`): GPUs equally near the same ports share them
    /// out (each `ceil(ports / GPUs)` of them, starting at its device index
    /// modulo the GPUs, bit-mirrored when the ports are a power of two), so
    /// that equally near ports and NIC ports are all used.
    pub fn spread_net(&self, gpu: usize, ports: &[usize], channel: usize) -> Option<usize> {
        let local = self.local_nets(gpu, ports);
        let first = *local.first()?;
        let mut near_gpus = self.local_gpus(first);
        if near_gpus.is_empty() {
            near_gpus.push(gpu);
        }
        let per_gpu = local.len().div_ceil(near_gpus.len()).max(1);
        let dev = self.gpu_dev(gpu);
        let mut i = dev % near_gpus.len();
        if local.len().is_power_of_two() {
            i = mirror_bits(i, local.len());
        }
        i += channel % per_gpu;
        Some(local[i % local.len()])
    }

    /// NCCL's device index of a GPU node (`dev`; its place among the GPUs
    /// when the model has none).
    pub fn gpu_dev(&self, gpu: usize) -> usize {
        let pos = self.gpus.iter().position(|&g| g == gpu).unwrap_or(0);
        self.system
            .find_pci(&self.nodes[gpu].id)
            .and_then(|p| p.gpu.as_ref())
            .and_then(|g| g.dev)
            .map_or(pos, |d| d as usize)
    }

    /// The path from GPU node `gpu` to NIC node `nic` as NCCL computes it
    /// (`ncclTopoComputePaths`): the PCIe path, or PXN when a GPU joined
    /// to this one by NVLink (directly or through NVSwitch) has a path of at
    /// most PXB to the NIC and that is faster or avoids the CPU (GPUDirect
    /// RDMA assumed unless the model says it is off), or P2C when the GPU
    /// reaches the NIC's CPU over C2C.
    pub fn gpu_nic_path(&self, gpu: usize, nic: usize) -> Option<Path> {
        let direct = self.pci_path(gpu, nic).cloned();
        let mut best = direct.clone();
        // P2C: GPU → C2C → CPU → PCIe → NIC.
        if let Some(c) = self.cpu_of(gpu) {
            let (gc, nc) = (self.path(gpu, c), self.pci_path(nic, c));
            if let (Some(gc), Some(nc)) = (gc, nc) {
                if gc.kind == PathType::C2c && nc.kind == PathType::Phb {
                    let mut nodes = gc.nodes.clone();
                    nodes.extend(nc.nodes.iter().rev().skip(1));
                    let p2c = Path {
                        kind: PathType::P2c,
                        bw: gc.bw.min(nc.bw),
                        nodes,
                    };
                    if best.as_ref().is_none_or(|b| p2c.kind < b.kind) {
                        best = Some(p2c);
                    }
                }
            }
        }
        let gdr_off = |g: usize| {
            self.system
                .find_pci(&self.nodes[g].id)
                .and_then(|p| p.gpu.as_ref())
                .and_then(|x| x.gdr)
                == Some(false)
        };
        let nic_gdr_off = self.links[nic]
            .iter()
            .filter(|l| l.kind == LinkType::Net)
            .filter_map(|l| self.net_of(l.to))
            .any(|n| n.gdr == Some(false));
        let own = best.clone();
        for &peer in &self.gpus {
            if peer == gpu || nic_gdr_off || gdr_off(peer) {
                continue;
            }
            let (Some(nv), Some(pn)) = (self.path(gpu, peer), self.pci_path(peer, nic)) else {
                continue;
            };
            if nv.kind > PathType::Nvl || pn.kind > PathType::Pxb {
                continue;
            }
            let faster = own.as_ref().is_none_or(|o| pn.bw > o.bw + 1e-9);
            let avoids_cpu = own.as_ref().is_none_or(|o| o.kind > PathType::Pxn);
            if !(faster || avoids_cpu) {
                continue;
            }
            let mut nodes = nv.nodes.clone();
            nodes.extend(pn.nodes.iter().skip(1));
            let pxn = Path {
                kind: PathType::Pxn,
                bw: nv.bw.min(pn.bw),
                nodes,
            };
            let better = best.as_ref().is_none_or(|b| {
                (pxn.kind, -pxn.bw)
                    .partial_cmp(&(b.kind, -b.bw))
                    .is_some_and(|o| o == std::cmp::Ordering::Less)
            });
            if better {
                best = Some(pxn);
            }
        }
        best.or(direct)
    }

    /// The nvidia-smi `topo -m` label between two GPU/NIC nodes: `X`, `NV#`,
    /// `PIX`, `PXB`, `PHB` (same host bridge), `NODE` (same NUMA node,
    /// different host bridges), `SYS`.
    pub fn smi_label(&self, a: usize, b: usize) -> String {
        if a == b {
            return "X".into();
        }
        let nv = if self.nodes[a].kind == NodeKind::Gpu && self.nodes[b].kind == NodeKind::Gpu {
            self.nvlink_count(a, b)
        } else {
            0
        };
        if nv > 0 {
            return format!("NV{nv}");
        }
        let Some(p) = self.pci_path(a, b) else {
            return "SYS".into();
        };
        match p.kind {
            PathType::Loc | PathType::Pix => "PIX".into(),
            PathType::Pxb => "PXB".into(),
            // PHB: through one host bridge; NODE: between host bridges of
            // one NUMA node. Where the host bridges are not known (NCCL
            // files), devices under different top-level PCI elements are on
            // different root ports, which on current servers are different
            // host bridges: NODE, as nvidia-smi reports them (a PHB path
            // never stays inside one top-level element).
            PathType::Phb => match (&self.nodes[a].hostbridge, &self.nodes[b].hostbridge) {
                (Some(x), Some(y)) if x == y => "PHB".into(),
                _ => "NODE".into(),
            },
            _ => "SYS".into(),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn add_pci<'a>(
    b: &mut Builder,
    parent: usize,
    numaid: i32,
    hb: Option<String>,
    p: &'a Pci,
    ci: usize,
    nics: &mut Vec<usize>,
    gpus: &mut BTreeMap<String, usize>,
    nvlinks: &mut Vec<(usize, usize, &'a super::model::Gpu)>,
) {
    let kind = if p.is_gpu() {
        NodeKind::Gpu
    } else if p.is_nic() {
        NodeKind::Nic
    } else {
        NodeKind::Pci
    };
    let me = b.node(kind, p.busid.clone(), numaid, hb.clone());
    b.both(parent, me, LinkType::Pci, p.nccl_link_bw(), 0);
    match kind {
        NodeKind::Gpu => {
            gpus.insert(p.busid.clone(), me);
            if let Some(g) = &p.gpu {
                nvlinks.push((me, ci, g));
            }
        }
        NodeKind::Nic => {
            nics.push(me);
            match &p.nic {
                Some(nic) => {
                    for net in &nic.nets {
                        b.net(me, net.clone(), numaid, hb.clone());
                    }
                }
                None => b.net(me, placeholder_net(p), numaid, hb.clone()),
            }
        }
        _ => {}
    }
    for c in &p.children {
        add_pci(b, me, numaid, hb.clone(), c, ci, nics, gpus, nvlinks);
    }
}

/// The port braid assumes for a NIC-class PCI endpoint that a file lists
/// without a `nic` element: named after the bus id, RDMA (InfiniBand for
/// class 0x0207, RoCE for other network classes), speed unknown.
pub fn placeholder_net(p: &Pci) -> Net {
    let ib = p.class.is_some_and(|c| c >> 8 == 0x0207);
    let mut attrs = super::model::Attrs::new();
    attrs.insert("placeholder".into(), "1".into());
    Net {
        name: p.busid.clone(),
        rdma: Some(true),
        link_layer: Some(if ib { "InfiniBand" } else { "Ethernet" }.into()),
        attrs,
        ..Default::default()
    }
}

/// The entries with the highest bandwidth, then the best class (NCCL's
/// `ncclTopoGetLocal`), in their order.
fn best_of(rated: &[(usize, f64, PathType)]) -> Vec<usize> {
    const EPS: f64 = 1e-9;
    let Some(bw) = rated.iter().map(|r| r.1).reduce(f64::max) else {
        return Vec::new();
    };
    let kind = rated
        .iter()
        .filter(|r| (r.1 - bw).abs() <= EPS)
        .map(|r| r.2)
        .min()
        .unwrap_or(PathType::Dis);
    rated
        .iter()
        .filter(|r| (r.1 - bw).abs() <= EPS && r.2 == kind)
        .map(|r| r.0)
        .collect()
}

/// NCCL's `mirrorBits`: `val`'s bits reversed within `log2(pow2)` bits.
pub fn mirror_bits(val: usize, pow2: usize) -> usize {
    let mut mirror = 0;
    let (mut b, mut mb) = (1, pow2 >> 1);
    while b < pow2 {
        if val & b != 0 {
            mirror |= mb;
        }
        b <<= 1;
        mb >>= 1;
    }
    mirror
}

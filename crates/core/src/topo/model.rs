//! The host model: NUMA nodes with their CPU sets, the PCI tree, GPUs with
//! their NVLinks, and NICs with their network ports.
//!
//! The shape follows NCCL's topology XML (`system` → `cpu` → `pci` → `gpu` /
//! `nic` → `net`) so that import and export are lossless; attributes braid
//! does not interpret are kept in `attrs` and written back.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Extra attributes braid keeps but does not interpret (written back on export).
pub type Attrs = BTreeMap<String, String>;

/// One host.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct System {
    /// The `name` attribute (braid writes the host name there).
    pub name: Option<String>,
    /// NUMA nodes (NCCL's `cpu` elements), in file / node order.
    pub cpus: Vec<Cpu>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: Attrs,
}

/// A NUMA node and the CPUs that belong to it (NCCL's `cpu` element).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cpu {
    /// NUMA node id (`numaid`); -1 when unknown.
    pub numaid: i32,
    /// The CPUs of the node (`affinity`, a cpumask in sysfs `cpumap` format).
    pub affinity: Option<CpuSet>,
    /// `x86_64`, `arm64`, `ppc64`.
    pub arch: Option<String>,
    /// `GenuineIntel`, `AuthenticAMD`, ...
    pub vendor: Option<String>,
    pub familyid: Option<u32>,
    pub modelid: Option<u32>,
    /// PCI devices attached to this node's host bridges.
    pub pci: Vec<Pci>,
    /// NICs not placed in the PCI tree.
    pub nics: Vec<Nic>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: Attrs,
}

/// A set of CPU ids, each below [`MAX_CPUS`]. Parsing (masks, lists,
/// JSON) refuses larger ids: a mask or list of a set is as long as its
/// largest id, so one huge id from a file would cost gigabytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<u32>")]
pub struct CpuSet(pub Vec<u32>);

/// Bound on CPU ids (Linux's `NR_CPUS` is at most 8192 today).
pub const MAX_CPUS: u32 = 1 << 16;

impl TryFrom<Vec<u32>> for CpuSet {
    type Error = String;

    /// Sorts and dedups; refuses ids of [`MAX_CPUS`] or more.
    fn try_from(mut cpus: Vec<u32>) -> Result<CpuSet, String> {
        if let Some(c) = cpus.iter().find(|&&c| c >= MAX_CPUS) {
            return Err(format!(
                "CPU id {c} is out of range (ids are below {MAX_CPUS})"
            ));
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(CpuSet(cpus))
    }
}

/// A PCI device: a bridge/switch, or an endpoint carrying a GPU or a NIC.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Pci {
    /// `DDDD:BB:DD.F`, lower case.
    pub busid: String,
    /// PCI class code (`0x060400` bridge, `0x03xxxx` display, `0x02xxxx` network,
    /// `0x068000` NVSwitch).
    pub class: Option<u32>,
    pub vendor: Option<String>,
    pub device: Option<String>,
    pub subsystem_vendor: Option<String>,
    pub subsystem_device: Option<String>,
    /// As sysfs / NCCL write it, e.g. `"16.0 GT/s PCIe"`.
    pub link_speed: Option<String>,
    pub link_width: Option<u32>,
    /// The PCI host bridge (root complex, e.g. `pci0000:00`) this device hangs
    /// from; braid's own attribute (`hostbridge`), used to tell nvidia-smi's
    /// NODE from PHB. Absent in NCCL files.
    pub hostbridge: Option<String>,
    /// Devices below this one (when it is a bridge or switch).
    pub children: Vec<Pci>,
    pub gpu: Option<Gpu>,
    /// Further `gpu` elements of this PCI device: NCCL's layout for several
    /// ranks on one GPU (each with its own `rank`). They are the same
    /// physical GPU as [`Pci::gpu`]: counted once, kept for export.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_gpus: Vec<Gpu>,
    pub nic: Option<Nic>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: Attrs,
}

/// A GPU (NCCL's `gpu` element inside its `pci`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Device index (NVML / CUDA).
    pub dev: Option<u32>,
    /// Compute capability × 10 (`90` for Hopper).
    pub sm: Option<u32>,
    pub rank: Option<u32>,
    pub gdr: Option<bool>,
    pub nvlinks: Vec<NvLink>,
    /// NVLink-C2C links to the CPU (Grace Hopper/Blackwell; NCCL's `c2c`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub c2c: Vec<C2c>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: Attrs,
}

/// NVLink-C2C links from a GPU to its CPU (NCCL's `c2c` element).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct C2c {
    /// Bandwidth of one link, MB/s (NVML's C2C max bandwidth).
    pub bw: u32,
    /// Number of active links.
    pub count: u32,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: Attrs,
}

impl C2c {
    /// GB/s of all the links together (`bw × count / 1000`, NCCL's rule).
    pub fn total_bw(&self) -> f64 {
        self.bw as f64 * self.count as f64 / 1000.0
    }
}

/// NVLinks from a GPU to one peer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NvLink {
    /// Bus id of the peer (GPU, NVSwitch or CPU).
    pub target: String,
    /// Number of links.
    pub count: u32,
    /// Class of the peer: `0x068000` NVSwitch, `0x068001` CPU, `0x03xxxx` GPU.
    pub tclass: Option<u32>,
}

/// A NIC: one PCI function, one or more network ports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Nic {
    pub nets: Vec<Net>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: Attrs,
}

/// One network port (NCCL's `net` element).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Net {
    /// `mlx5_0` (RDMA device) or `eth0` (kernel interface).
    pub name: String,
    pub dev: Option<u32>,
    /// Mbit/s.
    pub speed: Option<u64>,
    pub port: Option<u32>,
    pub latency: Option<String>,
    pub guid: Option<String>,
    pub maxconn: Option<u32>,
    pub gdr: Option<bool>,
    pub coll: Option<bool>,
    /// `InfiniBand` or `Ethernet` (braid attribute `link_layer`).
    pub link_layer: Option<String>,
    /// Port state as the kernel says it (`ACTIVE`, `DOWN`, `up`, ...) (braid attribute `state`).
    pub state: Option<String>,
    /// Whether this is an RDMA (verbs) device (braid attribute `rdma`).
    pub rdma: Option<bool>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: Attrs,
}

/// What kind of network a port is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum NicKind {
    InfiniBand,
    RoCE,
    Ethernet,
    /// A kernel interface over InfiniBand (IPoIB, `ib0`): sockets, not verbs.
    IpOverIb,
}

impl std::fmt::Display for NicKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NicKind::InfiniBand => "InfiniBand",
            NicKind::RoCE => "RoCE",
            NicKind::Ethernet => "Ethernet",
            NicKind::IpOverIb => "IPoIB",
        })
    }
}

impl Net {
    /// Whether the port is an RDMA (verbs) device rather than a kernel
    /// interface driven through sockets. The `rdma` attribute decides when
    /// present (braid writes it). NCCL's files lack it; there NCCL's own
    /// conventions decide: its socket transport writes `port="0"` (and a
    /// `guid` that is just the device index, `0x0` for the first), its IB
    /// transport ports count from 1. So: port 0 → socket; a verbs device
    /// name (`mlx5_0`, `efa_0`, `irdma0`, ...) → RDMA; otherwise a port of
    /// 1 or more, or a GUID other than 0, → RDMA; anything else → socket.
    pub fn is_rdma(&self) -> bool {
        if let Some(r) = self.rdma {
            return r;
        }
        if self.port == Some(0) {
            return false;
        }
        const VERBS: [&str; 14] = [
            "mlx4_", "mlx5_", "bnxt_re", "irdma", "efa_", "rxe", "siw", "qedr", "qib", "hfi1_",
            "cxgb4_", "hns_", "erdma_", "ionic_",
        ];
        if VERBS.iter().any(|p| self.name.starts_with(p)) {
            return true;
        }
        if self.port.is_some_and(|p| p >= 1) {
            return true;
        }
        self.guid.as_deref().is_some_and(|g| {
            let h = g.trim().trim_start_matches("0x").trim_start_matches("0X");
            u64::from_str_radix(h, 16).is_ok_and(|v| v != 0)
        })
    }

    /// InfiniBand, RoCE (RDMA over Ethernet), IPoIB (a kernel interface on
    /// InfiniBand) or plain Ethernet.
    pub fn kind(&self) -> NicKind {
        let ll = self.link_layer.as_deref().unwrap_or("");
        let eth = ll.eq_ignore_ascii_case("ethernet");
        let ib = ll.eq_ignore_ascii_case("infiniband");
        match (self.is_rdma(), eth, ib) {
            (true, true, _) => NicKind::RoCE,
            (true, false, _) => NicKind::InfiniBand,
            (false, _, true) => NicKind::IpOverIb,
            (false, _, false) => NicKind::Ethernet,
        }
    }

    /// Whether the port is usable: `ACTIVE` / `up`, or unknown state.
    pub fn is_up(&self) -> bool {
        match self.state.as_deref() {
            None => true,
            Some(s) => {
                let s = s.to_ascii_lowercase();
                s.contains("active") && !s.contains("inactive") || s == "up" || s == "unknown"
            }
        }
    }

    /// Bandwidth in GB/s (`speed / 8000`), if the speed is known.
    pub fn bw(&self) -> Option<f64> {
        self.speed.filter(|&s| s > 0).map(|s| s as f64 / 8000.0)
    }
}

impl Pci {
    /// The top byte of the class code: 0x03 display, 0x02 network, 0x06 bridge.
    pub fn base_class(&self) -> Option<u8> {
        self.class.map(|c| (c >> 16) as u8)
    }
    /// A GPU: has a `gpu` child, or is a display-class endpoint (partial files).
    pub fn is_gpu(&self) -> bool {
        self.gpu.is_some() || (self.base_class() == Some(0x03) && self.nic.is_none())
    }
    /// A NIC: has a `nic` child, or is a network-class endpoint (partial files).
    pub fn is_nic(&self) -> bool {
        self.nic.is_some() || (self.base_class() == Some(0x02) && self.gpu.is_none())
    }
    /// An NVSwitch (class 0x068000).
    pub fn is_nvswitch(&self) -> bool {
        self.class == Some(0x068000)
    }
    /// Link bandwidth in GB/s from `link_speed` × `link_width` (NCCL's rule:
    /// width × per-lane rate / 80, per-lane in units of 100 Mbit/s), if both
    /// are known. A width of 0 is 16 lanes, as NCCL reads it ("speed not
    /// indicated in /sys").
    pub fn link_bw(&self) -> Option<f64> {
        let per_lane = pcie_per_lane(self.link_speed.as_deref()?)?;
        let width = self.link_width.map(|w| if w == 0 { 16 } else { w })?;
        Some(width as f64 * per_lane / 80.0)
    }

    /// The bandwidth NCCL gives this link, GB/s: [`Pci::link_bw`], with a
    /// missing or 0 width taken as 16 lanes and an unknown speed as NCCL's
    /// fallback of 6 Gbit/s a lane (PCIe Gen3): 12 GB/s when nothing is known.
    pub fn nccl_link_bw(&self) -> f64 {
        let per_lane = self
            .link_speed
            .as_deref()
            .and_then(pcie_per_lane)
            .unwrap_or(60.0);
        let width = match self.link_width {
            None | Some(0) => 16,
            Some(w) => w,
        };
        width as f64 * per_lane / 80.0
    }

    /// Every `gpu` element of this device ([`Pci::gpu`] then [`Pci::extra_gpus`]).
    pub fn all_gpus(&self) -> impl Iterator<Item = &Gpu> {
        self.gpu.iter().chain(self.extra_gpus.iter())
    }
    /// Visit this device and every device below it.
    pub fn walk<'a>(&'a self, f: &mut impl FnMut(&'a Pci)) {
        f(self);
        for c in &self.children {
            c.walk(f);
        }
    }
}

/// Per-lane PCIe rate in units of 100 Mbit/s for a `link_speed` string
/// ("8.0 GT/s PCIe", "16 GT/s", "2.5 GT/s").
pub fn pcie_per_lane(speed: &str) -> Option<f64> {
    let num: String = speed
        .trim()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let gts: f64 = num.parse().ok()?;
    Some(match gts {
        g if g <= 2.5 => 15.0,
        g if g <= 5.0 => 30.0,
        g if g <= 8.0 => 60.0,
        g if g <= 16.0 => 120.0,
        g if g <= 32.0 => 240.0,
        _ => 480.0,
    })
}

impl CpuSet {
    /// Parse a sysfs `cpumap` / NCCL `affinity` mask: comma-separated 32-bit
    /// hex groups, most significant first (`"00000000,0000ffff"`).
    pub fn from_mask(mask: &str) -> Option<CpuSet> {
        let mut cpus = Vec::new();
        let groups: Vec<&str> = mask.trim().split(',').collect();
        for (i, g) in groups.iter().rev().enumerate() {
            let g = g.trim().trim_start_matches("0x");
            if g.is_empty() {
                return None;
            }
            let v = u32::from_str_radix(g, 16).ok()?;
            for b in 0..32 {
                if v & (1 << b) != 0 {
                    let c = u32::try_from(i).ok()?.checked_mul(32)? + b;
                    if c >= MAX_CPUS {
                        return None;
                    }
                    cpus.push(c);
                }
            }
        }
        cpus.sort_unstable();
        Some(CpuSet(cpus))
    }

    /// Parse a sysfs `cpulist` (`"0-3,8,10-11"`).
    pub fn from_list(list: &str) -> Option<CpuSet> {
        let mut cpus = Vec::new();
        for part in list.trim().split(',').filter(|p| !p.is_empty()) {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                    if b < a || b >= MAX_CPUS {
                        return None;
                    }
                    cpus.extend(a..=b);
                }
                None => cpus.push(part.trim().parse().ok().filter(|&c| c < MAX_CPUS)?),
            }
        }
        cpus.sort_unstable();
        cpus.dedup();
        Some(CpuSet(cpus))
    }

    /// The mask in sysfs `cpumap` format (8 hex digits per group).
    pub fn to_mask(&self) -> String {
        let groups = self.0.iter().max().map_or(1, |m| *m as usize / 32 + 1);
        let mut words = vec![0u32; groups];
        for &c in &self.0 {
            words[c as usize / 32] |= 1 << (c % 32);
        }
        words
            .iter()
            .rev()
            .map(|w| format!("{w:08x}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The list in sysfs `cpulist` format (`"0-3,8"`).
    pub fn to_list(&self) -> String {
        let mut out: Vec<String> = Vec::new();
        let mut i = 0;
        while i < self.0.len() {
            let start = self.0[i];
            let mut end = start;
            while i + 1 < self.0.len() && self.0[i + 1] == end + 1 {
                i += 1;
                end += 1;
            }
            out.push(if start == end {
                start.to_string()
            } else {
                format!("{start}-{end}")
            });
            i += 1;
        }
        out.join(",")
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A GPU found in the model, with where it sits.
#[derive(Clone, Debug)]
pub struct GpuRef<'a> {
    pub numaid: i32,
    pub pci: &'a Pci,
}

/// A network port found in the model, with where it sits.
#[derive(Clone, Debug)]
pub struct NetRef<'a> {
    pub numaid: i32,
    /// The PCI function of the NIC (None for NICs outside the PCI tree).
    pub pci: Option<&'a Pci>,
    pub net: &'a Net,
}

impl System {
    /// Every GPU (a `gpu` element or a display-class PCI endpoint), ordered by
    /// device index, then bus id.
    pub fn gpus(&self) -> Vec<GpuRef<'_>> {
        let mut out = Vec::new();
        for cpu in &self.cpus {
            for p in &cpu.pci {
                p.walk(&mut |d| {
                    if d.is_gpu() {
                        out.push(GpuRef {
                            numaid: cpu.numaid,
                            pci: d,
                        })
                    }
                });
            }
        }
        out.sort_by(|a, b| {
            let da = a.pci.gpu.as_ref().and_then(|g| g.dev).unwrap_or(u32::MAX);
            let db = b.pci.gpu.as_ref().and_then(|g| g.dev).unwrap_or(u32::MAX);
            (da, &a.pci.busid).cmp(&(db, &b.pci.busid))
        });
        out
    }

    /// Every network port, in model order. A NIC endpoint from a partial file
    /// (no `nic` element) shows up as one port named after its bus id.
    pub fn nets(&self) -> Vec<NetRef<'_>> {
        let mut out = Vec::new();
        for cpu in &self.cpus {
            for p in &cpu.pci {
                p.walk(&mut |d| {
                    if let Some(nic) = &d.nic {
                        for n in &nic.nets {
                            out.push(NetRef {
                                numaid: cpu.numaid,
                                pci: Some(d),
                                net: n,
                            });
                        }
                    }
                });
            }
            for nic in &cpu.nics {
                for n in &nic.nets {
                    out.push(NetRef {
                        numaid: cpu.numaid,
                        pci: None,
                        net: n,
                    });
                }
            }
        }
        out
    }

    /// NIC-class PCI endpoints that carry no `nic` element (partial files).
    pub fn bare_nic_endpoints(&self) -> Vec<(i32, &Pci)> {
        let mut out = Vec::new();
        for cpu in &self.cpus {
            for p in &cpu.pci {
                p.walk(&mut |d| {
                    if d.is_nic() && d.nic.is_none() {
                        out.push((cpu.numaid, d));
                    }
                });
            }
        }
        out
    }

    /// Find a PCI device by bus id (case-insensitive).
    pub fn find_pci(&self, busid: &str) -> Option<&Pci> {
        let want = busid.to_ascii_lowercase();
        let mut found = None;
        for cpu in &self.cpus {
            for p in &cpu.pci {
                p.walk(&mut |d| {
                    if found.is_none() && d.busid.eq_ignore_ascii_case(&want) {
                        found = Some(d);
                    }
                });
            }
        }
        found
    }

    /// Number of distinct CPUs over all NUMA nodes (a CPU listed by two
    /// nodes counts once).
    pub fn cpu_count(&self) -> usize {
        let mut all: Vec<u32> = self
            .cpus
            .iter()
            .filter_map(|c| c.affinity.as_ref())
            .flat_map(|a| a.0.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    }

    /// The NUMA nodes proper (not NCCL's node -1 of CPUs whose node is
    /// unknown or offline).
    pub fn numa_nodes(&self) -> usize {
        self.cpus.iter().filter(|c| c.numaid >= 0).count()
    }

    /// NUMA nodes with CPUs (memory-only nodes, such as CXL or HBM
    /// expanders, have none and get no ranks). A node whose CPUs are not
    /// known counts as having some.
    pub fn cpu_nodes(&self) -> impl Iterator<Item = &Cpu> {
        self.cpus
            .iter()
            .filter(|c| c.affinity.as_ref().is_none_or(|a| !a.is_empty()))
    }

    /// The distinct NVSwitches the GPUs' NVLinks lead to (`tclass`
    /// 0x068000), by bus id, sorted.
    pub fn nvswitches(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .gpus()
            .iter()
            .filter_map(|g| g.pci.gpu.as_ref())
            .flat_map(|g| g.nvlinks.iter())
            .filter(|l| l.tclass == Some(0x068000))
            .map(|l| l.target.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

//! Detection from sysfs under an injected root, recording of what was read,
//! and writing a sysfs tree for a model (hand-built fixtures).
//!
//! The root is a directory that holds `sys/` (and optionally `proc/cpuinfo`,
//! `proc/sys/kernel/hostname` and `proc/driver/nvidia/gpus`); on a live
//! machine it is `/`. Detection reads what hwloc reads for the host and
//! NCCL for the devices:
//!
//! - `sys/devices/system/node/node<N>/cpumap` (or `cpulist`), restricted to
//!   `sys/devices/system/cpu/online`: NUMA nodes. As hwloc: a node whose
//!   CPUs overlap an earlier node's is dropped (buggy firmware); a node
//!   without CPUs is kept as memory only (no rank is placed there); NVIDIA
//!   GPU memory shown as a node (`proc/driver/nvidia/gpus/*/numa_status`)
//!   is dropped on POWER; online CPUs of an offline node are kept as node
//!   -1. Without node directories, one node with the online CPUs. Trailing
//!   NUL bytes (some ARM kernels) are ignored.
//! - `sys/bus/pci/devices/<bdf>` → its real path gives the PCI ancestry; each
//!   level's `class`, `vendor`, `device`, `subsystem_*`, `max_link_speed`,
//!   `max_link_width`, `numa_node` (else `local_cpus`, as hwloc). As NCCL
//!   does, the walk up skips one level at a time (the downstream port of a
//!   switch, or the root port), so a PCIe switch is one node. The list may
//!   be missing (CPU-only captures): no PCI device is placed then.
//! - `sys/class/infiniband/<dev>/{device,node_guid,ports/<p>/{state,rate,link_layer}}`:
//!   RDMA ports (InfiniBand or RoCE).
//! - `sys/class/net/<if>/{device,speed,operstate,type}`: kernel interfaces
//!   with a device behind them (virtual ones like `lo` are skipped; type 32
//!   is IPoIB). The functions of one adapter are one NIC (function 0).
//! - `sys/module/nvidia_peermem` (or `sys/kernel/mm/memory_peers/nv_mem`): GPUDirect RDMA.
//!
//! GPUs do not come from sysfs but from a [`GpuProvider`]: braid-core does
//! not link CUDA or NVML. [`NoGpus`] reports none (not an error);
//! [`RecordedGpus`] reads `<gpus><gpu busid=.. dev=.. sm=..><nvlink .../></gpu></gpus>`
//! (the answers NVML would give, recorded in a fixture as `nvml-gpus.xml`);
//! [`super::nvml::NvmlGpus`] asks NVML (recorded answers, or `braid-cuda`'s
//! run-time loaded library) as NCCL does.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Component, Path, PathBuf};

use super::model::{Cpu, CpuSet, Gpu, Net, Nic, Pci, System};
use super::xml::parse_document;
use super::TopoError;

/// A GPU reported by a provider: its bus id and what NVML / CUDA says about it.
#[derive(Clone, Debug, PartialEq)]
pub struct DetectedGpu {
    pub busid: String,
    pub gpu: Gpu,
}

/// Where GPUs come from (NVML, the CUDA driver, a recording).
pub trait GpuProvider {
    /// A short name for reports (`none`, `recorded:<file>`, `nvml`).
    fn name(&self) -> String;
    /// The GPUs; an absent driver is `Ok(vec![])`, never an error.
    fn gpus(&self) -> Result<Vec<DetectedGpu>, TopoError>;
}

/// No GPU provider: reports no GPUs.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoGpus;

impl GpuProvider for NoGpus {
    fn name(&self) -> String {
        "none (braid-core does not load NVML/CUDA)".into()
    }
    fn gpus(&self) -> Result<Vec<DetectedGpu>, TopoError> {
        Ok(Vec::new())
    }
}

/// GPUs recorded in an XML file (`<gpus><gpu busid=...>...</gpu></gpus>`).
#[derive(Clone, Debug)]
pub struct RecordedGpus {
    pub file: PathBuf,
}

/// The file name [`RecordedGpus`] is looked up under in a fixture root.
pub const RECORDED_GPUS_FILE: &str = "nvml-gpus.xml";

impl RecordedGpus {
    /// `<root>/nvml-gpus.xml` if it exists.
    pub fn in_root(root: &Path) -> Option<RecordedGpus> {
        let f = root.join(RECORDED_GPUS_FILE);
        f.is_file().then_some(RecordedGpus { file: f })
    }

    /// Parse the recorded-GPU XML text.
    pub fn parse(file: &str, text: &str) -> Result<Vec<DetectedGpu>, TopoError> {
        let root = parse_document(file, text)?;
        if root.name != "gpus" {
            return Err(TopoError::Parse {
                file: file.into(),
                line: root.line,
                msg: format!("root element is <{}>, expected <gpus>", root.name),
            });
        }
        let mut out = Vec::new();
        for g in &root.children {
            if g.name != "gpu" {
                continue;
            }
            // Reuse the <pci><gpu/></pci> importer by wrapping.
            let busid = g
                .attrs
                .iter()
                .find(|(k, _)| k == "busid")
                .map(|(_, v)| v.trim().to_ascii_lowercase())
                .ok_or_else(|| TopoError::Parse {
                    file: file.into(),
                    line: g.line,
                    msg: "<gpu> without a busid attribute".into(),
                })?;
            let mut g2 = g.clone();
            g2.attrs.retain(|(k, _)| k != "busid");
            let gpu = super::xml::element_to_gpu(file, &g2)?;
            out.push(DetectedGpu { busid, gpu });
        }
        Ok(out)
    }

    /// Write GPUs in the recorded format.
    pub fn render(gpus: &[DetectedGpu]) -> String {
        let v: Vec<(String, Gpu)> = gpus
            .iter()
            .map(|g| (g.busid.clone(), g.gpu.clone()))
            .collect();
        super::xml::gpus_to_xml(&v)
    }
}

impl GpuProvider for RecordedGpus {
    fn name(&self) -> String {
        let name = self.file.file_name().map_or_else(
            || self.file.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        format!("recorded ({name})")
    }
    fn gpus(&self) -> Result<Vec<DetectedGpu>, TopoError> {
        let f = self.file.display().to_string();
        let text = fs::read_to_string(&self.file).map_err(|e| TopoError::Io {
            path: f.clone(),
            msg: e.to_string(),
        })?;
        RecordedGpus::parse(&f, &text)
    }
}

/// What detection found, plus notes for people.
#[derive(Clone, Debug)]
pub struct Detected {
    pub system: System,
    /// Facts worth telling (no GPU provider, devices skipped, ...).
    pub notes: Vec<String>,
}

#[derive(Default, Debug)]
struct Recording {
    files: BTreeMap<PathBuf, Vec<u8>>,
    links: BTreeMap<PathBuf, PathBuf>,
}

/// Reads files under a root, resolving symlinks inside it, optionally
/// recording every file and link it touched.
#[derive(Debug)]
pub struct SysfsReader {
    root: PathBuf,
    rec: Option<RefCell<Recording>>,
    /// The first read that failed for want of descriptors or memory
    /// (path, error): what detection found is then not this machine.
    exhausted: RefCell<Option<(PathBuf, String)>>,
}

/// Whether a failed read says the process is out of descriptors or memory
/// (as opposed to a file that is absent or unreadable for everyone).
fn is_exhaustion(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS)
    )
}

/// The error of a detection cut short by `e` at `path`.
fn exhausted_error(path: &Path, e: &str) -> TopoError {
    TopoError::Exhausted {
        path: path.display().to_string(),
        msg: format!(
            "{e}: this process is out of file descriptors (or memory), so topology detection \
             cannot read this machine; raise the limit (`ulimit -n`) or close what holds them"
        ),
    }
}

impl SysfsReader {
    /// A reader for `root` (the directory holding `sys/`). A directory that
    /// is itself a sysfs (holds `bus/` and `devices/`) is accepted too. The
    /// PCI device list (`sys/bus/pci/devices`) may be missing: detection
    /// then finds no PCI devices and says so.
    pub fn new(root: impl Into<PathBuf>) -> Result<SysfsReader, TopoError> {
        let root: PathBuf = root.into();
        let root = if !root.join("sys").is_dir() && root.join("bus").is_dir() {
            // Given the sysfs itself: treat its parent as the root only if it is named sys.
            match root.file_name() {
                Some(n) if n == "sys" => root.parent().map(Path::to_path_buf).unwrap_or(root),
                _ => {
                    return Err(TopoError::Io {
                        path: root.display().to_string(),
                        msg: "looks like a sysfs but is not named 'sys'; pass the directory that contains sys/".into(),
                    })
                }
            }
        } else {
            root
        };
        // A tree without the PCI device list (many captures of CPU-only
        // machines) still has NUMA nodes and CPUs: detection says so in a
        // note. Only a root without sys/ is refused.
        let sys = root.join("sys");
        if let Err(e) = fs::read_dir(&sys) {
            if is_exhaustion(&e) {
                return Err(exhausted_error(&sys, &e.to_string()));
            }
            return Err(TopoError::Io {
                path: sys.display().to_string(),
                msg: format!("cannot read the sysfs tree ({e}); is the root a sysfs tree (it must hold sys/)?"),
            });
        }
        Ok(SysfsReader {
            root,
            rec: None,
            exhausted: RefCell::new(None),
        })
    }

    /// Like [`SysfsReader::new`], recording every file and symlink read.
    pub fn recording(root: impl Into<PathBuf>) -> Result<SysfsReader, TopoError> {
        let mut r = SysfsReader::new(root)?;
        r.rec = Some(RefCell::new(Recording::default()));
        Ok(r)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Notes a failed access to `path` if it failed for want of
    /// descriptors or memory.
    fn check(&self, path: &Path, e: &std::io::Error) {
        if is_exhaustion(e) {
            let mut x = self.exhausted.borrow_mut();
            if x.is_none() {
                *x = Some((path.to_path_buf(), e.to_string()));
            }
        }
    }

    /// An error if some read failed for want of descriptors or memory:
    /// what was read does not describe this machine.
    pub fn complete(&self) -> Result<(), TopoError> {
        match &*self.exhausted.borrow() {
            Some((p, e)) => Err(exhausted_error(p, e)),
            None => Ok(()),
        }
    }

    /// Resolve a root-relative path, following symlinks inside the root.
    fn resolve(&self, rel: &Path) -> PathBuf {
        self.resolve_depth(rel, 0)
    }

    fn resolve_depth(&self, rel: &Path, depth: usize) -> PathBuf {
        let mut cur = PathBuf::new();
        for comp in rel.components() {
            match comp {
                Component::Normal(c) => {
                    let cand = cur.join(c);
                    let full = self.root.join(&cand);
                    let meta = fs::symlink_metadata(&full);
                    if let Err(e) = &meta {
                        self.check(&full, e);
                    }
                    match meta {
                        Ok(m) if m.file_type().is_symlink() && depth < 40 => {
                            let Ok(target) = fs::read_link(&full) else {
                                cur = cand;
                                continue;
                            };
                            if let Some(r) = &self.rec {
                                r.borrow_mut().links.insert(cand.clone(), target.clone());
                            }
                            let joined = if target.is_absolute() {
                                target.strip_prefix("/").unwrap_or(&target).to_path_buf()
                            } else {
                                cur.join(&target)
                            };
                            cur = self.resolve_depth(&joined, depth + 1);
                        }
                        _ => cur = cand,
                    }
                }
                Component::ParentDir => {
                    cur.pop();
                }
                _ => {}
            }
        }
        cur
    }

    /// Read a small text file, trimmed of white space and of the NUL bytes
    /// some kernels leave at the end of sysfs files (an ARM Kunpeng 920's
    /// node `cpumap` ends in `\n\0`); None if absent or unreadable.
    pub fn read(&self, rel: impl AsRef<Path>) -> Option<String> {
        let r = self.resolve(rel.as_ref());
        let full = self.root.join(&r);
        let bytes = match fs::read(&full) {
            Ok(b) => b,
            Err(e) => {
                self.check(&full, &e);
                return None;
            }
        };
        if let Some(rec) = &self.rec {
            rec.borrow_mut().files.insert(r, bytes.clone());
        }
        Some(
            String::from_utf8_lossy(&bytes)
                .trim_matches(|c: char| c == '\0' || c.is_whitespace())
                .to_string(),
        )
    }

    /// The resolved (real) root-relative path.
    pub fn real(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.resolve(rel.as_ref())
    }

    /// Whether a path exists.
    pub fn exists(&self, rel: impl AsRef<Path>) -> bool {
        let r = self.resolve(rel.as_ref());
        let ok = match fs::metadata(self.root.join(&r)) {
            Ok(_) => true,
            Err(e) => {
                self.check(&self.root.join(&r), &e);
                false
            }
        };
        if ok {
            if let Some(rec) = &self.rec {
                let mut rec = rec.borrow_mut();
                if self.root.join(&r).is_dir() {
                    rec.files.entry(r.join(".keep")).or_default();
                } else if let Ok(b) = fs::read(self.root.join(&r)) {
                    rec.files.insert(r, b);
                }
            }
        }
        ok
    }

    /// Sorted entry names of a directory (empty if absent).
    pub fn list(&self, rel: impl AsRef<Path>) -> Vec<String> {
        let r = self.resolve(rel.as_ref());
        let rd = match fs::read_dir(self.root.join(&r)) {
            Ok(rd) => rd,
            Err(e) => {
                self.check(&self.root.join(&r), &e);
                return Vec::new();
            }
        };
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort_by_key(|a| natural(a));
        if let Some(rec) = &self.rec {
            let mut rec = rec.borrow_mut();
            for n in &names {
                let p = r.join(n);
                if let Ok(t) = fs::read_link(self.root.join(&p)) {
                    rec.links.insert(p, t);
                }
            }
        }
        names
    }

    /// Write what was read into `out` (a new fixture root). Returns the number
    /// of files and links written.
    pub fn write_recording(&self, out: &Path) -> Result<(usize, usize), TopoError> {
        let io = |p: &Path, e: std::io::Error| TopoError::Io {
            path: p.display().to_string(),
            msg: e.to_string(),
        };
        let Some(rec) = &self.rec else {
            return Ok((0, 0));
        };
        let rec = rec.borrow();
        for (p, bytes) in &rec.files {
            let dst = out.join(p);
            if let Some(d) = dst.parent() {
                fs::create_dir_all(d).map_err(|e| io(d, e))?;
            }
            if p.file_name().is_some_and(|n| n == ".keep") {
                continue;
            }
            fs::write(&dst, bytes).map_err(|e| io(&dst, e))?;
        }
        for (p, target) in &rec.links {
            let dst = out.join(p);
            if let Some(d) = dst.parent() {
                fs::create_dir_all(d).map_err(|e| io(d, e))?;
            }
            let _ = fs::remove_file(&dst);
            symlink(target, &dst).map_err(|e| io(&dst, e))?;
        }
        Ok((rec.files.len(), rec.links.len()))
    }
}

#[cfg(unix)]
fn symlink(target: &Path, dst: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, dst)
}

#[cfg(not(unix))]
fn symlink(_target: &Path, _dst: &Path) -> std::io::Result<()> {
    Err(std::io::Error::other("symlinks need a unix host"))
}

/// Sort key that orders `node10` after `node9`.
fn natural(s: &str) -> (String, u64, String) {
    let digits_at = s.find(|c: char| c.is_ascii_digit()).unwrap_or(s.len());
    let (head, rest) = s.split_at(digits_at);
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let n = rest[..end].parse().unwrap_or(0);
    (head.to_string(), n, rest[end..].to_string())
}

/// Whether `s` looks like a PCI address `DDDD:BB:DD.F` (the domain may
/// have up to 8 hex digits: Linux prints 32-bit domains such as `10000` in
/// full).
pub fn is_bdf(s: &str) -> bool {
    let Some((dom, rest)) = s.split_once(':') else {
        return false;
    };
    let b = rest.as_bytes();
    (4..=8).contains(&dom.len())
        && dom.chars().all(|c| c.is_ascii_hexdigit())
        && b.len() == 7
        && b[2] == b':'
        && b[5] == b'.'
        && rest
            .chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 2 | 5) || c.is_ascii_hexdigit())
}

/// `DDDD:BB:DD.0` for `DDDD:BB:DD.F`: function 0 of the same device.
fn function_zero(busid: &str) -> String {
    match busid.rsplit_once('.') {
        Some((dev, _)) => format!("{dev}.0"),
        None => busid.to_string(),
    }
}

fn hex_u32(s: &str) -> Option<u32> {
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

/// Detect the host under `reader`'s root, with GPUs from `gpus`.
pub fn detect(reader: &SysfsReader, gpus: &dyn GpuProvider) -> Result<Detected, TopoError> {
    let mut notes = Vec::new();
    let mut sys = System {
        name: reader.read("proc/sys/kernel/hostname"),
        ..Default::default()
    };
    sys.cpus = numa_nodes(reader, &mut notes);
    if reader.list("sys/bus/pci/devices").is_empty() {
        notes.push(
            "no PCI devices (sys/bus/pci/devices is empty or absent): no GPU or NIC can be placed"
                .into(),
        );
    }
    add_gpus(reader, gpus, &mut sys, &mut notes)?;
    add_rdma_devices(reader, &mut sys, &mut notes);
    add_interfaces(reader, &mut sys, &mut notes);
    reader.complete()?;
    Ok(Detected { system: sys, notes })
}

/// The NUMA nodes, as hwloc reads them: the node's cpumap (its cpulist
/// when there is none), restricted to the online CPUs; a node whose CPUs
/// overlap an earlier node's is a firmware error and is dropped; nodes
/// without CPUs are memory-only (kept, but no rank goes there); NVIDIA
/// GPU memory shown as NUMA nodes (POWER9 with NVLink to the CPU) is
/// dropped on POWER, as hwloc hides it there. Online CPUs in no node
/// become node -1 ([`loose_cpus`]); with no node at all, one node 0 holds
/// every online CPU.
fn numa_nodes(reader: &SysfsReader, notes: &mut Vec<String>) -> Vec<Cpu> {
    let info = cpuinfo(reader);
    let online = reader
        .read("sys/devices/system/cpu/online")
        .and_then(|l| CpuSet::from_list(&l));
    let gpu_nodes = nvidia_gpu_numa_nodes(reader);
    let mut cpus = Vec::new();
    let mut seen: Vec<u32> = Vec::new();
    for n in reader.list("sys/devices/system/node") {
        let Some(id) = n.strip_prefix("node").and_then(|i| i.parse::<i32>().ok()) else {
            continue;
        };
        let base = format!("sys/devices/system/node/{n}");
        let mut aff = reader
            .read(format!("{base}/cpumap"))
            .and_then(|m| CpuSet::from_mask(&m))
            .or_else(|| {
                reader
                    .read(format!("{base}/cpulist"))
                    .and_then(|l| CpuSet::from_list(&l))
            });
        if let (Some(a), Some(on)) = (&mut aff, &online) {
            a.0.retain(|c| on.0.contains(c));
        }
        if let Some(a) = &aff {
            if a.0.iter().any(|c| seen.contains(c)) {
                notes.push(format!(
                    "NUMA node {id}: its CPUs ({}) overlap an earlier node's (a firmware error): node ignored, as hwloc does",
                    a.to_list()
                ));
                continue;
            }
            seen.extend(a.0.iter().copied());
        }
        let mut attrs = super::model::Attrs::new();
        if let Some(gpu) = gpu_nodes.iter().find(|(node, _)| *node == id).map(|x| &x.1) {
            if info.arch.as_deref().is_some_and(|a| a.starts_with("ppc")) {
                notes.push(format!(
                    "NUMA node {id} is the memory of GPU {gpu}: ignored on POWER, as hwloc does"
                ));
                continue;
            }
            attrs.insert("gpu_memory".into(), gpu.clone());
        }
        if aff.as_ref().is_some_and(CpuSet::is_empty) {
            notes.push(format!(
                "NUMA node {id} has no CPUs (memory only): no ranks are placed there"
            ));
        }
        cpus.push(info.node(id, aff, attrs));
    }
    if let (Some(on), false) = (&online, cpus.is_empty()) {
        cpus.extend(loose_cpus(&info, on, &seen, notes));
    }
    if cpus.is_empty() {
        notes.push("no NUMA nodes under sys/devices/system/node: assuming one node".into());
        cpus.push(info.node(0, online, super::model::Attrs::new()));
    }
    cpus
}

/// Online CPUs that no node lists (`seen` holds those the nodes list; their
/// node is offline): hwloc keeps them, outside any NUMA node; braid puts
/// them in NCCL's "unknown" node, -1. None when there are none.
fn loose_cpus(
    info: &CpuInfo,
    online: &CpuSet,
    seen: &[u32],
    notes: &mut Vec<String>,
) -> Option<Cpu> {
    let loose: Vec<u32> = online
        .0
        .iter()
        .copied()
        .filter(|c| !seen.contains(c))
        .collect();
    if loose.is_empty() {
        return None;
    }
    let loose = CpuSet(loose);
    notes.push(format!(
        "CPUs {} are online but in no NUMA node (their node is offline): kept as node -1",
        loose.to_list()
    ));
    let mut attrs = super::model::Attrs::new();
    attrs.insert("no_numa_node".into(), "1".into());
    Some(info.node(-1, Some(loose), attrs))
}

/// The GPUs `gpus` reports, placed in the PCI tree; NVLinks whose far end
/// is unknown lead to the class of the peer's PCI function, or to an
/// NVSwitch where the peer is not visible (VMs), as NCCL does.
fn add_gpus(
    reader: &SysfsReader,
    gpus: &dyn GpuProvider,
    sys: &mut System,
    notes: &mut Vec<String>,
) -> Result<(), TopoError> {
    let provided = gpus.gpus()?;
    if provided.is_empty() {
        notes.push(format!("GPU provider {}: no GPUs", gpus.name()));
    } else {
        notes.push(format!(
            "GPU provider {}: {} GPU(s)",
            gpus.name(),
            provided.len()
        ));
    }
    for mut g in provided {
        for l in g.gpu.nvlinks.iter_mut().filter(|l| l.tclass.is_none()) {
            let class = reader
                .read(format!("sys/bus/pci/devices/{}/class", l.target))
                .and_then(|c| hex_u32(&c));
            l.tclass = Some(class.unwrap_or(0x068000));
        }
        let pci = insert_pci(reader, sys, &g.busid, notes);
        pci.gpu = Some(g.gpu);
    }
    Ok(())
}

/// The RDMA devices under `sys/class/infiniband`: one net per port
/// (`mlx5_0`, then `mlx5_0:2`, ...), numbered in order of discovery,
/// attached to the device's PCI function.
fn add_rdma_devices(reader: &SysfsReader, sys: &mut System, notes: &mut Vec<String>) {
    let gdr = reader.exists("sys/module/nvidia_peermem")
        || reader.exists("sys/kernel/mm/memory_peers/nv_mem/version");
    let ib = reader.list("sys/class/infiniband");
    if ib.is_empty() {
        notes.push("no RDMA devices (sys/class/infiniband is empty or absent)".into());
    }
    let mut rdma_dev = 0u32;
    for dev in &ib {
        let base = format!("sys/class/infiniband/{dev}");
        let guid = reader.read(format!("{base}/node_guid")).map(|g| {
            let h: String = g.chars().filter(|c| c.is_ascii_hexdigit()).collect();
            format!("0x{}", h.trim_start_matches('0'))
        });
        let mut nets = Vec::new();
        for port in reader.list(format!("{base}/ports")) {
            let Ok(pn) = port.parse::<u32>() else {
                continue;
            };
            let mut net = rdma_port(reader, dev, &format!("{base}/ports/{port}"), pn);
            net.dev = Some(rdma_dev);
            net.guid = guid.clone();
            net.gdr = Some(gdr);
            nets.push(net);
            rdma_dev += 1;
        }
        attach_nets(reader, sys, &format!("{base}/device"), nets, notes);
    }
}

/// Port `pn` of RDMA device `dev`, read from its directory `pb`: name,
/// state, rate and link layer (the device's own facts are the caller's).
fn rdma_port(reader: &SysfsReader, dev: &str, pb: &str, pn: u32) -> Net {
    let state = reader
        .read(format!("{pb}/state"))
        .map(|s| s.split(':').next_back().unwrap_or("").trim().to_string());
    let speed = reader.read(format!("{pb}/rate")).and_then(|r| {
        let num: String = r
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        num.parse::<f64>().ok().map(|g| (g * 1000.0) as u64)
    });
    Net {
        name: if pn == 1 {
            dev.to_string()
        } else {
            format!("{dev}:{pn}")
        },
        speed,
        port: Some(pn),
        link_layer: reader.read(format!("{pb}/link_layer")),
        state,
        rdma: Some(true),
        ..Default::default()
    }
}

/// The kernel network interfaces under `sys/class/net` that are backed by
/// a device (not virtual ones), numbered in order, attached to their PCI
/// function.
fn add_interfaces(reader: &SysfsReader, sys: &mut System, notes: &mut Vec<String>) {
    let mut sock_dev = 0u32;
    for ifname in reader.list("sys/class/net") {
        let base = format!("sys/class/net/{ifname}");
        if !reader.exists(format!("{base}/device")) {
            continue;
        }
        let speed = reader
            .read(format!("{base}/speed"))
            .and_then(|s| s.parse::<i64>().ok())
            .filter(|&s| s > 0)
            .map(|s| s as u64);
        let ll = match reader.read(format!("{base}/type")).as_deref() {
            Some("32") => "InfiniBand",
            _ => "Ethernet",
        };
        let net = Net {
            name: ifname.clone(),
            dev: Some(sock_dev),
            speed,
            link_layer: Some(ll.into()),
            state: reader.read(format!("{base}/operstate")),
            rdma: Some(false),
            ..Default::default()
        };
        sock_dev += 1;
        attach_nets(reader, sys, &format!("{base}/device"), vec![net], notes);
    }
}

/// What `/proc/cpuinfo` says of the CPUs (None where it says nothing).
struct CpuInfo {
    /// `x86_64`, `arm64` or `ppc64`.
    arch: Option<String>,
    vendor: Option<String>,
    family: Option<u32>,
    model: Option<u32>,
}

impl CpuInfo {
    /// NUMA node `numaid` with these CPUs' facts.
    fn node(&self, numaid: i32, affinity: Option<CpuSet>, attrs: super::model::Attrs) -> Cpu {
        Cpu {
            numaid,
            affinity,
            arch: self.arch.clone(),
            vendor: self.vendor.clone(),
            familyid: self.family,
            modelid: self.model,
            attrs,
            ..Default::default()
        }
    }
}

/// The first CPU's vendor, family and model in `/proc/cpuinfo`, and the
/// architecture its fields reveal.
fn cpuinfo(r: &SysfsReader) -> CpuInfo {
    let Some(text) = r.read("proc/cpuinfo") else {
        return CpuInfo {
            arch: None,
            vendor: None,
            family: None,
            model: None,
        };
    };
    let mut vendor = None;
    let mut family = None;
    let mut model = None;
    let mut arch = None;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            if line.trim().is_empty() && vendor.is_some() {
                break;
            }
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        match k {
            "vendor_id" if vendor.is_none() => vendor = Some(v.to_string()),
            "cpu family" if family.is_none() => family = v.parse().ok(),
            "model" if model.is_none() => model = v.parse().ok(),
            "CPU implementer" => arch = Some("arm64".to_string()),
            "cpu" if v.starts_with("POWER") => arch = Some("ppc64".to_string()),
            _ => {}
        }
    }
    if vendor.is_some() && arch.is_none() {
        arch = Some("x86_64".into());
    }
    CpuInfo {
        arch,
        vendor,
        family,
        model,
    }
}

/// Put the nets of one device (found through `device_link`) into the model,
/// merging with a NIC already on the same PCI function.
fn attach_nets(
    r: &SysfsReader,
    sys: &mut System,
    device_link: &str,
    nets: Vec<Net>,
    notes: &mut Vec<String>,
) {
    if nets.is_empty() {
        return;
    }
    let real = r.real(device_link);
    let bdf = real
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .rfind(|c| is_bdf(c))
        .map(str::to_string);
    match bdf {
        Some(b) => {
            // The functions of one adapter (02:00.0 and 02:00.1: two ports
            // of one NIC) are one NIC, as NCCL's IB transport merges them
            // ("merge multi-port NICs into the same PCI device") and as
            // hwloc shows them side by side under one bridge.
            let f0 = function_zero(&b);
            let b = if f0 != b && is_network_function(r, &f0) {
                notes.push(format!(
                    "{} is on {b}, a second function of the adapter at {f0}: one NIC",
                    nets[0].name
                ));
                f0
            } else {
                b
            };
            let pci = insert_pci(r, sys, &b, notes);
            pci.nic.get_or_insert_with(Nic::default).nets.extend(nets);
        }
        None => {
            // Not on PCI (a virtual or platform device): under the NUMA node
            // the device says, else the first one (NCCL: the first CPU).
            let numa = r
                .read(real.join("numa_node"))
                .and_then(|s| s.parse::<i32>().ok());
            let ci = numa
                .and_then(|n| sys.cpus.iter().position(|c| c.numaid == n))
                .unwrap_or(0);
            notes.push(format!(
                "{} is not on PCI ({}); placed under NUMA node {}",
                nets[0].name,
                real.display(),
                sys.cpus[ci].numaid
            ));
            sys.cpus[ci].nics.push(Nic {
                nets,
                attrs: Default::default(),
            });
        }
    }
}

/// Whether the PCI function `busid` exists and is a network or InfiniBand
/// controller (class 0x02xxxx or 0x0c06xx).
fn is_network_function(r: &SysfsReader, busid: &str) -> bool {
    r.read(format!("sys/bus/pci/devices/{busid}/class"))
        .and_then(|c| hex_u32(&c))
        .is_some_and(|c| c >> 16 == 0x02 || c >> 8 == 0x0c06)
}

/// NUMA nodes that are NVIDIA GPU memory, from
/// `proc/driver/nvidia/gpus/<busid>/numa_status` ("Node: N"), with the GPU.
fn nvidia_gpu_numa_nodes(r: &SysfsReader) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for gpu in r.list("proc/driver/nvidia/gpus") {
        let Some(text) = r.read(format!("proc/driver/nvidia/gpus/{gpu}/numa_status")) else {
            continue;
        };
        let node = text.lines().find_map(|l| {
            l.trim()
                .strip_prefix("Node:")
                .and_then(|v| v.trim().parse::<i32>().ok())
        });
        if let Some(n) = node.filter(|&n| n >= 0) {
            out.push((n, gpu.to_ascii_lowercase()));
        }
    }
    out
}

fn pci_attrs(r: &SysfsReader, dir: &Path, parent_port: Option<&Path>, busid: &str) -> Pci {
    let rd = |f: &str| r.read(dir.join(f));
    let speed = rd("max_link_speed").filter(|s| !s.is_empty() && !s.starts_with("Unknown"));
    let mut width = rd("max_link_width")
        .and_then(|w| w.parse::<u32>().ok())
        .filter(|&w| w > 0);
    let mut speed = speed;
    if let Some(pp) = parent_port {
        // The link is as fast as the slower end (device or the port above it).
        let pw = r
            .read(pp.join("max_link_width"))
            .and_then(|w| w.parse::<u32>().ok());
        if let (Some(w), Some(p)) = (width, pw.filter(|&p| p > 0)) {
            width = Some(w.min(p));
        }
        if let (Some(s), Some(ps)) = (&speed, r.read(pp.join("max_link_speed"))) {
            let (a, b) = (
                super::model::pcie_per_lane(s),
                super::model::pcie_per_lane(&ps),
            );
            if let (Some(a), Some(b)) = (a, b) {
                if b < a {
                    speed = Some(ps);
                }
            }
        }
    }
    Pci {
        busid: busid.to_string(),
        class: rd("class").and_then(|c| hex_u32(&c)),
        vendor: rd("vendor"),
        device: rd("device"),
        subsystem_vendor: rd("subsystem_vendor"),
        subsystem_device: rd("subsystem_device"),
        link_speed: speed,
        link_width: width,
        ..Default::default()
    }
}

/// Insert the PCI device `busid` and its ancestry into the model; returns it.
fn insert_pci<'s>(
    r: &SysfsReader,
    sys: &'s mut System,
    busid: &str,
    notes: &mut Vec<String>,
) -> &'s mut Pci {
    let busid = busid.to_ascii_lowercase();
    let real = r.real(format!("sys/bus/pci/devices/{busid}"));
    let comps: Vec<String> = real
        .components()
        .filter_map(|c| c.as_os_str().to_str().map(str::to_string))
        .collect();
    // Levels: everything from the host bridge (sys/devices/pciDDDD:BB) down.
    // A device listed as a plain directory under sys/bus/pci/devices (some
    // captures) has no known ancestry.
    let under_devices = comps
        .iter()
        .position(|c| c == "devices")
        .filter(|&i| i >= 1 && comps[i - 1] == "sys" && !(i >= 2 && comps[i - 2] == "pci"));
    let hb_idx = under_devices.and_then(|d| {
        comps
            .iter()
            .enumerate()
            .skip(d + 1)
            .filter(|(_, c)| c.starts_with("pci") && !is_bdf(c))
            .map(|(i, _)| i)
            .next_back()
    });
    let present = r.root().join(&real).is_dir() && comps.last().is_some_and(|c| c == &busid);
    let (hostbridge, bdfs): (Option<String>, Vec<usize>) = match (present, hb_idx) {
        (true, Some(h)) => (
            Some(comps[h].clone()),
            (h + 1..comps.len())
                .filter(|&i| is_bdf(&comps[i]))
                .collect(),
        ),
        (true, None) => (None, vec![comps.len() - 1]),
        _ => {
            notes.push(format!(
                "{busid} is not in sys/bus/pci/devices: placed directly under the first NUMA node"
            ));
            (None, Vec::new())
        }
    };
    let found = present;
    // Chain from the top: the endpoint, then every second level up (NCCL's walk).
    let mut chain: Vec<Pci> = Vec::new();
    if bdfs.is_empty() {
        chain.push(Pci {
            busid: busid.clone(),
            ..Default::default()
        });
    } else {
        let mut k = bdfs.len() as isize - 1;
        while k >= 0 {
            let i = bdfs[k as usize];
            let dir: PathBuf = comps[..=i].iter().collect();
            let port: Option<PathBuf> =
                (k >= 1).then(|| comps[..=bdfs[k as usize - 1]].iter().collect());
            chain.push(pci_attrs(r, &dir, port.as_deref(), &comps[i]));
            k -= 2;
        }
    }
    chain.reverse();
    // NUMA node: the device's numa_node when it names a node with CPUs,
    // else the node its local_cpus cover most (hwloc's rule), else the
    // first node with CPUs.
    let numa = {
        let dir: PathBuf = comps.iter().collect();
        let by_numa = found
            .then(|| r.read(dir.join("numa_node")))
            .flatten()
            .and_then(|s| s.parse::<i32>().ok())
            .filter(|&n| sys.cpu_nodes().any(|c| c.numaid == n));
        let by_cpus = || {
            let local = r
                .read(dir.join("local_cpus"))
                .and_then(|m| CpuSet::from_mask(&m))?;
            sys.cpu_nodes()
                .filter_map(|c| {
                    let a = c.affinity.as_ref()?;
                    let k = a.0.iter().filter(|x| local.0.contains(x)).count();
                    (k > 0).then_some((k, c.numaid))
                })
                .max_by_key(|&(k, n)| (k, std::cmp::Reverse(n)))
                .map(|(_, n)| n)
        };
        by_numa
            .or_else(|| found.then(by_cpus).flatten())
            .or_else(|| sys.cpu_nodes().next().map(|c| c.numaid))
            .unwrap_or(sys.cpus[0].numaid)
    };
    let ci = sys.cpus.iter().position(|c| c.numaid == numa).unwrap_or(0);
    if let Some(top) = chain.first_mut() {
        top.hostbridge.clone_from(&hostbridge);
    }
    let mut list = &mut sys.cpus[ci].pci;
    let mut chain = chain.into_iter().peekable();
    loop {
        let p = chain.next().unwrap_or_else(|| Pci {
            busid: busid.clone(),
            ..Default::default()
        });
        let pos = match list.iter().position(|x| x.busid == p.busid) {
            Some(i) => i,
            None => {
                let at = list.partition_point(|x| x.busid < p.busid);
                list.insert(at, p);
                at
            }
        };
        if chain.peek().is_none() {
            return &mut list[pos];
        }
        list = &mut list[pos].children;
    }
}

/// Write a sysfs tree (plus `proc/cpuinfo`, hostname and `nvml-gpus.xml`)
/// that [`detect`] turns back into `sys`. Used to build fixtures by hand from
/// a topology XML. Switch downstream ports and root ports are synthesised
/// (bus of the parent + 1, device = child index, skipping bus ids the model
/// uses). Where the model does not name a device's host bridge, each PCI
/// bus gets its own (`pciDDDD:BB`). NICs outside the PCI tree become
/// platform devices with the node's `numa_node`. Returns what detection
/// will not find again (NIC- or GPU-class PCI endpoints without a `nic` or
/// `gpu` element: they are written as PCI devices, but detection lists NICs
/// from `sys/class` and GPUs from NVML).
pub fn write_tree(sys: &System, out: &Path) -> Result<Vec<String>, TopoError> {
    let io = |p: &Path, e: std::io::Error| TopoError::Io {
        path: p.display().to_string(),
        msg: e.to_string(),
    };
    let put = |rel: &str, text: &str| -> Result<(), TopoError> {
        let p = out.join(rel);
        if let Some(d) = p.parent() {
            fs::create_dir_all(d).map_err(|e| io(d, e))?;
        }
        fs::write(&p, format!("{text}\n")).map_err(|e| io(&p, e))
    };
    let link = |rel: &str, target: &str| -> Result<(), TopoError> {
        let p = out.join(rel);
        if let Some(d) = p.parent() {
            fs::create_dir_all(d).map_err(|e| io(d, e))?;
        }
        let _ = fs::remove_file(&p);
        symlink(Path::new(target), &p).map_err(|e| io(&p, e))
    };
    fs::create_dir_all(out.join("sys/bus/pci/devices")).map_err(|e| io(out, e))?;
    if let Some(n) = &sys.name {
        put("proc/sys/kernel/hostname", n)?;
    }
    if let Some(c) = sys.cpus.first() {
        if let Some(v) = &c.vendor {
            let mut s = format!("processor\t: 0\nvendor_id\t: {v}\n");
            if let Some(f) = c.familyid {
                s.push_str(&format!("cpu family\t: {f}\n"));
            }
            if let Some(m) = c.modelid {
                s.push_str(&format!("model\t\t: {m}\n"));
            }
            put("proc/cpuinfo", &s)?;
        }
    }
    let mut gpus = Vec::new();
    let mut any_gdr = false;
    let mut unwritten = Vec::new();
    let mut used: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    for c in &sys.cpus {
        for p in &c.pci {
            p.walk(&mut |d| {
                used.insert(d.busid.clone());
            });
        }
    }
    for c in &sys.cpus {
        let nb = format!("sys/devices/system/node/node{}", c.numaid);
        if let Some(a) = &c.affinity {
            put(&format!("{nb}/cpumap"), &a.to_mask())?;
            put(&format!("{nb}/cpulist"), &a.to_list())?;
        }
        for (i, p) in c.pci.iter().enumerate() {
            let (dom, bus) = split_bus(&p.busid);
            let hb = p
                .hostbridge
                .clone()
                .unwrap_or_else(|| format!("pci{dom}:{bus:02x}"));
            let hbus = u32::from_str_radix(hb.rsplit(':').next().unwrap_or("0"), 16).unwrap_or(0);
            // A root port between the host bridge and the device.
            let rp = free_busid(&dom, hbus, i + 1, &mut used);
            let rp_dir = format!("sys/devices/{hb}/{rp}");
            write_dev(&put, &link, &rp_dir, &rp, &bridge_like(p), c.numaid)?;
            write_pci_tree(
                &put,
                &link,
                &rp_dir,
                p,
                c.numaid,
                &mut gpus,
                &mut any_gdr,
                &mut used,
            )?;
            p.walk(&mut |d| {
                if d.nic.is_none() && d.gpu.is_none() && (d.is_nic() || d.is_gpu()) {
                    unwritten.push(format!(
                        "{} (class 0x{:06x}) has no {} element: written as a PCI device only; detection finds NICs in sys/class and GPUs through NVML, so it will not list it",
                        d.busid,
                        d.class.unwrap_or(0),
                        if d.is_nic() { "<nic>" } else { "<gpu>" }
                    ));
                }
            });
        }
        // NICs outside the PCI tree: platform devices of this node.
        for (k, nic) in c.nics.iter().enumerate() {
            let dev = format!("sys/devices/platform/braid-nic{}.{k}", c.numaid);
            put(&format!("{dev}/numa_node"), &c.numaid.to_string())?;
            for n in &nic.nets {
                any_gdr |= n.gdr == Some(true);
                write_net_to(&put, &link, &format!("../../../{}", &dev[4..]), n)?;
            }
        }
    }
    // NICs.
    for c in &sys.cpus {
        for p in &c.pci {
            let mut err = Ok(());
            p.walk(&mut |d| {
                if let Some(nic) = &d.nic {
                    for n in &nic.nets {
                        any_gdr |= n.gdr == Some(true);
                        if err.is_ok() {
                            let target = format!("../../../bus/pci/devices/{}", d.busid);
                            err = write_net_to(&put, &link, &target, n);
                        }
                    }
                }
            });
            err?;
        }
    }
    if any_gdr {
        put("sys/module/nvidia_peermem/version", "1.0")?;
    }
    if !gpus.is_empty() {
        let p = out.join(RECORDED_GPUS_FILE);
        fs::write(&p, RecordedGpus::render(&gpus)).map_err(|e| io(&p, e))?;
    }
    Ok(unwritten)
}

/// A bus id `DDDD:BB:DD.0` on `bus` that the model does not use, trying
/// device `first` (mod 32) and up; marked used.
fn free_busid(
    dom: &str,
    bus: u32,
    first: usize,
    used: &mut std::collections::BTreeSet<String>,
) -> String {
    for k in 0..32 {
        let b = format!("{dom}:{:02x}:{:02x}.0", bus % 256, (first + k) % 32);
        if !used.contains(&b) {
            used.insert(b.clone());
            return b;
        }
    }
    format!("{dom}:{:02x}:1f.7", bus % 256)
}

fn split_bus(busid: &str) -> (String, u32) {
    let mut it = busid.split(':');
    let dom = it.next().unwrap_or("0000").to_string();
    let bus = it
        .next()
        .and_then(|b| u32::from_str_radix(b, 16).ok())
        .unwrap_or(0);
    (dom, bus)
}

fn bridge_like(p: &Pci) -> Pci {
    Pci {
        busid: String::new(),
        class: Some(0x060400),
        vendor: p.vendor.clone().filter(|_| p.base_class() == Some(0x06)),
        link_speed: p.link_speed.clone(),
        link_width: p.link_width,
        ..Default::default()
    }
}

fn write_dev(
    put: &impl Fn(&str, &str) -> Result<(), TopoError>,
    link: &impl Fn(&str, &str) -> Result<(), TopoError>,
    dir: &str,
    busid: &str,
    p: &Pci,
    numa: i32,
) -> Result<(), TopoError> {
    if let Some(c) = p.class {
        put(&format!("{dir}/class"), &format!("0x{c:06x}"))?;
    }
    for (f, v) in [
        ("vendor", &p.vendor),
        ("device", &p.device),
        ("subsystem_vendor", &p.subsystem_vendor),
        ("subsystem_device", &p.subsystem_device),
        ("max_link_speed", &p.link_speed),
    ] {
        if let Some(v) = v {
            put(&format!("{dir}/{f}"), v)?;
        }
    }
    if let Some(w) = p.link_width {
        put(&format!("{dir}/max_link_width"), &w.to_string())?;
    }
    put(&format!("{dir}/numa_node"), &numa.to_string())?;
    let under_sys = dir.strip_prefix("sys/").unwrap_or(dir);
    link(
        &format!("sys/bus/pci/devices/{busid}"),
        &format!("../../../{under_sys}"),
    )
}

#[allow(clippy::too_many_arguments)]
fn write_pci_tree(
    put: &impl Fn(&str, &str) -> Result<(), TopoError>,
    link: &impl Fn(&str, &str) -> Result<(), TopoError>,
    parent_dir: &str,
    p: &Pci,
    numa: i32,
    gpus: &mut Vec<DetectedGpu>,
    any_gdr: &mut bool,
    used: &mut std::collections::BTreeSet<String>,
) -> Result<(), TopoError> {
    let dir = format!("{parent_dir}/{}", p.busid);
    write_dev(put, link, &dir, &p.busid, p, numa)?;
    if let Some(g) = &p.gpu {
        gpus.push(DetectedGpu {
            busid: p.busid.clone(),
            gpu: g.clone(),
        });
    }
    let _ = any_gdr;
    let (dom, bus) = split_bus(&p.busid);
    for (i, c) in p.children.iter().enumerate() {
        let port = free_busid(&dom, bus + 1, i, used);
        let pdir = format!("{dir}/{port}");
        write_dev(put, link, &pdir, &port, &bridge_like(c), numa)?;
        write_pci_tree(put, link, &pdir, c, numa, gpus, any_gdr, used)?;
    }
    Ok(())
}

/// Write one port whose device is at `target` (a path relative to
/// `sys/class/<kind>/<name>/`).
fn write_net_to(
    put: &impl Fn(&str, &str) -> Result<(), TopoError>,
    link: &impl Fn(&str, &str) -> Result<(), TopoError>,
    target: &str,
    n: &Net,
) -> Result<(), TopoError> {
    if n.is_rdma() {
        let (dev, port) = match n.name.split_once(':') {
            Some((d, p)) => (d.to_string(), p.to_string()),
            None => (n.name.clone(), n.port.unwrap_or(1).to_string()),
        };
        let base = format!("sys/class/infiniband/{dev}");
        link(&format!("{base}/device"), target)?;
        if let Some(g) = &n.guid {
            let h = g.trim_start_matches("0x");
            let h = format!("{h:0>16}");
            put(
                &format!("{base}/node_guid"),
                &format!("{}:{}:{}:{}", &h[0..4], &h[4..8], &h[8..12], &h[12..16]),
            )?;
        }
        let pb = format!("{base}/ports/{port}");
        // The port directory exists even when nothing is known about it.
        put(&format!("{pb}/.keep"), "")?;
        if let Some(s) = &n.state {
            let code = match s.as_str() {
                "ACTIVE" => 4,
                "ARMED" => 3,
                "INIT" => 2,
                _ => 1,
            };
            put(&format!("{pb}/state"), &format!("{code}: {s}"))?;
        }
        if let Some(sp) = n.speed {
            put(&format!("{pb}/rate"), &format!("{} Gb/sec (4X)", sp / 1000))?;
        }
        if let Some(l) = &n.link_layer {
            put(&format!("{pb}/link_layer"), l)?;
        }
    } else {
        let base = format!("sys/class/net/{}", n.name);
        link(&format!("{base}/device"), target)?;
        put(
            &format!("{base}/speed"),
            &n.speed.map_or("-1".to_string(), |s| s.to_string()),
        )?;
        if let Some(s) = &n.state {
            put(&format!("{base}/operstate"), s)?;
        }
        let ty = if n.link_layer.as_deref() == Some("InfiniBand") {
            "32"
        } else {
            "1"
        };
        put(&format!("{base}/type"), ty)?;
    }
    Ok(())
}

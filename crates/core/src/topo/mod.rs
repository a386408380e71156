//! Topology: what a host looks like and how its devices are connected.
//!
//! - [`model`]: the host as NUMA nodes (with their CPU sets), the PCI tree
//!   (bridges and switches with link generation and width), GPUs with their
//!   NVLinks, and NICs with their ports (InfiniBand, RoCE, Ethernet; state,
//!   rate, link layer). The shape is NCCL's topology XML.
//! - [`graph`]: the model as a graph, with NCCL's path classes (LOC, NVL, NVB,
//!   PIX, PXB, PHB, SYS, NET) and a bottleneck bandwidth per best path.
//! - [`sysfs`]: detection from sysfs under an injected root (tests run on
//!   recorded or hand-built trees), recording of what was read, and writing a
//!   tree for a model. GPUs come from a [`sysfs::GpuProvider`]; braid-core does
//!   not load NVML or CUDA, so the default provider ([`sysfs::NoGpus`]) reports
//!   none and fixtures supply recorded NVML answers ([`sysfs::RecordedGpus`]).
//! - [`xml`]: NCCL topology XML (`NCCL_TOPO_FILE` / `NCCL_TOPO_DUMP_FILE`)
//!   import and export, including partial vendor files (only `cpu` and `pci`
//!   with `class` and `busid`).
//! - [`json`]: JSON export of the model, its graph and its paths.
//! - [`plan`](mod@plan): pure planning over the fused topology of all ranks: the
//!   transport per rank pair and the ring orders (channels).
//! - [`render`]: text for people (summary, nvidia-smi-style matrix, plan).
//! - [`bind`]: which cores a launcher binds its local ranks to.
//! - [`merge`](mod@merge): a topology file merged with detection, as NCCL
//!   merges `NCCL_TOPO_FILE`.
//! - [`nvml`]: GPUs, NVLinks and NVSwitches from NVML queries (the queries
//!   are a trait: `braid-cuda` answers them from `libnvidia-ml.so.1`, tests
//!   from recorded answers).
//!
//! `BRAID_TOPO_FILE` names a topology file (NCCL XML, or braid JSON) that is
//! merged with detection; see [`load_host`]. `docs/topology.md` says where
//! braid concludes differently from NCCL and hwloc, and why.

pub mod bind;
pub mod graph;
pub mod json;
pub mod merge;
pub mod model;
pub mod nvml;
pub mod plan;
pub mod render;
pub mod sysfs;
pub mod xml;

use std::path::Path;

pub use crate::transport::TransportKind;
pub use graph::{PathType, Topology};
pub use model::{Cpu, CpuSet, Gpu, Net, Nic, NicKind, NvLink, Pci, System};
pub use plan::{plan, Cluster, CrossNic, GpuLink, Plan, RankPlace, TransportPolicy};
pub use sysfs::{detect, Detected, GpuProvider, NoGpus, RecordedGpus, SysfsReader};

/// Errors of topology detection and files. Each names the file (and line).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopoError {
    /// A topology file is malformed.
    #[error("{file}:{line}: {msg}")]
    Parse {
        file: String,
        line: usize,
        msg: String,
    },
    /// A file or directory could not be read or written.
    #[error("{path}: {msg}")]
    Io { path: String, msg: String },
    /// The inputs do not make sense together (e.g. a rank on a missing GPU).
    #[error("{0}")]
    Invalid(String),
    /// Detection could not read this machine: the process is out of file
    /// descriptors or memory (a model from what it could read would
    /// describe a different machine).
    #[error("{path}: {msg}")]
    Exhausted { path: String, msg: String },
}

/// Environment variable naming a topology file merged with detection.
pub const TOPO_FILE_ENV: &str = "BRAID_TOPO_FILE";

/// Read a topology file: NCCL XML, or braid JSON (`.json`, or text starting with `{`).
pub fn load_file(path: &Path) -> Result<System, TopoError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| TopoError::Io {
        path: name.clone(),
        msg: e.to_string(),
    })?;
    parse_text(&name, &text)
}

/// Parse topology text (XML or braid JSON); `name` appears in errors.
pub fn parse_text(name: &str, text: &str) -> Result<System, TopoError> {
    if name.ends_with(".json") || text.trim_start().starts_with('{') {
        json::from_json(name, text)
    } else {
        xml::from_xml(name, text)
    }
}

/// Where a host's topology came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A file named by `BRAID_TOPO_FILE`, alone (detection could not run).
    File(String),
    /// Detection under this root.
    Detected(String),
    /// A file named by `BRAID_TOPO_FILE` merged with detection under a root.
    Merged { file: String, root: String },
}

/// The topology of this host as the runtime should use it: the file named
/// by `BRAID_TOPO_FILE` (looked up through `env`) merged with detection
/// under `root` with GPUs from `gpus` ([`merge::merge`], as NCCL merges
/// `NCCL_TOPO_FILE`; the file alone, with a note, where detection cannot
/// run), else detection. Returns the model, its source and notes. An
/// unreadable or malformed file is an error.
pub fn load_host(
    env: impl Fn(&str) -> Option<String>,
    root: &Path,
    gpus: &dyn GpuProvider,
) -> Result<(System, Source, Vec<String>), TopoError> {
    if let Some(f) = env(TOPO_FILE_ENV).filter(|f| !f.trim().is_empty()) {
        let file = load_file(Path::new(&f))?;
        let detected = SysfsReader::new(root).and_then(|r| detect(&r, gpus));
        return Ok(match detected {
            Ok(d) => {
                let (sys, mut notes) = merge::merge(&file, &d.system);
                notes.splice(0..0, d.notes);
                let root = root.display().to_string();
                (sys, Source::Merged { file: f, root }, notes)
            }
            Err(e @ TopoError::Exhausted { .. }) => return Err(e),
            Err(e) => {
                let note = format!("detection failed ({e}): the file {f} alone");
                (file, Source::File(f), vec![note])
            }
        });
    }
    let reader = SysfsReader::new(root)?;
    let d = detect(&reader, gpus)?;
    Ok((
        d.system,
        Source::Detected(root.display().to_string()),
        d.notes,
    ))
}

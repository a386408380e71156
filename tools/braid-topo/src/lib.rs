//! braid-topo: prints the host topology braid sees (CPUs/NUMA, GPUs, NICs),
//! the GPU/NIC matrix the way `nvidia-smi topo -m` shows it, and, for
//! `--ranks N [--hosts H]`, the transports and rings braid would use.

use std::path::{Path, PathBuf};

use braid_core::topo::{
    self, json, merge, nvml, plan, render, sysfs, xml, Cluster, GpuProvider, Topology,
    TransportPolicy,
};

pub const USAGE: &str = "\
usage: braid-topo [SOURCE] [--ranks N [--hosts H]] [--json | --xml] [--paths]
                  [--record DIR] [--record-nvml FILE] [--write-sysfs DIR]

SOURCE (default: detect this machine, GPUs and NVLinks from NVML, else the
CUDA driver; BRAID_TOPO_FILE names a file merged with detection, as
NCCL_TOPO_FILE is):
  --topo-file FILE     NCCL topology XML (NCCL_TOPO_FILE format) or braid JSON,
                       merged with detection (of --sysfs-root, or this machine):
                       the file's attributes win, detected devices fill in
  --file-only          the file alone, without detection (what-if planning for
                       a machine you are not on)
  --sysfs-root DIR     detect from a sysfs tree under DIR (DIR/sys/...); GPUs are
                       read from DIR/nvml-gpus.xml or DIR/nvml.json when present
  --gpus-file FILE     GPUs as NVML would report them (<gpus><gpu busid=..>..</gpus>)
  --nvml-file FILE     NVML answers recorded by --record-nvml, replayed

OUTPUT (default: summary and matrix):
  --ranks N            also print the per-pair transports and rings for N ranks
  --hosts H            spread the N ranks over H copies of this host (default 1)
  --paths              also print every GPU/NIC path with NCCL's class and GB/s
  --json               the full model, graph and paths (and plan) as JSON
  --xml                the model as NCCL topology XML (NCCL_TOPO_DUMP_FILE format)
  --record DIR         copy the sysfs files detection read into DIR (a fixture)
  --record-nvml FILE   write this machine's NVML answers into FILE (a fixture)
  --write-sysfs DIR    write a sysfs tree for the model into DIR (hand-built fixtures)

Transports honour BRAID_TRANSPORT, BRAID_<NAME>_DISABLE and BRAID_P2P_LEVEL;
hops between hosts BRAID_CROSS_NIC (0: one rail, 1: any port, 2: one rail
unless slower).";

/// Why the command failed.
#[derive(Debug)]
pub enum Failure {
    /// Bad command line (exit 2).
    Usage(String),
    /// Anything else (exit 1).
    Error(String),
}

impl From<topo::TopoError> for Failure {
    fn from(e: topo::TopoError) -> Self {
        Failure::Error(e.to_string())
    }
}

#[derive(Default)]
struct Opts {
    topo_file: Option<PathBuf>,
    file_only: bool,
    sysfs_root: Option<PathBuf>,
    gpus_file: Option<PathBuf>,
    nvml_file: Option<PathBuf>,
    record_nvml: Option<PathBuf>,
    ranks: Option<usize>,
    hosts: Option<usize>,
    json: bool,
    xml: bool,
    paths: bool,
    record: Option<PathBuf>,
    write_sysfs: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Opts, Failure> {
    let mut o = Opts::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        let mut val = |name: &str| -> Result<String, Failure> {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| Failure::Usage(format!("{name} needs a value")))
        };
        let num = |name: &str, v: String| -> Result<usize, Failure> {
            v.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| Failure::Usage(format!("{name} takes a positive number, got '{v}'")))
        };
        match flag {
            "--topo-file" => o.topo_file = Some(val(flag)?.into()),
            "--sysfs-root" => o.sysfs_root = Some(val(flag)?.into()),
            "--gpus-file" => o.gpus_file = Some(val(flag)?.into()),
            "--nvml-file" => o.nvml_file = Some(val(flag)?.into()),
            "--record-nvml" => o.record_nvml = Some(val(flag)?.into()),
            "--file-only" => o.file_only = true,
            "--ranks" | "-n" => o.ranks = Some(num(flag, val(flag)?)?),
            "--hosts" => o.hosts = Some(num(flag, val(flag)?)?),
            "--record" => o.record = Some(val(flag)?.into()),
            "--write-sysfs" => o.write_sysfs = Some(val(flag)?.into()),
            "--json" => o.json = true,
            "--xml" => o.xml = true,
            "--paths" => o.paths = true,
            "-h" | "--help" => return Err(Failure::Usage("help".into())),
            other => return Err(Failure::Usage(format!("unknown argument '{other}'"))),
        }
    }
    if o.file_only && (o.sysfs_root.is_some() || o.record.is_some()) {
        return Err(Failure::Usage(
            "--file-only uses the file alone: no --sysfs-root or --record".into(),
        ));
    }
    if o.gpus_file.is_some() && o.nvml_file.is_some() {
        return Err(Failure::Usage(
            "give --gpus-file or --nvml-file, not both".into(),
        ));
    }
    if o.json && o.xml {
        return Err(Failure::Usage("give --json or --xml, not both".into()));
    }
    if o.hosts.is_some() && o.ranks.is_none() {
        return Err(Failure::Usage("--hosts needs --ranks".into()));
    }
    if o.record.is_some() && o.topo_file.is_some() {
        return Err(Failure::Usage(
            "--record copies sysfs; it does not apply to --topo-file".into(),
        ));
    }
    Ok(o)
}

/// The GPU provider for detection: a recording when given (or found in
/// the sysfs root), else this machine's NVML / CUDA driver when detecting
/// it, else none.
fn provider(o: &Opts) -> Result<Box<dyn GpuProvider>, Failure> {
    if let Some(f) = &o.gpus_file {
        return Ok(Box::new(sysfs::RecordedGpus { file: f.clone() }));
    }
    let nvml_file = o.nvml_file.clone().or_else(|| {
        o.sysfs_root
            .as_ref()
            .map(|r| r.join(nvml::RECORDED_NVML_FILE))
            .filter(|f| f.is_file())
    });
    if let Some(f) = nvml_file {
        let q = nvml::RecordedNvml::load(&f)?;
        return Ok(Box::new(nvml::NvmlGpus { q }));
    }
    Ok(match o.sysfs_root.as_deref() {
        Some(r) => match sysfs::RecordedGpus::in_root(r) {
            Some(p) => Box::new(p),
            None => Box::new(sysfs::NoGpus),
        },
        None => Box::new(braid_cuda::CudaGpus),
    })
}

/// Run braid-topo with `args` (without the program name); `env` reads the environment.
pub fn run(args: &[String], env: &dyn Fn(&str) -> Option<String>) -> Result<String, Failure> {
    let o = parse(args)?;
    if let Some(f) = &o.record_nvml {
        let n = braid_cuda::nvml::Nvml::open().map_err(Failure::Error)?;
        let rec = nvml::record(&n);
        std::fs::write(f, rec.to_json())
            .map_err(|e| Failure::Error(format!("{}: {e}", f.display())))?;
        return Ok(format!(
            "recorded NVML's answers for {} GPU(s) into {}\n",
            rec.devices.len(),
            f.display()
        ));
    }
    let topo_file = o.topo_file.clone().or_else(|| {
        env(topo::TOPO_FILE_ENV)
            .filter(|f| !f.trim().is_empty())
            .map(PathBuf::from)
    });
    if o.file_only && topo_file.is_none() {
        return Err(Failure::Usage(
            "--file-only needs --topo-file (or BRAID_TOPO_FILE)".into(),
        ));
    }
    if o.record.is_some() && topo_file.is_some() {
        return Err(Failure::Usage(
            "--record copies sysfs; it does not apply to a topology file".into(),
        ));
    }
    let file = match &topo_file {
        Some(f) => Some(topo::load_file(f)?),
        None => None,
    };
    let (system, notes, source) = match (file, o.file_only) {
        (Some(sys), true) => (
            sys,
            Vec::new(),
            format!(
                "file {} alone (--file-only)",
                topo_file.as_deref().unwrap_or(Path::new("")).display()
            ),
        ),
        (file, _) => {
            let root = o.sysfs_root.clone().unwrap_or_else(|| PathBuf::from("/"));
            let reader = if o.record.is_some() {
                sysfs::SysfsReader::recording(&root)
            } else {
                sysfs::SysfsReader::new(&root)
            };
            let provider = provider(&o)?;
            let detected =
                reader.and_then(|r| sysfs::detect(&r, provider.as_ref()).map(|d| (r, d)));
            match (file, detected) {
                (None, Err(e)) => return Err(e.into()),
                (None, Ok((reader, d))) => {
                    if let Some(dir) = &o.record {
                        let (files, links) = reader.write_recording(dir)?;
                        let gpus = provider.gpus()?;
                        if !gpus.is_empty() {
                            let p = dir.join(sysfs::RECORDED_GPUS_FILE);
                            std::fs::write(&p, sysfs::RecordedGpus::render(&gpus))
                                .map_err(|e| Failure::Error(format!("{}: {e}", p.display())))?;
                        }
                        return Ok(format!(
                            "recorded {files} files and {links} links read from {} into {}\n",
                            root.display(),
                            dir.display()
                        ));
                    }
                    (d.system, d.notes, format!("sysfs under {}", root.display()))
                }
                (Some(f), Ok((_, d))) => {
                    let (sys, mut notes) = merge::merge(&f, &d.system);
                    notes.splice(0..0, d.notes);
                    let name = topo_file.as_deref().unwrap_or(Path::new("")).display();
                    (
                        sys,
                        notes,
                        format!(
                            "file {name} merged with detection under {} (--file-only: the file alone)",
                            root.display()
                        ),
                    )
                }
                (Some(f), Err(e)) => {
                    let name = topo_file.as_deref().unwrap_or(Path::new("")).display();
                    (
                        f,
                        vec![format!("detection failed ({e}): the file alone")],
                        format!("file {name}"),
                    )
                }
            }
        }
    };
    if let Some(dir) = &o.write_sysfs {
        let unwritten = sysfs::write_tree(&system, dir)?;
        let mut out = format!("wrote a sysfs tree for the model into {}\n", dir.display());
        for u in unwritten {
            out.push_str(&format!("warning: {u}\n"));
        }
        return Ok(out);
    }
    if o.xml {
        return Ok(xml::to_xml(&system));
    }
    let name = system.name.clone().unwrap_or_else(|| "host".into());
    let t = Topology::new(system);
    let planned = match o.ranks {
        Some(n) => {
            let policy = TransportPolicy::from_env(env)?;
            let c = Cluster::uniform(&t, &name, n, o.hosts.unwrap_or(1))?;
            let p = plan::plan(&c, &policy)?;
            Some((c, p))
        }
        None => None,
    };
    if o.json {
        let mut v = json::to_value(&t);
        if let Some((c, p)) = &planned {
            v["plan"] = serde_json::json!({
                "ranks": c.ranks,
                "hosts": c.hosts.iter().map(|h| h.name.clone()).collect::<Vec<_>>(),
                "transports": p.transports,
                "rings": p.rings,
                "nearest_nic": p.nearest_nic,
                "rank_nics": p.rank_nics,
                "rails": p.rails,
                "cross_nic": p.cross_nic.value(),
                "notes": p.notes,
            });
        }
        v["notes"] = serde_json::json!(notes);
        return Ok(serde_json::to_string_pretty(&v).unwrap_or_default() + "\n");
    }
    let mut out = format!("source: {source}\n");
    out.push_str(&render::summary(&t, &notes));
    out.push('\n');
    out.push_str(&render::matrix(&t));
    if o.paths {
        out.push_str("\nPaths:\n");
        out.push_str(&render::paths(&t));
    }
    if let Some((c, p)) = &planned {
        out.push('\n');
        out.push_str(&render::plan(c, p));
    }
    Ok(out)
}

/// Whether a path looks like a fixture root (holds `sys/`).
pub fn is_root(p: &Path) -> bool {
    p.join("sys").is_dir()
}

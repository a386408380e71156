//! GPUs and NVLinks from NVML, as NCCL reads them, over a small trait of
//! NVML queries ([`NvmlQueries`]) so that the logic runs on recorded
//! answers in tests ([`RecordedNvml`]) and on the real library in
//! `braid-cuda` (`braid_cuda::nvml`, which loads `libnvidia-ml.so.1` at run
//! time).
//!
//! [`NvmlGpus`] does what NCCL's `ncclTopoGetXmlFromGpu` does: for every
//! device its PCI bus id and compute capability; for every NVLink below the
//! generation's maximum (4 for sm6x, 6 for sm7x, 12 for sm8x, 18 from sm90)
//! that supports peer-to-peer and is active, the bus id of what is at the
//! other end; links to the same peer add up to one `nvlink` element with a
//! count. A peer whose bus id NVML cannot give (an NVSwitch inside a VM) is
//! NCCL's `fffffff:ffff:ff`, taken as an NVSwitch. The class of the peer
//! (`tclass`) comes from NVML's remote device type where it says NVSwitch
//! or CPU; a GPU peer's class is left to sysfs (detection fills it in, as
//! NCCL reads it from sysfs). NVLink-C2C links (Grace) become a `c2c`
//! element.

use serde::{Deserialize, Serialize};

use super::model::{C2c, Gpu, NvLink};
use super::sysfs::{DetectedGpu, GpuProvider};
use super::TopoError;

/// The bus id NCCL uses for an NVLink peer NVML cannot name.
pub const UNKNOWN_PEER: &str = "fffffff:ffff:ff";

/// What is at the other end of an NVLink, as NVML's remote device type says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NvLinkRemote {
    Gpu,
    Switch,
    /// An IBM NPU (POWER9's NVLink to the CPU).
    Cpu,
    Unknown,
}

/// The NVML queries braid makes. Every error is NVML's message.
pub trait NvmlQueries {
    /// What answers (`NVML 12.550.54`, `recorded: FILE`).
    fn describe(&self) -> String;
    /// `nvmlDeviceGetCount_v2`.
    fn device_count(&self) -> Result<u32, String>;
    /// `nvmlDeviceGetPciInfo_v3`: the bus id as NVML writes it
    /// (`00000000:18:00.0`).
    fn pci_bus_id(&self, dev: u32) -> Result<String, String>;
    /// `nvmlDeviceGetCudaComputeCapability`: (major, minor).
    fn compute_capability(&self, dev: u32) -> Result<(u32, u32), String>;
    /// `nvmlDeviceGetNvLinkCapability(NVML_NVLINK_CAP_P2P_SUPPORTED)`.
    fn nvlink_p2p_supported(&self, dev: u32, link: u32) -> Result<bool, String>;
    /// Whether the link is up (`nvmlDeviceGetNvLinkState`, or the field
    /// value `NVML_FI_DEV_NVLINK_GET_STATE` from sm90 on, as NCCL asks).
    fn nvlink_active(&self, dev: u32, link: u32) -> Result<bool, String>;
    /// `nvmlDeviceGetNvLinkRemotePciInfo_v2`: the peer's bus id (empty when
    /// NVML cannot see it).
    fn nvlink_remote_bus_id(&self, dev: u32, link: u32) -> Result<String, String>;
    /// `nvmlDeviceGetNvLinkRemoteDeviceType`.
    fn nvlink_remote_type(&self, dev: u32, link: u32) -> Result<NvLinkRemote, String> {
        let _ = (dev, link);
        Ok(NvLinkRemote::Unknown)
    }
    /// NVLink-C2C: (active links, MB/s of one link), from the field values
    /// `NVML_FI_DEV_C2C_LINK_*`; None without C2C.
    fn c2c(&self, dev: u32) -> Result<Option<(u32, u32)>, String> {
        let _ = dev;
        Ok(None)
    }
}

/// NVML's bus id (`00000000:18:00.0`, upper case) as braid and sysfs write
/// it (`0000:18:00.0`); None when it is not a bus id (empty, or not
/// printable: NCCL's "not visible").
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim_end_matches('\0').trim();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_graphic()) {
        return None;
    }
    let (dom, rest) = id.split_once(':')?;
    let dom = u64::from_str_radix(dom, 16).ok()?;
    let rest = rest.to_ascii_lowercase();
    let b = rest.as_bytes();
    if b.len() != 7 || b[2] != b':' || b[5] != b'.' {
        return None;
    }
    Some(format!("{dom:04x}:{rest}"))
}

/// How many NVLinks NCCL asks NVML about for a generation (compute
/// capability × 10).
pub fn max_nvlinks(sm: u32) -> u32 {
    match sm {
        0..=59 => 0,
        60..=69 => 4,
        70..=79 => 6,
        80..=89 => 12,
        _ => 18,
    }
}

/// A [`GpuProvider`] over NVML queries.
#[derive(Debug)]
pub struct NvmlGpus<Q> {
    pub q: Q,
}

impl<Q: NvmlQueries> NvmlGpus<Q> {
    /// The GPUs, each with what NVML said about it, and notes on what it
    /// could not say.
    pub fn read(&self) -> (Vec<DetectedGpu>, Vec<String>) {
        let mut out = Vec::new();
        let mut notes = Vec::new();
        let count = match self.q.device_count() {
            Ok(n) => n,
            Err(e) => {
                notes.push(format!("NVML: no device count ({e})"));
                return (out, notes);
            }
        };
        for dev in 0..count {
            let busid = match self.q.pci_bus_id(dev).map(|b| normalize_bus_id(&b)) {
                Ok(Some(b)) => b,
                Ok(None) => {
                    notes.push(format!("NVML device {dev}: no PCI bus id; skipped"));
                    continue;
                }
                Err(e) => {
                    notes.push(format!("NVML device {dev}: no PCI bus id ({e}); skipped"));
                    continue;
                }
            };
            let sm = match self.q.compute_capability(dev) {
                Ok((major, minor)) => Some(major * 10 + minor),
                Err(e) => {
                    notes.push(format!(
                        "NVML device {dev} ({busid}): no compute capability ({e}); NVLinks not read"
                    ));
                    None
                }
            };
            let mut links: Vec<NvLink> = Vec::new();
            for link in 0..sm.map_or(0, max_nvlinks) {
                if !self.q.nvlink_p2p_supported(dev, link).unwrap_or(false) {
                    continue;
                }
                if !self.q.nvlink_active(dev, link).unwrap_or(false) {
                    continue;
                }
                let Ok(remote) = self.q.nvlink_remote_bus_id(dev, link) else {
                    continue;
                };
                let target = normalize_bus_id(&remote).unwrap_or_else(|| UNKNOWN_PEER.into());
                let tclass = if target == UNKNOWN_PEER {
                    Some(0x068000)
                } else {
                    match self.q.nvlink_remote_type(dev, link) {
                        Ok(NvLinkRemote::Switch) => Some(0x068000),
                        Ok(NvLinkRemote::Cpu) => Some(0x068001),
                        _ => None,
                    }
                };
                match links.iter_mut().find(|l| l.target == target) {
                    Some(l) => l.count += 1,
                    None => links.push(NvLink {
                        target,
                        count: 1,
                        tclass,
                    }),
                }
            }
            let c2c = match self.q.c2c(dev) {
                Ok(Some((count, bw))) if count > 0 => vec![C2c {
                    bw,
                    count,
                    attrs: Default::default(),
                }],
                _ => Vec::new(),
            };
            out.push(DetectedGpu {
                busid,
                gpu: Gpu {
                    dev: Some(dev),
                    sm,
                    nvlinks: links,
                    c2c,
                    ..Default::default()
                },
            });
        }
        (out, notes)
    }
}

impl<Q: NvmlQueries> GpuProvider for NvmlGpus<Q> {
    fn name(&self) -> String {
        self.q.describe()
    }
    fn gpus(&self) -> Result<Vec<DetectedGpu>, TopoError> {
        Ok(self.read().0)
    }
}

/// One recorded answer: a value, or NVML's error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Answer<T> {
    Value(T),
    Error { error: String },
}

impl<T: Clone> Answer<T> {
    fn get(a: Option<&Answer<T>>) -> Result<T, String> {
        match a {
            Some(Answer::Value(v)) => Ok(v.clone()),
            Some(Answer::Error { error }) => Err(error.clone()),
            None => Err("not recorded".into()),
        }
    }
}

/// One NVLink's recorded answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RecordedLink {
    pub link: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p2p: Option<Answer<bool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<Answer<bool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<Answer<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_type: Option<Answer<NvLinkRemote>>,
}

/// One device's recorded answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RecordedDevice {
    pub bus_id: Answer<String>,
    pub cc: Answer<(u32, u32)>,
    #[serde(default)]
    pub links: Vec<RecordedLink>,
    /// (active links, MB/s of one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub c2c: Option<(u32, u32)>,
}

impl Default for Answer<String> {
    fn default() -> Self {
        Answer::Error {
            error: "not recorded".into(),
        }
    }
}

impl Default for Answer<(u32, u32)> {
    fn default() -> Self {
        Answer::Error {
            error: "not recorded".into(),
        }
    }
}

/// NVML's answers recorded in a file (`nvml.json`): what [`record`]
/// writes, read back by tests and by `braid-topo --nvml-file`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RecordedNvml {
    /// Where the answers come from (a machine, or how they were made).
    pub source: String,
    pub devices: Vec<RecordedDevice>,
}

/// The file name recorded NVML answers are looked up under in a fixture root.
pub const RECORDED_NVML_FILE: &str = "nvml.json";

impl RecordedNvml {
    /// Parse recorded answers; `file` names the source in errors.
    pub fn parse(file: &str, text: &str) -> Result<RecordedNvml, TopoError> {
        serde_json::from_str(text).map_err(|e| TopoError::Parse {
            file: file.into(),
            line: e.line(),
            msg: e.to_string(),
        })
    }

    /// Read recorded answers from a file.
    pub fn load(path: &std::path::Path) -> Result<RecordedNvml, TopoError> {
        let f = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| TopoError::Io {
            path: f.clone(),
            msg: e.to_string(),
        })?;
        RecordedNvml::parse(&f, &text)
    }

    /// The answers as JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    fn dev(&self, dev: u32) -> Result<&RecordedDevice, String> {
        self.devices
            .get(dev as usize)
            .ok_or_else(|| format!("no device {dev}"))
    }

    fn link(&self, dev: u32, link: u32) -> Result<&RecordedLink, String> {
        self.dev(dev)?
            .links
            .iter()
            .find(|l| l.link == link)
            .ok_or_else(|| format!("link {link} not recorded"))
    }
}

impl NvmlQueries for RecordedNvml {
    fn describe(&self) -> String {
        format!("NVML (recorded: {})", self.source)
    }
    fn device_count(&self) -> Result<u32, String> {
        Ok(self.devices.len() as u32)
    }
    fn pci_bus_id(&self, dev: u32) -> Result<String, String> {
        Answer::get(Some(&self.dev(dev)?.bus_id))
    }
    fn compute_capability(&self, dev: u32) -> Result<(u32, u32), String> {
        Answer::get(Some(&self.dev(dev)?.cc))
    }
    fn nvlink_p2p_supported(&self, dev: u32, link: u32) -> Result<bool, String> {
        Answer::get(self.link(dev, link)?.p2p.as_ref())
    }
    fn nvlink_active(&self, dev: u32, link: u32) -> Result<bool, String> {
        Answer::get(self.link(dev, link)?.active.as_ref())
    }
    fn nvlink_remote_bus_id(&self, dev: u32, link: u32) -> Result<String, String> {
        Answer::get(self.link(dev, link)?.remote.as_ref())
    }
    fn nvlink_remote_type(&self, dev: u32, link: u32) -> Result<NvLinkRemote, String> {
        match self.link(dev, link)?.remote_type.as_ref() {
            None => Ok(NvLinkRemote::Unknown),
            a => Answer::get(a),
        }
    }
    fn c2c(&self, dev: u32) -> Result<Option<(u32, u32)>, String> {
        Ok(self.dev(dev)?.c2c)
    }
}

/// Ask `q` everything [`NvmlGpus`] asks, and keep the answers (for a
/// fixture, or to reproduce a machine's detection elsewhere).
pub fn record(q: &dyn NvmlQueries) -> RecordedNvml {
    fn ans<T>(r: Result<T, String>) -> Answer<T> {
        match r {
            Ok(v) => Answer::Value(v),
            Err(error) => Answer::Error { error },
        }
    }
    let mut devices = Vec::new();
    let count = q.device_count().unwrap_or(0);
    for dev in 0..count {
        let cc = q.compute_capability(dev);
        let sm = cc.as_ref().map_or(0, |(a, b)| a * 10 + b);
        let links = (0..max_nvlinks(sm))
            .map(|link| RecordedLink {
                link,
                p2p: Some(ans(q.nvlink_p2p_supported(dev, link))),
                active: Some(ans(q.nvlink_active(dev, link))),
                remote: Some(ans(q.nvlink_remote_bus_id(dev, link))),
                remote_type: Some(ans(q.nvlink_remote_type(dev, link))),
            })
            .collect();
        devices.push(RecordedDevice {
            bus_id: ans(q.pci_bus_id(dev)),
            cc: ans(cc),
            links,
            c2c: q.c2c(dev).ok().flatten(),
        });
    }
    RecordedNvml {
        source: q.describe(),
        devices,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_as_sysfs_writes_them() {
        assert_eq!(
            normalize_bus_id("00000000:0F:00.0").as_deref(),
            Some("0000:0f:00.0")
        );
        assert_eq!(
            normalize_bus_id("00010000:01:00.0\0\0").as_deref(),
            Some("10000:01:00.0")
        );
        assert_eq!(normalize_bus_id(""), None);
        assert_eq!(normalize_bus_id("\u{1}\u{2}"), None);
        assert_eq!(normalize_bus_id("garbage"), None);
    }

    #[test]
    fn link_counts_per_generation() {
        assert_eq!(
            [50, 60, 70, 80, 86, 90, 100].map(max_nvlinks),
            [0, 4, 6, 12, 12, 18, 18]
        );
    }
}

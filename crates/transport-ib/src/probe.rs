//! Choosing the RDMA device, port and GID: pure decisions over a list of
//! ports (the list itself comes from the verbs library, see `verbs.rs`, or
//! from a test).
//!
//! - `BRAID_IB_HCA` has `NCCL_IB_HCA`'s syntax: a comma-separated list of
//!   `device[:port]` entries; device names are prefixes (`mlx5` matches
//!   `mlx5_0` and `mlx5_1`) unless the list starts with `=` (exact names); a
//!   leading `^` (before the `=`) turns it into an exclusion list. Without a
//!   port an entry means every port of the device.
//! - Only ports in state ACTIVE with link layer InfiniBand or Ethernet
//!   (RoCE) count.
//! - RoCE needs a GID: `BRAID_IB_GID_INDEX` if set, else the first RoCE v2
//!   GID holding an IPv4-mapped address (`::ffff:a.b.c.d`), else the first
//!   RoCE v2 GID, else the first RoCE v1 GID. InfiniBand uses GID 0 (the
//!   port GID) and the LID.
//! - Among the remaining ports, those whose device sits on a NUMA node that
//!   this process may run on come first (the NIC nearest the rank's CPUs);
//!   an explicit order hint (device names, nearest first, as the topology
//!   planner computes for a GPU) overrides that. Ties keep the library's
//!   device order and port order.
//! - The *fabric* a port is on, which ranks compare to decide whether IB can
//!   connect them: `ib:<subnet prefix>` for InfiniBand (one subnet manager's
//!   subnet), `roce` for RoCE (routable over IP: any two RoCE ports are
//!   assumed to reach each other).

use braid_core::config::NameList;

use crate::info::Addr;

/// Port link layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE).
    Ethernet,
    /// Anything else (unspecified, ...).
    Other(u8),
}

/// What a GID is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidKind {
    /// InfiniBand / RoCE v1 (the verbs library does not tell them apart).
    IbOrRoceV1,
    /// RoCE v2 (UDP/IP).
    RoceV2,
}

/// One valid entry of a port's GID table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidDesc {
    /// Index in the table.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// Its type.
    pub kind: GidKind,
}

impl GidDesc {
    /// Whether the GID is an IPv4-mapped IPv6 address.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10] == [0; 10] && self.gid[10] == 0xff && self.gid[11] == 0xff
    }
}

/// One port of one device, as the verbs library describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortDesc {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number (from 1).
    pub port: u8,
    /// Whether the port state is ACTIVE.
    pub active: bool,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// Active MTU as the verbs enum (1 = 256 ... 5 = 4096).
    pub mtu: u8,
    /// Valid GID table entries.
    pub gids: Vec<GidDesc>,
    /// NUMA node of the device, when the kernel says.
    pub numa_node: Option<i32>,
}

/// The port braid uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chosen {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// GID index used for the address vector.
    pub gid_index: u32,
    /// How peers address this port.
    pub addr: Addr,
    /// The fabric id compared between ranks.
    pub fabric: String,
}

/// A parsed `BRAID_IB_HCA` value: a [`NameList`] whose entries' suffixes
/// are port numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaSpec(NameList);

/// A port as `BRAID_IB_HCA` gives it after a `:`, from 1 to 255.
fn parse_port(p: &str) -> Result<u8, String> {
    match p.parse::<u8>() {
        Ok(0) => Err("ports are numbered from 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err("the port after ':' must be a number from 1 to 255".into()),
    }
}

impl HcaSpec {
    /// Parses `[^][=]dev[:port][,dev[:port]...]`; an entry with a port that
    /// is not a number from 1 to 255 is an error.
    pub fn parse(s: &str) -> Result<HcaSpec, String> {
        let list = NameList::parse(s);
        for e in &list.entries {
            if let Some(p) = &e.suffix {
                parse_port(p).map_err(|why| format!("\"{}:{p}\": {why}", e.name))?;
            }
        }
        Ok(HcaSpec(list))
    }

    /// Whether `device:port` is selected.
    pub fn matches(&self, device: &str, port: u8) -> bool {
        self.0
            .matches_with(device, |p| parse_port(p).is_ok_and(|p| p == port))
    }
}

fn gid_for(p: &PortDesc, forced: Option<u32>) -> Result<GidDesc, String> {
    if let Some(i) = forced {
        return p
            .gids
            .iter()
            .find(|g| g.index == i)
            .copied()
            .ok_or_else(|| {
                format!(
                    "{}:{} has no valid GID at index {i} (BRAID_IB_GID_INDEX); valid: {:?}",
                    p.device,
                    p.port,
                    p.gids.iter().map(|g| g.index).collect::<Vec<_>>()
                )
            });
    }
    if p.link_layer == LinkLayer::InfiniBand {
        return p
            .gids
            .iter()
            .find(|g| g.index == 0)
            .or(p.gids.first())
            .copied()
            .ok_or_else(|| format!("{}:{} has an empty GID table", p.device, p.port));
    }
    let v2 = |g: &&GidDesc| g.kind == GidKind::RoceV2;
    p.gids
        .iter()
        .filter(v2)
        .find(|g| g.is_ipv4_mapped())
        .or_else(|| p.gids.iter().find(v2))
        .or_else(|| p.gids.first())
        .copied()
        .ok_or_else(|| {
            format!(
                "{}:{} (RoCE) has no GID: give the interface an IP address",
                p.device, p.port
            )
        })
}

/// The InfiniBand subnet prefix (first 8 bytes of the port GID).
fn subnet_prefix(gid: &[u8; 16]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&gid[..8]);
    u64::from_be_bytes(a)
}

/// Chooses the port, in the order described in the module docs. `near`
/// holds the NUMA nodes this process runs on; `hint` device names, nearest
/// first. The error says what was found and why nothing fits.
pub fn choose(
    ports: &[PortDesc],
    spec: Option<&HcaSpec>,
    gid_index: Option<u32>,
    near: &[i32],
    hint: &[String],
) -> Result<Chosen, String> {
    if ports.is_empty() {
        return Err("no RDMA device (the verbs library lists none)".into());
    }
    let mut why = Vec::new();
    let mut ok: Vec<(usize, &PortDesc)> = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let name = format!("{}:{}", p.device, p.port);
        if spec.is_some_and(|s| !s.matches(&p.device, p.port)) {
            why.push(format!("{name} not selected by BRAID_IB_HCA"));
        } else if !p.active {
            why.push(format!("{name} not ACTIVE"));
        } else if let LinkLayer::Other(l) = p.link_layer {
            why.push(format!(
                "{name} link layer {l} is neither InfiniBand nor Ethernet"
            ));
        } else {
            ok.push((i, p));
        }
    }
    let rank = |p: &PortDesc| -> (usize, usize) {
        let h = hint
            .iter()
            .position(|h| *h == p.device)
            .unwrap_or(hint.len());
        let n = match p.numa_node {
            Some(n) if n >= 0 && !near.is_empty() => usize::from(!near.contains(&n)),
            _ => 0,
        };
        (h, n)
    };
    ok.sort_by_key(|(i, p)| (rank(p), *i));
    for (_, p) in ok {
        match gid_for(p, gid_index) {
            Ok(g) => {
                let roce = p.link_layer == LinkLayer::Ethernet;
                return Ok(Chosen {
                    device: p.device.clone(),
                    port: p.port,
                    gid_index: g.index,
                    addr: Addr {
                        lid: p.lid,
                        gid: g.gid,
                        roce,
                        mtu: p.mtu.clamp(1, 5),
                    },
                    fabric: if roce {
                        "roce".into()
                    } else {
                        format!("ib:{:016x}", subnet_prefix(&g.gid))
                    },
                });
            }
            Err(e) => why.push(e),
        }
    }
    Err(format!("no usable RDMA port: {}", why.join("; ")))
}

/// Whether two fabric ids can reach each other.
pub fn same_fabric(a: &str, b: &str) -> bool {
    a == b
}

/// The NUMA nodes whose CPUs this process may run on (from
/// `/proc/self/status` and `/sys/devices/system/node`); empty when unknown.
pub fn local_numa_nodes() -> Vec<i32> {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return Vec::new();
    };
    let Some(allowed) = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(parse_cpulist)
    else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(n) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let cpus = std::fs::read_to_string(e.path().join("cpulist"))
            .map(|s| parse_cpulist(&s))
            .unwrap_or_default();
        if cpus.iter().any(|c| allowed.contains(c)) {
            out.push(n);
        }
    }
    out.sort_unstable();
    out
}

/// Parses a kernel CPU list (`0-3,8,10-11`).
pub fn parse_cpulist(s: &str) -> Vec<u32> {
    let mut v = Vec::new();
    for part in s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    if b >= a && b - a < 1 << 16 {
                        v.extend(a..=b);
                    }
                }
            }
            None => {
                if let Ok(a) = part.parse() {
                    v.push(a);
                }
            }
        }
    }
    v
}

/// The NUMA node of an RDMA device from sysfs, when the kernel says.
/// Where the kernel lists RDMA devices.
pub const SYSFS_CLASS: &str = "/sys/class/infiniband";

/// The RDMA devices under `dir` (normally [`SYSFS_CLASS`]), sorted; none
/// when it is absent.
pub fn sysfs_devices(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

pub fn device_numa_node(device: &str) -> Option<i32> {
    std::fs::read_to_string(format!("/sys/class/infiniband/{device}/device/numa_node"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(index: u32, kind: GidKind, last: [u8; 4], mapped: bool) -> GidDesc {
        let mut g = [0u8; 16];
        if mapped {
            g[10] = 0xff;
            g[11] = 0xff;
        } else {
            g[0] = 0xfe;
            g[1] = 0x80;
        }
        g[12..].copy_from_slice(&last);
        GidDesc {
            index,
            gid: g,
            kind,
        }
    }

    fn port(device: &str, port: u8, ll: LinkLayer, active: bool, numa: Option<i32>) -> PortDesc {
        PortDesc {
            device: device.into(),
            port,
            active,
            link_layer: ll,
            lid: if ll == LinkLayer::InfiniBand { 3 } else { 0 },
            mtu: 5,
            gids: match ll {
                LinkLayer::InfiniBand => vec![gid(0, GidKind::IbOrRoceV1, [0, 0, 0, 1], false)],
                _ => vec![
                    gid(0, GidKind::IbOrRoceV1, [1, 2, 3, 4], false),
                    gid(1, GidKind::RoceV2, [1, 2, 3, 4], false),
                    gid(2, GidKind::IbOrRoceV1, [10, 0, 0, 1], true),
                    gid(3, GidKind::RoceV2, [10, 0, 0, 1], true),
                ],
            },
            numa_node: numa,
        }
    }

    #[test]
    fn hca_spec_follows_nccl_syntax() {
        let s = HcaSpec::parse("mlx5_0:1,mlx5_1").unwrap();
        assert!(s.matches("mlx5_0", 1));
        assert!(!s.matches("mlx5_0", 2));
        assert!(s.matches("mlx5_1", 2));
        assert!(!s.matches("rxe0", 1));
        // Prefixes unless '='.
        let s = HcaSpec::parse("mlx5").unwrap();
        assert!(s.matches("mlx5_3", 1));
        let s = HcaSpec::parse("=mlx5").unwrap();
        assert!(!s.matches("mlx5_3", 1));
        assert!(s.matches("mlx5", 1));
        // Exclusion.
        let s = HcaSpec::parse("^mlx5_1,rxe").unwrap();
        assert!(s.matches("mlx5_0", 1));
        assert!(!s.matches("mlx5_1", 1));
        assert!(!s.matches("rxe0", 1));
        let s = HcaSpec::parse("^=mlx5_1:2").unwrap();
        assert!(s.matches("mlx5_1", 1));
        assert!(!s.matches("mlx5_1", 2));
        assert!(s.matches("mlx5_10", 2));
        let e = HcaSpec::parse("mlx5_0:x").unwrap_err();
        assert!(
            e.contains("\"mlx5_0:x\": the port after ':' must be a number"),
            "{e}"
        );
        let e = HcaSpec::parse("mlx5_0:0").unwrap_err();
        assert!(e.contains("numbered from 1"), "{e}");
    }

    #[test]
    fn roce_prefers_v2_ipv4_and_ib_uses_gid0() {
        let ports = vec![port("rxe0", 1, LinkLayer::Ethernet, true, None)];
        let c = choose(&ports, None, None, &[], &[]).unwrap();
        assert_eq!(
            (c.gid_index, c.addr.roce, c.fabric.as_str()),
            (3, true, "roce")
        );
        let c = choose(&ports, None, Some(1), &[], &[]).unwrap();
        assert_eq!(c.gid_index, 1);
        let e = choose(&ports, None, Some(9), &[], &[]).unwrap_err();
        assert!(e.contains("index 9"), "{e}");
        let ports = vec![port("mlx5_0", 1, LinkLayer::InfiniBand, true, None)];
        let c = choose(&ports, None, None, &[], &[]).unwrap();
        assert_eq!(c.gid_index, 0);
        assert_eq!(c.addr.lid, 3);
        assert_eq!(c.fabric, "ib:fe80000000000000");
    }

    #[test]
    fn inactive_excluded_and_unknown_ports_are_explained() {
        let ports = vec![
            port("mlx5_0", 1, LinkLayer::InfiniBand, false, None),
            port("mlx5_1", 1, LinkLayer::Other(0), true, None),
            port("rxe0", 1, LinkLayer::Ethernet, true, None),
        ];
        let spec = HcaSpec::parse("^rxe").unwrap();
        let e = choose(&ports, Some(&spec), None, &[], &[]).unwrap_err();
        assert!(e.contains("mlx5_0:1 not ACTIVE"), "{e}");
        assert!(e.contains("neither InfiniBand nor Ethernet"), "{e}");
        assert!(e.contains("rxe0:1 not selected by BRAID_IB_HCA"), "{e}");
        assert_eq!(choose(&ports, None, None, &[], &[]).unwrap().device, "rxe0");
        assert!(choose(&[], None, None, &[], &[])
            .unwrap_err()
            .contains("no RDMA device"));
    }

    #[test]
    fn nearest_numa_node_then_hint_win() {
        let ports = vec![
            port("mlx5_0", 1, LinkLayer::InfiniBand, true, Some(0)),
            port("mlx5_1", 1, LinkLayer::InfiniBand, true, Some(1)),
        ];
        assert_eq!(
            choose(&ports, None, None, &[], &[]).unwrap().device,
            "mlx5_0"
        );
        assert_eq!(
            choose(&ports, None, None, &[1], &[]).unwrap().device,
            "mlx5_1"
        );
        let hint = vec!["mlx5_0".to_string()];
        assert_eq!(
            choose(&ports, None, None, &[1], &hint).unwrap().device,
            "mlx5_0"
        );
    }

    #[test]
    fn cpulists_parse() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<u32>::new());
    }
}

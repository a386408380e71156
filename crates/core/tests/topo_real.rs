//! Topology on real data: cloud vendors' NCCL topology files and hwloc's
//! sysfs captures of real machines (tests/fixtures/topo/real; its README
//! gives each file's repository, path and commit).
//!
//! The expected values are NCCL's conclusions (for the XML: counts of the
//! file's own elements, taken by an independent string scan below, and the
//! NIC each GPU uses by NCCL's rule, worked out by hand from the file's
//! PCI tree in the comments) and hwloc's (for sysfs: counts read from
//! hwloc's expected `lstopo` output shipped with each capture). None of
//! them is what braid prints.

use std::path::{Path, PathBuf};

use braid_core::topo::{
    self, detect, graph, merge, nvml, plan, render, sysfs, xml, Cluster, CrossNic, NicKind, NoGpus,
    PathType, RecordedGpus, SysfsReader, System, Topology, TransportKind, TransportPolicy,
};

fn real() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topo/real")
}

fn vendor(name: &str) -> System {
    topo::load_file(&real().join("vendor").join(name)).unwrap()
}

fn vendor_text(name: &str) -> String {
    std::fs::read_to_string(real().join("vendor").join(name)).unwrap()
}

fn policy(env: &[(&str, &str)]) -> TransportPolicy {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    TransportPolicy::from_env(&|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        .unwrap()
}

// ---------------------------------------------------------------------------
// Vendor topology files
// ---------------------------------------------------------------------------

/// Per file, counted from the file itself: `<cpu>` elements (NUMA nodes),
/// `<gpu>` elements, display-class (`0x03`) `<pci>` elements, `<net>`
/// elements (NIC ports), network-class (`0x02`) `<pci>` elements without a
/// `<nic>` (partial files), NVLinks (the sum of `count`) and NVSwitches
/// (distinct `target`s of `tclass="0x068000"`).
struct Counts {
    file: &'static str,
    numa: usize,
    gpu_elements: usize,
    display_pci: usize,
    nets: usize,
    bare_nics: usize,
    nvlinks: u32,
    nvswitches: usize,
}

const COUNTS: &[Counts] = &[
    Counts {
        file: "aws-g5.48xl-topo.xml",
        numa: 2,
        gpu_elements: 0,
        display_pci: 0,
        nets: 0,
        bare_nics: 0,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "aws-p4d-24xl-topo.xml",
        numa: 2,
        gpu_elements: 0,
        display_pci: 8,
        nets: 0,
        bare_nics: 4,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "aws-p4de-24xl-topo.xml",
        numa: 2,
        gpu_elements: 0,
        display_pci: 8,
        nets: 0,
        bare_nics: 4,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "aws-p5.48xl-topo.xml",
        numa: 2,
        gpu_elements: 0,
        display_pci: 0,
        nets: 0,
        bare_nics: 0,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "azure-ncv4-topo.xml",
        numa: 4,
        gpu_elements: 4,
        display_pci: 4,
        nets: 1,
        bare_nics: 0,
        nvlinks: 48,
        nvswitches: 0,
    },
    Counts {
        file: "azure-ndv2-topo.xml",
        numa: 2,
        gpu_elements: 0,
        display_pci: 8,
        nets: 0,
        bare_nics: 1,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "azure-ndv4-topo.xml",
        numa: 4,
        gpu_elements: 0,
        display_pci: 8,
        nets: 0,
        bare_nics: 8,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "azure-ndv5-topo.xml",
        numa: 2,
        gpu_elements: 0,
        display_pci: 8,
        nets: 0,
        bare_nics: 8,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "ibm-gx3d-h100-topo.xml",
        numa: 2,
        gpu_elements: 8,
        display_pci: 8,
        nets: 8,
        bare_nics: 0,
        nvlinks: 144,
        nvswitches: 4,
    },
    Counts {
        file: "oci-H100-topology.xml",
        numa: 2,
        gpu_elements: 8,
        display_pci: 8,
        nets: 16,
        bare_nics: 0,
        nvlinks: 144,
        nvswitches: 4,
    },
    Counts {
        file: "oci-topo-flattened.xml",
        numa: 4,
        gpu_elements: 0,
        display_pci: 8,
        nets: 0,
        bare_nics: 8,
        nvlinks: 0,
        nvswitches: 0,
    },
    Counts {
        file: "oci-topo-flattened-b4.xml",
        numa: 4,
        gpu_elements: 0,
        display_pci: 8,
        nets: 0,
        bare_nics: 8,
        nvlinks: 0,
        nvswitches: 0,
    },
];

/// An independent count of a file's elements: a scan of the text for tags
/// and attributes, no XML parser (comments skipped).
fn scan_counts(text: &str) -> (usize, usize, usize, usize, usize, u32, usize) {
    let mut body = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("<!--") {
        body.push_str(&rest[..i]);
        rest = rest[i..].find("-->").map_or("", |j| &rest[i + j + 3..]);
    }
    body.push_str(rest);
    let attr = |tag: &str, name: &str| -> Option<String> {
        let k = format!(" {name}=\"");
        let at = tag.find(&k)? + k.len();
        Some(tag[at..].split('"').next()?.to_string())
    };
    let tags: Vec<&str> = body
        .split('<')
        .skip(1)
        .map(|t| t.split('>').next().unwrap_or(""))
        .collect();
    let is =
        |t: &&str, n: &str| t.starts_with(n) && t[n.len()..].starts_with([' ', '/']) || *t == n;
    let cpus = tags.iter().filter(|t| is(t, "cpu")).count();
    let gpus = tags.iter().filter(|t| is(t, "gpu")).count();
    let nets = tags.iter().filter(|t| is(t, "net")).count();
    let mut display = 0;
    let mut bare = 0;
    for (i, t) in tags.iter().enumerate().filter(|(_, t)| is(t, "pci")) {
        let class = attr(t, "class").unwrap_or_default();
        if class.starts_with("0x03") {
            display += 1;
        }
        // A network-class <pci> with no <nic> before its end.
        if class.starts_with("0x02") {
            let closed_at_once = t.ends_with('/');
            let has_nic = !closed_at_once
                && tags[i + 1..]
                    .iter()
                    .take_while(|x| !x.starts_with("/pci"))
                    .any(|x| is(x, "nic"));
            if !has_nic {
                bare += 1;
            }
        }
    }
    let mut links = 0;
    let mut switches: Vec<String> = Vec::new();
    for t in tags.iter().filter(|t| is(t, "nvlink")) {
        links += attr(t, "count")
            .and_then(|c| c.parse::<u32>().ok())
            .unwrap_or(1);
        if attr(t, "tclass").as_deref() == Some("0x068000") {
            switches.push(attr(t, "target").unwrap_or_default());
        }
    }
    switches.sort();
    switches.dedup();
    (cpus, gpus, display, nets, bare, links, switches.len())
}

#[test]
fn vendor_files_counts() {
    let mut seen = 0;
    for c in COUNTS {
        // The table is what the file says.
        let scanned = scan_counts(&vendor_text(c.file));
        assert_eq!(
            scanned,
            (
                c.numa,
                c.gpu_elements,
                c.display_pci,
                c.nets,
                c.bare_nics,
                c.nvlinks,
                c.nvswitches
            ),
            "{}: table against the file",
            c.file
        );
        // braid reads the same.
        let s = vendor(c.file);
        assert_eq!(s.numa_nodes(), c.numa, "{}: NUMA nodes", c.file);
        assert_eq!(
            s.gpus().len(),
            c.display_pci,
            "{}: GPUs (gpu elements, and display-class PCI endpoints of partial files)",
            c.file
        );
        assert_eq!(
            s.gpus().iter().filter(|g| g.pci.gpu.is_some()).count(),
            c.gpu_elements,
            "{}",
            c.file
        );
        assert_eq!(s.nets().len(), c.nets, "{}: NIC ports", c.file);
        assert_eq!(s.bare_nic_endpoints().len(), c.bare_nics, "{}", c.file);
        let links: u32 = s
            .gpus()
            .iter()
            .filter_map(|g| g.pci.gpu.as_ref())
            .flat_map(|g| g.nvlinks.iter())
            .map(|l| l.count)
            .sum();
        assert_eq!(links, c.nvlinks, "{}: NVLinks", c.file);
        assert_eq!(s.nvswitches().len(), c.nvswitches, "{}: NVSwitches", c.file);
        // Export keeps everything NCCL's format holds.
        let again = xml::from_xml("again", &xml::to_xml(&s)).unwrap();
        assert_eq!(again, s, "{}: round trip", c.file);
        seen += 1;
    }
    let files = std::fs::read_dir(real().join("vendor")).unwrap().count();
    assert_eq!(seen, files, "every vendor file has a row");
}

/// The NIC (ports) NCCL's rule gives each GPU of a file, GPUs in device
/// order (`dev`, else bus id), and the transport between two such hosts.
struct Rails {
    file: &'static str,
    nics: &'static [&'static [&'static str]],
    between_hosts: TransportKind,
}

const RAILS: &[Rails] = &[
    // Each GPU shares a PCIe bridge with one NIC (a1:00.0 holds a3 and a4,
    // ...): PIX at 48 GB/s (link_width 0 read as x16, 32 GT/s), every other
    // NIC is across 2.5 GT/s x1 bridges: GPU k uses the NIC beside it.
    Rails {
        file: "ibm-gx3d-h100-topo.xml",
        nics: &[
            &["mlx5_7"],
            &["mlx5_6"],
            &["mlx5_5"],
            &["mlx5_4"],
            &["mlx5_3"],
            &["mlx5_2"],
            &["mlx5_1"],
            &["mlx5_0"],
        ],
        between_hosts: TransportKind::Ib,
    },
    // Each GPU's switch holds one dual-port NIC (PXB, 22.5 GB/s a port):
    // both ports are equally near and the GPU is alone with them, so it
    // uses both (NCCL: ceil(2 ports / 1 GPU) per GPU).
    Rails {
        file: "oci-H100-topology.xml",
        nics: &[
            &["mlx5_0", "mlx5_1"],
            &["mlx5_3", "mlx5_4"],
            &["mlx5_5", "mlx5_6"],
            &["mlx5_7", "mlx5_8"],
            &["mlx5_9", "mlx5_10"],
            &["mlx5_12", "mlx5_13"],
            &["mlx5_14", "mlx5_15"],
            &["mlx5_16", "mlx5_17"],
        ],
        between_hosts: TransportKind::Ib,
    },
    // Two GPUs and two NICs under each switch: the GPUs share them out
    // (device index modulo 2, bit-mirrored), so all 8 NICs carry traffic.
    Rails {
        file: "oci-topo-flattened.xml",
        nics: &[
            &["0000:0c:00.0"],
            &["0000:16:00.0"],
            &["0000:48:00.0"],
            &["0000:4c:00.0"],
            &["0000:8a:00.0"],
            &["0000:94:00.0"],
            &["0000:c3:00.0"],
            &["0000:d1:00.0"],
        ],
        between_hosts: TransportKind::Ib,
    },
    Rails {
        file: "oci-topo-flattened-b4.xml",
        nics: &[
            &["0000:0c:00.0"],
            &["0000:16:00.0"],
            &["0000:47:00.0"],
            &["0000:4b:00.0"],
            &["0000:89:00.0"],
            &["0000:93:00.0"],
            &["0000:c3:00.0"],
            &["0000:d1:00.0"],
        ],
        between_hosts: TransportKind::Ib,
    },
    // Two GPUs and two IB NICs under each (virtual) switch.
    Rails {
        file: "azure-ndv4-topo.xml",
        nics: &[
            &["0101:00:00.0"],
            &["0102:00:00.0"],
            &["0103:00:00.0"],
            &["0104:00:00.0"],
            &["0105:00:00.0"],
            &["0106:00:00.0"],
            &["0107:00:00.0"],
            &["0108:00:00.0"],
        ],
        between_hosts: TransportKind::Ib,
    },
    // One GPU and one NIC per switch (GPU 0008 with NIC 0104).
    Rails {
        file: "azure-ndv5-topo.xml",
        nics: &[
            &["0101:00:00.0"],
            &["0102:00:00.0"],
            &["0103:00:00.0"],
            &["0104:00:00.0"],
            &["0105:00:00.0"],
            &["0106:00:00.0"],
            &["0107:00:00.0"],
            &["0108:00:00.0"],
        ],
        between_hosts: TransportKind::Ib,
    },
    // One IB NIC for 8 GPUs.
    Rails {
        file: "azure-ndv2-topo.xml",
        nics: &[&["0101:00:00.0"] as &[&str]; 8],
        between_hosts: TransportKind::Ib,
    },
    // Two GPUs per EFA adapter.
    Rails {
        file: "aws-p4d-24xl-topo.xml",
        nics: &[
            &["0000:10:1b.0"],
            &["0000:10:1b.0"],
            &["0000:20:1b.0"],
            &["0000:20:1b.0"],
            &["0000:90:1b.0"],
            &["0000:90:1b.0"],
            &["0000:a0:1b.0"],
            &["0000:a0:1b.0"],
        ],
        between_hosts: TransportKind::Ib,
    },
    // eth0 is NCCL's socket transport's (port 0, guid 0x0): sockets.
    Rails {
        file: "azure-ncv4-topo.xml",
        nics: &[&["eth0"] as &[&str]; 4],
        between_hosts: TransportKind::Socket,
    },
];

#[test]
fn vendor_files_two_host_plans_stay_on_one_rail() {
    for case in RAILS {
        let t = Topology::new(vendor(case.file));
        let g = t.gpus.len();
        let c = Cluster::uniform(&t, "h", 2 * g, 2).unwrap();
        let p = plan(&c, &TransportPolicy::default()).unwrap();
        for (r, want) in case.nics.iter().enumerate() {
            let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
            assert_eq!(p.rank_nics[r], want, "{}: rank {r}", case.file);
            assert_eq!(p.rank_nics[r + g], want, "{}: rank {}", case.file, r + g);
        }
        assert_eq!(
            p.transports[0][g],
            Some(case.between_hosts),
            "{}",
            case.file
        );
        let mut distinct: Vec<&str> = case.nics.iter().flat_map(|v| v.iter().copied()).collect();
        distinct.sort();
        distinct.dedup();
        assert_eq!(p.rails.len(), distinct.len(), "{}: rails", case.file);
        assert_eq!(
            p.rings.len(),
            distinct.len(),
            "{}: a channel per rail",
            case.file
        );
        let mut used: Vec<String> = Vec::new();
        for ring in &p.rings {
            let cross: Vec<_> = ring.hops.iter().filter(|h| h.nic_out.is_some()).collect();
            assert_eq!(cross.len(), 2, "{}", case.file);
            for h in cross {
                assert_eq!(h.same_rail(), Some(true), "{}: {h:?}", case.file);
                assert_eq!(h.nic_out, h.nic_in, "{}", case.file);
                used.push(h.nic_in.clone().unwrap());
            }
        }
        used.sort();
        used.dedup();
        assert_eq!(
            used, distinct,
            "{}: every rail carries a channel",
            case.file
        );
        // The only notes: why socket hosts do not use ib (one per host).
        let why_not_ib = |n: &String| n.contains("socket to other hosts, not ib");
        match case.between_hosts {
            TransportKind::Socket => assert!(
                p.notes.len() == 2 && p.notes.iter().all(why_not_ib),
                "{}: {:?}",
                case.file,
                p.notes
            ),
            _ => assert!(p.notes.is_empty(), "{}: {:?}", case.file, p.notes),
        }
        let text = render::plan(&c, &p);
        assert!(
            text.contains(&format!("on one rail: {}", 2 * distinct.len())),
            "{}: {text}",
            case.file
        );
    }
}

/// `BRAID_CROSS_NIC` as `NCCL_CROSS_NIC`, on the IBM file: 0 and 2 keep
/// the rail (the last rank reaches the rail's NIC over NVLink, PXN, at the
/// NIC's speed); 1 leaves through the last rank's own NIC.
#[test]
fn cross_nic_policy() {
    let t = Topology::new(vendor("ibm-gx3d-h100-topo.xml"));
    let c = Cluster::uniform(&t, "h", 16, 2).unwrap();
    for v in ["0", "2"] {
        let p = plan(&c, &policy(&[("BRAID_CROSS_NIC", v)])).unwrap();
        for h in p
            .rings
            .iter()
            .flat_map(|r| &r.hops)
            .filter(|h| h.nic_out.is_some())
        {
            assert_eq!(h.same_rail(), Some(true));
            assert_eq!(h.path_out, Some(PathType::Pxn), "{h:?}");
            assert_eq!(h.path_in, Some(PathType::Pix));
            assert!((h.bw - 25.0).abs() < 1e-9, "{h:?}");
        }
    }
    let p = plan(&c, &policy(&[("BRAID_CROSS_NIC", "1")])).unwrap();
    assert_eq!(p.cross_nic, CrossNic::Allow);
    let crossing = p
        .rings
        .iter()
        .flat_map(|r| &r.hops)
        .filter(|h| h.same_rail() == Some(false))
        .count();
    assert!(crossing > 0, "1 lets hops change rail");
    for h in p
        .rings
        .iter()
        .flat_map(|r| &r.hops)
        .filter(|h| h.nic_out.is_some())
    {
        assert_eq!(h.path_out, Some(PathType::Pix), "own NIC: {h:?}");
    }
    let e = TransportPolicy::from_env(&|k| (k == "BRAID_CROSS_NIC").then(|| "3".into()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("BRAID_CROSS_NIC") && e.contains('3'), "{e}");
    // Trees: the pair of ports for an edge between hosts keeps the rail.
    let p = plan(&c, &TransportPolicy::default()).unwrap();
    assert_eq!(
        p.net_pair(1, 8, 0),
        Some(("mlx5_6".to_string(), "mlx5_6".to_string())),
        "rank 1 leaves through mlx5_6; rank 8 (GPU0) takes it on the same rail"
    );
    assert_eq!(p.net_pair(1, 2, 0), None, "same host");
}

/// Width 0 is x16 (NCCL), so GPU and NIC beside it: PIX 48 GB/s (32 GT/s
/// x16); between GPUs of different bridges NCCL counts the 2.5 GT/s x1
/// bridge links the file gives (0.19 GB/s), but sends over PXN.
#[test]
fn link_width_zero_and_pxn() {
    let t = Topology::new(vendor("ibm-gx3d-h100-topo.xml"));
    let nic = |name: &str| {
        let i = t.net_info.iter().position(|n| n.name == name).unwrap();
        t.nic_of_net(t.nets[i]).unwrap()
    };
    let g0 = t.gpus[0];
    let p = t.path(g0, nic("mlx5_7")).unwrap();
    assert_eq!((p.kind, p.bw), (PathType::Pix, 48.0));
    let p = t.pci_path(g0, nic("mlx5_6")).unwrap();
    assert_eq!(p.kind, PathType::Phb);
    assert!((p.bw - 0.1875).abs() < 1e-9, "{}", p.bw);
    let p = t.gpu_nic_path(g0, nic("mlx5_6")).unwrap();
    assert_eq!((p.kind, p.bw), (PathType::Pxn, 48.0));
    // nvidia-smi: devices of one socket under different bridges are NODE.
    assert_eq!(t.smi_label(g0, nic("mlx5_6")), "NODE");
    assert_eq!(t.smi_label(g0, nic("mlx5_3")), "SYS");
}

/// NCCL writes `guid="0x0"` and `port="0"` for its socket NICs.
#[test]
fn socket_nics_of_nccl_files_are_not_rdma() {
    let s = vendor("azure-ncv4-topo.xml");
    let n = &s.nets()[0];
    assert_eq!(n.net.name, "eth0");
    assert!(!n.net.is_rdma());
    assert_eq!(n.net.kind(), NicKind::Ethernet);
    let ibm = vendor("ibm-gx3d-h100-topo.xml");
    assert!(ibm.nets().iter().all(|n| n.net.is_rdma()));
}

// ---------------------------------------------------------------------------
// Merge with detection
// ---------------------------------------------------------------------------

/// What an ND A100 v4 VM's sysfs and NVML show: 4 NUMA nodes, the GPUs
/// and IB NICs as flat PCI devices (Hyper-V), GPUs on NVSwitches the VM
/// cannot see, and eth0 (Hyper-V's synthetic NIC, not on PCI).
const NDV4_VM: &str = r#"<system version="1" name="ndv4-vm">
  <cpu numaid="0" affinity="00000000,00000000,00ffffff" arch="x86_64" vendor="AuthenticAMD" familyid="23" modelid="49">
    <pci busid="0003:00:00.0" class="0x030200" vendor="0x10de" device="0x20b0"><gpu dev="2" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="0004:00:00.0" class="0x030200" vendor="0x10de" device="0x20b0"><gpu dev="3" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="0103:00:00.0" class="0x020700" vendor="0x15b3"><nic><net name="mlx5_ib2" dev="2" speed="200000" port="1" guid="0x1" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
    <pci busid="0104:00:00.0" class="0x020700" vendor="0x15b3"><nic><net name="mlx5_ib3" dev="3" speed="200000" port="1" guid="0x2" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
    <nic><net name="eth0" dev="0" speed="40000" link_layer="Ethernet" state="up" rdma="0"/></nic>
  </cpu>
  <cpu numaid="1" affinity="00000000,0000ffff,ff000000" arch="x86_64" vendor="AuthenticAMD" familyid="23" modelid="49">
    <pci busid="0001:00:00.0" class="0x030200"><gpu dev="0" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="0002:00:00.0" class="0x030200"><gpu dev="1" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="0101:00:00.0" class="0x020700"><nic><net name="mlx5_ib0" dev="0" speed="200000" port="1" guid="0x3" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
    <pci busid="0102:00:00.0" class="0x020700"><nic><net name="mlx5_ib1" dev="1" speed="200000" port="1" guid="0x4" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
  </cpu>
  <cpu numaid="2" affinity="000000ff,ffff0000,00000000" arch="x86_64" vendor="AuthenticAMD" familyid="23" modelid="49">
    <pci busid="000d:00:00.0" class="0x030200"><gpu dev="6" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="000e:00:00.0" class="0x030200"><gpu dev="7" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="0107:00:00.0" class="0x020700"><nic><net name="mlx5_ib6" dev="6" speed="200000" port="1" guid="0x5" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
    <pci busid="0108:00:00.0" class="0x020700"><nic><net name="mlx5_ib7" dev="7" speed="200000" port="1" guid="0x6" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
  </cpu>
  <cpu numaid="3" affinity="ffffff00,00000000,00000000" arch="x86_64" vendor="AuthenticAMD" familyid="23" modelid="49">
    <pci busid="000b:00:00.0" class="0x030200"><gpu dev="4" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="000c:00:00.0" class="0x030200"><gpu dev="5" sm="80"><nvlink target="fffffff:ffff:ff" count="12" tclass="0x068000"/></gpu></pci>
    <pci busid="0105:00:00.0" class="0x020700"><nic><net name="mlx5_ib4" dev="4" speed="200000" port="1" guid="0x7" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
    <pci busid="0106:00:00.0" class="0x020700"><nic><net name="mlx5_ib5" dev="5" speed="200000" port="1" guid="0x8" link_layer="InfiniBand" state="ACTIVE" rdma="1"/></nic></pci>
  </cpu>
</system>
"#;

/// The Azure NDv4 file (only bus ids and classes) merged with the VM's
/// detection: the GPUs and IB NICs land in the file's switches, the plan
/// uses IB between hosts with each GPU on the NIC of its switch (the file
/// alone planned sockets with `nic -` before).
#[test]
fn partial_vendor_file_merged_with_detection() {
    let file = vendor("azure-ndv4-topo.xml");
    let det = xml::from_xml("vm", NDV4_VM).unwrap();
    let (m, notes) = merge::merge(&file, &det);
    assert_eq!(m.gpus().len(), 8);
    assert_eq!(m.nets().iter().filter(|n| n.net.is_rdma()).count(), 8);
    assert!(
        m.bare_nic_endpoints().is_empty(),
        "every NIC endpoint filled"
    );
    // The file's switch ffff:ff:01.0 (NUMA 0) now holds GPUs 3, 4 and NICs 2, 3.
    let sw = &m.cpus[0].pci[0];
    assert_eq!(sw.busid, "ffff:ff:01.0");
    let names: Vec<&str> = sw
        .children
        .iter()
        .filter_map(|c| c.nic.as_ref())
        .map(|n| n.nets[0].name.as_str())
        .collect();
    assert_eq!(names, ["mlx5_ib2", "mlx5_ib3"]);
    assert!(
        notes.is_empty() || notes.iter().all(|n| !n.contains("dropped")),
        "{notes:?}"
    );
    let t = Topology::new(m);
    let c = Cluster::uniform(&t, "ndv4", 16, 2).unwrap();
    let p = plan(&c, &TransportPolicy::default()).unwrap();
    assert_eq!(p.transports[0][8], Some(TransportKind::Ib));
    // GPUs in device order: dev 0 (0001) .. dev 7 (000e); each on the NIC
    // of its switch, the two GPUs of a switch on different NICs.
    let want = [
        "mlx5_ib0", "mlx5_ib1", "mlx5_ib2", "mlx5_ib3", "mlx5_ib4", "mlx5_ib5", "mlx5_ib6",
        "mlx5_ib7",
    ];
    for (r, w) in want.iter().enumerate() {
        assert_eq!(p.nearest_nic[r].as_deref(), Some(*w), "rank {r}");
    }
    assert_eq!(p.rails.len(), 8);
    assert!(p
        .rings
        .iter()
        .flat_map(|r| &r.hops)
        .filter(|h| h.nic_out.is_some())
        .all(|h| h.same_rail() == Some(true)));
}

/// The same through `BRAID_TOPO_FILE` and a sysfs tree of the VM:
/// `load_host` merges, as NCCL merges `NCCL_TOPO_FILE`.
#[test]
fn braid_topo_file_is_merged_with_detection() {
    let det = xml::from_xml("vm", NDV4_VM).unwrap();
    let root = std::env::temp_dir().join(format!("braid-topo-ndv4-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let unwritten = sysfs::write_tree(&det, &root).unwrap();
    assert!(unwritten.is_empty(), "{unwritten:?}");
    let again = detect(
        &SysfsReader::new(&root).unwrap(),
        &RecordedGpus::in_root(&root).unwrap(),
    )
    .unwrap();
    assert_eq!(again.system.gpus().len(), 8);
    assert_eq!(
        again.system.nets().len(),
        9,
        "8 IB ports and eth0 (not on PCI)"
    );
    let f = real()
        .join("vendor/azure-ndv4-topo.xml")
        .display()
        .to_string();
    let gpus = RecordedGpus::in_root(&root).unwrap();
    let (sys, src, _) = topo::load_host(
        |k| (k == topo::TOPO_FILE_ENV).then(|| f.clone()),
        &root,
        &gpus,
    )
    .unwrap();
    assert!(matches!(src, topo::Source::Merged { .. }), "{src:?}");
    let (direct, _) = merge::merge(&vendor("azure-ndv4-topo.xml"), &again.system);
    assert_eq!(sys, direct);
    assert_eq!(
        sys.cpus[0].pci[0].busid, "ffff:ff:01.0",
        "the file's placement"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// The sysfs of this VM, recorded (tests/fixtures/topo/vm): eth0 is virtio
/// at 0000:00:03.0, and there is no `/sys/class/infiniband`.
fn vm_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topo/vm")
}

fn detect_root(root: &Path) -> System {
    detect(&SysfsReader::new(root).unwrap(), &NoGpus)
        .unwrap()
        .system
}

/// Every pair of ranks on different hosts of `p`.
fn between_hosts(c: &Cluster, p: &topo::Plan) -> Vec<TransportKind> {
    let n = c.ranks.len();
    let mut v = Vec::new();
    for a in 0..n {
        for b in 0..n {
            if c.ranks[a].host != c.ranks[b].host {
                v.push(p.transports[a][b].unwrap());
            }
        }
    }
    v
}

/// Issue 30, item 5: Azure NCv4's file merged with this VM's detection
/// (through `BRAID_TOPO_FILE`, as the runtime and braid-topo load it).
/// The file has eth0 outside the PCI tree; detection finds eth0 on the
/// virtio function 0000:00:03.0 with no RDMA device. The merge used to add
/// that function bare, which the model then took for an RDMA NIC
/// (a placeholder port), and the plan went `ib` between hosts through it.
/// Now eth0 keeps the file's place with what detection knows of it, and
/// the plan is socket, with a note saying why not ib.
#[test]
fn ncv4_file_merged_with_this_vm_plans_socket() {
    let f = real()
        .join("vendor/azure-ncv4-topo.xml")
        .display()
        .to_string();
    let (sys, src, notes) = topo::load_host(
        |k| (k == topo::TOPO_FILE_ENV).then(|| f.clone()),
        &vm_root(),
        &NoGpus,
    )
    .unwrap();
    assert!(matches!(src, topo::Source::Merged { .. }), "{src:?}");
    assert!(sys.bare_nic_endpoints().is_empty(), "{sys:?}");
    let t = Topology::new(sys);
    assert!(
        t.ports(Some(true)).is_none(),
        "no RDMA port: {:?}",
        t.net_info
    );
    assert_eq!(t.net_info.len(), 1, "one eth0: {:?}", t.net_info);
    assert_eq!(t.net_info[0].name, "eth0");
    assert_eq!(t.net_info[0].rdma, Some(false), "detection's word");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("eth0") && n.contains("0000:00:03.0")),
        "{notes:?}"
    );
    let c = Cluster::uniform(&t, "vm", 8, 2).unwrap();
    let p = plan(&c, &TransportPolicy::default()).unwrap();
    assert!(
        between_hosts(&c, &p)
            .iter()
            .all(|&k| k == TransportKind::Socket),
        "{:?}",
        p.transports
    );
    assert_eq!(p.transports[3][4], Some(TransportKind::Socket));
    assert_eq!(p.rank_nics[3], ["eth0"]);
    let why = p
        .notes
        .iter()
        .find(|n| n.contains("not ib"))
        .unwrap_or_else(|| panic!("no note on why not ib: {:?}", p.notes));
    assert!(
        why.contains("eth0") && why.contains("no RDMA device"),
        "{why}"
    );
    let text = render::plan(&c, &p);
    assert!(
        text.contains("3 -> 4: socket NET 12.0 GB/s via eth0 -> eth0"),
        "{text}"
    );
    assert!(!text.contains(": ib "), "{text}");
    // The file alone plans the same.
    let t = Topology::new(vendor("azure-ncv4-topo.xml"));
    let c = Cluster::uniform(&t, "ncv4", 8, 2).unwrap();
    let p = plan(&c, &TransportPolicy::default()).unwrap();
    assert_eq!(p.transports[3][4], Some(TransportKind::Socket));
}

/// A file that names an InfiniBand NIC at 0000:00:03.0 (with its port, or
/// as a bare class-0x0207 endpoint, as partial vendor files do).
const IB_AT_03: &str = r#"<system version="1"><cpu numaid="0" affinity="00000003" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:00:03.0" class="0x020700" link_speed="16.0 GT/s PCIe" link_width="16">
      <nic><net name="mlx5_0" dev="0" speed="200000" port="1" guid="0x1c34da0300a1b2c3" latency="0.000000" maxconn="131072" gdr="0"/></nic>
    </pci></cpu></system>"#;
const BARE_IB_AT_03: &str = r#"<system version="1"><cpu numaid="0" affinity="00000003" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:00:03.0" class="0x020700" link_speed="16.0 GT/s PCIe" link_width="16"/>
    </cpu></system>"#;

fn two_host_plan(sys: System) -> (Topology, Cluster, topo::Plan) {
    let t = Topology::new(sys);
    let c = Cluster::uniform(&t, "h", 2, 2).unwrap();
    let p = plan(&c, &TransportPolicy::default()).unwrap();
    (t, c, p)
}

/// Where detection finds, at the PCI function a file names as an IB NIC,
/// an Ethernet interface and no RDMA device, the merge keeps what
/// detection knows: the file's RDMA port there is dropped (with a note)
/// and the plan is socket; the file alone keeps its claim (ib).
#[test]
fn file_ib_nic_detected_as_ethernet_without_rdma_plans_socket() {
    let det = detect_root(&vm_root());
    for (what, text) in [("port", IB_AT_03), ("bare endpoint", BARE_IB_AT_03)] {
        let file = xml::from_xml("ib-at-03.xml", text).unwrap();
        let (_, _, p) = two_host_plan(file.clone());
        assert_eq!(
            p.transports[0][1],
            Some(TransportKind::Ib),
            "{what}: the file alone is ib"
        );
        let (m, notes) = merge::merge(&file, &det);
        let (t, _, p) = two_host_plan(m);
        assert_eq!(
            p.transports[0][1],
            Some(TransportKind::Socket),
            "{what}: {:?} {notes:?}",
            t.net_info
        );
        assert!(t.ports(Some(true)).is_none(), "{what}: {:?}", t.net_info);
        let names: Vec<&str> = t.net_info.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["eth0"], "{what}");
        assert_eq!(p.rank_nics[0], ["eth0"], "{what}");
        if what == "port" {
            assert!(
                notes
                    .iter()
                    .any(|n| n.contains("mlx5_0") && n.contains("no RDMA device")),
                "{notes:?}"
            );
        }
        assert!(
            p.notes
                .iter()
                .any(|n| n.contains("not ib") && n.contains("eth0")),
            "{what}: {:?}",
            p.notes
        );
    }
}

/// The same file where detection finds the RDMA device on that function
/// (a sysfs tree written for the model, replayed): ib, through mlx5_0.
#[test]
fn file_ib_nic_detected_with_rdma_keeps_ib() {
    let host = xml::from_xml(
        "rdma-host",
        r#"<system version="1" name="rdma-host"><cpu numaid="0" affinity="00000003">
        <pci busid="0000:00:03.0" class="0x020700" vendor="0x15b3" device="0x101b"><nic>
          <net name="mlx5_0" dev="0" speed="200000" port="1" guid="0x1c34da0300a1b2c3" link_layer="InfiniBand" state="ACTIVE" rdma="1"/>
          <net name="ib0" dev="0" speed="200000" link_layer="InfiniBand" state="up" rdma="0"/>
        </nic></pci></cpu></system>"#,
    )
    .unwrap();
    let root = std::env::temp_dir().join(format!("braid-topo-rdma03-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let unwritten = sysfs::write_tree(&host, &root).unwrap();
    assert!(unwritten.is_empty(), "{unwritten:?}");
    let det = detect_root(&root);
    let _ = std::fs::remove_dir_all(&root);
    assert!(
        det.nets()
            .iter()
            .any(|n| n.net.name == "mlx5_0" && n.net.is_rdma()),
        "{:?}",
        det.nets()
    );
    for text in [IB_AT_03, BARE_IB_AT_03] {
        let file = xml::from_xml("ib-at-03.xml", text).unwrap();
        let (m, notes) = merge::merge(&file, &det);
        let (t, _, p) = two_host_plan(m);
        assert_eq!(
            p.transports[0][1],
            Some(TransportKind::Ib),
            "{:?} {notes:?}",
            t.net_info
        );
        assert_eq!(p.rank_nics[0], ["mlx5_0"]);
        assert!(
            p.notes.iter().all(|n| !n.contains("not ib")),
            "{:?}",
            p.notes
        );
    }
}

// ---------------------------------------------------------------------------
// NVML
// ---------------------------------------------------------------------------

fn recorded_ibm() -> nvml::RecordedNvml {
    nvml::RecordedNvml::load(&real().join("nvml/ibm-gx3d-h100.nvml.json")).unwrap()
}

/// NCCL's NVML loop over the recorded answers rebuilds the NVLinks the
/// IBM file holds (the answers were made from that file: see the README).
#[test]
fn nvml_answers_give_the_files_nvlinks() {
    let (gpus, notes) = nvml::NvmlGpus { q: recorded_ibm() }.read();
    assert!(notes.is_empty(), "{notes:?}");
    let file = vendor("ibm-gx3d-h100-topo.xml");
    assert_eq!(gpus.len(), 8);
    for g in &gpus {
        let fp = file.find_pci(&g.busid).unwrap();
        let fg = fp.gpu.as_ref().unwrap();
        assert_eq!(g.gpu.dev, fg.dev, "{}", g.busid);
        assert_eq!(g.gpu.sm, Some(90));
        let mut a = g.gpu.nvlinks.clone();
        let mut b = fg.nvlinks.clone();
        a.sort_by(|x, y| x.target.cmp(&y.target));
        b.sort_by(|x, y| x.target.cmp(&y.target));
        assert_eq!(a, b, "{}", g.busid);
    }
    // Through detection: a sysfs tree of the IBM machine, GPUs from NVML.
    let root = std::env::temp_dir().join(format!("braid-topo-ibm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    sysfs::write_tree(&file, &root).unwrap();
    let d = detect(
        &SysfsReader::new(&root).unwrap(),
        &nvml::NvmlGpus { q: recorded_ibm() },
    )
    .unwrap();
    let t = Topology::new(d.system);
    assert_eq!(t.system.nvswitches().len(), 4);
    assert_eq!(t.smi_label(t.gpus[0], t.gpus[7]), "NV18");
    let _ = std::fs::remove_dir_all(&root);
}

/// What NVML says on awkward machines: a VM that hides the NVSwitches
/// (empty remote bus id: NCCL's fffffff:ffff:ff, an NVSwitch), links that
/// are down, not P2P capable or fail; a device without a bus id.
#[test]
fn nvml_awkward_answers() {
    let text = r#"{"source": "hand-made", "devices": [
      {"bus_id": "00000000:18:00.0", "cc": [8, 0], "links": [
        {"link": 0, "p2p": true, "active": true, "remote": ""},
        {"link": 1, "p2p": true, "active": true, "remote": "\u0001\u0002"},
        {"link": 2, "p2p": true, "active": false, "remote": "00000000:19:00.0"},
        {"link": 3, "p2p": false, "active": true, "remote": "00000000:19:00.0"},
        {"link": 4, "p2p": {"error": "Not Supported"}},
        {"link": 5, "p2p": true, "active": true, "remote": "00000000:19:00.0", "remote_type": "gpu"},
        {"link": 6, "p2p": true, "active": true, "remote": "00000000:19:00.0", "remote_type": "gpu"}
      ]},
      {"bus_id": {"error": "GPU is lost"}, "cc": [8, 0]},
      {"bus_id": "00000000:19:00.0", "cc": {"error": "Unknown Error"}}
    ]}"#;
    let q = nvml::RecordedNvml::parse("hand.json", text).unwrap();
    let (gpus, notes) = nvml::NvmlGpus { q }.read();
    assert_eq!(gpus.len(), 2);
    let l = &gpus[0].gpu.nvlinks;
    assert_eq!(l.len(), 2, "{l:?}");
    assert_eq!(l[0].target, nvml::UNKNOWN_PEER);
    assert_eq!((l[0].count, l[0].tclass), (2, Some(0x068000)));
    assert_eq!(
        (l[1].target.as_str(), l[1].count, l[1].tclass),
        ("0000:19:00.0", 2, None)
    );
    assert!(gpus[1].gpu.nvlinks.is_empty());
    assert!(notes.iter().any(|n| n.contains("GPU is lost")), "{notes:?}");
    assert!(
        notes.iter().any(|n| n.contains("Unknown Error")),
        "{notes:?}"
    );
    // The recorder writes what it asked, and replays to the same GPUs.
    let q = nvml::RecordedNvml::parse("hand.json", text).unwrap();
    let rec = nvml::record(&q);
    let again = nvml::RecordedNvml::parse("again", &rec.to_json()).unwrap();
    assert_eq!(nvml::NvmlGpus { q: again }.read().0, gpus);
}

// ---------------------------------------------------------------------------
// hwloc sysfs captures
// ---------------------------------------------------------------------------

/// What hwloc's expected output says: NUMA nodes, PUs, and per network OS
/// device (Network / OpenFabrics) its name and the bus id of its PCI
/// device.
#[derive(Debug, Default)]
struct Hwloc {
    numa: usize,
    pus: usize,
    ports: Vec<(String, String)>,
}

fn hwloc_expected(name: &str) -> Hwloc {
    let dir = real().join("hwloc");
    let mut h = Hwloc::default();
    if let Ok(text) = std::fs::read_to_string(dir.join(format!("{name}.console"))) {
        let mut pci: Vec<(usize, String)> = Vec::new();
        for line in text.lines() {
            let indent = line.len() - line.trim_start().len();
            let l = line.trim_start();
            pci.retain(|(i, _)| *i < indent);
            if l.starts_with("NUMANode L#") {
                h.numa += 1;
            } else if l.starts_with("PU L#") {
                h.pus += 1;
            } else if let Some(rest) = l.strip_prefix("PCI L#") {
                if let Some(b) = rest.split("busid=").nth(1) {
                    pci.push((indent, b.split(' ').next().unwrap_or("").to_string()));
                }
            } else if l.starts_with("OSDev[Network]") || l.starts_with("OSDev[OpenFabrics]") {
                let name = l.rsplit('"').nth(1).unwrap_or("").to_string();
                let bus = pci.last().map(|p| p.1.clone()).unwrap_or_default();
                h.ports.push((name, bus));
            }
        }
    } else {
        let text = std::fs::read_to_string(dir.join(format!("{name}.xml"))).unwrap();
        // A stack of open <object>s: (type, pci bus id).
        let mut stack: Vec<(String, String)> = Vec::new();
        for line in text.lines() {
            let l = line.trim();
            let attr = |k: &str| {
                l.split(&format!(" {k}=\""))
                    .nth(1)
                    .and_then(|v| v.split('"').next())
                    .unwrap_or("")
                    .to_string()
            };
            if l.starts_with("<object ") {
                let ty = attr("type");
                match ty.as_str() {
                    "NUMANode" => h.numa += 1,
                    "PU" => h.pus += 1,
                    "OSDev" => {
                        let t: u32 = attr("osdev_type").parse().unwrap_or(0);
                        if t & (16 | 32) != 0 {
                            let bus = stack
                                .iter()
                                .rev()
                                .find(|(ty, _)| ty == "PCIDev")
                                .map(|x| x.1.clone())
                                .unwrap_or_default();
                            h.ports.push((attr("name"), bus));
                        }
                    }
                    _ => {}
                }
                if !l.ends_with("/>") {
                    stack.push((ty, attr("pci_busid")));
                }
            } else if l.starts_with("</object>") {
                stack.pop();
            }
        }
    }
    h.ports.sort();
    h
}

const CAPTURES: [&str; 15] = [
    "128arm-2pa2n8cluster4co",
    "128ia64-17n4s2c",
    "16amd64-8n2c",
    "256ppc-8n8s4t",
    "2pa-pcidomain32bits",
    "32em64t-2n8c+dax+nvme+mic+dimms",
    "32intel64-2p8co2t+8ve",
    "40intel64-2g2n4c+pcilocality",
    "40intel64-4n10c+pci-conflicts",
    "48amd64-4pa2n6c-sparse",
    "64amd64-4s2n4ca2co",
    "8em64t-2s2ca2c-buggynuma",
    "96em64t-4no4pa3ca2co",
    "nvidiagpunumanodes",
    "offline-cpu0-node0",
];

fn detect_capture(name: &str) -> topo::Detected {
    let reader = SysfsReader::new(real().join("hwloc").join(name)).unwrap();
    detect(&reader, &NoGpus).unwrap()
}

/// Adapter of a bus id (functions of one adapter are one NIC in braid).
fn adapter(busid: &str) -> &str {
    busid.rsplit_once('.').map_or(busid, |x| x.0)
}

#[test]
fn hwloc_captures_detect_as_hwloc_sees_them() {
    for name in CAPTURES {
        let want = hwloc_expected(name);
        let d = detect_capture(name);
        let s = &d.system;
        assert_eq!(s.numa_nodes(), want.numa, "{name}: NUMA nodes");
        assert_eq!(s.cpu_count(), want.pus, "{name}: CPUs (hwloc's PUs)");
        let mut ports: Vec<(String, String)> = s
            .nets()
            .iter()
            .map(|n| {
                (
                    n.net.name.clone(),
                    n.pci.map(|p| p.busid.clone()).unwrap_or_default(),
                )
            })
            .collect();
        ports.sort();
        let names = |v: &[(String, String)]| v.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
        assert_eq!(names(&ports), names(&want.ports), "{name}: NIC ports");
        for ((n, ours), (_, theirs)) in ports.iter().zip(&want.ports) {
            assert_eq!(adapter(ours), adapter(theirs), "{name}: {n}'s PCI device");
        }
        // Every capture plans: CPU ranks on nodes with CPUs only.
        let t = Topology::new(s.clone());
        let c = Cluster::uniform(&t, name, 2 * t.system.cpus.len().max(1), 1).unwrap();
        plan(&c, &TransportPolicy::default()).unwrap();
        for r in &c.ranks {
            let node = r.numa.unwrap();
            let cpu = s.cpus.iter().find(|x| x.numaid == node).unwrap();
            assert!(
                !cpu.affinity.as_ref().unwrap().is_empty(),
                "{name}: rank on node {node}"
            );
        }
    }
}

#[test]
fn hwloc_capture_details() {
    // Kunpeng 920: cpumaps end in "\n\0".
    let d = detect_capture("128arm-2pa2n8cluster4co");
    assert_eq!(
        d.system.cpus[0].affinity.as_ref().unwrap().to_list(),
        "0-31"
    );
    assert_eq!(
        d.system.cpus[3].affinity.as_ref().unwrap().to_list(),
        "96-127"
    );
    // POWER9 + V100: the six GPU memory nodes are not NUMA nodes of CPUs.
    let d = detect_capture("nvidiagpunumanodes");
    let ids: Vec<i32> = d.system.cpus.iter().map(|c| c.numaid).collect();
    assert_eq!(ids, [0, 8]);
    assert_eq!(
        d.notes
            .iter()
            .filter(|n| n.contains("memory of GPU"))
            .count(),
        6
    );
    // Superdome: node 16 has memory and no CPU; no rank goes there.
    let d = detect_capture("128ia64-17n4s2c");
    let t = Topology::new(d.system.clone());
    let c = Cluster::uniform(&t, "sd", 17, 1).unwrap();
    assert!(c.ranks.iter().all(|r| r.numa != Some(16)));
    // Buggy BIOS: eight nodes listing the same 8 CPUs are one node of 8.
    let d = detect_capture("8em64t-2s2ca2c-buggynuma");
    assert_eq!((d.system.numa_nodes(), d.system.cpu_count()), (1, 8));
    // Two functions of one adapter are one NIC: ports of one NIC (PIX).
    let d = detect_capture("40intel64-2g2n4c+pcilocality");
    let t = Topology::new(d.system.clone());
    let nic = |n: &str| {
        let i = t.net_info.iter().position(|x| x.name == n).unwrap();
        t.nic_of_net(t.nets[i]).unwrap()
    };
    assert_eq!(nic("eth0"), nic("eth1"));
    assert_ne!(nic("eth0"), nic("eth2"));
    // eth0/eth1 and eth2/eth3 sit under root ports 00:05.0 and 00:06.0 of
    // one host bridge (hwloc: bridges 0000:[02-02] and [03-03] under
    // 0000:[00-09]).
    assert_eq!(
        t.path(nic("eth2"), nic("eth0")).unwrap().kind,
        PathType::Phb
    );
    assert_eq!(t.smi_label(nic("eth2"), nic("eth0")), "PHB");
    // IPoIB is a socket interface on InfiniBand, next to its verbs device.
    let ib0 = d
        .system
        .nets()
        .into_iter()
        .find(|n| n.net.name == "ib0")
        .unwrap();
    assert_eq!(ib0.net.kind(), NicKind::IpOverIb);
    assert_eq!(nic("ib0"), nic("qib0"));
    let text = render::summary(&t, &d.notes);
    assert!(text.contains("ib0 IPoIB"), "{text}");
    // 32-bit PCI domains, and a virtio NIC under its PCI function.
    let d = detect_capture("2pa-pcidomain32bits");
    assert_eq!(d.system.nets()[0].pci.unwrap().busid, "0000:00:03.0");
    assert!(sysfs::is_bdf("10000:00:04.0"));
    // CPUs whose node is offline stay CPUs (hwloc keeps them).
    let d = detect_capture("offline-cpu0-node0");
    assert_eq!(d.system.cpu_count(), 17);
    assert_eq!(d.system.numa_nodes(), 1);
}

// ---------------------------------------------------------------------------
// Files, display, sysfs writing
// ---------------------------------------------------------------------------

/// Several `<gpu>` in one `<pci>` (NCCL's layout for several ranks on one
/// GPU) and `<c2c>` (Grace): one GPU, everything kept on export.
#[test]
fn several_gpus_in_one_pci_and_c2c() {
    let text = r#"<system version="1">
  <cpu numaid="0" affinity="0000ffff" arch="arm64">
    <pci busid="0009:01:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
      <gpu dev="0" sm="90" rank="0" gdr="1">
        <c2c bw="22500" count="10"/>
      </gpu>
      <gpu dev="0" sm="90" rank="1" gdr="1"/>
    </pci>
    <pci busid="0000:01:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
      <nic><net name="mlx5_0" dev="0" speed="400000" port="1" guid="0x1"/></nic>
    </pci>
  </cpu>
</system>
"#;
    let s = xml::from_xml("gh.xml", text).unwrap();
    assert_eq!(s.gpus().len(), 1, "one physical GPU");
    let p = s.find_pci("0009:01:00.0").unwrap();
    assert_eq!(p.extra_gpus.len(), 1);
    assert_eq!(p.gpu.as_ref().unwrap().c2c[0].total_bw(), 225.0);
    let out = xml::to_xml(&s);
    assert_eq!(out.matches("<gpu ").count(), 2);
    assert!(out.contains("<c2c bw=\"22500\" count=\"10\"/>"), "{out}");
    assert_eq!(xml::from_xml("again", &out).unwrap(), s);
    let t = Topology::new(s);
    let (g, c) = (t.gpus[0], t.cpus[0]);
    assert_eq!(t.path(g, c).unwrap().kind, PathType::C2c);
    let nic = t.nic_of_net(t.nets[0]).unwrap();
    let p = t.gpu_nic_path(g, nic).unwrap();
    assert_eq!(p.kind, PathType::P2c, "GPU → C2C → CPU → PCIe → NIC");
    // Two ranks on the GPU: they share it.
    let cl = Cluster {
        hosts: vec![topo::plan::Host {
            name: "gh".into(),
            topo: t,
        }],
        ranks: vec![
            topo::RankPlace {
                host: 0,
                gpu: Some("0009:01:00.0".into()),
                numa: None,
            },
            topo::RankPlace {
                host: 0,
                gpu: Some("0009:01:00.0".into()),
                numa: None,
            },
        ],
    };
    let pl = plan(&cl, &TransportPolicy::default()).unwrap();
    assert_eq!(pl.transports[0][1], Some(TransportKind::Nvlink));
}

#[test]
fn matrix_columns_do_not_run_together() {
    let mut s = vendor("ibm-gx3d-h100-topo.xml");
    // A long CPU list (every other CPU of node 0).
    s.cpus[0].affinity = Some(topo::CpuSet((0..80).step_by(2).collect()));
    let t = Topology::new(s);
    let m = render::matrix(&t);
    let list = t.system.cpus[0].affinity.as_ref().unwrap().to_list();
    assert!(list.len() > 16);
    let row = m.lines().find(|l| l.starts_with("GPU0 ")).unwrap();
    assert!(row.contains(&format!("{list}  ")), "{row}");
    assert!(row.trim_end().ends_with(" 0"), "{row}");
}

/// `--write-sysfs`: buses 00 and 01 get host bridges of their own, NICs
/// outside the PCI tree and bare endpoints are not dropped silently.
#[test]
fn write_tree_keeps_what_it_can_and_says_what_it_cannot() {
    let text = r#"<system version="1">
  <cpu numaid="0" affinity="000000ff">
    <pci busid="0000:00:08.0" class="0x020000"><nic><net name="eth0" dev="0" port="0" rdma="0"/></nic></pci>
    <pci busid="0000:01:00.0" class="0x020700"><nic><net name="mlx5_0" dev="0" port="1" rdma="1"/></nic></pci>
    <pci busid="0000:02:00.0" class="0x020700"/>
  </cpu>
  <cpu numaid="1" affinity="0000ff00">
    <nic><net name="ib0" dev="1" link_layer="InfiniBand" rdma="0"/></nic>
  </cpu>
</system>
"#;
    let s = xml::from_xml("w.xml", text).unwrap();
    let root = std::env::temp_dir().join(format!("braid-topo-write-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let unwritten = sysfs::write_tree(&s, &root).unwrap();
    assert_eq!(unwritten.len(), 1, "{unwritten:?}");
    assert!(unwritten[0].contains("0000:02:00.0"));
    let d = detect(&SysfsReader::new(&root).unwrap(), &NoGpus).unwrap();
    let t = Topology::new(d.system.clone());
    let nic = |n: &str| {
        let i = t.net_info.iter().position(|x| x.name == n).unwrap();
        t.nic_of_net(t.nets[i]).unwrap()
    };
    assert_eq!(
        t.smi_label(nic("eth0"), nic("mlx5_0")),
        "NODE",
        "two host bridges"
    );
    let ib0 = d.system.cpus.iter().find(|c| c.numaid == 1).unwrap();
    assert_eq!(
        ib0.nics[0].nets[0].name, "ib0",
        "CPU-attached NIC kept on its node"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// A placeholder port per NIC-class endpoint of a partial file, RDMA.
#[test]
fn placeholders_for_partial_files() {
    let t = Topology::new(vendor("azure-ndv5-topo.xml"));
    assert_eq!(t.net_info.len(), 8);
    for n in &t.net_info {
        assert_eq!(n.attrs.get("placeholder").map(String::as_str), Some("1"));
        assert_eq!(n.kind(), NicKind::InfiniBand);
    }
    let t = Topology::new(vendor("aws-p4d-24xl-topo.xml"));
    assert!(t
        .net_info
        .iter()
        .all(|n| n.is_rdma() && n.kind() == NicKind::RoCE));
    assert_eq!(graph::mirror_bits(1, 4), 2);
}

/// The tree plans on the real files' clusters keep rails end to end: with
/// the communicator's ring (the plan's first channel) and hosts as the
/// plan places the ranks, every message between hosts of the double binary
/// tree AllReduce and of the binomial Broadcast and Reduce (every root)
/// goes between two ranks whose own NIC (port 0) is the same device, on 2
/// and 4 hosts — and the flat trees (no hosts given) break that on every
/// file with more than one rail, so the check can fail.
#[test]
fn vendor_files_tree_plans_stay_on_one_rail() {
    use braid_core::plan::{plan_with, Algo, Choice, Collective, PlanParams};
    use braid_core::{DataType, RedOp};
    for case in RAILS {
        let t = Topology::new(vendor(case.file));
        let g = t.gpus.len();
        for nh in [2usize, 4] {
            let c = Cluster::uniform(&t, "h", nh * g, nh).unwrap();
            let p = plan(&c, &TransportPolicy::default()).unwrap();
            let n = nh * g;
            let ring = p.rings[0].order.clone();
            let hosts: Vec<u32> = p.rank_host.iter().map(|&h| h as u32).collect();
            let nic = |r: usize| p.rank_nics[r][0].clone();
            let mut colls = vec![Collective::AllReduce {
                count: 4096,
                op: RedOp::Sum,
            }];
            for root in [0, 1, g as u32 - 1, g as u32 + 2] {
                colls.push(Collective::Broadcast { count: 4096, root });
                colls.push(Collective::Reduce {
                    count: 4096,
                    root,
                    op: RedOp::Sum,
                });
            }
            // Messages between hosts that change NIC, with and without
            // hosts given to the planner.
            let off_rail = |coll: &Collective, with_hosts: bool| -> usize {
                let mut bad = 0;
                for r in 0..n {
                    let params = PlanParams {
                        ring: ring.clone(),
                        ..PlanParams::new(r as u32, n as u32, 4096)
                    };
                    let h: &[u32] = if with_hosts { &hosts } else { &[] };
                    let prog =
                        plan_with(coll, DataType::F32, &params, Choice::of(Algo::Tree), h).unwrap();
                    for op in &prog.ops {
                        let Some(to) = op.send_peer() else { continue };
                        let to = to as usize;
                        if p.rank_host[r] != p.rank_host[to] && nic(r) != nic(to) {
                            bad += 1;
                        }
                    }
                }
                bad
            };
            let mut flat_bad = 0;
            for coll in &colls {
                assert_eq!(
                    off_rail(coll, true),
                    0,
                    "{} on {nh} hosts: {coll:?} leaves its rail",
                    case.file
                );
                flat_bad += off_rail(coll, false);
            }
            let distinct: std::collections::BTreeSet<String> = (0..g).map(nic).collect();
            if distinct.len() > 1 {
                assert!(
                    flat_bad > 0,
                    "{} on {nh} hosts: the flat trees stay on one rail too: the check proves nothing",
                    case.file
                );
            }
        }
    }
}

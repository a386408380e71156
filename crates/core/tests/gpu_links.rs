//! Device links of GPU ranks, decided by the one planner: which pairs use
//! NVLink, PCIe peer-to-peer or staging through host memory, under the P2P
//! level and switches, as NCCL's `p2pCanConnect` with `NCCL_P2P_LEVEL` and
//! `NCCL_P2P_DISABLE` decides (fixtures under tests/fixtures/topo).

// Pairs of GPU indices read clearer than nested enumerations here.
#![allow(clippy::needless_range_loop)]

use std::path::PathBuf;

use braid_core::topo::{
    self, Cluster, GpuLink, PathType, RankPlace, Topology, TransportKind, TransportPolicy,
};

fn fixture(name: &str) -> Topology {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/topo")
        .join(name);
    Topology::new(topo::load_file(&p).expect("fixture"))
}

fn env(pairs: &[(&str, &str)]) -> TransportPolicy {
    let pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    TransportPolicy::from_env(&move |k: &str| {
        pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })
    .expect("policy")
}

/// One rank per GPU of `t`; `links[i][j]` between the ranks of GPUs i and j.
fn links(t: &Topology, policy: &TransportPolicy) -> Vec<Vec<GpuLink>> {
    let n = t.gpus.len();
    let c = Cluster::uniform(t, "host", n, 1).unwrap();
    let p = topo::plan(&c, policy).unwrap();
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    if i == j {
                        GpuLink::Nvlink
                    } else {
                        p.gpu_link(i, j).expect("one host")
                    }
                })
                .collect()
        })
        .collect()
}

fn gpu_path(t: &Topology, i: usize, j: usize) -> PathType {
    t.path(t.gpus[i], t.gpus[j]).unwrap().kind
}

#[test]
fn nvswitch_server_is_all_nvlink_and_staged_without_p2p() {
    let t = fixture("nvswitch8.xml");
    let l = links(&t, &TransportPolicy::default());
    assert_eq!(l.len(), 8);
    assert!(l.iter().flatten().all(|&k| k == GpuLink::Nvlink));
    let off = links(&t, &env(&[("BRAID_P2P_DISABLE", "1")]));
    for (i, row) in off.iter().enumerate() {
        for (j, &k) in row.iter().enumerate() {
            if i != j {
                assert_eq!(k, GpuLink::PcieStaged, "{i} - {j}");
            }
        }
    }
}

#[test]
fn pcie_server_uses_p2p_under_a_switch_and_stages_across_sockets() {
    let t = fixture("pcie4.xml");
    let l = links(&t, &TransportPolicy::default());
    assert_eq!(l.len(), 4);
    let (mut p2p, mut staged) = (0, 0);
    for i in 0..4 {
        for j in 0..4 {
            if i == j {
                continue;
            }
            let path = t.pci_path(t.gpus[i], t.gpus[j]).unwrap().kind;
            match path {
                PathType::Pix | PathType::Pxb => {
                    assert_eq!(l[i][j], GpuLink::PcieP2p, "{i} - {j}");
                    p2p += 1;
                }
                PathType::Phb | PathType::Sys => {
                    assert_eq!(l[i][j], GpuLink::PcieStaged, "{i} - {j}");
                    staged += 1;
                }
                other => panic!("unexpected path {other} on a PCIe-only server"),
            }
        }
    }
    assert!(p2p > 0, "some pairs share a PCIe switch");
    assert!(staged > 0, "some pairs cross the sockets");
    // BRAID_P2P_LEVEL=SYS allows P2P everywhere.
    let sys = links(&t, &env(&[("BRAID_P2P_LEVEL", "sys")]));
    for (i, row) in sys.iter().enumerate() {
        for (j, &k) in row.iter().enumerate() {
            if i != j {
                assert_eq!(k, GpuLink::PcieP2p, "{i} - {j}");
            }
        }
    }
    // So does the level of PHB for same-socket pairs, not across sockets.
    let phb = links(&t, &env(&[("BRAID_P2P_LEVEL", "PHB")]));
    for i in 0..4 {
        for j in 0..4 {
            if i != j {
                let path = t.pci_path(t.gpus[i], t.gpus[j]).unwrap().kind;
                let want = if path <= PathType::Phb {
                    GpuLink::PcieP2p
                } else {
                    GpuLink::PcieStaged
                };
                assert_eq!(phb[i][j], want, "{i} - {j} ({path})");
            }
        }
    }
}

#[test]
fn nvlink_bridge_server_mixes_nvlink_and_pcie() {
    let t = fixture("nvbridge4.xml");
    let l = links(&t, &TransportPolicy::default());
    let n = t.gpus.len();
    let (mut nv, mut other) = (0, 0);
    for i in 0..n {
        for j in 0..n {
            if i == j {
                continue;
            }
            if t.nvlink_count(t.gpus[i], t.gpus[j]) > 0 {
                assert_eq!(l[i][j], GpuLink::Nvlink, "{i} - {j}");
                nv += 1;
            } else {
                assert_ne!(l[i][j], GpuLink::Nvlink, "{i} - {j}");
                other += 1;
            }
        }
    }
    assert!(nv > 0 && other > 0, "nvlink pairs {nv}, others {other}");
    // NVL level: NVLink pairs stay, PCIe pairs are staged.
    let l = links(&t, &env(&[("BRAID_P2P_LEVEL", "NVL")]));
    for i in 0..n {
        for j in 0..n {
            if i != j {
                let want = if gpu_path(&t, i, j) <= PathType::Nvl {
                    GpuLink::Nvlink
                } else {
                    GpuLink::PcieStaged
                };
                assert_eq!(l[i][j], want, "{i} - {j}");
            }
        }
    }
    // LOC level: no P2P between different GPUs at all.
    let l = links(&t, &env(&[("BRAID_P2P_LEVEL", "LOC")]));
    for i in 0..n {
        for j in 0..n {
            if i != j {
                assert_eq!(l[i][j], GpuLink::PcieStaged, "{i} - {j}");
            }
        }
    }
    // NVLink removed: the NVLink pairs fall back to PCIe P2P or staging.
    let l = links(&t, &env(&[("BRAID_NVLINK_DISABLE", "yes")]));
    assert!(l.iter().enumerate().all(|(i, r)| r
        .iter()
        .enumerate()
        .all(|(j, &k)| i == j || k != GpuLink::Nvlink)));
}

/// Two ranks on one GPU share its memory through CUDA IPC whatever the
/// level; only P2P off stages them. A GPU missing from the model gets no
/// peer-to-peer path, except to its own ranks, and a note says so.
#[test]
fn ranks_sharing_a_gpu_and_gpus_missing_from_the_model() {
    let t = fixture("pcie4.xml");
    let g0 = t.nodes[t.gpus[0]].id.clone();
    let place = |gpu: &str| RankPlace {
        host: 0,
        gpu: Some(gpu.to_string()),
        numa: None,
    };
    let mut c = Cluster::uniform(&t, "host", 1, 1).unwrap();
    c.ranks = vec![
        place(&g0),
        place(&g0),
        place("0000:ff:00.0"),
        place("0000:ff:00.0"),
    ];
    let p = topo::plan(&c, &env(&[("BRAID_P2P_LEVEL", "LOC")])).unwrap();
    assert_eq!(p.gpu_link(0, 1), Some(GpuLink::Nvlink), "same GPU");
    assert_eq!(p.gpu_link(2, 3), Some(GpuLink::Nvlink), "same unknown GPU");
    assert_eq!(p.gpu_link(0, 2), Some(GpuLink::PcieStaged), "unknown paths");
    assert_eq!(p.notes.len(), 2, "{:?}", p.notes);
    assert!(p.notes[0].contains("0000:ff:00.0"), "{:?}", p.notes);
    let off = topo::plan(&c, &env(&[("BRAID_P2P_DISABLE", "on")])).unwrap();
    assert_eq!(off.gpu_link(0, 1), Some(GpuLink::PcieStaged));
    // Only a network transport allowed: no device link at all.
    let net = topo::plan(&c, &env(&[("BRAID_TRANSPORT", "socket")])).unwrap();
    assert_eq!(net.transports[0][1], Some(TransportKind::Socket));
    assert_eq!(net.gpu_link(0, 1), None);
}

#[test]
fn policy_reads_every_variable_once_and_names_bad_values() {
    assert_eq!(env(&[]), TransportPolicy::default());
    let p = env(&[("BRAID_P2P_LEVEL", "1"), ("BRAID_P2P_DISABLE", "0")]);
    assert_eq!(p.p2p_level, PathType::Pix);
    assert!(p.disabled.is_empty());
    let p = env(&[
        ("BRAID_SHM_DISABLE", "off"),
        ("BRAID_SOCKET_DISABLE", "true"),
    ]);
    assert_eq!(
        p.disabled.iter().copied().collect::<Vec<_>>(),
        [TransportKind::Socket]
    );
    let p = env(&[("BRAID_TRANSPORT", "P2P")]);
    assert_eq!(p.forced, Some(TransportKind::Pcie));
    let err = |pairs: &[(&str, &str)]| {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TransportPolicy::from_env(&move |k: &str| {
            pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
        .unwrap_err()
        .to_string()
    };
    let e = err(&[("BRAID_P2P_LEVEL", "bogus")]);
    assert!(e.contains("BRAID_P2P_LEVEL=\"bogus\""), "{e}");
    assert!(err(&[("BRAID_P2P_LEVEL", "NET")]).contains("at most SYS"));
    let e = err(&[("BRAID_SHM_DISABLE", "disable")]);
    assert!(
        e.contains("BRAID_SHM_DISABLE=") && e.contains("on/off"),
        "{e}"
    );
    let e = err(&[("BRAID_TRANSPORT", "tcp")]);
    assert!(
        e.contains("BRAID_TRANSPORT=") && e.contains("socket"),
        "{e}"
    );
}

//! Which GPU link connects two ranks: a pure function of the path class
//! between their GPUs and the environment, like NCCL's `p2pCanConnect` +
//! `NCCL_P2P_LEVEL` / `NCCL_P2P_DISABLE`.
//!
//! - Path class at most NVB (same GPU, NVLink, NVLink through a GPU):
//!   [`GpuLink::Nvlink`] (`braid-transport-nvlink`, CUDA IPC);
//! - otherwise at most the P2P level (default PXB: never through the CPU):
//!   [`GpuLink::PcieP2p`] (`braid-transport-pcie`, CUDA IPC over PCIe);
//! - otherwise (PHB, SYS: ACS, different sockets), or when P2P is disabled:
//!   [`GpuLink::PcieStaged`] (`braid-transport-pcie`, staged through
//!   shared host memory, like NCCL's SHM transport for GPUs).
//!
//! `BRAID_P2P_LEVEL` takes NCCL's values (`LOC`, `NVL`, `PIX`, `PXB`, `PHB`,
//! `SYS`, or the legacy numbers 0–4) and applies to every path class, NVLink
//! included (`LOC` turns P2P off; `NVL` allows NVLink only);
//! `BRAID_P2P_DISABLE=1` turns P2P off.

use braid_core::topo::{PathType, Topology};

use crate::error::{CudaError, Result};

/// How two GPUs of one host exchange data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuLink {
    /// CUDA IPC, same GPU or NVLink.
    Nvlink,
    /// CUDA IPC over PCIe peer-to-peer.
    PcieP2p,
    /// Through pinned shared host memory.
    PcieStaged,
}

impl GpuLink {
    /// Name of the transport that serves the link.
    pub fn transport(self) -> &'static str {
        match self {
            GpuLink::Nvlink => "nvlink",
            GpuLink::PcieP2p | GpuLink::PcieStaged => "pcie",
        }
    }

    /// Short description for logs.
    pub fn describe(self) -> &'static str {
        match self {
            GpuLink::Nvlink => "nvlink (CUDA IPC)",
            GpuLink::PcieP2p => "pcie (CUDA IPC, P2P)",
            GpuLink::PcieStaged => "pcie (staged through host memory)",
        }
    }
}

/// The P2P policy from the environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pPolicy {
    /// `BRAID_P2P_DISABLE`.
    pub disabled: bool,
    /// `BRAID_P2P_LEVEL`: the worst path class P2P may take.
    pub level: PathType,
}

impl Default for P2pPolicy {
    fn default() -> Self {
        P2pPolicy {
            disabled: false,
            level: PathType::Pxb,
        }
    }
}

impl P2pPolicy {
    /// Read `BRAID_P2P_DISABLE` and `BRAID_P2P_LEVEL` through `env`.
    pub fn from_env(env: impl Fn(&str) -> Option<String>) -> Result<P2pPolicy> {
        let mut p = P2pPolicy::default();
        if let Some(v) = env("BRAID_P2P_DISABLE") {
            p.disabled = !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "" | "0" | "false" | "no" | "off"
            );
        }
        if let Some(v) = env("BRAID_P2P_LEVEL").filter(|v| !v.trim().is_empty()) {
            let level: PathType = v.parse().map_err(|e| {
                CudaError::InvalidArgument(format!(
                    "BRAID_P2P_LEVEL={v}: {e}; use LOC, NVL, PIX, PXB, PHB or SYS (or 0-4)"
                ))
            })?;
            if level > PathType::Sys {
                return Err(CudaError::InvalidArgument(format!(
                    "BRAID_P2P_LEVEL={v}: P2P never crosses the network; use at most SYS"
                )));
            }
            p.level = level;
        }
        Ok(p)
    }
}

/// The link for two GPUs whose best path has class `path` (LOC for one GPU
/// shared by two ranks).
pub fn select(path: PathType, policy: &P2pPolicy) -> GpuLink {
    if policy.disabled || path >= PathType::Net {
        GpuLink::PcieStaged
    } else if path == PathType::Loc {
        // Ranks sharing one GPU share its memory through IPC whatever the
        // level (NCCL's LOC level means "no P2P between different GPUs").
        GpuLink::Nvlink
    } else if path > policy.level {
        GpuLink::PcieStaged
    } else if path <= PathType::Nvb {
        GpuLink::Nvlink
    } else {
        GpuLink::PcieP2p
    }
}

/// The best path class between the GPUs with bus ids `a` and `b` in `topo`
/// (LOC when they are the same GPU; None when either is not in the model).
pub fn path_between(topo: &Topology, a: &str, b: &str) -> Option<PathType> {
    if a.eq_ignore_ascii_case(b) {
        return Some(PathType::Loc);
    }
    let x = topo.gpu_by_busid(a)?;
    let y = topo.gpu_by_busid(b)?;
    topo.path(x, y).map(|p| p.kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> Topology {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../core/tests/fixtures/topo")
            .join(name);
        Topology::new(braid_core::topo::load_file(&p).expect("fixture"))
    }

    fn gpus(t: &Topology) -> Vec<String> {
        t.gpus.iter().map(|&g| t.nodes[g].id.clone()).collect()
    }

    fn links(t: &Topology, policy: &P2pPolicy) -> Vec<Vec<GpuLink>> {
        let g = gpus(t);
        g.iter()
            .map(|a| {
                g.iter()
                    .map(|b| select(path_between(t, a, b).expect("path"), policy))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn nvswitch_server_is_all_nvlink() {
        let t = fixture("nvswitch8.xml");
        let l = links(&t, &P2pPolicy::default());
        assert_eq!(l.len(), 8);
        assert!(l.iter().flatten().all(|&k| k == GpuLink::Nvlink));
        // P2P off: everything goes through host memory.
        let off = P2pPolicy {
            disabled: true,
            ..P2pPolicy::default()
        };
        assert!(links(&t, &off)
            .iter()
            .flatten()
            .all(|&k| k == GpuLink::PcieStaged));
    }

    #[test]
    fn pcie_server_uses_p2p_under_a_switch_and_stages_across_sockets() {
        let t = fixture("pcie4.xml");
        let g = gpus(&t);
        assert_eq!(g.len(), 4);
        let pol = P2pPolicy::default();
        let mut p2p = 0;
        let mut staged = 0;
        for (i, a) in g.iter().enumerate() {
            for (j, b) in g.iter().enumerate() {
                let path = path_between(&t, a, b).unwrap();
                let k = select(path, &pol);
                if i == j {
                    assert_eq!(k, GpuLink::Nvlink, "same GPU shares memory through IPC");
                    continue;
                }
                match path {
                    PathType::Pix | PathType::Pxb => {
                        assert_eq!(k, GpuLink::PcieP2p);
                        p2p += 1;
                    }
                    PathType::Phb | PathType::Sys => {
                        assert_eq!(k, GpuLink::PcieStaged);
                        staged += 1;
                    }
                    other => panic!("unexpected path {other} on a PCIe-only server"),
                }
            }
        }
        assert!(p2p > 0, "some pairs share a PCIe switch");
        assert!(staged > 0, "some pairs cross the sockets");
        // BRAID_P2P_LEVEL=SYS allows P2P everywhere.
        let sys = P2pPolicy {
            level: PathType::Sys,
            ..pol
        };
        for a in &g {
            for b in &g {
                if a != b {
                    assert_eq!(
                        select(path_between(&t, a, b).unwrap(), &sys),
                        GpuLink::PcieP2p
                    );
                }
            }
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn nvlink_bridge_server_mixes_nvlink_and_pcie() {
        let t = fixture("nvbridge4.xml");
        let l = links(&t, &P2pPolicy::default());
        let g = gpus(&t);
        let mut nv = 0;
        let mut other = 0;
        for i in 0..g.len() {
            for j in 0..g.len() {
                if i == j {
                    continue;
                }
                let bridged = t.nvlink_count(t.gpus[i], t.gpus[j]) > 0;
                if bridged {
                    assert_eq!(l[i][j], GpuLink::Nvlink, "{} - {}", g[i], g[j]);
                    nv += 1;
                } else {
                    assert_ne!(l[i][j], GpuLink::Nvlink, "{} - {}", g[i], g[j]);
                    other += 1;
                }
            }
        }
        assert!(nv > 0 && other > 0, "nvlink pairs {nv}, others {other}");
        // NVL level: NVLink pairs stay, PCIe pairs are staged.
        let nvl = P2pPolicy {
            level: PathType::Nvl,
            ..P2pPolicy::default()
        };
        let l = links(&t, &nvl);
        for i in 0..g.len() {
            for j in 0..g.len() {
                if i != j && t.nvlink_count(t.gpus[i], t.gpus[j]) == 0 {
                    assert_eq!(l[i][j], GpuLink::PcieStaged);
                }
            }
        }
    }

    #[test]
    fn policy_from_env() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(P2pPolicy::from_env(env(&[])).unwrap(), P2pPolicy::default());
        let p = P2pPolicy::from_env(env(&[
            ("BRAID_P2P_LEVEL", "sys"),
            ("BRAID_P2P_DISABLE", "0"),
        ]))
        .unwrap();
        assert_eq!(p.level, PathType::Sys);
        assert!(!p.disabled);
        assert_eq!(
            P2pPolicy::from_env(env(&[("BRAID_P2P_LEVEL", "1")]))
                .unwrap()
                .level,
            PathType::Pix
        );
        assert_eq!(
            P2pPolicy::from_env(env(&[("BRAID_P2P_LEVEL", "NVL")]))
                .unwrap()
                .level,
            PathType::Nvl
        );
        assert!(
            P2pPolicy::from_env(env(&[("BRAID_P2P_DISABLE", "1")]))
                .unwrap()
                .disabled
        );
        let e = P2pPolicy::from_env(env(&[("BRAID_P2P_LEVEL", "bogus")])).unwrap_err();
        assert!(e.to_string().contains("BRAID_P2P_LEVEL=bogus"), "{e}");
        assert!(P2pPolicy::from_env(env(&[("BRAID_P2P_LEVEL", "NET")])).is_err());
    }

    #[test]
    fn levels_cut_where_nccl_cuts() {
        let at = |level| P2pPolicy {
            disabled: false,
            level,
        };
        assert_eq!(select(PathType::Pxb, &at(PathType::Pxb)), GpuLink::PcieP2p);
        assert_eq!(
            select(PathType::Phb, &at(PathType::Pxb)),
            GpuLink::PcieStaged
        );
        assert_eq!(select(PathType::Phb, &at(PathType::Phb)), GpuLink::PcieP2p);
        assert_eq!(
            select(PathType::Pix, &at(PathType::Nvl)),
            GpuLink::PcieStaged
        );
        assert_eq!(select(PathType::Nvl, &at(PathType::Nvl)), GpuLink::Nvlink);
        // LOC level: no P2P between different GPUs, but one GPU's ranks still
        // share its memory.
        assert_eq!(
            select(PathType::Nvl, &at(PathType::Loc)),
            GpuLink::PcieStaged
        );
        assert_eq!(select(PathType::Loc, &at(PathType::Loc)), GpuLink::Nvlink);
        assert_eq!(
            select(PathType::Net, &at(PathType::Sys)),
            GpuLink::PcieStaged
        );
        let off = P2pPolicy {
            disabled: true,
            level: PathType::Sys,
        };
        assert_eq!(select(PathType::Loc, &off), GpuLink::PcieStaged);
    }
}

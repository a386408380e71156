//! The transport policy: what `BRAID_TRANSPORT`, `BRAID_<NAME>_DISABLE`,
//! `BRAID_P2P_LEVEL` and `BRAID_CROSS_NIC` allow the planner.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::config;
use crate::topo::graph::PathType;
use crate::topo::TopoError;
use crate::transport::TransportKind;

/// What the environment allows: parsed once, here, for host and device
/// communicators alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportPolicy {
    /// `BRAID_TRANSPORT`: use only this one.
    pub forced: Option<TransportKind>,
    /// `BRAID_<NAME>_DISABLE` (and `BRAID_P2P_DISABLE`, which removes
    /// nvlink and pcie peer-to-peer).
    pub disabled: BTreeSet<TransportKind>,
    /// `BRAID_P2P_LEVEL`: the worst path between two GPUs that peer-to-peer
    /// (NVLink or PCIe) may take (default PXB: never through a CPU).
    pub p2p_level: PathType,
    /// `BRAID_CROSS_NIC`: whether a ring may leave a host through another
    /// port (rail) than it entered by.
    pub cross_nic: CrossNic,
}

impl Default for TransportPolicy {
    fn default() -> Self {
        TransportPolicy {
            forced: None,
            disabled: BTreeSet::new(),
            p2p_level: PathType::Pxb,
            cross_nic: CrossNic::Auto,
        }
    }
}

/// `BRAID_CROSS_NIC`, as `NCCL_CROSS_NIC`: whether the hops of a ring
/// between hosts may change rail (port index).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CrossNic {
    /// `0`: every hop between hosts stays on one rail: a ring leaves each
    /// host through the port of the rail it entered by, even when its last
    /// rank is far from that port (rail-optimised fabrics, where different
    /// rails may not even be connected).
    Never,
    /// `1`: a ring leaves each host through the port nearest its last rank,
    /// whatever the rail.
    Allow,
    /// `2` (default): like `0`, except where the port of the rail is slower
    /// to reach from the last rank than that rank's own port: then that hop
    /// changes rail (and the plan's notes say where and why).
    #[default]
    Auto,
}

impl CrossNic {
    /// The number `NCCL_CROSS_NIC` uses for it.
    pub fn value(self) -> u8 {
        match self {
            CrossNic::Never => 0,
            CrossNic::Allow => 1,
            CrossNic::Auto => 2,
        }
    }
}

impl TransportPolicy {
    /// Read `BRAID_TRANSPORT`, `BRAID_<NAME>_DISABLE`, `BRAID_P2P_DISABLE`,
    /// `BRAID_P2P_LEVEL` and `BRAID_CROSS_NIC` through `env` (e.g. [`config::process_env`]).
    /// A value braid cannot use is an error naming the variable.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, TopoError> {
        let bad = |e: config::ConfigError| TopoError::Invalid(e.to_string());
        let mut p = TransportPolicy::default();
        if let Some(v) = config::value(env, "BRAID_TRANSPORT") {
            p.forced =
                Some(v.parse().map_err(|e: String| {
                    bad(config::ConfigError::new("BRAID_TRANSPORT", &v, e))
                })?);
        }
        for t in TransportKind::ALL {
            if config::flag(env, &t.disable_var(), false).map_err(bad)? {
                p.disabled.insert(t);
            }
        }
        if config::flag(env, "BRAID_P2P_DISABLE", false).map_err(bad)? {
            p.disabled.insert(TransportKind::Nvlink);
            p.disabled.insert(TransportKind::Pcie);
        }
        if let Some(v) = config::value(env, "BRAID_P2P_LEVEL") {
            let expected = "use LOC, NVL, NVB, PIX, PXB, PHB or SYS (or NCCL's numbers 0-4)";
            let level: PathType = v.parse().map_err(|e: String| {
                bad(config::ConfigError::new(
                    "BRAID_P2P_LEVEL",
                    &v,
                    format!("{e}; {expected}"),
                ))
            })?;
            if level > PathType::Sys {
                return Err(bad(config::ConfigError::new(
                    "BRAID_P2P_LEVEL",
                    &v,
                    "peer-to-peer never crosses the network; use at most SYS",
                )));
            }
            p.p2p_level = level;
        }
        if let Some(v) = config::value(env, "BRAID_CROSS_NIC") {
            p.cross_nic = match v.trim() {
                "0" => CrossNic::Never,
                "1" => CrossNic::Allow,
                "2" => CrossNic::Auto,
                _ => {
                    return Err(bad(config::ConfigError::new(
                        "BRAID_CROSS_NIC",
                        &v,
                        "use 0 (hops between hosts stay on one rail), 1 (any port) or 2 (one rail unless that is slower), as NCCL_CROSS_NIC",
                    )))
                }
            };
        }
        Ok(p)
    }
}

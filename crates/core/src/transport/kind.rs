//! The transports braid has, as one enum: what the planner chooses between,
//! what the runtime's transport table holds, and how every log line and
//! environment variable names them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// braid's transports, best first (the order the planner prefers them in
/// for a pair that several can connect).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// GPUs joined by NVLink (or sharing one GPU), CUDA IPC.
    Nvlink,
    /// GPUs of one host over PCIe: peer-to-peer, or staged through host memory.
    Pcie,
    /// Processes of one host, POSIX shared memory.
    Shm,
    /// InfiniBand / RoCE RDMA.
    Ib,
    /// TCP sockets.
    Socket,
}

impl TransportKind {
    /// Every transport, best first.
    pub const ALL: [TransportKind; 5] = [
        TransportKind::Nvlink,
        TransportKind::Pcie,
        TransportKind::Shm,
        TransportKind::Ib,
        TransportKind::Socket,
    ];

    /// The name braid uses for it in logs, errors and variables
    /// (`BRAID_TRANSPORT=shm`, `BRAID_SHM_DISABLE`).
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Nvlink => "nvlink",
            TransportKind::Pcie => "pcie",
            TransportKind::Shm => "shm",
            TransportKind::Ib => "ib",
            TransportKind::Socket => "socket",
        }
    }

    /// The variable that removes it: `BRAID_<NAME>_DISABLE`.
    pub fn disable_var(self) -> String {
        format!("BRAID_{}_DISABLE", self.name().to_ascii_uppercase())
    }

    /// Whether its links carry device (GPU) memory.
    pub fn is_device(self) -> bool {
        matches!(self, TransportKind::Nvlink | TransportKind::Pcie)
    }

    /// Whether it connects ranks on different hosts.
    pub fn is_network(self) -> bool {
        matches!(self, TransportKind::Ib | TransportKind::Socket)
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TransportKind {
    type Err = String;
    /// A name (any case); NCCL's `p2p` means pcie and `net` means ib.
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.trim().to_ascii_lowercase();
        TransportKind::ALL
            .into_iter()
            .find(|t| {
                t.name() == l
                    || (l == "p2p" && *t == TransportKind::Pcie)
                    || (l == "net" && *t == TransportKind::Ib)
            })
            .ok_or_else(|| format!("unknown transport '{s}' (nvlink, pcie, shm, ib, socket)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_aliases() {
        for t in TransportKind::ALL {
            assert_eq!(t.name().parse::<TransportKind>(), Ok(t));
            assert_eq!(t.to_string().to_uppercase().parse::<TransportKind>(), Ok(t));
        }
        assert_eq!("p2p".parse(), Ok(TransportKind::Pcie));
        assert_eq!("NET".parse(), Ok(TransportKind::Ib));
        assert!("tcp"
            .parse::<TransportKind>()
            .unwrap_err()
            .contains("socket"));
        assert_eq!(TransportKind::Shm.disable_var(), "BRAID_SHM_DISABLE");
        let mut sorted = TransportKind::ALL;
        sorted.sort();
        assert_eq!(
            sorted,
            TransportKind::ALL,
            "declaration order is preference order"
        );
    }
}

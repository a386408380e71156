//! The transport table and per-pair selection.
//!
//! Like NCCL's `transport.cc`: an ordered table of transports, best first;
//! for each peer the first one that can connect wins. The decision is a pure
//! function of the two ranks' descriptions and the environment, and every
//! decision is logged at INFO. `BRAID_TRANSPORT=<name>` forces one transport
//! for every peer (an error if it cannot connect, never a silent fallback);
//! `BRAID_<NAME>_DISABLE=1` removes one from the table.

use std::net::SocketAddr;

use braid_core::transport::{PeerDesc, Transport};
use braid_transport_shm::ShmTransport;
use braid_transport_socket::{SocketConfig, SocketTransport};
use tracing::{info, warn};

use crate::error::{Error, Result};

/// The transports this build knows, best first.
#[cfg(not(feature = "ib"))]
pub const KNOWN: &[&str] = &["shm", "socket"];
/// The transports this build knows, best first.
#[cfg(feature = "ib")]
pub const KNOWN: &[&str] = &["shm", "ib", "socket"];

/// The ordered table of available transports.
pub struct TransportTable {
    entries: Vec<Box<dyn Transport>>,
    forced: Option<String>,
}

impl std::fmt::Debug for TransportTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<_> = self.entries.iter().map(|t| t.name()).collect();
        f.debug_struct("TransportTable")
            .field("entries", &names)
            .field("forced", &self.forced)
            .finish()
    }
}

fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| !matches!(v.trim(), "" | "0" | "false" | "no"))
        .unwrap_or(false)
}

impl TransportTable {
    /// Build the table from the environment. `root` is the bootstrap root's
    /// address: the socket transport listens on the interface that routes to
    /// it unless `BRAID_SOCKET_IFNAME` says otherwise.
    pub fn from_env(root: SocketAddr) -> Result<TransportTable> {
        let forced = std::env::var("BRAID_TRANSPORT")
            .ok()
            .map(|s| s.trim().to_ascii_lowercase())
            .filter(|s| !s.is_empty());
        if let Some(f) = &forced {
            if !KNOWN.contains(&f.as_str()) {
                return Err(Error::Env(format!(
                    "BRAID_TRANSPORT={f} is not a transport of this build; use one of: {}{}",
                    KNOWN.join(", "),
                    if f == "ib" {
                        " (IB needs a build with `--features ib`)"
                    } else {
                        ""
                    }
                )));
            }
        }
        let mut entries: Vec<Box<dyn Transport>> = Vec::new();
        if !env_flag("BRAID_SHM_DISABLE") {
            entries.push(Box::new(ShmTransport::new()));
        }
        #[cfg(feature = "ib")]
        if !env_flag("BRAID_IB_DISABLE") {
            match braid_transport_ib::IbTransport::from_env() {
                Ok(t) => {
                    let c = t.chosen();
                    info!(
                        device = %c.device,
                        port = c.port,
                        gid_index = c.gid_index,
                        fabric = %c.fabric,
                        "braid: IB transport"
                    );
                    entries.push(Box::new(t));
                }
                Err(e) if forced.as_deref() == Some("ib") => return Err(Error::Core(e)),
                Err(e) => info!("braid: {e}"),
            }
        }
        if !env_flag("BRAID_SOCKET_DISABLE") {
            match SocketConfig::from_env().and_then(|c| SocketTransport::new(c.with_root(root))) {
                Ok(t) => {
                    info!(
                        addr = %t.local_addr(),
                        interface = t.interface(),
                        "braid: socket transport"
                    );
                    entries.push(Box::new(t));
                }
                // Forced: the caller asked for it, so its absence is an error.
                Err(e) if forced.as_deref() == Some("socket") => return Err(Error::Core(e)),
                Err(e) => warn!("braid: socket transport unavailable: {e}"),
            }
        }
        Ok(TransportTable { entries, forced })
    }

    /// The fabrics this rank's transports are attached to, for
    /// [`PeerDesc::fabrics`].
    pub fn fabrics(&self) -> Vec<(String, String)> {
        self.entries
            .iter()
            .filter_map(|t| t.fabric().map(|f| (t.name().to_owned(), f)))
            .collect()
    }

    /// A table with the given transports (tests).
    pub fn with(entries: Vec<Box<dyn Transport>>, forced: Option<String>) -> TransportTable {
        TransportTable { entries, forced }
    }

    /// Entry `i`.
    pub fn get(&self, i: usize) -> &dyn Transport {
        self.entries[i].as_ref()
    }

    /// The transport for the link between `me` and `peer`: an index into
    /// the table.
    pub fn select(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<usize> {
        let found = self.entries.iter().position(|t| {
            self.forced.as_deref().is_none_or(|f| f == t.name()) && t.can_connect(me, peer)
        });
        match found {
            Some(i) => {
                info!(
                    rank = me.rank,
                    peer = peer.rank,
                    transport = self.entries[i].name(),
                    "braid: transport selected"
                );
                Ok(i)
            }
            None => {
                let tried: Vec<_> = self.entries.iter().map(|t| t.name()).collect();
                Err(Error::Bootstrap(format!(
                    "no transport connects rank {} (host {}) to rank {} (host {}): tried [{}]{}",
                    me.rank,
                    me.host_id,
                    peer.rank,
                    peer.host_id,
                    tried.join(", "),
                    match &self.forced {
                        Some(f) => format!(", BRAID_TRANSPORT={f} forced; unset it to let braid choose"),
                        None => String::from(
                            "; ranks on different hosts need a network transport, which this build lacks",
                        ),
                    }
                )))
            }
        }
    }

    /// Selection for every peer (`None` for oneself).
    pub fn select_all(&self, me: &PeerDesc, peers: &[PeerDesc]) -> Result<Vec<Option<usize>>> {
        peers
            .iter()
            .map(|p| {
                if p.rank == me.rank {
                    Ok(None)
                } else {
                    self.select(me, p).map(Some)
                }
            })
            .collect()
    }
}

/// Identity of the memory domain this process runs in: ranks with the same
/// value can share memory. `BRAID_HOST_ID` overrides; otherwise the host name,
/// the device and inode of the `/dev/shm` mount and the pid namespace, so that
/// containers or network namespaces on one kernel that do not share
/// `/dev/shm` (or process ids) count as different hosts, and ones that do
/// count as one.
pub fn host_id() -> String {
    if let Ok(v) = std::env::var("BRAID_HOST_ID") {
        if !v.trim().is_empty() {
            return v.trim().to_string();
        }
    }
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into());
    let shm = nix::sys::stat::stat("/dev/shm")
        .map(|st| format!("{:x}:{:x}", st.st_dev, st.st_ino))
        .unwrap_or_else(|_| "no-shm".into());
    // Liveness checks use process ids: ranks in different pid namespaces
    // must not count as one host even if they share /dev/shm.
    let pidns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "no-pidns".into());
    format!("{hostname}/{shm}/{pidns}")
}

/// The ring order: ranks grouped by host (hosts in the order of their lowest
/// rank, ranks of a host in rank order), so a ring crosses between hosts once
/// per host instead of at every rank when a launcher interleaves ranks over
/// hosts (Slurm's cyclic distribution, say). A pure function of the ranks'
/// descriptions, so every rank computes the same ring.
pub fn ring_by_host(peers: &[PeerDesc]) -> Vec<u32> {
    let mut hosts: Vec<&str> = Vec::new();
    for p in peers {
        if !hosts.contains(&p.host_id.as_str()) {
            hosts.push(&p.host_id);
        }
    }
    hosts
        .iter()
        .flat_map(|h| {
            peers
                .iter()
                .filter(move |p| p.host_id == *h)
                .map(|p| p.rank)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(rank: u32, host: &str) -> PeerDesc {
        PeerDesc {
            rank,
            host_id: host.into(),
            pid: 1000 + rank,
            fabrics: Vec::new(),
        }
    }

    #[test]
    fn ring_keeps_each_hosts_ranks_adjacent() {
        let peers: Vec<_> = [(0, "a"), (1, "b"), (2, "a"), (3, "b"), (4, "c")]
            .into_iter()
            .map(|(r, h)| desc(r, h))
            .collect();
        assert_eq!(ring_by_host(&peers), vec![0, 2, 1, 3, 4]);
        let one: Vec<_> = (0..4).map(|r| desc(r, "x")).collect();
        assert_eq!(ring_by_host(&one), vec![0, 1, 2, 3]);
    }
}

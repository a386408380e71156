//! The transport table and the host identity.
//!
//! Like NCCL's `transport.cc`: an ordered table of the transports this build
//! has and this host can run, best first. Which one links two ranks is the
//! topology planner's decision ([`crate::topology`]), a pure function of the
//! fused topology of all ranks and the environment, logged at INFO.
//! `BRAID_TRANSPORT=<name>` forces one transport for every peer (an error if
//! it cannot connect, never a silent fallback); `BRAID_<NAME>_DISABLE=1`
//! removes one.

use std::net::SocketAddr;

use braid_core::topo::TransportPolicy;
use braid_core::transport::{Transport, TransportKind};
use braid_transport_shm::{ShmConfig, ShmTransport};
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

impl TransportTable {
    /// Build the table from the environment. `root` is the bootstrap root's
    /// address: the socket transport listens on the interface that routes to
    /// it unless `BRAID_SOCKET_IFNAME` says otherwise.
    pub fn from_env(root: SocketAddr, policy: &TransportPolicy) -> Result<TransportTable> {
        let forced = policy.forced.map(|f| f.name().to_owned());
        let off = |t: TransportKind| policy.disabled.contains(&t);
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
        if !off(TransportKind::Shm) {
            let cfg = ShmConfig::from_env(&braid_core::config::process_env)
                .map_err(|e| Error::Env(format!("shared-memory transport: {e}")))?;
            entries.push(Box::new(ShmTransport::new(cfg)?));
        }
        #[cfg(feature = "ib")]
        if !off(TransportKind::Ib) {
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
        if !off(TransportKind::Socket) {
            let cfg = SocketConfig::from_env(&braid_core::config::process_env).map_err(|e| {
                braid_core::CoreError::InvalidArgument(format!("socket transport: {e}"))
            });
            match cfg.and_then(|c| SocketTransport::new(c.with_root(root))) {
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
        #[cfg(not(feature = "ib"))]
        if !off(TransportKind::Ib) {
            warn_rdma_unused(std::path::Path::new("/sys/class/infiniband"));
        }
        Ok(TransportTable { entries, forced })
    }

    /// The fabrics this rank's transports are attached to, for
    /// [`PeerDesc::fabrics`](braid_core::transport::PeerDesc::fabrics).
    pub fn fabrics(&self) -> Vec<(String, String)> {
        self.entries
            .iter()
            .filter_map(|t| t.fabric().map(|f| (t.name().to_owned(), f)))
            .collect()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entry `i`.
    pub fn get(&self, i: usize) -> &dyn Transport {
        self.entries[i].as_ref()
    }

    /// The names of the transports in the table, best first.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.entries.iter().map(|t| t.name())
    }

    /// The index of the transport called `name`, if the table holds it.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.entries.iter().position(|t| t.name() == name)
    }
}

/// The RDMA devices under `dir` (`/sys/class/infiniband`), sorted.
#[cfg_attr(feature = "ib", allow(dead_code))]
fn rdma_devices(dir: &std::path::Path) -> Vec<String> {
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

/// A build without the `ib` feature on a host with RDMA devices: say so,
/// once per process, instead of falling back to TCP in silence.
#[cfg(not(feature = "ib"))]
fn warn_rdma_unused(dir: &std::path::Path) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let devs = rdma_devices(dir);
    if devs.is_empty() {
        return;
    }
    ONCE.call_once(|| warn!("{}", rdma_unused_message(&devs)));
}

/// What [`warn_rdma_unused`] says.
#[cfg_attr(feature = "ib", allow(dead_code))]
fn rdma_unused_message(devs: &[String]) -> String {
    format!(
        "braid: this host has RDMA devices ({}) but this braid was built without the `ib` feature, so ranks on other hosts are reached over TCP; build with `--features braid/ib` (needs libibverbs) to use them, or set BRAID_IB_DISABLE=1 to silence this",
        devs.join(", ")
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_devices_are_listed_and_named_in_the_warning() {
        let d = std::env::temp_dir().join(format!("braid-ib-class-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        assert!(
            rdma_devices(&d).is_empty(),
            "a missing class directory means none"
        );
        std::fs::create_dir_all(d.join("rxe0")).unwrap();
        std::fs::create_dir_all(d.join("mlx5_0")).unwrap();
        let devs = rdma_devices(&d);
        assert_eq!(devs, ["mlx5_0", "rxe0"]);
        let m = rdma_unused_message(&devs);
        assert!(
            m.contains("mlx5_0, rxe0") && m.contains("--features braid/ib"),
            "{m}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}

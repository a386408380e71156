//! [`NvlinkTransport`]: the seam's [`Transport`] over the device-slot links
//! of [`crate::link`], for the peers the topology planner joined to this
//! rank by NVLink (or that share its GPU).

use std::sync::Arc;

use braid_core::topo::GpuLink;
use braid_core::transport::{PeerDesc, PendingRecv, PendingSend, Transport, TransportKind};
use braid_core::types::MemKind;
use braid_cuda::Device;

use crate::link::IpcLinks;
use crate::{Geometry, NAME};

/// The NVLink transport of one communicator: `links[rank]` is the link
/// selected for each peer (from the topology and the P2P policy).
#[derive(Debug)]
pub struct NvlinkTransport {
    links: IpcLinks,
    peers: Vec<GpuLink>,
}

impl NvlinkTransport {
    /// A transport on `dev` (None when CUDA is unavailable) that connects the
    /// peers whose selected link is [`GpuLink::Nvlink`].
    pub fn new(dev: Option<Arc<Device>>, geo: Geometry, links: Vec<GpuLink>) -> NvlinkTransport {
        NvlinkTransport {
            links: IpcLinks::new(NAME, dev, geo),
            peers: links,
        }
    }

    /// Why this transport cannot run here, if it cannot: `Err` with "CUDA
    /// unavailable: ..." on a machine without CUDA.
    pub fn availability() -> braid_cuda::Result<()> {
        crate::probe::availability()
    }
}

impl Transport for NvlinkTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Nvlink
    }
    fn mem_kind(&self) -> MemKind {
        self.links.mem_kind()
    }
    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool {
        self.links.has_device()
            && me.host_id == peer.host_id
            && self.peers.get(peer.rank as usize) == Some(&GpuLink::Nvlink)
    }
    fn listen(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        self.links.listen(me, peer)
    }
    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingSend>, Vec<u8>)> {
        self.links.prepare_send(me, peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(rank: u32) -> PeerDesc {
        PeerDesc {
            rank,
            host_id: "h".into(),
            pid: 1,
            fabrics: Vec::new(),
        }
    }

    #[test]
    fn connects_only_nvlink_peers_and_only_with_a_device() {
        let links = vec![GpuLink::Nvlink, GpuLink::Nvlink, GpuLink::PcieP2p];
        let t = NvlinkTransport::new(None, Geometry::DEFAULT, links);
        assert_eq!(t.name(), "nvlink");
        // No device: nothing, whatever the selection.
        assert!(!t.can_connect(&desc(0), &desc(1)));
        let e = t.listen(&desc(0), &desc(1)).err().unwrap().to_string();
        assert!(e.contains("nvlink unavailable"), "{e}");
        if NvlinkTransport::availability().is_err() {
            assert!(e.contains("CUDA unavailable"), "{e}");
            assert!(NvlinkTransport::availability()
                .unwrap_err()
                .to_string()
                .starts_with("CUDA unavailable"));
        }
    }
}

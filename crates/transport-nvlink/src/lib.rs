//! braid-transport-nvlink: GPUs joined by NVLink (directly or through
//! NVSwitch), and ranks that share one GPU.
//!
//! Internals: the receiving end keeps a ring of slots in its GPU's memory and
//! exports it with a CUDA IPC memory handle; the handle travels through the
//! bootstrap in the connect-info; the sending end maps the ring and its
//! device engine copies or reduces straight into the receiver's slots over
//! NVLink. Credits travel in a small shared-memory FIFO. The mechanism is
//! [`braid_cuda::link`], shared with `braid-transport-pcie` (NCCL has one P2P
//! transport; the path class decides which of the two serves a pair, see
//! the planner, `braid_core::topo::plan`).
//!
//! Without CUDA (no driver, no NVRTC, no device) the transport connects
//! nothing, and set-up errors say "CUDA unavailable" with the reason.

use std::sync::Arc;

use braid_core::topo::GpuLink;
use braid_core::transport::{PeerDesc, PendingRecv, PendingSend, Transport};
use braid_core::types::MemKind;
use braid_cuda::link::{Geometry, IpcTransport};
use braid_cuda::Device;

/// The transport's name.
pub const NAME: &str = "nvlink";

/// The NVLink transport of one communicator: `links[rank]` is the link
/// selected for each peer (from the topology and the P2P policy).
#[derive(Debug)]
pub struct NvlinkTransport {
    inner: IpcTransport,
}

impl NvlinkTransport {
    /// A transport on `dev` (None when CUDA is unavailable) that connects the
    /// peers whose selected link is [`GpuLink::Nvlink`].
    pub fn new(dev: Option<Arc<Device>>, geo: Geometry, links: Vec<GpuLink>) -> NvlinkTransport {
        NvlinkTransport {
            inner: IpcTransport::new(
                NAME,
                dev,
                geo,
                Box::new(move |_me: &PeerDesc, peer: &PeerDesc| {
                    links.get(peer.rank as usize) == Some(&GpuLink::Nvlink)
                }),
            ),
        }
    }

    /// Why this transport cannot run here, if it cannot: `Err` with "CUDA
    /// unavailable: ..." on a machine without CUDA.
    pub fn availability() -> braid_cuda::Result<()> {
        braid_cuda::probe().map(|_| ())
    }
}

impl Transport for NvlinkTransport {
    fn kind(&self) -> braid_core::transport::TransportKind {
        braid_core::transport::TransportKind::Nvlink
    }
    fn mem_kind(&self) -> MemKind {
        self.inner.mem_kind()
    }
    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool {
        self.inner.can_connect(me, peer)
    }
    fn listen(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        self.inner.listen(me, peer)
    }
    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingSend>, Vec<u8>)> {
        self.inner.prepare_send(me, peer)
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

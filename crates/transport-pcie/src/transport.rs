//! [`PcieTransport`]: the seam's [`Transport`] for GPUs of one host over
//! PCIe, in P2P mode (the device-slot links of `braid-transport-nvlink`) or
//! staged mode (the host-memory rings of `link.rs`) per peer.

use std::sync::Arc;
use std::time::Instant;

use braid_core::topo::GpuLink;
use braid_core::transport::{
    PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, Transport, TransportKind,
};
use braid_core::types::MemKind;
use braid_core::wire::{ROLE_RECEIVER, ROLE_SENDER};
use braid_core::CoreError;
use braid_cuda::Device;
use braid_transport_nvlink::{Geometry, IpcLinks};

use crate::info::{tagged, untag, MODE_P2P, MODE_STAGED};
use crate::link::StagedLinks;
use crate::NAME;

/// Which peers get which mode.
#[derive(Debug)]
enum Peers {
    /// `links[rank]`, the planner's choice, on a device.
    Selected(Vec<GpuLink>),
    /// Every peer of this host staged through host memory, no device.
    HostStaged,
}

/// The PCIe transport of one communicator.
#[derive(Debug)]
pub struct PcieTransport {
    p2p: IpcLinks,
    staged: StagedLinks,
    peers: Peers,
}

impl PcieTransport {
    /// A transport on `dev` (None when CUDA is unavailable) for the peers
    /// whose selected link (`links[rank]`) is PCIe P2P or staged; `geo` is
    /// the geometry of both kinds of link.
    pub fn new(
        dev: Option<Arc<Device>>,
        geo: Geometry,
        links: Vec<GpuLink>,
    ) -> braid_core::error::Result<PcieTransport> {
        let geo = geo.validate()?;
        Ok(PcieTransport {
            p2p: IpcLinks::new(NAME, dev, geo),
            staged: StagedLinks::new(geo)?,
            peers: Peers::Selected(links),
        })
    }

    /// A transport that stages every peer of this host through shared host
    /// memory, with rings of `geo`, and needs no CUDA device: the staged
    /// rings are host memory, and only the device engine that fills and
    /// drains them touches a GPU. Its links are those [`PcieTransport::new`]
    /// makes for staged peers (same blobs, same rings), with channels in
    /// [`MemKind::Host`]; the conformance suite runs it on machines
    /// without a GPU.
    pub fn host_staged(geo: Geometry) -> braid_core::error::Result<PcieTransport> {
        let geo = geo.validate()?;
        Ok(PcieTransport {
            p2p: IpcLinks::new(NAME, None, geo),
            staged: StagedLinks::new(geo)?,
            peers: Peers::HostStaged,
        })
    }

    /// The link mode for `peer`, after checking that the device it needs is
    /// there.
    fn mode(&self, peer: &PeerDesc) -> braid_core::error::Result<u8> {
        match &self.peers {
            Peers::HostStaged => Ok(MODE_STAGED),
            Peers::Selected(links) => {
                self.p2p.device()?;
                match links.get(peer.rank as usize) {
                    Some(GpuLink::PcieP2p) => Ok(MODE_P2P),
                    Some(GpuLink::PcieStaged) => Ok(MODE_STAGED),
                    other => Err(CoreError::InvalidArgument(format!(
                        "rank {} is reached over {:?}, not PCIe",
                        peer.rank, other
                    ))),
                }
            }
        }
    }
}

struct Tagged<P> {
    mode: u8,
    peer: u32,
    inner: P,
}

impl PendingRecv for Tagged<Box<dyn PendingRecv>> {
    fn connect(
        self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> braid_core::error::Result<Box<dyn RecvChannel>> {
        let rest = untag(ROLE_SENDER, self.mode, self.peer, sender_info)?;
        self.inner.connect(rest, deadline)
    }
}

impl PendingSend for Tagged<Box<dyn PendingSend>> {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        deadline: Instant,
    ) -> braid_core::error::Result<Box<dyn SendChannel>> {
        let rest = untag(ROLE_RECEIVER, self.mode, self.peer, receiver_info)?;
        self.inner.connect(rest, deadline)
    }
}

impl Transport for PcieTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Pcie
    }
    fn mem_kind(&self) -> MemKind {
        match self.peers {
            Peers::Selected(_) => self.p2p.mem_kind(),
            Peers::HostStaged => MemKind::Host,
        }
    }
    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool {
        me.host_id == peer.host_id
            && match &self.peers {
                Peers::HostStaged => true,
                Peers::Selected(links) => {
                    self.p2p.has_device()
                        && matches!(
                            links.get(peer.rank as usize),
                            Some(GpuLink::PcieP2p) | Some(GpuLink::PcieStaged)
                        )
                }
            }
    }
    fn listen(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        let mode = self.mode(peer)?;
        let (inner, blob) = if mode == MODE_P2P {
            self.p2p.listen(me, peer)?
        } else {
            self.staged.listen(me, peer)?
        };
        Ok((
            Box::new(Tagged {
                mode,
                peer: peer.rank,
                inner,
            }),
            tagged(ROLE_RECEIVER, mode, blob),
        ))
    }
    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingSend>, Vec<u8>)> {
        let mode = self.mode(peer)?;
        let (inner, blob) = if mode == MODE_P2P {
            self.p2p.prepare_send(me, peer)?
        } else {
            self.staged.prepare_send(me, peer)?
        };
        Ok((
            Box::new(Tagged {
                mode,
                peer: peer.rank,
                inner,
            }),
            tagged(ROLE_SENDER, mode, blob),
        ))
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
    fn without_cuda_nothing_connects() {
        let links = vec![GpuLink::Nvlink, GpuLink::PcieP2p, GpuLink::PcieStaged];
        let t = PcieTransport::new(None, Geometry::DEFAULT, links).unwrap();
        assert_eq!(t.name(), "pcie");
        for r in 0..3 {
            assert!(!t.can_connect(&desc(0), &desc(r)));
        }
        let e = t.listen(&desc(0), &desc(2)).err().unwrap().to_string();
        assert!(e.contains("pcie unavailable"), "{e}");
        if braid_cuda::probe().is_err() {
            assert!(e.contains("CUDA unavailable"), "{e}");
        }
        assert!(t.prepare_send(&desc(0), &desc(1)).is_err());
    }

    #[test]
    fn invalid_geometry_is_refused() {
        let g = Geometry {
            slot_bytes: 100,
            slots: 8,
        };
        assert!(PcieTransport::new(None, g, vec![]).is_err());
        assert!(PcieTransport::host_staged(g).is_err());
    }

    #[test]
    fn host_staged_connects_every_peer_of_its_host_in_host_memory() {
        let t = PcieTransport::host_staged(Geometry::DEFAULT).unwrap();
        assert_eq!(t.mem_kind(), MemKind::Host);
        assert!(t.can_connect(&desc(0), &desc(7)));
        let mut other = desc(1);
        other.host_id = "elsewhere".into();
        assert!(!t.can_connect(&desc(0), &other));
    }
}

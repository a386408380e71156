//! braid-transport-pcie: GPUs of one host connected over PCIe.
//!
//! Internals: where the PCIe path between the two GPUs allows peer-to-peer
//! (path class up to `BRAID_P2P_LEVEL`, PXB by default: no CPU host bridge on
//! the way), the link is the CUDA IPC device-slot FIFO of
//! [`braid_cuda::link`], the same mechanism as `braid-transport-nvlink`: the
//! sender's engine copies or reduces straight into the receiver's slots in
//! GPU memory. Where it does not (PHB/SYS: ACS, different sockets,
//! `BRAID_P2P_DISABLE=1`), the link is a shared-memory slot FIFO in host
//! memory (`braid-transport-shm`), like NCCL's SHM transport for GPUs: the
//! device engine copies device → host slot on one side and host slot →
//! device on the other. The per-pair choice is the planner, `braid_core::topo::plan`'s; the
//! connect-info starts with a mode byte so that two ranks that chose
//! differently fail at set-up with a message instead of mis-reading slots.
//!
//! Without CUDA the transport connects nothing, and set-up errors say "CUDA
//! unavailable" with the reason.

use std::sync::Arc;
use std::time::Instant;

use braid_core::topo::GpuLink;
use braid_core::transport::{
    PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, Transport,
};
use braid_core::types::MemKind;
use braid_core::CoreError;
use braid_cuda::link::{Geometry, IpcTransport};
use braid_cuda::Device;
use braid_transport_shm::ShmTransport;

/// The transport's name.
pub const NAME: &str = "pcie";

/// Mode byte: CUDA IPC peer-to-peer.
const MODE_P2P: u8 = 1;
/// Mode byte: staged through shared host memory.
const MODE_STAGED: u8 = 2;

/// The PCIe transport of one communicator.
#[derive(Debug)]
pub struct PcieTransport {
    p2p: IpcTransport,
    staged: ShmTransport,
    dev: Option<Arc<Device>>,
    links: Vec<GpuLink>,
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
        let l = links.clone();
        Ok(PcieTransport {
            p2p: IpcTransport::new(
                NAME,
                dev.clone(),
                geo,
                Box::new(move |_me: &PeerDesc, peer: &PeerDesc| {
                    l.get(peer.rank as usize) == Some(&GpuLink::PcieP2p)
                }),
            ),
            staged: ShmTransport::with_params(geo.slot_bytes, geo.slots)?,
            dev,
            links,
        })
    }

    fn link(&self, peer: &PeerDesc) -> Option<GpuLink> {
        self.links.get(peer.rank as usize).copied()
    }

    fn need_device(&self) -> braid_core::error::Result<()> {
        if self.dev.is_some() {
            return Ok(());
        }
        Err(CoreError::Unavailable {
            transport: NAME,
            reason: match braid_cuda::probe() {
                Err(e) => e.to_string(),
                Ok(_) => "no CUDA device was opened for this communicator".into(),
            },
        })
    }

    fn mode(&self, peer: &PeerDesc) -> braid_core::error::Result<u8> {
        match self.link(peer) {
            Some(GpuLink::PcieP2p) => Ok(MODE_P2P),
            Some(GpuLink::PcieStaged) => Ok(MODE_STAGED),
            other => Err(CoreError::InvalidArgument(format!(
                "rank {} is reached over {:?}, not PCIe",
                peer.rank, other
            ))),
        }
    }
}

fn tagged(mode: u8, blob: Vec<u8>) -> Vec<u8> {
    let mut v = Vec::with_capacity(blob.len() + 1);
    v.push(mode);
    v.extend_from_slice(&blob);
    v
}

/// Split a connect-info blob into its mode byte and the inner blob, checking
/// that the peer chose the same mode.
fn untag(mine: u8, peer: u32, b: &[u8]) -> braid_core::error::Result<&[u8]> {
    let name = |m| match m {
        MODE_P2P => "CUDA IPC peer-to-peer",
        MODE_STAGED => "staging through host memory",
        _ => "an unknown mode",
    };
    match b.split_first() {
        Some((&m, rest)) if m == mine => Ok(rest),
        Some((&m, _)) => Err(CoreError::Protocol {
            peer,
            detail: format!(
                "rank {peer} chose {} for this PCIe link and this rank {}: set BRAID_P2P_LEVEL / BRAID_P2P_DISABLE / BRAID_TOPO_FILE the same on every rank",
                name(m),
                name(mine)
            ),
        }),
        None => Err(CoreError::Protocol {
            peer,
            detail: "empty PCIe connect-info".into(),
        }),
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
        let rest = untag(self.mode, self.peer, sender_info)?;
        self.inner.connect(rest, deadline)
    }
}

impl PendingSend for Tagged<Box<dyn PendingSend>> {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        deadline: Instant,
    ) -> braid_core::error::Result<Box<dyn SendChannel>> {
        let rest = untag(self.mode, self.peer, receiver_info)?;
        self.inner.connect(rest, deadline)
    }
}

impl Transport for PcieTransport {
    fn kind(&self) -> braid_core::transport::TransportKind {
        braid_core::transport::TransportKind::Pcie
    }
    fn mem_kind(&self) -> MemKind {
        self.p2p.mem_kind()
    }
    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool {
        self.dev.is_some()
            && me.host_id == peer.host_id
            && matches!(
                self.link(peer),
                Some(GpuLink::PcieP2p) | Some(GpuLink::PcieStaged)
            )
    }
    fn listen(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        self.need_device()?;
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
            tagged(mode, blob),
        ))
    }
    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingSend>, Vec<u8>)> {
        self.need_device()?;
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
            tagged(mode, blob),
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
    fn mode_tags_round_trip_and_disagreement_is_explained() {
        let b = tagged(MODE_STAGED, vec![1, 2, 3]);
        assert_eq!(untag(MODE_STAGED, 3, &b).unwrap(), &[1, 2, 3]);
        let e = untag(MODE_P2P, 3, &b).unwrap_err().to_string();
        assert!(
            e.contains("rank 3 chose staging through host memory"),
            "{e}"
        );
        assert!(e.contains("BRAID_P2P_LEVEL"), "{e}");
        assert!(untag(MODE_P2P, 3, &[]).is_err());
    }

    #[test]
    fn without_cuda_nothing_connects() {
        let links = vec![GpuLink::Nvlink, GpuLink::PcieP2p, GpuLink::PcieStaged];
        let t = PcieTransport::new(None, Geometry::DEFAULT, links).unwrap();
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
    }
}

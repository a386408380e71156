//! The staged links: rings of slots in shared host memory
//! (`braid-transport-shm`), for pairs of GPUs whose PCIe path does not
//! allow peer-to-peer. The device engine copies device → host slot on one
//! side and host slot → device on the other, like NCCL's SHM transport for
//! GPUs; the rings themselves are host memory and need no device.
//!
//! The channels are the shared-memory transport's, reporting this
//! transport's name; every call is forwarded unchanged. The P2P links are
//! `braid-transport-nvlink`'s ([`braid_transport_nvlink::IpcLinks`]).
//!
//! The only `unsafe` of this crate is here: the forwarding of the seam's
//! `unsafe fn`s (direct transfers), under the same contracts.

use std::time::Instant;

use braid_core::error::Result;
use braid_core::transport::{
    DeviceRing, DirectRecv, DirectSend, Incoming, PeerDesc, PendingRecv, PendingSend, RecvChannel,
    SendChannel, SlotBuf, Transport,
};
use braid_core::types::MemKind;
use braid_transport_nvlink::Geometry;
use braid_transport_shm::ShmTransport;

use crate::NAME;

/// The staged links of one transport: shared-memory rings of the transport's
/// geometry.
#[derive(Debug)]
pub(crate) struct StagedLinks {
    shm: ShmTransport,
}

impl StagedLinks {
    /// Rings of `geo` (already validated).
    pub(crate) fn new(geo: Geometry) -> Result<StagedLinks> {
        Ok(StagedLinks {
            shm: ShmTransport::with_params(geo.slot_bytes, geo.slots)?,
        })
    }

    /// Phase 1 of the receiving end.
    pub(crate) fn listen(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        let (inner, blob) = self.shm.listen(me, peer)?;
        Ok((Box::new(PendingStagedRecv(inner)), blob))
    }

    /// Phase 1 of the sending end.
    pub(crate) fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)> {
        let (inner, blob) = self.shm.prepare_send(me, peer)?;
        Ok((Box::new(PendingStagedSend(inner)), blob))
    }
}

struct PendingStagedRecv(Box<dyn PendingRecv>);

impl PendingRecv for PendingStagedRecv {
    fn connect(
        self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn RecvChannel>> {
        Ok(Box::new(StagedRecv(self.0.connect(sender_info, deadline)?)))
    }
}

struct PendingStagedSend(Box<dyn PendingSend>);

impl PendingSend for PendingStagedSend {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn SendChannel>> {
        Ok(Box::new(StagedSend(
            self.0.connect(receiver_info, deadline)?,
        )))
    }
}

/// Sending end of a staged link.
struct StagedSend(Box<dyn SendChannel>);

impl SendChannel for StagedSend {
    fn peer(&self) -> u32 {
        self.0.peer()
    }
    fn transport(&self) -> &'static str {
        NAME
    }
    fn mem_kind(&self) -> MemKind {
        self.0.mem_kind()
    }
    fn slot_bytes(&self) -> usize {
        self.0.slot_bytes()
    }
    fn slots(&self) -> usize {
        self.0.slots()
    }
    fn poll_acquire(&mut self) -> Result<Option<SlotBuf>> {
        self.0.poll_acquire()
    }
    fn poll_acquire_small(&mut self, len: usize) -> Result<Option<SlotBuf>> {
        self.0.poll_acquire_small(len)
    }
    fn commit(&mut self, len: usize) -> Result<()> {
        self.0.commit(len)
    }
    fn poll_drained(&mut self) -> Result<bool> {
        self.0.poll_drained()
    }
    fn check_peer(&mut self) -> Result<()> {
        self.0.check_peer()
    }
    fn abort(&mut self, reason: &str) {
        self.0.abort(reason)
    }
    fn device_ring(&self) -> Option<DeviceRing> {
        self.0.device_ring()
    }
    fn direct(&mut self) -> Option<&mut dyn DirectSend> {
        self.0.direct()
    }
}

/// Receiving end of a staged link.
struct StagedRecv(Box<dyn RecvChannel>);

impl RecvChannel for StagedRecv {
    fn peer(&self) -> u32 {
        self.0.peer()
    }
    fn transport(&self) -> &'static str {
        NAME
    }
    fn mem_kind(&self) -> MemKind {
        self.0.mem_kind()
    }
    fn slot_bytes(&self) -> usize {
        self.0.slot_bytes()
    }
    fn poll_peek(&mut self) -> Result<Option<(SlotBuf, usize)>> {
        self.0.poll_peek()
    }
    fn release(&mut self) -> Result<()> {
        self.0.release()
    }
    fn check_peer(&mut self) -> Result<()> {
        self.0.check_peer()
    }
    fn abort(&mut self, reason: &str) {
        self.0.abort(reason)
    }
    fn device_ring(&self) -> Option<DeviceRing> {
        self.0.device_ring()
    }
    fn poll_peek_any(&mut self) -> Result<Option<Incoming>> {
        self.0.poll_peek_any()
    }
    fn direct(&mut self) -> Option<&mut dyn DirectRecv> {
        self.0.direct()
    }
}

//! The device-slot ring over CUDA IPC, with its credit counters: the link
//! of `braid-transport-nvlink`, and of `braid-transport-pcie` in P2P mode.
//!
//! The receiving end allocates a ring of `slots` device slots on its GPU
//! (plus [`COUNTER_BYTES`] for the two stream-engine counters after them)
//! and exports it with `cuIpcGetMemHandle`; the sending end maps it with
//! `cuIpcOpenMemHandle` and its engine copies (or reduces) straight into the
//! receiver's slots, over NVLink, PCIe, or inside one GPU. Credits travel in
//! a shared-memory FIFO (`braid-transport-shm`) of the same number of small
//! host slots, one control message (the payload length) per data slot, so
//! the k-th control slot always pairs with device slot `k mod slots`, and
//! the shared-memory link brings its liveness checks, abort reasons and
//! clean-up along. The connect-info is a [`LinkInfo`] (receiver) and a
//! [`SenderInfo`] (sender), both carrying the control link's own blob.
//!
//! A sender in the receiver's own process (the conformance suite runs both
//! ranks in one process) on the same GPU uses the ring's address directly:
//! CUDA IPC cannot open a handle in the process that exported it. Ranks in
//! different processes always map the handle.
//!
//! Slot pointers ([`SlotBuf::ptr`]) of these channels are device addresses
//! (a `CUdeviceptr` cast to a pointer), declared as [`MemKind::Device`]: only
//! the device engine may use them.
//!
//! The only `unsafe` of this crate is here: the 8-byte control message
//! written into and read from the control link's host slot.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use braid_core::transport::{
    DeviceRing, PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, SlotBuf, Transport,
};
use braid_core::types::MemKind;
use braid_core::CoreError;
use braid_cuda::{Device, DeviceBuffer, IpcMapping};
use braid_transport_shm::ShmTransport;

use crate::info::{LinkInfo, SenderInfo};
use crate::Geometry;

/// Bytes after the slots of a ring holding its two counters (`posted` at
/// offset 0, `freed` at offset 128: separate cache lines), for the stream
/// engine (see [`braid_core::transport::DeviceRing`]).
pub const COUNTER_BYTES: usize = 256;
/// Offset of `freed` in the counter area.
const FREED_AT: u64 = 128;

/// Bytes of one control message (the payload length, little-endian u64).
const CTRL_MSG: usize = 8;
/// Control slots are the smallest the shared-memory transport allows.
const CTRL_SLOT_BYTES: usize = 4096;

fn control() -> braid_core::error::Result<ShmTransport> {
    ShmTransport::with_params(CTRL_SLOT_BYTES, 2)
}

fn peer_err(name: &'static str, peer: u32, what: String) -> CoreError {
    CoreError::Peer {
        transport: name,
        peer,
        what,
        source: None,
    }
}

fn malformed(peer: u32, e: String) -> CoreError {
    CoreError::Protocol {
        peer,
        detail: format!("malformed CUDA IPC connect-info: {e}"),
    }
}

/// A random number naming this process in [`LinkInfo::process`] (0 when
/// the system has no randomness to give: then no sender takes a ring for
/// its own).
fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let mut b = [0u8; 8];
        match getrandom::getrandom(&mut b) {
            Ok(()) => u64::from_le_bytes(b).max(1),
            Err(_) => 0,
        }
    })
}

/// The device-slot links of one transport on one GPU: what a transport's
/// `listen` and `prepare_send` call for the pairs it serves. `name` is the
/// transport the channels report (`nvlink`, `pcie`).
pub struct IpcLinks {
    name: &'static str,
    dev: Option<Arc<Device>>,
    geo: Geometry,
}

impl std::fmt::Debug for IpcLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcLinks")
            .field("name", &self.name)
            .field("device", &self.dev.as_ref().map(|d| d.ordinal()))
            .field("geo", &self.geo)
            .finish()
    }
}

impl IpcLinks {
    /// Links named `name` on `dev` (None: CUDA unavailable; they set up
    /// nothing and say why) with rings of geometry `geo` (checked when a
    /// ring is made).
    pub fn new(name: &'static str, dev: Option<Arc<Device>>, geo: Geometry) -> IpcLinks {
        IpcLinks { name, dev, geo }
    }

    /// Whether a device was given.
    pub fn has_device(&self) -> bool {
        self.dev.is_some()
    }

    /// The device, or [`CoreError::Unavailable`] naming the transport and
    /// saying why there is none.
    pub fn device(&self) -> braid_core::error::Result<&Arc<Device>> {
        self.dev
            .as_ref()
            .ok_or_else(|| crate::probe::unavailable(self.name))
    }

    /// Where the slots live: the device (device 0 without one).
    pub fn mem_kind(&self) -> MemKind {
        MemKind::Device(self.dev.as_ref().map_or(0, |d| d.ordinal()))
    }

    /// Phase 1 of the receiving end: allocate and export the ring.
    pub fn listen(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        listen(self.name, self.device()?, self.geo, me, peer)
    }

    /// Phase 1 of the sending end.
    pub fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> braid_core::error::Result<(Box<dyn PendingSend>, Vec<u8>)> {
        prepare_send(self.name, self.device()?, me, peer)
    }
}

fn listen(
    name: &'static str,
    dev: &Arc<Device>,
    geo: Geometry,
    me: &PeerDesc,
    peer: &PeerDesc,
) -> braid_core::error::Result<(Box<dyn PendingRecv>, Vec<u8>)> {
    let geo = geo.validate()?;
    let ring_bytes = geo.slot_bytes * geo.slots;
    let ring = DeviceBuffer::alloc(dev, ring_bytes + COUNTER_BYTES)
        .map_err(|e| peer_err(name, peer.rank, format!("allocating the slot ring: {e}")))?;
    ring.write_at(ring_bytes, &[0u8; COUNTER_BYTES])
        .map_err(|e| {
            peer_err(
                name,
                peer.rank,
                format!("clearing the ring's counters: {e}"),
            )
        })?;
    let mem = ring
        .ipc_handle()
        .map_err(|e| peer_err(name, peer.rank, format!("exporting the slot ring: {e}")))?;
    let ctrl = ShmTransport::with_params(CTRL_SLOT_BYTES, geo.slots)?;
    let (pending, cblob) = ctrl.listen(me, peer)?;
    let info = LinkInfo {
        bus_id: dev.bus_id().to_string(),
        device: dev.ordinal(),
        process: process_token(),
        ring: ring.ptr(),
        mem,
        offset: 0,
        slot_bytes: geo.slot_bytes as u64,
        slots: geo.slots as u32,
        control: cblob,
    };
    Ok((
        Box::new(PendingIpcRecv {
            name,
            dev: dev.clone(),
            geo,
            ring,
            ctrl: pending,
            peer: peer.rank,
        }),
        info.encode(),
    ))
}

fn prepare_send(
    name: &'static str,
    dev: &Arc<Device>,
    me: &PeerDesc,
    peer: &PeerDesc,
) -> braid_core::error::Result<(Box<dyn PendingSend>, Vec<u8>)> {
    let (pending, cblob) = control()?.prepare_send(me, peer)?;
    let info = SenderInfo {
        bus_id: dev.bus_id().to_string(),
        device: dev.ordinal(),
        control: cblob,
    };
    Ok((
        Box::new(PendingIpcSend {
            name,
            dev: dev.clone(),
            ctrl: pending,
            peer: peer.rank,
        }),
        info.encode(),
    ))
}

struct PendingIpcRecv {
    name: &'static str,
    dev: Arc<Device>,
    geo: Geometry,
    ring: DeviceBuffer,
    ctrl: Box<dyn PendingRecv>,
    peer: u32,
}

impl PendingRecv for PendingIpcRecv {
    fn connect(
        self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> braid_core::error::Result<Box<dyn RecvChannel>> {
        let info = SenderInfo::decode(sender_info).map_err(|e| malformed(self.peer, e))?;
        let ctrl = self.ctrl.connect(&info.control, deadline)?;
        tracing::debug!(
            transport = self.name,
            peer = self.peer,
            peer_gpu = %info.bus_id,
            gpu = %self.dev.bus_id(),
            "braid: device link (receiving end) connected"
        );
        Ok(Box::new(IpcRecv {
            name: self.name,
            device: self.dev.ordinal(),
            geo: self.geo,
            ring: self.ring,
            ctrl,
            k: 0,
            peer: self.peer,
        }))
    }
}

struct PendingIpcSend {
    name: &'static str,
    dev: Arc<Device>,
    ctrl: Box<dyn PendingSend>,
    peer: u32,
}

impl PendingSend for PendingIpcSend {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        deadline: Instant,
    ) -> braid_core::error::Result<Box<dyn SendChannel>> {
        let info = LinkInfo::decode(receiver_info).map_err(|e| malformed(self.peer, e))?;
        let ring = if info.process != 0
            && info.process == process_token()
            && info.bus_id == self.dev.bus_id()
        {
            PeerRing::Local(info.ring + info.offset)
        } else {
            let map = IpcMapping::open(&self.dev, &info.mem).map_err(|e| {
                peer_err(
                    self.name,
                    self.peer,
                    format!(
                        "mapping the slots of GPU {} (rank {}) on GPU {}: {e}",
                        info.bus_id,
                        self.peer,
                        self.dev.bus_id()
                    ),
                )
            })?;
            PeerRing::Mapped(map, info.offset)
        };
        let ctrl = self.ctrl.connect(&info.control, deadline)?;
        if ctrl.slots() != info.slots as usize {
            return Err(CoreError::Protocol {
                peer: self.peer,
                detail: format!(
                    "control link has {} slots for {} device slots",
                    ctrl.slots(),
                    info.slots
                ),
            });
        }
        Ok(Box::new(IpcSend {
            name: self.name,
            device: self.dev.ordinal(),
            ring,
            geo: Geometry {
                slot_bytes: info.slot_bytes as usize,
                slots: info.slots as usize,
            },
            ctrl,
            k: 0,
            peer: self.peer,
        }))
    }
}

/// The ring at `base` with its counters after the slots.
fn ring_view(base: u64, geo: Geometry) -> DeviceRing {
    let counters = base + (geo.slot_bytes * geo.slots) as u64;
    DeviceRing {
        base,
        slot_bytes: geo.slot_bytes,
        slots: geo.slots,
        posted: counters,
        freed: counters + FREED_AT,
    }
}

/// The receiver's ring as the sender reaches it.
enum PeerRing {
    /// Mapped into this process through CUDA IPC (unmapped on drop), the
    /// ring at this offset in the mapping.
    Mapped(IpcMapping, u64),
    /// The receiver is this process, on the same GPU: the ring's address.
    Local(u64),
}

impl PeerRing {
    /// Device address of slot 0 in this process.
    fn base(&self) -> u64 {
        match self {
            PeerRing::Mapped(map, offset) => map.ptr() + offset,
            PeerRing::Local(base) => *base,
        }
    }
}

/// Sending end: the receiver's ring, reached from here.
struct IpcSend {
    name: &'static str,
    device: u32,
    ring: PeerRing,
    geo: Geometry,
    ctrl: Box<dyn SendChannel>,
    k: u64,
    peer: u32,
}

impl IpcSend {
    fn slot(&self) -> SlotBuf {
        let off = (self.k % self.geo.slots as u64) * self.geo.slot_bytes as u64;
        SlotBuf {
            ptr: (self.ring.base() + off) as usize as *mut u8,
            cap: self.geo.slot_bytes,
        }
    }
}

impl SendChannel for IpcSend {
    fn peer(&self) -> u32 {
        self.peer
    }
    fn transport(&self) -> &'static str {
        self.name
    }
    fn mem_kind(&self) -> MemKind {
        MemKind::Device(self.device)
    }
    fn slot_bytes(&self) -> usize {
        self.geo.slot_bytes
    }
    fn slots(&self) -> usize {
        self.geo.slots
    }
    fn device_ring(&self) -> Option<DeviceRing> {
        Some(ring_view(self.ring.base(), self.geo))
    }
    fn poll_acquire(&mut self) -> braid_core::error::Result<Option<SlotBuf>> {
        // A control slot free means the receiver released the device slot
        // that pairs with it.
        Ok(self.ctrl.poll_acquire()?.map(|_| self.slot()))
    }
    fn commit(&mut self, len: usize) -> braid_core::error::Result<()> {
        if len > self.geo.slot_bytes {
            return Err(CoreError::InvalidArgument(format!(
                "{} commit of {len} bytes into a {}-byte slot",
                self.name, self.geo.slot_bytes
            )));
        }
        let c = self.ctrl.poll_acquire()?.ok_or_else(|| {
            CoreError::InvalidArgument(format!("{} commit without an acquired slot", self.name))
        })?;
        // SAFETY: `c` is the control link's host slot of at least 4096
        // bytes, owned by this side until `commit`.
        unsafe {
            std::ptr::write_unaligned(c.ptr as *mut [u8; CTRL_MSG], (len as u64).to_le_bytes())
        };
        self.ctrl.commit(CTRL_MSG)?;
        self.k += 1;
        Ok(())
    }
    fn poll_drained(&mut self) -> braid_core::error::Result<bool> {
        self.ctrl.poll_drained()
    }
    fn check_peer(&mut self) -> braid_core::error::Result<()> {
        self.ctrl.check_peer()
    }
    fn abort(&mut self, reason: &str) {
        self.ctrl.abort(reason)
    }
}

/// Receiving end: owns the ring.
struct IpcRecv {
    name: &'static str,
    device: u32,
    geo: Geometry,
    ring: DeviceBuffer,
    ctrl: Box<dyn RecvChannel>,
    k: u64,
    peer: u32,
}

impl RecvChannel for IpcRecv {
    fn peer(&self) -> u32 {
        self.peer
    }
    fn transport(&self) -> &'static str {
        self.name
    }
    fn mem_kind(&self) -> MemKind {
        MemKind::Device(self.device)
    }
    fn slot_bytes(&self) -> usize {
        self.geo.slot_bytes
    }
    fn device_ring(&self) -> Option<DeviceRing> {
        Some(ring_view(self.ring.ptr(), self.geo))
    }
    fn poll_peek(&mut self) -> braid_core::error::Result<Option<(SlotBuf, usize)>> {
        let Some((c, clen)) = self.ctrl.poll_peek()? else {
            return Ok(None);
        };
        if clen != CTRL_MSG {
            return Err(CoreError::Protocol {
                peer: self.peer,
                detail: format!("{} control message of {clen} bytes", self.name),
            });
        }
        // SAFETY: the control slot holds CTRL_MSG committed bytes and stays
        // ours until `release`.
        let len =
            u64::from_le_bytes(unsafe { std::ptr::read_unaligned(c.ptr as *const [u8; CTRL_MSG]) })
                as usize;
        if len > self.geo.slot_bytes {
            return Err(CoreError::Protocol {
                peer: self.peer,
                detail: format!(
                    "{} slot announced with {len} bytes, slots hold {}",
                    self.name, self.geo.slot_bytes
                ),
            });
        }
        let off = (self.k % self.geo.slots as u64) * self.geo.slot_bytes as u64;
        Ok(Some((
            SlotBuf {
                ptr: (self.ring.ptr() + off) as usize as *mut u8,
                cap: self.geo.slot_bytes,
            },
            len,
        )))
    }
    fn release(&mut self) -> braid_core::error::Result<()> {
        self.ctrl.release()?;
        self.k += 1;
        Ok(())
    }
    fn check_peer(&mut self) -> braid_core::error::Result<()> {
        self.ctrl.check_peer()
    }
    fn abort(&mut self, reason: &str) {
        self.ctrl.abort(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(rank: u32) -> PeerDesc {
        PeerDesc {
            rank,
            host_id: "h".into(),
            pid: std::process::id(),
            fabrics: Vec::new(),
        }
    }

    #[test]
    fn without_a_device_nothing_is_set_up_and_set_up_says_why() {
        let l = IpcLinks::new("nvlink", None, Geometry::DEFAULT);
        assert!(!l.has_device());
        assert_eq!(l.mem_kind(), MemKind::Device(0));
        let e = l.listen(&desc(0), &desc(1)).err().expect("no device");
        let s = e.to_string();
        assert!(s.contains("nvlink unavailable"), "{s}");
        if braid_cuda::probe().is_err() {
            assert!(s.contains("CUDA unavailable"), "{s}");
        }
        assert!(l.prepare_send(&desc(0), &desc(1)).is_err());
    }

    #[test]
    fn ring_view_puts_the_counters_after_the_slots_on_separate_lines() {
        let g = Geometry {
            slot_bytes: 8192,
            slots: 4,
        };
        let r = ring_view(1 << 20, g);
        assert_eq!(r.base, 1 << 20);
        assert_eq!(r.posted, (1 << 20) + 4 * 8192);
        assert_eq!(r.freed, r.posted + 128);
        assert!(FREED_AT as usize + 4 <= COUNTER_BYTES);
    }

    #[test]
    fn the_process_token_is_stable_and_rarely_zero() {
        assert_eq!(process_token(), process_token());
        assert_ne!(process_token(), 0, "getrandom failed here");
    }
}

//! braid-transport-pcie: GPUs of one host connected over PCIe.
//!
//! # The contract
//!
//! Each directed connection is one of two kinds of link, chosen per pair
//! by the topology planner (`braid_core::topo::plan`) and passed in as
//! `links[rank]`:
//!
//! - **P2P** ([`GpuLink::PcieP2p`](braid_core::topo::GpuLink::PcieP2p)):
//!   where the PCIe path between the two GPUs allows peer-to-peer (path
//!   class up to `BRAID_P2P_LEVEL`, PXB by default: no CPU host bridge on
//!   the way), the CUDA IPC device-slot ring of `braid-transport-nvlink`
//!   ([`braid_transport_nvlink::IpcLinks`]), the same mechanism as NVLink:
//!   the sender's engine copies or reduces straight into the receiver's
//!   slots in GPU memory. Channels in
//!   [`MemKind::Device`](braid_core::types::MemKind::Device).
//! - **Staged** ([`GpuLink::PcieStaged`](braid_core::topo::GpuLink::PcieStaged)):
//!   where it does not (PHB/SYS: ACS, different sockets,
//!   `BRAID_P2P_DISABLE=1`), a ring of slots in shared host memory
//!   (`link.rs`, over `braid-transport-shm`), like NCCL's SHM transport for
//!   GPUs: the device engine copies device → host slot on one side and host
//!   slot → device on the other. Channels in
//!   [`MemKind::Host`](braid_core::types::MemKind::Host).
//!
//! The connect-info ([`info`]) carries a header and the mode, so that two
//! ranks that chose differently fail at set-up with a message instead of
//! mis-reading slots.
//!
//! Without CUDA the transport connects nothing, and set-up errors say "CUDA
//! unavailable" with the reason ([`probe`]). [`PcieTransport::host_staged`]
//! makes the staged links alone, without a device (what the conformance
//! suite runs on machines without a GPU).
//!
//! # Configuration
//!
//! The links' geometry is the device links' ([`Geometry`]:
//! `BRAID_CUDA_SLOT_BYTES`, `BRAID_CUDA_SLOTS`, read by
//! [`Geometry::from_env`]), for both modes.

#![deny(unsafe_code)]

pub mod info;
#[allow(unsafe_code)]
mod link;
pub mod probe;
mod transport;

pub use braid_transport_nvlink::Geometry;
pub use transport::PcieTransport;

/// The transport's name.
pub const NAME: &str = "pcie";

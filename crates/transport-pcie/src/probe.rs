//! Whether the PCIe transport can run here. Its P2P links are
//! `braid-transport-nvlink`'s, so the answers are that crate's
//! ([`braid_transport_nvlink::probe`], through [`braid_cuda::probe`]); a
//! transport that stages every peer through host memory
//! ([`crate::PcieTransport::host_staged`]) needs no CUDA at all.

pub use braid_transport_nvlink::probe::{gpu_for_tests, ENV_REQUIRE_GPU};

/// `Ok` when CUDA can be used here; otherwise "CUDA unavailable: ..." with
/// the reason.
pub fn availability() -> braid_cuda::Result<()> {
    braid_transport_nvlink::probe::availability()
}

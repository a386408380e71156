//! The transport conformance suite (braid-conformance) on NVLink device
//! links. Every link of this transport is a ring in GPU memory, so every
//! case needs a CUDA device: without one each test prints "skipped: needs a
//! CUDA device: ..." and passes, unless `BRAID_REQUIRE_GPU=1` asks for the
//! hardware, when it fails.
//!
//! Both simulated ranks are this process on one GPU (`BRAID_CUDA_DEVICE`,
//! else device 0): the sender reaches the ring by its address (CUDA IPC
//! cannot open a handle in the process that made it); the suite checks
//! lengths, order, credits, liveness and blob checks (slot contents are
//! device memory, which it does not touch). The IPC mapping between
//! processes is what `tools/gpu-check.sh` exercises.

use braid_core::topo::GpuLink;
use braid_core::transport::Transport;
use braid_transport_nvlink::{probe, Geometry, NvlinkTransport};

/// Small slots: fast, many wrap-arounds.
fn small() -> Geometry {
    Geometry {
        slot_bytes: 64 * 1024,
        slots: 4,
    }
}

/// One `#[test]` per conformance case (the list of
/// `braid_conformance::transport_conformance_tests!`), each skipping
/// without a GPU.
macro_rules! gpu_conformance_tests {
    ($geo:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let needs = concat!(
                    "conformance case ",
                    stringify!($case),
                    " on nvlink device-slot rings"
                );
                let Some(dev) = probe::gpu_for_tests(needs).unwrap_or_else(|e| panic!("{e}"))
                else {
                    return;
                };
                let factory = move || -> Box<dyn Transport> {
                    Box::new(NvlinkTransport::new(
                        Some(dev.clone()),
                        $geo,
                        vec![GpuLink::Nvlink; 2],
                    ))
                };
                braid_conformance::$case(&factory);
            }
        )*
    };
}

mod one_gpu_small {
    use super::*;
    gpu_conformance_tests!(small();
        ordered_delivery,
        credits,
        repeated_polls_return_same_slot,
        concurrent_stress,
        abort_is_seen_by_peer,
        drop_is_seen_by_peer,
        recv_connect_times_out,
        bad_connect_info_rejected,
        both_directions,
        oversized_commit_rejected,
        direct_transfers_when_offered,
        small_acquisitions,
        drained_after_peer_closes,
    );
}

mod one_gpu_defaults {
    use super::*;
    gpu_conformance_tests!(Geometry::DEFAULT;
        ordered_delivery,
        credits,
        both_directions,
        oversized_commit_rejected,
    );
}

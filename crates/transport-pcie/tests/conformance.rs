//! The transport conformance suite (braid-conformance) on the PCIe
//! transport.
//!
//! - Staged links (rings in shared host memory) run everywhere, through
//!   [`PcieTransport::host_staged`]: the same links, blobs and channels
//!   as staged peers of a transport on a device, without the device.
//! - P2P links (CUDA IPC device-slot rings) and staged links of a
//!   transport on a device need a CUDA device: without one those tests
//!   print "skipped: needs a CUDA device: ..." and pass, unless
//!   `BRAID_REQUIRE_GPU=1` asks for the hardware, when they fail. Both
//!   simulated ranks are this process on one GPU (`BRAID_CUDA_DEVICE`,
//!   else device 0).

use std::time::Instant;

use braid_core::topo::GpuLink;
use braid_core::transport::Transport;
use braid_core::types::MemKind;
use braid_transport_pcie::{probe, Geometry, PcieTransport};

/// Small slots: fast, many wrap-arounds.
fn small() -> Geometry {
    Geometry {
        slot_bytes: 64 * 1024,
        slots: 4,
    }
}

/// Staged through host memory, small slots.
mod staged_small {
    use super::*;
    braid_conformance::transport_conformance_tests!(|| PcieTransport::host_staged(small()).unwrap());
}

/// Staged through host memory, the production defaults (512 KiB x 8).
mod staged_defaults {
    use super::*;
    braid_conformance::transport_conformance_tests!(|| PcieTransport::host_staged(
        Geometry::DEFAULT
    )
    .unwrap());
}

/// P2P over one GPU: one `#[test]` per conformance case (the list of
/// `braid_conformance::transport_conformance_tests!`), each skipping
/// without a GPU.
mod p2p_one_gpu {
    use super::*;

    macro_rules! gpu_conformance_tests {
        ($($case:ident),* $(,)?) => {
            $(
                #[test]
                fn $case() {
                    let needs = concat!(
                        "conformance case ",
                        stringify!($case),
                        " on pcie P2P device-slot rings"
                    );
                    let Some(dev) = probe::gpu_for_tests(needs).unwrap_or_else(|e| panic!("{e}"))
                    else {
                        return;
                    };
                    let factory = move || -> Box<dyn Transport> {
                        Box::new(
                            PcieTransport::new(
                                Some(dev.clone()),
                                small(),
                                vec![GpuLink::PcieP2p; 2],
                            )
                            .unwrap(),
                        )
                    };
                    braid_conformance::$case(&factory);
                }
            )*
        };
    }

    gpu_conformance_tests!(
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

/// A transport on a device sets up staged peers with the device check and
/// host-memory channels that carry data. (The suite itself cannot run on
/// it: the transport declares device memory, its staged channels host
/// memory; `staged_*` above run the suite on the same links.)
#[test]
fn staged_links_of_a_transport_on_a_device() {
    let needs = "staged pcie links of a transport on a device";
    let Some(dev) = probe::gpu_for_tests(needs).unwrap_or_else(|e| panic!("{e}")) else {
        return;
    };
    let make = || PcieTransport::new(Some(dev.clone()), small(), vec![GpuLink::PcieStaged; 2]);
    let (t0, t1) = (make().unwrap(), make().unwrap());
    let (s, r) = (braid_conformance::desc(0), braid_conformance::desc(1));
    assert!(t0.can_connect(&s, &r) && t1.can_connect(&r, &s));
    let (prx, rinfo) = t1.listen(&r, &s).unwrap();
    let (ptx, sinfo) = t0.prepare_send(&s, &r).unwrap();
    let deadline = Instant::now() + braid_conformance::WAIT;
    let mut tx = ptx.connect(&rinfo, deadline).unwrap();
    let mut rx = prx.connect(&sinfo, deadline).unwrap();
    assert_eq!((tx.transport(), rx.transport()), ("pcie", "pcie"));
    assert_eq!(
        (tx.mem_kind(), rx.mem_kind()),
        (MemKind::Host, MemKind::Host)
    );
    assert_eq!(tx.slot_bytes(), small().slot_bytes);
    for seq in 0..3 * small().slots as u8 {
        let buf = braid_conformance::wait_for("a slot", braid_conformance::WAIT, || {
            tx.poll_acquire().unwrap()
        });
        let len = 100 + seq as usize;
        // SAFETY: a host slot of slot_bytes (> len) bytes, ours until commit.
        unsafe { std::ptr::write_bytes(buf.ptr, seq, len) };
        tx.commit(len).unwrap();
        let (got, n) = braid_conformance::wait_for("a message", braid_conformance::WAIT, || {
            rx.poll_peek().unwrap()
        });
        assert_eq!(n, len);
        // SAFETY: a committed host slot of `n` bytes, ours until release.
        let data = unsafe { std::slice::from_raw_parts(got.ptr, n) };
        assert!(data.iter().all(|&b| b == seq), "message {seq}");
        rx.release().unwrap();
    }
}

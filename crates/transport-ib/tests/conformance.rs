//! The transport conformance suite (braid-conformance), run against the IB
//! transport on a real RDMA device (Soft-RoCE in `tools/rdma-vm/run`:
//! `scripts/rdma-tests.sh`). Without an RDMA device each case prints
//! "skipped: needs an RDMA device" and passes, unless `BRAID_REQUIRE_IB=1`
//! asks for the hardware (the guests set it), when it fails.

use braid_transport_ib::{available_for_tests, IbConfig, IbTransport};

fn ready() -> bool {
    available_for_tests("the transport conformance suite over IB").unwrap_or_else(|e| panic!("{e}"))
}

fn ib(slot_bytes: usize, slots: usize, qps: usize) -> IbTransport {
    // A short ACK timeout (4.096 us * 2^14 = 67 ms, 7 tries): a vanished
    // peer shows up within about half a second. (Retry count 7 would mean
    // "forever" on Soft-RoCE.)
    let cfg = IbConfig::from_env()
        .expect("BRAID_IB_* environment")
        .with_geometry(slot_bytes, slots)
        .with_qps(qps)
        .with_timeout(14, 6);
    IbTransport::new(cfg).unwrap_or_else(|e| {
        panic!(
            "these tests need an RDMA device; run them inside tools/rdma-vm/run \
             (scripts/rdma-tests.sh): {e}"
        )
    })
}

/// Small slots, two QPs (slots below the stripe minimum travel whole, on
/// alternating QPs).
mod two_qps {
    use super::*;
    braid_conformance::transport_conformance_tests!(if ready, || ib(64 * 1024, 16, 2));
}

/// Slots that stripe over three QPs, odd slot count.
mod striped {
    use super::*;
    braid_conformance::transport_conformance_tests!(if ready, || ib(192 * 1024 + 64, 5, 3));
}

/// One QP, tiny slots, a deep FIFO.
mod one_qp {
    use super::*;
    braid_conformance::transport_conformance_tests!(if ready, || ib(4096 + 64, 32, 1));
}

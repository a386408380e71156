//! The transport conformance suite (braid-conformance), run against shm with a
//! few geometries.

use braid_transport_shm::ShmTransport;

/// Small slots: fast, many wrap-arounds.
mod small {
    use super::*;
    braid_conformance::transport_conformance_tests!(
        || ShmTransport::with_params(64 * 1024, 4).unwrap()
    );
}

/// Odd geometry: slot_bytes not a multiple of the page size, 3 slots.
mod odd {
    use super::*;
    braid_conformance::transport_conformance_tests!(
        || ShmTransport::with_params(4096 + 64, 3).unwrap()
    );
}

/// The production defaults (128 KiB x 16, `ShmConfig::default()`).
mod defaults {
    use super::*;
    braid_conformance::transport_conformance_tests!(ShmTransport::default);
}

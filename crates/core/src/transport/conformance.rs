//! Transport conformance suite (to be written).

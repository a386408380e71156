//! Shared-memory transport (to be written).

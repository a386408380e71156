//! In-memory simulator (to be written).

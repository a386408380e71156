//! Bootstrap (to be written).

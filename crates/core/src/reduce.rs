//! Host reduction loops (to be written).

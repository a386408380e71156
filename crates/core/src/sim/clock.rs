//! Timed simulation (in progress).

//! Integration test helpers.

pub mod netns;
pub mod ranks;
pub mod workload;

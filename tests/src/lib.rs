//! Integration test helpers.

pub mod algobench;
pub mod netns;
pub mod ranks;
pub mod workload;

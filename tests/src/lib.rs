//! Integration test helpers.

pub mod netns;
pub mod ranks;

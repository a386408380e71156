//! braid: collective communication for distributed programs.

pub mod bootstrap;
pub mod env;
pub mod error;

pub use error::{Error, Result};

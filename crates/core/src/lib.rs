//! braid-core: the pieces of braid that do no I/O.
//!
//! - [`types`]: datatypes and reduction operators.
//! - [`reduce`]: host reduction loops (vectorised by the compiler).
//! - [`plan`]: pure collective plans — a rank's program of primitive steps.
//! - [`sim`]: an in-memory simulator that runs every rank's plan together.
//! - [`transport`]: the transport seam (slot FIFOs with credits) and its
//!   conformance suite.

pub mod copy;
pub mod error;
pub mod plan;
pub mod reduce;
pub mod reference;
pub mod sim;
pub mod topo;
pub mod transport;
pub mod types;
pub mod wire;

pub use error::CoreError;
pub use types::{DataType, RedOp};

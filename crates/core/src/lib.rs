//! braid-core: the pieces of braid that do no I/O.
//!
//! - [`types`]: datatypes and reduction operators.
//! - [`reduce`]: host reduction loops (vectorised by the compiler).
//! - [`plan`]: pure collective plans — a rank's program of primitive steps.
//! - [`sim`]: an in-memory simulator that runs every rank's plan together.
//! - [`transport`]: the transport seam (slot FIFOs with credits) and the
//!   [`TransportKind`](transport::TransportKind) enum naming every transport.
//! - [`topo`]: host topology (detection, NCCL XML) and the planner that
//!   chooses a transport per rank pair and the rings.
//! - [`config`]: how `BRAID_*` values are read (booleans, numbers, NCCL's
//!   device lists), the same way in every crate.
//! - [`wire`]: reading and writing the connect-info blobs.
//! - [`tune`]: the tuner's cost model (which algorithm for which call).

pub mod config;
pub mod copy;
pub mod error;
pub mod plan;
pub mod reduce;
pub mod reference;
pub mod sim;
pub mod topo;
pub mod transport;
pub mod tune;
pub mod types;
pub mod wire;

pub use error::CoreError;
pub use types::{DataType, RedOp};

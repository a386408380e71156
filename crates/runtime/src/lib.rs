//! braid: collective communication for distributed programs.
//!
//! ```no_run
//! use braid::{Communicator, RedOp};
//! # fn main() -> braid::Result<()> {
//! // Under braid-run, torchrun, srun or mpirun:
//! let comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce_in_place(&mut grads, RedOp::Sum)?;
//! # Ok(()) }
//! ```
//!
//! Layers (see docs/design.md): plans and the transport seam live in `braid-core`;
//! this crate holds the bootstrap, transport selection, the host engine that
//! runs plans, the communicator and streams.

mod bootstrap;
mod collective;
mod comm;
mod device;
mod engine;
mod error;
// Public items for the `internals` feature's re-exports (the fuzzers use
// them); the rest of these modules stays as it was.
#[allow(unreachable_pub)]
mod fingerprint;
#[allow(unreachable_pub)]
mod launch;
mod oplock;
mod progress;
mod settings;
mod slot_stores;
mod stream;
mod topology;
mod transports;

pub use bootstrap::{RootServer, UniqueId};
pub use braid_core::types::{bf16, f16, DataType, Element, RedOp};
pub use braid_transport_shm::HostBuffer;
pub use collective::Collective;
pub use comm::{Blocks, Communicator, Config, Group, MailBatch, Mailbox};
pub use device::CudaComm;
pub use error::{Error, ErrorKind, Result};
pub use progress::{dump as dump_pending, Running, Snapshot, Waiting};
pub use stream::{Handle, Stream};

/// The CUDA types a [`CudaComm`] works with: the device it was made on
/// ([`CudaComm::device`]), buffers in its memory and the streams that
/// operations are enqueued on. Without CUDA every constructor answers
/// "CUDA unavailable: ...".
pub mod cuda {
    pub use braid_cuda::{CudaError, CudaStream, Device, DeviceBuffer};
}

/// Unstable internals for braid's own tools, tests and fuzzers (the wire
/// decoders, launch-environment parsing). Not part of the library's API:
/// enabled by the `internals` feature, with no stability promise.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod internals {
    pub use crate::bootstrap::fuzzing as bootstrap;
    pub use crate::comm::fuzzing as rendezvous;
    pub use crate::launch::{first_host, parse_hostlist};

    /// The operation headers that detect mismatched calls.
    pub mod fingerprint {
        pub use crate::fingerprint::{check, OpHeader, HEADER_BYTES};
    }
}

/// Install a `tracing` subscriber filtered by `BRAID_DEBUG` (`WARN`, `INFO`,
/// `DEBUG`, `TRACE`, or any `tracing` filter directive such as
/// `braid=debug`), unless the program installed its own. Called by
/// communicator creation; harmless to call again. Logs go to stderr.
pub fn init_logging() {
    use std::sync::Once;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let level = braid_core::config::process_env(settings::process::DEBUG).unwrap_or_default();
        if level.trim().is_empty() {
            return;
        }
        let directive = match level.trim().to_ascii_uppercase().as_str() {
            "VERSION" | "WARN" => "warn".to_string(),
            "INFO" => "info".to_string(),
            "DEBUG" => "debug".to_string(),
            "TRACE" => "trace".to_string(),
            _ => level.clone(),
        };
        let filter = tracing_subscriber::EnvFilter::try_new(&directive)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false)
            .try_init();
    });
}

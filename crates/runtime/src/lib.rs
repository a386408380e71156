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
//! Layers (see DESIGN.md): plans and the transport seam live in `braid-core`;
//! this crate holds the bootstrap, transport selection, the host engine that
//! runs plans, the communicator and streams.

mod bootstrap;
pub mod comm;
pub mod cuda;
mod cuda_stream;
pub mod engine;
pub mod env;
pub mod error;
pub mod fingerprint;
mod oplock;
pub mod progress;
pub mod select;
pub mod slot_stores;
pub mod stream;
pub mod topology;

pub use bootstrap::{RootServer, UniqueId};

/// Unstable internals for braid's fuzz targets (feature `internals`): the
/// wire decoders over plain bytes. Not part of the API.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::bootstrap::fuzzing as bootstrap;
}
pub use braid_core::plan::Collective;
pub use braid_core::types::{bf16, f16, DataType, Element, RedOp};
pub use braid_cuda;
pub use braid_transport_shm::HostBuffer;
pub use comm::{Communicator, Config, Group};
pub use cuda::CudaComm;
pub use error::{Error, Result};
pub use progress::dump as dump_pending;
pub use stream::{Handle, Stream};

/// Install a `tracing` subscriber filtered by `BRAID_DEBUG` (`WARN`, `INFO`,
/// `DEBUG`, `TRACE`, or any `tracing` filter directive such as
/// `braid=debug`), unless the program installed its own. Called by
/// communicator creation; harmless to call again. Logs go to stderr.
pub fn init_logging() {
    use std::sync::Once;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let level = std::env::var("BRAID_DEBUG").unwrap_or_default();
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

//! The error type of the `braid` crate.

use braid_core::CoreError;

/// Everything that can go wrong in braid's public API.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad input from the caller; nothing was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The launch environment is missing or inconsistent.
    #[error("launch environment: {0}")]
    Env(String),

    /// A `BRAID_*` variable has a value braid cannot use (the message names
    /// it and says what it should be).
    #[error("configuration: {0}")]
    Config(#[from] braid_core::config::ConfigError),

    /// Network I/O with the bootstrap root or another rank failed.
    #[error("bootstrap: {what}")]
    BootstrapIo {
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// The rendezvous failed: wrong secret, ranks that disagree, duplicate or
    /// missing ranks, a timeout. The message names the ranks concerned.
    #[error("bootstrap: {0}")]
    Bootstrap(String),

    /// A collective or point-to-point operation failed. The communicator is
    /// unusable afterwards (its peers may be anywhere in the operation).
    #[error("rank {rank}: {op} #{seq} failed: {source}; this communicator is no longer usable: drop it and create a new one (or split the survivors off a healthy one)")]
    Operation {
        rank: u32,
        op: String,
        seq: u64,
        #[source]
        source: CoreError,
    },

    /// A transport or plan error outside of an operation (set-up).
    #[error(transparent)]
    Core(#[from] CoreError),

    /// The CUDA layer failed, or CUDA is unavailable ("CUDA unavailable: ...").
    #[error(transparent)]
    Cuda(#[from] braid_cuda::CudaError),

    /// A topology file or the topology plan is unusable.
    #[error("topology: {0}")]
    Topology(#[from] braid_core::topo::TopoError),

    /// The communicator was aborted or broken by an earlier error.
    #[error("communicator is no longer usable: {0}")]
    Unusable(String),
}

/// Result alias for braid.
pub type Result<T> = std::result::Result<T, Error>;

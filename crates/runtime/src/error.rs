//! The error type of the `braid` crate, and the kinds a program matches on.

use braid_core::CoreError;

/// Everything that can go wrong in braid's public API.
///
/// Match on [`Error::kind`] (and [`Error::peer`]) to decide what to do: the
/// kinds are braid's own and stable. The variants say where an error came
/// from and keep the lower layers' errors as their sources (for the message
/// and [`std::error::Error::source`]); new ones may appear.
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
    #[error("rank {rank}: {op} #{seq} failed: {source}; this communicator is no longer usable: drop it and create a new one, or shrink it to the ranks that are left")]
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

/// What kind of failure an [`Error`] is: what a program (or a binding's
/// exception class) decides on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Bad input from the caller; nothing was sent.
    InvalidArgument,
    /// The launch environment, a `BRAID_*` value or a topology file is
    /// unusable (the message names it).
    Config,
    /// The rendezvous failed (wrong secret, ranks that disagree, a rank that
    /// left, a root that is not braid's).
    Bootstrap,
    /// A wait ran past its deadline: the rendezvous, or a peer during an
    /// operation (see [`Error::peer`]).
    Timeout,
    /// A peer failed, closed its link or aborted (see [`Error::peer`]).
    PeerFailed,
    /// The ranks issued different operations (or counts, datatypes,
    /// operators, roots).
    Mismatch,
    /// The communicator was aborted, or broken by an earlier error.
    Unusable,
    /// The communicator was revoked ([`crate::Communicator::revoke`]), on
    /// this rank or another: shrink it or drop it.
    Revoked,
    /// A transport cannot run on this host (missing device or library).
    Unavailable,
    /// The CUDA layer failed, or CUDA is unavailable.
    Cuda,
    /// Anything else.
    Other,
}

impl Error {
    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::Env(_) | Error::Config(_) | Error::Topology(_) => ErrorKind::Config,
            Error::Bootstrap(m) if m.contains("timed out") || m.contains("timeout") => {
                ErrorKind::Timeout
            }
            Error::BootstrapIo { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                ) =>
            {
                ErrorKind::Timeout
            }
            Error::Bootstrap(_) | Error::BootstrapIo { .. } => ErrorKind::Bootstrap,
            Error::Operation { source, .. } | Error::Core(source) => core_kind(source),
            Error::Cuda(_) => ErrorKind::Cuda,
            Error::Unusable(m) if m.contains(crate::comm::REVOKED) => ErrorKind::Revoked,
            Error::Unusable(_) => ErrorKind::Unusable,
        }
    }

    /// The peer rank the error is about: the one that failed, timed out,
    /// aborted or disagreed.
    pub fn peer(&self) -> Option<u32> {
        match self {
            Error::Operation { source, .. } | Error::Core(source) => source.peer(),
            _ => None,
        }
    }
}

fn core_kind(c: &CoreError) -> ErrorKind {
    use crate::fingerprint::MISMATCH;
    match c {
        CoreError::PeerAborted { reason: m, .. } | CoreError::Aborted(m)
            if m.contains(crate::comm::REVOKED) =>
        {
            ErrorKind::Revoked
        }
        CoreError::InvalidArgument(_) => ErrorKind::InvalidArgument,
        CoreError::Unavailable { .. } => ErrorKind::Unavailable,
        CoreError::Timeout { .. } => ErrorKind::Timeout,
        CoreError::PeerAborted { reason: m, .. } | CoreError::Protocol { detail: m, .. }
            if m.contains(MISMATCH) =>
        {
            ErrorKind::Mismatch
        }
        CoreError::Peer { .. } | CoreError::PeerAborted { .. } | CoreError::Protocol { .. } => {
            ErrorKind::PeerFailed
        }
        CoreError::Aborted(_) => ErrorKind::Unusable,
        _ => ErrorKind::Other,
    }
}

/// Result alias for braid.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn op(source: CoreError) -> Error {
        Error::Operation {
            rank: 0,
            op: "AllReduce".into(),
            seq: 3,
            source,
        }
    }

    /// Each error maps to the kind a program decides on, with the peer it
    /// names; a peer's relayed mismatch report is a mismatch, not a failure.
    #[test]
    fn kinds_and_peers() {
        let timeout = CoreError::Timeout {
            transport: "shm",
            peer: 2,
            waiting_for: "data",
            after: Duration::from_secs(1),
        };
        let aborted = |reason: &str| CoreError::PeerAborted {
            transport: "socket",
            peer: 1,
            reason: reason.into(),
        };
        let mismatch = format!(
            "rank 1 called Broadcast where rank 0 called AllReduce: {}",
            crate::fingerprint::MISMATCH
        );
        let io = |k| Error::BootstrapIo {
            what: "reading".into(),
            source: std::io::Error::from(k),
        };
        let cases = [
            (
                Error::InvalidArgument("x".into()),
                ErrorKind::InvalidArgument,
                None,
            ),
            (Error::Env("x".into()), ErrorKind::Config, None),
            (
                Error::Bootstrap("timed out after 5 s".into()),
                ErrorKind::Timeout,
                None,
            ),
            (
                Error::Bootstrap("wrong secret".into()),
                ErrorKind::Bootstrap,
                None,
            ),
            (io(std::io::ErrorKind::TimedOut), ErrorKind::Timeout, None),
            (
                io(std::io::ErrorKind::ConnectionRefused),
                ErrorKind::Bootstrap,
                None,
            ),
            (op(timeout), ErrorKind::Timeout, Some(2)),
            (op(aborted("it crashed")), ErrorKind::PeerFailed, Some(1)),
            (op(aborted(&mismatch)), ErrorKind::Mismatch, Some(1)),
            (
                Error::Core(CoreError::Protocol {
                    peer: 4,
                    detail: mismatch.clone(),
                }),
                ErrorKind::Mismatch,
                Some(4),
            ),
            (
                Error::Core(CoreError::Unavailable {
                    transport: "ib",
                    reason: "no devices".into(),
                }),
                ErrorKind::Unavailable,
                None,
            ),
            (
                op(CoreError::Aborted("x".into())),
                ErrorKind::Unusable,
                None,
            ),
            (Error::Unusable("x".into()), ErrorKind::Unusable, None),
            (
                Error::Cuda(braid_cuda::CudaError::Unavailable("no driver".into())),
                ErrorKind::Cuda,
                None,
            ),
        ];
        for (e, kind, peer) in cases {
            assert_eq!((e.kind(), e.peer()), (kind, peer), "{e}");
        }
    }
}

//! The error type of braid-core, shared by every transport through the seam.

use std::time::Duration;

/// A boxed underlying cause.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors raised by plans, the simulator and transports.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// The caller passed something invalid; nothing was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The transport cannot run here (missing device, library, permission).
    #[error("transport {transport} unavailable: {reason}")]
    Unavailable {
        transport: &'static str,
        reason: String,
    },

    /// Something failed on the link to a peer.
    #[error("{transport} link with rank {peer}: {what}")]
    Peer {
        transport: &'static str,
        peer: u32,
        what: String,
        #[source]
        source: Option<Cause>,
    },

    /// The peer gave up (it aborted, hit an error, or closed the link).
    #[error("rank {peer} closed or aborted the {transport} link: {reason}")]
    PeerAborted {
        transport: &'static str,
        peer: u32,
        reason: String,
    },

    /// A wait ran past its deadline.
    #[error("timed out after {after:?} waiting for rank {peer} ({transport}, {waiting_for}); raise BRAID_TIMEOUT if the peer is only slow")]
    Timeout {
        transport: &'static str,
        peer: u32,
        waiting_for: &'static str,
        after: Duration,
    },

    /// The local side aborted the operation.
    #[error("operation aborted locally: {0}")]
    Aborted(String),

    /// A peer sent something that does not match what this rank expected.
    #[error("protocol error with rank {peer}: {detail}")]
    Protocol { peer: u32, detail: String },
}

/// Result alias for braid-core.
pub type Result<T> = std::result::Result<T, CoreError>;

impl CoreError {
    /// The peer the error is about, if any.
    pub fn peer(&self) -> Option<u32> {
        match self {
            CoreError::Peer { peer, .. }
            | CoreError::PeerAborted { peer, .. }
            | CoreError::Timeout { peer, .. }
            | CoreError::Protocol { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

//! The error type of braid-cuda.

/// Errors of the CUDA layer. Every variant says what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// CUDA cannot be used on this machine: no driver library, no NVRTC, no
    /// device, or the driver refused to initialise. Never a panic.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),

    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {name} ({text})")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error name (`CUDA_ERROR_...`).
        name: String,
        /// The driver's description.
        text: String,
    },

    /// NVRTC could not compile the reduction kernels.
    #[error("NVRTC failed to compile braid's kernels for {arch}: {what}\n{log}")]
    Nvrtc {
        arch: String,
        what: String,
        log: String,
    },

    /// The caller passed something invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Result alias for braid-cuda.
pub type Result<T> = std::result::Result<T, CudaError>;

impl From<CudaError> for braid_core::CoreError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Unavailable(reason) => braid_core::CoreError::Unavailable {
                transport: "cuda",
                reason,
            },
            CudaError::InvalidArgument(s) => braid_core::CoreError::InvalidArgument(s),
            other => braid_core::CoreError::Unavailable {
                transport: "cuda",
                reason: other.to_string(),
            },
        }
    }
}

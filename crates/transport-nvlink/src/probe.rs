//! Whether the GPU transports can run here: CUDA's availability (through
//! [`braid_cuda::probe`]), the error a transport without a device gives, and
//! the device that hardware tests use (or the reason they skip).
//!
//! `braid-transport-pcie` uses the same answers.

use std::sync::Arc;

use braid_core::config;
use braid_core::CoreError;
use braid_cuda::Device;

/// Environment variable: tests that need a CUDA device fail, instead of
/// skipping, when it is true (`1`, `true`, `on`, `yes`) and no device is
/// usable. For machines where the GPU is the point of the run.
pub const ENV_REQUIRE_GPU: &str = "BRAID_REQUIRE_GPU";

/// `Ok` when CUDA can be used here; otherwise "CUDA unavailable: ..." with
/// the reason (no driver, no NVRTC, no device, `BRAID_CUDA_DISABLE`).
pub fn availability() -> braid_cuda::Result<()> {
    braid_cuda::probe().map(|_| ())
}

/// Why a transport has no device: the probe's reason, or, where CUDA works,
/// that none was opened for the communicator.
pub fn no_device_reason() -> String {
    match braid_cuda::probe() {
        Err(e) => e.to_string(),
        Ok(_) => "no CUDA device was opened for this communicator".into(),
    }
}

/// The error of `transport` asked to set up a link without a device.
pub fn unavailable(transport: &'static str) -> CoreError {
    CoreError::Unavailable {
        transport,
        reason: no_device_reason(),
    }
}

/// For tests that need a CUDA device to do what `needs` says: the device
/// (`BRAID_CUDA_DEVICE`, else device 0), or `Ok(None)` after printing
/// "skipped: needs a CUDA device: `needs` (why)" to stderr. `Err` with the
/// same message when [`ENV_REQUIRE_GPU`] asks for the hardware and it is
/// missing (or that variable's value is not a boolean): the caller fails.
pub fn gpu_for_tests(needs: &str) -> Result<Option<Arc<Device>>, String> {
    let required =
        config::flag(&config::process_env, ENV_REQUIRE_GPU, false).map_err(|e| e.to_string())?;
    let dev = braid_cuda::probe().and_then(|info| {
        let ordinal = braid_cuda::device_for_rank(0, info.devices)?;
        Device::open(ordinal)
    });
    match dev {
        Ok(d) => Ok(Some(d)),
        Err(e) if required => Err(format!(
            "{ENV_REQUIRE_GPU} is set but this test cannot run: needs a CUDA device: {needs} ({e})"
        )),
        Err(e) => {
            eprintln!("skipped: needs a CUDA device: {needs} ({e})");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_cuda_the_reasons_say_so() {
        if availability().is_ok() {
            eprintln!("skipped: CUDA is present here");
            return;
        }
        assert!(availability()
            .unwrap_err()
            .to_string()
            .starts_with("CUDA unavailable"));
        let e = unavailable("nvlink").to_string();
        assert!(
            e.contains("nvlink unavailable") && e.contains("CUDA unavailable"),
            "{e}"
        );
    }
}

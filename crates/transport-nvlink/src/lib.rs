//! braid-transport-nvlink: GPUs joined by NVLink (directly or through
//! NVSwitch), and ranks that share one GPU.
//!
//! # The contract
//!
//! Each directed connection sender → receiver is a ring of fixed-size slots
//! in the **receiver's GPU memory** ([`link`]). The receiving end allocates
//! the ring (plus two 32-bit counters after it for the stream engine) and
//! exports it with a CUDA IPC memory handle; the handle travels through the
//! bootstrap in the connect-info ([`info`]); the sending end maps the ring
//! and its device engine copies or reduces straight into the receiver's
//! slots over NVLink. Credits travel in a small shared-memory FIFO
//! (`braid-transport-shm`), one control message per slot. Channels report
//! [`MemKind::Device`](braid_core::types::MemKind::Device): slot pointers
//! are device addresses, for the device engine only; they also offer the
//! ring as a [`DeviceRing`](braid_core::transport::DeviceRing) so a stream
//! can drive the link with stream memory operations.
//!
//! The same links serve `braid-transport-pcie` in P2P mode (NCCL has one
//! P2P transport; the path class decides which of the two serves a pair,
//! see the planner, `braid_core::topo::plan`).
//!
//! Without CUDA (no driver, no NVRTC, no device) the transport connects
//! nothing, and set-up errors say "CUDA unavailable" with the reason
//! ([`probe`]). All device work goes through `braid-cuda`'s safe API; this
//! crate's only `unsafe` is the control message in [`link`].
//!
//! # Configuration
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `BRAID_CUDA_SLOT_BYTES` | bytes per device slot, a multiple of 4096 up to 1 GiB (NVLink and PCIe links, staged ones too) | 524288 |
//! | `BRAID_CUDA_SLOTS` | slots per device link, 2 to 1024 | 8 |
//!
//! read by [`Geometry::from_env`].

#![deny(unsafe_code)]

use braid_core::config::{self, ConfigError};
use braid_core::error::Result;
use braid_core::CoreError;

pub mod info;
#[allow(unsafe_code)]
pub mod link;
pub mod probe;
mod transport;

pub use link::IpcLinks;
pub use transport::NvlinkTransport;

/// The transport's name.
pub const NAME: &str = "nvlink";

/// Environment variable: bytes per device slot.
pub const ENV_SLOT_BYTES: &str = "BRAID_CUDA_SLOT_BYTES";
/// Environment variable: slots per device link.
pub const ENV_SLOTS: &str = "BRAID_CUDA_SLOTS";

/// Geometry of a device link (NVLink and PCIe, P2P or staged): the GPU
/// transports' configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes per device slot (a multiple of 4096).
    pub slot_bytes: usize,
    /// Slots per link (2 to 1024).
    pub slots: usize,
}

const SLOT_BYTES_RULE: &str = "a multiple of 4096 from 4096 up to 1 GiB";
const SLOTS_RULE: &str = "2 to 1024";

fn slot_bytes_ok(b: usize) -> bool {
    b >= 4096 && b.is_multiple_of(4096) && b <= (1 << 30)
}

fn slots_ok(n: usize) -> bool {
    (2..=1024).contains(&n)
}

impl Geometry {
    /// NCCL's Simple protocol: 4 MiB per connection in 8 steps of 512 KiB.
    pub const DEFAULT: Geometry = Geometry {
        slot_bytes: 512 * 1024,
        slots: 8,
    };

    /// Check the bounds.
    pub fn validate(self) -> Result<Geometry> {
        if !slot_bytes_ok(self.slot_bytes) || !slots_ok(self.slots) {
            return Err(CoreError::InvalidArgument(format!(
                "device link geometry {} slots x {} bytes is invalid: slots {SLOTS_RULE}, slot bytes {SLOT_BYTES_RULE}",
                self.slots, self.slot_bytes
            )));
        }
        Ok(self)
    }

    /// [`Geometry::DEFAULT`] overridden by `BRAID_CUDA_SLOT_BYTES` and
    /// `BRAID_CUDA_SLOTS`; an error names the variable that is set but
    /// unusable.
    pub fn from_env() -> Result<Geometry> {
        Geometry::from_lookup(&config::process_env)
    }

    /// Like [`Geometry::from_env`] with a custom lookup (tests).
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Geometry> {
        let bad = |e: ConfigError| CoreError::InvalidArgument(e.to_string());
        let read =
            |var: &str, ok: fn(usize) -> bool, rule: &str, default: usize| match config::number::<
                usize,
            >(
                env, var
            )
            .map_err(bad)?
            {
                None => Ok(default),
                Some(v) if ok(v) => Ok(v),
                Some(v) => Err(bad(ConfigError::new(var, &v.to_string(), rule))),
            };
        Ok(Geometry {
            slot_bytes: read(
                ENV_SLOT_BYTES,
                slot_bytes_ok,
                SLOT_BYTES_RULE,
                Geometry::DEFAULT.slot_bytes,
            )?,
            slots: read(ENV_SLOTS, slots_ok, SLOTS_RULE, Geometry::DEFAULT.slots)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<Geometry> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Geometry::from_lookup(&|k| m.get(k).cloned())
    }

    #[test]
    fn geometry_bounds() {
        assert!(Geometry::DEFAULT.validate().is_ok());
        for bad in [
            Geometry {
                slot_bytes: 1000,
                slots: 8,
            },
            Geometry {
                slot_bytes: 4096,
                slots: 1,
            },
            Geometry {
                slot_bytes: 4096,
                slots: 2000,
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn geometry_env_defaults() {
        assert_eq!(from(&[]).unwrap(), Geometry::DEFAULT);
        assert_eq!(
            from(&[(ENV_SLOT_BYTES, " "), (ENV_SLOTS, "")]).unwrap(),
            Geometry::DEFAULT
        );
        // Only reads the variables; the test environment does not set them.
        if std::env::var(ENV_SLOT_BYTES).is_err() && std::env::var(ENV_SLOTS).is_err() {
            assert_eq!(Geometry::from_env().unwrap(), Geometry::DEFAULT);
        }
    }

    #[test]
    fn geometry_env_is_read_and_errors_name_the_variable() {
        assert_eq!(
            from(&[(ENV_SLOT_BYTES, "65536"), (ENV_SLOTS, " 4 ")]).unwrap(),
            Geometry {
                slot_bytes: 65536,
                slots: 4
            }
        );
        for (k, v) in [
            (ENV_SLOT_BYTES, "x"),
            (ENV_SLOT_BYTES, "-1"),
            (ENV_SLOT_BYTES, "1000"),
            (ENV_SLOT_BYTES, "0"),
            (ENV_SLOT_BYTES, "2147483648"),
            (ENV_SLOTS, "1"),
            (ENV_SLOTS, "2000"),
            (ENV_SLOTS, "eight"),
        ] {
            let e = from(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
            assert!(e.contains(v.trim()), "{k}={v}: {e}");
        }
    }
}

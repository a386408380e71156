//! A communicator's settings: the `BRAID_*` variables it reads, each
//! declared once below with its default (as NCCL's `NCCL_PARAM`), parsed
//! from one snapshot of the environment taken when the communicator is
//! created ([`Settings::from_env`]) and carried by it. Tests build the
//! settings they need from a table ([`Env::from_pairs`]) instead of
//! depending on the process environment.
//!
//! Variables that several crates parse as a group (the transport policy,
//! each transport's configuration, the topology file, `BRAID_ALGO` and the
//! rules file) are read by their own parsers from the same snapshot
//! ([`Settings::env`]). Process-wide ones (logging, the dump signal, which
//! take effect once per process) are named in [`process`].

use std::collections::HashMap;
use std::time::Duration;

use braid_core::config;
use braid_core::topo::TransportPolicy;

use crate::comm::ConnectMode;
use crate::error::{Error, Result};
use crate::slot_stores;

/// The variables read once per process, not per communicator.
pub(crate) mod process {
    /// The log filter (`init_logging`).
    pub(crate) const DEBUG: &str = "BRAID_DEBUG";
    /// The signal that dumps what every communicator waits for.
    pub(crate) const DUMP_SIGNAL: &str = "BRAID_DUMP_SIGNAL";
}

/// A snapshot of the environment (or a table standing for it).
#[derive(Clone, Debug, Default)]
pub(crate) struct Env(HashMap<String, String>);

impl Env {
    /// The process environment now (variables whose name or value is not
    /// UTF-8 count as unset, as `std::env::var` has them).
    pub(crate) fn process() -> Env {
        Env(std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect())
    }

    /// A table of variables (tests).
    #[cfg(test)]
    pub(crate) fn from_pairs(pairs: &[(&str, &str)]) -> Env {
        Env(pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }

    /// The value of `name`, as `std::env::var(name).ok()` gave it when the
    /// snapshot was taken.
    pub(crate) fn get(&self, name: &str) -> Option<String> {
        self.0.get(name).cloned()
    }
}

/// A byte count (or any number), `default` when unset.
fn number_or<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: T,
) -> Result<T> {
    Ok(config::number(env, var)?.unwrap_or(default))
}

/// A number that is `None` when unset (its default depends on the host).
fn optional_number<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: Option<T>,
) -> Result<Option<T>> {
    Ok(config::number(env, var)?.or(default))
}

/// A boolean (`1/0`, `true/false`, `on/off`, `yes/no`).
fn flag(env: &dyn Fn(&str) -> Option<String>, var: &str, default: bool) -> Result<bool> {
    Ok(config::flag(env, var, default)?)
}

/// Text, trimmed; unset or empty gives `default`.
fn text(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: Option<String>,
) -> Result<Option<String>> {
    Ok(config::value(env, var).or(default))
}

/// The raw value, untrimmed (parsed where it is used, which reports a bad
/// one at that point).
fn raw(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: Option<String>,
) -> Result<Option<String>> {
    Ok(env(var).or(default))
}

/// Seconds from 1 ms to a year.
fn stall_seconds(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: Option<Duration>,
) -> Result<Option<Duration>> {
    let range = (
        Duration::from_millis(1),
        Duration::from_secs(365 * 24 * 3600),
    );
    Ok(config::seconds(env, var, range.0, range.1)?.or(default))
}

/// `lazy` or `eager`: [`ConnectMode::from_env`], which reads
/// [`crate::comm::ENV_CONNECT`] (the variable declared below) and gives
/// the default, `lazy`, when it is unset.
fn connect_mode(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: ConnectMode,
) -> Result<ConnectMode> {
    debug_assert_eq!(
        (var, default),
        (crate::comm::ENV_CONNECT, ConnectMode::Lazy)
    );
    ConnectMode::from_env(env)
}

/// `auto`, `0` or `1`.
fn slot_mode(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: slot_stores::Mode,
) -> Result<slot_stores::Mode> {
    match env(var) {
        None => Ok(default),
        v => slot_stores::Mode::parse(v.as_deref()).map_err(Error::Env),
    }
}

/// Declares the settings: for each, its field, type, variable, default and
/// the function that parses it (`fn(env, var, default) -> Result<type>`).
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $ty:ty = $var:expr, $default:expr => $parse:ident;
    )*) => {
        /// The `BRAID_*` settings of one communicator (see the module).
        #[derive(Clone, Debug)]
        pub(crate) struct Settings {
            $(
                $(#[doc = $doc])*
                pub(crate) $field: $ty,
            )*
            /// `BRAID_TRANSPORT`, `BRAID_<NAME>_DISABLE`, `BRAID_P2P_LEVEL`,
            /// `BRAID_CROSS_NIC`, parsed by `braid_core`.
            pub(crate) policy: TransportPolicy,
            /// The snapshot they were read from, for the parsers of other
            /// crates.
            pub(crate) env: Env,
        }

        impl Settings {
            /// Every variable declared here, with its default as written.
            #[cfg(test)]
            pub(crate) const VARS: &'static [(&'static str, &'static str)] =
                &[$(($var, stringify!($default))),*];

            /// The settings in `env`; a bad value is an error naming its
            /// variable.
            pub(crate) fn from_snapshot(env: Env) -> Result<Settings> {
                let lookup = |k: &str| env.get(k);
                let policy = TransportPolicy::from_env(&lookup)?;
                Ok(Settings {
                    $($field: $parse(&lookup, $var, $default)?,)*
                    policy,
                    env,
                })
            }
        }
    };
}

settings! {
    /// Identity of this memory domain (`topology::host_id`); unset:
    /// derived from the host.
    host_id: Option<String> = "BRAID_HOST_ID", None => text;
    /// Iterations a wait spins before it sleeps; unset: by CPU sharing
    /// (`comm::tuning::spin_budget`).
    spin: Option<u32> = "BRAID_SPIN", None => optional_number;
    /// Pieces from this size go by reference on links that allow it;
    /// unset: by CPU sharing (`comm::tuning::direct_min_default`).
    direct_min: Option<usize> = "BRAID_DIRECT_MIN_BYTES", None => optional_number;
    /// Below this, reductions move data through slots; unset: by huge
    /// pages (`comm::tuning::single_copy_default`).
    single_copy_min: Option<usize> = "BRAID_SINGLE_COPY_MIN_BYTES", None => optional_number;
    /// From this size, copies use streaming stores; unset: by the
    /// last-level cache (`comm::tuning::stream_default`).
    stream_min: Option<usize> = "BRAID_STREAM_MIN_BYTES", None => optional_number;
    /// The piece of pure data movement when every link passes references.
    direct_piece: usize = "BRAID_DIRECT_PIECE_BYTES", 2 << 20 => number_or;
    /// AllReduce up to this size uses recursive doubling; 0 forces the ring.
    small_allreduce: usize = "BRAID_ALLREDUCE_RD_BYTES", 16 * 1024 => number_or;
    /// Mismatch detection (one 32-byte header per link per operation).
    check_headers: bool = "BRAID_CHECK_MISMATCH", true => flag;
    /// Single-copy AllGather and Broadcast read each block from its owner.
    direct_moves: bool = "BRAID_DIRECT_MOVES", true => flag;
    /// How long a wait may last before it is logged at WARN; unset: 10 s
    /// or half the timeout (`progress::stall_warn`).
    stall_warn: Option<Duration> = "BRAID_STALL_WARN", None => stall_seconds;
    /// Which links are connected at creation.
    connect: ConnectMode = crate::comm::ENV_CONNECT, ConnectMode::Lazy => connect_mode;
    /// Ordinary or streaming stores into slots.
    slot_stores: slot_stores::Mode = slot_stores::ENV, slot_stores::Mode::Auto => slot_mode;
    /// The device engine (`stream`, `proxy`, `auto`), parsed by the device
    /// communicator.
    cuda_engine: Option<String> = "BRAID_CUDA_ENGINE", None => raw;
}

impl Settings {
    /// The settings in the process environment now.
    pub(crate) fn from_env() -> Result<Settings> {
        Settings::from_snapshot(Env::process())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> Result<Settings> {
        Settings::from_snapshot(Env::from_pairs(pairs))
    }

    #[test]
    fn defaults_when_unset() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.host_id, None);
        assert_eq!(s.spin, None);
        assert_eq!(s.direct_min, None);
        assert_eq!(s.direct_piece, 2 << 20);
        assert_eq!(s.small_allreduce, 16 * 1024);
        assert!(s.check_headers && s.direct_moves);
        assert_eq!(s.stall_warn, None);
        assert_eq!(s.connect, ConnectMode::Lazy);
        assert_eq!(s.slot_stores, slot_stores::Mode::Auto);
        assert_eq!(s.policy, TransportPolicy::default());
    }

    #[test]
    fn values_are_read_from_the_snapshot() {
        let s = settings(&[
            ("BRAID_HOST_ID", " box7 "),
            ("BRAID_SPIN", "5"),
            ("BRAID_DIRECT_MIN_BYTES", "4096"),
            ("BRAID_CHECK_MISMATCH", "off"),
            ("BRAID_STALL_WARN", "0.5"),
            ("BRAID_CONNECT", "eager"),
            ("BRAID_SLOT_STREAM", "1"),
            ("BRAID_CUDA_ENGINE", " proxy"),
            ("BRAID_SHM_DISABLE", "1"),
        ])
        .unwrap();
        assert_eq!(s.host_id.as_deref(), Some("box7"));
        assert_eq!(s.spin, Some(5));
        assert_eq!(s.direct_min, Some(4096));
        assert!(!s.check_headers);
        assert_eq!(s.stall_warn, Some(Duration::from_millis(500)));
        assert_eq!(s.connect, ConnectMode::Eager);
        assert_eq!(s.slot_stores, slot_stores::Mode::Streaming);
        assert_eq!(s.cuda_engine.as_deref(), Some(" proxy"));
        assert!(s
            .policy
            .disabled
            .contains(&braid_core::transport::TransportKind::Shm));
        assert_eq!(s.env.get("BRAID_SPIN").as_deref(), Some("5"));
    }

    #[test]
    fn bad_values_name_their_variable() {
        for (var, bad, says) in [
            ("BRAID_SPIN", "lots", "whole number"),
            ("BRAID_ALLREDUCE_RD_BYTES", "-1", "whole number"),
            ("BRAID_DIRECT_MOVES", "maybe", "on/off"),
            ("BRAID_STALL_WARN", "0", "seconds from 0.001"),
            ("BRAID_CONNECT", "sometimes", "lazy or eager"),
            ("BRAID_SLOT_STREAM", "2", "expected auto"),
        ] {
            let e = settings(&[(var, bad)]).unwrap_err().to_string();
            assert!(e.contains(var) && e.contains(says), "{var}={bad}: {e}");
        }
    }

    #[test]
    fn every_declared_variable_is_documented() {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/environment.md"),
        )
        .unwrap();
        let names = Settings::VARS
            .iter()
            .map(|(n, _)| *n)
            .chain([process::DEBUG, process::DUMP_SIGNAL]);
        for n in names {
            assert!(doc.contains(&format!("| `{n}` |")), "{n} has no row");
        }
    }
}

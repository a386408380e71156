//! Reading braid's configuration values the same way everywhere.
//!
//! Every `BRAID_*` variable is looked up through an injected function
//! (`|k| std::env::var(k).ok()` in the runtime, a table in tests), so that
//! parsing is pure and testable. Booleans accept `1/0`, `true/false`,
//! `on/off`, `yes/no` (any case); anything else is an error naming the
//! variable. An empty value counts as unset. The list syntax of NCCL's
//! `NCCL_SOCKET_IFNAME` / `NCCL_IB_HCA` (`[^][=]name[:suffix][,…]`) is parsed
//! by [`NameList`].
//!
//! Every variable braid reads is listed in `docs/environment.md`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A variable whose value braid cannot use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: {expected}")]
#[non_exhaustive]
pub struct ConfigError {
    /// The variable's name.
    pub var: String,
    /// The value it had.
    pub value: String,
    /// What it should be.
    pub expected: String,
}

impl ConfigError {
    /// An error for `var=value`, saying what was expected.
    pub fn new(var: &str, value: &str, expected: impl Into<String>) -> ConfigError {
        ConfigError {
            var: var.to_owned(),
            value: value.to_owned(),
            expected: expected.into(),
        }
    }
}

/// The process environment, as a lookup function.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The value of `var`, trimmed; `None` when unset or empty.
pub fn value(env: &dyn Fn(&str) -> Option<String>, var: &str) -> Option<String> {
    env(var)
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Parse a boolean value of `var`: `1/0`, `true/false`, `on/off`, `yes/no`.
pub fn parse_bool(var: &str, v: &str) -> Result<bool, ConfigError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(ConfigError::new(
            var,
            v,
            "expected 1/0, true/false, on/off or yes/no",
        )),
    }
}

/// The boolean `var`, or `default` when unset or empty.
pub fn flag(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: bool,
) -> Result<bool, ConfigError> {
    value(env, var).map_or(Ok(default), |v| parse_bool(var, &v))
}

/// The number in `var` (any `FromStr` type), or `None` when unset or empty.
pub fn number<T: FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
) -> Result<Option<T>, ConfigError> {
    match value(env, var) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| ConfigError::new(var, &v, "expected a whole number")),
    }
}

/// A duration in seconds (a decimal number) in `var`, between `min` and
/// `max`; `None` when unset or empty.
pub fn seconds(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    min: Duration,
    max: Duration,
) -> Result<Option<Duration>, ConfigError> {
    let Some(v) = value(env, var) else {
        return Ok(None);
    };
    let range = || {
        format!(
            "expected seconds from {} to {}",
            min.as_secs_f64(),
            max.as_secs_f64()
        )
    };
    let s: f64 = v.parse().map_err(|_| ConfigError::new(var, &v, range()))?;
    if !s.is_finite() || s < min.as_secs_f64() || s > max.as_secs_f64() {
        return Err(ConfigError::new(var, &v, range()));
    }
    Ok(Some(Duration::from_secs_f64(s)))
}

/// One entry of a [`NameList`]: a name and what follows a `:` (a port, say).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameEntry {
    /// The name (or name prefix).
    pub name: String,
    /// The text after the first `:`, trimmed, if any.
    pub suffix: Option<String>,
}

/// NCCL's device-list syntax, `[^][=]name[:suffix][,name[:suffix]…]`: a list
/// of name prefixes (`eth,ib` matches `eth0` and `ib1`); a leading `^` makes
/// it an exclusion list, a `=` (after the `^`, if any) makes every entry an
/// exact name. Empty entries are ignored; an empty inclusion list matches
/// nothing and an empty exclusion list everything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameList {
    /// `^`: the entries name what to leave out.
    pub exclude: bool,
    /// `=`: names must match exactly, not as prefixes.
    pub exact: bool,
    /// The entries in order.
    pub entries: Vec<NameEntry>,
}

impl NameList {
    /// Parse the list syntax (never fails; entries' suffixes are the
    /// caller's to check).
    pub fn parse(s: &str) -> NameList {
        let mut s = s.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let entries = s
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| match e.split_once(':') {
                Some((n, x)) => NameEntry {
                    name: n.trim().to_owned(),
                    suffix: Some(x.trim().to_owned()),
                },
                None => NameEntry {
                    name: e.to_owned(),
                    suffix: None,
                },
            })
            .collect();
        NameList {
            exclude,
            exact,
            entries,
        }
    }

    /// Whether `name` is selected, taking into account only the entries for
    /// which `suffix_ok` holds (an entry without a suffix always counts).
    pub fn matches_with(&self, name: &str, suffix_ok: impl Fn(&str) -> bool) -> bool {
        let hit = self.entries.iter().any(|e| {
            let name_ok = if self.exact {
                name == e.name
            } else {
                name.starts_with(e.name.as_str())
            };
            name_ok && e.suffix.as_deref().is_none_or(&suffix_ok)
        });
        hit != self.exclude
    }

    /// Whether `name` is selected (suffixes ignored).
    pub fn matches(&self, name: &str) -> bool {
        self.matches_with(name, |_| true)
    }
}

impl fmt::Display for NameList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.exclude {
            f.write_str("^")?;
        }
        if self.exact {
            f.write_str("=")?;
        }
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(&e.name)?;
            if let Some(s) = &e.suffix {
                write!(f, ":{s}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn booleans_read_the_same_everywhere() {
        for (v, want) in [
            ("1", true),
            ("true", true),
            ("ON", true),
            ("Yes", true),
            (" 0 ", false),
            ("false", false),
            ("off", false),
            ("NO", false),
        ] {
            assert_eq!(parse_bool("SOME_FLAG", v), Ok(want), "{v}");
        }
        for bad in ["2", "disable", "y", "-1"] {
            let e = parse_bool("BRAID_SHM_DISABLE", bad).unwrap_err();
            let m = e.to_string();
            assert!(m.starts_with("BRAID_SHM_DISABLE="), "{m}");
            assert!(m.contains("on/off"), "{m}");
        }
        let e = env(&[("A", "off"), ("B", ""), ("C", "maybe")]);
        assert_eq!(flag(&e, "A", true), Ok(false));
        assert_eq!(flag(&e, "B", true), Ok(true), "empty is unset");
        assert_eq!(flag(&e, "Z", false), Ok(false));
        assert!(flag(&e, "C", false).is_err());
    }

    #[test]
    fn numbers_and_seconds_name_the_variable() {
        let e = env(&[("N", "42"), ("M", "4x"), ("T", "0.5"), ("U", "1e-12")]);
        assert_eq!(number::<u32>(&e, "N"), Ok(Some(42)));
        assert_eq!(number::<u32>(&e, "Z"), Ok(None));
        assert!(number::<u32>(&e, "M")
            .unwrap_err()
            .to_string()
            .contains("M=\"4x\""));
        let lo = Duration::from_millis(1);
        let hi = Duration::from_secs(10);
        assert_eq!(
            seconds(&e, "T", lo, hi),
            Ok(Some(Duration::from_millis(500)))
        );
        let m = seconds(&e, "U", lo, hi).unwrap_err().to_string();
        assert!(m.starts_with("U=") && m.contains("0.001 to 10"), "{m}");
    }

    #[test]
    fn name_lists_follow_ncclss_syntax() {
        let l = NameList::parse("eth,ib");
        assert!(l.matches("eth0") && l.matches("ib1") && !l.matches("lo"));
        let l = NameList::parse("^docker,lo");
        assert!(!l.matches("docker0") && !l.matches("lo") && l.matches("eth0"));
        let l = NameList::parse("^=eth0");
        assert!(!l.matches("eth0") && l.matches("eth01"));
        let l = NameList::parse("=mlx5_1:2, rxe");
        assert!(l.exact && !l.exclude);
        assert_eq!(l.entries[0].suffix.as_deref(), Some("2"));
        assert!(l.matches_with("mlx5_1", |s| s == "2"));
        assert!(!l.matches_with("mlx5_1", |s| s == "1"));
        assert!(l.matches_with("rxe", |_| false), "no suffix: any port");
        assert!(!l.matches("rxe0"), "exact names");
        assert!(NameList::parse("^").matches("eth0"));
        assert!(!NameList::parse("").matches("eth0"));
        assert_eq!(NameList::parse(" ^=a:1,b ").to_string(), "^=a:1,b");
    }
}

//! What users set: `BRAID_ALGO` ([`Forced`]) and the rules file
//! (`BRAID_TUNING_FILE`, [`Rules`]), parsed and checked.

use serde::{Deserialize, Serialize};

use super::Shape;
use crate::plan::{Algo, Choice, CollKind};
use crate::sim::clock::Link;

/// A choice as `BRAID_ALGO` and rules files write it: `ring`, or
/// `hier(rd)` for the hierarchical AllReduce with the leaders running
/// recursive doubling (`hier` alone leaves the leaders' algorithm to the
/// model).
pub fn parse_choice(s: &str) -> crate::error::Result<Choice> {
    let t = s.trim();
    if let Some(rest) = t.strip_suffix(')') {
        if let Some((outer, inner)) = rest.split_once('(') {
            let c = Choice {
                algo: Algo::parse(outer)?,
                inner: Some(Algo::parse(inner)?),
            };
            c.check(CollKind::AllReduce)?;
            return Ok(c);
        }
    }
    Ok(Choice::of(Algo::parse(t)?))
}

/// `BRAID_ALGO`: algorithms forced for every collective that can run them
/// and per collective, e.g. `tree`, `allreduce:rabenseifner`,
/// `ring,allreduce:hier(rd)` (items separated by `,` or `;`; a
/// collective's own item wins over a bare one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forced {
    /// Items without a collective, in order.
    pub all: Vec<Choice>,
    /// Per collective.
    pub per: Vec<(CollKind, Choice)>,
}

impl Forced {
    /// Parses `BRAID_ALGO`'s value. Unknown algorithms and collectives are
    /// errors that list the known ones; a collective paired with an
    /// algorithm that cannot run it is an error saying which can.
    pub fn parse(s: &str) -> crate::error::Result<Forced> {
        let mut f = Forced::default();
        for item in s.split([',', ';']).map(str::trim).filter(|i| !i.is_empty()) {
            match item.split_once(':') {
                Some((k, a)) => {
                    let kind = CollKind::parse(k)?;
                    let c = parse_choice(a)?;
                    c.check(kind)?;
                    f.per.push((kind, c));
                }
                None => f.all.push(parse_choice(item)?),
            }
        }
        Ok(f)
    }

    /// Nothing forced.
    pub fn is_empty(&self) -> bool {
        self.all.is_empty() && self.per.is_empty()
    }

    /// The choice forced for `kind`: its own item, else the first bare
    /// item that runs it. `Err` carries the bare items that cannot run
    /// `kind` (for the log: "tree cannot run allgather").
    pub fn get(&self, kind: CollKind) -> Result<Option<Choice>, Vec<Choice>> {
        if let Some((_, c)) = self.per.iter().find(|(k, _)| *k == kind) {
            return Ok(Some(*c));
        }
        if let Some(c) = self.all.iter().find(|c| c.check(kind).is_ok()) {
            return Ok(Some(*c));
        }
        if self.all.is_empty() {
            Ok(None)
        } else {
            Err(self.all.clone())
        }
    }
}

/// One rule of a rules file (`BRAID_TUNING_FILE`): for this collective,
/// sizes and rank counts (bounds inclusive, absent: unbounded), use this
/// algorithm.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// `allreduce`, `reducescatter`, `allgather`, `broadcast`, `reduce`.
    pub collective: String,
    /// The algorithm, as `BRAID_ALGO` names it (`hier(rd)` too).
    pub algorithm: String,
    #[serde(default)]
    pub min_bytes: Option<u64>,
    #[serde(default)]
    pub max_bytes: Option<u64>,
    #[serde(default)]
    pub min_ranks: Option<u32>,
    #[serde(default)]
    pub max_ranks: Option<u32>,
    #[serde(default)]
    pub min_hosts: Option<u32>,
    #[serde(default)]
    pub max_hosts: Option<u32>,
}

/// Link costs a rules file may give instead of measuring them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkCosts {
    #[serde(default)]
    pub shm: Option<Link>,
    #[serde(default)]
    pub net: Option<Link>,
}

/// A rules file: rules, first match wins, and optionally the link costs
/// the model should assume.
///
/// ```json
/// { "rules": [
///     { "collective": "allreduce", "max_bytes": 65536, "algorithm": "rd" },
///     { "collective": "allreduce", "min_ranks": 64, "algorithm": "hier(rabenseifner)" }
///   ],
///   "links": { "net": { "latency_us": 500, "gbps": 0.025, "overhead_us": 20 } } }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rules {
    #[serde(default)]
    pub rules: Vec<Rule>,
    #[serde(default)]
    pub links: Option<LinkCosts>,
    /// How close (a fraction of the best estimate) other candidates must
    /// be to be timed ([`trial`](super::trial); default
    /// [`TRIAL_MARGIN`](super::TRIAL_MARGIN)): 0 times nothing (the
    /// model's pick stands, even between ties), a large value times the
    /// leading candidates (at most [`TRIAL_MAX`](super::TRIAL_MAX))
    /// wherever the budget allows.
    #[serde(default)]
    pub trial_margin: Option<f64>,
    /// The most time the trials of one collective and size class may take,
    /// ms (default [`TRIAL_BUDGET_US`](super::TRIAL_BUDGET_US) / 1000):
    /// where latency matters from the first call, a small budget.
    #[serde(default)]
    pub trial_budget_ms: Option<f64>,
    /// Checked rules (filled by [`Rules::parse`]).
    #[serde(skip)]
    checked: Vec<(CollKind, Choice)>,
}

impl Rules {
    /// Parses and checks a rules file's text: JSON, unknown fields,
    /// collectives and algorithms are errors naming the rule.
    pub fn parse(text: &str) -> crate::error::Result<Rules> {
        let mut r: Rules = serde_json::from_str(text)
            .map_err(|e| crate::CoreError::InvalidArgument(format!("rules file: {e}")))?;
        for (name, v, what) in [
            (
                "trial_margin",
                r.trial_margin,
                "a fraction of the best estimate, 0 or more (0.3 is the default)",
            ),
            (
                "trial_budget_ms",
                r.trial_budget_ms,
                "milliseconds, 0 or more (2000 is the default)",
            ),
        ] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return Err(crate::CoreError::InvalidArgument(format!(
                    "rules file: {name} is {v}; give {what}"
                )));
            }
        }
        let mut checked = Vec::new();
        for (i, rule) in r.rules.iter().enumerate() {
            let at = |e: crate::CoreError| {
                crate::CoreError::InvalidArgument(format!("rules file, rule #{i}: {e}"))
            };
            let kind = CollKind::parse(&rule.collective).map_err(at)?;
            let c = parse_choice(&rule.algorithm).map_err(at)?;
            c.check(kind).map_err(at)?;
            checked.push((kind, c));
        }
        r.checked = checked;
        Ok(r)
    }

    /// The trials' margin and budget: the file's, else the defaults.
    pub fn trial_limits(&self) -> super::TrialLimits {
        let d = super::TrialLimits::default();
        super::TrialLimits {
            margin: self.trial_margin.unwrap_or(d.margin),
            budget_us: self.trial_budget_ms.map_or(d.budget_us, |ms| ms * 1e3),
        }
    }

    /// The first rule for `kind` that matches, with its index.
    pub fn get(&self, kind: CollKind, bytes: u64, shape: &Shape) -> Option<(usize, Choice)> {
        let inside = |v: u64, lo: Option<u64>, hi: Option<u64>| {
            lo.is_none_or(|l| v >= l) && hi.is_none_or(|h| v <= h)
        };
        self.rules
            .iter()
            .zip(&self.checked)
            .enumerate()
            .find(|(_, (r, (k, _)))| {
                *k == kind
                    && inside(bytes, r.min_bytes, r.max_bytes)
                    && inside(
                        shape.nranks as u64,
                        r.min_ranks.map(u64::from),
                        r.max_ranks.map(u64::from),
                    )
                    && inside(
                        shape.nhosts as u64,
                        r.min_hosts.map(u64::from),
                        r.max_hosts.map(u64::from),
                    )
            })
            .map(|(i, (_, (_, c)))| (i, *c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braid_algo_forms() {
        let f = Forced::parse("tree").unwrap();
        assert_eq!(f.get(CollKind::AllReduce), Ok(Some(Choice::of(Algo::Tree))));
        assert_eq!(f.get(CollKind::Broadcast), Ok(Some(Choice::of(Algo::Tree))));
        assert_eq!(
            f.get(CollKind::AllGather),
            Err(vec![Choice::of(Algo::Tree)])
        );
        let f = Forced::parse(" ring ; allreduce:hier(rd), allgather:bruck").unwrap();
        assert_eq!(f.get(CollKind::AllReduce), Ok(Some(Choice::hier(Algo::Rd))));
        assert_eq!(
            f.get(CollKind::AllGather),
            Ok(Some(Choice::of(Algo::Bruck)))
        );
        assert_eq!(f.get(CollKind::Reduce), Ok(Some(Choice::of(Algo::Ring))));
        assert_eq!(Forced::parse("").unwrap().get(CollKind::Reduce), Ok(None));
        let e = Forced::parse("butterfly").unwrap_err().to_string();
        assert!(e.contains("known ones are ring, direct, rd"), "{e}");
        let e = Forced::parse("allgather:tree").unwrap_err().to_string();
        assert!(e.contains("tree cannot run allgather"), "{e}");
        assert!(
            e.contains("algorithms for allgather: ring, direct, bruck"),
            "{e}"
        );
        assert!(Forced::parse("alltoall:ring").is_err());
        assert!(Forced::parse("hier(bruck)").is_err());
    }

    #[test]
    fn rules_match_in_order_and_bad_files_are_errors() {
        let r = Rules::parse(
            r#"{ "rules": [
                { "collective": "all_reduce", "max_bytes": 65536, "algorithm": "rd" },
                { "collective": "allreduce", "min_ranks": 64, "algorithm": "hier(tree)" },
                { "collective": "broadcast", "min_hosts": 2, "algorithm": "tree" } ],
              "links": { "net": { "latency_us": 500, "gbps": 0.025, "overhead_us": 20 } } }"#,
        )
        .unwrap();
        let s = Shape::uniform(4, 1, 1 << 19);
        assert_eq!(
            r.get(CollKind::AllReduce, 8, &s),
            Some((0, Choice::of(Algo::Rd)))
        );
        assert_eq!(r.get(CollKind::AllReduce, 1 << 20, &s), None);
        let big = Shape::uniform(16, 8, 1 << 17);
        assert_eq!(
            r.get(CollKind::AllReduce, 1 << 20, &big),
            Some((1, Choice::hier(Algo::Tree)))
        );
        assert_eq!(r.get(CollKind::Broadcast, 1, &s).map(|x| x.0), Some(2));
        assert_eq!(
            r.get(CollKind::Broadcast, 1, &Shape::uniform(1, 4, 4096)),
            None
        );
        assert_eq!(
            r.links.and_then(|l| l.net).map(|n| n.latency_us),
            Some(500.0)
        );
        let wide = Rules::parse(r#"{ "trial_margin": 100, "trial_budget_ms": 5 }"#).unwrap();
        assert_eq!(
            wide.trial_limits(),
            super::super::TrialLimits {
                margin: 100.0,
                budget_us: 5000.0
            }
        );
        assert_eq!(r.trial_limits(), super::super::TrialLimits::default());
        for bad in [
            "{",
            r#"{ "rulez": [] }"#,
            r#"{ "rules": [ { "collective": "allreduce", "algorithm": "fast" } ] }"#,
            r#"{ "rules": [ { "collective": "allgather", "algorithm": "tree" } ] }"#,
            r#"{ "rules": [ { "collective": "allreduce", "algorithm": "rd", "max_byte": 1 } ] }"#,
            r#"{ "trial_margin": -0.1 }"#,
            r#"{ "trial_margin": "wide" }"#,
            r#"{ "trial_budget_ms": -1 }"#,
        ] {
            assert!(Rules::parse(bad).is_err(), "{bad}");
        }
    }
}

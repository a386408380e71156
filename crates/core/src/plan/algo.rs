//! The algorithms by name, and which collective each can run.

use std::fmt;

use super::Collective;
use crate::error::{CoreError, Result};

/// The collectives whose algorithm is chosen per call (AllToAll, groups
/// and the barrier have one plan each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CollKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
}

impl CollKind {
    /// Every kind, in a fixed order.
    pub const ALL: [CollKind; 5] = [
        CollKind::AllReduce,
        CollKind::ReduceScatter,
        CollKind::AllGather,
        CollKind::Broadcast,
        CollKind::Reduce,
    ];

    /// Lower-case name, as `BRAID_ALGO` prefixes and rules files write it.
    pub const fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "allreduce",
            CollKind::ReduceScatter => "reducescatter",
            CollKind::AllGather => "allgather",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
        }
    }

    /// The kind named `s` (case and `_` ignored: `all_reduce`, `AllReduce`).
    pub fn parse(s: &str) -> Result<CollKind> {
        let norm: String = s
            .chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect();
        CollKind::ALL
            .into_iter()
            .find(|k| k.name() == norm)
            .ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "unknown collective `{s}`: known ones are {}",
                    CollKind::ALL.map(CollKind::name).join(", ")
                ))
            })
    }

    /// The kind of `coll`, if its algorithm is chosen per call.
    pub fn of(coll: &Collective) -> Option<CollKind> {
        Some(match coll {
            Collective::AllReduce { .. } => CollKind::AllReduce,
            Collective::ReduceScatter { .. } => CollKind::ReduceScatter,
            Collective::AllGather { .. } => CollKind::AllGather,
            Collective::Broadcast { .. } => CollKind::Broadcast,
            Collective::Reduce { .. } => CollKind::Reduce,
            _ => return None,
        })
    }

    /// The algorithms that can run this kind, in [`Algo::ALL`] order.
    pub fn algorithms(self) -> Vec<Algo> {
        Algo::ALL.into_iter().filter(|a| a.supports(self)).collect()
    }
}

impl fmt::Display for CollKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A collective algorithm (see `docs/algorithms.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algo {
    /// Rings and chains: every collective; bandwidth-optimal, 2(p−1) or
    /// p−1 steps.
    Ring,
    /// One stage: every block read from its owner (AllGather), or the root
    /// sending to every rank (Broadcast); one step, p−1 messages per rank.
    Direct,
    /// Recursive doubling AllReduce: log2 p exchanges of the whole buffer.
    Rd,
    /// Rabenseifner's AllReduce: reduce-scatter by recursive halving,
    /// all-gather by recursive doubling; 2 log2 p steps, ring volume. Its
    /// Reduce gathers to the root instead: the root reduces 1/p of the
    /// buffer, not all of it as at the end of the ring's chain.
    Rabenseifner,
    /// Trees: NCCL's double binary tree for AllReduce, binomial trees for
    /// Broadcast and Reduce.
    Tree,
    /// Bruck's AllGather and its transpose for ReduceScatter: ⌈log2 p⌉
    /// steps for any p, ring volume.
    Bruck,
    /// Hierarchical AllReduce: reduce inside each host to a leader, an
    /// AllReduce among the leaders, broadcast back inside each host.
    Hier,
}

impl Algo {
    /// Every algorithm, in a fixed order.
    pub const ALL: [Algo; 7] = [
        Algo::Ring,
        Algo::Direct,
        Algo::Rd,
        Algo::Rabenseifner,
        Algo::Tree,
        Algo::Bruck,
        Algo::Hier,
    ];

    /// The name `BRAID_ALGO`, rules files, logs and `braid-perf` use.
    pub const fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Direct => "direct",
            Algo::Rd => "rd",
            Algo::Rabenseifner => "rabenseifner",
            Algo::Tree => "tree",
            Algo::Bruck => "bruck",
            Algo::Hier => "hier",
        }
    }

    /// The algorithm named `s` (case ignored); an unknown name is an error
    /// that lists the known ones.
    pub fn parse(s: &str) -> Result<Algo> {
        let t = s.trim().to_ascii_lowercase();
        Algo::ALL
            .into_iter()
            .find(|a| a.name() == t)
            .ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "unknown algorithm `{s}`: known ones are {}",
                    Algo::ALL.map(Algo::name).join(", ")
                ))
            })
    }

    /// The collectives this algorithm runs.
    pub const fn collectives(self) -> &'static [CollKind] {
        use CollKind::*;
        match self {
            Algo::Ring => &[AllReduce, ReduceScatter, AllGather, Broadcast, Reduce],
            Algo::Direct => &[AllGather, Broadcast],
            Algo::Rabenseifner => &[AllReduce, Reduce],
            Algo::Rd | Algo::Hier => &[AllReduce],
            Algo::Tree => &[AllReduce, Broadcast, Reduce],
            Algo::Bruck => &[AllGather, ReduceScatter],
        }
    }

    /// Whether this algorithm runs `kind`.
    pub fn supports(self, kind: CollKind) -> bool {
        self.collectives().contains(&kind)
    }

    /// The error for running `kind` with an algorithm that cannot.
    pub fn unsupported(self, kind: CollKind) -> CoreError {
        CoreError::InvalidArgument(format!(
            "algorithm {self} cannot run {kind} (it runs {}); algorithms for {kind}: {}",
            self.collectives()
                .iter()
                .map(|k| k.name())
                .collect::<Vec<_>>()
                .join(", "),
            kind.algorithms()
                .iter()
                .map(|a| a.name())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }

    /// Whether the plan may send pieces by reference (single copy): every
    /// region it sends stays unchanged until the receiver has read it — a
    /// rank rewrites a region it sent only with data that depends on the
    /// receiver having consumed it. Recursive doubling rewrites what it has
    /// just sent with the partner's reply, which may arrive before the
    /// partner has read ours, so its pieces must go through slots.
    pub const fn single_copy_safe(self) -> bool {
        !matches!(self, Algo::Rd)
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An algorithm as the tuner or the user picks it: for the hierarchical
/// AllReduce, also the algorithm the host leaders run among themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Choice {
    /// The algorithm.
    pub algo: Algo,
    /// [`Algo::Hier`]: the leaders' AllReduce (ring when `None`).
    pub inner: Option<Algo>,
}

impl Choice {
    /// `algo` alone.
    pub const fn of(algo: Algo) -> Choice {
        Choice { algo, inner: None }
    }

    /// The hierarchical AllReduce with the leaders running `inner`.
    pub const fn hier(inner: Algo) -> Choice {
        Choice {
            algo: Algo::Hier,
            inner: Some(inner),
        }
    }

    /// Whether the plan may send by reference (see
    /// [`Algo::single_copy_safe`]).
    pub fn single_copy_safe(self) -> bool {
        self.algo.single_copy_safe() && self.inner.is_none_or(Algo::single_copy_safe)
    }

    /// Checks that this choice can run `kind`: the algorithm runs it, and a
    /// leaders' algorithm is a flat AllReduce given only to `hier`.
    pub fn check(self, kind: CollKind) -> Result<()> {
        if !self.algo.supports(kind) {
            return Err(self.algo.unsupported(kind));
        }
        match self.inner {
            None => Ok(()),
            Some(_) if self.algo != Algo::Hier => Err(CoreError::InvalidArgument(format!(
                "only hier takes a leaders' algorithm, not {}",
                self.algo
            ))),
            Some(i) if i == Algo::Hier || !i.supports(CollKind::AllReduce) => {
                Err(CoreError::InvalidArgument(format!(
                    "hier's leaders run a flat AllReduce (ring, rd, rabenseifner or tree), not {i}"
                )))
            }
            Some(_) => Ok(()),
        }
    }
}

impl fmt::Display for Choice {
    /// `ring`, or `hier(rd)` for the hierarchical form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.inner {
            Some(i) => write!(f, "{}({})", self.algo, i),
            None => write!(f, "{}", self.algo),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_known_ones() {
        for a in Algo::ALL {
            assert_eq!(Algo::parse(a.name()).unwrap(), a);
            assert_eq!(Algo::parse(&a.name().to_uppercase()).unwrap(), a);
        }
        let e = Algo::parse("butterfly").unwrap_err().to_string();
        for a in Algo::ALL {
            assert!(e.contains(a.name()), "{e}");
        }
        for k in CollKind::ALL {
            assert_eq!(CollKind::parse(k.name()).unwrap(), k);
        }
        assert_eq!(CollKind::parse("all_reduce").unwrap(), CollKind::AllReduce);
        assert!(CollKind::parse("alltoall").is_err());
    }

    #[test]
    fn every_kind_has_the_ring_and_unsupported_pairs_say_what_would_do() {
        for k in CollKind::ALL {
            assert!(Algo::Ring.supports(k));
        }
        let e = Choice::of(Algo::Bruck)
            .check(CollKind::AllReduce)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bruck cannot run allreduce"), "{e}");
        assert!(e.contains("ring, rd, rabenseifner, tree, hier"), "{e}");
        assert!(Choice::hier(Algo::Rd).check(CollKind::AllReduce).is_ok());
        assert!(Choice::hier(Algo::Hier).check(CollKind::AllReduce).is_err());
        assert!(Choice::hier(Algo::Bruck)
            .check(CollKind::AllReduce)
            .is_err());
        assert_eq!(Choice::hier(Algo::Rd).to_string(), "hier(rd)");
        assert!(!Choice::hier(Algo::Rd).single_copy_safe());
    }
}

//! Search: the order of one host's ranks in a ring, best by the narrowest
//! link, then the worst path class, then the total bandwidth (as NCCL's
//! `graph/search.cc` searches for the best channel).

use super::paths::Ctx;
use crate::topo::graph::PathType;
use crate::transport::TransportKind;

/// Score of an ordering: narrowest GB/s (the hop to the port the path
/// leaves by included), GB/s of that hop, worst path class, total GB/s,
/// and how the last rank reaches that port (0: next to it, 1: through a
/// relay, 2: otherwise).
#[derive(Clone, Copy, PartialEq)]
struct Score {
    min_bw: f64,
    exit_bw: f64,
    worst: PathType,
    sum_bw: f64,
    exit: u8,
}

impl Score {
    /// Whether this ordering is better than `o`, field by field.
    fn better(&self, o: &Score) -> bool {
        const EPS: f64 = 1e-9;
        if (self.min_bw - o.min_bw).abs() > EPS {
            return self.min_bw > o.min_bw;
        }
        if (self.exit_bw - o.exit_bw).abs() > EPS {
            return self.exit_bw > o.exit_bw;
        }
        if self.worst != o.worst {
            return self.worst < o.worst;
        }
        if (self.sum_bw - o.sum_bw).abs() > EPS {
            return self.sum_bw > o.sum_bw;
        }
        self.exit < o.exit
    }
}

/// The best order of the ranks `rs` of one host: a cycle (`cycle`) or a path
/// from `start` whose last rank is rated by `exit` (GB/s to the port it
/// leaves by, class of that path).
pub(super) fn best_order(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    rs: &[usize],
    start: Option<usize>,
    cycle: bool,
    exit: &dyn Fn(usize) -> (f64, u8),
) -> Vec<usize> {
    let m = rs.len();
    if m <= 1 {
        return rs.to_vec();
    }
    let edge = |a: usize, b: usize| cx.link(a, b, transports[a][b].unwrap_or(TransportKind::Shm));
    let first = start.unwrap_or(rs[0]);
    // The exit rating depends on the last rank only: once per rank.
    let exits: Vec<(usize, (f64, u8))> = rs.iter().map(|&r| (r, exit(r))).collect();
    let exit = |r: usize| {
        exits
            .iter()
            .find(|x| x.0 == r)
            .map_or((f64::INFINITY, 2), |x| x.1)
    };
    let score = |order: &[usize]| {
        let (exit_bw, exit_class) = exit(*order.last().unwrap_or(&first));
        let mut s = Score {
            min_bw: exit_bw,
            exit_bw,
            worst: PathType::Loc,
            sum_bw: 0.0,
            exit: exit_class,
        };
        let k = if cycle { order.len() } else { order.len() - 1 };
        for i in 0..k {
            let (t, bw) = edge(order[i], order[(i + 1) % order.len()]);
            s.min_bw = s.min_bw.min(bw);
            s.worst = s.worst.max(t);
            s.sum_bw += bw;
        }
        s
    };
    let rest: Vec<usize> = rs.iter().copied().filter(|&r| r != first).collect();
    if m <= 9 {
        // Exhaustive, in lexicographic order so ties keep the smallest order.
        let mut best: Option<(Score, Vec<usize>)> = None;
        let mut cur = vec![first];
        let mut used = vec![false; rest.len()];
        permute(&rest, &mut used, &mut cur, &mut |o| {
            let s = score(o);
            if best.as_ref().is_none_or(|(b, _)| s.better(b)) {
                best = Some((s, o.to_vec()));
            }
        });
        return best.map(|(_, o)| o).unwrap_or_else(|| rs.to_vec());
    }
    // Greedy: always the best next neighbour, keeping the rank that leaves
    // best for last when the path is not a cycle.
    let keep_last = (!cycle)
        .then(|| {
            rest.iter().copied().min_by(|&a, &b| {
                let (ea, eb) = (exit(a), exit(b));
                (ea.1, -ea.0)
                    .partial_cmp(&(eb.1, -eb.0))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
        })
        .flatten();
    let mut order = vec![first];
    let mut left: Vec<usize> = rest
        .iter()
        .copied()
        .filter(|&r| Some(r) != keep_last)
        .collect();
    while !left.is_empty() {
        let last = *order.last().unwrap_or(&first);
        let mut bi = 0;
        for i in 1..left.len() {
            let (ti, bwi) = edge(last, left[i]);
            let (tb, bwb) = edge(last, left[bi]);
            if bwi > bwb + 1e-9 || ((bwi - bwb).abs() <= 1e-9 && ti < tb) {
                bi = i;
            }
        }
        order.push(left.remove(bi));
    }
    order.extend(keep_last);
    order
}

/// Call `f` with every order that starts with `cur` and continues with the
/// unused ranks of `rest`, in lexicographic order.
fn permute(rest: &[usize], used: &mut [bool], cur: &mut Vec<usize>, f: &mut impl FnMut(&[usize])) {
    if cur.len() == rest.len() + 1 {
        f(cur);
        return;
    }
    for i in 0..rest.len() {
        if !used[i] {
            used[i] = true;
            cur.push(rest[i]);
            permute(rest, used, cur, f);
            cur.pop();
            used[i] = false;
        }
    }
}

//! Timing trials: where the model's candidates are too close for its
//! error, the runtime times them at the first call of a collective and
//! size class ([`trial`] says which and how often, [`timed_pick`] takes
//! the fastest).

use super::{candidates, estimate, Costs, Shape};
use crate::plan::{Choice, CollKind};

/// Candidates whose estimates lie within this fraction of the best one
/// are close enough for the model's error to decide between them: the
/// runtime times them ([`trial`]). Measured against the emulated hosts,
/// the model's error reached 25% where one algorithm's steps meet effects
/// it does not describe (a 1 MiB Rabenseifner on 8 rate-limited hosts:
/// estimated 5% faster than the ring, measured 20% slower).
pub const TRIAL_MARGIN: f64 = 0.3;

/// The most candidates one trial times.
pub const TRIAL_MAX: usize = 3;

/// The most time, by the model's estimates, that the trials of one call
/// shape may take, µs: trials happen at the first call of a shape and
/// never cost more than about this.
pub const TRIAL_BUDGET_US: f64 = 2e6;

/// The largest collective (bytes, as [`estimate`] counts them) whose
/// candidates are timed: trials run on scratch buffers as large as the
/// call's, and at this size and above the estimates are bandwidth terms,
/// where the model is most reliable.
pub const TRIAL_MAX_BYTES: usize = 16 << 20;

/// Close candidates to time, from [`trial`].
#[derive(Clone, Debug, PartialEq)]
pub struct Trial {
    /// The candidates with their estimates (µs), the model's best first.
    pub choices: Vec<(Choice, f64)>,
    /// Timed runs of each (after one untimed run that connects its links).
    pub runs: usize,
}

/// Whether the model's pick for `kind` of `bytes` on `shape` should be
/// checked by timing: `Some` when another candidate's estimate lies
/// within [`TRIAL_MARGIN`] of the best one's (at most [`TRIAL_MAX`], the
/// best first) and 2 to 5 timed runs of each, plus one untimed, fit in
/// [`TRIAL_BUDGET_US`] by the estimates; `None` when the model's pick
/// stands alone, timing would cost too much or the collective is larger
/// than [`TRIAL_MAX_BYTES`].
///
/// `margin` replaces [`TRIAL_MARGIN`] where a rules file sets one
/// ([`Rules::trial_margin`](super::Rules::trial_margin)); 0 means no trials (not even of ties).
pub fn trial(
    costs: &Costs,
    shape: &Shape,
    kind: CollKind,
    bytes: usize,
    margin: Option<f64>,
) -> Option<Trial> {
    let margin = margin.unwrap_or(TRIAL_MARGIN);
    if bytes > TRIAL_MAX_BYTES || margin <= 0.0 {
        return None;
    }
    let mut all: Vec<(Choice, f64)> = candidates(kind, shape)
        .into_iter()
        .map(|c| (c, estimate(costs, shape, kind, c, bytes)))
        .filter(|(_, t)| t.is_finite())
        .collect();
    // Stable: equal estimates keep the candidates' order (as `best`).
    all.sort_by(|a, b| a.1.total_cmp(&b.1));
    let best = all.first()?.1;
    let choices: Vec<(Choice, f64)> = all
        .into_iter()
        .take_while(|(_, t)| *t <= best * (1.0 + margin))
        .take(TRIAL_MAX)
        .collect();
    if choices.len() < 2 {
        return None;
    }
    let total: f64 = choices.iter().map(|(_, t)| t).sum();
    let runs = (2..=5usize)
        .rev()
        .find(|&r| total * (r + 1) as f64 <= TRIAL_BUDGET_US)?;
    Some(Trial { choices, runs })
}

/// The choice with the shortest measured time of a [`Trial`] (`times` in
/// the trial's order); the earlier one (the model's preference) on ties.
pub fn timed_pick(trial: &Trial, times: &[f64]) -> Choice {
    let mut best = 0;
    for (i, t) in times.iter().enumerate().take(trial.choices.len()) {
        if *t < times[best] {
            best = i;
        }
    }
    trial.choices[best].0
}

/// Size classes of [`trial`] results: a trial's answer stands for every
/// call of the same collective whose size has the same bit length.
pub fn size_class(bytes: usize) -> u32 {
    usize::BITS - bytes.leading_zeros()
}

#[cfg(test)]
mod tests {
    use super::super::best;
    use super::*;
    use crate::plan::Algo;
    use crate::transport::TransportKind;

    /// Trials: a clear winner (latency-bound 8 bytes on 16 hosts, where
    /// recursive doubling's 4 steps beat the ring's 30 by far) is not
    /// timed; near-ties are, the model's best first, within the margin and
    /// the budget; the timed pick is the fastest measured, the model's
    /// order on ties.
    #[test]
    fn trials_time_only_close_candidates_within_budget() {
        let c = Costs::defaults(TransportKind::Socket);
        let s = Shape::uniform(16, 1, 1 << 19);
        let kind = CollKind::AllReduce;
        let est = |ch: Choice, b: usize| estimate(&c, &s, kind, ch, b);
        // Every size of the golden range: a trial exists exactly when a
        // second candidate lies within the margin, recomputed here from
        // the estimates one by one.
        let mut seen_trial = false;
        let mut seen_none = false;
        for shift in 0..=26 {
            let b = 8usize << shift;
            let mut ts: Vec<(Choice, f64)> = candidates(kind, &s)
                .into_iter()
                .map(|ch| (ch, est(ch, b)))
                .collect();
            ts.sort_by(|x, y| x.1.total_cmp(&y.1));
            let close = ts
                .iter()
                .filter(|(_, t)| *t <= ts[0].1 * (1.0 + TRIAL_MARGIN))
                .count()
                .min(TRIAL_MAX);
            let cost: f64 = ts.iter().take(close).map(|(_, t)| 3.0 * t).sum();
            match trial(&c, &s, kind, b, None) {
                Some(t) => {
                    seen_trial = true;
                    assert!(b <= TRIAL_MAX_BYTES, "{b}: {t:?}");
                    assert!(close >= 2 && cost <= TRIAL_BUDGET_US, "{b}: {t:?}");
                    assert_eq!(t.choices.len(), close, "{b}");
                    assert_eq!(t.choices[0].0, best(&c, &s, kind, b).0, "{b}");
                    for w in t.choices.windows(2) {
                        assert!(w[0].1 <= w[1].1, "{b}: {t:?}");
                    }
                    let total: f64 = t.choices.iter().map(|x| x.1).sum();
                    assert!((2..=5).contains(&t.runs), "{b}: {t:?}");
                    assert!(total * (t.runs + 1) as f64 <= TRIAL_BUDGET_US, "{b}");
                }
                None => {
                    seen_none = true;
                    assert!(
                        close < 2 || cost > TRIAL_BUDGET_US || b > TRIAL_MAX_BYTES,
                        "{b}: {close} close"
                    );
                }
            }
        }
        assert!(seen_trial && seen_none);
        // A rules file's margin: wide, the clear winner is timed against
        // the next candidates too; zero, near-ties are left to the model.
        assert!(trial(&c, &s, kind, 8, None).is_none());
        let wide = trial(&c, &s, kind, 8, Some(100.0)).expect("timed");
        assert_eq!(
            wide.choices.len(),
            TRIAL_MAX.min(candidates(kind, &s).len())
        );
        assert_eq!(wide.choices[0].0, best(&c, &s, kind, 8).0);
        assert!((0..=26).all(|k| trial(&c, &s, kind, 8 << k, Some(0.0)).is_none()));
        let t = Trial {
            choices: vec![
                (Choice::of(Algo::Rabenseifner), 1.0),
                (Choice::of(Algo::Ring), 1.1),
                (Choice::of(Algo::Tree), 1.2),
            ],
            runs: 2,
        };
        assert_eq!(timed_pick(&t, &[97.0, 83.0, 90.0]).algo, Algo::Ring);
        assert_eq!(timed_pick(&t, &[83.0, 83.0, 90.0]).algo, Algo::Rabenseifner);
        assert_eq!(size_class(0), 0);
        assert_eq!(size_class(1 << 20), size_class((1 << 21) - 1));
        assert_ne!(size_class(1 << 20), size_class(1 << 21));
    }
}

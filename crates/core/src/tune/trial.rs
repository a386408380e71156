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
/// call's. Up to here, because the bandwidth terms are not reliable either
/// where the network stack's work competes with the reductions for the
/// same cores: between two emulated hosts over TCP the model picks
/// recursive doubling for a 64 MiB AllReduce (estimated a tie with the
/// ring, both bound by the wire), which ran at 0.43-0.65 of iperf3's
/// speed both ways where the ring ran at 0.76-0.96; DDP's default bucket
/// (25 MiB) falls in this range too.
pub const TRIAL_MAX_BYTES: usize = 64 << 20;

/// How much timing the tuner may do: [`TRIAL_MARGIN`] and
/// [`TRIAL_BUDGET_US`] unless a rules file sets them
/// ([`Rules::trial_limits`](super::Rules::trial_limits)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrialLimits {
    /// Candidates within this fraction of the best estimate are timed; 0:
    /// none (not even ties).
    pub margin: f64,
    /// The most time the trials of one call shape may take, µs: by the
    /// estimates when [`trial`] plans them, and by the first (untimed)
    /// runs when the runtime has made them ([`runs_within`]).
    pub budget_us: f64,
}

impl Default for TrialLimits {
    fn default() -> Self {
        TrialLimits {
            margin: TRIAL_MARGIN,
            budget_us: TRIAL_BUDGET_US,
        }
    }
}

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
/// within the margin of the best one's (at most [`TRIAL_MAX`], the best
/// first) and 2 to 5 timed runs of each, plus one untimed, fit in the
/// budget by the estimates; `None` when the model's pick stands alone,
/// timing would cost too much, the margin is 0 or the collective is
/// larger than [`TRIAL_MAX_BYTES`].
pub fn trial(
    costs: &Costs,
    shape: &Shape,
    kind: CollKind,
    bytes: usize,
    limits: TrialLimits,
) -> Option<Trial> {
    let margin = limits.margin;
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
        .find(|&r| total * (r + 1) as f64 <= limits.budget_us)?;
    Some(Trial { choices, runs })
}

/// How many of a [`Trial`]'s timed runs still fit the budget, now that
/// the first (untimed) run of every candidate took `first_us` in all
/// (the ranks' agreed maximum, so every rank gets the same answer): at
/// most `trial.runs`; 0 when not even one more run of each fits, and the
/// model's pick should stand. The estimates can be far off — on loaded
/// machines a 1-byte AllReduce estimated at 47 µs took 2.6 ms — and the
/// budget is a promise about real time.
pub fn runs_within(trial: &Trial, first_us: f64, limits: TrialLimits) -> usize {
    let spent = first_us.max(0.0);
    (1..=trial.runs)
        .rev()
        .find(|&r| spent * (r + 1) as f64 <= limits.budget_us)
        .unwrap_or(0)
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
            match trial(&c, &s, kind, b, TrialLimits::default()) {
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
        let margin = |m: f64| TrialLimits {
            margin: m,
            ..TrialLimits::default()
        };
        assert!(trial(&c, &s, kind, 8, TrialLimits::default()).is_none());
        let wide = trial(&c, &s, kind, 8, margin(100.0)).expect("timed");
        assert_eq!(
            wide.choices.len(),
            TRIAL_MAX.min(candidates(kind, &s).len())
        );
        assert_eq!(wide.choices[0].0, best(&c, &s, kind, 8).0);
        assert!((0..=26).all(|k| trial(&c, &s, kind, 8 << k, margin(0.0)).is_none()));
        // The budget, by the estimates and then by the first runs.
        let tight = TrialLimits {
            budget_us: wide.choices.iter().map(|x| x.1).sum::<f64>() * 3.5,
            margin: 100.0,
        };
        let t = trial(&c, &s, kind, 8, tight).expect("two runs fit");
        assert_eq!(t.runs, 2, "{t:?}");
        assert!(trial(
            &c,
            &s,
            kind,
            8,
            TrialLimits {
                budget_us: 0.0,
                ..tight
            }
        )
        .is_none());
        let first = tight.budget_us / 3.0;
        assert_eq!(runs_within(&t, first, tight), 2);
        assert_eq!(runs_within(&t, first * 1.2, tight), 1);
        assert_eq!(runs_within(&t, tight.budget_us, tight), 0);
        assert_eq!(runs_within(&t, 0.0, tight), 2);
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

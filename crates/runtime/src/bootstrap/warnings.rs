//! Rate-limited warnings for the bootstrap's state machines (the root's
//! rendezvous, a rank's listener): at most one warning per cause per
//! [`WARN_INTERVAL`]; the ones left out are counted, and the count is said
//! with the next warning of that cause or, at the latest, one interval
//! after the last shown (so that a flood that stops, or a process that
//! exits soon after, does not lose them), and when the machine ends.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::fmt_dur;

/// At most one warning per cause per this interval; the others are counted.
pub(crate) const WARN_INTERVAL: Duration = Duration::from_secs(1);

/// How loud a log line is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    Warn,
    Debug,
}

/// A log line for the driver to emit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LogLine {
    pub level: Level,
    pub msg: String,
}

#[derive(Debug)]
struct Cause {
    last: Instant,
    suppressed: u64,
}

/// The log lines of a machine, with the rate limit of its warnings.
#[derive(Debug, Default)]
pub(crate) struct Warnings {
    causes: BTreeMap<String, Cause>,
    logs: VecDeque<LogLine>,
}

impl Warnings {
    /// A debug line (never limited).
    pub(super) fn debug(&mut self, msg: String) {
        self.logs.push_back(LogLine {
            level: Level::Debug,
            msg,
        });
    }

    /// A warning, at most one per `cause` per [`WARN_INTERVAL`]; the next
    /// one says how many were left out. Returns whether it was shown.
    pub(super) fn warn(&mut self, now: Instant, cause: &str, msg: impl FnOnce() -> String) -> bool {
        let due = match self.causes.get(cause) {
            None => true,
            Some(w) => now.saturating_duration_since(w.last) >= WARN_INTERVAL,
        };
        if !due {
            // Counted only: under a flood the message is not even built.
            if let Some(w) = self.causes.get_mut(cause) {
                w.suppressed += 1;
            }
            return false;
        }
        let mut text = msg();
        if let Some(w) = self.causes.get(cause) {
            if w.suppressed > 0 {
                text += &format!(
                    " ({} more like this in the last {} not shown)",
                    w.suppressed,
                    fmt_dur(now.saturating_duration_since(w.last))
                );
            }
        }
        self.causes.insert(
            cause.to_string(),
            Cause {
                last: now,
                suppressed: 0,
            },
        );
        self.logs.push_back(LogLine {
            level: Level::Warn,
            msg: text,
        });
        true
    }

    /// When the counts of left-out warnings are next due.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        self.causes
            .values()
            .filter(|w| w.suppressed > 0)
            .map(|w| w.last + WARN_INTERVAL)
            .min()
    }

    /// The clock reached `now`: says the counts that are due.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        self.flush_where(now, |w| {
            now.saturating_duration_since(w.last) >= WARN_INTERVAL
        });
    }

    /// Says every count of left-out warnings (the machine ends).
    pub(super) fn flush(&mut self, now: Instant) {
        self.flush_where(now, |_| true);
    }

    fn flush_where(&mut self, now: Instant, due: impl Fn(&Cause) -> bool) {
        let mut lines = Vec::new();
        for (cause, w) in self.causes.iter_mut() {
            if w.suppressed > 0 && due(w) {
                lines.push(format!(
                    "{} more bootstrap warnings ({cause}) in the last {} not shown",
                    w.suppressed,
                    fmt_dur(now.saturating_duration_since(w.last))
                ));
                w.suppressed = 0;
                // The next warning of this cause is shown at once.
                w.last = now.checked_sub(WARN_INTERVAL).unwrap_or(w.last);
            }
        }
        for msg in lines {
            self.logs.push_back(LogLine {
                level: Level::Warn,
                msg,
            });
        }
    }

    /// The next log line.
    pub(super) fn poll_log(&mut self) -> Option<LogLine> {
        self.logs.pop_front()
    }

    /// Warnings shown and counted as left out so far (for tests).
    #[cfg(test)]
    pub(super) fn suppressed(&self) -> u64 {
        self.causes.values().map(|w| w.suppressed).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every warning is accounted for, shown or counted, within an interval
    /// of the last one even when no later warning of its cause comes.
    #[test]
    fn left_out_warnings_are_counted_within_an_interval() {
        let t0 = Instant::now();
        let mut w = Warnings::default();
        for i in 0..40u64 {
            w.warn(t0 + Duration::from_millis(i * 10), "rejected", || {
                format!("rejected connection {i}")
            });
        }
        assert_eq!(w.suppressed(), 39);
        let due = w.poll_timeout().expect("a count is due");
        assert_eq!(due, t0 + WARN_INTERVAL);
        w.handle_timeout(due);
        let warns: Vec<String> = std::iter::from_fn(|| w.poll_log())
            .filter(|l| l.level == Level::Warn)
            .map(|l| l.msg)
            .collect();
        assert_eq!(warns.len(), 2, "{warns:?}");
        assert!(
            warns[1].starts_with("39 more bootstrap warnings (rejected)"),
            "{warns:?}"
        );
        assert_eq!(w.suppressed(), 0);
        assert_eq!(w.poll_timeout(), None);
        // The next one is shown at once.
        assert!(w.warn(due, "rejected", || "again".into()));
    }

    #[test]
    fn flush_says_every_count() {
        let t0 = Instant::now();
        let mut w = Warnings::default();
        for _ in 0..3 {
            w.warn(t0, "a", || "a".into());
            w.warn(t0, "b", || "b".into());
        }
        w.flush(t0);
        let n = std::iter::from_fn(|| w.poll_log())
            .filter(|l| l.level == Level::Warn && l.msg.contains("more bootstrap warnings"))
            .count();
        assert_eq!(n, 2);
    }
}

//! Logging setup: plain or JSON lines on stderr, filtered by `RUST_LOG` when set; and the rate
//! limit for a failure that repeats while it lasts.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// kube's HTTP trace layer logs every failed request at ERROR with no context ("failed with
/// error ..."), and the caller gets the same error back and logs it with what it was doing. By
/// default that second copy is off: during an API outage it doubled every line. `RUST_LOG`
/// brings it back.
const DEFAULT_EXTRA: &str = "kube_client::client::builder=off";

pub fn init_logging(format: LogFormat, default_level: &str) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{default_level},{DEFAULT_EXTRA}")));
    // Colours only for a person at a terminal: `kubectl logs` and log collectors get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// What to log for one more failure of a streak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureLog {
    /// The first failure after success (or ever): log it in full.
    First,
    /// A reminder that it still fails: `failures` so far, for `lasting` since the first.
    StillFailing { failures: u64, lasting: Duration },
    /// Repeats the last line said; at most debug.
    Quiet,
}

/// Rate limit for the log of one repeating failure (the progress writes of an operation while
/// the API server is down): the first failure is logged, then one reminder per `every` while it
/// lasts, and one line when it ends. An hour's outage costs a few dozen lines per operation,
/// not one per update interval, and the operator still sees when it began, that it goes on and
/// when it ended.
#[derive(Debug)]
pub struct FailureStreak {
    every: Duration,
    first: Option<Instant>,
    last_said: Option<Instant>,
    failures: u64,
}

impl FailureStreak {
    pub fn new(every: Duration) -> Self {
        FailureStreak {
            every,
            first: None,
            last_said: None,
            failures: 0,
        }
    }

    pub fn failed(&mut self, now: Instant) -> FailureLog {
        self.failures += 1;
        let Some(first) = self.first else {
            self.first = Some(now);
            self.last_said = Some(now);
            return FailureLog::First;
        };
        match self.last_said {
            Some(said) if now.saturating_duration_since(said) < self.every => FailureLog::Quiet,
            _ => {
                self.last_said = Some(now);
                FailureLog::StillFailing {
                    failures: self.failures,
                    lasting: now.saturating_duration_since(first),
                }
            }
        }
    }

    /// Ends the streak; returns (failures, how long it lasted) when there was one to report.
    pub fn succeeded(&mut self, now: Instant) -> Option<(u64, Duration)> {
        let first = self.first.take()?;
        let failures = std::mem::take(&mut self.failures);
        self.last_said = None;
        Some((failures, now.saturating_duration_since(first)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streak_is_said_once_then_reminded_per_period_then_ended() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut streak = FailureStreak::new(Duration::from_secs(60));
        assert_eq!(streak.succeeded(s(0)), None, "no streak, nothing to end");
        assert_eq!(streak.failed(s(0)), FailureLog::First);
        // One failure per 10 s interval: quiet until a minute since the last line.
        for t in (10..60).step_by(10) {
            assert_eq!(streak.failed(s(t)), FailureLog::Quiet, "at {t} s");
        }
        assert_eq!(
            streak.failed(s(60)),
            FailureLog::StillFailing {
                failures: 7,
                lasting: Duration::from_secs(60)
            }
        );
        assert_eq!(streak.failed(s(70)), FailureLog::Quiet);
        assert_eq!(streak.succeeded(s(75)), Some((8, Duration::from_secs(75))));
        // A new streak starts over: its first failure is said in full again.
        assert_eq!(streak.failed(s(80)), FailureLog::First);
        assert_eq!(streak.succeeded(s(81)), Some((1, Duration::from_secs(1))));
        assert_eq!(streak.succeeded(s(82)), None);
    }

    #[test]
    fn a_failure_after_a_long_quiet_gap_is_a_reminder_at_once() {
        let t0 = Instant::now();
        let mut streak = FailureStreak::new(Duration::from_secs(60));
        assert_eq!(streak.failed(t0), FailureLog::First);
        assert_eq!(
            streak.failed(t0 + Duration::from_secs(300)),
            FailureLog::StillFailing {
                failures: 2,
                lasting: Duration::from_secs(300)
            }
        );
    }
}

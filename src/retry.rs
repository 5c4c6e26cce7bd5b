//! The retry ladder: how long a failed event waits before it is due again.

use std::time::Duration;

use crate::error::{Error, Result};

/// What happens after the last explicit step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AfterLastStep {
    /// Each further delay doubles the one before, up to the cap.
    Double,
    /// The last step repeats.
    Repeat,
}

/// How long a failed event waits before it is due again.
///
/// The default is the schema's original ladder (docs/schema.md), extended: after the 1st failure 1 min,
/// 2nd 5 min, 3rd 15 min, 4th 1 h, then doubling (2 h, 4 h, 8 h, 16 h) capped
/// at 24 h. Every delay is stretched by a random 0–10 % ([`Self::jitter`]) so
/// that events that failed together do not retry in lockstep; a delay is never
/// shorter than its step. The due time is computed in SQL as
/// `now() + delay`, with the database's clock.
///
/// # Example
/// ```
/// use std::time::Duration;
/// use pg_outbox::RetryPolicy;
/// let p = RetryPolicy::default();
/// assert_eq!(p.base_delay(1), Duration::from_secs(60));
/// assert_eq!(p.base_delay(5), Duration::from_secs(2 * 3600));
/// let fast = RetryPolicy::schedule(vec![Duration::from_millis(100)]).unwrap();
/// assert_eq!(fast.base_delay(7), Duration::from_millis(100));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    steps: Vec<Duration>,
    after: AfterLastStep,
    cap: Duration,
    jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            steps: RetryPolicy::DEFAULT_STEPS.to_vec(),
            after: AfterLastStep::Double,
            cap: RetryPolicy::DEFAULT_CAP,
            jitter: RetryPolicy::DEFAULT_JITTER,
        }
    }
}

impl RetryPolicy {
    /// The original ladder's steps: 1 min, 5 min, 15 min, 1 h
    /// (docs/schema.md, "Publisher and poller flow", MarkRetry).
    pub const DEFAULT_STEPS: [Duration; 4] = [
        Duration::from_secs(60),
        Duration::from_secs(5 * 60),
        Duration::from_secs(15 * 60),
        Duration::from_secs(60 * 60),
    ];

    /// Longest wait of the default ladder: 24 hours.
    pub const DEFAULT_CAP: Duration = Duration::from_secs(24 * 60 * 60);

    /// Default jitter: each delay is stretched by a random 0–10 %.
    pub const DEFAULT_JITTER: f64 = 0.10;

    /// A ladder of explicit steps whose last step repeats (the relay's
    /// `--retry-schedule 1m,5m,15m,1h`). Steps may be sub-second.
    ///
    /// # Errors
    /// [`Error::Config`] if `steps` is empty or a step is zero.
    pub fn schedule(steps: Vec<Duration>) -> Result<Self> {
        if steps.is_empty() {
            return Err(Error::Config("retry schedule needs at least one step".into()));
        }
        if steps.iter().any(|d| d.is_zero()) {
            return Err(Error::Config("retry schedule steps must be longer than zero".into()));
        }
        let cap = steps.iter().copied().max().unwrap_or(RetryPolicy::DEFAULT_CAP);
        Ok(RetryPolicy {
            steps,
            after: AfterLastStep::Repeat,
            cap: cap.max(RetryPolicy::DEFAULT_CAP),
            jitter: RetryPolicy::DEFAULT_JITTER,
        })
    }

    /// Set what follows the last step (default for [`RetryPolicy::default`]:
    /// [`AfterLastStep::Double`]; for [`RetryPolicy::schedule`]:
    /// [`AfterLastStep::Repeat`]).
    pub fn after_last_step(mut self, after: AfterLastStep) -> Self {
        self.after = after;
        self
    }

    /// Set the longest delay (default 24 h). Delays above it are cut to it.
    pub fn cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// Set the jitter fraction, clamped to 0.0..=1.0 (default 0.10: each
    /// delay is stretched by a random 0–10 %). 0 makes delays exact.
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = if fraction.is_finite() { fraction.clamp(0.0, 1.0) } else { 0.0 };
        self
    }

    /// The steps of this ladder.
    pub fn steps(&self) -> &[Duration] {
        &self.steps
    }

    /// The delay after the `failures`-th failure (1-based), without jitter.
    /// `failures` of 0 is treated as 1.
    pub fn base_delay(&self, failures: u32) -> Duration {
        let n = failures.max(1) as usize;
        let last = *self.steps.last().unwrap_or(&RetryPolicy::DEFAULT_STEPS[0]);
        let d = if n <= self.steps.len() {
            self.steps[n - 1]
        } else {
            match self.after {
                AfterLastStep::Repeat => last,
                AfterLastStep::Double => {
                    let extra = (n - self.steps.len()).min(32) as u32;
                    last.checked_mul(1u32 << extra.min(31)).unwrap_or(self.cap)
                }
            }
        };
        d.min(self.cap)
    }

    /// The delay after the `failures`-th failure, with jitter applied:
    /// between `base_delay(failures)` and `base_delay(failures) * (1 + jitter)`.
    pub fn delay(&self, failures: u32) -> Duration {
        let base = self.base_delay(failures);
        if self.jitter <= 0.0 {
            return base;
        }
        let f: f64 = rand::random::<f64>() * self.jitter;
        base.mul_f64(1.0 + f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ladder_is_the_original_steps_then_doubles_to_cap() {
        let p = RetryPolicy::default();
        let mins = |m: u64| Duration::from_secs(m * 60);
        let got: Vec<_> = (1..=10).map(|n| p.base_delay(n)).collect();
        assert_eq!(
            got,
            vec![
                mins(1),
                mins(5),
                mins(15),
                mins(60),
                mins(120),
                mins(240),
                mins(480),
                mins(960),
                mins(1440),
                mins(1440)
            ]
        );
        assert_eq!(p.base_delay(1000), RetryPolicy::DEFAULT_CAP);
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = RetryPolicy::default();
        for n in 1..=12 {
            for _ in 0..50 {
                let d = p.delay(n);
                let b = p.base_delay(n);
                assert!(d >= b && d <= b.mul_f64(1.1) + Duration::from_nanos(1), "{d:?} vs {b:?}");
            }
        }
        let exact = RetryPolicy::default().jitter(0.0);
        assert_eq!(exact.delay(2), Duration::from_secs(300));
    }

    #[test]
    fn schedule_repeats_last_step_and_rejects_bad_input() {
        let p = RetryPolicy::schedule(vec![Duration::from_millis(50), Duration::from_millis(200)]).unwrap();
        assert_eq!(p.base_delay(1), Duration::from_millis(50));
        assert_eq!(p.base_delay(2), Duration::from_millis(200));
        assert_eq!(p.base_delay(9), Duration::from_millis(200));
        assert!(RetryPolicy::schedule(vec![]).is_err());
        assert!(RetryPolicy::schedule(vec![Duration::ZERO]).is_err());
    }
}

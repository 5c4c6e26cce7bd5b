//! The retry timer: wakes the drain loop when the earliest failed event is
//! due again (`next_retry_at`, read with the database's clock as seconds
//! from now, so the relay's clock never decides).
//!
//! The earliest retry time is read at the end of a drain (and armed from
//! every written failure). A drain woken by a notification or a poll reads
//! it again only when the last read is [`RETRY_READ_GAP`] old: at 1 000
//! wake-ups per second the read would otherwise be a third of the drain
//! session's round trips. A skipped read is made up that long after the
//! last one, so a retry written by another session is armed at most that
//! much later.

use std::time::Duration;

use tokio::time::Instant;

use super::wake::Wake;

/// Shortest time between two reads of the earliest retry for drains woken
/// by notifications or polls: 100 ms.
pub(super) const RETRY_READ_GAP: Duration = Duration::from_millis(100);
/// The timer fires this much after the retry time, so the database's
/// `now()` has passed it when the fetch runs.
const LATE: Duration = Duration::from_millis(5);

/// The retry timer's state.
#[derive(Debug, Default)]
pub(super) struct RetryTimer {
    /// When the earliest known retry is due.
    at: Option<Instant>,
    /// When the earliest retry was last read.
    read_at: Option<Instant>,
    /// A skipped read is made up at this time.
    read_due: Option<Instant>,
}

impl RetryTimer {
    /// When the timer fires, if armed.
    pub(super) fn at(&self) -> Option<Instant> {
        self.at
    }

    /// When a skipped read is made up, if one was skipped.
    pub(super) fn read_due(&self) -> Option<Instant> {
        self.read_due
    }

    /// Should a drain started by `reason`, ending at `now`, read the
    /// earliest retry time? `false` puts the read off (see [`Self::read_due`]).
    pub(super) fn read_now(&mut self, reason: Wake, now: Instant) -> bool {
        let recent = self.read_at.is_some_and(|t| now.saturating_duration_since(t) < RETRY_READ_GAP);
        if matches!(reason, Wake::Notification | Wake::Recheck) && recent {
            if self.read_due.is_none() {
                self.read_due = self.read_at.map(|t| t + RETRY_READ_GAP);
            }
            return false;
        }
        self.read_at = Some(now);
        self.read_due = None;
        true
    }

    /// A retry is due `secs` seconds after `now` (the database's clock): arm
    /// the timer unless it fires earlier already.
    pub(super) fn arm(&mut self, secs: f64, now: Instant) {
        let at = now + crate::store::secs_to_duration(secs) + LATE;
        self.at = Some(match self.at {
            Some(cur) if cur < at => cur,
            _ => at,
        });
    }

    /// The timer fired. It held only the earliest retry: the next read is
    /// not put off.
    pub(super) fn fired(&mut self) {
        self.at = None;
        self.read_at = None;
    }

    /// The time of a put-off read came: the next read is not put off.
    pub(super) fn read_due_fired(&mut self) {
        self.read_due = None;
        self.read_at = None;
    }

    /// The session was lost: the next read is not put off.
    pub(super) fn session_lost(&mut self) {
        self.read_at = None;
        self.read_due = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_for_notification_drains_are_spaced_and_made_up() {
        let t0 = Instant::now();
        let mut r = RetryTimer::default();
        assert!(r.read_now(Wake::Notification, t0));
        let soon = t0 + Duration::from_millis(10);
        assert!(!r.read_now(Wake::Notification, soon));
        assert_eq!(r.read_due(), Some(t0 + RETRY_READ_GAP));
        assert!(r.read_now(Wake::Sweep, soon), "other drains always read");
        assert_eq!(r.read_due(), None);
        assert!(!r.read_now(Wake::Recheck, soon));
        r.read_due_fired();
        assert!(r.read_now(Wake::Recheck, soon));
        assert!(r.read_now(Wake::Notification, t0 + RETRY_READ_GAP * 2));
    }

    #[test]
    fn the_timer_keeps_the_earliest_retry() {
        let t0 = Instant::now();
        let mut r = RetryTimer::default();
        r.arm(2.0, t0);
        r.arm(5.0, t0);
        assert_eq!(r.at(), Some(t0 + Duration::from_secs(2) + LATE));
        r.arm(0.5, t0);
        assert_eq!(r.at(), Some(t0 + Duration::from_millis(500) + LATE));
        r.read_now(Wake::Notification, t0);
        r.fired();
        assert_eq!(r.at(), None);
        assert!(r.read_now(Wake::Notification, t0), "after firing, the next read is not put off");
    }
}

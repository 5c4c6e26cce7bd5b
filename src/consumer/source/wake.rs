//! The wake-up policy: when the drain loop fetches, and whether this relay
//! asks producers for notifications (idle) or polls and spares them NOTIFY
//! (busy).
//!
//! A pure state machine over event counts and clock readings: the loop
//! tells it what happened (a wake-up, a fetch's count, a look at NOTIFY's
//! lock queue) with the time, and carries out what it answers (write the
//! relay's waiting flag, read the earliest retry, fetch again). It runs no
//! SQL, so its rules are unit-tested with a synthetic clock below.
//!
//! The rules, in the order the loop meets them:
//! - Busy: from [`BUSY_EVENTS_PER_WINDOW`] events per [`RATE_WINDOW`], or a
//!   fetch of [`BUSY_FETCH_EVENTS`] or more while waiting, or producers seen
//!   queueing on NOTIFY's commit lock ([`NOTIFY_QUEUE_WAITERS`] waiters,
//!   [`NOTIFY_QUEUE_CHECKS`] looks in a row). A busy relay polls every
//!   [`BUSY_POLL`] after an empty fetch and producers skip NOTIFY.
//! - Idle: under [`IDLE_EVENTS_PER_WINDOW`] in both the current and the
//!   last window (and past the [`NOTIFY_QUEUE_BUSY_HOLD`]): the relay asks
//!   for notifications again, looks once more at once, then after each of
//!   [`RECHECKS`].
//! - While waiting, a fetch that returns less than a batch ends the drain:
//!   whatever commits later notifies.
//!
//! Why these figures: docs/performance.md, "The wake-up policy".

use std::time::Duration;

use tokio::time::Instant;

/// The relay counts the events it fetches per window of this length.
pub(super) const RATE_WINDOW: Duration = Duration::from_millis(100);
/// Busy from 300 events per window (3 000 events/s) ...
pub(super) const BUSY_EVENTS_PER_WINDOW: u64 = 300;
/// ... until fewer than 150 per window (1 500 events/s) in the current and
/// the last window.
pub(super) const IDLE_EVENTS_PER_WINDOW: u64 = 150;
/// A fetch that finds this many events while the relay waits for
/// notifications means producers commit faster than wake-ups are served:
/// go busy at once.
pub(super) const BUSY_FETCH_EVENTS: u64 = 8;
/// While waiting and fetching at least this many events per window (500
/// events/s), the relay looks (at most once per window) whether producers
/// queue for NOTIFY's commit lock.
pub(super) const NOTIFY_QUEUE_CHECK_EVENTS: u64 = 50;
/// This many waiters on NOTIFY's commit lock ...
pub(super) const NOTIFY_QUEUE_WAITERS: i64 = 2;
/// ... seen in this many looks in a row make the relay go busy.
pub(super) const NOTIFY_QUEUE_CHECKS: u8 = 2;
/// After the NOTIFY-queue rule turned the relay busy, it stays busy at
/// least this long (the queue's own rate is under the idle rate).
pub(super) const NOTIFY_QUEUE_BUSY_HOLD: Duration = Duration::from_millis(200);
/// While busy, an empty fetch is followed by another after this long.
pub(super) const BUSY_POLL: Duration = Duration::from_millis(1);
/// After asking for notifications again, the relay looks once more after
/// each of these delays, for events whose producers decided not to notify
/// just before the request became visible and were still committing.
/// Anything later still is found by the sweep.
pub(super) const RECHECKS: [Duration; 5] = [
    Duration::from_millis(2),
    Duration::from_millis(10),
    Duration::from_millis(50),
    Duration::from_millis(200),
    Duration::from_millis(500),
];

/// What started the current drain; events fetched are counted per reason
/// (`outbox_events_fetched_total{wake=...}`), so a healthy relay shows most
/// events found by notifications and few by the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    Start,
    Notification,
    Sweep,
    Retry,
    Reconnect,
    Release,
    Ownership,
    Recheck,
}

impl Wake {
    /// The `wake` label of `outbox_events_fetched_total`.
    pub(super) fn label(self) -> &'static str {
        match self {
            Wake::Start => "start",
            Wake::Notification => "notification",
            Wake::Sweep => "sweep",
            Wake::Retry => "retry",
            Wake::Reconnect => "reconnect",
            Wake::Release => "release",
            Wake::Ownership => "ownership",
            Wake::Recheck => "poll",
        }
    }
}

/// What the loop does after a fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AfterFetch {
    /// Write the relay's waiting flag (`events.outbox_relays.waiting`).
    pub(super) set_waiting: Option<bool>,
    /// Read the earliest retry time (the drain is over for now).
    pub(super) read_retry: bool,
}

/// What a fetch found.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fetched {
    /// Events handed to the stream.
    pub(super) handed: u64,
    /// The fetch returned a whole batch.
    pub(super) full: bool,
    /// A competing-mode claim transaction is open.
    pub(super) claiming: bool,
    /// The consumer is stopping.
    pub(super) stopping: bool,
}

/// The wake-up policy's state.
#[derive(Debug)]
pub(super) struct WakePolicy {
    /// Busy/idle switching applies (LISTEN on, not competing mode).
    adaptive: bool,
    listen: bool,
    want_fetch: bool,
    reason: Wake,
    /// The relay's row says it waits for notifications.
    waiting: bool,
    /// The relay has a row in `events.outbox_relays`.
    registered: bool,
    window_start: Instant,
    window_events: u64,
    last_window_events: u64,
    recheck_at: Option<Instant>,
    rechecks_left: u8,
    queue_checked_at: Option<Instant>,
    queue_seen: u8,
    busy_hold_until: Option<Instant>,
    /// The last look at NOTIFY's lock queue says: go busy.
    queue_busy: bool,
}

impl WakePolicy {
    /// A policy for a consumer with LISTEN on or off, in competing mode or
    /// not; its first drain starts at once.
    pub(super) fn new(listen: bool, competing: bool, now: Instant) -> Self {
        WakePolicy {
            adaptive: listen && !competing,
            listen,
            want_fetch: true,
            reason: Wake::Start,
            waiting: false,
            registered: false,
            window_start: now,
            window_events: 0,
            last_window_events: 0,
            recheck_at: None,
            rechecks_left: 0,
            queue_checked_at: None,
            queue_seen: 0,
            busy_hold_until: None,
            queue_busy: false,
        }
    }

    /// Start (or continue) a drain; a drain already wanted keeps its reason.
    pub(super) fn wake(&mut self, reason: Wake) {
        if !self.want_fetch {
            self.reason = reason;
        }
        self.want_fetch = true;
    }

    /// Does the loop want to fetch?
    pub(super) fn wants_fetch(&self) -> bool {
        self.want_fetch
    }

    /// What started the current drain.
    pub(super) fn reason(&self) -> Wake {
        self.reason
    }

    /// Stopping: no more fetches.
    pub(super) fn stop(&mut self) {
        self.want_fetch = false;
    }

    /// When to poll or look once more, if at all.
    pub(super) fn recheck_at(&self) -> Option<Instant> {
        self.recheck_at
    }

    /// The recheck time came.
    pub(super) fn recheck_due(&mut self) {
        self.recheck_at = None;
        self.wake(Wake::Recheck);
    }

    /// The fallback sweep fired. While polling (busy, or looking again after
    /// going idle) it finds nothing a poll would not: it counts as a poll.
    pub(super) fn sweep_due(&mut self) {
        self.wake(if self.recheck_at.is_some() { Wake::Recheck } else { Wake::Sweep });
    }

    /// The relay's waiting flag was written.
    pub(super) fn registered(&mut self, waiting: bool) {
        self.waiting = waiting;
        self.registered = true;
        // A new row of looks starts from a changed state.
        self.queue_seen = 0;
    }

    /// The session is gone, and its registration with it as far as this
    /// policy knows.
    pub(super) fn session_lost(&mut self) {
        self.waiting = false;
        self.registered = false;
        self.queue_seen = 0;
        self.busy_hold_until = None;
    }

    /// A new session is open: register again, and drain (notifications may
    /// have been missed).
    pub(super) fn session_opened(&mut self) {
        self.waiting = false;
        self.registered = false;
        self.wake(Wake::Reconnect);
    }

    /// `handed` events were fetched at `now`.
    pub(super) fn count(&mut self, now: Instant, handed: u64) {
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed >= RATE_WINDOW * 2 {
            self.last_window_events = 0;
            self.window_events = 0;
            self.window_start = now;
        } else if elapsed >= RATE_WINDOW {
            self.last_window_events = self.window_events;
            self.window_events = 0;
            self.window_start += RATE_WINDOW;
        }
        self.window_events += handed;
    }

    /// After [`Self::count`]: should the loop look at NOTIFY's lock queue
    /// before deciding (then report with [`Self::queue_looked`])? Only while
    /// waiting, when no other busy rule decides already, at
    /// [`NOTIFY_QUEUE_CHECK_EVENTS`] per window or more, at most once per
    /// window; a look two windows or more after the last starts a new row.
    pub(super) fn wants_queue_look(&mut self, now: Instant, handed: u64) -> bool {
        if !(self.adaptive && self.registered && self.waiting && handed > 0)
            || self.busy_rate()
            || handed >= BUSY_FETCH_EVENTS
        {
            return false;
        }
        if self.window_events.max(self.last_window_events) < NOTIFY_QUEUE_CHECK_EVENTS {
            self.queue_seen = 0;
            return false;
        }
        match self.queue_checked_at.map(|t| now.saturating_duration_since(t)) {
            Some(e) if e < RATE_WINDOW => return false,
            Some(e) if e >= RATE_WINDOW * 2 => self.queue_seen = 0,
            _ => {}
        }
        self.queue_checked_at = Some(now);
        true
    }

    /// The look found `waiters` producers queueing on NOTIFY's commit lock
    /// (0 when the look failed).
    pub(super) fn queue_looked(&mut self, now: Instant, waiters: i64) {
        if waiters < NOTIFY_QUEUE_WAITERS {
            self.queue_seen = 0;
            return;
        }
        self.queue_seen += 1;
        if self.queue_seen >= NOTIFY_QUEUE_CHECKS {
            self.busy_hold_until = Some(now + NOTIFY_QUEUE_BUSY_HOLD);
            self.queue_busy = true;
            tracing::debug!(waiters, "producers queue for NOTIFY's commit lock; polling instead");
        }
    }

    /// A fetch ended (after [`Self::count`]): what next.
    pub(super) fn after_fetch(&mut self, now: Instant, f: Fetched) -> AfterFetch {
        let queue_busy = std::mem::take(&mut self.queue_busy);
        if f.handed > 0 {
            return self.after_events(now, f, queue_busy);
        }
        if f.full {
            // Every row of a full result was skipped (stopping): look again.
            self.want_fetch = true;
            return AfterFetch { set_waiting: None, read_retry: false };
        }
        self.want_fetch = false;
        let mut set_waiting = None;
        if !self.listen && !self.registered && !f.claiming {
            set_waiting = Some(false);
        }
        let held = self.busy_hold_until.is_some_and(|t| now < t);
        if self.adaptive && !self.waiting && self.idle_rate() && !held {
            // Idle: ask for notifications again, then look once more at once
            // and after each of the rechecks.
            set_waiting = Some(true);
            self.want_fetch = true;
            self.rechecks_left = RECHECKS.len() as u8;
        } else if self.adaptive && !self.waiting {
            // Busy and nothing right now: poll again in a moment.
            self.recheck_at = Some(now + BUSY_POLL);
        } else {
            self.next_recheck(now);
        }
        AfterFetch { set_waiting, read_retry: !f.claiming }
    }

    fn after_events(&mut self, now: Instant, f: Fetched, queue_busy: bool) -> AfterFetch {
        // Keep fetching until a fetch finds nothing.
        self.want_fetch = true;
        let busy = self.busy_rate() || f.handed >= BUSY_FETCH_EVENTS || queue_busy;
        let mut set_waiting = None;
        if self.adaptive && (!self.registered || (self.waiting && busy)) {
            // Draining at a high rate: poll, and spare producers NOTIFY.
            self.rechecks_left = 0;
            self.recheck_at = None;
            set_waiting = Some(false);
        } else if !self.listen && !self.registered {
            // Sweep-only: never ask producers to notify (nobody listens).
            set_waiting = Some(false);
        }
        let waiting = self.waiting && set_waiting.is_none();
        if self.adaptive && waiting && !f.full && !f.claiming && !f.stopping {
            // Still waiting, and the fetch returned less than a batch: it
            // took every event due when it ran, and whatever commits later
            // notifies (its producer reads the hint after this relay asked
            // for notifications). The drain is done without a fetch that
            // finds nothing.
            self.want_fetch = false;
            self.next_recheck(now);
            return AfterFetch { set_waiting, read_retry: true };
        }
        AfterFetch { set_waiting, read_retry: false }
    }

    /// After going idle, a drain that ended schedules the next recheck, if
    /// any is left.
    fn next_recheck(&mut self, now: Instant) {
        if self.rechecks_left > 0 {
            let i = RECHECKS.len() - usize::from(self.rechecks_left);
            self.rechecks_left -= 1;
            self.recheck_at = Some(now + RECHECKS[i]);
        }
    }

    fn busy_rate(&self) -> bool {
        self.window_events >= BUSY_EVENTS_PER_WINDOW || self.last_window_events >= BUSY_EVENTS_PER_WINDOW
    }

    fn idle_rate(&self) -> bool {
        self.window_events < IDLE_EVENTS_PER_WINDOW && self.last_window_events < IDLE_EVENTS_PER_WINDOW
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn fetched(handed: u64, full: bool) -> Fetched {
        Fetched { handed, full, claiming: false, stopping: false }
    }

    /// A fetch at `now` that handed out `handed` events (no queue look).
    fn fetch(p: &mut WakePolicy, now: Instant, handed: u64, full: bool) -> AfterFetch {
        p.count(now, handed);
        p.after_fetch(now, fetched(handed, full))
    }

    /// A registered policy waiting for notifications.
    fn waiting_policy(t0: Instant) -> WakePolicy {
        let mut p = WakePolicy::new(true, false, t0);
        p.registered(true);
        p
    }

    #[test]
    fn first_events_register_the_relay_as_busy_then_idle_after_an_empty_fetch() {
        let t0 = Instant::now();
        let mut p = WakePolicy::new(true, false, t0);
        assert!(p.wants_fetch());
        assert_eq!(p.reason(), Wake::Start);
        let a = fetch(&mut p, t0, 3, false);
        assert_eq!(a, AfterFetch { set_waiting: Some(false), read_retry: false });
        p.registered(false);
        assert!(p.wants_fetch(), "keeps fetching until a fetch finds nothing");
        let a = fetch(&mut p, t0 + MS, 0, false);
        assert_eq!(a, AfterFetch { set_waiting: Some(true), read_retry: true }, "idle rate: ask for notifications");
        p.registered(true);
        assert!(p.wants_fetch(), "looks once more at once");
        // The looks after going idle follow the recheck ladder.
        let mut now = t0 + 2 * MS;
        for delay in RECHECKS {
            let a = fetch(&mut p, now, 0, false);
            assert_eq!(a, AfterFetch { set_waiting: None, read_retry: true });
            assert!(!p.wants_fetch());
            assert_eq!(p.recheck_at(), Some(now + delay));
            now += delay;
            p.recheck_due();
            assert_eq!(p.reason(), Wake::Recheck);
        }
        fetch(&mut p, now, 0, false);
        assert_eq!(p.recheck_at(), None, "after the last recheck only notifications and the sweep wake it");
    }

    #[test]
    fn a_small_fetch_while_waiting_ends_the_drain_without_an_empty_fetch() {
        let t0 = Instant::now();
        let mut p = waiting_policy(t0);
        p.wake(Wake::Notification);
        assert_eq!(p.reason(), Wake::Start, "a wanted drain keeps its reason");
        let a = fetch(&mut p, t0, 2, false);
        assert_eq!(a, AfterFetch { set_waiting: None, read_retry: true });
        assert!(!p.wants_fetch());
        p.wake(Wake::Notification);
        assert_eq!(p.reason(), Wake::Notification);
        // A full batch keeps the drain going even while waiting.
        let a = fetch(&mut p, t0 + MS, 5, true);
        assert_eq!(a, AfterFetch { set_waiting: None, read_retry: false });
        assert!(p.wants_fetch());
    }

    #[test]
    fn the_rate_turns_the_relay_busy_and_back_idle_after_two_quiet_windows() {
        let t0 = Instant::now();
        let mut p = waiting_policy(t0);
        // 7 events per fetch (under the one-fetch rule) until 300 in a window.
        let mut now = t0;
        let mut went_busy = None;
        for i in 0..60u32 {
            now = t0 + MS * i;
            let a = fetch(&mut p, now, 7, false);
            if a.set_waiting == Some(false) {
                went_busy = Some(i);
                break;
            }
        }
        assert_eq!(went_busy, Some(42), "busy at the fetch that reaches 300 events in the window");
        p.registered(false);
        // Busy and empty: poll again after BUSY_POLL, and stay busy while
        // the last window was busy.
        let a = fetch(&mut p, now + MS, 0, false);
        assert_eq!(a, AfterFetch { set_waiting: None, read_retry: true });
        assert_eq!(p.recheck_at(), Some(now + MS + BUSY_POLL));
        let later = t0 + RATE_WINDOW + MS * 5;
        fetch(&mut p, later, 0, false);
        assert_eq!(p.recheck_at(), Some(later + BUSY_POLL), "the last window was busy");
        let quiet = t0 + RATE_WINDOW * 3;
        let a = fetch(&mut p, quiet, 0, false);
        assert_eq!(a.set_waiting, Some(true), "two quiet windows: idle");
    }

    #[test]
    fn one_large_fetch_while_waiting_turns_the_relay_busy() {
        let t0 = Instant::now();
        let mut p = waiting_policy(t0);
        let a = fetch(&mut p, t0, BUSY_FETCH_EVENTS, false);
        assert_eq!(a, AfterFetch { set_waiting: Some(false), read_retry: false });
        assert!(p.wants_fetch());
    }

    #[test]
    fn a_notify_queue_seen_twice_in_a_row_turns_the_relay_busy_and_holds_it() {
        let t0 = Instant::now();
        let mut p = waiting_policy(t0);
        // 6 events per fetch: under every other busy rule.
        let mut now = t0;
        for _ in 0..9 {
            p.count(now, 6);
            now += MS;
        }
        p.count(now, 6);
        assert!(p.wants_queue_look(now, 6), "54 events in the window: look");
        p.queue_looked(now, NOTIFY_QUEUE_WAITERS);
        assert_eq!(p.after_fetch(now, fetched(6, false)).set_waiting, None, "one look is not enough");
        p.count(now + MS, 6);
        assert!(!p.wants_queue_look(now + MS, 6), "at most one look per window");
        let next = now + RATE_WINDOW;
        p.count(next, 6);
        assert!(p.wants_queue_look(next, 6));
        p.queue_looked(next, NOTIFY_QUEUE_WAITERS + 3);
        assert_eq!(p.after_fetch(next, fetched(6, false)).set_waiting, Some(false), "two looks in a row: busy");
        p.registered(false);
        // Quiet windows, but the hold keeps it busy ...
        let quiet = next + NOTIFY_QUEUE_BUSY_HOLD - MS;
        p.count(quiet, 0);
        assert!(p.idle_rate(), "two quiet windows");
        let a = p.after_fetch(quiet, fetched(0, false));
        assert_eq!(a.set_waiting, None, "held busy");
        // ... until it ends.
        let after = next + NOTIFY_QUEUE_BUSY_HOLD + MS;
        p.count(after, 0);
        assert_eq!(p.after_fetch(after, fetched(0, false)).set_waiting, Some(true));
    }

    #[test]
    fn a_queue_look_with_few_waiters_or_a_gap_restarts_the_row() {
        let t0 = Instant::now();
        let mut p = waiting_policy(t0);
        p.count(t0, 60);
        // 60 events in one fetch is over BUSY_FETCH_EVENTS: no look needed.
        assert!(!p.wants_queue_look(t0, 60));
        p.count(t0, 0);
        assert!(p.wants_queue_look(t0, 1));
        p.queue_looked(t0, NOTIFY_QUEUE_WAITERS);
        // Two windows later the row starts again: one more look is not enough.
        let later = t0 + RATE_WINDOW * 2;
        p.count(later, 60);
        assert!(p.wants_queue_look(later, 1));
        p.queue_looked(later, NOTIFY_QUEUE_WAITERS);
        assert_eq!(p.after_fetch(later, fetched(1, false)).set_waiting, None);
        p.queue_looked(later, 1);
        p.queue_looked(later, NOTIFY_QUEUE_WAITERS);
        assert_eq!(p.after_fetch(later, fetched(1, false)).set_waiting, None, "too few waiters restarted the row");
        p.queue_looked(later, NOTIFY_QUEUE_WAITERS);
        assert_eq!(p.after_fetch(later, fetched(1, false)).set_waiting, Some(false));
    }

    #[test]
    fn sweep_only_and_competing_consumers_never_ask_for_notifications() {
        let t0 = Instant::now();
        let mut sweep_only = WakePolicy::new(false, false, t0);
        assert_eq!(fetch(&mut sweep_only, t0, 0, false).set_waiting, Some(false));
        sweep_only.registered(false);
        assert_eq!(fetch(&mut sweep_only, t0 + MS, 0, false).set_waiting, None);
        let mut competing = WakePolicy::new(true, true, t0);
        let claim = Fetched { handed: 0, full: false, claiming: true, stopping: false };
        assert_eq!(competing.after_fetch(t0, claim), AfterFetch { set_waiting: None, read_retry: false });
        assert_eq!(fetch(&mut competing, t0, 900, true).set_waiting, None);
    }

    #[test]
    fn a_sweep_while_polling_counts_as_a_poll_and_a_lost_session_forgets_registration() {
        let t0 = Instant::now();
        let mut p = waiting_policy(t0);
        fetch(&mut p, t0, BUSY_EVENTS_PER_WINDOW, false);
        p.registered(false);
        fetch(&mut p, t0 + MS, 0, false);
        assert!(p.recheck_at().is_some());
        p.sweep_due();
        assert_eq!(p.reason(), Wake::Recheck);
        p.session_lost();
        p.session_opened();
        assert!(p.wants_fetch());
        let a = fetch(&mut p, t0 + RATE_WINDOW * 3, 1, false);
        assert_eq!(a.set_waiting, Some(false), "registers again on the new session");
    }
}

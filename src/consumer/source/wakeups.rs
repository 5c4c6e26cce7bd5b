//! Wake-ups, shared by the sources that fetch from the table: the
//! notifier's signals, the fallback sweep, the retry timer
//! ([`super::retry_timer`]), the wake-up policy ([`super::wake`]) and the
//! relay's registration in `events.outbox_relays` (whether it waits for
//! notifications; producers read it, `triggers/outbox_relays_refresh_hint.sql`).
//!
//! The policy is a pure state machine; this service carries out what it
//! answers (write the waiting flag, look at NOTIFY's lock queue, read the
//! earliest retry) on the work session.

use std::time::Duration;

use tokio::time::Instant;

use super::retry_timer::RetryTimer;
use super::wake::{Fetched, Wake, WakePolicy};
use super::{Cx, Signals, jittered};
use crate::consumer::ConsumerConfig;
use crate::consumer::completer::Written;
use crate::metrics as m;
use crate::store::statement::{self, Failure, StatementError};

/// The wake-up state of a source.
#[derive(Debug)]
pub(super) struct Wakeups {
    policy: WakePolicy,
    retry: RetryTimer,
    signals: Signals,
    sweep_at: Instant,
    sweep_interval: Duration,
    /// A failed look at `pg_locks` was logged as a warning (once).
    queue_look_warned: bool,
}

/// The earliest of two times.
pub(super) fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `at` is set and has come.
pub(super) fn due(at: Option<Instant>, now: Instant) -> bool {
    at.is_some_and(|t| t <= now)
}

impl Wakeups {
    /// Wake-ups for a consumer configured by `cfg`, woken by `signals`; in
    /// competing mode (`competing`) the policy never switches to polling.
    /// The first drain starts at once.
    pub(super) fn new(cfg: &ConsumerConfig, signals: Signals, competing: bool) -> Self {
        let now = Instant::now();
        Wakeups {
            policy: WakePolicy::new(cfg.listen, competing, now),
            retry: RetryTimer::default(),
            signals,
            sweep_at: now + jittered(cfg.sweep_interval),
            sweep_interval: cfg.sweep_interval,
            queue_look_warned: false,
        }
    }

    pub(super) fn wants_fetch(&self) -> bool {
        self.policy.wants_fetch()
    }

    pub(super) fn label(&self) -> &'static str {
        self.policy.reason().label()
    }

    pub(super) fn wake(&mut self, reason: Wake) {
        self.policy.wake(reason);
    }

    pub(super) fn stop(&mut self) {
        self.policy.stop();
    }

    /// A notification, or the LISTEN session opened again.
    pub(super) async fn signalled(&self) -> Wake {
        tokio::select! {
            biased;
            _ = self.signals.notification.notified() => Wake::Notification,
            _ = self.signals.reconnected.notified() => Wake::Reconnect,
        }
    }

    /// The next of the sweep, the retry timer, a put-off read of the
    /// earliest retry (sessions open, no claim open: `in_tx`) and a
    /// recheck (not while stopping).
    pub(super) fn next_timer(&self, open: bool, stopping: bool, in_tx: bool) -> Option<Instant> {
        let read_due = self.retry.read_due().filter(|_| open && !in_tx);
        let recheck = self.policy.recheck_at().filter(|_| !stopping);
        earliest(earliest(Some(self.sweep_at), self.retry.at()), earliest(read_due, recheck))
    }

    /// Fire the timers due now (the same conditions as [`Self::next_timer`]).
    pub(super) async fn timers_due(
        &mut self,
        cx: Option<Cx<'_>>,
        stopping: bool,
        in_tx: bool,
    ) -> Result<(), StatementError> {
        let now = Instant::now();
        if self.sweep_at <= now {
            metrics::counter!(m::SWEEPS).increment(1);
            self.policy.sweep_due();
            self.sweep_at = Instant::now() + jittered(self.sweep_interval);
        }
        if due(self.retry.at(), now) {
            self.retry.fired();
            self.policy.wake(Wake::Retry);
        }
        if let Some(cx) = cx
            && !in_tx
            && due(self.retry.read_due(), now)
        {
            self.retry.read_due_fired();
            self.read_retry_time(cx).await?;
        }
        if !stopping && due(self.policy.recheck_at(), now) {
            self.policy.recheck_due();
        }
        Ok(())
    }

    /// Carry out what the wake-up policy says after a fetch that handed
    /// out `handed` events (`full`: more may be due; `in_tx`: a claim is
    /// open).
    pub(super) async fn fetched(
        &mut self,
        cx: Cx<'_>,
        handed: u64,
        full: bool,
        in_tx: bool,
    ) -> Result<(), StatementError> {
        let now = Instant::now();
        self.policy.count(now, handed);
        // A failed look gives the sessions up, but the policy still decides
        // (its statements then wait for new sessions).
        let mut looked = Ok(());
        if self.policy.wants_queue_look(now, handed) {
            match self.notify_lock_waiters(cx).await {
                Ok(waiters) => self.policy.queue_looked(now, waiters),
                Err(e) => looked = Err(e),
            }
        }
        let fetched = Fetched { handed, full, claiming: in_tx, stopping: cx.stopping() };
        let next = self.policy.after_fetch(now, fetched);
        looked?;
        if let Some(waiting) = next.set_waiting {
            cx.work.set_waiting(waiting, cx.stop()).await?;
            metrics::gauge!(m::WAITING_FOR_NOTIFICATIONS).set(if waiting { 1.0 } else { 0.0 });
            self.policy.registered(waiting);
        }
        if next.read_retry {
            self.read_retry_time(cx).await?;
        }
        Ok(())
    }

    /// How many producers wait on NOTIFY's commit lock (0 when `pg_locks`
    /// cannot be read: warned once, then at debug level).
    async fn notify_lock_waiters(&mut self, cx: Cx<'_>) -> Result<i64, StatementError> {
        match cx.work.notify_lock_waiters(cx.stop()).await {
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                let error = crate::error::report(&e);
                if self.queue_look_warned {
                    tracing::debug!(error = %error, "could not count NOTIFY's lock waiters");
                } else {
                    self.queue_look_warned = true;
                    tracing::warn!(error = %error,
                        "could not read pg_locks: producers queueing for NOTIFY's commit lock go unnoticed \
                         (the other busy rules still apply)");
                }
                Ok(0)
            }
            r => r,
        }
    }

    /// Arm the retry timer for the earliest `next_retry_at`, unless the
    /// retry timer puts the read off.
    async fn read_retry_time(&mut self, cx: Cx<'_>) -> Result<(), StatementError> {
        if !self.retry.read_now(self.policy.reason(), Instant::now()) {
            return Ok(());
        }
        if let Some(secs) = cx.work.next_retry_in(cx.stop()).await? {
            self.retry.arm(secs, Instant::now());
        }
        Ok(())
    }

    /// A write's failures scheduled retries: arm the timer for the earliest.
    pub(super) fn written(&mut self, w: &Written) {
        if let Some(secs) = w.earliest_retry {
            self.retry.arm(secs, Instant::now());
        }
    }

    /// New sessions: register again, and drain (notifications may have been
    /// missed).
    pub(super) fn session_opened(&mut self) {
        self.policy.session_opened();
    }

    /// The sessions are gone, and the registration with them.
    pub(super) fn session_lost(&mut self) {
        self.policy.session_lost();
        self.retry.session_lost();
    }

    /// Remove this relay's registration, giving up at `deadline`. A database
    /// error or timeout is logged; a stop is returned.
    pub(super) async fn unregister(cx: Cx<'_>, deadline: Instant) -> Result<(), StatementError> {
        match cx.work.unregister(tokio::time::sleep_until(deadline)).await {
            Ok(()) => Ok(()),
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                tracing::debug!(error = %crate::error::report(&e), "could not unregister for wake-ups");
                Ok(())
            }
            Err(StatementError { kind, failure: Failure::TimedOut(e) }) => {
                statement::record_timeout(kind, cx.work.timeout(), &e, None);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

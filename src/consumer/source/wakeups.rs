//! Wake-ups, the engine's "when to fetch", shared by every wake-up kind
//! ([`WakeKind`]: NOTIFY's or the WAL stream's): the signals, the fallback
//! sweep, the retry timer ([`super::retry_timer`]), the wake-up policy
//! ([`super::wake`]) and the relay's registration in
//! `events.outbox_relays` (whether it waits for notifications; producers
//! read it, `triggers/outbox_relays_refresh_hint.sql`).
//!
//! The policy is a pure state machine; this service carries out what it
//! answers (write the waiting flag, look at NOTIFY's lock queue, read the
//! earliest retry) on the work session. `in_tx` in its methods: the fetch
//! holds a claim transaction open ([`super::Fetch::holds_transaction`]).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::retry_timer::RetryTimer;
use super::wake::{Fetched, Wake, WakePolicy};
use super::{Cx, Leadership, Signals, WakeKind, jittered};
use crate::consumer::ConsumerConfig;
use crate::consumer::completer::Written;
use crate::metrics as m;
use crate::store::statement::{self, Failure, StatementError};

/// The wake-up state of a consumer, woken as its kind `K` says.
#[derive(Debug)]
pub(in crate::consumer) struct Wakeups<K> {
    kind: K,
    policy: WakePolicy,
    retry: RetryTimer,
    signals: Signals,
    sweep_at: Instant,
    sweep_interval: Duration,
    /// A failed look at `pg_locks` was logged as a warning (once).
    queue_look_warned: bool,
}

/// The earliest of two times.
pub(in crate::consumer) fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `at` is set and has come.
pub(in crate::consumer) fn due(at: Option<Instant>, now: Instant) -> bool {
    at.is_some_and(|t| t <= now)
}

impl<K: WakeKind> Wakeups<K> {
    /// Wake-ups of kind `kind` for a consumer configured by `cfg`, woken by
    /// `signals`; in competing mode (`competing`) the policy never switches
    /// to polling. The first drain starts at once.
    pub(in crate::consumer) fn new(cfg: &ConsumerConfig, signals: Signals, competing: bool, kind: K) -> Self {
        let now = Instant::now();
        Wakeups {
            kind,
            policy: WakePolicy::new(cfg.listen, competing, now),
            retry: RetryTimer::default(),
            signals,
            sweep_at: now + jittered(cfg.sweep_interval),
            sweep_interval: cfg.sweep_interval,
            queue_look_warned: false,
        }
    }

    /// Does a wake-up want a fetch now? The engine adds its own conditions
    /// (sessions open, room) and the fetch's (its leadership may fetch, no
    /// transaction held).
    pub(in crate::consumer) fn wants_fetch(&self) -> bool {
        self.policy.wants_fetch()
    }

    /// What started the current drain: the `wake` label of
    /// `outbox_events_fetched_total`.
    pub(in crate::consumer) fn label(&self) -> &'static str {
        self.policy.reason().label()
    }

    /// A wake-up: from [`Self::signalled`], or the engine's (a release, a
    /// retried event's acknowledgement written, leadership taken).
    pub(in crate::consumer) fn woken(&mut self, reason: Wake) {
        self.kind.woken(reason);
        self.policy.wake(reason);
    }

    /// The consumer stops: no more fetches.
    pub(in crate::consumer) fn stop(&mut self) {
        self.kind.stop();
        self.policy.stop();
    }

    /// Resolves on a wake-up from outside the loop (a notification, or the
    /// LISTEN session or the stream opened again); hand it to
    /// [`Self::woken`].
    /// It borrows the signals alone (the kind need not be `Sync`).
    pub(in crate::consumer) fn signalled(&self) -> impl Future<Output = Wake> + Send + '_ {
        let signals = &self.signals;
        async move {
            tokio::select! {
                biased;
                _ = signals.notification.notified() => Wake::Notification,
                _ = signals.reconnected.notified() => Wake::Reconnect,
            }
        }
    }

    /// The next of the sweep, the retry timer, a put-off read of the
    /// earliest retry (sessions open, no claim open: `in_tx`), a recheck
    /// (not while stopping) and a look of the kind's own.
    pub(in crate::consumer) fn next_timer(&self, open: bool, stopping: bool, in_tx: bool) -> Option<Instant> {
        let read_due = self.retry.read_due().filter(|_| open && !in_tx);
        let recheck = self.policy.recheck_at().filter(|_| !stopping);
        let timers = earliest(earliest(Some(self.sweep_at), self.retry.at()), earliest(read_due, recheck));
        earliest(timers, self.kind.next_look(open, stopping))
    }

    /// Fire the timers due now (the same conditions as [`Self::next_timer`];
    /// `cx`: `None` while the sessions are closed).
    pub(in crate::consumer) async fn timers_due(
        &mut self,
        cx: Option<Cx<'_>>,
        stopping: bool,
        in_tx: bool,
    ) -> Result<(), StatementError> {
        let now = Instant::now();
        if cx.is_some() && !stopping && self.kind.look_due(now) {
            self.policy.wake(Wake::Recheck);
        }
        if self.sweep_at <= now {
            crate::metrics::counter!(m::SWEEPS).increment(1);
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
    /// out `handed` events (`full`: it returned a whole batch, or the byte
    /// budget cut it, so more may be due; `in_tx`: a claim is open).
    pub(in crate::consumer) async fn fetched(
        &mut self,
        cx: Cx<'_>,
        handed: u64,
        full: bool,
        in_tx: bool,
    ) -> Result<(), StatementError> {
        self.kind.fetched(handed);
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
            crate::metrics::gauge!(m::WAITING_FOR_NOTIFICATIONS).set(if waiting { 1.0 } else { 0.0 });
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
    pub(in crate::consumer) fn written(&mut self, w: &Written) {
        if let Some(secs) = w.earliest_retry {
            self.retry.arm(secs, Instant::now());
        }
    }

    /// New sessions: register again, and drain (notifications may have been
    /// missed).
    pub(in crate::consumer) fn session_opened(&mut self) {
        self.kind.session_opened();
        self.policy.session_opened();
    }

    /// The sessions are gone, and the registration with them.
    pub(in crate::consumer) fn session_lost(&mut self) {
        self.kind.session_lost();
        self.policy.session_lost();
        self.retry.session_lost();
    }

    /// The leadership may have changed (its timers ran): tell the kind.
    pub(in crate::consumer) fn led(&mut self, leader: &impl Leadership) {
        self.kind.led(leader);
    }

    /// The last statement before the sessions close: remove this relay's
    /// registration, giving up at `deadline`. A database error or timeout
    /// is logged; a stop is returned.
    pub(in crate::consumer) async fn finish(&mut self, cx: Cx<'_>, deadline: Instant) -> Result<(), StatementError> {
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

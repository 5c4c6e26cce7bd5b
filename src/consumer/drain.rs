//! The drain loop: one task that waits for what can happen next and hands
//! each to the service that owns it.
//!
//! ```text
//! wake-ups (notification, sweep, retry timer, reconnect, release, recheck,
//! locks taken)
//!     -> WakePolicy says fetch -> Ownership says which rows -> Fetcher
//!     -> the stream's buffer -> user code settles -> Completer writes
//!     -> the write's outcome: HoldBack released, RetryTimer armed
//! ```
//!
//! The services, each a file of this module with its own state:
//! [`Sessions`] (the work and writer sessions, reconnecting), [`Fetcher`]
//! (fetches and the events handed out), [`super::holdback`] (per-aggregate
//! hold-back), [`Completer`] (acknowledgements and failures, written in
//! batches), [`Ownership`] (what this consumer may fetch, by mode),
//! [`WakePolicy`] (when to fetch; busy or idle), [`RetryTimer`] (the
//! earliest retry), [`Maintenance`] (registration, gauges).
//!
//! Why one task: a write's outcome is taken in by the loop between two
//! fetches, and fetches are awaited by the loop, so a fetch issued after a
//! write completed sees it. That keeps per-aggregate hold-back exact
//! without locks between services. Writes run on the writer session in a
//! task of their own while the loop goes on fetching, so the database
//! updates one batch while the next is fetched, decoded and delivered (on
//! two cores this is what lets a consumer drain faster than a
//! fetch-then-update loop); at most one is in flight, and while two batches
//! are unwritten the loop fetches nothing ([`Completer::behind`]). Nor does
//! it while the payloads handed out and not settled reach the byte bound
//! ([`Fetcher::bytes_allow_fetch`]); each fetch asks for what the bound
//! leaves.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::error::SendError;
use tokio::sync::{Notify, mpsc};
use tokio::time::{Instant, Sleep, sleep, sleep_until};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::completer::{Completer, FlushDone};
use super::delivery::Settlement;
use super::fetcher::Fetcher;
use super::health;
use super::maintenance::Maintenance;
use super::ownership::Ownership;
use super::retry_timer::RetryTimer;
use super::session::{OpenError, Sessions};
use super::statement::{self, Failure, Kind, StatementError};
use super::wake::{Fetched, Wake, WakePolicy};
use super::{ConsumerConfig, Delivery, Mode, STATUS_INTERVAL, Shared};
use crate::connect::Link;
use crate::error::Error;
use crate::metrics as m;
use crate::store;

/// What the loop waits on, apart from its services' timers.
pub(crate) struct Io {
    /// The stream's buffer.
    pub(crate) tx: mpsc::Sender<Delivery>,
    /// Settlements from deliveries.
    pub(crate) settle_rx: mpsc::UnboundedReceiver<Settlement>,
    /// A notification arrived.
    pub(crate) wake: Arc<Notify>,
    /// The LISTEN session was opened again (notifications may be lost).
    pub(crate) reconnect_wake: Arc<Notify>,
}

/// At most this many settlements are taken in per turn of the loop.
const SETTLEMENTS_PER_TURN: usize = 10_000;

/// `d` plus up to 10 %, so consumers started together spread out.
pub(super) fn jittered(d: Duration) -> Duration {
    d.mul_f64(1.0 + rand::random::<f64>() * 0.1)
}

/// Resolves when `token` is cancelled; never without one.
async fn cancelled(token: Option<&CancellationToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// Run the drain loop until `token` is cancelled and the handed-out
/// deliveries are settled (or the shutdown grace ran out), then write the
/// last settlements. `first` is the connection `start` opened.
pub(crate) async fn run(
    cfg: Arc<ConsumerConfig>,
    first: (Client, Link),
    io: Io,
    shared: Arc<Shared>,
    token: CancellationToken,
    health: Arc<health::State>,
) {
    /// Marks the loop ended however it ends (a panic included).
    struct Ended(Arc<health::State>);
    impl Drop for Ended {
        fn drop(&mut self) {
            self.0.ended();
        }
    }
    let _ended = Ended(health.clone());
    health.turned();
    let (done_tx, done_rx) = mpsc::unbounded_channel();
    let waiting = shared.clone();
    let engine = Engine {
        sessions: Sessions::new(first, cfg.reconnect_max_delay),
        fetcher: Fetcher::new(shared, cfg.batch_size, cfg.max_buffered_bytes),
        completer: Completer::new(&cfg, done_tx),
        ownership: Ownership::new(cfg.mode),
        policy: WakePolicy::new(cfg.listen, matches!(cfg.mode, Mode::Competing), Instant::now()),
        retry: RetryTimer::default(),
        maintenance: Maintenance::default(),
        cfg,
        token,
        stop_deadline: None,
        health,
    };
    engine.run(io, done_rx, &waiting.reader_waiting).await
}

struct Engine {
    cfg: Arc<ConsumerConfig>,
    token: CancellationToken,
    /// Set once stopping: the loop ends then, or when nothing is handed out.
    stop_deadline: Option<Instant>,
    sessions: Sessions,
    fetcher: Fetcher,
    completer: Completer,
    ownership: Ownership,
    policy: WakePolicy,
    retry: RetryTimer,
    maintenance: Maintenance,
    /// Where each turn, the sessions' state, the role and errors are told.
    health: Arc<health::State>,
}

impl Engine {
    /// `reader_waiting`: the stream's reader found the buffer empty.
    async fn run(mut self, io: Io, mut done_rx: mpsc::UnboundedReceiver<FlushDone>, reader_waiting: &Notify) {
        let Io { tx, mut settle_rx, wake, reconnect_wake } = io;
        let token = self.token.clone();
        let sweep = sleep(jittered(self.cfg.sweep_interval));
        tokio::pin!(sweep);
        let mut status_tick = tokio::time::interval(STATUS_INTERVAL);
        status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Timers not armed wait for a time so far away it never comes (every
        // branch's future is built, armed or not).
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        let until = |t: Option<Instant>| t.unwrap_or(far);
        while !self.stop_reached() {
            self.health.turned();
            if self.sessions.is_open() && self.completer.batch_ready() {
                self.start_write();
            }
            let stopping = self.stop_deadline.is_some();
            let open = self.sessions.is_open();
            let buffer_empty = tx.capacity() == tx.max_capacity();
            let can_fetch = !stopping
                && open
                && self.policy.wants_fetch()
                && self.ownership.may_fetch()
                && !self.completer.behind()
                && self.fetcher.bytes_allow_fetch(buffer_empty);
            // Held payloads between half the bound and the bound: a fetch
            // waits for half of it to be freed, or for the reader to empty
            // the buffer (then it waits with deliveries unsettled).
            let bytes_wait = !stopping && !buffer_empty && self.fetcher.waits_for_empty_buffer();
            let writing = self.completer.is_writing();
            let (flush_at, retry_read_due) = (self.completer.flush_at(), self.retry.read_due());
            let (recheck_at, lock_at) = (self.policy.recheck_at(), self.ownership.lock_at());
            // Notice a lost session at once, not at the next query: its locks
            // are gone, and what it buffered must not be handed out.
            let (closed, writer_closed) = self.sessions.conn().map(|c| c.closed()).unzip();
            let (closed, writer_closed) = (closed, writer_closed.flatten());
            tokio::select! {
                biased;
                _ = cancelled(closed.as_ref()), if closed.is_some() => self.connection_closed("drain"),
                _ = cancelled(writer_closed.as_ref()), if writer_closed.is_some() => self.connection_closed("writer"),
                Some(done) = done_rx.recv() => self.written(done).await,
                _ = token.cancelled(), if !stopping => {}
                Some(s) = settle_rx.recv() => self.take_settlements(s, &mut settle_rx),
                _ = sleep_until(until(flush_at)), if flush_at.is_some() && open && !writing => self.flush_timer().await,
                _ = sleep_until(until(self.sessions.reconnect_at())), if !open => self.reconnect(token.cancelled()).await,
                permit = tx.reserve_many(self.fetcher.batch()), if can_fetch => self.fetch(permit).await,
                _ = wake.notified(), if !stopping => self.policy.wake(Wake::Notification),
                _ = reader_waiting.notified(), if bytes_wait => {}
                _ = reconnect_wake.notified(), if !stopping => self.policy.wake(Wake::Reconnect),
                _ = &mut sweep => self.sweep(sweep.as_mut()),
                _ = sleep_until(until(self.retry.at())), if self.retry.at().is_some() => self.retry_due(),
                _ = sleep_until(until(retry_read_due)), if retry_read_due.is_some() && open && !self.ownership.claiming() => {
                    self.retry_read_due().await
                }
                _ = sleep_until(until(recheck_at)), if recheck_at.is_some() && !stopping => self.policy.recheck_due(),
                _ = sleep_until(until(lock_at)), if lock_at.is_some() && open && !stopping => self.take_locks().await,
                _ = status_tick.tick(), if open && !stopping => self.maintain().await,
                _ = tx.closed(), if !stopping => token.cancel(),
                _ = sleep_until(until(self.stop_deadline)), if stopping => {}
            }
        }
        self.final_flush(&mut done_rx).await;
    }

    /// Start stopping once the token is cancelled; the loop ends when
    /// nothing handed out is left or the shutdown grace ran out.
    fn stop_reached(&mut self) -> bool {
        if self.token.is_cancelled() && self.stop_deadline.is_none() {
            self.stop_deadline = Some(Instant::now() + self.cfg.shutdown_grace);
            self.health.stopping();
            self.policy.stop();
            tracing::debug!(
                outstanding = self.fetcher.outstanding(),
                held_bytes = self.fetcher.held_bytes(),
                "drain loop stopping"
            );
        }
        self.stop_deadline.is_some_and(|d| self.fetcher.outstanding() == 0 || Instant::now() >= d)
    }

    /// Take in settlements: `first`, then whatever else is queued (up to
    /// [`SETTLEMENTS_PER_TURN`]).
    fn take_settlements(&mut self, first: Settlement, rx: &mut mpsc::UnboundedReceiver<Settlement>) {
        self.settle(first);
        for _ in 0..SETTLEMENTS_PER_TURN {
            match rx.try_recv() {
                Ok(s) => self.settle(s),
                Err(_) => break,
            }
        }
        self.fetcher.record_held();
    }

    fn settle(&mut self, s: Settlement) {
        match s {
            Settlement::Ack { id } => {
                self.fetcher.settled(id);
                self.completer.ack(id);
            }
            Settlement::Fail { id, key, retry_count, error } => {
                self.fetcher.settled(id);
                self.completer.fail(id, key, retry_count, error);
            }
            Settlement::Release { id, key } => {
                metrics::counter!(m::EVENTS_RELEASED).increment(1);
                self.fetcher.released(id, &key);
                self.ownership.done(id);
                self.policy.wake(Wake::Release);
            }
        }
        if self.ownership.claiming() && self.fetcher.outstanding() == 0 {
            // Competing mode: the whole claimed batch is settled; write and commit.
            self.completer.flush_now();
        }
    }

    /// Fetch into the reserved buffer slots (`Err`: the stream was dropped).
    async fn fetch(&mut self, permit: std::result::Result<mpsc::PermitIterator<'_, Delivery>, SendError<()>>) {
        let Ok(permit) = permit else { return self.token.cancel() };
        let Some(conn) = self.sessions.conn() else { return };
        let scope = self.ownership.scope();
        let budget = self.fetcher.budget();
        let fetched = match self.fetcher.query(conn, scope, (&self.completer, budget), self.token.cancelled()).await {
            Ok(fetched) => fetched,
            Err(e) => {
                drop(permit);
                return self.db_error(e);
            }
        };
        // A fetch the byte budget cut counts as full: more may be due (the
        // wake-up policy ends a drain at a fetch of less than a batch).
        let full = fetched.len() >= self.fetcher.batch() || fetched.cut;
        let handed = self.fetcher.hand_out(fetched, permit, &self.token, &mut self.ownership, &mut self.completer);
        self.fetcher.record_held();
        metrics::counter!(m::EVENTS_FETCHED, "wake" => self.policy.reason().label()).increment(handed);
        self.after_fetch(handed, full).await;
    }

    /// Carry out what the wake-up policy says after a fetch.
    async fn after_fetch(&mut self, handed: u64, full: bool) {
        if self.ownership.claiming() && handed == 0 {
            // Nothing claimed: close the claim transaction at once.
            self.completer.flush_now();
        }
        let now = Instant::now();
        self.policy.count(now, handed);
        if self.policy.wants_queue_look(now, handed) {
            self.look_at_notify_queue(now).await;
        }
        let fetched =
            Fetched { handed, full, claiming: self.ownership.claiming(), stopping: self.token.is_cancelled() };
        let next = self.policy.after_fetch(now, fetched);
        if let Some(waiting) = next.set_waiting {
            self.set_waiting(waiting).await;
        }
        if next.read_retry {
            self.read_retry_time().await;
        }
    }

    async fn look_at_notify_queue(&mut self, now: Instant) {
        let Some(conn) = self.sessions.conn() else { return };
        match self.maintenance.notify_lock_waiters(conn, &self.token).await {
            Ok(waiters) => self.policy.queue_looked(now, waiters),
            Err(e) => self.db_error(e),
        }
    }

    /// Say in `events.outbox_relays` whether this relay waits for wake-ups.
    async fn set_waiting(&mut self, waiting: bool) {
        let Some(conn) = self.sessions.conn() else { return };
        match self.maintenance.set_waiting(conn, &self.token, waiting).await {
            Ok(()) => self.policy.registered(waiting),
            Err(e) => self.db_error(e),
        }
    }

    /// Arm the retry timer for the earliest `next_retry_at`, unless the
    /// retry timer puts the read off.
    async fn read_retry_time(&mut self) {
        let Some(conn) = self.sessions.conn() else { return };
        if !self.retry.read_now(self.policy.reason(), Instant::now()) {
            return;
        }
        let read = conn.client.query_one(&conn.next_retry, &[]);
        match conn.run(Kind::NextRetryRead, self.token.cancelled(), read).await {
            Ok(row) => match row.try_get::<_, Option<f64>>("retry_in") {
                Ok(Some(secs)) => self.retry.arm(secs, Instant::now()),
                Ok(None) => {}
                Err(e) => self.db_error(StatementError::db(Kind::NextRetryRead, e)),
            },
            Err(e) => self.db_error(e),
        }
    }

    async fn retry_read_due(&mut self) {
        self.retry.read_due_fired();
        self.read_retry_time().await;
    }

    fn retry_due(&mut self) {
        self.retry.fired();
        self.policy.wake(Wake::Retry);
    }

    fn sweep(&mut self, timer: Pin<&mut Sleep>) {
        metrics::counter!(m::SWEEPS).increment(1);
        self.policy.sweep_due();
        timer.reset(Instant::now() + jittered(self.cfg.sweep_interval));
    }

    async fn take_locks(&mut self) {
        let Some(conn) = self.sessions.conn() else { return };
        match self.ownership.take_locks(conn, self.token.cancelled()).await {
            Ok(true) => self.policy.wake(Wake::Ownership),
            Ok(false) => {}
            Err(e) => self.db_error(e),
        }
        self.health.role(self.ownership.role());
    }

    async fn maintain(&mut self) {
        let Some(conn) = self.sessions.conn() else { return };
        if let Err(e) = self.maintenance.refresh(conn, &self.token).await {
            self.db_error(e);
        }
    }

    /// The flush timer fired: write what is pending, or, in competing mode
    /// with nothing to write, end a claim transaction whose batch is settled.
    async fn flush_timer(&mut self) {
        if self.completer.pending() > 0 {
            return self.start_write();
        }
        self.completer.disarm();
        if self.ownership.claiming() && self.fetcher.outstanding() == 0 {
            self.commit_claim().await;
        }
    }

    fn start_write(&mut self) {
        match self.sessions.conn() {
            Some(conn) => self.completer.start(conn, self.sessions.generation()),
            None => self.completer.disarm(),
        }
    }

    /// Take in a write's outcome: hold-back released, retry timer armed,
    /// partitions freed; an error on the current sessions gives them up.
    async fn written(&mut self, done: FlushDone) {
        let current = done.generation == self.sessions.generation() && self.sessions.is_open();
        let w = self.completer.finish(done);
        for id in w.acked.iter().chain(w.failed.iter().map(|(id, _)| id)) {
            self.ownership.done(*id);
        }
        if let Some(secs) = w.earliest_retry {
            self.retry.arm(secs, Instant::now());
        }
        // No fetch is in flight while this runs (fetches are awaited by this
        // same task), so every later fetch sees the failures.
        self.fetcher.failures_written(w.failed.iter().map(|(_, key)| key));
        if let Some(e) = w.error
            && current
        {
            self.db_error(e);
        }
        self.fetcher.forget_holdback();
        if self.ownership.claiming() && self.fetcher.outstanding() == 0 && self.completer.pending() == 0 {
            self.commit_claim().await;
        }
        if self.completer.pending() > 0 && self.sessions.is_open() {
            self.completer.arm();
        }
    }

    /// Competing mode: commit the claim transaction (its batch is settled).
    async fn commit_claim(&mut self) {
        let Some(conn) = self.sessions.conn() else { return };
        let commit = conn.client.batch_execute(store::COMMIT);
        match statement::run_to_end(Kind::ClaimCommit, &conn.session, conn.timeout, commit).await {
            Ok(()) => self.ownership.claim_ended(),
            Err(e) => self.db_error(e),
        }
    }

    /// Open the sessions (when `stop` resolves first, give up).
    async fn reconnect(&mut self, stop: impl std::future::Future<Output = ()>) {
        let member_key = self.ownership.new_member_key();
        match self.sessions.open(&self.cfg, member_key, stop).await {
            Ok(()) => {
                self.ownership.session_opened();
                self.health.connected(true);
                self.health.role(self.ownership.role());
                self.policy.session_opened();
                if self.completer.pending() > 0 {
                    self.completer.flush_now();
                }
            }
            Err(OpenError::Connect(e)) => self.connection_failed(&e),
            Err(OpenError::Statement(StatementError { failure: Failure::Db(e), .. })) => {
                self.connection_failed(&Error::Db(e))
            }
            Err(OpenError::Statement(e)) => self.db_error(e),
        }
    }

    fn connection_closed(&mut self, which: &str) {
        metrics::counter!(m::DATABASE_ERRORS).increment(1);
        let delay = self.sessions.next_delay();
        tracing::warn!(retry_in = ?delay, "{which} connection closed; reconnecting");
        self.health.error(format!("{which} connection closed"));
        self.lost_connection(delay);
    }

    fn connection_failed(&mut self, e: &Error) {
        metrics::counter!(m::DATABASE_ERRORS).increment(1);
        let delay = self.sessions.next_delay();
        let error = crate::error::report(e);
        tracing::warn!(error = %error, retry_in = ?delay, "drain connection failed; retrying");
        self.health.error(error);
        self.lost_connection(delay);
    }

    /// Give the sessions up and open them again after `delay`. Locks and
    /// claims went with them: another consumer may deliver what is buffered
    /// here, so none of it is handed out.
    fn lost_connection(&mut self, delay: Duration) {
        self.fetcher.session_lost();
        self.sessions.close(delay);
        self.policy.session_lost();
        self.retry.session_lost();
        self.ownership.session_lost();
        self.health.connected(false);
        self.health.role(self.ownership.role());
    }

    /// A statement failed: reconnect with backoff (a statement the timeout
    /// cut is logged and counted as such); one cancelled because the
    /// consumer is stopping just closes its sessions.
    fn db_error(&mut self, e: StatementError) {
        let StatementError { kind, failure } = e;
        let e = match failure {
            Failure::Stopped => {
                tracing::debug!(during = kind.describe(), "stopping: closing the sessions of a cancelled statement");
                return self.lost_connection(Duration::ZERO);
            }
            Failure::TimedOut(e) => {
                metrics::counter!(m::DATABASE_ERRORS).increment(1);
                let delay = self.sessions.next_delay();
                statement::record_timeout(kind, self.cfg.statement_timeout, &e, Some(delay));
                self.health.error(format!(
                    "statement timeout: the server cancelled a statement ({}) after {:?}",
                    kind.describe(),
                    self.cfg.statement_timeout
                ));
                return self.lost_connection(delay);
            }
            Failure::Db(e) => e,
        };
        metrics::counter!(m::DATABASE_ERRORS).increment(1);
        let delay = self.sessions.next_delay();
        let error = crate::error::report(&e);
        tracing::warn!(error = %error, during = kind.describe(), retry_in = ?delay,
            "database error in the drain loop; reconnecting");
        self.health.error(format!("{}: {error}", kind.describe()));
        self.lost_connection(delay);
    }

    /// Unregister and write the final settlements, within one shutdown
    /// grace: a statement still running then is cancelled. Whatever is still
    /// handed out is released by its `Drop` later.
    async fn final_flush(&mut self, done_rx: &mut mpsc::UnboundedReceiver<FlushDone>) {
        let deadline = Instant::now() + self.cfg.shutdown_grace;
        if let Some(conn) = self.sessions.conn()
            && let Err(e) = Maintenance::unregister(conn, deadline).await
        {
            self.db_error(e);
        }
        // A write per batch, and up to three more for writes that fail.
        for _ in 0..3 + self.completer.writes_needed() {
            if self.completer.is_writing() {
                match self.write_outcome(done_rx, deadline).await {
                    Some(done) => self.written(done).await,
                    None => break,
                }
            }
            if self.completer.pending() == 0 || Instant::now() >= deadline {
                break;
            }
            if !self.sessions.is_open() {
                self.reconnect(sleep_until(deadline)).await;
            }
            self.start_write();
            if self.completer.is_writing()
                && let Some(done) = self.write_outcome(done_rx, deadline).await
            {
                self.written(done).await;
            }
        }
        self.report_unwritten();
    }

    /// The outcome of the write in flight, waited for until `deadline`;
    /// then the write is cancelled and waited for a little longer (`None`
    /// if it still does not end: its events stay unpublished).
    async fn write_outcome(
        &self,
        done_rx: &mut mpsc::UnboundedReceiver<FlushDone>,
        deadline: Instant,
    ) -> Option<FlushDone> {
        if let Ok(done) = tokio::time::timeout_at(deadline, done_rx.recv()).await {
            return done;
        }
        tracing::warn!(grace = ?self.cfg.shutdown_grace,
            "the final settlements were not written within the shutdown grace; cancelling the write");
        if let Some(conn) = self.sessions.conn() {
            conn.writer_session.cancel().await;
        }
        tokio::time::timeout(statement::CANCELLED_WAIT, done_rx.recv()).await.ok().flatten()
    }

    fn report_unwritten(&self) {
        let (acks, fails) = self.completer.pending_counts();
        let unfinished = self.completer.writing();
        if acks + fails + unfinished > 0 {
            tracing::error!(
                acknowledgements = acks,
                failures = fails,
                unfinished,
                "could not write the final settlements; those events will be delivered again"
            );
        }
        if self.fetcher.outstanding() > 0 {
            tracing::warn!(
                deliveries = self.fetcher.outstanding(),
                "shutdown grace ran out with deliveries still open; they stay unpublished and will be delivered again"
            );
        }
    }
}

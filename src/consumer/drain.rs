//! The drain loop: one task, the engine every source shares. It waits for
//! what can happen next and hands each to the service that owns it.
//!
//! ```text
//! the wake-ups say fetch (signals, timers), and the leadership may
//!     -> the fetch fetches -> InFlight hands out into the stream's buffer
//!     -> user code settles -> Completer writes
//!     -> the write's outcome: HoldBack released, the fetch and wake-ups told
//! ```
//!
//! The engine's services, each a file of this module with its own state:
//! [`Sessions`] (the work and writer sessions, reconnecting), [`InFlight`]
//! (the events handed out, the byte bound, the fetch count),
//! [`super::holdback`] (per-aggregate hold-back), [`Completer`]
//! (acknowledgements and failures, written in batches), [`Maintenance`]
//! (gauges). Where events come from is the source (`super::source`): its
//! [`Wakeups`] of a [`WakeKind`], its [`Fetch`], and that fetch's
//! [`Leadership`].
//!
//! Why one task: a write's outcome is taken in by the loop between two
//! fetches, and fetches are awaited by the loop, so a fetch issued after a
//! write completed sees it. That keeps per-aggregate hold-back exact
//! without locks between services. Writes run on the writer session in a
//! task of their own while the loop goes on fetching, so the database
//! updates one batch while the next is fetched, decoded and delivered; at
//! most one is in flight, and while two batches are unwritten the loop
//! fetches nothing ([`Completer::behind`]). Nor does it while the payloads
//! handed out and not settled reach the byte bound
//! ([`InFlight::bytes_allow_fetch`]); each fetch asks for what the bound
//! leaves.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::sync::mpsc::error::SendError;
use tokio::time::{Instant, sleep_until};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::completer::{Completer, FlushDone};
use super::delivery::Settlement;
use super::health;
use super::inflight::InFlight;
use super::leadership::LEASE;
use super::maintenance::Maintenance;
use super::session::{OpenError, Sessions};
use super::source::{Cx, Fetch, Leadership, Room, Stop, TermCheck, Wake, WakeKind, Wakeups, due, earliest};
use super::{ConsumerConfig, Delivery, STATUS_INTERVAL, Shared};
use crate::connect::Link;
use crate::error::SubscriptionError;
use crate::metrics as m;
use crate::store::statement::{Failure, StatementError};

mod finish;
mod loss;

use loss::Loss;

/// What the loop exchanges with the stream.
pub(crate) struct Io {
    /// The stream's buffer.
    pub(crate) tx: mpsc::Sender<Delivery>,
    /// Settlements from deliveries.
    pub(crate) settle_rx: mpsc::UnboundedReceiver<Settlement>,
    /// What the loop and the deliveries share.
    pub(crate) shared: Arc<Shared>,
}

/// At most this many settlements are taken in per turn of the loop.
const SETTLEMENTS_PER_TURN: usize = 10_000;

/// Resolves at `at`; never without it.
async fn maybe_sleep(at: Option<Instant>) {
    maybe(at.map(sleep_until)).await
}

/// `f`'s output; never without it.
async fn maybe<F: Future>(f: Option<F>) -> F::Output {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Run the drain loop over the source of `wakeups` and `fetch` until
/// `token` is cancelled and the handed-out deliveries are settled (or the
/// shutdown grace ran out), then write the last settlements. `first` is
/// the connection `start` opened.
///
/// # Errors
/// What ended the consumer on its own: [`SubscriptionError::Unknown`] when
/// the named subscription it reads was dropped,
/// [`SubscriptionError::Expired`] when it expired. Every other error is
/// retried.
pub(crate) async fn run<K: WakeKind, F: Fetch>(
    cfg: Arc<ConsumerConfig>,
    (wakeups, fetch): (Wakeups<K>, F),
    first: (Client, Link),
    io: Io,
    token: CancellationToken,
    health: Arc<health::State>,
) -> crate::error::Result<()> {
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
    let Io { tx, settle_rx, shared } = io;
    let engine = Engine {
        sessions: Sessions::new(first, cfg.reconnect_max_delay),
        inflight: InFlight::new(shared.clone(), cfg.batch_size, cfg.max_buffered_bytes),
        completer: Completer::new(&cfg, done_tx),
        maintenance: Maintenance::new(
            cfg.heartbeat_interval().min(STATUS_INTERVAL),
            STATUS_INTERVAL,
            cfg.leads() || cfg.mode == crate::consumer::Mode::Competing,
            cfg.delivery_configuration(),
        ),
        wakeups,
        fetch,
        status_due: Instant::now(),
        cfg,
        token,
        stop_deadline: None,
        final_deadline: None,
        health,
        on_standby: None,
        shared: shared.clone(),
        lease_warned: None,
        fatal: None,
    };
    engine.run(tx, settle_rx, done_rx, &shared).await
}

struct Engine<K: WakeKind, F: Fetch> {
    cfg: Arc<ConsumerConfig>,
    token: CancellationToken,
    /// Set once stopping: the loop ends then, or when nothing is handed out.
    stop_deadline: Option<Instant>,
    /// Set for the final flush: statements give up then.
    final_deadline: Option<Instant>,
    sessions: Sessions,
    inflight: InFlight,
    completer: Completer,
    maintenance: Maintenance,
    /// When maintenance (the heartbeat, and the gauges when due) runs next.
    status_due: Instant,
    /// When to fetch.
    wakeups: Wakeups<K>,
    /// Which rows, under which leadership.
    fetch: F,
    /// Where each turn, the sessions' state, the role and errors are told.
    health: Arc<health::State>,
    /// Since when reconnects have found only a read-only standby (a
    /// failover under way): said once when it starts and once when it ends,
    /// not at every try.
    on_standby: Option<Instant>,
    /// What the loop shares with the stream and the deliveries (the
    /// hand-out lease).
    shared: Arc<Shared>,
    /// When a confirmation that came back after its lease was said last
    /// (said at most once a minute).
    lease_warned: Option<Instant>,
    /// What ends the consumer instead of a retry: its subscription was
    /// dropped ([`Engine::gone`]). Returned once the loop has stopped.
    fatal: Option<crate::error::Error>,
}

impl<K: WakeKind, F: Fetch> Engine<K, F> {
    async fn run(
        mut self,
        tx: mpsc::Sender<Delivery>,
        mut settle_rx: mpsc::UnboundedReceiver<Settlement>,
        mut done_rx: mpsc::UnboundedReceiver<FlushDone>,
        shared: &Shared,
    ) -> crate::error::Result<()> {
        let token = self.token.clone();
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
                && self.wakeups.wants_fetch()
                && self.fetch.leadership().may_fetch()
                && !self.fetch.holds_transaction()
                && !self.completer.behind()
                && self.inflight.bytes_allow_fetch(buffer_empty);
            // Held payloads between half the bound and the bound: a fetch
            // waits for half of it to be freed, or for the reader to empty
            // the buffer (then it waits with deliveries unsettled).
            let bytes_wait = !stopping && !buffer_empty && self.inflight.waits_for_empty_buffer();
            let engine_at = self.next_timer(open);
            let source_at = self.source_timer(open, stopping);
            // The source's timers and maintenance, last of all, share an arm.
            let later_at = earliest(source_at, Some(self.status_due).filter(|_| open));
            // Notice a lost session at once, not at the next query: its locks
            // are gone, and what it buffered must not be handed out.
            let closed = self.sessions.conn().map(|c| c.closed());
            tokio::select! {
                biased;
                which = maybe(closed), if open => self.lose(Loss::Closed(which)),
                Some(done) = done_rx.recv() => self.written(done).await,
                _ = stop_requested(&token, &tx), if !stopping => token.cancel(),
                Some(s) = settle_rx.recv() => self.take_settlements(s, &mut settle_rx),
                _ = maybe_sleep(engine_at) => self.timer_due().await,
                permit = tx.reserve_many(self.inflight.batch()), if can_fetch => self.fetch(permit).await,
                wake = self.wakeups.signalled(), if !stopping => self.wakeups.woken(wake),
                _ = shared.reader_waiting.notified(), if bytes_wait => {}
                _ = shared.lease.renewal_requested(), if open && !stopping => self.renew_lease().await,
                _ = maybe_sleep(later_at) => match source_at {
                    Some(at) if at <= Instant::now() => self.source_timers().await,
                    _ => self.maintain().await,
                },
            }
        }
        self.final_flush(&mut done_rx).await;
        self.fatal.map_or(Ok(()), Err)
    }

    /// The engine's next timer but the gauges': a write due (sessions
    /// open, none in flight), a reconnect (sessions closed), or the end of
    /// the shutdown grace.
    fn next_timer(&self, open: bool) -> Option<Instant> {
        let flush = self.completer.flush_at().filter(|_| open && !self.completer.is_writing());
        let reconnect = self.sessions.reconnect_at().filter(|_| !open);
        [flush, reconnect, self.stop_deadline].into_iter().flatten().min()
    }

    /// The engine's timer fired: carry out the first of its timers due.
    async fn timer_due(&mut self) {
        let now = Instant::now();
        let open = self.sessions.is_open();
        let due = |t: Option<Instant>| t.is_some_and(|t| t <= now);
        if open && !self.completer.is_writing() && due(self.completer.flush_at()) {
            self.flush_timer().await;
        } else if !open && due(self.sessions.reconnect_at()) {
            self.reconnect().await;
        }
        // Otherwise the shutdown grace ran out: the loop's condition ends it.
    }

    /// Start stopping once the token is cancelled; the loop ends when
    /// nothing handed out is left or the shutdown grace ran out.
    fn stop_reached(&mut self) -> bool {
        if self.token.is_cancelled() && self.stop_deadline.is_none() {
            self.stop_deadline = Some(Instant::now() + self.cfg.shutdown_grace);
            self.health.stopping();
            self.wakeups.stop();
            tracing::debug!(
                outstanding = self.inflight.outstanding(),
                held_bytes = self.inflight.held_bytes(),
                "drain loop stopping"
            );
        }
        self.stop_deadline.is_some_and(|d| self.inflight.outstanding() == 0 || Instant::now() >= d)
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
        self.inflight.record_held();
    }

    fn settle(&mut self, s: Settlement) {
        match s {
            Settlement::Ack { id } => {
                self.inflight.settled(id);
                self.completer.ack(id);
            }
            Settlement::Fail { id, key, retry_count, error } => {
                self.inflight.settled(id);
                self.completer.fail(id, key, retry_count, error);
            }
            Settlement::Release { id, key } => {
                crate::metrics::counter!(m::EVENTS_RELEASED).increment(1);
                self.inflight.released(id, &key);
                self.fetch.released(id);
                self.wakeups.woken(Wake::Release);
            }
        }
        if self.fetch.holds_transaction() && self.inflight.outstanding() == 0 {
            // What the fetch's transaction handed out is settled: write it.
            self.completer.flush_now();
        }
    }

    /// The wake-ups, the fetch, and the work session with the stop signal
    /// for them (`None` while the sessions are closed).
    fn source_cx(&mut self) -> (&mut Wakeups<K>, &mut F, Option<Cx<'_>>) {
        let stop = match self.final_deadline {
            Some(at) => Stop::At(at),
            None => Stop::Token(&self.token),
        };
        let cx = self.sessions.conn().map(|c| Cx { work: &c.work, stop });
        (&mut self.wakeups, &mut self.fetch, cx)
    }

    /// Fetch into the reserved buffer slots (`Err`: the stream was dropped).
    async fn fetch(&mut self, permit: std::result::Result<mpsc::PermitIterator<'_, Delivery>, SendError<()>>) {
        let Ok(permit) = permit else { return self.token.cancel() };
        let exclude = self.inflight.exclude(&self.completer);
        let room = Room { exclude: &exclude, batch: self.inflight.batch(), budget: self.inflight.budget() };
        let sent = Instant::now();
        let page = match self.source_cx() {
            (_, fetch, Some(cx)) => fetch.fetch(cx, room).await,
            (_, _, None) => return,
        };
        let page = match page {
            Ok(page) => page,
            Err(e) => {
                drop(permit);
                return self.lose(Loss::Statement(e));
            }
        };
        // The fetch read the current terms with its rows: hand them out
        // only under ours, within the lease from when the fetch was sent.
        match self.fetch.leadership().check_page(&page) {
            TermCheck::Unfenced => self.shared.lease.unfenced(),
            TermCheck::Unconfirmed => {}
            TermCheck::Confirmed => self.confirmed(sent),
            TermCheck::Superseded { term, current } => {
                drop(permit);
                return self.lose(Loss::Fenced { term, current });
            }
        }
        // A fetch the byte budget cut counts as full: more may be due (the
        // wake-up policy ends a drain at a fetch of less than a batch).
        let full = page.rows.len() >= self.inflight.batch() || page.cut;
        let fetch = &mut self.fetch;
        let settle = (&self.token, &mut self.completer);
        let handed = self.inflight.hand_out(page, permit, settle, |id, part| fetch.handed_out(id, part));
        self.inflight.record_held();
        crate::metrics::counter!(m::EVENTS_FETCHED, "wake" => self.wakeups.label()).increment(handed);
        let in_tx = self.fetch.holds_transaction();
        if handed == 0 && in_tx {
            // Nothing handed out: end the fetch's transaction at once.
            self.completer.flush_now();
        }
        let after = match self.source_cx() {
            (wakeups, _, Some(cx)) => wakeups.fetched(cx, handed, full, in_tx).await,
            (_, _, None) => Ok(()),
        };
        self.check(after);
    }

    /// The stream waits to hand a delivery out and the lease has run out:
    /// confirm that the term is still current, one statement for all that
    /// waits ([`super::lease`]).
    async fn renew_lease(&mut self) {
        if !self.fetch.leadership().fenced() {
            // No term held: a standby's buffer was released when it lost
            // its term.
            return;
        }
        let sent = Instant::now();
        let read = match self.source_cx() {
            (_, fetch, Some(cx)) => fetch.leadership().confirm_terms(cx).await,
            (_, _, None) => return,
        };
        match read {
            Ok(TermCheck::Confirmed) => self.confirmed(sent),
            Ok(TermCheck::Superseded { term, current }) => self.lose(Loss::Fenced { term, current }),
            Ok(TermCheck::Unfenced | TermCheck::Unconfirmed) => {}
            Err(e) => self.lose(Loss::Statement(e)),
        }
    }

    /// A statement sent at `sent` found the term current: the lease runs
    /// from then. One whose answer came back after the lease had already
    /// run out lets nothing out; said (log, health) at most once a minute,
    /// since nothing is handed out while every round trip is that long.
    fn confirmed(&mut self, sent: Instant) {
        self.shared.lease.confirm(sent);
        let round_trip = sent.elapsed();
        if round_trip < LEASE || self.lease_warned.is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
            return;
        }
        self.lease_warned = Some(Instant::now());
        tracing::warn!(round_trip = ?round_trip, lease = ?LEASE,
            "a statement confirming the leadership term came back after the hand-out lease had run out: nothing \
             fetched with it is handed out; while round trips to the database take this long, delivery stalls \
             (a slow network or an overloaded server)");
        self.health.error(format!(
            "round trip of {round_trip:?} to the database, longer than the {LEASE:?} hand-out lease: delivery stalls"
        ));
    }

    /// The source's next timer: the wake-ups' (`in_tx`: the fetch holds a
    /// transaction), or the leadership's next try for its locks (sessions
    /// open, not stopping).
    fn source_timer(&self, open: bool, stopping: bool) -> Option<Instant> {
        let wakeups = self.wakeups.next_timer(open, stopping, self.fetch.holds_transaction());
        earliest(wakeups, self.fetch.leadership().next_try().filter(|_| open && !stopping))
    }

    /// The source's timer fired: the wake-ups' timers due, then the
    /// leadership's try for its locks (a fetch when it may fetch more, and
    /// its role told); then the wake-ups hear of the leadership.
    async fn source_timers(&mut self) {
        let stopping = self.stop_deadline.is_some();
        let now = Instant::now();
        let in_tx = self.fetch.holds_transaction();
        let (wakeups, fetch, cx) = self.source_cx();
        let tried = async {
            wakeups.timers_due(cx, stopping, in_tx).await?;
            match cx.filter(|_| !stopping && due(fetch.leadership().next_try(), now)) {
                Some(cx) => fetch.leadership_mut().try_take(cx).await.map(Some),
                None => Ok(None),
            }
        }
        .await;
        self.wakeups.led(self.fetch.leadership());
        match tried {
            Ok(None) => {}
            Ok(Some(took)) => {
                if took {
                    self.wakeups.woken(Wake::Ownership);
                }
                self.health.role(self.fetch.leadership().role());
            }
            Err(e) => self.lose(Loss::Statement(e)),
        }
    }

    async fn maintain(&mut self) {
        let tick = Instant::now();
        self.status_due = tick + self.maintenance.every();
        let Some(conn) = self.sessions.conn() else { return };
        // While stopping, the heartbeat alone goes on, to the end of the
        // grace: a graceful stop longer than `stranded_after` must not
        // look stranded to a standby (which may end it, fencing its last
        // acknowledgements).
        let stop = match self.stop_deadline {
            Some(deadline) => Stop::At(deadline),
            None => Stop::Token(&self.token),
        };
        let only_heartbeat = self.stop_deadline.is_some();
        let r = self.maintenance.refresh(&conn.work, tick, || stop.wait(), only_heartbeat).await;
        self.check(r);
        if self.maintenance.own_expired() && self.fatal.is_none() {
            let name = self.cfg.reader.subscription().unwrap_or_default().to_string();
            self.end_with(SubscriptionError::Expired(name).into());
        }
        if let Some(conflict) = self.maintenance.conflict()
            && self.fatal.is_none()
        {
            tracing::error!(signal = "configuration_conflict", "{conflict}; this relay started last, so it stops");
            let e = crate::error::Error::Config(format!("{conflict}; this relay started last, so it stops"));
            self.end_with(e);
        }
    }

    /// The flush timer fired: write what is pending, or, with nothing to
    /// write, end a fetch's transaction whose deliveries are settled.
    async fn flush_timer(&mut self) {
        if self.completer.pending() > 0 {
            return self.start_write();
        }
        self.completer.disarm();
        self.end_transaction().await;
    }

    /// Everything handed out is settled and written: a fetch that holds a
    /// transaction ends it.
    async fn end_transaction(&mut self) {
        if !self.fetch.holds_transaction() || self.inflight.outstanding() > 0 || self.completer.pending() > 0 {
            return;
        }
        let r = match self.source_cx() {
            (_, fetch, Some(cx)) => fetch.settled(cx).await,
            (_, _, None) => Ok(()),
        };
        self.check(r);
    }

    fn start_write(&mut self) {
        match self.sessions.conn() {
            Some(conn) => {
                let leader = self.fetch.leadership();
                self.completer.start(&conn.writer, self.sessions.generation(), |ids| leader.fence_for(ids));
            }
            None => self.completer.disarm(),
        }
    }

    /// Take in a write's outcome: hold-back released, the fetch and the
    /// wake-ups told; an error on the current sessions gives them up.
    async fn written(&mut self, done: FlushDone) {
        let current = done.generation == self.sessions.generation() && self.sessions.is_open();
        let leader = self.fetch.leadership();
        let w = self.completer.finish(done, |ids| leader.fence_for(ids));
        if self.fetch.written(&w) {
            self.wakeups.woken(Wake::Retry);
        }
        self.wakeups.written(&w);
        // No fetch is in flight while this runs (fetches are awaited by this
        // same task), so every later fetch sees the failures.
        self.inflight.failures_written(w.failed.iter().map(|(_, key)| key));
        if let Some(e) = w.error
            && current
        {
            self.lose(Loss::Statement(e));
        } else if let Some(term) = w.fenced
            && current
            && self.fetch.leadership().fenced()
        {
            self.lose(Loss::Fenced { term, current: None });
        }
        self.inflight.forget_holdback();
        self.end_transaction().await;
        if self.completer.pending() > 0 && self.sessions.is_open() {
            self.completer.arm();
        }
    }

    /// Open the sessions and let the fetch take what it holds on them
    /// (giving up when the consumer stops, or at the final flush's
    /// deadline).
    async fn reconnect(&mut self) {
        let token = self.token.clone();
        let stop = match self.final_deadline {
            Some(at) => Stop::At(at),
            None => Stop::Token(&token),
        };
        if let Err(e) = self.sessions.open(&self.cfg, self.fetch.fetch_kind(), stop.wait()).await {
            return self.lose(match e {
                OpenError::Connect(e) => Loss::ConnectFailed(e),
                OpenError::Statement(e) => Loss::opening(e),
            });
        }
        let opened = match self.source_cx() {
            (_, fetch, Some(cx)) => fetch.session_opened(cx).await,
            (_, _, None) => Ok(()),
        };
        if let Err(e) = opened {
            return self.lose(Loss::opening(e));
        }
        self.wakeups.session_opened();
        self.sessions.ready();
        if let Some(since) = self.on_standby.take() {
            tracing::info!(signal = "writable", after = ?since.elapsed(), "a host accepts writes again (the standby was promoted): delivering");
        }
        self.health.connected(true);
        self.health.role(self.fetch.leadership().role());
        if self.completer.pending() > 0 {
            self.completer.flush_now();
        }
    }

    /// A statement's outcome: an error gives the sessions up.
    fn check(&mut self, r: Result<(), StatementError>) {
        if let Err(e) = r {
            self.lose(Loss::Statement(e));
        }
    }

    /// Give the sessions up and open them again after a backoff delay
    /// (at once when stopping cancelled a statement), saying why. Locks and
    /// claims went with them: another consumer may deliver what is buffered
    /// here, so none of it is handed out.
    fn lose(&mut self, loss: Loss) {
        // A dropped subscription ends the consumer: not a database error,
        // and nothing to reconnect for.
        let ended = self.gone(&loss);
        let described = if ended { None } else { self.describe_loss(loss) };
        let delay = match described {
            Some((error, delay)) => {
                crate::metrics::counter!(m::DATABASE_ERRORS).increment(1);
                self.health.error(error);
                delay
            }
            None => Duration::ZERO,
        };
        let had_term = self.fetch.leadership().fenced();
        self.inflight.session_lost();
        self.sessions.close(delay);
        self.wakeups.session_lost();
        self.fetch.session_lost();
        if had_term {
            // After the stale mark: a delivery waiting for the lease is
            // released when the stream looks again.
            self.shared.lease.revoke();
        }
        self.health.connected(false);
        self.health.role(self.fetch.leadership().role());
    }

    /// A named subscription's statement failed with SQLSTATE P0002 (its
    /// acknowledgement and failure functions' "subscription does not
    /// exist": migrations/0016_outbox_subscriptions.sql): it was dropped,
    /// so nothing it fetches can be settled. Stop (what is handed out is
    /// released with the sessions) and end with
    /// [`SubscriptionError::Unknown`], instead of reconnecting for ever.
    /// Returns whether it did.
    fn gone(&mut self, loss: &Loss) -> bool {
        let Some(name) = self.cfg.reader.subscription() else { return false };
        let Loss::Statement(StatementError { failure: Failure::Db(e), .. }) = loss else { return false };
        if e.code() != Some(&tokio_postgres::error::SqlState::NO_DATA_FOUND) {
            return false;
        }
        if self.fatal.is_some() {
            // Already ending (its drop found first by another statement,
            // or another cause): nothing more to say.
            return true;
        }
        tracing::error!(
            subscription = name,
            signal = "subscription_dropped",
            "subscription {name:?} was dropped (pg-outbox subscription drop): stopping; its events stay in \
             events.outbox, and nothing more is delivered or settled for it"
        );
        self.end_with(SubscriptionError::Unknown(name.to_string()).into());
        true
    }

    /// End the consumer with `e` (its subscription was dropped or
    /// expired, or an older relay runs another configuration): stop, and
    /// return `e` once stopped.
    fn end_with(&mut self, e: crate::error::Error) {
        self.health.error(e.to_string());
        self.fatal = Some(e);
        self.token.cancel();
    }

    /// Log a loss and return the error for the consumer's health with the
    /// reconnect delay drawn; `None` for a statement that stopping
    /// cancelled.
    fn describe_loss(&mut self, loss: Loss) -> Option<(String, Duration)> {
        if let Loss::Statement(StatementError { kind, failure: Failure::Stopped }) = &loss {
            tracing::debug!(during = kind.describe(), "stopping: closing the sessions of a cancelled statement");
            return None;
        }
        let delay = self.sessions.next_delay();
        loss.describe(delay, &mut self.on_standby, &self.cfg).map(|error| (error, delay))
    }
}

/// Resolves when the consumer is told to stop, or the stream was dropped.
async fn stop_requested(token: &CancellationToken, tx: &mpsc::Sender<Delivery>) {
    tokio::select! {
        _ = token.cancelled() => {}
        _ = tx.closed() => {}
    }
}

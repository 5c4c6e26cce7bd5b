//! The drain loop: one task that owns the work connection, fetches due
//! events, and writes acknowledgements and failures in batches.
//!
//! Writes go over a second session (the writer) while the loop goes on
//! fetching, so the database updates one batch while the next is fetched,
//! decoded and delivered: on two cores this is what lets a consumer drain
//! faster than a fetch-then-update loop. At most one write is in flight;
//! its ids are excluded from fetches until it is done. Its completion is
//! handled by the loop itself between fetches, so per-aggregate hold-back
//! stays exact: a fetch issued after a failure's write completed sees it,
//! and each failure's effect on earlier fetches is known by fetch number
//! (see [`super::Hold`]). In competing mode the writes stay on the work
//! session, inside the claim transaction.
//!
//! Wake-ups: a notification, the fallback sweep (jittered), the retry timer
//! (the earliest `next_retry_at`, read with the database's clock), a
//! reconnect of either connection, and a released delivery. A fetch takes
//! only as many rows as there is room for in the stream's buffer, and a full
//! batch is followed by another fetch as soon as there is room again, so a
//! backlog of any size is streamed, never loaded.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use tokio::sync::{Notify, mpsc};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;

use super::delivery::Settlement;
use super::statement::{self, Failure, Kind, Session, StatementError};
use super::{AggregateKey, ConsumerConfig, Delivery, Mode, STATUS_INTERVAL, Shared};
use crate::connect::Link;
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::store;

struct Conn {
    client: Arc<Client>,
    link: Link,
    /// The work session's cancel requests and statements in flight.
    session: Session,
    fetch: Statement,
    /// The session's membership lock key (partitioned mode).
    member_key: i32,
    next_retry: Statement,
    /// The session acknowledgements and failures are written on: a second
    /// session, or the work session itself in competing mode.
    writer: Arc<Client>,
    /// The second session's connection task (`None` in competing mode).
    writer_link: Option<Link>,
    /// The writer session's cancel requests and statements in flight (the
    /// work session's in competing mode).
    writer_session: Session,
    ack: Statement,
    fail: Statement,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The sessions are given up (an error, a lost connection, the end):
        // a statement of theirs still running is cancelled, so it does not
        // run on at the server after its session is closed here.
        if self.session.busy() {
            self.session.cancel_in_background();
        }
        if self.writer_link.is_some() && self.writer_session.busy() {
            self.writer_session.cancel_in_background();
        }
        self.link.handle.abort();
        if let Some(l) = &self.writer_link {
            l.handle.abort();
        }
    }
}

/// The outcome of one batched write, sent back to the loop.
struct FlushDone {
    /// The connection generation it was written on.
    generation: u64,
    acks: Vec<i64>,
    fails: Vec<PendingFail>,
    ack_res: std::result::Result<Vec<tokio_postgres::Row>, StatementError>,
    fail_res: std::result::Result<Vec<tokio_postgres::Row>, StatementError>,
}

struct PendingFail {
    id: i64,
    key: AggregateKey,
    error: String,
    delay: Duration,
    /// The row's retry_count when it was fetched: the write applies only if
    /// it is still that, so a failure replayed after a lost reply (the
    /// UPDATE committed, the connection died before the answer) is not
    /// counted twice.
    retry_count: i32,
}

/// What the select loop waits on; kept apart from the state it mutates.
struct Io {
    tx: mpsc::Sender<Delivery>,
    settle_rx: mpsc::UnboundedReceiver<Settlement>,
    wake: Arc<Notify>,
    reconnect_wake: Arc<Notify>,
}

/// What started the current drain; events fetched are counted per reason
/// (`outbox_events_fetched_total{wake=...}`), so a healthy relay shows most
/// events found by notifications and few by the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
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
    fn label(self) -> &'static str {
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

/// Advisory lock keys (PostgreSQL docs, "Advisory Locks"). Single mode takes
/// one bigint-keyed session lock; partitioned mode takes two-int4 locks: one
/// per partition under class `PARTITION_CLASS`, and one membership lock per
/// consumer under `MEMBER_CLASS`, whose count tells how many share the work.
const LEADER_KEY: i64 = 0x7067_6f75_7400_0001;
const PARTITION_CLASS: i32 = 0x706f_0001;
const MEMBER_CLASS: i32 = 0x706f_0002;
/// How often a standby tries to take over, and partitions are rebalanced.
const LOCK_INTERVAL: Duration = Duration::from_millis(250);
/// The relay measures how many events it fetches per window of this length
/// to decide whether it is busy (it polls, producers skip NOTIFY) or idle
/// (it sleeps, producers notify).
const RATE_WINDOW: Duration = Duration::from_millis(100);
/// Busy from 300 events per window (3 000 events/s) on ...
const BUSY_EVENTS_PER_WINDOW: u64 = 300;
/// ... until fewer than 150 per window (1 500 events/s). Below that, one
/// notification per producer transaction costs producers little, and it is
/// the fastest wake-up there is: polling every millisecond while busy
/// measured 2.5 ms p50 commit-to-delivery at 1 000 events/s against 0.5 ms
/// for a notification (`cargo bench --bench e2e -- latency`). Above it,
/// NOTIFY's commit lock (one for the whole server) would cost producers more than a
/// polling relay adds in latency.
const IDLE_EVENTS_PER_WINDOW: u64 = 150;
/// A fetch that finds this many events while the relay waits for wake-ups
/// means producers commit faster than wake-ups are served: their NOTIFYs
/// then queue on its commit lock (with 64 producer connections they held
/// the rate near 2 200 events/s, under [`BUSY_EVENTS_PER_WINDOW`], so the
/// rate alone never ended it). Go busy at once.
const BUSY_FETCH_EVENTS: u64 = 8;
/// While the relay waits for wake-ups and fetches at least this many events
/// per window (500 events/s), it looks (at most once per window) whether
/// producers queue for NOTIFY's commit lock ([`store::NOTIFY_LOCK_WAITERS`]).
/// Such a queue holds itself up: notifying commits run one at a time, each
/// with its WAL flush, so with 64 producer connections the rate settled at
/// about 1 200 events/s, under [`BUSY_EVENTS_PER_WINDOW`], and each wake-up
/// found only one or two events, under [`BUSY_FETCH_EVENTS`]: neither rule
/// ended it, for seconds.
const NOTIFY_QUEUE_CHECK_EVENTS: u64 = 50;
/// This many waiters on NOTIFY's lock (other producers, queued behind the
/// one committing), seen in [`NOTIFY_QUEUE_CHECKS`] checks in a row, make
/// the relay go busy. A queue that holds itself up stays for seconds. At
/// 1 000 events/s from 16 connections two waiters are seen now and then:
/// with one look enough, three 10 s pgbench runs turned the relay busy 3,
/// 2 and 5 times (each time costing latency, not helping producers); with
/// two in a row, 0, 0 and 2 times (and 0 and 0 in two runs without this
/// rule).
const NOTIFY_QUEUE_WAITERS: i64 = 2;
/// See [`NOTIFY_QUEUE_WAITERS`].
const NOTIFY_QUEUE_CHECKS: u8 = 2;
/// After the NOTIFY-queue rule turned the relay busy, it stays busy at least
/// this long: the queue's rate (about 1 200 events/s) is under the idle rate,
/// so the rate windows still holding it would otherwise send the relay back
/// to waiting at its first empty poll, and the queue would form again.
const NOTIFY_QUEUE_BUSY_HOLD: Duration = Duration::from_millis(200);
/// While busy, an empty fetch is followed by another after this long.
const BUSY_POLL: Duration = Duration::from_millis(1);
/// A drain woken by a notification or a poll reads the earliest retry time
/// again only if it last did longer ago than this: at 1 000 wake-ups/s the
/// read would otherwise be a third of the drain connection's round trips.
/// A skipped read is made up this long after the last one, so a retry
/// written by another session, or the next one after the retry timer fired,
/// is armed at most this much later.
const RETRY_READ_GAP: Duration = Duration::from_millis(100);
/// After a relay asks for wake-ups again, it looks once more after each of
/// these delays, for events whose producers decided not to notify just
/// before the request became visible and committed a little later (their
/// COMMIT's WAL flush). Anything later still is found by the sweep.
const RECHECKS: [Duration; 5] = [
    Duration::from_millis(2),
    Duration::from_millis(10),
    Duration::from_millis(50),
    Duration::from_millis(200),
    Duration::from_millis(500),
];

pub(crate) struct Engine {
    cfg: Arc<ConsumerConfig>,
    conn: Option<Conn>,
    first: Option<(Client, Link)>,
    io: Option<Io>,
    shared: Arc<Shared>,
    token: CancellationToken,
    /// Handed out (in the buffer or with user code), not settled: id -> fetch number.
    outstanding: HashMap<i64, u64>,
    acks: Vec<i64>,
    fails: Vec<PendingFail>,
    /// Ids of the write in flight, if one is: excluded from fetches.
    flushing: Option<Vec<i64>>,
    flush_tx: Option<mpsc::UnboundedSender<FlushDone>>,
    /// Counts connections made, so a write's outcome is tied to its session.
    generation: u64,
    fetch_seq: u64,
    want_fetch: bool,
    retry_at: Option<Instant>,
    /// When the earliest retry was last read (`store::NEXT_RETRY_IN`).
    retry_read_at: Option<Instant>,
    /// A skipped read of the earliest retry is made up at this time.
    retry_read_due: Option<Instant>,
    flush_at: Option<Instant>,
    reconnect_at: Option<Instant>,
    backoff: backon::ExponentialBackoff,
    reason: Wake,
    /// Single mode: this consumer holds the outbox lock.
    leader: bool,
    /// Partitioned mode: partitions held and fetched.
    owned: BTreeSet<i32>,
    /// Partitioned mode: partitions given up, unlocked once nothing of them is in flight.
    releasing: BTreeSet<i32>,
    /// Partitioned mode: partition of every fetched, not yet flushed id.
    part_of: HashMap<i64, i32>,
    /// Competing mode: a claim transaction is open.
    in_tx: bool,
    lock_at: Option<Instant>,
    standby_logged: bool,
    /// This relay's row in events.outbox_relays says it waits for a wake-up.
    waiting: bool,
    /// This relay has a row in events.outbox_relays.
    registered: bool,
    /// Events fetched in the current rate window, and in the one before.
    window_start: Instant,
    window_events: u64,
    last_window_events: u64,
    /// After going idle: when to look once more, and how many looks are left.
    recheck_at: Option<Instant>,
    rechecks_left: u8,
    /// When the relay last looked for producers queueing on NOTIFY's lock,
    /// and how many looks in a row found them queueing.
    notify_queue_checked_at: Option<Instant>,
    notify_queue_seen: u8,
    /// The NOTIFY-queue rule turned the relay busy: not idle before this.
    busy_hold_until: Option<Instant>,
    /// A failed look at `pg_locks` was logged as a warning (once per engine).
    notify_queue_warned: bool,
    /// The backlog gauges are read again no earlier than this (see
    /// [`GAUGES_SHARE`]).
    gauges_due: Option<Instant>,
}

/// The backlog gauges ([`store::GAUGES`]) count every unpublished row on
/// the drain session, so their cost grows with the backlog (about 0.3 s for
/// 430 000 rows of 1.5 KB here): they are read every
/// [`STATUS_INTERVAL`], or, when a read took longer than this share of
/// that, less often, so that they never take more than this share of the
/// drain loop's time while a large backlog drains.
const GAUGES_SHARE: u32 = 20;

fn new_backoff(max: Duration) -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(1.0 + rand::random::<f64>() * 0.1)
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        cfg: Arc<ConsumerConfig>,
        first: (Client, Link),
        tx: mpsc::Sender<Delivery>,
        settle_rx: mpsc::UnboundedReceiver<Settlement>,
        shared: Arc<Shared>,
        wake: Arc<Notify>,
        reconnect_wake: Arc<Notify>,
        token: CancellationToken,
    ) -> Self {
        let backoff = new_backoff(cfg.reconnect_max_delay);
        Engine {
            cfg,
            conn: None,
            first: Some(first),
            io: Some(Io { tx, settle_rx, wake, reconnect_wake }),
            shared,
            token,
            outstanding: HashMap::new(),
            acks: Vec::new(),
            fails: Vec::new(),
            flushing: None,
            flush_tx: None,
            generation: 0,
            fetch_seq: 0,
            want_fetch: true,
            retry_at: None,
            retry_read_at: None,
            retry_read_due: None,
            flush_at: None,
            reconnect_at: Some(Instant::now()),
            backoff,
            reason: Wake::Start,
            leader: false,
            owned: BTreeSet::new(),
            releasing: BTreeSet::new(),
            part_of: HashMap::new(),
            in_tx: false,
            lock_at: None,
            standby_logged: false,
            waiting: false,
            registered: false,
            window_start: Instant::now(),
            window_events: 0,
            last_window_events: 0,
            recheck_at: None,
            rechecks_left: 0,
            notify_queue_checked_at: None,
            notify_queue_seen: 0,
            busy_hold_until: None,
            notify_queue_warned: false,
            gauges_due: None,
        }
    }

    /// Start (or continue) a drain from the beginning of the outbox.
    fn wake_up(&mut self, reason: Wake) {
        if !self.want_fetch {
            self.reason = reason;
        }
        self.want_fetch = true;
    }

    /// May this consumer fetch now, given its mode?
    fn may_fetch(&self) -> bool {
        match self.cfg.mode {
            Mode::Single => self.leader,
            Mode::Partitioned { .. } => !self.owned.is_empty(),
            Mode::Competing => !self.in_tx,
        }
    }

    fn pending(&self) -> usize {
        self.acks.len() + self.fails.len()
    }

    pub(crate) async fn run(mut self) -> Result<()> {
        let Some(Io { tx, mut settle_rx, wake, reconnect_wake }) = self.io.take() else { return Ok(()) };
        let (flush_tx, mut flush_rx) = mpsc::unbounded_channel();
        self.flush_tx = Some(flush_tx);
        let token = self.token.clone();
        let sweep = sleep(jittered(self.cfg.sweep_interval));
        tokio::pin!(sweep);
        let mut status_tick = tokio::time::interval(STATUS_INTERVAL);
        status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop_deadline: Option<Instant> = None;
        let far = Instant::now() + Duration::from_secs(86_400 * 365);

        loop {
            if self.token.is_cancelled() && stop_deadline.is_none() {
                stop_deadline = Some(Instant::now() + self.cfg.shutdown_grace);
                self.want_fetch = false;
                tracing::debug!(outstanding = self.outstanding.len(), "drain loop stopping");
            }
            if let Some(deadline) = stop_deadline
                && (self.outstanding.is_empty() || Instant::now() >= deadline)
            {
                break;
            }
            if self.conn.is_some() && self.flushing.is_none() && self.pending() >= self.cfg.ack_batch_size {
                self.start_flush();
            }
            let stopping = stop_deadline.is_some();
            let can_fetch = self.want_fetch && !stopping && self.conn.is_some() && self.may_fetch();
            let batch = self.cfg.batch_size;
            // Notice a lost session at once, not at the next query: its locks
            // are gone, and what it buffered must not be handed out.
            let closed = self.conn.as_ref().map(|c| c.link.closed.clone());
            let writer_closed = self.conn.as_ref().and_then(|c| c.writer_link.as_ref()).map(|l| l.closed.clone());
            tokio::select! {
                biased;
                _ = async { if let Some(t) = &closed { t.cancelled().await } }, if closed.is_some() => {
                    metrics::counter!(m::DATABASE_ERRORS).increment(1);
                    let delay = self.backoff.next().unwrap_or(self.cfg.reconnect_max_delay);
                    tracing::warn!(retry_in = ?delay, "drain connection closed; reconnecting");
                    self.lost_connection(delay);
                }
                _ = async { if let Some(t) = &writer_closed { t.cancelled().await } }, if writer_closed.is_some() => {
                    metrics::counter!(m::DATABASE_ERRORS).increment(1);
                    let delay = self.backoff.next().unwrap_or(self.cfg.reconnect_max_delay);
                    tracing::warn!(retry_in = ?delay, "writer connection closed; reconnecting");
                    self.lost_connection(delay);
                }
                Some(done) = flush_rx.recv() => self.finish_flush(done).await,
                _ = token.cancelled(), if !stopping => {}
                Some(s) = settle_rx.recv() => {
                    self.settle(s);
                    let mut more = 0;
                    while more < 10_000 {
                        match settle_rx.try_recv() {
                            Ok(s) => { self.settle(s); more += 1; }
                            Err(_) => break,
                        }
                    }
                }
                _ = sleep_until(self.flush_at.unwrap_or(far)), if self.flush_at.is_some() && self.conn.is_some() && self.flushing.is_none() => {
                    self.flush_timer().await;
                }
                _ = sleep_until(self.reconnect_at.unwrap_or(far)), if self.conn.is_none() => {
                    self.reconnect(token.cancelled()).await;
                }
                permit = tx.reserve_many(batch), if can_fetch => {
                    match permit {
                        Ok(permit) => self.fetch(permit).await,
                        Err(_) => token.cancel(), // the stream was dropped
                    }
                }
                _ = wake.notified(), if !stopping => self.wake_up(Wake::Notification),
                _ = reconnect_wake.notified(), if !stopping => self.wake_up(Wake::Reconnect),
                _ = &mut sweep => {
                    metrics::counter!(m::SWEEPS).increment(1);
                    // While polling (busy, or looking again after going idle) a
                    // sweep finds nothing a poll would not: count it as a poll.
                    self.wake_up(if self.recheck_at.is_some() { Wake::Recheck } else { Wake::Sweep });
                    sweep.as_mut().reset(Instant::now() + jittered(self.cfg.sweep_interval));
                }
                _ = sleep_until(self.retry_at.unwrap_or(far)), if self.retry_at.is_some() => {
                    self.retry_at = None;
                    // The timer held only the earliest retry: read the next.
                    self.retry_read_at = None;
                    self.wake_up(Wake::Retry);
                }
                _ = sleep_until(self.retry_read_due.unwrap_or(far)), if self.retry_read_due.is_some() && self.conn.is_some() && !self.in_tx => {
                    self.retry_read_due = None;
                    self.retry_read_at = None;
                    self.schedule_retry_timer().await;
                }
                _ = sleep_until(self.recheck_at.unwrap_or(far)), if self.recheck_at.is_some() && !stopping => {
                    self.recheck_at = None;
                    self.wake_up(Wake::Recheck);
                }
                _ = sleep_until(self.lock_at.unwrap_or(far)), if self.lock_at.is_some() && self.conn.is_some() && !stopping => {
                    self.take_locks().await;
                }
                _ = status_tick.tick(), if self.conn.is_some() && !stopping => {
                    self.refresh_gauges().await;
                }
                _ = tx.closed(), if !stopping => token.cancel(),
                _ = sleep_until(stop_deadline.unwrap_or(far)), if stopping => {}
            }
        }
        self.final_flush(&mut flush_rx).await;
        Ok(())
    }

    /// Flush pending settlements at the latest one ack interval from now.
    fn arm_flush(&mut self) {
        if self.flush_at.is_none() {
            self.flush_at = Some(Instant::now() + self.cfg.ack_interval);
        }
    }

    /// Queue a failed attempt of `id` (fetched with `retry_count`) with its
    /// retry delay from the ladder. The caller has already counted it in the
    /// aggregate's hold-back (`pending`); the flush releases that.
    fn queue_fail(&mut self, id: i64, key: AggregateKey, retry_count: i32, error: String) {
        let failures = u32::try_from(retry_count.max(0)).unwrap_or(0).saturating_add(1);
        let delay = self.cfg.retry.delay(failures);
        self.fails.push(PendingFail { id, key, error, delay, retry_count });
        self.arm_flush();
    }

    fn settle(&mut self, s: Settlement) {
        match s {
            Settlement::Ack { id } => {
                self.outstanding.remove(&id);
                self.acks.push(id);
                self.arm_flush();
            }
            Settlement::Fail { id, key, retry_count, error } => {
                self.outstanding.remove(&id);
                self.queue_fail(id, key, retry_count, error);
            }
            Settlement::Release { id, key } => {
                self.outstanding.remove(&id);
                metrics::counter!(m::EVENTS_RELEASED).increment(1);
                let seq = self.fetch_seq;
                let mut map = self.shared.holdback();
                let h = map.entry(key).or_default();
                h.pending = h.pending.saturating_sub(1);
                h.upto_seq = h.upto_seq.max(seq);
                drop(map);
                self.part_of.remove(&id);
                self.wake_up(Wake::Release);
            }
        }
        if self.in_tx && self.outstanding.is_empty() {
            // Competing mode: the whole claimed batch is settled; write and commit.
            self.flush_at = Some(Instant::now());
        }
    }

    /// Open the work and writer sessions and prepare their statements. When
    /// `stop` resolves while they are being prepared, the statement running
    /// is cancelled and the sessions are closed (see [`statement::run`]).
    async fn reconnect(&mut self, stop: impl std::future::Future<Output = ()>) {
        let session = self.cfg.session();
        let (client, link) = match self.first.take() {
            Some(first) => first,
            None => match crate::connect::connect(&self.cfg.pg, "pg-outbox drain", &session).await {
                Ok(c) => c,
                Err(e) => {
                    self.connection_failed(&e);
                    return;
                }
            },
        };
        let mode = self.cfg.mode;
        let client = Arc::new(client);
        let writer = if matches!(mode, Mode::Competing) {
            None
        } else {
            match crate::connect::connect(&self.cfg.pg, "pg-outbox writer", &session).await {
                Ok((c, l)) => Some((Arc::new(c), l)),
                Err(e) => {
                    link.handle.abort();
                    self.connection_failed(&e);
                    return;
                }
            }
        };
        let (writer, writer_link) = match writer {
            Some((c, l)) => (c, Some(l)),
            None => (client.clone(), None),
        };
        let work_session = Session::new(link.canceller.clone());
        let writer_session = match &writer_link {
            Some(l) => Session::new(l.canceller.clone()),
            None => work_session.clone(),
        };
        let member_key: i32 = rand::random::<i32>();
        let timeout = self.cfg.statement_timeout;
        tokio::pin!(stop);
        let work_prepared = statement::run(Kind::SessionSetup, &work_session, timeout, &mut stop, async {
            let fetch_sql = match mode {
                Mode::Single => store::fetch_sql(false),
                Mode::Partitioned { .. } => store::fetch_sql(true),
                Mode::Competing => store::COMPETING_FETCH.to_string(),
            };
            let fetch = client.prepare(&fetch_sql).await?;
            let next_retry = client.prepare(store::NEXT_RETRY_IN).await?;
            if let Mode::Partitioned { .. } = mode {
                client.execute(store::MEMBER_LOCK, &[&MEMBER_CLASS, &member_key]).await?;
            }
            Ok((fetch, next_retry))
        })
        .await;
        let prepared = match work_prepared {
            Ok((fetch, next_retry)) => {
                statement::run(Kind::SessionSetup, &writer_session, timeout, &mut stop, async {
                    let ack = writer.prepare(store::ACK).await?;
                    let fail = writer.prepare(store::FAIL).await?;
                    Ok((fetch, ack, fail, next_retry))
                })
                .await
            }
            Err(e) => Err(e),
        };
        match prepared {
            Ok((fetch, ack, fail, next_retry)) => {
                self.generation += 1;
                self.conn = Some(Conn {
                    client,
                    link,
                    session: work_session,
                    fetch,
                    member_key,
                    next_retry,
                    writer,
                    writer_link,
                    writer_session,
                    ack,
                    fail,
                });
                self.backoff = new_backoff(self.cfg.reconnect_max_delay);
                self.reconnect_at = None;
                // Locks of the old session are gone with it.
                self.set_leader(false);
                self.owned.clear();
                self.releasing.clear();
                self.in_tx = false;
                self.standby_logged = false;
                self.waiting = false;
                self.registered = false;
                metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
                if !matches!(mode, Mode::Competing) {
                    self.lock_at = Some(Instant::now());
                }
                // Sweep after (re)connecting: notifications may have been missed.
                self.wake_up(Wake::Reconnect);
                if self.pending() > 0 {
                    self.flush_at = Some(Instant::now());
                }
            }
            Err(e) => {
                link.handle.abort();
                if let Some(l) = writer_link {
                    l.handle.abort();
                }
                match e.failure {
                    Failure::Db(e) => self.connection_failed(&Error::Db(e)),
                    _ => self.db_error(e),
                }
            }
        }
    }

    fn connection_failed(&mut self, e: &Error) {
        metrics::counter!(m::DATABASE_ERRORS).increment(1);
        let delay = self.backoff.next().unwrap_or(self.cfg.reconnect_max_delay);
        tracing::warn!(error = %crate::error::report(e), retry_in = ?delay, "drain connection failed; retrying");
        self.lost_connection(delay);
    }

    fn lost_connection(&mut self, delay: Duration) {
        // Locks and claims went with the session: another consumer may
        // deliver what is buffered here, so none of it is handed out.
        self.shared.stale_before.store(self.fetch_seq + 1, std::sync::atomic::Ordering::SeqCst);
        self.conn = None;
        self.waiting = false;
        self.registered = false;
        self.notify_queue_seen = 0;
        self.busy_hold_until = None;
        self.retry_read_at = None;
        self.retry_read_due = None;
        self.in_tx = false;
        self.set_leader(false);
        self.owned.clear();
        self.releasing.clear();
        metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
        self.reconnect_at = Some(Instant::now() + delay);
    }

    fn set_leader(&mut self, leader: bool) {
        if matches!(self.cfg.mode, Mode::Single) {
            if leader && !self.leader {
                tracing::info!("active: this consumer holds the outbox lock and delivers");
            } else if !leader && self.leader {
                tracing::warn!("no longer active (connection lost); will try to take over again");
            }
            metrics::gauge!(m::LEADER).set(if leader { 1.0 } else { 0.0 });
        }
        self.leader = leader;
    }

    /// Single mode: try to become the active consumer. Partitioned mode:
    /// take or give up partitions to hold a fair share.
    async fn take_locks(&mut self) {
        self.lock_at = None;
        let Some(conn) = self.conn.as_ref() else { return };
        match self.cfg.mode {
            Mode::Competing => {}
            Mode::Single => {
                if self.leader {
                    return;
                }
                let timeout = self.cfg.statement_timeout;
                let lock = conn.client.query_one(store::TRY_LEADER_LOCK, &[&LEADER_KEY]);
                match statement::run(Kind::Lock, &conn.session, timeout, self.token.cancelled(), lock).await {
                    Ok(row) => {
                        if row.try_get::<_, bool>(0).unwrap_or(false) {
                            self.set_leader(true);
                            self.wake_up(Wake::Ownership);
                        } else {
                            if !self.standby_logged {
                                self.standby_logged = true;
                                tracing::info!("standby: another consumer holds the outbox lock; waiting to take over");
                            }
                            metrics::gauge!(m::LEADER).set(0.0);
                            self.lock_at = Some(Instant::now() + LOCK_INTERVAL);
                        }
                    }
                    Err(e) => self.db_error(e),
                }
            }
            Mode::Partitioned { partitions } => {
                let (session, token) = (conn.session.clone(), self.token.clone());
                let timeout = self.cfg.statement_timeout;
                let rebalanced = self.rebalance(partitions);
                if let Err(e) = statement::run(Kind::Lock, &session, timeout, token.cancelled(), rebalanced).await {
                    self.db_error(e);
                    return;
                }
                self.lock_at = Some(Instant::now() + jittered(LOCK_INTERVAL * 4));
            }
        }
    }

    async fn rebalance(&mut self, partitions: u32) -> std::result::Result<(), tokio_postgres::Error> {
        let Some(conn) = self.conn.as_ref() else { return Ok(()) };
        let members: i64 = conn.client.query_one(store::COUNT_MEMBERS, &[&MEMBER_CLASS]).await?.try_get(0)?;
        let members = u32::try_from(members.max(1)).unwrap_or(1);
        let share = partitions.div_ceil(members) as usize;
        let before = self.owned.len();
        if self.owned.len() < share {
            let start = (conn.member_key.unsigned_abs() % partitions.max(1)) as i32;
            let total = i32::try_from(partitions).unwrap_or(i32::MAX);
            for k in 0..total {
                if self.owned.len() >= share {
                    break;
                }
                let p = (start + k) % total;
                if self.owned.contains(&p) || self.releasing.contains(&p) {
                    continue;
                }
                let got: bool =
                    conn.client.query_one(store::TRY_PARTITION_LOCK, &[&PARTITION_CLASS, &p]).await?.try_get(0)?;
                if got {
                    self.owned.insert(p);
                }
            }
        } else if self.owned.len() > share {
            while self.owned.len() > share {
                if let Some(p) = self.owned.pop_last() {
                    self.releasing.insert(p);
                }
            }
        }
        // Unlock given-up partitions once nothing of them is in flight.
        let busy: BTreeSet<i32> = self.part_of.values().copied().collect();
        let free: Vec<i32> = self.releasing.iter().copied().filter(|p| !busy.contains(p)).collect();
        for p in free {
            conn.client.execute(store::PARTITION_UNLOCK, &[&PARTITION_CLASS, &p]).await?;
            self.releasing.remove(&p);
        }
        if self.owned.len() != before {
            tracing::info!(owned = ?self.owned, members, "partitions rebalanced");
            metrics::gauge!(m::PARTITIONS_OWNED).set(self.owned.len() as f64);
            if self.owned.len() > before {
                self.wake_up(Wake::Ownership);
            }
        }
        Ok(())
    }

    /// A statement failed: reconnect with backoff (a statement the
    /// timeout cut is logged and counted as such); one cancelled because the
    /// consumer is stopping just closes its sessions.
    fn db_error(&mut self, e: StatementError) {
        let StatementError { kind, failure } = e;
        let e = match failure {
            Failure::Stopped => {
                tracing::debug!(during = kind.describe(), "stopping: closing the sessions of a cancelled statement");
                self.lost_connection(Duration::ZERO);
                return;
            }
            Failure::TimedOut(e) => {
                metrics::counter!(m::DATABASE_ERRORS).increment(1);
                let delay = self.backoff.next().unwrap_or(self.cfg.reconnect_max_delay);
                statement::record_timeout(kind, self.cfg.statement_timeout, &e, Some(delay));
                self.lost_connection(delay);
                return;
            }
            Failure::Db(e) => e,
        };
        metrics::counter!(m::DATABASE_ERRORS).increment(1);
        let delay = self.backoff.next().unwrap_or(self.cfg.reconnect_max_delay);
        tracing::warn!(error = %crate::error::report(&e), during = kind.describe(), retry_in = ?delay,
            "database error in the drain loop; reconnecting");
        self.lost_connection(delay);
    }

    async fn fetch(&mut self, permit: mpsc::PermitIterator<'_, Delivery>) {
        let Some(conn) = self.conn.as_ref() else { return };
        let mut exclude: Vec<i64> = self.outstanding.keys().copied().collect();
        exclude.extend(self.acks.iter().copied());
        exclude.extend(self.fails.iter().map(|f| f.id));
        if let Some(ids) = &self.flushing {
            exclude.extend(ids.iter().copied());
        }
        let batch = i64::try_from(self.cfg.batch_size).unwrap_or(i64::MAX);
        let (timeout, session, stop) = (self.cfg.statement_timeout, &conn.session, self.token.cancelled());
        let res = match self.cfg.mode {
            Mode::Single => {
                statement::run(Kind::Fetch, session, timeout, stop, conn.client.query(&conn.fetch, &[&exclude, &batch]))
                    .await
            }
            Mode::Partitioned { partitions } => {
                let owned: Vec<i32> = self.owned.iter().copied().collect();
                let n = i64::from(partitions);
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&exclude, &batch, &n, &owned];
                statement::run(Kind::Fetch, session, timeout, stop, conn.client.query(&conn.fetch, &params)).await
            }
            Mode::Competing => {
                // Claim rows with row locks held by an open transaction until
                // the whole batch is settled; other consumers skip them.
                let claim = async {
                    conn.client.batch_execute(store::BEGIN).await?;
                    conn.client.query(&conn.fetch, &[&batch]).await
                };
                // A failed claim leaves no transaction behind that matters:
                // its session is closed.
                self.in_tx = true;
                statement::run(Kind::Fetch, session, timeout, stop, claim).await
            }
        };
        let rows = match res {
            Ok(rows) => rows,
            Err(e) => {
                drop(permit);
                self.db_error(e);
                return;
            }
        };
        self.fetch_seq += 1;
        let seq = self.fetch_seq;
        let full = rows.len() >= self.cfg.batch_size;
        let mut handed = 0u64;
        let partitioned = matches!(self.cfg.mode, Mode::Partitioned { .. });
        for (row, slot) in rows.iter().zip(permit) {
            if self.token.is_cancelled() {
                // Stopping: hand out nothing more; these rows stay unpublished.
                break;
            }
            match store::event_from_row(row) {
                Ok(event) => {
                    self.outstanding.insert(event.id, seq);
                    if partitioned && let Ok(p) = row.try_get::<_, i32>(store::PARTITION_COLUMN) {
                        self.part_of.insert(event.id, p);
                    }
                    slot.send(Delivery::new(event, seq, self.shared.clone()));
                    handed += 1;
                }
                Err(e) => self.undecodable(row, &e),
            }
        }
        metrics::counter!(m::EVENTS_FETCHED, "wake" => self.reason.label()).increment(handed);
        if self.in_tx && handed == 0 {
            // Nothing claimed: close the claim transaction at once.
            self.flush_at = Some(Instant::now());
        }
        self.count_rate(handed);
        let adaptive = self.cfg.listen && !matches!(self.cfg.mode, Mode::Competing);
        if handed > 0 {
            // Keep fetching until a fetch finds nothing.
            self.want_fetch = true;
            if adaptive
                && (!self.registered
                    || (self.waiting
                        && (self.busy_rate() || handed >= BUSY_FETCH_EVENTS || self.notify_queue_forming().await)))
            {
                // Draining at a high rate: poll, and spare producers NOTIFY.
                self.rechecks_left = 0;
                self.recheck_at = None;
                self.set_waiting(false).await;
            } else if !self.cfg.listen && !self.registered {
                // Sweep-only: never ask producers to notify (nobody listens).
                self.set_waiting(false).await;
            }
            if adaptive && self.waiting && !full && !self.in_tx && !self.token.is_cancelled() {
                // Still waiting, and the fetch returned less than a batch: it
                // took every event that was due when it ran, and whatever
                // commits later notifies (its producer reads the hint after
                // this relay asked for wake-ups). So this drain is done,
                // without a fetch that finds nothing; at low rates that fetch
                // was the round trip a next notification queued behind.
                self.want_fetch = false;
                self.next_recheck();
                self.schedule_retry_timer().await;
            }
        } else if full {
            // Every row of a full result was skipped (stopping): look again later.
            self.want_fetch = true;
        } else {
            self.want_fetch = false;
            if !self.cfg.listen && !self.registered && !self.in_tx {
                self.set_waiting(false).await;
            }
            let held = self.busy_hold_until.is_some_and(|t| Instant::now() < t);
            if adaptive && !self.waiting && self.idle_rate() && !held {
                // Idle: ask for wake-ups again, then look once more at once
                // and a few times shortly after, for events whose producers
                // decided not to notify just before and were still committing.
                self.set_waiting(true).await;
                self.want_fetch = true;
                self.rechecks_left = RECHECKS.len() as u8;
            } else if adaptive && !self.waiting {
                // Busy and nothing right now: poll again in a moment.
                self.recheck_at = Some(Instant::now() + BUSY_POLL);
            } else {
                self.next_recheck();
            }
            if !self.in_tx {
                self.schedule_retry_timer().await;
            }
        }
    }

    /// After going idle, a drain that ended schedules the next of its
    /// [`RECHECKS`], if any is left.
    fn next_recheck(&mut self) {
        if self.rechecks_left > 0 {
            let i = RECHECKS.len() - usize::from(self.rechecks_left);
            self.rechecks_left -= 1;
            self.recheck_at = Some(Instant::now() + RECHECKS[i]);
        }
    }

    fn count_rate(&mut self, n: u64) {
        let elapsed = self.window_start.elapsed();
        if elapsed >= RATE_WINDOW * 2 {
            self.last_window_events = 0;
            self.window_events = 0;
            self.window_start = Instant::now();
        } else if elapsed >= RATE_WINDOW {
            self.last_window_events = self.window_events;
            self.window_events = 0;
            self.window_start += RATE_WINDOW;
        }
        self.window_events += n;
    }

    /// Do producers queue for NOTIFY's commit lock ([`NOTIFY_QUEUE_WAITERS`]
    /// or more waiters, [`NOTIFY_QUEUE_CHECKS`] looks in a row)? Looked at
    /// only at [`NOTIFY_QUEUE_CHECK_EVENTS`] per window or more, at most once
    /// per window; a look two windows or more after the last one starts a
    /// new row. An error counts as no: the relay then stays as it is, and
    /// the next query reports the connection's state.
    async fn notify_queue_forming(&mut self) -> bool {
        if self.window_events.max(self.last_window_events) < NOTIFY_QUEUE_CHECK_EVENTS {
            self.notify_queue_seen = 0;
            return false;
        }
        match self.notify_queue_checked_at.map(|t| t.elapsed()) {
            Some(e) if e < RATE_WINDOW => return false,
            Some(e) if e >= RATE_WINDOW * 2 => self.notify_queue_seen = 0,
            _ => {}
        }
        self.notify_queue_checked_at = Some(Instant::now());
        let Some(conn) = self.conn.as_ref() else { return false };
        let look = conn.client.query_one(store::NOTIFY_LOCK_WAITERS, &[]);
        let waiters = match statement::run(
            Kind::NotifyLockWaiters,
            &conn.session,
            self.cfg.statement_timeout,
            self.token.cancelled(),
            look,
        )
        .await
        {
            Ok(row) => row.try_get::<_, i64>(0).unwrap_or(0),
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                let error = crate::error::report(&e);
                if self.notify_queue_warned {
                    tracing::debug!(error = %error, "could not count NOTIFY's lock waiters");
                } else {
                    self.notify_queue_warned = true;
                    tracing::warn!(error = %error,
                        "could not read pg_locks: producers queueing for NOTIFY's commit lock go unnoticed \
                         (the other busy rules still apply)");
                }
                0
            }
            Err(e) => {
                self.db_error(e);
                return false;
            }
        };
        if waiters < NOTIFY_QUEUE_WAITERS {
            self.notify_queue_seen = 0;
            return false;
        }
        self.notify_queue_seen += 1;
        if self.notify_queue_seen < NOTIFY_QUEUE_CHECKS {
            return false;
        }
        // The caller marks the relay busy, which restarts the row of looks.
        self.busy_hold_until = Some(Instant::now() + NOTIFY_QUEUE_BUSY_HOLD);
        tracing::debug!(waiters, "producers queue for NOTIFY's commit lock; polling instead");
        true
    }

    fn busy_rate(&self) -> bool {
        self.window_events >= BUSY_EVENTS_PER_WINDOW || self.last_window_events >= BUSY_EVENTS_PER_WINDOW
    }

    fn idle_rate(&self) -> bool {
        self.window_events < IDLE_EVENTS_PER_WINDOW && self.last_window_events < IDLE_EVENTS_PER_WINDOW
    }

    /// A row that cannot be decoded (e.g. `occurred_at = 'infinity'`) is
    /// recorded as a failed attempt, like a sink failure: it holds back the
    /// later events of its aggregate, is retried on the ladder, and becomes
    /// a dead letter an operator can see, rather than being skipped.
    fn undecodable(&mut self, row: &tokio_postgres::Row, e: &Error) {
        let msg =
            crate::consumer::delivery::sanitize_error(&format!("cannot decode the row: {}", crate::error::report(e)));
        let (Ok(id), Ok(t), Ok(a), Ok(retry_count)) = (
            row.try_get::<_, i64>(0),
            row.try_get::<_, String>(1),
            row.try_get::<_, uuid::Uuid>(2),
            row.try_get::<_, i32>(6),
        ) else {
            tracing::error!(error = %msg, "could not read an outbox row's id or aggregate; it stays unpublished");
            return;
        };
        tracing::error!(id, error = %msg, "could not read an outbox row; recording it as a failed attempt");
        let key = (t, a);
        // Hold back the aggregate's later events until the failure is written.
        self.shared.holdback().entry(key.clone()).or_default().pending += 1;
        self.queue_fail(id, key, retry_count, msg);
    }

    /// Say in events.outbox_relays whether this relay waits for wake-ups.
    async fn set_waiting(&mut self, waiting: bool) {
        let Some(conn) = self.conn.as_ref() else { return };
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&waiting];
        let set = conn.client.execute(store::SET_WAITING, &params);
        match statement::run(Kind::Registration, &conn.session, self.cfg.statement_timeout, self.token.cancelled(), set)
            .await
        {
            Ok(_) => {
                self.waiting = waiting;
                self.registered = true;
                // A new row of looks starts from a changed state.
                self.notify_queue_seen = 0;
                metrics::gauge!(m::WAITING_FOR_NOTIFICATIONS).set(if waiting { 1.0 } else { 0.0 });
            }
            Err(e) => self.db_error(e),
        }
    }

    /// Arm the retry timer for the earliest `next_retry_at` (the database's
    /// clock). For a drain woken by a notification or a poll within
    /// [`RETRY_READ_GAP`] of the last read, the read is put off until that
    /// gap has passed (`retry_read_due`) instead.
    async fn schedule_retry_timer(&mut self) {
        let Some(conn) = self.conn.as_ref() else { return };
        let now = Instant::now();
        if matches!(self.reason, Wake::Notification | Wake::Recheck)
            && self.retry_read_at.is_some_and(|t| now.duration_since(t) < RETRY_READ_GAP)
        {
            if self.retry_read_due.is_none() {
                self.retry_read_due = self.retry_read_at.map(|t| t + RETRY_READ_GAP);
            }
            return;
        }
        self.retry_read_at = Some(now);
        self.retry_read_due = None;
        let read = conn.client.query_one(&conn.next_retry, &[]);
        match statement::run(
            Kind::NextRetryRead,
            &conn.session,
            self.cfg.statement_timeout,
            self.token.cancelled(),
            read,
        )
        .await
        {
            Ok(row) => match row.try_get::<_, Option<f64>>(0) {
                Ok(Some(secs)) => self.arm_retry(secs),
                Ok(None) => {}
                Err(e) => self.db_error(StatementError::db(Kind::NextRetryRead, e)),
            },
            Err(e) => self.db_error(e),
        }
    }

    fn arm_retry(&mut self, secs: f64) {
        // A few milliseconds late, so the database's now() has passed it.
        let at = Instant::now() + store::secs_to_duration(secs) + Duration::from_millis(5);
        self.retry_at = Some(match self.retry_at {
            Some(cur) if cur < at => cur,
            _ => at,
        });
    }

    /// The flush timer fired: write what is pending, or, in competing mode
    /// with nothing to write, end a claim transaction whose batch is settled.
    async fn flush_timer(&mut self) {
        if self.pending() > 0 {
            self.start_flush();
            return;
        }
        self.flush_at = None;
        if self.in_tx && self.outstanding.is_empty() {
            self.commit_claim().await;
        }
    }

    /// Competing mode: commit the claim transaction (its batch is settled).
    async fn commit_claim(&mut self) {
        let Some(conn) = self.conn.as_ref() else { return };
        let commit = conn.client.batch_execute(store::COMMIT);
        match statement::run_to_end(Kind::ClaimCommit, &conn.session, self.cfg.statement_timeout, commit).await {
            Ok(()) => self.in_tx = false,
            Err(e) => self.db_error(e),
        }
    }

    /// Most acknowledgements (and, apart, most failures) one write takes:
    /// the acknowledgement batch size.
    fn write_cap(&self) -> usize {
        self.cfg.ack_batch_size.max(1)
    }

    /// Start writing the pending settlements (one `UPDATE` for the
    /// acknowledgements, one for the failures, pipelined) on the writer
    /// session, without waiting: the loop goes on fetching and delivering.
    /// The outcome comes back through the flush channel ([`Self::finish_flush`]).
    fn start_flush(&mut self) {
        self.flush_at = None;
        if self.flushing.is_some() || self.pending() == 0 {
            return;
        }
        let (Some(conn), Some(done_tx)) = (self.conn.as_ref(), self.flush_tx.clone()) else { return };
        // At most one batch of each per write: settlements put back after a
        // failed write must not make the next write bigger (and slower to
        // meet the statement timeout) than the one that failed.
        let cap = self.write_cap();
        let acks: Vec<i64> = self.acks.drain(..self.acks.len().min(cap)).collect();
        let fails: Vec<PendingFail> = self.fails.drain(..self.fails.len().min(cap)).collect();
        self.flushing = Some(acks.iter().copied().chain(fails.iter().map(|f| f.id)).collect());
        let writer = conn.writer.clone();
        let session = conn.writer_session.clone();
        let timeout = self.cfg.statement_timeout;
        let (ack, fail) = (conn.ack.clone(), conn.fail.clone());
        let max_retries = self.cfg.max_retries;
        let generation = self.generation;
        tokio::spawn(async move {
            let ack_fut = async {
                if acks.is_empty() {
                    Ok(Vec::new())
                } else {
                    statement::run_to_end(Kind::AckWrite, &session, timeout, writer.query(&ack, &[&acks])).await
                }
            };
            let fail_ids: Vec<i64> = fails.iter().map(|f| f.id).collect();
            let details = store::fail_details(
                fails.iter().map(|f| (f.id, f.error.as_str(), f.delay.as_secs_f64(), f.retry_count)),
            );
            let fail_fut = async {
                if fail_ids.is_empty() {
                    Ok(Vec::new())
                } else {
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&fail_ids, &details, &max_retries];
                    statement::run_to_end(Kind::FailWrite, &session, timeout, writer.query(&fail, &params)).await
                }
            };
            let (ack_res, fail_res) = tokio::join!(ack_fut, fail_fut);
            drop((fail_ids, details));
            let _ = done_tx.send(FlushDone { generation, acks, fails, ack_res, fail_res });
        });
    }

    /// Take in the outcome of a write: metrics, hold-back release, retry
    /// timer; on an error, queue the settlements again (both writes are
    /// idempotent) and reconnect if the write's session is the current one.
    async fn finish_flush(&mut self, done: FlushDone) {
        self.flushing = None;
        let FlushDone { generation, acks, fails, ack_res, fail_res } = done;
        let current = generation == self.generation && self.conn.is_some();
        match ack_res {
            Ok(rows) => {
                let hist = metrics::histogram!(m::DELIVERY_LAG);
                for r in &rows {
                    if let Ok(Some(lag)) = r.try_get::<_, Option<f64>>(0) {
                        hist.record(lag);
                    }
                }
                metrics::counter!(m::EVENTS_PUBLISHED).increment(rows.len() as u64);
                for id in &acks {
                    self.part_of.remove(id);
                }
            }
            Err(e) => {
                self.acks.extend(acks);
                if current {
                    self.db_error(e);
                }
            }
        }
        match fail_res {
            Ok(rows) => {
                let mut earliest: Option<f64> = None;
                let mut dead = 0u64;
                for r in &rows {
                    let id: i64 = r.try_get(0).unwrap_or_default();
                    if r.try_get::<_, bool>(1).unwrap_or(false) {
                        dead += 1;
                        let err = fails.iter().find(|f| f.id == id).map(|f| f.error.as_str()).unwrap_or("");
                        tracing::warn!(id, error = err, "event became a dead letter");
                    }
                    if let Ok(Some(s)) = r.try_get::<_, Option<f64>>(2) {
                        earliest = Some(earliest.map_or(s, |e: f64| e.min(s)));
                    }
                }
                metrics::counter!(m::EVENTS_FAILED).increment(fails.len() as u64);
                metrics::counter!(m::EVENTS_DEAD_LETTERED).increment(dead);
                if let Some(s) = earliest {
                    self.arm_retry(s);
                }
                // No fetch is in flight while this runs (fetches are awaited
                // by this same task), so every later fetch sees the failures.
                let seq = self.fetch_seq;
                let mut map = self.shared.holdback();
                for f in &fails {
                    let h = map.entry(f.key.clone()).or_default();
                    h.pending = h.pending.saturating_sub(1);
                    h.upto_seq = h.upto_seq.max(seq);
                }
                drop(map);
                for f in &fails {
                    self.part_of.remove(&f.id);
                }
            }
            Err(e) => {
                self.fails.extend(fails);
                if current && self.conn.is_some() {
                    self.db_error(e);
                }
            }
        }
        self.collect_holdback();
        if self.in_tx && self.outstanding.is_empty() && self.pending() == 0 {
            self.commit_claim().await;
        }
        if self.pending() > 0 && self.flush_at.is_none() && self.conn.is_some() {
            self.flush_at = Some(Instant::now() + self.cfg.ack_interval);
        }
    }

    /// The outcome of the write in flight, waited for until `deadline`;
    /// then the write is cancelled and waited for a little longer (`None`
    /// if it still does not end: its events stay unpublished).
    async fn flush_outcome(
        &mut self,
        flush_rx: &mut mpsc::UnboundedReceiver<FlushDone>,
        deadline: Instant,
    ) -> Option<FlushDone> {
        if let Ok(done) = tokio::time::timeout_at(deadline, flush_rx.recv()).await {
            return done;
        }
        tracing::warn!(grace = ?self.cfg.shutdown_grace,
            "the final settlements were not written within the shutdown grace; cancelling the write");
        if let Some(conn) = self.conn.as_ref() {
            conn.writer_session.cancel().await;
        }
        tokio::time::timeout(statement::CANCELLED_WAIT, flush_rx.recv()).await.ok().flatten()
    }

    /// Forget hold-back entries that can no longer match a buffered delivery.
    fn collect_holdback(&self) {
        let oldest = self.outstanding.values().copied().min().unwrap_or(u64::MAX);
        self.shared.holdback().retain(|_, h| h.pending > 0 || h.upto_seq >= oldest);
    }

    /// Refresh the backlog gauges, forget gone relays, read the notification
    /// queue's usage. A failure of these is logged at debug level and the
    /// loop goes on, except a timeout or a stop (see [`Self::db_error`]).
    async fn refresh_gauges(&mut self) {
        let Some(conn) = self.conn.as_ref() else { return };
        if self.gauges_due.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let (timeout, stop) = (self.cfg.statement_timeout, self.token.clone());
        let gauges = conn.client.query_one(store::GAUGES, &[]);
        let started = Instant::now();
        let read = statement::run(Kind::Gauges, &conn.session, timeout, stop.cancelled(), gauges).await;
        // One read every GAUGES_SHARE times its own duration at most.
        self.gauges_due = Some(started + started.elapsed() * GAUGES_SHARE);
        match read {
            Ok(row) => {
                let pending: i64 = row.try_get(0).unwrap_or(0);
                let dead: i64 = row.try_get(1).unwrap_or(0);
                let oldest: Option<f64> = row.try_get(2).unwrap_or(None);
                metrics::gauge!(m::BACKLOG).set(pending as f64);
                metrics::gauge!(m::DEAD_LETTERS).set(dead as f64);
                metrics::gauge!(m::OLDEST_UNPUBLISHED_AGE).set(oldest.unwrap_or(0.0));
            }
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                tracing::debug!(error = %crate::error::report(&e), "could not refresh backlog gauges")
            }
            // Their cost grows with the backlog: a statement timeout cuts
            // only this read (the session stays usable), which is tried
            // again GAUGES_SHARE times its duration later.
            Err(StatementError { kind, failure: Failure::TimedOut(e) }) => {
                statement::record_timeout(kind, timeout, &e, None)
            }
            Err(e) => return self.db_error(e),
        }
        let forget = conn.client.execute(store::FORGET_GONE_RELAYS, &[]);
        match statement::run(Kind::Registration, &conn.session, timeout, stop.cancelled(), forget).await {
            Ok(_) => {}
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                tracing::debug!(error = %crate::error::report(&e), "could not forget gone relays")
            }
            Err(e) => return self.db_error(e),
        }
        let usage = conn.client.query_one(store::NOTIFICATION_QUEUE_USAGE, &[]);
        match statement::run(Kind::Gauges, &conn.session, timeout, stop.cancelled(), usage).await {
            Ok(row) => {
                if let Ok(usage) = row.try_get::<_, f64>(0) {
                    metrics::gauge!(m::NOTIFICATION_QUEUE_USAGE).set(usage);
                }
            }
            Err(StatementError { failure: Failure::Db(_), .. }) => {}
            Err(e) => self.db_error(e),
        }
    }

    /// Unregister and write the final settlements, within one shutdown
    /// grace: a statement still running then is cancelled.
    async fn final_flush(&mut self, flush_rx: &mut mpsc::UnboundedReceiver<FlushDone>) {
        let deadline = Instant::now() + self.cfg.shutdown_grace;
        if let Some(conn) = self.conn.as_ref() {
            let unregister = conn.client.execute(store::UNREGISTER, &[]);
            let timeout = self.cfg.statement_timeout;
            match statement::run(Kind::Registration, &conn.session, timeout, sleep_until(deadline), unregister).await {
                Ok(_) => {}
                Err(StatementError { failure: Failure::Db(e), .. }) => {
                    tracing::debug!(error = %crate::error::report(&e), "could not unregister for wake-ups")
                }
                Err(StatementError { kind, failure: Failure::TimedOut(e) }) => {
                    statement::record_timeout(kind, timeout, &e, None)
                }
                Err(e) => self.db_error(e),
            }
        }
        // Whatever is still handed out is released by its Drop later; here we
        // write what was settled: a write per batch, and up to three more for
        // writes that fail.
        let rounds = 3 + self.pending().div_ceil(self.write_cap());
        for _ in 0..rounds {
            if self.flushing.is_some() {
                match self.flush_outcome(flush_rx, deadline).await {
                    Some(done) => self.finish_flush(done).await,
                    None => break,
                }
            }
            if self.pending() == 0 || Instant::now() >= deadline {
                break;
            }
            if self.conn.is_none() {
                self.reconnect(sleep_until(deadline)).await;
            }
            self.start_flush();
            if self.flushing.is_some()
                && let Some(done) = self.flush_outcome(flush_rx, deadline).await
            {
                self.finish_flush(done).await;
            }
        }
        let unwritten = self.flushing.as_ref().map_or(0, Vec::len);
        if self.pending() + unwritten > 0 {
            tracing::error!(
                acknowledgements = self.acks.len(),
                failures = self.fails.len(),
                unfinished = unwritten,
                "could not write the final settlements; those events will be delivered again"
            );
        }
        if !self.outstanding.is_empty() {
            tracing::warn!(
                deliveries = self.outstanding.len(),
                "shutdown grace ran out with deliveries still open; they stay unpublished and will be delivered again"
            );
        }
    }
}

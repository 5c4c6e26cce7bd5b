//! The consumer: an async [`Stream`](futures::Stream) of [`Delivery`] values.

mod completer;
mod delivery;
mod drain;
mod fetcher;
mod health;
mod holdback;
mod maintenance;
mod notifier;
mod ownership;
mod retry_timer;
mod session;
mod statement;
mod wake;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use futures::stream::FusedStream;
use std::future::Future;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use uuid::Uuid;

pub use delivery::Delivery;
pub use health::{HEALTH_ERROR_BYTES, Health, HealthMonitor, LastError, Role, SinkHealth};

use crate::connect;
use crate::error::{Error, Result};
use crate::retry::RetryPolicy;

/// The channel the insert trigger notifies
/// (`triggers/outbox_insert_order_and_notify.sql`).
pub const NOTIFY_CHANNEL: &str = "events.outbox";
/// Default rows fetched per query: 500 (the schema's original poller query,
/// FetchUnpublishedBatch in docs/schema.md, takes 50; docs/performance.md, "Batch sizes", says why 500). A fetch
/// returns at once with what is there, so a small backlog is not delayed.
/// The stream buffers up to twice the batch, and payloads within
/// [`DEFAULT_MAX_BUFFERED_BYTES`].
pub const DEFAULT_BATCH_SIZE: usize = 500;
/// Default bound on the payload bytes a consumer holds: 64 MiB
/// ([`ConsumerBuilder::max_buffered_bytes`]). Before it, only rows bounded
/// what a consumer holds: twice the batch of 500, so with payloads near the
/// publisher's 1 MiB limit ([`crate::DEFAULT_MAX_PAYLOAD_BYTES`]) about
/// 1 GB. The default buffer of 1 000 rows reaches 64 MiB only with payloads
/// of about 64 KiB or more, so for smaller ones (the bench's envelope is
/// 1.5 KB) the rows bind first and nothing changes; the bound binds where
/// payloads are large.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 * 1024 * 1024;
/// The smallest byte bound [`ConsumerBuilder::max_buffered_bytes`] takes:
/// 1 MiB, the publisher's default payload limit
/// ([`crate::DEFAULT_MAX_PAYLOAD_BYTES`]). A smaller bound would still
/// work (a fetch always returns at least one event), but every fetch would
/// bring a single event: a figure that low is far more likely a unit
/// mistake (`64` meant as MiB) than a wish.
pub const MIN_MAX_BUFFERED_BYTES: usize = 1024 * 1024;
/// Default fallback sweep interval: 1 second. Bounds how long a lost
/// notification can delay an event.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Default dead-letter threshold: an event whose `retry_count` reaches 10 is
/// a dead letter (the schema's original threshold, `retry_count >= 10`;
/// docs/schema.md, "Retention and dead letters").
pub const DEFAULT_MAX_RETRIES: i32 = 10;
/// Default acknowledgement batch: flush once 500 settlements are pending.
pub const DEFAULT_ACK_BATCH_SIZE: usize = 500;
/// Default acknowledgement delay: flush pending settlements after 10 ms.
pub const DEFAULT_ACK_INTERVAL: Duration = Duration::from_millis(10);
/// Default longest wait between reconnect attempts: 30 seconds.
pub const DEFAULT_RECONNECT_MAX_DELAY: Duration = Duration::from_secs(30);
/// Default liveness ping on the idle LISTEN connection: every 5 seconds.
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(5);
/// Default statement timeout of the consumer's own sessions (drain, writer,
/// LISTEN): 60 seconds. A healthy statement of theirs takes milliseconds (a
/// fetch of a 500-row batch, the UPDATE of an acknowledged batch), so a
/// minute is three orders of magnitude above it: an overloaded server, a
/// checkpoint or a lock held for a while by a migration does not reach it.
/// A statement that does (a bad plan, a lock held by a forgotten session)
/// is cut by the server after a minute instead of running on for as long
/// as it takes, after the relay gave up on it or was killed.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default time graceful shutdown waits for handed-out deliveries: 30 s.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// The largest statement timeout the server takes: `i32::MAX` ms.
const MAX_STATEMENT_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);
/// Interval at which the backlog gauges are refreshed: 5 seconds.
pub(crate) const STATUS_INTERVAL: Duration = Duration::from_secs(5);
/// How long start waits for its test notification to come back: 2 s.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest `last_error` stored, in bytes; longer messages are cut.
pub const MAX_ERROR_BYTES: usize = 4096;

/// How several consumers of one outbox share it. The same choice is the
/// relay's `--mode` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Mode {
    /// One active consumer per outbox (default). Each consumer takes a
    /// session advisory lock on its work connection before it fetches; the
    /// others are hot standbys that try to take the lock every 250 ms, so
    /// when the active one dies (its session ends, releasing the lock) a
    /// standby takes over within about a quarter of a second of the server
    /// noticing. Keeps id order and per-aggregate order.
    #[default]
    Single,
    /// Several active consumers share the work by a hash of the aggregate:
    /// `partitions` partitions, each held by one consumer at a time through
    /// an advisory lock, rebalanced (every second or so) to a fair share as
    /// consumers join and leave. A partition is handed over only once
    /// nothing of it is in flight, so per-aggregate order holds; there is
    /// no order between aggregates.
    Partitioned {
        /// Number of partitions (default in the relay: 16). Every consumer
        /// of one outbox must use the same number.
        partitions: u32,
    },
    /// Competing consumers, as the schema's original design planned for
    /// scaling out (docs/schema.md): each fetch claims due rows with
    /// `FOR UPDATE SKIP LOCKED` in a transaction kept open until the batch
    /// is settled, so consumers never deliver the same row at once. **No
    /// order at all**, not even per aggregate, and no hold-back behind
    /// failed events: for events whose order does not matter.
    Competing,
}

/// Settings of a consumer. Build it with [`Consumer::builder`].
#[derive(Debug, Clone)]
pub(crate) struct ConsumerConfig {
    pub(crate) pg: connect::ConnectOptions,
    pub(crate) listener_pg: Option<connect::ConnectOptions>,
    pub(crate) batch_size: usize,
    pub(crate) buffer: usize,
    pub(crate) max_buffered_bytes: usize,
    pub(crate) sweep_interval: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) max_retries: i32,
    pub(crate) ack_batch_size: usize,
    pub(crate) ack_interval: Duration,
    pub(crate) reconnect_max_delay: Duration,
    pub(crate) ping_interval: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) statement_timeout: Duration,
    pub(crate) mode: Mode,
    pub(crate) listen: bool,
}

impl ConsumerConfig {
    /// Startup settings of the consumer's own sessions: the statement
    /// timeout, and the server's check for a vanished client while a
    /// statement runs.
    pub(crate) fn session(&self) -> connect::SessionSettings {
        connect::SessionSettings { statement_timeout: Some(self.statement_timeout), check_client_connection: true }
    }
}

/// Entry point of the consuming side. See [`Consumer::builder`].
#[derive(Debug)]
pub struct Consumer(());

impl Consumer {
    /// A builder for a consumer of `events.outbox` on the database `pg`:
    /// [`ConnectOptions`](crate::ConnectOptions) from [`ConnectOptions::parse`](crate::ConnectOptions::parse)
    /// (TLS settings included), or a plain `tokio_postgres::Config` (its
    /// `sslmode` disable/prefer/require carries over).
    ///
    /// # Example
    /// ```no_run
    /// # async fn run() -> Result<(), pg_outbox::Error> {
    /// use futures::StreamExt;
    /// let pg = pg_outbox::ConnectOptions::parse("postgres://postgres@127.0.0.1/app")?;
    /// let mut events = pg_outbox::Consumer::builder(pg).batch_size(100).start().await?;
    /// while let Some(delivery) = events.next().await {
    ///     println!("{} {}", delivery.id, delivery.event_type);
    ///     delivery.ack();
    /// }
    /// # Ok(()) }
    /// ```
    pub fn builder(pg: impl Into<connect::ConnectOptions>) -> ConsumerBuilder {
        ConsumerBuilder {
            cfg: ConsumerConfig {
                pg: pg.into(),
                listener_pg: None,
                batch_size: DEFAULT_BATCH_SIZE,
                buffer: 0,
                max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
                sweep_interval: DEFAULT_SWEEP_INTERVAL,
                retry: RetryPolicy::default(),
                max_retries: DEFAULT_MAX_RETRIES,
                ack_batch_size: DEFAULT_ACK_BATCH_SIZE,
                ack_interval: DEFAULT_ACK_INTERVAL,
                reconnect_max_delay: DEFAULT_RECONNECT_MAX_DELAY,
                ping_interval: DEFAULT_PING_INTERVAL,
                shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
                statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
                mode: Mode::Single,
                listen: true,
            },
        }
    }
}

/// Builds and starts a consumer. Every setter documents its default.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until start() is called"]
pub struct ConsumerBuilder {
    cfg: ConsumerConfig,
}

impl ConsumerBuilder {
    /// Rows fetched per query (default [`DEFAULT_BATCH_SIZE`], 500; the schema's original poller fetches 50). A backlog is drained in batches
    /// of this size and is never read into memory at once.
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.cfg.batch_size = rows;
        self
    }

    /// Deliveries buffered ahead of the stream's reader, in rows (default:
    /// twice the batch size). The next batch is fetched while the reader
    /// works through the buffer. The payloads they hold are bounded apart,
    /// in bytes ([`Self::max_buffered_bytes`]).
    pub fn buffer(mut self, rows: usize) -> Self {
        self.cfg.buffer = rows;
        self
    }

    /// Bound on the payload bytes this consumer holds (default
    /// [`DEFAULT_MAX_BUFFERED_BYTES`], 64 MiB; at least
    /// [`MIN_MAX_BUFFERED_BYTES`], 1 MiB): the payloads of every event
    /// fetched and not yet settled, whether it waits in the stream's buffer
    /// or is in the reader's hands, unacknowledged.
    ///
    /// A payload counts as received: the `jsonb` value's binary form, a
    /// version byte and the JSON text. Memory held for it is about that
    /// once parsed into [`serde_json::Value`] for payloads made of long
    /// strings; for payloads of many small fields the parsed value takes
    /// more (a few times the text), which this bound does not count. A
    /// fetch's rows are decoded as they arrive, each row's bytes dropped
    /// before the next is read, so they add one row at a time. Measured
    /// (`drain` scenario of the e2e bench, 300 payloads of 1 MiB, a quick
    /// run on a shared machine): a Consumer peaked at 139 MiB of RSS with
    /// the default bound, 312 MiB with none; the relay at 84 and 318 MiB.
    ///
    /// Each fetch asks for at most the bound minus what is held, and the
    /// server stops sending at it (the rows before each must add up to
    /// less), so what is held stays under the bound plus one event: one
    /// payload larger than the bound still moves, alone. No fetch starts
    /// while the held payloads reach the bound; one starts again once at
    /// least half of it is free, or, below the bound, when the reader has
    /// emptied the buffer and waits (so fetches stay large, as in rows: the
    /// next batch is fetched once a batch of room is free).
    ///
    /// Both bounds hold at once: a fetch takes at most [`Self::batch_size`]
    /// rows and the stream buffers at most [`Self::buffer`] of them, so with
    /// payloads under about 64 KiB the rows bind first and this bound
    /// changes nothing.
    ///
    /// **Deliveries kept unacknowledged count**: a reader that holds
    /// deliveries until it has received more (to settle them in groups, say)
    /// must hold fewer than the bound's worth, or the stream stalls: it
    /// hands out nothing more until some of them are acknowledged, failed
    /// or dropped. (Settled ones stop counting as soon as the consumer takes
    /// the settlement in, before it is written: the payload is gone with the
    /// delivery.)
    ///
    /// The relay's flag `--max-buffered-bytes` sets it; the relay hands one
    /// delivery at a time to its sink, so the bound covers the relay too.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).max_buffered_bytes(16 * 1024 * 1024)
    /// # }
    /// ```
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.cfg.max_buffered_bytes = bytes;
        self
    }

    /// Interval of the fallback sweep (default 1 s, plus up to 10 % jitter).
    /// A lost notification delays an event by at most this long.
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.cfg.sweep_interval = interval;
        self
    }

    /// The retry ladder (default [`RetryPolicy::default`]: 1 min, 5 min,
    /// 15 min, 1 h, then doubling, capped at 24 h, with 0–10 % jitter).
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.cfg.retry = policy;
        self
    }

    /// Dead-letter threshold (default 10): the failure that brings
    /// `retry_count` to this value makes the event a dead letter.
    pub fn max_retries(mut self, n: i32) -> Self {
        self.cfg.max_retries = n;
        self
    }

    /// Flush acknowledgements once this many are pending (default 500).
    pub fn ack_batch_size(mut self, n: usize) -> Self {
        self.cfg.ack_batch_size = n;
        self
    }

    /// Flush pending acknowledgements at the latest this long after the
    /// first of them (default 10 ms).
    pub fn ack_interval(mut self, interval: Duration) -> Self {
        self.cfg.ack_interval = interval;
        self
    }

    /// Longest wait between reconnect attempts (default 30 s; attempts
    /// start at 100 ms and double, with jitter).
    pub fn reconnect_max_delay(mut self, delay: Duration) -> Self {
        self.cfg.reconnect_max_delay = delay;
        self
    }

    /// Liveness ping interval on the idle LISTEN connection (default 5 s).
    pub fn ping_interval(mut self, interval: Duration) -> Self {
        self.cfg.ping_interval = interval;
        self
    }

    /// How long a graceful shutdown waits for deliveries already handed out
    /// to be acknowledged or failed (default 30 s). Those still open then are
    /// released: not published, delivered again later.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.cfg.shutdown_grace = grace;
        self
    }

    /// The longest a statement of the consumer's own sessions (drain,
    /// writer, LISTEN) may run before the server cancels it (default
    /// [`DEFAULT_STATEMENT_TIMEOUT`], 60 s; zero disables it, as in
    /// PostgreSQL; at most `i32::MAX` milliseconds, about 24.8 days).
    ///
    /// Sent as `-c statement_timeout=...` when each session starts; an
    /// `options` setting of the database URL wins over it. The sessions also
    /// get `client_connection_check_interval` (5 s, on PostgreSQL 14 and
    /// later), so a statement whose relay vanished ends within seconds.
    /// When a statement times out the consumer logs a warning naming it,
    /// counts it in `outbox_statement_timeouts_total{statement}`, and
    /// reconnects with backoff as after other database errors: nothing is
    /// marked published and no attempt is counted as failed because of it.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).statement_timeout(std::time::Duration::from_secs(10))
    /// # }
    /// ```
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.cfg.statement_timeout = timeout;
        self
    }

    /// Use a different database address for the LISTEN connection (default:
    /// the same as the work connection). LISTEN needs a direct or
    /// session-mode connection; it does not work through a transaction-mode
    /// pooler.
    pub fn listener_config(mut self, pg: impl Into<connect::ConnectOptions>) -> Self {
        self.cfg.listener_pg = Some(pg.into());
        self
    }

    /// How consumers of one outbox share it (default [`Mode::Single`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.cfg.mode = mode;
        self
    }

    /// Whether to LISTEN for notifications (default true). With `false`
    /// only the sweep finds events (every sweep interval): for environments
    /// without LISTEN, such as a transaction-mode pooler.
    pub fn listen(mut self, listen: bool) -> Self {
        self.cfg.listen = listen;
        self
    }

    fn validate(&mut self) -> Result<()> {
        let c = &mut self.cfg;
        if c.batch_size == 0 || c.batch_size > 100_000 {
            return Err(Error::Config(format!("batch size must be 1..=100000 rows, got {}", c.batch_size)));
        }
        if c.buffer == 0 {
            c.buffer = c.batch_size * 2;
        }
        c.buffer = c.buffer.max(c.batch_size);
        if c.max_buffered_bytes < MIN_MAX_BUFFERED_BYTES || i64::try_from(c.max_buffered_bytes).is_err() {
            return Err(Error::Config(format!(
                "max buffered bytes must be at least {MIN_MAX_BUFFERED_BYTES} (1 MiB), got {}",
                c.max_buffered_bytes
            )));
        }
        if c.sweep_interval.is_zero() {
            return Err(Error::Config("sweep interval must be longer than zero".into()));
        }
        if c.max_retries < 1 {
            return Err(Error::Config(format!("max retries must be at least 1, got {}", c.max_retries)));
        }
        if c.ack_batch_size == 0 {
            return Err(Error::Config("acknowledgement batch size must be at least 1".into()));
        }
        if let Mode::Partitioned { partitions } = c.mode
            && !(1..=4096).contains(&partitions)
        {
            return Err(Error::Config(format!("partitions must be 1..=4096, got {partitions}")));
        }
        if c.ping_interval.is_zero() || c.reconnect_max_delay.is_zero() {
            return Err(Error::Config("ping interval and reconnect delay must be longer than zero".into()));
        }
        if c.statement_timeout > MAX_STATEMENT_TIMEOUT {
            return Err(Error::Config(format!(
                "statement timeout must be at most {} ms (about 24.8 days; 0 disables it), got {:?}",
                i32::MAX,
                c.statement_timeout
            )));
        }
        Ok(())
    }

    /// Connect, check the schema, LISTEN, and start the background tasks.
    ///
    /// Spawns two tasks on the current Tokio runtime: the notifier (a
    /// dedicated LISTEN connection that never opens a transaction) and the
    /// drain loop (fetch, hand out, write acknowledgements in batches). A
    /// first drain runs at once.
    ///
    /// # Errors
    /// [`Error::Config`] for out-of-range settings; [`Error::Connect`] if the
    /// database cannot be reached (the first connection fails fast; later
    /// losses are retried with backoff); [`Error::NotMigrated`] if the
    /// schema has not been migrated.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future before it resolves closes the sessions it
    /// opened (and with them any lock they took); nothing was fetched yet.
    pub async fn start(mut self) -> Result<EventStream> {
        self.validate()?;
        let cfg = Arc::new(self.cfg);
        let (work, work_link) = connect::connect(&cfg.pg, "pg-outbox drain", &cfg.session()).await?;
        crate::migrate::check(&work).await?;
        match crate::migrate::ordering(&work).await? {
            Some(mode) => tracing::info!(ordering = %mode, "ordering mode installed on events.outbox: {mode}"),
            None => tracing::warn!(
                "no insert trigger is enabled on events.outbox: new events are found by the sweep only, and \
                 racing producers can commit an aggregate's events out of order; enable one with \
                 `pg-outbox migrate --ordering outbox-locked`"
            ),
        }
        let wake = Arc::new(Notify::new());
        let reconnect_wake = Arc::new(Notify::new());
        let (status_tx, status_rx) = watch::channel(ListenerStatus::default());
        let token = CancellationToken::new();
        let wakes = (wake.clone(), reconnect_wake.clone());
        let notifier = start_notifier(&cfg, &work, wakes, token.child_token(), status_tx).await?;
        let (tx, rx) = mpsc::channel(cfg.buffer);
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        let shared =
            Arc::new(Shared { holdback: holdback::HoldBack::default(), settle_tx, reader_waiting: Notify::new() });
        let io = drain::Io { tx, settle_rx, wake, reconnect_wake };
        let health = HealthMonitor::new(Arc::new(health::State::new(&cfg)), status_rx.clone());
        let drain = tokio::spawn(drain::run(
            cfg.clone(),
            (work, work_link),
            io,
            shared.clone(),
            token.clone(),
            health.state().clone(),
        ));
        Ok(EventStream {
            rx,
            shared,
            token: token.clone(),
            cancelled: Box::pin(token.clone().cancelled_owned()),
            tasks: Some((drain, notifier)),
            status: status_rx,
            health,
            grace: cfg.shutdown_grace,
            done: false,
        })
    }
}

/// Start the notifier (LISTEN on its own session) unless LISTEN is off,
/// after checking that a notification sent on `work` comes back: when none
/// does within [`PROBE_TIMEOUT`] (a transaction-mode pooler, a replica), the
/// consumer runs on sweeps alone and says so.
async fn start_notifier(
    cfg: &Arc<ConsumerConfig>,
    work: &tokio_postgres::Client,
    (wake, reconnect_wake): (Arc<Notify>, Arc<Notify>),
    token: CancellationToken,
    status_tx: watch::Sender<ListenerStatus>,
) -> Result<Option<JoinHandle<()>>> {
    metrics::gauge!(crate::metrics::LISTEN_ENABLED).set(if cfg.listen { 1.0 } else { 0.0 });
    if !cfg.listen {
        metrics::gauge!(crate::metrics::NOTIFICATIONS_WORKING).set(0.0);
        tracing::info!(sweep_interval = ?cfg.sweep_interval, "LISTEN disabled: sweep-only mode");
        return Ok(None);
    }
    let listener_pg = cfg.listener_pg.clone().unwrap_or_else(|| cfg.pg.clone());
    let (probe_tx, mut probe_rx) = watch::channel(String::new());
    let first_listener = notifier::listen(&listener_pg, &cfg.session(), wake.clone(), probe_tx.clone()).await?;
    let probe = format!("{}{}", notifier::PROBE_PREFIX, Uuid::new_v4());
    work.execute(crate::store::NOTIFY, &[&NOTIFY_CHANNEL, &probe]).await?;
    let came_back = tokio::time::timeout(PROBE_TIMEOUT, probe_rx.wait_for(|p| *p == probe)).await.is_ok();
    metrics::gauge!(crate::metrics::NOTIFICATIONS_WORKING).set(if came_back { 1.0 } else { 0.0 });
    if came_back {
        tracing::info!(channel = NOTIFY_CHANNEL, "notifications work: LISTEN connection receives them");
    } else {
        tracing::warn!(
            channel = NOTIFY_CHANNEL,
            sweep_interval = ?cfg.sweep_interval,
            "a test notification did not come back within {PROBE_TIMEOUT:?} (transaction-mode pooler? replica?): \
             running in sweep-only mode; events may wait up to one sweep interval"
        );
    }
    Ok(Some(tokio::spawn(notifier::run(
        listener_pg,
        first_listener,
        wake,
        reconnect_wake,
        probe_tx,
        token,
        status_tx,
        cfg.clone(),
    ))))
}

/// The drain loop's and the notifier's task handles.
type Tasks = (JoinHandle<()>, Option<JoinHandle<()>>);

/// State of the LISTEN connection, for monitoring and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStatus {
    /// True while the LISTEN connection is up and listening.
    pub listening: bool,
    /// Successful reconnects since start (the first connection is not counted).
    pub reconnects: u64,
}

/// What the drain loop and the deliveries share.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Per-aggregate hold-back of deliveries already fetched.
    pub(crate) holdback: holdback::HoldBack,
    /// Settlements, to the drain loop.
    pub(crate) settle_tx: mpsc::UnboundedSender<delivery::Settlement>,
    /// The stream's reader found the buffer empty and waits: the drain
    /// loop may fetch below the byte bound although less than half of it
    /// is free ([`ConsumerBuilder::max_buffered_bytes`]).
    pub(crate) reader_waiting: Notify,
}

impl Shared {
    /// Must `d` be released instead of handed out ([`holdback`])?
    fn is_held(&self, d: &Delivery) -> bool {
        self.holdback.is_held(&d.aggregate_type, d.aggregate_id, d.seq())
    }
}

/// The consumer's stream of deliveries, in id order.
///
/// Each [`Delivery`] must be acknowledged ([`Delivery::ack`]) or failed
/// ([`Delivery::fail`]); one dropped without either is released: nothing is
/// written, and the event is delivered again on a later fetch.
///
/// Order: events are handed out in ascending id. An event waiting for a
/// retry, or a dead letter, holds back the later events of its aggregate;
/// other aggregates go on. For this to hold end to end, settle an
/// aggregate's deliveries one after another (a reader that handles several
/// deliveries of one aggregate at once decides their order itself).
///
/// The stream ends (`None`) after [`EventStream::shutdown`] or
/// [`ShutdownHandle::shutdown`]; deliveries still buffered then are released.
/// Dropping the stream also stops the consumer.
///
/// # Cancel safety
/// `next()` is cancel safe: a delivery is either returned or stays buffered.
#[derive(Debug)]
pub struct EventStream {
    rx: mpsc::Receiver<Delivery>,
    shared: Arc<Shared>,
    token: CancellationToken,
    tasks: Option<Tasks>,
    status: watch::Receiver<ListenerStatus>,
    health: HealthMonitor,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    grace: Duration,
    done: bool,
}

impl EventStream {
    /// A handle that can stop this consumer from another task.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle { token: self.token.clone() }
    }

    /// Stop fetching; the stream then ends. Idempotent. Call
    /// [`EventStream::finish`] to wait for the final acknowledgements.
    pub fn shutdown(&self) {
        self.token.cancel();
    }

    /// The shutdown grace this consumer was built with (default 30 s).
    pub fn shutdown_grace(&self) -> Duration {
        self.grace
    }

    /// Watch the LISTEN connection's state.
    pub fn listener_status(&self) -> watch::Receiver<ListenerStatus> {
        self.status.clone()
    }

    /// A handle that reads this consumer's [`Health`]: whether its drain
    /// loop still turns, whether its database sessions are open, its
    /// [`Role`], the LISTEN connection's state, the last database error,
    /// and (under `relay::run`) the sink's side. Cheap
    /// to clone and to read; meant for liveness and readiness probes (the
    /// relay's `/livez` and `/readyz` are built on it).
    ///
    /// # Example
    /// ```no_run
    /// # async fn run(pg: pg_outbox::ConnectOptions) -> Result<(), pg_outbox::Error> {
    /// let events = pg_outbox::Consumer::builder(pg).start().await?;
    /// let health = events.health();
    /// tokio::spawn(async move {
    ///     loop {
    ///         let h = health.get();
    ///         if !h.live {
    ///             eprintln!("drain loop stalled for {:?}", h.since_last_turn);
    ///         }
    ///         tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    ///     }
    /// });
    /// # Ok(()) }
    /// ```
    pub fn health(&self) -> HealthMonitor {
        self.health.clone()
    }

    /// Stop (if not stopped yet), release buffered deliveries, wait until
    /// every delivery already handed out is settled (up to the shutdown
    /// grace), write the final acknowledgements, and close the connections.
    ///
    /// Database errors while the consumer runs are retried (with backoff),
    /// never returned; settlements that could not be written by the end are
    /// logged as an error, and those events are delivered again.
    ///
    /// # Errors
    /// [`Error::Io`] only if the drain task panicked.
    ///
    /// # Cancel safety
    /// Cancel safe: the consumer is told to stop before the first await, and
    /// its tasks finish stopping on their own (final acknowledgements
    /// included) if the future is dropped; only the wait for them is given up.
    pub async fn finish(mut self) -> Result<()> {
        self.token.cancel();
        self.release_buffered();
        match self.tasks.take() {
            Some((mut drain, notifier)) => {
                // Keep releasing what a fetch in progress still hands out, so
                // the drain loop does not wait for deliveries nobody will read.
                let mut open = true;
                let r = loop {
                    tokio::select! {
                        r = &mut drain => break r,
                        d = self.rx.recv(), if open => match d {
                            Some(d) => drop(d),
                            None => open = false,
                        },
                    }
                };
                if let Some(n) = notifier {
                    let _ = n.await;
                }
                r.map_err(|e| Error::Io(std::io::Error::other(e)))
            }
            None => Ok(()),
        }
    }

    fn release_buffered(&mut self) {
        self.rx.close();
        while let Ok(d) = self.rx.try_recv() {
            drop(d); // Drop releases it
        }
    }
}

impl Stream for EventStream {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.token.is_cancelled() {
            self.done = true;
            self.release_buffered();
            return Poll::Ready(None);
        }
        loop {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(d)) => {
                    if self.shared.is_held(&d) {
                        d.release_held();
                        continue;
                    }
                    return Poll::Ready(Some(d));
                }
                Poll::Ready(None) => {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    self.shared.reader_waiting.notify_one();
                    // Also wake up when shutdown is requested.
                    if self.cancelled.as_mut().poll(cx).is_ready() {
                        self.done = true;
                        self.release_buffered();
                        return Poll::Ready(None);
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl FusedStream for EventStream {
    fn is_terminated(&self) -> bool {
        self.done
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Stops a consumer from another task; cheap to clone.
#[derive(Debug, Clone)]
pub struct ShutdownHandle {
    token: CancellationToken,
}

impl ShutdownHandle {
    /// Stop fetching: the stream ends, buffered deliveries are released, and
    /// the drain loop waits (up to the shutdown grace) for deliveries already
    /// handed out, then writes the final acknowledgements. Idempotent; does
    /// not wait (use [`EventStream::finish`]).
    pub fn shutdown(&self) {
        self.token.cancel();
    }

    /// True once shutdown was requested.
    pub fn is_shutdown(&self) -> bool {
        self.token.is_cancelled()
    }
}

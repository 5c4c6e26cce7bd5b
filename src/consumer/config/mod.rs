//! The consumer's configuration: defaults, the builder, and validation
//! (`validate`).

mod validate;

use std::time::Duration;

use crate::connect;
use crate::migrate::SourceKind;
use crate::retry::RetryPolicy;
use crate::store::AckCommit;
use crate::store::subscription::Reader;
use crate::store::subscription_admin::DEFAULT_NAME;

/// The largest statement timeout the server takes: `i32::MAX` ms.
const MAX_STATEMENT_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);
/// Interval at which the backlog gauges are refreshed: 5 seconds.
pub(crate) const STATUS_INTERVAL: Duration = Duration::from_secs(5);
/// How long start waits for its test notification to come back: 2 s.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

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
    pub(crate) source: SourceKind,
    pub(crate) stranded_after: Duration,
    pub(crate) take_over_stranded: bool,
    pub(crate) wait_for_primary: bool,
    pub(crate) producers_lock_aggregates: bool,
    /// Whose events it reads: the default subscription, or a named one.
    pub(crate) reader: Reader,
    /// How a named subscription's settlements commit
    /// ([`ConsumerBuilder::durable_acknowledgements`]).
    pub(crate) ack_commit: AckCommit,
}

impl ConsumerConfig {
    /// How often the heartbeat is refreshed and a standby looks at the
    /// holder of the outbox lock: a third of the stranded threshold.
    pub(crate) fn heartbeat_interval(&self) -> Duration {
        self.stranded_after / 3
    }

    /// Whether this consumer takes leadership on its work session (single
    /// and partitioned modes; competing mode takes none).
    pub(crate) fn leads(&self) -> bool {
        !matches!(self.mode, Mode::Competing)
    }

    /// Startup settings of the consumer's own sessions: the statement
    /// timeout, the server's check for a vanished client while a statement
    /// runs, no `idle_session_timeout` (so a server or database that closes
    /// idle sessions leaves the writer and LISTEN sessions alone), and a
    /// writable server (a standby is refused).
    pub(crate) fn session(&self) -> connect::SessionSettings {
        connect::SessionSettings {
            statement_timeout: Some(self.statement_timeout),
            check_client_connection: true,
            keep_when_idle: true,
            pinned: true,
            primary: true,
        }
    }
}

/// Entry point of the consuming side. See [`Consumer::builder`].
#[derive(Debug)]
pub struct Consumer(());

impl Consumer {
    /// The channel the insert trigger notifies and the consumer listens on:
    /// `events.outbox` (`triggers/outbox_insert_order_and_notify.sql`).
    pub const NOTIFY_CHANNEL: &'static str = crate::store::NOTIFY_CHANNEL;

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
                batch_size: ConsumerBuilder::DEFAULT_BATCH_SIZE,
                buffer: 0,
                max_buffered_bytes: ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES,
                sweep_interval: ConsumerBuilder::DEFAULT_SWEEP_INTERVAL,
                retry: RetryPolicy::default(),
                max_retries: ConsumerBuilder::DEFAULT_MAX_RETRIES,
                ack_batch_size: ConsumerBuilder::DEFAULT_ACK_BATCH_SIZE,
                ack_interval: ConsumerBuilder::DEFAULT_ACK_INTERVAL,
                reconnect_max_delay: ConsumerBuilder::DEFAULT_RECONNECT_MAX_DELAY,
                ping_interval: ConsumerBuilder::DEFAULT_PING_INTERVAL,
                shutdown_grace: ConsumerBuilder::DEFAULT_SHUTDOWN_GRACE,
                statement_timeout: ConsumerBuilder::DEFAULT_STATEMENT_TIMEOUT,
                mode: Mode::Single,
                listen: true,
                source: SourceKind::Listen,
                stranded_after: ConsumerBuilder::DEFAULT_STRANDED_AFTER,
                take_over_stranded: false,
                wait_for_primary: false,
                producers_lock_aggregates: false,
                ack_commit: AckCommit::default(),
                reader: Reader::Default,
            },
        }
    }
}

/// Builds and starts a consumer. Every setter documents its default.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until start() is called"]
pub struct ConsumerBuilder {
    pub(super) cfg: ConsumerConfig,
}

/// The defaults and bounds of the builder's settings.
impl ConsumerBuilder {
    /// Default rows fetched per query: 500 (the schema's original poller query,
    /// FetchUnpublishedBatch in docs/schema.md, takes 50; docs/performance.md, "Batch sizes", says why 500). A fetch
    /// returns at once with what is there, so a small backlog is not delayed.
    /// The stream buffers up to twice the batch, and payloads within
    /// [`ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES`].
    pub const DEFAULT_BATCH_SIZE: usize = 500;
    /// The most rows a fetch may ask for: 100 000. A larger
    /// [`ConsumerBuilder::batch_size`] makes [`ConsumerBuilder::start`] fail
    /// with [`Error::Config`](crate::Error::Config).
    pub const MAX_BATCH_SIZE: usize = 100_000;
    /// Default bound on the payload bytes a consumer holds: 64 MiB
    /// ([`ConsumerBuilder::max_buffered_bytes`]). Before it, only rows bounded
    /// what a consumer holds: twice the batch of 500, so with payloads near the
    /// publisher's 1 MiB limit ([`Publisher::DEFAULT_MAX_PAYLOAD_BYTES`](crate::Publisher::DEFAULT_MAX_PAYLOAD_BYTES)) about
    /// 1 GB. The default buffer of 1 000 rows reaches 64 MiB only with payloads
    /// of about 64 KiB or more, so for smaller ones (the bench's envelope is
    /// 1.5 KB) the rows bind first and nothing changes; the bound binds where
    /// payloads are large.
    pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 * 1024 * 1024;
    /// The smallest byte bound [`ConsumerBuilder::max_buffered_bytes`] takes:
    /// 1 MiB, the publisher's default payload limit
    /// ([`Publisher::DEFAULT_MAX_PAYLOAD_BYTES`](crate::Publisher::DEFAULT_MAX_PAYLOAD_BYTES)). A smaller bound would still
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
    /// Default longest wait between reconnect attempts: 10 seconds. Attempts
    /// start after 100–200 ms and the wait doubles (with jitter) up to it, so
    /// after a failover, a restart or a suspended server that resumes, the
    /// consumer is back within about this long of the server (bar the connect
    /// itself); while the server stays away, it costs a connection attempt per
    /// session every 5–10 s.
    pub const DEFAULT_RECONNECT_MAX_DELAY: Duration = Duration::from_secs(10);
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
    /// Default age of the heartbeat after which the holder of single mode's
    /// outbox lock counts as stranded: 15 s ([`ConsumerBuilder::stranded_after`]).
    /// The active consumer refreshes its heartbeat every third of it (5 s), and
    /// a standby looks at the holder every third of it too, and reports it once
    /// it found it stranded twice in a row: a holder that stopped is reported
    /// within 26 s (15 s, then two looks, each 5 s plus up to 10 % jitter
    /// apart), under the 30 s the design asks.
    pub const DEFAULT_STRANDED_AFTER: Duration = crate::store::leader::DEFAULT_STRANDED_AFTER;
    /// The shortest [`ConsumerBuilder::stranded_after`]: 3 s (a heartbeat every
    /// second).
    pub const MIN_STRANDED_AFTER: Duration = Duration::from_secs(3);
    /// The longest [`ConsumerBuilder::stranded_after`]: 1 hour.
    pub const MAX_STRANDED_AFTER: Duration = Duration::from_secs(3600);
    /// Default time graceful shutdown waits for handed-out deliveries: 30 s.
    pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
}

impl ConsumerBuilder {
    /// Rows fetched per query (default [`ConsumerBuilder::DEFAULT_BATCH_SIZE`], 500; the schema's original poller fetches 50). A backlog is drained in batches
    /// of this size and is never read into memory at once. 1 to
    /// [`ConsumerBuilder::MAX_BATCH_SIZE`]; outside, [`ConsumerBuilder::start`]
    /// fails with [`Error::Config`](crate::Error::Config).
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
    /// [`ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES`], 64 MiB; at least
    /// [`ConsumerBuilder::MIN_MAX_BUFFERED_BYTES`], 1 MiB): the payloads of every event
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

    /// Longest wait between reconnect attempts (default
    /// [`ConsumerBuilder::DEFAULT_RECONNECT_MAX_DELAY`], 10 s). The first attempt after a
    /// loss comes after 100–200 ms, and each wait doubles, with jitter,
    /// up to this bound (the jitter stays within it: once there, waits are
    /// between half the bound and the bound). It bounds how long the
    /// consumer takes to come back once the server does (a failover, a
    /// restart): at most about this long, plus the connect. The relay's
    /// flag `--reconnect-max-delay` sets it.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).reconnect_max_delay(std::time::Duration::from_secs(2))
    /// # }
    /// ```
    pub fn reconnect_max_delay(mut self, delay: Duration) -> Self {
        self.cfg.reconnect_max_delay = delay;
        self
    }

    /// At start, wait for a standby to be promoted instead of failing
    /// (default `false`).
    ///
    /// Without it, [`ConsumerBuilder::start`] fails with
    /// [`Error::ReadOnlyStandby`](crate::Error::ReadOnlyStandby) when the server (every host of a
    /// multi-host URL that answers) is a hot standby: the consumer writes
    /// (it marks events published), so it needs the primary. With it,
    /// `start` tries again with the reconnect backoff (up to
    /// [`ConsumerBuilder::reconnect_max_delay`]) for as long as the server
    /// answers as a standby, logging once when it starts waiting and once
    /// when the server is promoted (not at every try), and goes on once a
    /// host accepts writes. Other errors end the wait as they end `start`.
    /// Cancel the wait by dropping the future. The relay's flag
    /// `--wait-for-primary` sets it.
    ///
    /// Once started, a consumer always rides out a failover this way: a
    /// reconnect that lands on a standby backs off and tries again.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).wait_for_primary(true)
    /// # }
    /// ```
    pub fn wait_for_primary(mut self, wait: bool) -> Self {
        self.cfg.wait_for_primary = wait;
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
    /// [`ConsumerBuilder::DEFAULT_STATEMENT_TIMEOUT`], 60 s; zero disables it, as in
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

    /// Read subscription `name` instead of the default subscription
    /// (default: the default subscription, the seeded flow of
    /// `published_at` and the retry columns on the row).
    ///
    /// A subscription is one more reader of the same outbox, created with
    /// `pg-outbox subscription create NAME` (docs/subscriptions.md), with
    /// its own progress (a cursor), retries, dead letters and hold-back per
    /// aggregate: acknowledging an event here leaves it unpublished for
    /// the default subscription and every other one. It has its own leader
    /// (its own advisory lock and leadership term, scope
    /// `subscription:NAME`), so relays of different subscriptions run side
    /// by side, each with its own standbys. Any mode: [`Mode::Partitioned`]
    /// takes its own partition locks and terms (scope
    /// `subscription:NAME:partition:P/N`) and its partitions share one
    /// cursor, read at most 20 000 ids ahead of it; [`Mode::Competing`]
    /// claims each event with a transaction-level advisory lock of a class
    /// of the subscription's own (no order, no hold-back; docs/subscriptions.md,
    /// "Competing mode"), within the same 20 000 ids.
    ///
    /// # Errors
    /// [`ConsumerBuilder::start`] returns [`Error::Config`](crate::Error::Config) when `name` is
    /// not a subscription's name (1 to 63 characters of `a-z`, `0-9`, `_`,
    /// `.`, `-`; not `default`), when
    /// other relays of the subscription run in another mode or partition
    /// count, when
    /// the subscription does not exist, or when ids do not follow
    /// transaction ids (the insert trigger `outbox_order` is needed: without
    /// it the cursor could pass an event that commits late).
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).subscription("audit")
    /// # }
    /// ```
    pub fn subscription(mut self, name: impl Into<String>) -> Self {
        let name: String = name.into();
        self.cfg.reader = if name == DEFAULT_NAME { Reader::Default } else { Reader::Subscription(name.into()) };
        self
    }

    /// Whether a named subscription's acknowledgements wait for the WAL
    /// to reach disk (default `false`; flag `--durable-acks`). The default
    /// subscription's `published_at` always commits as the session says:
    /// [`ConsumerBuilder::start`] refuses `true` for it with
    /// [`Error::Config`](crate::Error::Config).
    ///
    /// By default a named subscription's settlements (its cursor moves,
    /// retries and dead letters) commit with `synchronous_commit = off`
    /// for their own transaction (PostgreSQL docs, "Asynchronous Commit"),
    /// so that readers do not take WAL flushes from producers
    /// (docs/performance.md, "Subscriptions"). A server crash, or a
    /// failover even to a synchronous standby, then loses the settlements
    /// of the last moments (up to three times `wal_writer_delay`, 600 ms at
    /// its default): their events may be **delivered again, never lost**,
    /// since the WAL keeps its order and what survives is a prefix of it.
    /// With `true` they commit as the session's `synchronous_commit` says
    /// (`on` unless the role, the database or the URL's `options` set it),
    /// and only what was in flight is delivered again.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).subscription("audit").durable_acknowledgements(true)
    /// # }
    /// ```
    pub fn durable_acknowledgements(mut self, durable: bool) -> Self {
        self.cfg.ack_commit = if durable { AckCommit::Durable } else { AckCommit::Asynchronous };
        self
    }

    /// How consumers of one outbox share it (default [`Mode::Single`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.cfg.mode = mode;
        self
    }

    /// Whether to LISTEN for notifications (default true). With `false`
    /// only the sweep finds events (every sweep interval): for a server
    /// whose notifications never arrive, or producers that use two-phase
    /// commit. Not a way through a transaction-mode pooler: the consumer's
    /// locks are its sessions', and [`ConsumerBuilder::start`] refuses one
    /// either way.
    pub fn listen(mut self, listen: bool) -> Self {
        self.cfg.listen = listen;
        self
    }

    /// Where the consumer learns that events committed (default
    /// [`SourceKind::Listen`]). With `SourceKind::Wal` (feature `wal`) the consumer does
    /// not LISTEN ([`ConsumerBuilder::listen`] is ignored) and registers as
    /// never waiting for a notification, so producers skip NOTIFY.
    pub fn source(mut self, source: SourceKind) -> Self {
        self.cfg.source = source;
        self
    }

    /// How old the active consumer's heartbeat may get before a standby
    /// counts the holder of the outbox lock as stranded (single mode;
    /// default [`ConsumerBuilder::DEFAULT_STRANDED_AFTER`], 15 s; from [`ConsumerBuilder::MIN_STRANDED_AFTER`],
    /// 3 s, to [`ConsumerBuilder::MAX_STRANDED_AFTER`], 1 hour).
    ///
    /// The active consumer refreshes its heartbeat (`updated_at` of its row
    /// in `events.outbox_relays`) every third of this; a standby looks at
    /// the lock's holder (`pg_locks`, `pg_stat_activity` and that row) every
    /// third of it, and counts the holder stranded when it has no heartbeat
    /// this recent and runs no statement, twice in a row. It then logs a
    /// warning with the holder's pid, client address, application name and
    /// idle time and sets `outbox_leader_stranded` to 1; with
    /// [`Self::take_over_stranded`] it ends that session and takes over. A
    /// holder that stops is found within this plus two looks (a third of it
    /// each, plus up to 10 % jitter): 26 s by default. Every consumer of one
    /// outbox should use the same value: a shorter one on a standby than on
    /// the active consumer would find a live one stranded.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).stranded_after(std::time::Duration::from_secs(30))
    /// # }
    /// ```
    pub fn stranded_after(mut self, age: Duration) -> Self {
        self.cfg.stranded_after = age;
        self
    }

    /// Let a standby end a stranded holder of the outbox lock and take over
    /// (single mode; default `false`: it only reports it). A stranded holder
    /// is a session that holds the lock without a live consumer behind it
    /// ([`Self::stranded_after`]): a pooler's server session left with the
    /// lock, an older build's, a frozen process's, or one behind a network
    /// that drops its traffic. The standby ends it with
    /// `pg_terminate_backend(pid)`, in a statement that checks again that it
    /// still holds the lock and is still stranded, then takes the lock.
    /// Deliveries the ended holder had handed out and not written are
    /// delivered again (at-least-once).
    ///
    /// **Role.** PostgreSQL lets a session end another only when it is a
    /// superuser, has the privileges of the other session's role, or is a
    /// member of `pg_signal_backend`; a superuser's session only a superuser
    /// may end (PostgreSQL docs, "Server Signaling Functions"). So the
    /// consumer's role needs `GRANT pg_signal_backend TO <role>`, or to be
    /// the holder's role. When the server refuses, the standby logs one
    /// warning naming what is missing and keeps standing by.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).take_over_stranded(true)
    /// # }
    /// ```
    pub fn take_over_stranded(mut self, take_over: bool) -> Self {
        self.cfg.take_over_stranded = take_over;
        self
    }

    /// Declare that every producer locks its aggregate's row before it
    /// inserts the aggregate's events (the producer-locked contract,
    /// README "Ordering modes"; default `false`).
    ///
    /// Where the outbox runs ordering mode `producer-locked` (or has no
    /// insert trigger), per-aggregate order rests on that contract: a
    /// producer that breaks it can commit an aggregate's later event first,
    /// and the relay then delivers the earlier one after it. At least once,
    /// that costs order. Exactly once it would cost the event, if a later
    /// event counted as proof; it does not, and such an event fails instead
    /// (an error that says order broke upstream). So
    /// `relay::run_with` (feature `relay`) with an exactly-once sink refuses an
    /// outbox whose order rests on the producers unless this is `true`
    /// (flag `--producers-lock-aggregates`). It changes nothing else.
    ///
    /// # Example
    /// ```
    /// # fn f(pg: pg_outbox::ConnectOptions) -> pg_outbox::ConsumerBuilder {
    /// pg_outbox::Consumer::builder(pg).producers_lock_aggregates(true)
    /// # }
    /// ```
    pub fn producers_lock_aggregates(mut self, declared: bool) -> Self {
        self.cfg.producers_lock_aggregates = declared;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stranded_after_is_checked_and_sets_the_heartbeat_pace() {
        let pg = crate::connect::ConnectOptions::parse("postgres://u@localhost/db").expect("URL");
        let b = Consumer::builder(pg);
        assert_eq!(b.cfg.stranded_after, ConsumerBuilder::DEFAULT_STRANDED_AFTER);
        assert!(!b.cfg.take_over_stranded);
        assert_eq!(b.cfg.heartbeat_interval(), Duration::from_secs(5));
        for bad in [Duration::from_secs(2), Duration::from_secs(3601)] {
            let e = b.clone().stranded_after(bad).validate().expect_err("out of range").to_string();
            assert!(e.contains("stranded-after must be 3 s to 1 hour"), "{e}");
        }
        let mut ok = b.stranded_after(Duration::from_secs(3)).take_over_stranded(true);
        ok.validate().expect("3 s is the shortest");
        assert_eq!(ok.cfg.heartbeat_interval(), Duration::from_secs(1));
        assert!(ok.cfg.take_over_stranded);
    }
}

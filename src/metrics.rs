//! Metric names and descriptions. pg-outbox records through the `metrics`
//! facade only; install an exporter (the relay installs
//! `metrics-exporter-prometheus`) to see them. Names follow Prometheus
//! conventions: `outbox_` prefix, `_total` counters, `_seconds` units.
//!
//! This module is the one place metric names are written: the library
//! records through these constants, the integration tests read them from
//! here, and a test holds the Grafana dashboard and the alert rules
//! (`contrib/`) and the names in docs/operations.md to them.
//!
//! A consumer of a named subscription (`ConsumerBuilder::subscription`),
//! and `relay::run` on its stream, label every metric they record
//! `subscription="NAME"`, so two subscriptions read in one process keep
//! their series apart; the default subscription's carry no such label, as
//! before subscriptions existed. (The lag gauges of every subscription,
//! [`SUBSCRIPTION_LAG`] and its two siblings, name the subscription they
//! measure, whoever reads them.)

use std::future::Future;
use std::sync::Arc;

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

tokio::task_local! {
    /// The named subscription the running task works for (`None`: the
    /// default one), for the label of the metrics it records.
    static SUBSCRIPTION: Option<Arc<str>>;
}

/// `fut`, run as work for `subscription` (`None`: the default one): the
/// metrics it records through [`counter!`], [`gauge!`] and
/// [`histogram!`] carry the label `subscription="NAME"` for a named one.
pub(crate) fn for_subscription<F: Future>(
    subscription: Option<Arc<str>>,
    fut: F,
) -> tokio::task::futures::TaskLocalFuture<Option<Arc<str>>, F> {
    SUBSCRIPTION.scope(subscription, fut)
}

/// Spawn `fut` as work for `subscription` ([`for_subscription`]).
pub(crate) fn spawn_for<F>(subscription: Option<Arc<str>>, fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(SUBSCRIPTION.scope(subscription, fut))
}

/// Spawn `fut` as work for the running task's subscription.
pub(crate) fn spawn<F>(fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    spawn_for(current(), fut)
}

/// The running task's named subscription, if any.
fn current() -> Option<Arc<str>> {
    SUBSCRIPTION.try_with(Clone::clone).ok().flatten()
}

/// `labels`, and `subscription="NAME"` when the running task works for a
/// named subscription.
pub(crate) fn labelled(mut labels: Vec<metrics::Label>) -> Vec<metrics::Label> {
    if let Some(name) = current() {
        labels.push(metrics::Label::new("subscription", name.to_string()));
    }
    labels
}

/// `metrics::counter!` with the running task's subscription label
/// ([`labelled`]); labels as `"key" => value`.
macro_rules! counter {
    ($name:expr $(, $k:literal => $v:expr)* $(,)?) => {
        ::metrics::counter!($name, $crate::metrics::labelled(vec![$(::metrics::Label::new($k, $v)),*]))
    };
}

/// `metrics::gauge!` with the running task's subscription label.
macro_rules! gauge {
    ($name:expr $(, $k:literal => $v:expr)* $(,)?) => {
        ::metrics::gauge!($name, $crate::metrics::labelled(vec![$(::metrics::Label::new($k, $v)),*]))
    };
}

/// `metrics::histogram!` with the running task's subscription label.
macro_rules! histogram {
    ($name:expr $(, $k:literal => $v:expr)* $(,)?) => {
        ::metrics::histogram!($name, $crate::metrics::labelled(vec![$(::metrics::Label::new($k, $v)),*]))
    };
}

pub(crate) use {counter, gauge, histogram};

/// Counter: events acknowledged and marked published.
pub const EVENTS_PUBLISHED: &str = "outbox_events_published_total";
/// Counter: delivery attempts that failed (each failure counts once).
pub const EVENTS_FAILED: &str = "outbox_events_failed_total";
/// Counter: events that became dead letters.
pub const EVENTS_DEAD_LETTERED: &str = "outbox_events_dead_lettered_total";
/// Counter: deliveries released without acknowledgement or failure (dropped,
/// held back behind a failed event of their aggregate, or left at shutdown);
/// they are delivered again later.
pub const EVENTS_RELEASED: &str = "outbox_events_released_total";
/// Counter: events fetched from the outbox and handed out, labelled `wake`
/// by what started the drain: `notification`, `sweep` (found by the fallback
/// timer: a notification was lost or late), `retry`, `reconnect`,
/// `release`, `ownership` (became active or took partitions), `start`.
pub const EVENTS_FETCHED: &str = "outbox_events_fetched_total";
/// Histogram, seconds: from an event's `occurred_at` to its acknowledgement
/// being written (database clock).
pub const DELIVERY_LAG: &str = "outbox_delivery_lag_seconds";
/// Gauge, rows: unpublished events that are not dead letters.
pub const BACKLOG: &str = "outbox_backlog_events";
/// Gauge, rows: dead letters (unpublished, `next_retry_at = 'infinity'`).
pub const DEAD_LETTERS: &str = "outbox_dead_letters";
/// Gauge, 0 or 1: 1 while [`BACKLOG`] or [`DEAD_LETTERS`] is an estimate
/// (a class of rows over [`OutboxStatus::EXACT_ROWS`](crate::status::OutboxStatus::EXACT_ROWS); docs/operations.md,
/// "How `status` estimates"), 0 while both are exact.
pub const BACKLOG_ESTIMATED: &str = "outbox_backlog_estimated";
/// Gauge, seconds: age of the oldest unpublished event that is not a dead letter.
pub const OLDEST_UNPUBLISHED_AGE: &str = "outbox_oldest_unpublished_age_seconds";
/// Gauge, bytes: payload bytes this consumer holds, as received: events
/// fetched and not yet settled, in the stream's buffer or in the reader's
/// hands. Stays under `max_buffered_bytes` (default 64 MiB; the relay's
/// `--max-buffered-bytes`) plus one event; at the bound the consumer
/// fetches nothing until deliveries are settled.
pub const BUFFERED_PAYLOAD_BYTES: &str = "outbox_buffered_payload_bytes";
/// Counter: notifications received on the LISTEN connection.
pub const NOTIFICATIONS: &str = "outbox_notifications_total";
/// Counter: fallback sweeps run by the timer.
pub const SWEEPS: &str = "outbox_sweeps_total";
/// Counter: LISTEN connection reconnects (each is followed by a sweep).
pub const LISTENER_RECONNECTS: &str = "outbox_listener_reconnects_total";
/// Gauge: 1 while the LISTEN connection is up and listening, else 0.
pub const LISTENER_UP: &str = "outbox_listener_up";
/// Counter: errors on the work connection (each followed by a reconnect with backoff).
pub const DATABASE_ERRORS: &str = "outbox_database_errors_total";
/// Counter: statements of the consumer's own sessions that the server cut
/// at the statement timeout (`statement_timeout`, default 60 s; each is
/// followed by a reconnect with backoff, and counts in [`DATABASE_ERRORS`]
/// too), labelled `statement` by what it was doing: one of
/// [`TIMEOUT_STATEMENTS`].
pub const STATEMENT_TIMEOUTS: &str = "outbox_statement_timeouts_total";
/// Gauge: 1 while this consumer holds the outbox lock (single mode), else 0.
pub const LEADER: &str = "outbox_leader";
/// Gauge: 1 while this standby sees the outbox lock (single mode) held by a
/// stranded session: one with no live consumer behind it (no heartbeat
/// within `stranded_after`, default 15 s, and no statement running), so
/// nothing is delivered; else 0. With `take_over_stranded` (the relay's
/// `--take-over-stranded`) the standby ends that session and takes over.
pub const LEADER_STRANDED: &str = "outbox_leader_stranded";
/// Counter: settlements a write did not record because this consumer's
/// leadership term was no longer current (another relay took the outbox
/// over: docs/architecture.md, "Leadership terms"), labelled `write`
/// (`ack`, `fail`). Those events stay unpublished and the current leader
/// delivers them again; a fenced write is not retried (unless this
/// consumer has taken the outbox back by then: it writes them under its
/// new term).
pub const FENCED_WRITES: &str = "outbox_fenced_writes_total";
/// Gauge: the leadership term this consumer holds (single mode), 0 when it
/// holds none (a standby; competing and partitioned modes).
pub const LEADER_TERM: &str = "outbox_leader_term";
/// Gauge: partitions this consumer holds (partitioned mode).
pub const PARTITIONS_OWNED: &str = "outbox_partitions_owned";
/// Gauge, 0..1: `pg_notification_queue_usage()`, the fraction of the
/// server's notification queue in use (PostgreSQL docs, "NOTIFY"). Near 1,
/// every notifying COMMIT fails.
pub const NOTIFICATION_QUEUE_USAGE: &str = "outbox_notification_queue_usage_ratio";
/// Gauge: 1 when a test notification sent at start came back on the LISTEN
/// connection; 0 when it did not (a transaction-mode pooler, a replica, or
/// `listen(false)`): then only the sweep finds events.
pub const NOTIFICATIONS_WORKING: &str = "outbox_notifications_working";
/// Gauge: 1 when the consumer listens for notifications, 0 when it was
/// started without (`--no-listen`): alerts
/// on [`NOTIFICATIONS_WORKING`] and [`LISTENER_UP`] apply only where this is 1.
pub const LISTEN_ENABLED: &str = "outbox_listen_enabled";
/// Gauge: 1 while this relay asks producers to notify it (idle), 0 while
/// it is draining and polls by itself (producers then skip NOTIFY).
pub const WAITING_FOR_NOTIFICATIONS: &str = "outbox_waiting_for_notifications";
/// Gauge, seconds, label `subscription`: a named subscription's lag, the
/// age of the lowest event above its cursor that it has not settled (0
/// once it has caught up). Every relay and consumer of the outbox reports
/// every subscription (every 5 s), so the alert fires while the
/// subscription's own relay is down.
pub const SUBSCRIPTION_LAG: &str = "outbox_subscription_lag_seconds";
/// Gauge, seconds, label `subscription`: a named subscription's lag bound
/// (`subscription create|set --max-lag`); absent without one.
pub const SUBSCRIPTION_MAX_LAG: &str = "outbox_subscription_max_lag_seconds";
/// Gauge, label `subscription`: 1 while a named subscription lags more
/// than its bound (it still holds retention: nothing is dropped), else 0.
pub const SUBSCRIPTION_BEHIND: &str = "outbox_subscription_behind";
/// Counter: published events deleted by retention.
pub const RETENTION_DELETED: &str = "outbox_retention_deleted_total";
/// Gauge, Unix seconds: when the last successful retention run finished.
/// Absent until retention has run once in this process (a zero would read
/// as "last ran in 1970").
pub const RETENTION_LAST_RUN: &str = "outbox_retention_last_run_timestamp_seconds";
/// Counter: retention runs that failed (a database error, or the relay's
/// scheduled run could not connect).
pub const RETENTION_ERRORS: &str = "outbox_retention_errors_total";
/// Histogram, seconds: time a sink took to deliver one event, from its
/// send to the destination's answer, however many are in flight (relay
/// only).
pub const SINK_DURATION: &str = "outbox_sink_duration_seconds";
/// Gauge: deliveries the relay has in flight to its sink, at most
/// `--max-in-flight` (`relay::DeliveryOptions::max_in_flight`),
/// one per aggregate (relay only).
pub const SINK_IN_FLIGHT: &str = "outbox_sink_in_flight";
/// Gauge: the delivery guarantee the relay's sink runs with, labelled
/// `guarantee` (`exactly-once` or `at-least-once`, [`SINK_GUARANTEES`]):
/// 1 for the sink's, 0 for the other (relay only; set when the relay
/// starts). Exactly-once is the NATS JetStream and Redis Streams sinks
/// with `--exactly-once`; every other sink is at-least-once.
pub const SINK_GUARANTEE: &str = "outbox_sink_guarantee";
/// Counter: sends the destination refused, or that the sink skipped,
/// because it already holds this very event, read back from it
/// (`--exactly-once`); each such event is acknowledged without a second
/// copy. The sum over the `proof` labels of [`SINK_ACKNOWLEDGED_UNSENT`].
pub const SINK_REPEATS_REFUSED: &str = "outbox_sink_repeats_refused_total";
/// Counter: events acknowledged without a send (`--exactly-once`), labelled
/// `proof` ([`SINK_PROOFS`]: how the sink read the event back from the
/// broker, `relay::Proof`). Never by inference from a later event:
/// an event the broker cannot be shown to hold fails instead.
pub const SINK_ACKNOWLEDGED_UNSENT: &str = "outbox_sink_acknowledged_unsent_total";

/// Register descriptions and units of every metric above with the installed
/// recorder. Call once after installing an exporter; harmless to call again.
pub fn describe() {
    describe_counter!(EVENTS_PUBLISHED, "Events acknowledged and marked published.");
    describe_counter!(EVENTS_FAILED, "Delivery attempts that failed.");
    describe_counter!(EVENTS_DEAD_LETTERED, "Events that became dead letters.");
    describe_counter!(EVENTS_RELEASED, "Deliveries released unsettled; delivered again later.");
    describe_counter!(EVENTS_FETCHED, "Events fetched and handed out.");
    describe_histogram!(DELIVERY_LAG, Unit::Seconds, "From occurred_at to acknowledgement.");
    describe_gauge!(BACKLOG, "Unpublished events that are not dead letters.");
    describe_gauge!(DEAD_LETTERS, "Dead letters waiting for an operator.");
    describe_gauge!(BACKLOG_ESTIMATED, "1 while the backlog or dead-letter gauge is estimated, 0 while exact.");
    describe_gauge!(OLDEST_UNPUBLISHED_AGE, Unit::Seconds, "Age of the oldest pending event.");
    describe_gauge!(BUFFERED_PAYLOAD_BYTES, Unit::Bytes, "Payload bytes fetched and not yet settled.");
    describe_counter!(NOTIFICATIONS, "Notifications received on the LISTEN connection.");
    describe_counter!(SWEEPS, "Fallback sweeps run by the timer.");
    describe_counter!(LISTENER_RECONNECTS, "LISTEN connection reconnects.");
    describe_gauge!(LISTENER_UP, "1 while the LISTEN connection is listening.");
    describe_counter!(DATABASE_ERRORS, "Errors on the work connection.");
    describe_counter!(STATEMENT_TIMEOUTS, "Statements cut by the statement timeout, by statement.");
    describe_histogram!(SINK_DURATION, Unit::Seconds, "Time a sink took to deliver one event.");
    describe_gauge!(SINK_IN_FLIGHT, "Deliveries in flight to the sink (one per aggregate at most).");
    describe_gauge!(SINK_GUARANTEE, "1 for the delivery guarantee the sink runs with (exactly-once, at-least-once).");
    describe_counter!(SINK_REPEATS_REFUSED, "Sends refused or skipped: the destination holds this very event.");
    describe_counter!(
        SINK_ACKNOWLEDGED_UNSENT,
        "Events acknowledged without a send, by how the broker was shown to hold them (proof)."
    );
    describe_gauge!(WAITING_FOR_NOTIFICATIONS, "1 while this relay asks producers to notify it.");
    describe_counter!(RETENTION_DELETED, "Published events deleted by retention.");
    describe_gauge!(RETENTION_LAST_RUN, Unit::Seconds, "When the last successful retention run finished (Unix time).");
    describe_counter!(RETENTION_ERRORS, "Retention runs that failed.");
    describe_gauge!(LEADER, "1 while this consumer holds the outbox lock (single mode).");
    describe_gauge!(LEADER_STRANDED, "1 while this standby sees the outbox lock held by a stranded session.");
    describe_counter!(FENCED_WRITES, "Settlements not written: this consumer's leadership term was superseded.");
    describe_gauge!(LEADER_TERM, "The leadership term this consumer holds (0: none).");
    describe_gauge!(PARTITIONS_OWNED, "Partitions this consumer holds (partitioned mode).");
    describe_gauge!(NOTIFICATION_QUEUE_USAGE, "pg_notification_queue_usage(), 0..1.");
    describe_gauge!(NOTIFICATIONS_WORKING, "1 when notifications round-trip to the LISTEN connection.");
    describe_gauge!(LISTEN_ENABLED, "1 when the consumer listens for notifications (0 with --no-listen).");
}

/// The `proof` label values of [`SINK_ACKNOWLEDGED_UNSENT`].
pub const SINK_PROOFS: [&str; 4] = ["entry", "last-message", "chain", "duplicate-window"];

/// The `guarantee` label values of [`SINK_GUARANTEE`].
pub const SINK_GUARANTEES: [&str; 2] = ["at-least-once", "exactly-once"];

/// The `write` label values of [`FENCED_WRITES`].
pub const FENCED_WRITE_KINDS: [&str; 2] = ["ack", "fail"];

/// The `wake` label values of [`EVENTS_FETCHED`].
pub const FETCH_WAKES: [&str; 8] =
    ["start", "notification", "sweep", "retry", "reconnect", "release", "ownership", "poll"];

/// The `statement` label values of [`STATEMENT_TIMEOUTS`]: `fetch`,
/// `ack_write` (marking events published), `fail_write` (recording failed
/// attempts), `next_retry_read` (the earliest retry time), `gauges` (the
/// backlog gauges), `registration` (whether this relay waits for wake-ups),
/// `lock` (the outbox lock or partitions), `notify_lock_waiters` (producers
/// queued on NOTIFY's lock), `claim_commit` (competing mode),
/// `session_setup` (preparing a new session's statements), and `term`
/// (taking or confirming the leadership term).
pub const TIMEOUT_STATEMENTS: [&str; 11] = [
    "fetch",
    "ack_write",
    "fail_write",
    "next_retry_read",
    "gauges",
    "registration",
    "lock",
    "notify_lock_waiters",
    "claim_commit",
    "session_setup",
    "term",
];

/// Record the starting value of every counter (0, and for
/// [`EVENTS_FETCHED`] one 0 per [`FETCH_WAKES`] label, for
/// [`STATEMENT_TIMEOUTS`] one per [`TIMEOUT_STATEMENTS`] label) and of every gauge
/// (0, except [`RETENTION_LAST_RUN`], which stays absent until retention
/// runs), so a Prometheus exporter shows each series from the first scrape
/// and dashboards and alerts never show "no data" for a metric that simply
/// has not happened yet. The consumer overwrites the gauges with real values
/// as soon as it knows them (the backlog gauges within 5 s).
///
/// Histograms ([`DELIVERY_LAG`], [`SINK_DURATION`]) appear with their first
/// sample. Call once after installing a recorder and before starting a
/// consumer; calling it later would reset gauges to 0 until their next update.
pub fn record_initial_values() {
    for name in [
        EVENTS_PUBLISHED,
        EVENTS_FAILED,
        EVENTS_DEAD_LETTERED,
        EVENTS_RELEASED,
        NOTIFICATIONS,
        SWEEPS,
        LISTENER_RECONNECTS,
        DATABASE_ERRORS,
        RETENTION_DELETED,
        RETENTION_ERRORS,
        SINK_REPEATS_REFUSED,
    ] {
        metrics::counter!(name).increment(0);
    }
    for wake in FETCH_WAKES {
        metrics::counter!(EVENTS_FETCHED, "wake" => wake).increment(0);
    }
    for statement in TIMEOUT_STATEMENTS {
        metrics::counter!(STATEMENT_TIMEOUTS, "statement" => statement).increment(0);
    }
    for write in FENCED_WRITE_KINDS {
        metrics::counter!(FENCED_WRITES, "write" => write).increment(0);
    }
    for name in [
        BACKLOG,
        DEAD_LETTERS,
        BACKLOG_ESTIMATED,
        OLDEST_UNPUBLISHED_AGE,
        BUFFERED_PAYLOAD_BYTES,
        LISTENER_UP,
        LEADER,
        LEADER_STRANDED,
        LEADER_TERM,
        PARTITIONS_OWNED,
        NOTIFICATION_QUEUE_USAGE,
        NOTIFICATIONS_WORKING,
        WAITING_FOR_NOTIFICATIONS,
        LISTEN_ENABLED,
    ] {
        metrics::gauge!(name).set(0.0);
    }
}

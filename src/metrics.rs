//! Metric names and descriptions. pg-outbox records through the `metrics`
//! facade only; install an exporter (the relay installs
//! `metrics-exporter-prometheus`) to see them. Names follow Prometheus
//! conventions: `outbox_` prefix, `_total` counters, `_seconds` units.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

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
/// Counter: events fetched from the outbox and handed out.
pub const EVENTS_FETCHED: &str = "outbox_events_fetched_total";
/// Histogram, seconds: from an event's `occurred_at` to its acknowledgement
/// being written (database clock).
pub const DELIVERY_LAG: &str = "outbox_delivery_lag_seconds";
/// Gauge, rows: unpublished events that are not dead letters.
pub const BACKLOG: &str = "outbox_backlog_events";
/// Gauge, rows: dead letters (unpublished, `next_retry_at = 'infinity'`).
pub const DEAD_LETTERS: &str = "outbox_dead_letters";
/// Gauge, seconds: age of the oldest unpublished event that is not a dead letter.
pub const OLDEST_UNPUBLISHED_AGE: &str = "outbox_oldest_unpublished_age_seconds";
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
/// Histogram, seconds: time a sink took to deliver one event (relay only).
pub const SINK_DURATION: &str = "outbox_sink_duration_seconds";

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
    describe_gauge!(OLDEST_UNPUBLISHED_AGE, Unit::Seconds, "Age of the oldest pending event.");
    describe_counter!(NOTIFICATIONS, "Notifications received on the LISTEN connection.");
    describe_counter!(SWEEPS, "Fallback sweeps run by the timer.");
    describe_counter!(LISTENER_RECONNECTS, "LISTEN connection reconnects.");
    describe_gauge!(LISTENER_UP, "1 while the LISTEN connection is listening.");
    describe_counter!(DATABASE_ERRORS, "Errors on the work connection.");
    describe_histogram!(SINK_DURATION, Unit::Seconds, "Time a sink took to deliver one event.");
}

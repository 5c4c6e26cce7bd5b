//! The built-in sinks, one file each, each with its options struct and its
//! `open` function; [`super::SINKS`] lists them. Their public types are
//! re-exported here, and from here by `relay`.

#[cfg(feature = "amqp")]
pub(crate) mod amqp;
#[cfg(feature = "kafka")]
pub(crate) mod kafka;
#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod stdout;
#[cfg(feature = "webhook")]
pub(crate) mod webhook;

#[cfg(feature = "amqp")]
pub use amqp::{AMQP_APP_ID, AmqpOptions, AmqpSink};
#[cfg(feature = "kafka")]
pub use kafka::{DEFAULT_KAFKA_PORT, KafkaOptions, KafkaProperty, KafkaSink};
#[cfg(feature = "nats")]
pub use nats::{NatsOptions, NatsSink};
#[cfg(feature = "redis")]
pub use redis::{RedisOptions, RedisSink};
pub use stdout::StdoutSink;
#[cfg(feature = "webhook")]
pub use webhook::{DEFAULT_WEBHOOK_TIMEOUT, HttpHeader, WebhookOptions, WebhookSecret, WebhookSink};

/// Count and log a send of event `id` to `destination` (a subject, a
/// stream key) that the destination refused, or that was skipped, because
/// it already holds the event (`why`): the event is acknowledged without a
/// second copy (`outbox_sink_repeats_refused_total`). The exactly-once
/// sinks' one way of saying so.
#[cfg(any(feature = "nats", feature = "redis"))]
pub(crate) fn refused_repeat(id: i64, destination: &str, why: &str) {
    metrics::counter!(crate::metrics::SINK_REPEATS_REFUSED).increment(1);
    tracing::info!(id, destination, "repeat refused, acknowledged without a second copy: {why}");
}

/// An `occurred_at` as the relay writes it (header or field, RFC 3339), or
/// `None` when it is not one.
#[cfg(any(feature = "nats", feature = "redis"))]
pub(crate) fn parse_occurred_at(text: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::parse_from_rfc3339(text.trim()).ok().map(|t| t.with_timezone(&chrono::Utc))
}

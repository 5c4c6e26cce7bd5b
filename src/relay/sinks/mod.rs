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

use super::sink_list::with_exactly_once;
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

// What the sinks that can deliver exactly once share.
with_exactly_once! {
    use crate::relay::{Proof, Sent};

    /// Log an event of `id` that the sink did not send to `destination` (a
    /// subject, a stream key) because it read this very event back from there
    /// (`proof`, `why`), and return [`Sent::Held`]: the relay acknowledges it
    /// without a second copy and counts it
    /// (`outbox_sink_acknowledged_unsent_total{proof}`). The exactly-once
    /// sinks' one way of saying so.
    pub(crate) fn held(id: i64, destination: &str, proof: Proof, why: &str) -> Sent {
        tracing::warn!(id, destination, proof = proof.as_str(), "repeat refused, acknowledged without a send: {why}");
        Sent::Held(proof)
    }

    /// When an exactly-once sink checks its broker's settings again: every
    /// `every` while it delivers (checked before a send).
    #[derive(Debug)]
    pub(crate) struct Recheck {
        every: std::time::Duration,
        last: std::sync::Mutex<std::time::Instant>,
    }

    impl Recheck {
        /// Checked just now; again after `every` (`None`: the default, a minute).
        pub(crate) fn new(every: Option<std::time::Duration>) -> Self {
            Recheck {
                every: every.unwrap_or(crate::relay::DEFAULT_BROKER_CHECK_INTERVAL),
                last: std::sync::Mutex::new(std::time::Instant::now()),
            }
        }

        /// Whether a check is due; if so, the next is due `every` from now.
        pub(crate) fn due(&self) -> bool {
            let mut last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.elapsed() < self.every {
                return false;
            }
            *last = std::time::Instant::now();
            true
        }

        /// The error that stops the relay when a running check of the `sink`
        /// found `why`.
        pub(crate) fn failed(sink: &'static str, why: String) -> crate::error::BoxError {
            tracing::error!(sink, "{why}");
            Box::new(crate::relay::FatalSinkError(format!(
                "exactly-once stopped: a broker check found a setting that breaks it: {why}"
            )))
        }
    }

    /// An `occurred_at` as the relay writes it (header or field, RFC 3339), or
    /// `None` when it is not one.
    pub(crate) fn parse_occurred_at(text: &str) -> Option<chrono::DateTime<chrono::Utc>> {
        chrono::DateTime::parse_from_rfc3339(text.trim()).ok().map(|t| t.with_timezone(&chrono::Utc))
    }
}

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

//! The relay: a consumer whose deliveries go to a [`Sink`]. What the
//! `pg-outbox relay` command runs, usable from a program too.
//!
//! Each delivery is handed to the sink; `Ok` acknowledges it (it becomes
//! published), `Err` fails it (retry with backoff, dead letter at the
//! threshold). Deliveries are handed over one after another, in id order,
//! so per-aggregate order holds at the sink.

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(feature = "kafka")]
mod kafka;
mod message;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "redis")]
mod redis;
mod stdout;
#[cfg(feature = "webhook")]
mod webhook;

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

#[cfg(feature = "amqp")]
pub use amqp::{AMQP_APP_ID, AmqpSink};
#[cfg(feature = "kafka")]
pub use kafka::{DEFAULT_KAFKA_PORT, KafkaSink, parse_kafka_url};
pub use message::{DEFAULT_CLOUDEVENTS_SOURCE, Format, Message, Template, header};
#[cfg(feature = "nats")]
pub use nats::NatsSink;
#[cfg(feature = "redis")]
pub use redis::RedisSink;
pub use stdout::StdoutSink;
#[cfg(feature = "webhook")]
pub use webhook::{DEFAULT_WEBHOOK_TIMEOUT, WebhookSecret, WebhookSink};

pub use crate::redact::redact_sink;
#[cfg(feature = "webhook")]
pub use crate::redact::redact_url;

use crate::error::{BoxError, Result};
use crate::event::Event;
use crate::redact::redact_spec;
use crate::{EventStream, metrics as m};

/// Default time one delivery may take (`--sink-timeout`): 10 seconds.
pub const DEFAULT_SINK_TIMEOUT: Duration = Duration::from_secs(10);

/// A boxed future returned by [`Sink::deliver`].
pub type SinkFuture<'a> = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>>;

/// Where the relay delivers events.
///
/// `deliver` returns `Ok(())` only once the destination has taken the event
/// (written and flushed, a 2xx response, a broker's confirmation): the event
/// is then marked published. An `Err` fails the event; its text is stored in
/// `last_error`.
pub trait Sink: Send + Sync {
    /// Deliver one event.
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a>;
}

/// The JSON record of an event as sinks write it: keys `id`,
/// `aggregate_type`, `aggregate_id`, `event_type`, `payload`, `occurred_at`
/// (RFC 3339) and `retry_count`.
#[derive(Debug, Serialize)]
pub struct SinkRecord<'a> {
    /// Outbox id.
    pub id: i64,
    /// Kind of aggregate.
    pub aggregate_type: &'a str,
    /// Aggregate id.
    pub aggregate_id: uuid::Uuid,
    /// Event name.
    pub event_type: &'a str,
    /// The payload as stored.
    pub payload: &'a serde_json::Value,
    /// RFC 3339 time the producer inserted the event.
    pub occurred_at: String,
    /// Failed attempts before this one.
    pub retry_count: i32,
}

impl<'a> SinkRecord<'a> {
    /// The record of `event`.
    pub fn new(event: &'a Event) -> Self {
        SinkRecord {
            id: event.id,
            aggregate_type: &event.aggregate_type,
            aggregate_id: event.aggregate_id,
            event_type: &event.event_type,
            payload: &event.payload,
            occurred_at: event.occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            retry_count: event.retry_count,
        }
    }
}

/// Settings of the sinks, as the `pg-outbox relay` flags give them. Each
/// sink reads the fields it needs; the others are ignored.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SinkOptions {
    /// Message body format (default [`Format::Record`]).
    pub format: Format,
    /// CloudEvents `source` attribute (default [`DEFAULT_CLOUDEVENTS_SOURCE`]).
    pub cloudevents_source: String,
    /// How long one delivery may take before it fails: the webhook request,
    /// or the wait for a broker's acknowledgement (default 10 s).
    pub timeout: Duration,
    /// NATS JetStream subject (default `events.{aggregate_type}.{event_type}`).
    pub nats_subject: Template,
    /// Kafka topic (default `outbox.event.{aggregate_type}`, the topic
    /// Debezium's outbox event router uses).
    pub kafka_topic: Template,
    /// Redis stream key (default `outbox:{aggregate_type}`).
    pub redis_stream: Template,
    /// Redis `XADD ... MAXLEN ~ N` trimming; `None` (the default) never trims.
    pub redis_maxlen: Option<usize>,
    /// RabbitMQ exchange (default `amq.topic`, which every broker has).
    pub amqp_exchange: String,
    /// RabbitMQ routing key (default `{aggregate_type}.{event_type}`).
    pub amqp_routing_key: Template,
    /// Webhook signing secret (Standard Webhooks, `whsec_` base64); `None`
    /// (the default) sends unsigned requests.
    pub webhook_secret: Option<String>,
    /// Extra HTTP headers on every webhook request (default none).
    pub webhook_headers: Vec<(String, String)>,
}

impl Default for SinkOptions {
    fn default() -> Self {
        let t = |s: &str| Template::parse(s).unwrap_or_else(|_| unreachable!("built-in template {s} parses"));
        SinkOptions {
            format: Format::Record,
            cloudevents_source: DEFAULT_CLOUDEVENTS_SOURCE.to_string(),
            timeout: DEFAULT_SINK_TIMEOUT,
            nats_subject: t("events.{aggregate_type}.{event_type}"),
            kafka_topic: t("outbox.event.{aggregate_type}"),
            redis_stream: t("outbox:{aggregate_type}"),
            redis_maxlen: None,
            amqp_exchange: "amq.topic".to_string(),
            amqp_routing_key: t("{aggregate_type}.{event_type}"),
            webhook_secret: None,
            webhook_headers: Vec::new(),
        }
    }
}

/// The sink schemes `--sink` accepts, for messages.
pub const SINK_SCHEMES: &str = "`stdout`, http(s)://, nats://, kafka://, redis://, amqp://";

/// Open the sink a `--sink` value names: `stdout`, `http://` or `https://`
/// (webhook), `nats://` (NATS JetStream), `kafka://` (Kafka), `redis://` or
/// `rediss://` (Redis Streams), `amqp://` or `amqps://` (RabbitMQ).
/// Returns the sink and a name for logs (credentials removed).
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for an unknown scheme, a
/// malformed URL, a scheme whose Cargo feature this build lacks, or a broker
/// that cannot be reached at start.
///
/// # Cancel safety
/// Cancel safe: dropping the future drops the connection being opened.
pub async fn open_sink(spec: &str, opts: &SinkOptions) -> Result<(Box<dyn Sink>, String)> {
    if spec == "stdout" {
        return Ok((Box::new(StdoutSink::with_format(opts.format, &opts.cloudevents_source)), "stdout".into()));
    }
    let scheme = spec.split_once("://").map(|(s, _)| s.to_ascii_lowercase()).unwrap_or_default();
    match scheme.as_str() {
        "http" | "https" => {
            #[cfg(feature = "webhook")]
            {
                let hook = WebhookSink::new(spec, opts.timeout)?.with_options(opts)?;
                let name = format!("webhook {}", hook.display_url());
                Ok((Box::new(hook), name))
            }
            #[cfg(not(feature = "webhook"))]
            Err(missing_feature("webhook"))
        }
        "nats" => {
            #[cfg(feature = "nats")]
            {
                let sink = NatsSink::connect(spec, opts).await?;
                let name = format!("NATS JetStream {}", sink.display_url());
                Ok((Box::new(sink), name))
            }
            #[cfg(not(feature = "nats"))]
            Err(missing_feature("nats"))
        }
        "redis" | "rediss" => {
            #[cfg(feature = "redis")]
            {
                let sink = RedisSink::connect(spec, opts).await?;
                let name = format!("Redis Streams {}", sink.display_url());
                Ok((Box::new(sink), name))
            }
            #[cfg(not(feature = "redis"))]
            Err(missing_feature("redis"))
        }
        #[cfg(feature = "amqp")]
        "amqp" | "amqps" => {
            let sink = AmqpSink::connect(spec, opts).await?;
            let name = sink.describe();
            Ok((Box::new(sink), name))
        }
        #[cfg(not(feature = "amqp"))]
        "amqp" | "amqps" => Err(missing_feature("amqp")),
        #[cfg(feature = "kafka")]
        "kafka" => {
            let sink = KafkaSink::connect(spec, opts).await?;
            let name = sink.describe();
            Ok((Box::new(sink), name))
        }
        #[cfg(not(feature = "kafka"))]
        "kafka" => Err(missing_feature("kafka")),
        _ => Err(crate::Error::Config(format!(
            "unsupported sink '{}': expected one of {SINK_SCHEMES}",
            redact_spec(spec)
        ))),
    }
}

/// The error for a sink scheme whose Cargo feature this build lacks.
#[allow(dead_code)] // unused when every sink feature is on
fn missing_feature(feature: &str) -> crate::Error {
    crate::Error::Config(format!(
        "this pg-outbox was built without the `{feature}` feature; rebuild with `--features {feature}` \
         (`--features full` has every sink)"
    ))
}

/// Counts of what a relay run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Events the sink accepted (acknowledged).
    pub delivered: u64,
    /// Attempts the sink refused (failed, to be retried or dead-lettered).
    pub failed: u64,
}

/// A sink error that means the sink itself is gone (for example standard
/// output was closed), not that this event is bad. [`run`] stops on it: the
/// event is released (not charged a failure) and `run` returns
/// [`Error::Sink`](crate::Error::Sink).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct FatalSinkError(pub String);

/// Deliver every event of `stream` to `sink` until `shutdown` resolves or
/// the stream ends, then finish the stream (final acknowledgements).
///
/// The stream's [`EventStream::health`] then reports the sink's side too
/// ([`crate::Health::sink`]): the delivery in progress, failures since the
/// last success, the last error.
///
/// On shutdown it stops fetching; the delivery in progress gets up to the
/// consumer's shutdown grace to finish (then it is released: not published,
/// delivered again by the next relay); buffered deliveries are released;
/// the final acknowledgements are written before it returns.
///
/// # Errors
/// [`Error::Sink`](crate::Error::Sink) when the sink reported a
/// [`FatalSinkError`]; otherwise the error that stopped the consumer, if any.
///
/// # Cancel safety
/// Not cancel safe, but it loses nothing: dropping the future drops the
/// stream, which stops the consumer (as [`crate::ShutdownHandle::shutdown`]
/// does), and the delivery in hand unacknowledged: the sink may have taken
/// that event, which is then delivered again later (at-least-once);
/// buffered events stay unpublished for the next relay. For a clean stop,
/// resolve `shutdown` instead.
pub async fn run<S, F>(mut stream: EventStream, sink: &S, shutdown: F) -> Result<RelayStats>
where
    S: Sink + ?Sized,
    F: Future<Output = ()>,
{
    let mut stats = RelayStats::default();
    let handle = stream.shutdown_handle();
    let grace = stream.shutdown_grace();
    let monitor = stream.health();
    let health = monitor.state();
    health.sink_attached();
    tokio::pin!(shutdown);
    let mut shutdown_seen = false;
    let mut fatal: Option<FatalSinkError> = None;
    loop {
        let next = tokio::select! {
            d = stream.next() => d,
            _ = &mut shutdown, if !shutdown_seen => {
                shutdown_seen = true;
                tracing::info!("shutting down: writing acknowledgements");
                handle.shutdown();
                continue;
            }
        };
        let Some(delivery) = next else { break };
        let started = Instant::now();
        health.delivery_started(started);
        let result = {
            let deliver = sink.deliver(delivery.event());
            tokio::pin!(deliver);
            tokio::select! {
                r = &mut deliver => Some(r),
                _ = &mut shutdown, if !shutdown_seen => {
                    shutdown_seen = true;
                    tracing::info!(id = delivery.id, grace = ?grace, "shutting down: waiting for the event in hand");
                    handle.shutdown();
                    tokio::time::timeout(grace, &mut deliver).await.ok()
                }
            }
        };
        let ended = Instant::now();
        metrics::histogram!(m::SINK_DURATION).record((ended - started).as_secs_f64());
        match result {
            None => {
                health.delivery_abandoned();
                tracing::warn!(
                    id = delivery.id,
                    "shutdown grace ran out; the event in hand is released and will be delivered again"
                );
                delivery.release();
                break;
            }
            Some(Ok(())) => {
                health.delivery_ended(ended, Ok(()));
                stats.delivered += 1;
                delivery.ack();
            }
            Some(Err(e)) => match e.downcast::<FatalSinkError>() {
                Ok(f) => {
                    health.delivery_ended(ended, Err(f.to_string()));
                    tracing::error!(id = delivery.id, error = %f, "sink is gone; stopping (the event is released, not failed)");
                    delivery.release();
                    handle.shutdown();
                    fatal = Some(*f);
                    break;
                }
                Err(e) => {
                    stats.failed += 1;
                    let msg = crate::error::report(e.as_ref());
                    health.delivery_ended(ended, Err(msg.clone()));
                    tracing::warn!(id = delivery.id, attempt = delivery.retry_count + 1, error = %msg.escape_debug(), "sink failed");
                    delivery.fail(msg);
                }
            },
        }
    }
    stream.finish().await?;
    match fatal {
        Some(f) => Err(crate::Error::Sink(Box::new(f))),
        None => Ok(stats),
    }
}

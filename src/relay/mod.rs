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
pub use webhook::{DEFAULT_WEBHOOK_TIMEOUT, WebhookSecret, WebhookSink, redact_url};

use crate::error::{BoxError, Result};
use crate::event::Event;
use crate::{EventStream, metrics as m};

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
            timeout: DEFAULT_WEBHOOK_TIMEOUT,
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
pub async fn open_sink(spec: &str, opts: &SinkOptions) -> Result<(Box<dyn Sink>, String)> {
    if spec == "stdout" {
        return Ok((Box::new(StdoutSink::with_format(opts.format, &opts.cloudevents_source)), "stdout".into()));
    }
    let scheme = spec.split_once("://").map(|(s, _)| s.to_ascii_lowercase()).unwrap_or_default();
    match scheme.as_str() {
        "http" | "https" => {
            let hook = WebhookSink::new(spec, opts.timeout)?.with_options(opts)?;
            let name = format!("webhook {}", hook.display_url());
            Ok((Box::new(hook), name))
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
         (it is in the default features)"
    ))
}

/// `spec` without credentials, query string or fragment, for logs and
/// messages: each comma-separated URL keeps its scheme, host, port and path
/// (`nats://user:pw@h:4222` becomes `nats://h:4222`).
pub(crate) fn redact_spec(spec: &str) -> String {
    spec.split(',')
        .map(|part| {
            let part = part.trim();
            let (scheme, rest) = match part.split_once("://") {
                Some((s, r)) => (format!("{s}://"), r),
                None => (String::new(), part),
            };
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(end);
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            let tail = match tail.find(['?', '#']) {
                Some(i) => format!("{}?…", &tail[..i]),
                None => tail.to_string(),
            };
            format!("{scheme}{host}{tail}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `spec` (a `--sink` value) with every secret masked as `****`, keeping
/// everything else readable, for printed settings: in each URL of a
/// comma-separated list (`nats://a:pw@h1,nats://b:pw@h2`) and each host of
/// a multi-host authority, the password of `user:password@` (or the whole
/// user part when it has no password: a token), and any query string or
/// fragment (`?****`, `#****`).
///
/// The credentials end at the last `@` of a URL, so a password holding an
/// unencoded `/`, `?` or `#` is masked too; an `@` in a path or query makes
/// it mask more than needed, never less.
///
/// # Example
/// ```
/// use pg_outbox::relay::redact_sink;
/// assert_eq!(redact_sink("nats://tok@h:4222"), "nats://****@h:4222");
/// assert_eq!(redact_sink("amqp://app:pw@mq:5672/%2f"), "amqp://app:****@mq:5672/%2f");
/// assert_eq!(redact_sink("https://h/hook?api_key=k"), "https://h/hook?****");
/// ```
pub fn redact_sink(spec: &str) -> String {
    const MASK: &str = "****";
    // Group the comma-separated parts into URLs: a part with a scheme starts
    // one; a part without continues the previous one (more hosts, or a
    // comma inside a path or query).
    let mut urls: Vec<String> = Vec::new();
    for part in spec.split(',') {
        match urls.last_mut() {
            Some(last) if !has_scheme(part) => {
                last.push(',');
                last.push_str(part);
            }
            _ => urls.push(part.to_string()),
        }
    }
    urls.iter()
        .map(|url| {
            let (scheme, rest) = match url.split_once("://") {
                Some((s, r)) => (format!("{s}://"), r),
                None => (String::new(), url.as_str()),
            };
            // The authority ends at the first `/`, `?` or `#` after the last `@`.
            let from = rest.rfind('@').map_or(0, |i| i + 1);
            let end = rest[from..].find(['/', '?', '#']).map_or(rest.len(), |i| from + i);
            let (authority, tail) = rest.split_at(end);
            let authority = mask_authority(authority, MASK);
            let (path, query, fragment) = match tail.find(['?', '#']) {
                Some(i) => {
                    let after = &tail[i..];
                    (&tail[..i], after.starts_with('?'), after.contains('#'))
                }
                None => (tail, false, false),
            };
            let mut out = format!("{scheme}{authority}{path}");
            if query {
                out.push('?');
                out.push_str(MASK);
            }
            if fragment {
                out.push('#');
                out.push_str(MASK);
            }
            out
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether `part` starts with `scheme://`.
fn has_scheme(part: &str) -> bool {
    part.trim_start().split_once("://").is_some_and(|(s, _)| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    })
}

/// An authority (`user:pw@h1,h2` or `u:p@h1,u:q@h2`) with its secrets masked.
fn mask_authority(authority: &str, mask: &str) -> String {
    let Some(last_at) = authority.rfind('@') else { return authority.to_string() };
    let userinfo = |u: &str| match u.split_once(':') {
        Some((user, _)) => format!("{user}:{mask}"),
        None => mask.to_string(),
    };
    // Host by host when every host before the last credentials has its own
    // (`u:p@h1,u:q@h2`); otherwise a comma may sit inside a password, so
    // everything up to the last `@` is masked as one.
    let hosts: Vec<&str> = authority.split(',').collect();
    let last_with_creds = hosts.iter().rposition(|h| h.contains('@')).unwrap_or(0);
    if hosts[..last_with_creds].iter().all(|h| h.contains('@')) {
        hosts
            .iter()
            .map(|h| match h.rsplit_once('@') {
                Some((u, host)) => format!("{}@{host}", userinfo(u)),
                None => h.to_string(),
            })
            .collect::<Vec<_>>()
            .join(",")
    } else {
        let (u, host) = authority.split_at(last_at);
        let user = u.split_once(':').map(|(user, _)| user).filter(|user| !user.contains([',', '@']));
        match user {
            Some(user) => format!("{user}:{mask}{host}"),
            None => format!("{mask}{host}"),
        }
    }
}

/// `text` with every secret of `spec` (the password of each URL, or the
/// user part when it has no password: a token; as written and
/// percent-decoded) replaced by `***`: for error messages of
/// client libraries that might quote the URL.
#[allow(dead_code)] // unused when no broker feature is on
pub(crate) fn scrub(text: &str, spec: &str) -> String {
    let mut secrets: Vec<String> = Vec::new();
    for part in spec.split(',') {
        let rest = part.trim().split_once("://").map_or(part, |(_, r)| r);
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if let Some((userinfo, _)) = rest[..end].rsplit_once('@') {
            // `user:password` hides the password; a lone user part is a token.
            let secret = userinfo.split_once(':').map_or(userinfo, |(_, p)| p);
            if !secret.is_empty() {
                secrets.push(secret.to_string());
                let decoded = percent_encoding::percent_decode_str(secret).decode_utf8_lossy();
                if decoded != secret {
                    secrets.push(decoded.into_owned());
                }
            }
        }
    }
    // Longest first, so a secret that contains another is replaced whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_string();
    for s in &secrets {
        out = out.replace(s.as_str(), "***");
    }
    out
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
/// On shutdown it stops fetching; the delivery in progress gets up to the
/// consumer's shutdown grace to finish (then it is released: not published,
/// delivered again by the next relay); buffered deliveries are released;
/// the final acknowledgements are written before it returns.
///
/// # Errors
/// [`Error::Sink`](crate::Error::Sink) when the sink reported a
/// [`FatalSinkError`]; otherwise the error that stopped the consumer, if any.
pub async fn run<S, F>(mut stream: EventStream, sink: &S, shutdown: F) -> Result<RelayStats>
where
    S: Sink + ?Sized,
    F: Future<Output = ()>,
{
    let mut stats = RelayStats::default();
    let handle = stream.shutdown_handle();
    let grace = stream.shutdown_grace();
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
        metrics::histogram!(m::SINK_DURATION).record(started.elapsed().as_secs_f64());
        match result {
            None => {
                tracing::warn!(
                    id = delivery.id,
                    "shutdown grace ran out; the event in hand is released and will be delivered again"
                );
                delivery.release();
                break;
            }
            Some(Ok(())) => {
                stats.delivered += 1;
                delivery.ack();
            }
            Some(Err(e)) => match e.downcast::<FatalSinkError>() {
                Ok(f) => {
                    tracing::error!(id = delivery.id, error = %f, "sink is gone; stopping (the event is released, not failed)");
                    delivery.release();
                    handle.shutdown();
                    fatal = Some(*f);
                    break;
                }
                Err(e) => {
                    stats.failed += 1;
                    let msg = crate::error::report(e.as_ref());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_urls_lose_credentials_in_names_and_messages() {
        assert_eq!(redact_spec("nats://u:p%40ss@h1:4222,nats://tok@h2:4223"), "nats://h1:4222,nats://h2:4223");
        assert_eq!(redact_spec("rediss://:secret@cache:6380/2?protocol=resp3"), "rediss://cache:6380/2?…");
        assert_eq!(redact_spec("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        let text = "auth failed for u with p%40ss (p@ss) and secret";
        assert_eq!(scrub(text, "nats://u:p%40ss@h1:4222"), "auth failed for u with *** (***) and secret");
        assert_eq!(scrub(text, "nats://secret@h1:4222"), "auth failed for u with p%40ss (p@ss) and ***");
        assert_eq!(scrub(text, "redis://h:6379"), text);
    }

    #[test]
    fn printed_sinks_mask_every_secret() {
        let cases = [
            ("stdout", "stdout"),
            ("nats://NATSTOKEN@127.0.0.1:4222", "nats://****@127.0.0.1:4222"),
            ("nats://nu:PW1@h1:4222,nats://nu2:PW2@h2:4222", "nats://nu:****@h1:4222,nats://nu2:****@h2:4222"),
            ("nats://nu:PW1@h1:4222,nu2:PW2@h2:4222", "nats://nu:****@h1:4222,nu2:****@h2:4222"),
            ("kafka://u:p@h1:9092,h2:9092", "kafka://u:****@h1:9092,h2:9092"),
            ("nats://u:p,w@h1:4222", "nats://u:****@h1:4222"),
            ("http://h/path?api_key=K", "http://h/path?****"),
            ("https://h/p?a=1,b=2#frag", "https://h/p?****#****"),
            ("rediss://:secret@cache:6380/2?protocol=resp3", "rediss://:****@cache:6380/2?****"),
            ("amqp://u:pa/ss?x#y@mq:5672/%2f", "amqp://u:****@mq:5672/%2f"),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ];
        for (spec, want) in cases {
            assert_eq!(redact_sink(spec), want, "{spec}");
        }
    }
}

//! The relay: a consumer whose deliveries go to a [`Sink`]. What the
//! `pg-outbox relay` command runs, usable from a program too.
//!
//! Each delivery is handed to the sink; `Ok` acknowledges it (it becomes
//! published), `Err` fails it (retry with backoff, dead letter at the
//! threshold). Deliveries are handed over one after another, in id order,
//! so per-aggregate order holds at the sink.
//!
//! [`replay`] delivers events that were already published to a sink again,
//! without changing the table.

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(feature = "kafka")]
mod kafka;
mod message;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "redis")]
mod redis;
pub mod replay;
mod stdout;
#[cfg(feature = "webhook")]
mod webhook;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

#[cfg(feature = "amqp")]
pub use amqp::{AMQP_APP_ID, AmqpSink};
/// For the command line (`--print-config`); not part of the API.
#[cfg(feature = "kafka")]
#[doc(hidden)]
pub use kafka::parse_kafka_url;
#[cfg(feature = "kafka")]
pub use kafka::{DEFAULT_KAFKA_PORT, KafkaSink};
pub use message::{DEFAULT_CLOUDEVENTS_SOURCE, Format, Message, Template, header};
#[cfg(feature = "nats")]
pub use nats::NatsSink;
#[cfg(feature = "redis")]
pub use redis::RedisSink;
pub use stdout::StdoutSink;
#[cfg(feature = "webhook")]
pub use webhook::{DEFAULT_WEBHOOK_TIMEOUT, WebhookSecret, WebhookSink};

pub use crate::redact::Secret;
/// For the command line (`--print-config`); not part of the API.
#[doc(hidden)]
pub use crate::redact::is_secret_property;
/// For the command line (`--print-config`); not part of the API.
#[doc(hidden)]
pub use crate::redact::redact_sink;
#[cfg(feature = "webhook")]
#[doc(hidden)]
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
/// sink reads the fields it needs; the others are ignored. `Debug` masks
/// every secret.
#[derive(Clone)]
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
    /// Use TLS to the broker although the URL does not say so: NATS
    /// (`nats://`; `tls://` always does) and Kafka. Redis and RabbitMQ take
    /// TLS from the scheme (`rediss://`, `amqps://`) and refuse this with a
    /// plain scheme. Any of the three `tls_*` files implies it. Default off.
    pub tls: bool,
    /// PEM file of the CA certificate(s) that sign the broker's
    /// certificate; `None` (the default) trusts the platform's root
    /// certificates. RabbitMQ adds the file's certificates to the
    /// platform's roots.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (chain) to present for mutual TLS
    /// (with [`tls_client_key`](Self::tls_client_key)); default none.
    pub tls_client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key (PKCS#8, PKCS#1 or
    /// SEC1); default none.
    pub tls_client_key: Option<PathBuf>,
    /// User name for the broker (NATS user, Redis ACL user, RabbitMQ user,
    /// Kafka SASL user); overrides one in the URL. Default none.
    pub user: Option<String>,
    /// Password of [`user`](Self::user) (or of the URL's user); overrides
    /// one in the URL. Default none.
    pub password: Option<Secret>,
    /// NATS token (instead of a user and password); default none.
    pub nats_token: Option<Secret>,
    /// NATS NKey seed (`SU...`): the client signs the server's nonce with it;
    /// default none.
    pub nats_nkey: Option<Secret>,
    /// Contents of a NATS `.creds` file (user JWT and NKey seed, as `nsc`
    /// writes it); default none.
    pub nats_credentials: Option<Secret>,
    /// Kafka SASL mechanism: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`
    /// (with [`user`](Self::user) and [`password`](Self::password)); `None`
    /// (the default) uses no SASL.
    pub kafka_sasl_mechanism: Option<String>,
    /// Extra librdkafka properties, applied last, so they override the
    /// sink's own (e.g. `security.protocol`, `sasl.oauthbearer.*`,
    /// `compression.type`); default none.
    pub kafka_options: Vec<(String, String)>,
}

impl SinkOptions {
    /// Whether TLS is asked for: [`tls`](Self::tls) or any TLS file.
    pub fn tls_wanted(&self) -> bool {
        self.tls || self.tls_ca_file.is_some() || self.tls_client_cert.is_some() || self.tls_client_key.is_some()
    }

    /// Check the TLS files before connecting: each one given is readable and
    /// holds PEM, and a client certificate comes with its key.
    #[allow(dead_code)] // unused when no broker feature is on
    fn check_tls_files(&self, broker: &str) -> Result<()> {
        match (&self.tls_client_cert, &self.tls_client_key) {
            (Some(_), None) => {
                return Err(crate::Error::Config(format!(
                    "{broker}: a client certificate needs its private key (--sink-tls-client-key)"
                )));
            }
            (None, Some(_)) => {
                return Err(crate::Error::Config(format!(
                    "{broker}: a client key needs its certificate (--sink-tls-client-cert)"
                )));
            }
            _ => {}
        }
        for (what, path) in [
            ("CA file (--sink-tls-ca-file)", &self.tls_ca_file),
            ("client certificate (--sink-tls-client-cert)", &self.tls_client_cert),
            ("client key (--sink-tls-client-key)", &self.tls_client_key),
        ] {
            let Some(path) = path else { continue };
            let text = std::fs::read_to_string(path)
                .map_err(|e| crate::Error::Config(format!("{broker}: TLS {what} {}: {e}", path.display())))?;
            if !text.contains("-----BEGIN ") {
                return Err(crate::Error::Config(format!(
                    "{broker}: TLS {what} {} holds no PEM block (-----BEGIN ...)",
                    path.display()
                )));
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for SinkOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kafka_options: Vec<(&str, &str)> = self
            .kafka_options
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret_property(k) { "****" } else { v.as_str() }))
            .collect();
        f.debug_struct("SinkOptions")
            .field("format", &self.format)
            .field("cloudevents_source", &self.cloudevents_source)
            .field("timeout", &self.timeout)
            .field("nats_subject", &self.nats_subject.as_str())
            .field("kafka_topic", &self.kafka_topic.as_str())
            .field("redis_stream", &self.redis_stream.as_str())
            .field("redis_maxlen", &self.redis_maxlen)
            .field("amqp_exchange", &self.amqp_exchange)
            .field("amqp_routing_key", &self.amqp_routing_key.as_str())
            .field("webhook_secret", &self.webhook_secret.as_ref().map(|_| "****"))
            .field("webhook_headers", &self.webhook_headers.len())
            .field("tls", &self.tls)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_client_cert", &self.tls_client_cert)
            .field("tls_client_key", &self.tls_client_key)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("nats_token", &self.nats_token)
            .field("nats_nkey", &self.nats_nkey)
            .field("nats_credentials", &self.nats_credentials)
            .field("kafka_sasl_mechanism", &self.kafka_sasl_mechanism)
            .field("kafka_options", &kafka_options)
            .finish()
    }
}

/// Why a broker refused a connection, in words, when `error` (one line,
/// with its chain) shows a known cause: an untrusted certificate, a
/// certificate for another host name, a missing or refused client
/// certificate, refused credentials. `None` otherwise.
#[allow(dead_code)] // unused when no broker feature is on
pub(crate) fn refusal_reason(error: &str) -> Option<&'static str> {
    let e = error.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| e.contains(n));
    if has(&["broker certificate could not be verified"]) {
        // librdkafka (OpenSSL) reports both causes with the same words.
        Some(
            "TLS: the broker's certificate could not be verified: it is not signed by a trusted CA \
             (see --sink-tls-ca-file) or not valid for the host name in the URL (librdkafka does not say which)",
        )
    } else if has(&["notvalidforname", "not valid for name", "hostname mismatch", "host name mismatch"]) {
        Some("TLS: the broker's certificate is not valid for the host name in the URL")
    } else if has(&[
        "unknownissuer",
        "unknown issuer",
        "unable to get local issuer",
        "self-signed certificate",
        "self signed certificate",
        "invalidcertificate",
    ]) {
        Some("TLS: the broker's certificate is not signed by a trusted CA (see --sink-tls-ca-file)")
    } else if has(&[
        "certificaterequired",
        "certificate required",
        "badcertificate",
        "bad certificate",
        "unknownca",
        "unknown ca",
        "decrypterror",
    ]) {
        Some(
            "TLS: the broker refused the client certificate or wants one \
             (--sink-tls-client-cert, --sink-tls-client-key)",
        )
    } else if has(&[
        "authorization violation",
        "authentication failed",
        "wrongpass",
        "noauth",
        "access_refused",
        "access-refused",
        "sasl authentication",
        "authentication error",
        "invalid username or password",
        "failed signing nonce",
    ]) {
        Some("the broker refused the credentials (user and password, token, NKey or credentials file)")
    } else {
        None
    }
}

#[cfg(test)]
mod reason_tests {
    use super::refusal_reason;

    #[test]
    fn refusals_are_told_apart() {
        let cases = [
            ("IO error: invalid peer certificate: UnknownIssuer", "not signed by a trusted CA"),
            ("invalid peer certificate: certificate not valid for name \"127.0.0.1\"", "not valid for the host name"),
            ("received fatal alert: BadCertificate", "refused the client certificate"),
            ("received fatal alert: CertificateRequired", "refused the client certificate"),
            ("WRONGPASS invalid username-password pair", "refused the credentials"),
            ("failed to connect: authorization violation", "refused the credentials"),
            (
                "SSL handshake failed: certificate verify failed: broker certificate could not be verified",
                "does not say which",
            ),
        ];
        for (error, want) in cases {
            let got = refusal_reason(error).unwrap_or_default();
            assert!(got.contains(want), "{error} -> {got}");
        }
        assert_eq!(refusal_reason("connection refused"), None);
    }
}

/// `error` preceded by its [`refusal_reason`], if it has one.
#[allow(dead_code)] // unused when no broker feature is on
pub(crate) fn with_reason(error: String) -> String {
    match refusal_reason(&error) {
        Some(reason) => format!("{reason} ({error})"),
        None => error,
    }
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
            tls: false,
            tls_ca_file: None,
            tls_client_cert: None,
            tls_client_key: None,
            user: None,
            password: None,
            nats_token: None,
            nats_nkey: None,
            nats_credentials: None,
            kafka_sasl_mechanism: None,
            kafka_options: Vec::new(),
        }
    }
}

/// The sink schemes `--sink` accepts, for messages.
pub const SINK_SCHEMES: &str = "`stdout`, http(s)://, nats:// (or tls://), kafka://, redis(s)://, amqp(s)://";

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
        "nats" | "tls" => {
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

/// Deliver `event` to `sink`. When `shutdown` (if given) resolves first,
/// log it (`what`: how the caller calls stopping), call `on_stop`, and give
/// the delivery `grace` more. Returns its outcome (`None`: the grace ran
/// out) and whether `shutdown` resolved.
pub(crate) async fn deliver_with_grace<S, F>(
    sink: &S,
    event: &Event,
    shutdown: Option<Pin<&mut F>>,
    grace: Duration,
    what: &str,
    on_stop: impl FnOnce(),
) -> (Option<Result<(), BoxError>>, bool)
where
    S: Sink + ?Sized,
    F: Future<Output = ()>,
{
    let deliver = sink.deliver(event);
    tokio::pin!(deliver);
    let watching = shutdown.is_some();
    let shutdown = async {
        match shutdown {
            Some(s) => s.await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = &mut deliver => (Some(r), false),
        _ = shutdown, if watching => {
            tracing::info!(id = event.id, grace = ?grace, "{what}: waiting for the event in hand");
            on_stop();
            (tokio::time::timeout(grace, &mut deliver).await.ok(), true)
        }
    }
}

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
        let watch = (!shutdown_seen).then_some(shutdown.as_mut());
        let on_stop = || handle.shutdown();
        let (result, stopped) =
            deliver_with_grace(sink, delivery.event(), watch, grace, "shutting down", on_stop).await;
        shutdown_seen |= stopped;
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

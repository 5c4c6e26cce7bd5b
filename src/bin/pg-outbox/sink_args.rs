//! The `relay` flags that configure sinks.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pg_outbox::relay::{Format, Secret, SinkOptions, Template};

use crate::error::Error;

/// Sink settings; each sink reads the flags of its own scheme.
#[derive(clap::Args, Debug)]
#[command(next_help_heading = "Sink options")]
pub(crate) struct SinkArgs {
    /// Where events go, by scheme: `stdout` (one JSON object per line),
    /// http(s)://HOST/PATH (webhook: one POST per event, 2xx acknowledges),
    /// nats://HOST:4222 (JetStream; acknowledged on the PubAck),
    /// kafka://HOST:9092 (acknowledged on the broker's ack, acks=all),
    /// redis://HOST:6379 (XADD to a stream), amqp://USER:PASS@HOST:5672/VHOST
    /// (RabbitMQ; acknowledged on the publisher confirm).
    #[arg(long, default_value = "stdout")]
    pub(crate) sink: String,
    /// Message body: `record` (our JSON record) or `cloudevents`
    /// (CloudEvents 1.0 structured JSON).
    #[arg(long, default_value = "record", value_parser = parse_format)]
    pub(crate) format: Format,
    /// CloudEvents `source` attribute (with --format cloudevents).
    #[arg(long, default_value = pg_outbox::relay::DEFAULT_CLOUDEVENTS_SOURCE, value_parser = parse_source)]
    pub(crate) cloudevents_source: String,
    /// How long one delivery may take (webhook request, broker acknowledgement).
    #[arg(long, alias = "webhook-timeout", value_parser = crate::parse_duration, default_value = "10s")]
    pub(crate) sink_timeout: Duration,
    /// NATS subject template; placeholders {aggregate_type}, {event_type},
    /// {aggregate_id}.
    #[arg(long, default_value = "events.{aggregate_type}.{event_type}", value_parser = parse_template)]
    pub(crate) nats_subject: Template,
    /// Kafka topic template (the message key is the aggregate id).
    #[arg(long, default_value = "outbox.event.{aggregate_type}", value_parser = parse_template)]
    pub(crate) kafka_topic: Template,
    /// Redis stream key template.
    #[arg(long, default_value = "outbox:{aggregate_type}", value_parser = parse_template)]
    pub(crate) redis_stream: Template,
    /// Trim Redis streams to about this many entries (XADD MAXLEN ~); off by default.
    #[arg(long, value_name = "ENTRIES", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) redis_maxlen: Option<u64>,
    /// RabbitMQ exchange to publish to.
    #[arg(long, default_value = "amq.topic")]
    pub(crate) amqp_exchange: String,
    /// RabbitMQ routing key template.
    #[arg(long, default_value = "{aggregate_type}.{event_type}", value_parser = parse_template)]
    pub(crate) amqp_routing_key: Template,
    /// Sign webhook requests (Standard Webhooks: webhook-id,
    /// webhook-timestamp, webhook-signature) with this secret (`whsec_...`).
    #[arg(long, hide_env_values = true)]
    pub(crate) webhook_secret: Option<String>,
    /// Extra header on every webhook request, `NAME: VALUE` (repeatable).
    #[arg(long = "webhook-header", value_name = "NAME: VALUE", value_parser = parse_header)]
    pub(crate) webhook_headers: Vec<(String, String)>,
    /// Use TLS to the broker: NATS (same as a tls:// URL) and Kafka
    /// (security.protocol SSL, or SASL_SSL with --kafka-sasl-mechanism).
    /// Redis and RabbitMQ take TLS from the scheme: rediss://, amqps://.
    /// Any --sink-tls-* file implies it.
    #[arg(long, help_heading = "Sink TLS and credentials")]
    pub(crate) sink_tls: bool,
    /// PEM file of the CA certificate(s) that sign the broker's certificate
    /// (all sinks but the webhook); default: the system's root certificates
    /// (RabbitMQ adds the file's certificates to them).
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    pub(crate) sink_tls_ca_file: Option<PathBuf>,
    /// PEM file of a client certificate to present (mutual TLS), with
    /// --sink-tls-client-key.
    #[arg(long, value_name = "FILE", requires = "sink_tls_client_key", help_heading = "Sink TLS and credentials")]
    pub(crate) sink_tls_client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key.
    #[arg(long, value_name = "FILE", requires = "sink_tls_client_cert", help_heading = "Sink TLS and credentials")]
    pub(crate) sink_tls_client_key: Option<PathBuf>,
    /// User name at the broker (NATS user, Redis ACL user, RabbitMQ user,
    /// Kafka SASL user); overrides a user in the URL.
    #[arg(long, value_name = "USER", help_heading = "Sink TLS and credentials")]
    pub(crate) sink_user: Option<String>,
    /// File holding the broker password (one line; a trailing newline is
    /// ignored); overrides --sink-password and a password in the URL.
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    pub(crate) sink_password_file: Option<PathBuf>,
    /// The broker password itself; prefer OUTBOX_SINK_PASSWORD or
    /// --sink-password-file (a command line is visible to other users).
    #[arg(long, value_name = "PASSWORD", hide_env_values = true, help_heading = "Sink TLS and credentials")]
    pub(crate) sink_password: Option<String>,
    /// NATS: a .creds file (user JWT and NKey seed, as `nsc` writes it).
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    pub(crate) nats_creds: Option<PathBuf>,
    /// NATS: a file holding a user NKey seed (SU...).
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    pub(crate) nats_nkey_file: Option<PathBuf>,
    /// NATS: a file holding the authentication token.
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    pub(crate) nats_token_file: Option<PathBuf>,
    /// Kafka SASL mechanism, with --sink-user and a password: PLAIN,
    /// SCRAM-SHA-256 or SCRAM-SHA-512 (others, e.g. OAUTHBEARER, through
    /// --kafka-option). security.protocol becomes SASL_SSL with --sink-tls
    /// (or a TLS file), else SASL_PLAINTEXT.
    #[arg(long, value_name = "MECHANISM", value_parser = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"], help_heading = "Sink TLS and credentials")]
    pub(crate) kafka_sasl_mechanism: Option<String>,
    /// Any librdkafka producer property, KEY=VALUE (repeatable), applied
    /// last: it overrides the sink's own. The sink's defaults: acks=all,
    /// enable.idempotence=true, linger.ms=0 (one event in flight at a time),
    /// compression.type=none, partitioner=murmur2_random (Java's),
    /// message.timeout.ms from --sink-timeout. E.g.
    /// --kafka-option sasl.mechanism=OAUTHBEARER.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = parse_kafka_option, help_heading = "Sink TLS and credentials")]
    pub(crate) kafka_options: Vec<(String, String)>,
}

/// The contents of a secret file named by `flag`, without the trailing
/// line break.
fn read_secret(flag: &str, path: &Path) -> Result<Secret, Error> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("--{flag} {}: cannot read: {e}", path.display())))?;
    let value = text.trim_end_matches(['\n', '\r']);
    if value.trim().is_empty() {
        return Err(Error::Config(format!("--{flag} {}: the file is empty", path.display())));
    }
    Ok(Secret::new(value))
}

impl SinkArgs {
    /// The library's sink options, secret files read.
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag for an unreadable or empty secret file.
    pub(crate) fn options(&self) -> Result<SinkOptions, Error> {
        let mut o = SinkOptions::default();
        o.format = self.format;
        o.cloudevents_source = self.cloudevents_source.clone();
        o.timeout = self.sink_timeout;
        o.nats_subject = self.nats_subject.clone();
        o.kafka_topic = self.kafka_topic.clone();
        o.redis_stream = self.redis_stream.clone();
        o.redis_maxlen = self.redis_maxlen.and_then(|n| usize::try_from(n).ok());
        o.amqp_exchange = self.amqp_exchange.clone();
        o.amqp_routing_key = self.amqp_routing_key.clone();
        o.webhook_secret = self.webhook_secret.clone();
        o.webhook_headers = self.webhook_headers.clone();
        o.tls = self.sink_tls;
        o.tls_ca_file = self.sink_tls_ca_file.clone();
        o.tls_client_cert = self.sink_tls_client_cert.clone();
        o.tls_client_key = self.sink_tls_client_key.clone();
        o.user = self.sink_user.clone();
        o.password = match (&self.sink_password_file, &self.sink_password) {
            (Some(path), _) => Some(read_secret("sink-password-file", path)?),
            (None, Some(p)) => Some(Secret::new(p.as_str())),
            (None, None) => None,
        };
        o.nats_credentials = self.nats_creds.as_deref().map(|p| read_secret("nats-creds", p)).transpose()?;
        o.nats_nkey = self.nats_nkey_file.as_deref().map(|p| read_secret("nats-nkey-file", p)).transpose()?;
        o.nats_token = self.nats_token_file.as_deref().map(|p| read_secret("nats-token-file", p)).transpose()?;
        o.kafka_sasl_mechanism = self.kafka_sasl_mechanism.clone();
        o.kafka_options = self.kafka_options.clone();
        Ok(o)
    }
}

fn parse_format(s: &str) -> Result<Format, String> {
    s.parse().map_err(|e: pg_outbox::Error| e.to_string())
}

/// CloudEvents 1.0 requires a non-empty `source` (a URI-reference).
fn parse_source(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("the CloudEvents source must not be empty (the spec requires it), e.g. /billing".into());
    }
    Ok(s.to_string())
}

fn parse_template(s: &str) -> Result<Template, String> {
    Template::parse(s).map_err(|e| e.to_string())
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) =
        s.split_once(':').ok_or_else(|| format!("invalid header '{s}': write NAME: VALUE, e.g. 'X-Team: billing'"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("invalid header '{s}': the name is empty"));
    }
    Ok((name.to_string(), value.trim().to_string()))
}

fn parse_kafka_option(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err("write KEY=VALUE with a librdkafka property, e.g. compression.type=zstd".to_string()),
    }
}

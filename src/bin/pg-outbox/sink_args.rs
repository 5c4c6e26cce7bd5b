//! The `relay` and `replay` flags that configure sinks: the ones every sink
//! shares, then one group per sink built in, which the sink declares itself
//! ([`pg_outbox::relay::SinkFlags`]).
//! Every secret-bearing flag is parsed into a secret type
//! ([`Secret`], [`SecretUrl`], the sinks' header and property types), which
//! decides how `--print-config` shows it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pg_outbox::relay::{DeliveryOptions, Format, SinkSettings};
use pg_outbox::secret::{Secret, SecretUrl};

use crate::error::Error;

/// Sink settings; each sink reads the shared ones and its own group.
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
    pub(crate) sink: SecretUrl,
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
    /// Deliver each event exactly once: the broker refuses a repeat (an
    /// event delivered again after a crash), and the relay acknowledges it
    /// without a second copy only when it reads that very event back from
    /// the broker (outbox_sink_acknowledged_unsent_total{proof}); an event
    /// the broker cannot be shown to hold fails instead. NATS JetStream:
    /// reads each subject's last message back and publishes with
    /// Nats-Expected-Last-Subject-Sequence; needs --nats-subject with
    /// {aggregate_id} and streams that keep each subject's last message
    /// (retention limits; no max_age, max_msgs or max_bytes; keep at
    /// least twice --batch-size per subject with max_msgs_per_subject, so
    /// every repeat can be proven). Redis Streams: XADD with the outbox
    /// id as entry id (Redis refuses one at or below the stream's top);
    /// needs --redis-stream with {aggregate_id} and a maxmemory-policy that
    /// does not evict keys. Broker settings are checked at start and every
    /// minute. Refused at start for stdout, webhook and RabbitMQ (the
    /// destination cannot refuse a repeat) and Kafka (no transactional
    /// producer); they stay at-least-once: deduplicate on the `id` header.
    /// Not with --mode competing (no per-aggregate order), nor on an outbox
    /// in ordering mode producer-locked (or with no insert trigger) unless
    /// --producers-lock-aggregates.
    #[arg(long)]
    pub(crate) exactly_once: bool,
    /// How often --exactly-once checks the broker's settings again while
    /// delivering (default 60s). Hidden: for tests.
    #[arg(long, hide = true, value_parser = crate::parse::parse_duration, value_name = "DURATION")]
    broker_check_interval: Option<Duration>,
    // One group per sink this build has, each declared by its sink.
    #[command(flatten)]
    sinks: pg_outbox::relay::SinkFlags,
    #[command(flatten)]
    access: AccessArgs,
}

/// TLS and credentials, shared by the brokers.
#[derive(clap::Args, Debug)]
#[command(next_help_heading = "Sink TLS and credentials")]
struct AccessArgs {
    /// Use TLS to the broker: NATS (same as a tls:// URL) and Kafka
    /// (security.protocol SSL, or SASL_SSL with --kafka-sasl-mechanism).
    /// Redis and RabbitMQ take TLS from the scheme: rediss://, amqps://.
    /// Any --sink-tls-* file implies it.
    #[arg(long)]
    sink_tls: bool,
    /// PEM file of the CA certificate(s) that sign the broker's certificate
    /// (all sinks but the webhook); default: the system's root certificates
    /// (RabbitMQ adds the file's certificates to them).
    #[arg(long, value_name = "FILE")]
    sink_tls_ca_file: Option<PathBuf>,
    /// PEM file of a client certificate to present (mutual TLS), with
    /// --sink-tls-client-key.
    #[arg(long, value_name = "FILE", requires = "sink_tls_client_key")]
    sink_tls_client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key.
    #[arg(long, value_name = "FILE", requires = "sink_tls_client_cert")]
    sink_tls_client_key: Option<PathBuf>,
    /// User name at the broker (NATS user, Redis ACL user, RabbitMQ user,
    /// Kafka SASL user); overrides a user in the URL.
    #[arg(long, value_name = "USER")]
    sink_user: Option<String>,
    /// File holding the broker password (one line; a trailing newline is
    /// ignored); overrides --sink-password and a password in the URL.
    #[arg(long, value_name = "FILE")]
    sink_password_file: Option<PathBuf>,
    /// The broker password itself; prefer OUTBOX_SINK_PASSWORD or
    /// --sink-password-file (a command line is visible to other users).
    #[arg(long, value_name = "PASSWORD", hide_env_values = true)]
    sink_password: Option<Secret>,
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

/// The secret of the file `flag` names, if one is named.
fn secret_file(flag: &str, path: Option<&Path>) -> Result<Option<Secret>, Error> {
    path.map(|p| read_secret(flag, p)).transpose()
}

impl SinkArgs {
    /// The library's sink settings, secret files read.
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag for an unreadable or empty secret file.
    pub(crate) fn settings(&self) -> Result<SinkSettings, Error> {
        let mut s = SinkSettings::default();
        s.delivery = self.delivery();
        s.exactly_once = self.exactly_once;
        s.broker_check_interval = self.broker_check_interval;
        let a = &self.access;
        s.tls.enabled = a.sink_tls;
        s.tls.ca_file = a.sink_tls_ca_file.clone();
        s.tls.client_cert = a.sink_tls_client_cert.clone();
        s.tls.client_key = a.sink_tls_client_key.clone();
        s.credentials.user = a.sink_user.clone();
        s.credentials.password = match secret_file("sink-password-file", a.sink_password_file.as_deref())? {
            Some(p) => Some(p),
            None => a.sink_password.clone(),
        };
        if s.credentials.password.as_ref().is_some_and(|p| p.expose().is_empty()) {
            return Err(Error::Config("--sink-password is empty; give the password, or leave the flag out".into()));
        }
        self.sinks.apply(&mut s)?;
        Ok(s)
    }

    /// Format, CloudEvents source and timeout, as the relay applies them.
    pub(crate) fn delivery(&self) -> DeliveryOptions {
        let mut d = DeliveryOptions::default();
        d.format = self.format;
        d.cloudevents_source = self.cloudevents_source.clone();
        d.timeout = self.sink_timeout;
        d
    }

    /// Open the sink `--sink` names.
    ///
    /// # Errors
    /// As [`pg_outbox::relay::open_sink`], and [`Error::Config`] for an
    /// unreadable secret file.
    pub(crate) async fn open(&self) -> Result<Box<dyn pg_outbox::relay::Sink>, Error> {
        Ok(pg_outbox::relay::open_sink(&self.sink, &self.settings()?).await?)
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

//! The `relay` flags that configure sinks.

use std::time::Duration;

use pg_outbox::relay::{Format, SinkOptions, Template};

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
}

impl SinkArgs {
    /// The library's sink options.
    pub(crate) fn options(&self) -> SinkOptions {
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
        o
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

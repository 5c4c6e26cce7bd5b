//! The settings of the sinks: what every sink shares (delivery, TLS and
//! credentials, see `access`) and one options struct per sink. `Debug` is
//! derived: every secret is a [`Secret`](crate::secret::Secret), which prints
//! masked.

use super::DeliveryOptions;
use super::access::{Credentials, TlsOptions};

/// Default of [`SinkSettings::broker_check_interval`]: 60 seconds.
pub const DEFAULT_BROKER_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Settings of the sinks, as the `pg-outbox relay` flags give them: the
/// shared groups, and one field per sink (present when its Cargo feature
/// is on). Each sink reads its own field and the shared groups. Every
/// default is the flag's default.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct SinkSettings {
    /// Format, CloudEvents source and timeout, the same for every sink.
    pub delivery: DeliveryOptions,
    /// TLS to the broker (NATS, Kafka, Redis, RabbitMQ).
    pub tls: TlsOptions,
    /// The broker's user and password (NATS, Kafka SASL, Redis, RabbitMQ).
    pub credentials: Credentials,
    /// Deliver each event exactly once (`--exactly-once`; default `false`,
    /// at-least-once): the destination refuses a repeat, and the sink
    /// acknowledges a refused one without a second copy
    /// ([`super::Guarantee::ExactlyOnce`]). Only the NATS JetStream and
    /// Redis Streams sinks support it, and only with a subject or stream key
    /// template that holds `{aggregate_id}`; [`super::open_sink`] refuses
    /// it for any other sink (the webhook, RabbitMQ and stdout have no way
    /// for the destination to refuse a repeat; Kafka: see
    /// [`super::SinkKind::no_exactly_once`]) and the NATS sink refuses
    /// streams that may lose a subject's last message. An event is
    /// acknowledged without a send only when the sink reads this very event
    /// back from the broker ([`super::Sent::Held`]); one the broker cannot
    /// be shown to hold fails. It relies on the relay handing one
    /// aggregate's events to the sink one at a time in id order, which the
    /// `single` and `partitioned` modes do (not `competing`), and
    /// [`super::run_with`] checks.
    pub exactly_once: bool,
    /// How often an exactly-once sink checks again, while it delivers, the
    /// broker settings it checked at start (NATS stream limits and server
    /// version, Redis eviction policy); `None` (the default):
    /// [`DEFAULT_BROKER_CHECK_INTERVAL`], a minute. A setting found to
    /// break exactly-once stops the relay with a
    /// [`super::FatalSinkError`] naming it (the event in hand released). A
    /// check that cannot read the settings is logged and tried again at the
    /// next interval.
    pub broker_check_interval: Option<std::time::Duration>,
    /// The webhook sink's options.
    #[cfg(feature = "webhook")]
    pub webhook: super::sinks::webhook::WebhookOptions,
    /// The NATS JetStream sink's options.
    #[cfg(feature = "nats")]
    pub nats: super::sinks::nats::NatsOptions,
    /// The Kafka sink's options.
    #[cfg(feature = "kafka")]
    pub kafka: super::sinks::kafka::KafkaOptions,
    /// The Redis Streams sink's options.
    #[cfg(feature = "redis")]
    pub redis: super::sinks::redis::RedisOptions,
    /// The RabbitMQ sink's options.
    #[cfg(feature = "amqp")]
    pub amqp: super::sinks::amqp::AmqpOptions,
}

#[cfg(test)]
mod tests {
    /// Every secret-bearing field of every sink this build has, filled with
    /// a secret of its own; the secrets.
    fn filled() -> (super::SinkSettings, Vec<&'static str>) {
        use crate::secret::Secret;
        let mut s = super::SinkSettings::default();
        let mut secrets = vec!["pw-credentials"];
        s.credentials.user = Some("user".into());
        s.credentials.password = Some(Secret::new("pw-credentials"));
        #[cfg(feature = "webhook")]
        {
            use crate::relay::HttpHeader;
            s.webhook.secret = Some(Secret::new("whsec-webhook"));
            s.webhook.headers =
                vec![HttpHeader::new("Authorization", "Bearer bearer-1"), HttpHeader::new("X-Api-Key", "ak-2")];
            secrets.extend(["whsec-webhook", "bearer-1", "ak-2"]);
        }
        #[cfg(feature = "nats")]
        {
            s.nats.token = Some(Secret::new("nats-token"));
            s.nats.nkey = Some(Secret::new("nats-nkey"));
            s.nats.credentials = Some(Secret::new("nats-creds"));
            secrets.extend(["nats-token", "nats-nkey", "nats-creds"]);
        }
        #[cfg(feature = "kafka")]
        {
            use crate::relay::KafkaProperty;
            s.kafka.properties = vec![
                KafkaProperty::new("sasl.password", "kafka-pw"),
                KafkaProperty::new("sasl.jaas.config", "kafka-jaas"),
                KafkaProperty::new("ssl.key.pem", "kafka-pem"),
                KafkaProperty::new("sasl.oauthbearer.client.secret", "kafka-oauth"),
            ];
            secrets.extend(["kafka-pw", "kafka-jaas", "kafka-pem", "kafka-oauth"]);
        }
        (s, secrets)
    }

    #[test]
    fn debug_of_settings_with_every_secret_filled_prints_none() {
        let (settings, secrets) = filled();
        for text in [format!("{settings:?}"), format!("{settings:#?}")] {
            for secret in &secrets {
                assert!(!text.contains(secret), "{secret} printed: {text}");
            }
            assert!(text.contains(crate::secret::MASK), "{text}");
        }
    }
}

//! The settings of the sinks: what every sink shares (delivery, TLS,
//! credentials) and one options struct per sink. `Debug` is derived: every
//! secret is a [`Secret`], which prints masked.

use std::path::PathBuf;

use super::DeliveryOptions;
#[cfg(feature = "amqp")]
use super::sinks::amqp::AmqpOptions;
#[cfg(feature = "kafka")]
use super::sinks::kafka::KafkaOptions;
#[cfg(feature = "nats")]
use super::sinks::nats::NatsOptions;
#[cfg(feature = "redis")]
use super::sinks::redis::RedisOptions;
#[cfg(feature = "webhook")]
use super::sinks::webhook::WebhookOptions;
use crate::error::{Error, Result};
use crate::secret::Secret;

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
    pub webhook: WebhookOptions,
    /// The NATS JetStream sink's options.
    #[cfg(feature = "nats")]
    pub nats: NatsOptions,
    /// The Kafka sink's options.
    #[cfg(feature = "kafka")]
    pub kafka: KafkaOptions,
    /// The Redis Streams sink's options.
    #[cfg(feature = "redis")]
    pub redis: RedisOptions,
    /// The RabbitMQ sink's options.
    #[cfg(feature = "amqp")]
    pub amqp: AmqpOptions,
}

/// TLS to a broker. Redis and RabbitMQ take TLS from the scheme
/// (`rediss://`, `amqps://`) and refuse these settings with a plain one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsOptions {
    /// Use TLS to the broker although the URL does not say so: NATS
    /// (`nats://`; `tls://` always does) and Kafka. Any of the three files
    /// implies it. Default off.
    pub enabled: bool,
    /// PEM file of the CA certificate(s) that sign the broker's
    /// certificate; `None` (the default) trusts the platform's root
    /// certificates. RabbitMQ adds the file's certificates to the
    /// platform's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (chain) to present for mutual TLS
    /// (with [`client_key`](Self::client_key)); default none.
    pub client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key (PKCS#8, PKCS#1 or
    /// SEC1); default none.
    pub client_key: Option<PathBuf>,
}

impl TlsOptions {
    /// Whether TLS is asked for: [`enabled`](Self::enabled) or any file.
    pub fn wanted(&self) -> bool {
        self.enabled || self.ca_file.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }

    /// Check the files before connecting to `broker` (a name for the
    /// message): each one given is readable and holds PEM, and a client
    /// certificate comes with its key.
    ///
    /// # Errors
    /// [`Error::Config`] naming the broker, the file and the flag.
    pub fn check_files(&self, broker: &str) -> Result<()> {
        match (&self.client_cert, &self.client_key) {
            (Some(_), None) => {
                return Err(Error::Config(format!(
                    "{broker}: a client certificate needs its private key (--sink-tls-client-key)"
                )));
            }
            (None, Some(_)) => {
                return Err(Error::Config(format!(
                    "{broker}: a client key needs its certificate (--sink-tls-client-cert)"
                )));
            }
            _ => {}
        }
        for (what, path) in [
            ("CA file (--sink-tls-ca-file)", &self.ca_file),
            ("client certificate (--sink-tls-client-cert)", &self.client_cert),
            ("client key (--sink-tls-client-key)", &self.client_key),
        ] {
            let Some(path) = path else { continue };
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("{broker}: TLS {what} {}: {e}", path.display())))?;
            if !text.contains("-----BEGIN ") {
                return Err(Error::Config(format!(
                    "{broker}: TLS {what} {} holds no PEM block (-----BEGIN ...)",
                    path.display()
                )));
            }
        }
        Ok(())
    }
}

/// The broker's user and password; both override ones in the URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Credentials {
    /// User name for the broker (NATS user, Redis ACL user, RabbitMQ user,
    /// Kafka SASL user). Default none.
    pub user: Option<String>,
    /// Password of [`user`](Self::user) (or of the URL's user). Default none.
    pub password: Option<Secret>,
}

/// Why a broker refused a connection, in words, when `error` (one line,
/// with its chain) shows a known cause: an untrusted certificate, a
/// certificate for another host name, a missing or refused client
/// certificate, refused credentials. `None` otherwise.
#[cfg_attr(not(any(feature = "nats", feature = "kafka", feature = "redis", feature = "amqp")), allow(dead_code))]
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

/// `error` preceded by its [`refusal_reason`], if it has one.
#[cfg_attr(not(any(feature = "nats", feature = "kafka", feature = "redis", feature = "amqp")), allow(dead_code))]
pub(crate) fn with_reason(error: String) -> String {
    match refusal_reason(&error) {
        Some(reason) => format!("{reason} ({error})"),
        None => error,
    }
}

#[cfg(test)]
mod tests {
    use super::refusal_reason;

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

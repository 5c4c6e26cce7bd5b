//! Kafka sink, on `rdkafka` (librdkafka).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;

use crate::error::{Error, Result};
use crate::event::Event;
use crate::relay::access::with_reason;
use crate::relay::{Message, SendFuture, Sent, Sink, SinkSettings, Template};
use crate::secret::{MASK, Secret, SecretUrl, looks_secret};

/// The Kafka sink's options (flags `--kafka-*`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaOptions {
    /// Topic template (default `outbox.event.{aggregate_type}`, the topic
    /// Debezium's outbox event router uses). The message key is the
    /// aggregate id.
    pub topic: Template,
    /// SASL mechanism: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`, with
    /// the user and password of [`SinkSettings::credentials`]; `None` (the
    /// default) uses no SASL.
    pub sasl_mechanism: Option<String>,
    /// Extra librdkafka properties, applied last, so they override the
    /// sink's own (e.g. `security.protocol`, `sasl.oauthbearer.*`,
    /// `compression.type`); default none.
    pub properties: Vec<KafkaProperty>,
}

impl Default for KafkaOptions {
    fn default() -> Self {
        KafkaOptions {
            topic: Template::builtin("outbox.event.{aggregate_type}"),
            sasl_mechanism: None,
            properties: Vec::new(),
        }
    }
}

/// A librdkafka producer property, `KEY=VALUE` (flag `--kafka-option`).
/// The value is kept as a [`Secret`] when the key may hold one
/// (`sasl.password`, `ssl.key.password`, `ssl.key.pem`,
/// `sasl.jaas.config`, `sasl.oauthbearer.client.secret`, ...): `Display`
/// and `Debug` then print it as `****`.
///
/// # Example
/// ```
/// use pg_outbox::relay::KafkaProperty;
/// let p: KafkaProperty = "sasl.password=pw".parse().unwrap();
/// assert_eq!(p.to_string(), "sasl.password=****");
/// assert_eq!(p.value(), "pw");
/// assert_eq!("compression.type=zstd".parse::<KafkaProperty>().unwrap().to_string(), "compression.type=zstd");
/// assert!("=x".parse::<KafkaProperty>().is_err());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaProperty {
    key: String,
    value: Secret,
    secret: bool,
}

impl KafkaProperty {
    /// The property `key` = `value`.
    pub fn new(key: impl Into<String>, value: impl Into<String>) -> Self {
        let key = key.into();
        let secret = looks_secret(&key);
        KafkaProperty { key, value: Secret::new(value), secret }
    }

    /// The property's name.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The property's value, as set.
    pub fn value(&self) -> &str {
        self.value.expose()
    }
}

impl std::str::FromStr for KafkaProperty {
    type Err = Error;
    /// `KEY=VALUE`; the key is trimmed, the value kept as written.
    fn from_str(s: &str) -> Result<Self> {
        match s.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok(KafkaProperty::new(k.trim(), v)),
            _ => {
                Err(Error::Config("write KEY=VALUE with a librdkafka property, e.g. compression.type=zstd".to_string()))
            }
        }
    }
}

impl std::fmt::Display for KafkaProperty {
    /// `KEY=VALUE`, the value masked when it may be a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = if self.secret { MASK } else { self.value.expose() };
        write!(f, "{}={value}", self.key)
    }
}

impl std::fmt::Debug for KafkaProperty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("KafkaProperty").field(&self.to_string()).finish()
    }
}

/// Port used for a `kafka://` host given without one: 9092.
pub const DEFAULT_KAFKA_PORT: u16 = 9092;

/// Longest Kafka topic name: 249 characters (Kafka's `Topic.validate`).
const TOPIC_MAX: usize = 249;

/// Extra wait past `message.timeout.ms` for librdkafka's own delivery
/// report, before the sink gives up on it.
const REPORT_MARGIN: Duration = Duration::from_secs(5);

/// The producer's client context: remembers librdkafka's error reports
/// (a failed TLS handshake, a refused SASL login), which say why a broker
/// cannot be reached where the metadata request only says that it cannot.
#[derive(Clone, Default)]
struct Context {
    errors: Arc<Mutex<Vec<String>>>,
}

/// Distinct error reports a [`Context`] keeps.
const KEPT_ERRORS: usize = 3;

impl Context {
    /// The reports since the last call, distinct, oldest first.
    fn take(&self) -> Option<String> {
        let errors = std::mem::take(&mut *self.errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        (!errors.is_empty()).then(|| errors.join("; "))
    }
}

impl ClientContext for Context {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "librdkafka error");
        let mut errors = self.errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if errors.len() < KEPT_ERRORS && !errors.iter().any(|e| e == reason) {
            errors.push(reason.to_string());
        }
    }
}

/// The producer, with its context.
type KafkaProducer = FutureProducer<Context>;

/// Most produce requests librdkafka keeps in flight per broker connection:
/// 5, the most its idempotent producer allows while it keeps the order of
/// each partition (and without duplicates) across its own retries.
const MAX_REQUESTS_IN_FLIGHT: &str = "5";

/// A producer shared by the sink and the sends in flight on it (each holds
/// an `Arc`). Whichever drops the last `Arc` destroys it, and that happens
/// off the async runtime: dropping a librdkafka producer purges what it
/// still holds, waits up to 500 ms for those reports and joins its
/// threads, which must not stall a runtime worker.
struct Handle(Option<KafkaProducer>);

impl Handle {
    fn new(producer: KafkaProducer) -> Arc<Self> {
        Arc::new(Handle(Some(producer)))
    }
}

impl std::ops::Deref for Handle {
    type Target = KafkaProducer;
    fn deref(&self) -> &KafkaProducer {
        // Taken only by `drop`, after which nothing derefs it.
        self.0.as_ref().expect("the producer is held until the handle is dropped")
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let Some(producer) = self.0.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn_blocking(move || drop(producer));
            }
            // Not on a runtime: blocking here stalls nothing.
            Err(_) => drop(producer),
        }
    }
}

/// Whether a failed delivery (`error`, from the delivery report) may say
/// something about the producer rather than about the message: anything
/// but a refusal of this message itself (too large, invalid, a topic it
/// may not write or that is invalid, a broker policy). Only such a failure
/// renews the producer: a message the broker refuses would fail again on a
/// new producer, and each new one costs every later send a connection and
/// a producer id first.
fn implicates_producer(error: &KafkaError) -> bool {
    !matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::PolicyViolation
                | RDKafkaErrorCode::InvalidRecord
        )
    )
}

/// Produces each event to a Kafka topic and acknowledges it only on the
/// broker's delivery report.
///
/// The producer runs with `acks=all` and `enable.idempotence=true`
/// (librdkafka's idempotent producer: no duplicates or reordering from its
/// own retries), `max.in.flight.requests.per.connection=5` (the most the
/// idempotent producer allows while it keeps each partition's order),
/// `linger.ms=0`, `compression.type=none` (small messages gain little), and
/// `partitioner=murmur2_random`, the hash Java clients use, so a key lands in
/// the partition a Java producer would pick. `linger.ms=0` costs no
/// batching: the relay keeps many sends in flight, and librdkafka puts the
/// messages that queue up while a request is in flight into the next one;
/// an idle relay's lone event then goes out at once instead of waiting for
/// the linger. The message key is the aggregate id (one aggregate stays in
/// one partition, as Debezium's outbox event router does), the topic is
/// rendered from a [`Template`], the headers are the [`Message`] headers.
///
/// A delivery returns `Ok` only when its own delivery report says the
/// partition leader wrote the message with all in-sync replicas
/// (`acks=all`); it fails when the report is an error or does not arrive
/// within the timeout (`message.timeout.ms`), e.g. while the broker is
/// down. Sends overlap (for different aggregates: the relay keeps one per
/// aggregate in flight), all on one producer.
///
/// After a failed delivery (the relay's timeout included; not a refusal of
/// the message itself, such as one too large), or a fatal idempotence
/// error, the producer is replaced by a new one (with a new producer id),
/// once per producer however many of its sends fail: later sends go to the
/// new one. The other sends in flight on the old producer are not cut
/// short: each keeps the old producer alive and ends with its own delivery
/// report (or its timeout), delivered or failed as the broker said; the
/// old producer is destroyed, off the async runtime, when the last of them
/// ends.
pub struct KafkaSink {
    config: ClientConfig,
    brokers: String,
    name: String,
    topic: Template,
    timeout: Duration,
    producer: Mutex<Arc<Handle>>,
    context: Context,
    /// Values cut out of librdkafka's errors.
    quoted: Vec<Secret>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic.as_str())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The bootstrap servers of a `kafka://host:port[,host:port]` URL, as
/// librdkafka's `bootstrap.servers` wants them (`host:port,host:port`).
///
/// # Errors
/// [`Error::Config`] for another scheme, an empty host list, a bad port,
/// credentials, a path or a query string (not supported by this sink).
fn parse_kafka_url(url: &str) -> Result<String> {
    // Messages quote the URL without credentials, query or fragment.
    let shown = SecretUrl::new(url).shown();
    let rest = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("kafka") => rest,
        _ => return Err(Error::Config("a Kafka sink URL starts with kafka://".into())),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('@') {
        return Err(Error::Config(
            "Kafka URL with credentials: write kafka://HOST:PORT[,HOST:PORT] and give the user with --sink-user, \
             the password with --sink-password-file (or OUTBOX_SINK_PASSWORD) and --kafka-sasl-mechanism"
                .into(),
        ));
    }
    if rest.contains(['/', '?', '#']) {
        return Err(Error::Config(format!(
            "Kafka URL '{shown}' has a path or query; write kafka://HOST:PORT[,HOST:PORT]"
        )));
    }
    let mut servers = Vec::new();
    for part in rest.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(Error::Config(format!(
                "Kafka URL '{shown}' has an empty host; write kafka://HOST:PORT[,HOST:PORT]"
            )));
        }
        // A bracketed IPv6 address keeps its colons: [::1]:9092.
        let (host, port) = match part.rsplit_once(':') {
            Some((h, p)) if !p.contains(']') => (h, Some(p)),
            _ => (part, None),
        };
        if host.is_empty() {
            return Err(Error::Config(format!("Kafka URL '{shown}' has an empty host in '{part}'")));
        }
        let port = match port {
            None => DEFAULT_KAFKA_PORT,
            Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                Error::Config(format!("Kafka URL '{shown}': port '{p}' of '{part}' is not a number from 1 to 65535"))
            })?,
        };
        servers.push(format!("{host}:{port}"));
    }
    Ok(servers.join(","))
}

/// Whether `topic` is a legal Kafka topic name: 1 to 249 characters from
/// `[a-zA-Z0-9._-]`, and not `.` or `..` (Kafka's `Topic.validate`).
fn check_topic(topic: &str) -> Result<(), String> {
    let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if topic.is_empty() || topic.len() > TOPIC_MAX || topic == "." || topic == ".." || !topic.chars().all(legal) {
        return Err(format!(
            "'{topic}' is not a valid Kafka topic name (1 to {TOPIC_MAX} of a-z A-Z 0-9 . _ -); check --kafka-topic"
        ));
    }
    Ok(())
}

/// SASL mechanisms [`KafkaOptions::sasl_mechanism`] takes.
const SASL_MECHANISMS: [&str; 3] = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"];

/// The producer's librdkafka properties: the sink's defaults, then TLS
/// and SASL from `settings`, then [`KafkaOptions::properties`].
fn client_config(brokers: &str, settings: &SinkSettings) -> Result<ClientConfig> {
    let (tls, credentials, kafka) = (&settings.tls, &settings.credentials, &settings.kafka);
    let timeout = settings.delivery.timeout;
    tls.check_files("Kafka")?;
    let timeout_ms = timeout.as_millis().clamp(1, u128::from(i32::MAX as u32)).to_string();
    let request_ms = timeout.as_millis().clamp(1, 30_000).to_string();
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("client.id", "pg-outbox")
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("max.in.flight.requests.per.connection", MAX_REQUESTS_IN_FLIGHT)
        .set("linger.ms", "0")
        .set("compression.type", "none")
        .set("partitioner", "murmur2_random")
        .set("message.timeout.ms", &timeout_ms)
        .set("request.timeout.ms", &request_ms);
    let sasl = match &kafka.sasl_mechanism {
        None => {
            if credentials.user.is_some() || credentials.password.is_some() {
                return Err(Error::Config(
                    "Kafka: a user or password needs a SASL mechanism (--kafka-sasl-mechanism PLAIN, \
                     SCRAM-SHA-256 or SCRAM-SHA-512)"
                        .into(),
                ));
            }
            false
        }
        Some(m) => {
            let m = m.to_ascii_uppercase();
            if !SASL_MECHANISMS.contains(&m.as_str()) {
                return Err(Error::Config(format!(
                    "Kafka SASL mechanism '{m}' is not one of {}; set others with --kafka-option sasl.mechanism=...",
                    SASL_MECHANISMS.join(", ")
                )));
            }
            let (Some(user), Some(password)) = (&credentials.user, &credentials.password) else {
                return Err(Error::Config(format!(
                    "Kafka SASL {m} needs a user (--sink-user) and a password (--sink-password-file)"
                )));
            };
            config.set("sasl.mechanism", &m).set("sasl.username", user).set("sasl.password", password.expose());
            true
        }
    };
    let protocol = match (tls.wanted(), sasl) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    config.set("security.protocol", protocol);
    let path = |p: &std::path::Path| p.display().to_string();
    if let Some(ca) = &tls.ca_file {
        config.set("ssl.ca.location", path(ca));
    }
    if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
        config.set("ssl.certificate.location", path(cert)).set("ssl.key.location", path(key));
    }
    for p in &kafka.properties {
        config.set(p.key(), p.value());
    }
    Ok(config)
}

impl KafkaSink {
    /// Create the producer for `url` (`kafka://host:port[,host:port]`,
    /// port [`DEFAULT_KAFKA_PORT`] when left out) and check that a broker
    /// answers (a metadata request within the delivery timeout, which also
    /// becomes librdkafka's `message.timeout.ms`: how long one event may
    /// wait for its delivery report, retries included).
    ///
    /// Security: `security.protocol` is `ssl` with TLS asked for
    /// ([`crate::relay::TlsOptions::wanted`]), `sasl_plaintext` with
    /// [`KafkaOptions::sasl_mechanism`], `sasl_ssl` with both, `plaintext`
    /// otherwise; the CA file becomes `ssl.ca.location` (else OpenSSL's
    /// default roots), the client certificate and key
    /// `ssl.certificate.location` and `ssl.key.location`; the broker's host
    /// name is checked (librdkafka's default
    /// `ssl.endpoint.identification.algorithm=https`).
    /// [`KafkaOptions::properties`] are set last and override all of it.
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed URL, inconsistent SASL settings, an
    /// unreadable TLS file, or a producer librdkafka refuses to create (an
    /// unknown property); [`Error::SinkUnavailable`] when no broker answers,
    /// with librdkafka's last error report (a failed TLS handshake, a
    /// refused login) and the reason in words.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the producer being created.
    pub async fn connect(url: &SecretUrl, settings: &SinkSettings) -> Result<Self> {
        let brokers = parse_kafka_url(url.expose())?;
        let config = client_config(&brokers, settings)?;
        let context = Context::default();
        // Every --kafka-option value (3 characters or more) and the SASL
        // password: never quoted back in an error.
        let mut quoted: Vec<Secret> = settings.credentials.password.iter().cloned().collect();
        quoted.extend(settings.kafka.properties.iter().filter(|p| p.value().len() >= 3).map(|p| p.value.clone()));
        let producer = Handle::new(Self::create(&config, &brokers, &context, &quoted)?);
        let probe = producer.clone();
        let wait = settings.delivery.timeout;
        let answered = tokio::task::spawn_blocking(move || probe.client().fetch_metadata(None, wait).map(|_| ()))
            .await
            .map_err(|e| Error::Config(format!("Kafka metadata check did not finish: {e}")))?;
        if let Err(e) = answered {
            let mut why = crate::error::report(&e);
            if let Some(reason) = context.take() {
                why = format!("{reason}; {why}");
            }
            // The handle's last drop destroys it off the runtime.
            drop(producer);
            return Err(Error::SinkUnavailable(format!(
                "cannot connect to Kafka at {brokers} within {wait:?}: {}",
                with_reason(why)
            )));
        }
        let topic = settings.kafka.topic.clone();
        Ok(KafkaSink {
            config,
            name: format!("Kafka {brokers} topic '{topic}'"),
            brokers,
            topic,
            timeout: wait,
            producer: Mutex::new(producer),
            context,
            quoted,
        })
    }

    /// A producer for `config`. librdkafka's configuration errors quote
    /// property values: every value in `quoted` is cut out of them.
    fn create(config: &ClientConfig, brokers: &str, context: &Context, quoted: &[Secret]) -> Result<KafkaProducer> {
        config.create_with_context(context.clone()).map_err(|e| {
            let quoted: Vec<&str> = quoted.iter().map(Secret::expose).collect();
            let why = crate::secret::scrub_all(&crate::error::report(&e), &quoted);
            Error::Config(format!("cannot create a Kafka producer for {brokers}: {why}"))
        })
    }

    /// The producer to use now; a new one if the current one hit a fatal
    /// error (librdkafka: an idempotent producer that lost its guarantees
    /// must be recreated; the sends in flight on it get their fatal error
    /// reports).
    fn producer(&self) -> Result<Arc<Handle>, String> {
        let mut current = self.producer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((code, reason)) = current.client().fatal_error() {
            tracing::warn!(brokers = %self.brokers, %code, %reason, "Kafka producer hit a fatal error; creating a new one");
            let fresh =
                Self::create(&self.config, &self.brokers, &self.context, &self.quoted).map_err(|e| e.to_string())?;
            // The old one is destroyed off the runtime by its last holder.
            *current = Handle::new(fresh);
        }
        Ok(current.clone())
    }

    /// Replace `used` after a failed delivery, if it is still the current
    /// producer: of many sends failing on one producer (a broker outage
    /// fails every send in flight), only the first replaces it, and later
    /// sends go to the new one. The new producer gets a new producer id,
    /// which also recovers from a broker that forgot the old id (it answers
    /// UNKNOWN_PRODUCER_ID forever, e.g. after losing its state).
    ///
    /// Nothing in flight is lost: each send on `used` holds it, so it stays
    /// alive, and the send gets its own report from it, true either way.
    fn renew(&self, used: &Arc<Handle>) {
        let mut current = self.producer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !Arc::ptr_eq(&current, used) {
            return;
        }
        match Self::create(&self.config, &self.brokers, &self.context, &self.quoted) {
            Ok(fresh) => {
                tracing::info!(brokers = %self.brokers, "replacing the Kafka producer after a failed delivery");
                *current = Handle::new(fresh);
            }
            Err(e) => {
                tracing::warn!(brokers = %self.brokers, error = %e, "cannot create a new Kafka producer; keeping the old one")
            }
        }
    }

    async fn produce(&self, msg: &Message, event: &Event) -> Result<(), String> {
        let topic = self.topic.render(event);
        check_topic(&topic)?;
        let mut headers = OwnedHeaders::new_with_capacity(msg.headers.len());
        for (name, value) in &msg.headers {
            headers = headers.insert(Header { key: name, value: Some(value.as_bytes()) });
        }
        let producer = self.producer()?;
        let record = FutureRecord::to(&topic).key(msg.key.as_bytes()).payload(&msg.body).headers(headers);
        let report = producer
            .send_result(record)
            .map_err(|(e, _)| format!("the producer refused the message for topic '{topic}': {e}"))?;
        // Dropped before the report (the relay's timeout) or failed: renew.
        let mut renew = RenewOnDrop { sink: self, used: Some(producer) };
        let failure = match tokio::time::timeout(self.timeout + REPORT_MARGIN, report).await {
            Ok(Ok(Ok(delivery))) => {
                tracing::debug!(
                    id = event.id,
                    topic = %topic,
                    partition = delivery.partition,
                    offset = delivery.offset,
                    "Kafka delivery report"
                );
                renew.used = None;
                return Ok(());
            }
            Ok(Ok(Err((e, _)))) => {
                if !implicates_producer(&e) {
                    renew.used = None;
                }
                format!("the broker did not take the message for topic '{topic}': {}", crate::error::report(&e))
            }
            Ok(Err(_canceled)) => format!("the producer dropped the message for topic '{topic}'"),
            Err(_) => format!("no delivery report for topic '{topic}' within {:?}", self.timeout + REPORT_MARGIN),
        };
        Err(failure)
    }
}

/// Renews the producer `used` when dropped armed: a delivery that did not
/// end with a report, or whose failure may be the producer's. Disarmed
/// (`used` taken), it only lets go of the producer.
struct RenewOnDrop<'a> {
    sink: &'a KafkaSink,
    used: Option<Arc<Handle>>,
}

impl Drop for RenewOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(used) = self.used.take() {
            self.sink.renew(&used);
        }
    }
}

/// Open the Kafka sink (`--sink kafka://...`).
pub(crate) fn open<'a>(url: &'a SecretUrl, settings: &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>> {
    Box::pin(async move { Ok(Box::new(KafkaSink::connect(url, settings).await?) as Box<dyn Sink>) })
}

/// The Kafka sink's flags (feature `cli`).
#[cfg(feature = "cli")]
#[derive(clap::Args, Debug)]
#[group(skip)]
pub(crate) struct Flags {
    /// Kafka topic template (the message key is the aggregate id).
    #[arg(long, default_value = "outbox.event.{aggregate_type}", value_parser = |s: &str| Template::parse(s).map_err(|e| e.to_string()))]
    kafka_topic: Template,
    /// Kafka SASL mechanism, with --sink-user and a password: PLAIN,
    /// SCRAM-SHA-256 or SCRAM-SHA-512 (others, e.g. OAUTHBEARER, through
    /// --kafka-option). security.protocol becomes SASL_SSL with --sink-tls
    /// (or a TLS file), else SASL_PLAINTEXT.
    #[arg(long, value_name = "MECHANISM", value_parser = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"], help_heading = "Sink TLS and credentials")]
    kafka_sasl_mechanism: Option<String>,
    /// Any librdkafka producer property, KEY=VALUE (repeatable), applied
    /// last: it overrides the sink's own. The sink's defaults: acks=all,
    /// enable.idempotence=true, max.in.flight.requests.per.connection=5,
    /// linger.ms=0 (each send goes out at once; --max-in-flight overlaps them),
    /// compression.type=none, partitioner=murmur2_random (Java's),
    /// message.timeout.ms from --sink-timeout. E.g.
    /// --kafka-option sasl.mechanism=OAUTHBEARER.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = crate::relay::cli::NoEcho::<KafkaProperty>::new(), help_heading = "Sink TLS and credentials")]
    kafka_options: Vec<KafkaProperty>,
}

#[cfg(feature = "cli")]
impl Flags {
    /// Write the flags into [`SinkSettings::kafka`].
    pub(crate) fn apply(&self, settings: &mut SinkSettings) -> Result<()> {
        settings.kafka.topic = self.kafka_topic.clone();
        settings.kafka.sasl_mechanism = self.kafka_sasl_mechanism.clone();
        settings.kafka.properties = self.kafka_options.clone();
        Ok(())
    }
}

impl Sink for KafkaSink {
    fn name(&self) -> &str {
        &self.name
    }

    /// No cap of its own (`None`): sends overlap on one producer, and a
    /// failed one replaces the producer without costing the others their
    /// reports (see [`KafkaSink`]).
    fn max_in_flight(&self) -> Option<usize> {
        None
    }

    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SendFuture<'a> {
        Box::pin(async move { self.produce(message, event).await.map(|()| Sent::Delivered).map_err(Into::into) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_urls_give_bootstrap_servers() {
        assert_eq!(parse_kafka_url("kafka://k1:9093").expect("one host"), "k1:9093");
        assert_eq!(parse_kafka_url("kafka://k1,k2:9094/").expect("two hosts"), "k1:9092,k2:9094");
        assert_eq!(parse_kafka_url("KAFKA://[::1]:9092").expect("ipv6"), "[::1]:9092");
        for bad in
            ["kafka://", "kafka://a,,b", "kafka://a:0", "kafka://a:x", "kafka://u:p@a", "kafka://a/t", "http://a"]
        {
            assert!(parse_kafka_url(bad).is_err(), "{bad} must be refused");
        }
    }

    #[test]
    fn only_a_failure_that_may_be_the_producers_renews_it() {
        use rdkafka::error::KafkaError::MessageProduction;
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::UnknownProducerId,
            RDKafkaErrorCode::OutOfOrderSequenceNumber,
            RDKafkaErrorCode::NotEnoughReplicas,
            RDKafkaErrorCode::PurgeInflight,
        ] {
            assert!(implicates_producer(&MessageProduction(code)), "{code:?} renews");
        }
        for code in [RDKafkaErrorCode::MessageSizeTooLarge, RDKafkaErrorCode::TopicAuthorizationFailed] {
            assert!(!implicates_producer(&MessageProduction(code)), "{code:?} is the message's own");
        }
        assert!(implicates_producer(&KafkaError::Canceled));
    }

    #[test]
    fn topic_names_follow_kafkas_rules() {
        assert!(check_topic("outbox.event.invoice_v2-x").is_ok());
        for bad in ["", ".", "..", "a b", "a/b", &"x".repeat(250)] {
            assert!(check_topic(bad).is_err(), "{bad:?} must be refused");
        }
    }
}

//! RabbitMQ (AMQP 0-9-1) sink, on the `lapin` client.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, DefaultConnectionBuilder, ExchangeKind};

use crate::error::{Error, Result};
use crate::event::Event;
use crate::relay::access::with_reason;
use crate::relay::sink::delivered;
use crate::relay::{Message, SendFuture, Sink, SinkSettings, Template, TlsOptions};
use crate::secret::SecretUrl;

/// The RabbitMQ sink's options (flags `--amqp-*`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AmqpOptions {
    /// Exchange to publish to (default `amq.topic`, which every broker has).
    pub exchange: String,
    /// Routing key template (default `{aggregate_type}.{event_type}`).
    pub routing_key: Template,
}

impl Default for AmqpOptions {
    fn default() -> Self {
        AmqpOptions {
            exchange: "amq.topic".to_string(),
            routing_key: Template::builtin("{aggregate_type}.{event_type}"),
        }
    }
}

/// The `app_id` property of every message: `pg-outbox`.
pub const AMQP_APP_ID: &str = "pg-outbox";

/// AMQP 0-9-1 `delivery_mode` 2: the broker writes the message to disk
/// (AMQP 0-9-1 spec, `basic` class properties).
const PERSISTENT: u8 = 2;

/// Longest exchange name or routing key AMQP 0-9-1 allows (a `shortstr`).
const SHORTSTR_MAX: usize = 255;

/// Publishes each event to a RabbitMQ exchange and acknowledges it only on
/// the broker's publisher confirm.
///
/// Each message goes to `exchange` (default `amq.topic`) with the routing key
/// rendered from a [`Template`], `mandatory` set, persistent
/// (`delivery_mode` 2), `message_id` = outbox id (deduplicate on it),
/// `content_type`, `app_id` [`AMQP_APP_ID`], `timestamp` = occurred_at
/// (seconds) and the [`Message`] headers as a headers table (long strings).
///
/// A delivery returns `Ok` only after the broker's `basic.ack` for the
/// message (RabbitMQ "Consumer Acknowledgements and Publisher Confirms":
/// for a persistent message routed to durable queues the ack follows the
/// write to disk). It fails when the broker nacks, when it returns the
/// message as unroutable (`basic.return`: no queue is bound for the routing
/// key, which RabbitMQ reports before the ack), when no confirm arrives
/// within the relay's timeout, or when the connection is down.
///
/// Sends overlap, each on a confirm-mode channel of its own (of one
/// connection; a channel is reused once its message is confirmed), so a
/// confirm and a `basic.return` always belong to the one message on their
/// channel: lapin pairs a return with whichever confirm it resolves next,
/// which on a channel shared by several unconfirmed messages can be
/// another message's. At most as many sends as the connection may open
/// channels (its negotiated `channel_max`, 2047 on a default RabbitMQ) are
/// in flight at once ([`Sink::max_in_flight`]).
///
/// After a lost connection, a channel that broke, or a delivery the relay
/// gave up on (no confirm within its timeout), the connection is retired:
/// the next delivery opens a new one. The sends still in flight on the
/// retired connection end as the broker says (a confirm, a return, a
/// nack, or the error of the broken channel or connection: never taken
/// for delivered) or at their timeout; the connection is closed when the
/// last of them ends.
pub struct AmqpSink {
    uri: AMQPUri,
    shown: String,
    name: String,
    exchange: String,
    routing_key: Template,
    timeout: Duration,
    /// The CA file's certificates and the client identity (PEM); empty
    /// without `--sink-tls-*` files.
    tls: OwnedTLSConfig,
    /// The current link; the lock is held while one is opened, so sends
    /// that find none wait for that one.
    link: tokio::sync::Mutex<Option<Arc<Link>>>,
    /// Sends in flight at most: the first connection's `channel_max`.
    channels: usize,
}

impl std::fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URI: it holds the password.
        f.debug_struct("AmqpSink")
            .field("broker", &self.shown)
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key.as_str())
            .finish_non_exhaustive()
    }
}

/// An open connection, shared by the sends in flight on it (each holds an
/// `Arc`), and its confirm-mode channels that have nothing unconfirmed.
/// lapin closes the connection when the last holder drops it.
struct Link {
    conn: Connection,
    /// Channels in confirm mode with no message awaiting its confirm.
    idle: std::sync::Mutex<Vec<Channel>>,
    /// Set by a send that saw this link fail: no new send uses it. Only
    /// ever set on the link that send used, never on a newer one.
    retired: AtomicBool,
}

impl Link {
    /// Whether new sends may use it: connected, and not retired.
    fn usable(&self) -> bool {
        self.conn.status().connected() && !self.retired.load(Ordering::SeqCst)
    }

    /// Stop handing this link out; the next send opens a new one.
    fn retire(&self) {
        self.retired.store(true, Ordering::SeqCst);
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Channel>> {
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Close `conn` in the background, giving it 2 s.
    fn discard_conn(conn: Connection) {
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "pg-outbox closing".into())).await;
        });
    }
}

/// Channels a connection that negotiated `channel_max` can open: 0 means
/// no limit, which is at most 65 535 (a `short`).
fn channel_limit(channel_max: u16) -> usize {
    match channel_max {
        0 => usize::from(u16::MAX),
        n => usize::from(n),
    }
}

/// `host:port vhost '/x'`: where the URI points, without credentials.
fn describe(uri: &AMQPUri) -> String {
    let scheme = match uri.scheme {
        AMQPScheme::AMQP => "amqp",
        AMQPScheme::AMQPS => "amqps",
    };
    format!("{scheme}://{}:{} vhost '{}'", uri.authority.host, uri.authority.port, uri.vhost)
}

/// The TLS settings of `tls` for lapin: the CA file's PEM (added to the
/// platform's roots) and the client certificate and key (PEM; PKCS#8,
/// PKCS#1 or SEC1 keys). Empty without TLS files.
fn tls_config(tls: &TlsOptions) -> Result<OwnedTLSConfig> {
    tls.check_files("RabbitMQ")?;
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| Error::Config(format!("RabbitMQ: cannot read {}: {e}", p.display())))
    };
    let cert_chain = match &tls.ca_file {
        Some(path) => Some(String::from_utf8(read(path)?).map_err(|_| {
            Error::Config(format!("RabbitMQ: TLS CA file (--sink-tls-ca-file) {} is not UTF-8 PEM", path.display()))
        })?),
        None => None,
    };
    let identity = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => Some(OwnedIdentity::PKCS8 { pem: read(cert)?, key: read(key)? }),
        _ => None,
    };
    Ok(OwnedTLSConfig { identity, cert_chain })
}

/// The error of a failed step, one line, with its source chain.
fn report(e: &lapin::Error) -> String {
    crate::error::report(e)
}

impl AmqpSink {
    /// Connect to the broker an `amqp://` or `amqps://` URL names
    /// (`amqp://USER:PASS@HOST:5672/VHOST`; RabbitMQ's URI spec: the default
    /// vhost `/` is written `%2f`, an empty path means `/`;
    /// [`SinkSettings::credentials`] override the URL's; `amqps://` checks
    /// the broker's certificate and host name against the platform's root
    /// certificates plus those of the CA file, and presents the client
    /// certificate and key when given), open a channel in confirm mode and
    /// check that [`AmqpOptions::exchange`] exists (a passive declare). The
    /// delivery timeout bounds connecting.
    ///
    /// # Errors
    /// [`Error::Config`] when the URL does not parse, TLS settings come
    /// with `amqp://`, a TLS file cannot be read or holds no PEM, or the
    /// exchange does not exist; [`Error::SinkUnavailable`] when the broker
    /// cannot be reached, fails the TLS handshake (the reason in words: an
    /// untrusted CA, a wrong host name, a refused or missing client
    /// certificate) or refuses the login or the vhost. Both name the
    /// broker (scheme, host, port, vhost; never the password).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the connection being opened.
    pub async fn connect(url: &SecretUrl, settings: &SinkSettings) -> Result<Self> {
        let mut uri: AMQPUri = url.expose().parse().map_err(|e: String| {
            let e = url.scrub(&e.replace(url.expose(), "…"));
            Error::Config(format!("invalid RabbitMQ URL ({e}); write amqp://USER:PASS@HOST:PORT/VHOST"))
        })?;
        if settings.tls.wanted() && uri.scheme != AMQPScheme::AMQPS {
            return Err(Error::Config(format!(
                "RabbitMQ at {}: TLS settings need an amqps:// URL (amqp:// is plain TCP)",
                describe(&uri)
            )));
        }
        let tls = tls_config(&settings.tls)?;
        if let Some(user) = &settings.credentials.user {
            uri.authority.userinfo.username = user.clone();
        }
        if let Some(password) = &settings.credentials.password {
            uri.authority.userinfo.password = password.expose().to_string();
        }
        let options = &settings.amqp;
        if options.exchange.len() > SHORTSTR_MAX {
            return Err(Error::Config(format!(
                "RabbitMQ exchange name is {} bytes; AMQP allows at most {SHORTSTR_MAX}",
                options.exchange.len()
            )));
        }
        let shown = describe(&uri);
        let mut sink = AmqpSink {
            uri,
            name: format!("RabbitMQ {shown} exchange '{}'", options.exchange),
            shown,
            exchange: options.exchange.clone(),
            routing_key: options.routing_key.clone(),
            timeout: settings.delivery.timeout,
            tls,
            link: tokio::sync::Mutex::new(None),
            channels: 1,
        };
        let (link, channel) = tokio::time::timeout(sink.timeout, sink.open())
            .await
            .map_err(|_| {
                Error::SinkUnavailable(format!("RabbitMQ at {} did not answer within {:?}", sink.shown, sink.timeout))
            })?
            .map_err(|e| Error::SinkUnavailable(with_reason(e)))?;
        if let Err(e) = sink.check_exchange(&channel).await {
            drop(channel);
            Link::discard_conn(link.conn);
            return Err(e);
        }
        sink.channels = channel_limit(link.conn.configuration().channel_max());
        link.idle().push(channel);
        *sink.link.get_mut() = Some(Arc::new(link));
        Ok(sink)
    }

    /// Check that the exchange exists: a passive declare only checks, and a
    /// missing exchange closes the channel with 404 NOT_FOUND. The default
    /// exchange ("") always exists and cannot be declared.
    async fn check_exchange(&self, channel: &Channel) -> Result<()> {
        if self.exchange.is_empty() {
            return Ok(());
        }
        let check = channel.exchange_declare(
            self.exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() },
            FieldTable::default(),
        );
        match tokio::time::timeout(self.timeout, check).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::Config(format!(
                "RabbitMQ exchange '{}' on {}: {} (declare it first, or pick another with --amqp-exchange)",
                self.exchange,
                self.shown,
                report(&e)
            ))),
            Err(_) => Err(Error::Config(format!(
                "RabbitMQ at {} did not confirm that exchange '{}' exists within {:?}",
                self.shown, self.exchange, self.timeout
            ))),
        }
    }

    /// Open a connection, and a channel with publisher confirms on.
    async fn open(&self) -> Result<(Link, Channel), String> {
        let props = ConnectionProperties::default().with_connection_name("pg-outbox relay".into());
        let connected = match DefaultConnectionBuilder::new() {
            Ok(builder) => {
                builder
                    .with_uri(self.uri.clone())
                    .with_properties(props)
                    .with_tls_config(self.tls.clone())
                    .connect()
                    .await
            }
            Err(e) => Err(e),
        };
        let conn = connected.map_err(|e| format!("cannot connect to RabbitMQ at {}: {}", self.shown, report(&e)))?;
        let link = Link { conn, idle: std::sync::Mutex::new(Vec::new()), retired: AtomicBool::new(false) };
        match self.open_channel(&link).await {
            Ok(channel) => Ok((link, channel)),
            Err(e) => {
                Link::discard_conn(link.conn);
                Err(e)
            }
        }
    }

    /// Open a channel on `link` with publisher confirms on.
    async fn open_channel(&self, link: &Link) -> Result<Channel, String> {
        let channel = link
            .conn
            .create_channel()
            .await
            .map_err(|e| format!("cannot open a channel on RabbitMQ at {}: {}", self.shown, report(&e)))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| format!("RabbitMQ at {} refused publisher confirms: {}", self.shown, report(&e)))?;
        Ok(channel)
    }

    /// The link to publish on: the current one, or a new one when it was
    /// lost or retired (opened under the lock, so concurrent sends wait for
    /// this one instead of each opening its own).
    async fn link(&self) -> Result<Arc<Link>, String> {
        let mut slot = self.link.lock().await;
        if let Some(current) = slot.as_ref() {
            if current.usable() {
                return Ok(current.clone());
            }
            tracing::warn!(broker = %self.shown, "RabbitMQ connection lost or given up on; reconnecting");
            // Closed by lapin when the sends still on it let go.
            *slot = None;
        }
        let (link, channel) = self.open().await?;
        tracing::info!(broker = %self.shown, "connected to RabbitMQ");
        link.idle().push(channel);
        let link = Arc::new(link);
        *slot = Some(link.clone());
        Ok(link)
    }

    /// Publish one message on a channel of its own and wait for its
    /// confirm. The channel goes back to `link`'s idle ones once the
    /// message is confirmed (or returned, or nacked: the channel is fine);
    /// on any other outcome it is dropped, and `in_use` stays armed, so the
    /// link is retired.
    async fn publish(&self, in_use: &mut InUse, msg: &Message, event: &Event) -> Result<(), String> {
        let routing_key = self.routing_key.render(event);
        if routing_key.len() > SHORTSTR_MAX {
            in_use.armed = false;
            return Err(format!(
                "routing key '{routing_key}' is {} bytes; AMQP allows at most {SHORTSTR_MAX}",
                routing_key.len()
            ));
        }
        let link = self.link().await?;
        in_use.link = Some(link.clone());
        let idle = link.idle().pop().filter(|c| c.status().connected());
        let channel = match idle {
            Some(c) => c,
            None => self.open_channel(&link).await?,
        };
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let props = properties(event, msg);
        let exchange = self.exchange.as_str().into();
        let outcome =
            match channel.basic_publish(exchange, routing_key.as_str().into(), options, &msg.body, props).await {
                Ok(confirm) => self.confirmed(confirm.await, &routing_key),
                Err(e) => Err(Broken(format!("publishing failed: {}", report(&e)))),
            };
        match outcome {
            Ok(()) => {
                in_use.armed = false;
                link.idle().push(channel);
                Ok(())
            }
            Err(Refused(msg)) => {
                in_use.armed = false;
                link.idle().push(channel);
                Err(msg)
            }
            Err(Broken(msg)) => Err(msg),
        }
    }

    /// What a publisher confirm means: delivered, refused (the channel is
    /// fine), or a channel that may be broken.
    fn confirmed(&self, confirm: lapin::Result<Confirmation>, routing_key: &str) -> Result<(), PublishError> {
        match confirm {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned))) => Err(Refused(format!(
                "RabbitMQ returned the message as unroutable: exchange '{}', routing key '{}' ({} {}; bind a queue \
                 to the exchange for this routing key)",
                self.exchange, routing_key, returned.reply_code, returned.reply_text
            ))),
            Ok(Confirmation::Nack(None)) => {
                Err(Refused(format!("RabbitMQ refused the message (basic.nack) on exchange '{}'", self.exchange)))
            }
            // The channel lost confirm mode: never count that as delivered.
            Ok(Confirmation::NotRequested) => {
                Err(Broken("RabbitMQ channel is not in confirm mode; the message is not confirmed".to_string()))
            }
            Err(e) => Err(Broken(format!("no confirm: {}", report(&e)))),
        }
    }
}

/// Why a publish failed.
enum PublishError {
    /// The broker refused or returned the message; the channel is fine.
    Refused(String),
    /// The channel may be broken: it is discarded and reopened.
    Broken(String),
}
use PublishError::{Broken, Refused};

/// The message's AMQP properties: persistent, with the envelope's headers,
/// id, content type and the event's time (seconds).
fn properties(event: &Event, msg: &Message) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in &msg.headers {
        headers.insert(ShortString::from(*name), AMQPValue::LongString(value.as_str().into()));
    }
    let props = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_message_id(msg.id.as_str().into())
        .with_content_type(msg.content_type.into())
        .with_app_id(AMQP_APP_ID.into())
        .with_headers(headers);
    match u64::try_from(event.occurred_at.timestamp()) {
        Ok(secs) => props.with_timestamp(secs),
        Err(_) => props,
    }
}

/// Retires the link a send used when dropped armed: a publish that broke
/// the channel or connection, or one the relay gave up on (the broker may
/// be stuck or the socket half-open), so the next delivery starts afresh.
/// Only that link: a newer one another send opened meanwhile is kept.
struct InUse {
    link: Option<Arc<Link>>,
    armed: bool,
}

impl Drop for InUse {
    fn drop(&mut self) {
        if self.armed
            && let Some(used) = &self.link
        {
            used.retire();
        }
    }
}

/// Open the RabbitMQ sink (`--sink amqp://...` or `amqps://...`).
pub(crate) fn open<'a>(url: &'a SecretUrl, settings: &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>> {
    Box::pin(async move { Ok(Box::new(AmqpSink::connect(url, settings).await?) as Box<dyn Sink>) })
}

/// The RabbitMQ sink's flags (feature `cli`).
#[cfg(feature = "cli")]
#[derive(clap::Args, Debug)]
#[group(skip)]
pub(crate) struct Flags {
    /// RabbitMQ exchange to publish to.
    #[arg(long, default_value = "amq.topic")]
    amqp_exchange: String,
    /// RabbitMQ routing key template.
    #[arg(long, default_value = "{aggregate_type}.{event_type}", value_parser = |s: &str| Template::parse(s).map_err(|e| e.to_string()))]
    amqp_routing_key: Template,
}

#[cfg(feature = "cli")]
impl Flags {
    /// Write the flags into [`SinkSettings::amqp`].
    pub(crate) fn apply(&self, settings: &mut SinkSettings) -> Result<()> {
        settings.amqp.exchange = self.amqp_exchange.clone();
        settings.amqp.routing_key = self.amqp_routing_key.clone();
        Ok(())
    }
}

impl Sink for AmqpSink {
    fn name(&self) -> &str {
        &self.name
    }

    /// The channels the broker lets one connection open (its negotiated
    /// `channel_max`, 2047 on a default RabbitMQ): one per send in flight.
    fn max_in_flight(&self) -> Option<usize> {
        Some(self.channels)
    }

    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SendFuture<'a> {
        delivered(Box::pin(async move {
            let mut in_use = InUse { link: None, armed: true };
            self.publish(&mut in_use, message, event).await.map_err(Into::into)
        }))
    }
}

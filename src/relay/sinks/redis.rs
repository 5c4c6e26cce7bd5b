//! Redis Streams sink (Cargo feature `redis`, client `redis` with its
//! connection manager).

use std::time::Duration;

use futures::future::BoxFuture;
use redis::IntoConnectionInfo;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{parse_occurred_at, refused_repeat};
use crate::error::{BoxError, Error, Result};
use crate::event::Event;
use crate::relay::settings::with_reason;
use crate::relay::{Guarantee, Message, Sink, SinkFuture, SinkSettings, Template, header};
use crate::secret::SecretUrl;

/// The Redis Streams sink's options (flags `--redis-*`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisOptions {
    /// Stream key template (default `outbox:{aggregate_type}`).
    pub stream: Template,
    /// `XADD ... MAXLEN ~ N` trimming, in entries; `None` (the default)
    /// never trims.
    pub maxlen: Option<usize>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions { stream: Template::builtin("outbox:{aggregate_type}"), maxlen: None }
    }
}

/// Appends each event to a Redis stream with `XADD` and acknowledges it
/// when Redis replies with the new entry's id.
///
/// - Stream key: [`RedisOptions::stream`] rendered for the event
///   (default `outbox:{aggregate_type}`). The entry id is chosen by Redis
///   (`*`), so entries of one stream are in the order they were added.
/// - Fields: `id` (outbox id), `type` (event_type), `aggregate_type`,
///   `aggregate` (aggregate_id), `occurred_at` (RFC 3339), `payload` (the
///   [`Message`] body, in the relay's format), `content_type`, and `correlation_id`,
///   `causation_id`, `traceparent`, `tracestate` when the envelope's metadata
///   has them.
/// - Trimming: with [`RedisOptions::maxlen`] = `Some(n)`, `XADD key
///   MAXLEN ~ n * ...` (Redis docs, "XADD": approximate trimming keeps at
///   least `n` entries); `None` (the default) never trims.
/// - An error reply, a lost connection or no reply within the relay's
///   timeout fails the event (retried with backoff); the
///   connection manager reconnects on the next delivery. Redis Streams have
///   no deduplication: an event whose acknowledgement the relay could not
///   record is appended again; consumers deduplicate on the `id` field.
/// - Exactly once ([`SinkSettings::exactly_once`], `--exactly-once`): the
///   key template must hold `{aggregate_id}`, so each stream receives one
///   aggregate's events, one at a time, in increasing id order, and the
///   entry id is the outbox id: `XADD key <id>-0 ...`. Redis refuses an
///   entry id equal to or below the stream's top id ("The ID specified in
///   XADD is equal or smaller than the target stream top item"), and a
///   stream remembers its top id even after trimming (`MAXLEN`) or `XDEL`;
///   such a refusal means the stream already holds this event or a later
///   one of its aggregate, so the event is acknowledged without a second
///   copy (a refused repeat: logged at info with the id and key, counted in
///   `outbox_sink_repeats_refused_total`). Before it counts the refusal,
///   the sink reads the stream's newest entry: one of another aggregate
///   type (the same aggregate id under two types, with a template lacking
///   `{aggregate_type}`) fails the event instead, as it cannot tell, and
///   so does one whose entry id is not its outbox id (appended without
///   exactly-once, with an id Redis chose: a stream written at-least-once
///   before cannot be continued exactly once), and one this outbox cannot
///   have written after the event: this event's id with another
///   `occurred_at`, or a greater id that occurred earlier (another outbox
///   writes the key, or the database was restored to an earlier point and
///   its ids came round again). The event's own entry (`XRANGE key
///   <id>-0 <id>-0`), when the stream still holds it, decides first: the
///   same `occurred_at` is a refused repeat, another one fails the event.
///   Deleting the key (`DEL`, `UNLINK`, expiry) forgets the top id, and a
///   repeat is then appended again. Needs Redis 5.0 or later (streams);
///   checked at start.
///
/// URLs: `redis://[user:password@]host[:port][/db]`, and
/// `rediss://...` for TLS (rustls). [`SinkSettings::credentials`] (an ACL
/// user, or the `requirepass` password alone) override the URL's. With
/// `rediss://` the server's certificate is checked against the CA file
/// (else the platform's root certificates) and the URL's host name; a
/// client certificate and key are presented when given
/// (`tls-auth-clients yes`). TLS settings with a `redis://` URL are an
/// error. The password never appears in logs or errors.
#[derive(Clone)]
pub struct RedisSink {
    conn: ConnectionManager,
    options: RedisOptions,
    name: String,
    exactly_once: bool,
}

/// The text of Redis's refusal of an entry id at or below a stream's top
/// id (Redis 5.0 and later, `t_stream.c`).
const ID_TOO_SMALL: &str = "equal or smaller than the target stream top item";

/// The major and minor version in the `redis_version:` line of `INFO server`.
fn redis_version(info: &str) -> Option<(u32, u32)> {
    let v = info.lines().find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let mut parts = v.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    Some((major, minor))
}

impl std::fmt::Debug for RedisSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSink")
            .field("name", &self.name)
            .field("options", &self.options)
            .field("exactly_once", &self.exactly_once)
            .finish_non_exhaustive()
    }
}

/// Stream fields of `msg`, in a fixed order.
fn fields(msg: &Message) -> Vec<(&'static str, &[u8])> {
    let mut out: Vec<(&'static str, &[u8])> = Vec::with_capacity(10);
    let get = |name: &str| msg.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_bytes());
    for (field, name) in [
        ("id", header::ID),
        ("type", header::EVENT_TYPE),
        ("aggregate_type", header::AGGREGATE_TYPE),
        ("aggregate", header::AGGREGATE_ID),
        ("occurred_at", header::OCCURRED_AT),
    ] {
        out.push((field, get(name).unwrap_or_default()));
    }
    out.push(("payload", msg.body.as_slice()));
    out.push(("content_type", msg.content_type.as_bytes()));
    for name in [header::CORRELATION_ID, header::CAUSATION_ID, header::TRACEPARENT, header::TRACESTATE] {
        if let Some(v) = get(name) {
            out.push((name, v));
        }
    }
    out
}

impl RedisSink {
    /// Connect to the Redis server of `url` (`redis://` or `rediss://`) and
    /// prepare appending with `settings` (stream template, MAXLEN,
    /// credentials, TLS; the delivery timeout also bounds connecting and
    /// each reply).
    ///
    /// # Errors
    /// [`Error::Config`] if the URL or the TLS settings are malformed;
    /// [`Error::SinkUnavailable`] if the server cannot be reached (or
    /// refuses the credentials) within the timeout. Messages name the
    /// server without credentials.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the connection being opened.
    pub async fn connect(url: &SecretUrl, settings: &SinkSettings) -> Result<Self> {
        let shown = url.shown();
        let (tls, timeout) = (&settings.tls, settings.delivery.timeout);
        let rediss = url.scheme().as_deref() == Some("rediss");
        if tls.wanted() && !rediss {
            return Err(Error::Config(format!(
                "Redis at {shown}: TLS settings need a rediss:// URL (redis:// is plain TCP)"
            )));
        }
        tls.check_files("Redis")?;
        if rediss {
            // rustls needs a process-wide crypto provider when more than one
            // is compiled in; ours is ring. Already installed is fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let invalid =
            |e: redis::RedisError| Error::Config(format!("invalid Redis URL '{shown}': {}", url.scrub(&e.to_string())));
        let mut info = url.expose().into_connection_info().map_err(invalid)?;
        let mut redis_settings = info.redis_settings().clone();
        if let Some(user) = &settings.credentials.user {
            redis_settings = redis_settings.set_username(user);
        }
        if let Some(password) = &settings.credentials.password {
            redis_settings = redis_settings.set_password(password.expose());
        }
        info = info.set_redis_settings(redis_settings);
        let client = if tls.ca_file.is_some() || tls.client_cert.is_some() {
            let read = |p: &std::path::Path| {
                std::fs::read(p).map_err(|e| Error::Config(format!("Redis: cannot read {}: {e}", p.display())))
            };
            let client_tls = match (&tls.client_cert, &tls.client_key) {
                (Some(cert), Some(key)) => {
                    Some(redis::ClientTlsConfig { client_cert: read(cert)?, client_key: read(key)? })
                }
                _ => None,
            };
            let root_cert = tls.ca_file.as_deref().map(read).transpose()?;
            redis::Client::build_with_tls(info, redis::TlsCertificates { client_tls, root_cert })
        } else {
            redis::Client::open(info)
        }
        .map_err(invalid)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(3)
            .set_max_delay(Duration::from_secs(2));
        let unreachable =
            |what: String| Error::SinkUnavailable(format!("cannot connect to Redis at {shown}: {}", with_reason(what)));
        let mut conn = match tokio::time::timeout(timeout, ConnectionManager::new_with_config(client, config)).await {
            Err(_) => return Err(unreachable(format!("no connection within {timeout:?}"))),
            Ok(Err(e)) => return Err(unreachable(url.scrub(&e.to_string()))),
            Ok(Ok(c)) => c,
        };
        // The connection may be lazy about authentication: ask once.
        let pong: std::result::Result<String, _> = redis::cmd("PING").query_async(&mut conn).await;
        pong.map_err(|e| unreachable(url.scrub(&e.to_string())))?;
        if settings.exactly_once {
            let info: std::result::Result<String, _> = redis::cmd("INFO").arg("server").query_async(&mut conn).await;
            let info = info.map_err(|e| {
                Error::SinkUnavailable(format!(
                    "--exactly-once: cannot read the version of Redis at {shown} (INFO server): {}",
                    url.scrub(&e.to_string())
                ))
            })?;
            match redis_version(&info) {
                Some((major, _)) if major >= 5 => {}
                Some((major, minor)) => {
                    return Err(Error::Config(format!(
                        "--exactly-once: Redis at {shown} is {major}.{minor}; streams need Redis 5.0 or later"
                    )));
                }
                None => {
                    return Err(Error::Config(format!(
                        "--exactly-once: INFO server of Redis at {shown} names no redis_version; streams need 5.0 or later"
                    )));
                }
            }
        }
        Ok(RedisSink {
            conn,
            options: settings.redis.clone(),
            name: format!("Redis Streams {shown}"),
            exactly_once: settings.exactly_once,
        })
    }

    /// Refuse a key template that exactly-once cannot keep: one without
    /// `{aggregate_id}`.
    fn check_template(template: &Template) -> Result<()> {
        if !template.has_aggregate_id() {
            return Err(Error::Config(format!(
                "--exactly-once needs a Redis stream per aggregate: --redis-stream '{template}' lacks {{aggregate_id}} \
                 (a retry of one aggregate's event would reach the stream after later events of other aggregates, \
                 and be refused as a repeat), e.g. 'outbox:{{aggregate_type}}:{{aggregate_id}}'"
            )));
        }
        Ok(())
    }

    /// After Redis refused event's entry id at or below the top of `key`:
    /// `Ok` (a refused repeat, counted) unless the newest entry belongs to
    /// another aggregate, which cannot tell.
    async fn refused(&self, key: &str, event: &Event) -> std::result::Result<(), BoxError> {
        let mut conn = self.conn.clone();
        // The event's own entry, if the stream still has it: then it decides.
        let own: std::result::Result<redis::streams::StreamRangeReply, _> = redis::cmd("XRANGE")
            .arg(key)
            .arg(format!("{}-0", event.id))
            .arg(format!("{}-0", event.id))
            .query_async(&mut conn)
            .await;
        let own = own.map_err(|e| {
            format!("XADD {key} refused entry {}-0 as not above the top; reading that entry failed: {e}", event.id)
        })?;
        if let Some(entry) = own.ids.first() {
            let at = entry.get::<String>("occurred_at").as_deref().and_then(parse_occurred_at);
            let same_aggregate = entry.get::<String>("aggregate").is_none_or(|a| a == event.aggregate_id.to_string());
            if at != Some(event.occurred_at) || !same_aggregate {
                return Err(format!(
                    "XADD {key} refused entry {}-0, and the entry {} there is another event (another outbox writes \
                     this key, or the database was restored to an earlier point and its ids came round again); \
                     not acknowledged (use keys of this outbox's own)",
                    event.id, entry.id
                )
                .into());
            }
            refused_repeat(event.id, key, "the stream holds it");
            return Ok(());
        }
        let newest: std::result::Result<redis::streams::StreamRangeReply, _> =
            redis::cmd("XREVRANGE").arg(key).arg("+").arg("-").arg("COUNT").arg(1).query_async(&mut conn).await;
        let newest = newest.map_err(|e| {
            format!(
                "XADD {key} refused entry {}-0 as not above the top; reading the newest entry failed: {e}",
                event.id
            )
        })?;
        if let Some(entry) = newest.ids.first() {
            let field = |name: &str| entry.get::<String>(name);
            let outbox_id = field("id").unwrap_or_default();
            if entry.id != format!("{outbox_id}-0") {
                // An entry id Redis chose (`*`, a millisecond time) says
                // nothing about outbox ids.
                return Err(format!(
                    "XADD {key} refused entry {}-0 as not above the top, and the newest entry {} was not written \
                     with --exactly-once (its entry id is not its outbox id): whether {key} holds this event cannot \
                     be told; deliver exactly once to keys of their own (a new --redis-stream) or delete this one",
                    event.id, entry.id
                )
                .into());
            }
            let at = field("occurred_at").as_deref().and_then(parse_occurred_at);
            let top: i64 = outbox_id.trim().parse().unwrap_or(i64::MAX);
            let ours = match at {
                Some(at) if top == event.id => at == event.occurred_at,
                Some(at) => top > event.id && at >= event.occurred_at,
                None => false,
            };
            if !ours {
                return Err(format!(
                    "XADD {key} refused entry {}-0 as not above the top, and the newest entry {} ({}) is not one \
                     this outbox can have written after event {} (occurred {}): another outbox writes this key, or \
                     the database was restored to an earlier point and its ids came round again; whether {key} \
                     holds this event cannot be told, so it is not acknowledged (use keys of this outbox's own)",
                    event.id,
                    entry.id,
                    at.map_or_else(|| "no occurred_at field".to_string(), |t| format!("occurred {}", t.to_rfc3339())),
                    event.id,
                    event.occurred_at.to_rfc3339()
                )
                .into());
            }
            let aggregate = event.aggregate_id.to_string();
            let other_type = field("aggregate_type").is_some_and(|t| t != event.aggregate_type);
            let other_id = field("aggregate").is_some_and(|a| a != aggregate);
            if other_type || other_id {
                return Err(format!(
                    "XADD {key} refused entry {}-0 as not above the top, and the newest entry {} belongs to another \
                     aggregate: whether {key} holds this event cannot be told; put {{aggregate_type}} in --redis-stream",
                    event.id, entry.id
                )
                .into());
            }
        }
        refused_repeat(event.id, key, "the stream's top id is this event's or a later one's");
        Ok(())
    }
}

/// Open the Redis Streams sink (`--sink redis://...` or `rediss://...`).
pub(crate) fn open<'a>(url: &'a SecretUrl, settings: &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>> {
    Box::pin(async move {
        if settings.exactly_once {
            RedisSink::check_template(&settings.redis.stream)?;
        }
        Ok(Box::new(RedisSink::connect(url, settings).await?) as Box<dyn Sink>)
    })
}

impl Sink for RedisSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn guarantee(&self) -> Guarantee {
        if self.exactly_once { Guarantee::ExactlyOnce } else { Guarantee::AtLeastOnce }
    }

    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let key = self.options.stream.render(event);
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&key);
            if let Some(n) = self.options.maxlen {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            match self.exactly_once {
                // An outbox id is positive; 0-0 is not a valid entry id.
                true if event.id > 0 => cmd.arg(format!("{}-0", event.id)),
                true => return Err(format!("outbox id {} cannot be a Redis stream entry id", event.id).into()),
                false => cmd.arg("*"),
            };
            for (field, value) in fields(message) {
                cmd.arg(field).arg(value);
            }
            let mut conn = self.conn.clone();
            let reply: std::result::Result<String, redis::RedisError> = cmd.query_async(&mut conn).await;
            match reply {
                Ok(_entry_id) => Ok(()),
                Err(e) if self.exactly_once && e.to_string().contains(ID_TOO_SMALL) => self.refused(&key, event).await,
                Err(e) => Err(format!("XADD {key} failed: {e}").into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_comes_from_info_server() {
        assert_eq!(redis_version("# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n"), Some((7, 0)));
        assert_eq!(redis_version("redis_version:4.0.9"), Some((4, 0)));
        assert_eq!(redis_version("# Server\r\n"), None);
    }

    #[test]
    fn fields_follow_the_documented_names() {
        let msg = Message {
            id: "9".into(),
            key: "a".into(),
            body: b"{\"x\":1}".to_vec(),
            content_type: "application/json",
            headers: vec![
                (header::ID, "9".into()),
                (header::EVENT_TYPE, "Shipped".into()),
                (header::AGGREGATE_TYPE, "order".into()),
                (header::AGGREGATE_ID, "a".into()),
                (header::OCCURRED_AT, "2026-01-01T00:00:00Z".into()),
                (header::CONTENT_TYPE, "application/json".into()),
                (header::TRACEPARENT, "00-x-y-01".into()),
            ],
        };
        let f: Vec<(&str, &str)> =
            fields(&msg).into_iter().map(|(k, v)| (k, std::str::from_utf8(v).expect("utf-8"))).collect();
        assert_eq!(
            f,
            [
                ("id", "9"),
                ("type", "Shipped"),
                ("aggregate_type", "order"),
                ("aggregate", "a"),
                ("occurred_at", "2026-01-01T00:00:00Z"),
                ("payload", "{\"x\":1}"),
                ("content_type", "application/json"),
                ("traceparent", "00-x-y-01"),
            ]
        );
    }
}

//! Redis Streams sink (Cargo feature `redis`, client `redis` with its
//! connection manager).

use std::time::Duration;

use redis::IntoConnectionInfo;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{Format, Message, Sink, SinkFuture, SinkOptions, Template, header};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::redact::{redact_spec, scrub};

/// Appends each event to a Redis stream with `XADD` and acknowledges it
/// when Redis replies with the new entry's id.
///
/// - Stream key: [`SinkOptions::redis_stream`] rendered for the event
///   (default `outbox:{aggregate_type}`). The entry id is chosen by Redis
///   (`*`), so entries of one stream are in the order they were added.
/// - Fields: `id` (outbox id), `type` (event_type), `aggregate_type`,
///   `aggregate` (aggregate_id), `payload` (the [`Message`] body, per
///   [`SinkOptions::format`]), `content_type`, and `correlation_id`,
///   `causation_id`, `traceparent`, `tracestate` when the envelope's metadata
///   has them.
/// - Trimming: with [`SinkOptions::redis_maxlen`] = `Some(n)`, `XADD key
///   MAXLEN ~ n * ...` (Redis docs, "XADD": approximate trimming keeps at
///   least `n` entries); `None` (the default) never trims.
/// - An error reply, a lost connection or no reply within
///   [`SinkOptions::timeout`] fails the event (retried with backoff); the
///   connection manager reconnects on the next delivery. Redis Streams have
///   no deduplication: an event whose acknowledgement the relay could not
///   record is appended again; consumers deduplicate on the `id` field.
///
/// URLs: `redis://[user:password@]host[:port][/db]`, and
/// `rediss://...` for TLS (rustls). [`SinkOptions::user`] and
/// [`SinkOptions::password`] (an ACL user, or the `requirepass` password
/// alone) override the URL's. With `rediss://` the server's certificate is
/// checked against [`SinkOptions::tls_ca_file`] (else the platform's root
/// certificates) and the URL's host name; [`SinkOptions::tls_client_cert`]
/// and [`SinkOptions::tls_client_key`] present a client certificate
/// (`tls-auth-clients yes`). TLS settings with a `redis://` URL are an
/// error. The password never appears in logs or errors.
#[derive(Clone)]
pub struct RedisSink {
    conn: ConnectionManager,
    stream: Template,
    maxlen: Option<usize>,
    format: Format,
    source: String,
    timeout: Duration,
    shown: String,
}

impl std::fmt::Debug for RedisSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSink")
            .field("server", &self.shown)
            .field("stream", &self.stream.as_str())
            .field("maxlen", &self.maxlen)
            .field("timeout", &self.timeout)
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
    /// prepare appending with `opts` (stream template, MAXLEN, format,
    /// timeout).
    ///
    /// # Errors
    /// [`Error::Config`] if the URL is malformed or the server cannot be
    /// reached (or refuses the credentials) within
    /// [`SinkOptions::timeout`]; the message names the server without
    /// credentials.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the connection being opened.
    pub async fn connect(url: &str, opts: &SinkOptions) -> Result<Self> {
        let shown = redact_spec(url);
        let tls = url.get(..9).is_some_and(|p| p.eq_ignore_ascii_case("rediss://"));
        if opts.tls_wanted() && !tls {
            return Err(Error::Config(format!(
                "Redis at {shown}: TLS settings need a rediss:// URL (redis:// is plain TCP)"
            )));
        }
        opts.check_tls_files("Redis")?;
        if tls {
            // rustls needs a process-wide crypto provider when more than one
            // is compiled in; ours is ring. Already installed is fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let invalid = |e: redis::RedisError| {
            Error::Config(format!("invalid Redis URL '{shown}': {}", scrub(&e.to_string(), url)))
        };
        let mut info = url.into_connection_info().map_err(invalid)?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &opts.user {
            settings = settings.set_username(user);
        }
        if let Some(password) = &opts.password {
            settings = settings.set_password(password.expose());
        }
        info = info.set_redis_settings(settings);
        let client = if opts.tls_ca_file.is_some() || opts.tls_client_cert.is_some() {
            let read = |p: &std::path::Path| {
                std::fs::read(p).map_err(|e| Error::Config(format!("Redis: cannot read {}: {e}", p.display())))
            };
            let client_tls = match (&opts.tls_client_cert, &opts.tls_client_key) {
                (Some(cert), Some(key)) => {
                    Some(redis::ClientTlsConfig { client_cert: read(cert)?, client_key: read(key)? })
                }
                _ => None,
            };
            let root_cert = opts.tls_ca_file.as_deref().map(read).transpose()?;
            redis::Client::build_with_tls(info, redis::TlsCertificates { client_tls, root_cert })
        } else {
            redis::Client::open(info)
        }
        .map_err(invalid)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(opts.timeout))
            .set_response_timeout(Some(opts.timeout))
            .set_number_of_retries(3)
            .set_max_delay(Duration::from_secs(2));
        let unreachable = |what: String| {
            Error::SinkUnavailable(format!("cannot connect to Redis at {shown}: {}", super::with_reason(what)))
        };
        let mut conn =
            match tokio::time::timeout(opts.timeout, ConnectionManager::new_with_config(client, config)).await {
                Err(_) => return Err(unreachable(format!("no connection within {:?}", opts.timeout))),
                Ok(Err(e)) => return Err(unreachable(scrub(&e.to_string(), url))),
                Ok(Ok(c)) => c,
            };
        // The connection may be lazy about authentication: ask once.
        let pong: std::result::Result<String, _> = redis::cmd("PING").query_async(&mut conn).await;
        pong.map_err(|e| unreachable(scrub(&e.to_string(), url)))?;
        Ok(RedisSink {
            conn,
            stream: opts.redis_stream.clone(),
            maxlen: opts.redis_maxlen,
            format: opts.format,
            source: opts.cloudevents_source.clone(),
            timeout: opts.timeout,
            shown,
        })
    }

    /// The server as shown in messages (no credentials).
    pub fn display_url(&self) -> &str {
        &self.shown
    }
}

impl Sink for RedisSink {
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let msg = Message::new(event, self.format, &self.source)?;
            let key = self.stream.render(event);
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&key);
            if let Some(n) = self.maxlen {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            cmd.arg("*");
            for (field, value) in fields(&msg) {
                cmd.arg(field).arg(value);
            }
            let mut conn = self.conn.clone();
            let reply: std::result::Result<String, redis::RedisError> =
                match tokio::time::timeout(self.timeout, cmd.query_async(&mut conn)).await {
                    Ok(r) => r,
                    Err(_) => {
                        return Err(
                            format!("Redis {}: no reply to XADD {key} within {:?}", self.shown, self.timeout).into()
                        );
                    }
                };
            match reply {
                Ok(_entry_id) => Ok(()),
                Err(e) => Err(format!("Redis {}: XADD {key} failed: {e}", self.shown).into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                ("payload", "{\"x\":1}"),
                ("content_type", "application/json"),
                ("traceparent", "00-x-y-01"),
            ]
        );
    }
}

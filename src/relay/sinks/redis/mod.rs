//! Redis Streams sink (Cargo feature `redis`, client `redis` with its
//! connection manager).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use redis::IntoConnectionInfo;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{Recheck, held, parse_occurred_at};
use crate::error::{BoxError, Error, Result};
use crate::event::Event;
use crate::relay::access::with_reason;
use crate::relay::{Guarantee, Message, Proof, SendFuture, Sent, Sink, SinkSettings, Template, header};
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
    /// Replicas that must have each entry before the event is
    /// acknowledged (`--redis-wait-replicas`): after `XADD` the sink runs
    /// `WAIT n timeout` (Redis docs, "WAIT") with half the delivery
    /// timeout, and fails the event when fewer replicas confirm. Default
    /// 0: the primary's reply is enough, and an entry lives in the
    /// primary's memory (and its AOF, per `appendfsync`) when acknowledged.
    pub wait_replicas: u32,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions { stream: Template::builtin("outbox:{aggregate_type}"), maxlen: None, wait_replicas: 0 }
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
///   stream remembers its top id even after trimming (`MAXLEN`) or `XDEL`.
///   After such a refusal the sink reads the event's own entry back
///   (`XRANGE key <id>-0 <id>-0`): when the stream holds it, with this
///   event's `occurred_at` and aggregate, the event is acknowledged without
///   a second copy ([`Sent::Held`] with [`Proof::Entry`]: logged at warn
///   with the id and key, counted in
///   `outbox_sink_acknowledged_unsent_total{proof="entry"}`). Otherwise the
///   event fails, and is never acknowledged unsent: an entry of this id
///   holding another event (another outbox writes the key, or the database
///   was restored to an earlier point and its ids came round again); no
///   such entry, while the stream never deleted one at or above it
///   (`XINFO STREAM`'s `max-deleted-entry-id`, Redis 7.0 and later): the
///   event was never stored, and a later event of its aggregate was, so
///   order broke upstream of the relay; no such entry, and entries at or
///   above it were deleted or trimmed (or Redis is older than 7.0): it
///   cannot be proven. A stream whose newest entry id is not its outbox id
///   (appended without exactly-once) is named as such. Deleting the key
///   (`DEL`, `UNLINK`, expiry, eviction) forgets the top id, and a repeat
///   is then appended again: a second copy, never a loss. So the sink
///   refuses, at start and every
///   [`SinkSettings::broker_check_interval`] while it runs, a server whose
///   `maxmemory-policy` evicts keys without an expiry (`allkeys-*`);
///   `--redis-maxlen` must keep at least one entry. Needs Redis 5.0 or
///   later (streams); checked at start.
/// - Durability: an acknowledged entry is in the primary's memory, and on
///   its disk only as its persistence says (AOF with `appendfsync always`
///   writes each before replying; `everysec`, the default, loses up to a
///   second on a crash; RDB alone loses everything since the last save).
///   [`RedisOptions::wait_replicas`] waits for replicas as well. The sink
///   logs what is in force at start.
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
    /// Half the delivery timeout: how long `WAIT` waits for replicas.
    wait_timeout: Duration,
    /// When the eviction policy is checked again (exactly once).
    recheck: Arc<Recheck>,
}

/// Why `maxmemory_policy` (from `INFO memory`) breaks exactly-once: it
/// evicts keys that have no expiry, and a stream key evicted forgets its
/// top id, so a repeat would be appended again. `None` when it keeps them
/// (`noeviction`, `volatile-*`: those evict only keys with an expiry,
/// which the sink never sets).
fn eviction_breaks(policy: &str) -> Option<String> {
    policy.starts_with("allkeys-").then(|| {
        format!(
            "maxmemory-policy is {policy}, which evicts stream keys under memory pressure, and an evicted key \
             forgets which entries it held; set `maxmemory-policy noeviction` (or a volatile-* policy)"
        )
    })
}

/// The value of `name:` in an `INFO` reply, if any.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|l| l.trim().strip_prefix(name).and_then(|r| r.strip_prefix(':'))).map(str::trim)
}

/// A stream entry id `<ms>-<seq>` as a pair, for comparing.
fn entry_id(text: &str) -> Option<(u64, u64)> {
    let (ms, seq) = text.trim().split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// The fields of an `XINFO STREAM` reply (a flat list of names and values
/// in RESP2, a map in RESP3) that are strings or integers, by name.
fn xinfo_fields(reply: &redis::Value) -> std::collections::HashMap<String, String> {
    fn text(v: &redis::Value) -> Option<String> {
        match v {
            redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            redis::Value::SimpleString(s) => Some(s.clone()),
            redis::Value::Int(i) => Some(i.to_string()),
            _ => None,
        }
    }
    let pairs: Vec<(&redis::Value, &redis::Value)> = match reply {
        redis::Value::Array(items) => items.chunks(2).filter_map(|c| Some((c.first()?, c.get(1)?))).collect(),
        redis::Value::Map(items) => items.iter().map(|(k, v)| (k, v)).collect(),
        _ => Vec::new(),
    };
    pairs.into_iter().filter_map(|(k, v)| Some((text(k)?, text(v)?))).collect()
}

/// The channel the sink publishes to before `WAIT` after a proof that
/// only read ([`RedisSink::replicated`]).
const WAIT_CHANNEL: &str = "pg-outbox:wait-replicas";

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

/// The client for `url`, with the credentials and TLS files of `settings`.
///
/// # Errors
/// [`Error::Config`] for a malformed URL or an unreadable TLS file.
fn client(url: &SecretUrl, settings: &SinkSettings) -> Result<redis::Client> {
    let (shown, tls) = (url.shown(), &settings.tls);
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
    if tls.ca_file.is_none() && tls.client_cert.is_none() {
        return redis::Client::open(info).map_err(invalid);
    }
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| Error::Config(format!("Redis: cannot read {}: {e}", p.display())))
    };
    let client_tls = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig { client_cert: read(cert)?, client_key: read(key)? }),
        _ => None,
    };
    let root_cert = tls.ca_file.as_deref().map(read).transpose()?;
    redis::Client::build_with_tls(info, redis::TlsCertificates { client_tls, root_cert }).map_err(invalid)
}

/// Refuse a server older than Redis 5.0 (no streams), read from `INFO
/// server` on `conn`.
///
/// # Errors
/// [`Error::SinkUnavailable`] when it cannot be read; [`Error::Config`]
/// for an older server or one that names no version.
async fn check_version(conn: &mut ConnectionManager, url: &SecretUrl) -> Result<()> {
    let shown = url.shown();
    let info: std::result::Result<String, _> = redis::cmd("INFO").arg("server").query_async(conn).await;
    let info = info.map_err(|e| {
        Error::SinkUnavailable(format!(
            "--exactly-once: cannot read the version of Redis at {shown} (INFO server): {}",
            url.scrub(&e.to_string())
        ))
    })?;
    match redis_version(&info) {
        Some((major, _)) if major >= 5 => Ok(()),
        Some((major, minor)) => Err(Error::Config(format!(
            "--exactly-once: Redis at {shown} is {major}.{minor}; streams need Redis 5.0 or later"
        ))),
        None => Err(Error::Config(format!(
            "--exactly-once: INFO server of Redis at {shown} names no redis_version; streams need 5.0 or later"
        ))),
    }
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
        let client = client(url, settings)?;
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
            check_version(&mut conn, url).await?;
        }
        let sink = RedisSink {
            conn,
            options: settings.redis.clone(),
            name: format!("Redis Streams {shown}"),
            exactly_once: settings.exactly_once,
            wait_timeout: timeout / 2,
            recheck: Arc::new(Recheck::new(settings.broker_check_interval)),
        };
        if settings.exactly_once
            && let Some(why) =
                sink.check_broker().await.map_err(|e| Error::SinkUnavailable(format!("Redis at {shown}: {e}")))?
        {
            return Err(Error::Config(format!("--exactly-once: Redis at {shown}: {why}")));
        }
        sink.log_durability(&shown).await;
        Ok(sink)
    }

    /// Why the server's settings break exactly-once (one line that says
    /// what to change), `None` when they keep it; `Err` when they cannot be
    /// read.
    async fn check_broker(&self) -> std::result::Result<Option<String>, String> {
        let mut conn = self.conn.clone();
        let info: std::result::Result<String, _> = redis::cmd("INFO").arg("memory").query_async(&mut conn).await;
        let info = info.map_err(|e| format!("cannot read the eviction policy (INFO memory): {e}"))?;
        Ok(info_field(&info, "maxmemory_policy").and_then(eviction_breaks))
    }

    /// Log what an acknowledged entry means on the server: its persistence
    /// (AOF and `appendfsync`, when the server lets `CONFIG GET` read it)
    /// and the replicas waited for.
    async fn log_durability(&self, shown: &str) {
        let mut conn = self.conn.clone();
        let info: std::result::Result<String, _> = redis::cmd("INFO").arg("persistence").query_async(&mut conn).await;
        let aof = info.ok().and_then(|i| info_field(&i, "aof_enabled").map(|v| v == "1"));
        let fsync: std::result::Result<Vec<String>, _> =
            redis::cmd("CONFIG").arg("GET").arg("appendfsync").query_async(&mut conn).await;
        let fsync = fsync.ok().and_then(|v| v.get(1).cloned());
        let on_disk = match (aof, fsync.as_deref()) {
            (Some(true), Some("always")) => "AOF with appendfsync always: each entry is on disk before Redis replies",
            (Some(true), Some("everysec")) => {
                "AOF with appendfsync everysec: a crash of Redis can lose the last second"
            }
            (Some(true), _) => {
                "AOF on (appendfsync not readable here or not always): a crash of Redis can lose recent entries"
            }
            (Some(false), _) => "no AOF: entries live in memory until the next RDB save; a crash of Redis loses them",
            (None, _) => "persistence not readable (INFO persistence)",
        };
        let replicas = self.options.wait_replicas;
        tracing::info!(
            sink = %shown,
            wait_replicas = replicas,
            "Redis durability of an acknowledged entry: {on_disk}; {}",
            if replicas == 0 {
                "no replica waited for (--redis-wait-replicas 0)".to_string()
            } else {
                format!("WAIT {replicas} replica(s) after each XADD")
            }
        );
    }

    /// With [`RedisOptions::wait_replicas`], wait until that many replicas
    /// have `entry` of `key` (and everything written before it).
    ///
    /// `WAIT` counts the replicas that have this connection's last write.
    /// After a write of its own (the `XADD`) that covers the entry. After a
    /// proof that only read (`written` false: the `XADD` was refused), the
    /// connection may have written nothing since it opened (a new relay, a
    /// reconnect), and `WAIT` would answer at once (Redis 7.2 and later
    /// count a connection's own propagated writes only); so it first
    /// publishes to channel `pg-outbox:wait-replicas` (a non-cluster
    /// server propagates every `PUBLISH` to its replicas), a write that
    /// comes after the entry.
    async fn replicated(&self, key: &str, entry: &str, written: bool) -> std::result::Result<(), BoxError> {
        let n = self.options.wait_replicas;
        if n == 0 {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        if !written {
            let _: i64 = redis::cmd("PUBLISH")
                .arg(WAIT_CHANNEL)
                .arg(entry)
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("PUBLISH {WAIT_CHANNEL} before WAIT {n} for {key} {entry} failed: {e}"))?;
        }
        let millis = u64::try_from(self.wait_timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let got: i64 = redis::cmd("WAIT")
            .arg(n)
            .arg(millis)
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("WAIT {n} after XADD {key} {entry} failed: {e}"))?;
        if got < i64::from(n) {
            return Err(format!(
                "entry {entry} of {key} is on the primary, but only {got} of {n} replicas confirmed it within \
                 {millis} ms (--redis-wait-replicas): not acknowledged; retried"
            )
            .into());
        }
        Ok(())
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
    /// [`Sent::Held`] when the stream holds this event's own entry, else an
    /// error that says why it is not acknowledged (see [`RedisSink`]).
    async fn refused(&self, key: &str, event: &Event) -> std::result::Result<Sent, BoxError> {
        let mut conn = self.conn.clone();
        let own_id = format!("{}-0", event.id);
        let own: std::result::Result<redis::streams::StreamRangeReply, _> =
            redis::cmd("XRANGE").arg(key).arg(&own_id).arg(&own_id).query_async(&mut conn).await;
        let own = own.map_err(|e| {
            format!("XADD {key} refused entry {own_id} as not above the top; reading that entry failed: {e}")
        })?;
        if let Some(entry) = own.ids.first() {
            let at = entry.get::<String>("occurred_at").as_deref().and_then(parse_occurred_at);
            let same_aggregate = entry.get::<String>("aggregate").is_none_or(|a| a == event.aggregate_id.to_string())
                && entry.get::<String>("aggregate_type").is_none_or(|t| t == event.aggregate_type);
            if at != Some(event.occurred_at) || !same_aggregate {
                return Err(format!(
                    "XADD {key} refused entry {own_id}, and the entry {} there is another event (another outbox writes \
                     this key, or the database was restored to an earlier point and its ids came round again); \
                     not acknowledged (use keys of this outbox's own)",
                    entry.id
                )
                .into());
            }
            self.replicated(key, &own_id, false).await?;
            return Ok(held(event.id, key, Proof::Entry, "the stream holds its own entry"));
        }
        Err(self.not_held(key, event).await.into())
    }

    /// Why `key`, which refused `event`'s entry id as not above its top and
    /// has no entry of that id, is not shown to hold it.
    async fn not_held(&self, key: &str, event: &Event) -> String {
        let mut conn = self.conn.clone();
        let own_id = format!("{}-0", event.id);
        let newest: std::result::Result<redis::streams::StreamRangeReply, _> =
            redis::cmd("XREVRANGE").arg(key).arg("+").arg("-").arg("COUNT").arg(1).query_async(&mut conn).await;
        if let Ok(newest) = newest
            && let Some(entry) = newest.ids.first()
            && entry.get::<String>("id").is_none_or(|id| entry.id != format!("{}-0", id.trim()))
        {
            // An entry id Redis chose (`*`, a millisecond time) says nothing
            // about outbox ids.
            return format!(
                "XADD {key} refused entry {own_id} as not above the top, and the newest entry {} was not written \
                 with --exactly-once (its entry id is not its outbox id): whether {key} holds this event cannot be \
                 told; deliver exactly once to keys of their own (a new --redis-stream) or delete this one",
                entry.id
            );
        }
        let info: std::result::Result<redis::Value, _> =
            redis::cmd("XINFO").arg("STREAM").arg(key).query_async(&mut conn).await;
        let fields = match info {
            Ok(v) => xinfo_fields(&v),
            Err(e) => {
                return format!(
                    "XADD {key} refused entry {own_id} as not above the top, the stream has no such entry, and \
                     XINFO STREAM failed ({e}): whether it was ever stored cannot be proven; not acknowledged"
                );
            }
        };
        let top = fields.get("last-generated-id").cloned().unwrap_or_else(|| "?".into());
        let field_id = |name: &str| fields.get(name).and_then(|d| entry_id(d));
        let own = (event.id.unsigned_abs(), 0);
        // Redis 7.0 and later: XDEL raises max-deleted-entry-id, trimming
        // raises the first entry, and neither lowers entries-added. An own
        // id above the one and at or above the other, on a stream that holds
        // entries, was never added; on a stream that holds every entry ever
        // added, no id was.
        let count = |name: &str| fields.get(name).and_then(|l| l.parse::<u64>().ok());
        let length = count("length").unwrap_or(0);
        let deleted = match (field_id("max-deleted-entry-id"), field_id("recorded-first-entry-id")) {
            // Every entry ever added is still there: nothing was removed.
            (Some(_), Some(_)) if count("entries-added") == Some(length) => Some((0, 0)),
            (Some(d), Some(first)) if length > 0 => {
                if own < first {
                    Some(first)
                } else {
                    Some(d)
                }
            }
            (Some(_), Some(_)) => field_id("last-generated-id"),
            _ => None,
        };
        match deleted {
            Some(d) if d < own => format!(
                "order broke upstream: {key} (aggregate {} {}) already holds entry {top} above this event's \
                 {own_id}, and its counters show it never held {own_id} (no entry at or above it deleted or \
                 trimmed; counters reset by re-creating the key, loading a stream saved by Redis before 7.0 or \
                 XSETID would hide that), so this event was never stored and a later one of its aggregate was; not \
                 acknowledged unsent. Causes: a \
                 producer that broke the producer-locked contract, a trigger disabled while rows changed, another \
                 outbox (or a restored database) writing this key; see docs/operations.md, \"When exactly-once finds \
                 order broken\"",
                event.aggregate_type, event.aggregate_id
            ),
            Some(d) => format!(
                "XADD {key} refused entry {own_id} as not above the top {top}, the stream has no such entry, and \
                 entries up to {}-{} were deleted or trimmed: whether this event was stored cannot be proven; not \
                 acknowledged unsent (see docs/operations.md, \"When exactly-once finds order broken\")",
                d.0, d.1
            ),
            None => format!(
                "XADD {key} refused entry {own_id} as not above the top {top}, and the stream has no such entry: \
                 whether this event was stored cannot be proven (Redis before 7.0 does not say what a stream \
                 deleted); not acknowledged unsent (see docs/operations.md, \"When exactly-once finds order broken\")"
            ),
        }
    }
}

/// Open the Redis Streams sink (`--sink redis://...` or `rediss://...`).
pub(crate) fn open<'a>(url: &'a SecretUrl, settings: &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>> {
    Box::pin(async move {
        if settings.exactly_once {
            RedisSink::check_template(&settings.redis.stream)?;
            if settings.redis.maxlen == Some(0) {
                return Err(Error::Config(
                    "--exactly-once proves a repeat by its own entry, which the stream must still hold: \
                     --redis-maxlen must be at least 1"
                        .into(),
                ));
            }
        }
        Ok(Box::new(RedisSink::connect(url, settings).await?) as Box<dyn Sink>)
    })
}

/// The Redis Streams sink's flags (feature `cli`).
#[cfg(feature = "cli")]
#[derive(clap::Args, Debug)]
#[group(skip)]
pub(crate) struct Flags {
    /// Redis stream key template.
    #[arg(long, default_value = "outbox:{aggregate_type}", value_parser = |s: &str| Template::parse(s).map_err(|e| e.to_string()))]
    redis_stream: Template,
    /// Trim Redis streams to about this many entries (XADD MAXLEN ~); off by default.
    #[arg(long, value_name = "ENTRIES", value_parser = clap::value_parser!(u64).range(1..))]
    redis_maxlen: Option<u64>,
    /// Acknowledge an event only once this many Redis replicas have its
    /// entry (WAIT after each XADD, within half of --sink-timeout); fewer
    /// fails the event, which is retried. 0 (the default): the primary's
    /// reply is enough.
    #[arg(long, value_name = "REPLICAS", default_value_t = 0)]
    redis_wait_replicas: u32,
}

#[cfg(feature = "cli")]
impl Flags {
    /// Write the flags into [`SinkSettings::redis`].
    pub(crate) fn apply(&self, settings: &mut SinkSettings) -> Result<()> {
        settings.redis.stream = self.redis_stream.clone();
        settings.redis.maxlen = self.redis_maxlen.and_then(|n| usize::try_from(n).ok());
        settings.redis.wait_replicas = self.redis_wait_replicas;
        Ok(())
    }
}

impl Sink for RedisSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn guarantee(&self) -> Guarantee {
        if self.exactly_once { Guarantee::ExactlyOnce } else { Guarantee::AtLeastOnce }
    }

    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SendFuture<'a> {
        Box::pin(async move {
            if self.exactly_once && self.recheck.due() {
                match self.check_broker().await {
                    Ok(Some(why)) => return Err(Recheck::failed("redis", why)),
                    Ok(None) => {}
                    // Unreadable now: the send below meets the same trouble.
                    Err(e) => tracing::warn!(sink = %self.name, "{e}"),
                }
            }
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
                Ok(entry_id) => {
                    self.replicated(&key, &entry_id, true).await?;
                    Ok(Sent::Delivered)
                }
                Err(e) if self.exactly_once && e.to_string().contains(ID_TOO_SMALL) => self.refused(&key, event).await,
                Err(e) => Err(format!("XADD {key} failed: {e}").into()),
            }
        })
    }
}

#[cfg(test)]
mod tests;

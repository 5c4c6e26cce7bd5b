//! NATS JetStream sink (Cargo feature `nats`, client `async-nats`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use async_nats::HeaderMap;
use async_nats::header::{HeaderValue, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
use async_nats::jetstream::stream::{DiscardPolicy, LastRawMessageErrorKind, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, context::PublishErrorKind};
use chrono::{DateTime, Utc};
use futures::future::BoxFuture;

use super::{Recheck, held, parse_occurred_at};
use crate::error::{BoxError, Error, Result};
use crate::event::Event;
use crate::relay::settings::with_reason;
use crate::relay::{Guarantee, Message, Proof, SendFuture, Sent, Sink, SinkSettings, Template, header};
use crate::secret::{MASK, Secret, SecretUrl};

/// The NATS sink's options (flags `--nats-*`). Authentication is one way
/// of: a user and password ([`SinkSettings::credentials`] or the URL), a
/// token (the URL's lone user part or [`token`](Self::token)), an NKey
/// seed, or a credentials file.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsOptions {
    /// Subject template (default `events.{aggregate_type}.{event_type}`).
    pub subject: Template,
    /// Token (instead of a user and password); default none.
    pub token: Option<Secret>,
    /// NKey seed (`SU...`): the client signs the server's nonce with it;
    /// default none.
    pub nkey: Option<Secret>,
    /// Contents of a `.creds` file (user JWT and NKey seed, as `nsc`
    /// writes it); default none.
    pub credentials: Option<Secret>,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            subject: Template::builtin("events.{aggregate_type}.{event_type}"),
            token: None,
            nkey: None,
            credentials: None,
        }
    }
}

/// Publishes each event to NATS JetStream and acknowledges it on the
/// stream's PubAck.
///
/// - Subject: [`NatsOptions::subject`] rendered for the event (default
///   `events.{aggregate_type}.{event_type}`). A stream must capture it; when
///   none does, the server has no responder and the event fails with
///   "no JetStream stream captures subject X".
/// - Body: the [`Message`] body, in the relay's format.
/// - Headers: the [`Message`] headers (`id`, `term` when the relay holds a
///   leadership term, `event_type`, `aggregate_type`, `aggregate_id`,
///   `occurred_at`, and `correlation_id`, `causation_id`,
///   `traceparent`, `tracestate` when the envelope's metadata has them),
///   `Content-Type`, and `Nats-Msg-Id` = the outbox id, so a stream's
///   duplicate window (JetStream docs, "Message Deduplication"; default
///   2 minutes) drops a redelivery of an event whose acknowledgement the
///   relay could not record.
/// - `send` returns `Ok` only after the PubAck (a duplicate's PubAck
///   counts: the stream has the message), which the relay waits for up to
///   its timeout. A timeout, a lost connection or a stream
///   error fails the event (retried with backoff). The client reconnects
///   on its own, forever, while the relay runs.
///
/// Exactly once ([`SinkSettings::exactly_once`], `--exactly-once`): the
/// subject template must hold `{aggregate_id}`, so each subject receives
/// one aggregate's events, one at a time, in increasing id order. Before
/// its first send to a subject the sink reads the subject's last message
/// back from its stream and keeps its outbox id (header `id`, else
/// `Nats-Msg-Id`) and stream sequence. An event above the last id is
/// published with `Nats-Expected-Last-Subject-Sequence` = that sequence (0
/// for an empty subject), so the stream refuses it if anything else was
/// written to the subject meanwhile (JetStream error 10071, "wrong last
/// sequence": another relay, a deposed leader), and with headers
/// `previous_id` and `previous_occurred_at` naming the event stored before
/// it. An event at or below the last id is not sent: the sink reads it
/// back, and acknowledges it without a send ([`Sent::Held`]) only when the
/// subject's last message is this event ([`Proof::LastMessage`]) or the walk
/// back along the subject (each message's stored expected sequence and
/// `previous_id`, at most 1 000 messages) reaches it ([`Proof::Chain`]); a
/// greater id alone proves nothing, and the event fails with the cause
/// (order broke upstream; a message the stream's limits removed; a message
/// not written by pg-outbox). After a wrong last sequence the sink reads
/// the subject again and does the same. A duplicate PubAck counts only
/// when the message stored under that `Nats-Msg-Id` is this event
/// ([`Proof::DuplicateWindow`]). This holds for any length of time as long
/// as the stream keeps each subject's last message: opening the sink checks
/// every stream that captures the template's subjects (and again every
/// [`SinkSettings::broker_check_interval`] while it runs) and refuses one
/// whose retention is not `limits`, or that sets `max_age`, `max_msgs` or
/// `max_bytes`, or `discard_new_per_subject`, or a file-stored one on a
/// nats-server release whose per-subject index can lose a subject's last
/// message after a restart (2.12.7 and later 2.12 releases; nats-server
/// PRs 8254 and 8285); and it refuses the template when no stream captures
/// it. Deleting or purging a subject's messages makes the next event of
/// that aggregate be stored again: a second copy, never a loss. It logs
/// each stream's storage and replicas at start: what a PubAck means on disk.
///
/// Authentication, one way of: a user and password (in the URL,
/// `nats://user:pass@host:4222`, or [`SinkSettings::credentials`]), a token
/// (`nats://token@host:4222` or [`NatsOptions::token`]), an NKey seed
/// ([`NatsOptions::nkey`]) or a `.creds` file
/// ([`NatsOptions::credentials`]). Secrets never appear in logs or errors.
///
/// TLS: a `tls://` URL, [`crate::relay::TlsOptions::enabled`] or any TLS
/// file requires it (the connection fails if the server does not offer
/// it); the server's certificate is checked against the CA file (else the
/// platform's roots) and the host name of the URL; a client certificate
/// and key are presented (`verify: true` on the server). Without any
/// of these the client still upgrades to TLS when the server requires it,
/// checking against the platform's roots.
#[derive(Debug, Clone)]
pub struct NatsSink {
    js: jetstream::Context,
    subject: Template,
    name: String,
    /// The exactly-once state; `None` for at-least-once.
    exactly_once: Option<Arc<ExactlyOnce>>,
}

/// Subjects whose last message the exactly-once sink remembers at most;
/// past it one is forgotten (and read back again before its next send).
const REMEMBERED_SUBJECTS: usize = 100_000;

/// What a subject last held, as the exactly-once sink knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Last {
    /// Outbox id of the subject's last message; `None`: the subject is empty.
    id: Option<i64>,
    /// Its aggregate type (header `aggregate_type`), when it has one.
    aggregate_type: Option<String>,
    /// When its event occurred (header `occurred_at`), when it has one.
    occurred_at: Option<DateTime<Utc>>,
    /// Its stream sequence; 0 for an empty subject.
    sequence: u64,
}

/// The exactly-once sink's memory: each subject's last message, and which
/// stream captures each subject (streams checked once each).
#[derive(Debug)]
struct ExactlyOnce {
    last: Mutex<HashMap<String, Last>>,
    /// Stream names whose configuration was checked and found to keep each
    /// subject's last message.
    checked: Mutex<HashSet<String>>,
    /// The stream that captures each subject (bounded as `last`).
    stream_of: Mutex<HashMap<String, String>>,
    /// When the streams and the server version are checked again.
    recheck: Recheck,
}

/// Header of an exactly-once message: the outbox id of the message the
/// subject held just before it (absent on a subject's first message). The
/// stream stored the message only because that one was still the
/// subject's last ([`NATS_EXPECTED_LAST_SUBJECT_SEQUENCE`], also stored
/// with the message), so it proves that event stored even after the
/// stream's limits removed it.
pub(crate) const PREVIOUS_ID: &str = "previous_id";
/// Header of an exactly-once message: the `occurred_at` (RFC 3339) of the
/// event named by [`PREVIOUS_ID`].
pub(crate) const PREVIOUS_OCCURRED_AT: &str = "previous_occurred_at";
/// Messages of one subject that the walk back from its last message reads
/// at most, looking for an event it may hold.
const MAX_WALK: usize = 1000;

/// Why nats-server `version` cannot be trusted with a file-stored stream's
/// per-subject lookups, which exactly-once rests on (the last message of a
/// subject and `Nats-Expected-Last-Subject-Sequence`); `None` when it can.
/// Releases 2.12.7 and later of the 2.12 line can lose a subject's place
/// after a restart (the per-subject first-block pointer, nats-server PRs
/// 8254 and 8285), so the subject's last message is not found and an
/// expected sequence of 0 is accepted: a repeat is stored again. 2.14
/// stores both pointers. Versions it cannot read are let through.
fn server_breaks_lookups(version: &str) -> Option<String> {
    let mut parts = version.trim().trim_start_matches('v').split(['.', '-', '+']);
    let mut next = || parts.next().and_then(|p| p.parse::<u64>().ok());
    let (major, minor, patch) = (next()?, next()?, next().unwrap_or(0));
    (major == 2 && minor == 12 && patch >= 7).then(|| {
        format!(
            "nats-server {version} can lose a subject's last message after a restart on file storage \
             (nats-server PRs 8254 and 8285), and a repeat would be stored again; upgrade to nats-server 2.14 or \
             later, or use memory storage"
        )
    })
}

/// Insert into a map bounded at [`REMEMBERED_SUBJECTS`] entries.
fn remember<V>(map: &Mutex<HashMap<String, V>>, key: &str, value: V) {
    let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
    if map.len() >= REMEMBERED_SUBJECTS && !map.contains_key(key) {
        let victim = map.keys().next().cloned();
        if let Some(v) = victim {
            map.remove(&v);
        }
    }
    map.insert(key.to_string(), value);
}

/// Why a stream's configuration cannot keep each subject's last message
/// (what exactly-once delivery reads back), naming the setting to change;
/// `None` when it keeps it.
fn stream_loses_last(config: &jetstream::stream::Config) -> Option<String> {
    if config.retention != RetentionPolicy::Limits {
        return Some(format!(
            "its retention is {:?}, which removes messages once consumed; use retention limits",
            config.retention
        ));
    }
    if !config.max_age.is_zero() {
        return Some(format!("max_age is {:?}, which removes a subject's last message; set max_age 0", config.max_age));
    }
    if config.max_messages > 0 {
        return Some(format!(
            "max_msgs is {}, which can remove a subject's last message; set max_msgs -1 (unlimited) \
             and bound it with max_msgs_per_subject instead (at least twice --batch-size proves every repeat)",
            config.max_messages
        ));
    }
    if config.max_bytes > 0 {
        return Some(format!(
            "max_bytes is {}, which can remove a subject's last message; set max_bytes -1 (unlimited) \
             and bound it with max_msgs_per_subject instead (at least twice --batch-size proves every repeat)",
            config.max_bytes
        ));
    }
    if config.discard == DiscardPolicy::New && config.discard_new_per_subject && config.max_messages_per_subject > 0 {
        return Some(format!(
            "discard new per subject with max_msgs_per_subject {} refuses a subject's later events; \
             use discard old",
            config.max_messages_per_subject
        ));
    }
    None
}

/// Credentials taken out of a NATS URL (percent-decoded). `Debug` hides
/// the secrets.
#[cfg_attr(test, derive(PartialEq))]
enum Credentials {
    /// `nats://user:password@host`.
    UserPassword(String, String),
    /// `nats://token@host`.
    Token(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::UserPassword(user, _) => write!(f, "UserPassword({user:?}, {MASK})"),
            Credentials::Token(_) => write!(f, "Token({MASK})"),
        }
    }
}

/// The servers of a comma-separated list, credentials removed, the
/// credentials found (the last URL's that has any), and whether a `tls://`
/// URL asks for TLS.
fn split_credentials(spec: &SecretUrl) -> Result<(Vec<String>, Option<Credentials>, bool)> {
    let mut servers = Vec::new();
    let mut creds = None;
    let mut tls = false;
    for part in spec.expose().split(',').map(str::trim) {
        let shown = SecretUrl::new(part).shown();
        let mut url = url::Url::parse(part).map_err(|e| Error::Config(format!("invalid NATS URL '{shown}': {e}")))?;
        match url.scheme() {
            "nats" => {}
            "tls" => tls = true,
            _ => {
                return Err(Error::Config(format!(
                    "invalid NATS URL '{shown}': every server of the list must use nats:// (or tls://)"
                )));
            }
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(Error::Config(format!("invalid NATS URL '{shown}': no host")));
        }
        if !url.username().is_empty() {
            let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
            let user = decode(url.username());
            creds = Some(match url.password() {
                Some(pass) => Credentials::UserPassword(user, decode(pass)),
                None => Credentials::Token(user),
            });
            let _ = url.set_username("");
            let _ = url.set_password(None);
        }
        servers.push(url.to_string());
    }
    Ok((servers, creds, tls))
}

/// How the client proves who it is, from the URL and the options; at most
/// one way may be given.
fn authentication(
    url_creds: Option<Credentials>,
    settings: &SinkSettings,
    options: async_nats::ConnectOptions,
) -> Result<async_nats::ConnectOptions> {
    let nats = &settings.nats;
    let (mut user, mut password, mut token) = match url_creds {
        Some(Credentials::UserPassword(u, p)) => (Some(u), Some(p), None),
        Some(Credentials::Token(t)) => (None, None, Some(t)),
        None => (None, None, None),
    };
    if let Some(u) = &settings.credentials.user {
        user = Some(u.clone());
        // A URL's lone user part was a token; with --sink-user it is not.
        token = token.filter(|_| password.is_some());
    }
    if let Some(p) = &settings.credentials.password {
        password = Some(p.expose().to_string());
    }
    if let Some(t) = &nats.token {
        token = Some(t.expose().to_string());
    }
    let user_password = match (user, password) {
        (Some(u), Some(p)) => Some((u, p)),
        (None, None) => None,
        (Some(u), None) => {
            return Err(Error::Config(format!(
                "NATS user '{u}' has no password (give --sink-password-file or put it in the URL)"
            )));
        }
        (None, Some(_)) => {
            return Err(Error::Config("NATS password given without a user (--sink-user)".into()));
        }
    };
    let ways = [user_password.is_some(), token.is_some(), nats.nkey.is_some(), nats.credentials.is_some()];
    if ways.iter().filter(|w| **w).count() > 1 {
        return Err(Error::Config(
            "NATS: give one way to authenticate: a user and password, a token, an NKey seed or a credentials file"
                .into(),
        ));
    }
    if let Some((u, p)) = user_password {
        return Ok(options.user_and_password(u, p));
    }
    if let Some(t) = token {
        return Ok(options.token(t));
    }
    if let Some(seed) = &nats.nkey {
        let seed = seed.expose().trim();
        // Checked here so a bad seed is a clear error, not a failed handshake.
        nkeys::KeyPair::from_seed(seed).map_err(|e| {
            Error::Config(format!("NATS NKey seed is not valid ({e}); a user seed is one line starting with SU"))
        })?;
        return Ok(options.nkey(seed.to_string()));
    }
    if let Some(creds) = &nats.credentials {
        return options.credentials(creds.expose()).map_err(|e| {
            Error::Config(format!(
                "NATS credentials file is not usable ({e}); it must hold a user JWT and an NKey seed, as `nsc` writes them"
            ))
        });
    }
    Ok(options)
}

impl NatsSink {
    /// Connect to the NATS server(s) of `url` (`nats://host:4222`, several
    /// separated by commas) and prepare publishing with `settings` (subject
    /// template, authentication, TLS; the delivery timeout also bounds
    /// connecting).
    ///
    /// # Errors
    /// [`Error::Config`] if the URL or a credential is malformed;
    /// [`Error::SinkUnavailable`] if the server cannot be reached within the
    /// timeout. Messages name the server without credentials.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the connection being opened.
    pub async fn connect(url: &SecretUrl, settings: &SinkSettings) -> Result<Self> {
        let shown = url.shown();
        let timeout = settings.delivery.timeout;
        let tls = &settings.tls;
        let (servers, creds, tls_scheme) = split_credentials(url)?;
        tls.check_files("NATS")?;
        let mut options = async_nats::ConnectOptions::new()
            .name(concat!("pg-outbox/", env!("CARGO_PKG_VERSION")))
            .connection_timeout(timeout)
            .event_callback({
                let shown = shown.clone();
                move |event| {
                    let shown = shown.clone();
                    async move {
                        match event {
                            async_nats::Event::Connected => tracing::info!(server = %shown, "NATS connected"),
                            async_nats::Event::Disconnected => {
                                tracing::warn!(server = %shown, "NATS disconnected; reconnecting")
                            }
                            async_nats::Event::Closed => tracing::info!(server = %shown, "NATS connection closed"),
                            other => tracing::warn!(server = %shown, "NATS: {other}"),
                        }
                    }
                }
            });
        options = authentication(creds, settings, options)?;
        if tls_scheme || tls.wanted() {
            // rustls needs a process-wide crypto provider when more than one
            // is compiled in; ours is ring. Already installed is fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
            options = options.require_tls(true);
        }
        if let Some(ca) = &tls.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        let client = options.connect(servers).await.map_err(|e| {
            let why = url.scrub(&crate::error::report(&e));
            Error::SinkUnavailable(format!("cannot connect to NATS at {shown}: {}", with_reason(why)))
        })?;
        let mut js = jetstream::new(client);
        js.set_timeout(timeout);
        let mut sink = NatsSink {
            js,
            subject: settings.nats.subject.clone(),
            name: format!("NATS JetStream {shown}"),
            exactly_once: None,
        };
        if settings.exactly_once {
            sink.exactly_once = Some(Arc::new(ExactlyOnce {
                last: Mutex::default(),
                checked: Mutex::default(),
                stream_of: Mutex::default(),
                recheck: Recheck::new(settings.broker_check_interval),
            }));
            sink.check_streams(true).await?;
        }
        Ok(sink)
    }

    /// Refuse a subject template that exactly-once cannot keep (see
    /// [`NatsSink`]): one without `{aggregate_id}`.
    fn check_template(template: &Template) -> Result<()> {
        if !template.has_aggregate_id() {
            return Err(Error::Config(format!(
                "--exactly-once needs a NATS subject per aggregate: --nats-subject '{template}' lacks {{aggregate_id}} \
                 (a retry of one aggregate's event would reach the subject after later events of other aggregates, \
                 and be refused as a repeat), e.g. 'events.{{aggregate_type}}.{{aggregate_id}}'"
            )));
        }
        Ok(())
    }

    /// Check again, while delivering, what [`Self::check_streams`] checked
    /// at start (every [`SinkSettings::broker_check_interval`]): a stream
    /// whose limits changed, or a server version that breaks exactly-once,
    /// stops the relay.
    async fn recheck(&self, state: &ExactlyOnce) -> std::result::Result<(), BoxError> {
        state.checked.lock().unwrap_or_else(PoisonError::into_inner).clear();
        match self.check_streams(false).await {
            Ok(()) => Ok(()),
            Err(Error::Config(why)) => Err(Recheck::failed("nats", why)),
            // Unreachable now: the send meets the same trouble.
            Err(e) => {
                tracing::warn!(sink = %self.name, "{e}");
                Ok(())
            }
        }
    }

    /// Check the streams that capture the subject template's subjects: at
    /// least one, each keeping every subject's last message, on a server
    /// whose per-subject lookups hold; at start (`log`), also log what a
    /// PubAck means on disk for each.
    async fn check_streams(&self, log: bool) -> Result<()> {
        let filter = self.subject.token_wildcards("*");
        let names = self.stream_names(&filter).await?;
        if names.is_empty() {
            return Err(Error::Config(format!(
                "--exactly-once: no JetStream stream captures the subjects of --nats-subject '{}' ({filter}); \
                 create one, e.g. `nats stream add OUTBOX --subjects '{filter}' --retention limits`",
                self.subject
            )));
        }
        for name in names {
            self.check_stream(&name, log).await?;
        }
        Ok(())
    }

    /// Names of the streams whose subjects overlap `filter`.
    async fn stream_names(&self, filter: &str) -> Result<Vec<String>> {
        let mut names = Vec::new();
        loop {
            let page: serde_json::Value = self
                .js
                .request("STREAM.NAMES", &serde_json::json!({ "offset": names.len(), "subject": filter }))
                .await
                .map_err(|e| Error::SinkUnavailable(format!("NATS: cannot list the JetStream streams: {e}")))?;
            if let Some(e) = page.get("error") {
                return Err(Error::SinkUnavailable(format!("NATS: cannot list the JetStream streams: {e}")));
            }
            let got: Vec<String> = page
                .get("streams")
                .and_then(serde_json::Value::as_array)
                .map(|a| a.iter().filter_map(|n| n.as_str().map(str::to_string)).collect())
                .unwrap_or_default();
            let total = page.get("total").and_then(serde_json::Value::as_u64).unwrap_or(0);
            if got.is_empty() {
                return Ok(names);
            }
            names.extend(got);
            if names.len() as u64 >= total {
                return Ok(names);
            }
        }
    }

    /// Check one stream's configuration (once per stream, until the next
    /// [`Self::recheck`]).
    async fn check_stream(&self, name: &str, log: bool) -> Result<()> {
        let Some(state) = &self.exactly_once else { return Ok(()) };
        if state.checked.lock().unwrap_or_else(PoisonError::into_inner).contains(name) {
            return Ok(());
        }
        let stream = self
            .js
            .get_stream(name)
            .await
            .map_err(|e| Error::SinkUnavailable(format!("NATS: cannot read stream {name}'s configuration: {e}")))?;
        let config = &stream.cached_info().config;
        if let Some(why) = stream_loses_last(config) {
            return Err(Error::Config(format!(
                "--exactly-once: JetStream stream {name} may lose a subject's last message, which exactly-once \
                 reads back: {why}"
            )));
        }
        let version = self.js.client().server_info().version;
        if config.storage == StorageType::File
            && let Some(why) = server_breaks_lookups(&version)
        {
            return Err(Error::Config(format!(
                "--exactly-once: JetStream stream {name} is on file storage, and {why}"
            )));
        }
        if log {
            let on_disk = match config.storage {
                StorageType::File => {
                    "file storage: the server writes each message before its PubAck and syncs to disk every \
                     sync_interval (2 minutes by default; `jetstream { sync_interval: always }` syncs each)"
                }
                StorageType::Memory => "memory storage: a restart of the server loses the stream's messages",
            };
            tracing::info!(
                stream = %name,
                replicas = config.num_replicas,
                server = %version,
                "NATS durability of an acknowledged message: {on_disk}; {} replica(s){}",
                config.num_replicas,
                if config.num_replicas > 1 {
                    " (a PubAck means a majority of them stored it)"
                } else {
                    " (one server: its loss loses what it has not synced)"
                }
            );
        }
        state.checked.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_string());
        Ok(())
    }

    /// The stream that captures `subject` (looked up once, then
    /// remembered), its configuration checked.
    async fn stream_for(
        &self,
        state: &ExactlyOnce,
        subject: &str,
    ) -> std::result::Result<(String, jetstream::stream::Stream<()>), BoxError> {
        let known = state.stream_of.lock().unwrap_or_else(PoisonError::into_inner).get(subject).cloned();
        let stream_name = match known {
            Some(n) => n,
            None => {
                let n = self.js.stream_by_subject(subject).await.map_err(|e| {
                    format!("cannot find the JetStream stream of subject {subject} to read its last message: {e}")
                })?;
                self.check_stream(&n, true).await.map_err(|e| e.to_string())?;
                remember(&state.stream_of, subject, n.clone());
                n
            }
        };
        let stream = self
            .js
            .get_stream_no_info(&stream_name)
            .await
            .map_err(|e| format!("cannot read stream {stream_name}: {e}"))?;
        Ok((stream_name, stream))
    }

    /// Read back what `subject` last holds, from the stream that captures it.
    async fn read_last(&self, state: &ExactlyOnce, subject: &str) -> std::result::Result<Last, BoxError> {
        let (stream_name, stream) = self.stream_for(state, subject).await?;
        let last = match stream.get_last_raw_message_by_subject(subject).await {
            Ok(msg) => msg,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                return Ok(Last { id: None, aggregate_type: None, occurred_at: None, sequence: 0 });
            }
            Err(e) => {
                // The stream may be gone (deleted, or another now captures
                // the subject): find it again next time.
                state.stream_of.lock().unwrap_or_else(PoisonError::into_inner).remove(subject);
                return Err(
                    format!("cannot read the last message of subject {subject} (stream {stream_name}): {e}").into()
                );
            }
        };
        let get = |name: &str| last.headers.get(name).map(|v| v.as_str().to_string());
        let id = get(header::ID).or_else(|| get("Nats-Msg-Id")).and_then(|v| v.trim().parse::<i64>().ok());
        let Some(id) = id else {
            return Err(format!(
                "the last message of subject {subject} (stream {stream_name}, sequence {}) has no outbox id \
                 (header id or Nats-Msg-Id): it was not written by pg-outbox, so whether the subject already \
                 holds this event cannot be told; remove it or use a subject of pg-outbox's own",
                last.sequence
            )
            .into());
        };
        Ok(Last {
            id: Some(id),
            aggregate_type: get(header::AGGREGATE_TYPE),
            occurred_at: get(header::OCCURRED_AT).as_deref().and_then(parse_occurred_at),
            sequence: last.sequence,
        })
    }

    /// Read `event` back from `subject`, whose last message has its id or
    /// a greater one: [`Sent::Held`] when the subject's last message is
    /// this event ([`Proof::LastMessage`]), or when the walk back along the
    /// subject's messages (each names the one before it: the stored
    /// `Nats-Expected-Last-Subject-Sequence`, and [`PREVIOUS_ID`]) reaches
    /// it ([`Proof::Chain`]). A greater id alone proves nothing: the error
    /// says why the event is not shown to be held (order broke upstream:
    /// the chain passes its id without it; the stream's limits removed a
    /// message the walk needs; a message that is not this outbox's; another
    /// event under its id).
    async fn prove(&self, state: &ExactlyOnce, subject: &str, event: &Event) -> std::result::Result<Sent, BoxError> {
        let (stream_name, stream) = self.stream_for(state, subject).await?;
        let mut message = match stream.get_last_raw_message_by_subject(subject).await {
            Ok(m) => m,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                return Err(format!(
                    "subject {subject} (stream {stream_name}) held event {} or a later one, and is empty now \
                     (purged or deleted): whether it holds this event cannot be proven; not acknowledged",
                    event.id
                )
                .into());
            }
            Err(e) => {
                return Err(
                    format!("cannot read the last message of subject {subject} (stream {stream_name}): {e}").into()
                );
            }
        };
        let broke = |id: i64, what: String| -> BoxError {
            format!(
                "order broke upstream: subject {subject} (stream {stream_name}) holds event {id} of aggregate {} {}, \
                 and {what}, so event {} was never stored there and a later one of its aggregate was; not \
                 acknowledged unsent. Causes: a producer that broke the producer-locked contract, a trigger \
                 disabled while rows changed, another outbox (or a restored database) writing this subject; see \
                 docs/operations.md, \"When exactly-once finds order broken\"",
                event.aggregate_type, event.aggregate_id, event.id
            )
            .into()
        };
        for hop in 0..MAX_WALK {
            let get = |name: &str| message.headers.get(name).map(|v| v.as_str().trim().to_string());
            let sequence = message.sequence;
            if message.subject.as_str() != subject {
                return Err(format!(
                    "the walk back along subject {subject} (stream {stream_name}) reached message {sequence} of \
                     subject {}: whether it holds event {} cannot be proven; not acknowledged",
                    message.subject, event.id
                )
                .into());
            }
            let Some(id) = get(header::ID).or_else(|| get("Nats-Msg-Id")).and_then(|v| v.parse::<i64>().ok()) else {
                return Err(format!(
                    "message {sequence} of subject {subject} (stream {stream_name}) has no outbox id (header id or \
                     Nats-Msg-Id): it was not written by pg-outbox, so whether the subject holds event {} cannot \
                     be proven; not acknowledged (use a subject of pg-outbox's own)",
                    event.id
                )
                .into());
            };
            let at = get(header::OCCURRED_AT).as_deref().and_then(parse_occurred_at);
            if id == event.id {
                let same_type = get(header::AGGREGATE_TYPE).is_none_or(|t| t == event.aggregate_type);
                if at == Some(event.occurred_at) && same_type {
                    let (proof, why) = if hop == 0 {
                        (Proof::LastMessage, "the subject's last message is this event")
                    } else {
                        (Proof::Chain, "the walk back along the subject reached this event's own message")
                    };
                    return Ok(held(event.id, subject, proof, why));
                }
                return Err(format!(
                    "message {sequence} of subject {subject} (stream {stream_name}) has event {}'s id but is another \
                     event ({}): another outbox writes this subject, or the database was restored to an earlier \
                     point and its ids came round again; not acknowledged (use subjects of this outbox's own)",
                    event.id,
                    at.map_or_else(|| "no occurred_at header".to_string(), |t| format!("occurred {}", t.to_rfc3339()))
                )
                .into());
            }
            if id < event.id {
                return Err(broke(id, format!("the walk back from its last message reached event {id} without it")));
            }
            if let Some(previous) = get(PREVIOUS_ID).and_then(|v| v.parse::<i64>().ok()) {
                let previous_at = get(PREVIOUS_OCCURRED_AT).as_deref().and_then(parse_occurred_at);
                if previous == event.id && previous_at == Some(event.occurred_at) {
                    return Ok(held(
                        event.id,
                        subject,
                        Proof::Chain,
                        "a message of the subject names this event as the one stored just before it",
                    ));
                }
                if previous < event.id {
                    return Err(broke(id, format!("was stored right after event {previous}")));
                }
            }
            let before = get(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE.as_ref()).and_then(|v| v.parse::<u64>().ok());
            let Some(before) = before else {
                return Err(format!(
                    "subject {subject} (stream {stream_name}) holds event {id} above event {}, and message {sequence} \
                     does not say which message came before it (no Nats-Expected-Last-Subject-Sequence: not written \
                     by pg-outbox --exactly-once): another outbox writes this subject, or the database was restored \
                     to an earlier point and its ids came round again; whether it holds this event cannot be proven, \
                     so it is not acknowledged (use subjects of this outbox's own)",
                    event.id
                )
                .into());
            };
            if before == 0 {
                return Err(broke(id, "that is the subject's first message".to_string()));
            }
            message = match stream.get_raw_message(before).await {
                Ok(m) => m,
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                    return Err(format!(
                        "subject {subject} (stream {stream_name}) holds event {id} above event {}, and message \
                         {before}, stored before it, is gone (the stream's limits removed it, e.g. \
                         max_msgs_per_subject): whether the subject held this event cannot be proven; not \
                         acknowledged (keep more messages per subject; see docs/operations.md, \"When \
                         exactly-once finds order broken\")",
                        event.id
                    )
                    .into());
                }
                Err(e) => {
                    return Err(format!("cannot read message {before} of stream {stream_name}: {e}").into());
                }
            };
        }
        Err(format!(
            "subject {subject} (stream {stream_name}) holds {MAX_WALK} or more messages above event {}: whether it \
             holds this event cannot be proven within them; not acknowledged",
            event.id
        )
        .into())
    }

    /// The stream answered a publish of `event` with a duplicate PubAck
    /// (`Nats-Msg-Id` seen within its duplicate window): `Ok` when the
    /// message stored under that id (at `ack`'s sequence) is this event (its
    /// `id` and `occurred_at`, on this subject); `Err` when it is another one (another outbox
    /// on this stream, or ids that came round again after a restore), which
    /// the stream dropped this event for, or when it cannot be read.
    async fn verify_duplicate(
        &self,
        ack: &jetstream::publish::PublishAck,
        subject: &str,
        event: &Event,
    ) -> std::result::Result<(), BoxError> {
        let stream = self.js.get_stream_no_info(&ack.stream).await.map_err(|e| {
            format!("cannot read stream {} to check a duplicate of event {}: {e}", ack.stream, event.id)
        })?;
        let stored = stream.get_raw_message(ack.sequence).await.map_err(|e| {
            format!(
                "cannot read message {} of stream {} to check a duplicate of event {}: {e}",
                ack.sequence, ack.stream, event.id
            )
        })?;
        let get = |name: &str| stored.headers.get(name).map(|v| v.as_str().to_string());
        let id = get(header::ID).and_then(|v| v.trim().parse::<i64>().ok());
        let at = get(header::OCCURRED_AT).as_deref().and_then(parse_occurred_at);
        if id == Some(event.id) && at == Some(event.occurred_at) && stored.subject.as_str() == subject {
            return Ok(());
        }
        Err(format!(
            "publish to {subject}: stream {} dropped event {} as a duplicate of message {} (Nats-Msg-Id {}) on \
             subject {}, which is another event or another subject (another outbox on this stream, a subject \
             template changed, or a database restored to an earlier point whose ids came round again); not \
             acknowledged, retried after the stream's duplicate window",
            ack.stream, event.id, ack.sequence, event.id, stored.subject
        )
        .into())
    }

    /// The exactly-once send (see [`NatsSink`]).
    async fn send_once(
        &self,
        state: &ExactlyOnce,
        subject: String,
        mut headers: HeaderMap,
        message: &Message,
        event: &Event,
    ) -> std::result::Result<Sent, BoxError> {
        if state.recheck.due() {
            self.recheck(state).await?;
        }
        let cached = state.last.lock().unwrap_or_else(PoisonError::into_inner).get(&subject).cloned();
        let last = match cached {
            Some(l) => l,
            None => {
                let l = self.read_last(state, &subject).await?;
                remember(&state.last, &subject, l.clone());
                l
            }
        };
        if last.id.is_some_and(|id| event.id <= id) {
            // The subject holds this id or a greater one: only the event
            // itself, read back, proves it held.
            state.last.lock().unwrap_or_else(PoisonError::into_inner).remove(&subject);
            return self.prove(state, &subject, event).await;
        }
        headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, last.sequence.to_string().as_str());
        if let Some(id) = last.id {
            headers.insert(PREVIOUS_ID, id.to_string().as_str());
            if let Some(at) = last.occurred_at {
                headers.insert(PREVIOUS_OCCURRED_AT, at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true).as_str());
            }
        }
        let published = async {
            let ack = self.js.publish_with_headers(subject.clone(), headers, message.body.clone().into()).await?;
            ack.await
        };
        match published.await {
            Ok(ack) if ack.duplicate => {
                // Within the duplicate window the stream dropped it: it holds
                // the event, if the message stored under its id is this one.
                // The acknowledged sequence is the original's, not
                // necessarily the subject's last: read the subject back next time.
                state.last.lock().unwrap_or_else(PoisonError::into_inner).remove(&subject);
                self.verify_duplicate(&ack, &subject, event).await?;
                Ok(held(
                    event.id,
                    &subject,
                    Proof::DuplicateWindow,
                    "the stream's duplicate window holds it (Nats-Msg-Id), and the message stored under it is this event",
                ))
            }
            Ok(ack) => {
                let l = Last {
                    id: Some(event.id),
                    aggregate_type: Some(event.aggregate_type.clone()),
                    occurred_at: Some(event.occurred_at),
                    sequence: ack.sequence,
                };
                remember(&state.last, &subject, l);
                Ok(Sent::Delivered)
            }
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                // Something else wrote to the subject since it was read.
                state.last.lock().unwrap_or_else(PoisonError::into_inner).remove(&subject);
                let now = self.read_last(state, &subject).await?;
                remember(&state.last, &subject, now.clone());
                if now.id.is_some_and(|id| event.id <= id) {
                    return self.prove(state, &subject, event).await;
                }
                Err(format!(
                    "publish to {subject} refused: the subject changed since it was read (wrong last sequence: \
                     another relay wrote to it); its last message is now sequence {}; retried",
                    now.sequence
                )
                .into())
            }
            Err(e) => {
                // The stream may or may not have stored it: read back next time.
                state.last.lock().unwrap_or_else(PoisonError::into_inner).remove(&subject);
                Err(publish_error(&subject, e))
            }
        }
    }

    /// The NATS headers of `msg`.
    fn headers(msg: &Message) -> std::result::Result<HeaderMap, String> {
        let mut map = HeaderMap::new();
        for (name, value) in &msg.headers {
            // A header value cannot hold a line break (NATS headers are
            // MIME-style lines); the From impls would panic on one.
            let v: HeaderValue = value
                .parse()
                .map_err(|_| format!("header {name} contains a line break, which NATS headers cannot carry"))?;
            if *name == header::CONTENT_TYPE {
                map.insert("Content-Type", v);
            } else {
                map.insert(*name, v);
            }
        }
        map.insert(NATS_MESSAGE_ID, msg.id.as_str());
        Ok(map)
    }
}

/// The error of a failed publish to `subject`.
fn publish_error(subject: &str, e: jetstream::context::PublishError) -> BoxError {
    if e.kind() == PublishErrorKind::StreamNotFound {
        format!(
            "no JetStream stream captures subject {subject}; create one, e.g. `nats stream add --subjects '{subject}'`"
        )
        .into()
    } else {
        format!("publish to {subject} failed: {e}").into()
    }
}

/// Open the NATS JetStream sink (`--sink nats://...` or `tls://...`).
pub(crate) fn open<'a>(url: &'a SecretUrl, settings: &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>> {
    Box::pin(async move {
        if settings.exactly_once {
            NatsSink::check_template(&settings.nats.subject)?;
        }
        Ok(Box::new(NatsSink::connect(url, settings).await?) as Box<dyn Sink>)
    })
}

impl Sink for NatsSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn guarantee(&self) -> Guarantee {
        if self.exactly_once.is_some() { Guarantee::ExactlyOnce } else { Guarantee::AtLeastOnce }
    }

    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SendFuture<'a> {
        Box::pin(async move {
            let subject = self.subject.render(event);
            check_subject(&subject)?;
            let headers = Self::headers(message)?;
            if let Some(state) = &self.exactly_once {
                return self.send_once(state, subject, headers, message, event).await;
            }
            let published = async {
                let ack = self.js.publish_with_headers(subject.clone(), headers, message.body.clone().into()).await?;
                ack.await
            };
            let ack = match published.await {
                Err(e) => return Err(publish_error(&subject, e)),
                Ok(ack) => ack,
            };
            if ack.duplicate {
                // Only if what is stored under its id is this event.
                self.verify_duplicate(&ack, &subject, event).await?;
                tracing::debug!(id = %message.id, stream = %ack.stream, "JetStream dropped a duplicate (already stored)");
            }
            Ok(Sent::Delivered)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_url_and_are_decoded() {
        let split = |s: &str| split_credentials(&SecretUrl::new(s));
        let (servers, creds, tls) = split("nats://al%40ice:p%3Ass@h1:4222,nats://h2:4223").expect("parses");
        assert_eq!(servers, ["nats://h1:4222", "nats://h2:4223"]);
        assert!(!tls);
        assert!(creds == Some(Credentials::UserPassword("al@ice".into(), "p:ss".into())), "user and password");
        let (_, creds, _) = split("nats://s3cr3t@h1:4222").expect("parses");
        let (_, _, tls) = split("tls://h1:4222").expect("parses");
        assert!(tls, "tls:// asks for TLS");
        assert!(creds == Some(Credentials::Token("s3cr3t".into())), "a lone user part is a token");
        let err = split("nats://u:pw@h1:4222,http://h2").expect_err("http is refused").to_string();
        assert!(err.contains("nats://") && !err.contains("pw"), "{err}");
    }

    #[test]
    fn streams_that_may_lose_a_subjects_last_message_are_named_by_setting() {
        use jetstream::stream::Config;
        let ok = Config { name: "S".into(), max_messages: -1, max_bytes: -1, ..Default::default() };
        assert_eq!(stream_loses_last(&ok), None);
        assert_eq!(stream_loses_last(&Config { max_messages_per_subject: 1, ..ok.clone() }), None);
        let cases = [
            (Config { retention: RetentionPolicy::WorkQueue, ..ok.clone() }, "retention"),
            (Config { retention: RetentionPolicy::Interest, ..ok.clone() }, "retention"),
            (Config { max_age: std::time::Duration::from_secs(60), ..ok.clone() }, "max_age"),
            (Config { max_messages: 1000, ..ok.clone() }, "max_msgs is 1000"),
            (Config { max_bytes: 1 << 20, ..ok.clone() }, "max_bytes"),
            (
                Config {
                    discard: DiscardPolicy::New,
                    discard_new_per_subject: true,
                    max_messages_per_subject: 1,
                    ..ok.clone()
                },
                "discard new per subject",
            ),
        ];
        for (config, want) in cases {
            let why = stream_loses_last(&config).unwrap_or_default();
            assert!(why.contains(want), "{want}: {why}");
        }
    }

    #[test]
    fn servers_whose_per_subject_lookups_can_fail_are_named() {
        for bad in ["2.12.7", "v2.12.9", "2.12.7-RC.1"] {
            let why = server_breaks_lookups(bad).unwrap_or_default();
            assert!(why.contains("8254") && why.contains("2.14"), "{bad}: {why}");
        }
        for good in ["2.9.10", "2.10.29", "2.11.4", "2.12.6", "2.14.0", "3.0.0", "unknown"] {
            assert_eq!(server_breaks_lookups(good), None, "{good}");
        }
    }

    #[test]
    fn headers_carry_msg_id_and_content_type_and_refuse_line_breaks() {
        let msg = Message {
            id: "7".into(),
            key: "k".into(),
            body: b"{}".to_vec(),
            content_type: "application/json",
            headers: vec![(header::ID, "7".into()), (header::CONTENT_TYPE, "application/json".into())],
        };
        let h = NatsSink::headers(&msg).expect("headers");
        assert_eq!(h.get(NATS_MESSAGE_ID).map(HeaderValue::as_str), Some("7"));
        assert_eq!(h.get("Content-Type").map(HeaderValue::as_str), Some("application/json"));
        assert_eq!(h.get("id").map(HeaderValue::as_str), Some("7"));
        let mut bad = msg.clone();
        bad.headers.push((header::CORRELATION_ID, "a\r\nb".into()));
        let err = NatsSink::headers(&bad).expect_err("a line break is refused");
        assert!(err.contains("correlation_id"), "{err}");
    }
}

/// A subject one can publish to (NATS docs, "Subject-Based Messaging"):
/// tokens separated by `.`, none empty, no whitespace or control
/// characters, and no wildcard token (`*` or `>`). Event fields rendered into
/// the subject template can break these rules; such an event fails (and
/// ends as a dead letter an operator sees) rather than being published to a
/// wildcard or split subject.
fn check_subject(subject: &str) -> Result<(), BoxError> {
    let bad = |why: &str| -> Result<(), BoxError> {
        Err(format!(
            "subject {subject:?} from --nats-subject is not a subject NATS can publish to: {why} \
             (the event's aggregate_type or event_type holds '.', '*', '>' or whitespace)"
        )
        .into())
    };
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return bad("it holds whitespace or a control character");
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return bad("it has an empty token");
        }
        if token == "*" || token == ">" {
            return bad("it has a wildcard token");
        }
    }
    Ok(())
}

#[cfg(test)]
mod subject_tests {
    use super::check_subject;

    #[test]
    fn wildcards_empty_tokens_and_whitespace_are_refused() {
        assert!(check_subject("events.invoice.Issued").is_ok());
        for bad in ["events.x*.>", "events.*.a", "events..a", "events.a b", "events.a\tb", ".a", "a."] {
            assert!(check_subject(bad).is_err(), "{bad:?} must be refused");
        }
    }
}

//! NATS JetStream sink (Cargo feature `nats`, client `async-nats`).

use async_nats::HeaderMap;
use async_nats::header::{HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, context::PublishErrorKind};
use futures::future::BoxFuture;

use crate::error::{BoxError, Error, Result};
use crate::event::Event;
use crate::relay::settings::with_reason;
use crate::relay::{Message, Sink, SinkFuture, SinkSettings, Template, header};
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
        Ok(NatsSink { js, subject: settings.nats.subject.clone(), name: format!("NATS JetStream {shown}") })
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

/// Open the NATS JetStream sink (`--sink nats://...` or `tls://...`).
pub(crate) fn open<'a>(url: &'a SecretUrl, settings: &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>> {
    Box::pin(async move { Ok(Box::new(NatsSink::connect(url, settings).await?) as Box<dyn Sink>) })
}

impl Sink for NatsSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let subject = self.subject.render(event);
            check_subject(&subject)?;
            let headers = Self::headers(message)?;
            let published = async {
                let ack = self.js.publish_with_headers(subject.clone(), headers, message.body.clone().into()).await?;
                ack.await
            };
            let ack = match published.await {
                Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                    return Err(format!(
                        "no JetStream stream captures subject {subject}; create one, e.g. `nats stream add --subjects '{subject}'`"
                    )
                    .into());
                }
                Err(e) => return Err(format!("publish to {subject} failed: {e}").into()),
                Ok(ack) => ack,
            };
            if ack.duplicate {
                tracing::debug!(id = %message.id, stream = %ack.stream, "JetStream dropped a duplicate (already stored)");
            }
            Ok(())
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

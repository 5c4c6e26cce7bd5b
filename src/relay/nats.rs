//! NATS JetStream sink (Cargo feature `nats`, client `async-nats`).

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, context::PublishErrorKind};

use super::{Format, Message, Sink, SinkFuture, SinkOptions, Template, header};
use crate::error::{BoxError, Error, Result};
use crate::event::Event;
use crate::redact::{redact_spec, scrub};

/// Publishes each event to NATS JetStream and acknowledges it on the
/// stream's PubAck.
///
/// - Subject: [`SinkOptions::nats_subject`] rendered for the event (default
///   `events.{aggregate_type}.{event_type}`). A stream must capture it; when
///   none does, the server has no responder and the event fails with
///   "no JetStream stream captures subject X".
/// - Body: the [`Message`] body ([`SinkOptions::format`]).
/// - Headers: the [`Message`] headers (`id`, `event_type`, `aggregate_type`,
///   `aggregate_id`, `occurred_at`, and `correlation_id`, `causation_id`,
///   `traceparent`, `tracestate` when the envelope's metadata has them),
///   `Content-Type`, and `Nats-Msg-Id` = the outbox id, so a stream's
///   duplicate window (JetStream docs, "Message Deduplication"; default
///   2 minutes) drops a redelivery of an event whose acknowledgement the
///   relay could not record.
/// - `deliver` returns `Ok` only after the PubAck (a duplicate's PubAck
///   counts: the stream has the message), bounded by
///   [`SinkOptions::timeout`]. A timeout, a lost connection or a stream
///   error fails the event (retried with backoff). The client reconnects
///   on its own, forever, while the relay runs.
///
/// Authentication, one way of: a user and password (in the URL,
/// `nats://user:pass@host:4222`, or [`SinkOptions::user`] and
/// [`SinkOptions::password`]), a token (`nats://token@host:4222` or
/// [`SinkOptions::nats_token`]), an NKey seed ([`SinkOptions::nats_nkey`]) or
/// a `.creds` file ([`SinkOptions::nats_credentials`]). Secrets never appear
/// in logs or errors.
///
/// TLS: a `tls://` URL, [`SinkOptions::tls`] or any TLS file requires it
/// (the connection fails if the server does not offer it); the server's
/// certificate is checked against [`SinkOptions::tls_ca_file`] (else the
/// platform's roots) and the host name of the URL;
/// [`SinkOptions::tls_client_cert`] and [`SinkOptions::tls_client_key`]
/// present a client certificate (`verify: true` on the server). Without any
/// of these the client still upgrades to TLS when the server requires it,
/// checking against the platform's roots.
#[derive(Debug, Clone)]
pub struct NatsSink {
    js: jetstream::Context,
    subject: Template,
    format: Format,
    source: String,
    timeout: Duration,
    shown: String,
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
            Credentials::UserPassword(user, _) => write!(f, "UserPassword({user:?}, ***)"),
            Credentials::Token(_) => f.write_str("Token(***)"),
        }
    }
}

/// The servers of a comma-separated list, credentials removed, the
/// credentials found (the last URL's that has any), and whether a `tls://`
/// URL asks for TLS.
fn split_credentials(spec: &str) -> Result<(Vec<String>, Option<Credentials>, bool)> {
    let mut servers = Vec::new();
    let mut creds = None;
    let mut tls = false;
    for part in spec.split(',').map(str::trim) {
        let mut url = url::Url::parse(part)
            .map_err(|e| Error::Config(format!("invalid NATS URL '{}': {e}", redact_spec(part))))?;
        match url.scheme() {
            "nats" => {}
            "tls" => tls = true,
            _ => {
                return Err(Error::Config(format!(
                    "invalid NATS URL '{}': every server of the list must use nats:// (or tls://)",
                    redact_spec(part)
                )));
            }
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(Error::Config(format!("invalid NATS URL '{}': no host", redact_spec(part))));
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
    opts: &SinkOptions,
    options: async_nats::ConnectOptions,
) -> Result<async_nats::ConnectOptions> {
    let (mut user, mut password, mut token) = match url_creds {
        Some(Credentials::UserPassword(u, p)) => (Some(u), Some(p), None),
        Some(Credentials::Token(t)) => (None, None, Some(t)),
        None => (None, None, None),
    };
    if let Some(u) = &opts.user {
        user = Some(u.clone());
        // A URL's lone user part was a token; with --sink-user it is not.
        token = token.filter(|_| password.is_some());
    }
    if let Some(p) = &opts.password {
        password = Some(p.expose().to_string());
    }
    if let Some(t) = &opts.nats_token {
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
    let ways = [user_password.is_some(), token.is_some(), opts.nats_nkey.is_some(), opts.nats_credentials.is_some()];
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
    if let Some(seed) = &opts.nats_nkey {
        let seed = seed.expose().trim();
        // Checked here so a bad seed is a clear error, not a failed handshake.
        nkeys::KeyPair::from_seed(seed).map_err(|e| {
            Error::Config(format!("NATS NKey seed is not valid ({e}); a user seed is one line starting with SU"))
        })?;
        return Ok(options.nkey(seed.to_string()));
    }
    if let Some(creds) = &opts.nats_credentials {
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
    /// separated by commas) and prepare publishing with `opts`
    /// (subject template, format, timeout).
    ///
    /// # Errors
    /// [`Error::Config`] if the URL is malformed or the server cannot be
    /// reached within [`SinkOptions::timeout`]; the message names the
    /// server without credentials.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the connection being opened.
    pub async fn connect(url: &str, opts: &SinkOptions) -> Result<Self> {
        let shown = redact_spec(url);
        let (servers, creds, tls_scheme) = split_credentials(url)?;
        opts.check_tls_files("NATS")?;
        let mut options = async_nats::ConnectOptions::new()
            .name(concat!("pg-outbox/", env!("CARGO_PKG_VERSION")))
            .connection_timeout(opts.timeout)
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
        options = authentication(creds, opts, options)?;
        if tls_scheme || opts.tls_wanted() {
            // rustls needs a process-wide crypto provider when more than one
            // is compiled in; ours is ring. Already installed is fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
            options = options.require_tls(true);
        }
        if let Some(ca) = &opts.tls_ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&opts.tls_client_cert, &opts.tls_client_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        let client = options.connect(servers).await.map_err(|e| {
            let why = scrub(&crate::error::report(&e), url);
            Error::SinkUnavailable(format!("cannot connect to NATS at {shown}: {}", super::with_reason(why)))
        })?;
        let mut js = jetstream::new(client);
        js.set_timeout(opts.timeout);
        Ok(NatsSink {
            js,
            subject: opts.nats_subject.clone(),
            format: opts.format,
            source: opts.cloudevents_source.clone(),
            timeout: opts.timeout,
            shown,
        })
    }

    /// The server(s) as shown in messages (no credentials).
    pub fn display_url(&self) -> &str {
        &self.shown
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

impl Sink for NatsSink {
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let msg = Message::new(event, self.format, &self.source)?;
            let subject = self.subject.render(event);
            check_subject(&subject)?;
            let headers = Self::headers(&msg)?;
            let publish = async {
                let ack = self.js.publish_with_headers(subject.clone(), headers, msg.body.into()).await?;
                ack.await
            };
            let ack = match tokio::time::timeout(self.timeout, publish).await {
                Err(_) => {
                    return Err(format!(
                        "NATS {}: no PubAck for subject {subject} within {:?}",
                        self.shown, self.timeout
                    )
                    .into());
                }
                Ok(Err(e)) if e.kind() == PublishErrorKind::StreamNotFound => {
                    return Err(format!(
                        "no JetStream stream captures subject {subject}; create one, e.g. `nats stream add --subjects '{subject}'`"
                    )
                    .into());
                }
                Ok(Err(e)) => return Err(format!("NATS {}: publish to {subject} failed: {e}", self.shown).into()),
                Ok(Ok(ack)) => ack,
            };
            if ack.duplicate {
                tracing::debug!(id = %msg.id, stream = %ack.stream, "JetStream dropped a duplicate (already stored)");
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
        let (servers, creds, tls) = split_credentials("nats://al%40ice:p%3Ass@h1:4222,nats://h2:4223").expect("parses");
        assert_eq!(servers, ["nats://h1:4222", "nats://h2:4223"]);
        assert!(!tls);
        assert!(creds == Some(Credentials::UserPassword("al@ice".into(), "p:ss".into())), "user and password");
        let (_, creds, _) = split_credentials("nats://s3cr3t@h1:4222").expect("parses");
        let (_, _, tls) = split_credentials("tls://h1:4222").expect("parses");
        assert!(tls, "tls:// asks for TLS");
        assert!(creds == Some(Credentials::Token("s3cr3t".into())), "a lone user part is a token");
        let err = split_credentials("nats://u:pw@h1:4222,http://h2").expect_err("http is refused").to_string();
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

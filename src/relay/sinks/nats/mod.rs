//! NATS JetStream sink (Cargo feature `nats`, client `async-nats`).
//!
//! `mod.rs` holds the sink and its at-least-once send; `exactly_once`
//! the exactly-once send, its proofs and the stream checks; `auth` the
//! URL's credentials and the ways to authenticate.

mod auth;
mod exactly_once;

use std::sync::Arc;

use async_nats::HeaderMap;
use async_nats::header::{HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, context::PublishErrorKind};
use futures::future::BoxFuture;

use crate::error::{BoxError, Error, Result};
use crate::event::Event;
use crate::relay::access::with_reason;
use crate::relay::{Guarantee, Message, SendFuture, Sent, Sink, SinkSettings, Template, header};
use crate::secret::{Secret, SecretUrl};
use auth::{authentication, split_credentials};
use exactly_once::ExactlyOnce;

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
/// subject's last message is this event ([`Proof::LastMessage`](crate::relay::Proof::LastMessage)) or the walk
/// back along the subject (each message's stored expected sequence and
/// `previous_id`, at most 1 000 messages) reaches it ([`Proof::Chain`](crate::relay::Proof::Chain)); a
/// greater id alone proves nothing, and the event fails with the cause
/// (order broke upstream; a message the stream's limits removed; a message
/// not written by pg-outbox). After a wrong last sequence the sink reads
/// the subject again and does the same. A duplicate PubAck counts only
/// when the message stored under that `Nats-Msg-Id` is this event
/// ([`Proof::DuplicateWindow`](crate::relay::Proof::DuplicateWindow)). This holds for any length of time as long
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
            sink.exactly_once = Some(Arc::new(ExactlyOnce::new(settings.broker_check_interval)));
            sink.check_streams(true).await?;
        }
        Ok(sink)
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

/// The NATS sink's flags (feature `cli`).
#[cfg(feature = "cli")]
#[derive(clap::Args, Debug)]
#[group(skip)]
pub(crate) struct Flags {
    /// NATS subject template; placeholders {aggregate_type}, {event_type},
    /// {aggregate_id}.
    #[arg(long, default_value = "events.{aggregate_type}.{event_type}", value_parser = |s: &str| Template::parse(s).map_err(|e| e.to_string()))]
    nats_subject: Template,
    /// NATS: a .creds file (user JWT and NKey seed, as `nsc` writes it).
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    nats_creds: Option<std::path::PathBuf>,
    /// NATS: a file holding a user NKey seed (SU...).
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    nats_nkey_file: Option<std::path::PathBuf>,
    /// NATS: a file holding the authentication token.
    #[arg(long, value_name = "FILE", help_heading = "Sink TLS and credentials")]
    nats_token_file: Option<std::path::PathBuf>,
}

#[cfg(feature = "cli")]
impl Flags {
    /// Write the flags into [`SinkSettings::nats`], the secret files read.
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag for an unreadable or empty file.
    pub(crate) fn apply(&self, settings: &mut SinkSettings) -> Result<()> {
        /// The contents of the file `path` that `flag` names, without the
        /// trailing line break.
        fn secret_file(flag: &str, path: Option<&std::path::Path>) -> Result<Option<Secret>> {
            let Some(path) = path else { return Ok(None) };
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("--{flag} {}: cannot read: {e}", path.display())))?;
            let value = text.trim_end_matches(['\n', '\r']);
            if value.trim().is_empty() {
                return Err(Error::Config(format!("--{flag} {}: the file is empty", path.display())));
            }
            Ok(Some(Secret::new(value)))
        }
        let nats = &mut settings.nats;
        nats.subject = self.nats_subject.clone();
        nats.credentials = secret_file("nats-creds", self.nats_creds.as_deref())?;
        nats.nkey = secret_file("nats-nkey-file", self.nats_nkey_file.as_deref())?;
        nats.token = secret_file("nats-token-file", self.nats_token_file.as_deref())?;
        Ok(())
    }
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

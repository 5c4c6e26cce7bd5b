//! The webhook sink: one HTTP POST per event, optionally signed (Standard Webhooks).

use std::time::Duration;

use base64::Engine as _;
use hmac::{KeyInit as _, Mac as _};

use super::{Format, Message, Sink, SinkFuture, SinkOptions, header};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::redact::redact_url;

/// Default time a webhook has to answer: 10 seconds
/// ([`super::DEFAULT_SINK_TIMEOUT`]).
pub const DEFAULT_WEBHOOK_TIMEOUT: Duration = super::DEFAULT_SINK_TIMEOUT;

/// Most bytes of a failed response's body kept in `last_error`.
const BODY_SNIPPET: usize = 512;

/// POSTs each event's [`super::SinkRecord`] as JSON to a URL. A 2xx response
/// acknowledges the event; any other status (redirects are not followed: a
/// 3xx fails the event too), a connection error or a timeout fails it, with
/// the status (and the start of the body, on one line) in `last_error`.
/// Credentials and the query string of the URL never appear in logs or
/// `last_error`. The request carries `Idempotency-Key: <outbox id>` so the
/// receiver can drop redeliveries.
///
/// With a [`WebhookSecret`] (flag `--webhook-secret`), each request is signed
/// as the Standard Webhooks specification says (see [`WebhookSecret`]).
#[derive(Debug, Clone)]
pub struct WebhookSink {
    client: reqwest::Client,
    url: reqwest::Url,
    shown: String,
    format: Format,
    source: String,
    headers: reqwest::header::HeaderMap,
    secret: Option<WebhookSecret>,
}

/// A Standard Webhooks symmetric signing key (Standard Webhooks
/// specification 1.0.0, "Signature scheme"; <https://www.standardwebhooks.com>).
///
/// Each signed request carries three headers:
/// - `webhook-id`: the outbox id (decimal; the same on every retry, so it is
///   also the idempotency key);
/// - `webhook-timestamp`: Unix time in seconds when this attempt was sent
///   (a new value on every retry, as the specification asks);
/// - `webhook-signature`: `v1,` followed by the standard base64 (with
///   padding) of HMAC-SHA256 over `{webhook-id}.{webhook-timestamp}.{body}`,
///   keyed with the decoded secret. `body` is the exact bytes sent.
///
/// The secret is written as the specification serialises it: `whsec_`
/// followed by the key in standard base64. Like the reference libraries
/// (`standardwebhooks` for Rust, `standardwebhooks` for Python/JS, Svix), a
/// secret without the `whsec_` prefix is taken as the bare base64 key. The
/// key must be 24 to 64 bytes long (the specification: "at least 24 bytes
/// (192 bits, 512 maximum)").
///
/// The key never appears in `Debug` output, logs or error messages.
#[derive(Clone)]
pub struct WebhookSecret {
    key: Vec<u8>,
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(redacted)")
    }
}

impl WebhookSecret {
    /// The prefix of a serialised symmetric secret.
    pub const PREFIX: &'static str = "whsec_";
    /// Shortest key accepted, in bytes (Standard Webhooks: at least 24).
    pub const MIN_KEY_BYTES: usize = 24;
    /// Longest key accepted, in bytes (Standard Webhooks: 512 bits).
    pub const MAX_KEY_BYTES: usize = 64;

    /// Parse `whsec_<base64>` (or a bare base64 key).
    ///
    /// # Errors
    /// [`Error::Config`] when the text after the prefix is empty or not
    /// standard base64, or the key is shorter than [`Self::MIN_KEY_BYTES`]
    /// or longer than [`Self::MAX_KEY_BYTES`]. The message never quotes the
    /// secret.
    ///
    /// # Example
    /// ```
    /// use pg_outbox::relay::WebhookSecret;
    /// // The test vector of the Standard Webhooks reference library.
    /// let s = WebhookSecret::parse("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
    /// let body = br#"{"email":"test@example.com","username":"test_user"}"#;
    /// assert_eq!(
    ///     s.sign("msg_27UH4WbU6Z5A5EzD8u03UvzRbpk", 1649367553, body),
    ///     "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
    /// );
    /// assert!(WebhookSecret::parse("whsec_not base64!").is_err());
    /// ```
    pub fn parse(secret: &str) -> Result<Self> {
        let encoded = secret.trim();
        let encoded = encoded.strip_prefix(Self::PREFIX).unwrap_or(encoded);
        if encoded.is_empty() {
            return Err(Error::Config("--webhook-secret is empty: write whsec_ followed by a base64 key".into()));
        }
        let key = base64::engine::general_purpose::STANDARD.decode(encoded).map_err(|e| {
            Error::Config(format!(
                "--webhook-secret is not a Standard Webhooks secret (whsec_ followed by standard base64): {e}"
            ))
        })?;
        if key.len() < Self::MIN_KEY_BYTES || key.len() > Self::MAX_KEY_BYTES {
            return Err(Error::Config(format!(
                "--webhook-secret decodes to a {}-byte key; Standard Webhooks asks for {} to {} bytes",
                key.len(),
                Self::MIN_KEY_BYTES,
                Self::MAX_KEY_BYTES
            )));
        }
        Ok(WebhookSecret { key })
    }

    /// The `webhook-signature` value for message `id` sent at `timestamp`
    /// (Unix seconds) with `body`: `v1,<base64 HMAC-SHA256>`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.key) else {
            unreachable!("HMAC accepts keys of any length")
        };
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        let tag = mac.finalize().into_bytes();
        format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(tag))
    }
}

/// Header names pg-outbox sets itself on every webhook request; a
/// `--webhook-header` may not set them (a second `Content-Type`, or a forged
/// `webhook-signature`, would reach the receiver beside ours).
const RESERVED_HEADERS: [&str; 8] = [
    "content-type",
    "idempotency-key",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "traceparent",
    "tracestate",
    "user-agent",
];

/// Most bytes of a failed response's body read (the rest is not read): a
/// receiver answering an error with a huge body cannot make the relay
/// buffer it.
const MAX_ERROR_BODY_READ: usize = 16 * 1024;

impl WebhookSink {
    /// A webhook sink for an `http://` or `https://` URL, with a per-request
    /// timeout (default [`DEFAULT_WEBHOOK_TIMEOUT`]).
    ///
    /// # Errors
    /// [`Error::Config`] if the URL does not parse or is not http(s).
    pub fn new(url: &str, timeout: Duration) -> Result<Self> {
        let url = reqwest::Url::parse(url).map_err(|e| Error::Config(format!("invalid webhook URL: {e}")))?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(Error::Config(format!("webhook URL must be http or https, got {}", url.scheme())));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(Error::Config("webhook URL has no host".into()));
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("pg-outbox/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Config(format!("cannot build the HTTP client: {e}")))?;
        let shown = redact_url(&url);
        Ok(WebhookSink {
            client,
            url,
            shown,
            format: Format::Record,
            source: super::DEFAULT_CLOUDEVENTS_SOURCE.to_string(),
            headers: reqwest::header::HeaderMap::new(),
            secret: None,
        })
    }

    /// Apply the webhook fields of `opts`: body format, extra headers and
    /// the signing secret.
    ///
    /// # Errors
    /// [`Error::Config`] for a header name or value HTTP does not allow, a
    /// header pg-outbox sets itself (`Content-Type`, `Idempotency-Key`, the
    /// `webhook-*` signature headers, `traceparent`, `tracestate`,
    /// `User-Agent`, `outbox-*`), or a malformed secret (see
    /// [`WebhookSecret::parse`]).
    pub fn with_options(mut self, opts: &SinkOptions) -> Result<Self> {
        self.format = opts.format;
        self.source = opts.cloudevents_source.clone();
        self.secret = opts.webhook_secret.as_deref().map(WebhookSecret::parse).transpose()?;
        for (name, value) in &opts.webhook_headers {
            let n = reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| Error::Config(format!("invalid webhook header name '{name}': {e}")))?;
            if RESERVED_HEADERS.contains(&n.as_str()) || n.as_str().starts_with("outbox-") {
                return Err(Error::Config(format!(
                    "--webhook-header '{name}' is set by pg-outbox itself and cannot be overridden"
                )));
            }
            let v = reqwest::header::HeaderValue::from_str(value)
                .map_err(|e| Error::Config(format!("invalid value for webhook header '{name}': {e}")))?;
            self.headers.append(n, v);
        }
        Ok(self)
    }

    /// The URL as shown in messages (no credentials, no query string).
    pub fn display_url(&self) -> &str {
        &self.shown
    }
}

impl WebhookSink {
    /// The POST request for `msg`: its headers, and the Standard Webhooks
    /// signature when a secret is set.
    fn request(&self, msg: Message) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(self.url.clone())
            .headers(self.headers.clone())
            .header("Idempotency-Key", &msg.id)
            .header(reqwest::header::CONTENT_TYPE, msg.content_type);
        for (name, value) in &msg.headers {
            // Trace context keeps its W3C names; the rest are prefixed.
            req = match *name {
                header::CONTENT_TYPE => req,
                header::TRACEPARENT | header::TRACESTATE => req.header(*name, value),
                _ => req.header(format!("outbox-{}", name.replace('_', "-")), value),
            };
        }
        if let Some(secret) = &self.secret {
            // The attempt's own time (Standard Webhooks: "the timestamp of
            // when the webhook attempt has been made").
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            req = req
                .header("webhook-id", &msg.id)
                .header("webhook-timestamp", now)
                .header("webhook-signature", secret.sign(&msg.id, now, &msg.body));
        }
        req.body(msg.body)
    }

    /// The error for a response that is not a success: its status and the
    /// start of its body, on one line.
    async fn refused(&self, mut resp: reqwest::Response) -> String {
        let status = resp.status();
        let mut raw: Vec<u8> = Vec::new();
        while raw.len() < MAX_ERROR_BODY_READ {
            match resp.chunk().await {
                Ok(Some(chunk)) => raw.extend_from_slice(&chunk[..chunk.len().min(MAX_ERROR_BODY_READ - raw.len())]),
                _ => break,
            }
        }
        let body = String::from_utf8_lossy(&raw);
        // One line: collapse whitespace (HTML error pages span many lines).
        let flat = body.split_whitespace().collect::<Vec<_>>().join(" ");
        let mut snippet: String = flat.chars().take(BODY_SNIPPET).collect();
        if snippet.len() < flat.len() {
            snippet.push('…');
        }
        if status.is_redirection() {
            return format!(
                "webhook answered HTTP {status} (redirects are not followed; point --sink at the final URL): {snippet}"
            );
        }
        format!("webhook answered HTTP {status}: {snippet}")
    }
}

impl Sink for WebhookSink {
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let msg = Message::new(event, self.format, &self.source)?;
            let resp = self.request(msg).send().await.map_err(|e| {
                let timeout = e.is_timeout();
                let e = e.without_url();
                if timeout {
                    format!("webhook {} timed out: {}", self.shown, crate::error::report(&e))
                } else {
                    format!("webhook {} request failed: {}", self.shown, crate::error::report(&e))
                }
            })?;
            if resp.status().is_success() {
                return Ok(());
            }
            Err(self.refused(resp).await.into())
        })
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn headers_pg_outbox_sets_cannot_be_overridden_and_queries_are_hidden() {
        for name in ["Content-Type", "idempotency-key", "webhook-signature", "traceparent", "outbox-id"] {
            let opts =
                super::SinkOptions { webhook_headers: vec![(name.to_string(), "x".to_string())], ..Default::default() };
            let hook = super::WebhookSink::new("http://127.0.0.1:1/h", std::time::Duration::from_secs(1))
                .expect("a valid URL");
            assert!(hook.with_options(&opts).is_err(), "{name} must be refused");
        }
        let opts = super::SinkOptions {
            webhook_headers: vec![("X-Team".to_string(), "billing".to_string())],
            ..Default::default()
        };
        let hook = super::WebhookSink::new("http://u:pw@127.0.0.1:1/h?token=abc", std::time::Duration::from_secs(1))
            .expect("a valid URL");
        assert_eq!(hook.display_url(), "http://127.0.0.1:1/h?…");
        assert!(hook.with_options(&opts).is_ok());
    }

    use super::WebhookSecret;

    #[test]
    fn signs_like_the_reference_library_with_or_without_the_prefix() {
        // Vector from the Standard Webhooks reference library's tests.
        let body = br#"{"email":"test@example.com","username":"test_user"}"#;
        let want = "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=";
        for secret in ["whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD", "C2FVsBQIhrscChlQIMV+b5sSYspob7oD"] {
            let s = WebhookSecret::parse(secret).expect("valid secret");
            assert_eq!(s.sign("msg_27UH4WbU6Z5A5EzD8u03UvzRbpk", 1649367553, body), want);
        }
    }

    #[test]
    fn rejects_malformed_secrets_without_quoting_them() {
        for (secret, needle) in [
            ("whsec_", "empty"),
            ("", "empty"),
            ("whsec_s3cr3t!!", "base64"),
            ("whsec_c2hvcnQ=", "5-byte key"),
            (&format!("whsec_{}", "A".repeat(100)), "75-byte key"),
        ] {
            let e = WebhookSecret::parse(secret).expect_err("malformed secret").to_string();
            assert!(e.contains(needle), "{secret:?}: {e}");
            assert!(e.contains("--webhook-secret"), "{e}");
            if secret.len() > 6 {
                assert!(!e.contains(&secret[6..]), "the secret leaked: {e}");
            }
        }
        assert_eq!(
            format!("{:?}", WebhookSecret::parse("C2FVsBQIhrscChlQIMV+b5sSYspob7oD")),
            "Ok(WebhookSecret(redacted))"
        );
    }
}

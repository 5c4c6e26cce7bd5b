use std::time::Duration;

use super::{Format, Message, Sink, SinkFuture, SinkOptions, header};
use crate::error::{Error, Result};
use crate::event::Event;

/// Default time a webhook has to answer: 10 seconds.
pub const DEFAULT_WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// Most bytes of a failed response's body kept in `last_error`.
const BODY_SNIPPET: usize = 512;

/// POSTs each event's [`SinkRecord`] as JSON to a URL. A 2xx response
/// acknowledges the event; any other status (redirects are not followed: a
/// 3xx fails the event too), a connection error or a timeout fails it, with
/// the status (and the start of the body, on one line) in `last_error`.
/// Credentials and the query string of the URL never appear in logs or
/// `last_error`. The request carries `Idempotency-Key: <outbox id>` so the
/// receiver can drop redeliveries.
#[derive(Debug, Clone)]
pub struct WebhookSink {
    client: reqwest::Client,
    url: reqwest::Url,
    shown: String,
    format: Format,
    source: String,
    headers: reqwest::header::HeaderMap,
}

/// The URL without credentials and query string, for messages.
pub fn redact_url(url: &reqwest::Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    if u.query().is_some() {
        u.set_query(Some("…"));
    }
    u.to_string()
}

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
        })
    }

    /// Apply the webhook fields of `opts`: body format and extra headers.
    ///
    /// # Errors
    /// [`Error::Config`] for a header name or value HTTP does not allow.
    pub fn with_options(mut self, opts: &SinkOptions) -> Result<Self> {
        self.format = opts.format;
        self.source = opts.cloudevents_source.clone();
        for (name, value) in &opts.webhook_headers {
            let n = reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| Error::Config(format!("invalid webhook header name '{name}': {e}")))?;
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

impl Sink for WebhookSink {
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let msg = Message::new(event, self.format, &self.source)?;
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
            let resp = req.body(msg.body).send().await.map_err(|e| {
                let timeout = e.is_timeout();
                let e = e.without_url();
                if timeout {
                    format!("webhook {} timed out: {}", self.shown, crate::error::report(&e))
                } else {
                    format!("webhook {} request failed: {}", self.shown, crate::error::report(&e))
                }
            })?;
            let status = resp.status();
            if status.is_success() {
                return Ok(());
            }
            let body = resp.text().await.unwrap_or_default();
            // One line: collapse whitespace (HTML error pages span many lines).
            let flat = body.split_whitespace().collect::<Vec<_>>().join(" ");
            let mut snippet: String = flat.chars().take(BODY_SNIPPET).collect();
            if snippet.len() < flat.len() {
                snippet.push('…');
            }
            if status.is_redirection() {
                return Err(format!("webhook answered HTTP {status} (redirects are not followed; point --sink at the final URL): {snippet}").into());
            }
            Err(format!("webhook answered HTTP {status}: {snippet}").into())
        })
    }
}

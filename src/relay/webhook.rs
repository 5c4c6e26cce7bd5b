use std::time::Duration;

use super::{Sink, SinkFuture, SinkRecord};
use crate::error::{Error, Result};
use crate::event::Event;

/// Default time a webhook has to answer: 10 seconds.
pub const DEFAULT_WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// Most bytes of a failed response's body kept in `last_error`.
const BODY_SNIPPET: usize = 512;

/// POSTs each event's [`SinkRecord`] as JSON to a URL. A 2xx response
/// acknowledges the event; any other status, a connection error or a
/// timeout fails it, with the status (and the start of the body) in
/// `last_error`. The request carries `Idempotency-Key: <outbox id>` so the
/// receiver can drop redeliveries.
#[derive(Debug, Clone)]
pub struct WebhookSink {
    client: reqwest::Client,
    url: reqwest::Url,
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
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .user_agent(concat!("pg-outbox/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Config(format!("cannot build the HTTP client: {e}")))?;
        Ok(WebhookSink { client, url })
    }
}

impl Sink for WebhookSink {
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let resp = self
                .client
                .post(self.url.clone())
                .header("Idempotency-Key", event.id.to_string())
                .json(&SinkRecord::new(event))
                .send()
                .await
                .map_err(|e| {
                    if e.is_timeout() {
                        format!("webhook timed out: {}", crate::error::report(&e))
                    } else {
                        format!("webhook request failed: {}", crate::error::report(&e))
                    }
                })?;
            let status = resp.status();
            if status.is_success() {
                return Ok(());
            }
            let body = resp.text().await.unwrap_or_default();
            let mut snippet: String = body.chars().take(BODY_SNIPPET).collect();
            if snippet.len() < body.len() {
                snippet.push('…');
            }
            Err(format!("webhook answered HTTP {status}: {snippet}").into())
        })
    }
}

//! The stdout sink: one JSON line per event.

use tokio::io::AsyncWriteExt;

use super::{Format, Message, Sink, SinkFuture};
use crate::event::Event;

/// Writes each event as one JSON object per line (a [`super::SinkRecord`],
/// or a CloudEvent with [`Format::Cloudevents`]) to
/// standard output, flushed before the event is acknowledged. Nothing else
/// is written to standard output. If standard output fails (the reader
/// went away: `EPIPE`; the disk is full: `ENOSPC`), it returns a
/// [`super::FatalSinkError`]: the relay stops without charging the event a
/// failure.
#[derive(Debug)]
pub struct StdoutSink {
    out: tokio::sync::Mutex<tokio::io::Stdout>,
    format: Format,
    source: String,
}

impl Default for StdoutSink {
    fn default() -> Self {
        Self::with_format(Format::Record, super::DEFAULT_CLOUDEVENTS_SOURCE)
    }
}

impl StdoutSink {
    /// A sink writing [`super::SinkRecord`] lines to this process's standard output.
    pub fn new() -> Self {
        Self::default()
    }

    /// A sink writing lines in `format`; `source` is the CloudEvents
    /// `source` attribute.
    pub fn with_format(format: Format, source: &str) -> Self {
        StdoutSink { out: tokio::sync::Mutex::new(tokio::io::stdout()), format, source: source.to_string() }
    }
}

/// Any write error on standard output (closed: `EPIPE`; full: `ENOSPC`; ...)
/// is about the sink, not the event: stop the relay rather than fail every
/// event on its way to becoming a dead letter.
fn gone(e: std::io::Error) -> crate::error::BoxError {
    let what = if e.kind() == std::io::ErrorKind::BrokenPipe {
        "standard output was closed"
    } else {
        "cannot write to standard output"
    };
    Box::new(super::FatalSinkError(format!("{what}: {e}")))
}

impl Sink for StdoutSink {
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let mut line = match self.format {
                // The record needs no headers: serialise it directly.
                Format::Record => serde_json::to_vec(&super::SinkRecord::new(event))?,
                Format::Cloudevents => Message::new(event, self.format, &self.source)?.body,
            };
            line.push(b'\n');
            // Asynchronous, so a reader that stops reading cannot block the
            // runtime: the relay's shutdown grace still runs out.
            let mut out = self.out.lock().await;
            match out.write_all(&line).await {
                Ok(()) => {}
                Err(e) => return Err(gone(e)),
            }
            match out.flush().await {
                Ok(()) => Ok(()),
                Err(e) => Err(gone(e)),
            }
        })
    }
}

use std::io::Write;
use std::sync::Mutex;

use super::{Format, Message, Sink, SinkFuture};
use crate::event::Event;

/// Writes each event as one JSON object per line (a [`super::SinkRecord`],
/// or a CloudEvent with [`Format::Cloudevents`]) to
/// standard output, flushed before the event is acknowledged. Nothing else
/// is written to standard output. If standard output is closed (the reader
/// went away: `EPIPE`), it returns a [`super::FatalSinkError`]: the relay
/// stops without charging the event a failure.
#[derive(Debug, Default)]
pub struct StdoutSink {
    lock: Mutex<()>,
    format: Format,
    source: String,
}

impl StdoutSink {
    /// A sink writing [`super::SinkRecord`] lines to this process's standard output.
    pub fn new() -> Self {
        Self::default()
    }

    /// A sink writing lines in `format`; `source` is the CloudEvents
    /// `source` attribute.
    pub fn with_format(format: Format, source: &str) -> Self {
        StdoutSink { lock: Mutex::new(()), format, source: source.to_string() }
    }
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
            let _guard = self.lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut out = std::io::stdout().lock();
            match out.write_all(&line).and_then(|()| out.flush()) {
                Ok(()) => Ok(()),
                // Nobody reads any more: stop, rather than fail every event.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                    Err(Box::new(super::FatalSinkError(format!("standard output was closed: {e}"))) as _)
                }
                Err(e) => Err(e.into()),
            }
        })
    }
}

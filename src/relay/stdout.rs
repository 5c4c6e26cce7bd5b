use std::io::Write;
use std::sync::Mutex;

use super::{Sink, SinkFuture, SinkRecord};
use crate::event::Event;

/// Writes each event as one JSON object per line ([`SinkRecord`]) to
/// standard output, flushed before the event is acknowledged. Nothing else
/// is written to standard output. If standard output is closed (the reader
/// went away: `EPIPE`), it returns a [`super::FatalSinkError`]: the relay
/// stops without charging the event a failure.
#[derive(Debug, Default)]
pub struct StdoutSink {
    lock: Mutex<()>,
}

impl StdoutSink {
    /// A sink writing to this process's standard output.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Sink for StdoutSink {
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            let mut line = serde_json::to_vec(&SinkRecord::new(event))?;
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

use std::io::Write;
use std::sync::Mutex;

use super::{Sink, SinkFuture, SinkRecord};
use crate::event::Event;

/// Writes each event as one JSON object per line ([`SinkRecord`]) to
/// standard output, flushed before the event is acknowledged. Nothing else
/// is written to standard output.
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
            out.write_all(&line)?;
            out.flush()?;
            Ok(())
        })
    }
}

//! The stdout sink: one JSON line per event.

use futures::future::BoxFuture;
use tokio::io::AsyncWriteExt;

use crate::error::Result;
use crate::event::Event;
use crate::relay::sink::delivered;
use crate::relay::{FatalSinkError, Message, SendFuture, Sink, SinkSettings};
use crate::secret::SecretUrl;

/// Writes each event as one JSON line, the message body in the relay's
/// format (a [`crate::relay::SinkRecord`], or a CloudEvent with
/// [`crate::relay::Format::Cloudevents`]), to standard output, flushed
/// before the event is acknowledged. Nothing else
/// is written to standard output. If standard output fails (the reader
/// went away: `EPIPE`; the disk is full: `ENOSPC`), it returns a
/// [`FatalSinkError`]: the relay stops without charging the event a
/// failure.
///
/// Its writes are never cut at `--sink-timeout` (a cut line would corrupt
/// the stream). At shutdown, once the grace runs out, a reader that stopped
/// reading may be left with the start of the last line: that event is
/// released, not published, and delivered whole again by the next relay.
///
/// When standard output is a pipe (`pg-outbox relay | consumer`), the sink
/// opens the pipe again through `/proc/self/fd/1` (Linux), puts its own
/// open file description (not the one the process inherited and shares with
/// its parent) in non-blocking mode, and writes through the async runtime's
/// reactor: no thread hand-off per event. Otherwise (a file, a terminal, or
/// where that reopening fails) it writes through `tokio::io::Stdout`, which
/// hands each write to a blocking thread. Either way, a reader that stops
/// reading never blocks the runtime, so the relay's shutdown grace still
/// runs out.
#[derive(Debug, Default)]
pub struct StdoutSink {
    /// `None` until the first delivery opens it (inside the runtime).
    out: tokio::sync::Mutex<Option<Out>>,
}

/// Where the lines go.
#[derive(Debug)]
enum Out {
    #[cfg(target_os = "linux")]
    Pipe(tokio::net::unix::pipe::Sender),
    Stdout(tokio::io::Stdout),
}

impl Out {
    /// Standard output as a non-blocking pipe of our own if it is a pipe,
    /// else tokio's `Stdout`.
    fn open() -> Out {
        #[cfg(target_os = "linux")]
        if let Some(pipe) = reopen_pipe() {
            return Out::Pipe(pipe);
        }
        Out::Stdout(tokio::io::stdout())
    }
}

/// Reopen standard output (fd 1) if it is a pipe or FIFO with a reader;
/// `None` otherwise, or on any error (the caller falls back).
#[cfg(target_os = "linux")]
fn reopen_pipe() -> Option<tokio::net::unix::pipe::Sender> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let fd1 = std::fs::metadata("/proc/self/fd/1").ok()?;
    if !fd1.file_type().is_fifo() {
        return None;
    }
    // O_NONBLOCK at open: with no reader left, fail (ENXIO) instead of
    // waiting for one.
    let file = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open("/proc/self/fd/1").ok()?;
    tokio::net::unix::pipe::Sender::from_file(file).ok()
}

impl StdoutSink {
    /// A sink writing to this process's standard output.
    pub fn new() -> Self {
        Self::default()
    }
}

/// Open the stdout sink (`--sink stdout`); it takes no settings.
pub(crate) fn open<'a>(_url: &'a SecretUrl, _settings: &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>> {
    Box::pin(async { Ok(Box::new(StdoutSink::new()) as Box<dyn Sink>) })
}

/// The stdout sink's flags: none (feature `cli`).
#[cfg(feature = "cli")]
#[derive(clap::Args, Debug)]
#[group(skip)]
pub(crate) struct Flags {}

#[cfg(feature = "cli")]
impl Flags {
    /// Nothing to write.
    pub(crate) fn apply(&self, _settings: &mut SinkSettings) -> Result<()> {
        Ok(())
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
    Box::new(FatalSinkError(format!("{what}: {e}")))
}

impl Sink for StdoutSink {
    fn name(&self) -> &str {
        "stdout"
    }

    /// A line cut midway would leave half a record in the stream.
    fn bounded(&self) -> bool {
        false
    }

    /// One line at a time, so the lines come out in id order: a local pipe
    /// has no round trip to hide, and a reader may rely on the order.
    fn max_in_flight(&self) -> Option<usize> {
        Some(1)
    }

    fn send<'a>(&'a self, message: &'a Message, _event: &'a Event) -> SendFuture<'a> {
        delivered(Box::pin(async move {
            let mut line = Vec::with_capacity(message.body.len() + 1);
            line.extend_from_slice(&message.body);
            line.push(b'\n');
            let mut out = self.out.lock().await;
            let written = match out.get_or_insert_with(Out::open) {
                // A pipe has no user-space buffer: written is flushed.
                #[cfg(target_os = "linux")]
                Out::Pipe(pipe) => pipe.write_all(&line).await,
                Out::Stdout(stdout) => match stdout.write_all(&line).await {
                    Ok(()) => stdout.flush().await,
                    Err(e) => Err(e),
                },
            };
            written.map_err(gone)
        }))
    }
}

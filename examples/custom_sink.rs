//! A relay with a sink of your own: implement `pg_outbox::relay::EventSink`
//! (or `Sink`, to receive the relay's encoded message too) and hand it to
//! `pg_outbox::relay::run`.
//!
//! The sink here appends each event as one JSON line (the relay's
//! `SinkRecord` format) to a file, and returns `Ok` only after the line is
//! written and synced to disk: that is the `Sink` contract, since `Ok` marks
//! the event published. Events whose payload is not the standard envelope are
//! refused with an error; the relay fails them (retry with backoff, dead
//! letter at the threshold) and goes on with other aggregates.
//!
//! Ctrl-C stops the relay: the event in hand is finished, the last
//! acknowledgements are written, and the counts are printed.
//!
//! Run it against a migrated database (the file defaults to
//! `outbox-events.jsonl`):
//!
//! ```text
//! export DATABASE_URL=postgres://postgres@127.0.0.1:5432/app
//! cargo run --features cli -- migrate
//! cargo run --features relay --example custom_sink -- /tmp/outbox-events.jsonl
//! # in another terminal:
//! cargo run --example publish_in_tx
//! ```

mod common;

use std::path::PathBuf;
use std::process::ExitCode;

use pg_outbox::relay::{EventSink, SinkFuture, SinkRecord};
use pg_outbox::{Consumer, Error, Event};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

/// Appends events as JSON lines to a file, synced before acknowledging.
#[derive(Debug)]
struct JsonLinesFile {
    /// The open file; the lock keeps lines whole.
    file: Mutex<tokio::fs::File>,
}

impl JsonLinesFile {
    /// Open `path` for appending, creating it if missing.
    async fn open(path: &std::path::Path) -> std::io::Result<Self> {
        let file = tokio::fs::OpenOptions::new().create(true).append(true).open(path).await?;
        Ok(JsonLinesFile { file: Mutex::new(file) })
    }
}

impl EventSink for JsonLinesFile {
    fn name(&self) -> &str {
        "JSON lines file"
    }

    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a> {
        Box::pin(async move {
            if event.payload.get("version").is_none() || event.payload.get("data").is_none() {
                return Err(format!("event {} is not an envelope {{version, data, metadata}}", event.id).into());
            }
            let mut line = serde_json::to_vec(&SinkRecord::new(event))?;
            line.push(b'\n');
            let mut file = self.file.lock().await;
            file.write_all(&line).await?;
            file.sync_data().await?;
            Ok(())
        })
    }
}

/// Relay events to the file until Ctrl-C.
async fn run(url: &str, path: PathBuf) -> Result<(), Error> {
    let sink = JsonLinesFile::open(&path).await?;
    let stream = Consumer::builder(pg_outbox::ConnectOptions::parse(url)?).start().await?;
    eprintln!("relaying events.outbox to {}; press Ctrl-C to stop", path.display());
    let shutdown = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            eprintln!("cannot listen for Ctrl-C ({e}); stopping");
        }
    };
    let stats = pg_outbox::relay::run(stream, &sink, shutdown).await?;
    eprintln!("stopped: {} delivered, {} refused by the sink", stats.delivered, stats.failed);
    Ok(())
}

/// Entry point: read `DATABASE_URL` (exit code 2 with a hint when it is
/// missing), run, and print any error with its causes (exit code 1).
#[tokio::main]
async fn main() -> ExitCode {
    common::init_logs("info");
    match common::database_url("custom_sink -- /tmp/outbox-events.jsonl") {
        Ok(url) => {
            let path =
                std::env::args_os().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("outbox-events.jsonl"));
            common::exit(run(&url, path).await)
        }
        Err(code) => code,
    }
}

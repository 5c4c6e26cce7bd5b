//! Consume the outbox as an async stream: acknowledge what was handled,
//! fail what was not, and shut down gracefully on Ctrl-C.
//!
//! Each delivery's payload is read as the standard envelope
//! `{version, data, metadata}`. A delivery that is handled is acknowledged
//! (`Delivery::ack`: the row is marked published); one that cannot be
//! handled (here: a payload that is not a version-1 envelope) is failed with
//! an error message (`Delivery::fail`: it is retried after the retry
//! ladder's delay, and becomes a dead letter after the 10th failure, holding
//! back later events of its aggregate meanwhile).
//!
//! Ctrl-C stops fetching through the stream's `ShutdownHandle`; the stream
//! then ends, and `EventStream::finish` writes the last acknowledgements
//! before the program exits. Nothing acknowledged is lost, and nothing
//! unacknowledged is marked published.
//!
//! Run it against a migrated database:
//!
//! ```text
//! export DATABASE_URL=postgres://postgres@127.0.0.1:5432/app
//! cargo run --features cli -- migrate
//! cargo run --example consume_stream
//! # in another terminal:
//! cargo run --example publish_in_tx
//! ```

mod common;

use std::process::ExitCode;

use futures::StreamExt;
use pg_outbox::{Consumer, Delivery, Envelope, Error};

/// Handle one delivery; an `Err` is stored as the event's `last_error`.
fn handle(delivery: &Delivery) -> Result<(), String> {
    let envelope: Envelope<serde_json::Value> = serde_json::from_value(delivery.payload.clone())
        .map_err(|e| format!("payload is not an event envelope: {e}"))?;
    if envelope.version != 1 {
        return Err(format!("unsupported envelope version {} (this consumer reads version 1)", envelope.version));
    }
    let correlation = envelope.metadata.as_ref().and_then(|m| m.correlation_id.as_deref()).unwrap_or("-");
    println!(
        "#{} {} {}/{} (attempt {}, correlation {correlation}): {}",
        delivery.id,
        delivery.event_type,
        delivery.aggregate_type,
        delivery.aggregate_id,
        delivery.retry_count + 1,
        envelope.data
    );
    Ok(())
}

/// Consume until Ctrl-C, then finish cleanly.
async fn run(url: &str) -> Result<(), Error> {
    let pg = pg_outbox::ConnectOptions::parse(url)?;
    let mut stream = Consumer::builder(pg).start().await?;
    eprintln!("consuming events.outbox; press Ctrl-C to stop");

    let shutdown = stream.shutdown_handle();
    tokio::spawn(async move {
        match tokio::signal::ctrl_c().await {
            Ok(()) => eprintln!("\nCtrl-C: finishing (writing the last acknowledgements) ..."),
            Err(e) => eprintln!("cannot listen for Ctrl-C ({e}); stopping"),
        }
        shutdown.shutdown();
    });

    let (mut acked, mut failed) = (0u64, 0u64);
    while let Some(delivery) = stream.next().await {
        match handle(&delivery) {
            Ok(()) => {
                acked += 1;
                delivery.ack();
            }
            Err(message) => {
                failed += 1;
                eprintln!("#{} failed: {message}", delivery.id);
                delivery.fail(message);
            }
        }
    }
    stream.finish().await?;
    eprintln!("stopped: {acked} acknowledged, {failed} failed");
    Ok(())
}

/// Entry point: read `DATABASE_URL` (exit code 2 with a hint when it is
/// missing), run, and print any error with its causes (exit code 1).
#[tokio::main]
async fn main() -> ExitCode {
    common::init_logs("warn");
    match common::database_url("consume_stream") {
        Ok(url) => common::exit(run(&url).await),
        Err(code) => code,
    }
}

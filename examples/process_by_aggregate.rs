//! Process an outbox concurrently with order kept per aggregate: a handler
//! of your own behind `pg_outbox::relay::run_with`, which keeps up to
//! `DeliveryOptions::max_in_flight` events in flight, at most one per
//! aggregate, acknowledges each as its handler returns `Ok`, and fails it
//! (retry with backoff, its aggregate's later events held back) on `Err`.
//!
//! The handler here stands for a call across the network: it takes 20 ms
//! per event. One at a time that is 50 events/s; with 32 in flight over
//! many aggregates, up to 1 600/s, while each aggregate's events are still
//! handled one after another in id order.
//!
//! A `Sink` (not an `EventSink`) says nothing about `max_in_flight`, so the
//! relay's setting applies; an `EventSink` is called one at a time unless
//! its `max_in_flight` says more.
//!
//! ```text
//! export DATABASE_URL=postgres://postgres@127.0.0.1:5432/app
//! cargo run --features cli -- migrate
//! cargo run --features relay --example process_by_aggregate
//! # in another terminal:
//! cargo run --example publish_in_tx
//! ```

mod common;

use std::process::ExitCode;
use std::time::Duration;

use pg_outbox::relay::{DeliveryOptions, Message, SendFuture, Sent, Sink};
use pg_outbox::{Consumer, Error, Event};

/// The work done for each event.
struct Handler;

impl Sink for Handler {
    fn name(&self) -> &str {
        "handler"
    }

    fn send<'a>(&'a self, _message: &'a Message, event: &'a Event) -> SendFuture<'a> {
        Box::pin(async move {
            // A remote call: 20 ms. Another aggregate's event may be in
            // this handler at the same time; this aggregate's next one is not.
            tokio::time::sleep(Duration::from_millis(20)).await;
            println!("{} {} {} {}", event.aggregate_type, event.aggregate_id, event.id, event.event_type);
            Ok(Sent::Delivered)
        })
    }
}

/// Process events until Ctrl-C.
async fn run(url: &str) -> Result<(), Error> {
    let stream = Consumer::builder(pg_outbox::ConnectOptions::parse(url)?).start().await?;
    let mut options = DeliveryOptions::default();
    options.max_in_flight = 32;
    eprintln!("processing events.outbox, 32 at a time, one per aggregate; press Ctrl-C to stop");
    let shutdown = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            eprintln!("cannot listen for Ctrl-C ({e}); stopping");
        }
    };
    let stats = pg_outbox::relay::run_with(stream, &Handler, &options, shutdown).await?;
    eprintln!("stopped: {} handled, {} failed", stats.delivered, stats.failed);
    Ok(())
}

/// Entry point: read `DATABASE_URL` (exit code 2 with a hint when it is
/// missing), run, and print any error with its causes (exit code 1).
#[tokio::main]
async fn main() -> ExitCode {
    common::init_logs("info");
    match common::database_url("process_by_aggregate") {
        Ok(url) => common::exit(run(&url).await),
        Err(code) => code,
    }
}

//! Publish an event in the same transaction as the domain change (the
//! publisher flow of docs/schema.md).
//!
//! The example keeps a small domain table, `billing.subscriptions`. In one
//! transaction it records a payment on a subscription and inserts a
//! `PaymentSucceeded` event whose payload is the standard envelope
//! `{version, data, metadata{causation_id, correlation_id}}`. Both become
//! visible at COMMIT, or neither does: the second transaction below is
//! rolled back and leaves no event behind.
//!
//! Run it against a migrated database:
//!
//! ```text
//! export DATABASE_URL=postgres://postgres@127.0.0.1:5432/app
//! cargo run --features cli -- migrate
//! cargo run --example publish_in_tx
//! ```
//!
//! Then watch the event arrive with `cargo run --example consume_stream`.

mod common;

use std::process::ExitCode;

use pg_outbox::tokio_postgres::Client;
use pg_outbox::{Envelope, Error, Metadata, NewEvent, Publisher};
use serde::Serialize;
use uuid::Uuid;

/// The event's data: what happened, in the domain's words.
#[derive(Debug, Serialize)]
struct PaymentSucceeded {
    /// Amount paid, in minor units.
    amount: i64,
    /// ISO 4217 currency code.
    currency: &'static str,
    /// Payments recorded on the subscription so far, this one included.
    payment_number: i32,
}

/// The example's own domain table (created if missing).
const DOMAIN_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS billing; \
    CREATE TABLE IF NOT EXISTS billing.subscriptions ( \
      id UUID PRIMARY KEY, \
      status TEXT NOT NULL DEFAULT 'pending', \
      payments INTEGER NOT NULL DEFAULT 0, \
      updated_at TIMESTAMPTZ NOT NULL DEFAULT now())";

/// Connect to `url` (TLS as its `sslmode` says); the connection is driven by
/// a spawned task.
async fn connect(url: &str) -> Result<Client, Error> {
    pg_outbox::ConnectOptions::parse(url)?.with_application_name("publish_in_tx example").connect().await
}

/// Record a payment and publish `PaymentSucceeded` atomically; returns the
/// event's outbox id.
async fn record_payment(client: &mut Client, subscription: Uuid, amount: i64, request_id: &str) -> Result<i64, Error> {
    let tx = client.transaction().await?;
    // The domain change ...
    let row = tx
        .query_one(
            "UPDATE billing.subscriptions SET status = 'active', payments = payments + 1, updated_at = now() \
             WHERE id = $1 RETURNING payments",
            &[&subscription],
        )
        .await?;
    let payment_number: i32 = row.try_get(0)?;
    // ... and its event, in the same transaction.
    let envelope = Envelope::new(1, PaymentSucceeded { amount, currency: "KRW", payment_number })
        .with_metadata(Metadata::new().correlation_id(request_id).causation_id(Uuid::new_v4().to_string()));
    let event = NewEvent::with_envelope("subscription", subscription, "PaymentSucceeded", &envelope)?;
    let id = Publisher::new().publish(&tx, &event).await?;
    tx.commit().await?;
    Ok(id)
}

/// Create a subscription, publish one event for it, and show that a
/// rolled-back transaction publishes nothing.
async fn run(url: &str) -> Result<(), Error> {
    let mut client = connect(url).await?;
    client.batch_execute(DOMAIN_SCHEMA).await?;

    let subscription = Uuid::new_v4();
    client.execute("INSERT INTO billing.subscriptions (id) VALUES ($1)", &[&subscription]).await?;

    let id = record_payment(&mut client, subscription, 9_900, "req-example-1").await?;
    println!("committed: subscription {subscription} is active, event {id} (PaymentSucceeded) is in the outbox");

    // A transaction that rolls back takes its event with it.
    {
        let tx = client.transaction().await?;
        tx.execute("UPDATE billing.subscriptions SET status = 'cancelled' WHERE id = $1", &[&subscription]).await?;
        let event = NewEvent::with_envelope(
            "subscription",
            subscription,
            "SubscriptionCancelled",
            &Envelope::new(1, serde_json::json!({"reason": "changed my mind"})),
        )?;
        let doomed = Publisher::new().publish(&tx, &event).await?;
        tx.rollback().await?;
        println!("rolled back: event {doomed} (SubscriptionCancelled) was never committed and will never be delivered");
    }

    let row = client
        .query_one(
            "SELECT count(*) FROM events.outbox WHERE aggregate_type = 'subscription' AND aggregate_id = $1",
            &[&subscription],
        )
        .await?;
    let events: i64 = row.try_get(0)?;
    println!("the outbox holds {events} event(s) for subscription {subscription}");
    Ok(())
}

/// Entry point: read `DATABASE_URL` (exit code 2 with a hint when it is
/// missing), run, and print any error with its causes (exit code 1).
#[tokio::main]
async fn main() -> ExitCode {
    match common::database_url("publish_in_tx") {
        Ok(url) => common::exit(run(&url).await),
        Err(code) => code,
    }
}

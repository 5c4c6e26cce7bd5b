//! Publishing events inside the caller's transaction.

#[cfg(feature = "sqlx")]
mod sqlx;

use tokio_postgres::GenericClient;

use crate::error::Result;
use crate::event::NewEvent;
use crate::store;

/// Inserts events into `events.outbox` through the caller's client or
/// transaction. It never commits, never spawns, and never notifies by itself:
/// the table's insert trigger (`triggers/outbox_insert_order_and_notify.sql`)
/// sends the wake-up, and only while some relay waits for one (or none has
/// registered); while every relay is busy draining, inserts send none. All
/// notifications of one transaction are identical, so PostgreSQL delivers at
/// most one per transaction, when the caller commits, however many events it
/// inserted. A rolled-back transaction leaves no event and wakes nobody.
///
/// # Example
/// ```no_run
/// # async fn run(client: &mut tokio_postgres::Client) -> Result<(), pg_outbox::Error> {
/// use pg_outbox::{Envelope, NewEvent, Publisher};
/// let sub = uuid::Uuid::new_v4();
/// let tx = client.transaction().await?;
/// tx.execute("UPDATE billing.subscriptions SET status = 'active' WHERE id = $1", &[&sub]).await?;
/// let id = Publisher::new()
///     .publish(&tx, &NewEvent::with_envelope("subscription", sub, "PaymentSucceeded",
///         &Envelope::new(1, serde_json::json!({"amount": 990})))?)
///     .await?;
/// tx.commit().await?;
/// println!("published event {id}");
/// # Ok(()) }
/// ```
///
/// From a deadpool-postgres pool: its transaction derefs to tokio-postgres'
/// `Transaction`, so pass `&*tx` (deadpool's own `GenericClient` trait is a
/// different one). Through sqlx, see `Publisher::publish_sqlx` (feature
/// `sqlx`).
/// ```no_run
/// # async fn run(pool: &deadpool_postgres::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// use pg_outbox::{NewEvent, Publisher};
/// let mut client = pool.get().await?;
/// let tx = client.transaction().await?;
/// let order = uuid::Uuid::new_v4();
/// tx.execute("INSERT INTO shop.orders (id, total) VALUES ($1, 4200)", &[&order]).await?;
/// let event = NewEvent::new("order", order, "OrderPlaced", serde_json::json!({"total": 4200}));
/// let id = Publisher::new().publish(&*tx, &event).await?;
/// tx.commit().await?;
/// println!("published event {id}");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Publisher {
    max_payload_bytes: usize,
}

impl Default for Publisher {
    fn default() -> Self {
        Publisher { max_payload_bytes: Publisher::DEFAULT_MAX_PAYLOAD_BYTES }
    }
}

impl Publisher {
    /// Default largest payload accepted: 1 MiB of JSON text, the default
    /// message limit of common brokers (Kafka `message.max.bytes`, NATS
    /// `max_payload`).
    pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

    /// A publisher with the default payload limit ([`Publisher::DEFAULT_MAX_PAYLOAD_BYTES`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Set the largest payload accepted, in bytes of JSON text (default 1 MiB).
    pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Insert one event and return its id.
    ///
    /// # Errors
    /// [`crate::Error::InvalidEvent`] before any SQL for an invalid event (see
    /// [`NewEvent::validate`]); [`crate::Error::Db`] if the INSERT fails.
    ///
    /// # Cancel safety
    /// Not cancel safe: if the future is dropped, the row may or may not have
    /// been inserted in the caller's transaction. Roll the transaction back
    /// rather than retrying blindly.
    pub async fn publish<C: GenericClient + Sync>(&self, client: &C, event: &NewEvent) -> Result<i64> {
        event.validate(self.max_payload_bytes)?;
        store::insert_event(client, event).await
    }

    /// Insert several events with one statement and return their ids, in the
    /// order of `events` (ids increase in that order). An empty slice inserts
    /// nothing and returns an empty vector. Like any transaction, it sends at
    /// most one notification, however many events (see [`Publisher`]).
    ///
    /// # Errors
    /// As [`Publisher::publish`]; nothing is inserted if any event is invalid.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`Publisher::publish`].
    pub async fn publish_many<C: GenericClient + Sync>(&self, client: &C, events: &[NewEvent]) -> Result<Vec<i64>> {
        self.validate_all(events)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        store::insert_events(client, events).await
    }

    /// Check every event of a batch before any SQL (see [`NewEvent::validate`]).
    fn validate_all(&self, events: &[NewEvent]) -> Result<()> {
        events.iter().try_for_each(|e| e.validate(self.max_payload_bytes))
    }
}

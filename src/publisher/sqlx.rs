//! Publishing through sqlx (feature `sqlx`): the same statements, checks
//! and errors as through tokio-postgres.

use ::sqlx::PgExecutor;

use super::Publisher;
use crate::error::Result;
use crate::event::NewEvent;
use crate::store::via_sqlx;

impl Publisher {
    /// Insert one event through sqlx and return its id: as
    /// [`Publisher::publish`], for applications whose transactions are
    /// sqlx's. Available with the `sqlx` feature.
    ///
    /// `executor` is any [`sqlx::PgExecutor`]: `&mut *tx` for a
    /// `sqlx::Transaction<'_, Postgres>` (the usual case: the event commits
    /// or rolls back with the caller's other writes), `&mut conn` for a
    /// `PgConnection` (inside or outside a transaction block), or `&pool`
    /// for a `PgPool`, where the INSERT runs in a transaction of its own,
    /// so it is no longer atomic with anything else.
    ///
    /// Until the transaction ends, the insert trigger's lock on the event's
    /// aggregate is held, and other publishers of that aggregate wait (as
    /// through tokio-postgres). sqlx rolls a dropped `Transaction` back only
    /// when its `PgConnection` is next used, or when a pooled connection
    /// goes back to its pool; end transactions explicitly, or use the
    /// connection again soon after dropping one.
    ///
    /// # Errors
    /// [`crate::Error::InvalidEvent`] before any SQL for an invalid event
    /// (see [`NewEvent::validate`]), so the caller's transaction stays
    /// usable; [`crate::Error::NotMigrated`] if `events.outbox` or its
    /// schema does not exist; [`crate::Error::Sqlx`] if the INSERT fails
    /// otherwise (PostgreSQL then aborts the caller's transaction, as for
    /// any failed statement).
    ///
    /// # Cancel safety
    /// Not cancel safe: if the future is dropped, the row may or may not have
    /// been inserted in the caller's transaction. Roll the transaction back
    /// rather than retrying blindly.
    ///
    /// # Example
    /// ```no_run
    /// # async fn run(pool: &sqlx::PgPool) -> Result<(), pg_outbox::Error> {
    /// use pg_outbox::{Envelope, NewEvent, Publisher};
    /// let sub = uuid::Uuid::new_v4();
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("UPDATE billing.subscriptions SET status = 'active' WHERE id = $1")
    ///     .bind(sub)
    ///     .execute(&mut *tx)
    ///     .await?;
    /// let event = NewEvent::with_envelope("subscription", sub, "PaymentSucceeded",
    ///     &Envelope::new(1, serde_json::json!({"amount": 990})))?;
    /// let id = Publisher::new().publish_sqlx(&mut *tx, &event).await?;
    /// tx.commit().await?;
    /// println!("published event {id}");
    /// # Ok(()) }
    /// ```
    pub async fn publish_sqlx<'c, E: PgExecutor<'c>>(&self, executor: E, event: &NewEvent) -> Result<i64> {
        event.validate(self.max_payload_bytes)?;
        via_sqlx::insert_event(executor, event).await
    }

    /// Insert several events through sqlx with one statement and return
    /// their ids in the order of `events`: as [`Publisher::publish_many`]
    /// (an empty slice sends nothing and returns an empty vector). The
    /// executor is taken as in [`Publisher::publish_sqlx`]. Available with
    /// the `sqlx` feature.
    ///
    /// # Errors
    /// As [`Publisher::publish_sqlx`]; nothing is inserted and no SQL is
    /// sent if any event is invalid.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`Publisher::publish_sqlx`].
    ///
    /// # Example
    /// ```no_run
    /// # async fn run(conn: &mut sqlx::PgConnection) -> Result<(), pg_outbox::Error> {
    /// use sqlx::Connection;
    /// use pg_outbox::{NewEvent, Publisher};
    /// let order = uuid::Uuid::new_v4();
    /// let events = [
    ///     NewEvent::new("order", order, "OrderPlaced", serde_json::json!({"total": 4200})),
    ///     NewEvent::new("order", order, "OrderPaid", serde_json::json!({"amount": 4200})),
    /// ];
    /// let mut tx = conn.begin().await?;
    /// let ids = Publisher::new().publish_many_sqlx(&mut *tx, &events).await?;
    /// tx.commit().await?;
    /// assert_eq!(ids.len(), 2);
    /// # Ok(()) }
    /// ```
    pub async fn publish_many_sqlx<'c, E: PgExecutor<'c>>(&self, executor: E, events: &[NewEvent]) -> Result<Vec<i64>> {
        self.validate_all(events)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        via_sqlx::insert_events(executor, events).await
    }
}

//! The reads of the operator console, `pg-outbox console`: the relays and
//! their roles, one event with its state and its aggregate's timeline, a
//! page of dead letters (keyset paging), and delivery per minute over the
//! last hour. The backlog figures are [`crate::status`]; the actions are
//! [`crate::dead_letters::retry`] and [`crate::dead_letters::discard`].
//!
//! The binary's, not an API: hidden from the docs, behind the feature
//! `console` (which `cli` turns on), and changed with any release. A binary
//! reaches only what its library makes public; the SQL stays in
//! `store/console.rs`, beside the locks and filters it shares and where the
//! plan tests run it.
//!
//! Every function only reads, through an index or the catalog views, with a
//! bound on the rows it returns.

use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::dead_letters::Filter;
use crate::error::Result;
use crate::event::Event;
use crate::store::console as store;
pub use crate::store::console::{
    DeliveryChart, EventDetail, EventState, MinuteDelivery, RelaySession, Relays, Timeline,
};

/// One event by id, or `None` when there is no such row.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn event<C: GenericClient + Sync>(client: &C, id: i64) -> Result<Option<EventDetail>> {
    let now = store::db_now(client).await?;
    store::event(client, id, now).await
}

/// The aggregate's events before and after `of` (at most `around` on each
/// side), through `outbox_aggregate_idx`, and how many later ones are
/// unpublished.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn timeline<C: GenericClient + Sync>(client: &C, of: &Event, around: i64) -> Result<Timeline> {
    let now = store::db_now(client).await?;
    store::timeline(client, of, around, now).await
}

/// Up to `limit` dead letters matching `filter` (its `limit` is ignored)
/// with ids above `after_id` (0 for the first page), in id order: a walk of
/// `outbox_dead_letter_idx` from `after_id`, as fast on the thousandth page
/// as on the first. The next page starts after the last id returned.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn dead_letter_page<C: GenericClient + Sync>(
    client: &C,
    filter: &Filter,
    after_id: i64,
    limit: i64,
) -> Result<Vec<EventDetail>> {
    let now = store::db_now(client).await?;
    store::dead_letter_page(client, filter, after_id, limit, now).await
}

/// Default bound of [`delivery_chart`]'s read: the latest 50 000 events.
pub const DEFAULT_CHART_ROWS: i64 = 50_000;

/// Events published per minute and their delivery lag
/// (`published_at - occurred_at`), over the last hour, read from the latest
/// `max_rows` events by id (a backward walk of `outbox_pkey`, so the cost is
/// bounded whatever the publish rate; see [`DeliveryChart::capped`]).
/// Retention that deleted rows removes them from the chart too.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn delivery_chart<C: GenericClient + Sync>(client: &C, max_rows: i64) -> Result<DeliveryChart> {
    let now = store::db_now(client).await?;
    store::delivery_chart(client, max_rows, now).await
}

/// The relays connected to this database, as `pg_stat_activity`,
/// `events.outbox_relays` and `pg_locks` show them: the sessions registered
/// for wake-ups, those holding pg-outbox's leader, partition or membership
/// locks, and those named as a relay names its sessions. Seeing other
/// sessions' rows in `pg_stat_activity` needs the same role or
/// `pg_read_all_stats`; sessions of other roles show with fewer details.
/// On a hot standby, none: relays run only against a primary.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn relays<C: GenericClient + Sync>(client: &C) -> Result<Relays> {
    store::relays(client).await
}

/// Bound every later statement of `client`'s session to `timeout`: sets
/// the session's `statement_timeout` (whole milliseconds, rounded up; zero
/// turns it off), over any the role, the database or the URL's `options`
/// set. What `pg-outbox console` does to its session, so that no page
/// waits on the database for long.
///
/// # Errors
/// [`crate::Error::Db`] when the server refuses the setting or the
/// session is gone.
///
/// # Cancel safety
/// Cancel safe: one statement that changes only this session's setting;
/// dropped, the setting may or may not have changed.
pub async fn set_statement_timeout<C: GenericClient + Sync>(client: &C, timeout: Duration) -> Result<()> {
    store::set_statement_timeout(client, timeout).await
}

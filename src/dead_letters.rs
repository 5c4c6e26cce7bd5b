//! Operating dead letters: list, show, retry, discard.
//!
//! A dead letter is an unpublished event whose `next_retry_at` is
//! `'infinity'`: the failure that reached the dead-letter threshold put it
//! there. It is never fetched again automatically, never deleted by
//! retention, and it holds back the later events of its aggregate.
//!
//! - [`retry`] makes dead letters due now. `retry_count` is kept (it never
//!   decreases), so a retried dead letter gets one more attempt; failing
//!   again makes it a dead letter again. Once it is delivered, its
//!   aggregate's held-back events follow, in id order.
//! - [`discard`] deletes dead letters ("removed by hand after review", as
//!   docs/schema.md has it); the later events of their aggregates are then delivered.

use tokio_postgres::GenericClient;

use crate::error::Result;
use crate::event::Event;
pub use crate::store::dead_letters::Filter;
use crate::store::dead_letters::{self as store, Action};

/// Default number of rows `list` returns: 100.
pub const DEFAULT_LIST_LIMIT: i64 = 100;

/// A dead letter as listed: the event plus when it died (its last failure is
/// in `event.last_error`).
pub type DeadLetter = Event;

/// List dead letters matching `filter`, oldest id first (default limit
/// [`DEFAULT_LIST_LIMIT`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn list<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<DeadLetter>> {
    store::list(client, filter, filter.limit.unwrap_or(DEFAULT_LIST_LIMIT)).await
}

/// How many dead letters match `filter`, ignoring its limit (to tell
/// whether a [`list`] was cut short).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn count<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<i64> {
    store::count(client, filter).await
}

/// Ids of the dead letters matching `filter` (what [`retry`] or
/// [`discard`] would touch), for a dry run.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn matching_ids<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<i64>> {
    store::matching_ids(client, filter, filter.limit.unwrap_or(i64::MAX)).await
}

/// Apply `action` (retry or discard) to the matching dead letters, locking
/// them first; wake the relays when any changed. Returns the ids, ascending.
async fn apply_to_matching<C: GenericClient + Sync>(client: &C, filter: &Filter, action: Action) -> Result<Vec<i64>> {
    store::apply(client, action, filter, filter.limit.unwrap_or(i64::MAX)).await
}

/// Make the matching dead letters due now and wake the relays. Returns the
/// ids retried. `retry_count` and `last_error` are kept.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// One statement, then a `NOTIFY` that wakes the relays. If the future is dropped,
/// the statement may or may not have run (outside a transaction it commits
/// on its own; inside the caller's, roll back to be sure); if it ran but the
/// `NOTIFY` was not sent, the relays' sweep finds the retried events within
/// one sweep interval. Running it again is harmless: it picks only what is
/// still a dead letter.
pub async fn retry<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<i64>> {
    apply_to_matching(client, filter, Action::Retry).await
}

/// Delete the matching dead letters. Returns the ids deleted. The later
/// events of their aggregates are no longer held back.
///
/// With [`Filter::subscription`] naming a subscription, its dead letters
/// are settled for it instead (the events stay). For the default
/// subscription (the seeded flow), the events are deleted from
/// `events.outbox` only when every other subscription has passed them:
/// otherwise nothing is deleted and the error names the events and the
/// subscriptions that still need them.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`];
/// [`crate::Error::Subscription`] with
/// [`crate::error::SubscriptionError::StillNeeded`] when a subscription has
/// not passed a picked event yet (nothing was deleted), or
/// [`crate::error::SubscriptionError::Unknown`] for a name that is no
/// subscription.
///
/// # Cancel safety
/// One statement, then a `NOTIFY` that wakes the relays. If the future is dropped,
/// the statement may or may not have run (outside a transaction it commits
/// on its own; inside the caller's, roll back to be sure). Running it again
/// is harmless: it picks only what is still a dead letter.
pub async fn discard<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<i64>> {
    apply_to_matching(client, filter, Action::Discard).await
}

/// Which of `ids` are in `events.outbox` at all, dead letters or not (to
/// explain ids that an operation did not touch), ascending.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn existing<C: GenericClient + Sync>(client: &C, ids: &[i64]) -> Result<Vec<i64>> {
    let mut found = store::existing(client, ids).await?;
    found.sort_unstable();
    Ok(found)
}

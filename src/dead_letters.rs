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
//! - [`discard`] deletes dead letters (the seed: "removed by hand after
//!   review"); the later events of their aggregates are then delivered.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use crate::error::Result;
use crate::event::Event;
use crate::store::{event_from_row, map_missing_schema};

/// Default number of rows `list` returns: 100.
pub const DEFAULT_LIST_LIMIT: i64 = 100;

/// Which dead letters an operation applies to. Empty fields match all;
/// set fields are combined with AND.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Filter {
    /// Only these ids.
    pub ids: Option<Vec<i64>>,
    /// Only this aggregate type (exact match).
    pub aggregate_type: Option<String>,
    /// Only this event type (exact match).
    pub event_type: Option<String>,
    /// Only events whose `last_error` contains this text (case-sensitive).
    pub error_contains: Option<String>,
    /// Only events that occurred at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// At most this many rows (default: all for retry/discard, 100 for list).
    pub limit: Option<i64>,
}

impl Filter {
    /// A filter matching every dead letter.
    pub fn all() -> Self {
        Self::default()
    }

    /// A filter matching the given ids.
    pub fn ids(ids: Vec<i64>) -> Self {
        Filter { ids: Some(ids), ..Self::default() }
    }

    /// Set [`Filter::aggregate_type`].
    pub fn aggregate_type(mut self, t: impl Into<String>) -> Self {
        self.aggregate_type = Some(t.into());
        self
    }

    /// Set [`Filter::event_type`].
    pub fn event_type(mut self, t: impl Into<String>) -> Self {
        self.event_type = Some(t.into());
        self
    }

    /// Set [`Filter::error_contains`].
    pub fn error_contains(mut self, t: impl Into<String>) -> Self {
        self.error_contains = Some(t.into());
        self
    }

    /// Set [`Filter::since`].
    pub fn since(mut self, t: DateTime<Utc>) -> Self {
        self.since = Some(t);
        self
    }

    /// Set [`Filter::limit`].
    pub fn limit(mut self, n: i64) -> Self {
        self.limit = Some(n);
        self
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 5] {
        [&self.ids, &self.aggregate_type, &self.event_type, &self.error_contains, &self.since]
    }
}

/// The WHERE clause shared by every operation; `$6` is the row limit.
/// Every statement orders by `id + 0`, the key of `outbox_dead_letter_idx`
/// (dead letters only), which no other index provides: with sorts
/// discouraged on pg-outbox's sessions ([`crate::PLANNER_SETTINGS`]) each
/// is a walk of that index, touching dead letters only, whatever the
/// statistics say (the count too: its subquery keeps the order).
const MATCHES: &str = "published_at IS NULL AND next_retry_at = 'infinity' \
     AND ($1::bigint[] IS NULL OR id = ANY($1)) \
     AND ($2::text IS NULL OR aggregate_type = $2) \
     AND ($3::text IS NULL OR event_type = $3) \
     AND ($4::text IS NULL OR strpos(coalesce(last_error, ''), $4) > 0) \
     AND ($5::timestamptz IS NULL OR occurred_at >= $5)";

/// [`list`]'s statement: `$1`..`$5` the filter, `$6` the limit.
pub(crate) fn list_sql() -> String {
    format!(
        "SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count, last_error \
         FROM events.outbox WHERE {MATCHES} ORDER BY id + 0 LIMIT $6"
    )
}

/// [`count`]'s statement: `$1`..`$5` the filter.
pub(crate) fn count_sql() -> String {
    format!("SELECT count(*) FROM (SELECT 1 FROM events.outbox WHERE {MATCHES} ORDER BY id + 0) d")
}

/// [`matching_ids`]'s statement: `$1`..`$5` the filter, `$6` the limit.
pub(crate) fn ids_sql() -> String {
    format!("SELECT id FROM events.outbox WHERE {MATCHES} ORDER BY id + 0 LIMIT $6")
}

/// [`retry`]'s action on the picked dead letters.
pub(crate) const RETRY: &str =
    "UPDATE events.outbox o SET next_retry_at = now() FROM picked WHERE o.id = picked.id RETURNING o.id";
/// [`discard`]'s action on the picked dead letters.
pub(crate) const DISCARD: &str = "DELETE FROM events.outbox o USING picked WHERE o.id = picked.id RETURNING o.id";

/// [`retry`]'s and [`discard`]'s statement around `action`: `$1`..`$5` the
/// filter, `$6` the limit.
pub(crate) fn apply_sql(action: &str) -> String {
    format!(
        "WITH picked AS (SELECT id FROM events.outbox WHERE {MATCHES} ORDER BY id + 0 LIMIT $6 FOR UPDATE), \
              done AS ({action}) \
         SELECT id FROM done ORDER BY id"
    )
}

/// A dead letter as listed: the event plus when it died (its last failure is
/// in `event.last_error`).
pub type DeadLetter = Event;

/// List dead letters matching `filter`, oldest id first (default limit
/// [`DEFAULT_LIST_LIMIT`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub async fn list<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<DeadLetter>> {
    let limit = filter.limit.unwrap_or(DEFAULT_LIST_LIMIT);
    let sql = list_sql();
    let [a, b, c, d, e] = filter.params();
    let rows = client.query(&sql, &[a, b, c, d, e, &limit]).await.map_err(map_missing_schema)?;
    rows.iter().map(event_from_row).collect()
}

/// How many dead letters match `filter`, ignoring its limit (to tell
/// whether a [`list`] was cut short).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub async fn count<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<i64> {
    let sql = count_sql();
    let row = client.query_one(&sql, &filter.params()).await.map_err(map_missing_schema)?;
    Ok(row.try_get(0)?)
}

/// Ids of the dead letters matching `filter` (what [`retry`] or
/// [`discard`] would touch), for a dry run.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub async fn matching_ids<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<i64>> {
    let limit = filter.limit.unwrap_or(i64::MAX);
    let sql = ids_sql();
    let [a, b, c, d, e] = filter.params();
    let rows = client.query(&sql, &[a, b, c, d, e, &limit]).await.map_err(map_missing_schema)?;
    rows.iter().map(|r| r.try_get(0).map_err(Into::into)).collect()
}

/// Apply `action` (an UPDATE or DELETE of `events.outbox o` joined to the
/// picked ids, returning `o.id`) to the matching dead letters, locking them
/// first; wake the relays when any changed. Returns the ids, ascending.
async fn apply_to_matching<C: GenericClient + Sync>(client: &C, filter: &Filter, action: &str) -> Result<Vec<i64>> {
    let limit = filter.limit.unwrap_or(i64::MAX);
    let sql = apply_sql(action);
    let [a, b, c, d, e] = filter.params();
    let rows = client.query(&sql, &[a, b, c, d, e, &limit]).await.map_err(map_missing_schema)?;
    if !rows.is_empty() {
        client.execute(crate::store::NOTIFY, &[&crate::NOTIFY_CHANNEL, &""]).await?;
    }
    rows.iter().map(|r| r.try_get(0).map_err(Into::into)).collect()
}

/// Make the matching dead letters due now and wake the relays. Returns the
/// ids retried. `retry_count` and `last_error` are kept.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub async fn retry<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<i64>> {
    apply_to_matching(client, filter, RETRY).await
}

/// Delete the matching dead letters. Returns the ids deleted. The later
/// events of their aggregates are no longer held back.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub async fn discard<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<Vec<i64>> {
    apply_to_matching(client, filter, DISCARD).await
}

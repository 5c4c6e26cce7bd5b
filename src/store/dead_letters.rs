//! The operators' statements on dead letters ([`crate::dead_letters`]),
//! and one function per operation that runs them.

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::subscription_dead_letters as sub;
use super::{event_from_row, map_missing_schema, query_map, row_id};
use crate::error::{Result, SubscriptionError};
use crate::event::Event;
use chrono::{DateTime, Utc};

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
    /// Whose dead letters: the subscription of this name
    /// (`pg_outbox::subscription`), whose failure rows
    /// (`events.outbox_subscription_failures` with `next_retry_at =
    /// 'infinity'`) are its dead letters; `None` or `default` for the
    /// seeded flow (`events.outbox`'s own columns). With a subscription,
    /// `retry_count` and `last_error` (and the filter's error text) are the
    /// subscription's, retry makes its failure rows due now (the count
    /// kept), and discard settles the events for it (deletes its failure
    /// rows, as an acknowledgement does: the event stays in
    /// `events.outbox`). A name that is no subscription is
    /// [`crate::error::SubscriptionError::Unknown`].
    pub subscription: Option<String>,
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

    /// Set [`Filter::subscription`].
    pub fn subscription(mut self, name: impl Into<String>) -> Self {
        self.subscription = Some(name.into());
        self
    }

    /// The subscription named, unless it is the default (the seeded flow).
    fn named_subscription(&self) -> Option<&str> {
        self.subscription.as_deref().filter(|s| *s != super::subscription_admin::DEFAULT_NAME)
    }
}

/// The WHERE clause shared by every operation; `$6` is the row limit.
/// Every statement orders by `id + 0`, the key of `outbox_dead_letter_idx`
/// (dead letters only), which no other index provides: with sorts
/// discouraged on pg-outbox's sessions ([`crate::connect::PLANNER_SETTINGS`]) each
/// is a walk of that index, touching dead letters only, whatever the
/// statistics say (the count too: its subquery keeps the order).
pub(super) const MATCHES: &str = "published_at IS NULL AND next_retry_at = 'infinity' \
     AND ($1::bigint[] IS NULL OR id = ANY($1)) \
     AND ($2::text IS NULL OR aggregate_type = $2) \
     AND ($3::text IS NULL OR event_type = $3) \
     AND ($4::text IS NULL OR strpos(coalesce(last_error, ''), $4) > 0) \
     AND ($5::timestamptz IS NULL OR occurred_at >= $5)";

/// [`MATCHES`] for a filter that names ids: each named id is one lookup in
/// `outbox_pkey`, and the rest of the filter is checked on those rows only,
/// so an operator acting on a few ids touches a few rows however many dead
/// letters there are (walking `outbox_dead_letter_idx` instead, as
/// [`MATCHES`] does, touched 12 000 buffers with 50 000 dead letters).
/// Ordered by `id`, the key of that index scan.
pub(super) const MATCHES_BY_ID: &str = "id = ANY($1::bigint[]) \
     AND published_at IS NULL AND next_retry_at = 'infinity' \
     AND ($2::text IS NULL OR aggregate_type = $2) \
     AND ($3::text IS NULL OR event_type = $3) \
     AND ($4::text IS NULL OR strpos(coalesce(last_error, ''), $4) > 0) \
     AND ($5::timestamptz IS NULL OR occurred_at >= $5)";

/// Which rows a statement starts from: every dead letter (a walk of
/// `outbox_dead_letter_idx`, [`MATCHES`]), or the ids the filter names
/// (lookups in `outbox_pkey`, [`MATCHES_BY_ID`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Walk {
    /// Every dead letter, the filter's ids (if any) checked on each.
    DeadLetters,
    /// The ids of `$1`, which must not be NULL.
    Ids,
}

impl Walk {
    /// The walk a filter needs.
    pub(crate) fn of(filter: &Filter) -> Self {
        if filter.ids.is_some() { Walk::Ids } else { Walk::DeadLetters }
    }

    /// The `WHERE` condition and the `ORDER BY` key.
    fn parts(self) -> (&'static str, &'static str) {
        match self {
            Walk::DeadLetters => (MATCHES, "id + 0"),
            Walk::Ids => (MATCHES_BY_ID, "id"),
        }
    }
}

/// `list`'s statement: `$1`..`$5` the filter, `$6` the limit.
pub(crate) fn list_sql(walk: Walk) -> String {
    let (matches, order) = walk.parts();
    format!(concat!("SELECT ", event_columns!(), " FROM events.outbox WHERE {} ORDER BY {} LIMIT $6"), matches, order)
}

/// `count`'s statement: `$1`..`$5` the filter.
pub(crate) fn count_sql(walk: Walk) -> String {
    let (matches, order) = walk.parts();
    format!("SELECT count(*) FROM (SELECT 1 FROM events.outbox WHERE {matches} ORDER BY {order}) d")
}

/// `matching_ids`'s statement: `$1`..`$5` the filter, `$6` the limit.
pub(crate) fn ids_sql(walk: Walk) -> String {
    let (matches, order) = walk.parts();
    format!("SELECT id FROM events.outbox WHERE {matches} ORDER BY {order} LIMIT $6")
}

/// `retry`'s action on the picked dead letters.
pub(crate) const RETRY: &str =
    "UPDATE events.outbox o SET next_retry_at = now() FROM picked WHERE o.id = picked.id RETURNING o.id";
/// `discard`'s action on the picked dead letters.
pub(crate) const DISCARD: &str = "DELETE FROM events.outbox o USING picked WHERE o.id = picked.id RETURNING o.id";

/// `retry`'s and `discard`'s statement around `action`: `$1`..`$5` the
/// filter, `$6` the limit.
pub(crate) fn apply_sql(walk: Walk, action: &str) -> String {
    let (matches, order) = walk.parts();
    format!(
        "WITH picked AS (SELECT id FROM events.outbox WHERE {matches} ORDER BY {order} LIMIT $6 FOR UPDATE), \
              done AS ({action}) \
         SELECT id FROM done ORDER BY id"
    )
}

/// `discard`'s statement on a schema with subscriptions (migration 0016):
/// [`apply_sql`] with [`DISCARD`], but the rows are deleted only when every
/// subscription but an expired one has passed each picked event: it is at or below the
/// subscription's cursor with no failure row of it (a retry, a held event,
/// a dead letter), or among the ids it settled above the cursor. Otherwise
/// nothing is deleted, and the statement returns the picked events some
/// subscription still needs (`needed_by`, its name) instead: deleting them
/// would lose them for it. The subscriptions' rows are read `FOR SHARE`, so
/// a rewind that commits meanwhile is waited for and seen. Returns `id` and
/// `needed_by` (NULL for a deleted row), by id. `$1`..`$5` the filter,
/// `$6` the limit.
pub(crate) fn discard_subscribed_sql(walk: Walk) -> String {
    let (matches, order) = walk.parts();
    format!(
        "WITH picked AS (SELECT id FROM events.outbox WHERE {matches} ORDER BY {order} LIMIT $6 FOR UPDATE), \
              subs AS MATERIALIZED (SELECT name, cursor_id, settled FROM events.outbox_subscriptions \
                                    WHERE state <> 'expired' FOR SHARE), \
              needed AS MATERIALIZED ( \
                SELECT p.id, s.name FROM picked p CROSS JOIN subs s \
                WHERE NOT (p.id = ANY (s.settled) \
                           OR (p.id <= s.cursor_id \
                               AND (SELECT 1 FROM events.outbox_subscription_failures f \
                                    WHERE f.subscription = s.name AND f.id = p.id) IS NULL))), \
              done AS (DELETE FROM events.outbox o USING picked \
                       WHERE o.id = picked.id AND (SELECT count(*) FROM needed) = 0 RETURNING o.id) \
         SELECT id, NULL::text AS needed_by FROM done \
         UNION ALL SELECT id, name FROM needed ORDER BY 1, 2"
    )
}

/// Which of the ids $1 (`bigint[]`) are in `events.outbox` at all, dead
/// letters or not: lookups in `outbox_pkey`, to explain ids an operator
/// named that are not dead letters.
pub(crate) const EXISTING_IDS: &str = "SELECT id FROM events.outbox WHERE id = ANY($1::bigint[])";

/// `filter`'s fields as the parameters `$1`..`$5` of [`MATCHES`]: ids,
/// aggregate type, event type, error text, since (each NULL for any). Its
/// `limit` is not among them.
pub(super) fn filter_params(filter: &Filter) -> [&(dyn ToSql + Sync); 5] {
    [&filter.ids, &filter.aggregate_type, &filter.event_type, &filter.error_contains, &filter.since]
}

/// [`filter_params`] and the row limit `$6`.
fn limited<'a>(filter: &'a Filter, limit: &'a i64) -> [&'a (dyn ToSql + Sync); 6] {
    let [a, b, c, d, e] = filter_params(filter);
    [a, b, c, d, e, limit]
}

/// The dead letters matching `filter` (its `limit` ignored), lowest id
/// first, at most `limit` of them ([`list_sql`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`] (a row that cannot
/// be read as an event too).
pub(crate) async fn list<C: GenericClient + Sync>(client: &C, filter: &Filter, limit: i64) -> Result<Vec<Event>> {
    if let Some(name) = filter.named_subscription() {
        return sub::dead_letters_list(client, name, filter_params(filter), limit).await;
    }
    query_map(client, &list_sql(Walk::of(filter)), &limited(filter, &limit), event_from_row).await
}

/// How many dead letters match `filter`, ignoring its limit ([`count_sql`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn count<C: GenericClient + Sync>(client: &C, filter: &Filter) -> Result<i64> {
    if let Some(name) = filter.named_subscription() {
        return sub::dead_letters_count(client, name, filter_params(filter)).await;
    }
    let sql = count_sql(Walk::of(filter));
    let row = client.query_one(&sql, &filter_params(filter)).await.map_err(map_missing_schema)?;
    Ok(row.try_get("count")?)
}

/// The ids of the dead letters matching `filter` (its `limit` ignored),
/// ascending, at most `limit` of them ([`ids_sql`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn matching_ids<C: GenericClient + Sync>(client: &C, filter: &Filter, limit: i64) -> Result<Vec<i64>> {
    if let Some(name) = filter.named_subscription() {
        return sub::dead_letters_ids(client, name, filter_params(filter), limit).await;
    }
    query_map(client, &ids_sql(Walk::of(filter)), &limited(filter, &limit), row_id).await
}

/// What [`apply`] does to the dead letters it picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Make them due now ([`RETRY`]).
    Retry,
    /// Delete them ([`DISCARD`]).
    Discard,
}

/// Lock the dead letters matching `filter` (its `limit` ignored), at most
/// `limit` of them in id order, and apply `action` to them in one statement
/// ([`apply_sql`]); then, when it changed any, wake the relays (a
/// notification on [`super::NOTIFY_CHANNEL`]). Returns the ids it changed,
/// ascending.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`]; [`crate::Error::Db`]
/// too when the wake-up cannot be sent (the change stands).
pub(crate) async fn apply<C: GenericClient + Sync>(
    client: &C,
    action: Action,
    filter: &Filter,
    limit: i64,
) -> Result<Vec<i64>> {
    if let Some(name) = filter.named_subscription() {
        return sub::dead_letters_apply(client, name, filter_params(filter), limit, action == Action::Discard).await;
    }
    if action == Action::Discard && super::retention::subscribers(client).await?.present {
        return discard_subscribed(client, filter, limit).await;
    }
    let sql = apply_sql(
        Walk::of(filter),
        match action {
            Action::Retry => RETRY,
            Action::Discard => DISCARD,
        },
    );
    let ids = query_map(client, &sql, &limited(filter, &limit), row_id).await?;
    if !ids.is_empty() {
        super::wakeup::notify(client, super::NOTIFY_CHANNEL, "").await?;
    }
    Ok(ids)
}

/// The default subscription's discard on a schema with subscriptions
/// ([`discard_subscribed_sql`]): the deleted ids, ascending; or, when a
/// subscription has not passed a picked event yet, nothing deleted and
/// [`SubscriptionError::StillNeeded`].
async fn discard_subscribed<C: GenericClient + Sync>(client: &C, filter: &Filter, limit: i64) -> Result<Vec<i64>> {
    let rows = query_map(client, &discard_subscribed_sql(Walk::of(filter)), &limited(filter, &limit), |r| {
        Ok((r.try_get::<_, i64>("id")?, r.try_get::<_, Option<String>>("needed_by")?))
    })
    .await?;
    let (mut ids, mut subscriptions) = (Vec::new(), Vec::new());
    for (id, by) in &rows {
        if let Some(by) = by {
            ids.push(*id);
            subscriptions.push(by.clone());
        }
    }
    if !ids.is_empty() {
        ids.dedup();
        subscriptions.sort_unstable();
        subscriptions.dedup();
        return Err(SubscriptionError::StillNeeded { ids, subscriptions }.into());
    }
    let ids: Vec<i64> = rows.into_iter().map(|(id, _)| id).collect();
    if !ids.is_empty() {
        super::wakeup::notify(client, super::NOTIFY_CHANNEL, "").await?;
    }
    Ok(ids)
}

/// Which of `ids` are in `events.outbox` at all, dead letters or not
/// ([`EXISTING_IDS`]), in no particular order.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn existing<C: GenericClient + Sync>(client: &C, ids: &[i64]) -> Result<Vec<i64>> {
    query_map(client, EXISTING_IDS, &[&ids], row_id).await
}

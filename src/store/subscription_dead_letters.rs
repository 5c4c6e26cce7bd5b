//! A subscription's dead letters: the events of its failure rows with
//! `next_retry_at = 'infinity'` (`crate::dead_letters` with a subscription
//! named), listed, counted, retried and discarded for it alone.

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::subscription_admin::require;
use super::{event_from_row, map_missing_schema, query_map, row_id};
use crate::error::Result;
use crate::event::Event;

/// A subscription's dead letters, the events of its failure rows with
/// `next_retry_at = 'infinity'`: `$1 text` the subscription, then the
/// dead-letter filter (`super::dead_letters::Filter`): `$2 bigint[]` ids,
/// `$3 text` aggregate type, `$4 text` event type, `$5 text` error text
/// (in the failure row's `last_error`), `$6 timestamptz` occurred since,
/// each NULL for any. A walk of the failures' primary key `(subscription,
/// id)` (lookups in it when ids are named), each joined to its event by
/// `outbox_pkey`; ordered by that key's id.
const SUB_DEAD: &str = "events.outbox_subscription_failures f JOIN events.outbox o ON o.id = f.id \
     WHERE f.subscription = $1 AND f.next_retry_at = 'infinity' \
       AND ($2::bigint[] IS NULL OR f.id = ANY($2)) \
       AND ($3::text IS NULL OR o.aggregate_type = $3) \
       AND ($4::text IS NULL OR o.event_type = $4) \
       AND ($5::text IS NULL OR strpos(coalesce(f.last_error, ''), $5) > 0) \
       AND ($6::timestamptz IS NULL OR o.occurred_at >= $6)";

/// The dead letters of `$1` matching the filter, lowest id first, at most
/// `$7`, as events whose `retry_count` and `last_error` are the
/// subscription's.
pub(crate) fn dead_letters_list_sql() -> String {
    format!(
        "SELECT o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.occurred_at, \
                f.retry_count, f.last_error FROM {SUB_DEAD} ORDER BY f.id LIMIT $7"
    )
}

/// How many dead letters of `$1` match the filter (`count`).
pub(crate) fn dead_letters_count_sql() -> String {
    format!("SELECT count(*) AS count FROM (SELECT 1 FROM {SUB_DEAD}) d")
}

/// The ids of the dead letters of `$1` matching the filter, ascending, at
/// most `$7`.
pub(crate) fn dead_letters_ids_sql() -> String {
    format!("SELECT f.id AS id FROM {SUB_DEAD} ORDER BY f.id LIMIT $7")
}

/// Make the dead letters of `$1` matching the filter (at most `$7`, locked
/// first) due now; `retry_count` stays. Returns their ids, ascending.
pub(crate) fn dead_letters_retry_sql() -> String {
    format!(
        "WITH picked AS (SELECT f.id FROM {SUB_DEAD} ORDER BY f.id LIMIT $7 FOR UPDATE OF f), \
              done AS (UPDATE events.outbox_subscription_failures u SET next_retry_at = now() FROM picked \
                       WHERE u.subscription = $1 AND u.id = picked.id RETURNING u.id) \
         SELECT id FROM done ORDER BY id"
    )
}

/// Settle the dead letters of `$1` matching the filter (at most `$7`,
/// locked first) as if delivered: `events.outbox_subscription_ack` deletes
/// their failure rows, makes the held events of each of their
/// aggregates due, and counts those above the cursor as settled. Returns
/// their ids, ascending.
pub(crate) fn dead_letters_discard_sql() -> String {
    format!(
        "WITH picked AS MATERIALIZED (SELECT f.id FROM {SUB_DEAD} ORDER BY f.id LIMIT $7 FOR UPDATE OF f), \
              settled AS MATERIALIZED ( \
                SELECT count(*) AS n FROM events.outbox_subscription_ack($1, ARRAY(SELECT p.id FROM picked p), true, NULL, NULL)) \
         SELECT p.id FROM picked p, settled s WHERE s.n >= 0 ORDER BY p.id"
    )
}

/// The dead letters of `subscription` matching `filter`, at most `limit`.
///
/// # Errors
/// [`SubscriptionError::Unknown`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
pub(crate) async fn dead_letters_list<C: GenericClient + Sync>(
    client: &C,
    subscription: &str,
    filter: [&(dyn ToSql + Sync); 5],
    limit: i64,
) -> Result<Vec<Event>> {
    require(client, subscription).await?;
    let [a, b, c, d, e] = filter;
    query_map(client, &dead_letters_list_sql(), &[&subscription, a, b, c, d, e, &limit], event_from_row).await
}

/// How many dead letters of `subscription` match `filter`.
///
/// # Errors
/// As [`dead_letters_list`].
pub(crate) async fn dead_letters_count<C: GenericClient + Sync>(
    client: &C,
    subscription: &str,
    filter: [&(dyn ToSql + Sync); 5],
) -> Result<i64> {
    require(client, subscription).await?;
    let [a, b, c, d, e] = filter;
    let row = client
        .query_one(&dead_letters_count_sql(), &[&subscription, a, b, c, d, e])
        .await
        .map_err(map_missing_schema)?;
    Ok(row.try_get("count")?)
}

/// The ids of the dead letters of `subscription` matching `filter`, at
/// most `limit`.
///
/// # Errors
/// As [`dead_letters_list`].
pub(crate) async fn dead_letters_ids<C: GenericClient + Sync>(
    client: &C,
    subscription: &str,
    filter: [&(dyn ToSql + Sync); 5],
    limit: i64,
) -> Result<Vec<i64>> {
    require(client, subscription).await?;
    let [a, b, c, d, e] = filter;
    query_map(client, &dead_letters_ids_sql(), &[&subscription, a, b, c, d, e, &limit], row_id).await
}

/// Retry (`discard` false) or settle (`discard` true) the dead letters of
/// `subscription` matching `filter`, at most `limit`; wake the relays when
/// any changed. Returns the ids, ascending.
///
/// # Errors
/// As [`dead_letters_list`]; [`crate::Error::Db`] too when the wake-up
/// cannot be sent (the change stands).
pub(crate) async fn dead_letters_apply<C: GenericClient + Sync>(
    client: &C,
    subscription: &str,
    filter: [&(dyn ToSql + Sync); 5],
    limit: i64,
    discard: bool,
) -> Result<Vec<i64>> {
    require(client, subscription).await?;
    let sql = if discard { dead_letters_discard_sql() } else { dead_letters_retry_sql() };
    let [a, b, c, d, e] = filter;
    let ids = query_map(client, &sql, &[&subscription, a, b, c, d, e, &limit], row_id).await?;
    if !ids.is_empty() {
        super::wakeup::notify(client, super::NOTIFY_CHANNEL, "").await?;
    }
    Ok(ids)
}

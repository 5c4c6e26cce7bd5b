//! Retention's statements ([`crate::retention`]), and one function per
//! operation that runs them. Each goes as one round trip on the unnamed
//! statement (`query_typed`), so it holds no server session between its
//! parse and its execution (a transaction-mode pooler).

use std::time::Duration;

use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use super::map_missing_schema;
use crate::error::Result;

/// The condition that every subscription (`events.outbox_subscriptions`,
/// active or paused: a paused one must not lose events; not an expired
/// one, which the operator let go) has passed event
/// `o`: its id is at or below the lowest cursor, and no subscription has a
/// failure row for it (waiting for a retry, held back, or a dead letter).
/// The lowest cursor and the subscriptions' names are init plans, read
/// once per statement; the failure probe runs only on the rows the other
/// conditions keep, one lookup in the failures' primary key
/// `(subscription, id)` per subscription (none when there is none). A
/// macro, so that `concat!` builds constant statements from it.
macro_rules! subscribed {
    () => {
        "AND o.id <= coalesce((SELECT min(s.cursor_id) FROM events.outbox_subscriptions s \
                                WHERE s.state <> 'expired'), 9223372036854775807) \
         AND (SELECT 1 FROM events.outbox_subscription_failures f \
              WHERE f.subscription = ANY (ARRAY(SELECT s.name FROM events.outbox_subscriptions s \
                                                WHERE s.state <> 'expired')) \
                AND f.id = o.id LIMIT 1) IS NULL"
    };
}

/// Delete one batch: walk the next $2 rows by id above $3, up to id $4
/// (the run's end, [`WALK_END`]), and delete those of them that are due:
/// published longer ago than $1 seconds, and passed by every subscription
/// (`subscribed!`). Returns how many it walked
/// (`walked`), the highest id walked (`last_id`) and how many it deleted
/// (`deleted`). The next batch starts after `last_id`, so a run walks
/// `outbox_pkey` once, never passing again the index entries of the rows
/// earlier batches deleted (they stay until VACUUM), and no statement
/// walks more than one batch: rows published later than their neighbours
/// (retried, held back, dead letters retried by an operator) and the young
/// rows after the last due one cost a batch each, not one long scan at the
/// end of the run. A row skipped because another session had it locked is
/// left for the next run.
pub(crate) const DELETE_BATCH: &str = concat!(
    "WITH walked AS MATERIALIZED ( \
       SELECT id FROM events.outbox WHERE id > $3 AND id <= $4 ORDER BY id LIMIT $2), \
     doomed AS MATERIALIZED ( \
       SELECT o.id FROM events.outbox o \
       WHERE o.id > $3 AND o.id <= (SELECT max(id) FROM walked) \
         AND o.published_at IS NOT NULL AND o.published_at < now() - make_interval(secs => $1) ",
    subscribed!(),
    " ORDER BY o.id FOR UPDATE SKIP LOCKED), \
     gone AS (DELETE FROM events.outbox o USING doomed WHERE o.id = doomed.id RETURNING o.id) \
     SELECT count(*) AS walked, max(id) AS last_id, (SELECT count(*) FROM gone) AS deleted FROM walked"
);

/// [`DELETE_BATCH`] on a schema before migration 0016, which has no
/// subscriptions.
pub(crate) const DELETE_BATCH_UNSUBSCRIBED: &str = "WITH walked AS MATERIALIZED ( \
       SELECT id FROM events.outbox WHERE id > $3 AND id <= $4 ORDER BY id LIMIT $2), \
     doomed AS MATERIALIZED ( \
       SELECT id FROM events.outbox \
       WHERE id > $3 AND id <= (SELECT max(id) FROM walked) \
         AND published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1) \
       ORDER BY id FOR UPDATE SKIP LOCKED), \
     gone AS (DELETE FROM events.outbox o USING doomed WHERE o.id = doomed.id RETURNING o.id) \
     SELECT count(*) AS walked, max(id) AS last_id, (SELECT count(*) FROM gone) AS deleted FROM walked";

/// Where a run with age $1 (seconds) walks to, read when it starts:
/// `last_id`, the highest id in the table (NULL when it is empty), and
/// `marked`, the `last_id` of the oldest earlier run's mark taken at least
/// an hour after the cutoff and not after now (NULL when there is none):
/// every row with a higher id committed after that mark was taken
/// (migrations/0014_outbox_retention_marks.sql). Records this run's mark
/// (the highest id and the time), drops marks dated after now (a clock
/// that was ahead), and keeps the newest 10 000.
pub(crate) const WALK_END: &str = "WITH top AS (SELECT max(id) AS last_id FROM events.outbox), \
     mark AS (INSERT INTO events.outbox_retention_marks (taken_at, last_id) \
       SELECT now(), top.last_id FROM top WHERE top.last_id IS NOT NULL \
       ON CONFLICT (taken_at) DO NOTHING RETURNING 1), \
     pruned AS (DELETE FROM events.outbox_retention_marks \
       WHERE taken_at > now() \
          OR taken_at < (SELECT m.taken_at FROM events.outbox_retention_marks m \
                         ORDER BY m.taken_at DESC OFFSET 9999 LIMIT 1) RETURNING 1) \
     SELECT top.last_id, \
       (SELECT m.last_id FROM events.outbox_retention_marks m \
        WHERE m.taken_at >= now() - make_interval(secs => $1) + interval '1 hour' AND m.taken_at <= now() \
        ORDER BY m.taken_at LIMIT 1) AS marked \
     FROM top";

/// The highest id in the table (`last_id`, NULL when it is empty): a
/// run's end when the marks cannot be read or written.
pub(crate) const LAST_ID: &str = "SELECT max(id) AS last_id FROM events.outbox";

/// How many rows a run with age $1 (seconds) would delete (`due`): those
/// published longer ago and passed by every subscription (`subscribed!`).
pub(crate) const COUNT_DUE: &str = concat!(
    "SELECT count(*) AS due FROM events.outbox o \
     WHERE o.published_at IS NOT NULL AND o.published_at < now() - make_interval(secs => $1) ",
    subscribed!()
);

/// [`COUNT_DUE`] on a schema before migration 0016.
pub(crate) const COUNT_DUE_UNSUBSCRIBED: &str = "SELECT count(*) AS due FROM events.outbox \
     WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1)";

/// Whether `events.outbox_subscriptions` exists (`present`: a schema from
/// migration 0016 on).
pub(crate) const HAS_SUBSCRIPTIONS: &str = "SELECT to_regclass('events.outbox_subscriptions') IS NOT NULL AS present";
/// The lowest cursor of the subscriptions (`floor`, NULL when there is
/// none): no event above it can be deleted.
pub(crate) const LOWEST_CURSOR: &str =
    "SELECT min(cursor_id) AS floor FROM events.outbox_subscriptions WHERE state <> 'expired'";

/// What retention must wait for: whether the schema has subscriptions at
/// all, and the lowest cursor among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Subscribers {
    /// `events.outbox_subscriptions` exists (migration 0016).
    pub(crate) present: bool,
    /// The lowest cursor, when there is a subscription.
    pub(crate) floor: Option<i64>,
}

/// Read [`Subscribers`] ([`HAS_SUBSCRIPTIONS`], [`LOWEST_CURSOR`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`] (a role that may
/// not read `events.outbox_subscriptions` too: retention never guesses).
pub(crate) async fn subscribers<C: GenericClient + Sync>(client: &C) -> Result<Subscribers> {
    let present: bool =
        client.query_typed_one(HAS_SUBSCRIPTIONS, &[]).await.map_err(map_missing_schema)?.try_get("present")?;
    if !present {
        return Ok(Subscribers { present, floor: None });
    }
    let floor: Option<i64> =
        client.query_typed_one(LOWEST_CURSOR, &[]).await.map_err(map_missing_schema)?.try_get("floor")?;
    Ok(Subscribers { present, floor })
}

/// One batch for [`delete_batch`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Batch {
    /// Delete only rows published longer ago than this (by the database's
    /// clock; sent as seconds).
    pub(crate) older_than: Duration,
    /// Walk at most this many rows.
    pub(crate) size: i64,
    /// Only ids above this one.
    pub(crate) after_id: i64,
    /// Only ids up to this one: the run's end ([`walk_end`]).
    pub(crate) end_id: i64,
    /// The schema has subscriptions ([`Subscribers::present`]): run
    /// [`DELETE_BATCH`], else [`DELETE_BATCH_UNSUBSCRIBED`].
    pub(crate) subscriptions: bool,
}

/// What [`delete_batch`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Deleted {
    /// Rows it walked.
    pub(crate) walked: i64,
    /// The highest id it walked; `None` when it walked none.
    pub(crate) last_id: Option<i64>,
    /// Rows it deleted.
    pub(crate) rows: i64,
}

/// Delete one batch ([`DELETE_BATCH`], or [`DELETE_BATCH_UNSUBSCRIBED`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn delete_batch<C: GenericClient + Sync>(client: &C, b: &Batch) -> Result<Deleted> {
    let secs = b.older_than.as_secs_f64();
    let row = client
        .query_typed_one(
            if b.subscriptions { DELETE_BATCH } else { DELETE_BATCH_UNSUBSCRIBED },
            &[(&secs, Type::FLOAT8), (&b.size, Type::INT8), (&b.after_id, Type::INT8), (&b.end_id, Type::INT8)],
        )
        .await
        .map_err(map_missing_schema)?;
    Ok(Deleted { walked: row.try_get("walked")?, last_id: row.try_get("last_id")?, rows: row.try_get("deleted")? })
}

/// Where a run walks to ([`WALK_END`]): the highest id in the table, or
/// an earlier run's mark when that is lower; `None` when the table is
/// empty. Records this run's mark. Without the marks table (a schema
/// before migration 0014) or the privileges on it, walks to the highest id
/// ([`LAST_ID`]) and says why in `unmarked`.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn walk_end<C: GenericClient + Sync>(client: &C, older_than: Duration) -> Result<Option<WalkEnd>> {
    let secs = older_than.as_secs_f64();
    let row = match client.query_typed_one(WALK_END, &[(&secs, Type::FLOAT8)]).await {
        Ok(row) => row,
        Err(e) => {
            let code = e.as_db_error().map(|d| d.code().clone());
            if code != Some(SqlState::UNDEFINED_TABLE) && code != Some(SqlState::INSUFFICIENT_PRIVILEGE) {
                return Err(map_missing_schema(e));
            }
            let why = crate::error::report(&e);
            let row = client.query_typed_one(LAST_ID, &[]).await.map_err(map_missing_schema)?;
            let last: Option<i64> = row.try_get("last_id")?;
            return Ok(last.map(|id| WalkEnd { id, marked: false, unmarked: Some(why) }));
        }
    };
    let last: Option<i64> = row.try_get("last_id")?;
    let marked: Option<i64> = row.try_get("marked")?;
    Ok(last.map(|last| match marked {
        Some(m) if m < last => WalkEnd { id: m, marked: true, unmarked: None },
        _ => WalkEnd { id: last, marked: false, unmarked: None },
    }))
}

/// The last id a run walks, from [`walk_end`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WalkEnd {
    /// The id.
    pub(crate) id: i64,
    /// It is an earlier run's mark, below the highest id in the table.
    pub(crate) marked: bool,
    /// Why the marks could not be read or written (the error), if so.
    pub(crate) unmarked: Option<String>,
}

/// How many published rows are older than `older_than` (by the database's
/// clock; sent as seconds) and passed by every subscription: what a run
/// would delete ([`COUNT_DUE`], or [`COUNT_DUE_UNSUBSCRIBED`] on a schema
/// before migration 0016).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn count_due<C: GenericClient + Sync>(client: &C, older_than: Duration) -> Result<i64> {
    let secs = older_than.as_secs_f64();
    let sql = if subscribers(client).await?.present { COUNT_DUE } else { COUNT_DUE_UNSUBSCRIBED };
    let row = client.query_typed_one(sql, &[(&secs, Type::FLOAT8)]).await.map_err(map_missing_schema)?;
    Ok(row.try_get("due")?)
}

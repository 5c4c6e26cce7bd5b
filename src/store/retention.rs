//! Retention's statements ([`crate::retention`]), and one function per
//! operation that runs them. Each goes as one round trip on the unnamed
//! statement (`query_typed`), so it holds no server session between its
//! parse and its execution (a transaction-mode pooler).

use std::time::Duration;

use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use super::map_missing_schema;
use crate::error::Result;

/// Delete one batch: walk the next $2 rows by id above $3, up to id $4
/// (the highest id when the run started), and delete those of them that
/// were published longer ago than $1 seconds; returns how many it walked
/// (`walked`), the highest id walked (`last_id`) and how many it deleted
/// (`deleted`). The next batch starts after `last_id`, so a run walks
/// `outbox_pkey` once, never passing again the index entries of the rows
/// earlier batches deleted (they stay until VACUUM), and no statement
/// walks more than one batch: rows published later than their neighbours
/// (retried, held back, dead letters retried by an operator) and the young
/// rows after the last due one cost a batch each, not one long scan at the
/// end of the run. A row skipped because another session had it locked is
/// left for the next run.
pub(crate) const DELETE_BATCH: &str = "WITH walked AS MATERIALIZED ( \
       SELECT id FROM events.outbox WHERE id > $3 AND id <= $4 ORDER BY id LIMIT $2), \
     doomed AS MATERIALIZED ( \
       SELECT id FROM events.outbox \
       WHERE id > $3 AND id <= (SELECT max(id) FROM walked) \
         AND published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1) \
       ORDER BY id FOR UPDATE SKIP LOCKED), \
     gone AS (DELETE FROM events.outbox o USING doomed WHERE o.id = doomed.id RETURNING o.id) \
     SELECT count(*) AS walked, max(id) AS last_id, (SELECT count(*) FROM gone) AS deleted FROM walked";

/// The highest id in the table (`last_id`, NULL when it is empty): where a
/// run's walk ends. Rows with higher ids were given their ids after the run
/// started, so they were published after it too.
pub(crate) const LAST_ID: &str = "SELECT max(id) AS last_id FROM events.outbox";

/// How many rows a run with age $1 (seconds) would delete (`due`).
pub(crate) const COUNT_DUE: &str = "SELECT count(*) AS due FROM events.outbox \
     WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1)";

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
    /// Only ids up to this one: the run's end ([`last_id`]).
    pub(crate) end_id: i64,
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

/// Delete one batch ([`DELETE_BATCH`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn delete_batch<C: GenericClient + Sync>(client: &C, b: &Batch) -> Result<Deleted> {
    let secs = b.older_than.as_secs_f64();
    let row = client
        .query_typed_one(
            DELETE_BATCH,
            &[(&secs, Type::FLOAT8), (&b.size, Type::INT8), (&b.after_id, Type::INT8), (&b.end_id, Type::INT8)],
        )
        .await
        .map_err(map_missing_schema)?;
    Ok(Deleted { walked: row.try_get("walked")?, last_id: row.try_get("last_id")?, rows: row.try_get("deleted")? })
}

/// The highest id in the table, `None` when it is empty ([`LAST_ID`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn last_id<C: GenericClient + Sync>(client: &C) -> Result<Option<i64>> {
    let row = client.query_typed_one(LAST_ID, &[]).await.map_err(map_missing_schema)?;
    Ok(row.try_get("last_id")?)
}

/// How many published rows are older than `older_than` (by the database's
/// clock; sent as seconds): what a run would delete ([`COUNT_DUE`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn count_due<C: GenericClient + Sync>(client: &C, older_than: Duration) -> Result<i64> {
    let secs = older_than.as_secs_f64();
    let row = client.query_typed_one(COUNT_DUE, &[(&secs, Type::FLOAT8)]).await.map_err(map_missing_schema)?;
    Ok(row.try_get("due")?)
}

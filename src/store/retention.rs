//! Retention's statements ([`crate::retention`]), and one function per
//! operation that runs them. Each goes as one round trip on the unnamed
//! statement (`query_typed`), so it holds no server session between its
//! parse and its execution (a transaction-mode pooler).

use std::time::Duration;

use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use super::map_missing_schema;
use crate::error::Result;

/// Delete one batch: up to $2 published rows older than $1 seconds with ids
/// above $3, lowest ids first; returns how many it deleted (`deleted`) and
/// the highest id it deleted (`last_id`). The next batch starts after that
/// id, so a run walks `outbox_pkey` once instead of passing, in every
/// batch, the index entries of the rows earlier batches deleted (they stay
/// until VACUUM) and the unpublished rows and dead letters at the low end
/// of the ids. A row skipped because another session had it locked is left
/// for the next run.
pub(crate) const DELETE_BATCH: &str = "WITH doomed AS MATERIALIZED ( \
       SELECT id FROM events.outbox \
       WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1) AND id > $3 \
       ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED), \
     gone AS (DELETE FROM events.outbox o USING doomed WHERE o.id = doomed.id RETURNING o.id) \
     SELECT count(*) AS deleted, max(id) AS last_id FROM gone";

/// How many rows a run with age $1 (seconds) would delete (`due`).
pub(crate) const COUNT_DUE: &str = "SELECT count(*) AS due FROM events.outbox \
     WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1)";

/// One batch for [`delete_batch`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Batch {
    /// Delete only rows published longer ago than this (by the database's
    /// clock; sent as seconds).
    pub(crate) older_than: Duration,
    /// At most this many rows.
    pub(crate) size: i64,
    /// Only ids above this one.
    pub(crate) after_id: i64,
}

/// What [`delete_batch`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Deleted {
    /// Rows it deleted.
    pub(crate) rows: i64,
    /// The highest id it deleted; `None` when it deleted none.
    pub(crate) last_id: Option<i64>,
}

/// Delete one batch ([`DELETE_BATCH`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn delete_batch<C: GenericClient + Sync>(client: &C, b: &Batch) -> Result<Deleted> {
    let secs = b.older_than.as_secs_f64();
    let row = client
        .query_typed_one(DELETE_BATCH, &[(&secs, Type::FLOAT8), (&b.size, Type::INT8), (&b.after_id, Type::INT8)])
        .await
        .map_err(map_missing_schema)?;
    Ok(Deleted { rows: row.try_get("deleted")?, last_id: row.try_get("last_id")? })
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

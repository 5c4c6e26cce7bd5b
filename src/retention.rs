//! Retention: delete published events older than a cutoff, in bounded
//! batches (the seed's ArchiveOldOutboxEvents, made safe for a large, busy
//! table).
//!
//! - Only rows with `published_at IS NOT NULL AND published_at < now() -
//!   older_than` are deleted: never an unpublished event, never a dead
//!   letter (dead letters are unpublished). The cutoff uses the database's
//!   clock.
//! - Batches of `batch_size` rows (default 1000), picked in id order through
//!   the primary key with `FOR UPDATE SKIP LOCKED` inside a materialised CTE
//!   (so the planner cannot re-run the LIMIT subquery and delete more than
//!   a batch), with a pause between batches (default 100 ms) so it never
//!   holds long locks, keeps WAL and vacuum steady, and leaves room for
//!   producers.
//! - One runner at a time: a session advisory lock; a second concurrent run
//!   returns at once with `skipped = true`.

use std::time::Duration;

use tokio_postgres::Client;

use crate::error::Result;
use crate::store::map_missing_schema;

/// The seed's retention: published events older than 30 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// Default rows deleted per statement: 1000.
pub const DEFAULT_RETENTION_BATCH: i64 = 1000;
/// Default pause between batches: 100 ms.
pub const DEFAULT_RETENTION_PAUSE: Duration = Duration::from_millis(100);

const RETENTION_LOCK_KEY: i64 = 0x7067_6f75_7400_0002;

const DELETE_BATCH: &str = "WITH doomed AS MATERIALIZED ( \
       SELECT id FROM events.outbox \
       WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1) \
       ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED) \
     DELETE FROM events.outbox o USING doomed WHERE o.id = doomed.id";

const COUNT_DUE: &str = "SELECT count(*) FROM events.outbox \
     WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1)";

/// Settings of a retention run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retention {
    /// Delete published events older than this (default 30 days).
    pub older_than: Duration,
    /// Rows per DELETE (default 1000).
    pub batch_size: i64,
    /// Pause between batches (default 100 ms).
    pub pause: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { older_than: DEFAULT_RETENTION, batch_size: DEFAULT_RETENTION_BATCH, pause: DEFAULT_RETENTION_PAUSE }
    }
}

/// What a retention run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RetentionReport {
    /// Rows deleted (or, in a dry run, that would be).
    pub deleted: i64,
    /// DELETE statements run.
    pub batches: i64,
    /// Another run held the retention lock; nothing was done.
    pub skipped: bool,
}

/// Count what a run would delete, without deleting.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub async fn dry_run(client: &Client, r: &Retention) -> Result<RetentionReport> {
    let secs = r.older_than.as_secs_f64();
    let n: i64 = client.query_one(COUNT_DUE, &[&secs]).await.map_err(map_missing_schema)?.try_get(0)?;
    Ok(RetentionReport { deleted: n, batches: 0, skipped: false })
}

/// Delete published events older than `r.older_than`, batch by batch,
/// until a batch finds fewer rows than its size. Records
/// `outbox_retention_deleted_total` and `outbox_retention_last_run_timestamp_seconds`.
///
/// Must run outside a transaction (each batch commits on its own).
///
/// # Errors
/// [`crate::Error::Config`] for a batch size below 1;
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`]. Batches already
/// deleted stay deleted.
pub async fn run(client: &Client, r: &Retention) -> Result<RetentionReport> {
    if r.batch_size < 1 {
        return Err(crate::Error::Config(format!("retention batch size must be at least 1, got {}", r.batch_size)));
    }
    let got: bool = client.query_one(crate::store::TRY_LEADER_LOCK, &[&RETENTION_LOCK_KEY]).await?.try_get(0)?;
    if !got {
        return Ok(RetentionReport { skipped: true, ..RetentionReport::default() });
    }
    let result = delete_batches(client, r).await;
    client.execute("SELECT pg_advisory_unlock($1)", &[&RETENTION_LOCK_KEY]).await?;
    let report = result?;
    metrics::gauge!(crate::metrics::RETENTION_LAST_RUN)
        .set(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()));
    Ok(report)
}

async fn delete_batches(client: &Client, r: &Retention) -> Result<RetentionReport> {
    let secs = r.older_than.as_secs_f64();
    let mut report = RetentionReport::default();
    loop {
        let n = client.execute(DELETE_BATCH, &[&secs, &r.batch_size]).await.map_err(map_missing_schema)?;
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        report.deleted += n;
        report.batches += 1;
        metrics::counter!(crate::metrics::RETENTION_DELETED).increment(u64::try_from(n).unwrap_or(0));
        if n < r.batch_size {
            return Ok(report);
        }
        tokio::time::sleep(r.pause).await;
    }
}

//! Retention: delete published events older than a cutoff, in bounded
//! batches (the schema's original ArchiveOldOutboxEvents, docs/schema.md,
//! made safe for a large, busy table).
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
//! - One runner at a time: a session advisory lock, on a session of the
//!   run's own; a second concurrent run returns at once with
//!   `skipped = true`. Dropping a run's future closes its session, so no
//!   lock outlives the run on any connection.
//! - Through a transaction-mode pooler
//!   ([`ConnectOptions::session_mode`]), where a session lock would stay
//!   behind on a server session that other clients get, each batch is a
//!   transaction that takes the same lock at transaction level: one batch
//!   of one runner at a time, and a run that finds the lock taken (another
//!   run's batch, or a direct runner's whole run) stops there, `skipped`
//!   when it had deleted nothing.

use std::time::Duration;

use tokio_postgres::Client;

use crate::connect::{self, ConnectOptions, SessionMode, SessionSettings};
use crate::error::Result;
use crate::store::locks::{self, RunLock};
use crate::store::retention::{self as store, Batch};

/// The schema's original retention: published events older than 30 days
/// (docs/schema.md, "Retention and dead letters").
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// Default rows deleted per statement: 1000.
pub const DEFAULT_RETENTION_BATCH: i64 = 1000;
/// Default pause between batches: 100 ms.
pub const DEFAULT_RETENTION_PAUSE: Duration = Duration::from_millis(100);

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

/// Count what a run would delete, without deleting (one `SELECT count(*)`
/// over the published rows older than the cutoff).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn dry_run(client: &Client, r: &Retention) -> Result<RetentionReport> {
    let n = store::count_due(client, r.older_than).await?;
    Ok(RetentionReport { deleted: n, batches: 0, skipped: false })
}

/// Delete published events older than `r.older_than`, batch by batch,
/// until a batch finds fewer rows than its size, on a database session of
/// its own (application name `pg-outbox retention`), which it closes before
/// returning. Records `outbox_retention_deleted_total` (per batch),
/// `outbox_retention_last_run_timestamp_seconds` (after a successful run)
/// and `outbox_retention_errors_total` (when a batch fails).
///
/// A run that finds another run holding the retention lock returns at once
/// with [`RetentionReport::skipped`] set and nothing deleted.
///
/// # Errors
/// [`crate::Error::Config`] for a batch size below 1; a connection error if
/// the session cannot be opened ([`crate::Error::ReadOnlyStandby`] for a
/// hot standby: deleting needs the primary); [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`]. Batches already deleted stay deleted.
///
/// # Cancel safety
/// Dropping the future closes its session, which releases the lock (once a
/// batch still running in the server ends); batches already deleted stay
/// deleted and the next run goes on from the oldest remaining row.
///
/// # Example
/// ```no_run
/// # async fn run() -> Result<(), pg_outbox::Error> {
/// use pg_outbox::retention::{self, Retention};
/// let pg = pg_outbox::ConnectOptions::parse("postgres://app@db.internal/app")?;
/// let report = retention::run(&pg, &Retention::default()).await?;
/// println!("deleted {} events in {} batches", report.deleted, report.batches);
/// # Ok(()) }
/// ```
pub async fn run(pg: &ConnectOptions, r: &Retention) -> Result<RetentionReport> {
    if r.batch_size < 1 {
        return Err(crate::Error::Config(format!("retention batch size must be at least 1, got {}", r.batch_size)));
    }
    let opened = async {
        let shared = matches!(pg.session_mode().await?, SessionMode::Shared { .. });
        Ok::<_, crate::Error>((shared, connect::connect(pg, "pg-outbox retention", &SessionSettings::primary()).await?))
    };
    let (shared, (client, _link)) = match opened.await {
        Ok(c) => c,
        Err(e) => {
            metrics::counter!(crate::metrics::RETENTION_ERRORS).increment(1);
            return Err(e);
        }
    };
    let report = if shared {
        let result = delete_locked_batches(&client, r).await;
        if result.is_err() {
            metrics::counter!(crate::metrics::RETENTION_ERRORS).increment(1);
        }
        result?
    } else {
        if !locks::try_lock(&client, RunLock::Retention).await? {
            return Ok(RetentionReport { skipped: true, ..RetentionReport::default() });
        }
        let result = delete_batches(&client, r).await;
        let unlocked = locks::unlock(&client, RunLock::Retention).await;
        if result.is_err() || unlocked.is_err() {
            metrics::counter!(crate::metrics::RETENTION_ERRORS).increment(1);
        }
        unlocked?;
        result?
    };
    if report.skipped {
        return Ok(report);
    }
    metrics::gauge!(crate::metrics::RETENTION_LAST_RUN)
        .set(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()));
    Ok(report)
}

async fn delete_batches(client: &Client, r: &Retention) -> Result<RetentionReport> {
    let mut report = RetentionReport::default();
    let mut batch = Batch { older_than: r.older_than, size: r.batch_size, after_id: 0 };
    loop {
        let deleted = store::delete_batch(client, &batch).await?;
        if !counted(&mut report, &mut batch, &deleted, r) {
            return Ok(report);
        }
        tokio::time::sleep(r.pause).await;
    }
}

/// Count a deleted batch in `report` and move `batch` past it; whether a
/// full batch came back, so another may follow.
fn counted(report: &mut RetentionReport, batch: &mut Batch, deleted: &store::Deleted, r: &Retention) -> bool {
    let n = deleted.rows;
    if let Some(last) = deleted.last_id {
        batch.after_id = last;
    }
    report.deleted += n;
    report.batches += 1;
    metrics::counter!(crate::metrics::RETENTION_DELETED).increment(u64::try_from(n).unwrap_or(0));
    n >= r.batch_size
}

/// [`delete_batches`] through a transaction-mode pooler: each batch a
/// transaction that first takes the retention lock at transaction level;
/// the run stops at a batch that cannot take it (`skipped` when none ran).
async fn delete_locked_batches(client: &Client, r: &Retention) -> Result<RetentionReport> {
    let mut report = RetentionReport::default();
    let mut batch = Batch { older_than: r.older_than, size: r.batch_size, after_id: 0 };
    loop {
        client.batch_execute("BEGIN").await?;
        let locked = async {
            if !locks::try_xact_lock(client, RunLock::Retention).await? {
                return Ok(None);
            }
            store::delete_batch(client, &batch).await.map(Some)
        };
        let deleted = match locked.await {
            Ok(Some(deleted)) => {
                client.batch_execute("COMMIT").await?;
                deleted
            }
            Ok(None) => {
                client.batch_execute("ROLLBACK").await?;
                if report.batches == 0 {
                    report.skipped = true;
                } else {
                    tracing::info!(
                        batches = report.batches,
                        deleted = report.deleted,
                        "retention: another run holds the retention lock; this run stops here"
                    );
                }
                return Ok(report);
            }
            Err(e) => {
                let _ = client.batch_execute("ROLLBACK").await;
                return Err(e);
            }
        };
        if !counted(&mut report, &mut batch, &deleted, r) {
            return Ok(report);
        }
        tokio::time::sleep(r.pause).await;
    }
}

/// When a daily run at `hour`:00 UTC comes next after `now`: today at that
/// hour if it is still ahead, else tomorrow (a run is never scheduled for
/// `now` itself). An `hour` above 23 is taken as 23.
///
/// # Example
/// ```
/// use chrono::{TimeZone, Utc};
/// let now = Utc.with_ymd_and_hms(2026, 1, 31, 2, 59, 59).unwrap();
/// let next = pg_outbox::retention::next_daily_run(now, 3);
/// assert_eq!(next, Utc.with_ymd_and_hms(2026, 1, 31, 3, 0, 0).unwrap());
/// ```
pub fn next_daily_run(now: chrono::DateTime<chrono::Utc>, hour: u32) -> chrono::DateTime<chrono::Utc> {
    let at = chrono::NaiveTime::from_hms_opt(hour.min(23), 0, 0).unwrap_or(chrono::NaiveTime::MIN);
    let today = now.date_naive().and_time(at).and_utc();
    if today > now { today } else { today + chrono::Duration::days(1) }
}

#[cfg(test)]
mod tests {
    use chrono::{TimeZone, Utc};

    use super::next_daily_run;

    fn t(d: u32, h: u32, m: u32, s: u32) -> chrono::DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 2, d, h, m, s).single().expect("valid time")
    }

    #[test]
    fn next_daily_run_is_today_if_ahead_else_tomorrow() {
        assert_eq!(next_daily_run(t(10, 1, 0, 0), 3), t(10, 3, 0, 0), "later today");
        assert_eq!(next_daily_run(t(10, 3, 0, 0), 3), t(11, 3, 0, 0), "exactly at the hour: tomorrow");
        assert_eq!(next_daily_run(t(10, 3, 0, 1), 3), t(11, 3, 0, 0), "just after: tomorrow");
        assert_eq!(next_daily_run(t(10, 23, 59, 59), 0), t(11, 0, 0, 0), "midnight");
        assert_eq!(next_daily_run(t(28, 12, 0, 0), 3), Utc.with_ymd_and_hms(2026, 3, 1, 3, 0, 0).unwrap(), "month end");
        assert_eq!(next_daily_run(t(10, 22, 0, 0), 99), t(10, 23, 0, 0), "hour clamped to 23");
        // Always strictly ahead and at most a day away.
        for h in 0..24 {
            let now = t(15, h, 30, 0);
            for at in 0..24 {
                let next = next_daily_run(now, at);
                assert!(next > now && next - now <= chrono::Duration::days(1), "{now} {at} -> {next}");
            }
        }
    }
}

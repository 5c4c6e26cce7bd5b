//! Retention: delete published events older than a cutoff, in bounded
//! batches (the schema's original ArchiveOldOutboxEvents, docs/schema.md,
//! made safe for a large, busy table).
//!
//! - Only rows with `published_at IS NOT NULL AND published_at < now() -
//!   older_than` are deleted: never an unpublished event, never a dead
//!   letter (dead letters are unpublished). The cutoff uses the database's
//!   clock.
//! - One walk of `outbox_pkey` in id order, from the lowest id to the
//!   highest one when the run started, or to an earlier run's mark: each
//!   run records the highest id and the time when it starts; every row
//!   with a higher id committed after that time, and a row is published
//!   after it commits, so a run with cutoff C walks only up to the mark of
//!   the oldest run that started at least an hour after C (and not after
//!   now). Daily runs of a 30-day retention walk about two days of rows,
//!   not thirty. The exceptions (a `published_at` written earlier than
//!   its row's commit by over an hour) are deleted late, not never: in
//!   docs/operations.md, "Retention". In batches: each batch walks the
//!   next rows by id (at most its size) and deletes those of them that are
//!   due, with `FOR UPDATE SKIP LOCKED` inside a materialised CTE (so the
//!   planner cannot re-run the subquery and delete more than a batch).
//!   No statement walks more than its batch: not the young rows after the
//!   last due one (a run that stopped at the first short batch would walk
//!   them all in one statement to find nothing), nor a stretch of rows
//!   published late. A pause between batches keeps locks short, WAL and
//!   vacuum steady, and leaves room for producers.
//! - Paced by what the server shows: each batch's own time. The batch size
//!   follows the rows per second the last batch walked, so a batch takes
//!   about `batch_time` (default 5 ms; the first batch 1 000 rows, then
//!   from 100 rows up to `batch_size`, default 10 000), and the pause after
//!   a batch is at least
//!   `(1 - max_share) / max_share` times the batch's time (default share
//!   0.05: nineteen times it) and at least `pause` (default 100 ms). A loaded
//!   server makes batches slower, so the run slows with it and its share of
//!   the server's time stays under `max_share`. `batch_time` zero turns the
//!   pacing off: batches of `batch_size`, `pause` apart.
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
/// Default largest batch, in rows: 10 000.
pub const DEFAULT_RETENTION_BATCH: i64 = 10_000;
/// The first batch of a paced run, in rows (or `batch_size`, if smaller):
/// 1 000.
pub const FIRST_RETENTION_BATCH: i64 = 1_000;
/// The smallest batch a paced run shrinks to, in rows: 100.
pub const MIN_RETENTION_BATCH: i64 = 100;
/// Default shortest pause between batches: 100 ms.
pub const DEFAULT_RETENTION_PAUSE: Duration = Duration::from_millis(100);
/// Default time a paced batch aims at: 5 ms. Short batches keep each
/// burst of WAL and CPU short, which is what producers' slowest inserts
/// feel: in the `history` bench, 20 ms batches at a fifth of the time
/// raised producers' p99 insert latency 2.5x, 5 ms batches at a twentieth
/// 1.08x (docs/performance.md).
pub const DEFAULT_RETENTION_BATCH_TIME: Duration = Duration::from_millis(5);
/// Default most share of wall time a paced run spends in batches: 0.05.
pub const DEFAULT_RETENTION_MAX_SHARE: f64 = 0.05;

/// Settings of a retention run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retention {
    /// Delete published events older than this (default 30 days).
    pub older_than: Duration,
    /// Rows walked per DELETE: the largest batch of a paced run, every batch's
    /// size when `batch_time` is zero (default 10 000).
    pub batch_size: i64,
    /// The shortest pause between batches (default 100 ms).
    pub pause: Duration,
    /// The time a batch aims at: the next batch's size is the rows per
    /// second the last walked times this, at most doubling or halving
    /// at a time, from [`MIN_RETENTION_BATCH`] to `batch_size` (default
    /// 5 ms). Zero: no pacing, every batch `batch_size` rows.
    pub batch_time: Duration,
    /// The most share of wall time spent in batches, above 0 and at most 1:
    /// the pause after a batch is at least `(1 - max_share) / max_share`
    /// times its time (default 0.05).
    pub max_share: f64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            older_than: DEFAULT_RETENTION,
            batch_size: DEFAULT_RETENTION_BATCH,
            pause: DEFAULT_RETENTION_PAUSE,
            batch_time: DEFAULT_RETENTION_BATCH_TIME,
            max_share: DEFAULT_RETENTION_MAX_SHARE,
        }
    }
}

/// A run's pace: the size of its next batch and the pause after each,
/// from the batches' own times ([`Retention`]).
#[derive(Debug, Clone, Copy)]
struct Pace {
    size: i64,
}

impl Pace {
    fn new(r: &Retention) -> Pace {
        let size = if r.batch_time.is_zero() { r.batch_size } else { FIRST_RETENTION_BATCH.min(r.batch_size) };
        Pace { size }
    }

    /// After a batch of `rows` that took `took`: the pause to take, and
    /// the next batch's size.
    fn after(&mut self, r: &Retention, rows: i64, took: Duration) -> Duration {
        if r.batch_time.is_zero() {
            return r.pause;
        }
        let took_s = took.as_secs_f64().max(1e-4);
        if rows > 0 {
            let want = rows as f64 * r.batch_time.as_secs_f64() / took_s;
            let next = want.clamp(self.size as f64 / 2.0, self.size as f64 * 2.0);
            self.size = (next.round() as i64).clamp(MIN_RETENTION_BATCH.min(r.batch_size), r.batch_size);
        }
        // `run` refuses a share outside (0, 1]; the floor only keeps the
        // division finite.
        let share = r.max_share.clamp(1e-6, 1.0);
        r.pause.max(took.mul_f64((1.0 - share) / share))
    }
}

/// What a retention run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct RetentionReport {
    /// Rows deleted (or, in a dry run, that would be).
    pub deleted: i64,
    /// Rows walked: every row a batch looked at, deleted or not (0 in a
    /// dry run).
    pub walked: i64,
    /// The last id the run walks to (0 when the table was empty): the
    /// highest id when it started, or an earlier run's mark.
    pub walk_end_id: i64,
    /// [`RetentionReport::walk_end_id`] is the highest id at an earlier
    /// run's start, taken at least an hour after the cutoff: every row
    /// above it committed after that run started
    /// (migrations/0014_outbox_retention_marks.sql).
    pub walk_end_marked: bool,
    /// [`RetentionReport::walk_end_id`] is the lowest cursor of the
    /// subscriptions (`crate::subscription`), below the table's highest id
    /// and any mark: no event above it can be deleted until that
    /// subscription passes it.
    pub walk_end_subscription: bool,
    /// Batches (DELETE statements) run.
    pub batches: i64,
    /// Another run held the retention lock; nothing was done.
    pub skipped: bool,
    /// The smallest and the largest batch the run asked for, in rows
    /// walked (0 when it ran none).
    pub smallest_batch: i64,
    /// See [`RetentionReport::smallest_batch`].
    pub largest_batch: i64,
    /// Seconds spent in batches.
    pub busy_seconds: f64,
    /// Seconds spent pausing between them.
    pub paused_seconds: f64,
}

/// Count what a run would delete, without deleting (one `SELECT count(*)`
/// over the published rows older than the cutoff that every subscription
/// has passed).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn dry_run(client: &Client, r: &Retention) -> Result<RetentionReport> {
    let n = store::count_due(client, r.older_than).await?;
    Ok(RetentionReport { deleted: n, ..Default::default() })
}

/// Delete published events older than `r.older_than`, batch by batch,
/// walking the table up to its end (the module docs), on a database session of
/// its own (application name `pg-outbox retention`), which it closes before
/// returning. Records `outbox_retention_deleted_total` (per batch),
/// `outbox_retention_last_run_timestamp_seconds` (after a successful run)
/// and `outbox_retention_errors_total` (when a batch fails).
///
/// A run that finds another run holding the retention lock returns at once
/// with [`RetentionReport::skipped`] set and nothing deleted.
///
/// # Errors
/// [`crate::Error::Config`] for a batch size below 1 or a max share not in
/// (0, 1]; a connection error if
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
        return Err(crate::error::Error::Config(format!(
            "retention batch size must be at least 1, got {}",
            r.batch_size
        )));
    }
    if !(r.max_share > 0.0 && r.max_share <= 1.0) {
        return Err(crate::error::Error::Config(format!(
            "retention max share must be above 0 and at most 1, got {}",
            r.max_share
        )));
    }
    let opened = async {
        let shared = matches!(pg.session_mode().await?, SessionMode::Shared { .. });
        Ok::<_, crate::error::Error>((
            shared,
            connect::connect(pg, "pg-outbox retention", &SessionSettings::primary()).await?,
        ))
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
    let Some((mut report, mut pace, mut batch)) = start_walk(client, r).await? else {
        return Ok(RetentionReport::default());
    };
    loop {
        let started = std::time::Instant::now();
        let deleted = store::delete_batch(client, &batch).await?;
        if !counted(&mut report, &mut batch, &deleted, started.elapsed()) {
            return Ok(report);
        }
        pause(&mut report, &mut pace, &mut batch, r, deleted.walked, started.elapsed()).await;
    }
}

/// A run's start: where its walk ends ([`store::walk_end`], which records
/// the run's mark), its report so far, its pace and its first batch;
/// `None` when the table is empty. Warns when the marks cannot be used.
async fn start_walk(client: &Client, r: &Retention) -> Result<Option<(RetentionReport, Pace, Batch)>> {
    let subscribers = store::subscribers(client).await?;
    let Some(mut end) = store::walk_end(client, r.older_than).await? else {
        return Ok(None);
    };
    // No event above the lowest cursor can be deleted: the walk ends there.
    let mut by_subscription = false;
    if let Some(floor) = subscribers.floor
        && floor < end.id
    {
        end.id = floor;
        end.marked = false;
        by_subscription = true;
    }
    if let Some(why) = &end.unmarked {
        tracing::warn!(
            error = %why,
            "retention: events.outbox_retention_marks cannot be used ({why}); this run walks to the highest id. \
             Run `pg-outbox migrate` (migration 0014) and grant the retention role SELECT, INSERT, DELETE on it"
        );
    }
    let report = RetentionReport {
        walk_end_id: end.id,
        walk_end_marked: end.marked,
        walk_end_subscription: by_subscription,
        ..RetentionReport::default()
    };
    let pace = Pace::new(r);
    // Every id, including any a producer gave at or below zero.
    let batch = Batch {
        older_than: r.older_than,
        size: pace.size,
        after_id: i64::MIN,
        end_id: end.id,
        subscriptions: subscribers.present,
    };
    Ok(Some((report, pace, batch)))
}

/// Count a batch, which took `took`, in `report` and move `batch` past
/// the rows it walked; whether it walked a whole batch short of the run's
/// end, so another may follow.
fn counted(report: &mut RetentionReport, batch: &mut Batch, deleted: &store::Deleted, took: Duration) -> bool {
    let n = deleted.rows;
    if let Some(last) = deleted.last_id {
        batch.after_id = last;
    }
    report.deleted += n;
    report.walked += deleted.walked;
    report.batches += 1;
    report.busy_seconds += took.as_secs_f64();
    report.smallest_batch = if report.batches == 1 { batch.size } else { report.smallest_batch.min(batch.size) };
    report.largest_batch = report.largest_batch.max(batch.size);
    metrics::counter!(crate::metrics::RETENTION_DELETED).increment(u64::try_from(n).unwrap_or(0));
    deleted.walked >= batch.size && batch.after_id < batch.end_id
}

/// The pause after a batch of `rows` that took `took`, and the next
/// batch's size ([`Pace`]).
async fn pause(
    report: &mut RetentionReport,
    pace: &mut Pace,
    batch: &mut Batch,
    r: &Retention,
    rows: i64,
    took: Duration,
) {
    let wait = pace.after(r, rows, took);
    batch.size = pace.size;
    tracing::debug!(
        rows,
        took_ms = took.as_secs_f64() * 1e3,
        next = pace.size,
        pause_ms = wait.as_secs_f64() * 1e3,
        "retention: batch"
    );
    report.paused_seconds += wait.as_secs_f64();
    tokio::time::sleep(wait).await;
}

/// [`delete_batches`] through a transaction-mode pooler: each batch a
/// transaction that first takes the retention lock at transaction level;
/// the run stops at a batch that cannot take it (`skipped` when none ran).
async fn delete_locked_batches(client: &Client, r: &Retention) -> Result<RetentionReport> {
    let Some((mut report, mut pace, mut batch)) = start_walk(client, r).await? else {
        return Ok(RetentionReport::default());
    };
    loop {
        let started = std::time::Instant::now();
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
        if !counted(&mut report, &mut batch, &deleted, started.elapsed()) {
            return Ok(report);
        }
        pause(&mut report, &mut pace, &mut batch, r, deleted.walked, started.elapsed()).await;
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
    use std::time::Duration;

    use chrono::{TimeZone, Utc};

    use super::{Pace, Retention, next_daily_run};

    #[test]
    fn a_paced_run_sizes_batches_from_their_time_and_pauses_for_its_share() {
        let r = Retention { batch_time: Duration::from_millis(20), max_share: 0.2, ..Retention::default() };
        let mut pace = Pace::new(&r);
        assert_eq!(pace.size, super::FIRST_RETENTION_BATCH);
        // 1 000 rows in 5 ms: 20 ms would take 4 000, but a step at most doubles.
        let wait = pace.after(&r, 1000, Duration::from_millis(5));
        assert_eq!(pace.size, 2000);
        assert_eq!(wait, r.pause, "a quick batch pauses the shortest pause");
        // 2 000 rows in 80 ms: 20 ms takes 500, but a step at most halves.
        let wait = pace.after(&r, 2000, Duration::from_millis(80));
        assert_eq!(pace.size, 1000);
        assert_eq!(wait, Duration::from_millis(320), "at most a fifth of the time in batches");
        // Growth stops at the largest batch, shrinking at the smallest.
        for _ in 0..20 {
            pace.after(&r, pace.size, Duration::from_millis(1));
        }
        assert_eq!(pace.size, r.batch_size);
        for _ in 0..20 {
            pace.after(&r, pace.size, Duration::from_secs(1));
        }
        assert_eq!(pace.size, super::MIN_RETENTION_BATCH);
        // No pacing: the fixed size and pause.
        let fixed = Retention { batch_time: Duration::ZERO, batch_size: 7, ..Retention::default() };
        let mut pace = Pace::new(&fixed);
        assert_eq!(pace.size, 7);
        assert_eq!(pace.after(&fixed, 7, Duration::from_secs(3)), fixed.pause);
        assert_eq!(pace.size, 7);
    }

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

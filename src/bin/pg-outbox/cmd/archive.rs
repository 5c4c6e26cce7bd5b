//! `pg-outbox archive`: delete published events older than a cutoff.

use std::time::Duration;

use crate::db::connect;
use crate::error::Error;
use crate::parse::{parse_duration, parse_duration_or_zero};

#[derive(clap::Args, Debug)]
pub(crate) struct ArchiveArgs {
    /// Delete published events older than this (default 30 days, docs/schema.md),
    /// once every subscription has passed them.
    #[arg(long, value_parser = parse_duration, default_value = "30d")]
    older_than: Duration,
    /// The largest batch, in rows walked per DELETE (every batch's size with
    /// `--batch-time 0`; a paced run shrinks batches down to 100 rows, or
    /// to this if it is smaller).
    #[arg(long, default_value_t = pg_outbox::retention::DEFAULT_RETENTION_BATCH)]
    batch_size: i64,
    /// The shortest pause between batches.
    #[arg(long, value_parser = parse_duration, default_value = "100ms")]
    pause: Duration,
    /// The time a batch aims at: each batch is sized from the rows per
    /// second the last one walked (0: no pacing, batches of --batch-size).
    #[arg(long, value_parser = parse_duration_or_zero, default_value = "5ms")]
    batch_time: Duration,
    /// The most share of wall time spent deleting, as a percentage: the
    /// pause after a batch is at least (100 - P) / P times its time.
    #[arg(long, value_parser = parse_share, default_value = "5")]
    max_share_percent: f64,
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
}

pub(crate) async fn run(db: &pg_outbox::ConnectOptions, args: ArchiveArgs) -> Result<(), Error> {
    let r = pg_outbox::retention::Retention {
        older_than: args.older_than,
        batch_size: args.batch_size,
        pause: args.pause,
        batch_time: args.batch_time,
        max_share: args.max_share_percent / 100.0,
    };
    let age = humantime::format_duration(args.older_than);
    if args.dry_run {
        let rep = pg_outbox::retention::dry_run(&connect(db).await?, &r).await?;
        println!("dry run: would delete {} published events older than {age}", rep.deleted);
        return Ok(());
    }
    let rep = pg_outbox::retention::run(db, &r).await?;
    if rep.skipped {
        return Err(Error::Usage("another retention run holds the lock; nothing deleted".into()));
    }
    let end = if rep.walk_end_subscription {
        ", the lowest subscription cursor (pg-outbox subscription list)"
    } else if rep.walk_end_marked {
        ", an earlier run's mark"
    } else {
        ", the highest"
    };
    if rep.deleted == 0 {
        if rep.walk_end_subscription {
            println!("deleted 0 published events older than {age}: none were due up to id {}{end}", rep.walk_end_id);
        } else {
            println!("deleted 0 published events older than {age}: none were due");
        }
        return Ok(());
    }
    println!(
        "deleted {} published events older than {age} in {} batches of {} to {} rows ({:.1} s deleting, {:.1} s paused; \
         {} rows walked, up to id {}{})",
        rep.deleted,
        rep.batches,
        rep.smallest_batch,
        rep.largest_batch,
        rep.busy_seconds,
        rep.paused_seconds,
        rep.walked,
        rep.walk_end_id,
        end
    );
    Ok(())
}

/// A percentage above 0 and at most 100.
fn parse_share(s: &str) -> Result<f64, String> {
    let p: f64 = s.trim_end_matches('%').parse().map_err(|_| format!("`{s}` is not a percentage (e.g. 20)"))?;
    if p > 0.0 && p <= 100.0 { Ok(p) } else { Err(format!("`{s}`: the share must be above 0 and at most 100")) }
}

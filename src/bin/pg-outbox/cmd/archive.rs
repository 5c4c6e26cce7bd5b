//! `pg-outbox archive`: delete published events older than a cutoff.

use std::time::Duration;

use crate::db::connect;
use crate::error::Error;
use crate::parse::parse_duration;

#[derive(clap::Args, Debug)]
pub(crate) struct ArchiveArgs {
    /// Delete published events older than this (default 30 days, docs/schema.md).
    #[arg(long, value_parser = parse_duration, default_value = "30d")]
    older_than: Duration,
    /// Rows per DELETE statement.
    #[arg(long, default_value_t = pg_outbox::retention::DEFAULT_RETENTION_BATCH)]
    batch_size: i64,
    /// Pause between batches.
    #[arg(long, value_parser = parse_duration, default_value = "100ms")]
    pause: Duration,
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
}

pub(crate) async fn run(url: &str, args: ArchiveArgs) -> Result<(), Error> {
    let r =
        pg_outbox::retention::Retention { older_than: args.older_than, batch_size: args.batch_size, pause: args.pause };
    let age = humantime::format_duration(args.older_than);
    if args.dry_run {
        let rep = pg_outbox::retention::dry_run(&connect(url).await?, &r).await?;
        println!("dry run: would delete {} published events older than {age}", rep.deleted);
        return Ok(());
    }
    let rep = pg_outbox::retention::run(&pg_outbox::ConnectOptions::parse(url)?, &r).await?;
    if rep.skipped {
        return Err(Error::Usage("another retention run holds the lock; nothing deleted".into()));
    }
    println!("deleted {} published events older than {age} in {} batches", rep.deleted, rep.batches);
    Ok(())
}

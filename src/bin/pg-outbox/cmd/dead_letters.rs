//! `pg-outbox dead-letters ...`: operate dead letters from the command line,
//! the default's (the seeded flow) or, with `--subscription NAME`, a
//! subscription's.

use crate::error::Error;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use pg_outbox::dead_letters::{self, Filter};

#[derive(Subcommand, Debug)]
pub(crate) enum DeadLetterCmd {
    /// List dead letters (table, or --json).
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Print JSON (one array) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter in full, as JSON.
    Show {
        /// Outbox id.
        id: i64,
        /// A subscription's dead letter (its retry count and last error)
        /// instead of the default's.
        #[arg(long)]
        subscription: Option<String>,
    },
    /// Make dead letters due again (one more attempt each; retry_count is kept).
    Retry {
        #[command(flatten)]
        sel: Selection,
    },
    /// Delete dead letters for good; their aggregates' later events then flow.
    Discard {
        #[command(flatten)]
        sel: Selection,
        /// Confirm the deletion.
        #[arg(long)]
        yes: bool,
    },
}

/// Which dead letters `retry` and `discard` touch.
#[derive(Args, Debug)]
pub(crate) struct Selection {
    /// Outbox ids; or use the filters, or --all.
    ids: Vec<i64>,
    #[command(flatten)]
    filter: FilterArgs,
    /// Apply to every dead letter when no id or filter is given.
    #[arg(long)]
    all: bool,
    /// Print what would change, change nothing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args, Debug, Default)]
pub(crate) struct FilterArgs {
    /// The dead letters of this subscription (its failure rows that reached
    /// the threshold) instead of the default's (events.outbox's own
    /// columns). Retry makes them due again for that subscription only;
    /// discard settles them for it (the events stay in events.outbox).
    #[arg(long)]
    subscription: Option<String>,
    /// Only this aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only this event type.
    #[arg(long)]
    event_type: Option<String>,
    /// Only dead letters whose last_error contains this text.
    #[arg(long)]
    error_contains: Option<String>,
    /// Only events that occurred since this time: RFC 3339 (2026-01-31T00:00:00Z) or an age (24h, 7d).
    #[arg(long, value_parser = parse_since)]
    since: Option<DateTime<Utc>>,
    /// At most this many rows (list default: 100).
    #[arg(long)]
    limit: Option<i64>,
}

fn parse_since(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    let age = humantime::parse_duration(s.trim())
        .map_err(|_| format!("invalid --since '{s}': write an RFC 3339 time or an age like 24h or 7d"))?;
    let too_far = || format!("invalid --since '{s}': that age reaches before any representable time");
    let age = chrono::Duration::from_std(age).map_err(|_| too_far())?;
    Utc::now().checked_sub_signed(age).ok_or_else(too_far)
}

impl FilterArgs {
    fn is_empty(&self) -> bool {
        self.aggregate_type.is_none()
            && self.event_type.is_none()
            && self.error_contains.is_none()
            && self.since.is_none()
            && self.limit.is_none()
    }

    fn to_filter(&self, ids: &[i64]) -> Result<Filter, Error> {
        if let Some(l) = self.limit
            && l < 1
        {
            return Err(Error::Config(format!("--limit must be at least 1, got {l}")));
        }
        let mut f = if ids.is_empty() { Filter::all() } else { Filter::ids(ids.to_vec()) };
        f.aggregate_type = self.aggregate_type.clone();
        f.event_type = self.event_type.clone();
        f.error_contains = self.error_contains.clone();
        f.since = self.since;
        f.limit = self.limit;
        f.subscription = self.subscription.clone();
        Ok(f)
    }
}

/// "3 dead letters: 12, 15, 19" (at most 50 ids shown).
fn counted(ids: &[i64]) -> String {
    let noun = if ids.len() == 1 { "dead letter" } else { "dead letters" };
    if ids.is_empty() {
        return format!("0 {noun}");
    }
    let shown: Vec<String> = ids.iter().take(50).map(|i| i.to_string()).collect();
    let more = if ids.len() > 50 { format!(" and {} more", ids.len() - 50) } else { String::new() };
    format!("{} {noun}: {}{more}", ids.len(), shown.join(", "))
}

/// ` of subscription NAME`, or nothing for the default.
fn of_subscription(f: &Filter) -> String {
    match f.subscription.as_deref() {
        Some(name) if name != pg_outbox::subscription::DEFAULT => format!(" of subscription {name}"),
        _ => String::new(),
    }
}

/// Explain ids that were asked for by number but are not dead letters
/// (`whose`: ` of subscription NAME`, or nothing).
async fn explain_missing(
    client: &tokio_postgres::Transaction<'_>,
    asked: &[i64],
    found: &[i64],
    whose: &str,
) -> Result<(), Error> {
    let missing: Vec<i64> = asked.iter().copied().filter(|i| !found.contains(i)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let existing = dead_letters::existing(client, &missing).await?;
    let (exist, absent): (Vec<i64>, Vec<i64>) = missing.iter().partition(|i| existing.contains(i));
    let list = |ids: &[i64]| ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", ");
    let (n, m) = (exist.len(), absent.len());
    let mut parts = Vec::new();
    if n > 0 {
        let are = if n == 1 { "is not a dead letter" } else { "are not dead letters" };
        parts.push(format!("{} {} {are}{whose}", if n == 1 { "event" } else { "events" }, list(&exist)));
    }
    if m > 0 {
        let verb = if m == 1 { "is no event in events.outbox" } else { "are no events in events.outbox" };
        parts.push(format!("{} {verb}", list(&absent)));
    }
    Err(Error::Usage(format!("{}: nothing done for them", parts.join(", and "))))
}

fn require_selection(ids: &[i64], filter: &FilterArgs, all: bool, verb: &str) -> Result<(), Error> {
    if ids.is_empty() && filter.is_empty() && !all {
        return Err(Error::Usage(format!(
            "name the dead letters to {verb}: give ids, a filter (--aggregate-type, --event-type, --error-contains, --since, --limit), or --all"
        )));
    }
    Ok(())
}

/// Run `cmd` in one transaction: its statements hold one server session
/// from the first to the last (so a transaction-mode pooler cannot split
/// them across sessions), and a retry or discard commits with the
/// wake-up it sends. What was done is committed also when the command then
/// reports ids it did not touch.
pub(crate) async fn run(db: &pg_outbox::ConnectOptions, cmd: DeadLetterCmd) -> Result<(), Error> {
    // Retrying and discarding write: on the primary (a standby is refused
    // in a sentence); listing and showing read anywhere.
    let writes = matches!(cmd, DeadLetterCmd::Retry { .. } | DeadLetterCmd::Discard { .. });
    let mut client = if writes { crate::db::connect_primary(db).await? } else { crate::db::connect(db).await? };
    let tx = client.transaction().await?;
    let result = match cmd {
        DeadLetterCmd::List { filter, json } => match filter.to_filter(&[]) {
            Ok(f) => list(&tx, &f, json).await,
            Err(e) => Err(e),
        },
        DeadLetterCmd::Show { id, subscription } => show(&tx, id, subscription).await,
        DeadLetterCmd::Retry { sel } => retry(&tx, sel).await,
        DeadLetterCmd::Discard { sel, yes } => discard(&tx, sel, yes).await,
    };
    let committed = tx.commit().await;
    result?;
    Ok(committed?)
}

/// `dead-letters list`: a table (or JSON) on stdout; a note on stderr when
/// the page is cut short by the limit.
async fn list(client: &tokio_postgres::Transaction<'_>, f: &Filter, json: bool) -> Result<(), Error> {
    let rows = dead_letters::list(client, f).await?;
    let limit = f.limit.unwrap_or(dead_letters::DEFAULT_LIST_LIMIT);
    let mut note = None;
    if i64::try_from(rows.len()).is_ok_and(|n| n >= limit) {
        let total = dead_letters::count(client, f).await?;
        if total > limit {
            note = Some(format!("showing {} of {total} dead letters; use --limit {total} to see them all", rows.len()));
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else if rows.is_empty() {
        eprintln!("no dead letters{}", of_subscription(f));
    } else {
        print_table(&rows);
    }
    if let Some(note) = note {
        eprintln!("{note}");
    }
    Ok(())
}

fn print_table(rows: &[pg_outbox::Event]) {
    println!(
        "{:>10}  {:<20}  {:<36}  {:<24}  {:>7}  last_error",
        "id", "aggregate_type", "aggregate_id", "event_type", "retries"
    );
    for e in rows {
        let err: String =
            super::text::printable(e.last_error.as_deref().unwrap_or_default()).chars().take(80).collect();
        println!(
            "{:>10}  {:<20}  {:<36}  {:<24}  {:>7}  {}",
            e.id,
            super::text::printable(&e.aggregate_type),
            e.aggregate_id,
            super::text::printable(&e.event_type),
            e.retry_count,
            err
        );
    }
}

/// `dead-letters show ID`: the dead letter as JSON, or why there is none.
async fn show(client: &tokio_postgres::Transaction<'_>, id: i64, subscription: Option<String>) -> Result<(), Error> {
    let mut f = Filter::ids(vec![id]);
    f.subscription = subscription;
    let rows = dead_letters::list(client, &f).await?;
    if let Some(e) = rows.first() {
        println!("{}", serde_json::to_string_pretty(e)?);
        return Ok(());
    }
    let exists = !dead_letters::existing(client, &[id]).await?.is_empty();
    Err(Error::Usage(if exists {
        format!("event {id} is not a dead letter{}", of_subscription(&f))
    } else {
        format!("no event {id} in events.outbox")
    }))
}

/// `dead-letters retry`: due again at once (or, with --dry-run, what would be).
async fn retry(client: &tokio_postgres::Transaction<'_>, sel: Selection) -> Result<(), Error> {
    let Selection { ids, filter, all, dry_run } = sel;
    require_selection(&ids, &filter, all, "retry")?;
    let f = filter.to_filter(&ids)?;
    let done = if dry_run {
        let found = dead_letters::matching_ids(client, &f).await?;
        println!("dry run: would retry {}{}", counted(&found), of_subscription(&f));
        found
    } else {
        let done = dead_letters::retry(client, &f).await?;
        println!("retried {}{}", counted(&done), of_subscription(&f));
        done
    };
    explain_missing(client, &ids, &done, &of_subscription(&f)).await
}

/// `dead-letters discard`: delete for good, only with --yes (or, with
/// --dry-run, say what would be deleted).
async fn discard(client: &tokio_postgres::Transaction<'_>, sel: Selection, yes: bool) -> Result<(), Error> {
    let Selection { ids, filter, all, dry_run } = sel;
    require_selection(&ids, &filter, all, "discard")?;
    let f = filter.to_filter(&ids)?;
    if dry_run || !yes {
        let found = dead_letters::matching_ids(client, &f).await?;
        let whose = of_subscription(&f);
        if found.is_empty() && !dry_run {
            println!("no dead letters{whose} match: nothing to discard");
            return explain_missing(client, &ids, &found, &whose).await;
        }
        if !dry_run {
            let what = if whose.is_empty() { "delete" } else { "settle, unsent," };
            return Err(Error::Usage(format!(
                "discard would {what} {}{whose} for good; pass --yes to confirm, or --dry-run",
                counted(&found)
            )));
        }
        let what = if whose.is_empty() { "delete" } else { "settle" };
        println!("dry run: would {what} {}{whose}", counted(&found));
        return explain_missing(client, &ids, &found, &whose).await;
    }
    let done = dead_letters::discard(client, &f).await?;
    let whose = of_subscription(&f);
    if whose.is_empty() {
        println!("deleted {}", counted(&done));
    } else {
        println!("discarded {}{whose}: settled for it without delivery, the events stay", counted(&done));
    }
    explain_missing(client, &ids, &done, &whose).await
}

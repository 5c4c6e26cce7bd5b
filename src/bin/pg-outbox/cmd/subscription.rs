//! `pg-outbox subscription ...`: create, list, pause, resume, drop and
//! rewind subscriptions (docs/subscriptions.md).

use clap::Subcommand;
use pg_outbox::subscription::{self, From, Subscription};

use crate::error::Error;

/// How `--from` and `--to` are written, for `--help`.
pub(crate) const FROM_HELP: &str = "\
Where a subscription starts (--from) or a rewind puts it (--to):
  now           the events after the highest id in events.outbox now (an event whose transaction
                is still open then and drew a lower id is not delivered to the subscription)
  earliest      every event in the table
  id:N          the events from id N on
  time:RFC3339  the events from the first (lowest id) that occurred at or after that time, e.g.
                time:2026-01-31T00:00:00Z (a one-off walk of the table up to that event)
See docs/subscriptions.md.";

#[derive(Subcommand, Debug)]
pub(crate) enum SubscriptionCmd {
    /// Create a subscription: another reader of the outbox, with its own
    /// progress, retries and dead letters.
    #[command(after_help = FROM_HELP)]
    Create {
        /// Its name: 1 to 63 characters of a-z, 0-9, '_', '.' and '-',
        /// starting with a letter or a digit; not `default`.
        name: String,
        /// Where it starts: now, earliest, id:N or time:RFC3339 (below).
        #[arg(long, value_parser = parse_from, default_value = "now")]
        from: From,
        /// Its lag bound (e.g. 15m, 1h): once its oldest unsettled event is
        /// older, it is behind (metric, log, status). Nothing is dropped.
        #[arg(long, value_parser = crate::parse_duration)]
        max_lag: Option<std::time::Duration>,
        /// With --max-lag: once behind, mark it expired: retention stops
        /// waiting for it (events it never got may be deleted) and its
        /// relays stop. Off by default: a subscription behind keeps
        /// everything.
        #[arg(long, requires = "max_lag")]
        expire: bool,
    },
    /// Set or clear a subscription's lag bound (--max-lag).
    Set {
        /// The subscription's name.
        name: String,
        /// Its lag bound (e.g. 15m, 1h), or `none` to clear it: once its
        /// oldest unsettled event is older, it is behind (the gauge
        /// outbox_subscription_behind, the log signal subscription_behind,
        /// status). Nothing is dropped: it still holds retention.
        #[arg(long, value_parser = parse_max_lag)]
        max_lag: MaxLag,
        /// Once behind, mark it expired: retention stops waiting for it
        /// (events it never got may be deleted) and its relays stop. Off by
        /// default (and without a bound): a subscription behind keeps
        /// everything.
        #[arg(long)]
        expire: bool,
    },
    /// List the subscriptions, the default (the seeded flow) first, with
    /// state, cursor, backlog, lag, failures, dead letters and held events
    /// (table, or --json).
    List {
        /// Print JSON (one array) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Pause a subscription: its relays deliver nothing more until it is
    /// resumed; retention keeps every event it has not passed.
    Pause {
        /// The subscription's name.
        name: String,
    },
    /// Resume a paused subscription.
    Resume {
        /// The subscription's name.
        name: String,
    },
    /// Drop a subscription with its failure rows and dead letters (its
    /// events stay in events.outbox).
    Drop {
        /// The subscription's name.
        name: String,
        /// Confirm the drop.
        #[arg(long)]
        yes: bool,
    },
    /// Move a paused subscription's cursor: its events after the new cursor
    /// (failures and dead letters among them) are delivered again once it
    /// is resumed.
    #[command(after_help = FROM_HELP)]
    Rewind {
        /// The subscription's name.
        name: String,
        /// Where to put it: now, earliest, id:N or time:RFC3339 (below).
        #[arg(long, value_parser = parse_from)]
        to: From,
    },
}

/// `set --max-lag`: a duration, or `none`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MaxLag(Option<std::time::Duration>);

fn parse_max_lag(s: &str) -> Result<MaxLag, String> {
    if s.trim() == "none" {
        return Ok(MaxLag(None));
    }
    crate::parse_duration(s).map(|d| MaxLag(Some(d))).map_err(|e| format!("{e}, or none to clear the bound"))
}

/// `--from` and `--to`: the error names the value and the forms.
fn parse_from(s: &str) -> Result<From, String> {
    s.parse::<From>().map_err(|e| e.to_string())
}

pub(crate) async fn run(db: &pg_outbox::ConnectOptions, cmd: SubscriptionCmd) -> Result<(), Error> {
    match cmd {
        SubscriptionCmd::List { json } => list(db, json).await,
        SubscriptionCmd::Create { name, from, max_lag, expire } => {
            let mut client = crate::db::connect_primary(db).await?;
            let tx = client.transaction().await.map_err(pg_outbox::Error::from)?;
            let mut s = subscription::create(&tx, &name, from).await?;
            if max_lag.is_some() {
                subscription::set_max_lag(&tx, &name, max_lag, expire).await?;
                s = subscription::get(&tx, &name).await?;
            }
            tx.commit().await.map_err(pg_outbox::Error::from)?;
            let cursor = s.cursor_id.unwrap_or_default();
            println!(
                "created subscription {} from {from}: cursor {cursor}, events from id {} on",
                s.name,
                cursor.saturating_add(1)
            );
            Ok(())
        }
        SubscriptionCmd::Set { name, max_lag: MaxLag(max_lag), expire } => {
            if expire && max_lag.is_none() {
                return Err(Error::Usage("--expire needs a lag bound: --max-lag DURATION, not none".into()));
            }
            let client = crate::db::connect_primary(db).await?;
            subscription::set_max_lag(&client, &name, max_lag, expire).await?;
            match (max_lag, expire) {
                (Some(d), false) => println!("subscription {name}: lag bound {}", humantime::format_duration(d)),
                (Some(d), true) => println!(
                    "subscription {name}: lag bound {}, expires once behind (retention then stops waiting for it)",
                    humantime::format_duration(d)
                ),
                (None, _) => println!("subscription {name}: no lag bound"),
            }
            Ok(())
        }
        SubscriptionCmd::Pause { name } => {
            let client = crate::db::connect_primary(db).await?;
            if subscription::pause(&client, &name).await? {
                println!("paused subscription {name}");
            } else {
                println!("subscription {name} was paused already");
            }
            Ok(())
        }
        SubscriptionCmd::Resume { name } => {
            let client = crate::db::connect_primary(db).await?;
            if subscription::resume(&client, &name).await? {
                println!("resumed subscription {name}");
            } else {
                println!("subscription {name} was active already");
            }
            Ok(())
        }
        SubscriptionCmd::Drop { name, yes } => drop_subscription(db, &name, yes).await,
        SubscriptionCmd::Rewind { name, to } => {
            let client = crate::db::connect_primary(db).await?;
            let r = subscription::rewind(&client, &name, to).await?;
            println!(
                "rewound subscription {name} to {to}: cursor {} (was {}); events from id {} on are delivered \
                 once it is resumed; {} failure rows above the cursor deleted, {} of them dead letters",
                r.cursor_id,
                r.previous_cursor_id,
                r.cursor_id.saturating_add(1),
                r.failures_dropped,
                r.dead_letters_dropped
            );
            Ok(())
        }
    }
}

/// `subscription drop NAME`: only with --yes; in one transaction with the
/// figures it reports.
async fn drop_subscription(db: &pg_outbox::ConnectOptions, name: &str, yes: bool) -> Result<(), Error> {
    let mut client = crate::db::connect_primary(db).await?;
    let tx = client.transaction().await?;
    let s = subscription::get(&tx, name).await?;
    let exact = if s.counts_exact { "" } else { "at least " };
    if !yes {
        return Err(Error::Usage(format!(
            "drop would delete subscription {name} for good, with its failure rows ({exact}{} dead letters, \
             {exact}{} waiting for a retry, {exact}{} held); pass --yes to confirm",
            s.dead_letters, s.failing, s.held
        )));
    }
    let d = subscription::drop(&tx, name).await?;
    tx.commit().await?;
    println!(
        "dropped subscription {name}: {} failure rows deleted, {} of them dead letters",
        d.failures, d.dead_letters
    );
    Ok(())
}

/// `subscription list`: a table (or JSON) on stdout, from one snapshot.
async fn list(db: &pg_outbox::ConnectOptions, json: bool) -> Result<(), Error> {
    let mut client = crate::db::connect(db).await?;
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    let all = subscription::list(&tx).await?;
    tx.commit().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        print_table(&all);
    }
    Ok(())
}

/// The subscriptions as a table: one line each. Figures that are lower
/// bounds (more failure rows than were counted) start with `>=`, estimated
/// ones (the default's, as `status` estimates them) with `~`.
pub(crate) fn print_table(all: &[Subscription]) {
    let names: Vec<String> = all.iter().map(|s| super::text::printable(&s.name)).collect();
    let w = names.iter().map(|n| n.chars().count()).max().unwrap_or(0).max(12);
    println!(
        "{:<w$}  {:<7}  {:>12}  {:>12}  {:>16}  {:>8}  {:>8}  {:>12}  {:>8}  {:<20}  leader",
        "subscription", "state", "cursor", "backlog <=", "lag", "max lag", "failing", "dead letters", "held", "moved"
    );
    for (s, name) in all.iter().zip(&names) {
        let mark = match (s.counts_exact, s.cursor_id.is_some()) {
            (true, _) => "",
            (false, true) => ">=",
            (false, false) => "~",
        };
        let backlog_mark = if s.cursor_id.is_none() && !s.counts_exact { "~" } else { "" };
        let n = |v: i64| format!("{mark}{v}");
        println!(
            "{:<w$}  {:<7}  {:>12}  {:>12}  {:>16}  {:>8}  {:>8}  {:>12}  {:>8}  {:<20}  {}",
            name,
            s.state.as_str(),
            s.cursor_id.map_or("-".to_string(), |c| c.to_string()),
            format!("{backlog_mark}{}", s.backlog_upper_bound),
            lag_cell(s),
            s.max_lag_seconds.map_or("-".to_string(), super::text::short_secs),
            n(s.failing),
            n(s.dead_letters),
            n(s.held),
            s.moved_at.map_or("-".to_string(), |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
            leader_cell(s),
        );
    }
}

/// The lag, and `BEHIND` when it passes the bound (`--max-lag`).
fn lag_cell(s: &Subscription) -> String {
    let lag = s.lag_seconds.map_or("-".to_string(), super::text::short_secs);
    if s.behind { format!("BEHIND {lag}") } else { lag }
}

/// Who leads a subscription, in one table cell: `pid 4242 term 7`, `none`,
/// or `stranded: pid 4242` for a holder that is not a live relay (`status`
/// explains a stranded outbox lock in full; a subscription's is the same);
/// in partitioned mode, how many of its partitions are held and by how
/// many sessions: `partitions 3/4 held by 2`.
pub(crate) fn leader_cell(s: &Subscription) -> String {
    match s.leader.as_ref() {
        None if !s.partitions.is_empty() => {
            let mut pids: Vec<i32> = s.partitions.iter().map(|p| p.pid).collect();
            pids.sort_unstable();
            pids.dedup();
            let of = s.partitions.iter().find_map(|p| p.partitions).map_or("?".to_string(), |n| n.to_string());
            format!("partitions {}/{of} held by {}", s.partitions.len(), pids.len())
        }
        None if s.competing > 0 => {
            format!("competing: {} relay{}", s.competing, if s.competing == 1 { "" } else { "s" })
        }
        None => "none".into(),
        Some(l) if !l.live => format!("stranded: pid {} (not a live relay)", l.pid),
        Some(l) => match l.term {
            Some(t) => format!("pid {} term {t}", l.pid),
            None => format!("pid {}", l.pid),
        },
    }
}

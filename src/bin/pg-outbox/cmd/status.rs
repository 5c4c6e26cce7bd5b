//! `pg-outbox status`: backlog, retries and dead letters, as a table or
//! JSON.

use super::text::{printable, short_secs};
use crate::db::connect;
use crate::error::Error;

#[derive(clap::Args, Debug)]
pub(crate) struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(db: &pg_outbox::ConnectOptions, args: StatusArgs) -> Result<(), Error> {
    let mut client = connect(db).await?;
    // One read-only snapshot: the figures agree with one another, and the
    // statements hold one server session (a transaction-mode pooler cannot
    // split them across sessions).
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    let s = pg_outbox::status::read(&tx).await?;
    tx.commit().await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        let est = |field: &str| if s.estimated_figures.contains(&field) { "~" } else { "" };
        let age = s
            .oldest_unpublished_age_seconds
            .map_or("-".to_string(), |a| format!("{}{a:.3} s", est("oldest_unpublished_age_seconds")));
        println!("unpublished         {}{}", est("unpublished"), s.unpublished);
        println!("due now             {}{}", est("due_now"), s.due_now);
        println!("held back           {}{}", est("held_back"), s.held_back);
        println!("waiting for retry   {}{}", est("waiting_for_retry"), s.waiting_for_retry);
        println!("dead letters        {}{}", est("dead_letters"), s.dead_letters);
        println!("oldest pending age  {age}");
        println!("leader              {}", leader_line(s.leader.as_ref(), !s.partitions.is_empty()));
        if !s.partitions.is_empty() {
            println!("partitions          {}", partitions_line(&s.partitions));
        }
        println!(
            "ordering mode       {}",
            s.ordering.map_or("none (no insert trigger enabled)", pg_outbox::migrate::OrderingMode::as_str)
        );
        if !s.subscriptions.is_empty() {
            println!();
            println!("subscriptions (besides the default above; pg-outbox subscription list)");
            super::subscription::print_table(&s.subscriptions);
        }
        print_by_type(&s);
        print_retries(&s.retries, s.estimated_figures.contains(&"retries"));
        if s.estimated {
            println!();
            println!(
                "~ estimated: more than {} rows of a kind, sampled (docs/operations.md, \"How `status` estimates\")",
                pg_outbox::status::OutboxStatus::EXACT_ROWS
            );
        }
    }
    Ok(())
}

/// The `leader` line: the live leader's pid, "no live leader" with the
/// stranded holder's details, or none.
fn leader_line(l: Option<&pg_outbox::status::LeaderLock>, partitioned: bool) -> String {
    let Some(l) = l else {
        return if partitioned {
            "none (relays run in partitioned mode: see partitions)".into()
        } else {
            "none (no relay holds the outbox lock)".into()
        };
    };
    let heartbeat =
        l.heartbeat_age_seconds.map_or("no heartbeat".to_string(), |a| format!("heartbeat {} ago", short_secs(a)));
    if l.live {
        let term = l.term.map_or(String::new(), |t| format!("term {t}, "));
        return format!("pid {} (live, {term}{heartbeat}){}", l.pid, relay_of(l.relay.as_ref()));
    }
    let client = l
        .client_addr
        .as_deref()
        .map(printable)
        .unwrap_or_else(|| if l.state.is_some() { "local socket".into() } else { "hidden".into() });
    let app = printable(l.application_name.as_deref().unwrap_or(""));
    let state = match (l.state.as_deref(), l.state_seconds) {
        (Some(state), Some(secs)) => format!("{} for {}", printable(state), short_secs(secs)),
        _ => "state hidden".into(),
    };
    format!(
        "no live leader: the outbox lock is held by pid {} (client {client}, application_name {app:?}, {state}, \
         {heartbeat}); nothing is delivered until it ends (pg_terminate_backend({}), or a relay with \
         --take-over-stranded)",
        l.pid, l.pid
    )
}

/// `, relay 4242 on host-a (pg-outbox 0.1.0)`: the relay's own identity,
/// when it recorded one (empty otherwise).
fn relay_of(r: Option<&pg_outbox::status::RelayIdentity>) -> String {
    r.map_or(String::new(), |r| {
        format!(", relay {} on {} (pg-outbox {})", r.process_id, printable(&r.host), printable(&r.version))
    })
}

/// The `partitions` line: each partition held, `P/N pid X term T`; then,
/// per holder, its relay's identity and heartbeat age.
fn partitions_line(held: &[pg_outbox::status::PartitionHolder]) -> String {
    let one = |h: &pg_outbox::status::PartitionHolder| {
        let of = h.partitions.map_or(String::new(), |n| format!("/{n}"));
        let term = h.term.map_or("no term".to_string(), |t| format!("term {t}"));
        format!("{}{of} pid {} {term}", h.partition, h.pid)
    };
    let mut line = held.iter().map(one).collect::<Vec<_>>().join(", ");
    let mut seen = std::collections::BTreeSet::new();
    for h in held.iter().filter(|h| seen.insert(h.pid)) {
        let heartbeat =
            h.heartbeat_age_seconds.map_or("no heartbeat".to_string(), |a| format!("heartbeat {} ago", short_secs(a)));
        line.push_str(&format!("; pid {}: {heartbeat}{}", h.pid, relay_of(h.relay.as_ref())));
    }
    line
}

fn print_by_type(s: &pg_outbox::status::OutboxStatus) {
    if s.by_type.is_empty() {
        return;
    }
    let types: Vec<(String, String)> =
        s.by_type.iter().map(|t| (printable(&t.event_type), printable(&t.aggregate_type))).collect();
    let w_event = types.iter().map(|(e, _)| e.chars().count()).max().unwrap_or(0).max(10);
    let w_agg = types.iter().map(|(_, a)| a.chars().count()).max().unwrap_or(0).max(14);
    println!();
    println!("by event type");
    println!(
        "{:<w_event$}  {:<w_agg$}  {:>11}  {:>7}  {:>9}  {:>17}  {:>12}  oldest pending",
        "event_type", "aggregate_type", "unpublished", "due now", "held back", "waiting for retry", "dead letters"
    );
    let est = if s.estimated_figures.contains(&"by_type") { "~" } else { "" };
    let n = |v: i64| format!("{est}{v}");
    for (t, (event_type, aggregate_type)) in s.by_type.iter().zip(&types) {
        let age = t.oldest_unpublished_age_seconds.map_or("-".to_string(), |a| format!("{est}{}", short_secs(a)));
        println!(
            "{:<w_event$}  {:<w_agg$}  {:>11}  {:>7}  {:>9}  {:>17}  {:>12}  {age}",
            event_type,
            aggregate_type,
            n(t.unpublished),
            n(t.due_now),
            n(t.held_back),
            n(t.waiting_for_retry),
            n(t.dead_letters)
        );
    }
    if s.by_type_truncated {
        println!("(only the {} types with the most unpublished events are shown)", s.by_type.len());
    }
}

fn print_retries(r: &pg_outbox::status::RetryLadder, estimated: bool) {
    let Some(next_at) = r.next_due_at else { return };
    println!();
    let next_in = r.next_due_in_seconds.map_or("-".to_string(), short_secs);
    println!(
        "retries due         next at {} (in {next_in})",
        next_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    let est = if estimated { "~" } else { "" };
    println!("  within 1 m        {est}{}", r.due_within_1m);
    println!("  within 1 h        {est}{}", r.due_within_1h);
    println!("  later             {est}{}", r.due_later);
    if r.next.is_empty() {
        return;
    }
    println!("next retries");
    println!(
        "{:>10}  {:<24}  {:<20}  {:>7}  {:<20}  {:>8}  last_error",
        "id", "event_type", "aggregate_type", "retries", "due at", "due in"
    );
    for p in &r.next {
        let err: String = printable(p.last_error.as_deref().unwrap_or_default()).chars().take(60).collect();
        println!(
            "{:>10}  {:<24}  {:<20}  {:>7}  {:<20}  {:>8}  {err}",
            p.id,
            printable(&p.event_type),
            printable(&p.aggregate_type),
            p.retry_count,
            p.due_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            short_secs(p.due_in_seconds)
        );
    }
}

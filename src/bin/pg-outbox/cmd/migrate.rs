//! `pg-outbox migrate`: create or update the schema, and show or switch
//! the ordering mode.

use crate::error::Error;

#[derive(clap::Args, Debug)]
pub(crate) struct MigrateArgs {
    /// How per-aggregate order is kept on insert. `outbox-locked` (the
    /// default for a new database): the insert trigger locks each event's
    /// aggregate, so order holds whatever producers do. `producer-locked`
    /// (opt-in, cheaper inserts): safe ONLY if every transaction that
    /// writes an aggregate's events first locks a row of its own for that
    /// aggregate and holds it to the commit (e.g. `UPDATE
    /// billing.subscriptions ... WHERE id = $1` before the INSERT);
    /// producers that do not can have events delivered out of order.
    /// Without this flag the installed mode is kept. Switching waits at
    /// most 5 s for running producer transactions (then fails: run it
    /// again).
    #[arg(long, value_enum, value_name = "MODE")]
    ordering: Option<OrderingArg>,
    /// Prepare for the relays' source. `wal`: create the publication
    /// `pg_outbox` (inserts into events.outbox only) that `relay --source
    /// wal` reads, and in the producer-locked mode stop the insert trigger
    /// entirely (the relay no longer needs its NOTIFY); the outbox-locked
    /// mode keeps its trigger, which keeps the order. `listen`: start the
    /// producer-locked mode's wake-up trigger again. Applied after
    /// --ordering. Without this flag nothing changes.
    #[arg(long, value_enum, value_name = "SOURCE")]
    source: Option<super::relay::SourceArg>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OrderingArg {
    OutboxLocked,
    ProducerLocked,
}

pub(crate) async fn run(pg: &pg_outbox::ConnectOptions, args: MigrateArgs) -> Result<(), Error> {
    use pg_outbox::migrate::{self, OrderingMode};
    let report = migrate::apply(pg).await?;
    if report.applied.is_empty() {
        eprintln!("schema is up to date");
    } else {
        for name in &report.applied {
            eprintln!("applied {name}");
        }
    }
    let installed = match args.ordering {
        Some(arg) => {
            let mode = match arg {
                OrderingArg::OutboxLocked => OrderingMode::OutboxLocked,
                OrderingArg::ProducerLocked => OrderingMode::ProducerLocked,
            };
            let before = migrate::set_ordering(pg, mode).await.map_err(|e| {
                if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
                    return Error::Usage(format!(
                        "could not switch the ordering mode to {mode}: producer transactions that have written \
                         events kept events.outbox locked for 5 s (the switch waits for them, and producers wait \
                         for the switch, so it gives up then); nothing changed: run `pg-outbox migrate --ordering \
                         {mode}` again, when fewer producer transactions are open"
                    ));
                }
                Error::Outbox(e)
            })?;
            if before == Some(mode) {
                eprintln!("ordering mode: {mode} (unchanged)");
            } else {
                eprintln!("ordering mode: {mode} (was {})", before.map_or("none", OrderingMode::as_str));
            }
            Some(mode)
        }
        None => {
            let client = pg.connect().await?;
            let mode = migrate::ordering(&client).await?;
            match mode {
                Some(mode) => eprintln!("ordering mode: {mode} (kept; change it with --ordering)"),
                None => eprintln!(
                    "ordering mode: none (no insert trigger is enabled on events.outbox; enable one with --ordering)"
                ),
            }
            mode
        }
    };
    if let Some(source) = args.source {
        let fires = migrate::set_source(pg, source.kind()).await.map_err(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
                return Error::Usage(
                    "could not change the insert trigger: producer transactions that have written events kept \
                     events.outbox locked for 5 s; nothing changed: run it again"
                        .into(),
                );
            }
            Error::Outbox(e)
        })?;
        match (source, fires) {
            (super::relay::SourceArg::Wal, false) => eprintln!(
                "source: wal (publication pg_outbox; no insert trigger fires: run relays with --source wal, a \
                 --source listen relay would find events by its sweep only)"
            ),
            (super::relay::SourceArg::Wal, true) => eprintln!(
                "source: wal (publication pg_outbox; the outbox-locked mode's insert trigger stays, it keeps the \
                 order; producers skip its NOTIFY while only --source wal relays run)"
            ),
            (super::relay::SourceArg::Listen, _) => eprintln!("source: listen (the insert trigger notifies relays)"),
        }
    }
    if installed == Some(OrderingMode::ProducerLocked) {
        eprintln!(
            "note: in the producer-locked mode, order per aggregate holds only if every transaction that writes \
             an aggregate's events first locks a row of its own for that aggregate (README, \"Ordering modes\")"
        );
    }
    Ok(())
}

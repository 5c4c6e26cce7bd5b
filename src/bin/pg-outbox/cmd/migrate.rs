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
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OrderingArg {
    OutboxLocked,
    ProducerLocked,
}

pub(crate) async fn run(url: &str, args: MigrateArgs) -> Result<(), Error> {
    use pg_outbox::migrate::{self, OrderingMode};
    let pg = pg_outbox::ConnectOptions::parse(url)?;
    let report = migrate::apply(&pg).await?;
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
            let before = migrate::set_ordering(&pg, mode).await.map_err(|e| {
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
    if installed == Some(OrderingMode::ProducerLocked) {
        eprintln!(
            "note: in the producer-locked mode, order per aggregate holds only if every transaction that writes \
             an aggregate's events first locks a row of its own for that aggregate (README, \"Ordering modes\")"
        );
    }
    Ok(())
}

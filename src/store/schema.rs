//! What [`crate::migrate`] runs besides the embedded files: the ledger of
//! applied files, the statement timeout of a run, and the checks of the
//! server and the schema; and one function per operation that runs them.

use tokio_postgres::{Client, GenericClient};

use super::map_missing_schema;
use crate::error::{Error, Result};

/// How per-aggregate order is kept on insert: the ordering mode installed
/// on `events.outbox` (which insert trigger is enabled; see
/// `triggers/outbox_insert_order_and_notify.sql`, "Ordering modes", and
/// docs/architecture.md). A new database gets [`OrderingMode::OutboxLocked`];
/// `migrate::apply` keeps whatever mode is installed, and
/// `migrate::set_ordering` switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum OrderingMode {
    /// The default. The insert trigger `outbox_order` locks each event's
    /// aggregate before it draws the event's id, so an aggregate's ids
    /// commit in id order whatever the producers do (docs/architecture.md,
    /// "Why order holds when producers race"). Costs each insert a PL/pgSQL
    /// row trigger.
    OutboxLocked,
    /// Opt-in, for producers that already serialise each aggregate: every
    /// transaction that writes an aggregate's events first locks a row of
    /// its own for that aggregate (`SELECT ... FOR UPDATE` or an `UPDATE`
    /// of the aggregate's row) and holds it to the commit. The insert path
    /// then only decides the wake-up (the statement trigger `outbox_wake`,
    /// called only while a relay waits for one). Producers that write an
    /// aggregate without such a lock can commit its events out of id order,
    /// and relays then deliver them out of order.
    ProducerLocked,
}

impl OrderingMode {
    /// The mode's name as `pg-outbox migrate --ordering` and
    /// `events.outbox_set_ordering()` spell it: `outbox-locked` or
    /// `producer-locked`.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderingMode::OutboxLocked => "outbox-locked",
            OrderingMode::ProducerLocked => "producer-locked",
        }
    }

    /// The mode `events.outbox_set_ordering()` and the catalog read name
    /// `s`; `None` for any other name (`none`).
    pub(crate) fn from_sql(s: &str) -> Option<OrderingMode> {
        match s {
            "outbox-locked" => Some(OrderingMode::OutboxLocked),
            "producer-locked" => Some(OrderingMode::ProducerLocked),
            _ => None,
        }
    }
}

impl std::fmt::Display for OrderingMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OrderingMode {
    type Err = Error;

    /// Parse `outbox-locked` or `producer-locked`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the value and the two names it accepts.
    fn from_str(s: &str) -> Result<OrderingMode> {
        OrderingMode::from_sql(s).ok_or_else(|| {
            Error::Config(format!("unknown ordering mode {s:?}; expected outbox-locked or producer-locked"))
        })
    }
}

/// The server's version as a number (`server_version_num`, e.g. 150004) and
/// as text (`server_version`, e.g. "15.4").
const SERVER_VERSION: &str = "SELECT current_setting('server_version_num')::int4 AS num, \
     current_setting('server_version') AS version";

/// Turn the session's `statement_timeout` off for a run (the run's own
/// session, which ends with it).
const NO_STATEMENT_TIMEOUT: &str = "SET statement_timeout = 0";

/// Create the ledger of applied files, `events.outbox_schema_migrations`.
const CREATE_LEDGER: &str = "CREATE SCHEMA IF NOT EXISTS events; \
     CREATE TABLE IF NOT EXISTS events.outbox_schema_migrations ( \
       name TEXT PRIMARY KEY, checksum TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())";
/// The checksum recorded for file $1 (`checksum`), if any.
const RECORDED_CHECKSUM: &str = "SELECT checksum FROM events.outbox_schema_migrations WHERE name = $1";
/// Record file $1 as applied with checksum $2.
const RECORD: &str = "INSERT INTO events.outbox_schema_migrations (name, checksum) VALUES ($1, $2) \
     ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = now()";
/// End a transaction a failed file left open (a trigger file runs in one).
const ROLLBACK: &str = "ROLLBACK";

/// Indexes of `events.outbox` left invalid by an interrupted concurrent
/// build (`name`).
const INVALID_INDEXES: &str = "SELECT i.indexrelid::regclass::text AS name FROM pg_index i \
     WHERE i.indrelid = 'events.outbox'::regclass AND NOT i.indisvalid";
/// Whether relation $1 (a qualified name) exists (`present`).
const RELATION_EXISTS: &str = "SELECT to_regclass($1) IS NOT NULL AS present";
/// The names of the user triggers on `events.outbox` (`name`).
const OUTBOX_TRIGGERS: &str = "SELECT tgname::text AS name FROM pg_trigger \
     WHERE tgrelid = 'events.outbox'::regclass AND NOT tgisinternal";

/// The ordering mode installed on `events.outbox` (`mode`: `outbox-locked`
/// when the trigger `outbox_order` is enabled, else `producer-locked` when
/// `outbox_wake` is, else `none`), from `pg_trigger.tgenabled`
/// (triggers/outbox_insert_order_and_notify.sql, "Ordering modes").
const INSTALLED_ORDERING: &str = "SELECT CASE \
       WHEN bool_or(tgname = 'outbox_order' AND tgenabled <> 'D') THEN 'outbox-locked' \
       WHEN bool_or(tgname = 'outbox_wake' AND tgenabled <> 'D') THEN 'producer-locked' \
       ELSE 'none' END AS mode \
     FROM pg_trigger WHERE tgrelid = 'events.outbox'::regclass AND tgname IN ('outbox_order', 'outbox_wake')";
/// Switch the ordering mode to $1 (`outbox-locked` or `producer-locked`);
/// returns the mode installed before (`before`).
const SET_ORDERING: &str = "SELECT events.outbox_set_ordering($1) AS before";

/// The server's version, as [`server_version`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerVersion {
    /// `server_version_num`, e.g. 150004.
    pub(crate) num: i32,
    /// `server_version`, e.g. "15.4".
    pub(crate) version: String,
}

/// The server's version ([`SERVER_VERSION`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn server_version(client: &Client) -> Result<ServerVersion> {
    Ok(read_server_version(client).await?)
}

/// [`server_version`] with the driver's error, for a statement run with
/// `statement::run` (the drain loop's session setup).
pub(super) async fn read_server_version(client: &Client) -> Result<ServerVersion, tokio_postgres::Error> {
    let row = client.query_one(SERVER_VERSION, &[]).await?;
    Ok(ServerVersion { num: row.try_get("num")?, version: row.try_get("version")? })
}

/// Turn the session's `statement_timeout` off ([`NO_STATEMENT_TIMEOUT`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn no_statement_timeout(client: &Client) -> Result<()> {
    Ok(client.batch_execute(NO_STATEMENT_TIMEOUT).await?)
}

/// Create the ledger of applied files if it is missing ([`CREATE_LEDGER`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statements fail.
pub(crate) async fn create_ledger(client: &Client) -> Result<()> {
    Ok(client.batch_execute(CREATE_LEDGER).await?)
}

/// The checksum the ledger records for file `name`, or `None` when it
/// records none ([`RECORDED_CHECKSUM`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn recorded_checksum(client: &Client, name: &str) -> Result<Option<String>> {
    let row = client.query_opt(RECORDED_CHECKSUM, &[&name]).await?;
    Ok(row.map(|r| r.try_get("checksum")).transpose()?)
}

/// Run the statements of an embedded file, `sql`; if they fail, end the
/// transaction a file that opens one leaves aborted ([`ROLLBACK`], its own
/// failure ignored), so that the session stays usable.
///
/// # Errors
/// [`crate::Error::Db`] with the file's failure.
pub(crate) async fn run_file(client: &Client, sql: &str) -> Result<()> {
    if let Err(e) = client.batch_execute(sql).await {
        let _ = client.batch_execute(ROLLBACK).await;
        return Err(e.into());
    }
    Ok(())
}

/// Record file `name` as applied with `checksum` ([`RECORD`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn record(client: &Client, name: &str, checksum: &str) -> Result<()> {
    client.execute(RECORD, &[&name, &checksum]).await?;
    Ok(())
}

/// The names of the indexes of `events.outbox` left invalid by an
/// interrupted concurrent build ([`INVALID_INDEXES`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn invalid_indexes(client: &Client) -> Result<Vec<String>> {
    names(client, INVALID_INDEXES).await
}

/// Whether relation `name` (a qualified name) exists ([`RELATION_EXISTS`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn relation_exists(client: &Client, name: &str) -> Result<bool> {
    Ok(client.query_one(RELATION_EXISTS, &[&name]).await?.try_get("present")?)
}

/// The names of the user triggers on `events.outbox` ([`OUTBOX_TRIGGERS`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn outbox_triggers(client: &Client) -> Result<Vec<String>> {
    names(client, OUTBOX_TRIGGERS).await
}

/// The column `name` of every row `sql` (no parameters) returns.
async fn names(client: &Client, sql: &str) -> Result<Vec<String>> {
    let rows = client.query(sql, &[]).await?;
    Ok(rows.iter().map(|r| r.try_get("name")).collect::<Result<_, _>>()?)
}

/// Does an insert trigger fire on `events.outbox` in ordinary sessions
/// (`tgenabled` `O`, origin, or `A`, always)? Not after `migrate --source
/// wal` in the producer-locked mode, which sets `outbox_wake` to `R`
/// (replica only).
const INSERT_TRIGGER_FIRES: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger \
       WHERE tgrelid = 'events.outbox'::regclass AND tgname IN ('outbox_order', 'outbox_wake') \
         AND tgenabled IN ('O', 'A')) AS fires";

/// Does an insert trigger fire in ordinary sessions
/// ([`INSERT_TRIGGER_FIRES`])?
///
/// # Errors
/// [`crate::Error::Db`].
pub(crate) async fn insert_trigger_fires<C: GenericClient + Sync>(client: &C) -> Result<bool> {
    Ok(client.query_one(INSERT_TRIGGER_FIRES, &[]).await?.try_get("fires")?)
}

/// The ordering mode installed ([`INSTALLED_ORDERING`]), `None` when
/// neither insert trigger is enabled.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn installed_ordering<C: GenericClient + Sync>(client: &C) -> Result<Option<OrderingMode>> {
    let row = client.query_one(INSTALLED_ORDERING, &[]).await.map_err(map_missing_schema)?;
    let mode: String = row.try_get("mode")?;
    Ok(OrderingMode::from_sql(&mode))
}

/// Switch the ordering mode to `mode` ([`SET_ORDERING`]); returns the mode
/// installed before, `None` when neither insert trigger was enabled.
///
/// # Errors
/// [`crate::Error::NotMigrated`] when `events.outbox_set_ordering()` or the
/// schema is missing; [`crate::Error::Db`] for any other failure (e.g.
/// SQLSTATE 55P03 when the table's lock was not had in time).
pub(crate) async fn set_ordering(client: &Client, mode: OrderingMode) -> Result<Option<OrderingMode>> {
    let row = client.query_one(SET_ORDERING, &[&mode.as_str()]).await.map_err(|e| {
        if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_FUNCTION) {
            return Error::NotMigrated(
                "events.outbox_set_ordering() does not exist (created by triggers/outbox_insert_order_and_notify.sql); \
                 run `pg-outbox migrate` first"
                    .into(),
            );
        }
        map_missing_schema(e)
    })?;
    let before: String = row.try_get("before")?;
    Ok(OrderingMode::from_sql(&before))
}

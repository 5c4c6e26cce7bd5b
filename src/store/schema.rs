//! What [`crate::migrate`] runs besides the embedded files: the ledger of
//! applied files, the statement timeout of a run, and the checks of the
//! server and the schema.

/// The server's version as a number (`server_version_num`, e.g. 150004) and
/// as text (`server_version`, e.g. "15.4").
pub(crate) const SERVER_VERSION: &str = "SELECT current_setting('server_version_num')::int4 AS num, \
     current_setting('server_version') AS version";

/// Turn the session's `statement_timeout` off for a run (the run's own
/// session, which ends with it).
pub(crate) const NO_STATEMENT_TIMEOUT: &str = "SET statement_timeout = 0";

/// Create the ledger of applied files, `events.outbox_schema_migrations`.
pub(crate) const CREATE_LEDGER: &str = "CREATE SCHEMA IF NOT EXISTS events; \
     CREATE TABLE IF NOT EXISTS events.outbox_schema_migrations ( \
       name TEXT PRIMARY KEY, checksum TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())";
/// The checksum recorded for file $1 (`checksum`), if any.
pub(crate) const RECORDED_CHECKSUM: &str = "SELECT checksum FROM events.outbox_schema_migrations WHERE name = $1";
/// Record file $1 as applied with checksum $2.
pub(crate) const RECORD: &str = "INSERT INTO events.outbox_schema_migrations (name, checksum) VALUES ($1, $2) \
     ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = now()";
/// End a transaction a failed file left open (a trigger file runs in one).
pub(crate) const ROLLBACK: &str = "ROLLBACK";

/// Indexes of `events.outbox` left invalid by an interrupted concurrent
/// build (`name`).
pub(crate) const INVALID_INDEXES: &str = "SELECT i.indexrelid::regclass::text AS name FROM pg_index i \
     WHERE i.indrelid = 'events.outbox'::regclass AND NOT i.indisvalid";
/// Whether relation $1 (a qualified name) exists (`present`).
pub(crate) const RELATION_EXISTS: &str = "SELECT to_regclass($1) IS NOT NULL AS present";
/// The names of the user triggers on `events.outbox` (`name`).
pub(crate) const OUTBOX_TRIGGERS: &str = "SELECT tgname::text AS name FROM pg_trigger \
     WHERE tgrelid = 'events.outbox'::regclass AND NOT tgisinternal";

/// The ordering mode installed on `events.outbox` (`mode`: `outbox-locked`
/// when the trigger `outbox_order` is enabled, else `producer-locked` when
/// `outbox_wake` is, else `none`), from `pg_trigger.tgenabled`
/// (triggers/outbox_insert_order_and_notify.sql, "Ordering modes").
pub(crate) const INSTALLED_ORDERING: &str = "SELECT CASE \
       WHEN bool_or(tgname = 'outbox_order' AND tgenabled <> 'D') THEN 'outbox-locked' \
       WHEN bool_or(tgname = 'outbox_wake' AND tgenabled <> 'D') THEN 'producer-locked' \
       ELSE 'none' END AS mode \
     FROM pg_trigger WHERE tgrelid = 'events.outbox'::regclass AND tgname IN ('outbox_order', 'outbox_wake')";
/// Switch the ordering mode to $1 (`outbox-locked` or `producer-locked`);
/// returns the mode installed before (`before`).
pub(crate) const SET_ORDERING: &str = "SELECT events.outbox_set_ordering($1) AS before";

//! Embedded schema migrations: `migrations/*.sql` then `triggers/*.sql`.
//!
//! Every file is plain SQL that `psql -f` can run and that is a no-op when
//! run twice. [`apply`] runs them on a session of its own under a session
//! advisory lock (so two relays starting at once do not race), records what it ran in
//! `events.outbox_schema_migrations`, and skips what is recorded. Trigger
//! files are re-applied only when their text changed.
//!
//! Both [`apply`] and [`check`] first check that the server is PostgreSQL
//! [`MIN_SERVER_VERSION`] or later.

use tokio_postgres::Client;

use crate::connect::{self, ConnectOptions, SessionSettings};
use crate::error::{Error, Result};
use crate::store::locks::{self, RunLock};
use crate::store::schema as store;
pub use crate::store::schema::OrderingMode;

/// Where a consumer learns that events committed. The same choice is the
/// relay's `--source` flag. Either way the events themselves are read from
/// `events.outbox` in id order, and hold-back, retries, dead letters,
/// leadership and the sweep are the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SourceKind {
    /// LISTEN for the insert trigger's NOTIFY (default). Needs an insert
    /// trigger (either ordering mode installs one).
    #[default]
    Listen,
    /// Read the server's logical replication stream (pgoutput) of inserts
    /// into `events.outbox`, through a temporary slot that the server drops
    /// when the connection ends (no WAL is kept while no consumer runs).
    /// Producers then need no insert trigger and never NOTIFY. Needs
    /// `wal_level = logical`, the REPLICATION privilege, a free slot and
    /// WAL sender, and the publication `pg-outbox migrate --source wal`
    /// creates; [`ConsumerBuilder::start`](crate::ConsumerBuilder::start) checks each and fails with
    /// [`Error::ReplicationSetup`] naming
    /// what to change. Feature `wal`.
    #[cfg(feature = "wal")]
    Wal,
}

impl std::fmt::Display for SourceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SourceKind::Listen => "listen",
            #[cfg(feature = "wal")]
            SourceKind::Wal => "wal",
        })
    }
}

/// Schema migrations, in order: (name, SQL). Numbered `NNNN_name`.
pub const MIGRATIONS: &[(&str, &str)] = &[
    ("0001_events_outbox", include_str!("../migrations/0001_events_outbox.sql")),
    ("0002_outbox_fresh_idx", include_str!("../migrations/0002_outbox_fresh_idx.sql")),
    ("0003_outbox_aggregate_failed_idx", include_str!("../migrations/0003_outbox_aggregate_failed_idx.sql")),
    ("0004_outbox_aggregate_heads", include_str!("../migrations/0004_outbox_aggregate_heads.sql")),
    ("0005_outbox_relays", include_str!("../migrations/0005_outbox_relays.sql")),
    ("0006_outbox_fresh_order_idx", include_str!("../migrations/0006_outbox_fresh_order_idx.sql")),
    ("0007_drop_outbox_fresh_idx", include_str!("../migrations/0007_drop_outbox_fresh_idx.sql")),
    ("0008_outbox_hint", include_str!("../migrations/0008_outbox_hint.sql")),
    ("0009_outbox_holdback_idx", include_str!("../migrations/0009_outbox_holdback_idx.sql")),
    ("0010_outbox_dead_letter_idx", include_str!("../migrations/0010_outbox_dead_letter_idx.sql")),
    ("0011_drop_outbox_aggregate_failed_idx", include_str!("../migrations/0011_drop_outbox_aggregate_failed_idx.sql")),
    ("0012_drop_legacy_notify_trigger", include_str!("../migrations/0012_drop_legacy_notify_trigger.sql")),
    ("0013_outbox_terms", include_str!("../migrations/0013_outbox_terms.sql")),
    ("0014_outbox_retention_marks", include_str!("../migrations/0014_outbox_retention_marks.sql")),
    ("0015_outbox_relays_identity", include_str!("../migrations/0015_outbox_relays_identity.sql")),
    ("0016_outbox_subscriptions", include_str!("../migrations/0016_outbox_subscriptions.sql")),
    ("0017_outbox_subscription_expiry", include_str!("../migrations/0017_outbox_subscription_expiry.sql")),
    ("0018_outbox_subscription_held_idx", include_str!("../migrations/0018_outbox_subscription_held_idx.sql")),
];

/// Trigger files, applied after the migrations: (name, SQL).
pub const TRIGGERS: &[(&str, &str)] = &[
    ("triggers/outbox_update_check_invariants", include_str!("../triggers/outbox_update_check_invariants.sql")),
    ("triggers/outbox_relays_refresh_hint", include_str!("../triggers/outbox_relays_refresh_hint.sql")),
    ("triggers/outbox_insert_order_and_notify", include_str!("../triggers/outbox_insert_order_and_notify.sql")),
    ("triggers/outbox_unblock", include_str!("../triggers/outbox_unblock.sql")),
    ("triggers/outbox_rewind", include_str!("../triggers/outbox_rewind.sql")),
];

/// The oldest PostgreSQL pg-outbox supports: 13 (`server_version_num`
/// 130000). The insert trigger needs `pg_current_xact_id()` (new in 13);
/// the rest needs 12 or older (`hashtextextended` and `uuid_hash_extended`
/// 11, `WITH ... AS MATERIALIZED` 12). `client_connection_check_interval`
/// (14) is used only where the server knows it.
pub const MIN_SERVER_VERSION: (i32, &str) = (130_000, "13");

/// `Ok` when `server_version_num` `num` is [`MIN_SERVER_VERSION`] or later;
/// else an error naming the server's version (`version`, as the server
/// spells it) and the version needed.
fn supported(num: i32, version: &str) -> Result<()> {
    let (min_num, min) = MIN_SERVER_VERSION;
    if num >= min_num {
        return Ok(());
    }
    Err(Error::UnsupportedServer(format!(
        "the server runs PostgreSQL {version} (server_version_num {num}); \
         pg-outbox needs PostgreSQL {min} or later (server_version_num {min_num} or more)"
    )))
}

/// Check the server's version (see [`MIN_SERVER_VERSION`]).
async fn check_server_version(client: &Client) -> Result<()> {
    let v = store::server_version(client).await?;
    supported(v.num, &v.version)
}

/// What [`apply`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Names of the files it ran, in order. Empty when the schema was
    /// already up to date.
    pub applied: Vec<String>,
}

fn checksum(sql: &str) -> String {
    // FNV-1a, 64 bit: a change detector, not a security measure.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in sql.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Apply every migration and trigger file that is not recorded yet, on a
/// database session of its own (application name `pg-outbox migrate`),
/// which it closes before returning.
///
/// The files build indexes `CONCURRENTLY`, so producers keep writing while
/// they build; such a build first waits for every transaction older than
/// it. Concurrent runs are serialised by a session advisory lock (polled
/// every 100 ms, never waited for in the server: a waiting session would
/// sit in a transaction that the holder's concurrent index build waits
/// for). The session runs with `statement_timeout` off, so a timeout set
/// for the role, the database or in the URL's `options` does not cut a
/// long index build.
///
/// # Errors
/// [`Error::Connect`] (or another connection error) if the session cannot
/// be opened; [`Error::SharedSessions`] if `pg` leads to a
/// transaction-mode pooler (its lock would stay behind there: use a direct
/// URL or a session-mode pooler's); [`Error::ReadOnlyStandby`] if the server is a hot standby
/// (a migration writes: point the URL at the primary); [`Error::UnsupportedServer`] before anything runs if the
/// server is older than [`MIN_SERVER_VERSION`], naming both versions;
/// [`Error::Db`] if a statement fails (nothing after it runs; the files are
/// idempotent, so running again after fixing the cause is safe), or
/// [`Error::NotMigrated`] naming an index left invalid by an interrupted
/// concurrent build, with the statement that removes it.
///
/// # Cancel safety
/// Dropping the future closes its session, which releases the lock (once a
/// statement still running in the server ends): nothing is left held on
/// any connection of the caller's. Files already applied stay applied; one
/// cut short is applied again by the next run (every file is idempotent),
/// and an index whose concurrent build was cut short is reported by the
/// next run as above.
///
/// # Example
/// ```no_run
/// # async fn run() -> Result<(), pg_outbox::Error> {
/// let pg = pg_outbox::ConnectOptions::parse("postgres://app@db.internal/app")?;
/// let report = pg_outbox::migrate::apply(&pg).await?;
/// for file in &report.applied {
///     println!("applied {file}");
/// }
/// # Ok(()) }
/// ```
pub async fn apply(pg: &ConnectOptions) -> Result<MigrationReport> {
    // Its lock and its `statement_timeout` are its session's.
    connect::require_own_sessions(pg, "migrate").await?;
    let (client, _link) = connect::connect(pg, "pg-outbox migrate", &SessionSettings::primary()).await?;
    check_server_version(&client).await?;
    store::no_statement_timeout(&client).await?;
    // Poll with pg_try_advisory_lock rather than wait in pg_advisory_lock:
    // a session waiting for the lock sits in a transaction, and
    // CREATE INDEX CONCURRENTLY in the session holding it waits for every
    // such transaction to end (docs, "Building Indexes Concurrently"), so
    // two `migrate` runs at once would deadlock.
    loop {
        if locks::try_lock(&client, RunLock::Migrate).await? {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // The lock ends with the session, when `client` is dropped (also when
    // this future is).
    apply_locked(&client).await
}

async fn apply_locked(client: &Client) -> Result<MigrationReport> {
    store::create_ledger(client).await?;
    let mut report = MigrationReport::default();
    for (name, sql) in MIGRATIONS.iter().chain(TRIGGERS.iter()) {
        let sum = checksum(sql);
        let recorded = store::recorded_checksum(client, name).await?;
        let is_trigger = name.starts_with("triggers/");
        let needed = match recorded {
            None => true,
            Some(s) => is_trigger && s != sum,
        };
        if !needed {
            continue;
        }
        // A file that opens its own transaction
        // (triggers/outbox_insert_order_and_notify.sql) leaves it aborted on
        // error: `run_file` ends it, so the session stays usable.
        store::run_file(client, sql).await?;
        store::record(client, name, &sum).await?;
        report.applied.push((*name).to_string());
    }
    if let Some(name) = store::invalid_indexes(client).await?.first() {
        return Err(Error::NotMigrated(format!(
            "index {name} is invalid (an earlier concurrent build was interrupted); \
             drop it with `DROP INDEX CONCURRENTLY {name}`"
        )));
    }
    Ok(report)
}

/// The ordering mode installed on `events.outbox`, or `None` when neither
/// insert trigger is enabled (someone ran `ALTER TABLE events.outbox
/// DISABLE TRIGGER ...`: relays then find new events by their sweep only,
/// and racing producers can commit an aggregate's events out of order).
///
/// # Errors
/// [`Error::Db`] if the catalog read fails, e.g. [`Error::NotMigrated`]
/// when `events.outbox` does not exist.
///
/// # Cancel safety
/// Cancel safe: it only reads.
///
/// # Example
/// ```no_run
/// # async fn run(client: &pg_outbox::tokio_postgres::Client) -> Result<(), pg_outbox::Error> {
/// match pg_outbox::migrate::ordering(client).await? {
///     Some(mode) => println!("ordering mode: {mode}"),
///     None => println!("no insert trigger enabled"),
/// }
/// # Ok(()) }
/// ```
pub async fn ordering<C: tokio_postgres::GenericClient + Sync>(client: &C) -> Result<Option<OrderingMode>> {
    store::installed_ordering(client).await
}

/// Install ordering mode `mode` on a database that [`apply`] migrated,
/// on a session of its own, and return the mode installed before (`None`
/// when neither insert trigger was enabled). Idempotent: installing the
/// installed mode changes nothing.
///
/// Safe while producers run: the switch takes `SHARE ROW EXCLUSIVE` on
/// `events.outbox`, so it waits for every running transaction that has
/// written events and every later one waits for it; no transaction writes
/// events under both modes. It waits at most 5 s for that lock (its
/// `lock_timeout`), so producers are never kept waiting longer than that.
/// Read [`OrderingMode::ProducerLocked`] before choosing it.
///
/// # Errors
/// [`Error::Connect`] (or another connection error) if the session cannot
/// be opened ([`Error::ReadOnlyStandby`] on a hot standby); [`Error::NotMigrated`] if `events.outbox_set_ordering()` is
/// missing (run [`apply`] first); [`Error::Db`] with SQLSTATE 55P03
/// (`lock_not_available`) when running producer transactions held the
/// table for 5 s (nothing changed; run it again), or another database
/// error (e.g. the role does not own `events.outbox`).
///
/// # Cancel safety
/// Dropping the future closes its session: the switch either committed or
/// rolled back, never half done.
///
/// # Example
/// ```no_run
/// # async fn run() -> Result<(), pg_outbox::Error> {
/// use pg_outbox::migrate::{self, OrderingMode};
/// let pg = pg_outbox::ConnectOptions::parse("postgres://app@db.internal/app")?;
/// migrate::apply(&pg).await?;
/// let before = migrate::set_ordering(&pg, OrderingMode::ProducerLocked).await?;
/// println!("ordering: producer-locked (was {before:?})");
/// # Ok(()) }
/// ```
pub async fn set_ordering(pg: &ConnectOptions, mode: OrderingMode) -> Result<Option<OrderingMode>> {
    let (client, _link) = connect::connect(pg, "pg-outbox migrate", &SessionSettings::primary()).await?;
    store::set_ordering(&client, mode).await
}

/// Prepare a database that [`apply`] migrated for a consumer's source, on a
/// session of its own, and return whether an insert trigger still fires.
///
/// [`SourceKind::Wal`]: create the publication
/// `pg_outbox` of inserts into `events.outbox` (if missing), and in the
/// producer-locked mode turn the wake-up trigger `outbox_wake` off for
/// ordinary sessions (`ENABLE REPLICA TRIGGER`: it fires only under
/// `session_replication_role = replica`), so that inserts run no trigger
/// at all. The outbox-locked mode keeps its trigger: it is what keeps each
/// aggregate's order. [`SourceKind::Listen`]:
/// turn `outbox_wake` back on in the producer-locked mode (the publication
/// stays; `DROP PUBLICATION pg_outbox` removes it). Switching the ordering
/// mode ([`set_ordering`]) turns `outbox_wake` on again: run this after it.
///
/// Safe while producers run, as [`set_ordering`]: `SHARE ROW EXCLUSIVE` on
/// `events.outbox`, waiting at most 5 s.
///
/// # Errors
/// As [`set_ordering`]; creating the publication needs the CREATE
/// privilege on the database and ownership of `events.outbox`.
#[cfg(feature = "wal")]
pub async fn set_source(pg: &ConnectOptions, source: SourceKind) -> Result<bool> {
    let (client, _link) = connect::connect(pg, "pg-outbox migrate", &SessionSettings::primary()).await?;
    crate::store::replication::set_source(&client, source != SourceKind::Listen).await
}

/// Objects the relay needs, each with the file that creates it.
const REQUIRED: &[(&str, &str)] = &[
    ("events.outbox", "0001_events_outbox"),
    ("events.outbox_fresh_order_idx", "0006_outbox_fresh_order_idx"),
    ("events.outbox_holdback_idx", "0009_outbox_holdback_idx"),
    ("events.outbox_dead_letter_idx", "0010_outbox_dead_letter_idx"),
    ("events.outbox_aggregate_heads", "0004_outbox_aggregate_heads"),
    ("events.outbox_relays", "0005_outbox_relays"),
    ("events.outbox_hint", "0008_outbox_hint"),
    ("events.outbox_terms", "0013_outbox_terms"),
];

/// Triggers the relay needs on `events.outbox`, with their files.
const REQUIRED_TRIGGERS: &[(&str, &str)] = &[
    ("outbox_guard", "triggers/outbox_update_check_invariants.sql"),
    ("outbox_order", "triggers/outbox_insert_order_and_notify.sql"),
    ("outbox_wake", "triggers/outbox_insert_order_and_notify.sql"),
    ("outbox_unblock", "triggers/outbox_unblock.sql"),
    ("outbox_unblock_delete", "triggers/outbox_unblock.sql"),
];

/// Check that the schema has what this version needs: the tables, indexes
/// and triggers that the embedded files create (whether `pg-outbox migrate`
/// or `psql -f` applied them).
///
/// # Errors
/// [`Error::UnsupportedServer`] if the server is older than [`MIN_SERVER_VERSION`],
/// naming both versions; [`Error::NotMigrated`] naming the first missing
/// object and its file; [`Error::Db`] if the check itself fails.
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn check(client: &Client) -> Result<()> {
    check_server_version(client).await?;
    for (object, file) in REQUIRED {
        if !store::relation_exists(client, object).await? {
            return Err(Error::NotMigrated(format!("{object} does not exist (created by {file})")));
        }
    }
    let names = store::outbox_triggers(client).await?;
    for (trigger, file) in REQUIRED_TRIGGERS {
        if !names.iter().any(|n| n == trigger) {
            return Err(Error::NotMigrated(format!("trigger {trigger} on events.outbox is missing ({file})")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_in_order_and_single_statement_when_concurrent() {
        for (i, (name, sql)) in MIGRATIONS.iter().enumerate() {
            assert!(name.starts_with(&format!("{:04}_", i + 1)), "{name}");
            if sql.contains("CONCURRENTLY") {
                let statements =
                    sql.lines().filter(|l| !l.trim_start().starts_with("--")).collect::<String>().matches(';').count();
                assert_eq!(statements, 1, "{name} must hold one statement");
            }
        }
    }

    #[test]
    fn the_server_version_is_compared_by_number() {
        assert!(supported(130_000, "13.0").is_ok());
        assert!(supported(150_020, "15.20").is_ok());
        assert!(supported(180_000, "18beta1").is_ok());
        let e = supported(120_022, "12.22").expect_err("12 is too old").to_string();
        assert!(e.contains("PostgreSQL 12.22 (server_version_num 120022)"), "{e}");
        assert!(e.contains("needs PostgreSQL 13 or later (server_version_num 130000 or more)"), "{e}");
        assert!(supported(90_624, "9.6.24").is_err());
    }

    #[test]
    fn every_trigger_file_says_what_it_does_and_names_its_locks() {
        for (name, sql) in TRIGGERS {
            for part in ["What it does:", "Fires:", "Needs: PostgreSQL 13", "Idempotent"] {
                assert!(sql.contains(part), "{name}: the header lacks {part:?}");
            }
            for (i, line) in sql.lines().enumerate() {
                if line.contains("1886322691") && !line.trim_start().starts_with("--") {
                    let near = sql.lines().skip(i.saturating_sub(3)).take(4).collect::<String>();
                    assert!(near.contains("Advisory lock keys"), "{name}:{}: name the docs table", i + 1);
                }
            }
            assert!(!sql.contains("DROP TRIGGER") && !sql.contains("DROP FUNCTION"), "{name}: drops go in migrations");
        }
    }

    #[test]
    fn checksum_detects_change() {
        assert_ne!(checksum("a"), checksum("b"));
        assert_eq!(checksum("a"), checksum("a"));
    }
}

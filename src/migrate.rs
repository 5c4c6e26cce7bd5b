//! Embedded schema migrations: `migrations/*.sql` then `triggers/*.sql`.
//!
//! Every file is plain SQL that `psql -f` can run and that is a no-op when
//! run twice. [`apply`] runs them under a session advisory lock (so two
//! relays starting at once do not race), records what it ran in
//! `events.outbox_schema_migrations`, and skips what is recorded. Trigger
//! files are re-applied only when their text changed.

use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::store::map_missing_schema;

/// Schema migrations, in order: (name, SQL). Numbered `NNNN_name`.
pub const MIGRATIONS: &[(&str, &str)] = &[
    ("0001_events_outbox", include_str!("../migrations/0001_events_outbox.sql")),
    ("0002_outbox_fresh_idx", include_str!("../migrations/0002_outbox_fresh_idx.sql")),
    ("0003_outbox_aggregate_failed_idx", include_str!("../migrations/0003_outbox_aggregate_failed_idx.sql")),
    ("0004_outbox_aggregate_heads", include_str!("../migrations/0004_outbox_aggregate_heads.sql")),
];

/// Trigger files, applied after the migrations: (name, SQL).
pub const TRIGGERS: &[(&str, &str)] = &[
    ("triggers/outbox_guard", include_str!("../triggers/outbox_guard.sql")),
    ("triggers/outbox_notify", include_str!("../triggers/outbox_notify.sql")),
    ("triggers/outbox_order", include_str!("../triggers/outbox_order.sql")),
];

/// Advisory lock key that serialises concurrent `migrate` runs.
const MIGRATE_LOCK_KEY: i64 = 0x7067_6f75_7462_6f78; // "pgoutbox"

const CREATE_LEDGER: &str = "CREATE SCHEMA IF NOT EXISTS events; \
     CREATE TABLE IF NOT EXISTS events.outbox_schema_migrations ( \
       name TEXT PRIMARY KEY, checksum TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())";

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

/// Apply every migration and trigger file that is not recorded yet.
///
/// Must run outside a transaction (indexes are built `CONCURRENTLY`, so
/// producers keep writing while they build).
///
/// # Errors
/// [`Error::Db`] if a statement fails (nothing after it runs; the files are
/// idempotent, so running again after fixing the cause is safe), or
/// [`Error::NotMigrated`] naming an index left invalid by an interrupted
/// concurrent build, with the statement that removes it.
pub async fn apply(client: &Client) -> Result<MigrationReport> {
    client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATE_LOCK_KEY]).await?;
    let result = apply_locked(client).await;
    let unlock = client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATE_LOCK_KEY]).await;
    let report = result?;
    unlock?;
    Ok(report)
}

async fn apply_locked(client: &Client) -> Result<MigrationReport> {
    client.batch_execute(CREATE_LEDGER).await?;
    let mut report = MigrationReport::default();
    for (name, sql) in MIGRATIONS.iter().chain(TRIGGERS.iter()) {
        let sum = checksum(sql);
        let recorded: Option<String> = client
            .query_opt("SELECT checksum FROM events.outbox_schema_migrations WHERE name = $1", &[name])
            .await?
            .map(|r| r.try_get(0))
            .transpose()?;
        let is_trigger = name.starts_with("triggers/");
        let needed = match recorded {
            None => true,
            Some(s) => is_trigger && s != sum,
        };
        if !needed {
            continue;
        }
        client.batch_execute(sql).await?;
        client
            .execute(
                "INSERT INTO events.outbox_schema_migrations (name, checksum) VALUES ($1, $2) \
                 ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = now()",
                &[name, &sum],
            )
            .await?;
        report.applied.push((*name).to_string());
    }
    let invalid = client
        .query(
            "SELECT i.indexrelid::regclass::text FROM pg_index i \
             WHERE i.indrelid = 'events.outbox'::regclass AND NOT i.indisvalid",
            &[],
        )
        .await?;
    if let Some(row) = invalid.first() {
        let name: String = row.try_get(0)?;
        return Err(Error::NotMigrated(format!(
            "index {name} is invalid (an earlier concurrent build was interrupted); \
             drop it with `DROP INDEX CONCURRENTLY {name}`"
        )));
    }
    Ok(report)
}

/// Check that every embedded migration and trigger has been applied.
///
/// # Errors
/// [`Error::NotMigrated`] naming the first missing file (or the missing
/// table); [`Error::Db`] if the check itself fails.
pub async fn check(client: &Client) -> Result<()> {
    let rows =
        client.query("SELECT name FROM events.outbox_schema_migrations", &[]).await.map_err(map_missing_schema)?;
    let have: Vec<String> = rows.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>()?;
    for (name, _) in MIGRATIONS.iter().chain(TRIGGERS.iter()) {
        if !have.iter().any(|h| h == name) {
            return Err(Error::NotMigrated(format!("{name} has not been applied")));
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
    fn checksum_detects_change() {
        assert_ne!(checksum("a"), checksum("b"));
        assert_eq!(checksum("a"), checksum("a"));
    }
}

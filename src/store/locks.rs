//! Every advisory lock pg-outbox takes (PostgreSQL docs, "Advisory Locks"),
//! with the statements that take them. `docs/architecture.md`, "Advisory
//! lock keys", lists the same keys for operators, and the trigger files name
//! that table where they use one.
//!
//! PostgreSQL keeps bigint keys and two-int4 keys apart (`objsubid` 1 and 2
//! in `pg_locks`), so a bigint key never meets a `(class, key)` pair. All
//! our keys spell "pgout" or "po" in their high bytes, to stay clear of
//! other applications' keys in the same database.

use tokio_postgres::GenericClient;

use crate::error::Result;

/// Single mode: the outbox's leader lock. Session level, bigint key
/// ("pgout\0\0\x01"). Held by the active consumer's work session for as long
/// as it is active; standbys try it every 250 ms ([`TRY_LEADER_LOCK`]), and
/// it is released when that session ends.
pub(crate) const LEADER_KEY: i64 = 0x7067_6f75_7400_0001;

/// Retention: one runner at a time. Session level, bigint key
/// ("pgout\0\0\x02"). Held by the session running `retention::run` for the
/// run; a second runner that cannot take it at once skips its run. Through
/// a transaction-mode pooler, transaction level instead, held by each batch.
const RETENTION_KEY: i64 = 0x7067_6f75_7400_0002;

/// `migrate`: serialises concurrent runs. Session level, bigint key
/// ("pgoutbox"). Held by the session running `migrate::apply` while it
/// applies the files; another run polls for it every 100 ms (never waits in
/// the lock: `CREATE INDEX CONCURRENTLY` would wait for the waiter's
/// transaction, a deadlock).
const MIGRATE_KEY: i64 = 0x7067_6f75_7462_6f78;

/// Partitioned mode: one lock per partition, `(PARTITION_CLASS,
/// partition)` with partition `0..partitions`. Session level, two int4.
/// Held by the work session of the consumer that owns the partition; taken
/// with [`TRY_PARTITION_LOCK`], given up with [`PARTITION_UNLOCK`].
pub(crate) const PARTITION_CLASS: i32 = 0x706f_0001;

/// Partitioned mode: one membership lock per consumer, `(MEMBER_CLASS,
/// random key)`. Session level, two int4. Held by each consumer's work
/// session for its lifetime ([`MEMBER_LOCK`]); [`COUNT_MEMBERS`] counts them
/// to tell how many consumers share the partitions.
pub(crate) const MEMBER_CLASS: i32 = 0x706f_0002;

/// Competing mode: one membership lock per consumer, `(COMPETING_CLASS,
/// its backend pid)`. Session level, two int4. Held by each competing
/// consumer's work session for its lifetime ([`COMPETING_LOCK`]): between
/// claims it holds nothing else, and the other relays' configuration check
/// (`super::leader`, `OTHER_CONFIGS`) must see it. A named subscription's
/// is its claim class plus one (`super::subscription::Reader::competing_class`).
pub(crate) const COMPETING_CLASS: i32 = 0x706f_0004;

/// The insert trigger's class (`triggers/outbox_insert_order_and_notify.sql`,
/// `triggers/outbox_relays_refresh_hint.sql`), 1886322691: two-int4 locks
/// `(TRIGGER_CLASS, BULK_GATE)` and `(TRIGGER_CLASS, HINT_WRITERS)`. The
/// same number seeds the hash of the per-aggregate lock key, a
/// transaction-level bigint lock
/// `uuid_hash_extended(aggregate_id, hashtextextended(aggregate_type,
/// 1886322691))` that each producer transaction holds on every aggregate it
/// writes, until it ends.
#[allow(dead_code, reason = "taken by the SQL in triggers/; named here for the registry")]
pub(crate) const TRIGGER_CLASS: i32 = 0x706f_0003;

/// `(TRIGGER_CLASS, BULK_GATE)`: the bulk gate. Transaction level, shared
/// mode, held by every bulk transaction (`events.outbox_bulk_begin()`) until
/// it ends; ordinary producers and the hint refresh try it in exclusive mode
/// to learn whether a bulk transaction runs.
#[allow(dead_code, reason = "taken by the SQL in triggers/; named here for the registry")]
pub(crate) const BULK_GATE: i32 = 1;

/// `(TRIGGER_CLASS, HINT_WRITERS)`: serialises writers of
/// `events.outbox_hint`. Transaction level in the hint refresh
/// (`events.outbox_hint_refresh()`), session level for a moment in
/// `events.outbox_bulk_begin()`.
#[allow(dead_code, reason = "taken by the SQL in triggers/; named here for the registry")]
pub(crate) const HINT_WRITERS: i32 = 2;

/// Single mode: try to take the leader lock ($1: [`LEADER_KEY`]).
pub(crate) const TRY_LEADER_LOCK: &str = TRY_LOCK;
/// Try to take the session lock of bigint key $1 without waiting.
const TRY_LOCK: &str = "SELECT pg_try_advisory_lock($1)";
/// Release the session lock of bigint key $1.
const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";
/// Try to take the lock of bigint key $1 for the running transaction
/// (released at its end) without waiting: a run's lock through a
/// transaction-mode pooler, where a session lock would stay behind.
const TRY_XACT_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1)";
/// Partitioned mode: hold a membership lock for this session ($1
/// [`MEMBER_CLASS`], $2 key).
pub(crate) const MEMBER_LOCK: &str = "SELECT pg_advisory_lock($1, $2)";
/// Competing mode: hold a membership lock for this session ($1, the
/// reader's competing class, [`COMPETING_CLASS`] for the default; key: the
/// backend pid).
pub(crate) const COMPETING_LOCK: &str = "SELECT pg_advisory_lock($1, pg_backend_pid())";
/// Partitioned mode: how many consumers hold a membership lock of class $1
/// in this database (two-int4 advisory locks have `objsubid = 2`,
/// PostgreSQL docs "pg_locks").
pub(crate) const COUNT_MEMBERS: &str = "SELECT count(*) AS members FROM pg_locks \
     WHERE locktype = 'advisory' AND granted \
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
       AND classid = ($1::int4)::bigint::oid AND objsubid = 2";
/// Partitioned mode: try to take partition $2 of class $1
/// ([`PARTITION_CLASS`]).
pub(crate) const TRY_PARTITION_LOCK: &str = "SELECT pg_try_advisory_lock($1, $2)";
/// Partitioned mode: give partition $2 of class $1 up.
pub(crate) const PARTITION_UNLOCK: &str = "SELECT pg_advisory_unlock($1, $2)";

/// A session-level lock of a bigint key that one session at a time holds
/// for a run of an operator's task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunLock {
    /// [`RETENTION_KEY`]: one retention run at a time.
    Retention,
    /// [`MIGRATE_KEY`]: one `migrate` run at a time.
    Migrate,
}

impl RunLock {
    /// The lock's key.
    fn key(self) -> i64 {
        match self {
            RunLock::Retention => RETENTION_KEY,
            RunLock::Migrate => MIGRATE_KEY,
        }
    }
}

/// Try to take `lock` for `client`'s session without waiting ([`TRY_LOCK`]);
/// returns whether it did. Held until [`unlock`] or the session's end.
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn try_lock<C: GenericClient + Sync>(client: &C, lock: RunLock) -> Result<bool> {
    Ok(client.query_one(TRY_LOCK, &[&lock.key()]).await?.try_get(0)?)
}

/// Try to take `lock` for `client`'s running transaction without waiting
/// ([`TRY_XACT_LOCK`]); returns whether it did. Held until the transaction
/// ends.
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn try_xact_lock<C: GenericClient + Sync>(client: &C, lock: RunLock) -> Result<bool> {
    Ok(client.query_one(TRY_XACT_LOCK, &[&lock.key()]).await?.try_get(0)?)
}

/// Release `lock`, which `client`'s session holds ([`UNLOCK`]).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails.
pub(crate) async fn unlock<C: GenericClient + Sync>(client: &C, lock: RunLock) -> Result<()> {
    client.execute(UNLOCK, &[&lock.key()]).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_and_the_trigger_class_is_the_one_in_the_sql() {
        let bigint = [LEADER_KEY, RETENTION_KEY, MIGRATE_KEY];
        let classes = [PARTITION_CLASS, MEMBER_CLASS, TRIGGER_CLASS];
        for (i, a) in bigint.iter().enumerate() {
            assert!(bigint[i + 1..].iter().all(|b| a != b), "bigint keys must differ");
        }
        for (i, a) in classes.iter().enumerate() {
            assert!(classes[i + 1..].iter().all(|b| a != b), "classes must differ");
        }
        assert_eq!(TRIGGER_CLASS, 1_886_322_691);
        assert_ne!(BULK_GATE, HINT_WRITERS);
        for (name, sql) in crate::migrate::TRIGGERS {
            for sub in sql.split("(1886322691, ").skip(1) {
                let k: i32 = sub.split(')').next().and_then(|k| k.trim().parse().ok()).unwrap_or(-1);
                assert!(k == BULK_GATE || k == HINT_WRITERS, "{name}: unknown key ({TRIGGER_CLASS}, {k})");
            }
        }
    }

    #[test]
    fn the_docs_table_lists_every_key() {
        let docs = include_str!("../../docs/architecture.md");
        for key in [
            format!("{LEADER_KEY:#x}"),
            format!("{RETENTION_KEY:#x}"),
            format!("{MIGRATE_KEY:#x}"),
            format!("{PARTITION_CLASS:#x}"),
            format!("{MEMBER_CLASS:#x}"),
            format!("{TRIGGER_CLASS:#x}"),
        ] {
            assert!(docs.contains(&key), "docs/architecture.md lacks {key}");
        }
    }
}

//! The WAL source's statements: what the server must offer before a
//! consumer reads its logical replication stream, the publication that
//! `pg-outbox migrate --source wal` creates, and the replication commands
//! (PostgreSQL docs, "Streaming Replication Protocol").

use tokio_postgres::GenericClient;

use crate::error::{Error, Result};

/// The publication the WAL source reads: `events.outbox`, inserts only
/// (updates, deletes and truncates are not published, so acknowledgements
/// and archiving send nothing down the stream).
pub(crate) const PUBLICATION: &str = "pg_outbox";

/// Create [`PUBLICATION`] unless it exists (`CREATE PUBLICATION` has no
/// `IF NOT EXISTS`). Run by `migrate --source wal`. From PostgreSQL 15 it
/// publishes the `id` column alone (a column list: PostgreSQL docs,
/// "Logical Replication", "Column Lists"), so an insert's message on the
/// stream is a few bytes whatever its payload; PostgreSQL 14 publishes the
/// whole row.
pub(crate) const CREATE_PUBLICATION: &str = "DO $$ BEGIN \
       IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = 'pg_outbox') THEN \
         IF current_setting('server_version_num')::int >= 150000 THEN \
           EXECUTE 'CREATE PUBLICATION pg_outbox FOR TABLE events.outbox (id) WITH (publish = ''insert'')'; \
         ELSE \
           CREATE PUBLICATION pg_outbox FOR TABLE events.outbox WITH (publish = 'insert'); \
         END IF; \
       END IF; \
     END $$";

/// What the server offers the WAL source, read on the work session in one
/// statement: `wal_level`; whether the user may open a replication
/// connection (superuser, the REPLICATION attribute, or Amazon RDS's
/// `rds_replication` role); replication slots and WAL senders left
/// (`max_replication_slots` minus `pg_replication_slots`, `max_wal_senders`
/// minus the running WAL senders of `pg_stat_replication`); and whether
/// [`PUBLICATION`] publishes inserts into `events.outbox`.
pub(crate) const READINESS: &str = "SELECT current_setting('server_version_num')::int AS version_num, \
       current_setting('server_version') AS version, \
       current_setting('wal_level') AS wal_level, \
       current_user::text AS usr, \
       (SELECT r.rolsuper OR r.rolreplication OR EXISTS ( \
           SELECT 1 FROM pg_catalog.pg_roles g \
            WHERE g.rolname = 'rds_replication' AND pg_catalog.pg_has_role(r.oid, g.oid, 'MEMBER')) \
          FROM pg_catalog.pg_roles r WHERE r.rolname = current_user) AS may_replicate, \
       current_setting('max_replication_slots')::int AS max_slots, \
       (SELECT count(*) FROM pg_catalog.pg_replication_slots)::int AS used_slots, \
       current_setting('max_wal_senders')::int AS max_senders, \
       (SELECT count(*) FROM pg_catalog.pg_stat_replication)::int AS used_senders, \
       EXISTS (SELECT 1 FROM pg_catalog.pg_publication p \
                 JOIN pg_catalog.pg_publication_tables t ON t.pubname = p.pubname \
                WHERE p.pubname = 'pg_outbox' AND p.pubinsert \
                  AND t.schemaname = 'events' AND t.tablename = 'outbox') AS published";

/// The oldest server the WAL source runs on, as `server_version_num`:
/// PostgreSQL 14 (the replication client sends pgoutput's `messages`
/// option, which 14 added).
pub(crate) const MIN_SERVER_VERSION: i32 = 140_000;

/// What [`READINESS`] read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Readiness {
    pub(crate) version_num: i32,
    pub(crate) version: String,
    pub(crate) wal_level: String,
    pub(crate) user: String,
    pub(crate) may_replicate: bool,
    pub(crate) max_slots: i32,
    pub(crate) used_slots: i32,
    pub(crate) max_senders: i32,
    pub(crate) used_senders: i32,
    pub(crate) published: bool,
}

impl Readiness {
    /// The first thing missing, as one line that says what to change.
    pub(crate) fn problem(&self) -> Option<String> {
        let user = &self.user;
        if self.version_num < MIN_SERVER_VERSION {
            return Some(format!(
                "the server runs PostgreSQL {}, and the WAL source needs 14 or later (its replication client \
                 asks pgoutput for logical decoding messages, an option PostgreSQL 14 added): use --source listen",
                self.version
            ));
        }
        if self.wal_level != "logical" {
            return Some(format!(
                "the server has wal_level = {}, and logical replication needs wal_level = logical: run \
                 ALTER SYSTEM SET wal_level = logical and restart the server (Amazon RDS and Aurora: set \
                 rds.logical_replication = 1 in the parameter group; Cloud SQL: the flag \
                 cloudsql.logical_decoding = on; Azure: wal_level = logical in the server parameters; Neon \
                 and Supabase: enable logical replication in the project's settings)",
                self.wal_level
            ));
        }
        if !self.may_replicate {
            return Some(format!(
                "user {user} may not open a replication connection: run ALTER ROLE {user} REPLICATION (Amazon \
                 RDS and Aurora: GRANT rds_replication TO {user}; Cloud SQL: ALTER ROLE {user} WITH REPLICATION \
                 as cloudsqlsuperuser)"
            ));
        }
        if self.used_slots >= self.max_slots {
            return Some(format!(
                "no replication slot is free (max_replication_slots = {}, {} in use): raise \
                 max_replication_slots (a restart is needed) or drop a slot nothing reads (see \
                 pg_replication_slots)",
                self.max_slots, self.used_slots
            ));
        }
        if self.used_senders >= self.max_senders {
            return Some(format!(
                "no WAL sender is free (max_wal_senders = {}, {} running): raise max_wal_senders (a restart is \
                 needed)",
                self.max_senders, self.used_senders
            ));
        }
        if !self.published {
            return Some(format!(
                "the publication {PUBLICATION} of inserts into events.outbox does not exist: run \
                 `pg-outbox migrate --source wal`"
            ));
        }
        None
    }
}

/// Read [`READINESS`] on `client`.
///
/// # Errors
/// [`Error::Db`] when the statement fails.
pub(crate) async fn readiness<C: GenericClient + Sync>(client: &C) -> Result<Readiness> {
    let row = client.query_one(READINESS, &[]).await?;
    Ok(Readiness {
        version_num: row.try_get("version_num")?,
        version: row.try_get("version")?,
        wal_level: row.try_get("wal_level")?,
        user: row.try_get("usr")?,
        may_replicate: row.try_get::<_, Option<bool>>("may_replicate")?.unwrap_or(false),
        max_slots: row.try_get("max_slots")?,
        used_slots: row.try_get("used_slots")?,
        max_senders: row.try_get("max_senders")?,
        used_senders: row.try_get("used_senders")?,
        published: row.try_get("published")?,
    })
}

/// Check on `client` that the WAL source can run.
///
/// # Errors
/// [`Error::ReplicationSetup`] naming the first thing to change;
/// [`Error::Db`] when the check itself fails.
pub(crate) async fn check<C: GenericClient + Sync>(client: &C) -> Result<()> {
    match readiness(client).await?.problem() {
        Some(problem) => Err(Error::ReplicationSetup(problem)),
        None => Ok(()),
    }
}

/// Create [`PUBLICATION`] unless it exists ([`CREATE_PUBLICATION`]).
///
/// # Errors
/// [`Error::Db`] when the statement fails (e.g. the user may not create
/// publications: it needs CREATE on the database and to own
/// `events.outbox`).
pub(crate) async fn create_publication<C: GenericClient + Sync>(client: &C) -> Result<()> {
    client.batch_execute(CREATE_PUBLICATION).await?;
    Ok(())
}

/// In the producer-locked mode (`outbox_order` off, `outbox_wake` on),
/// turn the wake-up trigger off for ordinary sessions: `ENABLE REPLICA`, so
/// it fires only under `session_replication_role = replica` (PostgreSQL
/// docs, "ALTER TABLE"), and inserts run no trigger at all. Waits at most
/// 5 s for the table's lock.
const WAKE_TRIGGER_OFF: &str = "BEGIN; SET LOCAL lock_timeout = '5s'; DO $$ BEGIN \
       IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid = 'events.outbox'::regclass \
                        AND tgname = 'outbox_order' AND tgenabled <> 'D') \
          AND EXISTS (SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid = 'events.outbox'::regclass \
                        AND tgname = 'outbox_wake' AND tgenabled = 'O') THEN \
         ALTER TABLE events.outbox ENABLE REPLICA TRIGGER outbox_wake; \
       END IF; \
     END $$; COMMIT";

/// The reverse of [`WAKE_TRIGGER_OFF`]: the wake-up trigger fires again.
const WAKE_TRIGGER_ON: &str = "BEGIN; SET LOCAL lock_timeout = '5s'; DO $$ BEGIN \
       IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid = 'events.outbox'::regclass \
                    AND tgname = 'outbox_wake' AND tgenabled = 'R') THEN \
         ALTER TABLE events.outbox ENABLE TRIGGER outbox_wake; \
       END IF; \
     END $$; COMMIT";

/// Prepare for the WAL source (`wal`: create [`PUBLICATION`], and in the
/// producer-locked mode stop the wake-up trigger) or for the listen
/// source (start it again); returns whether an insert trigger fires.
///
/// # Errors
/// [`Error::Db`] (SQLSTATE 55P03 when producers held the table 5 s).
pub(crate) async fn set_source(client: &tokio_postgres::Client, wal: bool) -> Result<bool> {
    if wal {
        create_publication(client).await?;
    }
    client
        .batch_execute(if wal { WAKE_TRIGGER_OFF } else { WAKE_TRIGGER_ON })
        .await
        .map_err(super::map_missing_schema)?;
    super::schema::insert_trigger_fires(client).await
}

/// The replication command that creates the WAL source's slot `slot`:
/// temporary (the server drops it when the connection ends, and at a
/// restart), `pgoutput`, no exported snapshot (the consumer reads the
/// table itself). The old syntax, which servers 10 to 18 accept.
pub(crate) fn create_slot_command(slot: &str) -> String {
    format!("CREATE_REPLICATION_SLOT {slot} TEMPORARY LOGICAL pgoutput NOEXPORT_SNAPSHOT")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready() -> Readiness {
        Readiness {
            version_num: 150_004,
            version: "15.4".into(),
            wal_level: "logical".into(),
            user: "app".into(),
            may_replicate: true,
            max_slots: 10,
            used_slots: 0,
            max_senders: 10,
            used_senders: 0,
            published: true,
        }
    }

    #[test]
    fn each_missing_piece_is_named_with_what_to_change() {
        assert_eq!(ready().problem(), None);
        let cases: [(Readiness, &str); 6] = [
            (Readiness { version_num: 130_020, version: "13.20".into(), ..ready() }, "needs 14 or later"),
            (Readiness { wal_level: "replica".into(), ..ready() }, "wal_level = replica"),
            (Readiness { may_replicate: false, ..ready() }, "ALTER ROLE app REPLICATION"),
            (Readiness { used_slots: 10, ..ready() }, "max_replication_slots = 10"),
            (Readiness { used_senders: 10, ..ready() }, "max_wal_senders = 10"),
            (Readiness { published: false, ..ready() }, "pg-outbox migrate --source wal"),
        ];
        for (r, needle) in cases {
            let problem = r.problem().unwrap_or_default();
            assert!(problem.contains(needle), "{problem:?} lacks {needle:?}");
            assert!(!problem.contains('\n'), "one line: {problem:?}");
        }
    }

    #[test]
    fn the_slot_is_temporary_and_exports_no_snapshot() {
        assert_eq!(
            create_slot_command("pg_outbox_ab"),
            "CREATE_REPLICATION_SLOT pg_outbox_ab TEMPORARY LOGICAL pgoutput NOEXPORT_SNAPSHOT"
        );
    }
}

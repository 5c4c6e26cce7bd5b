//! Wake-ups: LISTEN and NOTIFY, and the relays' registrations in
//! `events.outbox_relays` that tell producers whether to notify
//! (`triggers/outbox_relays_refresh_hint.sql`).

use tokio_postgres::GenericClient;

use crate::error::Result;

/// The channel the insert trigger notifies
/// (`triggers/outbox_insert_order_and_notify.sql`), and the consumer
/// listens on ([`Consumer::NOTIFY_CHANNEL`](crate::Consumer::NOTIFY_CHANNEL)).
pub(crate) const NOTIFY_CHANNEL: &str = "events.outbox";

/// Send notification payload $2 on channel $1 (the start-up probe, and the
/// wake-up after an operator made dead letters due or deleted them).
pub(crate) const NOTIFY: &str = "SELECT pg_notify($1, $2)";
/// Fraction of the notification queue in use (0..1).
pub(crate) const NOTIFICATION_QUEUE_USAGE: &str = "SELECT pg_notification_queue_usage() AS usage";
/// Send `payload` on `channel` ([`NOTIFY`]): listeners get it when the
/// transaction `client` is in commits (at once outside one).
///
/// # Errors
/// [`crate::Error::Db`] when the statement fails (e.g. the notification
/// queue is full).
pub(crate) async fn notify<C: GenericClient + Sync>(client: &C, channel: &str, payload: &str) -> Result<()> {
    client.execute(NOTIFY, &[&channel, &payload]).await?;
    Ok(())
}

/// The fraction (0 to 1) of the server's notification queue in use
/// ([`NOTIFICATION_QUEUE_USAGE`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
#[cfg(feature = "console")]
pub(crate) async fn notification_queue_usage<C: GenericClient + Sync>(client: &C) -> Result<f64> {
    let row = client.query_one(NOTIFICATION_QUEUE_USAGE, &[]).await.map_err(super::map_missing_schema)?;
    Ok(row.try_get("usage")?)
}

/// The listener's liveness ping: an empty query, one round trip.
const PING: &str = "";

/// LISTEN on `channel` ([`listen_sql`]).
pub(crate) async fn listen(client: &tokio_postgres::Client, channel: &str) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&listen_sql(channel)).await
}

/// The liveness ping ([`PING`]): one round trip.
pub(crate) async fn ping(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    client.simple_query(PING).await.map(drop)
}

/// `LISTEN` on `channel`, quoted as an identifier.
pub(crate) fn listen_sql(channel: &str) -> String {
    format!("LISTEN {}", quote_ident(channel))
}

/// Quote a name as an SQL identifier.
fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// How many sessions wait for the lock a notifying transaction holds through
/// its COMMIT. PostgreSQL takes it in `PreCommit_Notify`
/// (src/backend/commands/async.c: `LockSharedObject(DatabaseRelationId,
/// InvalidOid, 0, AccessExclusiveLock)`), so it shows in `pg_locks` as an
/// `object` lock on `pg_database` with database and objid 0; it is one lock
/// for the whole server. Waiters mean notifying commits are queueing.
pub(crate) const NOTIFY_LOCK_WAITERS: &str = "SELECT count(*) AS waiters FROM pg_catalog.pg_locks \
     WHERE locktype = 'object' AND database = 0 AND classid = 'pg_catalog.pg_database'::regclass \
       AND objid = 0 AND objsubid = 0 AND NOT granted";

/// Register this relay (its work connection's backend pid) as waiting for a
/// wake-up ($1 = true) or as busy draining ($1 = false). Refreshes its
/// heartbeat too (`updated_at`, see [`HEARTBEAT`]).
pub(crate) const SET_WAITING: &str = "INSERT INTO events.outbox_relays (pid, waiting) VALUES (pg_backend_pid(), $1) \
     ON CONFLICT (pid) DO UPDATE SET waiting = EXCLUDED.waiting, updated_at = now()";
/// Forget relays whose sessions are gone (their `waiting` no longer means
/// anything), and refresh this session's heartbeat: the `updated_at` of its
/// own row, if it has one (a relay that fetches; a standby has none). One
/// statement every few seconds from each relay (`consumer::maintenance`);
/// standbys read the heartbeat to tell a live leader from a stranded lock
/// ([`super::leader`]). The two parts touch different rows: a session's
/// own pid is never gone.
pub(crate) const HEARTBEAT: &str = "WITH gone AS (DELETE FROM events.outbox_relays r \
       WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a WHERE a.pid = r.pid)) \
     UPDATE events.outbox_relays SET updated_at = now() WHERE pid = pg_backend_pid()";
/// Stop receiving wake-ups: drop this session's row.
pub(crate) const UNREGISTER: &str = "DELETE FROM events.outbox_relays WHERE pid = pg_backend_pid()";

#[cfg(test)]
mod tests {
    #[test]
    fn channel_is_quoted() {
        assert_eq!(super::listen_sql("events.outbox"), "LISTEN \"events.outbox\"");
        assert_eq!(super::quote_ident("a\"b"), "\"a\"\"b\"");
    }
}

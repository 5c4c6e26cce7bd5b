//! Single mode's leader lock ([`super::locks::LEADER_KEY`]) as the others see it: which
//! session holds it, and whether that holder is a live relay. For standbys
//! (`consumer::leadership::stranded`) and for [`crate::status::read`]. And the
//! leader's term (`events.outbox_terms`, migration 0013): taken with the
//! lock ([`TAKE_TERM`]), confirmed ([`CURRENT_TERM`]), released at a
//! graceful stop ([`RELEASE_TERM`]); docs/architecture.md, "Leadership
//! terms".
//!
//! The liveness signal is the holder's heartbeat: every relay that fetches
//! has a row in `events.outbox_relays` keyed by its work session's backend
//! pid, and refreshes its `updated_at` every few seconds
//! ([`super::wakeup::HEARTBEAT`]; the leader registers at once when it takes
//! the lock, [`TAKE_TERM`]). A holder is **live** when that row's
//! `updated_at` is within the threshold, or when it is running a statement
//! it began within the threshold of its last heartbeat (a relay busy in a
//! long statement; the statement timeout bounds those). Anything else (no
//! row: an older build, a pooler's server session, a plain session; a stale
//! row: a frozen process, a cut network) is **stranded**. Every time is the
//! database's `now()`.

use chrono::{DateTime, Utc};
use tokio_postgres::{GenericClient, Row};

use crate::error::Result;
use crate::term::Term;

/// Heartbeat age after which the holder of single mode's outbox lock is
/// stranded, by default: 15 s (`ConsumerBuilder::DEFAULT_STRANDED_AFTER`,
/// and what `status` judges holders against).
pub(crate) const DEFAULT_STRANDED_AFTER: std::time::Duration = std::time::Duration::from_secs(15);

/// [`LEADER_HOLDER`]'s text, for `concat!` ([`TERMINATE_STRANDED`] runs
/// it as a subquery).
macro_rules! leader_holder {
    () => {
        "SELECT l.pid, a.application_name, host(a.client_addr) AS client_addr, \
       a.state, a.backend_start, \
       EXTRACT(EPOCH FROM (now() - a.state_change))::float8 AS state_secs, \
       EXTRACT(EPOCH FROM (now() - r.updated_at))::float8 AS heartbeat_age, \
       coalesce(r.updated_at >= now() - make_interval(secs => $2::float8), false) AS beating, \
       coalesce(a.state = 'active' AND a.wait_event_type IS DISTINCT FROM 'Client' \
         AND a.query_start <= r.updated_at + make_interval(secs => $2::float8), false) AS busy \
     FROM pg_catalog.pg_locks l \
       LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
       LEFT JOIN events.outbox_relays r ON r.pid = l.pid \
     WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL AND l.objsubid = 1 \
       AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
       AND l.classid = ($1::bigint >> 32)::oid AND l.objid = ($1::bigint & 4294967295)::oid"
    };
}

/// The holder of the advisory lock of bigint key $1, with its liveness
/// against a threshold of $2 seconds (`float8`): `pid`, `application_name`,
/// `client_addr` (NULL over a Unix socket, or when the viewer may not see
/// it), `state`, `backend_start`, `state_secs` (since `state` last
/// changed), `heartbeat_age` (NULL without a row), `beating` (a row
/// refreshed within $2 s) and `busy` (running a statement, not waiting on
/// its client, begun at most $2 s after its last heartbeat). Zero rows when
/// nobody holds it. `pg_stat_activity` shows other roles' sessions without
/// their state and address unless the viewer has `pg_read_all_stats`: such
/// a holder is never `busy`.
pub(crate) const LEADER_HOLDER: &str = leader_holder!();

/// End the holder of the lock of bigint key $1 with `pg_terminate_backend`
/// if it is still backend $3 started at $4 and still stranded against $2
/// seconds ([`LEADER_HOLDER`]): the check and the signal in one statement,
/// so a holder that came back to life, or a new session that got the pid,
/// is left alone. One row `ended` (the server's answer) when it was
/// signalled, none when it no longer qualified. Refused with SQLSTATE 42501
/// unless the caller is a superuser, has the holder's role's privileges, or
/// is a member of `pg_signal_backend` (a superuser's session: only a
/// superuser).
pub(crate) const TERMINATE_STRANDED: &str = concat!(
    "SELECT pg_terminate_backend(h.pid) AS ended FROM (",
    leader_holder!(),
    ") h WHERE h.pid = $3 AND h.backend_start IS NOT DISTINCT FROM $4 AND NOT h.beating AND NOT h.busy"
);

pub(crate) use super::subscription::OUTBOX_SCOPE;

/// The scope of partitioned mode's term for partition `p` of `partitions`
/// in `events.outbox_terms`: `partition:P/N` (a consumer configured with
/// another number of partitions takes other locks and other terms).
#[cfg(test)]
pub(crate) fn partition_scope(p: i32, partitions: u32) -> String {
    format!("partition:{p}/{partitions}")
}

/// Record the session that just took the leader lock as the holder of
/// scope $1's term and bump that term; in the same statement, register it
/// in `events.outbox_relays`, its first heartbeat, so standbys and `status`
/// see a live holder at once (a new row says it waits for wake-ups, the
/// safe value: producers notify, until its first fetch writes what the
/// wake-up policy decides). The bump waits for acknowledgements and
/// failures still being written under the old term (each holds a `FOR
/// SHARE` lock on the row, [`super::settle`]); once it commits, no write
/// under an older term changes anything.
///
/// The new term is one more than the greatest term of any leadership scope
/// (`'outbox'` and every `'partition:P/N'`; not the unblock and rewind
/// counts), not only of scope $1: an aggregate moves to another scope when
/// the mode or the number of partitions changes, and a destination that
/// refuses a lower term per aggregate must still see its terms grow.
///
/// One row: `term` (the new one, 1 the first time) and `previous_released`
/// (the previous holder marked its term released at a graceful stop,
/// [`RELEASE_TERM`]; true when there was none), and `previous_term` (scope
/// $1's term before, NULL when there was none). `previous_released` is
/// false too while a scope of another configuration, whose aggregates
/// overlap $1's (`'outbox'` against any partition; `'partition:P/N'`
/// against another N), holds a term not released: its holder crashed or
/// froze before the mode or the partition count changed, and may still be
/// within its hand-out lease.
///
/// A named subscription's scopes (`'subscription:NAME'` in single mode,
/// `'subscription:NAME:partition:P/N'` in partitioned mode) are a family of
/// their own, with the same rules inside it: its terms grow from its own,
/// and no other family's holder delivers its events.
pub(crate) const TAKE_TERM: &str = "WITH reg AS ( \
       INSERT INTO events.outbox_relays (pid, waiting) VALUES (pg_backend_pid(), true) \
       ON CONFLICT (pid) DO UPDATE SET updated_at = now() RETURNING pid), \
     fam AS (SELECT CASE WHEN starts_with($1, 'subscription:') \
         THEN 'subscription:' || split_part($1, ':', 2) ELSE 'outbox' END AS whole, \
       CASE WHEN starts_with($1, 'subscription:') \
         THEN 'subscription:' || split_part($1, ':', 2) || ':partition:' ELSE 'partition:' END AS parts), \
     prev AS (SELECT released, term FROM events.outbox_terms WHERE scope = $1), \
     others AS (SELECT bool_and(o.released) AS released FROM events.outbox_terms o, fam \
       WHERE (o.scope = fam.whole OR starts_with(o.scope, fam.parts)) AND o.scope <> $1 \
         AND (o.scope = fam.whole OR $1 = fam.whole OR split_part(o.scope, '/', 2) <> split_part($1, '/', 2))), \
     next AS (SELECT coalesce(max(term), 0) + 1 AS term FROM events.outbox_terms, fam \
       WHERE scope = fam.whole OR starts_with(scope, fam.parts)), \
     t AS ( \
       INSERT INTO events.outbox_terms AS t (scope, term, holder_pid, holder_started, taken_at, released) \
       SELECT $1, (SELECT term FROM next), pid, \
              (SELECT backend_start FROM pg_catalog.pg_stat_activity WHERE pid = pg_backend_pid()), now(), false \
       FROM reg \
       ON CONFLICT (scope) DO UPDATE SET term = greatest(t.term, excluded.term - 1) + 1, \
         holder_pid = excluded.holder_pid, \
         holder_started = excluded.holder_started, taken_at = now(), released = false \
       RETURNING term) \
     SELECT (SELECT term FROM t) AS term, \
       coalesce((SELECT released FROM prev), true) AND coalesce((SELECT released FROM others), true) \
         AS previous_released, \
       (SELECT term FROM prev) AS previous_term";

/// Raise scope $1's term, just taken by this session, to $2 + 1 (`int8`):
/// the database's terms went back below one this consumer had already
/// seen (an asynchronous failover lost the last bumps, or a restore). One
/// row, `term`; none when this session no longer holds the scope's term.
pub(crate) const RAISE_TERM: &str = "UPDATE events.outbox_terms SET term = $2::int8 + 1 \
     WHERE scope = $1 AND holder_pid = pg_backend_pid() AND term <= $2::int8 RETURNING term";

/// Scope $1's current term (`term`, NULL when none was ever taken) and its
/// holder's backend pid (`holder_pid`): a leader confirming that its term
/// is still current before it hands out more of what it fetched, and
/// `status`.
pub(crate) const CURRENT_TERM: &str = "SELECT (SELECT term FROM events.outbox_terms WHERE scope = $1) AS term, \
       (SELECT holder_pid FROM events.outbox_terms WHERE scope = $1) AS holder_pid";

/// The current terms of the scopes $1 (`text[]`): one row per scope that
/// has one, `scope` and `term`. A partitioned consumer confirming that the
/// terms of the partitions it holds are still current.
pub(crate) const CURRENT_TERMS: &str = "SELECT scope, term FROM events.outbox_terms WHERE scope = ANY($1::text[])";

/// Whether the current role may take, confirm and release terms
/// (`SELECT`, `INSERT` and `UPDATE` on `events.outbox_terms`): one row,
/// `allowed`, with the role's name, `role`.
pub(crate) const TERM_PRIVILEGES: &str = "SELECT current_user::text AS role, \
       has_table_privilege('events.outbox_terms', 'SELECT') \
       AND has_table_privilege('events.outbox_terms', 'INSERT') \
       AND has_table_privilege('events.outbox_terms', 'UPDATE') AS allowed";

/// Mark term $2 of scope $1 released: its holder stops and hands out
/// nothing more, so the next leader may start at once. Changes nothing
/// when the term is no longer current.
pub(crate) const RELEASE_TERM: &str = "UPDATE events.outbox_terms SET released = true WHERE scope = $1 AND term = $2";

/// Have the server end this session once it has sat idle for $1
/// milliseconds (`text`): `idle_session_timeout` (PostgreSQL 14+, docs
/// "Client Connection Defaults"), for the rest of the session. Ending the
/// session releases its advisory locks, so a leader that stops talking to
/// the server loses leadership within that bound. One row, `set`: the
/// setting now, NULL on a server without it (PostgreSQL 13), where nothing
/// changes.
pub(crate) const BOUND_IDLE: &str = "SELECT CASE WHEN current_setting('server_version_num')::int >= 140000 \
       THEN set_config('idle_session_timeout', $1::text, false) END AS set";

/// Have the server end this session once it has sat idle inside a
/// transaction for $1 milliseconds (`text`):
/// `idle_in_transaction_session_timeout` (docs "Client Connection
/// Defaults"; every supported server), for the rest of the session.
/// Competing mode's claim transaction is open while its events are
/// delivered: ending the session rolls it back and releases its claims,
/// so a consumer that stops talking to the server hands its claimed
/// events to the others within that bound. One row, `set`.
pub(crate) const BOUND_IDLE_IN_CLAIM: &str =
    "SELECT set_config('idle_in_transaction_session_timeout', $1::text, false) AS set";

/// Record which relay this session belongs to in its row of
/// `events.outbox_relays` (created if missing, as a waiting relay: the
/// safe value, as [`TAKE_TERM`]'s): its process id $1 (`int4`), host name
/// $2 and version $3 (migration 0015). Fails with SQLSTATE 42703 on a
/// schema without those columns.
pub(crate) const REGISTER_IDENTITY: &str = "INSERT INTO events.outbox_relays \
       (pid, waiting, relay_pid, relay_host, relay_version) VALUES (pg_backend_pid(), true, $1, $2, $3) \
     ON CONFLICT (pid) DO UPDATE SET relay_pid = excluded.relay_pid, relay_host = excluded.relay_host, \
       relay_version = excluded.relay_version, updated_at = now()";

/// A statement that does nothing but tell the server the session is alive
/// (its `idle_session_timeout` counts from the end of the last statement).
pub(crate) const KEEP_ALIVE: &str = "SELECT 1";

/// Refuse a role that cannot take a term ([`TERM_PRIVILEGES`]) at start,
/// rather than once it has taken the lock: `Err` names the role and the
/// `GRANT` it needs.
///
/// # Errors
/// [`crate::Error::Config`] when a privilege is missing;
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`] when the check
/// cannot run.
pub(crate) async fn check_term_privileges<C: GenericClient + Sync>(client: &C) -> Result<()> {
    let row = client.query_one(TERM_PRIVILEGES, &[]).await.map_err(super::map_missing_schema)?;
    if row.try_get::<_, bool>("allowed")? {
        return Ok(());
    }
    let role: String = row.try_get("role")?;
    Err(crate::error::Error::Config(format!(
        "role {role:?} may not take the leadership term: a relay in single or partitioned mode needs SELECT, \
         INSERT and UPDATE on events.outbox_terms (migration 0013); run GRANT SELECT, INSERT, UPDATE ON events.outbox_terms TO \
         \"{role}\""
    )))
}

/// The delivery configurations other sessions of this database hold,
/// read from their advisory locks (`store::locks`): one row per lock,
/// `pid`, `config`: `single` (the leader lock, $1), `partitioned` (a
/// membership lock, class $2), or `partitioned N` (the lock of partition P,
/// class $3, whose holder took the term of scope `$4P/N`, $4 being
/// `partition:` or a subscription's `subscription:NAME:partition:`), and
/// `older`: whether that session started before this one (backend start,
/// then pid). Another role's session shows no backend start in
/// `pg_stat_activity` without `pg_read_all_stats`; then the start it
/// recorded with its term (`holder_started`) stands in, and `older` is NULL
/// when it recorded none; and `relay_pid`, `relay_host`: which relay
/// process it belongs to, as it registered (migration 0015; NULL when it
/// did not); and `competing` (competing mode's membership lock, class $5,
/// held by every competing consumer's work session). A single-mode standby
/// holds no lock and is not seen.
const OTHER_CONFIGS: &str = "SELECT l.pid, CASE \
       WHEN l.objsubid = 1 THEN 'single' \
       WHEN l.classid = ($5::int4)::bigint::oid THEN 'competing' \
       WHEN l.classid = ($2::int4)::bigint::oid THEN 'partitioned' \
       ELSE coalesce((SELECT 'partitioned ' || split_part(t.scope, '/', 2) FROM events.outbox_terms t \
         WHERE t.holder_pid = l.pid AND starts_with(t.scope, $4::text || l.objid::text || '/') LIMIT 1), \
         'partitioned') \
       END AS config, \
       (coalesce((SELECT a.backend_start FROM pg_catalog.pg_stat_activity a WHERE a.pid = l.pid), \
                 (SELECT max(t.holder_started) FROM events.outbox_terms t WHERE t.holder_pid = l.pid)), l.pid) \
         < ((SELECT me.backend_start FROM pg_catalog.pg_stat_activity me WHERE me.pid = pg_backend_pid()), \
            pg_backend_pid()) AS older, \
       (SELECT r.relay_pid FROM events.outbox_relays r WHERE r.pid = l.pid) AS relay_pid, \
       (SELECT r.relay_host FROM events.outbox_relays r WHERE r.pid = l.pid) AS relay_host \
     FROM pg_catalog.pg_locks l \
     WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL AND l.pid <> pg_backend_pid() \
       AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
       AND ((l.objsubid = 1 AND l.classid = ($1::bigint >> 32)::oid AND l.objid = ($1::bigint & 4294967295)::oid) \
         OR (l.objsubid = 2 AND l.classid IN (($2::int4)::bigint::oid, ($3::int4)::bigint::oid, \
                                              ($5::int4)::bigint::oid)))";

/// Refuse to start a consumer configured as `mine` (`single`,
/// `partitioned N` or `competing`) on an outbox (for a named subscription
/// `reader`, on that subscription) that other relays deliver with another
/// configuration, as their locks show ([`OTHER_CONFIGS`]): a single-mode
/// relay beside partitioned ones, or a competing relay beside either,
/// delivers every event twice, and relays
/// with different partition counts take the same partitions' locks under
/// other terms. A member whose partition count cannot be told (it holds no
/// partition yet) passes.
///
/// # Errors
/// [`crate::Error::Config`] naming the other relay's configuration and
/// backend pid; [`crate::Error::Db`] when `pg_locks` cannot be read.
pub(crate) async fn check_configuration<C: GenericClient + Sync>(
    client: &C,
    reader: &super::subscription::Reader,
    mine: &str,
) -> Result<()> {
    match configuration_conflict(client, reader, mine, false).await? {
        Some(e) => Err(crate::error::Error::Config(e)),
        None => Ok(()),
    }
}

/// Another configuration than `mine` among the relays of `reader`'s
/// outbox or subscription ([`check_configuration`]), as the message to
/// stop with; with `only_older`, only one held by a session that started
/// before this one (relays that started together, or one that reconnected
/// beside another started meanwhile, passed the check at start: the
/// younger of two yields, so that one of them goes on).
///
/// # Errors
/// [`crate::Error::Db`] when `pg_locks` cannot be read (or the schema is
/// missing: [`crate::Error::NotMigrated`]).
pub(crate) async fn configuration_conflict<C: GenericClient + Sync>(
    client: &C,
    reader: &super::subscription::Reader,
    mine: &str,
    only_older: bool,
) -> Result<Option<String>> {
    let rows = other_configurations(client, reader).await.map_err(super::map_missing_schema)?;
    Ok(conflict_among(&rows, reader, mine, only_older)?)
}

/// The rows of [`OTHER_CONFIGS`] for `reader`'s locks.
pub(crate) async fn other_configurations<C: GenericClient + Sync>(
    client: &C,
    reader: &super::subscription::Reader,
) -> std::result::Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let (leader, member, partition) = (reader.leader_key(), reader.member_class(), reader.partition_class());
    let (prefix, competing) = (reader.partition_scope_prefix(), reader.competing_class());
    client.query(OTHER_CONFIGS, &[&leader, &member, &partition, &prefix, &competing]).await
}

/// The first of `rows` ([`OTHER_CONFIGS`]) whose configuration differs
/// from `mine` (with `only_older`, held by an older session), as the
/// message to refuse or stop with ([`configuration_conflict`]).
pub(crate) fn conflict_among(
    rows: &[tokio_postgres::Row],
    reader: &super::subscription::Reader,
    mine: &str,
    only_older: bool,
) -> std::result::Result<Option<String>, tokio_postgres::Error> {
    let what = match reader.subscription() {
        Some(name) => format!("subscription {name:?}"),
        None => "this outbox".to_string(),
    };
    for row in rows {
        let (pid, other, older): (i32, String, Option<bool>) =
            (row.try_get("pid")?, row.try_get("config")?, row.try_get("older")?);
        let relay = match (row.try_get::<_, Option<i32>>("relay_pid")?, row.try_get::<_, Option<String>>("relay_host")?)
        {
            (Some(p), Some(h)) => format!(", relay process {p} on {h}"),
            (Some(p), None) => format!(", relay process {p}"),
            _ => String::new(),
        };
        let differs = match (mine, other.as_str()) {
            (m, o) if m == o => false,
            // A member that holds no partition yet: its count is unknown.
            (m, "partitioned") => !m.starts_with("partitioned "),
            _ => true,
        };
        // Of unknown age (another role's session that took no term): it
        // may be the younger, which stops; this one goes on.
        if differs && (older == Some(true) || !only_older) {
            let twice = "a single-mode relay beside partitioned ones, or a competing one beside either, delivers every \
                         event twice";
            return Ok(Some(format!(
                "another relay delivers {what} as {other} (backend pid {pid}{relay}), and this one is configured as \
                 {mine}: one outbox (and each subscription) runs one delivery configuration ({twice}; different \
                 --partitions leave events no relay reads and deliver others twice); start this one with the same \
                 --mode and --partitions, or stop the others first"
            )));
        }
    }
    Ok(None)
}

/// A partition of partitioned mode and the session holding its lock, as
/// `OutboxStatus::partitions` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct PartitionHolder {
    /// The partition, from 0.
    pub partition: i32,
    /// How many partitions its holder divides the outbox into
    /// (`--partitions`), from the scope of the term it took (`partition:P/N`);
    /// `None` when it took none.
    pub partitions: Option<u32>,
    /// The holder's backend process id.
    pub pid: i32,
    /// The leadership term the holder took of the partition; `None` when
    /// it took none (or the schema predates terms).
    pub term: Option<crate::term::Term>,
    /// Which relay holds it (process id, host, version); `None` when it
    /// recorded none (an earlier build, a schema before migration 0015).
    pub relay: Option<RelayIdentity>,
    /// Age of the holder's heartbeat in seconds, by the database's clock;
    /// `None` without a registration.
    pub heartbeat_age_seconds: Option<f64>,
}

/// Partitioned mode's partition locks held in this database (class $1),
/// with the term each holder took of its partition (`term`, and
/// `partitions`, the N of scope `$2P/N`, $2 being `partition:` or a
/// subscription's `subscription:NAME:partition:`; NULL when none).
const PARTITION_HOLDERS: &str = "SELECT l.objid::int8::int4 AS partition, l.pid, t.term, \
       nullif(split_part(t.scope, '/', 2), '')::int8 AS partitions \
     FROM pg_catalog.pg_locks l \
       LEFT JOIN events.outbox_terms t ON t.holder_pid = l.pid AND starts_with(t.scope, $2::text || l.objid::text || '/') \
     WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL AND l.objsubid = 2 \
       AND l.classid = ($1::int4)::bigint::oid \
       AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
     ORDER BY 1, 2";

/// Each partition lock of `reader` (the default subscription, or a named
/// one) held, by partition ([`PARTITION_HOLDERS`]); without
/// `events.outbox_terms` (a schema from before migration 0013), none.
///
/// # Errors
/// [`crate::Error::Db`] when `pg_locks` cannot be read.
pub(crate) async fn partition_holders<C: GenericClient + Sync>(
    client: &C,
    reader: &super::subscription::Reader,
) -> Result<Vec<PartitionHolder>> {
    let has_terms: bool =
        client.query_one("SELECT to_regclass('events.outbox_terms') IS NOT NULL", &[]).await?.try_get(0)?;
    if !has_terms {
        return Ok(Vec::new());
    }
    let (class, prefix) = (reader.partition_class(), reader.partition_scope_prefix());
    let rows = client.query(PARTITION_HOLDERS, &[&class, &prefix]).await?;
    let pids: Vec<i32> = rows.iter().map(|r| r.try_get("pid")).collect::<std::result::Result<_, _>>()?;
    let mut pids_sorted = pids.clone();
    pids_sorted.sort_unstable();
    pids_sorted.dedup();
    let identities = identities(client, &pids_sorted).await?;
    rows.iter()
        .map(|r| {
            let pid: i32 = r.try_get("pid")?;
            let (relay, age) = identities.get(&pid).cloned().map_or((None, None), |(r, a)| (r, Some(a)));
            Ok(PartitionHolder {
                partition: r.try_get("partition")?,
                partitions: r.try_get::<_, Option<i64>>("partitions")?.and_then(|n| u32::try_from(n).ok()),
                pid,
                term: r.try_get("term")?,
                relay,
                heartbeat_age_seconds: age,
            })
        })
        .collect()
}

/// Which relay a registered work session belongs to, as the relay
/// recorded it when it took leadership (`events.outbox_relays`, migration
/// 0015): its own process id (not the server backend's), the host name of
/// its machine, and its pg-outbox version.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RelayIdentity {
    /// The relay's operating-system process id.
    pub process_id: i32,
    /// The host name of the machine it runs on (`gethostname`), as sent.
    pub host: String,
    /// Its pg-outbox version (`CARGO_PKG_VERSION`).
    pub version: String,
}

impl RelayIdentity {
    /// This process's identity: process id, host name (empty when the
    /// system gives none) and version.
    pub(crate) fn own() -> (i32, String, String) {
        let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        (pid, host_name(), env!("CARGO_PKG_VERSION").to_string())
    }
}

/// This machine's host name (`gethostname(2)`), lossily decoded; empty
/// when the call fails.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at
    // most that many bytes and NUL-terminates unless the name is cut.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Whether `events.outbox_relays` has the identity columns (migration 0015).
const HAS_IDENTITY: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute \
       WHERE attrelid = to_regclass('events.outbox_relays') AND attname = 'relay_pid' AND NOT attisdropped)";

/// The identity and heartbeat age (seconds) of the registered work
/// sessions `pids` (`int4[]`).
const IDENTITIES: &str = "SELECT pid, relay_pid, relay_host, relay_version, \
       EXTRACT(EPOCH FROM (now() - updated_at))::float8 AS heartbeat_age \
     FROM events.outbox_relays WHERE pid = ANY($1::int4[])";

/// The identity (when recorded) and heartbeat age of each of `pids`' rows
/// of `events.outbox_relays`, by backend pid; empty before migration 0015.
pub(crate) async fn identities<C: GenericClient + Sync>(
    client: &C,
    pids: &[i32],
) -> Result<std::collections::HashMap<i32, (Option<RelayIdentity>, f64)>> {
    if pids.is_empty() || !client.query_one(HAS_IDENTITY, &[]).await?.try_get::<_, bool>(0)? {
        return Ok(std::collections::HashMap::new());
    }
    let rows = client.query(IDENTITIES, &[&pids]).await?;
    rows.iter()
        .map(|r| {
            let relay = match r.try_get::<_, Option<i32>>("relay_pid")? {
                Some(process_id) => Some(RelayIdentity {
                    process_id,
                    host: r.try_get::<_, Option<String>>("relay_host")?.unwrap_or_default(),
                    version: r.try_get::<_, Option<String>>("relay_version")?.unwrap_or_default(),
                }),
                None => None,
            };
            Ok((r.try_get("pid")?, (relay, r.try_get("heartbeat_age")?)))
        })
        .collect()
}

/// A term taken ([`TAKE_TERM`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TermTaken {
    /// The new term.
    pub(crate) term: Term,
    /// The previous holder released its term at a graceful stop.
    pub(crate) previous_released: bool,
    /// The term before this one (`None`: this is the first).
    pub(crate) previous_term: Option<Term>,
}

/// Which session holds the leader lock: its pid and start, which together
/// tell it from a later session that gets the same pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HolderId {
    pub(crate) pid: i32,
    pub(crate) backend_start: Option<DateTime<Utc>>,
}

/// The holder of the leader lock, as [`LEADER_HOLDER`] reads it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Holder {
    pub(crate) id: HolderId,
    /// `application_name` (`None` when `pg_stat_activity` has no row).
    pub(crate) application_name: Option<String>,
    /// The client's address; `None` over a Unix socket or when hidden.
    pub(crate) client_addr: Option<String>,
    /// `pg_stat_activity.state` (`None` when hidden).
    pub(crate) state: Option<String>,
    /// Seconds since `state` last changed.
    pub(crate) state_secs: Option<f64>,
    /// Seconds since its heartbeat; `None` without one.
    pub(crate) heartbeat_age: Option<f64>,
    /// Its heartbeat is within the threshold.
    pub(crate) beating: bool,
    /// It runs a statement begun within the threshold of its heartbeat.
    pub(crate) busy: bool,
}

impl Holder {
    /// A live relay: heartbeating, or busy in a statement.
    pub(crate) fn live(&self) -> bool {
        self.beating || self.busy
    }

    /// The client address for log lines: `local socket` when there is none.
    pub(crate) fn client(&self) -> &str {
        self.client_addr.as_deref().unwrap_or(if self.state.is_some() { "local socket" } else { "hidden" })
    }
}

/// A [`Holder`] from a row of [`LEADER_HOLDER`].
pub(crate) fn holder_from_row(r: &Row) -> std::result::Result<Holder, tokio_postgres::Error> {
    Ok(Holder {
        id: HolderId { pid: r.try_get("pid")?, backend_start: r.try_get("backend_start")? },
        application_name: r.try_get("application_name")?,
        client_addr: r.try_get("client_addr")?,
        state: r.try_get("state")?,
        state_secs: r.try_get("state_secs")?,
        heartbeat_age: r.try_get("heartbeat_age")?,
        beating: r.try_get("beating")?,
        busy: r.try_get("busy")?,
    })
}

/// The holder of the leader lock judged against `threshold_secs`
/// ([`LEADER_HOLDER`]), or `None` when nobody holds it.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn leader_holder<C: GenericClient + Sync>(
    client: &C,
    key: i64,
    threshold_secs: f64,
) -> Result<Option<Holder>> {
    let row = client.query_opt(LEADER_HOLDER, &[&key, &threshold_secs]).await.map_err(super::map_missing_schema)?;
    Ok(row.as_ref().map(holder_from_row).transpose()?)
}

/// The session holding a single-mode leader lock: the outbox's (the
/// default subscription's), as [`super::OutboxStatus::leader`] shows it, or
/// a named subscription's ([`super::subscription_admin::Subscription::leader`]).
///
/// A live leader is a relay that refreshed its heartbeat (its row in
/// `events.outbox_relays`) within `ConsumerBuilder::DEFAULT_STRANDED_AFTER` (15 s),
/// or is running a statement it began within that of its last heartbeat.
/// Any other holder is stranded: a pooler's server session that kept the
/// lock, a session of an older build (which writes no heartbeat), a frozen
/// relay, or one behind a network that drops its traffic. Every age is by
/// the database's clock. Another role's session shows without its state,
/// address and idle time unless the reader has `pg_read_all_stats`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct LeaderLock {
    /// The holder's backend process id.
    pub pid: i32,
    /// Whether the holder is a live relay (`false`: no live leader).
    pub live: bool,
    /// Its `application_name` (`pg-outbox drain` for a relay's work
    /// session), if visible.
    pub application_name: Option<String>,
    /// Its client address; `None` over a Unix socket or when hidden.
    pub client_addr: Option<String>,
    /// `pg_stat_activity.state` (`idle`, `active`, ...), if visible.
    pub state: Option<String>,
    /// Seconds in that state (idle time when `idle`), if visible.
    pub state_seconds: Option<f64>,
    /// Age of its heartbeat in seconds; `None` when it has none (not a
    /// relay of this version, or one that has not fetched yet).
    pub heartbeat_age_seconds: Option<f64>,
    /// The leadership term this holder took (`events.outbox_terms`);
    /// `None` when it took none (a session of an earlier build, or of
    /// anything else, holds the lock) or the schema predates terms.
    pub term: Option<crate::term::Term>,
    /// Which relay holds it: its own process id, host and version, as it
    /// recorded them when it took the lock; `None` for a session that is
    /// not a relay's, a relay of an earlier build, or a schema before
    /// migration 0015.
    pub relay: Option<RelayIdentity>,
}

/// The holder of the leader lock of key `key` (the outbox's, or a named
/// subscription's: `store::subscription::Reader::leader_key`) and the term
/// of `scope` if it took it, judged against [`DEFAULT_STRANDED_AFTER`]
/// ([`LEADER_HOLDER`]); none on a server in recovery (a standby), or when
/// nobody holds it.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn leader_lock<C: GenericClient + Sync>(
    client: &C,
    key: i64,
    scope: &str,
) -> Result<Option<LeaderLock>> {
    let server =
        client.query_one("SELECT pg_is_in_recovery(), to_regclass('events.outbox_terms') IS NOT NULL", &[]).await?;
    let (in_recovery, has_terms): (bool, bool) = (server.try_get(0)?, server.try_get(1)?);
    if in_recovery {
        return Ok(None);
    }
    let threshold = DEFAULT_STRANDED_AFTER.as_secs_f64();
    let Some(h) = leader_holder(client, key, threshold).await? else { return Ok(None) };
    // The term is the holder's only when it took it (not a session of an
    // older build, or of anything else, that holds the lock); a schema from
    // before migration 0013 has none.
    let term: Option<crate::term::Term> = if has_terms {
        let row = client.query_one(CURRENT_TERM, &[&scope]).await.map_err(super::map_missing_schema)?;
        let holder: Option<i32> = row.try_get("holder_pid")?;
        row.try_get::<_, Option<crate::term::Term>>("term")?.filter(|_| holder == Some(h.id.pid))
    } else {
        None
    };
    Ok(Some(LeaderLock {
        pid: h.id.pid,
        live: h.live(),
        application_name: h.application_name,
        client_addr: h.client_addr,
        state: h.state,
        state_seconds: h.state_secs,
        heartbeat_age_seconds: h.heartbeat_age,
        term,
        relay: identities(client, &[h.id.pid]).await?.remove(&h.id.pid).and_then(|(relay, _)| relay),
    }))
}

//! The operator console's reads ([`crate::console`]): relays and their
//! roles, one event with its aggregate's timeline, a page of dead letters,
//! and delivery per minute. Each is bounded: an index lookup or walk with a
//! LIMIT, or the catalog views.

use super::dead_letters::MATCHES;
use super::locks::{LEADER_KEY, MEMBER_CLASS, PARTITION_CLASS};

/// The columns of an event row plus its state: `published_at`, and
/// `next_retry_at` as NULL for a dead letter (chrono cannot hold
/// `'infinity'`) with `dead` telling them apart.
macro_rules! detail_columns {
    () => {
        concat!(
            event_columns!(),
            ", published_at, (next_retry_at = 'infinity') IS TRUE AS dead, \
             CASE WHEN next_retry_at = 'infinity' THEN NULL ELSE next_retry_at END AS next_retry_at"
        )
    };
}

/// One event by id ($1): a lookup in `outbox_pkey`.
pub(crate) const EVENT: &str = concat!("SELECT ", detail_columns!(), " FROM events.outbox WHERE id = $1");

/// The events of aggregate ($1 type, $2 id) before id $3, latest first, at
/// most $4: a backward walk of `outbox_aggregate_idx`.
pub(crate) const EARLIER: &str = concat!(
    "SELECT ",
    detail_columns!(),
    " FROM events.outbox WHERE aggregate_type = $1 AND aggregate_id = $2 AND id < $3 ORDER BY id DESC LIMIT $4"
);

/// The events of aggregate ($1 type, $2 id) after id $3, in id order, at
/// most $4: a forward walk of `outbox_aggregate_idx`.
pub(crate) const LATER: &str = concat!(
    "SELECT ",
    detail_columns!(),
    " FROM events.outbox WHERE aggregate_type = $1 AND aggregate_id = $2 AND id > $3 ORDER BY id LIMIT $4"
);

/// How many unpublished events of aggregate ($1 type, $2 id) come after id
/// $3 (those an unpublished event holds back): a range of
/// `outbox_aggregate_idx`, as long as the aggregate's history after it.
/// The inner query orders by that index's key (its `OFFSET 0` keeps the
/// planner from merging it into the outer query and dropping the order),
/// so with sorts discouraged ([`crate::PLANNER_SETTINGS`]) that walk is the
/// plan whatever the statistics say; a bare count let statistics taken before a backlog pick
/// `outbox_unpublished_idx` and walk every unpublished row.
pub(crate) const LATER_UNPUBLISHED: &str = "SELECT count(*) AS n FROM ( \
       SELECT published_at FROM events.outbox \
       WHERE aggregate_type = $1 AND aggregate_id = $2 AND id > $3 \
       ORDER BY aggregate_type, aggregate_id, id OFFSET 0) later \
     WHERE published_at IS NULL";

/// A page of dead letters: the filter of [`MATCHES`] (`$1`..`$5`), ids
/// above $6 (keyset paging), at most $7 rows, in id order: a walk of
/// `outbox_dead_letter_idx` from $6, touching dead letters only.
pub(crate) fn dead_letter_page_sql() -> String {
    format!(
        concat!("SELECT ", detail_columns!(), " FROM events.outbox WHERE {} AND id + 0 > $6 ORDER BY id + 0 LIMIT $7"),
        MATCHES
    )
}

/// Delivery per minute of publication, over the latest $1 events by id (a
/// backward walk of `outbox_pkey`, so the cost is bounded whatever the
/// rate) that were published within the last hour: the minute, how many,
/// the mean and the largest `published_at - occurred_at` in seconds; plus,
/// on every row, the earliest `published_at` among those rows and whether
/// the walk stopped at its limit (`capped`).
pub(crate) const DELIVERY_PER_MINUTE: &str = "WITH recent AS ( \
       SELECT occurred_at, published_at FROM events.outbox ORDER BY id DESC LIMIT $1), \
     n AS (SELECT count(*) AS rows FROM recent) \
     SELECT date_trunc('minute', published_at) AS minute, count(*) AS published, \
       avg(EXTRACT(EPOCH FROM (published_at - occurred_at)))::float8 AS mean_lag, \
       max(EXTRACT(EPOCH FROM (published_at - occurred_at)))::float8 AS max_lag, \
       (SELECT rows FROM n) >= $1 AS capped \
     FROM recent WHERE published_at >= now() - interval '1 hour' \
     GROUP BY 1 ORDER BY 1";

/// The sessions of the relays in this database: those registered in
/// `events.outbox_relays`, those holding one of pg-outbox's advisory locks
/// ([`LEADER_KEY`], [`PARTITION_CLASS`], [`MEMBER_CLASS`]), and those named
/// as the relay names its sessions (`pg-outbox drain`, `writer`,
/// `listener`); with what they hold. $1: the leader key, $2: the partition
/// class, $3: the member class.
pub(crate) const RELAY_SESSIONS: &str = "WITH ours AS ( \
       SELECT l.pid, \
         bool_or(l.objsubid = 1 AND l.classid = ($1::bigint >> 32)::oid AND l.objid = ($1::bigint & 4294967295)::oid) AS leader, \
         array_agg(l.objid::bigint::int4 ORDER BY l.objid) FILTER (WHERE l.objsubid = 2 AND l.classid = ($2::int4)::bigint::oid) AS partitions, \
         bool_or(l.objsubid = 2 AND l.classid = ($3::int4)::bigint::oid) AS member \
       FROM pg_catalog.pg_locks l \
       WHERE l.locktype = 'advisory' AND l.granted \
         AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
       GROUP BY l.pid) \
     SELECT a.pid, coalesce(a.application_name, '') AS application_name, host(a.client_addr) AS client_addr, \
       a.backend_start, coalesce(a.state, '') AS state, a.state_change, \
       r.waiting, r.updated_at AS waiting_since, \
       coalesce(o.leader, false) AS leader, coalesce(o.partitions, '{}') AS partitions, coalesce(o.member, false) AS member \
     FROM pg_catalog.pg_stat_activity a \
       LEFT JOIN events.outbox_relays r ON r.pid = a.pid \
       LEFT JOIN ours o ON o.pid = a.pid \
     WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() \
       AND (r.pid IS NOT NULL OR coalesce(o.leader, false) OR o.partitions IS NOT NULL OR coalesce(o.member, false) \
            OR a.application_name IN ('pg-outbox drain', 'pg-outbox writer', 'pg-outbox listener')) \
     ORDER BY a.backend_start, a.pid";

/// The lock keys [`RELAY_SESSIONS`] takes as parameters.
pub(crate) const RELAY_LOCK_KEYS: (i64, i32, i32) = (LEADER_KEY, PARTITION_CLASS, MEMBER_CLASS);

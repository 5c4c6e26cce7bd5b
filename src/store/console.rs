//! The operator console's reads ([`crate::console`]): relays and their
//! roles, one event with its aggregate's timeline, a page of dead letters,
//! and delivery per minute. Each is bounded: an index lookup or walk with a
//! LIMIT, or the catalog views. One function per read runs it and returns
//! the console's types.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Row};

use super::dead_letters::Filter;
use super::dead_letters::{MATCHES, filter_params};
use super::locks::{LEADER_KEY, MEMBER_CLASS, PARTITION_CLASS};
use super::{event_from_row, map_missing_schema, query_map};
use crate::error::Result;
use crate::event::Event;

/// Where an event stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EventState {
    /// Delivered (`published_at` is set).
    Published,
    /// Not published and due (fresh, or its retry is due); it may still be
    /// held back by an earlier failed event of its aggregate.
    Due,
    /// Waiting for its retry (`next_retry_at` in the future).
    WaitingForRetry,
    /// A dead letter (`next_retry_at = 'infinity'`).
    DeadLetter,
}

/// An event with the columns that say where it stands.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct EventDetail {
    /// The event (payload, retry count, last error included).
    pub event: Event,
    /// When it was delivered, or `None`.
    pub published_at: Option<DateTime<Utc>>,
    /// When its retry is due, or `None` (never failed, published, or a dead
    /// letter: see [`EventDetail::state`]).
    pub next_retry_at: Option<DateTime<Utc>>,
    /// Where it stands, by the database's clock at the time of the read.
    pub state: EventState,
}

impl EventDetail {
    /// The event with its state at `now`: published when `published_at` is
    /// set, else a dead letter when `dead`, else waiting while
    /// `next_retry_at` is after `now`, else due.
    pub(crate) fn judged(
        event: Event,
        published_at: Option<DateTime<Utc>>,
        next_retry_at: Option<DateTime<Utc>>,
        dead: bool,
        now: DateTime<Utc>,
    ) -> Self {
        let state = if published_at.is_some() {
            EventState::Published
        } else if dead {
            EventState::DeadLetter
        } else if next_retry_at.is_some_and(|t| t > now) {
            EventState::WaitingForRetry
        } else {
            EventState::Due
        };
        EventDetail { event, published_at, next_retry_at, state }
    }
}

/// The events of one aggregate around one of its events.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Timeline {
    /// Earlier events, latest first (at most the `around` asked for).
    pub earlier: Vec<EventDetail>,
    /// Later events, in id order (at most the `around` asked for).
    pub later: Vec<EventDetail>,
    /// Unpublished events after this one: those it holds back while it is
    /// not published (all of them, not only those in [`Timeline::later`]).
    pub later_unpublished: i64,
}

/// Delivery in one minute of the last hour.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct MinuteDelivery {
    /// The minute (`published_at` truncated to the minute).
    pub minute: DateTime<Utc>,
    /// Events published in that minute.
    pub published: i64,
    /// Mean `published_at - occurred_at` of those events, in seconds.
    pub mean_lag_seconds: f64,
    /// Largest `published_at - occurred_at` of those events, in seconds.
    pub max_lag_seconds: f64,
}

/// Delivery per minute over the last hour, from the table itself.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct DeliveryChart {
    /// Minutes with at least one publication, oldest first.
    pub minutes: Vec<MinuteDelivery>,
    /// The read stopped at the latest `max_rows` events, so minutes
    /// before the first of [`DeliveryChart::minutes`] may be incomplete or
    /// missing (more than `max_rows` events in the hour).
    pub capped: bool,
    /// The database's `now()` at the read: the end of the hour shown.
    pub now: DateTime<Utc>,
}

/// What a relay session holds or does.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct RelaySession {
    /// Backend process id.
    pub pid: i32,
    /// `application_name`: the relay names its sessions `pg-outbox drain`
    /// (fetches, holds the locks), `pg-outbox writer` (acknowledgements) and
    /// `pg-outbox listener` (LISTEN) unless its URL names them.
    pub application_name: String,
    /// The client's address, or `None` over a Unix socket.
    pub client_addr: Option<String>,
    /// When the session started.
    pub backend_start: Option<DateTime<Utc>>,
    /// `pg_stat_activity.state` (`idle`, `active`, ...).
    pub state: String,
    /// When `state` last changed.
    pub state_change: Option<DateTime<Utc>>,
    /// Registered in `events.outbox_relays`: `Some(true)` while it waits for
    /// a wake-up (idle), `Some(false)` while it drains, `None` when not
    /// registered.
    pub waiting: Option<bool>,
    /// When the registration was last written (`updated_at`): its waiting
    /// flag set, or the relay's heartbeat, which refreshes it every 5 s
    /// (a third of `stranded_after`) while the relay runs.
    pub waiting_since: Option<DateTime<Utc>>,
    /// Holds the single mode's leader lock: the active relay.
    pub leader: bool,
    /// The partitions it holds (partitioned mode), ascending.
    pub partitions: Vec<i32>,
    /// Holds a partitioned mode membership lock.
    pub member: bool,
}

impl RelaySession {
    /// The role as a short phrase: `leader`, `partitions 0, 3, 5`, `member
    /// (no partition)`, `listener`, `writer`, or `standby or competing` for a
    /// drain session that holds no lock.
    pub fn role(&self) -> String {
        if self.leader {
            return "leader".into();
        }
        if !self.partitions.is_empty() {
            let list: Vec<String> = self.partitions.iter().map(i32::to_string).collect();
            return format!("partitions {}", list.join(", "));
        }
        if self.member {
            return "member (no partition)".into();
        }
        match self.application_name.as_str() {
            "pg-outbox listener" => "listener".into(),
            "pg-outbox writer" => "writer".into(),
            _ => "standby or competing".into(),
        }
    }
}

/// The relays' sessions and the notification queue.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Relays {
    /// Relay sessions in this database, oldest first.
    pub sessions: Vec<RelaySession>,
    /// `pg_notification_queue_usage()`: the fraction (0 to 1) of the
    /// server's notification queue in use; near 1, notifying commits fail.
    pub notification_queue_usage: f64,
}

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
/// so with sorts discouraged ([`crate::connect::PLANNER_SETTINGS`]) that walk is the
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
const RELAY_SESSIONS: &str = "WITH ours AS ( \
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
const RELAY_LOCK_KEYS: (i64, i32, i32) = (LEADER_KEY, PARTITION_CLASS, MEMBER_CLASS);

/// The database's clock (`now`), so that states follow it.
const NOW: &str = "SELECT now() AS now";

/// The database's `now()`.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn db_now<C: GenericClient + Sync>(client: &C) -> Result<DateTime<Utc>> {
    let row = client.query_one(NOW, &[]).await.map_err(map_missing_schema)?;
    Ok(row.try_get("now")?)
}

/// An [`EventDetail`] from a row holding the columns of `detail_columns!`,
/// its state judged at `now`.
///
/// # Errors
/// [`crate::Error::Db`] when a column cannot be read.
fn detail_from_row(row: &Row, now: DateTime<Utc>) -> Result<EventDetail> {
    Ok(EventDetail::judged(
        event_from_row(row)?,
        row.try_get("published_at")?,
        row.try_get("next_retry_at")?,
        row.try_get("dead")?,
        now,
    ))
}

/// The event with id `id` ([`EVENT`]) with its state at `now`, or `None`
/// when there is no such row.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn event<C: GenericClient + Sync>(
    client: &C,
    id: i64,
    now: DateTime<Utc>,
) -> Result<Option<EventDetail>> {
    let rows = client.query(EVENT, &[&id]).await.map_err(map_missing_schema)?;
    rows.first().map(|r| detail_from_row(r, now)).transpose()
}

/// The events of `of`'s aggregate before and after it, at most `around` on
/// each side ([`EARLIER`], [`LATER`]), with their states at `now`, and how
/// many later ones are unpublished ([`LATER_UNPUBLISHED`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn timeline<C: GenericClient + Sync>(
    client: &C,
    of: &Event,
    around: i64,
    now: DateTime<Utc>,
) -> Result<Timeline> {
    let p: [&(dyn ToSql + Sync); 4] = [&of.aggregate_type, &of.aggregate_id, &of.id, &around];
    let earlier = query_map(client, EARLIER, &p, |r| detail_from_row(r, now)).await?;
    let later = query_map(client, LATER, &p, |r| detail_from_row(r, now)).await?;
    let n = client
        .query_one(LATER_UNPUBLISHED, &[&of.aggregate_type, &of.aggregate_id, &of.id])
        .await
        .map_err(map_missing_schema)?;
    Ok(Timeline { earlier, later, later_unpublished: n.try_get("n")? })
}

/// Up to `limit` dead letters matching `filter` (its `limit` ignored) with
/// ids above `after_id`, in id order ([`dead_letter_page_sql`]), with their
/// states at `now`.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn dead_letter_page<C: GenericClient + Sync>(
    client: &C,
    filter: &Filter,
    after_id: i64,
    limit: i64,
    now: DateTime<Utc>,
) -> Result<Vec<EventDetail>> {
    let [a, b, c, d, e] = filter_params(filter);
    query_map(client, &dead_letter_page_sql(), &[a, b, c, d, e, &after_id, &limit], |r| detail_from_row(r, now)).await
}

/// Delivery per minute over the last hour before the database's `now`,
/// from the latest `max_rows` events by id ([`DELIVERY_PER_MINUTE`]); lags
/// in seconds, 0 where the database gives none.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn delivery_chart<C: GenericClient + Sync>(
    client: &C,
    max_rows: i64,
    now: DateTime<Utc>,
) -> Result<DeliveryChart> {
    let mut capped = false;
    let minutes = query_map(client, DELIVERY_PER_MINUTE, &[&max_rows], |r| {
        Ok((
            MinuteDelivery {
                minute: r.try_get("minute")?,
                published: r.try_get("published")?,
                mean_lag_seconds: r.try_get::<_, Option<f64>>("mean_lag")?.unwrap_or(0.0),
                max_lag_seconds: r.try_get::<_, Option<f64>>("max_lag")?.unwrap_or(0.0),
            },
            r.try_get::<_, bool>("capped")?,
        ))
    })
    .await?
    .into_iter()
    .map(|(m, c)| {
        capped |= c;
        m
    })
    .collect();
    Ok(DeliveryChart { minutes, capped, now })
}

/// A [`RelaySession`] from a row of [`RELAY_SESSIONS`].
///
/// # Errors
/// [`crate::Error::Db`] when a column cannot be read.
fn relay_session(r: &Row) -> Result<RelaySession> {
    Ok(RelaySession {
        pid: r.try_get("pid")?,
        application_name: r.try_get("application_name")?,
        client_addr: r.try_get("client_addr")?,
        backend_start: r.try_get("backend_start")?,
        state: r.try_get("state")?,
        state_change: r.try_get("state_change")?,
        waiting: r.try_get("waiting")?,
        waiting_since: r.try_get("waiting_since")?,
        leader: r.try_get("leader")?,
        partitions: r.try_get("partitions")?,
        member: r.try_get("member")?,
    })
}

/// The relays' sessions in this database ([`RELAY_SESSIONS`], oldest
/// first) and the fraction (0 to 1) of the notification queue in use.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn relays<C: GenericClient + Sync>(client: &C) -> Result<Relays> {
    // A hot standby runs no relay (they are refused there), and cannot read
    // `events.outbox_relays`, an unlogged table ("cannot access temporary
    // or unlogged relations during recovery").
    let recovery = client.query_one("SELECT pg_is_in_recovery()", &[]).await?;
    if recovery.try_get::<_, bool>(0)? {
        let notification_queue_usage = super::wakeup::notification_queue_usage(client).await?;
        return Ok(Relays { sessions: Vec::new(), notification_queue_usage });
    }
    let (leader, partition, member) = RELAY_LOCK_KEYS;
    let sessions = query_map(client, RELAY_SESSIONS, &[&leader, &partition, &member], relay_session).await?;
    let notification_queue_usage = super::wakeup::notification_queue_usage(client).await?;
    Ok(Relays { sessions, notification_queue_usage })
}

/// Bound every later statement of `client`'s session to `timeout`
/// (`statement_timeout`, in whole milliseconds rounded up; zero turns it
/// off), over any the role, the database or the URL set.
///
/// # Errors
/// [`crate::Error::Db`] when the setting is refused.
pub(crate) async fn set_statement_timeout<C: GenericClient + Sync>(client: &C, timeout: Duration) -> Result<()> {
    let sql = format!("SET statement_timeout = {}", crate::connect::setting_millis(timeout));
    client.batch_execute(&sql).await?;
    Ok(())
}

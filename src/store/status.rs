//! Backlog figures: the relay's gauges and `pg-outbox status`.

use tokio_postgres::GenericClient;

use super::fetch::HELD_BACK;
use super::{map_missing_schema, query_map};
use crate::error::Result;

/// The relay's gauges, cheaper than [`status_sql`]: pending (not dead)
/// rows (`pending`), dead letters (`dead`), and the age of the oldest
/// pending row in seconds (`oldest_age`).
pub(crate) const GAUGES: &str = "SELECT \
       count(*) FILTER (WHERE next_retry_at IS DISTINCT FROM 'infinity') AS pending, \
       count(*) FILTER (WHERE next_retry_at = 'infinity') AS dead, \
       EXTRACT(EPOCH FROM (now() - min(occurred_at) FILTER (WHERE next_retry_at IS DISTINCT FROM 'infinity')))::float8 AS oldest_age \
     FROM events.outbox WHERE published_at IS NULL";

/// The figures [`status_sql`] and [`by_type_sql`] share, over
/// [`unpublished_rows`]: all, due and not held back, due and held back,
/// waiting for a retry, dead letters, and the age of the oldest that is not a
/// dead letter.
const BACKLOG_COUNTS: &str = "count(*) AS unpublished, \
       count(*) FILTER (WHERE (next_retry_at IS NULL OR next_retry_at <= now()) AND NOT held) AS due, \
       count(*) FILTER (WHERE (next_retry_at IS NULL OR next_retry_at <= now()) AND held) AS held, \
       count(*) FILTER (WHERE next_retry_at > now() AND next_retry_at < 'infinity') AS waiting, \
       count(*) FILTER (WHERE next_retry_at = 'infinity') AS dead, \
       EXTRACT(EPOCH FROM (now() - min(occurred_at) FILTER (WHERE next_retry_at IS DISTINCT FROM 'infinity')))::float8 AS oldest_age";

/// The unpublished rows (one pass of the partial index
/// `outbox_unpublished_idx`) as `o`, with the columns `extra` names first
/// (each followed by a comma), then `occurred_at`, `next_retry_at` and
/// `held`: whether a due row is held back behind an earlier failed event of
/// its aggregate (one probe of `outbox_holdback_idx` per due row, once:
/// `OFFSET 0` keeps the subquery, so `held` is not inlined into both FILTERs
/// that read it; see `held_back_by` in `fetch.rs`).
fn unpublished_rows(extra: &str) -> String {
    format!(
        "(SELECT {extra}o.occurred_at, o.next_retry_at, \
           CASE WHEN o.next_retry_at IS NULL OR o.next_retry_at <= now() THEN {HELD_BACK} ELSE false END AS held \
         FROM events.outbox o WHERE o.published_at IS NULL OFFSET 0) o"
    )
}

/// Backlog and lag figures; see [`OutboxStatus`] and [`BACKLOG_COUNTS`].
pub(super) fn status_sql() -> String {
    format!("SELECT {BACKLOG_COUNTS} FROM {}", unpublished_rows(""))
}

/// Figures about the outbox, as `pg-outbox status` prints them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows with `published_at IS NULL`, dead letters included:
    /// `due_now + held_back + waiting_for_retry + dead_letters`.
    pub unpublished: i64,
    /// Unpublished rows that are due now (fresh, or their retry is due) and
    /// not held back.
    pub due_now: i64,
    /// Due rows held back behind an earlier failed, unpublished event of
    /// their aggregate (waiting for a retry, due again, or a dead letter).
    pub held_back: i64,
    /// Unpublished rows waiting for their retry (`next_retry_at` in the future).
    pub waiting_for_retry: i64,
    /// Dead letters: unpublished rows with `next_retry_at = 'infinity'` (set
    /// by the failure that reached the dead-letter threshold).
    pub dead_letters: i64,
    /// Age in seconds of the oldest unpublished event that is not a dead
    /// letter (from its `occurred_at`), or `None` when there is none.
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// Backlog per `(event_type, aggregate_type)`, most unpublished first
    /// (ties by event type, then aggregate type); at most
    /// [`STATUS_MAX_TYPES`] rows.
    pub by_type: Vec<TypeBacklog>,
    /// More `(event_type, aggregate_type)` pairs have unpublished events
    /// than [`OutboxStatus::by_type`] shows.
    pub by_type_truncated: bool,
    /// When the events waiting for a retry come due.
    pub retries: RetryLadder,
    /// Who holds single mode's outbox lock, and whether it is a live relay;
    /// `None` when nobody holds it (no relay runs in single mode, or none
    /// has taken the lock yet). A holder that is not live is a stranded
    /// lock: no relay delivers (`status` prints "no live leader"). Always
    /// `None` on a hot standby, whose sessions hold no relay's lock (and
    /// whose `events.outbox_relays`, an unlogged table, cannot be read
    /// during recovery).
    pub leader: Option<LeaderLock>,
    /// The ordering mode installed on `events.outbox`
    /// ([`crate::migrate::ordering`]); `None` when neither insert trigger is
    /// enabled. In JSON: `"outbox-locked"`, `"producer-locked"` or `null`.
    pub ordering: Option<crate::migrate::OrderingMode>,
}

/// The session holding single mode's outbox lock, as
/// [`OutboxStatus::leader`] shows it.
///
/// A live leader is a relay that refreshed its heartbeat (its row in
/// `events.outbox_relays`) within [`crate::DEFAULT_STRANDED_AFTER`] (15 s),
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
    pub term: Option<i64>,
}

/// Most `(event_type, aggregate_type)` rows [`status`] returns: 50.
pub const STATUS_MAX_TYPES: i64 = 50;
/// How many of the next retry-due events [`status`] lists: 5.
pub const STATUS_NEXT_RETRIES: i64 = 5;

/// Unpublished events of one `(event_type, aggregate_type)`; the counts
/// split [`TypeBacklog::unpublished`] as in [`OutboxStatus`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct TypeBacklog {
    /// Event name.
    pub event_type: String,
    /// Kind of aggregate.
    pub aggregate_type: String,
    /// Unpublished rows, dead letters included.
    pub unpublished: i64,
    /// Due now and not held back.
    pub due_now: i64,
    /// Due, but held back behind an earlier failed event of their aggregate.
    pub held_back: i64,
    /// Waiting for their retry (`next_retry_at` in the future).
    pub waiting_for_retry: i64,
    /// Dead letters (`next_retry_at = 'infinity'`).
    pub dead_letters: i64,
    /// Age in seconds of the oldest of these that is not a dead letter, or
    /// `None` when all are dead letters.
    pub oldest_unpublished_age_seconds: Option<f64>,
}

/// When the events waiting for a retry (`next_retry_at` in the future, not
/// a dead letter) come due. The buckets do not overlap and add up to
/// [`OutboxStatus::waiting_for_retry`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct RetryLadder {
    /// The earliest `next_retry_at` (RFC 3339 in JSON), or `None`.
    pub next_due_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Seconds from now until [`RetryLadder::next_due_at`].
    pub next_due_in_seconds: Option<f64>,
    /// Due within the next minute.
    pub due_within_1m: i64,
    /// Due after one minute and within the hour.
    pub due_within_1h: i64,
    /// Due in more than an hour.
    pub due_later: i64,
    /// The next [`STATUS_NEXT_RETRIES`] events to come due, earliest first.
    pub next: Vec<PendingRetry>,
}

/// One event waiting for its retry.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct PendingRetry {
    /// Outbox id.
    pub id: i64,
    /// Event name.
    pub event_type: String,
    /// Kind of aggregate.
    pub aggregate_type: String,
    /// Failed attempts so far.
    pub retry_count: i32,
    /// When it is due (`next_retry_at`).
    pub due_at: chrono::DateTime<chrono::Utc>,
    /// Seconds from now until `due_at`.
    pub due_in_seconds: f64,
    /// The last failure's message.
    pub last_error: Option<String>,
}

/// Backlog per type: [`BACKLOG_COUNTS`] over [`unpublished_rows`], grouped
/// by event and aggregate type. $1 is the row limit (one more than shown, to
/// tell whether rows were left out).
pub(super) fn by_type_sql() -> String {
    format!(
        "SELECT o.event_type, o.aggregate_type, {BACKLOG_COUNTS} FROM {} \
         GROUP BY o.event_type, o.aggregate_type \
         ORDER BY unpublished DESC, o.event_type, o.aggregate_type LIMIT $1",
        unpublished_rows("o.event_type, o.aggregate_type, ")
    )
}

/// Rows waiting for a retry, bucketed by due time: a range scan of
/// `outbox_retry_due_idx` (keyed by next_retry_at, unpublished rows only).
pub(super) const RETRY_BUCKETS: &str = "SELECT min(next_retry_at) AS next_due_at, \
       EXTRACT(EPOCH FROM (min(next_retry_at) - now()))::float8 AS next_due_in, \
       count(*) FILTER (WHERE next_retry_at <= now() + interval '1 minute') AS within_1m, \
       count(*) FILTER (WHERE next_retry_at > now() + interval '1 minute' AND next_retry_at <= now() + interval '1 hour') AS within_1h, \
       count(*) FILTER (WHERE next_retry_at > now() + interval '1 hour') AS later \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at > now() AND next_retry_at < 'infinity'";

/// The next $1 rows to come due for a retry, in due order: the first
/// entries of `outbox_retry_due_idx` after now(), in the order of its key,
/// the only plan without a sort (ties, which the failures of one batch can
/// share, in index order; ordering them by id too would sort every row of
/// the tie).
pub(super) const NEXT_RETRIES: &str = "SELECT id, event_type, aggregate_type, retry_count, next_retry_at, \
       EXTRACT(EPOCH FROM (next_retry_at - now()))::float8 AS due_in, last_error \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at > now() AND next_retry_at < 'infinity' \
     ORDER BY next_retry_at LIMIT $1";

/// Read [`OutboxStatus`]: four read-only queries (totals, per type, retry
/// buckets, next retries), each served by a partial index and bounded by a
/// LIMIT where it returns rows, and one on `pg_locks` for the holder of the
/// outbox lock ([`OutboxStatus::leader`]). The totals and per-type figures scan the
/// unpublished rows (not the published history), so their cost grows with
/// the backlog, not the table. The queries run one after another (not in one
/// snapshot), so figures taken while a relay works may differ by a few rows.
///
/// # Errors
/// [`crate::Error::NotMigrated`] if the schema is missing; [`crate::Error::Db`] if the
/// query fails otherwise.
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn status<C: GenericClient + Sync>(client: &C) -> Result<OutboxStatus> {
    let row = client.query_one(&status_sql(), &[]).await.map_err(map_missing_schema)?;
    let mut by_type = query_map(client, &by_type_sql(), &[&(STATUS_MAX_TYPES + 1)], |r| {
        Ok(TypeBacklog {
            event_type: r.try_get("event_type")?,
            aggregate_type: r.try_get("aggregate_type")?,
            unpublished: r.try_get("unpublished")?,
            due_now: r.try_get("due")?,
            held_back: r.try_get("held")?,
            waiting_for_retry: r.try_get("waiting")?,
            dead_letters: r.try_get("dead")?,
            oldest_unpublished_age_seconds: r.try_get("oldest_age")?,
        })
    })
    .await?;
    let by_type_truncated = by_type.len() > usize::try_from(STATUS_MAX_TYPES).unwrap_or(usize::MAX);
    by_type.truncate(usize::try_from(STATUS_MAX_TYPES).unwrap_or(usize::MAX));
    let b = client.query_one(RETRY_BUCKETS, &[]).await.map_err(map_missing_schema)?;
    let next = query_map(client, NEXT_RETRIES, &[&STATUS_NEXT_RETRIES], |r| {
        Ok(PendingRetry {
            id: r.try_get("id")?,
            event_type: r.try_get("event_type")?,
            aggregate_type: r.try_get("aggregate_type")?,
            retry_count: r.try_get("retry_count")?,
            due_at: r.try_get("next_retry_at")?,
            due_in_seconds: r.try_get("due_in")?,
            last_error: r.try_get("last_error")?,
        })
    })
    .await?;
    Ok(OutboxStatus {
        unpublished: row.try_get("unpublished")?,
        due_now: row.try_get("due")?,
        held_back: row.try_get("held")?,
        waiting_for_retry: row.try_get("waiting")?,
        dead_letters: row.try_get("dead")?,
        oldest_unpublished_age_seconds: row.try_get("oldest_age")?,
        by_type,
        by_type_truncated,
        retries: RetryLadder {
            next_due_at: b.try_get("next_due_at")?,
            next_due_in_seconds: b.try_get("next_due_in")?,
            due_within_1m: b.try_get("within_1m")?,
            due_within_1h: b.try_get("within_1h")?,
            due_later: b.try_get("later")?,
            next,
        },
        leader: leader_lock(client).await?,
        ordering: crate::migrate::ordering(client).await?,
    })
}

/// The holder of the outbox lock, judged against
/// [`crate::DEFAULT_STRANDED_AFTER`] ([`super::leader::LEADER_HOLDER`]);
/// none on a server in recovery (a standby).
async fn leader_lock<C: GenericClient + Sync>(client: &C) -> Result<Option<LeaderLock>> {
    let server =
        client.query_one("SELECT pg_is_in_recovery(), to_regclass('events.outbox_terms') IS NOT NULL", &[]).await?;
    let (in_recovery, has_terms): (bool, bool) = (server.try_get(0)?, server.try_get(1)?);
    if in_recovery {
        return Ok(None);
    }
    let threshold = crate::DEFAULT_STRANDED_AFTER.as_secs_f64();
    let Some(h) = super::leader::leader_holder(client, threshold).await? else { return Ok(None) };
    // The term is the holder's only when it took it (not a session of an
    // older build, or of anything else, that holds the lock); a schema from
    // before migration 0013 has none.
    let term: Option<i64> = if has_terms {
        let row = client
            .query_one(super::leader::CURRENT_TERM, &[&super::leader::OUTBOX_SCOPE])
            .await
            .map_err(super::map_missing_schema)?;
        let holder: Option<i32> = row.try_get("holder_pid")?;
        row.try_get::<_, Option<i64>>("term")?.filter(|_| holder == Some(h.id.pid))
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
    }))
}

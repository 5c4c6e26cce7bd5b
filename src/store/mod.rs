//! All SQL that pg-outbox runs at run time (schema SQL lives in `migrations/`
//! and `triggers/`). Every time comparison uses the database's `now()`.

use std::time::Duration;

use tokio_postgres::{GenericClient, Row};

use crate::error::{Error, Result};
use crate::event::{Event, NewEvent};

/// Column list of [`Event`], in the order [`event_from_row`] reads it.
const EVENT_COLUMNS: &str =
    "id, aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count, last_error";

pub(crate) const INSERT_ONE: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
     VALUES ($1, $2, $3, $4) RETURNING id";

pub(crate) const INSERT_MANY: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
     SELECT t, a, e, p FROM unnest($1::text[], $2::uuid[], $3::text[], $4::jsonb[]) \
     WITH ORDINALITY AS x(t, a, e, p, n) ORDER BY n RETURNING id";

/// The hold-back probe of a candidate row `o`: the id of the first earlier
/// event of its aggregate that has failed and is not published (waiting for
/// a retry, due again, or a dead letter), or NULL. An event is handed out
/// only when this is NULL, so per aggregate the failed event is always
/// delivered (or discarded) before anything after it.
///
/// Why it is robust: it is a correlated scalar subquery, so PostgreSQL runs
/// it once per candidate row and never turns it into a join, and it orders
/// by the expression `id + 0`, which only `outbox_holdback_idx` (aggregate,
/// `id + 0`; failed unpublished rows only) provides; with sorts discouraged
/// on pg-outbox's sessions ([`crate::PLANNER_SETTINGS`]) the probe is one
/// descent of that index whatever the statistics say. (Written as
/// `NOT EXISTS`, the planner flattens it into an anti-join, and with
/// statistics from before a backlog formed it chose to walk the whole
/// backlog through `outbox_unpublished_idx` for every candidate.)
macro_rules! held_back_by {
    () => {
        "(SELECT b.id FROM events.outbox b \
           WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id \
             AND b.id + 0 < o.id AND b.published_at IS NULL AND b.next_retry_at IS NOT NULL \
           ORDER BY b.id + 0 LIMIT 1)"
    };
}

/// See [`held_back_by`]: the row is not held back.
const NOT_HELD_BACK: &str = concat!(held_back_by!(), " IS NULL");
/// [`NOT_HELD_BACK`], skipped when no unpublished row has failed at all
/// (the usual case while a sink is healthy): the first test is one read of
/// the first entry of `outbox_retry_due_idx`, by its key (the only plan
/// without a sort), which PostgreSQL runs once per statement (an InitPlan),
/// and `OR` evaluates its arguments in order, so then no row pays for the
/// probe.
const NOT_HELD_BACK_IF_ANY_FAILED: &str = concat!(
    "((SELECT 1 FROM events.outbox f WHERE f.published_at IS NULL AND f.next_retry_at IS NOT NULL \
       ORDER BY f.next_retry_at LIMIT 1) IS NULL OR ",
    held_back_by!(),
    " IS NULL)"
);
/// See [`held_back_by`]: the row is held back.
const HELD_BACK: &str = concat!(held_back_by!(), " IS NOT NULL");

/// Fetch the next due events. Two index walks, each in the order of an
/// index no other index can stand in for, each stopping after $2 rows it
/// returns (plus the held-back rows it passes, one probe each):
/// fresh rows from `outbox_fresh_order_idx`, by its key `id + 0` (a key of
/// plain id would let the planner walk `outbox_pkey` or
/// `outbox_unpublished_idx` instead, through every published or failed
/// row), and failed rows whose retry is due from `outbox_retry_due_idx`, by
/// `next_retry_at` (rows waiting for a retry and dead letters, at
/// 'infinity', are outside its range). Then the lowest $2 ids of both.
/// With sorts discouraged on pg-outbox's sessions
/// ([`crate::PLANNER_SETTINGS`]), those walks are the only plans without a
/// sort, so the planner takes them whatever the statistics say (none, taken
/// before a backlog formed, or current); the final sort is over at most
/// twice $2 rows.
///
/// Due retries may come in any order: [`held_back_by`] lets through only
/// the earliest failed event of each aggregate, and nothing after it, so no
/// two events of one aggregate come from different branches.
///
/// $1 are ids already in flight, $2 the batch size. With `partitioned`,
/// only aggregates whose hash partition (of $3) is in $4, and the partition
/// is returned as column [`PARTITION_COLUMN`].
///
/// Every fetch starts from the lowest id: no cursor. A cursor (`id > last`)
/// would skip rows that were held back when it passed them and became
/// eligible since (their blocker was delivered or discarded), and rows of
/// another aggregate that committed after a higher id.
pub(crate) fn fetch_sql(partitioned: bool) -> String {
    let (part_filter, part_col) = if partitioned {
        (format!("AND {PARTITION_EXPR} = ANY($4::int4[])"), format!(", {PARTITION_EXPR} AS part"))
    } else {
        (String::new(), String::new())
    };
    format!(
        "SELECT {cols}{part_col} FROM ( \
           (SELECT o.* FROM events.outbox o \
             WHERE o.published_at IS NULL AND o.next_retry_at IS NULL \
               AND o.id <> ALL($1::bigint[]) {part_filter} AND {hb_fresh} \
             ORDER BY o.id + 0 LIMIT $2) \
           UNION ALL \
           (SELECT o.* FROM events.outbox o \
             WHERE o.published_at IS NULL AND o.next_retry_at IS NOT NULL AND o.next_retry_at <= now() \
               AND o.id <> ALL($1::bigint[]) {part_filter} AND {hb} \
             ORDER BY o.next_retry_at LIMIT $2) \
         ) o ORDER BY id LIMIT $2",
        cols = EVENT_COLUMNS,
        hb_fresh = NOT_HELD_BACK_IF_ANY_FAILED,
        hb = NOT_HELD_BACK
    )
}

/// The SQL text of the consumer's fetch in single mode, for `EXPLAIN`:
/// `$1` the ids in flight (`bigint[]`), `$2` the batch size in rows
/// (`bigint`). Exposed so its plan can be checked against real data: each
/// of its two branches must be an index range scan (`outbox_fresh_order_idx` for
/// fresh rows, `outbox_retry_due_idx` for due retries) that skips dead
/// letters and rows waiting for a retry instead of walking them.
pub fn fetch_query() -> String {
    fetch_sql(false)
}

/// Every statement pg-outbox runs on `events.outbox` at run time, by name,
/// with the SQL text it runs: for checking their plans with `EXPLAIN`
/// against real tables (the integration tests do, in every statistics
/// state). Not a stable interface: names and texts change with the code.
///
/// The parameters, by name: `fetch` `$1 bigint[]` ids in flight, `$2 bigint`
/// batch; `fetch_partitioned` those and `$3 bigint` partitions, `$4 int4[]`
/// partitions held; `competing_fetch`, `$1 bigint` batch; `ack` `$1 bigint[]`;
/// `fail` `$1 bigint[]` ids, `$2 jsonb` details per id (`{"<id>": {"e":
/// error, "d": delay in seconds, "s": retry count seen}}`), `$3 int4`
/// dead-letter threshold;
/// `next_retry_in`, `gauges`, `status`, `retry_buckets`: none;
/// `status_by_type`, `next_retries`: `$1 bigint` limit; `dead_letters_*`:
/// `$1 bigint[]` ids, `$2 text` aggregate type, `$3 text` event type, `$4
/// text` error text, `$5 timestamptz` since (each NULL for any), and but for
/// `dead_letters_count`, `$6 bigint` limit; `retention_delete` `$1 float8`
/// age in seconds, `$2 bigint` batch, `$3 bigint` after id;
/// `retention_count` `$1 float8`.
#[doc(hidden)]
pub fn run_time_statements() -> Vec<(&'static str, String)> {
    use crate::dead_letters as d;
    vec![
        ("fetch", fetch_sql(false)),
        ("fetch_partitioned", fetch_sql(true)),
        ("competing_fetch", COMPETING_FETCH.to_string()),
        ("ack", ACK.to_string()),
        ("fail", FAIL.to_string()),
        ("next_retry_in", NEXT_RETRY_IN.to_string()),
        ("gauges", GAUGES.to_string()),
        ("status", status_sql()),
        ("status_by_type", by_type_sql()),
        ("retry_buckets", RETRY_BUCKETS.to_string()),
        ("next_retries", NEXT_RETRIES.to_string()),
        ("dead_letters_list", d::list_sql()),
        ("dead_letters_count", d::count_sql()),
        ("dead_letters_ids", d::ids_sql()),
        ("dead_letters_retry", d::apply_sql(d::RETRY)),
        ("dead_letters_discard", d::apply_sql(d::DISCARD)),
        ("retention_delete", crate::retention::DELETE_BATCH.to_string()),
        ("retention_count", crate::retention::COUNT_DUE.to_string()),
    ]
}

/// The hash partition of a row's aggregate, 0..$3 (partitioned mode).
const PARTITION_EXPR: &str =
    "((hashtextextended(o.aggregate_type || '/' || o.aggregate_id::text, 0) & 2147483647) % $3)::int4";

/// Index of the partition column in a partitioned fetch's rows.
pub(crate) const PARTITION_COLUMN: usize = 8;

/// The seed's competing mode: claim due rows with `FOR UPDATE SKIP LOCKED`
/// inside a transaction held until the batch is settled. No per-aggregate
/// order, no hold-back. Due retries first (a walk of `outbox_retry_due_idx`
/// by `next_retry_at`), then fresh rows for the rest of the $1 (a walk of
/// `outbox_fresh_order_idx` by `id + 0`): as in [`fetch_sql`], each is the
/// only plan without a sort, so a head of dead letters or rows waiting for a
/// retry is never walked, whatever the statistics. Each claim is a plain
/// SELECT with LIMIT, so together they never lock more than $1 rows
/// (unlike `UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP
/// LOCKED)`, whose subquery the planner may run more than once).
pub(crate) const COMPETING_FETCH: &str = "WITH r AS ( \
       SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count, last_error \
       FROM events.outbox \
       WHERE published_at IS NULL AND next_retry_at IS NOT NULL AND next_retry_at <= now() \
       ORDER BY next_retry_at LIMIT $1 FOR UPDATE SKIP LOCKED), \
     f AS ( \
       SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count, last_error \
       FROM events.outbox \
       WHERE published_at IS NULL AND next_retry_at IS NULL \
       ORDER BY id + 0 LIMIT $1 - (SELECT count(*) FROM r) FOR UPDATE SKIP LOCKED) \
     SELECT * FROM r UNION ALL SELECT * FROM f";

/// Mark events published (the seed's MarkPublished, batched). Returns, per
/// row actually published, seconds from `occurred_at` to now.
pub(crate) const ACK: &str = "UPDATE events.outbox SET published_at = now() \
     WHERE id = ANY($1::bigint[]) AND published_at IS NULL \
     RETURNING EXTRACT(EPOCH FROM (now() - occurred_at))::float8";

/// Record failures (the seed's MarkRetry, batched): retry_count + 1,
/// last_error, and next_retry_at = now() + delay, or 'infinity' when the
/// event becomes a dead letter (retry_count reaches $3). $1 are the ids; $2
/// a jsonb object keyed by id (as text), each value `{"e": error, "d": delay
/// in seconds, "s": retry_count when fetched}` (see [`fail_details`]). Only
/// rows whose retry_count is still what was fetched change, so replaying a
/// batch whose reply was lost counts nothing twice.
///
/// Why it is robust: there is no join. `o.id = ANY($1)` makes every plan of
/// `events.outbox` an index lookup of those ids, and each row finds its
/// details by a key lookup in $2 (a binary search of the object's sorted
/// keys). Joined to `unnest` of arrays instead, under statistics from before
/// a backlog the planner took the outbox side for one row and rescanned the
/// whole array for every row: 3 s for 4 000 failures.
pub(crate) const FAIL: &str = "UPDATE events.outbox o SET retry_count = o.retry_count + 1, \
       last_error = $2::jsonb -> o.id::text ->> 'e', \
       next_retry_at = CASE WHEN o.retry_count + 1 >= $3 THEN 'infinity'::timestamptz \
         ELSE now() + make_interval(secs => ($2::jsonb -> o.id::text ->> 'd')::float8) END \
     WHERE o.id = ANY($1::bigint[]) AND o.published_at IS NULL \
       AND o.retry_count = ($2::jsonb -> o.id::text ->> 's')::int4 \
     RETURNING o.id, o.retry_count >= $3 AS dead, \
       CASE WHEN o.retry_count >= $3 THEN NULL \
            ELSE EXTRACT(EPOCH FROM (o.next_retry_at - now()))::float8 END";

/// [`FAIL`]'s `$2`: per id (as text), the error (`e`), the delay in seconds
/// (`d`) and the retry_count when fetched (`s`).
pub(crate) fn fail_details<'a>(fails: impl Iterator<Item = (i64, &'a str, f64, i32)>) -> serde_json::Value {
    serde_json::Value::Object(
        fails.map(|(id, e, d, s)| (id.to_string(), serde_json::json!({ "e": e, "d": d, "s": s }))).collect(),
    )
}

/// Seconds until the earliest pending retry is due, or NULL if none waits:
/// the first entry of `outbox_retry_due_idx` after now() (ordered by its
/// key, the only plan without a sort; see [`fetch_sql`]). Always one row.
pub(crate) const NEXT_RETRY_IN: &str = "SELECT (SELECT EXTRACT(EPOCH FROM (next_retry_at - now()))::float8 \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NOT NULL \
       AND next_retry_at > now() AND next_retry_at < 'infinity' \
     ORDER BY next_retry_at LIMIT 1)";

/// The relay's gauges, cheaper than [`status_sql`]: pending (not dead)
/// rows, dead letters, and the age of the oldest pending row in seconds.
pub(crate) const GAUGES: &str = "SELECT \
       count(*) FILTER (WHERE next_retry_at IS DISTINCT FROM 'infinity'), \
       count(*) FILTER (WHERE next_retry_at = 'infinity'), \
       EXTRACT(EPOCH FROM (now() - min(occurred_at) FILTER (WHERE next_retry_at IS DISTINCT FROM 'infinity')))::float8 \
     FROM events.outbox WHERE published_at IS NULL";

/// Backlog and lag figures; see [`OutboxStatus`]. `held` marks rows held
/// back behind an earlier failed event of their aggregate (one probe of
/// `outbox_holdback_idx` per due row, once: `OFFSET 0` keeps the subquery,
/// so `held` is not inlined into both FILTERs; see [`held_back_by`]).
fn status_sql() -> String {
    format!(
        "SELECT \
           count(*) AS unpublished, \
           count(*) FILTER (WHERE (next_retry_at IS NULL OR next_retry_at <= now()) AND NOT held) AS due, \
           count(*) FILTER (WHERE next_retry_at > now() AND next_retry_at < 'infinity') AS waiting, \
           count(*) FILTER (WHERE next_retry_at = 'infinity') AS dead, \
           EXTRACT(EPOCH FROM (now() - min(occurred_at) FILTER (WHERE next_retry_at IS DISTINCT FROM 'infinity')))::float8, \
           count(*) FILTER (WHERE (next_retry_at IS NULL OR next_retry_at <= now()) AND held) AS held \
         FROM (SELECT o.occurred_at, o.next_retry_at, \
                 CASE WHEN o.next_retry_at IS NULL OR o.next_retry_at <= now() THEN {HELD_BACK} ELSE false END AS held \
               FROM events.outbox o WHERE o.published_at IS NULL OFFSET 0) o"
    )
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

/// Backlog per type: one pass over the unpublished rows (the partial index
/// `outbox_unpublished_idx`), grouped; the hold-back probe
/// (`outbox_holdback_idx`, see [`held_back_by`]) runs only for due rows,
/// once each (`OFFSET 0` keeps the subquery, so its `held` is not inlined
/// into both FILTERs that read it). $1 is the row
/// limit (one more than shown, to tell whether rows were left out).
fn by_type_sql() -> String {
    format!(
        "SELECT o.event_type, o.aggregate_type, count(*) AS unpublished, \
           count(*) FILTER (WHERE (o.next_retry_at IS NULL OR o.next_retry_at <= now()) AND NOT o.held) AS due, \
           count(*) FILTER (WHERE (o.next_retry_at IS NULL OR o.next_retry_at <= now()) AND o.held) AS held, \
           count(*) FILTER (WHERE o.next_retry_at > now() AND o.next_retry_at < 'infinity') AS waiting, \
           count(*) FILTER (WHERE o.next_retry_at = 'infinity') AS dead, \
           EXTRACT(EPOCH FROM (now() - min(o.occurred_at) FILTER (WHERE o.next_retry_at IS DISTINCT FROM 'infinity')))::float8 \
         FROM (SELECT o.event_type, o.aggregate_type, o.occurred_at, o.next_retry_at, \
                 CASE WHEN o.next_retry_at IS NULL OR o.next_retry_at <= now() THEN {HELD_BACK} ELSE false END AS held \
               FROM events.outbox o WHERE o.published_at IS NULL OFFSET 0) o \
         GROUP BY o.event_type, o.aggregate_type \
         ORDER BY unpublished DESC, o.event_type, o.aggregate_type LIMIT $1"
    )
}

/// Rows waiting for a retry, bucketed by due time: a range scan of
/// `outbox_retry_due_idx` (keyed by next_retry_at, unpublished rows only).
const RETRY_BUCKETS: &str = "SELECT min(next_retry_at), EXTRACT(EPOCH FROM (min(next_retry_at) - now()))::float8, \
       count(*) FILTER (WHERE next_retry_at <= now() + interval '1 minute'), \
       count(*) FILTER (WHERE next_retry_at > now() + interval '1 minute' AND next_retry_at <= now() + interval '1 hour'), \
       count(*) FILTER (WHERE next_retry_at > now() + interval '1 hour') \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at > now() AND next_retry_at < 'infinity'";

/// The next $1 rows to come due for a retry, in due order: the first
/// entries of `outbox_retry_due_idx` after now(), in the order of its key,
/// the only plan without a sort (ties, which the failures of one batch can
/// share, in index order; ordering them by id too would sort every row of
/// the tie).
const NEXT_RETRIES: &str = "SELECT id, event_type, aggregate_type, retry_count, next_retry_at, \
       EXTRACT(EPOCH FROM (next_retry_at - now()))::float8, last_error \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at > now() AND next_retry_at < 'infinity' \
     ORDER BY next_retry_at LIMIT $1";

/// Read [`OutboxStatus`]: four read-only queries (totals, per type, retry
/// buckets, next retries), each served by a partial index and bounded by a
/// LIMIT where it returns rows. The totals and per-type figures scan the
/// unpublished rows (not the published history), so their cost grows with
/// the backlog, not the table. The queries run one after another (not in one
/// snapshot), so figures taken while a relay works may differ by a few rows.
///
/// # Errors
/// [`Error::NotMigrated`] if the schema is missing; [`Error::Db`] if the
/// query fails otherwise.
pub async fn status<C: GenericClient + Sync>(client: &C) -> Result<OutboxStatus> {
    let row = client.query_one(&status_sql(), &[]).await.map_err(map_missing_schema)?;
    let mut by_type = client
        .query(&by_type_sql(), &[&(STATUS_MAX_TYPES + 1)])
        .await
        .map_err(map_missing_schema)?
        .iter()
        .map(|r| {
            Ok(TypeBacklog {
                event_type: r.try_get(0)?,
                aggregate_type: r.try_get(1)?,
                unpublished: r.try_get(2)?,
                due_now: r.try_get(3)?,
                held_back: r.try_get(4)?,
                waiting_for_retry: r.try_get(5)?,
                dead_letters: r.try_get(6)?,
                oldest_unpublished_age_seconds: r.try_get(7)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let by_type_truncated = by_type.len() > usize::try_from(STATUS_MAX_TYPES).unwrap_or(usize::MAX);
    by_type.truncate(usize::try_from(STATUS_MAX_TYPES).unwrap_or(usize::MAX));
    let b = client.query_one(RETRY_BUCKETS, &[]).await.map_err(map_missing_schema)?;
    let next = client
        .query(NEXT_RETRIES, &[&STATUS_NEXT_RETRIES])
        .await
        .map_err(map_missing_schema)?
        .iter()
        .map(|r| {
            Ok(PendingRetry {
                id: r.try_get(0)?,
                event_type: r.try_get(1)?,
                aggregate_type: r.try_get(2)?,
                retry_count: r.try_get(3)?,
                due_at: r.try_get(4)?,
                due_in_seconds: r.try_get(5)?,
                last_error: r.try_get(6)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(OutboxStatus {
        unpublished: row.try_get(0)?,
        due_now: row.try_get(1)?,
        held_back: row.try_get(5)?,
        waiting_for_retry: row.try_get(2)?,
        dead_letters: row.try_get(3)?,
        oldest_unpublished_age_seconds: row.try_get(4)?,
        by_type,
        by_type_truncated,
        retries: RetryLadder {
            next_due_at: b.try_get(0)?,
            next_due_in_seconds: b.try_get(1)?,
            due_within_1m: b.try_get(2)?,
            due_within_1h: b.try_get(3)?,
            due_later: b.try_get(4)?,
            next,
        },
    })
}

/// An [`Event`] from a row of [`EVENT_COLUMNS`], read by column name.
pub(crate) fn event_from_row(row: &Row) -> Result<Event> {
    Ok(Event {
        id: row.try_get("id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        occurred_at: row.try_get("occurred_at")?,
        retry_count: row.try_get("retry_count")?,
        last_error: row.try_get("last_error")?,
    })
}

/// What a failure needs of a row [`event_from_row`] could not decode: its
/// id, aggregate type, aggregate id and retry count, read by name, or
/// `None` if one of those cannot be read either.
pub(crate) fn row_identity(row: &Row) -> Option<(i64, String, uuid::Uuid, i32)> {
    Some((
        row.try_get("id").ok()?,
        row.try_get("aggregate_type").ok()?,
        row.try_get("aggregate_id").ok()?,
        row.try_get("retry_count").ok()?,
    ))
}

/// The partition of a row of a partitioned fetch ([`fetch_sql`]`(true)`),
/// read by name; `None` for a row of another fetch.
pub(crate) fn row_partition(row: &Row) -> Option<i32> {
    row.try_get("part").ok()
}

pub(crate) async fn insert_event<C: GenericClient + Sync>(client: &C, e: &NewEvent) -> Result<i64> {
    let row = client
        .query_one(INSERT_ONE, &[&e.aggregate_type, &e.aggregate_id, &e.event_type, &e.payload])
        .await
        .map_err(map_missing_schema)?;
    Ok(row.try_get(0)?)
}

pub(crate) async fn insert_events<C: GenericClient + Sync>(client: &C, events: &[NewEvent]) -> Result<Vec<i64>> {
    let types: Vec<&str> = events.iter().map(|e| e.aggregate_type.as_str()).collect();
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.aggregate_id).collect();
    let names: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    let payloads: Vec<&serde_json::Value> = events.iter().map(|e| &e.payload).collect();
    let rows = client.query(INSERT_MANY, &[&types, &ids, &names, &payloads]).await.map_err(map_missing_schema)?;
    let mut out = rows.iter().map(|r| r.try_get::<_, i64>(0)).collect::<Result<Vec<_>, _>>()?;
    // Sequence values are drawn in ORDER BY n order within the statement, so
    // ascending ids are the input order.
    out.sort_unstable();
    Ok(out)
}

/// Turn "relation events.outbox does not exist" into [`Error::NotMigrated`].
pub(crate) fn map_missing_schema(e: tokio_postgres::Error) -> Error {
    if let Some(db) = e.as_db_error()
        && (*db.code() == tokio_postgres::error::SqlState::UNDEFINED_TABLE
            || *db.code() == tokio_postgres::error::SqlState::INVALID_SCHEMA_NAME)
    {
        return Error::NotMigrated(db.message().to_string());
    }
    Error::Db(e)
}

/// Seconds as a [`Duration`], clamped to zero and to a day (a timer never
/// needs more: the sweep runs far more often).
pub(crate) fn secs_to_duration(secs: f64) -> Duration {
    if !secs.is_finite() || secs <= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(secs.min(86_400.0)) }
}

/// Single mode: try to take the outbox's session lock ($1: bigint key).
pub(crate) const TRY_LEADER_LOCK: &str = "SELECT pg_try_advisory_lock($1)";
/// Partitioned mode: hold a membership lock for this session ($1 class, $2 key).
pub(crate) const MEMBER_LOCK: &str = "SELECT pg_advisory_lock($1, $2)";
/// Partitioned mode: how many consumers hold a membership lock of class $1
/// in this database (two-int4 advisory locks have `objsubid = 2`,
/// PostgreSQL docs "pg_locks").
pub(crate) const COUNT_MEMBERS: &str = "SELECT count(*) FROM pg_locks \
     WHERE locktype = 'advisory' AND granted \
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
       AND classid = ($1::int4)::bigint::oid AND objsubid = 2";
/// Partitioned mode: try to take partition $2 of class $1.
pub(crate) const TRY_PARTITION_LOCK: &str = "SELECT pg_try_advisory_lock($1, $2)";
/// Partitioned mode: give partition $2 of class $1 up.
pub(crate) const PARTITION_UNLOCK: &str = "SELECT pg_advisory_unlock($1, $2)";
/// Competing mode: open and close the claim transaction.
pub(crate) const BEGIN: &str = "BEGIN";
/// See [`BEGIN`].
pub(crate) const COMMIT: &str = "COMMIT";
/// Fraction of the notification queue in use (0..1).
pub(crate) const NOTIFICATION_QUEUE_USAGE: &str = "SELECT pg_notification_queue_usage()";
/// Send notification payload $2 on channel $1 (the start-up probe).
pub(crate) const NOTIFY: &str = "SELECT pg_notify($1, $2)";

/// How many sessions wait for the lock a notifying transaction holds through
/// its COMMIT. PostgreSQL takes it in `PreCommit_Notify`
/// (src/backend/commands/async.c: `LockSharedObject(DatabaseRelationId,
/// InvalidOid, 0, AccessExclusiveLock)`), so it shows in `pg_locks` as an
/// `object` lock on `pg_database` with database and objid 0; it is one lock
/// for the whole server. Waiters mean notifying commits are queueing.
pub(crate) const NOTIFY_LOCK_WAITERS: &str = "SELECT count(*) FROM pg_catalog.pg_locks \
     WHERE locktype = 'object' AND database = 0 AND classid = 'pg_catalog.pg_database'::regclass \
       AND objid = 0 AND objsubid = 0 AND NOT granted";

/// Register this relay (its work connection's backend pid) as waiting for a
/// wake-up ($1 = true) or as busy draining ($1 = false).
pub(crate) const SET_WAITING: &str = "INSERT INTO events.outbox_relays (pid, waiting) VALUES (pg_backend_pid(), $1) \
     ON CONFLICT (pid) DO UPDATE SET waiting = EXCLUDED.waiting, updated_at = now()";
/// Forget relays whose sessions are gone (their `waiting` no longer means anything).
pub(crate) const FORGET_GONE_RELAYS: &str = "DELETE FROM events.outbox_relays r \
     WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.pid)";
/// Stop receiving wake-ups: drop this session's row.
pub(crate) const UNREGISTER: &str = "DELETE FROM events.outbox_relays WHERE pid = pg_backend_pid()";

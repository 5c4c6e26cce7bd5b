//! Settling delivered events: acknowledgements and failures, batched, each
//! fenced by the writer's term.

/// The fence of a write: `current` is true when the writer's term (`$T`,
/// NULL for a consumer that holds no term: competing and partitioned
/// modes) is scope `'outbox'`'s current term in `events.outbox_terms`
/// (migration 0013). The row is read `FOR SHARE`: a leader taking the next
/// term ([`super::leader::TAKE_TERM`]) waits for the write to end, and a
/// write that comes after the bump reads the new term (PostgreSQL docs,
/// "The Locking Clause": a locked row is re-read in its latest version).
/// A macro so that `concat!` builds the statements with the term's
/// parameter number.
macro_rules! fence {
    ($t:literal) => {
        concat!(
            "fence AS MATERIALIZED (SELECT ",
            $t,
            "::bigint IS NULL OR coalesce((SELECT t.term FROM events.outbox_terms t \
               WHERE t.scope = 'outbox' FOR SHARE) = ",
            $t,
            ", false) AS current)"
        )
    };
}

/// Mark events published (MarkPublished of docs/schema.md, batched), if
/// term $2 is current ([`fence!`]). Returns `current` and, per row actually
/// published, seconds from `occurred_at` to now (`lag`, NULL in the one
/// row returned when none was published).
pub(crate) const ACK: &str = concat!(
    "WITH ",
    fence!("$2"),
    ", u AS (UPDATE events.outbox SET published_at = now() \
       WHERE id = ANY($1::bigint[]) AND published_at IS NULL AND (SELECT current FROM fence) \
       RETURNING EXTRACT(EPOCH FROM (now() - occurred_at))::float8 AS lag) \
     SELECT f.current, u.lag FROM fence f LEFT JOIN u ON true"
);

/// Record failures (MarkRetry of docs/schema.md, batched): retry_count + 1,
/// last_error, and next_retry_at = now() + delay, or 'infinity' when the
/// event becomes a dead letter (retry_count reaches $3). $1 are the ids; $2
/// a jsonb object keyed by id (as text), each value `{"e": error, "d": delay
/// in seconds, "s": retry_count when fetched}` (see [`fail_details`]). Only
/// rows whose retry_count is still what was fetched change, so replaying a
/// batch whose reply was lost counts nothing twice. Returns per row changed
/// `id`, `dead` and `retry_in` (seconds until the retry, NULL for a dead
/// letter), with `current` (false: term $4 is no longer current
/// ([`fence!`]), and nothing changed); when no row changed, one row with
/// `current` and NULLs.
///
/// Why it is robust: there is no join. `o.id = ANY($1)` makes every plan of
/// `events.outbox` an index lookup of those ids, and each row finds its
/// details by a key lookup in $2 (a binary search of the object's sorted
/// keys). Joined to `unnest` of arrays instead, under statistics from before
/// a backlog the planner took the outbox side for one row and rescanned the
/// whole array for every row: 3 s for 4 000 failures.
pub(crate) const FAIL: &str = concat!(
    "WITH ",
    fence!("$4"),
    ", u AS (UPDATE events.outbox o SET retry_count = o.retry_count + 1, \
       last_error = $2::jsonb -> o.id::text ->> 'e', \
       next_retry_at = CASE WHEN o.retry_count + 1 >= $3 THEN 'infinity'::timestamptz \
         ELSE now() + make_interval(secs => ($2::jsonb -> o.id::text ->> 'd')::float8) END \
     WHERE o.id = ANY($1::bigint[]) AND o.published_at IS NULL \
       AND o.retry_count = ($2::jsonb -> o.id::text ->> 's')::int4 AND (SELECT current FROM fence) \
     RETURNING o.id, o.retry_count >= $3 AS dead, \
       CASE WHEN o.retry_count >= $3 THEN NULL \
            ELSE EXTRACT(EPOCH FROM (o.next_retry_at - now()))::float8 END AS retry_in) \
     SELECT f.current, u.id, u.dead, u.retry_in FROM fence f LEFT JOIN u ON true"
);

/// [`FAIL`]'s `$2`: per id (as text), the error (`e`), the delay in seconds
/// (`d`) and the retry_count when fetched (`s`).
pub(crate) fn fail_details<'a>(fails: impl Iterator<Item = (i64, &'a str, f64, i32)>) -> serde_json::Value {
    serde_json::Value::Object(
        fails.map(|(id, e, d, s)| (id.to_string(), serde_json::json!({ "e": e, "d": d, "s": s }))).collect(),
    )
}

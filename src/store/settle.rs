//! Settling delivered events: acknowledgements and failures, batched.

/// Mark events published (MarkPublished of docs/schema.md, batched). Returns, per
/// row actually published, seconds from `occurred_at` to now (`lag`).
pub(crate) const ACK: &str = "UPDATE events.outbox SET published_at = now() \
     WHERE id = ANY($1::bigint[]) AND published_at IS NULL \
     RETURNING EXTRACT(EPOCH FROM (now() - occurred_at))::float8 AS lag";

/// Record failures (MarkRetry of docs/schema.md, batched): retry_count + 1,
/// last_error, and next_retry_at = now() + delay, or 'infinity' when the
/// event becomes a dead letter (retry_count reaches $3). $1 are the ids; $2
/// a jsonb object keyed by id (as text), each value `{"e": error, "d": delay
/// in seconds, "s": retry_count when fetched}` (see [`fail_details`]). Only
/// rows whose retry_count is still what was fetched change, so replaying a
/// batch whose reply was lost counts nothing twice. Returns per row changed
/// `id`, `dead` and `retry_in` (seconds until the retry, NULL for a dead
/// letter).
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
            ELSE EXTRACT(EPOCH FROM (o.next_retry_at - now()))::float8 END AS retry_in";

/// [`FAIL`]'s `$2`: per id (as text), the error (`e`), the delay in seconds
/// (`d`) and the retry_count when fetched (`s`).
pub(crate) fn fail_details<'a>(fails: impl Iterator<Item = (i64, &'a str, f64, i32)>) -> serde_json::Value {
    serde_json::Value::Object(
        fails.map(|(id, e, d, s)| (id.to_string(), serde_json::json!({ "e": e, "d": d, "s": s }))).collect(),
    )
}

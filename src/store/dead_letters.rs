//! The operators' statements on dead letters ([`crate::dead_letters`]).

/// The WHERE clause shared by every operation; `$6` is the row limit.
/// Every statement orders by `id + 0`, the key of `outbox_dead_letter_idx`
/// (dead letters only), which no other index provides: with sorts
/// discouraged on pg-outbox's sessions ([`crate::PLANNER_SETTINGS`]) each
/// is a walk of that index, touching dead letters only, whatever the
/// statistics say (the count too: its subquery keeps the order).
pub(crate) const MATCHES: &str = "published_at IS NULL AND next_retry_at = 'infinity' \
     AND ($1::bigint[] IS NULL OR id = ANY($1)) \
     AND ($2::text IS NULL OR aggregate_type = $2) \
     AND ($3::text IS NULL OR event_type = $3) \
     AND ($4::text IS NULL OR strpos(coalesce(last_error, ''), $4) > 0) \
     AND ($5::timestamptz IS NULL OR occurred_at >= $5)";

/// `list`'s statement: `$1`..`$5` the filter, `$6` the limit.
pub(crate) fn list_sql() -> String {
    format!(concat!("SELECT ", event_columns!(), " FROM events.outbox WHERE {} ORDER BY id + 0 LIMIT $6"), MATCHES)
}

/// `count`'s statement: `$1`..`$5` the filter.
pub(crate) fn count_sql() -> String {
    format!("SELECT count(*) FROM (SELECT 1 FROM events.outbox WHERE {MATCHES} ORDER BY id + 0) d")
}

/// `matching_ids`'s statement: `$1`..`$5` the filter, `$6` the limit.
pub(crate) fn ids_sql() -> String {
    format!("SELECT id FROM events.outbox WHERE {MATCHES} ORDER BY id + 0 LIMIT $6")
}

/// `retry`'s action on the picked dead letters.
pub(crate) const RETRY: &str =
    "UPDATE events.outbox o SET next_retry_at = now() FROM picked WHERE o.id = picked.id RETURNING o.id";
/// `discard`'s action on the picked dead letters.
pub(crate) const DISCARD: &str = "DELETE FROM events.outbox o USING picked WHERE o.id = picked.id RETURNING o.id";

/// `retry`'s and `discard`'s statement around `action`: `$1`..`$5` the
/// filter, `$6` the limit.
pub(crate) fn apply_sql(action: &str) -> String {
    format!(
        "WITH picked AS (SELECT id FROM events.outbox WHERE {MATCHES} ORDER BY id + 0 LIMIT $6 FOR UPDATE), \
              done AS ({action}) \
         SELECT id FROM done ORDER BY id"
    )
}

/// Which of the ids $1 (`bigint[]`) are in `events.outbox` at all, dead
/// letters or not: lookups in `outbox_pkey`, to explain ids an operator
/// named that are not dead letters.
pub(crate) const EXISTING_IDS: &str = "SELECT id FROM events.outbox WHERE id = ANY($1::bigint[])";

//! Replay's statements (`pg_outbox::relay::replay`): reads only.
//!
//! A replay walks `outbox_pkey` in windows of ids: each statement reads the
//! rows with ids in `($1, $2]` that match the filter, in id order, at most
//! `$9` of them. The window bounds the index range one statement walks
//! whatever the filter keeps (a filter on a rare event type reads the window
//! and returns few rows), so no statement reads the whole range at once; the
//! limit bounds the rows one page holds.

/// Make the session's transactions read-only (each statement of a replay is
/// a transaction of its own): a replay cannot change a row, even by mistake.
pub(crate) const READ_ONLY: &str = "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY";

/// Whether this session's transactions are read-only (`read_only`), to
/// check that [`READ_ONLY`] took.
pub(crate) const IS_READ_ONLY: &str = "SELECT current_setting('transaction_read_only') = 'on' AS read_only";

/// The lowest and the highest id above `$1 bigint` (`first_id`, `last_id`;
/// NULL when there is none): where a replay starts and ends, and, after a
/// window with nothing in it, where the next row is (so a gap in the ids,
/// such as retention leaves at the low end, costs one statement, not one
/// per window). One step at each end of `outbox_pkey`.
pub(crate) const BOUNDS: &str = "SELECT min(id) AS first_id, max(id) AS last_id FROM events.outbox WHERE id > $1";

/// The window and the filter: ids in `($1 bigint, $2 bigint]`; `$3
/// boolean` include unpublished rows; `$4 timestamptz` occurred at or
/// after, `$5 timestamptz` occurred before, `$6 text` aggregate type, `$7
/// uuid` aggregate id, `$8 text` event type (each NULL for any).
const MATCHES: &str = "id > $1 AND id <= $2 \
     AND ($3::boolean OR published_at IS NOT NULL) \
     AND ($4::timestamptz IS NULL OR occurred_at >= $4) \
     AND ($5::timestamptz IS NULL OR occurred_at < $5) \
     AND ($6::text IS NULL OR aggregate_type = $6) \
     AND ($7::uuid IS NULL OR aggregate_id = $7) \
     AND ($8::text IS NULL OR event_type = $8)";

/// One page: the matching rows ([`MATCHES`], `$1`..`$8`), lowest id
/// first, at most `$9 bigint`. Ordered by `id`,
/// the key of `outbox_pkey`: with sorts discouraged on pg-outbox's sessions
/// ([`crate::PLANNER_SETTINGS`]), a walk of that index over the window that
/// stops after `$9` rows.
pub(crate) fn page_sql() -> String {
    format!(concat!("SELECT ", event_columns!(), " FROM events.outbox WHERE {} ORDER BY id LIMIT $9"), MATCHES)
}

/// What a dry run counts in one window: the matching rows ([`MATCHES`],
/// `$1`..`$8`: `n`) and the lowest and highest of their ids (`first_id`,
/// `last_id`).
pub(crate) fn count_sql() -> String {
    format!("SELECT count(*) AS n, min(id) AS first_id, max(id) AS last_id FROM events.outbox WHERE {MATCHES}")
}

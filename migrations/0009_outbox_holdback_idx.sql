-- pg-outbox migration 0009 (addition): the index of the hold-back probe,
-- replacing outbox_aggregate_failed_idx (0003, dropped by 0011).
-- The probe asks, for a candidate row o: "which is the first earlier event
-- of o's aggregate that failed and is not published?" (src/store/fetch.rs,
-- held_back_by), ordered by the expression (id + 0). No other index can
-- produce that order (PostgreSQL does not infer an expression's order from
-- its column's; docs, "Indexes and ORDER BY"), and pg-outbox's sessions
-- discourage explicit sorts (src/connect.rs, PLANNER_SETTINGS), so the probe
-- is a descent of this index for every candidate, whatever the table's
-- statistics say. With a key of plain id, a plan that walks the whole
-- backlog through outbox_unpublished_idx for every candidate looked as
-- cheap whenever the statistics predated the backlog.
-- Only rows that have failed at least once are in it (next_retry_at set),
-- so producers' inserts never touch it.
-- CONCURRENTLY, one statement, idempotent: see 0002.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_holdback_idx
    ON events.outbox (aggregate_type, aggregate_id, (id + 0))
    WHERE published_at IS NULL AND next_retry_at IS NOT NULL;

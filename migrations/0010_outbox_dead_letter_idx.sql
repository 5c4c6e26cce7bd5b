-- pg-outbox migration 0010 (addition): dead letters in id order.
-- Dead letters are unpublished rows with next_retry_at = 'infinity' (0004).
-- Listing, counting, retrying and discarding them (`pg-outbox dead-letters`)
-- walks this index in the order of its key, the expression (id + 0), which
-- no other index provides: however stale the statistics, the walk touches
-- dead letters only, never the backlog or the published history.
-- Producers' inserts never touch it (next_retry_at is NULL on insert).
-- CONCURRENTLY, one statement, idempotent: see 0002.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_dead_letter_idx ON events.outbox ((id + 0))
    WHERE published_at IS NULL AND next_retry_at = 'infinity';

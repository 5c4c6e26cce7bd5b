-- pg-outbox migration 0003 (addition): per-aggregate hold-back asks "is there
-- an earlier event of this aggregate that failed and is not due again?".
-- This index holds only unpublished rows that have failed at least once
-- (next_retry_at set), so the answer is one short index probe however many
-- events the aggregate has, published or not.
-- CONCURRENTLY, one statement per file: see 0002.
-- Idempotent: running this file twice is a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_aggregate_failed_idx
    ON events.outbox (aggregate_type, aggregate_id, id)
    WHERE published_at IS NULL AND next_retry_at IS NOT NULL;

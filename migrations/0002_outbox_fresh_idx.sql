-- pg-outbox migration 0002 (addition): the index the relay walks to fetch new
-- events in id order. Rows waiting for a retry and dead letters have
-- next_retry_at set, so they are not in it: a head of failed rows never slows
-- the fetch of fresh events.
-- CONCURRENTLY: producers keep inserting while it builds (PostgreSQL docs,
-- "CREATE INDEX", Building Indexes Concurrently). One statement per file, so
-- `psql -f` and `pg-outbox migrate` both run it outside a transaction block.
-- Idempotent: running this file twice is a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_fresh_idx ON events.outbox (id)
    WHERE published_at IS NULL AND next_retry_at IS NULL;

-- pg-outbox migration 0007: drop outbox_fresh_idx (0002), replaced by
-- outbox_fresh_order_idx (0006); producers no longer maintain both.
-- CONCURRENTLY, one statement, idempotent: see 0002.
DROP INDEX CONCURRENTLY IF EXISTS events.outbox_fresh_idx;

-- pg-outbox migration 0011: drop outbox_aggregate_failed_idx (0003), replaced
-- by outbox_holdback_idx (0009); failures no longer maintain both.
-- CONCURRENTLY, one statement, idempotent: see 0002.
DROP INDEX CONCURRENTLY IF EXISTS events.outbox_aggregate_failed_idx;

-- pg-outbox migration 0004 (addition): per-aggregate commit order.
--
-- A sequence value is taken at INSERT but becomes visible at COMMIT, so two
-- transactions writing events of one aggregate could commit ids 10 and 11 in
-- the order 11, 10, and a relay could deliver 11 first. The trigger in
-- triggers/outbox_insert_order_and_notify.sql prevents that: before an event row gets its id,
-- its transaction locks the aggregate's row in this table (a row lock: it
-- lives in the tuple, not in the shared lock table, so a bulk insert of any
-- number of aggregates cannot run out of lock memory). A second transaction
-- writing the same aggregate waits there until the first ends, and only
-- then draws its id: an aggregate's visible ids are always a prefix of its
-- ids. Transactions writing different aggregates never wait on each other.
-- One small row per aggregate ever written.
CREATE TABLE IF NOT EXISTS events.outbox_aggregate_heads (
    aggregate_type TEXT NOT NULL,
    aggregate_id   UUID NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- Dead letters are marked with next_retry_at = 'infinity' (never due, so
-- even the seed's own FetchUnpublishedBatch query skips them). Rows that an
-- earlier poller left at the seed's threshold (retry_count >= 10) become
-- dead letters in that form. Idempotent.
UPDATE events.outbox SET next_retry_at = 'infinity'
WHERE published_at IS NULL AND retry_count >= 10 AND next_retry_at IS DISTINCT FROM 'infinity';

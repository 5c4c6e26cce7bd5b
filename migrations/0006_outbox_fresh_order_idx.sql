-- pg-outbox migration 0006 (addition): the index the relay walks to fetch new
-- events, replacing outbox_fresh_idx (dropped by 0007). Its key is the
-- expression (id + 0), not id, and the fetch orders by that expression, so no
-- other index can produce the fetch's order. With a key of plain id, the
-- planner may prefer outbox_pkey whenever its statistics say that nearly all
-- rows are unpublished (a large backlog at the last ANALYZE): a pkey scan then
-- walks every row published since, on every fetch, and a drain slows down as
-- it goes (measured: from 22 000 to 540 events/s on a 200 000 event backlog).
-- PostgreSQL does not infer the order of an expression from its column's
-- (docs, "Indexes and ORDER BY"), so only this index serves it.
-- Rows waiting for a retry and dead letters have next_retry_at set, so they
-- are not in it: a head of failed rows never slows the fetch of fresh events.
-- CONCURRENTLY, one statement, idempotent: see 0002.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_fresh_order_idx ON events.outbox ((id + 0))
    WHERE published_at IS NULL AND next_retry_at IS NULL;

-- pg-outbox migration 0014 (addition): where a retention run's walk may end.
--
-- Each retention run records, when it starts, the highest id in
-- events.outbox and the time it read it (`taken_at`, the database's
-- clock). Every row with a higher id committed after that time (it was
-- not visible to max(id)), and a row is published only after it commits.
-- A later run with cutoff C therefore walks only up to the `last_id` of
-- the oldest mark taken at least an hour after C and not after now (the
-- hour covers a publisher whose `now()` is its transaction's start). With
-- daily runs, a 30-day retention walks the due day and about one more,
-- not the whole table. Without such a mark a run walks to the highest id.
-- A row whose `published_at` was written earlier than its commit by more
-- than the hour is deleted late (docs/operations.md, "Retention").
-- A handful of rows (one per run; runs keep the newest 10 000).
-- Idempotent: running this file twice is a no-op.
CREATE TABLE IF NOT EXISTS events.outbox_retention_marks (
    taken_at TIMESTAMPTZ PRIMARY KEY,
    last_id  BIGINT NOT NULL
);

-- pg-outbox migration 0001: the events.outbox table exactly as seeded
-- (seed-events-outbox-schema, "Table"). Producers depend on these columns,
-- defaults, the CHECK constraint and the four index names: never change them.
-- Idempotent: running this file twice is a no-op.

CREATE SCHEMA IF NOT EXISTS events;

CREATE TABLE IF NOT EXISTS events.outbox (
    id                 BIGSERIAL PRIMARY KEY,
    aggregate_type     TEXT NOT NULL,
    aggregate_id       UUID NOT NULL,
    event_type         TEXT NOT NULL,
    payload            JSONB NOT NULL,
    occurred_at        TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    published_at       TIMESTAMPTZ,
    retry_count        INTEGER NOT NULL DEFAULT 0,
    last_error         TEXT,
    next_retry_at      TIMESTAMPTZ,
    CONSTRAINT outbox_retry_nonneg CHECK (retry_count >= 0)
);

CREATE INDEX IF NOT EXISTS outbox_unpublished_idx ON events.outbox (id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_retry_due_idx ON events.outbox (next_retry_at)
    WHERE published_at IS NULL AND next_retry_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS outbox_aggregate_idx ON events.outbox (aggregate_type, aggregate_id, id);
CREATE INDEX IF NOT EXISTS outbox_event_type_occurred_idx ON events.outbox (event_type, occurred_at);

-- pg-outbox migration 0005 (addition): which relays want a wake-up.
--
-- NOTIFY takes a database-wide lock at COMMIT (PostgreSQL docs, "NOTIFY"),
-- so every notifying producer transaction queues behind the one before it.
-- A relay that is draining needs no wake-up: it keeps fetching until it
-- finds nothing. Each active relay keeps a row here (keyed by its work
-- connection's backend pid) and sets `waiting` only while it is idle; the
-- insert trigger (triggers/outbox_insert_order_and_notify.sql), through the
-- hint that triggers/outbox_relays_refresh_hint.sql keeps, notifies only
-- when some relay is waiting, or when no relay has registered at all.
-- UNLOGGED: this is ephemeral state; no WAL, emptied after a crash.
-- Idempotent: running this file twice is a no-op.
CREATE UNLOGGED TABLE IF NOT EXISTS events.outbox_relays (
    pid        INTEGER PRIMARY KEY,
    waiting    BOOLEAN NOT NULL DEFAULT false,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

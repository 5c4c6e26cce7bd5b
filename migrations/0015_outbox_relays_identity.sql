-- pg-outbox migration 0015 (addition): who each registered relay is.
--
-- A row of events.outbox_relays is keyed by the backend pid of a relay's
-- work session, which names the server's process, not the relay's. A
-- relay that takes leadership (the outbox, or partitioned membership)
-- records its own process id, host name and version beside it, so
-- `pg-outbox status` and the console can say which relay leads or holds a
-- partition, and how old its heartbeat is (docs/operations.md, "Several
-- relays on one outbox"). Nullable: rows of relays of earlier builds have none.
-- Idempotent: running this file twice is a no-op.
ALTER TABLE events.outbox_relays
    ADD COLUMN IF NOT EXISTS relay_pid     INTEGER,
    ADD COLUMN IF NOT EXISTS relay_host    TEXT,
    ADD COLUMN IF NOT EXISTS relay_version TEXT;

-- pg-outbox trigger file: the update trigger `outbox_guard` on events.outbox.
--
-- What it does: rejects an UPDATE that breaks the seed's invariants
-- (seed-events-outbox-schema, "Invariants"), whoever runs it:
--   * published_at is one-way: once set it never goes back to NULL;
--   * retry_count only increases (never decreases).
-- The payload being JSON is enforced by the column type (jsonb), and
-- retry_count >= 0 by the seeded CHECK constraint.
-- Fires: BEFORE UPDATE ON events.outbox, FOR EACH ROW, and only for a row
-- that breaks an invariant (its WHEN clause), so valid updates pay nothing.
-- Locks: none of its own.
-- Needs: PostgreSQL 13 or later (pg-outbox's minimum, checked by
-- `pg-outbox migrate`; this file alone needs 11).
--
-- Decision table, per updated row:
--
--   OLD.published_at | NEW.published_at | retry_count   | outcome
--   -----------------+------------------+---------------+---------------------------
--   NULL             | any              | same or more  | allowed (function not run)
--   set              | set              | same or more  | allowed (function not run)
--   set              | NULL             | any           | SQLSTATE 23514, names the id
--   any              | any              | lower         | SQLSTATE 23514, names the id
--
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.published_at IS NOT NULL AND NEW.published_at IS NULL THEN
        RAISE EXCEPTION 'events.outbox: published_at cannot go back to NULL (id %)', OLD.id
            USING ERRCODE = 'check_violation',
                  HINT = 'published_at is one-way: once an event is published it stays published';
    END IF;
    IF NEW.retry_count < OLD.retry_count THEN
        RAISE EXCEPTION 'events.outbox: retry_count cannot decrease (id %, % -> %)',
            OLD.id, OLD.retry_count, NEW.retry_count
            USING ERRCODE = 'check_violation',
                  HINT = 'retry_count only increases';
    END IF;
    RETURN NEW;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_guard' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_guard
            BEFORE UPDATE ON events.outbox
            FOR EACH ROW
            WHEN ((OLD.published_at IS NOT NULL AND NEW.published_at IS NULL)
                  OR NEW.retry_count < OLD.retry_count)
            EXECUTE FUNCTION events.outbox_guard();
    END IF;
END
$$;

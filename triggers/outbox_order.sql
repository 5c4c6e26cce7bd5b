-- pg-outbox trigger: per-aggregate commit order (see migration 0004).
--
-- BEFORE INSERT, for each row: lock the aggregate's head row (creating it if
-- needed), then assign NEW.id from the sequence. Column defaults are
-- evaluated before BEFORE triggers, so the default's value was drawn too
-- early (before the lock) and is replaced; the sequence just skips it.
-- Consequences, by design:
--   * two transactions writing the same aggregate are serialised from the
--     first such INSERT to COMMIT/ROLLBACK of the first; ids of one
--     aggregate therefore become visible in id order;
--   * transactions writing different aggregates never wait on each other;
--   * two transactions writing the same two aggregates in opposite orders
--     can deadlock (PostgreSQL detects it and aborts one; retry it);
--   * a rolled-back insert releases the lock at once.
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_order() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        PERFORM 1 FROM events.outbox_aggregate_heads
        WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id
        FOR NO KEY UPDATE;
        EXIT WHEN FOUND;
        -- A new aggregate: our uncommitted head row is the lock (a concurrent
        -- insert of the same key waits for us to end).
        INSERT INTO events.outbox_aggregate_heads (aggregate_type, aggregate_id)
        VALUES (NEW.aggregate_type, NEW.aggregate_id)
        ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
    NEW.id := nextval('events.outbox_id_seq'::regclass);
    RETURN NEW;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_order' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_order
            BEFORE INSERT ON events.outbox
            FOR EACH ROW EXECUTE FUNCTION events.outbox_order();
    END IF;
END
$$;

-- pg-outbox trigger: keep the producers' hint (migration 0008) in step with
-- the relays (events.outbox_relays, migration 0005) and with bulk writers.
--
-- NOTIFY takes a lock at COMMIT that is shared by the whole server (it is
-- taken on database 0 in PreCommit_Notify, src/backend/commands/async.c),
-- so every notifying producer transaction queues behind the one before it,
-- whatever its database (docs, "NOTIFY"). A relay
-- that is draining needs no wake-up: it fetches until it finds nothing.
-- Each relay therefore says in events.outbox_relays whether it waits; after
-- every statement on that table, events.outbox_hint_refresh() sets bit 1 of
-- events.outbox_hint when some relay waits (or none has registered, e.g. a
-- consumer that is not pg-outbox), and producers notify only then
-- (triggers/outbox_order.sql). A relay that goes idle looks again 0, 2, 10,
-- 50, 200 and 500 ms after it does, and its sweep finds anything later
-- still, so an event whose producer read the hint just before is not lost.
-- The refresh also clears bit 2 once no bulk transaction holds the gate.
-- Idempotent: running this file twice is a no-op.

-- Advisory lock keys (two-int4 form, class 0x706f0003): (class, 1) is the
-- bulk gate, held in share mode by every bulk transaction; (class, 2)
-- serialises writers of events.outbox_hint.
CREATE OR REPLACE FUNCTION events.outbox_hint_refresh() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    notify boolean;
    bulk boolean;
    hint bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(1886322691, 2);
    notify := NOT EXISTS (SELECT 1 FROM events.outbox_relays)
              OR EXISTS (SELECT 1 FROM events.outbox_relays WHERE waiting);
    bulk := coalesce(pg_sequence_last_value('events.outbox_hint'), 3) & 2 <> 0;
    -- The gate is free: no bulk transaction is running (one that starts
    -- now waits for this transaction, then sets bit 2 again).
    IF bulk AND pg_try_advisory_xact_lock(1886322691, 1) THEN
        bulk := false;
    END IF;
    hint := (CASE WHEN notify THEN 1 ELSE 0 END) + (CASE WHEN bulk THEN 2 ELSE 0 END);
    PERFORM setval('events.outbox_hint', hint);
    RETURN hint;
END
$$;

CREATE OR REPLACE FUNCTION events.outbox_relays_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM events.outbox_hint_refresh();
    RETURN NULL;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_relays_changed' AND tgrelid = 'events.outbox_relays'::regclass
    ) THEN
        CREATE TRIGGER outbox_relays_changed
            AFTER INSERT OR UPDATE OR DELETE ON events.outbox_relays
            FOR EACH STATEMENT EXECUTE FUNCTION events.outbox_relays_changed();
    END IF;
END
$$;

SELECT events.outbox_hint_refresh();

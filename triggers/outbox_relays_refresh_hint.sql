-- pg-outbox trigger file: the statement trigger `outbox_relays_changed` on
-- events.outbox_relays, and events.outbox_hint_refresh(). It sends no
-- NOTIFY itself: it keeps the hint that tells the insert trigger
-- (triggers/outbox_insert_order_and_notify.sql) whether to.
--
-- What it does: after every statement that changes events.outbox_relays
-- (migration 0005: each relay's row says whether it waits for a wake-up),
-- it recomputes the producers' hint, the sequence events.outbox_hint
-- (migration 0008), and sets it with setval (immediate, no transaction of
-- its own).
-- Fires: AFTER INSERT OR UPDATE OR DELETE ON events.outbox_relays, FOR EACH
-- STATEMENT; and once when this file is applied.
-- Locks: the trigger class 0x706f0003 = 1886322691 (TRIGGER_CLASS in
-- src/store/locks.rs; docs/architecture.md, "Advisory lock keys"):
-- (1886322691, 2), the hint writers (HINT_WRITERS), for the rest of the
-- transaction; (1886322691, 1), the bulk gate (BULK_GATE), tried in
-- exclusive mode and, when free, held for the rest of the transaction.
-- Needs: PostgreSQL 13 or later (pg-outbox's minimum, checked by
-- `pg-outbox migrate`; this file alone needs 11).
--
-- Decision table (the new hint is the sum of its bits):
--
--   events.outbox_relays                 | bit 1 (notify)
--   -------------------------------------+---------------
--   empty (no pg-outbox relay registered) | set
--   some relay waits (waiting = true)     | set
--   every relay busy (waiting = false)    | clear
--
--   bit 2 before | bulk gate (1886322691, 1)        | bit 2 after
--   -------------+----------------------------------+------------
--   clear        | (not tried)                      | clear
--   set          | held by a bulk transaction       | set
--   set          | free (taken until this tx ends)  | clear
--
-- Why: NOTIFY takes a lock at COMMIT that is shared by the whole server
-- (it is taken on database 0 in PreCommit_Notify,
-- src/backend/commands/async.c), so every notifying producer transaction
-- queues behind the one before it, whatever its database (docs, "NOTIFY").
-- A relay that is draining needs no wake-up: it fetches until it finds
-- nothing. So producers notify only while bit 1 is set. A relay that goes
-- idle looks again 0, 2, 10, 50, 200 and 500 ms after it does, and its
-- sweep finds anything later still, so an event whose producer read the
-- hint just before is not lost. A bulk transaction that starts while the
-- refresh holds the gate waits for the refresh's transaction, then sets
-- bit 2 again.
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_hint_refresh() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    notify boolean;
    bulk boolean;
    hint bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(1886322691, 2);  -- hint writers (docs/architecture.md, "Advisory lock keys")
    notify := NOT EXISTS (SELECT 1 FROM events.outbox_relays)
              OR EXISTS (SELECT 1 FROM events.outbox_relays WHERE waiting);
    bulk := coalesce(pg_sequence_last_value('events.outbox_hint'), 3) & 2 <> 0;
    -- The gate is free: no bulk transaction is running (one that starts
    -- now waits for this transaction, then sets bit 2 again).
    -- The bulk gate (docs/architecture.md, "Advisory lock keys").
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

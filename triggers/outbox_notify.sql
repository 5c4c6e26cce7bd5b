-- pg-outbox trigger: wake an idle relay when events are committed.
--
-- A BEFORE INSERT row trigger whose WHEN clause matches only the
-- transaction's first event (the transaction-local setting
-- pg_outbox.notify_checked is empty until this trigger sets it), so its
-- function runs once per transaction, and the other rows cost one
-- expression each. It sends an empty payload on the channel "events.outbox":
-- the notification only says "look"; the rows are the truth. PostgreSQL
-- holds a NOTIFY until COMMIT and drops it on ROLLBACK (docs, "NOTIFY"), so
-- a rolled-back transaction wakes nobody, and a transaction of any size
-- sends at most one notification, far below NOTIFY's 8000-byte payload limit.
--
-- It notifies only when a relay is waiting for a wake-up (or when no relay
-- has registered in events.outbox_relays, e.g. a consumer that is not
-- pg-outbox): a relay that is busy draining polls anyway, and skipping
-- NOTIFY spares producers its database-wide commit lock. The decision is
-- taken at the transaction's first insert; a relay that goes idle later
-- looks again 0, 2, 10, 50, 200 and 500 ms after it does, and its sweep
-- finds anything committed later still. (An earlier version decided at
-- COMMIT in a deferred constraint trigger; that trigger alone cost producers
-- about 15 % of their insert rate at 16 connections.)
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('pg_outbox.notify_checked', 'y', true);
    -- NULL (no relay registered) or true (one is waiting): notify.
    IF (SELECT bool_or(waiting) FROM events.outbox_relays) IS NOT FALSE THEN
        PERFORM pg_notify('events.outbox', '');
    END IF;
    RETURN NEW;
END
$$;

DO $$
BEGIN
    -- Earlier versions used a statement-level trigger, then a deferred
    -- constraint trigger, of this name. tgtype 7 = ROW | BEFORE | INSERT.
    IF EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_notify' AND tgrelid = 'events.outbox'::regclass
          AND (tgconstraint <> 0 OR tgtype <> 7)
    ) THEN
        DROP TRIGGER outbox_notify ON events.outbox;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_notify' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_notify
            BEFORE INSERT ON events.outbox
            FOR EACH ROW
            WHEN (coalesce(current_setting('pg_outbox.notify_checked', true), '') = '')
            EXECUTE FUNCTION events.outbox_notify();
    END IF;
END
$$;

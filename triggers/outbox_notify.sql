-- pg-outbox trigger: wake an idle relay when events are committed.
--
-- A deferred constraint trigger: it runs at COMMIT, once per transaction
-- (its WHEN clause matches only the transaction's first event, whose id the
-- order trigger records in the transaction-local setting
-- pg_outbox.first_id), and sends an empty payload on the channel
-- "events.outbox": the notification only says "look"; the rows are the
-- truth. A transaction of any size sends at most one notification, and the
-- payload can never approach NOTIFY's 8000-byte limit.
--
-- It notifies only when a relay is waiting for a wake-up (or when no relay
-- has registered in events.outbox_relays, e.g. a consumer that is not
-- pg-outbox): a relay that is busy draining polls anyway, and skipping
-- NOTIFY spares producers its database-wide commit lock. Deciding at COMMIT
-- (not at INSERT) means a long producer transaction still wakes a relay that
-- went idle meanwhile. A rolled-back transaction notifies nobody.
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM events.outbox_relays WHERE waiting)
       OR NOT EXISTS (SELECT 1 FROM events.outbox_relays) THEN
        PERFORM pg_notify('events.outbox', '');
    END IF;
    RETURN NULL;
END
$$;

DO $$
BEGIN
    -- Earlier versions used a plain statement-level trigger of this name.
    IF EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_notify' AND tgrelid = 'events.outbox'::regclass AND tgconstraint = 0
    ) THEN
        DROP TRIGGER outbox_notify ON events.outbox;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_notify' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE CONSTRAINT TRIGGER outbox_notify
            AFTER INSERT ON events.outbox
            DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW
            WHEN (NEW.id::text = current_setting('pg_outbox.first_id', true))
            EXECUTE FUNCTION events.outbox_notify();
    END IF;
END
$$;

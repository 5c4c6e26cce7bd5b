-- pg-outbox trigger: wake the relay when events are inserted.
--
-- Fires once per INSERT statement (FOR EACH STATEMENT), not once per row, and
-- sends an empty payload on the channel "events.outbox": the notification only
-- says "look"; the rows are the truth. A bulk insert of any size sends one
-- notification, and the payload can never approach NOTIFY's 8000-byte limit
-- (PostgreSQL docs, "NOTIFY"). Identical notifications within one transaction
-- are folded into one by the server, so a transaction costs one notification.
-- Notifications are delivered at COMMIT; a rolled-back insert wakes nobody.
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('events.outbox', '');
    RETURN NULL;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_notify' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_notify
            AFTER INSERT ON events.outbox
            FOR EACH STATEMENT EXECUTE FUNCTION events.outbox_notify();
    END IF;
END
$$;

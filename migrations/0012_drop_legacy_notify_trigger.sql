-- pg-outbox migration 0012: drop what earlier versions installed and this
-- one no longer uses (earlier, the insert trigger's file dropped it).
--
-- * The statement trigger outbox_notify on events.outbox and its function
--   events.outbox_notify(): earlier versions notified from them; the insert
--   trigger (triggers/outbox_insert_order_and_notify.sql) notifies now. A
--   database still on such a version has, between this migration and the
--   insert trigger file, inserts that send no wake-up: relays find those
--   events at their next sweep (1 s by default).
-- * The ledger rows (events.outbox_schema_migrations, written by
--   `pg-outbox migrate`) of the trigger files' former names,
--   triggers/outbox_guard, triggers/outbox_notify and triggers/outbox_order:
--   the files are now triggers/outbox_update_check_invariants.sql,
--   triggers/outbox_relays_refresh_hint.sql and
--   triggers/outbox_insert_order_and_notify.sql, recorded under those names.
--
-- The trigger is dropped only if it exists, with a lock_timeout of 5 s (the
-- drop waits for running producer transactions; run it again if it times
-- out), so a database without it is not locked at all.
-- Idempotent: running this file twice is a no-op.
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_notify' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        PERFORM set_config('lock_timeout', '5s', true);
        DROP TRIGGER outbox_notify ON events.outbox;
    END IF;
    IF to_regclass('events.outbox_schema_migrations') IS NOT NULL THEN
        DELETE FROM events.outbox_schema_migrations
        WHERE name IN ('triggers/outbox_guard', 'triggers/outbox_notify', 'triggers/outbox_order');
    END IF;
END
$$;
DROP FUNCTION IF EXISTS events.outbox_notify();

-- pg-outbox migration 0008 (addition): the producers' hint.
--
-- Every event insert reads this one value (pg_sequence_last_value, a buffer
-- read without a query), so that the per-row trigger costs producers as
-- little as possible (triggers/outbox_insert_order_and_notify.sql):
--   bit 1 (value & 1): some relay waits for a wake-up, or none has
--         registered: producers NOTIFY;
--   bit 2 (value & 2): a bulk transaction may be writing events: producers
--         check whether it holds their aggregate (see that file).
-- Kept by triggers/outbox_relays_refresh_hint.sql from events.outbox_relays and by bulk
-- transactions. A sequence because setval is immediate and needs no
-- transaction of its own (docs, "Sequence Manipulation Functions").
-- Starts at 3 (notify, check): the safe value until the first refresh.
-- Idempotent: running this file twice is a no-op.
CREATE SEQUENCE IF NOT EXISTS events.outbox_hint AS bigint MINVALUE 0 MAXVALUE 3 START 3 NO CYCLE;
SELECT setval('events.outbox_hint', 3) WHERE pg_sequence_last_value('events.outbox_hint') IS NULL;
GRANT SELECT ON SEQUENCE events.outbox_hint TO PUBLIC;

-- pg-outbox migration 0017 (addition): a subscription may expire
-- (docs/subscriptions.md, "Falling behind"). An operator who opted in
-- (`subscription set NAME --max-lag D --expire`, the subscription's
-- `options` key `expire`) lets a subscription that falls behind its lag
-- bound be marked `expired`: retention then stops waiting for it, and its
-- relays stop. Nothing else changes: the seeded table is untouched.
-- Idempotent: the constraint is replaced only while it lacks 'expired'.
-- Also an index for the gauges (below).
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
         WHERE conrelid = 'events.outbox_subscriptions'::regclass
           AND conname = 'outbox_subscriptions_state_check'
           AND pg_get_constraintdef(oid) LIKE '%expired%') THEN
        ALTER TABLE events.outbox_subscriptions DROP CONSTRAINT IF EXISTS outbox_subscriptions_state_check;
        ALTER TABLE events.outbox_subscriptions ADD CONSTRAINT outbox_subscriptions_state_check
            CHECK (state IN ('active', 'paused', 'expired'));
    END IF;
END
$$;

-- A subscription's failure rows that are not dead letters (waiting for a
-- retry, due, or held back), by id: the backlog gauges count them and find
-- the oldest (src/store/subscription.rs, GAUGES) without passing its dead
-- letters, which only pile up (100 000 of them cost the gauges 3 480
-- buffers every 5 s through the primary key).
CREATE INDEX IF NOT EXISTS outbox_subscription_failures_pending_idx
    ON events.outbox_subscription_failures (subscription, id)
    WHERE next_retry_at IS NULL OR next_retry_at < 'infinity';

-- pg-outbox migration 0017 (addition): a subscription may expire
-- (docs/subscriptions.md, "Falling behind"). An operator who opted in
-- (`subscription set NAME --max-lag D --expire`, the subscription's
-- `options` key `expire`) lets a subscription that falls behind its lag
-- bound be marked `expired`: retention then stops waiting for it, and its
-- relays stop. Nothing else changes: the seeded table is untouched.
-- Idempotent: the constraint is replaced only while it lacks 'expired'.
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

-- pg-outbox migration 0018 (addition): a partial index of a subscription's
-- held events (failure rows with `next_retry_at` NULL: events the cursor
-- passed behind a failed event of their aggregate), by id. A subscription
-- read in competing mode holds nothing back: its claim takes held events
-- as due, walking this index (src/store/subscription_claim.rs) instead of
-- passing the failure rows that wait for a retry or are dead letters.
-- Nothing else changes: the seeded table is untouched.
-- Idempotent: running this file twice is a no-op.
CREATE INDEX IF NOT EXISTS outbox_subscription_failures_held_idx
    ON events.outbox_subscription_failures (subscription, id)
    WHERE next_retry_at IS NULL;

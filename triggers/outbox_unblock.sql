-- pg-outbox trigger file: the triggers `outbox_unblock` and
-- `outbox_unblock_delete` on events.outbox, and events.outbox_unblock().
--
-- What it does: counts, transactionally, the changes that can let an event
-- held back behind a failed event of its aggregate be handed out: a failed
-- event (unpublished, `next_retry_at` set: waiting for a retry, due, or a
-- dead letter) that is published (its retry acknowledged), deleted
-- (`dead-letters discard`), or no longer failed, and an unpublished event
-- whose id or aggregate changes. The count is the `term` of scope
-- 'unblock' in events.outbox_terms (migration 0013), bumped at most once
-- per transaction. Every ordered fetch reads it in its own snapshot: when
-- it differs from the count the consumer last saw, the fetch reads from the
-- first fresh row instead of its floor, so the fetch floor may pass
-- held-back events without ever leaving one behind (docs/architecture.md,
-- "The fetch floor").
-- Fires: AFTER UPDATE and AFTER DELETE ON events.outbox, FOR EACH ROW, and
-- only for a row its WHEN clause names, so producers' inserts, the relay's
-- acknowledgements of fresh events, its failures and the archive's deletes
-- of published rows pay nothing but the clause. Enabled ALWAYS, so it fires
-- under `session_replication_role = replica` too. A fetch counts unblocks
-- only while both triggers are enabled ALWAYS; otherwise (one disabled, say)
-- the fetch floor stops at held-back rows instead of passing them.
-- Disabling them inside a transaction that frees held rows and enabling
-- them again before it commits hides the freeing from the relay: the
-- events it frees may then be delivered after later events of their
-- aggregate.
-- Runs as the owner of the function (SECURITY DEFINER), so roles that
-- publish, acknowledge or discard need no privilege on events.outbox_terms
-- for it.
-- Locks: the row of scope 'unblock' in events.outbox_terms, until the
-- transaction ends (two transactions that unblock at once take turns).
-- Needs: PostgreSQL 13 or later (pg_current_xact_id).
--
-- Decision table, per row:
--
--   statement | OLD row                     | NEW row                              | count
--   ----------+-----------------------------+--------------------------------------+-------
--   UPDATE    | published                   | any                                  | same
--   UPDATE    | unpublished, failed         | published, or next_retry_at NULL     | +1
--   UPDATE    | unpublished, failed         | still failed, same id and aggregate  | same
--   UPDATE    | unpublished                 | another id or aggregate              | +1
--   UPDATE    | unpublished, fresh          | same id and aggregate                | same
--   DELETE    | unpublished, failed         | (none)                               | +1
--   DELETE    | published, or fresh         | (none)                               | same
--
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_unblock() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- Once per transaction: a row this transaction already bumped has its
    -- id as xmin.
    INSERT INTO events.outbox_terms AS t (scope, term) VALUES ('unblock', 1)
    ON CONFLICT (scope) DO UPDATE SET term = t.term + 1, taken_at = now()
        WHERE t.xmin <> pg_current_xact_id()::xid;
    RETURN NULL;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_unblock' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_unblock
            AFTER UPDATE ON events.outbox
            FOR EACH ROW
            WHEN (OLD.published_at IS NULL
                  AND ((OLD.next_retry_at IS NOT NULL
                        AND (NEW.published_at IS NOT NULL OR NEW.next_retry_at IS NULL))
                       OR NEW.id <> OLD.id
                       OR NEW.aggregate_type <> OLD.aggregate_type
                       OR NEW.aggregate_id <> OLD.aggregate_id))
            EXECUTE FUNCTION events.outbox_unblock();
        ALTER TABLE events.outbox ENABLE ALWAYS TRIGGER outbox_unblock;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_unblock_delete' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_unblock_delete
            AFTER DELETE ON events.outbox
            FOR EACH ROW
            WHEN (OLD.published_at IS NULL AND OLD.next_retry_at IS NOT NULL)
            EXECUTE FUNCTION events.outbox_unblock();
        ALTER TABLE events.outbox ENABLE ALWAYS TRIGGER outbox_unblock_delete;
    END IF;
END
$$;

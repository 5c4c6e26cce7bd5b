-- pg-outbox trigger file: the triggers `outbox_rewind` and
-- `outbox_rewind_insert` on events.outbox, and events.outbox_rewind().
--
-- What it does: counts, transactionally, the changes that can make an
-- event fresh (unpublished, `next_retry_at` NULL: what the ordered fetch
-- reads in id order) where the fetch floor's rule cannot see it: an UPDATE
-- that makes a row fresh that was published or failed before, or gives a
-- fresh row another id (say, an operator setting `published_at` back to
-- NULL under `session_replication_role = replica`, which the guard
-- `outbox_guard` lets through there), and an INSERT under
-- `session_replication_role = replica` (a restore, a logical replication
-- subscriber), where the insert trigger `outbox_order` does not fire, so
-- the event's id may be older than its transaction's id. The count is the
-- `term` of scope 'rewind' in events.outbox_terms (migration 0013), bumped
-- at most once per transaction. Every ordered fetch reads it in its own
-- snapshot: when it differs from the count the consumer last saw, the
-- fetch reads from the first fresh row instead of its floor, so an event
-- made fresh below the floor is fetched by the first fetch that can see it
-- (docs/architecture.md, "The fetch floor").
-- Fires: `outbox_rewind` BEFORE UPDATE ON events.outbox, FOR EACH ROW,
-- only for a row its WHEN clause names, so the relay's acknowledgements
-- and failures, retries and discards pay nothing but the clause; enabled
-- ALWAYS, so it fires under `session_replication_role = replica` too.
-- `outbox_rewind_insert` BEFORE INSERT ON events.outbox, FOR EACH ROW,
-- enabled REPLICA: it fires only in sessions with
-- `session_replication_role = replica`, so producers' inserts never run
-- it (its WHEN clause checks the role too, so a plain `ENABLE TRIGGER`,
-- as `pg_restore --disable-triggers` ends with, cannot make every
-- producer's transaction bump the count and take turns on its row; the
-- fetch then reads the count as not kept). Row triggers, because the
-- logical replication apply process fires no statement triggers (docs,
-- "Logical Replication Architecture"); BEFORE
-- triggers, so that the first row of a transaction sets the transaction's
-- mark (the setting `pg_outbox.rewound`, local to the transaction) before
-- the next row's WHEN clause reads it: after the first, the rows of a
-- transaction run no function at all, however many rows one statement
-- changes. Both return the row unchanged.
-- A fetch counts rewinds only while `outbox_rewind` is enabled ALWAYS and
-- `outbox_rewind_insert` REPLICA or ALWAYS; otherwise (one disabled or
-- missing, say) the consumer drops its floor every sweep interval instead.
-- Disabling them, changing rows and enabling them again between two
-- fetches hides the change until the consumer next drops its floor anyway
-- (at most a minute, or the sweep interval if longer). So does setting
-- `pg_outbox.rewound` to `on` by hand before the change.
-- Runs as the owner of the function (SECURITY DEFINER), so roles that
-- change events.outbox need no privilege on events.outbox_terms for it.
-- Its SET clause restores only `search_path` when it returns: the mark it
-- sets stays for the rest of the transaction (docs, "CREATE FUNCTION").
-- A savepoint rolled back undoes the mark with the bump.
-- Locks: the row of scope 'rewind' in events.outbox_terms, until the
-- transaction ends (two transactions that rewind at once take turns).
-- Needs: PostgreSQL 13 or later (pg_current_xact_id).
--
-- Decision table, per row (until the transaction's first bump; then
-- nothing):
--
--   statement | session role | OLD row                 | NEW row                  | count
--   ----------+--------------+-------------------------+--------------------------+-------
--   UPDATE    | any          | published, or failed    | fresh                    | +1
--   UPDATE    | any          | fresh                   | fresh, another id        | +1
--   UPDATE    | any          | fresh                   | fresh, same id           | same
--   UPDATE    | any          | any                     | published, or failed     | same
--   INSERT    | replica      | (none)                  | any                      | +1
--   INSERT    | origin/local | (none)                  | any                      | same
--   DELETE    | any          | any                     | (none)                   | same
--
-- Idempotent: running this file twice is a no-op.

CREATE OR REPLACE FUNCTION events.outbox_rewind() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM set_config('pg_outbox.rewound', 'on', true);
    -- Once per transaction also without the mark (set by hand to another
    -- value in the transaction, say): a row this transaction already
    -- bumped has its id as xmin.
    INSERT INTO events.outbox_terms AS t (scope, term) VALUES ('rewind', 1)
    ON CONFLICT (scope) DO UPDATE SET term = t.term + 1, taken_at = now()
        WHERE t.xmin <> pg_current_xact_id()::xid;
    RETURN NEW;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_rewind' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_rewind
            BEFORE UPDATE ON events.outbox
            FOR EACH ROW
            WHEN (NEW.published_at IS NULL AND NEW.next_retry_at IS NULL
                  AND (OLD.published_at IS NOT NULL
                       OR OLD.next_retry_at IS NOT NULL
                       OR NEW.id <> OLD.id)
                  AND current_setting('pg_outbox.rewound', true) IS DISTINCT FROM 'on')
            EXECUTE FUNCTION events.outbox_rewind();
        ALTER TABLE events.outbox ENABLE ALWAYS TRIGGER outbox_rewind;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_rewind_insert' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_rewind_insert
            BEFORE INSERT ON events.outbox
            FOR EACH ROW
            WHEN (current_setting('session_replication_role') = 'replica'
                  AND current_setting('pg_outbox.rewound', true) IS DISTINCT FROM 'on')
            EXECUTE FUNCTION events.outbox_rewind();
        ALTER TABLE events.outbox ENABLE REPLICA TRIGGER outbox_rewind_insert;
    END IF;
END
$$;

-- pg-outbox trigger file: the insert triggers `outbox_order` and
-- `outbox_wake` on events.outbox, one of them enabled (the ordering mode),
-- and events.outbox_set_ordering(), which switches between them.
--
-- Ordering modes (docs/architecture.md, "Ordering modes"):
--   * outbox-locked (the default): `outbox_order` is enabled. Everything
--     below the mode list describes it: the trigger itself keeps each
--     aggregate's ids in commit order, whatever the producers do.
--   * producer-locked: `outbox_wake` is enabled instead, a statement
--     trigger that only sends the wake-up, and only while a relay waits for
--     one: its WHEN condition reads bit 1 of the hint, so while every relay
--     is busy no function is called at all (docs, "CREATE TRIGGER": WHEN).
--     Ids come from the column's default. Order per aggregate then holds
--     only if every transaction that writes an aggregate's events first
--     locks a row of its own for that aggregate and keeps it to the commit
--     (the schema's flow: UPDATE the aggregate's row, then INSERT the
--     event): a second writer waits at that row and draws its id after the
--     first commits. Producers that do not can commit an aggregate's ids
--     out of order, and a relay then delivers them out of order.
--   Switch with `pg-outbox migrate --ordering MODE` or
--   `SELECT events.outbox_set_ordering('producer-locked')`; the mode is
--   which trigger is enabled (pg_trigger.tgenabled), and running this file
--   again keeps it.
--
-- What it does: in the outbox-locked mode, before each event row is
-- inserted, it takes a lock on the event's aggregate (so each aggregate's
-- ids become visible in id order), takes the transaction's id
-- (pg_current_xact_id, which the insert would take anyway), only then draws
-- the event's id, and sends the relays' wake-up (NOTIFY) when one is
-- wanted. Ids drawn after the transaction id let a relay's fetch start
-- past what it has read (docs/architecture.md, "The fetch floor").
-- Fires: outbox_order BEFORE INSERT ON events.outbox, FOR EACH ROW, every
-- insert; outbox_wake BEFORE INSERT, FOR EACH STATEMENT, when bit 1 of
-- the hint is set.
-- Reads: events.outbox_hint (migration 0008), a sequence whose value is the
-- hint: bit 1 (value & 1) "some relay waits for a wake-up", bit 2 (value & 2)
-- "a bulk transaction may be writing events". It is kept by
-- triggers/outbox_relays_refresh_hint.sql and by events.outbox_bulk_begin().
-- Locks: the per-aggregate key, and the trigger class 0x706f0003 =
-- 1886322691 (TRIGGER_CLASS in src/store/locks.rs) with its keys 1, the
-- bulk gate (BULK_GATE), and 2, the hint writers (HINT_WRITERS): see
-- docs/architecture.md, "Advisory lock keys". Row locks on
-- events.outbox_aggregate_heads (migration 0004).
-- Needs: PostgreSQL 13 or later (pg_current_xact_id); checked below and by
-- `pg-outbox migrate`.
--
-- Decision table, per inserted row (hint as read after the aggregate's
-- lock; a NULL hint counts as 3):
--
--   hint | ordinary transaction                 | bulk transaction
--   -----+--------------------------------------+-------------------------------
--    0   | aggregate's advisory lock; no NOTIFY | aggregate's head row; no NOTIFY
--    1   | aggregate's advisory lock; NOTIFY    | aggregate's head row; NOTIFY
--    2   | advisory lock, and the head row if   | aggregate's head row; no NOTIFY
--        | a bulk transaction runs; no NOTIFY   |
--    3   | advisory lock, and the head row if   | aggregate's head row; NOTIFY
--        | a bulk transaction runs; NOTIFY      |
--
--   * "aggregate's advisory lock": pg_advisory_xact_lock on the bigint key
--     uuid_hash_extended(aggregate_id, hashtextextended(aggregate_type,
--     1886322691)), held until the transaction ends; it waits while another
--     transaction holds it.
--   * "head row": FOR NO KEY UPDATE of the aggregate's row in
--     events.outbox_aggregate_heads (created if new), held until the
--     transaction ends, after waiting for any ordinary transaction holding
--     the aggregate's advisory lock (taken and released at once).
--   * "a bulk transaction runs": the bulk gate (1886322691, 1) is held; the
--     trigger tries it and releases it at once.
--   * NOTIFY: pg_notify('events.outbox', ''), sent at COMMIT, dropped on
--     ROLLBACK; identical notifications of one transaction fold into one.
--   * The fast path, one PL/pgSQL expression: an ordinary transaction,
--     hint 0, and the advisory lock free at once. Everything else is the
--     full path.
--   * Ordinary turns bulk: a transaction that has written about 1 024
--     events (counted on the ids divisible by 64), or that called
--     events.outbox_bulk_begin(), becomes a bulk transaction: it takes the
--     bulk gate in share mode and sets bit 2 of the hint.
--
-- Why: a sequence value is taken at INSERT but becomes visible at COMMIT,
-- so two transactions writing events of one aggregate could commit ids 10
-- and 11 in the order 11, 10, and a relay could deliver 11 first. Here a
-- second transaction writing the same aggregate waits for the first at the
-- lock, and only then draws its id. Column defaults are evaluated before
-- BEFORE triggers, so the default's value was drawn too early (before the
-- lock) and is replaced; the sequence just skips it. Consequences, by
-- design:
--   * an aggregate's visible ids are always a prefix of its ids;
--   * transactions writing different aggregates never wait on each other;
--   * two transactions writing the same two aggregates in opposite orders
--     can deadlock (PostgreSQL detects it and aborts one; retry it);
--   * a rolled-back insert releases its locks at once.
--
-- The advisory lock lives in PostgreSQL's shared lock table, not in a table
-- row, so it writes no WAL and no tuple; that table is sized for about
-- max_locks_per_transaction (64) locks per connection (docs, "Lock
-- Management"), so a transaction may not hold one per event forever: hence
-- bulk transactions and their row locks (stored in the tuple, so any number
-- of aggregates fits). An ordinary transaction that sees bit 2 after taking
-- its advisory lock, and finds the gate held, also locks the aggregate's
-- head row, so it waits for a bulk transaction that holds it, or makes the
-- bulk transaction wait for it. Bit 2 is cleared by the next refresh
-- (triggers/outbox_relays_refresh_hint.sql) once the gate is free.
--
-- The wake-up: NOTIFY takes a lock at COMMIT that is one for the whole
-- server, so producers notify only while a relay waits for one (bit 1);
-- the notification only says "look" (empty payload); the rows are the
-- truth.
--
-- Cost: with every relay busy (hint 0), an ordinary insert takes the fast
-- path, two PL/pgSQL expressions; the e2e bench's producers scenario
-- reports the server time per insert.
--
-- Applied in one transaction that first takes SHARE ROW EXCLUSIVE on
-- events.outbox, so no producer runs an older version of this trigger
-- while another runs this one; it waits at most 5 s for running producer
-- transactions (lock_timeout), and can simply be run again.
-- Idempotent: running this file twice is a no-op.

BEGIN;
DO $$
BEGIN
    IF current_setting('server_version_num')::integer < 130000 THEN
        RAISE EXCEPTION 'pg-outbox needs PostgreSQL 13 or later; this server runs %',
            current_setting('server_version');
    END IF;
END
$$;
SET LOCAL lock_timeout = '5s';
LOCK TABLE events.outbox IN SHARE ROW EXCLUSIVE MODE;

-- Lock the aggregate's head row until the transaction ends, creating it if
-- needed (a new aggregate: our uncommitted head row is the lock, and a
-- concurrent insert of the same key waits for us). Called by the two
-- functions below, which run as the schema's owner.
CREATE OR REPLACE FUNCTION events.outbox_lock_head(agg_type text, agg_id uuid) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        PERFORM 1 FROM events.outbox_aggregate_heads
        WHERE aggregate_type = agg_type AND aggregate_id = agg_id
        FOR NO KEY UPDATE;
        EXIT WHEN FOUND;
        INSERT INTO events.outbox_aggregate_heads (aggregate_type, aggregate_id)
        VALUES (agg_type, agg_id)
        ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
END
$$;

-- Slow path of an ordinary transaction while bit 2 is set: if a bulk
-- transaction is running, lock the aggregate's head row too. (Ordinary
-- writers of one aggregate are already serialised by its advisory lock, so
-- this row lock has one holder at a time and its xmax stays a plain xid.)
CREATE OR REPLACE FUNCTION events.outbox_order_check_bulk(agg_type text, agg_id uuid) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- The bulk gate (docs/architecture.md, "Advisory lock keys").
    IF pg_try_advisory_lock(1886322691, 1) THEN
        -- The gate is free: no bulk transaction runs, and one that starts
        -- later waits for our advisory lock before it takes this aggregate.
        PERFORM pg_advisory_unlock(1886322691, 1);  -- the bulk gate (docs/architecture.md, "Advisory lock keys")
        RETURN;
    END IF;
    PERFORM events.outbox_lock_head(agg_type, agg_id);
END
$$;

-- Make the current transaction a bulk transaction (see "Ordinary turns bulk"
-- above). Call it
-- first in a transaction that writes events for thousands of aggregates.
-- Returns nothing; errors only if PostgreSQL does.
CREATE OR REPLACE FUNCTION events.outbox_bulk_begin() RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('pg_outbox.bulk', true) = 'on' THEN
        RETURN;
    END IF;
    -- Gate first, then the bit: a refresh that sees the gate free cannot
    -- clear a bit set after it. Keys: the bulk gate and the hint writers
    -- (docs/architecture.md, "Advisory lock keys").
    PERFORM pg_advisory_xact_lock_shared(1886322691, 1);  -- bulk gate ("Advisory lock keys")
    PERFORM pg_advisory_lock(1886322691, 2);  -- hint writers ("Advisory lock keys")
    BEGIN
        PERFORM setval('events.outbox_hint', coalesce(pg_sequence_last_value('events.outbox_hint'), 3) | 2);
    EXCEPTION WHEN OTHERS THEN
        PERFORM pg_advisory_unlock(1886322691, 2);  -- hint writers ("Advisory lock keys")
        RAISE;
    END;
    PERFORM pg_advisory_unlock(1886322691, 2);  -- hint writers ("Advisory lock keys")
    PERFORM set_config('pg_outbox.bulk', 'on', true);
END
$$;

-- Bulk path: lock the aggregate's head row, after waiting for ordinary
-- transactions that hold its advisory lock.
CREATE OR REPLACE FUNCTION events.outbox_order_bulk(agg_type text, agg_id uuid, agg_key bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- Already ours (locked or created by this transaction): nothing to wait for.
    PERFORM 1 FROM events.outbox_aggregate_heads
    WHERE aggregate_type = agg_type AND aggregate_id = agg_id
      AND pg_current_xact_id()::xid IN (xmin, xmax);
    IF FOUND THEN
        RETURN;
    END IF;
    -- Wait for an ordinary transaction holding the aggregate, without
    -- keeping a lock of our own in the shared lock table.
    PERFORM pg_advisory_lock(agg_key);
    PERFORM pg_advisory_unlock(agg_key);
    PERFORM events.outbox_lock_head(agg_type, agg_id);
END
$$;

CREATE OR REPLACE FUNCTION events.outbox_order() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    agg_key bigint;
    hint bigint;
    seen integer;
BEGIN
    -- ids-after-xid: every path below takes the transaction's id
    -- (pg_current_xact_id) before it draws the event's id, so an id drawn
    -- before a relay's snapshot belongs to a transaction that snapshot
    -- counts as running or ended: the relay's fetch floor relies on it
    -- (src/store/fetch.rs, fetch_floor; docs/architecture.md, "The fetch
    -- floor"). The insert would take the id anyway; this takes it earlier.
    --
    -- Fast path, the common case under load, in one expression: PL/pgSQL
    -- prepares every expression it evaluates once per transaction, so with
    -- single-row transactions each expression costs its preparation on
    -- every insert. An ordinary (not bulk) transaction takes the
    -- aggregate's lock without waiting, reads the hint after the lock (see
    -- below) and, when it is 0 (no relay waits for a wake-up, no bulk
    -- transaction may run), draws the id. CASE evaluates its branches in
    -- order and only when reached (docs, "Conditional Expressions").
    -- Anything else leaves NEW.id NULL for the full path below. The key:
    -- the per-aggregate key (docs/architecture.md, "Advisory lock keys").
    NEW.id := CASE WHEN current_setting('pg_outbox.bulk', true) IS DISTINCT FROM 'on' THEN
                  CASE WHEN pg_try_advisory_xact_lock(uuid_hash_extended(NEW.aggregate_id,
                                hashtextextended(NEW.aggregate_type, 1886322691))) THEN
                      CASE WHEN pg_sequence_last_value('events.outbox_hint'::regclass) = 0 THEN
                          CASE WHEN pg_current_xact_id() IS NOT NULL THEN
                              nextval('events.outbox_id_seq'::regclass)
                          END
                      END
                  END
              END;
    -- NULL (full path) or one id in 64 (the bulk count) go on.
    IF NEW.id % 64 <> 0 THEN
        RETURN NEW;
    END IF;
    IF NEW.id IS NOT NULL THEN
        hint := 0;
    ELSIF current_setting('pg_outbox.bulk', true) IS DISTINCT FROM 'on' THEN
        -- The per-aggregate key (docs/architecture.md, "Advisory lock keys").
        agg_key := uuid_hash_extended(NEW.aggregate_id, hashtextextended(NEW.aggregate_type, 1886322691));
        -- Already ours if the fast path took it (a second take only counts).
        IF NOT pg_try_advisory_xact_lock(agg_key) THEN
            PERFORM pg_advisory_xact_lock(agg_key);
        END IF;
        -- Read after the lock: a bulk transaction that sets bit 2 later
        -- waits for our lock before it takes this aggregate.
        hint := coalesce(pg_sequence_last_value('events.outbox_hint'::regclass), 3);
        IF hint >= 2 THEN
            PERFORM events.outbox_order_check_bulk(NEW.aggregate_type, NEW.aggregate_id);
        END IF;
        NEW.id := CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval('events.outbox_id_seq'::regclass) END;
    ELSE
        -- The per-aggregate key (docs/architecture.md, "Advisory lock keys").
        agg_key := uuid_hash_extended(NEW.aggregate_id, hashtextextended(NEW.aggregate_type, 1886322691));
        PERFORM events.outbox_order_bulk(NEW.aggregate_type, NEW.aggregate_id, agg_key);
        hint := coalesce(pg_sequence_last_value('events.outbox_hint'::regclass), 3);
        NEW.id := CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval('events.outbox_id_seq'::regclass) END;
        seen := -1;  -- a bulk transaction has nothing left to count
    END IF;
    IF seen IS NULL AND NEW.id % 64 = 0 THEN
        -- Every event draws two ids (the default's and ours), so one id
        -- in 64 stands for about 32 events.
        seen := coalesce(nullif(current_setting('pg_outbox.events', true), ''), '0')::integer + 32;
        IF seen >= 1024 THEN
            PERFORM events.outbox_bulk_begin();
        ELSE
            PERFORM set_config('pg_outbox.events', seen::text, true);
        END IF;
    END IF;
    IF hint % 2 = 1 THEN
        PERFORM pg_notify('events.outbox', '');
    END IF;
    RETURN NEW;
END
$$;

-- The producer-locked mode's wake-up (see "Ordering modes" above): the
-- trigger outbox_wake calls it only while its WHEN condition finds bit 1
-- of the hint set, so while every relay is busy no function runs at all.
CREATE OR REPLACE FUNCTION events.outbox_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('events.outbox', '');
    RETURN NULL;
END
$$;

-- Switch the ordering mode (see "Ordering modes" above) and return the mode
-- that was installed before ('outbox-locked', 'producer-locked', or
-- 'none' when neither trigger was enabled): the result is the old mode,
-- not the new one. `mode` is 'outbox-locked' or 'producer-locked';
-- anything else raises an error naming it. When `mode` is already
-- installed it returns at once, taking no lock. Otherwise it takes SHARE
-- ROW EXCLUSIVE on events.outbox, waiting at most 5 s (lock_timeout) for
-- running producer transactions, so no transaction writes events under
-- both modes; on a timeout (SQLSTATE 55P03) nothing changed: run it again.
-- Only the table's owner can switch (it alters the table's triggers).
CREATE OR REPLACE FUNCTION events.outbox_set_ordering(mode text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    saved_lock_timeout text := current_setting('lock_timeout');
    before text;
BEGIN
    IF mode IS NULL OR mode NOT IN ('outbox-locked', 'producer-locked') THEN
        RAISE EXCEPTION 'unknown ordering mode %; expected outbox-locked or producer-locked', coalesce(quote_literal(mode), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Read twice: without a lock first (a switch to the installed mode
    -- must not wait for producers), then under the lock.
    FOR attempt IN 1..2 LOOP
        SELECT CASE
                   WHEN bool_or(tgname = 'outbox_order' AND tgenabled <> 'D') THEN 'outbox-locked'
                   WHEN bool_or(tgname = 'outbox_wake' AND tgenabled <> 'D') THEN 'producer-locked'
                   ELSE 'none'
               END
          INTO before
          FROM pg_trigger
         WHERE tgrelid = 'events.outbox'::regclass AND tgname IN ('outbox_order', 'outbox_wake');
        IF before = mode THEN
            RETURN before;
        END IF;
        EXIT WHEN attempt = 2;
        PERFORM set_config('lock_timeout', '5s', true);
        LOCK TABLE events.outbox IN SHARE ROW EXCLUSIVE MODE;
        PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    END LOOP;
    IF mode = 'outbox-locked' THEN
        ALTER TABLE events.outbox ENABLE TRIGGER outbox_order;
        ALTER TABLE events.outbox DISABLE TRIGGER outbox_wake;
    ELSE
        ALTER TABLE events.outbox ENABLE TRIGGER outbox_wake;
        ALTER TABLE events.outbox DISABLE TRIGGER outbox_order;
    END IF;
    RETURN before;
END
$$;

-- Create the two insert triggers when missing. A new outbox_wake starts
-- disabled: a database keeps the mode it has (outbox-locked when new or
-- upgraded from a version without modes), whatever this file's runs.
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_order' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        CREATE TRIGGER outbox_order
            BEFORE INSERT ON events.outbox
            FOR EACH ROW EXECUTE FUNCTION events.outbox_order();
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgname = 'outbox_wake' AND tgrelid = 'events.outbox'::regclass
    ) THEN
        -- WHEN: a NULL hint counts as 3 (notify), as in outbox_order().
        CREATE TRIGGER outbox_wake
            BEFORE INSERT ON events.outbox
            FOR EACH STATEMENT
            WHEN (coalesce(pg_sequence_last_value('events.outbox_hint'::regclass), 3) % 2 = 1)
            EXECUTE FUNCTION events.outbox_wake();
        ALTER TABLE events.outbox DISABLE TRIGGER outbox_wake;
    END IF;
END
$$;

COMMIT;

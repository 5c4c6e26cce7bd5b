-- pg-outbox migration 0016 (addition): subscriptions, more readers of one
-- outbox, each with its own progress, retries and dead letters
-- (docs/subscriptions.md).
--
-- The default subscription is the seeded flow, unchanged: `published_at`
-- and the retry columns on the row. Any other subscription keeps:
--
-- * a cursor (`cursor_id`): every event at or below it is settled for
--   the subscription (acknowledged), or has a row in
--   events.outbox_subscription_failures;
-- * the ids above the cursor already settled (`settled`, sorted): only
--   the few acknowledged ahead of an event still in flight;
-- * checkpoints (`checkpoint_ids`, `checkpoint_xids`): the highest id
--   visible to a read the writer makes before each acknowledgement, in a
--   transaction without an id of its own, and the next transaction id that
--   read saw (src/store/subscription.rs, CHECKPOINT). The
--   fetch floor's rule (docs/architecture.md, "The fetch floor"): the
--   insert trigger takes a transaction's id before it draws an event's id,
--   so once a snapshot's xmin has passed a checkpoint's transaction id, no
--   event at or below its id can still commit. The cursor never passes an
--   id no checkpoint covers, so an event whose transaction commits late is
--   never skipped;
-- * its failures, one row per failed event (not per event): retry count,
--   next retry, last error, or a dead letter (`next_retry_at` 'infinity');
--   and the events held back behind them (`retry_count` 0,
--   `next_retry_at` NULL until the event before them is settled), so the
--   cursor can pass a failing aggregate without holding up the others.
--
-- Acknowledging costs one update of the subscription's row per batch,
-- whatever the number of events. Producers pay nothing: the insert
-- trigger does not know subscriptions exist.
-- Idempotent: running this file twice is a no-op.
CREATE TABLE IF NOT EXISTS events.outbox_subscriptions (
    name            TEXT PRIMARY KEY
                    CONSTRAINT outbox_subscriptions_name_check
                    CHECK (name ~ '^[a-z0-9][a-z0-9_.-]{0,62}$' AND name <> 'default'),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    start_id        BIGINT NOT NULL,
    state           TEXT NOT NULL DEFAULT 'active'
                    CONSTRAINT outbox_subscriptions_state_check CHECK (state IN ('active', 'paused')),
    options         JSONB NOT NULL DEFAULT '{}',
    cursor_id       BIGINT NOT NULL,
    moved_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    settled         BIGINT[] NOT NULL DEFAULT '{}',
    checkpoint_ids  BIGINT[] NOT NULL DEFAULT '{}',
    checkpoint_xids BIGINT[] NOT NULL DEFAULT '{}'
);

-- No foreign key to events.outbox_subscriptions: its triggers would sit in
-- pg_trigger, which every fetch reads (src/store/fetch.rs, REWINDS,
-- UNBLOCKS); `subscription drop` deletes a subscription's rows itself.
CREATE TABLE IF NOT EXISTS events.outbox_subscription_failures (
    subscription   TEXT NOT NULL,
    id             BIGINT NOT NULL,
    aggregate_type TEXT NOT NULL,
    aggregate_id   UUID NOT NULL,
    retry_count    INTEGER NOT NULL DEFAULT 0
                   CONSTRAINT outbox_subscription_failures_retry_nonneg CHECK (retry_count >= 0),
    last_error     TEXT,
    next_retry_at  TIMESTAMPTZ,
    failed_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription, id)
);

-- Hold-back: the first failed (or held) event of an aggregate, one descent.
CREATE INDEX IF NOT EXISTS outbox_subscription_failures_aggregate_idx
    ON events.outbox_subscription_failures (subscription, aggregate_type, aggregate_id, id);
-- Due retries, by when: dead letters ('infinity') and held rows (NULL)
-- are outside the walk.
CREATE INDEX IF NOT EXISTS outbox_subscription_failures_due_idx
    ON events.outbox_subscription_failures (subscription, next_retry_at)
    WHERE next_retry_at IS NOT NULL;

-- Move subscription `p_name`'s cursor as far as its settled ids, its
-- failures and its checkpoints allow, and record the checkpoint (`p_top`,
-- `p_next`): the highest id and the next transaction id one snapshot saw,
-- read where ids follow transaction ids (NULL `p_top`: none). Called by
-- the functions below with the subscription's row locked.
CREATE OR REPLACE FUNCTION events.outbox_subscription_advance(p_name text, p_top bigint, p_next bigint)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    s events.outbox_subscriptions;
    v_xmin bigint := pg_snapshot_xmin(pg_current_snapshot())::text::int8;
    v_limit bigint;
    v_cursor bigint;
    v_ids bigint[] := '{}';
    v_xids bigint[] := '{}';
    v_any_failed boolean;
    v_running bigint;
    r record;
BEGIN
    SELECT * INTO s FROM events.outbox_subscriptions WHERE name = p_name;
    v_limit := s.cursor_id;
    -- A checkpoint is passed once no transaction that may have drawn an id
    -- at or below it still runs: this snapshot's xmin has passed its
    -- transaction id, or else every transaction this snapshot counts as
    -- running below it holds that id in another database (a transaction
    -- cannot write another database's outbox; one whose database cannot be
    -- told, ended since or prepared for two-phase commit, counts as
    -- running here). So a long write in another database of the cluster
    -- does not hold the cursor.
    IF EXISTS (SELECT 1 FROM unnest(s.checkpoint_xids) x WHERE x > v_xmin) THEN
        v_running := (SELECT min(x::text::int8) FROM pg_snapshot_xip(pg_current_snapshot()) x
                       WHERE NOT EXISTS (
                           SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                            WHERE l.locktype = 'transactionid' AND l.granted
                              AND l.transactionid = (((x::text::int8) % 4294967296)::text)::xid
                              AND a.datid IS DISTINCT FROM
                                  (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())));
    END IF;
    -- Checkpoints passed bound the cursor; the others stay.
    FOR r IN SELECT u.id, u.xid FROM unnest(s.checkpoint_ids, s.checkpoint_xids) u(id, xid) LOOP
        IF r.xid <= v_xmin OR v_running IS NULL OR r.xid <= v_running THEN
            v_limit := greatest(v_limit, r.id);
        ELSE
            v_ids := v_ids || r.id;
            v_xids := v_xids || r.xid;
        END IF;
    END LOOP;
    -- The new checkpoint (the newest replaces the newest kept when 32
    -- wait: it moves the cursor furthest once passed).
    IF p_top IS NOT NULL AND p_top > greatest(v_limit, v_ids[cardinality(v_ids)]) THEN
        IF cardinality(v_ids) >= 32 THEN
            v_ids[32] := p_top;
            v_xids[32] := p_next;
            v_ids := v_ids[1:32];
            v_xids := v_xids[1:32];
        ELSE
            v_ids := v_ids || p_top;
            v_xids := v_xids || p_next;
        END IF;
    END IF;
    -- The cursor moves to just below the first event above it, up to the
    -- limit, that is neither settled, nor failed (a failure row), nor held
    -- back behind a failed event of its aggregate; or to the limit. One
    -- walk of the primary key from the cursor, in one statement (the ids
    -- settled in a hashed set). The events it passes held back get a
    -- failure row of their own (held: `next_retry_at` NULL), so they are
    -- delivered once the event they wait for is settled. The failure rows
    -- above the cursor are read once per statement into a hashed set, and
    -- the hold-back probe is a scalar subquery in the order of
    -- `outbox_subscription_failures_aggregate_idx` (one descent per event
    -- walked): as NOT EXISTS, with statistics taken while the failures
    -- table was empty, the planner scanned every failure row for each
    -- event walked.
    v_cursor := s.cursor_id;
    IF v_limit > s.cursor_id THEN
        v_any_failed := EXISTS (SELECT 1 FROM events.outbox_subscription_failures f WHERE f.subscription = p_name);
        SELECT o.id - 1 INTO v_cursor FROM events.outbox o
         WHERE o.id > s.cursor_id AND o.id <= v_limit
           AND o.id NOT IN (SELECT unnest(s.settled))
           AND (NOT v_any_failed OR (
                o.id NOT IN (SELECT f.id FROM events.outbox_subscription_failures f
                              WHERE f.subscription = p_name AND f.id > s.cursor_id)
                AND (SELECT f.id FROM events.outbox_subscription_failures f
                      WHERE f.subscription = p_name AND f.aggregate_type = o.aggregate_type
                        AND f.aggregate_id = o.aggregate_id AND f.id < o.id ORDER BY f.id LIMIT 1) IS NULL))
         ORDER BY o.id LIMIT 1;
        v_cursor := coalesce(v_cursor, v_limit);
        IF v_any_failed AND v_cursor > s.cursor_id THEN
            INSERT INTO events.outbox_subscription_failures (subscription, id, aggregate_type, aggregate_id)
            SELECT p_name, o.id, o.aggregate_type, o.aggregate_id FROM events.outbox o
             WHERE o.id > s.cursor_id AND o.id <= v_cursor
               AND o.id NOT IN (SELECT unnest(s.settled))
               AND o.id NOT IN (SELECT f.id FROM events.outbox_subscription_failures f
                                 WHERE f.subscription = p_name AND f.id > s.cursor_id)
            ON CONFLICT DO NOTHING;
        END IF;
    END IF;
    UPDATE events.outbox_subscriptions
       SET cursor_id = v_cursor,
           moved_at = CASE WHEN v_cursor > s.cursor_id THEN now() ELSE moved_at END,
           settled = ARRAY(SELECT x FROM unnest(s.settled) x WHERE x > v_cursor ORDER BY x),
           checkpoint_ids = v_ids,
           checkpoint_xids = v_xids
     WHERE name = p_name;
END
$$;

-- The held events of each aggregate (`p_types[i]`, `p_ids[i]`) are due
-- now: an event they waited for was settled. The fetch lets through those
-- with no failed event (retry_count > 0) before them, in id order.
CREATE OR REPLACE FUNCTION events.outbox_subscription_release_held(p_name text, p_types text[], p_ids uuid[])
RETURNS void
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    UPDATE events.outbox_subscription_failures h SET next_retry_at = now()
      FROM (SELECT DISTINCT * FROM unnest(p_types, p_ids)) a(aggregate_type, aggregate_id)
     WHERE h.subscription = p_name AND h.aggregate_type = a.aggregate_type AND h.aggregate_id = a.aggregate_id
       AND h.next_retry_at IS NULL;
$$;

-- Acknowledge events `p_ids` for subscription `p_name`, when `p_current`
-- (the writer's leadership term is current: the caller's fence), and
-- record the checkpoint (`p_top`, `p_next`: see the advance above). Returns,
-- per event settled now (not before), seconds from `occurred_at` to now.
-- Fails with SQLSTATE P0002 when the subscription does not exist.
CREATE OR REPLACE FUNCTION events.outbox_subscription_ack(p_name text, p_ids bigint[], p_current boolean,
                                                          p_top bigint, p_next bigint)
RETURNS TABLE (lag float8)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    s events.outbox_subscriptions;
    v_deleted bigint[];
    v_types text[];
    v_aggs uuid[];
BEGIN
    IF NOT p_current THEN
        RETURN;
    END IF;
    SELECT * INTO s FROM events.outbox_subscriptions WHERE name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'subscription "%" does not exist', p_name USING ERRCODE = 'P0002';
    END IF;
    -- Retried (or held) events delivered: their failure rows go, and the
    -- next held event of their aggregate is due.
    WITH d AS (DELETE FROM events.outbox_subscription_failures f
                WHERE f.subscription = p_name AND f.id = ANY (p_ids)
                RETURNING f.id, f.aggregate_type, f.aggregate_id)
    SELECT array_agg(d.aggregate_type), array_agg(d.aggregate_id), array_agg(d.id)
      INTO v_types, v_aggs, v_deleted FROM d;
    IF v_types IS NOT NULL THEN
        PERFORM events.outbox_subscription_release_held(p_name, v_types, v_aggs);
    END IF;
    RETURN QUERY
        SELECT EXTRACT(EPOCH FROM (now() - o.occurred_at))::float8 FROM events.outbox o
         WHERE o.id = ANY (p_ids)
           AND (o.id = ANY (coalesce(v_deleted, '{}'))
                OR (o.id > s.cursor_id AND o.id NOT IN (SELECT unnest(s.settled))));
    -- Settled above the cursor, retried ones too (their failure rows are
    -- gone): the walk passes them.
    UPDATE events.outbox_subscriptions
       SET settled = ARRAY(SELECT DISTINCT x FROM unnest(s.settled || p_ids) x WHERE x > s.cursor_id ORDER BY x)
     WHERE name = p_name;
    PERFORM events.outbox_subscription_advance(p_name, p_top, p_next);
END
$$;

-- Record failures of events for subscription `p_name`, when `p_current`:
-- `p_details` is a jsonb object keyed by id (as text), each value
-- `{"e": error, "d": delay in seconds, "s": retry_count when fetched}`
-- (src/store/settle.rs, fail_details). A failure applies only while the
-- event's retry count is still the one fetched (0 without a failure row),
-- so a batch written twice counts once; the failure that brings the count
-- to `p_max` makes a dead letter (`next_retry_at` 'infinity'). Returns per
-- row changed `id`, `dead`, and `retry_in` (seconds, NULL for a dead letter).
CREATE OR REPLACE FUNCTION events.outbox_subscription_fail(p_name text, p_details jsonb, p_max integer,
                                                           p_current boolean, p_top bigint, p_next bigint)
RETURNS TABLE (id bigint, dead boolean, retry_in float8)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF NOT p_current THEN
        RETURN;
    END IF;
    PERFORM 1 FROM events.outbox_subscriptions s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'subscription "%" does not exist', p_name USING ERRCODE = 'P0002';
    END IF;
    RETURN QUERY
    WITH d AS (SELECT k::int8 AS id, v ->> 'e' AS e, (v ->> 'd')::float8 AS delay, (v ->> 's')::int4 AS seen
                 FROM jsonb_each(p_details) j(k, v)),
         w AS (INSERT INTO events.outbox_subscription_failures AS f
                   (subscription, id, aggregate_type, aggregate_id, retry_count, last_error, next_retry_at, failed_at)
               SELECT p_name, o.id, o.aggregate_type, o.aggregate_id, 1, d.e,
                      CASE WHEN 1 >= p_max THEN 'infinity'::timestamptz
                           ELSE now() + make_interval(secs => d.delay) END, now()
                 FROM d JOIN events.outbox o ON o.id = d.id
               ON CONFLICT (subscription, id) DO UPDATE
                  SET retry_count = f.retry_count + 1, last_error = excluded.last_error, failed_at = now(),
                      next_retry_at = CASE WHEN f.retry_count + 1 >= p_max THEN 'infinity'::timestamptz
                          ELSE now() + make_interval(secs => (p_details -> f.id::text ->> 'd')::float8) END
                WHERE f.retry_count = (p_details -> f.id::text ->> 's')::int4
               RETURNING f.id, f.retry_count, f.next_retry_at)
    SELECT w.id, w.retry_count >= p_max,
           CASE WHEN w.retry_count >= p_max THEN NULL
                ELSE EXTRACT(EPOCH FROM (w.next_retry_at - now()))::float8 END
      FROM w
      JOIN d ON d.id = w.id
     WHERE w.retry_count = d.seen + 1;
    PERFORM events.outbox_subscription_advance(p_name, p_top, p_next);
END
$$;

-- pg-outbox migration 0013 (addition): leadership terms (fencing tokens).
--
-- Each time a relay becomes the leader of the outbox (single mode), it
-- bumps `term` of scope 'outbox' in the statement that records it as the
-- holder, so terms only grow. Every acknowledgement and failure the relay
-- writes is conditional on its term still being the current one, in the
-- same statement (which takes a FOR SHARE lock on this row, so a bump waits
-- for writes in progress and a write after a bump changes nothing), and
-- every fetch reads the current term with its rows. `released` says the
-- holder stopped gracefully after its last hand-out, so the next leader
-- need not wait out the old one's hand-out lease (docs/architecture.md,
-- "Leadership terms").
-- A logged table (not UNLOGGED): a term must survive a crash and a
-- failover to a standby, or it could go backwards.
-- Idempotent: running this file twice is a no-op.
CREATE TABLE IF NOT EXISTS events.outbox_terms (
    scope          TEXT PRIMARY KEY,
    term           BIGINT NOT NULL CHECK (term > 0),
    holder_pid     INTEGER,
    holder_started TIMESTAMPTZ,
    taken_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    released       BOOLEAN NOT NULL DEFAULT false
);

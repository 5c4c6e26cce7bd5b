//! Retention's statements ([`crate::retention`]).

/// Delete one batch: up to $2 published rows older than $1 seconds with ids
/// above $3, lowest ids first; returns how many it deleted (`deleted`) and
/// the highest id it deleted (`last_id`). The next batch starts after that
/// id, so a run walks `outbox_pkey` once instead of passing, in every
/// batch, the index entries of the rows earlier batches deleted (they stay
/// until VACUUM) and the unpublished rows and dead letters at the low end
/// of the ids. A row skipped because another session had it locked is left
/// for the next run.
pub(crate) const DELETE_BATCH: &str = "WITH doomed AS MATERIALIZED ( \
       SELECT id FROM events.outbox \
       WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1) AND id > $3 \
       ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED), \
     gone AS (DELETE FROM events.outbox o USING doomed WHERE o.id = doomed.id RETURNING o.id) \
     SELECT count(*) AS deleted, max(id) AS last_id FROM gone";

/// How many rows a run with age $1 (seconds) would delete (`due`).
pub(crate) const COUNT_DUE: &str = "SELECT count(*) AS due FROM events.outbox \
     WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1)";

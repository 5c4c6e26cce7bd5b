//! The consumer's fetches: the ordered fetch (single and partitioned mode),
//! the competing mode's claim, and when the next retry is due.

use super::rows::{BYTES_BEFORE, EVENT_COLUMNS, PARTITION, SMALL_STORED_BYTES, TERM};

/// The outbox's current leadership term (`events.outbox_terms`, migration
/// 0013), NULL when no leader ever took one: a scalar subquery PostgreSQL
/// runs once per statement (an InitPlan), one primary-key lookup in a table
/// of one row.
const CURRENT_OUTBOX_TERM: &str = "(SELECT t.term FROM events.outbox_terms t WHERE t.scope = 'outbox')";

/// The current leadership terms of the partitions $5 (of $4), in the order
/// of $5, 0 for a partition without one (`events.outbox_terms`, scope
/// `partition:P/N`: [`super::leader::partition_scope`]): a subquery that
/// does not depend on the row, which PostgreSQL runs once per statement (an
/// InitPlan), one primary-key lookup per partition held.
const CURRENT_PARTITION_TERMS: &str = "(SELECT array_agg(coalesce(t.term, 0) ORDER BY u.i) \
     FROM unnest($5::int4[]) WITH ORDINALITY u(p, i) \
     LEFT JOIN events.outbox_terms t ON t.scope = 'partition:' || u.p || '/' || $4)";

/// The hold-back probe of a candidate row `o`: the id of the first earlier
/// event of its aggregate that has failed and is not published (waiting for
/// a retry, due again, or a dead letter), or NULL. An event is handed out
/// only when this is NULL, so per aggregate the failed event is always
/// delivered (or discarded) before anything after it.
///
/// Why it is robust: it is a correlated scalar subquery, so PostgreSQL runs
/// it once per candidate row and never turns it into a join, and it orders
/// by the expression `id + 0`, which only `outbox_holdback_idx` (aggregate,
/// `id + 0`; failed unpublished rows only) provides; with sorts discouraged
/// on pg-outbox's sessions ([`crate::connect::PLANNER_SETTINGS`]) the probe is one
/// descent of that index whatever the statistics say. (Written as
/// `NOT EXISTS`, the planner flattens it into an anti-join, and with
/// statistics from before a backlog formed it chose to walk the whole
/// backlog through `outbox_unpublished_idx` for every candidate.)
macro_rules! held_back_by {
    () => {
        "(SELECT b.id FROM events.outbox b \
           WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id \
             AND b.id + 0 < o.id AND b.published_at IS NULL AND b.next_retry_at IS NOT NULL \
           ORDER BY b.id + 0 LIMIT 1)"
    };
}

/// See [`held_back_by`]: the row is not held back.
const NOT_HELD_BACK: &str = concat!(held_back_by!(), " IS NULL");
/// The first failed unpublished row, if any (`1` or NULL): one read of the
/// first entry of `outbox_retry_due_idx`, by its key (the only plan without
/// a sort), which PostgreSQL runs once per statement (an InitPlan).
macro_rules! first_failed {
    () => {
        "(SELECT 1 FROM events.outbox f WHERE f.published_at IS NULL AND f.next_retry_at IS NOT NULL \
           ORDER BY f.next_retry_at LIMIT 1)"
    };
}

/// [`NOT_HELD_BACK`], skipped when no unpublished row has failed at all
/// (the usual case while a sink is healthy): the first test is
/// [`first_failed`], and `OR` evaluates its arguments in order, so then no
/// row pays for the probe.
const NOT_HELD_BACK_IF_ANY_FAILED: &str = concat!("(", first_failed!(), " IS NULL OR ", held_back_by!(), " IS NULL)");
/// Some unpublished row has failed ([`first_failed`]).
const ANY_FAILED: &str = concat!("(", first_failed!(), " IS NOT NULL)");
/// See [`held_back_by`]: the row is held back.
pub(super) const HELD_BACK: &str = concat!(held_back_by!(), " IS NOT NULL");

/// Row `o` is not in flight: its id is not among the ids handed out or
/// being written (`$1`, `bigint[]`, no NULLs). A `NOT IN` over a subquery
/// that does not depend on the row, which PostgreSQL runs once per
/// statement into a hash table (`EXPLAIN` shows `hashed SubPlan`), so each
/// row a fetch walks costs one hash probe whatever the number of ids in
/// flight. PostgreSQL plans it hashed when the subquery's rows, as
/// estimated, fit in `work_mem` (docs, "Subquery Expressions"; the
/// estimate for `unnest` of a parameter is 100 rows), and this is checked
/// in every statistics state and in the generic plan by the plan tests,
/// which count the rows each node handles.
///
/// Written as `o.id <> ALL($1)`, the test was a linear search of the array
/// for every row walked in the generic plan a prepared statement switches
/// to after five runs (PostgreSQL hashes `<> ALL` only over a constant
/// array, from version 15). Measured on PostgreSQL 15, generic plan, 2 000
/// ids in flight at the head of 20 000 fresh rows, a fetch of 500: 19.2 to
/// 20.0 ms of execution that way, 1.6 to 2.2 ms this way, 0.85 ms with
/// nothing in flight (`EXPLAIN ANALYZE`, five runs each).
const NOT_IN_FLIGHT: &str = "o.id NOT IN (SELECT unnest($1::bigint[]))";

/// Fetch the next due events. Two index walks, each in the order of an
/// index no other index can stand in for, each stopping after $2 rows it
/// returns (plus the held-back rows it passes, one probe each):
/// fresh rows from `outbox_fresh_order_idx`, by its key `id + 0` (a key of
/// plain id would let the planner walk `outbox_pkey` or
/// `outbox_unpublished_idx` instead, through every published or failed
/// row), starting past the fetch floor ([`FETCH_FLOOR`]), and failed rows
/// whose retry is due from `outbox_retry_due_idx`, by
/// `next_retry_at` (rows waiting for a retry and dead letters, at
/// 'infinity', are outside its range). Then the lowest $2 ids of both, cut
/// at the byte budget $3 ([`within_budget`]).
/// With sorts discouraged on pg-outbox's sessions
/// ([`crate::connect::PLANNER_SETTINGS`]), those walks are the only plans without a
/// sort, so the planner takes them whatever the statistics say (none, taken
/// before a backlog formed, or current); the final sort is over at most
/// twice $2 rows.
///
/// Due retries may come in any order: [`held_back_by`] lets through only
/// the earliest failed event of each aggregate, and nothing after it, so no
/// two events of one aggregate come from different branches.
///
/// $1 are ids already in flight, $2 the batch size, $3 the byte budget.
/// With `partitioned`, only aggregates whose hash partition (of $4) is in
/// $5, the partition is returned as column `part`
/// ([`super::row_partition`]) and the current term of that partition as
/// column `term` ([`CURRENT_PARTITION_TERMS`]); without it, every row
/// carries the outbox's current leadership term as column `term`
/// ([`CURRENT_OUTBOX_TERM`]). So the fetch itself tells the consumer
/// whether the terms it holds are still current. The fetch floor's six
/// parameters follow ($4..$9, or $6..$11 partitioned: [`fetch_floor`]), and
/// every row carries the floor used and the snapshot's figures
/// ([`FLOOR_COLUMNS`]).
/// `sizes` says how payloads are measured ([`PayloadSizes`]).
pub(crate) fn fetch_sql(partitioned: bool, sizes: PayloadSizes) -> String {
    let (part_filter, part_col, first_floor_param) = if partitioned {
        (
            format!("AND {PARTITION_EXPR} = ANY($5::int4[])"),
            format!(
                ", {PARTITION_EXPR} AS {PARTITION}, \
                 {CURRENT_PARTITION_TERMS}[array_position($5::int4[], {PARTITION_EXPR})] AS {TERM}"
            ),
            6,
        )
    } else {
        (String::new(), format!(", {CURRENT_OUTBOX_TERM} AS {TERM}"), 4)
    };
    let candidates = format!(
        "SELECT o.* FROM ( \
           (SELECT o.* FROM events.outbox o \
             WHERE o.published_at IS NULL AND o.next_retry_at IS NULL \
               AND o.id + 0 > (SELECT f.floor FROM fetch_floor f) \
               AND {NOT_IN_FLIGHT} {part_filter} AND {hb_fresh} \
             ORDER BY o.id + 0 LIMIT $2) \
           UNION ALL \
           (SELECT o.* FROM events.outbox o \
             WHERE o.published_at IS NULL AND o.next_retry_at IS NOT NULL AND o.next_retry_at <= now() \
               AND {NOT_IN_FLIGHT} {part_filter} AND {hb} \
             ORDER BY o.next_retry_at LIMIT $2) \
         ) o ORDER BY o.id LIMIT $2",
        hb_fresh = NOT_HELD_BACK_IF_ANY_FAILED,
        hb = NOT_HELD_BACK,
    );
    let floor = fetch_floor(first_floor_param, &part_filter);
    let cols = format!("{EVENT_COLUMNS}{part_col}, {FLOOR_COLUMNS}");
    format!("WITH fetch_floor AS MATERIALIZED ({floor}) {}", within_budget(&cols, &candidates, "$3", sizes))
}

/// The oldest transaction id still running when the fetch's snapshot was
/// taken (`pg_snapshot_xmin`), as `bigint` with its epoch: an `xid8` goes
/// to a number through its text (PostgreSQL has no cast from `xid8` to a
/// number: docs, "Transaction ID and Snapshot Information Functions").
const SNAPSHOT_XMIN: &str = "pg_snapshot_xmin(pg_current_snapshot())::text::int8";

/// The next transaction id to be assigned, as this statement first saw it
/// (at or after its snapshot was taken), as `bigint` with its epoch: the
/// snapshot's xmax (every id below it was assigned) plus `age()` of it,
/// which in a transaction without an id of its own counts from the next id
/// to be assigned (docs, "Control Data Functions" and the source of
/// `age(xid)`: `GetStableLatestTransactionId`). No id is assigned to the
/// fetch. A special xid makes `age` return 2^31 - 1: the floor then waits
/// (it never moves early).
pub(super) const NEXT_XID: &str = "(pg_snapshot_xmax(pg_current_snapshot())::text::int8 \
     + age(((pg_snapshot_xmax(pg_current_snapshot())::text::int8 % 4294967296)::text)::xid))";

/// Whether ids follow transaction ids on this outbox now: the insert
/// trigger `outbox_order` fires on ordinary sessions (`tgenabled` O or A: the outbox-locked mode) in a version
/// that takes the transaction's id before it draws the event's id (its
/// source has the mark `ids-after-xid`,
/// triggers/outbox_insert_order_and_notify.sql), and the id sequence hands
/// out one value at a time (`CACHE 1`, so ids rise in the order they are
/// drawn across sessions). Catalog lookups: a few buffers per fetch.
pub(super) const IDS_AFTER_XIDS: &str = "coalesce((SELECT t.tgenabled IN ('O', 'A') AND strpos(p.prosrc, 'ids-after-xid') > 0 \
       AND (SELECT s.seqcache FROM pg_sequence s WHERE s.seqrelid = 'events.outbox_id_seq'::regclass) = 1 \
     FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid \
     WHERE t.tgrelid = 'events.outbox'::regclass AND t.tgname = 'outbox_order'), false)";

/// The columns every row of an ordered fetch carries after its event
/// columns: `fetch_floor` (the floor the fresh branch started past),
/// `snapshot_xmin` and `next_xid` ([`SNAPSHOT_XMIN`], [`NEXT_XID`]),
/// `ids_after_xids` ([`IDS_AFTER_XIDS`]), `unblocks` ([`UNBLOCKS`]),
/// `rewinds` ([`REWINDS`]) and `held_passed` (the first held-back row the
/// floor passed in this fetch, or NULL: [`fetch_floor`]), each computed
/// once per fetch.
pub(crate) const FLOOR_COLUMNS: &str = "(SELECT f.floor FROM fetch_floor f) AS fetch_floor, \
     (SELECT f.snapshot_xmin FROM fetch_floor f) AS snapshot_xmin, \
     (SELECT f.next_xid FROM fetch_floor f) AS next_xid, \
     (SELECT f.ids_after_xids FROM fetch_floor f) AS ids_after_xids, \
     (SELECT f.unblocks FROM fetch_floor f) AS unblocks, \
     (SELECT f.rewinds FROM fetch_floor f) AS rewinds, \
     (SELECT f.held_passed FROM fetch_floor f) AS held_passed";

/// The fetch floor (docs/architecture.md, "The fetch floor"): the fresh
/// branch reads only ids above it, so it does not walk the rows drained
/// before (their index entries stay until VACUUM) nor the events in flight
/// below it. Parameters from `$n`: the floor the consumer holds (`bigint`,
/// `i64::MIN` for none), a checkpoint: the highest id a past fetch
/// returned (`$n+1`) and the next transaction id that fetch saw (`$n+2`),
/// the count of unblocks the consumer last saw (`$n+3`, `bigint`, NULL for
/// none: [`UNBLOCKS`]), the id just below the first held-back row a
/// past fetch's floor passed (`$n+4`, `bigint`, `i64::MAX` for none), and
/// the count of rewinds the consumer last saw (`$n+5`, `bigint`, NULL for
/// none: [`REWINDS`]).
///
/// The rule, exact: an id at or below the checkpoint's was drawn before
/// that fetch's snapshot (ids rise as drawn, `CACHE 1`), by a transaction
/// that had its transaction id already (the trigger takes it first), so
/// below the checkpoint's next id. Once a snapshot's xmin has reached that
/// id, every such transaction has ended: what it committed is visible, and
/// nothing more can appear at or below the checkpoint. Then the floor moves
/// up to the last id before the first fresh row there that is neither in
/// flight nor held back (a row released, or committed late), or to the
/// checkpoint when there is none. Otherwise it stays. The consumer lowers
/// it again when it releases an event, and resets it when its sessions or
/// partitions change, and as a safety net every minute (every sweep where
/// rewinds are not counted).
///
/// What makes a row fresh again outside the rule (an operator setting
/// `published_at` back to NULL, rows inserted where the insert trigger does
/// not fire) bumps the rewind count in its own transaction ([`REWINDS`]),
/// so a fetch that can see such a row also sees a count other than the
/// consumer's, and then reads from the first fresh row, in the same
/// snapshot.
///
/// The floor passes rows held back behind a failed event of their
/// aggregate, so a hot aggregate behind a dead letter is not walked by
/// every fetch; the fetch returns the first held row it passed
/// (`held_passed`), and the consumer keeps the lowest. What frees held rows
/// (the retry's acknowledgement, an operator discarding the dead letter)
/// bumps the unblock count in its own transaction ([`UNBLOCKS`]), so a
/// fetch that can see a held row freed also sees a count other than the
/// consumer's, and then reads from just below the first held row any floor
/// passed (or from the floor, if lower; the floor stays put when none was
/// passed), in the same snapshot: a freed row comes before any later event
/// of its aggregate. Where the count is not kept ([`NOT_COUNTED`]), the
/// floor stops at held rows.
fn fetch_floor(n: usize, part_filter: &str) -> String {
    let p = |k: usize| format!("${}::int8", n + k);
    let (floor, upto, next, seen, held_below, seen_rewinds) = (p(0), p(1), p(2), p(3), p(4), p(5));
    format!(
        "SELECT x.floor, x.snapshot_xmin, x.next_xid, x.ids_after_xids, x.unblocks, x.rewinds, \
                CASE WHEN x.stepped AND {ANY_FAILED} THEN \
                  (SELECT o.id FROM events.outbox o \
                    WHERE o.published_at IS NULL AND o.next_retry_at IS NULL \
                      AND o.id + 0 > {floor} AND o.id + 0 <= x.floor \
                      AND {NOT_IN_FLIGHT} {part_filter} AND {HELD_BACK} \
                    ORDER BY o.id + 0 LIMIT 1) END AS held_passed \
         FROM (SELECT CASE WHEN s.rewinds IS DISTINCT FROM {seen_rewinds} THEN {NO_FLOOR} \
                      WHEN s.unblocks IS DISTINCT FROM {seen} THEN least({floor}, {held_below}) \
                      WHEN s.stepped THEN \
                        coalesce((SELECT o.id - 1 FROM events.outbox o \
                                   WHERE o.published_at IS NULL AND o.next_retry_at IS NULL \
                                     AND o.id + 0 > {floor} AND o.id + 0 <= {upto} \
                                     AND {NOT_IN_FLIGHT} {part_filter} \
                                     AND (s.unblocks IS NOT DISTINCT FROM {NOT_COUNTED} OR {hb}) \
                                   ORDER BY o.id + 0 LIMIT 1), {upto}) \
                      ELSE {floor} END AS floor, \
                      s.stepped, s.snapshot_xmin, s.next_xid, s.ids_after_xids, s.unblocks, s.rewinds \
               FROM (SELECT s.*, (s.unblocks IS NOT DISTINCT FROM {seen} \
                                  AND s.rewinds IS NOT DISTINCT FROM {seen_rewinds} \
                                  AND s.snapshot_xmin >= {next} AND {upto} > {floor}) AS stepped \
                     FROM (SELECT {SNAPSHOT_XMIN} AS snapshot_xmin, {NEXT_XID} AS next_xid, \
                                  {IDS_AFTER_XIDS} AS ids_after_xids, {UNBLOCKS} AS unblocks, \
                                  {REWINDS} AS rewinds OFFSET 0) s \
                     OFFSET 0) s) x",
        hb = NOT_HELD_BACK_IF_ANY_FAILED,
    )
}

/// The count of unblocks of an outbox where they are not counted
/// ([`UNBLOCKS`]), and of rewinds ([`REWINDS`]).
const NOT_COUNTED: &str = "(-1)::int8";

/// The floor parameter for none: `i64::MIN`, the fetch reads from the
/// first fresh row.
const NO_FLOOR: &str = "(-9223372036854775808)::int8";

/// How many times a row has been made fresh (unpublished, not failed)
/// outside the fetch floor's rule, as the fetch's snapshot sees it: the
/// `term` of scope 'rewind' in `events.outbox_terms`, which the triggers of
/// triggers/outbox_rewind.sql bump in the transaction that makes a
/// published or failed row fresh, gives a fresh row another id, or inserts
/// under `session_replication_role = replica` (NULL while none ever did).
/// -1 ([`NOT_COUNTED`]) unless `outbox_rewind` fires on every session
/// (`tgenabled` 'A') and `outbox_rewind_insert` on replica sessions
/// (`tgenabled` 'R' or 'A'): then the consumer drops its floor every sweep
/// interval. A primary-key lookup and a catalog lookup per fetch.
const REWINDS: &str = "CASE WHEN (SELECT count(*) FROM pg_trigger t \
       WHERE t.tgrelid = 'events.outbox'::regclass \
         AND ((t.tgname = 'outbox_rewind' AND t.tgenabled = 'A') \
              OR (t.tgname = 'outbox_rewind_insert' AND t.tgenabled IN ('R', 'A')))) = 2 \
     THEN (SELECT t.term FROM events.outbox_terms t WHERE t.scope = 'rewind') ELSE -1 END";

/// How many times a failed event has stopped holding back the events of
/// its aggregate after it, as the fetch's snapshot sees it: the `term` of
/// scope 'unblock' in `events.outbox_terms`, which the triggers of
/// triggers/outbox_unblock.sql bump in the transaction that publishes,
/// deletes or otherwise clears a failed event (NULL while none ever did).
/// -1 ([`NOT_COUNTED`]) unless both triggers fire on every session
/// (`tgenabled` 'A': enabled ALWAYS, so also under
/// `session_replication_role = replica`): then the floor does not pass
/// held-back rows. A primary-key lookup and a catalog lookup per fetch.
const UNBLOCKS: &str = "CASE WHEN (SELECT count(*) FROM pg_trigger t \
       WHERE t.tgrelid = 'events.outbox'::regclass AND t.tgname IN ('outbox_unblock', 'outbox_unblock_delete') \
         AND t.tgenabled = 'A') = 2 \
     THEN (SELECT t.term FROM events.outbox_terms t WHERE t.scope = 'unblock') ELSE -1 END";

/// How a fetch measures a payload: in bytes as the client receives it (the
/// binary form of `jsonb`: a version byte and the JSON text), the measure
/// the consumer counts against its bound
/// ([`ConsumerBuilder::max_buffered_bytes`](crate::ConsumerBuilder::max_buffered_bytes)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PayloadSizes {
    /// PostgreSQL 14 and later: a payload stored in the row uncompressed
    /// and under 2 KB is measured by its stored size (`pg_column_size`,
    /// read from the value's header, no conversion: measured on the bench's
    /// 1.5 KB envelope, 1 635 bytes stored for 1 584 received, and 0.5 µs a
    /// row against 2.9 µs for the text's length); any other (compressed,
    /// or stored out of line in the TOAST table, as every payload over
    /// about 2 KB is) by the length of its text, which is exact.
    StoredWhenSmall,
    /// PostgreSQL 13, which lacks `pg_column_compression` to tell a
    /// compressed value: every payload by the length of its text.
    Text,
}

impl PayloadSizes {
    /// The sizes to use on a server of `server_version_num` `num`.
    pub(crate) fn for_server(num: i32) -> Self {
        if num >= 140_000 { PayloadSizes::StoredWhenSmall } else { PayloadSizes::Text }
    }

    /// The SQL expression of the size of row `o`'s payload.
    fn expr(self) -> String {
        match self {
            PayloadSizes::StoredWhenSmall => format!(
                "CASE WHEN pg_column_compression(o.payload) IS NULL AND pg_column_size(o.payload) < {SMALL_STORED_BYTES} \
                 THEN pg_column_size(o.payload) ELSE octet_length(o.payload::text) + 1 END"
            ),
            PayloadSizes::Text => "(octet_length(o.payload::text) + 1)".to_string(),
        }
    }
}

/// `cols` of the rows of `candidates` (a query of candidate rows, each with
/// an `id` and a `payload`), in id order, as long as the payloads of the
/// rows before each add up to less than `budget` bytes: the first row
/// always, so a payload bigger than the budget still moves. The rows
/// returned add up to less than the budget plus the last one's payload.
/// Each row also has that sum of the rows before it, as column
/// [`BYTES_BEFORE`] (`bigint`, NULL for the first), from which the consumer
/// tells a fetch the budget cut from one that took every candidate
/// ([`super::fetch_was_cut`]).
///
/// How the server stops early: the running sum of the rows *before* each
/// (a frame that ends one row back) is computed as rows are read, and the
/// count of rows at or past the budget is a window count over it, which
/// PostgreSQL 15 and later turn into a run condition that ends the scan at
/// the first row past the budget (`EXPLAIN` shows `Run Condition`). So
/// payloads past the budget are neither measured nor sent, and the
/// candidates' payloads stay unread TOAST pointers until then (a sort keeps
/// them as pointers). Older servers evaluate the same filter row by row:
/// the same rows, with every candidate measured. The candidate rows and
/// their plan are those of `candidates` alone.
pub(super) fn within_budget(cols: &str, candidates: &str, budget: &str, sizes: PayloadSizes) -> String {
    format!(
        "SELECT {cols}, o.bytes_before AS {BYTES_BEFORE} FROM ( \
           SELECT o.*, count(*) FILTER (WHERE o.bytes_before >= {budget}) \
                         OVER (ORDER BY o.id ROWS UNBOUNDED PRECEDING) AS past_budget FROM ( \
             SELECT o.*, sum({size}) OVER (ORDER BY o.id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) \
                           AS bytes_before \
             FROM ({candidates}) o \
           ) o \
         ) o WHERE o.past_budget < 1 ORDER BY o.id",
        size = sizes.expr()
    )
}

/// The SQL text of the consumer's fetch in single mode, for `EXPLAIN`:
/// `$1` the ids in flight (`bigint[]`), `$2` the batch size in rows
/// (`bigint`), `$3` the byte budget (`bigint`), `$4` the fetch floor
/// (`bigint`: only ids above it are read as fresh rows; `i64::MIN` for
/// none), `$5` and `$6` the floor's checkpoint (`bigint`: an id a past
/// fetch returned and the next transaction id it saw; pass `$4` and
/// `i64::MAX` to keep the floor where it is), `$7` the count of unblocks
/// last seen (`bigint`: the `term` of scope 'unblock' in
/// `events.outbox_terms`, NULL for none, -1 where it is not kept), `$8`
/// the id below the first held-back row a floor passed (`bigint`,
/// `i64::MAX` for none): when the count is not the current one, the fetch
/// reads from the lower of `$4` and `$8`; and `$9` the count of rewinds
/// last seen (`bigint`: the `term` of scope 'rewind', NULL for none, -1
/// where it is not kept): when it is not the current one, the fetch reads
/// from the first fresh row, whatever `$4`. Exposed so its plan can be
/// checked against real data: each of its two branches must be an index
/// range scan (`outbox_fresh_order_idx` for fresh rows,
/// `outbox_retry_due_idx` for due retries) that skips dead letters and rows
/// waiting for a retry instead of walking them. `server_version_num` is
/// the server's (e.g. 180004): the text is the one the consumer prepares on
/// that server (on PostgreSQL 13, which lacks `pg_column_compression`, it
/// measures payloads by the length of their text).
#[cfg(feature = "kit")]
pub fn fetch_query(server_version_num: i32) -> String {
    fetch_sql(false, PayloadSizes::for_server(server_version_num))
}

/// The hash partition of a row's aggregate, 0..$3 (partitioned mode).
const PARTITION_EXPR: &str =
    "((hashtextextended(o.aggregate_type || '/' || o.aggregate_id::text, 0) & 2147483647) % $4)::int4";

/// A named subscription's current leadership term (scope
/// `subscription:NAME`, $4 the name): an InitPlan, one primary-key lookup.
const CURRENT_SUBSCRIPTION_TERM: &str =
    "(SELECT t.term FROM events.outbox_terms t WHERE t.scope = 'subscription:' || $4::text)";

/// The first failure row of subscription $4 for the aggregate of row `o`
/// at or before its id (with `"<="`; a failed event, a dead letter, or one
/// held back behind them): one descent of
/// `outbox_subscription_failures_aggregate_idx`.
macro_rules! subscription_held_by {
    ($op:literal) => {
        concat!(
            "(SELECT b.id FROM events.outbox_subscription_failures b \
               WHERE b.subscription = $4::text AND b.aggregate_type = o.aggregate_type \
                 AND b.aggregate_id = o.aggregate_id AND b.id ",
            $op,
            " o.id ORDER BY b.id LIMIT 1)"
        )
    };
}

/// A named subscription's fetch (docs/subscriptions.md): the due events
/// of subscription $4 (`text`) in id order, with $1 the ids in flight, $2
/// the batch size and $3 the byte budget, as [`fetch_sql`]. Two index
/// walks, each stopping after $2 rows: fresh events above the
/// subscription's cursor by the primary key, skipping the ids settled
/// above it and any event whose aggregate has a failure row at or before
/// it (its own included: a failed event is not fresh); and failure rows
/// whose retry is due, by `outbox_subscription_failures_due_idx` (dead
/// letters, at 'infinity', and held events, NULL, are outside its range),
/// each let through only when its aggregate has no failure row before it
/// (so one event per aggregate, the earliest: due rows of one aggregate may
/// share a `next_retry_at`, and a walk cut at $2 rows would otherwise pick
/// a later one alone). Behind each such row, the failure rows of its
/// aggregate that follow it and are released (held events made due
/// together when the event they waited for was settled: `retry_count` 0,
/// due, not in flight), in id order up to the first that is not, at most
/// [`SUBSCRIPTION_FOLLOWERS`]: the final cut by id keeps each aggregate's
/// rows a prefix. Rows of the failure rows say so in column
/// `failure_row`: settling one wakes the next fetch.
/// Nothing while the subscription is paused, or when it does not exist.
/// `retry_count` and `last_error` are the subscription's (its failure
/// row's), and every row carries the subscription's current term as
/// `term`.
///
/// With `partitioned`, only aggregates whose hash partition (of $5, `int8`)
/// is in $6 (`int4[]`), each row carrying its partition as column `part`
/// and the current term of that partition (scope
/// `subscription:NAME:partition:P/N`) as `term`; and fresh events only up
/// to [`SUBSCRIPTION_WINDOW`] ids above the cursor, which the consumers of
/// all partitions share.
pub(crate) fn subscription_fetch_sql(partitioned: bool, sizes: PayloadSizes) -> String {
    let fresh_cols = "o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.occurred_at, \
         0 AS retry_count, NULL::text AS last_error, false AS failure_row";
    let failed_cols = "o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.occurred_at, \
         f.retry_count, f.last_error, true AS failure_row";
    let (part_filter, window, term_cols) = if partitioned {
        (
            format!("AND {SUBSCRIPTION_PARTITION_EXPR} = ANY($6::int4[])"),
            format!("AND o.id <= (SELECT s.cursor_id FROM sub s) + {SUBSCRIPTION_WINDOW}"),
            format!(
                "{SUBSCRIPTION_PARTITION_EXPR} AS {PARTITION}, \
                 {CURRENT_SUBSCRIPTION_PARTITION_TERMS}[array_position($6::int4[], {SUBSCRIPTION_PARTITION_EXPR})] \
                 AS {TERM}"
            ),
        )
    } else {
        (String::new(), String::new(), format!("{CURRENT_SUBSCRIPTION_TERM} AS {TERM}"))
    };
    let heads = format!(
        "SELECT {failed_cols} FROM events.outbox_subscription_failures f \
           JOIN events.outbox o ON o.id = f.id \
          WHERE f.subscription = $4::text AND f.next_retry_at <= now() AND (SELECT s.active FROM sub s) \
            AND f.id NOT IN (SELECT unnest($1::bigint[])) {part_filter} \
            AND (SELECT b.id FROM events.outbox_subscription_failures b \
                  WHERE b.subscription = $4::text AND b.aggregate_type = f.aggregate_type \
                    AND b.aggregate_id = f.aggregate_id AND b.id < f.id ORDER BY b.id LIMIT 1) IS NULL \
          ORDER BY f.next_retry_at LIMIT $2",
    );
    let candidates = format!(
        "SELECT o.* FROM ( \
           (SELECT {fresh_cols} FROM events.outbox o \
             WHERE o.id > (SELECT s.cursor_id FROM sub s) AND (SELECT s.active FROM sub s) {window} \
               AND o.id NOT IN (SELECT unnest(s.settled) FROM sub s) AND {NOT_IN_FLIGHT} {part_filter} \
               AND (NOT (SELECT s.any_failed FROM sub s) OR {held} IS NULL) \
             ORDER BY o.id LIMIT $2) \
           UNION ALL \
           (SELECT * FROM heads) \
           UNION ALL \
           (SELECT {failed_cols} FROM ({released}) f JOIN events.outbox o ON o.id = f.id) \
         ) o ORDER BY o.id LIMIT $2",
        held = subscription_held_by!("<="),
        released = released_behind_heads(),
    );
    let cols = format!("{EVENT_COLUMNS}, failure_row, {term_cols}");
    format!(
        "WITH sub AS MATERIALIZED (SELECT s.cursor_id, s.settled, s.state = 'active' AS active, \
           EXISTS (SELECT 1 FROM events.outbox_subscription_failures f WHERE f.subscription = s.name) AS any_failed \
           FROM events.outbox_subscriptions s WHERE s.name = $4::text), \
         heads AS MATERIALIZED ({heads}) {}",
        within_budget(&cols, &candidates, "$3", sizes)
    )
}

/// Behind each of the `heads` of a named subscription's fetch (failure
/// rows due, the first of their aggregate), the failure rows of its
/// aggregate that follow it and are released (`retry_count` 0, due, not in
/// flight: $1), in id order up to the first that is not, at most
/// [`SUBSCRIPTION_FOLLOWERS`] each and $2 in all, lowest ids first: `id`,
/// `retry_count`, `last_error`.
fn released_behind_heads() -> String {
    format!(
        "SELECT f.id, f.retry_count, f.last_error FROM heads h \
         CROSS JOIN LATERAL ( \
           SELECT f.*, bool_and(f.released) OVER (ORDER BY f.id) AS run FROM ( \
             SELECT b.id, b.retry_count, b.last_error, \
                    b.retry_count = 0 AND b.next_retry_at <= now() AND b.id <> ALL ($1::bigint[]) AS released \
               FROM events.outbox_subscription_failures b \
              WHERE b.subscription = $4::text AND b.aggregate_type = h.aggregate_type \
                AND b.aggregate_id = h.aggregate_id AND b.id > h.id \
              ORDER BY b.id LIMIT {SUBSCRIPTION_FOLLOWERS}) f) f \
         WHERE f.run ORDER BY f.id LIMIT $2"
    )
}

/// How many released events of an aggregate a named subscription's fetch
/// hands out at most behind the failure row that leads it (the events
/// held back behind a failed one, due together once it is settled): 64 a
/// fetch, so a fetch walks at most 64 entries of
/// `outbox_subscription_failures_aggregate_idx` per aggregate it retries.
/// Without them, each aggregate's held events came one per fetch and
/// acknowledgement.
const SUBSCRIPTION_FOLLOWERS: i64 = 64;

/// How far above a partitioned subscription's cursor its consumers read
/// fresh events at most: 20 000 ids. The consumers of all its partitions
/// share one cursor, and the ids settled above it are kept in its row
/// (`settled`), rewritten by every acknowledgement; a partition whose
/// events stay in flight (its consumer frozen until it is replaced, or a
/// slow sink) holds the cursor, and without a bound the others would pile
/// their settled ids above it. So that list stays under 20 000 ids
/// (160 KB), and the other partitions wait once they are that far ahead.
pub(crate) const SUBSCRIPTION_WINDOW: i64 = 20_000;

/// The hash partition of a row's aggregate, 0..$5 (a partitioned named
/// subscription's fetch): [`PARTITION_EXPR`]'s hash.
const SUBSCRIPTION_PARTITION_EXPR: &str =
    "((hashtextextended(o.aggregate_type || '/' || o.aggregate_id::text, 0) & 2147483647) % $5)::int4";

/// The current terms of partitions $6 (`int4[]`) of $5 of subscription $4,
/// in $6's order (0 for one never taken), scope
/// `subscription:NAME:partition:P/N`.
const CURRENT_SUBSCRIPTION_PARTITION_TERMS: &str = "(SELECT array_agg(coalesce(t.term, 0) ORDER BY u.i) \
     FROM unnest($6::int4[]) WITH ORDINALITY u(p, i) \
     LEFT JOIN events.outbox_terms t ON t.scope = 'subscription:' || $4::text || ':partition:' || u.p || '/' || $5)";

/// Competing mode (docs/schema.md, "Publisher and poller flow"): claim
/// due rows with `FOR UPDATE SKIP LOCKED` inside a transaction held until
/// the batch is settled. No per-aggregate
/// order, no hold-back. Due retries first (a walk of `outbox_retry_due_idx`
/// by `next_retry_at`), then fresh rows for the rest of the $1 (a walk of
/// `outbox_fresh_order_idx` by `id + 0`): as in [`fetch_sql`], each is the
/// only plan without a sort, so a head of dead letters or rows waiting for a
/// retry is never walked, whatever the statistics. Each claim is a plain
/// SELECT with LIMIT, so together they never lock more than $1 rows
/// (unlike `UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP
/// LOCKED)`, whose subquery the planner may run more than once).
///
/// The claimed rows are returned in id order up to the byte budget $2
/// ([`within_budget`]; `FOR UPDATE` cannot share a level with a window
/// function, so the cut comes after the claim): rows claimed past the
/// budget stay locked, unreturned, until the claim transaction ends, then
/// another fetch takes them.
pub(crate) fn competing_fetch_sql(sizes: PayloadSizes) -> String {
    let claim = concat!(
        "WITH r AS ( \
           SELECT ",
        event_columns!(),
        " FROM events.outbox \
           WHERE published_at IS NULL AND next_retry_at IS NOT NULL AND next_retry_at <= now() \
           ORDER BY next_retry_at LIMIT $1 FOR UPDATE SKIP LOCKED), \
         f AS ( \
           SELECT ",
        event_columns!(),
        " FROM events.outbox \
           WHERE published_at IS NULL AND next_retry_at IS NULL \
           ORDER BY id + 0 LIMIT $1 - (SELECT count(*) FROM r) FOR UPDATE SKIP LOCKED) "
    );
    let cut = within_budget(EVENT_COLUMNS, "SELECT * FROM r UNION ALL SELECT * FROM f", "$2", sizes);
    format!("{claim}{cut}")
}

/// Competing mode: open and close the claim transaction.
pub(crate) const BEGIN: &str = "BEGIN";
/// See [`BEGIN`].
pub(crate) const COMMIT: &str = "COMMIT";

/// Seconds until the earliest pending retry is due (`retry_in`), or NULL if
/// none waits: the first entry of `outbox_retry_due_idx` after now()
/// (ordered by its key, the only plan without a sort; see [`fetch_sql`]).
/// Always one row.
pub(crate) const NEXT_RETRY_IN: &str = "SELECT (SELECT EXTRACT(EPOCH FROM (next_retry_at - now()))::float8 \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NOT NULL \
       AND next_retry_at > now() AND next_retry_at < 'infinity' \
     ORDER BY next_retry_at LIMIT 1) AS retry_in";

/// [`NEXT_RETRY_IN`] for subscription $1 (`text`): the first entry of
/// `outbox_subscription_failures_due_idx` after now().
pub(crate) const SUBSCRIPTION_NEXT_RETRY_IN: &str = "SELECT (SELECT EXTRACT(EPOCH FROM (next_retry_at - now()))::float8 \
     FROM events.outbox_subscription_failures WHERE subscription = $1::text AND next_retry_at IS NOT NULL \
       AND next_retry_at > now() AND next_retry_at < 'infinity' \
     ORDER BY next_retry_at LIMIT 1) AS retry_in";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_column_follows_the_event_columns() {
        assert_eq!(EVENT_COLUMNS.split(", ").count(), 8, "{EVENT_COLUMNS}");
        let sql = fetch_sql(true, PayloadSizes::StoredWhenSmall);
        let select = sql.split_once(") SELECT ").map(|(_, s)| s).unwrap_or_default();
        assert!(select.starts_with(&format!("{EVENT_COLUMNS}, ")), "{sql}");
        assert!(sql.contains(&format!("AS {TERM}, {FLOOR_COLUMNS}, o.bytes_before AS {BYTES_BEFORE} FROM")), "{sql}");
        assert!(sql.contains(&format!("AS {PARTITION}, ")), "{sql}");
        assert_eq!(
            crate::store::leader::partition_scope(3, 16),
            "partition:3/16",
            "the fetch's terms read the scopes the consumer takes"
        );
        assert!(!fetch_sql(false, PayloadSizes::StoredWhenSmall).contains(PARTITION_EXPR));
    }

    #[test]
    fn the_competing_claim_selects_the_event_columns_in_both_branches() {
        let sql = competing_fetch_sql(PayloadSizes::StoredWhenSmall);
        assert_eq!(sql.matches(EVENT_COLUMNS).count(), 3, "{sql}");
    }

    #[test]
    fn payloads_are_measured_by_their_text_before_postgresql_14() {
        assert_eq!(PayloadSizes::for_server(130_016), PayloadSizes::Text);
        assert_eq!(PayloadSizes::for_server(140_000), PayloadSizes::StoredWhenSmall);
        assert!(!fetch_sql(false, PayloadSizes::Text).contains("pg_column_compression"));
        assert!(competing_fetch_sql(PayloadSizes::StoredWhenSmall).contains("pg_column_compression"));
    }
}

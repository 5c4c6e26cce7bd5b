//! The consumer's fetches: the ordered fetch (single and partitioned mode),
//! the competing mode's claim, and when the next retry is due.

use super::rows::{BYTES_BEFORE, EVENT_COLUMNS, PARTITION, TERM};

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
/// on pg-outbox's sessions ([`crate::store::PLANNER_SETTINGS`]) the probe is one
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
/// [`NOT_HELD_BACK`], skipped when no unpublished row has failed at all
/// (the usual case while a sink is healthy): the first test is one read of
/// the first entry of `outbox_retry_due_idx`, by its key (the only plan
/// without a sort), which PostgreSQL runs once per statement (an InitPlan),
/// and `OR` evaluates its arguments in order, so then no row pays for the
/// probe.
const NOT_HELD_BACK_IF_ANY_FAILED: &str = concat!(
    "((SELECT 1 FROM events.outbox f WHERE f.published_at IS NULL AND f.next_retry_at IS NOT NULL \
       ORDER BY f.next_retry_at LIMIT 1) IS NULL OR ",
    held_back_by!(),
    " IS NULL)"
);
/// See [`held_back_by`]: the row is held back.
pub(super) const HELD_BACK: &str = concat!(held_back_by!(), " IS NOT NULL");

/// Fetch the next due events. Two index walks, each in the order of an
/// index no other index can stand in for, each stopping after $2 rows it
/// returns (plus the held-back rows it passes, one probe each):
/// fresh rows from `outbox_fresh_order_idx`, by its key `id + 0` (a key of
/// plain id would let the planner walk `outbox_pkey` or
/// `outbox_unpublished_idx` instead, through every published or failed
/// row), and failed rows whose retry is due from `outbox_retry_due_idx`, by
/// `next_retry_at` (rows waiting for a retry and dead letters, at
/// 'infinity', are outside its range). Then the lowest $2 ids of both, cut
/// at the byte budget $3 ([`within_budget`]).
/// With sorts discouraged on pg-outbox's sessions
/// ([`crate::store::PLANNER_SETTINGS`]), those walks are the only plans without a
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
/// whether the terms it holds are still current.
/// `sizes` says how payloads are measured ([`PayloadSizes`]).
///
/// Every fetch starts from the lowest id: no cursor. A cursor (`id > last`)
/// would skip rows that were held back when it passed them and became
/// eligible since (their blocker was delivered or discarded), and rows of
/// another aggregate that committed after a higher id.
pub(crate) fn fetch_sql(partitioned: bool, sizes: PayloadSizes) -> String {
    let (part_filter, part_col) = if partitioned {
        (
            format!("AND {PARTITION_EXPR} = ANY($5::int4[])"),
            format!(
                ", {PARTITION_EXPR} AS {PARTITION}, \
                 {CURRENT_PARTITION_TERMS}[array_position($5::int4[], {PARTITION_EXPR})] AS {TERM}"
            ),
        )
    } else {
        (String::new(), format!(", {CURRENT_OUTBOX_TERM} AS {TERM}"))
    };
    let candidates = format!(
        "SELECT o.* FROM ( \
           (SELECT o.* FROM events.outbox o \
             WHERE o.published_at IS NULL AND o.next_retry_at IS NULL \
               AND o.id <> ALL($1::bigint[]) {part_filter} AND {hb_fresh} \
             ORDER BY o.id + 0 LIMIT $2) \
           UNION ALL \
           (SELECT o.* FROM events.outbox o \
             WHERE o.published_at IS NULL AND o.next_retry_at IS NOT NULL AND o.next_retry_at <= now() \
               AND o.id <> ALL($1::bigint[]) {part_filter} AND {hb} \
             ORDER BY o.next_retry_at LIMIT $2) \
         ) o ORDER BY o.id LIMIT $2",
        hb_fresh = NOT_HELD_BACK_IF_ANY_FAILED,
        hb = NOT_HELD_BACK
    );
    within_budget(&format!("{EVENT_COLUMNS}{part_col}"), &candidates, "$3", sizes)
}

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

/// Payloads stored in the row, uncompressed, under this many bytes are
/// measured by their stored size ([`PayloadSizes::StoredWhenSmall`]).
pub(crate) const SMALL_STORED_BYTES: usize = 2048;

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
fn within_budget(cols: &str, candidates: &str, budget: &str, sizes: PayloadSizes) -> String {
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
/// (`bigint`), `$3` the byte budget (`bigint`). Exposed so its plan can be
/// checked against real data: each of its two branches must be an index
/// range scan (`outbox_fresh_order_idx` for fresh rows,
/// `outbox_retry_due_idx` for due retries) that skips dead letters and rows
/// waiting for a retry instead of walking them. `server_version_num` is
/// the server's (e.g. 180004): the text is the one the consumer prepares on
/// that server (on PostgreSQL 13, which lacks `pg_column_compression`, it
/// measures payloads by the length of their text).
pub fn fetch_query(server_version_num: i32) -> String {
    fetch_sql(false, PayloadSizes::for_server(server_version_num))
}

/// The hash partition of a row's aggregate, 0..$3 (partitioned mode).
const PARTITION_EXPR: &str =
    "((hashtextextended(o.aggregate_type || '/' || o.aggregate_id::text, 0) & 2147483647) % $4)::int4";

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_column_follows_the_event_columns() {
        assert_eq!(EVENT_COLUMNS.split(", ").count(), 8, "{EVENT_COLUMNS}");
        let sql = fetch_sql(true, PayloadSizes::StoredWhenSmall);
        assert!(sql.starts_with(&format!("SELECT {EVENT_COLUMNS}, ")), "{sql}");
        assert!(sql.contains(&format!("AS {TERM}, o.bytes_before AS {BYTES_BEFORE} FROM")), "{sql}");
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

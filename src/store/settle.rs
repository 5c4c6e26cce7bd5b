//! Settling delivered events: acknowledgements and failures, batched, each
//! fenced by the writer's terms.

use std::collections::BTreeMap;

use crate::term::Term;

/// The fence of a write: `current` is true when every leadership term the
/// writer names in `$T` (a `jsonb` object, scope to term: [`Fence`]; NULL
/// for a consumer that holds no term, competing mode) is still its scope's
/// current term in `events.outbox_terms` (migration 0013). The rows are read
/// `FOR SHARE`: a consumer taking the next term of a scope
/// ([`super::leader::TAKE_TERM`]) waits for the write to end, and a write
/// that comes after the bump reads the new term and finds it no longer
/// matches (PostgreSQL docs, "The Locking Clause": a locked row is re-read
/// in its latest version and the condition checked again). A macro so that
/// `concat!` builds the statements with the term's parameter number.
macro_rules! fence {
    ($t:literal) => {
        concat!(
            "fence AS MATERIALIZED (SELECT ",
            $t,
            "::jsonb IS NULL OR (SELECT count(*) FROM (SELECT 1 FROM events.outbox_terms t \
               WHERE t.scope = ANY (ARRAY(SELECT jsonb_object_keys(",
            $t,
            "::jsonb))) AND t.term = (",
            $t,
            "::jsonb ->> t.scope)::bigint FOR SHARE) f) = (SELECT count(*) FROM jsonb_object_keys(",
            $t,
            "::jsonb)) AS current)"
        )
    };
}

/// The leadership terms a write is conditional on ([`fence!`]): scope
/// (`'outbox'` in single mode, one per partition in partitioned mode,
/// [`super::leader::partition_scope`]) to term. Every one must still be
/// current for the write to change anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Fence(BTreeMap<String, i64>);

impl Fence {
    /// A fence of the one scope `scope` at `term`.
    pub(crate) fn of(scope: &str, term: Term) -> Self {
        Fence(BTreeMap::from([(scope.to_string(), term.to_db())]))
    }

    /// Add scope `scope` at `term` (a scope named twice keeps the greater).
    /// `None`, no term known for it, fences the write off: no scope ever
    /// holds term 0.
    pub(crate) fn insert(&mut self, scope: String, term: Option<Term>) {
        let term = term.map_or(0, Term::to_db);
        let t = self.0.entry(scope).or_insert(term);
        *t = (*t).max(term);
    }

    /// No scope at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The greatest term named (for logs).
    pub(crate) fn max_term(&self) -> Option<Term> {
        self.0.values().copied().max().and_then(Term::from_db)
    }

    /// The statements' `$T`.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Object(self.0.iter().map(|(k, v)| (k.clone(), serde_json::Value::from(*v))).collect())
    }
}

/// A select-list item that sets `synchronous_commit` for the statement's
/// transaction to the text `$p`, or, where `$p` is NULL, to what the
/// session has (`set_config(..., true)`, as `SET LOCAL`: PostgreSQL docs,
/// "Asynchronous Commit"). The statements that carry it return at least
/// one row, so it is evaluated before their transaction commits.
macro_rules! commit_as {
    ($p:literal) => {
        concat!(
            "set_config('synchronous_commit', coalesce(",
            $p,
            "::text, current_setting('synchronous_commit')), true) AS commit_as"
        )
    };
}
pub(crate) use commit_as;

/// How a named subscription's settlements commit: its acknowledgements,
/// failures and dead letters ([`SUBSCRIPTION_ACK`], [`SUBSCRIPTION_FAIL`],
/// an idle cursor's move, and competing mode's claim transactions, which
/// hold them). Nothing
/// else: leadership terms and the default subscription's `published_at`
/// always commit as the session says (`on` by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum AckCommit {
    /// `synchronous_commit = off` for the settlement's transaction: it
    /// does not wait for its WAL to reach disk (or a synchronous standby).
    /// A server crash or a failover loses the settlements of the last
    /// moments (up to three times `wal_writer_delay`, 600 ms at its
    /// default; PostgreSQL docs, "Asynchronous Commit"): their events are
    /// delivered again, none is lost, as the WAL keeps its order.
    #[default]
    Asynchronous,
    /// As the session's `synchronous_commit` says.
    Durable,
}

impl AckCommit {
    /// The value of `synchronous_commit` for a settlement's transaction:
    /// `Some("off")`, or `None` for the session's own.
    pub(crate) fn setting(self) -> Option<&'static str> {
        match self {
            AckCommit::Asynchronous => Some("off"),
            AckCommit::Durable => None,
        }
    }

    /// What begins a named subscription's claim transaction (competing
    /// mode), which holds its settlements.
    pub(crate) fn claim_begin(self) -> &'static str {
        match self {
            AckCommit::Asynchronous => "BEGIN; SET LOCAL synchronous_commit = off",
            AckCommit::Durable => "BEGIN",
        }
    }
}

/// Mark events published (MarkPublished of docs/schema.md, batched), if
/// the terms $2 are current ([`fence!`]). Returns `current` and, per row actually
/// published, seconds from `occurred_at` to now (`lag`, NULL in the one
/// row returned when none was published).
pub(crate) const ACK: &str = concat!(
    "WITH ",
    fence!("$2"),
    ", u AS (UPDATE events.outbox SET published_at = now() \
       WHERE id = ANY($1::bigint[]) AND published_at IS NULL AND (SELECT current FROM fence) \
       RETURNING EXTRACT(EPOCH FROM (now() - occurred_at))::float8 AS lag) \
     SELECT f.current, u.lag FROM fence f LEFT JOIN u ON true"
);

/// Record failures (MarkRetry of docs/schema.md, batched): retry_count + 1,
/// last_error, and next_retry_at = now() + delay, or 'infinity' when the
/// event becomes a dead letter (retry_count reaches $3). $1 are the ids; $2
/// a jsonb object keyed by id (as text), each value `{"e": error, "d": delay
/// in seconds, "s": retry_count when fetched}` (see [`fail_details`]). Only
/// rows whose retry_count is still what was fetched change, so replaying a
/// batch whose reply was lost counts nothing twice. Returns per row changed
/// `id`, `dead` and `retry_in` (seconds until the retry, NULL for a dead
/// letter), with `current` (false: a term of $4 is no longer current
/// ([`fence!`]), and nothing changed); when no row changed, one row with
/// `current` and NULLs.
///
/// Why it is robust: there is no join. `o.id = ANY($1)` makes every plan of
/// `events.outbox` an index lookup of those ids, and each row finds its
/// details by a key lookup in $2 (a binary search of the object's sorted
/// keys). Joined to `unnest` of arrays instead, under statistics from before
/// a backlog the planner took the outbox side for one row and rescanned the
/// whole array for every row: 3 s for 4 000 failures.
pub(crate) const FAIL: &str = concat!(
    "WITH ",
    fence!("$4"),
    ", u AS (UPDATE events.outbox o SET retry_count = o.retry_count + 1, \
       last_error = $2::jsonb -> o.id::text ->> 'e', \
       next_retry_at = CASE WHEN o.retry_count + 1 >= $3 THEN 'infinity'::timestamptz \
         ELSE now() + make_interval(secs => ($2::jsonb -> o.id::text ->> 'd')::float8) END \
     WHERE o.id = ANY($1::bigint[]) AND o.published_at IS NULL \
       AND o.retry_count = ($2::jsonb -> o.id::text ->> 's')::int4 AND (SELECT current FROM fence) \
     RETURNING o.id, o.retry_count >= $3 AS dead, \
       CASE WHEN o.retry_count >= $3 THEN NULL \
            ELSE EXTRACT(EPOCH FROM (o.next_retry_at - now()))::float8 END AS retry_in) \
     SELECT f.current, u.id, u.dead, u.retry_in FROM fence f LEFT JOIN u ON true"
);

/// [`FAIL`]'s `$2`: per id (as text), the error (`e`), the delay in seconds
/// (`d`) and the retry_count when fetched (`s`).
pub(crate) fn fail_details<'a>(fails: impl Iterator<Item = (i64, &'a str, f64, i32)>) -> serde_json::Value {
    serde_json::Value::Object(
        fails.map(|(id, e, d, s)| (id.to_string(), serde_json::json!({ "e": e, "d": d, "s": s }))).collect(),
    )
}

/// [`ACK`] for a named subscription (docs/subscriptions.md): settle events
/// $1 for subscription $3 (`text`) if the terms $2 are current
/// ([`fence!`]), through `events.outbox_subscription_ack` (migration 0016),
/// which records them above the cursor (or deletes their failure rows, and
/// makes the held events of each such aggregate due) and moves the cursor,
/// with the checkpoint $4, $5 ([`super::subscription::checkpoint_sql`], read
/// just before). The same rows as [`ACK`]: `current`, and `lag` per event
/// settled now. Fails with SQLSTATE P0002 when the subscription is gone.
/// Its transaction commits as `$6` (`text`) says, [`AckCommit::setting`]:
/// `off`, or NULL for the session's own `synchronous_commit`.
pub(crate) const SUBSCRIPTION_ACK: &str = concat!(
    "WITH ",
    fence!("$2"),
    " SELECT f.current, a.lag, ",
    commit_as!("$6"),
    " FROM fence f \
       LEFT JOIN events.outbox_subscription_ack($3::text, $1::bigint[], (SELECT current FROM fence), \
         $4::int8, $5::int8) a ON true"
);

/// [`FAIL`] for a named subscription: record the failures $1 (the details
/// of [`fail_details`]) for subscription $4 (`text`) with the dead-letter
/// threshold $2, if the terms $3 are current, through
/// `events.outbox_subscription_fail` (migration 0016), in its failure rows,
/// with the checkpoint $5, $6 as [`SUBSCRIPTION_ACK`].
/// The same rows as [`FAIL`].
/// Its transaction commits as `$7` says, as [`SUBSCRIPTION_ACK`]'s `$6`.
pub(crate) const SUBSCRIPTION_FAIL: &str = concat!(
    "WITH ",
    fence!("$3"),
    " SELECT f.current, u.id, u.dead, u.retry_in, ",
    commit_as!("$7"),
    " FROM fence f \
       LEFT JOIN events.outbox_subscription_fail($4::text, $1::jsonb, $2::int4, (SELECT current FROM fence), \
         $5::int8, $6::int8) u ON true"
);

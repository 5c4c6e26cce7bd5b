//! Backlog figures: the relay's gauges and `pg-outbox status`.

use tokio_postgres::GenericClient;

use super::backlog::{self, Backlog, Class};
pub use super::leader::{LeaderLock, PartitionHolder, RelayIdentity};
use super::{map_missing_schema, query_map};
use crate::error::Result;

/// Figures about the outbox, as `pg-outbox status` prints them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows with `published_at IS NULL`, dead letters included:
    /// `due_now + held_back + waiting_for_retry + dead_letters`.
    pub unpublished: i64,
    /// Unpublished rows that are due now (fresh, or their retry is due) and
    /// not held back.
    pub due_now: i64,
    /// Due rows held back behind an earlier failed, unpublished event of
    /// their aggregate (waiting for a retry, due again, or a dead letter).
    pub held_back: i64,
    /// Unpublished rows waiting for their retry (`next_retry_at` in the future).
    pub waiting_for_retry: i64,
    /// Dead letters: unpublished rows with `next_retry_at = 'infinity'` (set
    /// by the failure that reached the dead-letter threshold).
    pub dead_letters: i64,
    /// Age in seconds of the oldest unpublished event that is not a dead
    /// letter (from its `occurred_at`), or `None` when there is none.
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// Backlog per `(event_type, aggregate_type)`, most unpublished first
    /// (ties by event type, then aggregate type); at most
    /// [`OutboxStatus::MAX_TYPES`](crate::status::OutboxStatus::MAX_TYPES) rows.
    pub by_type: Vec<TypeBacklog>,
    /// More `(event_type, aggregate_type)` pairs have unpublished events
    /// than [`OutboxStatus::by_type`] shows.
    pub by_type_truncated: bool,
    /// When the events waiting for a retry come due.
    pub retries: RetryLadder,
    /// Who holds single mode's outbox lock, and whether it is a live relay;
    /// `None` when nobody holds it (no relay runs in single mode, or none
    /// has taken the lock yet). A holder that is not live is a stranded
    /// lock: no relay delivers (`status` prints "no live leader"). Always
    /// `None` on a hot standby, whose sessions hold no relay's lock (and
    /// whose `events.outbox_relays`, an unlogged table, cannot be read
    /// during recovery).
    pub leader: Option<LeaderLock>,
    /// Partitioned mode: each partition held, by partition, with its
    /// holder and the term it took; empty when no relay runs in partitioned
    /// mode (and always on a hot standby, as [`OutboxStatus::leader`]).
    pub partitions: Vec<PartitionHolder>,
    /// The ordering mode installed on `events.outbox`
    /// ([`crate::migrate::ordering`]); `None` when neither insert trigger is
    /// enabled. In JSON: `"outbox-locked"`, `"producer-locked"` or `null`.
    pub ordering: Option<super::schema::OrderingMode>,
    /// Every subscription but the default (whose figures are the ones
    /// above), by name, with its state, cursor, lag, backlog bound,
    /// failures, dead letters and held events
    /// ([`crate::subscription::list`]'s figures, bounded whatever the
    /// table's size); empty when there is none, or on a schema before
    /// migration 0016.
    pub subscriptions: Vec<super::subscription_admin::Subscription>,
    /// Whether any figure is estimated: the figures named in
    /// [`OutboxStatus::estimated_figures`] are.
    pub estimated: bool,
    /// The figures that are estimated, by field name (`unpublished`,
    /// `due_now`, `held_back`, `waiting_for_retry`, `dead_letters`,
    /// `oldest_unpublished_age_seconds`, `by_type`, `retries`); empty when
    /// every figure is exact. A class of rows (fresh, due retries, waiting
    /// for a retry, dead letters) with more than [`OutboxStatus::EXACT_ROWS`](crate::status::OutboxStatus::EXACT_ROWS) rows
    /// is estimated, and so is every figure it adds to. `retries` covers
    /// the three `due_within`/`due_later` buckets only: the next retries and
    /// the earliest due time are always exact.
    pub estimated_figures: Vec<&'static str>,
}

/// Most `(event_type, aggregate_type)` rows [`status`] returns: 50.
pub(crate) const STATUS_MAX_TYPES: i64 = 50;
/// How many of the next retry-due events [`status`] lists: 5.
pub(crate) const STATUS_NEXT_RETRIES: i64 = 5;

/// Unpublished events of one `(event_type, aggregate_type)`; the counts
/// split [`TypeBacklog::unpublished`] as in [`OutboxStatus`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct TypeBacklog {
    /// Event name.
    pub event_type: String,
    /// Kind of aggregate.
    pub aggregate_type: String,
    /// Unpublished rows, dead letters included.
    pub unpublished: i64,
    /// Due now and not held back.
    pub due_now: i64,
    /// Due, but held back behind an earlier failed event of their aggregate.
    pub held_back: i64,
    /// Waiting for their retry (`next_retry_at` in the future).
    pub waiting_for_retry: i64,
    /// Dead letters (`next_retry_at = 'infinity'`).
    pub dead_letters: i64,
    /// Age in seconds of the oldest of these that is not a dead letter, or
    /// `None` when all are dead letters.
    pub oldest_unpublished_age_seconds: Option<f64>,
}

/// When the events waiting for a retry (`next_retry_at` in the future, not
/// a dead letter) come due. The buckets do not overlap and add up to
/// [`OutboxStatus::waiting_for_retry`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct RetryLadder {
    /// The earliest `next_retry_at` (RFC 3339 in JSON), or `None`.
    pub next_due_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Seconds from now until [`RetryLadder::next_due_at`].
    pub next_due_in_seconds: Option<f64>,
    /// Due within the next minute.
    pub due_within_1m: i64,
    /// Due after one minute and within the hour.
    pub due_within_1h: i64,
    /// Due in more than an hour.
    pub due_later: i64,
    /// The next [`OutboxStatus::NEXT_RETRIES`](crate::status::OutboxStatus::NEXT_RETRIES) events to come due, earliest first.
    pub next: Vec<PendingRetry>,
}

/// One event waiting for its retry.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct PendingRetry {
    /// Outbox id.
    pub id: i64,
    /// Event name.
    pub event_type: String,
    /// Kind of aggregate.
    pub aggregate_type: String,
    /// Failed attempts so far.
    pub retry_count: i32,
    /// When it is due (`next_retry_at`).
    pub due_at: chrono::DateTime<chrono::Utc>,
    /// Seconds from now until `due_at`.
    pub due_in_seconds: f64,
    /// The last failure's message.
    pub last_error: Option<String>,
}

/// The next $1 rows to come due for a retry, in due order: the first
/// entries of `outbox_retry_due_idx` after now(), in the order of its key,
/// the only plan without a sort (ties, which the failures of one batch can
/// share, in index order; ordering them by id too would sort every row of
/// the tie).
pub(super) const NEXT_RETRIES: &str = "SELECT id, event_type, aggregate_type, retry_count, next_retry_at, \
       EXTRACT(EPOCH FROM (next_retry_at - now()))::float8 AS due_in, last_error \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at > now() AND next_retry_at < 'infinity' \
     ORDER BY next_retry_at LIMIT $1";

/// Read [`OutboxStatus`] in bounded time, whatever the backlog's size.
///
/// Each class of unpublished rows (fresh, due retries, waiting for a retry,
/// dead letters) is counted exactly up to [`OutboxStatus::EXACT_ROWS`](crate::status::OutboxStatus::EXACT_ROWS) rows, read
/// from its partial index in that index's order. A class with more is
/// estimated from [`OutboxStatus::SAMPLE_IDS`](crate::status::OutboxStatus::SAMPLE_IDS) ids per estimated kind, drawn
/// uniformly from the ids past the rows read and looked up by primary key;
/// [`OutboxStatus::estimated_figures`] names what is estimated
/// (docs/operations.md, "How `status` estimates"). Then the next
/// [`OutboxStatus::NEXT_RETRIES`](crate::status::OutboxStatus::NEXT_RETRIES) retries (the first entries of
/// `outbox_retry_due_idx` after now), and the holder of the outbox lock on
/// `pg_locks` ([`OutboxStatus::leader`]), and the subscriptions
/// ([`OutboxStatus::subscriptions`]). No statement walks the backlog or
/// the published history: the buffers each touches are bounded by those
/// constants. The statements run one after another; run them in one
/// `REPEATABLE READ` transaction (as `pg-outbox status` does) for figures
/// from one snapshot.
///
/// # Errors
/// [`crate::Error::NotMigrated`] if the schema is missing; [`crate::Error::Db`] if the
/// query fails otherwise.
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn status<C: GenericClient + Sync>(client: &C) -> Result<OutboxStatus> {
    let b = backlog::read(client).await.map_err(map_missing_schema)?;
    let next = query_map(client, NEXT_RETRIES, &[&STATUS_NEXT_RETRIES], |r| {
        Ok(PendingRetry {
            id: r.try_get("id")?,
            event_type: r.try_get("event_type")?,
            aggregate_type: r.try_get("aggregate_type")?,
            retry_count: r.try_get("retry_count")?,
            due_at: r.try_get("next_retry_at")?,
            due_in_seconds: r.try_get("due_in")?,
            last_error: r.try_get("last_error")?,
        })
    })
    .await?;
    let (by_type, by_type_truncated) = by_type(&b);
    let (fresh, due, waiting, dead) =
        (b.total(Class::Fresh), b.total(Class::Due), b.total(Class::Waiting), b.total(Class::Dead));
    // Held back: due rows behind an earlier failed event of their aggregate.
    let held = b.sum(Class::Fresh, |c| c.held) + b.sum(Class::Due, |c| c.held);
    let held = held.min(fresh + due);
    Ok(OutboxStatus {
        unpublished: fresh + due + waiting + dead,
        due_now: fresh + due - held,
        held_back: held,
        waiting_for_retry: waiting,
        dead_letters: dead,
        oldest_unpublished_age_seconds: b.oldest_age,
        by_type,
        by_type_truncated,
        retries: RetryLadder {
            next_due_at: next.first().map(|r| r.due_at),
            next_due_in_seconds: next.first().map(|r| r.due_in_seconds),
            due_within_1m: b.sum(Class::Waiting, |c| c.within_1m),
            due_within_1h: b.sum(Class::Waiting, |c| c.within_1h),
            due_later: b.sum(Class::Waiting, |c| c.later),
            next,
        },
        leader: super::leader::leader_lock(client, super::locks::LEADER_KEY, super::leader::OUTBOX_SCOPE).await?,
        partitions: super::leader::partition_holders(client, &super::subscription::Reader::Default).await?,
        ordering: super::schema::installed_ordering(client).await?,
        subscriptions: super::subscription_admin::named_if_any(client).await?,
        estimated: !b.estimated.is_empty(),
        estimated_figures: estimated_figures(&b),
    })
}

/// The figures the estimated classes of `b` add to, in
/// [`OutboxStatus`]'s field order.
fn estimated_figures(b: &Backlog) -> Vec<&'static str> {
    let (f, d, w, x) = (
        b.is_estimated(Class::Fresh),
        b.is_estimated(Class::Due),
        b.is_estimated(Class::Waiting),
        b.is_estimated(Class::Dead),
    );
    [
        ("unpublished", f || d || w || x),
        ("due_now", f || d),
        ("held_back", f || d),
        ("waiting_for_retry", w),
        ("dead_letters", x),
        ("oldest_unpublished_age_seconds", f || d || w),
        ("by_type", f || d || w || x),
        ("retries", w),
    ]
    .into_iter()
    .filter_map(|(name, yes)| yes.then_some(name))
    .collect()
}

/// The backlog per `(event_type, aggregate_type)`, most unpublished first
/// (ties by event type, then aggregate type), at most [`STATUS_MAX_TYPES`],
/// and whether more types were left out. The oldest age per type is that of
/// the rows read.
fn by_type(b: &Backlog) -> (Vec<TypeBacklog>, bool) {
    let mut types: std::collections::BTreeMap<(String, String), [f64; 5]> = Default::default();
    for ((class, event_type, aggregate_type), c) in &b.by {
        let t = types.entry((event_type.clone(), aggregate_type.clone())).or_default();
        let i = match class {
            Class::Fresh | Class::Due => 0,
            Class::Waiting => 2,
            Class::Dead => 3,
        };
        if i == 0 {
            t[0] += c.n - c.held;
            t[1] += c.held;
        } else {
            t[i] += c.n;
        }
        t[4] += c.n;
    }
    let mut rows: Vec<TypeBacklog> = types
        .into_iter()
        .map(|((event_type, aggregate_type), t)| TypeBacklog {
            event_type: event_type.clone(),
            aggregate_type: aggregate_type.clone(),
            unpublished: t[4].round() as i64,
            due_now: t[0].round() as i64,
            held_back: t[1].round() as i64,
            waiting_for_retry: t[2].round() as i64,
            dead_letters: t[3].round() as i64,
            oldest_unpublished_age_seconds: b.oldest_age_of(&event_type, &aggregate_type),
        })
        .filter(|t| t.unpublished > 0)
        .collect();
    rows.sort_by(|a, b| {
        b.unpublished
            .cmp(&a.unpublished)
            .then_with(|| a.event_type.cmp(&b.event_type))
            .then_with(|| a.aggregate_type.cmp(&b.aggregate_type))
    });
    let max = usize::try_from(STATUS_MAX_TYPES).unwrap_or(usize::MAX);
    let truncated = rows.len() > max;
    rows.truncate(max);
    (rows, truncated)
}

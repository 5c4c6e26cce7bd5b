//! The operators' statements on subscriptions (`crate::subscription`):
//! create, read, pause, resume, drop, rewind, and a subscription's dead
//! letters (`crate::dead_letters` with a subscription named). The model is
//! migrations/0016_outbox_subscriptions.sql: every event at or below a
//! subscription's `cursor_id` is settled for it, or has a row in
//! `events.outbox_subscription_failures`.
//!
//! Every read here is bounded whatever the size of `events.outbox`: a
//! subscription's figures are one descent of `outbox_pkey` (the highest
//! id), one walk of it from the cursor past the ids settled above it (the
//! lag), and at most [`FAILURES_COUNTED`] + 1 rows of its failures, by
//! their primary key. Creating one from a time (`From::Time`) is the
//! exception, a one-off walk of `outbox_pkey` up to the first event at or
//! after that time.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use super::backlog::{Backlog, Class};
use super::{map_missing_schema, query_map};
use crate::error::{Result, SubscriptionError};

/// The name of the seeded flow (`published_at` and the retry columns on
/// the row), which is no row of `events.outbox_subscriptions`.
pub(crate) const DEFAULT_NAME: &str = "default";

/// Failure rows of a subscription read for its figures (failing, dead
/// letters, held): 10 000. A subscription with more has figures counted
/// over its first 10 000 (and one) by id, lower bounds
/// (`Subscription::counts_exact` false).
pub(crate) const FAILURES_COUNTED: i64 = 10_000;

/// Where a subscription starts (or a rewind puts it): the cursor, the
/// highest id taken as settled, is computed from it when the operation
/// runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum From {
    /// The events after the highest id in `events.outbox` now (cursor: that
    /// id, 0 when the table is empty). An event whose transaction is still
    /// open at that moment and drew a lower id is not delivered to the
    /// subscription: ids are drawn at insert, not at commit.
    Now,
    /// Every event in the table (cursor: the lowest id minus one, 0 when
    /// the table is empty). Retention may have deleted older ones.
    Earliest,
    /// The events from this id on (cursor: the id minus one).
    Id(i64),
    /// The events from the first (lowest id) whose `occurred_at` is at or
    /// after this time (cursor: its id minus one); when there is none, as
    /// [`From::Now`]. Found by a one-off walk of `outbox_pkey` from the
    /// lowest id: on a large table, as long as a scan.
    Time(DateTime<Utc>),
}

/// A subscription's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum SubscriptionState {
    /// Its relays deliver its events.
    Active,
    /// Its relays deliver nothing until it is resumed; retention keeps
    /// every event it has not passed.
    Paused,
    /// It fell behind its lag bound with expiry opted in
    /// (`subscription set --expire`): its relays stop, retention no longer
    /// waits for it, and it can only be rewound (then paused) or dropped
    /// ([`SubscriptionError::Expired`]).
    Expired,
}

impl SubscriptionState {
    /// `active`, `paused` or `expired`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            SubscriptionState::Active => "active",
            SubscriptionState::Paused => "paused",
            SubscriptionState::Expired => "expired",
        }
    }

    fn parse(s: &str) -> Result<SubscriptionState> {
        match s {
            "active" => Ok(SubscriptionState::Active),
            "paused" => Ok(SubscriptionState::Paused),
            "expired" => Ok(SubscriptionState::Expired),
            other => Err(crate::error::Error::NotMigrated(format!(
                "events.outbox_subscriptions holds the unknown state {other:?}"
            ))),
        }
    }
}

impl std::fmt::Display for SubscriptionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A subscription and its figures, as `pg-outbox subscription list` and
/// `pg-outbox status` show them. Ids are `events.outbox` ids; ages are in
/// seconds, by the database's clock.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Subscription {
    /// Its name; `default` for the seeded flow.
    pub name: String,
    /// Active or paused (the default is always active).
    pub state: SubscriptionState,
    /// When it was created (`None` for the default).
    pub created_at: Option<DateTime<Utc>>,
    /// The cursor it was created with (`None` for the default).
    pub start_id: Option<i64>,
    /// Every event with an id at or below this is settled for it, or is
    /// one of its failures (`None` for the default, which keeps its
    /// progress on the rows).
    pub cursor_id: Option<i64>,
    /// When the cursor last moved (`None` for the default).
    pub moved_at: Option<DateTime<Utc>>,
    /// At most this many events wait for a first delivery: the highest id
    /// minus the cursor, minus the ids settled above it (ids have gaps, so
    /// the events may be fewer). For the default: its unpublished events
    /// never attempted (`status`'s count, estimated beyond 2 000, when
    /// [`Subscription::counts_exact`] is false).
    pub backlog_upper_bound: i64,
    /// Age in seconds of the event with the lowest id above the cursor
    /// that is not settled (`occurred_at` to now); `None` when there is
    /// none. For the default: its oldest unpublished event that is not a
    /// dead letter, retries included (`status`'s oldest pending age).
    pub lag_seconds: Option<f64>,
    /// Its lag bound in seconds (`subscription create|set --max-lag`);
    /// `None` without one, and for the default.
    pub max_lag_seconds: Option<f64>,
    /// Whether [`Subscription::lag_seconds`] passes
    /// [`Subscription::max_lag_seconds`]: the alert (docs/subscriptions.md,
    /// "Falling behind"). It still holds retention: nothing is dropped.
    pub behind: bool,
    /// Whether it expires once behind (`subscription set --expire`): it is
    /// then marked [`SubscriptionState::Expired`].
    pub expires: bool,
    /// Failed events waiting for a retry or due again (`retry_count` above
    /// 0, not dead letters).
    pub failing: i64,
    /// Dead letters (`next_retry_at = 'infinity'`): never delivered again
    /// unless retried by an operator (`pg-outbox dead-letters retry
    /// --subscription NAME`).
    pub dead_letters: i64,
    /// Events held back behind an earlier failed event of their aggregate.
    pub held: i64,
    /// Whether `failing`, `dead_letters` and `held` are exact: false for a
    /// subscription with more than 10 000 failure rows (they are counted
    /// over its first 10 000 by id: lower bounds), and for the default when
    /// `status` estimated them.
    pub counts_exact: bool,
    /// Who holds its single-mode leader lock (a relay or consumer reading
    /// it), with its term; `None` when nobody does, or on a standby. For
    /// the default subscription, the outbox lock's holder
    /// ([`super::OutboxStatus::leader`]).
    pub leader: Option<super::leader::LeaderLock>,
    /// In partitioned mode, each partition lock held (a relay or consumer
    /// reading it with `--mode partitioned`), by partition, with its
    /// holder and term; empty when none is held. For the default
    /// subscription, the outbox's ([`super::OutboxStatus::partitions`]).
    pub partitions: Vec<super::leader::PartitionHolder>,
    /// Relays or consumers reading it in competing mode (each holds a
    /// membership lock for as long as it runs; docs/architecture.md,
    /// "Advisory lock keys"); 0 when none does.
    pub competing: u32,
}

/// What a rewind did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Rewound {
    /// The cursor before.
    pub previous_cursor_id: i64,
    /// The cursor now.
    pub cursor_id: i64,
    /// Failure rows above the new cursor deleted (their events are
    /// delivered again), dead letters included.
    pub failures_dropped: i64,
    /// Of those, dead letters.
    pub dead_letters_dropped: i64,
}

/// What dropping a subscription deleted besides its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Dropped {
    /// Its failure rows (dead letters included).
    pub failures: i64,
    /// Of those, dead letters.
    pub dead_letters: i64,
}

/// The highest id in `events.outbox` (`cursor_id`, 0 when empty): one
/// descent of `outbox_pkey`.
pub(crate) const CURSOR_NOW: &str =
    "SELECT coalesce((SELECT o.id FROM events.outbox o ORDER BY o.id DESC LIMIT 1), 0) AS cursor_id";
/// The lowest id in `events.outbox` minus one (`cursor_id`, 0 when empty):
/// one descent of `outbox_pkey`.
pub(crate) const CURSOR_EARLIEST: &str =
    "SELECT coalesce((SELECT o.id FROM events.outbox o ORDER BY o.id LIMIT 1) - 1, 0) AS cursor_id";
/// The first id whose `occurred_at` is at or after $1 minus one, else the
/// highest id, else 0 (`cursor_id`): a walk of `outbox_pkey` from the
/// lowest id up to that event (no index has `occurred_at`).
pub(crate) const CURSOR_TIME: &str = "SELECT coalesce( \
       (SELECT o.id FROM events.outbox o WHERE o.occurred_at >= $1 ORDER BY o.id LIMIT 1) - 1, \
       (SELECT o.id FROM events.outbox o ORDER BY o.id DESC LIMIT 1), 0) AS cursor_id";

/// Create subscription $1 with cursor (and start id) $2; returns its name,
/// or nothing when the name is taken.
pub(crate) const CREATE: &str = "INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) \
     VALUES ($1, $2, $2) ON CONFLICT (name) DO NOTHING RETURNING name";

/// Every subscription (or only $1 when it is not NULL) with its figures,
/// by name (byte order): the highest id (one descent, an init plan), the lag (a walk of
/// `outbox_pkey` from the cursor past the ids settled above it), and its
/// failures counted over its first $2 rows by primary key.
pub(crate) const LIST: &str = concat!(
    "SELECT s.name, s.state, s.created_at, s.start_id, s.cursor_id, s.moved_at, \
       greatest(coalesce((SELECT o.id FROM events.outbox o ORDER BY o.id DESC LIMIT 1), s.cursor_id) - s.cursor_id \
                - (SELECT count(*) FROM unnest(s.settled) x WHERE x > s.cursor_id), 0)::int8 AS backlog_upper_bound, ",
    super::subscription_lag::lag_of_s!(),
    " AS lag_seconds, \
       (s.options ->> 'max_lag_seconds')::float8 AS max_lag_seconds, \
       coalesce((s.options ->> 'expire')::boolean, false) AS expires, \
       f.failing, f.dead_letters, f.held, f.walked \
     FROM events.outbox_subscriptions s \
     CROSS JOIN LATERAL ( \
       SELECT count(*) FILTER (WHERE w.retry_count > 0 AND w.next_retry_at < 'infinity') AS failing, \
              count(*) FILTER (WHERE w.next_retry_at = 'infinity') AS dead_letters, \
              count(*) FILTER (WHERE w.next_retry_at IS NULL) AS held, \
              count(*) AS walked \
       FROM (SELECT x.retry_count, x.next_retry_at FROM events.outbox_subscription_failures x \
             WHERE x.subscription = s.name ORDER BY x.id LIMIT $2) w) f \
     WHERE ($1::text IS NULL OR s.name = $1) \
     ORDER BY s.name COLLATE \"C\""
);

/// Whether `events.outbox_subscriptions` exists (`present`): a schema
/// before migration 0016 has none.
pub(crate) const TABLE_EXISTS: &str = "SELECT to_regclass('events.outbox_subscriptions') IS NOT NULL AS present";

/// Set subscription $1's state to $2 unless it expired; returns the state
/// it had (`was`; `expired`: nothing changed), or nothing when there is no
/// such subscription.
pub(crate) const SET_STATE: &str = "WITH old AS ( \
       SELECT name, state FROM events.outbox_subscriptions WHERE name = $1 FOR UPDATE), \
     upd AS (UPDATE events.outbox_subscriptions s SET state = $2 FROM old \
             WHERE s.name = old.name AND old.state <> 'expired' RETURNING 1) \
     SELECT old.state AS was FROM old";

/// Drop subscription $1: its row and its failure rows, in one statement. Its term row (scope `subscription:` $1) stays, so terms only
/// grow: a subscription created again under the name takes the next term,
/// and a destination that refuses a lower term per aggregate still takes
/// its deliveries. Returns one row: `dropped` (0 when there was no such
/// subscription), its `failures` and `dead_letters` before.
pub(crate) const DROP: &str = "WITH f AS ( \
       SELECT count(*) AS failures, count(*) FILTER (WHERE x.next_retry_at = 'infinity') AS dead_letters \
       FROM events.outbox_subscription_failures x WHERE x.subscription = $1), \
     d AS (DELETE FROM events.outbox_subscriptions WHERE name = $1 RETURNING name), \
     x AS (DELETE FROM events.outbox_subscription_failures WHERE subscription = $1 AND EXISTS (SELECT 1 FROM d) \
           RETURNING 1) \
     SELECT (SELECT count(*) FROM d) AS dropped, f.failures, f.dead_letters, (SELECT count(*) FROM x) AS deleted FROM f";

/// Rewind subscription $1 to cursor $2 when it is paused or expired (it is
/// paused then): the cursor set,
/// the ids settled above it and the checkpoints cleared, its failure rows
/// above $2 deleted. One row (none when there is no such subscription):
/// its `state` and `previous_cursor_id`, the failure rows deleted
/// (`failures`, `dead_letters` among them), and `moved` (0 when it was not
/// paused, and nothing changed).
pub(crate) const REWIND: &str = "WITH s AS ( \
       SELECT name, state, cursor_id FROM events.outbox_subscriptions WHERE name = $1 FOR UPDATE), \
     gone AS (DELETE FROM events.outbox_subscription_failures f USING s \
              WHERE s.state IN ('paused', 'expired') AND f.subscription = s.name AND f.id > $2 \
              RETURNING f.next_retry_at), \
     moved AS (UPDATE events.outbox_subscriptions u \
               SET cursor_id = $2, settled = '{}', checkpoint_ids = '{}', checkpoint_xids = '{}', moved_at = now(), \
                   state = 'paused' \
               FROM s WHERE u.name = s.name AND s.state IN ('paused', 'expired') RETURNING u.name) \
     SELECT s.state, s.cursor_id AS previous_cursor_id, \
       (SELECT count(*) FROM gone) AS failures, \
       (SELECT count(*) FROM gone WHERE next_retry_at = 'infinity') AS dead_letters, \
       (SELECT count(*) FROM moved) AS moved \
     FROM s";

/// Whether subscription $1 exists (a row, or none).
pub(crate) const EXISTS: &str = "SELECT 1 AS present FROM events.outbox_subscriptions WHERE name = $1";

/// Check `name` against the naming rule of `events.outbox_subscriptions`
/// (`^[a-z0-9][a-z0-9_.-]{0,62}$`, not `default`), before any SQL.
///
/// # Errors
/// [`SubscriptionError::InvalidName`] saying which part of the rule it breaks.
pub(crate) fn check_name(name: &str) -> Result<()> {
    let why = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > 63 {
        Some("it is longer than 63 characters")
    } else if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'.' | b'-')) {
        Some("it holds a character other than a-z, 0-9, '_', '.' and '-'")
    } else if !name.as_bytes()[0].is_ascii_alphanumeric() {
        Some("it does not start with a letter or a digit")
    } else if name == DEFAULT_NAME {
        Some(
            "'default' is the seeded flow (published_at on the row), which has no row to create, pause, rewind or drop",
        )
    } else {
        None
    };
    match why {
        Some(why) => Err(SubscriptionError::InvalidName { name: name.to_string(), why }.into()),
        None => Ok(()),
    }
}

/// The cursor `from` gives now ([`CURSOR_NOW`], [`CURSOR_EARLIEST`],
/// [`CURSOR_TIME`]; `Id(n)`: `n - 1`).
///
/// # Errors
/// [`SubscriptionError::InvalidStart`] for `Id(n)` below one, where no
/// id is, or above the highest id plus one (the events between would be
/// skipped unseen as they commit); [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
pub(crate) async fn cursor_for<C: GenericClient + Sync>(client: &C, from: From) -> Result<i64> {
    let row = match from {
        From::Id(n) => {
            let top: i64 = client.query_one(CURSOR_NOW, &[]).await.map_err(map_missing_schema)?.try_get("cursor_id")?;
            let why = if n < 1 {
                "ids start at 1; give id:1 for the first event".to_string()
            } else if n > top.saturating_add(1) {
                format!(
                    "the highest id is {top}: a start above {} would skip, unseen, the events that take the ids                      between; give id:{} or lower, or --from now",
                    top.saturating_add(1),
                    top.saturating_add(1)
                )
            } else {
                return Ok(n - 1);
            };
            return Err(SubscriptionError::InvalidStart { value: format!("id:{n}"), why }.into());
        }
        From::Now => client.query_one(CURSOR_NOW, &[]).await,
        From::Earliest => client.query_one(CURSOR_EARLIEST, &[]).await,
        From::Time(t) => client.query_one(CURSOR_TIME, &[&t]).await,
    }
    .map_err(map_missing_schema)?;
    Ok(row.try_get("cursor_id")?)
}

/// Every subscription's name.
const NAMES: &str = "SELECT name FROM events.outbox_subscriptions";

/// Create subscription `name` (checked with [`check_name`]) starting at
/// `from`; returns it with its figures.
///
/// # Errors
/// [`SubscriptionError::InvalidName`], [`SubscriptionError::Exists`],
/// [`SubscriptionError::LockClassTaken`], [`SubscriptionError::InvalidStart`];
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn create<C: GenericClient + Sync>(client: &C, name: &str, from: From) -> Result<Subscription> {
    check_name(name)?;
    let class = super::subscription::Reader::Subscription(name.into()).partition_class();
    let names = client.query(NAMES, &[]).await.map_err(map_missing_schema)?;
    for row in names {
        let other: String = row.try_get(0)?;
        if other != name && super::subscription::Reader::Subscription(other.as_str().into()).partition_class() == class
        {
            return Err(SubscriptionError::LockClassTaken { name: name.to_string(), other }.into());
        }
    }
    let cursor = cursor_for(client, from).await?;
    let created = client.query_opt(CREATE, &[&name, &cursor]).await.map_err(map_missing_schema)?;
    if created.is_none() {
        return Err(SubscriptionError::Exists(name.to_string()).into());
    }
    get(client, name).await
}

/// Read one [`LIST`] row.
fn subscription_from_row(r: &tokio_postgres::Row) -> Result<Subscription> {
    let state: String = r.try_get("state")?;
    let walked: i64 = r.try_get("walked")?;
    Ok(Subscription {
        name: r.try_get("name")?,
        state: SubscriptionState::parse(&state)?,
        created_at: Some(r.try_get("created_at")?),
        start_id: Some(r.try_get("start_id")?),
        cursor_id: Some(r.try_get("cursor_id")?),
        moved_at: Some(r.try_get("moved_at")?),
        backlog_upper_bound: r.try_get("backlog_upper_bound")?,
        lag_seconds: r.try_get("lag_seconds")?,
        max_lag_seconds: r.try_get("max_lag_seconds")?,
        behind: super::subscription_lag::behind(r.try_get("lag_seconds")?, r.try_get("max_lag_seconds")?),
        expires: r.try_get("expires")?,
        failing: r.try_get("failing")?,
        dead_letters: r.try_get("dead_letters")?,
        held: r.try_get("held")?,
        counts_exact: walked <= FAILURES_COUNTED,
        leader: None,
        partitions: Vec::new(),
        competing: 0,
    })
}

/// The subscriptions (all, or only `name`), by name, with their figures
/// ([`LIST`]); the default is not among them.
///
/// # Errors
/// [`crate::Error::NotMigrated`] (a schema before migration 0016 too) or
/// [`crate::Error::Db`].
pub(crate) async fn named<C: GenericClient + Sync>(client: &C, name: Option<&str>) -> Result<Vec<Subscription>> {
    let cap = FAILURES_COUNTED + 1;
    let mut all = query_map(client, LIST, &[&name, &cap], subscription_from_row).await?;
    for s in &mut all {
        let reader = super::subscription::Reader::Subscription(s.name.as_str().into());
        s.leader = super::leader::leader_lock(client, reader.leader_key(), &reader.leader_scope()).await?;
        s.partitions = super::leader::partition_holders(client, &reader).await?;
        s.competing = competing_readers(client, &reader).await?;
    }
    Ok(all)
}

/// How many sessions hold `reader`'s competing membership lock
/// (`super::locks::COUNT_MEMBERS` of its competing class).
async fn competing_readers<C: GenericClient + Sync>(client: &C, reader: &super::subscription::Reader) -> Result<u32> {
    let row = client.query_one(super::locks::COUNT_MEMBERS, &[&reader.competing_class()]).await?;
    Ok(u32::try_from(row.try_get::<_, i64>("members")?).unwrap_or(u32::MAX))
}

/// One subscription with its figures.
///
/// # Errors
/// [`SubscriptionError::Unknown`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
pub(crate) async fn get<C: GenericClient + Sync>(client: &C, name: &str) -> Result<Subscription> {
    named(client, Some(name)).await?.pop().ok_or_else(|| SubscriptionError::Unknown(name.to_string()).into())
}

/// Whether `events.outbox_subscriptions` exists ([`TABLE_EXISTS`]).
///
/// # Errors
/// [`crate::Error::Db`].
pub(crate) async fn table_exists<C: GenericClient + Sync>(client: &C) -> Result<bool> {
    Ok(client.query_one(TABLE_EXISTS, &[]).await?.try_get("present")?)
}

/// The subscriptions with their figures, or none on a schema before
/// migration 0016 (for `status`, which reads older schemas too).
///
/// # Errors
/// [`crate::Error::Db`].
pub(crate) async fn named_if_any<C: GenericClient + Sync>(client: &C) -> Result<Vec<Subscription>> {
    if !table_exists(client).await? {
        return Ok(Vec::new());
    }
    named(client, None).await
}

/// The default subscription (the seeded flow) as a [`Subscription`], from
/// the backlog figures `status` reads ([`super::backlog::read`]); its
/// `leader` is left `None` for the caller to read.
pub(crate) fn default_from(b: &Backlog) -> Subscription {
    let held = (b.sum(Class::Fresh, |c| c.held) + b.sum(Class::Due, |c| c.held))
        .min(b.total(Class::Fresh) + b.total(Class::Due));
    Subscription {
        name: DEFAULT_NAME.to_string(),
        state: SubscriptionState::Active,
        created_at: None,
        start_id: None,
        cursor_id: None,
        moved_at: None,
        backlog_upper_bound: b.total(Class::Fresh),
        lag_seconds: b.oldest_age,
        max_lag_seconds: None,
        behind: false,
        expires: false,
        failing: b.total(Class::Due) + b.total(Class::Waiting),
        dead_letters: b.total(Class::Dead),
        held,
        counts_exact: b.estimated.is_empty(),
        leader: None,
        partitions: Vec::new(),
        competing: 0,
    }
}

/// The default subscription ([`default_from`]) then the others, by name.
///
/// # Errors
/// [`crate::Error::NotMigrated`] (a schema before migration 0016 too) or
/// [`crate::Error::Db`].
pub(crate) async fn list<C: GenericClient + Sync>(client: &C) -> Result<Vec<Subscription>> {
    let b = super::backlog::read(client).await.map_err(map_missing_schema)?;
    let mut default = default_from(&b);
    default.leader = super::leader::leader_lock(client, super::locks::LEADER_KEY, super::leader::OUTBOX_SCOPE).await?;
    default.partitions = super::leader::partition_holders(client, &super::subscription::Reader::Default).await?;
    default.competing = competing_readers(client, &super::subscription::Reader::Default).await?;
    let mut all = vec![default];
    all.extend(named(client, None).await?);
    Ok(all)
}

/// Set `name`'s state ([`SET_STATE`]); returns the state it had.
///
/// # Errors
/// [`SubscriptionError::Unknown`], [`SubscriptionError::Expired`] (an
/// expired subscription is only rewound or dropped); [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
pub(crate) async fn set_state<C: GenericClient + Sync>(
    client: &C,
    name: &str,
    state: SubscriptionState,
) -> Result<SubscriptionState> {
    check_name(name)?;
    let row = client.query_opt(SET_STATE, &[&name, &state.as_str()]).await.map_err(map_missing_schema)?;
    let Some(row) = row else { return Err(SubscriptionError::Unknown(name.to_string()).into()) };
    let was: String = row.try_get("was")?;
    let was = SubscriptionState::parse(&was)?;
    if was == SubscriptionState::Expired {
        return Err(SubscriptionError::Expired(name.to_string()).into());
    }
    if state == SubscriptionState::Active && was != state {
        // Relays waiting for a wake-up look again.
        super::wakeup::notify(client, super::NOTIFY_CHANNEL, "").await?;
    }
    Ok(was)
}

/// Drop `name` ([`DROP`]).
///
/// # Errors
/// [`SubscriptionError::Unknown`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
pub(crate) async fn drop_subscription<C: GenericClient + Sync>(client: &C, name: &str) -> Result<Dropped> {
    check_name(name)?;
    let row = client.query_one(DROP, &[&name]).await.map_err(map_missing_schema)?;
    let dropped: i64 = row.try_get("dropped")?;
    if dropped == 0 {
        return Err(SubscriptionError::Unknown(name.to_string()).into());
    }
    Ok(Dropped { failures: row.try_get("failures")?, dead_letters: row.try_get("dead_letters")? })
}

/// Rewind `name` to `from` ([`REWIND`]), only when it is paused.
///
/// # Errors
/// [`SubscriptionError::Unknown`], [`SubscriptionError::NotPaused`],
/// [`SubscriptionError::InvalidStart`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
pub(crate) async fn rewind<C: GenericClient + Sync>(client: &C, name: &str, from: From) -> Result<Rewound> {
    // Refused before any work when the name is invalid or unknown or the
    // subscription active; the statement checks again under the row's lock.
    check_name(name)?;
    match state_of(client, name).await? {
        SubscriptionState::Paused | SubscriptionState::Expired => {}
        SubscriptionState::Active => return Err(SubscriptionError::NotPaused(name.to_string()).into()),
    }
    let cursor = cursor_for(client, from).await?;
    let row = client.query_opt(REWIND, &[&name, &cursor]).await.map_err(map_missing_schema)?;
    let Some(row) = row else { return Err(SubscriptionError::Unknown(name.to_string()).into()) };
    let moved: i64 = row.try_get("moved")?;
    if moved == 0 {
        return Err(SubscriptionError::NotPaused(name.to_string()).into());
    }
    Ok(Rewound {
        previous_cursor_id: row.try_get("previous_cursor_id")?,
        cursor_id: cursor,
        failures_dropped: row.try_get("failures")?,
        dead_letters_dropped: row.try_get("dead_letters")?,
    })
}

/// `name`'s state now, without its figures.
async fn state_of<C: GenericClient + Sync>(client: &C, name: &str) -> Result<SubscriptionState> {
    let row = client
        .query_opt("SELECT state FROM events.outbox_subscriptions WHERE name = $1", &[&name])
        .await
        .map_err(map_missing_schema)?;
    let Some(row) = row else { return Err(SubscriptionError::Unknown(name.to_string()).into()) };
    let state: String = row.try_get("state")?;
    SubscriptionState::parse(&state)
}

/// Fail with [`SubscriptionError::Unknown`] unless `name` exists
/// ([`EXISTS`]).
///
/// # Errors
/// That, [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn require<C: GenericClient + Sync>(client: &C, name: &str) -> Result<()> {
    match client.query_opt(EXISTS, &[&name]).await.map_err(map_missing_schema)? {
        Some(_) => Ok(()),
        None => Err(SubscriptionError::Unknown(name.to_string()).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::check_name;

    #[test]
    fn names_follow_the_tables_rule() {
        for ok in ["a", "0", "orders-audit", "billing.v2", "a_b", &"x".repeat(63)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("", "empty"),
            ("default", "seeded flow"),
            ("Orders", "other than"),
            ("-a", "start with"),
            ("_a", "start with"),
            (".a", "start with"),
            ("a b", "other than"),
            ("é", "other than"),
            (&"x".repeat(64), "longer than 63"),
        ] {
            let e = check_name(bad).expect_err(bad).to_string();
            assert!(e.contains(why) && e.contains("^[a-z0-9][a-z0-9_.-]{0,62}$"), "{bad:?}: {e}");
        }
    }
}

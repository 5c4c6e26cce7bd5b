//! Reads for an operator console (`pg-outbox console`): the relays and
//! their roles, one event with its state and its aggregate's timeline, a
//! page of dead letters (keyset paging), and delivery per minute over the
//! last hour. The backlog figures are [`crate::status`]; the actions are
//! [`crate::dead_letters::retry`] and [`crate::dead_letters::discard`].
//!
//! Every function only reads, through an index or the catalog views, with a
//! bound on the rows it returns.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use crate::dead_letters::Filter;
use crate::error::Result;
use crate::event::Event;
use crate::store::console as store;

/// Where an event stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EventState {
    /// Delivered (`published_at` is set).
    Published,
    /// Not published and due (fresh, or its retry is due); it may still be
    /// held back by an earlier failed event of its aggregate.
    Due,
    /// Waiting for its retry (`next_retry_at` in the future).
    WaitingForRetry,
    /// A dead letter (`next_retry_at = 'infinity'`).
    DeadLetter,
}

/// An event with the columns that say where it stands.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct EventDetail {
    /// The event (payload, retry count, last error included).
    pub event: Event,
    /// When it was delivered, or `None`.
    pub published_at: Option<DateTime<Utc>>,
    /// When its retry is due, or `None` (never failed, published, or a dead
    /// letter: see [`EventDetail::state`]).
    pub next_retry_at: Option<DateTime<Utc>>,
    /// Where it stands, by the database's clock at the time of the read.
    pub state: EventState,
}

impl EventDetail {
    /// The event with its state at `now`: published when `published_at` is
    /// set, else a dead letter when `dead`, else waiting while
    /// `next_retry_at` is after `now`, else due.
    pub(crate) fn judged(
        event: Event,
        published_at: Option<DateTime<Utc>>,
        next_retry_at: Option<DateTime<Utc>>,
        dead: bool,
        now: DateTime<Utc>,
    ) -> Self {
        let state = if published_at.is_some() {
            EventState::Published
        } else if dead {
            EventState::DeadLetter
        } else if next_retry_at.is_some_and(|t| t > now) {
            EventState::WaitingForRetry
        } else {
            EventState::Due
        };
        EventDetail { event, published_at, next_retry_at, state }
    }
}

/// One event by id, or `None` when there is no such row.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn event<C: GenericClient + Sync>(client: &C, id: i64) -> Result<Option<EventDetail>> {
    let now = store::db_now(client).await?;
    store::event(client, id, now).await
}

/// The events of one aggregate around one of its events.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Timeline {
    /// Earlier events, latest first (at most the `around` asked for).
    pub earlier: Vec<EventDetail>,
    /// Later events, in id order (at most the `around` asked for).
    pub later: Vec<EventDetail>,
    /// Unpublished events after this one: those it holds back while it is
    /// not published (all of them, not only those in [`Timeline::later`]).
    pub later_unpublished: i64,
}

/// The aggregate's events before and after `of` (at most `around` on each
/// side), through `outbox_aggregate_idx`, and how many later ones are
/// unpublished.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn timeline<C: GenericClient + Sync>(client: &C, of: &Event, around: i64) -> Result<Timeline> {
    let now = store::db_now(client).await?;
    store::timeline(client, of, around, now).await
}

/// Up to `limit` dead letters matching `filter` (its `limit` is ignored)
/// with ids above `after_id` (0 for the first page), in id order: a walk of
/// `outbox_dead_letter_idx` from `after_id`, as fast on the thousandth page
/// as on the first. The next page starts after the last id returned.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn dead_letter_page<C: GenericClient + Sync>(
    client: &C,
    filter: &Filter,
    after_id: i64,
    limit: i64,
) -> Result<Vec<EventDetail>> {
    let now = store::db_now(client).await?;
    store::dead_letter_page(client, filter, after_id, limit, now).await
}

/// Delivery in one minute of the last hour.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct MinuteDelivery {
    /// The minute (`published_at` truncated to the minute).
    pub minute: DateTime<Utc>,
    /// Events published in that minute.
    pub published: i64,
    /// Mean `published_at - occurred_at` of those events, in seconds.
    pub mean_lag_seconds: f64,
    /// Largest `published_at - occurred_at` of those events, in seconds.
    pub max_lag_seconds: f64,
}

/// Delivery per minute over the last hour, from the table itself.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct DeliveryChart {
    /// Minutes with at least one publication, oldest first.
    pub minutes: Vec<MinuteDelivery>,
    /// The read stopped at the latest `max_rows` events, so minutes
    /// before the first of [`DeliveryChart::minutes`] may be incomplete or
    /// missing (more than `max_rows` events in the hour).
    pub capped: bool,
    /// The database's `now()` at the read: the end of the hour shown.
    pub now: DateTime<Utc>,
}

/// Default bound of [`delivery_chart`]'s read: the latest 50 000 events.
pub const DEFAULT_CHART_ROWS: i64 = 50_000;

/// Events published per minute and their delivery lag
/// (`published_at - occurred_at`), over the last hour, read from the latest
/// `max_rows` events by id (a backward walk of `outbox_pkey`, so the cost is
/// bounded whatever the publish rate; see [`DeliveryChart::capped`]).
/// Retention that deleted rows removes them from the chart too.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn delivery_chart<C: GenericClient + Sync>(client: &C, max_rows: i64) -> Result<DeliveryChart> {
    let now = store::db_now(client).await?;
    store::delivery_chart(client, max_rows, now).await
}

/// What a relay session holds or does.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct RelaySession {
    /// Backend process id.
    pub pid: i32,
    /// `application_name`: the relay names its sessions `pg-outbox drain`
    /// (fetches, holds the locks), `pg-outbox writer` (acknowledgements) and
    /// `pg-outbox listener` (LISTEN) unless its URL names them.
    pub application_name: String,
    /// The client's address, or `None` over a Unix socket.
    pub client_addr: Option<String>,
    /// When the session started.
    pub backend_start: Option<DateTime<Utc>>,
    /// `pg_stat_activity.state` (`idle`, `active`, ...).
    pub state: String,
    /// When `state` last changed.
    pub state_change: Option<DateTime<Utc>>,
    /// Registered in `events.outbox_relays`: `Some(true)` while it waits for
    /// a wake-up (idle), `Some(false)` while it drains, `None` when not
    /// registered.
    pub waiting: Option<bool>,
    /// When the registration was last written (`updated_at`): its waiting
    /// flag set, or the relay's heartbeat, which refreshes it every 5 s
    /// (a third of `stranded_after`) while the relay runs.
    pub waiting_since: Option<DateTime<Utc>>,
    /// Holds the single mode's leader lock: the active relay.
    pub leader: bool,
    /// The partitions it holds (partitioned mode), ascending.
    pub partitions: Vec<i32>,
    /// Holds a partitioned mode membership lock.
    pub member: bool,
}

impl RelaySession {
    /// The role as a short phrase: `leader`, `partitions 0, 3, 5`, `member
    /// (no partition)`, `listener`, `writer`, or `standby or competing` for a
    /// drain session that holds no lock.
    pub fn role(&self) -> String {
        if self.leader {
            return "leader".into();
        }
        if !self.partitions.is_empty() {
            let list: Vec<String> = self.partitions.iter().map(i32::to_string).collect();
            return format!("partitions {}", list.join(", "));
        }
        if self.member {
            return "member (no partition)".into();
        }
        match self.application_name.as_str() {
            "pg-outbox listener" => "listener".into(),
            "pg-outbox writer" => "writer".into(),
            _ => "standby or competing".into(),
        }
    }
}

/// The relays' sessions and the notification queue.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Relays {
    /// Relay sessions in this database, oldest first.
    pub sessions: Vec<RelaySession>,
    /// `pg_notification_queue_usage()`: the fraction (0 to 1) of the
    /// server's notification queue in use; near 1, notifying commits fail.
    pub notification_queue_usage: f64,
}

/// The relays connected to this database, as `pg_stat_activity`,
/// `events.outbox_relays` and `pg_locks` show them: the sessions registered
/// for wake-ups, those holding pg-outbox's leader, partition or membership
/// locks, and those named as a relay names its sessions. Seeing other
/// sessions' rows in `pg_stat_activity` needs the same role or
/// `pg_read_all_stats`; sessions of other roles show with fewer details.
/// On a hot standby, none: relays run only against a primary.
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn relays<C: GenericClient + Sync>(client: &C) -> Result<Relays> {
    store::relays(client).await
}

/// Bound every later statement of `client`'s session to `timeout`: sets
/// the session's `statement_timeout` (whole milliseconds, rounded up; zero
/// turns it off), over any the role, the database or the URL's `options`
/// set. What `pg-outbox console` does to its session, so that no page
/// waits on the database for long.
///
/// # Errors
/// [`crate::Error::Db`] when the server refuses the setting or the
/// session is gone.
///
/// # Cancel safety
/// Cancel safe: one statement that changes only this session's setting;
/// dropped, the setting may or may not have changed.
pub async fn set_statement_timeout<C: GenericClient + Sync>(client: &C, timeout: Duration) -> Result<()> {
    store::set_statement_timeout(client, timeout).await
}

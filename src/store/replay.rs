//! Replay's statements (`pg_outbox::relay::replay`): reads only.
//!
//! A replay walks `outbox_pkey` in windows of ids: each statement reads the
//! rows with ids in `($1, $2]` that match the filter, in id order, at most
//! `$9` of them. The window bounds the index range one statement walks
//! whatever the filter keeps (a filter on a rare event type reads the window
//! and returns few rows), so no statement reads the whole range at once; the
//! limit bounds the rows one page holds. One function per read runs it.

use std::sync::LazyLock;

use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

use super::{event_from_row, map_missing_schema, row_id};
use crate::error::{Error, Result};
use crate::event::Event;
use chrono::{DateTime, Utc};

/// Which events a replay delivers. Unset fields match all; set fields are
/// combined with AND. The default: every published event.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Filter {
    /// Only ids at or above this one.
    pub from_id: Option<i64>,
    /// Only ids at or below this one.
    pub to_id: Option<i64>,
    /// Only ids above this one: where an earlier, stopped replay resumes
    /// (its `relay::replay::Progress::last_delivered`). Combined with
    /// [`Filter::from_id`], the later start wins.
    pub after_id: Option<i64>,
    /// Only events that occurred (`occurred_at`) at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only events that occurred before this time.
    pub until: Option<DateTime<Utc>>,
    /// Only this aggregate type (exact match).
    pub aggregate_type: Option<String>,
    /// Only this aggregate.
    pub aggregate_id: Option<uuid::Uuid>,
    /// Only this event type (exact match).
    pub event_type: Option<String>,
    /// Also unpublished events (pending, waiting for a retry, dead letters),
    /// which the relay delivers too. Default `false`: published only.
    pub include_unpublished: bool,
}

impl Filter {
    /// Set [`Filter::from_id`].
    pub fn from_id(mut self, id: i64) -> Self {
        self.from_id = Some(id);
        self
    }

    /// Set [`Filter::to_id`].
    pub fn to_id(mut self, id: i64) -> Self {
        self.to_id = Some(id);
        self
    }

    /// Set [`Filter::after_id`].
    pub fn after_id(mut self, id: i64) -> Self {
        self.after_id = Some(id);
        self
    }

    /// Set [`Filter::since`].
    pub fn since(mut self, t: DateTime<Utc>) -> Self {
        self.since = Some(t);
        self
    }

    /// Set [`Filter::until`].
    pub fn until(mut self, t: DateTime<Utc>) -> Self {
        self.until = Some(t);
        self
    }

    /// Set [`Filter::aggregate_type`].
    pub fn aggregate_type(mut self, t: impl Into<String>) -> Self {
        self.aggregate_type = Some(t.into());
        self
    }

    /// Set [`Filter::aggregate_id`].
    pub fn aggregate_id(mut self, id: uuid::Uuid) -> Self {
        self.aggregate_id = Some(id);
        self
    }

    /// Set [`Filter::event_type`].
    pub fn event_type(mut self, t: impl Into<String>) -> Self {
        self.event_type = Some(t.into());
        self
    }

    /// Set [`Filter::include_unpublished`].
    pub fn include_unpublished(mut self, yes: bool) -> Self {
        self.include_unpublished = yes;
        self
    }

    /// Check that the ranges are not inverted.
    ///
    /// # Errors
    /// [`Error::Config`] when `from_id` is above `to_id`, or `since` is not
    /// before `until`.
    pub fn validate(&self) -> Result<()> {
        if let (Some(from), Some(to)) = (self.from_id, self.to_id)
            && from > to
        {
            return Err(Error::Config(format!("the id range is inverted: from id {from} is above to id {to}")));
        }
        if let (Some(since), Some(until)) = (self.since, self.until)
            && since >= until
        {
            let t = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
            return Err(Error::Config(format!(
                "the time range is empty or inverted: since {} is not before until {}",
                t(since),
                t(until)
            )));
        }
        Ok(())
    }

    /// The ids below and at this one are out: the later of `after_id` and
    /// the id before `from_id`; `None` when neither is set.
    pub(crate) fn start_after(&self) -> Option<i64> {
        let from = self.from_id.map(|f| f.saturating_sub(1));
        match (self.after_id, from) {
            (Some(a), Some(f)) => Some(a.max(f)),
            (a, f) => a.or(f),
        }
    }
}

/// Starts each read of a replay: a transaction of its own, read-only, so a
/// replay cannot change a row, even by mistake. Per transaction, not per
/// session (`SET SESSION CHARACTERISTICS`): through a transaction-mode
/// pooler a session setting would stay behind on a server session that
/// other clients get, and make their transactions read-only.
const BEGIN_READ_ONLY: &str = "START TRANSACTION READ ONLY";

/// The lowest and the highest id above `$1 bigint` (`first_id`, `last_id`;
/// NULL when there is none): where a replay starts and ends, and, after a
/// window with nothing in it, where the next row is (so a gap in the ids,
/// such as retention leaves at the low end, costs one statement, not one
/// per window). One step at each end of `outbox_pkey`.
pub(crate) const BOUNDS: &str = "SELECT min(id) AS first_id, max(id) AS last_id FROM events.outbox WHERE id > $1";

/// The window and the filter: ids in `($1 bigint, $2 bigint]`; `$3
/// boolean` include unpublished rows; `$4 timestamptz` occurred at or
/// after, `$5 timestamptz` occurred before, `$6 text` aggregate type, `$7
/// uuid` aggregate id, `$8 text` event type (each NULL for any).
const MATCHES: &str = "id > $1 AND id <= $2 \
     AND ($3::boolean OR published_at IS NOT NULL) \
     AND ($4::timestamptz IS NULL OR occurred_at >= $4) \
     AND ($5::timestamptz IS NULL OR occurred_at < $5) \
     AND ($6::text IS NULL OR aggregate_type = $6) \
     AND ($7::uuid IS NULL OR aggregate_id = $7) \
     AND ($8::text IS NULL OR event_type = $8)";

/// One page: the matching rows ([`MATCHES`], `$1`..`$8`), lowest id
/// first, at most `$9 bigint`. Ordered by `id`,
/// the key of `outbox_pkey`: with sorts discouraged on pg-outbox's sessions
/// ([`crate::connect::PLANNER_SETTINGS`]), a walk of that index over the window that
/// stops after `$9` rows.
pub(crate) fn page_sql() -> String {
    format!(concat!("SELECT ", event_columns!(), " FROM events.outbox WHERE {} ORDER BY id LIMIT $9"), MATCHES)
}

/// What a dry run counts in one window: the matching rows ([`MATCHES`],
/// `$1`..`$8`: `n`) and the lowest and highest of their ids (`first_id`,
/// `last_id`).
pub(crate) fn count_sql() -> String {
    format!("SELECT count(*) AS n, min(id) AS first_id, max(id) AS last_id FROM events.outbox WHERE {MATCHES}")
}

/// [`page_sql`] and [`count_sql`], built once.
static PAGE: LazyLock<String> = LazyLock::new(page_sql);
static COUNT: LazyLock<String> = LazyLock::new(count_sql);

/// Run `read` (statements on `client`) in a read-only transaction of its
/// own ([`BEGIN_READ_ONLY`]), committed after it, rolled back after an error.
async fn read_only<T>(client: &Client, read: impl Future<Output = Result<T>>) -> Result<T> {
    client.batch_execute(BEGIN_READ_ONLY).await?;
    match read.await {
        Ok(v) => {
            client.batch_execute("COMMIT").await?;
            Ok(v)
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

/// The lowest and the highest id in `events.outbox`, as [`bounds`] reads
/// them; `None` when there is none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    /// The lowest id.
    pub(crate) first_id: Option<i64>,
    /// The highest id.
    pub(crate) last_id: Option<i64>,
}

/// The lowest and the highest id above `after` ([`BOUNDS`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn bounds(client: &Client, after: i64) -> Result<Bounds> {
    read_only(client, async {
        let row = client.query_one(BOUNDS, &[&after]).await.map_err(map_missing_schema)?;
        Ok(Bounds { first_id: row.try_get("first_id")?, last_id: row.try_get("last_id")? })
    })
    .await
}

/// One window of a replay: the rows of `filter` with ids in `(after, upto]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window<'a> {
    /// The ids at and below this one are out.
    pub(crate) after: i64,
    /// The ids above this one are out.
    pub(crate) upto: i64,
    /// Which events (its id bounds are not used: the window is).
    pub(crate) filter: &'a Filter,
}

impl Window<'_> {
    /// The parameters `$1`..`$8` of [`MATCHES`].
    fn params(&self) -> [&(dyn ToSql + Sync); 8] {
        let f = self.filter;
        [
            &self.after,
            &self.upto,
            &f.include_unpublished,
            &f.since,
            &f.until,
            &f.aggregate_type,
            &f.aggregate_id,
            &f.event_type,
        ]
    }
}

/// A row of a page that cannot be read as an event.
#[derive(Debug)]
pub(crate) struct Unreadable {
    /// Its id, when that much can be read.
    pub(crate) id: Option<i64>,
    /// Why it cannot be read.
    pub(crate) error: Error,
}

/// The rows of `window`, lowest id first, at most `limit` ([`page_sql`]):
/// each an event, or what can be told of a row that cannot be read as one
/// (the rows after it are read all the same).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`] when the page
/// cannot be read.
pub(crate) async fn page(client: &Client, window: &Window<'_>, limit: i64) -> Result<Vec<Result<Event, Unreadable>>> {
    let [a, b, c, d, e, f, g, h] = window.params();
    let params = [a, b, c, d, e, f, g, h, &limit];
    let rows =
        read_only(client, async { client.query(PAGE.as_str(), &params).await.map_err(map_missing_schema) }).await?;
    Ok(rows.iter().map(|r| event_from_row(r).map_err(|error| Unreadable { id: row_id(r).ok(), error })).collect())
}

/// What [`count`] found in one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counted {
    /// How many rows match.
    pub(crate) rows: i64,
    /// The lowest of their ids (`None` when none match).
    pub(crate) first_id: Option<i64>,
    /// The highest of their ids.
    pub(crate) last_id: Option<i64>,
}

/// Count the rows of `window` ([`count_sql`]).
///
/// # Errors
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
pub(crate) async fn count(client: &Client, window: &Window<'_>) -> Result<Counted> {
    let params = window.params();
    let row = read_only(client, async { client.query_one(COUNT.as_str(), &params).await.map_err(map_missing_schema) })
        .await?;
    Ok(Counted { rows: row.try_get("n")?, first_id: row.try_get("first_id")?, last_id: row.try_get("last_id")? })
}

//! Event rows: the column list, and reading a row by column name.

use tokio_postgres::Row;

use crate::error::Result;
use crate::event::Event;

/// The columns of an event row, as text: see `event_columns!`.
pub(crate) const EVENT_COLUMNS: &str = event_columns!();

/// Name of the partition column a partitioned fetch adds to the event
/// columns ([`super::fetch_sql`]).
pub(crate) const PARTITION: &str = "part";

/// An [`Event`] from a row holding [`EVENT_COLUMNS`], read by column name.
pub(crate) fn event_from_row(row: &Row) -> Result<Event> {
    Ok(Event {
        id: row.try_get("id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        occurred_at: row.try_get("occurred_at")?,
        retry_count: row.try_get("retry_count")?,
        last_error: row.try_get("last_error")?,
    })
}

/// The `id` column of a row.
pub(crate) fn row_id(row: &Row) -> Result<i64> {
    Ok(row.try_get("id")?)
}

/// What a failure needs of a row [`event_from_row`] could not decode: its
/// id, aggregate type, aggregate id and retry count, read by name, or
/// `None` if one of those cannot be read either.
pub(crate) fn row_identity(row: &Row) -> Option<(i64, String, uuid::Uuid, i32)> {
    Some((
        row.try_get("id").ok()?,
        row.try_get("aggregate_type").ok()?,
        row.try_get("aggregate_id").ok()?,
        row.try_get("retry_count").ok()?,
    ))
}

/// The partition of a row of a partitioned fetch ([`super::fetch_sql`]`(true)`),
/// read by name; `None` for a row of another fetch.
pub(crate) fn row_partition(row: &Row) -> Option<i32> {
    row.try_get(PARTITION).ok()
}

//! Event rows: the column list, and reading a row by column name.

use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, Type};

use crate::error::Result;
use crate::event::Event;

/// Payloads stored in the row, uncompressed, under this many bytes are
/// measured by their stored size (`fetch::PayloadSizes::StoredWhenSmall`).
pub(crate) const SMALL_STORED_BYTES: usize = 2048;

/// The columns of an event row, as text: see `event_columns!`.
pub(crate) const EVENT_COLUMNS: &str = event_columns!();

/// Name of the partition column a partitioned fetch adds to the event
/// columns ([`super::fetch_sql`]).
pub(crate) const PARTITION: &str = "part";

/// The column of a single-mode fetch that carries the outbox's current
/// leadership term (`store::fetch::fetch_sql`).
pub(crate) const TERM: &str = "term";

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

/// Name of the column a fetch adds after the event columns (and the
/// partition): the payload bytes of the rows before it, as the fetch
/// measured them (`store::fetch`'s `within_budget`).
pub(crate) const BYTES_BEFORE: &str = "bytes_before";

/// Did the byte budget cut a fetch whose last row is `last` (more
/// candidates were there)? Yes when the payloads of its rows reach `budget`
/// as the fetch measured them: [`BYTES_BEFORE`] of the last row plus its
/// own payload, which the fetch measured as received (then it is exact), or
/// by its stored size, under [`SMALL_STORED_BYTES`]: so the
/// last row counts for at least that. A fetch that took every candidate and
/// came within that of the budget is taken for cut too: the next fetch
/// finds nothing, as after a full batch that happened to be the last.
pub(crate) fn fetch_was_cut(last: &Row, budget: i64) -> bool {
    let before: i64 = last.try_get::<_, Option<i64>>(BYTES_BEFORE).ok().flatten().unwrap_or(0);
    let own = payload_bytes(last).unwrap_or(0).max(SMALL_STORED_BYTES);
    before.saturating_add(i64::try_from(own).unwrap_or(i64::MAX)) >= budget
}

/// The payload of a row holding [`EVENT_COLUMNS`] as received, in bytes:
/// the binary form of `jsonb` (a version byte and the JSON text), before
/// it is parsed. What the consumer counts against its byte bound; the
/// fetch measures payloads the same way ([`super::PayloadSizes`]). `None`
/// if the row has no such column.
pub(crate) fn payload_bytes(row: &Row) -> Option<usize> {
    row.try_get::<_, Received>("payload").ok().map(|r| r.0)
}

/// The length of a value as it came off the wire, not decoded.
struct Received(usize);

impl<'a> FromSql<'a> for Received {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Received(raw.len()))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB || *ty == Type::JSON
    }
}

/// An event decoded from a fetched row, with what the consumer keeps of
/// the row besides: its payload's bytes as received ([`payload_bytes`]) and,
/// in a partitioned fetch, its partition.
pub(crate) struct DecodedEvent {
    pub(crate) event: Event,
    pub(crate) payload_bytes: usize,
    pub(crate) partition: Option<i32>,
    /// The current leadership term the fetch read for the row (single
    /// mode: the outbox's; partitioned mode: its partition's; `None` in
    /// competing mode).
    pub(crate) term: Option<crate::term::Term>,
    /// Read from a named subscription's failure rows (a retry, or an event
    /// held back behind one, column `failure_row` of
    /// [`super::fetch::subscription_fetch_sql`]): settling it can free the
    /// events of its aggregate after it.
    pub(crate) failure_row: bool,
}

/// [`event_from_row`] and the rest of [`DecodedEvent`]; the partition when
/// `partitioned`.
pub(crate) fn decode_event(row: &Row, partitioned: bool) -> Result<DecodedEvent> {
    Ok(DecodedEvent {
        event: event_from_row(row)?,
        payload_bytes: payload_bytes(row).unwrap_or(0),
        partition: if partitioned { row_partition(row) } else { None },
        term: row.try_get::<_, Option<i64>>(TERM).ok().flatten().and_then(crate::term::Term::from_db),
        failure_row: row.try_get::<_, Option<bool>>("failure_row").ok().flatten().unwrap_or(false),
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

/// The partition of a row of a partitioned fetch ([`super::fetch_sql`]`(true, _)`),
/// read by name; `None` for a row of another fetch.
pub(crate) fn row_partition(row: &Row) -> Option<i32> {
    row.try_get(PARTITION).ok()
}

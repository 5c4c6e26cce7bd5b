//! What a fetch returns: its rows, decoded as they arrive, and what the
//! fetch says of itself (the term it read, whether the byte budget cut
//! it, the floor and snapshot figures of an ordered fetch).

use futures::TryStreamExt;
use tokio_postgres::{Row, RowStream};

use super::rows::{DecodedEvent, TERM, decode_event, fetch_was_cut, row_identity};
use crate::error::Error;
use crate::term::Term;

/// What an ordered fetch says of its floor and snapshot (read from its
/// first row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FloorReading {
    /// The floor the fresh rows were read above.
    pub(crate) floor: i64,
    /// The oldest transaction id running at the fetch's snapshot.
    pub(crate) snapshot_xmin: i64,
    /// The next transaction id to be assigned, as the fetch saw it.
    pub(crate) next_xid: i64,
    /// Ids follow transaction ids on this outbox now (the rule the floor
    /// needs: [`super::fetch::fetch_sql`]).
    pub(crate) ids_after_xids: bool,
    /// The count of unblocks the fetch's snapshot saw (`None`: none yet;
    /// -1: not kept).
    pub(crate) unblocks: Option<i64>,
    /// The count of rewinds the fetch's snapshot saw (`None`: none yet;
    /// -1: not kept).
    pub(crate) rewinds: Option<i64>,
    /// The first held-back row the floor passed in this fetch.
    pub(crate) held_passed: Option<i64>,
}

/// What of a row that could not be decoded could be read, for recording a
/// failed attempt.
#[derive(Debug)]
pub(crate) struct RowIdentity {
    pub(crate) id: i64,
    pub(crate) aggregate_type: String,
    pub(crate) aggregate_id: uuid::Uuid,
    pub(crate) retry_count: i32,
}

/// A row of a fetch that could not be decoded (e.g. `occurred_at =
/// 'infinity'`): why, and its identity if even that could be read.
#[derive(Debug)]
pub(crate) struct Undecodable {
    /// Boxed: a fetch's rows are `Result`s of this, and [`Error`] is large.
    pub(crate) error: Box<Error>,
    pub(crate) identity: Option<RowIdentity>,
}

/// One row of a fetch, decoded as it arrived.
pub(crate) type FetchedRow = Result<DecodedEvent, Undecodable>;

/// What a fetch returned, in id order.
#[derive(Default)]
pub(crate) struct FetchPage {
    pub(crate) rows: Vec<FetchedRow>,
    /// The outbox's current leadership term as the fetch read it (single
    /// mode, with at least one row; `None` otherwise).
    pub(crate) term: Option<Term>,
    /// The byte budget cut it: more rows may be due.
    pub(crate) cut: bool,
    /// The floor and snapshot figures (an ordered fetch with at least one
    /// row; `None` otherwise).
    pub(crate) floor: Option<FloorReading>,
}

/// Read a fetch's rows as they arrive, decoding each and dropping its bytes
/// as received before the next is read (tokio-postgres hands rows over one
/// batch of messages at a time, and reads no further until asked), so a
/// fetch never holds its rows and their parsed payloads together.
/// `partitioned`: read each row's partition too.
pub(super) async fn decode_stream(
    stream: RowStream,
    budget: i64,
    partitioned: bool,
) -> Result<FetchPage, tokio_postgres::Error> {
    futures::pin_mut!(stream);
    let mut rows = Vec::new();
    let mut cut = false;
    let mut term = None;
    let mut floor = None;
    while let Some(row) = stream.try_next().await? {
        cut = fetch_was_cut(&row, budget);
        if rows.is_empty() {
            term = row.try_get::<_, Option<i64>>(TERM).ok().flatten().and_then(Term::from_db);
            floor = floor_reading(&row);
        }
        rows.push(decode_row(&row, partitioned));
    }
    Ok(FetchPage { rows, cut, term, floor })
}

/// The floor columns of an ordered fetch's row (`None` in a claim, or if
/// any is NULL).
fn floor_reading(row: &Row) -> Option<FloorReading> {
    let int = |name: &str| row.try_get::<_, Option<i64>>(name).ok().flatten();
    Some(FloorReading {
        floor: int("fetch_floor")?,
        snapshot_xmin: int("snapshot_xmin")?,
        next_xid: int("next_xid")?,
        ids_after_xids: row.try_get::<_, Option<bool>>("ids_after_xids").ok().flatten()?,
        unblocks: int("unblocks"),
        rewinds: int("rewinds"),
        held_passed: int("held_passed"),
    })
}

fn decode_row(row: &Row, partitioned: bool) -> FetchedRow {
    decode_event(row, partitioned).map_err(|error| Undecodable {
        error: Box::new(error),
        identity: row_identity(row).map(|(id, aggregate_type, aggregate_id, retry_count)| RowIdentity {
            id,
            aggregate_type,
            aggregate_id,
            retry_count,
        }),
    })
}

//! The producers' INSERTs ([`crate::Publisher`]). The insert trigger
//! (`triggers/outbox_insert_order_and_notify.sql`) draws the id, takes the
//! aggregate's lock and sends the wake-up.

use tokio_postgres::GenericClient;

use super::{map_missing_schema, query_map, row_id};
use crate::error::Result;
use crate::event::NewEvent;

/// Insert one event: `$1` aggregate type, `$2` aggregate id, `$3` event
/// type, `$4` payload; returns its id.
pub(crate) const INSERT_ONE: &str =
    concat!("INSERT INTO events.outbox (", new_event_columns!(), ") VALUES ($1, $2, $3, $4) RETURNING id");

/// Insert several events in one statement: the four columns as arrays, in
/// input order; returns their ids (ascending in input order).
pub(crate) const INSERT_MANY: &str = concat!(
    "INSERT INTO events.outbox (",
    new_event_columns!(),
    ") SELECT t, a, e, p FROM unnest($1::text[], $2::uuid[], $3::text[], $4::jsonb[]) \
     WITH ORDINALITY AS x(t, a, e, p, n) ORDER BY n RETURNING id"
);

pub(crate) async fn insert_event<C: GenericClient + Sync>(client: &C, e: &NewEvent) -> Result<i64> {
    let row = client
        .query_one(INSERT_ONE, &[&e.aggregate_type, &e.aggregate_id, &e.event_type, &e.payload])
        .await
        .map_err(map_missing_schema)?;
    row_id(&row)
}

pub(crate) async fn insert_events<C: GenericClient + Sync>(client: &C, events: &[NewEvent]) -> Result<Vec<i64>> {
    let types: Vec<&str> = events.iter().map(|e| e.aggregate_type.as_str()).collect();
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.aggregate_id).collect();
    let names: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    let payloads: Vec<&serde_json::Value> = events.iter().map(|e| &e.payload).collect();
    let mut out = query_map(client, INSERT_MANY, &[&types, &ids, &names, &payloads], row_id).await?;
    // Sequence values are drawn in ORDER BY n order within the statement, so
    // ascending ids are the input order.
    out.sort_unstable();
    Ok(out)
}

//! The producers' INSERTs ([`crate::Publisher`]). The insert trigger
//! (`triggers/outbox_insert_order_and_notify.sql`) draws the id, takes the
//! aggregate's lock and sends the wake-up.
//!
//! Each INSERT goes as one message sequence on the unnamed statement, with
//! its parameter types given (tokio-postgres' `query_typed`, sqlx's
//! `persistent(false)`), never as a named prepared statement: a
//! transaction-mode pooler (PgBouncer before 1.21, Supavisor, Neon's
//! pooled endpoints) hands a client's statements to whichever server
//! session is free, where a statement named on another does not exist, or
//! one of the same name from another client already does. Through
//! tokio-postgres, Parse, Bind and Execute travel in one round trip and
//! hold no server session between them, inside a transaction or outside;
//! sqlx parses in a round trip of its own, so through such a pooler
//! publish inside a transaction.

use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};

use super::{map_missing_schema, row_id};
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
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&e.aggregate_type, Type::TEXT),
        (&e.aggregate_id, Type::UUID),
        (&e.event_type, Type::TEXT),
        (&e.payload, Type::JSONB),
    ];
    let row = client.query_typed_one(INSERT_ONE, &params).await.map_err(map_missing_schema)?;
    row_id(&row)
}

pub(crate) async fn insert_events<C: GenericClient + Sync>(client: &C, events: &[NewEvent]) -> Result<Vec<i64>> {
    let types: Vec<&str> = events.iter().map(|e| e.aggregate_type.as_str()).collect();
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.aggregate_id).collect();
    let names: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    let payloads: Vec<&serde_json::Value> = events.iter().map(|e| &e.payload).collect();
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&types, Type::TEXT_ARRAY),
        (&ids, Type::UUID_ARRAY),
        (&names, Type::TEXT_ARRAY),
        (&payloads, Type::JSONB_ARRAY),
    ];
    let rows = client.query_typed(INSERT_MANY, &params).await.map_err(map_missing_schema)?;
    let mut out = rows.iter().map(row_id).collect::<Result<Vec<i64>>>()?;
    // Sequence values are drawn in ORDER BY n order within the statement, so
    // ascending ids are the input order.
    out.sort_unstable();
    Ok(out)
}

/// The INSERTs above through sqlx (feature `sqlx`): the same statements,
/// parameters and error mapping.
#[cfg(feature = "sqlx")]
pub(crate) mod via_sqlx {
    use super::{INSERT_MANY, INSERT_ONE};
    use crate::error::{Error, Result};
    use crate::event::NewEvent;

    /// Insert one event and return its id.
    pub(crate) async fn insert_event<'c, E: sqlx::PgExecutor<'c>>(executor: E, e: &NewEvent) -> Result<i64> {
        sqlx::query_scalar(INSERT_ONE)
            .persistent(false)
            .bind(e.aggregate_type.as_str())
            .bind(e.aggregate_id)
            .bind(e.event_type.as_str())
            .bind(&e.payload)
            .fetch_one(executor)
            .await
            .map_err(map_missing_schema)
    }

    /// Insert several events in one statement; their ids in input order.
    pub(crate) async fn insert_events<'c, E: sqlx::PgExecutor<'c>>(
        executor: E,
        events: &[NewEvent],
    ) -> Result<Vec<i64>> {
        let types: Vec<&str> = events.iter().map(|e| e.aggregate_type.as_str()).collect();
        let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.aggregate_id).collect();
        let names: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
        let payloads: Vec<&serde_json::Value> = events.iter().map(|e| &e.payload).collect();
        let mut out: Vec<i64> = sqlx::query_scalar(INSERT_MANY)
            .persistent(false)
            .bind(types)
            .bind(ids)
            .bind(names)
            .bind(payloads)
            .fetch_all(executor)
            .await
            .map_err(map_missing_schema)?;
        // As in `insert_events`: ascending ids are the input order.
        out.sort_unstable();
        Ok(out)
    }

    /// As [`super::map_missing_schema`]: a missing table or schema
    /// (SQLSTATE 42P01, 3F000) is [`Error::NotMigrated`]; anything else is
    /// [`Error::Sqlx`].
    fn map_missing_schema(e: sqlx::Error) -> Error {
        let err = Error::from(e);
        if let Error::Sqlx { source, code: Some(code) } = &err
            && crate::store::is_missing_schema(code)
            && let Some(db) = source.as_database_error()
        {
            return Error::NotMigrated(db.message().to_string());
        }
        err
    }
}

//! All SQL that pg-outbox runs at run time, split by concern (schema SQL
//! lives in `migrations/` and `triggers/`; the `demo` command's own
//! application SQL, its `billing` schema and scratch database, stays with
//! it). Every time comparison uses the database's `now()`.
//!
//! - [`rows`]: the column list of an event row, written once, and reading
//!   rows by column name;
//! - [`publish`]: the producers' INSERTs;
//! - [`fetch`]: the consumer's fetches and the competing mode's claim;
//! - [`settle`]: acknowledgements and failures;
//! - [`status`], [`backlog`]: the backlog figures (bounded: exact up to a
//!   cap, estimated from a sample beyond) and the relay's gauges;
//! - [`wakeup`]: LISTEN/NOTIFY and the relays' registrations;
//! - [`replication`]: the WAL source's checks, its publication and its
//!   slot;
//! - [`locks`]: every advisory lock key, and the statements that take them;
//! - [`leader`]: who holds single mode's leader lock, and whether it is a
//!   live relay (its heartbeat); the leadership term it takes, confirms
//!   and releases (`events.outbox_terms`);
//! - [`subscription`]: whose events a consumer reads (the default
//!   subscription or a named one), its leader lock key and term scope;
//! - [`dead_letters`], [`retention`]: the operators' statements;
//! - [`subscription_admin`]: the operators' statements on subscriptions
//!   (create, list, pause, resume, drop, rewind);
//!   [`subscription_dead_letters`]: a subscription's dead letters;
//!   [`subscription_lag`]: its lag bound, and every subscription's lag
//!   that each consumer's maintenance reads for the alert;
//! - `replay`: replay's reads (feature `relay`);
//! - `console`: the operator console's reads (feature `console`);
//! - [`schema`]: what `migrate` runs besides the files;
//! - [`statement`]: the kinds of the drain loop's statements, and running
//!   one (stop, timeout, cancel);
//! - `work`, `writer`: the drain loop's two sessions, typed: a method per
//!   statement, parameters and results as structs.

use std::time::Duration;

use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Row};

use crate::error::{Error, Result};

/// The columns of an event row ([`crate::Event`]), written once: every
/// statement that returns event rows selects these, and
/// [`rows::event_from_row`] reads them by name. A macro, so that `concat!`
/// builds constant statements from it.
macro_rules! event_columns {
    () => {
        "id, aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count, last_error"
    };
}

/// The columns a producer writes ([`crate::NewEvent`]); the others take
/// their defaults.
macro_rules! new_event_columns {
    () => {
        "aggregate_type, aggregate_id, event_type, payload"
    };
}

pub(crate) mod backlog;
#[cfg(feature = "console")]
pub(crate) mod console;
pub(crate) mod dead_letters;
pub(crate) mod fetch;
pub(crate) mod leader;
pub(crate) mod locks;
mod page;
mod publish;
#[cfg(feature = "relay")]
pub(crate) mod replay;
#[cfg(feature = "wal")]
pub(crate) mod replication;
pub(crate) mod retention;
mod rows;
pub(crate) mod schema;
mod settle;
pub(crate) mod statement;
mod status;
pub(crate) mod subscription;
pub(crate) mod subscription_admin;
mod subscription_claim;
#[cfg(feature = "kit")]
pub use subscription_claim::claim_statements as subscription_claim_statements;
pub(crate) mod subscription_dead_letters;
pub(crate) mod subscription_lag;
mod wakeup;
mod work;
mod writer;

pub(crate) use backlog::{STATUS_EXACT_ROWS, STATUS_SAMPLE_IDS};
pub(crate) use fetch::SUBSCRIPTION_WINDOW;
#[cfg(feature = "kit")]
pub use fetch::fetch_query;
#[cfg(feature = "kit")]
pub(crate) use fetch::{NEXT_RETRY_IN, PayloadSizes, competing_fetch_sql, fetch_sql};
#[cfg(feature = "sqlx")]
pub(crate) use publish::via_sqlx;
pub(crate) use publish::{insert_event, insert_events};
pub(crate) use rows::{DecodedEvent, event_from_row, row_id};
#[cfg(feature = "kit")]
pub(crate) use settle::{ACK, FAIL};
pub(crate) use settle::{AckCommit, Fence};
pub use status::{
    LeaderLock, OutboxStatus, PartitionHolder, PendingRetry, RelayIdentity, RetryLadder, TypeBacklog, status,
};
pub(crate) use status::{STATUS_MAX_TYPES, STATUS_NEXT_RETRIES};
pub(crate) use wakeup::{NOTIFY_CHANNEL, listen, notify, ping};
pub(crate) use work::{
    FetchKind, FetchPage, FetchParams, FetchScope, FetchedRow, FloorParams, FloorReading, RowIdentity, Undecodable,
    WorkSession,
};
pub(crate) use writer::{Acknowledged, FailParams, FailWritten, FailsWritten, WriterSession};

/// Every statement pg-outbox runs on `events.outbox` at run time on a
/// server of `server_version_num` (e.g. 180004), by name, with the SQL
/// text it runs there: for checking their plans with `EXPLAIN` against
/// real tables (the integration tests do, in every statistics state, on
/// every supported version). Not a stable interface: names and texts
/// change with the code.
///
/// The parameters, by name: `fetch` (and, on PostgreSQL 14 and later,
/// `fetch_text_sizes`, the form PostgreSQL 13 runs) `$1 bigint[]` ids in
/// flight, `$2 bigint` batch, `$3 bigint` byte budget; `fetch_partitioned` those and `$4 bigint`
/// partitions, `$5 int4[]` partitions held; `competing_fetch`, `$1 bigint`
/// batch, `$2 bigint` byte budget; `ack` `$1 bigint[]`, `$2 jsonb` the
/// writer's leadership terms, scope to term (NULL: not fenced);
/// `fail` `$1 bigint[]` ids, `$2 jsonb` details per id (`{"<id>": {"e":
/// error, "d": delay in seconds, "s": retry count seen}}`), `$3 int4`
/// dead-letter threshold, `$4 jsonb` the writer's terms (NULL: not fenced);
/// `next_retry_in`: none; `backlog_exact`, `next_retries`: `$1 bigint`
/// limit; `backlog_sample`: `$1 bigint` lowest id, `$2 bigint` ids drawn,
/// `$3`, `$4 bigint` the fresh rows' and dead letters' ids counted
/// exactly; `dead_letters_*`:
/// `$1 bigint[]` ids, `$2 text` aggregate type, `$3 text` event type, `$4
/// text` error text, `$5 timestamptz` since (each NULL for any; not NULL
/// for the `_by_id` forms, which start from those ids), and but for
/// `dead_letters_count*`, `$6 bigint` limit; `retention_delete` `$1 float8`
/// age in seconds, `$2 bigint` batch, `$3 bigint` after id;
/// `retention_count` `$1 float8`; `replay_page` (feature `relay`) `$1
/// bigint` after id, `$2 bigint` up to id, `$3 boolean` include
/// unpublished, `$4`, `$5 timestamptz` occurred since, until, `$6 text`
/// aggregate type, `$7 uuid` aggregate id, `$8 text` event type (each NULL
/// for any), `$9 bigint` limit; `replay_count` the same but `$9`;
/// `replay_bounds` `$1 bigint` after id.
///
/// Not listed: the producers' INSERTs (their cost is the triggers',
/// measured by the benches), the operators' lookup of ids by primary key
/// ([`dead_letters::EXISTING_IDS`]), the operators' statements on
/// subscriptions ([`subscription_admin`]: one-off, on its own tables, and
/// on `events.outbox` by primary key; the three that read a
/// subscription's lag and backlog, the lags every consumer reads among
/// them, are [`subscription_read_statements`], checked in
/// `tests/it/subscription_plans.rs`; retention's rule for them is in
/// `retention_delete`, checked in `tests/it/subscription_admin.rs`), and
/// statements on other tables or the catalogs ([`locks`], [`leader`],
/// [`wakeup`], [`schema`]).
#[cfg(feature = "kit")]
#[doc(hidden)]
pub fn run_time_statements(server_version_num: i32) -> Vec<(&'static str, String)> {
    use dead_letters as d;
    let sizes = PayloadSizes::for_server(server_version_num);
    let mut all = vec![
        ("fetch", fetch_sql(false, sizes)),
        ("fetch_partitioned", fetch_sql(true, sizes)),
        ("competing_fetch", competing_fetch_sql(sizes)),
    ];
    if sizes != PayloadSizes::Text {
        all.push(("fetch_text_sizes", fetch_sql(false, PayloadSizes::Text)));
    }
    all.extend([
        ("ack", ACK.to_string()),
        ("fail", FAIL.to_string()),
        ("next_retry_in", NEXT_RETRY_IN.to_string()),
        ("backlog_exact", backlog::exact_sql()),
        ("backlog_sample", backlog::sample_sql()),
        ("next_retries", status::NEXT_RETRIES.to_string()),
        ("dead_letters_list", d::list_sql(d::Walk::DeadLetters)),
        ("dead_letters_count", d::count_sql(d::Walk::DeadLetters)),
        ("dead_letters_ids", d::ids_sql(d::Walk::DeadLetters)),
        ("dead_letters_retry", d::apply_sql(d::Walk::DeadLetters, d::RETRY)),
        ("dead_letters_discard", d::discard_subscribed_sql(d::Walk::DeadLetters)),
        ("dead_letters_list_by_id", d::list_sql(d::Walk::Ids)),
        ("dead_letters_count_by_id", d::count_sql(d::Walk::Ids)),
        ("dead_letters_retry_by_id", d::apply_sql(d::Walk::Ids, d::RETRY)),
        ("dead_letters_discard_by_id", d::discard_subscribed_sql(d::Walk::Ids)),
        ("dead_letters_existing", d::EXISTING_IDS.to_string()),
        ("retention_delete", retention::DELETE_BATCH.to_string()),
        ("retention_walk_end", retention::WALK_END.to_string()),
        ("retention_count", retention::COUNT_DUE.to_string()),
    ]);
    #[cfg(feature = "relay")]
    all.extend([
        ("replay_page", replay::page_sql()),
        ("replay_count", replay::count_sql()),
        ("replay_bounds", replay::BOUNDS.to_string()),
    ]);
    #[cfg(feature = "console")]
    all.extend([
        ("console_event", console::EVENT.to_string()),
        ("console_earlier", console::EARLIER.to_string()),
        ("console_later", console::LATER.to_string()),
        ("console_later_unpublished", console::LATER_UNPUBLISHED.to_string()),
        ("console_dead_letter_page", console::dead_letter_page_sql()),
        ("console_delivery_per_minute", console::DELIVERY_PER_MINUTE.to_string()),
    ]);
    all
}

/// The statements that read a named subscription's lag and backlog, for
/// the plan tests and the console bench, each with the cap the library
/// passes: `subscription_gauges` ([`subscription::GAUGES`]: `$1 text`
/// name, `$2 bigint` cap), `subscription_list` ([`subscription_admin::LIST`]:
/// `$1 text` name or NULL for all, `$2 bigint` cap) and `subscription_lags`
/// ([`subscription_lag::LAGS`]: no parameters, no cap), and
/// `subscription_window_holder` ([`subscription_lag::WINDOW_HOLDER`]: `$1
/// text` name, no cap). Each must cost the same whatever the size of
/// `events.outbox`.
#[cfg(feature = "kit")]
#[doc(hidden)]
pub fn subscription_read_statements() -> Vec<(&'static str, &'static str, Option<i64>)> {
    vec![
        ("subscription_gauges", subscription::GAUGES, Some(STATUS_EXACT_ROWS)),
        ("subscription_list", subscription_admin::LIST, Some(subscription_admin::FAILURES_COUNTED + 1)),
        ("subscription_lags", subscription_lag::LAGS, None),
        ("subscription_window_holder", subscription_lag::WINDOW_HOLDER, None),
    ]
}

/// Run `sql` with `params` and read every row it returns with `read`; a
/// missing schema is [`Error::NotMigrated`].
pub(crate) async fn query_map<C: GenericClient + Sync, T>(
    client: &C,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
    read: impl Fn(&Row) -> Result<T>,
) -> Result<Vec<T>> {
    client.query(sql, params).await.map_err(map_missing_schema)?.iter().map(read).collect()
}

/// Turn "relation events.outbox does not exist" into [`Error::NotMigrated`].
pub(crate) fn map_missing_schema(e: tokio_postgres::Error) -> Error {
    if let Some(db) = e.as_db_error()
        && is_missing_schema(db.code())
    {
        return Error::NotMigrated(db.message().to_string());
    }
    Error::Db(e)
}

/// A SQLSTATE saying the table or schema does not exist (42P01, 3F000).
fn is_missing_schema(code: &tokio_postgres::error::SqlState) -> bool {
    *code == tokio_postgres::error::SqlState::UNDEFINED_TABLE
        || *code == tokio_postgres::error::SqlState::INVALID_SCHEMA_NAME
}

/// Seconds as a [`Duration`], clamped to zero and to a day (a timer never
/// needs more: the sweep runs far more often).
pub(crate) fn secs_to_duration(secs: f64) -> Duration {
    if !secs.is_finite() || secs <= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(secs.min(86_400.0)) }
}

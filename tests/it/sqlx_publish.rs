//! Publishing through sqlx (feature `sqlx`): delivery of committed events,
//! none of rolled-back ones, checks before any SQL that leave the caller's
//! transaction usable, ids in input order, and the error mapping.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;
use pg_outbox::{Consumer, Error, NewEvent, Publisher};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::support::TestDb;

/// sqlx's options for the test database (same host, port, user, password
/// and database as the tokio-postgres config; a host starting with `/` is a
/// socket directory for both).
fn sqlx_options(db: &TestDb) -> PgConnectOptions {
    let mut o = PgConnectOptions::new_without_pgpass()
        .port(db.pg.get_ports().first().copied().unwrap_or(5432))
        .username(db.pg.get_user().unwrap_or("postgres"))
        .database(&db.name);
    o = match db.pg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => o.host(h),
        Some(tokio_postgres::config::Host::Unix(p)) => o.host(&p.display().to_string()),
        None => o.host("127.0.0.1"),
    };
    if let Some(pw) = db.pg.get_password() {
        o = o.password(std::str::from_utf8(pw).expect("UTF-8 password"));
    }
    o
}

async fn connect(db: &TestDb) -> PgConnection {
    PgConnection::connect_with(&sqlx_options(db)).await.expect("sqlx connect")
}

fn event(agg: Uuid, name: &str) -> NewEvent {
    NewEvent::new("subscription", agg, name, serde_json::json!({"name": name}))
}

async fn count(conn: &mut PgConnection, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(conn).await.expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_committed_events_are_delivered_and_rolled_back_ones_never() {
    let db = TestDb::new("sqlx_delivery").await;
    let mut stream = Consumer::builder(db.options())
        .sweep_interval(Duration::from_secs(3600))
        .start()
        .await
        .expect("start consumer");
    let mut conn = connect(&db).await;
    let p = Publisher::new();
    let agg = Uuid::new_v4();

    // Committed: one alone and two in a batch, in one transaction.
    let mut tx = conn.begin().await.expect("begin");
    let mut committed = vec![p.publish_sqlx(&mut *tx, &event(agg, "Paid")).await.expect("publish")];
    committed.extend(
        p.publish_many_sqlx(&mut *tx, &[event(agg, "Shipped"), event(agg, "Delivered")]).await.expect("publish many"),
    );
    tx.commit().await.expect("commit");

    // Rolled back, explicitly and by dropping the transaction.
    let mut tx = conn.begin().await.expect("begin");
    let gone = p.publish_sqlx(&mut *tx, &event(agg, "Gone")).await.expect("publish");
    p.publish_many_sqlx(&mut *tx, &[event(agg, "Gone"), event(agg, "Gone")]).await.expect("publish many");
    tx.rollback().await.expect("rollback");
    {
        let mut tx = conn.begin().await.expect("begin");
        p.publish_sqlx(&mut *tx, &event(agg, "Gone")).await.expect("publish");
    }
    // sqlx sends a dropped transaction's ROLLBACK with the connection's next
    // statement; until then the transaction holds the aggregate's lock.
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await.expect("after the dropped transaction");
    assert_eq!(one, 1);

    // A later committed event (a larger id than every rolled-back one),
    // through the pool: once it arrives, nothing earlier is still to come.
    let pool = PgPoolOptions::new().max_connections(1).connect_with(sqlx_options(&db)).await.expect("pool");
    let last = p.publish_sqlx(&pool, &event(agg, "Last")).await.expect("publish through pool");
    assert!(last > gone);
    committed.push(last);

    // Only notifications can deliver these: the sweep is an hour away.
    let mut got = Vec::new();
    while got.last() != Some(&last) {
        let d = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("no delivery within 10 s")
            .expect("stream ended");
        assert_ne!(d.event_type, "Gone", "a rolled-back event was delivered (id {})", d.id);
        got.push(d.id);
        d.ack();
    }
    assert_eq!(got, committed, "exactly the committed events, in publishing order");
    stream.finish().await.expect("finish");

    let published = count(&mut conn, "SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL").await;
    assert_eq!(published, 4);
    assert_eq!(count(&mut conn, "SELECT count(*) FROM events.outbox WHERE event_type = 'Gone'").await, 0);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_invalid_events_fail_before_sql_and_leave_the_transaction_usable() {
    let db = TestDb::new("sqlx_invalid").await;
    let mut conn = connect(&db).await;
    let p = Publisher::new().max_payload_bytes(1000);
    let agg = Uuid::new_v4();
    let bad = [
        NewEvent::new("subscription", agg, "Paid\0", serde_json::json!({})),
        NewEvent::new("subscription", agg, "Paid", serde_json::json!({"blob": "y".repeat(2000)})),
        NewEvent::new("", agg, "Paid", serde_json::json!({})),
        NewEvent::new("subscription", agg, "Paid", serde_json::json!({"s": "x\u{0}y"})),
    ];

    let mut tx = conn.begin().await.expect("begin");
    let kept = p.publish_sqlx(&mut *tx, &event(agg, "Kept")).await.expect("publish");
    for e in &bad {
        let err = p.publish_sqlx(&mut *tx, e).await.expect_err("must be refused");
        assert!(matches!(err, Error::InvalidEvent(_)), "{err:?}");
        // A valid event first in the batch: nothing of it is inserted.
        let err = p.publish_many_sqlx(&mut *tx, &[event(agg, "Batch"), e.clone()]).await.expect_err("batch refused");
        assert!(matches!(err, Error::InvalidEvent(_)), "{err:?}");
    }
    let err = p.publish_sqlx(&mut *tx, &bad[0]).await.expect_err("NUL");
    assert!(err.to_string().contains("event_type contains a NUL"), "{err}");
    let err = p.publish_sqlx(&mut *tx, &bad[1]).await.expect_err("oversized");
    assert!(err.to_string().contains("over the limit of 1000 bytes"), "{err}");
    let err = p.publish_sqlx(&mut *tx, &bad[2]).await.expect_err("empty");
    assert!(err.to_string().contains("aggregate_type is empty"), "{err}");

    // Had any statement failed, PostgreSQL would refuse this one (25P02).
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *tx).await.expect("transaction still usable");
    assert_eq!(one, 1);
    let after = p.publish_sqlx(&mut *tx, &event(agg, "After")).await.expect("publish after refusals");
    tx.commit().await.expect("commit");

    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM events.outbox ORDER BY id").fetch_all(&mut conn).await.expect("ids");
    assert_eq!(ids, [kept, after], "only the valid events, committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_publish_many_returns_ids_in_input_order() {
    let db = TestDb::new("sqlx_order").await;
    let mut conn = connect(&db).await;
    let p = Publisher::new();
    assert!(p.publish_many_sqlx(&mut conn, &[]).await.expect("empty").is_empty());

    // Outside a transaction block too (the statement commits by itself).
    let batch: Vec<NewEvent> =
        (0..25).map(|i| NewEvent::new("order", Uuid::new_v4(), format!("E{i}"), serde_json::json!({"i": i}))).collect();
    let ids = p.publish_many_sqlx(&mut conn, &batch).await.expect("batch");
    assert_eq!(ids.len(), batch.len());
    for (id, e) in ids.iter().zip(&batch) {
        let (t, agg, payload): (String, Uuid, serde_json::Value) =
            sqlx::query_as("SELECT event_type, aggregate_id, payload FROM events.outbox WHERE id = $1")
                .bind(id)
                .fetch_one(&mut conn)
                .await
                .expect("row");
        assert_eq!((t.as_str(), agg, &payload), (e.event_type.as_str(), e.aggregate_id, &e.payload));
    }
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "distinct ids");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_publish_maps_a_missing_schema_and_keeps_sqlstates() {
    let db = TestDb::new("sqlx_errors").await;
    let mut conn = connect(&db).await;
    let p = Publisher::new();
    let agg = Uuid::new_v4();

    // A read-only transaction: the server's SQLSTATE reaches code() and
    // is_transient() (25006 is transient: a standby after a failover).
    let mut tx = conn.begin().await.expect("begin");
    sqlx::query("SET TRANSACTION READ ONLY").execute(&mut *tx).await.expect("read only");
    let err = p.publish_sqlx(&mut *tx, &event(agg, "Paid")).await.expect_err("read-only");
    assert!(matches!(err, Error::Sqlx { .. }), "{err:?}");
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION));
    assert!(err.is_transient());
    assert!(err.as_db_error().is_none());
    tx.rollback().await.expect("rollback");

    // A permanent server error, converted with `?`-style From.
    let raw = sqlx::query("SELECT 1/0").execute(&mut conn).await.expect_err("division by zero");
    let err = Error::from(raw);
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::DIVISION_BY_ZERO));
    assert!(!err.is_transient());

    sqlx::query("DROP SCHEMA events CASCADE").execute(&mut conn).await.expect("drop schema");
    let err = p.publish_sqlx(&mut conn, &event(agg, "Paid")).await.expect_err("unmigrated");
    assert!(matches!(err, Error::NotMigrated(_)), "{err:?}");
    assert!(err.to_string().contains("pg-outbox migrate"), "{err}");
    let err = p.publish_many_sqlx(&mut conn, &[event(agg, "Paid")]).await.expect_err("unmigrated");
    assert!(matches!(err, Error::NotMigrated(_)), "{err:?}");
    let mut tx = conn.begin().await.expect("begin");
    let err = p.publish_sqlx(&mut *tx, &event(agg, "Paid")).await.expect_err("unmigrated in a transaction");
    assert!(matches!(err, Error::NotMigrated(_)), "{err:?}");
    tx.rollback().await.expect("rollback");
}

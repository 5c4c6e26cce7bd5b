//! Ordering modes (triggers/outbox_insert_order_and_notify.sql, "Ordering
//! modes"): in `producer-locked`, producers that lock their aggregate's row
//! first keep order without the outbox's own lock, producers that do not can
//! have an aggregate's events delivered out of order (the documented
//! caveat), the insert path calls no function while every relay is busy,
//! and switching is idempotent, kept by `migrate`, and waits for running
//! producers.

use std::collections::HashMap;
use std::time::Duration;

use pg_outbox::EventStream;
use pg_outbox::migrate::{self, OrderingMode};
use uuid::Uuid;

use crate::consumer::{next, start};
use crate::relay_proc;
use crate::support::{DbCli, TestDb};

async fn set(db: &TestDb, mode: OrderingMode) -> Option<OrderingMode> {
    migrate::set_ordering(&db.options(), mode).await.expect("set ordering")
}

/// Calls of `events.outbox_wake()` made by this session's current
/// transaction (`track_functions` must be `pl` or `all`).
async fn wake_calls(tx: &tokio_postgres::Transaction<'_>) -> i64 {
    tx.query_one(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_xact_user_functions \
         WHERE schemaname = 'events' AND funcname = 'outbox_wake'",
        &[],
    )
    .await
    .expect("function stats")
    .get(0)
}

/// The schema's domain table, `billing.subscriptions`, with a row for each
/// of `n` new aggregates; their ids.
pub(crate) async fn subscriptions(c: &tokio_postgres::Client, n: usize) -> Vec<Uuid> {
    c.batch_execute(
        "CREATE SCHEMA billing; \
         CREATE TABLE billing.subscriptions (id uuid PRIMARY KEY, version int NOT NULL DEFAULT 0)",
    )
    .await
    .expect("domain table");
    let aggregates: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    for a in &aggregates {
        c.execute("INSERT INTO billing.subscriptions (id) VALUES ($1)", &[a]).await.expect("aggregate row");
    }
    aggregates
}

/// One producer per client in `clients`, `per_producer` transactions each
/// on `aggregates` in turn: each bumps its aggregate's version under the
/// row lock (the schema's flow, the producer-locked contract), inserts the
/// event carrying that version, and lingers before COMMIT so that
/// transactions of one aggregate overlap. Returns when all committed.
pub(crate) async fn locking_producers(clients: Vec<tokio_postgres::Client>, aggregates: &[Uuid], per_producer: usize) {
    let mut tasks = Vec::new();
    for (p, mut c) in clients.into_iter().enumerate() {
        let aggregates = aggregates.to_vec();
        tasks.push(tokio::spawn(async move {
            for i in 0..per_producer {
                let agg = aggregates[(p + i) % aggregates.len()];
                let tx = c.transaction().await.expect("begin");
                let version: i32 = tx
                    .query_one(
                        "UPDATE billing.subscriptions SET version = version + 1 WHERE id = $1 RETURNING version",
                        &[&agg],
                    )
                    .await
                    .expect("lock the aggregate's row")
                    .get(0);
                tx.execute(
                    "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ('subscription', $1, 'Changed', jsonb_build_object('version', $2::int))",
                    &[&agg, &version],
                )
                .await
                .expect("insert event");
                tx.batch_execute("SELECT pg_sleep(random() * 0.003)").await.expect("linger");
                tx.commit().await.expect("commit");
            }
        }));
    }
    for t in tasks {
        t.await.expect("producer");
    }
}

/// Receive `total` events of [`locking_producers`] from `stream` (each
/// within `secs`), acknowledge them, and check that each aggregate's come
/// in id order with versions 1, 2, 3, ... and none missing.
pub(crate) async fn assert_versions_in_order(stream: &mut EventStream, total: usize, secs: u64) {
    let mut seen: HashMap<Uuid, (i64, i64)> = HashMap::new();
    for _ in 0..total {
        let d = next(stream, secs).await;
        let version = d.payload["version"].as_i64().expect("version in payload");
        let (last_id, last_version) = seen.entry(d.aggregate_id).or_insert((0, 0));
        assert!(d.id > *last_id, "aggregate {}: id {} delivered after id {}", d.aggregate_id, d.id, last_id);
        assert_eq!(version, *last_version + 1, "aggregate {}: version {version} after {last_version}", d.aggregate_id);
        *last_id = d.id;
        *last_version = version;
        d.ack();
    }
    let delivered: i64 = seen.values().map(|(_, v)| *v).sum();
    assert_eq!(delivered, i64::try_from(total).expect("total"), "every committed event delivered once, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_locked_mode_keeps_order_for_producers_that_lock_their_aggregate_first() {
    let db = TestDb::new("producer_locked_order").await;
    assert_eq!(set(&db, OrderingMode::ProducerLocked).await, Some(OrderingMode::OutboxLocked));
    let aggregates = subscriptions(&db.client().await, 4).await;
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(200))).await;
    // 8 producers, 40 transactions each, on 4 aggregates.
    let (producers, per_producer) = (8, 40);
    let mut clients = Vec::new();
    for _ in 0..producers {
        clients.push(db.client().await);
    }
    locking_producers(clients, &aggregates, per_producer).await;
    assert_versions_in_order(&mut stream, producers * per_producer, 30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_locked_mode_delivers_out_of_order_when_producers_do_not_lock() {
    // The documented caveat is real: nobody should pick this mode by accident.
    let db = TestDb::new("producer_locked_caveat").await;
    set(&db, OrderingMode::ProducerLocked).await;
    let agg = Uuid::new_v4();
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(100))).await;
    let insert = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ('acct', $1, $2, '{}') RETURNING id";

    // T1 draws the lower id and stays open; T2, writing the same aggregate
    // without locking anything first, is not kept waiting: it draws the
    // higher id and commits first.
    let mut c1 = db.client().await;
    let t1 = c1.transaction().await.expect("t1");
    let first: i64 = t1.query_one(insert, &[&agg, &"first"]).await.expect("insert t1").get(0);
    let mut c2 = db.client().await;
    let t2 = c2.transaction().await.expect("t2");
    let second: i64 = tokio::time::timeout(Duration::from_secs(5), t2.query_one(insert, &[&agg, &"second"]))
        .await
        .expect("without the outbox's lock the second writer does not wait")
        .expect("insert t2")
        .get(0);
    assert!(second > first);
    t2.commit().await.expect("commit t2");

    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.event_type.as_str()), (second, "second"), "the later event arrives first");
    d.ack();
    t1.commit().await.expect("commit t1");
    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.event_type.as_str()), (first, "first"), "the earlier event arrives after it");
    d.ack();
}

/// With the hint set to `hint`, a transaction of two 3-row insert
/// statements in a new session: how many times it called
/// `events.outbox_wake()`. (A new session each time: a backend's function
/// counts stay pending, and in `pg_stat_xact_user_functions`, until it
/// flushes them, which may be after several transactions.)
async fn wake_calls_of_two_statements(db: &TestDb, hint: i64) -> i64 {
    let mut c = db.client().await;
    c.batch_execute("SET track_functions = 'pl'").await.expect("track functions");
    c.query_one("SELECT setval('events.outbox_hint', $1)", &[&hint]).await.expect("hint");
    let insert = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                  SELECT 'acct', gen_random_uuid(), 'E', '{}' FROM generate_series(1, 3)";
    let tx = c.transaction().await.expect("tx");
    tx.execute(insert, &[]).await.expect("insert");
    tx.execute(insert, &[]).await.expect("insert");
    let calls = wake_calls(&tx).await;
    tx.commit().await.expect("commit");
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_locked_insert_path_calls_no_function_while_every_relay_is_busy() {
    let db = TestDb::new("producer_locked_wake").await;
    set(&db, OrderingMode::ProducerLocked).await;
    // Hint 0 (every relay busy, no bulk transaction) and 2 (bulk bit only):
    // no call at all.
    assert_eq!(wake_calls_of_two_statements(&db, 0).await, 0, "hint 0: the wake-up function is not called");
    assert_eq!(wake_calls_of_two_statements(&db, 2).await, 0, "hint 2: the wake-up function is not called");
    // Bit 1 set (a relay waits): one call per statement, not per row.
    assert_eq!(wake_calls_of_two_statements(&db, 1).await, 2, "hint 1: one call per statement");
    assert_eq!(wake_calls_of_two_statements(&db, 3).await, 2, "hint 3: one call per statement");

    let c = db.client().await;
    let r = c.query_one("SELECT count(*), min(id), max(id) FROM events.outbox", &[]).await.expect("ids");
    let (n, lo, hi): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
    assert_eq!(n, 24);
    // Ids come from the column's default in this mode: no second id drawn.
    assert_eq!(hi - lo + 1, 24, "ids {lo}..={hi} are dense");

    // The outbox-locked mode's trigger runs for every row instead.
    set(&db, OrderingMode::OutboxLocked).await;
    assert_eq!(wake_calls_of_two_statements(&db, 1).await, 0, "outbox-locked: the wake trigger is disabled");
}

/// Insert one event of a new aggregate in `tx`.
async fn insert_one(tx: &tokio_postgres::Transaction<'_>) {
    tx.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', $1, 'E', '{}')",
        &[&Uuid::new_v4()],
    )
    .await
    .expect("insert");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_modes_is_idempotent_kept_by_migrate_and_waits_for_running_producers() {
    let db = TestDb::new("ordering_switch").await;
    let c = db.client().await;
    assert_eq!(migrate::ordering(&c).await.expect("mode"), Some(OrderingMode::OutboxLocked), "new databases");
    assert_eq!(set(&db, OrderingMode::ProducerLocked).await, Some(OrderingMode::OutboxLocked));
    assert_eq!(set(&db, OrderingMode::ProducerLocked).await, Some(OrderingMode::ProducerLocked), "idempotent");
    assert_eq!(pg_outbox::status::read(&c).await.expect("status").ordering, Some(OrderingMode::ProducerLocked));

    // Re-running every file (as an upgrade does) keeps the mode.
    c.batch_execute("DELETE FROM events.outbox_schema_migrations WHERE name LIKE 'triggers/%'").await.expect("forget");
    let report = migrate::apply(&db.options()).await.expect("migrate");
    assert!(report.applied.iter().any(|f| f == "triggers/outbox_insert_order_and_notify"), "{report:?}");
    assert_eq!(migrate::ordering(&c).await.expect("mode"), Some(OrderingMode::ProducerLocked), "kept by migrate");

    // A producer transaction that has written an event holds the switch
    // back until it ends; its event and the next ones are all there.
    let mut p = db.client().await;
    let tx = p.transaction().await.expect("producer tx");
    insert_one(&tx).await;
    let options = db.options();
    let switch = tokio::spawn(async move { migrate::set_ordering(&options, OrderingMode::OutboxLocked).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!switch.is_finished(), "the switch waits for the running producer");
    tx.commit().await.expect("commit");
    let before = tokio::time::timeout(Duration::from_secs(10), switch)
        .await
        .expect("the switch ends once the producer committed")
        .expect("join")
        .expect("switch");
    assert_eq!(before, Some(OrderingMode::ProducerLocked));
    assert_eq!(migrate::ordering(&c).await.expect("mode"), Some(OrderingMode::OutboxLocked));

    // A producer that keeps its transaction open longer than 5 s makes the
    // switch fail with lock_not_available, changing nothing.
    let tx = p.transaction().await.expect("producer tx");
    insert_one(&tx).await;
    // Installing the installed mode takes no lock: it returns at once.
    let unchanged = tokio::time::timeout(Duration::from_secs(2), set(&db, OrderingMode::OutboxLocked))
        .await
        .expect("a switch to the installed mode does not wait for producers");
    assert_eq!(unchanged, Some(OrderingMode::OutboxLocked));
    let err = migrate::set_ordering(&db.options(), OrderingMode::ProducerLocked).await.expect_err("lock timeout");
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE), "{err:?}");
    tx.commit().await.expect("commit");
    assert_eq!(migrate::ordering(&c).await.expect("mode"), Some(OrderingMode::OutboxLocked), "unchanged");

    // Neither trigger enabled: reported as none.
    c.batch_execute("ALTER TABLE events.outbox DISABLE TRIGGER outbox_order").await.expect("disable");
    assert_eq!(migrate::ordering(&c).await.expect("mode"), None);
    assert_eq!(set(&db, OrderingMode::OutboxLocked).await, None);
    let n: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert_eq!(n, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_switches_reports_and_refuses_unknown_modes() {
    let db = TestDb::new("ordering_cli").await;
    let out = db.cli(&["migrate", "--ordering", "producer-locked"]).run().await;
    assert!(out.ok(), "{out:?}");
    assert!(out.stderr.contains("ordering mode: producer-locked (was outbox-locked)"), "{}", out.stderr);
    assert!(out.stderr.contains("locks a row of its own"), "the caveat is printed: {}", out.stderr);
    let out = db.cli(&["migrate"]).run().await;
    assert!(
        out.ok() && out.stderr.contains("ordering mode: producer-locked (kept; change it with --ordering)"),
        "{out:?}"
    );
    let out = db.cli(&["status"]).run().await;
    assert!(out.ok() && out.stdout.contains("ordering mode       producer-locked"), "{out:?}");
    let mut relay = relay_proc::start(&db, &["--sink", "stdout"]).await;
    relay.wait_for_signal(&["ordering"]).await;
    let line = relay.signal_line("ordering");
    assert!(line.contains("ordering=producer-locked"), "{line}");
    relay.stop().await;
    let out = db.cli(&["status", "--json"]).run().await;
    let json: serde_json::Value = serde_json::from_str(&out.stdout).expect("status json");
    assert_eq!(json["ordering"], "producer-locked");
    let out = db.cli(&["migrate", "--ordering", "outbox-locked"]).run().await;
    assert!(out.ok() && out.stderr.contains("ordering mode: outbox-locked (was producer-locked)"), "{out:?}");
    // A switch that producers hold back for 5 s fails, saying what happened
    // and what to do.
    let mut p = db.client().await;
    let tx = p.transaction().await.expect("producer tx");
    insert_one(&tx).await;
    let out = db.cli(&["migrate", "--ordering", "producer-locked"]).run().await;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("could not switch the ordering mode to producer-locked"), "{}", out.stderr);
    assert!(
        out.stderr.contains("nothing changed: run `pg-outbox migrate --ordering producer-locked` again"),
        "{}",
        out.stderr
    );
    let out = db.cli(&["migrate", "--ordering", "outbox-locked"]).run().await;
    assert!(out.ok() && out.stderr.contains("ordering mode: outbox-locked (unchanged)"), "{out:?}");
    tx.commit().await.expect("commit");
    let out = db.cli(&["migrate", "--ordering", "none"]).run().await;
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("invalid value 'none' for '--ordering <MODE>'"), "{}", out.stderr);
    assert!(out.stderr.contains("producer-locked"), "the accepted values are listed: {}", out.stderr);
}

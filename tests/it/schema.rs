//! Schema: the seeded table as a contract, idempotent migrations, the
//! invariant guard, and the statement-level notify trigger.

use std::time::Duration;

use futures::StreamExt;
use tokio_postgres::{AsyncMessage, NoTls};

use crate::support::{DbCli, TestDb, insert_seed_events};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_columns_defaults_check_and_index_names_are_exact() {
    let db = TestDb::new("seeded_columns").await;
    let c = db.client().await;
    let cols: Vec<(String, String, Option<String>, String)> = c
        .query(
            "SELECT column_name::text, data_type::text, column_default::text, is_nullable::text \
             FROM information_schema.columns WHERE table_schema = 'events' AND table_name = 'outbox' \
             ORDER BY ordinal_position",
            &[],
        )
        .await
        .expect("columns")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let names: Vec<&str> = cols.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "occurred_at",
            "published_at",
            "retry_count",
            "last_error",
            "next_retry_at"
        ]
    );
    let ty = |n: &str| cols.iter().find(|c| c.0 == n).map(|c| (c.1.clone(), c.2.clone(), c.3.clone())).expect(n);
    assert_eq!(ty("id").0, "bigint");
    assert!(ty("id").1.unwrap_or_default().starts_with("nextval("));
    assert_eq!(ty("aggregate_id").0, "uuid");
    assert_eq!(ty("payload").0, "jsonb");
    assert_eq!(ty("occurred_at"), ("timestamp with time zone".into(), Some("now()".into()), "NO".into()));
    assert_eq!(ty("published_at").2, "YES");
    assert_eq!(ty("retry_count"), ("integer".into(), Some("0".into()), "NO".into()));
    assert_eq!(ty("next_retry_at").0, "timestamp with time zone");

    let indexes: Vec<String> = c
        .query("SELECT indexname::text FROM pg_indexes WHERE schemaname = 'events' AND tablename = 'outbox'", &[])
        .await
        .expect("indexes")
        .iter()
        .map(|r| r.get(0))
        .collect();
    for seeded in [
        "outbox_pkey",
        "outbox_unpublished_idx",
        "outbox_retry_due_idx",
        "outbox_aggregate_idx",
        "outbox_event_type_occurred_idx",
    ] {
        assert!(indexes.iter().any(|i| i == seeded), "missing {seeded} in {indexes:?}");
    }
    let check: String = c
        .query_one(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'outbox_retry_nonneg' AND conrelid = 'events.outbox'::regclass",
            &[],
        )
        .await
        .expect("check constraint")
        .get(0);
    assert_eq!(check, "CHECK ((retry_count >= 0))");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_twice_is_a_no_op_and_seed_only_producer_works() {
    let db = TestDb::new("migrate_twice").await;
    let c = db.client().await;
    // The template was migrated already: applying again changes nothing.
    let report = pg_outbox::migrate::apply(&db.options()).await.expect("migrate again");
    assert!(report.applied.is_empty(), "second migrate applied {:?}", report.applied);
    pg_outbox::migrate::check(&c).await.expect("check");
    // A producer that knows only the seed's four columns.
    let id: i64 = c
        .query_one(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('subscription', gen_random_uuid(), 'PaymentSucceeded', '{\"version\":1,\"data\":{}}') RETURNING id",
            &[],
        )
        .await
        .expect("seed insert")
        .get(0);
    let row = c
        .query_one(
            "SELECT retry_count, published_at IS NULL, next_retry_at IS NULL FROM events.outbox WHERE id = $1",
            &[&id],
        )
        .await
        .expect("row");
    assert_eq!((row.get::<_, i32>(0), row.get::<_, bool>(1), row.get::<_, bool>(2)), (0, true, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_files_run_with_psql_twice() {
    // The files are plain SQL for `psql -f`.
    let Some(psql) = crate::needs::program(&crate::needs::PSQL) else { return };
    let db = TestDb::new("psql_files").await;
    let c = db.client().await;
    c.batch_execute("DROP SCHEMA events CASCADE").await.expect("drop schema");
    let root = env!("CARGO_MANIFEST_DIR");
    let mut files: Vec<String> = Vec::new();
    for dir in ["migrations", "triggers"] {
        let mut fs: Vec<String> = std::fs::read_dir(format!("{root}/{dir}"))
            .expect("read dir")
            .map(|e| e.expect("entry").path().display().to_string())
            .collect();
        fs.sort();
        files.extend(fs);
    }
    // triggers/ must come after migrations/ (guard, notify, order, unblock: any order works).
    for round in 0..2 {
        for f in &files {
            let out = std::process::Command::new(&psql)
                .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &db.url(), "-f", f])
                .output()
                .expect("run psql");
            assert!(
                out.status.success(),
                "round {round}: psql -f {f} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let triggers: Vec<(String, bool)> = c
        .query(
            "SELECT tgname::text, tgenabled <> 'D' FROM pg_trigger \
             WHERE tgrelid = 'events.outbox'::regclass AND NOT tgisinternal ORDER BY tgname",
            &[],
        )
        .await
        .expect("triggers")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let expected = [
        ("outbox_guard", true),
        ("outbox_order", true),
        ("outbox_rewind", true),
        ("outbox_rewind_insert", true),
        ("outbox_unblock", true),
        ("outbox_unblock_delete", true),
        ("outbox_wake", false),
    ]
    .map(|(n, e)| (n.to_string(), e))
    .to_vec();
    assert_eq!(
        triggers, expected,
        "the guard, both insert triggers, the rewind and the unblock triggers, once each, the outbox-locked mode enabled"
    );
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'events.outbox_relays'::regclass AND NOT tgisinternal",
            &[],
        )
        .await
        .expect("relay triggers")
        .get(0);
    assert_eq!(n, 1, "exactly the hint refresh on events.outbox_relays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_reject_unpublishing_and_lowering_retry_count() {
    let db = TestDb::new("invariants").await;
    let c = db.client().await;
    let id = insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await[0];
    c.execute("UPDATE events.outbox SET retry_count = 3, published_at = now() WHERE id = $1", &[&id])
        .await
        .expect("valid update");

    let e = c
        .execute("UPDATE events.outbox SET published_at = NULL WHERE id = $1", &[&id])
        .await
        .expect_err("unpublish must fail");
    let db_err = e.as_db_error().expect("db error");
    assert_eq!(db_err.code(), &tokio_postgres::error::SqlState::CHECK_VIOLATION);
    assert!(db_err.message().contains("published_at cannot go back to NULL"), "{}", db_err.message());

    let e = c
        .execute("UPDATE events.outbox SET retry_count = 2 WHERE id = $1", &[&id])
        .await
        .expect_err("lowering must fail");
    assert!(e.as_db_error().expect("db error").message().contains("retry_count cannot decrease"));

    let e = c.execute("UPDATE events.outbox SET retry_count = -1 WHERE id = $1", &[&id]).await.expect_err("negative");
    assert_eq!(e.code(), Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION));

    let e = c
        .execute(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', gen_random_uuid(), 'b', 'not json')",
            &[],
        )
        .await
        .expect_err("non-JSON payload");
    assert_eq!(e.code(), Some(&tokio_postgres::error::SqlState::INVALID_TEXT_REPRESENTATION));

    let row = c
        .query_one("SELECT retry_count, published_at IS NOT NULL FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("row");
    assert_eq!((row.get::<_, i32>(0), row.get::<_, bool>(1)), (3, true));
}

/// The rewind triggers (triggers/outbox_rewind.sql) count a transaction
/// once, whatever its rows: a replica-role load of 10 000 rows runs the
/// function for its first row only (`EXPLAIN ANALYZE` counts the trigger's
/// calls), so do 10 000 rows made fresh again in one statement, and a
/// savepoint rolled back takes its bump and its mark with it. Producers'
/// inserts and acknowledgements count nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewinds_are_counted_once_per_transaction_and_producers_count_none() {
    let db = TestDb::new("rewind_count").await;
    let c = db.client().await;
    let count = async || -> i64 {
        c.query_one("SELECT coalesce((SELECT term FROM events.outbox_terms WHERE scope = 'rewind'), 0)", &[])
            .await
            .expect("the rewind count")
            .get(0)
    };
    // The trigger's calls in an EXPLAIN (ANALYZE, FORMAT JSON) of `sql`.
    let calls = async |sql: &str, trigger: &str| -> i64 {
        let plan: serde_json::Value =
            c.query_one(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}"), &[]).await.expect("explain").get(0);
        // A trigger never called is not listed.
        plan[0]["Triggers"].as_array().into_iter().flatten().find(|t| t["Trigger Name"] == trigger).map_or(0, |t| {
            t["Calls"].as_i64().unwrap_or_else(|| panic!("the calls of {trigger} in {}", plan[0]["Triggers"]))
        })
    };
    let load = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                SELECT 'load', gen_random_uuid(), 'Loaded', '{}' FROM generate_series(1, 10000)";
    assert_eq!(calls(load, "outbox_rewind_insert").await, 0, "a producer's insert does not run it");
    c.batch_execute("UPDATE events.outbox SET published_at = now()").await.expect("publish");
    assert_eq!(count().await, 0, "producers' inserts and acknowledgements count nothing");
    c.batch_execute("SET session_replication_role = replica").await.expect("replica role");
    assert_eq!(calls(load, "outbox_rewind_insert").await, 1, "a replica-role load runs it for its first row");
    assert_eq!(count().await, 1);
    let unpublish = "UPDATE events.outbox SET published_at = NULL WHERE published_at IS NOT NULL";
    assert_eq!(calls(unpublish, "outbox_rewind").await, 1, "10 000 rows made fresh: one call");
    assert_eq!(count().await, 2);
    c.batch_execute(
        "BEGIN; SAVEPOINT s; \
         UPDATE events.outbox SET published_at = now() WHERE published_at IS NULL; \
         UPDATE events.outbox SET published_at = NULL; \
         ROLLBACK TO SAVEPOINT s; \
         UPDATE events.outbox SET published_at = now() WHERE id IN (SELECT id FROM events.outbox LIMIT 3); \
         UPDATE events.outbox SET published_at = NULL WHERE published_at IS NOT NULL; \
         COMMIT",
    )
    .await
    .expect("a rewind rolled back to a savepoint, then one kept");
    assert_eq!(count().await, 3, "the rolled-back rewind took its mark with it, the next one counted");
    c.batch_execute("RESET session_replication_role").await.expect("origin role");
    c.batch_execute("UPDATE events.outbox SET published_at = now()").await.expect("publish");
    assert_eq!(count().await, 3, "acknowledgements count nothing");
    // A plain ENABLE (as `pg_restore --disable-triggers` ends with) makes the
    // insert trigger fire on ordinary sessions: its WHEN clause still keeps
    // producers from counting (and from taking turns on the count's row).
    c.batch_execute("ALTER TABLE events.outbox ENABLE TRIGGER outbox_rewind_insert").await.expect("plain enable");
    c.batch_execute(load).await.expect("a producer's load");
    assert_eq!(count().await, 3, "producers count nothing whatever the trigger's enable state");
}

/// Count notifications on "events.outbox" received by a plain listener
/// while `work` runs.
async fn count_notifications<F: std::future::Future<Output = ()>>(db: &TestDb, work: F) -> (usize, Vec<String>) {
    let (client, mut conn) = db.pg.connect(NoTls).await.expect("connect listener");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driver = tokio::spawn(async move {
        let mut s = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = s.next().await {
            if let AsyncMessage::Notification(n) = m {
                let _ = tx.send(n.payload().to_string());
            }
        }
    });
    client.batch_execute("LISTEN \"events.outbox\"").await.expect("listen");
    work.await;
    // Let stragglers arrive (a liveness wait, not a timing assertion).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut payloads = Vec::new();
    while let Ok(p) = rx.try_recv() {
        payloads.push(p);
    }
    driver.abort();
    (payloads.len(), payloads)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_fires_once_per_transaction_with_a_tiny_payload() {
    let db = TestDb::new("notify_transaction").await;
    let mut c = db.client().await;
    let big = "x".repeat(10_000);
    let (n, payloads) = count_notifications(&db, async {
        // One statement, 1000 rows, each payload larger than NOTIFY's 8000-byte limit.
        c.execute(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'a', gen_random_uuid(), 'e', jsonb_build_object('blob', $1::text) FROM generate_series(1, 1000)",
            &[&big],
        )
        .await
        .expect("bulk insert");
    })
    .await;
    assert_eq!(n, 1, "one notification for one transaction: {payloads:?}");
    assert!(payloads.iter().all(|p| p.len() < 100));

    // Several statements in one transaction: still one.
    let (n, _) = count_notifications(&db, async {
        let tx = c.transaction().await.expect("tx");
        for _ in 0..3 {
            tx.execute(
                "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', gen_random_uuid(), 'e', '{}')",
                &[],
            )
            .await
            .expect("insert");
        }
        tx.commit().await.expect("commit");
    })
    .await;
    assert_eq!(n, 1, "one notification for a transaction of three statements");

    // Rolled back: no notification at all.
    let (n, _) = count_notifications(&db, async {
        c.batch_execute(
            "BEGIN; INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', gen_random_uuid(), 'e', '{}'); ROLLBACK;",
        )
        .await
        .expect("rolled back insert");
    })
    .await;
    assert_eq!(n, 0, "a rolled-back insert must wake nobody");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_skip_notify_while_every_relay_is_busy() {
    let db = TestDb::new("notify_when_idle").await;
    let c = db.client().await;
    let insert = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', gen_random_uuid(), 'e', '{}')";
    // A registered relay that is draining (not waiting): no notification.
    c.execute("INSERT INTO events.outbox_relays (pid, waiting) VALUES (pg_backend_pid(), false)", &[])
        .await
        .expect("busy relay");
    let (n, _) = count_notifications(&db, async {
        c.execute(insert, &[]).await.expect("insert");
    })
    .await;
    assert_eq!(n, 0, "a busy relay polls; producers need not notify");
    // The relay goes idle and asks for wake-ups: producers notify again.
    c.execute("UPDATE events.outbox_relays SET waiting = true", &[]).await.expect("idle relay");
    let (n, _) = count_notifications(&db, async {
        c.execute(insert, &[]).await.expect("insert");
    })
    .await;
    assert_eq!(n, 1);
    // No relay registered at all (another kind of consumer): always notify.
    c.execute("DELETE FROM events.outbox_relays", &[]).await.expect("no relay");
    let (n, _) = count_notifications(&db, async {
        c.execute(insert, &[]).await.expect("insert");
    })
    .await;
    assert_eq!(n, 1);
}

/// Three `pg-outbox migrate` runs at once on an empty database all succeed:
/// the ones that wait for the migration lock must not sit in a transaction
/// that the holder's `CREATE INDEX CONCURRENTLY` waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrate_runs_do_not_deadlock() {
    let db = TestDb::new("migrate_concurrent").await;
    let c = db.client().await;
    c.batch_execute("DROP SCHEMA events CASCADE").await.expect("start from an empty database");
    let runs: Vec<_> = (0..3).map(|_| db.cli(&["migrate"]).run()).collect();
    for out in futures::future::join_all(runs).await {
        assert!(out.ok(), "migrate failed: {}", out.stderr);
    }
    pg_outbox::migrate::check(&c).await.expect("the schema is complete");
}

//! A named subscription in competing mode: its consumers claim events with
//! advisory locks of the subscription's own class (not the rows, which are
//! the default's), deliver each event once in a clean run whatever the
//! racing producers, move the subscription's cursor to the end, hold
//! nothing back behind a failed event, and lose nothing when their
//! sessions are cut mid-claim.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use pg_outbox::Mode;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::consumer::{fast_retries, next, start};
use crate::modes::{Log, spawn_reader};
use crate::subscriptions::create;
use crate::support::{TestDb, eventually, insert_seed_events};

/// The subscription's cursor reached `last` with nothing settled above it.
async fn cursor_reaches(c: &Client, name: &str, last: i64) {
    eventually(15, "the cursor to reach the last event", || async {
        let row = c
            .query_one(
                "SELECT cursor_id, cardinality(settled) FROM events.outbox_subscriptions WHERE name = $1",
                &[&name],
            )
            .await
            .expect("cursor");
        (row.get::<_, i64>(0), row.get::<_, i32>(1)) == (last, 0)
    })
    .await;
}

/// Producers on their own sessions, each inserting `per` events over a few
/// aggregates in transactions of one to three events; the ids committed.
async fn produce(db: &TestDb, producers: usize, per: usize) -> Vec<i64> {
    let mut tasks = Vec::new();
    for _ in 0..producers {
        let mut pc = db.client().await;
        tasks.push(tokio::spawn(async move {
            let aggs: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
            let mut ids = Vec::new();
            while ids.len() < per {
                let tx = pc.transaction().await.expect("tx");
                for _ in 0..(1 + ids.len() % 3).min(per - ids.len()) {
                    let id: i64 = tx
                        .query_one(
                            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                             VALUES ('order', $1, 'OrderPlaced', '{}') RETURNING id",
                            &[&aggs[ids.len() % 4]],
                        )
                        .await
                        .expect("insert")
                        .get(0);
                    ids.push(id);
                }
                tx.commit().await.expect("commit");
            }
            ids
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("producer"));
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_readers_of_a_subscription_deliver_each_event_once_and_move_its_cursor_to_the_end() {
    let db = TestDb::new("sub_competing").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let log: Log = Arc::default();
    let mut readers = Vec::new();
    for i in 0..3 {
        let s = start(&db, |b| b.subscription("audit").mode(Mode::Competing).batch_size(10)).await;
        readers.push((s.shutdown_handle(), spawn_reader(s, i, log.clone())));
    }
    let committed = produce(&db, 4, 150).await;
    eventually(30, "every event delivered", || async { log.lock().expect("log").len() >= committed.len() }).await;
    // A moment more: a second delivery of any event would show now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let last = committed.iter().copied().max().expect("events");
    cursor_reaches(&c, "audit", last).await;
    let listed = pg_outbox::subscription::get(&c, "audit").await.expect("the subscription");
    assert_eq!((listed.competing, listed.leader.is_none()), (3, true), "list shows the competing readers");
    // Idle competing readers (no claim held) are still seen: a single or
    // partitioned reader of the subscription is refused beside them.
    for mode in [Mode::Single, Mode::Partitioned { partitions: 4 }] {
        let e = pg_outbox::Consumer::builder(db.options())
            .subscription("audit")
            .mode(mode)
            .start()
            .await
            .expect_err("beside idle competing readers")
            .to_string();
        assert!(e.contains("subscription \"audit\" as competing"), "{mode:?}: {e}");
    }
    for (h, r) in readers {
        h.shutdown();
        r.await.expect("reader");
    }
    let log = log.lock().expect("log").clone();
    let ids: Vec<i64> = log.iter().map(|e| e.1).collect();
    assert_eq!(ids.len(), committed.len(), "each event exactly once in a clean run");
    assert_eq!(ids.iter().copied().collect::<HashSet<_>>(), committed.iter().copied().collect::<HashSet<_>>());
    let shares: HashSet<usize> = log.iter().map(|e| e.0).collect();
    assert!(shares.len() >= 2, "the readers shared the events: {shares:?}");
    let untouched: i64 = c
        .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL AND retry_count = 0", &[])
        .await
        .expect("default")
        .get(0);
    assert_eq!(untouched, committed.len() as i64, "the default subscription's columns are its own");
    let failures: i64 =
        c.query_one("SELECT count(*) FROM events.outbox_subscription_failures", &[]).await.expect("failures").get(0);
    assert_eq!(failures, 0);
}

/// Competing mode holds nothing back: a failed event is retried while its
/// aggregate's later events are delivered, it becomes a dead letter at the
/// subscription's limit, and an event the cursor passed behind a dead
/// letter (held, as single mode keeps it) is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_competing_reader_retries_without_holding_back_and_delivers_what_single_mode_would_hold() {
    let db = TestDb::new("sub_competing_fail").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let a = Uuid::new_v4();
    let ids = insert_seed_events(&c, a, 3).await;
    let mut s =
        start(&db, |b| b.subscription("audit").mode(Mode::Competing).max_retries(2).retry_policy(fast_retries(&[50])))
            .await;
    let first = next(&mut s, 20).await;
    assert_eq!((first.id, first.retry_count), (ids[0], 0));
    first.fail("audit store down");
    let mut later = Vec::new();
    for _ in 0..2 {
        let d = next(&mut s, 20).await;
        later.push(d.id);
        d.ack();
    }
    assert_eq!(later, ids[1..].to_vec(), "the aggregate's later events are not held back");
    let retry = next(&mut s, 20).await;
    assert_eq!((retry.id, retry.retry_count, retry.last_error.as_deref()), (ids[0], 1, Some("audit store down")));
    retry.fail("still down");
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(1000), s.next()).await {
        panic!("a dead letter was delivered again: {}", d.id);
    }
    cursor_reaches(&c, "audit", ids[2]).await;
    let dead = c
        .query_one(
            "SELECT id, retry_count, next_retry_at = 'infinity', last_error FROM events.outbox_subscription_failures \
             WHERE subscription = 'audit'",
            &[],
        )
        .await
        .expect("one failure row");
    assert_eq!(
        (dead.get::<_, i64>(0), dead.get::<_, i32>(1), dead.get::<_, bool>(2), dead.get::<_, String>(3)),
        (ids[0], 2, true, "still down".to_string())
    );
    // A held event behind the dead letter, as the cursor leaves it in
    // single mode: competing mode delivers it.
    let held = insert_seed_events(&c, a, 1).await[0];
    c.execute(
        "INSERT INTO events.outbox_subscription_failures (subscription, id, aggregate_type, aggregate_id) \
         SELECT 'audit', id, aggregate_type, aggregate_id FROM events.outbox WHERE id = $1",
        &[&held],
    )
    .await
    .expect("held row");
    c.execute("UPDATE events.outbox_subscriptions SET cursor_id = $1 WHERE name = 'audit'", &[&held])
        .await
        .expect("cursor past it");
    let d = next(&mut s, 20).await;
    assert_eq!((d.id, d.retry_count), (held, 0));
    d.ack();
    eventually(10, "the held row settled", || async {
        let n: i64 = c
            .query_one("SELECT count(*) FROM events.outbox_subscription_failures WHERE id = $1", &[&held])
            .await
            .expect("count")
            .get(0);
        n == 0
    })
    .await;
    s.finish().await.expect("finish");
    // A single-mode reader beside a competing one is refused while the
    // competing one holds a claim; the other way round, always.
    let single = start(&db, |b| b.subscription("audit")).await;
    let e = pg_outbox::Consumer::builder(db.options())
        .subscription("audit")
        .mode(Mode::Competing)
        .start()
        .await
        .expect_err("competing beside single")
        .to_string();
    assert!(e.contains("subscription \"audit\" as single") && e.contains("configured as competing"), "{e}");
    single.finish().await.expect("finish");
}

/// Readers' sessions terminated mid-claim, five times under load: what
/// they had claimed goes back (the claim transaction rolls back, its locks
/// with it) and is delivered; nothing is lost, and the cursor reaches the
/// end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_readers_whose_sessions_are_cut_mid_claim_lose_nothing() {
    let db = TestDb::new("sub_competing_cut").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let log: Log = Arc::default();
    let mut readers = Vec::new();
    for i in 0..2 {
        let mut s = start(&db, |b| {
            b.subscription("audit").mode(Mode::Competing).batch_size(20).reconnect_max_delay(Duration::from_millis(500))
        })
        .await;
        let log = log.clone();
        let h = s.shutdown_handle();
        readers.push((
            h,
            tokio::spawn(async move {
                while let Some(d) = s.next().await {
                    // A slow sink: claims stay open while the sessions are cut.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    log.lock().expect("log").push((i, d.id, d.aggregate_id));
                    d.ack();
                }
                let _ = s.finish().await;
            }),
        ));
    }
    let producing = {
        let pc = db.client().await;
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for round in 0..20 {
                let agg = Uuid::from_u128(round % 7 + 1);
                ids.extend(insert_seed_events(&pc, agg, 50).await);
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            ids
        })
    };
    let mut cut = 0;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        cut += c
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'pg-outbox drain' \
                   AND state = 'idle in transaction'",
                &[],
            )
            .await
            .expect("terminate")
            .get::<_, i64>(0);
    }
    let committed = producing.await.expect("producer");
    assert!(cut >= 1, "no claim was cut");
    let want: HashSet<i64> = committed.iter().copied().collect();
    eventually(60, "every event delivered", || async {
        let got: HashSet<i64> = log.lock().expect("log").iter().map(|e| e.1).collect();
        want.is_subset(&got)
    })
    .await;
    cursor_reaches(&c, "audit", committed.iter().copied().max().expect("events")).await;
    for (h, r) in readers {
        h.shutdown();
        r.await.expect("reader");
    }
    let n = log.lock().expect("log").len();
    eprintln!("sessions cut mid-claim: {cut}; deliveries {n} for {} events", committed.len());
}

/// The claim's two statements under `EXPLAIN (ANALYZE, BUFFERS)`, custom
/// and generic plans, batch 500: `audit` has 20 000 events above its
/// cursor and 3 000 failure rows at or below it (75 due, 75 held, the
/// rest dead letters and waiting retries), and 10 above it (failed while
/// an earlier event was in flight), measured never analyzed, analyzed, and
/// with statistics stale after 180 000 more events. The buffers stay under
/// a fixed bound and do not grow with the table, neither table is scanned,
/// and the claim locks exactly the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_touches_a_bounded_number_of_buffers_in_every_statistics_state() {
    let db = TestDb::new("sub_competing_plans").await;
    let c = db.client().await;
    c.batch_execute(
        "ALTER TABLE events.outbox SET (autovacuum_enabled = false); \
         ALTER TABLE events.outbox_subscription_failures SET (autovacuum_enabled = false);",
    )
    .await
    .expect("autovacuum off");
    crate::subscription_plans::load(&c, 23_000).await;
    c.batch_execute(
        "INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) \
           SELECT 'audit', 0, id FROM events.outbox ORDER BY id OFFSET 2999 LIMIT 1; \
         INSERT INTO events.outbox_subscription_failures \
           (subscription, id, aggregate_type, aggregate_id, retry_count, next_retry_at, last_error) \
         SELECT 'audit', o.id, o.aggregate_type, o.aggregate_id, CASE WHEN o.n % 40 = 2 THEN 0 ELSE 3 END, \
                CASE WHEN o.n % 40 = 2 THEN NULL WHEN o.n % 40 = 3 THEN now() - interval '1 second' \
                     WHEN o.n % 2 = 0 THEN 'infinity'::timestamptz ELSE now() + interval '1 hour' END, 'HTTP 500' \
         FROM (SELECT id, aggregate_type, aggregate_id, row_number() OVER (ORDER BY id) AS n \
               FROM events.outbox ORDER BY id LIMIT 3000) o; \
         INSERT INTO events.outbox_subscription_failures \
           (subscription, id, aggregate_type, aggregate_id, retry_count, next_retry_at, last_error) \
         SELECT 'audit', o.id, o.aggregate_type, o.aggregate_id, 1, now() + interval '1 hour', 'HTTP 500' \
         FROM events.outbox o ORDER BY o.id OFFSET 3000 + 100 LIMIT 10;",
    )
    .await
    .expect("the subscription and its failures");
    let version = crate::support::server_version_num(&c).await;
    let mut states = vec![measure_claim(&db, version, "never analyzed").await];
    c.batch_execute("ANALYZE").await.expect("analyze");
    states.push(measure_claim(&db, version, "analyzed").await);
    crate::subscription_plans::load(&c, 180_000).await;
    states.push(measure_claim(&db, version, "statistics stale").await);
    eprintln!("claim buffers (statement, plan: never analyzed / analyzed / stale): {states:?}");
    // Growth from 23 000 to 203 000 events: an index level more on each
    // descent (the rows' statement descends the primary key once per id).
    for (i, (name, generic, buffers)) in states[2].iter().enumerate() {
        let before = states[1][i].2;
        let growth = if *name == "subscription_claim" { 40 } else { 500 + 40 };
        assert!(*buffers <= before + growth, "{name} (generic {generic}): {buffers} buffers stale against {before}");
    }
}

/// Buffers of the claim's statements in one state: (statement, generic
/// plan, buffers); asserts the bounds.
async fn measure_claim(db: &TestDb, version: i32, state: &str) -> Vec<(&'static str, bool, i64)> {
    let (statements, class) = pg_outbox::subscription::claim_statements(version, "audit");
    let mut c = crate::support::plan_check_session(db).await;
    let mut out = Vec::new();
    for generic in [false, true] {
        let tx = c.transaction().await.expect("begin");
        if generic {
            tx.batch_execute("SET LOCAL plan_cache_mode = force_generic_plan").await.expect("generic plans");
        }
        let (batch, name, budget) = (500_i64, "audit", 16_i64 << 20);
        let claim = tx.prepare(&statements[0].1).await.expect("prepare the claim");
        let row = tx.query_one(&claim, &[&batch, &name, &class]).await.expect("claim");
        let ids: Vec<i64> = row.get("ids");
        let held: i64 = tx
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() \
                   AND classid = ($1::int4)::bigint::oid AND objsubid = 2",
                &[&class],
            )
            .await
            .expect("locks")
            .get(0);
        assert_eq!((ids.len(), held), (500, 500), "{state}: the claim locks exactly its batch");
        tx.rollback().await.expect("rollback");
        for (name_of, sql) in &statements {
            let tx = c.transaction().await.expect("begin");
            if generic {
                tx.batch_execute("SET LOCAL plan_cache_mode = force_generic_plan").await.expect("generic plans");
            }
            let explain = format!("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {sql}");
            let plan: serde_json::Value = if *name_of == "subscription_claim" {
                tx.query_one(&explain, &[&batch, &name, &class]).await
            } else {
                tx.query_one(&explain, &[&ids, &budget, &name]).await
            }
            .unwrap_or_else(|e| panic!("explain {name_of}: {e}"))
            .get(0);
            tx.rollback().await.expect("rollback");
            let top = &plan[0]["Plan"];
            let buffers = crate::support::plan_count(top, "Shared Hit Blocks")
                + crate::support::plan_count(top, "Shared Read Blocks");
            assert!(
                !seq_scans(top).iter().any(|r| r == "outbox" || r == "outbox_subscription_failures"),
                "{state}: {name_of} (generic {generic}) scans a table: {plan}"
            );
            // The claim: 500 locks over the due (75), held (75) and fresh
            // (350) walks, each a few index pages and their heap pages, and
            // a probe of the failure rows' primary key per fresh event.
            // The rows: a primary-key lookup per id in each table.
            let bound = if *name_of == "subscription_claim" { 1_500 } else { 3_500 };
            assert!(buffers <= bound, "{state}: {name_of} (generic {generic}) touched {buffers} buffers: {plan}");
            out.push((*name_of, generic, buffers));
        }
    }
    out
}

/// The relations a plan scans sequentially.
fn seq_scans(node: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    if node["Node Type"] == "Seq Scan" {
        out.push(node["Relation Name"].as_str().unwrap_or("").to_string());
    }
    for child in node["Plans"].as_array().into_iter().flatten() {
        out.extend(seq_scans(child));
    }
    out
}

/// A live competing reader whose sink takes longer than the 4 s the server
/// lets a claim sit idle keeps its claim: a keep-alive runs inside the
/// claim transaction, so the server does not end its session, and the
/// event is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_competing_reader_keeps_its_claim_however_slow_its_sink() {
    let db = TestDb::new("sub_competing_slow").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 2).await;
    let mut s = start(&db, |b| b.subscription("audit").mode(Mode::Competing)).await;
    let first = next(&mut s, 20).await;
    let before = crate::freeze::drain_pids(&c).await;
    let claim = |pid: i32| {
        let c = &c;
        async move {
            c.query_one("SELECT xact_start::text FROM pg_stat_activity WHERE pid = $1", &[&pid])
                .await
                .expect("the claim transaction")
                .get::<_, Option<String>>(0)
        }
    };
    let started = claim(before[0]).await;
    assert!(started.is_some(), "the claim is open while the event is out");
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(crate::freeze::drain_pids(&c).await, before, "the server ended a live reader's session");
    assert_eq!(claim(before[0]).await, started, "the same claim transaction, open all along");
    first.ack();
    let second = next(&mut s, 20).await;
    assert_eq!(vec![ids[0], second.id], ids, "each once, nothing delivered again");
    second.ack();
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(1500), s.next()).await {
        panic!("delivered again: {}", d.id);
    }
    s.finish().await.expect("finish");
}

/// A competing relay process of a subscription: it says when the
/// subscription is paused and resumed while it runs (signals
/// `subscription_paused`, `subscription_resumed`), delivers nothing while
/// paused, and everything after, each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_competing_relay_says_when_its_subscription_is_paused_and_resumed() {
    use tokio::io::AsyncBufReadExt;
    let db = TestDb::new("sub_competing_pause").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let (mut relay, stdout) = crate::relay_proc::start_with_stdout(
        &db,
        &["--sink", "stdout", "--subscription", "audit", "--mode", "competing"],
    )
    .await;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = insert_seed_events(&c, Uuid::new_v4(), 3).await;
    let mut got = Vec::new();
    while got.len() < first.len() {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
        let Ok(Ok(Some(line))) = line else { panic!("no record ({line:?}): {}", relay.log()) };
        let record: serde_json::Value = serde_json::from_str(&line).expect("a JSON record");
        got.push(record["id"].as_i64().expect("an id"));
    }
    assert_eq!(got, first, "stdout takes one at a time, in id order");
    pg_outbox::subscription::pause(&c, "audit").await.expect("pause");
    relay.wait_signal(&["subscription_paused"], Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let later = insert_seed_events(&c, Uuid::new_v4(), 2).await;
    if let Ok(Ok(Some(line))) = tokio::time::timeout(Duration::from_millis(1500), lines.next_line()).await {
        panic!("delivered while paused: {line}");
    }
    pg_outbox::subscription::resume(&c, "audit").await.expect("resume");
    relay.wait_signal(&["subscription_resumed"], Duration::from_secs(20)).await.unwrap_or_else(|e| panic!("{e}"));
    let mut after = Vec::new();
    while after.len() < later.len() {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
        let Ok(Ok(Some(line))) = line else { panic!("no record after resume ({line:?}): {}", relay.log()) };
        let record: serde_json::Value = serde_json::from_str(&line).expect("a JSON record");
        after.push(record["id"].as_i64().expect("an id"));
    }
    assert_eq!(after, later);
    assert!(
        relay.log().contains("mode=competing") || relay.log().contains("\"mode\":\"competing\""),
        "{}",
        relay.log()
    );
    relay.sigterm();
    assert!(relay.wait().await.success(), "the relay stops cleanly: {}", relay.log());
}

/// Two competing readers under load whose subscription is dropped: each
/// stops with `SubscriptionError::Unknown`, whichever statement of it (a
/// claim, or a settlement in its claim) finds the drop first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_readers_of_a_dropped_subscription_stop_with_its_name() {
    let db = TestDb::new("sub_competing_drop").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let mut readers = Vec::new();
    for _ in 0..2 {
        let mut s = start(&db, |b| b.subscription("audit").mode(Mode::Competing).batch_size(20)).await;
        readers.push(tokio::spawn(async move {
            while let Some(d) = s.next().await {
                tokio::time::sleep(Duration::from_millis(2)).await;
                d.ack();
            }
            s.finish().await
        }));
    }
    for _ in 0..10 {
        insert_seed_events(&c, Uuid::new_v4(), 50).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    pg_outbox::subscription::drop(&c, "audit").await.expect("drop");
    for r in readers {
        let ended = tokio::time::timeout(Duration::from_secs(20), r).await.expect("stopped").expect("reader");
        match ended {
            Err(pg_outbox::Error::Subscription(pg_outbox::error::SubscriptionError::Unknown(name))) => {
                assert_eq!(name, "audit");
            }
            other => panic!("a dropped subscription's competing reader ended with {other:?}"),
        }
    }
}

//! Subscriptions, the reading side: a named subscription reads every event
//! in id order beside the default one, with its own progress (a cursor that
//! never passes an event whose transaction commits late), its own retries,
//! hold-back and dead letters, and its own leader and term.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use pg_outbox::{EventStream, Mode};
use tokio_postgres::Client;
use uuid::Uuid;

use crate::consumer::{fast_retries, next, start};
use crate::support::{DbCli, TestDb, eventually, insert_seed_events};

/// Create subscription `name` reading from the first event on (as
/// `subscription create NAME --from earliest` on an empty outbox).
pub(crate) async fn create(c: &Client, name: &str) {
    c.execute("INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) VALUES ($1, 0, 0)", &[&name])
        .await
        .expect("create subscription");
}

/// The cursor of subscription `name`, and how many ids it keeps settled
/// above it.
async fn cursor(c: &Client, name: &str) -> (i64, i32) {
    let row = c
        .query_one("SELECT cursor_id, cardinality(settled) FROM events.outbox_subscriptions WHERE name = $1", &[&name])
        .await
        .expect("cursor");
    (row.get(0), row.get(1))
}

/// Acknowledge every delivery until `want` distinct ids were seen; returns
/// the ids in delivery order.
async fn ack_all(stream: &mut EventStream, want: usize) -> Vec<i64> {
    let mut seen = Vec::new();
    let mut distinct = HashSet::new();
    while distinct.len() < want {
        let d = next(stream, 20).await;
        seen.push(d.id);
        distinct.insert(d.id);
        d.ack();
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_reads_every_event_in_order_and_leaves_the_default_unpublished() {
    let db = TestDb::new("sub_reads").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut ids = insert_seed_events(&c, a, 30).await;
    ids.extend(insert_seed_events(&c, b, 30).await);
    let mut stream = start(&db, |bld| bld.subscription("audit").batch_size(7)).await;
    let seen = ack_all(&mut stream, ids.len()).await;
    assert_eq!(seen, ids, "one delivery each, in id order");
    // Idle now, the consumer moves the cursor past everything on its own
    // (a fetch that finds nothing passes the checkpoints of the ones
    // before): within a few sweeps.
    let last = *ids.last().expect("ids");
    eventually(15, "the idle subscription's cursor at its last event", || async {
        cursor(&c, "audit").await == (last, 0)
    })
    .await;
    stream.finish().await.expect("finish");
    let unpublished: i64 = c
        .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL AND retry_count = 0", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(unpublished, 60, "the default subscription has read nothing");
    let term: String = c
        .query_one("SELECT string_agg(scope, ',' ORDER BY scope) FROM events.outbox_terms", &[])
        .await
        .expect("terms")
        .get(0);
    assert_eq!(term, "subscription:audit", "the subscription's own term, not the outbox's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_holds_back_its_aggregate_in_that_subscription_only() {
    let db = TestDb::new("sub_holdback").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let a_ids = insert_seed_events(&c, a, 3).await;
    let b_ids = insert_seed_events(&c, b, 3).await;
    let mut audit = start(&db, |bld| bld.subscription("audit").retry_policy(fast_retries(&[1500]))).await;
    let mut default = start(&db, |bld| bld).await;
    // The default subscription reads all six, untouched by audit's failure.
    let seen = ack_all(&mut default, 6).await;
    assert_eq!(seen.len(), 6);
    default.finish().await.expect("finish");
    // Audit fails a's first event: b goes on, a waits for the retry.
    let mut order = Vec::new();
    let first = next(&mut audit, 20).await;
    assert_eq!(first.id, a_ids[0]);
    first.fail("audit store down");
    for _ in 0..3 {
        let d = next(&mut audit, 20).await;
        order.push(d.id);
        d.ack();
    }
    assert_eq!(order, b_ids, "the other aggregate is not held back");
    eventually(10, "the failure written", || async {
        let n: i64 = c
            .query_one("SELECT count(*) FROM events.outbox_subscription_failures WHERE retry_count = 1", &[])
            .await
            .expect("count")
            .get(0);
        n == 1
    })
    .await;
    let failure = c
        .query_one(
            "SELECT retry_count, last_error FROM events.outbox_subscription_failures \
             WHERE subscription = 'audit' AND id = $1",
            &[&a_ids[0]],
        )
        .await
        .expect("failure row");
    assert_eq!((failure.get::<_, i32>(0), failure.get::<_, String>(1)), (1, "audit store down".into()));
    let row = c
        .query_one("SELECT published_at IS NOT NULL, retry_count FROM events.outbox WHERE id = $1", &[&a_ids[0]])
        .await
        .expect("row");
    assert_eq!((row.get::<_, bool>(0), row.get::<_, i32>(1)), (true, 0), "the default's columns are its own");
    // The retry comes, with its count, then a's later events in order.
    let d = next(&mut audit, 20).await;
    assert_eq!((d.id, d.retry_count, d.last_error.as_deref()), (a_ids[0], 1, Some("audit store down")));
    d.ack();
    let rest = ack_all(&mut audit, 2).await;
    assert_eq!(rest, a_ids[1..].to_vec());
    audit.finish().await.expect("finish");
    eventually(10, "no failure rows left", || async {
        let n: i64 =
            c.query_one("SELECT count(*) FROM events.outbox_subscription_failures", &[]).await.expect("count").get(0);
        n == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenth_failure_is_a_dead_letter_of_that_subscription_and_holds_its_aggregate() {
    let db = TestDb::new("sub_dead").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let a = Uuid::new_v4();
    let a_ids = insert_seed_events(&c, a, 2).await;
    let mut audit = start(&db, |bld| bld.subscription("audit").max_retries(3).retry_policy(fast_retries(&[50]))).await;
    for attempt in 0..3 {
        let d = next(&mut audit, 20).await;
        assert_eq!((d.id, d.retry_count), (a_ids[0], attempt));
        d.fail(format!("failure {}", attempt + 1));
    }
    // Nothing more: the dead letter holds a's second event back.
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(1500), audit.next()).await {
        panic!("unexpected delivery of {}", d.id);
    }
    audit.finish().await.expect("finish");
    let rows = c
        .query(
            "SELECT id, retry_count, next_retry_at = 'infinity', next_retry_at IS NULL \
             FROM events.outbox_subscription_failures WHERE subscription = 'audit' ORDER BY id",
            &[],
        )
        .await
        .expect("rows");
    let rows: Vec<(i64, i32, Option<bool>, bool)> =
        rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect();
    assert_eq!(rows[0], (a_ids[0], 3, Some(true), false), "a dead letter");
    if let Some(held) = rows.get(1) {
        assert_eq!(*held, (a_ids[1], 0, None, true), "held back behind it");
    }
    let published: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[]).await.expect("n").get(0);
    assert_eq!(published, 0, "nothing published for the default subscription");
}

/// Producers whose transactions draw ids and commit in another order (some
/// wait before they commit): the subscription's cursor must never pass an
/// id whose transaction is still open, so every committed event is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cursor_never_passes_an_event_that_commits_late() {
    let db = TestDb::new("sub_late").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let mut stream =
        start(&db, |bld| bld.subscription("audit").batch_size(5).sweep_interval(Duration::from_millis(200))).await;
    let mut producers = Vec::new();
    for p in 0..6u64 {
        let mut pc = db.client().await;
        producers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for i in 0..25u64 {
                let tx = pc.transaction().await.expect("tx");
                let id: i64 = tx
                    .query_one(
                        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ('late', gen_random_uuid(), 'E', '{}') RETURNING id",
                        &[],
                    )
                    .await
                    .expect("insert")
                    .get(0);
                // Every few, hold the transaction open while others commit.
                if (i + p) % 4 == 0 {
                    tokio::time::sleep(Duration::from_millis(30 + 20 * p)).await;
                }
                if (i + p) % 9 == 0 {
                    tx.rollback().await.expect("rollback");
                } else {
                    tx.commit().await.expect("commit");
                    committed.push(id);
                }
            }
            committed
        }));
    }
    let mut committed = HashSet::new();
    for p in producers {
        committed.extend(p.await.expect("producer"));
    }
    let mut seen: HashMap<i64, u32> = HashMap::new();
    while seen.len() < committed.len() {
        let d = next(&mut stream, 20).await;
        *seen.entry(d.id).or_default() += 1;
        d.ack();
    }
    stream.finish().await.expect("finish");
    assert_eq!(seen.keys().copied().collect::<HashSet<_>>(), committed, "every committed event, nothing else");
    assert!(seen.values().all(|n| *n == 1), "read once each");
    c.execute("SELECT events.outbox_subscription_ack('audit', '{}', true, NULL, NULL)", &[]).await.expect("advance");
    let top = committed.iter().max().copied().unwrap_or_default();
    let (cursor_id, settled) = cursor(&c, "audit").await;
    assert!(cursor_id >= top && settled == 0, "cursor {cursor_id} (settled above: {settled}), last event {top}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_of_two_subscriptions_lead_side_by_side() {
    let db = TestDb::new("sub_side").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 10).await;
    let mut audit = start(&db, |bld| bld.subscription("audit")).await;
    let mut default = start(&db, |bld| bld).await;
    // A second consumer of audit stands by: it gets nothing.
    let mut standby = start(&db, |bld| bld.subscription("audit")).await;
    assert_eq!(ack_all(&mut audit, 10).await, ids);
    assert_eq!(ack_all(&mut default, 10).await, ids);
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(800), standby.next()).await {
        panic!("the standby delivered {}", d.id);
    }
    audit.finish().await.expect("finish");
    // Once the leader stops, the standby takes over audit's later events.
    let later = insert_seed_events(&c, Uuid::new_v4(), 3).await;
    assert_eq!(ack_all(&mut standby, 3).await, later);
    standby.finish().await.expect("finish");
    default.finish().await.expect("finish");
    let terms: Vec<(String, i64)> = c
        .query("SELECT scope, term FROM events.outbox_terms ORDER BY scope", &[])
        .await
        .expect("terms")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(terms, vec![("outbox".to_string(), 1), ("subscription:audit".to_string(), 2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_subscription_or_a_bad_name_is_refused_by_name() {
    let db = TestDb::new("sub_refused").await;
    let e =
        pg_outbox::Consumer::builder(db.options()).subscription("nope").start().await.expect_err("refused").to_string();
    assert!(e.contains("subscription \"nope\" does not exist") && e.contains("subscription create nope"), "{e}");
    let e = pg_outbox::Consumer::builder(db.options())
        .subscription("Bad Name")
        .start()
        .await
        .expect_err("refused")
        .to_string();
    assert!(e.contains("\"Bad Name\"") && e.contains("a-z"), "{e}");
    let e = pg_outbox::Consumer::builder(db.options())
        .subscription("audit")
        .mode(pg_outbox::Mode::Competing)
        .start()
        .await
        .expect_err("refused")
        .to_string();
    assert!(e.contains("subscription \"audit\" does not exist"), "any mode: the missing subscription is named: {e}");
}

/// The rule itself, step by step: an event whose transaction is open when
/// a later one is acknowledged keeps the cursor below it, so it is read
/// once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_transactions_event_holds_the_cursor_below_it() {
    let db = TestDb::new("sub_open").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let insert = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ('open', gen_random_uuid(), 'E', '{}') RETURNING id";
    let first: i64 = c.query_one(insert, &[]).await.expect("first").get(0);
    let mut late_session = db.client().await;
    let late_tx = late_session.transaction().await.expect("tx");
    let late: i64 = late_tx.query_one(insert, &[]).await.expect("late").get(0);
    let after: i64 = c.query_one(insert, &[]).await.expect("after").get(0);
    assert!(first < late && late < after);
    // As the writer does: the checkpoint read in a statement of its own,
    // then the acknowledgement.
    let checkpoint = "SELECT max(id), pg_snapshot_xmax(pg_current_snapshot())::text::int8 \
         + age(((pg_snapshot_xmax(pg_current_snapshot())::text::int8 % 4294967296)::text)::xid) FROM events.outbox";
    let ack = "SELECT count(*) FROM events.outbox_subscription_ack('audit', $1, true, $2, $3)";
    // Acknowledged twice: the second write's snapshot passes the first's
    // checkpoint (the open transaction still runs, in this database).
    for _ in 0..2 {
        let cp = c.query_one(checkpoint, &[]).await.expect("checkpoint");
        let (top, next): (Option<i64>, Option<i64>) = (cp.get(0), cp.get(1));
        c.query_one(ack, &[&vec![first, after], &top, &next]).await.expect("ack");
    }
    let (cursor_id, settled) = cursor(&c, "audit").await;
    assert!(cursor_id < late, "cursor {cursor_id} passed {late}, whose transaction is open");
    // Every checkpoint was taken after the open transaction drew its id,
    // so none is passed: the cursor stays, the two kept settled above it.
    assert_eq!((cursor_id, settled), (0, 2));
    late_tx.commit().await.expect("commit");
    for ids in [vec![late], vec![]] {
        let cp = c.query_one(checkpoint, &[]).await.expect("checkpoint");
        let (top, next): (Option<i64>, Option<i64>) = (cp.get(0), cp.get(1));
        c.query_one(ack, &[&ids, &top, &next]).await.expect("ack");
    }
    assert_eq!(cursor(&c, "audit").await, (after, 0));
}

/// The WAL source wakes a subscription's consumer as it wakes the default
/// one (the table stays the truth); where the insert trigger was stopped
/// for it (`migrate --ordering producer-locked --source wal`), ids no
/// longer follow transaction ids and a subscription's consumer refuses to
/// start, naming the ordering mode.
#[cfg(feature = "wal")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_source_reads_a_subscription_and_one_without_the_trigger_is_refused() {
    use pg_outbox::{Consumer, SourceKind};
    use pg_outbox_testkit::process::LIVENESS;
    use pg_outbox_testkit::{TempServer, TempServerOptions};

    let server = tokio::task::spawn_blocking(|| {
        TempServer::start_with(TempServerOptions::default().setting("wal_level", "logical"))
    })
    .await
    .expect("join")
    .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {}", pg_outbox::error::report(&e)));
    let admin = crate::faults::connect(&server.url(), "sub wal admin", LIVENESS).await;
    if crate::support::server_version_num(&admin).await < 140_000 {
        println!("subscriptions: PostgreSQL older than 14 has no WAL source; nothing to check here");
        return;
    }
    let untriggered = vec!["migrate", "--ordering", "producer-locked", "--source", "wal"];
    for (db, args) in [("sub_wal", vec!["migrate", "--source", "wal"]), ("sub_wal_untriggered", untriggered)] {
        admin.batch_execute(&format!("CREATE DATABASE {db}")).await.expect("create database");
        let out = crate::support::cli(&args).url(&server.url_for(db)).run().await;
        assert!(out.ok(), "pg-outbox {args:?}: {}", out.stderr);
        let c = crate::faults::connect(&server.url_for(db), "sub wal", LIVENESS).await;
        create(&c, "audit").await;
    }
    let wal_consumer = |db: &str| {
        Consumer::builder(pg_outbox::ConnectOptions::parse(&server.url_for(db)).expect("url"))
            .source(SourceKind::Wal)
            .subscription("audit")
            .sweep_interval(Duration::from_secs(3600))
            .start()
    };
    let mut stream = wal_consumer("sub_wal").await.expect("start");
    let c = crate::faults::connect(&server.url_for("sub_wal"), "sub wal", LIVENESS).await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 5).await;
    // No sweep for an hour: the stream's wake-ups bring them.
    assert_eq!(ack_all(&mut stream, 5).await, ids);
    stream.finish().await.expect("finish");
    // Competing mode: two readers woken by the stream, each event once.
    let competing = || {
        Consumer::builder(pg_outbox::ConnectOptions::parse(&server.url_for("sub_wal")).expect("url"))
            .source(SourceKind::Wal)
            .subscription("audit")
            .mode(Mode::Competing)
            .sweep_interval(Duration::from_secs(3600))
            .start()
    };
    let (mut a, mut b) = (competing().await.expect("start a"), competing().await.expect("start b"));
    let more = insert_seed_events(&c, Uuid::new_v4(), 20).await;
    let mut got = Vec::new();
    while got.len() < more.len() {
        let d = tokio::time::timeout(Duration::from_secs(20), async {
            tokio::select! {
                Some(d) = a.next() => d,
                Some(d) = b.next() => d,
            }
        })
        .await
        .unwrap_or_else(|_| panic!("competing WAL readers: {} of {} within 20 s", got.len(), more.len()));
        got.push(d.id);
        d.ack();
    }
    got.sort_unstable();
    assert_eq!(got, more, "each event once between the two competing readers");
    a.finish().await.expect("finish a");
    b.finish().await.expect("finish b");
    let e = wal_consumer("sub_wal_untriggered").await.expect_err("refused").to_string();
    assert!(e.contains("ids to follow transaction ids") && e.contains("--ordering outbox-locked"), "{e}");
    drop((c, admin));
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

/// Who leads a subscription shows in `subscription list` and `status`; a
/// relay and a library consumer whose subscription is dropped stop on
/// their own, naming it, instead of reconnecting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_a_subscriptions_leader_and_a_dropped_subscription_stops_its_readers() {
    use tokio::io::AsyncBufReadExt;
    let db = TestDb::new("sub_dropped").await;
    let c = db.client().await;
    create(&c, "audit").await;
    create(&c, "billing").await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 3).await;
    let (mut relay, stdout) =
        crate::relay_proc::start_with_stdout(&db, &["--subscription", "audit", "--sink", "stdout"]).await;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    for id in &ids {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
        let line = line.expect("a line in time").expect("stdout").expect("a line");
        assert!(line.contains(&format!("\"id\":{id}")), "{id}: {line}");
    }
    let status = db.cli(&["status", "--json"]).run().await;
    assert!(status.ok(), "{status:?}");
    let v: serde_json::Value = serde_json::from_str(&status.stdout).expect("status JSON");
    let audit = &v["subscriptions"][0];
    assert_eq!((audit["name"].as_str(), audit["leader"]["term"].as_i64()), (Some("audit"), Some(1)), "{v}");
    assert!(audit["leader"]["live"].as_bool() == Some(true) && v["subscriptions"][1]["leader"].is_null(), "{v}");
    assert!(v["leader"].is_null(), "nobody leads the default: {v}");
    let list = db.cli(&["subscription", "list"]).run().await;
    let row = |name: &str| list.stdout.lines().find(|l| l.starts_with(name)).map(str::to_string).unwrap_or_default();
    assert!(row("audit").ends_with("term 1") && row("billing").ends_with("none"), "{list:?}");
    assert!(row("default").ends_with("none"), "{list:?}");

    // A library consumer of billing, then both subscriptions dropped.
    let mut billing = start(&db, |bld| bld.subscription("billing")).await;
    assert_eq!(ack_all(&mut billing, 3).await, ids);
    for name in ["audit", "billing"] {
        let out = db.cli(&["subscription", "drop", name, "--yes"]).run().await;
        assert!(out.ok(), "{out:?}");
    }
    let status = relay.wait().await;
    assert_eq!(status.code(), Some(1), "the relay exits with 1\n{}", relay.log());
    assert!(relay.log().contains("subscription_dropped"), "{}", relay.log());
    let end = tokio::time::timeout(Duration::from_secs(20), billing.next()).await.expect("the stream ends in time");
    assert!(end.is_none(), "nothing more is handed out");
    match billing.finish().await {
        Err(pg_outbox::Error::Subscription(pg_outbox::error::SubscriptionError::Unknown(name))) => {
            assert_eq!(name, "billing")
        }
        other => panic!("finish of a dropped subscription's consumer: {other:?}"),
    }
}

/// A subscription past its lag bound is behind: every relay of the outbox
/// (here the default's, with the subscription's own relay not running)
/// reports it in its metrics and log, and `subscription list` marks it;
/// nothing is dropped, and clearing the bound ends the alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_past_its_lag_bound_is_reported_behind_by_every_relay() {
    use crate::stranded::scrape;
    let db = TestDb::new("sub_behind").await;
    let c = db.client().await;
    let bad = db.cli(&["subscription", "create", "audit", "--from", "earliest", "--max-lag", "soon"]).run().await;
    assert!(matches!(bad.code, Some(2)) && bad.stderr.contains("invalid duration 'soon'"), "{bad:?}");
    let out = db.cli(&["subscription", "create", "audit", "--from", "earliest", "--max-lag", "10m"]).run().await;
    assert!(out.ok(), "{out:?}");
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         VALUES ('order', $1, 'Placed', '{}', now() - interval '1 hour')",
        &[&Uuid::new_v4()],
    )
    .await
    .expect("an event an hour old");
    let list = db.cli(&["subscription", "list", "--json"]).run().await;
    let v: serde_json::Value = serde_json::from_str(&list.stdout).expect("list JSON");
    let audit = &v[1];
    assert_eq!((audit["name"].as_str(), audit["max_lag_seconds"].as_f64()), (Some("audit"), Some(600.0)), "{v}");
    assert_eq!(audit["behind"].as_bool(), Some(true), "{v}");
    let table = db.cli(&["subscription", "list"]).run().await;
    assert!(table.stdout.lines().any(|l| l.starts_with("audit") && l.contains("BEHIND 1h")), "{table:?}");

    let addr = format!("127.0.0.1:{}", pg_outbox_testkit::process::free_port());
    let (mut relay, _stdout) =
        crate::relay_proc::start_with_stdout(&db, &["--sink", "stdout", "--metrics-addr", &addr]).await;
    relay.wait_signal(&["subscription_behind"], Duration::from_secs(30)).await.unwrap_or_else(|e| panic!("{e}"));
    let text = scrape(&addr).await.unwrap_or_default();
    assert!(text.lines().any(|l| l == "outbox_subscription_behind{subscription=\"audit\"} 1"), "{text}");
    assert!(text.lines().any(|l| l == "outbox_subscription_max_lag_seconds{subscription=\"audit\"} 600"), "{text}");
    let out = db.cli(&["subscription", "set", "audit", "--max-lag", "none"]).run().await;
    assert!(out.ok() && out.stdout.contains("no lag bound"), "{out:?}");
    eventually(30, "the alert ends", || async {
        scrape(&addr)
            .await
            .is_some_and(|t| t.lines().any(|l| l == "outbox_subscription_behind{subscription=\"audit\"} 0"))
    })
    .await;
    let kept: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert_eq!(kept, 1, "nothing dropped");
    relay.stop().await;
}

/// A subscription that opted in to expiry is marked expired once behind:
/// its relay stops and cannot start again, resume is refused, retention no
/// longer waits for it (one behind without expiry still holds it), and a
/// rewind brings it back, paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_that_opted_in_expires_once_behind_and_only_a_rewind_brings_it_back() {
    let db = TestDb::new("sub_expiry").await;
    let c = db.client().await;
    for args in [vec!["audit", "--max-lag", "10m", "--expire"], vec!["keep", "--max-lag", "10m"]] {
        let out = db.cli(&[&["subscription", "create", "--from", "earliest"][..], &args].concat()).run().await;
        assert!(out.ok(), "{out:?}");
    }
    assert!(db.cli(&["subscription", "pause", "audit"]).run().await.ok());
    let (mut audit, _out) =
        crate::relay_proc::start_with_stdout(&db, &["--subscription", "audit", "--sink", "stdout"]).await;
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         VALUES ('order', $1, 'Placed', '{}', now() - interval '1 hour')",
        &[&Uuid::new_v4()],
    )
    .await
    .expect("an event an hour old");
    let (default, _stdout) = crate::relay_proc::start_with_stdout(&db, &["--sink", "stdout"]).await;
    let status = audit.wait().await;
    assert_eq!(status.code(), Some(1), "audit's relay stops\n{}", audit.log());
    assert!(audit.log().contains("expired"), "{}", audit.log());
    let logs = format!("{}{}", audit.log(), default.log());
    assert!(logs.contains("subscription_expired"), "{logs}");

    let list = db.cli(&["subscription", "list", "--json"]).run().await;
    let v: serde_json::Value = serde_json::from_str(&list.stdout).expect("list JSON");
    let state = |i: usize| (v[i]["name"].as_str(), v[i]["state"].as_str(), v[i]["behind"].as_bool());
    assert_eq!(
        (state(1), state(2)),
        ((Some("audit"), Some("expired"), Some(true)), (Some("keep"), Some("active"), Some(true)))
    );
    let resume = db.cli(&["subscription", "resume", "audit"]).run().await;
    assert!(!resume.ok() && resume.stderr.contains("subscription \"audit\" expired"), "{resume:?}");
    let (again, log) = crate::relay_proc::run_to_exit(&db, &["--subscription", "audit", "--sink", "stdout"]).await;
    assert!(!again.success() && log.contains("subscription \"audit\" expired"), "{log}");

    // Retention: `keep`, behind without expiry, holds the event; once it is
    // dropped, the expired `audit` does not.
    eventually(30, "the default publishes it", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[])
            .await
            .expect("n")
            .get::<_, i64>(0)
            == 0
    })
    .await;
    c.execute("UPDATE events.outbox SET published_at = now() - interval '40 days'", &[])
        .await
        .expect("published long ago");
    let r = pg_outbox::retention::Retention::default();
    assert_eq!(pg_outbox::retention::run(&db.options(), &r).await.expect("retention").deleted, 0, "keep holds it");
    assert!(db.cli(&["subscription", "drop", "keep", "--yes"]).run().await.ok());
    assert_eq!(pg_outbox::retention::run(&db.options(), &r).await.expect("retention").deleted, 1, "audit expired");

    let rewind = db.cli(&["subscription", "rewind", "audit", "--to", "now"]).run().await;
    assert!(rewind.ok(), "{rewind:?}");
    let state: String = c
        .query_one("SELECT state FROM events.outbox_subscriptions WHERE name = 'audit'", &[])
        .await
        .expect("state")
        .get(0);
    assert_eq!(state, "paused", "a rewound expired subscription waits to be resumed");
    assert!(db.cli(&["subscription", "resume", "audit"]).run().await.ok());
    default.stop().await;
}

/// The process's Prometheus recorder, installed once (the library records
/// through the `metrics` facade; nothing else in this test binary installs
/// one).
fn prometheus() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).expect("the test process's recorder");
        handle
    })
}

/// A sink that takes every event.
struct Accept;

impl pg_outbox::relay::Sink for Accept {
    fn name(&self) -> &str {
        "accept"
    }

    fn send<'a>(
        &'a self,
        _: &'a pg_outbox::relay::Message,
        _: &'a pg_outbox::Event,
    ) -> pg_outbox::relay::SendFuture<'a> {
        Box::pin(async { Ok(pg_outbox::relay::Sent::Delivered) })
    }
}

/// In one process, a library consumer of a named subscription and
/// `relay::run` on it label what they record `subscription="NAME"`; the
/// default subscription's consumer beside them records without the label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_subscriptions_metrics_carry_its_label_in_one_process_with_the_default() {
    let handle = prometheus();
    let db = TestDb::new("sub_metrics").await;
    let c = db.client().await;
    create(&c, "metrics-label").await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 6).await;
    let stream = start(&db, |b| b.subscription("metrics-label")).await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(async move {
        let stop = async move {
            let _ = stop_rx.await;
        };
        pg_outbox::relay::run(stream, &Accept, stop).await
    });
    let mut default = start(&db, |b| b).await;
    let seen = ack_all(&mut default, ids.len()).await;
    assert_eq!(seen, ids);
    let published = |text: &str, label: &str| -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(pg_outbox::metrics::EVENTS_PUBLISHED) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    eventually(15, "the subscription's relay's acknowledgements counted under its label", || async {
        published(&handle.render(), "subscription=\"metrics-label\"") == Some(6.0)
    })
    .await;
    let _ = stop_tx.send(());
    let stats = relay.await.expect("join").expect("relay");
    assert_eq!(stats.delivered, 6);
    default.finish().await.expect("finish");
    let text = handle.render();
    for name in [pg_outbox::metrics::SINK_DURATION, pg_outbox::metrics::EVENTS_FETCHED] {
        assert!(
            text.lines().any(|l| l.starts_with(name) && l.contains("subscription=\"metrics-label\"")),
            "{name} with the subscription's label:\n{text}"
        );
    }
    // The default's acknowledgements: a series without the label (other
    // tests in this process add to it too).
    assert!(
        text.lines().any(|l| l.starts_with(pg_outbox::metrics::EVENTS_PUBLISHED) && !l.contains("subscription=")),
        "{text}"
    );
}

/// What each transaction that settles for a subscription commits with, as
/// a trigger deferred to the commit reads it: `synchronous_commit` off for
/// a named subscription's acknowledgements, failures, idle cursor moves and
/// claims by default, and the session's own (`on`) with
/// `durable_acknowledgements(true)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_subscription_settles_with_synchronous_commit_off_unless_asked_to_be_durable() {
    let db = TestDb::new("sub_commit").await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE public.commits (subscription text, setting text); \
         CREATE FUNCTION public.record_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO public.commits VALUES (to_jsonb(NEW) ->> TG_ARGV[0], current_setting('synchronous_commit')); \
           RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER record_commit AFTER UPDATE ON events.outbox_subscriptions \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.record_commit('name'); \
         CREATE CONSTRAINT TRIGGER record_commit AFTER INSERT OR UPDATE ON events.outbox_subscription_failures \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.record_commit('subscription');",
    )
    .await
    .expect("install the commit recorder");
    let readers = [("fast", Mode::Single, false), ("claims", Mode::Competing, false), ("durable", Mode::Single, true)];
    for (name, ..) in readers {
        create(&c, name).await;
    }
    let ids = insert_seed_events(&c, Uuid::new_v4(), 20).await;
    for (name, mode, durable) in readers {
        let mut stream = start(&db, |b| {
            b.subscription(name)
                .mode(mode)
                .durable_acknowledgements(durable)
                .batch_size(5)
                .retry_policy(fast_retries(&[20]))
        })
        .await;
        // Every event acknowledged, the first after one failure.
        let mut settled = HashSet::new();
        let mut failed = false;
        while settled.len() < ids.len() {
            let d = next(&mut stream, 20).await;
            if d.id == ids[0] && !failed {
                failed = true;
                d.fail("once");
            } else {
                settled.insert(d.id);
                d.ack();
            }
        }
        // Idle, the cursor moves over what is settled.
        let last = *ids.last().expect("ids");
        eventually(15, &format!("{name}'s cursor at its last event"), || async { cursor(&c, name).await == (last, 0) })
            .await;
        stream.finish().await.expect("finish");
    }
    let rows = c
        .query("SELECT subscription, setting, count(*) FROM public.commits GROUP BY 1, 2 ORDER BY 1, 2", &[])
        .await
        .expect("read the commits");
    let seen: Vec<(String, String, i64)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    println!("settling commits (subscription, synchronous_commit, transactions): {seen:?}");
    let settings = |name: &str| -> Vec<&str> {
        seen.iter().filter(|(s, ..)| s == name).map(|(_, setting, _)| setting.as_str()).collect()
    };
    assert_eq!(settings("fast"), ["off"], "single mode's settlements: {seen:?}");
    assert_eq!(settings("claims"), ["off"], "competing mode's claims: {seen:?}");
    assert_eq!(settings("durable"), ["on"], "durable acknowledgements: {seen:?}");

    // Asked of the default subscription, which always acknowledges
    // durably: refused by name, from the library and the command line.
    let e = pg_outbox::Consumer::builder(db.options()).durable_acknowledgements(true).start().await;
    let e = e.expect_err("refused for the default subscription").to_string();
    assert!(e.contains("durable acknowledgements apply to a named subscription"), "{e}");
    for extra in [&[][..], &["--subscription", "default"][..]] {
        let args = [&["relay", "--durable-acks", "--sink", "stdout"][..], extra].concat();
        let (code, _, err) = crate::support::cli(&args).url(&db.url()).run().await.parts();
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains("--durable-acks applies to --subscription NAME"), "{args:?}: {err}");
    }
}

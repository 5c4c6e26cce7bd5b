//! The consumer stream: delivery, order, acknowledgement, retries, dead
//! letters, hold-back, and wake-ups (notification, sweep, reconnect).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use pg_outbox::{
    Consumer, ConsumerBuilder, Delivery, Envelope, EventStream, Metadata, NewEvent, Publisher, RetryPolicy,
};
use uuid::Uuid;

use crate::support::{TestDb, eventually, insert_seed_events};

pub(crate) async fn start(db: &TestDb, f: impl FnOnce(ConsumerBuilder) -> ConsumerBuilder) -> EventStream {
    f(Consumer::builder(db.options())).start().await.expect("start consumer")
}

/// The next delivery, failing the test after `secs` (liveness bound).
pub(crate) async fn next(stream: &mut EventStream, secs: u64) -> Delivery {
    tokio::time::timeout(Duration::from_secs(secs), stream.next())
        .await
        .unwrap_or_else(|_| panic!("no delivery within {secs}s"))
        .expect("stream ended")
}

/// The next delivery must be event `id`; acknowledge it.
pub(crate) async fn ack_next(stream: &mut EventStream, id: i64, secs: u64) {
    let d = next(stream, secs).await;
    assert_eq!(d.id, id);
    d.ack();
}

/// Assert that nothing is delivered for `ms` milliseconds.
async fn assert_quiet(stream: &mut EventStream, ms: u64) {
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(ms), stream.next()).await {
        panic!("unexpected delivery of id {} ({})", d.id, d.event_type);
    }
}

/// A retry schedule of `steps_ms` milliseconds, without jitter.
pub(crate) fn fast_retries(steps_ms: &[u64]) -> RetryPolicy {
    RetryPolicy::schedule(steps_ms.iter().map(|m| Duration::from_millis(*m)).collect()).expect("schedule").jitter(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_event_is_delivered_acknowledged_and_marked_published() {
    let db = TestDb::new("happy_path").await;
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_secs(3600))).await;
    let mut c = db.client().await;
    let agg = Uuid::new_v4();
    let tx = c.transaction().await.expect("tx");
    let env = Envelope::new(1, serde_json::json!({"amount": 990}))
        .with_metadata(Metadata::new().causation_id("cause-1").correlation_id("req-1"));
    let id = Publisher::new()
        .publish(&tx, &NewEvent::with_envelope("subscription", agg, "PaymentSucceeded", &env).expect("envelope"))
        .await
        .expect("publish");
    tx.commit().await.expect("commit");

    // The sweep is an hour away: only the notification can deliver this.
    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.aggregate_id, d.event_type.as_str(), d.retry_count), (id, agg, "PaymentSucceeded", 0));
    assert_eq!(d.payload["version"], 1);
    assert_eq!(d.payload["data"]["amount"], 990);
    assert_eq!(d.payload["metadata"]["correlation_id"], "req-1");
    assert_eq!(d.payload["metadata"]["causation_id"], "cause-1");
    d.ack();
    eventually(10, "row marked published", || async {
        c.query_one("SELECT published_at IS NOT NULL FROM events.outbox WHERE id = $1", &[&id])
            .await
            .expect("q")
            .get::<_, bool>(0)
    })
    .await;
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_rejects_bad_events_before_sql_and_batches_return_ids_in_order() {
    let db = TestDb::new("publisher").await;
    let c = db.client().await;
    let p = Publisher::new().max_payload_bytes(1000);
    let agg = Uuid::new_v4();
    let bad = [
        NewEvent::new("", agg, "E", serde_json::json!({})),
        NewEvent::new("a\0b", agg, "E", serde_json::json!({})),
        NewEvent::new("a", agg, "", serde_json::json!({})),
        NewEvent::new("a", agg, "E", serde_json::json!({"s": "x\u{0}y"})),
        NewEvent::new("a", agg, "E", serde_json::json!({"k\u{0}": 1})),
        NewEvent::new("a", agg, "E", serde_json::json!({"blob": "y".repeat(2000)})),
    ];
    for e in &bad {
        let err = p.publish(&c, e).await.expect_err("must be refused");
        assert!(matches!(err, pg_outbox::Error::InvalidEvent(_)), "{err:?}");
    }
    let err = p.publish_many(&c, &bad[3..4]).await.expect_err("batch refused");
    assert!(err.to_string().contains("\\u0000"), "{err}");
    let n: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert_eq!(n, 0, "nothing inserted for refused events");

    let batch: Vec<NewEvent> =
        (0..20).map(|i| NewEvent::new("order", Uuid::new_v4(), format!("E{i}"), serde_json::json!({"i": i}))).collect();
    let ids = p.publish_many(&c, &batch).await.expect("batch");
    assert_eq!(ids.len(), 20);
    for (i, id) in ids.iter().enumerate() {
        let t: String =
            c.query_one("SELECT event_type FROM events.outbox WHERE id = $1", &[id]).await.expect("row").get(0);
        assert_eq!(t, format!("E{i}"));
    }
    assert!(p.publish_many(&c, &[]).await.expect("empty").is_empty());

    // Rolled back: no rows.
    let mut c2 = db.client().await;
    let tx = c2.transaction().await.expect("tx");
    p.publish(&tx, &NewEvent::new("a", agg, "Gone", serde_json::json!({}))).await.expect("publish");
    tx.rollback().await.expect("rollback");
    let n: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE event_type = 'Gone'", &[]).await.expect("count").get(0);
    assert_eq!(n, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_is_drained_in_id_order_across_many_batches() {
    let db = TestDb::new("id_order").await;
    let c = db.client().await;
    // Interleave aggregates; 1003 rows with batch size 7 means many fetches.
    let aggs: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'acct', ($1::uuid[])[1 + g % 5], 'E', jsonb_build_object('g', g) FROM generate_series(1, 1003) g",
        &[&aggs],
    )
    .await
    .expect("load");
    let mut stream = start(&db, |b| b.batch_size(7)).await;
    let mut got = Vec::new();
    while got.len() < 1003 {
        let d = next(&mut stream, 20).await;
        got.push(d.id);
        d.ack();
    }
    let mut sorted = got.clone();
    sorted.sort_unstable();
    assert_eq!(got, sorted, "ids must arrive in ascending order");
    assert_eq!(got.iter().collect::<HashSet<_>>().len(), 1003, "no duplicates");
    stream.finish().await.expect("finish");
    let left: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("q").get(0);
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_producers_with_rollbacks_deliver_each_committed_event_exactly_once() {
    let db = TestDb::new("concurrent_producers").await;
    // As in the seed's flow, each transaction updates its aggregate's domain
    // row first; that row lock orders the transactions of one aggregate.
    // (Producers that do not lock the aggregate are a separate guarantee.)
    let setup = db.client().await;
    setup
        .batch_execute("CREATE TABLE accounts (id uuid PRIMARY KEY, n int NOT NULL DEFAULT 0)")
        .await
        .expect("domain table");
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(500))).await;
    let aggs: Vec<Uuid> = (0..6).map(|_| Uuid::new_v4()).collect();
    setup.execute("INSERT INTO accounts (id) SELECT unnest($1::uuid[])", &[&aggs]).await.expect("accounts");
    let mut producers = Vec::new();
    for p in 0..6u64 {
        let pg = db.pg.clone();
        let aggs = aggs.clone();
        producers.push(tokio::spawn(async move {
            let (mut c, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
            tokio::spawn(conn);
            let publisher = Publisher::new();
            let mut committed = Vec::new();
            let mut rolled_back = Vec::new();
            for i in 0..60u64 {
                let tx = c.transaction().await.expect("tx");
                let agg = aggs[((p * 31 + i * 7) % 6) as usize];
                tx.execute("UPDATE accounts SET n = n + 1 WHERE id = $1", &[&agg]).await.expect("domain update");
                let id = publisher
                    .publish(&tx, &NewEvent::new("acct", agg, "Moved", serde_json::json!({"p": p, "i": i})))
                    .await
                    .expect("publish");
                if (p + i) % 5 == 0 {
                    tx.rollback().await.expect("rollback");
                    rolled_back.push(id);
                } else {
                    tx.commit().await.expect("commit");
                    committed.push(id);
                }
            }
            (committed, rolled_back)
        }));
    }
    let mut committed = HashSet::new();
    let mut rolled_back = HashSet::new();
    for p in producers {
        let (c, r) = p.await.expect("producer");
        committed.extend(c);
        rolled_back.extend(r);
    }
    let mut seen: HashMap<i64, u32> = HashMap::new();
    let mut last_per_agg: HashMap<Uuid, i64> = HashMap::new();
    while seen.len() < committed.len() {
        let d = next(&mut stream, 20).await;
        assert!(!rolled_back.contains(&d.id), "rolled-back event {} delivered", d.id);
        if let Some(prev) = last_per_agg.insert(d.aggregate_id, d.id) {
            assert!(prev < d.id, "aggregate order: {prev} then {}", d.id);
        }
        *seen.entry(d.id).or_default() += 1;
        d.ack();
    }
    // Nothing more arrives (no duplicates, no rolled-back rows), even across sweeps.
    assert_quiet(&mut stream, 1200).await;
    assert!(seen.values().all(|n| *n == 1), "a clean run delivers exactly once");
    assert_eq!(seen.keys().copied().collect::<HashSet<_>>(), committed);
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_event_holds_back_its_aggregate_while_others_go_on() {
    let db = TestDb::new("hold_back").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let b = Uuid::new_v4();
    let a1 = insert_seed_events(&c, a, 1).await[0];
    let a2 = insert_seed_events(&c, a, 1).await[0];
    let b1 = insert_seed_events(&c, b, 1).await[0];
    let mut stream = start(&db, |bld| bld.retry_policy(fast_retries(&[1500]))).await;

    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, a1);
    d.fail("downstream said no");
    // a2 was fetched with a1 but must not be handed out; b1 goes on.
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, b1, "the other aggregate goes on; {a2} must wait behind {a1}");
    d.ack();
    assert_quiet(&mut stream, 700).await;
    let row = c
        .query_one("SELECT retry_count, last_error, next_retry_at > now() FROM events.outbox WHERE id = $1", &[&a1])
        .await
        .expect("row");
    assert_eq!(row.get::<_, i32>(0), 1);
    assert_eq!(row.get::<_, String>(1), "downstream said no");
    assert!(row.get::<_, bool>(2), "waiting for its retry");
    // The retry timer brings a1 back first, then a2.
    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.retry_count, d.last_error.as_deref()), (a1, 1, Some("downstream said no")));
    d.ack();
    ack_next(&mut stream, a2, 10).await;
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenth_failure_makes_a_dead_letter_that_is_never_fetched_and_holds_back_its_aggregate() {
    let db = TestDb::new("dead_letter").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let first = insert_seed_events(&c, a, 1).await[0];
    let later = insert_seed_events(&c, a, 1).await[0];
    let mut stream =
        start(&db, |b| b.retry_policy(fast_retries(&[20, 40])).sweep_interval(Duration::from_millis(100))).await;
    for attempt in 0..10 {
        let d = next(&mut stream, 10).await;
        assert_eq!((d.id, d.retry_count), (first, attempt), "attempt {attempt}");
        d.fail(format!("failure {}", attempt + 1));
    }
    // Many sweeps pass: neither the dead letter nor the event behind it comes back.
    assert_quiet(&mut stream, 1500).await;
    let row = c
        .query_one(
            "SELECT retry_count, last_error, next_retry_at = 'infinity', published_at IS NULL FROM events.outbox WHERE id = $1",
            &[&first],
        )
        .await
        .expect("row");
    assert_eq!(row.get::<_, i32>(0), 10);
    assert_eq!(row.get::<_, String>(1), "failure 10");
    assert!(row.get::<_, bool>(2) && row.get::<_, bool>(3));
    let s = pg_outbox::status::read(&c).await.expect("status");
    assert_eq!((s.dead_letters, s.unpublished, s.due_now, s.held_back), (1, 2, 0, 1));
    // Another aggregate still flows.
    let other = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    ack_next(&mut stream, other, 10).await;
    let later_published: bool = c
        .query_one("SELECT published_at IS NOT NULL FROM events.outbox WHERE id = $1", &[&later])
        .await
        .expect("q")
        .get(0);
    assert!(!later_published);
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_ladder_sets_next_retry_at_from_the_database_clock() {
    let db = TestDb::new("ladder").await;
    let c = db.client().await;
    let id = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    // Simulate 4 earlier failures: the 5th waits 2 h (+0-10 % jitter).
    c.execute(
        "UPDATE events.outbox SET retry_count = 4, next_retry_at = now() - interval '1 second' WHERE id = $1",
        &[&id],
    )
    .await
    .expect("setup");
    let mut stream = start(&db, |b| b).await;
    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.retry_count), (id, 4));
    d.fail("again");
    eventually(10, "failure written", || async {
        c.query_one("SELECT retry_count FROM events.outbox WHERE id = $1", &[&id]).await.expect("q").get::<_, i32>(0)
            == 5
    })
    .await;
    let secs: f64 = c
        .query_one("SELECT EXTRACT(EPOCH FROM next_retry_at - now())::float8 FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("q")
        .get(0);
    assert!((7200.0 - 30.0..=7920.0).contains(&secs), "5th failure waits 2 h + jitter, got {secs} s");
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_delivery_is_released_and_delivered_again_first() {
    let db = TestDb::new("release").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let ids = insert_seed_events(&c, a, 3).await;
    let mut stream = start(&db, |b| b).await;
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, ids[0]);
    drop(d); // neither ack nor fail
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, ids[0], "released event comes again before later events of its aggregate");
    assert_eq!(d.retry_count, 0, "a release is not a failure");
    d.ack();
    for want in &ids[1..] {
        ack_next(&mut stream, *want, 10).await;
    }
    stream.finish().await.expect("finish");
}

/// Record every change of a relay's `waiting` in table `waiting_log` (a new
/// row, or a row whose `waiting` changed: not the heartbeat's updates).
async fn log_waiting_changes(c: &tokio_postgres::Client) {
    c.batch_execute(
        "CREATE TABLE waiting_log (waiting boolean NOT NULL); \
         CREATE FUNCTION log_waiting() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN \
              IF TG_OP = 'INSERT' OR OLD.waiting IS DISTINCT FROM NEW.waiting THEN \
                INSERT INTO waiting_log VALUES (NEW.waiting); \
              END IF; \
              RETURN NULL; \
            END $$; \
         CREATE TRIGGER log_waiting AFTER INSERT OR UPDATE ON events.outbox_relays \
         FOR EACH ROW EXECUTE FUNCTION log_waiting()",
    )
    .await
    .expect("log trigger");
}

/// Every registered relay waits for wake-ups (false when none is registered).
async fn relays_waiting(c: &tokio_postgres::Client) -> bool {
    c.query_one("SELECT coalesce(bool_and(waiting), false) FROM events.outbox_relays", &[])
        .await
        .expect("relays")
        .get::<_, bool>(0)
}

/// How many times a relay marked itself busy (see [`log_waiting_changes`]).
async fn busy_marks(c: &tokio_postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM waiting_log WHERE NOT waiting", &[]).await.expect("log").get::<_, i64>(0)
}

/// An idle relay that wakes to a fetch of 8 or more events marks itself busy
/// (producers then skip NOTIFY), however low its rate; fewer do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_that_finds_eight_events_turns_the_relay_busy() {
    let db = TestDb::new("busy_fetch").await;
    let c = db.client().await;
    log_waiting_changes(&c).await;
    let mut stream = start(&db, |b| b).await;
    let waiting = || relays_waiting(&c);
    eventually(10, "the idle relay asks for wake-ups", waiting).await;
    let busy_marks = || busy_marks(&c);
    assert_eq!(busy_marks().await, 0, "an idle relay never marked itself busy");
    // 20 events in one fetch: busy (then, the rate being low, waiting again).
    for id in insert_seed_events(&c, Uuid::new_v4(), 20).await {
        ack_next(&mut stream, id, 10).await;
    }
    eventually(10, "a fetch of 20 events marks the relay busy", || async { busy_marks().await == 1 }).await;
    eventually(10, "the relay asks for wake-ups again", waiting).await;
    // 5 events in one fetch: it stays waiting. (Settling wait, not a timing
    // assertion: the mark would follow the fetch within milliseconds.)
    for id in insert_seed_events(&c, Uuid::new_v4(), 5).await {
        ack_next(&mut stream, id, 10).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(busy_marks().await, 1, "a fetch of 5 events at a low rate must not mark the relay busy");
    stream.finish().await.expect("finish");
}

/// A relay's own second retry does not wait for the sweep. Two failures (a1
/// due at T, b1 due at T+0.3 s); the retry timer holds only T.
/// A notification drain reads min(next_retry_at) at T-45 ms and leaves c1
/// unread in the buffer (buffer = batch, so the next fetch waits for room);
/// d1's notification starts a drain, the retry timer fires at T+5 ms while
/// that drain waits (its reason stays "notification"); the drain then runs
/// at T+15 ms and ends within 100 ms of the last read, so it skips the
/// read: the skipped read must be made up (`RETRY_READ_GAP`), else nothing
/// arms b1's retry. Timings off by a slow machine only make the case
/// easier, never a false failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_retry_is_armed_although_a_drain_skipped_the_retry_read() {
    use tokio::time::{Instant, sleep, sleep_until};
    let db = TestDb::new("second_retry").await;
    let c = db.client().await;
    let mut stream = start(&db, |b| {
        b.batch_size(5).buffer(5).retry_policy(fast_retries(&[1500])).sweep_interval(Duration::from_secs(3_600))
    })
    .await;
    eventually(10, "the idle relay asks for wake-ups", || relays_waiting(&c)).await;
    sleep(Duration::from_millis(1_200)).await; // the rechecks after going idle are over
    let a1 = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, a1);
    d.fail("no");
    sleep(Duration::from_millis(300)).await;
    let b1 = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, b1);
    d.fail("no");
    eventually(10, "both failures written", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE next_retry_at IS NOT NULL", &[])
            .await
            .expect("count")
            .get::<_, i64>(0)
            == 2
    })
    .await;
    let secs: f64 = c
        .query_one("SELECT EXTRACT(EPOCH FROM next_retry_at - now())::float8 FROM events.outbox WHERE id = $1", &[&a1])
        .await
        .expect("due")
        .get(0);
    let due = Instant::now() + Duration::from_secs_f64(secs);
    sleep_until(due - Duration::from_millis(45)).await;
    let c1 = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    sleep_until(due - Duration::from_millis(25)).await;
    let d1 = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    sleep_until(due + Duration::from_millis(15)).await;
    // Liveness bound: b1 was due 0.3 s after a1, and the sweep is an hour away.
    let mut got = Vec::new();
    for _ in 0..4 {
        let d = tokio::time::timeout(Duration::from_secs(3), stream.next())
            .await
            .unwrap_or_else(|_| panic!("after {got:?}, nothing within 3 s (b1 = {b1}, due 0.3 s after a1)"))
            .expect("stream");
        got.push(d.id);
        d.ack();
    }
    got.sort_unstable();
    let mut want = vec![a1, b1, c1, d1];
    want.sort_unstable();
    assert_eq!(got, want);
    stream.finish().await.expect("finish");
}

/// A row another writer put in the retry ladder (a partitioned peer, a
/// former leader's late write) is delivered when due, although the
/// notification drain after it came within 100 ms of the last retry read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_writers_retry_is_delivered_when_due_not_at_the_sweep() {
    use tokio::time::sleep;
    let db = TestDb::new("foreign_retry").await;
    let c = db.client().await;
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_secs(3_600))).await;
    eventually(10, "the idle relay asks for wake-ups", || relays_waiting(&c)).await;
    sleep(Duration::from_millis(1_200)).await;
    let e = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    sleep(Duration::from_millis(20)).await;
    let x: i64 = c
        .query_one(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at) \
             VALUES ('subscription', gen_random_uuid(), 'PaymentSucceeded', '{\"version\":1,\"data\":{}}', 1, now() + interval '1 second') RETURNING id",
            &[],
        )
        .await
        .expect("insert retry row")
        .get(0);
    ack_next(&mut stream, e, 10).await;
    let d = tokio::time::timeout(Duration::from_secs(4), stream.next())
        .await
        .unwrap_or_else(|_| panic!("{x}, due in 1 s, was not delivered within 4 s"))
        .expect("stream");
    assert_eq!(d.id, x);
    d.ack();
    stream.finish().await.expect("finish");
}

/// With the sweep an hour away, every event of a trickle is delivered: a
/// waiting relay ends a drain after a fetch of less than a batch (without a
/// fetch that finds nothing), so what commits later must wake it; a busy
/// relay, which producers do not notify, must go on polling. Three
/// producers write 1-3 events per transaction every few milliseconds, after
/// one 200-event transaction that turns the relay busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle_after_a_burst_is_delivered_without_the_sweep() {
    let db = TestDb::new("trickle").await;
    let c = db.client().await;
    log_waiting_changes(&c).await;
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_secs(3_600))).await;
    eventually(10, "the idle relay asks for wake-ups", || relays_waiting(&c)).await;
    let mut expected: HashSet<i64> = insert_seed_events(&c, Uuid::new_v4(), 200).await.into_iter().collect();
    let mut producers = Vec::new();
    for p in 0..3u64 {
        let pg = db.pg.clone();
        producers.push(tokio::spawn(async move {
            let (c, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
            tokio::spawn(conn);
            let mut ids = Vec::new();
            for i in 0..150u64 {
                ids.extend(insert_seed_events(&c, Uuid::new_v4(), 1 + ((p + i) % 3) as i64).await);
                tokio::time::sleep(Duration::from_millis(2 + (p * 5 + i * 3) % 6)).await;
            }
            ids
        }));
    }
    // Deliveries are taken while the producers write.
    let written = futures::future::join_all(producers);
    tokio::pin!(written);
    let mut delivered = HashSet::new();
    let mut all_written = false;
    while !all_written || !expected.is_subset(&delivered) {
        tokio::select! {
            ids = &mut written, if !all_written => {
                for ids in ids {
                    expected.extend(ids.expect("producer"));
                }
                all_written = true;
            }
            // Liveness bound: producers commit every few milliseconds, and
            // the sweep is an hour away.
            d = tokio::time::timeout(Duration::from_secs(5), stream.next()) => {
                let d = d
                    .unwrap_or_else(|_| panic!("nothing delivered for 5 s; {} events delivered so far", delivered.len()))
                    .expect("stream ended");
                assert!(delivered.insert(d.id), "event {} delivered twice", d.id);
                d.ack();
            }
        }
    }
    assert_eq!(delivered, expected, "delivered events differ from those written");
    assert!(busy_marks(&c).await >= 1, "the 200-event fetch did not turn the relay busy");
    stream.finish().await.expect("finish");
}

/// Producers whose notifying commits queue for NOTIFY's commit lock turn an
/// idle relay busy, although their rate stays under the busy rate and each
/// wake-up finds fewer than 8 events: each commit is held 1 ms by
/// `commit_delay` (a sleep before the WAL flush, inside the lock), so six
/// producers commit one at a time, at most about 1 000 transactions (2 000
/// events) a second, the other five waiting. The relay must turn busy
/// within 3 s; with the rule disabled it stayed waiting for 5 s to over
/// 15 s (five runs). `commit_delay` applies only with `fsync=on`: on a
/// server without it (the throwaway test server) the test says so and
/// checks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_queueing_for_notify_turn_an_idle_relay_busy() {
    let db = TestDb::new("notify_queue").await;
    let c = db.client().await;
    let fsync: String = c.query_one("SHOW fsync", &[]).await.expect("fsync").get(0);
    if fsync != "on" {
        crate::needs::skip(&format!("commit_delay needs fsync=on, and the server runs with fsync={fsync}"));
        return;
    }
    log_waiting_changes(&c).await;
    let mut stream = start(&db, |b| b).await;
    eventually(10, "the idle relay asks for wake-ups", || relays_waiting(&c)).await;
    let handle = stream.shutdown_handle();
    let consumer = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(d) = stream.next().await {
            d.ack();
            n += 1;
        }
        stream.finish().await.expect("finish");
        n
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut producers = Vec::new();
    for _ in 0..6 {
        let p = db.client().await;
        p.batch_execute("SET commit_delay = 1000; SET commit_siblings = 0")
            .await
            .expect("commit_delay (needs a superuser)");
        let stop = stop.clone();
        producers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                p.execute(
                    "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES \
                     ('queue', gen_random_uuid(), 'Inserted', '{}'), ('queue', gen_random_uuid(), 'Inserted', '{}')",
                    &[],
                )
                .await
                .expect("insert");
                n += 2;
            }
            n
        }));
    }
    eventually(3, "producers queueing for NOTIFY's lock turn the relay busy", || async { busy_marks(&c).await >= 1 })
        .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut inserted = 0;
    for p in producers {
        inserted += p.await.expect("producer");
    }
    eventually(30, "every event is delivered", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[])
            .await
            .expect("count")
            .get::<_, i64>(0)
            == 0
    })
    .await;
    handle.shutdown();
    let delivered = consumer.await.expect("consumer");
    assert!(delivered >= inserted, "delivered {delivered} of {inserted} events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_finds_rows_inserted_without_a_notification() {
    let db = TestDb::new("sweep").await;
    let c = db.client().await;
    // Row triggers do not fire for this session (as in a restore): no NOTIFY.
    c.batch_execute("SET session_replication_role = replica").await.expect("replica role");
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(300))).await;
    // Let the first drain pass, then insert silently.
    assert_quiet(&mut stream, 300).await;
    let id = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    ack_next(&mut stream, id, 10).await;
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_while_the_listener_is_down_arrive_after_reconnect_not_at_the_next_sweep() {
    let db = TestDb::new("listener_down").await;
    let mut stream =
        start(&db, |b| b.sweep_interval(Duration::from_secs(3600)).reconnect_max_delay(Duration::from_millis(500)))
            .await;
    let mut status = stream.listener_status();
    let c = db.client().await;
    // Let the start-up drain and its follow-up looks finish first.
    assert_quiet(&mut stream, 300).await;
    assert_eq!(db.terminate("pg-outbox listener").await, 1, "one listener backend");
    // Insert while the listener is gone (its NOTIFY is lost).
    status.wait_for(|s| !s.listening).await.expect("status");
    let id = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    // No sweep for an hour: only the reconnect's catch-up can deliver it.
    ack_next(&mut stream, id, 15).await;
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.reconnects >= 1))
        .await
        .expect("the reconnect is counted")
        .expect("status");
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_writes_final_acknowledgements_and_stream_ends_after_shutdown() {
    let db = TestDb::new("shutdown").await;
    let c = db.client().await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 30).await;
    let mut stream =
        start(&db, |b| b.batch_size(10).ack_interval(Duration::from_secs(3600)).ack_batch_size(1000)).await;
    let handle = stream.shutdown_handle();
    let mut acked = Vec::new();
    for _ in 0..5 {
        let d = next(&mut stream, 10).await;
        acked.push(d.id);
        d.ack();
    }
    // Acks are pending (flush interval is an hour); shutdown must write them.
    handle.shutdown();
    assert!(tokio::time::timeout(Duration::from_secs(5), stream.next()).await.expect("ends").is_none());
    stream.finish().await.expect("finish");
    let published: Vec<i64> = c
        .query("SELECT id FROM events.outbox WHERE published_at IS NOT NULL ORDER BY id", &[])
        .await
        .expect("q")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(published, acked, "exactly the acknowledged events are published");
    assert_eq!(&ids[..5], &acked[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_fails_clearly_on_an_unmigrated_database_and_bad_settings() {
    let db = TestDb::new("unmigrated").await;
    let c = db.client().await;
    c.batch_execute("DROP SCHEMA events CASCADE").await.expect("drop");
    let err = Consumer::builder(db.options()).start().await.expect_err("unmigrated");
    assert!(matches!(err, pg_outbox::Error::NotMigrated(_)), "{err:?}");
    assert!(err.to_string().contains("pg-outbox migrate"));
    let err = Consumer::builder(db.options()).batch_size(0).start().await.expect_err("bad batch");
    assert!(matches!(err, pg_outbox::Error::Config(_)));
    let bad = pg_outbox::ConnectOptions::parse("postgres://postgres:s3cret@127.0.0.1:1/nowhere").expect("url");
    let err = Consumer::builder(bad).start().await.expect_err("unreachable");
    assert!(err.is_transient(), "a server that cannot be reached may come back: {err:?}");
    let missing = db.options().with_dbname("pgo_no_such_database");
    let gone = Consumer::builder(missing).start().await.expect_err("no such database");
    assert_eq!(gone.code(), Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME), "{gone:?}");
    assert!(!gone.is_transient(), "a database that does not exist stays missing: {gone:?}");
    let full = pg_outbox::error::report(&err);
    assert!(full.contains("127.0.0.1:1 (database nowhere, user postgres"), "names the target: {full}");
    assert!(!full.contains("s3cret"), "never shows the password: {full}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_row_is_a_recorded_failure_that_holds_back_its_aggregate() {
    let db = TestDb::new("undecodable").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let ids = insert_seed_events(&c, a, 2).await;
    // chrono cannot represent 'infinity'.
    c.execute("UPDATE events.outbox SET occurred_at = 'infinity' WHERE id = $1", &[&ids[0]]).await.expect("poison");
    let other = insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    let mut stream = start(&db, |b| b).await;
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, other, "the other aggregate flows; {} waits behind {}", ids[1], ids[0]);
    d.ack();
    assert_quiet(&mut stream, 500).await;
    let row = c
        .query_one("SELECT retry_count, last_error, next_retry_at > now() FROM events.outbox WHERE id = $1", &[&ids[0]])
        .await
        .expect("row");
    assert_eq!(row.get::<_, i32>(0), 1, "recorded as a failed attempt");
    assert!(row.get::<_, String>(1).contains("cannot decode"), "{}", row.get::<_, String>(1));
    assert!(row.get::<_, bool>(2));
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_numbers_are_delivered_digit_for_digit() {
    let db = TestDb::new("precision").await;
    let c = db.client().await;
    let text = r#"{"big": 1e400, "wei": 1000000000000000000001, "eth": 1.000000000000000001}"#;
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', gen_random_uuid(), 'e', $1::text::jsonb)",
        &[&text],
    )
    .await
    .expect("insert");
    let mut stream = start(&db, |b| b).await;
    let d = next(&mut stream, 10).await;
    let out = serde_json::to_string(&d.payload).expect("json");
    for digits in ["1000000000000000000001", "1.000000000000000001"] {
        assert!(out.contains(digits), "{digits} lost in {out}");
    }
    // jsonb stores 1e400 as the exact numeric 1 followed by 400 zeros.
    assert!(out.contains(&format!("\"big\":1{},", "0".repeat(400))), "{out}");
    d.ack();
    stream.finish().await.expect("finish");
}

/// While acknowledgements cannot be written (a lock blocks their UPDATE),
/// the consumer stops fetching once two acknowledgement batches are
/// unwritten: the settlements it holds, and the ids each fetch must skip,
/// stay bounded however fast user code acknowledges. Once the writes go
/// through again, everything is delivered and published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_falls_behind_stops_fetches_after_two_batches() {
    let db = TestDb::new("consumer_writer_behind").await;
    let c = db.client().await;
    let total = 3000i64;
    insert_seed_events(&c, Uuid::new_v4(), total).await;
    // Row locks on every event let the fetches (plain SELECTs) through and
    // make the acknowledgements' UPDATE wait.
    let locker = db.client().await;
    locker.batch_execute("BEGIN; SELECT id FROM events.outbox FOR UPDATE").await.expect("lock the rows");
    let (batch, ack_batch) = (50usize, 100usize);
    let mut stream = start(&db, |b| b.batch_size(batch).ack_batch_size(ack_batch)).await;
    let mut delivered = 0usize;
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(d)) = tokio::time::timeout_at(until, stream.next()).await {
        d.ack();
        delivered += 1;
    }
    // Two unwritten batches, the stream's buffer (twice the batch) and one
    // fetch on its way.
    let bound = 2 * ack_batch + 2 * batch + batch;
    assert!(
        (2 * ack_batch..=bound).contains(&delivered),
        "with the writer blocked, {delivered} events were delivered; expected {}..={bound}",
        2 * ack_batch
    );
    assert_eq!(crate::support::published_count(&c).await, 0, "nothing written while the lock is held");
    locker.batch_execute("COMMIT").await.expect("unlock");
    let mut seen = delivered;
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    while seen < usize::try_from(total).unwrap_or(usize::MAX) {
        match tokio::time::timeout_at(until, stream.next()).await {
            Ok(Some(d)) => {
                d.ack();
                seen += 1;
            }
            other => panic!("the drain stopped after {seen} of {total} deliveries: {other:?}"),
        }
    }
    eventually(30, "every event published", || async { crate::support::published_count(&c).await == total }).await;
    stream.finish().await.expect("finish");
}

/// Consumers started at the same moment on one database each get their own
/// start-up test notification back, though all are sent on one channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_starting_together_each_find_that_notifications_work() {
    let db = TestDb::new("probe_together").await;
    let db = &db;
    let streams = futures::future::join_all(
        (0..6).map(|_| async move { start(db, |b| b.mode(pg_outbox::Mode::Competing)).await }),
    )
    .await;
    for s in streams {
        let listener = s.health().get().listener;
        assert_eq!(listener.notifications_work, Some(true), "{listener:?}");
        s.finish().await.expect("finish");
    }
}

//! Per-aggregate order when producers race: an aggregate's ids become
//! visible in id order (triggers/outbox_insert_order_and_notify.sql), so the relay never
//! delivers a later event of an aggregate while an earlier one may still
//! commit; unrelated aggregates never wait on each other.

use std::time::Duration;

use futures::StreamExt;
use uuid::Uuid;

use crate::consumer::{ack_next, next, start};
use crate::support::TestDb;

/// Insert one event of aggregate `agg` (type `acct`, event type `name`) on
/// `c` (a transaction, or a client in autocommit); returns its id.
async fn insert(c: &impl tokio_postgres::GenericClient, agg: Uuid, name: &str) -> i64 {
    c.query_one(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('acct', $1, $2, '{}') RETURNING id",
        &[&agg, &name],
    )
    .await
    .expect("insert")
    .get(0)
}

/// Insert `n` events of distinct aggregates (type `agg_type`) in one
/// transaction and commit it, asserting on the way that the transaction
/// turned bulk and holds few advisory locks: one per aggregate would
/// exhaust the shared lock table ("out of shared memory"); after about
/// 1 000 events it locks head rows (stored in tuples) instead. `what`
/// names the case in failure messages.
async fn insert_many_and_check_bulk(db: &TestDb, agg_type: &str, n: i64, what: &str) {
    let mut c = db.client().await;
    let other = db.client().await;
    let tx = c.transaction().await.expect("tx");
    let inserted = tx
        .execute(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT $1, gen_random_uuid(), 'Imported', '{}' FROM generate_series(1, $2::bigint)",
            &[&agg_type, &n],
        )
        .await
        .expect("large insert");
    assert_eq!(inserted, u64::try_from(n).expect("n >= 0"), "{what}");
    let pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await.expect("pid").get(0);
    let locks: i64 = other
        .query_one("SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory'", &[&pid])
        .await
        .expect("locks")
        .get(0);
    assert!((2..=1_200).contains(&locks), "{what}: {n} aggregates in one transaction hold {locks} advisory locks");
    let bulk: Option<String> =
        tx.query_one("SELECT current_setting('pg_outbox.bulk', true)", &[]).await.expect("guc").get(0);
    assert_eq!(bulk.as_deref(), Some("on"), "{what}: the large transaction did not turn bulk");
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_insert_of_the_same_aggregate_waits_and_is_delivered_after_the_earlier_commit() {
    let db = TestDb::new("race_same_aggregate").await;
    let a = Uuid::new_v4();
    let b = Uuid::new_v4();
    let mut stream = start(&db, |bld| bld.sweep_interval(Duration::from_millis(100))).await;

    // T1 inserts for A and stays open.
    let mut c1 = db.client().await;
    let t1 = c1.transaction().await.expect("t1");
    let first = insert(&t1, a, "first").await;

    // T2 inserts for A too: it must wait for T1 (it cannot take a later id
    // and commit before T1).
    let pg = db.pg.clone();
    let t2 = tokio::spawn(async move {
        let (mut c2, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
        tokio::spawn(conn);
        let t2 = c2.transaction().await.expect("t2");
        let id = insert(&t2, a, "second").await;
        t2.commit().await.expect("commit t2");
        id
    });

    // Meanwhile another aggregate is neither blocked nor delayed.
    let c3 = db.client().await;
    let other: i64 = c3
        .query_one(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('acct', $1, 'other', '{}') RETURNING id",
            &[&b],
        )
        .await
        .expect("insert other")
        .get(0);
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, other, "an open transaction on A does not delay B");
    d.ack();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!t2.is_finished(), "T2 must wait for T1's lock on aggregate A");

    t1.commit().await.expect("commit t1");
    let second = tokio::time::timeout(Duration::from_secs(10), t2).await.expect("t2 finishes").expect("t2 task");
    assert!(second > first, "the waiting insert drew its id after T1: {first} < {second}");
    ack_next(&mut stream, first, 10).await;
    ack_next(&mut stream, second, 10).await;
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_insert_does_not_stall_the_aggregate() {
    let db = TestDb::new("race_rollback").await;
    let a = Uuid::new_v4();
    let mut stream = start(&db, |b| b).await;
    let mut c1 = db.client().await;
    let t1 = c1.transaction().await.expect("t1");
    insert(&t1, a, "doomed").await;
    let pg = db.pg.clone();
    let t2 = tokio::spawn(async move {
        let (mut c2, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
        tokio::spawn(conn);
        let t2 = c2.transaction().await.expect("t2");
        let id = insert(&t2, a, "kept").await;
        t2.commit().await.expect("commit t2");
        id
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    t1.rollback().await.expect("rollback");
    let kept = tokio::time::timeout(Duration::from_secs(10), t2).await.expect("t2 proceeds").expect("t2 task");
    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.event_type.as_str()), (kept, "kept"));
    d.ack();
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_transactions_on_different_aggregates_do_not_serialise() {
    let db = TestDb::new("race_different").await;
    // 8 transactions, each on its own aggregate, all open at once: none waits.
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(db.client().await);
    }
    let mut txs = Vec::new();
    for c in clients.iter_mut() {
        txs.push(c.transaction().await.expect("tx"));
    }
    for tx in &txs {
        tokio::time::timeout(Duration::from_secs(5), insert(tx, Uuid::new_v4(), "parallel"))
            .await
            .expect("an insert on a different aggregate must not wait");
    }
    for tx in txs {
        tx.commit().await.expect("commit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_insert_of_100k_distinct_aggregates_in_one_transaction_holds_few_locks() {
    let db = TestDb::new("bulk_100k").await;
    insert_many_and_check_bulk(&db, "bulk", 100_000, "100 000 events").await;
    let other = db.client().await;
    let rows: i64 = other
        .query_one("SELECT count(*) FROM events.outbox WHERE aggregate_type = 'bulk'", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(rows, 100_000);
}

/// Start a transaction on a fresh connection that runs `setup` and then
/// inserts one event for `agg`; it stays open until `release` fires, then
/// commits. Returns the event's id once inserted, and a handle that ends
/// with the commit.
async fn open_writer(
    db: &TestDb,
    setup: &'static str,
    agg: Uuid,
    name: &'static str,
) -> (tokio::sync::oneshot::Receiver<i64>, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let pg = db.pg.clone();
    let (id_tx, id_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let (mut c, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
        tokio::spawn(conn);
        let tx = c.transaction().await.expect("tx");
        if !setup.is_empty() {
            tx.batch_execute(setup).await.expect("setup");
        }
        let id = insert(&tx, agg, name).await;
        let _ = id_tx.send(id);
        let _ = release_rx.await;
        tx.commit().await.expect("commit");
    });
    (id_rx, release_tx, task)
}

/// Every value of the producers' hint (0: the trigger's fast path, no relay
/// waits and no bulk transaction may run; 1-3: its full path) keeps an
/// aggregate's writers in order: the second waits for the first and draws
/// the later id, another aggregate is not delayed, and a transaction that
/// writes 3 000 aggregates turns bulk instead of holding a lock for each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hint_value_keeps_an_aggregates_writers_in_order_and_turns_large_transactions_bulk() {
    let db = TestDb::new("order_hints").await;
    let c = db.client().await;
    for hint in 0..=3i64 {
        // No relay is registered, so nothing refreshes the hint meanwhile.
        c.query_one("SELECT setval('events.outbox_hint', $1)", &[&hint]).await.expect("set hint");
        let agg = Uuid::new_v4();
        let (first_id, release_first, first) = open_writer(&db, "", agg, "first").await;
        let first_id =
            tokio::time::timeout(Duration::from_secs(10), first_id).await.expect("first inserts").expect("id");
        let (second_id, release_second, second) = open_writer(&db, "", agg, "second").await;
        let mut second_id = Box::pin(second_id);
        tokio::time::timeout(
            Duration::from_secs(5),
            c.execute(
                "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('acct', $1, 'other', '{}')",
                &[&Uuid::new_v4()],
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("hint {hint}: another aggregate must not wait"))
        .expect("insert other");
        // Liveness wait: the second writer must still be blocked.
        assert!(
            tokio::time::timeout(Duration::from_millis(500), &mut second_id).await.is_err(),
            "hint {hint}: the second writer of the aggregate did not wait for the first"
        );
        release_first.send(()).expect("release first");
        first.await.expect("first commits");
        let second_id =
            tokio::time::timeout(Duration::from_secs(10), second_id).await.expect("second proceeds").expect("id");
        assert!(second_id > first_id, "hint {hint}: second id {second_id} <= first id {first_id}");
        release_second.send(()).expect("release second");
        second.await.expect("second commits");

        c.query_one("SELECT setval('events.outbox_hint', $1)", &[&hint]).await.expect("set hint");
        insert_many_and_check_bulk(&db, "many", 3_000, &format!("hint {hint}")).await;
    }
}

/// Bulk and ordinary transactions writing one aggregate wait for each other
/// in both orders, and the later one draws the later id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_and_ordinary_transactions_on_one_aggregate_wait_for_each_other() {
    let db = TestDb::new("bulk_vs_ordinary").await;
    const BULK: &str = "SELECT events.outbox_bulk_begin()";
    // An explicit bulk transaction; one that turned bulk after 2 000 events
    // of other aggregates; and an ordinary one, each first and second.
    const ESCALATED: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'other', gen_random_uuid(), 'filler', '{}' FROM generate_series(1, 2000)";
    let cases = [(BULK, ""), ("", BULK), (ESCALATED, ""), ("", ESCALATED), (BULK, BULK)];
    for (first_setup, second_setup) in cases {
        let agg = Uuid::new_v4();
        let (first_id, release_first, first) = open_writer(&db, first_setup, agg, "first").await;
        let first_id =
            tokio::time::timeout(Duration::from_secs(30), first_id).await.expect("first inserts").expect("id");
        let (second_id, release_second, second) = open_writer(&db, second_setup, agg, "second").await;
        let mut second_id = Box::pin(second_id);
        // Liveness wait: the second writer must still be blocked.
        assert!(
            tokio::time::timeout(Duration::from_millis(1_500), &mut second_id).await.is_err(),
            "{first_setup:?} then {second_setup:?}: the second writer of the aggregate did not wait"
        );
        release_first.send(()).expect("release first");
        first.await.expect("first commits");
        let second_id =
            tokio::time::timeout(Duration::from_secs(30), second_id).await.expect("second proceeds").expect("id");
        assert!(second_id > first_id, "{first_setup:?} then {second_setup:?}: {second_id} <= {first_id}");
        release_second.send(()).expect("release second");
        second.await.expect("second commits");
    }
    // Once no bulk transaction runs, the next refresh clears the bulk bit.
    let c = db.client().await;
    c.batch_execute("DELETE FROM events.outbox_relays WHERE false").await.expect("refresh");
    let hint: i64 = c.query_one("SELECT pg_sequence_last_value('events.outbox_hint')", &[]).await.expect("hint").get(0);
    assert_eq!(hint & 2, 0, "hint {hint} still says a bulk transaction may run");
}

/// Acknowledge the next `total` deliveries, asserting that each aggregate's
/// ids come in increasing order; `secs` bounds the wait for each.
async fn ack_each_aggregate_in_id_order(stream: &mut pg_outbox::EventStream, total: usize, secs: u64) {
    let mut last = std::collections::HashMap::new();
    for _ in 0..total {
        let d = next(stream, secs).await;
        if let Some(prev) = last.insert(d.aggregate_id, d.id) {
            assert!(prev < d.id, "aggregate {} delivered {} after {prev}", d.aggregate_id, d.id);
        }
        d.ack();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_producers_and_bulk_transactions_never_reorder_an_aggregate() {
    let db = TestDb::new("race_bulk").await;
    let aggs: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(100))).await;
    let mut producers = Vec::new();
    for p in 0..5u64 {
        let pg = db.pg.clone();
        let aggs = aggs.clone();
        producers.push(tokio::spawn(async move {
            let (mut c, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
            tokio::spawn(conn);
            let mut committed = 0usize;
            for i in 0..30u64 {
                let tx = c.transaction().await.expect("tx");
                if p == 0 {
                    // The bulk producer: 1 500 events round the aggregates
                    // in one transaction, turning bulk part way through.
                    let n = tx
                        .execute(
                            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                             SELECT 'acct', ($1::uuid[])[1 + g % 4], 'bulk', '{}' FROM generate_series(1, 1500) g",
                            &[&aggs],
                        )
                        .await
                        .expect("bulk insert");
                    tx.commit().await.expect("commit");
                    committed += n as usize;
                    if i >= 3 {
                        break;
                    }
                    continue;
                }
                insert(&tx, aggs[((p + i) % 4) as usize], "race").await;
                tokio::time::sleep(Duration::from_micros((p * 97 + i * 31) % 2000)).await;
                tx.commit().await.expect("commit");
                committed += 1;
            }
            committed
        }));
    }
    let mut total = 0;
    for p in producers {
        total += p.await.expect("producer");
    }
    ack_each_aggregate_in_id_order(&mut stream, total, 30).await;
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_racing_producers_on_few_aggregates_never_reorder_an_aggregate() {
    let db = TestDb::new("race_many").await;
    let aggs: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(100))).await;
    let mut producers = Vec::new();
    for p in 0..6u64 {
        let pg = db.pg.clone();
        let aggs = aggs.clone();
        producers.push(tokio::spawn(async move {
            let (mut c, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
            tokio::spawn(conn);
            let mut committed = 0usize;
            for i in 0..40u64 {
                let tx = c.transaction().await.expect("tx");
                // No domain-row lock here: only our trigger orders them.
                let agg = aggs[((p + i) % 3) as usize];
                insert(&tx, agg, "race").await;
                // Hold the transaction open a little, at varying lengths.
                tokio::time::sleep(Duration::from_micros((p * 97 + i * 31) % 2000)).await;
                if (p * 7 + i) % 9 == 0 {
                    tx.rollback().await.expect("rollback");
                } else {
                    tx.commit().await.expect("commit");
                    committed += 1;
                }
            }
            committed
        }));
    }
    let mut total = 0;
    for p in producers {
        total += p.await.expect("producer");
    }
    ack_each_aggregate_in_id_order(&mut stream, total, 15).await;
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(500), stream.next()).await {
        panic!("unexpected extra delivery {}", d.id);
    }
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_under_load_never_reorder_an_aggregate() {
    // One event in ten fails its first attempt and is retried 100 ms later
    // while producers keep writing: the retried event's later siblings, held
    // back meanwhile, must come after it, never before.
    let db = TestDb::new("retry_order_load").await;
    let aggs: Vec<Uuid> = (0..8).map(|_| Uuid::new_v4()).collect();
    let policy = pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(100)]).expect("policy");
    let mut stream = start(&db, |b| b.retry_policy(policy)).await;
    let mut producers = Vec::new();
    for p in 0..3u64 {
        let pg = db.pg.clone();
        let aggs = aggs.clone();
        producers.push(tokio::spawn(async move {
            let (mut c, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
            tokio::spawn(conn);
            for i in 0..400u64 {
                let tx = c.transaction().await.expect("tx");
                insert(&tx, aggs[((p * 13 + i * 7) % 8) as usize], "load").await;
                tx.commit().await.expect("commit");
                if i % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
            }
            400usize
        }));
    }
    let mut total = 0;
    for p in producers {
        total += p.await.expect("producer");
    }
    let mut received = std::collections::HashSet::new();
    let mut high = std::collections::HashMap::new();
    let mut failed = 0;
    while received.len() < total {
        let d = next(&mut stream, 20).await;
        if d.id % 10 == 0 && d.retry_count == 0 {
            failed += 1;
            d.fail("first attempt fails");
            continue;
        }
        if received.insert(d.id) {
            let h = high.entry(d.aggregate_id).or_insert(0);
            assert!(d.id > *h, "aggregate {}: {} delivered after {}", d.aggregate_id, d.id, *h);
            *h = d.id;
        }
        d.ack();
    }
    assert!(failed > 0, "failures were injected");
    stream.finish().await.expect("finish");
}

/// The fetch floor (docs/architecture.md, "The fetch floor") never passes
/// an event whose transaction is still open: events of other aggregates
/// committed after it, with higher ids, are delivered fetch after fetch
/// (each fetch leaves a checkpoint the floor could move to), rolled-back
/// inserts leave holes among them, and yet the events that commit last,
/// below all of those ids, are delivered on their commit's wake-up, not at
/// the next sweep (an hour away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_late_below_delivered_ids_are_delivered_without_waiting_for_the_sweep() {
    let db = TestDb::new("late_commit_floor").await;
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_secs(3_600))).await;
    let producer = db.client().await;
    let (mut c1, c2, mut c3) = (db.client().await, db.client().await, db.client().await);
    let t1 = c1.transaction().await.expect("t1");
    let late = insert(&t1, Uuid::new_v4(), "late").await;
    let mut t2 = None;
    let mut delivered = 0;
    for round in 0..5 {
        let doomed = c3.transaction().await.expect("doomed");
        insert(&doomed, Uuid::new_v4(), "doomed").await;
        doomed.rollback().await.expect("rollback");
        for _ in 0..20 {
            let id = insert(&producer, Uuid::new_v4(), "on_time").await;
            ack_next(&mut stream, id, 10).await;
            delivered += 1;
        }
        if round == 2 {
            c2.batch_execute("BEGIN").await.expect("begin t2");
            t2 = Some(insert(&c2, Uuid::new_v4(), "late too").await);
        }
    }
    assert_eq!(delivered, 100);
    t1.commit().await.expect("commit t1");
    ack_next(&mut stream, late, 10).await;
    let late_too = t2.expect("opened in round 2");
    assert!(late_too > late, "t2 drew its id after t1");
    c2.batch_execute("COMMIT").await.expect("commit t2");
    ack_next(&mut stream, late_too, 10).await;
    let after = insert(&producer, Uuid::new_v4(), "after").await;
    ack_next(&mut stream, after, 10).await;
    stream.finish().await.expect("finish: the acknowledgements are written");
    let unpublished: i64 = producer
        .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(unpublished, 0, "every committed event was delivered and acknowledged");
}

/// Events held back behind a failed event of their aggregate are passed by
/// the fetch floor (docs/architecture.md, "The fetch floor") while later
/// events of other aggregates are delivered, fetch after fetch. When the
/// failed event's retry is acknowledged (which bumps the unblock count),
/// they follow it at once, in order, not at the next notification or sweep
/// (an hour away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_held_back_behind_a_retry_follow_it_although_later_events_passed_them() {
    let db = TestDb::new("held_floor").await;
    let mut stream = start(&db, |b| {
        b.retry_policy(crate::consumer::fast_retries(&[3_000])).sweep_interval(Duration::from_secs(3_600))
    })
    .await;
    let c = db.client().await;
    let x = Uuid::new_v4();
    let x1 = insert(&c, x, "x1").await;
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, x1);
    d.fail("the sink is down");
    crate::support::eventually(10, "x1's failure written", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE next_retry_at IS NOT NULL", &[])
            .await
            .expect("count")
            .get::<_, i64>(0)
            == 1
    })
    .await;
    let x2 = insert(&c, x, "x2").await;
    let x3 = insert(&c, x, "x3").await;
    let mut got = Vec::new();
    for i in 0..60 {
        let id = insert(&c, Uuid::new_v4(), &format!("other {i}")).await;
        let d = next(&mut stream, 10).await;
        let got_id = d.id;
        got.push(got_id);
        d.ack();
        if got_id == x1 {
            break; // the retry came early (a slow machine): the case is moot
        }
        assert_eq!(got_id, id, "x2 and x3 stay held back while x1 waits for its retry");
    }
    let mut rest = Vec::new();
    while !(rest.contains(&x3) && (got.contains(&x1) || rest.contains(&x1))) {
        let d = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap_or_else(|_| panic!("after {rest:?}, nothing within 10 s (x1 {x1}, x2 {x2}, x3 {x3})"))
            .expect("stream");
        rest.push(d.id);
        d.ack();
    }
    let order: Vec<i64> = got.iter().chain(&rest).copied().filter(|id| [x1, x2, x3].contains(id)).collect();
    assert_eq!(order, [x1, x2, x3], "the aggregate's events in order, each once");
    stream.finish().await.expect("finish");
}

/// Events held back behind a dead letter follow its discard in order, the
/// first passed by the fetch floor while later events of other aggregates
/// are delivered, the second inserted above the floor. The discard bumps
/// the unblock count in its own transaction (triggers/outbox_unblock.sql),
/// and the next fetch, seeing a count it did not see before, reads from
/// below the first held event the floor passed. With `disable_first`, the
/// delete trigger is disabled before the discard: the fetch then reads the
/// count as not kept, which also differs. The sweep is an hour away, so
/// nothing else could free x1; the fetch after the discard is woken by a
/// new event, which comes after both.
async fn held_events_follow_a_discarded_dead_letter(tag: &str, disable_first: bool) {
    let db = TestDb::new(tag).await;
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_secs(3_600))).await;
    let c = db.client().await;
    let unblocks = async || -> Option<i64> {
        c.query_opt("SELECT term FROM events.outbox_terms WHERE scope = 'unblock'", &[])
            .await
            .expect("the unblock count")
            .map(|r| r.get(0))
    };
    let x = Uuid::new_v4();
    let dead: i64 = c
        .query_one(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, last_error, \
               next_retry_at) VALUES ('acct', $1, 'x0', '{}', 10, 'sink refused', 'infinity') RETURNING id",
            &[&x],
        )
        .await
        .expect("a dead letter")
        .get(0);
    let x1 = insert(&c, x, "x1").await;
    // Other aggregates' events, each delivered and acknowledged on its own,
    // so the floor moves on past x1 (held back all along).
    for i in 0..60 {
        let id = insert(&c, Uuid::new_v4(), &format!("other {i}")).await;
        let d = next(&mut stream, 10).await;
        assert_eq!(d.id, id, "x1 stays held back behind the dead letter {dead}");
        d.ack();
    }
    let x2 = insert(&c, x, "x2").await;
    let other = insert(&c, Uuid::new_v4(), "other after x2").await;
    let d = next(&mut stream, 10).await;
    assert_eq!(d.id, other, "x2 is held back too");
    d.ack();
    assert_eq!(unblocks().await, None, "acknowledging fresh events frees nothing");
    if disable_first {
        c.batch_execute("ALTER TABLE events.outbox DISABLE TRIGGER outbox_unblock_delete").await.expect("disable");
    }
    let discarded = pg_outbox::dead_letters::discard(&c, &pg_outbox::dead_letters::Filter::ids(vec![dead]))
        .await
        .expect("discard the dead letter");
    assert_eq!(discarded, [dead]);
    assert_eq!(unblocks().await.is_some(), !disable_first, "the discard counts what it freed while the trigger fires");
    let wake = insert(&c, Uuid::new_v4(), "wake").await;
    let mut got = Vec::new();
    while !got.contains(&wake) || !got.contains(&x1) || !got.contains(&x2) {
        let d = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap_or_else(|_| panic!("after {got:?}, nothing within 10 s (x1 {x1}, x2 {x2}, wake {wake})"))
            .expect("stream");
        got.push(d.id);
        d.ack();
    }
    assert_eq!(got, [x1, x2, wake], "the freed events first, in order, then the event that woke the fetch");
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_held_back_behind_a_discarded_dead_letter_follow_it_although_the_floor_passed_them() {
    held_events_follow_a_discarded_dead_letter("held_discard", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_events_follow_a_dead_letter_discarded_with_the_unblock_trigger_disabled() {
    held_events_follow_a_discarded_dead_letter("held_discard_off", true).await;
}

/// How a test makes an acknowledged event fresh again below the floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rewind {
    /// `published_at` back to NULL under `session_replication_role =
    /// replica` (the guard lets it through there).
    Unpublish,
    /// The row deleted and inserted again with its id under
    /// `session_replication_role = replica`, as a restore does.
    Restore,
    /// As `Unpublish`, with `outbox_rewind` disabled before: the fetch reads
    /// the count as not kept, which differs from the count it last saw.
    UnpublishWithTriggerDisabled,
    /// As `Unpublish`, with `outbox_rewind` disabled before and enabled
    /// again after, with no fetch in between: nothing counts the change, so
    /// the floor (past the event) hides it until it is next dropped.
    Hidden,
}

/// Makes sure the floor has passed every event acknowledged so far. The
/// floor moves past a fetch's rows once a later fetch's snapshot xmin
/// reaches the next transaction id the first saw (docs/architecture.md,
/// "The fetch floor"), and xmin is the cluster's: a transaction open in
/// another database (another test's) holds it back. So this takes a
/// transaction id after those fetches, waits (up to 60 s) until every
/// transaction up to it has ended, then delivers two more events: the
/// first fetch sees that xmin (and moves the floor past the oldest
/// checkpoint it was offered), the second is offered the newest checkpoint
/// that xmin passed, past every event acknowledged before.
async fn floor_passes(c: &tokio_postgres::Client, stream: &mut pg_outbox::EventStream) {
    let after: i64 =
        c.query_one("SELECT txid_current()", &[]).await.expect("a transaction id after the fetches").get(0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let xmin: i64 = c
            .query_one("SELECT txid_snapshot_xmin(txid_current_snapshot())", &[])
            .await
            .expect("the snapshot's xmin")
            .get(0);
        if xmin > after {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "transactions before id {after} still open after 60 s (xmin {xmin})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..2 {
        let probe = insert(c, Uuid::new_v4(), "floor").await;
        ack_next(stream, probe, 10).await;
    }
}

/// An acknowledged event made fresh again below the fetch floor
/// (docs/architecture.md, "The fetch floor") is fetched again by the next
/// fetch, which a new event wakes, before that event: the change bumps the
/// rewind count in its own transaction (triggers/outbox_rewind.sql), and a
/// fetch that reads another count reads from the first fresh row. The
/// sweep is an hour away, so the floor is dropped by nothing else. `Hidden`
/// shows that the floor had passed the event: there it is not fetched.
async fn rewound_event_below_the_floor(tag: &str, how: Rewind) {
    let db = TestDb::new(tag).await;
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_secs(3_600))).await;
    let c = db.client().await;
    let replica = db.client().await;
    replica.batch_execute("SET session_replication_role = replica").await.expect("replica role");
    let rewinds = async || -> Option<i64> {
        c.query_opt("SELECT term FROM events.outbox_terms WHERE scope = 'rewind'", &[])
            .await
            .expect("the rewind count")
            .map(|r| r.get(0))
    };
    let mut ids = Vec::new();
    for i in 0..60 {
        let id = insert(&c, Uuid::new_v4(), &format!("e{i}")).await;
        ack_next(&mut stream, id, 10).await;
        ids.push(id);
    }
    // Wait until the acknowledgements are written: the event to rewind must
    // be published first.
    let target = ids[5];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let published: bool = c
            .query_one("SELECT published_at IS NOT NULL FROM events.outbox WHERE id = $1", &[&target])
            .await
            .expect("published?")
            .get(0);
        if published {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "event {target} not acknowledged within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rewinds().await, None, "producers' inserts and acknowledgements count no rewind");
    if how == Rewind::Hidden {
        floor_passes(&c, &mut stream).await;
    }
    if matches!(how, Rewind::UnpublishWithTriggerDisabled | Rewind::Hidden) {
        c.batch_execute("ALTER TABLE events.outbox DISABLE TRIGGER outbox_rewind").await.expect("disable");
    }
    match how {
        Rewind::Restore => {
            // The copy a dump taken before the acknowledgement holds:
            // unpublished.
            replica
                .batch_execute(&format!(
                    "BEGIN; \
                     CREATE TEMP TABLE saved ON COMMIT DROP AS SELECT * FROM events.outbox WHERE id = {target}; \
                     UPDATE saved SET published_at = NULL; \
                     DELETE FROM events.outbox WHERE id = {target}; \
                     INSERT INTO events.outbox SELECT * FROM saved; \
                     COMMIT"
                ))
                .await
                .expect("restore an unpublished copy with its id");
        }
        _ => {
            let n = replica
                .execute("UPDATE events.outbox SET published_at = NULL WHERE id = $1", &[&target])
                .await
                .expect("unpublish");
            assert_eq!(n, 1);
        }
    }
    match how {
        Rewind::Unpublish | Rewind::Restore => assert!(rewinds().await.is_some(), "the change is counted"),
        Rewind::UnpublishWithTriggerDisabled | Rewind::Hidden => {
            assert_eq!(rewinds().await, None, "nothing counted with the trigger disabled")
        }
    }
    if how == Rewind::Hidden {
        c.batch_execute("ALTER TABLE events.outbox ENABLE ALWAYS TRIGGER outbox_rewind").await.expect("enable");
    }
    let wake = insert(&c, Uuid::new_v4(), "wake").await;
    if how == Rewind::Hidden {
        ack_next(&mut stream, wake, 10).await;
        let more = tokio::time::timeout(Duration::from_secs(2), stream.next()).await;
        assert!(
            more.is_err(),
            "the floor passed event {target}: nothing else is fetched ({:?})",
            more.ok().flatten().map(|d| d.id)
        );
    } else {
        ack_next(&mut stream, target, 10).await;
        ack_next(&mut stream, wake, 10).await;
    }
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_unpublished_below_the_floor_is_fetched_again_by_the_next_fetch() {
    rewound_event_below_the_floor("rewind_unpublish", Rewind::Unpublish).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_restored_with_its_id_below_the_floor_is_fetched_again_by_the_next_fetch() {
    rewound_event_below_the_floor("rewind_restore", Rewind::Restore).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_unpublished_with_the_rewind_trigger_disabled_is_fetched_again_by_the_next_fetch() {
    rewound_event_below_the_floor("rewind_disabled", Rewind::UnpublishWithTriggerDisabled).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_unpublished_while_nothing_counts_it_waits_for_the_floor_to_be_dropped() {
    rewound_event_below_the_floor("rewind_hidden", Rewind::Hidden).await;
}

//! Several consumers on one outbox: standby takeover (single mode),
//! partitioned sharing with per-aggregate order, and competing consumers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::{EventStream, Mode};
use uuid::Uuid;

use crate::consumer::{ack_next, start};
use crate::support::{TestDb, insert_seed_events};

/// (consumer index, id, aggregate) in the order each consumer received them.
pub(crate) type Log = Arc<Mutex<Vec<(usize, i64, Uuid)>>>;

pub(crate) fn spawn_reader(mut stream: EventStream, idx: usize, log: Log) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(d) = stream.next().await {
            log.lock().expect("log").push((idx, d.id, d.aggregate_id));
            d.ack();
        }
        stream.finish().await.expect("finish");
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_mode_has_one_active_consumer_and_a_standby_takes_over() {
    let db = TestDb::new("standby").await;
    let c = db.client().await;
    let mut a = start(&db, |b| b.mode(Mode::Single)).await;
    let mut b = start(&db, |b| b.mode(Mode::Single)).await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 20).await;
    // Exactly one of them delivers.
    let first = tokio::select! {
        d = a.next() => { let d = d.expect("a"); let id = d.id; d.ack(); ("a", id) }
        d = b.next() => { let d = d.expect("b"); let id = d.id; d.ack(); ("b", id) }
    };
    assert_eq!(first.1, ids[0]);
    let (mut active, mut standby) = if first.0 == "a" { (a, b) } else { (b, a) };
    for want in &ids[1..] {
        ack_next(&mut active, *want, 10).await;
    }
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(500), standby.next()).await {
        panic!("the standby delivered {} while the other is active", d.id);
    }
    // The active one stops; the standby takes over.
    active.finish().await.expect("finish");
    let stopped = Instant::now();
    let more = insert_seed_events(&c, Uuid::new_v4(), 5).await;
    for want in &more {
        ack_next(&mut standby, *want, 10).await;
    }
    eprintln!("standby took over and delivered within {:?} of the active consumer stopping", stopped.elapsed());
    standby.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_consumers_share_the_work_and_keep_each_aggregate_in_order() {
    let db = TestDb::new("partitioned").await;
    let c = db.client().await;
    let log: Log = Arc::default();
    let mode = Mode::Partitioned { partitions: 8 };
    let mut readers = Vec::new();
    for i in 0..3 {
        let s = start(&db, |b| b.mode(mode).batch_size(10)).await;
        readers.push((s.shutdown_handle(), spawn_reader(s, i, log.clone())));
    }
    // Let the three settle on a fair share (rebalancing runs about every second).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let aggs: Vec<Uuid> = (0..24).map(|_| Uuid::new_v4()).collect();
    let mut committed = Vec::new();
    for round in 0..10 {
        for a in &aggs {
            committed.extend(insert_seed_events(&c, *a, 1 + (round % 2)).await);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while log.lock().expect("log").len() < committed.len() {
        assert!(Instant::now() < deadline, "not all events delivered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // One consumer leaves; the others take its partitions.
    let (h, r) = readers.remove(0);
    h.shutdown();
    r.await.expect("reader");
    for a in &aggs {
        committed.extend(insert_seed_events(&c, *a, 2).await);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while log.lock().expect("log").len() < committed.len() {
        assert!(Instant::now() < deadline, "events of the departed consumer's partitions were not taken over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (h, r) in readers {
        h.shutdown();
        r.await.expect("reader");
    }
    let log = log.lock().expect("log").clone();
    let ids: Vec<i64> = log.iter().map(|e| e.1).collect();
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "each event delivered once in a clean run");
    assert_eq!(ids.iter().copied().collect::<HashSet<_>>(), committed.iter().copied().collect::<HashSet<_>>());
    // Per-aggregate order across all consumers, in the order deliveries were logged.
    let mut last: HashMap<Uuid, i64> = HashMap::new();
    for (_, id, agg) in &log {
        if let Some(prev) = last.insert(*agg, *id) {
            assert!(prev < *id, "aggregate {agg}: {id} after {prev}");
        }
    }
    let per_consumer: HashSet<usize> = log.iter().map(|e| e.0).collect();
    assert_eq!(per_consumer.len(), 3, "all three consumers took a share");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_consumers_never_deliver_an_event_twice_in_a_clean_run() {
    let db = TestDb::new("competing").await;
    let c = db.client().await;
    let log: Log = Arc::default();
    let mut readers = Vec::new();
    for i in 0..2 {
        let s = start(&db, |b| b.mode(Mode::Competing).batch_size(10)).await;
        readers.push((s.shutdown_handle(), spawn_reader(s, i, log.clone())));
    }
    let mut committed = Vec::new();
    for _ in 0..20 {
        committed.extend(insert_seed_events(&c, Uuid::new_v4(), 10).await);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left: i64 =
            c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("q").get(0);
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{left} events still unpublished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Idle competing consumers hold no row lock, but their membership
    // lock: a single-mode consumer is refused beside them.
    let e = pg_outbox::Consumer::builder(db.options())
        .mode(Mode::Single)
        .start()
        .await
        .expect_err("single beside idle competing consumers")
        .to_string();
    assert!(e.contains("this outbox as competing") && e.contains("configured as single"), "{e}");
    for (h, r) in readers {
        h.shutdown();
        r.await.expect("reader");
    }
    let ids: Vec<i64> = log.lock().expect("log").iter().map(|e| e.1).collect();
    assert_eq!(ids.len(), committed.len(), "each event exactly once");
    assert_eq!(ids.iter().copied().collect::<HashSet<_>>(), committed.iter().copied().collect::<HashSet<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_loses_its_session_hands_out_nothing_it_had_buffered() {
    let db = TestDb::new("stale_buffer").await;
    let c = db.client().await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 20).await;
    let mut a = start(&db, |b| b.mode(Mode::Single).batch_size(5).buffer(20)).await;
    let first = crate::consumer::next(&mut a, 10).await;
    assert_eq!(first.id, ids[0]);
    // The outbox lock's key, as A holds it (bigint key = classid << 32 | objid).
    let key: i64 = c
        .query_one(
            "SELECT (l.classid::bigint << 32) | l.objid::bigint FROM pg_locks l JOIN pg_stat_activity s ON s.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND s.datname = $1",
            &[&db.name],
        )
        .await
        .expect("A holds the outbox lock")
        .get(0);
    // A's session (and its lock) goes away while it has events buffered; the
    // test takes the lock, so no consumer may deliver now.
    assert_eq!(db.terminate_pid_of_lock_holder().await, 1);
    crate::support::eventually(10, "the lock to be free", || async {
        c.query_one("SELECT pg_try_advisory_lock($1)", &[&key]).await.expect("lock").get::<_, bool>(0)
    })
    .await;
    // The server ended the session; the consumer learns it when its
    // connection task reads the closed socket, which a loaded machine may
    // run a moment later. Once it knows (it is no longer the leader),
    // nothing it had buffered may come out.
    let health = a.health();
    crate::support::eventually(10, "the consumer to notice it lost the outbox lock", || {
        let role = health.get().role;
        async move { role != pg_outbox::health::Role::Leader }
    })
    .await;
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(700), a.next()).await {
        panic!("the consumer that lost its session handed out buffered event {}", d.id);
    }
    // The first delivery was in hand: its acknowledgement is written after
    // the reconnect. Once the lock is free again, A goes on from there.
    first.ack();
    c.execute("SELECT pg_advisory_unlock($1)", &[&key]).await.expect("unlock");
    for want in &ids[1..] {
        ack_next(&mut a, *want, 15).await;
    }
    a.finish().await.expect("finish a");
}

/// Start a consumer of `mode` and wait until it holds what its mode takes
/// (the leader lock, or partitions): one event of a fresh aggregate
/// delivered and acknowledged.
async fn leading(db: &TestDb, mode: Mode) -> EventStream {
    let mut s = pg_outbox::Consumer::builder(db.options()).mode(mode).start().await.expect("start");
    let c = db.client().await;
    insert_seed_events(&c, Uuid::new_v4(), 1).await;
    let d = tokio::time::timeout(Duration::from_secs(20), s.next()).await.expect("a delivery").expect("open");
    d.ack();
    s
}

#[tokio::test]
async fn a_relay_of_another_mode_or_partition_count_is_refused_at_start() {
    let db = TestDb::new("modes_mixed").await;
    let refused = |mode: Mode| {
        let db = &db;
        async move {
            match pg_outbox::Consumer::builder(db.options()).mode(mode).start().await {
                Ok(s) => {
                    s.finish().await.expect("finish");
                    panic!("{mode:?} started beside a relay of another configuration")
                }
                Err(e) => e.to_string(),
            }
        }
    };
    let single = leading(&db, Mode::Single).await;
    let e = refused(Mode::Partitioned { partitions: 4 }).await;
    assert!(e.contains("as single") && e.contains("partitioned 4"), "{e}");
    let e = refused(Mode::Competing).await;
    assert!(e.contains("as single") && e.contains("configured as competing"), "{e}");
    // The same configuration is welcome (a standby).
    let standby = pg_outbox::Consumer::builder(db.options()).start().await.expect("a second single-mode relay");
    standby.finish().await.expect("finish the standby");
    single.finish().await.expect("finish");

    let four = leading(&db, Mode::Partitioned { partitions: 4 }).await;
    let e = refused(Mode::Single).await;
    assert!(e.contains("as partitioned") && e.contains("configured as single"), "{e}");
    let e = refused(Mode::Partitioned { partitions: 2 }).await;
    assert!(e.contains("as partitioned 4") && e.contains("partitioned 2"), "{e}");
    let e = refused(Mode::Competing).await;
    assert!(e.contains("as partitioned") && e.contains("configured as competing"), "{e}");
    let same = pg_outbox::Consumer::builder(db.options())
        .mode(Mode::Partitioned { partitions: 4 })
        .start()
        .await
        .expect("another member with the same count");
    same.finish().await.expect("finish the member");
    four.finish().await.expect("finish");
    // Once they are gone, another configuration starts.
    let single = pg_outbox::Consumer::builder(db.options()).start().await.expect("single once the others stopped");
    single.finish().await.expect("finish");

    // --partitions belongs to --mode partitioned: refused beside another
    // mode, naming both flags, before anything connects.
    for mode in ["single", "competing"] {
        let (code, _, err) = crate::support::cli(&["relay", "--mode", mode, "--partitions", "8", "--sink", "stdout"])
            .url(&db.url())
            .run()
            .await
            .parts();
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("--partitions 8 applies to --mode partitioned") && err.contains(mode), "{err}");
    }
}

#[tokio::test]
async fn status_shows_each_partition_with_its_holder_and_term() {
    let db = TestDb::new("modes_status_partitions").await;
    let c = db.client().await;
    let none = pg_outbox::status::read(&c).await.expect("status");
    assert!(none.partitions.is_empty() && none.leader.is_none(), "no relay: {:?}", none.partitions);
    let four = leading(&db, Mode::Partitioned { partitions: 4 }).await;
    crate::support::eventually(10, "one member to hold all four partitions", || async {
        pg_outbox::status::read(&c).await.expect("status").partitions.len() == 4
    })
    .await;
    let s = pg_outbox::status::read(&c).await.expect("status");
    assert!(s.leader.is_none(), "partitioned mode takes no outbox lock");
    let held: Vec<i32> = s.partitions.iter().map(|h| h.partition).collect();
    assert_eq!(held, [0, 1, 2, 3], "one member holds every partition: {:?}", s.partitions);
    for h in &s.partitions {
        assert_eq!(h.partitions, Some(4), "{h:?}");
        assert!(h.term.is_some() && h.pid > 0, "{h:?}");
        // The holder is this test's own consumer: its process, version and
        // a fresh heartbeat, beside the server backend's pid.
        let relay = h.relay.as_ref().unwrap_or_else(|| panic!("the holder's relay: {h:?}"));
        assert_eq!(relay.process_id, i32::try_from(std::process::id()).expect("pid"), "{h:?}");
        assert_eq!(relay.version, env!("CARGO_PKG_VERSION"), "{h:?}");
        assert!(!relay.host.is_empty(), "{h:?}");
        assert!(h.heartbeat_age_seconds.is_some_and(|a| a < 15.0), "{h:?}");
    }
    let json = serde_json::to_value(&s).expect("json");
    assert_eq!(json["partitions"][0]["partitions"], 4, "{}", json["partitions"]);
    assert_eq!(json["partitions"][0]["relay"]["version"], env!("CARGO_PKG_VERSION"), "{}", json["partitions"]);
    let out = crate::support::cli(&["status"]).url(&db.url()).run().await;
    assert!(out.ok(), "{out:?}");
    let line = out.stdout.lines().find(|l| l.starts_with("partitions")).unwrap_or_default().to_string();
    assert!(line.contains(&format!("relay {} on ", std::process::id())) && line.contains("heartbeat"), "{line}");
    four.finish().await.expect("finish");
    let after = pg_outbox::status::read(&c).await.expect("status");
    assert!(after.partitions.is_empty(), "released at a graceful stop: {:?}", after.partitions);
}

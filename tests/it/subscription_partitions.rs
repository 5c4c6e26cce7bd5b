//! A named subscription in partitioned mode: its consumers share its
//! partitions under its own locks and terms (a family apart from the
//! outbox's), keep each aggregate in order and deliver each event once in
//! a clean run, hand a departed consumer's partitions over, and read at
//! most `SUBSCRIPTION_WINDOW` ids past the cursor they share.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use pg_outbox::Mode;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::consumer::{next, start};
use crate::modes::{Log, spawn_reader};
use crate::subscriptions::create;
use crate::support::{TestDb, eventually, insert_seed_events};

async fn delivered(log: &Log, want: usize, secs: u64, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while log.lock().expect("log").len() < want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {} of {want} delivered",
            log.lock().expect("log").len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The scopes of `events.outbox_terms`, sorted, comma-separated.
async fn scopes(c: &Client) -> String {
    c.query_one("SELECT coalesce(string_agg(scope, ',' ORDER BY scope), '') FROM events.outbox_terms", &[])
        .await
        .expect("terms")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_readers_of_a_subscription_share_it_in_order_and_take_over_a_departed_ones_share() {
    let db = TestDb::new("sub_partitioned").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let mode = Mode::Partitioned { partitions: 4 };
    let log: Log = Arc::default();
    let mut readers = Vec::new();
    for i in 0..2 {
        let s = start(&db, |b| b.subscription("audit").mode(mode).batch_size(10)).await;
        readers.push((s.shutdown_handle(), spawn_reader(s, i, log.clone())));
    }
    // A single-mode reader of the same subscription would deliver its
    // events twice: refused, naming the subscription. The default's relay
    // is another family: it starts.
    let e = pg_outbox::Consumer::builder(db.options())
        .subscription("audit")
        .start()
        .await
        .expect_err("single beside partitioned")
        .to_string();
    assert!(e.contains("subscription \"audit\"") && e.contains("partitioned"), "{e}");
    let default = start(&db, |b| b).await;
    eventually(10, "both readers hold partitions", || async {
        let held: i64 = c
            .query_one(
                "SELECT count(DISTINCT holder_pid) FROM events.outbox_terms \
                 WHERE scope LIKE 'subscription:audit:partition:%/4' AND NOT released",
                &[],
            )
            .await
            .expect("holders")
            .get(0);
        held == 2
    })
    .await;
    let aggs: Vec<Uuid> = (0..24).map(|_| Uuid::new_v4()).collect();
    let mut committed = Vec::new();
    for round in 0..6 {
        for a in &aggs {
            committed.extend(insert_seed_events(&c, *a, 1 + (round % 2)).await);
        }
    }
    delivered(&log, committed.len(), 30, "both readers").await;
    // One reader leaves; the other takes its partitions.
    let (h, r) = readers.remove(0);
    h.shutdown();
    r.await.expect("reader");
    for a in &aggs {
        committed.extend(insert_seed_events(&c, *a, 2).await);
    }
    delivered(&log, committed.len(), 30, "the departed reader's partitions taken over").await;
    let top = *committed.iter().max().expect("events");
    eventually(15, "the shared cursor at the last event", || async {
        let row = c
            .query_one(
                "SELECT cursor_id, cardinality(settled) FROM events.outbox_subscriptions WHERE name = 'audit'",
                &[],
            )
            .await
            .expect("cursor");
        (row.get::<_, i64>(0), row.get::<_, i32>(1)) == (top, 0)
    })
    .await;
    for (h, r) in readers {
        h.shutdown();
        r.await.expect("reader");
    }
    default.finish().await.expect("default");
    let log = log.lock().expect("log").clone();
    let ids: Vec<i64> = log.iter().map(|e| e.1).collect();
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "each event delivered once in a clean run");
    assert_eq!(ids.iter().copied().collect::<HashSet<_>>(), committed.iter().copied().collect::<HashSet<_>>());
    let mut last: HashMap<Uuid, i64> = HashMap::new();
    for (_, id, agg) in &log {
        if let Some(prev) = last.insert(*agg, *id) {
            assert!(prev < *id, "aggregate {agg}: {id} after {prev}");
        }
    }
    assert_eq!(log.iter().map(|e| e.0).collect::<HashSet<_>>().len(), 2, "both readers took a share");
    // Its own terms, one per partition; the default's relay took the
    // outbox's. No other partition scope.
    let all = scopes(&c).await;
    let want = "outbox,subscription:audit:partition:0/4,subscription:audit:partition:1/4,\
                subscription:audit:partition:2/4,subscription:audit:partition:3/4";
    assert_eq!(all, want);
    // The subscription's readers leave `published_at` alone (the default's
    // consumer acknowledged nothing).
    let unpublished: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("count").get(0);
    assert_eq!(unpublished, committed.len() as i64);
}

/// The log signals this process's consumers emit (field `signal`), with
/// their subscription, as `(signal, subscription)`: a global subscriber
/// installed once, at warn (nothing else in this test binary installs one).
fn signals() -> Seen {
    static SEEN: std::sync::OnceLock<Seen> = std::sync::OnceLock::new();
    SEEN.get_or_init(|| {
        let seen: Seen = Arc::default();
        let writer = {
            let seen = seen.clone();
            move || Line(seen.clone(), Vec::new())
        };
        let subscriber =
            tracing_subscriber::fmt().json().with_max_level(tracing::Level::WARN).with_writer(writer).finish();
        tracing::subscriber::set_global_default(subscriber).expect("the test process's subscriber");
        seen
    })
    .clone()
}

/// One JSON log line, parsed for its `signal` and `subscription` once
/// written out.
struct Line(Seen, Vec<u8>);

/// `(signal, subscription, fields)` of each log line that had both.
type Seen = Arc<Mutex<Vec<(String, String, serde_json::Value)>>>;

impl std::io::Write for Line {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.1.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&self.1) else { return };
        let field = |k: &str| v["fields"][k].as_str().map(str::to_string);
        if let (Some(signal), Some(sub)) = (field("signal"), field("subscription")) {
            self.0.lock().expect("signals").push((signal, sub, v["fields"].clone()));
        }
    }
}

/// A partition whose event stays in flight holds the shared cursor; the
/// other partitions read on up to the window above it, then wait (log
/// signal `subscription_window`), so the ids settled above the cursor stay
/// bounded; once the event is settled, the rest flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_holding_the_cursor_stops_the_others_at_the_window() {
    const WINDOW: i64 = 20_000;
    let signals = signals();
    let db = TestDb::new("sub_window").await;
    let c = db.client().await;
    create(&c, "window-check").await;
    let held_agg = Uuid::new_v4();
    let held_ids = insert_seed_events(&c, held_agg, 1).await;
    // About 25 000 more, on 500 aggregates, in one statement.
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'subscription', ('00000000-0000-0000-0000-' || lpad((g % 500)::text, 12, '0'))::uuid, \
                'PaymentSucceeded', jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g)) \
           FROM generate_series(1, 25000) g",
        &[],
    )
    .await
    .expect("backlog");
    let top: i64 = c.query_one("SELECT max(id) FROM events.outbox", &[]).await.expect("top").get(0);
    let mut stream =
        start(&db, |b| b.subscription("window-check").mode(Mode::Partitioned { partitions: 2 }).batch_size(500)).await;
    let first = next(&mut stream, 20).await;
    assert_eq!(first.id, held_ids[0]);
    let mut seen_ids: HashSet<i64> = HashSet::from([first.id]);
    let mut highest = 0;
    loop {
        match tokio::time::timeout(Duration::from_secs(3), stream.next()).await {
            Ok(Some(d)) => {
                highest = highest.max(d.id);
                assert!(seen_ids.insert(d.id), "event {} delivered twice", d.id);
                assert_ne!(d.aggregate_id, held_agg, "its aggregate waits for the event in flight");
                d.ack();
            }
            Ok(None) => panic!("the stream ended"),
            Err(_) => break,
        }
    }
    let (cursor, settled): (i64, i32) = {
        let row = c
            .query_one(
                "SELECT cursor_id, cardinality(settled) FROM events.outbox_subscriptions WHERE name = 'window-check'",
                &[],
            )
            .await
            .expect("cursor");
        (row.get(0), row.get(1))
    };
    let window_line = || {
        let seen = signals.lock().expect("signals");
        seen.iter().find(|(s, n, _)| s == "subscription_window" && n == "window-check").map(|(.., f)| f.clone())
    };
    eventually(10, "the signal subscription_window", || {
        let found = window_line().is_some();
        async move { found }
    })
    .await;
    // It names what holds the cursor: the event in flight.
    let fields = window_line().expect("the window line");
    assert_eq!(fields["held_by_event"].as_i64(), Some(held_ids[0]), "{fields}");
    let message = fields["message"].as_str().unwrap_or_default();
    assert!(message.contains(&format!("event {} is not settled", held_ids[0])), "{message}");
    let n = seen_ids.len() - 1;
    eprintln!("window: cursor {cursor}, highest read {highest} ({n} events), {settled} settled above the cursor");
    assert!(cursor < held_ids[0], "the event in flight holds the cursor ({cursor})");
    assert!(highest <= cursor + WINDOW, "read {highest}, past the window above cursor {cursor}");
    assert!(highest < top, "the reader stopped short of the backlog's end ({top})");
    assert!(i64::from(settled) <= WINDOW, "{settled} ids kept settled");
    assert!(n > 1_000, "the other partitions read on while the cursor was held ({n} events)");
    // Settled now: the cursor moves and the rest follows, each once.
    first.ack();
    while seen_ids.len() < 25_001 {
        let d = next(&mut stream, 20).await;
        assert!(seen_ids.insert(d.id), "event {} delivered twice", d.id);
        d.ack();
    }
    eventually(15, "the cursor at the backlog's end", || async {
        let cur: i64 = c
            .query_one("SELECT cursor_id FROM events.outbox_subscriptions WHERE name = 'window-check'", &[])
            .await
            .expect("cursor")
            .get(0);
        cur == top
    })
    .await;
    stream.finish().await.expect("finish");
}

/// Two readers of one subscription that passed the check at start with
/// different configurations: a partitioned one whose sessions were cut (its
/// role locked out meanwhile) and a single-mode one started while it was
/// away. Once the first reconnects, the younger sessions' reader (the one
/// that came back) stops within a gauges' turn, naming the other, and the
/// older delivers on: one configuration, said out loud, rather than events
/// delivered twice or left to no reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_comes_back_beside_another_configuration_stops_and_the_other_goes_on() {
    let db = TestDb::new("sub_conflict").await;
    let c = db.client().await;
    create(&c, "audit").await;
    let role = format!("pgo_conflict_{}", std::process::id());
    c.batch_execute(&format!(
        "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA events TO {role}; \
         GRANT ALL ON ALL TABLES IN SCHEMA events TO {role}; GRANT ALL ON ALL SEQUENCES IN SCHEMA events TO {role}"
    ))
    .await
    .expect("role");
    let mut cfg = db.pg.clone();
    cfg.user(&role);
    let mut away = pg_outbox::Consumer::builder(crate::support::options_of(&cfg))
        .subscription("audit")
        .mode(Mode::Partitioned { partitions: 4 })
        .reconnect_max_delay(Duration::from_secs(1))
        .start()
        .await
        .expect("the partitioned reader");
    let held = || async {
        c.query_one(
            "SELECT count(*) FROM events.outbox_terms t JOIN pg_stat_activity a ON a.pid = t.holder_pid \
             WHERE t.scope LIKE 'subscription:audit:partition:%' AND NOT t.released AND a.usename = $1",
            &[&role],
        )
        .await
        .expect("held")
        .get::<_, i64>(0)
    };
    eventually(10, "the partitioned reader holds its partitions", || async { held().await == 4 }).await;
    c.batch_execute(&format!(
        "ALTER ROLE {role} NOLOGIN; SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ))
    .await
    .expect("cut off");
    eventually(10, "its sessions gone", || async {
        let n: i64 = c
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE usename = $1", &[&role])
            .await
            .expect("sessions")
            .get(0);
        n == 0
    })
    .await;
    let mut single = start(&db, |b| b.subscription("audit")).await;
    c.batch_execute(&format!("ALTER ROLE {role} LOGIN")).await.expect("back");
    // The one that comes back (it may retake its partitions first, or find
    // the other configuration before it does) is the younger: it stops,
    // saying so.

    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(d) = away.next().await {
            d.release();
        }
    })
    .await;
    assert!(ended.is_ok(), "the reader that came back beside another configuration did not stop");
    let e = away.finish().await.expect_err("it stops with the conflict").to_string();
    assert!(
        e.contains("subscription \"audit\" as single") && e.contains("partitioned 4") && e.contains("started last"),
        "{e}"
    );
    // The other delivers on, every event.
    let ids = insert_seed_events(&c, Uuid::new_v4(), 20).await;
    let mut seen = Vec::new();
    while seen.len() < ids.len() {
        let d = next(&mut single, 20).await;
        if !seen.contains(&d.id) {
            seen.push(d.id);
        }
        d.ack();
    }
    assert_eq!(seen, ids);
    single.finish().await.expect("finish");
    c.batch_execute(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'; \
         DROP OWNED BY {role}; DROP ROLE {role}"
    ))
    .await
    .expect("drop the role");
}

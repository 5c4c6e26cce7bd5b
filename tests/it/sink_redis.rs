//! The Redis Streams sink through a real `pg-outbox relay` process and the
//! Redis server on 127.0.0.1:6379: every event arrives once, in
//! per-aggregate order, with the documented fields; `--redis-maxlen` trims;
//! an unreachable Redis stops the relay at start with a clear error.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use crate::brokers::{self, Sent};
use crate::needs;
use crate::relay_proc;
use crate::support::{self, TestDb};

pub(crate) const REDIS_URL: &str = "redis://127.0.0.1:6379";

/// Stream keys under a unique prefix for one test; deleted when dropped.
pub(crate) struct TestKeys {
    client: redis::Client,
    pub(crate) prefix: String,
}

pub(crate) type Entries = Vec<(String, HashMap<String, String>)>;

impl TestKeys {
    pub(crate) fn new(tag: &str) -> TestKeys {
        let client = redis::Client::open(REDIS_URL).expect("Redis URL");
        TestKeys { client, prefix: format!("pgo_it_{tag}_{}", uuid::Uuid::new_v4().simple()) }
    }

    pub(crate) async fn conn(&self) -> redis::aio::MultiplexedConnection {
        self.client.get_multiplexed_async_connection().await.expect("connect to Redis")
    }

    /// Every entry of `key`, oldest first (XRANGE key - +).
    pub(crate) async fn entries(&self, key: &str) -> Entries {
        redis::cmd("XRANGE").arg(key).arg("-").arg("+").query_async(&mut self.conn().await).await.expect("XRANGE")
    }

    pub(crate) async fn len(&self, key: &str) -> usize {
        redis::cmd("XLEN").arg(key).query_async(&mut self.conn().await).await.expect("XLEN")
    }
}

impl Drop for TestKeys {
    fn drop(&mut self) {
        let client = self.client.clone();
        let pattern = format!("{}*", self.prefix);
        let _ = std::thread::spawn(move || {
            let mut c = client.get_connection().ok()?;
            let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(&mut c).ok()?;
            if keys.is_empty() {
                return Some(());
            }
            redis::cmd("DEL").arg(keys).query::<()>(&mut c).ok()
        })
        .join();
    }
}

/// Check one entry against the event the test published; returns its id.
fn check_entry(fields: &HashMap<String, String>, sent: &BTreeMap<i64, Sent>) -> i64 {
    let id: i64 = fields.get("id").and_then(|v| v.parse().ok()).expect("field id is the outbox id");
    let e = sent.get(&id).unwrap_or_else(|| panic!("entry for unknown id {id}"));
    let id_text = id.to_string();
    let agg_text = e.aggregate_id.to_string();
    let mut want: BTreeMap<&str, &str> = BTreeMap::from([
        ("id", id_text.as_str()),
        ("type", e.event_type.as_str()),
        ("aggregate_type", e.aggregate_type.as_str()),
        ("aggregate", agg_text.as_str()),
        ("content_type", "application/json"),
        ("correlation_id", e.correlation_id.as_str()),
        ("traceparent", e.traceparent.as_str()),
    ]);
    if let Some(c) = &e.causation_id {
        want.insert("causation_id", c);
    }
    let got: BTreeMap<&str, &str> = fields
        .iter()
        .filter(|(k, _)| *k != "payload" && *k != "occurred_at")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(got, want, "fields of event {id}");
    let body: Value = serde_json::from_str(&fields["payload"]).expect("payload is JSON");
    assert_eq!(body["occurred_at"], fields["occurred_at"].as_str(), "field occurred_at of {id}");
    assert_eq!(body["id"], id);
    assert_eq!(body["aggregate_id"], agg_text.as_str());
    assert_eq!(body["payload"], e.payload, "payload of {id}");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sink_appends_each_event_once_in_order_with_its_fields() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("deliver");
    let db = TestDb::new("sink_redis_deliver").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 12, "t").await;
    let template = format!("{}:{{aggregate_type}}", keys.prefix);
    let relay =
        relay_proc::start(&db, &["--sink", REDIS_URL, "--redis-stream", &template, "--sweep-interval", "200ms"]).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;
    let mut ids = Vec::new();
    for aggregate_type in ["order", "invoice"] {
        let key = format!("{}:{aggregate_type}", keys.prefix);
        let entries = keys.entries(&key).await;
        assert!(!entries.is_empty(), "stream {key} has entries");
        for (_, fields) in &entries {
            let id = check_entry(fields, &sent);
            assert_eq!(sent[&id].aggregate_type, aggregate_type, "event {id} went to the stream of its aggregate type");
            ids.push(id);
        }
    }
    brokers::check_once_in_aggregate_order(&ids, &sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_maxlen_trims_the_stream_approximately() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    const EVENTS: i64 = 300;
    const MAXLEN: usize = 10;
    let keys = TestKeys::new("maxlen");
    let db = TestDb::new("sink_redis_maxlen").await;
    let c = db.client().await;
    let ids = support::insert_seed_events(&c, uuid::Uuid::new_v4(), EVENTS).await;
    let key = format!("{}:subscription", keys.prefix);
    let template = format!("{}:{{aggregate_type}}", keys.prefix);
    let maxlen = MAXLEN.to_string();
    let relay = relay_proc::start(
        &db,
        &["--sink", REDIS_URL, "--redis-stream", &template, "--redis-maxlen", &maxlen, "--sweep-interval", "200ms"],
    )
    .await;
    brokers::wait_published(&c, EVENTS).await;
    relay.stop().await;
    // Redis docs, XADD "Capped streams": with `~` Redis removes only whole
    // macro nodes (stream-node-max-entries, 100 by default), so the stream
    // keeps at least MAXLEN entries and at most about one node more.
    let len = keys.len(&key).await;
    assert!(len >= MAXLEN, "at least MAXLEN entries are kept: {len}");
    assert!(len < EVENTS as usize, "the stream was trimmed: {len} of {EVENTS} entries left");
    let entries = keys.entries(&key).await;
    let last = entries.last().and_then(|(_, f)| f.get("id")).and_then(|v| v.parse::<i64>().ok());
    assert_eq!(last, ids.last().copied(), "the newest entry is the last event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_at_start_is_a_clear_error() {
    let db = TestDb::new("sink_redis_unreachable").await;
    let (status, stderr) =
        relay_proc::run_to_exit(&db, &["--sink", "redis://:hunter2@127.0.0.1:1", "--sink-timeout", "2s"]).await;
    assert!(!status.success(), "relay exits non-zero: {status}");
    assert!(stderr.contains("cannot connect to Redis at redis://127.0.0.1:1"), "clear error:\n{stderr}");
    assert!(!stderr.contains("hunter2"), "the password is not shown:\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_server_lost_mid_run_fails_events_until_it_is_back() {
    let Some(program) = needs::program(&needs::REDIS_SERVER) else { return };
    let mut server = brokers::PrivateServer::start(
        program,
        &["--bind", "127.0.0.1", "--port", "{port}", "--dir", "{dir}", "--save", "", "--appendonly", "yes"],
    )
    .await;
    let url = format!("redis://127.0.0.1:{}", server.port);
    let db = TestDb::new("sink_redis_reconnect").await;
    let c = db.client().await;
    let relay = relay_proc::start(
        &db,
        &["--sink", &url, "--sink-timeout", "1s", "--retry-schedule", "300ms", "--sweep-interval", "200ms"],
    )
    .await;
    let mut sent = brokers::publish_events(&c, &brokers::three_aggregates(), 3, "t").await;
    brokers::wait_published(&c, sent.len() as i64).await;

    server.stop().await;
    let later = brokers::publish_events(&c, &brokers::three_aggregates(), 6, "t").await;
    support::eventually(brokers::LIVENESS.as_secs(), "events fail while Redis is gone", || async {
        let r = c
            .query_one("SELECT count(*) FROM events.outbox WHERE retry_count >= 1 AND last_error LIKE '%Redis%'", &[])
            .await
            .expect("count failures");
        r.get::<_, i64>(0) >= 1
    })
    .await;
    assert_eq!(brokers::published_count(&c).await, sent.len() as i64, "nothing is acknowledged meanwhile");

    server.restart().await;
    sent.extend(later);
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;
    let client = redis::Client::open(url.as_str()).expect("Redis URL");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to the private Redis");
    let mut ids = Vec::new();
    for key in ["outbox:order", "outbox:invoice"] {
        let entries: Entries =
            redis::cmd("XRANGE").arg(key).arg("-").arg("+").query_async(&mut conn).await.expect("XRANGE");
        ids.extend(entries.iter().map(|(_, fields)| check_entry(fields, &sent)));
    }
    // A failed XADD may still have reached Redis before the reply was lost;
    // here the server was down, so nothing was written twice.
    brokers::check_once_in_aggregate_order(&ids, &sent);
}

/// The exactly-once key template under `keys`' prefix: one stream per aggregate.
pub(crate) fn per_aggregate(keys: &TestKeys) -> String {
    format!("{}:{{aggregate_type}}:{{aggregate_id}}", keys.prefix)
}

/// The outbox ids in every aggregate's stream, one stream after another,
/// each entry checked: its entry id is `<outbox id>-0`, its fields the event's.
async fn ids_per_aggregate(keys: &TestKeys, sent: &BTreeMap<i64, Sent>) -> Vec<i64> {
    let mut aggregates: Vec<(String, uuid::Uuid)> =
        sent.values().map(|e| (e.aggregate_type.clone(), e.aggregate_id)).collect();
    aggregates.sort();
    aggregates.dedup();
    let mut ids = Vec::new();
    for (t, a) in aggregates {
        let key = format!("{}:{t}:{a}", keys.prefix);
        for (entry, fields) in keys.entries(&key).await {
            let id = check_entry(&fields, sent);
            assert_eq!(entry, format!("{id}-0"), "entry id of event {id} in {key}");
            assert_eq!(sent[&id].aggregate_id, a, "event {id} went to its aggregate's stream");
            ids.push(id);
        }
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_delivers_a_load_once_in_aggregate_order() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_load");
    let db = TestDb::new("sink_redis_eo_load").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::aggregates(20), 400, "t").await;
    let addr = format!("127.0.0.1:{}", brokers::free_port());
    let template = per_aggregate(&keys);
    let started = std::time::Instant::now();
    let relay = relay_proc::start(
        &db,
        &["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template, "--metrics-addr", &addr],
    )
    .await;
    brokers::wait_published(&c, sent.len() as i64).await;
    let took = started.elapsed();
    let metrics = brokers::scrape(&addr).await;
    let log = relay.log();
    relay.stop().await;
    eprintln!("exactly-once Redis: {} events in {took:?}", sent.len());
    let line = brokers::line_with(&log, "sink delivery guarantee");
    assert!(line.contains("exactly-once") && line.contains("Redis Streams"), "{line}");
    assert_eq!(brokers::sample(&metrics, r#"outbox_sink_guarantee{guarantee="exactly-once"}"#), Some(1.0), "{metrics}");
    assert_eq!(brokers::sample(&metrics, pg_outbox::metrics::SINK_REPEATS_REFUSED), Some(0.0));
    let ids = ids_per_aggregate(&keys, &sent).await;
    brokers::check_once_in_aggregate_order(&ids, &sent);
}

/// The crash window (the broker stored the events, the outbox did not
/// record it): each repeat is acknowledged only on its own entry, read
/// back. A stream trimmed empty meanwhile still refuses the repeats (it
/// keeps its top id), but holds no entry to prove them by: they fail,
/// saying so, and nothing is appended or acknowledged unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_a_repeat_is_proven_by_its_own_entry_and_a_trimmed_one_fails() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_repeat");
    let db = TestDb::new("sink_redis_eo_repeat").await;
    let c = db.client().await;
    let aggs = brokers::aggregates(4);
    let sent = brokers::publish_events(&c, &aggs, 24, "t").await;
    let template = per_aggregate(&keys);
    let args = ["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template, "--sweep-interval", "200ms"];
    let relay = relay_proc::start(&db, &args).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;

    let trimmed = format!("{}:{}:{}", keys.prefix, aggs[0].0, aggs[0].1);
    let _: i64 = redis::cmd("XTRIM")
        .arg(&trimmed)
        .arg("MAXLEN")
        .arg(0)
        .query_async(&mut keys.conn().await)
        .await
        .expect("XTRIM");
    let ids: Vec<i64> = sent.keys().copied().collect();
    brokers::unpublish(&db, &ids).await;
    let addr = format!("127.0.0.1:{}", brokers::free_port());
    let mut again = args.to_vec();
    again.extend(["--metrics-addr", &addr, "--retry-schedule", "1h"]);
    let relay = relay_proc::start(&db, &again).await;
    let kept: BTreeMap<i64, Sent> =
        sent.iter().filter(|(_, e)| e.aggregate_id != aggs[0].1).map(|(k, v)| (*k, v.clone())).collect();
    let first_trimmed = sent.iter().find(|(_, e)| e.aggregate_id == aggs[0].1).map(|(id, _)| *id).expect("an event");
    brokers::wait_published(&c, kept.len() as i64).await;
    support::eventually(brokers::LIVENESS.as_secs(), "the trimmed stream's first event failed", || async {
        brokers::row_state(&c, first_trimmed).await.1 == 1
    })
    .await;
    let metrics = brokers::scrape(&addr).await;
    let log = relay.log();
    relay.stop().await;
    let proven = Some(kept.len() as f64);
    assert_eq!(brokers::sample(&metrics, pg_outbox::metrics::SINK_REPEATS_REFUSED), proven, "{metrics}");
    assert_eq!(
        brokers::sample(&metrics, r#"outbox_sink_acknowledged_unsent_total{proof="entry"}"#),
        proven,
        "each repeat proven by its own entry:\n{metrics}"
    );
    let line = brokers::line_with(&log, "repeat refused");
    assert!(line.contains(&keys.prefix) && line.contains("WARN") && line.contains("entry"), "{line}");
    let (published, _, error) = brokers::row_state(&c, first_trimmed).await;
    assert!(!published, "never acknowledged without its entry");
    let error = error.unwrap_or_default();
    assert!(
        error.contains(&trimmed) && error.contains("deleted or trimmed") && error.contains("cannot be proven"),
        "{error}"
    );
    let trimmed_published: i64 = c
        .query_one(
            "SELECT count(*) FROM events.outbox WHERE aggregate_id = $1 AND published_at IS NOT NULL",
            &[&aggs[0].1],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(trimmed_published, 0, "none of the trimmed stream's events is acknowledged");
    assert_eq!(keys.len(&trimmed).await, 0, "nothing was appended to the trimmed stream");
    let ids = ids_per_aggregate(&keys, &kept).await;
    brokers::check_once_in_aggregate_order(&ids, &kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_an_event_a_deposed_relay_appended_is_not_appended_again() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_stale");
    let db = TestDb::new("sink_redis_eo_stale").await;
    let c = db.client().await;
    let aggregate = uuid::Uuid::new_v4();
    let key = format!("{}:order:{aggregate}", keys.prefix);
    let template = per_aggregate(&keys);
    let relay = relay_proc::start(
        &db,
        &["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template, "--sweep-interval", "200ms"],
    )
    .await;
    let event = |n: i32| pg_outbox::NewEvent::new("order", aggregate, "Updated", serde_json::json!({ "n": n }));
    let publisher = pg_outbox::Publisher::new();
    let first = publisher.publish(&c, &event(1)).await.expect("publish");
    brokers::wait_published(&c, 1).await;
    // A deposed relay appends the next event before the outbox commits it.
    let mut producer = db.client().await;
    let tx = producer.transaction().await.expect("begin");
    let second = publisher.publish(&tx, &event(2)).await.expect("publish");
    let _: String = redis::cmd("XADD")
        .arg(&key)
        .arg(format!("{second}-0"))
        .arg("id")
        .arg(second)
        .arg("aggregate_type")
        .arg("order")
        .arg("aggregate")
        .arg(aggregate.to_string())
        .arg("occurred_at")
        .arg(brokers::occurred_at_text(&tx, second).await)
        .arg("payload")
        .arg("from a deposed relay")
        .query_async(&mut keys.conn().await)
        .await
        .expect("XADD");
    tx.commit().await.expect("commit");
    brokers::wait_published(&c, 2).await;
    let log = relay.log();
    relay.stop().await;
    let entries = keys.entries(&key).await;
    let got: Vec<(&str, &str)> =
        entries.iter().map(|(entry, f)| (entry.as_str(), f.get("payload").map_or("", String::as_str))).collect();
    assert_eq!(got.len(), 2, "each event once: {got:?}");
    assert_eq!(got[0].0, format!("{first}-0"));
    assert_eq!(got[1], (format!("{second}-0").as_str(), "from a deposed relay"));
    let line = brokers::line_with(&log, "repeat refused");
    assert!(line.contains(&key) && line.contains(&second.to_string()), "{line}");
    assert_eq!(brokers::row_state(&c, second).await.1, 0, "acknowledged as held, without a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_is_refused_at_start_without_a_key_per_aggregate() {
    let db = TestDb::new("sink_redis_eo_refused").await;
    let (status, log) = relay_proc::run_to_exit(&db, &["--sink", REDIS_URL, "--exactly-once"]).await;
    assert!(!status.success(), "{status}");
    let line = brokers::line_with(&log, "--exactly-once");
    assert!(line.contains("--redis-stream 'outbox:{aggregate_type}' lacks {aggregate_id}"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_does_not_continue_a_stream_written_at_least_once() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_mixed");
    let db = TestDb::new("sink_redis_eo_mixed").await;
    let c = db.client().await;
    let aggregate = uuid::Uuid::new_v4();
    let key = format!("{}:order:{aggregate}", keys.prefix);
    // An at-least-once relay appended to the key: Redis chose the entry id
    // (a millisecond time, far above any outbox id).
    let _: String = redis::cmd("XADD")
        .arg(&key)
        .arg("*")
        .arg("id")
        .arg(1)
        .arg("aggregate_type")
        .arg("order")
        .arg("aggregate")
        .arg(aggregate.to_string())
        .query_async(&mut keys.conn().await)
        .await
        .expect("XADD");
    let event = pg_outbox::NewEvent::new("order", aggregate, "Created", serde_json::json!({}));
    let id = pg_outbox::Publisher::new().publish(&c, &event).await.expect("publish");
    let template = per_aggregate(&keys);
    let relay = relay_proc::start(
        &db,
        &["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template, "--retry-schedule", "1h"],
    )
    .await;
    support::eventually(brokers::LIVENESS.as_secs(), "the event failed", || async {
        brokers::row_state(&c, id).await.1 == 1
    })
    .await;
    relay.stop().await;
    let (published, _, last_error) = brokers::row_state(&c, id).await;
    assert!(!published, "never acknowledged when unsure");
    let last_error = last_error.unwrap_or_default();
    assert!(last_error.contains(&key) && last_error.contains("not written with --exactly-once"), "{last_error}");
    assert_eq!(keys.len(&key).await, 1, "nothing was appended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_a_relay_killed_before_its_acknowledgements_leaves_no_second_copy() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_kill");
    let db = TestDb::new("sink_redis_eo_kill").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::aggregates(3), 12, "t").await;
    let n = sent.len();
    let template = per_aggregate(&keys);
    let args = ["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template, "--sweep-interval", "200ms"];

    // The crash window: row locks hold the relay's acknowledgement UPDATE
    // while Redis stores everything; then kill -9.
    let mut locker = db.client().await;
    let tx = locker.transaction().await.expect("begin");
    let locked = tx.query("SELECT id FROM events.outbox FOR UPDATE", &[]).await.expect("lock the rows");
    assert_eq!(locked.len(), n);
    let locker_pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await.expect("pid").get(0);
    let mut relay = relay_proc::start(&db, &args).await;
    support::eventually(brokers::LIVENESS.as_secs(), "Redis holds every event", || async {
        ids_per_aggregate(&keys, &sent).await.len() == n
    })
    .await;
    relay.kill9().await;
    c.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND pid <> $1",
        &[&locker_pid],
    )
    .await
    .expect("terminate the dead relay's backends");
    support::eventually(10, "the dead relay's backends are gone", || async {
        let r = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid <> pg_backend_pid() AND pid <> $1 AND backend_type = 'client backend'",
                &[&locker_pid],
            )
            .await
            .expect("count backends");
        r.get::<_, i64>(0) == 0
    })
    .await;
    tx.rollback().await.expect("release the row locks");
    assert_eq!(brokers::published_count(&c).await, 0, "the crash lost every acknowledgement");

    let addr = format!("127.0.0.1:{}", brokers::free_port());
    let mut again = args.to_vec();
    again.extend(["--metrics-addr", &addr]);
    let relay = relay_proc::start(&db, &again).await;
    brokers::wait_published(&c, n as i64).await;
    let metrics = brokers::scrape(&addr).await;
    relay.stop().await;
    assert_eq!(brokers::sample(&metrics, pg_outbox::metrics::SINK_REPEATS_REFUSED), Some(n as f64), "{metrics}");
    let ids = ids_per_aggregate(&keys, &sent).await;
    brokers::check_once_in_aggregate_order(&ids, &sent);
}

/// A key that holds a greater id this outbox did not write (another
/// outbox on the same key, or a database restored to an earlier point
/// whose ids came round again): the event is not taken for a repeat; it
/// fails, naming the key, and stays unpublished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_a_greater_id_of_another_outbox_is_not_taken_for_a_repeat() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_foreign");
    let db = TestDb::new("sink_redis_eo_foreign").await;
    let c = db.client().await;
    let aggregate = uuid::Uuid::new_v4();
    let key = format!("{}:order:{aggregate}", keys.prefix);
    // Written exactly once by another outbox, an hour ago, with a far
    // greater id.
    let _: String = redis::cmd("XADD")
        .arg(&key)
        .arg("900000000-0")
        .arg("id")
        .arg(900_000_000i64)
        .arg("aggregate_type")
        .arg("order")
        .arg("aggregate")
        .arg(aggregate.to_string())
        .arg("occurred_at")
        .arg((chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        .query_async(&mut keys.conn().await)
        .await
        .expect("XADD");
    let event = pg_outbox::NewEvent::new("order", aggregate, "Created", serde_json::json!({}));
    let id = pg_outbox::Publisher::new().publish(&c, &event).await.expect("publish");
    let template = per_aggregate(&keys);
    let relay = relay_proc::start(
        &db,
        &["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template, "--retry-schedule", "1h"],
    )
    .await;
    support::eventually(brokers::LIVENESS.as_secs(), "the event failed", || async {
        brokers::row_state(&c, id).await.1 == 1
    })
    .await;
    relay.stop().await;
    let (published, _, last_error) = brokers::row_state(&c, id).await;
    assert!(!published, "never acknowledged when the key is another outbox's");
    let last_error = last_error.unwrap_or_default();
    assert!(
        last_error.contains(&key) && last_error.contains("never stored") && last_error.contains("another outbox"),
        "{last_error}"
    );
}

/// `--redis-wait-replicas 1`: an event is acknowledged once a replica has
/// its entry; with the replica gone, the event fails, saying how many
/// replicas confirmed it, and is not marked published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_wait_replicas_acknowledges_only_what_a_replica_confirmed() {
    let Some(program) = needs::program(&needs::REDIS_SERVER) else { return };
    let base = ["--bind", "127.0.0.1", "--port", "{port}", "--dir", "{dir}", "--save", ""];
    let primary = brokers::PrivateServer::start(program.clone(), &base).await;
    let primary_port = primary.port.to_string();
    let mut replica_args = base.to_vec();
    replica_args.extend(["--replicaof", "127.0.0.1", &primary_port]);
    let mut replica = brokers::PrivateServer::start(program, &replica_args).await;
    let url = format!("redis://127.0.0.1:{}", primary.port);
    let client = redis::Client::open(url.as_str()).expect("Redis URL");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to the primary");
    support::eventually(brokers::LIVENESS.as_secs(), "the replica is connected", || {
        let mut conn = conn.clone();
        async move {
            let info: String = redis::cmd("INFO").arg("replication").query_async(&mut conn).await.expect("INFO");
            info.contains("connected_slaves:1") && info.contains("state=online")
        }
    })
    .await;
    let db = TestDb::new("sink_redis_wait").await;
    let c = db.client().await;
    let relay = relay_proc::start(
        &db,
        &[
            "--sink",
            &url,
            "--redis-stream",
            "w:{aggregate_id}",
            "--redis-wait-replicas",
            "1",
            "--sink-timeout",
            "2s",
            "--retry-schedule",
            "1h",
            "--sweep-interval",
            "200ms",
        ],
    )
    .await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 3, "t").await;
    brokers::wait_published(&c, sent.len() as i64).await;

    replica.stop().await;
    let aggregate = uuid::Uuid::new_v4();
    let event = pg_outbox::NewEvent::new("order", aggregate, "Created", serde_json::json!({}));
    let id = pg_outbox::Publisher::new().publish(&c, &event).await.expect("publish");
    support::eventually(brokers::LIVENESS.as_secs(), "the event fails", || async {
        brokers::row_state(&c, id).await.1 == 1
    })
    .await;
    let log = relay.log();
    relay.stop().await;
    assert!(
        brokers::line_with(&log, "Redis durability").contains("WAIT 1 replica(s) after each XADD"),
        "the start log names what is in force:\n{log}"
    );
    let (published, _, error) = brokers::row_state(&c, id).await;
    assert!(!published, "not acknowledged without the replica");
    let error = error.unwrap_or_default();
    assert!(error.contains("only 0 of 1 replicas") && error.contains("--redis-wait-replicas"), "{error}");
    let len: u64 = redis::cmd("XLEN").arg(format!("w:{aggregate}")).query_async(&mut conn).await.expect("XLEN");
    assert_eq!(len, 1, "the primary has the entry; the relay did not count it as delivered");
}

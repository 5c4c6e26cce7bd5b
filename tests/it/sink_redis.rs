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

    async fn conn(&self) -> redis::aio::MultiplexedConnection {
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
    let got: BTreeMap<&str, &str> =
        fields.iter().filter(|(k, _)| *k != "payload").map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(got, want, "fields of event {id}");
    let body: Value = serde_json::from_str(&fields["payload"]).expect("payload is JSON");
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

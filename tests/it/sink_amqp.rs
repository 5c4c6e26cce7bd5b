//! The RabbitMQ sink through a real `pg-outbox relay` process and the local
//! RabbitMQ (127.0.0.1:5672, guest/guest), read back with lapin.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use serde_json::Value;
use uuid::Uuid;

use crate::brokers::{self, LIVENESS};
use crate::needs;
use crate::relay_proc;
use crate::support::{self, TestDb};

const BROKER: &str = needs::RABBITMQ.addr;
const URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A test's own queue bound to `amq.topic` for `prefix.#`.
pub async fn bound_queue(prefix: &str) -> (Connection, Channel, String) {
    let conn = Connection::connect(URL, ConnectionProperties::default()).await.expect("connect to RabbitMQ");
    let ch = conn.create_channel().await.expect("open a channel");
    let name = format!("{prefix}.q");
    ch.queue_declare(name.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())
        .await
        .expect("declare the test queue");
    ch.queue_bind(
        name.as_str().into(),
        "amq.topic".into(),
        format!("{prefix}.#").as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind the test queue");
    (conn, ch, name)
}

fn text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => s.to_string(),
        AMQPValue::ShortString(s) => s.to_string(),
        other => panic!("header value is not a string: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_sink_publishes_every_event_persistent_with_id_headers_and_order() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let db = TestDb::new("sink_amqp").await;
    let c = db.client().await;
    let prefix = format!("pgo-test-{}", Uuid::new_v4().simple());
    let (conn, ch, queue) = bound_queue(&prefix).await;
    let rk = format!("{prefix}.{{aggregate_type}}.{{event_type}}");
    let mut relay =
        relay_proc::start(&db, &["--sink", URL, "--amqp-routing-key", &rk, "--sweep-interval", "200ms"]).await;
    assert!(!relay.log().contains("guest:guest"), "the log shows credentials:\n{}", relay.log());

    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 30, "amqp").await;
    let agg_of: BTreeMap<i64, Uuid> = sent.iter().map(|(id, e)| (*id, e.aggregate_id)).collect();

    let mut consumer = ch
        .basic_consume(queue.as_str().into(), "pgo-test".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .expect("consume the test queue");
    let mut got: Vec<i64> = Vec::new();
    let mut per_agg: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    while got.len() < sent.len() {
        let delivery = tokio::time::timeout(LIVENESS, consumer.next())
            .await
            .unwrap_or_else(|_| {
                panic!("only {} of {} messages within {LIVENESS:?}; relay:\n{}", got.len(), sent.len(), relay.log())
            })
            .expect("consumer stream ended")
            .expect("delivery");
        let p = &delivery.properties;
        let id: i64 =
            p.message_id().as_ref().expect("message_id is set").as_str().parse().expect("message_id is the id");
        let agg = *agg_of.get(&id).unwrap_or_else(|| panic!("unknown message_id {id}"));
        let e = &sent[&id];
        assert_eq!(delivery.routing_key.as_str(), format!("{prefix}.{}.{}", e.aggregate_type, e.event_type));
        assert_eq!(p.delivery_mode(), &Some(2), "persistent");
        assert_eq!(p.content_type().as_ref().map(|s| s.as_str()), Some("application/json"));
        assert_eq!(p.app_id().as_ref().map(|s| s.as_str()), Some("pg-outbox"));
        assert!(p.timestamp().is_some_and(|t| t > 1_600_000_000), "timestamp is occurred_at: {p:?}");
        let headers = p.headers().as_ref().expect("headers are set");
        let h: BTreeMap<String, String> =
            headers.inner().iter().map(|(k, v)| (k.as_str().to_string(), text(v))).collect();
        let body: Value = serde_json::from_slice(&delivery.data).expect("the body is JSON");
        assert_eq!(body["payload"], e.payload, "the body's payload");
        assert_eq!(h["id"], id.to_string());
        assert_eq!(h["event_type"], e.event_type);
        assert_eq!(h["aggregate_type"], e.aggregate_type);
        assert_eq!(h["aggregate_id"], agg.to_string());
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["correlation_id"], e.correlation_id);
        assert_eq!(h.get("causation_id"), e.causation_id.as_ref(), "causation_id only where the envelope has one");
        assert_eq!(h["traceparent"], e.traceparent);
        assert!(!h.contains_key("tracestate"), "no tracestate in the envelope, so no header: {h:?}");
        chrono::DateTime::parse_from_rfc3339(&h["occurred_at"]).expect("occurred_at is RFC 3339");
        assert_eq!(body["id"], id);
        assert_eq!(body["aggregate_id"], agg.to_string());
        delivery.ack(BasicAckOptions::default()).await.expect("ack");
        got.push(id);
        per_agg.entry(agg).or_default().push(id);
    }
    let unique: BTreeSet<i64> = got.iter().copied().collect();
    assert_eq!(unique.len(), sent.len(), "each event arrived once: {got:?}");
    assert_eq!(unique, agg_of.keys().copied().collect(), "every event arrived");
    for (agg, ids) in &per_agg {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "aggregate {agg} out of order: {ids:?}");
    }
    support::eventually(30, "all 30 rows marked published", || async { brokers::published_count(&c).await == 30 })
        .await;
    relay.stop_cleanly().await;

    let extra = tokio::time::timeout(Duration::from_millis(300), consumer.next()).await;
    assert!(extra.is_err(), "no further message after all were acknowledged: {extra:?}");
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete the test queue");
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_unroutable_message_fails_the_event() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let db = TestDb::new("sink_amqp_noroute").await;
    let c = db.client().await;
    // No queue is bound for this prefix.
    let rk = format!("pgo-test-unbound-{}.{{event_type}}", Uuid::new_v4().simple());
    let relay = relay_proc::start(&db, &["--sink", URL, "--amqp-routing-key", &rk, "--sweep-interval", "200ms"]).await;
    let id = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    support::eventually(30, "the unroutable event to fail", || async { brokers::row_state(&c, id).await.1 >= 1 }).await;
    let (published, retries, last_error) = brokers::row_state(&c, id).await;
    assert!(!published, "an unroutable message is not a delivery");
    assert_eq!(retries, 1, "one failure (the default ladder waits a minute before the next try)");
    let last_error = last_error.expect("last_error is set");
    assert!(last_error.contains("unroutable"), "{last_error}");
    assert!(last_error.contains("amq.topic") && last_error.contains("PaymentSucceeded"), "{last_error}");
    drop(relay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_missing_exchange_or_bad_login_is_refused_at_start_without_showing_the_password() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let db = TestDb::new("sink_amqp_refused").await;
    let missing = format!("pgo-test-missing-{}", Uuid::new_v4().simple());
    let mut relay = relay_proc::spawn(&db, &["--sink", URL, "--amqp-exchange", &missing]);
    let status = relay.wait().await;
    assert!(!status.success(), "a missing exchange must stop the relay; stderr:\n{}", relay.log());
    let log = relay.log();
    assert!(log.contains(&missing) && log.contains("NOT_FOUND"), "the error names the exchange:\n{log}");
    assert!(!relay.signalled(pg_outbox_testkit::process::STARTED), "{log}");

    let secret = "s3cret-Pa55";
    let bad = format!("amqp://guest:{secret}@127.0.0.1:5672/%2f");
    let mut relay = relay_proc::spawn(&db, &["--sink", &bad, "--sink-timeout", "5s"]);
    let status = relay.wait().await;
    let log = relay.log();
    assert!(!status.success(), "a refused login must stop the relay; stderr:\n{log}");
    assert!(log.contains("127.0.0.1:5672") && log.contains("vhost '/'"), "the error names the broker:\n{log}");
    assert!(!log.contains(secret), "the password shows:\n{log}");
}

/// A TCP proxy to RabbitMQ that the test can cut: `cut()` closes every
/// proxied connection and refuses new ones until `restore()`.
struct CuttableProxy {
    port: u16,
    up: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cut: tokio::sync::watch::Sender<u64>,
}

impl CuttableProxy {
    async fn start() -> CuttableProxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let up = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let (up2, cut2) = (up.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let mut cut_rx = cut2.subscribe();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(BROKER).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut_rx.changed() => {}
                    }
                });
            }
        });
        CuttableProxy { port, up, cut }
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn cut(&self) {
        self.up.store(false, std::sync::atomic::Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    fn restore(&self) {
        self.up.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_connection_lost_mid_run_fails_events_then_the_sink_reconnects() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let db = TestDb::new("sink_amqp_lost").await;
    let c = db.client().await;
    let prefix = format!("pgo-test-{}", Uuid::new_v4().simple());
    let (conn, ch, queue) = bound_queue(&prefix).await;
    let proxy = CuttableProxy::start().await;
    let rk = format!("{prefix}.{{event_type}}");
    let url = proxy.url();
    let mut relay = relay_proc::start(
        &db,
        &[
            "--sink",
            &url,
            "--amqp-routing-key",
            &rk,
            "--retry-schedule",
            "300ms",
            "--sink-timeout",
            "2s",
            "--sweep-interval",
            "200ms",
        ],
    )
    .await;
    let mut consumer = ch
        .basic_consume(queue.as_str().into(), "pgo-test".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .expect("consume the test queue");
    let mut next_id = async || -> i64 {
        let d = tokio::time::timeout(LIVENESS, consumer.next())
            .await
            .expect("a message within the liveness bound")
            .expect("consumer stream ended")
            .expect("delivery");
        d.ack(BasicAckOptions::default()).await.expect("ack");
        d.properties.message_id().as_ref().expect("message_id").as_str().parse().expect("numeric message_id")
    };

    let first = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    assert_eq!(next_id().await, first);

    proxy.cut();
    let during = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    support::eventually(30, "the event to fail while the connection is down", || async {
        brokers::row_state(&c, during).await.1 >= 2
    })
    .await;
    let (published, _, last_error) = brokers::row_state(&c, during).await;
    assert!(!published, "nothing is published while the connection is down");
    let last_error = last_error.expect("last_error is set");
    assert!(last_error.contains("RabbitMQ"), "{last_error}");
    assert!(!last_error.contains("guest:guest"), "{last_error}");

    proxy.restore();
    support::eventually(30, "the event published after the connection returned", || async {
        brokers::row_state(&c, during).await.0
    })
    .await;
    assert_eq!(next_id().await, during, "the event arrived after the reconnect");
    assert!(relay.log().contains("connected to RabbitMQ"), "the reconnect is logged:\n{}", relay.log());
    relay.stop_cleanly().await;
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete the test queue");
    let _ = conn.close(200, "done".into()).await;
}

/// A proxy to RabbitMQ that holds each chunk the broker sends for `delay`
/// ([`crate::brokers::delaying_proxy`]): every confirm takes at least
/// `delay`. Returns the proxy's port.
async fn delaying_proxy(delay: Duration) -> u16 {
    crate::brokers::delaying_proxy(BROKER.to_string(), delay).await
}

/// Read `n` messages from `queue` (acknowledging each); their outbox ids
/// in arrival order.
async fn read_ids(ch: &Channel, queue: &str, n: usize, relay: &brokers::RelayProc) -> Vec<i64> {
    let mut consumer = ch
        .basic_consume(queue.into(), "pgo-test".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .expect("consume the test queue");
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let d = tokio::time::timeout(LIVENESS, consumer.next())
            .await
            .unwrap_or_else(|_| {
                panic!("only {} of {n} messages within {LIVENESS:?}; relay:\n{}", ids.len(), relay.log())
            })
            .expect("consumer stream ended")
            .expect("delivery");
        d.ack(BasicAckOptions::default()).await.expect("ack");
        ids.push(d.properties.message_id().as_ref().expect("message_id").as_str().parse().expect("numeric message_id"));
    }
    let extra = tokio::time::timeout(Duration::from_millis(300), consumer.next()).await;
    assert!(extra.is_err(), "no message beyond the {n} expected: {extra:?}");
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_sink_overlaps_sends_and_delivers_every_event_once_in_aggregate_order() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let db = TestDb::new("sink_amqp_pipelined").await;
    let c = db.client().await;
    let prefix = format!("pgo-test-{}", Uuid::new_v4().simple());
    let (conn, ch, queue) = bound_queue(&prefix).await;
    // Every confirm takes 25 ms or more: 480 events sent one at a time
    // would take 12 s or more.
    const DELAY: Duration = Duration::from_millis(25);
    const EVENTS: usize = 480;
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", delaying_proxy(DELAY).await);
    let sent = brokers::publish_events(&c, &brokers::aggregates(96), EVENTS, "pipelined").await;
    let rk = format!("{prefix}.{{aggregate_type}}.{{event_type}}");
    let began = Instant::now();
    let mut relay =
        relay_proc::start(&db, &["--sink", &url, "--amqp-routing-key", &rk, "--sweep-interval", "200ms"]).await;
    brokers::wait_published(&c, EVENTS as i64).await;
    let took = began.elapsed();

    let ids = read_ids(&ch, &queue, EVENTS, &relay).await;
    brokers::check_once_in_aggregate_order(&ids, &sent);
    let serial = DELAY * EVENTS as u32;
    assert!(
        took < serial / 4,
        "{EVENTS} events took {took:?}, start included; one at a time they take {serial:?} or more, so sends \
         did not overlap (the default --max-in-flight is 64)"
    );
    relay.stop_cleanly().await;
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete the test queue");
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_overlapping_sends_fail_exactly_the_unroutable_events() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let db = TestDb::new("sink_amqp_mixed_routes").await;
    let c = db.client().await;
    let prefix = format!("pgo-test-{}", Uuid::new_v4().simple());
    // Only `order` events have a queue: every `invoice` one is returned.
    let (conn, ch, queue) = bound_queue(&format!("{prefix}.order")).await;
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", delaying_proxy(Duration::from_millis(5)).await);
    let aggs = brokers::aggregates(60);
    let sent = brokers::publish_events(&c, &aggs, 240, "mixed").await;
    let orders: BTreeMap<i64, brokers::Sent> =
        sent.iter().filter(|(_, e)| e.aggregate_type == "order").map(|(id, e)| (*id, e.clone())).collect();
    // Each invoice aggregate's first event fails; the rest wait behind it.
    let first_invoices: Vec<i64> = aggs
        .iter()
        .filter(|(t, _)| *t == "invoice")
        .filter_map(|(_, agg)| sent.iter().find(|(_, e)| e.aggregate_id == *agg).map(|(id, _)| *id))
        .collect();
    assert!(!first_invoices.is_empty() && !orders.is_empty());
    let rk = format!("{prefix}.{{aggregate_type}}.{{event_type}}");
    let relay = relay_proc::start(&db, &["--sink", &url, "--amqp-routing-key", &rk, "--sweep-interval", "200ms"]).await;

    let counts = || async {
        let r = c
            .query_one(
                "SELECT count(*) FILTER (WHERE aggregate_type = 'order' AND published_at IS NOT NULL), \
                        count(*) FILTER (WHERE aggregate_type = 'invoice' AND published_at IS NOT NULL), \
                        count(*) FILTER (WHERE id = ANY($1) AND retry_count >= 1) \
                 FROM events.outbox",
                &[&first_invoices],
            )
            .await
            .expect("count rows");
        (r.get::<_, i64>(0), r.get::<_, i64>(1), r.get::<_, i64>(2))
    };
    let want = (orders.len() as i64, 0, first_invoices.len() as i64);
    support::eventually(LIVENESS.as_secs(), "every order event published and every first invoice failed", || async {
        counts().await == want
    })
    .await;
    assert_eq!(counts().await, want, "(orders published, invoices published, first invoices failed)");
    for id in &first_invoices {
        let (published, retries, last_error) = brokers::row_state(&c, *id).await;
        assert!(!published && retries == 1, "invoice {id}: published {published}, {retries} failures");
        let last_error = last_error.expect("last_error is set");
        assert!(
            last_error.contains("unroutable") && last_error.contains(&format!("{prefix}.invoice.")),
            "{last_error}"
        );
    }
    let ids = read_ids(&ch, &queue, orders.len(), &relay).await;
    brokers::check_once_in_aggregate_order(&ids, &orders);
    drop(relay);
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete the test queue");
    let _ = conn.close(200, "done".into()).await;
}

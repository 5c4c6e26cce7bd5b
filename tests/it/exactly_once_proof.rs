//! Exactly-once acknowledges an event without sending it only on proof
//! that the broker holds that very event, never because it holds a later
//! one of its aggregate. Each test takes a path by which an event reaches
//! an exactly-once sink after a later event of its aggregate (or by which
//! the broker forgets what it held) through real `pg-outbox relay`
//! processes and real brokers, reads the broker back with an independent
//! client, and checks that no event is marked published while the broker
//! lacks it: such an event fails, with an error that names the cause.
//! Before the proof rule, each of these events was marked published and
//! never reached the broker.

use std::time::Duration;

use pg_outbox::migrate::{self, OrderingMode};
use uuid::Uuid;

use crate::brokers::{self, LIVENESS};
use crate::needs;
use crate::relay_proc;
use crate::sink_nats::{self, NATS_URL, TestStream, publish_order};
use crate::sink_redis::{self, REDIS_URL, TestKeys};
use crate::support::{self, DbCli, TestDb};

/// Where a test's exactly-once relay delivers.
enum Broker {
    Redis(TestKeys),
    Nats(TestStream),
}

impl Broker {
    /// The relay's sink flags: one stream key or subject per aggregate.
    fn args(&self) -> Vec<String> {
        let (url, flag, template) = match self {
            Broker::Redis(keys) => (REDIS_URL, "--redis-stream", sink_redis::per_aggregate(keys)),
            Broker::Nats(stream) => (NATS_URL, "--nats-subject", sink_nats::per_aggregate(stream)),
        };
        ["--sink", url, "--exactly-once", flag, &template].iter().map(|s| s.to_string()).collect()
    }

    /// The outbox ids the broker holds for `aggregate` (type `order`), in
    /// the broker's order.
    async fn ids(&self, aggregate: Uuid) -> Vec<i64> {
        match self {
            Broker::Redis(keys) => {
                let key = format!("{}:order:{aggregate}", keys.prefix);
                keys.entries(&key)
                    .await
                    .iter()
                    .map(|(_, f)| f.get("id").and_then(|v| v.parse().ok()).expect("an id field"))
                    .collect()
            }
            Broker::Nats(stream) => {
                let subject = format!("{}.order.{aggregate}", stream.prefix);
                stream
                    .messages()
                    .await
                    .iter()
                    .filter(|m| m.subject.as_str() == subject)
                    .map(|m| {
                        let id = m.headers.as_ref().and_then(|h| h.get("id")).map(|v| v.as_str().to_string());
                        id.and_then(|v| v.parse().ok()).expect("an id header")
                    })
                    .collect()
            }
        }
    }
}

/// Under `--ordering producer-locked`, a producer that does not lock its
/// aggregate's row: two transactions write events of one aggregate, and
/// the one with the higher id commits first. The relay delivers the higher
/// one; the lower one then reaches the sink after it. It fails, saying
/// that order broke upstream, and is never marked published; the broker
/// holds only the higher one. Without `--producers-lock-aggregates` the
/// relay refuses to start on such an outbox.
async fn producer_locked_breach(tag: &str, broker: Broker) {
    let db = TestDb::new(tag).await;
    migrate::set_ordering(&db.options(), OrderingMode::ProducerLocked).await.expect("set ordering");
    let c = db.client().await;
    let sink = broker.args();
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    let (status, log) = relay_proc::run_to_exit(&db, &sink).await;
    assert!(!status.success(), "{status}");
    let line = brokers::line_with(&log, "--producers-lock-aggregates");
    assert!(line.contains("producer-locked"), "{line}");

    let mut args = sink.clone();
    args.extend(["--producers-lock-aggregates", "--retry-schedule", "1h", "--sweep-interval", "200ms"]);
    let relay = relay_proc::start(&db, &args).await;
    let aggregate = Uuid::new_v4();
    let (mut first, mut second) = (db.client().await, db.client().await);
    let lower_tx = first.transaction().await.expect("begin");
    let lower = publish_order(&lower_tx, aggregate).await;
    let higher_tx = second.transaction().await.expect("begin");
    let higher = publish_order(&higher_tx, aggregate).await;
    assert!(lower < higher);
    higher_tx.commit().await.expect("commit the higher id first");
    support::eventually(LIVENESS.as_secs(), "the higher id is published", || async {
        brokers::row_state(&c, higher).await.0
    })
    .await;
    lower_tx.commit().await.expect("commit the lower id");
    support::eventually(LIVENESS.as_secs(), "the lower id fails", || async {
        brokers::row_state(&c, lower).await.1 == 1
    })
    .await;
    relay.stop().await;
    let (published, _, error) = brokers::row_state(&c, lower).await;
    assert!(!published, "an event the broker lacks is never acknowledged");
    let error = error.unwrap_or_default();
    assert!(error.contains("order broke upstream") && error.contains(&higher.to_string()), "{error}");
    assert_eq!(broker.ids(aggregate).await, [higher], "the broker holds only what was sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_producer_locked_breach_fails_the_late_event_instead_of_losing_it() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    producer_locked_breach("eo_breach_redis", Broker::Redis(TestKeys::new("eo_breach"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_producer_locked_breach_fails_the_late_event_instead_of_losing_it() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    producer_locked_breach("eo_breach_nats", Broker::Nats(TestStream::create_with("eo_breach", |_| {}).await)).await;
}

/// A second outbox (a staging copy of production) writes the same keys,
/// its ids lagging: its events occurred before the first outbox's, and its
/// aggregate's event has an id the first outbox used for another
/// aggregate. Redis refuses each as not above the key's top; neither key
/// holds the event's own entry, nor ever removed one, so both fail as never
/// stored and stay unpublished, and the keys hold only the first outbox's
/// entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_lagging_second_outbox_on_the_same_keys_is_never_acknowledged_unsent() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_lagging");
    let (x, y) = (Uuid::new_v4(), Uuid::new_v4());
    let event = |a: Uuid| pg_outbox::NewEvent::new("order", a, "Updated", serde_json::json!({}));
    let publisher = pg_outbox::Publisher::new();
    let staging = TestDb::new("eo_lagging_staging").await;
    let s = staging.client().await;
    let staging_y = publisher.publish(&s, &event(y)).await.expect("publish");
    let staging_x = publisher.publish(&s, &event(x)).await.expect("publish");
    let production = TestDb::new("eo_lagging_production").await;
    let p = production.client().await;
    let mut produced = Vec::new();
    for a in [x, y, x] {
        produced.push(publisher.publish(&p, &event(a)).await.expect("publish"));
    }
    // Both sequences start alike (each database is a copy of one template).
    assert_eq!((produced[0], produced[1]), (staging_y, staging_x), "the ids lag as planned: {produced:?}");
    let template = sink_redis::per_aggregate(&keys);
    let args = ["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template, "--retry-schedule", "1h"];
    let relay = relay_proc::start(&production, &args).await;
    brokers::wait_published(&p, 3).await;
    relay.stop().await;

    let relay = relay_proc::start(&staging, &args).await;
    support::eventually(LIVENESS.as_secs(), "both staging events fail", || async {
        brokers::row_state(&s, staging_x).await.1 == 1 && brokers::row_state(&s, staging_y).await.1 == 1
    })
    .await;
    relay.stop().await;
    let (published, _, error) = brokers::row_state(&s, staging_x).await;
    assert!(!published, "never acknowledged under the other outbox's greater id");
    let error = error.unwrap_or_default();
    assert!(error.contains("never stored") && error.contains("another outbox"), "{error}");
    let (published, _, error) = brokers::row_state(&s, staging_y).await;
    assert!(!published, "never acknowledged below the other outbox's first entry");
    assert!(error.unwrap_or_default().contains("never stored"), "the error says why");
    let ids = |a: Uuid| {
        let key = format!("{}:order:{a}", keys.prefix);
        let keys = &keys;
        async move { keys.entries(&key).await.into_iter().map(|(entry, _)| entry).collect::<Vec<String>>() }
    };
    let entry = |id: i64| format!("{id}-0");
    assert_eq!(ids(x).await, [entry(produced[0]), entry(produced[2])], "key x holds production's entries only");
    assert_eq!(ids(y).await, [entry(produced[1])], "key y holds production's entry only");
}

/// Redis forgets a key's entries when it evicts the key: a repeat is then
/// appended again (a second copy, never a loss). A server whose
/// `maxmemory-policy` evicts keys without an expiry is refused at start,
/// and when it turns to one while the relay runs, the relay stops at its
/// next check, naming the setting, with the event in hand unpublished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_evicted_key_costs_a_second_copy_and_evicting_policies_are_refused() {
    let Some(program) = needs::program(&needs::REDIS_SERVER) else { return };
    let server = brokers::PrivateServer::start(
        program,
        &[
            "--bind",
            "127.0.0.1",
            "--port",
            "{port}",
            "--dir",
            "{dir}",
            "--save",
            "",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
    )
    .await;
    let url = format!("redis://127.0.0.1:{}", server.port);
    let client = redis::Client::open(url.as_str()).expect("Redis URL");
    let conn = client.get_multiplexed_async_connection().await.expect("connect to the private Redis");
    let db = TestDb::new("eo_evicted").await;
    let c = db.client().await;
    let template = "eo:{aggregate_type}:{aggregate_id}";
    let sink = ["--sink", url.as_str(), "--exactly-once", "--redis-stream", template];
    let (status, log) = relay_proc::run_to_exit(&db, &sink).await;
    assert!(!status.success(), "{status}");
    let line = brokers::line_with(&log, "maxmemory-policy");
    assert!(line.contains("allkeys-lru") && line.contains("noeviction"), "{line}");

    let set_policy = |policy: &'static str| {
        let mut conn = conn.clone();
        async move {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory-policy")
                .arg(policy)
                .query_async(&mut conn)
                .await
                .expect("CONFIG SET");
        }
    };
    set_policy("noeviction").await;
    let mut args = sink.to_vec();
    args.extend(["--broker-check-interval", "1s", "--retry-schedule", "1h", "--sweep-interval", "200ms"]);
    let mut relay = relay_proc::start(&db, &args).await;
    let aggregate = Uuid::new_v4();
    let key = format!("eo:order:{aggregate}");
    let mut sent = Vec::new();
    for _ in 0..3 {
        sent.push(publish_order(&c, aggregate).await);
    }
    brokers::wait_published(&c, 3).await;
    let len = |conn: &redis::aio::MultiplexedConnection| {
        let (mut conn, key) = (conn.clone(), key.clone());
        async move { redis::cmd("XLEN").arg(&key).query_async::<u64>(&mut conn).await.expect("XLEN") }
    };
    assert_eq!(len(&conn).await, 3);

    // The key evicted (as DEL does), then the crash window for the last
    // event: it is appended again.
    let _: () = redis::cmd("DEL").arg(&key).query_async(&mut conn.clone()).await.expect("DEL");
    brokers::unpublish(&db, &sent[2..]).await;
    brokers::wait_published(&c, 3).await;
    assert_eq!(len(&conn).await, 1, "the repeat is appended again: a second copy, not a loss");

    // Eviction turned on while the relay runs.
    set_policy("allkeys-lfu").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let late = publish_order(&c, aggregate).await;
    let status = tokio::time::timeout(LIVENESS, relay.wait()).await.expect("the relay stops");
    assert!(!status.success(), "{status}");
    let log = relay.log();
    let line = brokers::line_with(&log, "exactly-once stopped");
    assert!(line.contains("maxmemory-policy is allkeys-lfu"), "{line}");
    let (published, retries, _) = brokers::row_state(&c, late).await;
    assert!(!published && retries == 0, "the event in hand is released, neither published nor failed");
    assert_eq!(len(&conn).await, 1, "nothing was appended after the check failed");
}

/// Limits added to a stream while the relay runs (here `max_age`, which
/// removes a subject's last message) stop the relay at its next check,
/// naming the stream and the setting; the event in hand stays unpublished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_stream_limits_added_while_running_stop_the_relay() {
    if !needs::server(&needs::NATS).await {
        return;
    }
    let stream = TestStream::create_with("eo_limits", |_| {}).await;
    let db = TestDb::new("eo_nats_limits").await;
    let c = db.client().await;
    let subject = sink_nats::per_aggregate(&stream);
    let mut relay = relay_proc::start(
        &db,
        &[
            "--sink",
            NATS_URL,
            "--exactly-once",
            "--nats-subject",
            &subject,
            "--broker-check-interval",
            "1s",
            "--sweep-interval",
            "200ms",
        ],
    )
    .await;
    let aggregate = Uuid::new_v4();
    publish_order(&c, aggregate).await;
    brokers::wait_published(&c, 1).await;
    let mut config = stream.js.get_stream(stream.name()).await.expect("the stream").cached_info().config.clone();
    config.max_age = Duration::from_secs(3600);
    stream.js.update_stream(config).await.expect("add max_age");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let late = publish_order(&c, aggregate).await;
    let status = tokio::time::timeout(LIVENESS, relay.wait()).await.expect("the relay stops");
    assert!(!status.success(), "{status}");
    let log = relay.log();
    let line = brokers::line_with(&log, "exactly-once stopped");
    assert!(line.contains(stream.name()) && line.contains("max_age"), "{line}");
    assert!(!brokers::row_state(&c, late).await.0, "the event in hand stays unpublished");
    assert_eq!(stream.count().await, 1, "nothing was sent after the check failed");
}

/// `replay --exactly-once` of events the broker already holds sends none
/// of them again, and says so apart from what it sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_exactly_once_reports_what_the_broker_held_apart_from_what_it_sent() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_replay");
    let db = TestDb::new("eo_replay").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::aggregates(2), 6, "t").await;
    let template = sink_redis::per_aggregate(&keys);
    let sink = ["--sink", REDIS_URL, "--exactly-once", "--redis-stream", &template];
    let mut args = sink.to_vec();
    args.extend(["--sweep-interval", "200ms"]);
    let relay = relay_proc::start(&db, &args).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;
    let mut replay = vec!["replay"];
    replay.extend(sink);
    let out = db.cli(&replay).run().await;
    assert!(out.ok(), "{}", out.stderr);
    let line = brokers::line_with(&out.stderr, "replay done");
    assert!(line.contains("(0 sent, 6 already held by the broker"), "{line}");
}

/// The library refuses an exactly-once sink on a stream that cannot keep
/// its precondition, before it hands anything out: competing mode, and an
/// outbox whose order rests on the producers without their declaration;
/// with the declaration it delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_refuses_exactly_once_without_its_precondition() {
    use pg_outbox::relay::{Guarantee, Message, SendFuture, Sent, Sink};

    /// A sink that claims exactly-once; it delivers only when `allowed`,
    /// and otherwise must never be called.
    struct Claims {
        allowed: bool,
    }
    impl Sink for Claims {
        fn name(&self) -> &str {
            "claims exactly-once"
        }
        fn guarantee(&self) -> Guarantee {
            Guarantee::ExactlyOnce
        }
        fn send<'a>(&'a self, _: &'a Message, event: &'a pg_outbox::Event) -> SendFuture<'a> {
            assert!(self.allowed, "event {} handed out to a sink whose precondition does not hold", event.id);
            Box::pin(async { Ok(Sent::Delivered) })
        }
    }
    let db = TestDb::new("eo_library").await;
    let c = db.client().await;
    publish_order(&c, Uuid::new_v4()).await;
    let refused = |builder: pg_outbox::ConsumerBuilder| async move {
        let stream = builder.start().await.expect("start");
        pg_outbox::relay::run(stream, &Claims { allowed: false }, std::future::pending()).await
    };
    let competing = pg_outbox::Consumer::builder(db.options()).mode(pg_outbox::Mode::Competing);
    let err = refused(competing).await.expect_err("competing mode is refused").to_string();
    assert!(err.contains("competing"), "{err}");
    migrate::set_ordering(&db.options(), OrderingMode::ProducerLocked).await.expect("set ordering");
    let err = refused(pg_outbox::Consumer::builder(db.options())).await.expect_err("refused").to_string();
    assert!(err.contains("producer-locked") && err.contains("producers_lock_aggregates"), "{err}");
    assert_eq!(brokers::published_count(&c).await, 0, "nothing was handed out");

    let declared = pg_outbox::Consumer::builder(db.options()).producers_lock_aggregates(true);
    let stream = declared.start().await.expect("start");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        pg_outbox::relay::run(stream, &Claims { allowed: true }, async {
            let _ = stopped.await;
        })
        .await
    });
    brokers::wait_published(&c, 1).await;
    let _ = stop.send(());
    let stats = run.await.expect("join").expect("declared: delivered");
    assert_eq!(stats.delivered, 1);
}

//! The relay pipelines: many deliveries in flight to the sink at once,
//! at most one per aggregate, so per-aggregate order holds whatever
//! completes first. Through `relay::run_with` and a sink that answers
//! after a delay of its own per event and records what it sees; against a
//! real PostgreSQL.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pg_outbox::relay::{DeliveryOptions, Message, SendFuture, Sent, Sink};
use pg_outbox::{Consumer, Event, NewEvent, Publisher};
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::relay_proc::LIVENESS;
use crate::support::{self, TestDb};

/// What the sink saw.
#[derive(Default)]
struct Seen {
    /// Aggregates with a send in flight.
    busy: HashSet<Uuid>,
    /// Two sends of one aggregate in flight at once.
    overlaps: Vec<(Uuid, i64)>,
    /// Completed sends, in completion order.
    done: Vec<(Uuid, i64)>,
}

/// A sink that answers each event after 1 to 8 ms (by its id), fails the
/// events in `fail`, and never answers those of aggregate `hang`.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Seen>,
    now: AtomicUsize,
    most: AtomicUsize,
    fail: HashSet<i64>,
    hang: Option<Uuid>,
}

impl Recorder {
    fn seen<T>(&self, f: impl FnOnce(&mut Seen) -> T) -> T {
        f(&mut self.seen.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Sink for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }

    fn send<'a>(&'a self, _: &'a Message, event: &'a Event) -> SendFuture<'a> {
        Box::pin(async move {
            let (aggregate, id) = (event.aggregate_id, event.id);
            self.seen(|s| {
                if !s.busy.insert(aggregate) {
                    s.overlaps.push((aggregate, id));
                }
            });
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            if self.hang == Some(aggregate) {
                std::future::pending::<()>().await;
            }
            let millis = 1 + u64::try_from(id.rem_euclid(8)).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(millis)).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            self.seen(|s| {
                s.busy.remove(&aggregate);
                s.done.push((aggregate, id));
            });
            if self.fail.contains(&id) {
                return Err(format!("refused event {id}").into());
            }
            Ok(Sent::Delivered)
        })
    }
}

/// Whether event `id` is published, and its retry count.
async fn row_state(c: &tokio_postgres::Client, id: i64) -> (bool, i32) {
    let r = c
        .query_one("SELECT published_at IS NOT NULL, retry_count FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("read the row");
    (r.get(0), r.get(1))
}

/// `per` events for each of `aggregates` new aggregates, interleaved; the
/// ids of each aggregate's events in order.
async fn publish(c: &tokio_postgres::Client, aggregates: usize, per: usize) -> BTreeMap<Uuid, Vec<i64>> {
    let aggs: Vec<Uuid> = (0..aggregates).map(|_| Uuid::new_v4()).collect();
    let events: Vec<NewEvent> = (0..per)
        .flat_map(|n| aggs.iter().map(move |a| NewEvent::new("order", *a, "Updated", serde_json::json!({ "n": n }))))
        .collect();
    let ids = Publisher::new().publish_many(c, &events).await.expect("publish");
    let mut by: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    for (e, id) in events.iter().zip(ids) {
        by.entry(e.aggregate_id).or_default().push(id);
    }
    by
}

/// Run the relay with `max_in_flight` until `done` holds, then shut it
/// down; its stats.
async fn relay_until<F, Fut>(
    db: &TestDb,
    sink: Arc<Recorder>,
    max_in_flight: usize,
    done: F,
) -> pg_outbox::relay::RelayStats
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let stream = Consumer::builder(db.options())
        .shutdown_grace(Duration::from_millis(500))
        .sweep_interval(Duration::from_millis(200))
        .start()
        .await
        .expect("start");
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        let mut options = DeliveryOptions::default();
        options.max_in_flight = max_in_flight;
        pg_outbox::relay::run_with(stream, sink.as_ref(), &options, async {
            let _ = stopped.await;
        })
        .await
    });
    support::eventually(LIVENESS.as_secs(), "the relay got there", done).await;
    let _ = stop.send(());
    tokio::time::timeout(LIVENESS, run).await.expect("the relay stops").expect("join").expect("relay")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_in_flight_one_per_aggregate_in_id_order() {
    let db = TestDb::new("pipeline_order").await;
    let c = db.client().await;
    let by = publish(&c, 40, 10).await;
    let sink = Arc::new(Recorder::default());
    let stats = relay_until(&db, sink.clone(), 16, || async { support::published_count(&c).await == 400 }).await;
    assert_eq!(stats.delivered, 400);
    let most = sink.most.load(Ordering::SeqCst);
    assert!(most > 1 && most <= 16, "deliveries in flight at once: {most}");
    sink.seen(|s| {
        assert!(s.overlaps.is_empty(), "two sends of one aggregate in flight: {:?}", s.overlaps);
        for (aggregate, ids) in &by {
            let got: Vec<i64> = s.done.iter().filter(|(a, _)| a == aggregate).map(|(_, id)| *id).collect();
            assert_eq!(&got, ids, "aggregate {aggregate}: each event once, in id order");
        }
        let first: Vec<i64> = s.done.iter().map(|(_, id)| *id).collect();
        let mut sorted = first.clone();
        sorted.sort_unstable();
        assert_ne!(first, sorted, "completions interleave across aggregates (not one at a time in id order)");
    });
}

/// A failed event holds back its aggregate's later events, even those the
/// relay had already taken from the stream; other aggregates go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_holds_back_its_aggregate_while_the_others_flow() {
    let db = TestDb::new("pipeline_holdback").await;
    let c = db.client().await;
    let by = publish(&c, 20, 10).await;
    let (failing, ids) = by.iter().next().map(|(a, ids)| (*a, ids.clone())).expect("an aggregate");
    let failed = ids[2];
    let sink = Arc::new(Recorder { fail: HashSet::from([failed]), ..Recorder::default() });
    let others = 19 * 10;
    relay_until(&db, sink.clone(), 16, || async {
        support::published_count(&c).await == others + 2 && row_state(&c, failed).await.1 == 1
    })
    .await;
    for (n, id) in ids.iter().enumerate() {
        let (published, retries) = row_state(&c, *id).await;
        assert_eq!(published, n < 2, "event {n} of the failing aggregate: published only before the failure");
        assert_eq!(retries, i32::from(*id == failed), "only the failed event counts a failure");
    }
    sink.seen(|s| {
        let sent: Vec<i64> = s.done.iter().filter(|(a, _)| *a == failing).map(|(_, id)| *id).collect();
        assert_eq!(sent, ids[..3], "nothing of its aggregate was sent after the failure");
    });
}

/// At shutdown every send in flight gets the grace; one that outlives it
/// is released, never marked published or failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_gives_the_sends_in_flight_the_grace_then_releases_them() {
    let db = TestDb::new("pipeline_shutdown").await;
    let c = db.client().await;
    let by = publish(&c, 10, 3).await;
    let (stuck, ids) = by.iter().next().map(|(a, ids)| (*a, ids.clone())).expect("an aggregate");
    let sink = Arc::new(Recorder { hang: Some(stuck), ..Recorder::default() });
    let started = std::time::Instant::now();
    let stats = relay_until(&db, sink.clone(), 8, || async { support::published_count(&c).await == 27 }).await;
    assert!(started.elapsed() < LIVENESS, "the grace ended the wait");
    assert_eq!(stats.delivered, 27);
    for id in ids {
        assert_eq!(row_state(&c, id).await, (false, 0), "event {id}: released, neither published nor failed");
    }
}

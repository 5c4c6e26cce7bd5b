//! Faults injected for real. The fault suite: a producer load through real
//! `pg-outbox relay` processes into a webhook served by the test, with one
//! injected fault per test:
//!
//! - `kill -9` of the relay (restarted each time), alone and with a hot standby;
//! - a PostgreSQL restart (`pg_ctl restart -m fast`) on a throwaway server;
//! - `pg_terminate_backend` of the LISTEN connection, and of the work connection;
//! - a long transaction holding an early id of one aggregate open;
//! - a sink that hangs past the webhook timeout, and one that answers HTTP 500.
//!
//! Each test uses a fixed RNG seed (producers' choices and fault points) and
//! prints one summary line:
//! `fault=<kind> faults=<n> events=<committed> lost=<n> duplicates=<n> published_without_delivery=<n> order_violations=<n>`
//!
//! What the webhook "received" is the 2xx-answered requests only; a request
//! answered 500, or one held past the relay's timeout, is an attempt, not a
//! delivery. Checked in every test: every committed event received at least
//! once; no rolled-back event ever sent; no row published that the webhook
//! did not receive; per aggregate, first receptions in increasing id order;
//! duplicates (receptions of an id already received) zero, or bounded by the
//! relay's in-flight window for faults that can cause them; and all committed
//! rows end published.
//!
//! Last, the library's consumer alone: its work connection terminated
//! mid-stream loses nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};
use uuid::Uuid;

use pg_outbox_testkit::TempServer;

use crate::consumer::{next, start};
use crate::support::{self, TestDb};
use pg_outbox_testkit::process::{self, LIVENESS};

/// Committed events per test (producers stop once they reach it).
pub(crate) const EVENTS: usize = 2000;
/// Committed events in the hanging-sink test (one request in 50 hangs).
const HANG_EVENTS: usize = 1500;
/// Producer tasks per test.
const PRODUCERS: usize = 4;
/// Aggregates the producers write.
const AGGREGATES: usize = 8;
/// The relay's `--batch-size` (its default); its in-flight window is about
/// twice this (the stream's buffer) plus the event in hand.
pub(crate) const BATCH: usize = 50;
/// Largest pause between a producer's transactions, in ms (spreads the load
/// over a few seconds so faults land mid-stream).
const PACE_MS: u64 = 16;
/// Liveness bound for the whole outbox to end published after the load.
const DRAIN_LIVENESS: Duration = Duration::from_secs(90);

const AGGREGATE_TYPE: &str = "subscription";
const EVENT_TYPE: &str = "FaultSuiteEvent";
/// The seed's plain INSERT, as a producer that knows nothing of pg-outbox writes it.
const SEED_INSERT: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                           VALUES ($1, $2, $3, $4) RETURNING id";
/// The log signal of a relay that takes the outbox lock (`--mode single`;
/// docs/operations.md, "Logs").
pub(crate) const ACTIVE: &str = "leader";
/// The log signal of a hot standby.
pub(crate) const STANDBY: &str = "standby";
/// The keys of a sink record, exactly.
const RECORD_KEYS: [&str; 7] =
    ["aggregate_id", "aggregate_type", "event_type", "id", "occurred_at", "payload", "retry_count"];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

mod harness;
mod load;
mod subscriptions;
#[cfg(all(feature = "nats", feature = "redis"))]
mod subscriptions_exactly_once;
mod webhook;

pub(crate) use harness::*;
pub(crate) use load::*;
pub(crate) use webhook::*;

/// A throwaway server of this test's own (one it may restart), with
/// database `name` created and migrated by `pg-outbox migrate`; the server
/// and the database's URL.
pub(crate) async fn throwaway_migrated(name: &str) -> (Arc<TempServer>, String) {
    let server = Arc::new(
        tokio::task::spawn_blocking(TempServer::start)
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {}", pg_outbox::error::report(&e))),
    );
    let admin = connect(&server.url(), "fault-suite admin", LIVENESS).await;
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create database");
    drop(admin);
    let url = server.url_for(name);
    let migrate = support::cli(&["migrate"]).url(&url).run().await;
    assert!(migrate.ok(), "pg-outbox migrate failed: {}", migrate.stderr);
    (server, url)
}

// ---------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9() {
    const SEED: u64 = 0xFA17_0001;
    const KILLS: usize = 4;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_kill_9").await;
    let mut h = Harness::new("kill_9", SEED, db.url(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, KILLS);
    let mut kills = 0;
    for p in points {
        load.reached(p).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        h.assert_relays_running().await;
        let i = h.relays.iter().position(|r| r.alive).expect("a relay runs");
        h.relays[i].kill9().await;
        kills += 1;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..200))).await;
        h.start_relay().await;
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(kills), ledger).await;
    h.check(&report, 2 * BATCH * kills);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_standby() {
    const SEED: u64 = 0xFA17_0002;
    const KILLS: usize = 3;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_kill_9_standby").await;
    let mut h = Harness::new("kill_9_with_standby", SEED, db.url(), Behavior::Ok, &[]).await;
    let first = h.start_relay().await;
    h.relays[first].wait_signal(&[ACTIVE]).await;
    let second = h.start_relay().await;
    h.relays[second].wait_signal(&[STANDBY]).await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, KILLS);
    let mut takeovers = Vec::new();
    for p in points {
        load.reached(p).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        h.assert_relays_running().await;
        let active: Vec<usize> = (0..h.relays.len()).filter(|&i| h.relays[i].is_active()).collect();
        assert_eq!(active.len(), 1, "exactly one relay is active: {active:?}\n{}", h.logs());
        let standby: Vec<usize> = (0..h.relays.len()).filter(|&i| h.relays[i].alive && i != active[0]).collect();
        assert_eq!(standby.len(), 1, "exactly one standby\n{}", h.logs());
        let (active, standby) = (active[0], standby[0]);
        let killed_at = h.relays[active].kill9().await;
        // Takeover: from the kill to the standby's first delivery.
        let n = h.relays[standby].n;
        let deadline = Instant::now() + LIVENESS;
        let delivered_at = loop {
            if let Some(at) = h.sink.first_delivery_by(n, killed_at) {
                break at;
            }
            assert!(Instant::now() < deadline, "standby relay {n} never delivered after the kill\n{}", h.logs());
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let takeover = delivered_at.duration_since(killed_at);
        let killed = h.relays[active].n;
        println!(
            "fault=kill_9_with_standby takeover={takeover:?} (kill of relay {killed} to first delivery by relay {n})"
        );
        takeovers.push(takeover);
        h.relays[standby].wait_signal(&[ACTIVE]).await;
        let fresh = h.start_relay().await;
        h.relays[fresh].wait_signal(&[STANDBY]).await;
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(takeovers.len()), ledger).await;
    let ms: Vec<u128> = takeovers.iter().map(Duration::as_millis).collect();
    println!("fault=kill_9_with_standby takeover_ms={ms:?}");
    h.check(&report, 2 * BATCH * takeovers.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart() {
    const SEED: u64 = 0xFA17_0003;
    const RESTARTS: usize = 2;
    let mut rng = StdRng::seed_from_u64(SEED);
    let (server, url) = throwaway_migrated("fault_restart").await;

    let mut h = Harness::new("postgres_restart", SEED, url.clone(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&url, SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, RESTARTS);
    let mut restarts = 0;
    for p in points {
        load.reached(p).await;
        let s = server.clone();
        let took = Instant::now();
        tokio::task::spawn_blocking(move || s.restart())
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("restart: {}", pg_outbox::error::report(&e)));
        restarts += 1;
        println!("fault=postgres_restart restart {restarts} took {:?}", took.elapsed());
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(restarts), ledger).await;
    h.check(&report, 0);
    drop(h);
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_terminated() {
    const SEED: u64 = 0xFA17_0004;
    const TERMINATIONS: usize = 4;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_listener").await;
    // A 10 s sweep: only the catch-up after each reconnect finds quickly what
    // was committed while the listener was gone.
    let mut h = Harness::new("listener_terminated", SEED, db.url(), Behavior::Ok, &["--sweep-interval", "10s"]).await;
    h.start_relay().await;
    let spec = load_spec(&db.url(), SEED, &mut rng);
    let aggs = spec.aggregates.clone();
    let load = Load::spawn(spec);
    let mut faults = 0;
    for p in fault_points(&mut rng, load.events, TERMINATIONS) {
        load.reached(p).await;
        terminate(&db, &mut h, "pg-outbox listener").await;
        faults += 1;
    }
    let mut ledger = load.join().await;

    // Once more with the load over: terminate, then commit events at once,
    // in the gap, so no notification of them reaches the relay.
    let c = db.client().await;
    let before: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    support::eventually(60, "the load to be published", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[])
            .await
            .is_ok_and(|r| r.get::<_, i64>(0) == 0)
    })
    .await;
    let terminated_at = Instant::now();
    terminate(&db, &mut h, "pg-outbox listener").await;
    faults += 1;
    let mut gap = Vec::new();
    for (i, agg) in aggs.iter().enumerate() {
        let id: i64 = c
            .query_one(SEED_INSERT, &[&AGGREGATE_TYPE, agg, &EVENT_TYPE, &json!({"gap": i})])
            .await
            .expect("insert in the gap")
            .get(0);
        gap.push((id, *agg));
    }
    let gap_ids: Vec<i64> = gap.iter().map(|(id, _)| *id).collect();
    ledger.committed.extend(gap);
    let deadline = Instant::now() + DRAIN_LIVENESS;
    loop {
        let got: HashSet<i64> = h.sink.attempts().iter().filter(|a| a.delivered()).map(|a| a.id).collect();
        if gap_ids.iter().all(|id| got.contains(id)) {
            break;
        }
        assert!(Instant::now() < deadline, "events committed in the listener gap never delivered\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    println!(
        "fault=listener_terminated gap_catch_up={:?} (terminate to delivery of {} events committed in the gap; \
         sweep interval 10s; {before} events before)",
        terminated_at.elapsed(),
        gap_ids.len()
    );
    let report = h.finish(Faults::Injected(faults), ledger).await;
    h.check(&report, 0);
    let resumed: usize = h.relays.iter().map(|r| r.signal_count("listen_resumed")).sum();
    assert!(resumed > 0, "the relay logged its reconnects:\n{}", h.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_connection_terminated() {
    const SEED: u64 = 0xFA17_0005;
    const TERMINATIONS: usize = 4;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_drain").await;
    let mut h = Harness::new("work_connection_terminated", SEED, db.url(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let mut faults = 0;
    for p in fault_points(&mut rng, load.events, TERMINATIONS) {
        load.reached(p).await;
        terminate(&db, &mut h, "pg-outbox drain").await;
        faults += 1;
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(faults), ledger).await;
    h.check(&report, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_transaction() {
    const SEED: u64 = 0xFA17_0006;
    const HOLD: Duration = Duration::from_secs(3);
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_long_tx").await;
    let mut h = Harness::new("long_transaction", SEED, db.url(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let mut spec = load_spec(&db.url(), SEED, &mut rng);
    let a = spec.aggregates[0];
    let flag = Arc::new(AtomicBool::new(false));
    // While A's transaction is open the producers leave A alone (a producer
    // that writes A would wait for it: the per-aggregate lock).
    spec.avoid = Some(Avoid { aggregate: a, flag: flag.clone() });
    let load = Load::spawn(spec);
    load.reached(rng.random_range(EVENTS / 5..EVENTS / 3)).await;

    flag.store(true, Ordering::SeqCst);
    let mut long = db.client().await;
    let tx = long.transaction().await.expect("begin");
    let long_id: i64 = tx
        .query_one(SEED_INSERT, &[&AGGREGATE_TYPE, &a, &EVENT_TYPE, &json!({"long": true})])
        .await
        .expect("insert the long transaction's event")
        .get(0);
    let opened = Instant::now();
    // Another writer of A meanwhile: it waits for the long transaction and
    // gets a later id.
    let follower = {
        let url = db.url();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let c = connect(&url, "fault-suite follower", LIVENESS).await;
            let id: i64 = c
                .query_one(SEED_INSERT, &[&AGGREGATE_TYPE, &a, &EVENT_TYPE, &json!({"follower": true})])
                .await
                .expect("insert behind the long transaction")
                .get(0);
            (id, Instant::now())
        })
    };
    tokio::time::sleep(HOLD).await;
    // A relay far behind (a loaded machine) may not have reached ids above
    // the held one yet: keep the transaction open until it has (liveness bound).
    let deadline = Instant::now() + LIVENESS;
    while Instant::now() < deadline
        && !h.sink.attempts().iter().any(|x| x.delivered() && x.aggregate != a && x.id > long_id)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let closing = Instant::now();
    tx.commit().await.expect("commit the long transaction");
    flag.store(false, Ordering::SeqCst);
    let (follower_id, follower_at) = follower.await.expect("follower");
    assert!(follower_id > long_id && follower_at >= closing, "the follower waited for the long transaction");

    let mut ledger = load.join().await;
    ledger.committed.push((long_id, a));
    ledger.committed.push((follower_id, a));
    let report = h.finish(Faults::Injected(1), ledger).await;

    let attempts = h.sink.attempts();
    let during =
        attempts.iter().filter(|x| x.delivered() && x.aggregate != a && x.id > long_id && x.at < closing).count();
    let first_at = |id: i64| attempts.iter().position(|x| x.id == id && x.delivered());
    let long_pos = first_at(long_id).expect("the long transaction's event was delivered");
    let early_a: Vec<i64> =
        attempts[..long_pos].iter().filter(|x| x.aggregate == a && x.id > long_id).map(|x| x.id).collect();
    println!(
        "fault=long_transaction held_id={long_id} held_for={:?} deliveries_of_other_aggregates_while_open={during} \
         follower_id={follower_id}",
        closing.duration_since(opened)
    );
    assert!(during > 0, "other aggregates were delivered while the long transaction was open\n{}", h.logs());
    assert!(early_a.is_empty(), "later events of A were sent before the held one: {early_a:?}");
    assert!(first_at(follower_id).is_some_and(|p| p > long_pos), "the follower came after the held event");
    h.check(&report, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_sink() {
    const SEED: u64 = 0xFA17_0007;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_sink_hang").await;
    let behavior = Behavior::HangEvery { every: 50, hang: Duration::from_secs(2) };
    let mut h = Harness::new("hanging_sink", SEED, db.url(), behavior, &["--webhook-timeout", "300ms"]).await;
    h.start_relay().await;
    // Fewer events here: each hang costs the (sequential) relay its 300 ms timeout.
    let load = Load::spawn(LoadSpec { events: HANG_EVENTS, ..load_spec(&db.url(), SEED, &mut rng) });
    let ledger = load.join().await;
    let report = h.finish(Faults::SinkAnswers(HUNG), ledger).await;
    check_retried(&h.sink.attempts(), HUNG);
    h.check(&report, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_sink() {
    const SEED: u64 = 0xFA17_0008;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_sink_500").await;
    let mut h =
        Harness::new("failing_sink", SEED, db.url(), Behavior::FailFirstAttemptOfEvery { every: 10 }, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let ledger = load.join().await;
    let report = h.finish(Faults::SinkAnswers(500), ledger).await;
    check_retried(&h.sink.attempts(), 500);
    h.check(&report, 0);
}

/// Every attempt answered `status` was followed by a 2xx of the same id
/// carrying a higher `retry_count` (the relay counted the failure).
pub(super) fn check_retried(attempts: &[Attempt], status: u16) {
    for (i, a) in attempts.iter().enumerate().filter(|(_, a)| a.status == status) {
        let later = attempts[i + 1..].iter().find(|b| b.id == a.id && b.delivered());
        let later = later.unwrap_or_else(|| panic!("id {} (answered {status}) was never delivered after", a.id));
        assert!(
            later.retry_count > a.retry_count,
            "id {}: the delivery after a failed attempt carries retry_count {} (failed attempt had {})",
            a.id,
            later.retry_count,
            a.retry_count
        );
    }
}

// ---------------------------------------------------------------- the consumer alone

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_the_work_connection_loses_nothing() {
    let db = TestDb::new("work_conn_killed").await;
    let c = db.client().await;
    let agg = Uuid::new_v4();
    let ids: Vec<i64> = crate::support::insert_seed_events(&c, agg, 400).await;
    let mut stream = start(&db, |b| {
        b.batch_size(20).sweep_interval(Duration::from_millis(200)).reconnect_max_delay(Duration::from_millis(300))
    })
    .await;
    let mut seen = HashSet::new();
    let mut last = 0;
    let mut kills = 0;
    while seen.len() < ids.len() {
        let d = next(&mut stream, 20).await;
        assert!(d.id >= last || seen.contains(&d.id), "order: {} after {last}", d.id);
        last = last.max(d.id);
        seen.insert(d.id);
        if seen.len() % 100 == 50 && kills < 3 {
            kills += db.terminate("pg-outbox drain").await;
        }
        d.ack();
    }
    assert!(kills >= 1, "a fault was injected");
    drop(stream);
    // Every event ends published, even those whose acknowledgement was in flight.
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(200))).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        while let Ok(Some(d)) =
            tokio::time::timeout(Duration::from_millis(50), futures::StreamExt::next(&mut stream)).await
        {
            d.ack();
        }
        let left: i64 =
            c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("q").get(0);
        if left == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} events still unpublished");
    }
    stream.finish().await.expect("finish");
}

/// The writer session (acknowledgements and failures) is terminated while
/// writes are in flight: the consumer opens its sessions again, writes the
/// settlements it had queued (no event is delivered twice or lost), and a
/// failure written around the fault still holds its aggregate back until it
/// is delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_the_writer_connection_loses_nothing_and_keeps_each_aggregate_in_order() {
    let db = TestDb::new("writer_conn_killed").await;
    let c = db.client().await;
    let aggs = [Uuid::new_v4(), Uuid::new_v4()];
    let mut ids = Vec::new();
    for _ in 0..10 {
        for a in aggs {
            ids.extend(crate::support::insert_seed_events(&c, a, 20).await);
        }
    }
    let ladder = pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(50)]).expect("schedule").jitter(0.0);
    let mut stream = start(&db, |b| {
        b.batch_size(20)
            .ack_batch_size(5)
            .ack_interval(Duration::from_millis(5))
            .retry_policy(ladder)
            .sweep_interval(Duration::from_millis(200))
            .reconnect_max_delay(Duration::from_millis(300))
    })
    .await;
    let mut delivered: HashMap<i64, u32> = HashMap::new();
    let mut last: HashMap<Uuid, i64> = HashMap::new();
    // A failed event of each aggregate, owed before any later one of it.
    let mut owed: HashMap<Uuid, i64> = HashMap::new();
    let (mut kills, mut failed) = (0, 0);
    let mut acked = HashSet::new();
    while acked.len() < ids.len() {
        let d = next(&mut stream, 20).await;
        let n = {
            let n = delivered.entry(d.id).or_default();
            *n += 1;
            *n
        };
        match owed.get(&d.aggregate_id) {
            Some(f) => assert_eq!(d.id, *f, "aggregate {}: {} overtook its failed event {f}", d.aggregate_id, d.id),
            None => {
                assert_eq!(n, 1, "event {} delivered again although it was acknowledged", d.id);
                let prev = last.insert(d.aggregate_id, d.id).unwrap_or(0);
                assert!(d.id > prev, "aggregate {}: {} after {prev}", d.aggregate_id, d.id);
            }
        }
        let seen = delivered.len();
        if seen % 60 == 30 && kills < 3 && n == 1 {
            kills += db.terminate("pg-outbox writer").await;
        }
        if seen % 45 == 20 && n == 1 {
            owed.insert(d.aggregate_id, d.id);
            failed += 1;
            d.fail("refused once");
        } else {
            owed.remove(&d.aggregate_id);
            acked.insert(d.id);
            d.ack();
        }
    }
    assert!(kills >= 1 && failed >= 1, "faults were injected ({kills} terminations, {failed} failures)");
    // The same consumer writes every acknowledgement, also those whose write
    // was cut by the termination.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let left: i64 =
            c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("q").get(0);
        if left == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} acknowledged events still unpublished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let retried: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE retry_count > 0", &[]).await.expect("q").get(0);
    assert_eq!(retried, i64::from(failed), "each failure counted once");
    stream.finish().await.expect("finish");
}

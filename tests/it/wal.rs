//! The WAL source (`relay --source wal`, `SourceKind::Wal`): wake-ups from
//! a temporary logical replication slot instead of NOTIFY.
//!
//! Every test runs on a throwaway server of its own with `wal_level =
//! logical` (the machine's server is left as it is):
//! - with no insert trigger at all (producer-locked mode, `migrate
//!   --source wal`) events arrive without the sweep, in order for
//!   producers that lock their aggregate first;
//! - a relay killed with `kill -9` leaves no slot and no retained WAL while
//!   100 000 events (one transaction) and 1 MiB payloads are written, and
//!   delivers all of them when it comes back;
//! - the fault suite's `kill -9`, terminated replication backend and server
//!   restart: 0 lost, 0 order violations, no slot left behind;
//! - what the server lacks (`wal_level`, the REPLICATION privilege, the
//!   publication) is named in one line, and the relay exits non-zero.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::{Consumer, SourceKind};
use pg_outbox_testkit::process::LIVENESS;
use pg_outbox_testkit::{TempServer, TempServerOptions};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use uuid::Uuid;

use crate::faults::{self, BATCH, Behavior, Faults, Harness, Load, fault_points, load_spec};
use crate::support::{self, TestDb};

/// `pg-outbox relay args...` on the database at `url` (start or spawn it).
fn relay_on(url: &str, args: &[&str]) -> pg_outbox_testkit::process::Relay {
    pg_outbox_testkit::process::Relay::new(support::bin()).url(url).args(args)
}

/// A throwaway server with `wal_level = logical`.
async fn logical_server() -> TempServer {
    tokio::task::spawn_blocking(|| TempServer::start_with(TempServerOptions::default().setting("wal_level", "logical")))
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("throwaway PostgreSQL with wal_level = logical: {}", pg_outbox::error::report(&e)))
}

/// Does `server` run PostgreSQL 14 or later? On an older one, check that
/// a relay with the WAL source is refused with a line naming the version,
/// and say so.
async fn wal_supported(server: &TempServer) -> bool {
    let admin = faults::connect(&server.url(), "wal admin", LIVENESS).await;
    if support::server_version_num(&admin).await >= 140_000 {
        return true;
    }
    let url = migrated(server, "wal_too_old", &["--source", "wal"]).await;
    let mut relay = relay_on(&url, &["--source", "wal", "--sink", "stdout"]).spawn().unwrap_or_else(|e| panic!("{e}"));
    let status = relay.wait().await;
    let log = relay.log();
    assert!(!status.success() && log.contains("needs 14 or later"), "refused on an old server: {log}");
    println!("wal: PostgreSQL older than 14: the WAL source is refused, as documented; the rest of this test is moot");
    false
}

/// Create database `name` on `server` and run `pg-outbox migrate args...`
/// on it; its URL.
async fn migrated(server: &TempServer, name: &str, args: &[&str]) -> String {
    let admin = faults::connect(&server.url(), "wal admin", LIVENESS).await;
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create database");
    let url = server.url_for(name);
    let mut argv = vec!["migrate"];
    argv.extend_from_slice(args);
    let out = support::cli(&argv).url(&url).run().await;
    assert!(out.ok(), "pg-outbox {argv:?} failed: {}", out.stderr);
    url
}

/// Replication slots on the server, and the WAL they keep (bytes).
/// Replication slots of `c`'s database.
async fn database_slots(c: &tokio_postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()", &[])
        .await
        .expect("read pg_replication_slots")
        .get(0)
}

async fn slots(c: &tokio_postgres::Client) -> (i64, i64) {
    let row = c
        .query_one(
            "SELECT count(*), coalesce(sum(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), 0)::int8 \
             FROM pg_replication_slots",
            &[],
        )
        .await
        .expect("read pg_replication_slots");
    (row.get(0), row.get(1))
}

/// `tgenabled` of the insert triggers: (`outbox_order`, `outbox_wake`).
async fn trigger_states(c: &tokio_postgres::Client) -> (String, String) {
    let row = c
        .query_one(
            "SELECT max(tgenabled::text) FILTER (WHERE tgname = 'outbox_order'), \
                    max(tgenabled::text) FILTER (WHERE tgname = 'outbox_wake') \
             FROM pg_trigger WHERE tgrelid = 'events.outbox'::regclass",
            &[],
        )
        .await
        .expect("read pg_trigger");
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_insert_trigger_events_arrive_from_the_wal_in_order_without_the_sweep() {
    let server = logical_server().await;
    if !wal_supported(&server).await {
        return;
    }
    let url = migrated(&server, "wal_no_trigger", &["--ordering", "producer-locked", "--source", "wal"]).await;
    let c = faults::connect(&url, "wal test", LIVENESS).await;
    assert_eq!(
        trigger_states(&c).await,
        ("D".to_string(), "R".to_string()),
        "producer-locked with the WAL source: no insert trigger fires in ordinary sessions"
    );
    let aggregates = crate::ordering_modes::subscriptions(&c, 4).await;
    // A sweep every hour: only the stream can wake the consumer in time.
    let pg = pg_outbox::ConnectOptions::parse(&url).expect("url");
    let mut stream = Consumer::builder(pg)
        .source(SourceKind::Wal)
        .sweep_interval(Duration::from_secs(3600))
        .start()
        .await
        .expect("start a consumer with the WAL source");
    let (slot_count, _) = slots(&c).await;
    assert_eq!(slot_count, 1, "the consumer holds one slot");
    let temporary: bool =
        c.query_one("SELECT bool_and(temporary) FROM pg_replication_slots", &[]).await.expect("slots").get(0);
    assert!(temporary, "the slot is temporary");

    // After the first drain (nothing yet), single events one by one: each
    // must come from the stream's wake-up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..5 {
        let id: i64 = c
            .query_one(
                "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('subscription', $1, 'Single', jsonb_build_object('i', $2::int)) RETURNING id",
                &[&aggregates[0], &i],
            )
            .await
            .expect("insert")
            .get(0);
        let d = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap_or_else(|_| panic!("event {id} not delivered within 10 s (the sweep is 1 h away)"))
            .expect("stream ended");
        assert_eq!(d.id, id);
        d.ack();
    }

    // 8 producers that lock their aggregate's row first (the
    // producer-locked contract) on 4 aggregates: order per aggregate holds,
    // each event within 10 s (the sweep is 1 h away).
    let (producers, per_producer) = (8usize, 30usize);
    let mut clients = Vec::new();
    for _ in 0..producers {
        clients.push(faults::connect(&url, "wal producer", LIVENESS).await);
    }
    crate::ordering_modes::locking_producers(clients, &aggregates, per_producer).await;
    crate::ordering_modes::assert_versions_in_order(&mut stream, producers * per_producer, 10).await;
    stream.shutdown();
    let end = tokio::time::timeout(Duration::from_secs(30), async { while stream.next().await.is_some() {} }).await;
    assert!(end.is_ok(), "the stream ends after shutdown");
    support::eventually(10, "the slot to go with the consumer", || async { slots(&c).await.0 == 0 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relay_leaves_no_slot_and_delivers_a_100_000_event_transaction_when_back() {
    let server = logical_server().await;
    if !wal_supported(&server).await {
        return;
    }
    let url = migrated(&server, "wal_killed", &["--ordering", "producer-locked", "--source", "wal"]).await;
    let c = faults::connect(&url, "wal test", LIVENESS).await;
    let args = ["--source", "wal", "--sink", "stdout", "--max-buffered-bytes", "4MiB"];
    let spec = || relay_on(&url, &args);
    let mut relay = spec().start().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(slots(&c).await.0, 1, "the running relay holds one slot");
    relay.kill9().await;
    support::eventually(10, "the slot to go with the killed relay", || async { slots(&c).await == (0, 0) }).await;

    // While it is down: one transaction of 100 000 events, and 4 events of
    // 1 MiB each.
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'bulk', gen_random_uuid(), 'Bulk', jsonb_build_object('n', n) FROM generate_series(1, 100000) n; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'large', gen_random_uuid(), 'Large', jsonb_build_object('blob', repeat('x', 1048576)) \
           FROM generate_series(1, 4)",
    )
    .await
    .expect("write while the relay is down");
    let (count, retained) = slots(&c).await;
    assert_eq!((count, retained), (0, 0), "no slot and no WAL kept while no relay runs");

    let _relay = spec().start().await.unwrap_or_else(|e| panic!("{e}"));
    support::eventually(120, "all 100 004 events published", || async {
        c.query_one("SELECT count(*) FILTER (WHERE published_at IS NULL) = 0 FROM events.outbox", &[])
            .await
            .is_ok_and(|r| r.get(0))
    })
    .await;
    // And a large transaction written while it runs arrives from the
    // stream (the sweep is 1 s; the transaction's commit wakes it).
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'bulk', gen_random_uuid(), 'Bulk', jsonb_build_object('n', n) FROM generate_series(1, 100000) n",
    )
    .await
    .expect("a large transaction while the relay runs");
    support::eventually(120, "the second 100 000 published", || async {
        c.query_one("SELECT count(*) FILTER (WHERE published_at IS NULL) = 0 FROM events.outbox", &[])
            .await
            .is_ok_and(|r| r.get(0))
    })
    .await;
    let published: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert_eq!(published, 200_004);
}

/// The fault suite's load with a WAL-source relay: `kill -9` of the relay
/// (`Fault::Kill`), termination of its replication backend
/// (`Fault::Walsender`), or restarts of the server (`Fault::Restart`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    Kill,
    Walsender,
    Restart,
}

async fn fault_suite(fault: Fault, seed: u64, db: &str) {
    const FAULTS: usize = 3;
    let mut rng = StdRng::seed_from_u64(seed);
    let server = Arc::new(logical_server().await);
    if !wal_supported(&server).await {
        return;
    }
    // The outbox-locked mode (its trigger keeps the order for the suite's
    // producers, which lock nothing of their own); the relay never asks
    // for its NOTIFY.
    let url = migrated(&server, db, &["--source", "wal"]).await;
    let kind = match fault {
        Fault::Kill => "wal_kill_9",
        Fault::Walsender => "wal_walsender_terminated",
        Fault::Restart => "wal_postgres_restart",
    };
    let mut h =
        Harness::new(kind, seed, url.clone(), Behavior::Ok, &["--source", "wal", "--sweep-interval", "10s"]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&url, seed, &mut rng));
    let mut injected = 0;
    for p in fault_points(&mut rng, load.events, FAULTS) {
        load.reached(p).await;
        match fault {
            Fault::Kill => {
                h.assert_relays_running().await;
                let i = h.relays.iter().position(|r| r.alive).expect("a relay runs");
                h.relays[i].kill9().await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..200))).await;
                h.start_relay().await;
            }
            Fault::Walsender => {
                let admin = faults::connect(&url, "wal admin", LIVENESS).await;
                let deadline = Instant::now() + LIVENESS;
                loop {
                    h.assert_relays_running().await;
                    let n: i64 = admin
                        .query_one(
                            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_replication \
                             WHERE application_name = 'pg-outbox wal'",
                            &[],
                        )
                        .await
                        .expect("terminate the WAL sender")
                        .get(0);
                    if n > 0 {
                        break;
                    }
                    assert!(Instant::now() < deadline, "no WAL sender to terminate\n{}", h.logs());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Fault::Restart => {
                let s = server.clone();
                tokio::task::spawn_blocking(move || s.restart())
                    .await
                    .expect("join")
                    .unwrap_or_else(|e| panic!("restart: {}", pg_outbox::error::report(&e)));
            }
        }
        injected += 1;
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(injected), ledger).await;
    let duplicates = if fault == Fault::Kill { 2 * BATCH * injected } else { 0 };
    h.check(&report, duplicates);
    let c = faults::connect(&url, "wal check", LIVENESS).await;
    let live = h.relays.iter().filter(|r| r.alive).count() as i64;
    let (count, _) = slots(&c).await;
    assert_eq!(count, live, "one slot per running relay, none left behind by the faults\n{}", h.logs());
    if fault != Fault::Kill {
        let resumed: usize = h.relays.iter().map(|r| r.signal_count("replication_resumed")).sum();
        assert!(resumed > 0, "the relay logged its reconnect:\n{}", h.logs());
    }
    drop(h);
    support::eventually(10, "no slot once the relays are gone", || async { slots(&c).await.0 == 0 }).await;
    drop(c);
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_source_kill_9() {
    fault_suite(Fault::Kill, 0x3A1_0001, "wal_fault_kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_source_replication_backend_terminated() {
    fault_suite(Fault::Walsender, 0x3A1_0002, "wal_fault_walsender").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_source_postgres_restart() {
    fault_suite(Fault::Restart, 0x3A1_0003, "wal_fault_restart").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_server_lacks_is_named_and_the_relay_exits() {
    // The shared test server: whatever its wal_level, a database without
    // the publication is refused; with wal_level below logical, that first.
    let db = TestDb::new("wal_setup").await;
    let c = db.client().await;
    let wal_level: String = c.query_one("SHOW wal_level", &[]).await.expect("wal_level").get(0);
    let (status, log) = crate::relay_proc::run_to_exit(&db, &["--source", "wal", "--sink", "stdout"]).await;
    assert!(!status.success(), "the relay exits non-zero: {log}");
    let needle = if support::server_version_num(&c).await < 140_000 {
        "needs 14 or later"
    } else if wal_level == "logical" {
        "pg-outbox migrate --source wal"
    } else {
        "wal_level = logical"
    };
    assert!(log.contains(needle), "the error names what to change ({needle}): {log}");

    let server = logical_server().await;
    if !wal_supported(&server).await {
        return;
    }
    let url = migrated(&server, "wal_lacks", &[]).await;
    let spec = |url: &str| relay_on(url, &["--source", "wal", "--sink", "stdout"]);
    let mut relay = spec(&url).spawn().unwrap_or_else(|e| panic!("{e}"));
    let status = relay.wait().await;
    let log = relay.log();
    assert!(!status.success(), "no publication: the relay exits non-zero: {log}");
    assert!(log.contains("pg-outbox migrate --source wal"), "names the migrate step: {log}");

    let out = support::cli(&["migrate", "--source", "wal"]).url(&url).run().await;
    assert!(out.ok(), "migrate --source wal: {}", out.stderr);
    assert!(out.stderr.contains("outbox-locked mode's insert trigger stays"), "says the trigger stays: {}", out.stderr);
    let admin = faults::connect(&url, "wal admin", LIVENESS).await;
    admin
        .batch_execute(
            "CREATE ROLE app_no_replication LOGIN; \
             GRANT USAGE ON SCHEMA events TO app_no_replication; \
             GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA events TO app_no_replication; \
             GRANT INSERT, DELETE ON events.outbox_relays, events.outbox_terms TO app_no_replication; \
             GRANT USAGE ON ALL SEQUENCES IN SCHEMA events TO app_no_replication",
        )
        .await
        .expect("a role without REPLICATION");
    let weak = url.replacen("postgres://postgres@", "postgres://app_no_replication@", 1);
    assert_ne!(weak, url, "the throwaway server's URL names its user");
    let mut relay = spec(&weak).spawn().unwrap_or_else(|e| panic!("{e}"));
    let status = relay.wait().await;
    let log = relay.log();
    assert!(!status.success(), "no REPLICATION: the relay exits non-zero: {log}");
    assert!(
        log.contains("ALTER ROLE app_no_replication REPLICATION") || log.contains("REPLICATION privilege"),
        "names the privilege: {log}"
    );
    let (count, _) = slots(&admin).await;
    assert_eq!(count, 0, "a refused relay leaves no slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_relay_where_no_insert_trigger_fires_says_it_finds_events_by_the_sweep_only() {
    // The publication can be created whatever the server's wal_level; the
    // trigger's state is what the LISTEN relay must notice.
    let db = TestDb::new("wal_listen_warning").await;
    let out = support::cli(&["migrate", "--ordering", "producer-locked", "--source", "wal"]).url(&db.url()).run().await;
    assert!(out.ok(), "migrate --source wal: {}", out.stderr);
    assert!(out.stderr.contains("no insert trigger fires"), "migrate says so: {}", out.stderr);
    let mut relay = crate::relay_proc::start(&db, &["--sink", "stdout"]).await;
    relay.wait_for_signal(&["sweep_only"]).await;
    relay.sigterm();
    relay.wait().await;
    let out = support::cli(&["migrate", "--source", "listen"]).url(&db.url()).run().await;
    assert!(out.ok(), "migrate --source listen: {}", out.stderr);
    let c = db.client().await;
    assert_eq!(trigger_states(&c).await, ("D".to_string(), "O".to_string()), "the wake-up trigger fires again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_confirms_wal_it_has_no_events_in() {
    // WAL of other tables (nothing published) must not pile up behind the
    // running relay's slot: it confirms keepalives' WAL end too.
    let server = logical_server().await;
    if !wal_supported(&server).await {
        return;
    }
    let url = migrated(&server, "wal_confirms", &["--source", "wal"]).await;
    let c = faults::connect(&url, "wal test", LIVENESS).await;
    let relay =
        relay_on(&url, &["--source", "wal", "--sink", "stdout"]).start().await.unwrap_or_else(|e| panic!("{e}"));
    assert!(relay.log().contains("relay started; woken by logical replication"), "{}", relay.log());
    c.batch_execute(
        "CREATE TABLE other (id int, filler text); \
         INSERT INTO other SELECT n, repeat('x', 1000) FROM generate_series(1, 20000) n",
    )
    .await
    .expect("about 20 MB of WAL in another table");
    let written: i64 =
        c.query_one("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8", &[]).await.expect("lsn").get(0);
    support::eventually(60, "the slot to confirm past the other table's WAL", || async {
        c.query_one(
            "SELECT coalesce(bool_and(pg_wal_lsn_diff(confirmed_flush_lsn, '0/0') >= $1::int8), false) \
             FROM pg_replication_slots",
            &[&written],
        )
        .await
        .is_ok_and(|r| r.get(0))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_write_transaction_delays_the_slot_not_the_relay() {
    // Creating a slot waits for the write transactions running in the
    // cluster; its lock_timeout (10 s) ends the wait. The relay starts
    // anyway, delivers by the sweep, and streams once the transaction ends.
    let server = logical_server().await;
    if !wal_supported(&server).await {
        return;
    }
    let url = migrated(&server, "wal_long_tx", &["--source", "wal"]).await;
    let c = faults::connect(&url, "wal test", LIVENESS).await;
    c.batch_execute("CREATE TABLE other (id int)").await.expect("a table");
    let long = faults::connect(&url, "wal long transaction", LIVENESS).await;
    long.batch_execute("BEGIN; INSERT INTO other VALUES (1)").await.expect("a write transaction left open");
    let started = Instant::now();
    let port = pg_outbox_testkit::process::free_port();
    let mut relay = relay_on(
        &url,
        &["--source", "wal", "--sink", "stdout", "--sweep-interval", "500ms", "--metrics-addr", &port.to_string()],
    )
    .start()
    .await
    .unwrap_or_else(|e| panic!("the relay starts despite the long transaction: {e}"));
    let waited = started.elapsed();
    relay.wait_signal(&["replication_pending"], LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
    // Ready (the sweep delivers), and degraded: the stream is not there.
    let (_, body) = crate::health::probe_until(port, "/readyz", LIVENESS, |code, _| code == 200).await;
    assert_eq!(body["checks"]["listener"]["status"], "degraded", "{body}");
    assert_eq!(body["listener"]["enabled"], true, "{body}");
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('a', gen_random_uuid(), 'E', '{}')",
        &[],
    )
    .await
    .expect("insert");
    support::eventually(30, "the event published by the sweep meanwhile", || async {
        c.query_one("SELECT count(*) FILTER (WHERE published_at IS NULL) = 0 FROM events.outbox", &[])
            .await
            .is_ok_and(|r| r.get(0))
    })
    .await;
    long.batch_execute("COMMIT").await.expect("the long transaction ends");
    relay.wait_signal(&["replication_resumed"], Duration::from_secs(60)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(slots(&c).await.0, 1, "the slot exists once the transaction ended");
    let (_, body) =
        crate::health::probe_until(port, "/readyz", LIVENESS, |_, b| b["listener"]["listening"] == true).await;
    assert_eq!(body["checks"]["listener"]["status"], "ok", "{body}");
    println!("wal: the relay started after {waited:?} with a write transaction open (slot lock_timeout 10 s)");
}

/// A consumer with the WAL source on `url` in `mode`, its sweep an hour
/// away (only the stream, a takeover or a retry timer wakes it in time).
async fn wal_consumer(url: &str, mode: pg_outbox::Mode) -> pg_outbox::EventStream {
    Consumer::builder(pg_outbox::ConnectOptions::parse(url).expect("url"))
        .source(SourceKind::Wal)
        .mode(mode)
        .batch_size(10)
        .sweep_interval(Duration::from_secs(3600))
        .retry_policy(pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(200)]).expect("a schedule"))
        .start()
        .await
        .expect("start a consumer with the WAL source")
}

/// Read `stream` into `log` as (consumer, id, aggregate), acknowledging,
/// but failing the first delivery of each aggregate of `fail_once`.
fn read_into(
    mut stream: pg_outbox::EventStream,
    idx: usize,
    log: Arc<std::sync::Mutex<Vec<(usize, i64, Uuid)>>>,
    fail_once: Arc<std::sync::Mutex<std::collections::HashSet<Uuid>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(d) = stream.next().await {
            if fail_once.lock().expect("set").remove(&d.aggregate_id) {
                d.fail("the test fails it once");
                continue;
            }
            log.lock().expect("log").push((idx, d.id, d.aggregate_id));
            d.ack();
        }
        // The acknowledgements still batched are written before it ends.
        stream.finish().await.expect("finish");
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_with_a_retry_works_with_the_wal_source() {
    let server = logical_server().await;
    if !wal_supported(&server).await {
        return;
    }
    let modes = [
        ("single", pg_outbox::Mode::Single),
        ("partitioned", pg_outbox::Mode::Partitioned { partitions: 4 }),
        ("competing", pg_outbox::Mode::Competing),
    ];
    for (name, mode) in modes {
        let url = migrated(&server, &format!("wal_mode_{name}"), &["--source", "wal"]).await;
        let c = faults::connect(&url, "wal test", LIVENESS).await;
        let log: Arc<std::sync::Mutex<Vec<(usize, i64, Uuid)>>> = Arc::default();
        let fail_once: Arc<std::sync::Mutex<std::collections::HashSet<Uuid>>> = Arc::default();
        let mut readers = Vec::new();
        for i in 0..2 {
            let s = wal_consumer(&url, mode).await;
            readers.push((s.shutdown_handle(), read_into(s, i, log.clone(), fail_once.clone())));
        }
        // Let the partitions settle.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let aggs: Vec<Uuid> = (0..8).map(|_| Uuid::new_v4()).collect();
        // The first delivery of the first aggregate fails once.
        fail_once.lock().expect("set").insert(aggs[0]);
        let mut committed = Vec::new();
        for _ in 0..5 {
            for a in &aggs {
                committed.extend(support::insert_seed_events(&c, *a, 1).await);
            }
        }
        support::eventually(30, &format!("{name}: every event delivered (the sweep is 1 h away)"), || async {
            log.lock().expect("log").len() >= committed.len()
        })
        .await;
        // In single mode the standby holds no stream (its WAL sender would
        // decode all the WAL for nothing); the active consumer stops, the
        // standby takes over, opens its stream and is woken by it.
        if mode == pg_outbox::Mode::Single {
            support::eventually(
                30,
                "single: one slot, the leader's (the standby closed the one it opened at start)",
                || async { database_slots(&c).await == 1 },
            )
            .await;
            let active = log.lock().expect("log")[0].0;
            let (h, r) = readers.remove(active);
            h.shutdown();
            r.await.expect("reader");
            let more = support::insert_seed_events(&c, aggs[1], 3).await;
            committed.extend(more);
            support::eventually(30, "single: the standby took over and delivered", || async {
                log.lock().expect("log").len() >= committed.len()
            })
            .await;
            support::eventually(30, "single: the new leader streams from its own slot", || async {
                database_slots(&c).await == 1
            })
            .await;
            // Its stream wakes it (the sweep is an hour away).
            committed.extend(support::insert_seed_events(&c, aggs[2], 3).await);
            support::eventually(30, "single: the new leader's stream woke it", || async {
                log.lock().expect("log").len() >= committed.len()
            })
            .await;
        }
        for (h, r) in readers {
            h.shutdown();
            r.await.expect("reader");
        }
        let log = log.lock().expect("log").clone();
        let ids: Vec<i64> = log.iter().map(|e| e.1).collect();
        assert_eq!(
            ids.iter().copied().collect::<std::collections::HashSet<_>>(),
            committed.iter().copied().collect::<std::collections::HashSet<_>>(),
            "{name}: every committed event acknowledged"
        );
        if mode != pg_outbox::Mode::Competing {
            let mut last: HashMap<Uuid, i64> = HashMap::new();
            for (_, id, agg) in &log {
                if let Some(prev) = last.insert(*agg, *id) {
                    assert!(prev < *id, "{name}: aggregate {agg}: {id} after {prev} (the retried event held the rest)");
                }
            }
        }
        let retried: i64 = c
            .query_one("SELECT count(*) FROM events.outbox WHERE retry_count = 1 AND published_at IS NOT NULL", &[])
            .await
            .expect("count")
            .get(0);
        assert_eq!(retried, 1, "{name}: the failed event was retried by the retry timer and published");
    }
}

#[tokio::test]
async fn wrong_source_flags_are_refused_naming_the_flag() {
    let (code, _, err) =
        support::cli(&["relay", "--source", "kafka"]).url("postgres://u@127.0.0.1:1/d").run().await.parts();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--source") && err.contains("listen") && err.contains("wal"), "names the values: {err}");
    let (code, _, err) = support::cli(&["relay", "--source", "wal", "--no-listen"])
        .url("postgres://u@127.0.0.1:1/d")
        .run()
        .await
        .parts();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--no-listen applies to --source listen"), "{err}");
    // A config file may set it: `--print-config` prints it and reads back.
    let (code, out, err) = support::cli(&["relay", "--source", "wal", "--print-config"])
        .url("postgres://u@127.0.0.1:1/d")
        .run()
        .await
        .parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("source = \"wal\""), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_postgresql_15_the_publication_sends_the_id_alone() {
    let server = logical_server().await;
    if !wal_supported(&server).await {
        return;
    }
    let url = migrated(&server, "wal_columns", &["--source", "wal"]).await;
    let c = faults::connect(&url, "wal test", LIVENESS).await;
    let columns: Vec<String> = c
        .query("SELECT unnest(attnames)::text FROM pg_publication_tables WHERE pubname = 'pg_outbox'", &[])
        .await
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    if support::server_version_num(&c).await >= 150_000 {
        assert_eq!(columns, vec!["id".to_string()], "only the id is published");
    } else {
        assert!(columns.is_empty(), "PostgreSQL 14 has no column lists (nor attnames)");
    }
    // Either way the publication carries inserts only.
    let (ins, upd, del): (bool, bool, bool) = c
        .query_one("SELECT pubinsert, pubupdate, pubdelete FROM pg_publication WHERE pubname = 'pg_outbox'", &[])
        .await
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .expect("the publication");
    assert_eq!((ins, upd, del), (true, false, false));
}

//! Managed-server behaviour: what a hosted PostgreSQL does to long-lived
//! sessions.
//!
//! - `idle_session_timeout` set on the database (as some managed services
//!   set it, or a DBA does to reap idle sessions): the relay's own sessions
//!   turn it off for themselves, so they are never closed; a relay whose
//!   URL sets it back (the URL's `options` win) has its idle sessions
//!   closed by the server every few seconds, reconnects each time, and
//!   still delivers every event.
//! - A server restart (what a serverless compute that suspends and resumes
//!   looks like to a client): the relay's sessions come back, nothing is
//!   lost, and the delivery latency, measured before the restart in the
//!   same test (the floor), is back near it within a bound.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex, PoisonError};

use uuid::Uuid;

use pg_outbox_testkit::TempServer;
use pg_outbox_testkit::process::{self, LIVENESS};

use crate::faults::{self, BATCH, Behavior, Faults, Harness, Ledger, Sink};
use crate::needs;
use crate::support::{self, TestDb};

/// The database's `idle_session_timeout` in the first test (the issue's
/// figure).
const IDLE_TIMEOUT: &str = "3s";
/// How long the first test leaves the relays idle between events: past
/// the timeout.
const IDLE: Duration = Duration::from_millis(3500);

/// The relay's sessions on database `db`: (application name, backend pid).
async fn relay_sessions(c: &tokio_postgres::Client, db: &str) -> Vec<(String, i32)> {
    c.query(
        "SELECT application_name, pid FROM pg_stat_activity \
         WHERE datname = $1 AND application_name IN ('pg-outbox drain', 'pg-outbox writer', 'pg-outbox listener') \
         ORDER BY 1",
        &[&db],
    )
    .await
    .expect("read pg_stat_activity")
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Publish `n` events on `c` through pg-outbox; their ids.
async fn publish(c: &tokio_postgres::Client, n: usize) -> Vec<i64> {
    let publisher = pg_outbox::Publisher::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let event =
            pg_outbox::NewEvent::new("subscription", Uuid::new_v4(), "FaultSuiteEvent", serde_json::json!({ "n": i }));
        ids.push(publisher.publish(c, &event).await.expect("publish"));
    }
    ids
}

/// Wait until `sink` got a 2xx for every id in `ids` (failing with the
/// relay's stderr after [`LIVENESS`]).
async fn delivered(sink: &Sink, ids: &[i64], relay: &process::RelayProc) {
    let deadline = Instant::now() + LIVENESS;
    loop {
        let got: Vec<i64> = sink.attempts().iter().filter(|a| a.delivered()).map(|a| a.id).collect();
        if ids.iter().all(|id| got.contains(id)) {
            return;
        }
        assert!(Instant::now() < deadline, "events {ids:?} not delivered within {LIVENESS:?}; relay:\n{}", relay.log());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `url` with startup `options` added (a URL, or key=value settings).
fn with_options(url: &str, options: &str) -> String {
    if url.starts_with("postgres://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        let encoded: String = options.replace(' ', "%20").replace('=', "%3D");
        format!("{url}{sep}options={encoded}")
    } else {
        format!("{url} options='{options}'")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_session_timeout_on_the_database_leaves_the_relays_sessions_alone() {
    let kept = TestDb::new("managed_idle_kept").await;
    let closed = TestDb::new("managed_idle_closed").await;
    let c = kept.client().await;
    let num: i32 =
        c.query_one("SELECT current_setting('server_version_num')::int4", &[]).await.expect("version").get(0);
    if num < 140_000 {
        needs::skip("idle_session_timeout is new in PostgreSQL 14; this server is older");
        return;
    }
    for db in [&kept, &closed] {
        c.batch_execute(&format!("ALTER DATABASE {} SET idle_session_timeout = '{IDLE_TIMEOUT}'", db.name))
            .await
            .expect("set idle_session_timeout on the database");
    }
    // The setting holds for a plain session of the database.
    let plain = kept.client().await;
    let shown: String = plain.query_one("SHOW idle_session_timeout", &[]).await.expect("show").get(0);
    assert_eq!(shown, IDLE_TIMEOUT, "the database's setting is in force");
    drop(plain);

    // One relay as it comes; one whose URL sets the timeout again (the
    // URL's options win over the relay's own settings).
    let sink_kept = Sink::start(Behavior::Ok).await;
    let sink_closed = Sink::start(Behavior::Ok).await;
    let mut relay_kept = process::Relay::new(support::bin())
        .url(&kept.url())
        .args(&["--sink", &sink_kept.url_for(1)])
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let closed_url = with_options(&closed.url(), &format!("-c idle_session_timeout={IDLE_TIMEOUT}"));
    let mut relay_closed = process::Relay::new(support::bin())
        .url(&closed_url)
        .args(&["--sink", &sink_closed.url_for(1)])
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let before = relay_sessions(&c, &kept.name).await;
    assert_eq!(before.len(), 3, "drain, writer and listener sessions: {before:?}");

    let started = Instant::now();
    let mut events = 0;
    for round in 0..4 {
        if round > 0 {
            tokio::time::sleep(IDLE).await;
        }
        // Fresh sessions: the database's timeout closes idle ones.
        let (pk, pc) = (kept.client().await, closed.client().await);
        let sent = Instant::now();
        let (a, b) = (publish(&pk, 3).await, publish(&pc, 3).await);
        delivered(&sink_kept, &a, &relay_kept).await;
        delivered(&sink_closed, &b, &relay_closed).await;
        events += a.len();
        println!("idle_session_timeout round {round}: both relays delivered 3 events within {:?}", sent.elapsed());
    }
    relay_kept.check_running().await.unwrap_or_else(|e| panic!("{e}"));
    relay_closed.check_running().await.unwrap_or_else(|e| panic!("{e}"));
    let after = relay_sessions(&c, &kept.name).await;
    let (log_kept, log_closed) = (relay_kept.log(), relay_closed.log());
    let lost = |log: &str| {
        log.matches("LISTEN connection lost").count() + log.matches("connection closed; reconnecting").count()
    };
    println!(
        "idle_session_timeout={IDLE_TIMEOUT} on the database, {:?} idle between rounds: relay as it comes: {events} of \
         {events} events, {} sessions lost; relay whose URL sets the timeout: {events} of {events} events, {} sessions \
         lost and reopened; test_time={:?}",
        IDLE,
        lost(&log_kept),
        lost(&log_closed),
        started.elapsed()
    );
    assert_eq!(after, before, "the relay's sessions are the same backends throughout:\n{log_kept}");
    assert_eq!(lost(&log_kept), 0, "the relay lost no session:\n{log_kept}");
    assert!(
        lost(&log_closed) >= 2,
        "the server closed the idle sessions of the relay whose URL asks for it:\n{log_closed}"
    );
    assert!(log_closed.contains("LISTEN connection re-established"), "{log_closed}");
    relay_kept.stop_cleanly().await;
    relay_closed.stop_cleanly().await;
}

/// One probe: committed (its id and when its COMMIT was sent), or not known.
enum Probe {
    Committed(i64, Uuid, Instant),
    Uncertain(i64, Uuid),
    Failed,
}

/// Publish one event in a transaction of its own on `client`.
async fn probe(client: &mut tokio_postgres::Client, n: usize) -> Probe {
    let aggregate = Uuid::new_v4();
    let Ok(tx) = client.transaction().await else { return Probe::Failed };
    let event =
        pg_outbox::NewEvent::new("subscription", aggregate, "FaultSuiteEvent", serde_json::json!({ "probe": n }));
    let Ok(id) = pg_outbox::Publisher::new().publish(&tx, &event).await else { return Probe::Failed };
    let at = Instant::now();
    match tx.commit().await {
        Ok(()) => Probe::Committed(id, aggregate, at),
        Err(_) => Probe::Uncertain(id, aggregate),
    }
}

/// The latency before a restart and its return after it.
#[derive(Debug, Default)]
struct Recovery {
    /// Median latency of the probes committed before the restart.
    floor: Duration,
    /// Their largest.
    floor_max: Duration,
    floor_probes: usize,
    /// Twice the floor (taken as at least [`FLOOR_MIN`]).
    limit: Duration,
    /// The first probe committed after the restart: when (from the server
    /// accepting connections again) and its latency.
    first_after: Option<(Duration, Duration)>,
    /// The first window of probes whose median latency is within `limit`:
    /// when its first probe was committed, and that median.
    back: Option<(Duration, Duration)>,
}

/// The latency of each committed probe (from its COMMIT to its first 2xx
/// at the webhook), before and after the restart.
fn recovery(probes: &[Probe], attempts: &[faults::Attempt], restart_at: Instant, up_at: Instant) -> Recovery {
    let mut arrived: HashMap<i64, Instant> = HashMap::new();
    for a in attempts.iter().filter(|a| a.delivered()) {
        arrived.entry(a.id).or_insert(a.at);
    }
    let committed: Vec<(i64, Instant)> = probes
        .iter()
        .filter_map(|p| match *p {
            Probe::Committed(id, _, at) => Some((id, at)),
            _ => None,
        })
        .collect();
    let latency = |(id, at): &(i64, Instant)| arrived.get(id).map(|t| t.saturating_duration_since(*at));
    let before: Vec<Duration> = committed.iter().filter(|(_, at)| *at < restart_at).filter_map(latency).collect();
    if before.is_empty() {
        return Recovery::default();
    }
    let floor = median(before.clone());
    let limit = 2 * floor.max(FLOOR_MIN);
    let after: Vec<(Instant, Duration)> =
        committed.iter().filter(|(_, at)| *at >= up_at).filter_map(|p| latency(p).map(|l| (p.1, l))).collect();
    let back = after
        .windows(WINDOW)
        .map(|w| (w[0].0.duration_since(up_at), median(w.iter().map(|(_, l)| *l).collect())))
        .find(|(_, m)| *m <= limit);
    Recovery {
        floor,
        floor_max: before.iter().copied().max().unwrap_or_default(),
        floor_probes: before.len(),
        limit,
        first_after: after.first().map(|(at, l)| (at.duration_since(up_at), *l)),
        back,
    }
}

/// The median of `xs` (not empty).
fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort_unstable();
    xs[xs.len() / 2]
}

/// Probes in each window after the restart.
const WINDOW: usize = 5;
/// Time between probes.
const PROBE_EVERY: Duration = Duration::from_millis(50);
/// Probes that make the floor.
const FLOOR_PROBES: usize = 30;
/// The latency counts as back near the floor once the median of
/// [`WINDOW`] consecutive probes is under twice the floor, the floor taken
/// as at least [`FLOOR_MIN`] (a floor of a millisecond or two would make
/// scheduler noise on this shared machine a failure).
const FLOOR_MIN: Duration = Duration::from_millis(5);
/// How long the server stays stopped (a suspended compute).
const SUSPENDED: Duration = Duration::from_secs(3);
/// Bound on the time from the restarted server accepting connections to
/// the first probe of such a window: the relay's longest reconnect wait
/// (10 s by default); after 3 s away its backoff waits about 1.6–3.2 s,
/// so 10 s is loose.
const RECOVERY_BOUND: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_a_server_restart_sessions_come_back_nothing_is_lost_and_latency_returns_to_the_floor() {
    const SEED: u64 = 0x3A4A_0001;
    let started = Instant::now();
    let server = tokio::task::spawn_blocking(TempServer::start)
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {}", pg_outbox::error::report(&e)));
    let admin = faults::connect(&server.url(), "managed admin", LIVENESS).await;
    admin.batch_execute("CREATE DATABASE managed_restart").await.expect("create database");
    let url = server.url_for("managed_restart");
    let migrate = support::cli(&["migrate"]).url(&url).run().await;
    assert!(migrate.ok(), "pg-outbox migrate failed: {}", migrate.stderr);
    let mut h = Harness::new("server_restart", SEED, url.clone(), Behavior::Ok, &[]).await;
    h.start_relay().await;

    // The prober: one event every 50 ms, reconnecting when the session is
    // gone, until told to stop.
    let stop = tokio_util::sync::CancellationToken::new();
    let probes: Arc<Mutex<Vec<Probe>>> = Arc::default();
    let prober = {
        let (url, stop, probes) = (url.clone(), stop.clone(), probes.clone());
        tokio::spawn(async move {
            let mut client = faults::connect(&url, "managed prober", LIVENESS).await;
            let mut n = 0;
            while !stop.is_cancelled() {
                if client.is_closed() {
                    client = faults::connect(&url, "managed prober", LIVENESS).await;
                }
                let p = probe(&mut client, n).await;
                probes.lock().unwrap_or_else(PoisonError::into_inner).push(p);
                n += 1;
                tokio::time::sleep(PROBE_EVERY).await;
            }
        })
    };
    tokio::time::sleep(PROBE_EVERY * (FLOOR_PROBES as u32 + 2)).await;
    // Suspend: a fast stop, the server away for a while, then a start on
    // the same port and data.
    let restart_at = Instant::now();
    let stopped = tokio::task::spawn_blocking(move || {
        let mut server = server;
        let r = server.stop_fast();
        (server, r)
    });
    let (mut server, r) = stopped.await.expect("join");
    r.unwrap_or_else(|e| panic!("stop: {}", pg_outbox::error::report(&e)));
    tokio::time::sleep(SUSPENDED).await;
    let started_again = tokio::task::spawn_blocking(move || {
        let r = server.start_again();
        (server, r)
    });
    let (server, r) = started_again.await.expect("join");
    r.unwrap_or_else(|e| panic!("start again: {}", pg_outbox::error::report(&e)));
    let up_at = Instant::now();
    // Probe on until the latency is back near the floor (and a little
    // longer), or the bound ran out.
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let recovered = {
            let probes = probes.lock().unwrap_or_else(PoisonError::into_inner);
            recovery(&probes, &h.sink.attempts(), restart_at, up_at).back.is_some()
        };
        if recovered || up_at.elapsed() > RECOVERY_BOUND + Duration::from_secs(1) {
            tokio::time::sleep(Duration::from_millis(500)).await;
            break;
        }
    }
    stop.cancel();
    prober.await.expect("prober");
    let probes = std::mem::take(&mut *probes.lock().unwrap_or_else(PoisonError::into_inner));
    let check = faults::connect(&url, "managed check", LIVENESS).await;
    let sessions = {
        let mut s = Vec::new();
        let deadline = Instant::now() + LIVENESS;
        while Instant::now() < deadline {
            s = relay_sessions(&check, "managed_restart").await;
            if s.len() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        s
    };
    assert_eq!(sessions.len(), 3, "the relay's drain, writer and listener sessions came back: {sessions:?}");

    // Nothing lost, per-aggregate order kept: the fault suite's checks on
    // the prober's ledger.
    let mut ledger = Ledger::default();
    for p in &probes {
        match *p {
            Probe::Committed(id, agg, _) => ledger.committed.push((id, agg)),
            Probe::Uncertain(id, agg) => ledger.uncertain.push((id, agg)),
            Probe::Failed => {}
        }
    }
    let report = h.finish(Faults::Injected(1), ledger).await;
    h.check(&report, 2 * BATCH + 1);

    let r = recovery(&probes, &h.sink.attempts(), restart_at, up_at);
    println!(
        "server_restart: down_for={:?} floor_median={:?} (max {:?}, {} probes) limit={:?} \
         first_probe_after_restart={:?} back_near_floor_after={:?} events={} lost={} duplicates={} \
         uncertain_commits={} test_time={:?}",
        up_at.duration_since(restart_at),
        r.floor,
        r.floor_max,
        r.floor_probes,
        r.limit,
        r.first_after,
        r.back,
        report.events,
        report.lost,
        report.duplicates,
        report.uncertain,
        started.elapsed()
    );
    assert!(r.floor_probes >= FLOOR_PROBES / 2, "enough probes before the restart: {}", r.floor_probes);
    let (at, _) = r.back.unwrap_or_else(|| {
        panic!("the latency never came back under {:?} (2x the floor {:?}) after the restart", r.limit, r.floor)
    });
    assert!(
        at <= RECOVERY_BOUND,
        "latency back under {:?} only {at:?} after the restart (bound {RECOVERY_BOUND:?})",
        r.limit
    );
    drop(h);
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

//! Failover: a throwaway primary and a streaming standby of it
//! (`TempServer::start_standby`, a base backup taken with `pg_basebackup`
//! from the same directory as the server's binaries), a real
//! `pg-outbox relay` and producers publishing through pg-outbox
//! (`ConnectOptions::connect_primary` and `Publisher`), all on one
//! multi-host URL with `target_session_attrs=read-write`.
//!
//! - a switchover: the primary stopped fast (it sends its last WAL to the
//!   standby first), then the standby promoted;
//! - a failover: the primary's postmaster killed with SIGKILL while a
//!   synchronous standby (`synchronous_standby_names`, `synchronous_commit`
//!   on) holds every committed transaction, then the standby promoted.
//!
//! Both check what the fault suite checks (`faults.rs`: nothing committed
//! lost, nothing rolled back sent, per-aggregate order kept, duplicates
//! only within the relay's in-flight window) and print the time from the
//! promotion to the relay's first delivery after it.
//!
//! The same two with the WAL source (`--source wal`, `wal_level =
//! logical`): its replication connection skips the standby among the
//! URL's hosts and streams from the promoted one.
//!
//! Last, a relay pointed at a standby: it exits in one line that says what
//! to do, and with `--wait-for-primary` it waits, then delivers once the
//! standby is promoted.
//!
//! The tests skip (or fail under `PG_OUTBOX_REQUIRE_TOOLS=1`) when
//! `pg_basebackup` is not beside the server's binaries.

use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use uuid::Uuid;

use pg_outbox_testkit::process::{self, LIVENESS};
use pg_outbox_testkit::{StandbyOptions, TempServer, TempServerOptions};

use crate::faults::{self, BATCH, Behavior, Faults, Harness, Load, Sink};
use crate::needs;
use crate::support;

/// The database the outbox lives in on each pair of servers.
const DB: &str = "failover";
/// Committed events per failover test.
const EVENTS: usize = 1200;
/// The relay's longest wait between reconnects in these tests: its default.
const RECONNECT_MAX_DELAY: Duration = pg_outbox::ConsumerBuilder::DEFAULT_RECONNECT_MAX_DELAY;
/// Bound asserted on the time from the promotion to the relay's first
/// delivery after it: the reconnect backoff's longest wait (the default,
/// 10 s), plus 5 s for the connect, the leader lock, the sweep and a noisy
/// machine. Measured here it is far below (the figures are printed).
const RESUME_BOUND: Duration = Duration::from_secs(15);

/// The pause between the primary's end and the promotion (a failover
/// manager's detection time, short).
const DETECTION: Duration = Duration::from_secs(1);

/// Promote `standby` (on a blocking thread), failing the test if it is not.
async fn promote(standby: TempServer) -> TempServer {
    let (standby, promoted) = blocking(move || {
        let r = standby.promote();
        (standby, r)
    })
    .await;
    must(promoted, "promote the standby");
    standby
}

/// Run `f` on a blocking thread (`TempServer`'s functions block).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("join a blocking task")
}

fn must<T>(r: pg_outbox_testkit::temp_server::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {}", pg_outbox::error::report(&e)))
}

/// A throwaway primary with the outbox migrated in [`DB`], and a streaming
/// standby of it (synchronous if asked); `None` after a skip line when
/// `pg_basebackup` is missing.
async fn pair(synchronous: bool, source: Source) -> Option<(TempServer, TempServer)> {
    let options = match source {
        Source::Listen => TempServerOptions::default(),
        Source::Wal => TempServerOptions::default().setting("wal_level", "logical"),
    };
    let primary = must(blocking(move || TempServer::start_with(options)).await, "throwaway primary");
    if !needs::server_program(primary.bindir(), "pg_basebackup") {
        blocking(move || drop(primary)).await;
        return None;
    }
    let admin = faults::connect(&primary.url(), "failover admin", LIVENESS).await;
    admin.batch_execute(&format!("CREATE DATABASE {DB}")).await.expect("create the database");
    drop(admin);
    let args: &[&str] = match source {
        Source::Listen => &["migrate"],
        Source::Wal => &["migrate", "--source", "wal"],
    };
    let migrate = support::cli(args).url(&primary.url_for(DB)).run().await;
    assert!(migrate.ok(), "pg-outbox migrate failed: {}", migrate.stderr);
    let (primary, standby) = blocking(move || {
        let standby = primary.start_standby(StandbyOptions::default().synchronous(synchronous));
        (primary, standby)
    })
    .await;
    let standby = must(standby, "streaming standby");
    // The standby streams (a synchronous one is the primary's synchronous
    // standby) before the test starts.
    let want = if synchronous { "sync" } else { "async" };
    let admin = faults::connect(&primary.url(), "failover admin", LIVENESS).await;
    support::eventually(30, &format!("the standby to stream ({want})"), || async {
        admin.query("SELECT state, sync_state FROM pg_stat_replication", &[]).await.is_ok_and(|rows| {
            rows.len() == 1 && rows[0].get::<_, String>(0) == "streaming" && rows[0].get::<_, String>(1) == want
        })
    })
    .await;
    Some((primary, standby))
}

/// Both servers on one URL, the primary first, as an application lists a
/// cluster's nodes: each host within 2 s, the writable one wanted.
fn multi_host_url(a: &TempServer, b: &TempServer) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{DB}?target_session_attrs=read-write&connect_timeout=2",
        a.port(),
        b.port()
    )
}

/// How the primary goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// `pg_ctl stop -m fast`, then the standby is promoted.
    Switchover,
    /// SIGKILL of the postmaster (a synchronous standby), then the standby
    /// is promoted.
    Crash,
}

/// Where the relay learns of new events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// LISTEN (the default).
    Listen,
    /// `--source wal` on a `wal_level = logical` pair: the replication
    /// connection must find the promoted standby among the URL's hosts.
    Wal,
}

/// The load through a relay, the fault mid-load, the promotion, and the
/// checks; prints the figures.
async fn fail_over(fault: Fault, seed: u64, source: Source) {
    let kind = match (fault, source) {
        (Fault::Switchover, Source::Listen) => "switchover",
        (Fault::Crash, Source::Listen) => "failover_kill_9",
        (Fault::Switchover, Source::Wal) => "switchover_wal",
        (Fault::Crash, Source::Wal) => "failover_kill_9_wal",
    };
    let started = Instant::now();
    let Some((primary, standby)) = pair(fault == Fault::Crash, source).await else { return };
    let url = multi_host_url(&primary, &standby);
    let extra: &[&str] = match source {
        Source::Listen => &[],
        Source::Wal => &["--source", "wal"],
    };
    let mut h = Harness::new(kind, seed, url.clone(), Behavior::Ok, extra).await;
    h.start_relay().await;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut spec = faults::load_spec(&url, seed, &mut rng);
    spec.events = EVENTS;
    spec.publisher = true;
    let load = Load::spawn(spec);
    load.reached(EVENTS * 2 / 5).await;
    h.assert_relays_running().await;

    let down_at = Instant::now();
    let primary = blocking(move || {
        let mut primary = primary;
        let r = match fault {
            Fault::Switchover => primary.stop_fast(),
            Fault::Crash => primary.kill(),
        };
        (primary, r)
    })
    .await;
    let (primary, stopped) = primary;
    must(stopped, "stop the primary");
    let stopped_in = down_at.elapsed();
    // What notices the loss and decides to promote takes a while (seconds
    // for Patroni or a managed service): meanwhile the relay's reconnects
    // find no primary, only the standby.
    tokio::time::sleep(DETECTION).await;
    let promote_at = Instant::now();
    let standby = promote(standby).await;
    let promoted_at = Instant::now();

    // The relay's first delivery after the promotion.
    let n = h.relays[0].n;
    let deadline = promoted_at + RESUME_BOUND + LIVENESS;
    let resumed_at = loop {
        if let Some(at) = h.sink.first_delivery_by(n, promoted_at) {
            break at;
        }
        assert!(Instant::now() < deadline, "fault={kind}: no delivery after the promotion\n{}", h.logs());
        h.assert_relays_running().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let resume = resumed_at.duration_since(promoted_at);

    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(1), ledger).await;
    println!(
        "fault={kind} stop_took={stopped_in:?} promote_took={:?} primary_down_to_promoted={:?} \
         resume_after_promotion={resume:?} lost={} duplicates={} order_violations={} uncertain_commits={} \
         test_time={:?}",
        promoted_at.duration_since(promote_at),
        promoted_at.duration_since(down_at),
        report.lost,
        report.duplicates,
        report.order_violations,
        report.uncertain,
        started.elapsed()
    );
    // Duplicates: at most what the relay held when its sessions went (its
    // buffer of two batches and the event in hand), acknowledgements lost
    // with the primary included.
    h.check(&report, 2 * BATCH + 1);
    assert!(
        resume < RESUME_BOUND,
        "fault={kind}: the relay resumed {resume:?} after the promotion, over the bound of {RESUME_BOUND:?} \
         (reconnect backoff up to {RECONNECT_MAX_DELAY:?})\n{}",
        h.logs()
    );
    // It met the standby while no host accepted writes, said so once, and
    // once when the promotion ended it.
    let log = h.relays[0].log();
    assert_eq!(h.relays[0].signal_count("read_only"), 1, "fault={kind}:\n{log}");
    assert_eq!(h.relays[0].signal_count("writable"), 1, "fault={kind}:\n{log}");
    if source == Source::Wal {
        // The stream came back on the promoted standby, with a new slot.
        // The delivery above may come from a sweep of the work session
        // while the replication connection still waits out its backoff (up
        // to RECONNECT_MAX_DELAY): wait for it, within the relay's bound.
        h.relays[0].wait_signal(&["replication_resumed"]).await;
        let promoted = faults::connect(&standby.url(), "failover check", LIVENESS).await;
        let slot_active = || async {
            promoted
                .query_one("SELECT count(*) FROM pg_replication_slots WHERE temporary AND active", &[])
                .await
                .is_ok_and(|r| r.get::<_, i64>(0) == 1)
        };
        support::eventually(30, &format!("fault={kind}: the relay to stream from the promoted standby"), slot_active)
            .await;
    }
    drop(h);
    blocking(move || drop((primary, standby))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchover_loses_nothing_and_keeps_each_aggregate_in_order() {
    fail_over(Fault::Switchover, 0xFA11_0001, Source::Listen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_primary_with_a_synchronous_standby_loses_nothing_committed() {
    fail_over(Fault::Crash, 0xFA11_0002, Source::Listen).await;
}

#[cfg(feature = "wal")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchover_with_the_wal_source_loses_nothing_and_streams_from_the_promoted_standby() {
    fail_over(Fault::Switchover, 0xFA11_0003, Source::Wal).await;
}

#[cfg(feature = "wal")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_primary_with_a_synchronous_standby_and_the_wal_source_loses_nothing() {
    fail_over(Fault::Crash, 0xFA11_0004, Source::Wal).await;
}

/// Publish `n` events on `url` through pg-outbox; their ids.
async fn publish(url: &str, n: usize) -> Vec<i64> {
    let client = faults::connect(url, "failover publisher", LIVENESS).await;
    let publisher = pg_outbox::Publisher::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let event =
            pg_outbox::NewEvent::new("subscription", Uuid::new_v4(), "FaultSuiteEvent", serde_json::json!({ "n": i }));
        ids.push(publisher.publish(&client, &event).await.expect("publish"));
    }
    ids
}

/// `error:` lines of a command's stderr.
fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("error:")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_pointed_at_a_standby_exits_in_one_line_or_waits_for_the_promotion() {
    let Some((primary, standby)) = pair(false, Source::Listen).await else { return };
    let standby_url = standby.url_for(DB);
    let ids = publish(&primary.url_for(DB), 3).await;
    let on_standby = faults::connect(&standby_url, "failover check", LIVENESS).await;
    support::eventually(30, "the standby to replay the events", || async {
        on_standby.query_one("SELECT count(*) FROM events.outbox", &[]).await.is_ok_and(|r| r.get::<_, i64>(0) == 3)
    })
    .await;

    // Without --wait-for-primary: a non-zero exit and one line saying what to do.
    let sink = Sink::start(Behavior::Ok).await;
    let out = support::cli(&["relay", "--sink", &sink.url_for(1)]).url(&standby_url).run().await;
    assert_eq!(out.code, Some(1), "the relay exits 1 on a standby: {}", out.stderr);
    let errors = error_lines(&out.stderr);
    assert_eq!(errors.len(), 1, "one error line: {}", out.stderr);
    let line = errors[0];
    println!("relay on a standby: {line}");
    let at = format!("127.0.0.1:{}", standby.port());
    for needle in
        [at.as_str(), "is a read-only standby (in recovery)", "target_session_attrs=read-write", "--wait-for-primary"]
    {
        assert!(line.contains(needle), "{needle:?} in: {line}");
    }
    assert!(!out.stderr.contains("cannot execute LISTEN during recovery"), "{}", out.stderr);
    // The commands that write refuse it the same way; reading works.
    for args in [
        vec!["migrate"],
        vec![
            "publish",
            "--aggregate-type",
            "a",
            "--aggregate-id",
            &Uuid::nil().to_string(),
            "--event-type",
            "E",
            "--payload",
            "{}",
        ],
        vec!["dead-letters", "retry", "--all"],
    ] {
        let out = support::cli(&args).url(&standby_url).run().await;
        assert_eq!(out.code, Some(1), "{args:?} exits 1 on a standby: {}", out.stderr);
        assert!(
            error_lines(&out.stderr).iter().any(|l| l.contains("is a read-only standby (in recovery)")),
            "{args:?}: {}",
            out.stderr
        );
    }
    let status = support::cli(&["status"]).url(&standby_url).run().await;
    assert!(status.ok(), "status reads a standby: {}", status.stderr);
    // So does the console's list of relays: none runs on a standby.
    let relays = pg_outbox::console::relays(&on_standby).await.expect("the console's relays on a standby");
    assert!(relays.sessions.is_empty(), "no relay session on a standby: {:?}", relays.sessions);

    // With --wait-for-primary: it waits, saying so once, then delivers
    // after the promotion.
    let mut relay = process::Relay::new(support::bin())
        .url(&standby_url)
        .args(&["--sink", &sink.url_for(2), "--wait-for-primary", "--reconnect-max-delay", "400ms"])
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    relay.wait_for_signal(&["awaiting_promotion"]).await;
    // Several tries at up to 400 ms each.
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.check_running().await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!relay.signalled(process::STARTED), "no start before the promotion:\n{}", relay.log());
    let (primary, stopped) = blocking(move || {
        let mut primary = primary;
        let r = primary.stop_fast();
        (primary, r)
    })
    .await;
    must(stopped, "stop the primary");
    let standby = promote(standby).await;
    let promoted_at = Instant::now();
    relay.wait_for_signal(&[process::STARTED]).await;
    support::eventually(30, "the relay to deliver the events after the promotion", || async {
        let got: Vec<i64> = sink.attempts().iter().filter(|a| a.delivered()).map(|a| a.id).collect();
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    println!("wait_for_primary: started and delivered {:?} after the promotion", promoted_at.elapsed());
    let log = relay.log();
    println!("relay --wait-for-primary stderr:\n{log}");
    assert_eq!(log.matches("waiting for a promotion").count(), 1, "the wait is logged once:\n{log}");
    assert_eq!(log.matches("accepts writes now").count(), 1, "its end is logged once:\n{log}");
    relay.stop_cleanly().await;
    blocking(move || drop((primary, standby))).await;
}

/// key=value settings for `db`'s server behind a first host that accepts
/// TCP connections and never answers (a listener nobody serves: the kernel
/// completes the handshake, the startup message waits forever), each host
/// within `connect_timeout=1`.
fn behind_a_silent_host(db: &support::TestDb, silent: u16, attrs: &str) -> String {
    use tokio_postgres::config::Host;
    let host = match db.pg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "127.0.0.1".into(),
    };
    let port = db.pg.get_ports().first().copied().unwrap_or(5432);
    let user = db.pg.get_user().unwrap_or("postgres");
    format!("host=127.0.0.1,{host} port={silent},{port} user={user} dbname={} connect_timeout=1 {attrs}", db.name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_host_that_never_answers_costs_one_connect_timeout_then_the_next_host_serves() {
    let db = support::TestDb::new("failover_silent_host").await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_port = silent.local_addr().expect("addr").port();
    let url = behind_a_silent_host(&db, silent_port, "target_session_attrs=read-write");
    let opts = pg_outbox::ConnectOptions::parse(&url).expect("parse");
    let t = Instant::now();
    let client = opts
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect past the silent host: {}", pg_outbox::error::report(&e)));
    let took = t.elapsed();
    client.simple_query("SELECT 1").await.expect("the session works");
    println!("silent first host: connected to the second after {took:?} (connect_timeout=1)");
    assert!(took >= Duration::from_millis(900), "the first host got its whole second: {took:?}");
    assert!(took < Duration::from_secs(5), "one timeout, not more: {took:?}");
    let primary = opts.connect_primary().await.expect("connect_primary past the silent host");
    primary.simple_query("SELECT 1").await.expect("the session works");

    // Every host silent: one error naming each, after one timeout each.
    let other = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let other_port = other.local_addr().expect("addr").port();
    let both =
        format!("host=127.0.0.1,127.0.0.1 port={silent_port},{other_port} user=postgres dbname=x connect_timeout=1");
    let t = Instant::now();
    let e = pg_outbox::ConnectOptions::parse(&both).expect("parse").connect().await.expect_err("no host answers");
    let took = t.elapsed();
    let text = pg_outbox::error::report(&e);
    assert!(matches!(e, pg_outbox::Error::ConnectTimedOut { .. }), "{text}");
    for needle in [format!("127.0.0.1:{silent_port} or 127.0.0.1:{other_port}"), "within 1s".to_string()] {
        assert!(text.contains(&needle), "{needle:?} in: {text}");
    }
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_secs(6), "a second per host: {took:?}");
    drop((silent, other));
}

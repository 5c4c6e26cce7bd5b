//! No stranded leadership (single mode): a session that holds the outbox
//! lock with no live relay behind it is found by a standby, reported (log,
//! `outbox_leader_stranded`, `status`, the console) and, with
//! `--take-over-stranded`, ended so the standby takes over; a live leader
//! is never taken for one. (A frozen or cut-off relay's own session is
//! ended by the server before it would be found stranded: `freeze.rs`.)
//!
//! Each test prints one `stranded ...` line with what it measured:
//! detection (from the fault, or from the standby's start, to its warning),
//! takeover (to the standby's first delivery), and for a load: events,
//! lost, duplicates, order violations.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio_postgres::{Client, NoTls};
use uuid::Uuid;

use crate::freeze::Hook;
use crate::relay_proc::{self, LIVENESS, RelayProc, free_port};
use crate::support::{self, DbCli, TestDb, eventually};
use pg_outbox_testkit::process;

/// Single mode's leader lock (`src/store/locks.rs`, docs/architecture.md,
/// "Advisory lock keys").
const LEADER_KEY: i64 = 0x7067_6f75_7400_0001;
// The relay's log signals (docs/operations.md, "Logs"; never the wording).
/// A standby found a stranded holder.
const NO_LIVE_LEADER: &str = "stranded";
/// It ended one.
const ENDED: &str = "stranded_ended";
/// It may not end one.
const REFUSED: &str = "stranded_refused";
/// A relay took the lock.
const ACTIVE: &str = "leader";
/// A relay stands by.
const STANDBY: &str = "standby";
/// A leader's session is gone.
const DEPOSED: &str = "deposed";
/// The design's bound on finding a stranded holder.
const DETECTION_BOUND: Duration = Duration::from_secs(30);
/// A short threshold for the tests that do not measure the default one:
/// heartbeats and looks every second.
const FAST: &str = "3s";

// ------------------------------------------------------------- producers and the tally

const INSERT: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                      VALUES ('subscription', $1, 'StrandedTest', '{}') RETURNING id";

/// Insert `n` events round-robin over `aggregates`; their ids and aggregates.
async fn insert_events(c: &Client, aggregates: &[Uuid], n: usize) -> Vec<(i64, Uuid)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let agg = aggregates[i % aggregates.len()];
        let id: i64 = c.query_one(INSERT, &[&agg]).await.expect("insert an event").get(0);
        out.push((id, agg));
    }
    out
}

/// What a destination got against what was committed.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) events: usize,
    /// Committed, never received.
    pub(crate) lost: usize,
    /// Copies beyond the first.
    pub(crate) duplicates: usize,
    /// First copies of an aggregate's events out of id order.
    pub(crate) order_violations: usize,
    /// The first duplicates and order violations.
    pub(crate) examples: Vec<String>,
}

/// Tally `got` (`(id, aggregate)` in arrival order) against `committed`.
pub(crate) fn tally(
    committed: impl IntoIterator<Item = (i64, Uuid)>,
    got: impl IntoIterator<Item = (i64, Uuid)>,
) -> Tally {
    let committed: HashSet<i64> = committed.into_iter().map(|(id, _)| id).collect();
    let mut seen = HashSet::new();
    let mut last: HashMap<Uuid, i64> = HashMap::new();
    let mut t = Tally { events: committed.len(), ..Tally::default() };
    for (id, aggregate) in got {
        if !seen.insert(id) {
            t.duplicates += 1;
            if t.examples.len() < 20 {
                t.examples.push(format!("id {id} of {aggregate} again"));
            }
            continue;
        }
        let prev = last.entry(aggregate).or_insert(i64::MIN);
        if id < *prev {
            t.order_violations += 1;
            if t.examples.len() < 20 {
                t.examples.push(format!("order: id {id} of {aggregate} first came after id {prev}"));
            }
        }
        *prev = (*prev).max(id);
    }
    t.lost = committed.iter().filter(|id| !seen.contains(id)).count();
    t
}

/// Wait until the webhook got every committed event.
async fn all_delivered(hook: &Hook, committed: &[(i64, Uuid)], logs: impl Fn() -> String) {
    let want: HashSet<i64> = committed.iter().map(|(id, _)| *id).collect();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let got: HashSet<i64> = hook.got().iter().map(|g| g.id).collect();
        let missing = want.difference(&got).count();
        if missing == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{missing} of {} events never delivered\n{}", want.len(), logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ------------------------------------------------------------- helpers

/// A plain session named as a relay's work session that takes the outbox
/// lock and then sits idle, as a pooler's server session left with it
/// does; its client and backend pid.
async fn hold_leader_lock(cfg: &tokio_postgres::Config) -> (Client, i32) {
    let mut cfg = cfg.clone();
    cfg.application_name("pg-outbox drain");
    let (client, conn) = cfg.connect(NoTls).await.expect("connect the holder");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client.execute("SELECT pg_advisory_lock($1)", &[&LEADER_KEY]).await.expect("take the outbox lock");
    let pid: i32 = client.query_one("SELECT pg_backend_pid()", &[]).await.expect("pid").get(0);
    (client, pid)
}

/// The value of `name` in the relay's metrics at `addr` (summed over labels).
pub(crate) async fn metric(addr: &str, name: &str) -> Option<f64> {
    metric_in(&scrape(addr).await?, name)
}

/// The relay's metrics at `addr` (the text of `/metrics`), if it answers.
pub(crate) async fn scrape(addr: &str) -> Option<String> {
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().ok()?;
    http.get(format!("http://{addr}/metrics")).send().await.ok()?.text().await.ok()
}

/// The value of `name` in a scrape (summed over labels), if it is there.
pub(crate) fn metric_in(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

/// Wait until the relay at `addr` exports `name` = `value`.
async fn metric_is(addr: &str, name: &str, value: f64, secs: u64) {
    eventually(secs, &format!("{name} = {value} at {addr}"), || async { metric(addr, name).await == Some(value) })
        .await;
}

/// `pg-outbox status --json` on `db`.
async fn status_json(db: &TestDb) -> Value {
    let out = db.cli(&["status", "--json"]).run().await;
    assert!(out.ok(), "{out:?}");
    serde_json::from_str(&out.stdout).expect("status JSON")
}

/// The relay's first log line carrying `signal`.
fn log_line(relay: &RelayProc, signal: &str) -> String {
    relay.signal_line(signal)
}

/// How many of the relay's log lines carry `signal`.
fn log_count(relay: &RelayProc, signal: &str) -> usize {
    relay.signal_count(signal)
}

/// Wait until `relay` logs `signal`, for at most `limit`; how long that
/// took from `since`.
async fn logged_within(relay: &mut RelayProc, signal: &str, since: Instant, limit: Duration) -> Duration {
    relay.wait_signal(&[signal], limit.saturating_sub(since.elapsed())).await.unwrap_or_else(|e| panic!("{e}"));
    since.elapsed()
}

/// The overview of `pg-outbox console` on `db`, once it serves.
async fn console_overview(db: &TestDb) -> String {
    let port = free_port();
    let mut cmd = tokio::process::Command::new(support::bin());
    cmd.arg("console").arg("--addr").arg(format!("127.0.0.1:{port}")).arg("--refresh").arg("1h");
    process::clean_env(&mut cmd);
    cmd.env("DATABASE_URL", db.url()).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    let _child = cmd.kill_on_drop(true).spawn().expect("start pg-outbox console");
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().expect("HTTP client");
    let deadline = Instant::now() + LIVENESS;
    loop {
        if let Ok(r) = http.get(format!("http://127.0.0.1:{port}/")).send().await
            && r.status().is_success()
        {
            return r.text().await.expect("the overview");
        }
        assert!(Instant::now() < deadline, "the console never served its overview");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn aggregates(n: usize) -> Vec<Uuid> {
    (0..n).map(|_| Uuid::new_v4()).collect()
}

// ------------------------------------------------------------- tests

/// A plain session holding the outbox lock, idle (as PgBouncer keeps a
/// server session after a relay ran through it in transaction mode): a
/// relay with the default settings stands by, reports it within 30 s
/// (log, metric, `status`, console) and delivers nothing; a relay with
/// `--take-over-stranded` ends it, and every event is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_backend_holding_the_lock_is_reported_within_30s_and_ended_only_with_the_flag() {
    let db = TestDb::new("stranded_kept").await;
    let c = db.client().await;
    let (holder, holder_pid) = hold_leader_lock(&db.pg).await;
    let committed = insert_events(&c, &aggregates(8), 200).await;
    let hook = Hook::serve().await;

    let addr = format!("127.0.0.1:{}", free_port());
    let started = Instant::now();
    let mut first = relay_proc::start(&db, &["--sink", &hook.url(1), "--metrics-addr", &addr]).await;
    first.wait_for_signal(&[STANDBY]).await;
    let detected = logged_within(&mut first, NO_LIVE_LEADER, started, DETECTION_BOUND).await;
    let line = log_line(&first, NO_LIVE_LEADER);
    for part in [
        format!("pid={holder_pid}"),
        "application_name=\"pg-outbox drain\"".to_string(),
        "state=\"idle\"".to_string(),
        "idle=".to_string(),
        "client_addr=".to_string(),
        "heartbeat=none".to_string(),
        "--take-over-stranded".to_string(),
    ] {
        assert!(line.contains(&part), "the warning names {part}: {line}");
    }
    metric_is(&addr, pg_outbox::metrics::LEADER_STRANDED, 1.0, 10).await;
    assert_eq!(metric(&addr, pg_outbox::metrics::LEADER).await, Some(0.0));

    // status, as JSON and as text, and the console.
    let status = status_json(&db).await;
    let leader = &status["leader"];
    assert_eq!(leader["pid"], holder_pid, "{status}");
    assert_eq!(leader["live"], false, "{status}");
    assert_eq!(leader["application_name"], "pg-outbox drain", "{status}");
    assert_eq!(leader["state"], "idle", "{status}");
    assert_eq!(leader["heartbeat_age_seconds"], Value::Null, "{status}");
    assert!(leader["state_seconds"].as_f64().is_some_and(|s| s >= 1.0), "idle for a while: {status}");
    let text = db.cli(&["status"]).run().await;
    assert!(text.ok(), "{text:?}");
    let line = text.stdout.lines().find(|l| l.starts_with("leader")).unwrap_or_default().to_string();
    assert!(
        line.contains("no live leader") && line.contains(&format!("pid {holder_pid}")) && line.contains("idle for"),
        "{}",
        text.stdout
    );
    let overview = console_overview(&db).await;
    assert!(
        overview.contains("No live leader") && overview.contains(&format!("held by pid {holder_pid}")),
        "the console's overview says so: {overview}"
    );

    // Without the flag nothing is delivered, and the holder lives on.
    assert!(hook.got().is_empty(), "a standby delivered while the lock was held");
    assert_eq!(support::published_count(&c).await, 0);
    holder.simple_query("SELECT 1").await.expect("the holder is not ended without the flag");

    // A relay with the flag ends the holder; one of the two takes over.
    let started2 = Instant::now();
    let mut second = relay_proc::start(&db, &["--sink", &hook.url(2), "--take-over-stranded"]).await;
    let ended = logged_within(&mut second, ENDED, started2, DETECTION_BOUND).await;
    eventually(10, "the holder's session is ended", || async { holder.simple_query("SELECT 1").await.is_err() }).await;
    all_delivered(&hook, &committed, || format!("{}\n{}", first.log(), second.log())).await;
    let t = tally(committed.iter().copied(), hook.got().iter().map(|g| (g.id, g.aggregate)));
    assert_eq!((t.lost, t.duplicates, t.order_violations), (0, 0, 0), "{t:?}");
    metric_is(&addr, pg_outbox::metrics::LEADER_STRANDED, 0.0, 10).await;
    let status = status_json(&db).await;
    assert_eq!(status["leader"]["live"], true, "a relay leads now: {status}");
    let relays = [first.pid(), second.pid()].map(|p| p.map(u64::from));
    let leading = status["leader"]["relay"]["process_id"].as_u64();
    assert!(leading.is_some() && relays.contains(&leading), "a relay's own pid ({relays:?}): {status}");
    assert_ne!(status["leader"]["pid"], holder_pid, "{status}");
    let overview = console_overview(&db).await;
    let live = format!("Leader: pid {} (live, heartbeat", status["leader"]["pid"]);
    assert!(overview.contains(&live), "the console's overview shows the live leader ({live}): {overview}");
    println!(
        "stranded case=kept_backend detection={:.1}s (default threshold, from the standby's start) \
         ended_with_flag={:.1}s events={} lost={} duplicates={} order_violations={}",
        detected.as_secs_f64(),
        ended.as_secs_f64(),
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations
    );
}

/// A live leader is never taken for a stranded one, by a standby that
/// would end it (`--take-over-stranded`, a 6 s threshold: heartbeats and
/// looks every 2 s): not while idle, not while it drains a backlog, and
/// not while its session waits in a statement for twice the threshold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_leader_is_never_reported_stranded_idle_draining_a_backlog_or_busy_in_a_statement() {
    let db = TestDb::new("stranded_no_false_positive").await;
    let c = db.client().await;
    let (a_addr, b_addr) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let common = ["--sink", "stdout", "--stranded-after", "6s"];
    let a_spec = relay_proc::relay(&db, &common).args(&["--metrics-addr", &a_addr]).stdout(process::Output::Drained);
    let mut a = relay_proc::start_spec(a_spec).await;
    a.wait_for_signal(&[ACTIVE]).await;
    let mut b =
        relay_proc::start(&db, &[&common[..], &["--take-over-stranded", "--metrics-addr", b_addr.as_str()]].concat())
            .await;
    b.wait_for_signal(&[STANDBY]).await;
    let a_pid: i32 = c
        .query_one(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND classid = ($1::bigint >> 32)::oid AND objid = ($1::bigint & 4294967295)::oid",
            &[&LEADER_KEY],
        )
        .await
        .expect("the leader's pid")
        .get(0);
    let heartbeat_age = || async {
        c.query_one(
            "SELECT EXTRACT(EPOCH FROM (now() - updated_at))::float8 FROM events.outbox_relays WHERE pid = $1",
            &[&a_pid],
        )
        .await
        .map(|r| r.get::<_, f64>(0))
        .unwrap_or(f64::INFINITY)
    };
    let clean = |a: &RelayProc, b: &RelayProc| {
        assert!(!b.signalled(NO_LIVE_LEADER) && !b.signalled(ENDED), "a false positive:\n{}", b.log());
        assert!(!a.signalled(DEPOSED), "the leader lost its lock:\n{}\n{}", a.log(), b.log());
    };

    // Idle, then a backlog of 50 000 events drained, watched for at least
    // four thresholds.
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'subscription', gen_random_uuid(), 'Backlog', jsonb_build_object('n', g) FROM generate_series(1, 50000) g",
        &[],
    )
    .await
    .expect("insert the backlog");
    let backlog_at = Instant::now();
    let mut max_age = 0.0f64;
    let mut drained = None;
    let mut live_seen_while_draining = false;
    while drained.is_none() || started.elapsed() < Duration::from_secs(24) {
        max_age = max_age.max(heartbeat_age().await);
        assert_eq!(metric(&b_addr, pg_outbox::metrics::LEADER_STRANDED).await, Some(0.0), "{}", b.log());
        clean(&a, &b);
        if drained.is_none() {
            let left: i64 = c
                .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[])
                .await
                .expect("count")
                .get(0);
            if left == 0 {
                drained = Some(backlog_at.elapsed());
            } else if !live_seen_while_draining {
                let s = status_json(&db).await;
                assert_eq!(
                    (s["leader"]["pid"].as_i64(), s["leader"]["live"].as_bool()),
                    (Some(a_pid.into()), Some(true)),
                    "{s}"
                );
                live_seen_while_draining = true;
            }
        }
        assert!(backlog_at.elapsed() < Duration::from_secs(120), "the backlog never drained\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(max_age < 6.0, "the leader's heartbeat kept within the threshold while draining: {max_age:.2}s");

    // Busy in a statement: the leader's heartbeat waits for a row lock for
    // over twice the threshold (its session shows `active`, waiting on a
    // lock), long enough for two looks to find its heartbeat stale.
    let blocker = db.client().await;
    blocker
        .batch_execute(&format!("BEGIN; SELECT * FROM events.outbox_relays WHERE pid = {a_pid} FOR UPDATE"))
        .await
        .expect("lock the leader's row");
    let busy_from = Instant::now();
    let mut seen_waiting = false;
    let mut max_busy_age = 0.0f64;
    while busy_from.elapsed() < Duration::from_secs(13) {
        let row = c
            .query_one("SELECT state, wait_event_type FROM pg_stat_activity WHERE pid = $1", &[&a_pid])
            .await
            .expect("the leader's activity");
        let (state, wait): (Option<String>, Option<String>) = (row.get(0), row.get(1));
        seen_waiting |= state.as_deref() == Some("active") && wait.as_deref() == Some("Lock");
        max_busy_age = max_busy_age.max(heartbeat_age().await);
        assert_eq!(metric(&b_addr, pg_outbox::metrics::LEADER_STRANDED).await, Some(0.0), "{}", b.log());
        clean(&a, &b);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    blocker.batch_execute("COMMIT").await.expect("release the row");
    assert!(seen_waiting, "the leader's session waited on the row lock");
    assert!(max_busy_age > 10.0, "the heartbeat went stale for two looks meanwhile: {max_busy_age:.2}s");
    tokio::time::sleep(Duration::from_secs(5)).await;
    clean(&a, &b);
    let ids = support::insert_seed_events(&c, Uuid::new_v4(), 3).await;
    eventually(30, "events after the wait are delivered", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE id = ANY($1) AND published_at IS NOT NULL", &[&ids])
            .await
            .map(|r| r.get::<_, i64>(0) == 3)
            .unwrap_or(false)
    })
    .await;
    clean(&a, &b);
    println!(
        "stranded case=no_false_positive watched={:.0}s threshold=6s backlog=50000 drained_in={:.1}s \
         max_heartbeat_age_draining={max_age:.2}s busy_statement_heartbeat_age={max_busy_age:.1}s reports=0",
        started.elapsed().as_secs_f64(),
        drained.unwrap_or_default().as_secs_f64()
    );
}

// ------------------------------------------------------------- the role

/// `db.url()` with `user` for the user.
fn url_as(db: &TestDb, user: &str) -> String {
    let url = db.url();
    let current = db.pg.get_user().unwrap_or("postgres");
    if url.starts_with("postgres://") {
        url.replacen(&format!("postgres://{current}@"), &format!("postgres://{user}@"), 1)
    } else {
        url.replacen(&format!("user={current}"), &format!("user={user}"), 1)
    }
}

/// A relay whose role may not signal the holder's session logs what is
/// missing once and keeps standing by; granted `pg_signal_backend`, it
/// ends the holder and takes over. The holder is another role's session,
/// which the relay sees without state or address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_role_to_end_the_holder_a_standby_says_what_is_missing_and_stands_by() {
    let db = TestDb::new("stranded_role").await;
    let admin = db.client().await;
    let tag = std::process::id();
    let (relay_role, holder_role) = (format!("pgo_strand_relay_{tag}"), format!("pgo_strand_holder_{tag}"));
    admin
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {relay_role}; DROP ROLE IF EXISTS {holder_role}; \
             CREATE ROLE {relay_role} LOGIN; CREATE ROLE {holder_role} LOGIN; \
             GRANT USAGE ON SCHEMA events TO {relay_role}; \
             GRANT ALL ON ALL TABLES IN SCHEMA events TO {relay_role}; \
             GRANT ALL ON ALL SEQUENCES IN SCHEMA events TO {relay_role}"
        ))
        .await
        .expect("roles");
    let mut holder_cfg = db.pg.clone();
    holder_cfg.user(&holder_role);
    let (holder, holder_pid) = hold_leader_lock(&holder_cfg).await;
    let committed = insert_events(&admin, &aggregates(4), 20).await;
    let hook = Hook::serve().await;

    let spec = process::Relay::new(support::bin()).url(&url_as(&db, &relay_role)).args(&[
        "--sink",
        &hook.url(1),
        "--stranded-after",
        FAST,
        "--take-over-stranded",
    ]);
    let mut relay = relay_proc::start_spec(spec).await;
    let refused = REFUSED;
    relay.wait_signal(&[refused], DETECTION_BOUND).await.unwrap_or_else(|e| panic!("{e}"));
    let line = log_line(&relay, refused);
    assert!(line.contains("pg_signal_backend") && line.contains(&holder_pid.to_string()), "{line}");
    let warning = log_line(&relay, NO_LIVE_LEADER);
    assert!(warning.contains("state=\"hidden\"") && warning.contains("client_addr=\"hidden\""), "{warning}");
    // It keeps looking (every second) but says it once.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(log_count(&relay, refused), 1, "{}", relay.log());
    assert_eq!(log_count(&relay, NO_LIVE_LEADER), 1, "{}", relay.log());
    holder.simple_query("SELECT 1").await.expect("the holder lives on");
    assert!(hook.got().is_empty(), "nothing is delivered while the lock is held");
    relay.check_running().await.unwrap_or_else(|e| panic!("{e}"));

    admin.batch_execute(&format!("GRANT pg_signal_backend TO {relay_role}")).await.expect("grant");
    relay.wait_signal(&[ENDED], DETECTION_BOUND).await.unwrap_or_else(|e| panic!("{e}"));
    relay.wait_signal(&[ACTIVE], LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
    all_delivered(&hook, &committed, || relay.log()).await;
    relay.stop().await;
    drop(holder);
    admin
        .batch_execute(&format!(
            "DROP OWNED BY {relay_role}, {holder_role}; REVOKE pg_signal_backend FROM {relay_role}; \
             DROP ROLE {relay_role}; DROP ROLE {holder_role}"
        ))
        .await
        .expect("drop the roles");
}

#[tokio::test]
async fn a_leader_stopping_gracefully_keeps_its_heartbeat_while_it_waits_for_its_deliveries() {
    let db = TestDb::new("stranded_stopping").await;
    let c = db.client().await;
    let mut stream = pg_outbox::Consumer::builder(db.options())
        .stranded_after(Duration::from_secs(3))
        .shutdown_grace(Duration::from_secs(20))
        .start()
        .await
        .expect("start");
    support::insert_seed_events(&c, Uuid::new_v4(), 1).await;
    let held = tokio::time::timeout(Duration::from_secs(20), futures::StreamExt::next(&mut stream))
        .await
        .expect("a delivery in time")
        .expect("open");
    let pid: i32 = c
        .query_one("SELECT holder_pid FROM events.outbox_terms WHERE scope = 'outbox'", &[])
        .await
        .expect("the leader's pid")
        .get(0);
    // Stop while the delivery is still in hand: the loop waits for it,
    // within the grace, for longer than `stranded_after`.
    stream.shutdown_handle().shutdown();
    let age = || async {
        c.query_one(
            "SELECT EXTRACT(EPOCH FROM (now() - updated_at))::float8 FROM events.outbox_relays WHERE pid = $1",
            &[&pid],
        )
        .await
        .expect("the leader's heartbeat")
        .get::<_, f64>(0)
    };
    let mut oldest: f64 = 0.0;
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        oldest = oldest.max(age().await);
    }
    assert!(
        oldest < 3.0,
        "the heartbeat of a leader stopping gracefully went {oldest:.1} s without a refresh, past stranded_after (3 s)"
    );
    held.ack();
    stream.finish().await.expect("finish");
}

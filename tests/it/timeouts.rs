//! Statements pg-outbox gives up on do not go on running at the server: the
//! statement timeout of the consumer's sessions (`--statement-timeout`,
//! `ConsumerBuilder::statement_timeout`) cuts a fetch that waits too long,
//! the relay logs and counts it and delivers everything once the cause is
//! gone; stopping cancels a statement still running; a killed relay's
//! statement is ended by the server's client check; migrations run with the
//! timeout off. The slow statements are real: another session holds a lock
//! on `events.outbox` that they wait for.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_postgres::Client;
use uuid::Uuid;

use crate::relay_proc::{self, LIVENESS, free_port};
use crate::support::cli;
use crate::support::{TestDb, eventually, insert_seed_events, published_count};

/// The application names of pg-outbox's consumer sessions (drain, writer,
/// listener), as a LIKE pattern.
const OURS: &str = "pg-outbox %";

/// Backends of `db` whose application name is LIKE `app` running a
/// statement that waits for a lock.
async fn waiting_on_lock(c: &Client, db: &TestDb, app: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = $1 AND application_name LIKE $2 AND state = 'active' AND wait_event_type = 'Lock'",
        &[&db.name, &app],
    )
    .await
    .expect("read pg_stat_activity")
    .get(0)
}

/// Wait until a statement of a consumer session (the drain session's, or
/// the writer's while it prepares) waits for a lock (liveness bound 30 s;
/// the sessions of `db` are shown if none does).
async fn until_one_of_ours_waits(c: &Client, db: &TestDb) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while waiting_on_lock(c, db, OURS).await == 0 {
        if tokio::time::Instant::now() > deadline {
            let rows = c
                .query(
                    "SELECT pid, application_name, state, coalesce(wait_event_type, ''), coalesce(wait_event, ''), \
                     query FROM pg_stat_activity WHERE datname = $1",
                    &[&db.name],
                )
                .await
                .expect("read pg_stat_activity");
            let sessions: Vec<String> = rows
                .iter()
                .map(|r| {
                    format!(
                        "{} {:?} {} {}/{} {}",
                        r.get::<_, i32>(0),
                        r.get::<_, String>(1),
                        r.get::<_, String>(2),
                        r.get::<_, String>(3),
                        r.get::<_, String>(4),
                        r.get::<_, String>(5)
                    )
                })
                .collect();
            panic!("no statement of ours waits for the lock within 30 s; sessions:\n{}", sessions.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Backends of `db` whose application name is LIKE `app` running a
/// statement (waiting or not).
async fn active(c: &Client, db: &TestDb, app: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE $2 AND state = 'active'",
        &[&db.name, &app],
    )
    .await
    .expect("read pg_stat_activity")
    .get(0)
}

/// Process ids of the backends of `db` whose application name is LIKE `app`.
async fn pids(c: &Client, db: &TestDb, app: &str) -> HashSet<i32> {
    c.query("SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE $2", &[&db.name, &app])
        .await
        .expect("read pg_stat_activity")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Open a transaction on `locker` holding `events.outbox` in ACCESS
/// EXCLUSIVE mode: every statement of another session that reads the table
/// waits until the transaction ends.
async fn lock_outbox(locker: &Client) {
    locker.batch_execute("BEGIN; LOCK TABLE events.outbox IN ACCESS EXCLUSIVE MODE").await.expect("lock the outbox");
}

/// The value of the sample `series` (name and labels, as exported) in a
/// Prometheus scrape, if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

async fn scrape(addr: &str) -> String {
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("HTTP client");
    http.get(format!("http://{addr}/metrics")).send().await.expect("scrape").text().await.expect("body")
}

/// The `id` of a stdout sink record.
fn record_id(line: &str) -> i64 {
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    v["id"].as_i64().unwrap_or_else(|| panic!("no id: {line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_cut_by_the_statement_timeout_is_logged_counted_and_the_relay_delivers_everything_after() {
    let db = TestDb::new("timeout_relay").await;
    let c = db.client().await;
    let addr = format!("127.0.0.1:{}", free_port());
    let args =
        ["--sink", "stdout", "--statement-timeout", "200ms", "--sweep-interval", "100ms", "--metrics-addr", &addr];
    let (mut relay, stdout) = relay_proc::start_with_stdout(&db, &args).await;
    let mut lines = BufReader::new(stdout).lines();
    let mut delivered: HashSet<i64> = HashSet::new();

    let before = insert_seed_events(&c, Uuid::new_v4(), 3).await;
    while !before.iter().all(|id| delivered.contains(id)) {
        let line = tokio::time::timeout(LIVENESS, lines.next_line()).await.expect("a delivery").expect("stdout");
        delivered.insert(record_id(&line.expect("stdout open")));
    }
    // Their acknowledgements are written: the next statement to run is a
    // sweep's fetch, most likely.
    eventually(30, "the first events marked published", || async { published_count(&c).await == 3 }).await;

    // Hold the table for longer than the timeout; events committed with the
    // lock released must all be delivered afterwards.
    let locker = db.client().await;
    lock_outbox(&locker).await;
    let during = insert_seed_events(&locker, Uuid::new_v4(), 10).await;
    // Usually the fetch of the next sweep is the first statement to wait;
    // then the new sessions' preparation, until the lock is released.
    let timeouts = |text: &str| -> f64 {
        pg_outbox::metrics::TIMEOUT_STATEMENTS
            .iter()
            .filter_map(|kind| sample(text, &format!("outbox_statement_timeouts_total{{statement=\"{kind}\"}}")))
            .sum()
    };
    let deadline = tokio::time::Instant::now() + LIVENESS;
    let text = loop {
        let text = scrape(&addr).await;
        if timeouts(&text) >= 2.0 {
            break text;
        }
        assert!(tokio::time::Instant::now() < deadline, "no statement timed out:\n{text}\nstderr:\n{}", relay.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(sample(&text, pg_outbox::metrics::DATABASE_ERRORS).is_some_and(|n| n >= 1.0), "{text}");
    let warned = |log: String| {
        log.lines().any(|l| {
            l.contains("WARN")
                && l.contains("statement timeout")
                && l.contains("timeout=200ms")
                && pg_outbox::metrics::TIMEOUT_STATEMENTS.iter().any(|k| l.contains(&format!("statement=\"{k}\"")))
        })
    };
    eventually(10, "a warning naming the statement and the timeout", || async { warned(relay.log()) }).await;
    locker.batch_execute("COMMIT").await.expect("release the lock");

    while !during.iter().all(|id| delivered.contains(id)) {
        let line = tokio::time::timeout(LIVENESS, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("not every event was delivered after the lock; stderr:\n{}", relay.log()))
            .expect("read stdout")
            .expect("stdout open");
        delivered.insert(record_id(&line));
    }
    eventually(30, "every event marked published", || async { published_count(&c).await == 13 }).await;
    let untouched: i64 = c
        .query_one("SELECT count(*) FROM events.outbox WHERE retry_count = 0 AND last_error IS NULL", &[])
        .await
        .expect("count rows")
        .get(0);
    assert_eq!(untouched, 13, "a timeout is no failed attempt of any event");
    let published: HashSet<i64> = c
        .query("SELECT id FROM events.outbox WHERE published_at IS NOT NULL", &[])
        .await
        .expect("published ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(published.is_subset(&delivered), "published but never delivered: {:?}", published.difference(&delivered));
    let text = scrape(&addr).await;
    assert_eq!(sample(&text, pg_outbox::metrics::EVENTS_FAILED), Some(0.0), "{text}");
    relay.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_fetch_times_out_reconnects_and_delivers_every_event() {
    let db = TestDb::new("timeout_consumer").await;
    let c = db.client().await;
    let mut stream = pg_outbox::Consumer::builder(db.options())
        .statement_timeout(Duration::from_millis(200))
        .sweep_interval(Duration::from_millis(100))
        .start()
        .await
        .expect("start the consumer");
    let first = pids(&c, &db, "pg-outbox drain").await;
    assert_eq!(first.len(), 1, "one drain session: {first:?}");

    let locker = db.client().await;
    lock_outbox(&locker).await;
    let ids = insert_seed_events(&locker, Uuid::new_v4(), 20).await;
    // The fetch that waited for the lock was cut: the consumer reconnected.
    eventually(30, "a new drain session after the timeout", || async {
        !pids(&c, &db, "pg-outbox drain").await.is_subset(&first)
    })
    .await;
    locker.batch_execute("COMMIT").await.expect("release the lock");

    let mut seen = Vec::new();
    while seen.len() < ids.len() {
        let d = tokio::time::timeout(LIVENESS, stream.next()).await.expect("a delivery").expect("stream open");
        assert_eq!(d.retry_count, 0, "no attempt was counted as failed");
        seen.push(d.id);
        d.ack();
    }
    assert_eq!(seen, ids, "every event, once, in id order");
    eventually(30, "every event marked published", || async { published_count(&c).await == 20 }).await;
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cancels_the_relays_blocked_statement_at_the_server() {
    let db = TestDb::new("timeout_sigterm").await;
    let c = db.client().await;
    // The default timeout (60 s) is far away: only the cancel can end it.
    let mut relay = relay_proc::start(&db, &["--sink", "stdout", "--sweep-interval", "100ms"]).await;
    let locker = db.client().await;
    lock_outbox(&locker).await;
    until_one_of_ours_waits(&c, &db).await;
    relay.stop_cleanly().await;
    eventually(10, "no statement of ours left running", || async { active(&c, &db, OURS).await == 0 }).await;
    assert!(!relay.log().contains("statement timeout"), "{}", relay.log());
    locker.batch_execute("ROLLBACK").await.expect("release the lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutting_the_consumer_down_cancels_its_blocked_statement() {
    let db = TestDb::new("timeout_shutdown").await;
    let c = db.client().await;
    let stream = pg_outbox::Consumer::builder(db.options())
        .sweep_interval(Duration::from_millis(100))
        .start()
        .await
        .expect("start the consumer");
    let locker = db.client().await;
    lock_outbox(&locker).await;
    until_one_of_ours_waits(&c, &db).await;
    stream.shutdown();
    tokio::time::timeout(LIVENESS, stream.finish())
        .await
        .expect("finish returns while the lock is still held")
        .expect("finish");
    eventually(10, "no statement of ours left running", || async { active(&c, &db, OURS).await == 0 }).await;
    locker.batch_execute("ROLLBACK").await.expect("release the lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relays_blocked_statement_is_ended_by_the_servers_client_check() {
    let db = TestDb::new("timeout_kill9").await;
    let c = db.client().await;
    let version: i32 =
        c.query_one("SELECT current_setting('server_version_num')::int", &[]).await.expect("server version").get(0);
    if version < 140_000 {
        crate::needs::skip(&format!(
            "client_connection_check_interval needs PostgreSQL 14 or later (server {version})"
        ));
        return;
    }
    // No statement timeout: only the server's check for a vanished client
    // can end the statement while the lock is held.
    let mut relay =
        relay_proc::start(&db, &["--sink", "stdout", "--sweep-interval", "100ms", "--statement-timeout", "0"]).await;
    let locker = db.client().await;
    lock_outbox(&locker).await;
    until_one_of_ours_waits(&c, &db).await;
    relay.kill9().await;
    eventually(30, "the killed relay's statement ended at the server", || async { active(&c, &db, OURS).await == 0 })
        .await;
    locker.batch_execute("ROLLBACK").await.expect("release the lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timeout_in_the_urls_options_wins_over_the_consumers() {
    let db = TestDb::new("timeout_url_wins").await;
    let c = db.client().await;
    let mut pg = db.pg.clone();
    pg.options("-c statement_timeout=0");
    let stream = pg_outbox::Consumer::builder(crate::support::options_of(&pg))
        .statement_timeout(Duration::from_millis(200))
        .sweep_interval(Duration::from_millis(100))
        .start()
        .await
        .expect("start the consumer");
    eventually(30, "the drain, writer and listener sessions", || async { pids(&c, &db, OURS).await.len() == 3 }).await;
    let first = pids(&c, &db, OURS).await;
    let locker = db.client().await;
    lock_outbox(&locker).await;
    until_one_of_ours_waits(&c, &db).await;
    // Many times the consumer's 200 ms: the URL's `0` holds, so the same
    // session still waits.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(waiting_on_lock(&c, &db, OURS).await, 1, "the same statement still waits");
    assert_eq!(pids(&c, &db, OURS).await, first, "no timeout, no reconnect");
    locker.batch_execute("ROLLBACK").await.expect("release the lock");
    stream.finish().await.expect("finish");
}

/// The `statement_timeout` line of `--print-config` output.
fn printed(out: &str) -> &str {
    out.lines().find(|l| l.starts_with("statement_timeout ")).unwrap_or_else(|| panic!("no statement_timeout:\n{out}"))
}

#[tokio::test]
async fn the_statement_timeout_flag_takes_durations_and_zero_and_refuses_anything_else() {
    const NOWHERE: &str = "postgres://postgres@127.0.0.1:1/nowhere";
    let db = [("DATABASE_URL", NOWHERE)];
    let (code, out, err) = cli(&["relay", "--print-config"]).envs(&db).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(printed(&out).starts_with("statement_timeout = \"60s\"") && printed(&out).ends_with("# default"), "{out}");

    let (code, out, err) = cli(&["relay", "--statement-timeout", "5s", "--print-config"]).envs(&db).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(printed(&out).starts_with("statement_timeout = \"5s\"") && printed(&out).ends_with("# command line"));

    let (code, out, err) = cli(&["relay", "--statement-timeout", "0", "--print-config"]).envs(&db).run().await.parts();
    assert_eq!(code, Some(0), "0 disables the timeout: {err}");
    assert!(printed(&out).starts_with("statement_timeout = 0 "), "{out}");

    let env = [("DATABASE_URL", NOWHERE), ("OUTBOX_STATEMENT_TIMEOUT", "750ms")];
    let (code, out, err) = cli(&["relay", "--print-config"]).envs(&env).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(printed(&out).contains("\"750ms\"") && printed(&out).contains("OUTBOX_STATEMENT_TIMEOUT"), "{out}");

    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("relay.toml");
    std::fs::write(&file, "statement_timeout = \"2m\"\n").expect("write the config file");
    let file = file.display().to_string();
    let (code, out, err) = cli(&["relay", "--config", &file, "--print-config"]).envs(&db).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(printed(&out).starts_with("statement_timeout = \"2m\"") && printed(&out).contains("config file"));
    std::fs::write(&file, "statement_timeout = 0\n").expect("write the config file");
    let (code, out, err) = cli(&["relay", "--config", &file, "--print-config"]).envs(&db).run().await.parts();
    assert_eq!(code, Some(0), "a TOML 0 disables it too: {err}");
    assert!(printed(&out).starts_with("statement_timeout = 0 "), "{out}");

    for bad in ["abc", "-1s", "5 parsecs"] {
        let (code, out, err) = cli(&["relay", &format!("--statement-timeout={bad}")]).envs(&db).run().await.parts();
        assert!(code.is_some_and(|c| c != 0), "--statement-timeout {bad} must be refused: {err}");
        let first = err.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("error: ") && first.contains("--statement-timeout") && first.contains("invalid duration"),
            "a clear error naming the flag: {err}"
        );
        assert!(out.is_empty(), "{out}");
    }
    std::fs::write(&file, "statement_timeout = \"soon\"\n").expect("write the config file");
    let (code, _, err) = cli(&["relay", "--config", &file, "--print-config"]).envs(&db).run().await.parts();
    assert!(code.is_some_and(|c| c != 0), "a bad file value must be refused: {err}");
    assert!(err.contains("statement_timeout") && err.contains("invalid duration"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_runs_with_the_timeout_off_even_when_the_url_sets_one() {
    let db = TestDb::new("timeout_migrate").await;
    let c = db.client().await;
    // The next migrate waits in its concurrent index build (0006).
    let holder = crate::support::stall_the_next_migrate(&db, &c).await;

    let mut cfg = db.pg.clone();
    cfg.options("-c statement_timeout=100ms").application_name("timeouts migrate");
    let pg = crate::support::options_of(&cfg);
    let apply = tokio::spawn(async move { pg_outbox::migrate::apply(&pg).await });
    eventually(30, "the index build waiting for the open snapshot", || async {
        waiting_on_lock(&c, &db, "timeouts migrate").await > 0
    })
    .await;
    // Well past the session's 100 ms: still waiting, not cancelled.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!apply.is_finished(), "the build was cut: {:?}", apply.await);
    holder.batch_execute("COMMIT").await.expect("end the snapshot");
    let report = tokio::time::timeout(LIVENESS, apply).await.expect("apply ends").expect("join").expect("apply");
    assert_eq!(report.applied, vec!["0006_outbox_fresh_order_idx".to_string()]);
    let valid: bool = c
        .query_one("SELECT indisvalid FROM pg_index WHERE indexrelid = 'events.outbox_fresh_order_idx'::regclass", &[])
        .await
        .expect("index state")
        .get(0);
    assert!(valid);
}

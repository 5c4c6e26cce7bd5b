//! Through a connection pooler: Debian's PgBouncer (1.18, which keeps no
//! track of prepared statements) started on a free port in front of the
//! test database, in session and in transaction mode.
//!
//! - The publisher, through tokio-postgres and through sqlx, works through
//!   transaction mode with 32 concurrent transactions (and tokio-postgres
//!   outside a transaction too), with fewer server sessions than clients.
//! - `publish`, `status`, `dead-letters`, `archive` and `replay` work
//!   through transaction mode and leave no session state behind on the
//!   server session they borrowed (a pool of one session shows any).
//! - The relay works through session mode: two relays, one leader, every
//!   event delivered exactly once, also across a takeover.
//! - The relay (with `--no-listen` too), `migrate` and `console` refuse
//!   transaction mode at start, in one line naming the pooler and what to
//!   use instead.
//! - [`pg_outbox::ConnectOptions::session_mode`] tells the two modes apart.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use pg_outbox::{NewEvent, Publisher, SessionMode};
use serde_json::Value;
use tokio_postgres::{Client, Config, NoTls};
use uuid::Uuid;

use crate::needs;
use crate::relay_proc::{Relay, RelayProc, free_port};
use crate::support::{self, TestDb, eventually, insert_dead_letters, insert_seed_events, published_count};

/// How a PgBouncer of a test shares server sessions (`pool_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolMode {
    Session,
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A PgBouncer in front of the test server, on a free port of 127.0.0.1,
/// stopped when dropped. Clients log in with any user the server trusts
/// (`auth_type = trust`, the test server's user in the auth file); the
/// server side uses the test server's user and password.
struct Bouncer {
    child: Child,
    port: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Bouncer {
    /// Start PgBouncer in `mode` with at most `pool_size` server sessions
    /// per database and user; `None` (after a skip line) when it is not
    /// installed.
    async fn start(db: &TestDb, mode: PoolMode, pool_size: u32) -> Option<Bouncer> {
        let program = needs::program(&needs::PGBOUNCER)?;
        let dir = tempfile::tempdir().expect("a directory for PgBouncer");
        let user = db.pg.get_user().unwrap_or("postgres").to_string();
        let (host, port) = server_address(&db.pg);
        let password = db.pg.get_password().map(|p| String::from_utf8_lossy(p).into_owned());
        let server_password = password.as_deref().map(|p| format!(" password={}", quote(p))).unwrap_or_default();
        let listen = free_port();
        let users = dir.path().join("users.txt");
        std::fs::write(&users, format!("\"{user}\" \"\"\n")).expect("write the auth file");
        let ini = dir.path().join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 * = host={host} port={port}{server_password}\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {listen}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {users}\n\
                 pool_mode = {mode}\n\
                 default_pool_size = {pool_size}\n\
                 max_client_conn = 400\n\
                 server_reset_query = DISCARD ALL\n\
                 log_connections = 0\n\
                 log_disconnections = 0\n",
                users = users.display(),
                mode = mode.as_str(),
            ),
        )
        .expect("write pgbouncer.ini");
        let log = dir.path().join("pgbouncer.log");
        let log_file = std::fs::File::create(&log).expect("create PgBouncer's log");
        let mut cmd = Command::new(program);
        // PgBouncer refuses to run as root ("PgBouncer should not run as
        // root"); as root, it reads its files and then becomes `nobody`
        // (`-u`), so they must be readable by all.
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            use std::os::unix::fs::PermissionsExt;
            for (path, mode) in [(dir.path(), 0o755), (ini.as_path(), 0o644), (users.as_path(), 0o644)] {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            }
            cmd.args(["-u", "nobody"]);
        }
        cmd.arg(&ini).stdin(Stdio::null()).stdout(log_file.try_clone().expect("log")).stderr(log_file);
        let mut child = cmd.spawn().expect("start pgbouncer");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", listen)).await.is_ok() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("pgbouncer exited ({status}): {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            assert!(tokio::time::Instant::now() < deadline, "pgbouncer is not listening on {listen} after 10 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Some(Bouncer { child, port: listen, log, _dir: dir })
    }

    /// The test database through the pooler, as a URL for the binary.
    fn url(&self, db: &TestDb) -> String {
        let user = db.pg.get_user().unwrap_or("postgres");
        format!("postgres://{user}@127.0.0.1:{}/{}?sslmode=disable", self.port, db.name)
    }

    /// The test database through the pooler, as an application's plain
    /// tokio-postgres settings (no startup options).
    fn config(&self, db: &TestDb) -> Config {
        let mut cfg = Config::new();
        cfg.host("127.0.0.1").port(self.port).user(db.pg.get_user().unwrap_or("postgres")).dbname(&db.name);
        cfg
    }

    /// pg-outbox's connection options for the test database through the pooler.
    fn options(&self, db: &TestDb) -> pg_outbox::ConnectOptions {
        pg_outbox::ConnectOptions::parse(&self.url(db)).expect("pooler URL")
    }

    async fn client(&self, db: &TestDb) -> Client {
        let (client, conn) = self.config(db).connect(NoTls).await.expect("connect through pgbouncer");
        tokio::spawn(conn);
        client
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("pgbouncer's log (the end):\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
    }
}

/// Where the test server listens: a host name or address, or a socket
/// directory, and the port.
fn server_address(cfg: &Config) -> (String, u16) {
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "127.0.0.1".into(),
    };
    (host, cfg.get_ports().first().copied().unwrap_or(5432))
}

/// Retention's advisory lock key (docs/architecture.md, "Advisory lock keys").
const RETENTION_KEY: i64 = 0x7067_6f75_7400_0002;

/// A value of a libpq connection string, quoted.
fn quote(v: &str) -> String {
    format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))
}

async fn count(c: &Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get(0)
}

fn event(agg: Uuid, name: &str, n: usize) -> NewEvent {
    NewEvent::new("subscription", agg, name, serde_json::json!({"n": n}))
}

/// What the pooler's server sessions carry after a test's clients left
/// them: the settings a client could have leaked, read through the pooler
/// (whose pool of one hands every client the same server session), and
/// the advisory locks held on the database (read directly).
async fn assert_no_session_state_left(bouncer: &Bouncer, db: &TestDb) {
    let c = bouncer.client(db).await;
    for (setting, want) in
        [("default_transaction_read_only", "off"), ("enable_sort", "on"), ("statement_timeout", "0"), ("jit", "on")]
    {
        let got: String = c
            .query_one("SELECT current_setting($1)", &[&setting])
            .await
            .unwrap_or_else(|e| panic!("read {setting} through the pooler: {e}"))
            .get(0);
        assert_eq!(got, want, "{setting} was left changed on a pooled server session");
    }
    let direct = db.client().await;
    let locks: i64 = direct
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .expect("count advisory locks")
        .get(0);
    assert_eq!(locks, 0, "an advisory lock was left on a pooled server session");
}

// ---------------------------------------------------------------- the library's check

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_tells_a_transaction_pooler_from_a_session() {
    let db = TestDb::new("pool_detect").await;
    let Some(session) = Bouncer::start(&db, PoolMode::Session, 4).await else { return };
    let Some(transaction) = Bouncer::start(&db, PoolMode::Transaction, 4).await else { return };
    let Some(single) = Bouncer::start(&db, PoolMode::Transaction, 1).await else { return };
    assert_eq!(db.options().session_mode().await.expect("direct"), SessionMode::Kept);
    assert_eq!(session.options(&db).session_mode().await.expect("session mode"), SessionMode::Kept);
    for (what, b) in [("transaction mode", &transaction), ("transaction mode, one server session", &single)] {
        for round in 0..5 {
            let mode = b.options(&db).session_mode().await.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(matches!(mode, SessionMode::Shared { .. }), "{what}, round {round}: {mode:?}");
        }
    }
}

// ---------------------------------------------------------------- the publisher

/// 32 clients through transaction mode, 4 server sessions: each runs
/// rounds of a transaction with `publish` and `publish_many`, and a
/// `publish` outside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_through_a_transaction_pooler_with_32_concurrent_transactions() {
    const CLIENTS: usize = 32;
    const ROUNDS: usize = 5;
    let db = TestDb::new("pool_publish").await;
    let Some(bouncer) = Bouncer::start(&db, PoolMode::Transaction, 4).await else { return };
    let mut tasks = Vec::new();
    for n in 0..CLIENTS {
        let cfg = bouncer.config(&db);
        tasks.push(tokio::spawn(async move {
            let (mut client, conn) = cfg.connect(NoTls).await.map_err(|e| format!("connect: {e}"))?;
            tokio::spawn(conn);
            let p = Publisher::new();
            let agg = Uuid::new_v4();
            for round in 0..ROUNDS {
                let tx = client.transaction().await.map_err(|e| format!("begin: {e}"))?;
                p.publish(&tx, &event(agg, "One", round)).await.map_err(|e| format!("publish in {n}: {e:?}"))?;
                let many: Vec<NewEvent> = (0..3).map(|i| event(agg, "Many", round * 10 + i)).collect();
                let ids = p.publish_many(&tx, &many).await.map_err(|e| format!("publish_many in {n}: {e:?}"))?;
                if ids.len() != 3 {
                    return Err(format!("publish_many returned {ids:?}"));
                }
                tx.commit().await.map_err(|e| format!("commit: {e}"))?;
                p.publish(&client, &event(agg, "Alone", round))
                    .await
                    .map_err(|e| format!("publish outside a transaction in {n}: {e:?}"))?;
            }
            Ok::<_, String>(())
        }));
    }
    let mut errors = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.expect("publisher task") {
            errors.push(e);
        }
    }
    assert!(errors.is_empty(), "{} of {CLIENTS} clients failed: {errors:#?}", errors.len());
    let c = db.client().await;
    assert_eq!(count(&c, "SELECT count(*) FROM events.outbox").await, (CLIENTS * ROUNDS * 5) as i64);
    let ids = count(&c, "SELECT count(DISTINCT (payload->>'n', event_type, aggregate_id)) FROM events.outbox").await;
    assert_eq!(ids, (CLIENTS * ROUNDS * 5) as i64, "every event is there once");
}

/// 32 sqlx transactions at once through transaction mode, 4 server
/// sessions, each pooled connection reused for several transactions.
#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_publisher_through_a_transaction_pooler_with_32_concurrent_transactions() {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    const CLIENTS: usize = 32;
    const ROUNDS: usize = 5;
    let db = TestDb::new("pool_sqlx").await;
    let Some(bouncer) = Bouncer::start(&db, PoolMode::Transaction, 4).await else { return };
    // sqlx sends `extra_float_digits` at startup unless told not to; PgBouncer
    // refuses it unless `ignore_startup_parameters` names it.
    let opts = PgConnectOptions::new_without_pgpass()
        .host("127.0.0.1")
        .port(bouncer.port)
        .username(db.pg.get_user().unwrap_or("postgres"))
        .database(&db.name)
        .extra_float_digits(None);
    let pool = PgPoolOptions::new().max_connections(CLIENTS as u32).connect_with(opts).await.expect("sqlx pool");
    let mut tasks = Vec::new();
    for n in 0..CLIENTS {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let p = Publisher::new();
            let agg = Uuid::new_v4();
            for round in 0..ROUNDS {
                let mut tx = pool.begin().await.map_err(|e| format!("begin: {e}"))?;
                p.publish_sqlx(&mut *tx, &event(agg, "One", round))
                    .await
                    .map_err(|e| format!("publish_sqlx in {n}: {e:?}"))?;
                let many: Vec<NewEvent> = (0..3).map(|i| event(agg, "Many", round * 10 + i)).collect();
                p.publish_many_sqlx(&mut *tx, &many).await.map_err(|e| format!("publish_many_sqlx in {n}: {e:?}"))?;
                tx.commit().await.map_err(|e| format!("commit: {e}"))?;
            }
            Ok::<_, String>(())
        }));
    }
    let mut errors = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.expect("publisher task") {
            errors.push(e);
        }
    }
    pool.close().await;
    assert!(errors.is_empty(), "{} of {CLIENTS} clients failed: {errors:#?}", errors.len());
    let c = db.client().await;
    assert_eq!(count(&c, "SELECT count(*) FROM events.outbox").await, (CLIENTS * ROUNDS * 4) as i64);
}

// ---------------------------------------------------------------- the command line

/// `publish`, `status`, `dead-letters`, `archive` and `replay` through
/// transaction mode with one server session, which every command borrows
/// in turn: each works, and none leaves a setting or a lock on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_commands_work_through_a_transaction_pooler_and_leave_no_session_state() {
    let db = TestDb::new("pool_cli").await;
    let Some(bouncer) = Bouncer::start(&db, PoolMode::Transaction, 1).await else { return };
    let url = bouncer.url(&db);
    let c = db.client().await;
    let run = |args: Vec<String>| {
        let url = url.clone();
        async move {
            let out = support::cli(&args).url(&url).run().await;
            assert!(out.ok(), "pg-outbox {args:?} through transaction mode: {out:?}");
            out.stdout
        }
    };
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    // publish
    let agg = Uuid::new_v4().to_string();
    let published = run(args(&[
        "publish",
        "--aggregate-type",
        "subscription",
        "--aggregate-id",
        &agg,
        "--event-type",
        "PaymentSucceeded",
        "--payload",
        r#"{"version":1,"data":{"amount":990}}"#,
    ]))
    .await;
    let id: i64 = published.trim().parse().unwrap_or_else(|_| panic!("publish printed {published:?}"));
    assert_eq!(count(&c, &format!("SELECT count(*) FROM events.outbox WHERE id = {id}")).await, 1);

    // status
    insert_dead_letters(&c, 3).await;
    let status: Value = serde_json::from_str(&run(args(&["status", "--json"])).await).expect("status JSON");
    assert_eq!(status["unpublished"], 4, "{status}");
    assert_eq!(status["dead_letters"], 3, "{status}");

    // dead-letters: list, show, retry, discard
    let list: Value =
        serde_json::from_str(&run(args(&["dead-letters", "list", "--json"])).await).expect("dead-letters JSON");
    let dead: Vec<i64> = list.as_array().expect("a list").iter().map(|d| d["id"].as_i64().expect("id")).collect();
    assert_eq!(dead.len(), 3, "{list}");
    let shown = run(args(&["dead-letters", "show", &dead[0].to_string()])).await;
    assert!(shown.contains("HTTP 500"), "{shown}");
    run(args(&["dead-letters", "retry", &dead[0].to_string()])).await;
    run(args(&["dead-letters", "discard", &dead[1].to_string(), "--yes"])).await;
    let dead_now = count(&c, "SELECT count(*) FROM events.outbox WHERE next_retry_at = 'infinity'").await;
    assert_eq!(dead_now, 1, "one retried, one discarded");

    // archive: published rows older than a day go, in batches of 2.
    let agg2 = Uuid::new_v4();
    insert_seed_events(&c, agg2, 5).await;
    c.batch_execute(&format!(
        "UPDATE events.outbox SET published_at = now() - interval '2 days' WHERE aggregate_id = '{agg2}'"
    ))
    .await
    .expect("age the seed events");
    let dry = run(args(&["archive", "--older-than", "1d", "--dry-run"])).await;
    assert!(dry.contains("would delete 5 "), "dry run: {dry}");
    // A run elsewhere holds the retention lock (a session of its own): the
    // archive through transaction mode, whose batches take the same lock
    // for their transaction, finds it and deletes nothing.
    let holder = db.client().await;
    holder.execute("SELECT pg_advisory_lock($1)", &[&RETENTION_KEY]).await.expect("hold the retention lock");
    let out = support::cli(&["archive", "--older-than", "1d"]).url(&url).run().await;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("another retention run holds the lock"), "{}", out.stderr);
    holder.execute("SELECT pg_advisory_unlock($1)", &[&RETENTION_KEY]).await.expect("release the retention lock");
    run(args(&["archive", "--older-than", "1d", "--batch-size", "2", "--pause", "10ms"])).await;
    assert_eq!(count(&c, &format!("SELECT count(*) FROM events.outbox WHERE aggregate_id = '{agg2}'")).await, 0);

    // replay: published events to stdout, unchanged rows.
    insert_seed_events(&c, agg2, 4).await;
    c.batch_execute(&format!("UPDATE events.outbox SET published_at = now() WHERE aggregate_id = '{agg2}'"))
        .await
        .expect("publish the seed events");
    let before = count(&c, "SELECT sum(xmin::text::bigint)::bigint FROM events.outbox").await;
    let replayed = run(args(&["replay", "--sink", "stdout", "--batch-size", "2"])).await;
    assert_eq!(replayed.lines().count(), 4, "{replayed}");
    assert_eq!(
        count(&c, "SELECT sum(xmin::text::bigint)::bigint FROM events.outbox").await,
        before,
        "replay wrote nothing"
    );

    assert_no_session_state_left(&bouncer, &db).await;
}

// ---------------------------------------------------------------- the relay

/// A test webhook that records the outbox ids it receives, as one relay's.
#[derive(Clone, Default)]
struct Hook {
    ids: Arc<Mutex<Vec<i64>>>,
}

async fn hook_handler(State(hook): State<Hook>, body: Bytes) -> StatusCode {
    let Ok(v) = serde_json::from_slice::<Value>(&body) else { return StatusCode::BAD_REQUEST };
    let Some(id) = v["id"].as_i64() else { return StatusCode::BAD_REQUEST };
    hook.ids.lock().unwrap_or_else(PoisonError::into_inner).push(id);
    StatusCode::OK
}

async fn start_hook() -> (Hook, String) {
    let hook = Hook::default();
    let app = axum::Router::new().route("/hook", axum::routing::post(hook_handler)).with_state(hook.clone());
    (hook.clone(), support::serve_hook(app).await)
}

impl Hook {
    fn ids(&self) -> Vec<i64> {
        self.ids.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// Publish `n` events through the pooler, in transactions of five.
async fn publish_through(bouncer: &Bouncer, db: &TestDb, n: usize) -> Vec<i64> {
    let mut client = bouncer.client(db).await;
    let p = Publisher::new();
    let mut ids = Vec::new();
    for chunk in 0..n.div_ceil(5) {
        let tx = client.transaction().await.expect("begin");
        let agg = Uuid::new_v4();
        let events: Vec<NewEvent> = (0..5.min(n - chunk * 5)).map(|i| event(agg, "Relayed", chunk * 5 + i)).collect();
        ids.extend(p.publish_many(&tx, &events).await.expect("publish through the pooler"));
        tx.commit().await.expect("commit");
    }
    ids
}

/// Two relays through session mode: one leads, the other waits; every
/// event is delivered exactly once, before and after the leader stops and
/// the standby takes over (the leader's lock goes with its session, which
/// PgBouncer resets with `DISCARD ALL` when the client leaves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_through_a_session_pooler_one_leader_every_event_exactly_once() {
    let db = TestDb::new("pool_relays").await;
    let Some(bouncer) = Bouncer::start(&db, PoolMode::Session, 10).await else { return };
    let url = bouncer.url(&db);
    let (hook_a, url_a) = start_hook().await;
    let (hook_b, url_b) = start_hook().await;
    let start = |hook: String| {
        Relay::new(support::bin()).url(&url).args(&["--sink", hook.as_str(), "--sweep-interval", "200ms"]).start()
    };
    let mut a = start(url_a).await.expect("relay a through session mode");
    a.wait_for_signal(&["leader", "standby"]).await;
    let mut b = start(url_b).await.expect("relay b through session mode");
    let mut ids = publish_through(&bouncer, &db, 100).await;
    let c = db.client().await;
    eventually(30, "the first 100 events published", || async { published_count(&c).await == 100 }).await;
    assert_eq!(hook_b.ids().len(), 0, "the standby delivered while the leader ran: {:?}", hook_b.ids());
    assert!(a.log().contains("notifications work"), "the leader listens through session mode:\n{}", a.log());

    // The leader stops; the standby takes the lock through the pooler.
    a.stop_cleanly().await;
    b.wait_for_signal(&["leader"]).await;
    ids.extend(publish_through(&bouncer, &db, 100).await);
    eventually(30, "all 200 events published", || async { published_count(&c).await == 200 }).await;
    b.stop_cleanly().await;

    let mut delivered: BTreeMap<i64, usize> = BTreeMap::new();
    for id in hook_a.ids().into_iter().chain(hook_b.ids()) {
        *delivered.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = delivered.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    ids.sort_unstable();
    assert_eq!(delivered.keys().copied().collect::<Vec<_>>(), ids, "every event delivered");
    assert!(!hook_b.ids().is_empty(), "the standby delivered after the takeover");
}

/// A relay pointed at transaction mode stops at start with one line that
/// names the pooler and the kind of URL to use; with `--no-listen` too
/// (its leader lock is a session's, which transaction mode would strand);
/// `migrate` and `console` likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_migrate_and_console_refuse_a_transaction_pooler_in_one_line() {
    let db = TestDb::new("pool_refuse").await;
    let Some(bouncer) = Bouncer::start(&db, PoolMode::Transaction, 4).await else { return };
    let url = bouncer.url(&db);
    let pooler = format!("127.0.0.1:{}", bouncer.port);
    for extra in [&[][..], &["--no-listen"][..]] {
        let mut relay: RelayProc =
            Relay::new(support::bin()).url(&url).args(&["--sink", "stdout"]).args(extra).spawn().expect("spawn");
        let status = relay.wait().await;
        assert_eq!(status.code(), Some(1), "relay {extra:?} through transaction mode:\n{}", relay.log());
        let log = relay.log();
        let error: Vec<&str> = log.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(error.len(), 1, "one error line:\n{log}");
        for needed in ["transaction-mode pooler", pooler.as_str(), "direct", "session-mode"] {
            assert!(error[0].contains(needed), "the error names {needed:?}: {}", error[0]);
        }
        assert!(!relay.signalled(pg_outbox_testkit::process::STARTED), "{log}");
    }
    for args in [vec!["migrate".to_string()], vec!["console".into(), "--addr".into(), free_port().to_string()]] {
        let out = support::cli(&args).url(&url).run().await;
        assert_eq!(out.code, Some(1), "{args:?}: {out:?}");
        assert!(out.stderr.contains("transaction-mode pooler") && out.stderr.contains(&pooler), "{}", out.stderr);
        assert_eq!(out.stderr.lines().filter(|l| l.starts_with("error:")).count(), 1, "{}", out.stderr);
    }
    // The same through session mode works.
    let Some(session) = Bouncer::start(&db, PoolMode::Session, 4).await else { return };
    let out = support::cli(&["migrate"]).url(&session.url(&db)).run().await;
    assert!(out.ok(), "migrate through session mode: {out:?}");
}

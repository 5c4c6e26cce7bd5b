//! Test harness: a real PostgreSQL, one database per test.
//!
//! Server: `DATABASE_URL` when set; otherwise a server on 127.0.0.1:5432 or
//! the local socket if one answers; otherwise a throwaway server started from
//! the local binaries (stopped when the test process exits). Each test gets
//! its own database (NOTIFY is per database) cloned from a template migrated
//! once per process, so tests run in parallel. A test's database is dropped
//! when the test passes and kept (its name printed) when it fails.

#![allow(dead_code)]

use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::temp_server::TempServer;
use tokio_postgres::{Client, NoTls};

static SERVER: OnceLock<Mutex<Option<TempServer>>> = OnceLock::new();
static SETUP: tokio::sync::OnceCell<Setup> = tokio::sync::OnceCell::const_new();
static COUNTER: AtomicU32 = AtomicU32::new(0);

#[derive(Debug, Clone)]
struct Setup {
    /// Admin URL without a database name part we rely on: we swap dbname.
    admin: tokio_postgres::Config,
    template: String,
}

extern "C" fn cleanup_at_exit() {
    if let Some(setup) = SETUP.get() {
        let admin = setup.admin.clone();
        let template = setup.template.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async move {
                let (c, conn) = admin.connect(NoTls).await.ok()?;
                tokio::spawn(conn);
                c.batch_execute(&format!("DROP DATABASE IF EXISTS {template} WITH (FORCE)")).await.ok()
            })
        })
        .join();
    }
    if let Some(m) = SERVER.get()
        && let Ok(mut g) = m.lock()
    {
        drop(g.take());
    }
}

async fn try_connect(cfg: &tokio_postgres::Config) -> bool {
    let mut cfg = cfg.clone();
    cfg.connect_timeout(Duration::from_secs(3));
    match cfg.connect(NoTls).await {
        Ok((c, conn)) => {
            tokio::spawn(conn);
            c.simple_query("SELECT 1").await.is_ok()
        }
        Err(_) => false,
    }
}

async fn find_server() -> tokio_postgres::Config {
    // PG_OUTBOX_TEST_SERVER=throwaway skips the lookups (to exercise the
    // fresh-machine path where no server runs).
    let forced = std::env::var("PG_OUTBOX_TEST_SERVER").is_ok_and(|v| v == "throwaway");
    if forced {
        return start_throwaway().await;
    }
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.trim().is_empty()
    {
        return pg_outbox::ConnectOptions::parse(&url).expect("DATABASE_URL does not parse").tokio_postgres_config();
    }
    for candidate in
        ["postgres://postgres@127.0.0.1:5432/postgres", "host=/var/run/postgresql user=postgres dbname=postgres"]
    {
        let cfg = pg_outbox::ConnectOptions::parse(candidate).expect("candidate URL").tokio_postgres_config();
        if try_connect(&cfg).await {
            return cfg;
        }
    }
    start_throwaway().await
}

async fn start_throwaway() -> tokio_postgres::Config {
    let server = tokio::task::spawn_blocking(TempServer::start)
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("no PostgreSQL to test against: {}", pg_outbox::error::report(&e)));
    let url = server.url();
    SERVER.get_or_init(|| Mutex::new(None)).lock().expect("lock").replace(server);
    pg_outbox::ConnectOptions::parse(&url).expect("temp server URL").tokio_postgres_config()
}

async fn setup() -> &'static Setup {
    SETUP
        .get_or_init(|| async {
            let admin = find_server().await;
            let template = format!("pgo_it_tmpl_{}", std::process::id());
            let (c, conn) = admin.connect(NoTls).await.expect("connect admin");
            tokio::spawn(conn);
            c.batch_execute(&format!("DROP DATABASE IF EXISTS {template} WITH (FORCE)")).await.expect("drop template");
            c.batch_execute(&format!("CREATE DATABASE {template}")).await.expect("create template");
            let mut tcfg = admin.clone();
            tcfg.dbname(&template);
            {
                let pg = options_of(&tcfg);
                pg_outbox::migrate::apply(&pg).await.expect("migrate template");
            }
            // SAFETY: registering a plain extern "C" fn with atexit(3).
            unsafe {
                libc::atexit(cleanup_at_exit);
            }
            // The skips' summary (or the removal of an earlier run's list).
            crate::needs::report_at_exit();
            Setup { admin, template }
        })
        .await
}

/// A database of its own for one test.
pub struct TestDb {
    pub name: String,
    pub pg: tokio_postgres::Config,
    admin: tokio_postgres::Config,
}

impl TestDb {
    /// Create a migrated database for the test `tag`.
    pub async fn new(tag: &str) -> TestDb {
        let s = setup().await;
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let clean: String =
            tag.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
        let mut name = format!("pgo_it_{}_{}_{}", std::process::id(), n, clean);
        name.truncate(63);
        let (c, conn) = s.admin.connect(NoTls).await.expect("connect admin");
        tokio::spawn(conn);
        // CREATE DATABASE ... TEMPLATE fails if another session is copying
        // the template at the same instant; retry briefly.
        let mut tries = 0;
        loop {
            match c.batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {}", s.template)).await {
                Ok(()) => break,
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("create test database {name}: {e}"),
            }
        }
        let mut pg = s.admin.clone();
        pg.dbname(&name);
        TestDb { name, pg, admin: s.admin.clone() }
    }

    /// A new plain connection to this test's database.
    pub async fn client(&self) -> Client {
        let (c, conn) = self.pg.connect(NoTls).await.expect("connect test db");
        tokio::spawn(conn);
        c
    }

    /// This database's URL (for child processes).
    pub fn url(&self) -> String {
        let host = match self.pg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "127.0.0.1".into(),
        };
        let port = self.pg.get_ports().first().copied().unwrap_or(5432);
        let user = self.pg.get_user().unwrap_or("postgres");
        if host.starts_with('/') {
            format!("host={host} port={port} user={user} dbname={}", self.name)
        } else {
            format!("postgres://{user}@{host}:{port}/{}", self.name)
        }
    }

    /// Terminate the backends of this database whose application_name is `app`.
    pub async fn terminate(&self, app: &str) -> i64 {
        let c = self.client().await;
        let row = c
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
                &[&self.name, &app],
            )
            .await
            .expect("terminate");
        row.get(0)
    }
}

impl TestDb {
    /// Terminate the backend holding the single-mode outbox lock.
    pub async fn terminate_pid_of_lock_holder(&self) -> i64 {
        let c = self.client().await;
        c.query_one(
            "SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND a.datname = $1 AND a.application_name = 'pg-outbox drain' \
               AND l.objsubid = 1",
            &[&self.name],
        )
        .await
        .expect("terminate lock holder")
        .get(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test failed: keeping database {} for inspection", self.name);
            return;
        }
        let admin = self.admin.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async move {
                let (c, conn) = admin.connect(NoTls).await.ok()?;
                tokio::spawn(conn);
                c.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await.ok()
            })
        })
        .join();
    }
}

/// Insert `n` events for `aggregate` as a producer that knows only the seed
/// would, in one transaction; returns their ids.
pub async fn insert_seed_events(c: &Client, aggregate: uuid::Uuid, n: i64) -> Vec<i64> {
    c.query(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'subscription', $1, 'PaymentSucceeded', jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g)) \
         FROM generate_series(1, $2::bigint) g RETURNING id",
        &[&aggregate, &n],
    )
    .await
    .expect("insert")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Insert `n` dead letters as the relay leaves them (10 failures,
/// `next_retry_at = 'infinity'`, last error `HTTP 500`), type `Dead`.
pub async fn insert_dead_letters(c: &Client, n: i64) {
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
         SELECT 'subscription', gen_random_uuid(), 'Dead', '{}', 10, 'infinity', 'HTTP 500' FROM generate_series(1, $1::bigint)",
        &[&n],
    )
    .await
    .expect("insert dead letters");
}

/// Serve `app` on 127.0.0.1 on a free port, on a task of its own; returns
/// the URL of its `/hook` route (the test webhooks' path).
pub async fn serve_hook(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the test webhook");
    let addr = listener.local_addr().expect("test webhook address");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("test webhook stopped: {e}");
        }
    });
    format!("http://{addr}/hook")
}

/// Make migration 0006 (a concurrent index build) run again at the next
/// migrate, and hold a snapshot open in the database so that the build
/// waits for it (PostgreSQL docs, "Building Indexes Concurrently"). Returns
/// the session holding the snapshot: `COMMIT` on it lets the build finish.
pub async fn stall_the_next_migrate(db: &TestDb, c: &Client) -> Client {
    c.batch_execute(
        "DROP INDEX events.outbox_fresh_order_idx; \
         DELETE FROM events.outbox_schema_migrations WHERE name = '0006_outbox_fresh_order_idx'",
    )
    .await
    .expect("undo 0006");
    let holder = db.client().await;
    holder.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1").await.expect("take a snapshot");
    holder
}

/// Wait for a condition, polling every 20 ms, failing after `secs` seconds
/// (a liveness bound, not a speed assertion).
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if f().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {secs}s waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Path of the built `pg-outbox` binary.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_pg-outbox")
}

/// Rows of `events.outbox` with `published_at` set.
pub async fn published_count(c: &Client) -> i64 {
    c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[])
        .await
        .expect("count published rows")
        .get(0)
}

/// What a finished `pg-outbox` run left behind.
#[derive(Debug)]
pub struct Out {
    pub status: std::process::ExitStatus,
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    /// Exit code 0.
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// `(exit code, stdout, stderr)`.
    pub fn parts(self) -> (Option<i32>, String, String) {
        (self.code, self.stdout, self.stderr)
    }
}

/// A run of the built `pg-outbox` binary, the one way every test runs the
/// command line: a [clean environment](crate::process::clean_env) (no
/// inherited `DATABASE_URL`, `RUST_LOG` or `OUTBOX_*`), standard input empty
/// unless given, both outputs captured, and a liveness bound of 30 s.
pub struct Cli {
    cmd: tokio::process::Command,
    args: Vec<String>,
    stdin: Option<Vec<u8>>,
    closed_stdout: bool,
}

/// `pg-outbox args...` (run it with [`Cli::run`]).
pub fn cli<S: AsRef<str>>(args: &[S]) -> Cli {
    let args: Vec<String> = args.iter().map(|a| a.as_ref().to_string()).collect();
    let mut cmd = tokio::process::Command::new(bin());
    cmd.args(&args);
    crate::process::clean_env(&mut cmd);
    Cli { cmd, args, stdin: None, closed_stdout: false }
}

impl Cli {
    /// `DATABASE_URL=url`.
    pub fn url(mut self, url: &str) -> Cli {
        self.cmd.env("DATABASE_URL", url);
        self
    }

    /// One environment variable more.
    pub fn env(mut self, key: &str, value: &str) -> Cli {
        self.cmd.env(key, value);
        self
    }

    /// Environment variables more.
    pub fn envs(mut self, vars: &[(&str, &str)]) -> Cli {
        self.cmd.envs(vars.iter().copied());
        self
    }

    /// These bytes on standard input.
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Cli {
        self.stdin = Some(bytes.into());
        self
    }

    /// Standard output closed before the command writes (as
    /// `pg-outbox ... | head -1` leaves it once head is done).
    pub fn closed_stdout(mut self) -> Cli {
        self.closed_stdout = true;
        self
    }

    /// Run it to its exit.
    pub async fn run(mut self) -> Out {
        let stdin = if self.stdin.is_some() { Stdio::piped() } else { Stdio::null() };
        self.cmd.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let args = self.args;
        let mut child = self.cmd.spawn().unwrap_or_else(|e| panic!("cannot run {}: {e}", bin()));
        if self.closed_stdout {
            drop(child.stdout.take());
        }
        let input = self.stdin;
        let mut pipe = child.stdin.take();
        let feed = async move {
            if let (Some(bytes), Some(pipe)) = (input, pipe.as_mut()) {
                // A command that stops reading early closes the pipe: not an error here.
                let _ = tokio::io::AsyncWriteExt::write_all(pipe, &bytes).await;
            }
            drop(pipe);
        };
        let (_, out) =
            tokio::time::timeout(Duration::from_secs(30), async { tokio::join!(feed, child.wait_with_output()) })
                .await
                .unwrap_or_else(|_| panic!("pg-outbox {args:?} did not exit within 30 s"));
        let out = out.unwrap_or_else(|e| panic!("wait for pg-outbox {args:?}: {e}"));
        Out {
            status: out.status,
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl TestDb {
    /// `pg-outbox args...` on this database.
    pub fn cli<S: AsRef<str>>(&self, args: &[S]) -> Cli {
        cli(args).url(&self.url())
    }
}

pub use crate::options::options_of;

impl TestDb {
    /// This database's connection options (see [`options_of`]).
    pub fn options(&self) -> pg_outbox::ConnectOptions {
        options_of(&self.pg)
    }
}

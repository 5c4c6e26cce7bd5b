//! Test harness: what the tests share beyond the kit.
//!
//! The server and each test's database come from the kit
//! ([`pg_outbox_testkit::db`], re-exported here: [`TestDb`]): on
//! `DATABASE_URL`, a local server, or a throwaway one. Here: the one way
//! the tests run the command line ([`cli`], [`DbCli::cli`]), seeding
//! helpers, a test webhook, and polling.

use std::process::Stdio;
use std::time::Duration;

pub use pg_outbox_testkit::{TestDb, options_of};
use tokio_postgres::Client;

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

/// The server's `server_version_num` (e.g. 180004).
pub async fn server_version_num(c: &Client) -> i32 {
    c.query_one("SELECT current_setting('server_version_num')::int4", &[])
        .await
        .expect("read server_version_num")
        .get(0)
}

/// A session to `db` opened as pg-outbox opens its own (its planner
/// settings included), for checking the plans its statements get.
pub async fn plan_check_session(db: &TestDb) -> Client {
    pg_outbox::ConnectOptions::parse(&db.url())
        .expect("url")
        .with_application_name("pg-outbox plan check")
        .connect()
        .await
        .expect("connect as pg-outbox does")
}

/// A count of an `EXPLAIN (FORMAT JSON)` plan node (`Actual Rows`,
/// `Rows Removed by Filter`, `Shared Hit Blocks`, ...), 0 when absent.
/// PostgreSQL 18 prints row counts, which are averages over the node's
/// loops, with two decimals (`10.00`); earlier versions print integers.
/// Either is rounded to the nearest integer here.
pub fn plan_count(node: &serde_json::Value, key: &str) -> i64 {
    plan_number(node, key).round() as i64
}

/// A number of an `EXPLAIN (FORMAT JSON)` plan node as it is printed (see
/// [`plan_count`]), 0 when absent.
pub fn plan_number(node: &serde_json::Value, key: &str) -> f64 {
    let value = &node[key];
    value.as_f64().unwrap_or_else(|| {
        assert!(value.is_null(), "the plan's {key:?} is not a number: {value}");
        0.0
    })
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
/// command line: a [clean environment](pg_outbox_testkit::process::clean_env) (no
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
    pg_outbox_testkit::process::clean_env(&mut cmd);
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

/// The command line on a test's database: `db.cli(&["status"])`.
pub trait DbCli {
    /// `pg-outbox args...` with `DATABASE_URL` this database's URL.
    fn cli<S: AsRef<str>>(&self, args: &[S]) -> Cli;
}

impl DbCli for TestDb {
    fn cli<S: AsRef<str>>(&self, args: &[S]) -> Cli {
        cli(args).url(&self.url())
    }
}

// ------------------------------------------------------------ a proxy

/// A TCP proxy to the test database that can stop forwarding: while frozen
/// it keeps every connection open and reads nothing and writes nothing, as
/// a hung middlebox (or a silent network cut) does. A client waiting for a
/// reply then waits: the server's statement timeout fires, but its error
/// never arrives. [`Proxy::cut`] closes every connection it carries.
pub struct Proxy {
    pub port: u16,
    frozen: tokio::sync::watch::Sender<bool>,
    cuts: tokio::sync::watch::Sender<u64>,
}

/// Where a [`Proxy`] forwards to.
pub enum Target {
    Tcp(String),
    Unix(std::path::PathBuf),
}

impl Target {
    /// The server of `db`.
    pub fn of(db: &TestDb) -> Target {
        Target::of_config(&db.pg)
    }

    /// The (first) server of `pg`.
    pub fn of_config(pg: &tokio_postgres::Config) -> Target {
        let host = pg.get_hosts().first().cloned();
        let db_port = pg.get_ports().first().copied().unwrap_or(5432);
        match host {
            Some(tokio_postgres::config::Host::Unix(dir)) => Target::Unix(dir.join(format!(".s.PGSQL.{db_port}"))),
            Some(tokio_postgres::config::Host::Tcp(h)) => Target::Tcp(format!("{h}:{db_port}")),
            None => Target::Tcp(format!("127.0.0.1:{db_port}")),
        }
    }
}

impl Proxy {
    pub async fn start(target: Target) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let port = listener.local_addr().expect("address").port();
        let (frozen, _) = tokio::sync::watch::channel(false);
        let (cuts, _) = tokio::sync::watch::channel(0u64);
        let frozen_rx = frozen.subscribe();
        let cuts_rx = cuts.subscribe();
        let target = std::sync::Arc::new(target);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                let frozen = frozen_rx.clone();
                let mut cut = cuts_rx.clone();
                cut.mark_unchanged();
                tokio::spawn(async move {
                    let (cr, cw) = client.into_split();
                    let carry = async {
                        match &*target {
                            Target::Tcp(addr) => {
                                let Ok(server) = tokio::net::TcpStream::connect(addr).await else { return };
                                let (sr, sw) = server.into_split();
                                tokio::join!(pump(cr, sw, frozen.clone()), pump(sr, cw, frozen));
                            }
                            Target::Unix(path) => {
                                let Ok(server) = tokio::net::UnixStream::connect(path).await else { return };
                                let (sr, sw) = server.into_split();
                                tokio::join!(pump(cr, sw, frozen.clone()), pump(sr, cw, frozen));
                            }
                        }
                    };
                    // A cut drops both sockets: each side sees its
                    // connection closed. The cut is looked at first: a cut
                    // then a thaw (`cut(); freeze(false)`) must not let
                    // what was held while frozen through.
                    tokio::select! {
                        biased;
                        _ = cut.changed() => {}
                        _ = carry => {}
                    }
                });
            }
        });
        Proxy { port, frozen, cuts }
    }

    /// Stop (or resume) forwarding, keeping every connection open.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }

    /// Close every connection carried now (later ones are carried).
    pub fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }

    /// A URL of `db` through this proxy.
    pub fn url(&self, db: &TestDb) -> String {
        let user = db.pg.get_user().unwrap_or("postgres").to_string();
        format!("postgres://{user}@127.0.0.1:{}/{}?connect_timeout=1", self.port, db.name)
    }
}

/// Copy `from` to `to`, holding what was read while frozen.
async fn pump(
    mut from: impl tokio::io::AsyncRead + Unpin,
    mut to: impl tokio::io::AsyncWrite + Unpin,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

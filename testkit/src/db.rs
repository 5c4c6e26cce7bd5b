//! Databases of a test's own, and the benchmarks' scratch databases.
//!
//! [`TestDb::new`] gives each test a database of its own (NOTIFY is per
//! database, so tests run in parallel), cloned from a template migrated
//! once per process, on the server [`find_server`] finds (once per
//! process). The database is dropped when the test passes and kept, its
//! name on stderr, when it fails; the template and a throwaway server go
//! when the process exits.
//!
//! [`migrated_database`] and [`drop_database`] are the same steps for a
//! database of a given name (the benchmarks').

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use pg_outbox::ConnectOptions;
use pg_outbox::tokio_postgres::{Client, Config};

use crate::TempServer;
use crate::bench::BoxError;
use crate::options::options_of;
use crate::server::{connect, find_server};

/// The throwaway server of this process, if one was started (stopped at exit).
static SERVER: OnceLock<Mutex<Option<TempServer>>> = OnceLock::new();
static SETUP: tokio::sync::OnceCell<Setup> = tokio::sync::OnceCell::const_new();
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The server and template of this process's test databases.
#[derive(Debug, Clone)]
struct Setup {
    /// The server's admin settings; a test database's are these with
    /// another database name.
    admin: Config,
    template: String,
}

/// At exit: drop the template, then stop the throwaway server.
extern "C" fn cleanup_at_exit() {
    if let Some(setup) = SETUP.get() {
        drop_now(&setup.admin, &setup.template);
    }
    if let Some(m) = SERVER.get() {
        drop(m.lock().unwrap_or_else(PoisonError::into_inner).take());
    }
}

/// Drop database `name` from synchronous code (a `Drop`, an exit handler):
/// on a thread and runtime of its own, waited for.
fn drop_now(admin: &Config, name: &str) {
    let admin = admin.clone();
    let name = name.to_string();
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
        rt.block_on(async move {
            let client = connect(&admin).await.ok()?;
            drop_database(&client, &name).await;
            Some(())
        })
    })
    .join();
}

async fn setup() -> &'static Setup {
    SETUP
        .get_or_init(|| async {
            let server = find_server()
                .await
                .unwrap_or_else(|e| panic!("no PostgreSQL to test against: {}", pg_outbox::error::report(e.as_ref())));
            let admin = server.config.clone();
            if let Some(temp) = server.temp {
                SERVER.get_or_init(|| Mutex::new(None)).lock().unwrap_or_else(PoisonError::into_inner).replace(temp);
            }
            let template = format!("pgo_it_tmpl_{}", std::process::id());
            // Registered before the template exists, so that a throwaway
            // server is stopped even if the template cannot be made.
            // SAFETY: registering a plain extern "C" fn with atexit(3).
            unsafe {
                libc::atexit(cleanup_at_exit);
            }
            let client = connect(&admin).await.expect("connect to the test server");
            migrated_database(&client, &admin, &template)
                .await
                .unwrap_or_else(|e| panic!("migrated template {template}: {}", pg_outbox::error::report(e.as_ref())));
            Setup { admin, template }
        })
        .await
}

/// A database of one test's own, migrated; dropped when the test passes,
/// kept when it fails.
#[derive(Debug)]
pub struct TestDb {
    /// Its name: `pgo_it_<pid>_<n>_<tag>`, at most 63 bytes.
    pub name: String,
    /// How to reach it (the server's settings with this database), without
    /// TLS.
    pub pg: Config,
    admin: Config,
}

impl TestDb {
    /// Create a migrated database for the test `tag` (its name holds `tag`
    /// in lower case, with `_` for what is not ASCII alphanumeric). The
    /// first call of the process finds the server and migrates the
    /// template.
    ///
    /// # Panics
    /// If no server is found or the database cannot be created.
    pub async fn new(tag: &str) -> TestDb {
        let s = setup().await;
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let clean: String =
            tag.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
        let mut name = format!("pgo_it_{}_{}_{}", std::process::id(), n, clean);
        name.truncate(63);
        let c = connect(&s.admin).await.expect("connect to the test server");
        // CREATE DATABASE ... TEMPLATE fails if another session is copying
        // the template at the same instant; retry briefly.
        let mut tries = 0;
        loop {
            match c.batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {}", s.template)).await {
                Ok(()) => break,
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("create test database {name}: {e}"),
            }
        }
        let mut pg = s.admin.clone();
        pg.dbname(&name);
        TestDb { name, pg, admin: s.admin.clone() }
    }

    /// A new plain connection to this database (see [`connect`]).
    ///
    /// # Panics
    /// If it cannot connect.
    pub async fn client(&self) -> Client {
        connect(&self.pg).await.expect("connect to the test database")
    }

    /// This database's URL for a child process (a `postgres://` URL, or
    /// key=value settings for a Unix socket). It holds no password: the
    /// child's libpq settings supply one, if any.
    pub fn url(&self) -> String {
        use pg_outbox::tokio_postgres::config::Host;
        let host = match self.pg.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
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

    /// This database's connection options (see [`options_of`]).
    pub fn options(&self) -> ConnectOptions {
        options_of(&self.pg)
    }

    /// Terminate the backends of this database whose `application_name` is
    /// `app`; how many there were.
    ///
    /// # Panics
    /// If the query fails.
    pub async fn terminate(&self, app: &str) -> i64 {
        let c = self.client().await;
        c.query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
            &[&self.name, &app],
        )
        .await
        .expect("terminate")
        .get(0)
    }

    /// Terminate the backend of the relay's work session (application
    /// name `pg-outbox drain`) that holds single mode's leader lock; how
    /// many there were (0 or 1).
    ///
    /// # Panics
    /// If the query fails.
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
        drop_now(&self.admin, &self.name);
    }
}

/// Create (anew: an existing one is dropped first) the migrated database
/// `name` on `admin`'s server, and return `admin_cfg` pointing at it.
///
/// # Errors
/// The database cannot be created or migrated.
pub async fn migrated_database(admin: &Client, admin_cfg: &Config, name: &str) -> Result<Config, BoxError> {
    drop_database(admin, name).await;
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await?;
    let mut cfg = admin_cfg.clone();
    cfg.dbname(name);
    pg_outbox::migrate::apply(&options_of(&cfg)).await?;
    Ok(cfg)
}

/// Drop database `name` if it exists, forcibly (its sessions are ended) if
/// the server supports it (13+); a line on stderr if it cannot.
pub async fn drop_database(admin: &Client, name: &str) {
    let forced = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
    if let Err(e) = forced
        && let Err(e2) = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}")).await
    {
        eprintln!("could not drop database {name}: {e}; {e2}");
    }
}

//! A PostgreSQL to run against, and connections to it.
//!
//! [`find_server`] takes, in order: a throwaway server when
//! `PG_OUTBOX_TEST_SERVER=throwaway` (to exercise the path of a machine
//! where no server runs); `DATABASE_URL` when set; the server on
//! 127.0.0.1:5432, then the one on the local socket
//! (`/var/run/postgresql`), as the `postgres` user, if one answers within
//! 3 s; else a [`TempServer`] started from the local binaries.

use std::fmt;
use std::time::Duration;

use pg_outbox::ConnectOptions;
use pg_outbox::tokio_postgres::config::SslMode;
use pg_outbox::tokio_postgres::{Client, Config, NoTls};

use crate::TempServer;
use crate::bench::BoxError;
use crate::options::conninfo;

/// The local servers tried, in order, after `DATABASE_URL`.
const LOCAL: [(&str, &str); 2] = [
    ("postgres://postgres@127.0.0.1:5432/postgres", "the server at 127.0.0.1:5432"),
    ("host=/var/run/postgresql user=postgres dbname=postgres", "the server on the socket in /var/run/postgresql"),
];

/// How long a local server has to answer before the next one is tried.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Where [`find_server`] found its server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The `DATABASE_URL` environment variable.
    DatabaseUrl,
    /// A server running on this machine (the text says which).
    Local(&'static str),
    /// A throwaway server started from the local binaries.
    Throwaway,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::DatabaseUrl => f.write_str("DATABASE_URL"),
            Source::Local(which) => f.write_str(which),
            Source::Throwaway => f.write_str("a throwaway server started from the local binaries"),
        }
    }
}

/// A server to run against; a throwaway one is stopped (and deleted) when
/// this is dropped.
#[derive(Debug)]
pub struct Server {
    /// How to reach it as a user allowed to create databases (the
    /// `postgres` database, or `DATABASE_URL`'s), with TLS turned off: the
    /// tests and benchmarks connect with `NoTls`, and a benchmark's sides
    /// are compared on equal terms.
    pub config: Config,
    /// Where it was found (for a progress line).
    pub source: Source,
    /// The throwaway server, if one was started.
    pub temp: Option<TempServer>,
}

/// Find a server to run against (the order is in the [module
/// documentation](self)). Starting a throwaway server blocks a thread of
/// the blocking pool for a second or two.
///
/// # Errors
/// `DATABASE_URL` does not parse, or no local server answers and a
/// throwaway one cannot be started (the message says what to install).
pub async fn find_server() -> Result<Server, BoxError> {
    let mut server = find_any().await?;
    server.config.ssl_mode(SslMode::Disable);
    Ok(server)
}

async fn find_any() -> Result<Server, BoxError> {
    if std::env::var("PG_OUTBOX_TEST_SERVER").is_ok_and(|v| v == "throwaway") {
        return start_throwaway().await;
    }
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.trim().is_empty()
    {
        let config = ConnectOptions::parse(&url)?.tokio_postgres_config();
        return Ok(Server { config, source: Source::DatabaseUrl, temp: None });
    }
    for (candidate, which) in LOCAL {
        let config = ConnectOptions::parse(candidate)?.tokio_postgres_config();
        if answers(&config).await {
            return Ok(Server { config, source: Source::Local(which), temp: None });
        }
    }
    start_throwaway().await
}

/// Whether a server at `cfg` accepts a connection and a query within
/// [`PROBE_TIMEOUT`].
async fn answers(cfg: &Config) -> bool {
    let mut cfg = cfg.clone();
    cfg.connect_timeout(PROBE_TIMEOUT);
    let probe = async {
        match cfg.connect(NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                client.simple_query("SELECT 1").await.is_ok()
            }
            Err(_) => false,
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, probe).await.unwrap_or(false)
}

async fn start_throwaway() -> Result<Server, BoxError> {
    let temp = tokio::task::spawn_blocking(TempServer::start).await??;
    let config = ConnectOptions::parse(&temp.url())?.tokio_postgres_config();
    Ok(Server { config, source: Source::Throwaway, temp: Some(temp) })
}

/// A connection to `cfg` without TLS, whose connection task runs on a
/// spawned task (it writes a line on stderr if the connection ends with an
/// error other than the server closing it, as `DROP DATABASE ... WITH
/// (FORCE)` does).
///
/// # Errors
/// [`pg_outbox::Error::Connect`], naming the target (never the password).
pub async fn connect(cfg: &Config) -> Result<Client, pg_outbox::Error> {
    let (client, connection) = cfg.connect(NoTls).await.map_err(|source| pg_outbox::Error::Connect {
        target: ConnectOptions::parse(&conninfo(cfg)).map_or_else(|_| "the server under test".into(), |o| o.describe()),
        source,
    })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await
            && !e.is_closed()
        {
            eprintln!("connection to the server under test ended: {}", pg_outbox::error::report(&e));
        }
    });
    Ok(client)
}

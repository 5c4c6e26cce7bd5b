//! Opening connections: URL parsing, keepalives, application names, and
//! errors that name the target without the password.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

use crate::error::{Error, Result};

/// TCP keepalive idle time set on every connection, so a half-open
/// connection (a vanished server or a dropped NAT entry) is noticed in about
/// a minute instead of the kernel's two hours.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// Default connect timeout when the URL sets none: 10 seconds.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Parse a libpq-style URL (`postgres://user@host:5432/db?...`) or key=value
/// string.
///
/// # Errors
/// [`Error::InvalidUrl`] describing what could not be parsed (the text of
/// the URL, which may hold a password, is not repeated);
/// [`Error::Config`] for a URL of another scheme (`mysql://...`).
pub fn parse_url(url: &str) -> Result<Config> {
    let trimmed = url.trim_start();
    if let Some((scheme, _)) = trimmed.split_once("://")
        && scheme != "postgres"
        && scheme != "postgresql"
    {
        return Err(Error::Config(format!(
            "invalid database URL: scheme `{scheme}://` is not PostgreSQL; write postgres://user@host:5432/dbname"
        )));
    }
    url.parse::<Config>().map_err(Error::InvalidUrl)
}

/// `host:port/dbname` of a config, for messages. Never includes the password.
pub fn describe_target(cfg: &Config) -> String {
    let host = match cfg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let db = cfg.get_dbname().or(cfg.get_user()).unwrap_or("?");
    format!("{host}:{port}/{db}")
}

/// Connect with the given application name (visible in `pg_stat_activity`),
/// TCP keepalives and a connect timeout; spawn the connection task and return
/// its handle (its error is logged when it ends with one).
///
/// Used for the work connection. The LISTEN connection is driven by the
/// notifier itself (see `consumer::notifier`).
pub(crate) async fn connect(cfg: &Config, application_name: &str) -> Result<(Client, JoinHandle<()>)> {
    let cfg = prepared(cfg, application_name);
    let (client, connection) =
        cfg.connect(NoTls).await.map_err(|source| Error::Connect { target: describe_target(&cfg), source })?;
    let name = application_name.to_string();
    let handle = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(connection = %name, error = %e, "connection ended");
        }
    });
    Ok((client, handle))
}

/// The config with our application name, keepalives and a connect timeout.
pub(crate) fn prepared(cfg: &Config, application_name: &str) -> Config {
    let mut cfg = cfg.clone();
    if cfg.get_application_name().is_none() {
        cfg.application_name(application_name);
    }
    cfg.keepalives(true).keepalives_idle(KEEPALIVE_IDLE);
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
    }
    cfg
}

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

/// Server-side TCP keepalive settings sent with every connection (unless the
/// URL's `options` set them): idle 30 s, then 3 probes 10 s apart.
pub const SERVER_KEEPALIVES: &str = "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3";

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
/// its [`Link`] (its error is logged when it ends with one).
///
/// Used for the work connection. The LISTEN connection is driven by the
/// notifier itself (see `consumer::notifier`).
/// A spawned connection task, and a token cancelled the moment it ends
/// (the server closed the session, the network broke, or it was aborted).
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) handle: JoinHandle<()>,
    pub(crate) closed: tokio_util::sync::CancellationToken,
}

pub(crate) async fn connect(cfg: &Config, application_name: &str) -> Result<(Client, Link)> {
    let cfg = prepared(cfg, application_name);
    let (client, connection) =
        cfg.connect(NoTls).await.map_err(|source| Error::Connect { target: describe_target(&cfg), source })?;
    let name = application_name.to_string();
    let closed = tokio_util::sync::CancellationToken::new();
    let guard = closed.clone().drop_guard();
    let handle = tokio::spawn(async move {
        let _guard = guard;
        if let Err(e) = connection.await {
            tracing::debug!(connection = %name, error = %e, "connection ended");
        }
    });
    Ok((client, Link { handle, closed }))
}

/// The config with our application name, keepalives and a connect timeout.
pub(crate) fn prepared(cfg: &Config, application_name: &str) -> Config {
    let mut cfg = cfg.clone();
    if cfg.get_application_name().is_none() {
        cfg.application_name(application_name);
    }
    cfg.keepalives(true).keepalives_idle(KEEPALIVE_IDLE);
    // The server's side too (PostgreSQL docs, "Connection Settings"): a relay
    // that vanished behind a half-open connection is dropped in about a
    // minute, releasing its locks, so a standby can take over.
    let server_keepalives = SERVER_KEEPALIVES;
    let options = match cfg.get_options() {
        Some(o) if !o.contains("tcp_keepalives_idle") => format!("{o} {server_keepalives}"),
        Some(o) => o.to_string(),
        None => server_keepalives.to_string(),
    };
    cfg.options(&options);
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
    }
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepared_sets_keepalives_and_keeps_user_options() {
        let cfg = prepared(&parse_url("postgres://u@h/db").expect("url"), "app");
        assert_eq!(cfg.get_options(), Some(SERVER_KEEPALIVES));
        assert_eq!(cfg.get_application_name(), Some("app"));
        assert!(cfg.get_keepalives());
        let cfg = prepared(&parse_url("host=h user=u options='-c search_path=x'").expect("url"), "app");
        assert_eq!(cfg.get_options(), Some(format!("-c search_path=x {SERVER_KEEPALIVES}").as_str()));
        let mine = "-c tcp_keepalives_idle=5";
        let cfg = prepared(&parse_url(&format!("host=h user=u options='{mine}'")).expect("url"), "app");
        assert_eq!(cfg.get_options(), Some(mine));
    }

    #[test]
    fn other_schemes_are_named() {
        let e = parse_url("mysql://u@h/db").expect_err("not postgres");
        assert!(e.to_string().contains("mysql://"), "{e}");
        let secret = parse_url("postgres://u:s3cret@h:notaport/db").expect_err("bad port");
        assert!(!crate::error::report(&secret).contains("s3cret"));
    }
}

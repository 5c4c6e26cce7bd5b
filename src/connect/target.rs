//! Where a connection goes, for messages and errors: hosts or sockets,
//! database and user, never the password.

use std::path::Path;

use tokio_postgres::Config;
use tokio_postgres::config::Host;

use super::env::DEFAULT_PORT;

/// Where a config connects to, for messages: each host with its port (a
/// socket as its file, `/var/run/postgresql/.s.PGSQL.5432`), then the
/// database and user: `db:5432 (database app, user app)`, `socket
/// /var/run/postgresql/.s.PGSQL.5432 or /tmp/.s.PGSQL.5432 (database app,
/// user app)`. Never includes the password.
pub(super) fn describe_target(cfg: &Config) -> String {
    let ports = cfg.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(DEFAULT_PORT);
    let addrs = cfg.get_hostaddrs();
    let mut sockets = Vec::new();
    let mut tcp = Vec::new();
    let n = cfg.get_hosts().len().max(addrs.len());
    for i in 0..n {
        let addr = addrs.get(i);
        match (cfg.get_hosts().get(i), addr) {
            (Some(Host::Unix(dir)), _) => sockets.push(format!("{}/.s.PGSQL.{}", dir.display(), port(i))),
            (Some(Host::Tcp(h)), Some(a)) => tcp.push(format!("{h} ({a}):{}", port(i))),
            (Some(Host::Tcp(h)), None) if h.contains(':') => tcp.push(format!("[{h}]:{}", port(i))),
            (Some(Host::Tcp(h)), None) => tcp.push(format!("{h}:{}", port(i))),
            (None, Some(std::net::IpAddr::V6(a))) => tcp.push(format!("[{a}]:{}", port(i))),
            (None, Some(a)) => tcp.push(format!("{a}:{}", port(i))),
            (None, None) => {}
        }
    }
    let mut wheres = tcp;
    if !sockets.is_empty() {
        wheres.push(format!("socket {}", sockets.join(" or ")));
    }
    let place = if wheres.is_empty() { "no host".to_string() } else { wheres.join(" or ") };
    let db = cfg.get_dbname().unwrap_or("?");
    let user = cfg.get_user().unwrap_or("?");
    format!("{place} (database {db}, user {user})")
}

/// Notes for a failed connection: socket directories that do not exist,
/// and the password file a refused password came from.
pub(super) fn failure_notes(cfg: &Config, password_file: Option<&Path>, e: &tokio_postgres::Error) -> Vec<String> {
    let mut notes = Vec::new();
    for h in cfg.get_hosts() {
        if let Host::Unix(dir) = h
            && !dir.is_dir()
        {
            notes.push(format!("directory {} does not exist", dir.display()));
        }
    }
    if let Some(file) = password_file
        && e.code().is_some_and(|c| {
            *c == tokio_postgres::error::SqlState::INVALID_PASSWORD
                || *c == tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        })
    {
        notes.push(format!("password from the password file {}", file.display()));
    }
    notes
}

/// `target` (ending in `(...)`) with `notes` added inside the parentheses.
pub(super) fn with_notes(target: String, notes: &[String]) -> String {
    if notes.is_empty() {
        return target;
    }
    match target.strip_suffix(')') {
        Some(t) => format!("{t}; {})", notes.join("; ")),
        None => format!("{target} ({})", notes.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::testing::parse_in;

    #[test]
    fn targets_name_every_host_or_socket_the_database_and_the_user() {
        let o = parse_in("postgres://app:secret@db:6543/shop?sslmode=verify-full&sslrootcert=/ca.pem", &[]).expect("u");
        assert_eq!(o.describe(), "db:6543 (database shop, user app, sslmode=verify-full)");
        let o = parse_in("host=/run/pg,/tmp user=u dbname=d", &[]).expect("kv");
        assert_eq!(o.describe(), "socket /run/pg/.s.PGSQL.5432 or /tmp/.s.PGSQL.5432 (database d, user u)");
        let o = parse_in("host=a,b port=1,2 user=u dbname=d sslmode=disable", &[]).expect("kv");
        assert_eq!(o.describe(), "a:1 or b:2 (database d, user u, sslmode=disable)");
        let o = parse_in("host=db hostaddr=10.0.0.1 user=u", &[]).expect("kv");
        assert_eq!(o.describe(), "db (10.0.0.1):5432 (database u, user u, sslmode=prefer)");
        let o = parse_in("host=::1 user=u", &[]).expect("kv");
        assert_eq!(o.describe(), "[::1]:5432 (database u, user u, sslmode=prefer)");
        assert!(!o.describe().contains("secret"));
        assert_eq!(
            with_notes("x (database d)".into(), &["directory /x does not exist".into()]),
            "x (database d; directory /x does not exist)"
        );
    }
}

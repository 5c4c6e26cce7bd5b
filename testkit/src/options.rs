//! Connection options for the tests' and benchmarks' servers.

use pg_outbox::tokio_postgres::Config;
use pg_outbox::tokio_postgres::config::Host;

/// `cfg` (a test or benchmark server's settings) as pg-outbox's connection options, by
/// way of a key=value string: pg-outbox deliberately takes no
/// `tokio_postgres::Config` (it cannot hold `verify-full`). The local servers
/// need no TLS.
///
/// # Panics
/// If the string does not parse (a `Config` always gives one that does).
pub fn options_of(cfg: &Config) -> pg_outbox::ConnectOptions {
    pg_outbox::ConnectOptions::parse(&conninfo(cfg)).expect("test server options")
}

/// A libpq key=value connection string for `cfg` (every host and port,
/// user, password, dbname, options, application name; `sslmode=disable`:
/// every side of a benchmark's comparison connects without TLS, so
/// encryption does not skew its ratios), e.g. for the `DATABASE_URL` of a
/// child process. It holds the password if `cfg` has one: pass it through
/// the environment, never print it.
pub fn conninfo(cfg: &Config) -> String {
    let quote = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
    let mut parts = Vec::new();
    let hosts: Vec<String> = cfg
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(h) => h.clone(),
            Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    if !hosts.is_empty() {
        parts.push(format!("host={}", quote(&hosts.join(","))));
    }
    let ports: Vec<String> = cfg.get_ports().iter().map(u16::to_string).collect();
    if !ports.is_empty() {
        parts.push(format!("port={}", ports.join(",")));
    }
    if let Some(u) = cfg.get_user() {
        parts.push(format!("user={}", quote(u)));
    }
    if let Some(p) = cfg.get_password() {
        parts.push(format!("password={}", quote(&String::from_utf8_lossy(p))));
    }
    if let Some(d) = cfg.get_dbname() {
        parts.push(format!("dbname={}", quote(d)));
    }
    if let Some(o) = cfg.get_options() {
        parts.push(format!("options={}", quote(o)));
    }
    if let Some(a) = cfg.get_application_name() {
        parts.push(format!("application_name={}", quote(a)));
    }
    parts.push("sslmode=disable".into());
    parts.join(" ")
}

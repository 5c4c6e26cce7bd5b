//! One host's connection attempt: each TLS mode to try in turn, bounded,
//! a server that takes no writes told apart, each failure recorded.

use std::path::Path;
use std::time::Duration;

use tokio_postgres::{Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::ConnectOptions;
use super::hosts::{self, ServerState};
use super::target::{failure_notes, with_notes};
use super::tls::TlsStream;
use crate::error::Error;

/// What trying one host, in each TLS mode to try, gave.
pub(super) enum HostTry {
    /// A session to a server that takes writes (or to any server, when
    /// writes are not needed).
    Open(Client, Box<Connection<Socket, TlsStream>>),
    /// Not this host (each failure recorded); `unknown_setting`: the
    /// server did not know a setting of PostgreSQL 14.
    Next { unknown_setting: bool },
    /// A pooler refused the startup options: `session::open` connects again
    /// without them.
    Refused,
}

/// One host's connection attempt, the same for each TLS mode.
pub(super) struct Attempt<'a> {
    /// The host as messages name it.
    pub(super) name: String,
    pub(super) tls: &'a MakeRustlsConnect,
    /// Only a server that takes writes will do.
    pub(super) writes: bool,
    /// The bound of the whole attempt of each mode (libpq's
    /// `connect_timeout`: per host).
    pub(super) bound: Duration,
    /// The session options hold settings of PostgreSQL 14.
    pub(super) with_check: bool,
}

impl Attempt<'_> {
    /// Connect to `host` in each of the TLS modes `attempts` in turn, each
    /// failure pushed on `failures`.
    pub(super) async fn host(
        &self,
        mut host: Config,
        attempts: &[tokio_postgres::config::SslMode],
        failures: &mut Failures,
    ) -> HostTry {
        let (name, bound) = (&self.name, self.bound);
        let mut unknown_setting = false;
        for mode in attempts {
            host.ssl_mode(*mode);
            let attempt = async {
                let (client, mut connection) = host.connect(self.tls.clone()).await?;
                let state = if self.writes {
                    hosts::server_state(&client, &mut connection).await?
                } else {
                    ServerState::Writable
                };
                Ok::<_, tokio_postgres::Error>((client, connection, state))
            };
            let Ok(attempt) = tokio::time::timeout(bound, attempt).await else {
                tracing::debug!(target_db = %name, timeout = ?bound, "connection attempt timed out");
                failures.push(name, Failure::TimedOut);
                break;
            };
            match attempt {
                Ok((client, connection, ServerState::Writable)) => return HostTry::Open(client, Box::new(connection)),
                Ok((_, _, state)) => {
                    tracing::debug!(target_db = %name, ?state, "the server accepts no writes; trying the next host");
                    failures
                        .push(name, if state == ServerState::Standby { Failure::Standby } else { Failure::ReadOnly });
                    break;
                }
                Err(e) => {
                    tracing::debug!(target_db = %name, error = %crate::error::report(&e), "connection attempt failed");
                    unknown_setting |=
                        self.with_check && e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT);
                    // A pooler that refuses the options answered in this mode.
                    let refused = refused_startup_options(&e);
                    failures.push(name, Failure::Error(e));
                    if refused {
                        return HostTry::Refused;
                    }
                }
            }
        }
        HostTry::Next { unknown_setting }
    }
}

/// Whether the server refused the startup parameter `options`, as
/// PgBouncer does ("unsupported startup parameter: options", SQLSTATE
/// 08P01) unless its `ignore_startup_parameters` names it, and RDS Proxy
/// ("doesn't support command-line options", by its documentation).
pub(super) fn refused_startup_options(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.as_db_error().is_some_and(|db| {
        (*db.code() == SqlState::PROTOCOL_VIOLATION || *db.code() == SqlState::FEATURE_NOT_SUPPORTED)
            && db.message().to_ascii_lowercase().contains("options")
    })
}

/// Why a host was not connected to.
#[derive(Debug)]
pub(super) enum Failure {
    /// The connect timeout ran out.
    TimedOut,
    /// A hot standby, for a session that must write.
    Standby,
    /// A server whose sessions are read-only, for a session that must write.
    ReadOnly,
    /// What the driver reported.
    Error(tokio_postgres::Error),
}

/// The failures of one connection attempt, host by host, in order.
#[derive(Debug, Default)]
pub(super) struct Failures(Vec<(String, Failure)>);

impl Failures {
    pub(super) fn push(&mut self, host: &str, failure: Failure) {
        self.0.push((host.to_string(), failure));
    }

    /// The error for an attempt where no host would do: a standby (or a
    /// read-only server) if one answered, else the driver's last error,
    /// else the timeout. With several hosts, what each answered is noted.
    pub(super) fn into_error(
        self,
        opts: &ConnectOptions,
        base: &Config,
        password_file: Option<&Path>,
        several: bool,
        bound: Duration,
    ) -> Error {
        // What each host answered, when there are several and they
        // answered differently (the same failure everywhere is said once,
        // by the error itself).
        if self.0.is_empty() {
            return Error::Config("no connection attempt made".into());
        }
        let described: Vec<String> = self.0.iter().map(|(_, f)| describe_failure(f, bound)).collect();
        let differ = described.iter().any(|d| Some(d) != described.first());
        let notes_but = |skip: Option<usize>| -> Vec<String> {
            if !several || !(differ || skip.is_some()) {
                return Vec::new();
            }
            self.0
                .iter()
                .zip(&described)
                .enumerate()
                .filter(|(i, _)| Some(*i) != skip)
                .map(|(_, ((host, _), d))| format!("{}: {d}", short_host(host)))
                .collect()
        };
        if let Some(i) = self.0.iter().position(|(_, f)| matches!(f, Failure::Standby)) {
            return Error::ReadOnlyStandby { target: with_notes(self.0[i].0.clone(), &notes_but(Some(i))) };
        }
        if let Some(i) = self.0.iter().position(|(_, f)| matches!(f, Failure::ReadOnly)) {
            return Error::ReadOnlyServer { target: with_notes(self.0[i].0.clone(), &notes_but(Some(i))) };
        }
        let notes = notes_but(None);
        let last = self.0.into_iter().rev().find_map(|(_, f)| match f {
            Failure::Error(e) => Some(e),
            _ => None,
        });
        match last {
            Some(source) => {
                let mut all = failure_notes(base, password_file, &source);
                all.extend(notes);
                Error::Connect { target: with_notes(opts.describe(), &all), source }
            }
            None => Error::ConnectTimedOut { target: with_notes(opts.describe(), &notes), after: bound },
        }
    }
}

/// A host's description (`db:5432 (database app, user app)`) without the
/// database and user, for a note on it.
fn short_host(described: &str) -> &str {
    described.split_once(" (").map_or(described, |(host, _)| host)
}

/// A host's failure, for a note.
fn describe_failure(f: &Failure, bound: Duration) -> String {
    match f {
        Failure::TimedOut => format!("no answer within {bound:?}"),
        Failure::Standby => "a read-only standby (in recovery)".into(),
        Failure::ReadOnly => "read-only (default_transaction_read_only)".into(),
        Failure::Error(e) => crate::error::report(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::testing::parse_url;

    #[test]
    fn a_standby_among_several_hosts_is_named_with_what_the_others_answered() {
        let bound = Duration::from_secs(2);
        let opts = parse_url("postgres://u@a:1,b:2/d?target_session_attrs=read-write").expect("url");
        let mut f = Failures::default();
        f.push("a:1 (database d, user u)", Failure::TimedOut);
        f.push("b:2 (database d, user u)", Failure::Standby);
        let e = f.into_error(&opts, &opts.pg, None, true, bound);
        let Error::ReadOnlyStandby { target } = &e else { panic!("{e:?}") };
        assert_eq!(target, "b:2 (database d, user u; a:1: no answer within 2s)");
        assert!(e.to_string().starts_with("the server at b:2 (database d, user u; a:1: no answer within 2s) is a read-only standby (in recovery); point the URL at the primary"), "{e}");
        assert!(e.is_transient(), "a promotion may end it");
        let mut f = Failures::default();
        f.push("a:1 (database d, user u)", Failure::ReadOnly);
        let e = f.into_error(&opts, &opts.pg, None, false, bound);
        let Error::ReadOnlyServer { target } = &e else { panic!("{e:?}") };
        assert_eq!(target, "a:1 (database d, user u)", "one host: no notes");
        // The same failure on every host is said once, by the error.
        let mut f = Failures::default();
        f.push("a:1 (database d, user u)", Failure::TimedOut);
        f.push("b:2 (database d, user u)", Failure::TimedOut);
        let e = f.into_error(&opts, &opts.pg, None, true, bound);
        let Error::ConnectTimedOut { target, after } = &e else { panic!("{e:?}") };
        assert_eq!(*after, bound);
        assert_eq!(target, &opts.describe());
    }
}

//! One host's connection attempt: each TLS mode to try in turn, bounded,
//! a server that takes no writes told apart, each failure recorded.

use std::time::Duration;

use tokio_postgres::{Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::hosts::{self, ServerState};
use super::session::{Failure, Failures, refused_startup_options};
use super::tls::TlsStream;

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

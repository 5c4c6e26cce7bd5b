//! Opening connections: connection strings and libpq's environment
//! variables, defaults and password file (see [`ConnectOptions`]), TLS,
//! keepalives, application names, and errors that name the target without
//! the password.
//!
//! TLS follows libpq (PostgreSQL docs, "SSL Support", table "SSL Mode
//! Descriptions"): `sslmode` is one of `disable`, `allow`, `prefer`
//! (default), `require`, `verify-ca`, `verify-full`; `sslrootcert` names a
//! PEM file of trusted CA certificates, or `system` for the system's store.
//! tokio-postgres's own parser knows neither `allow`/`verify-*` nor
//! `sslrootcert`, so [`ConnectOptions::parse`] takes them out of the URL
//! first and keeps them beside the [`tokio_postgres::Config`].
//!
//! By concern:
//! - `ssl_mode`: the public [`SslMode`] and [`RootCert`];
//! - `options`: [`ConnectOptions`], resolved as libpq resolves them;
//! - `parse`: the URL and key=value syntax, with `sslmode` and
//!   `sslrootcert` taken out;
//! - `env` and `libpq`: what the string leaves unset, from libpq's
//!   environment variables, defaults and password file;
//! - `target`: where a connection goes, for messages;
//! - `hosts`: the hosts of a URL tried one at a time, each within the
//!   connect timeout, and whether a server accepts writes;
//! - `tls`: the rustls verifier behind `sslmode`, and [`TlsConnector`];
//! - `planner`: the planner settings every pg-outbox session starts with
//!   ([`PLANNER_SETTINGS`]), which the statements of `store` rely on;
//! - `session`: pg-outbox's own sessions (application names, keepalives,
//!   startup settings, the connection task and its canceller);
//! - `pooling`: whether the sessions behind a URL are a connection's own or
//!   shared between transactions (a transaction-mode pooler), [`SessionMode`].

mod attempt;
mod env;
mod hosts;
mod libpq;
mod options;
mod parse;
mod planner;
mod pooling;
mod session;
mod ssl_mode;
mod target;
mod tls;

pub use options::ConnectOptions;
pub(crate) use parse::parses;
pub(crate) use planner::PLANNER_SETTINGS;
pub use pooling::SessionMode;
pub(crate) use pooling::require_own_sessions;
pub(crate) use session::setting_millis;
pub(crate) use session::{Canceller, Link, SessionSettings, connect, open};
pub use ssl_mode::{RootCert, SslMode};
pub use tls::TlsConnector;

/// Parsing with the environment from a map, for the tests of every part.
#[cfg(test)]
mod testing {
    use super::ConnectOptions;
    use crate::error::Result;

    /// Parse with an empty environment.
    pub(super) fn parse_url(s: &str) -> Result<ConnectOptions> {
        ConnectOptions::parse_with(s, &|_| None)
    }

    /// Parse with the variables `vars` as the environment (the process
    /// environment is neither read nor changed).
    pub(super) fn parse_in(s: &str, vars: &[(&str, &str)]) -> Result<ConnectOptions> {
        let env = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        ConnectOptions::parse_with(s, &env)
    }
}

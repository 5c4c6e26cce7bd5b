//! The public TLS settings: libpq's `sslmode` and `sslrootcert`.

use std::fmt;
use std::path::PathBuf;

use crate::error::{Error, Result};

/// TLS mode of a connection, as libpq's `sslmode` (PostgreSQL docs, libpq
/// "SSL Support", table "SSL Mode Descriptions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SslMode {
    /// Never use TLS.
    Disable,
    /// Try without TLS first; if that connection fails, try with TLS (the
    /// certificate is not checked).
    Allow,
    /// Use TLS if the server offers it, else go on without (default). The
    /// certificate is not checked.
    #[default]
    Prefer,
    /// TLS or fail. The certificate is not checked, unless a root
    /// certificate is given (`sslrootcert`, or `~/.postgresql/root.crt`
    /// exists): then its chain is checked as in `verify-ca`.
    Require,
    /// TLS, and the server's certificate must chain to a trusted root
    /// (`sslrootcert`, default `~/.postgresql/root.crt`). The host name is
    /// not checked.
    VerifyCa,
    /// As `verify-ca`, and the certificate must be issued for the host name
    /// connected to (DNS name or IP address in its subjectAltName).
    VerifyFull,
}

impl SslMode {
    /// The libpq name (`verify-full`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// The closest mode tokio-postgres knows (it has no `allow` or
    /// `verify-*`): `verify-*` map to `require`, so a plain
    /// `Config::connect(NoTls)` refuses instead of going on without TLS.
    pub(super) fn coarse(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as T;
        match self {
            SslMode::Disable | SslMode::Allow => T::Disable,
            SslMode::Prefer => T::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => T::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SslMode {
    type Err = Error;

    /// Parse a libpq `sslmode` value.
    ///
    /// # Errors
    /// [`Error::Config`] naming the value and the accepted ones.
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::Config(format!(
                    "invalid sslmode `{other}`: expected disable, allow, prefer, require, verify-ca or verify-full"
                )));
            }
        })
    }
}

/// Trusted root certificates for checking the server (libpq `sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RootCert {
    /// A PEM file holding one or more CA certificates.
    File(PathBuf),
    /// The system's trusted roots (`sslrootcert=system`, libpq 16): loaded
    /// with `rustls-native-certs`. As in libpq, this requires
    /// `sslmode=verify-full` (and makes it the default).
    System,
}

impl fmt::Display for RootCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RootCert::File(p) => write!(f, "{}", p.display()),
            RootCert::System => f.write_str("system"),
        }
    }
}

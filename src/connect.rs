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

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::task::JoinHandle;
use tokio_postgres::config::Host;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, Result};

mod libpq;

/// TCP keepalive idle time set on every connection, so a half-open
/// connection (a vanished server or a dropped NAT entry) is noticed in about
/// a minute instead of the kernel's two hours.
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// Server-side TCP keepalive settings sent with every connection (unless the
/// URL's `options` set them): idle 30 s, then 3 probes 10 s apart.
pub(crate) const SERVER_KEEPALIVES: &str =
    "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3";

/// Planner settings sent with every pg-outbox session (as startup
/// `options`, before the URL's own, which therefore win):
///
/// * `enable_sort=off`: every ordered, limited statement pg-outbox runs on
///   `events.outbox` orders by a key that exactly one index provides (the
///   expression `id + 0` of `outbox_fresh_order_idx`, `outbox_holdback_idx`
///   and `outbox_dead_letter_idx`, or `next_retry_at` of
///   `outbox_retry_due_idx`), so the only plan without an explicit sort is
///   the walk of that index, which stops after the rows it returns. With
///   sorts discouraged (PostgreSQL docs, "Planner Method Configuration":
///   the planner avoids a sort "if there are other methods available"), the
///   planner takes that walk whatever the statistics say. Without it,
///   statistics taken before a backlog formed (no unpublished rows) make
///   every plan over unpublished rows look like one row, and the planner may
///   sort the whole backlog, or walk it once per candidate row.
/// * `jit=off`: the discouraged sort adds a large constant to the estimated
///   cost of a plan that must sort a few rows anyway, which would otherwise
///   pass `jit_above_cost` and compile every fetch.
/// * `max_parallel_workers_per_gather=0`: a fetch returns at most a batch;
///   starting workers costs more than it saves, and estimates from missing
///   statistics could ask for them.
pub(crate) const PLANNER_SETTINGS: &str = "-c enable_sort=off -c jit=off -c max_parallel_workers_per_gather=0";

/// Default connect timeout when the URL sets none: 10 seconds.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `client_connection_check_interval` of the consumer's sessions: 5 s.
/// While a statement runs, the server polls the socket this often and ends
/// the statement and the session once the client is gone (PostgreSQL 14+,
/// docs "Connection Settings"), instead of running on until it has a result
/// to send: a relay killed with `kill -9` during a slow statement leaves it
/// running for at most about this long. Only running statements are
/// checked, so an idle session costs nothing.
pub(crate) const CLIENT_CONNECTION_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// How long a cancel request may take (it opens a connection of its own).
pub(crate) const CANCEL_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

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
    fn coarse(self) -> tokio_postgres::config::SslMode {
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

/// Connection settings, resolved as libpq resolves them, with TLS by libpq's
/// `sslmode` rules.
///
/// Made by [`ConnectOptions::parse`] (a URL or key=value string, then the
/// `PG*` environment variables for what it leaves unset, then libpq's
/// defaults) or [`ConnectOptions::from_env`] (the variables alone). There
/// is deliberately no conversion from a [`tokio_postgres::Config`]: it
/// cannot hold `verify-ca` or `verify-full`, so a `Config` taken out with
/// [`ConnectOptions::tokio_postgres_config`] and turned back would lose the
/// certificate check without a word.
///
/// Connect with [`ConnectOptions::connect`], or build a pool from
/// [`ConnectOptions::tokio_postgres_config`] and
/// [`ConnectOptions::tls_connector`]. Every connection pg-outbox opens uses
/// the same rules, with TLS by rustls (ring provider). There is no way to
/// reach the inner `Config` mutably, so the TLS settings cannot be dropped
/// on the way: with `verify-ca` or `verify-full`, the `Config` handed out
/// asks for `sslmode=require`, which refuses to connect with
/// `tokio_postgres::NoTls`.
///
/// # Where each setting comes from
/// As in libpq (PostgreSQL docs, libpq "Environment Variables", "The
/// Password File", "Parameter Key Words"), for each setting the first of:
///
/// 1. the connection string (`postgres://user:pw@host:port/db?sslmode=...`,
///    or `host=... user=... dbname=...`);
/// 2. its environment variable: `PGHOST` (host names, or socket
///    directories starting with `/`, comma separated), `PGPORT`, `PGUSER`,
///    `PGPASSWORD`, `PGDATABASE`, `PGSSLMODE`, `PGSSLROOTCERT`, `PGAPPNAME`,
///    `PGCONNECT_TIMEOUT` (seconds); an empty variable counts as unset;
/// 3. libpq's default: the host is the Unix socket in `/var/run/postgresql`
///    (Debian's and Red Hat's libpq) or `/tmp` (PostgreSQL's own build), each
///    that exists, in this order; the port 5432; the user the operating
///    system user this process runs as; the database named after the user;
///    `sslmode=prefer`.
///
/// Without a password from 1 or 2, the password file supplies it when a line
/// matches (`PGPASSFILE`, default `~/.pgpass`; lines
/// `hostname:port:database:username:password`, `*` matching anything; a
/// socket in a default directory matches `localhost`; a file that group or
/// others may read is ignored with a warning). It is read when connecting,
/// for the first host.
///
/// # Example
/// ```
/// use pg_outbox::{ConnectOptions, SslMode};
/// let opts = ConnectOptions::parse(
///     "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ssl/pg-ca.pem",
/// )?;
/// assert_eq!(opts.ssl_mode(), SslMode::VerifyFull);
/// assert_eq!(opts.dbname(), Some("app"));
/// assert_eq!(opts.user(), Some("app"));
/// # Ok::<(), pg_outbox::Error>(())
/// ```
///
/// A `tokio_postgres::Config` does not turn back into options (it would
/// drop `verify-full`):
/// ```compile_fail
/// let opts = pg_outbox::ConnectOptions::parse("host=db user=app sslmode=verify-full sslrootcert=/ca.pem")?;
/// let weakened = pg_outbox::ConnectOptions::from(opts.tokio_postgres_config());
/// # Ok::<(), pg_outbox::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pg: Config,
    ssl_mode: SslMode,
    root_cert: Option<RootCert>,
    /// Where a missing password is looked up when connecting.
    password_file: Option<PathBuf>,
}

impl ConnectOptions {
    /// Parse a libpq connection string, a URL
    /// (`postgres://user:password@host:5432/db?sslmode=verify-full&sslrootcert=/ca.pem`)
    /// or key=value pairs (`host=h dbname=d sslmode=verify-full`), and fill
    /// what it leaves unset from the `PG*` environment variables, then from
    /// libpq's defaults (see [`ConnectOptions`]). An empty string takes
    /// everything from the environment and the defaults, as `psql` does.
    ///
    /// Like libpq's `PQconnectdb` (and unlike tokio-postgres's own parser),
    /// this reads the process environment; fields of the string always win
    /// over the variables. Without `sslmode` (in the string or `PGSSLMODE`)
    /// the mode is `prefer`, or `verify-full` with `sslrootcert=system`.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] describing what could not be parsed (the string,
    /// which may hold a password, is not repeated); [`Error::Config`] for a
    /// URL of another scheme (`mysql://...`), an unknown `sslmode`, a mode
    /// weaker than `verify-full` with `sslrootcert=system`, an invalid
    /// `PGPORT`, `PGSSLMODE` or `PGCONNECT_TIMEOUT`, or no user name at all
    /// (none given and the OS user's name unreadable).
    pub fn parse(s: &str) -> Result<Self> {
        Self::parse_with(s, &libpq::process_env)
    }

    /// The settings of the `PG*` environment variables alone, with libpq's
    /// defaults for the rest: the same as [`ConnectOptions::parse`] of an
    /// empty string, and what `psql` connects to when given no arguments.
    ///
    /// # Errors
    /// As [`ConnectOptions::parse`], for the variables' values.
    ///
    /// # Example
    /// ```no_run
    /// # async fn run() -> Result<(), pg_outbox::Error> {
    /// // PGHOST=db.internal PGUSER=app PGDATABASE=app, password in ~/.pgpass
    /// let client = pg_outbox::ConnectOptions::from_env()?.connect().await?;
    /// client.simple_query("SELECT 1").await?;
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> Result<Self> {
        Self::parse("")
    }

    /// [`ConnectOptions::parse`] with the variables read through `env`.
    pub(crate) fn parse_with(s: &str, env: libpq::Lookup<'_>) -> Result<Self> {
        let (mut pg, mode, root) = parse_string(s)?;
        fill_from_env(&mut pg, env)?;
        let mode = mode.or_else(|| env("PGSSLMODE"));
        let root = root.or_else(|| env("PGSSLROOTCERT"));
        let root_cert = match root.as_deref() {
            None | Some("") => None,
            Some("system") => Some(RootCert::System),
            Some(p) => Some(RootCert::File(PathBuf::from(p))),
        };
        let ssl_mode = match mode.as_deref() {
            Some(m) => m.parse()?,
            None if root_cert == Some(RootCert::System) => SslMode::VerifyFull,
            None => SslMode::Prefer,
        };
        let password_file = libpq::password_file(env);
        let opts = ConnectOptions { pg, ssl_mode, root_cert, password_file }.synced();
        opts.check_system_roots()?;
        Ok(opts)
    }

    /// The TLS mode (default [`SslMode::Prefer`]).
    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// The trusted roots given (`sslrootcert`), if any. Without one,
    /// `~/.postgresql/root.crt` is used when it exists (as libpq does).
    pub fn root_cert(&self) -> Option<&RootCert> {
        self.root_cert.as_ref()
    }

    /// The user name to log in as (given, `PGUSER`, or the OS user's name).
    /// `None` only if none was given and the OS user's name is unknown.
    pub fn user(&self) -> Option<&str> {
        self.pg.get_user()
    }

    /// The database name (given, `PGDATABASE`, or the user name).
    pub fn dbname(&self) -> Option<&str> {
        self.pg.get_dbname()
    }

    /// The hosts tried in order: TCP host names or addresses, and Unix
    /// socket directories (the socket file in one is `.s.PGSQL.<port>`).
    /// Empty only when `hostaddr` alone gives the addresses.
    pub fn hosts(&self) -> &[Host] {
        self.pg.get_hosts()
    }

    /// The ports, one for every host or one for all; empty means 5432.
    pub fn ports(&self) -> &[u16] {
        self.pg.get_ports()
    }

    /// The application name given (`application_name`, or `PGAPPNAME`).
    /// When none is, pg-outbox names its sessions itself (`pg-outbox` for
    /// [`ConnectOptions::connect`], `pg-outbox drain` and `pg-outbox
    /// listener` for a consumer's).
    pub fn application_name(&self) -> Option<&str> {
        self.pg.get_application_name()
    }

    /// The connect timeout given (`connect_timeout` or `PGCONNECT_TIMEOUT`,
    /// in seconds). Without one, [`DEFAULT_CONNECT_TIMEOUT`] applies.
    pub fn connect_timeout(&self) -> Option<Duration> {
        self.pg.get_connect_timeout().copied()
    }

    /// Set the TLS mode.
    ///
    /// # Example
    /// ```
    /// use pg_outbox::{ConnectOptions, SslMode};
    /// let pg = ConnectOptions::parse("postgres://app@db/app")?.with_ssl_mode(SslMode::Require);
    /// assert_eq!(pg.ssl_mode(), SslMode::Require);
    /// # Ok::<(), pg_outbox::Error>(())
    /// ```
    pub fn with_ssl_mode(mut self, mode: SslMode) -> Self {
        self.ssl_mode = mode;
        self.synced()
    }

    /// Set the trusted roots (`sslrootcert`). [`RootCert::System`] needs
    /// [`SslMode::VerifyFull`] (connecting otherwise fails with
    /// [`Error::Config`]).
    ///
    /// # Example
    /// ```
    /// use pg_outbox::{ConnectOptions, RootCert, SslMode};
    /// let pg = ConnectOptions::parse("postgres://app@db/app")?
    ///     .with_ssl_mode(SslMode::VerifyFull)
    ///     .with_root_cert(RootCert::File("/etc/ssl/pg-ca.pem".into()));
    /// assert_eq!(pg.root_cert(), Some(&RootCert::File("/etc/ssl/pg-ca.pem".into())));
    /// # Ok::<(), pg_outbox::Error>(())
    /// ```
    pub fn with_root_cert(mut self, root: RootCert) -> Self {
        self.root_cert = Some(root);
        self
    }

    /// Set the database name (the password file, if used, is searched for
    /// this one).
    pub fn with_dbname(mut self, dbname: &str) -> Self {
        self.pg.dbname(dbname);
        self
    }

    /// Set the application name (`application_name`, shown in
    /// `pg_stat_activity`).
    pub fn with_application_name(mut self, name: &str) -> Self {
        self.pg.application_name(name);
        self
    }

    /// Where the connection goes, for messages: hosts and ports (or socket
    /// files), database, user, and `sslmode` unless every host is a Unix
    /// socket (where TLS is not used), e.g. `db:5432 (database app, user
    /// app, sslmode=verify-full)`. Never includes the password.
    pub fn describe(&self) -> String {
        if self.all_unix() {
            describe_target(&self.pg)
        } else {
            let t = describe_target(&self.pg);
            match t.strip_suffix(')') {
                Some(t) => format!("{t}, sslmode={})", self.ssl_mode),
                None => format!("{t} (sslmode={})", self.ssl_mode),
            }
        }
    }

    /// Open a session with pg-outbox's TLS rules (the `sslmode`, verified
    /// against the roots as libpq does), TCP keepalives (client side, and
    /// server side via `tcp_keepalives_*`), a connect timeout (default
    /// [`DEFAULT_CONNECT_TIMEOUT`]), the application name `pg-outbox` unless
    /// one is given, and the planner settings pg-outbox's own statements are
    /// written for (`enable_sort=off`, `jit=off`,
    /// `max_parallel_workers_per_gather=0`, before the string's own
    /// `options`, which win). The session suits pg-outbox's functions
    /// ([`crate::migrate::apply`], [`crate::status`],
    /// [`crate::dead_letters`], [`crate::retention`], [`crate::Publisher`]);
    /// for a pool serving an application's own queries, see
    /// [`ConnectOptions::tokio_postgres_config`].
    ///
    /// The connection task is spawned on the current Tokio runtime, which
    /// owns it: it ends when the returned `Client` (and every clone of its
    /// statements) is dropped or the server closes the session; its error
    /// is logged at debug level, and the client's calls fail from then on
    /// (`Client::is_closed`).
    ///
    /// # Errors
    /// [`Error::Config`] if the root certificates cannot be loaded or the
    /// mode and roots do not fit together; [`Error::Connect`] naming the
    /// target (hosts or sockets tried, database, user, sslmode) with the
    /// driver's reason (e.g. `server does not support TLS`, `certificate
    /// not valid for name ...`); [`Error::ConnectTimedOut`] when the
    /// connect timeout ran out.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes the half-open connection;
    /// nothing has been sent on it but the startup.
    ///
    /// # Example
    /// ```no_run
    /// # async fn run() -> Result<(), pg_outbox::Error> {
    /// let client = pg_outbox::ConnectOptions::parse("postgres://app@db/app?sslmode=require")?.connect().await?;
    /// client.simple_query("SELECT 1").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(&self) -> Result<Client> {
        let name = self.pg.get_application_name().unwrap_or("pg-outbox").to_string();
        let (client, _link) = connect(self, &name, &SessionSettings::default()).await?;
        Ok(client)
    }

    /// The `tokio_postgres::Config` to connect with, for a connection pool
    /// (or any `Config::connect`): hosts, ports, user, database, password
    /// (from the password file when needed), application name, TCP
    /// keepalives, the connect timeout (default [`DEFAULT_CONNECT_TIMEOUT`]),
    /// and the closest `sslmode` tokio-postgres knows: `verify-ca` and
    /// `verify-full` become `require`, so pairing this `Config` with
    /// `tokio_postgres::NoTls` refuses to connect instead of going on
    /// without TLS; `allow` becomes `disable`. Every host a Unix socket:
    /// `disable` (TLS is not used on a socket, as in libpq). No planner
    /// settings are added.
    ///
    /// Pair it with [`ConnectOptions::tls_connector`], which checks
    /// certificates as the `sslmode` says; any other connector applies its
    /// own rules instead.
    pub fn tokio_postgres_config(&self) -> Config {
        use tokio_postgres::config::SslMode as T;
        let (mut cfg, _) = self.with_password();
        cfg.keepalives(true).keepalives_idle(KEEPALIVE_IDLE);
        if cfg.get_connect_timeout().is_none() {
            cfg.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
        }
        cfg.ssl_mode(if self.all_unix() { T::Disable } else { self.ssl_mode.coarse() });
        cfg
    }

    /// The TLS connector for [`ConnectOptions::tokio_postgres_config`]: a
    /// `tokio_postgres::tls::MakeTlsConnect<Socket>` checking the server's
    /// certificate as the `sslmode` says (`verify-full`: chain and host
    /// name; `verify-ca`, or `require` with roots: the chain; otherwise
    /// nothing), for a pool such as deadpool-postgres's
    /// `Manager::from_config(opts.tokio_postgres_config(), opts.tls_connector()?, ...)`.
    ///
    /// # Errors
    /// [`Error::Config`] if the root certificates cannot be loaded (a
    /// missing or unreadable `sslrootcert` file, no system roots) or the
    /// mode needs roots and none are given.
    ///
    /// # Example
    /// What a pool does for each connection:
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let opts = pg_outbox::ConnectOptions::parse(
    ///     "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ssl/pg-ca.pem",
    /// )?;
    /// let (client, connection) = opts.tokio_postgres_config().connect(opts.tls_connector()?).await?;
    /// tokio::spawn(connection);
    /// client.simple_query("SELECT 1").await?;
    /// # Ok(()) }
    /// ```
    pub fn tls_connector(&self) -> Result<TlsConnector> {
        Ok(TlsConnector(self.tls_for_hosts()?))
    }

    /// Whether every host is a Unix socket.
    fn all_unix(&self) -> bool {
        let hosts = self.pg.get_hosts();
        !hosts.is_empty() && self.pg.get_hostaddrs().is_empty() && hosts.iter().all(|h| matches!(h, Host::Unix(_)))
    }

    /// The connector for these hosts: a Unix socket ignores the TLS settings
    /// (libpq), so a missing root certificate must not refuse one either.
    fn tls_for_hosts(&self) -> Result<MakeRustlsConnect> {
        if self.all_unix() {
            ConnectOptions { ssl_mode: SslMode::Disable, root_cert: None, ..self.clone() }.tls()
        } else {
            self.tls()
        }
    }

    /// The `Config` with the password file's password when none is given,
    /// and the file it came from.
    fn with_password(&self) -> (Config, Option<&Path>) {
        let mut cfg = self.pg.clone();
        if cfg.get_password().is_some_and(|p| !p.is_empty()) {
            return (cfg, None);
        }
        let Some(file) = self.password_file.as_deref() else { return (cfg, None) };
        let host = match (cfg.get_hosts().first(), cfg.get_hostaddrs().first()) {
            (Some(Host::Tcp(h)), _) => h.clone(),
            (Some(Host::Unix(dir)), _) if libpq::is_default_socket_dir(dir) => "localhost".to_string(),
            (Some(Host::Unix(dir)), _) => dir.display().to_string(),
            (None, Some(addr)) => addr.to_string(),
            (None, None) => "localhost".to_string(),
        };
        let port = cfg.get_ports().first().copied().unwrap_or(DEFAULT_PORT);
        let (Some(db), Some(user)) = (cfg.get_dbname(), cfg.get_user()) else { return (cfg, None) };
        match libpq::password_from_file(file, &host, port, db, user) {
            Some(pw) => {
                cfg.password(pw);
                (cfg, Some(file))
            }
            None => (cfg, None),
        }
    }

    /// Keep the tokio-postgres mode in line with ours.
    fn synced(mut self) -> Self {
        self.pg.ssl_mode(self.ssl_mode.coarse());
        self
    }

    fn check_system_roots(&self) -> Result<()> {
        if self.root_cert == Some(RootCert::System) && self.ssl_mode != SslMode::VerifyFull {
            return Err(Error::Config(format!(
                "sslrootcert=system requires sslmode=verify-full (libpq 16), got sslmode={}",
                self.ssl_mode
            )));
        }
        Ok(())
    }

    /// The root store, if certificates are to be checked.
    fn roots(&self) -> Result<Option<RootCertStore>> {
        let root = match &self.root_cert {
            Some(r) => Some(r.clone()),
            None => default_root_file().map(RootCert::File),
        };
        let needed = matches!(self.ssl_mode, SslMode::VerifyCa | SslMode::VerifyFull);
        let wanted = needed || self.ssl_mode == SslMode::Require;
        let Some(root) = root.filter(|_| wanted) else {
            if needed {
                return Err(Error::Config(format!(
                    "sslmode={} needs trusted root certificates: set sslrootcert=FILE (a PEM file of CA \
                     certificates), or sslrootcert=system, or create ~/.postgresql/root.crt",
                    self.ssl_mode
                )));
            }
            return Ok(None);
        };
        let mut store = RootCertStore::empty();
        match root {
            RootCert::System => {
                let loaded = rustls_native_certs::load_native_certs();
                let (added, _) = store.add_parsable_certificates(loaded.certs);
                if added == 0 {
                    let why: Vec<String> = loaded.errors.iter().map(ToString::to_string).collect();
                    let why = if why.is_empty() { String::new() } else { format!(": {}", why.join("; ")) };
                    return Err(Error::Config(format!("sslrootcert=system: no system root certificates found{why}")));
                }
            }
            RootCert::File(path) => load_pem_roots(&path, &mut store)?,
        }
        Ok(Some(store))
    }

    /// The rustls connector for this mode.
    fn tls(&self) -> Result<MakeRustlsConnect> {
        self.check_system_roots()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = if self.ssl_mode == SslMode::Disable { None } else { self.roots()? };
        let check = match (self.ssl_mode, roots) {
            (SslMode::VerifyFull, Some(r)) => Check::Full(webpki(r, &provider)?),
            (SslMode::VerifyCa | SslMode::Require, Some(r)) => Check::Chain(webpki(r, &provider)?),
            _ => Check::Nothing,
        };
        let verifier = Arc::new(Verifier { check, provider: provider.clone() });
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(MakeRustlsConnect::new(config))
    }
}

fn webpki(roots: RootCertStore, provider: &Arc<CryptoProvider>) -> Result<Arc<WebPkiServerVerifier>> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| Error::Config(format!("TLS root certificates: {e}")))
}

/// `~/.postgresql/root.crt` if it exists (libpq's default `sslrootcert`).
fn default_root_file() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let p = Path::new(&home).join(".postgresql").join("root.crt");
    p.is_file().then_some(p)
}

fn load_pem_roots(path: &Path, store: &mut RootCertStore) -> Result<()> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| Error::Config(format!("sslrootcert {shown}: cannot read: {e}")))?;
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        let cert = cert.map_err(|e| Error::Config(format!("sslrootcert {shown}: not a PEM certificate file: {e}")))?;
        store.add(cert).map_err(|e| Error::Config(format!("sslrootcert {shown}: unusable certificate: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(Error::Config(format!(
            "sslrootcert {shown}: no certificate found (expected PEM, BEGIN CERTIFICATE)"
        )));
    }
    Ok(())
}

/// What the server's certificate is checked for.
#[derive(Debug)]
enum Check {
    /// Nothing (libpq `prefer`, `allow`, `require` without a root).
    Nothing,
    /// The chain to a trusted root, not the name (`verify-ca`).
    Chain(Arc<WebPkiServerVerifier>),
    /// Chain and host name (`verify-full`).
    Full(Arc<WebPkiServerVerifier>),
}

/// Certificate checks by sslmode; handshake signatures are always checked.
#[derive(Debug)]
struct Verifier {
    check: Check,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match &self.check {
            Check::Nothing => Ok(ServerCertVerified::assertion()),
            Check::Full(v) => v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now),
            // The name is checked after the chain (rustls's WebPkiServerVerifier),
            // so a name error means the chain is good.
            Check::Chain(v) => match v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            },
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

const TLS_KEYS: [&str; 2] = ["sslmode", "sslrootcert"];

/// Take `sslmode` and `sslrootcert` out of a URL's query string.
fn take_tls_params_url(url: &str) -> (String, Option<String>, Option<String>) {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => return (url.to_string(), None, None),
    };
    let (mut mode, mut root) = (None, None);
    let mut kept = Vec::new();
    for part in query.split('&') {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        let key = percent_encoding::percent_decode_str(k).decode_utf8_lossy();
        let value = || percent_encoding::percent_decode_str(v).decode_utf8_lossy().into_owned();
        match key.as_ref() {
            "sslmode" => mode = Some(value()),
            "sslrootcert" => root = Some(value()),
            _ => kept.push(part),
        }
    }
    let rest = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    (rest, mode, root)
}

/// Take `sslmode` and `sslrootcert` out of a libpq key=value string
/// (`key = value`, values optionally single-quoted with `\'` and `\\`
/// escapes; libpq "Keyword/Value Connection Strings").
fn take_tls_params_kv(s: &str) -> Result<(String, Option<String>, Option<String>)> {
    let b = s.as_bytes();
    let (mut mode, mut root) = (None, None);
    let mut rest = String::new();
    let mut i = skip_ws(b, 0);
    while i < b.len() {
        let start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &s[start..i];
        i = skip_ws(b, i);
        if i >= b.len() || b[i] != b'=' {
            // Not key=value: let tokio-postgres report it.
            return Ok((s.to_string(), None, None));
        }
        let (value, end, terminated) = kv_value(s, skip_ws(b, i + 1));
        if !terminated && TLS_KEYS.contains(&key) {
            return Err(Error::Config(format!("invalid connection string: unterminated quote in {key}")));
        }
        match key {
            "sslmode" => mode = Some(value),
            "sslrootcert" => root = Some(value),
            _ => {
                rest.push_str(&s[start..end]);
                rest.push(' ');
            }
        }
        i = skip_ws(b, end);
    }
    Ok((rest.trim_end().to_string(), mode, root))
}

/// The first byte at or after `i` that is not ASCII whitespace.
fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The key=value value starting at byte `i` of `s`: single-quoted (with
/// `\'` and `\\` escapes) or up to the next whitespace (with `\`
/// escapes). Returns the value, the byte after it, and whether a quote that
/// was opened was closed.
fn kv_value(s: &str, mut i: usize) -> (String, usize, bool) {
    let b = s.as_bytes();
    let quoted = i < b.len() && b[i] == b'\'';
    if quoted {
        i += 1;
    }
    let char_at = |i: usize| s[i..].chars().next().unwrap_or('\u{fffd}');
    let mut value = String::new();
    while i < b.len() {
        match b[i] {
            b'\'' if quoted => return (value, i + 1, true),
            c if !quoted && c.is_ascii_whitespace() => break,
            b'\\' if i + 1 < b.len() => {
                let ch = char_at(i + 1);
                value.push(ch);
                i += 1 + ch.len_utf8();
            }
            _ => {
                let ch = char_at(i);
                value.push(ch);
                i += ch.len_utf8();
            }
        }
    }
    (value, i, !quoted)
}

/// PostgreSQL's default port.
const DEFAULT_PORT: u16 = 5432;

/// A string's settings, syntax only (no environment): the tokio-postgres
/// part, and `sslmode` and `sslrootcert` as given.
fn parse_string(s: &str) -> Result<(Config, Option<String>, Option<String>)> {
    let trimmed = s.trim_start();
    let (rest, mode, root) = if let Some((scheme, _)) = trimmed.split_once("://") {
        if scheme != "postgres" && scheme != "postgresql" {
            return Err(Error::Config(format!(
                "invalid database URL: scheme `{scheme}://` is not PostgreSQL; write postgres://user@host:5432/dbname"
            )));
        }
        take_tls_params_url(trimmed)
    } else {
        take_tls_params_kv(s)?
    };
    let pg = rest.parse::<Config>().map_err(Error::InvalidUrl)?;
    Ok((pg, mode, root))
}

/// Whether `s` is a connection string pg-outbox can parse (its syntax; the
/// environment is not read).
pub(crate) fn parses(s: &str) -> bool {
    parse_string(s).is_ok()
}

/// Fill what the string left unset from the `PG*` variables of `env`, then
/// libpq's defaults (PostgreSQL docs, libpq "Environment Variables" and
/// "Parameter Key Words"). TLS settings and the password file are the
/// caller's.
fn fill_from_env(pg: &mut Config, env: libpq::Lookup<'_>) -> Result<()> {
    if pg.get_hosts().is_empty() && pg.get_hostaddrs().is_empty() {
        match env("PGHOST") {
            Some(hosts) => {
                for h in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
                    // A value starting with `/` is a socket directory.
                    pg.host(h);
                }
            }
            None => default_hosts(pg),
        }
        if pg.get_hosts().is_empty() {
            default_hosts(pg);
        }
    }
    if pg.get_ports().is_empty()
        && let Some(ports) = env("PGPORT")
    {
        for p in ports.split(',').map(str::trim) {
            let port = p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                Error::Config(format!(
                    "invalid PGPORT `{ports}`: expected a port number (1-65535), or several, comma separated"
                ))
            })?;
            pg.port(port);
        }
    }
    if pg.get_user().is_none() {
        match env("PGUSER").or_else(libpq::os_user) {
            Some(u) => {
                pg.user(u);
            }
            None => {
                return Err(Error::Config(
                    "no user name given and the operating system user's name cannot be read: \
                     set user= in the connection string, or PGUSER"
                        .into(),
                ));
            }
        }
    }
    if pg.get_password().is_none()
        && let Some(pw) = env("PGPASSWORD")
    {
        pg.password(pw);
    }
    if pg.get_dbname().is_none() {
        let db = env("PGDATABASE").or_else(|| pg.get_user().map(str::to_owned));
        if let Some(db) = db {
            pg.dbname(db);
        }
    }
    if pg.get_application_name().is_none()
        && let Some(name) = env("PGAPPNAME")
    {
        pg.application_name(name);
    }
    if pg.get_connect_timeout().is_none()
        && let Some(t) = env("PGCONNECT_TIMEOUT")
    {
        let secs = t.trim().parse::<i64>().map_err(|_| {
            Error::Config(format!("invalid PGCONNECT_TIMEOUT `{t}`: expected whole seconds (0 or less: no limit)"))
        })?;
        // As tokio-postgres's `connect_timeout`: 0 or less sets none.
        if let Ok(secs @ 1..) = u64::try_from(secs) {
            pg.connect_timeout(Duration::from_secs(secs));
        }
    }
    Ok(())
}

/// libpq's default host: the Unix socket directories (see
/// [`libpq::default_socket_dirs`]), or `localhost` where there are no Unix
/// sockets.
fn default_hosts(pg: &mut Config) {
    #[cfg(unix)]
    for dir in libpq::default_socket_dirs() {
        pg.host_path(dir);
    }
    #[cfg(not(unix))]
    pg.host("localhost");
}

/// Where a config connects to, for messages: each host with its port (a
/// socket as its file, `/var/run/postgresql/.s.PGSQL.5432`), then the
/// database and user: `db:5432 (database app, user app)`, `socket
/// /var/run/postgresql/.s.PGSQL.5432 or /tmp/.s.PGSQL.5432 (database app,
/// user app)`. Never includes the password.
#[doc(hidden)]
pub fn describe_target(cfg: &Config) -> String {
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
fn failure_notes(cfg: &Config, password_file: Option<&Path>, e: &tokio_postgres::Error) -> Vec<String> {
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
fn with_notes(target: String, notes: &[String]) -> String {
    if notes.is_empty() {
        return target;
    }
    match target.strip_suffix(')') {
        Some(t) => format!("{t}; {})", notes.join("; ")),
        None => format!("{target} ({})", notes.join("; ")),
    }
}

/// TLS for tokio-postgres with pg-outbox's `sslmode` rules, from
/// [`ConnectOptions::tls_connector`]: for a pool (or `Config::connect`)
/// with the `Config` of [`ConnectOptions::tokio_postgres_config`].
/// rustls with the ring provider; handshake signatures are always checked,
/// certificates as the `sslmode` says.
#[derive(Clone)]
pub struct TlsConnector(MakeRustlsConnect);

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector").finish_non_exhaustive()
    }
}

impl MakeTlsConnect<Socket> for TlsConnector {
    type Stream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;
    type TlsConnect = <MakeRustlsConnect as MakeTlsConnect<Socket>>::TlsConnect;
    type Error = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> std::result::Result<Self::TlsConnect, Self::Error> {
        MakeTlsConnect::<Socket>::make_tls_connect(&mut self.0, domain)
    }
}

/// The TLS stream type of our connections.
pub(crate) type TlsStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// A spawned connection task, a token cancelled the moment it ends (the
/// server closed the session, the network broke, or it was aborted), and
/// what cancels the session's running statement.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) handle: JoinHandle<()>,
    pub(crate) closed: tokio_util::sync::CancellationToken,
    pub(crate) canceller: Canceller,
}

/// Settings of one kind of session beyond those of every session, sent as
/// startup options before the URL's own `options` (which therefore win).
/// The default adds nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SessionSettings {
    /// `statement_timeout` (zero disables it, as in PostgreSQL); `None`
    /// leaves the server's, role's or URL's setting alone.
    pub(crate) statement_timeout: Option<Duration>,
    /// Send `client_connection_check_interval` =
    /// [`CLIENT_CONNECTION_CHECK_INTERVAL`]. A server older than PostgreSQL
    /// 14 refuses the unknown setting at startup; the connection is then
    /// made again without it.
    pub(crate) check_client_connection: bool,
}

impl SessionSettings {
    /// The startup options, `-c name=value` each; with or without the
    /// connection check.
    pub(crate) fn options(&self, with_check: bool) -> String {
        let mut out = Vec::new();
        if let Some(t) = self.statement_timeout {
            out.push(format!("-c statement_timeout={}", setting_millis(t)));
        }
        if with_check && self.check_client_connection {
            out.push(format!(
                "-c client_connection_check_interval={}",
                setting_millis(CLIENT_CONNECTION_CHECK_INTERVAL)
            ));
        }
        out.join(" ")
    }
}

/// A duration as the whole milliseconds of a server setting whose unit is
/// ms: rounded up (500 us is 1 ms, not 0, which would turn a timeout off),
/// at most `i32::MAX` (the largest such setting the server takes).
pub(crate) fn setting_millis(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX).min(i32::MAX as u64)
}

/// Sends cancel requests for the statement a session is running
/// (PostgreSQL docs, "Canceling Requests in Progress"), over a connection of
/// its own with the session's TLS settings.
#[derive(Clone)]
pub(crate) struct Canceller {
    token: tokio_postgres::CancelToken,
    tls: MakeRustlsConnect,
}

impl fmt::Debug for Canceller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Canceller").finish_non_exhaustive()
    }
}

impl Canceller {
    /// Ask the server to cancel the statement the session runs now, waiting
    /// at most [`CANCEL_REQUEST_TIMEOUT`]. Cancelling is racy by nature: a
    /// statement that ends first is not affected, but one sent right after
    /// may be, so a session is not used again after a cancel it may not have
    /// answered. Returns whether the request was sent; a failure is logged
    /// at debug level (the server may be gone, which ends the statement too).
    pub(crate) async fn cancel(&self) -> bool {
        match tokio::time::timeout(CANCEL_REQUEST_TIMEOUT, self.token.cancel_query(self.tls.clone())).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::debug!(error = %crate::error::report(&e), "cancel request failed");
                false
            }
            Err(_) => {
                tracing::debug!(timeout = ?CANCEL_REQUEST_TIMEOUT, "cancel request timed out");
                false
            }
        }
    }
}

/// Open a connection as `opts` says (TLS included), with our application
/// name, keepalives, a connect timeout and `settings`; do not spawn it.
/// Returns the client, its connection and its [`Canceller`].
///
/// `allow` tries without TLS and then with it; `prefer` asks for TLS and
/// goes on without if the server declines; a Unix socket never uses TLS
/// (as libpq).
pub(crate) async fn open(
    opts: &ConnectOptions,
    application_name: &str,
    settings: &SessionSettings,
) -> Result<(Client, Connection<Socket, TlsStream>, Canceller)> {
    use tokio_postgres::config::SslMode as T;
    let (with_password, password_file) = opts.with_password();
    let base = prepared(&with_password, application_name);
    let all_unix = opts.all_unix();
    let tls = opts.tls_for_hosts()?;
    let attempts: &[T] = match opts.ssl_mode {
        _ if all_unix => &[T::Disable],
        SslMode::Disable => &[T::Disable],
        SslMode::Allow => &[T::Disable, T::Require],
        SslMode::Prefer => &[T::Prefer],
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => &[T::Require],
    };
    let mut last = None;
    // tokio-postgres bounds only the TCP connect by `connect_timeout`; a
    // server that accepts and then never answers would hang the startup
    // exchange forever. The whole attempt gets the same bound (libpq's
    // `connect_timeout` is "maximum time to wait while connecting").
    let bound = base.get_connect_timeout().copied().unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    // With the connection check first; without it if the server does not
    // know the setting (PostgreSQL 13 or older: "unrecognized configuration
    // parameter", SQLSTATE 42704, at startup).
    let variants: &[bool] = if settings.check_client_connection { &[true, false] } else { &[false] };
    for &with_check in variants {
        let mut cfg = with_session_options(&base, &settings.options(with_check));
        let mut unknown_setting = false;
        for mode in attempts {
            cfg.ssl_mode(*mode);
            let Ok(attempt) = tokio::time::timeout(bound, cfg.connect(tls.clone())).await else {
                return Err(Error::ConnectTimedOut { target: opts.describe(), after: bound });
            };
            match attempt {
                Ok((client, connection)) => {
                    let canceller = Canceller { token: client.cancel_token(), tls: tls.clone() };
                    return Ok((client, connection, canceller));
                }
                Err(e) => {
                    tracing::debug!(target_db = %opts.describe(), error = %crate::error::report(&e), "connection attempt failed");
                    unknown_setting |=
                        with_check && e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT);
                    last = Some(e);
                }
            }
        }
        if !unknown_setting {
            break;
        }
        tracing::debug!(target_db = %opts.describe(),
            "the server does not know client_connection_check_interval (PostgreSQL 13 or older); connecting without it");
    }
    match last {
        Some(source) => {
            let target = with_notes(opts.describe(), &failure_notes(&base, password_file, &source));
            Err(Error::Connect { target, source })
        }
        None => Err(Error::Config("no connection attempt made".into())),
    }
}

/// Connect with the given application name (visible in `pg_stat_activity`),
/// TLS as configured, TCP keepalives and a connect timeout; spawn the
/// connection task and return its [`Link`] (its error is logged when it
/// ends with one).
///
/// Used for the work connection. The LISTEN connection is driven by the
/// notifier itself (see `consumer::source::notifier`).
pub(crate) async fn connect(
    opts: &ConnectOptions,
    application_name: &str,
    settings: &SessionSettings,
) -> Result<(Client, Link)> {
    let (client, connection, canceller) = open(opts, application_name, settings).await?;
    let name = application_name.to_string();
    let closed = tokio_util::sync::CancellationToken::new();
    let guard = closed.clone().drop_guard();
    let handle = tokio::spawn(async move {
        let _guard = guard;
        if let Err(e) = connection.await {
            tracing::debug!(connection = %name, error = %e, "connection ended");
        }
    });
    Ok((client, Link { handle, closed, canceller }))
}

/// `base`'s options with `extra` in front, so that `base`'s (ours of every
/// session, then the URL's) come later and win.
fn with_session_options(base: &Config, extra: &str) -> Config {
    let mut cfg = base.clone();
    match base.get_options() {
        _ if extra.is_empty() => {}
        Some(o) if !o.is_empty() => {
            cfg.options(format!("{extra} {o}"));
        }
        _ => {
            cfg.options(extra);
        }
    }
    cfg
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
    // Ours first: a later `-c` of the URL's own options overrides them.
    let ours = format!("{SERVER_KEEPALIVES} {PLANNER_SETTINGS}");
    let options = match cfg.get_options() {
        Some(o) => format!("{ours} {o}"),
        None => ours,
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

    /// Parse with an empty environment.
    fn parse_url(s: &str) -> Result<ConnectOptions> {
        ConnectOptions::parse_with(s, &|_| None)
    }

    #[test]
    fn prepared_sets_keepalives_and_planner_settings_and_keeps_user_options() {
        let ours = format!("{SERVER_KEEPALIVES} {PLANNER_SETTINGS}");
        let cfg = prepared(&parse_url("postgres://u@h/db").expect("url").pg, "app");
        assert_eq!(cfg.get_options(), Some(ours.as_str()));
        assert_eq!(cfg.get_application_name(), Some("app"));
        assert!(cfg.get_keepalives());
        let cfg = prepared(&parse_url("host=h user=u options='-c search_path=x'").expect("url").pg, "app");
        assert_eq!(cfg.get_options(), Some(format!("{ours} -c search_path=x").as_str()));
        // The URL's own settings come last, so they win.
        let mine = "-c tcp_keepalives_idle=5";
        let cfg = prepared(&parse_url(&format!("host=h user=u options='{mine}'")).expect("url").pg, "app");
        assert_eq!(cfg.get_options(), Some(format!("{ours} {mine}").as_str()));
    }

    #[test]
    fn tls_settings_are_taken_out_of_urls() {
        let o = parse_url("postgres://u@h/db?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem&application_name=x")
            .expect("url");
        assert_eq!(o.ssl_mode(), SslMode::VerifyFull);
        assert_eq!(o.root_cert(), Some(&RootCert::File("/tmp/ca.pem".into())));
        assert_eq!(o.application_name(), Some("x"));
        assert_eq!(o.tokio_postgres_config().get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        let o = parse_url("postgres://u@h/db").expect("url");
        assert_eq!(o.ssl_mode(), SslMode::Prefer);
        assert_eq!(o.root_cert(), None);
        let o = parse_url("postgres://u@h/db?sslrootcert=system").expect("url");
        assert_eq!((o.ssl_mode(), o.root_cert()), (SslMode::VerifyFull, Some(&RootCert::System)));
        let e = parse_url("postgres://u@h/db?sslrootcert=system&sslmode=require").expect_err("weaker than verify-full");
        assert!(e.to_string().contains("sslrootcert=system requires sslmode=verify-full"), "{e}");
        let e = parse_url("postgres://u@h/db?sslmode=verify").expect_err("unknown mode");
        assert!(e.to_string().contains("invalid sslmode `verify`"), "{e}");
        let o = parse_url("postgres://u@h/db?sslmode=allow").expect("url");
        assert_eq!(o.ssl_mode(), SslMode::Allow);
    }

    #[test]
    fn tls_settings_are_taken_out_of_key_value_strings() {
        let o = parse_url("host=h sslmode = verify-ca user=u sslrootcert='/tmp/my ca\\'s.pem' dbname=d").expect("kv");
        assert_eq!(o.ssl_mode(), SslMode::VerifyCa);
        assert_eq!(o.root_cert(), Some(&RootCert::File("/tmp/my ca's.pem".into())));
        assert_eq!((o.user(), o.dbname()), (Some("u"), Some("d")));
        let o = parse_url("host=h options='-c a=b' sslmode=disable").expect("kv");
        assert_eq!(o.ssl_mode(), SslMode::Disable);
        assert_eq!(o.pg.get_options(), Some("-c a=b"));
        let o = parse_url("host=h sslmode=require").expect("kv");
        assert_eq!(o.ssl_mode(), SslMode::Require);
    }

    #[test]
    fn verify_modes_need_roots() {
        let o = parse_url("postgres://u@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem").expect("url");
        let Err(e) = o.tls() else { panic!("a missing sslrootcert file must fail") };
        assert!(e.to_string().contains("sslrootcert /nonexistent/ca.pem: cannot read"), "{e}");
    }

    #[test]
    fn other_schemes_are_named() {
        let e = parse_url("mysql://u@h/db").expect_err("not postgres");
        assert!(e.to_string().contains("mysql://"), "{e}");
        let secret = parse_url("postgres://u:s3cret@h:notaport/db").expect_err("bad port");
        assert!(!crate::error::report(&secret).contains("s3cret"));
    }

    #[test]
    fn session_settings_come_before_the_urls_options() {
        let s = SessionSettings { statement_timeout: Some(Duration::from_millis(200)), check_client_connection: true };
        assert_eq!(s.options(true), "-c statement_timeout=200 -c client_connection_check_interval=5000");
        assert_eq!(s.options(false), "-c statement_timeout=200");
        assert_eq!(SessionSettings::default().options(true), "");
        let off = SessionSettings { statement_timeout: Some(Duration::ZERO), check_client_connection: false };
        assert_eq!(off.options(true), "-c statement_timeout=0");
        let base = prepared(&parse_url("host=h user=u options='-c statement_timeout=0'").expect("url").pg, "app");
        let cfg = with_session_options(&base, &s.options(true));
        let o = cfg.get_options().expect("options");
        assert!(o.starts_with("-c statement_timeout=200 -c client_connection_check_interval=5000 "), "{o}");
        assert!(o.ends_with("-c statement_timeout=0"), "the URL's own setting comes last, so it wins: {o}");
        assert_eq!(with_session_options(&base, "").get_options(), base.get_options());
        assert_eq!(setting_millis(Duration::from_micros(500)), 1, "rounded up, never to 0 (off)");
        assert_eq!(setting_millis(Duration::ZERO), 0);
        assert_eq!(setting_millis(Duration::from_secs(60)), 60_000);
        assert_eq!(setting_millis(Duration::from_secs(u64::MAX)), i32::MAX as u64);
    }
}

#[cfg(test)]
mod env_tests {
    //! libpq's variables, defaults and password file, with the variables
    //! from a map (the process environment is neither read nor changed).

    use super::*;

    fn parse_in(s: &str, vars: &[(&str, &str)]) -> Result<ConnectOptions> {
        let env = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        ConnectOptions::parse_with(s, &env)
    }

    fn password(o: &ConnectOptions) -> Option<String> {
        o.tokio_postgres_config().get_password().map(|p| String::from_utf8_lossy(p).into_owned())
    }

    fn tcp(h: &str) -> Host {
        Host::Tcp(h.to_string())
    }

    fn default_sockets() -> Vec<Host> {
        libpq::default_socket_dirs().into_iter().map(Host::Unix).collect()
    }

    const ALL: [(&str, &str); 9] = [
        ("PGHOST", "db.example.com"),
        ("PGPORT", "6543"),
        ("PGUSER", "envuser"),
        ("PGPASSWORD", "envpw"),
        ("PGDATABASE", "envdb"),
        ("PGSSLMODE", "verify-ca"),
        ("PGSSLROOTCERT", "/env/ca.pem"),
        ("PGAPPNAME", "envapp"),
        ("PGCONNECT_TIMEOUT", "7"),
    ];

    #[test]
    fn each_variable_fills_its_setting() {
        let o = parse_in("", &ALL).expect("variables alone");
        assert_eq!(o.hosts(), &[tcp("db.example.com")]);
        assert_eq!(o.ports(), &[6543]);
        assert_eq!(o.user(), Some("envuser"));
        assert_eq!(password(&o).as_deref(), Some("envpw"));
        assert_eq!(o.dbname(), Some("envdb"));
        assert_eq!(o.ssl_mode(), SslMode::VerifyCa);
        assert_eq!(o.root_cert(), Some(&RootCert::File("/env/ca.pem".into())));
        assert_eq!(o.application_name(), Some("envapp"));
        assert_eq!(o.connect_timeout(), Some(Duration::from_secs(7)));
    }

    #[test]
    fn the_strings_fields_win_over_the_variables() {
        for s in [
            "postgres://u:p@h:1/d?sslmode=disable&sslrootcert=/s/ca.pem&application_name=a&connect_timeout=3",
            "host=h port=1 user=u password=p dbname=d sslmode=disable sslrootcert=/s/ca.pem application_name=a \
             connect_timeout=3",
        ] {
            let o = parse_in(s, &ALL).expect("string");
            assert_eq!(o.hosts(), &[tcp("h")], "{s}");
            assert_eq!(o.ports(), &[1], "{s}");
            assert_eq!(o.user(), Some("u"), "{s}");
            assert_eq!(password(&o).as_deref(), Some("p"), "{s}");
            assert_eq!(o.dbname(), Some("d"), "{s}");
            assert_eq!(o.ssl_mode(), SslMode::Disable, "{s}");
            assert_eq!(o.root_cert(), Some(&RootCert::File("/s/ca.pem".into())), "{s}");
            assert_eq!(o.application_name(), Some("a"), "{s}");
            assert_eq!(o.connect_timeout(), Some(Duration::from_secs(3)), "{s}");
        }
        // Field by field: what the string leaves out comes from the variables.
        let o = parse_in("postgres://u@/d", &ALL).expect("hostless");
        assert_eq!((o.hosts(), o.ports()), (&[tcp("db.example.com")][..], &[6543][..]));
        assert_eq!((o.user(), o.dbname()), (Some("u"), Some("d")));
        assert_eq!(password(&o).as_deref(), Some("envpw"));
        assert_eq!(o.ssl_mode(), SslMode::VerifyCa);
    }

    #[test]
    fn hostless_strings_use_pghost_else_the_unix_socket() {
        let os_user = libpq::os_user().expect("the OS user's name");
        for s in ["postgres://postgres@/app", "dbname=app user=postgres", "postgresql://postgres@/app"] {
            let o = parse_in(s, &[]).expect(s);
            assert_eq!(o.hosts(), &default_sockets()[..], "{s}");
            assert!(o.ports().is_empty(), "{s}: 5432");
            assert_eq!((o.user(), o.dbname()), (Some("postgres"), Some("app")), "{s}");
            let o = parse_in(s, &[("PGHOST", "127.0.0.1")]).expect(s);
            assert_eq!(o.hosts(), &[tcp("127.0.0.1")], "{s}");
            let o = parse_in(s, &[("PGHOST", "/run/pg")]).expect(s);
            assert_eq!(o.hosts(), &[Host::Unix("/run/pg".into())], "{s}: a directory is a socket");
        }
        // No user given: PGUSER, else the OS user; no database: PGDATABASE, else the user.
        let o = parse_in("postgres:///app", &[]).expect("no user");
        assert_eq!((o.user(), o.dbname()), (Some(os_user.as_str()), Some("app")));
        let o = parse_in("", &[]).expect("nothing at all");
        assert_eq!(o.hosts(), &default_sockets()[..]);
        assert_eq!((o.user(), o.dbname()), (Some(os_user.as_str()), Some(os_user.as_str())));
        assert_eq!(o.ssl_mode(), SslMode::Prefer);
        let o = parse_in("host=h", &[("PGUSER", "alice")]).expect("PGUSER");
        assert_eq!((o.user(), o.dbname()), (Some("alice"), Some("alice")));
        let o = parse_in("user=bob host=h", &[("PGUSER", "alice")]).expect("user wins");
        assert_eq!((o.user(), o.dbname()), (Some("bob"), Some("bob")));
        // hostaddr alone is a host, as in libpq.
        let o = parse_in("hostaddr=127.0.0.1 user=u", &[("PGHOST", "elsewhere")]).expect("hostaddr");
        assert!(o.hosts().is_empty());
        // Several hosts and ports.
        let o = parse_in("user=u", &[("PGHOST", "/sock, h2"), ("PGPORT", "5433,5434")]).expect("lists");
        assert_eq!(o.hosts(), &[Host::Unix("/sock".into()), tcp("h2")]);
        assert_eq!(o.ports(), &[5433, 5434]);
    }

    #[test]
    fn bad_variables_are_named() {
        for (var, value, needle) in [
            ("PGPORT", "abc", "invalid PGPORT `abc`"),
            ("PGPORT", "0", "invalid PGPORT `0`"),
            ("PGPORT", "5432,x", "invalid PGPORT `5432,x`"),
            ("PGSSLMODE", "bogus", "invalid sslmode `bogus`"),
            ("PGCONNECT_TIMEOUT", "soon", "invalid PGCONNECT_TIMEOUT `soon`"),
        ] {
            let e = parse_in("host=h user=u", &[(var, value)]).expect_err(var);
            assert!(e.to_string().contains(needle), "{var}={value}: {e}");
        }
        let o = parse_in("host=h user=u", &[("PGCONNECT_TIMEOUT", "0")]).expect("0 sets none");
        assert_eq!(o.connect_timeout(), None);
        let o = parse_in("host=h user=u", &[("PGSSLROOTCERT", "system")]).expect("system roots");
        assert_eq!(o.ssl_mode(), SslMode::VerifyFull, "sslrootcert=system makes verify-full the default");
        let e = parse_in("host=h user=u", &[("PGSSLROOTCERT", "system"), ("PGSSLMODE", "require")]).expect_err("weak");
        assert!(e.to_string().contains("sslrootcert=system requires sslmode=verify-full"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn the_password_file_supplies_a_missing_password() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("pgpass");
        std::fs::write(
            &file,
            "localhost:5432:app:postgres:sockpw\ndb.example.com:6543:*:app:tcppw\n/run/pg:*:*:*:dirpw\n",
        )
        .expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let path = file.display().to_string();
        let env = [("PGPASSFILE", path.as_str())];
        // A socket in a default directory matches `localhost`.
        assert_eq!(password(&parse_in("postgres://postgres@/app", &env).expect("url")).as_deref(), Some("sockpw"));
        assert_eq!(
            password(&parse_in("postgres://app@db.example.com:6543/x", &env).expect("url")).as_deref(),
            Some("tcppw")
        );
        // Another socket directory matches as its path.
        assert_eq!(password(&parse_in("host=/run/pg user=u", &env).expect("kv")).as_deref(), Some("dirpw"));
        // A password given, in the string or PGPASSWORD, wins over the file.
        let given = parse_in("postgres://app:given@db.example.com:6543/x", &env).expect("url");
        assert_eq!(password(&given).as_deref(), Some("given"));
        let from_var =
            parse_in("postgres://app@db.example.com:6543/x", &[env[0], ("PGPASSWORD", "envpw")]).expect("url");
        assert_eq!(password(&from_var).as_deref(), Some("envpw"));
        // No matching line; and the database changed after parsing is the one matched.
        let o = parse_in("postgres://postgres@/other", &env).expect("url");
        assert_eq!(password(&o), None);
        assert_eq!(password(&o.with_dbname("app")).as_deref(), Some("sockpw"));
        // HOME/.pgpass is the default.
        std::fs::copy(&file, dir.path().join(".pgpass")).expect("copy");
        let home = dir.path().display().to_string();
        let o = parse_in("postgres://postgres@/app", &[("HOME", home.as_str())]).expect("url");
        assert_eq!(password(&o).as_deref(), Some("sockpw"));
    }

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

    #[test]
    fn the_pool_config_keeps_the_tls_rules() {
        use tokio_postgres::config::SslMode as T;
        let mode = |s: &str| parse_in(s, &[]).expect("url").tokio_postgres_config().get_ssl_mode();
        assert_eq!(mode("host=h user=u sslmode=verify-full sslrootcert=/ca.pem"), T::Require);
        assert_eq!(mode("host=h user=u sslmode=verify-ca sslrootcert=/ca.pem"), T::Require);
        assert_eq!(mode("host=h user=u sslmode=require"), T::Require);
        assert_eq!(mode("host=h user=u"), T::Prefer);
        assert_eq!(mode("host=h user=u sslmode=allow"), T::Disable);
        assert_eq!(mode("host=/run/pg user=u sslmode=verify-full"), T::Disable, "no TLS on a socket (libpq)");
        let cfg = parse_in("host=h user=u", &[]).expect("url").tokio_postgres_config();
        assert!(cfg.get_keepalives());
        assert_eq!(cfg.get_connect_timeout(), Some(&DEFAULT_CONNECT_TIMEOUT));
        assert_eq!(cfg.get_options(), None, "no planner settings for an application's pool");
        // A socket needs no roots, even with verify-full.
        let o = parse_in("host=/run/pg user=u sslmode=verify-full", &[]).expect("kv");
        assert!(o.tls_connector().is_ok());
        let o = parse_in("host=h user=u sslmode=verify-full", &[("HOME", "/nonexistent")]).expect("kv");
        let e = o.tls_connector().expect_err("verify-full needs roots");
        assert!(e.to_string().contains("needs trusted root certificates"), "{e}");
    }
}

//! [`ConnectOptions`]: connection settings resolved as libpq resolves them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::env::{DEFAULT_PORT, fill_from_env};
use super::libpq;
use super::parse::parse_string;
use super::session::{SessionSettings, client_liveness, connect};
use super::target::describe_target;
use super::{RootCert, SslMode, TlsConnector};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;

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
/// use pg_outbox::ConnectOptions;
/// use pg_outbox::tls::SslMode;
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
    pub(super) pg: Config,
    pub(super) ssl_mode: SslMode,
    pub(super) root_cert: Option<RootCert>,
    /// Where a missing password is looked up when connecting.
    pub(super) password_file: Option<PathBuf>,
}

impl ConnectOptions {
    /// Default connect timeout when the URL sets none: 10 seconds, for each
    /// host of a multi-host URL apart (as libpq's `connect_timeout`). A host
    /// that never answers (a dead VM, a dropped route) costs that long before
    /// the next host is tried, at every connect: with a multi-host URL for
    /// failover, set a shorter one (`connect_timeout=2`).
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// in seconds). Without one, [`ConnectOptions::DEFAULT_CONNECT_TIMEOUT`] applies. It
    /// bounds each host of a multi-host URL apart (as in libpq), from the
    /// TCP connect to the end of the startup exchange.
    pub fn connect_timeout(&self) -> Option<Duration> {
        self.pg.get_connect_timeout().copied()
    }

    /// Set the TLS mode.
    ///
    /// # Example
    /// ```
    /// use pg_outbox::ConnectOptions;
    /// use pg_outbox::tls::SslMode;
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
    /// use pg_outbox::ConnectOptions;
    /// use pg_outbox::tls::{RootCert, SslMode};
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
    /// [`ConnectOptions::DEFAULT_CONNECT_TIMEOUT`]), the application name `pg-outbox` unless
    /// one is given, and the planner settings pg-outbox's own statements are
    /// written for (`enable_sort=off`, `jit=off`,
    /// `max_parallel_workers_per_gather=0`, before the string's own
    /// `options`, which win; a pooler that refuses startup options, such as
    /// PgBouncer, gets a session without them, and without these settings:
    /// a `SET` would outlive the transaction on a transaction-mode pooler's
    /// server session). The session suits pg-outbox's functions
    /// ([`crate::migrate::apply`], [`crate::status::read`],
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
    /// The hosts of a multi-host URL (`postgres://a:5432,b:5432/app`,
    /// `host=a,b`) are tried in turn (shuffled with
    /// `load_balance_hosts=random`), each within the connect timeout, from
    /// its TCP connect to the end of its startup exchange: a host that
    /// never answers costs that long, then the next is tried (libpq's rule;
    /// tokio-postgres alone bounds only the TCP connect). With
    /// `target_session_attrs=read-write`, a standby or a read-only server
    /// is passed over for the next host, as in libpq.
    ///
    /// # Errors
    /// [`Error::Config`] if the root certificates cannot be loaded or the
    /// mode and roots do not fit together, or when the numbers of hosts and
    /// ports do not fit; [`Error::Connect`] naming the
    /// target (hosts or sockets tried, database, user, sslmode, and with
    /// several hosts what each answered) with the
    /// driver's reason (e.g. `server does not support TLS`, `certificate
    /// not valid for name ...`); [`Error::ConnectTimedOut`] when the
    /// connect timeout ran out on every host; with
    /// `target_session_attrs=read-write`, [`Error::ReadOnlyStandby`] or
    /// [`Error::ReadOnlyServer`] as for [`ConnectOptions::connect_primary`].
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

    /// Open a session as [`ConnectOptions::connect`] does, on a server that
    /// accepts writes: a hot standby (in recovery), or a server whose
    /// sessions are read-only (`default_transaction_read_only`), is refused
    /// as `target_session_attrs=read-write` refuses it, and the next host of
    /// a multi-host URL is tried. For a session that publishes or changes
    /// events, so that a URL pointing at a standby fails at once, in a
    /// sentence that says what to do, rather than at the first write.
    ///
    /// PostgreSQL 14 and later say at startup whether they are a standby
    /// (`in_hot_standby`), so this costs nothing there; an older server (or
    /// a pooler that does not pass the setting on) gets one query,
    /// `SELECT pg_is_in_recovery(), current_setting('transaction_read_only')`.
    ///
    /// # Errors
    /// As [`ConnectOptions::connect`]; [`Error::ReadOnlyStandby`] when the
    /// server (every host that answered) is a hot standby, naming it and
    /// what the other hosts answered; [`Error::ReadOnlyServer`] when none
    /// is a standby but every one refuses writes.
    ///
    /// # Cancel safety
    /// As [`ConnectOptions::connect`].
    ///
    /// # Example
    /// ```no_run
    /// # async fn run() -> Result<(), pg_outbox::Error> {
    /// let opts = pg_outbox::ConnectOptions::parse("postgres://app@db-a,db-b/app?connect_timeout=3")?;
    /// let client = opts.connect_primary().await?; // db-a or db-b, whichever is the primary
    /// client.batch_execute("BEGIN; COMMIT").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_primary(&self) -> Result<Client> {
        let name = self.pg.get_application_name().unwrap_or("pg-outbox").to_string();
        let (client, _link) = connect(self, &name, &SessionSettings::primary()).await?;
        Ok(client)
    }

    /// The `tokio_postgres::Config` to connect with, for a connection pool
    /// (or any `Config::connect`): hosts, ports, user, database, password
    /// (from the password file when needed), application name, TCP
    /// keepalives, the connect timeout (default [`ConnectOptions::DEFAULT_CONNECT_TIMEOUT`]),
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
    ///
    /// A connection made from this `Config` goes through tokio-postgres's
    /// own loop over the hosts of a multi-host URL, not pg-outbox's:
    /// `target_session_attrs=read-write` works there too, but
    /// `connect_timeout` bounds only each TCP connect, so a host that
    /// accepts and then never answers stalls that connection; bound it in
    /// the pool (deadpool-postgres's `Timeouts::create`).
    pub fn tokio_postgres_config(&self) -> Config {
        use tokio_postgres::config::SslMode as T;
        let (mut cfg, _) = self.with_password();
        client_liveness(&mut cfg);
        if cfg.get_connect_timeout().is_none() {
            cfg.connect_timeout(ConnectOptions::DEFAULT_CONNECT_TIMEOUT);
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
    pub(super) fn all_unix(&self) -> bool {
        let hosts = self.pg.get_hosts();
        !hosts.is_empty() && self.pg.get_hostaddrs().is_empty() && hosts.iter().all(|h| matches!(h, Host::Unix(_)))
    }

    /// The connector for these hosts: a Unix socket ignores the TLS settings
    /// (libpq), so a missing root certificate must not refuse one either.
    pub(super) fn tls_for_hosts(&self) -> Result<MakeRustlsConnect> {
        if self.all_unix() {
            ConnectOptions { ssl_mode: SslMode::Disable, root_cert: None, ..self.clone() }.tls()
        } else {
            self.tls()
        }
    }

    /// The password to log in with: the one given, else the password
    /// file's for the first host (`None`: neither).
    #[cfg(feature = "wal")]
    pub(crate) fn resolved_password(&self) -> Option<String> {
        self.with_password().0.get_password().map(|p| String::from_utf8_lossy(p).into_owned())
    }

    /// The `Config` with the password file's password when none is given,
    /// and the file it came from.
    pub(super) fn with_password(&self) -> (Config, Option<&Path>) {
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
    pub(super) fn synced(mut self) -> Self {
        self.pg.ssl_mode(self.ssl_mode.coarse());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::testing::parse_in;

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
        assert_eq!(cfg.get_connect_timeout(), Some(&ConnectOptions::DEFAULT_CONNECT_TIMEOUT));
        assert_eq!(cfg.get_options(), None, "no planner settings for an application's pool");
        // A socket needs no roots, even with verify-full.
        let o = parse_in("host=/run/pg user=u sslmode=verify-full", &[]).expect("kv");
        assert!(o.tls_connector().is_ok());
        let o = parse_in("host=h user=u sslmode=verify-full", &[("HOME", "/nonexistent")]).expect("kv");
        let e = o.tls_connector().expect_err("verify-full needs roots");
        assert!(e.to_string().contains("needs trusted root certificates"), "{e}");
    }
}

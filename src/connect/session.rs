//! pg-outbox's own sessions: application names, keepalives, the planner
//! and per-session settings sent at startup, the spawned connection task
//! and the canceller of its running statement.

use std::fmt;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::attempt::{Attempt, Failures, HostTry, refused_startup_options};
use super::hosts;
use super::target::describe_target;
use super::tls::TlsStream;
use super::{ConnectOptions, PLANNER_SETTINGS, SslMode};
use crate::error::{Error, Result};

/// TCP keepalive idle time set on every connection, so a half-open
/// connection (a vanished server or a dropped NAT entry) is noticed in about
/// a minute instead of the kernel's two hours.
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// Client-side TCP keepalive probes after [`KEEPALIVE_IDLE`]: 10 s apart,
/// 3 of them, so an idle connection to a vanished server ends in about a
/// minute (the kernel's defaults, 75 s apart and 9 of them, take over 11
/// minutes), unless the URL sets `keepalives_interval` or
/// `keepalives_retries`.
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Client-side keepalive probes unanswered before the connection ends: 3.
pub(crate) const KEEPALIVE_RETRIES: u32 = 3;

/// `TCP_USER_TIMEOUT` of every connection (Linux): 60 s. Data sent and
/// not acknowledged for that long ends the connection. Keepalives do not
/// probe a connection with data in flight, so without it a statement sent
/// into a black-holed network (a cut that drops packets silently) waits
/// for the kernel's retransmissions, about 15 minutes, while the relay
/// looks alive. Unless the URL sets `tcp_user_timeout` (in seconds, as
/// tokio-postgres reads it; libpq reads milliseconds).
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(60);

/// The client side of a connection's liveness on `cfg`: keepalives after
/// [`KEEPALIVE_IDLE`], [`KEEPALIVE_INTERVAL`] apart, [`KEEPALIVE_RETRIES`]
/// of them, and [`TCP_USER_TIMEOUT`]; the interval, the count and the user
/// timeout only where the URL leaves them unset.
pub(crate) fn client_liveness(cfg: &mut Config) {
    cfg.keepalives(true).keepalives_idle(KEEPALIVE_IDLE);
    if cfg.get_keepalives_interval().is_none() {
        cfg.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if cfg.get_keepalives_retries().is_none() {
        cfg.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if cfg.get_tcp_user_timeout().is_none() {
        cfg.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
}

/// Server-side TCP keepalive settings sent with every connection (unless the
/// URL's `options` set them): idle 30 s, then 3 probes 10 s apart.
pub(crate) const SERVER_KEEPALIVES: &str =
    "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3";

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
    /// Send `idle_session_timeout = 0`: the session may sit idle as long as
    /// it likes, whatever the server, database or role set (a managed
    /// server's default that closes idle sessions would otherwise end the
    /// relay's writer and LISTEN sessions between events). PostgreSQL 14+,
    /// like the connection check, and sent with it (see
    /// [`SessionSettings::check_client_connection`] for older servers).
    pub(crate) keep_when_idle: bool,
    /// The session needs the primary: a server in recovery (a hot standby),
    /// or one whose sessions are read-only, is refused as with
    /// `target_session_attrs=read-write` (the next host of a multi-host URL
    /// is tried), and when no host is writable the error is
    /// [`Error::ReadOnlyStandby`] (or [`Error::ReadOnlyServer`]).
    pub(crate) primary: bool,
    /// The session keeps its server session for its life (the relay's,
    /// after [`super::require_own_sessions`]): when a pooler refuses startup
    /// options, these settings and the planner's are sent as `SET` once
    /// connected. Other sessions then go without them: through a
    /// transaction-mode pooler a `SET` would stay behind on a server
    /// session that other clients get.
    pub(crate) pinned: bool,
}

impl SessionSettings {
    /// The settings of a session that writes and keeps nothing else:
    /// nothing beyond every session's, on a writable server (a standby is
    /// refused, see [`SessionSettings::primary`]).
    pub(crate) fn primary() -> Self {
        SessionSettings { primary: true, ..SessionSettings::default() }
    }

    /// The startup options, `-c name=value` each; with or without the
    /// settings PostgreSQL 14 introduced (the connection check and
    /// `idle_session_timeout`).
    pub(crate) fn options(&self, with_14: bool) -> String {
        let mut out = Vec::new();
        if let Some(t) = self.statement_timeout {
            out.push(format!("-c statement_timeout={}", setting_millis(t)));
        }
        if with_14 {
            out.extend(self.settings_of_14().iter().map(|(name, value)| format!("-c {name}={value}")));
        }
        out.join(" ")
    }

    /// The settings of these sessions that PostgreSQL 13 does not know:
    /// (name, value).
    fn settings_of_14(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self.check_client_connection {
            out.push((
                "client_connection_check_interval",
                setting_millis(CLIENT_CONNECTION_CHECK_INTERVAL).to_string(),
            ));
        }
        if self.keep_when_idle {
            out.push(("idle_session_timeout", "0".to_string()));
        }
        out
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

/// Settings a pooler refused as startup options, to be sent as `SET`
/// statements once the connection runs ([`Deferred::apply`]); empty unless
/// the session is [pinned](SessionSettings::pinned).
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    /// `SET name = value; ...` of the planner settings and the statement timeout.
    sets: Option<String>,
    /// `SET client_connection_check_interval = ...; SET
    /// idle_session_timeout = 0` (refused by PostgreSQL 13 and older, which
    /// is not an error here).
    check: Option<String>,
}

impl Deferred {
    /// Send the settings (nothing when there are none).
    ///
    /// # Errors
    /// The driver's error when a `SET` is refused.
    pub(crate) async fn apply(&self, client: &Client) -> std::result::Result<(), tokio_postgres::Error> {
        if let Some(sql) = &self.sets {
            client.batch_execute(sql).await?;
        }
        if let Some(sql) = &self.check {
            match client.batch_execute(sql).await {
                Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT) => {}
                r => r?,
            }
        }
        Ok(())
    }
}

/// `-c name=value ...` startup options as `SET name = value;` statements.
fn as_sets(options: &str) -> String {
    options
        .split_whitespace()
        .filter(|t| *t != "-c")
        .filter_map(|t| t.split_once('='))
        .map(|(name, value)| format!("SET {name} = {value};"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Open a connection as `opts` says (TLS included), with our application
/// name, keepalives, a connect timeout and `settings`; do not spawn it.
/// Returns the client, its connection, its [`Canceller`] and the settings
/// still to send ([`Deferred`]).
///
/// `allow` tries without TLS and then with it; `prefer` asks for TLS and
/// goes on without if the server declines; a Unix socket never uses TLS
/// (as libpq).
///
/// A pooler that refuses the startup parameter `options` (PgBouncer) gets
/// a connection without it, unless the URL sets options of its own; the
/// settings then come as `SET` statements for a pinned session, and not at
/// all for others.
pub(crate) async fn open(
    opts: &ConnectOptions,
    application_name: &str,
    settings: &SessionSettings,
) -> Result<(Client, Connection<Socket, TlsStream>, Canceller, Deferred)> {
    match open_with(opts, application_name, settings, true).await {
        Err(Error::Connect { source, .. })
            if refused_startup_options(&source) && opts.pg.get_options().is_none_or(str::is_empty) =>
        {
            tracing::debug!(target_db = %opts.describe(),
                "the server (a pooler) refuses startup options; connecting without them");
            let (client, connection, canceller, _) = open_with(opts, application_name, settings, false).await?;
            let deferred = if settings.pinned {
                let sets = as_sets(&format!("{PLANNER_SETTINGS} {}", settings.options(false)));
                let of_14 = settings.settings_of_14();
                let check = (!of_14.is_empty()).then(|| {
                    of_14.iter().map(|(name, value)| format!("SET {name} = {value};")).collect::<Vec<_>>().join(" ")
                });
                Deferred { sets: Some(sets), check }
            } else {
                Deferred::default()
            };
            Ok((client, connection, canceller, deferred))
        }
        r => r,
    }
}

/// [`open`], with startup options (ours and the URL's) or with none.
///
/// Each host is tried alone, in turn (see `hosts`), and bounded by the
/// connect timeout (libpq's `connect_timeout`, default
/// [`ConnectOptions::DEFAULT_CONNECT_TIMEOUT`]) from the TCP connect to the end of the
/// startup exchange: a host that never answers costs that long, then the
/// next is tried. A session that must write (`target_session_attrs=read-write`,
/// or [`SessionSettings::primary`]) refuses a standby or a read-only server
/// and tries the next host.
async fn open_with(
    opts: &ConnectOptions,
    application_name: &str,
    settings: &SessionSettings,
    with_options: bool,
) -> Result<(Client, Connection<Socket, TlsStream>, Canceller, Deferred)> {
    use tokio_postgres::config::SslMode as T;
    let (with_password, password_file) = opts.with_password();
    let base = if with_options {
        prepared(&with_password, application_name)
    } else {
        unprepared(&with_password, application_name)
    };
    let all_unix = opts.all_unix();
    let tls = opts.tls_for_hosts()?;
    let attempts: &[T] = match opts.ssl_mode {
        _ if all_unix => &[T::Disable],
        SslMode::Disable => &[T::Disable],
        SslMode::Allow => &[T::Disable, T::Require],
        SslMode::Prefer => &[T::Prefer],
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => &[T::Require],
    };
    let order = hosts::host_order(&base)?;
    let several = order.len() > 1;
    let writes = hosts::needs_writes(&base, settings.primary);
    let mut failures = Failures::default();
    // tokio-postgres bounds only the TCP connect by `connect_timeout`; a
    // server that accepts and then never answers would hang the startup
    // exchange forever. Each host's whole attempt gets the bound (libpq's
    // `connect_timeout` is "maximum time to wait while connecting", per host).
    let bound = base.get_connect_timeout().copied().unwrap_or(ConnectOptions::DEFAULT_CONNECT_TIMEOUT);
    // With the settings of PostgreSQL 14 first; without them if the server
    // does not know them (PostgreSQL 13: "unrecognized configuration
    // parameter", SQLSTATE 42704, at startup).
    let with_14 = !settings.settings_of_14().is_empty() && with_options;
    let variants: &[bool] = if with_14 { &[true, false] } else { &[false] };
    'variants: for &with_check in variants {
        let cfg = if with_options { with_session_options(&base, &settings.options(with_check)) } else { base.clone() };
        let mut unknown_setting = false;
        for &i in &order {
            let mut host = hosts::one_host(&cfg, i);
            if writes {
                // Checked here, to tell a standby from a read-only server.
                host.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::Any);
            }
            let attempt = Attempt { name: describe_target(&host), tls: &tls, writes, bound, with_check };
            match attempt.host(host, attempts, &mut failures).await {
                HostTry::Open(client, connection) => {
                    let canceller = Canceller { token: client.cancel_token(), tls: tls.clone() };
                    return Ok((client, *connection, canceller, Deferred::default()));
                }
                HostTry::Next { unknown_setting: unknown } => unknown_setting |= unknown,
                HostTry::Refused => break 'variants,
            }
        }
        if !unknown_setting {
            break;
        }
        tracing::debug!(target_db = %opts.describe(),
            "the server does not know client_connection_check_interval or idle_session_timeout (PostgreSQL 13 or \
             older); connecting without them");
        failures = Failures::default();
    }
    Err(failures.into_error(opts, &base, password_file, several, bound))
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
    let (client, connection, canceller, deferred) = open(opts, application_name, settings).await?;
    let name = application_name.to_string();
    let closed = tokio_util::sync::CancellationToken::new();
    let guard = closed.clone().drop_guard();
    let handle = tokio::spawn(async move {
        let _guard = guard;
        if let Err(e) = connection.await {
            tracing::debug!(connection = %name, error = %e, "connection ended");
        }
    });
    let link = Link { handle, closed, canceller };
    if let Err(e) = deferred.apply(&client).await {
        link.handle.abort();
        return Err(Error::Db(e));
    }
    Ok((client, link))
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

/// `cfg` without its startup options (tokio-postgres cannot unset them),
/// with our application name, client-side keepalives and a connect
/// timeout: for a pooler that refuses the parameter.
fn unprepared(cfg: &Config, application_name: &str) -> Config {
    let mut out = hosts::copy_settings(cfg, false);
    out.application_name(cfg.get_application_name().unwrap_or(application_name));
    for h in cfg.get_hosts() {
        match h {
            tokio_postgres::config::Host::Tcp(h) => out.host(h),
            tokio_postgres::config::Host::Unix(p) => out.host_path(p),
        };
    }
    for a in cfg.get_hostaddrs() {
        out.hostaddr(*a);
    }
    for p in cfg.get_ports() {
        out.port(*p);
    }
    client_liveness(&mut out);
    out.connect_timeout(cfg.get_connect_timeout().copied().unwrap_or(ConnectOptions::DEFAULT_CONNECT_TIMEOUT));
    out
}

/// The config with our application name, keepalives and a connect timeout.
pub(crate) fn prepared(cfg: &Config, application_name: &str) -> Config {
    let mut cfg = cfg.clone();
    if cfg.get_application_name().is_none() {
        cfg.application_name(application_name);
    }
    client_liveness(&mut cfg);
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
        cfg.connect_timeout(ConnectOptions::DEFAULT_CONNECT_TIMEOUT);
    }
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::testing::parse_url;

    #[test]
    fn prepared_sets_keepalives_and_planner_settings_and_keeps_user_options() {
        let ours = format!("{SERVER_KEEPALIVES} {PLANNER_SETTINGS}");
        let cfg = prepared(&parse_url("postgres://u@h/db").expect("url").pg, "app");
        assert_eq!(cfg.get_options(), Some(ours.as_str()));
        assert_eq!(cfg.get_application_name(), Some("app"));
        assert!(cfg.get_keepalives());
        assert_eq!(cfg.get_keepalives_interval(), Some(KEEPALIVE_INTERVAL));
        assert_eq!(cfg.get_keepalives_retries(), Some(KEEPALIVE_RETRIES));
        assert_eq!(cfg.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        let own =
            prepared(&parse_url("postgres://u@h/db?tcp_user_timeout=5&keepalives_retries=9").expect("url").pg, "a");
        assert_eq!(own.get_tcp_user_timeout(), Some(&Duration::from_secs(5)), "the URL's own is kept");
        assert_eq!(own.get_keepalives_retries(), Some(9));
        let cfg = prepared(&parse_url("host=h user=u options='-c search_path=x'").expect("url").pg, "app");
        assert_eq!(cfg.get_options(), Some(format!("{ours} -c search_path=x").as_str()));
        // The URL's own settings come last, so they win.
        let mine = "-c tcp_keepalives_idle=5";
        let cfg = prepared(&parse_url(&format!("host=h user=u options='{mine}'")).expect("url").pg, "app");
        assert_eq!(cfg.get_options(), Some(format!("{ours} {mine}").as_str()));
    }

    #[test]
    fn refused_startup_options_become_sets_and_a_config_without_options() {
        let s = SessionSettings { statement_timeout: Some(Duration::from_secs(60)), ..SessionSettings::default() };
        assert_eq!(
            as_sets(&format!("{PLANNER_SETTINGS} {}", s.options(false))),
            "SET enable_sort = off; SET jit = off; SET max_parallel_workers_per_gather = 0; SET statement_timeout = 60000;"
        );
        assert_eq!(as_sets(""), "");
        let base = parse_url("postgres://u:pw@h:6432/db?application_name=mine&connect_timeout=3").expect("url").pg;
        let cfg = unprepared(&prepared(&base, "app"), "app");
        assert_eq!(cfg.get_options(), None, "no startup options at all");
        assert_eq!(cfg.get_user(), Some("u"));
        assert_eq!(cfg.get_password(), Some(&b"pw"[..]));
        assert_eq!(cfg.get_dbname(), Some("db"));
        assert_eq!(cfg.get_ports(), &[6432]);
        assert_eq!(cfg.get_application_name(), Some("mine"));
        assert_eq!(cfg.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert!(cfg.get_keepalives());
        assert_eq!(unprepared(&parse_url("host=h user=u").expect("url").pg, "app").get_application_name(), Some("app"));
    }

    #[test]
    fn session_settings_come_before_the_urls_options() {
        let s = SessionSettings {
            statement_timeout: Some(Duration::from_millis(200)),
            check_client_connection: true,
            keep_when_idle: true,
            pinned: false,
            primary: true,
        };
        assert_eq!(
            s.options(true),
            "-c statement_timeout=200 -c client_connection_check_interval=5000 -c idle_session_timeout=0"
        );
        assert_eq!(s.options(false), "-c statement_timeout=200");
        assert_eq!(SessionSettings::default().options(true), "");
        assert_eq!(SessionSettings::primary().options(true), "", "a writable server, no setting");
        let off = SessionSettings { statement_timeout: Some(Duration::ZERO), ..SessionSettings::default() };
        assert_eq!(off.options(true), "-c statement_timeout=0");
        let base = prepared(&parse_url("host=h user=u options='-c statement_timeout=0'").expect("url").pg, "app");
        let cfg = with_session_options(&base, &s.options(true));
        let o = cfg.get_options().expect("options");
        assert!(
            o.starts_with(
                "-c statement_timeout=200 -c client_connection_check_interval=5000 -c idle_session_timeout=0 "
            ),
            "{o}"
        );
        assert!(o.ends_with("-c statement_timeout=0"), "the URL's own setting comes last, so it wins: {o}");
        assert_eq!(with_session_options(&base, "").get_options(), base.get_options());
        assert_eq!(setting_millis(Duration::from_micros(500)), 1, "rounded up, never to 0 (off)");
        assert_eq!(setting_millis(Duration::ZERO), 0);
        assert_eq!(setting_millis(Duration::from_secs(60)), 60_000);
        assert_eq!(setting_millis(Duration::from_secs(u64::MAX)), i32::MAX as u64);
    }
}

//! The hosts of a connection string, one at a time: the order they are
//! tried in, a `Config` for each alone (so that the connect timeout bounds
//! each host, as in libpq, and a dead first host of a multi-host URL does
//! not use up the whole attempt), and whether the server a session reached
//! accepts writes.
//!
//! tokio-postgres tries the hosts of one `Config` in turn, and bounds only
//! the TCP connect of each address by `connect_timeout`: a host that
//! accepts and then never answers (a hung server, a half-dead VM behind a
//! load balancer) stalls the attempt for good, and a bound put around the
//! whole attempt ends it before the next host is tried. libpq's
//! `connect_timeout` is "maximum time to wait while connecting" and
//! "applies separately to each host name or IP address" (PostgreSQL docs,
//! libpq "Parameter Key Words"). So each host gets a `Config` of its own
//! and the whole bound.

use std::future::Future;
use std::task::Poll;

use tokio_postgres::config::{Host, LoadBalanceHosts, TargetSessionAttrs};
use tokio_postgres::{Client, Config, Connection, SimpleQueryMessage, Socket};

use super::tls::TlsStream;
use crate::error::{Error, Result};

/// Whether the server is a standby (`pg_is_in_recovery()`, `t` or `f`)
/// and whether the session is read-only (`transaction_read_only`, `on` or
/// `off`): for a server that does not report `in_hot_standby` and
/// `default_transaction_read_only` at startup (PostgreSQL 13, a pooler).
/// A simple query, outside any transaction.
const SERVER_STATE: &str = "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')";

/// Whether a server accepts writes, as a session sees it at its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ServerState {
    /// A primary whose sessions may write.
    Writable,
    /// A hot standby (in recovery): read-only until promoted.
    Standby,
    /// Not in recovery, but `default_transaction_read_only` is on (for the
    /// server, the database or the role).
    ReadOnly,
}

/// The indexes of `cfg`'s hosts in the order to try them: as written, or
/// shuffled with `load_balance_hosts=random` (as libpq and tokio-postgres).
///
/// # Errors
/// [`Error::Config`] when the numbers of hosts, host addresses and ports
/// do not fit together (libpq's rules: as many `hostaddr` as `host` when
/// both are given; one port for all hosts or one for each), or when no
/// host is given at all.
pub(super) fn host_order(cfg: &Config) -> Result<Vec<usize>> {
    let (hosts, addrs, ports) = (cfg.get_hosts().len(), cfg.get_hostaddrs().len(), cfg.get_ports().len());
    if hosts == 0 && addrs == 0 {
        return Err(Error::Config("invalid connection settings: no host given (host= or hostaddr=)".into()));
    }
    if hosts > 0 && addrs > 0 && hosts != addrs {
        return Err(Error::Config(format!(
            "invalid connection settings: {hosts} hosts but {addrs} host addresses (hostaddr); give one address \
             per host, or none"
        )));
    }
    let n = hosts.max(addrs);
    if ports > 1 && ports != n {
        return Err(Error::Config(format!(
            "invalid connection settings: {ports} ports for {n} hosts; give one port for all hosts, or one per host"
        )));
    }
    let mut order: Vec<usize> = (0..n).collect();
    if cfg.get_load_balance_hosts() == LoadBalanceHosts::Random {
        use rand::seq::SliceRandom;
        order.shuffle(&mut rand::rng());
    }
    Ok(order)
}

/// `cfg` with host number `i` alone (its name or socket directory, its
/// address and its port), and every other setting as it is.
pub(super) fn one_host(cfg: &Config, i: usize) -> Config {
    let mut out = copy_settings(cfg, true);
    match cfg.get_hosts().get(i) {
        Some(Host::Tcp(h)) => {
            out.host(h);
        }
        Some(Host::Unix(p)) => {
            out.host_path(p);
        }
        None => {}
    }
    if let Some(a) = cfg.get_hostaddrs().get(i) {
        out.hostaddr(*a);
    }
    let ports = cfg.get_ports();
    if let Some(p) = ports.get(i).or(ports.first()) {
        out.port(*p);
    }
    out
}

/// Every setting of `cfg` but its hosts, host addresses and ports (which a
/// `Config` cannot unset), with or without its startup `options`.
pub(super) fn copy_settings(cfg: &Config, with_options: bool) -> Config {
    let mut out = Config::new();
    if let Some(u) = cfg.get_user() {
        out.user(u);
    }
    if let Some(p) = cfg.get_password() {
        out.password(p);
    }
    if let Some(d) = cfg.get_dbname() {
        out.dbname(d);
    }
    if with_options && let Some(o) = cfg.get_options() {
        out.options(o);
    }
    if let Some(a) = cfg.get_application_name() {
        out.application_name(a);
    }
    if let Some(t) = cfg.get_connect_timeout() {
        out.connect_timeout(*t);
    }
    if let Some(t) = cfg.get_tcp_user_timeout() {
        out.tcp_user_timeout(*t);
    }
    out.ssl_mode(cfg.get_ssl_mode())
        .ssl_negotiation(cfg.get_ssl_negotiation())
        .target_session_attrs(cfg.get_target_session_attrs())
        .channel_binding(cfg.get_channel_binding())
        .load_balance_hosts(cfg.get_load_balance_hosts())
        .keepalives(cfg.get_keepalives())
        .keepalives_idle(cfg.get_keepalives_idle());
    if let Some(i) = cfg.get_keepalives_interval() {
        out.keepalives_interval(i);
    }
    if let Some(r) = cfg.get_keepalives_retries() {
        out.keepalives_retries(r);
    }
    out
}

/// Whether sessions of `cfg` must reach a server that accepts writes:
/// `target_session_attrs=read-write`, or a part that needs the primary.
pub(super) fn needs_writes(cfg: &Config, primary: bool) -> bool {
    primary || cfg.get_target_session_attrs() == TargetSessionAttrs::ReadWrite
}

/// Whether the server behind a new session accepts writes. PostgreSQL 14
/// and later report `in_hot_standby` and `default_transaction_read_only`
/// at startup (they are `GUC_REPORT` settings), so no statement is sent;
/// an older server, or a pooler that passes other parameters only, gets
/// one simple query ([`SERVER_STATE`]), with the connection driven here
/// (it is not spawned yet).
///
/// # Errors
/// The driver's error if that query fails or the connection ends.
pub(super) async fn server_state(
    client: &Client,
    connection: &mut Connection<Socket, TlsStream>,
) -> std::result::Result<ServerState, tokio_postgres::Error> {
    let reported = (connection.parameter("in_hot_standby"), connection.parameter("default_transaction_read_only"));
    match reported {
        (Some("on"), _) => return Ok(ServerState::Standby),
        (Some(_), Some("on")) => return Ok(ServerState::ReadOnly),
        (Some(_), Some(_)) => return Ok(ServerState::Writable),
        _ => {}
    }
    let messages = drive_while(connection, client.simple_query(SERVER_STATE)).await?;
    let row = messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(r) => Some((r.get(0).map(str::to_string), r.get(1).map(str::to_string))),
        _ => None,
    });
    Ok(match row {
        Some((Some(recovery), _)) if recovery == "t" || recovery == "true" => ServerState::Standby,
        Some((_, Some(read_only))) if read_only == "on" => ServerState::ReadOnly,
        _ => ServerState::Writable,
    })
}

/// Run `fut` (a statement on the client of `connection`) while driving the
/// connection, which is not spawned yet. A notice that arrives meanwhile is
/// dropped (no LISTEN is in place, so nothing else can).
async fn drive_while<T>(
    connection: &mut Connection<Socket, TlsStream>,
    fut: impl Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> std::result::Result<T, tokio_postgres::Error> {
    let mut fut = std::pin::pin!(fut);
    let mut ended = false;
    std::future::poll_fn(|cx| {
        while !ended {
            match connection.poll_message(cx) {
                Poll::Ready(Some(Ok(_))) => {}
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                // The connection is closed: the statement fails on its own.
                Poll::Ready(None) => ended = true,
                Poll::Pending => break,
            }
        }
        fut.as_mut().poll(cx)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::testing::parse_url;

    #[test]
    fn each_host_alone_keeps_every_other_setting() {
        let cfg = parse_url(
            "postgres://u:pw@a:1,b:2/db?target_session_attrs=read-write&connect_timeout=3&application_name=x\
             &options=-c%20search_path%3Dy&keepalives_idle=7",
        )
        .expect("url")
        .pg;
        assert_eq!(host_order(&cfg).expect("order"), vec![0, 1]);
        let b = one_host(&cfg, 1);
        assert_eq!(b.get_hosts(), &[Host::Tcp("b".into())]);
        assert_eq!(b.get_ports(), &[2]);
        assert_eq!(b.get_user(), Some("u"));
        assert_eq!(b.get_password(), Some(&b"pw"[..]));
        assert_eq!(b.get_dbname(), Some("db"));
        assert_eq!(b.get_options(), Some("-c search_path=y"));
        assert_eq!(b.get_application_name(), Some("x"));
        assert_eq!(b.get_connect_timeout(), Some(&std::time::Duration::from_secs(3)));
        assert_eq!(b.get_keepalives_idle(), std::time::Duration::from_secs(7));
        assert_eq!(b.get_target_session_attrs(), TargetSessionAttrs::ReadWrite);
        assert!(needs_writes(&b, false));
        assert_eq!(copy_settings(&cfg, false).get_options(), None);
        // One port for all hosts.
        let cfg = parse_url("host=a,b port=6 user=u").expect("kv").pg;
        assert_eq!(one_host(&cfg, 1).get_ports(), &[6]);
        assert!(!needs_writes(&cfg, false) && needs_writes(&cfg, true));
        // A host address per host.
        let cfg = parse_url("host=a,b hostaddr=10.0.0.1,10.0.0.2 user=u").expect("kv").pg;
        let b = one_host(&cfg, 1);
        assert_eq!(b.get_hostaddrs(), &["10.0.0.2".parse::<std::net::IpAddr>().expect("ip")]);
        assert_eq!(b.get_hosts(), &[Host::Tcp("b".into())]);
    }

    #[test]
    fn hosts_and_ports_that_do_not_fit_are_refused_in_a_sentence() {
        let cfg = parse_url("host=a,b port=1,2,3 user=u").expect("kv").pg;
        let e = host_order(&cfg).expect_err("3 ports for 2 hosts");
        assert!(e.to_string().contains("3 ports for 2 hosts"), "{e}");
        let cfg = parse_url("host=a,b hostaddr=10.0.0.1 user=u").expect("kv").pg;
        let e = host_order(&cfg).expect_err("2 hosts, 1 address");
        assert!(e.to_string().contains("2 hosts but 1 host addresses"), "{e}");
        let cfg = parse_url("host=a,b,c user=u load_balance_hosts=random").expect("kv").pg;
        let mut order = host_order(&cfg).expect("order");
        order.sort_unstable();
        assert_eq!(order, vec![0, 1, 2], "every host, in some order");
    }
}

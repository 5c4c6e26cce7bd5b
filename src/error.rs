//! The error type of pg-outbox.

use tokio_postgres::error::{DbError, SqlState};

/// A boxed error from user code or a sink.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in pg-outbox.
///
/// # Formatting
/// `Display` shows one level only; the cause is available through
/// [`std::error::Error::source`]. Use a reporter that walks the chain (the
/// `pg-outbox` binary prints `a: b: c`). Message text is not stable; match on
/// variants, [`Error::code`] or [`Error::as_db_error`] instead.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database URL or connection settings could not be parsed.
    #[error("invalid database URL")]
    InvalidUrl(#[source] tokio_postgres::Error),
    /// A connection to the database could not be opened. `target` names the
    /// host, port and database (never the password).
    #[error("cannot connect to the database at {target}")]
    Connect {
        /// Host, port and database name.
        target: String,
        /// What the driver reported.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server accepted the connection but did not finish the startup
    /// exchange (TLS negotiation, authentication) within the connect
    /// timeout (`connect_timeout` of the URL, default
    /// [`ConnectOptions::DEFAULT_CONNECT_TIMEOUT`](crate::ConnectOptions::DEFAULT_CONNECT_TIMEOUT)): not a PostgreSQL server, or one
    /// that hangs. `target` names the host, port and database.
    #[error("cannot connect to the database at {target}: the server did not answer the startup within {after:?}")]
    ConnectTimedOut {
        /// Host, port and database name.
        target: String,
        /// The connect timeout that ran out.
        after: std::time::Duration,
    },
    /// Every server the URL names is a hot standby (in recovery: read-only),
    /// and what was asked needs the primary: the relay (a library
    /// [`Consumer`](crate::Consumer)), `migrate`, retention, and sessions
    /// opened with [`ConnectOptions::connect_primary`](crate::ConnectOptions::connect_primary).
    /// Found at connect time (the server's `in_hot_standby`, or
    /// `pg_is_in_recovery()` where the server does not report it), before
    /// any statement. `target` names the standby (host, port, database,
    /// user) and what the other hosts of a multi-host URL answered.
    ///
    /// Transient ([`Error::is_transient`]): a promotion makes the server
    /// the primary. The relay exits with it at start unless it waits for a
    /// promotion ([`ConsumerBuilder::wait_for_primary`](crate::ConsumerBuilder::wait_for_primary),
    /// `pg-outbox relay --wait-for-primary`); once running, a reconnect that
    /// lands on a standby backs off and tries again.
    #[error(
        "the server at {target} is a read-only standby (in recovery); point the URL at the primary, or list every \
         node in a multi-host URL with target_session_attrs=read-write (postgres://host1,host2/db?target_session_attrs=read-write), \
         or, for the relay, pass --wait-for-primary to wait for a promotion"
    )]
    ReadOnlyStandby {
        /// The standby's host, port, database and user, and what the other
        /// hosts answered (never the password).
        target: String,
    },
    /// The URL asks for a writable session (`target_session_attrs=read-write`,
    /// or a part that needs the primary, as for [`Error::ReadOnlyStandby`]),
    /// and no server it names is a standby, but every one that answered
    /// refuses writes: `default_transaction_read_only` is on for the server,
    /// the database or the role (as some managed services set it when the
    /// disk is nearly full). `target` names the server.
    #[error(
        "the server at {target} accepts no writes: default_transaction_read_only is on (for the server, the \
         database or the role) though it is not a standby; turn it off, or point the URL at a writable server"
    )]
    ReadOnlyServer {
        /// The server's host, port, database and user, and what the other
        /// hosts answered (never the password).
        target: String,
    },
    /// A query failed.
    #[error("database error")]
    Db(#[from] tokio_postgres::Error),
    /// A statement sent through sqlx failed (feature `sqlx`; see
    /// [`Publisher::publish_sqlx`](crate::Publisher::publish_sqlx)). Made
    /// from a [`sqlx::Error`] with `From` (so `?` converts one), which reads
    /// the SQLSTATE once; [`Error::code`] and [`Error::is_transient`] answer
    /// as for [`Error::Db`], while [`Error::as_db_error`] is `None` (use
    /// `source.as_database_error()` for the server's report).
    #[cfg(feature = "sqlx")]
    #[error("database error")]
    #[non_exhaustive]
    Sqlx {
        /// What sqlx reported.
        #[source]
        source: sqlx::Error,
        /// The SQLSTATE code the server reported, if it reported one.
        code: Option<SqlState>,
    },
    /// The schema is missing or older than this version of pg-outbox expects.
    #[error("schema not migrated: {0}; run `pg-outbox migrate`")]
    NotMigrated(String),
    /// The server's PostgreSQL is older than pg-outbox supports
    /// ([`crate::migrate::MIN_SERVER_VERSION`]); the message names both
    /// versions.
    #[error("unsupported server: {0}")]
    UnsupportedServer(String),
    /// The database URL leads to a pooler that shares server sessions
    /// between transactions (a transaction-mode pooler, as
    /// [`ConnectOptions::session_mode`](crate::ConnectOptions::session_mode)
    /// tells), and `what` needs sessions of its own: the relay (its leader
    /// and partition locks, prepared statements and settings are a
    /// session's) and `migrate` (its lock). `target` names the pooler's
    /// address and database, never the password.
    #[error(
        "{what} cannot run through the transaction-mode pooler at {target}, which shares server sessions between \
         clients ({evidence}): the locks and settings it keeps for its sessions would stay behind there; use a \
         direct URL to the server or a session-mode pooler's URL (PgBouncer pool_mode=session, Supavisor's port \
         5432, Neon's endpoint without -pooler)"
    )]
    SharedSessions {
        /// What was refused (`the relay ...`, `migrate`, `the console`).
        what: &'static str,
        /// The pooler's host and port, database and user.
        target: String,
        /// What showed the sharing (boxed: every variant stays small).
        evidence: Box<str>,
    },
    /// The WAL source cannot read the server's logical replication stream:
    /// the message says what to change, in one line (`wal_level`, the
    /// REPLICATION privilege or a managed server's equivalent, free
    /// `max_replication_slots` or `max_wal_senders`, the publication that
    /// `pg-outbox migrate --source wal` creates). The consumer never falls
    /// back to another source on its own.
    #[error("the WAL source cannot start: {0}")]
    ReplicationSetup(String),
    /// An event was refused before any SQL was sent (empty or NUL-bearing
    /// text, a payload PostgreSQL's jsonb cannot store, an oversized payload).
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A payload could not be serialised to JSON.
    #[error("payload is not serialisable to JSON")]
    Json(#[from] serde_json::Error),
    /// An I/O error outside the database driver.
    #[error("i/o error")]
    Io(#[from] std::io::Error),
    /// A sink failed to deliver an event.
    #[error("sink error")]
    Sink(#[source] BoxError),
    /// A sink's broker or endpoint could not be reached or refused the
    /// connection at start (the message names it, never its password).
    #[error("sink unavailable: {0}")]
    SinkUnavailable(String),
    /// An operation on a subscription was refused: a name that breaks the
    /// naming rule, a name taken or unknown, a rewind of an active one, a
    /// start position that cannot be used ([`SubscriptionError`]).
    #[error(transparent)]
    Subscription(#[from] SubscriptionError),
}

/// Why an operation on a subscription (`pg_outbox::subscription`) was
/// refused. Each message names the subscription (or the value) and says
/// what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubscriptionError {
    /// The name breaks the rule: 1 to 63 characters of `a`-`z`, `0`-`9`,
    /// `_`, `.`, `-`, starting with a letter or a digit (the regular
    /// expression `^[a-z0-9][a-z0-9_.-]{0,62}$`), and not `default`, the
    /// name of the seeded flow.
    #[error(
        "invalid subscription name {name:?}: {why}; a name is 1 to 63 characters of a-z, 0-9, '_', '.' and '-', \
         starting with a letter or a digit (^[a-z0-9][a-z0-9_.-]{{0,62}}$), and not 'default'"
    )]
    InvalidName {
        /// The name given.
        name: String,
        /// Which part of the rule it breaks.
        why: &'static str,
    },
    /// A subscription of that name exists already; creating it again is
    /// refused, never taken as success.
    #[error("subscription {0:?} exists already; drop it first (pg-outbox subscription drop) or choose another name")]
    Exists(String),
    /// The name's advisory lock class (partitioned mode's partition and
    /// membership locks: a 27-bit hash of the name, docs/architecture.md,
    /// "Advisory lock keys") is the one of an existing subscription, whose
    /// partitioned relays would then compete for the same locks: refused,
    /// so that no two subscriptions ever share one. The odds are about
    /// 1 in 134 million per pair of names.
    #[error(
        "subscription name {name:?} hashes to the advisory lock class of subscription {other:?} (partitioned mode's \
         locks), so their relays would compete for the same partitions; choose another name"
    )]
    LockClassTaken {
        /// The name given.
        name: String,
        /// The existing subscription with the same class.
        other: String,
    },
    /// No subscription of that name exists (`pg-outbox subscription list`
    /// shows those that do).
    #[error("no subscription {0:?}; `pg-outbox subscription list` shows the subscriptions there are")]
    Unknown(String),
    /// A rewind of a subscription that is not paused: a relay may be
    /// delivering its events.
    #[error("subscription {0:?} is active; pause it first (pg-outbox subscription pause {0}), then rewind it")]
    NotPaused(String),
    /// A start position that cannot be used: text that is none of `now`,
    /// `earliest`, `id:N`, `time:RFC3339`, or an id with no id before it.
    #[error("invalid start position {value:?}: {why}")]
    InvalidStart {
        /// The value given.
        value: String,
        /// What is wrong with it, and the forms that are accepted.
        why: String,
    },
    /// The subscription expired: it fell behind its lag bound with expiry
    /// opted in (`subscription set NAME --max-lag D --expire`), and
    /// retention no longer waits for it, so events it never got may be
    /// gone. Its relays stop, and it cannot be resumed or paused: rewind it
    /// (which accepts the gap and leaves it paused) or drop it.
    #[error(
        "subscription {0:?} expired: it fell behind its lag bound (--max-lag) with --expire, so retention no longer \
         waits for it and events it never got may have been deleted; `pg-outbox subscription rewind {0} --to ...` \
         accepts the gap (it is then paused: resume it), or drop it"
    )]
    Expired(String),
    /// A discard of the default subscription's dead letters (the seeded
    /// flow deletes them from `events.outbox`) that picked events another
    /// subscription has not passed yet: deleting them would lose them for
    /// it, so nothing was discarded. Discard them once every subscription
    /// has passed them, or leave them out of the selection.
    #[error(
        "nothing discarded: {} of the dead letters picked ({}) {} not been passed yet by subscription(s) {}, and \
         discarding deletes them from events.outbox, which would lose them for {}; discard them once {} passed \
         them (pg-outbox subscription list shows each cursor), or leave them out of the selection",
        ids.len(), crate::error::id_list(ids), if ids.len() == 1 { "has" } else { "have" },
        subscriptions.join(", "), if subscriptions.len() == 1 { "it" } else { "them" },
        if subscriptions.len() == 1 { "it has" } else { "they have" }
    )]
    StillNeeded {
        /// The picked events some subscription still needs, ascending.
        ids: Vec<i64>,
        /// The subscriptions that still need them, by name.
        subscriptions: Vec<String>,
    },
}

/// `ids` for a message: up to 10, then how many more.
pub(crate) fn id_list(ids: &[i64]) -> String {
    let shown: Vec<String> = ids.iter().take(10).map(i64::to_string).collect();
    match ids.len().saturating_sub(10) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

impl Error {
    /// The database's error report, if this error came from the server.
    pub fn as_db_error(&self) -> Option<&DbError> {
        match self {
            Error::Db(e) | Error::Connect { source: e, .. } => e.as_db_error(),
            _ => None,
        }
    }

    /// The SQLSTATE code, if the server reported one.
    pub fn code(&self) -> Option<&SqlState> {
        match self {
            Error::Db(e) | Error::Connect { source: e, .. } => e.code(),
            #[cfg(feature = "sqlx")]
            Error::Sqlx { code, .. } => code.as_ref(),
            _ => None,
        }
    }

    /// True when retrying later may succeed: the connection was closed or
    /// broken, the server is shutting down or starting, or the statement lost
    /// a serialization or deadlock race, or the server is a read-only
    /// standby (a promotion may follow). Rows are never touched because of
    /// such an error. False for what retrying cannot fix: a refused login
    /// (SQLSTATE class 28), a database that does not exist (3D000), a server
    /// certificate TLS refused, an invalid event, a schema not migrated.
    pub fn is_transient(&self) -> bool {
        match self {
            // A refused login (28xxx), a database that does not exist
            // (3D000) and the like stay refused; a network failure or a
            // server starting up may pass.
            Error::Connect { source, .. } => match source.code() {
                Some(code) => is_transient_code(code),
                // A certificate refused by TLS stays refused.
                None => !refused_by_tls(source),
            },
            Error::ConnectTimedOut { .. } => true,
            // A promotion, or an operator turning read-only off, ends it.
            Error::ReadOnlyStandby { .. } | Error::ReadOnlyServer { .. } => true,
            Error::Db(e) => is_transient_pg(e),
            #[cfg(feature = "sqlx")]
            Error::Sqlx { source, code } => is_transient_sqlx(source, code.as_ref()),
            Error::Io(_) => true,
            _ => false,
        }
    }
}

/// Whether a connection failed because TLS refused the server's certificate
/// (or the handshake): a rustls error somewhere in the chain.
fn refused_by_tls(e: &tokio_postgres::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = cur {
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>())
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Classify a driver error as transient (see [`Error::is_transient`]).
pub(crate) fn is_transient_pg(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        None => true, // I/O-level failure: the connection is gone or broken
        Some(code) => is_transient_code(code),
    }
}

/// Whether a SQLSTATE reported by the server means a retry later may succeed
/// (PostgreSQL docs, "PostgreSQL Error Codes").
fn is_transient_code(code: &SqlState) -> bool {
    let s = code.code();
    // Class 08 (connection exception), 57P (operator intervention:
    // admin/crash shutdown, cannot connect now), 53 (insufficient
    // resources), 40001/40P01 (serialization failure, deadlock),
    // 25006 (read-only transaction: we landed on a standby), 57014 (query
    // canceled: a statement timeout).
    s.starts_with("08")
        || s.starts_with("57P")
        || s.starts_with("53")
        || *code == SqlState::T_R_SERIALIZATION_FAILURE
        || *code == SqlState::T_R_DEADLOCK_DETECTED
        || *code == SqlState::READ_ONLY_SQL_TRANSACTION
        || *code == SqlState::QUERY_CANCELED
}

/// Classify an sqlx error as transient (see [`Error::is_transient`]): a
/// server error by its SQLSTATE; a broken connection, a pool that had no
/// connection free in time, or a crashed connection worker as transient;
/// everything else (configuration, TLS, protocol, decoding, a closed pool)
/// as permanent.
#[cfg(feature = "sqlx")]
fn is_transient_sqlx(e: &sqlx::Error, code: Option<&SqlState>) -> bool {
    match e {
        sqlx::Error::Database(_) => code.is_some_and(is_transient_code),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

#[cfg(feature = "sqlx")]
impl From<sqlx::Error> for Error {
    fn from(source: sqlx::Error) -> Self {
        let code = source.as_database_error().and_then(|d| d.code()).map(|c| SqlState::from_code(&c));
        Error::Sqlx { source, code }
    }
}

/// Format an error and its whole `source()` chain as `a: b: c`, skipping a
/// cause whose text its parent already contains.
pub fn report(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

//! Whether the server sessions behind a URL stay with their connection (a
//! direct connection, a session-mode pooler) or are shared between
//! transactions (a transaction-mode pooler such as PgBouncer's
//! `pool_mode = transaction`, Supavisor's port 6543, Neon's `-pooler`
//! endpoints): [`ConnectOptions::session_mode`], and the refusal of the
//! parts that need a session of their own.
//!
//! Through a transaction-mode pooler, whatever a session keeps beyond its
//! transaction (an advisory lock taken with `pg_advisory_lock`, a `SET`, a
//! `LISTEN`, a named prepared statement) stays with a server session that
//! the pooler hands to other clients, and is missing from the client's
//! next transaction. The relay's leader and partition locks, its prepared
//! statements and its settings are of that kind, as are `migrate`'s lock.

use std::time::Duration;

use tokio_postgres::{Client, SimpleQueryMessage};

use super::ConnectOptions;
use super::session::{SessionSettings, connect};
use crate::error::{Error, Result};

/// How long [`ConnectOptions::session_mode`] waits for each of its
/// statements: a pooler with no free server session for a second
/// connection (a full session-mode pool) makes it wait.
pub(crate) const SESSION_CHECK_WAIT: Duration = Duration::from_secs(5);

/// How the server sessions behind a URL behave, as
/// [`ConnectOptions::session_mode`] found them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionMode {
    /// Each connection kept one server session throughout: a direct
    /// connection, or a session-mode pooler. What a session keeps (advisory
    /// locks, settings, `LISTEN`, prepared statements) lasts as long as the
    /// connection.
    Kept,
    /// Connections shared server sessions between transactions: a
    /// transaction-mode (or statement-mode) pooler. Only what a transaction
    /// does is a client's own; what a session keeps stays behind on a
    /// server session that other clients get next.
    Shared {
        /// What showed it (the server process ids seen).
        evidence: String,
    },
    /// The check could not tell: the second connection got no server
    /// session within its wait (a full session-mode pool makes a second
    /// client wait for the first to leave).
    Unknown {
        /// Why.
        reason: String,
    },
}

impl ConnectOptions {
    /// Tell whether the server sessions behind these options stay with
    /// their connection ([`SessionMode::Kept`]: a direct connection or a
    /// session-mode pooler) or are shared between transactions
    /// ([`SessionMode::Shared`]: a transaction-mode pooler).
    ///
    /// Opens two connections, `A` and `B`, and reads the server process id
    /// (`pg_backend_pid()`) outside any transaction in the order A, B, B, A.
    /// On a kept session the two ids differ and neither changes. A
    /// transaction-mode pooler hands the server session A just gave back
    /// to B (PgBouncer reuses the session released last, or with
    /// `server_round_robin` the one idle longest, and B's second statement
    /// then moves), so the same id shows on both connections or an id
    /// changes: [`SessionMode::Shared`], which is never a false alarm.
    /// Other clients' traffic on the pool can, rarely, hide the sharing.
    /// A pool that gives B no server session within 5 s is
    /// [`SessionMode::Unknown`].
    ///
    /// # Errors
    /// A connection error if either connection cannot be opened;
    /// [`Error::Db`] if a statement fails.
    ///
    /// # Example
    /// ```no_run
    /// # async fn run() -> Result<(), pg_outbox::Error> {
    /// use pg_outbox::{ConnectOptions, SessionMode};
    /// let pg = ConnectOptions::parse("postgres://app@pooler.internal:6432/app")?;
    /// if let SessionMode::Shared { evidence } = pg.session_mode().await? {
    ///     eprintln!("a transaction-mode pooler ({evidence}): session locks would strand there");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn session_mode(&self) -> Result<SessionMode> {
        let settings = SessionSettings::default();
        let (a, _a_link) = connect(self, "pg-outbox session check", &settings).await?;
        let (b, _b_link) = connect(self, "pg-outbox session check", &settings).await?;
        let a1 = backend_pid(&a).await?;
        let Some(b1) = waited(backend_pid(&b)).await? else {
            return Ok(SessionMode::Unknown {
                reason: format!("a second connection got no server session within {SESSION_CHECK_WAIT:?}"),
            });
        };
        if a1 == b1 {
            return Ok(SessionMode::Shared {
                evidence: format!("two connections open at once were served by the same server process, {a1}"),
            });
        }
        let wait_b = waited(backend_pid(&b)).await?;
        let wait_a = waited(backend_pid(&a)).await?;
        for (name, first, later) in [("one connection", b1, wait_b), ("another", a1, wait_a)] {
            match later {
                Some(pid) if pid != first => {
                    return Ok(SessionMode::Shared {
                        evidence: format!("{name}'s statements were served by server process {first}, then by {pid}"),
                    });
                }
                Some(_) => {}
                None => {
                    return Ok(SessionMode::Unknown {
                        reason: format!("a statement got no server session within {SESSION_CHECK_WAIT:?}"),
                    });
                }
            }
        }
        Ok(SessionMode::Kept)
    }
}

/// `f`'s result, or `None` when it took longer than [`SESSION_CHECK_WAIT`].
async fn waited<T>(f: impl Future<Output = Result<T>>) -> Result<Option<T>> {
    match tokio::time::timeout(SESSION_CHECK_WAIT, f).await {
        Ok(r) => r.map(Some),
        Err(_) => Ok(None),
    }
}

/// The server process id of the session serving `client`'s next
/// statement, outside any transaction (a simple query: no prepared
/// statement is left anywhere).
async fn backend_pid(client: &Client) -> Result<i32> {
    for m in client.simple_query("SELECT pg_backend_pid()").await? {
        if let SimpleQueryMessage::Row(row) = m
            && let Some(pid) = row.get(0).and_then(|p| p.parse().ok())
        {
            return Ok(pid);
        }
    }
    Err(Error::Config("SELECT pg_backend_pid() returned no process id".into()))
}

/// Refuse to go on when `pg` leads to server sessions shared between
/// transactions: `what` (e.g. "the relay") needs a session of its own.
/// When the check cannot tell, say so in a warning and go on.
///
/// # Errors
/// [`Error::SharedSessions`] naming the pooler and the URL to use
/// instead; the check's own errors.
pub(crate) async fn require_own_sessions(pg: &ConnectOptions, what: &'static str) -> Result<()> {
    match pg.session_mode().await? {
        SessionMode::Kept => Ok(()),
        SessionMode::Shared { evidence } => {
            Err(Error::SharedSessions { what, target: pg.describe(), evidence: evidence.into() })
        }
        SessionMode::Unknown { reason } => {
            tracing::warn!(target_db = %pg.describe(), "cannot tell whether {what} gets database sessions of its own \
                ({reason}); going on. Through a transaction-mode pooler it would not work: use a direct URL or a \
                session-mode pooler's");
            Ok(())
        }
    }
}

//! Why the drain loop gives its sessions up, and how that is said (log,
//! health).

use std::time::Duration;

use tokio::time::Instant;

use crate::consumer::ConsumerConfig;
use crate::consumer::leadership::lease;
use crate::error::Error;
use crate::store::statement::{self, Failure, StatementError};
use crate::term::Term;

/// Why the sessions are given up.
pub(super) enum Loss {
    /// A session's connection ended (`"drain"` or `"writer"`).
    Closed(&'static str),
    /// Opening the sessions failed.
    ConnectFailed(Error),
    /// A statement failed.
    Statement(StatementError),
    /// The leadership term held (`term`) is no longer the current one
    /// (`current`, when read): another relay took the outbox over.
    Fenced { term: Option<Term>, current: Option<Term> },
}

impl Loss {
    /// A statement opening the sessions failed: a database error counts as
    /// a failed connection.
    pub(super) fn opening(e: StatementError) -> Self {
        match e {
            StatementError { failure: Failure::Db(e), .. } => Loss::ConnectFailed(Error::Db(e)),
            e => Loss::Statement(e),
        }
    }

    /// Log the loss, to be retried after `delay`, and return the error for
    /// the consumer's health (`None` for a statement that stopping
    /// cancelled). `on_standby`: since when reconnects have found only a
    /// read-only standby, said once when it starts.
    pub(super) fn describe(
        self,
        delay: Duration,
        on_standby: &mut Option<Instant>,
        cfg: &ConsumerConfig,
    ) -> Option<String> {
        let error = match self {
            Loss::Closed(which) => {
                tracing::warn!(retry_in = ?delay, "{which} connection closed; reconnecting");
                format!("{which} connection closed")
            }
            Loss::ConnectFailed(Error::ReadOnlyStandby { target }) => {
                if on_standby.is_none() {
                    *on_standby = Some(Instant::now());
                    tracing::warn!(signal = "read_only", standby = %target, retry_every_at_most = ?cfg.reconnect_max_delay,
                    "the database is a read-only standby now (a failover?): reconnecting until a host accepts writes");
                } else {
                    tracing::debug!(retry_in = ?delay, "still a read-only standby");
                }
                format!(
                    "the server at {target} is a read-only standby (in recovery): waiting for a host that accepts writes"
                )
            }
            Loss::Fenced { term, current } => {
                let known = |t: Option<Term>| t.map_or_else(|| "unknown".to_string(), |t| t.to_string());
                let (term, current) = (known(term), known(current));
                tracing::warn!(term = %term, current = %current, retry_in = ?delay,
                "this consumer's leadership term was superseded: another relay took the outbox over; \
                 handing nothing more out, and reconnecting as a standby");
                format!("leadership term {term} superseded (current term {current}): another relay leads")
            }
            Loss::ConnectFailed(e) => {
                let error = crate::error::report(&e);
                tracing::warn!(error = %error, retry_in = ?delay, "drain connection failed; retrying");
                error
            }
            Loss::Statement(StatementError { kind, failure }) => match failure {
                Failure::TimedOut(e) => {
                    statement::record_timeout(kind, cfg.statement_timeout, &e, Some(delay));
                    let timeout = cfg.statement_timeout;
                    format!(
                        "statement timeout: the server cancelled a statement ({}) after {timeout:?}",
                        kind.describe()
                    )
                }
                Failure::Db(e) => database_error(&e, kind, delay),
                Failure::Stopped => return None,
            },
        };
        Some(error)
    }
}

/// A database error that cost the sessions, logged and described for the
/// health: the server ended a session that sat idle (a leader's, or a
/// competing consumer's inside its claim: this relay stalled), or another.
fn database_error(e: &tokio_postgres::Error, kind: statement::StatementKind, delay: Duration) -> String {
    use tokio_postgres::error::SqlState;
    match e.code() {
        Some(c) if *c == SqlState::IDLE_SESSION_TIMEOUT => lease::ended_idle(e, delay),
        Some(c) if *c == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT => lease::ended_idle_in_claim(e, delay),
        _ => {
            let error = crate::error::report(e);
            tracing::warn!(error = %error, during = kind.describe(), retry_in = ?delay,
            "database error in the drain loop; reconnecting");
            format!("{}: {error}", kind.describe())
        }
    }
}

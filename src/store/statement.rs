//! Statements of the consumer's own sessions: what each one is (for logs
//! and the `statement` label of `outbox_statement_timeouts_total`), whether
//! the statement timeout cut it, and cancelling one the consumer gives up on.
//!
//! A statement cut by `statement_timeout` fails with SQLSTATE 57014
//! (`query_canceled`), the same code as one cancelled by a cancel request
//! (ours at shutdown, or an operator's `pg_cancel_backend`). The message
//! text, which says which, is translated by the server's `lc_messages`, so
//! it is not read: a 57014 after at least the timeout, measured from before
//! the statement was sent, is the timeout; earlier, a cancel.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use crate::connect::Canceller;
use crate::metrics as m;

/// After the consumer starts stopping, a statement still running gets this
/// long to end on its own (healthy ones take milliseconds) before it is
/// cancelled and its session given up.
pub(crate) const STOP_CANCEL_AFTER: Duration = Duration::from_millis(500);
/// How long a cancelled statement is waited for before its session is given
/// up without an answer.
pub(crate) const CANCELLED_WAIT: Duration = Duration::from_secs(5);

/// What a statement of the drain loop does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatementKind {
    /// Fetching due events (and, in competing mode, opening the claim transaction).
    Fetch,
    /// Marking acknowledged events published.
    AckWrite,
    /// Recording failed attempts (retry time, dead letters).
    FailWrite,
    /// Reading the earliest `next_retry_at`.
    NextRetryRead,
    /// Refreshing the backlog gauges (and forgetting gone relays).
    Gauges,
    /// Saying in `events.outbox_relays` whether this relay waits for wake-ups.
    Registration,
    /// Taking the outbox lock or partitions.
    Lock,
    /// Counting producers queued on NOTIFY's lock.
    NotifyLockWaiters,
    /// Committing a competing-mode claim transaction.
    ClaimCommit,
    /// Preparing a new session's statements.
    SessionSetup,
    /// Taking, confirming or releasing the leadership term.
    Term,
}

impl StatementKind {
    /// Every kind, in the order of [`m::TIMEOUT_STATEMENTS`].
    #[cfg(test)]
    pub(crate) const ALL: [StatementKind; 11] = [
        StatementKind::Fetch,
        StatementKind::AckWrite,
        StatementKind::FailWrite,
        StatementKind::NextRetryRead,
        StatementKind::Gauges,
        StatementKind::Registration,
        StatementKind::Lock,
        StatementKind::NotifyLockWaiters,
        StatementKind::ClaimCommit,
        StatementKind::SessionSetup,
        StatementKind::Term,
    ];

    /// The `statement` label of [`m::STATEMENT_TIMEOUTS`].
    pub(crate) fn label(self) -> &'static str {
        match self {
            StatementKind::Fetch => "fetch",
            StatementKind::AckWrite => "ack_write",
            StatementKind::FailWrite => "fail_write",
            StatementKind::NextRetryRead => "next_retry_read",
            StatementKind::Gauges => "gauges",
            StatementKind::Registration => "registration",
            StatementKind::Lock => "lock",
            StatementKind::NotifyLockWaiters => "notify_lock_waiters",
            StatementKind::ClaimCommit => "claim_commit",
            StatementKind::SessionSetup => "session_setup",
            StatementKind::Term => "term",
        }
    }

    /// What the statement was doing, for log lines.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            StatementKind::Fetch => "fetch",
            StatementKind::AckWrite => "writing acknowledgements",
            StatementKind::FailWrite => "writing failures",
            StatementKind::NextRetryRead => "reading the next retry time",
            StatementKind::Gauges => "refreshing backlog gauges",
            StatementKind::Registration => "registering for wake-ups",
            StatementKind::Lock => "taking the outbox lock or partitions",
            StatementKind::NotifyLockWaiters => "counting NOTIFY's lock waiters",
            StatementKind::ClaimCommit => "committing the claim transaction",
            StatementKind::SessionSetup => "preparing statements",
            StatementKind::Term => "taking or confirming the leadership term",
        }
    }
}

/// How a statement failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The statement timeout cut it (SQLSTATE 57014 after at least the timeout).
    TimedOut(tokio_postgres::Error),
    /// The consumer was stopping: the statement was cancelled (or not
    /// waited for any longer), and its session must not be used again.
    Stopped,
    /// Any other error.
    Db(tokio_postgres::Error),
}

/// A failed statement of the drain loop.
#[derive(Debug)]
pub(crate) struct StatementError {
    pub(crate) kind: StatementKind,
    pub(crate) failure: Failure,
}

impl StatementError {
    /// Classify the error of a statement of `kind` that ran for `elapsed`
    /// on a session whose statement timeout is `timeout` (zero: none).
    pub(crate) fn new(kind: StatementKind, e: tokio_postgres::Error, elapsed: Duration, timeout: Duration) -> Self {
        let failure = if is_timeout(&e, elapsed, timeout) { Failure::TimedOut(e) } else { Failure::Db(e) };
        StatementError { kind, failure }
    }

    /// A plain error of a statement of `kind` (not a timeout, not stopping).
    pub(crate) fn db(kind: StatementKind, e: tokio_postgres::Error) -> Self {
        StatementError { kind, failure: Failure::Db(e) }
    }
}

/// Whether `e`, from a statement that ran for `elapsed`, is the statement
/// timeout `timeout` (zero: none) at work.
pub(crate) fn is_timeout(e: &tokio_postgres::Error, elapsed: Duration, timeout: Duration) -> bool {
    !timeout.is_zero() && e.code() == Some(&SqlState::QUERY_CANCELED) && elapsed >= timeout
}

/// Log and count a statement of `kind` cut by the statement timeout.
pub(crate) fn record_timeout(
    kind: StatementKind,
    timeout: Duration,
    e: &tokio_postgres::Error,
    retry_in: Option<Duration>,
) {
    crate::metrics::counter!(m::STATEMENT_TIMEOUTS, "statement" => kind.label()).increment(1);
    let error = crate::error::report(e);
    match retry_in {
        Some(delay) => tracing::warn!(statement = kind.label(), timeout = ?timeout, retry_in = ?delay, error = %error,
            "statement timeout: the server cancelled a statement ({}) after {timeout:?}; reconnecting", kind.describe()),
        None => tracing::warn!(statement = kind.label(), timeout = ?timeout, error = %error,
            "statement timeout: the server cancelled a statement ({}) after {timeout:?}", kind.describe()),
    }
}

/// One session's cancel requests, how many of its statements are in
/// flight (so one may be cancelled when the session is given up), and when
/// its last statement ended (how long the server has seen it idle).
#[derive(Debug, Clone)]
pub(crate) struct Session {
    canceller: Canceller,
    in_flight: Arc<AtomicUsize>,
    last_ended: Arc<Mutex<Instant>>,
}

impl Session {
    pub(crate) fn new(canceller: Canceller) -> Self {
        Session {
            canceller,
            in_flight: Arc::new(AtomicUsize::new(0)),
            last_ended: Arc::new(Mutex::new(Instant::now())),
        }
    }

    /// Whether a statement of this session may be running.
    pub(crate) fn busy(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) > 0
    }

    /// How long the session has had no statement running: zero while one
    /// runs, else the time since the last one ended (or since the session
    /// was opened). What the server counts against `idle_session_timeout`.
    pub(crate) fn idle_for(&self) -> Duration {
        if self.busy() {
            return Duration::ZERO;
        }
        self.last_ended.lock().unwrap_or_else(std::sync::PoisonError::into_inner).elapsed()
    }

    /// Send a cancel request now and wait for it to be sent (bounded).
    pub(crate) async fn cancel(&self) -> bool {
        self.canceller.cancel().await
    }

    /// Send a cancel request from a task of its own (best effort: nothing
    /// happens outside a Tokio runtime).
    pub(crate) fn cancel_in_background(&self) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let canceller = self.canceller.clone();
            rt.spawn(async move {
                canceller.cancel().await;
            });
        }
    }

    /// Mark a statement in flight until the returned guard is finished or
    /// dropped; a guard dropped unfinished (its statement's future was
    /// dropped mid-way) cancels the statement.
    fn begin(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight { session: self.clone(), finished: false }
    }
}

struct InFlight {
    session: Session,
    finished: bool,
}

impl InFlight {
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.session.last_ended.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
        self.session.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.session.cancel_in_background();
        }
    }
}

/// Run the statement(s) `fut` of `kind` on `session`, whose statement
/// timeout is `timeout` (zero: none), and classify a failure.
///
/// When `stop` resolves first, the statement gets [`STOP_CANCEL_AFTER`] to
/// end on its own; then it is cancelled with a cancel request and waited
/// for at most [`CANCELLED_WAIT`], and the result is [`Failure::Stopped`]
/// (the session must be given up: a cancel request may still land on a
/// later statement). A statement that ends within the grace keeps its
/// result.
pub(crate) async fn run<T, F, S>(
    kind: StatementKind,
    session: &Session,
    timeout: Duration,
    stop: S,
    fut: F,
) -> Result<T, StatementError>
where
    F: Future<Output = Result<T, tokio_postgres::Error>>,
    S: Future<Output = ()>,
{
    let started = Instant::now();
    let guard = session.begin();
    tokio::pin!(fut);
    tokio::pin!(stop);
    let res = tokio::select! {
        biased;
        r = &mut fut => r,
        _ = &mut stop => match tokio::time::timeout(STOP_CANCEL_AFTER, &mut fut).await {
            Ok(r) => r,
            Err(_) => {
                tracing::debug!(statement = kind.label(), "stopping: cancelling a statement still running ({})", kind.describe());
                session.cancel().await;
                let _ = tokio::time::timeout(CANCELLED_WAIT, &mut fut).await;
                guard.finish();
                return Err(StatementError { kind, failure: Failure::Stopped });
            }
        },
    };
    guard.finish();
    res.map_err(|e| StatementError::new(kind, e, started.elapsed(), timeout))
}

/// [`run`] without a stop signal: the statement runs to its end (or its
/// timeout).
pub(crate) async fn run_to_end<T, F>(
    kind: StatementKind,
    session: &Session,
    timeout: Duration,
    fut: F,
) -> Result<T, StatementError>
where
    F: Future<Output = Result<T, tokio_postgres::Error>>,
{
    run(kind, session, timeout, std::future::pending(), fut).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_match_the_metric_label_list() {
        let labels: Vec<&str> = StatementKind::ALL.iter().map(|k| k.label()).collect();
        assert_eq!(labels, m::TIMEOUT_STATEMENTS);
        for k in StatementKind::ALL {
            assert!(!k.describe().is_empty());
        }
    }
}

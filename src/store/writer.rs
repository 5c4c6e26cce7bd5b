//! The drain loop's writer session, typed: acknowledgements and failures
//! ([`ACK`], [`FAIL`]), each a batch in one statement that runs to its end
//! or its statement timeout, and changes nothing unless the writer's term
//! is still current (the fence of [`ACK`] and [`FAIL`]). Both are idempotent (an acknowledged row is
//! skipped, a failure applies only while the row's `retry_count` is still
//! the one fetched), so a write whose reply was lost is written again.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement};

use super::settle::{ACK, AckCommit, FAIL, Fence, SUBSCRIPTION_ACK, SUBSCRIPTION_FAIL, fail_details};
use super::statement::{self, Session, StatementError, StatementKind};
use super::subscription::Reader;
use super::subscription_claim::ClaimCheckpoint;

/// A failed attempt to record ([`FAIL`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FailParams<'a> {
    pub(crate) id: i64,
    /// The error, as stored in `last_error`.
    pub(crate) error: &'a str,
    /// Delay until the retry (unless the event becomes a dead letter).
    pub(crate) delay: Duration,
    /// The row's `retry_count` when it was fetched: the failure applies only
    /// while it is still that.
    pub(crate) retry_count: i32,
}

/// What an acknowledgement write published.
#[derive(Debug, Default)]
pub(crate) struct Acknowledged {
    /// The write's term was no longer current: nothing was written.
    pub(crate) fenced: bool,
    /// Rows marked published now (not before).
    pub(crate) published: u64,
    /// For each of them, seconds from `occurred_at` to now.
    pub(crate) lags_secs: Vec<f64>,
}

/// What a failure write changed.
#[derive(Debug, Default)]
pub(crate) struct FailsWritten {
    /// The write's term was no longer current: nothing was written.
    pub(crate) fenced: bool,
    /// The rows changed.
    pub(crate) rows: Vec<FailWritten>,
}

/// A failure written ([`FAIL`]'s `RETURNING`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FailWritten {
    pub(crate) id: i64,
    /// The failure made the event a dead letter.
    pub(crate) dead: bool,
    /// Seconds until its retry is due (none for a dead letter).
    pub(crate) retry_in_secs: Option<f64>,
}

/// The writer session: its client, cancel requests, statement timeout and
/// prepared statements. Cheap to clone (a write runs in a task of its own).
#[derive(Clone)]
pub(crate) struct WriterSession {
    client: Arc<Client>,
    session: Session,
    timeout: Duration,
    ack: Statement,
    fail: Statement,
    /// Where a named subscription's writes take their checkpoint.
    checkpoint: CheckpointFrom,
    /// Whose events it settles: the default subscription's statements
    /// ([`ACK`], [`FAIL`]) or a named one's ([`SUBSCRIPTION_ACK`],
    /// [`SUBSCRIPTION_FAIL`]).
    reader: Reader,
    /// How a named subscription's settlements commit.
    commit: AckCommit,
}

/// Where a named subscription's settlement writes take the checkpoint they
/// pass on (`super::subscription::checkpoint_sql`).
#[derive(Clone)]
enum CheckpointFrom {
    /// The default subscription: none.
    None,
    /// A read in a statement of its own before each write (single and
    /// partitioned modes: the writer session is outside any transaction).
    Read(Statement),
    /// The one the claim transaction read as it began (competing mode:
    /// the writes run in that transaction, which by then has a
    /// transaction id of its own: `super::subscription_claim`).
    Claim(ClaimCheckpoint),
}

impl WriterSession {
    /// Prepare `client`'s statements for `reader`'s settlements until
    /// `stop` resolves; with `claim`, a named subscription's writes inside
    /// its claim transactions, which take that transaction's checkpoint.
    /// A named subscription's writes commit as `commit` says.
    pub(crate) async fn prepare(
        client: Arc<Client>,
        session: Session,
        timeout: Duration,
        (reader, claim, commit): (Reader, Option<ClaimCheckpoint>, AckCommit),
        stop: impl Future<Output = ()>,
    ) -> Result<Self, StatementError> {
        let (ack_sql, fail_sql) = match reader {
            Reader::Default => (ACK, FAIL),
            Reader::Subscription(_) => (SUBSCRIPTION_ACK, SUBSCRIPTION_FAIL),
        };
        let write = async {
            let checkpoint = match (&reader, claim) {
                (Reader::Default, _) => CheckpointFrom::None,
                (Reader::Subscription(_), Some(claim)) => CheckpointFrom::Claim(claim),
                (Reader::Subscription(_), None) => {
                    CheckpointFrom::Read(client.prepare(&super::subscription::checkpoint_sql()).await?)
                }
            };
            Ok((client.prepare(ack_sql).await?, client.prepare(fail_sql).await?, checkpoint))
        };
        let (ack, fail, checkpoint) =
            statement::run(StatementKind::SessionSetup, &session, timeout, stop, write).await?;
        Ok(WriterSession { client, session, timeout, ack, fail, checkpoint, reader, commit })
    }

    /// A named subscription's checkpoint, read in a statement of its own
    /// before its write (`(None, None)` for the default subscription).
    async fn checkpoint(&self, kind: StatementKind) -> Result<(Option<i64>, Option<i64>), StatementError> {
        let read = match &self.checkpoint {
            CheckpointFrom::None => return Ok((None, None)),
            CheckpointFrom::Claim(claim) => return Ok(claim.get()),
            CheckpointFrom::Read(read) => read,
        };
        let row = statement::run_to_end(kind, &self.session, self.timeout, self.client.query_one(read, &[])).await?;
        let int = |c: &str| row.try_get::<_, Option<i64>>(c).map_err(|e| StatementError::db(kind, e));
        Ok((int("top")?, int("next_xid")?))
    }

    /// The session's cancel requests and statements in flight.
    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    /// Mark `ids` published if every term of `fence` is still current
    /// (`None`: the consumer holds no term, and the write is not fenced).
    pub(crate) async fn ack(&self, ids: &[i64], fence: Option<&Fence>) -> Result<Acknowledged, StatementError> {
        if ids.is_empty() {
            return Ok(Acknowledged::default());
        }
        let fence = fence.map(Fence::to_json);
        let name = self.reader.subscription();
        let (top, next) = self.checkpoint(StatementKind::AckWrite).await?;
        let commit = self.commit.setting();
        let params: Vec<&(dyn ToSql + Sync)> = match &name {
            None => vec![&ids, &fence],
            Some(name) => vec![&ids, &fence, name, &top, &next, &commit],
        };
        let acked = self.client.query(&self.ack, &params);
        let rows = statement::run_to_end(StatementKind::AckWrite, &self.session, self.timeout, acked).await?;
        let lags_secs: Vec<f64> = rows.iter().filter_map(lag).collect();
        Ok(Acknowledged { fenced: !rows.iter().all(current), published: lags_secs.len() as u64, lags_secs })
    }

    /// Record `fails` if every term of `fence` is still current (`None`:
    /// not fenced); the
    /// failure that brings `retry_count` to `max_retries` makes an event a
    /// dead letter. Returns the rows changed.
    pub(crate) async fn fail(
        &self,
        fails: &[FailParams<'_>],
        max_retries: i32,
        fence: Option<&Fence>,
    ) -> Result<FailsWritten, StatementError> {
        if fails.is_empty() {
            return Ok(FailsWritten::default());
        }
        let ids: Vec<i64> = fails.iter().map(|f| f.id).collect();
        let details = fail_details(fails.iter().map(|f| (f.id, f.error, f.delay.as_secs_f64(), f.retry_count)));
        let fence = fence.map(Fence::to_json);
        let name = self.reader.subscription();
        let (top, next) = self.checkpoint(StatementKind::FailWrite).await?;
        let commit = self.commit.setting();
        let params: Vec<&(dyn ToSql + Sync)> = match &name {
            None => vec![&ids, &details, &max_retries, &fence],
            Some(name) => vec![&details, &max_retries, &fence, name, &top, &next, &commit],
        };
        let failed = self.client.query(&self.fail, &params);
        let rows = statement::run_to_end(StatementKind::FailWrite, &self.session, self.timeout, failed).await?;
        Ok(FailsWritten { fenced: !rows.iter().all(current), rows: rows.iter().filter_map(fail_written).collect() })
    }
}

/// The fence's verdict on a row of [`ACK`] or [`FAIL`] (a row without it
/// is not expected; it counts as current, as the statement wrote it).
fn current(row: &Row) -> bool {
    row.try_get::<_, bool>("current").unwrap_or(true)
}

fn lag(row: &Row) -> Option<f64> {
    row.try_get::<_, Option<f64>>("lag").ok().flatten()
}

/// A changed row of [`FAIL`]; `None` for the row of a write that changed
/// nothing (its `id` is NULL).
fn fail_written(row: &Row) -> Option<FailWritten> {
    Some(FailWritten {
        id: row.try_get::<_, Option<i64>>("id").ok().flatten()?,
        dead: row.try_get::<_, Option<bool>>("dead").ok().flatten().unwrap_or(false),
        retry_in_secs: row.try_get::<_, Option<f64>>("retry_in").ok().flatten(),
    })
}

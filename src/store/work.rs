//! The drain loop's work session, typed: one method per statement it runs
//! (fetch, claim, the earliest retry, registration, gauges, locks). Each
//! takes its parameters as values or a struct, runs as a statement of its
//! [`StatementKind`] (stop, timeout and cancel handling:
//! [`statement::run`]) and returns typed results; SQL text, parameter
//! positions and column names stay in this module.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use super::fetch::{BEGIN, COMMIT, NEXT_RETRY_IN, PayloadSizes, competing_fetch_sql, fetch_sql};
use super::fetch::{SUBSCRIPTION_NEXT_RETRY_IN, subscription_fetch_sql};
use super::leader::{BOUND_IDLE, BOUND_IDLE_IN_CLAIM, KEEP_ALIVE, RAISE_TERM, REGISTER_IDENTITY};
use super::leader::{CURRENT_TERM, CURRENT_TERMS, Holder, LEADER_HOLDER, RELEASE_TERM, TAKE_TERM, TERMINATE_STRANDED};
use super::leader::{TermTaken, holder_from_row};
use super::locks::{COMPETING_LOCK, COUNT_MEMBERS, MEMBER_LOCK, PARTITION_UNLOCK};
use super::locks::{TRY_LEADER_LOCK, TRY_PARTITION_LOCK};
use super::page::decode_stream;
pub(crate) use super::page::{FetchPage, FetchedRow, FloorReading, RowIdentity, Undecodable};
use super::settle::AckCommit;
use super::statement::{self, Session, StatementError, StatementKind};
use super::subscription::Reader;
use super::subscription_claim::{ClaimCheckpoint, SubscriptionClaim};
use super::wakeup::{HEARTBEAT, NOTIFICATION_QUEUE_USAGE, NOTIFY_LOCK_WAITERS, SET_WAITING, UNREGISTER};
use crate::term::Term;

/// Which fetch a work session prepares: what its source reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FetchKind {
    /// Every due row in id order, hold-back applied (single mode).
    Ordered,
    /// Due rows of some hash partitions of the aggregates (partitioned mode).
    Partitioned,
    /// Due rows claimed with `FOR UPDATE SKIP LOCKED` (competing mode).
    Claim,
}

/// Which rows a fetch may take.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FetchScope<'a> {
    /// Every due row (single mode, as the active consumer).
    All,
    /// Rows of the partitions `owned`, out of `partitions`.
    Partitions { partitions: u32, owned: &'a [i32] },
    /// Rows claimed in a new transaction, held open until
    /// [`WorkSession::commit_claim`] (competing mode).
    Claim,
}

/// The parameters of a fetch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FetchParams<'a> {
    /// Ids in flight (handed out, or settled and not yet written): never
    /// returned. A claim ignores them (its row locks exclude them).
    pub(crate) exclude: &'a [i64],
    /// Rows at most.
    pub(crate) batch: usize,
    /// Payload bytes at most, as received, but always one row.
    pub(crate) budget: i64,
    pub(crate) scope: FetchScope<'a>,
    /// The fetch floor and its checkpoint (ordered fetches; a claim
    /// ignores it).
    pub(crate) floor: FloorParams,
}

/// The fetch floor's parameters ([`super::fetch::fetch_sql`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FloorParams {
    /// Fresh rows are read above this id (`i64::MIN`: from the first).
    pub(crate) floor: i64,
    /// The checkpoint: an id a past fetch returned ...
    pub(crate) upto: i64,
    /// ... and the next transaction id that fetch saw (`i64::MAX`: none,
    /// the floor stays).
    pub(crate) next_xid: i64,
    /// The count of unblocks a past fetch read (`None`: none read, or none
    /// bumped yet): when the fetch reads another, it reads from the lower
    /// of `floor` and `held_below` ([`super::fetch::fetch_sql`]).
    pub(crate) unblocks: Option<i64>,
    /// The id just below the first held-back row a past fetch's floor
    /// passed (`i64::MAX`: none passed).
    pub(crate) held_below: i64,
    /// The count of rewinds a past fetch read (`None`: none read, or none
    /// bumped yet): when the fetch reads another, it reads from the first
    /// fresh row ([`super::fetch::fetch_sql`]).
    pub(crate) rewinds: Option<i64>,
}

impl FloorParams {
    /// The fetch floor's parameters in the order of the fetch's SQL
    /// (`super::fetch::fetch_sql`, `fetch_floor`: `$n`..`$n+5`).
    fn sql_params(&self) -> [&(dyn ToSql + Sync); 6] {
        [&self.floor, &self.upto, &self.next_xid, &self.unblocks, &self.held_below, &self.rewinds]
    }

    /// No floor: read from the first fresh row.
    pub(crate) const NONE: FloorParams = FloorParams {
        floor: i64::MIN,
        upto: i64::MIN,
        next_xid: i64::MAX,
        unblocks: None,
        held_below: i64::MAX,
        rewinds: None,
    };
}

/// The backlog gauges, read as `status` reads its figures
/// ([`super::backlog::read`]: exact up to a cap per class, estimated from a
/// sample beyond).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Gauges {
    /// Unpublished rows that are not dead letters.
    pub(crate) pending: i64,
    /// Dead letters.
    pub(crate) dead: i64,
    /// Age of the oldest pending row, in seconds (0 when none).
    pub(crate) oldest_age_secs: f64,
    /// Whether `pending` or `dead` is estimated.
    pub(crate) estimated: bool,
}

/// The work session: its client, its cancel requests and statements in
/// flight, its statement timeout, and its prepared statements.
pub(crate) struct WorkSession {
    client: Arc<Client>,
    session: Session,
    timeout: Duration,
    fetch: Statement,
    next_retry: Statement,
    /// Whose events it fetches, and whose leader lock it takes.
    reader: Reader,
    /// A named subscription's claim in competing mode (`fetch` is then
    /// unused).
    claim: Option<SubscriptionClaim>,
    /// How a named subscription's claim transactions commit.
    commit: AckCommit,
}

impl WorkSession {
    /// Prepare `client`'s statements for fetches of `kind`, until `stop`
    /// resolves. How the fetch measures payloads depends on the server's
    /// functions ([`PayloadSizes`]): read per session, so a reconnect to
    /// another server prepares what that one has. A named subscription's
    /// claim transactions commit as `commit` says.
    pub(crate) async fn prepare(
        client: Arc<Client>,
        session: Session,
        timeout: Duration,
        kind: FetchKind,
        (reader, commit): (Reader, AckCommit),
        stop: impl Future<Output = ()>,
    ) -> Result<Self, StatementError> {
        let work = async {
            let sizes = PayloadSizes::for_server(super::schema::read_server_version(&client).await?.num);
            let (sql, next_retry) = match (kind, &reader) {
                (FetchKind::Ordered, Reader::Default) => (fetch_sql(false, sizes), NEXT_RETRY_IN),
                (FetchKind::Partitioned, Reader::Default) => (fetch_sql(true, sizes), NEXT_RETRY_IN),
                (FetchKind::Claim, Reader::Default) => (competing_fetch_sql(sizes), NEXT_RETRY_IN),
                (FetchKind::Claim, Reader::Subscription(_)) => {
                    (super::subscription_claim::claimed_rows_sql(sizes), SUBSCRIPTION_NEXT_RETRY_IN)
                }
                (FetchKind::Ordered | FetchKind::Partitioned, Reader::Subscription(_)) => {
                    (subscription_fetch_sql(kind == FetchKind::Partitioned, sizes), SUBSCRIPTION_NEXT_RETRY_IN)
                }
            };
            let claim = match kind {
                FetchKind::Claim => SubscriptionClaim::prepare(&client, &reader, sizes).await?,
                FetchKind::Ordered | FetchKind::Partitioned => None,
            };
            Ok((client.prepare(&sql).await?, client.prepare(next_retry).await?, claim))
        };
        let (fetch, next_retry, claim) =
            statement::run(StatementKind::SessionSetup, &session, timeout, stop, work).await?;
        Ok(WorkSession { client, session, timeout, fetch, next_retry, reader, claim, commit })
    }

    /// The checkpoint a named subscription's claim transactions read, for
    /// the writer of competing mode (the same session); `None` otherwise.
    pub(crate) fn claim_checkpoint(&self) -> Option<ClaimCheckpoint> {
        self.claim.as_ref().map(SubscriptionClaim::checkpoint)
    }

    /// The session's cancel requests and statements in flight.
    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    /// Its statement timeout (zero: none).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn run<T>(
        &self,
        kind: StatementKind,
        stop: impl Future<Output = ()>,
        fut: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, StatementError> {
        statement::run(kind, &self.session, self.timeout, stop, fut).await
    }

    /// Fetch due events (see [`fetch_sql`], [`competing_fetch_sql`]); a
    /// claim first opens its transaction. Until `stop` resolves.
    pub(crate) async fn fetch(
        &self,
        p: FetchParams<'_>,
        stop: impl Future<Output = ()>,
    ) -> Result<FetchPage, StatementError> {
        let batch = i64::try_from(p.batch).unwrap_or(i64::MAX);
        let (exclude, budget, f) = (p.exclude, p.budget, p.floor);
        let client = &self.client;
        let fetch = async {
            match p.scope {
                FetchScope::All if let Some(name) = self.reader.subscription() => {
                    let params: [&(dyn ToSql + Sync); 4] = [&exclude, &batch, &budget, &name];
                    decode_stream(client.query_raw(&self.fetch, params).await?, budget, false).await
                }
                FetchScope::All => {
                    let params: Vec<&(dyn ToSql + Sync)> =
                        [&exclude as &(dyn ToSql + Sync), &batch, &budget].into_iter().chain(f.sql_params()).collect();
                    decode_stream(client.query_raw(&self.fetch, params).await?, budget, false).await
                }
                FetchScope::Partitions { partitions, owned } if let Some(name) = self.reader.subscription() => {
                    let partitions = i64::from(partitions);
                    let params: [&(dyn ToSql + Sync); 6] = [&exclude, &batch, &budget, &name, &partitions, &owned];
                    decode_stream(client.query_raw(&self.fetch, params).await?, budget, true).await
                }
                FetchScope::Partitions { partitions, owned } => {
                    let partitions = i64::from(partitions);
                    let params: Vec<&(dyn ToSql + Sync)> =
                        [&exclude as &(dyn ToSql + Sync), &batch, &budget, &partitions, &owned]
                            .into_iter()
                            .chain(f.sql_params())
                            .collect();
                    decode_stream(client.query_raw(&self.fetch, params).await?, budget, true).await
                }
                FetchScope::Claim if let (Some(claim), Some(name)) = (&self.claim, self.reader.subscription()) => {
                    client.batch_execute(self.commit.claim_begin()).await?;
                    claim.claim(client, name, batch, budget).await
                }
                FetchScope::Claim => {
                    client.batch_execute(BEGIN).await?;
                    let params: [&(dyn ToSql + Sync); 2] = [&batch, &budget];
                    decode_stream(client.query_raw(&self.fetch, params).await?, budget, false).await
                }
            }
        };
        self.run(StatementKind::Fetch, stop, fetch).await
    }

    /// A named subscription's fetch found nothing: move its cursor over what
    /// is settled, so an idle subscription's cursor (its figures, and what
    /// retention may delete) catches up without waiting for another event:
    /// a checkpoint read in a statement of its own, then an
    /// acknowledgement of no events that records it and passes the earlier
    /// ones (migration 0016, `events.outbox_subscription_advance`: safe
    /// from any session at any time, as it passes only settled, failed or
    /// held-back events). Nothing for the default subscription. Returns,
    /// for a named one, how far the highest id stands above its cursor as
    /// that checkpoint and the cursor before the move read them (`None`
    /// where ids do not follow transaction ids).
    pub(crate) async fn advance_idle(&self, stop: impl Future<Output = ()>) -> Result<Option<i64>, StatementError> {
        let Some(name) = self.reader.subscription() else { return Ok(None) };
        let advance = async {
            let row = self.client.query_one(&super::subscription::checkpoint_sql(), &[]).await?;
            let (top, next): (Option<i64>, Option<i64>) = (row.try_get("top")?, row.try_get("next_xid")?);
            let none: Vec<i64> = Vec::new();
            let commit = self.commit.setting();
            let params: [&(dyn ToSql + Sync); 5] = [&name, &none, &top, &next, &commit];
            let row = self.client.query_one(super::subscription::ADVANCE_IDLE, &params).await?;
            let cursor: Option<i64> = row.try_get("cursor_id")?;
            Ok(top.zip(cursor).map(|(top, cursor)| top - cursor))
        };
        self.run(StatementKind::Fetch, stop, advance).await
    }

    /// Commit the claim transaction, running to its end (or the timeout).
    pub(crate) async fn commit_claim(&self) -> Result<(), StatementError> {
        let commit = self.client.batch_execute(COMMIT);
        statement::run_to_end(StatementKind::ClaimCommit, &self.session, self.timeout, commit).await
    }

    /// Seconds until the earliest pending retry is due ([`NEXT_RETRY_IN`]),
    /// by the database's clock; `None` when none waits.
    pub(crate) async fn next_retry_in(&self, stop: impl Future<Output = ()>) -> Result<Option<f64>, StatementError> {
        let kind = StatementKind::NextRetryRead;
        let name = self.reader.subscription();
        let params: Vec<&(dyn ToSql + Sync)> = name.iter().map(|n| n as &(dyn ToSql + Sync)).collect();
        let row = self.run(kind, stop, self.client.query_one(&self.next_retry, &params)).await?;
        row.try_get::<_, Option<f64>>("retry_in").map_err(|e| StatementError::db(kind, e))
    }

    /// Write whether this relay waits for notifications ([`SET_WAITING`]).
    pub(crate) async fn set_waiting(
        &self,
        waiting: bool,
        stop: impl Future<Output = ()>,
    ) -> Result<(), StatementError> {
        let params: [&(dyn ToSql + Sync); 1] = [&waiting];
        self.run(StatementKind::Registration, stop, self.client.execute(SET_WAITING, &params)).await.map(drop)
    }

    /// Remove this relay's registration ([`UNREGISTER`]).
    pub(crate) async fn unregister(&self, stop: impl Future<Output = ()>) -> Result<(), StatementError> {
        self.run(StatementKind::Registration, stop, self.client.execute(UNREGISTER, &[])).await.map(drop)
    }

    /// Forget relays whose sessions are gone and refresh this session's
    /// heartbeat ([`HEARTBEAT`]).
    pub(crate) async fn heartbeat(&self, stop: impl Future<Output = ()>) -> Result<(), StatementError> {
        self.run(StatementKind::Registration, stop, self.client.execute(HEARTBEAT, &[])).await.map(drop)
    }

    /// Have the server end this session once idle for `after` ([`BOUND_IDLE`]):
    /// `Ok(false)` when the server has no such setting (PostgreSQL 13).
    pub(crate) async fn bound_idle(
        &self,
        after: Duration,
        stop: impl Future<Output = ()>,
    ) -> Result<bool, StatementError> {
        let kind = StatementKind::SessionSetup;
        let ms = crate::connect::setting_millis(after).to_string();
        let row = self.run(kind, stop, self.client.query_one(BOUND_IDLE, &[&ms])).await?;
        let set: Option<String> = row.try_get("set").map_err(|e| StatementError::db(kind, e))?;
        Ok(set.is_some())
    }

    /// Have the server end the session once idle for `after` inside a
    /// transaction ([`BOUND_IDLE_IN_CLAIM`]: competing mode).
    pub(crate) async fn bound_idle_in_claim(
        &self,
        after: Duration,
        stop: impl Future<Output = ()>,
    ) -> Result<(), StatementError> {
        let ms = crate::connect::setting_millis(after).to_string();
        self.run(StatementKind::SessionSetup, stop, self.client.execute(BOUND_IDLE_IN_CLAIM, &[&ms])).await?;
        Ok(())
    }

    /// Record this relay's process id, host name and version in the
    /// session's registration ([`REGISTER_IDENTITY`]); a schema without the
    /// columns (before migration 0015) records nothing.
    pub(crate) async fn register_identity(&self, stop: impl Future<Output = ()>) -> Result<(), StatementError> {
        let (pid, host, version) = super::leader::RelayIdentity::own();
        let params: [&(dyn ToSql + Sync); 3] = [&pid, &host, &version];
        match self.run(StatementKind::Registration, stop, self.client.execute(REGISTER_IDENTITY, &params)).await {
            Err(StatementError { failure: statement::Failure::Db(e), .. })
                if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) =>
            {
                Ok(())
            }
            r => r.map(drop),
        }
    }

    /// Tell the server the session is alive ([`KEEP_ALIVE`]).
    pub(crate) async fn keep_alive(&self, stop: impl Future<Output = ()>) -> Result<(), StatementError> {
        self.run(StatementKind::Registration, stop, self.client.execute(KEEP_ALIVE, &[])).await.map(drop)
    }

    /// Register this session as the holder of `scope` (the outbox, or a
    /// partition), with its first heartbeat, and take the scope's next
    /// leadership term ([`TAKE_TERM`]).
    /// Raise `scope`'s term, just taken by this session, above `seen`
    /// ([`RAISE_TERM`]): the new term.
    pub(crate) async fn raise_term(
        &self,
        scope: &str,
        seen: Term,
        stop: impl Future<Output = ()>,
    ) -> Result<Term, StatementError> {
        let kind = StatementKind::Term;
        let params: [&(dyn ToSql + Sync); 2] = [&scope, &seen.to_db()];
        let row = self.run(kind, stop, self.client.query_one(RAISE_TERM, &params)).await?;
        row.try_get("term").map_err(|e| StatementError::db(kind, e))
    }

    pub(crate) async fn take_term(
        &self,
        scope: &str,
        stop: impl Future<Output = ()>,
    ) -> Result<TermTaken, StatementError> {
        let kind = StatementKind::Term;
        let row = self.run(kind, stop, self.client.query_one(TAKE_TERM, &[&scope])).await?;
        let read = || -> Result<TermTaken, tokio_postgres::Error> {
            Ok(TermTaken {
                term: row.try_get("term")?,
                previous_released: row.try_get("previous_released")?,
                previous_term: row.try_get("previous_term")?,
            })
        };
        read().map_err(|e| StatementError::db(kind, e))
    }

    /// `scope`'s current leadership term ([`CURRENT_TERM`]; `None` when
    /// none was ever taken).
    pub(crate) async fn current_term(
        &self,
        scope: &str,
        stop: impl Future<Output = ()>,
    ) -> Result<Option<Term>, StatementError> {
        let kind = StatementKind::Term;
        let row = self.run(kind, stop, self.client.query_one(CURRENT_TERM, &[&scope])).await?;
        row.try_get::<_, Option<Term>>("term").map_err(|e| StatementError::db(kind, e))
    }

    /// The current terms of `scopes` ([`CURRENT_TERMS`]), scope to term;
    /// a scope without one is missing.
    pub(crate) async fn current_terms(
        &self,
        scopes: &[String],
        stop: impl Future<Output = ()>,
    ) -> Result<std::collections::BTreeMap<String, Term>, StatementError> {
        let kind = StatementKind::Term;
        let rows = self.run(kind, stop, self.client.query(CURRENT_TERMS, &[&scopes])).await?;
        rows.iter()
            .map(|r| Ok((r.try_get::<_, String>("scope")?, r.try_get::<_, Term>("term")?)))
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(|e| StatementError::db(kind, e))
    }

    /// Mark `scope`'s `term` released: its holder hands out nothing more
    /// of it ([`RELEASE_TERM`]).
    pub(crate) async fn release_term(
        &self,
        scope: &str,
        term: Term,
        stop: impl Future<Output = ()>,
    ) -> Result<(), StatementError> {
        let (kind, term) = (StatementKind::Term, term.to_db());
        self.run(kind, stop, self.client.execute(RELEASE_TERM, &[&scope, &term])).await.map(drop)
    }

    /// The holder of the leader lock, judged against `threshold_secs`
    /// ([`LEADER_HOLDER`]); `None` when nobody holds it.
    pub(crate) async fn leader_holder(
        &self,
        threshold_secs: f64,
        stop: impl Future<Output = ()>,
    ) -> Result<Option<Holder>, StatementError> {
        let kind = StatementKind::Lock;
        let key = self.reader.leader_key();
        let params: [&(dyn ToSql + Sync); 2] = [&key, &threshold_secs];
        let row = self.run(kind, stop, self.client.query_opt(LEADER_HOLDER, &params)).await?;
        row.as_ref().map(holder_from_row).transpose().map_err(|e| StatementError::db(kind, e))
    }

    /// End `holder`'s backend if it still holds the leader lock and is still
    /// stranded against `threshold_secs` ([`TERMINATE_STRANDED`]): `true`
    /// when the server signalled it.
    pub(crate) async fn terminate_stranded(
        &self,
        holder: &Holder,
        threshold_secs: f64,
        stop: impl Future<Output = ()>,
    ) -> Result<bool, StatementError> {
        let kind = StatementKind::Lock;
        let (pid, start) = (holder.id.pid, holder.id.backend_start);
        let key = self.reader.leader_key();
        let params: [&(dyn ToSql + Sync); 4] = [&key, &threshold_secs, &pid, &start];
        let row = self.run(kind, stop, self.client.query_opt(TERMINATE_STRANDED, &params)).await?;
        Ok(row.and_then(|r| r.try_get::<_, bool>("ended").ok()).unwrap_or(false))
    }

    /// Producers waiting on NOTIFY's commit lock ([`NOTIFY_LOCK_WAITERS`]).
    pub(crate) async fn notify_lock_waiters(&self, stop: impl Future<Output = ()>) -> Result<i64, StatementError> {
        let look = self.client.query_one(NOTIFY_LOCK_WAITERS, &[]);
        let row = self.run(StatementKind::NotifyLockWaiters, stop, look).await?;
        Ok(row.try_get::<_, i64>("waiters").unwrap_or(0))
    }

    /// The notification queue's usage, 0 to 1 (`None` if unreadable).
    pub(crate) async fn notification_queue_usage(
        &self,
        stop: impl Future<Output = ()>,
    ) -> Result<Option<f64>, StatementError> {
        let usage = self.client.query_one(NOTIFICATION_QUEUE_USAGE, &[]);
        let row = self.run(StatementKind::Gauges, stop, usage).await?;
        Ok(row.try_get::<_, f64>("usage").ok())
    }

    /// Whose events this session reads.
    pub(crate) fn reader(&self) -> &Reader {
        &self.reader
    }

    /// Another delivery configuration than `mine` among its outbox's (or
    /// subscription's) relays, held by a session older than this one
    /// ([`super::leader::configuration_conflict`]): the message to stop
    /// with.
    pub(crate) async fn configuration_conflict(
        &self,
        mine: &str,
        stop: impl Future<Output = ()>,
    ) -> Result<Option<String>, StatementError> {
        let read = async {
            let rows = super::leader::other_configurations(self.client.as_ref(), &self.reader).await?;
            super::leader::conflict_among(&rows, &self.reader, mine, true)
        };
        self.run(StatementKind::Gauges, stop, read).await
    }

    /// Every subscription's lag against its bound
    /// ([`super::subscription_lag::LAGS`]), for the alert.
    pub(crate) async fn subscription_lags(
        &self,
        stop: impl Future<Output = ()>,
    ) -> Result<Vec<super::subscription_lag::Lag>, StatementError> {
        let kind = StatementKind::Gauges;
        let rows = self.run(kind, stop, self.client.query(super::subscription_lag::LAGS, &[])).await?;
        rows.iter()
            .map(|r| {
                Ok(super::subscription_lag::Lag {
                    name: r.try_get("name")?,
                    lag_seconds: r.try_get("lag")?,
                    max_lag_seconds: r.try_get("max_lag")?,
                    state: r.try_get("state")?,
                    expire: r.try_get("expire")?,
                })
            })
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(|e| StatementError::db(kind, e))
    }

    /// What holds this named subscription's cursor
    /// ([`super::subscription_lag::WINDOW_HOLDER`]); the default when it is
    /// the default subscription, or gone.
    pub(crate) async fn window_holder(
        &self,
        stop: impl Future<Output = ()>,
    ) -> Result<super::subscription_lag::WindowHolder, StatementError> {
        let Some(name) = self.reader.subscription() else { return Ok(Default::default()) };
        let kind = StatementKind::Gauges;
        let params: [&(dyn ToSql + Sync); 1] = [&name];
        let read = self.client.query_opt(super::subscription_lag::WINDOW_HOLDER, &params);
        let Some(row) = self.run(kind, stop, read).await? else { return Ok(Default::default()) };
        let holder = || -> Result<_, tokio_postgres::Error> {
            let pid: Option<i32> = row.try_get("pid")?;
            let app: Option<String> = row.try_get("application_name")?;
            let secs: Option<f64> = row.try_get("open_secs")?;
            Ok(super::subscription_lag::WindowHolder {
                event_id: row.try_get("event_id")?,
                writer: pid.map(|pid| (pid, app.unwrap_or_default(), secs.unwrap_or(0.0))),
            })
        };
        holder().map_err(|e| StatementError::db(kind, e))
    }

    /// Mark subscription `name` expired if it still must
    /// ([`super::subscription_lag::EXPIRE`]); returns its lag and bound
    /// (seconds) when it did.
    pub(crate) async fn expire_subscription(
        &self,
        name: &str,
        stop: impl Future<Output = ()>,
    ) -> Result<Option<(f64, f64)>, StatementError> {
        let kind = StatementKind::Gauges;
        let row = self.run(kind, stop, self.client.query_opt(super::subscription_lag::EXPIRE, &[&name])).await?;
        row.map(|r| Ok((r.try_get("lag")?, r.try_get("max_lag")?)))
            .transpose()
            .map_err(|e: tokio_postgres::Error| StatementError::db(kind, e))
    }

    /// The backlog gauges ([`Gauges`]).
    pub(crate) async fn gauges(&self, stop: impl Future<Output = ()>) -> Result<Gauges, StatementError> {
        use super::backlog::Class;
        if let Some(name) = self.reader.subscription() {
            let (kind, cap) = (StatementKind::Gauges, super::STATUS_EXACT_ROWS);
            let params: [&(dyn ToSql + Sync); 2] = [&name, &cap];
            let row = self.run(kind, stop, self.client.query_one(super::subscription::GAUGES, &params)).await?;
            let count = |c: &str| row.try_get::<_, i64>(c).map_err(|e| StatementError::db(kind, e));
            let (fresh, waiting, dead) = (count("fresh")?, count("waiting")?, count("dead")?);
            return Ok(Gauges {
                pending: fresh + waiting,
                dead,
                oldest_age_secs: row.try_get::<_, Option<f64>>("oldest_age").ok().flatten().unwrap_or(0.0),
                estimated: fresh > cap || waiting > cap || dead > cap,
            });
        }
        let b = self.run(StatementKind::Gauges, stop, super::backlog::read(&*self.client)).await?;
        Ok(Gauges {
            pending: b.total(Class::Fresh) + b.total(Class::Due) + b.total(Class::Waiting),
            dead: b.total(Class::Dead),
            oldest_age_secs: b.oldest_age.unwrap_or(0.0),
            estimated: !b.estimated.is_empty(),
        })
    }

    /// Try single mode's leader lock of its reader ([`TRY_LEADER_LOCK`],
    /// [`Reader::leader_key`]): held by this
    /// session from now on when `true`.
    pub(crate) async fn try_leader_lock(&self, stop: impl Future<Output = ()>) -> Result<bool, StatementError> {
        let key = self.reader.leader_key();
        let row = self.run(StatementKind::Lock, stop, self.client.query_one(TRY_LEADER_LOCK, &[&key])).await?;
        Ok(row.try_get::<_, bool>(0).unwrap_or(false))
    }

    /// Take the membership lock `key` ([`MEMBER_LOCK`]) for this session's
    /// lifetime (partitioned mode).
    pub(crate) async fn take_member_lock(
        &self,
        key: i32,
        stop: impl Future<Output = ()>,
    ) -> Result<(), StatementError> {
        let class = self.reader.member_class();
        let params: [&(dyn ToSql + Sync); 2] = [&class, &key];
        self.run(StatementKind::SessionSetup, stop, self.client.execute(MEMBER_LOCK, &params)).await.map(drop)
    }

    /// Hold competing mode's membership lock for the session's lifetime
    /// ([`COMPETING_LOCK`]).
    pub(crate) async fn take_competing_lock(&self, stop: impl Future<Output = ()>) -> Result<(), StatementError> {
        let class = self.reader.competing_class();
        self.run(StatementKind::SessionSetup, stop, self.client.execute(COMPETING_LOCK, &[&class])).await.map(drop)
    }

    /// Consumers holding a membership lock ([`COUNT_MEMBERS`]).
    pub(crate) async fn count_members(&self, stop: impl Future<Output = ()>) -> Result<i64, StatementError> {
        let kind = StatementKind::Lock;
        let class = self.reader.member_class();
        let row = self.run(kind, stop, self.client.query_one(COUNT_MEMBERS, &[&class])).await?;
        row.try_get("members").map_err(|e| StatementError::db(kind, e))
    }

    /// Try partition `p`'s lock ([`TRY_PARTITION_LOCK`]).
    pub(crate) async fn try_partition_lock(
        &self,
        p: i32,
        stop: impl Future<Output = ()>,
    ) -> Result<bool, StatementError> {
        let kind = StatementKind::Lock;
        let class = self.reader.partition_class();
        let row = self.run(kind, stop, self.client.query_one(TRY_PARTITION_LOCK, &[&class, &p])).await?;
        row.try_get::<_, bool>(0).map_err(|e| StatementError::db(kind, e))
    }

    /// Give up partition `p`'s lock ([`PARTITION_UNLOCK`]).
    pub(crate) async fn unlock_partition(&self, p: i32, stop: impl Future<Output = ()>) -> Result<(), StatementError> {
        let class = self.reader.partition_class();
        let params: [&(dyn ToSql + Sync); 2] = [&class, &p];
        self.run(StatementKind::Lock, stop, self.client.execute(PARTITION_UNLOCK, &params)).await.map(drop)
    }
}

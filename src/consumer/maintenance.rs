//! Maintenance on the work session: the relay's registration in
//! `events.outbox_relays` (whether it waits for notifications), the backlog
//! gauges, forgetting relays that are gone, the notification queue's usage,
//! and the look at producers queueing on NOTIFY's commit lock.
//!
//! None of these is needed to deliver: a database error in them is logged
//! and the loop goes on (registration aside, whose flag producers read). A
//! statement timeout on the gauges cuts only that read; any other failure
//! (a timeout elsewhere, a stop) is returned for the loop to handle as a
//! failed session.

use tokio::time::{Instant, sleep_until};

use super::session::Conn;
use super::statement::{self, Failure, Kind, StatementError};
use crate::metrics as m;
use crate::store;

/// The backlog gauges ([`store::GAUGES`]) count every unpublished row, so
/// their cost grows with the backlog (about 0.3 s for 430 000 rows of
/// 1.5 KB here). They are read every [`super::STATUS_INTERVAL`] or, when a
/// read took longer than this share of that, less often, so that they never
/// take more than this share (1/20) of the drain loop's time while a large
/// backlog drains.
const GAUGES_SHARE: u32 = 20;

/// Maintenance state.
#[derive(Debug, Default)]
pub(super) struct Maintenance {
    /// The backlog gauges are read again no earlier than this.
    gauges_due: Option<Instant>,
    /// A failed look at `pg_locks` was logged as a warning (once).
    queue_look_warned: bool,
}

type Stop = tokio_util::sync::CancellationToken;

impl Maintenance {
    /// Write whether this relay waits for notifications; the loop's wake-up
    /// policy learns it when this succeeds.
    pub(super) async fn set_waiting(&self, conn: &Conn, stop: &Stop, waiting: bool) -> Result<(), StatementError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&waiting];
        conn.run(Kind::Registration, stop.cancelled(), conn.client.execute(store::SET_WAITING, &params)).await?;
        metrics::gauge!(m::WAITING_FOR_NOTIFICATIONS).set(if waiting { 1.0 } else { 0.0 });
        Ok(())
    }

    /// How many producers wait on NOTIFY's commit lock (0 when `pg_locks`
    /// cannot be read: warned once, then at debug level).
    pub(super) async fn notify_lock_waiters(&mut self, conn: &Conn, stop: &Stop) -> Result<i64, StatementError> {
        let look = conn.client.query_one(store::NOTIFY_LOCK_WAITERS, &[]);
        match conn.run(Kind::NotifyLockWaiters, stop.cancelled(), look).await {
            Ok(row) => Ok(row.try_get::<_, i64>("waiters").unwrap_or(0)),
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                let error = crate::error::report(&e);
                if self.queue_look_warned {
                    tracing::debug!(error = %error, "could not count NOTIFY's lock waiters");
                } else {
                    self.queue_look_warned = true;
                    tracing::warn!(error = %error,
                        "could not read pg_locks: producers queueing for NOTIFY's commit lock go unnoticed \
                         (the other busy rules still apply)");
                }
                Ok(0)
            }
            Err(e) => Err(e),
        }
    }

    /// When due, refresh the backlog gauges, forget gone relays and read the
    /// notification queue's usage.
    pub(super) async fn refresh(&mut self, conn: &Conn, stop: &Stop) -> Result<(), StatementError> {
        if self.gauges_due.is_some_and(|at| Instant::now() < at) {
            return Ok(());
        }
        self.read_gauges(conn, stop).await?;
        let forget = conn.client.execute(store::FORGET_GONE_RELAYS, &[]);
        match conn.run(Kind::Registration, stop.cancelled(), forget).await {
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                tracing::debug!(error = %crate::error::report(&e), "could not forget gone relays")
            }
            r => r.map(drop)?,
        }
        let usage = conn.client.query_one(store::NOTIFICATION_QUEUE_USAGE, &[]);
        match conn.run(Kind::Gauges, stop.cancelled(), usage).await {
            Ok(row) => {
                if let Ok(usage) = row.try_get::<_, f64>("usage") {
                    metrics::gauge!(m::NOTIFICATION_QUEUE_USAGE).set(usage);
                }
                Ok(())
            }
            Err(StatementError { failure: Failure::Db(_), .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn read_gauges(&mut self, conn: &Conn, stop: &Stop) -> Result<(), StatementError> {
        let started = Instant::now();
        let read = conn.run(Kind::Gauges, stop.cancelled(), conn.client.query_one(store::GAUGES, &[])).await;
        // One read every GAUGES_SHARE times its own duration at most.
        self.gauges_due = Some(started + started.elapsed() * GAUGES_SHARE);
        match read {
            Ok(row) => {
                let pending: i64 = row.try_get("pending").unwrap_or(0);
                let dead: i64 = row.try_get("dead").unwrap_or(0);
                let oldest: Option<f64> = row.try_get("oldest_age").unwrap_or(None);
                metrics::gauge!(m::BACKLOG).set(pending as f64);
                metrics::gauge!(m::DEAD_LETTERS).set(dead as f64);
                metrics::gauge!(m::OLDEST_UNPUBLISHED_AGE).set(oldest.unwrap_or(0.0));
                Ok(())
            }
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                tracing::debug!(error = %crate::error::report(&e), "could not refresh backlog gauges");
                Ok(())
            }
            // A statement timeout cuts only this read (the session stays
            // usable); it is tried again GAUGES_SHARE times its duration later.
            Err(StatementError { kind, failure: Failure::TimedOut(e) }) => {
                statement::record_timeout(kind, conn.timeout, &e, None);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Remove this relay's registration, giving up at `deadline`. A database
    /// error or timeout is logged; a stop is returned.
    pub(super) async fn unregister(conn: &Conn, deadline: Instant) -> Result<(), StatementError> {
        let unregister = conn.client.execute(store::UNREGISTER, &[]);
        match conn.run(Kind::Registration, sleep_until(deadline), unregister).await {
            Ok(_) => Ok(()),
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                tracing::debug!(error = %crate::error::report(&e), "could not unregister for wake-ups");
                Ok(())
            }
            Err(StatementError { kind, failure: Failure::TimedOut(e) }) => {
                statement::record_timeout(kind, conn.timeout, &e, None);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

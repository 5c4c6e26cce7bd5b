//! Maintenance on the work session: every heartbeat interval (a third of
//! `stranded_after`, at most [`super::STATUS_INTERVAL`]; 5 s by default)
//! the heartbeat, which also forgets relays that are gone; every
//! [`super::STATUS_INTERVAL`] (or less often, see [`GAUGES_SHARE`]) the
//! backlog gauges and the notification queue's usage; between those, a
//! keep-alive whenever the work session has run nothing for
//! [`KEEPALIVE_AFTER`] (the server ends it once idle for
//! `IDLE_SESSION_TIMEOUT`, `super::leadership::lease`: in single and
//! partitioned modes, idle at all; in competing mode, idle inside its claim
//! transaction).
//!
//! The heartbeat comes first and does not wait for the gauges: standbys
//! read it to tell a live leader from a stranded lock
//! (`leadership::stranded`), so it must keep its pace while a large backlog
//! makes the gauges slow.
//!
//! None of these is needed to deliver: a database error in them is logged
//! and the loop goes on. A statement timeout on the gauges cuts only that
//! read; any other failure (a timeout elsewhere, a stop) is returned for the
//! loop to handle as a failed session.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::leadership::lease::KEEPALIVE_AFTER;

use crate::metrics as m;
use crate::store::WorkSession;
use crate::store::statement::{self, Failure, StatementError};

/// The backlog gauges (`store::backlog::read`) cost a bounded number of
/// buffers whatever the backlog (exact up to a cap, estimated beyond), but
/// that is still thousands of buffers (docs/performance.md, "The backlog
/// gauges"). They are read every [`super::STATUS_INTERVAL`] or, when a
/// read took longer than this share of that, less often, so that they
/// never take more than this share (1/20) of the drain loop's time.
const GAUGES_SHARE: u32 = 20;

/// Maintenance state.
#[derive(Debug)]
pub(super) struct Maintenance {
    /// The backlog gauges are read again no earlier than this.
    gauges_due: Option<Instant>,
    /// The gauges' own interval ([`super::STATUS_INTERVAL`]).
    gauges_every: Duration,
    /// The heartbeat is refreshed again no earlier than this.
    heartbeat_due: Instant,
    /// The heartbeat's interval.
    heartbeat_every: Duration,
    /// Keep the work session from sitting idle for [`KEEPALIVE_AFTER`]
    /// (whose work session the server ends once idle for
    /// `IDLE_SESSION_TIMEOUT`: single and partitioned modes', and
    /// competing mode's inside its claim transaction).
    keep_alive: bool,
    /// The subscriptions lagging more than their bound at the last read
    /// (said once as each falls behind and once as it catches up); `None`
    /// once the schema proved to have no subscriptions table (not read
    /// again).
    behind: Option<BTreeSet<String>>,
    /// This consumer's own subscription was found expired: the drain loop
    /// stops ([`Maintenance::own_expired`]).
    own_expired: bool,
    /// This consumer's own subscription's state at the last read (`active`,
    /// `paused`): a change is said once ([`said_state`]).
    own_state: Option<String>,
    /// How this consumer delivers (`single`, `partitioned N`,
    /// `competing`), checked again at each gauges' turn against the other
    /// relays' ([`Self::conflict`]).
    configuration: String,
    /// Another configuration among the relays, held by an older session:
    /// the drain loop stops with it.
    conflict: Option<String>,
}

/// A best-effort read that failed: a statement timeout is recorded and cuts
/// only this read; a database error is [`tolerate`]d; anything else (a
/// stop) is passed on.
fn timed_out_or_tolerated(work: &WorkSession, e: StatementError, what: &str) -> Result<(), StatementError> {
    match e {
        StatementError { kind, failure: Failure::TimedOut(e) } => {
            statement::record_timeout(kind, work.timeout(), &e, None);
            Ok(())
        }
        e => tolerate(Err(e), what),
    }
}

/// One subscription's lag gauges, and the signal `subscription_behind`
/// when it falls behind (`was_behind`: it was at the last read) or the
/// word that it caught up.
fn record_lag(l: &crate::store::subscription_lag::Lag, was_behind: bool) {
    let label = [("subscription", l.name.clone())];
    ::metrics::gauge!(m::SUBSCRIPTION_LAG, &label).set(l.lag_seconds.unwrap_or(0.0));
    if let Some(max) = l.max_lag_seconds {
        ::metrics::gauge!(m::SUBSCRIPTION_MAX_LAG, &label).set(max);
    }
    ::metrics::gauge!(m::SUBSCRIPTION_BEHIND, &label).set(if l.behind() { 1.0 } else { 0.0 });
    if l.behind() && !was_behind {
        let what = if l.expire {
            "it opted in to expire (--expire), so it is marked expired now: retention stops waiting for it and its \
             relays stop"
        } else {
            "it still holds retention, so nothing is dropped: start or fix its relay, or drop it"
        };
        tracing::warn!(subscription = %l.name, lag_seconds = l.lag_seconds, max_lag_seconds = l.max_lag_seconds,
            signal = "subscription_behind",
            "subscription {:?} is behind: its oldest unsettled event is older than its bound (--max-lag); {what}",
            l.name);
    } else if !l.behind() && was_behind {
        tracing::info!(subscription = %l.name, "subscription {:?} is within its lag bound again", l.name);
    }
}

/// A named subscription's relay found its subscription's state `now`,
/// `before` at the last read (`None`: the first read): says when it was
/// paused (signal `subscription_paused`: its relays deliver nothing until
/// it is resumed) or resumed (`subscription_resumed`), and at the first
/// read when it starts paused.
fn said_state(name: &str, before: Option<&str>, now: &str) {
    match (before, now) {
        (None, "paused") => tracing::warn!(
            subscription = name,
            signal = "subscription_paused",
            "subscription {name:?} is paused: this relay delivers nothing until `pg-outbox subscription resume {name}`"
        ),
        (Some("active"), "paused") => tracing::warn!(
            subscription = name,
            signal = "subscription_paused",
            "subscription {name:?} was paused: this relay delivers nothing until `pg-outbox subscription resume {name}`"
        ),
        (Some("paused"), "active") => tracing::info!(
            subscription = name,
            signal = "subscription_resumed",
            "subscription {name:?} was resumed: this relay delivers again"
        ),
        _ => {}
    }
}

/// A database error of a best-effort statement: logged at debug level and
/// swallowed; anything else (a timeout, a stop) is passed on.
fn tolerate(r: Result<(), StatementError>, what: &str) -> Result<(), StatementError> {
    match r {
        Err(StatementError { failure: Failure::Db(e), .. }) => {
            tracing::debug!(error = %crate::error::report(&e), "could not {what}");
            Ok(())
        }
        r => r,
    }
}

impl Maintenance {
    /// Maintenance whose heartbeat is refreshed every `heartbeat_every`
    /// and whose gauges are read every `gauges_every` at most; with
    /// `keep_alive`, the work session is never left idle for longer than
    /// [`KEEPALIVE_AFTER`] and a turn of [`Self::every`].
    pub(super) fn new(
        heartbeat_every: Duration,
        gauges_every: Duration,
        keep_alive: bool,
        configuration: String,
    ) -> Self {
        Maintenance {
            configuration,
            conflict: None,
            gauges_due: None,
            gauges_every,
            heartbeat_due: Instant::now(),
            heartbeat_every,
            keep_alive,
            behind: Some(BTreeSet::new()),
            own_expired: false,
            own_state: None,
        }
    }

    /// How often a turn of maintenance comes: the heartbeat's interval, or
    /// half of [`KEEPALIVE_AFTER`] when the session is kept alive (a turn
    /// with nothing due costs no statement).
    pub(super) fn every(&self) -> Duration {
        if self.keep_alive { self.heartbeat_every.min(KEEPALIVE_AFTER / 2) } else { self.heartbeat_every }
    }

    /// A turn of maintenance (`tick`: when it was due), until `stop`
    /// resolves. When the heartbeat is due: refresh it (and forget gone
    /// relays), then, when due and not `only_heartbeat`, the backlog gauges
    /// and the notification queue's usage. Otherwise, when the work session
    /// is kept alive and has been idle for [`KEEPALIVE_AFTER`]: a
    /// keep-alive.
    pub(super) async fn refresh<F: Future<Output = ()>>(
        &mut self,
        work: &WorkSession,
        tick: Instant,
        stop: impl Fn() -> F,
        only_heartbeat: bool,
    ) -> Result<(), StatementError> {
        if tick < self.heartbeat_due {
            if self.keep_alive && work.session().idle_for() >= KEEPALIVE_AFTER {
                tolerate(work.keep_alive(stop()).await, "keep the session alive")?;
            }
            return Ok(());
        }
        self.heartbeat_due = tick + self.heartbeat_every;
        tolerate(work.heartbeat(stop()).await, "refresh the heartbeat")?;
        if only_heartbeat || self.gauges_due.is_some_and(|at| tick < at) {
            return Ok(());
        }
        self.read_gauges(work, tick, stop()).await?;
        self.read_lags(work, &stop).await?;
        match work.configuration_conflict(&self.configuration, stop()).await {
            Ok(conflict) => self.conflict = conflict,
            Err(e) => timed_out_or_tolerated(work, e, "check the relays' configurations")?,
        }
        let usage = work.notification_queue_usage(stop()).await.map(|usage| {
            if let Some(usage) = usage {
                crate::metrics::gauge!(m::NOTIFICATION_QUEUE_USAGE).set(usage);
            }
        });
        match usage {
            Err(StatementError { failure: Failure::Db(_), .. }) => Ok(()),
            r => r,
        }
    }

    async fn read_gauges(
        &mut self,
        work: &WorkSession,
        tick: Instant,
        stop: impl Future<Output = ()>,
    ) -> Result<(), StatementError> {
        let started = Instant::now();
        let read = work.gauges(stop).await;
        // One read every GAUGES_SHARE times its own duration at most, and
        // one per interval (counted from the tick, so the next tick finds
        // them due).
        self.gauges_due = Some((started + started.elapsed() * GAUGES_SHARE).max(tick + self.gauges_every));
        let read = read.map(|g| {
            crate::metrics::gauge!(m::BACKLOG).set(g.pending as f64);
            crate::metrics::gauge!(m::DEAD_LETTERS).set(g.dead as f64);
            crate::metrics::gauge!(m::BACKLOG_ESTIMATED).set(if g.estimated { 1.0 } else { 0.0 });
            crate::metrics::gauge!(m::OLDEST_UNPUBLISHED_AGE).set(g.oldest_age_secs);
        });
        match read {
            // A statement timeout cuts only this read (the session stays
            // usable); it is tried again GAUGES_SHARE times its duration later.
            Err(StatementError { kind, failure: Failure::TimedOut(e) }) => {
                statement::record_timeout(kind, work.timeout(), &e, None);
                Ok(())
            }
            r => tolerate(r, "refresh backlog gauges"),
        }
    }

    /// Every subscription's lag against its bound: the gauges
    /// [`m::SUBSCRIPTION_LAG`], [`m::SUBSCRIPTION_MAX_LAG`] and
    /// [`m::SUBSCRIPTION_BEHIND`], the signal `subscription_behind` as one
    /// falls behind, and the expiry of those behind that opted in. A schema
    /// without subscriptions (before migration 0016) is not asked again.
    async fn read_lags<F: Future<Output = ()>>(
        &mut self,
        work: &WorkSession,
        stop: impl Fn() -> F,
    ) -> Result<(), StatementError> {
        let Some(was) = self.behind.take() else { return Ok(()) };
        let lags = match work.subscription_lags(stop()).await {
            Ok(lags) => lags,
            Err(StatementError { failure: Failure::Db(e), .. })
                if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) =>
            {
                return Ok(());
            }
            Err(e) => {
                self.behind = Some(was);
                return timed_out_or_tolerated(work, e, "read the subscriptions' lag");
            }
        };
        let own = work.reader().subscription();
        self.behind = Some(lags.iter().filter(|l| l.behind()).map(|l| l.name.clone()).collect());
        for l in &lags {
            record_lag(l, was.contains(&l.name));
            self.own_expired |= l.state == "expired" && own == Some(l.name.as_str());
            if own == Some(l.name.as_str()) {
                said_state(&l.name, self.own_state.as_deref(), &l.state);
                self.own_state = Some(l.state.clone());
            }
        }
        for l in lags.iter().filter(|l| l.behind() && l.expire && l.state != "expired") {
            let expired = match work.expire_subscription(&l.name, stop()).await {
                Ok(expired) => expired,
                Err(e) => return timed_out_or_tolerated(work, e, "expire a subscription"),
            };
            if let Some((lag, max)) = expired {
                tracing::error!(subscription = %l.name, lag_seconds = lag, max_lag_seconds = max, signal = "subscription_expired",
                    "subscription {:?} expired: it fell behind its lag bound with --expire; retention no longer waits for it, \
                     so events it never got may be deleted, and its relays stop; rewind it to accept the gap, or drop it",
                    l.name);
                self.own_expired |= own == Some(l.name.as_str());
            }
        }
        Ok(())
    }

    /// Another delivery configuration among the relays of its outbox or
    /// subscription, held by a session older than this one's (two relays
    /// started together, or one reconnected beside a relay started
    /// meanwhile, both passed the check at start): the message this one,
    /// the younger, stops with, so that one configuration goes on.
    pub(super) fn conflict(&self) -> Option<&str> {
        self.conflict.as_deref()
    }

    /// Whether this consumer's own subscription expired (read at the
    /// gauges' turn, or expired by this consumer): the drain loop stops.
    pub(super) fn own_expired(&self) -> bool {
        self.own_expired
    }
}

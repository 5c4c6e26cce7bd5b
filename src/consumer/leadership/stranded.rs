//! A standby's watch on the holder of the outbox lock (single mode): is it
//! a live relay, or a stranded session that stops all delivery?
//!
//! Every [`Watch::every`] while standing by (a third of the threshold, 5 s
//! by default) the standby reads the holder ([`crate::store::leader`]): its
//! pid, client address, application name, state, idle time and heartbeat
//! age, all by the database's clock. A holder with no heartbeat within the
//! threshold and no statement running is a suspect; the same holder (pid
//! and backend start) found so at the next look too is stranded. Two looks,
//! so a holder that has only just taken the lock and not yet written its
//! first heartbeat is never reported.
//!
//! Stranded: a warning (once per holder, and again when the holder changes
//! or clears) and `outbox_leader_stranded` at 1. With `take_over_stranded`
//! the standby ends the holder's backend (`pg_terminate_backend`, checked
//! again in the same statement) and tries the lock at once; a refusal for
//! want of privileges is logged once per holder, and it keeps standing by.

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use crate::consumer::ConsumerConfig;
use crate::consumer::cx::{Cx, jittered};
use crate::metrics as m;
use crate::store::leader::{Holder, HolderId};
use crate::store::statement::{Failure, StatementError};

/// What a look found that the standby must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::consumer) enum Found {
    /// Nothing to do (a live holder, none, or a suspect not yet confirmed).
    Nothing,
    /// The stranded holder was ended: try the lock at once.
    Ended,
}

/// What one look found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// A live holder, or none.
    Live,
    /// A holder not live at this look only.
    Suspect,
    /// The same holder not live at two looks in a row.
    Stranded,
}

/// The watch's state.
#[derive(Debug)]
pub(in crate::consumer) struct Watch {
    /// The heartbeat age from which a holder is stranded, in seconds.
    threshold_secs: f64,
    /// How often to look.
    every: Duration,
    take_over: bool,
    /// When to look next (`None`: at the next failed try).
    look_at: Option<Instant>,
    /// The holder found stranded at the last look, not yet confirmed.
    suspect: Option<HolderId>,
    /// The holder reported stranded (warned, gauge at 1).
    reported: Option<HolderId>,
    /// The holder whose ending the server refused (warned once).
    refused: Option<HolderId>,
    /// A failed look was warned about (once).
    look_warned: bool,
}

impl Watch {
    /// A watch configured by `cfg`.
    pub(in crate::consumer) fn new(cfg: &ConsumerConfig) -> Self {
        Watch {
            threshold_secs: cfg.stranded_after.as_secs_f64(),
            every: cfg.heartbeat_interval(),
            take_over: cfg.take_over_stranded,
            look_at: None,
            suspect: None,
            reported: None,
            refused: None,
            look_warned: false,
        }
    }

    /// Is a look due at `now`?
    pub(in crate::consumer) fn due(&self, now: Instant) -> bool {
        self.look_at.is_none_or(|t| t <= now)
    }

    /// This consumer is no standby any more (it leads, or its session is
    /// gone): forget what was seen, and clear the gauge.
    pub(in crate::consumer) fn reset(&mut self) {
        self.look_at = None;
        self.suspect = None;
        self.refused = None;
        if self.reported.take().is_some() {
            crate::metrics::gauge!(m::LEADER_STRANDED).set(0.0);
        }
    }

    /// Look at the holder of the outbox lock, report a stranded one and,
    /// with `take_over`, end it. A database error of the look is logged
    /// (once as a warning) and ignored; timeouts and stops are returned.
    pub(in crate::consumer) async fn look(&mut self, cx: Cx<'_>) -> Result<Found, StatementError> {
        self.look_at = Some(Instant::now() + jittered(self.every));
        let holder = match cx.work.leader_holder(self.threshold_secs, cx.stop()).await {
            Ok(h) => h,
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                let error = crate::error::report(&e);
                if self.look_warned {
                    tracing::debug!(error = %error, "could not look at the holder of the outbox lock");
                } else {
                    self.look_warned = true;
                    tracing::warn!(error = %error,
                        "could not look at the holder of the outbox lock (pg_locks, pg_stat_activity, \
                         events.outbox_relays): a stranded holder would go unnoticed");
                }
                return Ok(Found::Nothing);
            }
            Err(e) => return Err(e),
        };
        match (self.judge(holder.as_ref()), holder) {
            (Verdict::Stranded, Some(holder)) if self.take_over => self.end(cx, &holder).await,
            _ => Ok(Found::Nothing),
        }
    }

    /// What a look that found `holder` (`None`: nobody holds the lock)
    /// means, with the state, the warning and the gauge brought up to date.
    fn judge(&mut self, holder: Option<&Holder>) -> Verdict {
        let Some(holder) = holder.filter(|h| !h.live()) else {
            self.clear();
            return Verdict::Live;
        };
        if self.suspect != Some(holder.id) {
            // First sighting: confirmed (or not) at the next look.
            self.suspect = Some(holder.id);
            return Verdict::Suspect;
        }
        if self.reported != Some(holder.id) {
            self.report(holder);
        }
        Verdict::Stranded
    }

    /// No stranded holder (any more).
    fn clear(&mut self) {
        self.suspect = None;
        if let Some(was) = self.reported.take() {
            crate::metrics::gauge!(m::LEADER_STRANDED).set(0.0);
            tracing::warn!(
                role = "standby",
                pid = was.pid,
                "the outbox lock is no longer held by the stranded session: it is gone, or it heartbeats again"
            );
        }
    }

    fn report(&mut self, h: &Holder) {
        let was = self.reported.replace(h.id);
        crate::metrics::gauge!(m::LEADER_STRANDED).set(1.0);
        let idle = h.state_secs.map_or("unknown".to_string(), |s| format!("{s:.0}s"));
        let heartbeat = h.heartbeat_age.map_or("none".to_string(), |s| format!("{s:.0}s old"));
        let what = if was.is_some() { "now another stranded session holds" } else { "a stranded session holds" };
        let pid = h.id.pid;
        let after = self.threshold_secs;
        let fix = if self.take_over {
            "ending it (--take-over-stranded)".to_string()
        } else {
            format!(
                "delivery is stopped until it ends: pg_terminate_backend({pid}), or run a relay with --take-over-stranded"
            )
        };
        tracing::warn!(
            signal = "stranded",
            role = "standby",
            pid,
            client_addr = h.client(),
            application_name = h.application_name.as_deref().unwrap_or(""),
            state = h.state.as_deref().unwrap_or("hidden"),
            idle = %idle,
            heartbeat = %heartbeat,
            "no live leader: {what} the outbox lock (pid {pid}, no heartbeat within {after}s and no statement \
             running); {fix}"
        );
    }

    /// End the stranded holder `h`.
    async fn end(&mut self, cx: Cx<'_>, h: &Holder) -> Result<Found, StatementError> {
        match cx.work.terminate_stranded(h, self.threshold_secs, cx.stop()).await {
            Ok(true) => {
                tracing::warn!(
                    signal = "stranded_ended",
                    role = "standby",
                    pid = h.id.pid,
                    client_addr = h.client(),
                    "ended the stranded holder of the outbox lock (pg_terminate_backend); taking over"
                );
                Ok(Found::Ended)
            }
            Ok(false) => {
                tracing::debug!(pid = h.id.pid, "the stranded holder changed before it was ended; looking again");
                Ok(Found::Nothing)
            }
            Err(StatementError { failure: Failure::Db(e), .. }) => {
                if self.refused != Some(h.id) {
                    self.refused = Some(h.id);
                    let error = crate::error::report(&e);
                    if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
                        tracing::warn!(signal = "stranded_refused", role = "standby", pid = h.id.pid, error = %error,
                            "cannot end the stranded holder of the outbox lock (pid {}): the relay's role may not \
                             signal it; --take-over-stranded needs a role that is a member of pg_signal_backend \
                             (GRANT pg_signal_backend TO <role>) or has the holder's role's privileges (a \
                             superuser's session: only a superuser); still standing by", h.id.pid);
                    } else {
                        tracing::warn!(role = "standby", pid = h.id.pid, error = %error,
                            "could not end the stranded holder of the outbox lock (pid {}); still standing by",
                            h.id.pid);
                    }
                }
                Ok(Found::Nothing)
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ConsumerConfig {
        let pg = crate::connect::ConnectOptions::parse("postgres://u@localhost/db").expect("URL");
        crate::consumer::Consumer::builder(pg).cfg
    }

    fn holder(pid: i32, beating: bool, busy: bool) -> Holder {
        Holder {
            id: HolderId { pid, backend_start: None },
            application_name: Some("pg-outbox drain".into()),
            client_addr: None,
            state: Some(if busy { "active" } else { "idle" }.into()),
            state_secs: Some(20.0),
            heartbeat_age: beating.then_some(1.0),
            beating,
            busy,
        }
    }

    #[test]
    fn a_holder_is_stranded_at_the_second_look_in_a_row_and_live_ones_never() {
        let mut w = Watch::new(&cfg());
        assert_eq!(w.every, Duration::from_secs(5), "a third of the default 15 s");
        assert_eq!(w.judge(None), Verdict::Live);
        assert_eq!(w.judge(Some(&holder(7, true, false))), Verdict::Live, "heartbeating");
        assert_eq!(w.judge(Some(&holder(7, false, true))), Verdict::Live, "busy in a statement");
        assert_eq!(w.judge(Some(&holder(7, false, false))), Verdict::Suspect, "one look is not enough");
        assert_eq!(w.judge(Some(&holder(7, true, false))), Verdict::Live, "it heartbeats: the suspicion goes");
        assert_eq!(w.judge(Some(&holder(7, false, false))), Verdict::Suspect);
        assert_eq!(w.judge(Some(&holder(7, false, false))), Verdict::Stranded);
        assert_eq!(w.reported.map(|h| h.pid), Some(7));
        assert_eq!(w.judge(Some(&holder(7, false, false))), Verdict::Stranded, "still, reported once");
        // Another holder starts over: a suspect first.
        assert_eq!(w.judge(Some(&holder(8, false, false))), Verdict::Suspect);
        assert_eq!(w.reported.map(|h| h.pid), Some(7), "the report stands until the new one is confirmed");
        assert_eq!(w.judge(Some(&holder(8, false, false))), Verdict::Stranded);
        assert_eq!(w.reported.map(|h| h.pid), Some(8));
        // The same pid in a new session is another holder.
        let mut later = holder(8, false, false);
        later.id.backend_start = Some(chrono::Utc::now());
        assert_eq!(w.judge(Some(&later)), Verdict::Suspect);
        assert_eq!(w.judge(None), Verdict::Live);
        assert_eq!((w.reported, w.suspect), (None, None), "cleared");
    }

    #[test]
    fn reset_forgets_what_was_seen_and_looks_at_once() {
        let mut w = Watch::new(&cfg());
        w.judge(Some(&holder(7, false, false)));
        w.judge(Some(&holder(7, false, false)));
        w.look_at = Some(Instant::now() + Duration::from_secs(60));
        assert!(!w.due(Instant::now()));
        w.reset();
        assert!(w.due(Instant::now()));
        assert_eq!((w.reported, w.suspect), (None, None));
        assert_eq!(w.judge(Some(&holder(7, false, false))), Verdict::Suspect, "two looks again after a reset");
    }
}

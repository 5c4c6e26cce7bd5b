//! The end of the drain loop: the source's last statements and the final
//! settlements, written within one shutdown grace.

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::Engine;
use crate::consumer::completer::FlushDone;
use crate::consumer::source::{Fetch, Leadership, WakeKind};
use crate::error::SubscriptionError;
use crate::store::statement;

impl<K: WakeKind, F: Fetch> Engine<K, F> {
    /// Let the source say its last (the leadership releases its terms, the
    /// wake-ups unregister), and write the final settlements, within
    /// one shutdown grace: a statement still running then is cancelled.
    /// Whatever is still handed out is released by its `Drop` later.
    pub(super) async fn final_flush(&mut self, done_rx: &mut mpsc::UnboundedReceiver<FlushDone>) {
        let deadline = Instant::now() + self.cfg.shutdown_grace;
        self.final_deadline = Some(deadline);
        let settled = self.inflight.outstanding() == 0;
        let r = match self.source_cx() {
            (wakeups, fetch, Some(cx)) => {
                async {
                    fetch.leadership().release_terms(cx, settled).await?;
                    wakeups.finish(cx, deadline).await
                }
                .await
            }
            (_, _, None) => Ok(()),
        };
        self.check(r);
        // A write per batch, and up to three more for writes that fail.
        for _ in 0..3 + self.completer.writes_needed() {
            if self.completer.is_writing() {
                match self.write_outcome(done_rx, deadline).await {
                    Some(done) => self.written(done).await,
                    None => break,
                }
            }
            if self.completer.pending() == 0 || Instant::now() >= deadline {
                break;
            }
            if !self.sessions.is_open() {
                self.reconnect().await;
            }
            self.start_write();
            if self.completer.is_writing()
                && let Some(done) = self.write_outcome(done_rx, deadline).await
            {
                self.written(done).await;
            }
        }
        self.report_unwritten();
    }

    /// The outcome of the write in flight, waited for until `deadline`;
    /// then the write is cancelled and waited for a little longer (`None`
    /// if it still does not end: its events stay unpublished).
    async fn write_outcome(
        &self,
        done_rx: &mut mpsc::UnboundedReceiver<FlushDone>,
        deadline: Instant,
    ) -> Option<FlushDone> {
        if let Ok(done) = tokio::time::timeout_at(deadline, done_rx.recv()).await {
            return done;
        }
        tracing::warn!(grace = ?self.cfg.shutdown_grace,
            "the final settlements were not written within the shutdown grace; cancelling the write");
        if let Some(conn) = self.sessions.conn() {
            conn.writer.session().cancel().await;
        }
        tokio::time::timeout(statement::CANCELLED_WAIT, done_rx.recv()).await.ok().flatten()
    }

    fn report_unwritten(&self) {
        let (acks, fails) = self.completer.pending_counts();
        let unfinished = self.completer.writing();
        let dropped = matches!(self.fatal, Some(crate::error::Error::Subscription(SubscriptionError::Unknown(_))));
        if acks + fails + unfinished > 0 && dropped {
            tracing::warn!(
                acknowledgements = acks,
                failures = fails,
                unfinished,
                "the final settlements were not written: the subscription was dropped, so nothing is delivered again \
                 for it"
            );
        } else if acks + fails + unfinished > 0 {
            tracing::error!(
                acknowledgements = acks,
                failures = fails,
                unfinished,
                "could not write the final settlements; those events will be delivered again"
            );
        }
        if self.inflight.outstanding() > 0 {
            tracing::warn!(
                deliveries = self.inflight.outstanding(),
                "shutdown grace ran out with deliveries still open; they stay unpublished and will be delivered again"
            );
        }
    }
}

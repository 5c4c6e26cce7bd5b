//! The claim source (competing mode, docs/schema.md, "Publisher and poller
//! flow"): each fetch opens a transaction and claims due rows with
//! `FOR UPDATE SKIP LOCKED` (`store::fetch::competing_fetch_sql`); the
//! transaction stays open until every claimed event is settled and its
//! settlement written, inside it, on the work session (there is no writer
//! session in this mode); then it commits, and the next claim may start.
//! Other consumers skip the locked rows, so no two deliver one row at once.
//! No order, no hold-back, no lock to own.
//!
//! The transaction's lifecycle, all of it here:
//! - [`Source::fetch`] begins it and claims (`in_tx` from then on);
//! - the engine writes at once when nothing claimed is outstanding
//!   ([`Source::holds_transaction`]);
//! - [`Source::settled`] commits once everything is written;
//! - a lost session ends it (the server rolls it back; what was handed out
//!   is not, and is delivered again).

use tokio::time::Instant;

use super::wakeups::Wakeups;
use super::{Cx, Room, Signals, Source, Wake};
use crate::consumer::ConsumerConfig;
use crate::consumer::completer::Written;
use crate::consumer::leadership::Unled;
use crate::metrics as m;
use crate::store::statement::StatementError;
use crate::store::{FetchKind, FetchPage, FetchParams, FetchScope, FloorParams};

/// Competing mode's source.
#[derive(Debug)]
pub(crate) struct ClaimSource {
    wakeups: Wakeups,
    /// A claim transaction is open.
    in_tx: bool,
}

impl ClaimSource {
    /// The source of a competing consumer configured by `cfg`, woken by
    /// `signals`.
    pub(crate) fn new(cfg: &ConsumerConfig, signals: Signals) -> Self {
        ClaimSource { wakeups: Wakeups::new(cfg, signals, true), in_tx: false }
    }
}

impl Source for ClaimSource {
    type Leader = Unled;

    fn leadership(&self) -> &Unled {
        &Unled
    }

    fn fetch_kind(&self) -> FetchKind {
        FetchKind::Claim
    }

    fn wants_fetch(&self) -> bool {
        self.wakeups.wants_fetch() && !self.in_tx
    }

    wakeups_delegate!();

    fn next_timer(&self, open: bool, stopping: bool) -> Option<Instant> {
        self.wakeups.next_timer(open, stopping, self.in_tx)
    }

    async fn timers_due(&mut self, cx: Option<Cx<'_>>, stopping: bool) -> Result<bool, StatementError> {
        self.wakeups.timers_due(cx, stopping, self.in_tx).await?;
        Ok(false)
    }

    async fn fetch(&mut self, cx: Cx<'_>, room: Room<'_>) -> Result<FetchPage, StatementError> {
        // A failed claim leaves no transaction behind that matters: its
        // session is closed.
        self.in_tx = true;
        let params = FetchParams {
            exclude: room.exclude,
            batch: room.batch,
            budget: room.budget,
            scope: FetchScope::Claim,
            floor: FloorParams::NONE,
        };
        cx.work.fetch(params, cx.stop()).await
    }

    fn handed_out(&mut self, _id: i64, _partition: Option<i32>) {}

    async fn fetched(&mut self, cx: Cx<'_>, handed: u64, full: bool) -> Result<(), StatementError> {
        self.wakeups.fetched(cx, handed, full, self.in_tx).await
    }

    fn released(&mut self, _id: i64) {
        self.wakeups.wake(Wake::Release);
    }

    fn written(&mut self, w: &Written) {
        self.wakeups.written(w);
    }

    fn holds_transaction(&self) -> bool {
        self.in_tx
    }

    async fn settled(&mut self, cx: Cx<'_>) -> Result<(), StatementError> {
        cx.work.commit_claim().await?;
        self.in_tx = false;
        Ok(())
    }

    async fn session_opened(&mut self, _cx: Cx<'_>) -> Result<(), StatementError> {
        self.in_tx = false;
        metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
        self.wakeups.session_opened();
        Ok(())
    }

    fn session_lost(&mut self) {
        self.in_tx = false;
        self.wakeups.session_lost();
        metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
    }

    fn stop(&mut self) {
        self.wakeups.stop();
    }

    async fn finish(&mut self, cx: Cx<'_>, deadline: Instant, _settled: bool) -> Result<(), StatementError> {
        Wakeups::unregister(cx, deadline).await
    }
}

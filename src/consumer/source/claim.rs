//! The claim fetch (competing mode, docs/schema.md, "Publisher and poller
//! flow"): each fetch opens a transaction and claims due rows with
//! `FOR UPDATE SKIP LOCKED` (`store::fetch::competing_fetch_sql`); the
//! transaction stays open until every claimed event is settled and its
//! settlement written, inside it, on the work session (there is no writer
//! session in this mode); then it commits, and the next claim may start.
//! Other consumers skip the locked rows, so no two deliver one row at once.
//! No order, no hold-back, no lock to own. A named subscription's claim
//! locks each event with an advisory lock of its own class instead of the
//! row (`store::subscription_claim`), and its writes in the transaction
//! pass the checkpoint the claim read; after a claim that found nothing,
//! the subscription's cursor is moved outside the transaction
//! ([`IdleAdvance`]).
//!
//! The transaction's lifecycle, all of it here:
//! - [`Fetch::fetch`] begins it and claims (`in_tx` from then on);
//! - the engine fetches no more, and writes at once when nothing claimed
//!   is outstanding ([`Fetch::holds_transaction`]);
//! - [`Fetch::settled`] commits once everything is written;
//! - a lost session ends it (the server rolls it back; what was handed out
//!   is not, and is delivered again); the server ends a session that sat
//!   idle inside it for `IDLE_SESSION_TIMEOUT` (4 s), so a frozen or
//!   cut-off consumer's claim goes back to the others.

use super::idle::IdleAdvance;
use super::{Cx, Fetch, Room};
use crate::consumer::completer::Written;
use crate::consumer::leadership::Unled;
use crate::consumer::leadership::lease::IDLE_SESSION_TIMEOUT;
use crate::metrics as m;
use crate::store::statement::StatementError;
use crate::store::{FetchKind, FetchPage, FetchParams, FetchScope, FloorParams};

/// Competing mode's fetch.
#[derive(Debug, Default)]
pub(crate) struct ClaimFetch {
    /// Competing mode holds no lock and no term.
    unled: Unled,
    /// A claim transaction is open.
    in_tx: bool,
    /// The open claim found nothing.
    found_nothing: bool,
    /// A named subscription's cursor moved after a claim found nothing.
    idle: IdleAdvance,
}

impl Fetch for ClaimFetch {
    type Leader = Unled;

    fn leadership(&self) -> &Unled {
        &self.unled
    }

    fn leadership_mut(&mut self) -> &mut Unled {
        &mut self.unled
    }

    fn fetch_kind(&self) -> FetchKind {
        FetchKind::Claim
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
        let page = cx.work.fetch(params, cx.stop()).await?;
        self.found_nothing = page.rows.is_empty();
        Ok(page)
    }

    fn handed_out(&mut self, _id: i64, _partition: Option<i32>) {}

    fn released(&mut self, _id: i64) {}

    fn written(&mut self, _w: &Written) -> bool {
        false
    }

    fn holds_transaction(&self) -> bool {
        self.in_tx
    }

    async fn settled(&mut self, cx: Cx<'_>) -> Result<(), StatementError> {
        cx.work.commit_claim().await?;
        self.in_tx = false;
        if self.found_nothing {
            self.idle.found_nothing(cx, true).await?;
        }
        Ok(())
    }

    async fn session_opened(&mut self, cx: Cx<'_>) -> Result<(), StatementError> {
        self.in_tx = false;
        crate::metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
        // A consumer that stops talking to the server while it holds a
        // claim (frozen, paused, cut off) loses it within this bound; a
        // live one sends a keep-alive inside the claim after a second of
        // quiet (`crate::consumer::maintenance`).
        cx.work.bound_idle_in_claim(IDLE_SESSION_TIMEOUT, cx.stop()).await?;
        // Seen by the other relays' configuration check, between claims too.
        cx.work.take_competing_lock(cx.stop()).await
    }

    fn session_lost(&mut self) {
        self.in_tx = false;
        crate::metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
    }
}

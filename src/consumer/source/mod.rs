//! Where events come from: the [`Source`] seam of the drain loop.
//!
//! The engine (`super::drain`) owns what every source shares: the sessions
//! and their loss, the events in flight and the byte bound
//! (`super::inflight`), hold-back, settlement writes (`super::completer`),
//! the final flush and the stream. A source decides when to fetch, which
//! rows, and what its own statements and timers do:
//!
//! - [`ListenSource`] (single and partitioned modes): LISTEN wake-ups, the
//!   wake-up policy, the retry timer, the relays' registration, and
//!   ownership by advisory locks, with the standbys' watch for a stranded
//!   lock (both in `super::leadership`);
//! - [`ClaimSource`] (competing mode): the same wake-ups, and the
//!   `FOR UPDATE SKIP LOCKED` claim transaction, all in `claim.rs`;
//! - `WalSource` (feature `wal`, either mode): one of the two, woken by
//!   the server's logical replication stream instead of NOTIFY, with its
//!   own looks after a wake-up that found nothing (`wal.rs`).
//!
//! The engine calls the source from its own task only (the one-task rule,
//! `super::drain`), so a source needs no locks; it is a type parameter of
//! the engine (`Engine<S: Source>`), so the calls are static.

/// The [`Source`] methods a source built on [`wakeups::Wakeups`] (in a
/// field `wakeups`) hands to it unchanged: the metric label, the signals,
/// and the wake-ups they bring.
macro_rules! wakeups_delegate {
    () => {
        fn wake_label(&self) -> &'static str {
            self.wakeups.label()
        }

        fn signalled(&self) -> impl Future<Output = Wake> + Send + '_ {
            self.wakeups.signalled()
        }

        fn woken(&mut self, wake: Wake) {
            self.wakeups.wake(wake);
        }
    };
}

mod claim;
mod floor;
mod listen;
pub(super) mod notifier;
mod retry_timer;
mod wake;
mod wakeups;
#[cfg(feature = "wal")]
pub(super) mod wal;

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

pub(super) use super::cx::{Cx, Stop, jittered};
pub(super) use super::leadership::TermCheck;
pub(super) use claim::ClaimSource;
pub(super) use listen::ListenSource;
pub(super) use wake::Wake;
#[cfg(feature = "wal")]
pub(super) use wal::WalSource;

use super::completer::Written;
use super::health::Role;
use crate::store::Fence;
use crate::store::statement::StatementError;
use crate::store::{FetchKind, FetchPage};

/// Wake-ups from outside the drain loop, shared with the notifier.
#[derive(Debug, Clone, Default)]
pub(crate) struct Signals {
    /// A notification arrived.
    pub(crate) notification: Arc<Notify>,
    /// The LISTEN session was opened again (notifications may be lost).
    pub(crate) reconnected: Arc<Notify>,
}

/// What the engine has room for in a fetch.
#[derive(Debug, Clone, Copy)]
pub(super) struct Room<'a> {
    /// Ids in flight, which no fetch may return.
    pub(super) exclude: &'a [i64],
    /// Rows at most (the buffer slots reserved).
    pub(super) batch: usize,
    /// Payload bytes at most (what the byte bound leaves; at least 1).
    pub(super) budget: i64,
}

/// A way of finding events for the engine. Every method is called from the
/// drain loop's task; the async ones run statements on the work session
/// through [`Cx`] and return their error for the engine to handle (it gives
/// the sessions up and reconnects).
pub(super) trait Source: Send {
    /// The fetch statement the work session prepares for this source.
    fn fetch_kind(&self) -> FetchKind;

    /// What this consumer does now, for its health.
    fn role(&self) -> Role;

    /// Single mode: `Some(true)` once a try for the outbox lock since the
    /// sessions opened found another holding it (a standby), `Some(false)`
    /// while this consumer leads, `None` before its first try (nothing is
    /// known yet). `Some(false)` in the other modes. Changes only when the
    /// sessions open or close and in [`Self::timers_due`].
    #[cfg(feature = "wal")]
    fn stands_by(&self) -> Option<bool> {
        Some(false)
    }

    /// Does the source hold a leadership term now (`events.outbox_terms`:
    /// single mode's leader, a partitioned consumer holding partitions)?
    /// Then a fetch must find its terms current for its rows to be handed
    /// out ([`Self::check_page`]), and hand-outs are bound by the lease.
    /// `false`: a standby, competing mode; nothing is fenced.
    fn fenced(&self) -> bool;

    /// What `page`'s rows say of the terms held (each row carries its
    /// scope's current term as the fetch read it).
    fn check_page(&self, page: &FetchPage) -> TermCheck;

    /// Confirm with one statement that the terms held are still current.
    async fn confirm_terms(&mut self, cx: Cx<'_>) -> Result<TermCheck, StatementError>;

    /// The terms a write of the settlements of `ids` is conditional on
    /// (`None`: not fenced).
    fn fence_for(&self, ids: &[i64]) -> Option<Fence>;

    /// Does the source want a fetch now (a wake-up is pending, and it may
    /// fetch)? The engine adds its own conditions (sessions open, room).
    fn wants_fetch(&self) -> bool;

    /// What started the current drain: the `wake` label of
    /// `outbox_events_fetched_total`.
    fn wake_label(&self) -> &'static str;

    /// Resolves on a wake-up from outside the loop; hand it to
    /// [`Self::woken`].
    fn signalled(&self) -> impl Future<Output = Wake> + Send + '_;

    /// A wake-up from [`Self::signalled`].
    fn woken(&mut self, wake: Wake);

    /// When the source's next timer is due, if any (`open`: the sessions
    /// are open; `stopping`: the consumer stops).
    fn next_timer(&self, open: bool, stopping: bool) -> Option<Instant>;

    /// The timers due now fire (`cx`: `None` while the sessions are closed).
    /// `Ok(true)`: what the source holds was tried, and its [`Self::role`]
    /// may have changed.
    async fn timers_due(&mut self, cx: Option<Cx<'_>>, stopping: bool) -> Result<bool, StatementError>;

    /// Fetch due events within `room`.
    async fn fetch(&mut self, cx: Cx<'_>, room: Room<'_>) -> Result<FetchPage, StatementError>;

    /// Event `id` (of hash partition `partition` in a partitioned fetch)
    /// was handed out.
    fn handed_out(&mut self, id: i64, partition: Option<i32>);

    /// A fetch ended: `handed` events went out; `full`: it returned a
    /// whole batch, or the byte budget cut it (more may be due).
    async fn fetched(&mut self, cx: Cx<'_>, handed: u64, full: bool) -> Result<(), StatementError>;

    /// Event `id` was released (handed back unsettled): fetch it again.
    fn released(&mut self, id: i64);

    /// A write's outcome was taken in.
    fn written(&mut self, written: &Written);

    /// Does the source hold a transaction open until what it handed out is
    /// settled and written (a claim)? Then the engine writes as soon as
    /// nothing is outstanding, and calls [`Self::settled`].
    fn holds_transaction(&self) -> bool;

    /// Everything handed out is settled and written: end the transaction.
    async fn settled(&mut self, cx: Cx<'_>) -> Result<(), StatementError>;

    /// New sessions are open: take what the source holds on them.
    async fn session_opened(&mut self, cx: Cx<'_>) -> Result<(), StatementError>;

    /// The sessions are gone, and every lock, claim and registration with
    /// them.
    fn session_lost(&mut self);

    /// The consumer stops: no more fetches.
    fn stop(&mut self);

    /// The last statement before the sessions close, until `deadline`.
    async fn finish(&mut self, cx: Cx<'_>, deadline: Instant) -> Result<(), StatementError>;
}

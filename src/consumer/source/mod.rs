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
pub(super) use super::leadership::{Leadership, TermCheck};
pub(super) use claim::ClaimSource;
pub(super) use listen::ListenSource;
pub(super) use wake::Wake;
#[cfg(feature = "wal")]
pub(super) use wal::WalSource;

use super::completer::Written;
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

    /// Who may hand events out, and under which terms.
    type Leader: Leadership;

    /// The source's leadership: its role, its terms and their fences
    /// ([`Leadership`]).
    fn leadership(&self) -> &Self::Leader;

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
    /// `settled`: nothing handed out is still open (else a delivery may
    /// still reach its destination, and the terms held must not be marked
    /// released: the next leader waits out this one's lease).
    async fn finish(&mut self, cx: Cx<'_>, deadline: Instant, settled: bool) -> Result<(), StatementError>;
}

#[cfg(test)]
mod tests {
    /// The method names of trait `name` in Rust source `code`.
    fn methods(code: &str, name: &str) -> Vec<String> {
        let start = code.find(&format!("trait {name}: Send {{")).unwrap_or_else(|| panic!("trait {name} not found"));
        let body = &code[start..];
        let end = body.find("\n}\n").unwrap_or(body.len());
        body[..end]
            .lines()
            .filter_map(|l| {
                let l = l.trim_start().trim_start_matches("async ");
                let rest = l.strip_prefix("fn ").or_else(|| l.strip_prefix("type "))?;
                Some(rest.split(['(', ':', '<', ' ']).next().unwrap_or_default().to_string())
            })
            .collect()
    }

    #[test]
    fn adding_a_source_in_the_architecture_doc_names_every_method_of_source_and_leadership() {
        let doc = include_str!("../../../docs/architecture.md");
        let start = doc.find("## Adding a source").expect("the section");
        let section = &doc[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
        let source = methods(include_str!("mod.rs"), "Source");
        let leadership = methods(include_str!("../leadership/mod.rs"), "Leadership");
        assert!(source.len() > 15 && leadership.len() == 6, "{source:?} {leadership:?}");
        for m in source.iter().chain(&leadership) {
            assert!(section.contains(&format!("`{m}`")), "docs/architecture.md, \"Adding a source\", lacks `{m}`");
        }
    }
}

//! Where events come from: the seam of the drain loop, in three parts.
//!
//! The engine (`super::drain`) owns what every source shares: the sessions
//! and their loss, the events in flight and the byte bound
//! (`super::inflight`), hold-back, settlement writes (`super::completer`),
//! the final flush and the stream. A source is three parts, each a type
//! parameter of the engine (`Engine<K: WakeKind, F: Fetch>`, the
//! leadership `F::Leader`), so the calls are static:
//!
//! - **wake-ups**, when to fetch: [`Wakeups`] (the wake-up policy, the
//!   sweep, the retry timer, the relay's registration), shared, woken by a
//!   [`WakeKind`]: [`Notified`] (LISTEN/NOTIFY, through the notifier) or
//!   `Streamed` (feature `wal`: the server's logical replication stream,
//!   with its own looks after a wake-up that found nothing, `wal.rs`);
//! - **fetch**, which rows, and what follows them ([`Fetch`]):
//!   [`OrderedFetch`] (single and partitioned modes: due rows in id order
//!   with hold-back, `ordered.rs`) or [`ClaimFetch`] (competing mode: the
//!   `FOR UPDATE SKIP LOCKED` claim transaction, `claim.rs`);
//! - **leadership**, whether it may ([`Leadership`], `super::leadership`):
//!   the ordered fetch's `Ownership` (advisory locks and terms, with the
//!   standbys' watch for a stranded lock), the claim's `Unled`.
//!
//! Any wake-up kind goes with either fetch. The engine calls them from
//! its own task only (the one-task rule, `super::drain`), so none needs
//! locks.

mod claim;
mod floor;
mod idle;
pub(super) mod notifier;
mod ordered;
mod retry_timer;
mod wake;
mod wakeups;
#[cfg(feature = "wal")]
pub(super) mod wal;

use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

pub(super) use super::cx::{Cx, Stop, jittered};
pub(super) use super::leadership::{Leadership, TermCheck};
pub(super) use claim::ClaimFetch;
pub(super) use notifier::Notified;
pub(super) use ordered::OrderedFetch;
pub(super) use wake::Wake;
pub(super) use wakeups::{Wakeups, due, earliest};
#[cfg(feature = "wal")]
pub(super) use wal::Streamed;

use super::completer::Written;
use crate::store::statement::StatementError;
use crate::store::{FetchKind, FetchPage};

/// Wake-ups from outside the drain loop, shared with the notifier (or the
/// WAL source's stream reader).
#[derive(Debug, Clone, Default)]
pub(crate) struct Signals {
    /// A notification arrived (or a commit that inserted, on the stream).
    pub(crate) notification: Arc<Notify>,
    /// The LISTEN session (or the stream's slot) was opened again
    /// (notifications may be lost).
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

/// How wake-ups learn that events committed, and the looks of their own
/// after a wake-up whose drain found nothing. [`Wakeups`] carries the rest
/// (the policy, the sweep, the retry timer, the registration) and calls
/// these hooks; each has a default that does nothing, which is
/// [`Notified`]'s (its looks after asking for notifications again are the
/// policy's own). `Sync`: the engine's task holds it across its awaits.
pub(super) trait WakeKind: Send + Sync {
    /// A wake-up came (from outside, or from the engine), before the policy
    /// takes it.
    fn woken(&mut self, _wake: Wake) {}

    /// A fetch ended, having handed out `handed` events.
    fn fetched(&mut self, _handed: u64) {}

    /// When the next look of its own is due (`open`: the sessions are open;
    /// `stopping`: the consumer stops).
    fn next_look(&self, _open: bool, _stopping: bool) -> Option<Instant> {
        None
    }

    /// Is a look of its own due at `now` (the sessions open, not
    /// stopping)? `true` takes it: the engine fetches ([`Wake::Recheck`]).
    fn look_due(&mut self, _now: Instant) -> bool {
        false
    }

    /// New sessions are open.
    fn session_opened(&mut self) {}

    /// The sessions are gone.
    fn session_lost(&mut self) {}

    /// The consumer stops: no more looks.
    fn stop(&mut self) {}

    /// The leadership may have changed (its timers ran): `leader` says
    /// what this consumer holds now.
    fn led(&mut self, _leader: &impl Leadership) {}
}

/// Which rows the engine fetches, and what follows each one it handed out
/// until it is settled. Every method is called from the drain loop's task;
/// the async ones run statements on the work session through [`Cx`] and
/// return their error for the engine to handle (it gives the sessions up
/// and reconnects).
pub(super) trait Fetch: Send {
    /// Who may hand events out, and under which terms.
    type Leader: Leadership;

    /// The fetch's leadership: its role, its terms and their fences
    /// ([`Leadership`]).
    fn leadership(&self) -> &Self::Leader;

    /// The same, to take or give up what it holds.
    fn leadership_mut(&mut self) -> &mut Self::Leader;

    /// The fetch statement the work session prepares for this source.
    fn fetch_kind(&self) -> FetchKind;

    /// Fetch due events within `room`.
    async fn fetch(&mut self, cx: Cx<'_>, room: Room<'_>) -> Result<FetchPage, StatementError>;

    /// Event `id` (of hash partition `partition` in a partitioned fetch)
    /// was handed out.
    fn handed_out(&mut self, id: i64, partition: Option<i32>);

    /// Event `id` was released (handed back unsettled): fetch it again
    /// (the engine wakes the wake-ups with [`Wake::Release`]).
    fn released(&mut self, id: i64);

    /// A write's outcome was taken in. `true`: events held back behind
    /// what it wrote are due now (the engine wakes the wake-ups with
    /// [`Wake::Retry`]).
    fn written(&mut self, written: &Written) -> bool;

    /// Does the fetch hold a transaction open until what it handed out is
    /// settled and written (a claim)? Then the engine fetches no more,
    /// writes as soon as nothing is outstanding, and calls
    /// [`Self::settled`].
    fn holds_transaction(&self) -> bool;

    /// Everything handed out is settled and written: end the transaction.
    async fn settled(&mut self, cx: Cx<'_>) -> Result<(), StatementError>;

    /// New sessions are open: take what the fetch holds on them (its
    /// leadership's locks).
    async fn session_opened(&mut self, cx: Cx<'_>) -> Result<(), StatementError>;

    /// The sessions are gone, and every lock and claim with them.
    fn session_lost(&mut self);
}

#[cfg(test)]
mod tests {
    /// The method names of trait `name` in Rust source `code`.
    fn methods(code: &str, name: &str) -> Vec<String> {
        let start = code.find(&format!("trait {name}: ")).unwrap_or_else(|| panic!("trait {name} not found"));
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

    /// The methods the engine may call in the inherent impl `header` of
    /// Rust source `code` (those visible outside the file).
    fn inherent(code: &str, header: &str) -> Vec<String> {
        let start = code.find(&format!("{header} {{")).unwrap_or_else(|| panic!("{header} not found"));
        let body = &code[start..];
        let end = body.find("\n}\n").unwrap_or(body.len());
        body[..end]
            .lines()
            .filter_map(|l| {
                let l = l.trim_start().strip_prefix("pub(in crate::consumer) ")?.trim_start_matches("async ");
                let name = l.strip_prefix("fn ")?.split(['(', '<']).next().unwrap_or_default();
                (name != "new").then(|| name.to_string())
            })
            .collect()
    }

    #[test]
    fn adding_a_source_in_the_architecture_doc_names_every_method_of_the_seams() {
        let doc = include_str!("../../../docs/architecture.md");
        let start = doc.find("## Adding a source").expect("the section");
        let section = &doc[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
        let kind = methods(include_str!("mod.rs"), "WakeKind");
        let fetch = methods(include_str!("mod.rs"), "Fetch");
        let leadership = methods(include_str!("../leadership/mod.rs"), "Leadership");
        let wakeups = inherent(include_str!("wakeups.rs"), "impl<K: WakeKind> Wakeups<K>");
        assert!(
            kind.len() == 8 && fetch.len() == 12 && leadership.len() == 10 && wakeups.len() == 13,
            "{kind:?} {fetch:?} {leadership:?} {wakeups:?}"
        );
        for m in kind.iter().chain(&fetch).chain(&leadership).chain(&wakeups) {
            assert!(section.contains(&format!("`{m}`")), "docs/architecture.md, \"Adding a source\", lacks `{m}`");
        }
    }
}

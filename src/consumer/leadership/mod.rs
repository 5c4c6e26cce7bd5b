//! Leadership: who may hand events out, under which term, and for how
//! long.
//!
//! - [`ownership`]: the locks by mode (single mode's outbox lock,
//!   partitioned mode's membership and partition locks), the leadership
//!   term taken with each (`events.outbox_terms`, [`crate::term::Term`]), what a
//!   fetch's rows say of the terms held ([`TermCheck`]), and the fence a
//!   settlement write is conditional on;
//! - [`lease`]: the hand-out lease (nothing is handed out unless a
//!   statement found the term current within [`LEASE`]) and the wait after
//!   taking over from a holder that did not release its term
//!   ([`lease::TAKEOVER_WAIT`]);
//! - [`stranded`]: a standby's watch on the holder of the outbox lock, and
//!   the takeover of a stranded one.
//!
//! The ordered fetch holds an [`Ownership`] (competing mode's claim fetch
//! holds [`Unled`]: none); the drain loop and the stream hold the
//! [`lease::Lease`]. docs/architecture.md,
//! "Leadership terms", tells the whole protocol.

pub(super) mod lease;
mod ownership;
mod stranded;

pub(super) use lease::LEASE;
pub(super) use ownership::{Ownership, TermCheck};

use tokio::time::Instant;

use super::cx::Cx;
use super::health::Role;
use crate::store::statement::StatementError;
use crate::store::{Fence, FetchPage};

/// What the drain loop asks of leadership: the consumer's role, whether
/// it may fetch, when it tries for its locks, whether it holds terms, what
/// a fetch's rows and a confirmation say of them, the fence of a
/// settlement write, and its terms' release at the stop. [`Ownership`] is
/// single and partitioned mode's; [`Unled`] competing mode's, which holds
/// nothing.
pub(super) trait Leadership: Send {
    /// What this consumer does now, for its health.
    fn role(&self) -> Role;

    /// May this consumer fetch now (it leads, or owns a partition, and no
    /// takeover wait runs)?
    fn may_fetch(&self) -> bool;

    /// When to try to take (or rebalance) the locks next, or when a wait
    /// after a takeover ends.
    fn next_try(&self) -> Option<Instant>;

    /// Take the locks, or rebalance (the time of [`Self::next_try`] came).
    /// `Ok(true)`: this consumer may fetch more than before.
    async fn try_take(&mut self, cx: Cx<'_>) -> Result<bool, StatementError>;

    /// The consumer stops: release the terms held, so the next leader need
    /// not wait out this one's hand-out lease; unless deliveries are still
    /// open (`settled` false: one may yet reach its destination).
    async fn release_terms(&self, cx: Cx<'_>, settled: bool) -> Result<(), StatementError>;

    /// Single mode: `Some(true)` once a try for the outbox lock since the
    /// sessions opened found another holding it (a standby), `Some(false)`
    /// while this consumer leads, `None` before its first try. `Some(false)`
    /// in the other modes.
    #[cfg(feature = "wal")]
    fn stands_by(&self) -> Option<bool> {
        Some(false)
    }

    /// Does this consumer hold a leadership term now (single mode's leader,
    /// a partitioned consumer holding partitions), or a claim (competing
    /// mode: [`Unled`])? Then a fetch must find its terms current (its
    /// claim's session alive) for its rows to be handed out
    /// ([`Self::check_page`]), and hand-outs are bound by the lease.
    /// `false`: a standby, a member holding no partition.
    fn fenced(&self) -> bool;

    /// What `page`'s rows say of the terms held (each row carries its
    /// scope's current term as the fetch read it).
    fn check_page(&self, page: &FetchPage) -> TermCheck;

    /// Confirm with one statement that the terms held are still current.
    async fn confirm_terms(&self, cx: Cx<'_>) -> Result<TermCheck, StatementError>;

    /// The terms a write of the settlements of `ids` is conditional on
    /// (`None`: not fenced).
    fn fence_for(&self, ids: &[i64]) -> Option<Fence>;
}

impl Leadership for Ownership {
    fn role(&self) -> Role {
        Ownership::role(self)
    }

    fn may_fetch(&self) -> bool {
        Ownership::may_fetch(self)
    }

    fn next_try(&self) -> Option<Instant> {
        self.lock_at()
    }

    async fn try_take(&mut self, cx: Cx<'_>) -> Result<bool, StatementError> {
        self.take_locks(cx).await
    }

    async fn release_terms(&self, cx: Cx<'_>, settled: bool) -> Result<(), StatementError> {
        if !settled {
            tracing::info!(
                "deliveries still open at the stop: the leadership terms stay unreleased, so the next leader \
                 waits out this one's lease"
            );
            return Ok(());
        }
        for (scope, term) in self.releasable_terms() {
            cx.work.release_term(&scope, term, cx.stop()).await?;
        }
        Ok(())
    }

    #[cfg(feature = "wal")]
    fn stands_by(&self) -> Option<bool> {
        Ownership::stands_by(self)
    }

    fn fenced(&self) -> bool {
        Ownership::fenced(self)
    }

    fn check_page(&self, page: &FetchPage) -> TermCheck {
        Ownership::check_page(self, page)
    }

    async fn confirm_terms(&self, cx: Cx<'_>) -> Result<TermCheck, StatementError> {
        Ownership::confirm_terms(self, cx).await
    }

    fn fence_for(&self, ids: &[i64]) -> Option<Fence> {
        Ownership::fence_for(self, ids)
    }
}

/// Competing mode's leadership: no lock and no term; but what it hands out
/// is claimed by a transaction on its work session, which the server ends
/// once it sits idle for `IDLE_SESSION_TIMEOUT` (the claim then goes to
/// other consumers). So hand-outs are bound by the lease ([`LEASE`], 2 s,
/// well inside those 4 s) from the last statement that found the session
/// alive (a fetch, or a keep-alive sent to renew it): a consumer that was
/// frozen past its claim hands nothing more out of it, and what it had
/// buffered is released with the session. Writes carry no fence.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Unled;

impl Leadership for Unled {
    fn role(&self) -> Role {
        Role::Competing
    }

    fn may_fetch(&self) -> bool {
        true
    }

    fn next_try(&self) -> Option<Instant> {
        None
    }

    async fn try_take(&mut self, _cx: Cx<'_>) -> Result<bool, StatementError> {
        Ok(false)
    }

    async fn release_terms(&self, _cx: Cx<'_>, _settled: bool) -> Result<(), StatementError> {
        Ok(())
    }

    fn fenced(&self) -> bool {
        true
    }

    fn check_page(&self, _page: &FetchPage) -> TermCheck {
        // The fetch ran on the session that holds the claim.
        TermCheck::Confirmed
    }

    async fn confirm_terms(&self, cx: Cx<'_>) -> Result<TermCheck, StatementError> {
        cx.work.keep_alive(cx.stop()).await?;
        Ok(TermCheck::Confirmed)
    }

    fn fence_for(&self, _ids: &[i64]) -> Option<Fence> {
        None
    }
}

//! The listen source (single and partitioned modes): LISTEN wake-ups, the
//! sweep and the retry timer ([`Wakeups`]) say when to fetch; ownership by
//! advisory locks ([`Ownership`]) says whether and which rows; the fetch
//! reads due rows in id order with hold-back (`store::fetch`).

use tokio::time::Instant;

use super::ownership::Ownership;
use super::wakeups::{Wakeups, due, earliest};
use super::{Cx, Room, Signals, Source, TermCheck, Wake};
use crate::consumer::ConsumerConfig;
use crate::consumer::completer::Written;
use crate::consumer::health::Role;
use crate::store::statement::StatementError;
use crate::store::{Fence, FetchKind, FetchPage, FetchParams};

/// Single or partitioned mode's source.
#[derive(Debug)]
pub(crate) struct ListenSource {
    wakeups: Wakeups,
    ownership: Ownership,
}

impl ListenSource {
    /// The source of a consumer configured by `cfg` (single or partitioned
    /// mode), woken by `signals`.
    pub(crate) fn new(cfg: &ConsumerConfig, signals: Signals) -> Self {
        ListenSource { wakeups: Wakeups::new(cfg, signals, false), ownership: Ownership::new(cfg) }
    }
}

impl Source for ListenSource {
    fn fetch_kind(&self) -> FetchKind {
        if self.ownership.is_partitioned() { FetchKind::Partitioned } else { FetchKind::Ordered }
    }

    fn role(&self) -> Role {
        self.ownership.role()
    }

    fn fenced(&self) -> bool {
        self.ownership.fenced()
    }

    fn check_page(&self, page: &FetchPage) -> TermCheck {
        self.ownership.check_page(page)
    }

    async fn confirm_terms(&mut self, cx: Cx<'_>) -> Result<TermCheck, StatementError> {
        self.ownership.confirm_terms(cx).await
    }

    fn fence_for(&self, ids: &[i64]) -> Option<Fence> {
        self.ownership.fence_for(ids)
    }

    fn wants_fetch(&self) -> bool {
        self.wakeups.wants_fetch() && self.ownership.may_fetch()
    }

    wakeups_delegate!();

    fn next_timer(&self, open: bool, stopping: bool) -> Option<Instant> {
        let lock_at = self.ownership.lock_at().filter(|_| open && !stopping);
        earliest(self.wakeups.next_timer(open, stopping, false), lock_at)
    }

    async fn timers_due(&mut self, cx: Option<Cx<'_>>, stopping: bool) -> Result<bool, StatementError> {
        let now = Instant::now();
        self.wakeups.timers_due(cx, stopping, false).await?;
        let Some(cx) = cx.filter(|_| !stopping && due(self.ownership.lock_at(), now)) else { return Ok(false) };
        if self.ownership.take_locks(cx).await? {
            self.wakeups.wake(Wake::Ownership);
        }
        Ok(true)
    }

    async fn fetch(&mut self, cx: Cx<'_>, room: Room<'_>) -> Result<FetchPage, StatementError> {
        let partitions = self.ownership.partitions();
        let scope = Ownership::scope(&partitions);
        let params = FetchParams { exclude: room.exclude, batch: room.batch, budget: room.budget, scope };
        cx.work.fetch(params, cx.stop()).await
    }

    fn handed_out(&mut self, id: i64, partition: Option<i32>) {
        self.ownership.fetched(id, partition);
    }

    async fn fetched(&mut self, cx: Cx<'_>, handed: u64, full: bool) -> Result<(), StatementError> {
        self.wakeups.fetched(cx, handed, full, false).await
    }

    fn released(&mut self, id: i64) {
        self.ownership.done(id);
        self.wakeups.wake(Wake::Release);
    }

    fn written(&mut self, w: &Written) {
        for id in w.acked.iter().chain(&w.dropped).chain(w.failed.iter().map(|(id, _)| id)) {
            self.ownership.done(*id);
        }
        self.wakeups.written(w);
    }

    fn holds_transaction(&self) -> bool {
        false
    }

    async fn settled(&mut self, _cx: Cx<'_>) -> Result<(), StatementError> {
        Ok(())
    }

    async fn session_opened(&mut self, cx: Cx<'_>) -> Result<(), StatementError> {
        self.ownership.session_opened(cx).await?;
        self.wakeups.session_opened();
        Ok(())
    }

    fn session_lost(&mut self) {
        self.wakeups.session_lost();
        self.ownership.session_lost();
    }

    fn stop(&mut self) {
        self.wakeups.stop();
    }

    async fn finish(&mut self, cx: Cx<'_>, deadline: Instant) -> Result<(), StatementError> {
        // Nothing more is handed out: the next leader need not wait out
        // this one's hand-out lease.
        for (scope, term) in self.ownership.releasable_terms() {
            cx.work.release_term(&scope, term, cx.stop()).await?;
        }
        Wakeups::unregister(cx, deadline).await
    }
}

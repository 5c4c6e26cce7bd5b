//! The listen source (single and partitioned modes): LISTEN wake-ups, the
//! sweep and the retry timer ([`Wakeups`]) say when to fetch; ownership by
//! advisory locks ([`Ownership`]) says whether and which rows; the fetch
//! reads due rows in id order with hold-back (`store::fetch`).

use std::collections::HashSet;

use tokio::time::Instant;

use super::floor::FetchFloor;
use super::wakeups::{Wakeups, due, earliest};
use super::{Cx, Room, Signals, Source, Wake};
use crate::consumer::ConsumerConfig;
use crate::consumer::completer::Written;
use crate::consumer::leadership::Ownership;
use crate::store::statement::StatementError;
use crate::store::{FetchKind, FetchPage, FetchParams, FetchedRow};

/// Single or partitioned mode's source.
#[derive(Debug)]
pub(crate) struct ListenSource {
    wakeups: Wakeups,
    ownership: Ownership,
    /// Where the fresh rows are read from ([`FetchFloor`]).
    floor: FetchFloor,
    /// The partitions the last fetch read (a change resets the floor).
    read_partitions: Option<(u32, Vec<i32>)>,
    /// Retried events in flight (fetched with a retry count above 0; at
    /// most the consumer's buffer): when one's acknowledgement is written,
    /// the events of its aggregate held back behind it are due.
    retries: HashSet<i64>,
}

impl ListenSource {
    /// The source of a consumer configured by `cfg` (single or partitioned
    /// mode), woken by `signals`.
    pub(crate) fn new(cfg: &ConsumerConfig, signals: Signals) -> Self {
        ListenSource {
            wakeups: Wakeups::new(cfg, signals, false),
            ownership: Ownership::new(cfg),
            floor: FetchFloor::new(cfg.sweep_interval),
            read_partitions: None,
            retries: HashSet::new(),
        }
    }
}

impl Source for ListenSource {
    type Leader = Ownership;

    fn leadership(&self) -> &Ownership {
        &self.ownership
    }

    fn fetch_kind(&self) -> FetchKind {
        if self.ownership.is_partitioned() { FetchKind::Partitioned } else { FetchKind::Ordered }
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
        if partitions != self.read_partitions {
            // Rows of a partition taken over lie below the floor too.
            self.floor.reset();
            self.read_partitions.clone_from(&partitions);
        }
        let scope = Ownership::scope(&partitions);
        let floor = self.floor.params(Instant::now());
        let params = FetchParams { exclude: room.exclude, batch: room.batch, budget: room.budget, scope, floor };
        let page = cx.work.fetch(params, cx.stop()).await?;
        self.floor.fetched(page.floor, page.rows.iter().filter_map(row_id).max());
        self.retries.extend(page.rows.iter().flatten().filter(|r| r.event.retry_count > 0).map(|r| r.event.id));
        Ok(page)
    }

    fn handed_out(&mut self, id: i64, partition: Option<i32>) {
        self.ownership.fetched(id, partition);
    }

    async fn fetched(&mut self, cx: Cx<'_>, handed: u64, full: bool) -> Result<(), StatementError> {
        self.wakeups.fetched(cx, handed, full, false).await
    }

    fn released(&mut self, id: i64) {
        self.retries.remove(&id);
        self.floor.released(id);
        self.ownership.done(id);
        self.wakeups.wake(Wake::Release);
    }

    fn written(&mut self, w: &Written) {
        for id in w.acked.iter().chain(&w.dropped).chain(w.failed.iter().map(|(id, _)| id)) {
            self.ownership.done(*id);
        }
        let mut retried_acked = false;
        for id in &w.acked {
            retried_acked |= self.retries.remove(id);
        }
        for id in w.dropped.iter().chain(w.failed.iter().map(|(id, _)| id)) {
            self.retries.remove(id);
        }
        if retried_acked {
            // Events of its aggregate held back behind a retried event are
            // due now that its acknowledgement is written: fetch them
            // rather than wait for a notification or the sweep.
            self.wakeups.wake(Wake::Retry);
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
        self.floor.reset();
        self.retries.clear();
        self.ownership.session_opened(cx).await?;
        self.wakeups.session_opened();
        Ok(())
    }

    fn session_lost(&mut self) {
        self.floor.reset();
        self.retries.clear();
        self.wakeups.session_lost();
        self.ownership.session_lost();
    }

    fn stop(&mut self) {
        self.wakeups.stop();
    }

    async fn finish(&mut self, cx: Cx<'_>, deadline: Instant, settled: bool) -> Result<(), StatementError> {
        // Nothing more is handed out and nothing handed out is open: the
        // next leader need not wait out this one's hand-out lease. With
        // deliveries still open (the grace ran out), one may yet reach its
        // destination: the terms stay unreleased and the next leader waits.
        if !settled {
            tracing::info!(
                "deliveries still open at the stop: the leadership terms stay unreleased, so the next leader \
                 waits out this one's lease"
            );
        }
        for (scope, term) in if settled { self.ownership.releasable_terms() } else { Vec::new() } {
            cx.work.release_term(&scope, term, cx.stop()).await?;
        }
        Wakeups::unregister(cx, deadline).await
    }
}

/// The id of a fetched row, if it could be read.
fn row_id(row: &FetchedRow) -> Option<i64> {
    match row {
        Ok(decoded) => Some(decoded.event.id),
        Err(e) => e.identity.as_ref().map(|i| i.id),
    }
}

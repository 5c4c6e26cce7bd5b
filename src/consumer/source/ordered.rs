//! The ordered fetch (single and partitioned modes): due rows in id order
//! with hold-back (`store::fetch`), read from the fetch floor
//! ([`FetchFloor`]), under ownership by advisory locks and their terms
//! ([`Ownership`]), which says whether and which rows.

use std::collections::HashSet;

use tokio::time::Instant;

use super::floor::FetchFloor;
use super::idle::IdleAdvance;
use super::{Cx, Fetch, Room};
use crate::consumer::ConsumerConfig;
use crate::consumer::completer::Written;
use crate::consumer::leadership::Ownership;
use crate::store::statement::StatementError;
use crate::store::{FetchKind, FetchPage, FetchParams, FetchedRow};

/// Single or partitioned mode's fetch.
#[derive(Debug)]
pub(crate) struct OrderedFetch {
    ownership: Ownership,
    /// Where the fresh rows are read from ([`FetchFloor`]).
    floor: FetchFloor,
    /// The partitions the last fetch read (a change resets the floor).
    read_partitions: Option<(u32, Vec<i32>)>,
    /// Retried events in flight (fetched with a retry count above 0; at
    /// most the consumer's buffer): when one's acknowledgement is written,
    /// the events of its aggregate held back behind it are due.
    retries: HashSet<i64>,
    /// A named subscription's cursor moved when a fetch finds nothing.
    idle: IdleAdvance,
}

impl OrderedFetch {
    /// The fetch of a consumer configured by `cfg` (single or partitioned
    /// mode).
    pub(crate) fn new(cfg: &ConsumerConfig) -> Self {
        OrderedFetch {
            ownership: Ownership::new(cfg),
            floor: FetchFloor::new(cfg.sweep_interval),
            read_partitions: None,
            retries: HashSet::new(),
            idle: IdleAdvance::default(),
        }
    }
}

impl Fetch for OrderedFetch {
    type Leader = Ownership;

    fn leadership(&self) -> &Ownership {
        &self.ownership
    }

    fn leadership_mut(&mut self) -> &mut Ownership {
        &mut self.ownership
    }

    fn fetch_kind(&self) -> FetchKind {
        if self.ownership.is_partitioned() { FetchKind::Partitioned } else { FetchKind::Ordered }
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
        self.retries.extend(
            page.rows.iter().flatten().filter(|r| r.event.retry_count > 0 || r.failure_row).map(|r| r.event.id),
        );
        if page.rows.is_empty() {
            self.idle.found_nothing(cx, self.ownership.is_partitioned()).await?;
        }
        Ok(page)
    }

    fn handed_out(&mut self, id: i64, partition: Option<i32>) {
        self.ownership.fetched(id, partition);
    }

    fn released(&mut self, id: i64) {
        self.retries.remove(&id);
        self.floor.released(id);
        self.ownership.done(id);
    }

    fn written(&mut self, w: &Written) -> bool {
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
        // Events of its aggregate held back behind a retried event are due
        // now that its acknowledgement is written: fetch them rather than
        // wait for a notification or the sweep.
        retried_acked
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
        self.ownership.session_opened(cx).await
    }

    fn session_lost(&mut self) {
        self.floor.reset();
        self.retries.clear();
        self.ownership.session_lost();
    }
}

/// The id of a fetched row, if it could be read.
fn row_id(row: &FetchedRow) -> Option<i64> {
    match row {
        Ok(decoded) => Some(decoded.event.id),
        Err(e) => e.identity.as_ref().map(|i| i.id),
    }
}

//! The fetch floor of the ordered fetches (docs/architecture.md, "The
//! fetch floor"): the id above which a fetch reads fresh rows, so that it
//! does not walk the rows drained before it (their index entries stay until
//! VACUUM) nor the events in flight below it.
//!
//! The server moves the floor up (`store::fetch`, `fetch_floor`), from a
//! checkpoint this keeps: the highest id a past fetch returned and the next
//! transaction id that fetch saw. Once a snapshot's xmin reaches that
//! transaction id, no row at or below the checkpoint can still appear, and
//! the floor moves to just below the first fresh row there that is neither
//! in flight nor held back. So it never passes a row that may still be
//! fetched, with two exceptions: an event in flight below the floor that is
//! released (handed back unsettled) lowers the floor below it, and a held
//! back row freed since (its failed event published or discarded) bumps
//! the unblock count, which a fetch reads: when it changed, the fetch read
//! from just below the first held row a floor passed (kept here from the
//! fetches' `held_passed`), and the floor starts again from there. Everything
//! else that could let a row below the floor be fetched again resets it:
//! new sessions, a change of the partitions held, and, as a safety net
//! against what the rule cannot see (an operator setting `published_at`
//! back to NULL, say), every sweep interval.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{FloorParams, FloorReading};

/// Checkpoints kept at most (the oldest are dropped: the newest moves the
/// floor furthest once its transaction id is passed).
const CHECKPOINTS: usize = 64;

/// A past fetch: the highest id it returned and the next transaction id it
/// saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Checkpoint {
    upto: i64,
    next_xid: i64,
}

/// The floor and its checkpoints.
#[derive(Debug)]
pub(super) struct FetchFloor {
    floor: i64,
    checkpoints: VecDeque<Checkpoint>,
    /// The snapshot xmin the last fetch saw.
    last_xmin: Option<i64>,
    /// The checkpoint the fetch in flight was given.
    offered: Option<Checkpoint>,
    /// The count of unblocks the last fetch read (`store::fetch`,
    /// `UNBLOCKS`): a fetch that reads another reads from the lower of the
    /// floor and `held_below`, and the floor starts again from there.
    unblocks: Option<i64>,
    /// Just below the first held-back row the floor passed (`i64::MAX`:
    /// none since the floor last started again).
    held_below: i64,
    reset_every: Duration,
    reset_at: Instant,
}

impl FetchFloor {
    /// No floor yet; reset every `reset_every` (the sweep interval).
    pub(super) fn new(reset_every: Duration) -> Self {
        FetchFloor {
            floor: i64::MIN,
            checkpoints: VecDeque::new(),
            last_xmin: None,
            offered: None,
            unblocks: None,
            held_below: i64::MAX,
            reset_every,
            reset_at: Instant::now() + reset_every,
        }
    }

    /// The floor now (`i64::MIN`: none).
    #[cfg(test)]
    pub(super) fn floor(&self) -> i64 {
        self.floor
    }

    /// Forget the floor and the checkpoints: the next fetch reads from the
    /// first fresh row.
    pub(super) fn reset(&mut self) {
        self.floor = i64::MIN;
        self.held_below = i64::MAX;
        self.checkpoints.clear();
        self.offered = None;
    }

    /// Event `id`, in flight, was released: it is fresh and unpublished
    /// again, so the floor goes below it.
    pub(super) fn released(&mut self, id: i64) {
        self.floor = self.floor.min(id.saturating_sub(1));
    }

    /// The parameters of the next fetch, at `now`: the floor, and the
    /// newest checkpoint whose transaction id the last fetch's snapshot had
    /// passed (else the oldest, which this fetch's snapshot may pass).
    pub(super) fn params(&mut self, now: Instant) -> FloorParams {
        if now >= self.reset_at {
            self.reset();
            self.reset_at = now + self.reset_every;
        }
        let passed = self.last_xmin.and_then(|xmin| self.checkpoints.iter().rposition(|c| c.next_xid <= xmin));
        if let Some(i) = passed {
            // The older ones move the floor less, and are passed too.
            self.checkpoints.drain(..i);
        }
        self.offered = self.checkpoints.front().copied();
        match self.offered {
            Some(c) => FloorParams {
                floor: self.floor,
                upto: c.upto,
                next_xid: c.next_xid,
                unblocks: self.unblocks,
                held_below: self.held_below,
            },
            None => FloorParams {
                floor: self.floor,
                upto: self.floor,
                next_xid: i64::MAX,
                unblocks: self.unblocks,
                held_below: self.held_below,
            },
        }
    }

    /// A fetch given [`Self::params`] returned: what it read of the floor
    /// (`None` for a fetch without rows: nothing changes) and the highest
    /// id among its rows.
    pub(super) fn fetched(&mut self, reading: Option<FloorReading>, highest: Option<i64>) {
        let offered = self.offered.take();
        let Some(r) = reading else { return };
        self.last_xmin = Some(r.snapshot_xmin);
        if r.unblocks != self.unblocks {
            // A failed event stopped holding back its aggregate since the
            // last count: the fetch read from below the first held row the
            // floor had passed (or from the floor), and so does the floor.
            self.unblocks = r.unblocks;
            self.floor = r.floor;
            self.held_below = i64::MAX;
            self.checkpoints.clear();
        } else {
            if let Some(h) = r.held_passed {
                self.held_below = self.held_below.min(h.saturating_sub(1));
            }
            // The floor the fetch used: the one given, or higher if the
            // checkpoint was passed (released events lowered the one given
            // before the fetch was sent, never while it ran: one task).
            self.floor = self.floor.max(r.floor);
            if let Some(c) = offered
                && r.floor >= c.upto
            {
                self.checkpoints.retain(|k| k.upto > r.floor);
            }
        }
        if !r.ids_after_xids {
            // The rule does not hold now (producer-locked mode, an older
            // trigger, a cached sequence): no checkpoint from this fetch.
            return;
        }
        if let Some(upto) = highest.filter(|&h| h > self.floor) {
            if self.checkpoints.len() == CHECKPOINTS {
                self.checkpoints.pop_front();
            }
            self.checkpoints.push_back(Checkpoint { upto, next_xid: r.next_xid });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(floor: i64, snapshot_xmin: i64, next_xid: i64) -> Option<FloorReading> {
        Some(FloorReading { floor, snapshot_xmin, next_xid, ids_after_xids: true, unblocks: None, held_passed: None })
    }

    #[test]
    fn a_checkpoint_is_offered_once_a_snapshot_passed_its_transaction_id() {
        let now = Instant::now();
        let mut f = FetchFloor::new(Duration::from_secs(3600));
        let p = f.params(now);
        assert_eq!(p, FloorParams::NONE, "nothing read yet");
        // Rows up to 500; the snapshot's next xid 100, a producer (xid 90)
        // still running.
        f.fetched(reading(i64::MIN, 90, 100), Some(500));
        let p = f.params(now);
        assert_eq!((p.floor, p.upto, p.next_xid), (i64::MIN, 500, 100), "offered, for the server to check");
        // The server found the xmin still below 100: the floor stays.
        f.fetched(reading(i64::MIN, 95, 110), Some(900));
        let p = f.params(now);
        assert_eq!((p.upto, p.next_xid), (500, 100), "the oldest is offered until one is passed");
        // Passed: the server moved the floor to 500.
        f.fetched(reading(500, 120, 130), Some(1200));
        assert_eq!(f.floor(), 500);
        let p = f.params(now);
        assert_eq!((p.floor, p.upto, p.next_xid), (500, 900, 110), "the newest passed one (1200's is not yet)");
    }

    #[test]
    fn a_release_lowers_the_floor_and_a_reset_forgets_it() {
        let now = Instant::now();
        let mut f = FetchFloor::new(Duration::from_secs(3600));
        f.params(now);
        f.fetched(reading(1000, 10, 20), Some(1500));
        f.released(700);
        assert_eq!(f.floor(), 699);
        assert_eq!(f.params(now).floor, 699);
        f.reset();
        assert_eq!(f.params(now), FloorParams::NONE);
    }

    #[test]
    fn without_the_rule_no_checkpoint_is_kept_and_the_interval_resets() {
        let now = Instant::now();
        let mut f = FetchFloor::new(Duration::from_secs(1));
        f.params(now);
        f.fetched(
            Some(FloorReading {
                floor: i64::MIN,
                snapshot_xmin: 5,
                next_xid: 6,
                ids_after_xids: false,
                unblocks: None,
                held_passed: None,
            }),
            Some(9),
        );
        assert_eq!(f.params(now), FloorParams::NONE);
        f.fetched(reading(40, 5, 6), Some(50));
        assert_eq!(f.floor(), 40);
        assert_eq!(f.params(now + Duration::from_secs(2)), FloorParams::NONE, "reset at the interval");
    }

    #[test]
    fn a_new_unblock_count_starts_the_floor_again_below_the_first_held_row_it_passed() {
        let now = Instant::now();
        let mut f = FetchFloor::new(Duration::from_secs(3600));
        f.params(now);
        f.fetched(reading(i64::MIN, 10, 20), Some(500));
        f.params(now);
        // The step passed held rows, the first at 300.
        f.fetched(Some(FloorReading { held_passed: Some(300), ..reading(500, 30, 40).unwrap() }), Some(900));
        assert_eq!(f.floor(), 500);
        let p = f.params(now);
        assert_eq!((p.unblocks, p.held_below), (None, 299));
        f.fetched(Some(FloorReading { held_passed: Some(450), ..reading(900, 50, 60).unwrap() }), Some(1200));
        assert_eq!(f.params(now).held_below, 299, "the lowest is kept");
        // A retry's acknowledgement freed held rows: the server read from
        // 299 and says so.
        let unblocked = FloorReading { unblocks: Some(1), ..reading(299, 70, 80).unwrap() };
        f.fetched(Some(unblocked), Some(1300));
        assert_eq!(f.floor(), 299, "the floor starts again below the first held row passed");
        let p = f.params(now);
        assert_eq!((p.floor, p.upto, p.next_xid, p.unblocks, p.held_below), (299, 1300, 80, Some(1), i64::MAX));
        // The same count again: the floor moves as before.
        f.fetched(Some(FloorReading { floor: 1300, ..unblocked }), Some(1400));
        assert_eq!(f.floor(), 1300);
        f.reset();
        assert_eq!(f.params(now).unblocks, Some(1), "a reset keeps the count (the floor is gone anyway)");
    }

    #[test]
    fn an_empty_fetch_changes_nothing() {
        let now = Instant::now();
        let mut f = FetchFloor::new(Duration::from_secs(3600));
        f.params(now);
        f.fetched(reading(10, 5, 6), Some(50));
        let before = f.params(now);
        f.fetched(None, None);
        assert_eq!(f.params(now), before);
    }
}

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
//! new sessions, a change of the partitions held, and a change of the
//! rewind count, which a fetch reads too: it is bumped by what makes a row
//! fresh outside the rule (an operator setting `published_at` back to NULL,
//! an insert where the insert trigger does not fire), and a fetch that
//! reads another count reads from the first fresh row. As a safety net
//! against what neither sees (triggers disabled while rows change), the
//! floor is also dropped every [`SAFETY_NET`], or every sweep interval if
//! longer; where rewinds are not counted (their triggers disabled or not
//! created), every sweep interval.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{FloorParams, FloorReading};

/// Checkpoints kept at most (the oldest are dropped: the newest moves the
/// floor furthest once its transaction id is passed).
const CHECKPOINTS: usize = 64;

/// How often the floor is dropped anyway where rewinds are counted (or
/// every sweep interval, if longer): the next fetch then reads from the
/// first fresh row, past every entry the table's index keeps of rows
/// published since the last VACUUM (about one index page per 350 rows,
/// docs/operations.md, "Vacuum"). On a 10 000 000-row table never
/// vacuumed, each such walk cost a draining relay about 0.35 s
/// (docs/performance.md, "The floor's safety net with the rewind count"):
/// once a minute, under 1 % of its time. An event made fresh where no count
/// sees it waits this long at most (or the sweep interval, if longer),
/// plus the wait for the next fetch.
pub(crate) const SAFETY_NET: Duration = Duration::from_secs(60);

/// The count of rewinds or unblocks of an outbox where it is not kept
/// (`store::fetch`, `NOT_COUNTED`).
const NOT_COUNTED: i64 = -1;

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
    /// The count of rewinds the last fetch read (`store::fetch`,
    /// `REWINDS`): a fetch that reads another reads from the first fresh
    /// row, and the floor starts again from there.
    rewinds: Option<i64>,
    /// The sweep interval: how often the floor is dropped where rewinds
    /// are not counted.
    sweep: Duration,
    /// When the floor was last dropped on the clock ([`Self::params`]).
    dropped_at: Instant,
}

impl FetchFloor {
    /// No floor yet; `sweep` is the consumer's sweep interval.
    pub(super) fn new(sweep: Duration) -> Self {
        FetchFloor {
            floor: i64::MIN,
            checkpoints: VecDeque::new(),
            last_xmin: None,
            offered: None,
            unblocks: None,
            held_below: i64::MAX,
            rewinds: None,
            sweep,
            dropped_at: Instant::now(),
        }
    }

    /// How often the floor is dropped on the clock: every [`SAFETY_NET`]
    /// (or sweep interval, if longer) once a fetch has read that rewinds
    /// are counted, else every sweep interval.
    fn drop_every(&self) -> Duration {
        match self.rewinds {
            Some(NOT_COUNTED) => self.sweep,
            // Counted: a term, or none bumped yet.
            _ if self.last_xmin.is_some() => self.sweep.max(SAFETY_NET),
            // Nothing read yet.
            _ => self.sweep,
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
        if now >= self.dropped_at + self.drop_every() {
            self.reset();
            self.dropped_at = now;
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
                rewinds: self.rewinds,
            },
            None => FloorParams {
                floor: self.floor,
                upto: self.floor,
                next_xid: i64::MAX,
                unblocks: self.unblocks,
                held_below: self.held_below,
                rewinds: self.rewinds,
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
        if r.rewinds != self.rewinds || r.unblocks != self.unblocks {
            // A row was made fresh outside the rule since the last count:
            // the fetch read from the first fresh row. Or a failed event
            // stopped holding back its aggregate: the fetch read from below
            // the first held row the floor had passed (or from the floor).
            // The floor starts again from where it read.
            self.rewinds = r.rewinds;
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
        Some(FloorReading {
            floor,
            snapshot_xmin,
            next_xid,
            ids_after_xids: true,
            unblocks: None,
            rewinds: None,
            held_passed: None,
        })
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
    fn without_the_rule_no_checkpoint_is_kept() {
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
                rewinds: None,
                held_passed: None,
            }),
            Some(9),
        );
        assert_eq!(f.params(now), FloorParams::NONE);
    }

    #[test]
    fn the_floor_is_dropped_every_sweep_only_where_rewinds_are_not_counted() {
        let now = Instant::now();
        let sweep = Duration::from_secs(1);
        // Counted (no rewind yet): the floor outlives the sweep, not the
        // safety net.
        let mut f = FetchFloor::new(sweep);
        f.params(now);
        f.fetched(reading(40, 5, 6), Some(50));
        assert_eq!(f.floor(), 40);
        assert_eq!(f.params(now + 2 * sweep).floor, 40, "kept past the sweep interval");
        assert_eq!(f.params(now + SAFETY_NET + sweep), FloorParams::NONE, "dropped by the safety net");
        // Not counted: dropped at the sweep interval.
        let mut f = FetchFloor::new(sweep);
        f.params(now);
        f.fetched(Some(FloorReading { rewinds: Some(NOT_COUNTED), ..reading(40, 5, 6).unwrap() }), Some(50));
        assert_eq!(f.floor(), 40);
        let p = f.params(now + 2 * sweep);
        assert_eq!((p.floor, p.upto, p.rewinds), (i64::MIN, i64::MIN, Some(NOT_COUNTED)), "dropped at the sweep");
        // A sweep interval longer than the safety net is kept.
        let long = SAFETY_NET * 2;
        let mut f = FetchFloor::new(long);
        f.params(now);
        f.fetched(reading(40, 5, 6), Some(50));
        assert_eq!(f.params(now + SAFETY_NET + sweep).floor, 40);
        assert_eq!(f.params(now + long + sweep).floor, i64::MIN);
    }

    #[test]
    fn a_new_rewind_count_starts_the_floor_again_from_the_first_fresh_row() {
        let now = Instant::now();
        let mut f = FetchFloor::new(Duration::from_secs(1));
        f.params(now);
        f.fetched(Some(FloorReading { rewinds: Some(3), ..reading(i64::MIN, 10, 20).unwrap() }), Some(500));
        f.params(now);
        f.fetched(
            Some(FloorReading { rewinds: Some(3), held_passed: Some(300), ..reading(500, 30, 40).unwrap() }),
            Some(900),
        );
        assert_eq!(f.floor(), 500);
        let p = f.params(now);
        assert_eq!((p.floor, p.upto, p.rewinds, p.held_below), (500, 900, Some(3), 299));
        // A row was made fresh again: the server read from the first fresh
        // row and says so.
        f.fetched(Some(FloorReading { rewinds: Some(4), ..reading(i64::MIN, 50, 60).unwrap() }), Some(120));
        assert_eq!(f.floor(), i64::MIN);
        let p = f.params(now);
        assert_eq!((p.floor, p.upto, p.next_xid, p.rewinds, p.held_below), (i64::MIN, 120, 60, Some(4), i64::MAX));
        f.reset();
        assert_eq!(f.params(now).rewinds, Some(4), "a reset keeps the count");
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

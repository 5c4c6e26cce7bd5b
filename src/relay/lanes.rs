//! The relay's lanes: which aggregates have a send in flight, and the
//! deliveries parked behind them. At most one event per aggregate is in
//! flight, so per-aggregate order holds whatever completes first; events
//! of other aggregates go on meanwhile.
//!
//! A lane is keyed by the aggregate id alone, not by type and id: a sink
//! that routes by id only (an exactly-once subject or key template without
//! `{aggregate_type}`) then still sees one event at a time per destination.

use std::collections::{HashMap, VecDeque};

use uuid::Uuid;

/// Busy lanes and what waits behind them. `T` is a delivery (a plain value
/// in the unit tests).
#[derive(Debug)]
pub(crate) struct Lanes<T> {
    /// Aggregates with a send in flight, and the deliveries parked behind
    /// each, in the order the stream handed them out (id order).
    busy: HashMap<Uuid, VecDeque<T>>,
    /// Deliveries parked in all lanes.
    parked: usize,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Lanes { busy: HashMap::new(), parked: 0 }
    }
}

impl<T> Lanes<T> {
    /// Take `item` of aggregate `lane`: `Some(item)` to send now (its lane
    /// was free and is busy now), `None` when it was parked behind the send
    /// in flight.
    pub(crate) fn admit(&mut self, lane: Uuid, item: T) -> Option<T> {
        match self.busy.get_mut(&lane) {
            Some(queue) => {
                queue.push_back(item);
                self.parked += 1;
                None
            }
            None => {
                self.busy.insert(lane, VecDeque::new());
                Some(item)
            }
        }
    }

    /// The send in flight on `lane` succeeded: the next parked delivery of
    /// the lane, to send now (the lane stays busy), or `None` (the lane is
    /// free).
    pub(crate) fn next(&mut self, lane: Uuid) -> Option<T> {
        let queue = self.busy.get_mut(&lane)?;
        match queue.pop_front() {
            Some(item) => {
                self.parked -= 1;
                Some(item)
            }
            None => {
                self.busy.remove(&lane);
                None
            }
        }
    }

    /// The send in flight on `lane` did not succeed (failed or released):
    /// free the lane and hand back what was parked behind it, to release
    /// (a failed event holds back its aggregate's later events).
    pub(crate) fn close(&mut self, lane: Uuid) -> VecDeque<T> {
        let queue = self.busy.remove(&lane).unwrap_or_default();
        self.parked -= queue.len();
        queue
    }

    /// Every parked delivery, all lanes emptied of them (at shutdown).
    pub(crate) fn drain_parked(&mut self) -> Vec<T> {
        self.parked = 0;
        self.busy.values_mut().flat_map(std::mem::take).collect()
    }

    /// Deliveries parked behind a send in flight.
    pub(crate) fn parked(&self) -> usize {
        self.parked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_send_per_lane_in_order_and_a_failure_hands_back_what_waited() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let mut lanes = Lanes::default();
        assert_eq!(lanes.admit(a, 1), Some(1), "a free lane sends at once");
        assert_eq!(lanes.admit(b, 2), Some(2), "another aggregate goes on");
        assert_eq!(lanes.admit(a, 3), None, "parked behind 1");
        assert_eq!(lanes.admit(a, 4), None);
        assert_eq!(lanes.parked(), 2);
        assert_eq!(lanes.next(a), Some(3), "1 done: the next of its lane, in order");
        assert_eq!(lanes.admit(a, 5), None, "the lane is still busy with 3");
        assert_eq!(lanes.close(a), VecDeque::from([4, 5]), "3 failed: what waited behind it comes back");
        assert_eq!(lanes.parked(), 0);
        assert_eq!(lanes.admit(a, 6), Some(6), "the lane is free again");
        assert_eq!(lanes.next(b), None, "2 done, nothing behind it: lane b is free");
        assert_eq!(lanes.admit(b, 7), Some(7));
        assert_eq!(lanes.admit(b, 8), None);
        assert_eq!(lanes.drain_parked(), vec![8]);
        assert_eq!(lanes.parked(), 0);
    }
}

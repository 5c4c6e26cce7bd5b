//! Per-aggregate hold-back: the one place that decides whether a buffered
//! delivery may still be handed out.
//!
//! A delivery waits in the stream's buffer between its fetch and user code.
//! When an earlier event of its aggregate fails or is released in that
//! time, the delivery must not be handed out (it would overtake the failed
//! event): it is released instead, and fetched again after the failure is
//! written. Every fetch has a number (`seq`); for each aggregate the map
//! holds how many of its failures and releases are not yet written
//! (`pending`) and the last fetch number issued before the latest of them
//! was taken in by the loop (`upto_seq`). A delivery is held while its aggregate has a pending entry,
//! or when it came from a fetch issued before the entry's write: that fetch
//! could not see the failure. After a lost session every delivery fetched
//! before it is held (`stale_before`): another consumer may deliver them.
//!
//! Writers of the map: [`Delivery::fail`](super::Delivery::fail), a release
//! (dropped delivery or a held one), an undecodable row ([`HoldBack::hold`]);
//! the drain loop when a failure is written or a release taken in
//! ([`HoldBack::written`]); the drain loop forgetting entries no buffered
//! delivery can match ([`HoldBack::forget_before`]); the drain loop after a
//! lost session ([`HoldBack::stale_through`]). Readers: the stream, as
//! it hands a delivery out ([`HoldBack::is_held`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use uuid::Uuid;

/// An aggregate: `(aggregate_type, aggregate_id)`.
pub(crate) type AggregateKey = (String, Uuid);

/// One aggregate's hold-back entry.
#[derive(Debug, Default)]
struct Hold {
    /// Failures and releases of this aggregate not yet taken in by the loop.
    pending: u32,
    /// Deliveries from fetches up to this number are held.
    upto_seq: u64,
}

/// The hold-back map and the stale-fetch mark, shared by the drain loop and
/// the stream (behind one mutex; the stream only reads it when it is not
/// empty).
#[derive(Debug, Default)]
pub(crate) struct HoldBack {
    map: Mutex<HashMap<AggregateKey, Hold>>,
    /// Deliveries of fetches numbered below this are held (session lost).
    stale_before: AtomicU64,
}

impl HoldBack {
    fn map(&self) -> MutexGuard<'_, HashMap<AggregateKey, Hold>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An event of `key` failed or was released: hold its aggregate's later
    /// deliveries until the loop takes it in ([`Self::written`]).
    pub(crate) fn hold(&self, key: &AggregateKey) {
        self.map().entry(key.clone()).or_default().pending += 1;
    }

    /// The loop took in one failure or release of each of `keys` (a failure
    /// is written, so every fetch issued after fetch `seq` sees it):
    /// deliveries fetched up to `seq` stay held.
    pub(crate) fn written<'a>(&self, keys: impl IntoIterator<Item = &'a AggregateKey>, seq: u64) {
        let mut map = self.map();
        for key in keys {
            let h = map.entry(key.clone()).or_default();
            h.pending = h.pending.saturating_sub(1);
            h.upto_seq = h.upto_seq.max(seq);
        }
    }

    /// Forget entries that can no longer match a buffered delivery: nothing
    /// pending and no delivery from a fetch numbered `oldest` or lower.
    pub(crate) fn forget_before(&self, oldest: u64) {
        self.map().retain(|_, h| h.pending > 0 || h.upto_seq >= oldest);
    }

    /// The session was lost after fetch `seq`: hold everything fetched so far.
    pub(crate) fn stale_through(&self, seq: u64) {
        self.stale_before.store(seq + 1, Ordering::SeqCst);
    }

    /// May a delivery of aggregate `(aggregate_type, aggregate_id)` from
    /// fetch `seq` be handed out? `true`: it must be released instead.
    pub(crate) fn is_held(&self, aggregate_type: &str, aggregate_id: Uuid, seq: u64) -> bool {
        if seq < self.stale_before.load(Ordering::SeqCst) {
            return true;
        }
        let map = self.map();
        if map.is_empty() {
            return false;
        }
        match map.get(&(aggregate_type.to_owned(), aggregate_id)) {
            Some(h) => h.pending > 0 || seq <= h.upto_seq,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u128) -> AggregateKey {
        ("order".to_owned(), Uuid::from_u128(n))
    }

    #[test]
    fn a_failure_holds_its_aggregate_until_written_and_older_fetches_after() {
        let h = HoldBack::default();
        let (a, b) = (key(1), key(2));
        assert!(!h.is_held("order", a.1, 1));
        h.hold(&a);
        assert!(h.is_held("order", a.1, 1), "pending failure holds every fetch");
        assert!(!h.is_held("order", b.1, 1), "other aggregates go on");
        h.written([&a], 3);
        assert!(h.is_held("order", a.1, 3), "fetch 3 ran before the write");
        assert!(!h.is_held("order", a.1, 4), "fetch 4 saw the written failure");
        h.forget_before(3);
        assert!(h.is_held("order", a.1, 3), "kept while fetch 3 may be buffered");
        h.forget_before(4);
        assert!(!h.is_held("order", a.1, 3));
    }

    #[test]
    fn a_lost_session_holds_every_earlier_fetch() {
        let h = HoldBack::default();
        h.stale_through(5);
        assert!(h.is_held("order", key(1).1, 5));
        assert!(!h.is_held("order", key(1).1, 6));
    }
}

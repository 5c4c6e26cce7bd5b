//! A delivery: one event handed to user code, to acknowledge or fail.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::consumer::Shared;
use crate::consumer::holdback::AggregateKey;
use crate::event::Event;
use crate::term::Term;

/// What user code decided about a delivery; sent to the drain loop.
#[derive(Debug)]
pub(crate) enum Settlement {
    Ack { id: i64 },
    Fail { id: i64, key: AggregateKey, retry_count: i32, error: String },
    Release { id: i64, key: AggregateKey },
}

/// One event handed out by an [`EventStream`](crate::EventStream).
///
/// Dereferences to [`Event`]. Settle it exactly once:
/// - [`Delivery::ack`]: delivered; the row is marked published.
/// - [`Delivery::fail`]: not delivered; `retry_count` goes up by one,
///   `last_error` is set, and the event is due again after the retry
///   ladder's delay, or becomes a dead letter at the threshold.
/// - dropped without either (or [`Delivery::release`]): released. Nothing is
///   written; the event stays unpublished and is delivered again on a later
///   fetch, before any later event of its aggregate.
///
/// Settling never blocks and never fails: settlements are queued and written
/// in batches (per write, one `UPDATE` for the acknowledgements and one for
/// the failures). If the process dies before a flush,
/// the event is delivered again (at-least-once).
pub struct Delivery {
    event: Event,
    seq: u64,
    term: Option<Term>,
    shared: Option<Arc<Shared>>,
}

impl Delivery {
    /// Longest error text [`Delivery::fail`] stores in the row's
    /// `last_error`, in bytes: 4096 (cut at a character boundary).
    pub const MAX_ERROR_BYTES: usize = 4096;

    pub(crate) fn new(event: Event, seq: u64, term: Option<Term>, shared: Arc<Shared>) -> Self {
        Delivery { event, seq, term, shared: Some(shared) }
    }

    /// The leadership term under which this event was handed out: a number
    /// that grows each time a relay takes the outbox over (single mode), or
    /// the event's partition (partitioned mode: one term per partition, and
    /// an aggregate always hashes to the same partition), kept in
    /// `events.outbox_terms`. A destination that remembers the highest term
    /// it has seen per aggregate can refuse a delivery of a lower one: it
    /// comes from a relay that has been deposed. The relay sends it with
    /// every message (header `term`, the webhook's `outbox-term`, the
    /// CloudEvents attribute `outboxterm`). `None` in competing mode, which
    /// takes no term.
    pub fn term(&self) -> Option<Term> {
        self.term
    }

    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The event.
    pub fn event(&self) -> &Event {
        &self.event
    }

    fn key(&self) -> AggregateKey {
        (self.event.aggregate_type.clone(), self.event.aggregate_id)
    }

    /// Whether this delivery may still be sent: always for a consumer that
    /// holds no term; for a leader, while its hand-out lease runs
    /// ([`crate::consumer::leadership::lease`]). A lapsed lease is renewed
    /// first (one statement of the drain loop, at most [`LEASE`] waited
    /// for); `false` when the term is gone or the renewal did not come, and
    /// the delivery must be released unsent: its relay may have been
    /// deposed, and its successor may be delivering this aggregate. The
    /// relay asks just before each send, so a relay frozen between the
    /// hand-out and the send (a pipelined send parked behind its
    /// aggregate, or a SIGSTOP) sends nothing once it resumes deposed.
    #[cfg(any(feature = "relay", test))]
    pub(crate) async fn lease_held(&self) -> bool {
        use crate::consumer::leadership::lease::{self, LEASE, LeaseState};
        let Some(shared) = &self.shared else { return false };
        let mut state = shared.lease.subscribe();
        let deadline = tokio::time::Instant::now() + LEASE;
        loop {
            let now = *state.borrow_and_update();
            if lease::allows(now, tokio::time::Instant::now()) {
                return true;
            }
            if now == LeaseState::Revoked {
                return false;
            }
            shared.lease.request_renewal();
            match tokio::time::timeout_at(deadline, state.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return false,
            }
        }
    }

    /// Acknowledge: the event was delivered; mark it published.
    pub fn ack(mut self) {
        if let Some(shared) = self.shared.take() {
            let _ = shared.settle_tx.send(Settlement::Ack { id: self.event.id });
        }
    }

    /// Fail: the event was not delivered. `error` is stored in `last_error`
    /// (NUL characters replaced, cut to [`Delivery::MAX_ERROR_BYTES`], 4096 bytes). Later events of the same
    /// aggregate are held back until this one is delivered.
    pub fn fail(mut self, error: impl fmt::Display) {
        if let Some(shared) = self.shared.take() {
            let key = self.key();
            shared.holdback.hold(&key);
            let _ = shared.settle_tx.send(Settlement::Fail {
                id: self.event.id,
                key,
                retry_count: self.event.retry_count,
                error: sanitize_error(&error.to_string()),
            });
        }
    }

    /// Release without a verdict: nothing is written and the event is
    /// delivered again later. Same as dropping the delivery.
    pub fn release(mut self) {
        self.do_release();
    }

    /// Released because an earlier event of its aggregate failed or was
    /// released after this one was fetched.
    pub(crate) fn release_held(mut self) {
        self.do_release();
    }

    fn do_release(&mut self) {
        if let Some(shared) = self.shared.take() {
            let key = self.key();
            shared.holdback.hold(&key);
            let _ = shared.settle_tx.send(Settlement::Release { id: self.event.id, key });
        }
    }
}

impl Deref for Delivery {
    type Target = Event;
    fn deref(&self) -> &Event {
        &self.event
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.do_release();
    }
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("event", &self.event)
            .field("term", &self.term)
            .field("settled", &self.shared.is_none())
            .finish()
    }
}

/// Replace NUL characters (PostgreSQL text cannot hold them) and cut to
/// [`Delivery::MAX_ERROR_BYTES`] on a character boundary.
pub(crate) fn sanitize_error(s: &str) -> String {
    let mut out = s.replace('\0', "\u{FFFD}");
    if out.len() > Delivery::MAX_ERROR_BYTES {
        let mut cut = Delivery::MAX_ERROR_BYTES;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::leadership::lease::LEASE;
    use tokio::sync::{Notify, mpsc};
    use tokio::time::{Duration, Instant};

    fn delivery() -> (Delivery, Arc<Shared>, mpsc::UnboundedReceiver<Settlement>) {
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            holdback: Default::default(),
            settle_tx,
            reader_waiting: Notify::new(),
            lease: Default::default(),
        });
        let event = Event {
            id: 7,
            aggregate_type: "order".into(),
            aggregate_id: uuid::Uuid::nil(),
            event_type: "Placed".into(),
            payload: serde_json::json!({}),
            occurred_at: chrono::Utc::now(),
            retry_count: 0,
            last_error: None,
        };
        (Delivery::new(event, 1, Term::new(3), shared.clone()), shared, settle_rx)
    }

    #[tokio::test]
    async fn a_send_goes_ahead_under_a_running_lease_and_after_a_renewal_and_never_once_the_term_is_gone() {
        let (d, shared, _settled) = delivery();
        assert!(d.lease_held().await, "unfenced: no term to lose");
        shared.lease.confirm(Instant::now());
        assert!(d.lease_held().await, "within the lease");
        // Lapsed: the send asks for a renewal and goes ahead once it comes.
        shared.lease.confirm(Instant::now() - LEASE - Duration::from_millis(1));
        let renewer = {
            let shared = shared.clone();
            tokio::spawn(async move {
                shared.lease.renewal_requested().await;
                shared.lease.confirm(Instant::now());
            })
        };
        assert!(d.lease_held().await, "renewed");
        renewer.await.expect("the renewal");
        // Revoked (the session and its term are gone): never.
        shared.lease.revoke();
        assert!(!d.lease_held().await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lapsed_lease_nobody_renews_stops_the_send_after_one_lease() {
        let (d, shared, _settled) = delivery();
        shared.lease.confirm(Instant::now() - LEASE - Duration::from_millis(1));
        let started = Instant::now();
        assert!(!d.lease_held().await, "a frozen or deposed relay sends nothing");
        assert_eq!(started.elapsed(), LEASE, "it waited one lease for a renewal");
    }

    #[test]
    fn error_text_is_made_storable() {
        assert_eq!(sanitize_error("a\0b"), "a\u{FFFD}b");
        let long = "é".repeat(5000);
        let s = sanitize_error(&long);
        assert!(s.len() <= 4096 && s.chars().all(|c| c == 'é'));
    }
}

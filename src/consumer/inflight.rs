//! The events in flight: due events into the stream's buffer, in id order,
//! and what the engine keeps of each until it is settled.
//!
//! A fetch takes only as many rows as there is room for in the stream's
//! buffer (the caller reserves the slots first), and only as many payload
//! bytes as the byte bound leaves (the server stops at it, see
//! `store::fetch_sql`), and never an event that is handed out, settled but
//! not yet written, or being written: those ids are excluded
//! ([`InFlight::exclude`]). Every fetch has a number; for every event
//! handed out and not yet settled, the number of the fetch that returned
//! it is kept, which is what per-aggregate hold-back ([`super::holdback`])
//! is decided by. A fetch starts from its floor, not from a cursor: a
//! cursor would skip rows that were held back when it passed them
//! (`super::source::floor`; docs/architecture.md, "The fetch floor").

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::completer::Completer;
use super::holdback::AggregateKey;
use super::{Delivery, Shared};
use crate::metrics as m;
use crate::store::{DecodedEvent, FetchPage, RowIdentity, Undecodable};

/// An event handed out and not settled.
struct Out {
    /// The number of the fetch that returned it.
    seq: u64,
    /// Its payload's bytes as received (`store::rows::payload_bytes`).
    bytes: usize,
}

/// Events handed out, the payload bytes they hold, and the fetch count.
pub(super) struct InFlight {
    /// Handed out (in the buffer or with user code), not settled.
    outstanding: HashMap<i64, Out>,
    /// Sum of the payload bytes of `outstanding`.
    held_bytes: usize,
    /// Bound on `held_bytes` (`ConsumerBuilder::max_buffered_bytes`).
    max_bytes: usize,
    /// Number of the last fetch.
    seq: u64,
    shared: Arc<Shared>,
    /// Rows per fetch.
    batch: usize,
}

impl InFlight {
    /// A fetcher taking `batch` rows per fetch, holding payloads within
    /// `max_bytes` (plus one event).
    pub(super) fn new(shared: Arc<Shared>, batch: usize, max_bytes: usize) -> Self {
        InFlight { outstanding: HashMap::new(), held_bytes: 0, max_bytes, seq: 0, shared, batch }
    }

    /// Payload bytes of the events handed out and not settled.
    pub(super) fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// May a fetch start, as far as the byte bound goes? Not while the held
    /// payloads reach the bound; below it, once half of it is free, or when
    /// the stream's buffer is empty (`buffer_empty`: the reader waits, with
    /// what it holds unsettled). Waiting for half the bound keeps fetches
    /// large: a reader that settles one delivery at a time would otherwise
    /// start a fetch of one event per settlement, each walking a batch of
    /// candidate rows.
    pub(super) fn bytes_allow_fetch(&self, buffer_empty: bool) -> bool {
        self.held_bytes < self.max_bytes && (self.held_bytes <= self.max_bytes / 2 || buffer_empty)
    }

    /// Would the reader emptying the buffer let a fetch start that the
    /// held bytes hold up now?
    pub(super) fn waits_for_empty_buffer(&self) -> bool {
        self.held_bytes < self.max_bytes && self.held_bytes > self.max_bytes / 2
    }

    /// The payload bytes the next fetch may bring: what the bound leaves
    /// (at least 1, so it always brings one event).
    pub(super) fn budget(&self) -> i64 {
        i64::try_from(self.max_bytes.saturating_sub(self.held_bytes).max(1)).unwrap_or(i64::MAX)
    }

    /// Set the gauge of held payload bytes.
    pub(super) fn record_held(&self) {
        crate::metrics::gauge!(m::BUFFERED_PAYLOAD_BYTES).set(self.held_bytes as f64);
    }

    /// Rows per fetch.
    pub(super) fn batch(&self) -> usize {
        self.batch
    }

    /// Events handed out and not settled.
    pub(super) fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// Ids a fetch must not return: handed out, or settled and not yet
    /// written (`completer`'s).
    pub(super) fn exclude(&self, completer: &Completer) -> Vec<i64> {
        let mut exclude: Vec<i64> = self.outstanding.keys().copied().collect();
        exclude.extend(completer.unwritten_ids());
        exclude
    }

    /// Hand the rows of `page` out through `permit` as one new fetch, each
    /// under the leadership term the fetch read for it, telling
    /// `handed_out` each id and partition; a row that cannot be
    /// decoded is recorded as a failed attempt. Stops handing out when
    /// `token` is cancelled (the rest stay unpublished). Returns how many
    /// were handed out.
    pub(super) fn hand_out(
        &mut self,
        page: FetchPage,
        permit: mpsc::PermitIterator<'_, Delivery>,
        (token, completer): (&CancellationToken, &mut Completer),
        mut handed_out: impl FnMut(i64, Option<i32>),
    ) -> u64 {
        self.seq += 1;
        let mut handed = 0u64;
        for (row, slot) in page.rows.into_iter().zip(permit) {
            if token.is_cancelled() {
                break;
            }
            match row {
                Ok(DecodedEvent { event, payload_bytes: bytes, partition, term, .. }) => {
                    self.held_bytes += bytes;
                    if let Some(old) = self.outstanding.insert(event.id, Out { seq: self.seq, bytes }) {
                        // Not expected (a fetch excludes the ids handed out);
                        // keeps the count exact if it happens.
                        self.held_bytes -= old.bytes;
                    }
                    handed_out(event.id, partition);
                    slot.send(Delivery::new(event, self.seq, term, self.shared.clone()));
                    handed += 1;
                }
                Err(undecodable) => self.undecodable(undecodable, completer),
            }
        }
        handed
    }

    /// A row that cannot be decoded (e.g. `occurred_at = 'infinity'`) is
    /// recorded as a failed attempt, like a sink failure: it holds back the
    /// later events of its aggregate, is retried on the ladder, and becomes
    /// a dead letter an operator can see, rather than being skipped.
    fn undecodable(&self, Undecodable { error, identity }: Undecodable, completer: &mut Completer) {
        let msg = super::delivery::sanitize_error(&format!("cannot decode the row: {}", crate::error::report(&*error)));
        let Some(RowIdentity { id, aggregate_type, aggregate_id, retry_count }) = identity else {
            tracing::error!(error = %msg, "could not read an outbox row's id or aggregate; it stays unpublished");
            return;
        };
        tracing::error!(id, error = %msg, "could not read an outbox row; recording it as a failed attempt");
        let key = (aggregate_type, aggregate_id);
        // Hold back the aggregate's later events until the failure is written.
        self.shared.holdback.hold(&key);
        completer.fail(id, key, retry_count, msg);
    }

    /// Event `id` was acknowledged or failed by user code: its payload is
    /// no longer held (the delivery is gone; the settlement holds its id).
    pub(super) fn settled(&mut self, id: i64) {
        self.forget(id);
    }

    fn forget(&mut self, id: i64) {
        if let Some(out) = self.outstanding.remove(&id) {
            self.held_bytes -= out.bytes;
        }
    }

    /// Event `id` of aggregate `key` was released: fetched again later, and
    /// the aggregate's deliveries from fetches so far are held.
    pub(super) fn released(&mut self, id: i64, key: &AggregateKey) {
        self.forget(id);
        self.shared.holdback.written([key], self.seq);
    }

    /// Failures of these aggregates were written: every later fetch sees
    /// them, so only deliveries of fetches so far stay held.
    pub(super) fn failures_written<'a>(&self, keys: impl IntoIterator<Item = &'a AggregateKey>) {
        self.shared.holdback.written(keys, self.seq);
    }

    /// Forget hold-back entries that can no longer match a buffered delivery.
    pub(super) fn forget_holdback(&self) {
        let oldest = self.outstanding.values().map(|o| o.seq).min().unwrap_or(u64::MAX);
        self.shared.holdback.forget_before(oldest);
    }

    /// The session was lost: locks and claims went with it, and another
    /// consumer may deliver what is buffered, so none of it is handed out.
    pub(super) fn session_lost(&self) {
        self.shared.holdback.stale_through(self.seq);
    }
}

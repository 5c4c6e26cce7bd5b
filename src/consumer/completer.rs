//! The completer: acknowledgements and failures, written in batches.
//!
//! Settlements wait here until a batch is full ([`ConsumerConfig`]'s
//! acknowledgement batch size) or the acknowledgement interval has passed
//! since the first of them. A write is one `UPDATE` for the
//! acknowledgements and one for the failures, pipelined on the writer
//! session, and runs in a task of its own while the loop goes on fetching;
//! at most one write is in flight, and its ids are excluded from fetches
//! until its outcome is taken in ([`Completer::finish`]); while two batches
//! are unwritten the loop fetches nothing ([`Completer::behind`]). Both statements
//! are idempotent (an acknowledged row is skipped, a failure applies only
//! while the row's `retry_count` is still the one fetched), so a write whose
//! reply was lost is simply written again.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::ConsumerConfig;
use super::holdback::AggregateKey;
use crate::metrics as m;
use crate::retry::RetryPolicy;
use crate::store::statement::StatementError;
use crate::store::{Acknowledged, FailParams, FailWritten, FailsWritten, Fence, WriterSession};
use crate::term::Term;

/// A failed attempt waiting to be written.
pub(super) struct PendingFail {
    pub(super) id: i64,
    pub(super) key: AggregateKey,
    pub(super) error: String,
    /// Retry delay from the ladder.
    delay: Duration,
    /// The row's retry_count when it was fetched: the write applies only if
    /// it is still that, so a failure replayed after a lost reply is not
    /// counted twice.
    retry_count: i32,
}

/// The outcome of one write, sent back to the loop.
pub(super) struct FlushDone {
    /// The session generation it was written on.
    pub(super) generation: u64,
    acks: Vec<i64>,
    fails: Vec<PendingFail>,
    /// The terms it was conditional on.
    fence: Option<Fence>,
    ack_res: Result<Acknowledged, StatementError>,
    fail_res: Result<FailsWritten, StatementError>,
}

/// What a write's outcome means for the rest of the loop.
pub(super) struct Written {
    /// Ids marked published.
    pub(super) acked: Vec<i64>,
    /// Failures written (id, aggregate).
    pub(super) failed: Vec<(i64, AggregateKey)>,
    /// Seconds from now to the earliest retry the failures scheduled.
    pub(super) earliest_retry: Option<f64>,
    /// The first statement error (its settlements are queued again).
    pub(super) error: Option<StatementError>,
    /// A term of the write was no longer current: the greatest of its
    /// terms (its settlements were dropped, and the current holder delivers
    /// those events again).
    pub(super) fenced: Option<Option<Term>>,
    /// The ids of the settlements dropped as fenced.
    pub(super) dropped: Vec<i64>,
}

/// Pending settlements and the write in flight.
pub(super) struct Completer {
    acks: Vec<i64>,
    fails: Vec<PendingFail>,
    /// Ids of the write in flight: excluded from fetches.
    flushing: Option<Vec<i64>>,
    flush_at: Option<Instant>,
    done_tx: mpsc::UnboundedSender<FlushDone>,
    /// Most acknowledgements (and, apart, most failures) one write takes.
    cap: usize,
    interval: Duration,
    retry: RetryPolicy,
    max_retries: i32,
}

impl Completer {
    /// A completer sending write outcomes to `done_tx`.
    pub(super) fn new(cfg: &ConsumerConfig, done_tx: mpsc::UnboundedSender<FlushDone>) -> Self {
        Completer {
            acks: Vec::new(),
            fails: Vec::new(),
            flushing: None,
            flush_at: None,
            done_tx,
            cap: cfg.ack_batch_size.max(1),
            interval: cfg.ack_interval,
            retry: cfg.retry.clone(),
            max_retries: cfg.max_retries,
        }
    }

    /// Settlements waiting to be written.
    pub(super) fn pending(&self) -> usize {
        self.acks.len() + self.fails.len()
    }

    /// A write is in flight.
    pub(super) fn is_writing(&self) -> bool {
        self.flushing.is_some()
    }

    /// Ids the write in flight holds.
    pub(super) fn writing(&self) -> usize {
        self.flushing.as_ref().map_or(0, Vec::len)
    }

    /// Settlements waiting: (acknowledgements, failures).
    pub(super) fn pending_counts(&self) -> (usize, usize) {
        (self.acks.len(), self.fails.len())
    }

    /// Writes it takes to write every pending settlement.
    pub(super) fn writes_needed(&self) -> usize {
        self.pending().div_ceil(self.cap)
    }

    /// A whole batch waits and nothing is being written.
    pub(super) fn batch_ready(&self) -> bool {
        self.flushing.is_none() && self.pending() >= self.cap
    }

    /// Two batches are unwritten (pending or being written): the writer is
    /// behind, and the loop fetches nothing more until it catches up. This
    /// bounds the settlements held in memory, and the ids every fetch must
    /// skip, at twice the acknowledgement batch; without it a writer slower
    /// than delivery (one batch per write) let them grow without end, and
    /// each fetch, which passes every one of them, grew slower with them.
    pub(super) fn behind(&self) -> bool {
        self.pending() + self.writing() >= 2 * self.cap
    }

    /// When the pending settlements are due to be written.
    pub(super) fn flush_at(&self) -> Option<Instant> {
        self.flush_at
    }

    /// Ids settled but not yet written, or being written: a fetch must not
    /// return them.
    pub(super) fn unwritten_ids(&self) -> impl Iterator<Item = i64> + '_ {
        let fails = self.fails.iter().map(|f| f.id);
        self.acks.iter().copied().chain(fails).chain(self.flushing.iter().flatten().copied())
    }

    /// Write at the latest one acknowledgement interval from now.
    pub(super) fn arm(&mut self) {
        if self.flush_at.is_none() {
            self.flush_at = Some(Instant::now() + self.interval);
        }
    }

    /// Write (or, with nothing pending, end the claim) at once.
    pub(super) fn flush_now(&mut self) {
        self.flush_at = Some(Instant::now());
    }

    /// The flush time passed with nothing to write.
    pub(super) fn disarm(&mut self) {
        self.flush_at = None;
    }

    /// Event `id` was delivered.
    pub(super) fn ack(&mut self, id: i64) {
        self.acks.push(id);
        self.arm();
    }

    /// Event `id` (of aggregate `key`, fetched with `retry_count`) failed
    /// with `error`; its retry delay comes from the ladder. The caller has
    /// already held its aggregate back; the write releases it.
    pub(super) fn fail(&mut self, id: i64, key: AggregateKey, retry_count: i32, error: String) {
        let failures = u32::try_from(retry_count.max(0)).unwrap_or(0).saturating_add(1);
        let delay = self.retry.delay(failures);
        self.fails.push(PendingFail { id, key, error, delay, retry_count });
        self.arm();
    }

    /// Start writing up to one batch of acknowledgements and one of failures
    /// on `writer` (of session generation `generation`), conditional on the
    /// terms `fence_for` names for their ids, without waiting: the outcome
    /// comes back as a [`FlushDone`].
    pub(super) fn start(
        &mut self,
        writer: &WriterSession,
        generation: u64,
        fence_for: impl FnOnce(&[i64]) -> Option<Fence>,
    ) {
        self.flush_at = None;
        if self.flushing.is_some() || self.pending() == 0 {
            return;
        }
        // At most one batch of each per write: settlements put back after a
        // failed write must not make the next write bigger (and slower to
        // meet the statement timeout) than the one that failed.
        let acks: Vec<i64> = self.acks.drain(..self.acks.len().min(self.cap)).collect();
        let fails: Vec<PendingFail> = self.fails.drain(..self.fails.len().min(self.cap)).collect();
        let ids: Vec<i64> = acks.iter().copied().chain(fails.iter().map(|f| f.id)).collect();
        let fence = fence_for(&ids);
        self.flushing = Some(ids);
        let (writer, max_retries) = (writer.clone(), self.max_retries);
        let done_tx = self.done_tx.clone();
        crate::metrics::spawn(async move {
            let (ack_res, fail_res) = write(&writer, &acks, &fails, max_retries, fence.as_ref()).await;
            let _ = done_tx.send(FlushDone { generation, acks, fails, fence, ack_res, fail_res });
        });
    }

    /// Take in the outcome of a write: metrics and dead-letter logs; on an
    /// error the settlements are queued again (both writes are idempotent).
    /// A fenced write is dropped, counted and logged, unless the terms this
    /// consumer would write them under now (`fence_for`) are newer than the
    /// write's (it lost its session and took the outbox, or the
    /// partitions, back): then the settlements, true of deliveries it
    /// made, are queued again under those.
    pub(super) fn finish(&mut self, done: FlushDone, fence_for: impl FnOnce(&[i64]) -> Option<Fence>) -> Written {
        let ids = self.flushing.take().unwrap_or_default();
        let FlushDone { acks, fails, fence, ack_res, fail_res, .. } = done;
        let fenced_write = matches!(&ack_res, Ok(a) if a.fenced) || matches!(&fail_res, Ok(f) if f.fenced);
        let adopt = fenced_write && fence.is_some() && {
            let now = fence_for(&ids);
            now.is_some() && now != fence
        };
        let term = fence.as_ref().and_then(Fence::max_term);
        let mut written = Written {
            acked: Vec::new(),
            failed: Vec::new(),
            earliest_retry: None,
            error: None,
            fenced: None,
            dropped: Vec::new(),
        };
        let mut fenced = (0usize, 0usize);
        match ack_res {
            Ok(acknowledged) if acknowledged.fenced && adopt => self.acks.extend(acks),
            Ok(acknowledged) if acknowledged.fenced => {
                fenced.0 = acks.len();
                written.dropped = acks;
            }
            Ok(acknowledged) => {
                record_published(&acknowledged);
                written.acked = acks;
            }
            Err(e) => {
                self.acks.extend(acks);
                written.error = Some(e);
            }
        }
        match fail_res {
            // Their aggregates stay held back until they are written.
            Ok(rows) if rows.fenced && adopt => self.fails.extend(fails),
            Ok(rows) => {
                if rows.fenced {
                    fenced.1 = fails.len();
                } else {
                    written.earliest_retry = record_failed(&rows.rows, &fails);
                }
                // Written or fenced, the failures are taken in: their
                // aggregates' hold-back ends with them.
                written.failed = fails.into_iter().map(|f| (f.id, f.key)).collect();
            }
            Err(e) => {
                self.fails.extend(fails);
                written.error = written.error.or(Some(e));
            }
        }
        if fenced != (0, 0) {
            written.fenced = Some(term);
            record_fenced(term, fenced);
        }
        written
    }
}

/// Settlements dropped as fenced (`(acknowledgements, failures)`), the
/// write conditional on `term` at most: counted and logged.
fn record_fenced(term: Option<Term>, (acks, fails): (usize, usize)) {
    crate::metrics::counter!(m::FENCED_WRITES, "write" => "ack").increment(acks as u64);
    crate::metrics::counter!(m::FENCED_WRITES, "write" => "fail").increment(fails as u64);
    tracing::warn!(
        term = term.map_or(0, Term::get),
        acknowledgements = acks,
        failures = fails,
        "settlements not written: a leadership term of this consumer was superseded (another relay took the \
         outbox or the partition over); those events stay unpublished and the current holder delivers them again"
    );
}

/// Acknowledged rows: the delivery-lag histogram and the published counter.
fn record_published(acknowledged: &Acknowledged) {
    let hist = crate::metrics::histogram!(m::DELIVERY_LAG);
    for lag in &acknowledged.lags_secs {
        hist.record(*lag);
    }
    crate::metrics::counter!(m::EVENTS_PUBLISHED).increment(acknowledged.published);
}

/// Failed rows: counters, a warning per new dead letter; the earliest
/// retry, in seconds from now.
fn record_failed(rows: &[FailWritten], fails: &[PendingFail]) -> Option<f64> {
    let mut earliest: Option<f64> = None;
    let mut dead = 0u64;
    for r in rows {
        if r.dead {
            dead += 1;
            let err = fails.iter().find(|f| f.id == r.id).map(|f| f.error.as_str()).unwrap_or("");
            tracing::warn!(id = r.id, error = err, "event became a dead letter");
        }
        if let Some(s) = r.retry_in_secs {
            earliest = Some(earliest.map_or(s, |e: f64| e.min(s)));
        }
    }
    crate::metrics::counter!(m::EVENTS_FAILED).increment(fails.len() as u64);
    crate::metrics::counter!(m::EVENTS_DEAD_LETTERED).increment(dead);
    earliest
}

/// One write: the acknowledgement and failure `UPDATE`s, pipelined on
/// `writer`; each runs to its end or its statement timeout.
async fn write(
    writer: &WriterSession,
    acks: &[i64],
    fails: &[PendingFail],
    max_retries: i32,
    fence: Option<&Fence>,
) -> (Result<Acknowledged, StatementError>, Result<FailsWritten, StatementError>) {
    let fails: Vec<FailParams<'_>> = fails
        .iter()
        .map(|f| FailParams { id: f.id, error: &f.error, delay: f.delay, retry_count: f.retry_count })
        .collect();
    tokio::join!(writer.ack(acks, fence), writer.fail(&fails, max_retries, fence))
}

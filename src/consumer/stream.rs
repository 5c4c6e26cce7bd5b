//! The stream handle: what the user holds while the consumer runs.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use futures::stream::FusedStream;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::leadership::lease;
use super::{Delivery, HealthMonitor, delivery, holdback};
use crate::error::{Error, Result};

/// The drain loop's and the notifier's task handles.
type Tasks = (JoinHandle<Result<()>>, Option<JoinHandle<()>>);

/// State of the LISTEN connection, for monitoring and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStatus {
    /// True while the LISTEN connection is up and listening (with the WAL
    /// source: while its replication connection streams).
    pub listening: bool,
    /// Successful reconnects since start (the first connection is not counted).
    pub reconnects: u64,
    /// The WAL source only: the replication stream is closed on purpose
    /// because this consumer stands by in single mode (another holds the
    /// outbox); it opens again when this one leads. Always false with
    /// LISTEN, whose connection stays open on standbys.
    pub standing_by: bool,
    /// Whether the test notification this consumer sent at start came back
    /// to its LISTEN connection within 2 s (`Some(false)`: it runs on its
    /// sweep alone, as through a transaction-mode pooler); `None` with the
    /// WAL source or with LISTEN turned off.
    pub notifications_work: Option<bool>,
}

/// What the drain loop and the deliveries share.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Per-aggregate hold-back of deliveries already fetched.
    pub(crate) holdback: holdback::HoldBack,
    /// Settlements, to the drain loop.
    pub(crate) settle_tx: mpsc::UnboundedSender<delivery::Settlement>,
    /// The stream's reader found the buffer empty and waits: the drain
    /// loop may fetch below the byte bound although less than half of it
    /// is free ([`ConsumerBuilder::max_buffered_bytes`]).
    pub(crate) reader_waiting: Notify,
    /// The leader's hand-out lease ([`lease`]).
    pub(crate) lease: lease::Lease,
}

impl Shared {
    /// Must `d` be released instead of handed out ([`holdback`])?
    fn is_held(&self, d: &Delivery) -> bool {
        self.holdback.is_held(&d.aggregate_type, d.aggregate_id, d.seq())
    }
}

/// The consumer's stream of deliveries, in id order.
///
/// Each [`Delivery`] must be acknowledged ([`Delivery::ack`]) or failed
/// ([`Delivery::fail`]); one dropped without either is released: nothing is
/// written, and the event is delivered again on a later fetch.
///
/// Order: events are handed out in ascending id. An event waiting for a
/// retry, or a dead letter, holds back the later events of its aggregate;
/// other aggregates go on. For this to hold end to end, settle an
/// aggregate's deliveries one after another (a reader that handles several
/// deliveries of one aggregate at once decides their order itself).
///
/// The stream ends (`None`) after [`EventStream::shutdown`] or
/// [`ShutdownHandle::shutdown`]; deliveries still buffered then are released.
/// Dropping the stream also stops the consumer.
///
/// # Cancel safety
/// `next()` is cancel safe: a delivery is either returned or stays buffered.
#[derive(Debug)]
pub struct EventStream {
    rx: mpsc::Receiver<Delivery>,
    shared: Arc<Shared>,
    token: CancellationToken,
    tasks: Option<Tasks>,
    status: watch::Receiver<ListenerStatus>,
    health: HealthMonitor,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    grace: Duration,
    done: bool,
    /// A delivery taken from the buffer that waits for the lease to be
    /// confirmed ([`lease`]).
    waiting: Option<Delivery>,
    /// Resolves when the lease changes (set while `waiting` waits).
    lease_changed: Option<LeaseChanged>,
    /// What exactly-once delivery needs to know of the consumer (read by
    /// the relay).
    #[cfg_attr(not(feature = "relay"), allow(dead_code))]
    order: OrderFacts,
    /// The named subscription it reads (`None`: the default one).
    subscription: Option<Arc<str>>,
}

/// How the consumer keeps per-aggregate order: what
/// [`EventStream::check_exactly_once`] reads.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "relay"), allow(dead_code))]
pub(super) struct OrderFacts {
    /// The consumer's mode.
    pub(super) mode: super::Mode,
    /// The ordering mode installed on `events.outbox` at start; `None`:
    /// no insert trigger.
    pub(super) ordering: Option<crate::migrate::OrderingMode>,
    /// [`super::ConsumerBuilder::producers_lock_aggregates`].
    pub(super) producers_lock: bool,
}

/// Resolves when the hand-out lease changes.
struct LeaseChanged(Pin<Box<dyn Future<Output = ()> + Send + Sync>>);

impl std::fmt::Debug for LeaseChanged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseChanged")
    }
}

/// What [`EventStream::new`] takes.
pub(super) struct StreamParts {
    pub(super) rx: mpsc::Receiver<Delivery>,
    pub(super) shared: Arc<Shared>,
    pub(super) token: CancellationToken,
    pub(super) tasks: Tasks,
    pub(super) status: watch::Receiver<ListenerStatus>,
    pub(super) health: HealthMonitor,
    pub(super) grace: Duration,
    pub(super) order: OrderFacts,
    pub(super) subscription: Option<Arc<str>>,
}

impl EventStream {
    /// The stream over a started consumer's parts.
    pub(super) fn new(p: StreamParts) -> Self {
        let StreamParts { rx, shared, token, tasks, status, health, grace, order, subscription } = p;
        let cancelled = Box::pin(token.clone().cancelled_owned());
        EventStream {
            rx,
            shared,
            token,
            tasks: Some(tasks),
            status,
            health,
            cancelled,
            grace,
            done: false,
            waiting: None,
            lease_changed: None,
            order,
            subscription,
        }
    }

    /// The named subscription this stream reads (`None`: the default
    /// one), for the label of the relay's metrics.
    #[cfg_attr(not(feature = "relay"), allow(dead_code))]
    pub(crate) fn subscription(&self) -> Option<Arc<str>> {
        self.subscription.clone()
    }

    /// Whether this stream keeps what exactly-once delivery rests on: each
    /// aggregate's events handed out one at a time, in the order their
    /// transactions wrote them.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) naming the cause: competing
    /// mode (it hands an aggregate's events to several readers at once), or
    /// an outbox whose order rests on the producers' own lock (ordering
    /// mode `producer-locked`, or no insert trigger) without
    /// [`super::ConsumerBuilder::producers_lock_aggregates`].
    #[cfg(feature = "relay")]
    pub(crate) fn check_exactly_once(&self) -> Result<()> {
        use crate::migrate::OrderingMode;
        if self.order.mode == super::Mode::Competing {
            return Err(crate::error::Error::Config(
                "exactly-once delivery (--exactly-once) needs one aggregate's events delivered one at a time in id \
                 order, which competing mode (--mode competing) does not keep; use single or partitioned mode"
                    .into(),
            ));
        }
        if self.order.producers_lock {
            return Ok(());
        }
        let rests_on = match self.order.ordering {
            Some(OrderingMode::OutboxLocked) => return Ok(()),
            Some(OrderingMode::ProducerLocked) => "ordering mode producer-locked is installed",
            None => "no insert trigger is enabled on events.outbox",
        };
        Err(crate::error::Error::Config(format!(
            "exactly-once delivery (--exactly-once): {rests_on}, so per-aggregate order rests on every producer \
             locking its aggregate's row before it inserts; declare that contract with --producers-lock-aggregates \
             (ConsumerBuilder::producers_lock_aggregates), or install `pg-outbox migrate --ordering outbox-locked`. \
             A producer that breaks it makes an event arrive after a later one of its aggregate: that event then \
             fails (the broker cannot be shown to hold it), it is never acknowledged unsent"
        )))
    }

    /// A handle that can stop this consumer from another task.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle { token: self.token.clone() }
    }

    /// Stop fetching; the stream then ends. Idempotent. Call
    /// [`EventStream::finish`] to wait for the final acknowledgements.
    pub fn shutdown(&self) {
        self.token.cancel();
    }

    /// The shutdown grace this consumer was built with (default 30 s).
    pub fn shutdown_grace(&self) -> Duration {
        self.grace
    }

    /// Watch the LISTEN connection's state.
    pub fn listener_status(&self) -> watch::Receiver<ListenerStatus> {
        self.status.clone()
    }

    /// A handle that reads this consumer's [`Health`](crate::health::Health): whether its drain
    /// loop still turns, whether its database sessions are open, its
    /// [`Role`](crate::health::Role), the LISTEN connection's state, the last database error,
    /// and (under `relay::run`) the sink's side. Cheap
    /// to clone and to read; meant for liveness and readiness probes (the
    /// relay's `/livez` and `/readyz` are built on it).
    ///
    /// # Example
    /// ```no_run
    /// # async fn run(pg: pg_outbox::ConnectOptions) -> Result<(), pg_outbox::Error> {
    /// let events = pg_outbox::Consumer::builder(pg).start().await?;
    /// let health = events.health();
    /// tokio::spawn(async move {
    ///     loop {
    ///         let h = health.get();
    ///         if !h.live {
    ///             eprintln!("drain loop stalled for {:?}", h.since_last_turn);
    ///         }
    ///         tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    ///     }
    /// });
    /// # Ok(()) }
    /// ```
    pub fn health(&self) -> HealthMonitor {
        self.health.clone()
    }

    /// Stop (if not stopped yet), release buffered deliveries, wait until
    /// every delivery already handed out is settled (up to the shutdown
    /// grace), write the final acknowledgements, and close the connections.
    ///
    /// Database errors while the consumer runs are retried (with backoff),
    /// never returned; settlements that could not be written by the end are
    /// logged as an error, and those events are delivered again. One
    /// thing ends a consumer on its own: the named subscription it reads
    /// was dropped ([`crate::subscription::drop`]); its stream then ends.
    ///
    /// # Errors
    /// [`Error::Subscription`] with
    /// [`crate::error::SubscriptionError::Unknown`] when the consumer
    /// stopped because its subscription was dropped; [`Error::Io`] if the
    /// drain task panicked.
    ///
    /// # Cancel safety
    /// Cancel safe: the consumer is told to stop before the first await, and
    /// its tasks finish stopping on their own (final acknowledgements
    /// included) if the future is dropped; only the wait for them is given up.
    pub async fn finish(mut self) -> Result<()> {
        self.token.cancel();
        self.release_buffered();
        match self.tasks.take() {
            Some((mut drain, notifier)) => {
                // Keep releasing what a fetch in progress still hands out, so
                // the drain loop does not wait for deliveries nobody will read.
                let mut open = true;
                let r = loop {
                    tokio::select! {
                        r = &mut drain => break r,
                        d = self.rx.recv(), if open => match d {
                            Some(d) => drop(d),
                            None => open = false,
                        },
                    }
                };
                if let Some(n) = notifier {
                    let _ = n.await;
                }
                r.map_err(|e| Error::Io(std::io::Error::other(e)))?
            }
            None => Ok(()),
        }
    }

    fn release_buffered(&mut self) {
        self.waiting = None;
        self.lease_changed = None;
        self.rx.close();
        while let Ok(d) = self.rx.try_recv() {
            drop(d); // Drop releases it
        }
    }
}

impl Stream for EventStream {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.token.is_cancelled() {
            self.done = true;
            self.release_buffered();
            return Poll::Ready(None);
        }
        loop {
            let next = match self.waiting.take() {
                Some(d) => Poll::Ready(Some(d)),
                None => self.rx.poll_recv(cx),
            };
            match next {
                Poll::Ready(Some(d)) => {
                    if self.shared.is_held(&d) {
                        d.release_held();
                        continue;
                    }
                    if self.lease_allows(cx) {
                        return Poll::Ready(Some(d));
                    }
                    // Wait for the drain loop to confirm the term (or to
                    // lose it: then hold-back releases the delivery).
                    self.waiting = Some(d);
                    if self.cancelled.as_mut().poll(cx).is_ready() {
                        self.done = true;
                        self.release_buffered();
                        return Poll::Ready(None);
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    self.shared.reader_waiting.notify_one();
                    // Also wake up when shutdown is requested.
                    if self.cancelled.as_mut().poll(cx).is_ready() {
                        self.done = true;
                        self.release_buffered();
                        return Poll::Ready(None);
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl EventStream {
    /// May a delivery be handed out now ([`lease`])? When not, ask the
    /// drain loop to confirm the term, and have `cx` woken when the lease
    /// changes.
    fn lease_allows(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.lease_changed.is_none() {
                // Subscribe before reading, so no change is missed.
                let mut rx = self.shared.lease.subscribe();
                if lease::allows(*rx.borrow_and_update(), tokio::time::Instant::now()) {
                    return true;
                }
                self.shared.lease.request_renewal();
                self.lease_changed = Some(LeaseChanged(Box::pin(async move {
                    // The sender lives in `Shared`, which this stream holds:
                    // it is never dropped first.
                    let _ = rx.changed().await;
                })));
            }
            match self.lease_changed.as_mut().map(|f| f.0.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => self.lease_changed = None,
                _ => return false,
            }
        }
    }
}

impl FusedStream for EventStream {
    fn is_terminated(&self) -> bool {
        self.done
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Stops a consumer from another task; cheap to clone.
#[derive(Debug, Clone)]
pub struct ShutdownHandle {
    token: CancellationToken,
}

impl ShutdownHandle {
    /// Stop fetching: the stream ends, buffered deliveries are released, and
    /// the drain loop waits (up to the shutdown grace) for deliveries already
    /// handed out, then writes the final acknowledgements. Idempotent; does
    /// not wait (use [`EventStream::finish`]).
    pub fn shutdown(&self) {
        self.token.cancel();
    }

    /// True once shutdown was requested.
    pub fn is_shutdown(&self) -> bool {
        self.token.is_cancelled()
    }
}

//! The relay's pipeline state: the lanes (one send in flight per
//! aggregate), when each send in flight started, what a completion settles,
//! and the shutdown grace. [`super::run_with`] owns the sends themselves
//! and drives this from its `select!`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::lanes::Lanes;
use super::{FatalSinkError, RelayStats, Sent};
use crate::consumer::{Delivery, HealthMonitor, ShutdownHandle};
use crate::error::BoxError;
use crate::metrics as m;

/// What a send that never began returns: its hand-out lease lapsed and
/// could not be renewed before the send (`Delivery::lease_held`), so this
/// relay may have been deposed. The delivery is released unsent, with
/// those parked behind it; whoever leads delivers them.
#[derive(Debug, thiserror::Error)]
#[error("the leadership lease lapsed before the send (this relay may have been deposed)")]
pub(super) struct LeaseLapsed;

/// Everything [`super::run_with`] keeps between sends.
pub(super) struct Pipeline {
    /// Sends in flight at most (at least 1).
    max: usize,
    lanes: Lanes<Delivery>,
    /// Start of each send in flight, by (start, id): the first is the oldest.
    starts: BTreeSet<(Instant, i64)>,
    pub(super) stats: RelayStats,
    /// The sink said it is gone: no more sends.
    pub(super) fatal: Option<FatalSinkError>,
    /// When the sends in flight are given up (set at shutdown).
    pub(super) grace_until: Option<tokio::time::Instant>,
    grace: Duration,
    handle: ShutdownHandle,
    monitor: HealthMonitor,
}

impl Pipeline {
    /// Up to `max` sends in flight (at least 1); `grace` for them at
    /// shutdown; `handle` stops the consumer; `monitor` gets the sink's side
    /// of health.
    pub(super) fn new(max: usize, grace: Duration, handle: ShutdownHandle, monitor: HealthMonitor) -> Self {
        Pipeline {
            max: max.max(1),
            lanes: Lanes::default(),
            starts: BTreeSet::new(),
            stats: RelayStats::default(),
            fatal: None,
            grace_until: None,
            grace,
            handle,
            monitor,
        }
    }

    /// Whether another delivery may be taken from the stream, with
    /// `in_flight` sends in flight.
    pub(super) fn room(&self, in_flight: usize) -> bool {
        self.fatal.is_none() && in_flight < self.max && self.lanes.parked() < self.max
    }

    /// A delivery the stream handed out: `Some` to send now, `None` when it
    /// waits behind its aggregate's send in flight.
    pub(super) fn admit(&mut self, delivery: Delivery) -> Option<Delivery> {
        self.lanes.admit(delivery.aggregate_id, delivery)
    }

    /// `delivery` is sent now: its start.
    pub(super) fn started(&mut self, delivery: &Delivery) -> Instant {
        let at = Instant::now();
        self.starts.insert((at, delivery.id));
        at
    }

    /// The send of `delivery` that started `at` ended with `result`:
    /// acknowledge, fail or (the sink is gone) release it; on anything but
    /// success release what waited behind it. Returns the next delivery of
    /// its aggregate to send now, if any.
    pub(super) fn settle(
        &mut self,
        delivery: Delivery,
        at: Instant,
        result: Result<Sent, BoxError>,
    ) -> Option<Delivery> {
        let ended = Instant::now();
        self.starts.remove(&(at, delivery.id));
        crate::metrics::histogram!(m::SINK_DURATION).record((ended - at).as_secs_f64());
        let health = self.monitor.state();
        let lane = delivery.aggregate_id;
        let e = match result {
            Ok(sent) => {
                health.delivery_ended(ended, Ok(()));
                self.stats.delivered += 1;
                if let Sent::Held(_) = sent {
                    self.stats.held += 1;
                }
                delivery.ack();
                return self.lanes.next(lane);
            }
            Err(e) => e,
        };
        let e = match e.downcast::<LeaseLapsed>() {
            Ok(_) => {
                tracing::warn!(id = delivery.id, term = ?delivery.term(), "{LeaseLapsed}; released unsent");
                delivery.release();
                for held in self.lanes.close(lane) {
                    held.release_held();
                }
                return None;
            }
            Err(e) => e,
        };
        match e.downcast::<FatalSinkError>() {
            Ok(f) => {
                health.delivery_ended(ended, Err(f.to_string()));
                tracing::error!(id = delivery.id, error = %f, "sink is gone; stopping (the event is released, not failed)");
                delivery.release();
                if self.fatal.is_none() {
                    self.fatal = Some(*f);
                    self.handle.shutdown();
                    self.grace_until.get_or_insert_with(|| tokio::time::Instant::now() + self.grace);
                }
            }
            Err(e) => {
                self.stats.failed += 1;
                let msg = crate::error::report(e.as_ref());
                health.delivery_ended(ended, Err(msg.clone()));
                tracing::warn!(id = delivery.id, attempt = delivery.retry_count + 1, error = %msg.escape_debug(), "sink failed");
                delivery.fail(msg);
            }
        }
        // Its aggregate's later events are held back.
        for held in self.lanes.close(lane) {
            held.release_held();
        }
        if self.fatal.is_some() {
            self.release_parked();
        }
        None
    }

    /// Shutdown asked for, `in_flight` sends in flight: stop the consumer,
    /// start the grace, release what waits behind the sends.
    pub(super) fn shut_down(&mut self, in_flight: usize) {
        tracing::info!(in_flight, grace = ?self.grace, "shutting down: waiting for the events in flight, then writing acknowledgements");
        self.handle.shutdown();
        self.grace_until.get_or_insert_with(|| tokio::time::Instant::now() + self.grace);
        self.release_parked();
    }

    /// The grace ran out with `in_flight` sends in flight, which the caller
    /// drops (a dropped delivery is released, never published).
    pub(super) fn give_up(&mut self, in_flight: usize) {
        tracing::warn!(
            in_flight,
            "shutdown grace ran out; the events in flight are released and will be delivered again"
        );
        self.starts.clear();
        self.release_parked();
    }

    /// Publish the in-flight figures: health's oldest send, the gauge.
    pub(super) fn report(&self, in_flight: usize) {
        self.monitor.state().deliveries_in_flight(self.starts.first().map(|(at, _)| *at));
        crate::metrics::gauge!(m::SINK_IN_FLIGHT).set(in_flight as f64);
    }

    /// Release every delivery parked behind a send in flight.
    fn release_parked(&mut self) {
        for parked in self.lanes.drain_parked() {
            parked.release_held();
        }
    }
}

//! The relay: a consumer whose deliveries go to a [`Sink`]. What the
//! `pg-outbox relay` command runs, usable from a program too.
//!
//! Each delivery is handed to the sink; `Ok` acknowledges it (it becomes
//! published), `Err` fails it (retry with backoff, dead letter at the
//! threshold). Up to [`DeliveryOptions::max_in_flight`] deliveries are in
//! flight at once, at most one per aggregate (a lane per aggregate id), so
//! per-aggregate order holds at the sink whatever completes first, and
//! throughput follows the sink's capacity rather than one over its round
//! trip. Each completion is settled as it lands.
//!
//! [`replay`] delivers events that were already published to a sink again,
//! without changing the table.
//!
//! # The parts
//! - [`Sink`] (and [`EventSink`], for a sink that needs only the event):
//!   what a sink does; [`run`] and [`run_with`] wrap every send with the
//!   encoding ([`Message`]), the timeout ([`DeliveryOptions`]), the sink's
//!   name in errors, and health.
//! - [`SINKS`]: the registry, from which [`open_sink`], the list of schemes
//!   and the "built without feature X" error come. It is made from one
//!   list in `sink_list.rs` (`each_sink!`), which also makes the sink flags
//!   of the binary ([`SinkFlags`], feature `cli`) and the `cfg` of what only
//!   some sinks use.
//! - [`SinkSettings`]: the shared settings and one options struct per sink;
//!   secrets are [`crate::secret::Secret`]s, so `Debug` masks them. TLS, credentials
//!   and why a broker refused a connection are in `access.rs`.
//!
//! # Adding a sink
//! The code:
//! 1. One file in `src/relay/sinks/`: the sink, its options struct, its
//!    `open` function and, under feature `cli`, its flags (`Flags`, a
//!    `clap::Args`, empty for a sink with none) with `apply`, which writes
//!    them into [`SinkSettings`].
//! 2. One entry in the list `each_sink!` in `sink_list.rs`: its name for
//!    messages, feature, schemes, whether its flags echo secrets, and why
//!    it cannot deliver exactly once (a reason in `registry.rs`), or not.
//! 3. Its `mod` and `pub use` lines in `sinks/mod.rs`, one field in
//!    [`SinkSettings`], and a Cargo feature (in `full` too).
//! 4. A flag type whose values hold secrets: the binary's `config.rs` names
//!    it, so that `--print-config` masks it.
//!
//! Then the words, which no list makes: the scheme in the `--sink` help
//! (the binary's `sink_args.rs`) and in [`open_sink`]'s doc; the feature
//! tables of README and `src/guide.md`; the sink's section in
//! docs/operations.md, "Sinks". The registry's test pins the sinks that
//! can deliver exactly once: a new one that can joins it. This file is not
//! touched.

mod access;
#[cfg(feature = "cli")]
mod cli;
mod lanes;
mod message;
mod pipeline;
mod registry;
pub mod replay;
mod settings;
mod sink;
mod sink_list;
mod sinks;

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;

use pipeline::Pipeline;

pub use access::{Credentials, TlsOptions};
#[cfg(feature = "cli")]
pub use cli::SinkFlags;
pub use message::{DEFAULT_CLOUDEVENTS_SOURCE, Format, Message, Template, header};
pub use registry::{OpenSink, SINKS, SinkKind, open_sink, sink_schemes};
pub use settings::{DEFAULT_BROKER_CHECK_INTERVAL, SinkSettings};
pub use sink::{
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_SINK_TIMEOUT, DeliveryOptions, EventSink, Guarantee, Proof, SendFuture, Sent, Sink,
    SinkFuture, SinkRecord,
};
pub use sinks::*;

pub use crate::secret::Secret;

use crate::consumer::EventStream;
use crate::error::{BoxError, Result};
use crate::event::Event;
use crate::metrics as m;

/// Counts of what a relay run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Events the sink accepted (acknowledged), those it found the
    /// destination already holding included.
    pub delivered: u64,
    /// Of [`RelayStats::delivered`], the events acknowledged without a send:
    /// an exactly-once sink read each back from the broker ([`Sent::Held`]).
    pub held: u64,
    /// Attempts the sink refused (failed, to be retried or dead-lettered).
    pub failed: u64,
}

/// A sink error that means the sink itself is gone (for example standard
/// output was closed), not that this event is bad. [`run`] stops on it: the
/// event is released (not charged a failure) and `run` returns
/// [`Error::Sink`](crate::Error::Sink).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct FatalSinkError(pub String);

/// Deliver `event` (under leadership term `term`, if any) to `sink` (as
/// [`sink::deliver`] does). When `shutdown` (if given) resolves first,
/// log it (`what`: how the caller calls stopping), call `on_stop`, and give
/// the delivery `grace` more. Returns its outcome (`None`: the grace ran
/// out) and whether `shutdown` resolved.
pub(crate) async fn deliver_with_grace<S, F>(
    sink: &S,
    options: &DeliveryOptions,
    (event, term): (&Event, Option<crate::term::Term>),
    shutdown: Option<Pin<&mut F>>,
    grace: Duration,
    what: &str,
    on_stop: impl FnOnce(),
) -> (Option<Result<Sent, BoxError>>, bool)
where
    S: Sink + ?Sized,
    F: Future<Output = ()>,
{
    let deliver = sink::deliver(sink, options, event, term);
    tokio::pin!(deliver);
    let watching = shutdown.is_some();
    let shutdown = async {
        match shutdown {
            Some(s) => s.await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = &mut deliver => (Some(r), false),
        _ = shutdown, if watching => {
            tracing::info!(id = event.id, grace = ?grace, "{what}: waiting for the event in hand");
            on_stop();
            (tokio::time::timeout(grace, &mut deliver).await.ok(), true)
        }
    }
}

/// Resolves at `deadline`; never without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Deliver every event of `stream` to `sink` with the default
/// [`DeliveryOptions`] until `shutdown` resolves or the stream ends: see
/// [`run_with`].
///
/// # Errors
/// As [`run_with`].
///
/// # Cancel safety
/// As [`run_with`].
pub async fn run<S, F>(stream: EventStream, sink: &S, shutdown: F) -> Result<RelayStats>
where
    S: Sink + ?Sized,
    F: Future<Output = ()>,
{
    run_with(stream, sink, &DeliveryOptions::default(), shutdown).await
}

/// Deliver every event of `stream` to `sink` until `shutdown` resolves or
/// the stream ends, then finish the stream (final acknowledgements). Each
/// event is encoded in `options`' format, and its delivery bounded by
/// `options`' timeout.
///
/// It sets the gauge `outbox_sink_guarantee{guarantee}` from
/// [`Sink::guarantee`] (1 for the sink's, 0 for the other).
///
/// An exactly-once sink ([`Guarantee::ExactlyOnce`]) needs each
/// aggregate's events handed out one at a time in id order, which the
/// stream checks first ([`crate::ConsumerBuilder::producers_lock_aggregates`]):
/// competing mode is refused, and so is an outbox whose per-aggregate order
/// rests on the producers' own lock (ordering mode `producer-locked`, or no
/// insert trigger) unless the producers are declared to keep that
/// contract.
///
/// The stream's [`EventStream::health`] then reports the sink's side too
/// ([`crate::health::Health::sink`]): the delivery in progress, failures since the
/// last success, the last error.
///
/// Pipelining: up to `options`' [`DeliveryOptions::max_in_flight`]
/// deliveries (or the sink's own [`Sink::max_in_flight`], if smaller) are
/// sent at once, at most one per aggregate id; the next of
/// an aggregate waits (parked, at most `max_in_flight` in all) until the
/// one before it completes. A failure fails that event and releases those
/// parked behind it (its aggregate is held back, as
/// [`crate::Delivery::fail`] says); other aggregates go on. Each delivery
/// carries the leadership term it was handed out under. Just before each
/// send, the relay checks that its hand-out lease still runs (renewing a
/// lapsed one first): a delivery whose lease cannot be renewed within a
/// lease (2 s) is released unsent, with those parked behind it, so a
/// deposed relay sends at most what was already on the wire, up to
/// `max_in_flight` events, each under its old term.
///
/// On shutdown it stops fetching and releases the parked deliveries; the
/// deliveries in flight get up to the consumer's shutdown grace, together,
/// to finish (then they are released: not published, delivered again by
/// the next relay); buffered deliveries are released; the final
/// acknowledgements are written before it returns.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) when an exactly-once sink meets
/// a stream that cannot keep its precondition (above; nothing is handed
/// out); [`Error::Sink`](crate::Error::Sink) when the sink reported a
/// [`FatalSinkError`]; otherwise the error that stopped the consumer, if any.
///
/// # Cancel safety
/// Not cancel safe, but it loses nothing: dropping the future drops the
/// stream, which stops the consumer (as [`crate::ShutdownHandle::shutdown`]
/// does), and the deliveries in flight unacknowledged: the sink may have
/// taken those events, which are then delivered again later (at-least-once);
/// buffered events stay unpublished for the next relay. For a clean stop,
/// resolve `shutdown` instead.
pub async fn run_with<S, F>(stream: EventStream, sink: &S, options: &DeliveryOptions, shutdown: F) -> Result<RelayStats>
where
    S: Sink + ?Sized,
    F: Future<Output = ()>,
{
    let subscription = stream.subscription();
    crate::metrics::for_subscription(subscription, run_labelled(stream, sink, options, shutdown)).await
}

/// [`run_with`], run with the stream's subscription label on the metrics
/// the relay and its sink record ([`crate::metrics::for_subscription`]).
async fn run_labelled<S, F>(
    mut stream: EventStream,
    sink: &S,
    options: &DeliveryOptions,
    shutdown: F,
) -> Result<RelayStats>
where
    S: Sink + ?Sized,
    F: Future<Output = ()>,
{
    if sink.guarantee() == Guarantee::ExactlyOnce
        && let Err(e) = stream.check_exactly_once()
    {
        if let Err(stop) = stream.finish().await {
            tracing::warn!(error = %crate::error::report(&stop), "stopping the consumer after the refusal");
        }
        return Err(e);
    }
    let monitor = stream.health();
    monitor.state().sink_attached();
    sink.guarantee().record();
    crate::metrics::counter!(m::SINK_REPEATS_REFUSED).increment(0);
    for proof in m::SINK_PROOFS {
        crate::metrics::counter!(m::SINK_ACKNOWLEDGED_UNSENT, "proof" => proof).increment(0);
    }
    tokio::pin!(shutdown);
    let max = options.max_in_flight.min(sink.max_in_flight().unwrap_or(usize::MAX));
    let mut pipe = Pipeline::new(max, stream.shutdown_grace(), stream.shutdown_handle(), monitor);
    let mut in_flight = FuturesUnordered::new();
    let send = |delivery: crate::consumer::Delivery, at: Instant| async move {
        if !delivery.lease_held().await {
            return (delivery, at, Err(Box::new(pipeline::LeaseLapsed) as crate::error::BoxError));
        }
        let result = sink::deliver(sink, options, delivery.event(), delivery.term()).await;
        (delivery, at, result)
    };
    let (mut shutdown_seen, mut stream_done) = (false, false);
    loop {
        // Done once nothing is in flight and nothing more will be taken
        // (parked deliveries wait only behind a send in flight).
        if (stream_done || pipe.fatal.is_some()) && in_flight.is_empty() {
            break;
        }
        let room = !stream_done && pipe.room(in_flight.len());
        let mut started = None;
        tokio::select! {
            biased;
            Some((delivery, at, result)) = in_flight.next(), if !in_flight.is_empty() => {
                started = pipe.settle(delivery, at, result);
            }
            _ = &mut shutdown, if !shutdown_seen => {
                shutdown_seen = true;
                pipe.shut_down(in_flight.len());
            }
            next = stream.next(), if room => match next {
                None => stream_done = true,
                Some(delivery) => started = pipe.admit(delivery),
            },
            _ = sleep_until(pipe.grace_until), if pipe.grace_until.is_some() && !in_flight.is_empty() => {
                pipe.give_up(in_flight.len());
                // Dropped unsettled, each delivery is released.
                in_flight.clear();
                pipe.report(0);
                break;
            }
        }
        if let Some(delivery) = started {
            let at = pipe.started(&delivery);
            in_flight.push(send(delivery, at));
        }
        pipe.report(in_flight.len());
    }
    stream.finish().await?;
    match pipe.fatal {
        Some(f) => Err(crate::error::Error::Sink(Box::new(f))),
        None => Ok(pipe.stats),
    }
}

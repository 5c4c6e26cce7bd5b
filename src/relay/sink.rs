//! What a sink is, and what the relay does around every send: encoding,
//! the timeout, the error's context.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::Serialize;

use super::{DEFAULT_CLOUDEVENTS_SOURCE, Format, Message};
use crate::error::BoxError;
use crate::event::Event;

/// Default time one delivery may take (`--sink-timeout`): 10 seconds.
pub const DEFAULT_SINK_TIMEOUT: Duration = Duration::from_secs(10);

/// What a sink promises about copies at the destination: whether an event
/// the relay delivers again (after a crash between the destination taking
/// it and the outbox recording it) can end up there twice.
///
/// The relay logs it at start and exports it as the gauge
/// `outbox_sink_guarantee{guarantee="exactly-once"|"at-least-once"}` = 1
/// ([`crate::metrics::SINK_GUARANTEE`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Guarantee {
    /// Every event reaches the destination at least once; one delivered
    /// again after a crash arrives again. Consumers deduplicate on the
    /// outbox id (header `id`). The default, and what every sink gives
    /// without `--exactly-once` ([`super::SinkSettings::exactly_once`]).
    #[default]
    AtLeastOnce,
    /// Every event reaches the destination exactly once: the destination
    /// refuses a repeat (an event at or below the last id it holds of the
    /// same aggregate), and the relay acknowledges the refused event
    /// without a second copy only when the sink read that very event back
    /// from the destination ([`Sent::Held`], counted in
    /// `outbox_sink_acknowledged_unsent_total{proof}`); one it cannot show
    /// the destination holds fails. What the NATS JetStream and Redis
    /// Streams sinks give with `--exactly-once`, under the conditions their
    /// docs state (a subject or key per aggregate, streams that keep each
    /// subject's last message).
    ExactlyOnce,
}

impl Guarantee {
    /// `at-least-once` or `exactly-once`: the gauge's label value and the
    /// word in logs.
    ///
    /// # Example
    /// ```
    /// use pg_outbox::relay::Guarantee;
    /// assert_eq!(Guarantee::default().as_str(), "at-least-once");
    /// assert_eq!(Guarantee::ExactlyOnce.to_string(), "exactly-once");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Guarantee::AtLeastOnce => "at-least-once",
            Guarantee::ExactlyOnce => "exactly-once",
        }
    }
}

impl Guarantee {
    /// Set the gauge `outbox_sink_guarantee{guarantee}`
    /// ([`crate::metrics::SINK_GUARANTEE`]): 1 for `self`, 0 for the other.
    /// [`super::run_with`] does it when it starts; a program that serves
    /// metrics before that may do it sooner.
    pub fn record(self) {
        for g in [Guarantee::AtLeastOnce, Guarantee::ExactlyOnce] {
            crate::metrics::gauge!(crate::metrics::SINK_GUARANTEE, "guarantee" => g.as_str()).set(if g == self {
                1.0
            } else {
                0.0
            });
        }
    }
}

impl std::fmt::Display for Guarantee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A boxed future returned by [`EventSink::deliver`]: `Ok(())` once the
/// destination has taken the event.
pub type SinkFuture<'a> = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>>;

/// A boxed future returned by [`Sink::send`]: how the destination came to
/// hold the event ([`Sent`]), or why it does not.
pub type SendFuture<'a> = Pin<Box<dyn Future<Output = Result<Sent, BoxError>> + Send + 'a>>;

/// How a destination came to hold an event that [`Sink::send`] settled
/// with `Ok`: the relay acknowledges it either way (it becomes published).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Sent {
    /// The sink sent it and the destination confirmed it (a flushed write,
    /// a 2xx response, a broker's acknowledgement).
    Delivered,
    /// The sink did not send it (or the destination dropped the send as a
    /// repeat): the destination already held this very event, which the
    /// sink read back ([`Proof`] says how). Only exactly-once sinks
    /// ([`Guarantee::ExactlyOnce`]) answer this; the relay counts it in
    /// `outbox_sink_acknowledged_unsent_total{proof}` and logs it at warn.
    Held(Proof),
}

/// How an exactly-once sink proved that the destination holds an event it
/// did not send ([`Sent::Held`]). Every proof is the event itself read back
/// from the broker: its own outbox id and `occurred_at` (and aggregate
/// type, where the broker keeps it). A greater id of the same aggregate is
/// never taken for proof: order can break upstream of the relay (a producer
/// that breaks the producer-locked contract, a trigger disabled while rows
/// change, another outbox writing the same keys), and a later event then
/// says nothing about an earlier one (docs/architecture.md, "Exactly once:
/// proof, never inference").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Proof {
    /// Redis Streams: the stream holds the event's own entry, `<id>-0`.
    Entry,
    /// NATS JetStream: the subject's last message is this event.
    LastMessage,
    /// NATS JetStream: a message on the subject names this event as the one
    /// stored just before it (headers `previous_id` and
    /// `previous_occurred_at`, written with an expected last subject
    /// sequence the stream checked), or the walk back along the subject's
    /// messages reached the event's own message.
    Chain,
    /// NATS JetStream: the stream dropped the send as a duplicate
    /// (`Nats-Msg-Id` within its duplicate window) and the message it
    /// stores under that id is this event.
    DuplicateWindow,
}

impl Proof {
    /// `entry`, `last-message`, `chain` or `duplicate-window`: the label
    /// value of `outbox_sink_acknowledged_unsent_total{proof}` and the word
    /// in logs.
    ///
    /// # Example
    /// ```
    /// use pg_outbox::relay::Proof;
    /// assert_eq!(Proof::Entry.as_str(), "entry");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Proof::Entry => "entry",
            Proof::LastMessage => "last-message",
            Proof::Chain => "chain",
            Proof::DuplicateWindow => "duplicate-window",
        }
    }

    /// Every proof kind, in the order of [`Proof::as_str`]'s list.
    pub const ALL: [Proof; 4] = [Proof::Entry, Proof::LastMessage, Proof::Chain, Proof::DuplicateWindow];
}

impl std::fmt::Display for Proof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the relay delivers events: the built-in sinks, and any sink of
/// your own.
///
/// The relay encodes each event once ([`Message`], in the format of its
/// [`DeliveryOptions`]), bounds the send by [`DeliveryOptions::timeout`],
/// prefixes an error with [`Sink::name`], and reports the outcome in the
/// stream's [`crate::health::Health`]; a sink only sends.
///
/// `send` returns `Ok` only once the destination has taken the event
/// (written and flushed, a 2xx response, a broker's confirmation:
/// [`Sent::Delivered`]) or, for an exactly-once sink, once it has read back
/// that the destination holds this very event ([`Sent::Held`]): the event
/// is then marked published. An `Err` fails the event (retry with backoff,
/// dead letter at the threshold); its text is stored in `last_error`. A
/// [`super::FatalSinkError`] stops the relay instead, the event released.
/// The relay drops a send that outlives the timeout (unless
/// [`Sink::bounded`] says not to): a sink must leave itself usable when its
/// future is dropped.
///
/// A sink that only needs the event can implement [`EventSink`] instead.
pub trait Sink: Send + Sync {
    /// The sink as logs, `/readyz`, error texts and the console show it,
    /// with no secret in it (see [`crate::secret::SecretUrl::shown`]), e.g.
    /// `NATS JetStream nats://127.0.0.1:4222`.
    fn name(&self) -> &str;

    /// Whether the relay may drop a send that outlives
    /// [`DeliveryOptions::timeout`] and fail the event (default `true`).
    /// A sink whose send, cut midway, would corrupt the destination (half
    /// a line in a byte stream, as the stdout sink writes) returns `false`:
    /// its sends run to their end, and the health probes report one stuck
    /// past the timeout.
    fn bounded(&self) -> bool {
        true
    }

    /// What the sink promises about copies at the destination (default
    /// [`Guarantee::AtLeastOnce`]). A sink that returns
    /// [`Guarantee::ExactlyOnce`] must make the destination refuse a repeat
    /// and return [`Sent::Held`] for it only when it has read this very
    /// event back from the destination, never because the destination
    /// holds a later one.
    fn guarantee(&self) -> Guarantee {
        Guarantee::AtLeastOnce
    }

    /// How many sends the sink takes at once, at most: `None` (the default)
    /// leaves it to the relay's [`DeliveryOptions::max_in_flight`]; a sink
    /// whose sends must not overlap returns `Some(1)` (the stdout sink, so
    /// its lines come out in id order), and one with a limit of its own
    /// returns it (RabbitMQ: the connection's `channel_max`, a channel per
    /// send). The relay keeps the smaller.
    fn max_in_flight(&self) -> Option<usize> {
        None
    }

    /// Send `message` (the encoded `event`) to the destination. The relay
    /// may call it again before the future resolves, for another
    /// aggregate's event (up to [`Sink::max_in_flight`]).
    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SendFuture<'a>;
}

/// A sink that delivers the event itself, with no use for the relay's
/// encoded [`Message`]: every `EventSink` is a [`Sink`] (the message is
/// built but not handed to it). The relay prefixes its errors with
/// [`EventSink::name`]; it does not cut its deliveries at the timeout
/// (the sink bounds its own I/O), unless [`EventSink::bounded`] says so.
pub trait EventSink: Send + Sync {
    /// The sink's name in logs and error texts, with no secret in it.
    /// Default: `custom sink`.
    fn name(&self) -> &str {
        "custom sink"
    }

    /// Whether the relay may drop a delivery that outlives its timeout, as
    /// [`Sink::bounded`]; default `false`.
    fn bounded(&self) -> bool {
        false
    }

    /// What the sink promises about copies, as [`Sink::guarantee`];
    /// default [`Guarantee::AtLeastOnce`]. An `EventSink` cannot answer
    /// [`Sent::Held`]: an exactly-once sink implements [`Sink`].
    fn guarantee(&self) -> Guarantee {
        Guarantee::AtLeastOnce
    }

    /// How many deliveries the sink takes at once, as [`Sink::max_in_flight`];
    /// default `Some(1)`: one at a time, as a sink written for a relay that
    /// delivered one event at a time expects. Return `None` (or more than
    /// 1) when `deliver` may run for several aggregates at once.
    fn max_in_flight(&self) -> Option<usize> {
        Some(1)
    }

    /// Deliver one event; the same contract as [`Sink::send`].
    fn deliver<'a>(&'a self, event: &'a Event) -> SinkFuture<'a>;
}

/// `future`'s outcome as a [`Sink::send`]'s: `Ok(())` is
/// [`Sent::Delivered`]. For the sinks that always send.
pub(crate) fn delivered(future: SinkFuture<'_>) -> SendFuture<'_> {
    Box::pin(async move { future.await.map(|()| Sent::Delivered) })
}

impl<T: EventSink + ?Sized> Sink for T {
    fn name(&self) -> &str {
        EventSink::name(self)
    }

    fn bounded(&self) -> bool {
        EventSink::bounded(self)
    }

    fn guarantee(&self) -> Guarantee {
        EventSink::guarantee(self)
    }

    fn max_in_flight(&self) -> Option<usize> {
        EventSink::max_in_flight(self)
    }

    fn send<'a>(&'a self, _message: &'a Message, event: &'a Event) -> SendFuture<'a> {
        delivered(self.deliver(event))
    }
}

/// How the relay hands every event to any sink: the message body's format,
/// the CloudEvents `source`, and how long one delivery may take. The same
/// for every sink (flags `--format`, `--cloudevents-source`,
/// `--sink-timeout`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeliveryOptions {
    /// Message body format (default [`Format::Record`]).
    pub format: Format,
    /// CloudEvents `source` attribute (default [`DEFAULT_CLOUDEVENTS_SOURCE`]).
    pub cloudevents_source: String,
    /// How long one delivery may take before it fails: the webhook request,
    /// the wait for a broker's acknowledgement, any [bounded](Sink::bounded)
    /// sink's send; the broker sinks also bound connecting by it (default
    /// [`DEFAULT_SINK_TIMEOUT`], 10 s).
    pub timeout: Duration,
    /// Deliveries the relay keeps in flight to the sink at once, at most
    /// one per aggregate (default [`DEFAULT_MAX_IN_FLIGHT`]; flag
    /// `--max-in-flight`; 0 counts as 1). Throughput into a sink whose
    /// answer takes a round trip grows with it, up to what the destination
    /// takes; 1 sends one event at a time.
    pub max_in_flight: usize,
}

/// Default of [`DeliveryOptions::max_in_flight`]: 64 deliveries.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;

impl Default for DeliveryOptions {
    fn default() -> Self {
        DeliveryOptions {
            format: Format::Record,
            cloudevents_source: DEFAULT_CLOUDEVENTS_SOURCE.to_string(),
            timeout: DEFAULT_SINK_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }
}

/// One delivery as the relay makes it: encode `event` (delivered under
/// leadership term `term`, if any), send it to `sink`
/// within the timeout (when the sink is [bounded](Sink::bounded)), and
/// name the sink in an error (a [`super::FatalSinkError`] passes through
/// as it is).
pub(crate) async fn deliver<S: Sink + ?Sized>(
    sink: &S,
    options: &DeliveryOptions,
    event: &Event,
    term: Option<crate::term::Term>,
) -> Result<Sent, BoxError> {
    let name = sink.name();
    let message = Message::with_term(event, term, options.format, &options.cloudevents_source)
        .map_err(|e| format!("{name}: cannot encode event {}: {}", event.id, crate::error::report(&e)))?;
    let send = sink.send(&message, event);
    let sent = if sink.bounded() { tokio::time::timeout(options.timeout, send).await } else { Ok(send.await) };
    match sent {
        Ok(Ok(Sent::Held(proof))) => {
            crate::metrics::counter!(crate::metrics::SINK_ACKNOWLEDGED_UNSENT, "proof" => proof.as_str()).increment(1);
            crate::metrics::counter!(crate::metrics::SINK_REPEATS_REFUSED).increment(1);
            Ok(Sent::Held(proof))
        }
        Ok(Ok(sent)) => Ok(sent),
        Ok(Err(e)) if e.is::<super::FatalSinkError>() => Err(e),
        Ok(Err(e)) => Err(format!("{name}: {}", crate::error::report(e.as_ref())).into()),
        Err(_) => Err(format!("{name}: timed out: no answer within {:?} (--sink-timeout)", options.timeout).into()),
    }
}

/// The JSON record of an event as sinks write it: keys `id`,
/// `aggregate_type`, `aggregate_id`, `event_type`, `payload`, `occurred_at`
/// (RFC 3339) and `retry_count`, and `term` when the relay delivered it
/// under a leadership term ([`crate::Delivery::term`]).
#[derive(Debug, Serialize)]
pub struct SinkRecord<'a> {
    /// Outbox id.
    pub id: i64,
    /// Kind of aggregate.
    pub aggregate_type: &'a str,
    /// Aggregate id.
    pub aggregate_id: uuid::Uuid,
    /// Event name.
    pub event_type: &'a str,
    /// The payload as stored.
    pub payload: &'a serde_json::Value,
    /// RFC 3339 time the producer inserted the event.
    pub occurred_at: String,
    /// Failed attempts before this one.
    pub retry_count: i32,
    /// The leadership term it was delivered under; `None` (and no key)
    /// when the relay holds none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub term: Option<crate::term::Term>,
}

impl<'a> SinkRecord<'a> {
    /// The record of `event`.
    pub fn new(event: &'a Event) -> Self {
        SinkRecord {
            id: event.id,
            aggregate_type: &event.aggregate_type,
            aggregate_id: event.aggregate_id,
            event_type: &event.event_type,
            payload: &event.payload,
            occurred_at: event.occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            retry_count: event.retry_count,
            term: None,
        }
    }
}

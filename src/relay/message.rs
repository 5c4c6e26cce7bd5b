//! What every sink sends: the message body (our JSON record or a CloudEvent),
//! its headers, its key, and names rendered from templates.

use serde::Serialize;

use super::SinkRecord;
use super::sink_list::dead_unless;
use crate::error::{Error, Result};
use crate::event::Event;

/// How an event is written as a message body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Format {
    /// The [`SinkRecord`] JSON object (`id`, `aggregate_type`, `aggregate_id`,
    /// `event_type`, `payload`, `occurred_at`, `retry_count`), content type
    /// `application/json`. The default.
    #[default]
    Record,
    /// A CloudEvents 1.0 event in structured JSON mode, content type
    /// `application/cloudevents+json` (CloudEvents spec, "JSON Event
    /// Format"): `id` = outbox id, `type` = event_type, `subject` =
    /// aggregate_id, `time` = occurred_at, `data` = the payload, and the
    /// extensions `aggregatetype`, `partitionkey` (= aggregate_id, the
    /// Partitioning extension), `correlationid`, `causationid`,
    /// `traceparent` and `tracestate` (the Distributed Tracing extension)
    /// when the envelope's metadata has them.
    Cloudevents,
}

impl std::str::FromStr for Format {
    type Err = Error;
    /// `record` or `cloudevents`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "record" => Ok(Format::Record),
            "cloudevents" => Ok(Format::Cloudevents),
            other => Err(Error::Config(format!("unknown format '{other}': use `record` or `cloudevents`"))),
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Record => "record",
            Format::Cloudevents => "cloudevents",
        })
    }
}

/// Default CloudEvents `source` attribute: `/pg-outbox`.
pub const DEFAULT_CLOUDEVENTS_SOURCE: &str = "/pg-outbox";

/// Header names every sink that has headers sets (lowercase, as HTTP/2,
/// NATS and Kafka clients expect). Values are UTF-8 text.
pub mod header {
    /// The outbox id (decimal): deduplicate on it.
    pub const ID: &str = "id";
    /// The leadership term the relay delivered under (decimal;
    /// [`crate::Delivery::term`]): a destination may refuse a message whose
    /// term is lower than one it has already seen for the aggregate (it
    /// comes from a deposed relay). Absent when the relay holds no term
    /// (competing mode, a standby, `replay`); in partitioned mode it is the
    /// term of the event's partition. The webhook sends it as
    /// `outbox-term`.
    pub const TERM: &str = "term";
    /// The event name.
    pub const EVENT_TYPE: &str = "event_type";
    /// The kind of aggregate.
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    /// The aggregate id (UUID).
    pub const AGGREGATE_ID: &str = "aggregate_id";
    /// When the producer inserted the event (RFC 3339).
    pub const OCCURRED_AT: &str = "occurred_at";
    /// `payload.metadata.correlation_id`, when present.
    pub const CORRELATION_ID: &str = "correlation_id";
    /// `payload.metadata.causation_id`, when present.
    pub const CAUSATION_ID: &str = "causation_id";
    /// `payload.metadata.traceparent` (W3C Trace Context), when present.
    pub const TRACEPARENT: &str = "traceparent";
    /// `payload.metadata.tracestate` (W3C Trace Context), when present.
    pub const TRACESTATE: &str = "tracestate";
    /// The body's content type.
    pub const CONTENT_TYPE: &str = "content-type";
}

/// One event as a broker message: body, content type, key and headers.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The outbox id as text: the message id on brokers that have one
    /// (`Nats-Msg-Id`, AMQP `message_id`, `webhook-id`).
    pub id: String,
    /// The partition/ordering key: the aggregate id, so one aggregate stays
    /// in one partition (as Debezium's outbox event router keys messages).
    pub key: String,
    /// The JSON body.
    pub body: Vec<u8>,
    /// `application/json` or `application/cloudevents+json`.
    pub content_type: &'static str,
    /// `(name, value)` pairs from [`header`], in a fixed order; metadata
    /// headers only when the envelope carries them.
    pub headers: Vec<(&'static str, String)>,
}

#[derive(Serialize)]
struct CloudEvent<'a> {
    specversion: &'static str,
    id: String,
    source: &'a str,
    #[serde(rename = "type")]
    ty: &'a str,
    subject: String,
    time: String,
    datacontenttype: &'static str,
    data: &'a serde_json::Value,
    aggregatetype: &'a str,
    partitionkey: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    outboxterm: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    correlationid: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    causationid: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tracestate: Option<&'a str>,
}

/// A text field of `payload.metadata`, if the payload has the standard
/// envelope shape ([`crate::Envelope`]) and the field is a string.
fn metadata_field<'a>(event: &'a Event, key: &str) -> Option<&'a str> {
    event.payload.get("metadata")?.get(key)?.as_str()
}

impl Message {
    /// The message for `event` in `format`; `source` is the CloudEvents
    /// `source` attribute (unused for [`Format::Record`]). No term: see
    /// [`Message::with_term`].
    ///
    /// # Errors
    /// [`Error::Json`] if the body cannot be serialised (not expected for a
    /// payload read from jsonb).
    pub fn new(event: &Event, format: Format, source: &str) -> Result<Self> {
        Self::with_term(event, None, format, source)
    }

    /// The message for `event` delivered under leadership term `term`
    /// ([`crate::Delivery::term`]): as [`Message::new`], with header
    /// [`header::TERM`] after the id, key `term` in the record body, and
    /// the CloudEvents extension attribute `outboxterm` (a string, as
    /// CloudEvents 1.0 extension values are), when `term` is given.
    ///
    /// # Errors
    /// As [`Message::new`].
    pub fn with_term(event: &Event, term: Option<crate::term::Term>, format: Format, source: &str) -> Result<Self> {
        let occurred_at = event.occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let correlation = metadata_field(event, "correlation_id");
        let causation = metadata_field(event, "causation_id");
        let traceparent = metadata_field(event, "traceparent");
        let tracestate = metadata_field(event, "tracestate");
        let (body, content_type) = match format {
            Format::Record => (serde_json::to_vec(&SinkRecord { term, ..SinkRecord::new(event) })?, "application/json"),
            Format::Cloudevents => {
                let ce = CloudEvent {
                    specversion: "1.0",
                    id: event.id.to_string(),
                    source,
                    ty: &event.event_type,
                    subject: event.aggregate_id.to_string(),
                    time: occurred_at.clone(),
                    datacontenttype: "application/json",
                    data: &event.payload,
                    aggregatetype: &event.aggregate_type,
                    partitionkey: event.aggregate_id.to_string(),
                    outboxterm: term.map(|t| t.to_string()),
                    correlationid: correlation,
                    causationid: causation,
                    traceparent,
                    tracestate,
                };
                (serde_json::to_vec(&ce)?, "application/cloudevents+json")
            }
        };
        let mut headers = vec![(header::ID, event.id.to_string())];
        headers.extend(term.map(|t| (header::TERM, t.to_string())));
        headers.extend([
            (header::EVENT_TYPE, event.event_type.clone()),
            (header::AGGREGATE_TYPE, event.aggregate_type.clone()),
            (header::AGGREGATE_ID, event.aggregate_id.to_string()),
            (header::OCCURRED_AT, occurred_at),
            (header::CONTENT_TYPE, content_type.to_string()),
        ]);
        for (name, value) in [
            (header::CORRELATION_ID, correlation),
            (header::CAUSATION_ID, causation),
            (header::TRACEPARENT, traceparent),
            (header::TRACESTATE, tracestate),
        ] {
            if let Some(v) = value {
                headers.push((name, v.to_string()));
            }
        }
        Ok(Message { id: event.id.to_string(), key: event.aggregate_id.to_string(), body, content_type, headers })
    }
}

/// A name built from an event: a subject, topic, stream key or routing key.
///
/// Placeholders `{aggregate_type}`, `{event_type}` and `{aggregate_id}` are
/// replaced by the event's values; `{{` and `}}` are literal braces.
///
/// # Example
/// ```
/// use pg_outbox::relay::Template;
/// let t = Template::parse("events.{aggregate_type}.{event_type}").unwrap();
/// assert_eq!(t.as_str(), "events.{aggregate_type}.{event_type}");
/// assert!(Template::parse("events.{tenant}").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    text: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Lit(String),
    AggregateType,
    EventType,
    AggregateId,
}

impl Template {
    dead_unless!(broker;
        /// A template written into pg-outbox itself (a default), known to parse.
        pub(crate) fn builtin(text: &str) -> Self {
            Template::parse(text).unwrap_or_else(|e| unreachable!("built-in template {text} does not parse: {e}"))
        }
    );

    /// Parse a template.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown placeholder, an unclosed `{`, a stray
    /// `}`, or an empty template.
    pub fn parse(text: &str) -> Result<Self> {
        if text.is_empty() {
            return Err(Error::Config("empty name template".into()));
        }
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    lit.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    lit.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => name.push(c),
                            None => {
                                return Err(Error::Config(format!("template '{text}': `{{` without a closing `}}`")));
                            }
                        }
                    }
                    let part = match name.as_str() {
                        "aggregate_type" => Part::AggregateType,
                        "event_type" => Part::EventType,
                        "aggregate_id" => Part::AggregateId,
                        other => {
                            return Err(Error::Config(format!(
                                "template '{text}': unknown placeholder {{{other}}}; use {{aggregate_type}}, {{event_type}} or {{aggregate_id}}"
                            )));
                        }
                    };
                    if !lit.is_empty() {
                        parts.push(Part::Lit(std::mem::take(&mut lit)));
                    }
                    parts.push(part);
                }
                '}' => return Err(Error::Config(format!("template '{text}': `}}` without an opening `{{`"))),
                c => lit.push(c),
            }
        }
        if !lit.is_empty() {
            parts.push(Part::Lit(lit));
        }
        Ok(Template { text: text.to_string(), parts })
    }

    /// Whether the template holds `{aggregate_id}`, so each name it
    /// renders receives the events of aggregates with one id only (what
    /// exactly-once delivery needs: [`super::SinkSettings::exactly_once`]).
    ///
    /// # Example
    /// ```
    /// use pg_outbox::relay::Template;
    /// assert!(Template::parse("events.{aggregate_type}.{aggregate_id}").unwrap().has_aggregate_id());
    /// assert!(!Template::parse("events.{aggregate_type}").unwrap().has_aggregate_id());
    /// ```
    pub fn has_aggregate_id(&self) -> bool {
        self.parts.contains(&Part::AggregateId)
    }

    /// Whether the template holds `{aggregate_type}`.
    pub fn has_aggregate_type(&self) -> bool {
        self.parts.contains(&Part::AggregateType)
    }

    /// The template rendered with `wildcard` for each placeholder: a NATS
    /// subject filter (`*`) that matches every name the template renders
    /// when each placeholder fills a whole `.`-separated token. A token that
    /// mixes a placeholder with text becomes the wildcard whole, so the
    /// filter still matches (it may match more).
    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    pub(crate) fn token_wildcards(&self, wildcard: &str) -> String {
        let mut out = String::with_capacity(self.text.len());
        for p in &self.parts {
            match p {
                Part::Lit(s) => out.push_str(s),
                Part::AggregateType | Part::EventType | Part::AggregateId => out.push('\u{0}'),
            }
        }
        out.split('.')
            .map(|token| if token.contains('\u{0}') { wildcard.to_string() } else { token.to_string() })
            .collect::<Vec<_>>()
            .join(".")
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The name for `event`.
    pub fn render(&self, event: &Event) -> String {
        let mut out = String::with_capacity(self.text.len() + 32);
        for p in &self.parts {
            match p {
                Part::Lit(s) => out.push_str(s),
                Part::AggregateType => out.push_str(&event.aggregate_type),
                Part::EventType => out.push_str(&event.event_type),
                Part::AggregateId => out.push_str(&event.aggregate_id.to_string()),
            }
        }
        out
    }
}

impl std::str::FromStr for Template {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Template::parse(s)
    }
}

impl std::fmt::Display for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(payload: serde_json::Value) -> Event {
        Event {
            id: 42,
            aggregate_type: "subscription".into(),
            aggregate_id: uuid::Uuid::nil(),
            event_type: "PaymentSucceeded".into(),
            payload,
            occurred_at: chrono::DateTime::from_timestamp(0, 0).unwrap_or_default(),
            retry_count: 0,
            last_error: None,
        }
    }

    #[test]
    fn templates_render_and_reject_unknown_placeholders() {
        let e = event(serde_json::json!({}));
        let t = Template::parse("events.{aggregate_type}.{event_type}").expect("parses");
        assert_eq!(t.render(&e), "events.subscription.PaymentSucceeded");
        let t = Template::parse("a{{b}}-{aggregate_id}").expect("parses");
        assert_eq!(t.render(&e), "a{b}-00000000-0000-0000-0000-000000000000");
        for bad in ["", "x.{tenant}", "x.{aggregate_type", "x}"] {
            assert!(Template::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn placeholders_are_seen_and_become_whole_token_wildcards() {
        let t = Template::parse("events.{aggregate_type}.{aggregate_id}").expect("parses");
        assert!(t.has_aggregate_id() && t.has_aggregate_type());
        assert_eq!(t.token_wildcards("*"), "events.*.*");
        let t = Template::parse("ev.agg-{aggregate_id}.x").expect("parses");
        assert_eq!(t.token_wildcards("*"), "ev.*.x");
        let t = Template::parse("events.{aggregate_type}.{event_type}").expect("parses");
        assert!(!t.has_aggregate_id());
        assert_eq!(t.token_wildcards("*"), "events.*.*");
        assert_eq!(Template::parse("plain").expect("parses").token_wildcards("*"), "plain");
    }

    #[test]
    fn messages_carry_metadata_headers_and_cloudevents_attributes() {
        let e = event(serde_json::json!({"version": 1, "data": {"n": 1},
            "metadata": {"correlation_id": "c-1", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}));
        let m = Message::new(&e, Format::Record, DEFAULT_CLOUDEVENTS_SOURCE).expect("message");
        assert_eq!(m.id, "42");
        assert_eq!(m.content_type, "application/json");
        let get = |n: &str| m.headers.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
        assert_eq!(get(header::CORRELATION_ID), Some("c-1"));
        assert_eq!(get(header::CAUSATION_ID), None);
        assert!(get(header::TRACEPARENT).is_some_and(|t| t.starts_with("00-0af7")));
        let body: serde_json::Value = serde_json::from_slice(&m.body).expect("json");
        assert_eq!(body["id"], 42);

        let m = Message::new(&e, Format::Cloudevents, "/orders").expect("message");
        let ce: serde_json::Value = serde_json::from_slice(&m.body).expect("json");
        assert_eq!(ce["specversion"], "1.0");
        assert_eq!(ce["id"], "42");
        assert_eq!(ce["type"], "PaymentSucceeded");
        assert_eq!(ce["source"], "/orders");
        assert_eq!(ce["data"]["data"]["n"], 1);
        assert_eq!(ce["correlationid"], "c-1");
        assert!(ce.get("causationid").is_none());
        assert!(ce.get("outboxterm").is_none(), "no term, no attribute");
        assert_eq!(m.content_type, "application/cloudevents+json");
    }

    #[test]
    fn a_term_travels_next_to_the_id_in_headers_record_and_cloudevents() {
        let e = event(serde_json::json!({"n": 1}));
        let m = Message::with_term(&e, crate::term::Term::new(7), Format::Record, DEFAULT_CLOUDEVENTS_SOURCE)
            .expect("message");
        assert_eq!(m.headers[0], (header::ID, "42".to_string()));
        assert_eq!(m.headers[1], (header::TERM, "7".to_string()));
        let record: serde_json::Value = serde_json::from_slice(&m.body).expect("json");
        assert_eq!(record["term"], 7);
        let m = Message::with_term(&e, crate::term::Term::new(7), Format::Cloudevents, "/orders").expect("message");
        let ce: serde_json::Value = serde_json::from_slice(&m.body).expect("json");
        assert_eq!(ce["outboxterm"], "7");
        let plain = Message::new(&e, Format::Record, DEFAULT_CLOUDEVENTS_SOURCE).expect("message");
        assert!(plain.headers.iter().all(|(k, _)| *k != header::TERM));
        let record: serde_json::Value = serde_json::from_slice(&plain.body).expect("json");
        assert!(record.get("term").is_none(), "{record}");
    }
}

//! Events: what producers publish and what consumers receive.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};

/// The payload's standard shape (docs/schema.md, "Event envelope"):
/// `{"version": 1, "data": {...}, "metadata": {"causation_id": ..., "correlation_id": ...}}`.
///
/// `metadata` is optional and left out of the JSON when `None`.
///
/// # Example
/// ```
/// use pg_outbox::{Envelope, Metadata};
/// let env = Envelope::new(1, serde_json::json!({"amount": 990}))
///     .with_metadata(Metadata::new().correlation_id("req-42"));
/// let v = serde_json::to_value(&env).unwrap();
/// assert_eq!(v["metadata"]["correlation_id"], "req-42");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// Payload schema version, for evolution.
    pub version: u32,
    /// The event's data.
    pub data: T,
    /// Tracing metadata, optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Metadata>,
}

impl<T> Envelope<T> {
    /// An envelope with the given schema version and data, without metadata.
    pub fn new(version: u32, data: T) -> Self {
        Envelope { version, data, metadata: None }
    }

    /// Attach tracing metadata.
    pub fn with_metadata(mut self, metadata: Metadata) -> Self {
        self.metadata = Some(metadata);
        self
    }
}

/// Tracing metadata of an [`Envelope`]. Fields that are `None` are left out of
/// the JSON; other keys (for example a W3C `traceparent`) are kept in `extra`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Id of the event or command that caused this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<String>,
    /// Id of the workflow or request this event belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// Any further metadata keys.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Metadata {
    /// Empty metadata.
    pub fn new() -> Self {
        Self::default()
    }
    /// Set `causation_id`.
    pub fn causation_id(mut self, id: impl Into<String>) -> Self {
        self.causation_id = Some(id.into());
        self
    }
    /// Set `correlation_id`.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }
}

/// An event to publish: one row of `events.outbox` as a producer writes it
/// (the four columns `(aggregate_type, aggregate_id, event_type, payload)`;
/// the database fills in the others, docs/schema.md).
///
/// # Example
/// ```
/// use pg_outbox::{Envelope, NewEvent};
/// let id = uuid::Uuid::new_v4();
/// let raw = NewEvent::new("subscription", id, "PaymentSucceeded", serde_json::json!({"amount": 990}));
/// let typed = NewEvent::with_envelope("subscription", id, "PaymentSucceeded",
///     &Envelope::new(1, serde_json::json!({"amount": 990}))).unwrap();
/// assert_eq!(typed.payload["version"], 1);
/// # let _ = raw;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// Kind of aggregate, e.g. `subscription`.
    pub aggregate_type: String,
    /// Id of the aggregate instance (a soft reference to a domain row).
    pub aggregate_id: Uuid,
    /// Event name, e.g. `PaymentSucceeded`.
    pub event_type: String,
    /// The JSON payload (stored as jsonb).
    pub payload: serde_json::Value,
}

impl NewEvent {
    /// An event with a raw JSON payload.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: Uuid,
        event_type: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        NewEvent { aggregate_type: aggregate_type.into(), aggregate_id, event_type: event_type.into(), payload }
    }

    /// An event whose payload is the standard [`Envelope`] around `data`.
    ///
    /// # Errors
    /// [`Error::Json`] if `data` cannot be serialised to JSON.
    pub fn with_envelope<T: Serialize>(
        aggregate_type: impl Into<String>,
        aggregate_id: Uuid,
        event_type: impl Into<String>,
        envelope: &Envelope<T>,
    ) -> Result<Self> {
        Ok(Self::new(aggregate_type, aggregate_id, event_type, serde_json::to_value(envelope)?))
    }

    /// Check the event before any SQL is sent.
    ///
    /// # Errors
    /// [`Error::InvalidEvent`] when `aggregate_type` or `event_type` is empty
    /// or blank, holds a control character, or a NUL character (PostgreSQL
    /// text cannot store byte 0), when
    /// the payload holds `\u0000` anywhere (jsonb rejects it, PostgreSQL docs
    /// "JSON Types"), or when its JSON text is longer than `max_payload_bytes`.
    pub fn validate(&self, max_payload_bytes: usize) -> Result<()> {
        for (name, v) in [("aggregate_type", &self.aggregate_type), ("event_type", &self.event_type)] {
            if v.trim().is_empty() {
                return Err(Error::InvalidEvent(format!("{name} is empty")));
            }
            if v.contains('\0') {
                return Err(Error::InvalidEvent(format!("{name} contains a NUL character (\\u0000)")));
            }
            if v.chars().any(char::is_control) {
                return Err(Error::InvalidEvent(format!("{name} contains a control character")));
            }
        }
        if let Some(path) = find_nul(&self.payload, "$") {
            return Err(Error::InvalidEvent(format!(
                "payload contains \\u0000 at {path}, which PostgreSQL jsonb cannot store"
            )));
        }
        let len = serde_json::to_vec(&self.payload)?.len();
        if len > max_payload_bytes {
            return Err(Error::InvalidEvent(format!(
                "payload is {len} bytes, over the limit of {max_payload_bytes} bytes"
            )));
        }
        Ok(())
    }
}

fn find_nul(v: &serde_json::Value, path: &str) -> Option<String> {
    match v {
        serde_json::Value::String(s) if s.contains('\0') => Some(path.to_string()),
        serde_json::Value::Array(a) => a.iter().enumerate().find_map(|(i, x)| find_nul(x, &format!("{path}[{i}]"))),
        serde_json::Value::Object(m) => m.iter().find_map(|(k, x)| {
            if k.contains('\0') { Some(format!("{path} (a key)")) } else { find_nul(x, &format!("{path}.{k}")) }
        }),
        _ => None,
    }
}

/// An event as stored in `events.outbox` and handed to consumers and sinks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The outbox id (BIGSERIAL): the processing order, and the message id
    /// consumers can deduplicate on.
    pub id: i64,
    /// Kind of aggregate.
    pub aggregate_type: String,
    /// Id of the aggregate instance.
    pub aggregate_id: Uuid,
    /// Event name.
    pub event_type: String,
    /// The JSON payload.
    pub payload: serde_json::Value,
    /// When the producer's transaction inserted the row (its `now()`).
    pub occurred_at: DateTime<Utc>,
    /// How many times delivery failed before this attempt (0 on the first).
    pub retry_count: i32,
    /// The error of the last failed attempt, if any.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub last_error: Option<String>,
}

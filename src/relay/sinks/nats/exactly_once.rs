//! The NATS sink's exactly-once send: each subject's last message read
//! back and chained by expected sequence, the proofs that an event is
//! already held, and the checks that the streams keep what those proofs
//! read.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};

use async_nats::HeaderMap;
use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::stream::{DiscardPolicy, LastRawMessageErrorKind, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, context::PublishErrorKind};
use chrono::{DateTime, Utc};

use super::{NatsSink, publish_error};
use crate::error::{BoxError, Error, Result};
use crate::event::Event;
use crate::relay::sinks::{Recheck, held, parse_occurred_at};
use crate::relay::{Message, Proof, Sent, Template, header};

/// Subjects whose last message the exactly-once sink remembers at most;
/// past it one is forgotten (and read back again before its next send).
const REMEMBERED_SUBJECTS: usize = 100_000;

/// What a subject last held, as the exactly-once sink knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Last {
    /// Outbox id of the subject's last message; `None`: the subject is empty.
    id: Option<i64>,
    /// Its aggregate type (header `aggregate_type`), when it has one.
    aggregate_type: Option<String>,
    /// When its event occurred (header `occurred_at`), when it has one.
    occurred_at: Option<DateTime<Utc>>,
    /// Its stream sequence; 0 for an empty subject.
    sequence: u64,
}

/// The exactly-once sink's memory: each subject's last message, and which
/// stream captures each subject (streams checked once each).
#[derive(Debug)]
pub(super) struct ExactlyOnce {
    last: Mutex<HashMap<String, Last>>,
    /// Stream names whose configuration was checked and found to keep each
    /// subject's last message.
    checked: Mutex<HashSet<String>>,
    /// The stream that captures each subject (bounded as `last`).
    stream_of: Mutex<HashMap<String, String>>,
    /// When the streams and the server version are checked again.
    recheck: Recheck,
}

impl ExactlyOnce {
    /// Nothing remembered yet; streams and server checked again every
    /// `broker_check_interval` (`None`: the default, 60 seconds).
    pub(super) fn new(broker_check_interval: Option<std::time::Duration>) -> Self {
        ExactlyOnce {
            last: Mutex::default(),
            checked: Mutex::default(),
            stream_of: Mutex::default(),
            recheck: Recheck::new(broker_check_interval),
        }
    }

    /// Forget what `subject` last held: it is read back before its next send.
    fn forget(&self, subject: &str) {
        self.last.lock().unwrap_or_else(PoisonError::into_inner).remove(subject);
    }
}

impl Last {
    /// Chain a message to this one: `Nats-Expected-Last-Subject-Sequence`
    /// (the stream refuses the message if the subject moved on), and
    /// [`PREVIOUS_ID`] and [`PREVIOUS_OCCURRED_AT`] naming this event.
    fn chain(&self, headers: &mut HeaderMap) {
        headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, self.sequence.to_string().as_str());
        if let Some(id) = self.id {
            headers.insert(PREVIOUS_ID, id.to_string().as_str());
            if let Some(at) = self.occurred_at {
                headers.insert(PREVIOUS_OCCURRED_AT, at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true).as_str());
            }
        }
    }
}

/// Header of an exactly-once message: the outbox id of the message the
/// subject held just before it (absent on a subject's first message). The
/// stream stored the message only because that one was still the
/// subject's last ([`NATS_EXPECTED_LAST_SUBJECT_SEQUENCE`], also stored
/// with the message), so it proves that event stored even after the
/// stream's limits removed it.
const PREVIOUS_ID: &str = "previous_id";
/// Header of an exactly-once message: the `occurred_at` (RFC 3339) of the
/// event named by [`PREVIOUS_ID`].
const PREVIOUS_OCCURRED_AT: &str = "previous_occurred_at";
/// Messages of one subject that the walk back from its last message reads
/// at most, looking for an event it may hold.
const MAX_WALK: usize = 1000;

/// Why nats-server `version` cannot be trusted with a file-stored stream's
/// per-subject lookups, which exactly-once rests on (the last message of a
/// subject and `Nats-Expected-Last-Subject-Sequence`); `None` when it can.
/// Releases 2.12.7 and later of the 2.12 line can lose a subject's place
/// after a restart (the per-subject first-block pointer, nats-server PRs
/// 8254 and 8285), so the subject's last message is not found and an
/// expected sequence of 0 is accepted: a repeat is stored again. 2.14
/// stores both pointers. Versions it cannot read are let through.
fn server_breaks_lookups(version: &str) -> Option<String> {
    let mut parts = version.trim().trim_start_matches('v').split(['.', '-', '+']);
    let mut next = || parts.next().and_then(|p| p.parse::<u64>().ok());
    let (major, minor, patch) = (next()?, next()?, next().unwrap_or(0));
    (major == 2 && minor == 12 && patch >= 7).then(|| {
        format!(
            "nats-server {version} can lose a subject's last message after a restart on file storage \
             (nats-server PRs 8254 and 8285), and a repeat would be stored again; upgrade to nats-server 2.14 or \
             later, or use memory storage"
        )
    })
}

/// Insert into a map bounded at [`REMEMBERED_SUBJECTS`] entries.
fn remember<V>(map: &Mutex<HashMap<String, V>>, key: &str, value: V) {
    let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
    if map.len() >= REMEMBERED_SUBJECTS && !map.contains_key(key) {
        let victim = map.keys().next().cloned();
        if let Some(v) = victim {
            map.remove(&v);
        }
    }
    map.insert(key.to_string(), value);
}

/// Why a stream's configuration cannot keep each subject's last message
/// (what exactly-once delivery reads back), naming the setting to change;
/// `None` when it keeps it.
fn stream_loses_last(config: &jetstream::stream::Config) -> Option<String> {
    if config.retention != RetentionPolicy::Limits {
        return Some(format!(
            "its retention is {:?}, which removes messages once consumed; use retention limits",
            config.retention
        ));
    }
    if !config.max_age.is_zero() {
        return Some(format!("max_age is {:?}, which removes a subject's last message; set max_age 0", config.max_age));
    }
    if config.max_messages > 0 {
        return Some(format!(
            "max_msgs is {}, which can remove a subject's last message; set max_msgs -1 (unlimited) \
             and bound it with max_msgs_per_subject instead (at least twice --batch-size proves every repeat)",
            config.max_messages
        ));
    }
    if config.max_bytes > 0 {
        return Some(format!(
            "max_bytes is {}, which can remove a subject's last message; set max_bytes -1 (unlimited) \
             and bound it with max_msgs_per_subject instead (at least twice --batch-size proves every repeat)",
            config.max_bytes
        ));
    }
    if config.discard == DiscardPolicy::New && config.discard_new_per_subject && config.max_messages_per_subject > 0 {
        return Some(format!(
            "discard new per subject with max_msgs_per_subject {} refuses a subject's later events; \
             use discard old",
            config.max_messages_per_subject
        ));
    }
    None
}

impl NatsSink {
    /// Refuse a subject template that exactly-once cannot keep (see
    /// [`NatsSink`]): one without `{aggregate_id}`.
    pub(super) fn check_template(template: &Template) -> Result<()> {
        if !template.has_aggregate_id() {
            return Err(Error::Config(format!(
                "--exactly-once needs a NATS subject per aggregate: --nats-subject '{template}' lacks {{aggregate_id}} \
                 (a retry of one aggregate's event would reach the subject after later events of other aggregates, \
                 and be refused as a repeat), e.g. 'events.{{aggregate_type}}.{{aggregate_id}}'"
            )));
        }
        Ok(())
    }

    /// Check again, while delivering, what [`Self::check_streams`] checked
    /// at start (every [`SinkSettings::broker_check_interval`]): a stream
    /// whose limits changed, or a server version that breaks exactly-once,
    /// stops the relay.
    async fn recheck(&self, state: &ExactlyOnce) -> std::result::Result<(), BoxError> {
        state.checked.lock().unwrap_or_else(PoisonError::into_inner).clear();
        match self.check_streams(false).await {
            Ok(()) => Ok(()),
            Err(Error::Config(why)) => Err(Recheck::failed("nats", why)),
            // Unreachable now: the send meets the same trouble.
            Err(e) => {
                tracing::warn!(sink = %self.name, "{e}");
                Ok(())
            }
        }
    }

    /// Check the streams that capture the subject template's subjects: at
    /// least one, each keeping every subject's last message, on a server
    /// whose per-subject lookups hold; at start (`log`), also log what a
    /// PubAck means on disk for each.
    pub(super) async fn check_streams(&self, log: bool) -> Result<()> {
        let filter = self.subject.token_wildcards("*");
        let names = self.stream_names(&filter).await?;
        if names.is_empty() {
            return Err(Error::Config(format!(
                "--exactly-once: no JetStream stream captures the subjects of --nats-subject '{}' ({filter}); \
                 create one, e.g. `nats stream add OUTBOX --subjects '{filter}' --retention limits`",
                self.subject
            )));
        }
        for name in names {
            self.check_stream(&name, log).await?;
        }
        Ok(())
    }

    /// Names of the streams whose subjects overlap `filter`.
    async fn stream_names(&self, filter: &str) -> Result<Vec<String>> {
        let mut names = Vec::new();
        loop {
            let page: serde_json::Value = self
                .js
                .request("STREAM.NAMES", &serde_json::json!({ "offset": names.len(), "subject": filter }))
                .await
                .map_err(|e| Error::SinkUnavailable(format!("NATS: cannot list the JetStream streams: {e}")))?;
            if let Some(e) = page.get("error") {
                return Err(Error::SinkUnavailable(format!("NATS: cannot list the JetStream streams: {e}")));
            }
            let got: Vec<String> = page
                .get("streams")
                .and_then(serde_json::Value::as_array)
                .map(|a| a.iter().filter_map(|n| n.as_str().map(str::to_string)).collect())
                .unwrap_or_default();
            let total = page.get("total").and_then(serde_json::Value::as_u64).unwrap_or(0);
            if got.is_empty() {
                return Ok(names);
            }
            names.extend(got);
            if names.len() as u64 >= total {
                return Ok(names);
            }
        }
    }

    /// Check one stream's configuration (once per stream, until the next
    /// [`Self::recheck`]).
    async fn check_stream(&self, name: &str, log: bool) -> Result<()> {
        let Some(state) = &self.exactly_once else { return Ok(()) };
        if state.checked.lock().unwrap_or_else(PoisonError::into_inner).contains(name) {
            return Ok(());
        }
        let stream = self
            .js
            .get_stream(name)
            .await
            .map_err(|e| Error::SinkUnavailable(format!("NATS: cannot read stream {name}'s configuration: {e}")))?;
        let config = &stream.cached_info().config;
        if let Some(why) = stream_loses_last(config) {
            return Err(Error::Config(format!(
                "--exactly-once: JetStream stream {name} may lose a subject's last message, which exactly-once \
                 reads back: {why}"
            )));
        }
        let version = self.js.client().server_info().version;
        if config.storage == StorageType::File
            && let Some(why) = server_breaks_lookups(&version)
        {
            return Err(Error::Config(format!(
                "--exactly-once: JetStream stream {name} is on file storage, and {why}"
            )));
        }
        if log {
            let on_disk = match config.storage {
                StorageType::File => {
                    "file storage: the server writes each message before its PubAck and syncs to disk every \
                     sync_interval (2 minutes by default; `jetstream { sync_interval: always }` syncs each)"
                }
                StorageType::Memory => "memory storage: a restart of the server loses the stream's messages",
            };
            tracing::info!(
                stream = %name,
                replicas = config.num_replicas,
                server = %version,
                "NATS durability of an acknowledged message: {on_disk}; {} replica(s){}",
                config.num_replicas,
                if config.num_replicas > 1 {
                    " (a PubAck means a majority of them stored it)"
                } else {
                    " (one server: its loss loses what it has not synced)"
                }
            );
        }
        state.checked.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_string());
        Ok(())
    }

    /// The stream that captures `subject` (looked up once, then
    /// remembered), its configuration checked.
    async fn stream_for(
        &self,
        state: &ExactlyOnce,
        subject: &str,
    ) -> std::result::Result<(String, jetstream::stream::Stream<()>), BoxError> {
        let known = state.stream_of.lock().unwrap_or_else(PoisonError::into_inner).get(subject).cloned();
        let stream_name = match known {
            Some(n) => n,
            None => {
                let n = self.js.stream_by_subject(subject).await.map_err(|e| {
                    format!("cannot find the JetStream stream of subject {subject} to read its last message: {e}")
                })?;
                self.check_stream(&n, true).await.map_err(|e| e.to_string())?;
                remember(&state.stream_of, subject, n.clone());
                n
            }
        };
        let stream = self
            .js
            .get_stream_no_info(&stream_name)
            .await
            .map_err(|e| format!("cannot read stream {stream_name}: {e}"))?;
        Ok((stream_name, stream))
    }

    /// Read back what `subject` last holds, from the stream that captures it.
    async fn read_last(&self, state: &ExactlyOnce, subject: &str) -> std::result::Result<Last, BoxError> {
        let (stream_name, stream) = self.stream_for(state, subject).await?;
        let last = match stream.get_last_raw_message_by_subject(subject).await {
            Ok(msg) => msg,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                return Ok(Last { id: None, aggregate_type: None, occurred_at: None, sequence: 0 });
            }
            Err(e) => {
                // The stream may be gone (deleted, or another now captures
                // the subject): find it again next time.
                state.stream_of.lock().unwrap_or_else(PoisonError::into_inner).remove(subject);
                return Err(
                    format!("cannot read the last message of subject {subject} (stream {stream_name}): {e}").into()
                );
            }
        };
        let get = |name: &str| last.headers.get(name).map(|v| v.as_str().to_string());
        let id = get(header::ID).or_else(|| get("Nats-Msg-Id")).and_then(|v| v.trim().parse::<i64>().ok());
        let Some(id) = id else {
            return Err(format!(
                "the last message of subject {subject} (stream {stream_name}, sequence {}) has no outbox id \
                 (header id or Nats-Msg-Id): it was not written by pg-outbox, so whether the subject already \
                 holds this event cannot be told; remove it or use a subject of pg-outbox's own",
                last.sequence
            )
            .into());
        };
        Ok(Last {
            id: Some(id),
            aggregate_type: get(header::AGGREGATE_TYPE),
            occurred_at: get(header::OCCURRED_AT).as_deref().and_then(parse_occurred_at),
            sequence: last.sequence,
        })
    }

    /// Read `event` back from `subject`, whose last message has its id or
    /// a greater one: [`Sent::Held`] when the subject's last message is
    /// this event ([`Proof::LastMessage`]), or when the walk back along the
    /// subject's messages (each names the one before it: the stored
    /// `Nats-Expected-Last-Subject-Sequence`, and [`PREVIOUS_ID`]) reaches
    /// it ([`Proof::Chain`]), reading at most [`MAX_WALK`] messages. A
    /// greater id alone proves nothing: the error says why the event is not
    /// shown to be held (see [`Walk::step`]).
    async fn prove(&self, state: &ExactlyOnce, subject: &str, event: &Event) -> std::result::Result<Sent, BoxError> {
        let (stream_name, stream) = self.stream_for(state, subject).await?;
        let walk = Walk { subject, stream: &stream_name, event };
        let mut message = match stream.get_last_raw_message_by_subject(subject).await {
            Ok(m) => m,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                return Err(format!(
                    "subject {subject} (stream {stream_name}) held event {} or a later one, and is empty now \
                     (purged or deleted): whether it holds this event cannot be proven; not acknowledged",
                    event.id
                )
                .into());
            }
            Err(e) => {
                return Err(
                    format!("cannot read the last message of subject {subject} (stream {stream_name}): {e}").into()
                );
            }
        };
        for hop in 0..MAX_WALK {
            let (before, id) = match walk.step(&message, hop) {
                Step::Done(result) => return result,
                Step::Before { before, id } => (before, id),
            };
            message = match stream.get_raw_message(before).await {
                Ok(m) => m,
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Err(walk.gone(before, id)),
                Err(e) => {
                    return Err(format!("cannot read message {before} of stream {stream_name}: {e}").into());
                }
            };
        }
        Err(format!(
            "subject {subject} (stream {stream_name}) holds {MAX_WALK} or more messages above event {}: whether it \
             holds this event cannot be proven within them; not acknowledged",
            event.id
        )
        .into())
    }

    /// What `subject` last holds: remembered, or read back and remembered.
    async fn last_of(&self, state: &ExactlyOnce, subject: &str) -> std::result::Result<Last, BoxError> {
        let cached = state.last.lock().unwrap_or_else(PoisonError::into_inner).get(subject).cloned();
        match cached {
            Some(l) => Ok(l),
            None => {
                let l = self.read_last(state, subject).await?;
                remember(&state.last, subject, l.clone());
                Ok(l)
            }
        }
    }

    /// The stream answered a publish of `event` with a duplicate PubAck
    /// (`Nats-Msg-Id` seen within its duplicate window): `Ok` when the
    /// message stored under that id (at `ack`'s sequence) is this event (its
    /// `id` and `occurred_at`, on this subject); `Err` when it is another one (another outbox
    /// on this stream, or ids that came round again after a restore), which
    /// the stream dropped this event for, or when it cannot be read.
    pub(super) async fn verify_duplicate(
        &self,
        ack: &jetstream::publish::PublishAck,
        subject: &str,
        event: &Event,
    ) -> std::result::Result<(), BoxError> {
        let stream = self.js.get_stream_no_info(&ack.stream).await.map_err(|e| {
            format!("cannot read stream {} to check a duplicate of event {}: {e}", ack.stream, event.id)
        })?;
        let stored = stream.get_raw_message(ack.sequence).await.map_err(|e| {
            format!(
                "cannot read message {} of stream {} to check a duplicate of event {}: {e}",
                ack.sequence, ack.stream, event.id
            )
        })?;
        let get = |name: &str| stored.headers.get(name).map(|v| v.as_str().to_string());
        let id = get(header::ID).and_then(|v| v.trim().parse::<i64>().ok());
        let at = get(header::OCCURRED_AT).as_deref().and_then(parse_occurred_at);
        if id == Some(event.id) && at == Some(event.occurred_at) && stored.subject.as_str() == subject {
            return Ok(());
        }
        Err(format!(
            "publish to {subject}: stream {} dropped event {} as a duplicate of message {} (Nats-Msg-Id {}) on \
             subject {}, which is another event or another subject (another outbox on this stream, a subject \
             template changed, or a database restored to an earlier point whose ids came round again); not \
             acknowledged, retried after the stream's duplicate window",
            ack.stream, event.id, ack.sequence, event.id, stored.subject
        )
        .into())
    }

    /// The exactly-once send (see [`NatsSink`]).
    pub(super) async fn send_once(
        &self,
        state: &ExactlyOnce,
        subject: String,
        mut headers: HeaderMap,
        message: &Message,
        event: &Event,
    ) -> std::result::Result<Sent, BoxError> {
        if state.recheck.due() {
            self.recheck(state).await?;
        }
        let last = self.last_of(state, &subject).await?;
        if last.id.is_some_and(|id| event.id <= id) {
            // The subject holds this id or a greater one: only the event
            // itself, read back, proves it held.
            state.forget(&subject);
            return self.prove(state, &subject, event).await;
        }
        last.chain(&mut headers);
        let published = async {
            let ack = self.js.publish_with_headers(subject.clone(), headers, message.body.clone().into()).await?;
            ack.await
        };
        match published.await {
            Ok(ack) if ack.duplicate => {
                // Within the duplicate window the stream dropped it: it holds
                // the event, if the message stored under its id is this one.
                // The acknowledged sequence is the original's, not
                // necessarily the subject's last: read the subject back next time.
                state.forget(&subject);
                self.verify_duplicate(&ack, &subject, event).await?;
                Ok(held(
                    event.id,
                    &subject,
                    Proof::DuplicateWindow,
                    "the stream's duplicate window holds it (Nats-Msg-Id), and the message stored under it is this event",
                ))
            }
            Ok(ack) => {
                let l = Last {
                    id: Some(event.id),
                    aggregate_type: Some(event.aggregate_type.clone()),
                    occurred_at: Some(event.occurred_at),
                    sequence: ack.sequence,
                };
                remember(&state.last, &subject, l);
                Ok(Sent::Delivered)
            }
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                // Something else wrote to the subject since it was read.
                state.forget(&subject);
                let now = self.read_last(state, &subject).await?;
                remember(&state.last, &subject, now.clone());
                if now.id.is_some_and(|id| event.id <= id) {
                    return self.prove(state, &subject, event).await;
                }
                Err(format!(
                    "publish to {subject} refused: the subject changed since it was read (wrong last sequence: \
                     another relay wrote to it); its last message is now sequence {}; retried",
                    now.sequence
                )
                .into())
            }
            Err(e) => {
                // The stream may or may not have stored it: read back next time.
                state.forget(&subject);
                Err(publish_error(&subject, e))
            }
        }
    }
}

/// The walk back along one subject, looking for one event.
struct Walk<'a> {
    subject: &'a str,
    stream: &'a str,
    event: &'a Event,
}

/// What one message of the walk says.
enum Step {
    /// The event is proven held, or cannot be: the walk ends.
    Done(std::result::Result<Sent, BoxError>),
    /// Read the message stored before this one (`id`), at stream sequence
    /// `before`.
    Before { before: u64, id: i64 },
}

impl Walk<'_> {
    /// Read `message`, the `hop`-th back from the subject's last: this event
    /// (held, if its `occurred_at` and aggregate type match; else another
    /// event under its id), a message naming this event as the one stored
    /// just before it (held), a smaller id or a chain that passes this id
    /// (order broke upstream), a message pg-outbox did not write (cannot be
    /// proven), or the sequence of the message before it.
    fn step(&self, message: &async_nats::jetstream::message::StreamMessage, hop: usize) -> Step {
        let (subject, stream, event) = (self.subject, self.stream, self.event);
        let get = |name: &str| message.headers.get(name).map(|v| v.as_str().trim().to_string());
        let sequence = message.sequence;
        let fail = |why: String| Step::Done(Err(why.into()));
        if message.subject.as_str() != subject {
            return fail(format!(
                "the walk back along subject {subject} (stream {stream}) reached message {sequence} of subject {}: \
                 whether it holds event {} cannot be proven; not acknowledged",
                message.subject, event.id
            ));
        }
        let Some(id) = get(header::ID).or_else(|| get("Nats-Msg-Id")).and_then(|v| v.parse::<i64>().ok()) else {
            return fail(format!(
                "message {sequence} of subject {subject} (stream {stream}) has no outbox id (header id or \
                 Nats-Msg-Id): it was not written by pg-outbox, so whether the subject holds event {} cannot be \
                 proven; not acknowledged (use a subject of pg-outbox's own)",
                event.id
            ));
        };
        let at = get(header::OCCURRED_AT).as_deref().and_then(parse_occurred_at);
        if id == event.id {
            let same_type = get(header::AGGREGATE_TYPE).is_none_or(|t| t == event.aggregate_type);
            if at == Some(event.occurred_at) && same_type {
                let (proof, why) = if hop == 0 {
                    (Proof::LastMessage, "the subject's last message is this event")
                } else {
                    (Proof::Chain, "the walk back along the subject reached this event's own message")
                };
                return Step::Done(Ok(held(event.id, subject, proof, why)));
            }
            return fail(format!(
                "message {sequence} of subject {subject} (stream {stream}) has event {}'s id but is another event \
                 ({}): another outbox writes this subject, or the database was restored to an earlier point and its \
                 ids came round again; not acknowledged (use subjects of this outbox's own)",
                event.id,
                at.map_or_else(|| "no occurred_at header".to_string(), |t| format!("occurred {}", t.to_rfc3339()))
            ));
        }
        if id < event.id {
            return self.broke(id, format!("the walk back from its last message reached event {id} without it"));
        }
        if let Some(previous) = get(PREVIOUS_ID).and_then(|v| v.parse::<i64>().ok()) {
            let previous_at = get(PREVIOUS_OCCURRED_AT).as_deref().and_then(parse_occurred_at);
            if previous == event.id && previous_at == Some(event.occurred_at) {
                let why = "a message of the subject names this event as the one stored just before it";
                return Step::Done(Ok(held(event.id, subject, Proof::Chain, why)));
            }
            if previous < event.id {
                return self.broke(id, format!("was stored right after event {previous}"));
            }
        }
        match get(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE.as_ref()).and_then(|v| v.parse::<u64>().ok()) {
            Some(0) => self.broke(id, "that is the subject's first message".to_string()),
            Some(before) => Step::Before { before, id },
            None => fail(format!(
                "subject {subject} (stream {stream}) holds event {id} above event {}, and message {sequence} does \
                 not say which message came before it (no Nats-Expected-Last-Subject-Sequence: not written by \
                 pg-outbox --exactly-once): another outbox writes this subject, or the database was restored to an \
                 earlier point and its ids came round again; whether it holds this event cannot be proven, so it is \
                 not acknowledged (use subjects of this outbox's own)",
                event.id
            )),
        }
    }

    /// Order broke upstream: the subject holds event `id` of the
    /// aggregate, and `what` shows this event was never stored before it.
    fn broke(&self, id: i64, what: String) -> Step {
        let (subject, stream, event) = (self.subject, self.stream, self.event);
        Step::Done(Err(format!(
            "order broke upstream: subject {subject} (stream {stream}) holds event {id} of aggregate {} {}, and \
             {what}, so event {} was never stored there and a later one of its aggregate was; not acknowledged \
             unsent. Causes: a producer that broke the producer-locked contract, a trigger disabled while rows \
             changed, another outbox (or a restored database) writing this subject; see docs/operations.md, \
             \"When exactly-once finds order broken\"",
            event.aggregate_type, event.aggregate_id, event.id
        )
        .into()))
    }

    /// Message `before`, stored before event `id`'s and needed by the
    /// walk, is gone.
    fn gone(&self, before: u64, id: i64) -> BoxError {
        format!(
            "subject {} (stream {}) holds event {id} above event {}, and message {before}, stored before it, \
             is gone (the stream's limits removed it, e.g. max_msgs_per_subject): whether the subject held this \
             event cannot be proven; not acknowledged (keep more messages per subject; see docs/operations.md, \
             \"When exactly-once finds order broken\")",
            self.subject, self.stream, self.event.id
        )
        .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_that_may_lose_a_subjects_last_message_are_named_by_setting() {
        use jetstream::stream::Config;
        let ok = Config { name: "S".into(), max_messages: -1, max_bytes: -1, ..Default::default() };
        assert_eq!(stream_loses_last(&ok), None);
        assert_eq!(stream_loses_last(&Config { max_messages_per_subject: 1, ..ok.clone() }), None);
        let cases = [
            (Config { retention: RetentionPolicy::WorkQueue, ..ok.clone() }, "retention"),
            (Config { retention: RetentionPolicy::Interest, ..ok.clone() }, "retention"),
            (Config { max_age: std::time::Duration::from_secs(60), ..ok.clone() }, "max_age"),
            (Config { max_messages: 1000, ..ok.clone() }, "max_msgs is 1000"),
            (Config { max_bytes: 1 << 20, ..ok.clone() }, "max_bytes"),
            (
                Config {
                    discard: DiscardPolicy::New,
                    discard_new_per_subject: true,
                    max_messages_per_subject: 1,
                    ..ok.clone()
                },
                "discard new per subject",
            ),
        ];
        for (config, want) in cases {
            let why = stream_loses_last(&config).unwrap_or_default();
            assert!(why.contains(want), "{want}: {why}");
        }
    }

    #[test]
    fn servers_whose_per_subject_lookups_can_fail_are_named() {
        for bad in ["2.12.7", "v2.12.9", "2.12.7-RC.1"] {
            let why = server_breaks_lookups(bad).unwrap_or_default();
            assert!(why.contains("8254") && why.contains("2.14"), "{bad}: {why}");
        }
        for good in ["2.9.10", "2.10.29", "2.11.4", "2.12.6", "2.14.0", "3.0.0", "unknown"] {
            assert_eq!(server_breaks_lookups(good), None, "{good}");
        }
    }
}

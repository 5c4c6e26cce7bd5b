//! Webhook requests through a real `pg-outbox relay`: Standard Webhooks
//! signatures checked by the reference library (`standardwebhooks`, an
//! implementation independent of ours), tampering detected, extra headers,
//! W3C trace context, CloudEvents bodies, and malformed secrets refused at
//! start.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::relay_proc;
use crate::support::{self, DbCli, TestDb};

/// A Standard Webhooks secret (24-byte key), as a receiver would be given it.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// One request as it arrived: headers, the exact body bytes, and whether the
/// reference library accepted its signature.
#[derive(Debug, Clone)]
struct Received {
    headers: HeaderMap,
    body: Bytes,
    verified: bool,
}

#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn got(&self) -> Vec<Received> {
        self.got.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

fn verifier() -> standardwebhooks::Webhook {
    standardwebhooks::Webhook::new(SECRET).expect("the reference library accepts the secret")
}

/// Verify with the reference library; answer 401 on a bad signature (so the
/// relay would fail the event), 204 otherwise.
async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let verified = verifier().verify(&body, &headers).is_ok();
    r.got.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(Received { headers, body, verified });
    if verified { StatusCode::NO_CONTENT } else { StatusCode::UNAUTHORIZED }
}

async fn start_receiver() -> (Receiver, String) {
    let r = Receiver::default();
    let app = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(r.clone());
    (r, crate::support::serve_hook(app).await)
}

async fn published(c: &tokio_postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[])
        .await
        .expect("count published")
        .get(0)
}

fn header<'a>(r: &'a Received, name: &str) -> &'a str {
    r.headers
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header: {:?}", r.headers))
        .to_str()
        .unwrap_or_else(|e| panic!("{name} is not text ({e})"))
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Two events: one whose envelope carries W3C trace context, one without.
/// The outbox id in a received body (a record's number, a CloudEvent's
/// string).
fn body_id(body: &[u8]) -> i64 {
    let v: Value = serde_json::from_slice(body).expect("the body is JSON");
    v["id"].as_i64().or_else(|| v["id"].as_str().and_then(|s| s.parse().ok())).expect("an id in the body")
}

/// Two events of two aggregates may arrive in either order (the relay has
/// both in flight at once): the requests sorted by outbox id.
fn in_id_order<T>(mut got: Vec<T>, body: impl Fn(&T) -> &[u8]) -> Vec<T> {
    got.sort_by_key(|r| body_id(body(r)));
    got
}

async fn publish_two(c: &tokio_postgres::Client) -> (i64, i64) {
    let traced = json!({"version": 1, "data": {"amount": 990},
        "metadata": {"correlation_id": "req-1", "traceparent": TRACEPARENT, "tracestate": "vendor=x"}});
    let plain = json!({"version": 1, "data": {"amount": 12}});
    let p = pg_outbox::Publisher::new();
    let a = p
        .publish(c, &pg_outbox::NewEvent::new("invoice", Uuid::new_v4(), "InvoiceIssued", traced))
        .await
        .expect("publish the traced event");
    let b = p
        .publish(c, &pg_outbox::NewEvent::new("invoice", Uuid::new_v4(), "InvoicePaid", plain))
        .await
        .expect("publish the plain event");
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_webhook_verifies_with_the_reference_library_and_tampering_is_caught() {
    let db = TestDb::new("hook_signed").await;
    let c = db.client().await;
    let (rx, url) = start_receiver().await;
    let relay = relay_proc::start(
        &db,
        &[
            "--sink",
            &url,
            "--webhook-secret",
            SECRET,
            "--webhook-header",
            "X-Team: billing",
            "--sweep-interval",
            "200ms",
        ],
    )
    .await;
    let (traced, plain) = publish_two(&c).await;
    support::eventually(30, "both events published", || async { published(&c).await == 2 }).await;

    let got = in_id_order(rx.got(), |r| &r.body[..]);
    assert_eq!(got.len(), 2, "one request per event, none rejected: {got:?}");
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs();
    for (r, id) in got.iter().zip([traced, plain]) {
        assert!(r.verified, "the reference library rejected the signature: {r:?}");
        assert_eq!(header(r, "webhook-id"), id.to_string(), "webhook-id is the outbox id");
        assert_eq!(header(r, "idempotency-key"), id.to_string());
        let ts: u64 = header(r, "webhook-timestamp").parse().expect("webhook-timestamp is an integer");
        assert!(ts <= before && before - ts < 60, "webhook-timestamp is the send time in Unix seconds: {ts}");
        let sig = header(r, "webhook-signature");
        assert!(sig.starts_with("v1,") && !sig.contains(' '), "one v1 signature: {sig}");
        assert_eq!(header(r, "x-team"), "billing", "--webhook-header arrives");
        let body: Value = serde_json::from_slice(&r.body).expect("the body is JSON");
        assert_eq!(body["id"], id, "{body}");
    }
    assert_eq!(header(&got[0], "traceparent"), TRACEPARENT, "trace context from the envelope's metadata");
    assert_eq!(header(&got[0], "tracestate"), "vendor=x");
    assert!(got[1].headers.get("traceparent").is_none(), "no traceparent when the metadata has none");

    // Tampering: the same headers with a changed body, timestamp or id, or a
    // different secret, no longer verify.
    let r = &got[0];
    let mut body = r.body.to_vec();
    let at = body.iter().position(|b| *b == b'9').expect("the amount 990 is in the body");
    body[at] = b'1';
    assert!(verifier().verify(&body, &r.headers).is_err(), "a tampered body must not verify");
    assert!(verifier().verify(&r.body, &r.headers).is_ok(), "the original still verifies");
    let mut h = r.headers.clone();
    let ts: i64 = header(r, "webhook-timestamp").parse().expect("timestamp");
    h.insert("webhook-timestamp", HeaderValue::from(ts - 1));
    assert!(verifier().verify(&r.body, &h).is_err(), "a changed timestamp must not verify");
    let mut h = r.headers.clone();
    h.insert("webhook-id", HeaderValue::from(plain));
    assert!(verifier().verify(&r.body, &h).is_err(), "a changed id must not verify");
    let other = standardwebhooks::Webhook::new("whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA").expect("other secret");
    assert!(other.verify(&r.body, &r.headers).is_err(), "another secret must not verify");

    let log = relay.log();
    assert!(!log.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), "the secret leaked into the log:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_webhook_bodies_are_cloudevents_1_0_and_signed() {
    let db = TestDb::new("hook_cloudevents").await;
    let c = db.client().await;
    let (rx, url) = start_receiver().await;
    let _relay = relay_proc::start(
        &db,
        &[
            "--sink",
            &url,
            "--webhook-secret",
            SECRET,
            "--format",
            "cloudevents",
            "--cloudevents-source",
            "/billing",
            "--sweep-interval",
            "200ms",
        ],
    )
    .await;
    let (traced, plain) = publish_two(&c).await;
    support::eventually(30, "both events published", || async { published(&c).await == 2 }).await;
    let rows = c
        .query("SELECT id, event_type, aggregate_id, payload FROM events.outbox ORDER BY id", &[])
        .await
        .expect("read rows");
    let got = in_id_order(rx.got(), |r| &r.body[..]);
    assert_eq!(got.len(), 2, "{got:?}");
    for ((r, row), id) in got.iter().zip(&rows).zip([traced, plain]) {
        assert!(r.verified, "signature of a CloudEvents body: {r:?}");
        assert!(header(r, "content-type").starts_with("application/cloudevents+json"), "structured mode content type");
        let ce: Value = serde_json::from_slice(&r.body).expect("the body is JSON");
        // CloudEvents 1.0 required attributes (spec, "Required Attributes").
        assert_eq!(ce["specversion"], "1.0", "{ce}");
        assert_eq!(ce["id"], id.to_string(), "{ce}");
        assert_eq!(ce["type"], row.get::<_, String>(1), "{ce}");
        assert_eq!(ce["source"], "/billing", "{ce}");
        assert_eq!(ce["subject"], row.get::<_, Uuid>(2).to_string(), "{ce}");
        assert_eq!(ce["data"], row.get::<_, Value>(3), "data is the payload as stored: {ce}");
        assert_eq!(ce["datacontenttype"], "application/json", "{ce}");
        let time = ce["time"].as_str().unwrap_or_else(|| panic!("time is a string: {ce}"));
        chrono::DateTime::parse_from_rfc3339(time).unwrap_or_else(|e| panic!("time is not RFC 3339 ({e}): {ce}"));
    }
    let ce: Value = serde_json::from_slice(&got[0].body).expect("JSON");
    assert_eq!(ce["traceparent"], TRACEPARENT, "Distributed Tracing extension: {ce}");
    assert_eq!(header(&got[0], "traceparent"), TRACEPARENT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_webhook_secret_is_refused_at_start_without_showing_it() {
    let db = TestDb::new("hook_bad_secret").await;
    let c = db.client().await;
    support::insert_seed_events(&c, Uuid::new_v4(), 1).await;
    for (secret, needle) in
        [("whsec_hunter2!!", "standard base64"), ("whsec_aHVudGVyMg==", "7-byte key"), ("whsec_", "empty")]
    {
        let out = db.cli(&["relay", "--sink", "http://127.0.0.1:9/hook", "--webhook-secret", secret]).run().await;
        let stderr = &out.stderr;
        assert_eq!(out.code, Some(1), "{secret}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line: {stderr}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains("--webhook-secret"), "{stderr}");
        assert!(lines[0].contains(needle), "{secret}: {stderr}");
        assert!(!stderr.contains("hunter2") && !stderr.contains("aHVudGVyMg"), "the secret leaked: {stderr}");
    }
    let touched: i64 = c
        .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL OR retry_count > 0", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(touched, 0, "a relay that refused to start touches no row");
}

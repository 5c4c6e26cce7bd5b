//! End to end through the real `pg-outbox relay` process: stdout and webhook
//! sinks, retries to a dead letter with per-aggregate hold-back, webhook
//! timeouts, Prometheus metrics, and a clean exit on SIGTERM.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::ChildStdout;
use tokio_postgres::Client;
use uuid::Uuid;

use pg_outbox::{NewEvent, Publisher};

use crate::relay_proc::{self, LIVENESS, Output, RelayProc, free_port, relay};
use crate::support::{self, TestDb, published_count};

/// The keys of a sink record, exactly: single mode's relay always holds a
/// leadership term.
const RECORD_KEYS: [&str; 8] =
    ["aggregate_id", "aggregate_type", "event_type", "id", "occurred_at", "payload", "retry_count", "term"];

/// A running `pg-outbox relay` child process whose stdout the test reads.
struct Relay {
    proc: RelayProc,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Relay {
    /// Start `pg-outbox relay args...` on `db` and wait until it says it
    /// started (it is listening by then).
    async fn start(db: &TestDb, args: &[&str]) -> Relay {
        let (proc, stdout) = relay_proc::start_with_stdout(db, args).await;
        Relay { proc, stdout: BufReader::new(stdout).lines() }
    }

    /// What the relay wrote on stderr so far.
    fn log(&self) -> String {
        self.proc.log()
    }

    /// The next line on the relay's stdout.
    async fn next_line(&mut self) -> String {
        match tokio::time::timeout(LIVENESS, self.stdout.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) => panic!("relay stdout ended early; stderr:\n{}", self.log()),
            Ok(Err(e)) => panic!("reading relay stdout: {e}; stderr:\n{}", self.log()),
            Err(_) => panic!("no line on relay stdout within {LIVENESS:?}; stderr:\n{}", self.log()),
        }
    }

    fn sigterm(&self) {
        self.proc.sigterm();
    }

    async fn wait(&mut self) -> ExitStatus {
        self.proc.wait().await
    }

    /// Everything left on stdout until it closes (the process has exited).
    async fn rest_of_stdout(&mut self) -> Vec<String> {
        let mut rest = Vec::new();
        loop {
            match tokio::time::timeout(LIVENESS, self.stdout.next_line()).await {
                Ok(Ok(Some(line))) => rest.push(line),
                Ok(Ok(None)) => return rest,
                Ok(Err(e)) => panic!("reading relay stdout: {e}"),
                Err(_) => panic!("relay stdout did not close within {LIVENESS:?}"),
            }
        }
    }
}

/// Check that `v` is a sink record (exactly the documented keys, RFC 3339
/// `occurred_at`) and return its id.
fn check_record(v: &Value) -> i64 {
    let obj = v.as_object().unwrap_or_else(|| panic!("a record is a JSON object: {v}"));
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect::<BTreeSet<_>>().into_iter().collect();
    assert_eq!(keys, RECORD_KEYS, "record keys: {v}");
    let occurred = obj["occurred_at"].as_str().unwrap_or_else(|| panic!("occurred_at is a string: {v}"));
    chrono::DateTime::parse_from_rfc3339(occurred).unwrap_or_else(|e| panic!("occurred_at is not RFC 3339 ({e}): {v}"));
    assert!(obj["retry_count"].is_i64(), "retry_count is an integer: {v}");
    assert!(obj["term"].as_i64().is_some_and(|t| t > 0), "term is a positive integer: {v}");
    assert!(obj["aggregate_type"].is_string() && obj["event_type"].is_string(), "{v}");
    let agg = obj["aggregate_id"].as_str().unwrap_or_else(|| panic!("aggregate_id is a string: {v}"));
    Uuid::parse_str(agg).unwrap_or_else(|e| panic!("aggregate_id is not a UUID ({e}): {v}"));
    obj["id"].as_i64().unwrap_or_else(|| panic!("id is an integer: {v}"))
}

/// `(aggregate_type, aggregate_id, event_type, payload)` of every row, by id.
async fn rows_by_id(c: &Client) -> BTreeMap<i64, (String, Uuid, String, Value)> {
    c.query("SELECT id, aggregate_type, aggregate_id, event_type, payload FROM events.outbox", &[])
        .await
        .expect("read outbox rows")
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect()
}

/// The state of one row: (published, retry_count, next_retry_at is
/// 'infinity', next_retry_at in the future, last_error).
async fn row_state(c: &Client, id: i64) -> (bool, i32, bool, bool, Option<String>) {
    let r = c
        .query_one(
            "SELECT published_at IS NOT NULL, retry_count, \
                    coalesce(next_retry_at = 'infinity'::timestamptz, false), \
                    coalesce(next_retry_at > now(), false), last_error \
             FROM events.outbox WHERE id = $1",
            &[&id],
        )
        .await
        .expect("read the row");
    (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))
}

async fn retry_count(c: &Client, id: i64) -> i32 {
    row_state(c, id).await.1
}

/// Publish `n` events with the library's publisher, one statement each,
/// alternating between `aggs`; returns their ids.
async fn publish_with_library(c: &Client, aggs: &[Uuid], n: usize, tag: &str) -> Vec<i64> {
    let publisher = Publisher::new();
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let event = NewEvent::new(
            "invoice",
            aggs[i % aggs.len()],
            "InvoiceIssued",
            json!({"version": 1, "data": {"tag": tag, "i": i}, "metadata": {"correlation_id": format!("req-{i}")}}),
        );
        ids.push(publisher.publish(c, &event).await.expect("publish with the library"));
    }
    ids
}

// ---------------------------------------------------------------- a webhook in the test

const HOOK_OK: u8 = 0;
const HOOK_FAIL: u8 = 1;
const HOOK_HANG: u8 = 2;

/// One request the test webhook received.
#[derive(Debug, Clone)]
struct Seen {
    idempotency_key: Option<String>,
    content_type: Option<String>,
    body: Value,
}

#[derive(Clone, Default)]
struct Hook {
    seen: Arc<Mutex<Vec<Seen>>>,
    mode: Arc<AtomicU8>,
}

impl Hook {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Requests whose body has `id`.
    fn attempts(&self, id: i64) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| s.body["id"] == id).collect()
    }

    fn set_mode(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }
}

async fn hook_handler(State(hook): State<Hook>, headers: HeaderMap, body: Bytes) -> (StatusCode, &'static str) {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let seen = Seen {
        idempotency_key: header("idempotency-key"),
        content_type: header("content-type"),
        body: serde_json::from_slice(&body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned())),
    };
    hook.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(seen);
    match hook.mode.load(Ordering::SeqCst) {
        HOOK_OK => (StatusCode::OK, "ok"),
        HOOK_FAIL => (StatusCode::INTERNAL_SERVER_ERROR, "boom from the test hook"),
        _ => {
            tokio::time::sleep(Duration::from_secs(120)).await;
            (StatusCode::OK, "too late")
        }
    }
}

/// Serve the test webhook on 127.0.0.1:0; returns it and its URL.
async fn start_hook(mode: u8) -> (Hook, String) {
    let hook = Hook::default();
    hook.set_mode(mode);
    let app = axum::Router::new().route("/hook", axum::routing::post(hook_handler)).with_state(hook.clone());
    (hook, crate::support::serve_hook(app).await)
}

// ---------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_sink_prints_every_event_as_one_json_line_then_exits_cleanly_on_sigterm() {
    let db = TestDb::new("relay_stdout").await;
    let c = db.client().await;
    let mut relay = Relay::start(&db, &["--sink", "stdout", "--sweep-interval", "200ms"]).await;

    // 50 events: the library's publisher, a seed-style bulk INSERT, the
    // publisher again, over four aggregates.
    let aggs = [Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4()];
    let mut ids = publish_with_library(&c, &aggs, 10, "first").await;
    ids.extend(support::insert_seed_events(&c, Uuid::new_v4(), 25).await);
    ids.extend(publish_with_library(&c, &aggs, 15, "second").await);
    assert_eq!(ids.len(), 50);
    let expected = rows_by_id(&c).await;

    let mut got = Vec::new();
    while got.len() < ids.len() {
        let line = relay.next_line().await;
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line}"));
        let id = check_record(&v);
        let (agg_type, agg_id, event_type, payload) =
            expected.get(&id).unwrap_or_else(|| panic!("relay printed an unknown id {id}: {line}"));
        assert_eq!(v["aggregate_type"], agg_type.as_str(), "{line}");
        assert_eq!(v["aggregate_id"], agg_id.to_string(), "{line}");
        assert_eq!(v["event_type"], event_type.as_str(), "{line}");
        assert_eq!(&v["payload"], payload, "{line}");
        assert_eq!(v["retry_count"], 0, "{line}");
        got.push(id);
    }
    assert!(got.windows(2).all(|w| w[0] < w[1]), "ids must be printed in ascending order, once each: {got:?}");
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(got, sorted, "every published event is printed");

    support::eventually(30, "all 50 rows marked published", || async { published_count(&c).await == 50 }).await;

    relay.sigterm();
    let status = relay.wait().await;
    assert_eq!(status.code(), Some(0), "relay should exit 0 on SIGTERM ({status}); stderr:\n{}", relay.log());
    let rest = relay.rest_of_stdout().await;
    assert!(rest.is_empty(), "nothing else may be printed on stdout: {rest:?}");
    assert_eq!(published_count(&c).await, 50);
}

/// Sum of the samples of `name` (with or without labels) in a Prometheus
/// text exposition, or `None` when there is none.
fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else { continue };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let value = line.split_whitespace().last().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            found = Some(found.unwrap_or(0.0) + v);
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_counts_deliveries_notifications_and_lag() {
    let db = TestDb::new("relay_metrics").await;
    let c = db.client().await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    // A long sweep interval: deliveries here are driven by notifications.
    let mut relay = Relay::start(&db, &["--sink", "stdout", "--sweep-interval", "1m", "--metrics-addr", &addr]).await;

    let ids = support::insert_seed_events(&c, Uuid::new_v4(), 5).await;
    for _ in &ids {
        let line = relay.next_line().await;
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line}"));
        check_record(&v);
    }
    support::eventually(30, "5 rows marked published", || async { published_count(&c).await == 5 }).await;

    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("HTTP client");
    let url = format!("http://{addr}/metrics");
    let deadline = tokio::time::Instant::now() + LIVENESS;
    let text = loop {
        let last = match http.get(&url).send().await {
            Ok(resp) => {
                assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
                let body = resp.text().await.expect("metrics body");
                if metric(&body, pg_outbox::metrics::EVENTS_PUBLISHED).unwrap_or(0.0) >= 5.0 {
                    break body;
                }
                body
            }
            Err(e) => format!("GET {url} failed: {e}"),
        };
        assert!(tokio::time::Instant::now() < deadline, "metrics never showed 5 published events:\n{last}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    assert_eq!(metric(&text, pg_outbox::metrics::EVENTS_PUBLISHED), Some(5.0), "{text}");
    let notifications = metric(&text, pg_outbox::metrics::NOTIFICATIONS).unwrap_or(0.0);
    assert!(notifications > 0.0, "outbox_notifications_total should be > 0:\n{text}");
    assert!(
        text.lines().any(|l| l == "# TYPE outbox_delivery_lag_seconds histogram"),
        "outbox_delivery_lag_seconds should be a histogram:\n{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("outbox_delivery_lag_seconds_bucket{")),
        "outbox_delivery_lag_seconds should have buckets:\n{text}"
    );
    assert_eq!(metric(&text, "outbox_delivery_lag_seconds_count"), Some(5.0), "one lag sample per event:\n{text}");
    let inf_bucket = text
        .lines()
        .find(|l| l.starts_with("outbox_delivery_lag_seconds_bucket{") && l.contains("le=\"+Inf\""))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(inf_bucket, Some(5.0), "the +Inf bucket holds every sample:\n{text}");

    relay.sigterm();
    let status = relay.wait().await;
    assert_eq!(status.code(), Some(0), "relay should exit 0 on SIGTERM ({status}); stderr:\n{}", relay.log());
}

/// The backlog gauges match the table, read by a standby too (it delivers
/// nothing, so the figures stay put while the test reads them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_gauges_count_pending_events_and_dead_letters() {
    let db = TestDb::new("relay_gauges").await;
    let c = db.client().await;
    // Hold the single-mode leader lock (docs/architecture.md, "Advisory lock
    // keys"), so the relay stays a standby.
    let leader_key: i64 = 0x7067_6f75_7400_0001;
    c.execute("SELECT pg_advisory_lock($1)", &[&leader_key]).await.expect("take the leader lock");
    support::insert_seed_events(&c, Uuid::new_v4(), 3).await;
    support::insert_dead_letters(&c, 2).await;
    c.batch_execute("UPDATE events.outbox SET occurred_at = now() - interval '90 seconds' WHERE retry_count = 0")
        .await
        .expect("age the pending events");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut relay = Relay::start(&db, &["--sink", "stdout", "--metrics-addr", &addr]).await;

    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("HTTP client");
    let url = format!("http://{addr}/metrics");
    let deadline = tokio::time::Instant::now() + LIVENESS;
    let text = loop {
        let body = match http.get(&url).send().await {
            Ok(resp) => resp.text().await.unwrap_or_default(),
            Err(e) => format!("GET {url} failed: {e}"),
        };
        if metric(&body, pg_outbox::metrics::BACKLOG) == Some(3.0) {
            break body;
        }
        assert!(tokio::time::Instant::now() < deadline, "outbox_backlog_events never showed 3:\n{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(metric(&text, pg_outbox::metrics::DEAD_LETTERS), Some(2.0), "{text}");
    let age = metric(&text, pg_outbox::metrics::OLDEST_UNPUBLISHED_AGE).unwrap_or(0.0);
    assert!((90.0..3600.0).contains(&age), "oldest pending event is about 90 s old, got {age}:\n{text}");
    assert_eq!(metric(&text, pg_outbox::metrics::LEADER), Some(0.0), "a standby: {text}");
    assert!(metric(&text, pg_outbox::metrics::NOTIFICATION_QUEUE_USAGE).is_some(), "{text}");
    assert_eq!(published_count(&c).await, 0, "a standby delivers nothing");

    relay.sigterm();
    let status = relay.wait().await;
    assert_eq!(status.code(), Some(0), "relay should exit 0 on SIGTERM ({status}); stderr:\n{}", relay.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_receives_every_event_once_in_aggregate_order_with_an_idempotency_key() {
    let db = TestDb::new("relay_webhook").await;
    let c = db.client().await;
    let (hook, url) = start_hook(HOOK_OK).await;
    let mut relay = Relay::start(&db, &["--sink", &url, "--sweep-interval", "200ms"]).await;

    let aggs = [Uuid::new_v4(), Uuid::new_v4()];
    let mut ids = support::insert_seed_events(&c, Uuid::new_v4(), 10).await;
    ids.extend(publish_with_library(&c, &aggs, 10, "hook").await);
    let expected = rows_by_id(&c).await;

    support::eventually(30, "all 20 rows marked published", || async { published_count(&c).await == 20 }).await;

    let seen = hook.seen();
    let got: Vec<i64> = seen.iter().map(|s| check_record(&s.body)).collect();
    let mut once = got.clone();
    once.sort_unstable();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(once, sorted, "each event POSTed once");
    // Several in flight, one per aggregate: each aggregate's events arrive
    // in id order; different aggregates' interleave.
    for (agg, _) in expected.values().map(|(_, a, _, _)| (a, ())).collect::<BTreeMap<_, _>>() {
        let of: Vec<i64> = got.iter().copied().filter(|id| expected[id].1 == *agg).collect();
        assert!(of.is_sorted(), "aggregate {agg}: in id order: {of:?}");
    }
    for s in &seen {
        let id = s.body["id"].as_i64().expect("checked above");
        assert_eq!(s.idempotency_key.as_deref(), Some(id.to_string().as_str()), "Idempotency-Key is the id: {s:?}");
        assert!(
            s.content_type.as_deref().is_some_and(|t| t.starts_with("application/json")),
            "the body is sent as JSON: {s:?}"
        );
        let (agg_type, agg_id, event_type, payload) = &expected[&id];
        assert_eq!(s.body["aggregate_type"], agg_type.as_str());
        assert_eq!(s.body["aggregate_id"], agg_id.to_string());
        assert_eq!(s.body["event_type"], event_type.as_str());
        assert_eq!(&s.body["payload"], payload);
        assert_eq!(s.body["retry_count"], 0);
    }

    relay.sigterm();
    let status = relay.wait().await;
    assert_eq!(status.code(), Some(0), "relay should exit 0 on SIGTERM ({status}); stderr:\n{}", relay.log());
    assert_eq!(hook.seen().len(), 20, "no redelivery of acknowledged events");
    let rest = relay.rest_of_stdout().await;
    assert!(rest.is_empty(), "a webhook relay prints nothing on stdout: {rest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_webhook_dead_letters_after_max_retries_and_holds_back_its_aggregate() {
    let db = TestDb::new("relay_hook_fail").await;
    let c = db.client().await;
    let (hook, url) = start_hook(HOOK_FAIL).await;
    let _relay = Relay::start(
        &db,
        &["--sink", &url, "--retry-schedule", "50ms", "--max-retries", "3", "--sweep-interval", "100ms"],
    )
    .await;

    let a = Uuid::new_v4();
    let a1 = support::insert_seed_events(&c, a, 1).await[0];
    support::eventually(30, "the event to fail 3 times", || async { retry_count(&c, a1).await >= 3 }).await;

    let (published, retries, infinite, _, last_error) = row_state(&c, a1).await;
    assert!(!published, "a failed event is not published");
    assert_eq!(retries, 3, "retry_count stops at --max-retries");
    assert!(infinite, "a dead letter has next_retry_at = 'infinity'");
    let last_error = last_error.expect("last_error is set");
    assert!(last_error.contains("500"), "last_error names the status: {last_error}");

    let attempts = hook.attempts(a1);
    assert_eq!(attempts.len(), 3, "exactly 3 attempts: {attempts:?}");
    let counts: Vec<&Value> = attempts.iter().map(|s| &s.body["retry_count"]).collect();
    assert_eq!(counts, [&json!(0), &json!(1), &json!(2)], "each attempt carries the failures before it");
    assert!(attempts.iter().all(|s| s.idempotency_key.as_deref() == Some(a1.to_string().as_str())), "{attempts:?}");

    // No 4th attempt: the dead letter stays put through many sweeps.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(hook.attempts(a1).len(), 3, "a dead letter is never delivered again");
    assert_eq!(retry_count(&c, a1).await, 3);

    // The webhook recovers. A later event of the same aggregate stays held
    // back behind the dead letter; another aggregate's event goes through.
    hook.set_mode(HOOK_OK);
    let a2 = support::insert_seed_events(&c, a, 1).await[0];
    let b1 = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    assert!(a2 < b1);
    support::eventually(30, "the other aggregate's event to be published", || async { row_state(&c, b1).await.0 })
        .await;
    assert_eq!(hook.attempts(b1).len(), 1, "the other aggregate's event is delivered once");
    // b1 was delivered after a2 would have been (id order); give a few more sweeps anyway.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        hook.attempts(a2).is_empty(),
        "an event behind a dead letter must not be delivered: {:?}",
        hook.attempts(a2)
    );
    let (published, retries, _, _, last_error) = row_state(&c, a2).await;
    assert!(!published && retries == 0 && last_error.is_none(), "the held-back event is untouched");
    assert_eq!(hook.attempts(a1).len(), 3, "the dead letter was not retried when the webhook recovered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_webhook_times_out_and_the_event_waits_for_a_retry() {
    let db = TestDb::new("relay_hook_hang").await;
    let c = db.client().await;
    let (hook, url) = start_hook(HOOK_HANG).await;
    let _relay = Relay::start(&db, &["--sink", &url, "--webhook-timeout", "300ms", "--sweep-interval", "200ms"]).await;

    let id = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    support::eventually(30, "the hanging delivery to fail", || async { retry_count(&c, id).await >= 1 }).await;

    let (published, retries, infinite, waiting, last_error) = row_state(&c, id).await;
    assert!(!published, "a timed-out delivery is not published");
    assert_eq!(retries, 1, "one failure (the default ladder waits a minute before the next try)");
    assert!(waiting && !infinite, "the event waits for its retry, it is not a dead letter");
    let last_error = last_error.expect("last_error is set");
    assert!(last_error.contains("timed out"), "last_error says it timed out: {last_error}");
    assert_eq!(hook.attempts(id).len(), 1, "the webhook got the request");
}

/// A webhook that redirects POST /hook to a GET-able 200 page.
async fn start_redirecting_hook() -> (Arc<AtomicU8>, String) {
    let landed = Arc::new(AtomicU8::new(0));
    let l2 = landed.clone();
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(|| async { (StatusCode::FOUND, [("location", "/landing")], "moved") }))
        .route(
            "/landing",
            axum::routing::get(move || {
                let l = l2.clone();
                async move {
                    l.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::OK, "landed")
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (landed, format!("http://user:hunter2@{addr}/hook?token=abc123"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirecting_webhook_fails_the_event_and_credentials_never_show() {
    let db = TestDb::new("relay_hook_redirect").await;
    let c = db.client().await;
    let (landed, url) = start_redirecting_hook().await;
    let relay = Relay::start(&db, &["--sink", &url, "--sweep-interval", "200ms"]).await;
    let id = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    support::eventually(30, "the redirected delivery to fail", || async { retry_count(&c, id).await >= 1 }).await;
    let (published, _, _, _, last_error) = row_state(&c, id).await;
    assert!(!published, "a 3xx answer is not a delivery");
    let last_error = last_error.expect("last_error");
    assert!(last_error.contains("302"), "{last_error}");
    assert_eq!(landed.load(Ordering::SeqCst), 0, "the redirect is not followed");
    let log = relay.log();
    for secret in ["hunter2", "abc123"] {
        assert!(!log.contains(secret), "the log shows {secret}:\n{log}");
        assert!(!last_error.contains(secret), "last_error shows {secret}: {last_error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_hanging_delivery_exits_after_the_grace_and_releases_the_event() {
    let db = TestDb::new("relay_grace").await;
    let c = db.client().await;
    let (hook, url) = start_hook(HOOK_HANG).await;
    let mut relay = Relay::start(&db, &["--sink", &url, "--webhook-timeout", "60s", "--shutdown-grace", "500ms"]).await;
    let id = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    support::eventually(30, "the webhook to receive the event", || async { !hook.attempts(id).is_empty() }).await;
    relay.sigterm();
    // Liveness: far below the 60 s webhook timeout, the process is gone.
    let status = relay.wait().await;
    assert!(status.success(), "exit status {status}; stderr:\n{}", relay.log());
    let (published, retries, _, _, _) = row_state(&c, id).await;
    assert!(!published, "the unfinished delivery is not published");
    assert_eq!(retries, 0, "and not charged a failure: it is released for the next relay");
    assert!(relay.log().contains("released"), "the log says so:\n{}", relay.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_stdout_stops_the_relay_without_failing_events() {
    let db = TestDb::new("relay_epipe").await;
    let c = db.client().await;
    let mut relay =
        relay_proc::start_spec(relay(&db, &["--sink", "stdout", "--sweep-interval", "200ms"]).stdout(Output::Piped))
            .await;
    let mut out = BufReader::new(relay.stdout.take().expect("stdout")).lines();
    support::insert_seed_events(&c, Uuid::new_v4(), 1).await;
    let first = tokio::time::timeout(LIVENESS, out.next_line()).await.expect("a line").expect("read").expect("line");
    assert!(first.starts_with('{'));
    // The reader goes away, like `pg-outbox relay | head -1`.
    drop(out);
    support::insert_seed_events(&c, Uuid::new_v4(), 3).await;
    let status = relay.wait().await;
    let stderr = relay.log();
    assert!(!status.success(), "a relay whose stdout is gone exits non-zero; stderr:\n{stderr}");
    assert!(stderr.contains("standard output was closed"), "{stderr}");
    let failed: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE retry_count > 0", &[]).await.expect("q").get(0);
    assert_eq!(failed, 0, "no event was charged a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_stdout_reader_that_stopped_reading_exits_after_the_grace() {
    let db = TestDb::new("relay_stuck_stdout").await;
    let c = db.client().await;
    // 300 events of ~8 KB: far more than a pipe holds, and nobody reads.
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'a', gen_random_uuid(), 'E', jsonb_build_object('note', repeat('x', 8000)) \
         FROM generate_series(1, 300)",
    )
    .await
    .expect("insert a backlog");
    let mut relay = Relay::start(&db, &["--sink", "stdout", "--shutdown-grace", "1s"]).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stopped = tokio::time::Instant::now();
    relay.sigterm();
    let status = relay.wait().await;
    let took = stopped.elapsed();
    // Liveness, not timing: without the grace the relay would wait forever.
    assert!(took < Duration::from_secs(15), "exit took {took:?}; stderr:\n{}", relay.log());
    assert!(status.success(), "exit status {status}; stderr:\n{}", relay.log());
    let (unpublished, failed): (i64, i64) = {
        let r = c
            .query_one(
                "SELECT count(*) FILTER (WHERE published_at IS NULL), count(*) FILTER (WHERE retry_count > 0) \
                 FROM events.outbox",
                &[],
            )
            .await
            .expect("count");
        (r.get(0), r.get(1))
    };
    assert!(unpublished > 0, "events nobody read are not published");
    assert_eq!(failed, 0, "and not charged a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_exits_at_once_and_loses_nothing() {
    let db = TestDb::new("relay_second_signal").await;
    let c = db.client().await;
    let (hook, url) = start_hook(HOOK_HANG).await;
    let mut relay = Relay::start(&db, &["--sink", &url, "--sink-timeout", "60s", "--shutdown-grace", "60s"]).await;
    let id = support::insert_seed_events(&c, Uuid::new_v4(), 1).await[0];
    support::eventually(30, "the webhook to receive the event", || async { !hook.attempts(id).is_empty() }).await;
    relay.sigterm();
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.sigterm();
    // Liveness: far below the 60 s grace, the process is gone.
    let status = relay.wait().await;
    assert_eq!(status.code(), Some(130), "exit status {status}; stderr:\n{}", relay.log());
    let (published, retries, _, _, _) = row_state(&c, id).await;
    assert!(!published && retries == 0, "the event in hand stays unpublished, uncharged, for the next relay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_stdout_stops_the_relay_without_failing_events() {
    let db = TestDb::new("relay_enospc").await;
    let c = db.client().await;
    support::insert_seed_events(&c, Uuid::new_v4(), 3).await;
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("open /dev/full");
    let mut relay = relay(&db, &["--sink", "stdout"])
        .stdout(Output::To(Stdio::from(full)))
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let status = relay.wait().await;
    let stderr = relay.log();
    assert!(!status.success(), "a relay that cannot write its stdout exits non-zero; stderr:\n{stderr}");
    assert!(stderr.contains("cannot write to standard output"), "{stderr}");
    let (published, failed): (i64, i64) = {
        let r = c
            .query_one(
                "SELECT count(*) FILTER (WHERE published_at IS NOT NULL), count(*) FILTER (WHERE retry_count > 0) \
                 FROM events.outbox",
                &[],
            )
            .await
            .expect("count");
        (r.get(0), r.get(1))
    };
    assert_eq!((published, failed), (0, 0), "nothing published, nothing charged a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdout_pipe_gets_whole_lines_and_the_inherited_pipe_stays_blocking() {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    let db = TestDb::new("relay_pipe").await;
    let c = db.client().await;
    let agg = Uuid::new_v4();
    // A line several times the pipe's capacity (64 KiB on Linux): written
    // in parts as the reader drains it.
    let big = "x".repeat(300_000);
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('pipe', $1, 'Big', jsonb_build_object('data', $2::text))",
        &[&agg, &big],
    )
    .await
    .expect("insert the big event");
    support::insert_seed_events(&c, agg, 2).await;
    // The test keeps the write end: the relay's stdout shares its open file
    // description, as a shell's pipeline does with its members.
    let (reader, writer) = std::io::pipe().expect("pipe");
    let child = relay(&db, &["--sink", "stdout", "--sweep-interval", "200ms"])
        .stdout(Output::To(Stdio::from(writer.try_clone().expect("clone the write end"))))
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let lines = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(reader).lines().take(3).collect::<std::io::Result<Vec<String>>>()
    });
    let lines = tokio::time::timeout(LIVENESS, lines).await.expect("three lines").expect("join").expect("read");
    let first: Value = serde_json::from_str(&lines[0]).expect("the big line is one JSON object");
    assert_eq!(first["payload"]["data"].as_str().map(str::len), Some(big.len()), "the big payload arrives whole");
    for line in &lines[1..] {
        let v: Value = serde_json::from_str(line).expect("JSON line");
        assert_eq!(v["aggregate_id"], json!(agg.to_string()));
    }
    // The fast path was taken: besides its fd 1, the relay holds a second
    // descriptor of the same pipe (its own reopened description).
    let pipe = std::fs::read_link(format!("/proc/self/fd/{}", writer.as_raw_fd())).expect("our pipe's name");
    let pid = child.pid().expect("relay runs");
    let same_pipe = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the relay's descriptors")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| *target == pipe)
        .count();
    assert!(same_pipe >= 2, "the relay writes through its own reopened pipe ({same_pipe} descriptor(s) of {pipe:?})");
    // SAFETY: F_GETFL on a descriptor this test owns.
    let flags = unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_GETFL) };
    assert!(flags >= 0, "fcntl: {}", std::io::Error::last_os_error());
    assert_eq!(flags & libc::O_NONBLOCK, 0, "the relay left the pipe it inherited in blocking mode");
    drop(child);
}

//! Faults injected for real. The fault suite: a producer load through real
//! `pg-outbox relay` processes into a webhook served by the test, with one
//! injected fault per test:
//!
//! - `kill -9` of the relay (restarted each time), alone and with a hot standby;
//! - a PostgreSQL restart (`pg_ctl restart -m fast`) on a throwaway server;
//! - `pg_terminate_backend` of the LISTEN connection, and of the work connection;
//! - a long transaction holding an early id of one aggregate open;
//! - a sink that hangs past the webhook timeout, and one that answers HTTP 500.
//!
//! Each test uses a fixed RNG seed (producers' choices and fault points) and
//! prints one summary line:
//! `fault=<kind> faults=<n> events=<committed> lost=<n> duplicates=<n> published_without_delivery=<n> order_violations=<n>`
//!
//! What the webhook "received" is the 2xx-answered requests only; a request
//! answered 500, or one held past the relay's timeout, is an attempt, not a
//! delivery. Checked in every test: every committed event received at least
//! once; no rolled-back event ever sent; no row published that the webhook
//! did not receive; per aggregate, first receptions in increasing id order;
//! duplicates (receptions of an id already received) zero, or bounded by the
//! relay's in-flight window for faults that can cause them; and all committed
//! rows end published.
//!
//! Last, the library's consumer alone: its work connection terminated
//! mid-stream loses nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};
use uuid::Uuid;

use pg_outbox_testkit::TempServer;

use crate::consumer::{next, start};
use crate::support::{self, TestDb};
use pg_outbox_testkit::process::{self, LIVENESS};

/// Committed events per test (producers stop once they reach it).
pub(crate) const EVENTS: usize = 2000;
/// Committed events in the hanging-sink test (one request in 50 hangs).
const HANG_EVENTS: usize = 1500;
/// Producer tasks per test.
const PRODUCERS: usize = 4;
/// Aggregates the producers write.
const AGGREGATES: usize = 8;
/// The relay's `--batch-size` (its default); its in-flight window is about
/// twice this (the stream's buffer) plus the event in hand.
pub(crate) const BATCH: usize = 50;
/// Largest pause between a producer's transactions, in ms (spreads the load
/// over a few seconds so faults land mid-stream).
const PACE_MS: u64 = 16;
/// Liveness bound for the whole outbox to end published after the load.
const DRAIN_LIVENESS: Duration = Duration::from_secs(90);

const AGGREGATE_TYPE: &str = "subscription";
const EVENT_TYPE: &str = "FaultSuiteEvent";
/// The seed's plain INSERT, as a producer that knows nothing of pg-outbox writes it.
const SEED_INSERT: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                           VALUES ($1, $2, $3, $4) RETURNING id";
/// What the relay logs when it takes the outbox lock (`--mode single`).
pub(crate) const ACTIVE: &str = "active: this consumer holds the outbox lock";
/// What a hot standby logs.
pub(crate) const STANDBY: &str = "standby: another consumer holds the outbox lock";
/// The keys of a sink record, exactly.
const RECORD_KEYS: [&str; 7] =
    ["aggregate_id", "aggregate_type", "event_type", "id", "occurred_at", "payload", "retry_count"];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------- the webhook

/// How the test webhook answers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Behavior {
    /// 200 to everything.
    Ok,
    /// Every `every`-th request (over all requests) is held for `hang`
    /// before its (too late) 200.
    HangEvery { every: u64, hang: Duration },
    /// The first attempt of every `every`-th distinct id gets HTTP 500.
    FailFirstAttemptOfEvery { every: u64 },
}

/// Status recorded for a request held past the relay's timeout: not a delivery.
const HUNG: u16 = 0;

/// One request the webhook got, in arrival order.
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    pub(crate) id: i64,
    aggregate: Uuid,
    retry_count: i64,
    /// The leadership term it was sent under.
    term: i64,
    /// Which relay process sent it (each relay gets its own URL path).
    relay: u32,
    status: u16,
    pub(crate) at: Instant,
}

impl Attempt {
    pub(crate) fn delivered(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

#[derive(Debug, Default)]
struct SinkLog {
    attempts: Vec<Attempt>,
    requests: u64,
    distinct: HashSet<i64>,
    malformed: Vec<String>,
}

#[derive(Clone)]
pub(crate) struct Sink {
    behavior: Behavior,
    log: Arc<Mutex<SinkLog>>,
    base: String,
}

/// `(id, aggregate_id, retry_count)` of a sink record, checking its keys.
/// A record's id, aggregate, retry count and leadership term (every relay
/// here runs in single mode, so every record carries one).
fn parse_record(body: &[u8]) -> Result<(i64, Uuid, i64, i64), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON ({e})"))?;
    let obj = v.as_object().ok_or_else(|| format!("not an object: {v}"))?;
    let keys: Vec<&str> =
        obj.keys().map(String::as_str).filter(|k| *k != "term").collect::<BTreeSet<_>>().into_iter().collect();
    let term = obj.get("term").and_then(Value::as_i64).ok_or_else(|| format!("no term: {v}"))?;
    if keys != RECORD_KEYS {
        return Err(format!("keys {keys:?}: {v}"));
    }
    let id = obj["id"].as_i64().ok_or_else(|| format!("id: {v}"))?;
    let agg = obj["aggregate_id"].as_str().and_then(|s| Uuid::parse_str(s).ok()).ok_or_else(|| format!("agg: {v}"))?;
    let retry_count = obj["retry_count"].as_i64().ok_or_else(|| format!("retry_count: {v}"))?;
    if obj["aggregate_type"] != AGGREGATE_TYPE || obj["event_type"] != EVENT_TYPE {
        return Err(format!("aggregate_type/event_type: {v}"));
    }
    Ok((id, agg, retry_count, term))
}

impl Sink {
    pub(crate) async fn start(behavior: Behavior) -> Sink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the test webhook");
        let addr = listener.local_addr().expect("webhook address");
        let sink = Sink { behavior, log: Arc::default(), base: format!("http://{addr}/hook") };
        let app =
            axum::Router::new().route("/hook/{relay}", axum::routing::post(hook_handler)).with_state(sink.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("test webhook stopped: {e}");
            }
        });
        sink
    }

    pub(crate) fn url_for(&self, relay: u32) -> String {
        format!("{}/{relay}", self.base)
    }

    /// Record a request and decide its answer (status, and how long to hold it).
    fn record(&self, relay: u32, body: &[u8]) -> (u16, Option<Duration>) {
        let mut log = lock(&self.log);
        log.requests += 1;
        let n = log.requests;
        let (id, aggregate, retry_count, term) = match parse_record(body) {
            Ok(r) => r,
            Err(e) => {
                log.malformed.push(e);
                return (400, None);
            }
        };
        let first = log.distinct.insert(id);
        let distinct = log.distinct.len() as u64;
        let (status, hold) = match self.behavior {
            Behavior::Ok => (200, None),
            Behavior::HangEvery { every, hang } if n.is_multiple_of(every) => (HUNG, Some(hang)),
            Behavior::HangEvery { .. } => (200, None),
            Behavior::FailFirstAttemptOfEvery { every } if first && distinct.is_multiple_of(every) => (500, None),
            Behavior::FailFirstAttemptOfEvery { .. } => (200, None),
        };
        log.attempts.push(Attempt { id, aggregate, retry_count, term, relay, status, at: Instant::now() });
        (status, hold)
    }

    pub(crate) fn attempts(&self) -> Vec<Attempt> {
        lock(&self.log).attempts.clone()
    }

    fn malformed(&self) -> Vec<String> {
        lock(&self.log).malformed.clone()
    }

    /// When relay `relay` first got a 2xx at or after `since`, if it did.
    pub(crate) fn first_delivery_by(&self, relay: u32, since: Instant) -> Option<Instant> {
        lock(&self.log).attempts.iter().find(|a| a.relay == relay && a.delivered() && a.at >= since).map(|a| a.at)
    }
}

async fn hook_handler(State(sink): State<Sink>, Path(relay): Path<u32>, body: Bytes) -> (StatusCode, &'static str) {
    match sink.record(relay, &body) {
        (_, Some(hold)) => {
            tokio::time::sleep(hold).await;
            (StatusCode::OK, "too late")
        }
        (200, None) => (StatusCode::OK, "ok"),
        (500, None) => (StatusCode::INTERNAL_SERVER_ERROR, "injected failure"),
        (_, None) => (StatusCode::BAD_REQUEST, "malformed record"),
    }
}

// ---------------------------------------------------------------- relay processes

/// Relay number `n` of a test (the kit's process), and whether it should be running.
pub(crate) struct RelayProc {
    pub(crate) n: u32,
    proc: process::RelayProc,
    pub(crate) alive: bool,
}

impl RelayProc {
    /// Start relay number `n` delivering to the sink's URL for `n`; wait until
    /// it says it started.
    async fn start(db_url: &str, sink: &Sink, n: u32, args: &[String]) -> RelayProc {
        let spec = process::Relay::new(support::bin()).url(db_url).args(&["--sink".to_string(), sink.url_for(n)]);
        RelayProc::start_spec(n, spec.args(args)).await
    }

    /// Start `spec` as relay number `n`; wait until it says it started.
    pub(crate) async fn start_spec(n: u32, spec: process::Relay) -> RelayProc {
        let proc = spec.start().await.unwrap_or_else(|e| panic!("relay {n}: {e}"));
        RelayProc { n, proc, alive: true }
    }

    /// Send `signal` (SIGSTOP, SIGCONT, ...).
    pub(crate) fn signal(&self, signal: libc::c_int) {
        self.proc.send(signal).unwrap_or_else(|e| panic!("relay {}: {e}", self.n));
    }

    pub(crate) fn log(&self) -> String {
        self.proc.log()
    }

    fn is_active(&self) -> bool {
        self.alive && self.log().contains(ACTIVE)
    }

    /// Wait until the relay's stderr holds one of `needles`.
    pub(crate) async fn wait_log(&mut self, needles: &[&str]) {
        let n = self.n;
        self.proc.wait_log(needles, LIVENESS).await.unwrap_or_else(|e| panic!("relay {n}: {e}"));
    }

    /// If the relay exited without the test killing it, say how.
    async fn unexpected_exit(&mut self) -> Option<String> {
        if !self.alive {
            return None;
        }
        let status = self.proc.exited().await.expect("poll the relay process")?;
        self.alive = false;
        let log = self.log();
        let why = if log.contains("shutting down") {
            "it got SIGINT/SIGTERM, which this test never sends"
        } else {
            "it stopped by itself"
        };
        Some(format!("relay {} exited unexpectedly ({status}): {why}", self.n))
    }

    /// `kill -9` the relay and reap it; returns the instant of the kill.
    pub(crate) async fn kill9(&mut self) -> Instant {
        let at = Instant::now();
        let status = self.proc.kill().await.unwrap_or_else(|e| panic!("relay {}: {e}", self.n));
        assert_eq!(status.signal(), Some(libc::SIGKILL), "relay {} died of SIGKILL ({status})", self.n);
        self.alive = false;
        at
    }
}

// ---------------------------------------------------------------- producers

/// What the producers did, by event id.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// COMMIT acknowledged.
    pub(crate) committed: Vec<(i64, Uuid)>,
    /// Rolled back on purpose, or failed before COMMIT was sent.
    pub(crate) rolled_back: Vec<(i64, Uuid)>,
    /// COMMIT sent, outcome unknown (the connection broke): committed iff the row exists.
    pub(crate) uncertain: Vec<(i64, Uuid)>,
    transactions: usize,
    /// Transactions retried after an error.
    retries: usize,
}

impl Ledger {
    /// The ids committed (with their aggregates) and rolled back: a COMMIT
    /// whose outcome is unknown counts as committed iff its row exists.
    pub(crate) async fn resolve(&self, c: &Client) -> (BTreeMap<i64, Uuid>, BTreeSet<i64>) {
        let uncertain_ids: Vec<i64> = self.uncertain.iter().map(|(id, _)| *id).collect();
        let existing: HashSet<i64> = c
            .query("SELECT id FROM events.outbox WHERE id = ANY($1)", &[&uncertain_ids])
            .await
            .expect("look up uncertain ids")
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut committed: BTreeMap<i64, Uuid> = self.committed.iter().copied().collect();
        let mut rolled_back: BTreeSet<i64> = self.rolled_back.iter().map(|(id, _)| *id).collect();
        for (id, agg) in &self.uncertain {
            if existing.contains(id) {
                committed.insert(*id, *agg);
            } else {
                rolled_back.insert(*id);
            }
        }
        (committed, rolled_back)
    }

    fn merge(&mut self, other: Ledger) {
        self.committed.extend(other.committed);
        self.rolled_back.extend(other.rolled_back);
        self.uncertain.extend(other.uncertain);
        self.transactions += other.transactions;
        self.retries += other.retries;
    }
}

enum Outcome {
    Committed(Vec<(i64, Uuid)>),
    RolledBack(Vec<(i64, Uuid)>),
    /// Failed before COMMIT was sent: nothing of it can be committed.
    Failed(Vec<(i64, Uuid)>),
    /// COMMIT sent, no acknowledgement.
    Unknown(Vec<(i64, Uuid)>),
}

/// Connect with `application_name = app`, retrying for up to `patience`.
pub(crate) async fn connect(url: &str, app: &str, patience: Duration) -> Client {
    let mut cfg: tokio_postgres::Config = url.parse().expect("database URL parses");
    cfg.application_name(app).connect_timeout(Duration::from_secs(5));
    let deadline = Instant::now() + patience;
    loop {
        match cfg.connect(NoTls).await {
            Ok((client, conn)) => {
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                return client;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot connect as {app} within {patience:?}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Connect through pg-outbox (`ConnectOptions::connect_primary`: every host
/// of a multi-host URL in turn, a standby refused) with `application_name =
/// app`, retrying for up to `patience`.
async fn connect_primary(url: &str, app: &str, patience: Duration) -> Client {
    let opts = pg_outbox::ConnectOptions::parse(url).expect("database URL parses").with_application_name(app);
    let deadline = Instant::now() + patience;
    loop {
        match opts.connect_primary().await {
            Ok(client) => return client,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "cannot connect as {app} within {patience:?}: {}",
                    pg_outbox::error::report(&e)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One transaction: BEGIN, an INSERT for each aggregate (the seed's, or
/// `Publisher::publish` with `publisher`; some followed by a small sleep),
/// then COMMIT or ROLLBACK.
async fn run_transaction(
    client: &mut Client,
    tag: (usize, usize),
    aggs: &[Uuid],
    sleeps: &[u64],
    rollback: bool,
    publisher: bool,
) -> Outcome {
    let mut ids = Vec::with_capacity(aggs.len());
    let Ok(tx) = client.transaction().await else { return Outcome::Failed(ids) };
    for (k, (agg, pause)) in aggs.iter().zip(sleeps).enumerate() {
        let payload = json!({"version": 1, "data": {"producer": tag.0, "tx": tag.1, "n": k}});
        let inserted = if publisher {
            let event = pg_outbox::NewEvent::new(AGGREGATE_TYPE, *agg, EVENT_TYPE, payload);
            pg_outbox::Publisher::new().publish(&tx, &event).await.ok()
        } else {
            tx.query_one(SEED_INSERT, &[&AGGREGATE_TYPE, agg, &EVENT_TYPE, &payload]).await.ok().map(|r| r.get(0))
        };
        match inserted {
            Some(id) => ids.push((id, *agg)),
            None => return Outcome::Failed(ids), // dropping tx rolls it back
        }
        if *pause > 0 {
            tokio::time::sleep(Duration::from_millis(*pause)).await;
        }
    }
    if rollback {
        let _ = tx.rollback().await;
        return Outcome::RolledBack(ids);
    }
    match tx.commit().await {
        Ok(()) => Outcome::Committed(ids),
        Err(_) => Outcome::Unknown(ids),
    }
}

/// An aggregate producers must not pick while `flag` is set.
#[derive(Clone)]
struct Avoid {
    aggregate: Uuid,
    flag: Arc<AtomicBool>,
}

#[derive(Clone)]
pub(crate) struct LoadSpec {
    url: String,
    seed: u64,
    pub(crate) events: usize,
    producers: usize,
    pub(crate) aggregates: Vec<Uuid>,
    avoid: Option<Avoid>,
    /// Publish through pg-outbox (`ConnectOptions::connect_primary` and
    /// `Publisher`) instead of the seed's plain INSERT on a tokio-postgres
    /// connection.
    pub(crate) publisher: bool,
    /// Largest pause between a producer's transactions, in ms.
    pub(crate) pace_ms: u64,
}

/// A producer: transactions of 1–3 events on random aggregates (inserted in
/// a fixed aggregate order, so producers never deadlock), one in ten rolled
/// back, until `quota` events are committed. On an error it reconnects if
/// needed and retries the transaction.
async fn producer(spec: Arc<LoadSpec>, idx: usize, quota: usize, progress: Arc<AtomicUsize>) -> Ledger {
    let mut rng = StdRng::seed_from_u64(spec.seed.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(idx as u64 + 1)));
    let mut ledger = Ledger::default();
    let app = format!("fault-suite producer {idx}");
    let open = || async {
        if spec.publisher {
            connect_primary(&spec.url, &app, Duration::from_secs(60)).await
        } else {
            connect(&spec.url, &app, Duration::from_secs(60)).await
        }
    };
    let mut client = open().await;
    let mut done = 0;
    let mut txn = 0;
    while done < quota {
        let n = rng.random_range(1..=3usize);
        let mut picks: Vec<usize> = (0..n).map(|_| rng.random_range(0..spec.aggregates.len())).collect();
        picks.sort_unstable();
        let mut aggs: Vec<Uuid> = picks.iter().map(|&i| spec.aggregates[i]).collect();
        let sleeps: Vec<u64> =
            (0..n).map(|_| if rng.random_bool(0.15) { rng.random_range(1..=5) } else { 0 }).collect();
        let rollback = rng.random_bool(0.1);
        let pace = rng.random_range(0..=spec.pace_ms);
        if let Some(avoid) = &spec.avoid
            && avoid.flag.load(Ordering::SeqCst)
        {
            aggs.retain(|a| *a != avoid.aggregate);
            if aggs.is_empty() {
                tokio::time::sleep(Duration::from_millis(pace)).await;
                continue;
            }
        }
        txn += 1;
        ledger.transactions += 1;
        loop {
            if client.is_closed() {
                client = open().await;
            }
            match run_transaction(&mut client, (idx, txn), &aggs, &sleeps, rollback, spec.publisher).await {
                Outcome::Committed(ids) => {
                    done += ids.len();
                    progress.fetch_add(ids.len(), Ordering::SeqCst);
                    ledger.committed.extend(ids);
                    break;
                }
                Outcome::RolledBack(ids) => {
                    ledger.rolled_back.extend(ids);
                    break;
                }
                Outcome::Failed(ids) => ledger.rolled_back.extend(ids),
                Outcome::Unknown(ids) => ledger.uncertain.extend(ids),
            }
            ledger.retries += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(pace)).await;
    }
    ledger
}

/// Producers running in the background.
pub(crate) struct Load {
    progress: Arc<AtomicUsize>,
    tasks: Vec<JoinHandle<Ledger>>,
    pub(crate) events: usize,
}

impl Load {
    pub(crate) fn spawn(spec: LoadSpec) -> Load {
        let progress = Arc::new(AtomicUsize::new(0));
        let events = spec.events;
        let producers = spec.producers;
        let spec = Arc::new(spec);
        let tasks = (0..producers)
            .map(|i| {
                let quota = events / producers + usize::from(i < events % producers);
                tokio::spawn(producer(spec.clone(), i, quota, progress.clone()))
            })
            .collect();
        Load { progress, tasks, events }
    }

    /// Events committed so far.
    pub(crate) fn committed(&self) -> usize {
        self.progress.load(Ordering::SeqCst)
    }

    /// Wait until at least `n` events are committed.
    pub(crate) async fn reached(&self, n: usize) {
        let deadline = Instant::now() + DRAIN_LIVENESS;
        while self.progress.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "producers stuck at {} committed events (waiting for {n})",
                self.progress.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    pub(crate) async fn join(self) -> Ledger {
        let mut all = Ledger::default();
        for t in self.tasks {
            all.merge(tokio::time::timeout(DRAIN_LIVENESS, t).await.expect("producers finish").expect("producer"));
        }
        all
    }
}

/// `k` points of the load (in committed events), one in each of `k` equal
/// slices of its middle 80 %.
pub(crate) fn fault_points(rng: &mut StdRng, events: usize, k: usize) -> Vec<usize> {
    (0..k)
        .map(|i| {
            let lo = events as f64 * (0.1 + 0.8 * i as f64 / k as f64);
            let hi = events as f64 * (0.1 + 0.8 * (i + 1) as f64 / k as f64);
            rng.random_range(lo as usize..(hi as usize).max(lo as usize + 1))
        })
        .collect()
}

fn aggregates(rng: &mut StdRng) -> Vec<Uuid> {
    (0..AGGREGATES).map(|_| Uuid::from_u128(rng.random::<u128>())).collect()
}

// ---------------------------------------------------------------- the checks

/// How many faults a test injected: counted by the test, or the webhook's
/// answers with a given status (counted once the outbox is drained).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Faults {
    Injected(usize),
    SinkAnswers(u16),
}

/// The counts a test reports and asserts on.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) kind: &'static str,
    pub(crate) faults: usize,
    pub(crate) events: usize,
    pub(crate) lost: usize,
    pub(crate) duplicates: usize,
    pub(crate) published_without_delivery: usize,
    pub(crate) order_violations: usize,
    /// Deliveries of an aggregate under a lower term than one already
    /// delivered for it: a deposed relay's send that arrived late (only a
    /// send already in hand when the relay was deposed can; the fencing
    /// keeps it from handing out more). Reported, for the record.
    pub(crate) term_regressions: usize,
    pub(crate) rolled_back: usize,
    pub(crate) rolled_back_sent: usize,
    pub(crate) unknown_sent: usize,
    pub(crate) aggregate_mismatches: usize,
    pub(crate) rows_not_committed: usize,
    pub(crate) uncertain: usize,
    pub(crate) attempts: usize,
    pub(crate) not_delivered_attempts: usize,
    pub(crate) retries: usize,
    pub(crate) examples: Vec<String>,
    /// Every attempt of the first aggregate whose order was violated.
    pub(crate) trace: String,
}

impl Report {
    fn summary(&self) -> String {
        format!(
            "fault={} faults={} events={} lost={} duplicates={} published_without_delivery={} order_violations={} \
             term_regressions={}",
            self.kind,
            self.faults,
            self.events,
            self.lost,
            self.duplicates,
            self.published_without_delivery,
            self.order_violations,
            self.term_regressions
        )
    }
}

pub(crate) struct Harness {
    kind: &'static str,
    seed: u64,
    url: String,
    pub(crate) sink: Sink,
    args: Vec<String>,
    pub(crate) relays: Vec<RelayProc>,
    started: Instant,
}

impl Harness {
    pub(crate) async fn new(kind: &'static str, seed: u64, url: String, behavior: Behavior, extra: &[&str]) -> Harness {
        let mut args: Vec<String> =
            ["--mode", "single", "--batch-size", &BATCH.to_string(), "--retry-schedule", "100ms"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        Harness {
            kind,
            seed,
            url,
            sink: Sink::start(behavior).await,
            args,
            relays: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Start one more relay; returns its index in `relays`.
    pub(crate) async fn start_relay(&mut self) -> usize {
        let n = u32::try_from(self.relays.len() + 1).expect("few relays");
        let relay = RelayProc::start(&self.url, &self.sink, n, &self.args).await;
        self.relays.push(relay);
        self.relays.len() - 1
    }

    /// Fail the test if a relay exited that the test did not kill.
    pub(crate) async fn assert_relays_running(&mut self) {
        assert_running(self.kind, &mut self.relays.iter_mut().collect::<Vec<_>>()).await;
    }

    /// The relays' stderr (the end of it), for failure messages.
    pub(crate) fn logs(&self) -> String {
        logs(self.relays.iter())
    }

    /// Wait for the outbox to end published, then check everything against
    /// the producers' ledger and the webhook's log; print the summary line.
    pub(crate) async fn finish(&mut self, faults: Faults, ledger: Ledger) -> Report {
        let c = connect(&self.url, "fault-suite checker", Duration::from_secs(60)).await;
        let (committed, rolled_back) = ledger.resolve(&c).await;
        let drained_in = wait_drained(&c, self.kind, self.seed, &mut self.relays.iter_mut().collect::<Vec<_>>()).await;

        // The rows first, then the webhook's log: a published row was
        // acknowledged after its 2xx, so its delivery is in the log by now.
        let rows: Vec<(i64, Uuid, bool)> = c
            .query("SELECT id, aggregate_id, published_at IS NOT NULL FROM events.outbox ORDER BY id", &[])
            .await
            .expect("read outbox rows")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let attempts = self.sink.attempts();
        let row_agg: HashMap<i64, Uuid> = rows.iter().map(|(id, agg, _)| (*id, *agg)).collect();

        let faults = match faults {
            Faults::Injected(n) => n,
            Faults::SinkAnswers(status) => attempts.iter().filter(|a| a.status == status).count(),
        };
        let mut report = Report {
            kind: self.kind,
            faults,
            events: committed.len(),
            rolled_back: rolled_back.len(),
            uncertain: ledger.uncertain.len(),
            attempts: attempts.len(),
            retries: ledger.retries,
            ..Report::default()
        };
        let mut received: HashSet<i64> = HashSet::new();
        // Per aggregate: highest id received so far, and highest term.
        let mut high: HashMap<Uuid, i64> = HashMap::new();
        let mut high_term: HashMap<Uuid, i64> = HashMap::new();
        let mut first_violated: Option<Uuid> = None;
        for a in &attempts {
            if rolled_back.contains(&a.id) {
                report.rolled_back_sent += 1;
                report.examples.push(format!("rolled-back id {} sent by relay {}", a.id, a.relay));
            } else if !row_agg.contains_key(&a.id) {
                report.unknown_sent += 1;
                report.examples.push(format!("unknown id {} sent by relay {}", a.id, a.relay));
            }
            if row_agg.get(&a.id).is_some_and(|agg| *agg != a.aggregate) {
                report.aggregate_mismatches += 1;
            }
            if !a.delivered() {
                report.not_delivered_attempts += 1;
                continue;
            }
            let t = high_term.entry(a.aggregate).or_insert(a.term);
            if a.term < *t {
                report.term_regressions += 1;
            }
            *t = (*t).max(a.term);
            if !received.insert(a.id) {
                report.duplicates += 1;
                continue;
            }
            let h = high.entry(a.aggregate).or_insert(i64::MIN);
            if a.id < *h {
                report.order_violations += 1;
                first_violated.get_or_insert(a.aggregate);
                if report.examples.len() < 20 {
                    report.examples.push(format!(
                        "order: id {} of {} first received after id {} (relay {})",
                        a.id, a.aggregate, *h, a.relay
                    ));
                }
            }
            *h = (*h).max(a.id);
        }
        if let Some(agg) = first_violated {
            let t0 = attempts.first().map_or(self.started, |a| a.at);
            let lines: Vec<String> = attempts
                .iter()
                .filter(|a| a.aggregate == agg)
                .map(|a| {
                    format!(
                        "{:>8.3}s id={} status={} retry_count={} term={} relay={}",
                        a.at.duration_since(t0).as_secs_f64(),
                        a.id,
                        a.status,
                        a.retry_count,
                        a.term,
                        a.relay
                    )
                })
                .collect();
            report.trace = format!("attempts of aggregate {agg}, in arrival order:\n{}", lines.join("\n"));
        }
        report.lost = committed.keys().filter(|id| !received.contains(id)).count();
        report.published_without_delivery =
            rows.iter().filter(|(id, _, published)| *published && !received.contains(id)).count();
        report.rows_not_committed = rows.iter().filter(|(id, _, _)| !committed.contains_key(id)).count();
        println!("{}", report.summary());
        println!(
            "fault={} seed={:#x} detail: rolled_back={} uncertain_commits={} producer_retries={} attempts={} \
             non_2xx_attempts={} relays_started={} drained_after_load={:?} test_time={:?}",
            self.kind,
            self.seed,
            report.rolled_back,
            report.uncertain,
            report.retries,
            report.attempts,
            report.not_delivered_attempts,
            self.relays.len(),
            drained_in,
            self.started.elapsed()
        );
        report
    }

    /// The assertions every test makes; `max_duplicates` is 0 for faults
    /// that cannot cause duplicates.
    pub(crate) fn check(&self, r: &Report, max_duplicates: usize) {
        let ctx = || {
            format!(
                "{} (seed {:#x})\nexamples: {:#?}\n{}\n{}",
                r.summary(),
                self.seed,
                r.examples,
                r.trace,
                self.logs()
            )
        };
        let malformed = self.sink.malformed();
        assert!(malformed.is_empty(), "malformed webhook bodies: {malformed:?}");
        assert!(r.events > 0 && r.faults > 0, "a load ran and a fault was injected: {}", ctx());
        assert_eq!(r.lost, 0, "committed events never delivered: {}", ctx());
        assert_eq!(r.rolled_back_sent, 0, "rolled-back events were sent: {}", ctx());
        assert_eq!(r.unknown_sent, 0, "ids that are not in the outbox were sent: {}", ctx());
        assert_eq!(r.aggregate_mismatches, 0, "records with the wrong aggregate: {}", ctx());
        assert_eq!(r.rows_not_committed, 0, "rows in the outbox that no producer committed: {}", ctx());
        assert_eq!(r.published_without_delivery, 0, "rows published without a 2xx delivery: {}", ctx());
        assert_eq!(r.order_violations, 0, "per-aggregate order violated: {}", ctx());
        assert!(
            r.duplicates <= max_duplicates,
            "{} duplicates, at most {max_duplicates} allowed for this fault: {}",
            r.duplicates,
            ctx()
        );
    }
}

/// Fail the test if one of `relays` exited that the test did not kill.
pub(crate) async fn assert_running(kind: &str, relays: &mut [&mut RelayProc]) {
    let mut exits = Vec::new();
    for r in relays.iter_mut() {
        exits.extend(r.unexpected_exit().await);
    }
    assert!(exits.is_empty(), "fault={kind}: {}\n{}", exits.join("; "), logs(relays.iter().map(|r| &**r)));
}

/// The relays' stderr (the end of it), for failure messages.
pub(crate) fn logs<'a>(relays: impl IntoIterator<Item = &'a RelayProc>) -> String {
    let mut out = String::new();
    for r in relays {
        let log = r.log();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        out.push_str(&format!("--- relay {} (alive: {}) stderr, last lines:\n{tail}\n", r.n, r.alive));
    }
    out
}

/// Liveness: wait until every row of the outbox is published (failing, with
/// the stuck rows and the relays' logs, on a dead letter, an unexpected
/// exit of a relay, or after [`DRAIN_LIVENESS`]); returns how long it took.
pub(crate) async fn wait_drained(c: &Client, kind: &str, seed: u64, relays: &mut [&mut RelayProc]) -> Duration {
    let load_done = Instant::now();
    let deadline = load_done + DRAIN_LIVENESS;
    loop {
        let row = c
            .query_one(
                "SELECT count(*) FILTER (WHERE published_at IS NULL), \
                        count(*) FILTER (WHERE next_retry_at = 'infinity') FROM events.outbox",
                &[],
            )
            .await
            .expect("count unpublished rows");
        let (unpublished, dead): (i64, i64) = (row.get(0), row.get(1));
        if unpublished == 0 {
            return load_done.elapsed();
        }
        assert_running(kind, relays).await;
        if dead > 0 || Instant::now() > deadline {
            let stuck: Vec<String> = c
                .query(
                    "SELECT id, aggregate_id, retry_count, next_retry_at::text, last_error FROM events.outbox \
                     WHERE published_at IS NULL ORDER BY id LIMIT 20",
                    &[],
                )
                .await
                .expect("unpublished rows")
                .iter()
                .map(|r| {
                    format!(
                        "{} {} retry_count={} next_retry_at={:?} last_error={:?}",
                        r.get::<_, i64>(0),
                        r.get::<_, Uuid>(1),
                        r.get::<_, i32>(2),
                        r.get::<_, Option<String>>(3),
                        r.get::<_, Option<String>>(4)
                    )
                })
                .collect();
            panic!(
                "fault={kind} seed={seed:#x}: {unpublished} rows never published ({dead} dead letters) within {:?}:\n{}\n{}",
                DRAIN_LIVENESS,
                stuck.join("\n"),
                logs(relays.iter().map(|r| &**r))
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn load_spec(url: &str, seed: u64, rng: &mut StdRng) -> LoadSpec {
    LoadSpec {
        url: url.to_string(),
        seed,
        events: EVENTS,
        producers: PRODUCERS,
        aggregates: aggregates(rng),
        avoid: None,
        publisher: false,
        pace_ms: PACE_MS,
    }
}

/// Terminate the backends named `app` until at least one was terminated
/// (the relay may be reconnecting at that instant); returns how many.
async fn terminate(db: &TestDb, h: &mut Harness, app: &str) -> i64 {
    let deadline = Instant::now() + LIVENESS;
    loop {
        h.assert_relays_running().await;
        let n = db.terminate(app).await;
        if n > 0 {
            return n;
        }
        assert!(Instant::now() < deadline, "no backend named {app:?} to terminate within {LIVENESS:?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9() {
    const SEED: u64 = 0xFA17_0001;
    const KILLS: usize = 4;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_kill_9").await;
    let mut h = Harness::new("kill_9", SEED, db.url(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, KILLS);
    let mut kills = 0;
    for p in points {
        load.reached(p).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        h.assert_relays_running().await;
        let i = h.relays.iter().position(|r| r.alive).expect("a relay runs");
        h.relays[i].kill9().await;
        kills += 1;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..200))).await;
        h.start_relay().await;
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(kills), ledger).await;
    h.check(&report, 2 * BATCH * kills);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_standby() {
    const SEED: u64 = 0xFA17_0002;
    const KILLS: usize = 3;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_kill_9_standby").await;
    let mut h = Harness::new("kill_9_with_standby", SEED, db.url(), Behavior::Ok, &[]).await;
    let first = h.start_relay().await;
    h.relays[first].wait_log(&[ACTIVE]).await;
    let second = h.start_relay().await;
    h.relays[second].wait_log(&[STANDBY]).await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, KILLS);
    let mut takeovers = Vec::new();
    for p in points {
        load.reached(p).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        h.assert_relays_running().await;
        let active: Vec<usize> = (0..h.relays.len()).filter(|&i| h.relays[i].is_active()).collect();
        assert_eq!(active.len(), 1, "exactly one relay is active: {active:?}\n{}", h.logs());
        let standby: Vec<usize> = (0..h.relays.len()).filter(|&i| h.relays[i].alive && i != active[0]).collect();
        assert_eq!(standby.len(), 1, "exactly one standby\n{}", h.logs());
        let (active, standby) = (active[0], standby[0]);
        let killed_at = h.relays[active].kill9().await;
        // Takeover: from the kill to the standby's first delivery.
        let n = h.relays[standby].n;
        let deadline = Instant::now() + LIVENESS;
        let delivered_at = loop {
            if let Some(at) = h.sink.first_delivery_by(n, killed_at) {
                break at;
            }
            assert!(Instant::now() < deadline, "standby relay {n} never delivered after the kill\n{}", h.logs());
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let takeover = delivered_at.duration_since(killed_at);
        let killed = h.relays[active].n;
        println!(
            "fault=kill_9_with_standby takeover={takeover:?} (kill of relay {killed} to first delivery by relay {n})"
        );
        takeovers.push(takeover);
        h.relays[standby].wait_log(&[ACTIVE]).await;
        let fresh = h.start_relay().await;
        h.relays[fresh].wait_log(&[STANDBY]).await;
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(takeovers.len()), ledger).await;
    let ms: Vec<u128> = takeovers.iter().map(Duration::as_millis).collect();
    println!("fault=kill_9_with_standby takeover_ms={ms:?}");
    h.check(&report, 2 * BATCH * takeovers.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart() {
    const SEED: u64 = 0xFA17_0003;
    const RESTARTS: usize = 2;
    let mut rng = StdRng::seed_from_u64(SEED);
    let server = Arc::new(
        tokio::task::spawn_blocking(TempServer::start)
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {}", pg_outbox::error::report(&e))),
    );
    let admin = connect(&server.url(), "fault-suite admin", LIVENESS).await;
    admin.batch_execute("CREATE DATABASE fault_restart").await.expect("create database");
    drop(admin);
    let url = server.url_for("fault_restart");
    let migrate = support::cli(&["migrate"]).url(&url).run().await;
    assert!(migrate.ok(), "pg-outbox migrate failed: {}", migrate.stderr);

    let mut h = Harness::new("postgres_restart", SEED, url.clone(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&url, SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, RESTARTS);
    let mut restarts = 0;
    for p in points {
        load.reached(p).await;
        let s = server.clone();
        let took = Instant::now();
        tokio::task::spawn_blocking(move || s.restart())
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("restart: {}", pg_outbox::error::report(&e)));
        restarts += 1;
        println!("fault=postgres_restart restart {restarts} took {:?}", took.elapsed());
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(restarts), ledger).await;
    h.check(&report, 0);
    drop(h);
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_terminated() {
    const SEED: u64 = 0xFA17_0004;
    const TERMINATIONS: usize = 4;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_listener").await;
    // A 10 s sweep: only the catch-up after each reconnect finds quickly what
    // was committed while the listener was gone.
    let mut h = Harness::new("listener_terminated", SEED, db.url(), Behavior::Ok, &["--sweep-interval", "10s"]).await;
    h.start_relay().await;
    let spec = load_spec(&db.url(), SEED, &mut rng);
    let aggs = spec.aggregates.clone();
    let load = Load::spawn(spec);
    let mut faults = 0;
    for p in fault_points(&mut rng, load.events, TERMINATIONS) {
        load.reached(p).await;
        terminate(&db, &mut h, "pg-outbox listener").await;
        faults += 1;
    }
    let mut ledger = load.join().await;

    // Once more with the load over: terminate, then commit events at once,
    // in the gap, so no notification of them reaches the relay.
    let c = db.client().await;
    let before: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    support::eventually(60, "the load to be published", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[])
            .await
            .is_ok_and(|r| r.get::<_, i64>(0) == 0)
    })
    .await;
    let terminated_at = Instant::now();
    terminate(&db, &mut h, "pg-outbox listener").await;
    faults += 1;
    let mut gap = Vec::new();
    for (i, agg) in aggs.iter().enumerate() {
        let id: i64 = c
            .query_one(SEED_INSERT, &[&AGGREGATE_TYPE, agg, &EVENT_TYPE, &json!({"gap": i})])
            .await
            .expect("insert in the gap")
            .get(0);
        gap.push((id, *agg));
    }
    let gap_ids: Vec<i64> = gap.iter().map(|(id, _)| *id).collect();
    ledger.committed.extend(gap);
    let deadline = Instant::now() + DRAIN_LIVENESS;
    loop {
        let got: HashSet<i64> = h.sink.attempts().iter().filter(|a| a.delivered()).map(|a| a.id).collect();
        if gap_ids.iter().all(|id| got.contains(id)) {
            break;
        }
        assert!(Instant::now() < deadline, "events committed in the listener gap never delivered\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    println!(
        "fault=listener_terminated gap_catch_up={:?} (terminate to delivery of {} events committed in the gap; \
         sweep interval 10s; {before} events before)",
        terminated_at.elapsed(),
        gap_ids.len()
    );
    let report = h.finish(Faults::Injected(faults), ledger).await;
    h.check(&report, 0);
    let log: String = h.relays.iter().map(RelayProc::log).collect();
    assert!(log.contains("LISTEN connection re-established"), "the relay logged its reconnects:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_connection_terminated() {
    const SEED: u64 = 0xFA17_0005;
    const TERMINATIONS: usize = 4;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_drain").await;
    let mut h = Harness::new("work_connection_terminated", SEED, db.url(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let mut faults = 0;
    for p in fault_points(&mut rng, load.events, TERMINATIONS) {
        load.reached(p).await;
        terminate(&db, &mut h, "pg-outbox drain").await;
        faults += 1;
    }
    let ledger = load.join().await;
    let report = h.finish(Faults::Injected(faults), ledger).await;
    h.check(&report, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_transaction() {
    const SEED: u64 = 0xFA17_0006;
    const HOLD: Duration = Duration::from_secs(3);
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_long_tx").await;
    let mut h = Harness::new("long_transaction", SEED, db.url(), Behavior::Ok, &[]).await;
    h.start_relay().await;
    let mut spec = load_spec(&db.url(), SEED, &mut rng);
    let a = spec.aggregates[0];
    let flag = Arc::new(AtomicBool::new(false));
    // While A's transaction is open the producers leave A alone (a producer
    // that writes A would wait for it: the per-aggregate lock).
    spec.avoid = Some(Avoid { aggregate: a, flag: flag.clone() });
    let load = Load::spawn(spec);
    load.reached(rng.random_range(EVENTS / 5..EVENTS / 3)).await;

    flag.store(true, Ordering::SeqCst);
    let mut long = db.client().await;
    let tx = long.transaction().await.expect("begin");
    let long_id: i64 = tx
        .query_one(SEED_INSERT, &[&AGGREGATE_TYPE, &a, &EVENT_TYPE, &json!({"long": true})])
        .await
        .expect("insert the long transaction's event")
        .get(0);
    let opened = Instant::now();
    // Another writer of A meanwhile: it waits for the long transaction and
    // gets a later id.
    let follower = {
        let url = db.url();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let c = connect(&url, "fault-suite follower", LIVENESS).await;
            let id: i64 = c
                .query_one(SEED_INSERT, &[&AGGREGATE_TYPE, &a, &EVENT_TYPE, &json!({"follower": true})])
                .await
                .expect("insert behind the long transaction")
                .get(0);
            (id, Instant::now())
        })
    };
    tokio::time::sleep(HOLD).await;
    // A relay far behind (a loaded machine) may not have reached ids above
    // the held one yet: keep the transaction open until it has (liveness bound).
    let deadline = Instant::now() + LIVENESS;
    while Instant::now() < deadline
        && !h.sink.attempts().iter().any(|x| x.delivered() && x.aggregate != a && x.id > long_id)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let closing = Instant::now();
    tx.commit().await.expect("commit the long transaction");
    flag.store(false, Ordering::SeqCst);
    let (follower_id, follower_at) = follower.await.expect("follower");
    assert!(follower_id > long_id && follower_at >= closing, "the follower waited for the long transaction");

    let mut ledger = load.join().await;
    ledger.committed.push((long_id, a));
    ledger.committed.push((follower_id, a));
    let report = h.finish(Faults::Injected(1), ledger).await;

    let attempts = h.sink.attempts();
    let during =
        attempts.iter().filter(|x| x.delivered() && x.aggregate != a && x.id > long_id && x.at < closing).count();
    let first_at = |id: i64| attempts.iter().position(|x| x.id == id && x.delivered());
    let long_pos = first_at(long_id).expect("the long transaction's event was delivered");
    let early_a: Vec<i64> =
        attempts[..long_pos].iter().filter(|x| x.aggregate == a && x.id > long_id).map(|x| x.id).collect();
    println!(
        "fault=long_transaction held_id={long_id} held_for={:?} deliveries_of_other_aggregates_while_open={during} \
         follower_id={follower_id}",
        closing.duration_since(opened)
    );
    assert!(during > 0, "other aggregates were delivered while the long transaction was open\n{}", h.logs());
    assert!(early_a.is_empty(), "later events of A were sent before the held one: {early_a:?}");
    assert!(first_at(follower_id).is_some_and(|p| p > long_pos), "the follower came after the held event");
    h.check(&report, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_sink() {
    const SEED: u64 = 0xFA17_0007;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_sink_hang").await;
    let behavior = Behavior::HangEvery { every: 50, hang: Duration::from_secs(2) };
    let mut h = Harness::new("hanging_sink", SEED, db.url(), behavior, &["--webhook-timeout", "300ms"]).await;
    h.start_relay().await;
    // Fewer events here: each hang costs the (sequential) relay its 300 ms timeout.
    let load = Load::spawn(LoadSpec { events: HANG_EVENTS, ..load_spec(&db.url(), SEED, &mut rng) });
    let ledger = load.join().await;
    let report = h.finish(Faults::SinkAnswers(HUNG), ledger).await;
    check_retried(&h.sink.attempts(), HUNG);
    h.check(&report, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_sink() {
    const SEED: u64 = 0xFA17_0008;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("fault_sink_500").await;
    let mut h =
        Harness::new("failing_sink", SEED, db.url(), Behavior::FailFirstAttemptOfEvery { every: 10 }, &[]).await;
    h.start_relay().await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let ledger = load.join().await;
    let report = h.finish(Faults::SinkAnswers(500), ledger).await;
    check_retried(&h.sink.attempts(), 500);
    h.check(&report, 0);
}

/// Every attempt answered `status` was followed by a 2xx of the same id
/// carrying a higher `retry_count` (the relay counted the failure).
fn check_retried(attempts: &[Attempt], status: u16) {
    for (i, a) in attempts.iter().enumerate().filter(|(_, a)| a.status == status) {
        let later = attempts[i + 1..].iter().find(|b| b.id == a.id && b.delivered());
        let later = later.unwrap_or_else(|| panic!("id {} (answered {status}) was never delivered after", a.id));
        assert!(
            later.retry_count > a.retry_count,
            "id {}: the delivery after a failed attempt carries retry_count {} (failed attempt had {})",
            a.id,
            later.retry_count,
            a.retry_count
        );
    }
}

// ---------------------------------------------------------------- the consumer alone

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_the_work_connection_loses_nothing() {
    let db = TestDb::new("work_conn_killed").await;
    let c = db.client().await;
    let agg = Uuid::new_v4();
    let ids: Vec<i64> = crate::support::insert_seed_events(&c, agg, 400).await;
    let mut stream = start(&db, |b| {
        b.batch_size(20).sweep_interval(Duration::from_millis(200)).reconnect_max_delay(Duration::from_millis(300))
    })
    .await;
    let mut seen = HashSet::new();
    let mut last = 0;
    let mut kills = 0;
    while seen.len() < ids.len() {
        let d = next(&mut stream, 20).await;
        assert!(d.id >= last || seen.contains(&d.id), "order: {} after {last}", d.id);
        last = last.max(d.id);
        seen.insert(d.id);
        if seen.len() % 100 == 50 && kills < 3 {
            kills += db.terminate("pg-outbox drain").await;
        }
        d.ack();
    }
    assert!(kills >= 1, "a fault was injected");
    drop(stream);
    // Every event ends published, even those whose acknowledgement was in flight.
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(200))).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        while let Ok(Some(d)) =
            tokio::time::timeout(Duration::from_millis(50), futures::StreamExt::next(&mut stream)).await
        {
            d.ack();
        }
        let left: i64 =
            c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("q").get(0);
        if left == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} events still unpublished");
    }
    stream.finish().await.expect("finish");
}

/// The writer session (acknowledgements and failures) is terminated while
/// writes are in flight: the consumer opens its sessions again, writes the
/// settlements it had queued (no event is delivered twice or lost), and a
/// failure written around the fault still holds its aggregate back until it
/// is delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_the_writer_connection_loses_nothing_and_keeps_each_aggregate_in_order() {
    let db = TestDb::new("writer_conn_killed").await;
    let c = db.client().await;
    let aggs = [Uuid::new_v4(), Uuid::new_v4()];
    let mut ids = Vec::new();
    for _ in 0..10 {
        for a in aggs {
            ids.extend(crate::support::insert_seed_events(&c, a, 20).await);
        }
    }
    let ladder = pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(50)]).expect("schedule").jitter(0.0);
    let mut stream = start(&db, |b| {
        b.batch_size(20)
            .ack_batch_size(5)
            .ack_interval(Duration::from_millis(5))
            .retry_policy(ladder)
            .sweep_interval(Duration::from_millis(200))
            .reconnect_max_delay(Duration::from_millis(300))
    })
    .await;
    let mut delivered: HashMap<i64, u32> = HashMap::new();
    let mut last: HashMap<Uuid, i64> = HashMap::new();
    // A failed event of each aggregate, owed before any later one of it.
    let mut owed: HashMap<Uuid, i64> = HashMap::new();
    let (mut kills, mut failed) = (0, 0);
    let mut acked = HashSet::new();
    while acked.len() < ids.len() {
        let d = next(&mut stream, 20).await;
        let n = {
            let n = delivered.entry(d.id).or_default();
            *n += 1;
            *n
        };
        match owed.get(&d.aggregate_id) {
            Some(f) => assert_eq!(d.id, *f, "aggregate {}: {} overtook its failed event {f}", d.aggregate_id, d.id),
            None => {
                assert_eq!(n, 1, "event {} delivered again although it was acknowledged", d.id);
                let prev = last.insert(d.aggregate_id, d.id).unwrap_or(0);
                assert!(d.id > prev, "aggregate {}: {} after {prev}", d.aggregate_id, d.id);
            }
        }
        let seen = delivered.len();
        if seen % 60 == 30 && kills < 3 && n == 1 {
            kills += db.terminate("pg-outbox writer").await;
        }
        if seen % 45 == 20 && n == 1 {
            owed.insert(d.aggregate_id, d.id);
            failed += 1;
            d.fail("refused once");
        } else {
            owed.remove(&d.aggregate_id);
            acked.insert(d.id);
            d.ack();
        }
    }
    assert!(kills >= 1 && failed >= 1, "faults were injected ({kills} terminations, {failed} failures)");
    // The same consumer writes every acknowledgement, also those whose write
    // was cut by the termination.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let left: i64 =
            c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("q").get(0);
        if left == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} acknowledged events still unpublished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let retried: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE retry_count > 0", &[]).await.expect("q").get(0);
    assert_eq!(retried, i64::from(failed), "each failure counted once");
    stream.finish().await.expect("finish");
}

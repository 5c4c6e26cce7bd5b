//! The fault suite with the relay pipelining: real `pg-outbox relay`
//! processes at the default `--max-in-flight` (64), producers writing over
//! [`AGGREGATES`] aggregates, and sinks that take many sends at once (a
//! webhook served here that answers after 20 to 40 ms, and private
//! `nats-server` and `redis-server` processes with `--exactly-once`). One
//! fault per test, injected for real:
//!
//! - `kill -9` of the relay in the middle of a backlog, then a new relay:
//!   into the webhook and into Redis without `--exactly-once` (at least
//!   once: each duplicate is an event the killed relay had sent and not yet
//!   recorded, counted per kill), and into NATS and Redis with
//!   `--exactly-once` (no duplicate, although the broker held events the
//!   outbox had not recorded at the kill);
//! - a broker restart (file storage, append-only file) mid-drain, NATS and
//!   Redis with `--exactly-once`;
//! - a webhook failing every event of one aggregate for a while: the others
//!   flow, the failing one's later events are held back, and after it heals
//!   everything arrives in order once;
//! - a freeze: the relay SIGSTOPped for 2 s with sends in flight, then
//!   SIGCONT.
//!
//! Each test then reads the destination back with a client of its own and
//! checks it against the producers' ledger: every committed event there (0
//! lost), first copies of each aggregate in id order (0 order violations),
//! no rolled-back event sent, every row published; and that sends were
//! really in flight together (the webhook's concurrency, or the relay's
//! `outbox_sink_in_flight` sampled).
//!
//! Duplicates per kill are not bounded by `--max-in-flight` alone: what a
//! killed relay had sent and not recorded is its sends in flight plus the
//! acknowledgements not yet written ([`UNRECORDED_BOUND`]). Into a fast
//! sink (Redis) that is hundreds of events, into the slow webhook a few
//! more than were in flight. One summary line per test:
//! `pipeline_fault=<kind> events=<n> lost=<n> duplicates=<n> order_violations=<n> most_in_flight=<n> ...`

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::brokers::PrivateServer;
use crate::faults::{self, Ledger, Load, RelayProc};
use crate::needs;
use crate::relay_proc::{LIVENESS, free_port};
use crate::stranded::{Tally, metric, tally};
use crate::support::{self, TestDb};
use pg_outbox_testkit::process;

/// The relay's default `--max-in-flight`, which every relay here runs with.
pub(crate) const MAX_IN_FLIGHT: usize = pg_outbox::relay::DEFAULT_MAX_IN_FLIGHT;
/// What a relay can have sent and not yet recorded, so what one `kill -9`
/// can cost an at-least-once sink in duplicates: its sends in flight, the
/// acknowledgements settled but not yet written (the consumer stops
/// fetching once two acknowledgement batches are unwritten), and what the
/// stream had buffered by then (twice the fetch batch), handed out
/// meanwhile. Not `--max-in-flight` alone: the acknowledgement window is
/// counted in events, so a fast sink fills it.
const UNRECORDED_BOUND: usize = MAX_IN_FLIGHT
    + 2 * pg_outbox::ConsumerBuilder::DEFAULT_ACK_BATCH_SIZE
    + 2 * pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE;
/// Aggregates the producers write.
const AGGREGATES: usize = 100;
/// Committed events per test.
pub(crate) const EVENTS: usize = 1600;
/// Largest pause between a producer's transactions, in ms.
const PACE_MS: u64 = 6;
/// The relays' retry schedule: short, and never a dead letter here.
const RETRY: [&str; 4] = ["--retry-schedule", "100ms,300ms", "--max-retries", "1000"];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------- producers

/// The fault suite's producers (1 to 3 events a transaction, one in ten
/// rolled back) over [`AGGREGATES`] aggregates, `events` committed in all.
pub(crate) fn spawn_load(url: &str, seed: u64, rng: &mut StdRng, events: usize) -> Load {
    let mut spec = faults::load_spec(url, seed, rng);
    spec.aggregates = (0..AGGREGATES).map(|_| Uuid::from_u128(rng.random::<u128>())).collect();
    spec.events = events;
    spec.pace_ms = PACE_MS;
    Load::spawn(spec)
}

/// Wait until no relay session is left on the database (a killed relay's
/// backend may still be finishing a statement it got before the kill), so
/// that what is published is what the killed relay recorded.
pub(crate) async fn relay_sessions_gone(c: &Client) {
    support::eventually(LIVENESS.as_secs(), "the killed relay's sessions end", || async {
        let r = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name LIKE 'pg-outbox%' AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .expect("count relay sessions");
        r.get::<_, i64>(0) == 0
    })
    .await;
}

/// Ids of the published rows.
async fn published_ids(c: &Client) -> HashSet<i64> {
    c.query("SELECT id FROM events.outbox WHERE published_at IS NOT NULL", &[])
        .await
        .expect("read published ids")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

// ---------------------------------------------------------------- the webhook

/// One request the webhook got, in arrival order. A webhook acts on a
/// request when it arrives: a 2xx request counts as received even if the
/// relay never reads the answer (it was killed meanwhile).
#[derive(Debug, Clone)]
struct Got {
    id: i64,
    aggregate: Uuid,
    /// Which relay process sent it (each relay has a URL path of its own).
    relay: u32,
    /// Answered 2xx (not the failing aggregate's 500).
    ok: bool,
}

#[derive(Default)]
struct HookLog {
    got: Vec<Got>,
    malformed: Vec<String>,
    /// Requests being answered now, by relay.
    now: HashMap<u32, usize>,
    /// Most requests answered at once, by relay.
    most: HashMap<u32, usize>,
}

#[derive(Default)]
struct HookState {
    log: Mutex<HookLog>,
    /// Aggregate whose events are answered 500.
    failing: Mutex<Option<Uuid>>,
}

/// A webhook that answers each request after 20 to 40 ms (by event id), so
/// that the relay has many sends in flight at once, and records what it got
/// and how many requests it was answering at once.
#[derive(Clone)]
struct Hook {
    state: Arc<HookState>,
    base: String,
}

/// Counts a request in flight while it lives (also if its connection is
/// dropped mid-answer).
struct Answering {
    state: Arc<HookState>,
    relay: u32,
}

impl Drop for Answering {
    fn drop(&mut self) {
        let mut log = lock(&self.state.log);
        if let Some(n) = log.now.get_mut(&self.relay) {
            *n -= 1;
        }
    }
}

async fn hook_handler(State(hook): State<Hook>, Path(relay): Path<u32>, body: Bytes) -> StatusCode {
    let parsed = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
        let id = v["id"].as_i64()?;
        let aggregate = v["aggregate_id"].as_str().and_then(|s| Uuid::parse_str(s).ok())?;
        Some((id, aggregate))
    });
    let Some((id, aggregate)) = parsed else {
        lock(&hook.state.log).malformed.push(String::from_utf8_lossy(&body).into_owned());
        return StatusCode::BAD_REQUEST;
    };
    let ok = *lock(&hook.state.failing) != Some(aggregate);
    let _answering = {
        let mut log = lock(&hook.state.log);
        log.got.push(Got { id, aggregate, relay, ok });
        let now = {
            let n = log.now.entry(relay).or_default();
            *n += 1;
            *n
        };
        let most = log.most.entry(relay).or_default();
        *most = (*most).max(now);
        Answering { state: hook.state.clone(), relay }
    };
    let millis = 20 + u64::try_from(id.rem_euclid(21)).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(millis)).await;
    if ok { StatusCode::OK } else { StatusCode::INTERNAL_SERVER_ERROR }
}

impl Hook {
    async fn start() -> Hook {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the test webhook");
        let addr = listener.local_addr().expect("webhook address");
        let hook = Hook { state: Arc::default(), base: format!("http://{addr}/hook") };
        let app =
            axum::Router::new().route("/hook/{relay}", axum::routing::post(hook_handler)).with_state(hook.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("test webhook stopped: {e}");
            }
        });
        hook
    }

    fn got(&self) -> Vec<Got> {
        lock(&self.state.log).got.clone()
    }

    fn received(&self) -> usize {
        lock(&self.state.log).got.len()
    }

    /// Requests of relay `n` being answered now.
    fn in_flight(&self, n: u32) -> usize {
        lock(&self.state.log).now.get(&n).copied().unwrap_or(0)
    }

    /// Most requests any one relay had in flight at once.
    fn most(&self) -> usize {
        lock(&self.state.log).most.values().copied().max().unwrap_or(0)
    }

    fn fail(&self, aggregate: Option<Uuid>) {
        *lock(&self.state.failing) = aggregate;
    }

    /// Relay number `n` delivering here (default `--max-in-flight`); waits
    /// until it says it started.
    async fn relay(&self, url: &str, n: u32) -> RelayProc {
        let sink = format!("{}/{n}", self.base);
        let spec = process::Relay::new(support::bin()).url(url).args(&["--sink", &sink]).args(&RETRY);
        RelayProc::start_spec(n, spec).await
    }

    /// The checks every webhook test makes (every request well formed, no
    /// rolled-back or unknown id sent, 0 lost, 0 order violations); the
    /// tally of 2xx receptions.
    fn check(&self, kind: &str, committed: &BTreeMap<i64, Uuid>, rolled_back: &BTreeSet<i64>, logs: &str) -> Tally {
        let log = lock(&self.state.log);
        assert!(log.malformed.is_empty(), "{kind}: malformed webhook bodies: {:?}", log.malformed);
        for g in &log.got {
            assert!(!rolled_back.contains(&g.id), "{kind}: rolled-back id {} was sent by relay {}", g.id, g.relay);
            let agg = committed.get(&g.id);
            assert_eq!(
                agg,
                Some(&g.aggregate),
                "{kind}: id {} sent by relay {} is no committed event of it",
                g.id,
                g.relay
            );
        }
        let t = tally(
            committed.iter().map(|(id, a)| (*id, *a)),
            log.got.iter().filter(|g| g.ok).map(|g| (g.id, g.aggregate)),
        );
        assert_eq!(t.lost, 0, "{kind}: committed events never delivered: {t:?}\n{logs}");
        assert_eq!(t.order_violations, 0, "{kind}: per-aggregate order violated: {t:?}\n{logs}");
        t
    }
}

/// The relays' stderr (the end of it), for failure messages.
pub(crate) fn logs(relays: &[RelayProc]) -> String {
    faults::logs(relays.iter())
}

/// Wait until every row is published (failing on a dead letter, a relay
/// that exited by itself, or after a liveness bound).
async fn drained(c: &Client, kind: &str, seed: u64, relays: &mut [RelayProc]) -> Duration {
    faults::wait_drained(c, kind, seed, &mut relays.iter_mut().collect::<Vec<_>>()).await
}

// ---------------------------------------------------------------- kill -9 into the webhook

/// What one kill left behind.
struct Kill {
    relay: u32,
    /// The webhook's requests of that relay not yet answered at the kill.
    in_flight: usize,
    /// Events the webhook got (2xx) from that relay whose rows were not
    /// published right after the kill: the only ones that may come twice.
    unsettled: HashSet<i64>,
}

/// `kill -9` of the relay while it drains a backlog into a webhook that
/// answers in 20 to 40 ms, three times, a new relay each time. Nothing is
/// lost or reordered; every duplicate is an event the killed relay had sent
/// and not recorded (its answer or its acknowledgement was cut off), and
/// the kill left at most `--max-in-flight` requests unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_into_a_slow_webhook_with_many_in_flight() {
    const SEED: u64 = 0x91FE_0001;
    const KIND: &str = "kill_9_webhook";
    const KILLS: usize = 3;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("pf_webhook_kill").await;
    let c = db.client().await;
    let hook = Hook::start().await;
    let load = spawn_load(&db.url(), SEED, &mut rng, EVENTS);
    let started = Instant::now();
    // A backlog first, so that each relay starts with many aggregates' events.
    load.reached(EVENTS / 5).await;
    let mut relays = vec![hook.relay(&db.url(), 1).await];
    let mut kills = Vec::new();
    for k in 0..KILLS {
        let n = relays[k].n;
        // Mid-drain, with many requests really in flight.
        support::eventually(LIVENESS.as_secs(), "the relay has 16 requests in flight", || async {
            hook.in_flight(n) >= 16
        })
        .await;
        faults::assert_running(KIND, &mut relays.iter_mut().collect::<Vec<_>>()).await;
        let in_flight = hook.in_flight(n);
        relays[k].kill9().await;
        relay_sessions_gone(&c).await;
        let published = published_ids(&c).await;
        let unsettled: HashSet<i64> =
            hook.got().iter().filter(|g| g.relay == n && g.ok && !published.contains(&g.id)).map(|g| g.id).collect();
        kills.push(Kill { relay: n, in_flight, unsettled });
        // A new backlog while no relay runs.
        load.reached((load.committed() + 200).min(EVENTS)).await;
        relays.push(hook.relay(&db.url(), n + 1).await);
    }
    let ledger = load.join().await;
    let (committed, rolled_back) = ledger.resolve(&c).await;
    let drained_in = drained(&c, KIND, SEED, &mut relays).await;
    let t = hook.check(KIND, &committed, &rolled_back, &logs(&relays));

    // Each duplicate: an event the relay that last sent it had not recorded
    // when it was killed.
    let mut last_by: HashMap<i64, u32> = HashMap::new();
    let mut dups: BTreeMap<u32, usize> = BTreeMap::new();
    for g in hook.got().iter().filter(|g| g.ok) {
        if let Some(before) = last_by.insert(g.id, g.relay) {
            let kill = kills.iter().find(|k| k.relay == before);
            assert!(
                g.relay > before && kill.is_some_and(|k| k.unsettled.contains(&g.id)),
                "{KIND}: id {} came again from relay {} though relay {before} had sent it and it was recorded \
                 (or that relay was never killed)",
                g.id,
                g.relay
            );
            *dups.entry(before).or_default() += 1;
        }
    }
    let per_kill: Vec<String> = kills
        .iter()
        .map(|k| {
            format!(
                "relay {}: in_flight={} unsettled={} duplicates={}",
                k.relay,
                k.in_flight,
                k.unsettled.len(),
                dups.get(&k.relay).copied().unwrap_or(0)
            )
        })
        .collect();
    let most = hook.most();
    println!(
        "pipeline_fault={KIND} kills={KILLS} events={} lost={} duplicates={} order_violations={} most_in_flight={most} \
         per_kill=[{}] drained_after_load={drained_in:?} test_time={:?}",
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations,
        per_kill.join("; "),
        started.elapsed()
    );
    assert!(most > 1 && most <= MAX_IN_FLIGHT, "{KIND}: requests in flight at once: {most}");
    for k in &kills {
        let d = dups.get(&k.relay).copied().unwrap_or(0);
        assert!(k.in_flight <= MAX_IN_FLIGHT, "{KIND}: relay {} had {} requests in flight", k.relay, k.in_flight);
        assert!(d <= UNRECORDED_BOUND, "{KIND}: {d} duplicates of the kill of relay {}", k.relay);
    }
}

// ---------------------------------------------------------------- a failing aggregate

/// The webhook answers 500 to every event of one aggregate for a while. The
/// relay keeps sending the other aggregates' events, many at once; of the
/// failing aggregate it sends only the failed event (again and again), its
/// later events held back though committed; once the webhook heals, every
/// event arrives once, each aggregate's in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_failing_one_aggregate_holds_it_back_while_the_others_flow() {
    const SEED: u64 = 0x91FE_0002;
    const KIND: &str = "failing_aggregate_webhook";
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("pf_webhook_fail_one").await;
    let c = db.client().await;
    let hook = Hook::start().await;
    let load = spawn_load(&db.url(), SEED, &mut rng, EVENTS);
    let started = Instant::now();
    // The failing aggregate: one the producers write (its first event
    // decides it), failing from its first send.
    let failing: Uuid = {
        let first = loop {
            let r = c
                .query_opt("SELECT aggregate_id FROM events.outbox ORDER BY id LIMIT 1", &[])
                .await
                .expect("first event");
            if let Some(r) = r {
                break r.get::<_, Uuid>(0);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        hook.fail(Some(first));
        first
    };
    load.reached(EVENTS / 5).await;
    let mut relays = vec![hook.relay(&db.url(), 1).await];

    // While it fails: its head event is refused again (a retry), and more
    // of its events are committed behind it.
    let failing_committed = || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE aggregate_id = $1", &[&failing])
            .await
            .expect("count")
            .get::<_, i64>(0)
    };
    support::eventually(LIVENESS.as_secs(), "the failing aggregate is refused twice with 3 events behind", || async {
        hook.got().iter().filter(|g| !g.ok).count() >= 2 && failing_committed().await >= 4
    })
    .await;
    let delivered_before = hook.got().iter().filter(|g| g.ok).count();
    support::eventually(LIVENESS.as_secs(), "the others flow: 300 more deliveries", || async {
        hook.got().iter().filter(|g| g.ok).count() >= delivered_before + 300
    })
    .await;
    let during = hook.got();
    let heads: BTreeSet<i64> = during.iter().filter(|g| g.aggregate == failing).map(|g| g.id).collect();
    let first_failing: i64 = c
        .query_one("SELECT min(id) FROM events.outbox WHERE aggregate_id = $1", &[&failing])
        .await
        .expect("its first event")
        .get(0);
    let behind: i64 = failing_committed().await - 1;
    assert_eq!(
        heads,
        BTreeSet::from([first_failing]),
        "{KIND}: only the failed event of {failing} was sent while it failed ({behind} of its events behind it)"
    );
    let published_behind: i64 = c
        .query_one(
            "SELECT count(*) FROM events.outbox WHERE aggregate_id = $1 AND published_at IS NOT NULL",
            &[&failing],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(published_behind, 0, "{KIND}: nothing of the failing aggregate is published while it fails");

    hook.fail(None);
    let ledger = load.join().await;
    let (committed, rolled_back) = ledger.resolve(&c).await;
    let drained_in = drained(&c, KIND, SEED, &mut relays).await;
    let t = hook.check(KIND, &committed, &rolled_back, &logs(&relays));
    let refused = hook.got().iter().filter(|g| !g.ok).count();
    let retries: i32 = c
        .query_one("SELECT retry_count FROM events.outbox WHERE id = $1", &[&first_failing])
        .await
        .expect("retry count")
        .get(0);
    let most = hook.most();
    println!(
        "pipeline_fault={KIND} events={} lost={} duplicates={} order_violations={} most_in_flight={most} \
         refused={refused} held_back={behind} failed_event_retries={retries} drained_after_load={drained_in:?} \
         test_time={:?}",
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations,
        started.elapsed()
    );
    assert_eq!(t.duplicates, 0, "{KIND}: no event delivered twice: {t:?}");
    assert!(retries >= 2 && retries as usize == refused, "{KIND}: each 500 counted once: {retries} vs {refused}");
    assert!(most > 1 && most <= MAX_IN_FLIGHT, "{KIND}: requests in flight at once: {most}");
}

// ---------------------------------------------------------------- a freeze

/// SIGSTOP of the relay for 2 s with sends in flight (the webhook answers
/// them meanwhile; the relay sends nothing new), then SIGCONT: everything
/// arrives, in order, each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_relay_resumes_without_loss_or_reordering() {
    const SEED: u64 = 0x91FE_0003;
    const KIND: &str = "freeze_webhook";
    const FREEZE: Duration = Duration::from_secs(2);
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = TestDb::new("pf_webhook_freeze").await;
    let c = db.client().await;
    let hook = Hook::start().await;
    let load = spawn_load(&db.url(), SEED, &mut rng, EVENTS);
    let started = Instant::now();
    load.reached(EVENTS / 5).await;
    let mut relays = vec![hook.relay(&db.url(), 1).await];
    support::eventually(LIVENESS.as_secs(), "the relay has 16 requests in flight", || async {
        hook.in_flight(1) >= 16
    })
    .await;
    relays[0].signal(libc::SIGSTOP);
    let in_flight = hook.in_flight(1);
    let stopped = Instant::now();
    // The webhook answers what was sent before the stop; nothing new comes.
    support::eventually(LIVENESS.as_secs(), "the requests sent before the stop are answered", || async {
        hook.in_flight(1) == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let at_rest = hook.received();
    tokio::time::sleep(FREEZE.saturating_sub(stopped.elapsed())).await;
    assert_eq!(hook.received(), at_rest, "{KIND}: the frozen relay sent nothing");
    relays[0].signal(libc::SIGCONT);

    let ledger = load.join().await;
    let (committed, rolled_back) = ledger.resolve(&c).await;
    let drained_in = drained(&c, KIND, SEED, &mut relays).await;
    let t = hook.check(KIND, &committed, &rolled_back, &logs(&relays));
    let most = hook.most();
    println!(
        "pipeline_fault={KIND} events={} lost={} duplicates={} order_violations={} most_in_flight={most} \
         in_flight_at_stop={in_flight} frozen_for={FREEZE:?} drained_after_load={drained_in:?} test_time={:?}",
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations,
        started.elapsed()
    );
    assert_eq!(t.duplicates, 0, "{KIND}: nothing took over, so nothing comes twice: {t:?}\n{}", logs(&relays));
    assert!(most > 1 && most <= MAX_IN_FLIGHT, "{KIND}: requests in flight at once: {most}");
}

// ---------------------------------------------------------------- exactly-once brokers

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BrokerKind {
    Nats,
    Redis,
}

/// A private broker server (restartable) with one subject (stream key) per
/// aggregate.
pub(crate) struct Broker {
    kind: BrokerKind,
    server: PrivateServer,
    url: String,
    /// Relays run with `--exactly-once`.
    exactly_once: bool,
}

/// The stream (NATS) and the key prefix (Redis) on the private servers.
const NATS_STREAM: &str = "OUTBOX";

impl Broker {
    /// `None` (the test skips) when the server program is missing.
    pub(crate) async fn start(kind: BrokerKind, exactly_once: bool) -> Option<Broker> {
        let broker = match kind {
            BrokerKind::Nats => {
                let program = needs::program(&needs::NATS_SERVER)?;
                let server = PrivateServer::start(
                    program,
                    &["-a", "127.0.0.1", "-p", "{port}", "-js", "-sd", "{dir}", "--http_port", "0"],
                )
                .await;
                let url = format!("nats://127.0.0.1:{}", server.port);
                Broker { kind, server, url, exactly_once }
            }
            BrokerKind::Redis => {
                let program = needs::program(&needs::REDIS_SERVER)?;
                let server = PrivateServer::start(
                    program,
                    &["--bind", "127.0.0.1", "--port", "{port}", "--dir", "{dir}", "--save", "", "--appendonly", "yes"],
                )
                .await;
                let url = format!("redis://127.0.0.1:{}", server.port);
                Broker { kind, server, url, exactly_once }
            }
        };
        if kind == BrokerKind::Nats {
            let js = broker.jetstream().await;
            let config = async_nats::jetstream::stream::Config {
                name: NATS_STREAM.into(),
                subjects: vec!["events.>".into()],
                storage: async_nats::jetstream::stream::StorageType::File,
                ..Default::default()
            };
            let mut created = false;
            for _ in 0..50 {
                // JetStream may need a moment after the port opens.
                if js.create_stream(config.clone()).await.is_ok() {
                    created = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(created, "create a file-backed stream on the private NATS server");
        }
        Some(broker)
    }

    async fn jetstream(&self) -> async_nats::jetstream::Context {
        let client = async_nats::connect(self.url.as_str()).await.expect("connect to the private NATS server");
        async_nats::jetstream::new(client)
    }

    /// `nats_exactly_once`, `redis_at_least_once`, ...
    pub(crate) fn name(&self) -> String {
        let broker = match self.kind {
            BrokerKind::Nats => "nats",
            BrokerKind::Redis => "redis",
        };
        let guarantee = if self.exactly_once { "exactly_once" } else { "at_least_once" };
        format!("{broker}_{guarantee}")
    }

    /// `--sink`, the per-aggregate subject (stream key), and `--exactly-once`.
    fn sink_args(&self) -> Vec<String> {
        let (flag, template) = match self.kind {
            BrokerKind::Nats => ("--nats-subject", "events.{aggregate_id}"),
            BrokerKind::Redis => ("--redis-stream", "outbox:{aggregate_id}"),
        };
        let mut args: Vec<String> = ["--sink", &self.url, flag, template].iter().map(|s| s.to_string()).collect();
        if self.exactly_once {
            args.push("--exactly-once".into());
        }
        args
    }

    /// Relay number `n` delivering here, its metrics on a port
    /// of its own; waits until it says it started.
    pub(crate) async fn relay(&self, url: &str, n: u32, extra: &[&str]) -> (RelayProc, String) {
        let metrics = format!("127.0.0.1:{}", free_port());
        let spec = process::Relay::new(support::bin())
            .url(url)
            .args(&self.sink_args())
            .args(&RETRY)
            .args(&["--metrics-addr", &metrics])
            .args(extra);
        (RelayProc::start_spec(n, spec).await, metrics)
    }

    /// Every copy the broker holds as `(id, aggregate of its subject or
    /// key)`, each aggregate's in the broker's order; checks that each body
    /// names its subject's (key's) aggregate.
    async fn copies(&self, aggregates: &[Uuid]) -> Vec<(i64, Uuid)> {
        let body = |aggregate: Uuid, bytes: &[u8]| -> (i64, Uuid) {
            let v: Value = serde_json::from_slice(bytes).expect("a message body is JSON");
            let id = v["id"].as_i64().unwrap_or_else(|| panic!("a message without an id: {v}"));
            assert_eq!(v["aggregate_id"].as_str(), Some(aggregate.to_string().as_str()), "id {id} on its aggregate");
            (id, aggregate)
        };
        match self.kind {
            BrokerKind::Nats => {
                let js = self.jetstream().await;
                let mut s = js.get_stream(NATS_STREAM).await.expect("get the stream");
                let n = usize::try_from(s.info().await.expect("stream info").state.messages).expect("fits");
                let consumer = s
                    .create_consumer(async_nats::jetstream::consumer::pull::Config {
                        deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
                        ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
                        ..Default::default()
                    })
                    .await
                    .expect("create an ephemeral consumer");
                let mut out = Vec::with_capacity(n);
                while out.len() < n {
                    let mut batch = consumer
                        .fetch()
                        .max_messages(n - out.len())
                        .expires(Duration::from_secs(2))
                        .messages()
                        .await
                        .expect("fetch from the stream");
                    let before = out.len();
                    while let Some(m) = batch.next().await {
                        let m = m.expect("a stream message").message;
                        let agg = m.subject.as_str().strip_prefix("events.").and_then(|a| Uuid::parse_str(a).ok());
                        let agg = agg.unwrap_or_else(|| panic!("a subject not of one aggregate: {}", m.subject));
                        out.push(body(agg, &m.payload));
                    }
                    assert!(out.len() > before, "the stream says {n} messages but only {} could be read", out.len());
                }
                out
            }
            BrokerKind::Redis => {
                let client = redis::Client::open(self.url.as_str()).expect("Redis URL");
                let mut conn = client.get_multiplexed_async_connection().await.expect("connect to the private Redis");
                let mut out = Vec::new();
                for a in aggregates {
                    let entries: crate::sink_redis::Entries = redis::cmd("XRANGE")
                        .arg(format!("outbox:{a}"))
                        .arg("-")
                        .arg("+")
                        .query_async(&mut conn)
                        .await
                        .expect("XRANGE");
                    for (entry, fields) in entries {
                        let payload = fields.get("payload").unwrap_or_else(|| panic!("entry {entry} has no payload"));
                        let (id, agg) = body(*a, payload.as_bytes());
                        if self.exactly_once {
                            assert_eq!(entry, format!("{id}-0"), "entry id of event {id}");
                        }
                        out.push((id, agg));
                    }
                }
                out
            }
        }
    }
}

/// Sample the relay's `outbox_sink_in_flight` at `addr` every 5 ms into
/// `most` (its highest value seen) until aborted.
pub(crate) fn sample_in_flight(addr: String, most: Arc<AtomicUsize>) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Some(v) = metric(&addr, pg_outbox::metrics::SINK_IN_FLIGHT).await {
                most.fetch_max(v as usize, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// Read the broker back and check it against the ledger: 0 lost, 0 order
/// violations, nothing rolled back or unknown, and with `--exactly-once` 0
/// duplicates; the tally and the copies.
pub(crate) async fn check_broker(
    kind: &str,
    broker: &Broker,
    c: &Client,
    ledger: &Ledger,
    aggregates: &[Uuid],
    logs: &str,
) -> (Tally, Vec<(i64, Uuid)>) {
    let (committed, rolled_back) = ledger.resolve(c).await;
    let copies = broker.copies(aggregates).await;
    for (id, agg) in &copies {
        assert!(!rolled_back.contains(id), "{kind}: rolled-back id {id} reached the broker");
        assert_eq!(
            committed.get(id),
            Some(agg),
            "{kind}: id {id} at the broker is no committed event of its aggregate"
        );
    }
    let t = tally(committed.iter().map(|(id, a)| (*id, *a)), copies.iter().copied());
    assert_eq!(t.lost, 0, "{kind}: committed events never reached the broker: {t:?}\n{logs}");
    assert_eq!(t.order_violations, 0, "{kind}: per-aggregate order violated: {t:?}\n{logs}");
    if broker.exactly_once {
        assert_eq!(t.duplicates, 0, "{kind}: duplicates with --exactly-once: {t:?}\n{logs}");
    }
    (t, copies)
}

/// The aggregates the producers of `ledger` wrote.
pub(crate) fn aggregates_of(ledger: &Ledger) -> Vec<Uuid> {
    let set: BTreeSet<Uuid> = ledger.committed.iter().map(|(_, a)| *a).collect();
    set.into_iter().collect()
}

/// Wait (polling every 2 ms: a fast sink drains a backlog in a few
/// fetches) until `n` more rows are published than now.
async fn published_more(c: &Client, n: i64) {
    let base = support::published_count(c).await;
    let deadline = Instant::now() + LIVENESS;
    while support::published_count(c).await < base + n {
        assert!(Instant::now() < deadline, "the relay did not publish {n} events within {LIVENESS:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Copies the broker holds now, by id.
pub(crate) async fn copies_by_id(broker: &Broker, c: &Client) -> HashMap<i64, usize> {
    let mut by: HashMap<i64, usize> = HashMap::new();
    for (id, _) in broker.copies(&aggregates_now(c).await).await {
        *by.entry(id).or_default() += 1;
    }
    by
}

/// `kill -9` of the relay in the middle of a backlog, three times, a new
/// relay each time. The broker holds every committed event, each
/// aggregate's in order. At each kill (once the killed relay's sessions are
/// gone) the broker held events the outbox had not recorded ("unsettled"):
/// with `--exactly-once` the next relay sends them again and the broker
/// refuses them, so nothing is there twice; at least once, each is a second
/// copy, and every duplicate is one of them (counted per kill).
async fn kill_9_mid_drain(kind: BrokerKind, exactly_once: bool, seed: u64) {
    const KILLS: usize = 3;
    let Some(broker) = Broker::start(kind, exactly_once).await else { return };
    let tag = format!("kill_9_{}", broker.name());
    let mut rng = StdRng::seed_from_u64(seed);
    let db = TestDb::new(&format!("pf_kill_{}", broker.name())).await;
    let c = db.client().await;
    let load = spawn_load(&db.url(), seed, &mut rng, EVENTS);
    let started = Instant::now();
    let most = Arc::new(AtomicUsize::new(0));
    load.reached(EVENTS / 5).await;
    let mut relays = Vec::new();
    let mut samplers = Vec::new();
    // Per kill: the events unsettled, and the copies the broker held then.
    let mut kills: Vec<(HashSet<i64>, HashMap<i64, usize>)> = Vec::new();
    for k in 0..=KILLS {
        let n = u32::try_from(k + 1).expect("few relays");
        let (relay, metrics) = broker.relay(&db.url(), n, &[]).await;
        relays.push(relay);
        samplers.push(sample_in_flight(metrics, most.clone()));
        if k == KILLS {
            break;
        }
        // Mid-drain: the relay has published some of the backlog.
        published_more(&c, 50).await;
        faults::assert_running(&tag, &mut relays.iter_mut().collect::<Vec<_>>()).await;
        relays[k].kill9().await;
        relay_sessions_gone(&c).await;
        let published = published_ids(&c).await;
        let held = copies_by_id(&broker, &c).await;
        let unsettled: HashSet<i64> = held.keys().filter(|id| !published.contains(id)).copied().collect();
        kills.push((unsettled, held));
        // A backlog the next relay takes a while to drain.
        load.reached((load.committed() + 400).min(EVENTS)).await;
    }
    let ledger = load.join().await;
    let drained_in = drained(&c, &tag, seed, &mut relays).await;
    for s in samplers {
        s.abort();
    }
    let (t, copies) = check_broker(&tag, &broker, &c, &ledger, &aggregates_of(&ledger), &logs(&relays)).await;
    let mut last: HashMap<i64, usize> = HashMap::new();
    for (id, _) in &copies {
        *last.entry(*id).or_default() += 1;
    }
    // Copies each kill's unsettled events gained after it (by the next
    // relays), and duplicates of events no kill left unsettled.
    let mut per_kill = Vec::new();
    for (k, (unsettled, held)) in kills.iter().enumerate() {
        let after = kills.get(k + 1).map_or(&last, |(_, h)| h);
        let gained: usize = unsettled.iter().map(|id| after.get(id).unwrap_or(&0) - held.get(id).unwrap_or(&0)).sum();
        per_kill.push((unsettled.len(), gained));
    }
    let stray: Vec<i64> = last
        .iter()
        .filter(|(id, n)| **n > 1 && !kills.iter().any(|(u, _)| u.contains(id)))
        .map(|(id, _)| *id)
        .collect();
    let most = most.load(Ordering::SeqCst);
    println!(
        "pipeline_fault={tag} kills={KILLS} events={} lost={} duplicates={} order_violations={} most_in_flight={most} \
         per_kill(unsettled,duplicates)={per_kill:?} drained_after_load={drained_in:?} test_time={:?}",
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations,
        started.elapsed()
    );
    assert!(most > 1 && most <= MAX_IN_FLIGHT, "{tag}: sends in flight at once (sampled): {most}");
    assert!(stray.is_empty(), "{tag}: duplicates of events recorded before every kill: {stray:?}");
    assert!(per_kill.iter().any(|(u, _)| *u > 0), "{tag}: no kill left the broker ahead of the outbox");
    if !exactly_once {
        assert_eq!(
            per_kill.iter().map(|(_, d)| d).sum::<usize>(),
            t.duplicates,
            "{tag}: every duplicate is a copy of an event a kill left unsettled"
        );
        for (unsettled, duplicates) in &per_kill {
            assert!(
                *duplicates <= UNRECORDED_BOUND,
                "{tag}: {duplicates} duplicates of one kill ({unsettled} unsettled), more than a relay can have \
                 sent unrecorded ({UNRECORDED_BOUND})"
            );
        }
    }
}

/// Every aggregate with an event in the outbox.
async fn aggregates_now(c: &Client) -> Vec<Uuid> {
    c.query("SELECT DISTINCT aggregate_id FROM events.outbox", &[])
        .await
        .expect("aggregates")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_into_nats_exactly_once_with_many_in_flight() {
    kill_9_mid_drain(BrokerKind::Nats, true, 0x91FE_0004).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_into_redis_exactly_once_with_many_in_flight() {
    kill_9_mid_drain(BrokerKind::Redis, true, 0x91FE_0005).await;
}

/// Redis without `--exactly-once` (`XADD key *`): nothing refuses a repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_into_redis_at_least_once_with_many_in_flight() {
    kill_9_mid_drain(BrokerKind::Redis, false, 0x91FE_0008).await;
}

/// The broker restarted (SIGTERM, then started again on its data) twice
/// while an exactly-once relay drains a backlog into it: sends in flight
/// fail and are retried once it is back; the broker holds every committed
/// event once, in order.
async fn exactly_once_broker_restart(kind: BrokerKind, seed: u64) {
    const RESTARTS: usize = 2;
    let Some(mut broker) = Broker::start(kind, true).await else { return };
    let tag = format!("broker_restart_{}", broker.name());
    let mut rng = StdRng::seed_from_u64(seed);
    let db = TestDb::new(&format!("pf_restart_{}", broker.name())).await;
    let c = db.client().await;
    let load = spawn_load(&db.url(), seed, &mut rng, EVENTS);
    let started = Instant::now();
    load.reached(EVENTS / 5).await;
    let (relay, metrics) = broker.relay(&db.url(), 1, &["--sink-timeout", "1s"]).await;
    let mut relays = vec![relay];
    let most = Arc::new(AtomicUsize::new(0));
    let sampler = sample_in_flight(metrics, most.clone());
    let mut failed_during = Vec::new();
    for _ in 0..RESTARTS {
        published_more(&c, 50).await;
        let failures_before = failures(&c).await;
        broker.server.stop().await;
        // The outage reaches the relay: sends fail.
        support::eventually(LIVENESS.as_secs(), "sends fail while the broker is down", || async {
            failures(&c).await > failures_before
        })
        .await;
        load.reached((load.committed() + 200).min(EVENTS)).await;
        failed_during.push(failures(&c).await - failures_before);
        broker.server.restart().await;
    }
    let ledger = load.join().await;
    let drained_in = drained(&c, &tag, seed, &mut relays).await;
    sampler.abort();
    let (t, _) = check_broker(&tag, &broker, &c, &ledger, &aggregates_of(&ledger), &logs(&relays)).await;
    let most = most.load(Ordering::SeqCst);
    println!(
        "pipeline_fault={tag} restarts={RESTARTS} events={} lost={} duplicates={} order_violations={} \
         most_in_flight={most} failures_per_outage={failed_during:?} drained_after_load={drained_in:?} test_time={:?}",
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations,
        started.elapsed()
    );
    assert!(most > 1 && most <= MAX_IN_FLIGHT, "{tag}: sends in flight at once (sampled): {most}");
}

/// Failures counted on the rows so far.
async fn failures(c: &Client) -> i64 {
    c.query_one("SELECT coalesce(sum(retry_count), 0)::int8 FROM events.outbox", &[])
        .await
        .expect("sum of retry counts")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_under_an_exactly_once_relay_with_many_in_flight() {
    exactly_once_broker_restart(BrokerKind::Nats, 0x91FE_0006).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_under_an_exactly_once_relay_with_many_in_flight() {
    exactly_once_broker_restart(BrokerKind::Redis, 0x91FE_0007).await;
}

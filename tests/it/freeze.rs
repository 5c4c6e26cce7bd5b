//! Leadership the server takes back (docs/architecture.md): at default
//! settings, a relay frozen (SIGSTOP, as a paused container or a stuck
//! host) or cut off (a proxy that stops forwarding and acknowledging
//! nothing) under a steady load is replaced by another relay within 10 s,
//! in single and partitioned modes, with the listen and the WAL source,
//! whatever the length of the fault; it loses nothing, breaks no order and
//! hands nothing out after its successor began (a send it began before the
//! fault may arrive when it resumes, with its old term: a late delivery,
//! which a destination refuses by term).
//!
//! Each test prints one `freeze ...` line: the fault, the mode and source,
//! the worst wait of an event committed around the fault (from its commit
//! to its first delivery), the takeover (from the fault until another
//! relay delivered each aggregate the faulted one was delivering), events, lost, duplicates, order violations
//! and late deliveries (a delivery carrying a lower term than one that
//! already arrived for its aggregate: a deposed relay's, after its
//! successor began).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::relay_proc::{self, LIVENESS};
use crate::stranded::tally;
use crate::support::{self, Proxy, Target, TestDb, eventually};
use pg_outbox_testkit::process;
#[cfg(feature = "wal")]
use pg_outbox_testkit::{TempServer, TempServerOptions};

/// The bound the design asks at default settings: no event waits longer
/// from its commit to its delivery while a relay is frozen or cut off.
const BOUND: Duration = Duration::from_secs(10);
/// How long each fault lasts: longer than the takeover, so the replaced
/// relay resumes after its successor delivered.
const FAULT: Duration = Duration::from_secs(14);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One delivery the webhook got.
#[derive(Debug, Clone)]
pub(crate) struct Got {
    pub(crate) relay: u32,
    pub(crate) id: i64,
    pub(crate) aggregate: Uuid,
    /// The delivery's leadership term (the header `outbox-term`).
    pub(crate) term: u64,
    pub(crate) at: Instant,
}

/// A webhook that answers 200 to every event and records it, by relay
/// (each relay posts to `/hook/<n>`); a delivery without a term is refused
/// with 400 unless the hook serves competing relays (`unfenced`: recorded
/// with term 0), whose relay 1 it answers after 20 ms, so that relay holds
/// a claim most of the time.
#[derive(Clone, Default)]
pub(crate) struct Hook {
    got: Arc<Mutex<Vec<Got>>>,
    base: String,
    unfenced: bool,
}

impl Hook {
    pub(crate) async fn serve() -> Hook {
        Hook::serve_for(false).await
    }

    async fn serve_for(unfenced: bool) -> Hook {
        let mut hook = Hook { unfenced, ..Hook::default() };
        let app = axum::Router::new().route("/hook/{relay}", axum::routing::post(record)).with_state(hook.clone());
        hook.base = support::serve_hook(app).await;
        hook
    }

    pub(crate) fn url(&self, relay: u32) -> String {
        format!("{}/{relay}", self.base)
    }

    pub(crate) fn got(&self) -> Vec<Got> {
        lock(&self.got).clone()
    }
}

async fn record(State(hook): State<Hook>, Path(relay): Path<u32>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let Ok(v) = serde_json::from_slice::<Value>(&body) else { return StatusCode::BAD_REQUEST };
    let id = v["id"].as_i64();
    let aggregate = v["aggregate_id"].as_str().and_then(|s| Uuid::parse_str(s).ok());
    let term = headers.get("outbox-term").and_then(|t| t.to_str().ok()?.parse::<u64>().ok());
    let term = if hook.unfenced { Some(term.unwrap_or(0)) } else { term };
    if hook.unfenced && relay == 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (Some(id), Some(aggregate), Some(term)) = (id, aggregate, term) else { return StatusCode::BAD_REQUEST };
    lock(&hook.got).push(Got { relay, id, aggregate, term, at: Instant::now() });
    StatusCode::OK
}

const INSERT: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                      VALUES ('subscription', $1, 'FreezeTest', '{}') RETURNING id";

/// A producer committing one event every 10 ms over `aggregates` until
/// stopped: each event's id, aggregate and commit time.
struct Producer {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Vec<(i64, Uuid, Instant)>>,
}

impl Producer {
    fn start(c: tokio_postgres::Client, aggregates: usize) -> Producer {
        let aggregates: Vec<Uuid> = (0..aggregates).map(|_| Uuid::new_v4()).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut out = Vec::new();
            let mut i = 0usize;
            while !flag.load(Ordering::SeqCst) {
                let agg = aggregates[i % aggregates.len()];
                let id: i64 = c.query_one(INSERT, &[&agg]).await.expect("insert an event").get(0);
                out.push((id, agg, Instant::now()));
                i += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            out
        });
        Producer { stop, task }
    }

    async fn stop(self) -> Vec<(i64, Uuid, Instant)> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("the producer task")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGSTOP, then SIGCONT.
    Freeze,
    /// The relay's every connection to the database goes through a proxy
    /// that stops passing anything either way and keeps the connections
    /// open (this machine answers the server's keepalives).
    Cut,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Single,
    Partitioned,
    /// Competing mode, of the default subscription or of a named one.
    Competing(Option<&'static str>),
}

/// Two relays of `mode` (the first through a proxy when the fault is a
/// cut), a steady load, the fault on the first relay for [`FAULT`], then
/// everything delivered: the figures, checked against the bound.
async fn replaced_within_the_bound(url: &str, fault: Fault, mode: Mode, wal: bool) {
    let pg: tokio_postgres::Config = url.parse().expect("a URL");
    let user = pg.get_user().unwrap_or("postgres").to_string();
    let db = pg.get_dbname().unwrap_or("postgres").to_string();
    let competing = matches!(mode, Mode::Competing(_));
    let hook = Hook::serve_for(competing).await;
    let mut args: Vec<&str> = Vec::new();
    match mode {
        Mode::Single => {}
        Mode::Partitioned => args.extend(["--mode", "partitioned"]),
        Mode::Competing(subscription) => {
            args.extend(["--mode", "competing"]);
            if let Some(name) = subscription {
                args.extend(["--subscription", name]);
            }
        }
    }
    if wal {
        args.extend(["--source", "wal"]);
    }
    let (sink1, sink2) = (hook.url(1), hook.url(2));
    let proxy = Proxy::start(Target::of_config(&pg)).await;
    let first_url = match fault {
        Fault::Cut => format!("postgres://{user}@127.0.0.1:{}/{db}?connect_timeout=2", proxy.port),
        Fault::Freeze => url.to_string(),
    };
    let spec = |url: &str, sink: &str| {
        let mut a = args.clone();
        a.extend(["--sink", sink]);
        process::Relay::new(support::bin()).url(url).args(&a)
    };
    // A competing relay 1 sends one event at a time (20 ms each), so the
    // claim it holds at the fault still has events it has not sent.
    let a = relay_proc::start_spec(if competing {
        spec(&first_url, &sink1).args(&["--max-in-flight", "1"])
    } else {
        spec(&first_url, &sink1)
    })
    .await;
    let producer = Producer::start(crate::faults::connect(url, "freeze producer", LIVENESS).await, 32);
    eventually(30, "the first relay delivers", || async { hook.got().iter().filter(|g| g.relay == 1).count() >= 50 })
        .await;
    // Competing: a burst of 500 events in one transaction, claimed by
    // relay 1 alone (relay 2 starts once relay 1 sends them): about 10 s of
    // its sends, most of them still unsent at the fault.
    let burst = if competing { claimed_burst(url, &hook).await } else { Vec::new() };
    let b = relay_proc::start_spec(spec(url, &sink2)).await;
    if mode != Mode::Single {
        eventually(30, "both relays deliver", || async {
            let since = Instant::now() - Duration::from_millis(500);
            hook.got().iter().any(|g| g.relay == 2 && g.at >= since)
                && hook.got().iter().any(|g| g.relay == 1 && g.at >= since)
        })
        .await;
    } else {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    let faulted = Instant::now();
    match fault {
        Fault::Freeze => a.send(libc::SIGSTOP).expect("SIGSTOP"),
        Fault::Cut => proxy.freeze(true),
    }
    // The takeover: until another relay delivered each aggregate that only
    // the faulted relay delivered in the second before the fault (competing
    // relays share every aggregate: until the other delivered an event the
    // faulted one had claimed, below).
    let before = hook.got();
    let recent = |relay: u32| -> std::collections::HashSet<Uuid> {
        before
            .iter()
            .filter(|g| g.relay == relay && g.at + Duration::from_secs(1) >= faulted && g.at < faulted)
            .map(|g| g.aggregate)
            .collect()
    };
    let theirs: Vec<Uuid> = if competing { Vec::new() } else { recent(1).difference(&recent(2)).copied().collect() };
    assert!(competing || !theirs.is_empty(), "the faulted relay delivered nothing alone before the fault");
    let deadline = faulted + LIVENESS;
    let takeover = loop {
        let got = hook.got();
        let firsts: Vec<Option<Instant>> = theirs
            .iter()
            .map(|agg| got.iter().find(|g| g.relay != 1 && g.at >= faulted && g.aggregate == *agg).map(|g| g.at))
            .collect();
        if firsts.iter().all(Option::is_some) {
            break firsts.into_iter().flatten().max().unwrap_or(faulted).duration_since(faulted);
        }
        assert!(Instant::now() < deadline, "nobody took over after the fault\n{}\n{}", a.log(), b.log());
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    tokio::time::sleep(FAULT.saturating_sub(faulted.elapsed())).await;
    match fault {
        Fault::Freeze => a.send(libc::SIGCONT).expect("SIGCONT"),
        Fault::Cut => proxy.freeze(false),
    }
    let resumed = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let committed = producer.stop().await;
    let want: Vec<(i64, Uuid)> =
        committed.iter().map(|(id, agg, _)| (*id, *agg)).chain(burst.iter().copied()).collect();
    eventually(90, "every event delivered", || async {
        let got: std::collections::HashSet<i64> = hook.got().iter().map(|g| g.id).collect();
        want.iter().all(|(id, _)| got.contains(id))
    })
    .await;
    let got = hook.got();
    let t = tally(want.iter().copied(), got.iter().map(|g| (g.id, g.aggregate)));
    let mut first: HashMap<i64, Instant> = HashMap::new();
    for g in &got {
        first.entry(g.id).or_insert(g.at);
    }
    // Every event committed from a second before the fault to its end.
    let worst = committed
        .iter()
        .filter(|(_, _, at)| *at + Duration::from_secs(1) >= faulted && *at <= faulted + FAULT)
        .filter_map(|(id, _, at)| first.get(id).map(|d| d.saturating_duration_since(*at)))
        .max()
        .unwrap_or_default();
    // Deliveries of a deposed relay after its successor began: each
    // carries a lower term than one that already arrived for its aggregate.
    // A relay hands nothing out after its lease lapsed, but a send it began
    // within the lease and that the freeze caught before it reached the
    // destination arrives once the relay resumes, with its old term (which
    // a destination refuses by term): such sends arrive at once on resume,
    // at most the sends in flight (64).
    let mut highest: HashMap<Uuid, u64> = HashMap::new();
    let late_at: Vec<Instant> = got
        .iter()
        .filter(|g| {
            let top = highest.entry(g.aggregate).or_insert(0);
            let late = g.term < *top;
            *top = (*top).max(g.term);
            late
        })
        .map(|g| g.at)
        .collect();
    let late = late_at.len();
    let handed_out_late = late_at.iter().filter(|at| **at > resumed + Duration::from_secs(1)).count();
    // Competing: the burst's events still unsent at the fault were
    // claimed by the frozen relay; the takeover is when the last of them
    // was delivered by the other.
    let mut claimed_unsent = 0;
    let takeover = if competing {
        let unsent: Vec<Instant> =
            burst.iter().filter_map(|(id, _)| first.get(id)).filter(|at| **at > faulted).copied().collect();
        claimed_unsent = unsent.len();
        assert!(unsent.len() >= 50, "the frozen relay held {} unsent events of its claim", unsent.len());
        let last = unsent.into_iter().max().unwrap_or(faulted).duration_since(faulted);
        assert!(
            last <= BOUND,
            "the frozen relay's claim was delivered {last:?} after the fault\n{}\n{}",
            a.log(),
            b.log()
        );
        last
    } else {
        takeover
    };
    println!(
        "freeze fault={fault:?} mode={mode:?} source={} worst_wait={:.2}s takeover={:.2}s events={} lost={} \
         duplicates={} order_violations={} late_deliveries={late} claimed_unsent={claimed_unsent}",
        if wal { "wal" } else { "listen" },
        worst.as_secs_f64(),
        takeover.as_secs_f64(),
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations
    );
    let logs = || format!("--- relay 1\n{}\n--- relay 2\n{}", a.log(), b.log());
    assert_eq!(t.lost, 0, "{t:?}\n{}", logs());
    if !competing {
        assert_eq!(t.order_violations, 0, "{t:?}\n{}", logs());
    }
    assert!(
        handed_out_late == 0 && late <= 64,
        "the faulted relay delivered after its successor began: {late}, {handed_out_late} of them more than 1 s after \
         it resumed\n{}",
        logs()
    );
    assert!(worst <= BOUND, "an event waited {worst:?} from its commit to its delivery\n{}", logs());
    b.stop().await;
    a.stop().await;
}

/// A burst of 500 events in one transaction, over 8 aggregates, and relay
/// 1 delivering them (it claimed them: a competing relay claims up to its
/// batch, 500); their ids and aggregates.
async fn claimed_burst(url: &str, hook: &Hook) -> Vec<(i64, Uuid)> {
    let c = crate::faults::connect(url, "freeze burst", LIVENESS).await;
    let rows = c
        .query(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'subscription', md5('burst-' || (g % 8))::uuid, 'FreezeTest', '{}' \
             FROM generate_series(1, 500) g RETURNING id, aggregate_id",
            &[],
        )
        .await
        .expect("insert the burst");
    let burst: Vec<(i64, Uuid)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let ids: std::collections::HashSet<i64> = burst.iter().map(|b| b.0).collect();
    eventually(30, "relay 1 sends the burst", || async {
        hook.got().iter().filter(|g| g.relay == 1 && ids.contains(&g.id)).count() >= 5
    })
    .await;
    burst
}

async fn on_the_machine(name: &str, fault: Fault, mode: Mode) {
    let db = TestDb::new(name).await;
    if let Mode::Competing(Some(subscription)) = mode {
        crate::subscriptions::create(&db.client().await, subscription).await;
    }
    if support::server_version_num(&db.client().await).await < 140_000 && !matches!(mode, Mode::Competing(_)) {
        return warned_on_13(&db).await;
    }
    replaced_within_the_bound(&db.url(), fault, mode, false).await;
}

/// PostgreSQL 13 has no `idle_session_timeout`: the leader says, as it
/// takes the outbox, that a frozen or cut-off leader is not replaced.
async fn warned_on_13(db: &TestDb) {
    let hook = Hook::serve().await;
    let mut a = relay_proc::start(db, &["--sink", &hook.url(1)]).await;
    a.wait_signal(&["no_idle_session_timeout"], LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
    println!("freeze server=13 warned=true (a frozen leader is not replaced without --take-over-stranded)");
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_is_replaced_within_10s_at_default_settings() {
    on_the_machine("freeze_single", Fault::Freeze, Mode::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_is_replaced_within_10s_at_default_settings() {
    on_the_machine("cut_single", Fault::Cut, Mode::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_partition_member_is_replaced_within_10s_at_default_settings() {
    on_the_machine("freeze_partitioned", Fault::Freeze, Mode::Partitioned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_member_cut_off_is_replaced_within_10s_at_default_settings() {
    on_the_machine("cut_partitioned", Fault::Cut, Mode::Partitioned).await;
}

/// Competing mode holds no leadership, but a claim: the server ends a
/// frozen relay's session once its claim transaction sits idle for 4 s
/// (`idle_in_transaction_session_timeout`, every supported server), and
/// the other relay delivers what it had claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_competing_relay_hands_its_claim_over_within_10s_at_default_settings() {
    on_the_machine("freeze_competing", Fault::Freeze, Mode::Competing(None)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_competing_relay_of_a_subscription_hands_its_claim_over_within_10s_at_default_settings() {
    on_the_machine("freeze_competing_sub", Fault::Freeze, Mode::Competing(Some("audit"))).await;
}

#[cfg(feature = "wal")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_of_the_wal_source_is_replaced_within_10s_at_default_settings() {
    let server = tokio::task::spawn_blocking(|| {
        TempServer::start_with(TempServerOptions::default().setting("wal_level", "logical"))
    })
    .await
    .expect("start task")
    .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {}", pg_outbox::error::report(&e)));
    let admin = crate::faults::connect(&server.url(), "freeze admin", LIVENESS).await;
    admin.batch_execute("CREATE DATABASE freeze_wal").await.expect("create database");
    let url = server.url_for("freeze_wal");
    let out = support::cli(&["migrate", "--source", "wal"]).url(&url).run().await;
    assert!(out.ok(), "migrate: {}", out.stderr);
    replaced_within_the_bound(&url, Fault::Freeze, Mode::Single, true).await;
}

/// The work session backends of relays on `db` (`pg-outbox drain`).
pub(crate) async fn drain_pids(c: &tokio_postgres::Client) -> Vec<i32> {
    c.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'pg-outbox drain'",
        &[],
    )
    .await
    .expect("read pg_stat_activity")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// A live leader keeps its session however quiet it is: with the sweep at
/// once an hour and no events, nothing but the keep-alive runs on its work
/// session between heartbeats 5 s apart, longer than the 4 s the server
/// allows it idle. Its session (and leadership) stays, and it delivers.
#[tokio::test]
async fn a_quiet_leader_keeps_its_session_and_its_leadership() {
    use futures::StreamExt;
    let db = TestDb::new("freeze_quiet_leader").await;
    let c = db.client().await;
    let mut stream = pg_outbox::Consumer::builder(db.options())
        .sweep_interval(Duration::from_secs(3600))
        .start()
        .await
        .expect("start a consumer");
    eventually(20, "it leads", || async { stream.health().get().role == pg_outbox::health::Role::Leader }).await;
    let before = drain_pids(&c).await;
    assert_eq!(before.len(), 1, "{before:?}");
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(drain_pids(&c).await, before, "the work session was ended while its relay was live");
    assert_eq!(stream.health().get().role, pg_outbox::health::Role::Leader);
    support::insert_seed_events(&c, Uuid::new_v4(), 1).await;
    let d = tokio::time::timeout(Duration::from_secs(10), stream.next()).await.expect("delivered").expect("open");
    d.ack();
    stream.finish().await.expect("finish");
}

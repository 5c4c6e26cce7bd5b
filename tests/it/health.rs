//! The relay's health probes, `/livez` and `/readyz`, against real
//! processes and real faults:
//!
//! - PostgreSQL (a throwaway server) stopped: `/readyz` turns 503 within
//!   [`DOWN_BOUND`] while `/livez` stays 200, and back to 200 within
//!   [`UP_BOUND`] after the server starts again;
//! - a webhook that never answers: `/readyz` stays 200 and says the sink is
//!   degraded, with the timeout as its last error;
//! - the drain loop stuck in a statement whose reply never comes (a TCP
//!   path between relay and server that stops forwarding, as a hung
//!   middlebox does): `/livez` turns 503 once the stall bound has passed,
//!   and 200 again when the path forwards again; nothing is lost;
//! - the delivery loop stuck (the stdout sink, which has no timeout, with a
//!   reader that stopped reading): degraded past `--sink-timeout`, `/livez`
//!   503 past the stall bound plus the sink timeout while the drain loop
//!   still turns, and 200 once the reader reads again;
//! - roles: a leader and a standby (both 200), partitioned and competing
//!   relays; `--health-addr` serves the probes without `/metrics`; a taken
//!   probe port stops the relay at start.
//!
//! Every body fetched is parsed as JSON and searched for the secrets the
//! test put into the URLs and flags. About 25 s in all on two cores.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{self, Proxy, Target, TestDb};
use pg_outbox_testkit::TempServer;
use pg_outbox_testkit::process::{self, LIVENESS};

/// How soon `/readyz` must say 503 after the server went away: the
/// sessions' sockets close with the server, and the next turn of the drain
/// loop (at most a sweep interval, 200 ms here) gives them up.
const DOWN_BOUND: Duration = Duration::from_secs(5);
/// How soon `/readyz` must say 200 after the server is back: the reconnect
/// backoff's next attempt (100 ms doubling, so about as long as the outage
/// lasted so far; at most 30 s), then the connect.
const UP_BOUND: Duration = Duration::from_secs(35);

/// Secrets the tests give the relay (URLs, flags); no body may hold one.
const SECRETS: [&str; 5] =
    ["pgsecret-7f3a", "hookpw-91c2", "tok-5e8d", "whsec_c2VjcmV0LWtleS1mb3ItdGhlLWhlYWx0aC1wcm9iZSE=", "bearer-44af"];

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().expect("HTTP client")
}

/// GET `path` on 127.0.0.1:`port`: the status and the body as JSON (which
/// it must be), checked for secrets.
pub(crate) async fn probe(port: u16, path: &str) -> (u16, Value) {
    let resp = http()
        .get(format!("http://127.0.0.1:{port}{path}"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path} on port {port}: {e}"));
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("probe body");
    for s in SECRETS {
        assert!(!text.contains(s), "a secret in the body of {path}: {text}");
    }
    let body: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} is not JSON ({e}): {text}"));
    (status, body)
}

/// Probe `path` until `want` holds (polling every 50 ms) or `limit` passes;
/// the last answer and when it came.
pub(crate) async fn probe_until(
    port: u16,
    path: &str,
    limit: Duration,
    want: impl Fn(u16, &Value) -> bool,
) -> (u16, Value) {
    let deadline = Instant::now() + limit;
    loop {
        let (status, body) = probe(port, path).await;
        if want(status, &body) {
            return (status, body);
        }
        assert!(Instant::now() < deadline, "{path} never got as expected within {limit:?}; last: {status} {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn relay(url: &str, port: u16) -> process::Relay {
    process::Relay::new(support::bin()).url(url).args(&["--metrics-addr", &port.to_string()])
}

async fn start(spec: process::Relay) -> process::RelayProc {
    spec.start().await.unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_503_while_postgres_is_down_and_200_once_it_is_back() {
    let mut server = tokio::task::spawn_blocking(TempServer::start)
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {}", pg_outbox::error::report(&e)));
    let admin = support::cli(&["migrate"]).url(&server.url_for("postgres")).run().await;
    assert!(admin.ok(), "migrate: {}", admin.stderr);
    // The server trusts local connections, so the password is never
    // checked; it is there to be kept out of the bodies.
    let url = format!("postgres://postgres:{}@127.0.0.1:{}/postgres", SECRETS[0], server.port());
    let port = process::free_port();
    let mut relay = start(relay(&url, port).args(&["--sweep-interval", "200ms"])).await;
    let (_, body) = probe_until(port, "/readyz", LIVENESS, |s, b| s == 200 && b["role"] == "leader").await;
    assert_eq!(body["status"], "ready", "{body}");
    assert_eq!(body["checks"]["database"]["status"], "ok", "{body}");
    assert_eq!(body["checks"]["schema"]["status"], "ok", "{body}");

    let mut server = tokio::task::spawn_blocking(move || {
        server.stop().unwrap_or_else(|e| panic!("stop: {}", pg_outbox::error::report(&e)));
        server
    })
    .await
    .expect("join");
    let stopped = Instant::now();
    let (_, body) = probe_until(port, "/readyz", DOWN_BOUND, |s, _| s == 503).await;
    let took_down = stopped.elapsed();
    assert_eq!(body["status"], "not_ready", "{body}");
    assert_eq!(body["checks"]["database"]["status"], "fail", "{body}");
    assert_eq!(body["checks"]["database"]["connected"], false, "{body}");
    assert_eq!(body["last_error"]["source"], "database", "{body}");
    // The outage is the database's, not the relay's: it stays live (a
    // restart would not help), and keeps saying it, for a while.
    for _ in 0..5 {
        let (status, live) = probe(port, "/livez").await;
        assert_eq!((status, &live["status"]), (200, &Value::from("live")), "{live}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, down) = probe(port, "/readyz").await;
    assert_eq!(status, 503, "{down}");
    assert!(down["checks"]["database"]["disconnected_seconds"].as_f64().is_some_and(|s| s > 0.5), "{down}");

    let server = tokio::task::spawn_blocking(move || {
        server.start_again().unwrap_or_else(|e| panic!("start again: {}", pg_outbox::error::report(&e)));
        server
    })
    .await
    .expect("join");
    let restarted = Instant::now();
    // Ready again as the leader: the database answers first (a standby is
    // ready too), then the relay takes its lock back.
    let (_, body) = probe_until(port, "/readyz", UP_BOUND, |s, b| s == 200 && b["role"] == "leader").await;
    let took_up = restarted.elapsed();
    assert_eq!(body["checks"]["database"]["status"], "ok", "{body}");
    // The last error stays for the operator, as the database's.
    let message = body["last_error"]["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{body}");
    println!("health: /readyz 503 {took_down:?} after the server stopped, 200 {took_up:?} after it started again");
    relay.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!relay.log().contains(SECRETS[0]), "the database password in the log");
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

/// A webhook that takes requests and never answers.
async fn silent_webhook() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the webhook");
    let port = listener.local_addr().expect("address").port();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(|| async {
            std::future::pending::<()>().await;
            "never"
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_sink_shows_as_degraded_and_the_relay_stays_ready() {
    let db = TestDb::new("health_hanging_sink").await;
    let hook = silent_webhook().await;
    let sink = format!("http://user:{}@127.0.0.1:{hook}/hook?token={}", SECRETS[1], SECRETS[2]);
    let port = process::free_port();
    let spec = relay(&db.url(), port).args(&[
        "--sink",
        &sink,
        "--sink-timeout",
        "300ms",
        "--webhook-secret",
        SECRETS[3],
        "--webhook-header",
        &format!("Authorization: Bearer {}", SECRETS[4]),
    ]);
    let mut relay = start(spec).await;
    let (status, body) = probe_until(port, "/readyz", LIVENESS, |s, _| s == 200).await;
    assert_eq!((status, &body["status"]), (200, &Value::from("ready")), "{body}");
    assert_eq!(body["checks"]["sink"]["status"], "ok", "{body}");

    let c = db.client().await;
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let (status, body) =
        probe_until(port, "/readyz", LIVENESS, |_, b| b["checks"]["sink"]["status"] == "degraded").await;
    assert_eq!(status, 200, "a sink's trouble does not make the relay unready: {body}");
    assert_eq!(body["status"], "degraded", "{body}");
    let sink = &body["checks"]["sink"];
    assert!(sink["consecutive_failures"].as_u64().is_some_and(|n| n >= 1), "{body}");
    assert_eq!(sink["last_success_seconds_ago"], Value::Null, "{body}");
    assert_eq!(sink["name"], format!("webhook http://127.0.0.1:{hook}/hook?****"), "{body}");
    let error = sink["last_error"]["message"].as_str().unwrap_or_default();
    assert!(error.contains("timed out") || error.contains("timeout"), "the timeout as the sink's error: {body}");
    assert_eq!(body["last_error"]["source"], "sink", "{body}");
    assert_eq!(body["checks"]["database"]["status"], "ok", "{body}");
    let (status, live) = probe(port, "/livez").await;
    assert_eq!(status, 200, "{live}");
    // The failed attempt is recorded, not published.
    assert_eq!(support::published_count(&c).await, 0);
    relay.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
    for s in SECRETS {
        assert!(!relay.log().contains(s), "a secret in the log");
    }
}

// ------------------------------------------------------------- a stuck path

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_loop_stuck_in_a_statement_fails_livez_until_it_turns_again() {
    let db = TestDb::new("health_stuck").await;
    let proxy = Proxy::start(Target::of(&db)).await;
    let url = proxy.url(&db);
    let port = process::free_port();
    // Stall bound: 2 x 1 s (statement timeout) + 2 x 1 s (connect timeout)
    // + 2 x 100 ms (sweep interval) = 4.2 s.
    let spec = relay(&url, port).stdout(process::Output::Piped).args(&[
        "--statement-timeout",
        "1s",
        "--sweep-interval",
        "100ms",
    ]);
    let mut relay = start(spec).await;
    let (_, body) = probe_until(port, "/livez", LIVENESS, |s, _| s == 200).await;
    assert_eq!(body["drain_loop"]["stall_bound_seconds"], 4.2, "{body}");
    probe_until(port, "/readyz", LIVENESS, |s, b| s == 200 && b["role"] == "leader").await;

    proxy.freeze(true);
    let frozen = Instant::now();
    // An event committed meanwhile (directly, not through the proxy) must
    // not be lost.
    let c = db.client().await;
    let ids = support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let (_, body) = probe_until(port, "/livez", Duration::from_secs(15), |s, _| s == 503).await;
    let took = frozen.elapsed();
    assert_eq!(body["status"], "stalled", "{body}");
    let since = body["drain_loop"]["last_turn_seconds_ago"].as_f64().unwrap_or_default();
    assert!(since > 4.2, "503 only past the stall bound: {body}");
    // The loop's last turn came at most one sweep interval (100 ms, +10 %)
    // before the path froze.
    assert!(took >= Duration::from_millis(4200 - 110), "not before the bound ({took:?})");
    let (status, ready) = probe(port, "/readyz").await;
    assert_eq!(status, 503, "a stalled relay is not ready either: {ready}");
    assert_eq!(ready["checks"]["drain_loop"]["status"], "fail", "{ready}");
    relay.check_running().await.unwrap_or_else(|e| panic!("{e}"));

    proxy.freeze(false);
    let thawed = Instant::now();
    let (_, body) = probe_until(port, "/livez", Duration::from_secs(15), |s, _| s == 200).await;
    println!("health: /livez 503 {took:?} after the path froze; 200 {:?} after it thawed", thawed.elapsed());
    assert_eq!(body["status"], "live", "{body}");
    let mut out = tokio::io::BufReader::new(relay.stdout.take().expect("stdout piped"));
    let mut line = String::new();
    tokio::time::timeout(LIVENESS, tokio::io::AsyncBufReadExt::read_line(&mut out, &mut line))
        .await
        .expect("the event committed during the stall is delivered")
        .expect("read stdout");
    let v: Value = serde_json::from_str(&line).expect("a JSON record");
    assert_eq!(v["id"], ids[0], "{line}");
    relay.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
}

/// Events for the stuck-delivery test: far more than a pipe holds (64 KiB;
/// a record is about 300 bytes).
const PIPE_FILLER: i64 = 3000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_stuck_past_its_bound_fails_livez_and_a_slow_one_is_degraded() {
    let db = TestDb::new("health_stuck_delivery").await;
    let url = db.url();
    let url = if url.starts_with("postgres://") {
        format!("{url}?connect_timeout=1")
    } else {
        format!("{url} connect_timeout=1")
    };
    let port = process::free_port();
    // The stdout sink has no timeout: a reader that stops reading holds the
    // delivery in hand. Stall bound 4.2 s (as above); a delivery counts as
    // stuck past 4.2 s + 1 s (--sink-timeout) = 5.2 s.
    let spec = relay(&url, port).stdout(process::Output::Piped).args(&[
        "--statement-timeout",
        "1s",
        "--sweep-interval",
        "100ms",
        "--sink-timeout",
        "1s",
    ]);
    let mut relay = start(spec).await;
    probe_until(port, "/readyz", LIVENESS, |s, _| s == 200).await;
    let c = db.client().await;
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), PIPE_FILLER).await;

    // Past --sink-timeout: degraded, still ready and live.
    let (status, body) =
        probe_until(port, "/readyz", LIVENESS, |_, b| b["checks"]["sink"]["status"] == "degraded").await;
    assert_eq!((status, &body["status"]), (200, &"degraded".into()), "{body}");
    let sink = &body["checks"]["sink"];
    // Past 1 s, shown to the millisecond: 1.0004 s reads as 1.0.
    assert!(sink["in_flight_seconds"].as_f64().is_some_and(|s| s >= 1.0), "{body}");
    assert_eq!(sink["consecutive_failures"], 0, "{body}");
    // Past the delivery bound: /livez fails, though the drain loop turns.
    let (_, live) = probe_until(port, "/livez", Duration::from_secs(15), |s, _| s == 503).await;
    assert_eq!(live["status"], "stalled", "{live}");
    assert_eq!(live["drain_loop"]["status"], "ok", "{live}");
    assert_eq!(live["delivery"]["status"], "fail", "{live}");
    assert_eq!(live["delivery"]["stall_bound_seconds"], 5.2, "{live}");
    assert!(live["delivery"]["in_flight_seconds"].as_f64().is_some_and(|s| s > 5.2), "{live}");
    let (status, ready) = probe(port, "/readyz").await;
    assert_eq!((status, &ready["checks"]["delivery"]["status"]), (503, &"fail".into()), "{ready}");

    // The reader reads again: every event arrives, and the relay is live.
    let out = relay.stdout.take().expect("stdout piped");
    let reader = tokio::spawn(async move {
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(out));
        let mut n = 0;
        while n < PIPE_FILLER {
            match lines.next_line().await {
                Ok(Some(_)) => n += 1,
                _ => break,
            }
        }
        (n, lines)
    });
    probe_until(port, "/livez", LIVENESS, |s, _| s == 200).await;
    let (n, _lines) = tokio::time::timeout(LIVENESS, reader).await.expect("all delivered").expect("reader");
    assert_eq!(n, PIPE_FILLER);
    support::eventually(30, "every event published", || async { support::published_count(&c).await == PIPE_FILLER })
        .await;
    relay.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_ready_and_says_so_and_each_mode_names_its_role() {
    let db = TestDb::new("health_roles").await;
    let (p1, p2) = (process::free_port(), process::free_port());
    let mut leader = start(relay(&db.url(), p1)).await;
    probe_until(p1, "/readyz", LIVENESS, |s, b| s == 200 && b["role"] == "leader").await;
    // The standby serves the probes on --health-addr alone.
    let mut standby =
        start(process::Relay::new(support::bin()).url(&db.url()).args(&["--health-addr", &p2.to_string()])).await;
    let (status, body) = probe_until(p2, "/readyz", LIVENESS, |_, b| b["checks"]["database"]["status"] == "ok").await;
    assert_eq!(status, 200, "a standby is ready: {body}");
    assert_eq!((&body["role"], &body["status"], &body["mode"]), (&"standby".into(), &"ready".into(), &"single".into()));
    let (status, _) = probe(p2, "/livez").await;
    assert_eq!(status, 200);
    let metrics = http().get(format!("http://127.0.0.1:{p2}/metrics")).send().await.expect("GET /metrics");
    assert_eq!(metrics.status().as_u16(), 404, "--health-addr serves no metrics");
    let metrics = http().get(format!("http://127.0.0.1:{p1}/metrics")).send().await.expect("GET /metrics");
    let text = metrics.text().await.expect("metrics");
    assert!(text.contains("outbox_leader 1"), "{text}");
    // The standby takes over when the leader goes.
    leader.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
    probe_until(p2, "/readyz", LIVENESS, |s, b| s == 200 && b["role"] == "leader").await;
    standby.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));

    let db = TestDb::new("health_partitioned").await;
    let mut partitioned = start(relay(&db.url(), p1).args(&["--mode", "partitioned", "--partitions", "4"])).await;
    let (status, body) =
        probe_until(p1, "/readyz", LIVENESS, |_, b| b["partitions"]["held"].as_array().is_some_and(|h| h.len() == 4))
            .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!((&body["role"], &body["partitions"]["of"]), (&"partitioned".into(), &4.into()), "{body}");
    partitioned.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));

    let db = TestDb::new("health_competing").await;
    let mut competing = start(relay(&db.url(), p1).args(&["--mode", "competing"])).await;
    let (status, body) = probe_until(p1, "/readyz", LIVENESS, |s, _| s == 200).await;
    assert_eq!((status, &body["role"]), (200, &"competing".into()), "{body}");
    competing.terminate(LIVENESS).await.unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test]
async fn a_taken_probe_port_stops_the_relay_at_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("address").port();
    let out = support::cli(&["relay", "--health-addr", &port.to_string()])
        .url("postgres://postgres@127.0.0.1:1/none")
        .run()
        .await;
    assert!(!out.ok(), "{}", out.stderr);
    assert!(out.stderr.contains(&format!("cannot serve health probes on 127.0.0.1:{port}")), "{}", out.stderr);
}

//! `contrib/`: the Grafana dashboard and the Prometheus alert rules use only
//! metric names a real relay exports, every exported metric is shown
//! somewhere, and both files parse.

use std::collections::BTreeSet;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::Value;
use uuid::Uuid;

use crate::relay_proc::{self, LIVENESS, free_port};
use crate::support::{self, TestDb};

const DASHBOARD: &str = include_str!("../../contrib/grafana/pg-outbox.json");
const ALERTS: &str = include_str!("../../contrib/prometheus/alerts.yml");
const METRICS_RS: &str = include_str!("../../src/metrics.rs");
/// The prose that names metrics.
const DOCS: [(&str, &str); 4] = [
    ("docs/operations.md", include_str!("../../docs/operations.md")),
    ("docs/architecture.md", include_str!("../../docs/architecture.md")),
    ("README.md", include_str!("../../README.md")),
    ("src/guide.md", include_str!("../../src/guide.md")),
];

/// Every `outbox_...` name in `text`.
fn outbox_names(text: &str) -> BTreeSet<String> {
    let re = regex::Regex::new(r"outbox_[a-z_]+").expect("regex");
    re.find_iter(text).map(|m| m.as_str().to_string()).collect()
}

/// `name` without the `_bucket`/`_sum`/`_count` suffix the Prometheus
/// exporter adds to histogram series.
fn base_name(name: &str) -> &str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            return base;
        }
    }
    name
}

/// PromQL expressions in the dashboard (every panel target).
fn dashboard_exprs(dash: &Value) -> Vec<String> {
    let panels = dash["panels"].as_array().expect("the dashboard has panels");
    let mut exprs = Vec::new();
    for p in panels {
        if p["type"] == "row" {
            continue;
        }
        let title = p["title"].as_str().unwrap_or_else(|| panic!("a panel has a title: {p}"));
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("panel {title} has targets"));
        assert!(!targets.is_empty(), "panel {title} has no query");
        for t in targets {
            let e = t["expr"].as_str().unwrap_or_else(|| panic!("panel {title}: a target without expr: {t}"));
            exprs.push(e.to_string());
        }
    }
    exprs
}

/// Alert rule expressions, after checking each rule's shape.
fn alert_exprs(rules: &serde_yaml::Value) -> Vec<String> {
    let groups = rules["groups"].as_sequence().expect("alerts.yml has groups");
    let mut exprs = Vec::new();
    for g in groups {
        for r in g["rules"].as_sequence().expect("a group has rules") {
            let name = r["alert"].as_str().unwrap_or_else(|| panic!("a rule without `alert`: {r:?}"));
            let expr = r["expr"].as_str().unwrap_or_else(|| panic!("{name}: no expr"));
            let severity = r["labels"]["severity"].as_str().unwrap_or_else(|| panic!("{name}: no severity label"));
            assert!(["warning", "critical"].contains(&severity), "{name}: severity {severity}");
            assert!(r["annotations"]["summary"].as_str().is_some(), "{name}: no summary");
            if let Some(f) = r.get("for") {
                let f = f.as_str().unwrap_or_else(|| panic!("{name}: `for` is a duration string"));
                humantime::parse_duration(f).unwrap_or_else(|e| panic!("{name}: for: {f}: {e}"));
            }
            exprs.push(expr.to_string());
        }
    }
    exprs
}

/// Brackets balance: a cheap guard against a mangled expression.
fn assert_balanced(expr: &str) {
    let mut stack = Vec::new();
    for c in expr.chars() {
        match c {
            '(' | '{' | '[' => stack.push(c),
            ')' | '}' | ']' => {
                let open = stack.pop().unwrap_or_else(|| panic!("unbalanced {c} in {expr}"));
                assert_eq!(open, matches_open(c), "mismatched {open}{c} in {expr}");
            }
            _ => {}
        }
    }
    assert!(stack.is_empty(), "unclosed {stack:?} in {expr}");
}

fn matches_open(close: char) -> char {
    match close {
        ')' => '(',
        '}' => '{',
        _ => '[',
    }
}

/// Sample names (before `{` or a space) and `# TYPE` names of a scrape.
fn scraped_names(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut samples = BTreeSet::new();
    let mut types = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.split_whitespace().next() {
                types.insert(name.to_string());
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            samples.insert(line[..end].to_string());
        }
    }
    (samples, types)
}

#[test]
fn contrib_files_parse_and_every_exported_metric_is_shown() {
    let dash: Value = serde_json::from_str(DASHBOARD).expect("contrib/grafana/pg-outbox.json is JSON");
    assert_eq!(dash["title"], "pg-outbox");
    let rules: serde_yaml::Value = serde_yaml::from_str(ALERTS).expect("contrib/prometheus/alerts.yml is YAML");
    for e in dashboard_exprs(&dash).iter().chain(&alert_exprs(&rules)) {
        assert_balanced(e);
    }
    let exported: BTreeSet<String> =
        outbox_names(METRICS_RS).into_iter().filter(|n| METRICS_RS.contains(&format!("\"{n}\""))).collect();
    assert!(exported.len() >= 20, "the metric names of src/metrics.rs: {exported:?}");
    let used: BTreeSet<String> =
        outbox_names(&format!("{DASHBOARD}\n{ALERTS}")).iter().map(|n| base_name(n).to_string()).collect();
    let unshown: Vec<&String> = exported.difference(&used).collect();
    assert!(unshown.is_empty(), "metrics neither on the dashboard nor in an alert: {unshown:?}");
    let unknown: Vec<&String> = used.difference(&exported).collect();
    assert!(unknown.is_empty(), "contrib names metrics the code does not define: {unknown:?}");
    // Alerts cover what docs/operations.md promises: backlog age, dead letters,
    // notifications, relay down, retention.
    let alerts = alert_exprs(&rules).join("\n");
    for needle in [
        pg_outbox::metrics::OLDEST_UNPUBLISHED_AGE,
        pg_outbox::metrics::DEAD_LETTERS,
        pg_outbox::metrics::NOTIFICATIONS_WORKING,
        pg_outbox::metrics::LISTENER_UP,
        "up{",
        "absent(",
        pg_outbox::metrics::RETENTION_ERRORS,
        pg_outbox::metrics::RETENTION_LAST_RUN,
        pg_outbox::metrics::LEADER_STRANDED,
    ] {
        assert!(alerts.contains(needle), "no alert uses {needle}");
    }
}

#[test]
fn the_docs_name_only_metrics_of_src_metrics_rs() {
    let defined: BTreeSet<String> =
        outbox_names(METRICS_RS).into_iter().filter(|n| METRICS_RS.contains(&format!("\"{n}\""))).collect();
    // A metric's name ends in its unit or kind; tables, indexes and
    // triggers named `outbox_...` do not.
    let re = regex::Regex::new(
        r"\boutbox_[a-z_]+_(total|seconds|ratio|events|bytes|up|working|leader|stranded|letters|estimated)\b",
    )
    .expect("regex");
    for (file, text) in DOCS {
        for m in re.find_iter(text) {
            let name = base_name(m.as_str());
            assert!(defined.contains(name), "{file} names the metric {name}, which src/metrics.rs does not define");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_in_contrib_is_exported_by_a_running_relay() {
    let db = TestDb::new("contrib_metrics").await;
    let c = db.client().await;
    // Old published rows, for the retention run at start.
    let old = support::insert_seed_events(&c, Uuid::new_v4(), 3).await;
    c.execute("UPDATE events.outbox SET published_at = now() - interval '40 days' WHERE id = ANY($1)", &[&old])
        .await
        .expect("age rows");
    // A subscription past them, with a lag bound: the relay reports its lag.
    c.execute(
        "INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id, options) \
         SELECT 'audit', max(id), max(id), '{\"max_lag_seconds\": 3600}' FROM events.outbox",
        &[],
    )
    .await
    .expect("a subscription");

    // A webhook that refuses `Poison` events and accepts the rest.
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(|body: Bytes| async move {
            if String::from_utf8_lossy(&body).contains("\"Poison\"") {
                (StatusCode::INTERNAL_SERVER_ERROR, "refused")
            } else {
                (StatusCode::OK, "ok")
            }
        }),
    );
    let hook = crate::support::serve_hook(app).await;

    let addr = format!("127.0.0.1:{}", free_port());
    let relay = relay_proc::start(
        &db,
        &[
            "--sink",
            &hook,
            "--metrics-addr",
            &addr,
            "--retry-schedule",
            "50ms",
            "--max-retries",
            "2",
            "--sweep-interval",
            "100ms",
            "--retention",
            "30d",
            "--retention-at-start",
        ],
    )
    .await;
    support::insert_seed_events(&c, Uuid::new_v4(), 4).await;
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('subscription', $1, 'Poison', '{}')",
        &[&Uuid::new_v4()],
    )
    .await
    .expect("insert the poison event");

    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("HTTP client");
    let url = format!("http://{addr}/metrics");
    let contrib = format!("{DASHBOARD}\n{ALERTS}");
    let wanted = outbox_names(&contrib);
    assert!(wanted.len() >= 20, "names found in contrib: {wanted:?}");
    let deadline = tokio::time::Instant::now() + LIVENESS;
    // Scrape until the run has produced what the contrib files show: 4
    // deliveries, a dead letter, a retention run that deleted the 3 old rows.
    let text = loop {
        let body = match http.get(&url).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(e) => format!("GET {url} failed: {e}"),
        };
        let value = |name: &str| {
            body.lines()
                .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
                .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
                .sum::<f64>()
        };
        if value(pg_outbox::metrics::EVENTS_PUBLISHED) >= 4.0
            && value(pg_outbox::metrics::EVENTS_DEAD_LETTERED) >= 1.0
            && value(pg_outbox::metrics::RETENTION_DELETED) >= 3.0
            && value(pg_outbox::metrics::DEAD_LETTERS) >= 1.0
        {
            break body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay never got there; last scrape:\n{body}\nlog:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let (samples, types) = scraped_names(&text);
    let missing: Vec<&String> = wanted.iter().filter(|n| !samples.contains(*n)).collect();
    assert!(missing.is_empty(), "contrib uses metrics the relay does not export: {missing:?}\nscrape:\n{text}");
    let untyped: Vec<&str> = wanted.iter().map(|n| base_name(n)).filter(|b| !types.contains(*b)).collect();
    assert!(untyped.is_empty(), "no # TYPE line for {untyped:?}\nscrape:\n{text}");
    // The retention run at start deleted the old rows and stamped its time.
    let left: i64 = c
        .query_one("SELECT count(*) FROM events.outbox WHERE id = ANY($1)", &[&old])
        .await
        .expect("count old rows")
        .get(0);
    assert_eq!(left, 0, "retention at start deleted the 40-day-old published rows");
    let stamp = text
        .lines()
        .find(|l| l.starts_with("outbox_retention_last_run_timestamp_seconds "))
        .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no retention timestamp:\n{text}"));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    assert!((now - stamp).abs() < 120.0, "the last-run timestamp is recent Unix time: {stamp} vs {now}");
    assert!(relay.log().contains("retention done"), "{}", relay.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_relay_exports_its_counters_and_gauges_before_any_event() {
    let db = TestDb::new("contrib_zero").await;
    let addr = format!("127.0.0.1:{}", free_port());
    let _relay = relay_proc::start(&db, &["--sink", "stdout", "--metrics-addr", &addr]).await;
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("HTTP client");
    let text = http.get(format!("http://{addr}/metrics")).send().await.expect("scrape").text().await.expect("body");
    let (samples, _) = scraped_names(&text);
    use pg_outbox::metrics as m;
    for name in [
        m::EVENTS_PUBLISHED,
        m::EVENTS_FAILED,
        m::EVENTS_DEAD_LETTERED,
        m::EVENTS_RELEASED,
        m::EVENTS_FETCHED,
        m::NOTIFICATIONS,
        m::SWEEPS,
        m::LISTENER_RECONNECTS,
        m::DATABASE_ERRORS,
        m::RETENTION_DELETED,
        m::RETENTION_ERRORS,
        m::BACKLOG,
        m::DEAD_LETTERS,
        m::OLDEST_UNPUBLISHED_AGE,
        m::LISTENER_UP,
        m::LEADER,
        m::LEADER_STRANDED,
        m::PARTITIONS_OWNED,
        m::NOTIFICATION_QUEUE_USAGE,
        m::NOTIFICATIONS_WORKING,
        m::WAITING_FOR_NOTIFICATIONS,
    ] {
        assert!(samples.contains(name), "{name} is not exported before the first event:\n{text}");
    }
    for wake in m::FETCH_WAKES {
        assert!(text.contains(&format!("outbox_events_fetched_total{{wake=\"{wake}\"}}")), "wake={wake}:\n{text}");
    }
    // Without --retention there is no last-run time (a 0 would read as 1970).
    assert!(!samples.contains(m::RETENTION_LAST_RUN), "{text}");
}

//! `pg-outbox replay` end to end: exactly the selected published events, in
//! id order, once, to stdout and to a webhook; filters; a sink failure and a
//! SIGTERM each stop it with the id to resume from, and resuming leaves no
//! gap; the table is unchanged, byte for byte, afterwards; bad input is a
//! one-line error. And `--log-format json`: every stderr line of a relay's
//! run (failing events, SIGTERM) and of a replay is one JSON object with the
//! documented keys.

use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio_postgres::Client;
use uuid::Uuid;

use crate::relay_proc::{self, LIVENESS};
use crate::support::{self, DbCli, TestDb};

/// One row of the test table, as the test made it.
#[derive(Debug, Clone)]
struct Row {
    id: i64,
    aggregate_type: String,
    aggregate_id: Uuid,
    event_type: String,
    occurred_at: DateTime<Utc>,
    published: bool,
}

/// The four aggregates of the test table.
fn aggregate(n: i64) -> Uuid {
    Uuid::from_u128(0x5eed_0000 + (n % 4) as u128)
}

/// Load `n` events: aggregate types `order`/`invoice` alternating, four
/// aggregates, every third `Paid` (else `Created`), one minute apart from
/// 2026-01-01T00:00Z; every tenth (7, 17, ...) unpublished, the 17th a dead
/// letter; then a gap of 25 000 ids and `tail` more published events (so a
/// full replay crosses a gap wider than its read window).
async fn load(c: &Client, n: i64, tail: i64) -> Vec<Row> {
    let insert = |from: i64, to: i64| {
        format!(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at, published_at, \
                                        retry_count, next_retry_at, last_error) \
             SELECT CASE WHEN g % 2 = 0 THEN 'order' ELSE 'invoice' END, \
                    ('00000000-0000-0000-0000-0000' || lpad(to_hex(x'5eed0000'::int + g % 4), 8, '0'))::uuid, \
                    CASE WHEN g % 3 = 0 THEN 'Paid' ELSE 'Created' END, \
                    jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g)), \
                    t, CASE WHEN g % 10 = 7 THEN NULL ELSE t + interval '1 second' END, \
                    CASE WHEN g = 17 THEN 10 WHEN g % 10 = 7 THEN 1 ELSE 0 END, \
                    CASE WHEN g = 17 THEN 'infinity'::timestamptz WHEN g % 10 = 7 THEN now() + interval '1 hour' END, \
                    CASE WHEN g % 10 = 7 THEN 'HTTP 500' END \
             FROM generate_series({from}, {to}) g, \
                  LATERAL (SELECT '2026-01-01T00:00:00Z'::timestamptz + g * interval '1 minute' AS t) x \
             ORDER BY g"
        )
    };
    c.batch_execute(&insert(1, n)).await.expect("load events");
    if tail > 0 {
        c.batch_execute("SELECT setval('events.outbox_id_seq', (SELECT max(id) FROM events.outbox) + 25000)")
            .await
            .expect("leave a gap in the ids");
        c.batch_execute(&insert(n + 1, n + tail)).await.expect("load the events after the gap");
    }
    c.query(
        "SELECT id, aggregate_type, aggregate_id, event_type, occurred_at, published_at IS NOT NULL \
         FROM events.outbox ORDER BY id",
        &[],
    )
    .await
    .expect("read the loaded rows")
    .iter()
    .map(|r| Row {
        id: r.get(0),
        aggregate_type: r.get(1),
        aggregate_id: r.get(2),
        event_type: r.get(3),
        occurred_at: r.get(4),
        published: r.get(5),
    })
    .collect()
}

/// Every column of every row, plus the row version (`xmin`) and place
/// (`ctid`): any write to a row, even one that changes no value, shows.
async fn snapshot(c: &Client) -> Vec<String> {
    c.query("SELECT xmin::text || ' ' || ctid::text || ' ' || to_jsonb(o)::text FROM events.outbox o ORDER BY id", &[])
        .await
        .expect("snapshot the table")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn ids(rows: &[Row], keep: impl Fn(&Row) -> bool) -> Vec<i64> {
    rows.iter().filter(|r| keep(r)).map(|r| r.id).collect()
}

/// The ids of the records on a replay's stdout, checking each against the
/// table.
fn stdout_ids(stdout: &str, rows: &[Row]) -> Vec<i64> {
    stdout.lines().map(|line| record_id(line, rows)).collect()
}

fn record_id(line: &str, rows: &[Row]) -> i64 {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line}"));
    check_record(&v, rows)
}

fn check_record(v: &Value, rows: &[Row]) -> i64 {
    let id = v["id"].as_i64().unwrap_or_else(|| panic!("a record has an integer id: {v}"));
    let row = rows.iter().find(|r| r.id == id).unwrap_or_else(|| panic!("replay sent an unknown id {id}: {v}"));
    assert_eq!(v["aggregate_type"], row.aggregate_type.as_str(), "{v}");
    assert_eq!(v["aggregate_id"], row.aggregate_id.to_string(), "{v}");
    assert_eq!(v["event_type"], row.event_type.as_str(), "{v}");
    id
}

/// The id after `--after-id ` in a replay's stderr.
fn after_id(stderr: &str) -> i64 {
    let re = regex::Regex::new(r"--after-id (-?\d+)").expect("regex");
    let caps = re.captures(stderr).unwrap_or_else(|| panic!("no `--after-id N` in stderr:\n{stderr}"));
    caps[1].parse().expect("an id")
}

fn s(id: i64) -> String {
    id.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_goes_to_stdout_exactly_in_order_once_and_the_table_stays_unchanged() {
    let db = TestDb::new("replay_stdout").await;
    let c = db.client().await;
    let rows = load(&c, 80, 5).await;
    let before = snapshot(&c).await;
    let (from, to) = (rows[10].id, rows[59].id);
    let want = ids(&rows, |r| r.published && r.id >= from && r.id <= to);
    assert!(want.len() > 40 && want.len() < 50, "published and unpublished rows in the range: {want:?}");

    // Pages of 7 rows: several pages, one partly filled.
    let out = db.cli(&["replay", "--from-id", &s(from), "--to-id", &s(to), "--batch-size", "7"]).run().await;
    assert!(out.ok(), "replay exits 0: {out:?}");
    assert_eq!(stdout_ids(&out.stdout, &rows), want, "exactly the published events of the range, in id order, once");
    let last = *want.last().expect("some");
    assert_eq!(after_id(&out.stderr), last, "the summary names the last id delivered: {}", out.stderr);
    assert!(out.stderr.contains(&format!("replay done: {} events delivered to stdout", want.len())), "{}", out.stderr);
    assert!(
        !out.stderr.contains('\r') && !out.stderr.contains("of the ids"),
        "no progress bar on a pipe: {}",
        out.stderr
    );

    // The dry run counts the same, sends nothing.
    let out = db.cli(&["replay", "--from-id", &s(from), "--to-id", &s(to), "--dry-run"]).run().await;
    assert!(out.ok() && out.stdout.is_empty(), "{out:?}");
    let expect = format!("dry run: would replay {} events (ids {} to {last})", want.len(), want[0]);
    assert!(out.stderr.contains(&expect), "{expect}: {}", out.stderr);

    // With unpublished events (pending, waiting, a dead letter): all of the range.
    let out = db.cli(&["replay", "--from-id", &s(from), "--to-id", &s(to), "--include-unpublished"]).run().await;
    assert!(out.ok(), "{out:?}");
    assert_eq!(stdout_ids(&out.stdout, &rows), ids(&rows, |r| r.id >= from && r.id <= to));

    // The whole table: across the gap of 25 000 ids (three read windows), the tail too.
    let out = db.cli(&["replay"]).run().await;
    assert!(out.ok(), "{out:?}");
    assert_eq!(stdout_ids(&out.stdout, &rows), ids(&rows, |r| r.published), "every published event");

    assert_eq!(snapshot(&c).await, before, "replay changed no row (values, xmin, ctid)");
}

// ---------------------------------------------------------------- a webhook in the test

/// A webhook that records the records it is sent, and answers 500 to the
/// id in `fail` (0: none).
#[derive(Clone, Default)]
struct Hook {
    seen: Arc<Mutex<Vec<Value>>>,
    fail: Arc<AtomicI64>,
}

impl Hook {
    fn take(&self) -> Vec<Value> {
        std::mem::take(&mut *self.seen.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

async fn hook_handler(State(hook): State<Hook>, body: Bytes) -> StatusCode {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let failing = v["id"].as_i64() == Some(hook.fail.load(Ordering::SeqCst));
    hook.seen.lock().unwrap_or_else(PoisonError::into_inner).push(v);
    if failing { StatusCode::INTERNAL_SERVER_ERROR } else { StatusCode::OK }
}

async fn start_hook() -> (Hook, String) {
    let hook = Hook::default();
    let app = axum::Router::new().route("/hook", axum::routing::post(hook_handler)).with_state(hook.clone());
    (hook, crate::support::serve_hook(app).await)
}

fn hook_ids(seen: &[Value], rows: &[Row]) -> Vec<i64> {
    seen.iter().map(|v| check_record(v, rows)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_select_by_aggregate_event_type_and_time_and_reach_a_webhook_in_order() {
    let db = TestDb::new("replay_webhook").await;
    let c = db.client().await;
    let rows = load(&c, 80, 0).await;
    let before = snapshot(&c).await;
    let (hook, url) = start_hook().await;

    let out = db.cli(&["replay", "--sink", &url, "--aggregate-type", "order", "--event-type", "Paid"]).run().await;
    assert!(out.ok(), "{out:?}");
    let want = ids(&rows, |r| r.published && r.aggregate_type == "order" && r.event_type == "Paid");
    assert!(want.len() >= 10, "{want:?}");
    assert_eq!(hook_ids(&hook.take(), &rows), want, "order/Paid events, in id order, once");

    // One aggregate, occurred in [00:20, 01:00).
    let agg = aggregate(3);
    let since = "2026-01-01T00:20:00Z";
    let until = "2026-01-01T02:00:00+01:00";
    let t = |s: &str| DateTime::parse_from_rfc3339(s).expect("time").with_timezone(&Utc);
    let out = db
        .cli(&["replay", "--sink", &url, "--aggregate-id", &agg.to_string(), "--since", since, "--until", until])
        .run()
        .await;
    assert!(out.ok(), "{out:?}");
    let want =
        ids(&rows, |r| r.published && r.aggregate_id == agg && r.occurred_at >= t(since) && r.occurred_at < t(until));
    assert!(want.len() >= 5, "{want:?}");
    assert_eq!(hook_ids(&hook.take(), &rows), want, "one aggregate within the time range");

    assert_eq!(snapshot(&c).await, before, "replay changed no row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_event_stops_the_replay_and_resuming_delivers_the_rest_without_a_gap() {
    let db = TestDb::new("replay_sink_fails").await;
    let c = db.client().await;
    let rows = load(&c, 40, 0).await;
    let before = snapshot(&c).await;
    let want = ids(&rows, |r| r.published);
    let (hook, url) = start_hook().await;
    let bad = want[5];
    hook.fail.store(bad, Ordering::SeqCst);

    let out = db.cli(&["replay", "--sink", &url]).run().await;
    assert_eq!(out.code, Some(1), "a refused event is an error: {out:?}");
    let lines: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "one error line: {}", out.stderr);
    assert!(lines[0].contains(&format!("replay stopped at event {bad} after 5 events")), "{}", lines[0]);
    assert!(lines[0].contains("500"), "the error names the sink's answer: {}", lines[0]);
    assert_eq!(after_id(lines[0]), want[4], "resume after the last event delivered");
    assert_eq!(hook_ids(&hook.take(), &rows), want[..6], "nothing after the refused event was sent");

    hook.fail.store(0, Ordering::SeqCst);
    let out = db.cli(&["replay", "--sink", &url, "--after-id", &s(want[4])]).run().await;
    assert!(out.ok(), "{out:?}");
    assert_eq!(hook_ids(&hook.take(), &rows), want[5..], "the rest, from the refused event on");
    assert_eq!(snapshot(&c).await, before, "replay changed no row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_rate_limited_replay_and_after_id_resumes_without_gap_or_duplicate() {
    let db = TestDb::new("replay_sigterm").await;
    let c = db.client().await;
    let rows = load(&c, 60, 0).await;
    let before = snapshot(&c).await;
    let want = ids(&rows, |r| r.published);

    let mut cmd = tokio::process::Command::new(support::bin());
    cmd.args(["replay", "--rate", "20"]);
    pg_outbox_testkit::process::clean_env(&mut cmd);
    cmd.env("DATABASE_URL", db.url()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.kill_on_drop(true).spawn().expect("start pg-outbox replay");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut stderr = child.stderr.take().expect("stderr");
    let mut first = Vec::new();
    while first.len() < 10 {
        match tokio::time::timeout(LIVENESS, stdout.next_line()).await {
            Ok(Ok(Some(line))) => first.push(record_id(&line, &rows)),
            other => panic!("replay stdout ended early: {other:?}"),
        }
    }
    let pid = libc::pid_t::try_from(child.id().expect("running")).expect("pid");
    // SAFETY: kill(2) on a child we spawned and have not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0, "send SIGTERM");
    while let Ok(Ok(Some(line))) = tokio::time::timeout(LIVENESS, stdout.next_line()).await {
        first.push(record_id(&line, &rows));
    }
    let status = tokio::time::timeout(LIVENESS, child.wait()).await.expect("exits").expect("status");
    let mut log = String::new();
    stderr.read_to_string(&mut log).await.expect("stderr");
    assert_eq!(status.code(), Some(130), "an interrupted replay exits 130: {log}");
    assert!(first.len() < want.len(), "interrupted mid-way ({} of {}): {log}", first.len(), want.len());
    let last = after_id(&log);
    assert_eq!(Some(&last), first.last(), "the printed id is the last one delivered: {log}");
    assert!(log.contains(&format!("replay interrupted after {} events", first.len())), "{log}");

    let out = db.cli(&["replay", "--after-id", &s(last)]).run().await;
    assert!(out.ok(), "{out:?}");
    let mut all = first.clone();
    all.extend(stdout_ids(&out.stdout, &rows));
    assert_eq!(all, want, "both runs together: every event once, in order");
    assert_eq!(snapshot(&c).await, before, "replay changed no row");
}

/// On a terminal (a pseudo-terminal that `script` makes) stderr gets the
/// progress bar, then the summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_gets_a_progress_bar() {
    let Some(script) = crate::needs::program(&crate::needs::SCRIPT) else { return };
    let db = TestDb::new("replay_tty").await;
    let rows = load(&db.client().await, 30, 0).await;
    let n = ids(&rows, |r| r.published).len();
    let mut cmd = tokio::process::Command::new(script);
    cmd.args(["-qec", &format!("'{}' replay --rate 50 > /dev/null", support::bin()), "/dev/null"]);
    pg_outbox_testkit::process::clean_env(&mut cmd);
    let out = cmd.env("DATABASE_URL", db.url()).stdin(Stdio::null()).kill_on_drop(true).output();
    let out = tokio::time::timeout(LIVENESS, out).await.expect("script exits").expect("run script");
    let tty = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}: {tty}", out.status);
    assert!(tty.contains("% of the ids") && tty.contains(" delivered"), "a progress bar: {tty:?}");
    assert!(tty.contains(&format!("replay done: {n} events delivered to stdout")), "then the summary: {tty:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_one_line_error_and_an_empty_range_says_nothing_to_replay() {
    let db = TestDb::new("replay_bad_input").await;
    let c = db.client().await;
    let rows = load(&c, 10, 0).await;
    let cases: [(&[&str], &str); 7] = [
        (&["--from-id", "10", "--to-id", "5"], "inverted id range: --from-id 10 is above --to-id 5"),
        (
            &["--since", "2026-01-02T00:00:00Z", "--until", "2026-01-01T00:00:00Z"],
            "empty or inverted time range: --since 2026-01-02T00:00:00Z is not before --until 2026-01-01T00:00:00Z",
        ),
        (&["--sink", "ftp://host/x"], "unsupported sink 'ftp://host/x'"),
        (&["--since", "yesterday"], "invalid time 'yesterday'"),
        (&["--until", "2026-01-01 00:00"], "RFC 3339"),
        (&["--aggregate-id", "not-a-uuid"], "'not-a-uuid' is not a valid UUID"),
        (&["--rate", "0"], "invalid rate '0'"),
    ];
    for (args, needle) in cases {
        let mut argv = vec!["replay"];
        argv.extend_from_slice(args);
        let out = db.cli(&argv).run().await;
        assert!(matches!(out.code, Some(1 | 2)), "{args:?} must fail: {out:?}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout: {out:?}");
        let first = out.stderr.lines().next().unwrap_or_default();
        assert!(first.starts_with("error:") && first.contains(needle), "{args:?}: want `{needle}` in: {}", out.stderr);
    }
    // Nothing in the range, or nothing matches: exit 0, said plainly.
    let last = rows.last().expect("rows").id;
    for args in [
        vec!["replay".to_string(), "--from-id".into(), s(last + 1000), "--to-id".into(), s(last + 2000)],
        vec!["replay".into(), "--event-type".into(), "NoSuchType".into()],
        vec!["replay".into(), "--after-id".into(), s(last)],
        vec!["replay".into(), "--dry-run".into(), "--aggregate-type".into(), "nothing".into()],
    ] {
        let out = db.cli(&args).run().await;
        assert!(out.ok() && out.stdout.is_empty(), "{args:?}: {out:?}");
        assert!(out.stderr.contains("nothing to replay"), "{args:?}: {}", out.stderr);
    }
}

// ---------------------------------------------------------------- structured logs

/// Parse every line of `log` as a JSON object with the keys every line
/// has: `timestamp` (RFC 3339, UTC), `level`, `message`, `target`.
fn json_lines(log: &str) -> Vec<Value> {
    assert!(!log.trim().is_empty(), "no log at all");
    log.lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}\nlog:\n{log}"));
            let obj = v.as_object().unwrap_or_else(|| panic!("not an object: {line}"));
            let ts = obj["timestamp"].as_str().unwrap_or_else(|| panic!("no timestamp: {line}"));
            let t = DateTime::parse_from_rfc3339(ts).unwrap_or_else(|e| panic!("timestamp not RFC 3339 ({e}): {line}"));
            assert_eq!(t.offset().local_minus_utc(), 0, "timestamp in UTC: {line}");
            assert!(ts.ends_with('Z'), "timestamp in UTC: {line}");
            let level = obj["level"].as_str().unwrap_or_else(|| panic!("no level: {line}"));
            assert!(["TRACE", "DEBUG", "INFO", "WARN", "ERROR"].contains(&level), "{line}");
            assert!(obj["message"].is_string(), "no message: {line}");
            assert!(obj["target"].as_str().is_some_and(|t| !t.is_empty()), "target: {line}");
            for gone in ["fields", "span", "spans", "threadName", "threadId"] {
                assert!(!obj.contains_key(gone), "no `{gone}`: {line}");
            }
            v
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_of_a_relay_with_failing_events_and_a_sigterm_parse_line_by_line() {
    let db = TestDb::new("log_json").await;
    let c = db.client().await;
    let good = support::insert_seed_events(&c, Uuid::new_v4(), 5).await;
    let bad = support::insert_seed_events(&c, Uuid::new_v4(), 2).await;
    // Rows the relay cannot read (chrono cannot hold an infinite time):
    // each is a failed attempt, then a dead letter.
    c.execute("UPDATE events.outbox SET occurred_at = 'infinity' WHERE id = ANY($1)", &[&bad]).await.expect("poison");
    // A password in the database URL (the server trusts local connections and
    // ignores it): it must not reach the log.
    let secret = "pw-s3cret-4711";
    let url = db.url().replacen("@", &format!(":{secret}@"), 1);
    assert!(url.contains(secret) || !db.url().contains('@'), "{url}");
    let spec = crate::relay_proc::relay(&db, &["--log-format", "json", "--sink", "stdout", "--max-retries", "1"])
        .url(&url)
        .stdout(pg_outbox_testkit::process::Output::Drained);
    let mut relay = relay_proc::start_spec(spec).await;
    support::eventually(30, "good events published, bad ones dead letters", || async {
        let r = c
            .query_one(
                "SELECT count(*) FILTER (WHERE published_at IS NOT NULL), \
                        count(*) FILTER (WHERE next_retry_at = 'infinity') FROM events.outbox",
                &[],
            )
            .await
            .expect("count");
        r.get::<_, i64>(0) == good.len() as i64 && r.get::<_, i64>(1) == bad.len() as i64
    })
    .await;
    relay.stop_cleanly().await;
    let log = relay.log();
    let lines = json_lines(&log);
    assert!(!log.contains(secret), "the password must not be logged:\n{log}");
    let with_id: BTreeSet<i64> = lines.iter().filter_map(|l| l.get("id").and_then(Value::as_i64)).collect();
    assert_eq!(with_id, bad.iter().copied().collect(), "the failing events' lines carry their id:\n{log}");
    let dead: Vec<_> = lines.iter().filter(|l| l["message"] == "event became a dead letter").collect();
    assert_eq!(dead.len(), 2, "{log}");
    assert!(dead.iter().all(|l| l["level"] == "WARN" && l["error"].is_string()), "{log}");
    assert!(lines.iter().any(|l| l["role"] == "leader"), "the relay's role is a field:\n{log}");
    let started = lines.iter().find(|l| l["signal"] == "started");
    let started = started.unwrap_or_else(|| panic!("a start line:\n{log}"));
    assert_eq!(started["sink"], "stdout", "{log}");
    assert!(started["database"].as_str().is_some_and(|d| d.contains(&db.name)), "{log}");
    assert!(lines.iter().any(|l| l["message"] == "relay stopped"), "the SIGTERM's lines too:\n{log}");

    // A replay's lines too, with the format from the environment.
    let out = db.cli(&["replay"]).env("PG_OUTBOX_LOG_FORMAT", "json").run().await;
    assert!(out.ok(), "{out:?}");
    let lines = json_lines(&out.stderr);
    let done = lines.last().expect("a summary");
    assert_eq!(done["events"], good.len() as u64, "{}", out.stderr);
    assert_eq!(done["last_delivered_id"], *good.last().expect("some"), "{}", out.stderr);
    // And the final error line of a failed command.
    let out = db.cli(&["--log-format", "json", "replay", "--sink", "ftp://x"]).run().await;
    assert_eq!(out.code, Some(1), "{out:?}");
    let lines = json_lines(&out.stderr);
    assert!(lines[0]["message"].as_str().is_some_and(|m| m.contains("unsupported sink")), "{}", out.stderr);

    let out = db.cli(&["--log-format", "xml", "status"]).run().await;
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.starts_with("error: invalid value 'xml' for '--log-format"), "{}", out.stderr);
    assert!(out.stderr.contains("[possible values: text, json]"), "{}", out.stderr);
    let out = db.cli(&["status"]).env("PG_OUTBOX_LOG_FORMAT", "yaml").run().await;
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("invalid value 'yaml'"), "{}", out.stderr);
}

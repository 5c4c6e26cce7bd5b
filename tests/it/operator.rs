//! Operator commands by filter: `dead-letters list|retry|discard` with
//! --aggregate-type, --event-type, --error-contains, --since and --limit,
//! dry runs that change nothing, and what a retried dead letter looks like.

use serde_json::Value;
use tokio_postgres::Client;

use crate::support::{TestDb, bin};

async fn cli(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(bin())
        .args(args)
        .env("DATABASE_URL", db.url())
        .env_remove("RUST_LOG")
        .output()
        .await
        .expect("run pg-outbox");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A dead letter as the relay leaves one (10 failures, next_retry_at =
/// 'infinity'), `age` old.
async fn dead(c: &Client, agg_type: &str, event_type: &str, error: &str, age: &str) -> i64 {
    c.query_one(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count, next_retry_at, last_error) \
         VALUES ($1, gen_random_uuid(), $2, '{}', now() - $4::text::interval, 10, 'infinity', $3) RETURNING id",
        &[&agg_type, &event_type, &error, &age],
    )
    .await
    .expect("insert a dead letter")
    .get(0)
}

/// `(dead letters, retried ones: unpublished, due, retry_count 10)` now.
async fn counts(c: &Client) -> (i64, i64) {
    let r = c
        .query_one(
            "SELECT count(*) FILTER (WHERE next_retry_at = 'infinity'), \
                    count(*) FILTER (WHERE next_retry_at <= now() AND retry_count = 10) \
             FROM events.outbox WHERE published_at IS NULL",
            &[],
        )
        .await
        .expect("count");
    (r.get(0), r.get(1))
}

fn listed_ids(json: &str) -> Vec<i64> {
    let v: Vec<Value> =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("list --json is a JSON array ({e}): {json}"));
    v.iter().map(|e| e["id"].as_i64().expect("id")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_filters_select_the_same_rows_for_list_retry_and_discard() {
    let db = TestDb::new("operator_filters").await;
    let c = db.client().await;
    let a = dead(&c, "subscription", "PaymentFailed", "HTTP 500 from billing", "2 hours").await;
    let b = dead(&c, "subscription", "PaymentFailed", "timed out", "3 days").await;
    let d = dead(&c, "invoice", "InvoiceIssued", "HTTP 500 from mail", "1 hour").await;
    let e = dead(&c, "invoice", "InvoiceVoided", "HTTP 400", "10 minutes").await;
    // Not dead letters: never listed, retried or discarded.
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('invoice', gen_random_uuid(), 'InvoiceIssued', '{}'); \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
           VALUES ('invoice', gen_random_uuid(), 'InvoiceIssued', '{}', 3, now() + interval '1 hour', 'HTTP 500 from mail')",
    )
    .await
    .expect("other rows");

    let list = |args: &'static [&'static str]| {
        let db = &db;
        async move {
            let mut all = vec!["dead-letters", "list", "--json"];
            all.extend_from_slice(args);
            let (code, out, err) = cli(db, &all).await;
            assert_eq!(code, 0, "{args:?}: {err}");
            listed_ids(&out)
        }
    };
    assert_eq!(list(&[]).await, [a, b, d, e]);
    assert_eq!(list(&["--aggregate-type", "subscription"]).await, [a, b]);
    assert_eq!(list(&["--event-type", "InvoiceIssued"]).await, [d]);
    assert_eq!(list(&["--error-contains", "HTTP 500"]).await, [a, d]);
    assert_eq!(list(&["--since", "1d"]).await, [a, d, e], "--since as an age");
    assert_eq!(list(&["--limit", "2"]).await, [a, b], "--limit keeps the lowest ids");
    assert_eq!(list(&["--aggregate-type", "invoice", "--error-contains", "HTTP"]).await, [d, e], "filters combine");

    let (code, out, err) = cli(&db, &["dead-letters", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 5, "a header and one line per dead letter:\n{out}");
    assert!(out.lines().next().is_some_and(|h| h.contains("event_type") && h.contains("last_error")), "{out}");
    let (code, _, err) = cli(&db, &["dead-letters", "list", "--limit", "0"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("--limit"), "{err}");
    let (code, _, err) = cli(&db, &["dead-letters", "list", "--since", "yesterday-ish"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("--since"), "{err}");

    // Dry runs report the same selection and change nothing.
    let (code, out, err) = cli(&db, &["dead-letters", "retry", "--dry-run", "--error-contains", "HTTP 500"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("dry run: would retry 2 dead letters: {a}, {d}"));
    let (code, out, err) = cli(&db, &["dead-letters", "discard", "--dry-run", "--aggregate-type", "invoice"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("dry run: would delete 2 dead letters: {d}, {e}"));
    assert_eq!(counts(&c).await, (4, 0), "dry runs change nothing");
    let (code, out, err) = cli(&db, &["dead-letters", "discard", "--aggregate-type", "invoice"]).await;
    assert_ne!(code, 0, "discard without --yes refuses");
    assert!(err.contains("--yes") && err.contains("2 dead letters"), "{err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(counts(&c).await, (4, 0));

    // Retry by filter: those two become due now, retry_count kept at 10.
    let (code, out, err) = cli(&db, &["dead-letters", "retry", "--error-contains", "HTTP 500"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("retried 2 dead letters: {a}, {d}"));
    assert_eq!(counts(&c).await, (2, 2));
    let r = c
        .query_one("SELECT retry_count, next_retry_at <= now(), last_error FROM events.outbox WHERE id = $1", &[&a])
        .await
        .expect("row");
    assert_eq!(
        (r.get::<_, i32>(0), r.get::<_, bool>(1)),
        (10, true),
        "retry sets next_retry_at = now(), keeps retry_count"
    );
    assert_eq!(r.get::<_, Option<String>>(2).as_deref(), Some("HTTP 500 from billing"), "last_error is kept");
    // A retried event is no longer a dead letter: list and show leave it out.
    assert_eq!(list(&[]).await, [b, e]);
    let (code, _, err) = cli(&db, &["dead-letters", "show", &a.to_string()]).await;
    assert_ne!(code, 0);
    assert!(err.contains("not a dead letter"), "{err}");
    // The status counts it as due, not dead.
    let (_, out, _) = cli(&db, &["status", "--json"]).await;
    let s: Value = serde_json::from_str(&out).expect("status JSON");
    assert_eq!(s["dead_letters"], 2, "{s}");

    // Discard by filter, confirmed.
    let (code, out, err) = cli(&db, &["dead-letters", "discard", "--yes", "--event-type", "InvoiceVoided"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("deleted 1 dead letter: {e}"));
    assert_eq!(list(&[]).await, [b]);
    let left: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert_eq!(left, 5, "only the discarded row is gone");
}

/// Stored text (aggregate and event types, `last_error`) reaches the
/// terminal with its control characters escaped in `status` and
/// `dead-letters list` tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_escape_control_characters() {
    let db = TestDb::new("operator_escape").await;
    let c = db.client().await;
    let id =
        dead(&c, "agg\u{1b}[2J", "Evt\u{1b}]0;title\u{7}", "boom \u{1b}[31mred\u{9b}1m\u{7f}\nnext", "1 hour").await;
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
         VALUES ('agg\u{1b}[2J', gen_random_uuid(), 'Wait\u{1b}[1m', '{}', 1, now() + interval '1 hour', 'HTTP 503 \u{1b}[5m\u{202e}')",
        &[],
    )
    .await
    .expect("insert a waiting retry");
    for args in [&["status"][..], &["dead-letters", "list"]] {
        let (code, out, err) = cli(&db, args).await;
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(out.contains(&id.to_string()) || args[0] == "status", "{out}");
        for raw in ['\u{1b}', '\u{7}', '\u{9b}', '\u{7f}', '\u{202e}'] {
            assert!(!out.contains(raw), "{args:?}: raw {raw:?} printed:\n{}", out.escape_debug());
        }
        assert!(out.contains("agg\\u{1b}[2J"), "{args:?}: escaped:\n{out}");
    }
    let (_, out, _) = cli(&db, &["dead-letters", "list"]).await;
    assert!(out.contains("boom \\u{1b}[31mred\\u{9b}1m\\u{7f} next"), "{out}");
    assert!(out.contains("Evt\\u{1b}]0;title\\u{7}"), "{out}");
    let (_, out, _) = cli(&db, &["status"]).await;
    assert!(out.contains("HTTP 503 \\u{1b}[5m\\u{202e}") && out.contains("Wait\\u{1b}[1m"), "{out}");
}

/// A `dead-letters list` cut short by its limit says so on stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_says_when_the_limit_cuts_it_short() {
    let db = TestDb::new("operator_list_limit").await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
         SELECT 'subscription', gen_random_uuid(), 'Dead', '{}', 10, 'infinity', 'HTTP 500' FROM generate_series(1, 105)",
    )
    .await
    .expect("insert dead letters");
    let (code, out, err) = cli(&db, &["dead-letters", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 101, "header and 100 rows: {out}");
    assert!(err.contains("showing 100 of 105 dead letters") && err.contains("--limit"), "{err}");
    let (code, out, err) = cli(&db, &["dead-letters", "list", "--json", "--limit", "10"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(listed_ids(&out).len(), 10, "stdout stays JSON: {out}");
    assert!(err.contains("showing 10 of 105 dead letters"), "{err}");
    for args in [
        &["dead-letters", "list", "--limit", "105"][..],
        &["dead-letters", "list", "--event-type", "Dead", "--limit", "200"],
    ] {
        let (code, out, err) = cli(&db, args).await;
        assert_eq!(code, 0, "{err}");
        assert_eq!(out.lines().count(), 106, "{args:?}: {out}");
        assert!(err.trim().is_empty(), "{args:?}: no note when all are shown: {err}");
    }
}

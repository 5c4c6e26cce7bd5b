//! Dead letters: held-back aggregates, and the operator commands that
//! release them (`pg-outbox dead-letters list|show|retry|discard`): by id and
//! by filter (--aggregate-type, --event-type, --error-contains, --since and
//! --limit), dry runs that change nothing, what a retried dead letter looks
//! like, and tables that escape control characters.

use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::consumer::{ack_next, next, start};
use crate::support::{DbCli, TestDb, insert_dead_letters, insert_seed_events};

/// Make `id` a dead letter through the consumer (10 real failures), and
/// wait until the last failure is written.
async fn kill_event(db: &TestDb, stream: &mut pg_outbox::EventStream, id: i64) {
    for attempt in 0..10 {
        let d = next(stream, 10).await;
        assert_eq!((d.id, d.retry_count), (id, attempt));
        d.fail(format!("HTTP 500 attempt {}", attempt + 1));
    }
    let c = db.client().await;
    crate::support::eventually(10, "the dead letter to be written", || async {
        c.query_one("SELECT next_retry_at = 'infinity' FROM events.outbox WHERE id = $1", &[&id])
            .await
            .expect("q")
            .get::<_, Option<bool>>(0)
            == Some(true)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_gives_a_dead_letter_one_more_attempt_then_its_aggregate_flows() {
    let db = TestDb::new("dl_retry").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let ids = insert_seed_events(&c, a, 3).await;
    let policy = pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(10)]).expect("policy").jitter(0.0);
    let mut stream = start(&db, |b| b.retry_policy(policy).sweep_interval(Duration::from_millis(100))).await;
    kill_event(&db, &mut stream, ids[0]).await;
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(600), stream.next()).await {
        panic!("held back, yet {} was delivered", d.id);
    }

    let (code, out, err) = db.cli(&["dead-letters", "list"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&ids[0].to_string()) && out.contains("HTTP 500 attempt 10"), "{out}");
    let (code, out, _) =
        db.cli(&["dead-letters", "list", "--json", "--error-contains", "attempt 10"]).run().await.parts();
    assert_eq!(code, Some(0));
    let listed: Vec<serde_json::Value> = serde_json::from_str(&out).expect("json");
    assert_eq!(listed.len(), 1);
    let (code, _, err) = db.cli(&["dead-letters", "retry"]).run().await.parts();
    assert_ne!(code, Some(0), "retry without a selection must refuse");
    assert!(err.contains("--all"), "{err}");
    let (code, out, _) = db.cli(&["dead-letters", "retry", "--dry-run", &ids[0].to_string()]).run().await.parts();
    assert_eq!(code, Some(0));
    assert!(out.contains("would retry 1"), "{out}");

    let (code, out, err) = db.cli(&["dead-letters", "retry", &ids[0].to_string()]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("retried 1"), "{out}");
    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.retry_count), (ids[0], 10), "retry_count is kept");
    d.ack();
    for want in &ids[1..] {
        let d = next(&mut stream, 10).await;
        assert_eq!(d.id, *want, "held-back events follow in id order");
        d.ack();
    }
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_deletes_the_dead_letter_and_releases_its_aggregate() {
    let db = TestDb::new("dl_discard").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let ids = insert_seed_events(&c, a, 2).await;
    let policy = pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(10)]).expect("policy").jitter(0.0);
    let mut stream = start(&db, |b| b.retry_policy(policy).sweep_interval(Duration::from_millis(100))).await;
    kill_event(&db, &mut stream, ids[0]).await;

    let (code, _, err) = db.cli(&["dead-letters", "discard", &ids[0].to_string()]).run().await.parts();
    assert_ne!(code, Some(0), "discard needs --yes");
    assert!(err.contains("--yes"), "{err}");
    let (code, out, err) = db.cli(&["dead-letters", "discard", "--yes", &ids[0].to_string()]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("deleted 1"), "{out}");
    ack_next(&mut stream, ids[1], 10).await;
    let left: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE id = $1", &[&ids[0]]).await.expect("q").get(0);
    assert_eq!(left, 0);
    let (code, _, err) = db.cli(&["dead-letters", "show", &ids[0].to_string()]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains(&format!("no event {}", ids[0])), "{err}");
    stream.finish().await.expect("finish");
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
            let (code, out, err) = db.cli(&all).run().await.parts();
            assert_eq!(code, Some(0), "{args:?}: {err}");
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

    let (code, out, err) = db.cli(&["dead-letters", "list"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 5, "a header and one line per dead letter:\n{out}");
    assert!(out.lines().next().is_some_and(|h| h.contains("event_type") && h.contains("last_error")), "{out}");
    let (code, _, err) = db.cli(&["dead-letters", "list", "--limit", "0"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("--limit"), "{err}");
    let (code, _, err) = db.cli(&["dead-letters", "list", "--since", "yesterday-ish"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("--since"), "{err}");

    // Dry runs report the same selection and change nothing.
    let (code, out, err) =
        db.cli(&["dead-letters", "retry", "--dry-run", "--error-contains", "HTTP 500"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), format!("dry run: would retry 2 dead letters: {a}, {d}"));
    let (code, out, err) =
        db.cli(&["dead-letters", "discard", "--dry-run", "--aggregate-type", "invoice"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), format!("dry run: would delete 2 dead letters: {d}, {e}"));
    assert_eq!(counts(&c).await, (4, 0), "dry runs change nothing");
    let (code, out, err) = db.cli(&["dead-letters", "discard", "--aggregate-type", "invoice"]).run().await.parts();
    assert_ne!(code, Some(0), "discard without --yes refuses");
    assert!(err.contains("--yes") && err.contains("2 dead letters"), "{err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(counts(&c).await, (4, 0));

    // Retry by filter: those two become due now, retry_count kept at 10.
    let (code, out, err) = db.cli(&["dead-letters", "retry", "--error-contains", "HTTP 500"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
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
    let (code, _, err) = db.cli(&["dead-letters", "show", &a.to_string()]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("not a dead letter"), "{err}");
    // The status counts it as due, not dead.
    let (_, out, _) = db.cli(&["status", "--json"]).run().await.parts();
    let s: Value = serde_json::from_str(&out).expect("status JSON");
    assert_eq!(s["dead_letters"], 2, "{s}");

    // Discard by filter, confirmed.
    let (code, out, err) =
        db.cli(&["dead-letters", "discard", "--yes", "--event-type", "InvoiceVoided"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
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
        let (code, out, err) = db.cli(args).run().await.parts();
        assert_eq!(code, Some(0), "{args:?}: {err}");
        assert!(out.contains(&id.to_string()) || args[0] == "status", "{out}");
        for raw in ['\u{1b}', '\u{7}', '\u{9b}', '\u{7f}', '\u{202e}'] {
            assert!(!out.contains(raw), "{args:?}: raw {raw:?} printed:\n{}", out.escape_debug());
        }
        assert!(out.contains("agg\\u{1b}[2J"), "{args:?}: escaped:\n{out}");
    }
    let (_, out, _) = db.cli(&["dead-letters", "list"]).run().await.parts();
    assert!(out.contains("boom \\u{1b}[31mred\\u{9b}1m\\u{7f} next"), "{out}");
    assert!(out.contains("Evt\\u{1b}]0;title\\u{7}"), "{out}");
    let (_, out, _) = db.cli(&["status"]).run().await.parts();
    assert!(out.contains("HTTP 503 \\u{1b}[5m\\u{202e}") && out.contains("Wait\\u{1b}[1m"), "{out}");
}

/// A `dead-letters list` cut short by its limit says so on stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_says_when_the_limit_cuts_it_short() {
    let db = TestDb::new("operator_list_limit").await;
    let c = db.client().await;
    insert_dead_letters(&c, 105).await;
    let (code, out, err) = db.cli(&["dead-letters", "list"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 101, "header and 100 rows: {out}");
    assert!(err.contains("showing 100 of 105 dead letters") && err.contains("--limit"), "{err}");
    let (code, out, err) = db.cli(&["dead-letters", "list", "--json", "--limit", "10"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(listed_ids(&out).len(), 10, "stdout stays JSON: {out}");
    assert!(err.contains("showing 10 of 105 dead letters"), "{err}");
    for args in [
        &["dead-letters", "list", "--limit", "105"][..],
        &["dead-letters", "list", "--event-type", "Dead", "--limit", "200"],
    ] {
        let (code, out, err) = db.cli(args).run().await.parts();
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(out.lines().count(), 106, "{args:?}: {out}");
        assert!(err.trim().is_empty(), "{args:?}: no note when all are shown: {err}");
    }
}

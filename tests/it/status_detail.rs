//! `pg-outbox status`: backlog per event type and the retry ladder, in the
//! table and in `--json`, against rows set up in a real database.

use serde_json::Value;
use tokio_postgres::Client;

use crate::support::{DbCli, TestDb};

async fn status(db: &TestDb, json: bool) -> String {
    let mut args = vec!["status"];
    if json {
        args.push("--json");
    }
    let out = db.cli(&args).run().await;
    assert!(out.ok(), "status failed: {}\n{}", out.stderr, out.stdout);
    out.stdout
}

async fn status_json(db: &TestDb) -> Value {
    let out = status(db, true).await;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {out}"))
}

/// Insert one row; returns its id.
async fn row(c: &Client, agg_type: &str, agg: uuid::Uuid, event_type: &str, extra: &str) -> i64 {
    let (cols, vals) = match extra {
        "" => (String::new(), String::new()),
        e => {
            let (c, v) = e.split_once('=').expect("col=value");
            (format!(", {c}"), format!(", {v}"))
        }
    };
    let sql = format!(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload{cols}) \
         VALUES ($1, $2, $3, '{{}}'{vals}) RETURNING id"
    );
    c.query_one(&sql, &[&agg_type, &agg, &event_type]).await.expect("insert a row").get(0)
}

/// The by_type entry for `(event_type, aggregate_type)`.
fn entry<'a>(v: &'a Value, event_type: &str, agg_type: &str) -> &'a Value {
    v["by_type"]
        .as_array()
        .unwrap_or_else(|| panic!("by_type is an array: {v}"))
        .iter()
        .find(|e| e["event_type"] == event_type && e["aggregate_type"] == agg_type)
        .unwrap_or_else(|| panic!("no by_type entry for {event_type}/{agg_type}: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_splits_the_backlog_by_event_type_and_shows_when_retries_come_due() {
    let db = TestDb::new("status_detail").await;
    let c = db.client().await;
    let new = uuid::Uuid::new_v4;

    // Empty outbox: empty lists, no next retry.
    let v = status_json(&db).await;
    assert_eq!(v["by_type"], serde_json::json!([]), "{v}");
    assert_eq!(v["by_type_truncated"], false, "{v}");
    assert!(v["retries"]["next_due_at"].is_null() && v["retries"]["next"] == serde_json::json!([]), "{v}");

    // invoice/InvoiceIssued: 3 fresh, 1 published (not counted).
    for _ in 0..3 {
        row(&c, "invoice", new(), "InvoiceIssued", "").await;
    }
    row(&c, "invoice", new(), "InvoiceIssued", "published_at=now()").await;
    // subscription/PaymentFailed: retries due in 30 s, 10 min and 2 h; a dead
    // letter, and a fresh event of the dead letter's aggregate (held back).
    let soon = row(
        &c,
        "subscription",
        new(),
        "PaymentFailed",
        "retry_count, next_retry_at, last_error=1, now() + interval '30 seconds', 'HTTP 503'",
    )
    .await;
    let mid =
        row(&c, "subscription", new(), "PaymentFailed", "retry_count, next_retry_at=2, now() + interval '10 minutes'")
            .await;
    let late =
        row(&c, "subscription", new(), "PaymentFailed", "retry_count, next_retry_at=4, now() + interval '2 hours'")
            .await;
    let dead_agg = new();
    row(
        &c,
        "subscription",
        dead_agg,
        "PaymentFailed",
        "retry_count, next_retry_at, occurred_at=10, 'infinity', now() - interval '3 days'",
    )
    .await;
    row(&c, "subscription", dead_agg, "PaymentFailed", "").await;

    let v = status_json(&db).await;
    assert_eq!(v["unpublished"], 8, "{v}");
    let types = v["by_type"].as_array().expect("array");
    assert_eq!(types.len(), 2, "{v}");
    assert_eq!(types[0]["event_type"], "PaymentFailed", "most unpublished first: {v}");
    let pf = entry(&v, "PaymentFailed", "subscription");
    assert_eq!(
        (&pf["unpublished"], &pf["due_now"], &pf["held_back"], &pf["waiting_for_retry"], &pf["dead_letters"]),
        (&Value::from(5), &Value::from(0), &Value::from(1), &Value::from(3), &Value::from(1)),
        "{pf}"
    );
    // The oldest pending is not the 3-day-old dead letter.
    let age = pf["oldest_unpublished_age_seconds"].as_f64().unwrap_or_else(|| panic!("an age: {pf}"));
    assert!((0.0..3600.0).contains(&age), "dead letters are not pending: {pf}");
    let inv = entry(&v, "InvoiceIssued", "invoice");
    assert_eq!(
        (&inv["unpublished"], &inv["due_now"], &inv["dead_letters"]),
        (&Value::from(3), &Value::from(3), &Value::from(0)),
        "{inv}"
    );
    let sum = |k: &str| types.iter().map(|t| t[k].as_i64().expect("count")).sum::<i64>();
    for k in ["unpublished", "due_now", "held_back", "waiting_for_retry", "dead_letters"] {
        assert_eq!(Value::from(sum(k)), v[k], "per-type {k} adds up to the total: {v}");
    }

    let r = &v["retries"];
    assert_eq!(
        (&r["due_within_1m"], &r["due_within_1h"], &r["due_later"]),
        (&Value::from(1), &Value::from(1), &Value::from(1)),
        "{r}"
    );
    let next_in = r["next_due_in_seconds"].as_f64().unwrap_or_else(|| panic!("next_due_in_seconds: {r}"));
    assert!(next_in > 20.0 && next_in <= 30.0, "the next retry is the 30 s one: {r}");
    let next_at = r["next_due_at"].as_str().unwrap_or_else(|| panic!("next_due_at: {r}"));
    chrono::DateTime::parse_from_rfc3339(next_at).unwrap_or_else(|e| panic!("next_due_at is RFC 3339 ({e}): {r}"));
    let ids: Vec<i64> = r["next"].as_array().expect("next").iter().map(|p| p["id"].as_i64().expect("id")).collect();
    assert_eq!(ids, [soon, mid, late], "next retries in due order, dead letters excluded: {r}");
    assert_eq!(r["next"][0]["last_error"], "HTTP 503", "{r}");
    assert_eq!(r["next"][0]["retry_count"], 1, "{r}");

    // The table shows the same.
    let table = status(&db, false).await;
    let line = |start: &str| {
        table.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no line starting {start:?}:\n{table}"))
    };
    let cols: Vec<&str> = line("PaymentFailed").split_whitespace().collect();
    assert_eq!(cols[..7], ["PaymentFailed", "subscription", "5", "0", "1", "3", "1"], "{table}");
    let cols: Vec<&str> = line("InvoiceIssued").split_whitespace().collect();
    assert_eq!(cols[..7], ["InvoiceIssued", "invoice", "3", "3", "0", "0", "0"], "{table}");
    assert!(line("retries due").contains("next at"), "{table}");
    assert_eq!(line("  within 1 m").split_whitespace().last(), Some("1"), "{table}");
    assert_eq!(line("  later").split_whitespace().last(), Some("1"), "{table}");
    let first_next = table
        .lines()
        .skip_while(|l| !l.starts_with("next retries"))
        .nth(2)
        .unwrap_or_else(|| panic!("no next retries rows:\n{table}"));
    assert_eq!(first_next.split_whitespace().next(), Some(soon.to_string().as_str()), "{table}");

    // Bounded: at most 50 types, and the output says more exist.
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'bulk', gen_random_uuid(), 'Type' || g, '{}' FROM generate_series(1, 60) g",
        &[],
    )
    .await
    .expect("60 more types");
    let v = status_json(&db).await;
    assert_eq!(
        v["by_type"].as_array().expect("array").len(),
        pg_outbox::status::OutboxStatus::MAX_TYPES as usize,
        "{v}"
    );
    assert_eq!(v["by_type_truncated"], true, "{v}");
    assert_eq!(v["by_type"][0]["event_type"], "PaymentFailed", "the largest backlog stays in view");
    let table = status(&db, false).await;
    assert!(table.contains("only the 50 types with the most unpublished events are shown"), "{table}");
}

/// `|got - want| <= tolerance * want`.
fn near(got: &Value, want: f64, tolerance: f64) -> bool {
    got.as_f64().is_some_and(|g| (g - want).abs() <= tolerance * want)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_estimates_a_class_past_its_exact_rows_and_says_which_figures_are_estimated() {
    let db = TestDb::new("status_estimate").await;
    let c = db.client().await;
    let cap = pg_outbox::status::OutboxStatus::EXACT_ROWS;
    // Fresh events of two types (2 to 1), three times the cap; retries
    // waiting, as many, due one per second from now on; dead letters, under
    // the cap. Row triggers off for the load.
    let (fresh, waiting, dead) = (3 * cap, 3 * cap, 120);
    c.batch_execute(&format!(
        "SET session_replication_role = replica; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'order', gen_random_uuid(), CASE WHEN g % 3 = 0 THEN 'OrderShipped' ELSE 'OrderPlaced' END, '{{}}' \
         FROM generate_series(1, {fresh}) g; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at) \
         SELECT 'invoice', gen_random_uuid(), 'InvoiceIssued', '{{}}', 1, now() + g * interval '1 second' \
         FROM generate_series(1, {waiting}) g; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at) \
         SELECT 'refund', gen_random_uuid(), 'RefundFailed', '{{}}', 10, 'infinity' FROM generate_series(1, {dead}) g; \
         RESET session_replication_role;"
    ))
    .await
    .expect("load");

    let v = status_json(&db).await;
    assert_eq!(v["estimated"], true, "{v}");
    let figures: Vec<&str> =
        v["estimated_figures"].as_array().expect("an array").iter().filter_map(Value::as_str).collect();
    for f in ["unpublished", "due_now", "held_back", "waiting_for_retry", "by_type", "retries"] {
        assert!(figures.contains(&f), "{f} is estimated: {v}");
    }
    // Under the cap: exact, and not marked.
    assert!(!figures.contains(&"dead_letters"), "{v}");
    assert_eq!(v["dead_letters"], dead, "{v}");
    // Standard errors (docs/operations.md, "How `status` estimates"): the
    // fresh rows fill their stratum (all but exact); the waiting retries
    // fill a third of theirs, the ids from the first unpublished one, so
    // one error is about 2 % of 12 000 ids, 4 % of the waiting rows, and
    // the same for a type's share of the fresh rows. Each bound is more
    // than five errors.
    let (fresh, waiting) = (fresh as f64, waiting as f64);
    assert!(near(&v["unpublished"], fresh + waiting + dead as f64, 0.1), "{v}");
    assert!(near(&v["due_now"], fresh, 0.05), "{v}");
    assert!(near(&v["waiting_for_retry"], waiting, 0.25), "{v}");
    assert_eq!(v["held_back"], 0, "nothing is held back: {v}");
    assert!(near(&entry(&v, "OrderPlaced", "order")["unpublished"], fresh * 2.0 / 3.0, 0.25), "{v}");
    assert!(near(&entry(&v, "OrderShipped", "order")["unpublished"], fresh / 3.0, 0.25), "{v}");
    assert_eq!(entry(&v, "RefundFailed", "refund")["dead_letters"], dead, "{v}");
    // The retries due within a minute are among the first rows read: exact
    // in fact, though the ladder is marked as a whole.
    assert_eq!(v["retries"]["due_within_1m"].as_i64().map(|n| (50..=60).contains(&n)), Some(true), "{v}");
    assert!(v["retries"]["next"].as_array().is_some_and(|n| n.len() == 5), "{v}");

    // The table marks each estimated figure and says how it is estimated.
    let table = status(&db, false).await;
    let line = |start: &str| {
        table.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no `{start}` line:\n{table}"))
    };
    assert!(line("unpublished").split_whitespace().last().is_some_and(|n| n.starts_with('~')), "{table}");
    assert_eq!(line("dead letters").split_whitespace().last(), Some(dead.to_string().as_str()), "{table}");
    assert!(table.contains(&format!("~ estimated: more than {cap} rows of a kind")), "{table}");

    // Back under the cap: exact again, and nothing marked.
    c.batch_execute(&format!(
        "UPDATE events.outbox SET published_at = now() WHERE aggregate_type = 'order' AND id > (SELECT min(id) + 99 \
           FROM events.outbox WHERE aggregate_type = 'order'); \
         DELETE FROM events.outbox WHERE aggregate_type = 'invoice' AND next_retry_at > now() + interval '{} seconds'",
        cap
    ))
    .await
    .expect("drain most of it");
    let v = status_json(&db).await;
    assert_eq!(v["estimated"], false, "{v}");
    assert_eq!(v["estimated_figures"], serde_json::json!([]), "{v}");
    let left: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("count").get(0);
    assert_eq!(v["unpublished"], left, "{v}");
    assert!(!status(&db, false).await.contains('~'), "nothing is estimated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_estimates_retries_that_share_one_due_time() {
    let db = TestDb::new("status_ties").await;
    let c = db.client().await;
    let cap = pg_outbox::status::OutboxStatus::EXACT_ROWS;
    // What `dead-letters retry --all` leaves: many retries due at one time
    // (one statement's now()); here three times the cap due an hour ago and
    // as many waiting, due tomorrow. And a row due at '-infinity'.
    let n = 3 * cap;
    c.batch_execute(&format!(
        "SET session_replication_role = replica; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at) \
         SELECT 'order', gen_random_uuid(), 'OrderPlaced', '{{}}', 1, \
                CASE WHEN g % 2 = 0 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END \
         FROM generate_series(1, {}) g; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at) \
         VALUES ('order', gen_random_uuid(), 'OrderPlaced', '{{}}', 1, '-infinity'); \
         RESET session_replication_role;",
        2 * n
    ))
    .await
    .expect("load");
    let v = status_json(&db).await;
    let figures: Vec<&str> =
        v["estimated_figures"].as_array().expect("an array").iter().filter_map(Value::as_str).collect();
    assert!(figures.contains(&"due_now") && figures.contains(&"waiting_for_retry"), "{v}");
    // Each kind fills half the retries' stratum: one standard error is
    // about 2 % of 12 000 ids, 4.5 % of each figure; 25 % is more than five.
    let n = n as f64;
    assert!(near(&v["due_now"], n + 1.0, 0.25), "the due retries are counted past the tie: {v}");
    assert!(near(&v["waiting_for_retry"], n, 0.25), "the waiting retries are counted past the tie: {v}");
    assert!(near(&v["unpublished"], 2.0 * n + 1.0, 0.1), "{v}");
}

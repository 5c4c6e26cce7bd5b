//! The statements that read a named subscription's lag and backlog cost
//! the same whatever the size of `events.outbox`: the relay's backlog
//! gauges (`subscription_gauges`), `subscription list` / `status`
//! (`subscription_list`) and the lags every relay reads for the alert
//! (`subscription_lags`), from `pg_outbox::subscription::read_statements()`.
//!
//! Two subscriptions, `audit` with its cursor at 0 (every event behind it)
//! and `search` caught up (its cursor at the highest id), each with 300
//! failure rows at the lowest ids (dead letters, waiting retries, held
//! events). Each statement runs under `EXPLAIN (ANALYZE, BUFFERS)` on a
//! session opened as pg-outbox opens its own, with custom and generic
//! plans, at 20 000 events (never analyzed, then analyzed) and at 200 000
//! (statistics stale: analyzed at 20 000; then current). The shared
//! buffers it touches stay under a fixed bound and do not grow with the
//! table, and the outbox is never scanned.

use pg_outbox::tokio_postgres::types::ToSql;
use serde_json::Value;
use tokio_postgres::Client;

use crate::support::{TestDb, plan_check_session, plan_count};

const SMALL: i64 = 20_000;
const LARGE: i64 = 200_000;
/// What the growth from `SMALL` to `LARGE` may add to a statement's
/// buffers: an index level more on each of its few descents.
const GROWTH: i64 = 20;

/// Insert `n` events as producers do (the triggers as they are), over
/// 10 000 aggregates.
pub(crate) async fn load(c: &Client, n: i64) {
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'invoice', md5('a-' || (g % 10000))::uuid, 'InvoiceIssued', \
                jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g)) \
         FROM generate_series(1, $1::bigint) g",
        &[&n],
    )
    .await
    .expect("load events");
}

/// The bound on a statement's buffers, whatever the table's size.
fn bound(name: &str) -> i64 {
    match name {
        // A walk of the first cap + 1 (2 001) events above the cursor in
        // id order (a few leaf pages of outbox_pkey and the heap pages
        // they sit on, some tens), and the subscription's 300 failure rows
        // (three counts and the oldest waiting, a few pages each).
        "subscription_gauges" => 400,
        // Per subscription: a descent of outbox_pkey for its lag, and a
        // walk of its failure rows, at most FAILURES_COUNTED + 1 (10 001:
        // 188 buffers with 100 000 dead letters; a few with 300); once, the
        // highest id.
        "subscription_list" => 250,
        // A descent of outbox_pkey per subscription.
        "subscription_lags" => 30,
        // One subscription's: the same descent, and the catalog's view of
        // the sessions (no shared buffers).
        "subscription_window_holder" => 30,
        other => panic!("no bound for {other}: add one"),
    }
}

/// Every (node type, relation) of a plan.
fn nodes(node: &Value, out: &mut Vec<(String, String)>) {
    out.push((
        node["Node Type"].as_str().unwrap_or("").to_string(),
        node["Relation Name"].as_str().unwrap_or("").to_string(),
    ));
    for child in node["Plans"].as_array().into_iter().flatten() {
        nodes(child, out);
    }
}

/// Buffers of each statement and case in this state, custom and generic
/// plans: `(statement, case, buffers)`; asserts the fixed bounds and that
/// the outbox is not scanned (the failures, 600 rows here, may be).
async fn measure(db: &TestDb, state: &str) -> Vec<(String, String, i64)> {
    let mut c = plan_check_session(db).await;
    let mut out = Vec::new();
    for (name, sql, cap) in pg_outbox::subscription::read_statements() {
        let cap = cap.unwrap_or(0);
        let subs: &[Option<&str>] = match name {
            "subscription_gauges" | "subscription_window_holder" => &[Some("audit"), Some("search")],
            "subscription_list" => &[None, Some("audit")],
            _ => &[None],
        };
        for (sub, generic) in subs.iter().flat_map(|s| [(s, false), (s, true)]) {
            let params: Vec<&(dyn ToSql + Sync)> = match (name, cap) {
                ("subscription_window_holder", _) => vec![sub],
                (_, 0) => vec![],
                _ => vec![sub, &cap],
            };
            let tx = c.transaction().await.expect("begin");
            if generic {
                tx.batch_execute("SET LOCAL plan_cache_mode = force_generic_plan").await.expect("generic plans");
            }
            let plan: Value = tx
                .query_one(&format!("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {sql}"), &params)
                .await
                .unwrap_or_else(|e| panic!("explain {name}: {e}"))
                .get(0);
            tx.rollback().await.expect("rollback");
            let top = &plan[0]["Plan"];
            let buffers = plan_count(top, "Shared Hit Blocks") + plan_count(top, "Shared Read Blocks");
            let case = format!("{}{}", sub.unwrap_or("all"), if generic { ", generic plan" } else { "" });
            let mut seen = Vec::new();
            nodes(top, &mut seen);
            assert!(
                !seen.iter().any(|(kind, rel)| kind == "Seq Scan" && rel == "outbox"),
                "{state}: {name} ({case}) scans the outbox: {seen:?}"
            );
            assert!(buffers <= bound(name), "{state}: {name} ({case}) touched {buffers} buffers: {plan}");
            out.push((name.to_string(), case, buffers));
        }
    }
    out
}

/// What the statements return at `LARGE`: the caps and the lags.
async fn check_results(c: &Client) {
    let gauges = pg_outbox::subscription::read_statements()[0];
    let cap = gauges.2.expect("the gauges' cap");
    let fresh = |name: &'static str| async move {
        c.query_one(gauges.1, &[&name, &cap]).await.expect("gauges").get::<_, i64>("fresh")
    };
    assert_eq!(fresh("audit").await, cap + 1, "cursor 0: more fresh events than counted");
    assert_eq!(fresh("search").await, 0, "caught up");
    let lags = c.query(pg_outbox::subscription::read_statements()[2].1, &[]).await.expect("lags");
    let lag = |i: usize| lags[i].get::<_, Option<f64>>("lag");
    assert!(lag(0).is_some() && lag(1).is_none(), "audit lags, search does not");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_lag_and_backlog_reads_stay_flat_as_the_outbox_grows() {
    let db = TestDb::new("sub_plans").await;
    let c = db.client().await;
    c.batch_execute(
        "ALTER TABLE events.outbox SET (autovacuum_enabled = false); \
         ALTER TABLE events.outbox_subscriptions SET (autovacuum_enabled = false); \
         ALTER TABLE events.outbox_subscription_failures SET (autovacuum_enabled = false);",
    )
    .await
    .expect("autovacuum off");
    load(&c, SMALL).await;
    c.batch_execute(
        "INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id, options) \
           SELECT 'audit', 0, 0, '{\"max_lag_seconds\": 60}'::jsonb \
           UNION ALL SELECT 'search', max(id), max(id), '{}'::jsonb FROM events.outbox; \
         INSERT INTO events.outbox_subscription_failures \
           (subscription, id, aggregate_type, aggregate_id, retry_count, next_retry_at, last_error) \
         SELECT s.name, o.id, o.aggregate_type, o.aggregate_id, CASE WHEN o.n % 3 = 2 THEN 0 ELSE 3 END, \
                CASE o.n % 3 WHEN 0 THEN 'infinity'::timestamptz WHEN 1 THEN now() + interval '1 hour' END, 'HTTP 500' \
         FROM (SELECT id, aggregate_type, aggregate_id, row_number() OVER (ORDER BY id) AS n \
               FROM events.outbox ORDER BY id LIMIT 3000) o CROSS JOIN events.outbox_subscriptions s \
         WHERE o.n % 10 = 0;",
    )
    .await
    .expect("subscriptions and their failures");
    let mut small = measure(&db, "20 000, never analyzed").await;
    c.batch_execute("ANALYZE").await.expect("analyze");
    small.extend(measure(&db, "20 000, analyzed").await);
    load(&c, LARGE - SMALL).await;
    c.batch_execute(
        "UPDATE events.outbox_subscriptions SET cursor_id = (SELECT max(id) FROM events.outbox) WHERE name = 'search'",
    )
    .await
    .expect("search caught up");
    let mut large = measure(&db, "200 000, statistics stale").await;
    c.batch_execute("ANALYZE").await.expect("analyze");
    large.extend(measure(&db, "200 000, analyzed").await);
    check_results(&c).await;
    // The same statement and case at both sizes: no more than an index
    // level more per descent.
    for (name, case, buffers) in &large {
        let most = small.iter().filter(|(n, k, _)| n == name && k == case).map(|s| s.2).max().expect("measured");
        assert!(
            *buffers <= most + GROWTH,
            "{name} ({case}): {buffers} buffers at {LARGE} events against {most} at {SMALL}: it grows with the table"
        );
    }
    // Dead letters only pile up: 100 000 more of `search`, at or below its
    // cursor, leave its reads within the same bounds (the gauges pass them
    // by a partial index of the failures that are not dead letters).
    c.execute(
        "INSERT INTO events.outbox_subscription_failures \
           (subscription, id, aggregate_type, aggregate_id, retry_count, next_retry_at, last_error) \
         SELECT 'search', o.id, o.aggregate_type, o.aggregate_id, 10, 'infinity', 'HTTP 500' \
         FROM events.outbox o WHERE o.id > (SELECT max(f.id) FROM events.outbox_subscription_failures f) \
         ORDER BY o.id LIMIT 100000",
        &[],
    )
    .await
    .expect("dead letters of search");
    c.batch_execute("ANALYZE events.outbox_subscription_failures").await.expect("analyze");
    let dead = measure(&db, "200 000, 100 000 dead letters").await;
    eprintln!("buffers with 100 000 dead letters of search: {dead:?}");
    settled_far_ahead(&c).await;
    eprintln!("buffers (statement, case, 20 000 never analyzed / analyzed, 200 000 stale / analyzed):");
    for (i, (name, case, b)) in small.iter().enumerate().take(small.len() / 2) {
        let half = small.len() / 2;
        eprintln!("  {name} {case}: {b} / {} / {} / {}", small[i + half].2, large[i].2, large[i + half].2);
    }
}

/// `audit` with 20 000 ids settled above its cursor (a long transaction
/// held its cursor while its relays settled on), one of them deleted since
/// (a discarded dead letter of the default), and one event among them not
/// settled: the lags read finds that event, with a walk of 20 001 entries
/// of `outbox_pkey` and a hashed set of the settled ids (linear in them;
/// the filter `id <> ALL (settled)` it replaced was quadratic: 3.2 s with
/// 20 000, docs/subscriptions.md, "The figures").
async fn settled_far_ahead(c: &Client) {
    let ids: Vec<i64> = c
        .query("SELECT id FROM events.outbox WHERE id > 0 ORDER BY id LIMIT 20001", &[])
        .await
        .expect("ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (gap, gone) = (ids[15_000], ids[100]);
    let settled: Vec<i64> = ids.iter().copied().filter(|id| *id != gap).collect();
    c.execute("UPDATE events.outbox_subscriptions SET cursor_id = 0, settled = $1 WHERE name = 'audit'", &[&settled])
        .await
        .expect("settled ahead");
    c.execute("DELETE FROM events.outbox WHERE id = $1", &[&gone]).await.expect("one settled event gone");
    let lags_sql = pg_outbox::subscription::read_statements()[2].1;
    let want: f64 = c
        .query_one("SELECT EXTRACT(EPOCH FROM (now() - occurred_at))::float8 FROM events.outbox WHERE id = $1", &[&gap])
        .await
        .expect("the gap's age")
        .get(0);
    let lags = c.query(lags_sql, &[]).await.expect("lags");
    let lag: f64 = lags[0].get::<_, Option<f64>>("lag").expect("audit lags");
    assert!((lag - want).abs() < 5.0, "the lag is the unsettled event {gap}'s ({want} s), got {lag} s");
    let plan: Value = c
        .query_one(&format!("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {lags_sql}"), &[])
        .await
        .expect("explain")
        .get(0);
    let top = &plan[0]["Plan"];
    let buffers = plan_count(top, "Shared Hit Blocks") + plan_count(top, "Shared Read Blocks");
    eprintln!("lags with 20 000 ids settled above the cursor: {buffers} buffers");
    assert!(buffers <= 3_000, "a walk of 20 001 entries and their heap pages: {buffers} buffers: {plan}");
}

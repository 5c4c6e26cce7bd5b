//! Query plans under a pathological head: 100 000 dead letters and 100 000
//! events waiting for a retry at the low end of the id range, fresh events
//! after them. Every fetch must skip the failed rows through its indexes
//! (buffers touched stay far below the number of failed rows), never walk
//! them.

use crate::support::{TestDb, plan_check_session, plan_count, server_version_num};

/// Buffers (hit + read) a plan node and its children touched.
fn buffers(node: &serde_json::Value) -> i64 {
    plan_count(node, "Shared Hit Blocks") + plan_count(node, "Shared Read Blocks")
}

fn collect(node: &serde_json::Value, out: &mut Vec<(String, String)>) {
    let kind = node["Node Type"].as_str().unwrap_or("").to_string();
    let index = node["Index Name"].as_str().unwrap_or("").to_string();
    let relation = node["Relation Name"].as_str().unwrap_or("").to_string();
    out.push((kind, if index.is_empty() { relation } else { index }));
    if let Some(children) = node["Plans"].as_array() {
        for c in children {
            collect(c, out);
        }
    }
}

#[tokio::test]
async fn fetch_skips_a_head_of_dead_letters_and_waiting_retries_through_its_indexes() {
    let db = TestDb::new("plans").await;
    let c = db.client().await;
    // 100 000 dead letters, then 100 000 waiting for a retry in an hour, each
    // on its own aggregate, then 2 000 fresh events of other aggregates.
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
           SELECT 'dead', md5('d' || g)::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, 100000) g; \
         UPDATE events.outbox SET retry_count = 10, last_error = 'boom', next_retry_at = 'infinity'; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
           SELECT 'waiting', md5('w' || g)::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, 100000) g; \
         UPDATE events.outbox SET retry_count = 1, last_error = 'later', next_retry_at = now() + interval '1 hour' \
           WHERE aggregate_type = 'waiting'; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
           SELECT 'fresh', md5('f' || g)::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, 2000) g;",
    )
    .await
    .expect("load the pathological head");
    c.batch_execute("VACUUM ANALYZE events.outbox").await.expect("vacuum");
    let sql =
        format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}", pg_outbox::fetch_query(server_version_num(&c).await));
    let none: Vec<i64> = Vec::new();
    let row = c
        .query_one(
            &sql,
            &[&none, &500i64, &(64i64 << 20), &i64::MIN, &i64::MIN, &i64::MAX, &None::<i64>, &i64::MAX, &None::<i64>],
        )
        .await
        .expect("explain the fetch");
    let plan: serde_json::Value = row.get(0);
    let root = &plan[0]["Plan"];
    assert!(!root["Actual Rows"].is_null(), "the plan has no actual rows: {plan}");
    let rows = plan_count(root, "Actual Rows");
    assert_eq!(rows, 500, "the fetch returns a full batch of fresh events");
    let mut nodes = Vec::new();
    collect(root, &mut nodes);
    let touched = buffers(root);
    assert!(
        !nodes.iter().any(|(kind, rel)| kind == "Seq Scan" && rel == "outbox"),
        "the fetch must not scan the outbox sequentially: {nodes:?}"
    );
    assert!(
        nodes.iter().any(|(_, rel)| rel == "outbox_fresh_order_idx"),
        "fresh events must come from outbox_fresh_order_idx: {nodes:?}"
    );
    assert!(
        !nodes.iter().any(|(_, rel)| rel == "outbox_unpublished_idx" || rel == "outbox_pkey"),
        "no branch may walk every unpublished row in id order: {nodes:?}"
    );
    // Walking the 200 000 failed rows would touch at least one buffer each.
    assert!(touched < 10_000, "the fetch touched {touched} buffers: it walks the failed head ({nodes:?})");

    // The same fetch with an empty head, for comparison: the head may add
    // one hold-back probe per fetched row (a descent of
    // outbox_holdback_idx, a few buffers), never a walk.
    c.batch_execute("DELETE FROM events.outbox WHERE aggregate_type <> 'fresh'").await.expect("remove the head");
    c.batch_execute("VACUUM ANALYZE events.outbox").await.expect("vacuum");
    let row = c
        .query_one(
            &sql,
            &[&none, &500i64, &(64i64 << 20), &i64::MIN, &i64::MIN, &i64::MAX, &None::<i64>, &i64::MAX, &None::<i64>],
        )
        .await
        .expect("explain the fetch again");
    let plan: serde_json::Value = row.get(0);
    let empty_head = buffers(&plan[0]["Plan"]);
    assert!(
        touched <= empty_head + 6 * rows,
        "a pathological head makes the fetch touch {touched} buffers against {empty_head} without it: \
         more than a few index descents per fetched row"
    );
}

/// Statistics taken while nearly every row was unpublished (a large backlog
/// at the last ANALYZE), with a fresh index bigger than the id-ordered
/// indexes (a churned partial index can be), must not lead the fetch into
/// `outbox_pkey` or `outbox_unpublished_idx`, which would walk every row
/// published since on every fetch. With the fresh index keyed on plain `id`
/// the planner does pick `outbox_unpublished_idx` here.
#[tokio::test]
async fn fetch_uses_the_fresh_index_when_statistics_say_everything_is_unpublished() {
    let db = TestDb::new("plans_stale").await;
    let c = db.client().await;
    c.batch_execute(
        "ALTER TABLE events.outbox SET (autovacuum_enabled = false); \
         ALTER INDEX events.outbox_fresh_order_idx SET (fillfactor = 10); \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
           SELECT 'a', md5('a' || g)::uuid, 'E', jsonb_build_object('note', repeat('x', 200)) \
           FROM generate_series(1, 60000) g;",
    )
    .await
    .expect("load a backlog");
    c.batch_execute("REINDEX INDEX events.outbox_fresh_order_idx").await.expect("bloat the fresh index");
    c.batch_execute("ANALYZE events.outbox").await.expect("analyze while all is unpublished");
    // A relay drains most of it; the statistics still say "all unpublished".
    c.batch_execute(
        "UPDATE events.outbox SET published_at = now() \
         WHERE id <= (SELECT id FROM events.outbox ORDER BY id OFFSET 50000 LIMIT 1)",
    )
    .await
    .expect("publish most of the backlog");
    let sql =
        format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}", pg_outbox::fetch_query(server_version_num(&c).await));
    let none: Vec<i64> = Vec::new();
    // Twice: the second run meets index entries the first one marked dead.
    let mut touched = 0;
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let row = c
            .query_one(
                &sql,
                &[
                    &none,
                    &500i64,
                    &(64i64 << 20),
                    &i64::MIN,
                    &i64::MIN,
                    &i64::MAX,
                    &None::<i64>,
                    &i64::MAX,
                    &None::<i64>,
                ],
            )
            .await
            .expect("explain the fetch");
        let plan: serde_json::Value = row.get(0);
        touched = buffers(&plan[0]["Plan"]);
        nodes.clear();
        collect(&plan[0]["Plan"], &mut nodes);
    }
    assert!(
        nodes.iter().any(|(_, rel)| rel == "outbox_fresh_order_idx"),
        "fresh events must come from outbox_fresh_order_idx: {nodes:?}"
    );
    assert!(
        !nodes.iter().any(|(_, rel)| rel == "outbox_pkey" || rel == "outbox_unpublished_idx"),
        "the fetch must not walk the table in id order: {nodes:?}"
    );
    assert!(touched < 5_000, "the fetch touched {touched} buffers: it walks the 50 000 published rows ({nodes:?})");
}

/// A drain leaves the index entries of the rows it published in
/// `outbox_fresh_order_idx` until VACUUM removes them. A fetch from the
/// first id walks them all, every time; a fetch from the floor
/// (`$4`, docs/architecture.md, "The fetch floor") starts past them. In
/// every statistics state: never analyzed, analyzed before the drain
/// (stale), analyzed after it (current).
#[tokio::test]
async fn a_fetch_from_its_floor_does_not_walk_a_million_drained_rows() {
    const DRAINED: i64 = 1_000_000;
    let db = TestDb::new("plans_floor").await;
    let c = db.client().await;
    c.batch_execute("ALTER TABLE events.outbox SET (autovacuum_enabled = false)").await.expect("autovacuum off");
    let load = format!(
        "TRUNCATE events.outbox; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
           SELECT 'drained', md5('d' || g)::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, {DRAINED}) g;"
    );
    let version = server_version_num(&c).await;
    let sql = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}", pg_outbox::fetch_query(version));
    let none: Vec<i64> = Vec::new();
    let budget = 64i64 << 20;
    // (state, ANALYZE before the drain, ANALYZE after it); "stale" keeps
    // the statistics of a table whose rows are all unpublished.
    for (state, analyze_before, analyze_after) in
        [("never analyzed", false, false), ("stale", true, false), ("current", false, true)]
    {
        c.batch_execute(&load).await.expect("load the rows to drain");
        if analyze_before {
            c.batch_execute("ANALYZE events.outbox").await.expect("analyze before the drain");
        }
        // The drain: every row published, nothing vacuumed; then the head.
        c.batch_execute(
            "UPDATE events.outbox SET published_at = now() WHERE published_at IS NULL; \
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
               SELECT 'fresh', md5('f' || g)::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, 2000) g;",
        )
        .await
        .expect("drain and add a head");
        if analyze_after {
            c.batch_execute("ANALYZE events.outbox").await.expect("analyze after the drain");
        }
        let floor: i64 = c
            .query_one("SELECT max(id) FROM events.outbox WHERE published_at IS NOT NULL", &[])
            .await
            .expect("the last drained id")
            .get(0);
        let explain = async |floor: i64| {
            // Twice: the second run meets index entries the first marked dead.
            let mut out = (0, 0);
            for _ in 0..2 {
                let row = c
                    .query_one(
                        &sql,
                        &[&none, &500i64, &budget, &floor, &floor, &i64::MAX, &None::<i64>, &i64::MAX, &None::<i64>],
                    )
                    .await
                    .expect("explain the fetch");
                let plan: serde_json::Value = row.get(0);
                out = (buffers(&plan[0]["Plan"]), plan_count(&plan[0]["Plan"], "Actual Rows"));
            }
            out
        };
        let (from_first, _) = explain(i64::MIN).await;
        let (from_floor, rows) = explain(floor).await;
        assert!(rows >= 500, "{state}: the fetch returns a batch ({rows} rows counted over its nodes)");
        eprintln!(
            "{state}: a fetch of 500 touched {from_first} buffers from the first id, {from_floor} from the floor"
        );
        // A batch of 500: its heap pages and index pages, a few catalog
        // lookups; the drained index entries alone fill over 2 000 pages.
        assert!(
            from_floor <= 8 * 500 + 100,
            "{state}: from the floor the fetch touched {from_floor} buffers (from the first id: {from_first})"
        );
        assert!(
            from_first > from_floor + 1_000,
            "{state}: from the first id the fetch should walk the drained entries: {from_first} against {from_floor}"
        );
    }
}

/// A hot aggregate behind a dead letter: 10 000 of its events held back
/// behind it, then fresh events of other aggregates. The floor passes the
/// held events once (the step that moves it probes each), and every fetch
/// after that starts past them; before, the floor stopped below the first
/// held event and every fetch walked all of them. In every statistics
/// state.
#[tokio::test]
async fn the_floor_passes_a_hot_aggregate_held_back_behind_a_dead_letter() {
    const HELD: i64 = 10_000;
    let db = TestDb::new("plans_hot_held").await;
    let c = db.client().await;
    c.batch_execute("ALTER TABLE events.outbox SET (autovacuum_enabled = false)").await.expect("autovacuum off");
    // The fetches run on a session as pg-outbox opens its own, with its
    // planner settings (without them, statistics from the steady state
    // make every hold-back probe a walk of the backlog).
    let relay = plan_check_session(&db).await;
    let version = server_version_num(&c).await;
    let fetch = pg_outbox::fetch_query(version);
    let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {fetch}");
    let floor_of = format!("SELECT min(q.fetch_floor) FROM ({fetch}) q");
    let none: Vec<i64> = Vec::new();
    let no_count: Option<i64> = None;
    let budget = 64i64 << 20;
    for (state, analyze_before, analyze_after) in
        [("never analyzed", false, false), ("stale", true, false), ("current", false, true)]
    {
        c.batch_execute(
            "TRUNCATE events.outbox; \
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
               SELECT 'steady', md5('s' || g)::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, 10000) g; \
             UPDATE events.outbox SET published_at = now()",
        )
        .await
        .expect("the steady state");
        if analyze_before {
            c.batch_execute("ANALYZE events.outbox").await.expect("analyze the steady state");
        }
        let load = format!(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, last_error, next_retry_at) \
               VALUES ('hot', md5('hot')::uuid, 'E', '{{}}', 10, 'sink refused', 'infinity'); \
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
               SELECT 'hot', md5('hot')::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, {HELD}) g; \
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
               SELECT 'fresh', md5('f' || g)::uuid, 'E', jsonb_build_object('n', g) FROM generate_series(1, 2000) g;"
        );
        c.batch_execute(&load).await.expect("the dead letter, its held events, the fresh ones");
        if analyze_after {
            c.batch_execute("ANALYZE events.outbox").await.expect("analyze");
        }
        let (dead, last_held): (i64, i64) = {
            let r = c
                .query_one("SELECT min(id), max(id) FROM events.outbox WHERE aggregate_type = 'hot'", &[])
                .await
                .expect("the dead letter and the last held id");
            (r.get(0), r.get(1))
        };
        // A checkpoint past the held events, passed (next xid 0): the step
        // moves the floor past them, not below the first.
        let moved: i64 = relay
            .query_one(
                &floor_of,
                &[&none, &500i64, &budget, &i64::MIN, &last_held, &0i64, &no_count, &i64::MAX, &no_count],
            )
            .await
            .expect("the floor the fetch moved to")
            .get(0);
        assert_eq!(moved, last_held, "{state}: the floor passes the held events");
        // A count other than the one the consumer saw: the fetch reads from
        // below the first held event passed (here the dead letter's id),
        // not from its floor.
        let seen = Some(41i64);
        let restarted: i64 = relay
            .query_one(
                &floor_of,
                &[&none, &500i64, &budget, &last_held, &last_held, &i64::MAX, &seen, &dead, &no_count],
            )
            .await
            .expect("the floor after an unblock")
            .get(0);
        assert_eq!(restarted, dead, "{state}: after an unblock the fetch reads from below the first held event");
        // A rewind count other than the one the consumer saw: the fetch
        // reads from the first fresh row, whatever its floor.
        let rewinds_seen = Some(7i64);
        let rewound: i64 = relay
            .query_one(
                &floor_of,
                &[&none, &500i64, &budget, &last_held, &last_held, &i64::MAX, &no_count, &i64::MAX, &rewinds_seen],
            )
            .await
            .expect("the floor after a rewind")
            .get(0);
        assert_eq!(rewound, i64::MIN, "{state}: after a rewind the fetch reads from the first fresh row");
        // With the unblock count not kept (a trigger disabled), the step
        // stops below the first held event, as it does below any row it
        // may still have to hand out.
        relay.batch_execute("ALTER TABLE events.outbox DISABLE TRIGGER outbox_unblock").await.expect("disable");
        let not_kept = Some(-1i64);
        let stopped: i64 = relay
            .query_one(
                &floor_of,
                &[&none, &500i64, &budget, &i64::MIN, &last_held, &0i64, &not_kept, &i64::MAX, &no_count],
            )
            .await
            .expect("the floor without the count")
            .get(0);
        relay.batch_execute("ALTER TABLE events.outbox ENABLE ALWAYS TRIGGER outbox_unblock").await.expect("enable");
        let first_held: i64 = c
            .query_one("SELECT min(id) FROM events.outbox WHERE aggregate_type = 'hot' AND next_retry_at IS NULL", &[])
            .await
            .expect("the first held id")
            .get(0);
        assert_eq!(stopped, first_held - 1, "{state}: without the count the floor stops at the first held event");
        let buffers_from = async |floor: i64| {
            // Twice: the second run meets index entries the first marked dead.
            let mut touched = 0;
            for _ in 0..2 {
                let row = relay
                    .query_one(
                        &explain,
                        &[&none, &500i64, &budget, &floor, &floor, &i64::MAX, &no_count, &i64::MAX, &no_count],
                    )
                    .await
                    .expect("explain the fetch");
                let plan: serde_json::Value = row.get(0);
                assert!(plan_count(&plan[0]["Plan"], "Actual Rows") > 0, "{state}: rows fetched");
                touched = buffers(&plan[0]["Plan"]);
            }
            touched
        };
        let below = buffers_from(dead).await;
        let past = buffers_from(moved).await;
        eprintln!("{state}: a fetch of 500 touched {below} buffers from below the held events, {past} past them");
        assert!(past <= 8 * 500 + 100, "{state}: past the held events the fetch touched {past} buffers");
        assert!(below > past + 5_000, "{state}: from below, the fetch walks the held events: {below} against {past}");
    }
}

//! Plans of every run-time statement in the statistics states users meet.
//!
//! Each test builds one state for real, with autovacuum off for the table
//! so that nothing fixes the statistics behind the test's back:
//! - never analyzed: rows loaded right after migrating, no ANALYZE or VACUUM;
//! - stale: a steady state (published rows only) analyzed, then the failed
//!   head and the backlog inserted after it, as an outage leaves them;
//! - current: ANALYZE after every change.
//!
//! In each: 100 000 dead letters and 100 000 events waiting for a retry at
//! the low end of the ids (each on an aggregate of its own), then backlogs of
//! 0, 10 000 and 1 000 000 fresh events. Every statement of
//! `pg_outbox::run_time_statements()` runs under `EXPLAIN (ANALYZE, BUFFERS)`
//! on a session opened as pg-outbox opens its own (so with its planner
//! settings), and the buffers it touched must stay within a bound
//! proportional to the rows it returns (fetches, writes, lists) or counts
//! (status figures: a constant), never to the failed head or the table. Writes run in a
//! transaction that is rolled back.

use pg_outbox::tokio_postgres::types::ToSql;
use pg_outbox::tokio_postgres::{Client, Transaction};

use crate::support::{TestDb, plan_check_session, plan_count, plan_number, server_version_num};

const DEAD: i64 = 100_000;
const WAITING: i64 = 100_000;
const STEADY: i64 = 100_000;
const BACKLOGS: [i64; 3] = [0, 10_000, 1_000_000];
const BATCH: i64 = 500;
/// Buffers (and rows handled) the backlog figures' first statement may
/// touch: four for each of the four classes' first rows (its heap page, its
/// index page, a share of a hold-back probe for a due row), whatever the
/// backlog.
const EXACT_BOUND: i64 = 4 * 4 * (pg_outbox::status::OutboxStatus::EXACT_ROWS + 1) + 100;
/// And the sample's: per id drawn (in up to three strata), a primary-key
/// lookup (the index levels and the heap page) and a hold-back probe.
const SAMPLE_BOUND: i64 = 10 * 3 * pg_outbox::status::OutboxStatus::SAMPLE_IDS + 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stats {
    Never,
    Stale,
    Current,
}

/// Buffers (shared hit + read) of a plan's top node, which counts its
/// children, subplans and CTEs.
fn buffers(plan: &serde_json::Value) -> i64 {
    let top = &plan[0]["Plan"];
    plan_count(top, "Shared Hit Blocks") + plan_count(top, "Shared Read Blocks")
}

/// Rows every node produced or filtered out, times its loops, over the whole
/// plan: what a plan does that touches no buffers (a rescanned function
/// scan or sort) shows here. The counts are per loop (averages, which
/// PostgreSQL 18 prints with two decimals), so the product is rounded.
fn rows_handled(node: &serde_json::Value) -> i64 {
    let loops = if node["Actual Loops"].is_null() { 1.0 } else { plan_number(node, "Actual Loops") };
    let own = ["Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter", "Rows Removed by Index Recheck"]
        .iter()
        .map(|k| plan_number(node, k))
        .sum::<f64>();
    (own * loops).round() as i64 + node["Plans"].as_array().map_or(0, |c| c.iter().map(rows_handled).sum())
}

fn top_rows(plan: &serde_json::Value) -> i64 {
    plan_count(&plan[0]["Plan"], "Actual Rows")
}

fn node_names(node: &serde_json::Value, out: &mut Vec<String>) {
    let kind = node["Node Type"].as_str().unwrap_or("");
    let on = node["Index Name"].as_str().or(node["Relation Name"].as_str()).unwrap_or("");
    out.push(format!("{kind} {on}"));
    if let Some(children) = node["Plans"].as_array() {
        for c in children {
            node_names(c, out);
        }
    }
}

async fn explain(tx: &Transaction<'_>, sql: &str, params: &[&(dyn ToSql + Sync)]) -> serde_json::Value {
    let row = tx
        .query_one(&format!("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {sql}"), params)
        .await
        .unwrap_or_else(|e| panic!("explain {sql}: {e}"));
    row.get(0)
}

/// Load `n` rows of one kind with a cheap server-side statement. Triggers
/// are skipped when the session may (`session_replication_role`, superuser
/// only): they order producers and notify relays, which a load needs not.
async fn insert(c: &Client, kind: &str, n: i64, cols: &str, vals: &str) {
    if n == 0 {
        return;
    }
    let base: i64 = c.query_one("SELECT coalesce(max(id), 0) FROM events.outbox", &[]).await.expect("max id").get(0);
    c.batch_execute(&format!(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload{cols}) \
         SELECT '{kind}', md5('{kind}' || ({base} + g))::uuid, 'PaymentSucceeded', \
                jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g, 'note', md5(g::text))){vals} \
         FROM generate_series(1, {n}) g"
    ))
    .await
    .unwrap_or_else(|e| panic!("load {n} {kind} rows: {e}"));
}

async fn build(c: &Client, stats: Stats) {
    c.batch_execute("ALTER TABLE events.outbox SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)")
        .await
        .expect("autovacuum off");
    let _ = c.batch_execute("SET session_replication_role = replica").await;
    insert(c, "steady", STEADY, ", published_at", ", now() - interval '1 day'").await;
    if stats == Stats::Stale {
        c.batch_execute("VACUUM ANALYZE events.outbox").await.expect("analyze the steady state");
    }
    insert(c, "dead", DEAD, ", retry_count, last_error, next_retry_at", ", 10, 'sink refused', 'infinity'").await;
    insert(
        c,
        "waiting",
        WAITING,
        ", retry_count, last_error, next_retry_at",
        ", 1, 'sink timed out', now() + interval '1 hour'",
    )
    .await;
}

/// Check every statement against the current table; `backlog` fresh rows.
async fn check_all(c: &mut Client, stats: Stats, backlog: i64) {
    let first: Vec<i64> = c
        .query("SELECT id FROM events.outbox WHERE aggregate_type = 'fresh' ORDER BY id LIMIT $1", &[&BATCH])
        .await
        .expect("first backlog ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let n_first = first.len() as i64;
    let unpublished = DEAD + WAITING + backlog;
    let none: Vec<i64> = Vec::new();
    // The writes' leadership terms (a `jsonb` object, scope to term): none
    // (a consumer that holds none writes unfenced), single mode's current
    // one, and two partitions' (the fence reads events.outbox_terms).
    let no_term: Option<serde_json::Value> = None;
    c.batch_execute(
        "INSERT INTO events.outbox_terms (scope, term) VALUES ('outbox', 7), ('partition:0/16', 3), \
           ('partition:1/16', 4) ON CONFLICT (scope) DO UPDATE SET term = excluded.term",
    )
    .await
    .expect("terms");
    let term = Some(serde_json::json!({"outbox": 7}));
    let partition_terms = Some(serde_json::json!({"partition:0/16": 3, "partition:1/16": 4}));
    let details = serde_json::Value::Object(
        first.iter().map(|id| (id.to_string(), serde_json::json!({"e": "sink refused", "d": 60.0, "s": 0}))).collect(),
    );
    let all_parts: Vec<i32> = (0..16).collect();
    let half_parts: Vec<i32> = (0..8).collect();
    let (no_ids, no_text, no_time): (Option<Vec<i64>>, Option<String>, Option<chrono::DateTime<chrono::Utc>>) =
        (None, None, None);
    let dead_type = Some("dead".to_string());
    let ten_days = 864_000.0f64;
    let limit_list = 100i64;
    let max_retries = 10i32;
    let parts = 16i64;
    let zero = 0i64;
    let five = 5i64;
    // The fetch floor: none, or past the first batch (the highest id in it).
    let (no_floor, no_xid) = (i64::MIN, i64::MAX);
    // The count of unblocks the fetch is told it saw: none (none bumped).
    let no_count: Option<i64> = None;
    // The rewind count as the fetches would read it (the loads run under
    // `session_replication_role = replica` bump it): a fetch told another
    // reads from the first fresh row whatever its floor.
    let rewinds: Option<i64> = c
        .query_opt("SELECT term FROM events.outbox_terms WHERE scope = 'rewind'", &[])
        .await
        .expect("the rewind count")
        .map(|r| r.get(0));
    let first_last = first.iter().copied().max().unwrap_or(i64::MIN);
    // The backlog figures: each class's first rows, then the sample, with
    // every class read up to its first rows (ids and due times from the
    // table) or none.
    let exact_limit = pg_outbox::status::OutboxStatus::EXACT_ROWS + 1;
    let sample_ids = pg_outbox::status::OutboxStatus::SAMPLE_IDS;
    let (no_id, no_due): (Option<i64>, Option<f64>) = (None, None);
    let past = c
        .query_one(
            "SELECT (SELECT min(id) + $1 FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NULL), \
                    (SELECT min(id) + $1 FROM events.outbox WHERE next_retry_at = 'infinity'), \
                    (SELECT EXTRACT(EPOCH FROM min(next_retry_at))::float8 FROM events.outbox \
                      WHERE next_retry_at > now() AND next_retry_at < 'infinity')",
            &[&pg_outbox::status::OutboxStatus::EXACT_ROWS],
        )
        .await
        .expect("the rows read of each class");
    let (fresh_past, dead_past, waiting_past): (Option<i64>, Option<i64>, Option<f64>) =
        (past.get(0), past.get(1), past.get(2));
    let due_past = waiting_past;
    // Replay reads a window of ids in the middle of the published rows.
    let window = pg_outbox::relay::replay::WINDOW;
    let (mid, mid_end) = (STEADY / 2, STEADY / 2 + window);
    let (no, no_agg): (bool, Option<uuid::Uuid>) = (false, None);
    let rare = Some("NoSuchType".to_string());
    // The console looks at a dead letter, its aggregate and the pages of
    // dead letters after it.
    let dead_row = c
        .query_one(
            "SELECT id, aggregate_type, aggregate_id FROM events.outbox WHERE aggregate_type = 'dead' LIMIT 1",
            &[],
        )
        .await
        .expect("a dead letter");
    let (dead_id, dead_agg_type, dead_agg_id): (i64, String, uuid::Uuid) =
        (dead_row.get(0), dead_row.get(1), dead_row.get(2));
    let timeline = 50i64;
    // Dead letters named by id: the last few (the walk of every dead
    // letter would pass all the others first).
    let dead_ids: Option<Vec<i64>> = Some(
        c.query("SELECT id FROM events.outbox WHERE aggregate_type = 'dead' ORDER BY id DESC LIMIT 10", &[])
            .await
            .expect("dead letter ids")
            .iter()
            .map(|r| r.get(0))
            .collect(),
    );
    let n_dead_ids = dead_ids.as_ref().map_or(0, Vec::len) as i64;
    // Byte budgets: the default bound (no cut with these payloads), and
    // five and a half fresh payloads' worth.
    let budget = i64::try_from(pg_outbox::ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES).expect("a bigint");
    // As the fetch measures them: stored sizes (these payloads are small
    // and uncompressed), or on PostgreSQL 13 the length of their text.
    let version = server_version_num(c).await;
    let size = if version >= 140_000 { "pg_column_size(payload)" } else { "octet_length(payload::text) + 1" };
    let fresh_payload_bytes: i64 = c
        .query_one(
            &format!(
                "SELECT coalesce(max({size}), 1)::int8 FROM events.outbox \
                 WHERE published_at IS NULL AND next_retry_at IS NULL"
            ),
            &[],
        )
        .await
        .expect("the fresh payloads' size")
        .get(0);
    let small_budget = fresh_payload_bytes * 11 / 2;
    let chart_rows = 1000i64;
    let mut failures = Vec::new();
    for (name, sql) in pg_outbox::run_time_statements(version) {
        // (parameters, bound on buffers)
        let fetched = BATCH.min(backlog);
        let cases: Vec<(Vec<&(dyn ToSql + Sync)>, i64, &str)> = match name {
            "fetch" | "fetch_text_sizes" => vec![
                (
                    vec![&none, &BATCH, &budget, &no_floor, &no_floor, &no_xid, &no_count, &i64::MAX, &rewinds],
                    8 * fetched + 50,
                    "nothing in flight",
                ),
                (
                    vec![&first, &BATCH, &budget, &no_floor, &no_floor, &no_xid, &no_count, &i64::MAX, &rewinds],
                    8 * (fetched + n_first) + 50,
                    "the first batch in flight",
                ),
                // The floor past the first batch, in flight: it is not walked.
                (
                    vec![&first, &BATCH, &budget, &first_last, &first_last, &no_xid, &no_count, &i64::MAX, &rewinds],
                    8 * fetched + 50,
                    "a floor",
                ),
                // The checkpoint passed: the floor moves past the batch in
                // flight (one probe per row in flight), then the fetch reads.
                (
                    vec![&first, &BATCH, &budget, &no_floor, &first_last, &zero, &no_count, &i64::MAX, &rewinds],
                    8 * (fetched + n_first) + 50,
                    "a checkpoint passed",
                ),
                // The candidates are the same; the server stops sending at
                // the budget.
                (
                    vec![&none, &BATCH, &small_budget, &no_floor, &no_floor, &no_xid, &no_count, &i64::MAX, &rewinds],
                    8 * fetched + 50,
                    "a byte budget of a few events",
                ),
            ],
            "fetch_partitioned" => vec![
                (
                    vec![
                        &none,
                        &BATCH,
                        &budget,
                        &parts,
                        &all_parts,
                        &no_floor,
                        &no_floor,
                        &no_xid,
                        &no_count,
                        &i64::MAX,
                        &rewinds,
                    ],
                    8 * fetched + 50,
                    "all partitions",
                ),
                (
                    vec![
                        &none,
                        &BATCH,
                        &budget,
                        &parts,
                        &half_parts,
                        &no_floor,
                        &no_floor,
                        &no_xid,
                        &no_count,
                        &i64::MAX,
                        &rewinds,
                    ],
                    16 * fetched + 50,
                    "half the partitions",
                ),
            ],
            "competing_fetch" => vec![(vec![&BATCH, &budget], 8 * fetched + 50, "")],
            "ack" => vec![
                (vec![&first, &no_term], 30 * n_first + 50, "no term"),
                (vec![&first, &term], 30 * n_first + 50, "the current term"),
                (vec![&first, &partition_terms], 30 * n_first + 50, "two partitions' terms"),
            ],
            // One primary-key probe per id: the index levels and the heap page.
            "dead_letters_existing" => vec![(vec![&first], 8 * n_first + 50, "")],
            // One case: each rolled-back failure leaves its entries in
            // outbox_retry_due_idx for the statements after it to pass.
            "fail" => vec![(vec![&first, &details, &max_retries, &term], 40 * n_first + 50, "the current term")],
            "next_retry_in" => vec![(vec![], 50, "")],
            "next_retries" => vec![(vec![&five], 100, "")],
            // The backlog figures: a constant bound, whatever the backlog
            // (exact up to a cap per class, then a sample of fixed size).
            "backlog_exact" => vec![(vec![&exact_limit], EXACT_BOUND, "")],
            "backlog_sample" => vec![
                (
                    vec![&sample_ids, &fresh_past, &dead_past, &due_past, &waiting_past],
                    SAMPLE_BOUND,
                    "every class estimated",
                ),
                (vec![&sample_ids, &no_id, &no_id, &no_due, &no_due], SAMPLE_BOUND, "no class estimated"),
            ],
            "dead_letters_list" | "dead_letters_ids" => {
                vec![(vec![&no_ids, &dead_type, &no_text, &no_text, &no_time, &limit_list], 5 * limit_list + 50, "")]
            }
            "dead_letters_count" => vec![(vec![&no_ids, &dead_type, &no_text, &no_text, &no_time], 3 * DEAD + 100, "")],
            // One primary-key lookup per named id, however many dead
            // letters there are.
            "dead_letters_list_by_id" => {
                vec![(vec![&dead_ids, &no_text, &no_text, &no_text, &no_time, &limit_list], 8 * n_dead_ids + 50, "")]
            }
            // And the new row versions' index entries.
            "dead_letters_retry_by_id" | "dead_letters_discard_by_id" => {
                vec![(vec![&dead_ids, &no_text, &no_text, &no_text, &no_time, &limit_list], 40 * n_dead_ids + 50, "")]
            }
            "dead_letters_count_by_id" => {
                vec![(vec![&dead_ids, &no_text, &no_text, &no_text, &no_time], 8 * n_dead_ids + 50, "")]
            }
            "dead_letters_retry" | "dead_letters_discard" => {
                vec![(vec![&no_ids, &dead_type, &no_text, &no_text, &no_time, &limit_list], 40 * limit_list + 100, "")]
            }
            // A retention batch walks at most its batch of rows (see
            // retention.rs), from the lowest id and from the middle.
            "retention_delete" => vec![
                (vec![&ten_days, &BATCH, &zero, &i64::MAX], 8 * BATCH + 100, ""),
                (vec![&ten_days, &BATCH, &mid, &i64::MAX], 8 * BATCH + 100, ""),
            ],
            "retention_walk_end" => vec![(vec![&ten_days], 50, "")],
            "retention_count" => vec![(vec![&ten_days], 3 * (STEADY + unpublished) + 100, "")],
            // A page from the middle of the published rows: in proportion
            // to the page; with a filter that keeps nothing, to the window.
            "replay_page" => vec![
                (
                    vec![&mid, &mid_end, &no, &no_time, &no_time, &no_text, &no_agg, &no_text, &BATCH],
                    8 * BATCH + 50,
                    "a full page",
                ),
                (
                    vec![&mid, &mid_end, &no, &no_time, &no_time, &no_text, &no_agg, &rare, &BATCH],
                    3 * window + 100,
                    "a filter that keeps nothing",
                ),
            ],
            "replay_count" => {
                vec![(vec![&mid, &mid_end, &no, &no_time, &no_time, &no_text, &no_agg, &no_text], 3 * window + 100, "")]
            }
            "replay_bounds" => vec![(vec![&mid], 50, "")],
            // The console: lookups and walks of one index, each bounded by
            // the rows it shows; the chart by the rows it reads.
            "console_event" => vec![(vec![&dead_id], 50, "")],
            "console_earlier" | "console_later" => {
                vec![(vec![&dead_agg_type, &dead_agg_id, &dead_id, &timeline], 8 * timeline + 50, "")]
            }
            "console_later_unpublished" => vec![(vec![&dead_agg_type, &dead_agg_id, &dead_id], 50, "")],
            "console_dead_letter_page" => vec![(
                vec![&no_ids, &dead_type, &no_text, &no_text, &no_time, &dead_id, &limit_list],
                5 * limit_list + 50,
                "",
            )],
            "console_delivery_per_minute" => vec![(vec![&chart_rows], 3 * chart_rows + 100, "")],
            other => panic!("no plan check for statement {other}: add one"),
        };
        // Custom plans (a statement's first runs), and the generic plan a
        // long-lived prepared statement of the relay's switches to.
        for ((params, bound, case), generic) in cases.iter().flat_map(|c| [(c, false), (c, true)]) {
            let (bound, case) = (*bound, if generic { format!("{case} (generic plan)") } else { case.to_string() });
            let tx = c.transaction().await.expect("begin");
            if generic {
                tx.batch_execute("SET LOCAL plan_cache_mode = force_generic_plan").await.expect("generic plans");
            }
            let plan = explain(&tx, &sql, params).await;
            tx.rollback().await.expect("rollback");
            let touched = buffers(&plan);
            let handled = rows_handled(&plan[0]["Plan"]);
            // The fetches' byte budget (`within_budget` in src/store/fetch.rs)
            // wraps the candidate rows in two window aggregates and the
            // subquery scans around them: five nodes that pass each candidate
            // once, touching no buffer.
            let budget_rows = if name.contains("fetch") { 5 * fetched } else { 0 };
            if touched > bound || handled > bound + budget_rows {
                let mut nodes = Vec::new();
                node_names(&plan[0]["Plan"], &mut nodes);
                failures.push(format!(
                    "{name} {case}: {touched} buffers, {handled} rows handled, bound {bound} ({} rows; plan: {})",
                    top_rows(&plan),
                    nodes.join(" / ")
                ));
            }
            if name.starts_with("backlog_") {
                eprintln!(
                    "plan_states {stats:?} backlog {backlog}: {name} {case}: {touched} buffers, {handled} rows handled"
                );
            }
            if name == "fetch" && case == "nothing in flight" {
                assert_eq!(top_rows(&plan), fetched, "{stats:?}, backlog {backlog}: the fetch returns a full batch");
                eprintln!("plan_states {stats:?} backlog {backlog}: fetch of {fetched} rows touched {touched} buffers");
            }
            if name == "fetch" && case == "a byte budget of a few events" {
                // Fresh events here are small (stored under 2 KB): the rows
                // before the last add up to less than the budget.
                let want = fetched.min(small_budget / fresh_payload_bytes + 1);
                assert_eq!(top_rows(&plan), want, "{stats:?}, backlog {backlog}: the fetch stops at the budget");
            }
        }
    }
    assert!(failures.is_empty(), "{stats:?} statistics, backlog {backlog}:\n{}", failures.join("\n"));
}

async fn run_state(stats: Stats, tag: &str) {
    let db = TestDb::new(tag).await;
    let setup = db.client().await;
    build(&setup, stats).await;
    // A session as pg-outbox opens its own: its planner settings included.
    let mut c = plan_check_session(&db).await;
    let mut loaded = 0;
    for backlog in BACKLOGS {
        insert(&setup, "fresh", backlog - loaded, "", "").await;
        loaded = backlog;
        if stats == Stats::Current {
            setup.batch_execute("ANALYZE events.outbox").await.expect("analyze");
        }
        check_all(&mut c, stats, backlog).await;
    }
    let analyzed: Option<chrono::DateTime<chrono::Utc>> = setup
        .query_one(
            "SELECT greatest(last_analyze, last_autoanalyze) FROM pg_stat_user_tables \
             WHERE schemaname = 'events' AND relname = 'outbox'",
            &[],
        )
        .await
        .expect("analyze times")
        .get(0);
    assert_eq!(analyzed.is_some(), stats != Stats::Never, "{stats:?}: the table's analyze state");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_is_bounded_on_a_table_never_analyzed() {
    run_state(Stats::Never, "plan_never").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_is_bounded_under_statistics_from_before_the_backlog() {
    run_state(Stats::Stale, "plan_stale").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_is_bounded_under_current_statistics() {
    run_state(Stats::Current, "plan_current").await;
}

/// Bound for a relay to drain the 50 000-event backlog below: about twenty
/// times what it takes here in a debug build. With the fetch planned from
/// the statistics alone, a 20 000-event backlog behind statistics from the
/// steady state delivered nothing in 90 s (every candidate row walked the
/// whole backlog), so 50 000 would take hours.
const OUTAGE_DRAIN_BOUND: std::time::Duration = std::time::Duration::from_secs(120);
const OUTAGE_BACKLOG: i64 = 50_000;

/// A backlog as an outage leaves it, then a relay: every event is delivered
/// (one stdout line each) and published within [`OUTAGE_DRAIN_BOUND`].
async fn relay_drains_an_outage_backlog(stats: Stats, tag: &str) {
    use tokio::io::AsyncBufReadExt;
    let db = TestDb::new(tag).await;
    let c = db.client().await;
    c.batch_execute("ALTER TABLE events.outbox SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)")
        .await
        .expect("autovacuum off");
    if stats == Stats::Stale {
        // Steady state: events flowed and were published; ANALYZE ran, as
        // autovacuum does on a busy table.
        insert(&c, "steady", 100_000, ", published_at", ", now() - interval '1 hour'").await;
        c.batch_execute("VACUUM ANALYZE events.outbox").await.expect("analyze the steady state");
    }
    // The outage: producers go on (triggers on), nothing is published.
    // Payloads of about 1.5 KB, one aggregate per event.
    c.batch_execute(&format!(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'subscription', md5('o' || g)::uuid, 'PaymentSucceeded', \
                jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g, 'pad', repeat(md5(g::text), 45))) \
         FROM generate_series(1, {OUTAGE_BACKLOG}) g"
    ))
    .await
    .expect("load the backlog");
    let (mut relay, stdout) = crate::relay_proc::start_with_stdout(&db, &["--sink", "stdout"]).await;
    let lines = tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let mut n = 0i64;
        while let Ok(Some(_)) = lines.next_line().await {
            n += 1;
        }
        n
    });
    let started = std::time::Instant::now();
    loop {
        let left: i64 = c
            .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[])
            .await
            .expect("count the backlog")
            .get(0);
        if left == 0 {
            break;
        }
        assert!(
            started.elapsed() < OUTAGE_DRAIN_BOUND,
            "{stats:?} statistics: {left} of {OUTAGE_BACKLOG} events still unpublished after {OUTAGE_DRAIN_BOUND:?}; relay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let took = started.elapsed();
    relay.stop_cleanly().await;
    let delivered = lines.await.expect("stdout reader");
    assert_eq!(delivered, OUTAGE_BACKLOG, "{stats:?}: every event delivered once, nothing published without delivery");
    eprintln!("relay drained {OUTAGE_BACKLOG} events behind {stats:?} statistics in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_a_backlog_that_formed_behind_stale_statistics() {
    relay_drains_an_outage_backlog(Stats::Stale, "outage_stale").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_a_backlog_on_a_table_never_analyzed() {
    relay_drains_an_outage_backlog(Stats::Never, "outage_never").await;
}

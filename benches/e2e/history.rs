//! Scenario `history`: how cost grows with the table. The same measurements
//! with 0, 1 000 000 and 10 000 000 published rows already in
//! `events.outbox` (30 days of history at about 330 000 events a day):
//! - the consumer's fetch: buffers its statement touches
//!   (`EXPLAIN (ANALYZE, BUFFERS)`) with a small unpublished backlog at the
//!   tail, against the empty table;
//! - producers: insert rate at 16 connections with a relay draining,
//!   against the empty table;
//! - the relay: drain rate of a backlog on top of the history, against the
//!   empty table;
//! - then, on the largest table, `pg-outbox archive --older-than 27d`
//!   deleting the oldest tenth while producers insert at full load: their
//!   p99 insert latency during the archive against the same producers just
//!   before and just after it, and the archive's rows/s.
//!
//! One scratch database grows from the smallest size to the largest the
//! way a live table does: each size adds the next part of the same 30-day
//! history above the ids already there, committed by producers in
//! transactions of 10 000 rows through pg-outbox's insert trigger and
//! published by a relay as they come. The table is analysed once, at its
//! first size, so the larger ones are measured with statistics from then;
//! it is never vacuumed by the bench, so it holds whatever the server's
//! autovacuum leaves of the publishing's old row versions. A `CHECKPOINT`
//! before each size's measurements starts them with every page clean.

use std::process::Stdio;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pg_outbox::tokio_postgres::{Client, Config, Statement};
use tokio_util::sync::CancellationToken;

use crate::drain::{DrainOutcome, Drainer, Job, drain_in_child};
use crate::producers::{INSERT, run_load};
use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::util::{self, RowKind, conninfo, scratch, start_relay, stop_relay};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;

/// Days of history the largest table holds; each size is the newest part.
const DAYS: i64 = 30;
/// The archive's cutoff: the oldest tenth of [`DAYS`], three days past a
/// 30-day retention (a daily run deletes one). Each batch is paced on its
/// own, so how many rows are due sets how long the run lasts, not what a
/// batch costs the producers; a tenth keeps the run under the load within
/// minutes at 10 000 000 rows.
const ARCHIVE_OLDER_THAN: &str = "27d";
/// Seconds in [`ARCHIVE_OLDER_THAN`], for the checks.
const ARCHIVE_OLDER_THAN_SECS: f64 = 27.0 * 86_400.0;
/// History rows a producer commits per transaction.
const LOAD_CHUNK: i64 = 10_000;
/// Producer transactions the relay may have left unpublished before the
/// next one is committed.
const LOAD_AHEAD: i64 = 20;
/// Events per aggregate in the history, on average.
const EVENTS_PER_AGGREGATE: i64 = 10;
/// Unpublished events at the tail when the fetch is explained.
const FETCH_TAIL: i64 = 1_000;
/// Producer connections (insert rate, and the producers around the archive).
const PRODUCERS: usize = 16;
/// Warm-up of the producers around the archive before their first baseline window.
const LOAD_WARMUP: Duration = Duration::from_millis(1500);
/// Longest the archive may run before the scenario gives up on it.
const ARCHIVE_LIMIT: Duration = Duration::from_secs(1800);

/// One table size's figures.
struct SizeRun {
    /// Published history rows in the table.
    rows: i64,
    /// Seconds to commit and publish this size's new rows.
    load_secs: f64,
    /// Table size with its indexes, MiB.
    total_mib: f64,
    /// Dead row versions in the table (`n_dead_tup` of
    /// `pg_stat_user_tables`, an estimate the server keeps).
    dead_rows: i64,
    /// Buffers (shared hit + read) of the fetch from the floor (just below
    /// the tail), custom plan and generic plan.
    fetch_floor: (i64, i64),
    /// Buffers (shared hit + read) of the fetch with no floor, custom plan.
    fetch_custom: i64,
    /// The same, generic plan (a long-lived prepared statement's).
    fetch_generic: i64,
    /// Producer inserts/s (after the warm-up): the run right after the
    /// size's CHECKPOINT, and the run after it.
    insert_rates: [f64; 2],
    /// The relay's drain of the backlog.
    drain: DrainOutcome,
}

/// What the archive phase measured.
struct ArchiveRun {
    /// Rows deleted (as `pg-outbox archive` printed, checked against the table).
    deleted: i64,
    /// Statements the archive ran (printed by it).
    batches: i64,
    /// Wall time of the `pg-outbox archive` process, seconds.
    seconds: f64,
    /// History rows before the archive.
    history_before: i64,
    /// Producers in the baseline window just before the archive.
    before: Latencies,
    /// The same during the archive.
    during: Latencies,
    /// The same in the baseline window just after it.
    after: Latencies,
    /// Both baseline windows together: the reference.
    without: Latencies,
    /// The pace it chose, as it printed it.
    printed: Printed,
}

/// Insert latencies of one window.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Latencies {
    inserts: u64,
    /// Inserts per second over the window.
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

/// The bench's own trigger that dates a history row's publication
/// [`PUBLISHED_AFTER`] after its `occurred_at` instead of at the relay's
/// `now()`, so that the history a relay publishes in minutes spans
/// [`DAYS`]; it touches only the history's rows (aggregate type
/// `history`) and changes no index access. Dropped after each load.
const BACKDATE_SQL: &str = "CREATE FUNCTION public.pgo_bench_backdate() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN NEW.published_at := NEW.occurred_at + interval '40 milliseconds'; RETURN NEW; END $$; \
     CREATE TRIGGER pgo_bench_backdate BEFORE UPDATE OF published_at ON events.outbox FOR EACH ROW \
     WHEN (OLD.published_at IS NULL AND NEW.published_at IS NOT NULL AND OLD.aggregate_type = 'history') \
     EXECUTE FUNCTION public.pgo_bench_backdate();";
/// Drops [`BACKDATE_SQL`]'s trigger and function.
const BACKDATE_DROP_SQL: &str = "DROP TRIGGER IF EXISTS pgo_bench_backdate ON events.outbox; \
     DROP FUNCTION IF EXISTS public.pgo_bench_backdate();";
/// Seconds from a history row's `occurred_at` to its `published_at`.
const PUBLISHED_AFTER: f64 = 0.04;
/// Longest the load waits for the relay to publish the rows it awaits
/// before it gives up (the relay stalled or died).
const LOAD_STALL_LIMIT: Duration = Duration::from_secs(120);

/// Where the history's rows are: pg-outbox's insert trigger gives each
/// row its id from `events.outbox_id_seq` when it is inserted, so the
/// history's positions (1 the oldest, `n_max` the newest) map to ids
/// ascending with them, the measurements' rows between the sizes' parts.
#[derive(Debug, Default)]
struct HistoryIds {
    /// The id of each position, from position 1.
    ids: Vec<i64>,
}

impl HistoryIds {
    /// The id of history position `pos`.
    fn id_of(&self, pos: i64) -> Option<i64> {
        self.ids.get(usize::try_from(pos.checked_sub(1)?).ok()?).copied()
    }
}

/// Insert the history rows at positions `lo..=hi` (of `n_max`, the largest
/// size) the way a live table gets them: producers commit them in
/// transactions of [`LOAD_CHUNK`] rows through pg-outbox's insert trigger
/// (ordering and wake-up), and a `pg-outbox relay --sink stdout` publishes
/// them as they come, with at most [`LOAD_AHEAD`] transactions waiting.
/// The rows are spread evenly over the [`DAYS`] before `anchor` (server
/// time, epoch seconds), position `n_max` the newest; payloads of about 150
/// bytes; [`EVENTS_PER_AGGREGATE`] events per aggregate on average. Each is
/// published [`PUBLISHED_AFTER`] after it occurred ([`BACKDATE_SQL`]). No
/// VACUUM and no ANALYZE: the table keeps whatever the server's autovacuum
/// leaves (on a server with it off, every row version the publishing
/// replaced). Records the rows' ids in `ids`. Fails if the relay stalls or
/// leaves a row unpublished, or if ids do not ascend with positions.
async fn load_history(
    cfg: &Config,
    client: &Client,
    ids: &mut HistoryIds,
    (lo, hi): (i64, i64),
    n_max: i64,
    anchor: f64,
) -> BenchResult<()> {
    if hi < lo {
        return Ok(());
    }
    client.batch_execute(BACKDATE_SQL).await?;
    let relay = start_relay(&conninfo(cfg), &[], false).await?;
    let result = async {
        let aggregates = (n_max / EVENTS_PER_AGGREGATE).max(1);
        let span = (DAYS * 86_400) as f64;
        let started = Instant::now();
        let mut reported = lo;
        let mut committed = std::collections::VecDeque::new();
        let published = client.prepare("SELECT published_at IS NOT NULL FROM events.outbox WHERE id = $1").await?;
        let mut from = lo;
        while from <= hi {
            let to = (from + LOAD_CHUNK - 1).min(hi);
            let at =
                format!("to_timestamp({anchor}) - make_interval(secs => {span} * ({n_max} - g) / {n_max}::float8)");
            let sql = format!(
                "WITH ins AS (\
                 INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at) \
                 SELECT 'history', md5('hist-' || (g % {aggregates}))::uuid, \
                        (ARRAY['PaymentSucceeded', 'InvoiceIssued', 'AccountUpdated', 'PlanChanged'])[1 + g % 4], \
                        jsonb_build_object('version', 1, \
                          'data', jsonb_build_object('seq', g, 'amount', g % 100000, 'currency', 'KRW', \
                                                     'note', md5(g::text)), \
                          'metadata', jsonb_build_object('correlation_id', 'req-' || g)), \
                        {at} \
                 FROM generate_series({from}::bigint, {to}::bigint) AS g ORDER BY g \
                 RETURNING id, (payload->'data'->>'seq')::bigint AS pos) \
                 SELECT array_agg(id ORDER BY pos), min(pos), max(pos) FROM ins"
            );
            let row = client.query_one(sql.as_str(), &[]).await.map_err(|e| {
                format!("inserting history rows {from}..={to} failed: {}", pg_outbox::error::report(&e))
            })?;
            let (got, first, last): (Vec<i64>, i64, i64) = (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
            let ascending = got.windows(2).all(|w| w[0] < w[1])
                && got.first().is_some_and(|&f| ids.ids.last().is_none_or(|&l| f > l));
            if (first, last) != (from, to) || i64::try_from(got.len())? != to - from + 1 || !ascending {
                return Err(format!(
                    "history rows {from}..={to} came back as positions {first}..={last}, {} rows, ids {}ascending",
                    got.len(),
                    if ascending { "" } else { "not " }
                )
                .into());
            }
            committed.extend(got.last().copied());
            ids.ids.extend(got);
            // The relay keeps up: wait for the transaction LOAD_AHEAD before this one.
            if committed.len() > usize::try_from(LOAD_AHEAD)?
                && let Some(awaited) = committed.pop_front()
            {
                await_published(client, &published, &relay, awaited).await?;
            }
            if to - reported >= 1_000_000 || to == hi {
                eprintln!(
                    "e2e: history: committed {} of {} rows ({:.0} s)",
                    fmt_count((to - lo + 1) as f64),
                    fmt_count((hi - lo + 1) as f64),
                    started.elapsed().as_secs_f64()
                );
                reported = to;
            }
            from = to + 1;
        }
        if let Some(&last) = committed.back() {
            await_published(client, &published, &relay, last).await?;
        }
        // The last row published, the earlier ones are too (the relay
        // acknowledges in id order); checked over the whole history.
        let left = || async {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM events.outbox WHERE aggregate_type = 'history' AND published_at IS NULL",
                    &[],
                )
                .await?
                .try_get(0)?;
            Ok::<_, BoxError>(n)
        };
        if !util::wait_until(LOAD_STALL_LIMIT, Duration::from_millis(200), || async { Ok(left().await? == 0) }).await? {
            return Err(format!("the relay left {} history rows unpublished", left().await?).into());
        }
        eprintln!(
            "e2e: history: the relay published {} rows ({:.0} s)",
            fmt_count((hi - lo + 1) as f64),
            started.elapsed().as_secs_f64()
        );
        Ok::<_, BoxError>(())
    }
    .await;
    let stopped = stop_relay(relay).await;
    client.batch_execute(BACKDATE_DROP_SQL).await?;
    result?;
    stopped
}

/// Wait until the row with id `id` is published (`published`: whether
/// the row with id $1 is); fails after [`LOAD_STALL_LIMIT`] with the
/// relay's log.
async fn await_published(client: &Client, published: &Statement, relay: &util::RelayProc, id: i64) -> BenchResult<()> {
    let done = util::wait_until(LOAD_STALL_LIMIT, Duration::from_millis(5), || async {
        Ok(client.query_opt(published, &[&id]).await?.map(|r| r.try_get::<_, bool>(0)).transpose()?.unwrap_or(false))
    })
    .await?;
    if !done {
        let log: Vec<char> = relay.log().chars().collect();
        let tail: String = log[log.len().saturating_sub(2_000)..].iter().collect();
        return Err(format!(
            "history row {id} was not published within {} s; the relay's log ends: {tail}",
            LOAD_STALL_LIMIT.as_secs()
        )
        .into());
    }
    Ok(())
}

/// Buffers of the consumer's fetch (custom plan, generic plan), run as the
/// consumer runs it (`pg_outbox::fetch_query`: nothing in flight, the fetch
/// floor `floor` (`i64::MIN`: none, as in a consumer's first fetch and in
/// the one after each drop of the floor: a rewind, a new session, the
/// safety net once a minute), the rewind count as the table has it, a batch of
/// [`pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE`], a budget of
/// [`pg_outbox::ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES`]) under `EXPLAIN (ANALYZE, BUFFERS)`
/// on a session opened as pg-outbox opens its own (its planner settings),
/// in a transaction rolled back. Fails unless it returns `expect_rows`.
async fn fetch_buffers(cfg: &Config, expect_rows: i64, floor: i64) -> BenchResult<(i64, i64)> {
    let mut c =
        pg_outbox_testkit::options_of(cfg).with_application_name("pg-outbox bench fetch plan").connect().await?;
    let version: i32 = c.query_one("SELECT current_setting('server_version_num')::int4", &[]).await?.try_get(0)?;
    let sql = format!("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {}", pg_outbox::fetch_query(version));
    let none: Vec<i64> = Vec::new();
    let batch = i64::try_from(pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE)?;
    // The byte budget of a consumer that holds nothing: the default bound.
    let budget = i64::try_from(pg_outbox::ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES)?;
    // The floor kept where it is (no checkpoint moves it).
    let no_xid = i64::MAX;
    // The rewind count the table has, as a running consumer would have
    // read it: another would make the fetch read from the first fresh row.
    let rewinds: Option<i64> = c
        .query_opt("SELECT term FROM events.outbox_terms WHERE scope = 'rewind'", &[])
        .await?
        .map(|r| r.try_get(0))
        .transpose()?;
    let mut out = [0i64; 2];
    for (k, generic) in [false, true].into_iter().enumerate() {
        let tx = c.transaction().await?;
        if generic {
            tx.batch_execute("SET LOCAL plan_cache_mode = force_generic_plan").await?;
        }
        let plan: serde_json::Value = tx
            .query_one(&sql, &[&none, &batch, &budget, &floor, &floor, &no_xid, &None::<i64>, &i64::MAX, &rewinds])
            .await?
            .try_get(0)?;
        tx.rollback().await?;
        let top = &plan[0]["Plan"];
        // PostgreSQL 18 prints row counts with two decimals (`500.00`).
        let rows = top["Actual Rows"].as_f64().map_or(-1, |r| r.round() as i64);
        if rows != expect_rows {
            return Err(format!("the fetch returned {rows} rows, expected {expect_rows}: {plan}").into());
        }
        out[k] = top["Shared Hit Blocks"].as_i64().unwrap_or(0) + top["Shared Read Blocks"].as_i64().unwrap_or(0);
    }
    Ok((out[0], out[1]))
}

/// Producers at full speed ([`PRODUCERS`] connections, new aggregates)
/// with a relay draining: inserts/s after the warm-up, as in `producers`.
async fn insert_rate(cfg: &Config, s: &Settings) -> BenchResult<f64> {
    let relay = start_relay(&conninfo(cfg), &[], false).await?;
    // Let the relay reach its idle state (asking for wake-ups).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (warmup, secs) = (s.producer_warmup_secs, s.history_producer_secs);
    let load = run_load(cfg, PRODUCERS, warmup + secs, warmup, 0).await;
    stop_relay(relay).await?;
    let load = load?;
    let counted: u64 = load.slices[load.warm_slices..].iter().sum();
    Ok(if secs > 0.0 { counted as f64 / secs } else { 0.0 })
}

/// Measure one size: the fetch, the producers, the relay's drain.
/// `floor`: the history's highest id (the tail comes after it).
async fn measure(cfg: &Config, s: &Settings, rows: i64, load_secs: f64, floor: i64) -> BenchResult<SizeRun> {
    let client = connect(cfg).await?;
    let row = client
        .query_one(
            "SELECT pg_total_relation_size('events.outbox')::float8 / 1048576, \
                    (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'events.outbox'::regclass)",
            &[],
        )
        .await?;
    let (total_mib, dead_rows): (f64, i64) = (row.try_get(0)?, row.try_get::<_, Option<i64>>(1)?.unwrap_or(0));
    util::load_rows(&client, RowKind::Fresh, FETCH_TAIL, 1_000, "tail").await?;
    let batch = i64::try_from(pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE)?;
    // From the floor first: the fetch with none marks the index entries of
    // the rows it passes dead (as every such fetch does), which the one
    // from the floor never reads.
    let fetch_floor = fetch_buffers(cfg, batch.min(FETCH_TAIL), floor).await?;
    let (fetch_custom, fetch_generic) = fetch_buffers(cfg, batch.min(FETCH_TAIL), i64::MIN).await?;
    // The producers' relay drains the tail too. Two runs: the first right
    // after the size's CHECKPOINT, when the first change to each index
    // page writes the whole page to the WAL (full_page_writes), the second
    // when many pages have been.
    let insert_rates = [insert_rate(cfg, s).await?, insert_rate(cfg, s).await?];
    util::load_rows(&client, RowKind::Fresh, s.history_backlog, 10_000, "backlog").await?;
    // Events the producers committed after their relay stopped are drained too.
    let due = util::fresh_unpublished(&client).await?;
    let job = Job { drainer: Drainer::Relay, limit: u64::try_from(due)?, max_secs: s.drain_max_secs };
    let drain = drain_in_child(cfg, &job).await?;
    if drain.capped {
        return Err(format!(
            "the relay drained {} of {due} events in the {:.0} s cap with {} history rows",
            drain.events, s.drain_max_secs, rows
        )
        .into());
    }
    eprintln!(
        "e2e: history: {} rows: fetch {} / {} buffers from the floor, {fetch_custom} / {fetch_generic} with none, producers {} then {} inserts/s, \
         relay {} events/s",
        fmt_count(rows as f64),
        fetch_floor.0,
        fetch_floor.1,
        fmt_count(insert_rates[0]),
        fmt_count(insert_rates[1]),
        fmt_count(drain.rate())
    );
    Ok(SizeRun { rows, load_secs, total_mib, dead_rows, fetch_floor, fetch_custom, fetch_generic, insert_rates, drain })
}

/// One insert: when it started (microseconds after the run's base
/// instant) and how long it took (microseconds).
type Sample = (u64, u64);

/// Producers at full load: [`PRODUCERS`] connections, each inserting new
/// aggregates as fast as it goes (closed loop, as in `producers`), until
/// `stop`. Returns every insert's start (relative to `base`) and latency.
async fn full_load(cfg: &Config, base: Instant, stop: CancellationToken) -> BenchResult<Vec<Sample>> {
    let mut tasks = Vec::new();
    for _ in 0..PRODUCERS {
        let client = connect(cfg).await?;
        let stmt = client.prepare(INSERT).await?;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
            while !stop.is_cancelled() {
                let started = Instant::now();
                client.execute(&stmt, &[&uuid::Uuid::new_v4()]).await?;
                samples.push((us(started.duration_since(base)), us(started.elapsed()).max(1)));
            }
            Ok::<_, BoxError>(samples)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// Latencies of the inserts that started in any of `windows` (each
/// `from_us..to_us`).
fn window(samples: &[Sample], windows: &[(u64, u64)]) -> BenchResult<Latencies> {
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    let inside = |at: u64| windows.iter().any(|&(from, to)| (from..to).contains(&at));
    for &(_, lat) in samples.iter().filter(|(at, _)| inside(*at)) {
        h.saturating_record(lat);
    }
    let secs: f64 = windows.iter().map(|&(from, to)| to.saturating_sub(from) as f64 / 1e6).sum();
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    Ok(Latencies {
        inserts: h.len(),
        per_second: h.len() as f64 / secs.max(1e-9),
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        max_ms: h.max() as f64 / 1000.0,
    })
}

/// History rows (aggregate type `history`): how many, how many of them
/// were published before the archive's cutoff at server time `at` (epoch
/// seconds), and the lowest id left (`None` when none is).
async fn history_counts(client: &Client, at: f64) -> BenchResult<(i64, i64, Option<i64>)> {
    let row = client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE published_at < to_timestamp($1) - make_interval(secs => $2)), \
                    min(id) \
             FROM events.outbox WHERE aggregate_type = 'history'",
            &[&at, &ARCHIVE_OLDER_THAN_SECS],
        )
        .await?;
    Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))
}

/// When the history row at position `pos` was published (epoch seconds),
/// as [`load_history`] wrote it.
fn published_at(pos: i64, n_max: i64, anchor: f64) -> f64 {
    anchor - (DAYS * 86_400) as f64 * (n_max - pos) as f64 / n_max as f64 + PUBLISHED_AFTER
}

async fn server_now(client: &Client) -> BenchResult<f64> {
    Ok(client.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[]).await?.try_get(0)?)
}

/// What `pg-outbox archive` printed: rows deleted, batches, the smallest
/// and largest batch (rows walked), seconds deleting and paused, rows walked.
struct Printed {
    deleted: i64,
    batches: i64,
    smallest: i64,
    largest: i64,
    busy: f64,
    paused: f64,
    walked: i64,
}

/// `pg-outbox archive --older-than 27d` at its default settings (paced) on
/// `cfg`: what it printed, and its wall time.
async fn archive(cfg: &Config) -> BenchResult<(Printed, f64)> {
    let mut cmd = tokio::process::Command::new(util::relay_bin());
    pg_outbox_testkit::process::clean_env(&mut cmd);
    cmd.env("DATABASE_URL", conninfo(cfg))
        .args(["archive", "--older-than", ARCHIVE_OLDER_THAN])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = Instant::now();
    let out = tokio::time::timeout(ARCHIVE_LIMIT, cmd.output())
        .await
        .map_err(|_| format!("pg-outbox archive did not finish within {} s", ARCHIVE_LIMIT.as_secs()))??;
    let seconds = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "pg-outbox archive failed ({}): {}{}",
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    // "deleted N published events older than 27days in B batches of X to Y
    // rows (A s deleting, P s paused; W rows walked)"
    let words: Vec<&str> =
        stdout.split_whitespace().map(|w| w.trim_matches(|c| c == '(' || c == ')' || c == ',' || c == ';')).collect();
    let after = |w: &str| words.iter().position(|x| *x == w).and_then(|i| words.get(i + 1)?.parse::<f64>().ok());
    let before =
        |w: &str| words.iter().position(|x| *x == w).and_then(|i| words.get(i.checked_sub(2)?)?.parse::<f64>().ok());
    if stdout.contains(": none were due") {
        return Ok((
            Printed { deleted: 0, batches: 0, smallest: 0, largest: 0, busy: 0.0, paused: 0.0, walked: 0 },
            seconds,
        ));
    }
    let batches = words.iter().position(|x| *x == "batches").and_then(|i| words.get(i.checked_sub(1)?)?.parse().ok());
    match (after("deleted"), batches, after("of"), after("to"), before("deleting"), before("paused"), before("walked"))
    {
        (Some(d), Some(b), Some(smallest), Some(largest), Some(busy), Some(paused), Some(walked)) => Ok((
            Printed {
                deleted: d as i64,
                batches: b,
                smallest: smallest as i64,
                largest: largest as i64,
                busy,
                paused,
                walked: walked as i64,
            },
            seconds,
        )),
        _ => Err(format!(
            "pg-outbox archive printed {stdout:?}, expected \"deleted N ... in B batches of X to Y rows (A s \
             deleting, P s paused; W rows walked)\""
        )
        .into()),
    }
}

/// The archive phase on the largest table: producers at full load with a
/// relay draining, a baseline window, `pg-outbox archive` while they go
/// on, and a second baseline window after it. Checks that the archive
/// deleted exactly the history rows older than its cutoff and nothing else
/// (`anchor`: the history's newest time, as given to [`load_history`]).
async fn archive_phase(
    cfg: &Config,
    s: &Settings,
    ids: &HistoryIds,
    n_max: i64,
    anchor: f64,
) -> BenchResult<ArchiveRun> {
    let client = connect(cfg).await?;
    // Counted before the producers start, so the count's scan of the table
    // is in no window. Rows older than the cutoff now are older than it
    // when the archive starts.
    let counted_at = server_now(&client).await?;
    let (history_before, due_before, _) = history_counts(&client, counted_at).await?;
    eprintln!(
        "e2e: history: archive --older-than {ARCHIVE_OLDER_THAN}: {} of {} history rows are older",
        fmt_count(due_before as f64),
        fmt_count(history_before as f64)
    );
    // The marks daily retention runs leave (migrations/0014): at the end
    // of each day of the history, the highest id published by then.
    let marks = (1..=DAYS)
        .map(|k| match n_max - k * n_max / DAYS {
            // Nothing was published by the end of the history's first day.
            pos if pos < 1 => Ok(0),
            pos => ids.id_of(pos).ok_or_else(|| format!("no history row at position {pos}")),
        })
        .collect::<Result<Vec<i64>, _>>()?;
    client
        .execute(
            "INSERT INTO events.outbox_retention_marks (taken_at, last_id) \
             SELECT to_timestamp($1::float8) - make_interval(days => k::int), ($2::bigint[])[k] \
             FROM generate_series(1, $3::int) AS k",
            &[&anchor, &marks, &i32::try_from(DAYS)?],
        )
        .await?;
    let relay = start_relay(&conninfo(cfg), &[], false).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = Instant::now();
    let stop = CancellationToken::new();
    let producers = {
        let (cfg, stop) = (cfg.clone(), stop.clone());
        tokio::spawn(async move { full_load(&cfg, base, stop).await })
    };
    let baseline = Duration::from_secs_f64(s.history_baseline_secs);
    let result = async {
        tokio::time::sleep(LOAD_WARMUP).await;
        let before_from = base.elapsed();
        tokio::time::sleep(baseline).await;
        let archive_from = base.elapsed();
        let started_at = server_now(&client).await?;
        let (printed, seconds) = archive(cfg).await?;
        let archive_to = base.elapsed();
        tokio::time::sleep(baseline).await;
        let after_to = base.elapsed();
        Ok::<_, BoxError>(([before_from, archive_from, archive_to, after_to], started_at, printed, seconds))
    }
    .await;
    stop.cancel();
    let samples = producers.await?;
    stop_relay(relay).await?;
    let (marks, started_at, printed, seconds) = result?;
    let (deleted, batches) = (printed.deleted, printed.batches);
    let samples = samples?;
    let [before_from, archive_from, archive_to, after_to] =
        marks.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let before = window(&samples, &[(before_from, archive_from)])?;
    let during = window(&samples, &[(archive_from, archive_to)])?;
    let after = window(&samples, &[(archive_to, after_to)])?;
    let without = window(&samples, &[(before_from, archive_from), (archive_to, after_to)])?;
    // The archive deleted exactly the history rows older than its cutoff:
    // every one that was older when it started, none younger than the
    // cutoff when it ended, and no other row.
    let ended_at = server_now(&client).await?;
    let (history_after, older_left, lowest) = history_counts(&client, started_at).await?;
    // The archive deleted the oldest `deleted` history rows and no other
    // (the rest of the history is all there), every row older than its
    // cutoff when it started, and none that was younger than its cutoff
    // when it ended.
    let exact = history_before == n_max
        && history_after == n_max - deleted
        && lowest == (deleted < n_max).then(|| ids.id_of(deleted + 1)).flatten()
        && older_left == 0
        && deleted >= due_before
        && (deleted == 0 || published_at(deleted, n_max, anchor) < ended_at - ARCHIVE_OLDER_THAN_SECS);
    if !exact {
        return Err(format!(
            "the archive did not delete exactly the oldest history rows: it printed {deleted} deleted; history rows \
             went from {history_before} (of {n_max}) to {history_after}, the lowest id left is {lowest:?}; \
             {due_before} were older than the cutoff before it started, {older_left} older than the cutoff when it \
             started are left"
        )
        .into());
    }
    eprintln!(
        "e2e: history: archive deleted {} rows in {batches} batches, {seconds:.1} s ({} rows/s); producer p99 {:.2} \
         ms before, {:.2} ms during, {:.2} ms after ({} / {} / {} inserts/s)",
        fmt_count(deleted as f64),
        fmt_count(deleted as f64 / seconds.max(1e-9)),
        before.p99_ms,
        during.p99_ms,
        after.p99_ms,
        fmt_count(before.per_second),
        fmt_count(during.per_second),
        fmt_count(after.per_second),
    );
    Ok(ArchiveRun { deleted, batches, seconds, history_before, before, during, after, without, printed })
}

/// Run the scenario in one scratch database, grown size by size.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let mut sizes = s.history_sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let n_max = sizes.last().copied().unwrap_or(0);
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "history").await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        let anchor = server_now(&client).await?;
        let autovacuum: String = client.query_one("SHOW autovacuum", &[]).await?.try_get(0)?;
        let mut runs = Vec::new();
        let mut loaded = 0;
        let mut ids = HistoryIds::default();
        for (i, &size) in sizes.iter().enumerate() {
            let t = Instant::now();
            // The next part of the history, above the ids already there.
            load_history(&db.cfg, &client, &mut ids, (loaded + 1, size), n_max, anchor).await?;
            if loaded == 0 && size > 0 {
                // The statistics an ANALYZE left when the table held its
                // first size; the larger sizes grow past them.
                client.batch_execute("ANALYZE events.outbox").await?;
            }
            loaded = size;
            util::checkpoint(&client).await?;
            let load_secs = t.elapsed().as_secs_f64();
            eprintln!("e2e: history: {} history rows, loaded in {load_secs:.1} s", fmt_count(size as f64));
            let floor = ids.id_of(size).unwrap_or(0);
            runs.push(measure(&db.cfg, s, size, load_secs, floor).await?);
            if i + 1 < sizes.len() {
                // Back to history only (the deleted rows stay as dead tuples
                // until the server's autovacuum, if it runs, removes them).
                client.execute("DELETE FROM events.outbox WHERE aggregate_type <> 'history'", &[]).await?;
            }
        }
        let archive = if n_max > 0 { Some(archive_phase(&db.cfg, s, &ids, n_max, anchor).await?) } else { None };
        Ok::<_, BoxError>((runs, archive, autovacuum))
    }
    .await;
    db.drop_now(&ctx.admin).await;
    let (runs, archive, autovacuum) = result?;
    Ok(report(s, &runs, archive.as_ref(), &autovacuum))
}

/// The section: one row per size, ratios against the empty table; the
/// archive's figures in the notes and targets.
fn report(s: &Settings, runs: &[SizeRun], archive: Option<&ArchiveRun>, autovacuum: &str) -> Section {
    let mut sec = Section::new(
        "history",
        &format!(
            "Cost with the table's history: 0 to {} published rows",
            fmt_count(runs.last().map_or(0, |r| r.rows) as f64)
        ),
        &[
            "published rows",
            "table + indexes MiB",
            "fetch buffers from the floor (custom / generic plan)",
            "vs empty",
            "fetch buffers with no floor (custom / generic plan)",
            "vs empty",
            "producer inserts/s (after checkpoint / next run)",
            "producers vs empty",
            "relay events/s",
            "relay vs empty",
            "dead row versions",
            "load s",
        ],
    );
    let base = runs.first();
    let mut data = Vec::new();
    for r in runs {
        let fetch_ratio = base.and_then(|b| {
            ratio(r.fetch_custom.max(r.fetch_generic) as f64, b.fetch_custom.max(b.fetch_generic) as f64)
        });
        let floor_ratio = base.and_then(|b| {
            ratio(r.fetch_floor.0.max(r.fetch_floor.1) as f64, b.fetch_floor.0.max(b.fetch_floor.1) as f64)
        });
        let prod_ratio = [0, 1].map(|k| base.and_then(|b| ratio(r.insert_rates[k], b.insert_rates[k])));
        let relay_ratio = base.and_then(|b| ratio(r.drain.rate(), b.drain.rate()));
        sec.rows.push(vec![
            fmt_count(r.rows as f64),
            format!("{:.0}", r.total_mib),
            format!("{} / {}", r.fetch_floor.0, r.fetch_floor.1),
            fmt_ratio(floor_ratio),
            format!("{} / {}", r.fetch_custom, r.fetch_generic),
            fmt_ratio(fetch_ratio),
            format!("{} / {}", fmt_count(r.insert_rates[0]), fmt_count(r.insert_rates[1])),
            format!("{} / {}", fmt_ratio(prod_ratio[0]), fmt_ratio(prod_ratio[1])),
            fmt_count(r.drain.rate()),
            fmt_ratio(relay_ratio),
            fmt_count(r.dead_rows as f64),
            format!("{:.0}", r.load_secs),
        ]);
        data.push(serde_json::json!({"published_rows": r.rows, "total_mib": r.total_mib,
            "fetch_buffers_custom": r.fetch_custom, "fetch_buffers_generic": r.fetch_generic,
            "fetch_ratio": fetch_ratio, "fetch_buffers_from_floor": [r.fetch_floor.0, r.fetch_floor.1],
            "fetch_from_floor_ratio": floor_ratio, "producer_inserts_per_second": r.insert_rates, "producer_ratios": prod_ratio,
            "relay": r.drain, "relay_events_per_second": r.drain.rate(), "relay_ratio": relay_ratio,
            "dead_row_versions": r.dead_rows, "load_seconds": r.load_secs}));
    }
    if let (Some(b), Some(l)) = (base, runs.last()) {
        let rows = fmt_count(l.rows as f64);
        sec.target(
            format!("fetch buffers from the floor with {rows} published rows flat (<= 1.1x the empty table)"),
            ratio(l.fetch_floor.0.max(l.fetch_floor.1) as f64, b.fetch_floor.0.max(b.fetch_floor.1) as f64),
            1.1,
            true,
        );
        sec.target(
            format!(
                "fetch buffers with no floor (a consumer's first; then one per drop of the floor) with {rows} published \
                 rows, never vacuumed, flat (<= 1.1x the empty table)"
            ),
            ratio(l.fetch_custom.max(l.fetch_generic) as f64, b.fetch_custom.max(b.fetch_generic) as f64),
            1.1,
            true,
        );
    }
    let mut archive_json = serde_json::Value::Null;
    if let Some(a) = archive {
        use pg_outbox::retention as R;
        let p99 = ratio(a.during.p99_ms, a.without.p99_ms);
        let throughput = ratio(a.during.per_second, a.without.per_second);
        let rate = a.deleted as f64 / a.seconds.max(1e-9);
        let lat = |l: &Latencies| {
            format!(
                "p50 {} ms, p99 {} ms, max {} ms, {} inserts/s",
                fmt_ms(l.p50_ms),
                fmt_ms(l.p99_ms),
                fmt_ms(l.max_ms),
                fmt_count(l.per_second)
            )
        };
        sec.notes.push(format!(
            "Archive: `pg-outbox archive --older-than {ARCHIVE_OLDER_THAN}` at its default settings (paced: each \
             batch sized from the rows per second of the one before to take about {} ms, up to {} rows; a pause \
             after each of at least {} ms and of at most {:.0} % of the time deleting) on the largest table deleted \
             {} of its {} history rows (the oldest tenth) in {} batches, {:.1} s: **{} rows/s**, walking {} \
             rows, up to the mark daily runs left a day after its cutoff (the history has one per day: the \
             highest id published by the end of that day). The pace it chose from the batches' times: \
             batches of {} to {} rows walked, {:.1} s deleting and {:.1} s paused ({:.0} % of the time deleting). Meanwhile {PRODUCERS} producer connections inserted at full load \
             (single-row autocommit INSERTs of new aggregates, each as soon as the one before returned), with a \
             relay draining. During the archive: {} ({} inserts). Without it, the {} s just before and the {} s \
             just after together: {} ({} inserts; before: {}; after: {}). p99 during vs without: {}; inserts/s: \
             {}. Checked: the rows gone are exactly the history rows older than the cutoff.",
            R::DEFAULT_RETENTION_BATCH_TIME.as_millis(),
            R::DEFAULT_RETENTION_BATCH,
            R::DEFAULT_RETENTION_PAUSE.as_millis(),
            100.0 * R::DEFAULT_RETENTION_MAX_SHARE,
            fmt_count(a.deleted as f64),
            fmt_count(a.history_before as f64),
            a.batches,
            a.seconds,
            fmt_count(rate),
            fmt_count(a.printed.walked as f64),
            a.printed.smallest,
            a.printed.largest,
            a.printed.busy,
            a.printed.paused,
            100.0 * a.printed.busy / (a.printed.busy + a.printed.paused).max(1e-9),
            lat(&a.during),
            a.during.inserts,
            s.history_baseline_secs,
            s.history_baseline_secs,
            lat(&a.without),
            a.without.inserts,
            lat(&a.before),
            lat(&a.after),
            fmt_ratio(p99),
            fmt_ratio(throughput),
        ));
        sec.target(
            "producer p99 insert latency at full load during the archive <= 1.2x without it".into(),
            p99,
            1.2,
            true,
        );
        archive_json = serde_json::json!({"deleted": a.deleted, "batches": a.batches, "seconds": a.seconds,
            "rows_per_second": rate, "history_rows_before": a.history_before, "smallest_batch": a.printed.smallest,
            "largest_batch": a.printed.largest, "busy_seconds": a.printed.busy, "paused_seconds": a.printed.paused,
            "walked": a.printed.walked, "baseline_seconds": s.history_baseline_secs, "producers_before": a.before,
            "producers_during": a.during, "producers_after": a.after, "producers_without": a.without,
            "p99_ratio": p99, "inserts_per_second_ratio": throughput});
    }
    sec.notes.push(format!(
        "History: published rows spread evenly over {DAYS} days (the largest size at {} events a day), payloads of \
         about 150 bytes, {EVENTS_PER_AGGREGATE} events per aggregate, ids ascending with time. One database grows \
         size by size as a live table does: producers commit the next part of the history above the ids already \
         there in transactions of {LOAD_CHUNK} rows through pg-outbox's insert trigger, and a `pg-outbox relay \
         --sink stdout` publishes them as they come (at most {LOAD_AHEAD} transactions behind; a trigger of the \
         bench's dates each publication {PUBLISHED_AFTER} s after the event, so that minutes of load span \
         {DAYS} days). ANALYZE ran once, at the first size: the larger ones are measured with statistics from \
         then. The bench never vacuums; the server's autovacuum was {autovacuum}, so the table holds the row \
         versions the publishing and the measurements left (the dead row versions column). A CHECKPOINT precedes \
         each size's measurements. Between sizes the rows the measurements added are deleted.",
        fmt_count(runs.last().map_or(0, |r| r.rows) as f64 / DAYS as f64)
    ));
    sec.notes.push(format!(
        "Fetch: `pg_outbox::fetch_query()` (nothing in flight, batch {}) under EXPLAIN (ANALYZE, BUFFERS) on a \
         session with pg-outbox's planner settings, with {FETCH_TAIL} unpublished events (~1.5 KB) at the tail; \
         shared buffers hit + read of the plan, custom and generic plan; the ratio is of the larger. From the floor: \
         the floor just below the tail, where a running consumer's floor is once the history is published. With no \
         floor: a consumer's first fetch, and the one after each drop of the floor (a rewind, a new session, \
         once a minute as a safety net), which reads `outbox_fresh_order_idx` from its start, so every entry the publishing left there \
         until a VACUUM removes it. Producers: \
         {PRODUCERS} connections, single-row autocommit INSERTs of new aggregates as fast as they go with a relay \
         draining, {} s of warm-up then {} s counted; two runs per size, back to back: the first right after the \
         CHECKPOINT before the size's measurements, when the first change to each index page after it writes the whole page to the WAL \
         (`full_page_writes`), which with the aggregate index's random keys costs more the larger the index; the \
         second when many of its pages have been written once (a live table pays the first after each \
         checkpoint). Relay: `pg-outbox relay --sink stdout` \
         draining a backlog of {} events (~1.5 KB) inserted on top of the history (statistics from before it, as \
         an outage leaves them). Every ratio is against the empty table (0 rows) of the same run, measured first.",
        pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE,
        s.producer_warmup_secs,
        s.history_producer_secs,
        fmt_count(s.history_backlog as f64)
    ));
    sec.data = serde_json::json!({"sizes": data, "archive": archive_json});
    sec
}

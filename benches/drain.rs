//! Drain throughput: pg-outbox's consumer against the seed's poller and a
//! plain-SQL batched loop, measured in the same run.
//!
//! Run it with `cargo bench --bench drain`. It needs a PostgreSQL server:
//! `DATABASE_URL` if set, else `postgres://postgres@127.0.0.1:5432/postgres`
//! if that answers, else a throwaway server started from the local binaries
//! ([`pg_outbox::temp_server::TempServer`]). It creates its own database
//! `pgo_bench_<pid>`, migrates it with [`pg_outbox::migrate::apply`], and
//! drops it at the end (also after a failed scenario).
//!
//! Before each scenario the outbox is truncated and reloaded with the same
//! backlog (one `INSERT ... SELECT generate_series`, ~1.5 KB JSON envelope
//! per event, spread over many aggregates), then `VACUUM ANALYZE` and
//! `CHECKPOINT` run; none of that is timed. The database refuses to
//! un-publish rows (the `outbox_guard` trigger), so resetting with
//! `UPDATE ... SET published_at = NULL` is not an option.
//!
//! Scenarios (each reads and decodes every column a consumer needs, payload
//! JSON included, so all of them do the same work per event):
//! - `seed poller`: the seed's FetchUnpublishedBatch (`LIMIT 50`) followed by
//!   one MarkPublished `UPDATE ... WHERE id = $1` per row, autocommit.
//! - `plain-SQL loop`: fetch 500 due rows, one `UPDATE ... WHERE id = ANY($1)`.
//! - `Consumer`: pg-outbox's stream, acknowledging every delivery, with the
//!   default batch size (50) and with 500. Timed until the table shows no
//!   unpublished row (acknowledgements are written in batches, so the last
//!   ones land a few milliseconds after the last delivery).
//!
//! Results are ratios against the two baselines, never pass/fail on time:
//! the machine may be shared and noisy. The Markdown table goes to stdout
//! and, with a JSON twin, to `target/bench/drain.md` and `drain.json`.
//!
//! Settings (environment):
//! - `BENCH_EVENTS`: backlog size (default 100000).
//! - `BENCH_AGGREGATES`: distinct aggregates (default 10000).
//! - `BENCH_MAX_SECS`: time cap per scenario (default 20). A scenario that
//!   has not drained the backlog by then stops and reports the rate over the
//!   events it did publish (marked "capped"); the seed poller usually is,
//!   since it commits once per event.
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it runs a quick
//! smoke pass over 1000 events and writes no files.

use std::collections::{BTreeMap, HashSet};
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;

use common::{BenchResult, BoxError, connect, drop_database, find_server, report_dir};
use futures::StreamExt;
use pg_outbox::tokio_postgres::{self, Client, Config, Row};
use pg_outbox::{Consumer, Event};
use serde::Serialize;

/// The seed's FetchUnpublishedBatch, verbatim.
const SEED_FETCH: &str = "SELECT * FROM events.outbox \
    WHERE published_at IS NULL AND (next_retry_at IS NULL OR next_retry_at <= NOW()) \
    ORDER BY id ASC LIMIT 50";

/// The seed's MarkPublished, verbatim.
const SEED_MARK: &str = "UPDATE events.outbox SET published_at = NOW() WHERE id = $1";

/// The plain-SQL loop's fetch: the seed's query with a larger batch and
/// the columns a consumer reads.
const PLAIN_FETCH: &str = "SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at, \
      retry_count, last_error FROM events.outbox \
    WHERE published_at IS NULL AND (next_retry_at IS NULL OR next_retry_at <= NOW()) \
    ORDER BY id ASC LIMIT 500";

/// The plain-SQL loop's batched MarkPublished.
const PLAIN_MARK: &str = "UPDATE events.outbox SET published_at = NOW() WHERE id = ANY($1::bigint[])";

/// Count of rows not published yet (served by `outbox_unpublished_idx`).
const UNPUBLISHED: &str = "SELECT count(*) FROM events.outbox WHERE published_at IS NULL";

/// Benchmark settings, read from the environment.
#[derive(Debug, Clone, Serialize)]
struct Settings {
    /// Backlog size per scenario.
    events: i64,
    /// Distinct `(aggregate_type, aggregate_id)` pairs, roughly.
    aggregates: i64,
    /// Time cap per scenario, in seconds.
    max_secs: u64,
    /// Quick pass under `cargo test`: small backlog, no files written.
    smoke: bool,
}

impl Settings {
    /// Read the settings; `smoke` when not run by `cargo bench`.
    fn from_env() -> BenchResult<Self> {
        let smoke = !std::env::args().any(|a| a == "--bench");
        let events = env_number("BENCH_EVENTS", if smoke { 1_000 } else { 100_000 })?;
        let aggregates = env_number("BENCH_AGGREGATES", 10_000)?;
        let max_secs = env_number("BENCH_MAX_SECS", 20)?;
        if events < 1 || aggregates < 1 || max_secs < 1 {
            return Err("BENCH_EVENTS, BENCH_AGGREGATES and BENCH_MAX_SECS must be at least 1".into());
        }
        let max_secs = u64::try_from(max_secs)?;
        Ok(Settings { events, aggregates, max_secs, smoke })
    }
}

/// An integer from the environment, or `default` when unset or empty.
fn env_number(name: &str, default: i64) -> BenchResult<i64> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => {
            let cleaned: String = v.trim().chars().filter(|c| *c != '_').collect();
            cleaned.parse::<i64>().map_err(|e| format!("{name}={v:?} is not a whole number: {e}").into())
        }
        _ => Ok(default),
    }
}

/// One scenario's measurement.
#[derive(Debug, Clone, Serialize)]
struct Outcome {
    /// Scenario name, as printed.
    scenario: String,
    /// Events published within the measurement.
    events: u64,
    /// Wall-clock seconds of the measurement (load excluded).
    seconds: f64,
    /// True when the time cap stopped the scenario before the backlog was empty.
    capped: bool,
    /// Deliveries whose id was not above the previous one (Consumer only).
    order_violations: u64,
    /// Deliveries of an id already delivered (Consumer only).
    duplicates: u64,
    /// Seconds `EventStream::finish` took after the measurement (Consumer only).
    finish_seconds: Option<f64>,
}

impl Outcome {
    /// Events per second.
    fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.events as f64 / self.seconds } else { 0.0 }
    }
}

/// Truncate the outbox and load the backlog, then vacuum, analyse and
/// checkpoint so every scenario starts from the same state. Returns the
/// average payload size in bytes (as JSON text).
async fn load_backlog(client: &Client, s: &Settings) -> BenchResult<f64> {
    client.batch_execute("TRUNCATE events.outbox RESTART IDENTITY").await?;
    // ~1.5 KB per payload: the seeded envelope around a few fields and a
    // 1408-character note, varied per row.
    let insert = format!(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT (ARRAY['subscription', 'invoice', 'account'])[1 + (g % {aggs}) % 3], \
                md5('aggregate-' || (g % {aggs}))::uuid, \
                (ARRAY['PaymentSucceeded', 'InvoiceIssued', 'AccountUpdated', 'PlanChanged'])[1 + g % 4], \
                jsonb_build_object( \
                  'version', 1, \
                  'data', jsonb_build_object('seq', g, 'amount', g % 100000, 'currency', 'KRW', \
                                             'note', repeat(md5(g::text), 44)), \
                  'metadata', jsonb_build_object('causation_id', md5('cause-' || g)::uuid::text, \
                                                 'correlation_id', 'req-' || g)) \
         FROM generate_series(1, {n}::bigint) AS g",
        aggs = s.aggregates,
        n = s.events
    );
    client.batch_execute(&insert).await?;
    client.batch_execute("VACUUM ANALYZE events.outbox").await?;
    if let Err(e) = client.batch_execute("CHECKPOINT").await {
        eprintln!("bench: CHECKPOINT refused ({e}); results may be noisier");
    }
    let row = client.query_one("SELECT avg(octet_length(payload::text))::float8 FROM events.outbox", &[]).await?;
    Ok(row.try_get::<_, Option<f64>>(0)?.unwrap_or(0.0))
}

/// Read a row the way a consumer would (every column it hands on, the
/// payload parsed as JSON), so the baselines do the same decoding work as
/// pg-outbox.
fn decode(row: &Row) -> BenchResult<Event> {
    Ok(Event {
        id: row.try_get("id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        occurred_at: row.try_get("occurred_at")?,
        retry_count: row.try_get("retry_count")?,
        last_error: row.try_get("last_error")?,
    })
}

/// Unpublished rows left in the outbox.
async fn unpublished(client: &Client) -> BenchResult<i64> {
    Ok(client.query_one(UNPUBLISHED, &[]).await?.try_get(0)?)
}

/// The seed's poller as written: fetch 50, then one autocommitted UPDATE
/// per row.
async fn seed_poller(cfg: &Config, s: &Settings) -> BenchResult<Outcome> {
    let client = connect(cfg).await?;
    let fetch = client.prepare(SEED_FETCH).await?;
    let mark = client.prepare(SEED_MARK).await?;
    let deadline = Instant::now() + Duration::from_secs(s.max_secs);
    let started = Instant::now();
    let mut done = 0u64;
    let mut capped = false;
    loop {
        let rows = client.query(&fetch, &[]).await?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            let event = black_box(decode(row)?);
            client.execute(&mark, &[&event.id]).await?;
            done += 1;
        }
        if Instant::now() >= deadline {
            capped = unpublished(&client).await? > 0;
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(Outcome {
        scenario: "seed poller (50, UPDATE per row)".into(),
        events: done,
        seconds,
        capped,
        order_violations: 0,
        duplicates: 0,
        finish_seconds: None,
    })
}

/// A plain-SQL batched loop: fetch 500 rows, mark them with one UPDATE.
async fn plain_loop(cfg: &Config, s: &Settings) -> BenchResult<Outcome> {
    let client = connect(cfg).await?;
    let fetch = client.prepare(PLAIN_FETCH).await?;
    let mark = client.prepare(PLAIN_MARK).await?;
    let deadline = Instant::now() + Duration::from_secs(s.max_secs);
    let started = Instant::now();
    let mut done = 0u64;
    let mut capped = false;
    let mut ids: Vec<i64> = Vec::with_capacity(500);
    loop {
        let rows = client.query(&fetch, &[]).await?;
        if rows.is_empty() {
            break;
        }
        ids.clear();
        for row in &rows {
            ids.push(black_box(decode(row)?).id);
        }
        let marked = client.execute(&mark, &[&ids]).await?;
        done += marked;
        if Instant::now() >= deadline {
            capped = unpublished(&client).await? > 0;
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(Outcome {
        scenario: "plain-SQL loop (500, UPDATE ... ANY)".into(),
        events: done,
        seconds,
        capped,
        order_violations: 0,
        duplicates: 0,
        finish_seconds: None,
    })
}

/// What the consumer scenario saw while reading the stream.
#[derive(Debug, Default)]
struct Tally {
    /// Deliveries acknowledged.
    delivered: u64,
    /// Deliveries whose id was not above the previous one.
    order_violations: u64,
    /// Deliveries of an id already delivered.
    duplicates: u64,
    /// True when the time cap stopped the reading.
    capped: bool,
    /// Seconds from `start()` until the table showed no unpublished row (or
    /// until the cap).
    seconds: f64,
}

/// Read and acknowledge deliveries until `expected` distinct events were
/// acknowledged and the table shows them all published, or until `deadline`.
async fn read_stream(
    stream: &mut pg_outbox::EventStream,
    probe: &Client,
    expected: u64,
    deadline: tokio::time::Instant,
    started: Instant,
) -> BenchResult<Tally> {
    let mut tally = Tally::default();
    let mut seen: HashSet<i64> = HashSet::with_capacity(usize::try_from(expected)?);
    let mut last_id = i64::MIN;
    while tally.delivered - tally.duplicates < expected {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(delivery)) => {
                let id = delivery.id;
                if id <= last_id {
                    tally.order_violations += 1;
                }
                last_id = last_id.max(id);
                if !seen.insert(id) {
                    tally.duplicates += 1;
                }
                black_box(delivery.payload.get("version"));
                delivery.ack();
                tally.delivered += 1;
            }
            Ok(None) => return Err("the consumer stream ended before the backlog was drained".into()),
            Err(_) => {
                tally.capped = true;
                tally.seconds = started.elapsed().as_secs_f64();
                return Ok(tally);
            }
        }
    }
    // Acknowledgements are written in batches: wait for the last one.
    loop {
        if unpublished(probe).await? == 0 {
            tally.seconds = started.elapsed().as_secs_f64();
            return Ok(tally);
        }
        if tokio::time::Instant::now() >= deadline + Duration::from_secs(10) {
            return Err("every event was delivered and acknowledged, but rows stayed unpublished".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// pg-outbox's consumer stream with `batch` rows per fetch, acknowledging
/// every delivery; timed from `start()` until the table shows no
/// unpublished row. `finish()` is called in every case (also on error) and
/// timed apart.
async fn consumer(cfg: &Config, s: &Settings, batch: usize) -> BenchResult<Outcome> {
    let probe = connect(cfg).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(s.max_secs);
    let expected = u64::try_from(s.events)?;
    let started = Instant::now();
    let mut stream = Consumer::builder(cfg.clone()).batch_size(batch).start().await?;
    let read = read_stream(&mut stream, &probe, expected, deadline, started).await;
    let finish_started = Instant::now();
    let finished = stream.finish().await;
    let finish_seconds = finish_started.elapsed().as_secs_f64();
    let tally = read?;
    finished?;
    let published: i64 =
        probe.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[]).await?.try_get(0)?;
    let distinct = tally.delivered - tally.duplicates;
    if u64::try_from(published)? < distinct {
        return Err(format!("{distinct} events acknowledged but only {published} rows published after finish()").into());
    }
    Ok(Outcome {
        scenario: format!("pg_outbox Consumer (batch {batch}, ack each)"),
        events: distinct,
        seconds: tally.seconds,
        capped: tally.capped,
        order_violations: tally.order_violations,
        duplicates: tally.duplicates,
        finish_seconds: Some(finish_seconds),
    })
}

/// Which scenario to run.
#[derive(Debug, Clone, Copy)]
enum Scenario {
    /// [`seed_poller`].
    Seed,
    /// [`plain_loop`].
    Plain,
    /// [`consumer`] with this batch size.
    Consumer(usize),
}

/// Load the backlog, then run one scenario and check that it published
/// everything it claims to have published.
async fn run_scenario(cfg: &Config, s: &Settings, which: Scenario) -> BenchResult<(Outcome, f64)> {
    let admin = connect(cfg).await?;
    let load_started = Instant::now();
    let payload_bytes = load_backlog(&admin, s).await?;
    eprintln!(
        "bench: loaded {} events ({payload_bytes:.0} B payload avg) in {:.1} s",
        s.events,
        load_started.elapsed().as_secs_f64()
    );
    let outcome = match which {
        Scenario::Seed => seed_poller(cfg, s).await?,
        Scenario::Plain => plain_loop(cfg, s).await?,
        Scenario::Consumer(batch) => consumer(cfg, s, batch).await?,
    };
    let left = unpublished(&admin).await?;
    if !outcome.capped && left != 0 {
        return Err(format!("{}: finished with {left} rows still unpublished", outcome.scenario).into());
    }
    eprintln!(
        "bench: {:<42} {:>7} events in {:>7.2} s = {:>9.0} events/s{}",
        outcome.scenario,
        outcome.events,
        outcome.seconds,
        outcome.rate(),
        if outcome.capped { " (capped)" } else { "" }
    );
    if let Some(f) = outcome.finish_seconds {
        eprintln!("bench: {:<42} finish() took {:.3} s", outcome.scenario, f);
    }
    Ok((outcome, payload_bytes))
}

/// `value / base` as `"12.34x"`, or `"n/a"` without a base.
fn ratio(value: f64, base: Option<f64>) -> String {
    match base {
        Some(b) if b > 0.0 => format!("{:.2}x", value / b),
        _ => "n/a".into(),
    }
}

/// The Markdown report: a short header and the table.
fn markdown(s: &Settings, context: &BTreeMap<&str, String>, outcomes: &[Outcome]) -> String {
    let seed = outcomes.iter().find(|o| o.scenario.starts_with("seed")).map(Outcome::rate);
    let plain = outcomes.iter().find(|o| o.scenario.starts_with("plain")).map(Outcome::rate);
    let mut out = String::new();
    out.push_str("# pg-outbox drain benchmark\n\n");
    for (k, v) in context {
        out.push_str(&format!("- {k}: {v}\n"));
    }
    out.push_str(&format!(
        "- backlog: {} events over {} aggregates, cap {} s per scenario\n\n",
        s.events,
        s.aggregates.min(s.events),
        s.max_secs
    ));
    out.push_str("| scenario | events | seconds | events/s | vs seed poller | vs plain-SQL loop |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|\n");
    for o in outcomes {
        let mut name = o.scenario.clone();
        if o.capped {
            name.push_str(" (capped)");
        }
        if o.order_violations > 0 || o.duplicates > 0 {
            name.push_str(&format!(" [{} out of order, {} duplicates]", o.order_violations, o.duplicates));
        }
        out.push_str(&format!(
            "| {name} | {} | {:.2} | {:.0} | {} | {} |\n",
            o.events,
            o.seconds,
            o.rate(),
            ratio(o.rate(), seed),
            ratio(o.rate(), plain)
        ));
    }
    out.push_str(
        "\nRatios are events/s divided by the baseline's events/s in the same run. \
         A capped scenario's rate is over the events it published before the cap.\n",
    );
    out
}

/// Facts about the server that matter for reading the numbers.
async fn server_context(client: &Client) -> BenchResult<BTreeMap<&'static str, String>> {
    let mut ctx = BTreeMap::new();
    let version: String = client.query_one("SELECT version()", &[]).await?.try_get(0)?;
    ctx.insert("server", version);
    let rows = client
        .query(
            "SELECT name, current_setting(name) FROM pg_settings \
             WHERE name IN ('fsync', 'synchronous_commit', 'shared_buffers') ORDER BY name",
            &[],
        )
        .await?;
    let settings: Vec<String> = rows
        .iter()
        .map(|r| -> Result<String, tokio_postgres::Error> {
            Ok(format!("{}={}", r.try_get::<_, String>(0)?, r.try_get::<_, String>(1)?))
        })
        .collect::<Result<_, _>>()?;
    ctx.insert("settings", settings.join(", "));
    ctx.insert(
        "cpus",
        std::thread::available_parallelism().map(|n| n.get().to_string()).unwrap_or_else(|_| "?".into()),
    );
    Ok(ctx)
}

/// Run every scenario against the database `cfg` (already migrated).
async fn run_all(cfg: &Config, s: &Settings) -> BenchResult<(Vec<Outcome>, f64)> {
    let mut outcomes = Vec::new();
    let mut payload = 0.0;
    for which in
        [Scenario::Seed, Scenario::Plain, Scenario::Consumer(pg_outbox::DEFAULT_BATCH_SIZE), Scenario::Consumer(500)]
    {
        let (outcome, bytes) = run_scenario(cfg, s, which).await?;
        payload = bytes;
        outcomes.push(outcome);
    }
    Ok((outcomes, payload))
}

/// Set up the database, run the scenarios, report, and clean up.
async fn bench() -> BenchResult<()> {
    let s = Settings::from_env()?;
    let (admin_cfg, _server) = find_server().await?;
    let admin = connect(&admin_cfg).await?;
    let db = format!("pgo_bench_{}", std::process::id());
    drop_database(&admin, &db).await;
    admin.batch_execute(&format!("CREATE DATABASE {db}")).await?;
    let mut cfg = admin_cfg.clone();
    cfg.dbname(&db);
    let result = async {
        let client = connect(&cfg).await?;
        let report = pg_outbox::migrate::apply(&client).await?;
        eprintln!("bench: database {db} migrated ({} files)", report.applied.len());
        let mut context = server_context(&client).await?;
        drop(client);
        let started = Instant::now();
        let (outcomes, payload) = run_all(&cfg, &s).await?;
        context.insert("payload", format!("{payload:.0} bytes of JSON text on average"));
        context.insert("total run", format!("{:.0} s", started.elapsed().as_secs_f64()));
        Ok::<_, BoxError>((context, outcomes))
    }
    .await;
    drop_database(&admin, &db).await;
    let (context, outcomes) = result?;
    let md = markdown(&s, &context, &outcomes);
    println!("{md}");
    if s.smoke {
        eprintln!("bench: smoke pass (run `cargo bench --bench drain` for the real thing); no files written");
        return Ok(());
    }
    let dir = report_dir();
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("drain.md"), &md)?;
    let json = serde_json::json!({
        "settings": s,
        "context": context,
        "results": outcomes.iter().map(|o| serde_json::json!({
            "scenario": o.scenario,
            "events": o.events,
            "seconds": o.seconds,
            "events_per_second": o.rate(),
            "capped": o.capped,
            "order_violations": o.order_violations,
            "duplicates": o.duplicates,
            "finish_seconds": o.finish_seconds,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(dir.join("drain.json"), serde_json::to_string_pretty(&json)?)?;
    eprintln!("bench: wrote {} and drain.json", dir.join("drain.md").display());
    Ok(())
}

/// Entry point: run [`bench`] on a multi-threaded runtime and report errors.
fn main() -> ExitCode {
    common::main_with(bench)
}

//! Scenario `drain`: drain a pre-loaded backlog to a no-op sink and
//! report events/s and the drainer's peak RSS, in three states of the table
//! (see [`TableState`]): stale statistics (the headline: the table as an
//! outage leaves it), never analysed, and settled. Then a backlog of 1 MiB
//! payloads ([`run_large`]), drained by the Consumer and the relay with the
//! default byte bound (`max_buffered_bytes`, 64 MiB) and with none to speak
//! of (the bound before there was one: rows alone), for their peak RSS.
//! Each drainer runs as a child process (this bench binary in
//! `--child-drain` mode, or the relay), so the bench's own memory does not
//! count.

use std::hint::black_box;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::tokio_postgres::{Client, Config, Row};
use pg_outbox::{Consumer, Event};
use serde::{Deserialize, Serialize};

use crate::report::{Section, fmt_count, fmt_ratio, ratio};
use crate::util::{self, RowKind, conninfo, scratch, start_relay, stop_relay, vm_hwm_kib};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;
use pg_outbox_testkit::db::drop_database;

/// The seed's FetchUnpublishedBatch, verbatim.
const SEED_FETCH: &str = "SELECT * FROM events.outbox \
    WHERE published_at IS NULL AND (next_retry_at IS NULL OR next_retry_at <= NOW()) \
    ORDER BY id ASC LIMIT 50";
/// The seed's MarkPublished, verbatim.
const SEED_MARK: &str = "UPDATE events.outbox SET published_at = NOW() WHERE id = $1";
/// The plain-SQL loop's fetch: the seed's query, 500 rows.
const PLAIN_FETCH: &str = "SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at, \
      retry_count, last_error FROM events.outbox \
    WHERE published_at IS NULL AND (next_retry_at IS NULL OR next_retry_at <= NOW()) \
    ORDER BY id ASC LIMIT 500";
/// The plain-SQL loop's batched MarkPublished (500 ids per statement).
const PLAIN_MARK: &str = "UPDATE events.outbox SET published_at = NOW() WHERE id = ANY($1::bigint[])";
/// The server-side loop: marks the backlog published 500 rows per
/// transaction in a procedure, no client in the loop (the floor of any
/// drainer that must also carry the rows out of the server).
const SERVER_LOOP_PROCEDURE: &str = "CREATE OR REPLACE PROCEDURE pgo_bench_server_loop(batch int) \
    LANGUAGE plpgsql AS $$ \
    DECLARE n bigint; \
    BEGIN \
      LOOP \
        UPDATE events.outbox SET published_at = now() WHERE id IN ( \
          SELECT id FROM events.outbox \
          WHERE published_at IS NULL AND (next_retry_at IS NULL OR next_retry_at <= now()) \
          ORDER BY id LIMIT batch); \
        GET DIAGNOSTICS n = ROW_COUNT; \
        EXIT WHEN n = 0; \
        COMMIT; \
      END LOOP; \
    END $$";
/// Is any due row still unpublished?
const ANY_DUE: &str =
    "SELECT EXISTS (SELECT 1 FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NULL)";

/// Environment variables passing a drain job to the child.
const ENV_URL: &str = "PG_OUTBOX_BENCH_CHILD_URL";
const ENV_JOB: &str = "PG_OUTBOX_BENCH_CHILD_JOB";
/// The Consumer's byte bound (`max_buffered_bytes`) in the child; unset or
/// empty: the default.
const ENV_MAX_BYTES: &str = "PG_OUTBOX_BENCH_CHILD_MAX_BUFFERED_BYTES";
/// The argument selecting child mode.
pub const CHILD_ARG: &str = "--child-drain";

/// What a child drains and how.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum Drainer {
    /// The seed's poller: fetch 50, one autocommitted UPDATE per row.
    Seed,
    /// Fetch 500, one `UPDATE ... = ANY($1)` for them.
    Plain,
    /// `pg_outbox::Consumer`, acknowledging every delivery, with this batch size.
    Consumer(usize),
    /// `pg-outbox relay --sink stdout`, its stdout a pipe this process reads and discards.
    Relay,
    /// [`SERVER_LOOP_PROCEDURE`]: `UPDATE ... WHERE id IN (SELECT ... ORDER
    /// BY id LIMIT 500)`, a commit after each, in one `CALL`; no row leaves
    /// the server.
    ServerLoop,
}

impl Drainer {
    /// Name used in the table.
    pub fn name(self) -> String {
        match self {
            Drainer::Seed => "seed poller (fetch 50, UPDATE per row)".into(),
            Drainer::Plain => "plain-SQL loop (fetch 500, one UPDATE)".into(),
            Drainer::Consumer(b) => format!("Consumer (batch {b})"),
            Drainer::Relay => "relay --sink stdout, piped".into(),
            Drainer::ServerLoop => "server-side loop (UPDATE 500 per commit, no client)".into(),
        }
    }
}

/// A drain job for a child process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// How to drain.
    pub drainer: Drainer,
    /// Stop after this many events (a prefix of the backlog).
    pub limit: u64,
    /// Give up after this many seconds (then "capped").
    pub max_secs: f64,
}

/// What a drain achieved.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DrainOutcome {
    /// Events published in the measurement.
    pub events: u64,
    /// Seconds from the drainer's start until they were published.
    pub seconds: f64,
    /// The time cap stopped it first.
    pub capped: bool,
    /// Peak RSS of the drainer process, KiB (`VmHWM`).
    pub vm_hwm_kib: Option<u64>,
    /// The whole machine's busy CPU time during the drain (child process
    /// included), seconds ([`util::machine_cpu_s`]); set by the parent.
    #[serde(default)]
    pub machine_busy_s: Option<f64>,
    /// The wall-clock seconds [`Self::machine_busy_s`] was read over (the
    /// child's start and exit included); set by the parent.
    #[serde(default)]
    pub machine_wall_s: Option<f64>,
}

impl DrainOutcome {
    /// Events per second.
    pub fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.events as f64 / self.seconds } else { 0.0 }
    }

    /// The machine's busy CPU per event, µs.
    pub fn cpu_us_per_event(&self) -> Option<f64> {
        self.machine_busy_s.filter(|_| self.events > 0).map(|s| s * 1e6 / self.events as f64)
    }

    /// Cores busy on average during the drain.
    pub fn cores_busy(&self) -> Option<f64> {
        self.machine_busy_s.zip(self.machine_wall_s.filter(|w| *w > 0.0)).map(|(b, w)| b / w)
    }
}

/// Decode a row the way a consumer would (every column, payload parsed), so
/// the baselines do the same work per event as pg-outbox.
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

async fn any_due(client: &Client) -> BenchResult<bool> {
    Ok(client.query_one(ANY_DUE, &[]).await?.try_get(0)?)
}

/// Child mode: run the job from the environment, print one JSON line.
pub async fn child_main() -> BenchResult<()> {
    let url = std::env::var(ENV_URL).map_err(|_| format!("{CHILD_ARG} needs {ENV_URL}"))?;
    let job: Job = serde_json::from_str(&std::env::var(ENV_JOB).map_err(|_| format!("{CHILD_ARG} needs {ENV_JOB}"))?)?;
    let cfg = pg_outbox::ConnectOptions::parse(&url)?.tokio_postgres_config();
    let bound = match std::env::var(ENV_MAX_BYTES) {
        Ok(v) if !v.is_empty() => Some(v.parse::<usize>().map_err(|e| format!("{ENV_MAX_BYTES}={v:?}: {e}"))?),
        _ => None,
    };
    let mut outcome = drain_here(&cfg, &job, bound).await?;
    outcome.vm_hwm_kib = vm_hwm_kib(std::process::id());
    println!("{}", serde_json::to_string(&outcome)?);
    Ok(())
}

/// Drain in this process; `bound`: the Consumer's byte bound (`None`: the
/// default).
async fn drain_here(cfg: &Config, job: &Job, bound: Option<usize>) -> BenchResult<DrainOutcome> {
    if job.drainer == Drainer::ServerLoop {
        return drain_server_side(cfg, job).await;
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(job.max_secs);
    let mut done = 0u64;
    let mut capped = false;
    match job.drainer {
        Drainer::Seed | Drainer::Plain => {
            let client = connect(cfg).await?;
            let seed = job.drainer == Drainer::Seed;
            let fetch = client.prepare(if seed { SEED_FETCH } else { PLAIN_FETCH }).await?;
            let mark = client.prepare(if seed { SEED_MARK } else { PLAIN_MARK }).await?;
            while done < job.limit {
                // The cap holds even for a fetch whose plan reads the whole
                // backlog: the statement is abandoned (the copy is dropped
                // with its sessions).
                let Ok(rows) = tokio::time::timeout_at(deadline.into(), client.query(&fetch, &[])).await else {
                    capped = true;
                    break;
                };
                let rows = rows?;
                if rows.is_empty() {
                    break;
                }
                let mut ids = Vec::with_capacity(rows.len());
                for row in &rows {
                    let event = black_box(decode(row)?);
                    if seed {
                        client.execute(&mark, &[&event.id]).await?;
                    } else {
                        ids.push(event.id);
                    }
                    done += 1;
                }
                if !seed {
                    client.execute(&mark, &[&ids]).await?;
                }
                if Instant::now() >= deadline {
                    capped = true;
                    break;
                }
            }
        }
        Drainer::Consumer(batch) => {
            let probe = connect(cfg).await?;
            let mut builder = Consumer::builder(pg_outbox_testkit::options_of(cfg)).batch_size(batch);
            if let Some(bytes) = bound {
                builder = builder.max_buffered_bytes(bytes);
            }
            let mut stream = builder.start().await?;
            loop {
                let next = tokio::time::timeout_at(deadline.into(), stream.next()).await;
                match next {
                    Ok(Some(d)) => {
                        black_box(&d.payload);
                        d.ack();
                        done += 1;
                        if done >= job.limit {
                            break;
                        }
                    }
                    Ok(None) => return Err("the consumer's stream ended before the backlog was drained".into()),
                    Err(_) => {
                        capped = true;
                        break;
                    }
                }
            }
            // Acknowledgements are written in batches: the drain is over when
            // the table shows no due row.
            while !capped && any_due(&probe).await? {
                if Instant::now() >= deadline {
                    capped = true;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let seconds = started.elapsed().as_secs_f64();
            if capped {
                // A statement may still be running (a fetch whose plan reads
                // the whole backlog), and finishing would wait for it: drop
                // the stream instead; the copy is dropped with its sessions.
                drop(stream);
            } else {
                stream.finish().await?;
            }
            return Ok(DrainOutcome {
                events: done,
                seconds,
                capped,
                vm_hwm_kib: None,
                machine_busy_s: None,
                machine_wall_s: None,
            });
        }
        Drainer::Relay => return Err("the relay drainer runs as its own process".into()),
        Drainer::ServerLoop => return Err("the server-side loop has its own drain".into()),
    }
    Ok(DrainOutcome {
        events: done,
        seconds: started.elapsed().as_secs_f64(),
        capped,
        vm_hwm_kib: None,
        machine_busy_s: None,
        machine_wall_s: None,
    })
}

/// [`Drainer::ServerLoop`]: create the procedure (untimed), then time one
/// `CALL` of it; at the cap the call is cancelled. Events: the fresh rows
/// it published.
async fn drain_server_side(cfg: &Config, job: &Job) -> BenchResult<DrainOutcome> {
    let client = connect(cfg).await?;
    client.batch_execute(SERVER_LOOP_PROCEDURE).await?;
    let before = util::fresh_unpublished(&client).await?;
    let started = Instant::now();
    let call = client.batch_execute("CALL pgo_bench_server_loop(500)");
    let capped = match tokio::time::timeout(Duration::from_secs_f64(job.max_secs), call).await {
        Ok(done) => {
            done?;
            false
        }
        Err(_) => {
            client.cancel_token().cancel_query(pg_outbox::tokio_postgres::NoTls).await?;
            true
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let after = util::fresh_unpublished(&connect(cfg).await?).await?;
    Ok(DrainOutcome {
        events: u64::try_from(before - after)?,
        seconds,
        capped,
        vm_hwm_kib: None,
        machine_busy_s: None,
        machine_wall_s: None,
    })
}

/// Run `job` in a child process on the database `cfg`.
pub async fn drain_in_child(cfg: &Config, job: &Job) -> BenchResult<DrainOutcome> {
    drain_in_child_bounded(cfg, job, None).await
}

/// [`drain_in_child`] with the Consumer's or the relay's byte bound
/// (`max_buffered_bytes`, `--max-buffered-bytes`; `None`: the default).
async fn drain_in_child_bounded(cfg: &Config, job: &Job, bound: Option<usize>) -> BenchResult<DrainOutcome> {
    if job.drainer == Drainer::Relay {
        return drain_with_relay(cfg, job, bound).await;
    }
    let exe = std::env::current_exe()?;
    let out = tokio::process::Command::new(exe)
        .arg(CHILD_ARG)
        .env(ENV_URL, conninfo(cfg))
        .env(ENV_JOB, serde_json::to_string(job)?)
        .env(ENV_MAX_BYTES, bound.map(|b| b.to_string()).unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await?;
    if !out.status.success() {
        return Err(format!("drain child ({}) failed: {}", job.drainer.name(), out.status).into());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().ok_or("drain child printed no result")?;
    Ok(serde_json::from_str(line).map_err(|e| format!("drain child printed {line:?}: {e}"))?)
}

/// The relay process drains; done when no due row is left (polled every
/// 100 ms); its peak RSS is read just before it is stopped (killed, when
/// the time cap stopped the measurement).
async fn drain_with_relay(cfg: &Config, job: &Job, bound: Option<usize>) -> BenchResult<DrainOutcome> {
    let probe = connect(cfg).await?;
    let bound = bound.map(|b| b.to_string());
    let args: Vec<&str> = match &bound {
        Some(b) => vec!["--max-buffered-bytes", b],
        None => Vec::new(),
    };
    let mut relay = start_relay(&conninfo(cfg), &args, false).await?;
    let started = relay.spawned;
    let deadline = started + Duration::from_secs_f64(job.max_secs);
    let mut capped = false;
    while any_due(&probe).await? {
        relay.check_running().await?;
        if Instant::now() >= deadline {
            capped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let hwm = relay.pid().and_then(vm_hwm_kib);
    if capped {
        // It may be stuck in a statement, which a graceful stop would wait
        // for; the measurement is over.
        relay.kill().await?;
    } else {
        stop_relay(relay).await?;
    }
    let events = if capped {
        let left: i64 = util::fresh_unpublished(&probe).await?;
        job.limit.saturating_sub(u64::try_from(left)?)
    } else {
        job.limit
    };
    Ok(DrainOutcome { events, seconds, capped, vm_hwm_kib: hwm, machine_busy_s: None, machine_wall_s: None })
}

/// The state of `events.outbox` a drainer meets. Each is built for real,
/// with autovacuum off on the table, in a template database; every drainer
/// drains a copy of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableState {
    /// A steady state (as many published rows as the backlog) vacuumed and
    /// analysed, then the backlog inserted after it, with no ANALYZE since:
    /// the table as an outage leaves it (the headline).
    Stale,
    /// The backlog inserted right after `migrate`: never analysed or vacuumed.
    NeverAnalyzed,
    /// The backlog alone, then `VACUUM ANALYZE` and `CHECKPOINT`.
    Settled,
}

impl TableState {
    /// Every state, in the order the report shows them (the headline first).
    pub const ALL: [TableState; 3] = [TableState::Stale, TableState::NeverAnalyzed, TableState::Settled];

    /// Name used in the table and in the JSON report.
    pub fn name(self) -> &'static str {
        match self {
            TableState::Stale => "stale statistics",
            TableState::NeverAnalyzed => "never analyzed",
            TableState::Settled => "settled",
        }
    }

    /// Whether the seed poller runs in this state: only in the settled one,
    /// where the scenario has always measured it. It commits once per event,
    /// so a run of it costs about as much as the state's other drainers
    /// together, and in a full run two more states would add minutes.
    fn runs_seed(self) -> bool {
        self == TableState::Settled
    }
}

/// What the planner knows of `events.outbox` in a database, read from the
/// catalogs (`pg_class`, `pg_stats`), which `CREATE DATABASE ... TEMPLATE`
/// copies with the files.
#[derive(Debug, Clone, Serialize)]
pub struct TableSnapshot {
    /// `pg_class.reltuples`: rows at the last VACUUM/ANALYZE (-1: never, PostgreSQL 14+).
    pub reltuples: f64,
    /// `pg_class.relpages`: pages at the last VACUUM/ANALYZE.
    pub relpages: i64,
    /// Pages the table has now.
    pub pages: i64,
    /// Columns of the table with statistics in `pg_stats`.
    pub analyzed_columns: i64,
    /// `pg_stats.null_frac` of `published_at` (the share of unpublished rows
    /// the planner believes in), if analysed.
    pub published_at_null_frac: Option<f64>,
    /// Autovacuum is off on the table (`autovacuum_enabled = false`).
    pub autovacuum_off: bool,
}

/// Read [`TableSnapshot`] of `events.outbox` (catalogs only: the table's
/// pages are not read, so the copy stays as it was made).
async fn snapshot(client: &Client) -> BenchResult<TableSnapshot> {
    let row = client
        .query_one(
            "SELECT c.reltuples::float8, c.relpages::bigint, \
                    (pg_relation_size(c.oid) / current_setting('block_size')::bigint)::bigint, \
                    (SELECT count(*) FROM pg_stats s WHERE s.schemaname = 'events' AND s.tablename = 'outbox'), \
                    (SELECT s.null_frac::float8 FROM pg_stats s \
                      WHERE s.schemaname = 'events' AND s.tablename = 'outbox' AND s.attname = 'published_at'), \
                    coalesce(c.reloptions, '{}') @> ARRAY['autovacuum_enabled=false'] \
             FROM pg_class c WHERE c.oid = 'events.outbox'::regclass",
            &[],
        )
        .await?;
    Ok(TableSnapshot {
        reltuples: row.try_get(0)?,
        relpages: row.try_get(1)?,
        pages: row.try_get(2)?,
        analyzed_columns: row.try_get(3)?,
        published_at_null_frac: row.try_get(4)?,
        autovacuum_off: row.try_get(5)?,
    })
}

/// Fail unless `snap` is what `state` means: a copy that lost the state (or
/// a server that analysed the table behind the bench's back) would measure
/// something else under the state's name.
fn check_state(state: TableState, snap: &TableSnapshot) -> BenchResult<()> {
    let holds = snap.autovacuum_off
        && match state {
            // No statistics at all.
            TableState::NeverAnalyzed => snap.analyzed_columns == 0,
            // Statistics from before the backlog: they saw no unpublished
            // row, and the table has grown since.
            TableState::Stale => snap.published_at_null_frac.is_some_and(|f| f < 0.01) && snap.pages > snap.relpages,
            // Statistics of the backlog itself: every row unpublished.
            TableState::Settled => snap.published_at_null_frac.is_some_and(|f| f > 0.99),
        };
    if holds {
        Ok(())
    } else {
        Err(format!("the copy of the `{}` backlog does not hold that state: {snap:?}", state.name()).into())
    }
}

/// Build `state` with a backlog of `n` events in the template database
/// `cfg` (not timed).
async fn load(cfg: &Config, n: i64, state: TableState) -> BenchResult<()> {
    let started = Instant::now();
    let client = connect(cfg).await?;
    client.batch_execute("ALTER TABLE events.outbox SET (autovacuum_enabled = false)").await?;
    match state {
        TableState::Stale => {
            util::load_rows(&client, RowKind::Published, n, 10_000, "agg").await?;
            client.batch_execute("VACUUM ANALYZE events.outbox").await?;
            util::load_rows(&client, RowKind::Fresh, n, 10_000, "agg").await?;
        }
        TableState::NeverAnalyzed => util::load_rows(&client, RowKind::Fresh, n, 10_000, "agg").await?,
        TableState::Settled => {
            util::load_rows(&client, RowKind::Fresh, n, 10_000, "agg").await?;
            util::settle(&client).await?;
        }
    }
    eprintln!(
        "e2e: drain: {}: loaded {} events in {:.1} s",
        state.name(),
        fmt_count(n as f64),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Templates smaller than this are copied block by block through the WAL
/// (`STRATEGY WAL_LOG`, PostgreSQL 15's default), larger ones as files.
const SMALL_TEMPLATE_BYTES: i64 = 32 << 20;

/// Create `name` as a copy of `template`, retrying while the template's last
/// sessions close. On PostgreSQL 15+ a small template (the smoke pass's) is
/// copied with `STRATEGY WAL_LOG`, which needs no checkpoint, and a large
/// one with `STRATEGY FILE_COPY`, which checkpoints before and after
/// copying (the faster for large templates, PostgreSQL docs, CREATE
/// DATABASE). Either copies every page, the catalogs' included.
async fn copy_database(admin: &Client, template: &str, name: &str) -> BenchResult<()> {
    let started = Instant::now();
    let size: i64 = admin.query_one("SELECT pg_database_size($1::text)", &[&template]).await?.try_get(0)?;
    let strategy = if size < SMALL_TEMPLATE_BYTES { "WAL_LOG" } else { "FILE_COPY" };
    let mut attempt = 0;
    loop {
        let copied =
            match admin.batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template} STRATEGY {strategy}")).await
            {
                // Before PostgreSQL 15 there is no STRATEGY (and file copy is the only one).
                Err(e) if e.code() == Some(&pg_outbox::tokio_postgres::error::SqlState::SYNTAX_ERROR) => {
                    admin.batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template}")).await
                }
                other => other,
            };
        match copied {
            Ok(()) => break,
            Err(e) if e.code() == Some(&pg_outbox::tokio_postgres::error::SqlState::OBJECT_IN_USE) && attempt < 50 => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    eprintln!(
        "e2e: drain: copied the backlog database ({} MiB) in {:.1} s",
        size >> 20,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One drainer's run in one table state.
struct Run {
    state: TableState,
    drainer: Drainer,
    limit: u64,
    table: TableSnapshot,
    outcome: DrainOutcome,
}

/// Run all drainers in every table state, each on its own copy of the
/// state's backlog.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let mut runs = Vec::new();
    for state in TableState::ALL {
        let template = scratch(&ctx.admin, &ctx.admin_cfg, "drain_tmpl").await?;
        let result = run_state(ctx, state, &template.name, &template.cfg, s).await;
        template.drop_now(&ctx.admin).await;
        runs.extend(result?);
    }
    let large = run_large(ctx, s).await?;
    Ok(report(s, &runs, &large))
}

/// Events of the 1 MiB-payload backlog: 2 000 (2 GiB of payloads), 300 in
/// a quick run, 8 in the smoke pass (which only checks that it runs).
fn large_events(s: &Settings) -> i64 {
    if s.smoke {
        8
    } else if s.quick {
        300
    } else {
        2_000
    }
}

/// Characters of each large payload's string: 1 MiB. With the keys around
/// it the payload is just over 1 MiB, as a producer's payload at the
/// publisher's limit ([`pg_outbox::Publisher::DEFAULT_MAX_PAYLOAD_BYTES`]) is just under.
const LARGE_PAYLOAD_CHARS: usize = 1 << 20;

/// A byte bound high enough never to bind: the behaviour before the bound
/// existed (rows alone: a batch of 500, the stream buffering twice that).
const NO_BYTE_BOUND: usize = 1 << 40;

/// One drain of the 1 MiB-payload backlog.
struct LargeRun {
    drainer: Drainer,
    /// `None`: the default bound.
    bound: Option<usize>,
    outcome: DrainOutcome,
}

impl LargeRun {
    fn bound_name(&self) -> String {
        match self.bound {
            None => format!("default bound ({} MiB)", pg_outbox::ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES >> 20),
            Some(_) => "no byte bound".into(),
        }
    }
}

/// Load [`large_events`] events of 1 MiB payloads once (not timed), then
/// drain them with the Consumer (batch 500) and the relay, each with the
/// default byte bound and with [`NO_BYTE_BOUND`]; between drains every
/// event is made unpublished again (payloads untouched, so the TOAST data
/// is not rewritten: cheaper than a copy of a 2 GiB database).
async fn run_large(ctx: &Ctx, s: &Settings) -> BenchResult<Vec<LargeRun>> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "drain_large").await?;
    let result = async {
        let n = large_events(s);
        let client = connect(&db.cfg).await?;
        let started = Instant::now();
        // The body: md5 hex of a counter, 32 characters at a time, which
        // PostgreSQL's pglz does not compress, so each payload is stored
        // out of line at its full size (built once, shared by every row).
        client
            .batch_execute(&format!(
                "ALTER TABLE events.outbox SET (autovacuum_enabled = false, toast.autovacuum_enabled = false); \
                 SET session_replication_role = replica; \
                 INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'document', md5('doc-' || g)::uuid, 'DocumentStored', \
                        jsonb_build_object('version', 1, 'data', jsonb_build_object('seq', g, 'body', b.body)) \
                 FROM generate_series(1, {n}::bigint) AS g, \
                      (SELECT string_agg(md5(k::text), '') AS body FROM generate_series(1, {chunks}) k) b; \
                 RESET session_replication_role;",
                chunks = LARGE_PAYLOAD_CHARS / 32
            ))
            .await?;
        client.batch_execute("VACUUM ANALYZE events.outbox").await?;
        eprintln!("e2e: drain: loaded {n} events of 1 MiB payloads in {:.1} s", started.elapsed().as_secs_f64());
        let mut runs = Vec::new();
        for (drainer, bound) in [
            (Drainer::Consumer(500), None),
            (Drainer::Consumer(500), Some(NO_BYTE_BOUND)),
            (Drainer::Relay, None),
            (Drainer::Relay, Some(NO_BYTE_BOUND)),
        ] {
            client
                .batch_execute(
                    "SET session_replication_role = replica; \
                     UPDATE events.outbox SET published_at = NULL WHERE published_at IS NOT NULL; \
                     RESET session_replication_role;",
                )
                .await?;
            // On its own: VACUUM cannot run in the implicit transaction of
            // a multi-statement query.
            client.batch_execute("VACUUM events.outbox").await?;
            let job = Job { drainer, limit: u64::try_from(n)?, max_secs: s.drain_max_secs };
            let outcome = drain_in_child_bounded(&db.cfg, &job, bound).await?;
            let run = LargeRun { drainer, bound, outcome };
            eprintln!(
                "e2e: drain: 1 MiB payloads {:<28} {:<28} {} events in {:.1} s = {} events/s, peak RSS {} KiB{}",
                drainer.name(),
                run.bound_name(),
                run.outcome.events,
                run.outcome.seconds,
                fmt_count(run.outcome.rate()),
                run.outcome.vm_hwm_kib.map(|k| k.to_string()).unwrap_or_else(|| "?".into()),
                if run.outcome.capped { " (capped)" } else { "" }
            );
            runs.push(run);
        }
        Ok::<_, BoxError>(runs)
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// Build `state` in `template`, then run every drainer on a copy of it.
async fn run_state(
    ctx: &Ctx,
    state: TableState,
    template: &str,
    template_cfg: &Config,
    s: &Settings,
) -> BenchResult<Vec<Run>> {
    let n = s.drain_events;
    let prefix = s.drain_baseline_prefix.min(n);
    load(template_cfg, n, state).await?;
    let mut jobs = Vec::new();
    if state.runs_seed() {
        jobs.push((Drainer::Seed, prefix));
    }
    jobs.extend([
        (Drainer::ServerLoop, n),
        (Drainer::Plain, n),
        (Drainer::Consumer(50), n),
        (Drainer::Consumer(500), n),
        (Drainer::Relay, n),
    ]);
    let mut runs = Vec::new();
    for (drainer, limit) in jobs {
        let name = format!("pgo_e2e_{}_drain", std::process::id());
        drop_database(&ctx.admin, &name).await;
        copy_database(&ctx.admin, template, &name).await?;
        let mut cfg = ctx.admin_cfg.clone();
        cfg.dbname(&name);
        let job = Job { drainer, limit: u64::try_from(limit)?, max_secs: s.drain_max_secs };
        let outcome = async {
            // The copy holds the template's planner statistics:
            // `CREATE DATABASE ... TEMPLATE` copies the files, pg_class
            // (reltuples, relpages, reloptions) and pg_statistic included, so
            // the copy plans as the template would (checked on PostgreSQL 15:
            // same reltuples, relpages, pg_stats null_frac and plans). Only
            // the cumulative activity counters of pg_stat_user_tables
            // (n_live_tup, n_mod_since_analyze, last_analyze, ...) start from
            // zero in a new database; they drive autovacuum alone (off here)
            // and the planner never reads them.
            let table = {
                let client = connect(&cfg).await?;
                let table = snapshot(&client).await?;
                check_state(state, &table)?;
                table
            };
            let (cpu_before, wall) = (util::machine_cpu_s(), Instant::now());
            let mut outcome = drain_in_child(&cfg, &job).await?;
            outcome.machine_busy_s = cpu_before.zip(util::machine_cpu_s()).map(|((b, _), (a, _))| a - b);
            outcome.machine_wall_s = Some(wall.elapsed().as_secs_f64());
            Ok::<_, BoxError>((table, outcome))
        }
        .await;
        drop_database(&ctx.admin, &name).await;
        let (table, outcome) = outcome?;
        eprintln!(
            "e2e: drain: {:<16} {:<40} {} events in {:.1} s = {} events/s, peak RSS {} KiB, machine CPU {} µs/event \
             ({} cores busy){}",
            state.name(),
            drainer.name(),
            outcome.events,
            outcome.seconds,
            fmt_count(outcome.rate()),
            outcome.vm_hwm_kib.map(|k| k.to_string()).unwrap_or_else(|| "?".into()),
            outcome.cpu_us_per_event().map_or_else(|| "?".into(), |v| format!("{v:.0}")),
            outcome.cores_busy().map_or_else(|| "?".into(), |v| format!("{v:.2}")),
            if outcome.capped { " (capped)" } else { "" }
        );
        runs.push(Run { state, drainer, limit: job.limit, table, outcome });
    }
    Ok(runs)
}

/// The section: one table, grouped by state (the headline first), each
/// ratio against the baseline measured in the same state; then the 1 MiB
/// payloads, each drainer's peak RSS against the same drainer without a
/// byte bound.
fn report(s: &Settings, runs: &[Run], large: &[LargeRun]) -> Section {
    let n = s.drain_events;
    let prefix = s.drain_baseline_prefix.min(n);
    let rate_of = |state: TableState, d: Drainer| {
        runs.iter().find(|r| r.state == state && r.drainer == d).map(|r| r.outcome.rate()).unwrap_or(0.0)
    };
    let mut sec = Section::new(
        "drain",
        &format!(
            "Drain throughput: backlog of {} events (~1.5 KB JSON each), by table state (stale statistics first); \
             peak RSS with {} events of 1 MiB payloads",
            fmt_count(n as f64),
            fmt_count(large_events(s) as f64)
        ),
        &[
            "table state",
            "drainer",
            "events",
            "seconds",
            "events/s",
            "vs plain-SQL loop (same state)",
            "vs server-side loop (same state)",
            "vs seed poller",
            "machine CPU µs/event",
            "cores busy",
            "peak RSS MiB",
            "peak RSS vs no byte bound",
        ],
    );
    let mut data = Vec::new();
    for state in TableState::ALL {
        let (seed, plain, server) =
            (rate_of(state, Drainer::Seed), rate_of(state, Drainer::Plain), rate_of(state, Drainer::ServerLoop));
        for r in runs.iter().filter(|r| r.state == state) {
            let o = &r.outcome;
            let mut name = r.drainer.name();
            if o.capped {
                name.push_str(" (capped)");
            }
            sec.rows.push(vec![
                state.name().into(),
                name,
                fmt_count(o.events as f64),
                format!("{:.1}", o.seconds),
                fmt_count(o.rate()),
                fmt_ratio(ratio(o.rate(), plain)),
                fmt_ratio(ratio(o.rate(), server)),
                fmt_ratio(ratio(o.rate(), seed)),
                o.cpu_us_per_event().map_or_else(|| "?".into(), |v| format!("{v:.0}")),
                o.cores_busy().map_or_else(|| "?".into(), |v| format!("{v:.2}")),
                o.vm_hwm_kib.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "?".into()),
                "n/a".into(),
            ]);
            match r.drainer {
                Drainer::Consumer(b) => {
                    // 1.0x: the floor's first goal; 1.3x for batch 500: issue 30's.
                    let goal = if b >= 500 { 1.3 } else { 1.0 };
                    sec.target(
                        format!("Consumer (batch {b}) >= {goal:.1}x the plain-SQL loop, {}", state.name()),
                        ratio(o.rate(), plain),
                        goal,
                        false,
                    );
                }
                Drainer::Relay => sec.target(
                    format!("relay >= 0.8x the server-side loop, {}", state.name()),
                    ratio(o.rate(), server),
                    0.8,
                    false,
                ),
                _ => {}
            }
            data.push(serde_json::json!({
                "state": state.name(), "drainer": r.drainer.name(), "limit": r.limit, "events": o.events,
                "seconds": o.seconds, "events_per_second": o.rate(), "capped": o.capped,
                "vm_hwm_kib": o.vm_hwm_kib, "ratio_vs_plain": ratio(o.rate(), plain),
                "ratio_vs_server_loop": ratio(o.rate(), server), "machine_busy_s": o.machine_busy_s,
                "machine_cpu_us_per_event": o.cpu_us_per_event(),
                "ratio_vs_seed": ratio(o.rate(), seed), "table": r.table,
            }));
        }
    }
    let mut large_data = Vec::new();
    for r in large {
        let o = &r.outcome;
        let unbounded = large
            .iter()
            .find(|u| u.drainer == r.drainer && u.bound == Some(NO_BYTE_BOUND))
            .and_then(|u| u.outcome.vm_hwm_kib);
        let rss_ratio = o.vm_hwm_kib.zip(unbounded).and_then(|(k, u)| ratio(k as f64, u as f64));
        let mut name = format!("{}, {}", r.drainer.name(), r.bound_name());
        if o.capped {
            name.push_str(" (capped)");
        }
        sec.rows.push(vec![
            "1 MiB payloads".into(),
            name,
            fmt_count(o.events as f64),
            format!("{:.1}", o.seconds),
            fmt_count(o.rate()),
            "n/a".into(),
            "n/a".into(),
            "n/a".into(),
            "n/a".into(),
            "n/a".into(),
            o.vm_hwm_kib.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "?".into()),
            fmt_ratio(rss_ratio),
        ]);
        large_data.push(serde_json::json!({
            "drainer": r.drainer.name(), "max_buffered_bytes": r.bound, "events": o.events, "seconds": o.seconds,
            "events_per_second": o.rate(), "capped": o.capped, "vm_hwm_kib": o.vm_hwm_kib,
            "vm_hwm_ratio_vs_no_byte_bound": rss_ratio,
        }));
    }
    sec.notes.push(format!(
        "1 MiB payloads: {} events whose payloads are 1 MiB of text each (stored out of line, uncompressed), \
         settled, drained by the Consumer (batch 500) and the relay, each once with the default byte bound \
         (`max_buffered_bytes`, `--max-buffered-bytes`: {} MiB) and once with a bound of 1 TiB, which never \
         binds: the behaviour before the bound, rows alone (a fetch of 500, the stream buffering 1 000). The \
         ratio is the peak RSS against the same drainer's without the bound, in the same run.",
        fmt_count(large_events(s) as f64),
        pg_outbox::ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES >> 20
    ));
    sec.notes.push(format!(
        "Table states, each built for real with autovacuum off on the table: *stale statistics* (the headline: \
         {n} published rows, VACUUM ANALYZE, then the {n}-event backlog inserted, no ANALYZE since: the table as \
         an outage leaves it, its statistics saying no row is unpublished); *never analyzed* (the backlog inserted \
         right after `migrate`, no VACUUM or ANALYZE); *settled* (the backlog, then VACUUM ANALYZE and CHECKPOINT). \
         Each copy's catalogs are checked to hold its state before the drainer starts.",
        n = fmt_count(n as f64)
    ));
    let seed_states: Vec<&str> = TableState::ALL.iter().filter(|t| t.runs_seed()).map(|t| t.name()).collect();
    sec.notes.push(format!(
        "The seed poller runs only in the {} state: it commits once per event, so each run of it costs about \
         as much as the state's other drainers together, and two more states would add minutes to a full run; \
         elsewhere its column is n/a.{}",
        seed_states.join(", "),
        if prefix < n {
            format!(
                " It drains only the first {} events of the same {}-event backlog; its rate is over that prefix.",
                fmt_count(prefix as f64),
                fmt_count(n as f64)
            )
        } else {
            String::new()
        }
    ));
    sec.notes.push(
        "Baselines in the same run and the same state: the seed's poller as written, a plain-SQL batched loop \
         (the seed's query, 500 rows, one UPDATE; what a user would write), and the server-side loop (a \
         procedure marking the rows published 500 per transaction, `UPDATE ... WHERE id IN (SELECT ... ORDER BY \
         id LIMIT 500)`, one CALL: no row leaves the server, so it is the floor of the server's own work per \
         event; it needs one core, where a client's drain spreads over the server's sessions and the client \
         process). Machine CPU: the whole machine's busy time from /proc/stat during the drain, over the events \
         (the drainer, the server, and anything else running); cores busy: that time over the wall-clock \
         time it was read over (the drainer process's start and exit included). \
         Every client drainer decodes every column \
         (payload JSON included) and runs as its own process; each state's backlog is loaded once \
         (INSERT ... SELECT generate_series, triggers' effect restored) in a template database, and each drainer \
         gets a fresh copy of it (CREATE DATABASE ... TEMPLATE, which keeps pg_class and pg_statistic), untimed. \
         Time runs from the drainer's start until the table shows no due row."
            .into(),
    );
    sec.notes.push(format!(
        "A drainer marked (capped) was stopped by the time cap ({:.0} s per drainer and state); its rate is over \
         the events it drained by then.",
        s.drain_max_secs
    ));
    sec.notes.push(
        "Peak RSS is the drainer process's VmHWM from /proc (for the relay, read once the backlog is drained or at \
         the cap)."
            .into(),
    );
    sec.data = serde_json::json!({ "states": data, "large_payloads": large_data });
    sec
}

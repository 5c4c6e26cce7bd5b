//! The end-to-end benchmark suite: `cargo bench --features full --bench e2e`
//! (`cargo bench --features full` runs it too).
//!
//! Scenarios (select some by name: `cargo bench --features full --bench e2e -- latency drain`):
//! - `latency`: commit-to-delivery latency of the `EventStream` and of a
//!   `pg-outbox relay --sink stdout` process at paced rates, against the raw
//!   floor (a bare LISTEN client) at the same rates;
//! - `drain`: drain throughput and peak RSS on a pre-loaded backlog, against
//!   the seed's poller and a plain-SQL batched loop, in three table states:
//!   stale statistics (analysed before the backlog formed, as an outage
//!   leaves it), never analysed, and settled (vacuumed and analysed);
//! - `keepup`: producers at full speed with the relay draining: lag;
//! - `producers`: insert rate with pg-outbox's triggers against without;
//! - `heads`: drain and latency with 100 000 dead letters and 100 000
//!   retry-waiting rows at the head of the id range, against an empty head;
//! - `history`: how cost grows with the table: the consumer's fetch
//!   (buffers), producers (inserts/s) and the relay (drain rate) with 0,
//!   1 000 000 and 10 000 000 published rows (30 days of history committed
//!   by producers and published by a relay, statistics from the first size,
//!   never vacuumed by the bench),
//!   against the empty table; then `pg-outbox archive` deleting the oldest
//!   tenth while producers insert at full load: their p99 insert latency
//!   against the same producers just before and just after it, and the
//!   archive's rows/s;
//! - `hot`: a 1 000 000-event backlog over 1 000 aggregates, with and
//!   without 5 failing aggregates holding back their events, drained by the
//!   Consumer, against every event its own aggregate (checks that exactly
//!   the failing aggregates' events are left);
//! - `pipeline`: a relay into a webhook that answers after 0, 1, 5 and
//!   20 ms, with 64 deliveries in flight and with one at a time, against a
//!   plain async client with 64 in flight on the same server; and with
//!   1, 4 and 16 aggregates at 5 ms;
//! - `subscriptions`: a backlog (the `hot` scenario's size) drained by a
//!   Consumer of a named subscription, against one of the default
//!   subscription and against a plain `UPDATE ... RETURNING` loop, with
//!   WAL bytes and dead tuples per event; commit-to-delivery p50 and p99 at
//!   100 and 1 000 events/s of each subscription's Consumer; then four named
//!   subscriptions draining a quarter of that backlog at once against one
//!   alone, producers' insert rate with four draining live against one, and
//!   one subscription's p50 and p99 at 100 events/s while another's Consumer
//!   fails every event, against while it acknowledges;
//! - `sinks` (only when named): a relay into NATS JetStream, Redis,
//!   RabbitMQ and Kafka (a tansu the scenario starts) through a proxy in
//!   this process that adds a round trip of 0, 1, 5 and 20 ms, with 64
//!   deliveries in flight (and one at a time at 5 ms), against a plain
//!   async client of each broker with 64 in flight through the same proxy;
//!   and the relay into stdout, the floor. The smoke pass skips a broker
//!   that is not there; a real run fails on it
//!   (`PG_OUTBOX_BENCH_SINKS=nats,redis` and `PG_OUTBOX_BENCH_ROUND_TRIPS=0,5`
//!   pick sinks and round trips);
//! - `trigger-split` (only when named): the producers' server CPU per insert
//!   for each step of the trigger's fast path, at 16 connections; and
//!   pg-outbox's triggers with no relay running and with 8 hot aggregates;
//! - `peers` (only when named): graphile-worker (npm, a LISTEN/NOTIFY job
//!   queue) on the same server: a 100 000-job backlog drained by a no-op
//!   task in its default and its documented high-throughput configuration,
//!   beside the relay and the Consumer (batch 500) on as many settled
//!   events; and `add_job` sent -> task started at 100 and 1 000 jobs/s,
//!   beside the EventStream's and the relay's commit-to-delivery. Needs
//!   `node` and `npm` (skipped with a note without them); installs the
//!   pinned graphile-worker with `npm ci` under
//!   `target/pg-outbox-bench/peers/` on its first run;
//! - `wal` (only when named): the WAL source (`pg-outbox relay --source
//!   wal`) on throwaway servers the scenario starts from the local
//!   PostgreSQL binaries (one with `wal_level = logical`, one with
//!   `replica`; the suite's server is not used): producers' insert rate at
//!   4, 16 and 64 connections with no insert trigger and the WAL relay
//!   draining, against no triggers and no relay (references: the same on
//!   `wal_level = replica`, and with a listen relay draining by its
//!   sweep); commit-to-delivery at 100 and 1 000 events/s
//!   against the listen source's relay and the LISTEN floor; a burst
//!   written while the relay runs, drained by each source (and the WAL
//!   written per event); the relay's CPU per event with each source.
//!
//! Every figure is a ratio against a baseline measured in the same run (the
//! machine may be shared and noisy); timings never fail the run, but each
//! issue target is printed as MET or NOT MET.
//!
//! Server: `DATABASE_URL` if set, else 127.0.0.1:5432 or the local socket if
//! one answers, else a throwaway server from the local PostgreSQL binaries
//! (the test kit's `find_server`, as the tests find theirs). Each scenario
//! works in its own databases `pgo_e2e_<pid>_<scenario>`, dropped afterwards
//! (also after a failure).
//!
//! Environment:
//! - `PG_OUTBOX_BENCH_QUICK=1`: small sizes and short runs (about 5 minutes;
//!   `history` grows its table to 1 000 000 rows instead of 10 000 000;
//!   `peers`: 30 000 jobs, 3 s per latency run; `wal`: a 50 000-event
//!   burst, 3 s per latency run, three producer rounds);
//! - `PG_OUTBOX_BENCH_CONNECTIONS=1,4,16`: producer connection counts for
//!   `producers` (default 1,4,16,64; quick 1,4,16), `trigger-split`
//!   (default 16) and `wal` (default 4,16,64), for servers with a low
//!   `max_connections`;
//! - `PG_OUTBOX_BENCH_RATES=1000`: event rates for `latency`, events/s
//!   (default 100,1000,5000);
//! - `PG_OUTBOX_BENCH_CONSUMER_OPTIONS='-c synchronous_commit=off'`: server
//!   settings of the subscriptions' Consumers in the producers' comparison
//!   of `subscriptions` (libpq's `options`; none by default);
//! - `PG_OUTBOX_BENCH_DURABLE_ACKS=1`: the subscriptions' Consumers in the
//!   producers' comparison of `subscriptions` acknowledge durably
//!   (`ConsumerBuilder::durable_acknowledgements`), for the figure without
//!   asynchronous acknowledgements;
//! - `PG_OUTBOX_BENCH_PRODUCER_ROUNDS=5`: rounds of the producers'
//!   comparisons (`producers`, `subscriptions`; default 6, quick 1);
//! - `PG_OUTBOX_BENCH_RELAY_BIN=/path/to/pg-outbox`: the relay binary the
//!   scenarios start, instead of the one cargo built (to compare two builds
//!   on the same machine).
//!
//! Output: the tables on stdout (progress on stderr), and
//! `target/pg-outbox-bench/e2e.md`, `e2e.json` and `latency.png` (with
//! `CARGO_TARGET_DIR`, under it). Under `cargo test --bench e2e` or
//! `cargo test --all-targets` (no `--bench` argument) it runs a tiny smoke
//! pass of every scenario, `trigger-split`, `peers` and `wal` included
//! (`peers` only where `node` and `npm` are, then with 1 000 jobs and 1 s
//! per latency run; `wal` needs the local PostgreSQL binaries, 14 or
//! later), and writes no report files (`peers` still installs
//! graphile-worker under `target/pg-outbox-bench/peers/`); `.ci/run` runs
//! it, so a scenario that no longer runs fails CI (timings never do).

mod chart;
mod drain;
mod heads;
mod history;
mod hot;
mod keepup;
mod latency;
mod peers;
mod pinning;
mod pipeline;
mod producers;
mod report;
mod sinks;
mod subscriptions;
mod subscriptions_many;
mod util;
mod wal;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use pg_outbox::tokio_postgres::{Client, Config};
use serde::Serialize;

use pg_outbox_testkit::bench::{self, BenchResult};
use pg_outbox_testkit::db::drop_database;
use pg_outbox_testkit::{connect, find_server};
use report::Section;

/// Scenario names, in the order they run.
pub const SCENARIOS: [&str; 9] =
    ["latency", "drain", "keepup", "producers", "heads", "history", "hot", "pipeline", "subscriptions"];
/// Scenarios that run only when named, after the others.
pub const EXTRA_SCENARIOS: [&str; 4] = ["trigger-split", "peers", "wal", "sinks"];

/// Sizes and durations of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    /// `PG_OUTBOX_BENCH_QUICK=1`.
    pub quick: bool,
    /// Not run by `cargo bench` (no `--bench` argument): tiny, no files.
    pub smoke: bool,
    /// Scenarios to run.
    pub scenarios: Vec<&'static str>,
    /// Latency: total rates, events/s.
    pub latency_rates: Vec<u64>,
    /// Latency: seconds of sending per run.
    pub latency_secs: f64,
    /// Drain: backlog size (in every table state).
    pub drain_events: i64,
    /// Drain: events the seed poller drains (a prefix of the backlog).
    pub drain_baseline_prefix: i64,
    /// Drain: time cap per drainer and table state, seconds.
    pub drain_max_secs: f64,
    /// Keep-up: seconds of producing.
    pub keepup_secs: f64,
    /// Producer cost: connection counts.
    pub producer_connections: Vec<usize>,
    /// Producer cost: seconds per run, counted after the warm-up.
    pub producer_secs: f64,
    /// Producer cost: seconds of inserting before counting starts, so both
    /// variants' relays are draining (the baseline's finds events only at
    /// its first sweep, after about a second).
    pub producer_warmup_secs: f64,
    /// Producer cost: rounds per connection count, each a run of both
    /// variants back to back (alternating which goes first); the ratio is
    /// the median of the rounds' ratios.
    pub producer_rounds: usize,
    /// Trigger split: connection counts.
    pub split_connections: Vec<usize>,
    /// Trigger split: rounds per connection count, each a run of every step.
    pub split_rounds: usize,
    /// Heads: dead letters, and as many retry-waiting rows.
    pub heads_rows: i64,
    /// Heads: fresh events after the head.
    pub heads_fresh: i64,
    /// Heads: seconds of the latency probe.
    pub heads_probe_secs: f64,
    /// Peers: backlog size, jobs for graphile-worker and events for
    /// pg-outbox (each drainer is capped at `drain_max_secs`).
    pub peers_jobs: i64,
    /// Peers: latency rates, jobs or events/s.
    pub peers_rates: Vec<u64>,
    /// Peers: seconds of sending per latency run.
    pub peers_latency_secs: f64,
    /// History: published rows in the table at each step (the largest is
    /// 30 days of history; the archive runs on it).
    pub history_sizes: Vec<i64>,
    /// History: events of the backlog the relay drains at each size.
    pub history_backlog: i64,
    /// History: seconds the producers' insert rate is counted (after
    /// `producer_warmup_secs`), per size.
    pub history_producer_secs: f64,
    /// History: seconds of each of the producers' two baseline windows
    /// around the archive, one just before it and one just after.
    pub history_baseline_secs: f64,
    /// Hot: events in each backlog (a multiple of `hot_aggregates`).
    pub hot_events: i64,
    /// Hot: aggregates of the hot backlogs.
    pub hot_aggregates: i64,
    /// Hot: aggregates whose events the consumer fails.
    pub hot_failing: i64,
    /// WAL source: producer connection counts.
    pub wal_connections: Vec<usize>,
    /// WAL source: producer rounds per connection count, each a run of
    /// every variant back to back (`producer_warmup_secs` and
    /// `producer_secs` each).
    pub wal_producer_rounds: usize,
    /// WAL source: latency rates, events/s.
    pub wal_rates: Vec<u64>,
    /// WAL source: seconds of sending per latency run.
    pub wal_latency_secs: f64,
    /// WAL source: events of the burst each source drains (capped at
    /// `drain_max_secs`).
    pub wal_burst: i64,
}

impl Settings {
    /// From the command line (scenario names) and the environment.
    fn from_env() -> BenchResult<Settings> {
        let smoke = !bench::is_bench_run();
        let quick = match std::env::var("PG_OUTBOX_BENCH_QUICK") {
            Ok(v) if v == "1" || v.eq_ignore_ascii_case("true") => true,
            Ok(v) if v.is_empty() || v == "0" || v.eq_ignore_ascii_case("false") => false,
            Ok(v) => return Err(format!("PG_OUTBOX_BENCH_QUICK={v:?}: expected 1 or 0").into()),
            Err(_) => false,
        };
        let mut scenarios = Vec::new();
        for arg in std::env::args().skip(1).filter(|a| !a.starts_with('-')) {
            let name = SCENARIOS.iter().chain(&EXTRA_SCENARIOS).find(|s| **s == arg).ok_or_else(|| {
                format!(
                    "unknown scenario `{arg}`; expected one or more of: {}",
                    SCENARIOS.iter().chain(&EXTRA_SCENARIOS).copied().collect::<Vec<_>>().join(", ")
                )
            })?;
            if !scenarios.contains(name) {
                scenarios.push(*name);
            }
        }
        if scenarios.is_empty() {
            scenarios = SCENARIOS.to_vec();
            if smoke {
                // The smoke pass checks that every scenario still runs.
                scenarios.extend(EXTRA_SCENARIOS);
            }
        } else {
            scenarios.sort_by_key(|s| SCENARIOS.iter().chain(&EXTRA_SCENARIOS).position(|x| x == s));
        }
        let mut s = if smoke {
            Settings {
                quick,
                smoke,
                scenarios,
                latency_rates: vec![100],
                latency_secs: 0.5,
                drain_events: 1_000,
                drain_baseline_prefix: 1_000,
                drain_max_secs: 30.0,
                keepup_secs: 1.0,
                producer_connections: vec![1],
                producer_secs: 0.5,
                producer_warmup_secs: 0.25,
                producer_rounds: 1,
                split_connections: vec![1],
                split_rounds: 1,
                heads_rows: 1_000,
                heads_fresh: 1_000,
                heads_probe_secs: 0.5,
                peers_jobs: 1_000,
                peers_rates: vec![100],
                peers_latency_secs: 1.0,
                history_sizes: vec![0, 1_000, 5_000],
                history_backlog: 1_000,
                history_producer_secs: 0.5,
                history_baseline_secs: 1.0,
                hot_events: 5_000,
                hot_aggregates: 50,
                hot_failing: 2,
                wal_connections: vec![1],
                wal_producer_rounds: 1,
                wal_rates: vec![100],
                wal_latency_secs: 0.5,
                wal_burst: 2_000,
            }
        } else if quick {
            Settings {
                quick,
                smoke,
                scenarios,
                latency_rates: vec![100, 1_000, 5_000],
                latency_secs: 2.0,
                drain_events: 30_000,
                drain_baseline_prefix: 10_000,
                drain_max_secs: 60.0,
                keepup_secs: 6.0,
                producer_connections: vec![1, 4, 16],
                producer_secs: 1.5,
                producer_warmup_secs: 1.5,
                producer_rounds: 1,
                split_connections: vec![16],
                split_rounds: 1,
                heads_rows: 20_000,
                heads_fresh: 20_000,
                heads_probe_secs: 2.0,
                peers_jobs: 30_000,
                peers_rates: vec![100, 1_000],
                peers_latency_secs: 3.0,
                history_sizes: vec![0, 100_000, 1_000_000],
                history_backlog: 20_000,
                history_producer_secs: 2.5,
                history_baseline_secs: 15.0,
                hot_events: 100_000,
                hot_aggregates: 1_000,
                hot_failing: 5,
                wal_connections: vec![4, 16, 64],
                wal_producer_rounds: 3,
                wal_rates: vec![100, 1_000],
                wal_latency_secs: 3.0,
                wal_burst: 50_000,
            }
        } else {
            Settings {
                quick,
                smoke,
                scenarios,
                latency_rates: vec![100, 1_000, 5_000],
                latency_secs: 10.0,
                drain_events: 1_000_000,
                drain_baseline_prefix: 100_000,
                drain_max_secs: 300.0,
                keepup_secs: 30.0,
                producer_connections: vec![1, 4, 16, 64],
                producer_secs: 2.5,
                producer_warmup_secs: 1.5,
                producer_rounds: 6,
                split_connections: vec![16],
                split_rounds: 3,
                heads_rows: 100_000,
                heads_fresh: 100_000,
                heads_probe_secs: 5.0,
                peers_jobs: 100_000,
                peers_rates: vec![100, 1_000],
                peers_latency_secs: 10.0,
                history_sizes: vec![0, 1_000_000, 10_000_000],
                history_backlog: 100_000,
                history_producer_secs: 4.0,
                history_baseline_secs: 30.0,
                hot_events: 1_000_000,
                hot_aggregates: 1_000,
                hot_failing: 5,
                wal_connections: vec![4, 16, 64],
                wal_producer_rounds: 6,
                wal_rates: vec![100, 1_000],
                wal_latency_secs: 10.0,
                wal_burst: 1_000_000,
            }
        };
        if let Some(v) = env_list::<usize>("PG_OUTBOX_BENCH_CONNECTIONS", "1,4,16")? {
            s.split_connections = v.clone();
            s.wal_connections = v.clone();
            s.producer_connections = v;
        }
        if let Some(v) = env_list::<u64>("PG_OUTBOX_BENCH_RATES", "100,1000")? {
            s.latency_rates = v;
        }
        if let Some(v) = env_list::<usize>("PG_OUTBOX_BENCH_PRODUCER_ROUNDS", "5")? {
            s.producer_rounds = v.iter().copied().max().unwrap_or(1);
        }
        Ok(s)
    }
}

/// A comma-separated list of whole numbers >= 1 from the environment
/// variable `name`; `None` when it is unset or empty. `example` goes into
/// the error message.
fn env_list<T: std::str::FromStr + PartialOrd + From<u8>>(name: &str, example: &str) -> BenchResult<Option<Vec<T>>> {
    let Ok(v) = std::env::var(name) else { return Ok(None) };
    if v.trim().is_empty() {
        return Ok(None);
    }
    let list = v
        .split(',')
        .map(|x| match x.trim().parse::<T>() {
            Ok(n) if n >= T::from(1) => Ok(n),
            _ => Err(format!("{name}={v:?}: `{x}` is not a whole number >= 1 (write e.g. {example})")),
        })
        .collect::<Result<_, _>>()?;
    Ok(Some(list))
}

/// What every scenario gets: the admin connection and the settings.
pub struct Ctx {
    /// Connection to the server's admin database (creates and drops databases).
    pub admin: Client,
    /// Its config; scratch databases are this with another dbname.
    pub admin_cfg: Config,
    /// Sizes and durations.
    pub settings: Settings,
}

/// Where the reports go: `target/pg-outbox-bench/` (under
/// `CARGO_TARGET_DIR` when set).
pub fn out_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("pg-outbox-bench")
}

/// Facts that matter for reading the numbers (never the password).
async fn context(client: &Client, s: &Settings) -> BenchResult<BTreeMap<&'static str, String>> {
    let mut ctx = BTreeMap::new();
    ctx.insert("server", client.query_one("SELECT version()", &[]).await?.try_get::<_, String>(0)?);
    let rows = client
        .query(
            "SELECT name || '=' || current_setting(name) FROM pg_settings \
             WHERE name IN ('fsync', 'synchronous_commit', 'shared_buffers', 'max_connections') ORDER BY name",
            &[],
        )
        .await?;
    let settings: Vec<String> = rows.iter().map(|r| r.try_get::<_, String>(0)).collect::<Result<_, _>>()?;
    ctx.insert("settings", settings.join(", "));
    ctx.insert(
        "cpus",
        std::thread::available_parallelism().map(|n| n.get().to_string()).unwrap_or_else(|_| "?".into()),
    );
    ctx.insert(
        "mode",
        if s.smoke {
            "smoke"
        } else if s.quick {
            "quick"
        } else {
            "full"
        }
        .into(),
    );
    ctx.insert("started", chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    if let Ok(out) = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        && out.status.success()
    {
        ctx.insert("commit", String::from_utf8_lossy(&out.stdout).trim().to_string());
    }
    // The relay binary, when it is not this build's (A/B runs).
    let relay = util::relay_bin();
    if relay != env!("CARGO_BIN_EXE_pg-outbox") {
        ctx.insert("relay binary", relay);
    }
    Ok(ctx)
}

/// Drop any scratch database of this run still there (a scenario that
/// failed half-way).
async fn drop_leftovers(admin: &Client) {
    let pattern = format!("pgo_e2e_{}_%", std::process::id());
    match admin.query("SELECT datname FROM pg_database WHERE datname LIKE $1", &[&pattern]).await {
        Ok(rows) => {
            for r in rows {
                if let Ok(name) = r.try_get::<_, String>(0) {
                    drop_database(admin, &name).await;
                }
            }
        }
        Err(e) => eprintln!("e2e: could not list leftover databases: {e}"),
    }
}

/// Run the selected scenarios, print and write the report.
async fn run() -> BenchResult<()> {
    let settings = Settings::from_env()?;
    let server = find_server().await?;
    eprintln!("bench: using {}", server.source);
    let admin_cfg = server.config.clone();
    let admin = connect(&admin_cfg).await?;
    let info = context(&admin, &settings).await?;
    let ctx = Ctx { admin, admin_cfg, settings };
    let s = &ctx.settings;
    eprintln!("e2e: scenarios {} ({} mode)", s.scenarios.join(", "), info.get("mode").map_or("?", |m| m.as_str()));
    let started = Instant::now();
    let mut sections: Vec<Section> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut latency_runs = None;
    for &scenario in &s.scenarios {
        let t = Instant::now();
        let result = match scenario {
            "latency" => latency::run(&ctx).await.map(|(sec, runs)| {
                latency_runs = Some(runs);
                sec
            }),
            "drain" => drain::run(&ctx).await,
            "keepup" => keepup::run(&ctx).await,
            "producers" => producers::run(&ctx).await,
            "heads" => heads::run(&ctx).await,
            "history" => history::run(&ctx).await,
            "hot" => hot::run(&ctx).await,
            "pipeline" => pipeline::run(&ctx).await,
            "subscriptions" => subscriptions::run(&ctx).await,
            "trigger-split" => producers::split(&ctx).await,
            "peers" => peers::run(&ctx).await,
            "wal" => wal::run(&ctx).await,
            "sinks" => sinks::run(&ctx).await,
            other => Err(format!("unknown scenario {other}").into()),
        };
        drop_leftovers(&ctx.admin).await;
        match result {
            Ok(mut sec) => {
                sec.notes.push(format!("Scenario time: {:.0} s.", t.elapsed().as_secs_f64()));
                println!("{}", sec.markdown());
                sections.push(sec);
            }
            Err(e) => {
                let msg = format!("{scenario}: {}", pg_outbox::error::report(e.as_ref()));
                eprintln!("e2e: scenario FAILED: {msg}");
                failures.push(msg);
            }
        }
    }
    let total = started.elapsed().as_secs_f64();

    let mut md = String::from("# pg-outbox end-to-end benchmarks\n\n");
    for (k, v) in &info {
        md.push_str(&format!("- {k}: {v}\n"));
    }
    md.push_str(&format!("- total time: {total:.0} s\n\n"));
    for sec in &sections {
        md.push_str(&sec.markdown());
    }
    let targets: Vec<&report::Target> = sections.iter().flat_map(|s| &s.targets).collect();
    let mut summary = format!("## Targets: {} of {} met\n\n", targets.iter().filter(|t| t.met).count(), targets.len());
    for t in &targets {
        summary.push_str(&format!("- {} {} ({})\n", if t.met { "MET    " } else { "NOT MET" }, t.what, t.measured));
    }
    for f in &failures {
        summary.push_str(&format!("- FAILED scenario {f}\n"));
    }
    md.push_str(&summary);
    println!("{summary}");
    eprintln!("e2e: total {total:.0} s");

    if s.smoke {
        eprintln!(
            "e2e: smoke pass (run `cargo bench --features full --bench e2e` for the real thing); no report files written"
        );
    } else {
        let dir = out_dir();
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("e2e.md"), &md)?;
        let json = serde_json::json!({
            "context": info, "settings": s, "total_seconds": total,
            "sections": sections, "failures": failures,
        });
        std::fs::write(dir.join("e2e.json"), serde_json::to_string_pretty(&json)?)?;
        if let Some(runs) = &latency_runs {
            let png = dir.join("latency.png");
            match chart::latency_png(runs, &png) {
                Ok(()) => eprintln!("e2e: wrote {}", png.display()),
                Err(e) => failures.push(format!("chart: {e}")),
            }
        }
        eprintln!("e2e: wrote {} and e2e.json", dir.join("e2e.md").display());
    }
    if !failures.is_empty() {
        return Err(format!("{} scenario(s) failed: {}", failures.len(), failures.join("; ")).into());
    }
    Ok(())
}

/// Entry point: the suite, or a drain child (`--child-drain`).
fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some(drain::CHILD_ARG) {
        return bench::main_with(drain::child_main);
    }
    bench::main_with(run)
}

//! `pg-outbox`: migrate, relay, publish, status and demo for the
//! PostgreSQL transactional outbox `events.outbox`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use pg_outbox::relay;
use pg_outbox::{Consumer, NewEvent, Publisher, RetryPolicy};

use crate::error::Error;

mod config;
mod console;
mod dead_letters;
mod demo;
mod error;
mod health;
mod logging;
mod replay;
mod sink_args;
mod temp_server;

#[derive(Parser, Debug)]
#[command(
    name = "pg-outbox",
    version,
    about = "Stream a PostgreSQL transactional outbox (events.outbox) with low latency."
)]
#[command(after_help = DATABASE_HELP)]
struct Cli {
    /// PostgreSQL URL, e.g. postgres://user@localhost:5432/app (libpq
    /// key=value strings work too). Falls back to OUTBOX_DATABASE_URL when
    /// DATABASE_URL is unset; with neither, connects as psql does (the PG*
    /// variables, then the local socket; the notes of `pg-outbox --help`).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true, display_order = 900)]
    database_url: Option<String>,

    /// Log lines on stderr: `text` (human-readable) or `json` (one object
    /// per line with timestamp, level, message, target and the event's
    /// fields, e.g. id).
    #[arg(long, env = "PG_OUTBOX_LOG_FORMAT", global = true, hide_env_values = true, value_enum, default_value_t = logging::LogFormat::Text, display_order = 901)]
    log_format: logging::LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create or update the outbox schema (idempotent; safe to run twice).
    Migrate(MigrateArgs),
    /// Deliver outbox events to a sink until SIGINT/SIGTERM.
    #[command(after_help = RELAY_HELP)]
    Relay(Box<RelayArgs>),
    /// Deliver already published events again to a sink (by id range, time,
    /// aggregate or event type), read-only, rate-limited and resumable.
    #[command(after_help = replay::REPLAY_HELP)]
    Replay(Box<replay::ReplayArgs>),
    /// Insert one event and print its id.
    Publish(PublishArgs),
    /// Show backlog, retries and dead letters.
    Status(StatusArgs),
    /// List, show, retry or discard dead letters.
    #[command(subcommand)]
    DeadLetters(dead_letters::DeadLetterCmd),
    /// Delete published events older than a cutoff (30 days by default, as docs/schema.md says), in
    /// bounded batches; never unpublished events or dead letters.
    Archive(ArchiveArgs),
    /// Run a self-contained demo: throwaway PostgreSQL, concurrent producers,
    /// relay to stdout, summary with delivery lag.
    Demo(demo::DemoArgs),
    /// Serve the operator console in the browser (overview, dead letters,
    /// events; retry and discard) until SIGINT/SIGTERM.
    Console(console::ConsoleArgs),
}

const DATABASE_HELP: &str = "\
The database: --database-url, else DATABASE_URL, else OUTBOX_DATABASE_URL; with none of them, the
libpq variables alone, as psql uses them. Settings a URL leaves out come from PGHOST, PGPORT, PGUSER,
PGPASSWORD, PGDATABASE, PGSSLMODE, PGSSLROOTCERT, PGAPPNAME and PGCONNECT_TIMEOUT, then libpq's
defaults: the Unix socket in /var/run/postgresql or /tmp, port 5432, the OS user, a database named
after the user. Without a password, ~/.pgpass (or PGPASSFILE) supplies one.
Logs go to stderr (set RUST_LOG, e.g. RUST_LOG=debug; --log-format json for one JSON object per
line); data goes to stdout.";

const RELAY_HELP: &str = "\
Every setting can also come from the environment (OUTBOX_<FLAG>, e.g. OUTBOX_BATCH_SIZE=500,
OUTBOX_SINK=stdout) or from a TOML file given by --config FILE or OUTBOX_CONFIG, whose keys are
the flag names (batch_size = 500, or batch-size; database_url = \"postgres://...\").
Precedence: command line > environment > config file > built-in default. The database URL comes
from --database-url, else DATABASE_URL, else OUTBOX_DATABASE_URL, else the file's database_url,
else the libpq variables (PGHOST, PGUSER, PGDATABASE, ...).
--print-config shows the effective settings and where each comes from (secrets masked).";

#[derive(clap::Args, Debug)]
struct RelayArgs {
    /// Read settings from this TOML file (keys are the flag names, e.g.
    /// `batch_size = 500`; unknown keys are an error).
    #[arg(long, env = "OUTBOX_CONFIG", value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// Print the effective settings as TOML, each with its source, secrets
    /// masked, and exit without connecting.
    #[arg(long)]
    print_config: bool,
    #[command(flatten)]
    sink: sink_args::SinkArgs,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics, and the health
    /// probes /livez and /readyz beside them. A bare PORT binds 127.0.0.1
    /// (this machine only); give a host to listen elsewhere (e.g.
    /// 0.0.0.0:9464).
    #[arg(long, value_name = "[HOST:]PORT", value_parser = parse_metrics_addr)]
    metrics_addr: Option<SocketAddr>,
    /// Serve the health probes /livez and /readyz (JSON; 200 or 503) on this
    /// address too, e.g. for a probe port apart from metrics. A bare PORT
    /// binds 127.0.0.1.
    #[arg(long, value_name = "[HOST:]PORT", value_parser = parse_metrics_addr)]
    health_addr: Option<SocketAddr>,
    /// Rows fetched per query (at least 1).
    #[arg(long, default_value_t = pg_outbox::DEFAULT_BATCH_SIZE,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    batch_size: usize,
    /// Bound on the payload bytes the relay holds, as received: events
    /// fetched and not yet delivered and acknowledged (e.g. 64MiB, 512MB, or
    /// a number of bytes; at least 1MiB). A fetch stops at it, so the relay
    /// holds at most this plus one event (one larger event still moves,
    /// alone); at the bound it fetches nothing until the sink takes some.
    /// The relay hands one event at a time to the sink and queues none of
    /// its own.
    #[arg(long, value_parser = parse_byte_size, default_value = "64MiB", value_name = "SIZE")]
    max_buffered_bytes: bytesize::ByteSize,
    /// Fallback sweep interval (e.g. 200ms, 1s, 5m; at least 10ms).
    #[arg(long, value_parser = parse_sweep_interval, default_value = "1s")]
    sweep_interval: Duration,
    /// Retry delays after each failure, comma separated (e.g. 1m,5m,15m,1h);
    /// the last step repeats. Default: 1m,5m,15m,1h then doubling, capped at 24h.
    #[arg(long, value_parser = parse_schedule)]
    retry_schedule: Option<RetryPolicy>,
    /// Failures after which an event is a dead letter (at least 1).
    #[arg(long, default_value_t = pg_outbox::DEFAULT_MAX_RETRIES,
          value_parser = clap::value_parser!(i32).range(1..))]
    max_retries: i32,
    /// On SIGINT/SIGTERM, how long to wait for the event in hand.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    shutdown_grace: Duration,
    /// Longest a statement of the relay's own database sessions may run
    /// before the server cancels it (e.g. 5s, 500ms; 0 disables it). A
    /// healthy one takes milliseconds; one that times out is logged, counted
    /// in outbox_statement_timeouts_total, and retried after a reconnect.
    #[arg(long, value_parser = parse_timeout, default_value = "60s", value_name = "DURATION")]
    statement_timeout: Duration,
    /// How several relays share one outbox: `single` (one active, others
    /// hot standbys; keeps order), `partitioned` (all active, split by a hash
    /// of the aggregate; keeps per-aggregate order), `competing` (the original design's
    /// FOR UPDATE SKIP LOCKED; no order at all).
    #[arg(long, value_enum, default_value_t = ModeArg::Single)]
    mode: ModeArg,
    /// Partitions in `--mode partitioned` (the same on every relay; at least 1).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    partitions: u32,
    /// Do not LISTEN: find events by the sweep only (for a transaction-mode pooler).
    #[arg(long)]
    no_listen: bool,
    /// Run retention daily: delete published events older than this (e.g.
    /// 30d, docs/schema.md's figure). Off unless given: deleting is your call.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    retention: Option<Duration>,
    /// Hour of the day (UTC, 0-23) at which retention runs.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..24))]
    retention_hour: u32,
    /// Also run retention once right after start (then daily as usual).
    /// Hidden: meant for tests and for checking a deployment.
    #[arg(long, hide = true, requires = "retention")]
    retention_at_start: bool,
}

#[derive(clap::Args, Debug)]
struct MigrateArgs {
    /// How per-aggregate order is kept on insert. `outbox-locked` (the
    /// default for a new database): the insert trigger locks each event's
    /// aggregate, so order holds whatever producers do. `producer-locked`
    /// (opt-in, cheaper inserts): safe ONLY if every transaction that
    /// writes an aggregate's events first locks a row of its own for that
    /// aggregate and holds it to the commit (e.g. `UPDATE
    /// billing.subscriptions ... WHERE id = $1` before the INSERT);
    /// producers that do not can have events delivered out of order.
    /// Without this flag the installed mode is kept. Switching waits at
    /// most 5 s for running producer transactions (then fails: run it
    /// again).
    #[arg(long, value_enum, value_name = "MODE")]
    ordering: Option<OrderingArg>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum OrderingArg {
    OutboxLocked,
    ProducerLocked,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ModeArg {
    Single,
    Partitioned,
    Competing,
}

#[derive(clap::Args, Debug)]
struct PublishArgs {
    /// Kind of aggregate, e.g. subscription.
    #[arg(long)]
    aggregate_type: String,
    /// Aggregate id (a UUID).
    #[arg(long, value_parser = parse_uuid)]
    aggregate_id: uuid::Uuid,
    /// Event name, e.g. PaymentSucceeded.
    #[arg(long)]
    event_type: String,
    /// JSON payload, e.g. '{"version":1,"data":{"amount":990}}'; `-` reads
    /// it from standard input, `@FILE` from a file. At most 1 MiB (1048576
    /// bytes, the publisher's limit).
    #[arg(long)]
    payload: String,
}

#[derive(clap::Args, Debug)]
struct ArchiveArgs {
    /// Delete published events older than this (default 30 days, docs/schema.md).
    #[arg(long, value_parser = parse_duration, default_value = "30d")]
    older_than: Duration,
    /// Rows per DELETE statement.
    #[arg(long, default_value_t = pg_outbox::retention::DEFAULT_RETENTION_BATCH)]
    batch_size: i64,
    /// Pause between batches.
    #[arg(long, value_parser = parse_duration, default_value = "100ms")]
    pause: Duration,
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("invalid duration '{s}': {e} (write e.g. 200ms, 1s, 5m, 1h)"))?;
    if d.is_zero() {
        return Err(format!("invalid duration '{s}': must be longer than zero"));
    }
    Ok(d)
}

/// A size in bytes for `--max-buffered-bytes`: a number of bytes, or a
/// number with a unit (`KiB`, `MiB`, `GiB` in powers of 1024; `KB`, `MB`,
/// `GB` in powers of 1000; parsed by the `bytesize` crate), at least
/// [`pg_outbox::MIN_MAX_BUFFERED_BYTES`] and at most `i64::MAX`. A
/// `ByteSize`, not a number, so a config file may write it either way
/// (`"64MiB"` or `67108864`).
fn parse_byte_size(s: &str) -> Result<bytesize::ByteSize, String> {
    let size: bytesize::ByteSize = s.trim().parse().map_err(|_: String| {
        format!("invalid size '{s}': write a number of bytes or a number with a unit, e.g. 64MiB, 512MB or 1048576")
    })?;
    let bytes = usize::try_from(size.as_u64())
        .ok()
        .filter(|b| i64::try_from(*b).is_ok())
        .ok_or_else(|| format!("invalid size '{s}': too large"))?;
    if bytes < pg_outbox::MIN_MAX_BUFFERED_BYTES {
        return Err(format!(
            "invalid size '{s}' ({bytes} bytes): must be at least 1MiB ({} bytes)",
            pg_outbox::MIN_MAX_BUFFERED_BYTES
        ));
    }
    Ok(size)
}

/// A timeout: a duration as [`parse_duration`], or `0` for none (as in
/// PostgreSQL).
fn parse_timeout(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    parse_duration(s).map_err(|e| format!("{e}; 0 disables the timeout"))
}

/// Shortest sweep interval: each sweep is a query, and a sweep every few
/// microseconds would keep a database core busy for nothing.
const MIN_SWEEP_INTERVAL: Duration = Duration::from_millis(10);

fn parse_sweep_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < MIN_SWEEP_INTERVAL {
        return Err(format!("invalid duration '{s}': the sweep interval must be at least 10ms"));
    }
    Ok(d)
}

fn parse_schedule(s: &str) -> Result<RetryPolicy, String> {
    let steps = s.split(',').map(parse_duration).collect::<Result<Vec<_>, _>>()?;
    RetryPolicy::schedule(steps).map_err(|e| e.to_string())
}

/// `PORT` (bound on 127.0.0.1) or `HOST:PORT`.
fn parse_metrics_addr(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let s = s.trim();
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.to_socket_addrs()
        .map_err(|e| format!("invalid address '{s}': {e} (write PORT or HOST:PORT, e.g. 9464 or 0.0.0.0:9464)"))?
        .next()
        .ok_or_else(|| format!("address '{s}' resolves to nothing"))
}

fn parse_uuid(s: &str) -> Result<uuid::Uuid, String> {
    uuid::Uuid::parse_str(s.trim()).map_err(|e| format!("'{s}' is not a valid UUID: {e}"))
}

/// The connection string: `--database-url`, `DATABASE_URL` or
/// `OUTBOX_DATABASE_URL` (clap, then `config::command`); empty when none is
/// given, which [`pg_outbox::ConnectOptions::parse`] fills from the libpq
/// variables and defaults, as psql does.
fn database_url(cli: &Option<String>) -> String {
    cli.clone().filter(|s| !s.trim().is_empty()).unwrap_or_default()
}

/// Resolve `url` (libpq's variables fill what it leaves out) and connect.
async fn connect(url: &str) -> Result<tokio_postgres::Client, Error> {
    Ok(options(url)?.connect().await?)
}

/// `url` parsed, with libpq's variables and defaults for what it leaves
/// out; the sessions are named `pg-outbox cli` unless it names them.
fn options(url: &str) -> Result<pg_outbox::ConnectOptions, Error> {
    let opts = pg_outbox::ConnectOptions::parse(url)?;
    Ok(match opts.application_name() {
        Some(_) => opts,
        None => opts.with_application_name("pg-outbox cli"),
    })
}

/// How to name the database, for a failed connection with no URL given.
const NO_URL_HINT: &str = "hint: no database URL was given (--database-url, DATABASE_URL or \
OUTBOX_DATABASE_URL), so the libpq variables and defaults were used as psql uses them: set PGHOST, \
PGPORT, PGUSER, PGDATABASE (and PGPASSWORD or ~/.pgpass), or give a URL such as \
postgres://user@host:5432/dbname";

/// Resolves on the first SIGINT/SIGTERM (graceful shutdown: the event in
/// hand gets `--shutdown-grace`, acknowledgements are written); a second
/// signal exits at once with status 130: nothing is lost, but events
/// delivered since the last written acknowledgement are delivered again.
async fn shutdown_then_force() {
    shutdown_signal().await;
    tokio::spawn(async {
        shutdown_signal().await;
        tracing::warn!(
            "second signal: exiting now; events whose acknowledgements were not written yet will be delivered again"
        );
        std::process::exit(130);
    });
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// Install the Prometheus recorder (served by [`health::serve`]) and keep
/// its histograms trimmed.
pub(crate) fn install_metrics() -> Result<metrics_exporter_prometheus::PrometheusHandle, Error> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let buckets =
        [0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(pg_outbox::metrics::DELIVERY_LAG.into()), &buckets)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(pg_outbox::metrics::SINK_DURATION.into()), &buckets))
        .map_err(|e| Error::Config(format!("metrics: {e}")))?;
    let handle = builder.install_recorder().map_err(|e| Error::Config(format!("metrics: {e}")))?;
    // What the exporter's own listener would do: upkeep every 5 s.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    pg_outbox::metrics::describe();
    pg_outbox::metrics::record_initial_values();
    Ok(handle)
}

async fn relay_cmd(url: &str, args: RelayArgs) -> Result<(), Error> {
    let (sink, sink_name) = relay::open_sink(&args.sink.sink, &args.sink.options()?).await?;
    let pg = pg_outbox::ConnectOptions::parse(url)?;
    let target = pg.describe();
    let metrics_listener = args.metrics_addr.map(|a| health::bind(a, "metrics")).transpose()?;
    let health_addr = args.health_addr.filter(|a| Some(*a) != args.metrics_addr);
    let health_listener = health_addr.map(|a| health::bind(a, "health probes")).transpose()?;
    let metrics = install_metrics()?;
    let probes = health::Probes::new(sink_name.clone(), args.sink.sink_timeout);
    if let Some(l) = metrics_listener {
        health::serve(l, probes.clone(), Some(metrics))?;
    }
    if let Some(l) = health_listener {
        health::serve(l, probes.clone(), None)?;
    }
    let mut builder = Consumer::builder(pg)
        .batch_size(args.batch_size)
        .max_buffered_bytes(usize::try_from(args.max_buffered_bytes.as_u64()).unwrap_or(usize::MAX))
        .sweep_interval(args.sweep_interval)
        .max_retries(args.max_retries)
        .shutdown_grace(args.shutdown_grace)
        .statement_timeout(args.statement_timeout)
        .listen(!args.no_listen)
        .mode(match args.mode {
            ModeArg::Single => pg_outbox::Mode::Single,
            ModeArg::Partitioned => pg_outbox::Mode::Partitioned { partitions: args.partitions },
            ModeArg::Competing => pg_outbox::Mode::Competing,
        });
    if let Some(policy) = args.retry_schedule {
        builder = builder.retry_policy(policy);
    }
    let bound = args.max_buffered_bytes;
    let stream = builder.start().await?;
    probes.started(stream.health());
    if let Some(a) = args.health_addr {
        tracing::info!(livez = %format!("http://{a}/livez"), readyz = %format!("http://{a}/readyz"), "health probes");
    }
    match args.metrics_addr {
        Some(a) => {
            tracing::info!(database = %target, sink = %sink_name, max_buffered_bytes = %bound, metrics = %format!("http://{a}/metrics"), "relay started; listening on channel {}", pg_outbox::NOTIFY_CHANNEL)
        }
        None => {
            tracing::info!(database = %target, sink = %sink_name, max_buffered_bytes = %bound, "relay started; listening on channel {}", pg_outbox::NOTIFY_CHANNEL)
        }
    }
    let retention = args.retention.map(|older| {
        tokio::spawn(retention_loop(url.to_string(), older, args.retention_hour, args.retention_at_start))
    });
    let stats = relay::run(stream, sink.as_ref(), shutdown_then_force()).await;
    if let Some(task) = retention {
        task.abort();
    }
    let stats = stats?;
    tracing::info!(delivered = stats.delivered, failed = stats.failed, "relay stopped");
    Ok(())
}

/// Run retention every day at `hour`:00 UTC (and once at start when
/// `at_start`), each run on a connection of its own.
async fn retention_loop(url: String, older_than: Duration, hour: u32, at_start: bool) {
    let r = pg_outbox::retention::Retention { older_than, ..Default::default() };
    if at_start {
        retention_once(&url, &r).await;
    }
    loop {
        let now = chrono::Utc::now();
        let next = pg_outbox::retention::next_daily_run(now, hour);
        let wait = (next - now).to_std().unwrap_or(Duration::from_secs(3600));
        tracing::info!(next = %next.to_rfc3339(), "retention scheduled");
        tokio::time::sleep(wait).await;
        retention_once(&url, &r).await;
    }
}

async fn retention_once(url: &str, r: &pg_outbox::retention::Retention) {
    let run = async { pg_outbox::retention::run(&pg_outbox::ConnectOptions::parse(url)?, r).await };
    match run.await {
        Ok(rep) if rep.skipped => tracing::info!("retention skipped: another relay is running it"),
        Ok(rep) => tracing::info!(deleted = rep.deleted, batches = rep.batches, "retention done"),
        Err(e) => tracing::error!(error = %pg_outbox::error::report(&e), "retention failed"),
    }
}

async fn archive_cmd(url: &str, args: ArchiveArgs) -> Result<(), Error> {
    let r =
        pg_outbox::retention::Retention { older_than: args.older_than, batch_size: args.batch_size, pause: args.pause };
    let age = humantime::format_duration(args.older_than);
    if args.dry_run {
        let rep = pg_outbox::retention::dry_run(&connect(url).await?, &r).await?;
        println!("dry run: would delete {} published events older than {age}", rep.deleted);
        return Ok(());
    }
    let rep = pg_outbox::retention::run(&pg_outbox::ConnectOptions::parse(url)?, &r).await?;
    if rep.skipped {
        return Err(Error::Usage("another retention run holds the lock; nothing deleted".into()));
    }
    println!("deleted {} published events older than {age} in {} batches", rep.deleted, rep.batches);
    Ok(())
}

async fn publish_cmd(url: &str, args: PublishArgs) -> Result<(), Error> {
    // Read at most one byte over the limit, so `@/dev/zero` or an endless
    // pipe is refused instead of filling memory.
    let limit = u64::try_from(pg_outbox::DEFAULT_MAX_PAYLOAD_BYTES).unwrap_or(u64::MAX).saturating_add(1);
    let read_limited = |r: &mut dyn std::io::Read, what: &str| -> Result<String, Error> {
        let mut buf = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(r, limit), &mut buf)
            .map_err(|e| Error::InvalidEvent(format!("cannot read the payload from {what}: {e}")))?;
        if buf.len() as u64 >= limit {
            return Err(Error::InvalidEvent(format!(
                "the payload from {what} is over the limit of {} bytes",
                pg_outbox::DEFAULT_MAX_PAYLOAD_BYTES
            )));
        }
        Ok(buf)
    };
    let text = if args.payload == "-" {
        read_limited(&mut std::io::stdin(), "standard input")?
    } else if let Some(path) = args.payload.strip_prefix('@') {
        let mut file = std::fs::File::open(path)
            .map_err(|e| Error::InvalidEvent(format!("cannot read the payload file {path}: {e}")))?;
        read_limited(&mut file, &format!("the file {path}"))?
    } else {
        args.payload.clone()
    };
    let payload: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::InvalidEvent(format!("--payload is not valid JSON: {e}")))?;
    let event = NewEvent::new(args.aggregate_type, args.aggregate_id, args.event_type, payload);
    let publisher = Publisher::new();
    event.validate(pg_outbox::DEFAULT_MAX_PAYLOAD_BYTES)?;
    let client = connect(url).await?;
    let id = publisher.publish(&client, &event).await?;
    println!("{id}");
    Ok(())
}

async fn status_cmd(url: &str, args: StatusArgs) -> Result<(), Error> {
    let client = connect(url).await?;
    let s = pg_outbox::status(&client).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        let age = s.oldest_unpublished_age_seconds.map_or("-".to_string(), |a| format!("{a:.3} s"));
        println!("unpublished         {}", s.unpublished);
        println!("due now             {}", s.due_now);
        println!("held back           {}", s.held_back);
        println!("waiting for retry   {}", s.waiting_for_retry);
        println!("dead letters        {}", s.dead_letters);
        println!("oldest pending age  {age}");
        println!(
            "ordering mode       {}",
            s.ordering.map_or("none (no insert trigger enabled)", pg_outbox::migrate::OrderingMode::as_str)
        );
        print_by_type(&s);
        print_retries(&s.retries);
    }
    Ok(())
}

/// `s` safe to print in a table: a line break becomes a space; other
/// control characters (ESC, C1 controls such as CSI, DEL) and bidirectional
/// overrides become escapes like `\u{1b}`, so stored text cannot drive the
/// terminal. (JSON output is escaped by serde.)
pub(crate) fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' | '\r' => out.push(' '),
            c if c.is_control()
                || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                out.extend(c.escape_default())
            }
            c => out.push(c),
        }
    }
    out
}

/// Seconds as a short human figure: `850 ms`, `42 s`, `3m 5s`, `2h 10m`.
fn short_secs(secs: f64) -> String {
    if !secs.is_finite() {
        return "-".into();
    }
    if secs < 1.0 {
        return format!("{:.0} ms", secs * 1000.0);
    }
    if secs < 60.0 {
        return format!("{secs:.0} s");
    }
    let whole = Duration::from_secs(secs as u64);
    let (h, m, s) = (whole.as_secs() / 3600, whole.as_secs() / 60 % 60, whole.as_secs() % 60);
    if h > 0 { format!("{h}h {m}m") } else { format!("{m}m {s}s") }
}

fn print_by_type(s: &pg_outbox::OutboxStatus) {
    if s.by_type.is_empty() {
        return;
    }
    let types: Vec<(String, String)> =
        s.by_type.iter().map(|t| (printable(&t.event_type), printable(&t.aggregate_type))).collect();
    let w_event = types.iter().map(|(e, _)| e.chars().count()).max().unwrap_or(0).max(10);
    let w_agg = types.iter().map(|(_, a)| a.chars().count()).max().unwrap_or(0).max(14);
    println!();
    println!("by event type");
    println!(
        "{:<w_event$}  {:<w_agg$}  {:>11}  {:>7}  {:>9}  {:>17}  {:>12}  oldest pending",
        "event_type", "aggregate_type", "unpublished", "due now", "held back", "waiting for retry", "dead letters"
    );
    for (t, (event_type, aggregate_type)) in s.by_type.iter().zip(&types) {
        let age = t.oldest_unpublished_age_seconds.map_or("-".to_string(), short_secs);
        println!(
            "{:<w_event$}  {:<w_agg$}  {:>11}  {:>7}  {:>9}  {:>17}  {:>12}  {age}",
            event_type, aggregate_type, t.unpublished, t.due_now, t.held_back, t.waiting_for_retry, t.dead_letters
        );
    }
    if s.by_type_truncated {
        println!("(only the {} types with the most unpublished events are shown)", s.by_type.len());
    }
}

fn print_retries(r: &pg_outbox::RetryLadder) {
    let Some(next_at) = r.next_due_at else { return };
    println!();
    let next_in = r.next_due_in_seconds.map_or("-".to_string(), short_secs);
    println!(
        "retries due         next at {} (in {next_in})",
        next_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    println!("  within 1 m        {}", r.due_within_1m);
    println!("  within 1 h        {}", r.due_within_1h);
    println!("  later             {}", r.due_later);
    if r.next.is_empty() {
        return;
    }
    println!("next retries");
    println!(
        "{:>10}  {:<24}  {:<20}  {:>7}  {:<20}  {:>8}  last_error",
        "id", "event_type", "aggregate_type", "retries", "due at", "due in"
    );
    for p in &r.next {
        let err: String = printable(p.last_error.as_deref().unwrap_or_default()).chars().take(60).collect();
        println!(
            "{:>10}  {:<24}  {:<20}  {:>7}  {:<20}  {:>8}  {err}",
            p.id,
            printable(&p.event_type),
            printable(&p.aggregate_type),
            p.retry_count,
            p.due_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            short_secs(p.due_in_seconds)
        );
    }
}

async fn migrate_cmd(url: &str, args: MigrateArgs) -> Result<(), Error> {
    use pg_outbox::migrate::{self, OrderingMode};
    let pg = pg_outbox::ConnectOptions::parse(url)?;
    let report = migrate::apply(&pg).await?;
    if report.applied.is_empty() {
        eprintln!("schema is up to date");
    } else {
        for name in &report.applied {
            eprintln!("applied {name}");
        }
    }
    let installed = match args.ordering {
        Some(arg) => {
            let mode = match arg {
                OrderingArg::OutboxLocked => OrderingMode::OutboxLocked,
                OrderingArg::ProducerLocked => OrderingMode::ProducerLocked,
            };
            let before = migrate::set_ordering(&pg, mode).await.map_err(|e| {
                if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
                    return Error::Usage(format!(
                        "could not switch the ordering mode to {mode}: producer transactions that have written \
                         events kept events.outbox locked for 5 s (the switch waits for them, and producers wait \
                         for the switch, so it gives up then); nothing changed: run `pg-outbox migrate --ordering \
                         {mode}` again, when fewer producer transactions are open"
                    ));
                }
                Error::Outbox(e)
            })?;
            if before == Some(mode) {
                eprintln!("ordering mode: {mode} (unchanged)");
            } else {
                eprintln!("ordering mode: {mode} (was {})", before.map_or("none", OrderingMode::as_str));
            }
            Some(mode)
        }
        None => {
            let client = pg.connect().await?;
            let mode = migrate::ordering(&client).await?;
            match mode {
                Some(mode) => eprintln!("ordering mode: {mode} (kept; change it with --ordering)"),
                None => eprintln!(
                    "ordering mode: none (no insert trigger is enabled on events.outbox; enable one with --ordering)"
                ),
            }
            mode
        }
    };
    if installed == Some(OrderingMode::ProducerLocked) {
        eprintln!(
            "note: in the producer-locked mode, order per aggregate holds only if every transaction that writes \
             an aggregate's events first locks a row of its own for that aggregate (README, \"Ordering modes\")"
        );
    }
    Ok(())
}

/// Let a closed standard output (`pg-outbox status | head -1`) end the
/// process quietly, as it does other command-line tools, instead of a
/// "Broken pipe" panic: the Rust runtime ignores SIGPIPE, this restores its
/// default action. Not for `relay` and `demo`, whose stdout sink handles
/// EPIPE itself and which must shut down cleanly.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called at start, before any other thread exists; SIG_DFL is a
    // valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    let loaded = match config::load() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {}", pg_outbox::error::report(&e));
            return ExitCode::FAILURE;
        }
    };
    if let Command::Relay(args) = &loaded.cli.command
        && args.print_config
    {
        print!("{}", config::render(&loaded));
        return ExitCode::SUCCESS;
    }
    let cli = loaded.cli;
    if !matches!(cli.command, Command::Relay(_) | Command::Demo(_) | Command::Replay(_) | Command::Console(_)) {
        restore_sigpipe();
    }
    let log_format = cli.log_format;
    logging::init(log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let url = database_url(&cli.database_url);
    let no_url = url.is_empty() && !matches!(cli.command, Command::Demo(_));
    let target_url = url.clone();
    let result = rt.block_on(async move {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Migrate(args) => migrate_cmd(&url, args).await,
            Command::Relay(args) => relay_cmd(&url, *args).await,
            Command::Publish(args) => publish_cmd(&url, args).await,
            Command::Status(args) => status_cmd(&url, args).await,
            Command::DeadLetters(cmd) => dead_letters::run(&url, cmd).await,
            Command::Archive(args) => archive_cmd(&url, args).await,
            Command::Replay(args) => replay::run(&url, *args, log_format).await,
            Command::Console(args) => console::run(options(&url)?, args).await,
        }
    });
    rt.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Error::Interrupted) => ExitCode::from(replay::INTERRUPTED_EXIT),
        Err(e) => {
            let mut message = pg_outbox::error::report(&e);
            // Name the database that lacks the schema: with libpq's
            // defaults it may not be the one the user had in mind.
            if let Error::Outbox(pg_outbox::Error::NotMigrated(_)) = &e
                && let Ok(target) = pg_outbox::ConnectOptions::parse(&target_url)
            {
                message.push_str(&format!(" against {}", target.describe()));
            }
            logging::error(log_format, &message);
            if no_url
                && matches!(
                    e,
                    Error::Outbox(pg_outbox::Error::Connect { .. } | pg_outbox::Error::ConnectTimedOut { .. })
                )
            {
                logging::line(log_format, "INFO", "pg_outbox", NO_URL_HINT, &[]);
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statement_timeout_takes_durations_and_zero_and_defaults_to_the_librarys() {
        assert_eq!(parse_timeout("0"), Ok(Duration::ZERO));
        assert_eq!(parse_timeout("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_timeout(" 250ms "), Ok(Duration::from_millis(250)));
        let e = parse_timeout("abc").expect_err("not a duration");
        assert!(e.contains("invalid duration 'abc'") && e.contains("0 disables"), "{e}");
        let cli = Cli::try_parse_from(["pg-outbox", "relay"]).expect("relay parses without flags");
        let Command::Relay(args) = cli.command else { panic!("relay") };
        assert_eq!(args.statement_timeout, pg_outbox::DEFAULT_STATEMENT_TIMEOUT);
    }

    #[test]
    fn max_buffered_bytes_takes_sizes_and_defaults_to_the_librarys() {
        let bytes = |s: &str| parse_byte_size(s).map(|b| b.as_u64());
        assert_eq!(bytes("64MiB"), Ok(64 << 20));
        assert_eq!(bytes(" 2 MB "), Ok(2_000_000));
        assert_eq!(bytes("1048576"), Ok(1 << 20));
        assert_eq!(bytes("1GiB"), Ok(1 << 30));
        let e = parse_byte_size("lots").expect_err("not a size");
        assert!(e.contains("invalid size 'lots'") && e.contains("64MiB"), "{e}");
        let e = parse_byte_size("64").expect_err("under 1 MiB");
        assert!(e.contains("at least 1MiB"), "{e}");
        let cli = Cli::try_parse_from(["pg-outbox", "relay"]).expect("relay parses without flags");
        let Command::Relay(args) = cli.command else { panic!("relay") };
        assert_eq!(args.max_buffered_bytes.as_u64(), pg_outbox::DEFAULT_MAX_BUFFERED_BYTES as u64);
    }
}

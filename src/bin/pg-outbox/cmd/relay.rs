//! `pg-outbox relay`: deliver outbox events to a sink until SIGINT/SIGTERM,
//! with metrics, health probes and optional daily retention.

use std::net::SocketAddr;
use std::time::Duration;

use pg_outbox::{Consumer, RetryPolicy, relay};

use crate::error::Error;
use crate::health;
use crate::parse::{
    parse_byte_size, parse_duration, parse_metrics_addr, parse_schedule, parse_stranded_after, parse_sweep_interval,
    parse_timeout,
};
use crate::prometheus::install_metrics;
use crate::signals::shutdown_then_force;
use crate::sink_args::SinkArgs;

pub(crate) const RELAY_HELP: &str = "\
Every setting can also come from the environment (OUTBOX_<FLAG>, e.g. OUTBOX_BATCH_SIZE=500,
OUTBOX_SINK=stdout) or from a TOML file given by --config FILE or OUTBOX_CONFIG, whose keys are
the flag names (batch_size = 500, or batch-size; database_url = \"postgres://...\").
Precedence: command line > environment > config file > built-in default. The database URL comes
from --database-url, else DATABASE_URL, else OUTBOX_DATABASE_URL, else the file's database_url,
else the libpq variables (PGHOST, PGUSER, PGDATABASE, ...).
--print-config shows the effective settings and where each comes from (secrets masked).";

#[derive(clap::Args, Debug)]
pub(crate) struct RelayArgs {
    /// Read settings from this TOML file (keys are the flag names, e.g.
    /// `batch_size = 500`; unknown keys are an error).
    #[arg(long, env = "OUTBOX_CONFIG", value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// Print the effective settings as TOML, each with its source, secrets
    /// masked, and exit without connecting.
    #[arg(long)]
    pub(crate) print_config: bool,
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
    /// Rows fetched per query (1 to 100000).
    #[arg(long, default_value_t = pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=pg_outbox::ConsumerBuilder::MAX_BATCH_SIZE as u64))]
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
    #[arg(long, default_value_t = pg_outbox::ConsumerBuilder::DEFAULT_MAX_RETRIES,
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
    /// Longest wait between attempts to reconnect once the database is lost
    /// (e.g. 10s, 2s, 1m). The first attempt comes after 100-200ms and each
    /// wait doubles, with jitter, up to this: once the database is back (a
    /// restart, a failover, a suspended server resuming), the relay resumes
    /// within about this long. Lower it for a quicker failover; each attempt
    /// is one connection per session (three).
    #[arg(long, value_parser = parse_duration, default_value = "10s", value_name = "DURATION")]
    reconnect_max_delay: Duration,
    /// If the database is a read-only standby at start, wait for it to be
    /// promoted (retrying with the reconnect backoff, logged once when the
    /// wait starts and once when it ends) instead of exiting with an error.
    /// Once running, the relay always waits out a failover this way.
    #[arg(long)]
    wait_for_primary: bool,
    /// The subscription to deliver (default: `default`, the seeded flow of
    /// `published_at` and the retry columns on the row). Another one keeps
    /// its own progress, retries and dead letters, and its own leader:
    /// create it first with `pg-outbox subscription create NAME`. Any
    /// mode. Its metrics carry the label `subscription="NAME"`.
    #[arg(long, value_name = "NAME", default_value = "default")]
    subscription: String,
    /// How several relays share one outbox: `single` (one active, others
    /// hot standbys; keeps order; each leader takes a leadership term that
    /// every message carries, and after a leader that did not stop cleanly
    /// the next waits 2.25 s before it delivers), `partitioned` (all active, split by a hash
    /// of the aggregate; keeps per-aggregate order; a term per partition, the same wait for a
    /// partition taken from a relay that did not stop cleanly), `competing` (the original
    /// design's FOR UPDATE SKIP LOCKED, or for a subscription a claim lock per event; no
    /// order at all; no term).
    #[arg(long, value_enum, default_value_t = ModeArg::Single)]
    mode: ModeArg,
    /// Partitions in `--mode partitioned` (the same on every relay; 1 to
    /// 4096; default 16). Refused with another mode.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    partitions: Option<u32>,
    /// Do not LISTEN: find events by the sweep only (for a server whose
    /// notifications never arrive, or producers that use two-phase commit).
    /// Not a way through a transaction-mode pooler: the relay refuses one.
    #[arg(long)]
    no_listen: bool,
    /// Where the relay learns that events committed: `listen` (the insert
    /// trigger's NOTIFY) or `wal` (the server's logical replication stream,
    /// through a temporary slot that disappears with the relay, so
    /// producers need no insert trigger and no WAL is kept while no relay
    /// runs). `wal` needs wal_level = logical, the REPLICATION privilege, a
    /// free replication slot and WAL sender, and `pg-outbox migrate
    /// --source wal`; the relay checks each at start and exits naming what
    /// to change. Events are read from the table either way.
    #[arg(long, value_enum, default_value_t = SourceArg::Listen)]
    source: SourceArg,
    /// In `--mode single`, let a standby end a stranded holder of the outbox
    /// lock and take over: a session that holds the lock with no live relay
    /// behind it (a pooler's server session left with it, an older build's
    /// relay; on PostgreSQL 13 also a frozen relay or one behind a network
    /// that drops traffic, which on 14 and later the server ends itself
    /// after 4 s idle), so nothing is delivered. Without this flag a standby only reports it (a warning,
    /// outbox_leader_stranded = 1, `status`). Ending another session takes
    /// pg_terminate_backend, which PostgreSQL allows a superuser, a role with
    /// the holder's role's privileges, or a member of pg_signal_backend
    /// (`GRANT pg_signal_backend TO <relay role>`); a superuser's session only
    /// a superuser. Refused, the standby logs what is missing and keeps
    /// standing by.
    #[arg(long)]
    take_over_stranded: bool,
    /// In `--mode single`, how old the active relay's heartbeat may get
    /// before a standby counts the lock's holder as stranded (3s to 1h).
    /// Heartbeats and a standby's looks come every third of it; a holder
    /// that stops is found within this plus two looks (26 s by default).
    /// Use the same value on every relay of one outbox.
    #[arg(long, value_parser = parse_stranded_after, default_value = "15s", value_name = "DURATION")]
    stranded_after: Duration,
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
    /// Declare that every producer locks its aggregate's row before it
    /// inserts the aggregate's events (the producer-locked contract, README
    /// "Ordering modes"). --exactly-once needs it on an outbox in ordering
    /// mode producer-locked (or with no insert trigger), where
    /// per-aggregate order rests on that contract; it changes nothing else.
    /// A producer that breaks it makes an event arrive after a later one of
    /// its aggregate, which then fails with an error saying so.
    #[arg(long)]
    producers_lock_aggregates: bool,
    /// With --subscription: acknowledge with the session's
    /// synchronous_commit (on by default) instead of off. By default a
    /// named subscription's acknowledgements, retries and dead letters do
    /// not wait for the WAL to reach disk, so relays of many subscriptions
    /// cost producers what one costs; a server crash or a failover then
    /// delivers the last moments' events again (up to 3 x
    /// wal_writer_delay, 600 ms at its default), never loses one. The
    /// default subscription always acknowledges durably.
    #[arg(long)]
    durable_acks: bool,
    /// Deliveries in flight to the sink at once (1 to 10000), at most one
    /// per aggregate, so per-aggregate order holds whatever completes
    /// first. Into a sink whose answer takes a round trip, throughput grows
    /// with it up to what the destination takes; 1 sends one event at a
    /// time. A shutdown gives every send in flight --shutdown-grace, then
    /// releases what is left (delivered again, never marked published).
    #[arg(long, value_name = "N", default_value_t = pg_outbox::relay::DEFAULT_MAX_IN_FLIGHT as u64,
        value_parser = clap::value_parser!(u64).range(1..=10000))]
    max_in_flight: u64,
    #[command(flatten)]
    sink: SinkArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SourceArg {
    Listen,
    Wal,
}

impl SourceArg {
    pub(crate) fn kind(self) -> pg_outbox::SourceKind {
        match self {
            SourceArg::Listen => pg_outbox::SourceKind::Listen,
            SourceArg::Wal => pg_outbox::SourceKind::Wal,
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ModeArg {
    Single,
    Partitioned,
    Competing,
}

pub(crate) async fn run(pg: pg_outbox::ConnectOptions, args: RelayArgs) -> Result<(), Error> {
    check(&args)?;
    let sink = args.sink.open().await?;
    let sink_name = sink.name().to_string();
    let guarantee = sink.guarantee();
    let target = pg.describe();
    let metrics_listener = args.metrics_addr.map(|a| health::bind(a, "metrics")).transpose()?;
    let health_addr = args.health_addr.filter(|a| Some(*a) != args.metrics_addr);
    let health_listener = health_addr.map(|a| health::bind(a, "health probes")).transpose()?;
    let metrics = install_metrics(&args.subscription)?;
    // Before /metrics is served, so its first scrape shows it.
    guarantee.record();
    let probes = health::Probes::new(sink_name.clone(), args.sink.sink_timeout);
    if let Some(l) = metrics_listener {
        health::serve(l, probes.clone(), Some(metrics))?;
    }
    if let Some(l) = health_listener {
        health::serve(l, probes.clone(), None)?;
    }
    let builder = consumer(pg.clone(), &args);
    let stream = builder.start().await?;
    // From here a SIGTERM is a graceful shutdown (until now, nothing was
    // in flight and the default action ends the process).
    let shutdown = shutdown_then_force();
    probes.started(stream.health());
    if let Some(a) = args.health_addr {
        tracing::info!(livez = %format!("http://{a}/livez"), readyz = %format!("http://{a}/readyz"), "health probes");
    }
    log_start(&args, &target, &sink_name, guarantee);
    let retention = args
        .retention
        .map(|older| tokio::spawn(retention_loop(pg.clone(), older, args.retention_hour, args.retention_at_start)));
    let mut delivery = args.sink.delivery();
    delivery.max_in_flight = usize::try_from(args.max_in_flight).unwrap_or(1);
    let stats = relay::run_with(stream, sink.as_ref(), &delivery, shutdown).await;
    if let Some(task) = retention {
        task.abort();
    }
    let stats = stats?;
    tracing::info!(signal = "stopped", delivered = stats.delivered, failed = stats.failed, "relay stopped");
    Ok(())
}

/// Partitions of `--mode partitioned` without `--partitions`.
pub(crate) const DEFAULT_PARTITIONS: u32 = 16;

/// Refuse flag combinations that cannot work, naming the flags.
fn check(args: &RelayArgs) -> Result<(), Error> {
    if args.sink.exactly_once && args.mode == ModeArg::Competing {
        return Err(Error::Config(
            "--exactly-once needs one aggregate's events delivered one at a time in id order, which \
             --mode competing does not keep; use --mode single or partitioned"
                .into(),
        ));
    }
    if let Some(n) = args.partitions
        && args.mode != ModeArg::Partitioned
    {
        let mode = if args.mode == ModeArg::Single { "single" } else { "competing" };
        return Err(Error::Config(format!(
            "--partitions {n} applies to --mode partitioned; this relay runs --mode {mode}, which has no partitions: \
             add --mode partitioned, or drop --partitions"
        )));
    }
    if args.durable_acks && args.subscription == pg_outbox::subscription::DEFAULT {
        return Err(Error::Config(
            "--durable-acks applies to --subscription NAME: the default subscription always acknowledges durably \
             (its published_at commits as the session says); add --subscription NAME, or drop --durable-acks"
                .into(),
        ));
    }
    if args.no_listen && args.source == SourceArg::Wal {
        return Err(Error::Config(
            "--no-listen applies to --source listen: the WAL source never LISTENs (its replication stream wakes it)"
                .into(),
        ));
    }
    Ok(())
}

/// The consumer the relay's flags configure, on `pg`.
fn consumer(pg: pg_outbox::ConnectOptions, args: &RelayArgs) -> pg_outbox::ConsumerBuilder {
    let builder = Consumer::builder(pg)
        .batch_size(args.batch_size)
        .max_buffered_bytes(usize::try_from(args.max_buffered_bytes.as_u64()).unwrap_or(usize::MAX))
        .sweep_interval(args.sweep_interval)
        .max_retries(args.max_retries)
        .shutdown_grace(args.shutdown_grace)
        .statement_timeout(args.statement_timeout)
        .reconnect_max_delay(args.reconnect_max_delay)
        .wait_for_primary(args.wait_for_primary)
        .listen(!args.no_listen)
        .source(args.source.kind())
        .stranded_after(args.stranded_after)
        .take_over_stranded(args.take_over_stranded)
        .producers_lock_aggregates(args.producers_lock_aggregates)
        .durable_acknowledgements(args.durable_acks)
        .subscription(args.subscription.clone())
        .mode(match args.mode {
            ModeArg::Single => pg_outbox::Mode::Single,
            ModeArg::Partitioned => {
                pg_outbox::Mode::Partitioned { partitions: args.partitions.unwrap_or(DEFAULT_PARTITIONS) }
            }
            ModeArg::Competing => pg_outbox::Mode::Competing,
        });
    match args.retry_schedule.clone() {
        Some(policy) => builder.retry_policy(policy),
        None => builder,
    }
}

/// Log what the relay runs with: the database, the sink and its guarantee,
/// the memory bound, what wakes it, and where metrics are served.
fn log_start(args: &RelayArgs, target: &str, sink_name: &str, guarantee: pg_outbox::relay::Guarantee) {
    let bound = args.max_buffered_bytes;
    let woken_by = match (args.source, args.no_listen) {
        (SourceArg::Wal, _) => "woken by logical replication (publication pg_outbox)".to_string(),
        (SourceArg::Listen, true) => "no LISTEN: the sweep finds new events".to_string(),
        (SourceArg::Listen, false) => format!("listening on channel {}", pg_outbox::Consumer::NOTIFY_CHANNEL),
    };
    let mode = match args.mode {
        ModeArg::Single => "single".to_string(),
        ModeArg::Partitioned => format!("partitioned {}", args.partitions.unwrap_or(DEFAULT_PARTITIONS)),
        ModeArg::Competing => "competing".to_string(),
    };
    let acks = if args.durable_acks || args.subscription == pg_outbox::subscription::DEFAULT {
        "durable"
    } else {
        "asynchronous"
    };
    match args.metrics_addr {
        Some(a) => {
            tracing::info!(signal = "started", database = %target, subscription = %args.subscription, mode = %mode, acknowledgements = acks, sink = %sink_name, max_buffered_bytes = %bound, metrics = %format!("http://{a}/metrics"), "relay started; {woken_by}")
        }
        None => {
            tracing::info!(signal = "started", database = %target, subscription = %args.subscription, mode = %mode, acknowledgements = acks, sink = %sink_name, max_buffered_bytes = %bound, "relay started; {woken_by}")
        }
    }
    tracing::info!(sink = %sink_name, guarantee = %guarantee, max_in_flight = args.max_in_flight, "sink delivery guarantee: {guarantee}");
}

/// Run retention every day at `hour`:00 UTC (and once at start when
/// `at_start`), each run on a connection of its own.
async fn retention_loop(db: pg_outbox::ConnectOptions, older_than: Duration, hour: u32, at_start: bool) {
    let r = pg_outbox::retention::Retention { older_than, ..Default::default() };
    if at_start {
        retention_once(&db, &r).await;
    }
    loop {
        let now = chrono::Utc::now();
        let next = pg_outbox::retention::next_daily_run(now, hour);
        let wait = (next - now).to_std().unwrap_or(Duration::from_secs(3600));
        tracing::info!(next = %next.to_rfc3339(), "retention scheduled");
        tokio::time::sleep(wait).await;
        retention_once(&db, &r).await;
    }
}

async fn retention_once(db: &pg_outbox::ConnectOptions, r: &pg_outbox::retention::Retention) {
    match pg_outbox::retention::run(db, r).await {
        Ok(rep) if rep.skipped => tracing::info!("retention skipped: another relay is running it"),
        Ok(rep) => tracing::info!(deleted = rep.deleted, batches = rep.batches, "retention done"),
        Err(e) => tracing::error!(error = %pg_outbox::error::report(&e), "retention failed"),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    #[test]
    fn statement_timeout_takes_durations_and_zero_and_defaults_to_the_librarys() {
        assert_eq!(parse_timeout("0"), Ok(Duration::ZERO));
        assert_eq!(parse_timeout("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_timeout(" 250ms "), Ok(Duration::from_millis(250)));
        let e = parse_timeout("abc").expect_err("not a duration");
        assert!(e.contains("invalid duration 'abc'") && e.contains("0 disables"), "{e}");
        let cli = Cli::try_parse_from(["pg-outbox", "relay"]).expect("relay parses without flags");
        let Command::Relay(args) = cli.command else { panic!("relay") };
        assert_eq!(args.statement_timeout, pg_outbox::ConsumerBuilder::DEFAULT_STATEMENT_TIMEOUT);
    }

    #[test]
    fn stranded_after_takes_3s_to_1h_and_defaults_to_the_librarys_and_the_take_over_is_off() {
        assert_eq!(parse_stranded_after("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_stranded_after(" 1h "), Ok(Duration::from_secs(3600)));
        for bad in ["2s", "61m", "0", "soon"] {
            let e = parse_stranded_after(bad).expect_err(bad);
            assert!(e.contains(&format!("invalid duration '{bad}'")), "{e}");
        }
        assert!(parse_stranded_after("1s").is_err_and(|e| e.contains("must be 3s to 1h")));
        let cli = Cli::try_parse_from(["pg-outbox", "relay"]).expect("relay parses without flags");
        let Command::Relay(args) = cli.command else { panic!("relay") };
        assert_eq!(args.stranded_after, pg_outbox::ConsumerBuilder::DEFAULT_STRANDED_AFTER);
        assert!(!args.take_over_stranded);
        let cli = Cli::try_parse_from(["pg-outbox", "relay", "--take-over-stranded", "--stranded-after", "30s"])
            .expect("the flags parse");
        let Command::Relay(args) = cli.command else { panic!("relay") };
        assert!(args.take_over_stranded);
        assert_eq!(args.stranded_after, Duration::from_secs(30));
    }

    #[test]
    fn reconnect_max_delay_takes_durations_and_defaults_to_the_librarys() {
        let cli = Cli::try_parse_from(["pg-outbox", "relay"]).expect("relay parses without flags");
        let Command::Relay(args) = cli.command else { panic!("relay") };
        assert_eq!(args.reconnect_max_delay, pg_outbox::ConsumerBuilder::DEFAULT_RECONNECT_MAX_DELAY);
        assert!(!args.wait_for_primary);
        let cli = Cli::try_parse_from(["pg-outbox", "relay", "--reconnect-max-delay", "2s", "--wait-for-primary"])
            .expect("relay parses");
        let Command::Relay(args) = cli.command else { panic!("relay") };
        assert_eq!(args.reconnect_max_delay, Duration::from_secs(2));
        assert!(args.wait_for_primary);
        let e = Cli::try_parse_from(["pg-outbox", "relay", "--reconnect-max-delay", "0"]).expect_err("zero");
        assert!(e.to_string().contains("must be longer than zero"), "{e}");
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
        assert_eq!(args.max_buffered_bytes.as_u64(), pg_outbox::ConsumerBuilder::DEFAULT_MAX_BUFFERED_BYTES as u64);
    }
}

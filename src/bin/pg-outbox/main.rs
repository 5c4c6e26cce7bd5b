//! `pg-outbox`: migrate, relay, publish, status and demo for the
//! PostgreSQL transactional outbox `events.outbox`.
//!
//! This file holds the command line's definition and the dispatch; each
//! command lives in `cmd/`.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::cmd::{archive, console, dead_letters, demo, migrate, publish, relay, replay, status, subscription};
use crate::error::Error;

mod cmd;
mod config;
mod db;
mod error;
mod health;
mod logging;
mod parse;
mod prometheus;
mod signals;
mod sink_args;
// The demo starts a server and reads its URL; the rest is the test kit's
// (`testkit/` includes this directory).
#[allow(dead_code)]
mod temp_server;

/// The duration parser, where the sink arguments name it.
pub(crate) use parse::parse_duration;

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
    database_url: Option<pg_outbox::DatabaseUrl>,

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
    Migrate(migrate::MigrateArgs),
    /// Deliver outbox events to a sink until SIGINT/SIGTERM.
    #[command(after_help = relay::RELAY_HELP)]
    Relay(Box<relay::RelayArgs>),
    /// Deliver already published events again to a sink (by id range, time,
    /// aggregate or event type), read-only, rate-limited and resumable.
    #[command(after_help = replay::REPLAY_HELP)]
    Replay(Box<replay::ReplayArgs>),
    /// Insert one event and print its id.
    Publish(publish::PublishArgs),
    /// Show backlog, retries, dead letters, and who leads (its pid and
    /// leadership term, or "no live leader").
    Status(status::StatusArgs),
    /// List, show, retry or discard dead letters (the default's, or a
    /// subscription's with --subscription).
    #[command(subcommand)]
    DeadLetters(dead_letters::DeadLetterCmd),
    /// Create, list, pause, resume, drop or rewind subscriptions: more
    /// readers of the outbox, each with its own progress, retries and dead
    /// letters.
    #[command(subcommand)]
    Subscription(subscription::SubscriptionCmd),
    /// Delete published events older than a cutoff (30 days by default, as docs/schema.md says), in
    /// bounded batches; never unpublished events or dead letters, nor events a subscription has not
    /// passed.
    Archive(archive::ArchiveArgs),
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

fn main() -> ExitCode {
    // One crypto provider for every rustls client of the process (the
    // sinks' brokers, the WAL source): the `wal` feature brings aws-lc-rs
    // beside ring into rustls, and then none is implied.
    let _ = rustls::crypto::ring::default_provider().install_default();
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
        signals::restore_sigpipe();
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
    if matches!(cli.command, Command::Demo(_)) && cli.database_url.is_some() {
        logging::line(
            log_format,
            "WARN",
            "pg_outbox",
            "the demo runs on a throwaway server of its own: the database URL given (--database-url or DATABASE_URL) is not used",
            &[],
        );
    }
    let url = db::database_url(&cli.database_url);
    let no_url = url.is_empty() && !matches!(cli.command, Command::Demo(_));
    // The one parse of the URL; the demo runs on a server of its own.
    let db = pg_outbox::ConnectOptions::parse(&url);
    let target = db.as_ref().ok().map(pg_outbox::ConnectOptions::describe);
    let result = rt.block_on(async move {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            command => on_database(command, db?, log_format).await,
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
                && let Some(target) = &target
            {
                message.push_str(&format!(" against {target}"));
            }
            logging::error(log_format, &message);
            if no_url
                && matches!(
                    e,
                    Error::Outbox(pg_outbox::Error::Connect { .. } | pg_outbox::Error::ConnectTimedOut { .. })
                )
            {
                logging::line(log_format, "INFO", "pg_outbox", db::NO_URL_HINT, &[]);
            }
            ExitCode::FAILURE
        }
    }
}

/// Run `command` on the database `db` names.
async fn on_database(
    command: Command,
    db: pg_outbox::ConnectOptions,
    log_format: logging::LogFormat,
) -> Result<(), Error> {
    match command {
        Command::Demo(args) => demo::run(args).await,
        Command::Migrate(args) => migrate::run(&db, args).await,
        Command::Relay(args) => relay::run(db, *args).await,
        Command::Publish(args) => publish::run(&db, args).await,
        Command::Status(args) => status::run(&db, args).await,
        Command::DeadLetters(cmd) => dead_letters::run(&db, cmd).await,
        Command::Subscription(cmd) => subscription::run(&db, cmd).await,
        Command::Archive(args) => archive::run(&db, args).await,
        Command::Replay(args) => replay::run(db, *args, log_format).await,
        Command::Console(args) => console::run(db::options(&db, console::SESSIONS), args).await,
    }
}

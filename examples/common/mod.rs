//! What every example does around its own code: logs to stderr, read
//! `DATABASE_URL`, report errors with their causes.

#![allow(dead_code)] // each example uses what it needs

use std::process::ExitCode;

/// Send `tracing` logs to stderr at `default` level (or `RUST_LOG`).
pub fn init_logs(default: &str) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .init();
}

/// `DATABASE_URL`, or exit code 2 with a hint naming how to run `example`.
pub fn database_url(example: &str) -> Result<String, ExitCode> {
    match std::env::var("DATABASE_URL").ok().filter(|u| !u.trim().is_empty()) {
        Some(url) => Ok(url),
        None => {
            eprintln!(
                "error: DATABASE_URL is not set.\n\
                 Point it at a migrated database, for example:\n  \
                 export DATABASE_URL=postgres://postgres@127.0.0.1:5432/app\n  \
                 cargo run -- migrate\n  \
                 cargo run --example {example}"
            );
            Err(ExitCode::from(2))
        }
    }
}

/// Exit code 0, or 1 after printing the error and its causes.
pub fn exit(result: Result<(), pg_outbox::Error>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", pg_outbox::error::report(&e));
            ExitCode::FAILURE
        }
    }
}

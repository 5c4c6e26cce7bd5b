//! Plumbing shared by the benchmarks: finding a server, connecting, a
//! scratch database, and where reports go.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use crate::temp_server::TempServer;
use pg_outbox::Error;
use pg_outbox::tokio_postgres::{Client, Config, NoTls};

/// Boxed error for the benchmarks' plumbing.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Result of the benchmarks' plumbing.
pub type BenchResult<T> = Result<T, BoxError>;

/// A connection to `cfg` whose driver runs on a spawned task.
pub async fn connect(cfg: &Config) -> BenchResult<Client> {
    let (client, connection) = cfg
        .connect(NoTls)
        .await
        .map_err(|source| Error::Connect { target: pg_outbox::describe_target(cfg), source })?;
    tokio::spawn(async move {
        // A connection closed by the server (DROP DATABASE ... WITH (FORCE)
        // at the end) is expected; anything else is worth a line.
        if let Err(e) = connection.await
            && !e.is_closed()
        {
            eprintln!("bench: connection ended: {e}");
        }
    });
    Ok(client)
}

/// The server to run against, and the throwaway server if one was started
/// (kept alive as long as the returned value lives): `DATABASE_URL` if set,
/// else 127.0.0.1:5432 if it answers, else a throwaway server. TLS is
/// turned off, so pg-outbox and the plain-SQL baselines (which connect
/// without TLS) are compared on equal terms.
pub async fn find_server() -> BenchResult<(Config, Option<TempServer>)> {
    let (mut cfg, server) = find_server_any().await?;
    cfg.ssl_mode(pg_outbox::tokio_postgres::config::SslMode::Disable);
    Ok((cfg, server))
}

async fn find_server_any() -> BenchResult<(Config, Option<TempServer>)> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.trim().is_empty()
    {
        eprintln!("bench: using DATABASE_URL");
        return Ok((pg_outbox::ConnectOptions::parse(&url)?.tokio_postgres_config(), None));
    }
    let local =
        pg_outbox::ConnectOptions::parse("postgres://postgres@127.0.0.1:5432/postgres")?.tokio_postgres_config();
    let mut probe = local.clone();
    probe.connect_timeout(Duration::from_secs(3));
    if let Ok(client) = connect(&probe).await
        && client.simple_query("SELECT 1").await.is_ok()
    {
        eprintln!("bench: using the server at 127.0.0.1:5432");
        return Ok((local, None));
    }
    eprintln!("bench: no server at 127.0.0.1:5432; starting a throwaway one from the local binaries");
    let server = tokio::task::spawn_blocking(TempServer::start).await??;
    Ok((pg_outbox::ConnectOptions::parse(&server.url())?.tokio_postgres_config(), Some(server)))
}

/// Drop a benchmark database, forcibly if the server supports it (13+).
pub async fn drop_database(admin: &Client, name: &str) {
    let forced = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
    if let Err(e) = forced
        && let Err(e2) = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}")).await
    {
        eprintln!("bench: could not drop database {name}: {e}; {e2}");
    }
}

/// Create (anew) a migrated database `name` next to `admin_cfg`'s and
/// return its config.
pub async fn migrated_database(admin: &Client, admin_cfg: &Config, name: &str) -> BenchResult<Config> {
    drop_database(admin, name).await;
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await?;
    let mut cfg = admin_cfg.clone();
    cfg.dbname(name);
    pg_outbox::migrate::apply(&crate::options::options_of(&cfg)).await?;
    Ok(cfg)
}

/// Where reports are written: `target/bench/`.
pub fn report_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("bench")
}

/// True when run by `cargo bench` (which passes `--bench`); false under
/// `cargo test --all-targets`, where benches run as a quick smoke pass.
pub fn is_bench_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Run `f` on a multi-threaded runtime; print errors; exit code.
pub fn main_with<F, Fut>(f: F) -> std::process::ExitCode
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = BenchResult<()>>,
{
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: cannot start the Tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(f()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench failed: {}", pg_outbox::error::report(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

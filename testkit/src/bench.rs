//! What the benchmarks share beyond the server and the databases: their
//! error type, whether `cargo bench` runs them, and their `main`.

/// Boxed error for the benchmarks' plumbing (and the kit's own).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Result of the benchmarks' plumbing.
pub type BenchResult<T> = Result<T, BoxError>;

/// True when run by `cargo bench` (which passes `--bench`); false under
/// `cargo test --all-targets`, where benches run as a quick smoke pass.
pub fn is_bench_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Run `f` on a multi-threaded runtime, with `RUST_LOG` (default `warn`)
/// logging on stderr; print an error's chain; the exit code (failure on an
/// error).
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

//! Plumbing for the end-to-end suite: connection strings for child
//! processes, scratch databases, backlog loading, the relay process (the
//! kit's, `pg_outbox_testkit::process`), and peak memory and CPU time from `/proc`.

use std::time::{Duration, Instant};

use pg_outbox::tokio_postgres::{Client, Config};

use pg_outbox_testkit::bench::BenchResult;
use pg_outbox_testkit::db::{drop_database, migrated_database};

/// How long a relay process may take to exit after SIGTERM.
const RELAY_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// Payload note length: with the envelope around it, each event's JSON is
/// about 1.5 KB.
pub const NOTE_CHARS: usize = 1408;

pub use pg_outbox_testkit::conninfo;

/// A migrated scratch database, dropped by [`Scratch::drop_now`].
pub struct Scratch {
    /// Its name.
    pub name: String,
    /// Config pointing at it.
    pub cfg: Config,
}

/// Create (anew) the migrated database `pgo_e2e_<pid>_<tag>`.
pub async fn scratch(admin: &Client, admin_cfg: &Config, tag: &str) -> BenchResult<Scratch> {
    let name = format!("pgo_e2e_{}_{tag}", std::process::id());
    let cfg = migrated_database(admin, admin_cfg, &name).await?;
    Ok(Scratch { name, cfg })
}

impl Scratch {
    /// Drop the database (forcibly: child processes may still hold sessions).
    pub async fn drop_now(self, admin: &Client) {
        drop_database(admin, &self.name).await;
    }
}

/// SQL expression of a ~1.5 KB seeded envelope for row `g` of a
/// `generate_series`.
pub fn envelope_sql() -> String {
    format!(
        "jsonb_build_object('version', 1, \
           'data', jsonb_build_object('seq', g, 'amount', g % 100000, 'currency', 'KRW', \
                                      'note', repeat(md5(g::text), {})), \
           'metadata', jsonb_build_object('causation_id', md5('cause-' || g)::uuid::text, \
                                          'correlation_id', 'req-' || g))",
        NOTE_CHARS / 32
    )
}

/// One kind of rows [`load_rows`] inserts.
#[derive(Debug, Clone, Copy)]
pub enum RowKind {
    /// Unpublished, never failed: due now.
    Fresh,
    /// Dead letters: `retry_count = 10`, `next_retry_at = 'infinity'`.
    DeadLetter,
    /// Waiting for a retry a day from now: `retry_count = 1`.
    RetryWaiting,
    /// Already published (`published_at = now()`): a steady state's rows.
    Published,
}

/// Insert `n` rows of `kind` over `aggregates` aggregates (named after
/// `agg_prefix`), fast: one `INSERT ... SELECT generate_series` with the
/// session in `session_replication_role = replica` (row triggers do not
/// fire; the order trigger's locks leave nothing behind once committed).
/// Ids come from the column default, so they are ascending in load order,
/// as the triggers would make them.
pub async fn load_rows(client: &Client, kind: RowKind, n: i64, aggregates: i64, agg_prefix: &str) -> BenchResult<()> {
    let (extra_cols, extra_vals) = match kind {
        RowKind::Fresh => ("", ""),
        RowKind::DeadLetter => {
            (", retry_count, next_retry_at, last_error", ", 10, 'infinity'::timestamptz, 'bench: dead letter'")
        }
        RowKind::RetryWaiting => {
            (", retry_count, next_retry_at, last_error", ", 1, now() + interval '1 day', 'bench: waiting for a retry'")
        }
        RowKind::Published => (", published_at", ", now()"),
    };
    let sql = format!(
        "SET session_replication_role = replica; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload{extra_cols}) \
         SELECT (ARRAY['subscription', 'invoice', 'account'])[1 + (g % {aggregates}) % 3], \
                md5('{agg_prefix}-' || (g % {aggregates}))::uuid, \
                (ARRAY['PaymentSucceeded', 'InvoiceIssued', 'AccountUpdated', 'PlanChanged'])[1 + g % 4], \
                {env}{extra_vals} \
         FROM generate_series(1, {n}::bigint) AS g; \
         RESET session_replication_role;",
        env = envelope_sql()
    );
    client.batch_execute(&sql).await.map_err(|e| {
        format!(
            "loading {n} rows failed ({}); the bench loads with session_replication_role = replica, \
             which needs a superuser (or the role's SET privilege on it)",
            pg_outbox::error::report(&e)
        )
    })?;
    Ok(())
}

/// `VACUUM ANALYZE` and `CHECKPOINT`, so each measurement starts from the
/// same state. A refused CHECKPOINT (not a superuser) is only noted.
pub async fn settle(client: &Client) -> BenchResult<()> {
    // One statement per call: VACUUM cannot run inside the implicit
    // transaction of a multi-statement query.
    client.batch_execute("VACUUM ANALYZE events.outbox").await?;
    checkpoint(client).await
}

/// `CHECKPOINT`, so that what follows starts with every page clean (only
/// noted when refused: it needs a superuser or `pg_checkpoint`).
pub async fn checkpoint(client: &Client) -> BenchResult<()> {
    if let Err(e) = client.batch_execute("CHECKPOINT").await {
        eprintln!("e2e: CHECKPOINT refused ({e}); results may be noisier");
    }
    Ok(())
}

/// Due rows not published yet (served by `outbox_fresh_order_idx`).
pub async fn fresh_unpublished(client: &Client) -> BenchResult<i64> {
    Ok(client
        .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NULL", &[])
        .await?
        .try_get(0)?)
}

/// Peak resident set size (`VmHWM`, KiB) of process `pid`, from
/// `/proc/<pid>/status` (Linux); `None` where unreadable.
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU time (microseconds) process `pid` has used: from
/// `/proc/<pid>/schedstat` (Linux, its first field, time on a CPU in
/// nanoseconds) where the kernel has it, else from `/proc/<pid>/stat`
/// (user + system, fields 14 and 15, in clock ticks of usually 10 ms);
/// `None` where unreadable (not Linux, or no such process).
pub fn cpu_us(pid: u32) -> Option<f64> {
    if let Ok(sched) = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        && let Some(ns) = sched.split_whitespace().next().and_then(|v| v.parse::<f64>().ok())
    {
        return Some(ns / 1e3);
    }
    process_cpu_us(pid)
}

/// CPU time (µs) of process `pid`, every thread of it, the exited ones
/// included: user + system from `/proc/<pid>/stat` (fields 14 and 15, in
/// clock ticks of usually 10 ms). [`cpu_us`] reads `schedstat`, which is
/// the main thread's alone: right for a PostgreSQL backend, near zero for a
/// multi-threaded broker (NATS, RabbitMQ, tansu) and short for the relay.
pub fn process_cpu_us(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3, so fields 14 and 15 are at 11 and 12.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks * 1e6 / per_second as f64)
}

/// The whole machine's CPU time so far, seconds: (busy, total) summed over
/// every CPU, from the first line of `/proc/stat` (busy: all but `idle` and
/// `iowait`); `None` where unreadable (not Linux). Everything running on
/// the machine counts, the bench's own polling included.
pub fn machine_cpu_s() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<f64> = line.split_whitespace().map(|v| v.parse::<f64>()).collect::<Result<_, _>>().ok()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let total: f64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4).copied().unwrap_or(0.0);
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ((total - idle) / per_second as f64, total / per_second as f64))
}

/// [`cpu_us`] of a PostgreSQL server process whose pid the server reported
/// (`pg_backend_pid()`, `pg_stat_activity`): `None` unless a local process of
/// that pid is named `postgres`, so a server on another machine or in a
/// container (whose pids mean other processes here) gives no figure rather
/// than a wrong one.
pub fn server_cpu_us(pid: u32) -> Option<f64> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    if comm.trim_end() != "postgres" {
        return None;
    }
    cpu_us(pid)
}

pub use pg_outbox_testkit::process::RelayProc;
use pg_outbox_testkit::process::{Output, Relay};

/// The `pg-outbox` binary the scenarios start: `PG_OUTBOX_BENCH_RELAY_BIN`
/// if set, else the one cargo built for this bench.
pub fn relay_bin() -> String {
    match std::env::var("PG_OUTBOX_BENCH_RELAY_BIN") {
        Ok(p) if !p.trim().is_empty() => p,
        _ => env!("CARGO_BIN_EXE_pg-outbox").to_string(),
    }
}

/// Start `pg-outbox relay --sink stdout <args>` ([`relay_bin`]) on `url`
/// (passed in the environment as `DATABASE_URL`) and wait until it logs
/// "relay started". Its stdout is a pipe: with `read_stdout` the caller
/// takes [`RelayProc::stdout`] and reads the lines; otherwise a task of this
/// process reads and discards them. Its stderr is kept up to the last
/// 64 KiB or so (a long run's log is not needed).
pub async fn start_relay(url: &str, args: &[&str], read_stdout: bool) -> BenchResult<RelayProc> {
    let relay = Relay::new(&relay_bin())
        .url(url)
        .args(&["--sink", "stdout"])
        .args(args)
        .stdout(if read_stdout { Output::Piped } else { Output::Drained })
        .log_cap(64 * 1024);
    Ok(relay.start().await?)
}

/// Stop a relay: SIGTERM, then a clean exit within 30 s (killed after that).
pub async fn stop_relay(mut relay: RelayProc) -> BenchResult<()> {
    Ok(relay.terminate(RELAY_STOP_TIMEOUT).await?)
}

/// Wait until `check` returns true, polling every `every`, for at most
/// `limit`. Returns whether it did.
pub async fn wait_until<F, Fut>(limit: Duration, every: Duration, mut check: F) -> BenchResult<bool>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = BenchResult<bool>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(every).await;
    }
}

/// Turn autovacuum off on `events.outbox` and its TOAST table, so only the
/// scenario decides when the table is vacuumed or analysed.
pub async fn autovacuum_off(client: &Client) -> BenchResult<()> {
    client
        .batch_execute("ALTER TABLE events.outbox SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)")
        .await?;
    Ok(())
}

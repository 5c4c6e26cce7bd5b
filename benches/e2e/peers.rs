//! Scenario `peers` (only when named, and tiny in the smoke pass):
//! graphile-worker (npm package `graphile-worker`, a LISTEN/NOTIFY job queue
//! for PostgreSQL on Node.js) against the same server in the same run,
//! beside pg-outbox:
//! - drain: a backlog of jobs run by a no-op task, in graphile-worker's
//!   default configuration and in its documented high-throughput one,
//!   beside the relay (`--sink stdout` into a pipe) and the `Consumer`
//!   (batch 500) on a backlog of as many events; every backlog settled
//!   (`VACUUM ANALYZE`, `CHECKPOINT`) before its drainer starts;
//! - latency: `add_job` sent -> task started at paced rates (the `latency`
//!   scenario's producers), beside commit sent -> event received for the
//!   `EventStream` and the relay.
//!
//! The pinned version is 0.17.3: the latest release whose declared engines
//! (`node >= 14`) include the Node.js 20 this suite runs on; 0.18.0 declares
//! `node >= 22.18.0`.
//!
//! It needs `node` and `npm` on the `PATH`; without either it is skipped
//! with a note. The first run installs the pinned graphile-worker
//! (`peers/package.json` and `peers/package-lock.json`, with `npm ci`) and
//! the worker script (`peers/worker.js`) into
//! `target/pg-outbox-bench/peers/graphile-worker-<version>-<hash>/`, which
//! later runs reuse. Every graphile-worker run gets its own scratch
//! database, dropped afterwards; its Node.js process is killed when the
//! bench drops it (a failure) and stops when its stdin closes.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use pg_outbox::tokio_postgres::config::Host;
use pg_outbox::tokio_postgres::{Client, Config};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::drain::{DrainOutcome, Drainer, Job, drain_in_child};
use crate::latency::{self, GRACE, PRODUCERS, Probe, Produce, Subject};
use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::util::{self, RowKind, scratch, vm_hwm_kib};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;

/// The scenario's npm project: the pinned graphile-worker.
const PACKAGE_JSON: &str = include_str!("peers/package.json");
/// Its lock file (`npm ci` installs exactly this).
const PACKAGE_LOCK: &str = include_str!("peers/package-lock.json");
/// The worker script: graphile-worker run against a scratch database.
const WORKER_JS: &str = include_str!("peers/worker.js");
/// The npm package measured.
const PACKAGE: &str = "graphile-worker";
/// Goal: the Consumer drains at least this many times the tuned peer's rate.
const DRAIN_GOAL: f64 = 1.5;
/// Goal: the relay (which also writes every event out) drains at least this
/// many times the tuned peer's rate.
const RELAY_DRAIN_GOAL: f64 = 1.2;
/// Goal: pg-outbox's p50 latency is at most this share of the peer's.
const LATENCY_GOAL: f64 = 0.5;
/// Jobs per `add_jobs` call when loading the peer's backlog.
const LOAD_CHUNK: i64 = 10_000;
/// Liveness bound for a Node.js step that should be quick: start, install
/// the schema, stop (graphile-worker's own graceful shutdown waits up to
/// 5 s before it aborts).
const NODE_STEP: Duration = Duration::from_secs(60);
/// Stderr kept from a Node.js process for error messages, bytes.
const STDERR_CAP: usize = 64 * 1024;

/// A graphile-worker configuration the scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PeerConfig {
    /// graphile-worker's defaults: `concurrentJobs` 1, `maxPoolSize` 10, no
    /// local queue, completions not batched.
    Default,
    /// The configuration of the "Quick stats" on
    /// <https://worker.graphile.org/docs/performance>: `concurrentJobs` 24,
    /// `maxPoolSize` 25, `localQueue.size` 500, `completeJobBatchDelay` 0,
    /// `failJobBatchDelay` 0 (see `peers/worker.js`).
    Tuned,
}

impl PeerConfig {
    /// Both, the default first.
    const ALL: [PeerConfig; 2] = [PeerConfig::Default, PeerConfig::Tuned];

    /// The worker script's argument.
    fn arg(self) -> &'static str {
        match self {
            PeerConfig::Default => "default",
            PeerConfig::Tuned => "tuned",
        }
    }

    /// Name used in the table.
    fn name(self) -> &'static str {
        match self {
            PeerConfig::Default => "graphile-worker, default config",
            PeerConfig::Tuned => "graphile-worker, tuned config",
        }
    }
}

/// A usable install of the pinned graphile-worker.
struct Install {
    /// The folder holding `worker.js` and `node_modules`.
    dir: PathBuf,
    /// graphile-worker's version, as installed.
    version: String,
    /// `node --version`.
    node: String,
}

/// `<program> --version`, or `None` when the program is not on the `PATH`.
async fn tool_version(program: &str) -> BenchResult<Option<String>> {
    let out = Command::new(program).arg("--version").stdin(Stdio::null()).output().await;
    match out {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("could not run `{program} --version`: {e}").into()),
        Ok(out) if !out.status.success() => Err(format!(
            "`{program} --version` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into()),
        Ok(out) => Ok(Some(String::from_utf8_lossy(&out.stdout).trim().to_string())),
    }
}

/// The version `peers/package.json` pins.
fn pinned_version() -> BenchResult<String> {
    let manifest: serde_json::Value = serde_json::from_str(PACKAGE_JSON)?;
    manifest["dependencies"][PACKAGE]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("peers/package.json pins no `{PACKAGE}` dependency").into())
}

/// The `version` field of an installed package's `package.json`.
fn installed_version(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("node_modules").join(PACKAGE).join("package.json")).ok()?;
    let manifest: serde_json::Value = serde_json::from_str(&text).ok()?;
    manifest["version"].as_str().map(str::to_string)
}

/// Install the pinned graphile-worker and the worker script under
/// `out/peers/` (with `npm ci`, into a staging folder renamed into place
/// once complete, so an interrupted install is never reused), or reuse the
/// install a run before made from the same three files. A new install
/// removes the installs of other files beside it.
async fn install(out: &Path, node: String) -> BenchResult<Install> {
    let pinned = pinned_version()?;
    let digest = Sha256::digest([PACKAGE_JSON, PACKAGE_LOCK, WORKER_JS].concat().as_bytes());
    let key: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    let root = out.join("peers");
    let dir = root.join(format!("{PACKAGE}-{pinned}-{key}"));
    if installed_version(&dir).is_none() {
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&root)?;
        let stage = tempfile::Builder::new().prefix(".install-").tempdir_in(&root)?;
        std::fs::write(stage.path().join("package.json"), PACKAGE_JSON)?;
        std::fs::write(stage.path().join("package-lock.json"), PACKAGE_LOCK)?;
        std::fs::write(stage.path().join("worker.js"), WORKER_JS)?;
        eprintln!("e2e: peers: installing {PACKAGE} {pinned} with `npm ci` into {}", dir.display());
        let started = Instant::now();
        let npm = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--ignore-scripts"])
            .current_dir(stage.path())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| format!("could not run `npm ci`: {e}"))?;
        if !npm.status.success() {
            return Err(format!(
                "`npm ci` of {PACKAGE} {pinned} in {} failed ({}): {}",
                stage.path().display(),
                npm.status,
                tail(&String::from_utf8_lossy(&npm.stderr), 4000)
            )
            .into());
        }
        let staged = stage.keep();
        if let Err(e) = std::fs::rename(&staged, &dir) {
            let _ = std::fs::remove_dir_all(&staged);
            // Another run may have installed the same files meanwhile.
            if installed_version(&dir).is_none() {
                return Err(format!("could not move the install into {}: {e}", dir.display()).into());
            }
        }
        eprintln!("e2e: peers: installed in {:.1} s", started.elapsed().as_secs_f64());
        // Installs of other files (an older worker script or version) are
        // not used again.
        for entry in std::fs::read_dir(&root)?.flatten() {
            let path = entry.path();
            if path != dir && entry.file_name().to_string_lossy().starts_with(&format!("{PACKAGE}-")) {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }
    let version = installed_version(&dir).ok_or_else(|| format!("{} holds no {PACKAGE}", dir.display()))?;
    if version != pinned {
        return Err(format!("{} holds {PACKAGE} {version}, not the pinned {pinned}", dir.display()).into());
    }
    Ok(Install { dir, version, node })
}

/// The last `max` bytes of `text` (at a character boundary).
fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].trim()
}

/// Microseconds since the Unix epoch, by the wall clock.
fn wall_us() -> BenchResult<u64> {
    Ok(u64::try_from(SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?.as_micros())?)
}

/// Point `cmd` at the database `cfg` through libpq's variables, which
/// node-postgres reads (the first host only), without TLS, as every other
/// client of the suite connects.
fn pg_env(cmd: &mut Command, cfg: &Config) -> BenchResult<()> {
    let host = match cfg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => return Err("the server's config names no host".into()),
    };
    cmd.env("PGHOST", host).env("PGSSLMODE", "disable");
    if let Some(port) = cfg.get_ports().first() {
        cmd.env("PGPORT", port.to_string());
    }
    if let Some(user) = cfg.get_user() {
        cmd.env("PGUSER", user);
    }
    if let Some(password) = cfg.get_password() {
        cmd.env("PGPASSWORD", String::from_utf8_lossy(password).into_owned());
    }
    let db = cfg.get_dbname().ok_or("the scratch database's config names no database")?;
    cmd.env("PGDATABASE", db);
    Ok(())
}

/// A running `node worker.js ...`: stdout read line by line, stderr kept
/// (its last 64 KiB) for error messages, killed when dropped.
struct NodeProc {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Option<Lines<BufReader<ChildStdout>>>,
    stderr: Arc<Mutex<String>>,
    what: String,
}

impl NodeProc {
    /// Start the worker script with `args` on the database `cfg`.
    fn spawn(install: &Install, cfg: &Config, args: &[&str]) -> BenchResult<NodeProc> {
        let mut cmd = Command::new("node");
        cmd.arg(install.dir.join("worker.js")).args(args).current_dir(&install.dir);
        // No DATABASE_URL (graphile-worker would prefer it) and no stray PG*.
        pg_outbox_testkit::process::clean_env(&mut cmd);
        cmd.env_remove("GRAPHILE_WORKER_SCHEMA");
        pg_env(&mut cmd, cfg)?;
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let what = format!("node worker.js {}", args.join(" "));
        let mut child = cmd.spawn().map_err(|e| format!("could not start `{what}`: {e}"))?;
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut err) = child.stderr.take() {
            let keep = stderr.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = err.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let mut kept = keep.lock().unwrap_or_else(PoisonError::into_inner);
                    kept.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if kept.len() > 2 * STDERR_CAP {
                        let cut = tail(&kept, STDERR_CAP).to_string();
                        *kept = cut;
                    }
                }
            });
        }
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().map(|o| BufReader::new(o).lines());
        Ok(NodeProc { child, stdin, stdout, stderr, what })
    }

    /// The process id, while it runs.
    fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// An error naming the process, `problem`, its exit status (if it exits
    /// within a second) and its stderr.
    async fn failure(&mut self, problem: &str) -> BoxError {
        let status = match tokio::time::timeout(Duration::from_secs(1), self.child.wait()).await {
            Ok(Ok(s)) => s.to_string(),
            _ => "still running".into(),
        };
        let err = self.stderr.lock().unwrap_or_else(PoisonError::into_inner).clone();
        format!("`{}` {problem} ({status}); its stderr: {}", self.what, tail(&err, 4000)).into()
    }

    /// Read lines until one starts with `prefix`; `None` when `deadline`
    /// passes first. Other lines are skipped.
    async fn wait_for(&mut self, prefix: &str, deadline: Instant) -> BenchResult<Option<String>> {
        loop {
            let lines = self.stdout.as_mut().ok_or("the worker's stdout is taken")?;
            match tokio::time::timeout_at(deadline.into(), lines.next_line()).await {
                Err(_) => return Ok(None),
                Ok(Ok(Some(line))) if line.starts_with(prefix) => return Ok(Some(line)),
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => return Err(self.failure(&format!("ended before printing `{prefix}`")).await),
                Ok(Err(e)) => return Err(format!("reading `{}`'s stdout: {e}", self.what).into()),
            }
        }
    }

    /// [`NodeProc::wait_for`] within [`NODE_STEP`], an error when it does not come.
    async fn expect(&mut self, prefix: &str) -> BenchResult<String> {
        match self.wait_for(prefix, Instant::now() + NODE_STEP).await? {
            Some(line) => Ok(line),
            None => Err(self.failure(&format!("printed no `{prefix}` within {} s", NODE_STEP.as_secs())).await),
        }
    }

    /// Close its stdin (the script stops the worker gracefully and exits)
    /// and wait for a clean exit; killed after [`NODE_STEP`].
    async fn stop(mut self) -> BenchResult<()> {
        drop(self.stdin.take());
        match tokio::time::timeout(NODE_STEP, self.child.wait()).await {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(_)) => Err(self.failure("failed").await),
            Ok(Err(e)) => Err(format!("waiting for `{}`: {e}", self.what).into()),
            Err(_) => {
                let _ = self.child.kill().await;
                Err(self.failure(&format!("did not stop within {} s of its stdin closing", NODE_STEP.as_secs())).await)
            }
        }
    }
}

/// Install graphile-worker's schema in the database `cfg` (its
/// `runMigrations`).
async fn migrate_peer(install: &Install, cfg: &Config) -> BenchResult<()> {
    let mut node = NodeProc::spawn(install, cfg, &["migrate"])?;
    node.expect("migrated").await?;
    node.stop().await
}

/// Add `n` jobs for the task `noop`, each with the drain scenario's ~1.5 KB
/// envelope as payload, through `graphile_worker.add_jobs` (the bulk form of
/// `add_job`), [`LOAD_CHUNK`] per call.
async fn load_jobs(client: &Client, n: i64) -> BenchResult<()> {
    let sql = format!(
        "SELECT count(*) FROM graphile_worker.add_jobs(ARRAY(\
           SELECT ROW('noop', ({env})::json, NULL, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec \
           FROM generate_series($1::bigint, $2::bigint) AS g))",
        env = util::envelope_sql()
    );
    let stmt = client.prepare(&sql).await?;
    let mut from = 1;
    while from <= n {
        let to = (from + LOAD_CHUNK - 1).min(n);
        let added: i64 = client.query_one(&stmt, &[&from, &to]).await?.try_get(0)?;
        if added != to - from + 1 {
            return Err(format!("graphile_worker.add_jobs added {added} jobs, not {}", to - from + 1).into());
        }
        from = to + 1;
    }
    Ok(())
}

/// Jobs still in graphile-worker's table (it deletes a job once completed).
async fn jobs_left(client: &Client) -> BenchResult<i64> {
    Ok(client.query_one("SELECT count(*) FROM graphile_worker._private_jobs", &[]).await?.try_get(0)?)
}

/// Whether any job is left: the first by primary key, so each poll reads
/// the index (whose entries of deleted jobs are soon marked dead) and not
/// the whole table.
async fn any_job_left(client: &Client) -> BenchResult<bool> {
    Ok(client.query_opt("SELECT id FROM graphile_worker._private_jobs ORDER BY id LIMIT 1", &[]).await?.is_some())
}

/// `VACUUM ANALYZE` the whole database (graphile-worker's tables), then
/// `CHECKPOINT` (only noted when refused), as [`util::settle`] does for
/// `events.outbox`.
async fn settle_peer(client: &Client) -> BenchResult<()> {
    client.batch_execute("VACUUM ANALYZE").await?;
    util::checkpoint(client).await
}

/// Drain a settled backlog of `n` jobs with graphile-worker in `config`, in
/// a scratch database dropped afterwards.
async fn drain_peer(ctx: &Ctx, install: &Install, config: PeerConfig, n: i64) -> BenchResult<DrainOutcome> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "peers").await?;
    let result = drain_peer_in(&db.cfg, install, config, n, ctx.settings.drain_max_secs).await;
    db.drop_now(&ctx.admin).await;
    result
}

async fn drain_peer_in(
    cfg: &Config,
    install: &Install,
    config: PeerConfig,
    n: i64,
    max_secs: f64,
) -> BenchResult<DrainOutcome> {
    migrate_peer(install, cfg).await?;
    let client = connect(cfg).await?;
    load_jobs(&client, n).await?;
    settle_peer(&client).await?;
    let mut node = NodeProc::spawn(install, cfg, &["drain", config.arg(), &n.to_string()])?;
    node.expect("starting").await?;
    // The clock starts when the script calls graphile-worker's run(), after
    // Node.js has loaded the modules.
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(max_secs);
    let mut capped = node.wait_for(&format!("ran {n}"), deadline).await?.is_none();
    // The task has started n times; the last completions may still be
    // on their way (batched in the tuned config).
    while !capped && any_job_left(&client).await? {
        if Instant::now() >= deadline {
            capped = true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let hwm = node.pid().and_then(vm_hwm_kib);
    let events = if capped { n - jobs_left(&client).await? } else { n };
    node.stop().await?;
    Ok(DrainOutcome {
        events: u64::try_from(events)?,
        seconds,
        capped,
        vm_hwm_kib: hwm,
        machine_busy_s: None,
        machine_wall_s: None,
    })
}

/// Drain a settled backlog of `n` events with `drainer` (the drain
/// scenario's child process or relay), in a scratch database dropped
/// afterwards.
async fn drain_outbox(ctx: &Ctx, drainer: Drainer, n: i64) -> BenchResult<DrainOutcome> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "peers").await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        util::load_rows(&client, RowKind::Fresh, n, 10_000, "agg").await?;
        util::settle(&client).await?;
        drop(client);
        let job = Job { drainer, limit: u64::try_from(n)?, max_secs: ctx.settings.drain_max_secs };
        drain_in_child(&db.cfg, &job).await
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// One drainer's result.
#[derive(Debug, Clone, Serialize)]
struct DrainRow {
    /// Name in the table.
    subject: String,
    /// Backlog size.
    backlog: i64,
    /// What it achieved.
    outcome: DrainOutcome,
}

/// Where a latency is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
enum Point {
    /// graphile-worker's task function entered (wall clock, the bench's and
    /// Node.js's).
    TaskStart,
    /// The line the task printed read by the bench from the worker's stdout
    /// (the bench's monotonic clock), the point the relay is measured at.
    PeerLineRead,
    /// An `EventStream` delivery in the bench process.
    Delivery,
    /// The relay's stdout line read by the bench.
    RelayLineRead,
}

/// One latency measurement.
#[derive(Debug, Clone, Serialize)]
struct LatencyRow {
    /// Name in the table.
    subject: String,
    /// graphile-worker's configuration, for its rows.
    config: Option<PeerConfig>,
    /// Where the latency is taken.
    point: Point,
    /// Target rate, events/s.
    rate: u64,
    /// Seconds of sending.
    seconds: f64,
    /// Jobs or events committed.
    sent: u64,
    /// Received within the grace after sending.
    received: u64,
    /// Sends that waited for a free producer connection.
    behind: u64,
    /// p50, p90, p99, p99.9 and max, milliseconds.
    percentiles_ms: [f64; 5],
    /// graphile-worker runs: the bench's wall clock minus Node.js's, read
    /// as the worker's `ready` line arrived, microseconds (a few hundred
    /// at most, never below 0, when the two agree).
    clock_offset_us: Option<i64>,
    /// graphile-worker task-start rows: tasks that started before their
    /// job was sent by the wall clock (a clock disagreement; counted as
    /// 1 µs).
    clock_anomalies: Option<u64>,
}

impl LatencyRow {
    fn achieved(&self) -> f64 {
        if self.seconds > 0.0 { self.sent as f64 / self.seconds } else { 0.0 }
    }
}

/// graphile-worker's latency in `config` at `rate` for `secs`, in a scratch
/// database dropped afterwards: the task-start and line-read rows.
async fn latency_peer(
    ctx: &Ctx,
    install: &Install,
    config: PeerConfig,
    rate: u64,
    secs: f64,
) -> BenchResult<[LatencyRow; 2]> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "peers").await?;
    let result = latency_peer_in(&db.cfg, install, config, rate, secs).await;
    db.drop_now(&ctx.admin).await;
    result
}

async fn latency_peer_in(
    cfg: &Config,
    install: &Install,
    config: PeerConfig,
    rate: u64,
    secs: f64,
) -> BenchResult<[LatencyRow; 2]> {
    migrate_peer(install, cfg).await?;
    let mut node = NodeProc::spawn(install, cfg, &["latency", config.arg()])?;
    let ready = node.expect("ready").await?;
    let node_wall: u64 = ready
        .strip_prefix("ready ")
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("the worker printed {ready:?}, expected `ready <microseconds>`"))?;
    let clock_offset_us = i64::try_from(wall_us()?)? - i64::try_from(node_wall)?;
    let line = Arc::new(Probe::new()?);
    let start = Arc::new(Probe::new()?);
    let anomalies = Arc::new(AtomicU64::new(0));
    let mut lines = node.stdout.take().ok_or("the worker's stdout is taken")?;
    let reader = {
        let (line, start, anomalies) = (line.clone(), start.clone(), anomalies.clone());
        tokio::spawn(async move {
            while let Some(l) = lines.next_line().await? {
                let fields: Vec<u64> = l.split(' ').filter_map(|f| f.parse().ok()).collect();
                let &[t, w, at] = fields.as_slice() else {
                    return Err(format!("the worker printed {l:?}, expected `<t> <w> <start>`").into());
                };
                line.record(t);
                if at < w {
                    anomalies.fetch_add(1, Ordering::SeqCst);
                }
                start.record_latency(at.saturating_sub(w));
            }
            Ok::<_, BoxError>(())
        })
    };
    let (sent, behind, seconds) = match latency::produce(cfg, Produce::AddJob, rate, secs, &line).await {
        Ok(p) => p,
        Err(e) => {
            reader.abort();
            return Err(e);
        }
    };
    let deadline = Instant::now() + GRACE;
    while line.received() < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    node.stop().await?;
    reader.await??;
    let row = |point: Point, probe: &Probe, label: &str| LatencyRow {
        subject: format!("{}: {label}", config.name()),
        config: Some(config),
        point,
        rate,
        seconds,
        sent,
        received: probe.received(),
        behind,
        percentiles_ms: probe.percentiles_ms(),
        clock_offset_us: Some(clock_offset_us),
        clock_anomalies: (point == Point::TaskStart).then(|| anomalies.load(Ordering::SeqCst)),
    };
    Ok([row(Point::TaskStart, &start, "task start"), row(Point::PeerLineRead, &line, "stdout line read")])
}

/// pg-outbox's latency (`latency::measure`) for `subject` at `rate`, in a
/// scratch database dropped afterwards.
async fn latency_outbox(ctx: &Ctx, subject: Subject, rate: u64, secs: f64) -> BenchResult<LatencyRow> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "peers").await?;
    let run = latency::measure(&db.cfg, subject, rate, secs).await;
    db.drop_now(&ctx.admin).await;
    let run = run?;
    let (subject, point) = match subject {
        Subject::Relay => ("pg-outbox relay --sink stdout: line read", Point::RelayLineRead),
        _ => ("pg-outbox EventStream: delivery", Point::Delivery),
    };
    Ok(LatencyRow {
        subject: subject.into(),
        config: None,
        point,
        rate: run.rate,
        seconds: run.seconds,
        sent: run.sent,
        received: run.received,
        behind: run.behind,
        percentiles_ms: run.percentiles_ms,
        clock_offset_us: None,
        clock_anomalies: None,
    })
}

/// Run the scenario: skipped (a section saying why) without `node` or `npm`.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let node = tool_version("node").await?;
    let npm = tool_version("npm").await?;
    let node = match (node, npm) {
        (Some(node), Some(_)) => node,
        (node, npm) => {
            let missing: Vec<&str> = [("node", node.is_none()), ("npm", npm.is_none())]
                .into_iter()
                .filter_map(|(name, gone)| gone.then_some(name))
                .collect();
            let msg = format!(
                "Skipped: `{}` not found on the PATH; install Node.js and npm to run graphile-worker beside \
                 pg-outbox.",
                missing.join("` and `")
            );
            eprintln!("e2e: peers: {msg}");
            let mut sec =
                Section::new("peers", "Peers: graphile-worker beside pg-outbox (skipped)", &["scenario", "status"]);
            sec.rows.push(vec!["peers".into(), format!("skipped: `{}` not found", missing.join("` and `"))]);
            sec.notes.push(msg);
            return Ok(sec);
        }
    };
    let install = install(&crate::out_dir(), node).await?;
    eprintln!("e2e: peers: {PACKAGE} {} on Node.js {}", install.version, install.node);

    let n = s.peers_jobs;
    let mut drains = Vec::new();
    for config in PeerConfig::ALL {
        let outcome = drain_peer(ctx, &install, config, n).await?;
        log_drain(config.name(), &outcome);
        drains.push(DrainRow { subject: config.name().into(), backlog: n, outcome });
    }
    for drainer in [Drainer::Relay, Drainer::Consumer(500)] {
        let outcome = drain_outbox(ctx, drainer, n).await?;
        let subject = format!("pg-outbox {}", drainer.name());
        log_drain(&subject, &outcome);
        drains.push(DrainRow { subject, backlog: n, outcome });
    }

    let mut lat = Vec::new();
    for &rate in &s.peers_rates {
        for config in PeerConfig::ALL {
            for row in latency_peer(ctx, &install, config, rate, s.peers_latency_secs).await? {
                log_latency(&row);
                lat.push(row);
            }
        }
        for subject in [Subject::Stream, Subject::Relay] {
            let row = latency_outbox(ctx, subject, rate, s.peers_latency_secs).await?;
            log_latency(&row);
            lat.push(row);
        }
    }
    Ok(report(s, &install, &drains, &lat))
}

fn log_drain(subject: &str, o: &DrainOutcome) {
    eprintln!(
        "e2e: peers: drain {subject:<45} {} in {:.1} s = {}/s, peak RSS {} KiB{}",
        o.events,
        o.seconds,
        fmt_count(o.rate()),
        o.vm_hwm_kib.map(|k| k.to_string()).unwrap_or_else(|| "?".into()),
        if o.capped { " (capped)" } else { "" }
    );
}

fn log_latency(r: &LatencyRow) {
    eprintln!(
        "e2e: peers: latency {:<55} {:>5}/s: sent {} received {} p50 {:.2} ms p99 {:.2} ms max {:.1} ms",
        r.subject, r.rate, r.sent, r.received, r.percentiles_ms[0], r.percentiles_ms[2], r.percentiles_ms[4]
    );
}

/// The lowest p50 of graphile-worker's configurations at `rate`, taken at
/// `point`.
fn best_peer_p50(lat: &[LatencyRow], rate: u64, point: Point) -> Option<f64> {
    lat.iter()
        .filter(|r| r.rate == rate && r.point == point && r.received > 0)
        .map(|r| r.percentiles_ms[0])
        .min_by(f64::total_cmp)
}

/// The section: drains against the tuned peer, latencies against the
/// peer's best p50 taken at the same kind of point.
fn report(s: &Settings, install: &Install, drains: &[DrainRow], lat: &[LatencyRow]) -> Section {
    let mut sec = Section::new(
        "peers",
        &format!("Peers: graphile-worker {} beside pg-outbox, same server, same run", install.version),
        &[
            "measure",
            "subject",
            "rate/s",
            "events",
            "lost",
            "seconds",
            "events/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "vs graphile-worker",
            "peak RSS MiB",
        ],
    );
    let tuned = drains.iter().find(|d| d.subject == PeerConfig::Tuned.name()).map(|d| d.outcome.rate()).unwrap_or(0.0);
    for d in drains {
        let o = &d.outcome;
        let r = ratio(o.rate(), tuned);
        sec.rows.push(vec![
            format!("drain {} (settled)", fmt_count(d.backlog as f64)),
            if o.capped { format!("{} (capped)", d.subject) } else { d.subject.clone() },
            String::new(),
            fmt_count(o.events as f64),
            String::new(),
            format!("{:.1}", o.seconds),
            fmt_count(o.rate()),
            String::new(),
            String::new(),
            String::new(),
            fmt_ratio(r),
            o.vm_hwm_kib.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "?".into()),
        ]);
        if d.subject.starts_with("pg-outbox") {
            let goal = if d.subject.contains("relay") { RELAY_DRAIN_GOAL } else { DRAIN_GOAL };
            sec.target(format!("{} drains >= {goal}x the tuned graphile-worker", d.subject), r, goal, false);
        }
    }
    for r in lat {
        let reference = match r.point {
            Point::TaskStart | Point::Delivery => best_peer_p50(lat, r.rate, Point::TaskStart),
            Point::PeerLineRead | Point::RelayLineRead => best_peer_p50(lat, r.rate, Point::PeerLineRead),
        };
        let vs = reference.and_then(|p| ratio(r.percentiles_ms[0], p));
        let p = &r.percentiles_ms;
        sec.rows.push(vec![
            "latency".into(),
            r.subject.clone(),
            fmt_count(r.rate as f64),
            fmt_count(r.sent as f64),
            fmt_count(r.sent.saturating_sub(r.received) as f64),
            format!("{:.1}", r.seconds),
            fmt_count(r.achieved()),
            fmt_ms(p[0]),
            fmt_ms(p[2]),
            fmt_ms(p[4]),
            fmt_ratio(vs),
            String::new(),
        ]);
        match r.point {
            Point::Delivery => sec.target(
                format!(
                    "EventStream p50 <= {LATENCY_GOAL}x graphile-worker's (task start, best config) at {}/s",
                    r.rate
                ),
                vs,
                LATENCY_GOAL,
                true,
            ),
            Point::RelayLineRead => sec.target(
                format!(
                    "relay p50 <= {LATENCY_GOAL}x graphile-worker's (stdout line read, best config) at {}/s",
                    r.rate
                ),
                vs,
                LATENCY_GOAL,
                true,
            ),
            _ => {}
        }
    }
    sec.notes.push(format!(
        "Peer: {PACKAGE} {} (npm, pinned in benches/e2e/peers/package.json and its lock file, installed with \
         `npm ci`) on Node.js {}, running benches/e2e/peers/worker.js. Default config: graphile-worker's defaults \
         (concurrentJobs 1, maxPoolSize 10, no local queue, completions not batched). Tuned config: the \
         high-throughput configuration of https://worker.graphile.org/docs/performance (concurrentJobs 24, \
         maxPoolSize 25, localQueue.size 500, completeJobBatchDelay 0, failJobBatchDelay 0).",
        install.version, install.node
    ));
    sec.notes.push(format!(
        "Drain: {n} jobs for a no-op task, each with the drain scenario's ~1.5 KB JSON envelope as payload \
         (graphile_worker.add_jobs, {chunk} per call, after graphile-worker's runMigrations), and {n} events of the \
         same envelopes for pg-outbox; each backlog in its own scratch database, settled (VACUUM ANALYZE, \
         CHECKPOINT) before its drainer starts. Time: graphile-worker from the moment the script calls run() \
         (Node.js start-up and module loading excluded, which favours the peer) until its jobs table is empty (it \
         deletes a job once completed); the relay from its spawn, the Consumer from its start in a child process, \
         until no due event is left (as in the drain scenario). Ratios are against the tuned graphile-worker; peak \
         RSS is each drainer process's VmHWM. Time cap {cap:.0} s per drainer.",
        n = fmt_count(s.peers_jobs as f64),
        chunk = fmt_count(LOAD_CHUNK as f64),
        cap = s.drain_max_secs,
    ));
    let offsets: Vec<i64> =
        lat.iter().filter(|r| r.point == Point::TaskStart).filter_map(|r| r.clock_offset_us).collect();
    let anomalies: u64 = lat.iter().filter_map(|r| r.clock_anomalies).sum();
    sec.notes.push(format!(
        "Latency: the latency scenario's producers ({PRODUCERS} connections, open-loop schedule, ~0.3 KB JSON \
         payload, autocommitted statements) sending `SELECT graphile_worker.add_job('probe', $1)` or the \
         pg-outbox INSERT, {:.0} s per run, each run in a fresh database. graphile-worker *task start* = the \
         bench's wall clock (SystemTime) just before it sends add_job -> the task function entered, by Node.js's \
         wall clock (performance.timeOrigin + performance.now()), the same system clock on one machine; \
         *stdout line read* = the bench's monotonic clock from the same send to reading the line the task printed \
         on entry. pg-outbox: EventStream = commit sent -> delivery in the bench process; relay = commit sent -> \
         its stdout line read by the bench. The EventStream is compared with the peer's task start, the relay \
         with the peer's line read, each against the lower p50 of the peer's two configs at that rate. Clock \
         check: the bench's wall clock minus Node.js's as the worker's ready line arrived: {} µs; tasks that \
         started before their job was sent by the wall clock: {anomalies}.",
        s.peers_latency_secs,
        offsets.iter().map(|o| o.to_string()).collect::<Vec<_>>().join(", ")
    ));
    sec.notes.push(format!(
        "\"lost\" = not received within {} s after sending stopped; \"events/s\" below the rate means the \
         producers could not hold it ({} sends waited for a free producer connection).",
        GRACE.as_secs(),
        fmt_count(lat.iter().map(|r| r.behind).sum::<u64>() as f64)
    ));
    let short: Vec<String> = lat
        .iter()
        .filter(|r| r.point != Point::PeerLineRead && r.achieved() < 0.95 * r.rate as f64)
        .map(|r| format!("{} at {}/s (achieved {}/s)", r.subject, fmt_count(r.rate as f64), fmt_count(r.achieved())))
        .collect();
    if !short.is_empty() {
        sec.notes.push(format!(
            "Producers could not hold the rate for: {}. Those runs measured a lower load than their rate says, \
             and ratios against them compare unequal loads.",
            short.join("; ")
        ));
    }
    sec.data = serde_json::json!({
        "graphile_worker_version": install.version,
        "node_version": install.node,
        "drain": drains,
        "latency": lat,
    });
    sec
}

//! Scenario `drain`: drain a pre-loaded backlog to a no-op sink and
//! report events/s and the drainer's peak RSS. Each drainer runs as a child
//! process (this bench binary in `--child-drain` mode, or the relay), so the
//! bench's own memory does not count.

use std::hint::black_box;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::tokio_postgres::{Client, Config, Row};
use pg_outbox::{Consumer, Event};
use serde::{Deserialize, Serialize};

use crate::common::{BenchResult, connect, drop_database};
use crate::report::{Section, fmt_count, fmt_ratio, ratio};
use crate::util::{self, RelayProc, RowKind, conninfo, scratch, vm_hwm_kib};
use crate::{Ctx, Settings};

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
/// Is any due row still unpublished?
const ANY_DUE: &str =
    "SELECT EXISTS (SELECT 1 FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NULL)";

/// Environment variables passing a drain job to the child.
const ENV_URL: &str = "PG_OUTBOX_BENCH_CHILD_URL";
const ENV_JOB: &str = "PG_OUTBOX_BENCH_CHILD_JOB";
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
}

impl Drainer {
    /// Name used in the table.
    pub fn name(self) -> String {
        match self {
            Drainer::Seed => "seed poller (fetch 50, UPDATE per row)".into(),
            Drainer::Plain => "plain-SQL loop (fetch 500, one UPDATE)".into(),
            Drainer::Consumer(b) => format!("Consumer (batch {b})"),
            Drainer::Relay => "relay --sink stdout, piped".into(),
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
}

impl DrainOutcome {
    /// Events per second.
    pub fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.events as f64 / self.seconds } else { 0.0 }
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
    let cfg = pg_outbox::parse_url(&url)?;
    let mut outcome = drain_here(&cfg, &job).await?;
    outcome.vm_hwm_kib = vm_hwm_kib(std::process::id());
    println!("{}", serde_json::to_string(&outcome)?);
    Ok(())
}

/// Drain in this process.
async fn drain_here(cfg: &Config, job: &Job) -> BenchResult<DrainOutcome> {
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
                let rows = client.query(&fetch, &[]).await?;
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
            let mut stream = Consumer::builder(cfg.clone()).batch_size(batch).start().await?;
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
            stream.finish().await?;
            return Ok(DrainOutcome { events: done, seconds, capped, vm_hwm_kib: None });
        }
        Drainer::Relay => return Err("the relay drainer runs as its own process".into()),
    }
    Ok(DrainOutcome { events: done, seconds: started.elapsed().as_secs_f64(), capped, vm_hwm_kib: None })
}

/// Run `job` in a child process on the database `cfg`.
pub async fn drain_in_child(cfg: &Config, job: &Job) -> BenchResult<DrainOutcome> {
    if job.drainer == Drainer::Relay {
        return drain_with_relay(cfg, job).await;
    }
    let exe = std::env::current_exe()?;
    let out = tokio::process::Command::new(exe)
        .arg(CHILD_ARG)
        .env(ENV_URL, conninfo(cfg))
        .env(ENV_JOB, serde_json::to_string(job)?)
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
/// 100 ms); its peak RSS is read just before it is stopped.
async fn drain_with_relay(cfg: &Config, job: &Job) -> BenchResult<DrainOutcome> {
    let probe = connect(cfg).await?;
    let mut relay = RelayProc::start(&conninfo(cfg), &[], false).await?;
    let started = relay.spawned;
    let deadline = started + Duration::from_secs_f64(job.max_secs);
    let mut capped = false;
    while any_due(&probe).await? {
        relay.check_running()?;
        if Instant::now() >= deadline {
            capped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let hwm = relay.pid().and_then(vm_hwm_kib);
    relay.stop().await?;
    let events = if capped {
        let left: i64 = util::fresh_unpublished(&probe).await?;
        job.limit.saturating_sub(u64::try_from(left)?)
    } else {
        job.limit
    };
    Ok(DrainOutcome { events, seconds, capped, vm_hwm_kib: hwm })
}

/// Load the backlog once into a template database (not timed).
async fn load(cfg: &Config, n: i64) -> BenchResult<()> {
    let started = Instant::now();
    let client = connect(cfg).await?;
    util::load_rows(&client, RowKind::Fresh, n, 10_000, "agg").await?;
    util::settle(&client).await?;
    eprintln!("e2e: drain: loaded {} events in {:.1} s", fmt_count(n as f64), started.elapsed().as_secs_f64());
    Ok(())
}

/// Create `name` as a copy of `template` (file copy where the server has
/// it, PostgreSQL 15+), retrying while the template's last sessions close.
async fn copy_database(admin: &Client, template: &str, name: &str) -> BenchResult<()> {
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        let copied = match admin
            .batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template} STRATEGY FILE_COPY"))
            .await
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
    eprintln!("e2e: drain: copied the backlog database in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Run all drainers, each on its own copy of one loaded backlog.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let template = scratch(&ctx.admin, &ctx.admin_cfg, "drain_tmpl").await?;
    let result = run_in(ctx, &template.name, &template.cfg, s).await;
    template.drop_now(&ctx.admin).await;
    result
}

async fn run_in(ctx: &Ctx, template: &str, template_cfg: &Config, s: &Settings) -> BenchResult<Section> {
    let n = s.drain_events;
    let prefix = s.drain_baseline_prefix.min(n);
    load(template_cfg, n).await?;
    let jobs = [
        (Drainer::Seed, prefix),
        (Drainer::Plain, n),
        (Drainer::Consumer(50), n),
        (Drainer::Consumer(500), n),
        (Drainer::Relay, n),
    ];
    let mut results: Vec<(Drainer, u64, DrainOutcome)> = Vec::new();
    for (drainer, limit) in jobs {
        let name = format!("pgo_e2e_{}_drain", std::process::id());
        drop_database(&ctx.admin, &name).await;
        copy_database(&ctx.admin, template, &name).await?;
        let mut cfg = ctx.admin_cfg.clone();
        cfg.dbname(&name);
        let job = Job { drainer, limit: u64::try_from(limit)?, max_secs: s.drain_max_secs };
        let outcome = drain_in_child(&cfg, &job).await;
        drop_database(&ctx.admin, &name).await;
        let outcome = outcome?;
        eprintln!(
            "e2e: drain: {:<40} {} events in {:.1} s = {} events/s, peak RSS {} KiB{}",
            drainer.name(),
            outcome.events,
            outcome.seconds,
            fmt_count(outcome.rate()),
            outcome.vm_hwm_kib.map(|k| k.to_string()).unwrap_or_else(|| "?".into()),
            if outcome.capped { " (capped)" } else { "" }
        );
        results.push((drainer, job.limit, outcome));
    }
    let rate_of = |d: Drainer| results.iter().find(|r| r.0 == d).map(|r| r.2.rate()).unwrap_or(0.0);
    let (seed, plain) = (rate_of(Drainer::Seed), rate_of(Drainer::Plain));
    let mut sec = Section::new(
        "drain",
        &format!("Drain throughput: backlog of {} events (~1.5 KB JSON each)", fmt_count(n as f64)),
        &["drainer", "events", "seconds", "events/s", "vs plain-SQL loop", "vs seed poller", "peak RSS MiB"],
    );
    for (drainer, _, o) in &results {
        let mut name = drainer.name();
        if o.capped {
            name.push_str(" (capped)");
        }
        sec.rows.push(vec![
            name,
            fmt_count(o.events as f64),
            format!("{:.1}", o.seconds),
            fmt_count(o.rate()),
            fmt_ratio(ratio(o.rate(), plain)),
            fmt_ratio(ratio(o.rate(), seed)),
            o.vm_hwm_kib.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "?".into()),
        ]);
        if let Drainer::Consumer(b) = drainer {
            sec.target(format!("Consumer (batch {b}) >= 1.0x the plain-SQL loop"), ratio(o.rate(), plain), 1.0, false);
        }
    }
    if prefix < n {
        sec.notes.push(format!(
            "The seed poller drains only the first {} events of the same {}-event backlog (one commit per \
             event makes the whole backlog take too long); its rate is over that prefix.",
            fmt_count(prefix as f64),
            fmt_count(n as f64)
        ));
    }
    sec.notes.push(
        "Baselines in the same run: the seed's poller as written and a plain-SQL batched loop (the ceiling). \
         Every drainer decodes every column (payload JSON included) and runs as its own process; the backlog \
         is loaded once (INSERT ... SELECT generate_series, triggers' effect restored), vacuumed and analysed \
         in a template database, and each drainer gets a fresh copy of it (CREATE DATABASE ... TEMPLATE), untimed. Time runs from the drainer's start until the table shows no due row."
            .into(),
    );
    sec.notes.push(
        "Peak RSS is the drainer process's VmHWM from /proc (for the relay, read once the backlog is drained).".into(),
    );
    sec.data = serde_json::json!(
        results
            .iter()
            .map(|(d, limit, o)| serde_json::json!({
                "drainer": d.name(), "limit": limit, "events": o.events, "seconds": o.seconds,
                "events_per_second": o.rate(), "capped": o.capped, "vm_hwm_kib": o.vm_hwm_kib,
                "ratio_vs_plain": ratio(o.rate(), plain), "ratio_vs_seed": ratio(o.rate(), seed),
            }))
            .collect::<Vec<_>>()
    );
    Ok(sec)
}

//! Scenario `latency`: commit-to-delivery latency at paced, open-loop
//! rates, for the raw floor (a bare LISTEN client), the in-process
//! `EventStream` and a real `pg-outbox relay --sink stdout` process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use hdrhistogram::Histogram;
use pg_outbox::tokio_postgres::{AsyncMessage, Client, Config, NoTls};
use serde::Serialize;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::task::JoinSet;

use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::util::{RelayProc, conninfo, scratch, start_relay, stop_relay};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::BenchResult;
use pg_outbox_testkit::connect;

/// Producer connections sharing the rate.
pub const PRODUCERS: usize = 16;
/// Events the schedule may queue ahead of the producer connections; when
/// the queue is full the schedule waits, counted as "behind".
const QUEUE: usize = 64;
/// How long to wait for the last events after the producers stop.
pub const GRACE: Duration = Duration::from_secs(10);
/// Channel of the floor's notifications.
const FLOOR_CHANNEL: &str = "pgo_bench_floor";
/// The floor's plain table, created by [`measure`] for [`Subject::Floor`].
pub const FLOOR_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS pgo_bench_floor (id bigserial PRIMARY KEY, payload jsonb NOT NULL)";
/// Characters of filler in each latency event's payload (~0.3 KB JSON).
const FILLER: usize = 200;

/// Who receives the events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Subject {
    /// A bare tokio-postgres LISTEN client; producers insert into a plain
    /// table and `pg_notify` in the same autocommitted statement.
    Floor,
    /// For reference, not a target's baseline: the same LISTEN client, with
    /// producers sending only `SELECT pg_notify(...)` (no write, so the
    /// commit flushes no WAL): notification delivery alone.
    NotifyOnly,
    /// `pg_outbox::Consumer`'s `EventStream` in this process.
    Stream,
    /// The same `EventStream`, with the database switched to the
    /// `producer-locked` ordering mode (`events.outbox_set_ordering`).
    StreamProducerLocked,
    /// A `pg-outbox relay --sink stdout` child process; latency is taken
    /// when this process reads the line from the relay's stdout.
    Relay,
}

/// What each producer statement does (see [`produce`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Produce {
    /// Insert the payload into the floor's plain table and `pg_notify` the
    /// send time, in one statement ([`Subject::Floor`]).
    Floor,
    /// `SELECT pg_notify(...)` of the send time alone ([`Subject::NotifyOnly`]).
    NotifyOnly,
    /// Insert the payload into the floor's plain table, nothing else: for a
    /// receiver that reads the inserts from logical replication (the `wal`
    /// scenario's floor).
    FloorInsert,
    /// Insert the payload as an event into `events.outbox`.
    Outbox,
    /// `SELECT graphile_worker.add_job('probe', $1::json)` with the payload,
    /// whose `data.w` also holds the wall-clock send time (microseconds since
    /// the Unix epoch), for a receiver in another process to compare with
    /// its own clock (the `peers` scenario).
    AddJob,
}

impl Subject {
    /// What its producers send.
    fn produce(self) -> Produce {
        match self {
            Subject::Floor => Produce::Floor,
            Subject::NotifyOnly => Produce::NotifyOnly,
            Subject::Stream | Subject::StreamProducerLocked | Subject::Relay => Produce::Outbox,
        }
    }

    /// Name used in tables and the chart.
    pub fn name(self) -> &'static str {
        match self {
            Subject::Floor => "floor (LISTEN client)",
            Subject::NotifyOnly => "NOTIFY only, no write",
            Subject::Stream => "EventStream",
            Subject::StreamProducerLocked => "EventStream, producer-locked",
            Subject::Relay => "relay --sink stdout",
        }
    }
}

/// Shared by producers and the receiver: the clock and the histogram.
pub struct Probe {
    base: Instant,
    hist: Mutex<Histogram<u64>>,
    received: AtomicU64,
}

impl Probe {
    /// A probe whose clock starts now, with an empty histogram.
    pub fn new() -> BenchResult<Self> {
        Ok(Probe {
            base: Instant::now(),
            hist: Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3)?),
            received: AtomicU64::new(0),
        })
    }

    /// Microseconds since the probe was made.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// An event sent at `sent_us` arrived now.
    pub fn record(&self, sent_us: u64) {
        self.record_latency(self.now_us().saturating_sub(sent_us));
    }

    /// An event arrived `latency_us` microseconds after it was sent
    /// (measured by another clock than the probe's).
    pub fn record_latency(&self, latency_us: u64) {
        self.hist.lock().unwrap_or_else(PoisonError::into_inner).saturating_record(latency_us.max(1));
        self.received.fetch_add(1, Ordering::SeqCst);
    }

    /// Events recorded so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::SeqCst)
    }

    /// p50, p90, p99, p99.9 and max of the latencies recorded, milliseconds
    /// (as [`LatencyRun::percentiles_ms`]).
    pub fn percentiles_ms(&self) -> [f64; 5] {
        let hist = self.hist.lock().unwrap_or_else(PoisonError::into_inner);
        let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        [ms(0.5), ms(0.9), ms(0.99), ms(0.999), hist.max() as f64 / 1000.0]
    }
}

/// One measured run.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRun {
    /// Receiver.
    pub subject: Subject,
    /// Target rate, events/s over all producers.
    pub rate: u64,
    /// Seconds of sending.
    pub seconds: f64,
    /// Events committed.
    pub sent: u64,
    /// Events received (within the grace after sending).
    pub received: u64,
    /// Events the schedule could not queue at once (rate not held).
    pub behind: u64,
    /// p50, p90, p99, p99.9 and max in milliseconds.
    pub percentiles_ms: [f64; 5],
    /// Relay only: CPU time of the relay process and of its database
    /// sessions' server processes, microseconds per event received, while
    /// the producers ran; `None` for other receivers, or where the server's
    /// processes cannot be read (another machine).
    pub relay_cpu_us_per_event: Option<f64>,
}

impl LatencyRun {
    /// Achieved send rate, events/s.
    pub fn achieved(&self) -> f64 {
        if self.seconds > 0.0 { self.sent as f64 / self.seconds } else { 0.0 }
    }
}

/// Labels of [`LatencyRun::percentiles_ms`].
pub const PERCENTILES: [&str; 5] = ["p50", "p90", "p99", "p99.9", "max"];

/// A running receiver, stopped by [`Receiver::stop`].
enum Receiver {
    Floor { _client: Client, task: tokio::task::JoinHandle<BenchResult<()>> },
    Stream { handle: pg_outbox::ShutdownHandle, task: tokio::task::JoinHandle<BenchResult<()>> },
    Relay { relay: RelayProc, task: tokio::task::JoinHandle<BenchResult<()>> },
}

/// Read the lines of `relay` (`--sink stdout`, its output piped) into
/// `probe` (each event's send time is its `payload.data.t`) until it closes
/// its output; a line that is not JSON ends the task with an error.
pub fn record_relay_lines(
    relay: &mut RelayProc,
    probe: Arc<Probe>,
) -> BenchResult<tokio::task::JoinHandle<BenchResult<()>>> {
    let stdout = relay.stdout.take().ok_or("relay stdout is not piped")?;
    Ok(tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Some(line) = lines.next_line().await? {
            let v: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| format!("relay wrote a line that is not JSON ({e}): {line}"))?;
            if let Some(t) = v["payload"]["data"]["t"].as_u64() {
                probe.record(t);
            }
        }
        Ok(())
    }))
}

impl Receiver {
    async fn start(cfg: &Config, subject: Subject, probe: Arc<Probe>) -> BenchResult<Receiver> {
        match subject {
            Subject::Floor | Subject::NotifyOnly => {
                let (client, mut connection) = cfg.connect(NoTls).await?;
                // Drive the connection ourselves: a spawned Connection drops
                // notifications.
                let task = tokio::spawn(async move {
                    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
                    while let Some(m) = messages.next().await {
                        match m {
                            Ok(AsyncMessage::Notification(n)) => {
                                if let Ok(t) = n.payload().parse::<u64>() {
                                    probe.record(t);
                                }
                            }
                            Ok(_) => {}
                            Err(e) if e.is_closed() => break,
                            Err(e) => return Err(e.into()),
                        }
                    }
                    Ok(())
                });
                client.batch_execute(&format!("LISTEN {FLOOR_CHANNEL}")).await?;
                Ok(Receiver::Floor { _client: client, task })
            }
            Subject::Stream | Subject::StreamProducerLocked => {
                if subject == Subject::StreamProducerLocked {
                    connect(cfg).await?.execute("SELECT events.outbox_set_ordering('producer-locked')", &[]).await?;
                }
                let mut stream = pg_outbox::Consumer::builder(pg_outbox_testkit::options_of(cfg)).start().await?;
                let handle = stream.shutdown_handle();
                let task = tokio::spawn(async move {
                    while let Some(d) = stream.next().await {
                        if let Some(t) = d.payload["data"]["t"].as_u64() {
                            probe.record(t);
                        }
                        d.ack();
                    }
                    stream.finish().await?;
                    Ok(())
                });
                Ok(Receiver::Stream { handle, task })
            }
            Subject::Relay => {
                let mut relay = start_relay(&conninfo(cfg), &[], true).await?;
                let task = record_relay_lines(&mut relay, probe)?;
                Ok(Receiver::Relay { relay, task })
            }
        }
    }

    async fn stop(self) -> BenchResult<()> {
        match self {
            Receiver::Floor { _client, task } => {
                drop(_client);
                task.await??;
            }
            Receiver::Stream { handle, task } => {
                handle.shutdown();
                task.await??;
            }
            Receiver::Relay { relay, task } => {
                stop_relay(relay).await?;
                task.await??;
            }
        }
        Ok(())
    }
}

/// Producers: a schedule emits one event every `1/rate` seconds (open
/// loop) into a queue served by `PRODUCERS` connections, each running one
/// autocommitted statement at a time. The send time is taken when a
/// connection sends the statement, so the latency is commit work plus
/// delivery, never time spent waiting in the bench's queue. When every
/// connection is busy and the queue is full the schedule waits: that is
/// counted as "behind", and the achieved rate falls below the target.
/// Returns (sent, behind, seconds).
pub async fn produce(
    cfg: &Config,
    what: Produce,
    rate: u64,
    secs: f64,
    probe: &Arc<Probe>,
) -> BenchResult<(u64, u64, f64)> {
    let sql = match what {
        Produce::Floor => {
            format!(
                "WITH i AS (INSERT INTO pgo_bench_floor (payload) VALUES ($1)) SELECT pg_notify('{FLOOR_CHANNEL}', $2)"
            )
        }
        Produce::NotifyOnly => format!("SELECT pg_notify('{FLOOR_CHANNEL}', $1)"),
        Produce::FloorInsert => "INSERT INTO pgo_bench_floor (payload) VALUES ($1)".to_string(),
        Produce::Outbox => "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
              VALUES ('bench', gen_random_uuid(), 'LatencyProbe', $1)"
            .to_string(),
        Produce::AddJob => "SELECT graphile_worker.add_job('probe', $1::json)".to_string(),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<u64>(QUEUE);
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let filler = "x".repeat(FILLER);
    let mut workers = JoinSet::new();
    for p in 0..PRODUCERS {
        let client = connect(cfg).await?;
        let stmt = client.prepare(&sql).await?;
        let (probe, rx, filler) = (probe.clone(), rx.clone(), filler.clone());
        workers.spawn(async move {
            loop {
                let Some(k) = rx.lock().await.recv().await else { break };
                let t = probe.now_us();
                let mut payload = json!({"version": 1, "data": {"t": t, "k": k, "producer": p, "note": filler},
                                         "metadata": {"correlation_id": format!("bench-{k}")}});
                if what == Produce::AddJob {
                    let wall = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?;
                    payload["data"]["w"] = json!(u64::try_from(wall.as_micros())?);
                }
                match what {
                    Produce::Floor => client.execute(&stmt, &[&payload, &t.to_string()]).await?,
                    Produce::NotifyOnly => client.execute(&stmt, &[&t.to_string()]).await?,
                    Produce::Outbox | Produce::AddJob | Produce::FloorInsert => {
                        client.execute(&stmt, &[&payload]).await?
                    }
                };
            }
            Ok::<_, pg_outbox_testkit::bench::BoxError>(())
        });
    }
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let end = start + Duration::from_secs_f64(secs);
    let (mut sent, mut behind) = (0u64, 0u64);
    loop {
        let at = start + period.mul_f64(sent as f64);
        // Stop at the end of the schedule, or at the end of the time when
        // the producers fell behind it.
        if at >= end || tokio::time::Instant::now() >= end {
            break;
        }
        tokio::time::sleep_until(at).await;
        match tx.try_send(sent) {
            Ok(()) => {}
            Err(tokio::sync::mpsc::error::TrySendError::Full(k)) => {
                behind += 1;
                if tx.send(k).await.is_err() {
                    break;
                }
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => break,
        }
        sent += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    drop(tx);
    while let Some(r) = workers.join_next().await {
        r??;
    }
    Ok((sent, behind, seconds.max(secs)))
}

/// Measure one subject at one rate on the migrated database `cfg`.
pub async fn measure(cfg: &Config, subject: Subject, rate: u64, secs: f64) -> BenchResult<LatencyRun> {
    if subject == Subject::Floor {
        connect(cfg).await?.batch_execute(FLOOR_TABLE).await?;
    }
    let probe = Arc::new(Probe::new()?);
    let receiver = Receiver::start(cfg, subject, probe.clone()).await?;
    let cpu_before = relay_cpu_us(cfg, &receiver).await;
    let produced = produce(cfg, subject.produce(), rate, secs, &probe).await;
    let (sent, behind, seconds) = match produced {
        Ok(p) => p,
        Err(e) => {
            let _ = receiver.stop().await;
            return Err(e);
        }
    };
    let deadline = Instant::now() + GRACE;
    while probe.received.load(Ordering::SeqCst) < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let cpu_after = relay_cpu_us(cfg, &receiver).await;
    let received = probe.received.load(Ordering::SeqCst);
    let relay_cpu_us_per_event = match (cpu_before, cpu_after) {
        (Some(b), Some(a)) if received > 0 => Some((a - b) / received as f64),
        _ => None,
    };
    receiver.stop().await?;
    Ok(LatencyRun {
        subject,
        rate,
        seconds,
        sent,
        received: probe.received(),
        behind,
        percentiles_ms: probe.percentiles_ms(),
        relay_cpu_us_per_event,
    })
}

/// For a relay receiver: the CPU time (microseconds) used so far by the
/// relay process and by the server processes of its sessions in this
/// database (`application_name` `pg-outbox ...`, from `pg_stat_activity`);
/// `None` for other receivers or where any of them cannot be read.
async fn relay_cpu_us(cfg: &Config, receiver: &Receiver) -> Option<f64> {
    let Receiver::Relay { relay, .. } = receiver else { return None };
    let client = connect(cfg).await.ok()?;
    let rows = client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name LIKE 'pg-outbox%'",
            &[],
        )
        .await
        .ok()?;
    let mut total = crate::util::cpu_us(relay.pid()?)?;
    for row in rows {
        let pid: i32 = row.try_get(0).ok()?;
        total += crate::util::server_cpu_us(u32::try_from(pid).ok()?)?;
    }
    Some(total)
}

/// Run every subject at every rate, each in a fresh database.
pub async fn run(ctx: &Ctx) -> BenchResult<(Section, Vec<LatencyRun>)> {
    let s: &Settings = &ctx.settings;
    let mut runs = Vec::new();
    for &rate in &s.latency_rates {
        for subject in
            [Subject::Floor, Subject::NotifyOnly, Subject::Stream, Subject::StreamProducerLocked, Subject::Relay]
        {
            let db = scratch(&ctx.admin, &ctx.admin_cfg, "latency").await?;
            let run = measure(&db.cfg, subject, rate, s.latency_secs).await;
            db.drop_now(&ctx.admin).await;
            let run = run?;
            eprintln!(
                "e2e: latency {:<22} {:>5}/s: sent {} received {} p50 {:.2} ms p99 {:.2} ms max {:.1} ms",
                subject.name(),
                rate,
                run.sent,
                run.received,
                run.percentiles_ms[0],
                run.percentiles_ms[2],
                run.percentiles_ms[4]
            );
            runs.push(run);
        }
    }
    let mut sec = Section::new(
        "latency",
        "Latency: commit sent -> event received",
        &[
            "receiver",
            "rate/s",
            "achieved/s",
            "events",
            "lost",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9 ms",
            "max ms",
            "p50 vs floor",
            "p99 vs floor",
        ],
    );
    for run in &runs {
        let floor = runs.iter().find(|r| r.subject == Subject::Floor && r.rate == run.rate);
        let (r50, r99) = match floor {
            Some(f) => {
                (ratio(run.percentiles_ms[0], f.percentiles_ms[0]), ratio(run.percentiles_ms[2], f.percentiles_ms[2]))
            }
            None => (None, None),
        };
        let mut row = vec![
            run.subject.name().to_string(),
            fmt_count(run.rate as f64),
            fmt_count(run.achieved()),
            fmt_count(run.sent as f64),
            fmt_count(run.sent.saturating_sub(run.received) as f64),
        ];
        row.extend(run.percentiles_ms.iter().map(|v| fmt_ms(*v)));
        row.push(fmt_ratio(r50));
        row.push(fmt_ratio(r99));
        sec.rows.push(row);
        let targeted = matches!(run.subject, Subject::Stream | Subject::StreamProducerLocked | Subject::Relay);
        if targeted && (run.rate == 100 || run.rate == 1000) {
            sec.target(format!("{} p50 <= 2x floor at {}/s", run.subject.name(), run.rate), r50, 2.0, true);
            sec.target(format!("{} p99 <= 5x floor at {}/s", run.subject.name(), run.rate), r99, 5.0, true);
        }
    }
    sec.notes.push(format!(
        "A fixed schedule (open loop) feeds {PRODUCERS} producer connections, each sending one autocommitted \
         INSERT at a time (~0.3 KB payload, a new aggregate per event); {} s per run, each run in a fresh database.",
        s.latency_secs
    ));
    sec.notes.push(
        "Baseline (floor): a bare tokio-postgres LISTEN client; producers insert the same payload into a plain \
         table and pg_notify in one autocommitted statement. Latency = send of the committing statement -> \
         notification / delivery / stdout line read by the bench."
            .into(),
    );
    sec.notes.push(format!(
        "\"lost\" = not received within {} s after sending stopped; \"achieved\" below the rate means the \
         producers could not hold it ({} events waited for a free producer connection in total).",
        GRACE.as_secs(),
        fmt_count(runs.iter().map(|r| r.behind).sum::<u64>() as f64)
    ));
    let cpu: Vec<String> = runs
        .iter()
        .filter_map(|r| r.relay_cpu_us_per_event.map(|us| format!("{}/s {us:.0} µs", fmt_count(r.rate as f64))))
        .collect();
    if !cpu.is_empty() {
        sec.notes.push(format!(
            "Relay CPU per event (the relay process and its sessions' server processes, while the producers ran; \
             no baseline, for comparing builds): {}.",
            cpu.join(", ")
        ));
    }
    sec.notes.push(
        "\"NOTIFY only, no write\" is for reference (no target uses it): producers send `SELECT pg_notify(...)` \
         alone, so their commit writes and flushes no WAL; the gap to the floor is the cost of committing a write."
            .into(),
    );
    let saturated: Vec<String> = runs
        .iter()
        .filter(|r| r.subject == Subject::Floor && r.achieved() < 0.95 * r.rate as f64)
        .map(|r| format!("{}/s (achieved {}/s)", fmt_count(r.rate as f64), fmt_count(r.achieved())))
        .collect();
    if !saturated.is_empty() {
        sec.notes.push(format!(
            "The floor could not hold {}: every floor transaction sends a NOTIFY, and notifying commits queue \
             for one server-wide lock (PITFALLS.md 3), while pg-outbox's trigger notifies only idle relays. \
             Ratios at those rates compare against a saturated floor.",
            saturated.join(", ")
        ));
    }
    sec.data = serde_json::to_value(&runs)?;
    Ok((sec, runs))
}

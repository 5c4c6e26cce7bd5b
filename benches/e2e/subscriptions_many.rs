//! Scenario `subscriptions`, continued: several named subscriptions at once.
//! - Fan-out: [`FAN`] subscriptions, a Consumer each, draining one backlog
//!   (a quarter of `hot_events`) at the same time: each one's events/s and
//!   all of them together (events delivered / wall time), against one
//!   subscription draining the same backlog alone.
//! - Producers: single-row autocommit inserts on [`PRODUCER_CONNS`]
//!   connections (the `producers` load) while [`FAN`] subscriptions'
//!   Consumers drain live, against one subscription's Consumer; again with
//!   the producers and the drains pinned to CPUs of their own
//!   ([`crate::pinning`]), which leaves what the drains cost the producers
//!   through the database rather than through a shared CPU.
//! - A failing sink: commit-to-delivery of subscription A at
//!   [`FAIL_RATE`] events/s while subscription B's Consumer fails every
//!   event (short retry ladder, so it retries and dead-letters within the
//!   run), against A's while B acknowledges.
//!
//! Every variant runs in rounds, alternating which goes first; ratios are
//! the median of the rounds' ratios.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::tokio_postgres::{Client, Config};
use pg_outbox::{Consumer, EventStream, RetryPolicy};
use serde::Serialize;

use crate::pinning;
use crate::producers::{median, run_load};
use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::util::{self, RowKind, scratch};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::{connect, options_of};

/// Aggregates the backlog is spread over (round robin in id order).
pub const AGGREGATES: i64 = 10_000;

/// Subscriptions draining at once.
const FAN: usize = 4;
/// Producer connections of the producers' comparison.
const PRODUCER_CONNS: usize = 4;
/// Events/s of the failing-sink comparison.
const FAIL_RATE: u64 = 100;
/// Retry ladder of the failing subscription's Consumer (the last step
/// repeats), ms.
const FAIL_STEPS_MS: [u64; 4] = [100, 200, 400, 800];
/// Its dead-letter threshold: the 5th failure dead-letters an event
/// (about 1.5 s after its first delivery).
const FAIL_MAX_RETRIES: i32 = 5;
/// Producer connections sharing a latency rate.
pub const LATENCY_PRODUCERS: usize = 4;

/// Create subscription `name` reading from the first event.
async fn create(client: &Client, name: &str) -> BenchResult<()> {
    client
        .execute("INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) VALUES ($1, 0, 0)", &[&name])
        .await?;
    Ok(())
}

/// Events not yet settled for subscription `name`.
async fn left(client: &Client, name: &str) -> BenchResult<i64> {
    Ok(client
        .query_one(
            "SELECT count(*) FROM events.outbox o, events.outbox_subscriptions s \
             WHERE s.name = $1 AND o.id > s.cursor_id AND NOT o.id = ANY (s.settled)",
            &[&name],
        )
        .await?
        .try_get(0)?)
}

/// Drain `events` with `stream`, a Consumer of subscription `name`: when
/// the table showed every event settled for it.
async fn drain_named(
    mut stream: EventStream,
    probe: Client,
    name: String,
    events: i64,
    deadline: Instant,
) -> BenchResult<Instant> {
    let mut acked = 0i64;
    while acked < events {
        match tokio::time::timeout_at(deadline.into(), stream.next()).await {
            Ok(Some(d)) => {
                black_box(&d.payload);
                d.ack();
                acked += 1;
            }
            Ok(None) => {
                return Err(format!("{name}: the consumer's stream ended before the backlog was drained").into());
            }
            Err(_) => return Err(format!("{name}: acknowledged {acked} of {events} in the cap").into()),
        }
    }
    let rest = deadline.saturating_duration_since(Instant::now());
    let (p, n) = (&probe, name.as_str());
    let done = util::wait_until(rest, Duration::from_millis(2), || async move { Ok(left(p, n).await? == 0) }).await?;
    let done_at = Instant::now();
    stream.finish().await?;
    if !done {
        return Err(format!("{name}: acknowledgements not all written in the cap").into());
    }
    Ok(done_at)
}

/// Drain the backlog of `cfg` with a Consumer per name, all at once: each
/// one's seconds from its start until the table showed the backlog settled
/// for it (in the order of `names`), and the seconds from the first start
/// until the last one was. The Consumers start one after another (each
/// start returns within milliseconds): started at the same instant, their
/// test notifications cross (see the scenario's notes).
async fn drain_at_once(cfg: &Config, names: &[String], events: i64, max_secs: f64) -> BenchResult<(Vec<f64>, f64)> {
    let mut probes = Vec::with_capacity(names.len());
    for _ in names {
        probes.push(connect(cfg).await?);
    }
    let first = Instant::now();
    let deadline = first + Duration::from_secs_f64(max_secs);
    let mut tasks = Vec::with_capacity(names.len());
    for (name, probe) in names.iter().zip(probes) {
        let started = Instant::now();
        let stream = Consumer::builder(options_of(cfg)).subscription(name.clone()).start().await?;
        tasks.push((started, tokio::spawn(drain_named(stream, probe, name.clone(), events, deadline))));
    }
    let mut seconds = Vec::with_capacity(tasks.len());
    let mut wall: f64 = 0.0;
    for (started, t) in tasks {
        let done_at = t.await??;
        seconds.push(done_at.saturating_duration_since(started).as_secs_f64());
        wall = wall.max(done_at.saturating_duration_since(first).as_secs_f64());
    }
    Ok((seconds, wall))
}

/// One round of the fan-out: one subscription alone, [`FAN`] at once.
#[derive(Debug, Clone, Serialize)]
struct FanRound {
    /// Seconds of the subscription draining alone.
    alone_secs: f64,
    /// Seconds of each of the [`FAN`] subscriptions draining at once.
    each_secs: Vec<f64>,
    /// Seconds from the first of them starting to the last one done.
    wall_secs: f64,
}

/// The fan-out comparison.
#[derive(Debug, Clone, Serialize)]
pub struct FanOut {
    events: i64,
    rounds: Vec<FanRound>,
}

impl FanOut {
    /// Median events/s of one subscription alone.
    fn alone_rate(&self) -> f64 {
        median(&mut self.rounds.iter().map(|r| self.events as f64 / r.alone_secs).collect::<Vec<_>>())
    }

    /// Median events/s of subscription `i` of the [`FAN`], and the median of
    /// its rounds' ratios to the subscription alone.
    fn each(&self, i: usize) -> (f64, f64) {
        let rate = |r: &FanRound| self.events as f64 / r.each_secs[i];
        let mut rates: Vec<f64> = self.rounds.iter().map(rate).collect();
        let mut ratios: Vec<f64> = self.rounds.iter().map(|r| rate(r) * r.alone_secs / self.events as f64).collect();
        (median(&mut rates), median(&mut ratios))
    }

    /// Median events/s of all [`FAN`] together (events delivered over the
    /// time until the last one finished), and the median of the rounds'
    /// ratios to the subscription alone.
    fn together(&self) -> (f64, f64) {
        let rate = |r: &FanRound| (self.events * FAN as i64) as f64 / r.wall_secs;
        let mut rates: Vec<f64> = self.rounds.iter().map(rate).collect();
        let mut ratios: Vec<f64> = self.rounds.iter().map(|r| rate(r) * r.alone_secs / self.events as f64).collect();
        (median(&mut rates), median(&mut ratios))
    }
}

/// Drains of one backlog by subscriptions created for the drain and
/// dropped after it: one alone and [`FAN`] at once, `rounds` times.
async fn fan_rounds(cfg: &Config, client: &Client, events: i64, rounds: usize, max_secs: f64) -> BenchResult<FanOut> {
    let mut out = FanOut { events, rounds: Vec::new() };
    for round in 0..rounds.max(1) {
        let (mut alone_secs, mut each_secs, mut wall_secs) = (0.0, Vec::new(), 0.0);
        let order = if round % 2 == 0 { [1, FAN] } else { [FAN, 1] };
        for n in order {
            let names: Vec<String> = (0..n).map(|i| format!("fan_{round}_{n}_{i}")).collect();
            for name in &names {
                create(client, name).await?;
            }
            let (secs, wall) = drain_at_once(cfg, &names, events, max_secs).await?;
            for name in &names {
                pg_outbox::subscription::drop(client, name).await?;
            }
            if n == 1 {
                alone_secs = secs[0];
            } else {
                (each_secs, wall_secs) = (secs, wall);
            }
        }
        let rates: Vec<String> = each_secs.iter().map(|s| fmt_count(events as f64 / s)).collect();
        eprintln!(
            "e2e: subscriptions: fan-out round {round}: alone {} events/s, {FAN} at once {} events/s each, {} \
             together",
            fmt_count(events as f64 / alone_secs),
            rates.join(" / "),
            fmt_count((events * FAN as i64) as f64 / wall_secs)
        );
        out.rounds.push(FanRound { alone_secs, each_secs, wall_secs });
    }
    Ok(out)
}

/// The fan-out comparison on a backlog of a quarter of `hot_events`.
async fn fanout(ctx: &Ctx) -> BenchResult<FanOut> {
    let s: &Settings = &ctx.settings;
    let events = (s.hot_events / 4).max(1);
    let rounds = if s.smoke { 1 } else { 3 };
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "sub_fan").await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        util::autovacuum_off(&client).await?;
        util::load_rows(&client, RowKind::Fresh, events, AGGREGATES, "fan").await?;
        util::settle(&client).await?;
        fan_rounds(&db.cfg, &client, events, rounds, s.drain_max_secs).await
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// Acknowledge everything `stream` delivers until `stop`, then finish it;
/// how many it acknowledged.
async fn ack_until(mut stream: EventStream, stop: Arc<AtomicBool>) -> BenchResult<u64> {
    let mut acked = 0;
    while !stop.load(Ordering::SeqCst) {
        if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(50), stream.next()).await {
            d.ack();
            acked += 1;
        }
    }
    stream.finish().await?;
    Ok(acked)
}

/// One producers' run.
#[derive(Debug, Clone, Serialize)]
struct ProducerRun {
    /// Inserts/s after the warm-up.
    per_second: f64,
    /// The fewest events a subscription's Consumer had acknowledged when
    /// the producers stopped, over the inserts committed.
    kept_up: f64,
    /// Share of the samples (every 10 ms after the warm-up) in which the
    /// producers' hint said "notify" (`events.outbox_hint`, bit 1: some
    /// consumer waits for a wake-up).
    notify_share: Option<f64>,
    /// The machine's busy CPU share after the warm-up (`/proc/stat`).
    machine_busy: Option<f64>,
    /// CPU time of the producers' own server processes per insert after
    /// the warm-up (microseconds, `/proc`): what each insert costs the
    /// server, whatever else runs on the machine.
    cpu_us_per_insert: Option<f64>,
    /// The run was to be pinned ([`crate::pinning`]) and every thread and
    /// server process of it was: `None` for an unpinned run.
    pinned: Option<bool>,
}

/// Sample the producers' hint every 10 ms from `warmup` seconds on until
/// `stop`: the share of samples saying "notify", and the machine's busy
/// CPU share over the same time.
async fn sample_hint(client: Client, warmup: f64, stop: Arc<AtomicBool>) -> BenchResult<(Option<f64>, Option<f64>)> {
    tokio::time::sleep(Duration::from_secs_f64(warmup)).await;
    let cpu0 = util::machine_cpu_s();
    let (mut set, mut all) = (0u64, 0u64);
    while !stop.load(Ordering::SeqCst) {
        let row =
            client.query_one("SELECT coalesce(pg_sequence_last_value('events.outbox_hint'), 3) % 2 = 1", &[]).await?;
        set += u64::from(row.try_get::<_, bool>(0)?);
        all += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let busy = match (cpu0, util::machine_cpu_s()) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => Some((b1 - b0) / (t1 - t0)),
        _ => None,
    };
    Ok(((all > 0).then(|| set as f64 / all as f64), busy))
}

/// One producers' run with `subs` subscriptions' Consumers draining live;
/// with `pinned`, the Consumers on a runtime of their own, and they and
/// their server processes on one CPU, the producers and theirs on another
/// ([`crate::pinning`]).
async fn producers_run(ctx: &Ctx, subs: usize, pinned: bool) -> BenchResult<ProducerRun> {
    let (warmup, secs) = (ctx.settings.producer_warmup_secs, ctx.settings.producer_secs);
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "sub_producers").await?;
    let drains = if pinned {
        Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name(pinning::DRAINS_THREAD)
                .on_thread_start(|| {
                    pinning::pin(0, &[pinning::DRAINS_CPU]);
                })
                .enable_all()
                .build()?,
        )
    } else {
        None
    };
    let result = async {
        let client = connect(&db.cfg).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut readers = Vec::with_capacity(subs);
        // The Consumers' sessions may take settings of their own
        // (`PG_OUTBOX_BENCH_CONSUMER_OPTIONS`, e.g. `-c synchronous_commit=off`).
        let mut consumers_cfg = db.cfg.clone();
        if let Ok(options) = std::env::var("PG_OUTBOX_BENCH_CONSUMER_OPTIONS") {
            consumers_cfg.options(&options);
        }
        // Their acknowledgements durable (`PG_OUTBOX_BENCH_DURABLE_ACKS=1`)
        // rather than at `synchronous_commit = off`, the default.
        let durable = std::env::var("PG_OUTBOX_BENCH_DURABLE_ACKS").is_ok_and(|v| v == "1");
        for i in 0..subs {
            let name = format!("live_{i}");
            create(&client, &name).await?;
            let (opts, stop) = (options_of(&consumers_cfg), stop.clone());
            let reader = async move {
                let stream =
                    Consumer::builder(opts).subscription(name).durable_acknowledgements(durable).start().await?;
                ack_until(stream, stop).await
            };
            readers.push(match &drains {
                Some(rt) => rt.spawn(reader),
                None => tokio::spawn(reader),
            });
        }
        // Let the consumers reach their idle state (asking for wake-ups).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let threads_pinned = pinned && pinning::pin_own_threads(false);
        let sampler = tokio::spawn(sample_hint(connect(&db.cfg).await?, warmup, stop.clone()));
        // The producers' server processes exist once the load has opened
        // its connections: pinned then, within the warm-up.
        let pin_backends = async {
            if !pinned {
                return None;
            }
            tokio::time::sleep(Duration::from_secs_f64((warmup / 2.0).min(0.3))).await;
            pinning::pin_backends(&client).await
        };
        let (load, backends) = tokio::join!(run_load(&db.cfg, PRODUCER_CONNS, warmup + secs, warmup, 0), pin_backends);
        let pinned = pinned.then_some(threads_pinned && backends.is_some_and(|n| n > PRODUCER_CONNS));
        stop.store(true, Ordering::SeqCst);
        let mut fewest = u64::MAX;
        for r in readers {
            fewest = fewest.min(r.await??);
        }
        let (notify_share, machine_busy) = sampler.await??;
        let load = load?;
        let counted: u64 = load.slices[load.warm_slices..].iter().sum();
        let inserted: u64 = load.slices.iter().sum();
        let kept_up = if inserted > 0 { fewest as f64 / inserted as f64 } else { 0.0 };
        let per_second = if secs > 0.0 { counted as f64 / secs } else { 0.0 };
        let cpu_us_per_insert = load.backend_cpu_us.filter(|_| counted > 0).map(|us| us / counted as f64);
        Ok::<_, BoxError>(ProducerRun { per_second, kept_up, notify_share, machine_busy, cpu_us_per_insert, pinned })
    }
    .await;
    if let Some(rt) = drains {
        pinning::pin_own_threads(true);
        rt.shutdown_background();
    }
    db.drop_now(&ctx.admin).await;
    result
}

/// The producers' comparison: per round, a run with one subscription
/// draining and one with [`FAN`].
#[derive(Debug, Clone, Serialize)]
pub struct ProducersCmp {
    connections: usize,
    warmup_secs: f64,
    counted_secs: f64,
    one: Vec<ProducerRun>,
    many: Vec<ProducerRun>,
    /// The same, pinned ([`crate::pinning`]); empty where pinning cannot
    /// be tried.
    one_pinned: Vec<ProducerRun>,
    many_pinned: Vec<ProducerRun>,
}

impl ProducersCmp {
    /// Median of the rounds' ratios, [`FAN`] against one.
    fn ratio(&self) -> Option<f64> {
        Self::rate_ratio(&self.many, &self.one)
    }

    /// Median of the pinned rounds' ratios, [`FAN`] against one, where
    /// every pinned run was pinned.
    fn pinned_ratio(&self) -> Option<f64> {
        let all = self.one_pinned.iter().chain(&self.many_pinned).all(|r| r.pinned == Some(true));
        Self::rate_ratio(&self.many_pinned, &self.one_pinned).filter(|_| all)
    }

    fn rate_ratio(many: &[ProducerRun], one: &[ProducerRun]) -> Option<f64> {
        let mut r: Vec<f64> = many.iter().zip(one).filter_map(|(m, o)| ratio(m.per_second, o.per_second)).collect();
        (!r.is_empty()).then(|| median(&mut r))
    }

    /// Median of the rounds' ratios of the producers' server CPU per
    /// insert, [`FAN`] against one.
    fn cpu_ratio(&self) -> Option<f64> {
        let mut r: Vec<f64> = self
            .many
            .iter()
            .zip(&self.one)
            .filter_map(|(m, o)| ratio(m.cpu_us_per_insert?, o.cpu_us_per_insert?))
            .collect();
        (!r.is_empty()).then(|| median(&mut r))
    }

    /// Median of `f` over `runs`, where every run has it.
    fn median_of(runs: &[ProducerRun], f: fn(&ProducerRun) -> Option<f64>) -> Option<f64> {
        let mut v = runs.iter().map(f).collect::<Option<Vec<f64>>>()?;
        (!v.is_empty()).then(|| median(&mut v))
    }
}

/// Producers with one and with [`FAN`] subscriptions draining,
/// `producer_rounds` rounds, alternating which goes first.
async fn producers(ctx: &Ctx) -> BenchResult<ProducersCmp> {
    let mut out = ProducersCmp {
        connections: PRODUCER_CONNS,
        warmup_secs: ctx.settings.producer_warmup_secs,
        counted_secs: ctx.settings.producer_secs,
        one: Vec::new(),
        many: Vec::new(),
        one_pinned: Vec::new(),
        many_pinned: Vec::new(),
    };
    let variants: &[bool] = if pinning::available() { &[false, true] } else { &[false] };
    for round in 0..ctx.settings.producer_rounds.max(1) {
        let order = if round % 2 == 0 { [1, FAN] } else { [FAN, 1] };
        for (pinned, n) in variants.iter().flat_map(|p| order.map(|n| (*p, n))) {
            let run = producers_run(ctx, n, pinned).await?;
            let pct = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{:.0} %", v * 100.0));
            eprintln!(
                "e2e: subscriptions: producers round {round}, {n} subscription(s) draining{}: {} inserts/s, {} \
                 server CPU per insert, the slowest consumer acknowledged {} of them, hint said notify {}, machine \
                 busy {}",
                match run.pinned {
                    None => "",
                    Some(true) => ", pinned",
                    Some(false) => ", pinning refused",
                },
                fmt_count(run.per_second),
                run.cpu_us_per_insert.map_or("n/a".into(), |us| format!("{us:.1} us")),
                pct(Some(run.kept_up)),
                pct(run.notify_share),
                pct(run.machine_busy)
            );
            match (pinned, n) {
                (false, 1) => out.one.push(run),
                (false, _) => out.many.push(run),
                (true, 1) => out.one_pinned.push(run),
                (true, _) => out.many_pinned.push(run),
            }
        }
    }
    Ok(out)
}

/// Commit `rate` events/s for `secs` seconds (open loop, a fresh aggregate
/// each) over [`LATENCY_PRODUCERS`] connections: each event's id and when
/// its commit was acknowledged.
pub async fn paced_inserts(cfg: &Config, rate: u64, secs: f64) -> BenchResult<Vec<(i64, Instant)>> {
    let total = ((rate as f64) * secs).max(1.0) as usize;
    let start = Instant::now() + Duration::from_millis(200);
    let mut producers = Vec::new();
    for p in 0..LATENCY_PRODUCERS {
        let c = connect(cfg).await?;
        producers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for i in (p..total).step_by(LATENCY_PRODUCERS) {
                let at = start + Duration::from_secs_f64(i as f64 / rate as f64);
                tokio::time::sleep_until(at.into()).await;
                let row = c
                    .query_one(
                        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ('bench', gen_random_uuid(), 'Latency', '{\"n\": 1}') RETURNING id",
                        &[],
                    )
                    .await?;
                committed.push((row.try_get::<_, i64>(0)?, Instant::now()));
            }
            Ok::<_, BoxError>(committed)
        }));
    }
    let mut committed = Vec::new();
    for p in producers {
        committed.extend(p.await??);
    }
    Ok(committed)
}

/// Arrival times of the events a latency run's reader acknowledged.
pub type Arrivals = Arc<Mutex<HashMap<i64, Instant>>>;

/// A latency run's reader: acknowledge and time each delivery of `stream`
/// until `expected` (set once the producers are done) have arrived, or
/// `secs` + 15 s passed; then finish the stream.
pub async fn time_arrivals(
    mut stream: EventStream,
    secs: f64,
    arrived: Arrivals,
    expected: Arc<AtomicUsize>,
) -> BenchResult<()> {
    let deadline = Instant::now() + Duration::from_secs_f64(secs + 15.0);
    while Instant::now() < deadline {
        if arrived.lock().unwrap_or_else(PoisonError::into_inner).len() >= expected.load(Ordering::SeqCst) {
            break;
        }
        if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(50), stream.next()).await {
            arrived.lock().unwrap_or_else(PoisonError::into_inner).insert(d.id, Instant::now());
            d.ack();
        }
    }
    Ok(stream.finish().await?)
}

/// p50 and p99 commit-to-delivery (ms) of `committed`; an error naming
/// `who` unless every event arrived.
pub fn percentiles(who: &str, committed: &[(i64, Instant)], arrived: &Arrivals) -> BenchResult<(f64, f64)> {
    let got = arrived.lock().unwrap_or_else(PoisonError::into_inner);
    let mut ms: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| got.get(id).map(|a| a.saturating_duration_since(*at).as_secs_f64() * 1000.0))
        .collect();
    if ms.is_empty() || ms.len() < committed.len() {
        return Err(format!("{who}: {} of {} events delivered within 15 s", ms.len(), committed.len()).into());
    }
    ms.sort_by(f64::total_cmp);
    let pct = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    Ok((pct(0.5), pct(0.99)))
}

/// Subscription B's Consumer: fail (or acknowledge) every delivery until
/// `stop`, then finish; how many deliveries it got.
async fn settle_b(mut stream: EventStream, fail: bool, stop: Arc<AtomicBool>) -> BenchResult<u64> {
    let mut got = 0;
    while !stop.load(Ordering::SeqCst) {
        if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(50), stream.next()).await {
            if fail {
                d.fail("bench: this subscription's sink refuses every event");
            } else {
                d.ack();
            }
            got += 1;
        }
    }
    stream.finish().await?;
    Ok(got)
}

/// One failing-sink run's figures: A's latency, and what B did.
#[derive(Debug, Clone, Serialize)]
struct SinkRun {
    b_fails: bool,
    sent: usize,
    p50_ms: f64,
    p99_ms: f64,
    b_deliveries: u64,
    b_dead_letters: i64,
}

/// Subscription A's latency at [`FAIL_RATE`] for `secs` with B's Consumer
/// failing every event (`b_fails`) or acknowledging it.
async fn sink_run(ctx: &Ctx, b_fails: bool, secs: f64) -> BenchResult<SinkRun> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "sub_failing").await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        create(&client, "a").await?;
        create(&client, "b").await?;
        let a = Consumer::builder(options_of(&db.cfg)).subscription("a").start().await?;
        let steps = FAIL_STEPS_MS.iter().map(|ms| Duration::from_millis(*ms)).collect();
        let b = Consumer::builder(options_of(&db.cfg))
            .subscription("b")
            .retry_policy(RetryPolicy::schedule(steps)?)
            .max_retries(FAIL_MAX_RETRIES)
            .start()
            .await?;
        let arrived: Arrivals = Arc::default();
        let expected = Arc::new(AtomicUsize::new(usize::MAX));
        let stop = Arc::new(AtomicBool::new(false));
        let a_task = tokio::spawn(time_arrivals(a, secs, arrived.clone(), expected.clone()));
        let b_task = tokio::spawn(settle_b(b, b_fails, stop.clone()));
        let committed = paced_inserts(&db.cfg, FAIL_RATE, secs).await;
        expected.store(committed.as_ref().map_or(0, Vec::len), Ordering::SeqCst);
        let a_done = a_task.await;
        stop.store(true, Ordering::SeqCst);
        let b_deliveries = b_task.await??;
        a_done??;
        let committed = committed?;
        let (p50_ms, p99_ms) = percentiles("subscription a", &committed, &arrived)?;
        let b_dead_letters: i64 = client
            .query_one(
                "SELECT count(*) FROM events.outbox_subscription_failures \
                 WHERE subscription = 'b' AND next_retry_at = 'infinity'",
                &[],
            )
            .await?
            .try_get(0)?;
        Ok::<_, BoxError>(SinkRun { b_fails, sent: committed.len(), p50_ms, p99_ms, b_deliveries, b_dead_letters })
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// The failing-sink comparison: per round, a run with B acknowledging and
/// one with B failing (alternating which goes first).
#[derive(Debug, Clone, Serialize)]
pub struct SinkCmp {
    rate: u64,
    secs: f64,
    acking: Vec<SinkRun>,
    failing: Vec<SinkRun>,
}

impl SinkCmp {
    /// Median p50 and p99 (ms) of `runs`.
    fn medians(runs: &[SinkRun]) -> (f64, f64) {
        let mut p50: Vec<f64> = runs.iter().map(|r| r.p50_ms).collect();
        let mut p99: Vec<f64> = runs.iter().map(|r| r.p99_ms).collect();
        (median(&mut p50), median(&mut p99))
    }

    /// Median of the rounds' p50 and p99 ratios, B failing against B acknowledging.
    fn ratios(&self) -> (Option<f64>, Option<f64>) {
        let of = |f: fn(&SinkRun) -> f64| {
            let mut r: Vec<f64> =
                self.failing.iter().zip(&self.acking).filter_map(|(x, b)| ratio(f(x), f(b))).collect();
            (!r.is_empty()).then(|| median(&mut r))
        };
        (of(|r| r.p50_ms), of(|r| r.p99_ms))
    }
}

/// The failing-sink comparison, `rounds` rounds of `latency_secs` each.
async fn failing_sink(ctx: &Ctx) -> BenchResult<SinkCmp> {
    let s: &Settings = &ctx.settings;
    let rounds = if s.smoke { 1 } else { 3 };
    let mut out = SinkCmp { rate: FAIL_RATE, secs: s.latency_secs, acking: Vec::new(), failing: Vec::new() };
    for round in 0..rounds {
        let order = if round % 2 == 0 { [false, true] } else { [true, false] };
        for b_fails in order {
            let run = sink_run(ctx, b_fails, s.latency_secs).await?;
            eprintln!(
                "e2e: subscriptions: failing sink round {round}, b {}: a's p50 {} ms, p99 {} ms; b got {} \
                 deliveries, {} dead letters",
                if b_fails { "failing" } else { "acknowledging" },
                fmt_ms(run.p50_ms),
                fmt_ms(run.p99_ms),
                run.b_deliveries,
                run.b_dead_letters
            );
            if b_fails { out.failing.push(run) } else { out.acking.push(run) }
        }
    }
    Ok(out)
}

/// All three comparisons.
#[derive(Debug, Clone, Serialize)]
pub struct Many {
    fanout: FanOut,
    producers: ProducersCmp,
    failing_sink: SinkCmp,
}

/// Run the fan-out, the producers' and the failing-sink comparisons.
pub async fn run(ctx: &Ctx) -> BenchResult<Many> {
    let fanout = fanout(ctx).await?;
    let producers = producers(ctx).await?;
    let failing_sink = failing_sink(ctx).await?;
    Ok(Many { fanout, producers, failing_sink })
}

/// A row of the scenario's table: what, reader, figure, baseline, ratio;
/// the last three columns empty.
fn row(what: &str, reader: String, figure: String, baseline: &str, vs: String) -> Vec<String> {
    vec![what.into(), reader, figure, baseline.into(), vs, String::new(), String::new(), String::new()]
}

impl Many {
    /// Add the rows, targets and notes to the scenario's section.
    pub fn report(&self, sec: &mut Section) {
        let f = &self.fanout;
        let what = format!("drain {} events", fmt_count(f.events as f64));
        let alone = "one subscription alone";
        sec.rows.push(row(&what, alone.into(), fmt_count(f.alone_rate()), alone, "1.00x".into()));
        for i in 0..FAN {
            let (rate, r) = f.each(i);
            sec.rows.push(row(
                &what,
                format!("{FAN} at once: subscription {}", i + 1),
                fmt_count(rate),
                alone,
                fmt_ratio(Some(r)),
            ));
        }
        let (rate, r) = f.together();
        sec.rows.push(row(&what, format!("{FAN} at once: all together"), fmt_count(rate), alone, fmt_ratio(Some(r))));
        let p = &self.producers;
        let what = format!("producers' inserts/s, {} connections", p.connections);
        let one = "1 subscription draining";
        let rate =
            |runs: &[ProducerRun]| fmt_count(ProducersCmp::median_of(runs, |r| Some(r.per_second)).unwrap_or(0.0));
        sec.rows.push(row(&what, one.into(), rate(&p.one), one, "1.00x".into()));
        sec.rows.push(row(&what, format!("{FAN} subscriptions draining"), rate(&p.many), one, fmt_ratio(p.ratio())));
        sec.target(format!("producers' insert rate with {FAN} subscriptions >= 0.98x with 1"), p.ratio(), 0.98, false);
        if !p.one_pinned.is_empty() {
            let pinned = format!("{what}, producers and drains on CPUs of their own");
            sec.rows.push(row(&pinned, one.into(), rate(&p.one_pinned), one, "1.00x".into()));
            let many = format!("{FAN} subscriptions draining");
            sec.rows.push(row(&pinned, many, rate(&p.many_pinned), one, fmt_ratio(p.pinned_ratio())));
            sec.target(
                format!("producers' insert rate with {FAN} subscriptions >= 0.98x with 1, on CPUs of their own"),
                p.pinned_ratio(),
                0.98,
                false,
            );
        }
        let what = format!("producers' server CPU per insert, {} connections", p.connections);
        let cpu = |runs: &[ProducerRun]| {
            ProducersCmp::median_of(runs, |r| r.cpu_us_per_insert).map_or("n/a".into(), |us| format!("{us:.1} us"))
        };
        sec.rows.push(row(&what, one.into(), cpu(&p.one), one, "1.00x".into()));
        sec.rows.push(row(&what, format!("{FAN} subscriptions draining"), cpu(&p.many), one, fmt_ratio(p.cpu_ratio())));
        let c = &self.failing_sink;
        let what = format!("latency at {}/s of subscription A", c.rate);
        let acking = "B acknowledging";
        let ((a50, a99), (f50, f99)) = (SinkCmp::medians(&c.acking), SinkCmp::medians(&c.failing));
        let (r50, r99) = c.ratios();
        sec.rows.push(row(
            &what,
            acking.into(),
            format!("{} / {}", fmt_ms(a50), fmt_ms(a99)),
            acking,
            "1.00x / 1.00x".into(),
        ));
        let vs = format!("{} / {}", fmt_ratio(r50), fmt_ratio(r99));
        sec.rows.push(row(
            &what,
            "B failing every event".into(),
            format!("{} / {}", fmt_ms(f50), fmt_ms(f99)),
            acking,
            vs,
        ));
        sec.target(
            "subscription A's p99 with B failing every event <= 1.2x with B acknowledging".into(),
            r99,
            1.2,
            true,
        );
        sec.notes.push(self.note());
    }

    /// The note that says how the three comparisons ran.
    fn note(&self) -> String {
        let dead: Vec<String> = self.failing_sink.failing.iter().map(|r| r.b_dead_letters.to_string()).collect();
        let pct = |runs: &[ProducerRun], f: fn(&ProducerRun) -> Option<f64>| {
            ProducersCmp::median_of(runs, f).map_or("n/a".into(), |v| format!("{:.0} %", v * 100.0))
        };
        let fewest = |runs: &[ProducerRun]| {
            format!("{:.0} %", runs.iter().map(|r| r.kept_up).fold(f64::INFINITY, f64::min).min(1.0) * 100.0)
        };
        let (one, many) = (&self.producers.one, &self.producers.many);
        format!(
            "Several subscriptions: ratios are medians of the rounds' ratios, rounds alternating which variant goes \
             first. Drain: {} settled events (a quarter of the backlog above) in one database, {} round(s) of one \
             named subscription alone and {FAN} at once (a Consumer each, default settings, in this process), each \
             created from the first event for its drain and dropped after it, the {FAN} Consumers started one \
             after another; each one's events/s from its start until the table shows every event settled for it, all \
             together: {FAN} x events over the time from the first start until the last one finished. Producers: the `producers` load ({PRODUCER_CONNS} connections, single-row autocommit \
             INSERTs, {} s warm-up, {} s counted, a fresh database per run) while 1 or {FAN} named subscriptions' \
             Consumers (in this process) acknowledge everything live, {} round(s); the slowest Consumer had \
             acknowledged at least {} (1) and {} ({FAN}) of the inserts when the producers stopped; after the \
             warm-up (medians), the producers' hint (`events.outbox_hint`, sampled every 10 ms) said \
             \"notify\" (some consumer waits for a wake-up, so every insert's transaction notifies) {} (1) and {} \
             ({FAN}) of the time, the machine's CPU was busy {} (1) and {} ({FAN}). Pinned (where the machine has \
             two CPUs or more): the same runs with this process's threads and the producers' server processes on \
             CPU {} and the Consumers (a runtime of their own) and their server processes on CPU {} \
             (`sched_setaffinity`; the server's background processes float), so that the drains reach the \
             producers only through the database; {}. Failing sink: \
             subscriptions A and B on one outbox, {} events/s for {} s (fresh aggregates, {LATENCY_PRODUCERS} \
             producer connections), A's Consumer acknowledging (commit to delivery measured), B's failing every \
             delivery (retry ladder {FAIL_STEPS_MS:?} ms, dead letter at the {FAIL_MAX_RETRIES}th failure; dead \
             letters at the end: {}) or acknowledging, {} round(s).",
            fmt_count(self.fanout.events as f64),
            self.fanout.rounds.len(),
            self.producers.warmup_secs,
            self.producers.counted_secs,
            one.len(),
            fewest(one),
            fewest(many),
            pct(one, |r| r.notify_share),
            pct(many, |r| r.notify_share),
            pct(one, |r| r.machine_busy),
            pct(many, |r| r.machine_busy),
            pinning::PRODUCERS_CPU,
            pinning::DRAINS_CPU,
            match (self.producers.one_pinned.is_empty(), self.producers.pinned_ratio()) {
                (true, _) => "not run here (fewer than two CPUs)".to_string(),
                (false, Some(_)) => format!(
                    "the slowest Consumer had acknowledged at least {} (1) and {} ({FAN}) of the inserts",
                    fewest(&self.producers.one_pinned),
                    fewest(&self.producers.many_pinned)
                ),
                (false, None) => "the kernel refused some of the pinning, so no ratio is given".to_string(),
            },
            self.failing_sink.rate,
            self.failing_sink.secs,
            dead.join(" / "),
            self.failing_sink.acking.len()
        )
    }
}

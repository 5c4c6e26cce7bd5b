//! Scenario `subscriptions`: a named subscription against the default one
//! (docs/subscriptions.md). A backlog of `hot_events` fresh events (1 000
//! 000 in a full run) drained by a Consumer of the default subscription
//! (one row written per event), by a Consumer of a named subscription (one
//! cursor row per batch), and by the floor: a plain loop of `UPDATE ...
//! RETURNING`, 500 rows a statement. Each drain's WAL bytes and dead tuples
//! per event. Then commit-to-delivery latency, p50 and p99, at 100 and 1 000
//! events/s, of each subscription's Consumer. Then several named
//! subscriptions at once (`subscriptions_many`): four draining one backlog
//! against one alone, producers with four draining live against one, and one
//! subscription's latency while another's Consumer fails every event.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::Consumer;
use pg_outbox::tokio_postgres::{Client, Config};
use serde::Serialize;

use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::subscriptions_many::{
    self, AGGREGATES, Arrivals, LATENCY_PRODUCERS, paced_inserts, percentiles, time_arrivals,
};
use crate::util::{self, RowKind, Scratch, scratch};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;

/// The named subscription the scenario creates.
const NAME: &str = "bench";
/// Rows per statement of the floor's loop.
const FLOOR_BATCH: i64 = 500;
/// Latency rates, events/s.
const RATES: [u64; 2] = [100, 1_000];

/// Who drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
enum Reader {
    /// `UPDATE ... RETURNING` in a loop, 500 a statement: the floor.
    Floor,
    /// A Consumer of the default subscription.
    Default,
    /// A Consumer of subscription [`NAME`].
    Named,
}

impl Reader {
    fn name(self) -> &'static str {
        match self {
            Reader::Floor => "floor: UPDATE ... RETURNING, 500 a statement",
            Reader::Default => "default subscription (Consumer)",
            Reader::Named => "named subscription (Consumer)",
        }
    }
}

/// One drain.
#[derive(Debug, Clone, Serialize)]
struct DrainRun {
    reader: Reader,
    events: i64,
    seconds: f64,
    wal_bytes: i64,
    dead_tuples: i64,
}

impl DrainRun {
    fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.events as f64 / self.seconds } else { 0.0 }
    }
}

/// One latency run.
#[derive(Debug, Clone, Serialize)]
struct LatencyRun {
    reader: Reader,
    rate: u64,
    sent: usize,
    p50_ms: f64,
    p99_ms: f64,
}

/// A scratch database with subscription [`NAME`] reading from the first
/// event, and `events` fresh events loaded and settled.
async fn backlog(ctx: &Ctx, tag: &str, events: i64) -> BenchResult<(Scratch, Client)> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, tag).await?;
    let client = connect(&db.cfg).await?;
    util::autovacuum_off(&client).await?;
    client
        .execute("INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) VALUES ($1, 0, 0)", &[&NAME])
        .await?;
    if events > 0 {
        util::load_rows(&client, RowKind::Fresh, events, AGGREGATES, "sub").await?;
        util::settle(&client).await?;
    }
    Ok((db, client))
}

/// The WAL position now, as a byte count.
async fn wal_at(client: &Client) -> BenchResult<i64> {
    Ok(client.query_one("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8", &[]).await?.try_get(0)?)
}

/// Dead tuples in the schema `events`, once the server's statistics caught
/// up (other sessions flush theirs within about a second of going idle).
async fn dead_tuples(client: &Client) -> BenchResult<i64> {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    client.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    Ok(client
        .query_one(
            "SELECT coalesce(sum(n_dead_tup), 0)::int8 FROM pg_stat_user_tables WHERE schemaname = 'events'",
            &[],
        )
        .await?
        .try_get(0)?)
}

/// Events of the backlog not yet settled for `reader`.
async fn left(client: &Client, reader: Reader) -> BenchResult<i64> {
    let sql = match reader {
        Reader::Named => {
            "SELECT count(*) FROM events.outbox o, events.outbox_subscriptions s \
             WHERE s.name = 'bench' AND o.id > s.cursor_id AND NOT o.id = ANY (s.settled)"
        }
        _ => "SELECT count(*) FROM events.outbox WHERE published_at IS NULL",
    };
    Ok(client.query_one(sql, &[]).await?.try_get(0)?)
}

/// Drain the backlog of `cfg` with `reader`; returns the seconds taken.
async fn drain(cfg: &Config, client: &Client, reader: Reader, events: i64, max_secs: f64) -> BenchResult<f64> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(max_secs);
    if reader == Reader::Floor {
        let floor = connect(cfg).await?;
        loop {
            let rows = floor
                .query(
                    "UPDATE events.outbox o SET published_at = now() WHERE o.id IN ( \
                       SELECT id FROM events.outbox WHERE published_at IS NULL ORDER BY id LIMIT $1) \
                     RETURNING o.id, o.payload",
                    &[&FLOOR_BATCH],
                )
                .await?;
            black_box(&rows);
            if rows.is_empty() {
                return Ok(started.elapsed().as_secs_f64());
            }
            if Instant::now() > deadline {
                return Err(format!("the floor's loop did not drain {events} events in {max_secs:.0} s").into());
            }
        }
    }
    let builder = Consumer::builder(pg_outbox_testkit::options_of(cfg));
    let builder = if reader == Reader::Named { builder.subscription(NAME) } else { builder };
    let mut stream = builder.start().await?;
    let mut acked = 0i64;
    while acked < events {
        match tokio::time::timeout_at(deadline.into(), stream.next()).await {
            Ok(Some(d)) => {
                black_box(&d.payload);
                d.ack();
                acked += 1;
            }
            Ok(None) => return Err("the consumer's stream ended before the backlog was drained".into()),
            Err(_) => return Err(format!("{} acknowledged {acked} of {events} in the cap", reader.name()).into()),
        }
    }
    let rest = deadline.saturating_duration_since(Instant::now());
    let done =
        util::wait_until(rest, Duration::from_millis(2), || async { Ok(left(client, reader).await? == 0) }).await?;
    let seconds = started.elapsed().as_secs_f64();
    stream.finish().await?;
    if !done {
        return Err(format!("{}: acknowledgements not all written in the cap", reader.name()).into());
    }
    Ok(seconds)
}

/// One drain in a scratch database of its own.
async fn one_drain(ctx: &Ctx, reader: Reader, tag: &str) -> BenchResult<DrainRun> {
    let s: &Settings = &ctx.settings;
    let events = s.hot_events;
    let (db, client) = backlog(ctx, tag, events).await?;
    let result = async {
        let wal0 = wal_at(&client).await?;
        let dead0 = dead_tuples(&client).await?;
        let seconds = drain(&db.cfg, &client, reader, events, s.drain_max_secs).await?;
        let wal_bytes = wal_at(&client).await? - wal0;
        let dead = dead_tuples(&client).await? - dead0;
        Ok::<_, BoxError>(DrainRun { reader, events, seconds, wal_bytes, dead_tuples: dead })
    }
    .await;
    db.drop_now(&ctx.admin).await;
    let run = result?;
    eprintln!("e2e: subscriptions: drain by {}: {} events/s", reader.name(), fmt_count(run.rate()));
    Ok(run)
}

/// Commit-to-delivery latency of `reader`'s Consumer at `rate` events/s for
/// `secs` seconds, producers on four connections.
async fn one_latency(ctx: &Ctx, reader: Reader, rate: u64, secs: f64, tag: &str) -> BenchResult<LatencyRun> {
    let (db, _client) = backlog(ctx, tag, 0).await?;
    let result = async {
        let builder = Consumer::builder(pg_outbox_testkit::options_of(&db.cfg));
        let builder = if reader == Reader::Named { builder.subscription(NAME) } else { builder };
        let stream = builder.start().await?;
        let arrived: Arrivals = Arc::default();
        // How many the producers committed (set once they are done): the
        // reader then stops, and finishes the stream (its acknowledgements
        // written, its sessions closed) before the database is dropped.
        let expected = Arc::new(AtomicUsize::new(usize::MAX));
        let reader_task = tokio::spawn(time_arrivals(stream, secs, arrived.clone(), expected.clone()));
        let committed = paced_inserts(&db.cfg, rate, secs).await;
        expected.store(committed.as_ref().map_or(0, Vec::len), Ordering::SeqCst);
        reader_task.await??;
        let committed = committed?;
        let (p50_ms, p99_ms) = percentiles(reader.name(), &committed, &arrived)?;
        Ok::<_, BoxError>(LatencyRun { reader, rate, sent: committed.len(), p50_ms, p99_ms })
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// Run the drains, the latency runs, then several subscriptions at once
/// (`subscriptions_many`).
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let mut drains = Vec::new();
    for (reader, tag) in [(Reader::Floor, "sub_floor"), (Reader::Default, "sub_default"), (Reader::Named, "sub_named")]
    {
        drains.push(one_drain(ctx, reader, tag).await?);
    }
    let mut latencies = Vec::new();
    for rate in RATES {
        for (reader, tag) in [(Reader::Default, "sub_lat_default"), (Reader::Named, "sub_lat_named")] {
            latencies.push(one_latency(ctx, reader, rate, s.latency_secs, tag).await?);
        }
    }
    let many = subscriptions_many::run(ctx).await?;
    let mut sec = Section::new(
        "subscriptions",
        &format!(
            "Subscriptions: a named subscription against the default one, {} events; several at once",
            fmt_count(s.hot_events as f64)
        ),
        &[
            "what",
            "reader",
            "events/s, inserts/s or p50 / p99 ms",
            "baseline",
            "vs baseline",
            "vs floor",
            "WAL bytes/event",
            "dead tuples/event",
        ],
    );
    drain_rows(&mut sec, &drains);
    latency_rows(&mut sec, &latencies);
    let rate_of = |r: Reader| drains.iter().find(|d| d.reader == r).map_or(0.0, DrainRun::rate);
    let named = ratio(rate_of(Reader::Named), rate_of(Reader::Default));
    sec.target("named subscription's drain >= 1.5x the default's".into(), named, 1.5, false);
    sec.notes.push(format!(
        "Each drain: {} fresh events (~1.5 KB JSON) over {AGGREGATES} aggregates in a scratch database of its own, \
         settled (VACUUM ANALYZE, CHECKPOINT); the named subscription created from the first event. Consumers \
         with the default settings; events/s over the time from the start until the table shows every event \
         settled for that reader (published, or passed by the subscription's cursor). WAL bytes from \
         pg_current_wal_lsn() around the drain; dead tuples from pg_stat_user_tables of the schema events. Latency: \
         {} s at each rate over {LATENCY_PRODUCERS} producer connections (single-row autocommitted inserts, a fresh \
         aggregate each), commit acknowledged to delivery in this process, one Consumer at a time.",
        fmt_count(s.hot_events as f64),
        s.latency_secs
    ));
    many.report(&mut sec);
    sec.data = serde_json::json!({"drains": drains, "latencies": latencies, "several": many});
    Ok(sec)
}

/// The drains' rows, against the default subscription's and the floor's
/// drain.
fn drain_rows(sec: &mut Section, drains: &[DrainRun]) {
    let rate_of = |r: Reader| drains.iter().find(|d| d.reader == r).map_or(0.0, DrainRun::rate);
    let (floor, default) = (rate_of(Reader::Floor), rate_of(Reader::Default));
    for d in drains {
        let per = |v: i64| format!("{:.1}", v as f64 / d.events.max(1) as f64);
        sec.rows.push(vec![
            "drain".into(),
            d.reader.name().into(),
            fmt_count(d.rate()),
            Reader::Default.name().into(),
            fmt_ratio(ratio(d.rate(), default)),
            fmt_ratio(ratio(d.rate(), floor)),
            per(d.wal_bytes),
            per(d.dead_tuples),
        ]);
    }
}

/// The latency runs' rows, against the default subscription's at the same
/// rate, and their targets.
fn latency_rows(sec: &mut Section, latencies: &[LatencyRun]) {
    for l in latencies {
        let base = latencies.iter().find(|b| b.rate == l.rate && b.reader == Reader::Default);
        sec.rows.push(vec![
            format!("latency at {}/s", l.rate),
            l.reader.name().into(),
            format!("{} / {}", fmt_ms(l.p50_ms), fmt_ms(l.p99_ms)),
            Reader::Default.name().into(),
            base.map_or("n/a".into(), |b| {
                format!("{} / {}", fmt_ratio(ratio(l.p50_ms, b.p50_ms)), fmt_ratio(ratio(l.p99_ms, b.p99_ms)))
            }),
            String::new(),
            String::new(),
            String::new(),
        ]);
        if l.reader == Reader::Named
            && let Some(b) = base
        {
            let what = format!("named subscription's p99 <= 1.1x the default's at {}/s", l.rate);
            sec.target(what, ratio(l.p99_ms, b.p99_ms), 1.1, true);
        }
    }
}

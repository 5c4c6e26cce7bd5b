//! Scenario `heads`: a pathological head of the id range (dead letters and
//! rows waiting for a retry, below every fresh event) against an empty head:
//! Consumer drain throughput and the latency of fresh events.

use std::time::Instant;

use crate::drain::{DrainOutcome, Drainer, Job, drain_in_child};
use crate::latency::{LatencyRun, Subject, measure};
use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::util::{self, RowKind, scratch};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;

/// Rate of the latency probe after the drain, events/s.
const PROBE_RATE: u64 = 50;

/// One head state's results.
struct HeadRun {
    name: &'static str,
    drain: DrainOutcome,
    latency: LatencyRun,
}

/// Load the head (if any) and the fresh events, drain them with a
/// Consumer child, then measure fresh events' latency at a low rate.
async fn one(ctx: &Ctx, pathological: bool) -> BenchResult<HeadRun> {
    let s: &Settings = &ctx.settings;
    let db = scratch(&ctx.admin, &ctx.admin_cfg, if pathological { "heads_bad" } else { "heads_empty" }).await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        let started = Instant::now();
        if pathological {
            util::load_rows(&client, RowKind::DeadLetter, s.heads_rows, 1_000, "dead").await?;
            util::load_rows(&client, RowKind::RetryWaiting, s.heads_rows, 1_000, "wait").await?;
        }
        util::load_rows(&client, RowKind::Fresh, s.heads_fresh, 10_000, "fresh").await?;
        util::settle(&client).await?;
        eprintln!("e2e: heads: loaded in {:.1} s", started.elapsed().as_secs_f64());
        let job = Job {
            drainer: Drainer::Consumer(pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE),
            limit: u64::try_from(s.heads_fresh)?,
            max_secs: s.drain_max_secs,
        };
        let drain = drain_in_child(&db.cfg, &job).await?;
        let latency = measure(&db.cfg, Subject::Stream, PROBE_RATE, s.heads_probe_secs).await?;
        Ok::<_, BoxError>((drain, latency))
    }
    .await;
    db.drop_now(&ctx.admin).await;
    let (drain, latency) = result?;
    let name = if pathological { "dead letters + retry-waiting head" } else { "empty head (baseline)" };
    eprintln!(
        "e2e: heads: {name}: {} events/s, p50 {:.2} ms, p99 {:.2} ms",
        fmt_count(drain.rate()),
        latency.percentiles_ms[0],
        latency.percentiles_ms[2]
    );
    Ok(HeadRun { name, drain, latency })
}

/// Run both head states.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let empty = one(ctx, false).await?;
    let bad = one(ctx, true).await?;
    let mut sec = Section::new(
        "heads",
        "Pathological heads: dead letters and retry-waiting rows below the fresh events",
        &["head", "events/s", "vs empty head", "p50 ms", "p99 ms", "p50 vs empty head", "p99 vs empty head"],
    );
    let base = &empty;
    for r in [&empty, &bad] {
        sec.rows.push(vec![
            r.name.to_string(),
            fmt_count(r.drain.rate()),
            fmt_ratio(ratio(r.drain.rate(), base.drain.rate())),
            fmt_ms(r.latency.percentiles_ms[0]),
            fmt_ms(r.latency.percentiles_ms[2]),
            fmt_ratio(ratio(r.latency.percentiles_ms[0], base.latency.percentiles_ms[0])),
            fmt_ratio(ratio(r.latency.percentiles_ms[2], base.latency.percentiles_ms[2])),
        ]);
    }
    let drain_ratio = ratio(bad.drain.rate(), empty.drain.rate());
    let p50_ratio = ratio(bad.latency.percentiles_ms[0], empty.latency.percentiles_ms[0]);
    sec.target(
        "drain throughput with the pathological head ~1.0x (>= 0.9x) the empty head".into(),
        drain_ratio,
        0.9,
        false,
    );
    sec.target(
        "fresh-event p50 latency with the pathological head ~1.0x (<= 1.25x) the empty head".into(),
        p50_ratio,
        1.25,
        true,
    );
    sec.notes.push(format!(
        "Pathological head: {} dead letters (retry_count 10, next_retry_at 'infinity') and {} rows waiting for a \
         retry (next_retry_at a day ahead), over 1 000 aggregates each, at the low end of the id range; then {} \
         fresh events on other aggregates. Drained by a Consumer child (batch {}); then fresh events at {PROBE_RATE}/s \
         for {} s through the EventStream, commit sent -> delivered. Baseline: the same without the head, in the same run.",
        fmt_count(s.heads_rows as f64),
        fmt_count(s.heads_rows as f64),
        fmt_count(s.heads_fresh as f64),
        pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE,
        s.heads_probe_secs
    ));
    sec.data = serde_json::json!(
        [empty, bad]
            .iter()
            .map(|r| serde_json::json!({
                "head": r.name, "drain": r.drain, "latency": r.latency,
            }))
            .collect::<Vec<_>>()
    );
    Ok(sec)
}

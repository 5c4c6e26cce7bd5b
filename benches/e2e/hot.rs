//! Scenario `hot`: a backlog over few aggregates (many events each), some
//! of them failing, drained by the Consumer, beside the same backlog with
//! every event its own aggregate. A failing aggregate's first event fails
//! (its retry an hour away) and holds back the rest of its aggregate, which
//! every later fetch passes; the scenario checks that exactly those events
//! are left unpublished.

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::tokio_postgres::{Client, Config};
use pg_outbox::{Consumer, RetryPolicy};
use serde::Serialize;

use crate::report::{Section, fmt_count, fmt_ratio, ratio};
use crate::util::{self, RowKind, scratch};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;

/// Retry delay of a failed event: longer than any drain here, so a failing
/// aggregate holds back its events until the end.
const RETRY_AFTER: Duration = Duration::from_secs(3600);
/// Prefix of the aggregates' names in `util::load_rows`.
const PREFIX: &str = "hot";

/// One backlog's layout.
#[derive(Debug, Clone, Copy, Serialize)]
struct Layout {
    /// Name in the table.
    name: &'static str,
    /// Events in the backlog.
    events: i64,
    /// Aggregates they are spread over (round robin in id order).
    aggregates: i64,
    /// Aggregates whose events the consumer fails.
    failing: i64,
}

/// What one drain did.
#[derive(Debug, Clone, Serialize)]
struct HotRun {
    layout: Layout,
    /// Deliveries acknowledged.
    acked: u64,
    /// Deliveries failed (one per failing aggregate).
    failed: u64,
    /// Events left unpublished at the end (checked: exactly the failing
    /// aggregates' events).
    held_back: i64,
    /// Seconds from the consumer's start until every deliverable event was
    /// published.
    seconds: f64,
}

impl HotRun {
    /// Events published per second.
    fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.acked as f64 / self.seconds } else { 0.0 }
    }
}

/// The failing aggregates' ids: `failing` of the `aggregates` that
/// `util::load_rows` names `md5('hot-' || k)::uuid`, spread evenly over k.
async fn failing_ids(client: &Client, layout: &Layout) -> BenchResult<Vec<uuid::Uuid>> {
    let ks: Vec<i64> = (0..layout.failing).map(|i| i * layout.aggregates / layout.failing.max(1)).collect();
    let rows =
        client.query(&format!("SELECT md5('{PREFIX}-' || k)::uuid FROM unnest($1::bigint[]) AS k"), &[&ks]).await?;
    Ok(rows.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>()?)
}

/// Events unpublished (all of them: held back, failed, or not yet acknowledged).
async fn unpublished(client: &Client) -> BenchResult<i64> {
    Ok(client.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await?.try_get(0)?)
}

/// Drain with a Consumer in this process (batch [`pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE`]):
/// fail every delivery of a `failing` aggregate, acknowledge the rest; done
/// when `expect_acks` are acknowledged and only `expect_held` events are
/// unpublished. Errors when the time cap comes first.
async fn drain(
    cfg: &Config,
    failing: &HashSet<uuid::Uuid>,
    expect_acks: u64,
    expect_held: i64,
    max_secs: f64,
) -> BenchResult<(u64, u64, f64)> {
    let probe = connect(cfg).await?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(max_secs);
    let mut stream = Consumer::builder(pg_outbox_testkit::options_of(cfg))
        .batch_size(pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE)
        .retry_policy(RetryPolicy::schedule(vec![RETRY_AFTER])?)
        .start()
        .await?;
    let (mut acked, mut failed) = (0u64, 0u64);
    let mut capped = false;
    while acked < expect_acks {
        match tokio::time::timeout_at(deadline.into(), stream.next()).await {
            Ok(Some(d)) => {
                if failing.contains(&d.aggregate_id) {
                    d.fail("bench: this aggregate's sink refuses it");
                    failed += 1;
                } else {
                    black_box(&d.payload);
                    d.ack();
                    acked += 1;
                }
            }
            Ok(None) => return Err("the consumer's stream ended before the backlog was drained".into()),
            Err(_) => {
                capped = true;
                break;
            }
        }
    }
    // Acknowledgements are written in batches: the drain is over when the
    // table shows only the held-back events unpublished.
    if !capped {
        let left = deadline.saturating_duration_since(Instant::now());
        capped = !util::wait_until(left, Duration::from_millis(2), || async {
            Ok(unpublished(&probe).await? <= expect_held)
        })
        .await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    if capped {
        drop(stream);
        return Err(format!(
            "the consumer acknowledged {acked} of {expect_acks} events and failed {failed} in the {max_secs:.0} s cap"
        )
        .into());
    }
    stream.finish().await?;
    Ok((acked, failed, seconds))
}

/// Check that the unpublished events are exactly the failing aggregates'
/// (`per_aggregate` each), each aggregate's first event failed once and
/// waiting for its retry, the rest untouched; and that every other event is
/// published. Returns the count held back.
async fn check_held(
    client: &Client,
    failing: &HashSet<uuid::Uuid>,
    per_aggregate: i64,
    events: i64,
) -> BenchResult<i64> {
    let rows = client
        .query(
            "SELECT aggregate_id, count(*), \
                    count(*) FILTER (WHERE retry_count = 1 AND next_retry_at > now()), \
                    count(*) FILTER (WHERE retry_count = 0 AND next_retry_at IS NULL), \
                    min(id) FILTER (WHERE retry_count = 1) = min(id) \
             FROM events.outbox WHERE published_at IS NULL GROUP BY aggregate_id",
            &[],
        )
        .await?;
    let mut seen: HashMap<uuid::Uuid, (i64, i64, i64, Option<bool>)> = HashMap::new();
    for r in &rows {
        seen.insert(r.try_get(0)?, (r.try_get(1)?, r.try_get(2)?, r.try_get(3)?, r.try_get(4)?));
    }
    let mut problems = Vec::new();
    for (agg, (n, failed, untouched, first_failed)) in &seen {
        if !failing.contains(agg) {
            problems.push(format!("aggregate {agg} (not failing) has {n} unpublished events"));
        } else if *n != per_aggregate || *failed != 1 || *untouched != per_aggregate - 1 || *first_failed != Some(true)
        {
            problems.push(format!(
                "failing aggregate {agg}: {n} unpublished (expected {per_aggregate}), {failed} failed once and waiting \
                 (expected 1, its first), {untouched} untouched, first failed: {first_failed:?}"
            ));
        }
    }
    for agg in failing.iter().filter(|a| !seen.contains_key(a)) {
        problems.push(format!("failing aggregate {agg} has no unpublished event"));
    }
    let held: i64 = seen.values().map(|v| v.0).sum();
    let published: i64 =
        client.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[]).await?.try_get(0)?;
    if published + held != events {
        problems.push(format!("{published} published + {held} held back is not the {events} events loaded"));
    }
    if problems.is_empty() {
        Ok(held)
    } else {
        Err(format!("held-back events are not exactly the failing aggregates' events: {}", problems.join("; ")).into())
    }
}

/// Load one layout's backlog in a scratch database, settle it, drain it,
/// check what is left.
async fn one(ctx: &Ctx, layout: Layout, tag: &str) -> BenchResult<HotRun> {
    let s: &Settings = &ctx.settings;
    let db = scratch(&ctx.admin, &ctx.admin_cfg, tag).await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        util::autovacuum_off(&client).await?;
        let started = Instant::now();
        util::load_rows(&client, RowKind::Fresh, layout.events, layout.aggregates, PREFIX).await?;
        util::settle(&client).await?;
        eprintln!(
            "e2e: hot: {}: loaded {} events in {:.1} s",
            layout.name,
            fmt_count(layout.events as f64),
            started.elapsed().as_secs_f64()
        );
        let failing: HashSet<uuid::Uuid> = failing_ids(&client, &layout).await?.into_iter().collect();
        let expect_held: i64 = if failing.is_empty() {
            0
        } else {
            let ids: Vec<uuid::Uuid> = failing.iter().copied().collect();
            client
                .query_one("SELECT count(*) FROM events.outbox WHERE aggregate_id = ANY($1)", &[&ids])
                .await?
                .try_get(0)?
        };
        let per_aggregate = layout.events / layout.aggregates.max(1);
        if expect_held != layout.failing * per_aggregate {
            return Err(format!(
                "{} failing aggregates hold {expect_held} events, expected {} each",
                layout.failing, per_aggregate
            )
            .into());
        }
        let expect_acks = u64::try_from(layout.events - expect_held)?;
        let (acked, failed, seconds) = drain(&db.cfg, &failing, expect_acks, expect_held, s.drain_max_secs).await?;
        let held_back = check_held(&client, &failing, per_aggregate, layout.events).await?;
        Ok::<_, BoxError>(HotRun { layout, acked, failed, held_back, seconds })
    }
    .await;
    db.drop_now(&ctx.admin).await;
    let run = result?;
    eprintln!(
        "e2e: hot: {}: {} events/s, {} failed, {} held back",
        layout.name,
        fmt_count(run.rate()),
        run.failed,
        run.held_back
    );
    Ok(run)
}

/// Run the three layouts: all distinct (the baseline), hot, hot with
/// failing aggregates.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let n = s.hot_events;
    let layouts = [
        (
            Layout { name: "every event its own aggregate (baseline)", events: n, aggregates: n, failing: 0 },
            "hot_distinct",
        ),
        (Layout { name: "hot aggregates", events: n, aggregates: s.hot_aggregates, failing: 0 }, "hot_ok"),
        (
            Layout {
                name: "hot aggregates, some failing",
                events: n,
                aggregates: s.hot_aggregates,
                failing: s.hot_failing,
            },
            "hot_failing",
        ),
    ];
    let mut runs = Vec::new();
    for (layout, tag) in layouts {
        runs.push(one(ctx, layout, tag).await?);
    }
    let mut sec = Section::new(
        "hot",
        &format!(
            "Hot aggregates: a backlog of {} events over {} aggregates, some failing, against every event its own",
            fmt_count(n as f64),
            fmt_count(s.hot_aggregates as f64)
        ),
        &[
            "backlog",
            "aggregates",
            "failing aggregates",
            "events/s",
            "vs all distinct",
            "failed deliveries",
            "held back (checked)",
            "seconds",
        ],
    );
    let base = runs[0].rate();
    for r in &runs {
        sec.rows.push(vec![
            r.layout.name.to_string(),
            fmt_count(r.layout.aggregates as f64),
            r.layout.failing.to_string(),
            fmt_count(r.rate()),
            fmt_ratio(ratio(r.rate(), base)),
            r.failed.to_string(),
            fmt_count(r.held_back as f64),
            format!("{:.1}", r.seconds),
        ]);
    }
    sec.notes.push(format!(
        "Each backlog: {} events (~1.5 KB JSON), aggregates taken round robin in id order (so every batch spans \
         many aggregates and a failing aggregate's events are spread over the whole backlog), loaded in a scratch \
         database of its own, then VACUUM ANALYZE and CHECKPOINT (the settled state). Drained by a Consumer in \
         the bench's process (batch {}), each variant alike; events/s are acknowledged events over the time from \
         the consumer's start until only the held-back events are unpublished. The consumer fails every delivery \
         of a failing aggregate (retry after {} s, so not during the drain): its first event fails and the rest \
         of the aggregate is held back, and every later fetch passes those rows (one hold-back probe each). The \
         scenario fails unless the unpublished events at the end are exactly the failing aggregates' events, \
         each aggregate's first event failed once and the rest untouched.",
        fmt_count(n as f64),
        pg_outbox::ConsumerBuilder::DEFAULT_BATCH_SIZE,
        RETRY_AFTER.as_secs()
    ));
    sec.data = serde_json::json!(
        runs.iter()
            .map(|r| serde_json::json!({"layout": r.layout, "acked": r.acked, "failed": r.failed,
                "held_back": r.held_back, "seconds": r.seconds, "events_per_second": r.rate(),
                "ratio_vs_distinct": ratio(r.rate(), base)}))
            .collect::<Vec<_>>()
    );
    Ok(sec)
}

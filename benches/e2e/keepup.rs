//! Scenario `keepup`: producers insert as fast as they can while a relay
//! drains; the oldest unpublished event's age is sampled every 250 ms.

use std::time::{Duration, Instant};

use crate::producers::run_load;
use crate::report::{Section, fmt_count, fmt_ratio, ratio};
use crate::util::{self, conninfo, scratch, start_relay, stop_relay};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;

/// Producer connections.
pub const CONNECTIONS: usize = 8;
/// Lag sampling interval.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// Longest wait for the relay to catch up after the producers stop.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(120);
/// Age of the oldest unpublished due event, seconds (0 when none).
const OLDEST_AGE: &str = "SELECT coalesce((SELECT extract(epoch FROM clock_timestamp() - occurred_at)::float8 \
     FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NULL ORDER BY id LIMIT 1), 0)";

/// Run the scenario in a fresh database.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "keepup").await?;
    let result = async {
        let cfg = db.cfg.clone();
        let relay = start_relay(&conninfo(&cfg), &[], false).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let sampler_client = connect(&cfg).await?;
        let stop = tokio_util::sync::CancellationToken::new();
        let stop2 = stop.clone();
        let sampler = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = stop2.cancelled() => break,
                    _ = tick.tick() => {
                        let lag: f64 = sampler_client.query_one(OLDEST_AGE, &[]).await?.try_get(0)?;
                        samples.push(lag);
                    }
                }
            }
            Ok::<_, BoxError>(samples)
        });
        let secs = s.keepup_secs;
        let inserted = run_load(&cfg, CONNECTIONS, secs, 0.0, 0).await;
        stop.cancel();
        let samples = sampler.await??;
        let inserted: u64 = inserted?.slices.iter().sum();
        let probe = connect(&cfg).await?;
        let left_at_end = u64::try_from(util::fresh_unpublished(&probe).await?)?;
        let final_lag: f64 = probe.query_one(OLDEST_AGE, &[]).await?.try_get(0)?;
        let catch_up_started = Instant::now();
        let caught_up = util::wait_until(CATCH_UP_LIMIT, Duration::from_millis(50), || async {
            Ok(util::fresh_unpublished(&probe).await? == 0)
        })
        .await?;
        let catch_up = catch_up_started.elapsed().as_secs_f64();
        stop_relay(relay).await?;
        let max_lag = samples.iter().copied().fold(final_lag, f64::max);
        let producer_tps = inserted as f64 / secs;
        let relay_rate = inserted.saturating_sub(left_at_end) as f64 / secs;
        Ok::<_, BoxError>((producer_tps, relay_rate, max_lag, final_lag, caught_up, catch_up, samples.len()))
    }
    .await;
    db.drop_now(&ctx.admin).await;
    let (producer_tps, relay_rate, max_lag, final_lag, caught_up, catch_up, n_samples) = result?;
    eprintln!(
        "e2e: keepup: producers {producer_tps:.0}/s, relay {relay_rate:.0}/s, max lag {max_lag:.3} s, final lag {final_lag:.3} s"
    );
    let keep = ratio(relay_rate, producer_tps);
    let mut sec = Section::new(
        "keepup",
        "Keep-up: producers at full speed with a relay draining",
        &["producer inserts/s", "relay events/s", "relay vs producers", "max lag s", "final lag s", "catch-up s"],
    );
    sec.rows.push(vec![
        fmt_count(producer_tps),
        fmt_count(relay_rate),
        fmt_ratio(keep),
        format!("{max_lag:.3}"),
        format!("{final_lag:.3}"),
        if caught_up { format!("{catch_up:.2}") } else { format!("> {}", CATCH_UP_LIMIT.as_secs()) },
    ]);
    sec.notes.push(format!(
        "{CONNECTIONS} producer connections, single-row autocommit INSERTs as fast as they go for {secs} s, \
         with `pg-outbox relay --sink stdout` draining (its stdout a pipe the bench reads and discards). Lag = age of the oldest unpublished event \
         ({n_samples} samples, every {} ms); final lag when the producers stop; catch-up = time from then until \
         nothing is left. Baseline: the producers' own rate in the same run (relay events/s = events published \
         during the window / its length). The issue sets no target here.",
        SAMPLE_EVERY.as_millis(),
        secs = s.keepup_secs,
    ));
    sec.data = serde_json::json!({"producer_inserts_per_second": producer_tps, "relay_events_per_second": relay_rate,
        "ratio": keep, "max_lag_seconds": max_lag, "final_lag_seconds": final_lag,
        "caught_up": caught_up, "catch_up_seconds": catch_up, "seconds": s.keepup_secs});
    Ok(sec)
}

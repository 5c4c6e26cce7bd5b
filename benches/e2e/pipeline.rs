//! Scenario `pipeline`: a relay delivering to a webhook that answers each
//! request after a round trip (0, 1, 5 and 20 ms, a test server in this
//! process), with `--max-in-flight 64` (the default) and 1 (one at a time,
//! the relay before pipelining), against what the same server takes from a
//! plain async HTTP client with 64 requests in flight, in the same run.
//! Also the default at 5 ms with few aggregates (1, 4, 16), where
//! per-aggregate order caps the rate at about aggregates / round trip.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::report::{Section, fmt_count, fmt_ratio, ratio};
use crate::util::{self, RowKind, conninfo, relay_bin, scratch};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::BenchResult;
use pg_outbox_testkit::connect;
use pg_outbox_testkit::process::{Output, Relay};

/// Requests the plain client keeps in flight, and the relay's default.
const IN_FLIGHT: usize = 64;
/// Aggregates of the main backlog.
const AGGREGATES: i64 = 1_000;
/// Longest time one drain is measured (the serial relay at 20 ms would
/// take an hour over 100 000 events): the rate is what was published in it.
const DRAIN_CAP: Duration = Duration::from_secs(20);

/// The test webhook: answers 200 after `delay`, counting the requests.
async fn serve(delay: Duration) -> BenchResult<(String, Arc<AtomicU64>)> {
    let count = Arc::new(AtomicU64::new(0));
    let counted = count.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |_body: axum::body::Bytes| {
            let counted = counted.clone();
            async move {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                counted.fetch_add(1, Ordering::Relaxed);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((url, count))
}

/// What the server takes from a plain client: `n` POSTs of a 1.5 KB body,
/// [`IN_FLIGHT`] at a time; requests/s.
async fn plain_client(url: &str, n: usize) -> BenchResult<f64> {
    let http = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(IN_FLIGHT).build()?;
    let body = vec![b'x'; 1_500];
    let started = Instant::now();
    let mut sends = futures::stream::iter(0..n)
        .map(|_| {
            let (http, body) = (http.clone(), body.clone());
            async move { http.post(url).header("content-type", "application/json").body(body).send().await }
        })
        .buffer_unordered(IN_FLIGHT);
    while let Some(r) = sends.next().await {
        r?.error_for_status()?;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Drain a backlog of `n` events over `aggregates` aggregates with a relay
/// to `url` at `max_in_flight`, for at most [`DRAIN_CAP`]; events/s.
async fn drain(ctx: &Ctx, url: &str, n: i64, aggregates: i64, max_in_flight: usize) -> BenchResult<f64> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "pipeline").await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        util::load_rows(&client, RowKind::Fresh, n, aggregates, "pipeline").await?;
        util::settle(&client).await?;
        let max = max_in_flight.to_string();
        let started = Instant::now();
        let relay = Relay::new(&relay_bin())
            .url(&conninfo(&db.cfg))
            .args(&["--sink", url, "--max-in-flight", &max, "--sweep-interval", "100ms"])
            .stdout(Output::Drained)
            .log_cap(64 * 1024)
            .start()
            .await?;
        util::wait_until(DRAIN_CAP, Duration::from_millis(20), || async {
            Ok(util::fresh_unpublished(&client).await? == 0)
        })
        .await?;
        let secs = started.elapsed().as_secs_f64();
        let left = util::fresh_unpublished(&client).await?;
        util::stop_relay(relay).await?;
        Ok::<_, pg_outbox_testkit::bench::BoxError>((n - left) as f64 / secs)
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// Run the scenario.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let (delays, events): (&[u64], i64) = if s.smoke {
        (&[5], 2_000)
    } else if s.quick {
        (&[0, 1, 5, 20], 20_000)
    } else {
        (&[0, 1, 5, 20], 100_000)
    };
    let mut sec = Section::new(
        "pipeline",
        "Pipelining: a relay into a webhook that answers after a round trip",
        &[
            "round trip",
            "plain client req/s (64 in flight)",
            "relay events/s (64 in flight)",
            "relay vs client",
            "relay one at a time, events/s",
            "speed-up",
        ],
    );
    let mut data = Vec::new();
    for &ms in delays {
        let delay = Duration::from_millis(ms);
        let (url, _count) = serve(delay).await?;
        let client_n = usize::try_from(events.min(20_000))?;
        let client_rate = plain_client(&url, client_n).await?;
        let pipelined = drain(ctx, &url, events, AGGREGATES, IN_FLIGHT).await?;
        // One at a time: a backlog it can drain within the cap or so.
        let serial_n = if ms == 0 { events.min(20_000) } else { (20_000 / i64::try_from(ms)?).min(events) };
        let serial = drain(ctx, &url, serial_n, AGGREGATES, 1).await?;
        eprintln!("e2e: pipeline: {ms} ms: client {client_rate:.0}/s, relay {pipelined:.0}/s (64), {serial:.0}/s (1)");
        let vs_client = ratio(pipelined, client_rate);
        let speed_up = ratio(pipelined, serial);
        sec.rows.push(vec![
            format!("{ms} ms"),
            fmt_count(client_rate),
            fmt_count(pipelined),
            fmt_ratio(vs_client),
            fmt_count(serial),
            fmt_ratio(speed_up),
        ]);
        if ms >= 5 {
            sec.target(format!("webhook at {ms} ms: relay vs plain client at least 0.5x"), vs_client, 0.5, false);
        }
        data.push(serde_json::json!({"round_trip_ms": ms, "client_per_second": client_rate,
            "relay_per_second": pipelined, "serial_per_second": serial, "vs_client": vs_client, "speed_up": speed_up}));
    }
    // Few aggregates: one in flight per aggregate caps the rate.
    let (url, _count) = serve(Duration::from_millis(5)).await?;
    let few: &[i64] = if s.smoke { &[4] } else { &[1, 4, 16] };
    let mut capped = Vec::new();
    for &aggregates in few {
        let n = (aggregates * 1_000).min(events);
        let rate = drain(ctx, &url, n, aggregates, IN_FLIGHT).await?;
        eprintln!("e2e: pipeline: 5 ms, {aggregates} aggregates: {rate:.0}/s");
        capped.push(format!("{aggregates}: {} events/s (cap {} /s)", fmt_count(rate), aggregates * 200));
        data.push(serde_json::json!({"round_trip_ms": 5, "aggregates": aggregates, "relay_per_second": rate}));
    }
    sec.notes.push(format!(
        "Backlog of {events} events (1.5 KB envelopes) over {AGGREGATES} aggregates, drained by `pg-outbox relay \
         --sink <webhook>` from its start until nothing is left (at most {} s; the rate is what was published in \
         it). The webhook is an axum server in the bench process that answers 200 after the round trip. Baseline: \
         a reqwest client posting 1.5 KB bodies to the same server, {IN_FLIGHT} in flight, in the same run. \
         One at a time: `--max-in-flight 1`, the relay's behaviour before pipelining. With few aggregates at 5 ms \
         (one send in flight per aggregate, so at most aggregates / 5 ms): {}.",
        DRAIN_CAP.as_secs(),
        capped.join("; ")
    ));
    sec.data = serde_json::Value::Array(data);
    Ok(sec)
}

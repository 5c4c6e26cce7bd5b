//! Producer cost of pg-outbox's triggers: insert throughput of producers
//! writing events, with the triggers against the same table without them,
//! measured in the same run and reported as ratios.
//!
//! Run it with `cargo bench --bench producers`. Server selection as in the
//! other benches (`DATABASE_URL`, 127.0.0.1:5432, or a throwaway server).
//!
//! Variants, each in a fresh migrated database with some triggers disabled,
//! and with a pg-outbox consumer draining the table while producers write
//! (as in production) unless said otherwise:
//! - `no triggers`: the seeded table alone (the baseline);
//! - `order only`: the per-aggregate order and wake-up trigger, without
//!   the update guard;
//! - `all triggers`: what `pg-outbox migrate` installs (order and wake-up,
//!   guard); the relay asks for notifications only while idle;
//! - `all triggers, no relay`: nobody registered, so every transaction
//!   notifies (the cost a plain notify trigger has).
//!
//! Each producer runs single-row autocommit INSERTs (the common producer
//! shape: one event per business transaction) for `BENCH_SECS` seconds
//! (default 3) at 1, 4 and 16 connections (`BENCH_CONNECTIONS`, comma
//! separated). Aggregates are either all distinct (`spread`) or 8 hot ones
//! (`hot`), where the order trigger serialises same-aggregate transactions
//! by design. Results go to stdout and `target/bench/producers.{md,json}`.

mod common;

use std::time::{Duration, Instant};

use common::{BenchResult, connect, drop_database, find_server, migrated_database, report_dir};
use pg_outbox::tokio_postgres::Config;

#[derive(Clone, Copy, Debug)]
struct Variant {
    name: &'static str,
    disable: &'static [&'static str],
    relay: bool,
}

const VARIANTS: [Variant; 4] = [
    Variant { name: "no triggers", disable: &["outbox_order", "outbox_guard"], relay: true },
    Variant { name: "order only", disable: &["outbox_guard"], relay: true },
    Variant { name: "all triggers", disable: &[], relay: true },
    Variant { name: "all triggers, no relay", disable: &[], relay: false },
];

/// A consumer acknowledging everything until stopped; returns events seen.
async fn relay(cfg: Config) -> BenchResult<(pg_outbox::ShutdownHandle, tokio::task::JoinHandle<u64>)> {
    use futures::StreamExt;
    let mut stream = pg_outbox::Consumer::builder(cfg).batch_size(200).start().await?;
    let handle = stream.shutdown_handle();
    let task = tokio::spawn(async move {
        let mut n = 0;
        while let Some(d) = stream.next().await {
            d.ack();
            n += 1;
        }
        let _ = stream.finish().await;
        n
    });
    Ok((handle, task))
}

/// Insert for `secs` seconds from `conns` connections; returns inserts/s.
async fn run_load(cfg: &Config, conns: usize, secs: f64, hot: bool) -> BenchResult<f64> {
    let hot_aggs: Vec<uuid::Uuid> = (0..8).map(|_| uuid::Uuid::new_v4()).collect();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for p in 0..conns {
        let cfg = cfg.clone();
        let hot_aggs = hot_aggs.clone();
        tasks.push(tokio::spawn(async move {
            let client = connect(&cfg).await?;
            let stmt = client
                .prepare(
                    "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ('bench', $1, 'Inserted', '{\"version\":1,\"data\":{\"amount\":990}}')",
                )
                .await?;
            let mut n = 0u64;
            while Instant::now() < deadline {
                let agg = if hot { hot_aggs[(p + n as usize) % hot_aggs.len()] } else { uuid::Uuid::new_v4() };
                client.execute(&stmt, &[&agg]).await?;
                n += 1;
            }
            Ok::<u64, common::BoxError>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / secs)
}

async fn bench() -> BenchResult<()> {
    let smoke = !common::is_bench_run();
    let secs: f64 =
        std::env::var("BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(if smoke { 0.2 } else { 3.0 });
    let conns: Vec<usize> = std::env::var("BENCH_CONNECTIONS")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| if smoke { vec![1] } else { vec![1, 4, 16] });
    let (admin_cfg, _server) = find_server().await?;
    let admin = connect(&admin_cfg).await?;
    let mut rows = Vec::new();
    let mut md =
        String::from("| variant | aggregates | connections | inserts/s | vs no triggers |\n|---|---|---:|---:|---:|\n");
    for hot in [false, true] {
        for &c in &conns {
            let mut base = None;
            for v in VARIANTS {
                let name = format!("pgo_bench_prod_{}", std::process::id());
                let cfg = migrated_database(&admin, &admin_cfg, &name).await?;
                let client = connect(&cfg).await?;
                for t in v.disable {
                    client.batch_execute(&format!("ALTER TABLE events.outbox DISABLE TRIGGER {t}")).await?;
                }
                let consumer = if v.relay { Some(relay(cfg.clone()).await?) } else { None };
                // Let the relay reach its idle state (asking for wake-ups).
                tokio::time::sleep(Duration::from_millis(200)).await;
                let rate = run_load(&cfg, c, secs, hot).await;
                if let Some((h, t)) = consumer {
                    h.shutdown();
                    let _ = t.await;
                }
                drop(client);
                drop_database(&admin, &name).await;
                let rate = rate?;
                let b = *base.get_or_insert(rate);
                let ratio = if b > 0.0 { rate / b } else { 0.0 };
                let aggs = if hot { "8 hot" } else { "spread" };
                md.push_str(&format!("| {} | {aggs} | {c} | {rate:.0} | {ratio:.2}x |\n", v.name));
                rows.push(serde_json::json!({"variant": v.name, "aggregates": aggs, "connections": c,
                    "inserts_per_second": rate, "ratio_vs_no_triggers": ratio}));
                eprintln!("bench: {} {aggs} x{c}: {rate:.0}/s ({ratio:.2}x)", v.name);
            }
        }
    }
    println!("{md}");
    if smoke {
        return Ok(());
    }
    let dir = report_dir();
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("producers.md"), &md)?;
    std::fs::write(
        dir.join("producers.json"),
        serde_json::to_string_pretty(&serde_json::json!({"seconds_per_run": secs, "results": rows}))?,
    )?;
    eprintln!("bench: wrote {}", dir.join("producers.md").display());
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::main_with(bench)
}

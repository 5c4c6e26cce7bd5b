//! Scenario `producers`: insert rate with pg-outbox's triggers (a relay
//! draining) against the same table without them (a relay draining too),
//! at several producer connection counts. The logic of
//! `benches/producers.rs`, reduced to the two variants.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pg_outbox::tokio_postgres::Config;

use crate::common::{BenchResult, BoxError, connect};
use crate::report::{Section, fmt_count, fmt_ratio, ratio};
use crate::util::{RelayProc, conninfo, scratch};
use crate::{Ctx, Settings};

/// The producers' statement: one single-row autocommit INSERT per business
/// transaction, a new aggregate each time, a small payload.
const INSERT: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
     VALUES ('bench', $1, 'Inserted', '{\"version\":1,\"data\":{\"amount\":990}}')";

/// Inserts are counted per slice of this length.
pub const SLICE: Duration = Duration::from_millis(250);

/// Insert for `secs` seconds from `conns` connections as fast as each can
/// (closed loop); returns the number of inserts committed in each
/// [`SLICE`] (the last one may be shorter), in order.
pub async fn run_load(cfg: &Config, conns: usize, secs: f64) -> BenchResult<Vec<u64>> {
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        let client = connect(cfg).await?;
        let stmt = client.prepare(INSERT).await?;
        clients.push((client, stmt));
    }
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for (client, stmt) in clients {
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                client.execute(&stmt, &[&uuid::Uuid::new_v4()]).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<(), BoxError>(())
        }));
    }
    let mut slices = Vec::new();
    let mut seen = 0;
    let mut at = start;
    while at < deadline {
        at = (at + SLICE).min(deadline);
        tokio::time::sleep_until(at.into()).await;
        let now = done.load(Ordering::Relaxed);
        slices.push(now - seen);
        seen = now;
    }
    for t in tasks {
        t.await??;
    }
    // Inserts sent before the deadline and committed after it count in the last slice.
    let last = done.load(Ordering::Relaxed) - seen;
    if let Some(l) = slices.last_mut() {
        *l += last;
    }
    Ok(slices)
}

/// Triggers disabled in the baseline: all of pg-outbox's insert and update
/// triggers, leaving the seeded table alone.
const OUR_TRIGGERS: [&str; 2] = ["outbox_order", "outbox_guard"];

/// One run of one variant at one connection count: inserts/s after the
/// warm-up, and during it.
async fn one(ctx: &Ctx, conns: usize, with_triggers: bool) -> BenchResult<(f64, f64)> {
    let (warmup, secs) = (ctx.settings.producer_warmup_secs, ctx.settings.producer_secs);
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "producers").await?;
    let result = async {
        if !with_triggers {
            let c = connect(&db.cfg).await?;
            for t in OUR_TRIGGERS {
                c.batch_execute(&format!("ALTER TABLE events.outbox DISABLE TRIGGER {t}")).await?;
            }
        }
        let relay = RelayProc::start(&conninfo(&db.cfg), &[], false).await?;
        // Let the relay reach its idle state (asking for wake-ups).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let slices = run_load(&db.cfg, conns, warmup + secs).await;
        relay.stop().await?;
        let slices = slices?;
        let warm = ((warmup / SLICE.as_secs_f64()).round() as usize).min(slices.len());
        let (during, after) = slices.split_at(warm);
        let rate = |s: &[u64], secs: f64| if secs > 0.0 { s.iter().sum::<u64>() as f64 / secs } else { 0.0 };
        Ok::<_, BoxError>((rate(after, secs), rate(during, warmup)))
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// The median of `v` (the mean of the middle two for an even count); 0 if empty.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Rates of the single runs, for the log: "1 234 / 1 250 / ...".
fn runs(v: &[f64]) -> String {
    v.iter().map(|r| fmt_count(*r)).collect::<Vec<_>>().join(" / ")
}

/// A procedure that commits `n` single-row inserts one by one, on the
/// server: each a transaction of its own, as an autocommit producer's, with
/// no client or network in the way.
const INSERT_LOOP: &str = "CREATE PROCEDURE public.pgo_bench_inserts(n integer) LANGUAGE plpgsql AS $$ \
     BEGIN FOR i IN 1..n LOOP \
       INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
       VALUES ('bench', gen_random_uuid(), 'Inserted', '{\"version\":1,\"data\":{\"amount\":990}}'); \
       COMMIT; \
     END LOOP; END $$";

/// The variants of [`server_cost`]: name, triggers enabled, and the value
/// of `events.outbox_hint` (0: every relay is busy, so the trigger takes its
/// fast path; 1: a relay waits, so every transaction notifies).
const SERVER_VARIANTS: [(&str, bool, i64); 3] =
    [("seeded table alone", false, 0), ("triggers, relay busy", true, 0), ("triggers, relay waiting", true, 1)];

/// Server time per single-row transaction for each of [`SERVER_VARIANTS`]:
/// `rounds` rounds of `n` inserts each (variants in a rotating order), with
/// `synchronous_commit=off` so the WAL flush does not drown the difference.
/// Returns, per variant, the microseconds per insert of every round.
async fn server_cost(ctx: &Ctx, n: i32, rounds: usize) -> BenchResult<Vec<Vec<f64>>> {
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "producers_server").await?;
    let result = async {
        let c = connect(&db.cfg).await?;
        c.batch_execute(INSERT_LOOP).await?;
        c.batch_execute("SET synchronous_commit = off").await?;
        let mut us = vec![Vec::new(); SERVER_VARIANTS.len()];
        for round in 0..rounds {
            for k in 0..SERVER_VARIANTS.len() {
                let v = (round + k) % SERVER_VARIANTS.len();
                let (_, with_triggers, hint) = SERVER_VARIANTS[v];
                let switch = if with_triggers { "ENABLE" } else { "DISABLE" };
                for t in OUR_TRIGGERS {
                    c.batch_execute(&format!("ALTER TABLE events.outbox {switch} TRIGGER {t}")).await?;
                }
                c.batch_execute("TRUNCATE events.outbox").await?;
                // No relay is registered here, so nothing refreshes the hint.
                c.execute("SELECT setval('events.outbox_hint', $1)", &[&hint]).await?;
                let t = Instant::now();
                c.execute("CALL public.pgo_bench_inserts($1)", &[&n]).await?;
                us[v].push(t.elapsed().as_secs_f64() * 1e6 / f64::from(n));
            }
        }
        Ok::<_, BoxError>(us)
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// Run both variants at every connection count.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let mut sec = Section::new(
        "producers",
        "Producer cost: insert rate with pg-outbox's triggers vs without",
        &["connections", "without triggers inserts/s", "with triggers inserts/s", "ratio", "warm-up ratio"],
    );
    let mut data = Vec::new();
    for &conns in &s.producer_connections {
        // Alternate the order (without, with; then with, without; ...) so a
        // drift of the machine's speed during the runs favours neither.
        let (mut bases, mut ourss) = (Vec::new(), Vec::new());
        let (mut warm_bases, mut warm_ourss) = (Vec::new(), Vec::new());
        for round in 0..s.producer_rounds.max(1) {
            for with in [round % 2 == 1, round % 2 == 0] {
                let (rate, warm) = one(ctx, conns, with).await?;
                if with { &mut ourss } else { &mut bases }.push(rate);
                if with { &mut warm_ourss } else { &mut warm_bases }.push(warm);
            }
        }
        // The ratio is the median of each round's ratio (its two runs ran
        // back to back), so a drift of the machine over the rounds cancels.
        let mut pairs: Vec<f64> = ourss.iter().zip(&bases).filter_map(|(o, b)| ratio(*o, *b)).collect();
        let mut warm_pairs: Vec<f64> = warm_ourss.iter().zip(&warm_bases).filter_map(|(o, b)| ratio(*o, *b)).collect();
        let in_order = serde_json::json!({"runs_without_per_second": bases, "runs_with_per_second": ourss,
            "round_ratios": pairs, "warmup_round_ratios": warm_pairs});
        let median_ratio = |v: &mut Vec<f64>| (!v.is_empty()).then(|| median(v));
        let (r, warm_r) = (median_ratio(&mut pairs), median_ratio(&mut warm_pairs));
        let (runs_base, runs_ours) = (runs(&bases), runs(&ourss));
        let (base, ours) = (median(&mut bases), median(&mut ourss));
        let (warm_base, warm_ours) = (median(&mut warm_bases), median(&mut warm_ourss));
        eprintln!(
            "e2e: producers x{conns}: without {base:.0}/s, with {ours:.0}/s (median round ratio {}; runs in order \
             without {runs_base}, with {runs_ours}); warm-up without {warm_base:.0}/s, with {warm_ours:.0}/s ({})",
            fmt_ratio(r),
            fmt_ratio(warm_r)
        );
        sec.rows.push(vec![conns.to_string(), fmt_count(base), fmt_count(ours), fmt_ratio(r), fmt_ratio(warm_r)]);
        if conns >= 4 {
            sec.target(format!("insert rate with triggers >= 0.95x without at {conns} connections"), r, 0.95, false);
        }
        data.push(serde_json::json!({"connections": conns, "without_triggers_per_second": base,
            "with_triggers_per_second": ours, "ratio": r,
            "in_order": in_order, "warmup_ratio": warm_r,
            "warmup_without_per_second": warm_base, "warmup_with_per_second": warm_ours}));
    }
    sec.notes.push(format!(
        "Single-row autocommit INSERTs, a new aggregate each, each run in a fresh database \
         with a `pg-outbox relay --sink stdout` draining (its stdout a pipe the bench reads and discards): {} s of \
         warm-up, then {} s counted. The warm-up is left out of the ratio because the baseline's relay, never \
         notified, finds events only at its first sweep (about 1 s in) and until then leaves the producers the \
         whole machine; its own ratio (`warm-up ratio`: it also holds any start-of-burst cost of NOTIFY) is shown \
         beside. {} round(s) per connection count, each a run of both variants back to back, alternating which \
         goes first; the rates are the median runs, the ratios the median of the rounds' ratios. Baseline in the same run: the same table with pg-outbox's triggers ({}) disabled.",
        s.producer_warmup_secs,
        s.producer_secs,
        s.producer_rounds.max(1),
        OUR_TRIGGERS.join(", ")
    ));
    let (n, rounds) = if s.smoke {
        (500, 1)
    } else if s.quick {
        (5_000, 3)
    } else {
        (20_000, 7)
    };
    let us = server_cost(ctx, n, rounds).await?;
    let base = us[0].clone();
    let mut parts = Vec::new();
    let mut server = Vec::new();
    for (i, ((name, _, hint), runs)) in SERVER_VARIANTS.iter().zip(&us).enumerate() {
        // Per round against the baseline's run of the same round.
        let mut added: Vec<f64> = runs.iter().zip(&base).map(|(v, b)| v - b).collect();
        let mut per = runs.clone();
        let (median_us, added_us) = (median(&mut per), median(&mut added));
        parts.push(if i == 0 {
            format!("{name} {median_us:.1} µs")
        } else {
            format!("{name} {median_us:.1} µs ({added_us:+.1} µs)")
        });
        server.push(serde_json::json!({"variant": name, "hint": hint, "us_per_insert": median_us,
            "added_us_median": added_us, "rounds_us": runs}));
    }
    sec.notes.push(format!(
        "Server time per single-row transaction ({rounds} round(s) of {n} inserts committed one by one inside a \
         procedure, `synchronous_commit=off`, no client in the way; median, and in brackets the median of each \
         round's difference to the seeded table): {}.",
        parts.join("; ")
    ));
    sec.data = serde_json::json!({"connections": data, "server_time": server});
    Ok(sec)
}

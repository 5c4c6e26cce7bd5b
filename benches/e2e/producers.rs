//! Scenario `producers`: insert rate with pg-outbox's triggers (a relay
//! draining) against the same table without them (a relay draining too),
//! at several producer connection counts, and against an empty PL/pgSQL
//! row trigger (the floor of any such trigger). Scenario `trigger-split`:
//! where the triggers' cost goes, step by step, with 8 hot aggregates
//! (which the order trigger serialises by design) and with no relay at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pg_outbox::tokio_postgres::Config;

use crate::report::{Section, fmt_count, fmt_ratio, ratio};
use crate::util::{conninfo, scratch, server_cpu_us, start_relay, stop_relay};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;

/// The producers' statement: one single-row autocommit INSERT per business
/// transaction, a small payload; the aggregate is a parameter.
pub const INSERT: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
     VALUES ('bench', $1, 'Inserted', '{\"version\":1,\"data\":{\"amount\":990}}')";

/// Inserts are counted per slice of this length.
pub const SLICE: Duration = Duration::from_millis(250);

/// What [`run_load`] measured.
pub struct Load {
    /// Inserts committed in each [`SLICE`] (the last one may be shorter), in order.
    pub slices: Vec<u64>,
    /// How many of the first slices are the warm-up.
    pub warm_slices: usize,
    /// CPU time (microseconds, from `/proc`) the producers' server processes
    /// used from the end of the warm-up slices to the end; `None` where
    /// unreadable (a server on another machine or in a container).
    pub backend_cpu_us: Option<f64>,
}

/// Total CPU time (microseconds) of the server processes `pids`; `None` if
/// any is unreadable.
fn cpu_of(pids: &[u32]) -> Option<f64> {
    pids.iter().map(|p| server_cpu_us(*p)).sum()
}

/// Insert for `secs` seconds from `conns` connections as fast as each can
/// (closed loop), the first `warmup` seconds of them (rounded to whole
/// [`SLICE`]s) a warm-up: in the slices, left out of [`Load::backend_cpu_us`].
/// Each insert is for a new aggregate, or with `hot` > 0 for one of `hot`
/// aggregates, each connection going round them from its own start.
pub async fn run_load(cfg: &Config, conns: usize, secs: f64, warmup: f64, hot: usize) -> BenchResult<Load> {
    let hot_aggs: Arc<Vec<uuid::Uuid>> = Arc::new((0..hot).map(|_| uuid::Uuid::new_v4()).collect());
    let mut clients = Vec::with_capacity(conns);
    let mut pids = Vec::with_capacity(conns);
    for _ in 0..conns {
        let client = connect(cfg).await?;
        let stmt = client.prepare(INSERT).await?;
        let pid: i32 = client.query_one("SELECT pg_backend_pid()", &[]).await?.try_get(0)?;
        pids.push(u32::try_from(pid)?);
        clients.push((Arc::new(client), stmt));
    }
    // Held until the CPU is read: a closed connection's server process is gone.
    let keep: Vec<_> = clients.iter().map(|(c, _)| c.clone()).collect();
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for (p, (client, stmt)) in clients.into_iter().enumerate() {
        let done = done.clone();
        let hot_aggs = hot_aggs.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < deadline {
                let agg = if hot_aggs.is_empty() { uuid::Uuid::new_v4() } else { hot_aggs[(p + n) % hot_aggs.len()] };
                client.execute(&stmt, &[&agg]).await?;
                done.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok::<(), BoxError>(())
        }));
    }
    let mut slices = Vec::new();
    let mut seen = 0;
    let mut at = start;
    let warm_slices = (warmup.max(0.0) / SLICE.as_secs_f64()).round() as usize;
    let mut cpu_at_warm_end = if warm_slices == 0 { cpu_of(&pids) } else { None };
    while at < deadline {
        at = (at + SLICE).min(deadline);
        tokio::time::sleep_until(at.into()).await;
        let now = done.load(Ordering::Relaxed);
        slices.push(now - seen);
        seen = now;
        if slices.len() == warm_slices && at < deadline {
            cpu_at_warm_end = cpu_of(&pids);
        }
    }
    let cpu_at_end = cpu_of(&pids);
    drop(keep);
    for t in tasks {
        t.await??;
    }
    // Inserts sent before the deadline and committed after it count in the last slice.
    let last = done.load(Ordering::Relaxed) - seen;
    if let Some(l) = slices.last_mut() {
        *l += last;
    }
    let backend_cpu_us = match (cpu_at_warm_end, cpu_at_end) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let warm_slices = warm_slices.min(slices.len());
    Ok(Load { slices, warm_slices, backend_cpu_us })
}

/// Triggers disabled in the baseline: all of pg-outbox's insert and update
/// triggers, leaving the seeded table alone.
const OUR_TRIGGERS: [&str; 2] = ["outbox_order", "outbox_guard"];

/// The table a run inserts into: pg-outbox's triggers enabled or not, and
/// optionally a PL/pgSQL row trigger of the bench's own; and how the run
/// uses it (a relay draining or not, new or hot aggregates).
#[derive(Clone, Copy)]
struct Table {
    /// Name in the report.
    name: &'static str,
    /// pg-outbox's triggers enabled ([`OUR_TRIGGERS`]).
    ours: bool,
    /// With `ours`: the `producer-locked` ordering mode installed
    /// (`events.outbox_set_ordering`), else the default `outbox-locked`.
    producer_locked: bool,
    /// With a `BEFORE INSERT ... FOR EACH ROW` PL/pgSQL trigger whose body
    /// runs these statements, then `RETURN NEW`.
    trigger: Option<&'static str>,
    /// A `pg-outbox relay` draining while the producers insert.
    relay: bool,
    /// Inserts go round this many aggregates (0: a new aggregate each).
    hot: usize,
}

/// The seeded table alone: pg-outbox's triggers disabled (the baseline).
const SEEDED: Table =
    Table { name: "without triggers", ours: false, producer_locked: false, trigger: None, relay: true, hot: 0 };
/// What `pg-outbox migrate` installs.
const OURS: Table =
    Table { name: "pg-outbox's triggers", ours: true, producer_locked: false, trigger: None, relay: true, hot: 0 };
/// The seeded table with a PL/pgSQL row trigger that does nothing: what any
/// PL/pgSQL row trigger costs before it does any work (a reference).
const EMPTY: Table = Table {
    name: "empty trigger (RETURN NEW)",
    ours: false,
    producer_locked: false,
    trigger: Some(""),
    relay: true,
    hot: 0,
};
/// What `pg-outbox migrate --ordering producer-locked` installs: only the
/// statement trigger that wakes a waiting relay.
const PRODUCER_LOCKED: Table = Table {
    name: "pg-outbox's triggers, producer-locked",
    ours: true,
    producer_locked: true,
    trigger: None,
    relay: true,
    hot: 0,
};
/// How many hot aggregates the hot variants of [`split`] insert into.
const HOT: usize = 8;
/// A single-row trigger body for [`SPLIT`]: the seeded table, a relay, new aggregates.
const fn step(name: &'static str, body: &'static str) -> Table {
    Table { name, ours: false, producer_locked: false, trigger: Some(body), relay: true, hot: 0 }
}

/// The variants of [`run`], in the order of a round's first run.
const VARIANTS: [Table; 4] = [SEEDED, OURS, EMPTY, PRODUCER_LOCKED];

/// The variants of [`split`]: the steps of pg-outbox's fast path one at a
/// time, each in a trigger of its own on the seeded table. The lock key is
/// the one `triggers/outbox_insert_order_and_notify.sql` uses; every aggregate is new, so the
/// lock is always free.
const SPLIT: [Table; 11] = [
    SEEDED,
    OURS,
    EMPTY,
    step("assign NEW.id", "NEW.id := NEW.id;"),
    step(
        "assign through a CASE of the lock key's hashes",
        "NEW.id := CASE WHEN uuid_hash_extended(NEW.aggregate_id, \
         hashtextextended(NEW.aggregate_type, 1886322691)) <> 0 THEN NEW.id ELSE NEW.id END;",
    ),
    step(
        "advisory lock in that CASE",
        "NEW.id := CASE WHEN pg_try_advisory_xact_lock(uuid_hash_extended(NEW.aggregate_id, \
         hashtextextended(NEW.aggregate_type, 1886322691))) THEN NEW.id ELSE NEW.id END;",
    ),
    step("second id (nextval)", "NEW.id := nextval('events.outbox_id_seq'::regclass);"),
    step(
        "hint read and second id",
        "NEW.id := CASE WHEN pg_sequence_last_value('events.outbox_hint'::regclass) >= 0 \
         THEN nextval('events.outbox_id_seq'::regclass) ELSE NEW.id END;",
    ),
    // No relay registered: every transaction notifies (the trigger's answer
    // when nobody says whether it waits).
    Table {
        name: "pg-outbox's triggers, no relay",
        ours: true,
        producer_locked: false,
        trigger: None,
        relay: false,
        hot: 0,
    },
    // Hot aggregates: same-aggregate transactions queue on the order lock.
    Table {
        name: "without triggers, 8 hot aggregates",
        ours: false,
        producer_locked: false,
        trigger: None,
        relay: true,
        hot: HOT,
    },
    Table {
        name: "pg-outbox's triggers, 8 hot aggregates",
        ours: true,
        producer_locked: false,
        trigger: None,
        relay: true,
        hot: HOT,
    },
];

/// The run of [`SPLIT`] a table is compared with: the seeded table with as
/// many hot aggregates.
fn baseline_of(table: &Table) -> usize {
    SPLIT.iter().position(|t| !t.ours && t.trigger.is_none() && t.relay && t.hot == table.hot).unwrap_or(0)
}

/// One run's figures (after the warm-up, unless said).
struct Run {
    /// Inserts/s after the warm-up.
    rate: f64,
    /// Inserts/s during the warm-up.
    warm_rate: f64,
    /// CPU time of the producers' server processes per insert (microseconds).
    backend_us: Option<f64>,
}

/// One run of one variant at one connection count.
async fn one(ctx: &Ctx, conns: usize, table: Table) -> BenchResult<Run> {
    let (warmup, secs) = (ctx.settings.producer_warmup_secs, ctx.settings.producer_secs);
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "producers").await?;
    let result = async {
        let c = connect(&db.cfg).await?;
        if table.producer_locked {
            c.execute("SELECT events.outbox_set_ordering('producer-locked')", &[]).await?;
        }
        if !table.ours {
            for t in OUR_TRIGGERS {
                c.batch_execute(&format!("ALTER TABLE events.outbox DISABLE TRIGGER {t}")).await?;
            }
        }
        if let Some(body) = table.trigger {
            c.batch_execute(&format!(
                "CREATE FUNCTION public.pgo_bench_trigger() RETURNS trigger LANGUAGE plpgsql \
                 AS $$ BEGIN {body} RETURN NEW; END $$; \
                 CREATE TRIGGER pgo_bench_trigger BEFORE INSERT ON events.outbox \
                 FOR EACH ROW EXECUTE FUNCTION public.pgo_bench_trigger()"
            ))
            .await?;
        }
        drop(c);
        let relay = if table.relay { Some(start_relay(&conninfo(&db.cfg), &[], false).await?) } else { None };
        // Let the relay reach its idle state (asking for wake-ups).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let load = run_load(&db.cfg, conns, warmup + secs, warmup, table.hot).await;
        if let Some(relay) = relay {
            stop_relay(relay).await?;
        }
        let load = load?;
        let (during, after) = load.slices.split_at(load.warm_slices);
        let counted: u64 = after.iter().sum();
        let rate = |s: &[u64], secs: f64| if secs > 0.0 { s.iter().sum::<u64>() as f64 / secs } else { 0.0 };
        let backend_us = load.backend_cpu_us.filter(|_| counted > 0).map(|us| us / counted as f64);
        Ok::<_, BoxError>(Run { rate: rate(after, secs), warm_rate: rate(during, warmup), backend_us })
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// The median of `v` (the mean of the middle two for an even count); 0 if empty.
pub fn median(v: &mut [f64]) -> f64 {
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

/// `rounds` (at least one) rounds of a run of every table at `conns`
/// connections, back to back, each round starting one further, so a drift
/// of the machine's speed favours none; per table, its runs in round order.
async fn rounds(ctx: &Ctx, conns: usize, tables: &[Table], rounds: usize) -> BenchResult<Vec<Vec<Run>>> {
    let mut runs_of: Vec<Vec<Run>> = tables.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds.max(1) {
        for k in 0..tables.len() {
            let v = (round + k) % tables.len();
            runs_of[v].push(one(ctx, conns, tables[v]).await?);
        }
    }
    Ok(runs_of)
}

/// One table's runs against the baseline's runs of the same rounds.
struct Versus {
    /// Median inserts/s.
    rate: f64,
    /// Each round's rate ratio to the baseline's run of that round (its
    /// runs ran back to back, so a drift of the machine over the rounds cancels).
    round_ratios: Vec<f64>,
    /// Median of `round_ratios`.
    ratio: Option<f64>,
    /// Median server CPU per insert (µs); `None` unless every run has it.
    cpu_us: Option<f64>,
    /// Median of each round's CPU difference to the baseline (µs).
    added_us: Option<f64>,
}

/// `of` against `base` (runs in the same round order).
fn versus(of: &[Run], base: &[Run]) -> Versus {
    let round_ratios: Vec<f64> = of.iter().zip(base).filter_map(|(o, b)| ratio(o.rate, b.rate)).collect();
    let ratio = (!round_ratios.is_empty()).then(|| median(&mut round_ratios.clone()));
    let cpu = |runs: &[Run]| runs.iter().map(|r| r.backend_us).collect::<Option<Vec<f64>>>();
    let (cpu_us, added_us) = match (cpu(of), cpu(base)) {
        (Some(mut c), Some(b)) if !c.is_empty() => {
            let mut d: Vec<f64> = c.iter().zip(&b).map(|(c, b)| c - b).collect();
            (Some(median(&mut c)), Some(median(&mut d)))
        }
        _ => (None, None),
    };
    let rate = median(&mut of.iter().map(|r| r.rate).collect::<Vec<f64>>());
    Versus { rate, round_ratios, ratio, cpu_us, added_us }
}

/// Scenario `trigger-split` (run only when named): the producers' server CPU
/// per insert and the insert rate for each of [`SPLIT`], against the seeded
/// table, at `Settings::split_connections` connections. Where the fast
/// path's time goes; no target.
pub async fn split(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let mut sec = Section::new(
        "trigger-split",
        "Producer cost split: the trigger's fast path one step at a time",
        &["connections", "table", "inserts/s", "vs without triggers", "server CPU µs/insert", "added µs/insert"],
    );
    let mut data = Vec::new();
    for &conns in &s.split_connections {
        let runs_of = rounds(ctx, conns, &SPLIT, s.split_rounds).await?;
        for (table, of) in SPLIT.iter().zip(&runs_of) {
            let base = &runs_of[baseline_of(table)];
            let Versus { rate, ratio: r, cpu_us: us, added_us: added, .. } = versus(of, base);
            let fmt_us = |v: Option<f64>, sign: bool| match v {
                Some(v) if sign => format!("{v:+.1}"),
                Some(v) => format!("{v:.1}"),
                None => "n/a".into(),
            };
            eprintln!(
                "e2e: trigger-split x{conns}: {}: {rate:.0}/s ({}), server CPU {} µs/insert ({})",
                table.name,
                fmt_ratio(r),
                fmt_us(us, false),
                fmt_us(added, true)
            );
            sec.rows.push(vec![
                conns.to_string(),
                table.name.to_string(),
                fmt_count(rate),
                fmt_ratio(r),
                fmt_us(us, false),
                fmt_us(added, true),
            ]);
            data.push(serde_json::json!({"connections": conns, "table": table.name, "trigger_body": table.trigger,
                "relay": table.relay, "hot_aggregates": table.hot,
                "per_second": rate, "ratio": r, "backend_cpu_us_per_insert": us, "added_us_median": added,
                "runs_in_order": {"per_second": of.iter().map(|r| r.rate).collect::<Vec<_>>(),
                    "backend_cpu_us_per_insert": of.iter().map(|r| r.backend_us).collect::<Vec<_>>()}}));
        }
    }
    sec.notes.push(format!(
        "Runs as in `producers` ({} s warm-up, {} s counted, a relay draining), {} round(s), each a run of every \
         table back to back, starting one further each round. Every table but pg-outbox's has pg-outbox's \
         triggers disabled and, except the baseline, one PL/pgSQL `BEFORE INSERT` row trigger of its own that \
         runs the step named, then `RETURN NEW` (bodies in `e2e.json`). Two more runs of pg-outbox's triggers: \
         with no relay running (nobody registered, so every transaction notifies), and with the inserts going \
         round {HOT} hot aggregates (the order trigger serialises same-aggregate transactions by design; compared \
         with the seeded table under the same {HOT} aggregates). Server CPU: the producers' own server \
         processes (`/proc`), median of the runs; added: median of each round's difference to the run without \
         triggers (with as many hot aggregates). Differences of 1 to 2 µs are within this measurement's spread; \
         read them as ranges.",
        s.producer_warmup_secs,
        s.producer_secs,
        s.split_rounds.max(1)
    ));
    sec.data = serde_json::json!(data);
    Ok(sec)
}

/// Run every variant at every connection count.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let mut sec = Section::new(
        "producers",
        "Producer cost: insert rate in each ordering mode vs without triggers",
        &[
            "connections",
            "without triggers inserts/s",
            "producer-locked inserts/s",
            "producer-locked ratio",
            "outbox-locked (default) inserts/s",
            "outbox-locked ratio",
            "outbox-locked vs empty trigger",
            "outbox-locked warm-up ratio",
            "empty trigger ratio",
            "producers' server CPU µs/insert: without / outbox-locked / empty trigger / producer-locked",
        ],
    );
    let mut data = Vec::new();
    for &conns in &s.producer_connections {
        let runs_of = rounds(ctx, conns, &VARIANTS, s.producer_rounds).await?;
        let [seeded, ours, empty, locked] = [0, 1, 2, 3].map(|v| &runs_of[v]);
        let (base, our, emp, pl) =
            (versus(seeded, seeded), versus(ours, seeded), versus(empty, seeded), versus(locked, seeded));
        let our_vs_empty = versus(ours, empty);
        let mut warm_pairs: Vec<f64> =
            ours.iter().zip(seeded).filter_map(|(o, b)| ratio(o.warm_rate, b.warm_rate)).collect();
        let warm_r = (!warm_pairs.is_empty()).then(|| median(&mut warm_pairs));
        let (r, empty_r, pl_r) = (our.ratio, emp.ratio, pl.ratio);
        let rates = |of: &[Run]| of.iter().map(|r| r.rate).collect::<Vec<f64>>();
        let (runs_base, runs_ours, runs_empty, runs_pl) =
            (runs(&rates(seeded)), runs(&rates(ours)), runs(&rates(empty)), runs(&rates(locked)));
        let cpu_fig = match (base.cpu_us, our.cpu_us, emp.cpu_us, pl.cpu_us, our.added_us, emp.added_us, pl.added_us) {
            (Some(b), Some(o), Some(e), Some(l), Some(ao), Some(ae), Some(al)) => Some((b, o, e, l, ao, ae, al)),
            _ => None,
        };
        let cpu_cell = match cpu_fig {
            Some((b, o, e, l, ao, ae, al)) => {
                format!("{b:.1} / {o:.1} ({ao:+.1}) / {e:.1} ({ae:+.1}) / {l:.1} ({al:+.1})")
            }
            None => "n/a (server not local)".into(),
        };
        let (pairs, empty_pairs, pl_pairs) = (our.round_ratios, emp.round_ratios, pl.round_ratios);
        let (base, our, emp, pl) = (base.rate, our.rate, emp.rate, pl.rate);
        eprintln!(
            "e2e: producers x{conns}: without {base:.0}/s, with {our:.0}/s (median round ratio {}), empty trigger \
             {emp:.0}/s ({}), producer-locked {pl:.0}/s ({}); runs in order: without {runs_base}, with {runs_ours}, \
             empty trigger {runs_empty}, producer-locked {runs_pl}; server CPU µs/insert {cpu_cell}",
            fmt_ratio(r),
            fmt_ratio(empty_r),
            fmt_ratio(pl_r)
        );
        sec.rows.push(vec![
            conns.to_string(),
            fmt_count(base),
            fmt_count(pl),
            fmt_ratio(pl_r),
            fmt_count(our),
            fmt_ratio(r),
            fmt_ratio(our_vs_empty.ratio),
            fmt_ratio(warm_r),
            fmt_ratio(empty_r),
            cpu_cell,
        ]);
        if conns >= 4 {
            sec.target(
                format!("producer-locked insert rate >= 0.97x without at {conns} connections"),
                pl_r,
                0.97,
                false,
            );
        }
        let cpu_json = cpu_fig.map(|(b, o, e, l, ao, ae, al)| {
            serde_json::json!({"without_us": b, "with_us": o, "empty_trigger_us": e, "producer_locked_us": l,
                "with_added_us_median": ao, "empty_trigger_added_us_median": ae, "producer_locked_added_us_median": al})
        });
        let in_order = |of: &[Run]| {
            serde_json::json!({"per_second": rates(of), "warmup_per_second": of.iter().map(|r| r.warm_rate).collect::<Vec<_>>(),
                "backend_cpu_us_per_insert": of.iter().map(|r| r.backend_us).collect::<Vec<_>>()})
        };
        data.push(serde_json::json!({"connections": conns, "without_triggers_per_second": base,
            "with_triggers_per_second": our, "empty_trigger_per_second": emp, "producer_locked_per_second": pl,
            "ratio": r, "producer_locked_ratio": pl_r, "with_triggers_vs_empty_trigger": our_vs_empty.ratio,
            "warmup_ratio": warm_r, "empty_trigger_ratio": empty_r,
            "round_ratios": pairs, "empty_trigger_round_ratios": empty_pairs, "producer_locked_round_ratios": pl_pairs,
            "backend_cpu_us_per_insert": cpu_json,
            "runs_in_order": {"without": in_order(seeded), "with": in_order(ours), "empty_trigger": in_order(empty),
                "producer_locked": in_order(locked)}}));
    }
    sec.notes.push(format!(
        "Single-row autocommit INSERTs, a new aggregate each, each run in a fresh database \
         with a `pg-outbox relay --sink stdout` draining (its stdout a pipe the bench reads and discards): {} s of \
         warm-up, then {} s counted. The warm-up is left out of the ratio because the baseline's relay, never \
         notified, finds events only at its first sweep (about 1 s in) and until then leaves the producers the \
         whole machine; its own ratio (`warm-up ratio`: it also holds any start-of-burst cost of NOTIFY) is shown \
         beside. {} round(s) per connection count, each a run of every variant back to back, starting with the \
         next one each round; the rates are the median runs, the ratios the median of the rounds' ratios. \
         Baseline in the same run: the same table with pg-outbox's triggers ({}) disabled. Reference: the same \
         table with a PL/pgSQL row trigger that only returns NEW (`empty trigger`): the cost of any PL/pgSQL row \
         trigger before it does work; `outbox-locked vs empty trigger` is therefore what the order guarantee's \
         own work costs beyond any row trigger. `producer-locked`: the same table after \
         `events.outbox_set_ordering('producer-locked')` (the order trigger disabled, only the wake-up statement \
         trigger enabled, called only while the relay waits); the producers' statement is the same in every \
         variant (a real producer of that mode also locks its aggregate's row, in every variant alike). \
         Server CPU: CPU time of the producers' own server processes \
         (`/proc`, after the warm-up) per insert, median of the runs; in brackets the median of each round's \
         difference to the run without triggers.",
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

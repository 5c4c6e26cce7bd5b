//! The console's pages on a large outbox: server time of the overview, the
//! dead-letter pages (first, deep, filtered) and an event page, with
//! 1 000 000 published events, then 1 000 000 unpublished events and
//! 100 000 dead letters in the table (target: under 100 ms each), and the
//! library reads behind each page measured alone, to tell where the time
//! goes. `pg_outbox::status::read` is timed in three statistics states, as users
//! meet them: stale (analyzed at the steady state, before the backlog and
//! the dead letters came), current (analyzed), and absent (the table's
//! statistics deleted, where the role may), each beside the baseline of an
//! exact `count(*)` of the unpublished rows in the same state, with the
//! estimate's error against the exact figures.
//!
//! Named subscriptions: two are created on the published history (`audit`
//! at cursor 0, `search` caught up, 300 failure rows each), and the
//! statements that read their lag and backlog (the relay's gauges,
//! `subscription list`, the lag alert's read) are measured there, then on
//! the whole table in each statistics state: shared buffers touched
//! (`EXPLAIN (ANALYZE, BUFFERS)`) and time, which must not grow with it.
//!
//! Run it with `cargo bench --features full --bench console`
//! (`BENCH_CONSOLE_PUBLISHED`, `BENCH_CONSOLE_UNPUBLISHED`,
//! `BENCH_CONSOLE_DEAD` change the sizes; the scale is
//! `BENCH_CONSOLE_UNPUBLISHED=10000000 BENCH_CONSOLE_DEAD=1000000`).
//! It uses `DATABASE_URL`, else the server on 127.0.0.1:5432 or the local
//! socket, else a throwaway one (the test kit's `find_server`); it loads a
//! scratch database `pgo_bench_console`, starts `pg-outbox console` on a
//! free port, times each page (2 warm-up requests, then 10; minimum,
//! median, maximum) over loopback HTTP, and drops the database. The overview serves the backlog figures from the last reading
//! when counting them takes longer than 200 ms (the warm-up requests wait
//! for the first one); `pg_outbox::status::read` below is what one reading costs.

use std::future::Future;
use std::process::Stdio;
use std::time::{Duration, Instant};

use pg_outbox::dead_letters::Filter;
use pg_outbox::tokio_postgres::Client;
use pg_outbox::tokio_postgres::types::ToSql;
use pg_outbox_testkit::bench::{self, BenchResult};
use pg_outbox_testkit::db::{drop_database, migrated_database};
use pg_outbox_testkit::{connect, find_server, process};
use tokio::io::{AsyncBufReadExt, BufReader};

const DB: &str = "pgo_bench_console";
const RUNS: usize = 10;

fn size(var: &str, default: i64) -> i64 {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Milliseconds of `RUNS` runs of `f` after two warm-up runs: (min, median, max).
async fn time<F, Fut>(mut f: F) -> BenchResult<(f64, f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = BenchResult<()>>,
{
    for _ in 0..2 {
        f().await?;
    }
    let mut ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        f().await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    Ok((ms[0], ms[RUNS / 2], ms[RUNS - 1]))
}

fn line(what: &str, (min, med, max): (f64, f64, f64)) {
    let mark = if med < 100.0 { "" } else { "  (over 100 ms)" };
    eprintln!("{what:<52} {min:>8.1} {med:>8.1} {max:>8.1}{mark}");
}

async fn run() -> BenchResult<()> {
    let unpublished = size("BENCH_CONSOLE_UNPUBLISHED", 1_000_000);
    let dead = size("BENCH_CONSOLE_DEAD", 100_000);
    let published = size("BENCH_CONSOLE_PUBLISHED", 1_000_000);
    let server = find_server().await?;
    eprintln!("bench: using {}", server.source);
    let admin = connect(&server.config).await?;
    let cfg = migrated_database(&admin, &server.config, DB).await?;
    let c = connect(&cfg).await?;
    let url = db_url(&cfg);
    let t = Instant::now();
    load_history(&c, published).await?;
    let lib = pg_outbox::ConnectOptions::parse(&url)?.connect().await?;
    create_subscriptions(&c).await?;
    subscription_reads(&lib, &format!("{published} rows, analyzed")).await?;
    load_backlog(&c, unpublished, dead).await?;
    eprintln!(
        "bench: loaded {published} published, then {unpublished} unpublished events and {dead} dead letters in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    c.batch_execute(
        "UPDATE events.outbox_subscriptions SET cursor_id = (SELECT max(id) FROM events.outbox) WHERE name = 'search'",
    )
    .await?;
    let rows = published + unpublished + dead;
    subscription_reads(&lib, &format!("{rows} rows, statistics stale")).await?;

    let (child, port) = start_console(&url).await?;
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deep: i64 = c
        .query_one(
            "SELECT id FROM events.outbox WHERE published_at IS NULL AND next_retry_at = 'infinity' \
             ORDER BY id + 0 OFFSET $1 LIMIT 1",
            &[&(dead * 9 / 10)],
        )
        .await?
        .get(0);

    eprintln!("{:<52} {:>8} {:>8} {:>8}", "ms (loopback HTTP: the page's server time)", "min", "median", "max");
    for (what, path) in [
        ("GET /  (overview)", "/".to_string()),
        ("GET /dead-letters  (first page + count)", "/dead-letters".to_string()),
        ("GET /dead-letters?after=… (90 % deep)", format!("/dead-letters?after={deep}")),
        ("GET /dead-letters?event_type=…&error=timeout", "/dead-letters?event_type=InvoiceIssued&error=timeout".into()),
        ("GET /events/ID  (a dead letter)", format!("/events/{deep}")),
    ] {
        let u = format!("{base}{path}");
        let r = time(|| {
            let (http, u) = (http.clone(), u.clone());
            async move {
                let resp = http.get(&u).send().await?;
                if !resp.status().is_success() {
                    return Err(format!("{u}: {}", resp.status()).into());
                }
                resp.bytes().await?;
                Ok(())
            }
        })
        .await?;
        line(what, r);
    }

    let lib = &lib;
    library_reads(lib, deep).await?;
    drop(child);
    status_states(lib, &c).await?;
    drop_database(&admin, DB).await;
    Ok(())
}

/// The scratch database's URL, for the console and the library's sessions.
fn db_url(cfg: &pg_outbox::tokio_postgres::Config) -> String {
    format!(
        "postgres://{}@{}:{}/{DB}?sslmode=disable",
        cfg.get_user().unwrap_or("postgres"),
        match cfg.get_hosts().first() {
            Some(pg_outbox::tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".into(),
        },
        cfg.get_ports().first().copied().unwrap_or(5432)
    )
}

/// The steady state: `published` events of published history, analyzed.
async fn load_history(c: &Client, published: i64) -> BenchResult<()> {
    // Row triggers off for the load (the triggers' locks leave nothing
    // behind once committed).
    c.batch_execute(&format!(
        "SET session_replication_role = replica; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, published_at) \
         SELECT 'history', md5('h-' || (g % 100000))::uuid, 'PaymentSucceeded', \
                jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g)), now() - interval '1 day' \
         FROM generate_series(1, {published}::bigint) g; \
         RESET session_replication_role; ANALYZE events.outbox;"
    ))
    .await?;
    Ok(())
}

/// Then `unpublished` fresh events over 100 000 aggregates, then `dead`
/// dead letters on their own aggregates, two error texts, with no ANALYZE
/// after them (stale statistics, as an outage leaves them).
async fn load_backlog(c: &Client, unpublished: i64, dead: i64) -> BenchResult<()> {
    c.batch_execute(&format!(
        "SET session_replication_role = replica; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT (ARRAY['subscription','invoice','account'])[1 + g % 3], md5('a-' || (g % 100000))::uuid, \
                (ARRAY['PaymentSucceeded','InvoiceIssued','AccountUpdated','PlanChanged'])[1 + g % 4], \
                jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g)) \
         FROM generate_series(1, {unpublished}::bigint) g; \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
         SELECT (ARRAY['subscription','invoice','account'])[1 + g % 3], md5('d-' || g)::uuid, \
                (ARRAY['PaymentSucceeded','InvoiceIssued','AccountUpdated','PlanChanged'])[1 + g % 4], \
                jsonb_build_object('version', 1, 'data', jsonb_build_object('n', g)), 10, 'infinity', \
                CASE WHEN g % 10 = 0 THEN 'timeout after 30 s' ELSE 'HTTP 500 from the upstream' END \
         FROM generate_series(1, {dead}::bigint) g; \
         RESET session_replication_role;"
    ))
    .await?;
    Ok(())
}

/// Start `pg-outbox console` on `url` on a free port; returns the process
/// and the port once it serves.
async fn start_console(url: &str) -> BenchResult<(tokio::process::Child, u16)> {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pg-outbox"));
    let port = process::free_port();
    cmd.args(["console", "--addr", &format!("127.0.0.1:{port}")]);
    process::clean_env(&mut cmd);
    cmd.env("DATABASE_URL", url).env("RUST_LOG", "warn,pg_outbox=info");
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).kill_on_drop(true);
    let mut child = cmd.spawn()?;
    let mut lines = BufReader::new(child.stderr.take().ok_or("stderr")?).lines();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await {
            Ok(Ok(Some(l))) if l.contains("console serving on") => break,
            Ok(Ok(Some(_))) => {}
            _ => return Err("the console did not start".into()),
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, port))
}

/// The library reads behind the console's pages, alone.
async fn library_reads(lib: &Client, deep: i64) -> BenchResult<()> {
    eprintln!("{:<52} {:>8} {:>8} {:>8}", "ms (the library reads alone)", "min", "median", "max");
    line(
        "pg_outbox::status::read",
        time(|| async { pg_outbox::status::read(lib).await.map(drop).map_err(Into::into) }).await?,
    );
    line(
        "console::relays",
        time(|| async { pg_outbox::console::relays(lib).await.map(drop).map_err(Into::into) }).await?,
    );
    line(
        "console::delivery_chart (latest 50 000)",
        time(|| async {
            pg_outbox::console::delivery_chart(lib, pg_outbox::console::DEFAULT_CHART_ROWS)
                .await
                .map(drop)
                .map_err(Into::into)
        })
        .await?,
    );
    let all = Filter::all();
    line(
        "console::dead_letter_page (first 51)",
        time(|| async { pg_outbox::console::dead_letter_page(lib, &all, 0, 51).await.map(drop).map_err(Into::into) })
            .await?,
    );
    line(
        "console::dead_letter_page (90 % deep)",
        time(|| async {
            pg_outbox::console::dead_letter_page(lib, &all, deep, 51).await.map(drop).map_err(Into::into)
        })
        .await?,
    );
    line(
        "dead_letters::count (all)",
        time(|| async { pg_outbox::dead_letters::count(lib, &all).await.map(drop).map_err(Into::into) }).await?,
    );
    Ok(())
}

/// `pg_outbox::status::read` against an exact `count(*)` of the unpublished rows
/// in each statistics state: stale (as loaded), current, absent.
async fn status_states(
    lib: &pg_outbox::tokio_postgres::Client,
    c: &pg_outbox::tokio_postgres::Client,
) -> BenchResult<()> {
    let exact = c
        .query_one(
            "SELECT count(*) FILTER (WHERE next_retry_at IS DISTINCT FROM 'infinity'), \
                    count(*) FILTER (WHERE next_retry_at = 'infinity') \
             FROM events.outbox WHERE published_at IS NULL",
            &[],
        )
        .await?;
    let (pending, dead): (i64, i64) = (exact.get(0), exact.get(1));
    eprintln!("{:<52} {:>8} {:>8} {:>8}  ratio of medians", "ms (status by statistics state)", "min", "median", "max");
    for state in ["stale", "current", "absent"] {
        match state {
            "current" => c.batch_execute("ANALYZE events.outbox").await?,
            "absent" => {
                if let Err(e) =
                    c.batch_execute("DELETE FROM pg_statistic WHERE starelid = 'events.outbox'::regclass").await
                {
                    eprintln!("(statistics absent: skipped, {e})");
                    continue;
                }
            }
            _ => {}
        }
        let s = time(|| async { pg_outbox::status::read(lib).await.map(drop).map_err(Into::into) }).await?;
        let base = time(|| async {
            c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await?;
            Ok(())
        })
        .await?;
        if state != "stale" {
            subscription_reads(lib, &format!("statistics {state}")).await?;
        }
        line(&format!("pg_outbox::status::read, statistics {state}"), s);
        line(&format!("baseline count(*) of unpublished, statistics {state}"), base);
        eprintln!("  status / baseline: {:.3}x", s.1 / base.1);
        let mut errs = Vec::new();
        for _ in 0..5 {
            let st = pg_outbox::status::read(lib).await?;
            let backlog = st.unpublished - st.dead_letters;
            errs.push((backlog as f64 / pending as f64 - 1.0, st.dead_letters as f64 / dead.max(1) as f64 - 1.0));
        }
        let fmt = |v: Vec<f64>| v.iter().map(|e| format!("{:+.1} %", e * 100.0)).collect::<Vec<_>>().join(", ");
        eprintln!(
            "  estimate error, 5 readings: pending {} (exact {pending}); dead letters {} (exact {dead})",
            fmt(errs.iter().map(|e| e.0).collect()),
            fmt(errs.iter().map(|e| e.1).collect())
        );
    }
    Ok(())
}

/// Two subscriptions on the outbox as loaded so far: `audit` with its
/// cursor at 0 (every event behind it) and `search` caught up (its cursor
/// at the highest id; moved up again after each load), each with 300
/// failure rows at its lowest ids: 100 dead letters, 100 waiting for a
/// retry, 100 held back.
async fn create_subscriptions(c: &Client) -> BenchResult<()> {
    c.batch_execute(
        "INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id, options) \
           SELECT 'audit', 0, 0, '{\"max_lag_seconds\": 60}'::jsonb \
           UNION ALL SELECT 'search', max(id), max(id), '{}'::jsonb FROM events.outbox; \
         INSERT INTO events.outbox_subscription_failures \
           (subscription, id, aggregate_type, aggregate_id, retry_count, next_retry_at, last_error) \
         SELECT s.name, o.id, o.aggregate_type, o.aggregate_id, CASE WHEN o.n % 3 = 2 THEN 0 ELSE 3 END, \
                CASE o.n % 3 WHEN 0 THEN 'infinity'::timestamptz WHEN 1 THEN now() + interval '1 hour' END, \
                'HTTP 500 from the upstream' \
         FROM (SELECT id, aggregate_type, aggregate_id, row_number() OVER (ORDER BY id) AS n \
               FROM events.outbox ORDER BY id LIMIT 3000) o CROSS JOIN events.outbox_subscriptions s \
         WHERE o.n % 10 = 0;",
    )
    .await?;
    Ok(())
}

/// The statements that read the subscriptions' lag and backlog, on `lib`
/// (a session opened as pg-outbox opens its own): the relay's backlog
/// gauges of each subscription, `subscription list` of all, and the lags
/// every relay reads for the alert. Shared buffers touched (hit + read,
/// `EXPLAIN (ANALYZE, BUFFERS)`) and milliseconds as [`time`] reads them.
async fn subscription_reads(lib: &Client, state: &str) -> BenchResult<()> {
    eprintln!("{:<52} {:>8} {:>8} {:>8} {:>8}", format!("subscriptions, {state}"), "buffers", "min", "median", "max");
    for (name, sql, cap) in pg_outbox::subscription::read_statements() {
        let cases: &[(&str, Option<&str>)] = match name {
            "subscription_gauges" => {
                &[("GAUGES audit (cursor 0)", Some("audit")), ("GAUGES search (caught up)", Some("search"))]
            }
            "subscription_list" => &[("LIST (all)", None)],
            _ => &[("LAGS", None)],
        };
        let cap = cap.unwrap_or(0);
        for (what, sub) in cases {
            let params: Vec<&(dyn ToSql + Sync)> = if name == "subscription_lags" { vec![] } else { vec![sub, &cap] };
            let plan: serde_json::Value =
                lib.query_one(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"), &params).await?.get(0);
            let top = &plan[0]["Plan"];
            let count = |k: &str| top[k].as_f64().unwrap_or(0.0);
            let buffers = count("Shared Hit Blocks") + count("Shared Read Blocks");
            let (min, med, max) = time(|| {
                let params = params.clone();
                async move {
                    lib.query(sql, &params).await?;
                    Ok(())
                }
            })
            .await?;
            eprintln!("  {what:<50} {buffers:>8} {min:>8.2} {med:>8.2} {max:>8.2}");
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    bench::main_with(run)
}

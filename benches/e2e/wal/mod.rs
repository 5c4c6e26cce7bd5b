//! Scenario `wal` (only when named): the WAL source (`pg-outbox relay
//! --source wal`), which is woken by committed inserts read from a
//! temporary logical replication slot instead of the insert trigger's
//! NOTIFY, against the listen source and against no relay at all.
//!
//! The WAL source needs `wal_level = logical`, which the suite's server
//! need not have (and must not be changed for it), so this scenario starts
//! its own throwaway servers from the local PostgreSQL binaries (the test
//! kit's `TempServer`, as `tests/it/wal.rs` does): one with `wal_level =
//! logical`, where everything but the reference runs, and one with
//! `wal_level = replica` (the default) for the reference insert rate.
//! Every database is in the `producer-locked` ordering mode unless said
//! otherwise, the mode in which `pg-outbox migrate --source wal` leaves no
//! trigger firing on insert; the listen source's databases keep its
//! wake-up trigger (`migrate --ordering producer-locked`), so the two
//! sources differ only in how the relay learns of commits.
//!
//! Parts:
//! 1. producers: insert rate at 4, 16 and 64 connections with the WAL
//!    source (no insert trigger, a `relay --source wal` draining) against
//!    the same table with every trigger disabled and no relay, on the same
//!    server; references: that bare table on the `replica` server, and
//!    with a listen relay draining it by its sweep (the `producers`
//!    scenario's baseline: what draining costs whatever wakes the relay);
//! 2. latency: commit-to-delivery at 100 and 1 000 events/s of `relay
//!    --source wal` against `relay` (the listen source), and against the
//!    LISTEN floor of the `latency` scenario;
//! 3. drain: a burst written while the relay runs, events/s from its first
//!    write until the table has no due row, for both sources; and the WAL
//!    written per event;
//! 4. the relay's CPU per event (process and server sessions, the
//!    replication session included) for both sources, from part 2.
//!
//! Each part also measures the floor of any WAL source on this server, to
//! tell the source's own cost from what reading the WAL costs whoever
//! does it: a bare reader ([`BareStream`]: a temporary slot, confirming at
//! once, nothing else) decoding the publication beside the producers and
//! a listen relay draining by its sweep (part 1), beside the listen relay's
//! drain (part 3), and reading inserts into a plain table for latency
//! (part 2, against the LISTEN floor).

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pg_outbox::tokio_postgres::config::{Host, SslMode};
use pg_outbox::tokio_postgres::{Client, Config};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig};
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::latency::{self, GRACE, Probe, Produce, Subject};
use crate::producers::run_load;
use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::util::{self, Scratch, conninfo, scratch, start_relay, stop_relay};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::{TempServer, TempServerOptions, connect};

mod parts;
mod stream;

use parts::*;
use stream::*;

/// `pg-outbox migrate` arguments of the WAL source's databases: the
/// producer-locked mode with no insert trigger, and the publication.
const MIGRATE_WAL: [&str; 4] = ["--ordering", "producer-locked", "--source", "wal"];
/// `pg-outbox migrate` arguments of the listen source's databases: the
/// same ordering mode, its wake-up trigger on.
const MIGRATE_LISTEN: [&str; 2] = ["--ordering", "producer-locked"];
/// The relay's arguments (after `--sink stdout`) for the WAL source.
const RELAY_WAL: [&str; 2] = ["--source", "wal"];
/// Rows per transaction of the drain's burst.
const BURST_BATCH: i64 = 1_000;
/// How long the producers' WAL-source run may take, after its load, for
/// the relay to publish every event (a check that it delivers; not timed).
const CATCH_UP: Duration = Duration::from_secs(60);

/// Insert triggers of `events.outbox` that fire for an ordinary session
/// (enabled `O`rigin or `A`lways, the insert bit of `tgtype` set), by name.
const FIRING_INSERT_TRIGGERS: &str = "SELECT coalesce(string_agg(tgname, ', ' ORDER BY tgname), '') FROM pg_trigger \
     WHERE tgrelid = 'events.outbox'::regclass AND NOT tgisinternal AND tgenabled IN ('O', 'A') \
       AND (tgtype::int & 4) <> 0";

/// How long [`drop_db`] waits for a stopped relay's slot to go.
const SLOT_GONE: Duration = Duration::from_secs(10);

/// The server's WAL position, bytes from the start.
const WAL_POSITION: &str = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8";

/// A throwaway server of this scenario and a connection to its `postgres`
/// database; stopped by [`Throwaway::stop`].
struct Throwaway {
    /// The server (its drop stops it and deletes its files, which blocks).
    server: TempServer,
    /// Creates and drops the scenario's databases.
    admin: Client,
    /// The admin connection's config; scratch databases are this with another dbname.
    admin_cfg: Config,
}

impl Throwaway {
    /// Start a server with `wal_level` (in the blocking pool: `initdb` and
    /// `pg_ctl` take a second or two) and check that it runs with it, on a
    /// version the WAL source supports (14 or later).
    async fn start(wal_level: &'static str) -> BenchResult<Throwaway> {
        let started = Instant::now();
        let server = tokio::task::spawn_blocking(move || {
            TempServer::start_with(TempServerOptions::default().setting("wal_level", wal_level))
        })
        .await?
        .map_err(|e| format!("throwaway server with wal_level = {wal_level}: {}", pg_outbox::error::report(&e)))?;
        let mut admin_cfg = pg_outbox::ConnectOptions::parse(&server.url())?.tokio_postgres_config();
        admin_cfg.ssl_mode(SslMode::Disable);
        let t = match connect(&admin_cfg).await {
            Ok(admin) => Throwaway { server, admin, admin_cfg },
            Err(e) => {
                let _ = tokio::task::spawn_blocking(move || drop(server)).await;
                return Err(e.into());
            }
        };
        let checked = async {
            let row = t
                .admin
                .query_one("SELECT current_setting('wal_level'), current_setting('server_version_num')::int", &[])
                .await?;
            let (level, version): (String, i32) = (row.try_get(0)?, row.try_get(1)?);
            if level != wal_level {
                return Err(format!("the throwaway server runs with wal_level = {level}, not {wal_level}").into());
            }
            if version < 140_000 {
                return Err(
                    format!("the WAL source needs PostgreSQL 14 or later; the local binaries are {version}").into()
                );
            }
            Ok::<_, BoxError>(version)
        }
        .await;
        match checked {
            Ok(version) => {
                eprintln!(
                    "e2e: wal: throwaway server (wal_level = {wal_level}, {version}) on port {} in {:.1} s",
                    t.server.port(),
                    started.elapsed().as_secs_f64()
                );
                Ok(t)
            }
            Err(e) => {
                t.stop().await;
                Err(e)
            }
        }
    }

    /// A fresh migrated database `pgo_e2e_<pid>_<tag>` on this server.
    async fn scratch(&self, tag: &str) -> BenchResult<Scratch> {
        scratch(&self.admin, &self.admin_cfg, tag).await
    }

    /// Lines of the server's log (`server.log` in its directory) that say a
    /// server process crashed or was killed (`PANIC`, `terminated by
    /// signal`); empty when none (or the log is unreadable).
    fn crashes(&self) -> Vec<String> {
        let log = std::fs::read_to_string(self.server.socket_dir().join("server.log")).unwrap_or_default();
        log.lines()
            .filter(|l| l.contains("PANIC") || l.contains("terminated by signal") || l.contains("was terminated by"))
            .map(str::to_string)
            .collect()
    }

    /// Stop the server and delete its files (in the blocking pool).
    async fn stop(self) {
        let Throwaway { server, admin, .. } = self;
        drop(admin);
        if let Err(e) = tokio::task::spawn_blocking(move || drop(server)).await {
            eprintln!("e2e: wal: stopping a throwaway server: {e}");
        }
    }
}

/// Drop the scratch database `db` of `server`, once no replication slot
/// is left in it: a stopped WAL-source relay's temporary slot goes when its
/// walsender exits, a moment after the relay, and `DROP DATABASE` refuses a
/// database with a slot, even `WITH (FORCE)`. A slot still there after
/// [`SLOT_GONE`] is reported (and the database dropped anyway, forcing).
async fn drop_db(server: &Throwaway, db: Scratch) {
    let started = Instant::now();
    loop {
        let slots = server
            .admin
            .query_one("SELECT count(*) FROM pg_replication_slots WHERE database = $1", &[&db.name])
            .await
            .and_then(|r| r.try_get::<_, i64>(0));
        match slots {
            Ok(0) => break,
            Ok(n) if started.elapsed() >= SLOT_GONE => {
                eprintln!(
                    "e2e: wal: {n} replication slot(s) still in {} {} s after its relay stopped",
                    db.name,
                    SLOT_GONE.as_secs()
                );
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => {
                eprintln!("e2e: wal: reading the slots of {}: {}", db.name, pg_outbox::error::report(&e));
                break;
            }
        }
    }
    if started.elapsed() >= Duration::from_millis(500) {
        eprintln!(
            "e2e: wal: the slot in {} went {:.1} s after its relay stopped",
            db.name,
            started.elapsed().as_secs_f64()
        );
    }
    if let Err(e) = server.admin.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", db.name)).await {
        eprintln!("e2e: wal: could not drop database {}: {}", db.name, pg_outbox::error::report(&e));
    }
}

/// Run `pg-outbox migrate <args>` ([`util::relay_bin`]) on `cfg`'s database
/// in a clean environment; its stderr (what it did).
async fn migrate_cli(cfg: &Config, args: &[&str]) -> BenchResult<String> {
    let mut cmd = tokio::process::Command::new(util::relay_bin());
    cmd.arg("migrate").args(args);
    pg_outbox_testkit::process::clean_env(&mut cmd);
    let out = cmd
        .env("DATABASE_URL", conninfo(cfg))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(format!("pg-outbox migrate {} failed ({}): {stderr}", args.join(" "), out.status).into());
    }
    Ok(stderr)
}

/// Insert triggers that fire for an ordinary session, by name (empty: none).
async fn firing_insert_triggers(client: &Client) -> BenchResult<String> {
    Ok(client.query_one(FIRING_INSERT_TRIGGERS, &[]).await?.try_get(0)?)
}

/// Which relay, and its database's setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
enum Source {
    /// `relay --source wal` on a database after `migrate --ordering
    /// producer-locked --source wal` (no insert trigger fires).
    Wal,
    /// `relay` (the listen source) on a database after `migrate --ordering
    /// producer-locked` (the wake-up statement trigger fires while a relay
    /// waits).
    Listen,
    /// `relay` on a database as `migrate` leaves it (the outbox-locked
    /// mode, its row trigger notifying waiting relays): the default setup,
    /// a reference in the latency part only.
    ListenDefault,
    /// As [`Source::Wal`], with producers that commit with
    /// `synchronous_commit = off` (latency part only, first rate): logical
    /// decoding reads only flushed WAL, so their commits reach the stream
    /// when the WAL writer flushes (`wal_writer_delay`, 200 ms by default).
    WalAsyncCommit,
    /// As [`Source::Listen`], with the same producers (their NOTIFY goes
    /// out at commit, flushed or not).
    ListenAsyncCommit,
}

impl Source {
    /// Name in the report.
    fn name(self) -> &'static str {
        match self {
            Source::Wal => "relay --source wal",
            Source::Listen => "relay (listen)",
            Source::WalAsyncCommit => "relay --source wal, producers synchronous_commit=off",
            Source::ListenAsyncCommit => "relay (listen), producers synchronous_commit=off",
            Source::ListenDefault => "relay (listen), outbox-locked",
        }
    }

    /// Is it the WAL source?
    fn is_wal(self) -> bool {
        matches!(self, Source::Wal | Source::WalAsyncCommit)
    }

    /// Do its producers commit with `synchronous_commit = off`?
    fn async_commit(self) -> bool {
        matches!(self, Source::WalAsyncCommit | Source::ListenAsyncCommit)
    }

    /// Arguments of the relay (after `--sink stdout`).
    fn relay_args(self) -> &'static [&'static str] {
        match self {
            Source::Wal | Source::WalAsyncCommit => &RELAY_WAL,
            Source::Listen | Source::ListenDefault | Source::ListenAsyncCommit => &[],
        }
    }

    /// Set the database `cfg` up for this source with `pg-outbox migrate`,
    /// and check what fires on insert: nothing for the WAL source (the
    /// feature's promise; a failure here is the feature's, not the bench's).
    async fn prepare(self, cfg: &Config) -> BenchResult<()> {
        let args: &[&str] = match self {
            Source::Wal | Source::WalAsyncCommit => &MIGRATE_WAL,
            Source::Listen | Source::ListenAsyncCommit => &MIGRATE_LISTEN,
            Source::ListenDefault => return Ok(()),
        };
        let said = migrate_cli(cfg, args).await?;
        let client = connect(cfg).await?;
        let firing = firing_insert_triggers(&client).await?;
        if self.is_wal() {
            let publications: i64 = client
                .query_one("SELECT count(*) FROM pg_publication WHERE pubname = 'pg_outbox'", &[])
                .await?
                .try_get(0)?;
            if !firing.is_empty() || publications != 1 {
                return Err(format!(
                    "after `pg-outbox migrate {}`: insert triggers still firing: [{firing}], publication \
                     pg_outbox present: {}; migrate said: {}",
                    args.join(" "),
                    publications == 1,
                    said.trim()
                )
                .into());
            }
        }
        Ok(())
    }
}

/// The median of `v` (the mean of the middle two for an even count); `None` if empty.
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// A variant of the producers part (the order of a round's first run is [`TABLES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
enum Table {
    /// `wal_level = logical`, `migrate --ordering producer-locked --source
    /// wal` (no insert trigger), `relay --source wal` draining.
    Wal,
    /// `wal_level = logical`, every trigger of the table disabled, no relay
    /// (the baseline).
    Bare,
    /// `wal_level = logical`, every trigger disabled, `relay` (the listen
    /// source, finding events by its sweep alone) draining: the `producers`
    /// scenario's baseline, a reference for what draining costs the
    /// producers whatever wakes the relay.
    BareRelay,
    /// `wal_level = replica`, every trigger disabled, no relay (the reference).
    BareReplica,
    /// `wal_level = logical`, every trigger disabled, no relay, a
    /// [`BareStream`] reading the WAL source's publication: what decoding
    /// alone costs the producers.
    BareStream,
    /// `wal_level = logical`, every trigger disabled, a listen relay
    /// draining by its sweep and a [`BareStream`] reading the publication:
    /// the floor of any WAL source that marks its events published (it
    /// must decode and it must drain), with no wake-up of its own.
    BareRelayStream,
}

/// Every producers variant.
const TABLES: [Table; 6] =
    [Table::Wal, Table::Bare, Table::BareReplica, Table::BareRelay, Table::BareStream, Table::BareRelayStream];

/// Run the scenario on two throwaway servers (see the module documentation).
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let logical = Throwaway::start("logical").await?;
    let replica = match Throwaway::start("replica").await {
        Ok(r) => r,
        Err(e) => {
            logical.stop().await;
            return Err(e);
        }
    };
    let measured = async {
        let producers = producers(&logical, &replica, s).await?;
        let latency = latencies(&logical, s).await?;
        // The listen source first, then the WAL source, then the floor
        // (one run each).
        let listen = drain(&logical, s, Source::Listen, false).await?;
        let wal = drain(&logical, s, Source::Wal, false).await?;
        let floor = drain(&logical, s, Source::Listen, true).await?;
        Ok::<_, BoxError>((producers, latency, [listen, wal, floor]))
    }
    .await;
    let crashes: Vec<String> = logical.crashes().into_iter().chain(replica.crashes()).collect();
    for line in &crashes {
        eprintln!("e2e: wal: server log: {line}");
    }
    replica.stop().await;
    logical.stop().await;
    let (producers, latency, drains) = measured?;
    let mut sec = report(s, &producers, &latency, &drains);
    if !crashes.is_empty() {
        sec.notes.push(format!(
            "The throwaway servers' logs say {} server process(es) crashed or were killed: {}",
            crashes.len(),
            crashes.join(" | ")
        ));
    }
    Ok(sec)
}

/// The section: one table of every part's figures (WAL source, its
/// baseline, their ratio, a reference and the ratio to it), and the targets.
fn report(
    s: &Settings,
    producers: &[ProducersAt],
    latency: &[LatencyRun],
    [listen, wal, floor_drain]: &[DrainRun; 3],
) -> Section {
    let mut sec = Section::new(
        "wal",
        "The WAL source (relay --source wal): producers, latency, drain and CPU against the listen source",
        &["measure", "at", "WAL source", "baseline", "WAL / baseline", "reference", "WAL / reference"],
    );
    for p in producers {
        let conns = p.connections;
        sec.rows.push(vec![
            "inserts/s (baseline: no triggers, no relay; reference: the same on wal_level=replica)".into(),
            format!("{conns} connections"),
            fmt_count(p.rate(Table::Wal)),
            fmt_count(p.rate(Table::Bare)),
            fmt_ratio(p.wal_ratio),
            fmt_count(p.rate(Table::BareReplica)),
            fmt_ratio(p.wal_vs_replica),
        ]);
        sec.rows.push(vec![
            "inserts/s (baseline: no triggers, a listen relay draining by its sweep: the producers scenario's)".into(),
            format!("{conns} connections"),
            fmt_count(p.rate(Table::Wal)),
            fmt_count(p.rate(Table::BareRelay)),
            fmt_ratio(p.wal_vs_draining),
            "n/a".into(),
            "n/a".into(),
        ]);
        sec.rows.push(vec![
            "inserts/s of the floor in the WAL source's column: no triggers, a listen relay draining by its sweep \
             and a bare reader decoding the publication (baseline: no triggers, no relay; reference: a bare reader \
             alone)"
                .into(),
            format!("{conns} connections"),
            fmt_count(p.rate(Table::BareRelayStream)),
            fmt_count(p.rate(Table::Bare)),
            fmt_ratio(p.floor_vs_bare),
            fmt_count(p.rate(Table::BareStream)),
            fmt_ratio(p.floor_vs_bare.zip(p.stream_vs_bare).and_then(|(f, b)| ratio(f, b))),
        ]);
        sec.rows.push(vec![
            "inserts/s (baseline: the floor above)".into(),
            format!("{conns} connections"),
            fmt_count(p.rate(Table::Wal)),
            fmt_count(p.rate(Table::BareRelayStream)),
            fmt_ratio(p.wal_vs_floor),
            "n/a".into(),
            "n/a".into(),
        ]);
        sec.target(
            format!(
                "WAL source (no insert trigger, relay draining) insert rate >= 0.97x no triggers and no relay at \
                 {conns} connections (the floor of any WAL source here: {})",
                fmt_ratio(p.floor_vs_bare)
            ),
            p.wal_ratio,
            0.97,
            false,
        );
    }
    let mut floor_notes = Vec::new();
    let find = |name: &str, rate: u64| latency.iter().find(|r| r.receiver == name && r.rate == rate);
    for &rate in &s.wal_rates {
        let (Some(w), Some(l), floor, default, wal_floor) = (
            find(Source::Wal.name(), rate),
            find(Source::Listen.name(), rate),
            find(Subject::Floor.name(), rate),
            find(Source::ListenDefault.name(), rate),
            find(WAL_FLOOR, rate),
        ) else {
            continue;
        };
        if let (Some(f), Some(wf)) = (floor, wal_floor) {
            for (i, label) in [(0, "p50"), (2, "p99")] {
                sec.rows.push(vec![
                    format!(
                        "latency {label} ms of the floors: a bare logical-replication reader in the WAL source's \
                         column (baseline: the bare LISTEN client)"
                    ),
                    format!("{}/s", fmt_count(rate as f64)),
                    fmt_ms(wf.percentiles_ms[i]),
                    fmt_ms(f.percentiles_ms[i]),
                    fmt_ratio(ratio(wf.percentiles_ms[i], f.percentiles_ms[i])),
                    "n/a".into(),
                    "n/a".into(),
                ]);
            }
            let over = |r: &LatencyRun, base: &LatencyRun| r.percentiles_ms[0] - base.percentiles_ms[0];
            sec.rows.push(vec![
                "latency p50 ms a relay adds to its floor (WAL: relay --source wal - the logical-replication \
                 reader; baseline: the listen relay - the LISTEN client)"
                    .into(),
                format!("{}/s", fmt_count(rate as f64)),
                fmt_ms(over(w, wf)),
                fmt_ms(over(l, f)),
                fmt_ratio(ratio(over(w, wf), over(l, f))),
                "n/a".into(),
                "n/a".into(),
            ]);
        }
        for (i, label) in [(0, "p50"), (2, "p99")] {
            let f = floor.map(|f| f.percentiles_ms[i]);
            sec.rows.push(vec![
                format!("latency {label} ms (baseline: relay, listen source; reference: the LISTEN floor)"),
                format!("{}/s", fmt_count(rate as f64)),
                fmt_ms(w.percentiles_ms[i]),
                fmt_ms(l.percentiles_ms[i]),
                fmt_ratio(ratio(w.percentiles_ms[i], l.percentiles_ms[i])),
                f.map_or_else(|| "n/a".into(), fmt_ms),
                fmt_ratio(f.and_then(|f| ratio(w.percentiles_ms[i], f))),
            ]);
        }
        let us = |r: &LatencyRun| r.cpu_us_per_event.map_or_else(|| "n/a".into(), |v| format!("{v:.0}"));
        sec.rows.push(vec![
            "relay CPU µs/event, process and server sessions (baseline: listen source)".into(),
            format!("{}/s", fmt_count(rate as f64)),
            us(w),
            us(l),
            fmt_ratio(w.cpu_us_per_event.zip(l.cpu_us_per_event).and_then(|(w, l)| ratio(w, l))),
            "n/a".into(),
            "n/a".into(),
        ]);
        if let Some(f) = floor {
            let vs =
                |r: Option<&LatencyRun>| fmt_ratio(r.and_then(|r| ratio(r.percentiles_ms[0], f.percentiles_ms[0])));
            floor_notes.push(format!(
                "{}/s: relay (listen) {}, relay (listen), outbox-locked {}, relay --source wal {}",
                fmt_count(rate as f64),
                vs(Some(l)),
                vs(default),
                vs(Some(w))
            ));
        }
        let floors = floor.zip(wal_floor).and_then(|(f, wf)| ratio(wf.percentiles_ms[0], f.percentiles_ms[0]));
        sec.target(
            format!(
                "relay --source wal p50 <= the listen source's at {rate}/s (the floors' p50, logical-replication \
                 reader / LISTEN client: {})",
                fmt_ratio(floors)
            ),
            ratio(w.percentiles_ms[0], l.percentiles_ms[0]),
            1.0,
            true,
        );
        sec.target(
            format!(
                "relay --source wal p50 <= 2x the LISTEN floor at {rate}/s (the listen relay's: {})",
                fmt_ratio(floor.and_then(|f| ratio(l.percentiles_ms[0], f.percentiles_ms[0])))
            ),
            floor.and_then(|f| ratio(w.percentiles_ms[0], f.percentiles_ms[0])),
            2.0,
            true,
        );
    }
    if let Some(&rate) = s.wal_rates.first()
        && let (Some(w), Some(l)) =
            (find(Source::WalAsyncCommit.name(), rate), find(Source::ListenAsyncCommit.name(), rate))
    {
        for (i, label) in [(0, "p50"), (2, "p99")] {
            sec.rows.push(vec![
                format!(
                    "latency {label} ms, producers synchronous_commit=off (baseline: listen source, same producers)"
                ),
                format!("{}/s", fmt_count(rate as f64)),
                fmt_ms(w.percentiles_ms[i]),
                fmt_ms(l.percentiles_ms[i]),
                fmt_ratio(ratio(w.percentiles_ms[i], l.percentiles_ms[i])),
                "n/a".into(),
                "n/a".into(),
            ]);
        }
    }
    let drain_ratio = ratio(wal.rate(), listen.rate());
    sec.rows.push(vec![
        format!(
            "drain events/s of a burst written while the relay runs{}",
            if wal.capped || listen.capped { " (capped)" } else { "" }
        ),
        format!("{} events", fmt_count(wal.events as f64)),
        fmt_count(wal.rate()),
        fmt_count(listen.rate()),
        fmt_ratio(drain_ratio),
        "n/a".into(),
        "n/a".into(),
    ]);
    sec.rows.push(vec![
        "WAL bytes/event during the drain (baseline: listen source)".into(),
        format!("{} events", fmt_count(wal.events as f64)),
        fmt_count(wal.wal_bytes_per_event),
        fmt_count(listen.wal_bytes_per_event),
        fmt_ratio(ratio(wal.wal_bytes_per_event, listen.wal_bytes_per_event)),
        "n/a".into(),
        "n/a".into(),
    ]);
    sec.rows.push(vec![
        "drain events/s of the burst (baseline: the listen relay with a bare reader decoding the publication \
         alongside, the floor of any WAL source here)"
            .into(),
        format!("{} events", fmt_count(wal.events as f64)),
        fmt_count(wal.rate()),
        fmt_count(floor_drain.rate()),
        fmt_ratio(ratio(wal.rate(), floor_drain.rate())),
        "n/a".into(),
        "n/a".into(),
    ]);
    sec.target(
        format!(
            "relay --source wal drains a fresh burst >= 1.0x the listen source (the floor here, listen relay with \
             a bare reader / listen relay: {})",
            fmt_ratio(ratio(floor_drain.rate(), listen.rate()))
        ),
        drain_ratio,
        1.0,
        false,
    );

    sec.notes.push(
        "Servers: two throwaway PostgreSQL servers started by the bench from the local binaries (the test kit's \
         TempServer: fsync=off, max_connections=300), one with wal_level=logical (everything but the reference) \
         and one with wal_level=replica (the reference insert rate); the suite's own server is not used. \
         WAL source: a database after `pg-outbox migrate --ordering producer-locked --source wal` (checked: no \
         trigger fires on insert, publication pg_outbox present), `pg-outbox relay --source wal --sink stdout`. \
         Listen source: `pg-outbox migrate --ordering producer-locked` (its wake-up statement trigger fires while \
         a relay waits), `pg-outbox relay --sink stdout`: the same ordering mode, so only the source differs."
            .into(),
    );
    let cpu_cell = |p: &ProducersAt| {
        let f = |t: Table| p.cpu(t).map_or_else(|| "n/a".into(), |v| format!("{v:.1}"));
        format!("{} connections {} / {} / {}", p.connections, f(Table::Wal), f(Table::Bare), f(Table::BareReplica))
    };
    sec.notes.push(format!(
        "Producers: the `producers` scenario's load (single-row autocommit INSERTs, a new aggregate each, \
         {} s of warm-up, then {} s counted), each run in a fresh database; {} round(s) per connection count, \
         each a run of every variant back to back, starting one further each round; rates are the median runs, \
         ratios the median of the rounds' ratios. WAL source: its relay draining into a pipe the bench reads and \
         discards (after each run the relay is checked to publish every event, untimed). Baseline: the same \
         table on the same server with every trigger disabled (`DISABLE TRIGGER USER`) and no relay. Reference: \
         that on the wal_level=replica server; logical / replica without triggers: {}. The floor: the \
         baseline's table with a listen relay draining it by its sweep and a bare logical-replication reader \
         (a temporary pgoutput slot on the WAL source's publication, confirming at once, doing nothing else; \
         checked to have read every insert) streaming it, so the server decodes and the rows are marked \
         published, as any WAL source needs, with no wake-up at all; and the bare reader alone. Producers' server CPU \
         µs/insert, WAL source / baseline / reference: {}.",
        s.producer_warmup_secs,
        s.producer_secs,
        s.wal_producer_rounds.max(1),
        producers
            .iter()
            .map(|p| format!("{} at {} connections", fmt_ratio(p.logical_vs_replica), p.connections))
            .collect::<Vec<_>>()
            .join(", "),
        producers.iter().map(cpu_cell).collect::<Vec<_>>().join("; ")
    ));
    let lines: Vec<String> = latency
        .iter()
        .map(|r| {
            format!(
                "{} at {}/s: p50 {} / p90 {} / p99 {} / p99.9 {} / max {} ms, {} of {} received{}",
                r.receiver,
                fmt_count(r.rate as f64),
                fmt_ms(r.percentiles_ms[0]),
                fmt_ms(r.percentiles_ms[1]),
                fmt_ms(r.percentiles_ms[2]),
                fmt_ms(r.percentiles_ms[3]),
                fmt_ms(r.percentiles_ms[4]),
                fmt_count(r.received as f64),
                fmt_count(r.sent as f64),
                r.cpu_us_per_event.map_or_else(String::new, |us| format!(", relay CPU {us:.0} µs/event"))
            )
        })
        .collect();
    sec.notes.push(format!(
        "Latency: the `latency` scenario's producers ({} connections, open-loop schedule, ~0.3 KB payloads), \
         {} s per run, each run in a fresh database of the logical server; latency = send of the committing \
         INSERT -> the event's stdout line read by the bench. Floor: the `latency` scenario's bare LISTEN \
         client. The logical-replication floor: the same producers inserting into the LISTEN floor's plain \
         table with no NOTIFY, read by a bare reader (a temporary pgoutput slot on a publication of that table, \
         the crate the WAL source uses, doing nothing but confirming), latency taken when the Insert message \
         arrives: what any WAL source waits before it knows of an event. Also measured, untargeted: the listen relay in the default setup (`migrate` alone: the \
         outbox-locked mode). The throwaway servers run with fsync=off, so the floor is lower than on a \
         durable server (a commit flushes nothing to disk) and a relay's own fixed cost per delivery weighs more \
         against it; p50 against the floor: {}. Every run: {}.",
        latency::PRODUCERS,
        s.wal_latency_secs,
        if floor_notes.is_empty() { "n/a".into() } else { floor_notes.join("; ") },
        lines.join("; ")
    ));
    let sessions: Vec<String> = latency
        .iter()
        .filter(|r| r.rate == 1_000 && !r.sessions.is_empty())
        .map(|r| format!("{}: {}", r.receiver, r.sessions.join(", ")))
        .collect();
    sec.notes.push(format!(
        "Relay CPU: CPU time of the relay process and of its database sessions' server processes \
         (`pg_stat_activity` rows with application_name `pg-outbox...`, read from `/proc`), from the relay's \
         idle start until every event arrived, per event received. Sessions counted at 1 000/s: {}.",
        if sessions.is_empty() { "n/a".into() } else { sessions.join("; ") }
    ));
    sec.notes.push(format!(
        "Drain: a relay idle on a fresh database of the logical server; then {} events (~1.5 KB JSON each, \
         10 000 aggregates) written from one connection in transactions of {} rows, back to back, while it \
         runs (written in {:.1} s for the listen source, {:.1} s for the WAL source, {:.1} s for the listen \
         source with a bare reader alongside); events/s from the first write until no due row is left. One run \
         of each (the listen source first, the floor last). The floor: the listen relay with a bare \
         logical-replication reader (a temporary slot on the WAL source's publication, confirming at once, \
         doing nothing else) reading the burst while it drains, which is all a WAL source must add on the \
         server. WAL bytes/event: \
         pg_current_wal_lsn() from just before the burst to the end, over the events (the burst's rows, the \
         relay's acknowledgements, anything else the server wrote meanwhile).",
        fmt_count(wal.events as f64),
        fmt_count(BURST_BATCH as f64),
        listen.write_seconds,
        wal.write_seconds,
        floor_drain.write_seconds
    ));
    sec.data = serde_json::json!({
        "producers": producers, "latency": latency,
        "drain": {"listen": listen, "wal": wal, "floor": floor_drain},
    });
    sec
}

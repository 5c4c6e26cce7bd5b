//! The scenario's parts: producers' insert rates, commit-to-delivery
//! latency and the drain of a burst, for each source.

use super::*;

/// One producers run's figures, after the warm-up.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ProducerRun {
    /// Inserts/s.
    pub(super) rate: f64,
    /// CPU time of the producers' server processes per insert, µs.
    pub(super) backend_us: Option<f64>,
}

/// One run of `table` at `conns` connections: a fresh database, the
/// variant's setup, [`run_load`]; for the WAL source, then a check that
/// its relay publishes every event within [`CATCH_UP`] (not timed).
pub(super) async fn producer_run(
    logical: &Throwaway,
    replica: &Throwaway,
    s: &Settings,
    conns: usize,
    table: Table,
) -> BenchResult<ProducerRun> {
    let server = if table == Table::BareReplica { replica } else { logical };
    let db = server.scratch("wal_producers").await?;
    let result = async {
        // The listen relay of [`Table::BareRelay`] and [`Table::BareRelayStream`].
        let mut drainer = None;
        // The bare reader of [`Table::BareStream`] and [`Table::BareRelayStream`].
        let mut reader = None;
        let relay = if table == Table::Wal {
            Source::Wal.prepare(&db.cfg).await?;
            let relay = start_relay(&conninfo(&db.cfg), &RELAY_WAL, false).await?;
            // Let the relay reach its idle state.
            tokio::time::sleep(Duration::from_millis(200)).await;
            Some(relay)
        } else {
            let streamed = matches!(table, Table::BareStream | Table::BareRelayStream);
            if streamed {
                // The WAL source's publication, as migrate creates it.
                Source::Wal.prepare(&db.cfg).await?;
            }
            let c = connect(&db.cfg).await?;
            c.batch_execute("ALTER TABLE events.outbox DISABLE TRIGGER USER").await?;
            let firing = firing_insert_triggers(&c).await?;
            if !firing.is_empty() {
                return Err(format!("triggers still fire on insert after DISABLE TRIGGER USER: {firing}").into());
            }
            if streamed {
                reader = Some(BareStream::start(&db.cfg, "pg_outbox", None).await?);
            }
            if matches!(table, Table::BareRelay | Table::BareRelayStream) {
                drainer = Some(start_relay(&conninfo(&db.cfg), &[], false).await?);
            }
            if reader.is_some() || drainer.is_some() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            None
        };
        let load = run_load(&db.cfg, conns, s.producer_warmup_secs + s.producer_secs, s.producer_warmup_secs, 0).await;
        if let Some(drainer) = drainer {
            stop_relay(drainer).await?;
        }
        if let Some(reader) = reader {
            // It read every insert (else it measured nothing), then stops.
            let written: i64 =
                connect(&db.cfg).await?.query_one("SELECT count(*) FROM events.outbox", &[]).await?.try_get(0)?;
            let caught_up = reader.caught_up(u64::try_from(written)?).await;
            reader.stop().await?;
            caught_up?;
        }
        if let Some(mut relay) = relay {
            let caught_up = match &load {
                Ok(_) => catch_up(&db.cfg, &mut relay).await,
                Err(_) => Ok(None),
            };
            stop_relay(relay).await?;
            if let Some(left) = caught_up? {
                return Err(format!(
                    "relay --source wal left {left} events unpublished {} s after the producers stopped",
                    CATCH_UP.as_secs()
                )
                .into());
            }
        }
        let load = load?;
        let after = &load.slices[load.warm_slices..];
        let counted: u64 = after.iter().sum();
        let rate = if s.producer_secs > 0.0 { counted as f64 / s.producer_secs } else { 0.0 };
        let backend_us = load.backend_cpu_us.filter(|_| counted > 0).map(|us| us / counted as f64);
        Ok::<_, BoxError>(ProducerRun { rate, backend_us })
    }
    .await;
    drop_db(server, db).await;
    result
}

/// Wait (at most [`CATCH_UP`]) until `relay` has published every event of
/// `cfg`'s database; `None` when it has, else how many are left.
pub(super) async fn catch_up(cfg: &Config, relay: &mut util::RelayProc) -> BenchResult<Option<i64>> {
    let probe = connect(cfg).await?;
    let deadline = Instant::now() + CATCH_UP;
    loop {
        relay.check_running().await?;
        let left = util::fresh_unpublished(&probe).await?;
        if left == 0 {
            return Ok(None);
        }
        if Instant::now() >= deadline {
            return Ok(Some(left));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Part 1's figures at one connection count.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ProducersAt {
    /// Producer connections.
    pub(super) connections: usize,
    /// Each variant's runs, in round order ([`TABLES`] order).
    pub(super) runs: Vec<(Table, Vec<ProducerRun>)>,
    /// Median of each round's WAL source / bare (logical) rate.
    pub(super) wal_ratio: Option<f64>,
    /// Median of each round's bare (logical) / bare (replica) rate.
    pub(super) logical_vs_replica: Option<f64>,
    /// Median of each round's WAL source / bare (replica) rate.
    pub(super) wal_vs_replica: Option<f64>,
    /// Median of each round's WAL source / bare with a listen relay draining.
    pub(super) wal_vs_draining: Option<f64>,
    /// Median of each round's bare with a listen relay draining / bare (logical).
    pub(super) draining_vs_bare: Option<f64>,
    /// Median of each round's bare with a bare reader / bare (logical): decoding alone.
    pub(super) stream_vs_bare: Option<f64>,
    /// Median of each round's bare with a listen relay draining and a bare
    /// reader / bare (logical): the floor of the WAL source's ratio.
    pub(super) floor_vs_bare: Option<f64>,
    /// Median of each round's WAL source / that floor.
    pub(super) wal_vs_floor: Option<f64>,
}

impl ProducersAt {
    /// The runs of `table`.
    pub(super) fn of(&self, table: Table) -> &[ProducerRun] {
        self.runs.iter().find(|(t, _)| *t == table).map_or(&[], |(_, r)| r.as_slice())
    }

    /// Median inserts/s of `table`.
    pub(super) fn rate(&self, table: Table) -> f64 {
        median(self.of(table).iter().map(|r| r.rate).collect()).unwrap_or(0.0)
    }

    /// Median server CPU µs per insert of `table`, if every run has it.
    pub(super) fn cpu(&self, table: Table) -> Option<f64> {
        median(self.of(table).iter().map(|r| r.backend_us).collect::<Option<Vec<f64>>>()?)
    }
}

/// The median over rounds of `of`'s rate / `base`'s rate.
pub(super) fn round_ratio(of: &[ProducerRun], base: &[ProducerRun]) -> Option<f64> {
    median(of.iter().zip(base).filter_map(|(o, b)| ratio(o.rate, b.rate)).collect())
}

/// Part 1: every variant at every connection count, `wal_producer_rounds`
/// rounds of each, starting one further each round.
pub(super) async fn producers(logical: &Throwaway, replica: &Throwaway, s: &Settings) -> BenchResult<Vec<ProducersAt>> {
    let mut out = Vec::new();
    for &conns in &s.wal_connections {
        let mut runs: Vec<Vec<ProducerRun>> = TABLES.iter().map(|_| Vec::new()).collect();
        for round in 0..s.wal_producer_rounds.max(1) {
            for k in 0..TABLES.len() {
                let v = (round + k) % TABLES.len();
                runs[v].push(producer_run(logical, replica, s, conns, TABLES[v]).await?);
            }
        }
        let [wal, bare, rep, draining, stream, floor] = [&runs[0], &runs[1], &runs[2], &runs[3], &runs[4], &runs[5]];
        let at = ProducersAt {
            connections: conns,
            wal_ratio: round_ratio(wal, bare),
            logical_vs_replica: round_ratio(bare, rep),
            wal_vs_replica: round_ratio(wal, rep),
            wal_vs_draining: round_ratio(wal, draining),
            draining_vs_bare: round_ratio(draining, bare),
            stream_vs_bare: round_ratio(stream, bare),
            floor_vs_bare: round_ratio(floor, bare),
            wal_vs_floor: round_ratio(wal, floor),
            runs: TABLES.iter().copied().zip(runs).collect(),
        };
        let list = |t: Table| at.of(t).iter().map(|r| fmt_count(r.rate)).collect::<Vec<_>>().join(" / ");
        eprintln!(
            "e2e: wal: producers x{conns}: WAL source {}/s ({}), no triggers (logical) {}/s, no triggers (replica) \
             {}/s (logical/replica {}), no triggers with a listen relay draining {}/s (WAL source vs it {}), \
             with a bare reader {}/s ({} of logical), with both {}/s ({} of logical; WAL source vs it {}); \
             runs in order: WAL {}, logical {}, replica {}, listen relay draining {}, bare reader {}, both {}",
            fmt_count(at.rate(Table::Wal)),
            fmt_ratio(at.wal_ratio),
            fmt_count(at.rate(Table::Bare)),
            fmt_count(at.rate(Table::BareReplica)),
            fmt_ratio(at.logical_vs_replica),
            fmt_count(at.rate(Table::BareRelay)),
            fmt_ratio(at.wal_vs_draining),
            fmt_count(at.rate(Table::BareStream)),
            fmt_ratio(at.stream_vs_bare),
            fmt_count(at.rate(Table::BareRelayStream)),
            fmt_ratio(at.floor_vs_bare),
            fmt_ratio(at.wal_vs_floor),
            list(Table::Wal),
            list(Table::Bare),
            list(Table::BareReplica),
            list(Table::BareRelay),
            list(Table::BareStream),
            list(Table::BareRelayStream),
        );
        out.push(at);
    }
    Ok(out)
}

/// One latency run of part 2.
#[derive(Debug, Clone, Serialize)]
pub(super) struct LatencyRun {
    /// Receiver's name.
    pub(super) receiver: &'static str,
    /// Target rate, events/s.
    pub(super) rate: u64,
    /// Seconds of sending.
    pub(super) seconds: f64,
    /// Events committed.
    pub(super) sent: u64,
    /// Events received within the grace after sending.
    pub(super) received: u64,
    /// Events the schedule could not queue at once.
    pub(super) behind: u64,
    /// p50, p90, p99, p99.9 and max, milliseconds.
    pub(super) percentiles_ms: [f64; 5],
    /// Relays only: CPU of the relay process and its server sessions per
    /// event received, µs.
    pub(super) cpu_us_per_event: Option<f64>,
    /// Relays only: the relay's server sessions the CPU was read from
    /// (`backend_type` each).
    pub(super) sessions: Vec<String>,
}

/// The CPU time (µs) used so far by the relay process `pid` and by the
/// server processes of its sessions in `cfg`'s database (`application_name`
/// `pg-outbox...`, from `pg_stat_activity`: the WAL source's walsender
/// included), with their backend types; `None` where any is unreadable.
pub(super) async fn relay_cpu_us(cfg: &Config, pid: Option<u32>) -> Option<(f64, Vec<String>)> {
    let client = connect(cfg).await.ok()?;
    let rows = client
        .query(
            "SELECT pid, backend_type FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name LIKE 'pg-outbox%' ORDER BY backend_type, pid",
            &[],
        )
        .await
        .ok()?;
    let mut total = util::cpu_us(pid?)?;
    let mut sessions = Vec::new();
    for row in rows {
        let pid: i32 = row.try_get(0).ok()?;
        total += util::server_cpu_us(u32::try_from(pid).ok()?)?;
        sessions.push(row.try_get::<_, Option<String>>(1).ok()?.unwrap_or_default());
    }
    Some((total, sessions))
}

/// Commit-to-delivery of a `relay --sink stdout` of `source` on the
/// prepared database `cfg` at `rate` events/s for `secs` seconds, with the
/// `latency` scenario's producers; latency is taken when the bench reads
/// the event's line from the relay's stdout.
pub(super) async fn relay_latency(cfg: &Config, source: Source, rate: u64, secs: f64) -> BenchResult<LatencyRun> {
    let probe = Arc::new(Probe::new()?);
    let mut relay = start_relay(&conninfo(cfg), source.relay_args(), true).await?;
    let reader = latency::record_relay_lines(&mut relay, probe.clone())?;
    // Let the relay reach its idle state.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = relay_cpu_us(cfg, relay.pid()).await;
    let mut producers_cfg = cfg.clone();
    if source.async_commit() {
        producers_cfg.options("-c synchronous_commit=off");
    }
    let produced = latency::produce(&producers_cfg, Produce::Outbox, rate, secs, &probe).await;
    let (sent, behind, seconds) = match produced {
        Ok(p) => p,
        Err(e) => {
            let _ = stop_relay(relay).await;
            return Err(e);
        }
    };
    let deadline = Instant::now() + GRACE;
    while probe.received() < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = relay_cpu_us(cfg, relay.pid()).await;
    let received = probe.received();
    relay.check_running().await?;
    stop_relay(relay).await?;
    reader.await??;
    let (cpu_us_per_event, sessions) = match (before, after) {
        (Some((b, _)), Some((a, sessions))) if received > 0 => (Some((a - b) / received as f64), sessions),
        (_, Some((_, sessions))) => (None, sessions),
        _ => (None, Vec::new()),
    };
    Ok(LatencyRun {
        receiver: source.name(),
        rate,
        seconds,
        sent,
        received,
        behind,
        percentiles_ms: probe.percentiles_ms(),
        cpu_us_per_event,
        sessions,
    })
}

/// Who receives the events in part 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Receiver {
    /// The `latency` scenario's bare LISTEN client.
    ListenFloor,
    /// A [`BareStream`] on the floor's table ([`wal_floor_latency`]).
    WalFloor,
    /// A relay of this source.
    Relay(Source),
}

/// Name of the logical-replication floor in the report.
pub(super) const WAL_FLOOR: &str = "floor (bare logical-replication reader)";

/// The logical-replication floor at `rate` events/s for `secs` seconds on
/// the database `cfg`: the `latency` scenario's producers insert into the
/// floor's plain table (no trigger, no NOTIFY), a [`BareStream`] reads the
/// inserts from a publication of that table; latency = send of the
/// committing INSERT -> its Insert message read from the stream. What any
/// WAL source waits before it can know of an event; a relay then still
/// fetches the row.
pub(super) async fn wal_floor_latency(cfg: &Config, rate: u64, secs: f64) -> BenchResult<LatencyRun> {
    let client = connect(cfg).await?;
    client.batch_execute(latency::FLOOR_TABLE).await?;
    client.batch_execute(FLOOR_PUBLICATION).await?;
    let probe = Arc::new(Probe::new()?);
    let reader = BareStream::start(cfg, "pgo_bench_floor", Some(probe.clone())).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (sent, behind, seconds) = match latency::produce(cfg, Produce::FloorInsert, rate, secs, &probe).await {
        Ok(p) => p,
        Err(e) => {
            let _ = reader.stop().await;
            return Err(e);
        }
    };
    let deadline = Instant::now() + GRACE;
    while probe.received() < sent && Instant::now() < deadline && !reader.task.is_finished() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    reader.stop().await?;
    Ok(LatencyRun {
        receiver: WAL_FLOOR,
        rate,
        seconds,
        sent,
        received: probe.received(),
        behind,
        percentiles_ms: probe.percentiles_ms(),
        cpu_us_per_event: None,
        sessions: Vec::new(),
    })
}

/// Part 2: at each rate, the LISTEN floor (the `latency` scenario's) and a
/// relay of each source, each in a fresh database of the logical server.
pub(super) async fn latencies(logical: &Throwaway, s: &Settings) -> BenchResult<Vec<LatencyRun>> {
    let mut runs = Vec::new();
    for (i, &rate) in s.wal_rates.iter().enumerate() {
        let mut receivers = vec![
            Receiver::ListenFloor,
            Receiver::WalFloor,
            Receiver::Relay(Source::Listen),
            Receiver::Relay(Source::Wal),
            Receiver::Relay(Source::ListenDefault),
        ];
        if i == 0 {
            receivers.extend([Receiver::Relay(Source::ListenAsyncCommit), Receiver::Relay(Source::WalAsyncCommit)]);
        }
        for receiver in receivers {
            let db = logical.scratch("wal_latency").await?;
            let run = async {
                match receiver {
                    Receiver::WalFloor => wal_floor_latency(&db.cfg, rate, s.wal_latency_secs).await,
                    Receiver::ListenFloor => {
                        let r = latency::measure(&db.cfg, Subject::Floor, rate, s.wal_latency_secs).await?;
                        Ok::<_, BoxError>(LatencyRun {
                            receiver: Subject::Floor.name(),
                            rate,
                            seconds: r.seconds,
                            sent: r.sent,
                            received: r.received,
                            behind: r.behind,
                            percentiles_ms: r.percentiles_ms,
                            cpu_us_per_event: None,
                            sessions: Vec::new(),
                        })
                    }
                    Receiver::Relay(source) => {
                        source.prepare(&db.cfg).await?;
                        relay_latency(&db.cfg, source, rate, s.wal_latency_secs).await
                    }
                }
            }
            .await;
            drop_db(logical, db).await;
            let run = run?;
            let streamed = match receiver {
                Receiver::Relay(source) => source.is_wal(),
                Receiver::WalFloor => true,
                Receiver::ListenFloor => false,
            };
            if streamed && run.received < run.sent {
                return Err(format!(
                    "{} received {} of {} events within {} s after the producers stopped",
                    run.receiver,
                    run.received,
                    run.sent,
                    GRACE.as_secs()
                )
                .into());
            }
            eprintln!(
                "e2e: wal: latency {:<30} {:>5}/s: sent {} received {} p50 {:.2} ms p99 {:.2} ms max {:.1} ms{}",
                run.receiver,
                rate,
                run.sent,
                run.received,
                run.percentiles_ms[0],
                run.percentiles_ms[2],
                run.percentiles_ms[4],
                match run.cpu_us_per_event {
                    Some(us) => format!(", relay CPU {us:.0} µs/event (sessions: {})", run.sessions.join(", ")),
                    None => String::new(),
                }
            );
            runs.push(run);
        }
    }
    Ok(runs)
}

/// One drain of part 3.
#[derive(Debug, Clone, Serialize)]
pub(super) struct DrainRun {
    /// The relay's source.
    pub(super) source: Source,
    /// A [`BareStream`] read the WAL source's publication alongside the
    /// relay (the floor of the WAL source's drain, with the listen source).
    pub(super) reader_alongside: bool,
    /// Events in the burst.
    pub(super) events: i64,
    /// Seconds the burst took to write (its last commit).
    pub(super) write_seconds: f64,
    /// Seconds from the burst's first write until no due row was left.
    pub(super) seconds: f64,
    /// The time cap stopped it first.
    pub(super) capped: bool,
    /// Events published by then.
    pub(super) published: i64,
    /// WAL written from the burst's start until it was drained, bytes per
    /// event (the whole server's: nothing else runs on it).
    pub(super) wal_bytes_per_event: f64,
}

impl DrainRun {
    /// Name in the report.
    pub(super) fn name(&self) -> String {
        if self.reader_alongside {
            format!("{} + bare reader", self.source.name())
        } else {
            self.source.name().to_string()
        }
    }

    /// Events published per second.
    pub(super) fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.published as f64 / self.seconds } else { 0.0 }
    }
}

/// Part 3 for `source`: a relay running idle on a fresh database of the
/// logical server; a burst of `wal_burst` events (the `drain` scenario's
/// ~1.5 KB envelopes, one connection, [`BURST_BATCH`] rows per transaction,
/// back to back, no session-level trigger tricks: what fires on insert in
/// the source's setup fires); timed from the first write until the table
/// shows no due row (polled every 20 ms), capped at `drain_max_secs`.
/// With `alongside`, a [`BareStream`] reads the publication of the WAL
/// source (created for it) from before the burst until it read every event.
pub(super) async fn drain(logical: &Throwaway, s: &Settings, source: Source, alongside: bool) -> BenchResult<DrainRun> {
    let db = logical.scratch("wal_drain").await?;
    let result = async {
        source.prepare(&db.cfg).await?;
        let client = connect(&db.cfg).await?;
        let reader = if alongside {
            if !source.is_wal() {
                client.batch_execute(OUTBOX_PUBLICATION).await?;
            }
            Some(BareStream::start(&db.cfg, "pg_outbox", None).await?)
        } else {
            None
        };
        util::autovacuum_off(&client).await?;
        let writer = connect(&db.cfg).await?;
        let insert = writer
            .prepare(&format!(
                "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'invoice', md5('burst-' || (g % 10000))::uuid, 'InvoiceIssued', {} \
                 FROM generate_series($1::bigint, $2::bigint) AS g",
                util::envelope_sql()
            ))
            .await?;
        let mut relay = start_relay(&conninfo(&db.cfg), source.relay_args(), false).await?;
        let measured = async {
            // Let the relay reach its idle state.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let n = s.wal_burst;
            let wal_before: f64 = client.query_one(WAL_POSITION, &[]).await?.try_get(0)?;
            let started = Instant::now();
            let deadline = started + Duration::from_secs_f64(s.drain_max_secs);
            let write = async {
                let mut first = 1i64;
                while first <= n {
                    let last = (first + BURST_BATCH - 1).min(n);
                    writer.execute(&insert, &[&first, &last]).await?;
                    first = last + 1;
                }
                Ok::<_, BoxError>(started.elapsed().as_secs_f64())
            };
            let write_seconds = tokio::time::timeout_at(deadline.into(), write)
                .await
                .map_err(|_| format!("writing the {n}-event burst took over {} s", s.drain_max_secs))??;
            let mut capped = false;
            loop {
                relay.check_running().await?;
                if util::fresh_unpublished(&client).await? == 0 {
                    break;
                }
                if Instant::now() >= deadline {
                    capped = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let seconds = started.elapsed().as_secs_f64();
            let wal_after: f64 = client.query_one(WAL_POSITION, &[]).await?.try_get(0)?;
            let published = n - util::fresh_unpublished(&client).await?;
            Ok::<_, BoxError>(DrainRun {
                source,
                reader_alongside: alongside,
                events: n,
                write_seconds,
                seconds,
                capped,
                published,
                wal_bytes_per_event: (wal_after - wal_before) / n.max(1) as f64,
            })
        }
        .await;
        match &measured {
            Ok(r) if !r.capped => stop_relay(relay).await?,
            // Capped or failed: it may be in a statement a graceful stop
            // would wait for.
            _ => {
                relay.kill().await?;
            }
        }
        if let Some(reader) = reader {
            let caught_up = match &measured {
                Ok(_) => reader.caught_up(u64::try_from(s.wal_burst)?).await,
                Err(_) => Ok(()),
            };
            reader.stop().await?;
            caught_up?;
        }
        measured
    }
    .await;
    drop_db(logical, db).await;
    let run = result?;
    eprintln!(
        "e2e: wal: drain {:<36} {} events written in {:.1} s, published in {:.1} s = {}/s{}, WAL {:.0} bytes/event",
        run.name(),
        fmt_count(run.published as f64),
        run.write_seconds,
        run.seconds,
        fmt_count(run.rate()),
        if run.capped { " (capped)" } else { "" },
        run.wal_bytes_per_event
    );
    Ok(run)
}

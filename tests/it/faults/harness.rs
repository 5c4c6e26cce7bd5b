//! The fault suite's relays (the kit's process, numbered) and the checks every test runs: nothing lost, nothing published without delivery, order per aggregate, duplicates within the in-flight window.

use super::*;

// ---------------------------------------------------------------- relay processes

/// Relay number `n` of a test (the kit's process), and whether it should be running.
pub(crate) struct RelayProc {
    pub(crate) n: u32,
    pub(super) proc: process::RelayProc,
    pub(crate) alive: bool,
}

impl RelayProc {
    /// Start relay number `n` delivering to the sink's URL for `n`; wait until
    /// it says it started.
    pub(super) async fn start(db_url: &str, sink: &Sink, n: u32, args: &[String]) -> RelayProc {
        let spec = process::Relay::new(support::bin()).url(db_url).args(&["--sink".to_string(), sink.url_for(n)]);
        RelayProc::start_spec(n, spec.args(args)).await
    }

    /// Start `spec` as relay number `n`; wait until it says it started.
    pub(crate) async fn start_spec(n: u32, spec: process::Relay) -> RelayProc {
        let proc = spec.start().await.unwrap_or_else(|e| panic!("relay {n}: {e}"));
        RelayProc { n, proc, alive: true }
    }

    /// Send `signal` (SIGSTOP, SIGCONT, ...).
    pub(crate) fn signal(&self, signal: libc::c_int) {
        self.proc.send(signal).unwrap_or_else(|e| panic!("relay {}: {e}", self.n));
    }

    pub(crate) fn log(&self) -> String {
        self.proc.log()
    }

    pub(super) fn is_active(&self) -> bool {
        self.alive && self.proc.signalled(ACTIVE)
    }

    /// Wait until the relay logs one of `signals` (docs/operations.md, "Logs").
    pub(crate) async fn wait_signal(&mut self, signals: &[&str]) {
        let n = self.n;
        self.proc.wait_signal(signals, LIVENESS).await.unwrap_or_else(|e| panic!("relay {n}: {e}"));
    }

    /// How many of the relay's lines carry `signal`.
    pub(crate) fn signal_count(&self, signal: &str) -> usize {
        self.proc.signal_count(signal)
    }

    /// If the relay exited without the test killing it, say how.
    pub(super) async fn unexpected_exit(&mut self) -> Option<String> {
        if !self.alive {
            return None;
        }
        let status = self.proc.exited().await.expect("poll the relay process")?;
        self.alive = false;
        let log = self.log();
        let why = if log.contains("shutting down") {
            "it got SIGINT/SIGTERM, which this test never sends"
        } else {
            "it stopped by itself"
        };
        Some(format!("relay {} exited unexpectedly ({status}): {why}", self.n))
    }

    /// `kill -9` the relay and reap it; returns the instant of the kill.
    pub(crate) async fn kill9(&mut self) -> Instant {
        let at = Instant::now();
        let status = self.proc.kill().await.unwrap_or_else(|e| panic!("relay {}: {e}", self.n));
        assert_eq!(status.signal(), Some(libc::SIGKILL), "relay {} died of SIGKILL ({status})", self.n);
        self.alive = false;
        at
    }
}

// ---------------------------------------------------------------- the checks

/// How many faults a test injected: counted by the test, or the webhook's
/// answers with a given status (counted once the outbox is drained).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Faults {
    Injected(usize),
    SinkAnswers(u16),
}

/// The counts a test reports and asserts on.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) kind: &'static str,
    pub(crate) faults: usize,
    pub(crate) events: usize,
    pub(crate) lost: usize,
    pub(crate) duplicates: usize,
    pub(crate) published_without_delivery: usize,
    pub(crate) order_violations: usize,
    /// Deliveries of an aggregate under a lower term than one already
    /// delivered for it: a deposed relay's send that arrived late (only a
    /// send already in hand when the relay was deposed can; the fencing
    /// keeps it from handing out more). Reported, for the record.
    pub(crate) term_regressions: usize,
    pub(crate) rolled_back: usize,
    pub(crate) rolled_back_sent: usize,
    pub(crate) unknown_sent: usize,
    pub(crate) aggregate_mismatches: usize,
    pub(crate) rows_not_committed: usize,
    pub(crate) uncertain: usize,
    pub(crate) attempts: usize,
    pub(crate) not_delivered_attempts: usize,
    pub(crate) retries: usize,
    pub(crate) examples: Vec<String>,
    /// Every attempt of the first aggregate whose order was violated.
    pub(crate) trace: String,
}

impl Report {
    pub(super) fn summary(&self) -> String {
        format!(
            "fault={} faults={} events={} lost={} duplicates={} published_without_delivery={} order_violations={} \
             term_regressions={}",
            self.kind,
            self.faults,
            self.events,
            self.lost,
            self.duplicates,
            self.published_without_delivery,
            self.order_violations,
            self.term_regressions
        )
    }
}

pub(crate) struct Harness {
    pub(super) kind: &'static str,
    pub(super) seed: u64,
    pub(super) url: String,
    pub(crate) sink: Sink,
    pub(super) args: Vec<String>,
    pub(crate) relays: Vec<RelayProc>,
    pub(super) started: Instant,
    /// The subscription its relays deliver (`None`: the default one).
    pub(super) subscription: Option<&'static str>,
}

impl Harness {
    pub(crate) async fn new(kind: &'static str, seed: u64, url: String, behavior: Behavior, extra: &[&str]) -> Harness {
        let mut args: Vec<String> =
            ["--mode", "single", "--batch-size", &BATCH.to_string(), "--retry-schedule", "100ms"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        Harness {
            kind,
            seed,
            url,
            sink: Sink::start(behavior).await,
            args,
            relays: Vec::new(),
            started: Instant::now(),
            subscription: None,
        }
    }

    /// Deliver subscription `name` instead of the default one: its relays
    /// run with `--subscription name`, and an event counts as published
    /// once settled for it.
    pub(crate) fn for_subscription(mut self, name: &'static str) -> Harness {
        self.args.extend(["--subscription".to_string(), name.to_string()]);
        self.subscription = Some(name);
        self
    }

    /// Its relays run in partitioned mode with `partitions` partitions.
    pub(crate) fn partitioned(mut self, partitions: u32) -> Harness {
        let at = self.args.iter().position(|a| a == "--mode").expect("--mode");
        self.args[at + 1] = "partitioned".to_string();
        self.args.extend(["--partitions".to_string(), partitions.to_string()]);
        self
    }

    /// Start one more relay; returns its index in `relays`.
    pub(crate) async fn start_relay(&mut self) -> usize {
        let n = u32::try_from(self.relays.len() + 1).expect("few relays");
        let relay = RelayProc::start(&self.url, &self.sink, n, &self.args).await;
        self.relays.push(relay);
        self.relays.len() - 1
    }

    /// Fail the test if a relay exited that the test did not kill.
    pub(crate) async fn assert_relays_running(&mut self) {
        assert_running(self.kind, &mut self.relays.iter_mut().collect::<Vec<_>>()).await;
    }

    /// The relays' stderr (the end of it), for failure messages.
    pub(crate) fn logs(&self) -> String {
        logs(self.relays.iter())
    }

    /// Wait for the outbox to end published, then check everything against
    /// the producers' ledger and the webhook's log; print the summary line.
    pub(crate) async fn finish(&mut self, faults: Faults, ledger: Ledger) -> Report {
        let c = connect(&self.url, "fault-suite checker", Duration::from_secs(60)).await;
        let (committed, rolled_back) = ledger.resolve(&c).await;
        let relays = &mut self.relays.iter_mut().collect::<Vec<_>>();
        let drained_in = wait_drained_in(&c, self.subscription, self.kind, self.seed, relays).await;

        // The rows first, then the webhook's log: a published row was
        // acknowledged after its 2xx, so its delivery is in the log by now.
        let rows: Vec<(i64, Uuid, bool)> = c
            .query(
                "SELECT o.id, o.aggregate_id, CASE WHEN $1::text IS NULL THEN o.published_at IS NOT NULL \
                   ELSE (o.id <= s.cursor_id OR o.id = ANY (s.settled)) AND NOT EXISTS ( \
                     SELECT 1 FROM events.outbox_subscription_failures f \
                      WHERE f.subscription = s.name AND f.id = o.id) END \
                 FROM events.outbox o LEFT JOIN events.outbox_subscriptions s ON s.name = $1::text ORDER BY o.id",
                &[&self.subscription],
            )
            .await
            .expect("read outbox rows")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let attempts = self.sink.attempts();
        let row_agg: HashMap<i64, Uuid> = rows.iter().map(|(id, agg, _)| (*id, *agg)).collect();

        let faults = match faults {
            Faults::Injected(n) => n,
            Faults::SinkAnswers(status) => attempts.iter().filter(|a| a.status == status).count(),
        };
        let mut report = Report {
            kind: self.kind,
            faults,
            events: committed.len(),
            rolled_back: rolled_back.len(),
            uncertain: ledger.uncertain.len(),
            attempts: attempts.len(),
            retries: ledger.retries,
            ..Report::default()
        };
        let mut received: HashSet<i64> = HashSet::new();
        // Per aggregate: highest id received so far, and highest term.
        let mut high: HashMap<Uuid, i64> = HashMap::new();
        let mut high_term: HashMap<Uuid, i64> = HashMap::new();
        let mut first_violated: Option<Uuid> = None;
        for a in &attempts {
            if rolled_back.contains(&a.id) {
                report.rolled_back_sent += 1;
                report.examples.push(format!("rolled-back id {} sent by relay {}", a.id, a.relay));
            } else if !row_agg.contains_key(&a.id) {
                report.unknown_sent += 1;
                report.examples.push(format!("unknown id {} sent by relay {}", a.id, a.relay));
            }
            if row_agg.get(&a.id).is_some_and(|agg| *agg != a.aggregate) {
                report.aggregate_mismatches += 1;
            }
            if !a.delivered() {
                report.not_delivered_attempts += 1;
                continue;
            }
            let t = high_term.entry(a.aggregate).or_insert(a.term);
            if a.term < *t {
                report.term_regressions += 1;
            }
            *t = (*t).max(a.term);
            if !received.insert(a.id) {
                report.duplicates += 1;
                continue;
            }
            let h = high.entry(a.aggregate).or_insert(i64::MIN);
            if a.id < *h {
                report.order_violations += 1;
                first_violated.get_or_insert(a.aggregate);
                if report.examples.len() < 20 {
                    report.examples.push(format!(
                        "order: id {} of {} first received after id {} (relay {})",
                        a.id, a.aggregate, *h, a.relay
                    ));
                }
            }
            *h = (*h).max(a.id);
        }
        if let Some(agg) = first_violated {
            let t0 = attempts.first().map_or(self.started, |a| a.at);
            let lines: Vec<String> = attempts
                .iter()
                .filter(|a| a.aggregate == agg)
                .map(|a| {
                    format!(
                        "{:>8.3}s id={} status={} retry_count={} term={} relay={}",
                        a.at.duration_since(t0).as_secs_f64(),
                        a.id,
                        a.status,
                        a.retry_count,
                        a.term,
                        a.relay
                    )
                })
                .collect();
            report.trace = format!("attempts of aggregate {agg}, in arrival order:\n{}", lines.join("\n"));
        }
        report.lost = committed.keys().filter(|id| !received.contains(id)).count();
        for id in committed.keys().filter(|id| !received.contains(id)).take(5) {
            let tried: Vec<String> =
                attempts.iter().filter(|a| a.id == *id).map(|a| format!("{}@relay{}", a.status, a.relay)).collect();
            report.examples.push(format!("lost id {id} (attempts: {tried:?})"));
        }
        report.published_without_delivery =
            rows.iter().filter(|(id, _, published)| *published && !received.contains(id)).count();
        report.rows_not_committed = rows.iter().filter(|(id, _, _)| !committed.contains_key(id)).count();
        println!("{}", report.summary());
        println!(
            "fault={} seed={:#x} detail: rolled_back={} uncertain_commits={} producer_retries={} attempts={} \
             non_2xx_attempts={} relays_started={} drained_after_load={:?} test_time={:?}",
            self.kind,
            self.seed,
            report.rolled_back,
            report.uncertain,
            report.retries,
            report.attempts,
            report.not_delivered_attempts,
            self.relays.len(),
            drained_in,
            self.started.elapsed()
        );
        report
    }

    /// The assertions every test makes; `max_duplicates` is 0 for faults
    /// that cannot cause duplicates.
    pub(crate) fn check(&self, r: &Report, max_duplicates: usize) {
        let ctx = || {
            format!(
                "{} (seed {:#x})\nexamples: {:#?}\n{}\n{}",
                r.summary(),
                self.seed,
                r.examples,
                r.trace,
                self.logs()
            )
        };
        let malformed = self.sink.malformed();
        assert!(malformed.is_empty(), "malformed webhook bodies: {malformed:?}");
        assert!(r.events > 0 && r.faults > 0, "a load ran and a fault was injected: {}", ctx());
        assert_eq!(r.lost, 0, "committed events never delivered: {}", ctx());
        assert_eq!(r.rolled_back_sent, 0, "rolled-back events were sent: {}", ctx());
        assert_eq!(r.unknown_sent, 0, "ids that are not in the outbox were sent: {}", ctx());
        assert_eq!(r.aggregate_mismatches, 0, "records with the wrong aggregate: {}", ctx());
        assert_eq!(r.rows_not_committed, 0, "rows in the outbox that no producer committed: {}", ctx());
        assert_eq!(r.published_without_delivery, 0, "rows published without a 2xx delivery: {}", ctx());
        assert_eq!(r.order_violations, 0, "per-aggregate order violated: {}", ctx());
        assert!(
            r.duplicates <= max_duplicates,
            "{} duplicates, at most {max_duplicates} allowed for this fault: {}",
            r.duplicates,
            ctx()
        );
    }
}

/// Fail the test if one of `relays` exited that the test did not kill.
pub(crate) async fn assert_running(kind: &str, relays: &mut [&mut RelayProc]) {
    let mut exits = Vec::new();
    for r in relays.iter_mut() {
        exits.extend(r.unexpected_exit().await);
    }
    assert!(exits.is_empty(), "fault={kind}: {}\n{}", exits.join("; "), logs(relays.iter().map(|r| &**r)));
}

/// The relays' stderr (the end of it), for failure messages.
pub(crate) fn logs<'a>(relays: impl IntoIterator<Item = &'a RelayProc>) -> String {
    let mut out = String::new();
    for r in relays {
        let log = r.log();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        out.push_str(&format!("--- relay {} (alive: {}) stderr, last lines:\n{tail}\n", r.n, r.alive));
    }
    out
}

/// Liveness: wait until every row of the outbox is published (failing, with
/// the stuck rows and the relays' logs, on a dead letter, an unexpected
/// exit of a relay, or after [`DRAIN_LIVENESS`]); returns how long it took.
pub(crate) async fn wait_drained(c: &Client, kind: &str, seed: u64, relays: &mut [&mut RelayProc]) -> Duration {
    wait_drained_in(c, None, kind, seed, relays).await
}

/// [`wait_drained`] for `subscription` (`None`: the default one): a named
/// one is drained when no event above its cursor is unsettled and no
/// failure row is left.
pub(crate) async fn wait_drained_in(
    c: &Client,
    subscription: Option<&str>,
    kind: &str,
    seed: u64,
    relays: &mut [&mut RelayProc],
) -> Duration {
    let load_done = Instant::now();
    let deadline = load_done + DRAIN_LIVENESS;
    loop {
        let row = match subscription {
            None => {
                c.query_one(
                    "SELECT count(*) FILTER (WHERE published_at IS NULL), \
                        count(*) FILTER (WHERE next_retry_at = 'infinity') FROM events.outbox",
                    &[],
                )
                .await
            }
            Some(name) => {
                c.query_one(
                    "SELECT (SELECT count(*) FROM events.outbox o, events.outbox_subscriptions s \
                          WHERE s.name = $1 AND o.id > s.cursor_id AND NOT o.id = ANY (s.settled)) \
                      + (SELECT count(*) FROM events.outbox_subscription_failures WHERE subscription = $1), \
                        (SELECT count(*) FROM events.outbox_subscription_failures \
                          WHERE subscription = $1 AND next_retry_at = 'infinity')",
                    &[&name],
                )
                .await
            }
        };
        let row = row.expect("count unpublished rows");
        let (unpublished, dead): (i64, i64) = (row.get(0), row.get(1));
        if unpublished == 0 {
            return load_done.elapsed();
        }
        assert_running(kind, relays).await;
        if dead > 0 || Instant::now() > deadline {
            let stuck: Vec<String> = c
                .query(
                    "SELECT id, aggregate_id, retry_count, next_retry_at::text, last_error FROM events.outbox \
                     WHERE published_at IS NULL ORDER BY id LIMIT 20",
                    &[],
                )
                .await
                .expect("unpublished rows")
                .iter()
                .map(|r| {
                    format!(
                        "{} {} retry_count={} next_retry_at={:?} last_error={:?}",
                        r.get::<_, i64>(0),
                        r.get::<_, Uuid>(1),
                        r.get::<_, i32>(2),
                        r.get::<_, Option<String>>(3),
                        r.get::<_, Option<String>>(4)
                    )
                })
                .collect();
            panic!(
                "fault={kind} seed={seed:#x}: {unpublished} rows never published ({dead} dead letters) within {:?}:\n{}\n{}",
                DRAIN_LIVENESS,
                stuck.join("\n"),
                logs(relays.iter().map(|r| &**r))
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn load_spec(url: &str, seed: u64, rng: &mut StdRng) -> LoadSpec {
    LoadSpec {
        url: url.to_string(),
        seed,
        events: EVENTS,
        producers: PRODUCERS,
        aggregates: aggregates(rng),
        avoid: None,
        publisher: false,
        pace_ms: PACE_MS,
    }
}

/// Terminate the backends named `app` until at least one was terminated
/// (the relay may be reconnecting at that instant); returns how many.
pub(super) async fn terminate(db: &TestDb, h: &mut Harness, app: &str) -> i64 {
    let deadline = Instant::now() + LIVENESS;
    loop {
        h.assert_relays_running().await;
        let n = db.terminate(app).await;
        if n > 0 {
            return n;
        }
        assert!(Instant::now() < deadline, "no backend named {app:?} to terminate within {LIVENESS:?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

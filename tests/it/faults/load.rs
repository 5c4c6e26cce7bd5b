//! The fault suite's producers: transactions of the seed's INSERT (or the publisher) on a few aggregates, some rolled back, and the ledger of what committed.

use super::*;

// ---------------------------------------------------------------- producers

/// What the producers did, by event id.
#[derive(Debug, Default, Clone)]
pub(crate) struct Ledger {
    /// COMMIT acknowledged.
    pub(crate) committed: Vec<(i64, Uuid)>,
    /// Rolled back on purpose, or failed before COMMIT was sent.
    pub(crate) rolled_back: Vec<(i64, Uuid)>,
    /// COMMIT sent, outcome unknown (the connection broke): committed iff the row exists.
    pub(crate) uncertain: Vec<(i64, Uuid)>,
    pub(super) transactions: usize,
    /// Transactions retried after an error.
    pub(super) retries: usize,
}

impl Ledger {
    /// The ids committed (with their aggregates) and rolled back: a COMMIT
    /// whose outcome is unknown counts as committed iff its row exists.
    pub(crate) async fn resolve(&self, c: &Client) -> (BTreeMap<i64, Uuid>, BTreeSet<i64>) {
        let uncertain_ids: Vec<i64> = self.uncertain.iter().map(|(id, _)| *id).collect();
        let existing: HashSet<i64> = c
            .query("SELECT id FROM events.outbox WHERE id = ANY($1)", &[&uncertain_ids])
            .await
            .expect("look up uncertain ids")
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut committed: BTreeMap<i64, Uuid> = self.committed.iter().copied().collect();
        let mut rolled_back: BTreeSet<i64> = self.rolled_back.iter().map(|(id, _)| *id).collect();
        for (id, agg) in &self.uncertain {
            if existing.contains(id) {
                committed.insert(*id, *agg);
            } else {
                rolled_back.insert(*id);
            }
        }
        (committed, rolled_back)
    }

    pub(super) fn merge(&mut self, other: Ledger) {
        self.committed.extend(other.committed);
        self.rolled_back.extend(other.rolled_back);
        self.uncertain.extend(other.uncertain);
        self.transactions += other.transactions;
        self.retries += other.retries;
    }
}

pub(super) enum Outcome {
    Committed(Vec<(i64, Uuid)>),
    RolledBack(Vec<(i64, Uuid)>),
    /// Failed before COMMIT was sent: nothing of it can be committed.
    Failed(Vec<(i64, Uuid)>),
    /// COMMIT sent, no acknowledgement.
    Unknown(Vec<(i64, Uuid)>),
}

/// Connect with `application_name = app`, retrying for up to `patience`.
pub(crate) async fn connect(url: &str, app: &str, patience: Duration) -> Client {
    let mut cfg: tokio_postgres::Config = url.parse().expect("database URL parses");
    cfg.application_name(app).connect_timeout(Duration::from_secs(5));
    let deadline = Instant::now() + patience;
    loop {
        match cfg.connect(NoTls).await {
            Ok((client, conn)) => {
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                return client;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot connect as {app} within {patience:?}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Connect through pg-outbox (`ConnectOptions::connect_primary`: every host
/// of a multi-host URL in turn, a standby refused) with `application_name =
/// app`, retrying for up to `patience`.
pub(super) async fn connect_primary(url: &str, app: &str, patience: Duration) -> Client {
    let opts = pg_outbox::ConnectOptions::parse(url).expect("database URL parses").with_application_name(app);
    let deadline = Instant::now() + patience;
    loop {
        match opts.connect_primary().await {
            Ok(client) => return client,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "cannot connect as {app} within {patience:?}: {}",
                    pg_outbox::error::report(&e)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One transaction: BEGIN, an INSERT for each aggregate (the seed's, or
/// `Publisher::publish` with `publisher`; some followed by a small sleep),
/// then COMMIT or ROLLBACK.
pub(super) async fn run_transaction(
    client: &mut Client,
    tag: (usize, usize),
    aggs: &[Uuid],
    sleeps: &[u64],
    rollback: bool,
    publisher: bool,
) -> Outcome {
    let mut ids = Vec::with_capacity(aggs.len());
    let Ok(tx) = client.transaction().await else { return Outcome::Failed(ids) };
    for (k, (agg, pause)) in aggs.iter().zip(sleeps).enumerate() {
        let payload = json!({"version": 1, "data": {"producer": tag.0, "tx": tag.1, "n": k}});
        let inserted = if publisher {
            let event = pg_outbox::NewEvent::new(AGGREGATE_TYPE, *agg, EVENT_TYPE, payload);
            pg_outbox::Publisher::new().publish(&tx, &event).await.ok()
        } else {
            tx.query_one(SEED_INSERT, &[&AGGREGATE_TYPE, agg, &EVENT_TYPE, &payload]).await.ok().map(|r| r.get(0))
        };
        match inserted {
            Some(id) => ids.push((id, *agg)),
            None => return Outcome::Failed(ids), // dropping tx rolls it back
        }
        if *pause > 0 {
            tokio::time::sleep(Duration::from_millis(*pause)).await;
        }
    }
    if rollback {
        let _ = tx.rollback().await;
        return Outcome::RolledBack(ids);
    }
    match tx.commit().await {
        Ok(()) => Outcome::Committed(ids),
        Err(_) => Outcome::Unknown(ids),
    }
}

/// An aggregate producers must not pick while `flag` is set.
#[derive(Clone)]
pub(super) struct Avoid {
    pub(super) aggregate: Uuid,
    pub(super) flag: Arc<AtomicBool>,
}

#[derive(Clone)]
pub(crate) struct LoadSpec {
    pub(super) url: String,
    pub(super) seed: u64,
    pub(crate) events: usize,
    pub(super) producers: usize,
    pub(crate) aggregates: Vec<Uuid>,
    pub(super) avoid: Option<Avoid>,
    /// Publish through pg-outbox (`ConnectOptions::connect_primary` and
    /// `Publisher`) instead of the seed's plain INSERT on a tokio-postgres
    /// connection.
    pub(crate) publisher: bool,
    /// Largest pause between a producer's transactions, in ms.
    pub(crate) pace_ms: u64,
}

/// A producer: transactions of 1–3 events on random aggregates (inserted in
/// a fixed aggregate order, so producers never deadlock), one in ten rolled
/// back, until `quota` events are committed. On an error it reconnects if
/// needed and retries the transaction.
pub(super) async fn producer(spec: Arc<LoadSpec>, idx: usize, quota: usize, progress: Arc<AtomicUsize>) -> Ledger {
    let mut rng = StdRng::seed_from_u64(spec.seed.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(idx as u64 + 1)));
    let mut ledger = Ledger::default();
    let app = format!("fault-suite producer {idx}");
    let open = || async {
        if spec.publisher {
            connect_primary(&spec.url, &app, Duration::from_secs(60)).await
        } else {
            connect(&spec.url, &app, Duration::from_secs(60)).await
        }
    };
    let mut client = open().await;
    let mut done = 0;
    let mut txn = 0;
    while done < quota {
        let n = rng.random_range(1..=3usize);
        let mut picks: Vec<usize> = (0..n).map(|_| rng.random_range(0..spec.aggregates.len())).collect();
        picks.sort_unstable();
        let mut aggs: Vec<Uuid> = picks.iter().map(|&i| spec.aggregates[i]).collect();
        let sleeps: Vec<u64> =
            (0..n).map(|_| if rng.random_bool(0.15) { rng.random_range(1..=5) } else { 0 }).collect();
        let rollback = rng.random_bool(0.1);
        let pace = rng.random_range(0..=spec.pace_ms);
        if let Some(avoid) = &spec.avoid
            && avoid.flag.load(Ordering::SeqCst)
        {
            aggs.retain(|a| *a != avoid.aggregate);
            if aggs.is_empty() {
                tokio::time::sleep(Duration::from_millis(pace)).await;
                continue;
            }
        }
        txn += 1;
        ledger.transactions += 1;
        loop {
            if client.is_closed() {
                client = open().await;
            }
            match run_transaction(&mut client, (idx, txn), &aggs, &sleeps, rollback, spec.publisher).await {
                Outcome::Committed(ids) => {
                    done += ids.len();
                    progress.fetch_add(ids.len(), Ordering::SeqCst);
                    ledger.committed.extend(ids);
                    break;
                }
                Outcome::RolledBack(ids) => {
                    ledger.rolled_back.extend(ids);
                    break;
                }
                Outcome::Failed(ids) => ledger.rolled_back.extend(ids),
                Outcome::Unknown(ids) => ledger.uncertain.extend(ids),
            }
            ledger.retries += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(pace)).await;
    }
    ledger
}

/// Producers running in the background.
pub(crate) struct Load {
    pub(super) progress: Arc<AtomicUsize>,
    pub(super) tasks: Vec<JoinHandle<Ledger>>,
    pub(crate) events: usize,
}

impl Load {
    pub(crate) fn spawn(spec: LoadSpec) -> Load {
        let progress = Arc::new(AtomicUsize::new(0));
        let events = spec.events;
        let producers = spec.producers;
        let spec = Arc::new(spec);
        let tasks = (0..producers)
            .map(|i| {
                let quota = events / producers + usize::from(i < events % producers);
                tokio::spawn(producer(spec.clone(), i, quota, progress.clone()))
            })
            .collect();
        Load { progress, tasks, events }
    }

    /// Events committed so far.
    pub(crate) fn committed(&self) -> usize {
        self.progress.load(Ordering::SeqCst)
    }

    /// Wait until at least `n` events are committed.
    pub(crate) async fn reached(&self, n: usize) {
        let deadline = Instant::now() + DRAIN_LIVENESS;
        while self.progress.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "producers stuck at {} committed events (waiting for {n})",
                self.progress.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    pub(crate) async fn join(self) -> Ledger {
        let mut all = Ledger::default();
        for t in self.tasks {
            all.merge(tokio::time::timeout(DRAIN_LIVENESS, t).await.expect("producers finish").expect("producer"));
        }
        all
    }
}

/// `k` points of the load (in committed events), one in each of `k` equal
/// slices of its middle 80 %.
pub(crate) fn fault_points(rng: &mut StdRng, events: usize, k: usize) -> Vec<usize> {
    (0..k)
        .map(|i| {
            let lo = events as f64 * (0.1 + 0.8 * i as f64 / k as f64);
            let hi = events as f64 * (0.1 + 0.8 * (i + 1) as f64 / k as f64);
            rng.random_range(lo as usize..(hi as usize).max(lo as usize + 1))
        })
        .collect()
}

pub(super) fn aggregates(rng: &mut StdRng) -> Vec<Uuid> {
    (0..AGGREGATES).map(|_| Uuid::from_u128(rng.random::<u128>())).collect()
}

//! `pg-outbox demo`: the publisher and consumer flow of docs/schema.md end
//! to end on a throwaway server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::temp_server::TempServer;
use pg_outbox::relay::{Message, SendFuture, Sent, Sink, StdoutSink};
use pg_outbox::{ConnectOptions, Consumer, Envelope, Event, Metadata, NewEvent, Publisher};

use crate::error::Error;

#[derive(clap::Args, Debug)]
pub(crate) struct DemoArgs {
    /// Events to produce in all.
    #[arg(long, default_value_t = 1000)]
    events: usize,
    /// Concurrent producer connections.
    #[arg(long, default_value_t = 4)]
    producers: usize,
    /// Subscriptions (aggregates) the producers update.
    #[arg(long, default_value_t = 20)]
    subscriptions: usize,
    /// One producer transaction in this many is rolled back (its event must
    /// never be delivered); 0 for none.
    #[arg(long, default_value_t = 10)]
    rollback_every: usize,
    /// Run on this PostgreSQL server instead of a throwaway one: the demo
    /// creates a scratch database there (pg_outbox_demo_<pid>) and drops it
    /// afterwards. DATABASE_URL is deliberately not used, so the demo never
    /// touches an application's outbox.
    #[arg(long, value_name = "URL")]
    server_url: Option<String>,
}

#[derive(Default)]
struct Seen {
    delivered_at: HashMap<i64, Instant>,
    per_aggregate_last: HashMap<uuid::Uuid, i64>,
    order_violations: u64,
    duplicates: u64,
}

/// Stdout, plus bookkeeping for the summary.
struct DemoSink {
    inner: StdoutSink,
    seen: Arc<Mutex<Seen>>,
}

impl Sink for DemoSink {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn max_in_flight(&self) -> Option<usize> {
        self.inner.max_in_flight()
    }

    fn send<'a>(&'a self, message: &'a Message, event: &'a Event) -> SendFuture<'a> {
        Box::pin(async move {
            self.inner.send(message, event).await?;
            let now = Instant::now();
            let mut s = lock(&self.seen);
            if s.delivered_at.insert(event.id, now).is_some() {
                s.duplicates += 1;
            }
            let last = s.per_aggregate_last.insert(event.aggregate_id, event.id);
            if last.is_some_and(|l| l > event.id) {
                s.order_violations += 1;
            }
            Ok(Sent::Delivered)
        })
    }
}

const SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS billing; \
    CREATE TABLE IF NOT EXISTS billing.subscriptions ( \
      id UUID PRIMARY KEY, status TEXT NOT NULL DEFAULT 'active', \
      payments INTEGER NOT NULL DEFAULT 0, updated_at TIMESTAMPTZ NOT NULL DEFAULT now())";

pub(crate) async fn run(args: DemoArgs) -> Result<(), Error> {
    if args.producers == 0 || args.subscriptions == 0 || args.events == 0 {
        return Err(Error::Config("--events, --producers and --subscriptions must be at least 1".into()));
    }
    match args.server_url.clone() {
        Some(server) => {
            // A scratch database on the given server, dropped afterwards.
            let name = format!("pg_outbox_demo_{}", std::process::id());
            let server = ConnectOptions::parse(&server)?;
            let admin = crate::db::connect(&server).await?;
            admin.batch_execute(&format!("CREATE DATABASE {name}")).await?;
            let opts = server.with_dbname(&name);
            eprintln!("demo: created scratch database {name} on {}", opts.describe());
            let result = run_on(&opts, &args).await;
            if let Err(e) = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await {
                eprintln!("demo: could not drop {name}: {}", pg_outbox::error::report(&e));
            }
            result
        }
        None => {
            eprintln!("demo: starting a throwaway PostgreSQL from the local binaries ...");
            let server = tokio::task::spawn_blocking(TempServer::start)
                .await
                .map_err(|e| Error::Check(format!("throwaway server start panicked: {e}")))??;
            eprintln!("demo: PostgreSQL running at 127.0.0.1:{}", server.port());
            let result = run_on(&ConnectOptions::parse(&server.url())?, &args).await;
            drop(server); // stops and deletes the throwaway server
            result
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Commit times of the events producers committed, by id.
type Committed = HashMap<i64, Instant>;

async fn run_on(opts: &ConnectOptions, args: &DemoArgs) -> Result<(), Error> {
    let metrics = crate::prometheus::install_metrics("default")?;
    let admin = crate::db::connect_with(opts.clone()).await?;
    let subs = prepare(opts, &admin, args).await?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (stop_tx, relay) = start_relay(opts, seen.clone()).await?;
    eprintln!(
        "demo: {} producers write {} events for {} subscriptions (1 in {} rolled back) ...",
        args.producers, args.events, args.subscriptions, args.rollback_every
    );
    let started = Instant::now();
    let (committed, rolled_back) = run_producers(opts, args, &subs).await?;
    wait_delivered(&seen, committed.len(), Duration::from_secs(60)).await;
    let elapsed = started.elapsed();
    let _ = stop_tx.send(());
    relay.await.map_err(|e| Error::Config(format!("relay panicked: {e}")))??;
    // The scratch database holds the demo's events only.
    let unpublished = pg_outbox::status::read(&admin).await?.unpublished;
    let summary = Summary::new(&committed, &lock(&seen), rolled_back, unpublished, elapsed)?;
    summary.print(&metrics);
    summary.check()
}

/// Migrate, create the demo's domain table and subscriptions; returns them.
async fn prepare(
    opts: &ConnectOptions,
    admin: &tokio_postgres::Client,
    args: &DemoArgs,
) -> Result<Vec<uuid::Uuid>, Error> {
    let report = pg_outbox::migrate::apply(opts).await?;
    eprintln!("demo: migrated ({} files applied)", report.applied.len());
    admin.batch_execute(SCHEMA).await?;
    let subs: Vec<uuid::Uuid> = (0..args.subscriptions).map(|_| uuid::Uuid::new_v4()).collect();
    admin
        .execute("INSERT INTO billing.subscriptions (id) SELECT unnest($1::uuid[]) ON CONFLICT DO NOTHING", &[&subs])
        .await?;
    Ok(subs)
}

type RelayTask = tokio::task::JoinHandle<Result<pg_outbox::relay::RelayStats, Error>>;

/// Start a relay into the demo sink; it stops when the sender is used.
async fn start_relay(
    opts: &ConnectOptions,
    seen: Arc<Mutex<Seen>>,
) -> Result<(tokio::sync::oneshot::Sender<()>, RelayTask), Error> {
    let stream = Consumer::builder(opts.clone()).start().await?;
    let sink = DemoSink { inner: StdoutSink::new(), seen };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(async move {
        let stop = async {
            let _ = stop_rx.await;
        };
        pg_outbox::relay::run(stream, &sink, stop).await.map_err(Error::from)
    });
    Ok((stop_tx, relay))
}

/// Run the producers to their end: what they committed, and how many
/// transactions they rolled back.
async fn run_producers(opts: &ConnectOptions, args: &DemoArgs, subs: &[uuid::Uuid]) -> Result<(Committed, u64), Error> {
    let committed: Arc<Mutex<Committed>> = Arc::default();
    let mut producers = Vec::new();
    for p in 0..args.producers {
        let (opts, subs, committed) = (opts.clone(), subs.to_vec(), committed.clone());
        let n = args.events / args.producers + usize::from(p < args.events % args.producers);
        let rollback_every = args.rollback_every;
        producers.push(tokio::spawn(async move { produce(opts, p, n, &subs, rollback_every, &committed).await }));
    }
    let mut rolled_back = 0u64;
    for p in producers {
        rolled_back += p.await.map_err(|e| Error::Config(format!("producer panicked: {e}")))??;
    }
    let committed = std::mem::take(&mut *lock(&committed));
    Ok((committed, rolled_back))
}

/// Wait until `produced` events were delivered, or `limit` passed.
async fn wait_delivered(seen: &Mutex<Seen>, produced: usize, limit: Duration) {
    let deadline = Instant::now() + limit;
    while lock(seen).delivered_at.len() < produced && Instant::now() <= deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the demo found.
struct Summary {
    produced: usize,
    rolled_back: u64,
    delivered: usize,
    lost: u64,
    stray: usize,
    duplicates: u64,
    order_violations: u64,
    unpublished: i64,
    elapsed: Duration,
    /// Commit-to-delivery lag, microseconds.
    lag: hdrhistogram::Histogram<u64>,
}

impl Summary {
    fn new(
        committed: &Committed,
        seen: &Seen,
        rolled_back: u64,
        unpublished: i64,
        elapsed: Duration,
    ) -> Result<Self, Error> {
        let mut lag = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
            .map_err(|e| Error::Config(format!("histogram: {e}")))?;
        let mut lost = 0u64;
        for (id, c) in committed {
            match seen.delivered_at.get(id) {
                Some(d) => {
                    let us = d.saturating_duration_since(*c).as_micros().max(1);
                    let _ = lag.record(u64::try_from(us).unwrap_or(u64::MAX));
                }
                None => lost += 1,
            }
        }
        Ok(Summary {
            produced: committed.len(),
            rolled_back,
            delivered: seen.delivered_at.len(),
            lost,
            stray: seen.delivered_at.keys().filter(|id| !committed.contains_key(id)).count(),
            duplicates: seen.duplicates,
            order_violations: seen.order_violations,
            unpublished,
            elapsed,
            lag,
        })
    }

    fn print(&self, metrics: &metrics_exporter_prometheus::PrometheusHandle) {
        let ms = |q: f64| self.lag.value_at_quantile(q) as f64 / 1000.0;
        let secs = self.elapsed.as_secs_f64();
        eprintln!();
        eprintln!("demo summary");
        eprintln!("  events committed        {}", self.produced);
        eprintln!("  transactions rolled back {} (their events must not appear)", self.rolled_back);
        eprintln!("  events delivered        {}", self.delivered);
        eprintln!("  lost                    {}", self.lost);
        eprintln!("  delivered but not committed {}", self.stray);
        eprintln!("  duplicates              {}", self.duplicates);
        eprintln!("  per-aggregate order violations {}", self.order_violations);
        eprintln!("  still unpublished       {}", self.unpublished);
        eprintln!("  wall time               {secs:.2} s ({:.0} events/s)", self.produced as f64 / secs);
        eprintln!(
            "  commit-to-delivery lag  p50 {:.2} ms  p90 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
            ms(0.5),
            ms(0.9),
            ms(0.99),
            self.lag.max() as f64 / 1000.0
        );
        eprintln!("  metrics (Prometheus text, selected):");
        const SHOWN: [&str; 5] = [
            "outbox_events_",
            "outbox_notifications",
            "outbox_sweeps",
            "outbox_delivery_lag_seconds_count",
            "outbox_delivery_lag_seconds_sum",
        ];
        for line in metrics.render().lines() {
            if !line.starts_with('#') && SHOWN.iter().any(|p| line.starts_with(p)) {
                eprintln!("    {line}");
            }
        }
    }

    fn check(&self) -> Result<(), Error> {
        if self.lost > 0 || self.stray > 0 || self.order_violations > 0 || self.unpublished > 0 {
            return Err(Error::Check(format!(
                "demo found a problem: {} lost, {} delivered without commit, {} order violations, {} unpublished",
                self.lost, self.stray, self.order_violations, self.unpublished
            )));
        }
        Ok(())
    }
}

/// One producer: the publisher flow of docs/schema.md, in the same
/// transaction as the domain update. Returns how many transactions it rolled back.
async fn produce(
    opts: ConnectOptions,
    p: usize,
    n: usize,
    subs: &[uuid::Uuid],
    rollback_every: usize,
    committed: &Mutex<Committed>,
) -> Result<u64, Error> {
    let mut client = crate::db::connect_with(opts).await?;
    let publisher = Publisher::new();
    let mut rolled_back = 0;
    for i in 0..n {
        let sub = subs[(p * 7919 + i * 31) % subs.len()];
        let tx = client.transaction().await?;
        let row = tx
            .query_one(
                "UPDATE billing.subscriptions SET payments = payments + 1, updated_at = now() WHERE id = $1 RETURNING payments",
                &[&sub],
            )
            .await?;
        let payments: i32 = row.try_get(0)?;
        let envelope = Envelope::new(
            1,
            serde_json::json!({"subscription_id": sub, "amount": 990, "currency": "EUR", "payment_no": payments}),
        )
        .with_metadata(Metadata::new().correlation_id(format!("demo-{p}-{i}")));
        let id = publisher
            .publish(&tx, &NewEvent::with_envelope("subscription", sub, "PaymentSucceeded", &envelope)?)
            .await?;
        if rollback_every > 0 && (i + 1) % rollback_every == 0 {
            tx.rollback().await?;
            rolled_back += 1;
        } else {
            tx.commit().await?;
            lock(committed).insert(id, Instant::now());
        }
        if i % 8 == 7 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    Ok(rolled_back)
}

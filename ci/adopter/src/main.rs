//! An application adopting pg-outbox: it publishes events through an sqlx
//! transaction and through a tokio-postgres transaction, each next to a
//! domain write, rolls one of each back, and consumes the stream until every
//! committed event has arrived.
//!
//! `DATABASE_URL` (a `postgres://` URL; default
//! `postgres://postgres@127.0.0.1:5432/postgres`) names a server and a
//! database to connect to first; the program creates a scratch database
//! there, migrates it, runs, and drops it again. `ADOPTER_EVENTS` sets how
//! many events each driver publishes (default 100). Exits 0 when every check
//! passes, 1 with a message otherwise.

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::StreamExt;
use pg_outbox::tokio_postgres;
use pg_outbox::{ConnectOptions, Consumer, NewEvent, Publisher};
use sqlx::Connection;
use uuid::Uuid;

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const DEFAULT_EVENTS: usize = 100;
/// How long the consumer may take to deliver every committed event.
const DELIVERY_DEADLINE: Duration = Duration::from_secs(60);
/// How long to keep watching the stream once every event has arrived.
const QUIET_AFTERWARDS: Duration = Duration::from_millis(500);
/// The event type of the events whose transactions roll back.
const ROLLED_BACK: &str = "OrderRolledBack";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let url = std::env::var("DATABASE_URL").ok().filter(|u| !u.trim().is_empty()).unwrap_or_else(|| DEFAULT_URL.into());
    let n = match std::env::var("ADOPTER_EVENTS") {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("adopter: ADOPTER_EVENTS must be a positive integer, not {v:?}");
                return ExitCode::FAILURE;
            }
        },
        Err(_) => DEFAULT_EVENTS,
    };
    let scratch = format!("pg_outbox_adopter_{}", Uuid::new_v4().simple());
    let scratch_url = match with_database(&url, &scratch) {
        Ok(u) => u,
        Err(e) => return fail(&*e),
    };
    if let Err(e) = admin(&url, &format!("CREATE DATABASE {scratch}")).await {
        return fail(&*e);
    }
    println!("adopter: created scratch database {scratch}");
    let outcome = run(&scratch_url, n).await;
    let dropped = admin(&url, &format!("DROP DATABASE IF EXISTS {scratch} WITH (FORCE)")).await;
    match (outcome, dropped) {
        (Ok(()), Ok(())) => {
            println!("adopter: dropped scratch database {scratch}; all checks passed");
            ExitCode::SUCCESS
        }
        (Err(e), _) => fail(&*e),
        (Ok(()), Err(e)) => fail(&*e),
    }
}

/// Print an error with its causes and return a failure exit code.
fn fail(e: &(dyn std::error::Error + 'static)) -> ExitCode {
    eprintln!("adopter: FAILED: {}", chain(e));
    ExitCode::FAILURE
}

/// An error and its causes, as `a: b: c`.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        msg.push_str(&format!(": {c}"));
        cause = c.source();
    }
    msg
}

/// Fail with `msg` unless `ok`.
fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<(), BoxError> {
    if ok { Ok(()) } else { Err(msg().into()) }
}

/// `url` with its database replaced by `db`.
fn with_database(url: &str, db: &str) -> Result<String, BoxError> {
    let Some(scheme_end) = url.find("://") else {
        return Err(format!("DATABASE_URL must be a postgres:// URL, not {url:?}").into());
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let query = tail.find('?').map_or("", |i| &tail[i..]);
    Ok(format!("{}{authority}/{db}{query}", &url[..scheme_end + 3]))
}

/// A tokio-postgres client on `url`, with pg-outbox's connection rules
/// (TLS as `sslmode` says, libpq's variables for what the URL leaves out).
async fn connect(url: &str) -> Result<tokio_postgres::Client, BoxError> {
    Ok(ConnectOptions::parse(url)?.connect().await?)
}

/// Run one statement on the database of `url`.
async fn admin(url: &str, sql: &str) -> Result<(), BoxError> {
    connect(url).await?.batch_execute(sql).await.map_err(|e| format!("{sql}: {e}").into())
}

/// An order placed (committed) or abandoned (rolled back) by `via`.
fn order_event(order: Uuid, via: &str, event_type: &str, i: usize) -> NewEvent {
    NewEvent::new("order", order, event_type, serde_json::json!({"via": via, "i": i}))
}

async fn run(url: &str, n: usize) -> Result<(), BoxError> {
    let report = pg_outbox::migrate::apply(&ConnectOptions::parse(url)?).await?;
    let mut pg = connect(url).await?;
    println!("adopter: migrated ({} files applied)", report.applied.len());
    pg.batch_execute("CREATE TABLE orders (id uuid PRIMARY KEY, via text NOT NULL)").await?;

    // The consumer runs from the start: the events arrive by notification.
    let mut stream = Consumer::builder(ConnectOptions::parse(url)?).start().await?;
    let publisher = Publisher::new();
    let mut committed = HashSet::new();
    let mut rolled_back = Vec::new();

    // Through sqlx: a transaction per batch, the domain row and its events.
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let orders: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let mut tx = conn.begin().await?;
    for order in &orders {
        sqlx::query("INSERT INTO orders (id, via) VALUES ($1, 'sqlx')").bind(order).execute(&mut *tx).await?;
    }
    let first = publisher.publish_sqlx(&mut *tx, &order_event(orders[0], "sqlx", "OrderPlaced", 0)).await?;
    let events: Vec<NewEvent> =
        orders.iter().enumerate().skip(1).map(|(i, o)| order_event(*o, "sqlx", "OrderPlaced", i)).collect();
    let rest = publisher.publish_many_sqlx(&mut *tx, &events).await?;
    tx.commit().await?;
    committed.insert(first);
    committed.extend(&rest);
    let mut tx = conn.begin().await?;
    rolled_back.push(publisher.publish_sqlx(&mut *tx, &order_event(Uuid::new_v4(), "sqlx", ROLLED_BACK, 0)).await?);
    tx.rollback().await?;
    println!("adopter: published {n} events through an sqlx transaction, and rolled one back");

    // Through tokio-postgres: the same, with `GenericClient`.
    let orders: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let tx = pg.transaction().await?;
    tx.execute("INSERT INTO orders (id, via) SELECT unnest($1::uuid[]), 'tokio-postgres'", &[&orders]).await?;
    let first = publisher.publish(&tx, &order_event(orders[0], "tokio-postgres", "OrderPlaced", 0)).await?;
    let events: Vec<NewEvent> =
        orders.iter().enumerate().skip(1).map(|(i, o)| order_event(*o, "tokio-postgres", "OrderPlaced", i)).collect();
    let rest = publisher.publish_many(&tx, &events).await?;
    tx.commit().await?;
    committed.insert(first);
    committed.extend(&rest);
    let tx = pg.transaction().await?;
    rolled_back.push(publisher.publish(&tx, &order_event(Uuid::new_v4(), "tokio-postgres", ROLLED_BACK, 0)).await?);
    tx.rollback().await?;
    println!("adopter: published {n} events through a tokio-postgres transaction, and rolled one back");
    check(committed.len() == 2 * n, || format!("{} distinct ids for {} events", committed.len(), 2 * n))?;

    // Consume until every committed event has arrived, acknowledging each.
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + DELIVERY_DEADLINE;
    let mut seen = HashSet::new();
    let mut deliveries = 0usize;
    while seen.len() < committed.len() {
        let Ok(next) = tokio::time::timeout_at(deadline, stream.next()).await else {
            return Err(format!(
                "{} of {} committed events delivered within {DELIVERY_DEADLINE:?}",
                seen.len(),
                committed.len()
            )
            .into());
        };
        let Some(d) = next else { return Err("the event stream ended".into()) };
        check(d.event_type != ROLLED_BACK && !rolled_back.contains(&d.id), || {
            format!("rolled-back event {} was delivered", d.id)
        })?;
        check(committed.contains(&d.id), || format!("unknown event {} ({}) was delivered", d.id, d.event_type))?;
        deliveries += 1;
        seen.insert(d.id);
        d.ack();
    }
    let elapsed = started.elapsed();
    // Anything still arriving now would be a duplicate or a rolled-back event.
    if let Ok(Some(d)) = tokio::time::timeout(QUIET_AFTERWARDS, stream.next()).await {
        check(d.event_type != ROLLED_BACK, || format!("rolled-back event {} was delivered", d.id))?;
        deliveries += 1;
        d.ack();
    }
    stream.finish().await?;
    println!(
        "adopter: consumed and acknowledged {} events, {} ms after the last commit ({} deliveries)",
        seen.len(),
        elapsed.as_millis(),
        deliveries
    );

    // The table: every committed event published, no rolled-back row.
    let row = pg
        .query_one(
            "SELECT count(*) AS total, count(*) FILTER (WHERE published_at IS NOT NULL) AS published, \
                    count(*) FILTER (WHERE id = ANY($1) OR event_type = $2) AS rolled_back, \
                    (SELECT count(*) FROM orders) AS orders \
             FROM events.outbox",
            &[&rolled_back, &ROLLED_BACK],
        )
        .await?;
    let (total, published, gone, orders): (i64, i64, i64, i64) =
        (row.try_get("total")?, row.try_get("published")?, row.try_get("rolled_back")?, row.try_get("orders")?);
    let want = i64::try_from(2 * n)?;
    check((total, published, gone, orders) == (want, want, 0, want), || {
        format!(
            "events.outbox holds {total} events ({published} published, {gone} rolled back) and {orders} orders; \
             expected {want}, {want}, 0 and {want}"
        )
    })?;
    println!("adopter: events.outbox shows all {want} events published and none of the rolled-back ones");
    Ok(())
}

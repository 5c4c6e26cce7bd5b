//! Helpers for the broker sink tests: a real `pg-outbox relay` process,
//! events published with envelope metadata across several aggregates, row
//! state, and brokers of a test's own.

use std::collections::BTreeMap;
use std::process::Stdio;

use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio_postgres::Client;
use uuid::Uuid;

use pg_outbox::{NewEvent, Publisher};

use crate::support;

#[allow(unused_imports)]
pub use crate::relay_proc::{LIVENESS, RelayProc, free_port};
pub use crate::support::published_count;

/// One published event as the tests expect to find it at the broker.
#[derive(Debug, Clone)]
pub struct Sent {
    pub aggregate_type: String,
    pub aggregate_id: Uuid,
    pub event_type: String,
    pub payload: Value,
    pub correlation_id: String,
    pub causation_id: Option<String>,
    pub traceparent: String,
}

/// Aggregates for [`publish_events`]: two of type `order` and one `invoice`.
pub fn three_aggregates() -> Vec<(&'static str, Uuid)> {
    vec![("order", Uuid::new_v4()), ("order", Uuid::new_v4()), ("invoice", Uuid::new_v4())]
}

/// Publish `n` events with the library's publisher, round-robin over
/// `aggs` (type and id), each in its own transaction: `Created` on each
/// aggregate's even rounds and `Updated` on its odd ones, with envelope
/// metadata (`correlation_id`, `traceparent`, and `causation_id` on the odd
/// rounds) and `tag` and the event's index `i` in `data`; returns them by id.
pub async fn publish_events(c: &Client, aggs: &[(&str, Uuid)], n: usize, tag: &str) -> BTreeMap<i64, Sent> {
    let publisher = Publisher::new();
    let mut out = BTreeMap::new();
    for j in 0..n {
        let (k, round) = (j % aggs.len(), j / aggs.len());
        let (aggregate_type, aggregate_id) = aggs[k];
        let event_type = if round % 2 == 0 { "Created" } else { "Updated" };
        let correlation_id = format!("corr-{tag}-{k}-{round}");
        let causation_id = (round % 2 == 1).then(|| format!("cause-{tag}-{k}-{round}"));
        let traceparent = format!("00-{:032x}-{:016x}-01", 0x0af7_6519_16cd_43dd_u128 + j as u128, (round + 1) as u64);
        let mut metadata = json!({"correlation_id": correlation_id, "traceparent": traceparent});
        if let Some(c) = &causation_id {
            metadata["causation_id"] = json!(c);
        }
        let payload =
            json!({"version": 1, "data": {"tag": tag, "k": k, "i": j, "note": "ünïcödé"}, "metadata": metadata});
        let event = NewEvent::new(aggregate_type, aggregate_id, event_type, payload.clone());
        let id = publisher.publish(c, &event).await.expect("publish an event");
        out.insert(
            id,
            Sent {
                aggregate_type: aggregate_type.to_string(),
                aggregate_id,
                event_type: event_type.to_string(),
                payload,
                correlation_id,
                causation_id,
                traceparent,
            },
        );
    }
    out
}

/// `(published, retry_count, last_error)` of one row.
pub async fn row_state(c: &Client, id: i64) -> (bool, i32, Option<String>) {
    let r = c
        .query_one("SELECT published_at IS NOT NULL, retry_count, last_error FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("read the row");
    (r.get(0), r.get(1), r.get(2))
}

/// Wait until `n` rows are published.
pub async fn wait_published(c: &Client, n: i64) {
    support::eventually(LIVENESS.as_secs(), &format!("{n} events published"), || async {
        published_count(c).await == n
    })
    .await;
}

/// Check that `ids` (in broker order) hold each expected id exactly once and
/// keep every aggregate's events in id order.
pub fn check_once_in_aggregate_order(ids: &[i64], sent: &BTreeMap<i64, Sent>) {
    let mut seen = std::collections::BTreeSet::new();
    for id in ids {
        assert!(seen.insert(*id), "id {id} arrived more than once: {ids:?}");
        assert!(sent.contains_key(id), "id {id} was not published by the test: {ids:?}");
    }
    assert_eq!(seen.len(), sent.len(), "every event arrived: got {ids:?}");
    let mut last: BTreeMap<Uuid, i64> = BTreeMap::new();
    for id in ids {
        let agg = sent[id].aggregate_id;
        if let Some(prev) = last.insert(agg, *id) {
            assert!(prev < *id, "aggregate {agg}: id {id} arrived after {prev}: {ids:?}");
        }
    }
}

/// A broker server of the test's own (`nats-server`, `redis-server`) on a
/// free port, so a test can stop and restart it without disturbing the
/// shared one. Killed when dropped.
pub struct PrivateServer {
    program: std::path::PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    pub port: u16,
    /// Data directory, kept across restarts (removed on drop).
    _dir: tempfile::TempDir,
}

impl PrivateServer {
    /// Start `program` with `args`, where `{port}` and `{dir}` are replaced
    /// by a free port and a fresh data directory; waits until the port
    /// accepts connections.
    pub async fn start(program: std::path::PathBuf, args: &[&str]) -> PrivateServer {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("find a free port").port();
        let dir = tempfile::tempdir().expect("a data directory");
        let args = args
            .iter()
            .map(|a| a.replace("{port}", &port.to_string()).replace("{dir}", &dir.path().display().to_string()))
            .collect();
        let mut s = PrivateServer { program, args, child: None, port, _dir: dir };
        s.restart().await;
        s
    }

    /// Start the server again (same port and data directory).
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "the server is already running");
        let child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.program.display()));
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        support::eventually(LIVENESS.as_secs(), &format!("{} accepts connections", self.program.display()), || {
            let addr = addr.clone();
            async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
        })
        .await;
    }

    /// Stop the server (SIGTERM, so it saves its data) and wait for it.
    pub async fn stop(&mut self) {
        let mut child = self.child.take().expect("the server is running");
        let pid = libc::pid_t::try_from(child.id().expect("running")).expect("pid fits pid_t");
        // SAFETY: kill(2) on a child we spawned and have not reaped.
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM) failed: {}", std::io::Error::last_os_error());
        tokio::time::timeout(LIVENESS, child.wait()).await.expect("the server stops").expect("reap the server");
    }
}

/// Mark `ids` unpublished again, as if the relay had crashed after the
/// broker stored them and before the outbox recorded it (the guard that
/// keeps `published_at` from going back to NULL is a trigger, which a
/// `session_replication_role = replica` session skips).
pub async fn unpublish(db: &support::TestDb, ids: &[i64]) {
    let c = db.client().await;
    c.batch_execute("SET session_replication_role = replica").await.expect("replica role");
    let n = c
        .execute("UPDATE events.outbox SET published_at = NULL WHERE id = ANY($1)", &[&ids])
        .await
        .expect("mark the events unpublished");
    assert_eq!(n, ids.len() as u64, "every event is unpublished again");
}

/// Aggregates of type `order` and `invoice`, `n` in all.
pub fn aggregates(n: usize) -> Vec<(&'static str, Uuid)> {
    (0..n).map(|i| (if i % 3 == 2 { "invoice" } else { "order" }, Uuid::new_v4())).collect()
}

/// The relay's Prometheus exposition at `addr` (`HOST:PORT`).
pub async fn scrape(addr: &str) -> String {
    let http =
        reqwest::Client::builder().no_proxy().timeout(std::time::Duration::from_secs(10)).build().expect("HTTP client");
    let url = format!("http://{addr}/metrics");
    let resp = http.get(&url).send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
    resp.text().await.expect("metrics body")
}

/// The sample of `series` (a metric name with its labels, as the exposition
/// writes it, e.g. `outbox_sink_guarantee{guarantee="exactly-once"}`).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// The first line of `log` that holds `needle`.
pub fn line_with<'a>(log: &'a str, needle: &str) -> &'a str {
    log.lines().find(|l| l.contains(needle)).unwrap_or_else(|| panic!("no line holds {needle:?}:\n{log}"))
}

/// Event `id`'s `occurred_at` as the relay writes it (RFC 3339, UTC, in
/// microseconds), read through `c` (a transaction sees its own events).
pub async fn occurred_at_text(c: &impl tokio_postgres::GenericClient, id: i64) -> String {
    c.query_one(
        "SELECT to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
         FROM events.outbox WHERE id = $1",
        &[&id],
    )
    .await
    .expect("occurred_at of an event")
    .get(0)
}

/// A TCP proxy to `target` that holds each chunk the server sends for
/// `delay` before passing it on, so every answer takes at least `delay`:
/// `n` requests made one after another take at least `n * delay`. Returns
/// the proxy's port.
pub async fn delaying_proxy(target: String, delay: std::time::Duration) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
    let port = listener.local_addr().expect("proxy address").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else { return };
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let down = async {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n @ 1..) = from_server.read(&mut buf).await {
                        tokio::time::sleep(delay).await;
                        if to_client.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                tokio::select! {
                    _ = tokio::io::copy(&mut from_client, &mut to_server) => {}
                    _ = down => {}
                }
            });
        }
    });
    port
}

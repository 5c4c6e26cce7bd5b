//! Helpers for broker sink tests: a `pg-outbox relay` child process, events
//! with envelope metadata, and row state queries.

#![allow(dead_code)]

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio_postgres::Client;
use uuid::Uuid;

use pg_outbox::{NewEvent, Publisher};

use crate::support::{self, TestDb};

/// Liveness bound for anything the relay should do "soon".
pub const LIVENESS: Duration = Duration::from_secs(30);

/// A running `pg-outbox relay` child process; killed on drop.
pub struct RelayProc {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl RelayProc {
    /// Spawn `pg-outbox relay args...` on `db`, collecting stderr.
    pub fn spawn(db: &TestDb, args: &[&str]) -> RelayProc {
        let mut child = Command::new(support::bin())
            .arg("relay")
            .args(args)
            .env("DATABASE_URL", db.url())
            .env("RUST_LOG", "info,tokio_postgres=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", support::bin()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut s = sink.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                s.push_str(&line);
                s.push('\n');
            }
        });
        RelayProc { child, log }
    }

    /// Spawn the relay and wait until it logs that it started.
    pub async fn start(db: &TestDb, args: &[&str]) -> RelayProc {
        let mut relay = Self::spawn(db, args);
        let deadline = tokio::time::Instant::now() + LIVENESS;
        while !relay.log().contains("relay started") {
            if let Some(status) = relay.child.try_wait().expect("poll the relay process") {
                tokio::time::sleep(Duration::from_millis(200)).await;
                panic!("relay exited before starting ({status}); stderr:\n{}", relay.log());
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "relay did not start within {LIVENESS:?}; stderr:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        relay
    }

    /// What the relay wrote on stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Ask the relay to stop (SIGTERM).
    pub fn sigterm(&self) {
        let pid = self.child.id().expect("the relay is still running");
        let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
        // SAFETY: kill(2) with a pid we spawned and still own (not reaped).
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM) failed: {}", std::io::Error::last_os_error());
    }

    /// Wait for the process to exit; then give the stderr reader a moment.
    pub async fn wait(&mut self) -> ExitStatus {
        let status = match tokio::time::timeout(LIVENESS, self.child.wait()).await {
            Ok(status) => status.expect("wait for the relay"),
            Err(_) => panic!("relay did not exit within {LIVENESS:?}; stderr:\n{}", self.log()),
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        status
    }

    /// SIGTERM, then expect exit code 0.
    pub async fn stop_cleanly(&mut self) {
        self.sigterm();
        let status = self.wait().await;
        assert_eq!(status.code(), Some(0), "relay should exit 0 on SIGTERM ({status}); stderr:\n{}", self.log());
    }
}

/// Metadata every event of [`publish_events`] carries in its envelope.
pub fn metadata(i: usize) -> (String, String) {
    (
        format!("corr-{i}"),
        format!("00-{:032x}-{:016x}-01", 0x0af7_6519_16cd_43dd_u128 + i as u128, 0xb7ad_6b71_u64 + i as u64),
    )
}

/// Publish `n` events with the library's publisher, round-robin over
/// `aggs`, each with `correlation_id`, `causation_id` and `traceparent` in
/// its envelope metadata; returns `(id, aggregate)` per event.
pub async fn publish_events(c: &Client, aggs: &[Uuid], n: usize, tag: &str) -> Vec<(i64, Uuid)> {
    let publisher = Publisher::new();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let agg = aggs[i % aggs.len()];
        let (corr, tp) = metadata(i);
        let event = NewEvent::new(
            "invoice",
            agg,
            "InvoiceIssued",
            json!({"version": 1, "data": {"tag": tag, "i": i},
                   "metadata": {"correlation_id": corr, "causation_id": format!("cause-{i}"), "traceparent": tp}}),
        );
        out.push((publisher.publish(c, &event).await.expect("publish with the library"), agg));
    }
    out
}

/// Number of rows marked published.
pub async fn published_count(c: &Client) -> i64 {
    c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[])
        .await
        .expect("count published rows")
        .get(0)
}

/// `(published, retry_count, last_error)` of one row.
pub async fn row_state(c: &Client, id: i64) -> (bool, i32, Option<String>) {
    let r = c
        .query_one("SELECT published_at IS NOT NULL, retry_count, last_error FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("read the row");
    (r.get(0), r.get(1), r.get(2))
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
}

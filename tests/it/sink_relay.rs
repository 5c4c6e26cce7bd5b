//! Helpers for broker sink tests: events with envelope metadata, and row
//! state queries (the relay process is [`crate::relay_proc::RelayProc`]).

#![allow(dead_code)]

use serde_json::json;
use tokio_postgres::Client;
use uuid::Uuid;

use pg_outbox::{NewEvent, Publisher};

pub use crate::relay_proc::{LIVENESS, RelayProc, free_port};
pub use crate::support::published_count;

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

/// `(published, retry_count, last_error)` of one row.
pub async fn row_state(c: &Client, id: i64) -> (bool, i32, Option<String>) {
    let r = c
        .query_one("SELECT published_at IS NOT NULL, retry_count, last_error FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("read the row");
    (r.get(0), r.get(1), r.get(2))
}

//! A webhook receiver for `pg-outbox relay --sink http://...` that refuses
//! what a deposed relay may still deliver: a delivery whose leadership term
//! (the header `outbox-term`) is lower than one already accepted for its
//! aggregate ([`pg_outbox::TermFilter`]).
//!
//! Why: a relay that was frozen or cut off is replaced within seconds, and
//! it hands nothing out once deposed; but a send it had already started can
//! still arrive after its successor's first delivery of the same aggregate.
//! The term tells them apart. A refused delivery is answered `200 OK` (the
//! relay that sent it can no longer record it anyway) and dropped: the
//! successor delivers that event again, under its own term.
//!
//! Run it, then point a relay at it:
//!
//! ```text
//! cargo run --example webhook_receiver -- 127.0.0.1:8080
//! cargo run --features cli,webhook -- relay --sink http://127.0.0.1:8080/events
//! ```
//!
//! It reads the relay's default record format (`--format record`): the event
//! as JSON, with `id` and `aggregate_id`.
//!
//! A receiver that restarts, or runs as several instances, keeps the
//! highest term per aggregate in its own database instead, updated in the
//! transaction that applies the event, with the same rule.

use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use pg_outbox::{Term, TermFilter};
use uuid::Uuid;

/// What the receiver did with one request.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Applied: event `id` of `aggregate` under `term`.
    Applied { id: i64, aggregate: Uuid, term: Term },
    /// Refused: `term` is lower than `highest`, already accepted for `aggregate`.
    Stale { id: i64, aggregate: Uuid, term: Term, highest: Term },
    /// Not an outbox delivery: what is wrong with it.
    Bad(String),
}

/// Read one delivery (the relay's JSON body and its `outbox-term` header)
/// and pass it through the filter.
fn receive(filter: &Mutex<TermFilter>, headers: &HeaderMap, body: &[u8]) -> Outcome {
    let term = headers.get("outbox-term").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let Some(term) = term.and_then(Term::new) else {
        return Outcome::Bad("no outbox-term header of 1 or more (a relay in --mode competing sends none)".into());
    };
    let event: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return Outcome::Bad(format!("the body is not JSON: {e}")),
    };
    let id = event["id"].as_i64();
    let aggregate = event["aggregate_id"].as_str().and_then(|s| Uuid::parse_str(s).ok());
    let (Some(id), Some(aggregate)) = (id, aggregate) else {
        return Outcome::Bad("the body has no numeric id or no UUID aggregate_id".into());
    };
    let mut filter = filter.lock().unwrap_or_else(PoisonError::into_inner);
    if filter.admit(aggregate, term) {
        // Apply the event here.
        return Outcome::Applied { id, aggregate, term };
    }
    let highest = filter.highest(&aggregate).unwrap_or(term);
    Outcome::Stale { id, aggregate, term, highest }
}

async fn events(State(filter): State<Arc<Mutex<TermFilter>>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    match receive(&filter, &headers, &body) {
        Outcome::Applied { id, aggregate, term } => {
            println!("applied event {id} of {aggregate} (term {term})");
            StatusCode::OK
        }
        Outcome::Stale { id, aggregate, term, highest } => {
            println!("refused event {id} of {aggregate}: term {term} is below {highest}, from a deposed relay");
            StatusCode::OK
        }
        Outcome::Bad(why) => {
            eprintln!("bad request: {why}");
            StatusCode::BAD_REQUEST
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:8080".to_string());
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let filter = Arc::new(Mutex::new(TermFilter::new()));
    let app = axum::Router::new().route("/events", axum::routing::post(events)).with_state(filter);
    println!("receiving on http://{addr}/events");
    match axum::serve(listener, app).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(term: &str, id: i64, aggregate: Uuid) -> (HeaderMap, Vec<u8>) {
        let mut h = HeaderMap::new();
        h.insert("outbox-term", term.parse().expect("header"));
        (h, serde_json::json!({ "id": id, "aggregate_id": aggregate }).to_string().into_bytes())
    }

    #[test]
    fn a_deposed_relays_late_delivery_is_refused_and_the_successors_applied() {
        let filter = Mutex::new(TermFilter::new());
        let agg = Uuid::new_v4();
        let (h, b) = delivery("3", 10, agg);
        assert!(matches!(receive(&filter, &h, &b), Outcome::Applied { id: 10, .. }));
        let (h, b) = delivery("4", 11, agg);
        assert!(matches!(receive(&filter, &h, &b), Outcome::Applied { id: 11, .. }));
        let (h, b) = delivery("3", 11, agg);
        assert!(matches!(receive(&filter, &h, &b), Outcome::Stale { id: 11, .. }), "the old relay's copy");
        let (h, b) = delivery("0", 12, agg);
        assert!(matches!(receive(&filter, &h, &b), Outcome::Bad(_)));
    }
}

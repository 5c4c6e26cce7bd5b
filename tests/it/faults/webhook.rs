//! The fault suite's webhook: what it received, in arrival order, and how it answers.

use super::*;

// ---------------------------------------------------------------- the webhook

/// How the test webhook answers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Behavior {
    /// 200 to everything.
    Ok,
    /// Every `every`-th request (over all requests) is held for `hang`
    /// before its (too late) 200.
    HangEvery { every: u64, hang: Duration },
    /// The first attempt of every `every`-th distinct id gets HTTP 500.
    FailFirstAttemptOfEvery { every: u64 },
}

/// Status recorded for a request held past the relay's timeout: not a delivery.
pub(super) const HUNG: u16 = 0;

/// One request the webhook got, in arrival order.
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    pub(crate) id: i64,
    pub(super) aggregate: Uuid,
    pub(super) retry_count: i64,
    /// The leadership term it was sent under.
    pub(super) term: i64,
    /// Which relay process sent it (each relay gets its own URL path).
    pub(super) relay: u32,
    pub(super) status: u16,
    pub(crate) at: Instant,
}

impl Attempt {
    pub(crate) fn delivered(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

#[derive(Debug, Default)]
pub(super) struct SinkLog {
    pub(super) attempts: Vec<Attempt>,
    pub(super) requests: u64,
    pub(super) distinct: HashSet<i64>,
    pub(super) malformed: Vec<String>,
}

#[derive(Clone)]
pub(crate) struct Sink {
    pub(super) behavior: Behavior,
    pub(super) log: Arc<Mutex<SinkLog>>,
    pub(super) base: String,
}

/// `(id, aggregate_id, retry_count)` of a sink record, checking its keys.
/// A record's id, aggregate, retry count and leadership term (every relay
/// here runs in single mode, so every record carries one).
pub(super) fn parse_record(body: &[u8]) -> Result<(i64, Uuid, i64, i64), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON ({e})"))?;
    let obj = v.as_object().ok_or_else(|| format!("not an object: {v}"))?;
    let keys: Vec<&str> =
        obj.keys().map(String::as_str).filter(|k| *k != "term").collect::<BTreeSet<_>>().into_iter().collect();
    let term = obj.get("term").and_then(Value::as_i64).ok_or_else(|| format!("no term: {v}"))?;
    if keys != RECORD_KEYS {
        return Err(format!("keys {keys:?}: {v}"));
    }
    let id = obj["id"].as_i64().ok_or_else(|| format!("id: {v}"))?;
    let agg = obj["aggregate_id"].as_str().and_then(|s| Uuid::parse_str(s).ok()).ok_or_else(|| format!("agg: {v}"))?;
    let retry_count = obj["retry_count"].as_i64().ok_or_else(|| format!("retry_count: {v}"))?;
    if obj["aggregate_type"] != AGGREGATE_TYPE || obj["event_type"] != EVENT_TYPE {
        return Err(format!("aggregate_type/event_type: {v}"));
    }
    Ok((id, agg, retry_count, term))
}

impl Sink {
    pub(crate) async fn start(behavior: Behavior) -> Sink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the test webhook");
        let addr = listener.local_addr().expect("webhook address");
        let sink = Sink { behavior, log: Arc::default(), base: format!("http://{addr}/hook") };
        let app =
            axum::Router::new().route("/hook/{relay}", axum::routing::post(hook_handler)).with_state(sink.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("test webhook stopped: {e}");
            }
        });
        sink
    }

    pub(crate) fn url_for(&self, relay: u32) -> String {
        format!("{}/{relay}", self.base)
    }

    /// Record a request and decide its answer (status, and how long to hold it).
    pub(super) fn record(&self, relay: u32, body: &[u8]) -> (u16, Option<Duration>) {
        let mut log = lock(&self.log);
        log.requests += 1;
        let n = log.requests;
        let (id, aggregate, retry_count, term) = match parse_record(body) {
            Ok(r) => r,
            Err(e) => {
                log.malformed.push(e);
                return (400, None);
            }
        };
        let first = log.distinct.insert(id);
        let distinct = log.distinct.len() as u64;
        let (status, hold) = match self.behavior {
            Behavior::Ok => (200, None),
            Behavior::HangEvery { every, hang } if n.is_multiple_of(every) => (HUNG, Some(hang)),
            Behavior::HangEvery { .. } => (200, None),
            Behavior::FailFirstAttemptOfEvery { every } if first && distinct.is_multiple_of(every) => (500, None),
            Behavior::FailFirstAttemptOfEvery { .. } => (200, None),
        };
        log.attempts.push(Attempt { id, aggregate, retry_count, term, relay, status, at: Instant::now() });
        (status, hold)
    }

    pub(crate) fn attempts(&self) -> Vec<Attempt> {
        lock(&self.log).attempts.clone()
    }

    pub(super) fn malformed(&self) -> Vec<String> {
        lock(&self.log).malformed.clone()
    }

    /// When relay `relay` first got a 2xx at or after `since`, if it did.
    pub(crate) fn first_delivery_by(&self, relay: u32, since: Instant) -> Option<Instant> {
        lock(&self.log).attempts.iter().find(|a| a.relay == relay && a.delivered() && a.at >= since).map(|a| a.at)
    }
}

pub(super) async fn hook_handler(
    State(sink): State<Sink>,
    Path(relay): Path<u32>,
    body: Bytes,
) -> (StatusCode, &'static str) {
    match sink.record(relay, &body) {
        (_, Some(hold)) => {
            tokio::time::sleep(hold).await;
            (StatusCode::OK, "too late")
        }
        (200, None) => (StatusCode::OK, "ok"),
        (500, None) => (StatusCode::INTERNAL_SERVER_ERROR, "injected failure"),
        (_, None) => (StatusCode::BAD_REQUEST, "malformed record"),
    }
}

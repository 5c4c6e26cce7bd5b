//! The relay's HTTP endpoints: `/metrics` (Prometheus text) on
//! `--metrics-addr`, and the probes `/livez` and `/readyz` on the same
//! listener and on `--health-addr` when given.
//!
//! - `/livez`: 200 while the relay's two loops turn: the drain loop (its
//!   last turn no longer ago than [`pg_outbox::health::Health::stall_bound`]) and
//!   the delivery loop (no delivery in flight for longer than that bound
//!   plus `--sink-timeout`); 503 once either stalls.
//! - `/readyz`: 503 when the relay cannot work (the drain loop stalled, the
//!   database sessions are down, shutting down, not started yet); 200 with
//!   `"status": "degraded"` when it works but something outside it is
//!   wrong (the sink's last delivery failed or one runs longer than
//!   `--sink-timeout`, the LISTEN connection is down); 200 `"ready"`
//!   otherwise. A standby is ready.
//!
//! Bodies are JSON; they carry the sink's stripped name and error texts
//! already free of secrets (the library's and the sinks' rules), never a
//! URL's credentials.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use pg_outbox::health::{Health, HealthMonitor, LastError, Role};
use serde_json::{Value, json};

use crate::error::Error;

/// What the probes read: the consumer's health once it started, and the
/// sink's settings.
#[derive(Debug)]
pub(crate) struct Probes {
    monitor: OnceLock<HealthMonitor>,
    sink_name: String,
    sink_timeout: Duration,
}

impl Probes {
    pub(crate) fn new(sink_name: String, sink_timeout: Duration) -> Arc<Self> {
        Arc::new(Probes { monitor: OnceLock::new(), sink_name, sink_timeout })
    }

    /// The consumer started: from now on the probes report its health.
    pub(crate) fn started(&self, monitor: HealthMonitor) {
        let _ = self.monitor.set(monitor);
    }
}

/// Bind `addr` now (so a taken port is an error at start, not a log line),
/// for [`serve`].
pub(crate) fn bind(addr: SocketAddr, what: &str) -> Result<std::net::TcpListener, Error> {
    let listener =
        std::net::TcpListener::bind(addr).map_err(|e| Error::Config(format!("cannot serve {what} on {addr}: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| Error::Config(format!("cannot serve {what} on {addr}: {e}")))?;
    Ok(listener)
}

/// Serve the probes (and `/metrics` when `metrics` is given) on `listener`
/// from a task of its own, until the process ends.
pub(crate) fn serve(
    listener: std::net::TcpListener,
    probes: Arc<Probes>,
    metrics: Option<PrometheusHandle>,
) -> Result<(), Error> {
    let addr = listener.local_addr().map_err(|e| Error::Config(format!("listener address: {e}")))?;
    let listener = tokio::net::TcpListener::from_std(listener)
        .map_err(|e| Error::Config(format!("cannot serve on {addr}: {e}")))?;
    let p = probes.clone();
    let mut app = axum::Router::new()
        .route("/livez", get(move || async move { livez(&probes) }))
        .route("/readyz", get(move || async move { readyz(&p) }));
    if let Some(handle) = metrics {
        app = app.route(
            "/metrics",
            get(move || async move {
                ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render())
            }),
        );
    }
    let app = app.fallback(|| async { (StatusCode::NOT_FOUND, "not found: try /livez, /readyz or /metrics\n") });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, %addr, "HTTP endpoint stopped");
        }
    });
    Ok(())
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut text = body.to_string();
    text.push('\n');
    (status, [(header::CONTENT_TYPE, "application/json"), (header::CACHE_CONTROL, "no-store")], text).into_response()
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

fn last_error(e: &LastError, source: &str) -> Value {
    json!({ "source": source, "message": e.message, "age_seconds": secs(e.age) })
}

fn livez(probes: &Probes) -> Response {
    let Some(monitor) = probes.monitor.get() else {
        return json_response(StatusCode::OK, &json!({ "status": "starting" }));
    };
    let h = monitor.get();
    let delivery = Delivery::of(&h, probes.sink_timeout);
    let live = h.live && !delivery.stuck;
    let status = match (live, h.ended) {
        (true, _) => "live",
        (false, true) => "ended",
        (false, false) => "stalled",
    };
    let body = json!({
        "status": status,
        "drain_loop": drain_loop(&h),
        "delivery": delivery.json(),
    });
    json_response(if live { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, &body)
}

/// The delivery loop (`relay::run`): stuck when one delivery has been in
/// flight for longer than the drain loop's stall bound plus the sink
/// timeout. Every sink but stdout cuts a delivery at its timeout, so only a
/// sink that ignores it (or a stdout reader that stopped reading) gets there.
struct Delivery {
    in_flight: Option<Duration>,
    bound: Duration,
    stuck: bool,
}

impl Delivery {
    fn of(h: &Health, sink_timeout: Duration) -> Self {
        let in_flight = h.sink.as_ref().and_then(|s| s.in_flight_for);
        let bound = h.stall_bound + sink_timeout;
        Delivery { in_flight, bound, stuck: in_flight.is_some_and(|d| d > bound) }
    }

    fn json(&self) -> Value {
        json!({
            "status": if self.stuck { "fail" } else { "ok" },
            "in_flight_seconds": self.in_flight.map(secs),
            "stall_bound_seconds": secs(self.bound),
        })
    }
}

fn drain_loop(h: &Health) -> Value {
    json!({
        "status": if h.live { "ok" } else { "fail" },
        "last_turn_seconds_ago": secs(h.since_last_turn),
        "stall_bound_seconds": secs(h.stall_bound),
    })
}

/// A check's status: `ok`, `degraded` (200) or `fail` (503).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Check {
    Ok,
    Degraded,
    Fail,
}

impl Check {
    fn as_str(self) -> &'static str {
        match self {
            Check::Ok => "ok",
            Check::Degraded => "degraded",
            Check::Fail => "fail",
        }
    }
}

fn readyz(probes: &Probes) -> Response {
    let Some(monitor) = probes.monitor.get() else {
        let body = json!({ "status": "starting", "checks": {} });
        return json_response(StatusCode::SERVICE_UNAVAILABLE, &body);
    };
    let (status, body) = readiness(&monitor.get(), &probes.sink_name, probes.sink_timeout);
    json_response(status, &body)
}

/// The sink's check: degraded while it fails or a delivery hangs past
/// `sink_timeout`; its figures (the `status` key is set by the caller).
fn sink_check(h: &Health, sink_name: &str, sink_timeout: Duration) -> (Check, Value) {
    match &h.sink {
        Some(s) => {
            let hanging = s.in_flight_for.is_some_and(|d| d > sink_timeout);
            let c = if s.consecutive_failures > 0 || hanging { Check::Degraded } else { Check::Ok };
            let v = json!({
                "name": sink_name,
                "timeout_seconds": secs(sink_timeout),
                "in_flight_seconds": s.in_flight_for.map(secs),
                "consecutive_failures": s.consecutive_failures,
                "last_success_seconds_ago": s.last_success_age.map(secs),
                "last_error": s.last_failure.as_ref().map(|e| last_error(e, "sink")),
            });
            (c, v)
        }
        None => (Check::Ok, json!({ "name": sink_name, "detail": "opened at start" })),
    }
}

/// The newest of the drain loop's last database error and the sink's.
fn newest_error(h: &Health) -> Option<Value> {
    let db_error = h.last_error.as_ref().map(|e| (e, "database"));
    let sink_error = h.sink.as_ref().and_then(|s| s.last_failure.as_ref()).map(|e| (e, "sink"));
    let newest = match (db_error, sink_error) {
        (Some(a), Some(b)) => Some(if a.0.age <= b.0.age { a } else { b }),
        (a, b) => a.or(b),
    };
    newest.map(|(e, source)| last_error(e, source))
}

/// The `/readyz` answer for `h`.
fn readiness(h: &Health, sink_name: &str, sink_timeout: Duration) -> (StatusCode, Value) {
    let mut worst = Check::Ok;
    let mut note = |c: Check| {
        worst = worst.max(c);
        c.as_str()
    };
    let drain = {
        let mut v = drain_loop(h);
        v["status"] = note(if h.live { Check::Ok } else { Check::Fail }).into();
        v
    };
    let delivery = Delivery::of(h, sink_timeout);
    let delivery = {
        let mut v = delivery.json();
        v["status"] = note(if delivery.stuck { Check::Fail } else { Check::Ok }).into();
        v
    };
    let database = json!({
        "status": note(if h.database_connected { Check::Ok } else { Check::Fail }),
        "connected": h.database_connected,
        "disconnected_seconds": h.disconnected_for.map(secs),
    });
    let schema = json!({ "status": note(Check::Ok), "detail": "current (checked at start)" });
    let shutdown = json!({
        "status": note(if h.stopping { Check::Fail } else { Check::Ok }),
        "stopping": h.stopping,
    });
    let listener = json!({
        "status": note(if h.listen && !h.listener.listening && !h.listener.standing_by {
            Check::Degraded
        } else {
            Check::Ok
        }),
        "enabled": h.listen,
        "listening": h.listener.listening,
        "standing_by": h.listener.standing_by,
        "reconnects": h.listener.reconnects,
    });
    let (check, mut sink) = sink_check(h, sink_name, sink_timeout);
    sink["status"] = note(check).into();
    let (status, code) = match worst {
        Check::Ok => ("ready", StatusCode::OK),
        Check::Degraded => ("degraded", StatusCode::OK),
        Check::Fail => ("not_ready", StatusCode::SERVICE_UNAVAILABLE),
    };
    let mode = match h.mode {
        pg_outbox::Mode::Single => "single",
        pg_outbox::Mode::Partitioned { .. } => "partitioned",
        pg_outbox::Mode::Competing => "competing",
        _ => "other",
    };
    let mut body = json!({
        "status": status,
        "role": h.role.as_str(),
        "mode": mode,
        "listener": { "enabled": h.listen, "listening": h.listener.listening, "reconnects": h.listener.reconnects },
        "last_error": newest_error(h),
        "checks": {
            "drain_loop": drain,
            "delivery": delivery,
            "database": database,
            "schema": schema,
            "sink": sink,
            "listener": listener,
            "shutdown": shutdown,
        },
    });
    if let Role::Partitioned { held, partitions } = &h.role {
        body["partitions"] = json!({ "held": held, "of": partitions });
    }
    (code, body)
}

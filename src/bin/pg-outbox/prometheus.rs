//! The Prometheus recorder behind `/metrics`.

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString, Unit};

use crate::error::Error;

/// Install the Prometheus recorder (served by [`crate::health::serve`]) and keep
/// its histograms trimmed. A relay of a named subscription labels every
/// metric `subscription="NAME"` ([`Labelled`]), so relays of several
/// subscriptions scraped into one Prometheus stay apart; the default subscription's
/// series keep no such label (an absent label reads as `""` in PromQL), so
/// dashboards and alerts written before subscriptions keep their series.
pub(crate) fn install_metrics(subscription: &str) -> Result<metrics_exporter_prometheus::PrometheusHandle, Error> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let buckets =
        [0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(pg_outbox::metrics::DELIVERY_LAG.into()), &buckets)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(pg_outbox::metrics::SINK_DURATION.into()), &buckets))
        .map_err(|e| Error::Config(format!("metrics: {e}")))?
        .build_recorder();
    let handle = recorder.handle();
    let installed = match subscription {
        "default" => metrics::set_global_recorder(recorder).map_err(|e| e.to_string()),
        name => {
            let label = Label::new("subscription", name.to_string());
            metrics::set_global_recorder(Labelled { inner: recorder, label }).map_err(|e| e.to_string())
        }
    };
    installed.map_err(|e| Error::Config(format!("metrics: {e}")))?;
    // What the exporter's own listener would do: upkeep every 5 s.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    pg_outbox::metrics::describe();
    pg_outbox::metrics::record_initial_values();
    Ok(handle)
}

/// A recorder that gives every metric without a `subscription` label the
/// relay's (`subscription="NAME"`), and leaves those that have one as they
/// are: the library labels what a named subscription's consumer and relay
/// record already, and the lag gauges name the subscription they measure.
/// (A global label of the exporter would not do: a series recorded once
/// with the label and once without, such as a counter set to 0 at start,
/// would show twice with the same labels.)
struct Labelled<R> {
    inner: R,
    label: Label,
}

impl<R: Recorder> Labelled<R> {
    fn key(&self, key: &Key) -> Key {
        if key.labels().any(|l| l.key() == self.label.key()) {
            key.clone()
        } else {
            key.with_extra_labels(vec![self.label.clone()])
        }
    }
}

impl<R: Recorder> Recorder for Labelled<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.inner.register_counter(&self.key(key), metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.inner.register_gauge(&self.key(key), metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.inner.register_histogram(&self.key(key), metadata)
    }
}

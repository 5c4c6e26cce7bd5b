//! The Prometheus recorder behind `/metrics`.

use std::time::Duration;

use crate::error::Error;

/// Install the Prometheus recorder (served by [`crate::health::serve`]) and keep
/// its histograms trimmed. A relay of a named subscription labels every
/// metric `subscription="NAME"`, so relays of several subscriptions
/// scraped into one Prometheus stay apart; the default subscription's
/// series keep no such label (an absent label reads as `""` in PromQL), so
/// dashboards and alerts written before subscriptions keep their series.
pub(crate) fn install_metrics(subscription: &str) -> Result<metrics_exporter_prometheus::PrometheusHandle, Error> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let buckets =
        [0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];
    let builder = match subscription {
        "default" => PrometheusBuilder::new(),
        name => PrometheusBuilder::new().add_global_label("subscription", name),
    };
    let builder = builder
        .set_buckets_for_metric(Matcher::Full(pg_outbox::metrics::DELIVERY_LAG.into()), &buckets)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(pg_outbox::metrics::SINK_DURATION.into()), &buckets))
        .map_err(|e| Error::Config(format!("metrics: {e}")))?;
    let handle = builder.install_recorder().map_err(|e| Error::Config(format!("metrics: {e}")))?;
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

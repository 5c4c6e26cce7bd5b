//! The overview's charts as server-made SVG: events published per minute
//! (bars) and delivery lag per minute (mean and largest, lines), over the
//! last hour.

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use maud::{Markup, html};
use pg_outbox::console::DeliveryChart;

const W: f64 = 600.0;
const H: f64 = 160.0;
const LEFT: f64 = 56.0;
const BOTTOM: f64 = 20.0;
const TOP: f64 = 10.0;
const MINUTES: i64 = 60;

/// One value per minute of the hour ending at `now`'s minute, oldest first.
fn per_minute(
    chart: &DeliveryChart,
    now: DateTime<Utc>,
    f: impl Fn(&pg_outbox::console::MinuteDelivery) -> f64,
) -> Vec<f64> {
    let end = now.duration_trunc(TimeDelta::minutes(1)).unwrap_or(now);
    let start = end - TimeDelta::minutes(MINUTES - 1);
    let mut v = vec![0.0; MINUTES as usize];
    for m in &chart.minutes {
        let i = (m.minute - start).num_minutes();
        if (0..MINUTES).contains(&i) {
            v[i as usize] = f(m);
        }
    }
    v
}

/// A round upper bound for the axis: 1, 2 or 5 times a power of ten.
fn nice_max(max: f64) -> f64 {
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(max.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|v| *v >= max).unwrap_or(10.0 * p)
}

fn axis(max: f64, unit: &str) -> Markup {
    let y0 = H - BOTTOM;
    html! {
        line x1=(LEFT) y1=(y0) x2=(W) y2=(y0) stroke="#888" {}
        line x1=(LEFT) y1=(TOP) x2=(LEFT) y2=(y0) stroke="#888" {}
        text x=(LEFT - 4.0) y=(TOP + 4.0) text-anchor="end" font-size="10" { (format_value(max)) " " (unit) }
        text x=(LEFT - 4.0) y=(y0) text-anchor="end" font-size="10" { "0" }
        text x=(LEFT) y=(H - 4.0) font-size="10" { "-60 min" }
        text x=(W) y=(H - 4.0) text-anchor="end" font-size="10" { "now" }
    }
}

fn format_value(v: f64) -> String {
    if v >= 100.0 || v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.2}") }
}

/// Events published per minute, as bars.
pub(crate) fn publish_rate(chart: &DeliveryChart, now: DateTime<Utc>) -> Markup {
    let v = per_minute(chart, now, |m| m.published as f64);
    let max = nice_max(v.iter().copied().fold(0.0, f64::max));
    let slot = (W - LEFT) / MINUTES as f64;
    let y0 = H - BOTTOM;
    html! {
        svg.chart id="chart-rate" viewBox={"0 0 " (W) " " (H)} role="img" aria-label="events published per minute, last hour" {
            (axis(max, "/min"))
            @for (i, n) in v.iter().enumerate() {
                @if *n > 0.0 {
                    @let h = (y0 - TOP) * n / max;
                    rect x=(format!("{:.1}", LEFT + i as f64 * slot + 1.0)) y=(format!("{:.1}", y0 - h)) width=(format!("{:.1}", slot - 2.0)) height=(format!("{h:.1}")) fill="#3b7dd8" {
                        title { (n) " published" }
                    }
                }
            }
        }
    }
}

/// Mean and largest delivery lag per minute, as two lines (minutes without
/// a publication are left out).
pub(crate) fn lag(chart: &DeliveryChart, now: DateTime<Utc>) -> Markup {
    let mean = per_minute(chart, now, |m| m.mean_lag_seconds);
    let max_lag = per_minute(chart, now, |m| m.max_lag_seconds);
    let present = per_minute(chart, now, |_| 1.0);
    let max = nice_max(max_lag.iter().copied().fold(0.0, f64::max));
    let slot = (W - LEFT) / MINUTES as f64;
    let y0 = H - BOTTOM;
    let xy = |v: &[f64]| -> Vec<(f64, f64)> {
        v.iter()
            .enumerate()
            .filter(|(i, _)| present[*i] > 0.0)
            .map(|(i, y)| (LEFT + (i as f64 + 0.5) * slot, y0 - (y0 - TOP) * y / max))
            .collect()
    };
    let points =
        |p: &[(f64, f64)]| -> String { p.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect::<Vec<_>>().join(" ") };
    let (max_xy, mean_xy) = (xy(&max_lag), xy(&mean));
    html! {
        svg.chart id="chart-lag" viewBox={"0 0 " (W) " " (H)} role="img" aria-label="delivery lag per minute, last hour" {
            (axis(max, "s"))
            polyline points=(points(&max_xy)) fill="none" stroke="#d8703b" stroke-width="1.5" {}
            polyline points=(points(&mean_xy)) fill="none" stroke="#3b7dd8" stroke-width="1.5" {}
            @for (x, y) in &max_xy { circle cx=(format!("{x:.1}")) cy=(format!("{y:.1}")) r="2" fill="#d8703b" {} }
            @for (x, y) in &mean_xy { circle cx=(format!("{x:.1}")) cy=(format!("{y:.1}")) r="2" fill="#3b7dd8" {} }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_bounds_are_round() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(3.0), 5.0);
        assert_eq!(nice_max(120.0), 200.0);
        assert_eq!(nice_max(1000.0), 1000.0);
    }
}

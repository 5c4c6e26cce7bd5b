//! The latency chart: one panel per rate, percentiles on the x axis,
//! milliseconds (log scale) on the y axis, one line per receiver (the
//! floor, NOTIFY only, the stream and the relay).
//!
//! Text is drawn with a subset of DejaVu Sans committed next to this file
//! (`DejaVuSans-subset.ttf`, licence in `DejaVuSans-LICENSE.txt`) through
//! plotters' `ab_glyph` feature, so no system fonts are needed.

use std::path::Path;

use plotters::prelude::*;

use crate::latency::{LatencyRun, PERCENTILES, Subject};
use pg_outbox_testkit::bench::BenchResult;

/// The embedded font.
static FONT: &[u8] = include_bytes!("DejaVuSans-subset.ttf");

/// Colour of each receiver's line.
fn colour(subject: Subject) -> RGBColor {
    match subject {
        Subject::Floor => RGBColor(90, 90, 90),
        Subject::NotifyOnly => RGBColor(160, 160, 160),
        Subject::Stream => RGBColor(31, 119, 180),
        Subject::StreamProducerLocked => RGBColor(44, 160, 44),
        Subject::Relay => RGBColor(214, 39, 40),
    }
}

/// Draw `runs` to the PNG file `path`.
pub fn latency_png(runs: &[LatencyRun], path: &Path) -> BenchResult<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the embedded chart font (benches/e2e/DejaVuSans-subset.ttf) is not a valid font")?;
    let mut rates: Vec<u64> = runs.iter().map(|r| r.rate).collect();
    rates.sort_unstable();
    rates.dedup();
    if rates.is_empty() {
        return Err("no latency runs to chart".into());
    }
    let width = 480 * u32::try_from(rates.len())?;
    let root = BitMapBackend::new(path, (width, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(50);
    title.draw(&Text::new(
        "pg-outbox commit-to-delivery latency (ms, log scale) by percentile",
        (20, 15),
        ("sans-serif", 22).into_font(),
    ))?;
    let panels = body.split_evenly((1, rates.len()));
    let max = runs.iter().flat_map(|r| r.percentiles_ms).fold(1.0f64, f64::max) * 1.5;
    let min = runs.iter().flat_map(|r| r.percentiles_ms).filter(|v| *v > 0.0).fold(max, f64::min).max(0.01) / 1.5;
    for (panel, rate) in panels.iter().zip(&rates) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{rate} events/s"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(55)
            .build_cartesian_2d(-0.3f64..(PERCENTILES.len() as f64 - 0.7), (min..max).log_scale())?;
        chart
            .configure_mesh()
            .x_labels(PERCENTILES.len())
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 0.01 && i >= 0.0 {
                    PERCENTILES.get(i as usize).map(|s| (*s).to_string()).unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("ms")
            .y_label_formatter(&|y| if *y >= 1.0 { format!("{y:.0}") } else { format!("{y:.2}") })
            .label_style(("sans-serif", 13))
            .draw()?;
        for subject in
            [Subject::NotifyOnly, Subject::Floor, Subject::Stream, Subject::StreamProducerLocked, Subject::Relay]
        {
            let Some(run) = runs.iter().find(|r| r.rate == *rate && r.subject == subject) else { continue };
            let c = colour(subject);
            let points: Vec<(f64, f64)> =
                run.percentiles_ms.iter().enumerate().map(|(i, v)| (i as f64, v.max(min))).collect();
            chart
                .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))?
                .label(subject.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
            chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, c.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 13))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

//! `pg-outbox replay`: deliver published events again to a sink
//! (`pg_outbox::relay::replay`), with a progress bar on a terminal and a
//! summary that says where to resume.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use pg_outbox::relay::replay::{self, Filter, Outcome, Progress, Replay};
use serde_json::{Value, json};

use crate::error::Error;
use crate::logging::{self, LogFormat};
use crate::sink_args::SinkArgs;

/// The `target` of the lines replay prints itself.
const TARGET: &str = "pg_outbox::replay";

/// Exit status of a replay stopped by SIGINT/SIGTERM before its end.
pub(crate) const INTERRUPTED_EXIT: u8 = 130;

pub(crate) const REPLAY_HELP: &str = "\
Reads only: published_at, retry_count and every other column stay as they are (the session is
read-only). Events go to the sink in id order, each once; the range ends at the highest id present
at start (or --to-id). Published events only, unless --include-unpublished.

Stderr gets a summary at the end with the last id delivered. Exit status: 0 when the range was
replayed (also when nothing matched: \"nothing to replay\"), 1 on an error (a sink that refused an
event stops the replay: nothing after it is sent), 130 when SIGINT/SIGTERM stopped it (a second
signal exits at once). After 1 or 130, run the same command with --after-id <the last id
delivered> to deliver the rest without a gap; the event in hand at the stop may come twice.";

#[derive(clap::Args, Debug)]
pub(crate) struct ReplayArgs {
    /// Only ids at or above this one.
    #[arg(long, value_name = "ID", allow_negative_numbers = true)]
    from_id: Option<i64>,
    /// Only ids at or below this one.
    #[arg(long, value_name = "ID", allow_negative_numbers = true)]
    to_id: Option<i64>,
    /// Resume: only ids above this one (the last id a stopped replay
    /// printed). With --from-id, the later start wins.
    #[arg(long, value_name = "ID", allow_negative_numbers = true)]
    after_id: Option<i64>,
    /// Only events that occurred (occurred_at) at or after this time, RFC
    /// 3339 (e.g. 2026-05-01T00:00:00Z or 2026-05-01T02:00:00+02:00).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    since: Option<DateTime<Utc>>,
    /// Only events that occurred before this time, RFC 3339.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    until: Option<DateTime<Utc>>,
    /// Only this aggregate type (exact match).
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only this aggregate (a UUID).
    #[arg(long, value_parser = crate::parse::parse_uuid)]
    aggregate_id: Option<uuid::Uuid>,
    /// Only this event type (exact match).
    #[arg(long)]
    event_type: Option<String>,
    /// Also replay events not published yet (pending, waiting for a retry,
    /// dead letters). Off by default: those are the relay's to deliver, and
    /// would reach the sink twice.
    #[arg(long)]
    include_unpublished: bool,
    /// At most N events per second, evenly spaced (e.g. 100, or 0.5 for one
    /// every 2 s). Default: as fast as the sink takes them.
    #[arg(long, value_name = "N", value_parser = parse_rate)]
    rate: Option<f64>,
    /// Rows read per query (1 to 100000).
    #[arg(long, default_value_t = replay::DEFAULT_PAGE_SIZE,
          value_parser = clap::value_parser!(i64).range(1..=100_000))]
    batch_size: i64,
    /// Count the events a replay would deliver; open no sink, deliver
    /// nothing.
    #[arg(long)]
    dry_run: bool,
    /// On SIGINT/SIGTERM, how long to wait for the event in hand.
    #[arg(long, value_parser = crate::parse::parse_duration, default_value = "30s")]
    shutdown_grace: Duration,
    #[command(flatten)]
    sink: SinkArgs,
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s.trim())
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("invalid time '{s}': {e} (write RFC 3339 with a zone, e.g. 2026-05-01T00:00:00Z)"))
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let r: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("invalid rate '{s}': write a number of events per second, e.g. 100 or 0.5"))?;
    if !(r.is_finite() && r > 0.0 && r <= replay::MAX_RATE) {
        return Err(format!(
            "invalid rate '{s}': must be more than 0 and at most {} events per second",
            replay::MAX_RATE
        ));
    }
    Ok(r)
}

impl ReplayArgs {
    /// The library's filter, after checking the ranges with the flags'
    /// names.
    fn filter(&self) -> Result<Filter, Error> {
        if let (Some(from), Some(to)) = (self.from_id, self.to_id)
            && from > to
        {
            return Err(Error::Usage(format!("inverted id range: --from-id {from} is above --to-id {to}")));
        }
        if let (Some(since), Some(until)) = (self.since, self.until)
            && since >= until
        {
            return Err(Error::Usage(format!(
                "empty or inverted time range: --since {} is not before --until {}",
                rfc3339(since),
                rfc3339(until)
            )));
        }
        let mut f = Filter::default().include_unpublished(self.include_unpublished);
        f.from_id = self.from_id;
        f.to_id = self.to_id;
        f.after_id = self.after_id;
        f.since = self.since;
        f.until = self.until;
        f.aggregate_type = self.aggregate_type.clone();
        f.aggregate_id = self.aggregate_id;
        f.event_type = self.event_type.clone();
        Ok(f)
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// The progress bar: on a terminal with text logs only.
fn bar(format: LogFormat, p: &Progress) -> indicatif::ProgressBar {
    if format != LogFormat::Text || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let len = u64::try_from(p.end.saturating_sub(p.start)).unwrap_or(0);
    let bar = indicatif::ProgressBar::with_draw_target(Some(len), indicatif::ProgressDrawTarget::stderr());
    let style =
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{wide_bar}] {percent:>3}% of the ids  {msg}")
            .map(|s| s.progress_chars("=> "));
    if let Ok(style) = style {
        bar.set_style(style);
    }
    bar
}

fn draw(bar: &indicatif::ProgressBar, p: &Progress, what: &str) {
    bar.set_position(u64::try_from(p.position.saturating_sub(p.start)).unwrap_or(0));
    bar.set_message(format!("{} {what}", p.events));
}

/// What the shutdown and the second-signal task share: the latest progress.
type Shared = Arc<Mutex<Progress>>;

/// The resume hint for `p`.
fn resume(p: &Progress) -> (String, Vec<(&'static str, Value)>) {
    match p.last_delivered {
        Some(id) => (
            format!("last delivered id {id}; resume with --after-id {id}"),
            vec![("last_delivered_id", json!(id)), ("after_id", json!(id))],
        ),
        None => (
            format!("no event delivered yet; resume with --after-id {}", p.start),
            vec![("last_delivered_id", Value::Null), ("after_id", json!(p.start))],
        ),
    }
}

fn elapsed(t: Instant) -> String {
    let s = t.elapsed().as_secs_f64();
    if s < 10.0 { format!("{s:.2} s") } else { humantime::format_duration(Duration::from_secs(s as u64)).to_string() }
}

/// Resolves on the first SIGINT/SIGTERM; a second one prints the resume
/// hint and exits at once with [`INTERRUPTED_EXIT`].
async fn signals(format: LogFormat, shared: Shared) {
    crate::signals::shutdown_signal().await;
    tokio::spawn(async move {
        crate::signals::shutdown_signal().await;
        let p = *shared.lock().unwrap_or_else(PoisonError::into_inner);
        let (hint, fields) = resume(&p);
        logging::line(
            format,
            "WARN",
            TARGET,
            &format!("second signal: replay stopped at once after {} events; {hint}", p.events),
            &fields,
        );
        std::process::exit(i32::from(INTERRUPTED_EXIT));
    });
}

/// Report a dry run's count: an error when it was interrupted.
fn report_count(format: LogFormat, c: replay::Counted) -> Result<(), Error> {
    let range = match (c.first_id, c.last_id) {
        (Some(a), Some(b)) => format!(" (ids {a} to {b})"),
        _ => String::new(),
    };
    let fields = vec![
        ("events", json!(c.events)),
        ("first_id", json!(c.first_id)),
        ("last_id", json!(c.last_id)),
        ("dry_run", json!(true)),
    ];
    if c.outcome == Outcome::Interrupted {
        let msg = format!("dry run interrupted: {} events counted so far{range}", c.events);
        logging::line(format, "WARN", TARGET, &msg, &fields);
        return Err(Error::Interrupted);
    }
    let msg = if c.events == 0 {
        "dry run: nothing to replay (no event matches)".to_string()
    } else {
        format!("dry run: would replay {} events{range}", c.events)
    };
    logging::line(format, "INFO", TARGET, &msg, &fields);
    Ok(())
}

/// `pg-outbox replay`: deliver the matching published events to the sink
/// again (or count them, with `--dry-run`), with a progress bar on a
/// terminal and a line saying how to resume.
pub(crate) async fn run(db: pg_outbox::ConnectOptions, args: ReplayArgs, format: LogFormat) -> Result<(), Error> {
    let filter = args.filter()?;
    let sink = if args.dry_run { None } else { Some(args.sink.open().await?) };
    let mut builder = Replay::builder(filter)
        .page_size(args.batch_size)
        .shutdown_grace(args.shutdown_grace)
        .delivery_options(args.sink.delivery());
    if let Some(r) = args.rate {
        builder = builder.rate(r);
    }
    let mut replay = builder.open(&db).await?;
    let start = replay.progress();
    let shared: Shared = Arc::new(Mutex::new(start));
    let bar = bar(format, &start);
    let started = Instant::now();
    let track = |what: &'static str| {
        let (bar, shared) = (bar.clone(), shared.clone());
        move |p: &Progress| {
            draw(&bar, p, what);
            *shared.lock().unwrap_or_else(PoisonError::into_inner) = *p;
        }
    };
    let Some(sink) = sink else {
        let counted = replay.count(signals(format, shared.clone()), track("counted")).await;
        bar.finish_and_clear();
        return report_count(format, counted?);
    };
    let sink_name = sink.name().to_string();
    tracing::info!(
        database = %db.describe(),
        sink = %sink_name,
        from = start.start.saturating_add(1),
        to = start.end,
        "replay started"
    );
    let result = replay.run(sink.as_ref(), signals(format, shared.clone()), track("delivered")).await;
    bar.finish_and_clear();
    let p = replay.progress();
    let (hint, mut fields) = resume(&p);
    fields.push(("events", json!(p.events)));
    fields.push(("sent", json!(p.events - p.held)));
    fields.push(("already_held", json!(p.held)));
    fields.push(("sink", json!(sink_name)));
    // With --exactly-once, what the broker already held was not sent again.
    let held = if p.held > 0 {
        format!(" ({} sent, {} already held by the broker, read back and not sent again)", p.events - p.held, p.held)
    } else {
        String::new()
    };
    match result {
        Ok(Outcome::Finished) if p.events == 0 => {
            logging::line(format, "INFO", TARGET, "nothing to replay (no event matches)", &fields);
            Ok(())
        }
        Ok(Outcome::Finished) => {
            let msg = format!(
                "replay done: {} events delivered to {sink_name}{held} in {}; {hint}",
                p.events,
                elapsed(started)
            );
            logging::line(format, "INFO", TARGET, &msg, &fields);
            Ok(())
        }
        Ok(_) => {
            let msg = format!("replay interrupted after {} events{held}; {hint}", p.events);
            logging::line(format, "WARN", TARGET, &msg, &fields);
            Err(Error::Interrupted)
        }
        Err(e) => {
            let at = p.stopped_at.map_or_else(String::new, |id| format!(" at event {id}"));
            Err(Error::Stopped(format!(
                "replay stopped{at} after {} events{held}: {}; {hint}",
                p.events,
                pg_outbox::error::report(&e)
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_with_a_zone() {
        let t = parse_time("2026-05-01T02:00:00+02:00").expect("offset");
        assert_eq!(rfc3339(t), "2026-05-01T00:00:00Z");
        let e = parse_time("2026-05-01 00:00").expect_err("no zone");
        assert!(e.contains("invalid time '2026-05-01 00:00'") && e.contains("RFC 3339"), "{e}");
    }

    #[test]
    fn rates_are_positive_and_bounded() {
        assert_eq!(parse_rate("0.5"), Ok(0.5));
        assert_eq!(parse_rate(" 100 "), Ok(100.0));
        for bad in ["0", "-1", "NaN", "inf", "fast", "2000000"] {
            assert!(parse_rate(bad).is_err(), "{bad} must be refused");
        }
    }
}

//! Replay: deliver events again, to any [`Sink`], without changing the
//! table. What `pg-outbox replay` runs, usable from a program too.
//!
//! A downstream that lost data needs the events again. Published events
//! stay in `events.outbox` until retention deletes them; a replay reads
//! those a [`Filter`] selects (an id range, a time range on `occurred_at`,
//! an aggregate, an event type) and hands them to a sink one after another,
//! in id order, each once.
//!
//! - **Read-only.** A replay runs on a session of its own, and each of its
//!   reads is a transaction started read-only (`START TRANSACTION READ
//!   ONLY`): it cannot change `published_at`, `retry_count` or anything
//!   else, and the relay that owns the outbox goes on undisturbed (replay
//!   takes none of its locks). Nothing of it outlives its transactions, so
//!   it works through a transaction-mode pooler too.
//! - **Published events only**, unless [`Filter::include_unpublished`]:
//!   unpublished events are the relay's job (and would then reach the sink
//!   twice, once from the relay and once from the replay).
//! - **Bounded reads.** Rows are read in keyset pages through `outbox_pkey`
//!   (`id > last ORDER BY id LIMIT page`), each page a read-only transaction
//!   of its own that walks at most [`WINDOW`] ids of the index: never the
//!   range at once, and no snapshot held open for the whole replay (a
//!   replay that runs for hours keeps no vacuum waiting). Rows that
//!   retention deletes before the replay reaches them are not delivered.
//! - **Bounded range.** Without [`Filter::to_id`], a replay ends at the
//!   highest id present when it opens: later events are the relay's.
//! - **Never skips.** A sink error stops the replay
//!   ([`Replay::run`] returns it); [`Progress::last_delivered`] says where to
//!   resume: [`Filter::after_id`] with that id delivers the rest, without a
//!   gap. An event in hand when the replay stops or is interrupted may have
//!   reached the sink without its confirmation; resuming delivers it again
//!   (at-least-once, as the relay: consumers deduplicate on the id).
//! - **Rate-limited** on request ([`ReplayBuilder::rate`]): events are
//!   spaced evenly (a tokio interval whose missed ticks are delayed, never
//!   bunched into a burst after a slow delivery).
//!
//! ```no_run
//! # async fn run() -> Result<(), pg_outbox::Error> {
//! use pg_outbox::relay::{StdoutSink, replay};
//! let db = pg_outbox::ConnectOptions::parse("postgres://app@db/app")?;
//! let filter = replay::Filter::default().from_id(1000).to_id(2000).event_type("PaymentSucceeded");
//! let mut replay = replay::Replay::builder(filter).rate(100.0).open(&db).await?;
//! let outcome = replay.run(&StdoutSink::new(), std::future::pending::<()>(), |_| {}).await?;
//! let p = replay.progress();
//! eprintln!("{outcome:?}: {} events; resume after {:?}", p.events, p.last_delivered);
//! # Ok(()) }
//! ```

use std::future::Future;
use std::time::Duration;

use tokio_postgres::Client;

use super::{DeliveryOptions, Sink};
use crate::connect::ConnectOptions;
use crate::error::{Error, Result};
pub use crate::store::replay::Filter;
use crate::store::replay::{self as store, Unreadable, Window};

/// Default rows per page: 500.
pub const DEFAULT_PAGE_SIZE: i64 = 500;

/// Ids of `outbox_pkey` one statement walks at most: 10 000. Bounds the
/// work of a statement whatever the filter keeps.
pub const WINDOW: i64 = 10_000;

/// Highest rate [`ReplayBuilder::rate`] accepts: a million events per
/// second (faster than any sink delivers one at a time; leave the rate
/// unset for no limit).
pub const MAX_RATE: f64 = 1_000_000.0;

/// Default time an event in hand may take to reach the sink after
/// shutdown resolves: 30 seconds, as the relay's
/// [`ConsumerBuilder::DEFAULT_SHUTDOWN_GRACE`](crate::ConsumerBuilder::DEFAULT_SHUTDOWN_GRACE).
pub const DEFAULT_REPLAY_GRACE: Duration = crate::consumer::ConsumerBuilder::DEFAULT_SHUTDOWN_GRACE;

/// Settings of a replay: `Replay::builder(filter)...open(&db)`.
#[derive(Debug, Clone)]
pub struct ReplayBuilder {
    filter: Filter,
    page_size: i64,
    rate: Option<f64>,
    grace: Duration,
    delivery: DeliveryOptions,
}

impl ReplayBuilder {
    /// Rows read per page (default [`DEFAULT_PAGE_SIZE`]; at least 1).
    ///
    /// # Example
    /// ```
    /// let b = pg_outbox::relay::replay::Replay::builder(Default::default()).page_size(100);
    /// # let _ = b;
    /// ```
    pub fn page_size(mut self, rows: i64) -> Self {
        self.page_size = rows;
        self
    }

    /// Deliver at most `per_second` events per second, evenly spaced
    /// (more than 0, at most [`MAX_RATE`]; fractions allowed, e.g. 0.5 is
    /// one event every 2 s). Default: no limit.
    ///
    /// # Example
    /// ```
    /// let b = pg_outbox::relay::replay::Replay::builder(Default::default()).rate(50.0);
    /// # let _ = b;
    /// ```
    pub fn rate(mut self, per_second: f64) -> Self {
        self.rate = Some(per_second);
        self
    }

    /// How long the event in hand may take to reach the sink once shutdown
    /// resolves (default [`DEFAULT_REPLAY_GRACE`]); past it the replay
    /// stops without waiting for the sink's answer.
    ///
    /// # Example
    /// ```
    /// # use std::time::Duration;
    /// let b = pg_outbox::relay::replay::Replay::builder(Default::default()).shutdown_grace(Duration::from_secs(5));
    /// # let _ = b;
    /// ```
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// How each event is encoded and how long its delivery may take
    /// (default [`DeliveryOptions::default`]), as in the relay.
    pub fn delivery_options(mut self, options: DeliveryOptions) -> Self {
        self.delivery = options;
        self
    }

    /// Check the settings, connect to `db` on a session of the replay's own
    /// (whose reads are read-only transactions) (application name `pg-outbox replay` unless the URL
    /// sets one), and find where the range starts and ends.
    ///
    /// # Errors
    /// [`Error::Config`] for an inverted range ([`Filter::validate`]), a page
    /// size below 1 or a rate out of range; [`Error::Connect`] and the like
    /// when the database cannot be reached; [`Error::NotMigrated`] without
    /// the schema.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the session being opened.
    pub async fn open(self, db: &ConnectOptions) -> Result<Replay> {
        self.filter.validate()?;
        if self.page_size < 1 {
            return Err(Error::Config(format!("the page size must be at least 1, got {}", self.page_size)));
        }
        let period = match self.rate {
            None => None,
            Some(r) if r.is_finite() && r > 0.0 && r <= MAX_RATE => Some(Duration::from_secs_f64(1.0 / r)),
            Some(r) => {
                return Err(Error::Config(format!(
                    "the rate must be more than 0 and at most {MAX_RATE} events per second, got {r}"
                )));
            }
        };
        let db = match db.application_name() {
            Some(_) => db.clone(),
            None => db.clone().with_application_name("pg-outbox replay"),
        };
        let client = db.connect().await?;
        let lower = self.filter.start_after().unwrap_or(i64::MIN);
        let store::Bounds { first_id, last_id } = store::bounds(&client, lower).await?;
        let start = first_id.map_or(lower, |f| f - 1);
        let end = last_id.unwrap_or(lower).min(self.filter.to_id.unwrap_or(i64::MAX)).max(start);
        Ok(Replay {
            client,
            filter: self.filter,
            page_size: self.page_size,
            period,
            grace: self.grace,
            delivery: self.delivery,
            start,
            end,
            scanned: start,
            events: 0,
            held: 0,
            last_delivered: None,
            stopped_at: None,
        })
    }
}

/// How a [`Replay::run`] or [`Replay::count`] ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Every matching event in the range was delivered (or counted).
    Finished,
    /// `shutdown` resolved first; [`Progress::last_delivered`] says where
    /// to resume.
    Interrupted,
}

/// Where a replay stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Progress {
    /// Events delivered (confirmed by the sink) or, in [`Replay::count`],
    /// counted. Those the broker already held are included, and counted
    /// apart in [`Progress::held`].
    pub events: u64,
    /// Of [`Progress::events`], those an exactly-once sink did not send: it
    /// read each back from the broker, which already held it
    /// ([`super::Sent::Held`]).
    pub held: u64,
    /// The id of the last event the sink confirmed, `None` before the
    /// first: resume after it ([`Filter::after_id`]).
    pub last_delivered: Option<i64>,
    /// The id of the event the replay stopped on because the sink refused
    /// it or its row could not be read; it was not delivered.
    pub stopped_at: Option<i64>,
    /// The range walked: ids in `(start, end]`.
    pub start: i64,
    /// See [`Progress::start`].
    pub end: i64,
    /// Ids up to this one have been read (and, but in a count, delivered
    /// where they matched): between `start` and `end`.
    pub position: i64,
}

impl Progress {
    /// The share of the id range walked, 0.0 to 1.0 (1.0 for an empty range).
    pub fn fraction(&self) -> f64 {
        if self.end <= self.start {
            return 1.0;
        }
        (self.position.saturating_sub(self.start)) as f64 / (self.end.saturating_sub(self.start)) as f64
    }
}

/// What [`Replay::count`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counted {
    /// Events a replay would deliver (so far, when interrupted).
    pub events: u64,
    /// The lowest id among them.
    pub first_id: Option<i64>,
    /// The highest id among them.
    pub last_id: Option<i64>,
    /// Whether the count went through the whole range.
    pub outcome: Outcome,
}

/// A replay, open on its session (every read a read-only transaction): [`Replay::run`] delivers,
/// [`Replay::count`] only counts. See the [module docs](self).
#[derive(Debug)]
pub struct Replay {
    client: Client,
    filter: Filter,
    page_size: i64,
    period: Option<Duration>,
    grace: Duration,
    delivery: DeliveryOptions,
    start: i64,
    end: i64,
    /// Every matching row with an id up to this one has been handled.
    scanned: i64,
    events: u64,
    held: u64,
    last_delivered: Option<i64>,
    stopped_at: Option<i64>,
}

impl Replay {
    /// Settings for a replay of the events `filter` selects.
    ///
    /// # Example
    /// ```
    /// use pg_outbox::relay::replay::{Filter, Replay};
    /// let b = Replay::builder(Filter::default().aggregate_type("subscription"));
    /// # let _ = b;
    /// ```
    pub fn builder(filter: Filter) -> ReplayBuilder {
        ReplayBuilder {
            filter,
            page_size: DEFAULT_PAGE_SIZE,
            rate: None,
            grace: DEFAULT_REPLAY_GRACE,
            delivery: DeliveryOptions::default(),
        }
    }

    /// Where the replay stands.
    pub fn progress(&self) -> Progress {
        Progress {
            events: self.events,
            held: self.held,
            last_delivered: self.last_delivered,
            stopped_at: self.stopped_at,
            start: self.start,
            end: self.end,
            position: self.scanned,
        }
    }

    /// The next window to read: the filter's rows with ids above
    /// [`Replay::scanned`] and up to [`WINDOW`] ids on, not past the end.
    fn window(&self) -> Window<'_> {
        let upto = self.end.min(self.scanned.saturating_add(WINDOW));
        Window { after: self.scanned, upto, filter: &self.filter }
    }

    /// After a window with nothing in it: skip to just before the next id
    /// (or to the end).
    async fn skip_gap(&mut self, window_end: i64) -> Result<()> {
        let next = store::bounds(&self.client, window_end).await?.first_id;
        self.scanned = next.map_or(self.end, |n| n - 1).clamp(window_end, self.end);
        Ok(())
    }

    /// Deliver every matching event in the range to `sink`, in id order,
    /// until the range ends or `shutdown` resolves; `on_progress` is called
    /// after each event and each page (to draw a progress bar). A second
    /// call goes on where the first stopped.
    ///
    /// Each event is handed to the sink once, after the rate limit's wait;
    /// once the sink confirms it, it counts in [`Progress::events`] and
    /// becomes [`Progress::last_delivered`]. When `shutdown` resolves during
    /// a delivery, that delivery gets the shutdown grace to finish.
    ///
    /// # Errors
    /// [`Error::Sink`] when the sink refuses an event (a
    /// [`FatalSinkError`](super::FatalSinkError) too): the replay stops
    /// there, [`Progress::stopped_at`] names the event, nothing after it is
    /// delivered. [`Error::Db`] when a page cannot be read (or a row
    /// decoded: its id is then in [`Progress::stopped_at`]).
    ///
    /// # Cancel safety
    /// Not cancel safe, but it loses nothing and changes nothing: dropping
    /// the future abandons the event in hand, which the sink may have taken
    /// without its confirmation counting; [`Replay::progress`] counts only
    /// confirmed deliveries, so a resume after
    /// [`Progress::last_delivered`] delivers it again. For a clean stop,
    /// resolve `shutdown` instead.
    pub async fn run<S, F, P>(&mut self, sink: &S, shutdown: F, mut on_progress: P) -> Result<Outcome>
    where
        S: Sink + ?Sized,
        F: Future<Output = ()>,
        P: FnMut(&Progress),
    {
        tokio::pin!(shutdown);
        let mut ticker = self.period.map(|p| {
            let mut t = tokio::time::interval(p);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        while self.scanned < self.end {
            let window = self.window();
            let upto = window.upto;
            let rows = tokio::select! {
                r = store::page(&self.client, &window, self.page_size) => r?,
                _ = &mut shutdown => return Ok(Outcome::Interrupted),
            };
            let full = rows.len() as i64 >= self.page_size;
            if rows.is_empty() {
                self.skip_gap(upto).await?;
                on_progress(&self.progress());
                continue;
            }
            for row in rows {
                let event = match row {
                    Ok(e) => e,
                    Err(Unreadable { id, error }) => {
                        self.stopped_at = id;
                        return Err(error);
                    }
                };
                if let Some(t) = ticker.as_mut() {
                    tokio::select! {
                        _ = t.tick() => {}
                        _ = &mut shutdown => return Ok(Outcome::Interrupted),
                    }
                }
                let (delivered, interrupted) = super::deliver_with_grace(
                    sink,
                    &self.delivery,
                    (&event, None),
                    Some(shutdown.as_mut()),
                    self.grace,
                    "stopping",
                    || {},
                )
                .await;
                match delivered {
                    None => return Ok(Outcome::Interrupted),
                    Some(Err(e)) => {
                        self.stopped_at = Some(event.id);
                        return Err(Error::Sink(e));
                    }
                    Some(Ok(sent)) => {
                        self.events += 1;
                        if let super::Sent::Held(_) = sent {
                            self.held += 1;
                        }
                        self.last_delivered = Some(event.id);
                        self.scanned = event.id;
                    }
                }
                on_progress(&self.progress());
                if interrupted {
                    return Ok(Outcome::Interrupted);
                }
            }
            if !full {
                self.scanned = upto;
            }
            on_progress(&self.progress());
        }
        Ok(Outcome::Finished)
    }

    /// Count the matching events in the range without delivering them (a
    /// dry run), window by window, until the range ends or `shutdown`
    /// resolves; `on_progress` is called after each window.
    ///
    /// # Errors
    /// [`Error::Db`] when a window cannot be counted.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn count<F, P>(&mut self, shutdown: F, mut on_progress: P) -> Result<Counted>
    where
        F: Future<Output = ()>,
        P: FnMut(&Progress),
    {
        tokio::pin!(shutdown);
        let (mut first_id, mut last_id) = (None, None);
        let mut outcome = Outcome::Finished;
        while self.scanned < self.end {
            let window = self.window();
            let upto = window.upto;
            let counted = tokio::select! {
                r = store::count(&self.client, &window) => r?,
                _ = &mut shutdown => { outcome = Outcome::Interrupted; break; }
            };
            if counted.rows == 0 {
                self.skip_gap(upto).await?;
            } else {
                self.events += u64::try_from(counted.rows).unwrap_or(0);
                first_id = first_id.or(counted.first_id);
                last_id = counted.last_id;
                self.scanned = upto;
            }
            on_progress(&self.progress());
        }
        Ok(Counted { events: self.events, first_id, last_id, outcome })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, Utc};

    #[test]
    fn start_after_takes_the_later_of_after_id_and_from_id() {
        assert_eq!(Filter::default().start_after(), None);
        assert_eq!(Filter::default().from_id(10).start_after(), Some(9));
        assert_eq!(Filter::default().after_id(10).start_after(), Some(10));
        assert_eq!(Filter::default().from_id(10).after_id(20).start_after(), Some(20));
        assert_eq!(Filter::default().from_id(30).after_id(20).start_after(), Some(29));
        assert_eq!(Filter::default().from_id(i64::MIN).start_after(), Some(i64::MIN));
    }

    #[test]
    fn inverted_ranges_are_refused_with_both_ends_named() {
        let e = Filter::default().from_id(10).to_id(5).validate().expect_err("inverted");
        assert!(e.to_string().contains("from id 10 is above to id 5"), "{e}");
        assert!(Filter::default().from_id(5).to_id(5).validate().is_ok());
        let t = |s: &str| DateTime::parse_from_rfc3339(s).expect("time").with_timezone(&Utc);
        let e = Filter::default().since(t("2026-01-02T00:00:00Z")).until(t("2026-01-01T00:00:00Z")).validate();
        let e = e.expect_err("inverted");
        assert!(e.to_string().contains("since 2026-01-02T00:00:00Z is not before until 2026-01-01T00:00:00Z"), "{e}");
    }

    #[test]
    fn progress_fraction_spans_the_range() {
        let p = Progress { start: 100, end: 300, position: 150, ..Progress::default() };
        assert!((p.fraction() - 0.25).abs() < 1e-9);
        assert_eq!(Progress { start: 5, end: 5, position: 5, ..Progress::default() }.fraction(), 1.0);
    }
}

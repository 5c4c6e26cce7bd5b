//! The drain loop: one task that owns the work connection and does, strictly
//! one after another, the fetching of due events and the writing of
//! acknowledgements in batches.
//!
//! Keeping both in one task (rather than a separate fetcher and completer)
//! is what makes per-aggregate hold-back exact: a fetch issued after a flush
//! sees that flush, so each failure's effect on later fetches is known by
//! fetch number (see [`super::Hold`]).
//!
//! Wake-ups: a notification, the fallback sweep (jittered), the retry timer
//! (the earliest `next_retry_at`, read with the database's clock), a
//! reconnect of either connection, and a released delivery. A fetch takes
//! only as many rows as there is room for in the stream's buffer, and a full
//! batch is followed by another fetch as soon as there is room again, so a
//! backlog of any size is streamed, never loaded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until};
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;

use super::delivery::Settlement;
use super::{AggregateKey, ConsumerConfig, Delivery, STATUS_INTERVAL, Shared};
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::store;

struct Conn {
    client: Client,
    handle: JoinHandle<()>,
    fetch: Statement,
    ack: Statement,
    fail: Statement,
    next_retry: Statement,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

struct PendingFail {
    id: i64,
    key: AggregateKey,
    error: String,
    delay: Duration,
}

/// What the select loop waits on; kept apart from the state it mutates.
struct Io {
    tx: mpsc::Sender<Delivery>,
    settle_rx: mpsc::UnboundedReceiver<Settlement>,
    wake: Arc<Notify>,
}

pub(crate) struct Engine {
    cfg: Arc<ConsumerConfig>,
    conn: Option<Conn>,
    first: Option<(Client, JoinHandle<()>)>,
    io: Option<Io>,
    shared: Arc<Shared>,
    token: CancellationToken,
    /// Handed out (in the buffer or with user code), not settled: id -> fetch number.
    outstanding: HashMap<i64, u64>,
    acks: Vec<i64>,
    fails: Vec<PendingFail>,
    fetch_seq: u64,
    cursor: i64,
    want_fetch: bool,
    retry_at: Option<Instant>,
    flush_at: Option<Instant>,
    reconnect_at: Option<Instant>,
    backoff: backon::ExponentialBackoff,
}

fn new_backoff(max: Duration) -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(1.0 + rand::random::<f64>() * 0.1)
}

impl Engine {
    pub(crate) fn new(
        cfg: Arc<ConsumerConfig>,
        first: (Client, JoinHandle<()>),
        tx: mpsc::Sender<Delivery>,
        settle_rx: mpsc::UnboundedReceiver<Settlement>,
        shared: Arc<Shared>,
        wake: Arc<Notify>,
        token: CancellationToken,
    ) -> Self {
        let backoff = new_backoff(cfg.reconnect_max_delay);
        Engine {
            cfg,
            conn: None,
            first: Some(first),
            io: Some(Io { tx, settle_rx, wake }),
            shared,
            token,
            outstanding: HashMap::new(),
            acks: Vec::new(),
            fails: Vec::new(),
            fetch_seq: 0,
            cursor: 0,
            want_fetch: true,
            retry_at: None,
            flush_at: None,
            reconnect_at: Some(Instant::now()),
            backoff,
        }
    }

    fn pending(&self) -> usize {
        self.acks.len() + self.fails.len()
    }

    pub(crate) async fn run(mut self) -> Result<()> {
        let Some(Io { tx, mut settle_rx, wake }) = self.io.take() else { return Ok(()) };
        let token = self.token.clone();
        let sweep = sleep(jittered(self.cfg.sweep_interval));
        tokio::pin!(sweep);
        let mut status_tick = tokio::time::interval(STATUS_INTERVAL);
        status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop_deadline: Option<Instant> = None;
        let far = Instant::now() + Duration::from_secs(86_400 * 365);

        loop {
            if self.token.is_cancelled() && stop_deadline.is_none() {
                stop_deadline = Some(Instant::now() + self.cfg.shutdown_grace);
                self.want_fetch = false;
                tracing::debug!(outstanding = self.outstanding.len(), "drain loop stopping");
            }
            if let Some(deadline) = stop_deadline
                && (self.outstanding.is_empty() || Instant::now() >= deadline)
            {
                break;
            }
            if self.conn.is_some() && self.pending() >= self.cfg.ack_batch_size {
                self.flush().await;
                continue;
            }
            let stopping = stop_deadline.is_some();
            let can_fetch = self.want_fetch && !stopping && self.conn.is_some();
            let batch = self.cfg.batch_size;
            tokio::select! {
                biased;
                _ = token.cancelled(), if !stopping => {}
                Some(s) = settle_rx.recv() => {
                    self.settle(s);
                    let mut more = 0;
                    while more < 10_000 {
                        match settle_rx.try_recv() {
                            Ok(s) => { self.settle(s); more += 1; }
                            Err(_) => break,
                        }
                    }
                }
                _ = sleep_until(self.flush_at.unwrap_or(far)), if self.flush_at.is_some() && self.conn.is_some() => {
                    self.flush().await;
                }
                _ = sleep_until(self.reconnect_at.unwrap_or(far)), if self.conn.is_none() => {
                    self.reconnect().await;
                }
                permit = tx.reserve_many(batch), if can_fetch => {
                    match permit {
                        Ok(permit) => self.fetch(permit).await,
                        Err(_) => token.cancel(), // the stream was dropped
                    }
                }
                _ = wake.notified(), if !stopping => {
                    self.want_fetch = true;
                    self.cursor = 0;
                }
                _ = &mut sweep => {
                    metrics::counter!(m::SWEEPS).increment(1);
                    self.want_fetch = true;
                    self.cursor = 0;
                    sweep.as_mut().reset(Instant::now() + jittered(self.cfg.sweep_interval));
                }
                _ = sleep_until(self.retry_at.unwrap_or(far)), if self.retry_at.is_some() => {
                    self.retry_at = None;
                    self.want_fetch = true;
                    self.cursor = 0;
                }
                _ = status_tick.tick(), if self.conn.is_some() && !stopping => {
                    self.refresh_gauges().await;
                }
                _ = tx.closed(), if !stopping => token.cancel(),
                _ = sleep_until(stop_deadline.unwrap_or(far)), if stopping => {}
            }
        }
        self.final_flush().await;
        Ok(())
    }

    fn settle(&mut self, s: Settlement) {
        let arm_flush = |flush_at: &mut Option<Instant>, every: Duration| {
            if flush_at.is_none() {
                *flush_at = Some(Instant::now() + every);
            }
        };
        match s {
            Settlement::Ack { id } => {
                self.outstanding.remove(&id);
                self.acks.push(id);
                arm_flush(&mut self.flush_at, self.cfg.ack_interval);
            }
            Settlement::Fail { id, key, retry_count, error } => {
                self.outstanding.remove(&id);
                let failures = u32::try_from(retry_count.max(0)).unwrap_or(0).saturating_add(1);
                let delay = self.cfg.retry.delay(failures);
                self.fails.push(PendingFail { id, key, error, delay });
                arm_flush(&mut self.flush_at, self.cfg.ack_interval);
            }
            Settlement::Release { id, key } => {
                self.outstanding.remove(&id);
                metrics::counter!(m::EVENTS_RELEASED).increment(1);
                let seq = self.fetch_seq;
                let mut map = self.shared.holdback();
                let h = map.entry(key).or_default();
                h.pending = h.pending.saturating_sub(1);
                h.upto_seq = h.upto_seq.max(seq);
                drop(map);
                self.want_fetch = true;
                self.cursor = 0;
            }
        }
    }

    async fn reconnect(&mut self) {
        let (client, handle) = match self.first.take() {
            Some(first) => first,
            None => match crate::connect::connect(&self.cfg.pg, "pg-outbox drain").await {
                Ok(c) => c,
                Err(e) => {
                    self.connection_failed(&e);
                    return;
                }
            },
        };
        let prepared = async {
            let fetch = client.prepare(&store::fetch_sql()).await?;
            let ack = client.prepare(store::ACK).await?;
            let fail = client.prepare(store::FAIL).await?;
            let next_retry = client.prepare(store::NEXT_RETRY_IN).await?;
            Ok::<_, tokio_postgres::Error>((fetch, ack, fail, next_retry))
        }
        .await;
        match prepared {
            Ok((fetch, ack, fail, next_retry)) => {
                self.conn = Some(Conn { client, handle, fetch, ack, fail, next_retry });
                self.backoff = new_backoff(self.cfg.reconnect_max_delay);
                self.reconnect_at = None;
                // Sweep after (re)connecting: notifications may have been missed.
                self.want_fetch = true;
                self.cursor = 0;
                if self.pending() > 0 {
                    self.flush_at = Some(Instant::now());
                }
            }
            Err(e) => {
                handle.abort();
                self.connection_failed(&Error::Db(e));
            }
        }
    }

    fn connection_failed(&mut self, e: &Error) {
        metrics::counter!(m::DATABASE_ERRORS).increment(1);
        let delay = self.backoff.next().unwrap_or(self.cfg.reconnect_max_delay);
        tracing::warn!(error = %crate::error::report(e), retry_in = ?delay, "drain connection failed; retrying");
        self.conn = None;
        self.reconnect_at = Some(Instant::now() + delay);
    }

    fn db_error(&mut self, what: &str, e: tokio_postgres::Error) {
        metrics::counter!(m::DATABASE_ERRORS).increment(1);
        let delay = self.backoff.next().unwrap_or(self.cfg.reconnect_max_delay);
        tracing::warn!(error = %crate::error::report(&e), during = what, retry_in = ?delay,
            "database error in the drain loop; reconnecting");
        self.conn = None;
        self.reconnect_at = Some(Instant::now() + delay);
    }

    async fn fetch(&mut self, permit: mpsc::PermitIterator<'_, Delivery>) {
        let Some(conn) = self.conn.as_ref() else { return };
        let mut exclude: Vec<i64> = self.outstanding.keys().copied().collect();
        exclude.extend(self.acks.iter().copied());
        exclude.extend(self.fails.iter().map(|f| f.id));
        let batch = i64::try_from(self.cfg.batch_size).unwrap_or(i64::MAX);
        let res = conn.client.query(&conn.fetch, &[&self.cursor, &exclude, &batch]).await;
        let rows = match res {
            Ok(rows) => rows,
            Err(e) => {
                drop(permit);
                self.db_error("fetch", e);
                return;
            }
        };
        self.fetch_seq += 1;
        let seq = self.fetch_seq;
        let full = rows.len() >= self.cfg.batch_size;
        let mut last_id = self.cursor;
        let mut handed = 0u64;
        for (row, slot) in rows.iter().zip(permit) {
            match store::event_from_row(row) {
                Ok(event) => {
                    last_id = last_id.max(event.id);
                    self.outstanding.insert(event.id, seq);
                    slot.send(Delivery::new(event, seq, self.shared.clone()));
                    handed += 1;
                }
                Err(e) => {
                    tracing::error!(error = %crate::error::report(&e), "could not read an outbox row; it stays unpublished");
                }
            }
        }
        metrics::counter!(m::EVENTS_FETCHED).increment(handed);
        if full {
            self.cursor = last_id;
            self.want_fetch = true;
        } else {
            self.cursor = 0;
            self.want_fetch = false;
            self.schedule_retry_timer().await;
        }
    }

    async fn schedule_retry_timer(&mut self) {
        let Some(conn) = self.conn.as_ref() else { return };
        match conn.client.query_one(&conn.next_retry, &[]).await {
            Ok(row) => match row.try_get::<_, Option<f64>>(0) {
                Ok(Some(secs)) => self.arm_retry(secs),
                Ok(None) => {}
                Err(e) => self.db_error("reading the next retry time", e),
            },
            Err(e) => self.db_error("reading the next retry time", e),
        }
    }

    fn arm_retry(&mut self, secs: f64) {
        // A few milliseconds late, so the database's now() has passed it.
        let at = Instant::now() + store::secs_to_duration(secs) + Duration::from_millis(5);
        self.retry_at = Some(match self.retry_at {
            Some(cur) if cur < at => cur,
            _ => at,
        });
    }

    async fn flush(&mut self) {
        self.flush_at = None;
        let Some(conn) = self.conn.as_ref() else { return };
        let acks = std::mem::take(&mut self.acks);
        let fails = std::mem::take(&mut self.fails);
        let ack_fut =
            async { if acks.is_empty() { Ok(Vec::new()) } else { conn.client.query(&conn.ack, &[&acks]).await } };
        let fail_ids: Vec<i64> = fails.iter().map(|f| f.id).collect();
        let fail_errs: Vec<&str> = fails.iter().map(|f| f.error.as_str()).collect();
        let fail_delays: Vec<f64> = fails.iter().map(|f| f.delay.as_secs_f64()).collect();
        let fail_fut = async {
            if fails.is_empty() {
                Ok(Vec::new())
            } else {
                conn.client.query(&conn.fail, &[&fail_ids, &fail_errs, &fail_delays, &self.cfg.max_retries]).await
            }
        };
        let (ack_res, fail_res) = tokio::join!(ack_fut, fail_fut);
        match ack_res {
            Ok(rows) => {
                let hist = metrics::histogram!(m::DELIVERY_LAG);
                for r in &rows {
                    if let Ok(Some(lag)) = r.try_get::<_, Option<f64>>(0) {
                        hist.record(lag);
                    }
                }
                metrics::counter!(m::EVENTS_PUBLISHED).increment(rows.len() as u64);
            }
            Err(e) => {
                self.acks.extend(acks);
                self.db_error("writing acknowledgements", e);
            }
        }
        match fail_res {
            Ok(rows) => {
                let mut earliest: Option<f64> = None;
                let mut dead = 0u64;
                for r in &rows {
                    let id: i64 = r.try_get(0).unwrap_or_default();
                    if r.try_get::<_, bool>(1).unwrap_or(false) {
                        dead += 1;
                        let err = fails.iter().find(|f| f.id == id).map(|f| f.error.as_str()).unwrap_or("");
                        tracing::warn!(id, error = err, "event became a dead letter");
                    }
                    if let Ok(Some(s)) = r.try_get::<_, Option<f64>>(2) {
                        earliest = Some(earliest.map_or(s, |e: f64| e.min(s)));
                    }
                }
                metrics::counter!(m::EVENTS_FAILED).increment(fails.len() as u64);
                metrics::counter!(m::EVENTS_DEAD_LETTERED).increment(dead);
                if let Some(s) = earliest {
                    self.arm_retry(s);
                }
                let seq = self.fetch_seq;
                let mut map = self.shared.holdback();
                for f in &fails {
                    let h = map.entry(f.key.clone()).or_default();
                    h.pending = h.pending.saturating_sub(1);
                    h.upto_seq = h.upto_seq.max(seq);
                }
            }
            Err(e) => {
                self.fails.extend(fails);
                if self.conn.is_some() {
                    self.db_error("writing failures", e);
                }
            }
        }
        self.collect_holdback();
        if self.pending() > 0 && self.flush_at.is_none() && self.conn.is_some() {
            self.flush_at = Some(Instant::now() + self.cfg.ack_interval);
        }
    }

    /// Forget hold-back entries that can no longer match a buffered delivery.
    fn collect_holdback(&self) {
        let oldest = self.outstanding.values().copied().min().unwrap_or(u64::MAX);
        self.shared.holdback().retain(|_, h| h.pending > 0 || h.upto_seq >= oldest);
    }

    async fn refresh_gauges(&mut self) {
        let Some(conn) = self.conn.as_ref() else { return };
        match store::status(&conn.client).await {
            Ok(s) => {
                metrics::gauge!(m::BACKLOG).set((s.unpublished - s.dead_letters) as f64);
                metrics::gauge!(m::DEAD_LETTERS).set(s.dead_letters as f64);
                metrics::gauge!(m::OLDEST_UNPUBLISHED_AGE).set(s.oldest_unpublished_age_seconds.unwrap_or(0.0));
            }
            Err(e) => tracing::debug!(error = %crate::error::report(&e), "could not refresh backlog gauges"),
        }
    }

    async fn final_flush(&mut self) {
        // Whatever is still handed out is released by its Drop later; here we
        // write what was settled.
        for _ in 0..3 {
            if self.pending() == 0 {
                break;
            }
            if self.conn.is_none() {
                self.reconnect().await;
            }
            self.flush().await;
        }
        if self.pending() > 0 {
            tracing::error!(
                acknowledgements = self.acks.len(),
                failures = self.fails.len(),
                "could not write the final settlements; those events will be delivered again"
            );
        }
        if !self.outstanding.is_empty() {
            tracing::warn!(
                deliveries = self.outstanding.len(),
                "shutdown grace ran out with deliveries still open; they stay unpublished and will be delivered again"
            );
        }
    }
}

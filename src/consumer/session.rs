//! The session service: the drain loop's database sessions and reconnecting.
//!
//! Two sessions, opened together and given up together: the work session
//! fetches (and holds the mode's advisory locks), the writer writes
//! acknowledgements and failures while the work session goes on fetching.
//! In competing mode the writes go on the work session itself, inside the
//! claim transaction. Each opening is a new generation, so the outcome of a
//! write is tied to the sessions it ran on. A lost session is given up at
//! once (its locks are gone) and opened again after an exponential backoff
//! with jitter (`backon`), from 100 ms up to the reconnect maximum
//! ([`new_backoff`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::ConsumerConfig;
use crate::connect::Link;
use crate::error::Error;
use crate::store::statement::{Session, StatementError};
use crate::store::{FetchKind, WorkSession, WriterSession};

/// Open sessions: the work session and the writer (the work session itself
/// in competing mode), with their statements prepared.
pub(super) struct Conn {
    pub(super) work: WorkSession,
    pub(super) writer: WriterSession,
    link: Link,
    /// The second session's connection task (`None` in competing mode).
    writer_link: Option<Link>,
}

impl Conn {
    /// Resolves when the work session's connection, or the writer's, ends:
    /// with which.
    pub(super) fn closed(&self) -> impl Future<Output = &'static str> + use<> {
        let work = self.link.closed.clone();
        let writer = self.writer_link.as_ref().map(|l| l.closed.clone());
        async move {
            tokio::select! {
                biased;
                _ = work.cancelled() => "drain",
                _ = cancelled(writer.as_ref()) => "writer",
            }
        }
    }
}

/// Resolves when `token` is cancelled; never without one.
async fn cancelled(token: Option<&CancellationToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The sessions are given up (an error, a lost connection, the end):
        // a statement of theirs still running is cancelled, so it does not
        // run on at the server after its session is closed here.
        if self.work.session().busy() {
            self.work.session().cancel_in_background();
        }
        if self.writer_link.is_some() && self.writer.session().busy() {
            self.writer.session().cancel_in_background();
        }
        self.link.handle.abort();
        if let Some(l) = &self.writer_link {
            l.handle.abort();
        }
    }
}

/// A connected session and its connection task.
type Connected = (Client, Link);

/// Why opening the sessions failed.
pub(super) enum OpenError {
    /// A connection could not be made.
    Connect(Error),
    /// A statement preparing a session failed (or was stopped).
    Statement(StatementError),
}

/// The sessions, open or waiting to reconnect.
pub(super) struct Sessions {
    conn: Option<Conn>,
    /// The connection `start` made (checked the schema on), used first.
    first: Option<Connected>,
    generation: u64,
    backoff: Backoff,
    reconnect_at: Option<Instant>,
}

/// The reconnect backoff, and when it starts over: only after sessions
/// that stayed up for [`Backoff::max_delay`] or longer once ready. Sessions
/// lost sooner (a permanent error right after each opening: a privilege
/// revoked, a statement that always fails) keep it growing, so such a
/// loop waits up to the longest delay between tries, not 100 ms.
#[derive(Debug)]
pub(super) struct Backoff {
    delays: backon::ExponentialBackoff,
    /// When the sessions last became ready, while they are up.
    ready_at: Option<Instant>,
    max_delay: Duration,
}

impl Backoff {
    /// A backoff whose delays grow up to `max_delay` ([`new_backoff`]).
    pub(super) fn new(max_delay: Duration) -> Self {
        Backoff { delays: new_backoff(max_delay), ready_at: None, max_delay }
    }

    /// The sessions are ready at `now`.
    pub(super) fn ready(&mut self, now: Instant) {
        self.ready_at = Some(now);
    }

    /// The sessions were lost at `now`: the delay before the next try,
    /// from a fresh backoff when they had stayed up for `max_delay`.
    pub(super) fn next_delay(&mut self, now: Instant) -> Duration {
        if self.ready_at.take().is_some_and(|at| now.saturating_duration_since(at) >= self.max_delay) {
            self.delays = new_backoff(self.max_delay);
        }
        self.delays.next().unwrap_or(self.max_delay).min(self.max_delay)
    }
}

/// The reconnect backoff, without end: 100–200 ms first, then doubling,
/// up to `max`. backon's jitter adds up to the delay itself (a delay `d`
/// becomes one in `[d, 2d)`), so the delay it doubles is capped at half of
/// `max`: every wait stays within `max`, and once there, waits fall
/// between `max / 2` and `max` (relays that lost the server together do
/// not come back in step).
pub(crate) fn new_backoff(max: Duration) -> backon::ExponentialBackoff {
    let half = max / 2;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100).min(half))
        .with_max_delay(half)
        .with_jitter()
        .without_max_times()
        .build()
}

impl Sessions {
    /// Sessions to open at once, starting with `first`.
    pub(super) fn new(first: Connected, max_delay: Duration) -> Self {
        Sessions {
            conn: None,
            first: Some(first),
            generation: 0,
            backoff: Backoff::new(max_delay),
            reconnect_at: Some(Instant::now()),
        }
    }

    /// The open sessions, if any.
    pub(super) fn conn(&self) -> Option<&Conn> {
        self.conn.as_ref()
    }

    pub(super) fn is_open(&self) -> bool {
        self.conn.is_some()
    }

    /// Counts openings: a write's outcome belongs to the sessions of its
    /// generation.
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// When to open the sessions again (while closed).
    pub(super) fn reconnect_at(&self) -> Option<Instant> {
        self.reconnect_at
    }

    /// The next delay of the reconnect backoff.
    pub(super) fn next_delay(&mut self) -> Duration {
        self.backoff.next_delay(Instant::now())
    }

    /// Give the sessions up (closing them) and open them again after `delay`.
    pub(super) fn close(&mut self, delay: Duration) {
        self.conn = None;
        self.reconnect_at = Some(Instant::now() + delay);
    }

    /// Open the work and writer sessions and prepare their statements for
    /// fetches of `kind`. When `stop` resolves during preparation, the
    /// statement running is cancelled and the sessions are closed (see
    /// `store::statement::run`).
    pub(super) async fn open(
        &mut self,
        cfg: &ConsumerConfig,
        kind: FetchKind,
        stop: impl Future<Output = ()>,
    ) -> Result<(), OpenError> {
        let (client, link, writer) = self.connect(cfg, kind).await.map_err(OpenError::Connect)?;
        let (writer, writer_link) = match writer {
            Some((c, l)) => (Arc::new(c), Some(l)),
            None => (client.clone(), None),
        };
        let session = Session::new(link.canceller.clone());
        let writer_session =
            writer_link.as_ref().map_or_else(|| session.clone(), |l| Session::new(l.canceller.clone()));
        let timeout = cfg.statement_timeout;
        tokio::pin!(stop);
        let prepared = async {
            let reader = (cfg.reader.clone(), cfg.ack_commit);
            let work = WorkSession::prepare(client, session, timeout, kind, reader, &mut stop).await?;
            let reader = (cfg.reader.clone(), work.claim_checkpoint(), cfg.ack_commit);
            Ok((work, WriterSession::prepare(writer, writer_session, timeout, reader, &mut stop).await?))
        };
        let (work, writer) = match prepared.await {
            Ok(p) => p,
            Err(e) => {
                link.handle.abort();
                if let Some(l) = writer_link {
                    l.handle.abort();
                }
                return Err(OpenError::Statement(e));
            }
        };
        self.generation += 1;
        self.conn = Some(Conn { work, writer, link, writer_link });
        self.reconnect_at = None;
        Ok(())
    }

    /// The sessions opened are ready (what the source takes on them is
    /// taken): the reconnect backoff starts over once they have stayed up
    /// long enough ([`Backoff`]).
    pub(super) fn ready(&mut self) {
        self.backoff.ready(Instant::now());
    }

    /// Connect the work session (the first connection, once) and, unless
    /// writes go on the work session (a claim's, `FetchKind::Claim`), the
    /// writer.
    async fn connect(
        &mut self,
        cfg: &ConsumerConfig,
        kind: FetchKind,
    ) -> Result<(Arc<Client>, Link, Option<Connected>), Error> {
        let settings = cfg.session();
        let (client, link) = match self.first.take() {
            Some(first) => first,
            None => crate::connect::connect(&cfg.pg, "pg-outbox drain", &settings).await?,
        };
        if kind == FetchKind::Claim {
            return Ok((Arc::new(client), link, None));
        }
        match crate::connect::connect(&cfg.pg, "pg-outbox writer", &settings).await {
            Ok(writer) => Ok((Arc::new(client), link, Some(writer))),
            Err(e) => {
                link.handle.abort();
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_starts_near_100ms_doubles_and_never_waits_longer_than_the_bound() {
        for max in
            [Duration::from_secs(10), Duration::from_secs(1), Duration::from_millis(150), Duration::from_millis(10)]
        {
            let waits: Vec<Duration> = new_backoff(max).take(40).collect();
            assert!(waits.iter().all(|w| *w <= max), "{max:?}: {waits:?}");
            assert!(waits[0] <= Duration::from_millis(200), "{max:?}: first {:?}", waits[0]);
            // Once at the bound, between half of it and all of it.
            assert!(waits[30..].iter().all(|w| *w >= max / 2), "{max:?}: {waits:?}");
        }
        let waits: Vec<Duration> = new_backoff(Duration::from_secs(10)).take(3).collect();
        assert!(waits[0] >= Duration::from_millis(100) && waits[2] >= Duration::from_millis(400), "{waits:?}");
    }
    #[test]
    fn sessions_lost_soon_after_opening_keep_the_backoff_growing_and_a_long_life_starts_it_over() {
        let max = Duration::from_secs(10);
        let mut b = Backoff::new(max);
        let t0 = Instant::now();
        // A permanent error right after each opening: 100-200 ms, then
        // longer each time, up to the bound.
        let mut waits = Vec::new();
        for i in 0..8 {
            b.ready(t0 + Duration::from_secs(i));
            waits.push(b.next_delay(t0 + Duration::from_secs(i) + Duration::from_millis(50)));
        }
        assert!(waits[0] <= Duration::from_millis(200), "{waits:?}");
        assert!(waits[5] >= Duration::from_millis(3_200) && waits[7] >= max / 2, "growing: {waits:?}");
        // Up for the bound or longer: the next loss waits 100-200 ms again.
        b.ready(t0 + Duration::from_secs(100));
        let after_long_life = b.next_delay(t0 + Duration::from_secs(100) + max);
        assert!(after_long_life <= Duration::from_millis(200), "{after_long_life:?}");
        // A failed opening (never ready) keeps growing too.
        let next = b.next_delay(t0 + Duration::from_secs(200));
        assert!(next >= Duration::from_millis(200), "{next:?}");
    }
}

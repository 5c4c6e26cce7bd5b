//! The session service: the drain loop's database sessions and reconnecting.
//!
//! Two sessions, opened together and given up together: the work session
//! fetches (and holds the mode's advisory locks), the writer writes
//! acknowledgements and failures while the work session goes on fetching.
//! In competing mode the writes go on the work session itself, inside the
//! claim transaction. Each opening is a new generation, so the outcome of a
//! write is tied to the sessions it ran on. A lost session is given up at
//! once (its locks are gone) and opened again after an exponential backoff
//! with jitter (`backon`), from 100 ms up to the reconnect maximum.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use tokio::time::Instant;
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;

use super::statement::{self, Kind, Session, StatementError};
use super::{ConsumerConfig, Mode};
use crate::connect::Link;
use crate::error::Error;
use crate::store;

/// Open sessions and their prepared statements.
pub(super) struct Conn {
    pub(super) client: Arc<Client>,
    link: Link,
    /// The work session's cancel requests and statements in flight.
    pub(super) session: Session,
    pub(super) fetch: Statement,
    pub(super) next_retry: Statement,
    /// The session acknowledgements and failures are written on: a second
    /// session, or the work session itself in competing mode.
    pub(super) writer: Arc<Client>,
    /// The second session's connection task (`None` in competing mode).
    writer_link: Option<Link>,
    /// The writer session's cancel requests and statements in flight (the
    /// work session's in competing mode).
    pub(super) writer_session: Session,
    pub(super) ack: Statement,
    pub(super) fail: Statement,
    /// Statement timeout of both sessions (zero: none).
    pub(super) timeout: Duration,
}

impl Conn {
    /// Run `fut` (statements of `kind` on the work session) until `stop`
    /// resolves (see [`statement::run`]).
    pub(super) async fn run<T>(
        &self,
        kind: Kind,
        stop: impl Future<Output = ()>,
        fut: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, StatementError> {
        statement::run(kind, &self.session, self.timeout, stop, fut).await
    }

    /// Tokens cancelled when the work session's connection, or the writer's,
    /// ends.
    pub(super) fn closed(&self) -> (CancellationToken, Option<CancellationToken>) {
        (self.link.closed.clone(), self.writer_link.as_ref().map(|l| l.closed.clone()))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The sessions are given up (an error, a lost connection, the end):
        // a statement of theirs still running is cancelled, so it does not
        // run on at the server after its session is closed here.
        if self.session.busy() {
            self.session.cancel_in_background();
        }
        if self.writer_link.is_some() && self.writer_session.busy() {
            self.writer_session.cancel_in_background();
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
    backoff: backon::ExponentialBackoff,
    reconnect_at: Option<Instant>,
    max_delay: Duration,
}

fn new_backoff(max: Duration) -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(max)
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
            backoff: new_backoff(max_delay),
            reconnect_at: Some(Instant::now()),
            max_delay,
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
        self.backoff.next().unwrap_or(self.max_delay)
    }

    /// Give the sessions up (closing them) and open them again after `delay`.
    pub(super) fn close(&mut self, delay: Duration) {
        self.conn = None;
        self.reconnect_at = Some(Instant::now() + delay);
    }

    /// Open the work and writer sessions and prepare their statements; in
    /// partitioned mode, take the membership lock `member_key`. When `stop`
    /// resolves during preparation, the statement running is cancelled and
    /// the sessions are closed (see [`statement::run`]).
    pub(super) async fn open(
        &mut self,
        cfg: &ConsumerConfig,
        member_key: Option<i32>,
        stop: impl Future<Output = ()>,
    ) -> Result<(), OpenError> {
        let (client, link, writer) = self.connect(cfg).await.map_err(OpenError::Connect)?;
        let (writer, writer_link) = match writer {
            Some((c, l)) => (Arc::new(c), Some(l)),
            None => (client.clone(), None),
        };
        let session = Session::new(link.canceller.clone());
        let writer_session =
            writer_link.as_ref().map_or_else(|| session.clone(), |l| Session::new(l.canceller.clone()));
        let prepared = Prepared::run(cfg, member_key, (&client, &session), (&writer, &writer_session), stop).await;
        let Prepared { fetch, next_retry, ack, fail } = match prepared {
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
        self.conn = Some(Conn {
            client,
            link,
            session,
            fetch,
            next_retry,
            writer,
            writer_link,
            writer_session,
            ack,
            fail,
            timeout: cfg.statement_timeout,
        });
        self.backoff = new_backoff(self.max_delay);
        self.reconnect_at = None;
        Ok(())
    }

    /// Connect the work session (the first connection, once) and, except in
    /// competing mode, the writer.
    async fn connect(&mut self, cfg: &ConsumerConfig) -> Result<(Arc<Client>, Link, Option<Connected>), Error> {
        let settings = cfg.session();
        let (client, link) = match self.first.take() {
            Some(first) => first,
            None => crate::connect::connect(&cfg.pg, "pg-outbox drain", &settings).await?,
        };
        if matches!(cfg.mode, Mode::Competing) {
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

/// The sessions' prepared statements.
struct Prepared {
    fetch: Statement,
    next_retry: Statement,
    ack: Statement,
    fail: Statement,
}

impl Prepared {
    /// Prepare the work session's statements (the mode's fetch, the
    /// earliest-retry read; in partitioned mode the membership lock
    /// `member_key` is taken) and the writer's (acknowledge, fail), until
    /// `stop` resolves.
    async fn run(
        cfg: &ConsumerConfig,
        member_key: Option<i32>,
        (client, session): (&Client, &Session),
        (writer, writer_session): (&Client, &Session),
        stop: impl Future<Output = ()>,
    ) -> Result<Prepared, StatementError> {
        let timeout = cfg.statement_timeout;
        tokio::pin!(stop);
        let work = async {
            // How the fetch measures payloads depends on the server's
            // functions (store::PayloadSizes); read per session, so a
            // reconnect to another server prepares what that one has.
            let version: i32 = client.query_one(store::schema::SERVER_VERSION, &[]).await?.try_get("num")?;
            let sizes = store::PayloadSizes::for_server(version);
            let fetch_sql = match cfg.mode {
                Mode::Single => store::fetch_sql(false, sizes),
                Mode::Partitioned { .. } => store::fetch_sql(true, sizes),
                Mode::Competing => store::competing_fetch_sql(sizes),
            };
            let fetch = client.prepare(&fetch_sql).await?;
            let next_retry = client.prepare(store::NEXT_RETRY_IN).await?;
            if let Some(key) = member_key {
                client.execute(store::MEMBER_LOCK, &[&store::locks::MEMBER_CLASS, &key]).await?;
            }
            Ok((fetch, next_retry))
        };
        let (fetch, next_retry) = statement::run(Kind::SessionSetup, session, timeout, &mut stop, work).await?;
        let write = async { Ok((writer.prepare(store::ACK).await?, writer.prepare(store::FAIL).await?)) };
        let (ack, fail) = statement::run(Kind::SessionSetup, writer_session, timeout, &mut stop, write).await?;
        Ok(Prepared { fetch, next_retry, ack, fail })
    }
}

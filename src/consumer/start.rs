//! Starting a consumer: the wiring of its tasks and channels.

use std::sync::Arc;

use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::session::new_backoff;
use super::source::{ClaimFetch, Notified, OrderedFetch, Signals, WakeKind, Wakeups, notifier};
#[cfg(feature = "wal")]
use super::source::{Streamed, wal};
use super::stream::{Shared, StreamParts};
use super::{
    ConsumerBuilder, ConsumerConfig, EventStream, HealthMonitor, ListenerStatus, Mode, PROBE_TIMEOUT, SourceKind,
    drain, health, holdback,
};
use crate::connect;
use crate::error::{Error, Result};
use crate::store::NOTIFY_CHANNEL;

impl ConsumerBuilder {
    /// Connect, check the schema, LISTEN (or open the WAL source's
    /// replication connection and slot), and start the background tasks.
    ///
    /// Spawns two tasks on the current Tokio runtime: the notifier (a
    /// dedicated LISTEN connection that never opens a transaction; with
    /// `SourceKind::Wal`, the replication stream's reader) and the
    /// drain loop (fetch, hand out, write acknowledgements in batches). A
    /// first drain runs at once.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) for out-of-range settings; [`Error::Connect`](crate::Error::Connect) if the
    /// database cannot be reached (the first connection fails fast; later
    /// losses are retried with backoff); [`Error::NotMigrated`](crate::Error::NotMigrated) if the
    /// schema has not been migrated; [`Error::SharedSessions`](crate::Error::SharedSessions) if
    /// the URL leads to a transaction-mode pooler
    /// ([`ConnectOptions::session_mode`](crate::ConnectOptions::session_mode)):
    /// the consumer's locks, prepared statements and settings belong to its
    /// sessions, so it needs a direct URL or a session-mode pooler's;
    /// [`Error::ReadOnlyStandby`](crate::Error::ReadOnlyStandby) if the
    /// server is a hot standby (it needs the primary), unless it waits for a
    /// promotion ([`ConsumerBuilder::wait_for_primary`]);
    /// [`Error::ReplicationSetup`](crate::Error::ReplicationSetup) with the
    /// WAL source when the server lacks what it needs (the message names
    /// what to change).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future before it resolves closes the sessions it
    /// opened (and with them any lock they took); nothing was fetched yet.
    pub async fn start(self) -> Result<EventStream> {
        let subscription = self.cfg.reader.subscription().map(Arc::<str>::from);
        crate::metrics::for_subscription(subscription, self.start_labelled()).await
    }

    /// [`Self::start`], run with the subscription's metrics label
    /// ([`crate::metrics::for_subscription`]): the tasks it spawns keep it.
    async fn start_labelled(mut self) -> Result<EventStream> {
        self.validate()?;
        if self.cfg.source != SourceKind::Listen {
            // The stream wakes the drain loop: register as never waiting,
            // so producers skip NOTIFY.
            self.cfg.listen = false;
        }
        let cfg = Arc::new(self.cfg);
        let (work, work_link) = first_session(&cfg).await?;
        crate::migrate::check(&work).await?;
        check_leadership(&cfg, &work).await?;
        let ordering = check_ordering(&cfg, &work).await?;
        let signals = Signals::default();
        let (status_tx, status_rx) = watch::channel(ListenerStatus::default());
        let token = CancellationToken::new();
        // The WAL source tells its stream reader when to stream (not while
        // it stands by).
        #[cfg(feature = "wal")]
        let (wanted_tx, wanted_rx) = watch::channel(true);
        let notifier = match cfg.source {
            SourceKind::Listen => start_notifier(&cfg, &work, signals.clone(), token.child_token(), status_tx).await?,
            #[cfg(feature = "wal")]
            SourceKind::Wal => {
                Some(start_wal(&cfg, &work, signals.clone(), token.child_token(), status_tx, wanted_rx).await?)
            }
        };
        let (tx, rx) = mpsc::channel(cfg.buffer);
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            holdback: holdback::HoldBack::default(),
            settle_tx,
            reader_waiting: Notify::new(),
            lease: Default::default(),
        });
        let io = drain::Io { tx, settle_rx, shared: shared.clone() };
        let health = HealthMonitor::new(Arc::new(health::State::new(&cfg)), status_rx.clone());
        let engine = Starter { first: (work, work_link), io, token: token.clone(), state: health.state().clone() };
        #[cfg(feature = "wal")]
        let drain = engine.spawn(&cfg, signals, wanted_tx);
        #[cfg(not(feature = "wal"))]
        let drain = engine.spawn(&cfg, signals);
        Ok(EventStream::new(StreamParts {
            rx,
            shared,
            token,
            tasks: (drain, notifier),
            status: status_rx,
            health,
            grace: cfg.shutdown_grace,
            order: super::stream::OrderFacts {
                mode: cfg.mode,
                ordering,
                producers_lock: cfg.producers_lock_aggregates,
            },
            subscription: cfg.reader.subscription().map(Arc::<str>::from),
        }))
    }
}

/// Check that the URL leads to sessions of the consumer's own, and open
/// the work session on a writable server; with `wait_for_primary`, wait
/// (with the reconnect backoff) while the server is a standby.
async fn first_session(cfg: &ConsumerConfig) -> Result<(tokio_postgres::Client, connect::Link)> {
    let attempt = || async {
        // The leader and partition locks, the prepared statements and the
        // settings of the drain loop are its sessions'.
        connect::require_own_sessions(&cfg.pg, "the relay (pg-outbox's consumer)").await?;
        connect::connect(&cfg.pg, "pg-outbox drain", &cfg.session()).await
    };
    let mut backoff = new_backoff(cfg.reconnect_max_delay);
    let mut waited = None;
    loop {
        match attempt().await {
            Err(Error::ReadOnlyStandby { target }) if cfg.wait_for_primary => {
                let delay = backoff.next().unwrap_or(cfg.reconnect_max_delay).min(cfg.reconnect_max_delay);
                if waited.is_none() {
                    tracing::warn!(signal = "awaiting_promotion", standby = %target, retry_every_at_most = ?cfg.reconnect_max_delay,
                        "the database is a read-only standby (in recovery): waiting for a promotion before starting");
                    waited = Some(tokio::time::Instant::now());
                } else {
                    tracing::debug!(retry_in = ?delay, "still a read-only standby");
                }
                tokio::time::sleep(delay).await;
            }
            Ok(session) => {
                if let Some(since) = waited {
                    tracing::info!(waited = ?since.elapsed(), "the database accepts writes now (promoted): starting");
                }
                return Ok(session);
            }
            Err(e) => return Err(e),
        }
    }
}

/// What the drain loop starts with: the first work session, the channels
/// to the stream, the stop, the health state.
struct Starter {
    first: (tokio_postgres::Client, connect::Link),
    io: drain::Io,
    token: CancellationToken,
    state: Arc<health::State>,
}

impl Starter {
    /// Spawn the drain loop over the source of `cfg`'s source kind and
    /// mode, woken by `signals` (the WAL source streams while `wanted` says
    /// so).
    fn spawn(
        self,
        cfg: &Arc<ConsumerConfig>,
        signals: Signals,
        #[cfg(feature = "wal")] wanted: watch::Sender<bool>,
    ) -> JoinHandle<Result<()>> {
        match cfg.source {
            SourceKind::Listen => self.spawn_with(cfg, signals, Notified),
            #[cfg(feature = "wal")]
            SourceKind::Wal => self.spawn_with(cfg, signals, Streamed::new(wanted)),
        }
    }

    /// Spawn the drain loop over wake-ups of `kind` and the fetch of
    /// `cfg`'s mode. One engine per pair of types: the calls into the
    /// source are static.
    fn spawn_with<K: WakeKind + 'static>(
        self,
        cfg: &Arc<ConsumerConfig>,
        signals: Signals,
        kind: K,
    ) -> JoinHandle<Result<()>> {
        let Starter { first, io, token, state } = self;
        let competing = cfg.mode == Mode::Competing;
        let wakeups = Wakeups::new(cfg, signals, competing, kind);
        if competing {
            crate::metrics::spawn(drain::run(cfg.clone(), (wakeups, ClaimFetch::default()), first, io, token, state))
        } else {
            crate::metrics::spawn(drain::run(cfg.clone(), (wakeups, OrderedFetch::new(cfg)), first, io, token, state))
        }
    }
}

impl ConsumerConfig {
    /// How it delivers, as the relays' configuration check names it
    /// (`crate::store::leader::check_configuration`): `single`,
    /// `partitioned N` or `competing`.
    pub(crate) fn delivery_configuration(&self) -> String {
        match self.mode {
            Mode::Single => "single".to_string(),
            Mode::Partitioned { partitions } => format!("partitioned {partitions}"),
            Mode::Competing => "competing".to_string(),
        }
    }
}

/// No relay of another configuration delivers this outbox (a competing
/// relay beside a single or partitioned one delivers every event twice);
/// in single and partitioned mode, the role may take terms.
///
/// # Errors
/// [`Error::Config`] naming what to change; [`Error::Db`] when the
/// catalog cannot be read.
async fn check_leadership(cfg: &ConsumerConfig, work: &tokio_postgres::Client) -> Result<()> {
    let mine = cfg.delivery_configuration();
    if cfg.mode != Mode::Competing {
        crate::store::leader::check_term_privileges(work).await?;
    }
    if let Some(name) = cfg.reader.subscription() {
        // A subscription's leadership is its own: the outbox's
        // configuration does not bind it, its own relays' does.
        crate::store::leader::check_configuration(work, &cfg.reader, &mine).await?;
        let state = crate::store::subscription::check(work, name).await?;
        if state == "paused" {
            tracing::warn!(subscription = name, state = %state,
                "subscription {name:?} is paused: nothing is delivered until `pg-outbox subscription resume {name}`");
        } else {
            tracing::info!(subscription = name, state = %state, "reading subscription {name:?} ({state})");
        }
        return Ok(());
    }
    crate::store::leader::check_configuration(work, &cfg.reader, &mine).await
}

/// The ordering mode installed on `events.outbox`, logged: at warn when no
/// insert trigger is enabled for a LISTEN consumer (the sweep alone finds
/// new events, and racing producers can commit out of order), or when the
/// trigger was stopped for the WAL source.
///
/// # Errors
/// [`crate::Error::Db`] when the catalog cannot be read.
async fn check_ordering(
    cfg: &ConsumerConfig,
    work: &tokio_postgres::Client,
) -> Result<Option<crate::migrate::OrderingMode>> {
    let ordering = crate::migrate::ordering(work).await?;
    match ordering {
        Some(mode) => {
            tracing::info!(signal = "ordering", ordering = %mode, "ordering mode installed on events.outbox: {mode}")
        }
        None if cfg.source != SourceKind::Listen => tracing::info!(
            "no insert trigger is enabled on events.outbox: per-aggregate order rests on the producers' own \
             lock (the producer-locked contract, README \"Ordering modes\")"
        ),
        None => tracing::warn!(
            "no insert trigger is enabled on events.outbox: new events are found by the sweep only, and \
             racing producers can commit an aggregate's events out of order; enable one with \
             `pg-outbox migrate --ordering outbox-locked`"
        ),
    }
    if cfg.source == SourceKind::Listen
        && cfg.listen
        && ordering.is_some()
        && !crate::store::schema::insert_trigger_fires(work).await?
    {
        tracing::warn!(
            signal = "sweep_only",
            sweep_interval = ?cfg.sweep_interval,
            "the insert trigger was stopped for the WAL source (`pg-outbox migrate --source wal`): producers \
             send no NOTIFY, so this LISTEN consumer finds new events by the sweep only; run it with the WAL \
             source (`relay --source wal`), or `pg-outbox migrate --source listen`"
        );
    }
    Ok(ordering)
}

/// Check that the server can stream inserts to the WAL source, open the
/// first replication connection and its slot (before the drain loop's
/// first fetch, so nothing commits unseen in between), and spawn the
/// stream reader.
#[cfg(feature = "wal")]
async fn start_wal(
    cfg: &Arc<ConsumerConfig>,
    work: &tokio_postgres::Client,
    signals: Signals,
    token: CancellationToken,
    status_tx: watch::Sender<ListenerStatus>,
    wanted: watch::Receiver<bool>,
) -> Result<JoinHandle<()>> {
    crate::metrics::gauge!(crate::metrics::LISTEN_ENABLED).set(0.0);
    // The replication client's rustls has aws-lc-rs beside ring (its
    // tokio-rustls default features): name the process's provider before
    // anything builds a config from the default (the client installs ring
    // too, when it connects with TLS).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pg = cfg.listener_pg.clone().unwrap_or_else(|| cfg.pg.clone());
    let first = wal::first(&pg, work).await?;
    crate::metrics::gauge!(crate::metrics::NOTIFICATIONS_WORKING).set(if first.is_some() { 1.0 } else { 0.0 });
    Ok(wal::spawn(wal::WalReader { pg, first, signals, token, status: status_tx, cfg: cfg.clone(), wanted }))
}

/// Start the notifier (LISTEN on its own session) unless LISTEN is off,
/// after checking that a notification sent on `work` comes back: when none
/// does within [`PROBE_TIMEOUT`] (a transaction-mode pooler, a replica), the
/// consumer runs on sweeps alone and says so.
async fn start_notifier(
    cfg: &Arc<ConsumerConfig>,
    work: &tokio_postgres::Client,
    signals: Signals,
    token: CancellationToken,
    status_tx: watch::Sender<ListenerStatus>,
) -> Result<Option<JoinHandle<()>>> {
    crate::metrics::gauge!(crate::metrics::LISTEN_ENABLED).set(if cfg.listen { 1.0 } else { 0.0 });
    if !cfg.listen {
        crate::metrics::gauge!(crate::metrics::NOTIFICATIONS_WORKING).set(0.0);
        tracing::info!(sweep_interval = ?cfg.sweep_interval, "LISTEN disabled: sweep-only mode");
        return Ok(None);
    }
    let listener_pg = cfg.listener_pg.clone().unwrap_or_else(|| cfg.pg.clone());
    // The test notification this consumer expects back; the listener
    // empties it when it arrives (and ignores other consumers' probes).
    let probe = format!("{}{}", notifier::PROBE_PREFIX, Uuid::new_v4());
    let (probe_tx, mut probe_rx) = watch::channel(probe.clone());
    let wake = signals.notification.clone();
    let first = notifier::listen(&listener_pg, &cfg.session(), wake, probe_tx.clone()).await?;
    crate::store::notify(work, NOTIFY_CHANNEL, &probe).await?;
    let came_back = tokio::time::timeout(PROBE_TIMEOUT, probe_rx.wait_for(String::is_empty)).await.is_ok();
    crate::metrics::gauge!(crate::metrics::NOTIFICATIONS_WORKING).set(if came_back { 1.0 } else { 0.0 });
    status_tx.send_modify(|s| s.notifications_work = Some(came_back));
    if came_back {
        tracing::info!(channel = NOTIFY_CHANNEL, "notifications work: LISTEN connection receives them");
    } else {
        tracing::warn!(
            channel = NOTIFY_CHANNEL,
            sweep_interval = ?cfg.sweep_interval,
            "a test notification did not come back within {PROBE_TIMEOUT:?} (transaction-mode pooler? replica?): \
             running in sweep-only mode; events may wait up to one sweep interval"
        );
    }
    let cfg = cfg.clone();
    let n = notifier::Notifier { pg: listener_pg, first, signals, probe: probe_tx, token, status: status_tx, cfg };
    Ok(Some(crate::metrics::spawn(notifier::run(n))))
}

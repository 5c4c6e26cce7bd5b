//! The WAL source: wake-ups from the server's logical replication stream
//! instead of NOTIFY, so producers need no insert trigger.
//!
//! The table stays the truth. The stream only says that inserts into
//! `events.outbox` committed; the engine then fetches due rows in id order
//! exactly as the listen source does, with hold-back, retries, the byte
//! bound, leadership and the sweep unchanged. So the replication slot
//! records nothing the consumer needs back:
//!
//! - the slot is **temporary**, created on the replication connection
//!   itself with a random name (`pg_outbox_` and 16 hex digits): the server
//!   drops it when the connection ends, so no WAL is kept while no consumer
//!   runs;
//! - everything read is confirmed at once: each commit's end, and each
//!   keepalive's WAL end (else WAL piles up while the stream is quiet);
//! - on every (re)connect the slot comes first, and only then the drain
//!   loop is woken to sweep the table (`Wake::Reconnect`): events committed
//!   before the slot existed are found by that sweep, the rest arrive on
//!   the stream, and the in-flight set removes the overlap (the listen
//!   source's "LISTEN first, then sweep");
//! - a wake-up follows a commit that held an insert, never a bare commit
//!   (before PostgreSQL 15 every transaction of the database arrives as an
//!   empty BEGIN/COMMIT pair);
//! - logical decoding sends a commit once its WAL is flushed, which can be
//!   a moment before the transaction is visible to other sessions (and as
//!   long as a synchronous standby takes to confirm it): a wake-up whose
//!   drain finds nothing is followed by further looks after 2, 10, 50 and
//!   200 ms ([`WAL_RECHECKS`]); anything later still is found by the sweep;
//! - creating the slot waits for every write transaction running in the
//!   cluster (the snapshot builder's wait for a consistent point); the
//!   replication connection's `lock_timeout` ([`SLOT_LOCK_TIMEOUT`]) bounds
//!   that wait, and when it expires the consumer logs which wait it was and
//!   tries again with backoff, meanwhile finding events by the sweep;
//! - a standby of single mode holds no stream: every WAL sender decodes all
//!   of the database's WAL, on the server the producers use, so a standby's
//!   would cost them as much as the leader's for nothing. The stream opened
//!   at start (which checks that this consumer can stream at all) is closed,
//!   with its slot, once the consumer finds another holds the outbox, and
//!   opened again the moment it leads: slot first, then a sweep, as on a
//!   reconnect.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::config::Host;
use tokio_util::sync::CancellationToken;

use super::{Leadership, Signals, Wake, WakeKind};
use crate::connect::{self, RootCert, SslMode};
use crate::consumer::session::new_backoff;
use crate::consumer::{ConsumerConfig, ListenerStatus};
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::store::replication::{self, PUBLICATION};

/// The replication connection's `lock_timeout`, which bounds how long
/// creating the slot waits for the write transactions running in the
/// cluster: 10 s.
pub(crate) const SLOT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// The start of the error when creating the slot waited out
/// [`SLOT_LOCK_TIMEOUT`].
const SLOT_WAIT: &str = "the slot is not ready";

/// Did opening fail because creating the slot waited out its
/// `lock_timeout` (a long write transaction)?
fn is_slot_wait(e: &Error) -> bool {
    matches!(e, Error::Io(io) if io.to_string().starts_with(SLOT_WAIT))
}

/// Opening the replication connection and creating the slot give up after
/// this long (the slot's own wait is bounded by [`SLOT_LOCK_TIMEOUT`]).
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// How often what was read is confirmed to the server (the crate sends a
/// raised position within this interval): 1 s.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// Messages the replication client may hold for the reader (which only
/// reads each one's type): 256. Each is at most one row (its `id` alone
/// from PostgreSQL 15, the whole row on 14), so this bounds the stream's
/// memory.
const STREAM_BUFFER: usize = 256;

/// After a wake-up from the stream whose drain found nothing, look again
/// after each of these delays (the commit may not be visible yet), until a
/// look finds events.
pub(crate) const WAL_RECHECKS: [Duration; 4] =
    [Duration::from_millis(2), Duration::from_millis(10), Duration::from_millis(50), Duration::from_millis(200)];

/// A random slot name: `pg_outbox_` and 16 hex digits.
fn slot_name() -> String {
    format!("pg_outbox_{:016x}", rand::random::<u64>())
}

/// The replication connection's settings for host `host` (with `port`) of
/// `pg` and slot `slot`: the URL's user, password (given, or the password
/// file's), database, and its TLS mode mapped to the crate's (`allow` and
/// `prefer` try TLS first; `require` with a root certificate checks the
/// chain, as libpq does; `verify-ca` and `verify-full` without
/// `sslrootcert` use `~/.postgresql/root.crt`; `sslrootcert=system` uses
/// the Mozilla roots the crate carries).
fn replication_config(pg: &connect::ConnectOptions, host: &Host, port: u16, slot: &str) -> Result<ReplicationConfig> {
    let user = pg.user().ok_or_else(|| Error::Config("the WAL source needs a user name".into()))?;
    let db = pg.dbname().unwrap_or(user);
    let password = pg.resolved_password().unwrap_or_default();
    let cfg = match host {
        Host::Unix(dir) => {
            ReplicationConfig::unix(dir.display().to_string(), port, user, password, db, slot, PUBLICATION)
        }
        Host::Tcp(host) => {
            let root = |r: Option<&RootCert>| match r {
                Some(RootCert::File(p)) => Some(p.clone()),
                Some(RootCert::System) => None,
                None => std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".postgresql/root.crt")),
            };
            let given = pg.root_cert();
            let tls = match pg.ssl_mode() {
                SslMode::Disable => TlsConfig::disabled(),
                SslMode::Allow | SslMode::Prefer => {
                    TlsConfig { mode: pgwire_replication::SslMode::Prefer, ..TlsConfig::disabled() }
                }
                SslMode::Require => match given {
                    Some(RootCert::File(p)) => TlsConfig::verify_ca(Some(p.clone())),
                    _ => TlsConfig::require(),
                },
                SslMode::VerifyCa => TlsConfig::verify_ca(root(given)),
                SslMode::VerifyFull => TlsConfig::verify_full(root(given)),
            };
            ReplicationConfig::new(host.clone(), user, password, db, slot, PUBLICATION).with_port(port).with_tls(tls)
        }
    };
    Ok(cfg
        .with_start_lsn(Lsn::ZERO)
        .with_status_interval(STATUS_INTERVAL)
        .with_buffer_size(STREAM_BUFFER)
        .with_options(format!("-c lock_timeout={}", SLOT_LOCK_TIMEOUT.as_millis()))
        .with_application_name(pg.application_name().unwrap_or("pg-outbox wal")))
}

/// The hosts of `pg` with their ports, in the URL's order (one port for
/// all, or one each; 5432 when none is given).
fn hosts(pg: &connect::ConnectOptions) -> Result<Vec<(Host, u16)>> {
    let ports = pg.ports();
    let hosts = pg.hosts();
    if hosts.is_empty() {
        return Err(Error::Config("the WAL source needs a host name or socket directory (not hostaddr alone)".into()));
    }
    Ok(hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (h.clone(), ports.get(i).or(ports.first()).copied().unwrap_or(5432)))
        .collect())
}

/// Why the replication connection could not be opened, in the words of
/// what to change where the server's error says it.
fn open_error(e: pgwire_replication::PgWireError, slot: &str) -> Error {
    let text = e.to_string();
    if text.contains("must be superuser or replication role") || text.contains("permission denied to start WAL sender")
    {
        return Error::ReplicationSetup(format!(
            "the server refused a replication connection ({text}): grant the user the REPLICATION privilege \
             (ALTER ROLE ... REPLICATION; Amazon RDS: GRANT rds_replication TO ...), and allow it in \
             pg_hba.conf"
        ));
    }
    if text.contains("lock timeout") {
        return Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "{SLOT_WAIT}: creating the replication slot {slot} waited {SLOT_LOCK_TIMEOUT:?} for write \
                 transactions running in the cluster to end (a new slot needs them to; see pg_stat_activity for \
                 long transactions)"
            ),
        ));
    }
    Error::Io(std::io::Error::other(format!("replication connection: {text}")))
}

/// Open a replication connection for `pg` on the first of its hosts that
/// is not a standby (a multi-host URL after a failover), create a temporary
/// slot on it, and start streaming the publication from the slot's
/// consistent point.
async fn open(pg: &connect::ConnectOptions) -> Result<(ReplicationClient, String)> {
    let slot = slot_name();
    let mut last = None;
    for (host, port) in hosts(pg)? {
        let cfg = replication_config(pg, &host, port, &slot)?;
        let opening = async {
            let mut client = ReplicationClient::connect_gated(cfg).await.map_err(|e| open_error(e, &slot))?;
            let rows = client.simple_query("SELECT pg_is_in_recovery()").await.map_err(|e| open_error(e, &slot))?;
            if rows.first().and_then(|r| r.first()).and_then(Option::as_ref).is_some_and(|v| v.as_ref() == b"t") {
                return Ok(None);
            }
            client.simple_query(&replication::create_slot_command(&slot)).await.map_err(|e| open_error(e, &slot))?;
            client.start().await.map_err(|e| open_error(e, &slot))?;
            client.wait_started().await.map_err(|e| open_error(e, &slot))?;
            Ok::<_, Error>(Some(client))
        };
        let target = match &host {
            Host::Tcp(h) => format!("{h}:{port}"),
            Host::Unix(d) => format!("{}:{port}", d.display()),
        };
        match tokio::time::timeout(OPEN_TIMEOUT, opening).await {
            Ok(Ok(Some(client))) => return Ok((client, slot)),
            Ok(Ok(None)) => last = Some(Error::ReadOnlyStandby { target }),
            Ok(Err(e @ Error::ReplicationSetup(_))) => return Err(e),
            Ok(Err(e)) => last = Some(e),
            Err(_) => {
                last = Some(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("opening the replication connection to {target} took more than {OPEN_TIMEOUT:?}"),
                )))
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::Config("the WAL source found no host to connect to".into())))
}

/// The first replication connection, opened by `start` before the drain
/// loop runs.
pub(crate) struct Streaming {
    client: ReplicationClient,
    slot: String,
}

/// Check on `work` that the server can stream (wal_level, privilege, free
/// slot and sender, publication), then open the first replication
/// connection and its slot.
///
/// `None` when creating the slot waited out [`SLOT_LOCK_TIMEOUT`] for a
/// long write transaction: the consumer then starts without the stream,
/// finds events by the sweep, and the reader tries again with backoff
/// (logged as a warning).
///
/// # Errors
/// [`Error::ReplicationSetup`] naming what to change; the connection's
/// errors otherwise.
pub(crate) async fn first(pg: &connect::ConnectOptions, work: &tokio_postgres::Client) -> Result<Option<Streaming>> {
    replication::check(work).await?;
    match open(pg).await {
        Ok((client, slot)) => {
            tracing::info!(slot = %slot, publication = PUBLICATION,
                "reading inserts into events.outbox from logical replication (a temporary slot)");
            Ok(Some(Streaming { client, slot }))
        }
        Err(e) if is_slot_wait(&e) => {
            tracing::warn!(signal = "replication_pending", error = %crate::error::report(&e),
                "starting without the replication stream: events are found by the sweep until the slot is created \
                 (tried again with backoff)");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// What the stream reader task is given.
pub(crate) struct WalReader {
    pub(crate) pg: connect::ConnectOptions,
    /// The stream `start` opened, if it could (see [`first`]).
    pub(crate) first: Option<Streaming>,
    pub(crate) signals: Signals,
    pub(crate) token: CancellationToken,
    pub(crate) status: watch::Sender<ListenerStatus>,
    pub(crate) cfg: Arc<ConsumerConfig>,
    /// Whether the consumer wants the stream: false while it stands by
    /// ([`Streamed`] sets it).
    pub(crate) wanted: watch::Receiver<bool>,
}

/// Why a connection's stream ended.
enum Ended {
    /// The consumer is stopping.
    Cancelled,
    /// The consumer stands by: the stream was closed on purpose.
    StandingBy,
    /// The connection was lost, or the server ended the stream (why).
    Lost(String),
}

/// Spawn the stream reader.
pub(crate) fn spawn(r: WalReader) -> JoinHandle<()> {
    crate::metrics::spawn(run(r))
}

/// Read the stream until cancelled: wake the drain loop after each commit
/// that held an insert, confirm what was read, and reconnect with backoff
/// (a new slot, then a sweep) when the connection is lost; close the stream
/// while the consumer stands by, and open it at once when it leads.
async fn run(r: WalReader) {
    let WalReader { pg, first, signals, token, status, cfg, mut wanted } = r;
    let mut current = first;
    if current.is_none() {
        // Not listening, no reconnects, not standing by, no probe.
        status.send_replace(ListenerStatus::default());
    }
    let mut reconnects: u64 = 0;
    let mut backoff = new_backoff(cfg.reconnect_max_delay);
    // Open at once, without the backoff's delay (on taking the lead).
    let mut at_once = false;
    // The stream to open is the first since this consumer took the lead
    // (not a reconnect).
    let mut took_lead = false;
    loop {
        if let Some(streaming) = current.take() {
            if stream(streaming, (&signals, &token, &status), &mut wanted, reconnects).await {
                return;
            }
            backoff = new_backoff(cfg.reconnect_max_delay);
        }
        if !*wanted.borrow_and_update() {
            if !wait_to_lead(&token, &status, &mut wanted).await {
                return;
            }
            at_once = true;
            took_lead = true;
        }
        let delay = backoff.next().unwrap_or(cfg.reconnect_max_delay).min(cfg.reconnect_max_delay);
        if !std::mem::take(&mut at_once) {
            tokio::select! {
                _ = token.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            if !*wanted.borrow() {
                continue;
            }
        }
        match open(&pg).await {
            Ok((client, slot)) => {
                if std::mem::take(&mut took_lead) {
                    tracing::info!(slot = %slot, "replication stream opened on taking the lead; sweeping");
                } else {
                    reconnects += 1;
                    crate::metrics::counter!(m::LISTENER_RECONNECTS).increment(1);
                    tracing::info!(signal = "replication_resumed", reconnects, slot = %slot, "replication connection re-established; sweeping");
                }
                crate::metrics::gauge!(m::NOTIFICATIONS_WORKING).set(1.0);
                current = Some(Streaming { client, slot });
                // The slot is in place: now sweep for what committed before.
                signals.reconnected.notify_one();
            }
            Err(e) => {
                tracing::warn!(error = %crate::error::report(&e), retry_in = ?delay, "replication reconnect failed");
            }
        }
    }
}

/// Stream from `streaming` until it ends, publishing the listener status
/// (`reconnects` so far) and the gauge; `true` when the consumer stops.
async fn stream(
    streaming: Streaming,
    (signals, token, status): (&Signals, &CancellationToken, &watch::Sender<ListenerStatus>),
    wanted: &mut watch::Receiver<bool>,
    reconnects: u64,
) -> bool {
    status.send_replace(ListenerStatus { listening: true, reconnects, standing_by: false, notifications_work: None });
    crate::metrics::gauge!(m::LISTENER_UP).set(1.0);
    let ended = read(streaming, signals, token, wanted).await;
    crate::metrics::gauge!(m::LISTENER_UP).set(0.0);
    let standing_by = matches!(ended, Ended::StandingBy);
    status.send_replace(ListenerStatus { listening: false, reconnects, standing_by, notifications_work: None });
    match ended {
        Ended::Cancelled => return true,
        Ended::StandingBy => {
            tracing::info!("standing by: the replication stream and its slot are closed until this consumer leads");
        }
        Ended::Lost(reason) => {
            tracing::warn!(reason = %reason, "replication connection lost; reconnecting (a new slot, then a sweep)");
        }
    }
    false
}

/// Stand by, no stream open, until the consumer leads (`wanted` turns
/// true): `true` then, `false` when the consumer stops.
async fn wait_to_lead(
    token: &CancellationToken,
    status: &watch::Sender<ListenerStatus>,
    wanted: &mut watch::Receiver<bool>,
) -> bool {
    status.send_modify(|s| {
        s.listening = false;
        s.standing_by = true;
    });
    tokio::select! {
        _ = token.cancelled() => return false,
        led = async { wanted.wait_for(|w| *w).await.is_ok() } => if !led { return false },
    }
    status.send_modify(|s| s.standing_by = false);
    true
}

/// Read one connection's stream until it ends, `token` is cancelled, or
/// the consumer no longer wants it (`wanted` turns false); then close it
/// (the server drops the temporary slot with the connection).
async fn read(
    Streaming { mut client, slot }: Streaming,
    signals: &Signals,
    token: &CancellationToken,
    wanted: &mut watch::Receiver<bool>,
) -> Ended {
    let mut inserts = false;
    loop {
        let event = tokio::select! {
            _ = token.cancelled() => {
                close(client).await;
                return Ended::Cancelled;
            }
            // Not wanted, or the source is gone (the consumer has stopped).
            standing_by = async { wanted.wait_for(|w| !*w).await.is_ok() } => {
                close(client).await;
                return if standing_by { Ended::StandingBy } else { Ended::Cancelled };
            }
            e = client.recv() => e,
        };
        match event {
            Ok(Some(ReplicationEvent::Begin { .. })) => inserts = false,
            Ok(Some(ReplicationEvent::XLogData { data, .. })) => {
                // pgoutput's Insert message ('I'); the publication sends
                // nothing else of events.outbox's rows.
                if data.first() == Some(&b'I') {
                    inserts = true;
                }
            }
            Ok(Some(ReplicationEvent::Commit { end_lsn, .. })) => {
                if std::mem::take(&mut inserts) {
                    crate::metrics::counter!(m::NOTIFICATIONS).increment(1);
                    signals.notification.notify_one();
                }
                client.update_applied_lsn(end_lsn);
            }
            Ok(Some(ReplicationEvent::KeepAlive { wal_end, .. })) => client.update_applied_lsn(wal_end),
            Ok(Some(ReplicationEvent::Message { .. })) => {}
            Ok(Some(ReplicationEvent::StoppedAt { .. })) | Ok(None) => {
                return Ended::Lost(format!("the server ended the stream of slot {slot}"));
            }
            Err(e) => return Ended::Lost(format!("slot {slot}: {e}")),
        }
    }
}

/// End the replication connection: ask the server to stop streaming, wait
/// at most 2 s for it, then drop the connection.
async fn close(mut client: ReplicationClient) {
    client.stop();
    let _ = tokio::time::timeout(Duration::from_secs(2), client.shutdown()).await;
    client.abort();
}

/// Wake-ups by the replication stream (the stream reader's signals), with
/// looks of their own after a wake-up from the stream whose drain found
/// nothing ([`WAL_RECHECKS`]), and the stream closed while this consumer
/// stands by.
#[derive(Debug)]
pub(crate) struct Streamed {
    /// Tells the stream reader whether to stream: not while this consumer
    /// stands by in single mode with a session open (another holds the
    /// outbox); unchanged while it has no session.
    wanted: watch::Sender<bool>,
    /// The drain loop's sessions are open.
    open: bool,
    /// The drain under way began with a wake-up from the stream, and has
    /// found nothing yet.
    awaiting: bool,
    recheck_at: Option<Instant>,
    rechecks_done: usize,
}

impl Streamed {
    /// Wake-ups by the stream, telling its reader through `wanted` when to
    /// stream.
    pub(crate) fn new(wanted: watch::Sender<bool>) -> Self {
        Streamed { wanted, open: false, awaiting: false, recheck_at: None, rechecks_done: 0 }
    }
}

impl WakeKind for Streamed {
    fn woken(&mut self, wake: Wake) {
        if wake == Wake::Notification {
            // A new commit: its own ladder of looks.
            self.awaiting = true;
            self.recheck_at = None;
            self.rechecks_done = 0;
        }
    }

    fn fetched(&mut self, handed: u64) {
        if self.awaiting {
            if handed > 0 {
                self.rechecks_done = 0;
            } else if let Some(delay) = WAL_RECHECKS.get(self.rechecks_done) {
                self.rechecks_done += 1;
                self.recheck_at = Some(Instant::now() + *delay);
            }
            self.awaiting = false;
        }
    }

    fn next_look(&self, open: bool, stopping: bool) -> Option<Instant> {
        self.recheck_at.filter(|_| open && !stopping)
    }

    fn look_due(&mut self, now: Instant) -> bool {
        if self.recheck_at.is_none_or(|t| t > now) {
            return false;
        }
        self.recheck_at = None;
        self.awaiting = true;
        true
    }

    fn session_opened(&mut self) {
        self.open = true;
    }

    fn session_lost(&mut self) {
        self.recheck_at = None;
        self.awaiting = false;
        self.open = false;
    }

    fn stop(&mut self) {
        self.recheck_at = None;
    }

    /// Tell the reader whether to stream: not once the leadership found
    /// another holding the outbox ([`Leadership::stands_by`]), with the
    /// session open (without one, or before its first try for the lock,
    /// nothing is known, and the reader keeps what it has).
    fn led(&mut self, leader: &impl Leadership) {
        if let (true, Some(standing_by)) = (self.open, leader.stands_by()) {
            let want = !standing_by;
            self.wanted.send_if_modified(|w| std::mem::replace(w, want) != want);
        }
    }
}

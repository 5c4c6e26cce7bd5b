//! Health of a running consumer, for liveness and readiness probes.
//!
//! The drain loop stores the time of each of its turns in an atomic (one
//! relaxed store per turn) and takes a short lock only when something an
//! operator would want to know changes: the sessions opened or were lost,
//! what this consumer owns, a database error. `relay::run`
//! adds the sink's side: a delivery in progress, the last outcome. A
//! [`HealthMonitor`] reads all of it into a [`Health`] snapshot.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{ConsumerBuilder, ConsumerConfig, ListenerStatus, Mode};
use crate::connect::ConnectOptions;
use crate::secret::{MASK, Secret};

/// What this consumer does among the consumers of its outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// [`Mode::Single`]: holds the outbox lock and delivers.
    Leader,
    /// [`Mode::Single`]: another consumer holds the outbox lock (or this
    /// one has no session right now); waits to take over.
    Standby,
    /// [`Mode::Partitioned`]: holds these partitions (numbered from 0) of
    /// `partitions`; none while rebalancing or without a session.
    Partitioned {
        /// The partitions held, ascending.
        held: Vec<u32>,
        /// Partitions of the outbox.
        partitions: u32,
    },
    /// [`Mode::Competing`]: claims rows with `FOR UPDATE SKIP LOCKED`.
    Competing,
}

impl Role {
    /// `leader`, `standby`, `partitioned` or `competing`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Leader => "leader",
            Role::Standby => "standby",
            Role::Partitioned { .. } => "partitioned",
            Role::Competing => "competing",
        }
    }
}

/// An error and how long ago it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LastError {
    /// The error, with its causes (`a: b: c`), without secrets, cut to
    /// [`LastError::MAX_MESSAGE_BYTES`].
    pub message: String,
    /// Time since it happened.
    pub age: Duration,
}

impl LastError {
    /// Longest error text a [`Health`] snapshot keeps, in bytes: 512 (cut
    /// at a character boundary).
    pub const MAX_MESSAGE_BYTES: usize = 512;
}

/// The sink's side of a relay's health, as `relay::run`
/// records it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SinkHealth {
    /// How long the oldest delivery in flight has been running (`None`: none
    /// in progress).
    pub in_flight_for: Option<Duration>,
    /// Deliveries that failed since the last one that succeeded (0: the
    /// last delivery succeeded, or none failed yet).
    pub consecutive_failures: u64,
    /// Time since the last delivery the sink took (`None`: none yet).
    pub last_success_age: Option<Duration>,
    /// The last failed delivery's error (`None`: none failed yet).
    pub last_failure: Option<LastError>,
}

/// A snapshot of a consumer's health: [`HealthMonitor::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// The drain loop still turns: it has not ended, and its last turn is
    /// at most [`Health::stall_bound`] ago (plus the shutdown grace while
    /// stopping). See [`Health::stall_bound`].
    pub live: bool,
    /// Time since the drain loop last turned. An idle loop turns at least
    /// once per sweep interval; a busy one many times a second.
    pub since_last_turn: Duration,
    /// How long the drain loop may go without turning before it counts as
    /// stalled: twice the statement timeout (60 s when it is disabled),
    /// plus twice the connect timeout (10 s unless the URL sets one), plus
    /// twice the sweep interval; 142 s with the defaults. A turn waits for
    /// the next wake-up (at most a sweep interval) and then runs a few
    /// statements, of which at most one runs into the statement timeout
    /// (the sessions are given up after it), or opens the two sessions
    /// (one connect timeout each); a turn longer than that is stuck, for
    /// example behind a network path that swallows replies.
    pub stall_bound: Duration,
    /// The drain loop has ended (after shutdown, or a panic).
    pub ended: bool,
    /// Shutdown was requested: the consumer finishes what it has and stops.
    pub stopping: bool,
    /// The work and writer sessions are open.
    pub database_connected: bool,
    /// How long the sessions have been closed (`None` while open, and
    /// before they opened the first time).
    pub disconnected_for: Option<Duration>,
    /// How consumers share the outbox.
    pub mode: Mode,
    /// What this consumer does in that mode.
    pub role: Role,
    /// Whether the consumer has a wake-up connection: it LISTENs
    /// ([`ConsumerBuilder::listen`](crate::ConsumerBuilder::listen)), or it
    /// reads the WAL source's replication stream
    /// ([`ConsumerBuilder::source`](crate::ConsumerBuilder::source)).
    pub listen: bool,
    /// The wake-up connection's state: the LISTEN connection's, or the
    /// replication connection's with the WAL source (never listening when
    /// `listen` is off).
    pub listener: ListenerStatus,
    /// The drain loop's last database error (a lost session, a failed or
    /// timed-out statement, a failed reconnect); kept after recovery.
    pub last_error: Option<LastError>,
    /// The sink's side, when the stream is run by `relay::run`.
    pub sink: Option<SinkHealth>,
}

impl Health {
    /// Ready to work: [`live`](Health::live), not stopping, and the
    /// database sessions open. Says nothing of the sink (see
    /// [`Health::sink`]) or the LISTEN connection (without it events are
    /// found by the sweep).
    pub fn ready(&self) -> bool {
        self.live && !self.stopping && self.database_connected
    }
}

/// Reads a consumer's health: [`EventStream::health`](crate::EventStream::health).
/// Cheap to clone and to read (a few atomic loads and one short lock); it
/// stays valid after the stream is gone (then the drain loop has ended).
#[derive(Debug, Clone)]
pub struct HealthMonitor {
    state: Arc<State>,
    listener: watch::Receiver<ListenerStatus>,
}

impl HealthMonitor {
    pub(crate) fn new(state: Arc<State>, listener: watch::Receiver<ListenerStatus>) -> Self {
        HealthMonitor { state, listener }
    }

    pub(crate) fn state(&self) -> &Arc<State> {
        &self.state
    }

    /// The health now.
    pub fn get(&self) -> Health {
        let s = &self.state;
        let now = Instant::now();
        let since_last_turn = now.saturating_duration_since(s.at(s.last_turn.load(Ordering::Relaxed)));
        let ended = s.ended.load(Ordering::Acquire);
        let stopping = s.stopping.load(Ordering::Acquire);
        let allowed = if stopping { s.stall_bound + s.shutdown_grace } else { s.stall_bound };
        let slow = lock(&s.slow).clone();
        Health {
            live: !ended && since_last_turn <= allowed,
            since_last_turn,
            stall_bound: s.stall_bound,
            ended,
            stopping,
            database_connected: slow.connected,
            disconnected_for: slow.disconnected_since.map(|t| now.saturating_duration_since(t)),
            mode: s.mode,
            role: slow.role,
            listen: s.listen,
            listener: *self.listener.borrow(),
            last_error: slow.last_error.map(|(message, at)| LastError { message, age: now - at }),
            sink: s.sink_health(now),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `msg` cut to [`LastError::MAX_MESSAGE_BYTES`] at a character boundary.
fn cut(mut msg: String) -> String {
    if msg.len() > LastError::MAX_MESSAGE_BYTES {
        let mut end = LastError::MAX_MESSAGE_BYTES;
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        msg.truncate(end);
        msg.push('…');
    }
    msg
}

/// The stall bound of `cfg` (see [`Health::stall_bound`]).
pub(crate) fn stall_bound(cfg: &ConsumerConfig) -> Duration {
    let statement = if cfg.statement_timeout.is_zero() {
        ConsumerBuilder::DEFAULT_STATEMENT_TIMEOUT
    } else {
        cfg.statement_timeout
    };
    let connect = cfg.pg.connect_timeout().filter(|t| !t.is_zero()).unwrap_or(ConnectOptions::DEFAULT_CONNECT_TIMEOUT);
    2 * statement + 2 * connect + 2 * cfg.sweep_interval
}

/// What the drain loop and the relay write, and [`HealthMonitor`] reads.
#[derive(Debug)]
pub(crate) struct State {
    base: Instant,
    stall_bound: Duration,
    shutdown_grace: Duration,
    mode: Mode,
    listen: bool,
    /// Time of the drain loop's last turn, in nanoseconds since `base`.
    last_turn: AtomicU64,
    ended: AtomicBool,
    stopping: AtomicBool,
    slow: Mutex<Slow>,
    sink: SinkState,
    /// The database password, kept out of error texts.
    password: Option<Secret>,
}

/// What changes seldom.
#[derive(Debug, Clone)]
struct Slow {
    connected: bool,
    disconnected_since: Option<Instant>,
    role: Role,
    last_error: Option<(String, Instant)>,
}

impl State {
    pub(crate) fn new(cfg: &ConsumerConfig) -> Self {
        let role = match cfg.mode {
            Mode::Single => Role::Standby,
            Mode::Partitioned { partitions } => Role::Partitioned { held: Vec::new(), partitions },
            Mode::Competing => Role::Competing,
        };
        let password = cfg
            .pg
            .tokio_postgres_config()
            .get_password()
            .filter(|p| !p.is_empty())
            .map(|p| Secret::new(String::from_utf8_lossy(p)));
        State {
            base: Instant::now(),
            stall_bound: stall_bound(cfg),
            shutdown_grace: cfg.shutdown_grace,
            mode: cfg.mode,
            // The WAL source's replication connection is its wake-up
            // connection: reported as the listener.
            listen: cfg.listen || cfg.source != super::SourceKind::Listen,
            last_turn: AtomicU64::new(0),
            ended: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            slow: Mutex::new(Slow { connected: false, disconnected_since: None, role, last_error: None }),
            sink: SinkState::default(),
            password,
        }
    }

    fn nanos(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    fn at(&self, nanos: u64) -> Instant {
        self.base + Duration::from_nanos(nanos)
    }

    /// The drain loop turned.
    pub(crate) fn turned(&self) {
        self.last_turn.store(self.nanos(Instant::now()), Ordering::Relaxed);
    }

    pub(crate) fn stopping(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    pub(crate) fn ended(&self) {
        self.ended.store(true, Ordering::Release);
    }

    /// The sessions opened (`true`) or were given up.
    pub(crate) fn connected(&self, now: bool) {
        let mut slow = lock(&self.slow);
        if now {
            slow.disconnected_since = None;
        } else if slow.connected || slow.disconnected_since.is_none() {
            slow.disconnected_since = Some(Instant::now());
        }
        slow.connected = now;
    }

    pub(crate) fn role(&self, role: Role) {
        lock(&self.slow).role = role;
    }

    /// Keep `msg` (secrets removed, cut) as the last database error.
    pub(crate) fn error(&self, msg: String) {
        let msg = cut(self.scrub(msg));
        lock(&self.slow).last_error = Some((msg, Instant::now()));
    }

    fn scrub(&self, msg: String) -> String {
        match &self.password {
            Some(p) if msg.contains(p.expose()) => msg.replace(p.expose(), MASK),
            _ => msg,
        }
    }
}

/// The sink's side, written by `relay::run` only.
#[cfg_attr(not(feature = "relay"), allow(dead_code))]
impl State {
    /// A relay runs this stream: report the sink's side.
    pub(crate) fn sink_attached(&self) {
        self.sink.attached.store(true, Ordering::Release);
    }

    /// The oldest delivery in flight started `at`; `None`: none is in
    /// flight.
    pub(crate) fn deliveries_in_flight(&self, oldest: Option<Instant>) {
        self.sink.started.store(oldest.map_or(0, |at| self.nanos(at).max(1)), Ordering::Relaxed);
    }

    /// A delivery ended `at`: `Ok`, or failed with this error text.
    pub(crate) fn delivery_ended(&self, at: Instant, outcome: std::result::Result<(), String>) {
        let now = self.nanos(at).max(1);
        match outcome {
            Ok(()) => {
                self.sink.last_ok.store(now, Ordering::Relaxed);
                self.sink.failures.store(0, Ordering::Relaxed);
            }
            Err(msg) => {
                self.sink.failures.fetch_add(1, Ordering::Relaxed);
                *lock(&self.sink.last_failure) = Some((cut(msg), at));
            }
        }
    }
}

/// The sink's side, written by `relay::run`.
#[derive(Debug, Default)]
struct SinkState {
    attached: AtomicBool,
    /// Start of the oldest delivery in flight (nanoseconds since `base`, at
    /// least 1), 0 when none is.
    started: AtomicU64,
    /// End of the last successful delivery, likewise; 0 before the first.
    last_ok: AtomicU64,
    failures: AtomicU64,
    last_failure: Mutex<Option<(String, Instant)>>,
}

impl State {
    fn sink_health(&self, now: Instant) -> Option<SinkHealth> {
        let s = &self.sink;
        if !s.attached.load(Ordering::Acquire) {
            return None;
        }
        let since = |n: u64| (n != 0).then(|| now.saturating_duration_since(self.at(n)));
        Some(SinkHealth {
            in_flight_for: since(s.started.load(Ordering::Relaxed)),
            consecutive_failures: s.failures.load(Ordering::Relaxed),
            last_success_age: since(s.last_ok.load(Ordering::Relaxed)),
            last_failure: lock(&s.last_failure)
                .clone()
                .map(|(message, at)| LastError { message, age: now.saturating_duration_since(at) }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_texts_are_cut_at_a_character_boundary() {
        let long = "é".repeat(LastError::MAX_MESSAGE_BYTES);
        let cut = cut(long);
        assert!(cut.len() <= LastError::MAX_MESSAGE_BYTES + '…'.len_utf8(), "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert_eq!(super::cut("short".into()), "short");
    }
}

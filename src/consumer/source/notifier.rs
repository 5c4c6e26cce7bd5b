//! The notifier: a dedicated LISTEN connection that turns notifications into
//! wake-ups of the drain loop.
//!
//! The connection is driven through `Connection::poll_message` (a plainly
//! spawned tokio-postgres connection drops notifications), never opens a
//! transaction, and keeps reading even while delivery is stalled, so the
//! server's notification queue is never pinned by us. A notification is only
//! a wake signal: all notifications that arrive while a drain runs collapse
//! into one more drain (a [`Notify`] permit), so memory stays flat.
//!
//! On connection loss it reconnects with exponential backoff, LISTENs again
//! *first*, and only then wakes the drain loop (a drain counted as
//! `wake="reconnect"`, from the lowest id: new sessions reset the fetch
//! floor); events
//! committed while it was down are found by that drain.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, Client};
use tokio_util::sync::CancellationToken;

use super::{Signals, WakeKind};
use crate::connect;
use crate::consumer::session::new_backoff;
use crate::consumer::{ConsumerConfig, ListenerStatus};
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::store;
use crate::store::NOTIFY_CHANNEL;

/// Wake-ups by LISTEN/NOTIFY: the notifier's signals. Its looks after a
/// wake-up that found nothing are the wake-up policy's own (after asking
/// producers for notifications again, `super::wake::RECHECKS`), so every
/// hook is the default.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Notified;

impl WakeKind for Notified {}

/// Payload prefix of the start-up test notification (not a wake-up).
pub(crate) const PROBE_PREFIX: &str = "pg-outbox probe ";

/// Operations on the LISTEN connection time out after this long.
const OP_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct Listening {
    client: Client,
    driver: JoinHandle<std::result::Result<(), tokio_postgres::Error>>,
}

/// Connect with `settings` (the consumer's statement timeout and client
/// check), start driving the connection, and LISTEN.
pub(crate) async fn listen(
    pg: &connect::ConnectOptions,
    settings: &connect::SessionSettings,
    wake: Arc<Notify>,
    probe: watch::Sender<String>,
) -> Result<Listening> {
    let (client, mut connection, _canceller, deferred) = connect::open(pg, "pg-outbox listener", settings).await?;
    let driver = crate::metrics::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(msg) = messages.next().await {
            match msg? {
                AsyncMessage::Notification(n) => {
                    if n.payload().starts_with(PROBE_PREFIX) {
                        // Only this consumer's own test notification counts
                        // (others starting at once on the database send
                        // theirs on the same channel): it empties the
                        // expected value, which the start waits for.
                        probe.send_if_modified(|want| {
                            let ours = !want.is_empty() && *want == n.payload();
                            if ours {
                                want.clear();
                            }
                            ours
                        });
                    } else {
                        crate::metrics::counter!(m::NOTIFICATIONS).increment(1);
                        wake.notify_one();
                    }
                }
                AsyncMessage::Notice(n) => tracing::debug!(notice = %n.message(), "listener notice"),
                _ => {}
            }
        }
        Ok(())
    });
    let listen = async {
        deferred.apply(&client).await?;
        store::listen(&client, NOTIFY_CHANNEL).await
    };
    match tokio::time::timeout(OP_TIMEOUT, listen).await {
        Ok(Ok(())) => Ok(Listening { client, driver }),
        Ok(Err(e)) => {
            driver.abort();
            Err(Error::Db(e))
        }
        Err(_) => {
            driver.abort();
            Err(Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "LISTEN timed out")))
        }
    }
}

/// Watch the LISTEN connection until it is lost (why) or `token` is
/// cancelled (`None`), pinging it every `ping_interval`.
async fn watch_connection(
    Listening { client, mut driver }: Listening,
    ping_interval: Duration,
    token: &CancellationToken,
) -> Option<String> {
    let mut ping = tokio::time::interval(ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.tick().await;
    loop {
        tokio::select! {
            _ = token.cancelled() => {
                driver.abort();
                return None;
            }
            r = &mut driver => {
                return Some(match r {
                    Ok(Ok(())) => "connection closed by the server".to_string(),
                    Ok(Err(e)) => crate::error::report(&e),
                    Err(e) => e.to_string(),
                });
            }
            _ = ping.tick() => {
                match tokio::time::timeout(OP_TIMEOUT, store::ping(&client)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => { driver.abort(); return Some(crate::error::report(&e)); }
                    Err(_) => { driver.abort(); return Some("liveness ping timed out".to_string()); }
                }
            }
        }
    }
}

/// What the notifier task is given.
pub(crate) struct Notifier {
    /// Where the LISTEN session connects.
    pub(crate) pg: connect::ConnectOptions,
    /// The LISTEN session `start` opened.
    pub(crate) first: Listening,
    /// The drain loop's wake-ups.
    pub(crate) signals: Signals,
    /// Where the start-up test notification is reported.
    pub(crate) probe: watch::Sender<String>,
    /// Stops the notifier.
    pub(crate) token: CancellationToken,
    /// The LISTEN session's state, for [`crate::EventStream::listener_status`].
    pub(crate) status: watch::Sender<ListenerStatus>,
    pub(crate) cfg: Arc<ConsumerConfig>,
}

/// Run until cancelled: watch the connection, ping it while idle, reconnect
/// with backoff when it is lost, and wake the drain loop after every
/// reconnect.
pub(crate) async fn run(n: Notifier) {
    let Notifier { pg, first, signals, probe, token, status, cfg } = n;
    let Signals { notification: wake, reconnected: reconnect_wake } = signals;
    let mut current = Some(first);
    let mut reconnects: u64 = 0;
    let new_backoff = || new_backoff(cfg.reconnect_max_delay);
    let mut backoff = new_backoff();
    // Reconnects that found only a read-only standby are said once.
    let mut on_standby = false;
    loop {
        if let Some(listening) = current.take() {
            status.send_modify(|s| (s.listening, s.reconnects, s.standing_by) = (true, reconnects, false));
            crate::metrics::gauge!(m::LISTENER_UP).set(1.0);
            let Some(reason) = watch_connection(listening, cfg.ping_interval, &token).await else {
                crate::metrics::gauge!(m::LISTENER_UP).set(0.0);
                status.send_modify(|s| (s.listening, s.reconnects, s.standing_by) = (false, reconnects, false));
                return;
            };
            crate::metrics::gauge!(m::LISTENER_UP).set(0.0);
            status.send_modify(|s| (s.listening, s.reconnects, s.standing_by) = (false, reconnects, false));
            tracing::warn!(reason = %reason, "LISTEN connection lost; reconnecting (a sweep follows)");
            backoff = new_backoff();
        }
        let delay = backoff.next().unwrap_or(cfg.reconnect_max_delay).min(cfg.reconnect_max_delay);
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        match listen(&pg, &cfg.session(), wake.clone(), probe.clone()).await {
            Ok(l) => {
                on_standby = false;
                reconnects += 1;
                crate::metrics::counter!(m::LISTENER_RECONNECTS).increment(1);
                tracing::info!(signal = "listen_resumed", reconnects, "LISTEN connection re-established; sweeping");
                current = Some(l);
                // LISTEN is in place: now sweep for what was committed while down.
                reconnect_wake.notify_one();
            }
            Err(Error::ReadOnlyStandby { .. }) if on_standby => {
                tracing::debug!(retry_in = ?delay, "LISTEN reconnect: still a read-only standby");
            }
            Err(Error::ReadOnlyStandby { target }) => {
                on_standby = true;
                tracing::warn!(standby = %target, retry_in = ?delay,
                    "LISTEN reconnect found a read-only standby (a failover?): retrying until a host accepts writes");
            }
            Err(e) => {
                on_standby = false;
                tracing::warn!(error = %crate::error::report(&e), retry_in = ?delay, "LISTEN reconnect failed");
            }
        }
    }
}

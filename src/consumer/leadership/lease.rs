//! The leader's hand-out lease: no delivery is handed to user code after
//! this consumer may have been deposed.
//!
//! A leader hands a buffered delivery out only within [`LEASE`] of the
//! moment it sent a statement that found its term current: every fetch
//! reads the current term with its rows (`store::fetch_sql`), and when the
//! lease lapses while deliveries wait in the buffer (a slow reader), the
//! stream asks the drain loop to confirm the term once more
//! ([`Lease::request_renewal`]): one round trip per lease, never one per
//! event. A relay that takes the outbox over after a holder that did not
//! release its term (a crash, a frozen process, a cut network) waits
//! [`TAKEOVER_WAIT`] after its term is taken before its first fetch.
//!
//! Why that is enough: the old leader's last confirming statement read the
//! term before the new leader's bump committed (else it would have read the
//! new term), so it was sent before the bump; the old leader hands out
//! nothing later than [`LEASE`] after sending it, and the new leader
//! nothing earlier than [`TAKEOVER_WAIT`] after the bump. Both measure on
//! their own monotonic clock, which keeps counting while a process is
//! stopped (SIGSTOP), so a leader frozen between its fetch and the hand-out
//! finds its lease lapsed when it resumes. The margin of
//! [`TAKEOVER_WAIT`] over [`LEASE`] covers clocks whose rates differ.
//!
//! Writers: the drain loop ([`Lease::confirm`], [`Lease::revoke`],
//! [`Lease::unfenced`]). Readers: the stream, as it hands a delivery out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::consumer::cx::Cx;
use crate::store::statement::StatementError;

/// How long after sending a statement that found its term current a
/// leader may hand deliveries out: 2 s.
pub(crate) const LEASE: Duration = Duration::from_secs(2);

/// How long a new leader waits before its first fetch when the previous
/// holder did not release its term: [`LEASE`] and 250 ms.
pub(crate) const TAKEOVER_WAIT: Duration = Duration::from_millis(2_250);
const _: () = assert!(TAKEOVER_WAIT.as_millis() > LEASE.as_millis());

/// How long the server lets the work session of single and partitioned
/// mode sit idle before it ends it (`idle_session_timeout`, PostgreSQL
/// 14+, docs "Client Connection Defaults"): 4 s. Ending the session
/// releases its advisory locks, so a leader that stops talking to the
/// server (a frozen process, a paused container, a silent network) loses
/// leadership within this long, with no other relay's privilege and no
/// flag; a standby then takes the outbox within [`TAKEOVER_WAIT`] and its
/// lock try (250 ms) more. A live consumer talks far more often: its sweep
/// every second, a standby's lock try every 250 ms, and otherwise a
/// keep-alive after [`KEEPALIVE_AFTER`] of quiet.
pub(crate) const IDLE_SESSION_TIMEOUT: Duration = Duration::from_secs(4);

/// A leader's work session that has sent nothing for this long (1 s, a
/// quarter of [`IDLE_SESSION_TIMEOUT`]) sends a keep-alive: a relay whose
/// sweep is turned down, or whose buffer is full behind a slow reader,
/// still keeps its session (and its leadership) with 2.5 s to spare (the
/// keep-alive is checked every half of this).
pub(crate) const KEEPALIVE_AFTER: Duration = Duration::from_secs(1);
const _: () = assert!(KEEPALIVE_AFTER.as_millis() * 4 <= IDLE_SESSION_TIMEOUT.as_millis());

/// Whether the warning that the server cannot take leadership back
/// (PostgreSQL 13) was given: once per process.
static UNBOUNDED_WARNED: AtomicBool = AtomicBool::new(false);

/// What the work session does as it takes leadership (the outbox lock and
/// its term, or partitioned membership): it records which relay it belongs
/// to (process id, host, version: `status` shows them), and asks the server
/// to end it once idle for [`IDLE_SESSION_TIMEOUT`]. On a server without
/// that setting (PostgreSQL 13) it warns, once per process, that a frozen
/// or cut-off leader keeps the outbox until the server's keepalives end its
/// session (a silent network: about 60 s) or forever (a frozen process),
/// and what to do about it.
pub(in crate::consumer) async fn taking_leadership(cx: Cx<'_>) -> Result<(), StatementError> {
    cx.work.register_identity(cx.stop()).await?;
    if cx.work.bound_idle(IDLE_SESSION_TIMEOUT, cx.stop()).await? {
        return Ok(());
    }
    if !UNBOUNDED_WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            signal = "no_idle_session_timeout",
            "the server has no idle_session_timeout (PostgreSQL 13): a frozen leader keeps the outbox for as long as it \
             is frozen, and one behind a silent network until the server's keepalives end its session (about 60 s); \
             upgrade to PostgreSQL 14 or later, or run the standbys with --take-over-stranded (docs/architecture.md, \
             \"Leadership the server takes back\")"
        );
    }
    Ok(())
}

/// The server ended the work session after [`IDLE_SESSION_TIMEOUT`]
/// without a statement (SQLSTATE 57P05, `e`): this relay stalled, lost its
/// leadership, and reconnects after `retry_in`. Logs it and returns the
/// health's last error.
pub(in crate::consumer) fn ended_idle(e: &tokio_postgres::Error, retry_in: Duration) -> String {
    tracing::warn!(error = %crate::error::report(e), retry_in = ?retry_in, idle_session_timeout = ?IDLE_SESSION_TIMEOUT,
        "the server ended this relay's work session after {IDLE_SESSION_TIMEOUT:?} without a statement: this relay \
         stalled (frozen, paused, cut off or starved of CPU), so it lost its leadership and another relay may have \
         taken over; reconnecting");
    format!("work session ended by the server after {IDLE_SESSION_TIMEOUT:?} idle (this relay stalled)")
}

/// The server ended competing mode's work session after
/// [`IDLE_SESSION_TIMEOUT`] idle inside its claim transaction (SQLSTATE
/// 25P03, `e`): this relay stalled, and what it had claimed went back to
/// the other relays. Logs it and returns the health's last error.
pub(in crate::consumer) fn ended_idle_in_claim(e: &tokio_postgres::Error, retry_in: Duration) -> String {
    tracing::warn!(error = %crate::error::report(e), retry_in = ?retry_in, idle_in_transaction_session_timeout = ?IDLE_SESSION_TIMEOUT,
        "the server ended this relay's claim after {IDLE_SESSION_TIMEOUT:?} without a statement: this relay stalled \
         (frozen, paused, cut off or starved of CPU), so the events it had claimed went back to the other relays \
         (those it had already handed out are delivered again); reconnecting");
    format!("claim ended by the server after {IDLE_SESSION_TIMEOUT:?} idle (this relay stalled)")
}

/// Whether buffered deliveries may be handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseState {
    /// The consumer holds no term nor claim (a standby, a partitioned
    /// member holding no partition): no lease applies.
    Unfenced,
    /// Until this instant.
    Until(Instant),
    /// Not at all: the term is gone with the session (what is buffered is
    /// released by hold-back's stale mark).
    Revoked,
}

/// The lease, shared by the drain loop and the stream.
#[derive(Debug)]
pub(crate) struct Lease {
    state: watch::Sender<LeaseState>,
    renew: Notify,
}

impl Default for Lease {
    fn default() -> Self {
        Lease { state: watch::Sender::new(LeaseState::Unfenced), renew: Notify::new() }
    }
}

impl Lease {
    /// May a delivery be handed out at `now`?
    #[cfg(test)]
    pub(crate) fn allows(&self, now: Instant) -> bool {
        allows(*self.state.borrow(), now)
    }

    /// A receiver that sees every change from now on.
    pub(crate) fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.subscribe()
    }

    /// The stream waits for a hand-out: ask the drain loop to confirm the
    /// term (a request made while none is pending is kept until taken).
    pub(crate) fn request_renewal(&self) {
        self.renew.notify_one();
    }

    /// Resolves when the stream asked for a renewal.
    pub(crate) async fn renewal_requested(&self) {
        self.renew.notified().await
    }

    /// A statement sent at `sent` found the term current.
    pub(crate) fn confirm(&self, sent: Instant) {
        self.state.send_replace(LeaseState::Until(sent + LEASE));
    }

    /// The consumer holds no term: nothing is fenced.
    pub(crate) fn unfenced(&self) {
        if *self.state.borrow() != LeaseState::Unfenced {
            self.state.send_replace(LeaseState::Unfenced);
        }
    }

    /// The term is gone: hand nothing out until a new one is confirmed.
    pub(crate) fn revoke(&self) {
        self.state.send_replace(LeaseState::Revoked);
    }
}

/// May a delivery be handed out at `now` under `state`?
pub(crate) fn allows(state: LeaseState, now: Instant) -> bool {
    match state {
        LeaseState::Unfenced => true,
        LeaseState::Until(until) => now < until,
        LeaseState::Revoked => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_confirmation_allows_hand_outs_for_the_lease_from_when_it_was_sent() {
        let lease = Lease::default();
        assert!(lease.allows(Instant::now()), "unfenced at first");
        let sent = Instant::now();
        lease.confirm(sent);
        assert!(lease.allows(sent + LEASE - Duration::from_millis(1)));
        assert!(!lease.allows(sent + LEASE));
        lease.revoke();
        assert!(!lease.allows(sent));
    }

    #[tokio::test]
    async fn a_subscriber_sees_a_change_made_after_it_subscribed() {
        let lease = Lease::default();
        let mut rx = lease.subscribe();
        lease.revoke();
        tokio::time::timeout(Duration::from_secs(1), rx.changed()).await.expect("woken").expect("open");
        assert_eq!(*rx.borrow(), LeaseState::Revoked);
        lease.request_renewal();
        tokio::time::timeout(Duration::from_secs(1), lease.renewal_requested()).await.expect("kept request");
    }
}

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

use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// How long after sending a statement that found its term current a
/// leader may hand deliveries out: 2 s.
pub(crate) const LEASE: Duration = Duration::from_secs(2);

/// How long a new leader waits before its first fetch when the previous
/// holder did not release its term: [`LEASE`] and 250 ms.
pub(crate) const TAKEOVER_WAIT: Duration = Duration::from_millis(2_250);
const _: () = assert!(TAKEOVER_WAIT.as_millis() > LEASE.as_millis());

/// Whether buffered deliveries may be handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseState {
    /// The consumer holds no term (competing and partitioned modes): no
    /// lease applies.
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

//! What a named subscription's fetch does when it finds nothing: move the
//! cursor over what is settled (so an idle subscription's figures, and
//! what retention may delete, catch up without another event), and, where
//! fresh events are read only within [`SUBSCRIPTION_WINDOW`] ids above the
//! cursor (partitioned and competing modes), say when its readers wait at
//! the window. Shared by the ordered and the claim fetch.

use tokio::time::Instant;

use super::Cx;
use crate::store::SUBSCRIPTION_WINDOW;
use crate::store::statement::StatementError;
use crate::store::subscription_lag::WindowHolder;

/// How often an idle named subscription's cursor is moved at most: each
/// move passes the checkpoint the one before recorded, so an idle
/// subscription's cursor catches up within about two of these (or two
/// sweeps, if longer).
const ADVANCE_IDLE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The idle moves of a named subscription's cursor, and whether its
/// readers wait at the window.
#[derive(Debug, Default)]
pub(super) struct IdleAdvance {
    /// When the cursor was last moved after a fetch that found nothing
    /// ([`crate::store::WorkSession::advance_idle`]).
    advanced: Option<Instant>,
    /// Fetches find nothing while events wait past the window above the
    /// cursor (said once).
    waiting_at_window: bool,
    /// What seemed to hold the cursor when the readers were first found
    /// waiting: the warning names only what still holds it a move later
    /// ([`WindowHolder::still`]), not an event that was merely in flight
    /// at that instant, or a producer's transaction that has since ended.
    first_holder: Option<WindowHolder>,
}

impl IdleAdvance {
    /// A fetch found nothing: move the cursor, at most every
    /// [`ADVANCE_IDLE_EVERY`] (nothing for the default subscription), and
    /// with `windowed` (the fetch reads within the window), say whether the
    /// readers wait at it. Run outside any claim transaction.
    pub(super) async fn found_nothing(&mut self, cx: Cx<'_>, windowed: bool) -> Result<(), StatementError> {
        let now = Instant::now();
        if self.advanced.is_some_and(|t| now < t + ADVANCE_IDLE_EVERY) {
            return Ok(());
        }
        self.advanced = Some(now);
        let ahead = cx.work.advance_idle(cx.stop()).await?;
        let Some(name) = cx.work.reader().subscription().filter(|_| windowed) else { return Ok(()) };
        let waiting = ahead.is_some_and(|a| a > SUBSCRIPTION_WINDOW);
        if !waiting {
            self.first_holder = None;
            if std::mem::take(&mut self.waiting_at_window) {
                tracing::info!(
                    subscription = name,
                    "subscription {name:?}: its cursor moved; reading on past the window"
                );
            }
            return Ok(());
        }
        if self.waiting_at_window {
            return Ok(());
        }
        let holder = cx.work.window_holder(cx.stop()).await?;
        match self.first_holder.take() {
            // Looked at once: look again at the next move.
            None => self.first_holder = Some(holder),
            Some(first) => {
                self.waiting_at_window = true;
                warn_at_window(name, ahead, &first.still(&holder));
            }
        }
        Ok(())
    }
}

/// A named subscription's readers wait at the window
/// ([`SUBSCRIPTION_WINDOW`]) while the highest id stands `ahead` ids above
/// its cursor, which `holder` holds (docs/subscriptions.md, "Delivering a
/// subscription"): said once (signal `subscription_window`), and at info
/// once they read on.
fn warn_at_window(name: &str, ahead: Option<i64>, holder: &WindowHolder) {
    tracing::warn!(
        subscription = name,
        ahead,
        window = SUBSCRIPTION_WINDOW,
        held_by_event = holder.event_id,
        held_by_pid = holder.writer.as_ref().map(|w| w.0),
        signal = "subscription_window",
        "subscription {name:?}: its readers wait {SUBSCRIPTION_WINDOW} ids above its cursor, which an event \
         not yet settled below holds (one in flight on a slow or frozen relay, or a write transaction still \
         open in this database): {holder}; they read on once the cursor moves"
    );
}

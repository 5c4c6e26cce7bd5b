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
        if windowed {
            let waiting = ahead.is_some_and(|a| a > SUBSCRIPTION_WINDOW);
            let holder = match waiting && !self.waiting_at_window {
                true => Some(cx.work.window_holder(cx.stop()).await?),
                false => None,
            };
            self.at_window(ahead, holder, cx.work.reader().subscription());
        }
        Ok(())
    }

    /// A named subscription's fetch found nothing while the highest id
    /// stands `ahead` ids above its cursor: past the window
    /// ([`SUBSCRIPTION_WINDOW`]), its readers wait for the cursor
    /// (docs/subscriptions.md, "Delivering a subscription"). Said once
    /// when they start waiting (signal `subscription_window`), naming what
    /// `holder` found holds the cursor, and once when they read on.
    fn at_window(&mut self, ahead: Option<i64>, holder: Option<WindowHolder>, subscription: Option<&str>) {
        let Some(name) = subscription else { return };
        let waiting = ahead.is_some_and(|a| a > SUBSCRIPTION_WINDOW);
        if waiting && !self.waiting_at_window {
            let holder = holder.unwrap_or_default();
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
        } else if !waiting && self.waiting_at_window {
            tracing::info!(subscription = name, "subscription {name:?}: its cursor moved; reading on past the window");
        }
        self.waiting_at_window = waiting;
    }
}

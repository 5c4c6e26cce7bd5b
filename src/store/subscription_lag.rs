//! A subscription's lag bound (`subscription create|set ... --max-lag`):
//! how far behind it may fall before every consumer's maintenance raises
//! the alert (the gauges `outbox_subscription_behind` and
//! `outbox_subscription_lag_seconds`, the log signal
//! `subscription_behind`), and `status` and `subscription list` mark it.
//! Falling behind never drops anything: the subscription keeps holding
//! retention (docs/subscriptions.md, "Falling behind").

use std::time::Duration;

use tokio_postgres::GenericClient;

use super::map_missing_schema;
use crate::error::{Result, SubscriptionError};

/// Set subscription $1's lag bound to $2 seconds (`float8`), or clear it
/// when $2 is NULL, in its `options` (key `max_lag_seconds`), and whether it
/// expires past the bound, $3 (`boolean`, key `expire`; false without a
/// bound). Returns its name, or nothing when there is no such subscription.
pub(crate) const SET_MAX_LAG: &str = "UPDATE events.outbox_subscriptions \
     SET options = CASE WHEN $2::float8 IS NULL THEN options - 'max_lag_seconds' - 'expire' \
                        ELSE options || jsonb_build_object('max_lag_seconds', $2::float8, 'expire', $3::boolean) END \
     WHERE name = $1 RETURNING name";

/// The lag of subscription row `s`: seconds from `occurred_at` to now of
/// the lowest event above its cursor that it has not settled (NULL when it
/// has caught up). That event is among the first `cardinality(settled) + 1`
/// rows above the cursor (at most that many of them are settled), so one
/// walk of `outbox_pkey` of that many entries, and a hashed `EXCEPT` of the
/// settled ids: linear in them. (Filtering the walk with `id <> ALL
/// (settled)` was quadratic: 3.2 s with 20 000 ids settled above the
/// cursor, against 33 ms this way.)
macro_rules! lag_of_s {
    () => {
        concat!(
            "(SELECT EXTRACT(EPOCH FROM (now() - o.occurred_at))::float8 FROM events.outbox o WHERE o.id = ",
            $crate::store::subscription_lag::lowest_unsettled_of_s!(),
            ")"
        )
    };
}
pub(crate) use lag_of_s;

/// The id of the lowest event above subscription row `s`'s cursor that it
/// has not settled (NULL when there is none), as [`lag_of_s!`] finds it.
macro_rules! lowest_unsettled_of_s {
    () => {
        "(SELECT min(d.id) FROM ( \
           (SELECT o.id FROM events.outbox o WHERE o.id > s.cursor_id ORDER BY o.id \
             LIMIT cardinality(s.settled) + 1) \
           EXCEPT SELECT unnest(s.settled)) d)"
    };
}
pub(crate) use lowest_unsettled_of_s;

/// Mark subscription $1 expired, if it still may and must: its expiry
/// opted in (`options` key `expire`), not expired yet, and its lag (as in
/// [`LAGS`], read again under the row's lock) past its bound. Returns its
/// `lag` and `max_lag` (seconds) when it expired it, nothing otherwise.
pub(crate) const EXPIRE: &str = concat!(
    "WITH s AS (SELECT name, cursor_id, settled, options FROM events.outbox_subscriptions \
       WHERE name = $1 AND state <> 'expired' AND coalesce((options ->> 'expire')::boolean, false) FOR UPDATE), \
     l AS (SELECT s.name, (s.options ->> 'max_lag_seconds')::float8 AS max_lag, ",
    lag_of_s!(),
    " AS lag FROM s) \
     UPDATE events.outbox_subscriptions u SET state = 'expired' FROM l \
     WHERE u.name = l.name AND l.lag > l.max_lag RETURNING l.lag, l.max_lag"
);

/// Every subscription's lag against its bound, by name, at most 1 000 of
/// them: `name`, `max_lag` (seconds, NULL without a bound) and `lag`:
/// seconds from `occurred_at` to now of the lowest event above its cursor
/// that it has not settled (as `subscription list` shows it; NULL when it
/// has caught up); its `state`, and `expire`: whether it expires past its
/// bound. One descent of `outbox_pkey` per subscription, walking
/// at most as many entries as it has ids settled above the cursor, whatever
/// the table's size ([`lag_of_s!`]).
pub(crate) const LAGS: &str = concat!(
    "SELECT s.name, s.state, (s.options ->> 'max_lag_seconds')::float8 AS max_lag, \
       coalesce((s.options ->> 'expire')::boolean, false) AS expire, ",
    lag_of_s!(),
    " AS lag FROM events.outbox_subscriptions s ORDER BY s.name COLLATE \"C\" LIMIT 1000"
);

/// What holds subscription $1's cursor, for the warning that its readers
/// wait at the window (`consumer::source::idle`): `event_id`, the lowest
/// event above the cursor it has not settled (as [`lag_of_s!`] finds it),
/// and the oldest write transaction open in this database on another
/// session (one with a transaction id: it may still insert an event below
/// what the cursor may pass): `pid`, `application_name` and `open_secs`,
/// NULL when there is none, or when `pg_stat_activity` hides it from this
/// role. One row, none when the subscription is gone.
pub(crate) const WINDOW_HOLDER: &str = concat!(
    "SELECT ",
    lowest_unsettled_of_s!(),
    " AS event_id, \
     w.pid, w.application_name, EXTRACT(EPOCH FROM (now() - w.xact_start))::float8 AS open_secs \
     FROM events.outbox_subscriptions s LEFT JOIN LATERAL ( \
       SELECT a.pid, a.application_name, a.xact_start FROM pg_catalog.pg_stat_activity a \
        WHERE a.datname = current_database() AND a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() \
        ORDER BY a.xact_start LIMIT 1) w ON true \
     WHERE s.name = $1"
);

/// What holds a subscription's cursor ([`WINDOW_HOLDER`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct WindowHolder {
    /// The lowest event above the cursor not settled.
    pub(crate) event_id: Option<i64>,
    /// The oldest write transaction open in this database: its backend's
    /// pid, `application_name`, and seconds since it began.
    pub(crate) writer: Option<(i32, String, f64)>,
}

impl WindowHolder {
    /// What of `self`, read first, `later` still finds: the same lowest
    /// event not settled, and the same write transaction (one pid, open
    /// at least as long as before). Whatever changed in between was in
    /// passing (an event in flight, a producer's short transaction), not
    /// what holds the cursor.
    pub(crate) fn still(&self, later: &WindowHolder) -> WindowHolder {
        let event_id = self.event_id.filter(|id| later.event_id == Some(*id));
        let writer = match (&self.writer, &later.writer) {
            (Some(a), Some(b)) if a.0 == b.0 && b.2 >= a.2 => Some(b.clone()),
            _ => None,
        };
        WindowHolder { event_id, writer }
    }
}

impl std::fmt::Display for WindowHolder {
    /// "event 41 is not settled; the oldest write transaction open in this
    /// database is pid 77 (psql), open 12 s" (either part alone, or
    /// "nothing found" when neither is known).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let event = self.event_id.map(|id| format!("event {id} is not settled (in flight, or failed and waiting)"));
        let writer = self.writer.as_ref().map(|(pid, app, secs)| {
            let app = if app.is_empty() { String::new() } else { format!(" ({app})") };
            format!("the oldest write transaction open in this database is pid {pid}{app}, open {secs:.0} s")
        });
        match (event, writer) {
            (Some(e), Some(w)) => write!(f, "{e}; {w}"),
            (Some(one), None) | (None, Some(one)) => f.write_str(&one),
            (None, None) => f.write_str("nothing found that held it across two looks a second apart"),
        }
    }
}

/// One subscription's lag against its bound ([`LAGS`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Lag {
    /// The subscription.
    pub(crate) name: String,
    /// Its lag in seconds; `None` when it has caught up.
    pub(crate) lag_seconds: Option<f64>,
    /// Its bound in seconds; `None` without one.
    pub(crate) max_lag_seconds: Option<f64>,
    /// `active`, `paused` or `expired`.
    pub(crate) state: String,
    /// It expires past its bound (opted in).
    pub(crate) expire: bool,
}

impl Lag {
    /// Whether it lags more than its bound ([`behind`]).
    pub(crate) fn behind(&self) -> bool {
        behind(self.lag_seconds, self.max_lag_seconds)
    }
}

/// Whether a lag of `lag` seconds passes the bound `max` (never without
/// a bound, nor for a subscription that has caught up).
pub(crate) fn behind(lag: Option<f64>, max: Option<f64>) -> bool {
    matches!((lag, max), (Some(lag), Some(max)) if lag > max)
}

/// Set subscription `name`'s lag bound ([`SET_MAX_LAG`]) and whether it
/// expires past it (`expire`); `None` clears both. The caller checks the
/// name first (`subscription_admin::check_name`).
///
/// # Errors
/// [`SubscriptionError::Unknown`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
pub(crate) async fn set_max_lag<C: GenericClient + Sync>(
    client: &C,
    name: &str,
    max: Option<Duration>,
    expire: bool,
) -> Result<()> {
    let seconds = max.map(|d| d.as_secs_f64());
    let row = client.query_opt(SET_MAX_LAG, &[&name, &seconds, &expire]).await.map_err(map_missing_schema)?;
    match row {
        Some(_) => Ok(()),
        None => Err(SubscriptionError::Unknown(name.to_string()).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::WindowHolder;

    #[test]
    fn the_window_warning_names_only_what_held_the_cursor_across_both_looks() {
        let first = WindowHolder { event_id: Some(41), writer: Some((77, "psql".into(), 3.0)) };
        // The same event and transaction a second later: both named.
        let later = WindowHolder { event_id: Some(41), writer: Some((77, "psql".into(), 4.0)) };
        assert_eq!(first.still(&later), later);
        assert_eq!(
            first.still(&later).to_string(),
            "event 41 is not settled (in flight, or failed and waiting); the oldest write transaction open in \
             this database is pid 77 (psql), open 4 s"
        );
        // An event settled meanwhile, and a new transaction on the same
        // backend (open for less time): neither is named.
        let passing = WindowHolder { event_id: Some(90), writer: Some((77, "psql".into(), 0.5)) };
        assert_eq!(first.still(&passing), WindowHolder::default());
        assert_eq!(first.still(&passing).to_string(), "nothing found that held it across two looks a second apart");
        // Another backend's transaction: not the one seen first.
        let other = WindowHolder { event_id: Some(41), writer: Some((78, String::new(), 9.0)) };
        assert_eq!(first.still(&other), WindowHolder { event_id: Some(41), writer: None });
    }
}

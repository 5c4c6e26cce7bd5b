//! Operating subscriptions: more readers of one outbox, each with its own
//! progress, retries and dead letters (docs/subscriptions.md).
//!
//! The default subscription, `default`, is the seeded flow: its progress is
//! `published_at` and the retry columns on each row of `events.outbox`.
//! Every other subscription is a row of `events.outbox_subscriptions`
//! (migration 0016): a cursor, `cursor_id`, at or below which every event
//! is settled for it or has a row in `events.outbox_subscription_failures`
//! (waiting for a retry, a dead letter, or held back behind an earlier
//! failed event of its aggregate). Producers pay nothing per subscription.
//!
//! - [`create`] a subscription starting [`From`] now, the earliest event,
//!   an id or a time; [`list`] them with their figures ([`get`] one);
//! - [`pause`] and [`resume`] its delivery; [`drop`] it with its failures;
//! - [`rewind`] a paused one to another start: its events after the new
//!   cursor are delivered again.
//!
//! A subscription's dead letters are operated with
//! [`crate::dead_letters`], naming it in the filter
//! ([`Filter::subscription`](crate::dead_letters::Filter::subscription)).
//! Retention deletes an event only once every subscription, active or
//! paused, has passed it without a failure row for it, and the default has
//! published it ([`crate::retention`]).
//!
//! Every function takes a client (or a transaction) the caller opened;
//! writes need the primary. Names follow the rule of [`check_name`]; every
//! operation on a name that is no subscription fails with
//! [`SubscriptionError::Unknown`] naming it.
//!
//! # Example
//! ```no_run
//! # async fn run(client: &tokio_postgres::Client) -> Result<(), pg_outbox::Error> {
//! use pg_outbox::subscription::{self, From};
//! let created = subscription::create(client, "audit", From::Now).await?;
//! println!("audit starts after id {:?}", created.cursor_id);
//! for s in subscription::list(client).await? {
//!     println!("{} {} lag {:?} s", s.name, s.state, s.lag_seconds);
//! }
//! # Ok(()) }
//! ```

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use crate::error::Result;
pub use crate::error::SubscriptionError;
use crate::store::subscription_admin as store;
pub use crate::store::subscription_admin::{Dropped, From, Rewound, Subscription, SubscriptionState};
/// The statements of a subscription's claim in competing mode, and its
/// claim class, for the plan tests (feature `kit`; not part of the API).
#[cfg(feature = "kit")]
#[doc(hidden)]
pub use crate::store::subscription_claim_statements as claim_statements;
/// The statements that read a subscription's lag and backlog, for the plan
/// tests and the console bench, with the test kit's feature `kit`. Not part
/// of the API: they change with any release.
#[cfg(feature = "kit")]
#[doc(hidden)]
pub use crate::store::subscription_read_statements as read_statements;

/// The name of the seeded flow's subscription: `default`. It is no row of
/// `events.outbox_subscriptions`, and no other subscription may take it.
pub const DEFAULT: &str = store::DEFAULT_NAME;

/// Failure rows of one subscription that [`list`] (and `status`) read for
/// its figures: 10 000; past that, its `failing`, `dead_letters` and `held`
/// are lower bounds ([`Subscription::counts_exact`] false).
pub const FAILURES_COUNTED: i64 = store::FAILURES_COUNTED;

/// Check `name` against the naming rule: 1 to 63 characters of `a`-`z`,
/// `0`-`9`, `_`, `.` and `-`, starting with a letter or a digit (the
/// table's CHECK, `^[a-z0-9][a-z0-9_.-]{0,62}$`), and not `default`.
///
/// # Errors
/// [`SubscriptionError::InvalidName`], saying which part of the rule the
/// name breaks.
///
/// # Example
/// ```
/// use pg_outbox::subscription::check_name;
/// assert!(check_name("orders-audit").is_ok());
/// assert!(check_name("Orders").is_err());
/// assert!(check_name("default").is_err());
/// ```
pub fn check_name(name: &str) -> Result<()> {
    store::check_name(name)
}

/// Create subscription `name`, starting at `from` (its cursor, and
/// `start_id`, are computed when it runs: see [`From`]). Returns it with
/// its figures. Creating a name that exists is an error, never a silent
/// success.
///
/// [`From::Now`] starts after the highest id in `events.outbox` at that
/// moment: an event whose transaction is still open then and drew a lower
/// id is not delivered to the subscription. [`From::Time`] walks
/// `outbox_pkey` once from the lowest id to the first event at or after
/// the time: on a large table, as long as a scan (the other forms are one
/// index descent).
///
/// # Errors
/// [`SubscriptionError::InvalidName`] (checked before any SQL),
/// [`SubscriptionError::Exists`], [`SubscriptionError::LockClassTaken`]
/// (the name's partition lock class is another subscription's: about 1 in
/// 134 million), [`SubscriptionError::InvalidStart`]
/// (`From::Id(i64::MIN)`); [`crate::Error::NotMigrated`] (a schema before
/// migration 0016: run `pg-outbox migrate`) or [`crate::Error::Db`].
///
/// # Cancel safety
/// Two statements (the cursor, then the INSERT). If the future is dropped,
/// the subscription may or may not exist; creating it again says which.
pub async fn create<C: GenericClient + Sync>(client: &C, name: &str, from: From) -> Result<Subscription> {
    store::create(client, name, from).await
}

/// One subscription with its figures (not the default).
///
/// # Errors
/// [`SubscriptionError::Unknown`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn get<C: GenericClient + Sync>(client: &C, name: &str) -> Result<Subscription> {
    store::get(client, name).await
}

/// Every subscription with its figures: the default first (its figures
/// from [`crate::status::read`]'s bounded backlog read, estimated past
/// 2 000 rows of a kind), then the others by name.
///
/// Bounded whatever the table's size: per subscription, one descent of
/// `outbox_pkey` for the highest id, one walk of it from the cursor past
/// the ids settled above it for the lag, and at most [`FAILURES_COUNTED`]
/// of its failure rows.
///
/// # Errors
/// [`crate::Error::NotMigrated`] (a schema before migration 0016 too) or
/// [`crate::Error::Db`].
///
/// # Cancel safety
/// Cancel safe: it only reads. For figures from one snapshot, run it in a
/// `REPEATABLE READ` transaction.
pub async fn list<C: GenericClient + Sync>(client: &C) -> Result<Vec<Subscription>> {
    store::list(client).await
}

/// Pause subscription `name`: its relays deliver nothing more until it is
/// resumed (events they already handed out may still be settled).
/// Retention keeps every event it has not passed. Returns whether it was
/// active (pausing a paused one changes nothing).
///
/// # Errors
/// [`SubscriptionError::Unknown`], [`SubscriptionError::Expired`] (an
/// expired subscription is only rewound or dropped);
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// One statement: if the future is dropped it may or may not have run;
/// running it again is harmless.
pub async fn pause<C: GenericClient + Sync>(client: &C, name: &str) -> Result<bool> {
    Ok(store::set_state(client, name, SubscriptionState::Paused).await? == SubscriptionState::Active)
}

/// Resume subscription `name`, and wake the relays. Returns whether it
/// was paused (resuming an active one changes nothing).
///
/// # Errors
/// [`SubscriptionError::Unknown`], [`SubscriptionError::Expired`] (rewind
/// it first: that accepts the gap); [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
///
/// # Cancel safety
/// One statement, then a `NOTIFY`: if the future is dropped it may or may
/// not have run (the relays' sweep finds a resumed subscription without
/// the wake-up); running it again is harmless.
pub async fn resume<C: GenericClient + Sync>(client: &C, name: &str) -> Result<bool> {
    Ok(store::set_state(client, name, SubscriptionState::Active).await? == SubscriptionState::Paused)
}

/// Set subscription `name`'s lag bound: once its lag (the age of the
/// lowest event above its cursor that it has not settled) passes `max`,
/// it is behind: every relay and consumer of the outbox sets the gauge
/// `outbox_subscription_behind{subscription}` to 1 and logs the signal
/// `subscription_behind` (within 5 s, their gauges' interval), and
/// `status` and `subscription list` mark it. Nothing is dropped: a
/// subscription behind still holds retention, unless `expire`: then the
/// first relay or consumer of the outbox to see it behind marks it
/// [`SubscriptionState::Expired`] (log signal `subscription_expired`):
/// retention no longer waits for it (events it never got may be deleted),
/// its relays stop, and it can only be rewound (accepting the gap) or
/// dropped (docs/subscriptions.md, "Falling behind"). `None` clears the
/// bound and the expiry (the default: no alert).
///
/// # Errors
/// [`SubscriptionError::Unknown`], [`SubscriptionError::InvalidName`];
/// [`crate::Error::NotMigrated`] or [`crate::Error::Db`].
///
/// # Cancel safety
/// One statement: if the future is dropped it may or may not have run;
/// running it again is harmless.
pub async fn set_max_lag<C: GenericClient + Sync>(
    client: &C,
    name: &str,
    max: Option<std::time::Duration>,
    expire: bool,
) -> Result<()> {
    store::check_name(name)?;
    crate::store::subscription_lag::set_max_lag(client, name, max, expire).await
}

/// Drop subscription `name`: its row and its failure rows (dead letters
/// included). Its leadership term row (`events.outbox_terms`, scope
/// `subscription:NAME`) stays, so terms only grow: one created again under
/// the name takes the next term. Its events stay in `events.outbox` (retention
/// stops waiting for it). A relay still delivering it fails its next
/// acknowledgement.
///
/// # Errors
/// [`SubscriptionError::Unknown`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
///
/// # Cancel safety
/// One statement: if the future is dropped it may or may not have run.
pub async fn drop<C: GenericClient + Sync>(client: &C, name: &str) -> Result<Dropped> {
    store::drop_subscription(client, name).await
}

/// Rewind paused (or expired: it is paused then) subscription `name` to `from` (computed as for
/// [`create`]; a later start skips the events between): its cursor is
/// set, the ids settled above it and its checkpoints cleared, and its
/// failure rows above the new cursor deleted, dead letters included: those
/// events are delivered again once it is resumed. Failure rows at or below
/// the new cursor stay. `start_id` stays what it was created with. Events
/// retention has deleted are not delivered again.
///
/// # Errors
/// [`SubscriptionError::NotPaused`] for an active subscription (pause it
/// first: a relay may be delivering it), [`SubscriptionError::Unknown`],
/// [`SubscriptionError::InvalidStart`]; [`crate::Error::NotMigrated`] or
/// [`crate::Error::Db`].
///
/// # Cancel safety
/// The cursor is computed, then one statement rewinds: if the future is
/// dropped, the rewind may or may not have happened (its cursor shows it).
pub async fn rewind<C: GenericClient + Sync>(client: &C, name: &str, from: From) -> Result<Rewound> {
    store::rewind(client, name, from).await
}

/// The forms [`From`] is written in, for messages.
const FORMS: &str = "write now, earliest, id:N (the events from id N on) or time:RFC3339 \
                     (e.g. time:2026-01-31T00:00:00Z: the events that occurred from then on)";

impl std::str::FromStr for From {
    type Err = crate::Error;

    /// `now`, `earliest`, `id:N` ([`From::Id`]) or `time:RFC3339`
    /// ([`From::Time`], e.g. `time:2026-01-31T00:00:00Z`), as
    /// `pg-outbox subscription create --from` takes them.
    ///
    /// # Errors
    /// [`SubscriptionError::InvalidStart`] naming the value and the forms.
    fn from_str(s: &str) -> Result<From> {
        let invalid =
            |why: String| -> crate::Error { SubscriptionError::InvalidStart { value: s.to_string(), why }.into() };
        let t = s.trim();
        match t {
            "now" => return Ok(From::Now),
            "earliest" => return Ok(From::Earliest),
            _ => {}
        }
        if let Some(n) = t.strip_prefix("id:") {
            let n: i64 = n.trim().parse().map_err(|_| invalid(format!("{n:?} is not a whole number; {FORMS}")))?;
            if n == i64::MIN {
                return Err(invalid("no id comes before it".into()));
            }
            return Ok(From::Id(n));
        }
        if let Some(at) = t.strip_prefix("time:") {
            let at: DateTime<Utc> = DateTime::parse_from_rfc3339(at.trim())
                .map_err(|e| invalid(format!("{at:?} is not an RFC 3339 time ({e}); {FORMS}")))?
                .with_timezone(&Utc);
            return Ok(From::Time(at));
        }
        Err(invalid(FORMS.to_string()))
    }
}

impl std::fmt::Display for From {
    /// The form [`From`]'s `FromStr` reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            From::Now => f.write_str("now"),
            From::Earliest => f.write_str("earliest"),
            From::Id(n) => write!(f, "id:{n}"),
            From::Time(t) => write!(f, "time:{}", t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::From;
    use chrono::TimeZone;

    #[test]
    fn start_positions_parse_and_print_back() {
        let t = chrono::Utc.with_ymd_and_hms(2026, 1, 31, 0, 0, 0).unwrap();
        for (text, want) in
            [("now", From::Now), ("earliest", From::Earliest), ("id:42", From::Id(42)), ("id:-3", From::Id(-3))]
        {
            let got: From = text.parse().expect(text);
            assert_eq!(got, want, "{text}");
            assert_eq!(got.to_string(), text);
        }
        let got: From = "time:2026-01-31T01:00:00+01:00".parse().expect("time");
        assert_eq!(got, From::Time(t));
        assert_eq!(got.to_string(), "time:2026-01-31T00:00:00Z");
        assert_eq!(got.to_string().parse::<From>().expect("round trip"), got);
        for bad in ["", "latest", "id:", "id:x", "id:1.5", "time:yesterday", "12", "NOW"] {
            let e = bad.parse::<From>().expect_err(bad).to_string();
            assert!(e.contains(&format!("{bad:?}")), "the error names the value {bad:?}: {e}");
            assert!(e.contains("invalid start position"), "{e}");
        }
        let e = format!("id:{}", i64::MIN).parse::<From>().expect_err("MIN").to_string();
        assert!(e.contains("no id comes before it"), "{e}");
    }
}

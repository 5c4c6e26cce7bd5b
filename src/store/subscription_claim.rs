//! Competing mode for a named subscription (docs/subscriptions.md,
//! "Competing mode"): each consumer claims events in a transaction it holds
//! until their settlements are written, as the default's competing mode
//! does; but a subscription's claims cannot be row locks on
//! `events.outbox` (those are the default's, and its relays update the
//! rows), so each claimed event is a transaction-level advisory lock of
//! the subscription's claim class ([`Reader::claim_class`]), which other
//! consumers skip. The claim is two statements in the claim transaction:
//!
//! 1. [`claim_sql`]: a checkpoint, then the locks, taken on candidates in
//!    order and stopping at the batch: due failure rows (retries, and held
//!    events made due), held events (competing mode holds nothing back:
//!    an event the cursor passed behind a failed one of its aggregate is
//!    due at once), then fresh events above the cursor, up to
//!    [`SUBSCRIPTION_WINDOW`] ids above it;
//! 2. [`claimed_rows_sql`]: the events locked, read again in a snapshot taken
//!    after the locks, keeping those still due. A lock is taken only once
//!    the consumer that held it has committed, and that consumer wrote its
//!    settlements before it committed: so a second snapshot sees them, and
//!    an event settled meanwhile is not handed out again (the first
//!    statement's snapshot predates the lock).
//!
//! The checkpoint (the highest id and the next transaction id, from one
//! snapshot) is read while the claim transaction has no transaction id,
//! as the cursor's rule needs (`super::subscription::checkpoint_sql`), and
//! the settlement writes of that transaction pass it to
//! `events.outbox_subscription_ack` and `_fail` (migration 0016): a write
//! takes a transaction id, after which the server counts `age()` from it.

use std::sync::{Arc, Mutex};

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use super::fetch::{PayloadSizes, SUBSCRIPTION_WINDOW, within_budget};
use super::page::FetchPage;
use super::rows::EVENT_COLUMNS;
use super::subscription::{Reader, claim_key};

/// A checkpoint: the highest id and the next transaction id one snapshot
/// saw (`None` where ids do not follow transaction ids).
pub(crate) type Checkpoint = (Option<i64>, Option<i64>);

/// The checkpoint of the claim transaction open on a session, shared by
/// its work session (which reads it with the claim) and its writer (the
/// same session in competing mode, which passes it with each write).
#[derive(Debug, Clone, Default)]
pub(crate) struct ClaimCheckpoint(Arc<Mutex<Checkpoint>>);

impl ClaimCheckpoint {
    fn set(&self, checkpoint: Checkpoint) {
        if let Ok(mut c) = self.0.lock() {
            *c = checkpoint;
        }
    }

    /// The checkpoint of the claim transaction (`(None, None)`, which
    /// records none, before the first claim).
    pub(crate) fn get(&self) -> Checkpoint {
        self.0.lock().map(|c| *c).unwrap_or((None, None))
    }
}

/// Candidates of [`claim_sql`] from `source` (a query of column `id`, in the
/// order to claim them), locked in that order up to `limit` rows. The
/// lock sits above the subquery, which has an OFFSET: PostgreSQL pushes no
/// condition into such a subquery, so the lock is tried only on rows every
/// other condition let through (a condition pushed down beside it could be
/// evaluated after it, and a row locked that the query then drops).
fn locked(source: &str, limit: &str) -> String {
    format!(
        "SELECT c.id FROM ({source} OFFSET 0) c WHERE pg_try_advisory_xact_lock($3::int4, {key}) LIMIT {limit}",
        key = claim_key!("c.id")
    )
}

/// Claim events of subscription $2 (`text`) for competing mode: at most
/// $1 (`bigint`) events whose claim lock (class $3, `int4`) no other
/// transaction holds, taken in the claim transaction (see the module).
/// One row: `top` and `next_xid` (the checkpoint), and `ids` (`bigint[]`),
/// the events locked: due failure rows by `next_retry_at`
/// (`outbox_subscription_failures_due_idx`), held ones by id
/// (`outbox_subscription_failures_held_idx`, migration 0018), then fresh
/// events above the cursor by the primary key, up to
/// [`SUBSCRIPTION_WINDOW`] ids above it, skipping the ids settled above it
/// and, while the subscription has failure rows above its cursor (the
/// first found by a descent of the failure rows' primary key, in its
/// order: as EXISTS, the planner may scan them all), those with one (a
/// primary-key probe per event walked). Nothing while the
/// subscription is paused or gone.
pub(crate) fn claim_sql() -> String {
    let due = locked(
        "SELECT f.id FROM events.outbox_subscription_failures f \
          WHERE f.subscription = $2::text AND f.next_retry_at <= now() AND (SELECT s.active FROM sub s) \
          ORDER BY f.next_retry_at",
        "$1",
    );
    let held = locked(
        "SELECT f.id FROM events.outbox_subscription_failures f \
          WHERE f.subscription = $2::text AND f.next_retry_at IS NULL AND (SELECT s.active FROM sub s) \
          ORDER BY f.id",
        "$1 - (SELECT count(*) FROM d)",
    );
    let fresh = locked(
        &format!(
            "SELECT o.id FROM events.outbox o \
              WHERE o.id > (SELECT s.cursor_id FROM sub s) \
                AND o.id <= (SELECT s.cursor_id FROM sub s) + {SUBSCRIPTION_WINDOW} \
                AND (SELECT s.active FROM sub s) AND o.id NOT IN (SELECT unnest(s.settled) FROM sub s) \
                AND (NOT (SELECT s.failed_above FROM sub s) OR (SELECT f.id FROM events.outbox_subscription_failures f \
                       WHERE f.subscription = $2::text AND f.id = o.id) IS NULL) \
              ORDER BY o.id"
        ),
        "$1 - (SELECT count(*) FROM d) - (SELECT count(*) FROM h)",
    );
    format!(
        "WITH sub AS MATERIALIZED (SELECT s.cursor_id, s.settled, s.state = 'active' AS active, \
           (SELECT f.id FROM events.outbox_subscription_failures f \
             WHERE f.subscription = s.name AND f.id > s.cursor_id ORDER BY f.id LIMIT 1) IS NOT NULL AS failed_above \
           FROM events.outbox_subscriptions s WHERE s.name = $2::text), \
         cp AS MATERIALIZED ({checkpoint}), \
         d AS MATERIALIZED ({due}), \
         h AS MATERIALIZED ({held}), \
         n AS MATERIALIZED ({fresh}) \
         SELECT (SELECT cp.top FROM cp) AS top, (SELECT cp.next_xid FROM cp) AS next_xid, \
           ARRAY(SELECT d.id FROM d UNION ALL SELECT h.id FROM h UNION ALL SELECT n.id FROM n) AS ids",
        checkpoint = super::subscription::checkpoint_sql(),
    )
}

/// The events $1 (`bigint[]`) of subscription $3 (`text`) that [`claim_sql`]
/// locked and that are still due in this statement's snapshot, in id
/// order up to the byte budget $2 (`bigint`, [`within_budget`]): those
/// with a failure row that is due or held (not waiting for a retry, not a
/// dead letter), and those without one above the cursor and not settled.
/// The event columns, `retry_count` and `last_error` from the failure row
/// (0 and NULL without one), and `failure_row`. A primary-key lookup of
/// each id in both tables (the failure row's a lateral probe, so no plan
/// joins the subscription's failure rows, dead letters included, by
/// scanning them).
pub(crate) fn claimed_rows_sql(sizes: PayloadSizes) -> String {
    let candidates = "SELECT o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.occurred_at, \
           coalesce(f.retry_count, 0) AS retry_count, f.last_error, f.id IS NOT NULL AS failure_row \
         FROM events.outbox o \
         LEFT JOIN LATERAL (SELECT f.id, f.retry_count, f.last_error, f.next_retry_at \
           FROM events.outbox_subscription_failures f WHERE f.subscription = $3::text AND f.id = o.id LIMIT 1) f ON true \
         CROSS JOIN sub s \
         WHERE o.id = ANY ($1::bigint[]) AND s.active \
           AND CASE WHEN f.id IS NOT NULL THEN f.next_retry_at IS NULL OR f.next_retry_at <= now() \
                    ELSE o.id > s.cursor_id AND o.id <> ALL (s.settled) END";
    format!(
        "WITH sub AS MATERIALIZED (SELECT s.cursor_id, s.settled, s.state = 'active' AS active \
           FROM events.outbox_subscriptions s WHERE s.name = $3::text) {}",
        within_budget(&format!("{EVENT_COLUMNS}, failure_row"), candidates, "$2", sizes)
    )
}

/// A named subscription's claim statements, prepared on a work session
/// of competing mode, and the checkpoint its claim transaction read.
#[derive(Debug, Clone)]
pub(crate) struct SubscriptionClaim {
    claim: Statement,
    rows: Statement,
    class: i32,
    checkpoint: ClaimCheckpoint,
}

impl SubscriptionClaim {
    /// Prepare the claim of `reader` (a named subscription; `None` for the
    /// default, whose claim is `super::fetch::competing_fetch_sql`) on
    /// `client`.
    pub(crate) async fn prepare(
        client: &Client,
        reader: &Reader,
        sizes: PayloadSizes,
    ) -> Result<Option<Self>, tokio_postgres::Error> {
        let Some(class) = reader.claim_class() else { return Ok(None) };
        let claim = client.prepare(&claim_sql()).await?;
        let rows = client.prepare(&claimed_rows_sql(sizes)).await?;
        Ok(Some(SubscriptionClaim { claim, rows, class, checkpoint: ClaimCheckpoint::default() }))
    }

    /// The checkpoint its claim transactions read, for the writer.
    pub(crate) fn checkpoint(&self) -> ClaimCheckpoint {
        self.checkpoint.clone()
    }

    /// Claim up to `batch` events of subscription `name` within the byte
    /// budget `budget`, in the claim transaction just begun on `client`.
    pub(crate) async fn claim(
        &self,
        client: &Client,
        name: &str,
        batch: i64,
        budget: i64,
    ) -> Result<FetchPage, tokio_postgres::Error> {
        let row = client.query_one(&self.claim, &[&batch, &name, &self.class]).await?;
        self.checkpoint.set((row.try_get("top")?, row.try_get("next_xid")?));
        let ids: Vec<i64> = row.try_get("ids")?;
        if ids.is_empty() {
            return Ok(FetchPage::default());
        }
        let params: [&(dyn ToSql + Sync); 3] = [&ids, &budget, &name];
        super::page::decode_stream(client.query_raw(&self.rows, params).await?, budget, false).await
    }
}

/// The claim's statements for the plan tests: `subscription_claim`
/// (`claim_sql`: `$1 bigint` batch, `$2 text` name, `$3 int4` class)
/// and `subscription_claimed_rows` (`claimed_rows_sql` for the server
/// `server_version_num`: `$1 bigint[]` ids, `$2 bigint` byte budget,
/// `$3 text` name), and the claim class of subscription `name`.
#[cfg(feature = "kit")]
pub fn claim_statements(server_version_num: i32, name: &str) -> (Vec<(&'static str, String)>, Option<i32>) {
    let sizes = PayloadSizes::for_server(server_version_num);
    (
        vec![("subscription_claim", claim_sql()), ("subscription_claimed_rows", claimed_rows_sql(sizes))],
        Reader::Subscription(name.into()).claim_class(),
    )
}

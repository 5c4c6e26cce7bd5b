//! Subscriptions as the consumer reads them (migration 0016,
//! docs/subscriptions.md): whose events a consumer reads, the default
//! subscription (the seeded flow: `published_at` and the retry columns on
//! the row) or a named one (a cursor, the ids settled above it, and a row
//! per failed event in `events.outbox_subscription_failures`); its
//! leadership's lock key and term scope; and the checks a named one's
//! consumer makes before it starts.

use std::sync::Arc;

use tokio_postgres::GenericClient;

use super::locks::{COMPETING_CLASS, LEADER_KEY, MEMBER_CLASS, PARTITION_CLASS};
use crate::error::{Error, Result};

/// The scope of single mode's term in `events.outbox_terms` (migration
/// 0013): the whole outbox, the default subscription's.
pub(crate) const OUTBOX_SCOPE: &str = "outbox";

/// Whose events a consumer reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) enum Reader {
    /// The default subscription: the seeded flow.
    #[default]
    Default,
    /// A named subscription (a row of `events.outbox_subscriptions`).
    Subscription(Arc<str>),
}

/// The high 16 bits of a subscription's leader lock key: "po", as the
/// two-int4 classes of `super::locks` (docs/architecture.md, "Advisory
/// lock keys").
const SUBSCRIPTION_KEY_PREFIX: i64 = 0x706f << 48;

impl Reader {
    /// The named subscription, if this is one.
    pub(crate) fn subscription(&self) -> Option<&str> {
        match self {
            Reader::Default => None,
            Reader::Subscription(name) => Some(name),
        }
    }

    /// The bigint key of single mode's leader lock: [`LEADER_KEY`] for the
    /// default subscription; for a named one "po" in the two high bytes and
    /// the low 48 bits of the FNV-1a hash (64 bits) of its name, so that
    /// two subscriptions share a key with odds of about 1 in 2^48.
    pub(crate) fn leader_key(&self) -> i64 {
        match self {
            Reader::Default => LEADER_KEY,
            Reader::Subscription(name) => SUBSCRIPTION_KEY_PREFIX | (fnv1a(name.as_bytes()) & 0xFFFF_FFFF_FFFF) as i64,
        }
    }

    /// The scope of single mode's term in `events.outbox_terms`: `outbox`
    /// for the default subscription, `subscription:NAME` for a named one.
    pub(crate) fn leader_scope(&self) -> String {
        match self {
            Reader::Default => OUTBOX_SCOPE.to_string(),
            Reader::Subscription(name) => format!("subscription:{name}"),
        }
    }

    /// What every partition scope of partitioned mode's terms starts
    /// with: `partition:` for the default subscription,
    /// `subscription:NAME:partition:` for a named one (a name holds no
    /// `:`), so that a subscription's terms are a family of their own.
    pub(crate) fn partition_scope_prefix(&self) -> String {
        match self {
            Reader::Default => "partition:".to_string(),
            Reader::Subscription(name) => format!("subscription:{name}:partition:"),
        }
    }

    /// The class (first int4 key) of partitioned mode's partition locks:
    /// [`PARTITION_CLASS`] for the default subscription; for a named one
    /// `0x6` in the top four bits and the low 27 bits of the FNV-1a hash of
    /// its name, shifted left by one (an even number), so that two
    /// subscriptions share a class with odds of about 1 in 2^27 (they would
    /// then only compete for locks: terms and rows stay apart). Classes of
    /// `super::locks` start with `0x706f`, outside this range.
    pub(crate) fn partition_class(&self) -> i32 {
        match self {
            Reader::Default => PARTITION_CLASS,
            Reader::Subscription(name) => 0x6000_0000 | (((fnv1a(name.as_bytes()) & 0x07FF_FFFF) as i32) << 1),
        }
    }

    /// The class of partitioned mode's membership locks: [`MEMBER_CLASS`]
    /// for the default subscription; for a named one, its partition class
    /// plus one ([`Self::partition_class`]).
    pub(crate) fn member_class(&self) -> i32 {
        match self {
            Reader::Default => MEMBER_CLASS,
            Reader::Subscription(_) => self.partition_class() | 1,
        }
    }

    /// The class of competing mode's claim locks (one transaction-level
    /// advisory lock per event claimed, keyed by [`claim_key`]): none for
    /// the default subscription (its claims are row locks); for a named one
    /// `0x5` in the top four bits and the same 27 bits of the hash as
    /// [`Self::partition_class`], so two subscriptions share a claim class
    /// exactly when they share a partition class, which `subscription
    /// create` refuses.
    pub(crate) fn claim_class(&self) -> Option<i32> {
        match self {
            Reader::Default => None,
            Reader::Subscription(_) => Some(0x5000_0000 | (self.partition_class() & 0x0FFF_FFFF)),
        }
    }
}

impl Reader {
    /// The class of competing mode's membership lock, held by each
    /// competing consumer's work session for its lifetime
    /// ([`super::locks::COMPETING_LOCK`]): [`COMPETING_CLASS`] for the
    /// default subscription; for a named one its claim class plus one (an
    /// odd number, apart from every claim lock's class).
    pub(crate) fn competing_class(&self) -> i32 {
        match self.claim_class() {
            None => COMPETING_CLASS,
            Some(claim) => claim | 1,
        }
    }
}

/// The second key of the claim lock on event `id` ([`Reader::claim_class`]),
/// in SQL over an `int8` expression: the id's low 32 bits as an `int4`.
/// Ids 2^32 apart share a key: a claim of one then makes the other wait
/// for the next claim, never a second delivery.
macro_rules! claim_key {
    ($id:literal) => {
        concat!("((", $id, " % 4294967296) - 2147483648)::int4")
    };
}
pub(crate) use claim_key;

/// FNV-1a, 64 bits (a fixed function: the key must not change between
/// builds, unlike std's hasher).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// A checkpoint for a named subscription's cursor (migration 0016): the
/// highest id in `events.outbox` and the next transaction id, from one
/// snapshot, read in a transaction of its own that has no transaction id
/// (so the next id is the server's, not the reader's own: `age()` counts
/// from a transaction's own id once it has one), and NULLs where ids do not
/// follow transaction ids. Once no transaction below that next id runs in
/// this database, no event at or below that id can still commit. One row:
/// `top`, `next_xid`.
pub(crate) fn checkpoint_sql() -> String {
    format!(
        "SELECT CASE WHEN {} THEN (SELECT o.id FROM events.outbox o ORDER BY o.id DESC LIMIT 1) END AS top, \
         {} AS next_xid",
        super::fetch::IDS_AFTER_XIDS,
        super::fetch::NEXT_XID
    )
}

/// Move subscription $1's cursor with the checkpoint $3, $4 (`int8`), as
/// an acknowledgement of the events $2 (none: `'{}'`) does
/// ([`super::work::WorkSession::advance_idle`]). One row: `cursor_id`, the
/// cursor before the move (the statement's snapshot), NULL when the
/// subscription is gone (the acknowledgement then fails with P0002). Its
/// transaction commits as `$5` (`text`) says, as
/// [`super::settle::SUBSCRIPTION_ACK`]'s `$6`.
pub(crate) const ADVANCE_IDLE: &str = concat!(
    "SELECT (SELECT count(*) \
       FROM events.outbox_subscription_ack($1::text, $2::bigint[], true, $3::int8, $4::int8)) AS moved, \
     (SELECT s.cursor_id FROM events.outbox_subscriptions s WHERE s.name = $1::text) AS cursor_id, ",
    super::settle::commit_as!("$5")
);

/// What a named subscription's consumer needs of the database: the
/// subscription exists, and ids follow transaction ids (the insert trigger
/// `outbox_order` enabled in its `ids-after-xid` version and the id
/// sequence with `CACHE 1`): without that rule the cursor could pass an
/// event whose transaction commits late (docs/subscriptions.md, "Progress").
const CHECK: &str = "SELECT (SELECT s.state FROM events.outbox_subscriptions s WHERE s.name = $1) AS state, \
     coalesce((SELECT t.tgenabled IN ('O', 'A') AND strpos(p.prosrc, 'ids-after-xid') > 0 \
       AND (SELECT q.seqcache FROM pg_sequence q WHERE q.seqrelid = 'events.outbox_id_seq'::regclass) = 1 \
     FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid \
     WHERE t.tgrelid = 'events.outbox'::regclass AND t.tgname = 'outbox_order'), false) AS ids_after_xids";

/// Check that subscription `name` can be read ([`CHECK`]); returns its
/// state (`active` or `paused`).
///
/// # Errors
/// [`Error::Config`] naming the subscription when it does not exist (and
/// how to create it), or when ids do not follow transaction ids (and how
/// to install the trigger); [`Error::Subscription`] with
/// `SubscriptionError::Expired` when it expired; [`Error::NotMigrated`] without migration 0016;
/// [`Error::Db`] otherwise.
pub(crate) async fn check<C: GenericClient + Sync>(client: &C, name: &str) -> Result<String> {
    let row = client.query_one(CHECK, &[&name]).await.map_err(super::map_missing_schema)?;
    let state: Option<String> = row.try_get("state")?;
    let Some(state) = state else {
        return Err(Error::Config(format!(
            "subscription {name:?} does not exist: create it with `pg-outbox subscription create {name} --from now` \
             (or `--from earliest` for the retained history)"
        )));
    };
    if state == "expired" {
        return Err(crate::error::SubscriptionError::Expired(name.to_string()).into());
    }
    if !row.try_get::<_, bool>("ids_after_xids")? {
        return Err(Error::Config(format!(
            "subscription {name:?} needs ids to follow transaction ids (the insert trigger `outbox_order` enabled, \
             the id sequence with CACHE 1), or its cursor could pass an event that commits late; run \
             `pg-outbox migrate --ordering outbox-locked`"
        )));
    }
    Ok(state)
}

/// The backlog gauges of subscription $1 (`text`), each count read to at
/// most $2 + 1 rows (`bigint`; more says "at least"): `fresh`, events above
/// the cursor neither settled nor failed (a walk of the primary key from
/// the cursor); `waiting`, failure rows that are not dead letters (waiting
/// for a retry, due, or held back); `dead`, dead letters; and
/// `oldest_age`, seconds since the oldest of the first fresh event and
/// the failed events not dead (NULL: none). Index walks from the cursor
/// and over the subscription's failure rows only, whatever the size of
/// the table; the failure rows above the cursor are read once into a
/// hashed set (as a per-event probe, with statistics taken while the
/// failures table was empty, the planner scanned every failure row for
/// each event walked).
pub(crate) const GAUGES: &str = "WITH s AS MATERIALIZED (SELECT cursor_id, settled FROM events.outbox_subscriptions \
       WHERE name = $1::text), \
     fresh AS MATERIALIZED (SELECT o.id, o.occurred_at FROM events.outbox o \
       WHERE o.id > (SELECT cursor_id FROM s) AND o.id NOT IN (SELECT unnest(settled) FROM s) \
         AND o.id NOT IN (SELECT f.id FROM events.outbox_subscription_failures f \
                           WHERE f.subscription = $1::text AND f.id > (SELECT cursor_id FROM s)) \
       ORDER BY o.id LIMIT $2::int8 + 1) \
     SELECT (SELECT count(*) FROM fresh) AS fresh, \
       (SELECT count(*) FROM (SELECT 1 FROM events.outbox_subscription_failures f \
          WHERE f.subscription = $1::text AND (f.next_retry_at IS NULL OR f.next_retry_at < 'infinity') \
          LIMIT $2::int8 + 1) w) AS waiting, \
       (SELECT count(*) FROM (SELECT 1 FROM events.outbox_subscription_failures f \
          WHERE f.subscription = $1::text AND f.next_retry_at = 'infinity' LIMIT $2::int8 + 1) d) AS dead, \
       EXTRACT(EPOCH FROM (now() - least( \
         (SELECT f.occurred_at FROM fresh f WHERE f.id = (SELECT min(m.id) FROM fresh m)), \
         (SELECT min(o.occurred_at) FROM (SELECT f.id FROM events.outbox_subscription_failures f \
            WHERE f.subscription = $1::text AND (f.next_retry_at IS NULL OR f.next_retry_at < 'infinity') \
            ORDER BY f.id LIMIT 1) f JOIN events.outbox o ON o.id = f.id))))::float8 AS oldest_age";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_keys_are_fixed_per_name_and_apart_from_the_outboxs() {
        let audit = Reader::Subscription("audit".into());
        assert_eq!(audit.leader_key(), Reader::Subscription("audit".into()).leader_key());
        assert_ne!(audit.leader_key(), Reader::Subscription("audit2".into()).leader_key());
        assert_ne!(audit.leader_key(), LEADER_KEY);
        assert_eq!(audit.leader_key() >> 48, 0x706f);
        // FNV-1a of "a", a published test vector: af63dc4c8601ec8c.
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(audit.leader_scope(), "subscription:audit");
        assert_eq!(Reader::Default.leader_scope(), "outbox");
    }

    #[test]
    fn partition_locks_and_scopes_are_a_family_per_subscription() {
        let audit = Reader::Subscription("audit".into());
        assert_eq!(Reader::Default.partition_class(), PARTITION_CLASS);
        assert_eq!(Reader::Default.member_class(), MEMBER_CLASS);
        assert_eq!(Reader::Default.partition_scope_prefix(), "partition:", "the default's scopes, partition:P/N");
        assert_eq!(audit.partition_scope_prefix(), "subscription:audit:partition:");
        let (p, m) = (audit.partition_class(), audit.member_class());
        assert_eq!(p >> 28, 0x6, "{p:#x}");
        assert_eq!((p & 1, m), (0, p | 1));
        for other in ["audit2", "search", "a"] {
            let o = Reader::Subscription(other.into());
            assert_ne!(o.partition_class(), p, "{other}");
            assert_eq!(o.partition_class() >> 28, 0x6);
        }
        // Two names found to share a class (refused at create:
        // `SubscriptionError::LockClassTaken`).
        let (x, y) = (Reader::Subscription("s61396".into()), Reader::Subscription("s189520".into()));
        assert_eq!(x.partition_class(), y.partition_class());
        assert_eq!(x.partition_class(), 0x6c68_a576);
        for class in [PARTITION_CLASS, MEMBER_CLASS, super::super::locks::TRIGGER_CLASS] {
            assert_ne!(class >> 28, 0x6, "the outbox's classes lie outside the subscriptions' range");
            assert_ne!(class >> 28, 0x5, "and outside the claims' range");
        }
        assert_eq!(Reader::Default.claim_class(), None, "the default claims rows");
        assert_eq!(x.claim_class(), y.claim_class(), "a claim class is shared with the partition class");
        assert_eq!(audit.claim_class(), Some(0x5000_0000 | (p & 0x0FFF_FFFF)));
        assert_ne!(audit.claim_class(), Reader::Subscription("audit2".into()).claim_class());
        assert_eq!(Reader::Default.competing_class(), COMPETING_CLASS);
        assert_eq!(audit.competing_class(), audit.claim_class().unwrap_or_default() | 1);
        for class in [PARTITION_CLASS, MEMBER_CLASS, COMPETING_CLASS, super::super::locks::TRIGGER_CLASS] {
            assert_eq!(class >> 16, 0x706f, "the outbox's classes share their high half");
        }
    }
}

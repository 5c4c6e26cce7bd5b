//! Leadership terms: the number a consumer takes with the outbox (single
//! mode) or with a partition (partitioned mode), kept per scope in
//! `events.outbox_terms` (migration 0013) and one greater each time the
//! scope changes hands.

use serde::Serialize;
use tokio_postgres::types::{FromSql, Type, accepts};

/// A leadership term: 1 for the first holder of a scope, then one more each
/// time another consumer takes it over. A consumer holds the term it took
/// until it loses its lock; a write of settlements names the terms it was
/// handed out under, and is dropped when one of them is no longer current
/// (a deposed relay). Each delivery carries its term
/// ([`crate::Delivery::term`]) so a destination can refuse a lower one.
///
/// Displayed and serialized as the bare number (`7`).
///
/// # Example
/// ```
/// use pg_outbox::Term;
/// let t = Term::new(7).expect("terms start at 1");
/// assert_eq!(t.get(), 7);
/// assert_eq!(t.to_string(), "7");
/// assert!(Term::new(0).is_none());
/// assert!(Term::new(8) > Some(t));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct Term(u64);

impl Term {
    /// The term numbered `n`; `None` for 0, which no scope ever holds (the
    /// first term is 1).
    pub const fn new(n: u64) -> Option<Term> {
        if n == 0 { None } else { Some(Term(n)) }
    }

    /// The term's number (1 or more).
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The term stored as `bigint` `n` in `events.outbox_terms`; `None` for
    /// 0 or below (the fetch's "no term" for a partition without one).
    pub(crate) fn from_db(n: i64) -> Option<Term> {
        u64::try_from(n).ok().and_then(Term::new)
    }

    /// The term as `events.outbox_terms` stores it (`bigint`); a term past
    /// `i64::MAX`, which the table cannot hold, saturates.
    pub(crate) fn to_db(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }
}

impl std::fmt::Display for Term {
    /// The bare number.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Read from a `bigint` column of `events.outbox_terms`; a value below 1,
/// which no scope holds, is an error naming it.
impl<'a> FromSql<'a> for Term {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Term, Box<dyn std::error::Error + Sync + Send>> {
        let n = i64::from_sql(ty, raw)?;
        Term::from_db(n).ok_or_else(|| format!("leadership term {n} is below 1").into())
    }

    accepts!(INT8);
}

impl From<Term> for u64 {
    fn from(t: Term) -> u64 {
        t.0
    }
}

/// A destination's fence against a deposed relay: it remembers the
/// highest leadership term it accepted per aggregate, and refuses a
/// delivery that carries a lower one.
///
/// The term fences what the relay hands out and what it writes, but a
/// delivery already on its way when its relay was deposed (at most
/// `--max-in-flight` of them, at most one per aggregate, each handed out
/// within its relay's lease) can still arrive after the successor's first
/// delivery of the same aggregate. An at-least-once destination that keeps
/// per-aggregate order refuses those by their term: every delivery carries
/// it ([`crate::Delivery::term`], the header `term`, the webhook's
/// `outbox-term`, the CloudEvents attribute `outboxterm`). An equal term
/// is accepted (a redelivery by the same leader; two partitions taken at
/// the same moment may share a number). A refused delivery should be
/// acknowledged to its sender and dropped: the successor delivers that
/// event again under its own term.
///
/// Kept in memory, one entry per aggregate seen (about 48 bytes each with
/// a `Uuid` key); a destination that restarts or runs several instances
/// should keep the highest term per aggregate in its own store, in the
/// transaction that applies the event, with the same rule.
///
/// # Example
/// ```
/// use pg_outbox::{Term, TermFilter};
/// let mut fence = TermFilter::new();
/// let order = uuid::Uuid::new_v4();
/// let (t3, t4) = (Term::new(3).unwrap(), Term::new(4).unwrap());
/// assert!(fence.admit(order, t3));
/// assert!(fence.admit(order, t4), "the successor's delivery");
/// assert!(!fence.admit(order, t3), "the deposed relay's, arriving late: refused");
/// assert!(fence.admit(order, t4), "a redelivery under the same term");
/// ```
#[derive(Debug, Clone)]
pub struct TermFilter<K = uuid::Uuid> {
    highest: std::collections::HashMap<K, Term>,
}

impl<K: Eq + std::hash::Hash> Default for TermFilter<K> {
    fn default() -> Self {
        TermFilter { highest: std::collections::HashMap::new() }
    }
}

impl<K: Eq + std::hash::Hash> TermFilter<K> {
    /// An empty filter: every aggregate's first delivery is accepted.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether to accept a delivery of `aggregate` under `term`: `true`
    /// (and `term` is remembered) unless a higher term of that aggregate was
    /// accepted before.
    pub fn admit(&mut self, aggregate: K, term: Term) -> bool {
        let highest = self.highest.entry(aggregate).or_insert(term);
        if term < *highest {
            return false;
        }
        *highest = term;
        true
    }

    /// The highest term accepted for `aggregate`, if any.
    pub fn highest(&self, aggregate: &K) -> Option<Term> {
        self.highest.get(aggregate).copied()
    }

    /// How many aggregates the filter remembers.
    pub fn len(&self) -> usize {
        self.highest.len()
    }

    /// Whether it remembers none.
    pub fn is_empty(&self) -> bool {
        self.highest.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_refuses_only_a_lower_term_of_the_same_aggregate() {
        let t = |n| Term::new(n).expect("term");
        let mut f: TermFilter<&str> = TermFilter::new();
        assert!(f.admit("a", t(5)));
        assert!(f.admit("b", t(2)), "another aggregate is not fenced by a's term");
        assert!(!f.admit("a", t(4)));
        assert!(f.admit("a", t(5)));
        assert!(f.admit("a", t(9)));
        assert!(!f.admit("a", t(5)));
        assert_eq!((f.highest(&"a"), f.highest(&"c"), f.len()), (Some(t(9)), None, 2));
    }

    #[test]
    fn stored_terms_below_one_are_none_and_round_trip_otherwise() {
        assert_eq!(Term::from_db(0), None);
        assert_eq!(Term::from_db(-1), None);
        assert_eq!(Term::from_db(3).map(Term::to_db), Some(3));
        assert_eq!(Term::new(u64::MAX).map(Term::to_db), Some(i64::MAX));
        assert_eq!(serde_json::to_string(&Term::new(9)).expect("json"), "9");
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_terms_below_one_are_none_and_round_trip_otherwise() {
        assert_eq!(Term::from_db(0), None);
        assert_eq!(Term::from_db(-1), None);
        assert_eq!(Term::from_db(3).map(Term::to_db), Some(3));
        assert_eq!(Term::new(u64::MAX).map(Term::to_db), Some(i64::MAX));
        assert_eq!(serde_json::to_string(&Term::new(9)).expect("json"), "9");
    }
}

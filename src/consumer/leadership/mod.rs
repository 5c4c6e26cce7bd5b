//! Leadership: who may hand events out, under which term, and for how
//! long.
//!
//! - [`ownership`]: the locks by mode (single mode's outbox lock,
//!   partitioned mode's membership and partition locks), the leadership
//!   term taken with each (`events.outbox_terms`, [`crate::Term`]), what a
//!   fetch's rows say of the terms held ([`TermCheck`]), and the fence a
//!   settlement write is conditional on;
//! - [`lease`]: the hand-out lease (nothing is handed out unless a
//!   statement found the term current within [`LEASE`]) and the wait after
//!   taking over from a holder that did not release its term
//!   ([`lease::TAKEOVER_WAIT`]);
//! - [`stranded`]: a standby's watch on the holder of the outbox lock, and
//!   the takeover of a stranded one.
//!
//! The sources hold an [`Ownership`] (competing mode takes none); the
//! drain loop and the stream hold the [`lease::Lease`]. docs/architecture.md,
//! "Leadership terms", tells the whole protocol.

pub(super) mod lease;
mod ownership;
mod stranded;

pub(super) use lease::LEASE;
pub(super) use ownership::{Ownership, TermCheck};

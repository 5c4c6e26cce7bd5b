//! The outbox's figures, as `pg-outbox status` prints them: [`read`] takes
//! them in bounded time, whatever the backlog's size, into an
//! [`OutboxStatus`]: the backlog by state and by type, the retry ladder,
//! and who holds the outbox's leader and partition locks.
//!
//! # Example
//! ```no_run
//! # async fn run(client: &tokio_postgres::Client) -> Result<(), pg_outbox::Error> {
//! let status = pg_outbox::status::read(client).await?;
//! println!("{} unpublished, {} dead letters", status.unpublished, status.dead_letters);
//! if status.estimated {
//!     println!("estimated: {:?}", status.estimated_figures);
//! }
//! # Ok(()) }
//! ```

pub use crate::store::status as read;
pub use crate::store::{
    LeaderLock, OutboxStatus, PartitionHolder, PendingRetry, RelayIdentity, RetryLadder, TypeBacklog,
};

/// The bounds of [`read`].
impl OutboxStatus {
    /// Rows of each class (fresh, due retries, waiting for a retry, dead
    /// letters) counted exactly before that class's figures are estimated:
    /// 2 000. Reading them costs at most about four buffers a row (measured:
    /// 16 ms for all four classes at 10 000 000 unpublished rows and
    /// 1 000 000 dead letters, `cargo bench --features full --bench
    /// console`).
    pub const EXACT_ROWS: i64 = crate::store::STATUS_EXACT_ROWS;
    /// Ids an estimate draws and looks up by primary key in each stratum
    /// (fresh rows, dead letters, retries; only those estimated): 500, about
    /// 15 ms a stratum on a table that does not fit in shared buffers
    /// (docs/operations.md, "How `status` estimates").
    pub const SAMPLE_IDS: i64 = crate::store::STATUS_SAMPLE_IDS;
    /// Most `(event_type, aggregate_type)` rows [`read`] returns
    /// ([`OutboxStatus::by_type`]): 50.
    pub const MAX_TYPES: i64 = crate::store::STATUS_MAX_TYPES;
    /// How many of the next retry-due events [`read`] lists
    /// ([`RetryLadder::next`]): 5.
    pub const NEXT_RETRIES: i64 = crate::store::STATUS_NEXT_RETRIES;
}

//! The builder's checks of its settings before a consumer starts.

use super::{ConsumerBuilder, ConsumerConfig, MAX_STATEMENT_TIMEOUT, Mode};
use crate::error::{Error, Result};
use crate::store::AckCommit;
use crate::store::subscription_admin::check_name;

impl ConsumerBuilder {
    /// Check the settings, and fill in those derived from others (the
    /// buffer from the batch size).
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting out of range, and
    /// [`Error::Subscription`] for an invalid subscription name.
    pub(in crate::consumer) fn validate(&mut self) -> Result<()> {
        let c = &mut self.cfg;
        if c.batch_size == 0 || c.batch_size > ConsumerBuilder::MAX_BATCH_SIZE {
            return Err(Error::Config(format!(
                "batch size must be 1..={} rows, got {}",
                ConsumerBuilder::MAX_BATCH_SIZE,
                c.batch_size
            )));
        }
        if c.buffer == 0 {
            c.buffer = c.batch_size * 2;
        }
        c.buffer = c.buffer.max(c.batch_size);
        if c.max_buffered_bytes < ConsumerBuilder::MIN_MAX_BUFFERED_BYTES
            || i64::try_from(c.max_buffered_bytes).is_err()
        {
            return Err(Error::Config(format!(
                "max buffered bytes must be at least {} (1 MiB), got {}",
                ConsumerBuilder::MIN_MAX_BUFFERED_BYTES,
                c.max_buffered_bytes
            )));
        }
        if c.sweep_interval.is_zero() {
            return Err(Error::Config("sweep interval must be longer than zero".into()));
        }
        if c.max_retries < 1 {
            return Err(Error::Config(format!("max retries must be at least 1, got {}", c.max_retries)));
        }
        if c.ack_batch_size == 0 {
            return Err(Error::Config("acknowledgement batch size must be at least 1".into()));
        }
        if let Mode::Partitioned { partitions } = c.mode
            && !(1..=4096).contains(&partitions)
        {
            return Err(Error::Config(format!("partitions must be 1..=4096, got {partitions}")));
        }
        if c.ping_interval.is_zero() || c.reconnect_max_delay.is_zero() {
            return Err(Error::Config("ping interval and reconnect delay must be longer than zero".into()));
        }
        if !(ConsumerBuilder::MIN_STRANDED_AFTER..=ConsumerBuilder::MAX_STRANDED_AFTER).contains(&c.stranded_after) {
            return Err(Error::Config(format!("stranded-after must be 3 s to 1 hour, got {:?}", c.stranded_after)));
        }
        check_subscription(c)?;
        if c.statement_timeout > MAX_STATEMENT_TIMEOUT {
            return Err(Error::Config(format!(
                "statement timeout must be at most {} ms (about 24.8 days; 0 disables it), got {:?}",
                i32::MAX,
                c.statement_timeout
            )));
        }
        Ok(())
    }
}

/// A named subscription's name is one.
///
/// # Errors
/// [`Error::Subscription`] for an invalid name.
/// [`Error::Config`] for durable acknowledgements asked of the default
/// subscription, which always acknowledges durably.
fn check_subscription(c: &ConsumerConfig) -> Result<()> {
    match c.reader.subscription() {
        Some(name) => check_name(name),
        None if c.ack_commit == AckCommit::Durable => Err(Error::Config(
            "durable acknowledgements apply to a named subscription: the default subscription always \
             acknowledges durably (its published_at commits as the session says)"
                .into(),
        )),
        None => Ok(()),
    }
}

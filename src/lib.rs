#![doc = include_str!("guide.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub, rust_2018_idioms)]
#![doc(test(attr(deny(warnings), allow(dead_code))))]

mod connect;
#[cfg(feature = "console")]
#[cfg_attr(docsrs, doc(cfg(feature = "console")))]
pub mod console;
mod consumer;
pub mod dead_letters;
pub mod error;
mod event;
pub mod metrics;
pub mod migrate;
mod publisher;
#[cfg(feature = "relay")]
#[cfg_attr(docsrs, doc(cfg(feature = "relay")))]
pub mod relay;
pub mod retention;
mod retry;
mod secret;
mod store;
#[cfg(feature = "temp-server")]
#[cfg_attr(docsrs, doc(cfg(feature = "temp-server")))]
pub mod temp_server;
mod term;

pub use connect::{ConnectOptions, DEFAULT_CONNECT_TIMEOUT, RootCert, SessionMode, SslMode, TlsConnector};
pub use consumer::{
    Consumer, ConsumerBuilder, DEFAULT_ACK_BATCH_SIZE, DEFAULT_ACK_INTERVAL, DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_RETRIES, DEFAULT_PING_INTERVAL, DEFAULT_RECONNECT_MAX_DELAY,
    DEFAULT_SHUTDOWN_GRACE, DEFAULT_STATEMENT_TIMEOUT, DEFAULT_STRANDED_AFTER, DEFAULT_SWEEP_INTERVAL, Delivery,
    EventStream, HEALTH_ERROR_BYTES, Health, HealthMonitor, LastError, ListenerStatus, MAX_ERROR_BYTES,
    MAX_STRANDED_AFTER, MIN_MAX_BUFFERED_BYTES, MIN_STRANDED_AFTER, Mode, NOTIFY_CHANNEL, Role, ShutdownHandle,
    SinkHealth, SourceKind,
};
pub use error::{Error, Result};
pub use event::{Envelope, Event, Metadata, NewEvent};
pub use publisher::{DEFAULT_MAX_PAYLOAD_BYTES, Publisher};
pub use retry::{AfterLastStep, DEFAULT_RETRY_CAP, DEFAULT_RETRY_JITTER, DEFAULT_RETRY_STEPS, RetryPolicy};
pub use secret::{DatabaseUrl, MASK, Secret, SecretUrl};
pub use store::{
    LeaderLock, OutboxStatus, PartitionHolder, PendingRetry, RelayIdentity, RetryLadder, STATUS_EXACT_ROWS,
    STATUS_MAX_TYPES, STATUS_NEXT_RETRIES, STATUS_SAMPLE_IDS, TypeBacklog, status,
};
/// The statements behind the consumer, for the plan tests
/// (`EXPLAIN (ANALYZE, BUFFERS)` under every statistics state). Not part of
/// the API: they change with any release.
#[doc(hidden)]
pub use store::{fetch_query, run_time_statements};
pub use term::{Term, TermFilter};
pub use tokio_postgres;

#[cfg(test)]
mod surface;

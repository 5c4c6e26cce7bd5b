//! The consumer: an async [`Stream`](futures::Stream) of [`Delivery`] values.
//!
//! - `config`: the builder, its defaults and their validation;
//! - `start`: connecting, checking the schema, and wiring the tasks;
//! - `stream`: the handle the user holds ([`EventStream`],
//!   [`ShutdownHandle`]) and what it shares with the drain loop;
//! - `drain`: the engine, one task that fetches through a `source`, hands
//!   out, and settles (docs/architecture.md, "The drain loop").

mod completer;
mod config;
mod cx;
mod delivery;
mod drain;
mod health;
mod holdback;
mod inflight;
mod leadership;
mod maintenance;
mod session;
mod source;
mod start;
mod stream;

pub use config::{
    Consumer, ConsumerBuilder, DEFAULT_ACK_BATCH_SIZE, DEFAULT_ACK_INTERVAL, DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_RETRIES, DEFAULT_PING_INTERVAL, DEFAULT_RECONNECT_MAX_DELAY,
    DEFAULT_SHUTDOWN_GRACE, DEFAULT_STATEMENT_TIMEOUT, DEFAULT_STRANDED_AFTER, DEFAULT_SWEEP_INTERVAL, MAX_ERROR_BYTES,
    MAX_STRANDED_AFTER, MIN_MAX_BUFFERED_BYTES, MIN_STRANDED_AFTER, Mode, NOTIFY_CHANNEL, SourceKind,
};
pub(crate) use config::{ConsumerConfig, PROBE_TIMEOUT, STATUS_INTERVAL};
pub use delivery::Delivery;
pub use health::{HEALTH_ERROR_BYTES, Health, HealthMonitor, LastError, Role, SinkHealth};
pub(crate) use stream::Shared;
pub use stream::{EventStream, ListenerStatus, ShutdownHandle};

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

pub(crate) use crate::migrate::SourceKind;
pub use config::{Consumer, ConsumerBuilder, Mode};
pub(crate) use config::{ConsumerConfig, PROBE_TIMEOUT, STATUS_INTERVAL};
pub use delivery::Delivery;
pub use health::{Health, HealthMonitor, LastError, Role, SinkHealth};
pub(crate) use stream::Shared;
pub use stream::{EventStream, ListenerStatus, ShutdownHandle};

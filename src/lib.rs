#![doc = include_str!("guide.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub, rust_2018_idioms)]
#![doc(test(attr(deny(warnings), allow(dead_code))))]

mod connect;
/// The operator console's reads, for `pg-outbox console` (feature
/// `console`, which `cli` turns on). Not part of the API: they change with
/// any release.
#[cfg(feature = "console")]
#[doc(hidden)]
pub mod console;
mod consumer;
pub mod dead_letters;
pub mod error;
mod event;
pub mod health;
pub mod metrics;
pub mod migrate;
mod publisher;
#[cfg(feature = "relay")]
#[cfg_attr(docsrs, doc(cfg(feature = "relay")))]
pub mod relay;
pub mod retention;
mod retry;
pub mod secret;
pub mod status;
mod store;
pub mod subscription;
mod term;
pub mod tls;

pub use connect::{ConnectOptions, SessionMode};
pub use consumer::{Consumer, ConsumerBuilder, Delivery, EventStream, Mode, ShutdownHandle};
pub use error::{Error, Result};
pub use event::{Envelope, Event, Metadata, NewEvent};
pub use migrate::SourceKind;
pub use publisher::Publisher;
pub use retry::{AfterLastStep, RetryPolicy};
pub use secret::DatabaseUrl;
/// The statements behind the consumer, for the plan tests
/// (`EXPLAIN (ANALYZE, BUFFERS)` under every statistics state), with the
/// test kit's feature `kit`. Not part of the API: they change with any
/// release.
#[cfg(feature = "kit")]
#[doc(hidden)]
pub use store::{fetch_query, run_time_statements};
pub use term::{Term, TermFilter};
pub use tokio_postgres;

#[cfg(test)]
mod surface;

//! Integration tests against a real PostgreSQL (see `support`).

mod auto_traits;
#[cfg(any(feature = "nats", feature = "redis"))]
mod broker_relay;
mod cli;
mod consumer;
mod dead_letters;
mod fault_suite;
mod faults;
mod modes;
mod order;
mod relay;
mod retention;
mod schema;
#[cfg(feature = "nats")]
mod sink_nats;
#[cfg(feature = "redis")]
mod sink_redis;
mod support;

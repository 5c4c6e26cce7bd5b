//! Integration tests against a real PostgreSQL (see `support`).

mod auto_traits;
#[cfg(any(feature = "nats", feature = "redis"))]
mod broker_relay;
mod cli;
mod config;
mod consumer;
mod contrib;
mod dead_letters;
mod fault_suite;
mod faults;
mod modes;
mod operator;
mod order;
mod plan_states;
mod plans;
mod relay;
mod relay_proc;
mod retention;
mod schema;
#[cfg(feature = "amqp")]
mod sink_amqp;
#[cfg(feature = "kafka")]
mod sink_kafka;
#[cfg(feature = "nats")]
mod sink_nats;
#[cfg(feature = "redis")]
mod sink_redis;
mod sink_relay;
mod status_detail;
mod support;
mod timeouts;
mod tls;
mod webhook_signing;

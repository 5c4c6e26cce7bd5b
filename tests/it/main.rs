//! Integration tests against a real PostgreSQL (see `support` and the
//! `pg-outbox-testkit` crate).

mod auto_traits;
mod broker_tls;
mod brokers;
mod byte_bound;
mod cancel_safety;
mod cli;
mod config;
mod console;
mod consumer;
mod container;
mod contrib;
mod dead_letters;
#[cfg(all(feature = "nats", feature = "redis"))]
mod exactly_once;
#[cfg(all(feature = "nats", feature = "redis"))]
mod exactly_once_proof;
#[cfg(feature = "redis")]
mod exactly_once_unblock;
mod failover;
mod faults;
mod freeze;
mod health;
mod layers;
mod libpq;
mod managed;
mod modes;
mod needs;
mod order;
mod ordering_modes;
#[cfg(feature = "relay")]
mod pipeline;
#[cfg(all(feature = "nats", feature = "redis"))]
mod pipeline_faults;
mod plan_states;
mod plans;
mod poolers;
mod relay;
mod relay_proc;
mod replay;
mod retention;
mod schema;
mod secrets;
mod signals;
#[cfg(feature = "amqp")]
mod sink_amqp;
#[cfg(feature = "kafka")]
mod sink_kafka;
#[cfg(feature = "nats")]
mod sink_nats;
#[cfg(feature = "redis")]
mod sink_redis;
#[cfg(feature = "sqlx")]
mod sqlx_publish;
mod status_detail;
mod stranded;
mod subscription_admin;
mod subscription_competing;
mod subscription_partitions;
mod subscription_plans;
mod subscriptions;
mod support;
mod terms;
mod timeouts;
mod tls;
mod versions;
#[cfg(feature = "wal")]
mod wal;
mod webhook_signing;

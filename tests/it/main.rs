//! Integration tests against a real PostgreSQL (see `support`).

mod auto_traits;
mod cli;
mod config;
mod consumer;
mod dead_letters;
mod fault_suite;
mod faults;
mod modes;
mod order;
mod relay;
mod retention;
mod schema;
mod support;
mod tls;

//! Health of a running consumer, for liveness and readiness probes:
//! [`EventStream::health`](crate::EventStream::health) hands out a
//! [`HealthMonitor`], whose [`HealthMonitor::get`] reads a [`Health`]
//! snapshot: whether the drain loop turns, this consumer's [`Role`], the
//! LISTEN connection's state ([`ListenerStatus`]), the last database error
//! ([`LastError`]) and, under `relay::run`, the sink's side
//! ([`SinkHealth`]).

pub use crate::consumer::{Health, HealthMonitor, LastError, ListenerStatus, Role, SinkHealth};

//! The built-in sinks, one file each, each with its options struct and its
//! `open` function; [`super::SINKS`] lists them.

#[cfg(feature = "amqp")]
pub(crate) mod amqp;
#[cfg(feature = "kafka")]
pub(crate) mod kafka;
#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod stdout;
#[cfg(feature = "webhook")]
pub(crate) mod webhook;

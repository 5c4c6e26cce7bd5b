//! What the drain loop's statements run on ([`Cx`]: the work session and
//! when to give up), shared by the sources and leadership.

use std::future::Future;

use futures::future::Either;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::WorkSession;

/// `d` plus up to 10 %, so consumers started together spread out.
pub(super) fn jittered(d: std::time::Duration) -> std::time::Duration {
    d.mul_f64(1.0 + rand::random::<f64>() * 0.1)
}

/// When a source's statements must give up.
#[derive(Clone, Copy)]
pub(super) enum Stop<'a> {
    /// When the consumer is told to stop.
    Token(&'a CancellationToken),
    /// At this time (the consumer is stopping, within its shutdown grace).
    At(Instant),
}

impl<'a> Stop<'a> {
    /// Resolves when it is time to give up, and again each time it is
    /// polled after that (one stop may serve several statements in turn).
    pub(super) fn wait(self) -> impl Future<Output = ()> + Send + 'a {
        match self {
            Stop::Token(token) => Either::Left(token.cancelled()),
            Stop::At(at) => Either::Right(tokio::time::sleep_until(at)),
        }
    }
}

/// What a source's statements run on: the open work session, and when to
/// give up.
#[derive(Clone, Copy)]
pub(super) struct Cx<'a> {
    pub(super) work: &'a WorkSession,
    pub(super) stop: Stop<'a>,
}

impl<'a> Cx<'a> {
    /// Resolves when a statement must give up (it then gets a short grace,
    /// then is cancelled: `store::statement::run`).
    pub(super) fn stop(&self) -> impl Future<Output = ()> + Send + 'a {
        self.stop.wait()
    }

    /// The consumer is stopping.
    pub(super) fn stopping(&self) -> bool {
        match self.stop {
            Stop::Token(token) => token.is_cancelled(),
            Stop::At(_) => true,
        }
    }
}

//! Signals: graceful shutdown on SIGINT/SIGTERM, and SIGPIPE's default
//! action for the short commands.

use std::future::Future;

/// Resolves on the first SIGINT/SIGTERM (graceful shutdown: the event in
/// hand gets `--shutdown-grace`, acknowledgements are written); a second
/// signal exits at once with status 130: nothing is lost, but events
/// delivered since the last written acknowledgement are delivered again.
/// A second signal within [`SAME_STOP`] of the first counts as the same
/// stop: coreutils `timeout` sends SIGTERM to the process and then to its
/// process group, so the relay gets two a few milliseconds apart.
/// The first signal is listened for from the call on, not from the first
/// poll: a SIGTERM that comes while the relay starts is a graceful
/// shutdown too, never the default action that ends the process.
pub(crate) fn shutdown_then_force() -> impl Future<Output = ()> + Send + 'static {
    let first = shutdown_signal();
    async move {
        first.await;
        let at = std::time::Instant::now();
        tokio::spawn(async move {
            loop {
                shutdown_signal().await;
                if at.elapsed() >= SAME_STOP {
                    break;
                }
                tracing::debug!("a second signal right after the first: the same stop");
            }
            tracing::warn!(
                "second signal: exiting now; events whose acknowledgements were not written yet will be delivered again"
            );
            std::process::exit(130);
        });
    }
}

/// How soon after the first a second SIGINT/SIGTERM is taken for the same
/// stop, not a request to exit at once: 200 ms.
const SAME_STOP: std::time::Duration = std::time::Duration::from_millis(200);

/// Resolves on SIGINT or SIGTERM. Listens from the call on (the handlers
/// are installed before this returns, and stay installed). Call it within
/// the Tokio runtime.
pub(crate) fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        async move {
            match (term, int) {
                (Some(mut term), Some(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Let a closed standard output (`pg-outbox status | head -1`) end the
/// process quietly, as it does other command-line tools, instead of a
/// "Broken pipe" panic: the Rust runtime ignores SIGPIPE, this restores its
/// default action. Not for `relay` and `demo`, whose stdout sink handles
/// EPIPE itself and which must shut down cleanly.
pub(crate) fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called at start, before any other thread exists; SIG_DFL is a
    // valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

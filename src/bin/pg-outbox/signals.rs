//! Signals: graceful shutdown on SIGINT/SIGTERM, and SIGPIPE's default
//! action for the short commands.

/// Resolves on the first SIGINT/SIGTERM (graceful shutdown: the event in
/// hand gets `--shutdown-grace`, acknowledgements are written); a second
/// signal exits at once with status 130: nothing is lost, but events
/// delivered since the last written acknowledgement are delivered again.
pub(crate) async fn shutdown_then_force() {
    shutdown_signal().await;
    tokio::spawn(async {
        shutdown_signal().await;
        tracing::warn!(
            "second signal: exiting now; events whose acknowledgements were not written yet will be delivered again"
        );
        std::process::exit(130);
    });
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
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

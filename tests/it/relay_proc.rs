//! The relay process of the shared kit ([`crate::process`]) as the tests use
//! it: on a [`TestDb`], failing the test (with the relay's stderr) instead
//! of returning errors.

#![allow(dead_code)]

use std::process::ExitStatus;

use tokio::process::ChildStdout;

pub use crate::process::{LIVENESS, Output, Relay, RelayProc, free_port};
use crate::support::{self, TestDb};

/// `pg-outbox relay args...` on `db`.
pub fn relay(db: &TestDb, args: &[&str]) -> Relay {
    Relay::new(support::bin()).url(&db.url()).args(args)
}

fn must<T>(r: Result<T, String>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

impl RelayProc {
    /// Spawn `pg-outbox relay args...` on `db`, collecting stderr.
    pub fn spawn(db: &TestDb, args: &[&str]) -> RelayProc {
        must(relay(db, args).spawn())
    }

    /// Spawn the relay and wait until it logs that it started (its sink is
    /// connected and it is listening by then).
    pub async fn start(db: &TestDb, args: &[&str]) -> RelayProc {
        must(relay(db, args).start().await)
    }

    /// [`RelayProc::start`] with the relay's standard output piped to the
    /// test (for `--sink stdout`).
    pub async fn start_with_stdout(db: &TestDb, args: &[&str]) -> (RelayProc, ChildStdout) {
        let mut relay = must(relay(db, args).stdout(Output::Piped).start().await);
        let stdout = relay.stdout.take().expect("stdout is piped");
        (relay, stdout)
    }

    /// Start `spec` and wait until it logs that it started.
    pub async fn start_spec(spec: Relay) -> RelayProc {
        must(spec.start().await)
    }

    /// Run `pg-outbox relay args...` on `db` expecting it to exit on its
    /// own; returns its exit status and stderr.
    pub async fn run_to_exit(db: &TestDb, args: &[&str]) -> (ExitStatus, String) {
        let mut relay = Self::spawn(db, args);
        let status = relay.wait().await;
        (status, relay.log())
    }

    /// Wait until the relay's stderr holds one of `needles`.
    pub async fn wait_for_log(&mut self, needles: &[&str]) {
        must(self.wait_log(needles, LIVENESS).await);
    }

    /// Ask the relay to stop (SIGTERM).
    pub fn sigterm(&self) {
        must(self.send(libc::SIGTERM));
    }

    /// `kill -9` the relay and reap it.
    pub async fn kill9(&mut self) -> ExitStatus {
        must(self.kill().await)
    }

    /// Wait for the process to exit (and its stderr to be read).
    pub async fn wait(&mut self) -> ExitStatus {
        must(self.reap(LIVENESS).await)
    }

    /// SIGTERM, then expect exit code 0.
    pub async fn stop_cleanly(&mut self) {
        must(self.terminate(LIVENESS).await);
    }

    /// [`RelayProc::stop_cleanly`], consuming the relay.
    pub async fn stop(mut self) {
        self.stop_cleanly().await;
    }
}

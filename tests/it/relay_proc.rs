//! The kit's relay process ([`pg_outbox_testkit::process`]) as the tests
//! use it: this package's binary on a [`TestDb`], failing the test (with
//! the relay's stderr) instead of returning errors.

use std::process::ExitStatus;

pub use pg_outbox_testkit::process::{LIVENESS, Output, Relay, RelayProc, free_port};
use tokio::process::ChildStdout;

use crate::support::{self, TestDb};

/// `pg-outbox relay args...` on `db`.
pub fn relay(db: &TestDb, args: &[&str]) -> Relay {
    Relay::new(support::bin()).url(&db.url()).args(args)
}

fn must<T>(r: Result<T, String>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// Spawn `pg-outbox relay args...` on `db`, collecting stderr.
pub fn spawn(db: &TestDb, args: &[&str]) -> RelayProc {
    must(relay(db, args).spawn())
}

/// Spawn the relay and wait until it logs that it started (its sink is
/// connected and it is listening by then).
pub async fn start(db: &TestDb, args: &[&str]) -> RelayProc {
    start_spec(relay(db, args)).await
}

/// [`start`] with the relay's standard output piped to the test (for
/// `--sink stdout`).
pub async fn start_with_stdout(db: &TestDb, args: &[&str]) -> (RelayProc, ChildStdout) {
    let mut relay = start_spec(relay(db, args).stdout(Output::Piped)).await;
    let stdout = relay.stdout.take().expect("stdout is piped");
    (relay, stdout)
}

/// Start `spec` and wait until it logs that it started.
pub async fn start_spec(spec: Relay) -> RelayProc {
    must(spec.start().await)
}

/// Run `pg-outbox relay args...` on `db` expecting it to exit on its own;
/// returns its exit status and stderr.
pub async fn run_to_exit(db: &TestDb, args: &[&str]) -> (ExitStatus, String) {
    let mut relay = spawn(db, args);
    let status = relay.wait().await;
    (status, relay.log())
}

//! A `pg-outbox relay` child process for tests that start it, read its log
//! (stderr) and stop it; its stdout is discarded.

#![allow(dead_code)]

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

use crate::support::{self, TestDb};

/// Liveness bound for anything the relay should do "soon".
pub const LIVENESS: Duration = Duration::from_secs(30);

/// A running relay; killed when dropped.
pub struct RelayProc {
    child: Child,
    log: Arc<Mutex<String>>,
}

fn command(db: &TestDb, args: &[&str]) -> Command {
    let mut cmd = Command::new(support::bin());
    cmd.arg("relay")
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "info,tokio_postgres=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for var in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"] {
        cmd.env_remove(var);
    }
    cmd
}

impl RelayProc {
    /// Spawn `pg-outbox relay args...` on `db`, collecting stderr.
    pub fn spawn(db: &TestDb, args: &[&str]) -> RelayProc {
        Self::spawn_cmd(command(db, args))
    }

    fn spawn_cmd(mut cmd: Command) -> RelayProc {
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {}: {e}", support::bin()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut s = sink.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                s.push_str(&line);
                s.push('\n');
            }
        });
        RelayProc { child, log }
    }

    /// Spawn the relay and wait until it logs that it started (its sink is
    /// connected and it is listening by then).
    pub async fn start(db: &TestDb, args: &[&str]) -> RelayProc {
        let mut relay = Self::spawn(db, args);
        relay.wait_started().await;
        relay
    }

    /// [`RelayProc::start`] with the relay's standard output piped to the
    /// test (for `--sink stdout`).
    pub async fn start_with_stdout(db: &TestDb, args: &[&str]) -> (RelayProc, ChildStdout) {
        let mut cmd = command(db, args);
        cmd.stdout(Stdio::piped());
        let mut relay = Self::spawn_cmd(cmd);
        let stdout = relay.child.stdout.take().expect("stdout is piped");
        relay.wait_started().await;
        (relay, stdout)
    }

    async fn wait_started(&mut self) {
        let deadline = tokio::time::Instant::now() + LIVENESS;
        while !self.log().contains("relay started") {
            if let Some(status) = self.child.try_wait().expect("poll the relay process") {
                // Give the stderr reader a moment to collect the last lines.
                tokio::time::sleep(Duration::from_millis(200)).await;
                panic!("relay exited before starting ({status}); stderr:\n{}", self.log());
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "relay did not start within {LIVENESS:?}; stderr:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Run `pg-outbox relay args...` on `db` expecting it to exit on its
    /// own; returns its exit status and stderr.
    pub async fn run_to_exit(db: &TestDb, args: &[&str]) -> (ExitStatus, String) {
        let mut relay = Self::spawn(db, args);
        let status = relay.wait().await;
        (status, relay.log())
    }

    /// What the relay wrote on stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.child.id().expect("the relay is still running");
        let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
        // SAFETY: kill(2) with a pid we spawned and still own (not reaped).
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({signal}) failed: {}", std::io::Error::last_os_error());
    }

    /// Ask the relay to stop (SIGTERM).
    pub fn sigterm(&self) {
        self.signal(libc::SIGTERM);
    }

    /// `kill -9` the relay and reap it.
    pub async fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        self.wait().await;
    }

    /// Wait for the process to exit; then give the stderr reader a moment.
    pub async fn wait(&mut self) -> ExitStatus {
        let status = match tokio::time::timeout(LIVENESS, self.child.wait()).await {
            Ok(status) => status.expect("wait for the relay"),
            Err(_) => panic!("relay did not exit within {LIVENESS:?}; stderr:\n{}", self.log()),
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        status
    }

    /// SIGTERM, then expect exit code 0.
    pub async fn stop_cleanly(&mut self) {
        self.sigterm();
        let status = self.wait().await;
        assert_eq!(status.code(), Some(0), "relay should exit 0 on SIGTERM ({status}); stderr:\n{}", self.log());
    }

    /// [`RelayProc::stop_cleanly`], consuming the relay.
    pub async fn stop(mut self) {
        self.stop_cleanly().await;
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
}

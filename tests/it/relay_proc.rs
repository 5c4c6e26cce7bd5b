//! A `pg-outbox relay` child process for tests that need only to start it,
//! read its log and stop it (stdout is discarded).

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::support::{self, TestDb};

/// Liveness bound for anything the relay should do "soon".
pub const LIVENESS: Duration = Duration::from_secs(30);

/// A running relay; killed when dropped.
pub struct RelayProc {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl RelayProc {
    /// Start `pg-outbox relay args...` on `db` and wait until it logs that it
    /// started.
    pub async fn start(db: &TestDb, args: &[&str]) -> RelayProc {
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
        let mut relay = RelayProc { child, log };
        let deadline = tokio::time::Instant::now() + LIVENESS;
        while !relay.log().contains("relay started") {
            if let Some(status) = relay.child.try_wait().expect("poll the relay process") {
                tokio::time::sleep(Duration::from_millis(200)).await;
                panic!("relay exited before starting ({status}); stderr:\n{}", relay.log());
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "relay did not start within {LIVENESS:?}:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        relay
    }

    /// What the relay wrote on stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
}

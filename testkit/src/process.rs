//! Child processes of the `pg-outbox` binary, shared by the integration
//! tests (`tests/it`) and the benchmarks (`benches/`): the clean environment
//! every run gets, the relay process (stderr collected, its `started` log
//! signal awaited, signalled, reaped), and a free port.
//!
//! The binary is the caller's to name ([`Relay::new`]): cargo tells its
//! path to the tests and benchmarks only (`CARGO_BIN_EXE_pg-outbox`).
//! Failures come back as `Err(String)` holding the relay's stderr, so that
//! the benchmarks can report them; the tests use the panicking twins
//! ([`RelayProc::wait_for_signal`], [`RelayProc::stop_cleanly`], ...), which
//! fail the test with the same message.

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::task::JoinHandle;

/// Liveness bound for anything a relay should do "soon": start, exit.
pub const LIVENESS: Duration = Duration::from_secs(30);

/// The `signal` of the line the relay logs once its sink is connected and
/// it listens.
pub const STARTED: &str = "started";

/// The text of a log line carrying the stable field `signal = name`
/// (docs/operations.md, "Logs"): `signal="name"` in the text format,
/// `"signal":"name"` in JSON. The tests wait on these names, never on the
/// wording of a line, which is for people and may change.
pub fn signal(name: &str) -> [String; 2] {
    [format!("signal=\"{name}\""), format!("\"signal\":\"{name}\"")]
}

/// Clear what the caller's environment could slip into a run of the
/// binary: `DATABASE_URL`, `RUST_LOG`, libpq's `PG*` variables, every `OUTBOX_*` setting and the
/// HTTP proxy variables (a webhook on 127.0.0.1 must not go through a proxy).
pub fn clean_env(cmd: &mut Command) {
    cmd.env_remove("DATABASE_URL").env_remove("RUST_LOG");
    // libpq's variables fill what a connection string leaves out.
    for var in [
        "PGHOST",
        "PGHOSTADDR",
        "PGPORT",
        "PGUSER",
        "PGPASSWORD",
        "PGPASSFILE",
        "PGDATABASE",
        "PGSSLMODE",
        "PGSSLROOTCERT",
        "PGAPPNAME",
        "PGCONNECT_TIMEOUT",
    ] {
        cmd.env_remove(var);
    }
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(|k| k.starts_with("OUTBOX_")) {
            cmd.env_remove(k);
        }
    }
    for var in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"] {
        cmd.env_remove(var);
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
}

/// Where a relay's standard output goes.
#[derive(Debug)]
pub enum Output {
    /// `/dev/null`.
    Null,
    /// A pipe the caller reads ([`RelayProc::stdout`]).
    Piped,
    /// A pipe a task of this process reads and discards as fast as lines
    /// come (as in `pg-outbox relay | consumer`, so the sink writes the way
    /// it does in use).
    Drained,
    /// Anything else (a file, a pipe the caller made).
    To(Stdio),
}

/// How to run `pg-outbox relay`: `Relay::new(program).url(..).args(..).start()`.
#[derive(Debug)]
pub struct Relay {
    program: String,
    url: Option<String>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    stdout: Output,
    log_cap: Option<usize>,
}

impl Relay {
    /// `program relay` in a [clean environment](clean_env) with
    /// `RUST_LOG=info,tokio_postgres=warn`, stdout to `/dev/null`.
    pub fn new(program: &str) -> Relay {
        Relay {
            program: program.to_string(),
            url: None,
            args: Vec::new(),
            env: Vec::new(),
            stdout: Output::Null,
            log_cap: None,
        }
    }

    /// `DATABASE_URL` (through the environment: it may hold a password).
    pub fn url(mut self, url: &str) -> Relay {
        self.url = Some(url.to_string());
        self
    }

    /// More arguments after `relay`.
    pub fn args<S: AsRef<str>>(mut self, args: &[S]) -> Relay {
        self.args.extend(args.iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// One more environment variable (set after the clean-up).
    pub fn env(mut self, key: &str, value: &str) -> Relay {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Where standard output goes.
    pub fn stdout(mut self, stdout: Output) -> Relay {
        self.stdout = stdout;
        self
    }

    /// Keep at most about `bytes` of stderr (the log starts over past it), for
    /// long runs whose log is not needed.
    pub fn log_cap(mut self, bytes: usize) -> Relay {
        self.log_cap = Some(bytes);
        self
    }

    /// Start the process, collecting its stderr.
    pub fn spawn(self) -> Result<RelayProc, String> {
        let mut cmd = Command::new(&self.program);
        cmd.arg("relay").args(&self.args);
        clean_env(&mut cmd);
        cmd.env("RUST_LOG", "info,tokio_postgres=warn");
        if let Some(url) = &self.url {
            cmd.env("DATABASE_URL", url);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let drained = matches!(self.stdout, Output::Drained);
        cmd.stdin(Stdio::null())
            .stdout(match self.stdout {
                Output::Null => Stdio::null(),
                Output::Piped | Output::Drained => Stdio::piped(),
                Output::To(s) => s,
            })
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let spawned = Instant::now();
        let mut child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", self.program))?;
        let mut stdout = child.stdout.take();
        if drained && let Some(mut out) = stdout.take() {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 256 * 1024];
                while let Ok(n) = out.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
        let stderr = child.stderr.take().ok_or("relay stderr is not piped")?;
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        let cap = self.log_cap;
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut s = sink.lock().unwrap_or_else(PoisonError::into_inner);
                if cap.is_some_and(|cap| s.len() > cap) {
                    s.clear();
                    s.push_str("[...]\n");
                }
                s.push_str(&line);
                s.push('\n');
            }
        });
        Ok(RelayProc { child, stdout, log, reader: Some(reader), spawned })
    }

    /// [`Relay::spawn`], then wait until the relay logs that it started.
    pub async fn start(self) -> Result<RelayProc, String> {
        let mut relay = self.spawn()?;
        relay.wait_signal(&[STARTED], LIVENESS).await?;
        Ok(relay)
    }
}

/// The value of `r`, or a panic with its error (the relay's stderr).
fn must<T>(r: Result<T, String>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// A running `pg-outbox relay`; killed when dropped.
#[derive(Debug)]
pub struct RelayProc {
    child: Child,
    /// Its standard output, with [`Output::Piped`] (until taken).
    pub stdout: Option<ChildStdout>,
    log: Arc<Mutex<String>>,
    reader: Option<JoinHandle<()>>,
    /// When it was spawned.
    pub spawned: Instant,
}

impl RelayProc {
    /// What the relay wrote on stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Its exit status if it has exited (the stderr collected by then).
    pub async fn exited(&mut self) -> Result<Option<ExitStatus>, String> {
        let status = self.child.try_wait().map_err(|e| format!("poll the relay process: {e}"))?;
        if status.is_some() {
            self.drain_log().await;
        }
        Ok(status)
    }

    /// An error holding its stderr if it has exited.
    pub async fn check_running(&mut self) -> Result<(), String> {
        match self.exited().await? {
            Some(status) => Err(format!("relay exited early ({status}); stderr:\n{}", self.log())),
            None => Ok(()),
        }
    }

    /// Wait until its stderr holds one of `needles`, for at most `limit`.
    pub async fn wait_log(&mut self, needles: &[&str], limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            let log = self.log();
            if needles.iter().any(|n| log.contains(n)) {
                return Ok(());
            }
            if let Some(status) = self.exited().await? {
                return Err(format!("relay exited ({status}) while waiting for {needles:?}; stderr:\n{}", self.log()));
            }
            if Instant::now() >= deadline {
                return Err(format!("relay never logged {needles:?} within {limit:?}; stderr:\n{}", self.log()));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Wait until it logs a line with one of the `signal`s (names of the
    /// field, [`signal`]), for at most `limit`.
    pub async fn wait_signal(&mut self, signals: &[&str], limit: Duration) -> Result<(), String> {
        let needles: Vec<String> = signals.iter().flat_map(|s| signal(s)).collect();
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        self.wait_log(&needles, limit).await
    }

    /// Whether a line with `signal` (a name of the field, [`signal`]) was logged.
    pub fn signalled(&self, name: &str) -> bool {
        let log = self.log();
        signal(name).iter().any(|n| log.contains(n.as_str()))
    }

    /// How many lines carry `signal` (a name of the field, [`signal`]).
    pub fn signal_count(&self, name: &str) -> usize {
        let needles = signal(name);
        self.log().lines().filter(|l| needles.iter().any(|n| l.contains(n.as_str()))).count()
    }

    /// The first line carrying `signal`, or `""`.
    pub fn signal_line(&self, name: &str) -> String {
        let needles = signal(name);
        self.log().lines().find(|l| needles.iter().any(|n| l.contains(n.as_str()))).unwrap_or_default().to_string()
    }

    /// Send `signal` (kill(2)).
    pub fn send(&self, signal: libc::c_int) -> Result<(), String> {
        let pid = self.child.id().ok_or("the relay is no longer running")?;
        let pid = libc::pid_t::try_from(pid).map_err(|e| format!("pid {pid}: {e}"))?;
        // SAFETY: kill(2) on a child we spawned and have not reaped.
        let rc = unsafe { libc::kill(pid, signal) };
        if rc != 0 {
            return Err(format!("kill({signal}) failed: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Wait for the process to exit, for at most `limit`; then for its
    /// stderr to be read to the end.
    pub async fn reap(&mut self, limit: Duration) -> Result<ExitStatus, String> {
        let status = match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.map_err(|e| format!("wait for the relay: {e}"))?,
            Err(_) => return Err(format!("relay did not exit within {limit:?}; stderr:\n{}", self.log())),
        };
        self.drain_log().await;
        Ok(status)
    }

    /// `kill -9`, and reap it.
    pub async fn kill(&mut self) -> Result<ExitStatus, String> {
        self.send(libc::SIGKILL)?;
        self.reap(LIVENESS).await
    }

    /// SIGTERM, then expect exit code 0 within `limit` (killed if it takes longer).
    pub async fn terminate(&mut self, limit: Duration) -> Result<(), String> {
        self.send(libc::SIGTERM)?;
        match self.reap(limit).await {
            Ok(status) if status.code() == Some(0) => Ok(()),
            Ok(status) => Err(format!("relay should exit 0 on SIGTERM ({status}); stderr:\n{}", self.log())),
            Err(e) => {
                let _ = self.child.kill().await;
                Err(e)
            }
        }
    }

    /// Wait until it logs one of the `signals` ([`signal`]), for at most
    /// [`LIVENESS`].
    ///
    /// # Panics
    /// As [`RelayProc::wait_signal`] fails: with the relay's stderr.
    pub async fn wait_for_signal(&mut self, signals: &[&str]) {
        must(self.wait_signal(signals, LIVENESS).await);
    }

    /// Ask the relay to stop (SIGTERM).
    ///
    /// # Panics
    /// If it is no longer running, or kill(2) fails.
    pub fn sigterm(&self) {
        must(self.send(libc::SIGTERM));
    }

    /// `kill -9` the relay and reap it.
    ///
    /// # Panics
    /// As [`RelayProc::kill`] fails.
    pub async fn kill9(&mut self) -> ExitStatus {
        must(self.kill().await)
    }

    /// Wait for the process to exit (and its stderr to be read), for at
    /// most [`LIVENESS`].
    ///
    /// # Panics
    /// If it does not exit in time (with its stderr).
    pub async fn wait(&mut self) -> ExitStatus {
        must(self.reap(LIVENESS).await)
    }

    /// SIGTERM, then expect exit code 0 within [`LIVENESS`].
    ///
    /// # Panics
    /// As [`RelayProc::terminate`] fails: with the relay's stderr.
    pub async fn stop_cleanly(&mut self) {
        must(self.terminate(LIVENESS).await);
    }

    /// [`RelayProc::stop_cleanly`], consuming the relay.
    ///
    /// # Panics
    /// As [`RelayProc::stop_cleanly`].
    pub async fn stop(mut self) {
        self.stop_cleanly().await;
    }

    /// Let the stderr reader reach the end (bounded: a grandchild could
    /// hold the pipe open).
    async fn drain_log(&mut self) {
        if let Some(reader) = self.reader.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
        }
    }
}

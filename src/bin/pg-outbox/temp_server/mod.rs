//! A throwaway PostgreSQL server started from the local binaries: the
//! `demo` command's, and the test kit's (`testkit/` includes this
//! directory) for tests on a machine where no server runs. Not part of the
//! library.
//!
//! [`TempServer::start`] creates a cluster in a new temporary directory
//! (data, Unix socket and `server.log`), starts it listening on 127.0.0.1
//! on a free port with trust authentication for the `postgres` superuser,
//! and waits until it accepts connections. Dropping the [`TempServer`]
//! stops the server and deletes the directory. Durability is traded for
//! speed (`fsync=off`) and `max_connections` is 300: never keep data in it.
//!
//! The binaries (`initdb`, `pg_ctl`, `postgres`) are taken from the
//! directory given to [`TempServerOptions::bindir`], else from
//! `$PG_BINDIR` when it is set (either is an error naming it when it lacks
//! one of them: there is no fallback then); else they are looked up with
//! `pg_config --bindir`, then in the newest
//! `/usr/lib/postgresql/<version>/bin`, then in `$PATH`. The server may be
//! of any major version pg-outbox supports (13 and later). PostgreSQL
//! refuses to run as root; when this process runs as root, the server runs as the
//! `postgres` user (or `nobody`). Unix only.
//!
//! For failover tests, [`TempServer::start_standby`] starts a streaming
//! standby of a server from a base backup (`pg_basebackup -R`, from the
//! same directory as the server's binaries), synchronous if asked; then
//! [`TempServer::stop_fast`] or [`TempServer::kill`] the primary and
//! [`TempServer::promote`] the standby.
//!
//! By concern: `bindir`, where the server's programs are and who runs
//! them; `failover`, standbys, promotion, a clean stop and a kill; this
//! file, the cluster's life otherwise.
//!
//! The functions block (for the second or two that `initdb` and `pg_ctl`
//! take): in async code call them through `tokio::task::spawn_blocking`.
//!
//! # Example
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use pg_outbox_testkit::temp_server::TempServer;
//!
//! let server = tokio::task::spawn_blocking(TempServer::start).await??;
//! let options = pg_outbox::ConnectOptions::parse(&server.url())?;
//! pg_outbox::migrate::apply(&options).await?;
//! // ... publish and consume on `options` ...
//! drop(server); // stops the server and deletes its files
//! # Ok(())
//! # }
//! ```

mod bindir;
mod failover;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use bindir::{chosen_bindir, find_bindir, free_port, lookup_user};

/// Why a throwaway server could not be found, started or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The binaries are missing, `initdb` or `pg_ctl` failed, or an option
    /// is invalid; the message says which and how to fix it (with the
    /// programs' output and the end of the server's log).
    #[error("throwaway PostgreSQL server: {0}")]
    Server(String),
    /// A file or directory of the server could not be created or written,
    /// or no free port could be found.
    #[error("throwaway PostgreSQL server: i/o error")]
    Io(#[from] std::io::Error),
}

/// `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Extra settings and files for [`TempServer::start_with`] (e.g. `ssl = on`
/// with a certificate and key). The default adds nothing: the server of
/// [`TempServer::start`].
///
/// # Example
/// ```no_run
/// # fn example(cert_pem: &[u8], key_pem: &[u8]) -> pg_outbox_testkit::temp_server::Result<()> {
/// use pg_outbox_testkit::temp_server::{TempServer, TempServerOptions};
///
/// let _server = TempServer::start_with(
///     TempServerOptions::default()
///         .file("server.crt", cert_pem)
///         .file("server.key", key_pem)
///         .setting("ssl", "on"),
/// )?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct TempServerOptions {
    settings: Vec<(String, String)>,
    files: Vec<(String, Vec<u8>)>,
    bindir: Option<PathBuf>,
}

impl TempServerOptions {
    /// Add `name = 'value'` to `postgresql.conf` (PostgreSQL docs, "Setting
    /// Parameters"; the value is quoted here). Relative file names in
    /// settings are relative to the data directory. A later setting of the
    /// same name wins; the command line's (`port`, `listen_addresses`,
    /// `fsync`, `max_connections`, `unix_socket_directories`) win over all.
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.to_string(), value.to_string()));
        self
    }

    /// Write a file into the data directory before the server starts, owned
    /// by the server's user with mode 0600 (as a TLS key must be). `name` is
    /// a plain file name; an existing file (e.g. `pg_hba.conf`) is replaced.
    pub fn file(mut self, name: &str, contents: impl AsRef<[u8]>) -> Self {
        self.files.push((name.to_string(), contents.as_ref().to_vec()));
        self
    }

    /// Run the binaries (`initdb`, `pg_ctl`, `postgres`) in `dir` instead of
    /// those the search in the [module documentation](self) finds, say to
    /// run another major version. Default: the search. An error names
    /// `dir` when one of them is missing there.
    pub fn bindir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.bindir = Some(dir.into());
        self
    }
}

/// How [`TempServer::start_standby`] sets a standby up. The default: an
/// asynchronous streaming standby with the primary's settings.
///
/// # Example
/// ```no_run
/// # fn example() -> pg_outbox_testkit::temp_server::Result<()> {
/// use pg_outbox_testkit::temp_server::{StandbyOptions, TempServer};
///
/// let primary = TempServer::start()?;
/// // Commits on the primary wait until this standby has the WAL.
/// let standby = primary.start_standby(StandbyOptions::default().synchronous(true))?;
/// // ... publish on primary.url(), then fail over:
/// drop(primary); // stops it, as a crash would
/// standby.promote()?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct StandbyOptions {
    synchronous: bool,
    server: TempServerOptions,
}

impl StandbyOptions {
    /// Make the standby synchronous (default `false`): the primary's
    /// `synchronous_standby_names` is set to the standby's name (replacing
    /// any earlier one) and reloaded, so with `synchronous_commit` at its
    /// default (`on`) a COMMIT on the primary returns only once the standby
    /// has flushed its WAL (to the operating system only: a throwaway server
    /// runs with `fsync=off`): a transaction whose COMMIT returned survives
    /// a crash of the primary followed by a promotion of the standby.
    pub fn synchronous(mut self, synchronous: bool) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Add `name = 'value'` to the standby's `postgresql.conf`, after the
    /// primary's settings, which the base backup copied (see
    /// [`TempServerOptions::setting`]).
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.server = self.server.setting(name, value);
        self
    }
}

/// A throwaway server (see the [module documentation](self)); stopped and
/// its directory deleted on drop.
#[derive(Debug)]
pub struct TempServer {
    dir: tempfile::TempDir,
    bindir: PathBuf,
    port: u16,
    run_as: Option<(u32, u32)>,
    running: bool,
}

/// A [`Error::Server`] with `msg`.
fn err(msg: impl Into<String>) -> Error {
    Error::Server(msg.into())
}

impl TempServer {
    /// Create a cluster in a new temporary directory and start it (see the
    /// [module documentation](self) for its settings). Blocks for the
    /// second or two that `initdb` and the start take; a start that fails
    /// (say, the port was taken meanwhile) is tried again on another port,
    /// three times in all.
    ///
    /// # Errors
    /// [`Error::Server`] if the binaries are missing or `initdb`/`pg_ctl`
    /// fail (the message carries their output), or when running as root
    /// with neither a `postgres` nor a `nobody` user; [`Error::Io`] if the
    /// directory cannot be created.
    pub fn start() -> Result<Self> {
        Self::start_with(TempServerOptions::default())
    }

    /// As [`TempServer::start`], with extra settings and files, or other
    /// binaries.
    ///
    /// # Errors
    /// As [`TempServer::start`]; also [`Error::Server`] for a file name
    /// that is not a plain name or a [`TempServerOptions::bindir`] that
    /// lacks a binary, and [`Error::Io`] if a file cannot be written.
    pub fn start_with(options: TempServerOptions) -> Result<Self> {
        let bindir = match &options.bindir {
            Some(d) => chosen_bindir(d.clone(), "the binaries' directory is", "pass the one holding them")?,
            None => find_bindir()?,
        };
        let run_as = Self::server_user()?;
        let dir = Self::new_dir(run_as)?;
        let mut server = TempServer { dir, bindir, port: 0, run_as, running: false };
        let data = server.data_dir();
        server.run(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-A".as_ref(),
                "trust".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
                "--no-sync".as_ref(),
            ],
        )?;
        server.configure(&options)?;
        server.start_on_a_free_port()?;
        Ok(server)
    }

    /// The user the server runs as: `None` for this process's own, or
    /// (uid, gid) of `postgres` (or `nobody`) when this process is root.
    fn server_user() -> Result<Option<(u32, u32)>> {
        // SAFETY: geteuid has no preconditions.
        let is_root = unsafe { libc::geteuid() } == 0;
        if !is_root {
            return Ok(None);
        }
        Ok(Some(lookup_user("postgres").or_else(|| lookup_user("nobody")).ok_or_else(|| {
            err("running as root and neither a `postgres` nor a `nobody` user exists to run the server")
        })?))
    }

    /// A new temporary directory, owned by the server's user.
    fn new_dir(run_as: Option<(u32, u32)>) -> Result<tempfile::TempDir> {
        let dir = tempfile::Builder::new().prefix("pg-outbox-pg.").tempdir()?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        Ok(dir)
    }

    /// Start on a free port, three times at most (the port may be taken
    /// between the choice and the start).
    fn start_on_a_free_port(&mut self) -> Result<()> {
        let mut last = None;
        for _ in 0..3 {
            self.port = free_port()?;
            match self.pg_ctl_start() {
                Ok(()) => {
                    self.running = true;
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| err("could not start")))
    }

    /// Append `name = 'value'` lines to `postgresql.conf` (read at the next
    /// start or reload).
    fn append_settings(&self, settings: &[(&str, &str)]) -> Result<()> {
        self.append_settings_to("postgresql.conf", settings)
    }

    /// Append `name = 'value'` lines to the configuration file `file` of
    /// the data directory.
    fn append_settings_to(&self, file: &str, settings: &[(&str, &str)]) -> Result<()> {
        use std::io::Write;
        let mut conf = std::fs::OpenOptions::new().append(true).open(self.data_dir().join(file))?;
        for (name, value) in settings {
            writeln!(conf, "{name} = '{}'", value.replace('\'', "''"))?;
        }
        Ok(())
    }

    /// Have the running server read its configuration files again.
    fn reload(&self) -> Result<()> {
        let data = self.data_dir();
        self.run("pg_ctl", &["-D".as_ref(), data.as_os_str(), "reload".as_ref()])
    }

    /// The directory of the server's programs (`initdb`, `pg_ctl`,
    /// `postgres`, and usually `pg_basebackup` and `psql`), found as the
    /// [module documentation](self) says.
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    fn configure(&self, options: &TempServerOptions) -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let data = self.data_dir();
        for (name, contents) in &options.files {
            if name.is_empty() || name.contains('/') || name.starts_with('.') {
                return Err(err(format!("file name `{name}` must be a plain name in the data directory")));
            }
            let path = data.join(name);
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&path)?;
            f.write_all(contents)?;
            if let Some((uid, gid)) = self.run_as {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
            }
        }
        let settings: Vec<(&str, &str)> = options.settings.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        if !settings.is_empty() {
            self.append_settings(&settings)?;
        }
        Ok(())
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn run(&self, bin: &str, args: &[&std::ffi::OsStr]) -> Result<()> {
        let mut cmd = Command::new(self.bindir.join(bin));
        cmd.args(args).stdin(Stdio::null()).current_dir(self.dir.path());
        if let Some((uid, gid)) = self.run_as {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(gid);
        }
        let out = cmd.output().map_err(|e| err(format!("cannot run {bin}: {e}")))?;
        if !out.status.success() {
            let log = std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
            let tail: String =
                log.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join(" | ");
            return Err(err(format!(
                "{bin} failed ({}): {} {} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim(),
                tail
            )));
        }
        Ok(())
    }

    fn pg_ctl_start(&self) -> Result<()> {
        let data = self.data_dir();
        let log = self.dir.path().join("server.log");
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300",
            self.port,
            self.dir.path().display()
        );
        self.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-l".as_ref(),
                log.as_os_str(),
                "-w".as_ref(),
                "-o".as_ref(),
                opts.as_ref(),
                "start".as_ref(),
            ],
        )
    }

    /// Directory of the server's Unix socket (`host=` of a key=value
    /// connection string, with `port=` [`TempServer::port`]).
    pub fn socket_dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The TCP port the server listens on, on 127.0.0.1 (also the number in
    /// its socket's file name).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// URL of the `postgres` database as the `postgres` superuser, e.g.
    /// `postgres://postgres@127.0.0.1:35271/postgres` (no password: trust
    /// authentication, unless a `pg_hba.conf` given to
    /// [`TempServerOptions::file`] asks for one).
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// URL of database `db` as the `postgres` superuser (as
    /// [`TempServer::url`]; `db` is not created here).
    pub fn url_for(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{}", self.port, db)
    }

    /// Restart the server (`pg_ctl stop -m fast`, then start): every
    /// connection is closed, then the server accepts connections again on
    /// the same port, with the same data. Blocks until it does.
    ///
    /// # Errors
    /// [`Error::Server`] if `pg_ctl` fails (for instance, after
    /// [`TempServer::stop`]).
    pub fn restart(&self) -> Result<()> {
        let data = self.data_dir();
        self.run(
            "pg_ctl",
            &["-D".as_ref(), data.as_os_str(), "-m".as_ref(), "fast".as_ref(), "-w".as_ref(), "stop".as_ref()],
        )?;
        self.pg_ctl_start()
    }

    /// Start the server again after [`TempServer::stop`], on the same
    /// port and data directory; blocks until it accepts connections. Does
    /// nothing when it runs.
    ///
    /// # Errors
    /// [`Error::Server`] if `pg_ctl` fails (for instance, the port was
    /// taken meanwhile).
    pub fn start_again(&mut self) -> Result<()> {
        if self.running {
            return Ok(());
        }
        self.pg_ctl_start()?;
        self.running = true;
        Ok(())
    }

    /// Stop the server now, as a crash would (`pg_ctl stop -m immediate`:
    /// connections are cut, nothing is checkpointed). Does nothing when it
    /// is stopped; also done on drop. The files stay until the drop.
    ///
    /// # Errors
    /// [`Error::Server`] if `pg_ctl` fails.
    pub fn stop(&mut self) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        self.running = false;
        let data = self.data_dir();
        self.run(
            "pg_ctl",
            &["-D".as_ref(), data.as_os_str(), "-m".as_ref(), "immediate".as_ref(), "-w".as_ref(), "stop".as_ref()],
        )
    }
}

impl Drop for TempServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            // Not eprintln!: a closed stderr must not turn this into a panic
            // while unwinding (an abort that would leave the server running).
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "pg-outbox: could not stop the throwaway PostgreSQL server: {}",
                pg_outbox::error::report(&e)
            );
        }
    }
}

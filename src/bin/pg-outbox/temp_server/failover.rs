//! Failover: a streaming standby of a server, its promotion, and the two
//! ways a primary goes (a clean stop, a kill).

use std::path::Path;

#[cfg(doc)]
use super::Error;
use super::{Result, StandbyOptions, TempServer, err};

/// Standbys started by this process, for their names.
static STANDBYS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// How long [`TempServer::kill`] waits for the killed postmaster to go.
const KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl TempServer {
    /// Start a streaming standby of this server (which must run): a base
    /// backup taken with `pg_basebackup -R -X stream` from the directory of
    /// this server's binaries, started on a free port of its own as a hot
    /// standby (read-only, following this server's WAL). Blocks until the
    /// standby accepts connections (it has reached a consistent state),
    /// which takes a few seconds. The standby is a [`TempServer`] like any
    /// other: stopped and deleted on drop, and [`TempServer::promote`] makes
    /// it a primary.
    ///
    /// The standby connects as `postgres` with `application_name` set to
    /// its own name (`pgo_standby_<pid>_<n>`), which
    /// [`StandbyOptions::synchronous`] names in this server's
    /// `synchronous_standby_names`. The default `pg_hba.conf` of a
    /// throwaway server lets local replication connections in.
    ///
    /// # Errors
    /// [`Error::Server`] if this server is not running, if `pg_basebackup`
    /// is not beside `initdb` (some packagings of the server ship without
    /// it; the message says where it was looked for), if the backup or the
    /// start fails (with the programs' output), or if this server cannot
    /// be reloaded; [`Error::Io`] for a file that cannot be written.
    pub fn start_standby(&self, options: StandbyOptions) -> Result<TempServer> {
        if !self.running {
            return Err(err("cannot start a standby of a server that is not running"));
        }
        if !self.bindir.join("pg_basebackup").is_file() {
            return Err(err(format!(
                "pg_basebackup is not in {} (the directory of the server's binaries); install the server package \
                 that ships it (Debian: postgresql), or point PG_BINDIR at a directory that holds it",
                self.bindir.display()
            )));
        }
        let n = STANDBYS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = format!("pgo_standby_{}_{n}", std::process::id());
        let dir = Self::new_dir(self.run_as)?;
        let mut standby = TempServer { dir, bindir: self.bindir.clone(), port: 0, run_as: self.run_as, running: false };
        let data = standby.data_dir();
        let port = self.port.to_string();
        standby.run(
            "pg_basebackup",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-h".as_ref(),
                "127.0.0.1".as_ref(),
                "-p".as_ref(),
                port.as_ref(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-R".as_ref(),
                "-X".as_ref(),
                "stream".as_ref(),
                "-c".as_ref(),
                "fast".as_ref(),
                "--no-sync".as_ref(),
            ],
        )?;
        // `-R` wrote a primary_conninfo without an application name into
        // postgresql.auto.conf (read after postgresql.conf); a later line
        // there wins, and names the standby for synchronous_standby_names.
        let conninfo = format!("host=127.0.0.1 port={} user=postgres application_name={name}", self.port);
        standby.append_settings_to("postgresql.auto.conf", &[("primary_conninfo", &conninfo)])?;
        standby.configure(&options.server)?;
        if options.synchronous {
            self.append_settings(&[("synchronous_standby_names", &name)])?;
            self.reload()?;
        }
        standby.start_on_a_free_port()?;
        Ok(standby)
    }

    /// Make this standby a primary (`pg_ctl promote -w`): it leaves
    /// recovery and accepts writes. Blocks until it does.
    ///
    /// # Errors
    /// [`Error::Server`] if `pg_ctl` fails, e.g. when the server is not a
    /// standby or does not run.
    pub fn promote(&self) -> Result<()> {
        let data = self.data_dir();
        self.run("pg_ctl", &["-D".as_ref(), data.as_os_str(), "-w".as_ref(), "promote".as_ref()])
    }

    /// Stop the server cleanly (`pg_ctl stop -m fast`): sessions are ended,
    /// and a primary sends its last WAL to its standbys before it goes (a
    /// switchover). Does nothing when it is stopped; [`TempServer::start_again`]
    /// starts it again.
    ///
    /// # Errors
    /// [`Error::Server`] if `pg_ctl` fails.
    pub fn stop_fast(&mut self) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        let data = self.data_dir();
        self.run(
            "pg_ctl",
            &["-D".as_ref(), data.as_os_str(), "-m".as_ref(), "fast".as_ref(), "-w".as_ref(), "stop".as_ref()],
        )?;
        self.running = false;
        Ok(())
    }

    /// Kill the server's postmaster with SIGKILL, as a crash of the machine
    /// would end it: nothing is flushed or sent to standbys, and the
    /// server processes it leaves end on their own within moments (they
    /// watch the postmaster). Blocks until the postmaster is gone (10 s at
    /// most). The server is not restarted; the files stay until the drop.
    /// Does nothing when it is stopped.
    ///
    /// # Errors
    /// [`Error::Server`] if the postmaster's process id cannot be read from
    /// `postmaster.pid`, if it cannot be signalled, or if it is still there
    /// after 10 s.
    pub fn kill(&mut self) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        let pid_file = self.data_dir().join("postmaster.pid");
        let text =
            std::fs::read_to_string(&pid_file).map_err(|e| err(format!("cannot read {}: {e}", pid_file.display())))?;
        let pid: libc::pid_t = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| err(format!("no process id on the first line of {}", pid_file.display())))?;
        // SAFETY: kill(2) with a pid read from the server's own pid file.
        if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
            return Err(err(format!("cannot kill the postmaster {pid}: {}", std::io::Error::last_os_error())));
        }
        self.running = false;
        let deadline = std::time::Instant::now() + KILL_WAIT;
        while alive(pid) {
            if std::time::Instant::now() > deadline {
                return Err(err(format!("the postmaster {pid} is still there {KILL_WAIT:?} after SIGKILL")));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Ok(())
    }
}

/// Whether process `pid` still runs (a zombie, dead but not yet reaped by
/// its parent, does not count).
fn alive(pid: libc::pid_t) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the command, which ends in ')'.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) if Path::new("/proc/self").exists() => false,
        // No procfs (not Linux): ask the kernel whether the pid exists.
        // SAFETY: kill(2) with signal 0 only checks the pid.
        Err(_) => (unsafe { libc::kill(pid, 0) }) == 0,
    }
}

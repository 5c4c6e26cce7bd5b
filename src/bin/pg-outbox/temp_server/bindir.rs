//! Where the server's programs are (`initdb`, `pg_ctl`, `postgres`, in
//! the order the [module documentation](super) gives), the user the server
//! runs as when this process is root, and a free port.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{Result, err};

/// The programs a throwaway server needs, in one directory.
const SERVER_BINARIES: [&str; 3] = ["initdb", "pg_ctl", "postgres"];

fn has_server_binaries(dir: &Path) -> bool {
    SERVER_BINARIES.iter().all(|b| dir.join(b).is_file())
}

/// The directory holding `initdb`, `pg_ctl` and `postgres` (the order of
/// the search is in the module documentation); an error saying how to
/// install them when none is found.
pub(super) fn find_bindir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("PG_BINDIR").filter(|d| !d.is_empty()).map(PathBuf::from) {
        // Set on purpose (say, to test another major): never fall back to
        // other binaries behind the user's back.
        return chosen_bindir(
            d,
            "PG_BINDIR is",
            "point PG_BINDIR at it, or unset PG_BINDIR to use the binaries found elsewhere",
        );
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").stderr(Stdio::null()).output() {
        let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && has_server_binaries(&d) {
            return Ok(d);
        }
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<(u32, PathBuf)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                Some((v, e.path().join("bin")))
            })
            .filter(|(_, p)| has_server_binaries(p))
            .collect();
        versions.sort();
        if let Some((_, p)) = versions.pop() {
            return Ok(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            if has_server_binaries(&d) {
                return Ok(d);
            }
        }
    }
    Err(err("PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; install them \
         (Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql) \
         or set PG_BINDIR, or point DATABASE_URL at a running server"))
}

/// `dir` when it holds the server binaries; else an error naming it
/// (`what` says whose it is, `fix` how to fix it) and those it lacks.
pub(super) fn chosen_bindir(dir: PathBuf, what: &str, fix: &str) -> Result<PathBuf> {
    if has_server_binaries(&dir) {
        return Ok(dir);
    }
    let missing: Vec<&str> = SERVER_BINARIES.into_iter().filter(|b| !dir.join(b).is_file()).collect();
    Err(err(format!(
        "{what} {}, which lacks {}: the server binaries (initdb, pg_ctl, postgres) must all be in one directory; {fix}",
        dir.display(),
        missing.join(", ")
    )))
}

/// uid/gid of a user, via getpwnam(3).
pub(super) fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let c = CString::new(name).ok()?;
    // SAFETY: getpwnam returns a pointer to static storage or NULL; we read
    // two integers from it immediately and keep no reference.
    unsafe {
        let pw = libc::getpwnam(c.as_ptr());
        if pw.is_null() { None } else { Some(((*pw).pw_uid, (*pw).pw_gid)) }
    }
}
/// A free TCP port on 127.0.0.1, as the kernel hands one out.
pub(super) fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

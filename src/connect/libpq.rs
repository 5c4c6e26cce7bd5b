//! libpq's conventions for what a connection string leaves unset: its
//! environment variables (PostgreSQL docs, libpq "Environment Variables"),
//! its defaults (libpq "Parameter Key Words": the Unix socket directory, the
//! OS user name, the database named after the user) and the password file
//! (libpq "The Password File").

use std::path::{Path, PathBuf};

/// Reads one environment variable: `Some` when set and not empty. The
/// process environment in production; a closure over a map in tests, so no
/// test mutates the environment other tests read.
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment, as a [`Lookup`]: an empty value counts as unset
/// (as an empty keyword in a connection string does for libpq).
pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The Unix socket directories tried when neither the string nor `PGHOST`
/// names a host, in order: libpq's compiled-in `DEFAULT_PGSOCKET_DIR` is
/// `/var/run/postgresql` in Debian's and Red Hat's packages and `/tmp` in
/// PostgreSQL's own build (libpq "Parameter Key Words", `host`).
pub(crate) const SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

/// The default socket directories that exist (all of them when none does,
/// so the error names every one tried).
pub(crate) fn default_socket_dirs() -> Vec<PathBuf> {
    let existing: Vec<PathBuf> = SOCKET_DIRS.iter().map(PathBuf::from).filter(|p| p.is_dir()).collect();
    if existing.is_empty() { SOCKET_DIRS.iter().map(PathBuf::from).collect() } else { existing }
}

/// Whether `dir` is one of the default socket directories (for the password
/// file, where libpq matches such a socket as `localhost`).
pub(crate) fn is_default_socket_dir(dir: &Path) -> bool {
    SOCKET_DIRS.iter().any(|d| Path::new(d) == dir)
}

/// The name of the operating system user this process runs as (effective
/// user id), libpq's default user name.
#[cfg(unix)]
pub(crate) fn os_user() -> Option<String> {
    passwd_field(|pw| pw.pw_name)
}

/// The name of the operating system user (`USERNAME`), libpq's default user
/// name.
#[cfg(not(unix))]
pub(crate) fn os_user() -> Option<String> {
    std::env::var("USERNAME").ok().filter(|v| !v.is_empty())
}

/// The home directory of the effective user from the password database,
/// for when `HOME` is unset (as libpq's `pqGetHomeDirectory`).
#[cfg(unix)]
fn os_home() -> Option<String> {
    passwd_field(|pw| pw.pw_dir)
}

/// A string field of the effective user's password database entry
/// (`getpwuid_r(geteuid())`, as libpq's `pg_fe_getauthname`).
#[cfg(unix)]
fn passwd_field(field: impl Fn(&libc::passwd) -> *mut libc::c_char) -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: an all-zero passwd is a valid value (null pointers and
        // zero ids); getpwuid_r fills it in.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call, and buf.len() is the
        // size of the buffer passed.
        let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if rc != 0 || result.is_null() {
            return None;
        }
        let p = field(&pwd);
        if p.is_null() {
            return None;
        }
        // SAFETY: getpwuid_r succeeded, so the field points to a
        // NUL-terminated string inside `buf`, which is alive here.
        let s = unsafe { std::ffi::CStr::from_ptr(p) };
        return s.to_str().ok().filter(|s| !s.is_empty()).map(str::to_owned);
    }
}

/// The password file libpq reads: `PGPASSFILE`, else `~/.pgpass`
/// (`%APPDATA%\postgresql\pgpass.conf` on Windows). `HOME` comes from
/// `env` first, then the password database.
pub(crate) fn password_file(env: Lookup<'_>) -> Option<PathBuf> {
    if let Some(p) = env("PGPASSFILE") {
        return Some(PathBuf::from(p));
    }
    #[cfg(unix)]
    {
        let home = env("HOME").or_else(os_home)?;
        Some(Path::new(&home).join(".pgpass"))
    }
    #[cfg(not(unix))]
    {
        let appdata = env("APPDATA")?;
        Some(Path::new(&appdata).join("postgresql").join("pgpass.conf"))
    }
}

/// The password for `host`, `port`, `dbname` and `user` from the password
/// file at `path`, as libpq finds it: a missing file is no error; a file that
/// is not a plain file, or that group or others may read (Unix), is ignored
/// with a warning; the first matching line wins.
pub(crate) fn password_from_file(path: &Path, host: &str, port: u16, dbname: &str, user: &str) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    let shown = path.display();
    if !meta.is_file() {
        tracing::warn!("password file {shown} is not a plain file; ignoring it");
        return None;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                "password file {shown} has group or world access; permissions should be u=rw (0600) or less; ignoring it"
            );
            return None;
        }
    }
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => {
            tracing::warn!("password file {shown}: cannot read: {e}; ignoring it");
            return None;
        }
    };
    lookup_password(&text, host, &port.to_string(), dbname, user).filter(|p| !p.is_empty())
}

/// The password of the first line of a password file's `text` matching
/// `host:port:dbname:user` (libpq's `passwordFromFile`): lines are
/// `hostname:port:database:username:password`; a field that is exactly `*`
/// matches anything; `\` escapes the next character (`\:`, `\\`); empty
/// lines and lines starting with `#` are skipped.
pub(crate) fn lookup_password(text: &str, host: &str, port: &str, dbname: &str, user: &str) -> Option<String> {
    'lines: for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut rest = line;
        for want in [host, port, dbname, user] {
            match match_field(rest, want) {
                Some(r) => rest = r,
                None => continue 'lines,
            }
        }
        return Some(password_field(rest));
    }
    None
}

/// If the field at the start of `line` matches `want`, the text after the
/// field's `:` (libpq's `pwdfMatchesString`).
fn match_field<'a>(line: &'a str, want: &str) -> Option<&'a str> {
    if let Some(rest) = line.strip_prefix("*:") {
        return Some(rest);
    }
    let mut want = want.chars().peekable();
    let mut chars = line.char_indices();
    while let Some((i, c)) = chars.next() {
        let (c, escaped) = if c == '\\' { (chars.next()?.1, true) } else { (c, false) };
        if c == ':' && !escaped && want.peek().is_none() {
            return Some(&line[i + 1..]);
        }
        if want.next() != Some(c) {
            return None;
        }
    }
    None
}

/// The password field: up to the next unescaped `:`, escapes removed.
fn password_field(rest: &str) -> String {
    let mut out = String::new();
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            ':' => break,
            '\\' => match chars.next() {
                Some(n) => out.push(n),
                None => out.push('\\'),
            },
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_file_lines_match_as_libpq_matches_them() {
        let text = "\
# comment:*:*:*:nope
db.example.com:5432:app:alice:s3cret
*:*:app:bob:bob-pw
localhost:*:*:carol:local\\:pw\\\\x:ignored
host\\:with\\:colons:5432:*:*:escaped
*:6543:*:*:other-port
*:*:*:*:fallback
";
        let get = |h: &str, p: &str, d: &str, u: &str| lookup_password(text, h, p, d, u);
        assert_eq!(get("db.example.com", "5432", "app", "alice").as_deref(), Some("s3cret"));
        assert_eq!(get("db.example.com", "5433", "app", "alice").as_deref(), Some("fallback"), "port must match");
        assert_eq!(get("anywhere", "1", "app", "bob").as_deref(), Some("bob-pw"), "* matches any host and port");
        assert_eq!(get("localhost", "5432", "x", "carol").as_deref(), Some("local:pw\\x"), "escapes; ends at a :");
        assert_eq!(get("host:with:colons", "5432", "d", "u").as_deref(), Some("escaped"));
        assert_eq!(get("h", "6543", "d", "u").as_deref(), Some("other-port"));
        assert_eq!(get("h", "5432", "d", "u").as_deref(), Some("fallback"), "the first match wins, in order");
        assert_eq!(lookup_password("a*:5432:d:u:pw", "ab", "5432", "d", "u"), None, "* only as a whole field");
        assert_eq!(lookup_password("h:5432:d:u:", "h", "5432", "d", "u").as_deref(), Some(""), "an empty password");
        assert_eq!(lookup_password("h:5432:d:u", "h", "5432", "d", "u"), None, "too few fields");
        assert_eq!(lookup_password("h:5432:d:u:pw\r\n", "h", "5432", "d", "u").as_deref(), Some("pw"), "CRLF");
        assert_eq!(lookup_password("", "h", "5432", "d", "u"), None);
    }

    #[cfg(unix)]
    #[test]
    fn password_files_readable_by_others_or_not_plain_are_ignored() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pgpass");
        std::fs::write(&path, "*:*:*:*:pw\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(password_from_file(&path, "h", 5432, "d", "u").as_deref(), Some("pw"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        assert_eq!(password_from_file(&path, "h", 5432, "d", "u"), None, "group-readable: ignored");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o604)).expect("chmod");
        assert_eq!(password_from_file(&path, "h", 5432, "d", "u"), None, "world-readable: ignored");
        assert_eq!(password_from_file(dir.path(), "h", 5432, "d", "u"), None, "a directory: ignored");
        assert_eq!(password_from_file(&dir.path().join("missing"), "h", 5432, "d", "u"), None);
        std::fs::write(&path, "*:*:*:*:\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(password_from_file(&path, "h", 5432, "d", "u"), None, "an empty password is none");
    }

    #[test]
    fn the_password_file_is_pgpassfile_else_home() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(password_file(&env(&[("PGPASSFILE", "/x/pw"), ("HOME", "/h")])), Some("/x/pw".into()));
        #[cfg(unix)]
        assert_eq!(password_file(&env(&[("HOME", "/h")])), Some("/h/.pgpass".into()));
    }

    #[cfg(unix)]
    #[test]
    fn the_os_user_is_known() {
        let user = os_user().expect("the effective user has a name");
        assert!(!user.is_empty() && !user.contains('\0'));
    }
}

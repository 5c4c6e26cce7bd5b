//! libpq's conventions through the binary and the library, against the real
//! server: the `PG*` variables alone (no URL), hostless strings over the Unix
//! socket, the precedence of `--database-url`, `DATABASE_URL`,
//! `OUTBOX_DATABASE_URL` and the variables, the password file against a
//! throwaway server that asks for passwords, and errors naming what was
//! tried.

use std::path::PathBuf;

use pg_outbox_testkit::{TempServer, TempServerOptions};
use tokio_postgres::config::Host;

use crate::support::{Out, TestDb, cli};

/// A database nobody listens on.
const NOWHERE: &str = "postgres://postgres@127.0.0.1:1/nowhere";

/// The test server as libpq variables: `PGHOST` (a host name or a socket
/// directory), `PGPORT`, `PGUSER`, and `PGDATABASE` = this test's database.
fn pg_vars(db: &TestDb) -> Vec<(&'static str, String)> {
    let host = match db.pg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "127.0.0.1".into(),
    };
    let port = db.pg.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = db.pg.get_user().unwrap_or("postgres").to_string();
    vec![("PGHOST", host), ("PGPORT", port), ("PGUSER", user), ("PGDATABASE", db.name.clone())]
}

fn borrowed<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    vars.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn assert_status_ok(out: &Out, what: &str) {
    assert_eq!(out.code, Some(0), "{what}: {out:?}");
    assert!(out.stdout.contains("unpublished"), "{what}: {out:?}");
}

/// `env -u DATABASE_URL PGHOST=... PGUSER=... PGDATABASE=... pg-outbox
/// status` works as psql would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pg_variables_alone_name_the_database() {
    let db = TestDb::new("libpq_vars_alone").await;
    let vars = pg_vars(&db);
    let out = cli(&["status"]).envs(&borrowed(&vars)).run().await;
    assert_status_ok(&out, "status with the PG variables alone");
    // The library resolves the same way: parse of an empty string.
    let out = cli(&["status"]).url("").envs(&borrowed(&vars)).run().await;
    assert_status_ok(&out, "an empty DATABASE_URL counts as none");
}

/// `--database-url`, then `DATABASE_URL`, then `OUTBOX_DATABASE_URL`, then
/// the variables; a string's own fields win over the variables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precedence_flag_then_database_url_then_outbox_database_url_then_pg_variables() {
    let db = TestDb::new("libpq_precedence").await;
    let vars = pg_vars(&db);
    let good = db.url();
    let refused = |out: &Out| out.code != Some(0) && out.stderr.contains("127.0.0.1:1 (database nowhere");

    // DATABASE_URL wins over the variables (which alone would work).
    let out = cli(&["status"]).url(NOWHERE).envs(&borrowed(&vars)).run().await;
    assert!(refused(&out), "DATABASE_URL must be used before the PG variables: {out:?}");
    // OUTBOX_DATABASE_URL too.
    let out = cli(&["status"]).env("OUTBOX_DATABASE_URL", NOWHERE).envs(&borrowed(&vars)).run().await;
    assert!(refused(&out), "OUTBOX_DATABASE_URL must be used before the PG variables: {out:?}");
    // DATABASE_URL wins over OUTBOX_DATABASE_URL.
    let out = cli(&["status"]).url(&good).env("OUTBOX_DATABASE_URL", NOWHERE).run().await;
    assert_status_ok(&out, "DATABASE_URL before OUTBOX_DATABASE_URL");
    // The flag wins over DATABASE_URL.
    let out = cli(&["--database-url", &good, "status"]).url(NOWHERE).run().await;
    assert_status_ok(&out, "--database-url before DATABASE_URL");
    let out = cli(&["--database-url", NOWHERE, "status"]).url(&good).run().await;
    assert!(refused(&out), "--database-url must win: {out:?}");

    // Fields of the string override the variables: the database here.
    let mut wrong_db = vars.clone();
    wrong_db.retain(|(k, _)| *k != "PGDATABASE");
    wrong_db.push(("PGDATABASE", "no_such_database_here".into()));
    let out = cli(&["status"]).url(&format!("dbname={}", db.name)).envs(&borrowed(&wrong_db)).run().await;
    assert_status_ok(&out, "dbname of the string over PGDATABASE");
    // ... and the variables fill what the string leaves out.
    let out = cli(&["status"]).envs(&borrowed(&wrong_db)).run().await;
    assert!(
        out.code != Some(0) && out.stderr.contains("database no_such_database_here"),
        "PGDATABASE applies without a URL, and the error names it: {out:?}"
    );
}

/// The socket file of the local server in a default socket directory, if
/// it has one (as on a machine with PostgreSQL installed from packages).
fn default_socket(port: u16) -> Option<PathBuf> {
    ["/var/run/postgresql", "/tmp"]
        .iter()
        .map(|d| PathBuf::from(d).join(format!(".s.PGSQL.{port}")))
        .find(|p| p.exists())
}

/// Hostless strings: `PGHOST` when set, else the local Unix socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostless_strings_use_pghost_or_the_unix_socket() {
    let db = TestDb::new("libpq_hostless").await;
    let vars = pg_vars(&db);
    let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()).unwrap_or_default();
    let (host, port, user) = (get("PGHOST"), get("PGPORT"), get("PGUSER"));
    let name = &db.name;

    // With PGHOST (and PGPORT) set, whatever they name.
    for url in
        [format!("postgres://{user}@/{name}"), format!("dbname={name} user={user}"), format!("postgres:///{name}")]
    {
        let out = cli(&["--database-url", &url, "status"])
            .envs(&[("PGHOST", &host), ("PGPORT", &port), ("PGUSER", &user)])
            .run()
            .await;
        assert_status_ok(&out, &format!("{url} with PGHOST={host}"));
    }

    // Without PGHOST: the default socket directory.
    let port_n: u16 = port.parse().expect("port");
    let url = format!("postgres://{user}@/{name}");
    let out = cli(&["--database-url", &url, "status"]).env("PGPORT", &port).run().await;
    match default_socket(port_n) {
        Some(socket) => {
            assert_status_ok(&out, &format!("{url} over {}", socket.display()));
            // And a socket directory in PGHOST.
            let dir = socket.parent().expect("directory").display().to_string();
            let url = format!("postgres:///{name}?user={user}");
            let out = cli(&["--database-url", &url, "status"]).envs(&[("PGHOST", &dir), ("PGPORT", &port)]).run().await;
            assert_status_ok(&out, &format!("{url} with PGHOST={dir}"));
        }
        None => {
            // No server on a default socket here: the error names the sockets tried.
            assert_ne!(out.code, Some(0), "{out:?}");
            assert!(out.stderr.contains(&format!(".s.PGSQL.{port}")) && out.stderr.contains("socket"), "{out:?}");
        }
    }
}

/// With nothing set, the binary connects as psql does (default socket, OS
/// user); when that fails, it says what it tried and how to name a database.
#[tokio::test]
async fn without_any_setting_the_error_names_the_sockets_and_user_tried_and_how_to_set_them() {
    // Port 1: nothing listens there, on any socket.
    let out = cli(&["status"]).env("PGPORT", "1").run().await;
    assert_ne!(out.code, Some(0), "{out:?}");
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "the error and a hint: {out:?}");
    assert!(lines[0].starts_with("error: cannot connect to the database at socket "), "{out:?}");
    assert!(lines[0].contains("/.s.PGSQL.1"), "names the socket files tried: {out:?}");
    let dirs: Vec<&str> =
        ["/var/run/postgresql", "/tmp"].into_iter().filter(|d| std::path::Path::new(d).is_dir()).collect();
    for d in &dirs {
        assert!(lines[0].contains(&format!("{d}/.s.PGSQL.1")), "tries {d}: {out:?}");
    }
    let me = os_user();
    assert!(
        lines[0].contains(&format!("(database {me}, user {me})")),
        "the OS user, and a database named after it: {out:?}"
    );
    assert!(lines[1].starts_with("hint: no database URL was given") && lines[1].contains("PGHOST"), "{out:?}");

    // A socket directory that does not exist is named as such.
    let out = cli(&["status"])
        .envs(&[("PGHOST", "/nonexistent/pg"), ("PGUSER", "postgres"), ("PGDATABASE", "app")])
        .run()
        .await;
    assert!(
        out.stderr.contains(
            "socket /nonexistent/pg/.s.PGSQL.5432 (database app, user postgres; directory /nonexistent/pg does not exist)"
        ),
        "{out:?}"
    );
    // An unreachable host: host, port, database and user, never the password.
    let out = cli(&["--database-url", "postgres://app:s3cret@127.0.0.1:1/shop", "status"]).run().await;
    let first = out.stderr.lines().next().unwrap_or_default();
    assert_eq!(
        first,
        "error: cannot connect to the database at 127.0.0.1:1 (database shop, user app, sslmode=prefer): \
         error connecting to server: Connection refused (os error 111)",
        "{out:?}"
    );
    assert_eq!(out.stderr.lines().count(), 1, "a URL was given: no hint: {out:?}");
}

/// The name of the user this process runs as (`id -un`).
fn os_user() -> String {
    let out = std::process::Command::new("id").arg("-un").output().expect("run id -un");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A throwaway server that asks for a password over TCP (scram), with a
/// role `app` whose password is `app-pw`.
async fn password_server() -> TempServer {
    let options = TempServerOptions::default()
        .file("pg_hba.conf", "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        .setting("password_encryption", "scram-sha-256");
    let server = tokio::task::spawn_blocking(move || TempServer::start_with(options))
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("cannot start a PostgreSQL server: {}", pg_outbox::error::report(&e)));
    let socket = format!("host={} port={} user=postgres dbname=postgres", server.socket_dir().display(), server.port());
    let admin =
        pg_outbox::ConnectOptions::parse(&socket).expect("socket").connect().await.expect("connect over the socket");
    admin.batch_execute("CREATE ROLE app LOGIN PASSWORD 'app-pw'").await.expect("role");
    admin.batch_execute("CREATE DATABASE app OWNER app").await.expect("database");
    server
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_file_supplies_the_password() {
    use std::os::unix::fs::PermissionsExt;
    let server = password_server().await;
    let port = server.port().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("pgpass");
    std::fs::write(&file, format!("# test\n127.0.0.1:{port}:app:app:app-pw\n")).expect("write");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let file = file.display().to_string();
    let url = format!("postgres://app@127.0.0.1:{port}/app");

    // migrate (as the owner of the database), then status, with the file's password.
    let out = cli(&["migrate"]).url(&url).env("PGPASSFILE", &file).run().await;
    assert_eq!(out.code, Some(0), "migrate with the password from PGPASSFILE: {out:?}");
    let out = cli(&["status"]).url(&url).env("PGPASSFILE", &file).run().await;
    assert_status_ok(&out, "status with the password from PGPASSFILE");
    // ~/.pgpass by default.
    std::fs::copy(&file, dir.path().join(".pgpass")).expect("copy");
    let home = dir.path().display().to_string();
    let out = cli(&["status"]).url(&url).env("HOME", &home).run().await;
    assert_status_ok(&out, "status with the password from ~/.pgpass");
    // The variables alone, password included from the file.
    let vars = [("PGHOST", "127.0.0.1"), ("PGPORT", port.as_str()), ("PGUSER", "app"), ("PGPASSFILE", file.as_str())];
    let out = cli(&["status"]).envs(&vars).run().await;
    assert_status_ok(&out, "PGHOST, PGPORT, PGUSER and the password file; the database named after the user");
    // PGPASSWORD wins over the file.
    let out = cli(&["status"]).url(&url).envs(&[("PGPASSFILE", file.as_str()), ("PGPASSWORD", "wrong")]).run().await;
    assert!(out.code != Some(0) && out.stderr.contains("password authentication failed"), "{out:?}");
    // A file others may read is ignored, with a warning, as libpq does.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let out = cli(&["status"]).url(&url).env("PGPASSFILE", &file).run().await;
    assert_ne!(out.code, Some(0), "{out:?}");
    assert!(out.stderr.contains("has group or world access"), "warns about the file: {out:?}");
    // No file at all: the server's refusal, naming the target.
    let out = cli(&["status"]).url(&url).env("HOME", "/nonexistent").run().await;
    assert!(
        out.code != Some(0) && out.stderr.contains(&format!("127.0.0.1:{port} (database app, user app")),
        "{out:?}"
    );

    // A wrong password from the file is named as coming from it.
    std::fs::write(&file, format!("127.0.0.1:{port}:*:app:not-it\n")).expect("write");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let out = cli(&["status"]).url(&url).env("PGPASSFILE", &file).run().await;
    assert!(out.stderr.contains(&format!("password from the password file {file}")), "{out:?}");
}

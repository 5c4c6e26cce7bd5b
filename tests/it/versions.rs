//! The PostgreSQL versions pg-outbox runs on (13 and later; CI runs the
//! suite or a part of it on each, see `.ci/run`), and what it says about
//! the others:
//! - a server older than 13 is refused by `migrate`, by the relay and by
//!   the library's `migrate::apply`, in one line naming both versions
//!   (against PostgreSQL 12's own binaries, from `ci/pg-binaries.sh 12`);
//! - `PG_BINDIR` without the server binaries is an error naming it, never
//!   a quiet fallback to other binaries (which would test another version).

use pg_outbox_testkit::temp_server::{TempServer, TempServerOptions};

use crate::needs;
use crate::support::{Out, cli};

/// One line on stderr, `error: ...`, holding every one of `needles`; a
/// non-zero exit and nothing on stdout.
fn assert_one_line_error(what: &str, out: &Out, needles: &[&str]) {
    assert!(matches!(out.code, Some(c) if c != 0), "{what}: expected a non-zero exit code: {out:?}");
    let lines: Vec<&str> = out.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{what}: expected one line on stderr: {out:?}");
    assert!(lines[0].starts_with("error: "), "{what}: stderr does not start with `error: `: {out:?}");
    for n in needles {
        assert!(lines[0].contains(n), "{what}: stderr does not mention {n:?}: {out:?}");
    }
    assert!(out.stdout.is_empty(), "{what}: nothing should go to stdout on an error: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_older_than_13_is_refused_in_one_line_naming_both_versions() {
    let Some(bindir) = needs::program(&needs::POSTGRES_12) else { return };
    let server =
        tokio::task::spawn_blocking(move || TempServer::start_with(TempServerOptions::default().bindir(bindir)))
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("PostgreSQL 12: {}", pg_outbox::error::report(&e)));
    let url = server.url();
    let options = pg_outbox::ConnectOptions::parse(&url).expect("url");
    let c = options.connect().await.expect("connect to PostgreSQL 12");
    let version: String = c.query_one("SHOW server_version", &[]).await.expect("server_version").get(0);
    assert!(version.starts_with("12."), "the server runs {version}, not 12");
    let needles = [format!("PostgreSQL {version} "), "needs PostgreSQL 13 or later".to_string()];
    let needles: Vec<&str> = needles.iter().map(String::as_str).collect();

    let out = cli(&["migrate"]).url(&url).run().await;
    assert_one_line_error("migrate", &out, &needles);
    let out = cli(&["relay", "--sink", "stdout"]).url(&url).run().await;
    assert_one_line_error("relay", &out, &needles);
    match pg_outbox::migrate::apply(&options).await {
        Err(e @ pg_outbox::Error::UnsupportedServer(_)) => {
            let text = e.to_string();
            assert!(needles.iter().all(|n| text.contains(n)), "{text}");
        }
        other => panic!("migrate::apply on PostgreSQL {version}: expected UnsupportedServer, got {other:?}"),
    }
    // Refused before anything ran: no schema was created.
    let schemas: i64 = c
        .query_one("SELECT count(*) FROM pg_namespace WHERE nspname = 'events'", &[])
        .await
        .expect("look for the schema")
        .get(0);
    assert_eq!(schemas, 0, "migrate created the events schema on PostgreSQL {version}");
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

#[tokio::test]
async fn a_pg_bindir_without_the_server_binaries_is_an_error_naming_it() {
    let dir = tempfile::tempdir().expect("a directory");
    // A directory holding initdb alone: what it lacks is named.
    std::fs::write(dir.path().join("initdb"), "").expect("write initdb");
    let shown = dir.path().display().to_string();
    let out = cli(&["demo"]).env("PG_BINDIR", &shown).run().await;
    // The demo says what it starts, then fails in one line.
    assert!(matches!(out.code, Some(c) if c != 0), "expected a non-zero exit code: {out:?}");
    let errors: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "expected one error line: {out:?}");
    assert_eq!(out.stderr.lines().last(), Some(errors[0]), "the error is the last line: {out:?}");
    for n in ["PG_BINDIR", &shown, "lacks pg_ctl, postgres"] {
        assert!(errors[0].contains(n), "the error does not mention {n:?}: {out:?}");
    }
}

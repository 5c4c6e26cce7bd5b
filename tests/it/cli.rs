//! The `pg-outbox` command line: errors are one line on stderr that name the
//! problem (exit code != 0, nothing written), and the happy paths of
//! `migrate`, `publish` and `status`.

use tokio_postgres::Client;

use crate::support::{self, DbCli, Out, TestDb, cli};

/// A failed run of our own code: exit code 1 (not a crash, not 0), and stderr
/// is exactly one line, `error: ...`, holding every one of `needles`.
fn assert_one_line_error(out: &Out, needles: &[&str]) {
    assert!(matches!(out.code, Some(c) if c != 0), "expected a non-zero exit code: {out:?}");
    assert!(!out.stderr.contains("panicked"), "the binary panicked: {out:?}");
    let lines: Vec<&str> = out.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line on stderr: {out:?}");
    assert!(lines[0].starts_with("error: "), "stderr does not start with `error: `: {out:?}");
    for n in needles {
        assert!(lines[0].contains(n), "stderr does not mention {n:?}: {out:?}");
    }
    assert!(out.stdout.is_empty(), "nothing should go to stdout on an error: {out:?}");
}

/// A usage error reported by the argument parser: exit code != 0, exactly one
/// `error: ...` line on stderr (usage hints may follow), holding `needles`.
fn assert_usage_error(out: &Out, needles: &[&str]) {
    assert!(matches!(out.code, Some(c) if c != 0), "expected a non-zero exit code: {out:?}");
    assert!(!out.stderr.contains("panicked"), "the binary panicked: {out:?}");
    let errors: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "expected one error line on stderr: {out:?}");
    assert!(out.stderr.starts_with("error: "), "stderr does not start with the error: {out:?}");
    for n in needles {
        assert!(errors[0].contains(n), "the error line does not mention {n:?}: {out:?}");
    }
    assert!(out.stdout.is_empty(), "nothing should go to stdout on an error: {out:?}");
}

async fn outbox_rows(c: &Client) -> i64 {
    c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count outbox rows").get(0)
}

/// `(unpublished with retry_count 0 and no last_error, total)`: rows the relay
/// has not touched, and all rows.
async fn untouched_rows(c: &Client) -> (i64, i64) {
    let row = c
        .query_one(
            "SELECT count(*) FILTER (WHERE published_at IS NULL AND retry_count = 0 AND last_error IS NULL \
                                       AND next_retry_at IS NULL), count(*) FROM events.outbox",
            &[],
        )
        .await
        .expect("count untouched rows");
    (row.get(0), row.get(1))
}

fn publish_args<'a>(aggregate_id: &'a str, payload: &'a str) -> Vec<&'a str> {
    vec![
        "publish",
        "--aggregate-type",
        "subscription",
        "--aggregate-id",
        aggregate_id,
        "--event-type",
        "PaymentSucceeded",
        "--payload",
        payload,
    ]
}

/// A database created by the test without the outbox schema; dropped (with
/// FORCE) when the guard goes out of scope.
struct RawDb {
    name: String,
    url: String,
    admin: tokio_postgres::Config,
}

impl RawDb {
    async fn new(db: &TestDb) -> RawDb {
        let name = format!("pgo_it_raw_{}_{}", std::process::id(), uuid::Uuid::new_v4().simple());
        db.client()
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create an unmigrated database");
        // The test database's name is unique, so swapping it in the URL is safe.
        let url = db.url().replace(&db.name, &name);
        assert_ne!(url, db.url(), "could not derive the URL of {name}");
        RawDb { name, url, admin: db.pg.clone() }
    }

    async fn client(&self) -> Client {
        let mut cfg = self.admin.clone();
        cfg.dbname(&self.name);
        let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.expect("connect to the unmigrated database");
        tokio::spawn(conn);
        c
    }

    /// True when the `events` schema exists.
    async fn has_events_schema(&self) -> bool {
        self.client()
            .await
            .query_one("SELECT to_regnamespace('events') IS NOT NULL", &[])
            .await
            .expect("look for schema events")
            .get(0)
    }
}

impl Drop for RawDb {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async move {
                let (c, conn) = admin.connect(tokio_postgres::NoTls).await.ok()?;
                tokio::spawn(conn);
                c.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await.ok()
            })
        })
        .join();
    }
}

// ---------------------------------------------------------------- errors

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_url_is_one_line_naming_the_url_without_its_password() {
    let agg = uuid::Uuid::new_v4().to_string();
    let out = cli(&[&["--database-url", "postgres://host:notaport/db"][..], &publish_args(&agg, "{}")[..]].concat())
        .run()
        .await;
    assert_one_line_error(&out, &["invalid database URL", "port"]);

    // Same through DATABASE_URL, with a password in it: never echoed.
    let out = cli(&["status"]).url("postgres://u:secret@host:notaport/db").run().await;
    assert_one_line_error(&out, &["invalid database URL", "port"]);
    assert!(!out.stderr.contains("secret"), "the password leaked: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_database_names_host_and_port_but_not_the_password() {
    // Nothing listens on port 1 (a privileged port nobody binds in tests).
    for args in [vec!["status"], vec!["migrate"], vec!["relay", "--sink", "stdout"]] {
        let out = cli(&args).url("postgres://u:secret@127.0.0.1:1/db").run().await;
        assert_one_line_error(&out, &["cannot connect", "127.0.0.1:1"]);
        assert!(!out.stderr.contains("secret"), "the password leaked: {out:?}");
    }
    let agg = uuid::Uuid::new_v4().to_string();
    let out =
        cli(&[&["--database-url", "postgres://u:secret@127.0.0.1:1/db"][..], &publish_args(&agg, r#"{"a":1}"#)[..]]
            .concat())
        .run()
        .await;
    assert_one_line_error(&out, &["cannot connect", "127.0.0.1:1"]);
    assert!(!out.stderr.contains("secret"), "the password leaked: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_accepts_and_never_answers_is_an_error_within_the_connect_timeout() {
    // A listener that accepts connections and never writes a byte (not a
    // PostgreSQL server, or one that hangs in its startup).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("local addr").port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let url = format!("postgres://u:secret@127.0.0.1:{port}/db?connect_timeout=2&sslmode=disable");
    for args in [vec!["status"], vec!["relay", "--sink", "stdout"]] {
        let out = cli(&args).url(&url).run().await;
        assert_one_line_error(&out, &["cannot connect", &format!("127.0.0.1:{port}"), "did not answer", "2s"]);
        assert!(!out.stderr.contains("secret"), "the password leaked: {out:?}");
    }
    held.abort();
}

/// With no URL, the binary connects as psql does (libpq's variables and
/// defaults); when that fails, the error names what was tried and a hint
/// says how to name a database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_database_url_connects_as_psql_and_says_how_to_give_one() {
    let agg = uuid::Uuid::new_v4().to_string();
    let check = |out: &Out| {
        assert!(matches!(out.code, Some(c) if c != 0), "expected a non-zero exit code: {out:?}");
        let lines: Vec<&str> = out.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 2, "the error and a hint: {out:?}");
        assert!(
            lines[0].starts_with("error: cannot connect to the database at socket ") && lines[0].contains(".s.PGSQL.1")
        );
        for n in ["--database-url", "DATABASE_URL", "OUTBOX_DATABASE_URL", "PGHOST", "PGUSER", "PGDATABASE"] {
            assert!(lines[1].contains(n), "the hint does not mention {n}: {out:?}");
        }
        assert!(out.stdout.is_empty(), "nothing should go to stdout on an error: {out:?}");
    };
    // Nothing listens on port 1, on any socket either.
    for args in [vec!["status"], vec!["migrate"], vec!["relay", "--sink", "stdout"], publish_args(&agg, r#"{"a":1}"#)] {
        check(&cli(&args).env("PGPORT", "1").run().await);
    }
    // An empty or blank value counts as missing, not as a URL to parse.
    check(&cli(&["status"]).url("  ").env("PGPORT", "1").run().await);
}

/// `--help` states where the database comes from, in order.
#[tokio::test]
async fn help_documents_the_database_precedence_and_the_pg_variables() {
    let out = cli(&["--help"]).run().await;
    assert_eq!(out.code, Some(0), "{out:?}");
    let help = out.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains(
            "--database-url, else DATABASE_URL, else OUTBOX_DATABASE_URL; with none of them, the libpq variables alone"
        ),
        "{help}"
    );
    for var in [
        "PGHOST",
        "PGPORT",
        "PGUSER",
        "PGPASSWORD",
        "PGDATABASE",
        "PGSSLMODE",
        "PGSSLROOTCERT",
        "PGAPPNAME",
        "PGCONNECT_TIMEOUT",
        "PGPASSFILE",
        "~/.pgpass",
        "/var/run/postgresql",
    ] {
        assert!(help.contains(var), "--help does not mention {var}: {help}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_rejects_bad_input_before_writing_anything() {
    let db = TestDb::new("cli_publish_bad").await;
    let c = db.client().await;
    let url = db.url();
    let agg = uuid::Uuid::new_v4().to_string();

    let out = cli(&publish_args(&agg, "not json")).url(&url).run().await;
    assert_one_line_error(&out, &["--payload", "not valid JSON"]);

    // JSON text with an escaped NUL: valid JSON, but jsonb cannot store it.
    let out = cli(&publish_args(&agg, r#"{"a":"x\u0000y"}"#)).url(&url).run().await;
    assert_one_line_error(&out, &["\\u0000", "$.a"]);

    let out = cli(&publish_args("not-a-uuid", "{}")).url(&url).run().await;
    assert_usage_error(&out, &["--aggregate-id", "not-a-uuid", "UUID"]);

    let out = cli(&[&publish_args(&agg, "{}")[..], &["--bogus-flag"][..]].concat()).url(&url).run().await;
    assert_eq!(out.code, Some(2), "an unknown flag is a usage error (exit 2): {out:?}");
    assert_usage_error(&out, &["--bogus-flag"]);

    let empty_type =
        ["publish", "--aggregate-type", "", "--aggregate-id", &agg, "--event-type", "E", "--payload", "{}"];
    let out = cli(&empty_type).url(&url).run().await;
    assert_one_line_error(&out, &["aggregate_type"]);

    assert_eq!(outbox_rows(&c).await, 0, "a rejected publish must write nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_rejects_bad_sink_and_bad_durations_without_touching_rows() {
    let db = TestDb::new("cli_relay_bad").await;
    let c = db.client().await;
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 3).await;
    let url = db.url();

    let out = cli(&["relay", "--sink", "ftp://x"]).url(&url).run().await;
    assert_one_line_error(&out, &["ftp://x", "stdout", "http"]);

    let out = cli(&["relay", "--sink", "http://"]).url(&url).run().await;
    assert_one_line_error(&out, &["webhook URL", "empty host"]);

    let out = cli(&["relay", "--sweep-interval", "5parsecs"]).url(&url).run().await;
    assert_usage_error(&out, &["--sweep-interval", "5parsecs"]);

    let out = cli(&["relay", "--sweep-interval", "0s"]).url(&url).run().await;
    assert_usage_error(&out, &["--sweep-interval", "0s"]);

    let out = cli(&["relay", "--retry-schedule", "1m,soon"]).url(&url).run().await;
    assert_usage_error(&out, &["--retry-schedule", "soon"]);

    assert_eq!(untouched_rows(&c).await, (3, 3), "a relay that refused to start must not touch any row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmigrated_database_says_run_migrate_and_creates_nothing() {
    let db = TestDb::new("cli_unmigrated").await;
    let raw = RawDb::new(&db).await;
    let agg = uuid::Uuid::new_v4().to_string();

    for args in [vec!["status"], vec!["status", "--json"], vec!["relay", "--sink", "stdout"], publish_args(&agg, "{}")]
    {
        let out = cli(&args).url(&raw.url).run().await;
        assert_one_line_error(&out, &["not migrated", "pg-outbox migrate"]);
    }
    assert!(!raw.has_events_schema().await, "only `migrate` may create the schema");
}

// ---------------------------------------------------------------- happy paths

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_twice_applies_then_reports_up_to_date() {
    let db = TestDb::new("cli_migrate").await;
    let raw = RawDb::new(&db).await;

    let first = cli(&["migrate"]).url(&raw.url).run().await;
    assert_eq!(first.code, Some(0), "first migrate failed: {first:?}");
    assert!(
        first.stderr.contains("applied 0001_events_outbox"),
        "first migrate should list what it applied: {first:?}"
    );
    assert!(!first.stderr.contains("up to date"), "{first:?}");
    assert!(first.stdout.is_empty(), "migrate prints nothing on stdout: {first:?}");

    let second = cli(&["migrate"]).url(&raw.url).run().await;
    assert_eq!(second.code, Some(0), "second migrate failed: {second:?}");
    assert!(second.stderr.contains("schema is up to date"), "{second:?}");
    assert!(!second.stderr.contains("applied"), "second migrate must apply nothing: {second:?}");
    assert!(second.stdout.is_empty(), "migrate prints nothing on stdout: {second:?}");

    // The schema works: publish and status succeed on the migrated database.
    let agg = uuid::Uuid::new_v4().to_string();
    let out = cli(&publish_args(&agg, "{}")).url(&raw.url).run().await;
    assert_eq!(out.code, Some(0), "publish after migrate: {out:?}");
    let n: i64 = raw.client().await.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert_eq!(n, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_prints_only_the_id_and_inserts_the_row() {
    let db = TestDb::new("cli_publish").await;
    let c = db.client().await;
    let agg = uuid::Uuid::new_v4();
    let payload = r#"{"version":1,"data":{"amount":990},"metadata":{"correlation_id":"req-42"}}"#;
    let agg_s = agg.to_string();

    let out = cli(&publish_args(&agg_s, payload)).url(&db.url()).run().await;
    assert_eq!(out.code, Some(0), "publish failed: {out:?}");
    let id: i64 = out.stdout.trim_end().parse().unwrap_or_else(|e| panic!("stdout is not an id ({e}): {out:?}"));
    assert_eq!(out.stdout, format!("{id}\n"), "stdout must hold only the id");

    let row = c
        .query_one(
            "SELECT aggregate_type, aggregate_id, event_type, payload, published_at IS NULL, retry_count \
             FROM events.outbox WHERE id = $1",
            &[&id],
        )
        .await
        .expect("the printed id names a row");
    assert_eq!(row.get::<_, String>(0), "subscription");
    assert_eq!(row.get::<_, uuid::Uuid>(1), agg);
    assert_eq!(row.get::<_, String>(2), "PaymentSucceeded");
    let expected: serde_json::Value = serde_json::from_str(payload).expect("test payload");
    assert_eq!(row.get::<_, serde_json::Value>(3), expected);
    assert!(row.get::<_, bool>(4), "a new event is unpublished");
    assert_eq!(row.get::<_, i32>(5), 0);
    assert_eq!(outbox_rows(&c).await, 1);

    // A second publish gets a larger id.
    let out = cli(&publish_args(&agg_s, "{}")).url(&db.url()).run().await;
    assert_eq!(out.code, Some(0), "second publish failed: {out:?}");
    let id2: i64 = out.stdout.trim_end().parse().unwrap_or_else(|e| panic!("stdout is not an id ({e}): {out:?}"));
    assert!(id2 > id, "ids increase: {id} then {id2}");
}

/// The count printed after `label` in `pg-outbox status`'s table.
fn table_value(out: &Out, label: &str) -> i64 {
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("status has no line {label:?}: {out:?}"));
    let value = line.split_whitespace().last().unwrap_or_default();
    value.parse().unwrap_or_else(|e| panic!("{label:?} is not a count ({e}): {out:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_match_the_rows() {
    let db = TestDb::new("cli_status").await;
    let c = db.client().await;
    let url = db.url();

    // Empty outbox first.
    let out = cli(&["status", "--json"]).url(&url).run().await;
    assert_eq!(out.code, Some(0), "status failed: {out:?}");
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"));
    assert_eq!(v["unpublished"], 0, "{v}");
    assert!(v["oldest_unpublished_age_seconds"].is_null(), "no pending event, no age: {v}");

    // 2 fresh, 1 waiting for a retry, 1 dead letter, 1 published.
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 2).await;
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
           VALUES ('subscription', gen_random_uuid(), 'Waiting', '{}', 1, now() + interval '1 hour', 'HTTP 503'); \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
           VALUES ('subscription', gen_random_uuid(), 'Dead', '{}', 10, 'infinity', 'HTTP 500'); \
         INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, published_at) \
           VALUES ('subscription', gen_random_uuid(), 'Done', '{}', now());",
    )
    .await
    .expect("set up rows");

    let out = cli(&["status"]).url(&url).run().await;
    assert_eq!(out.code, Some(0), "status failed: {out:?}");
    assert_eq!(table_value(&out, "unpublished"), 4, "{out:?}");
    assert_eq!(table_value(&out, "due now"), 2, "{out:?}");
    assert_eq!(table_value(&out, "waiting for retry"), 1, "{out:?}");
    assert_eq!(table_value(&out, "dead letters"), 1, "{out:?}");
    assert!(out.stdout.lines().any(|l| l.starts_with("oldest pending age") && l.ends_with(" s")), "{out:?}");

    let out = cli(&["status", "--json"]).url(&url).run().await;
    assert_eq!(out.code, Some(0), "status --json failed: {out:?}");
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"));
    assert_eq!(v["unpublished"], 4, "{v}");
    assert_eq!(v["due_now"], 2, "{v}");
    assert_eq!(v["waiting_for_retry"], 1, "{v}");
    assert_eq!(v["dead_letters"], 1, "{v}");
    let age = v["oldest_unpublished_age_seconds"].as_f64().unwrap_or_else(|| panic!("no age: {v}"));
    assert!(age >= 0.0, "{v}");

    // Dead means next_retry_at = 'infinity', not a retry_count: a dead letter
    // an operator released (due again, retry_count still 10) counts as due.
    c.batch_execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at) \
           VALUES ('subscription', gen_random_uuid(), 'Released', '{}', 10, now() - interval '1 second')",
    )
    .await
    .expect("released dead letter");
    let out = cli(&["status", "--json"]).url(&url).run().await;
    assert_eq!(out.code, Some(0), "status failed: {out:?}");
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"));
    assert_eq!(v["dead_letters"], 1, "{v}");
    assert_eq!(v["waiting_for_retry"], 1, "{v}");
    assert_eq!(v["due_now"], 3, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_reads_the_payload_from_stdin_and_from_a_file() {
    let db = TestDb::new("cli_payload_sources").await;
    let c = db.client().await;
    let agg = uuid::Uuid::new_v4().to_string();
    let base = ["publish", "--aggregate-type", "subscription", "--aggregate-id", agg.as_str(), "--event-type", "E"];

    // `--payload -`: standard input (beyond a command line's 128 KiB limit).
    let big = serde_json::json!({"version": 1, "data": {"blob": "x".repeat(200_000)}}).to_string();
    let out = db.cli(&[&base[..], &["--payload", "-"]].concat()).stdin(big.as_bytes()).run().await;
    assert!(out.ok(), "{}", out.stderr);
    let id: i64 = out.stdout.trim().parse().expect("an id on stdout");
    let len: i32 = c
        .query_one("SELECT length(payload->'data'->>'blob') FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("row")
        .get(0);
    assert_eq!(len, 200_000);

    // `--payload @FILE`, and a missing file is a clear error with nothing written.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("payload.json");
    std::fs::write(&file, r#"{"version":1,"data":{"from":"file"}}"#).expect("write file");
    let arg = format!("@{}", file.display());
    let out = db.cli(&[&base[..], &["--payload", arg.as_str()]].concat()).run().await;
    assert!(out.ok(), "{}", out.stderr);
    let id: i64 = out.stdout.trim().parse().expect("an id on stdout");
    let from: String = c
        .query_one("SELECT payload->'data'->>'from' FROM events.outbox WHERE id = $1", &[&id])
        .await
        .expect("row")
        .get(0);
    assert_eq!(from, "file");
    let before = outbox_rows(&c).await;
    let missing = format!("@{}", dir.path().join("nope.json").display());
    let out = db.cli(&[&base[..], &["--payload", missing.as_str()]].concat()).run().await;
    assert!(!out.ok());
    assert!(out.stderr.contains("cannot read the payload file"));
    assert_eq!(outbox_rows(&c).await, before, "nothing written");

    // An endless source is refused at the size limit, not read into memory.
    // (Within the runner's 30 s bound: publish stops reading at the limit.)
    let out = db.cli(&[&base[..], &["--payload", "@/dev/zero"]].concat()).run().await;
    assert!(!out.ok());
    assert!(out.stderr.contains("over the limit of 1048576 bytes"));
    assert_eq!(outbox_rows(&c).await, before, "nothing written");
}

/// A closed standard output ends `status` and `dead-letters list` quietly
/// (no panic, no error), and an absurd `--since` age is a one-line error
/// naming the flag, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_stdout_and_huge_ages_do_not_panic() {
    use std::os::unix::process::ExitStatusExt;
    let db = TestDb::new("cli_epipe").await;
    let c = db.client().await;
    support::insert_dead_letters(&c, 3).await;
    for args in [&["status"][..], &["dead-letters", "list"], &["dead-letters", "list", "--json"]] {
        let Out { status, stderr, .. } = db.cli(args).closed_stdout().run().await;
        assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{args:?}: {stderr}");
        assert!(
            status.success() || status.signal() == Some(libc::SIGPIPE),
            "{args:?}: ends quietly, got {status:?}: {stderr}"
        );
        assert!(stderr.trim().is_empty(), "{args:?}: nothing on stderr: {stderr}");
    }
    for since in ["1000000000d", "300000000y"] {
        let out = cli(&["dead-letters", "list", "--since", since]).url(&db.url()).run().await;
        assert_usage_error(&out, &["--since", since]);
    }
}

//! `pg-outbox relay` settings from the command line, `OUTBOX_*` environment
//! variables and a TOML file (`--config`/`OUTBOX_CONFIG`): precedence,
//! errors naming the key and file, `--print-config` with secrets masked, and
//! a real relay run configured by file and environment (with a bare
//! `--metrics-addr` port bound on 127.0.0.1).

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::relay_proc::{self, Output, Relay, free_port};
use crate::support::{self, TestDb, cli};

/// A database nobody listens on: `--print-config` must not connect.
const NOWHERE: &str = "postgres://postgres@127.0.0.1:1/nowhere";

/// `--print-config` output as key -> (value text, source).
fn settings(out: &str) -> HashMap<String, (String, String)> {
    out.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (setting, source) = l.rsplit_once(" # ")?;
            let (key, value) = setting.split_once(" = ")?;
            Some((key.trim().to_string(), (value.trim().to_string(), source.trim().to_string())))
        })
        .collect()
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write the config file");
    path.display().to_string()
}

#[tokio::test]
async fn precedence_is_command_line_then_environment_then_file_then_default() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(
        &dir,
        "relay.toml",
        "batch-size = 500\nsweep_interval = \"5s\"\nmax_retries = 3\nmode = \"competing\"\n\
         database_url = \"postgres://fromfile@127.0.0.1:1/file\"\n",
    );
    let env = [
        ("OUTBOX_CONFIG", file.as_str()),
        ("OUTBOX_SWEEP_INTERVAL", "2s"),
        ("OUTBOX_MAX_RETRIES", "4"),
        ("DATABASE_URL", NOWHERE),
    ];
    let (code, out, err) = cli(&["relay", "--max-retries", "5", "--print-config"]).envs(&env).run().await.parts();
    assert_eq!(code, Some(0), "print-config exits 0 without connecting: {err}");
    let s = settings(&out);
    let file_src = format!("config file {file}");
    assert_eq!(s["batch_size"], ("500".into(), file_src.clone()), "{out}");
    assert_eq!(s["mode"], ("\"competing\"".into(), file_src.clone()), "{out}");
    assert_eq!(s["sweep_interval"], ("\"2s\"".into(), "environment (OUTBOX_SWEEP_INTERVAL)".into()), "{out}");
    assert_eq!(s["max_retries"], ("5".into(), "command line".into()), "{out}");
    assert!(!s.contains_key("partitions"), "--partitions is unset outside partitioned mode: {out}");
    assert_eq!(s["sink"], ("\"stdout\"".into(), "default".into()), "{out}");
    assert_eq!(s["database_url"], (format!("\"{NOWHERE}\""), "environment (DATABASE_URL)".into()), "{out}");

    // Without DATABASE_URL the file's database_url applies; --config on the
    // command line works as OUTBOX_CONFIG does.
    let (code, out, err) = cli(&["relay", "--config", &file, "--print-config"]).envs(&[]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    let s = settings(&out);
    assert_eq!(s["database_url"], ("\"postgres://fromfile@127.0.0.1:1/file\"".into(), file_src.clone()), "{out}");
    assert_eq!(s["max_retries"], ("3".into(), file_src), "{out}");

    // The printed settings are a config file that gives the same settings.
    let again = write(&dir, "printed.toml", &out);
    let (code, out2, err) = cli(&["relay", "--config", &again, "--print-config"]).envs(&[]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    let values = |m: HashMap<String, (String, String)>| {
        let mut v: Vec<(String, String)> = m.into_iter().map(|(k, (v, _))| (k, v)).collect();
        v.sort();
        v
    };
    assert_eq!(values(settings(&out2)), values(settings(&out)), "{out}\n---\n{out2}");
}

#[tokio::test]
async fn bad_config_files_are_refused_naming_the_key_and_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: [(&str, &str, &[&str]); 10] = [
        ("unknown.toml", "batch_size = 10\nbatchsize = 5\n", &["unknown key `batchsize`", "batch_size"]),
        ("type.toml", "batch_size = \"lots\"\n", &["key `batch_size`", "must be a number"]),
        ("numstr.toml", "batch_size = \"5\"\n", &["key `batch_size` must be a number", "\"5\""]),
        ("zero.toml", "batch_size = 0\n", &["key `batch_size`", "0"]),
        ("parts.toml", "partitions = 0\n", &["key `partitions`", "0"]),
        ("retries.toml", "max_retries = 0\n", &["key `max_retries`", "0"]),
        ("range.toml", "retention_hour = 24\n", &["key `retention_hour`", "24"]),
        ("flag.toml", "no_listen = \"yes\"\n", &["key `no_listen` must be true or false"]),
        ("table.toml", "[sink]\nurl = \"x\"\n", &["key `sink`"]),
        ("syntax.toml", "sink = stdout\n", &["invalid TOML at line 1"]),
    ];
    for (name, text, needles) in cases {
        let path = write(&dir, name, text);
        let (code, out, err) =
            cli(&["relay", "--config", &path, "--print-config"]).envs(&[("DATABASE_URL", NOWHERE)]).run().await.parts();
        assert_eq!(code, Some(1), "{name}: expected exit 1; stderr: {err}");
        assert!(out.is_empty(), "{name}: nothing on stdout: {out}");
        let line = err.trim();
        assert_eq!(line.lines().count(), 1, "{name}: one line: {err}");
        assert!(line.starts_with("error: ") && line.contains(&path), "{name}: names the file: {err}");
        for n in needles {
            assert!(line.contains(n), "{name}: mentions {n:?}: {err}");
        }
    }
    let missing = dir.path().join("missing.toml").display().to_string();
    let (code, _, err) =
        cli(&["relay", "--print-config"]).envs(&[("OUTBOX_CONFIG", missing.as_str())]).run().await.parts();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&missing) && err.contains("cannot read"), "{err}");
    // A bad value from the environment is refused by the argument parser.
    let (code, _, err) = cli(&["relay", "--print-config"]).envs(&[("OUTBOX_BATCH_SIZE", "lots")]).run().await.parts();
    assert!(code.is_some_and(|c| c != 0), "{err}");
    assert!(err.contains("invalid value 'lots'") && err.contains("--batch-size"), "{err}");
    // Values the relay would refuse are refused up front, naming the flag.
    for (flag, env) in [
        ("--batch-size", "OUTBOX_BATCH_SIZE"),
        ("--partitions", "OUTBOX_PARTITIONS"),
        ("--max-retries", "OUTBOX_MAX_RETRIES"),
    ] {
        let (code, out, err) =
            cli(&["relay", flag, "0", "--print-config"]).envs(&[("DATABASE_URL", NOWHERE)]).run().await.parts();
        assert!(code.is_some_and(|c| c != 0) && out.is_empty(), "{flag} 0 must be refused: {out}{err}");
        assert!(err.starts_with("error: ") && err.contains("invalid value '0'") && err.contains(flag), "{err}");
        let (code, _, err) =
            cli(&["relay", "--print-config"]).envs(&[("DATABASE_URL", NOWHERE), (env, "0")]).run().await.parts();
        assert!(code.is_some_and(|c| c != 0) && err.contains(flag), "{env}=0 must be refused: {err}");
    }
}

#[tokio::test]
async fn print_config_masks_passwords_and_secrets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(&dir, "secrets.toml", "sink = \"amqp://rabbit:amqp-pw-1@127.0.0.1:5672/%2f\"\n");
    let env = [
        ("DATABASE_URL", "postgres://app:db-pw-2@127.0.0.1:1/app"),
        ("OUTBOX_WEBHOOK_SECRET", "whsec_c2VjcmV0LTM="),
        ("OUTBOX_CONFIG", file.as_str()),
    ];
    let args = ["relay", "--webhook-header", "Authorization: Bearer token-4", "--webhook-header", "X-Team: billing"];
    let (code, out, err) = cli(&[&args[..], &["--print-config"]].concat()).envs(&env).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    for secret in ["amqp-pw-1", "db-pw-2", "c2VjcmV0LTM", "token-4"] {
        assert!(!out.contains(secret) && !err.contains(secret), "{secret} leaked:\n{out}{err}");
    }
    let s = settings(&out);
    assert_eq!(s["sink"].0, "\"amqp://rabbit:****@127.0.0.1:5672/%2f\"", "{out}");
    assert_eq!(s["database_url"].0, "\"postgres://app:****@127.0.0.1:1/app\"", "{out}");
    assert_eq!(s["webhook_secret"], ("\"****\"".into(), "environment (OUTBOX_WEBHOOK_SECRET)".into()), "{out}");
    assert_eq!(s["webhook_header"].0, "[\"Authorization: ****\", \"X-Team: billing\"]", "{out}");

    // Nor does an unknown sink's error, nor a connect error.
    let (code, _, err) = cli(&["relay", "--sink", "ftp://u:sink-pw-5@127.0.0.1/x"])
        .envs(&[("DATABASE_URL", NOWHERE)])
        .run()
        .await
        .parts();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("unsupported sink 'ftp://127.0.0.1/x'") && !err.contains("sink-pw-5"), "{err}");
    let (code, _, err) = cli(&["status"])
        .envs(&[("DATABASE_URL", "postgres://app:db-pw-2@127.0.0.1:1/app?connect_timeout=2")])
        .run()
        .await
        .parts();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("127.0.0.1:1 (database app, user app") && !err.contains("db-pw-2"), "{err}");
}

/// `OUTBOX_DATABASE_URL` is the fallback after `--database-url` and
/// `DATABASE_URL`, above the file, and `--print-config` names it.
#[tokio::test]
async fn outbox_database_url_is_the_fallback_after_database_url() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(&dir, "db.toml", "database_url = \"postgres://fromfile@127.0.0.1:1/file\"\n");
    let outbox = "postgres://fromoutbox@127.0.0.1:1/outbox";
    let (code, out, err) = cli(&["relay", "--config", &file, "--print-config"])
        .envs(&[("OUTBOX_DATABASE_URL", outbox)])
        .run()
        .await
        .parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        settings(&out)["database_url"],
        (format!("\"{outbox}\""), "environment (OUTBOX_DATABASE_URL)".into()),
        "{out}"
    );
    let both = [("OUTBOX_DATABASE_URL", outbox), ("DATABASE_URL", NOWHERE)];
    let (code, out, err) = cli(&["relay", "--print-config"]).envs(&both).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(settings(&out)["database_url"], (format!("\"{NOWHERE}\""), "environment (DATABASE_URL)".into()));
    let (code, out, err) = cli(&["relay", "--database-url", "postgres://cli@127.0.0.1:1/x", "--print-config"])
        .envs(&both)
        .run()
        .await
        .parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(settings(&out)["database_url"].1, "command line", "{out}");
    // It is used to connect, too (here: a database nobody listens on).
    let (code, _, err) = cli(&["status"]).envs(&[("OUTBOX_DATABASE_URL", NOWHERE)]).run().await.parts();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("127.0.0.1:1") && !err.contains("no database given"), "{err}");
}

/// Tokens (a user part without a password), every server of a list, query
/// strings, and database passwords holding `?`, `#` or `/` are masked too.
#[tokio::test]
async fn print_config_masks_tokens_lists_queries_and_odd_passwords() {
    let cases: [(&str, &str, &str, &[&str]); 4] = [
        ("sink", "nats://NATSTOKEN@127.0.0.1:4222", "\"nats://****@127.0.0.1:4222\"", &["NATSTOKEN"]),
        (
            "sink",
            "nats://nu:PW1@h1:4222,nats://nu2:PW2@h2:4222",
            "\"nats://nu:****@h1:4222,nats://nu2:****@h2:4222\"",
            &["PW1", "PW2"],
        ),
        ("sink", "http://h/path?api_key=K3Y", "\"http://h/path?****\"", &["K3Y", "api_key"]),
        ("database_url", "postgres://u:pa?ss@127.0.0.1/db", "\"postgres://u:****@127.0.0.1/db\"", &["pa?ss", "ss@"]),
    ];
    for (key, value, shown, secrets) in cases {
        let flag = format!("--{}", key.replace('_', "-"));
        let mut env = vec![];
        if key != "database_url" {
            env.push(("DATABASE_URL", NOWHERE));
        }
        let (code, out, err) = cli(&["relay", &flag, value, "--print-config"]).envs(&env).run().await.parts();
        assert_eq!(code, Some(0), "{err}");
        for secret in secrets {
            assert!(!out.contains(secret) && !err.contains(secret), "{secret} leaked:\n{out}{err}");
        }
        assert_eq!(settings(&out)[key].0, shown, "{out}");
    }
    for url in ["postgres://u:p#w/d@127.0.0.1/db", "postgres://u:s3/cr#t@127.0.0.1:1/db?sslmode=disable"] {
        let (code, out, err) = cli(&["relay", "--database-url", url, "--print-config"]).envs(&[]).run().await.parts();
        assert_eq!(code, Some(0), "{err}");
        let shown = &settings(&out)["database_url"].0;
        assert!(shown.contains("****@127.0.0.1"), "{url} shown as {shown}");
        for secret in ["p#w/d", "w/d", "s3/cr#t", "cr#t"] {
            assert!(!out.contains(secret), "{secret} leaked:\n{out}");
        }
    }
}

#[tokio::test]
async fn metrics_addr_takes_a_port_or_host_and_port() {
    let (code, out, err) = cli(&["relay", "--metrics-addr", "9464", "--print-config"])
        .envs(&[("DATABASE_URL", NOWHERE)])
        .run()
        .await
        .parts();
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(settings(&out)["metrics_addr"].0, "9464", "{out}");
    for bad in ["notaport", "70000", "127.0.0.1:"] {
        let (code, _, err) = cli(&["relay", "--metrics-addr", bad, "--print-config"])
            .envs(&[("DATABASE_URL", NOWHERE)])
            .run()
            .await
            .parts();
        assert!(code.is_some_and(|c| c != 0), "--metrics-addr {bad} must be refused: {err}");
        assert!(err.contains(&format!("'{bad}'")) && err.contains("PORT or HOST:PORT"), "{err}");
    }
}

/// A real relay configured by a file (database, sink, sweep interval, bare
/// metrics port) and the environment (`OUTBOX_NO_LISTEN`), delivering to stdout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_runs_with_settings_from_file_and_environment() {
    let db = TestDb::new("config_relay").await;
    let c = db.client().await;
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(
        &dir,
        "relay.toml",
        &format!(
            "database_url = \"{}\"\nsink = \"stdout\"\nsweep_interval = \"200ms\"\nmetrics_addr = {port}\n",
            db.url()
        ),
    );
    // No DATABASE_URL: the file names the database.
    let mut relay = relay_proc::start_spec(
        Relay::new(support::bin())
            .args(&["--config", &file])
            .env("OUTBOX_NO_LISTEN", "true")
            .env("RUST_LOG", "info")
            .stdout(Output::Piped),
    )
    .await;
    let mut out = BufReader::new(relay.stdout.take().expect("stdout")).lines();
    let log = relay.log();
    assert!(log.contains("LISTEN disabled"), "OUTBOX_NO_LISTEN=true applies:\n{log}");
    assert!(log.contains(&format!("http://127.0.0.1:{port}/metrics")), "a bare port binds 127.0.0.1:\n{log}");

    let ids = support::insert_seed_events(&c, uuid::Uuid::new_v4(), 3).await;
    for id in &ids {
        let line = tokio::time::timeout(Duration::from_secs(30), out.next_line())
            .await
            .expect("a delivery within 30 s")
            .expect("read stdout")
            .expect("stdout open");
        let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON record");
        assert_eq!(v["id"], serde_json::json!(id), "{line}");
    }
    let body = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("HTTP client")
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .expect("GET /metrics on 127.0.0.1")
        .text()
        .await
        .expect("metrics body");
    assert!(body.contains("outbox_"), "metrics served on 127.0.0.1:{port}:\n{body}");
    relay.kill9().await;
}

/// Without any URL, `--print-config` says the PG variables apply.
#[tokio::test]
async fn print_config_without_a_url_names_the_pg_variables() {
    let (code, out, err) = cli(&["relay", "--print-config"]).envs(&[]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    let line = out.lines().find(|l| l.starts_with("# database_url =")).unwrap_or_default();
    assert!(line.ends_with("# not set: libpq's PG* variables and defaults apply"), "{out}");
}

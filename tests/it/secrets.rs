//! No secret is printed anywhere. Every secret-bearing option of every sink
//! (the URL's password, token and query key, `--sink-password` and its
//! file, the webhook's signing secret and credential headers, the NATS
//! token, NKey and credentials files, Kafka's secret properties) and the
//! database URL's password are filled with secrets of their own, then:
//! - `--print-config`, given them by flag and by environment, prints none;
//! - a relay whose broker cannot be reached, or refuses the credentials,
//!   exits naming the broker and prints none;
//! - a webhook that fails every request and echoes it back in its error
//!   page leaves none in `last_error`, the relay's log or `/readyz`.

use axum::http::{HeaderMap, StatusCode, Uri};
use axum::routing::post;

use crate::health::{probe, probe_until};
use crate::needs;
use crate::relay_proc::{self, LIVENESS, free_port};
use crate::support::{self, TestDb, cli};

/// A port nothing listens on (connections are refused).
fn closed_port() -> u16 {
    free_port()
}

/// Assert that none of `secrets` occurs in `text` (`what` names it).
fn none_in(secrets: &[&str], what: &str, text: &str) {
    for s in secrets {
        assert!(!text.contains(s), "secret {s:?} printed in {what}:\n{text}");
    }
}

/// A file holding `text`, in `dir`.
fn file(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write a secret file");
    path.display().to_string()
}

#[tokio::test]
async fn print_config_masks_every_secret_option_of_every_sink() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secrets = [
        "db-pw-1f2e",
        "url-pw-3d4c",
        "url-token-5b6a",
        "url-key-7988",
        "sink-pw-a1b2",
        "file-pw-c3d4",
        "whsec_d2Vic2VjcmV0LWtleS1mb3ItdGhlLXByaW50LWNvbmZpZw==",
        "bearer-e5f6",
        "apikey-0a1b",
        "kafka-pw-2c3d",
        "kafka-jaas-4e5f",
        "nats-token-6a7b",
        "SUnkey-8c9d",
        "nats-creds-0e1f",
    ];
    let pw_file = file(&dir, "pw", &format!("{}\n", secrets[5]));
    let token_file = file(&dir, "token", secrets[11]);
    let nkey_file = file(&dir, "nkey", secrets[12]);
    let creds_file = file(&dir, "creds", secrets[13]);
    let sink =
        format!("nats://natsuser:{}@127.0.0.1:1,nats://{}@127.0.0.1:2/?api_key={}", secrets[1], secrets[2], secrets[3]);
    let database = format!("postgres://app:{}@127.0.0.1:1/nowhere", secrets[0]);
    let bearer = format!("Authorization: Bearer {}", secrets[7]);
    let api_key = format!("X-Api-Key: {}", secrets[8]);
    let kafka_pw = format!("sasl.password={}", secrets[9]);
    let jaas = format!("sasl.jaas.config={}", secrets[10]);
    let by_flag = [
        "relay",
        "--print-config",
        "--database-url",
        &database,
        "--sink",
        &sink,
        "--sink-password",
        secrets[4],
        "--sink-password-file",
        &pw_file,
        "--webhook-secret",
        secrets[6],
        "--webhook-header",
        &bearer,
        "--webhook-header",
        &api_key,
        "--kafka-option",
        &kafka_pw,
        "--kafka-option",
        &jaas,
        "--nats-token-file",
        &token_file,
        "--nats-nkey-file",
        &nkey_file,
        "--nats-creds",
        &creds_file,
    ];
    let out = cli(&by_flag).envs(&[]).run().await;
    assert!(out.ok(), "{out:?}");
    none_in(&secrets, "--print-config (flags)", &format!("{}\n{}", out.stdout, out.stderr));
    for masked in ["sink_password = \"****\"", "webhook_secret = \"****\"", "Authorization: ****", "sasl.password=****"]
    {
        assert!(out.stdout.contains(masked), "{masked} in:\n{}", out.stdout);
    }

    let by_env = [
        ("DATABASE_URL", database.as_str()),
        ("OUTBOX_SINK", sink.as_str()),
        ("OUTBOX_SINK_PASSWORD", secrets[4]),
        ("OUTBOX_WEBHOOK_SECRET", secrets[6]),
        ("OUTBOX_WEBHOOK_HEADER", bearer.as_str()),
        ("OUTBOX_KAFKA_OPTION", kafka_pw.as_str()),
    ];
    let out = cli(&["relay", "--print-config"]).envs(&by_env).run().await;
    assert!(out.ok(), "{out:?}");
    none_in(&secrets, "--print-config (environment)", &format!("{}\n{}", out.stdout, out.stderr));
    assert!(out.stdout.contains("environment (OUTBOX_SINK_PASSWORD)"), "{}", out.stdout);
}

#[tokio::test]
async fn unreachable_brokers_are_named_without_their_secrets() {
    let db = TestDb::new("secrets_unreachable").await;
    let port = closed_port();
    let secrets = ["url-pw-9a8b", "url-token-7c6d", "flag-pw-5e4f", "oauth-3a2b"];
    let oauth = format!("sasl.oauthbearer.client.secret={}", secrets[3]);
    // (sink, whether the message names the broker's address)
    let cases = [
        (format!("nats://natsuser:{}@127.0.0.1:{port}", secrets[0]), true),
        (format!("nats://{}@127.0.0.1:{port}", secrets[1]), true),
        (format!("redis://app:{}@127.0.0.1:{port}/0", secrets[0]), true),
        (format!("amqp://app:{}@127.0.0.1:{port}/%2f", secrets[0]), true),
        (format!("kafka://127.0.0.1:{port}"), true),
        // Credentials in a Kafka URL are refused, without quoting them.
        (format!("kafka://app:{}@127.0.0.1:{port}", secrets[0]), false),
        // A query string is not quoted either.
        (format!("kafka://127.0.0.1:{port}?password={}", secrets[0]), false),
    ];
    for (sink, named) in &cases {
        let args = [
            "--sink",
            sink,
            "--sink-timeout",
            "2s",
            "--sink-user",
            "app",
            "--sink-password",
            secrets[2],
            "--kafka-sasl-mechanism",
            "PLAIN",
            // A property this build cannot take: librdkafka's error quotes
            // its value.
            "--kafka-option",
            &oauth,
        ];
        let (status, log) = relay_proc::run_to_exit(&db, &args).await;
        assert!(!status.success(), "{sink}: the relay must not start:\n{log}");
        none_in(&secrets, &format!("the log of a relay to {sink}"), &log);
        if *named {
            assert!(log.contains(&format!("127.0.0.1:{port}")), "{sink}: the broker is named:\n{log}");
        }
    }
}

#[tokio::test]
async fn brokers_refusing_the_credentials_are_named_without_them() {
    let db = TestDb::new("secrets_refused").await;
    let secret = "refused-pw-3b2a";
    let mut cases = Vec::new();
    if needs::server(&needs::RABBITMQ).await {
        cases.push(format!("amqp://guest:{secret}@{}/%2f", needs::RABBITMQ.addr));
    }
    if needs::server(&needs::REDIS).await {
        cases.push(format!("redis://nobody:{secret}@{}/0", needs::REDIS.addr));
    }
    for sink in &cases {
        let (status, log) = relay_proc::run_to_exit(&db, &["--sink", sink, "--sink-timeout", "5s"]).await;
        assert!(!status.success(), "{sink}: wrong credentials must stop the relay:\n{log}");
        assert!(log.contains("refused the credentials"), "{sink}: the reason in words:\n{log}");
        none_in(&[secret], &format!("the log of a relay to {sink}"), &log);
    }
}

#[tokio::test]
async fn a_webhook_echoing_the_request_in_its_error_page_leaves_no_secret_anywhere() {
    let secrets = ["hook-pw-1a2b", "hook-key-3c4d", "apikey-5e6f", "cookie-7a8b", "plainq-9c0d"];
    // The receiver refuses every request and echoes what it got: the
    // query, and the headers (the URL's credentials arrive as Basic
    // authorization).
    let app = axum::Router::new().route(
        "/hook",
        post(|uri: Uri, headers: HeaderMap| async move {
            let echoed: Vec<String> =
                headers.iter().map(|(n, v)| format!("{n}: {}", String::from_utf8_lossy(v.as_bytes()))).collect();
            (StatusCode::INTERNAL_SERVER_ERROR, format!("refused {uri} with {}", echoed.join("; ")))
        }),
    );
    let hook = support::serve_hook(app).await;
    let url = hook.replacen("http://", &format!("http://user:{}@", secrets[0]), 1);
    let sink = format!("{url}?api_key={}&plain={}", secrets[1], secrets[4]);
    let db = TestDb::new("secrets_webhook").await;
    let port = free_port();
    let api_key = format!("X-Api-Key: {}", secrets[2]);
    let cookie = format!("Cookie: session={}", secrets[3]);
    let args = [
        "--sink",
        &sink,
        "--webhook-header",
        &api_key,
        "--webhook-header",
        &cookie,
        "--metrics-addr",
        &port.to_string(),
    ];
    let mut relay = relay_proc::start(&db, &args).await;
    let c = db.client().await;
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let (_, body) = probe_until(port, "/readyz", LIVENESS, |_, b| b["checks"]["sink"]["status"] == "degraded").await;
    none_in(&secrets, "/readyz", &body.to_string());
    let error = body["checks"]["sink"]["last_error"]["message"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("HTTP 500") && error.contains("refused"), "the echo is kept, secrets cut: {error}");
    assert!(error.contains("authorization: Basic ****"), "the Basic credentials are cut: {error}");
    let (_, live) = probe(port, "/livez").await;
    none_in(&secrets, "/livez", &live.to_string());
    support::eventually(30, "the failure recorded in last_error", || {
        let c = &c;
        async move {
            let row = c.query_one("SELECT last_error FROM events.outbox LIMIT 1", &[]).await.expect("outbox row");
            row.get::<_, Option<String>>(0).is_some()
        }
    })
    .await;
    let row = c.query_one("SELECT last_error FROM events.outbox LIMIT 1", &[]).await.expect("outbox row");
    let last_error: String = row.get::<_, Option<String>>(0).unwrap_or_default();
    none_in(&secrets, "last_error", &last_error);
    assert!(last_error.contains("Basic ****"), "the secrets are masked, not dropped: {last_error}");
    relay.stop_cleanly().await;
    none_in(&secrets, "the relay's log", &relay.log());
}

//! TLS and authentication of the broker sinks, against real servers each
//! test starts on free ports with a configuration it writes, and
//! certificates made here (rcgen): a CA, a server certificate for
//! `localhost` only (so `127.0.0.1` is a host name mismatch), a client
//! certificate, and a second CA the servers do not use (an untrusted one).
//!
//! For each broker: the right credentials deliver every event; a wrong
//! password, an untrusted certificate and a wrong host name each stop the
//! relay at start with a non-zero exit and an error naming the broker and
//! the reason, and nothing is marked published; no secret is printed.
//! RabbitMQ and Kafka are reached through stunnel, which does their TLS.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};

use crate::brokers::{self, PrivateServer};
use crate::needs;
use crate::relay_proc;
use crate::support::{self, TestDb};

/// Certificates and keys, as PEM files in a directory of their own.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// A CA; a server certificate it signs for `localhost`; a client
    /// certificate it signs; and another CA, not used by any server.
    pub fn new() -> Pki {
        // The test's own broker clients build rustls configs from the
        // process's default provider; with the `wal` feature rustls has two
        // (ring, and aws-lc-rs through pgwire-replication's tokio-rustls),
        // so none is implied: install ring, as the relay does.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().expect("a directory for certificates");
        let new_ca = |name: &str| {
            let key = KeyPair::generate().expect("CA key");
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let cert = params.self_signed(&key).expect("self-signed CA");
            (Issuer::new(params, key), cert.pem())
        };
        let (issuer, ca_pem) = new_ca("pg-outbox test CA");
        let (_, other_pem) = new_ca("some other CA");
        let leaf = |names: Vec<String>, cn: &str, usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().expect("leaf key");
            let mut params = CertificateParams::new(names).expect("leaf params");
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &issuer).expect("sign a leaf certificate");
            (cert.pem(), key.serialize_pem())
        };
        let (server_pem, server_key) =
            leaf(vec!["localhost".to_string()], "localhost", ExtendedKeyUsagePurpose::ServerAuth);
        let (client_pem, client_key) =
            leaf(vec!["pg-outbox-client".to_string()], "pg-outbox-client", ExtendedKeyUsagePurpose::ClientAuth);
        let pki = Pki { dir };
        for (name, text) in [
            ("ca.pem", ca_pem),
            ("other-ca.pem", other_pem),
            ("server.pem", server_pem),
            ("server.key", server_key),
            ("client.pem", client_pem),
            ("client.key", client_key),
        ] {
            pki.write(name, &text);
        }
        pki
    }

    /// Write `text` to the file `name` in the directory; its path.
    pub fn write(&self, name: &str, text: &str) -> String {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).expect("write a test file");
        path.display().to_string()
    }

    /// The path of `name` in the directory.
    pub fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

/// Run a relay on `db` with `args`, expecting it to stop at start: a
/// non-zero exit, an error that names `broker` and holds `reason`, none of
/// `secrets` printed, and no event of the database published.
pub async fn expect_refused(db: &TestDb, args: &[&str], broker: &str, reason: &str, secrets: &[&str]) {
    let started = std::time::Instant::now();
    let (status, stderr) = relay_proc::run_to_exit(db, args).await;
    assert!(!status.success(), "the relay must fail at start ({args:?}): {status}\n{stderr}");
    let error = stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(error.contains(broker), "the error names {broker} ({args:?}):\n{stderr}");
    assert!(error.contains(reason), "the error says '{reason}' ({args:?}):\n{stderr}");
    for s in secrets {
        assert!(!stderr.contains(s), "secret {s:?} printed ({args:?}):\n{stderr}");
    }
    let c = db.client().await;
    assert_eq!(support::published_count(&c).await, 0, "nothing is marked published ({args:?})");
    assert!(started.elapsed() < Duration::from_secs(15), "the failure came quickly: {:?}", started.elapsed());
}

/// Reasons the relay gives (src/relay/mod.rs `refusal_reason`).
pub const UNTRUSTED: &str = "not signed by a trusted CA";
pub const WRONG_HOST: &str = "not valid for the host name";
pub const BAD_CREDENTIALS: &str = "refused the credentials";
/// librdkafka reports an untrusted certificate and a wrong host name alike.
pub const KAFKA_UNVERIFIED: &str = "could not be verified";
pub const CLIENT_CERT: &str = "refused the client certificate or wants one";

// ---------------------------------------------------------------------------
// NATS

/// A nats-server with JetStream, TLS (client certificates required) and
/// users `alice` (password) and an NKey user, or with a token instead.
async fn nats_server(pki: &Pki, auth: &str) -> Option<PrivateServer> {
    let program = needs::program(&needs::NATS_SERVER)?;
    let conf = format!(
        "listen: \"127.0.0.1:{{port}}\"\njetstream {{ store_dir: \"{{dir}}\" }}\n\
         tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n  timeout: 2\n}}\n{auth}\n",
        pki.path("server.pem"),
        pki.path("server.key"),
        pki.path("ca.pem"),
    );
    // PrivateServer replaces {port} and {dir} in arguments only: keep the
    // template in the file name's place and write the file per port below.
    let template = pki.write("nats.conf.in", &conf);
    let wrapper = pki.write(
        "nats.sh",
        &format!(
            "#!/bin/sh\nsed -e \"s|{{port}}|$1|\" -e \"s|{{dir}}|$2|\" {template} > $2/nats.conf\nexec {} -c $2/nats.conf\n",
            program.display()
        ),
    );
    Some(PrivateServer::start(PathBuf::from("/bin/sh"), &[&wrapper, "{port}", "{dir}"]).await)
}

/// A JetStream stream `name` capturing `<name>.>` on the server
/// (connecting with `auth` and the client certificate).
async fn nats_stream(pki: &Pki, port: u16, auth: async_nats::ConnectOptions, name: &str) {
    let client = auth
        .add_root_certificates(pki.path("ca.pem").into())
        .add_client_certificate(pki.path("client.pem").into(), pki.path("client.key").into())
        .require_tls(true)
        .connect(format!("localhost:{port}"))
        .await
        .expect("the test connects to its nats-server");
    let js = jetstream::new(client);
    let mut last = None;
    for _ in 0..50 {
        let config = stream::Config {
            name: name.into(),
            subjects: vec![format!("{name}.>")],
            storage: stream::StorageType::Memory,
            ..Default::default()
        };
        match js.get_or_create_stream(config).await {
            Ok(_) => return,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("create the stream: {last:?}");
}

async fn nats_message_count(pki: &Pki, port: u16, auth: async_nats::ConnectOptions, name: &str) -> u64 {
    let client = auth
        .add_root_certificates(pki.path("ca.pem").into())
        .add_client_certificate(pki.path("client.pem").into(), pki.path("client.key").into())
        .require_tls(true)
        .connect(format!("localhost:{port}"))
        .await
        .expect("the test connects to its nats-server");
    let js = jetstream::new(client);
    let mut s = js.get_stream(name).await.expect("the stream");
    s.info().await.expect("stream info").state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_tls_and_authentication() {
    let pki = Pki::new();
    let nkey = nkeys::KeyPair::new_user();
    let seed = nkey.seed().expect("an NKey seed");
    let auth = format!(
        "authorization {{ users = [\n  {{ user: alice, password: \"pw-alice-7\" }}\n  {{ nkey: {} }}\n] }}",
        nkey.public_key()
    );
    let Some(server) = nats_server(&pki, &auth).await else { return };
    let port = server.port;
    let alice = || async_nats::ConnectOptions::new().user_and_password("alice".into(), "pw-alice-7".into());
    let password = pki.write("password", "pw-alice-7\n");
    let wrong = pki.write("wrong-password", "not-the-password\n");
    let seed_file = pki.write("nkey.seed", &format!("{seed}\n"));
    let (ca, other_ca, cert, key) =
        (pki.path("ca.pem"), pki.path("other-ca.pem"), pki.path("client.pem"), pki.path("client.key"));
    let url = format!("nats://localhost:{port}");
    let tls: Vec<&str> =
        vec!["--sink-tls-ca-file", &ca, "--sink-tls-client-cert", &cert, "--sink-tls-client-key", &key];

    // The right credentials: user and password from a file, then the NKey.
    for (tag, auth_args) in [
        ("nats_tls_password", vec!["--sink-user", "alice", "--sink-password-file", password.as_str()]),
        ("nats_tls_nkey", vec!["--nats-nkey-file", seed_file.as_str()]),
    ] {
        let db = TestDb::new(tag).await;
        let c = db.client().await;
        let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 6, "tls").await;
        let stream = tag.to_uppercase();
        nats_stream(&pki, port, alice(), &stream).await;
        let subject = format!("{stream}.{{aggregate_type}}.{{event_type}}");
        let mut args = vec!["--sink", url.as_str(), "--sink-timeout", "3s", "--nats-subject", &subject];
        args.extend(&tls);
        args.extend(&auth_args);
        let relay = relay_proc::start(&db, &args).await;
        brokers::wait_published(&c, sent.len() as i64).await;
        let log = relay.log();
        relay.stop().await;
        assert!(!log.contains("pw-alice-7") && !log.contains(seed.as_str()), "no secret in the log:\n{log}");
        let n = nats_message_count(&pki, port, alice(), &stream).await;
        assert_eq!(n, sent.len() as u64, "every event reached the stream");
    }

    // Each fault stops the relay at start.
    let db = TestDb::new("nats_tls_refused").await;
    let c = db.client().await;
    brokers::publish_events(&c, &brokers::three_aggregates(), 3, "tls").await;
    let by_ip = format!("nats://127.0.0.1:{port}");
    let cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (vec!["--sink", &url, "--sink-user", "alice", "--sink-password-file", &wrong], "NATS", BAD_CREDENTIALS),
        (
            vec![
                "--sink",
                &url,
                "--sink-tls-ca-file",
                &other_ca,
                "--sink-user",
                "alice",
                "--sink-password-file",
                &password,
            ],
            "NATS",
            UNTRUSTED,
        ),
        (vec!["--sink", &by_ip, "--sink-user", "alice", "--sink-password-file", &password], "NATS", WRONG_HOST),
    ];
    for (mut args, broker, reason) in cases {
        let replace_ca = args.contains(&"--sink-tls-ca-file");
        if replace_ca {
            args.extend(["--sink-tls-client-cert", &cert, "--sink-tls-client-key", &key]);
        } else {
            args.extend(&tls);
        }
        args.extend(["--sink-timeout", "3s"]);
        expect_refused(&db, &args, broker, reason, &["pw-alice-7", "not-the-password"]).await;
    }
    // No client certificate where the server requires one.
    let args = ["--sink", &url, "--sink-tls-ca-file", &ca, "--sink-user", "alice", "--sink-password-file", &password];
    let args = [&args[..], &["--sink-timeout", "3s"]].concat();
    expect_refused(&db, &args, "NATS", CLIENT_CERT, &["pw-alice-7"]).await;
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_tls_token() {
    let pki = Pki::new();
    let Some(server) = nats_server(&pki, "authorization { token: \"tok-3141\" }").await else { return };
    let port = server.port;
    let tok = || async_nats::ConnectOptions::new().token("tok-3141".into());
    nats_stream(&pki, port, tok(), "TOK").await;
    let token = pki.write("token", "tok-3141\n");
    let wrong = pki.write("wrong-token", "tok-0000\n");
    let (ca, cert, key) = (pki.path("ca.pem"), pki.path("client.pem"), pki.path("client.key"));
    let url = format!("nats://localhost:{port}");
    let base = ["--sink", url.as_str(), "--sink-tls-ca-file", &ca, "--sink-tls-client-cert", &cert];
    let base = [&base[..], &["--sink-tls-client-key", &key, "--sink-timeout", "3s"]].concat();
    let base = [&base[..], &["--nats-subject", "TOK.{aggregate_type}.{event_type}"]].concat();

    let db = TestDb::new("nats_tls_token").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 4, "tok").await;
    expect_refused(&db, &[&base[..], &["--nats-token-file", &wrong]].concat(), "NATS", BAD_CREDENTIALS, &["tok-"])
        .await;
    let relay = relay_proc::start(&db, &[&base[..], &["--nats-token-file", &token]].concat()).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;
    assert_eq!(nats_message_count(&pki, port, tok(), "TOK").await, sent.len() as u64);
}

/// A NATS JWT (v2): `base64url(header).base64url(claims).base64url(sig)`,
/// the claims `jti`, `iat`, `iss` (the signer's public key), `sub`, `name`
/// and `nats` (`type`, `version` 2 and the rest of `nats`), signed with
/// the issuer's ed25519 NKey.
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, mut nats: serde_json::Value) -> String {
    use base64::Engine;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    nats["version"] = serde_json::json!(2);
    let claims = serde_json::json!({
        "jti": uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
        "iat": chrono::Utc::now().timestamp(),
        "iss": issuer.public_key(),
        "sub": subject,
        "name": name,
        "nats": nats,
    });
    let header = b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let signed = format!("{header}.{}", b64(claims.to_string().as_bytes()));
    let sig = issuer.sign(signed.as_bytes()).expect("sign the JWT");
    format!("{signed}.{}", b64(&sig))
}

/// The server settings of operator (JWT) mode, with an account that may
/// use JetStream and a system account, both preloaded; and the `.creds`
/// text of a user of that account, as `nsc` writes it.
fn nats_operator_mode() -> (String, String) {
    let operator = nkeys::KeyPair::new_operator();
    let (account, system, user) =
        (nkeys::KeyPair::new_account(), nkeys::KeyPair::new_account(), nkeys::KeyPair::new_user());
    let unlimited = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": true,
        "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
    });
    let op_jwt = nats_jwt(&operator, &operator.public_key(), "test-operator", serde_json::json!({"type": "operator"}));
    let acct_jwt =
        nats_jwt(&operator, &account.public_key(), "APP", serde_json::json!({"type": "account", "limits": unlimited}));
    let sys_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        "SYS",
        serde_json::json!({"type": "account", "limits": {"subs": -1, "data": -1, "payload": -1, "conn": -1}}),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        "relay",
        serde_json::json!({"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}),
    );
    let conf = format!(
        "operator: \"{op_jwt}\"\nsystem_account: {}\nresolver: MEMORY\nresolver_preload: {{\n  {}: \"{acct_jwt}\"\n  {}: \"{sys_jwt}\"\n}}",
        system.public_key(),
        account.public_key(),
        system.public_key(),
    );
    let seed = user.seed().expect("the user's seed");
    let creds = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    );
    (conf, creds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_tls_creds_file() {
    let pki = Pki::new();
    let (auth, creds) = nats_operator_mode();
    let Some(server) = nats_server(&pki, &auth).await else { return };
    let port = server.port;
    let user = || async_nats::ConnectOptions::with_credentials(&creds).expect("the test's .creds parse");
    nats_stream(&pki, port, user(), "CREDS").await;
    let creds_file = pki.write("relay.creds", &creds);
    let seed = creds.lines().find(|l| l.starts_with("SU")).expect("a seed line").to_string();
    let (ca, cert, key) = (pki.path("ca.pem"), pki.path("client.pem"), pki.path("client.key"));
    let url = format!("nats://localhost:{port}");
    let args = ["--sink", url.as_str(), "--sink-tls-ca-file", &ca, "--sink-tls-client-cert", &cert];
    let args = [&args[..], &["--sink-tls-client-key", &key, "--sink-timeout", "3s"]].concat();
    let args = [&args[..], &["--nats-subject", "CREDS.{aggregate_type}.{event_type}"]].concat();

    let db = TestDb::new("nats_tls_creds").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 4, "creds").await;
    // A user the operator does not know (its own account): refused.
    let (_, stranger) = nats_operator_mode();
    let stranger_file = pki.write("stranger.creds", &stranger);
    expect_refused(&db, &[&args[..], &["--nats-creds", &stranger_file]].concat(), "NATS", BAD_CREDENTIALS, &[&seed])
        .await;
    let relay = relay_proc::start(&db, &[&args[..], &["--nats-creds", &creds_file]].concat()).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    let log = relay.log();
    relay.stop().await;
    assert!(!log.contains(&seed), "the seed is not in the log:\n{log}");
    assert_eq!(nats_message_count(&pki, port, user(), "CREDS").await, sent.len() as u64);
}

// ---------------------------------------------------------------------------
// Redis

/// Entries of stream `key` on the TLS redis-server (as `alice`).
async fn redis_xlen(pki: &Pki, port: u16, key: &str) -> u64 {
    let read = |name: &str| std::fs::read(pki.path(name)).expect("read a test file");
    let info =
        redis::IntoConnectionInfo::into_connection_info(format!("rediss://localhost:{port}")).expect("a Redis URL");
    let settings = info.redis_settings().clone().set_username("alice").set_password("pw-redis-9");
    let certs = redis::TlsCertificates {
        client_tls: Some(redis::ClientTlsConfig { client_cert: read("client.pem"), client_key: read("client.key") }),
        root_cert: Some(read("ca.pem")),
    };
    let client = redis::Client::build_with_tls(info.set_redis_settings(settings), certs).expect("a Redis client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("the test connects to its redis-server");
    redis::cmd("XLEN").arg(key).query_async(&mut conn).await.expect("XLEN")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_tls_and_acl_user() {
    let Some(program) = needs::program(&needs::REDIS_SERVER) else { return };
    let pki = Pki::new();
    let (ca, other_ca, cert, key) =
        (pki.path("ca.pem"), pki.path("other-ca.pem"), pki.path("client.pem"), pki.path("client.key"));
    let (server_pem, server_key) = (pki.path("server.pem"), pki.path("server.key"));
    let server = PrivateServer::start(
        program,
        &[
            "--port",
            "0",
            "--tls-port",
            "{port}",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            "{dir}",
            "--tls-cert-file",
            &server_pem,
            "--tls-key-file",
            &server_key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "yes",
            // Redis joins the words after --user into one ACL rule.
            "--user",
            "default",
            "off",
            "--user",
            "alice",
            "on",
            ">pw-redis-9",
            "~*",
            "&*",
            "+@all",
        ],
    )
    .await;
    let port = server.port;
    let password = pki.write("password", "pw-redis-9\n");
    let wrong = pki.write("wrong-password", "not-the-password\n");
    let url = format!("rediss://localhost:{port}");
    let tls = ["--sink-tls-ca-file", ca.as_str(), "--sink-tls-client-cert", &cert, "--sink-tls-client-key", &key];
    let user = ["--sink-user", "alice", "--sink-password-file", password.as_str(), "--sink-timeout", "3s"];

    let db = TestDb::new("redis_tls_refused").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 6, "tls").await;
    let by_ip = format!("rediss://127.0.0.1:{port}");
    let secrets = ["pw-redis-9", "not-the-password"];
    let wrong_user = ["--sink-user", "alice", "--sink-password-file", wrong.as_str(), "--sink-timeout", "3s"];
    expect_refused(&db, &[&["--sink", &url][..], &tls, &wrong_user].concat(), "Redis", BAD_CREDENTIALS, &secrets).await;
    let untrusted =
        ["--sink-tls-ca-file", other_ca.as_str(), "--sink-tls-client-cert", &cert, "--sink-tls-client-key", &key];
    expect_refused(&db, &[&["--sink", &url][..], &untrusted, &user].concat(), "Redis", UNTRUSTED, &secrets).await;
    expect_refused(&db, &[&["--sink", &by_ip][..], &tls, &user].concat(), "Redis", WRONG_HOST, &secrets).await;
    expect_refused(
        &db,
        &[&["--sink", &url][..], &["--sink-tls-ca-file", &ca], &user].concat(),
        "Redis",
        CLIENT_CERT,
        &secrets,
    )
    .await;
    let plain = format!("redis://localhost:{port}");
    expect_refused(&db, &[&["--sink", &plain][..], &tls, &user].concat(), "Redis", "need a rediss:// URL", &secrets)
        .await;

    let relay = relay_proc::start(&db, &[&["--sink", &url][..], &tls, &user].concat()).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    let log = relay.log();
    relay.stop().await;
    assert!(!log.contains("pw-redis-9"), "no secret in the log:\n{log}");
    let total = redis_xlen(&pki, port, "outbox:order").await + redis_xlen(&pki, port, "outbox:invoice").await;
    assert_eq!(total, sent.len() as u64, "every event reached its stream");
}

// ---------------------------------------------------------------------------
// Kafka

/// Start `program` (stunnel) terminating TLS on `127.0.0.1:tls` with the
/// server certificate for `localhost`, requiring a client certificate that
/// the test CA signs, and forwarding to `127.0.0.1:plain`. Killed on drop.
fn stunnel(pki: &Pki, program: &std::path::Path, service: &str, tls: u16, plain: u16) -> tokio::process::Child {
    let conf = pki.write(
        &format!("stunnel-{service}.conf"),
        &format!(
            "foreground = yes\npid =\n[{service}]\naccept = 127.0.0.1:{tls}\nconnect = 127.0.0.1:{plain}\n\
             cert = {}\nkey = {}\nCAfile = {}\nverifyChain = yes\nrequireCert = yes\n",
            pki.path("server.pem"),
            pki.path("server.key"),
            pki.path("ca.pem")
        ),
    );
    tokio::process::Command::new(program)
        .arg(&conf)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start stunnel")
}

/// A tansu broker behind stunnel: tansu 0.6 has no working TLS listener
/// (its `--cert` serves plain TCP), so stunnel terminates TLS with the
/// server certificate for `localhost`, requires a client certificate
/// signed by the test CA, and forwards to tansu, which advertises the
/// stunnel port as `localhost:<port>` (so every connection librdkafka makes
/// after the bootstrap goes through TLS too). Returns the processes (killed
/// on drop) and the TLS port.
async fn tansu_tls(pki: &Pki) -> Option<(Vec<tokio::process::Child>, u16)> {
    let [bin, program] = needs::programs([&needs::TANSU, &needs::STUNNEL])?;
    let (plain, tls) = (brokers::free_port(), brokers::free_port());
    let spawn = |cmd: &mut tokio::process::Command| {
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start a test server")
    };
    let tansu = spawn(
        tokio::process::Command::new(&bin)
            .args(["broker", "--listener-url", &format!("tcp://127.0.0.1:{plain}")])
            .args(["--advertised-listener-url", &format!("tcp://localhost:{tls}")])
            .args(["--storage-engine", "memory://tansu/", "--silent"]),
    );
    let proxy = stunnel(pki, &program, "kafka", tls, plain);
    for port in [plain, tls] {
        let addr = format!("127.0.0.1:{port}");
        support::eventually(30, "tansu and stunnel to accept connections", || async {
            tokio::net::TcpStream::connect(&addr).await.is_ok()
        })
        .await;
    }
    Some((vec![tansu, proxy], tls))
}

/// Messages in every partition of `topic` (high watermarks), read over TLS.
fn kafka_messages(pki: &Pki, port: u16, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", format!("localhost:{port}"))
        .set("security.protocol", "ssl")
        .set("ssl.ca.location", pki.path("ca.pem"))
        .set("ssl.certificate.location", pki.path("client.pem"))
        .set("ssl.key.location", pki.path("client.key"))
        .set("group.id", "pgo-tls-test")
        .create()
        .expect("a consumer");
    let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).expect("topic metadata over TLS");
    let t = md.topics().iter().find(|t| t.name() == topic).expect("the topic exists");
    t.partitions()
        .iter()
        .map(|p| {
            let (low, high) =
                consumer.fetch_watermarks(topic, p.id(), Duration::from_secs(10)).expect("partition watermarks");
            high - low
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_tls() {
    let pki = Pki::new();
    let Some((_tansu, port)) = tansu_tls(&pki).await else { return };
    let (ca, other_ca, cert, key) =
        (pki.path("ca.pem"), pki.path("other-ca.pem"), pki.path("client.pem"), pki.path("client.key"));
    let url = format!("kafka://localhost:{port}");
    let by_ip = format!("kafka://127.0.0.1:{port}");
    let db = TestDb::new("kafka_tls").await;
    let c = db.client().await;
    let aggs = [("tlsorder", uuid::Uuid::new_v4()), ("tlsorder", uuid::Uuid::new_v4())];
    let sent = brokers::publish_events(&c, &aggs, 6, "tls").await;
    let quick = ["--sink-timeout", "3s", "--sink-tls-client-cert", &cert, "--sink-tls-client-key", &key];
    expect_refused(
        &db,
        &[&["--sink", &url, "--sink-tls-ca-file", &other_ca][..], &quick].concat(),
        "Kafka",
        KAFKA_UNVERIFIED,
        &[],
    )
    .await;
    expect_refused(
        &db,
        &[&["--sink", &by_ip, "--sink-tls-ca-file", &ca][..], &quick].concat(),
        "Kafka",
        KAFKA_UNVERIFIED,
        &[],
    )
    .await;

    let relay = relay_proc::start(&db, &[&["--sink", &url, "--sink-tls-ca-file", &ca][..], &quick].concat()).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;
    // The broker's watermarks may trail its produce acknowledgements for a
    // moment: look again for up to 10 s (an event that never arrived still
    // fails the test).
    let pki = std::sync::Arc::new(pki);
    let mut n = 0;
    for _ in 0..20 {
        let pki = pki.clone();
        n = tokio::task::spawn_blocking(move || kafka_messages(&pki, port, "outbox.event.tlsorder"))
            .await
            .expect("join");
        if n >= sent.len() as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(n, sent.len() as i64, "every event reached the topic");
}

// ---------------------------------------------------------------------------
// RabbitMQ (the machine's broker on 5672, user guest, no TLS listener of its own)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_password_from_a_file_or_the_environment() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let pki = Pki::new();
    let right = pki.write("password", "guest\n");
    let wrong = pki.write("wrong-password", "not-the-guest-password\n");
    let url = "amqp://127.0.0.1:5672/%2f";
    let db = TestDb::new("amqp_password_file").await;
    let c = db.client().await;
    brokers::publish_events(&c, &brokers::three_aggregates(), 2, "pw").await;
    let bad = ["--sink", url, "--sink-user", "guest", "--sink-password-file", wrong.as_str(), "--sink-timeout", "5s"];
    expect_refused(&db, &bad, "RabbitMQ", BAD_CREDENTIALS, &["not-the-guest-password"]).await;
    let tls = ["--sink", url, "--sink-tls-ca-file", right.as_str(), "--sink-timeout", "5s"];
    expect_refused(&db, &tls, "RabbitMQ", "need an amqps:// URL", &[]).await;
    // The right password from the file: the relay logs in and starts (the
    // delivery itself is covered by sink_amqp); then from the environment.
    let good = ["--sink", url, "--sink-user", "guest", "--sink-password-file", right.as_str(), "--sink-timeout", "5s"];
    relay_proc::start(&db, &good).await.stop().await;
    let spec = crate::relay_proc::relay(&db, &["--sink", url, "--sink-user", "guest", "--sink-timeout", "5s"])
        .env("OUTBOX_SINK_PASSWORD", "guest");
    relay_proc::start_spec(spec).await.stop().await;
}

/// The machine's RabbitMQ behind stunnel: `amqps://localhost:<port>` with
/// the test CA's server certificate, client certificates required
/// (mutual TLS is checked by stunnel, RabbitMQ sees plain AMQP).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_tls_private_ca_and_client_certificate() {
    if !needs::server(&needs::RABBITMQ).await {
        return;
    }
    let Some(program) = needs::program(&needs::STUNNEL) else { return };
    let pki = Pki::new();
    let port = brokers::free_port();
    let _proxy = stunnel(&pki, &program, "amqp", port, 5672);
    let addr = format!("127.0.0.1:{port}");
    support::eventually(30, "stunnel to accept connections", || async {
        tokio::net::TcpStream::connect(&addr).await.is_ok()
    })
    .await;
    let (ca, other_ca, cert, key) =
        (pki.path("ca.pem"), pki.path("other-ca.pem"), pki.path("client.pem"), pki.path("client.key"));
    let password = pki.write("password", "guest\n");
    let prefix = format!("pgotls{}", uuid::Uuid::new_v4().simple());
    let (conn, ch, queue) = crate::sink_amqp::bound_queue(&prefix).await;
    let routing_key = format!("{prefix}.{{aggregate_type}}.{{event_type}}");
    let url = format!("amqps://localhost:{port}/%2f");
    let by_ip = format!("amqps://127.0.0.1:{port}/%2f");
    let plain = "amqp://127.0.0.1:5672/%2f".to_string();
    let common = ["--sink-user", "guest", "--sink-password-file", &password, "--sink-timeout", "3s"];
    let common = [&common[..], &["--amqp-routing-key", &routing_key]].concat();
    let client = ["--sink-tls-client-cert", cert.as_str(), "--sink-tls-client-key", &key];

    let db = TestDb::new("amqp_tls").await;
    let c = db.client().await;
    let sent = brokers::publish_events(&c, &brokers::three_aggregates(), 6, "tls").await;
    let run = |url: &str, ca: &str, with_client: bool| {
        let mut args = vec!["--sink".to_string(), url.to_string(), "--sink-tls-ca-file".into(), ca.to_string()];
        if with_client {
            args.extend(client.iter().map(|s| s.to_string()));
        }
        args.extend(common.iter().map(|s| s.to_string()));
        args
    };
    for (args, reason) in [
        (run(&url, &other_ca, true), UNTRUSTED),
        (run(&by_ip, &ca, true), WRONG_HOST),
        (run(&url, &ca, false), CLIENT_CERT),
        (run(&plain, &ca, true), "need an amqps:// URL"),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        expect_refused(&db, &args, "RabbitMQ", reason, &[]).await;
    }

    let args = run(&url, &ca, true);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = relay_proc::start(&db, &args).await;
    brokers::wait_published(&c, sent.len() as i64).await;
    relay.stop().await;
    let declared = ch
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions { passive: true, ..Default::default() },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("the test queue");
    assert_eq!(declared.message_count() as usize, sent.len(), "every event reached the queue over TLS");
    ch.queue_delete(queue.as_str().into(), lapin::options::QueueDeleteOptions::default())
        .await
        .expect("delete the test queue");
    let _ = conn.close(200, "done".into()).await;
}

// ---------------------------------------------------------------------------
// Settings

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn print_config_masks_sink_secrets() {
    let out = support::cli(&[
        "relay",
        "--print-config",
        "--sink",
        "kafka://k1:9093",
        "--sink-user",
        "svc",
        "--sink-password-file",
        "/run/secrets/kafka",
        "--kafka-sasl-mechanism",
        "SCRAM-SHA-512",
        "--kafka-option",
        "sasl.password=opt-secret-1",
        "--kafka-option",
        "sasl.oauthbearer.client.secret=opt-secret-2",
        "--kafka-option",
        "compression.type=zstd",
    ])
    .env("OUTBOX_SINK_PASSWORD", "env-secret-3")
    .run()
    .await;
    let (code, stdout, stderr) = out.parts();
    assert_eq!(code, Some(0), "{stderr}");
    for s in ["opt-secret-1", "opt-secret-2", "env-secret-3"] {
        assert!(!stdout.contains(s), "{s} printed:\n{stdout}");
    }
    assert!(stdout.contains("sink_password_file = \"/run/secrets/kafka\""), "{stdout}");
    assert!(stdout.contains("\"sasl.password=****\""), "{stdout}");
    assert!(stdout.contains("\"compression.type=zstd\""), "{stdout}");
    assert!(stdout.contains("sink_user = \"svc\""), "{stdout}");
}

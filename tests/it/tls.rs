//! TLS to PostgreSQL with libpq's `sslmode` rules, against throwaway servers:
//! one with `ssl = on` that accepts TLS connections only (a CA and a server
//! certificate for `localhost` generated here), one without TLS.

use std::time::Duration;

use pg_outbox_testkit::{TempServer, TempServerOptions};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::relay_proc::{self, Output, Relay};
use crate::support::{self, Out, cli};

/// A CA, and a server certificate it signed for `localhost` only (not for
/// `127.0.0.1`, so connecting by IP address is a host name mismatch).
struct Pki {
    ca_pem: String,
    server_pem: String,
    server_key_pem: String,
}

fn new_ca(name: &str) -> (CertificateParams, KeyPair, String) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let cert = params.self_signed(&key).expect("self-signed CA");
    (params, key, cert.pem())
}

fn pki() -> Pki {
    let (ca_params, ca_key, ca_pem) = new_ca("pg-outbox test CA");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("server key");
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).expect("server params");
    params.distinguished_name.push(DnType::CommonName, "localhost");
    let cert = params.signed_by(&key, &issuer).expect("server certificate");
    Pki { ca_pem, server_pem: cert.pem(), server_key_pem: key.serialize_pem() }
}

/// A throwaway server that only accepts TLS connections over TCP.
async fn tls_server(pki: &Pki) -> TempServer {
    tls_server_with(pki, TempServerOptions::default()).await
}

/// [`tls_server`] with `options`' settings too.
async fn tls_server_with(pki: &Pki, options: TempServerOptions) -> TempServer {
    let options = options
        .file("server.crt", &pki.server_pem)
        .file("server.key", &pki.server_key_pem)
        .file("pg_hba.conf", "local all all trust\nhostssl all all 127.0.0.1/32 trust\n")
        .setting("ssl", "on")
        .setting("ssl_cert_file", "server.crt")
        .setting("ssl_key_file", "server.key");
    tokio::task::spawn_blocking(move || TempServer::start_with(options))
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("cannot start a TLS PostgreSQL server: {}", pg_outbox::error::report(&e)))
}

async fn plain_server() -> TempServer {
    tokio::task::spawn_blocking(TempServer::start)
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("cannot start a PostgreSQL server: {}", pg_outbox::error::report(&e)))
}

fn write_file(dir: &tempfile::TempDir, name: &str, contents: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, contents).expect("write a test file");
    path.display().to_string()
}

/// Connect with `url` and return whether the session is encrypted (from
/// `pg_stat_ssl`), or the error as one line.
async fn ssl_in_use(url: &str) -> Result<bool, String> {
    let opts = pg_outbox::ConnectOptions::parse(url).map_err(|e| pg_outbox::error::report(&e))?;
    let client = opts.connect().await.map_err(|e| pg_outbox::error::report(&e))?;
    let row = client
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
        .await
        .expect("query pg_stat_ssl");
    Ok(row.get(0))
}

#[tokio::test]
async fn tls_modes_against_a_tls_only_server() {
    let pki = pki();
    let server = tls_server(&pki).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = write_file(&dir, "ca.pem", &pki.ca_pem);
    let (_, _, other_ca_pem) = new_ca("some other CA");
    let other_ca = write_file(&dir, "other-ca.pem", &other_ca_pem);
    let port = server.port();
    let by_name = |q: &str| format!("postgres://postgres@localhost:{port}/postgres?{q}");
    let by_ip = |q: &str| format!("postgres://postgres@127.0.0.1:{port}/postgres?{q}");

    // verify-full with the right CA and the certificate's host name.
    assert_eq!(ssl_in_use(&by_name(&format!("sslmode=verify-full&sslrootcert={ca}"))).await, Ok(true));
    // The same in a key=value string.
    let kv = format!("host=localhost port={port} user=postgres dbname=postgres sslmode=verify-full sslrootcert='{ca}'");
    assert_eq!(ssl_in_use(&kv).await, Ok(true));

    // verify-full by IP address: the certificate is for localhost only.
    let e = ssl_in_use(&by_ip(&format!("sslmode=verify-full&sslrootcert={ca}"))).await.expect_err("name mismatch");
    assert!(e.contains("sslmode=verify-full") && e.contains("not valid for name \"127.0.0.1\""), "{e}");
    assert!(e.contains("localhost"), "the error names what the certificate is valid for: {e}");

    // verify-ca checks the chain but not the name: by IP address it works ...
    assert_eq!(ssl_in_use(&by_ip(&format!("sslmode=verify-ca&sslrootcert={ca}"))).await, Ok(true));
    // ... and with a CA that did not sign the certificate it fails.
    let e = ssl_in_use(&by_name(&format!("sslmode=verify-ca&sslrootcert={other_ca}"))).await.expect_err("wrong CA");
    assert!(e.contains("sslmode=verify-ca") && e.contains("invalid peer certificate"), "{e}");
    // require with a root certificate verifies the chain like verify-ca (libpq).
    let e = ssl_in_use(&by_name(&format!("sslmode=require&sslrootcert={other_ca}"))).await.expect_err("wrong CA");
    assert!(e.contains("sslmode=require") && e.contains("invalid peer certificate"), "{e}");

    // verify-full without any root certificate is refused before connecting.
    let e = ssl_in_use(&by_name("sslmode=verify-full")).await.expect_err("no roots");
    assert!(e.contains("sslmode=verify-full needs trusted root certificates"), "{e}");

    // require without a root certificate: encrypted, not verified.
    assert_eq!(ssl_in_use(&by_ip("sslmode=require")).await, Ok(true));
    // prefer (also the default) uses TLS when the server offers it.
    assert_eq!(ssl_in_use(&by_ip("sslmode=prefer")).await, Ok(true));
    assert_eq!(ssl_in_use(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).await, Ok(true));
    // allow: the plain attempt is refused by this server, the TLS one works.
    assert_eq!(ssl_in_use(&by_ip("sslmode=allow")).await, Ok(true));
    // disable: refused by this server (no pg_hba entry without encryption).
    let e = ssl_in_use(&by_ip("sslmode=disable")).await.expect_err("plain refused");
    assert!(e.contains("sslmode=disable") && e.contains("no encryption"), "{e}");
}

/// migrate, publish and relay to stdout over verify-full; every session of
/// the relay (the drain connection and the LISTEN connection) is encrypted.
#[tokio::test]
async fn relay_end_to_end_over_verify_full() {
    let pki = pki();
    let server = tls_server(&pki).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = write_file(&dir, "ca.pem", &pki.ca_pem);
    let url = format!("postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}", server.port());

    let Out { code, stderr: err, .. } = cli(&["migrate"]).url(&url).run().await;
    assert_eq!(code, Some(0), "migrate over verify-full failed: {err}");
    let agg = uuid::Uuid::new_v4().to_string();
    let payload = r#"{"version":1,"data":{"tls":true}}"#;
    let publish =
        ["publish", "--aggregate-type", "tls", "--aggregate-id", &agg, "--event-type", "Sent", "--payload", payload];
    let Out { code, stdout: out, stderr: err, .. } = cli(&publish).url(&url).run().await;
    assert_eq!(code, Some(0), "publish over verify-full failed: {err}");
    let id: i64 = out.trim().parse().unwrap_or_else(|e| panic!("publish prints an id ({e}): {out}"));

    let mut relay =
        relay_proc::start_spec(Relay::new(support::bin()).url(&url).args(&["--sink", "stdout"]).stdout(Output::Piped))
            .await;
    let mut lines = BufReader::new(relay.stdout.take().expect("stdout is piped")).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("a delivery within 30 s")
        .expect("read relay stdout")
        .expect("relay stdout open");
    let record: serde_json::Value = serde_json::from_str(&line).expect("a JSON record");
    assert_eq!(record["id"], serde_json::json!(id), "{line}");
    assert_eq!(record["aggregate_id"], serde_json::json!(agg), "{line}");

    let admin = pg_outbox::ConnectOptions::parse(&url).expect("url").connect().await.expect("connect");
    let rows = admin
        .query(
            "SELECT a.application_name, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name IN ('pg-outbox drain', 'pg-outbox listener')",
            &[],
        )
        .await
        .expect("query pg_stat_ssl");
    let mut seen: Vec<(String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![("pg-outbox drain".to_string(), true), ("pg-outbox listener".to_string(), true)],
        "the relay's drain and LISTEN sessions are both encrypted"
    );
    relay.kill9().await;
}

/// The WAL source's replication connection follows the URL's `sslmode`
/// too: over `verify-full`, its WAL sender's session is encrypted and the
/// stream wakes the relay (its sweep is an hour away).
#[cfg(feature = "wal")]
#[tokio::test]
async fn the_wal_source_streams_over_verify_full() {
    let pki = pki();
    let server = tls_server_with(&pki, TempServerOptions::default().setting("wal_level", "logical")).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = write_file(&dir, "ca.pem", &pki.ca_pem);
    let url = format!("postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}", server.port());
    let Out { code, stderr: err, .. } = cli(&["migrate", "--source", "wal"]).url(&url).run().await;
    assert_eq!(code, Some(0), "migrate --source wal over verify-full failed: {err}");
    let admin = pg_outbox::ConnectOptions::parse(&url).expect("url").connect().await.expect("connect");
    if admin
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .expect("version")
        .get::<_, i32>(0)
        < 140_000
    {
        return;
    }
    let args = ["--source", "wal", "--sink", "stdout", "--sweep-interval", "1h"];
    let mut relay =
        relay_proc::start_spec(Relay::new(support::bin()).url(&url).args(&args).stdout(Output::Piped)).await;
    let mut lines = BufReader::new(relay.stdout.take().expect("stdout is piped")).lines();
    let id: i64 = admin
        .query_one(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('tls', gen_random_uuid(), 'Sent', '{}') RETURNING id",
            &[],
        )
        .await
        .expect("insert")
        .get(0);
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("a delivery within 30 s (the sweep is an hour away)")
        .expect("read relay stdout")
        .expect("relay stdout open");
    let record: serde_json::Value = serde_json::from_str(&line).expect("a JSON record");
    assert_eq!(record["id"], serde_json::json!(id), "{line}");
    let encrypted: Vec<bool> = admin
        .query("SELECT s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)", &[])
        .await
        .expect("query pg_stat_ssl")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(encrypted, vec![true], "the relay's one WAL sender session is encrypted");
    relay.kill9().await;
}

#[tokio::test]
async fn tls_modes_against_a_server_without_tls() {
    let server = plain_server().await;
    let url = |q: &str| format!("postgres://postgres@127.0.0.1:{}/postgres?{q}", server.port());
    assert_eq!(ssl_in_use(&url("sslmode=prefer")).await, Ok(false));
    assert_eq!(ssl_in_use(&url("sslmode=allow")).await, Ok(false));
    assert_eq!(ssl_in_use(&url("sslmode=disable")).await, Ok(false));
    let e = ssl_in_use(&url("sslmode=require")).await.expect_err("no TLS on this server");
    assert!(e.contains("sslmode=require") && e.contains("server does not support TLS"), "{e}");

    // The binary says the same on one line and exits non-zero.
    let Out { code, stderr: err, .. } = cli(&["status"]).url(&url("sslmode=require")).run().await;
    assert_ne!(code, Some(0), "status with sslmode=require against a server without TLS must fail");
    assert!(err.contains("sslmode=require") && err.contains("server does not support TLS"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// A Unix socket never uses TLS, as with libpq: `sslmode=verify-full`
/// without any root certificate still connects there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_ignores_the_tls_settings() {
    let server = plain_server().await;
    let url = format!(
        "host={} port={} user=postgres dbname=postgres sslmode=verify-full",
        server.socket_dir().display(),
        server.port()
    );
    let Out { code, stderr: err, .. } = cli(&["migrate"]).url(&url).run().await;
    assert_eq!(code, Some(0), "migrate over the socket: {err}");
    let Out { code, stdout: out, stderr: err, .. } = cli(&["status"]).url(&url).run().await;
    assert_eq!(code, Some(0), "status over the socket: {err}");
    assert!(out.contains("unpublished"), "{out}");
}

/// Every public way to connect with a `ConnectOptions`, each as one result:
/// whether the session is encrypted, or the error as one line.
async fn every_public_path(url: &str) -> Vec<(&'static str, Result<bool, String>)> {
    let report = |e: &tokio_postgres::Error| pg_outbox::error::report(e);
    let opts = match pg_outbox::ConnectOptions::parse(url) {
        Ok(o) => o,
        Err(e) => return vec![("parse", Err(pg_outbox::error::report(&e)))],
    };
    async fn encrypted(c: &tokio_postgres::Client) -> Result<bool, String> {
        c.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
            .await
            .map(|r| r.get(0))
            .map_err(|e| e.to_string())
    }
    let mut out = Vec::new();
    // ConnectOptions::connect.
    out.push((
        "connect()",
        match opts.connect().await {
            Ok(c) => encrypted(&c).await,
            Err(e) => Err(pg_outbox::error::report(&e)),
        },
    ));
    // A pool's way: tokio_postgres_config() with our connector ...
    let pool = match opts.tls_connector() {
        Ok(tls) => match opts.tokio_postgres_config().connect(tls).await {
            Ok((c, conn)) => {
                tokio::spawn(conn);
                encrypted(&c).await
            }
            Err(e) => Err(report(&e)),
        },
        Err(e) => Err(pg_outbox::error::report(&e)),
    };
    out.push(("tokio_postgres_config() + tls_connector()", pool));
    // ... and with NoTls, which must never connect without TLS.
    let plain = match opts.tokio_postgres_config().connect(tokio_postgres::NoTls).await {
        Ok((c, conn)) => {
            tokio::spawn(conn);
            encrypted(&c).await
        }
        Err(e) => Err(report(&e)),
    };
    out.push(("tokio_postgres_config() + NoTls", plain));
    // The consumer (its start checks the schema after connecting: an
    // unmigrated database still proves the connection was made).
    let consumer = match pg_outbox::Consumer::builder(opts.clone()).start().await {
        Ok(_) => Ok(true),
        Err(pg_outbox::Error::NotMigrated(_)) => Ok(true),
        Err(e) => Err(pg_outbox::error::report(&e)),
    };
    out.push(("Consumer::start", consumer));
    // The binary's migrate.
    let Out { code, stderr, .. } = cli(&["migrate"]).url(url).run().await;
    out.push(("pg-outbox migrate", if code == Some(0) { Ok(true) } else { Err(stderr.trim().to_string()) }));
    out
}

/// No public path turns a `verify-full` URL into an unverified or plaintext
/// connection: `connect()`, the pool path with our connector or with
/// `NoTls`, the consumer and the binary all refuse an untrusted certificate,
/// a certificate for another host name, and a server without TLS; with the
/// right CA and name, every path but `NoTls` connects encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_public_path_weakens_verify_full() {
    let pki = pki();
    let server = tls_server(&pki).await;
    let plain = plain_server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = write_file(&dir, "ca.pem", &pki.ca_pem);
    let (_, _, other_ca_pem) = new_ca("some other CA");
    let other_ca = write_file(&dir, "other-ca.pem", &other_ca_pem);
    let url = |host: &str, port: u16, ca: &str| {
        format!("postgres://postgres@{host}:{port}/postgres?sslmode=verify-full&sslrootcert={ca}")
    };

    let good = every_public_path(&url("localhost", server.port(), &ca)).await;
    for (path, result) in &good {
        let want: Result<bool, String> = Ok(true);
        if *path == "tokio_postgres_config() + NoTls" {
            let e = result.as_ref().expect_err("NoTls with verify-full must refuse");
            assert!(e.contains("TLS") || e.contains("tls"), "{path}: {e}");
        } else {
            assert_eq!(result, &want, "{path}: verify-full with the right CA and name connects encrypted");
        }
    }

    let cases = [
        ("an untrusted certificate", url("localhost", server.port(), &other_ca), "invalid peer certificate"),
        ("a certificate for another name", url("127.0.0.1", server.port(), &ca), "not valid for name"),
        ("a server without TLS", url("localhost", plain.port(), &ca), "server does not support TLS"),
    ];
    for (what, url, reason) in cases {
        // A refused certificate is not worth retrying; a server without TLS
        // is a setting to fix too, but looks like any closed connection.
        if reason != "server does not support TLS" {
            let err = pg_outbox::ConnectOptions::parse(&url).expect("url").connect().await.expect_err("refused");
            assert!(!err.is_transient(), "{what}: a refused certificate is not transient: {err:?}");
        }
        for (path, result) in every_public_path(&url).await {
            let e = result.expect_err(&format!("{path} must refuse {what}"));
            if path == "tokio_postgres_config() + NoTls" {
                assert!(e.contains("TLS") || e.contains("tls"), "{path}, {what}: {e}");
            } else {
                assert!(e.contains(reason), "{path}, {what}: the error names the reason ({reason}): {e}");
                if path != "tokio_postgres_config() + tls_connector()" {
                    assert!(e.contains("sslmode=verify-full"), "{path}, {what}: names the mode: {e}");
                }
            }
        }
    }
}

/// `TlsConnector` meets what deadpool-postgres's `Manager::from_config`
/// asks of a connector (checked at compile time).
#[test]
fn the_tls_connector_fits_a_pool() {
    use tokio_postgres::Socket;
    use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
    fn pool_ready<T>()
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
    }
    pool_ready::<pg_outbox::tls::TlsConnector>();
    let opts = pg_outbox::ConnectOptions::parse("postgres://u@db.example.com/d?sslmode=require").expect("url");
    assert!(opts.tls_connector().is_ok(), "require without roots needs none");
}

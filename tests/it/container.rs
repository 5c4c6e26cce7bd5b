//! The container image (`contrib/container`): built with podman from
//! scratch around the binary under test, run against the test database, it
//! migrates, relays, answers its probes, and exits 0 on SIGTERM as PID 1.
//!
//! Needs podman and runc (`.ci/run` installs them). Without them the test
//! skips ([`needs`](crate::needs)), unless `PG_OUTBOX_REQUIRE_PODMAN=1`,
//! which makes it fail. Everything podman stores goes to a temporary directory of the
//! test (vfs storage: no overlay filesystem needed), removed at the end.
//! About 10 s.

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

use crate::health::{probe, probe_until};
use crate::needs;
use crate::support::{self, TestDb};
use pg_outbox_testkit::process::{self, LIVENESS};

/// Podman's own storage and state, apart from the machine's.
struct Podman {
    /// The podman and runc programs.
    bin: PathBuf,
    runc: PathBuf,
    dir: tempfile::TempDir,
    container: Option<String>,
}

impl Podman {
    /// The global options: storage in `dir` (vfs: works without overlayfs),
    /// and runc (crun refuses a machine whose cgroups are in hybrid mode).
    fn global(&self) -> Vec<String> {
        let d = self.dir.path();
        vec![
            "--root".into(),
            d.join("root").display().to_string(),
            "--runroot".into(),
            d.join("run").display().to_string(),
            "--storage-driver".into(),
            "vfs".into(),
            "--runtime".into(),
            self.runc.display().to_string(),
        ]
    }

    async fn run(&self, args: &[&str]) -> Output {
        Command::new(&self.bin)
            .args(self.global())
            .args(args)
            .output()
            .await
            .unwrap_or_else(|e| panic!("podman {args:?}: {e}"))
    }

    async fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert!(out.status.success(), "podman {args:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        if let Some(name) = self.container.take() {
            let _ = std::process::Command::new(&self.bin).args(self.global()).args(["rm", "-f", &name]).output();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_relays_answers_its_probes_and_stops_cleanly_on_sigterm() {
    let Some([bin, runc]) = needs::programs([&needs::PODMAN, &needs::RUNC]) else { return };
    let db = TestDb::new("container_image").await;
    let url = db.url();
    if !url.starts_with("postgres://") {
        needs::skip("the test database is reached through a Unix socket, which the container cannot see");
        return;
    }
    let mut podman = Podman { bin, runc, dir: tempfile::tempdir().expect("temporary directory"), container: None };
    let tag = format!("localhost/pg-outbox-it:{}", std::process::id());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("contrib/container/build.sh");
    let build = Command::new("sh")
        .arg(&script)
        .args([support::bin(), &tag])
        .env("PODMAN", format!("{} {}", podman.bin.display(), podman.global().join(" ")))
        .output()
        .await
        .expect("run build.sh");
    assert!(build.status.success(), "build.sh: {}\n{}", build.status, String::from_utf8_lossy(&build.stderr));

    // Small limits: raising them is refused in some sandboxes (this one).
    let base = ["run", "--network", "host", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"];
    let env = format!("DATABASE_URL={url}");
    let version = podman.ok(&[&base[..], &["--rm", &tag, "--version"]].concat()).await;
    assert!(version.starts_with("pg-outbox "), "{version}");
    // Runs as the image's non-root user.
    let whoami = podman.ok(&["image", "inspect", "--format", "{{.Config.User}}", &tag]).await;
    assert_eq!(whoami.trim(), "65532:65532");

    let name = format!("pg-outbox-it-{}", std::process::id());
    let port = process::free_port();
    let metrics = format!("127.0.0.1:{port}");
    podman.container = Some(name.clone());
    podman
        .ok(&[
            &base[..],
            &[
                "-d",
                "--name",
                &name,
                "-e",
                &env,
                &tag,
                "relay",
                "--metrics-addr",
                &metrics,
                "--sweep-interval",
                "200ms",
            ],
        ]
        .concat())
        .await;
    // The relay binds its port once it runs; the probes then answer.
    support::eventually(LIVENESS.as_secs(), "the container's relay listens", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
    })
    .await;
    let (_, body) = probe_until(port, "/readyz", LIVENESS, |s, b| s == 200 && b["role"] == "leader").await;
    assert_eq!(body["status"], "ready", "{body}");
    let c = db.client().await;
    let ids = support::insert_seed_events(&c, uuid::Uuid::new_v4(), 3).await;
    support::eventually(30, "the container's relay publishes the events", || async {
        support::published_count(&c).await == 3
    })
    .await;
    let (status, live) = probe(port, "/livez").await;
    assert_eq!(status, 200, "{live}");

    // SIGTERM to PID 1 (the relay), as the kubelet sends it: exit 0.
    podman.ok(&["stop", "-t", "30", &name]).await;
    let code = podman.ok(&["wait", &name]).await;
    let logs = podman.run(&["logs", &name]).await;
    let (stdout, stderr) = (String::from_utf8_lossy(&logs.stdout), String::from_utf8_lossy(&logs.stderr));
    assert_eq!(code.trim(), "0", "exit status of the relay on SIGTERM; log:\n{stderr}");
    assert!(stderr.contains("relay stopped"), "{stderr}");
    let delivered: Vec<i64> =
        stdout.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter_map(|v| v["id"].as_i64()).collect();
    assert_eq!(delivered, ids, "the records on the container's stdout:\n{stdout}");
    podman.ok(&["rm", &name]).await;
    podman.container = None;
    let _ = tokio::time::timeout(Duration::from_secs(30), podman.run(&["rmi", &tag])).await;
}

//! `pg-outbox console` against a real PostgreSQL: in headless Chromium
//! (Debian's `chromium` and `chromium-driver`, driven over WebDriver with
//! fantoccini) with a running relay, and at the HTTP level for the
//! security checks.
//!
//! Without Chromium and chromedriver the browser tests skip
//! ([`needs`](crate::needs)), unless `PG_OUTBOX_REQUIRE_BROWSER=1`.
//!
//! `PG_OUTBOX_SCREENSHOTS=1 cargo test --all-features --test it console`
//! also saves a screenshot of each page to `docs/console-*.png`.

use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};

use fantoccini::{Client as Browser, ClientBuilder, Locator};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::needs;
use crate::support::{DbCli, TestDb, bin, eventually};
use pg_outbox_testkit::process::{self, Relay, free_port};

/// A running `pg-outbox console`; killed when dropped.
struct Console {
    _child: Child,
    base: String,
    log: Arc<Mutex<String>>,
}

impl Console {
    /// Start `pg-outbox console --addr 127.0.0.1:PORT args...` on `db` and
    /// wait until it serves.
    async fn start(db: &TestDb, args: &[&str]) -> Console {
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let mut cmd = Command::new(bin());
        cmd.arg("console").arg("--addr").arg(format!("127.0.0.1:{port}")).arg("--refresh").arg("1h").args(args);
        process::clean_env(&mut cmd);
        cmd.env("DATABASE_URL", db.url()).env("RUST_LOG", "info");
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).kill_on_drop(true);
        let mut child = cmd.spawn().expect("start pg-outbox console");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut s = sink.lock().unwrap_or_else(PoisonError::into_inner);
                s.push_str(&line);
                s.push('\n');
            }
        });
        let console = Console { _child: child, base, log };
        let c = &console;
        eventually(30, "the console serves", || async move { c.log().contains("console serving on") }).await;
        console
    }

    fn log(&self) -> String {
        self.log.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

/// Headless Chromium under chromedriver, in a fresh profile; both end
/// when this is dropped (the whole process group is killed). Tests find
/// the two programs with [`Chromium::programs`] before they start.
struct Chromium {
    browser: Option<Browser>,
    _driver: Child,
    _profile: tempfile::TempDir,
}

/// The paths of chromium and chromedriver.
struct BrowserPrograms {
    chromium: std::path::PathBuf,
    driver: std::path::PathBuf,
}

impl Chromium {
    /// chromium and chromedriver, or `None` when the test skips.
    fn programs() -> Option<BrowserPrograms> {
        let [chromium, driver] = needs::programs([&needs::CHROMIUM, &needs::CHROMEDRIVER])?;
        Some(BrowserPrograms { chromium, driver })
    }

    async fn start(programs: BrowserPrograms) -> Chromium {
        let port = free_port();
        // Its own process group, which the browser it starts joins: dropping
        // this ends both, even when a test panics before `close`.
        let driver = Command::new(&programs.driver)
            .process_group(0)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromedriver");
        let addr = format!("127.0.0.1:{port}");
        eventually(30, "chromedriver listens", || {
            let addr = addr.clone();
            async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
        })
        .await;
        let profile = tempfile::tempdir().expect("profile dir");
        let mut args = vec![
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--no-first-run".into(),
            "--window-size=1280,1000".into(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        args.push("--hide-scrollbars".into());
        let options = serde_json::json!({ "args": args, "binary": programs.chromium });
        let mut caps = serde_json::Map::new();
        caps.insert("goog:chromeOptions".into(), options);
        let browser = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://{addr}"))
            .await
            .expect("a Chromium session through chromedriver");
        Chromium { browser: Some(browser), _driver: driver, _profile: profile }
    }

    fn b(&self) -> &Browser {
        self.browser.as_ref().expect("browser")
    }

    async fn goto(&self, url: &str) {
        self.b().goto(url).await.unwrap_or_else(|e| panic!("open {url}: {e}"));
    }

    async fn text(&self, css: &str) -> String {
        let el = self.b().wait().for_element(Locator::Css(css)).await.unwrap_or_else(|e| panic!("find {css}: {e}"));
        el.text().await.unwrap_or_else(|e| panic!("text of {css}: {e}"))
    }

    async fn click(&self, css: &str) {
        let el = self.b().wait().for_element(Locator::Css(css)).await.unwrap_or_else(|e| panic!("find {css}: {e}"));
        el.click().await.unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    /// Save the page to `docs/console-{name}.png` when
    /// `PG_OUTBOX_SCREENSHOTS=1`.
    async fn screenshot(&self, name: &str) {
        if std::env::var("PG_OUTBOX_SCREENSHOTS").is_ok_and(|v| v == "1") {
            let png = self.b().screenshot().await.expect("screenshot");
            let path = format!("{}/docs/console-{name}.png", env!("CARGO_MANIFEST_DIR"));
            std::fs::write(&path, png).unwrap_or_else(|e| panic!("write {path}: {e}"));
        }
    }

    async fn close(mut self) {
        if let Some(b) = self.browser.take() {
            let _ = b.close().await;
        }
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        if let Some(pid) = self._driver.id().and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: signals the process group this struct started.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
    }
}

const SCRIPT: &str = "<script>alert(1)</script>";

/// Insert one event; returns its id. `state`: `dead` (10 failures,
/// `'infinity'`), `waiting` (2 failures, retry in an hour) or `due`.
async fn insert(c: &tokio_postgres::Client, agg: uuid::Uuid, event_type: &str, payload: &str, state: &str) -> i64 {
    let (retries, next, err): (i32, Option<&str>, Option<&str>) = match state {
        "dead" => (10, Some("infinity"), Some("HTTP 500 <b>upstream</b>")),
        "waiting" => (2, Some("1 hour"), Some("timeout")),
        _ => (0, None, None),
    };
    c.query_one(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, retry_count, next_retry_at, last_error) \
         VALUES ('subscription', $1, $2, $3::text::jsonb, $4, \
           CASE $5::text WHEN 'infinity' THEN 'infinity'::timestamptz WHEN '1 hour' THEN now() + interval '1 hour' END, $6) \
         RETURNING id",
        &[&agg, &event_type, &payload, &retries, &next, &err],
    )
    .await
    .expect("insert an event")
    .get(0)
}

async fn published(c: &tokio_postgres::Client, id: i64) -> bool {
    c.query_opt("SELECT 1 FROM events.outbox WHERE id = $1 AND published_at IS NOT NULL", &[&id])
        .await
        .expect("read an event")
        .is_some()
}

async fn exists(c: &tokio_postgres::Client, id: i64) -> bool {
    c.query_opt("SELECT 1 FROM events.outbox WHERE id = $1", &[&id]).await.expect("read an event").is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_chromium_matches_status_and_a_retried_dead_letter_is_delivered() {
    let Some(programs) = Chromium::programs() else { return };
    let db = TestDb::new("console_browser_retry").await;
    let c = db.client().await;
    let a = uuid::Uuid::new_v4();
    let dead_a = insert(&c, a, "PaymentFailed", r#"{"note": "first"}"#, "dead").await;
    let held1 = insert(&c, a, "PaymentRetried", "{}", "due").await;
    let held2 = insert(&c, a, "PaymentSucceeded", "{}", "due").await;
    for _ in 0..2 {
        insert(&c, uuid::Uuid::new_v4(), "Dead", "{}", "dead").await;
        insert(&c, uuid::Uuid::new_v4(), "Slow", "{}", "waiting").await;
    }
    for _ in 0..3 {
        insert(&c, uuid::Uuid::new_v4(), "Fresh", "{}", "due").await;
    }
    let console = Console::start(&db, &[]).await;
    let chromium = Chromium::start(programs).await;

    // The overview shows what `pg-outbox status --json` shows.
    chromium.goto(&console.url("/")).await;
    let out = db.cli(&["status", "--json"]).run().await;
    assert!(out.ok(), "{out:?}");
    let status: serde_json::Value = serde_json::from_str(&out.stdout).expect("status JSON");
    for key in ["unpublished", "due_now", "held_back", "waiting_for_retry", "dead_letters"] {
        let shown: i64 = chromium.text(&format!("#{key}")).await.parse().expect("a number");
        assert_eq!(serde_json::json!(shown), status[key], "{key}: page {shown}, status {}", status[key]);
    }
    assert_eq!((status["unpublished"].as_i64(), status["held_back"].as_i64()), (Some(10), Some(2)), "{status}");

    // A relay delivers what is due; the dead letter holds its aggregate back.
    let _relay = Relay::new(bin()).url(&db.url()).args(&["--sink", "stdout"]).start().await.expect("relay starts");
    eventually(30, "the due events are delivered", || async {
        c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[])
            .await
            .map(|r| r.get::<_, i64>(0) == 3)
            .unwrap_or(false)
    })
    .await;
    assert!(!published(&c, held1).await && !published(&c, held2).await, "held back behind {dead_a}");
    chromium.goto(&console.url("/")).await;
    let relays = chromium.text("#relays").await;
    assert!(relays.contains("leader") && relays.contains("pg-outbox listener"), "{relays}");
    chromium.screenshot("overview").await;

    // Retry it from its page: a confirmation first, then the relay delivers
    // it and the two events it held back.
    chromium.goto(&console.url(&format!("/events/{dead_a}"))).await;
    assert!(chromium.text("#holds-back").await.contains('2'), "two later events are held back");
    let timeline = chromium.text("#timeline").await;
    assert!(timeline.contains(&held1.to_string()) && timeline.contains(&held2.to_string()), "{timeline}");
    chromium.screenshot("event").await;
    chromium.click("#retry-one").await;
    assert_eq!(chromium.text("#count").await, "1");
    assert!(!published(&c, dead_a).await, "nothing changes before the confirmation");
    chromium.click("#confirm").await;
    assert_eq!(chromium.text("#applied-count").await, "1");
    eventually(30, "the retried dead letter and its aggregate are delivered", || async {
        published(&c, dead_a).await && published(&c, held1).await && published(&c, held2).await
    })
    .await;
    let log = console.log();
    assert!(
        log.contains("console: dead letters changed") && log.contains("action=\"retry\"") && log.contains("count=1"),
        "{log}"
    );
    assert!(log.contains("from=127.0.0.1:"), "the log names the address: {log}");
    chromium.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_chromium_shows_payloads_as_text_and_discards_only_what_was_confirmed() {
    let Some(programs) = Chromium::programs() else { return };
    let db = TestDb::new("console_browser_discard").await;
    let c = db.client().await;
    let script =
        insert(&c, uuid::Uuid::new_v4(), "Dead", &serde_json::json!({ "html": SCRIPT }).to_string(), "dead").await;
    let d1 = insert(&c, uuid::Uuid::new_v4(), "Dead", "{}", "dead").await;
    let d2 = insert(&c, uuid::Uuid::new_v4(), "Dead", "{}", "dead").await;
    let o1 = insert(&c, uuid::Uuid::new_v4(), "Other", "{}", "dead").await;
    let o2 = insert(&c, uuid::Uuid::new_v4(), "Other", "{}", "dead").await;
    let console = Console::start(&db, &[]).await;
    let chromium = Chromium::start(programs).await;

    // The payload and the error are text: no script of theirs runs or exists.
    chromium.goto(&console.url(&format!("/events/{script}"))).await;
    assert!(chromium.text("#payload").await.contains(SCRIPT), "the payload shows as text");
    assert!(chromium.text("#last-error").await.contains("<b>upstream</b>"), "the error shows as text");
    let scripts = chromium
        .b()
        .execute(
            "return [document.scripts.length, document.querySelectorAll('#payload *, #last-error *').length]",
            vec![],
        )
        .await
        .expect("run a script");
    assert_eq!(scripts, serde_json::json!([1, 0]), "only the console's own script; no element from the payload");
    assert!(chromium.b().get_alert_text().await.is_err(), "no alert is open");

    // Discard one of the selected: the confirmation shows the count and
    // deletes nothing; the confirmed click deletes that one only.
    chromium.goto(&console.url("/dead-letters")).await;
    assert!(chromium.text("#match-count").await.starts_with("5 "));
    chromium.screenshot("dead-letters").await;
    chromium.click(&format!("#select-{d1}")).await;
    chromium.click("#discard-selected").await;
    assert_eq!(chromium.text("#count").await, "1");
    assert!(exists(&c, d1).await, "asks first: nothing is deleted yet");
    chromium.screenshot("confirm").await;
    chromium.click("#confirm").await;
    assert_eq!(chromium.text("#applied-count").await, "1");
    assert!(!exists(&c, d1).await, "the confirmed one is deleted");
    for id in [script, d2, o1, o2] {
        assert!(exists(&c, id).await, "{id} was not selected and stays");
    }

    // All that match a filter: exactly those.
    chromium.goto(&console.url("/dead-letters?event_type=Other")).await;
    assert!(chromium.text("#match-count").await.starts_with("2 "));
    chromium.click("#discard-all").await;
    assert_eq!(chromium.text("#count").await, "2");
    chromium.click("#confirm").await;
    assert_eq!(chromium.text("#applied-count").await, "2");
    for (id, stays) in [(script, true), (d2, true), (o1, false), (o2, false)] {
        assert_eq!(exists(&c, id).await, stays, "event {id}");
    }
    chromium.close().await;
}

/// An HTTP client that follows no redirects (to see them).
fn http() -> reqwest::Client {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("HTTP client")
}

/// The CSRF cookie a page sets.
async fn csrf_cookie(client: &reqwest::Client, url: &str, token: Option<&str>) -> String {
    let mut req = client.get(url);
    if let Some(t) = token {
        req = req.header("X-Console-Token", t);
    }
    let resp = req.send().await.expect("GET a page");
    let cookie = resp
        .headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|v| v.strip_prefix("pgo_csrf="))
        .map(|v| v.split(';').next().unwrap_or_default().to_string())
        .expect("the page sets the CSRF cookie");
    let set = resp.headers().get("set-cookie").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert!(set.contains("SameSite=Strict") && set.contains("HttpOnly"), "{set}");
    cookie
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_changes_nothing_without_the_csrf_token_the_console_token_or_from_another_origin() {
    let db = TestDb::new("console_http_guard").await;
    let c = db.client().await;
    let id = insert(&c, uuid::Uuid::new_v4(), "Dead", "{}", "dead").await;
    let dead =
        || async { c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get::<_, i64>(0) };
    let console = Console::start(&db, &[]).await;
    let client = http();
    let apply = console.url("/dead-letters/apply");
    let csrf = csrf_cookie(&client, &console.url("/dead-letters"), None).await;
    let form = format!("csrf={csrf}&action=discard&scope=selected&id={id}");
    let post = |origin: &str, cookie: Option<&str>, body: String| {
        let mut req = client
            .post(&apply)
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", origin)
            .body(body);
        if let Some(cookie) = cookie {
            req = req.header("cookie", format!("pgo_csrf={cookie}"));
        }
        req.send()
    };
    let own = console.base.clone();
    // No cookie; a cookie but no field; another origin; a GET: refused.
    assert_eq!(post(&own, None, form.clone()).await.expect("POST").status(), 403);
    let no_field = format!("action=discard&scope=selected&id={id}");
    assert_eq!(post(&own, Some(&csrf), no_field).await.expect("POST").status(), 403);
    assert_eq!(post("http://evil.example", Some(&csrf), form.clone()).await.expect("POST").status(), 403);
    let get = client.get(format!("{apply}?{form}")).send().await.expect("GET");
    assert_eq!(get.status(), 405);
    // A page asked for under another host name (DNS rebinding): refused.
    let rebound = client.get(console.url("/")).header("host", "evil.example").send().await.expect("GET");
    assert_eq!(rebound.status(), 403);
    assert_eq!(dead().await, 1, "nothing changed");
    // The console's own form, from its own origin: done.
    let ok = post(&own, Some(&csrf), form.clone()).await.expect("POST");
    assert_eq!(ok.status(), 200);
    assert_eq!(dead().await, 0, "the confirmed form discards");
    drop(console);

    // A token: every page needs it; a change needs it too.
    let id = insert(&c, uuid::Uuid::new_v4(), "Dead", "{}", "dead").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    let token = "a-console-token-of-some-length";
    std::fs::write(&token_file, format!("{token}\n")).expect("write the token");
    let tf = token_file.display().to_string();
    let console = Console::start(&db, &["--console-token-file", &tf]).await;
    let page = client.get(console.url("/dead-letters")).send().await.expect("GET");
    assert_eq!(
        (page.status().as_u16(), page.headers().get("location").cloned()),
        (303, Some("/login".parse().expect("header")))
    );
    let csrf = csrf_cookie(&client, &console.url("/dead-letters"), Some(token)).await;
    let form = format!("csrf={csrf}&action=discard&scope=selected&id={id}");
    let post = |token: Option<&str>| {
        let mut req = client
            .post(console.url("/dead-letters/apply"))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", console.base.clone())
            .header("cookie", format!("pgo_csrf={csrf}"))
            .body(form.clone());
        if let Some(t) = token {
            req = req.header("X-Console-Token", t);
        }
        req.send()
    };
    assert_eq!(post(None).await.expect("POST").status(), 401, "the CSRF form alone is not enough");
    assert_eq!(post(Some("a-wrong-token-of-some-length")).await.expect("POST").status(), 401);
    assert_eq!(dead().await, 1, "nothing changed");
    assert_eq!(post(Some(token)).await.expect("POST").status(), 200);
    assert_eq!(dead().await, 0, "the token's change is done");
    drop(console);

    // Read-only: no buttons, and changes are refused.
    insert(&c, uuid::Uuid::new_v4(), "Dead", "{}", "dead").await;
    let console = Console::start(&db, &["--read-only"]).await;
    let page = client.get(console.url("/dead-letters")).send().await.expect("GET");
    let csrf = page
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("pgo_csrf="))
        .map(|v| v.split(';').next().unwrap_or_default().to_string())
        .expect("CSRF cookie");
    let html = page.text().await.expect("page");
    assert!(html.contains("id=\"read-only\"") && !html.contains("discard-selected"), "{html}");
    let refused = client
        .post(console.url("/dead-letters/apply"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", console.base.clone())
        .header("cookie", format!("pgo_csrf={csrf}"))
        .body(format!("csrf={csrf}&action=discard&scope=all&expected=1"))
        .send()
        .await
        .expect("POST");
    assert_eq!(refused.status(), 403);
    assert_eq!(dead().await, 1, "read-only changes nothing");

    // Another address than loopback needs a token.
    let out = db.cli(&["console", "--addr", "0.0.0.0:0"]).run().await;
    assert!(
        !out.ok() && out.stderr.contains("not a loopback address") && out.stderr.contains("--console-token-file"),
        "{out:?}"
    );
}

/// The overview lists the named subscriptions with their figures and
/// leader, and marks one past its lag bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_lists_subscriptions_and_marks_one_behind() {
    let db = TestDb::new("console_subscriptions").await;
    let c = db.client().await;
    for args in [["audit", "1m"], ["billing", "none"]] {
        let mut cli = vec!["subscription", "create", args[0], "--from", "earliest"];
        if args[1] != "none" {
            cli.extend(["--max-lag", args[1]]);
        }
        let out = db.cli(&cli).run().await;
        assert!(out.ok(), "{out:?}");
    }
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         VALUES ('order', $1, 'Placed', '{}', now() - interval '3 hours')",
        &[&uuid::Uuid::new_v4()],
    )
    .await
    .expect("an old event");
    let console = Console::start(&db, &[]).await;
    let page = http().get(console.url("/")).send().await.expect("GET /").text().await.expect("the page");
    let table = page.split("id=\"subscriptions\"").nth(1).unwrap_or_else(|| panic!("no subscriptions table:\n{page}"));
    let rows: Vec<&str> = table.split("<tr>").skip(2).collect();
    assert!(rows[0].contains("<td>audit</td>") && rows[0].contains("class=\"bad\">behind: 3.0 h"), "{table}");
    assert!(rows[0].contains("<td>60.0 s</td>") && rows[0].contains("<td>none</td>"), "{table}");
    assert!(rows[1].contains("<td>billing</td>") && !rows[1].contains("behind"), "{table}");
}

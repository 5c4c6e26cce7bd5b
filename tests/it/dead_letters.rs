//! Dead letters: held-back aggregates, and the operator commands that
//! release them (`pg-outbox dead-letters retry|discard`).

use std::time::Duration;

use futures::StreamExt;
use uuid::Uuid;

use crate::consumer::{ack_next, next, start};
use crate::support::{TestDb, bin, insert_seed_events};

async fn cli(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(bin())
        .args(args)
        .env("DATABASE_URL", db.url())
        .output()
        .await
        .expect("run pg-outbox");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Make `id` a dead letter through the consumer (10 real failures), and
/// wait until the last failure is written.
async fn kill_event(db: &TestDb, stream: &mut pg_outbox::EventStream, id: i64) {
    for attempt in 0..10 {
        let d = next(stream, 10).await;
        assert_eq!((d.id, d.retry_count), (id, attempt));
        d.fail(format!("HTTP 500 attempt {}", attempt + 1));
    }
    let c = db.client().await;
    crate::support::eventually(10, "the dead letter to be written", || async {
        c.query_one("SELECT next_retry_at = 'infinity' FROM events.outbox WHERE id = $1", &[&id])
            .await
            .expect("q")
            .get::<_, Option<bool>>(0)
            == Some(true)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_gives_a_dead_letter_one_more_attempt_then_its_aggregate_flows() {
    let db = TestDb::new("dl_retry").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let ids = insert_seed_events(&c, a, 3).await;
    let policy = pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(10)]).expect("policy").jitter(0.0);
    let mut stream = start(&db, |b| b.retry_policy(policy).sweep_interval(Duration::from_millis(100))).await;
    kill_event(&db, &mut stream, ids[0]).await;
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(600), stream.next()).await {
        panic!("held back, yet {} was delivered", d.id);
    }

    let (code, out, err) = cli(&db, &["dead-letters", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&ids[0].to_string()) && out.contains("HTTP 500 attempt 10"), "{out}");
    let (code, out, _) = cli(&db, &["dead-letters", "list", "--json", "--error-contains", "attempt 10"]).await;
    assert_eq!(code, 0);
    let listed: Vec<serde_json::Value> = serde_json::from_str(&out).expect("json");
    assert_eq!(listed.len(), 1);
    let (code, _, err) = cli(&db, &["dead-letters", "retry"]).await;
    assert_ne!(code, 0, "retry without a selection must refuse");
    assert!(err.contains("--all"), "{err}");
    let (code, out, _) = cli(&db, &["dead-letters", "retry", "--dry-run", &ids[0].to_string()]).await;
    assert_eq!(code, 0);
    assert!(out.contains("would retry 1"), "{out}");

    let (code, out, err) = cli(&db, &["dead-letters", "retry", &ids[0].to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("retried 1"), "{out}");
    let d = next(&mut stream, 10).await;
    assert_eq!((d.id, d.retry_count), (ids[0], 10), "retry_count is kept");
    d.ack();
    for want in &ids[1..] {
        let d = next(&mut stream, 10).await;
        assert_eq!(d.id, *want, "held-back events follow in id order");
        d.ack();
    }
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_deletes_the_dead_letter_and_releases_its_aggregate() {
    let db = TestDb::new("dl_discard").await;
    let c = db.client().await;
    let a = Uuid::new_v4();
    let ids = insert_seed_events(&c, a, 2).await;
    let policy = pg_outbox::RetryPolicy::schedule(vec![Duration::from_millis(10)]).expect("policy").jitter(0.0);
    let mut stream = start(&db, |b| b.retry_policy(policy).sweep_interval(Duration::from_millis(100))).await;
    kill_event(&db, &mut stream, ids[0]).await;

    let (code, _, err) = cli(&db, &["dead-letters", "discard", &ids[0].to_string()]).await;
    assert_ne!(code, 0, "discard needs --yes");
    assert!(err.contains("--yes"), "{err}");
    let (code, out, err) = cli(&db, &["dead-letters", "discard", "--yes", &ids[0].to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("deleted 1"), "{out}");
    ack_next(&mut stream, ids[1], 10).await;
    let left: i64 =
        c.query_one("SELECT count(*) FROM events.outbox WHERE id = $1", &[&ids[0]]).await.expect("q").get(0);
    assert_eq!(left, 0);
    let (code, _, err) = cli(&db, &["dead-letters", "show", &ids[0].to_string()]).await;
    assert_ne!(code, 0);
    assert!(err.contains(&format!("no event {}", ids[0])), "{err}");
    stream.finish().await.expect("finish");
}

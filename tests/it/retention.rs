//! Retention: `pg-outbox archive` deletes only published events older than
//! the cutoff, in bounded batches.

use uuid::Uuid;

use crate::support::{DbCli, TestDb, insert_seed_events};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_deletes_old_published_events_only_in_batches() {
    let db = TestDb::new("archive").await;
    let c = db.client().await;
    let old_published = insert_seed_events(&c, Uuid::new_v4(), 5).await;
    let recent_published = insert_seed_events(&c, Uuid::new_v4(), 2).await;
    let old_unpublished = insert_seed_events(&c, Uuid::new_v4(), 2).await;
    let dead = insert_seed_events(&c, Uuid::new_v4(), 1).await;
    // Due rows after a stretch of rows that are not: a batch that finds
    // none due does not end the run.
    let old_after = insert_seed_events(&c, Uuid::new_v4(), 2).await;
    let old_published = [old_published, old_after].concat();
    c.execute(
        "UPDATE events.outbox SET occurred_at = now() - interval '60 days', published_at = now() - interval '40 days' WHERE id = ANY($1)",
        &[&old_published],
    )
    .await
    .expect("old published");
    c.execute(
        "UPDATE events.outbox SET published_at = now() - interval '1 day' WHERE id = ANY($1)",
        &[&recent_published],
    )
    .await
    .expect("recent");
    c.execute(
        "UPDATE events.outbox SET occurred_at = now() - interval '90 days' WHERE id = ANY($1)",
        &[&old_unpublished],
    )
    .await
    .expect("old unpublished");
    c.execute(
        "UPDATE events.outbox SET occurred_at = now() - interval '90 days', retry_count = 10, next_retry_at = 'infinity' WHERE id = ANY($1)",
        &[&dead],
    )
    .await
    .expect("dead letter");

    let (code, out, err) = db.cli(&["archive", "--dry-run"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("would delete 7 "), "{out}");
    let (code, out, err) = db.cli(&["archive", "--batch-size", "2", "--pause", "10ms"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    // 12 rows, 2 at a time; the batches of the recent, unpublished and
    // dead rows delete nothing.
    assert!(out.contains("deleted 7 published events older than 30days in 6 batches of 2 to 2 rows"), "{out}");
    assert!(out.contains("12 rows walked"), "{out}");
    let left: Vec<i64> =
        c.query("SELECT id FROM events.outbox ORDER BY id", &[]).await.expect("q").iter().map(|r| r.get(0)).collect();
    let mut kept = [recent_published, old_unpublished, dead].concat();
    kept.sort_unstable();
    assert_eq!(left, kept, "recent published, unpublished and dead letters stay");
    let (code, out, _) = db.cli(&["archive"]).run().await.parts();
    assert_eq!(code, Some(0));
    assert!(out.contains("deleted 0 "), "{out}");
    let (code, _, err) = db.cli(&["archive", "--batch-size", "0"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("batch size"), "{err}");
}

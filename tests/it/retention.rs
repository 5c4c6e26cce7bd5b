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

/// A run walks only up to the mark of the oldest earlier run that started
/// at least an hour after its cutoff (no row above it can be due), and
/// leaves its own mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_walks_up_to_an_earlier_runs_mark_and_leaves_its_own() {
    let db = TestDb::new("archive_marks").await;
    let c = db.client().await;
    let old = insert_seed_events(&c, Uuid::new_v4(), 4).await;
    let young = insert_seed_events(&c, Uuid::new_v4(), 2).await;
    c.execute("UPDATE events.outbox SET published_at = now() - interval '40 days' WHERE id = ANY($1)", &[&old])
        .await
        .expect("old published");
    c.execute("UPDATE events.outbox SET published_at = now() - interval '1 day' WHERE id = ANY($1)", &[&young])
        .await
        .expect("young published");
    // As runs 20 and 10 days ago and just under 30 days ago left them: the
    // first is the oldest at least an hour after a 30-day cutoff, the one
    // the run takes; the last is too close to the cutoff to bound anything.
    c.execute(
        "INSERT INTO events.outbox_retention_marks (taken_at, last_id) VALUES \
         (now() - interval '20 days', $1), (now() - interval '10 days', $3), \
         (now() - interval '30 days' + interval '30 minutes', $2)",
        &[&old[3], &old[0], &young[1]],
    )
    .await
    .expect("earlier marks");
    // And 10 005 from long before the cutoff, which bound nothing: a run
    // keeps the newest 10 000 marks it finds, and adds its own.
    c.execute(
        "INSERT INTO events.outbox_retention_marks (taken_at, last_id) \
         SELECT now() - interval '100 days' - make_interval(secs => g), -g FROM generate_series(1, 10005) AS g",
        &[],
    )
    .await
    .expect("old marks");
    // A row above the mark published before it: only a hand-made row can
    // be, so the walk does not reach it.
    let above = insert_seed_events(&c, Uuid::new_v4(), 1).await;
    c.execute("UPDATE events.outbox SET published_at = now() - interval '40 days' WHERE id = ANY($1)", &[&above])
        .await
        .expect("hand-made row");

    let (code, out, err) = db.cli(&["archive", "--batch-size", "2", "--pause", "10ms"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("deleted 4 published events older than 30days in 2 batches of 2 to 2 rows"), "{out}");
    assert!(out.contains(&format!("4 rows walked, up to id {}, an earlier run's mark", old[3])), "{out}");
    let left: Vec<i64> =
        c.query("SELECT id FROM events.outbox ORDER BY id", &[]).await.expect("q").iter().map(|r| r.get(0)).collect();
    assert_eq!(left, [young.clone(), above.clone()].concat(), "the old rows up to the mark went");
    // The run left its mark: the highest id when it started.
    let newest: i64 = c
        .query_one("SELECT last_id FROM events.outbox_retention_marks ORDER BY taken_at DESC LIMIT 1", &[])
        .await
        .expect("mark")
        .get(0);
    assert_eq!(newest, above[0]);
    let (marks, oldest_left): (i64, i64) = c
        .query_one("SELECT count(*), count(*) FILTER (WHERE last_id <= -9998) FROM events.outbox_retention_marks", &[])
        .await
        .map(|r| (r.get(0), r.get(1)))
        .expect("marks kept");
    assert_eq!((marks, oldest_left), (10_001, 0), "the 8 oldest of 10 008 marks went, the run's own came");

    // Without a usable mark the walk goes to the highest id. A mark dated
    // after now (taken while the clock was ahead) bounds nothing, and the
    // run drops it.
    c.execute("DELETE FROM events.outbox_retention_marks", &[]).await.expect("forget the marks");
    c.execute(
        "INSERT INTO events.outbox_retention_marks (taken_at, last_id) VALUES (now() + interval '1 day', $1)",
        &[&young[0]],
    )
    .await
    .expect("a mark from the future");
    let (code, out, err) = db.cli(&["archive", "--batch-size", "2", "--pause", "10ms"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&format!("3 rows walked, up to id {}, the highest", above[0])), "{out}");
    assert!(out.contains("deleted 1 published events"), "{out}");
    let future: i64 = c
        .query_one("SELECT count(*) FROM events.outbox_retention_marks WHERE taken_at > now()", &[])
        .await
        .expect("future marks")
        .get(0);
    assert_eq!(future, 0, "the mark from the future was dropped");

    // Without the marks table (a schema before migration 0014) a run warns
    // and walks to the highest id.
    c.batch_execute("DROP TABLE events.outbox_retention_marks").await.expect("drop the marks");
    let (code, out, err) = db.cli(&["archive", "--older-than", "1h", "--batch-size", "2"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("deleted 2 published events"), "{out}");
    assert!(err.contains("events.outbox_retention_marks cannot be used") && err.contains("pg-outbox migrate"), "{err}");
}

//! A dropped `migrate::apply` or `retention::run` future leaves no advisory
//! lock behind: each runs on a session of its own, which ends with the
//! future, so no caller's (pooled) connection keeps a lock nobody releases.

use std::time::Duration;

use pg_outbox::retention::Retention;
use tokio_postgres::Client;

use crate::support::{TestDb, eventually};

/// Advisory locks granted to sessions of `db` named `app`, and those
/// sessions.
async fn held_by(c: &Client, db: &TestDb, app: &str) -> (i64, i64) {
    let row = c
        .query_one(
            "SELECT (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                     WHERE a.datname = $1 AND a.application_name = $2 \
                       AND l.locktype = 'advisory' AND l.granted) AS locks, \
                    (SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2) AS sessions",
            &[&db.name, &app],
        )
        .await
        .expect("read pg_locks");
    (row.get("locks"), row.get("sessions"))
}

fn options(db: &TestDb, app: &str) -> pg_outbox::ConnectOptions {
    let mut cfg = db.pg.clone();
    cfg.application_name(app);
    crate::support::options_of(&cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_migrate_leaves_no_lock_behind() {
    let db = TestDb::new("cancel_migrate").await;
    let c = db.client().await;
    // The next migrate waits in its concurrent index build, with its lock held.
    let holder = crate::support::stall_the_next_migrate(&db, &c).await;

    let app = "cancel safety migrate";
    let pg = options(&db, app);
    let apply = tokio::spawn(async move { pg_outbox::migrate::apply(&pg).await });
    eventually(30, "migrate holding its lock", || async { held_by(&c, &db, app).await.0 > 0 }).await;
    apply.abort();
    assert!(apply.await.expect_err("aborted").is_cancelled());

    // The build still waits for the snapshot; once it ends, the statement
    // ends and the session (and with it the lock) goes.
    holder.batch_execute("COMMIT").await.expect("end the snapshot");
    eventually(30, "the dropped migrate's session and lock gone", || async { held_by(&c, &db, app).await == (0, 0) })
        .await;

    // A new run is not kept waiting by a leftover lock, and finishes the job.
    let report = tokio::time::timeout(Duration::from_secs(60), pg_outbox::migrate::apply(&options(&db, app)))
        .await
        .expect("a second migrate must not wait for a lock left behind")
        .expect("migrate");
    assert_eq!(report.applied, vec!["0006_outbox_fresh_order_idx".to_string()]);
    pg_outbox::migrate::check(&c).await.expect("schema complete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_retention_run_leaves_no_lock_behind() {
    let db = TestDb::new("cancel_retention").await;
    let c = db.client().await;
    c.execute(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'subscription', gen_random_uuid(), 'PaymentSucceeded', '{}' FROM generate_series(1, 400)",
        &[],
    )
    .await
    .expect("insert events");
    c.execute("UPDATE events.outbox SET published_at = now() - interval '40 days'", &[]).await.expect("publish them");

    let app = "cancel safety retention";
    let slow = Retention {
        older_than: Duration::from_secs(30 * 86_400),
        batch_size: 10,
        pause: Duration::from_millis(200),
        ..Default::default()
    };
    let pg = options(&db, app);
    let run = tokio::spawn(async move { pg_outbox::retention::run(&pg, &slow).await });
    eventually(30, "retention part way, holding its lock", || async {
        let left: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
        left < 400 && held_by(&c, &db, app).await.0 > 0
    })
    .await;
    run.abort();
    assert!(run.await.expect_err("aborted").is_cancelled());
    eventually(30, "the dropped run's session and lock gone", || async { held_by(&c, &db, app).await == (0, 0) }).await;
    let left: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert!(left > 0 && left < 400, "the run was cut part way: {left} rows left");

    // The next run takes the lock (it is not skipped) and deletes the rest.
    let fast = Retention {
        older_than: Duration::from_secs(30 * 86_400),
        batch_size: 100,
        pause: Duration::ZERO,
        ..Default::default()
    };
    let report = pg_outbox::retention::run(&options(&db, app), &fast).await.expect("retention");
    assert!(!report.skipped, "a lock was left behind: {report:?}");
    assert_eq!(report.deleted, left);
    let left: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    assert_eq!(left, 0);
}

//! Faults injected for real: the work connection terminated mid-stream.

use std::collections::HashSet;
use std::time::Duration;

use uuid::Uuid;

use crate::consumer::{next, start};
use crate::support::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_the_work_connection_loses_nothing() {
    let db = TestDb::new("work_conn_killed").await;
    let c = db.client().await;
    let agg = Uuid::new_v4();
    let ids: Vec<i64> = crate::support::insert_seed_events(&c, agg, 400).await;
    let mut stream = start(&db, |b| {
        b.batch_size(20).sweep_interval(Duration::from_millis(200)).reconnect_max_delay(Duration::from_millis(300))
    })
    .await;
    let mut seen = HashSet::new();
    let mut last = 0;
    let mut kills = 0;
    while seen.len() < ids.len() {
        let d = next(&mut stream, 20).await;
        assert!(d.id >= last || seen.contains(&d.id), "order: {} after {last}", d.id);
        last = last.max(d.id);
        seen.insert(d.id);
        if seen.len() % 100 == 50 && kills < 3 {
            kills += db.terminate("pg-outbox drain").await;
        }
        d.ack();
    }
    assert!(kills >= 1, "a fault was injected");
    drop(stream);
    // Every event ends published, even those whose acknowledgement was in flight.
    let mut stream = start(&db, |b| b.sweep_interval(Duration::from_millis(200))).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        while let Ok(Some(d)) =
            tokio::time::timeout(Duration::from_millis(50), futures::StreamExt::next(&mut stream)).await
        {
            d.ack();
        }
        let left: i64 =
            c.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NULL", &[]).await.expect("q").get(0);
        if left == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} events still unpublished");
    }
    stream.finish().await.expect("finish");
}

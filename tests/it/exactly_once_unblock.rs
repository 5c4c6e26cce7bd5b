//! Exactly-once Redis and events freed behind the relay's back: a dead
//! letter discarded with the unblock triggers disabled inside the discard's
//! transaction (triggers/outbox_unblock.sql, docs/architecture.md "The
//! fetch floor") lets a later event of its aggregate reach the stream
//! before the events it held back. Through real `pg-outbox relay`
//! processes and the Redis server on 127.0.0.1:6379, this file shows that
//! those late events are refused by the stream and fail, saying order broke
//! upstream: none is marked published while the stream lacks it.
//!
//! It runs on a PostgreSQL server of its own: the fetch floor moves only
//! once a snapshot's xmin, which is the whole server's, passes the
//! transactions that drew the ids below it, and a long transaction of
//! another test on a shared server would hold every floor back.

use pg_outbox::dead_letters::{self, Filter};
use pg_outbox::{NewEvent, Publisher};
use pg_outbox_testkit::TempServer;
use tokio_postgres::{Client, NoTls};
use uuid::Uuid;

use crate::brokers::{LIVENESS, aggregates, line_with, publish_events, published_count, row_state, wait_published};
use crate::needs;
use crate::relay_proc::{Relay, RelayProc, start_spec};
use crate::sink_redis::{Entries, REDIS_URL, TestKeys, per_aggregate};
use crate::support::{self, eventually};

/// A session on `url`.
async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("connect to the throwaway server");
    tokio::spawn(connection);
    client
}

/// `pg-outbox relay args...` on `url`, once it logged that it started.
async fn start(url: &str, args: &[&str]) -> RelayProc {
    start_spec(Relay::new(support::bin()).url(url).args(args)).await
}

/// The term of scope 'unblock' (`None` until something counted one).
async fn unblocks(c: &Client) -> Option<i64> {
    c.query_opt("SELECT term FROM events.outbox_terms WHERE scope = 'unblock'", &[])
        .await
        .expect("the unblock count")
        .map(|r| r.get(0))
}

/// The published events whose own entry (`<id>-0`, with the event's id in
/// its field `id`) is missing from their aggregate's stream: events marked
/// published that the broker does not hold.
async fn published_but_absent(c: &Client, keys: &TestKeys) -> Vec<i64> {
    let rows = c
        .query(
            "SELECT id, aggregate_type, aggregate_id FROM events.outbox WHERE published_at IS NOT NULL ORDER BY id",
            &[],
        )
        .await
        .expect("the published events");
    let mut conn = keys.conn().await;
    let mut absent = Vec::new();
    for r in rows {
        let (id, aggregate_type, aggregate_id): (i64, String, Uuid) = (r.get(0), r.get(1), r.get(2));
        let key = format!("{}:{aggregate_type}:{aggregate_id}", keys.prefix);
        let own = format!("{id}-0");
        let entries: Entries =
            redis::cmd("XRANGE").arg(&key).arg(&own).arg(&own).query_async(&mut conn).await.expect("XRANGE");
        let held = entries.iter().any(|(entry, f)| *entry == own && f.get("id") == Some(&id.to_string()));
        if !held {
            absent.push(id);
        }
    }
    absent
}

/// End to end, the path triggers/outbox_unblock.sql warns of: event a0 of
/// aggregate A fails at the sink (its stream key holds a string: WRONGTYPE)
/// and is a dead letter (`--max-retries 1`); a1 and a2 are held back behind
/// it while other aggregates' events move the fetch floor past them. The
/// key is fixed and a0 discarded in a transaction that disables the unblock
/// triggers and enables them again before COMMIT, so the unblock count does
/// not move and the relay is not told. A later event a3 is then delivered
/// first (above the floor), and a relay started afterwards fetches a1 from
/// the first fresh row: Redis refuses `a1-0` below the stream's top `a3-0`,
/// the stream has no entry `a1-0`, and the event fails, saying order broke
/// upstream, instead of being acknowledged unsent (a2 stays held behind it).
/// The stream holds only a3, and every event marked published has its own
/// entry. The sweep is an hour away, so the floor's safety net never runs;
/// the server is the test's own, so nothing else holds the floor back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_exactly_once_events_freed_behind_the_relays_back_fail_instead_of_being_acknowledged_unsent() {
    if !needs::server(&needs::REDIS).await {
        return;
    }
    let keys = TestKeys::new("eo_unblock");
    let server = tokio::task::spawn_blocking(TempServer::start)
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {}", pg_outbox::error::report(&e)));
    let url = server.url();
    let migrate = support::cli(&["migrate"]).url(&url).run().await;
    assert!(migrate.ok(), "pg-outbox migrate failed: {}", migrate.stderr);
    let c = connect(&url).await;
    let aggregate = Uuid::new_v4();
    let key = format!("{}:order:{aggregate}", keys.prefix);
    let publisher = Publisher::new();
    let event = |n: i32| NewEvent::new("order", aggregate, "Updated", serde_json::json!({ "n": n }));

    // The aggregate's key holds a string: XADD fails with WRONGTYPE.
    let _: () = redis::cmd("SET").arg(&key).arg("not a stream").query_async(&mut keys.conn().await).await.expect("SET");
    let a0 = publisher.publish(&c, &event(0)).await.expect("publish a0");
    let template = per_aggregate(&keys);
    let args = [
        "--sink",
        REDIS_URL,
        "--exactly-once",
        "--redis-stream",
        &template,
        "--max-retries",
        "1",
        "--retry-schedule",
        "1h",
        "--sweep-interval",
        "1h",
    ];
    let mut relay = start(&url, &args).await;
    eventually(LIVENESS.as_secs(), "a0 failed", || async { row_state(&c, a0).await.1 == 1 }).await;
    let a1 = publisher.publish(&c, &event(1)).await.expect("publish a1");
    let a2 = publisher.publish(&c, &event(2)).await.expect("publish a2");
    // Other aggregates' events, each fetched and acknowledged on its own,
    // so the floor moves on past a1 and a2 (held back all along).
    let mut others = 0;
    for (t, other) in aggregates(8) {
        others += publish_events(&c, &[(t, other)], 1, "other").await.len() as i64;
        wait_published(&c, others).await;
    }
    for id in [a1, a2] {
        assert_eq!(row_state(&c, id).await, (false, 0, None), "event {id} is held back behind the dead letter {a0}");
    }
    let before = unblocks(&c).await;

    // Fix the key; discard a0 with the unblock triggers disabled inside the
    // transaction, enabled again before it commits.
    let _: i64 = redis::cmd("DEL").arg(&key).query_async(&mut keys.conn().await).await.expect("DEL");
    let mut operator = connect(&url).await;
    let tx = operator.transaction().await.expect("begin");
    tx.batch_execute(
        "ALTER TABLE events.outbox DISABLE TRIGGER outbox_unblock; \
         ALTER TABLE events.outbox DISABLE TRIGGER outbox_unblock_delete",
    )
    .await
    .expect("disable the unblock triggers");
    let discarded = dead_letters::discard(&tx, &Filter::ids(vec![a0])).await.expect("discard a0");
    assert_eq!(discarded, [a0], "a0 was a dead letter");
    tx.batch_execute(
        "ALTER TABLE events.outbox ENABLE ALWAYS TRIGGER outbox_unblock; \
         ALTER TABLE events.outbox ENABLE ALWAYS TRIGGER outbox_unblock_delete",
    )
    .await
    .expect("enable the unblock triggers");
    tx.commit().await.expect("commit the discard");
    assert_eq!(unblocks(&c).await, before, "the freeing of a1 and a2 is not counted");

    // A later event of A is delivered first, above the floor.
    let a3 = publisher.publish(&c, &event(3)).await.expect("publish a3");
    eventually(LIVENESS.as_secs(), "a3 published", || async { row_state(&c, a3).await.0 }).await;
    for id in [a1, a2] {
        assert!(
            !row_state(&c, id).await.0,
            "event {id} is not yet published when a3 ({a3}) is: the floor had passed it, and no one told the relay it was freed"
        );
    }
    relay.stop_cleanly().await;

    // A restart's first fetch starts from the first fresh row: a1.
    let mut relay = start(&url, &args).await;
    eventually(LIVENESS.as_secs(), "a1 failed or acknowledged", || async {
        let (published, failures, _) = row_state(&c, a1).await;
        published || failures > 0
    })
    .await;
    relay.stop_cleanly().await;
    let log = relay.log();

    let (published, _, error) = row_state(&c, a1).await;
    assert!(!published, "a1 ({a1}) is not acknowledged: the stream never stored it");
    let error = error.unwrap_or_default();
    assert!(
        error.contains("order broke upstream") && error.contains(&key) && error.contains(&format!("{a3}-0")),
        "a1's error names the order broken upstream, the key and the entry above it: {error}"
    );
    let line = line_with(&log, "order broke upstream");
    assert!(line.contains("sink failed") && line.contains(&a1.to_string()), "{line}");
    assert_eq!(row_state(&c, a2).await, (false, 0, None), "a2 ({a2}) stays held back behind a1");
    let entries = keys.entries(&key).await;
    let got: Vec<(&str, Option<&str>)> =
        entries.iter().map(|(entry, f)| (entry.as_str(), f.get("id").map(String::as_str))).collect();
    let a3_text = a3.to_string();
    assert_eq!(got, [(format!("{a3}-0").as_str(), Some(a3_text.as_str()))], "A's stream holds only what was sent");
    let published_of_a: Vec<i64> = c
        .query(
            "SELECT id FROM events.outbox WHERE aggregate_id = $1 AND published_at IS NOT NULL ORDER BY id",
            &[&aggregate],
        )
        .await
        .expect("A's published events")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(published_of_a, [a3], "of A, only a3 is marked published");
    assert_eq!(published_but_absent(&c, &keys).await, Vec::<i64>::new(), "no event is marked published unsent");
    assert_eq!(published_count(&c).await, others + 1, "besides a3, only the other aggregates' events");
    drop((c, operator));
    tokio::task::spawn_blocking(move || drop(server)).await.expect("stop the throwaway server");
}

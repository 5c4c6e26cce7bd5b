//! The byte bound on what a consumer holds (`max_buffered_bytes`, the
//! relay's `--max-buffered-bytes`): with payloads of about 1 MiB, a reader
//! that acknowledges nothing receives up to the bound plus one event and
//! then nothing more; acknowledging lets the rest through, in id order,
//! each event published once acknowledged; a payload larger than the bound
//! still moves, alone; the relay with the flag delivers everything; a wrong
//! value is an error naming the flag.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;
use pg_outbox::tokio_postgres::Client;
use pg_outbox::{Delivery, EventStream};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::consumer::{next, start};
use crate::relay_proc::{self, LIVENESS};
use crate::support::{TestDb, cli, eventually};

const MIB: usize = 1024 * 1024;

/// Insert events whose payloads are `{"data": "<hex>"}` with `chunks[i]`
/// times 32 hex characters, one aggregate each, in one transaction; their
/// ids, ascending.
async fn insert_sized(c: &Client, chunks: &[i32]) -> Vec<i64> {
    let rows = c
        .query(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'blob', gen_random_uuid(), 'Stored', \
                    jsonb_build_object('data', (SELECT string_agg(md5(n::text || ':' || k::text), '') \
                                                FROM generate_series(1, n) k)) \
             FROM unnest($1::int4[]) WITH ORDINALITY AS s(n, ord) ORDER BY ord RETURNING id",
            &[&chunks],
        )
        .await
        .expect("insert sized events");
    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids ascend in insert order: {ids:?}");
    ids
}

/// Payload bytes of events `ids` as a client receives them (the binary
/// `jsonb`: a version byte and the text), by id.
async fn received_sizes(c: &Client, ids: &[i64]) -> BTreeMap<i64, usize> {
    c.query("SELECT id, octet_length(payload::text) + 1 FROM events.outbox WHERE id = ANY($1)", &[&ids])
        .await
        .expect("payload sizes")
        .iter()
        .map(|r| (r.get::<_, i64>(0), usize::try_from(r.get::<_, i32>(1)).expect("a size")))
        .collect()
}

async fn published_ids(c: &Client) -> BTreeSet<i64> {
    c.query("SELECT id FROM events.outbox WHERE published_at IS NOT NULL", &[])
        .await
        .expect("published ids")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Deliveries until none comes for `quiet` (the stream has stalled).
async fn take_until_quiet(stream: &mut EventStream, quiet: Duration) -> Vec<Delivery> {
    let mut got = Vec::new();
    while let Ok(d) = tokio::time::timeout(quiet, stream.next()).await {
        got.push(d.expect("stream ended"));
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_acknowledges_nothing_stalls_at_the_byte_bound_and_resumes_as_it_acknowledges() {
    let db = TestDb::new("bytes_stall").await;
    let c = db.client().await;
    let bound = 4 * MIB;
    // The sweep is an hour away: every fetch after the first comes from the
    // drain going on, so a fetch the budget cut must not end the drain.
    let mut stream = start(&db, |b| b.max_buffered_bytes(bound).sweep_interval(Duration::from_secs(3600))).await;
    eventually(10, "the idle consumer waits for notifications", || async {
        c.query_one("SELECT coalesce(bool_and(waiting), false) FROM events.outbox_relays", &[])
            .await
            .expect("relays")
            .get::<_, bool>(0)
    })
    .await;
    // Twelve payloads of 1 MiB of text (32 768 x 32 hex characters) each,
    // in one transaction: one notification.
    let ids = insert_sized(&c, &[32_768; 12]).await;
    let sizes = received_sizes(&c, &ids).await;
    let largest = sizes.values().copied().max().expect("sizes");

    // Acknowledge nothing: the stream stalls once the bound is reached.
    let held = take_until_quiet(&mut stream, Duration::from_secs(1)).await;
    let got: Vec<i64> = held.iter().map(|d| d.id).collect();
    let total: usize = got.iter().map(|id| sizes[id]).sum();
    eprintln!("held {} events, {total} payload bytes, bound {bound}, largest {largest}", got.len());
    assert_eq!(got, ids[..got.len()], "a prefix of the backlog, in id order");
    assert!(total < bound + largest, "held {total} bytes: more than the bound {bound} plus one event ({largest})");
    assert!(total >= bound, "held {total} bytes: the reader waits, so fetches go on up to the bound {bound}");
    assert!(got.len() < ids.len(), "the stream stalled before the backlog's end");
    assert!(published_ids(&c).await.is_empty(), "nothing acknowledged, nothing published");

    // Acknowledging one frees its bytes: the reader, waiting, gets more.
    let mut held = held.into_iter();
    let first = held.next().expect("one held");
    let first_id = first.id;
    first.ack();
    eventually(10, "the acknowledged event is published, and only it", || async {
        published_ids(&c).await == BTreeSet::from([first_id])
    })
    .await;
    let more = take_until_quiet(&mut stream, Duration::from_secs(1)).await;
    assert!(!more.is_empty(), "an acknowledgement makes room for more");
    let still: Vec<i64> = held.as_slice().iter().chain(&more).map(|d| d.id).collect();
    let total: usize = still.iter().map(|id| sizes[id]).sum();
    assert!(total < bound + largest, "held {total} bytes after one acknowledgement");
    assert_eq!(published_ids(&c).await, BTreeSet::from([first_id]), "only what was acknowledged is published");

    // Acknowledge everything, as it comes: the rest arrives, in order.
    let mut order = vec![first_id];
    for d in held.chain(more) {
        order.push(d.id);
        d.ack();
    }
    ack_the_rest_in_order(stream, &c, order, &ids).await;
}

/// Acknowledge deliveries as they come until `order` (the ids delivered so
/// far) holds as many as `ids`; then every event must have come once, in id
/// order, and be published.
async fn ack_the_rest_in_order(mut stream: EventStream, c: &Client, mut order: Vec<i64>, ids: &[i64]) {
    while order.len() < ids.len() {
        let d = next(&mut stream, 10).await;
        order.push(d.id);
        d.ack();
    }
    assert_eq!(order, ids, "every event once, in id order");
    eventually(10, "every event is published", || async { published_ids(c).await.len() == ids.len() }).await;
    stream.finish().await.expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_larger_than_the_byte_bound_is_delivered_alone() {
    let db = TestDb::new("bytes_larger").await;
    let c = db.client().await;
    // Small, 3 MiB, small, 2 MiB, small; the bound is 1 MiB.
    let ids = insert_sized(&c, &[4, 98_304, 4, 65_536, 4]).await;
    let mut stream = start(&db, |b| b.max_buffered_bytes(MIB).sweep_interval(Duration::from_millis(200))).await;

    // The first fetch takes the small event and, as the bytes before it are
    // under the bound, the 3 MiB one; then nothing until they are settled.
    let held = take_until_quiet(&mut stream, Duration::from_secs(1)).await;
    let got: Vec<i64> = held.iter().map(|d| d.id).collect();
    assert_eq!(got, ids[..2], "the small event and the 3 MiB one, then a stall");
    assert_eq!(held[1].payload["data"].as_str().map(str::len), Some(98_304 * 32), "the 3 MiB payload, whole");
    for d in held {
        d.ack();
    }
    ack_the_rest_in_order(stream, &c, got, &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_with_a_byte_bound_delivers_every_large_event_in_order() {
    let db = TestDb::new("bytes_relay").await;
    let c = db.client().await;
    let ids = insert_sized(&c, &[32_768; 10]).await;
    let (mut relay, stdout) =
        relay_proc::start_with_stdout(&db, &["--sink", "stdout", "--max-buffered-bytes", "2MiB"]).await;
    let mut lines = BufReader::new(stdout).lines();
    let mut delivered = Vec::new();
    while delivered.len() < ids.len() {
        let line = match tokio::time::timeout(LIVENESS, lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            other => panic!("no record on the relay's stdout ({other:?}); stderr:\n{}", relay.log()),
        };
        let record: serde_json::Value = serde_json::from_str(&line).expect("a JSON record");
        assert_eq!(record["payload"]["data"].as_str().map(str::len), Some(32_768 * 32), "the whole payload");
        delivered.push(record["id"].as_i64().expect("an id"));
    }
    assert_eq!(delivered, ids, "every event once, in id order");
    eventually(10, "every event is published", || async { published_ids(&c).await.len() == ids.len() }).await;
    relay.sigterm();
    assert!(relay.wait().await.success(), "the relay stops cleanly: {}", relay.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_max_buffered_bytes_is_an_error_naming_the_flag() {
    for (value, why) in [("64", "at least 1MiB"), ("lots", "invalid size 'lots'"), ("1e9", "invalid size")] {
        let out = cli(&["relay", "--sink", "stdout", "--max-buffered-bytes", value]).run().await;
        assert!(!out.ok(), "{value}: refused");
        assert!(out.stderr.contains("--max-buffered-bytes") && out.stderr.contains(why), "{value}: {}", out.stderr);
    }
    let out = cli(&["relay", "--sink", "stdout", "--print-config"]).env("OUTBOX_MAX_BUFFERED_BYTES", "2k").run().await;
    assert!(!out.ok(), "a value from the environment is checked too");
    assert!(out.stderr.contains("--max-buffered-bytes") && out.stderr.contains("at least 1MiB"), "{}", out.stderr);
    let out = cli(&["relay", "--sink", "stdout", "--print-config"]).run().await;
    assert!(out.ok(), "{}", out.stderr);
    let line = out.stdout.lines().find(|l| l.starts_with("max_buffered_bytes")).expect("the setting is printed");
    assert!(line.contains("\"64MiB\"") && line.contains("# default"), "{line}");
    let out = cli(&["relay", "--sink", "stdout", "--max-buffered-bytes", "256MiB", "--print-config"]).run().await;
    assert!(out.stdout.contains("max_buffered_bytes = \"256MiB\""), "{}", out.stdout);

    // A config file may give a size or a number of bytes; a wrong one names
    // the key and the file.
    let dir = tempfile::tempdir().expect("temp dir");
    for (text, ok) in [("max_buffered_bytes = 8388608\n", true), ("max_buffered_bytes = \"1KiB\"\n", false)] {
        let file = dir.path().join("relay.toml");
        std::fs::write(&file, text).expect("write config");
        let path = file.to_string_lossy().into_owned();
        let out = cli(&["relay", "--config", &path, "--print-config"]).run().await;
        if ok {
            assert!(out.ok() && out.stdout.contains("max_buffered_bytes = 8388608"), "{text}: {out:?}");
        } else {
            assert!(!out.ok(), "{text}: refused");
            assert!(out.stderr.contains("max_buffered_bytes") && out.stderr.contains(&path), "{text}: {}", out.stderr);
        }
    }
}

//! Subscriptions, the operators' side (`pg_outbox::subscription`,
//! `pg-outbox subscription ...`): create from each start and the cursor
//! it gives, names checked and taken names refused, pause and resume,
//! rewind refused while active and applied while paused, drop with its
//! failures and term row, a subscription's dead letters, retention that
//! waits for every subscription (and its plan), and the command line.

use std::time::Duration;

use pg_outbox::error::SubscriptionError;
use pg_outbox::subscription::{self, From, SubscriptionState};
use serde_json::Value;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::support::{DbCli, TestDb, insert_seed_events, plan_check_session, plan_count, server_version_num};

/// The subscription error inside `e`, or a panic saying what `e` is.
fn sub_error(e: pg_outbox::Error) -> SubscriptionError {
    match e {
        pg_outbox::Error::Subscription(s) => s,
        other => panic!("expected a subscription error, got {other:?}"),
    }
}

/// `(cursor_id, start_id, state, settled, checkpoint_ids)` of `name`.
async fn row(c: &Client, name: &str) -> (i64, i64, String, Vec<i64>, Vec<i64>) {
    let r = c
        .query_one(
            "SELECT cursor_id, start_id, state, settled, checkpoint_ids FROM events.outbox_subscriptions WHERE name = $1",
            &[&name],
        )
        .await
        .unwrap_or_else(|e| panic!("read subscription {name}: {e}"));
    (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))
}

/// A failure row of `sub` for event `id` (its aggregate read from the
/// event): `retry_count`, and `next_retry_at` as SQL (`'infinity'` for a
/// dead letter, `NULL` for a held event, `now() + interval '1 hour'`).
async fn failure(c: &Client, sub: &str, id: i64, retry_count: i32, next_retry_at: &str) {
    c.execute(
        &format!(
            "INSERT INTO events.outbox_subscription_failures \
               (subscription, id, aggregate_type, aggregate_id, retry_count, last_error, next_retry_at) \
             SELECT $1, o.id, o.aggregate_type, o.aggregate_id, $3, 'HTTP 500 for ' || $1, {next_retry_at} \
             FROM events.outbox o WHERE o.id = $2"
        ),
        &[&sub, &id, &retry_count],
    )
    .await
    .unwrap_or_else(|e| panic!("failure row of {sub} for {id}: {e}"));
}

/// The ids of `sub`'s failure rows, ascending.
async fn failure_ids(c: &Client, sub: &str) -> Vec<i64> {
    c.query("SELECT id FROM events.outbox_subscription_failures WHERE subscription = $1 ORDER BY id", &[&sub])
        .await
        .expect("failure rows")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Every id in `events.outbox`, ascending.
async fn outbox_ids(c: &Client) -> Vec<i64> {
    c.query("SELECT id FROM events.outbox ORDER BY id", &[]).await.expect("ids").iter().map(|r| r.get(0)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_sets_the_cursor_from_each_start() {
    let db = TestDb::new("sub_create").await;
    let c = db.client().await;
    // An empty table: now and earliest both start at 0.
    let empty_now = subscription::create(&c, "empty-now", From::Now).await.expect("create on an empty table");
    assert_eq!((empty_now.cursor_id, empty_now.start_id), (Some(0), Some(0)));
    let empty_earliest = subscription::create(&c, "empty-earliest", From::Earliest).await.expect("create");
    assert_eq!(empty_earliest.cursor_id, Some(0));

    let ids = insert_seed_events(&c, Uuid::new_v4(), 6).await;
    // occurred_at one day apart, oldest first (10 days ago to 5 days ago).
    c.execute(
        "UPDATE events.outbox SET occurred_at = now() - make_interval(days => 10 - (id - $1)::int) WHERE id = ANY($2)",
        &[&ids[0], &ids],
    )
    .await
    .expect("spread occurred_at");

    let now = subscription::create(&c, "from-now", From::Now).await.expect("now");
    assert_eq!((now.cursor_id, now.start_id), (Some(ids[5]), Some(ids[5])), "now: after the highest id");
    assert_eq!(now.state, SubscriptionState::Active);
    assert_eq!(now.backlog_upper_bound, 0);
    assert_eq!(now.lag_seconds, None, "nothing above the cursor");

    let earliest = subscription::create(&c, "from-earliest", From::Earliest).await.expect("earliest");
    assert_eq!(earliest.cursor_id, Some(ids[0] - 1), "earliest: every event");
    // Ids have gaps (the insert trigger draws its own values): the bound
    // is the span of ids above the cursor.
    let span = ids[5] - (ids[0] - 1);
    assert!(span >= 6);
    assert_eq!(earliest.backlog_upper_bound, span);
    let lag = earliest.lag_seconds.expect("a lag: the oldest event waits");
    assert!(lag > 9.0 * 86_400.0 && lag < 11.0 * 86_400.0, "the first event's age, about 10 days: {lag}");

    let by_id = subscription::create(&c, "from-id", From::Id(ids[3])).await.expect("id");
    assert_eq!(by_id.cursor_id, Some(ids[3] - 1), "id:N: the events from N on");

    // A time between the third and the fourth event's: from the fourth on.
    let t: chrono::DateTime<chrono::Utc> = c
        .query_one("SELECT occurred_at + interval '1 hour' FROM events.outbox WHERE id = $1", &[&ids[2]])
        .await
        .expect("a time")
        .get(0);
    let by_time = subscription::create(&c, "from-time", From::Time(t)).await.expect("time");
    assert_eq!(by_time.cursor_id, Some(ids[3] - 1), "time: from the first event at or after it");
    let later = subscription::create(&c, "from-the-future", From::Time(chrono::Utc::now() + chrono::Duration::days(1)))
        .await
        .expect("a time after every event");
    assert_eq!(later.cursor_id, Some(ids[5]), "a time after every event: as now");

    // Stored as returned, start_id equal to the cursor, nothing settled.
    for s in [&now, &earliest, &by_id, &by_time, &later] {
        let (cursor, start, state, settled, checkpoints) = row(&c, &s.name).await;
        assert_eq!((Some(cursor), Some(start)), (s.cursor_id, s.cursor_id), "{}", s.name);
        assert_eq!((state.as_str(), settled.len(), checkpoints.len()), ("active", 0, 0), "{}", s.name);
    }
    // The list: the default first, then by name; the ids settled above the
    // cursor come off the backlog's bound.
    c.execute(
        "UPDATE events.outbox_subscriptions SET settled = ARRAY[$1::int8, $2::int8] WHERE name = 'from-earliest'",
        &[&ids[1], &ids[2]],
    )
    .await
    .expect("settle two above the cursor");
    let all = subscription::list(&c).await.expect("list");
    let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "default",
            "empty-earliest",
            "empty-now",
            "from-earliest",
            "from-id",
            "from-now",
            "from-the-future",
            "from-time"
        ]
    );
    assert_eq!((all[0].cursor_id, all[0].state), (None, SubscriptionState::Active), "the default has no cursor");
    assert_eq!(all[0].backlog_upper_bound, 6, "the default: six events never attempted");
    let e = all.iter().find(|s| s.name == "from-earliest").expect("from-earliest");
    assert_eq!(e.backlog_upper_bound, span - 2, "the span above the cursor, less the two settled");
    // Still the first event's lag: it is not settled.
    assert!(e.lag_seconds.is_some_and(|l| l > 9.0 * 86_400.0), "{e:?}");
    // Ids start at 1; a start past the highest id plus one would skip the
    // events that take the ids between.
    let top: i64 = c.query_one("SELECT max(id) FROM events.outbox", &[]).await.expect("max").get(0);
    for (n, why) in [(i64::MIN, "ids start at 1"), (0, "ids start at 1"), (top + 2, "would skip")] {
        let err = sub_error(subscription::create(&c, "out-of-range", From::Id(n)).await.expect_err("refused"));
        assert!(matches!(&err, SubscriptionError::InvalidStart { why: w, .. } if w.contains(why)), "{n}: {err:?}");
    }
    subscription::create(&c, "next-one", From::Id(top + 1)).await.expect("the next id is a start");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_checked_taken_names_refused_and_unknown_names_named() {
    let db = TestDb::new("sub_names").await;
    let c = db.client().await;
    for (bad, why) in [("Orders", "other than"), ("default", "seeded flow"), ("-x", "start with"), ("", "empty")] {
        let e = subscription::create(&c, bad, From::Now).await.expect_err(bad);
        let text = e.to_string();
        assert!(matches!(sub_error(e), SubscriptionError::InvalidName { .. }), "{bad:?}");
        assert!(text.contains(why) && text.contains("^[a-z0-9][a-z0-9_.-]{0,62}$"), "{bad:?}: {text}");
    }
    let long = "x".repeat(64);
    assert!(subscription::create(&c, &long, From::Now).await.is_err(), "64 characters");
    let rows: i64 = c.query_one("SELECT count(*) FROM events.outbox_subscriptions", &[]).await.expect("count").get(0);
    assert_eq!(rows, 0, "no bad name reached the table");

    subscription::create(&c, "audit", From::Now).await.expect("create");
    let e = subscription::create(&c, "audit", From::Earliest).await.expect_err("a taken name");
    let text = e.to_string();
    assert_eq!(sub_error(e), SubscriptionError::Exists("audit".into()));
    assert!(text.contains("\"audit\"") && text.contains("exists already"), "{text}");
    // Two names whose partitioned mode's lock classes (a 27-bit hash) are
    // the same: the second is refused, naming the first.
    subscription::create(&c, "s61396", From::Now).await.expect("create");
    let e = subscription::create(&c, "s189520", From::Now).await.expect_err("a taken lock class");
    let text = e.to_string();
    assert_eq!(sub_error(e), SubscriptionError::LockClassTaken { name: "s189520".into(), other: "s61396".into() });
    assert!(text.contains("advisory lock class") && text.contains("choose another name"), "{text}");

    // Every operation on an unknown name says which.
    let unknown = |e: pg_outbox::Error| {
        let text = e.to_string();
        assert!(text.contains("\"nope\""), "{text}");
        assert_eq!(sub_error(e), SubscriptionError::Unknown("nope".into()));
    };
    unknown(subscription::get(&c, "nope").await.expect_err("get"));
    unknown(subscription::pause(&c, "nope").await.expect_err("pause"));
    unknown(subscription::resume(&c, "nope").await.expect_err("resume"));
    unknown(subscription::drop(&c, "nope").await.expect_err("drop"));
    unknown(subscription::rewind(&c, "nope", From::Earliest).await.expect_err("rewind"));
    let f = pg_outbox::dead_letters::Filter::all().subscription("nope");
    unknown(pg_outbox::dead_letters::list(&c, &f).await.expect_err("dead letters of an unknown subscription"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_and_rewind_only_while_paused() {
    let db = TestDb::new("sub_rewind").await;
    let c = db.client().await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 8).await;
    subscription::create(&c, "audit", From::Earliest).await.expect("create");
    // As a relay leaves it: the cursor at the 6th event, one settled above
    // it, a checkpoint; failures: a retry at the 2nd, a dead letter at the
    // 4th, a held event at the 5th, and a dead letter above the cursor
    // (the 8th: its failure written before the cursor passed it).
    c.execute(
        "UPDATE events.outbox_subscriptions SET cursor_id = $1, settled = ARRAY[$2::int8], \
           checkpoint_ids = ARRAY[$2::int8], checkpoint_xids = ARRAY[1::int8] WHERE name = 'audit'",
        &[&ids[5], &ids[6]],
    )
    .await
    .expect("move the cursor");
    failure(&c, "audit", ids[1], 2, "now() + interval '1 hour'").await;
    failure(&c, "audit", ids[3], 10, "'infinity'").await;
    failure(&c, "audit", ids[4], 0, "NULL").await;
    failure(&c, "audit", ids[7], 10, "'infinity'").await;
    let s = subscription::get(&c, "audit").await.expect("get");
    assert_eq!((s.failing, s.dead_letters, s.held, s.counts_exact), (1, 2, 1, true), "{s:?}");

    // Active: the rewind is refused, and changes nothing.
    let e = subscription::rewind(&c, "audit", From::Id(ids[2])).await.expect_err("active");
    let text = e.to_string();
    assert_eq!(sub_error(e), SubscriptionError::NotPaused("audit".into()));
    assert!(text.contains("pause it first"), "{text}");
    assert_eq!(row(&c, "audit").await.0, ids[5], "the cursor did not move");
    assert_eq!(failure_ids(&c, "audit").await, [ids[1], ids[3], ids[4], ids[7]]);

    assert!(subscription::pause(&c, "audit").await.expect("pause"), "it was active");
    assert!(!subscription::pause(&c, "audit").await.expect("pause again"), "paused already");
    assert_eq!(subscription::get(&c, "audit").await.expect("get").state, SubscriptionState::Paused);

    // Paused: the events from the 3rd on are delivered again; the failure
    // rows above the new cursor go (the dead letters among them counted),
    // the retry below stays.
    let r = subscription::rewind(&c, "audit", From::Id(ids[2])).await.expect("rewind");
    assert_eq!((r.previous_cursor_id, r.cursor_id), (ids[5], ids[2] - 1));
    assert_eq!((r.failures_dropped, r.dead_letters_dropped), (3, 2));
    let (cursor, start, state, settled, checkpoints) = row(&c, "audit").await;
    assert_eq!((cursor, start, state.as_str()), (ids[2] - 1, ids[0] - 1, "paused"), "start_id stays");
    assert!(settled.is_empty() && checkpoints.is_empty(), "settled {settled:?}, checkpoints {checkpoints:?}");
    assert_eq!(failure_ids(&c, "audit").await, [ids[1]], "the failure below the new cursor stays");

    // Forward too: the events between are skipped.
    let r = subscription::rewind(&c, "audit", From::Now).await.expect("rewind to now");
    assert_eq!((r.cursor_id, r.failures_dropped), (ids[7], 0));

    assert!(subscription::resume(&c, "audit").await.expect("resume"), "it was paused");
    assert!(!subscription::resume(&c, "audit").await.expect("resume again"), "active already");
    assert_eq!(row(&c, "audit").await.2, "active");
    let e = subscription::rewind(&c, "audit", From::Earliest).await.expect_err("active again");
    assert_eq!(sub_error(e), SubscriptionError::NotPaused("audit".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_removes_the_failures_of_that_subscription_only_and_keeps_its_term() {
    let db = TestDb::new("sub_drop").await;
    let c = db.client().await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 3).await;
    for name in ["audit", "search"] {
        subscription::create(&c, name, From::Earliest).await.expect("create");
        failure(&c, name, ids[0], 10, "'infinity'").await;
        failure(&c, name, ids[1], 1, "now() + interval '1 minute'").await;
        c.execute("INSERT INTO events.outbox_terms (scope, term) VALUES ('subscription:' || $1::text, 3)", &[&name])
            .await
            .expect("a term row");
    }
    let d = subscription::drop(&c, "audit").await.expect("drop");
    assert_eq!((d.failures, d.dead_letters), (2, 1));
    assert!(failure_ids(&c, "audit").await.is_empty(), "its failure rows went with it");
    let terms: Vec<String> = c
        .query("SELECT scope FROM events.outbox_terms WHERE scope LIKE 'subscription:%' ORDER BY scope", &[])
        .await
        .expect("terms")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(terms, ["subscription:audit", "subscription:search"], "terms only grow: the rows stay");
    assert_eq!(failure_ids(&c, "search").await, [ids[0], ids[1]], "and its failure rows");
    assert_eq!(outbox_ids(&c).await, ids, "the events stay");
    assert_eq!(
        sub_error(subscription::get(&c, "audit").await.expect_err("gone")),
        SubscriptionError::Unknown("audit".into())
    );
    // The name is free again.
    subscription::create(&c, "audit", From::Now).await.expect("create it again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriptions_dead_letters_are_its_failure_rows_retried_and_discarded_for_it_alone() {
    let db = TestDb::new("sub_dead").await;
    let c = db.client().await;
    let agg = Uuid::new_v4();
    let ids = insert_seed_events(&c, agg, 3).await;
    let other = insert_seed_events(&c, Uuid::new_v4(), 1).await;
    subscription::create(&c, "audit", From::Earliest).await.expect("create");
    c.execute("UPDATE events.outbox_subscriptions SET cursor_id = $1 WHERE name = 'audit'", &[&other[0]])
        .await
        .expect("the cursor past them all");
    // A dead letter at the first event of `agg`, the next two held behind
    // it; another aggregate's dead letter.
    failure(&c, "audit", ids[0], 10, "'infinity'").await;
    failure(&c, "audit", ids[1], 0, "NULL").await;
    failure(&c, "audit", ids[2], 0, "NULL").await;
    failure(&c, "audit", other[0], 10, "'infinity'").await;
    use pg_outbox::dead_letters::{self, Filter};
    let of_audit = || Filter::all().subscription("audit");
    let listed = dead_letters::list(&c, &of_audit()).await.expect("list");
    let listed: Vec<(i64, i32, Option<String>)> =
        listed.into_iter().map(|e| (e.id, e.retry_count, e.last_error)).collect();
    let err = Some("HTTP 500 for audit".to_string());
    assert_eq!(listed, [(ids[0], 10, err.clone()), (other[0], 10, err.clone())], "its own retry count and error");
    assert!(dead_letters::list(&c, &Filter::all()).await.expect("the default's").is_empty(), "the default has none");
    assert!(
        dead_letters::list(&c, &Filter::all().subscription("default")).await.expect("default by name").is_empty(),
        "`default` names the seeded flow"
    );
    assert_eq!(dead_letters::count(&c, &of_audit()).await.expect("count"), 2);
    assert_eq!(
        dead_letters::matching_ids(&c, &of_audit().aggregate_type("subscription").limit(1)).await.expect("ids"),
        [ids[0]]
    );

    // Retry: due now, the count kept.
    let retried = dead_letters::retry(&c, &Filter::ids(vec![other[0]]).subscription("audit")).await.expect("retry");
    assert_eq!(retried, other);
    let (count, due): (i32, bool) = c
        .query_one(
            "SELECT retry_count, next_retry_at <= now() FROM events.outbox_subscription_failures \
             WHERE subscription = 'audit' AND id = $1",
            &[&other[0]],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .expect("the retried row");
    assert_eq!((count, due), (10, true));

    // Discard: settled for the subscription; the held events of its
    // aggregate are due (the fetch hands them out one at a time, in id
    // order), the event stays.
    let discarded = dead_letters::discard(&c, &Filter::ids(vec![ids[0]]).subscription("audit")).await.expect("discard");
    assert_eq!(discarded, [ids[0]]);
    assert_eq!(failure_ids(&c, "audit").await, [ids[1], ids[2], other[0]]);
    let released: Vec<(i64, bool)> = c
        .query(
            "SELECT id, next_retry_at IS NOT NULL FROM events.outbox_subscription_failures \
             WHERE subscription = 'audit' AND id = ANY($1) ORDER BY id",
            &[&ids],
        )
        .await
        .expect("held rows")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(released, [(ids[1], true), (ids[2], true)], "the held events are due");
    assert_eq!(outbox_ids(&c).await, [ids.clone(), other.clone()].concat(), "no event deleted");
}

/// Dead letters of the default subscription in `ids` (the seeded flow's
/// columns: unpublished, `next_retry_at = 'infinity'`).
async fn default_dead(c: &Client, ids: &[i64]) {
    c.execute(
        "UPDATE events.outbox SET retry_count = 10, last_error = 'HTTP 500', next_retry_at = 'infinity' \
         WHERE id = ANY($1)",
        &[&ids],
    )
    .await
    .expect("dead letters of the default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discarding_a_default_dead_letter_a_subscription_still_needs_deletes_nothing_and_names_both() {
    let db = TestDb::new("sub_discard_default").await;
    let c = db.client().await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 4).await;
    subscription::create(&c, "audit", From::Earliest).await.expect("create audit");
    subscription::create(&c, "billing", From::Earliest).await.expect("create billing");
    default_dead(&c, &ids).await;
    // audit: past ids[0] and ids[1], a dead letter of its own at ids[1],
    // ids[3] settled above its cursor. billing: past all but ids[3].
    c.execute(
        "UPDATE events.outbox_subscriptions SET cursor_id = $1, settled = ARRAY[$2::int8] WHERE name = 'audit'",
        &[&ids[1], &ids[3]],
    )
    .await
    .expect("audit's cursor");
    failure(&c, "audit", ids[1], 10, "'infinity'").await;
    c.execute("UPDATE events.outbox_subscriptions SET cursor_id = $1 WHERE name = 'billing'", &[&ids[2]])
        .await
        .expect("billing's cursor");
    use pg_outbox::dead_letters::{self, Filter};

    let e = dead_letters::discard(&c, &Filter::all()).await.expect_err("audit and billing still need some");
    let text = e.to_string();
    assert_eq!(
        sub_error(e),
        SubscriptionError::StillNeeded {
            ids: vec![ids[1], ids[2], ids[3]],
            subscriptions: vec!["audit".into(), "billing".into()]
        }
    );
    assert!(
        text.starts_with("nothing discarded: 3 of the dead letters picked") && text.contains("audit, billing"),
        "{text}"
    );
    assert_eq!(outbox_ids(&c).await, ids, "nothing deleted");
    // Only what every subscription passed goes.
    assert_eq!(dead_letters::discard(&c, &Filter::ids(vec![ids[0]])).await.expect("passed by both"), [ids[0]]);
    let e = dead_letters::discard(&c, &Filter::ids(vec![ids[2]])).await.expect_err("audit needs it");
    assert_eq!(sub_error(e), SubscriptionError::StillNeeded { ids: vec![ids[2]], subscriptions: vec!["audit".into()] });
    // Once audit settles its own dead letter and passes ids[2], and billing
    // passes ids[3], the rest go.
    dead_letters::discard(&c, &Filter::ids(vec![ids[1]]).subscription("audit")).await.expect("audit's own discard");
    c.execute("UPDATE events.outbox_subscriptions SET cursor_id = $1 WHERE name IN ('audit', 'billing')", &[&ids[3]])
        .await
        .expect("both past them all");
    assert_eq!(dead_letters::discard(&c, &Filter::all()).await.expect("passed by all"), ids[1..].to_vec());
    assert!(outbox_ids(&c).await.is_empty());
    // The command line says it in one line and exits non-zero.
    let more = insert_seed_events(&c, Uuid::new_v4(), 1).await;
    default_dead(&c, &more).await;
    let out = db.cli(&["dead-letters", "discard", "--all", "--yes"]).run().await;
    assert!(matches!(out.code, Some(c) if c != 0), "a refused discard exits non-zero: {out:?}");
    let want = format!("nothing discarded: 1 of the dead letters picked ({})", more[0]);
    assert!(out.stderr.contains(&want) && out.stderr.lines().count() == 1, "{out:?}");
    assert_eq!(outbox_ids(&c).await, more, "nothing deleted");
    // An expired subscription (its operator opted in to expiry, and it fell
    // behind) is waited for no more: audit expired below the event, billing
    // passed it.
    c.execute("UPDATE events.outbox_subscriptions SET cursor_id = $1 WHERE name = 'billing'", &[&more[0]])
        .await
        .expect("billing past it");
    c.execute("UPDATE events.outbox_subscriptions SET state = 'expired' WHERE name = 'audit'", &[])
        .await
        .expect("audit expired");
    assert_eq!(dead_letters::discard(&c, &Filter::all()).await.expect("audit expired"), more);
    assert!(outbox_ids(&c).await.is_empty());
}

/// Published events, old enough for retention.
async fn publish_old(c: &Client, ids: &[i64]) {
    c.execute("UPDATE events.outbox SET published_at = now() - interval '40 days' WHERE id = ANY($1)", &[&ids])
        .await
        .expect("published 40 days ago");
}

fn retention() -> pg_outbox::retention::Retention {
    pg_outbox::retention::Retention {
        batch_size: 3,
        batch_time: Duration::ZERO,
        pause: Duration::from_millis(1),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_waits_for_every_subscription_active_or_paused() {
    let db = TestDb::new("sub_retention").await;
    let c = db.client().await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 10).await;
    publish_old(&c, &ids).await;
    let r = retention();
    // One subscription at the start, paused: nothing can go.
    subscription::create(&c, "slow", From::Earliest).await.expect("create slow");
    subscription::pause(&c, "slow").await.expect("pause");
    subscription::create(&c, "fast", From::Now).await.expect("create fast");
    assert_eq!(pg_outbox::retention::dry_run(&c, &r).await.expect("dry run").deleted, 0);
    let rep = pg_outbox::retention::run(&db.options(), &r).await.expect("run");
    assert_eq!((rep.deleted, rep.walk_end_id, rep.walk_end_subscription), (0, ids[0] - 1, true), "{rep:?}");
    assert_eq!(outbox_ids(&c).await, ids, "a paused subscription keeps every event it has not passed");

    // The paused one passed the 6th; it failed on the 3rd (a dead letter),
    // and the other one holds the 5th back: those stay, the rest up to the
    // 6th goes.
    c.execute("UPDATE events.outbox_subscriptions SET cursor_id = $1 WHERE name = 'slow'", &[&ids[5]])
        .await
        .expect("move slow");
    failure(&c, "slow", ids[2], 10, "'infinity'").await;
    failure(&c, "fast", ids[4], 0, "NULL").await;
    assert_eq!(pg_outbox::retention::dry_run(&c, &r).await.expect("dry run").deleted, 4);
    let rep = pg_outbox::retention::run(&db.options(), &r).await.expect("run");
    assert_eq!((rep.deleted, rep.walk_end_id, rep.walk_end_subscription), (4, ids[5], true), "{rep:?}");
    assert_eq!(outbox_ids(&c).await, [ids[2], ids[4], ids[6], ids[7], ids[8], ids[9]]);

    // Rewound to the start: its dead letter above the new cursor is gone,
    // but the cursor is below every event left, so none goes.
    let rewound = subscription::rewind(&c, "slow", From::Earliest).await.expect("rewind to the start");
    assert_eq!((rewound.cursor_id, rewound.dead_letters_dropped), (ids[2] - 1, 1));
    let rep = pg_outbox::retention::run(&db.options(), &r).await.expect("run");
    assert_eq!((rep.deleted, rep.walk_end_id), (0, ids[2] - 1), "{rep:?}");
    assert_eq!(outbox_ids(&c).await, [ids[2], ids[4], ids[6], ids[7], ids[8], ids[9]]);

    // Once both are dropped, the default alone decides: every published
    // event goes, an unpublished one stays.
    let unpublished = insert_seed_events(&c, Uuid::new_v4(), 1).await;
    subscription::drop(&c, "slow").await.expect("drop slow");
    subscription::drop(&c, "fast").await.expect("drop fast");
    let rep = pg_outbox::retention::run(&db.options(), &r).await.expect("run");
    assert!(!rep.walk_end_subscription, "{rep:?}");
    let left = outbox_ids(&c).await;
    assert_eq!(left, unpublished, "every published event went; the unpublished one stays: {rep:?}");
}

/// `(node type, relation)` of every node of a plan.
fn plan_nodes(node: &Value, out: &mut Vec<(String, String)>) {
    let kind = node["Node Type"].as_str().unwrap_or("").to_string();
    out.push((kind, node["Relation Name"].as_str().unwrap_or("").to_string()));
    for child in node["Plans"].as_array().into_iter().flatten() {
        plan_nodes(child, out);
    }
}

/// A retention batch with subscriptions stays bounded by its batch: the
/// lowest cursor and the names are read once, and a failure row costs one
/// primary-key lookup per subscription for a row otherwise due, whatever
/// the number of failure rows (20 000 here, dead letters of one
/// subscription at the ids the batch walks), before and after ANALYZE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_batch_probes_the_failures_by_primary_key() {
    const ROWS: i64 = 20_000;
    const BATCH: i64 = 500;
    let db = TestDb::new("sub_retention_plan").await;
    let setup = db.client().await;
    setup
        .batch_execute(&format!(
            "ALTER TABLE events.outbox SET (autovacuum_enabled = false); \
             ALTER TABLE events.outbox_subscription_failures SET (autovacuum_enabled = false); \
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, published_at) \
               SELECT 'plan', md5('p' || g)::uuid, 'E', jsonb_build_object('n', g), now() - interval '40 days' \
               FROM generate_series(1, {ROWS}) g; \
             INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) \
               SELECT 'audit', 0, max(id) FROM events.outbox; \
             INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) \
               SELECT 'search', 0, max(id) FROM events.outbox; \
             INSERT INTO events.outbox_subscription_failures \
               (subscription, id, aggregate_type, aggregate_id, retry_count, next_retry_at) \
               SELECT 'audit', id, aggregate_type, aggregate_id, 10, 'infinity' \
               FROM (SELECT o.*, row_number() OVER (ORDER BY o.id) AS n FROM events.outbox o) x WHERE n % 2 = 0;"
        ))
        .await
        .expect("load");
    let version = server_version_num(&setup).await;
    let sql = pg_outbox::run_time_statements(version)
        .into_iter()
        .find_map(|(name, sql)| (name == "retention_delete").then_some(sql))
        .expect("the retention batch");
    let lowest: i64 = setup.query_one("SELECT min(id) FROM events.outbox", &[]).await.expect("min").get(0);
    let after = lowest - 1;
    let ten_days = 10.0 * 86_400.0f64;
    for analyzed in [false, true] {
        if analyzed {
            setup
                .batch_execute("ANALYZE events.outbox; ANALYZE events.outbox_subscription_failures")
                .await
                .expect("analyze");
        }
        let mut c = plan_check_session(&db).await;
        let tx = c.transaction().await.expect("begin");
        let row = tx
            .query_one(
                &format!("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {sql}"),
                &[&ten_days, &BATCH, &after, &i64::MAX],
            )
            .await
            .expect("explain the batch");
        tx.rollback().await.expect("rollback");
        let plan: Value = row.get(0);
        let top = &plan[0]["Plan"];
        let buffers = plan_count(top, "Shared Hit Blocks") + plan_count(top, "Shared Read Blocks");
        let text = plan.to_string();
        // The subscriptions' own table is read once (a few rows); neither
        // the outbox nor the failures is scanned.
        let mut nodes = Vec::new();
        plan_nodes(top, &mut nodes);
        for (kind, relation) in &nodes {
            assert!(
                !(kind == "Seq Scan" && relation != "outbox_subscriptions"),
                "analyzed {analyzed}: a sequential scan of {relation}: {nodes:?}"
            );
        }
        assert!(text.contains("outbox_subscription_failures_pkey"), "analyzed {analyzed}: {plan}");
        // A walk of the batch and a delete (8 a row, as plan_states allows),
        // and per row due, two lookups of a few buffers each.
        let bound = 8 * BATCH + 2 * 4 * BATCH + 100;
        assert!(buffers <= bound, "analyzed {analyzed}: {buffers} buffers, bound {bound}: {plan}");
    }
    // And it deletes what it should: the odd ids of the first batch.
    let deleted: i64 = setup
        .query_one(&sql, &[&ten_days, &BATCH, &after, &i64::MAX])
        .await
        .map(|r| r.get("deleted"))
        .expect("one batch");
    assert_eq!(deleted, BATCH / 2);
    let kept: i64 = setup
        .query_one(
            "SELECT count(*) FROM events.outbox o \
             WHERE EXISTS (SELECT 1 FROM events.outbox_subscription_failures f WHERE f.id = o.id)",
            &[],
        )
        .await
        .expect("kept")
        .get(0);
    assert_eq!(kept, ROWS / 2, "every event with a failure row stays");
}

// ------------------------------------------------------------ command line

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_creates_lists_pauses_rewinds_and_drops() {
    let db = TestDb::new("sub_cli").await;
    let c = db.client().await;
    let ids = insert_seed_events(&c, Uuid::new_v4(), 4).await;

    // A --from that is none of the forms: a usage error naming the value.
    for bad in ["latest", "id:abc", "time:yesterday"] {
        let out = db.cli(&["subscription", "create", "audit", "--from", bad]).run().await;
        assert!(matches!(out.code, Some(c) if c != 0), "{bad}: {out:?}");
        assert!(
            out.stderr.contains(&format!("'{bad}'")) || out.stderr.contains(&format!("\"{bad}\"")),
            "{bad}: {out:?}"
        );
        assert!(out.stderr.contains("earliest") && out.stderr.contains("id:N"), "the forms are named: {out:?}");
        assert!(out.stdout.is_empty(), "{out:?}");
    }
    let out = db.cli(&["subscription", "create", "Bad", "--from", "now"]).run().await;
    assert!(
        matches!(out.code, Some(c) if c != 0) && out.stderr.contains("invalid subscription name \"Bad\""),
        "{out:?}"
    );
    let rows: i64 = c.query_one("SELECT count(*) FROM events.outbox_subscriptions", &[]).await.expect("n").get(0);
    assert_eq!(rows, 0, "nothing created");

    let (code, out, err) =
        db.cli(&["subscription", "create", "audit", "--from", &format!("id:{}", ids[1])]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&format!("cursor {}", ids[1] - 1)), "{out}");
    let (code, _, err) = db.cli(&["subscription", "create", "audit"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("\"audit\" exists already"), "{err}");
    let (code, _, err) = db.cli(&["subscription", "create", "later"]).run().await.parts();
    assert_eq!(code, Some(0), "--from defaults to now: {err}");
    assert_eq!(row(&c, "later").await.0, ids[3]);

    failure(&c, "audit", ids[1], 10, "'infinity'").await;
    let (code, out, err) = db.cli(&["subscription", "list", "--json"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    let listed: Vec<Value> = serde_json::from_str(&out).unwrap_or_else(|e| panic!("list --json: {e}: {out}"));
    let names: Vec<&str> = listed.iter().map(|s| s["name"].as_str().expect("a name")).collect();
    assert_eq!(names, ["default", "audit", "later"]);
    assert_eq!(listed[1]["cursor_id"], ids[1] - 1);
    assert_eq!(listed[1]["state"], "active");
    assert_eq!(listed[1]["dead_letters"], 1);
    assert_eq!(listed[1]["backlog_upper_bound"], ids[3] - (ids[1] - 1), "the span of ids above the cursor");
    assert!(listed[1]["lag_seconds"].as_f64().is_some(), "{}", listed[1]);
    assert!(listed[0]["cursor_id"].is_null(), "{}", listed[0]);
    let (code, table, _) = db.cli(&["subscription", "list"]).run().await.parts();
    assert_eq!(code, Some(0));
    assert!(table.lines().any(|l| l.starts_with("audit") && l.contains("active")), "{table}");

    // status shows it too, and in JSON an array `subscriptions`.
    let (code, out, err) = db.cli(&["status", "--json"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    let status: Value = serde_json::from_str(&out).expect("status json");
    let subs = status["subscriptions"].as_array().unwrap_or_else(|| panic!("no subscriptions array: {status}"));
    assert_eq!(subs.iter().map(|s| s["name"].as_str().unwrap_or("")).collect::<Vec<_>>(), ["audit", "later"]);
    assert_eq!(subs[0]["dead_letters"], 1);
    let (code, out, _) = db.cli(&["status"]).run().await.parts();
    assert_eq!(code, Some(0));
    assert!(out.contains("subscriptions") && out.lines().any(|l| l.starts_with("audit")), "{out}");

    // Its dead letters, by name.
    let (code, out, err) = db.cli(&["dead-letters", "list", "--subscription", "audit", "--json"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    let dead: Vec<Value> = serde_json::from_str(&out).expect("json");
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0]["id"].as_i64(), dead[0]["last_error"].as_str()), (Some(ids[1]), Some("HTTP 500 for audit")));
    let (code, out, _) = db.cli(&["dead-letters", "list", "--json"]).run().await.parts();
    assert_eq!((code, out.trim()), (Some(0), "[]"), "the default has none");
    let (code, _, err) = db.cli(&["dead-letters", "list", "--subscription", "nope"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("no subscription \"nope\""), "{err}");
    let (code, out, err) =
        db.cli(&["dead-letters", "retry", "--subscription", "audit", &ids[1].to_string()]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("retried 1 dead letter"), "{out}");

    // Rewind: refused while active, saying to pause; applied once paused.
    let (code, _, err) = db.cli(&["subscription", "rewind", "audit", "--to", "earliest"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("pause it first"), "{err}");
    let (code, out, _) = db.cli(&["subscription", "pause", "audit"]).run().await.parts();
    assert_eq!((code, out.trim()), (Some(0), "paused subscription audit"));
    let (code, out, err) = db.cli(&["subscription", "rewind", "audit", "--to", "earliest"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&format!("cursor {}", ids[0] - 1)) && out.contains("1 failure rows"), "{out}");
    assert!(failure_ids(&c, "audit").await.is_empty());
    let (code, _, err) = db.cli(&["subscription", "rewind", "audit", "--to", "soon"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("soon"), "{err}");
    let (code, out, _) = db.cli(&["subscription", "resume", "audit"]).run().await.parts();
    assert_eq!((code, out.trim()), (Some(0), "resumed subscription audit"));

    // Drop: only with --yes.
    let (code, _, err) = db.cli(&["subscription", "drop", "audit"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("--yes"), "{err}");
    assert!(subscription::get(&c, "audit").await.is_ok(), "still there");
    let (code, out, err) = db.cli(&["subscription", "drop", "audit", "--yes"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("dropped subscription audit"), "{out}");
    let (code, _, err) = db.cli(&["subscription", "pause", "audit"]).run().await.parts();
    assert_ne!(code, Some(0));
    assert!(err.contains("no subscription \"audit\""), "{err}");

    // archive names the subscription that bounds its walk: `later`, at the
    // 4th event, with a 5th above it.
    publish_old(&c, &ids).await;
    insert_seed_events(&c, Uuid::new_v4(), 1).await;
    let (code, out, err) = db.cli(&["archive", "--batch-size", "2", "--batch-time", "0"]).run().await.parts();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("the lowest subscription cursor") && out.contains(&format!("id {}", ids[3])), "{out}");
}

//! Leadership terms (fencing tokens, docs/architecture.md "Leadership
//! terms"): every leader of the outbox takes a term that only grows, every
//! delivery carries it, a write under a superseded term changes nothing,
//! and a deposed leader hands nothing out.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use pg_outbox::health::Role;
use pg_outbox::{Consumer, EventStream};
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::support::{self, Proxy, Target, TestDb, eventually};

async fn current_term(c: &Client) -> Option<i64> {
    c.query_opt("SELECT term FROM events.outbox_terms WHERE scope = 'outbox'", &[])
        .await
        .expect("read the term")
        .map(|r| r.get(0))
}

async fn next(stream: &mut EventStream) -> pg_outbox::Delivery {
    tokio::time::timeout(Duration::from_secs(20), stream.next()).await.expect("a delivery in time").expect("open")
}

#[tokio::test]
async fn each_leader_takes_a_greater_term_and_its_deliveries_carry_it() {
    let db = TestDb::new("terms_grow").await;
    let c = db.client().await;
    let agg = uuid::Uuid::new_v4();

    let mut a = Consumer::builder(db.options()).start().await.expect("start a");
    support::insert_seed_events(&c, agg, 1).await;
    let d = next(&mut a).await;
    let first = current_term(&c).await.expect("a term taken");
    assert_eq!(
        d.term(),
        u64::try_from(first).ok().and_then(pg_outbox::Term::new),
        "the delivery carries the leader's term"
    );
    d.ack();
    a.finish().await.expect("finish a");
    let released: bool = c
        .query_one("SELECT released FROM events.outbox_terms WHERE scope = 'outbox'", &[])
        .await
        .expect("released")
        .get(0);
    assert!(released, "a graceful stop releases the term");

    let mut b = Consumer::builder(db.options()).start().await.expect("start b");
    support::insert_seed_events(&c, agg, 1).await;
    let d = next(&mut b).await;
    let second = current_term(&c).await.expect("a term");
    assert!(second > first, "terms grow: {first} then {second}");
    assert_eq!(d.term(), u64::try_from(second).ok().and_then(pg_outbox::Term::new));
    let leader = pg_outbox::status::read(&c).await.expect("status").leader.expect("a leader");
    assert_eq!(
        (leader.live, leader.term),
        (true, u64::try_from(second).ok().and_then(pg_outbox::Term::new)),
        "status shows the live leader's term"
    );
    d.ack();
    b.finish().await.expect("finish b");
    assert_eq!(support::published_count(&c).await, 2);
}

#[tokio::test]
async fn writes_under_a_superseded_term_change_nothing_and_the_events_come_again() {
    let db = TestDb::new("terms_fenced").await;
    let c = db.client().await;
    let mut events = Consumer::builder(db.options()).start().await.expect("start");
    let ids = support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let other = support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let (a, b) = (next(&mut events).await, next(&mut events).await);
    let held = a.term().expect("a term");
    // Another leader takes the outbox over, as its takeover would.
    c.execute("UPDATE events.outbox_terms SET term = term + 1, released = false WHERE scope = 'outbox'", &[])
        .await
        .expect("bump the term");
    a.ack();
    b.fail("sink refused");

    // Both come again, under a greater term, and nothing was written in
    // between: not published, no failure counted.
    let mut again = Vec::new();
    while again.len() < 2 {
        let d = next(&mut events).await;
        assert!(d.term().is_some_and(|t| t > held), "delivered again under a greater term: {:?}", d.term());
        again.push(d);
    }
    let mut got: Vec<i64> = again.iter().map(|d| d.id).collect();
    got.sort_unstable();
    assert_eq!(got, [ids[0], other[0]]);
    let row = c
        .query_one("SELECT count(*) FILTER (WHERE published_at IS NOT NULL), max(retry_count) FROM events.outbox", &[])
        .await
        .expect("rows");
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i32>(1)), (0, 0), "a fenced write changed nothing");
    for d in again {
        d.ack();
    }
    events.finish().await.expect("finish");
    assert_eq!(support::published_count(&c).await, 2);
}

/// The database's terms going back below one a relay already took (an
/// asynchronous failover that lost the last bump, simulated by lowering
/// the stored term as the relay's work session ends) never make it take a
/// term twice: it raises the one it takes above the highest it took.
#[tokio::test]
async fn a_term_the_database_lost_is_never_taken_again() {
    use tokio::io::AsyncBufReadExt;
    let db = TestDb::new("terms_went_back").await;
    let c = db.client().await;
    // Another scope at 5: the outbox's first term is 6.
    c.execute("INSERT INTO events.outbox_terms (scope, term, released) VALUES ('partition:0/2', 5, true)", &[])
        .await
        .expect("another scope's term");
    let (relay, stdout) = crate::relay_proc::start_with_stdout(&db, &["--sink", "stdout"]).await;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut term_of_next = async || -> u64 {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("a delivery in time")
            .expect("stdout")
            .expect("a line");
        let v: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        v["term"].as_u64().unwrap_or_else(|| panic!("a term: {line}"))
    };
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let first = term_of_next().await;
    assert_eq!(first, 6);
    // The failover: the relay's work session ends and the bump to 6 is
    // lost (the database would hand out 6 again), in one statement.
    let ended: i64 = c
        .query_one(
            "WITH lost AS (UPDATE events.outbox_terms SET term = 5 WHERE scope = 'outbox' RETURNING 1) \
             SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'pg-outbox drain' AND (SELECT count(*) FROM lost) = 1",
            &[],
        )
        .await
        .expect("end the work session, lose the bump")
        .get(0);
    assert_eq!(ended, 1);
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let again = term_of_next().await;
    assert!(again > first, "took {again} after {first}: a term never repeats\n{}", relay.log());
    assert!(relay.signalled("term_raised"), "{}", relay.log());
    assert_eq!(current_term(&c).await, i64::try_from(again).ok(), "the stored term is the one delivered");
    relay.stop().await;
}

/// A leader still waiting out a deposed predecessor's lease must not mark
/// its term released when it stops: the next leader must wait in its place
/// (else the deposed one and the next could hand out at once).
#[tokio::test]
async fn a_leader_that_stops_during_its_takeover_wait_does_not_release_its_term() {
    let db = TestDb::new("terms_chained").await;
    let c = db.client().await;
    let a = Consumer::builder(db.options()).start().await.expect("start a");
    eventually(20, "a leads", || async { a.health().get().role == Role::Leader }).await;
    a.finish().await.expect("finish a");
    // As if it had crashed instead: its term not released.
    c.execute("UPDATE events.outbox_terms SET released = false WHERE scope = 'outbox'", &[]).await.expect("unrelease");
    let b = Consumer::builder(db.options()).start().await.expect("start b");
    eventually(20, "b leads", || async { b.health().get().role == Role::Leader }).await;
    b.finish().await.expect("finish b within its wait");
    let (term, released): (i64, bool) = c
        .query_one("SELECT term, released FROM events.outbox_terms WHERE scope = 'outbox'", &[])
        .await
        .map(|r| (r.get(0), r.get(1)))
        .expect("term row");
    assert_eq!((term, released), (2, false), "b's term stays unreleased");

    // Once the wait is over, a graceful stop releases the term.
    let mut d = Consumer::builder(db.options()).start().await.expect("start d");
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    next(&mut d).await.ack();
    d.finish().await.expect("finish d");
    let released: bool =
        c.query_one("SELECT released FROM events.outbox_terms WHERE scope = 'outbox'", &[]).await.expect("row").get(0);
    assert!(released, "a leader that delivered releases its term");
}

/// A leader whose shutdown grace runs out with a delivery still open
/// leaves its term unreleased: that delivery may yet reach its destination,
/// so the next leader must wait out the lease.
#[tokio::test]
async fn a_leader_stopping_with_a_delivery_still_open_does_not_release_its_term() {
    let db = TestDb::new("terms_open_at_stop").await;
    let c = db.client().await;
    let mut a =
        Consumer::builder(db.options()).shutdown_grace(Duration::from_millis(500)).start().await.expect("start a");
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let open = next(&mut a).await;
    a.finish().await.expect("finish a");
    let released: bool =
        c.query_one("SELECT released FROM events.outbox_terms WHERE scope = 'outbox'", &[]).await.expect("row").get(0);
    assert!(!released, "a term with a delivery still open at the stop stays unreleased");
    drop(open);

    // Settled before the stop: released.
    let mut b = Consumer::builder(db.options()).start().await.expect("start b");
    next(&mut b).await.ack();
    b.finish().await.expect("finish b");
    let released: bool =
        c.query_one("SELECT released FROM events.outbox_terms WHERE scope = 'outbox'", &[]).await.expect("row").get(0);
    assert!(released, "a leader with nothing open releases its term");
}

/// A role without the privileges on `events.outbox_terms` is refused at
/// start, in one line naming the GRANT, instead of failing each time it
/// takes the lock.
#[tokio::test]
async fn a_role_that_cannot_take_a_term_is_refused_at_start_with_the_grant_it_needs() {
    let db = TestDb::new("terms_grant").await;
    let admin = db.client().await;
    let role = format!("pgo_terms_{}", std::process::id());
    admin
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA events TO {role}; \
             GRANT ALL ON ALL TABLES IN SCHEMA events TO {role}; GRANT ALL ON ALL SEQUENCES IN SCHEMA events TO {role}; \
             REVOKE INSERT, UPDATE ON events.outbox_terms FROM {role}"
        ))
        .await
        .expect("role");
    let mut cfg = db.pg.clone();
    cfg.user(&role);
    let refused = Consumer::builder(support::options_of(&cfg)).start().await;
    let err = refused.map(drop).expect_err("refused");
    let text = err.to_string();
    assert!(text.contains("events.outbox_terms") && text.contains("GRANT SELECT, INSERT, UPDATE"), "{text}");
    // Partitioned mode takes a term per partition: refused the same way.
    let refused = Consumer::builder(support::options_of(&cfg))
        .mode(pg_outbox::Mode::Partitioned { partitions: 4 })
        .start()
        .await
        .map(drop)
        .expect_err("partitioned mode refused");
    assert!(refused.to_string().contains("GRANT SELECT, INSERT, UPDATE"), "{refused}");
    // Competing mode takes no term: the same role starts.
    let competing = Consumer::builder(support::options_of(&cfg))
        .mode(pg_outbox::Mode::Competing)
        .start()
        .await
        .expect("competing mode starts");
    competing.finish().await.expect("finish");
    admin.batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}")).await.expect("drop role");
}

/// One consumer, its reader, and what its reader was handed.
struct Member {
    stream_task: tokio::task::JoinHandle<()>,
    paused: watch::Sender<bool>,
    /// Ids handed out, in order.
    handed: Arc<Mutex<Vec<i64>>>,
    health: pg_outbox::health::HealthMonitor,
    shutdown: pg_outbox::ShutdownHandle,
    proxy: Proxy,
}

impl Member {
    async fn start(db: &TestDb) -> Member {
        Member::start_as(db, pg_outbox::Mode::Single, None).await
    }

    /// A member in `mode` whose sessions are all named `app`
    /// (`application_name`; by default each its own, `pg-outbox drain`...).
    async fn start_as(db: &TestDb, mode: pg_outbox::Mode, app: Option<&str>) -> Member {
        let proxy = Proxy::start(Target::of(db)).await;
        let mut pg = pg_outbox::ConnectOptions::parse(&proxy.url(db)).expect("proxy url");
        if let Some(app) = app {
            pg = pg.with_application_name(app);
        }
        let mut events = Consumer::builder(pg)
            .mode(mode)
            .batch_size(20)
            .sweep_interval(Duration::from_millis(200))
            .reconnect_max_delay(Duration::from_millis(500))
            .start()
            .await
            .expect("start");
        let (paused, mut paused_rx) = watch::channel(false);
        let handed = Arc::new(Mutex::new(Vec::new()));
        let (health, shutdown) = (events.health(), events.shutdown_handle());
        let log = handed.clone();
        let stream_task = tokio::spawn(async move {
            loop {
                if paused_rx.wait_for(|p| !*p).await.is_err() {
                    return;
                }
                tokio::select! {
                    d = events.next() => match d {
                        Some(d) => {
                            log.lock().expect("log").push(d.id);
                            d.ack();
                        }
                        None => return,
                    },
                    _ = paused_rx.changed() => {}
                }
            }
        });
        Member { stream_task, paused, handed, health, shutdown, proxy }
    }

    fn handed(&self) -> usize {
        self.handed.lock().expect("log").len()
    }

    fn leads(&self) -> bool {
        self.health.get().role == Role::Leader
    }
}

/// The fault the lease exists for: a leader whose buffer holds fetched
/// events stops handing out (its reader paused), its network goes silent,
/// and the server ends its work session (as it does once it notices a dead
/// peer); the standby takes over and delivers later events; then the old
/// leader's reader resumes while its sessions still look alive to it. It
/// must hand out nothing: its lease ran out while it was cut off, and the
/// term cannot be confirmed again. Twenty times under a steady load,
/// alternating leaders; then every event was delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leader_hands_nothing_out_after_the_standby_took_over() {
    let db = TestDb::new("terms_deposed").await;
    let c = db.client().await;
    let members = [Member::start(&db).await, Member::start(&db).await];
    eventually(20, "a leader", || async { members.iter().any(Member::leads) }).await;

    // A steady load over a few aggregates.
    let (stop_load, mut stopped) = watch::channel(false);
    let producer = {
        let c = db.client().await;
        let aggregates: Vec<uuid::Uuid> = (0..8).map(|_| uuid::Uuid::new_v4()).collect();
        tokio::spawn(async move {
            let mut n = 0usize;
            while !*stopped.borrow_and_update() {
                support::insert_seed_events(&c, aggregates[n % aggregates.len()], 1).await;
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };

    for rep in 0..20 {
        let Some(l) = members.iter().position(Member::leads) else {
            eventually(20, "a leader", || async { members.iter().any(Member::leads) }).await;
            continue;
        };
        let (leader, standby) = (&members[l], &members[1 - l]);
        leader.paused.send_replace(true);
        // Let its buffer fill with fetched, unhanded events.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let before = leader.handed();
        leader.proxy.freeze(true);
        assert!(db.terminate_pid_of_lock_holder().await > 0, "rep {rep}: the leader's work session ended");
        let mark: i64 = c.query_one("SELECT max(id) FROM events.outbox", &[]).await.expect("max").get(0);
        eventually(30, "the standby to deliver a later event", || async {
            standby.handed.lock().expect("log").iter().any(|id| *id > mark)
        })
        .await;
        leader.paused.send_replace(false);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(leader.handed(), before, "rep {rep}: the deposed leader handed out after the takeover");
        // Its network comes back as the server left it: connections gone.
        leader.proxy.freeze(false);
        leader.proxy.cut();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(leader.handed(), before, "rep {rep}: the deposed leader handed out after it reconnected");
        assert!(standby.leads(), "rep {rep}: the standby leads");
    }

    stop_load.send_replace(true);
    producer.await.expect("producer");
    let total: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    eventually(60, "every event published", || async { support::published_count(&c).await == total }).await;
    let mut delivered: Vec<i64> = members.iter().flat_map(|m| m.handed.lock().expect("log").clone()).collect();
    delivered.sort_unstable();
    delivered.dedup();
    assert_eq!(delivered.len() as i64, total, "every event was handed out");
    for m in &members {
        m.shutdown.shutdown();
    }
    for m in members {
        let _ = tokio::time::timeout(Duration::from_secs(10), m.stream_task).await;
    }
}

/// The current term of partition `p` of `n` (scope `partition:P/N`).
async fn partition_term(c: &Client, p: i32, n: u32) -> Option<i64> {
    c.query_opt("SELECT term FROM events.outbox_terms WHERE scope = $1", &[&format!("partition:{p}/{n}")])
        .await
        .expect("read a partition's term")
        .map(|r| r.get(0))
}

/// The partition of event `id`'s aggregate, as partitioned mode hashes it.
async fn partition_of(c: &Client, id: i64, n: u32) -> i32 {
    c.query_one(
        "SELECT ((hashtextextended(aggregate_type || '/' || aggregate_id::text, 0) & 2147483647) % $2)::int4 \
         FROM events.outbox WHERE id = $1",
        &[&id, &i64::from(n)],
    )
    .await
    .expect("partition of an event")
    .get(0)
}

#[tokio::test]
async fn each_partition_holder_takes_a_term_its_deliveries_carry_and_a_graceful_stop_releases() {
    const N: u32 = 4;
    let db = TestDb::new("terms_partitions").await;
    let c = db.client().await;
    let mode = pg_outbox::Mode::Partitioned { partitions: N };
    let mut a = Consumer::builder(db.options()).mode(mode).start().await.expect("start a");
    for _ in 0..16 {
        support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    }
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let d = next(&mut a).await;
        let p = partition_of(&c, d.id, N).await;
        let term = partition_term(&c, p, N).await.expect("the partition's term was taken");
        assert_eq!(
            d.term(),
            u64::try_from(term).ok().and_then(pg_outbox::Term::new),
            "event {} carries partition {p}'s term",
            d.id
        );
        seen.insert(p);
        d.ack();
    }
    assert!(seen.len() > 1, "events of several partitions: {seen:?}");
    a.finish().await.expect("finish a");
    let unreleased: i64 = c
        .query_one("SELECT count(*) FROM events.outbox_terms WHERE scope LIKE 'partition:%/4' AND NOT released", &[])
        .await
        .expect("released")
        .get(0);
    assert_eq!(unreleased, 0, "a graceful stop releases every partition's term");
    let before = partition_term(&c, 0, N).await.expect("partition 0's term");

    let mut b = Consumer::builder(db.options()).mode(mode).start().await.expect("start b");
    support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await;
    let d = next(&mut b).await;
    let p = partition_of(&c, d.id, N).await;
    let after = partition_term(&c, p, N).await.expect("a term");
    assert_eq!(
        d.term(),
        u64::try_from(after).ok().and_then(pg_outbox::Term::new),
        "the next holder's delivery carries its new term"
    );
    assert!(partition_term(&c, 0, N).await.expect("partition 0") > before, "taking a partition again bumps its term");
    d.ack();
    b.finish().await.expect("finish b");
    assert_eq!(support::published_count(&c).await, 17, "every event published under a current term");
}

/// Partitioned mode's case of the deposed leader: a member whose buffer
/// holds fetched events stops handing out, its network goes silent, and the
/// server ends its sessions; the other member takes its partitions over
/// (after the takeover wait) and delivers later events; then the old
/// member's reader resumes. It hands out nothing: its lease ran out, and
/// its partitions' terms cannot be confirmed again. Five times under a
/// steady load; then every event was delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_partition_holder_hands_nothing_out_after_another_took_its_partitions() {
    let db = TestDb::new("terms_deposed_partitions").await;
    let c = db.client().await;
    let mode = pg_outbox::Mode::Partitioned { partitions: 4 };
    let names = ["terms-member-a", "terms-member-b"];
    let members =
        [Member::start_as(&db, mode, Some(names[0])).await, Member::start_as(&db, mode, Some(names[1])).await];
    let holds = |m: &Member| match m.health.get().role {
        Role::Partitioned { held, .. } => held.len(),
        _ => 0,
    };
    eventually(30, "both members hold partitions", || async { members.iter().all(|m| holds(m) > 0) }).await;

    let (stop_load, mut stopped) = watch::channel(false);
    let producer = {
        let c = db.client().await;
        let aggregates: Vec<uuid::Uuid> = (0..16).map(|_| uuid::Uuid::new_v4()).collect();
        tokio::spawn(async move {
            let mut n = 0usize;
            while !*stopped.borrow_and_update() {
                support::insert_seed_events(&c, aggregates[n % aggregates.len()], 1).await;
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };

    for rep in 0..5 {
        let (old, other) = (&members[rep % 2], &members[1 - rep % 2]);
        eventually(30, "the member to hold partitions", || async { holds(old) > 0 }).await;
        old.paused.send_replace(true);
        tokio::time::sleep(Duration::from_millis(150)).await;
        let before = old.handed();
        old.proxy.freeze(true);
        // The partitions it holds, as the database says once its network is
        // silent (it can neither take nor release one any more).
        let old_parts: Vec<i32> = c
            .query(
                "SELECT split_part(split_part(scope, ':', 2), '/', 1)::int4 FROM events.outbox_terms \
                 WHERE scope LIKE 'partition:%/4' AND NOT released \
                   AND holder_pid IN (SELECT pid FROM pg_stat_activity WHERE application_name = $1)",
                &[&names[rep % 2]],
            )
            .await
            .expect("the partitions it holds")
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(!old_parts.is_empty(), "rep {rep}: the member holds partitions");
        let ended: i64 = c
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name LIKE $1",
                &[&format!("{}%", names[rep % 2])],
            )
            .await
            .expect("terminate the member's sessions")
            .get(0);
        assert!(ended > 0, "rep {rep}: the member's sessions ended");
        eventually(30, "the other member to hold every partition", || async { holds(other) == 4 }).await;
        let mark: i64 = c.query_one("SELECT max(id) FROM events.outbox", &[]).await.expect("max").get(0);
        // A later event of one of the partitions taken over (the other's
        // own partitions go on delivering throughout).
        eventually(30, "the other member to deliver a later event of a partition it took over", || async {
            let later: Vec<i64> = other.handed.lock().expect("log").iter().copied().filter(|id| *id > mark).collect();
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM events.outbox WHERE id = ANY($1) AND \
                     ((hashtextextended(aggregate_type || '/' || aggregate_id::text, 0) & 2147483647) % 4)::int4 \
                       = ANY($2)",
                    &[&later, &old_parts],
                )
                .await
                .expect("partitions of the later events")
                .get(0);
            n > 0
        })
        .await;
        old.paused.send_replace(false);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(old.handed(), before, "rep {rep}: the deposed member handed out after the takeover");
        old.proxy.freeze(false);
        old.proxy.cut();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(old.handed(), before, "rep {rep}: the deposed member handed out after it reconnected");
    }

    stop_load.send_replace(true);
    producer.await.expect("producer");
    let total: i64 = c.query_one("SELECT count(*) FROM events.outbox", &[]).await.expect("count").get(0);
    eventually(90, "every event published", || async { support::published_count(&c).await == total }).await;
    let mut delivered: Vec<i64> = members.iter().flat_map(|m| m.handed.lock().expect("log").clone()).collect();
    delivered.sort_unstable();
    delivered.dedup();
    assert_eq!(delivered.len() as i64, total, "every event was handed out");
    for m in &members {
        m.shutdown.shutdown();
    }
    for m in members {
        let _ = tokio::time::timeout(Duration::from_secs(10), m.stream_task).await;
    }
}

/// The terms of `n` deliveries of `stream` (events of fresh aggregates
/// inserted for them), each acknowledged.
async fn terms_of(c: &Client, stream: &mut EventStream, n: usize) -> Vec<pg_outbox::Term> {
    for _ in 0..n {
        support::insert_seed_events(c, uuid::Uuid::new_v4(), 1).await;
    }
    let mut terms = Vec::new();
    for _ in 0..n {
        let d = next(stream).await;
        terms.push(d.term().expect("a leader's delivery carries a term"));
        d.ack();
    }
    terms
}

#[tokio::test]
async fn terms_only_grow_when_the_mode_or_the_number_of_partitions_changes() {
    let db = TestDb::new("terms_across_modes").await;
    let c = db.client().await;
    let mut last = None;
    let configs = [
        pg_outbox::Mode::Single,
        pg_outbox::Mode::Partitioned { partitions: 4 },
        pg_outbox::Mode::Partitioned { partitions: 2 },
        pg_outbox::Mode::Single,
        pg_outbox::Mode::Partitioned { partitions: 4 },
    ];
    for mode in configs {
        let mut s = Consumer::builder(db.options()).mode(mode).start().await.expect("start");
        let terms = terms_of(&c, &mut s, 8).await;
        s.finish().await.expect("finish");
        let lowest = terms.iter().min().copied();
        assert!(
            lowest > last,
            "{mode:?}: every delivery's term is above every term before ({lowest:?} after {last:?}); an aggregate \
             that moves to another scope must not see its term go down"
        );
        last = terms.iter().max().copied();
    }
}

/// A holder of another configuration's scope that did not release its
/// term (it crashed or froze before the mode changed) may still be within
/// its hand-out lease: the new configuration's first leader waits the
/// takeover wait before it delivers, as it would after its own scope's.
#[tokio::test]
async fn a_term_left_unreleased_under_another_mode_makes_the_next_leader_wait() {
    let db = TestDb::new("terms_wait_across_modes").await;
    let c = db.client().await;
    // What a partitioned relay killed before the switch leaves behind.
    c.execute("INSERT INTO events.outbox_terms (scope, term, released) VALUES ('partition:0/4', 7, false)", &[])
        .await
        .expect("an unreleased partition term");
    let id = support::insert_seed_events(&c, uuid::Uuid::new_v4(), 1).await[0];
    let mut s = Consumer::builder(db.options()).start().await.expect("start");
    let d = next(&mut s).await;
    assert_eq!(d.id, id);
    d.ack();
    s.finish().await.expect("finish");
    let waited: f64 = c
        .query_one(
            "SELECT EXTRACT(EPOCH FROM ((SELECT published_at FROM events.outbox WHERE id = $1) \
               - (SELECT taken_at FROM events.outbox_terms WHERE scope = 'outbox')))::float8",
            &[&id],
        )
        .await
        .expect("from the term to the delivery")
        .get(0);
    assert!(waited >= 2.0, "delivered {waited:.3} s after taking the term, inside a possible lease of the other mode");
}

//! Exactly-once sinks delivering a named subscription under a real fault:
//! the pipelining fault suite's `kill -9` mid-drain (see
//! `pipeline_faults`), with subscription `audit` created before the load
//! and every relay run with `--subscription audit --exactly-once` into a
//! private Redis (`XADD key <id>-0`) or NATS JetStream (each subject's
//! last message chained) server. Progress is `audit`'s cursor row, not
//! `published_at`: an event counts as settled for it once at or below its
//! `cursor_id` with no failure row, or listed in its `settled`.
//!
//! At each kill (once the killed relay's sessions are gone) the broker may
//! hold events not yet settled for `audit` ("unsettled"); the next relay
//! (fenced by the term of scope `subscription:audit`) sends them again and
//! the broker refuses the repeats. Checked at the end: the broker holds
//! every committed event exactly once (0 lost, 0 duplicates), each
//! aggregate's in id order; every relay took a term of its own in
//! `subscription:audit`; and the default subscription was untouched (no
//! row published, attempted or failed, and no term of scope `outbox`).
//! One summary line per test:
//! `subscription_fault=<kind> events=<n> lost=<n> duplicates=<n> order_violations=<n> ...`

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio_postgres::Client;

use crate::faults::{self, RelayProc};
use crate::pipeline_faults::{
    Broker, BrokerKind, EVENTS, MAX_IN_FLIGHT, aggregates_of, check_broker, copies_by_id, logs, relay_sessions_gone,
    sample_in_flight, spawn_load,
};
use crate::relay_proc::LIVENESS;
use crate::stranded::metric;
use crate::support::TestDb;
use pg_outbox::subscription::{self, From};

/// The subscription every relay here delivers.
const SUBSCRIPTION: &str = "audit";
/// `kill -9`s per test (a new relay after each).
const KILLS: usize = 3;
/// Events settled for the subscription by each relay before it is killed.
const SETTLED_BEFORE_KILL: i64 = 50;
/// An outbox row `o` is settled for subscription `s` (its row in
/// `events.outbox_subscriptions`): at or below the cursor with no failure
/// row, or listed as settled above it.
const SETTLED: &str = "(o.id <= s.cursor_id OR o.id = ANY (s.settled)) AND NOT EXISTS ( \
                       SELECT 1 FROM events.outbox_subscription_failures f \
                        WHERE f.subscription = s.name AND f.id = o.id)";

// ---------------------------------------------------------------- the subscription's progress

/// Ids of the events settled for subscription `name`.
async fn settled_ids(c: &Client, name: &str) -> HashSet<i64> {
    let sql =
        format!("SELECT o.id FROM events.outbox o JOIN events.outbox_subscriptions s ON s.name = $1 WHERE {SETTLED}");
    c.query(&sql, &[&name]).await.expect("read settled ids").iter().map(|r| r.get(0)).collect()
}

/// How many events are settled for subscription `name`.
async fn settled_count(c: &Client, name: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM events.outbox o JOIN events.outbox_subscriptions s ON s.name = $1 WHERE {SETTLED}"
    );
    c.query_one(&sql, &[&name]).await.expect("count settled events").get(0)
}

/// Wait (polling every 5 ms) until `n` more events are settled for
/// subscription `name` than now.
async fn settled_more(c: &Client, name: &str, n: i64) {
    let base = settled_count(c, name).await;
    let deadline = Instant::now() + LIVENESS;
    while settled_count(c, name).await < base + n {
        assert!(Instant::now() < deadline, "{name}: the relay did not settle {n} events within {LIVENESS:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The default subscription's progress on the rows: how many are
/// published, and how many were ever attempted and failed (a retry count,
/// a next retry or an error).
async fn default_progress(c: &Client) -> (i64, i64) {
    let r = c
        .query_one(
            "SELECT count(*) FILTER (WHERE published_at IS NOT NULL), \
                    count(*) FILTER (WHERE retry_count <> 0 OR next_retry_at IS NOT NULL OR last_error IS NOT NULL) \
             FROM events.outbox",
            &[],
        )
        .await
        .expect("read the default subscription's columns");
    (r.get(0), r.get(1))
}

/// The leadership term of `scope`, if any relay ever took it.
async fn term(c: &Client, scope: &str) -> Option<i64> {
    c.query_opt("SELECT term FROM events.outbox_terms WHERE scope = $1", &[&scope])
        .await
        .expect("read a leadership term")
        .map(|r| r.get(0))
}

/// Repeats the relay whose metrics are at `addr` had the broker refuse
/// (`outbox_sink_repeats_refused_total`; 0 before the first).
/// The repeats the relay at `addr` had refused, from a scrape that shows
/// each series once. (A relay of a named subscription once exported a
/// metric under two keys with the same labels, the library's labelled one
/// and the one set to 0 at start; the exporter showed the 0, and this
/// count read 0 while repeats were refused: `check_kills` caught it.)
async fn repeats_refused(addr: &str) -> usize {
    if let Some(body) = crate::stranded::scrape(addr).await {
        let mut series = HashSet::new();
        for line in body.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let name = line.rsplit_once(' ').map_or(line, |(n, _)| n);
            assert!(series.insert(name.to_string()), "series {name} shown twice:\n{body}");
        }
    }
    metric(addr, pg_outbox::metrics::SINK_REPEATS_REFUSED).await.map_or(0, |v| v as usize)
}

// ---------------------------------------------------------------- kill -9 mid-drain

/// What one kill left behind.
struct Kill {
    /// Events the broker held that were not settled for the subscription.
    unsettled: HashSet<i64>,
    /// Copies the broker held then, by id.
    held: HashMap<i64, usize>,
}

/// Wait until the running relay (the last of `relays`, metrics at `addr`)
/// has settled some of the backlog, `kill -9` it, and read what it left:
/// its repeats refused just before the kill, and the [`Kill`].
async fn kill_mid_drain(broker: &Broker, c: &Client, tag: &str, relays: &mut [RelayProc], addr: &str) -> (usize, Kill) {
    settled_more(c, SUBSCRIPTION, SETTLED_BEFORE_KILL).await;
    faults::assert_running(tag, &mut relays.iter_mut().collect::<Vec<_>>()).await;
    let refused = repeats_refused(addr).await;
    relays.last_mut().expect("a relay runs").kill9().await;
    relay_sessions_gone(c).await;
    let settled = settled_ids(c, SUBSCRIPTION).await;
    let held = copies_by_id(broker, c).await;
    let unsettled = held.keys().filter(|id| !settled.contains(id)).copied().collect();
    (refused, Kill { unsettled, held })
}

/// `kill -9` of the relay delivering subscription `audit` into an
/// exactly-once `kind` broker, [`KILLS`] times mid-drain, a new relay each
/// time; then the checks of the module's doc.
async fn kill_9_mid_drain_of_a_subscription(kind: BrokerKind, seed: u64) {
    let Some(broker) = Broker::start(kind, true).await else { return };
    let tag = format!("kill_9_{}_subscription", broker.name());
    let mut rng = StdRng::seed_from_u64(seed);
    let db = TestDb::new(&format!("pf_sub_kill_{}", broker.name())).await;
    let c = db.client().await;
    subscription::create(&c, SUBSCRIPTION, From::Earliest).await.expect("create the subscription");
    let load = spawn_load(&db.url(), seed, &mut rng, EVENTS);
    let started = Instant::now();
    let most = Arc::new(AtomicUsize::new(0));
    load.reached(EVENTS / 5).await;
    let (mut relays, mut addrs, mut samplers, mut kills, mut refused) = (vec![], vec![], vec![], vec![], vec![]);
    for k in 0..=KILLS {
        let n = u32::try_from(k + 1).expect("few relays");
        let (relay, addr) = broker.relay(&db.url(), n, &["--subscription", SUBSCRIPTION]).await;
        relays.push(relay);
        samplers.push(sample_in_flight(addr.clone(), most.clone()));
        addrs.push(addr);
        if k == KILLS {
            break;
        }
        let (r, kill) = kill_mid_drain(&broker, &c, &tag, &mut relays, &addrs[k]).await;
        refused.push(r);
        kills.push(kill);
        // A backlog the next relay takes a while to drain.
        load.reached((load.committed() + 400).min(EVENTS)).await;
    }
    let ledger = load.join().await;
    let all = &mut relays.iter_mut().collect::<Vec<_>>();
    let drained_in = faults::wait_drained_in(&c, Some(SUBSCRIPTION), &tag, seed, all).await;
    refused.push(repeats_refused(addrs.last().expect("a relay")).await);
    for s in samplers {
        s.abort();
    }
    let (t, copies) = check_broker(&tag, &broker, &c, &ledger, &aggregates_of(&ledger), &logs(&relays)).await;
    let most = most.load(Ordering::SeqCst);
    let per_kill: Vec<(usize, usize)> = kills.iter().zip(&refused[1..]).map(|(k, r)| (k.unsettled.len(), *r)).collect();
    println!(
        "subscription_fault={tag} subscription={SUBSCRIPTION} kills={KILLS} events={} lost={} duplicates={} \
         order_violations={} most_in_flight={most} per_kill(unsettled,repeats_refused_by_next)={per_kill:?} \
         drained_after_load={drained_in:?} test_time={:?}",
        t.events,
        t.lost,
        t.duplicates,
        t.order_violations,
        started.elapsed()
    );
    assert_eq!(t.duplicates, 0, "{tag}: duplicates at an exactly-once broker: {t:?}");
    check_kills(&tag, &kills, &copies, &refused);
    assert!(most > 1 && most <= MAX_IN_FLIGHT, "{tag}: sends in flight at once (sampled): {most}");
    check_terms_and_default(&tag, &c).await;
}

/// The kills were real faults and the broker absorbed them: some kill left
/// the broker ahead of the subscription, the relays after it had the
/// broker refuse repeats, and every event a kill left unsettled is held
/// exactly once at the end, as it was held once at the kill.
fn check_kills(tag: &str, kills: &[Kill], copies: &[(i64, uuid::Uuid)], refused: &[usize]) {
    let mut last: HashMap<i64, usize> = HashMap::new();
    for (id, _) in copies {
        *last.entry(*id).or_default() += 1;
    }
    assert!(kills.iter().any(|k| !k.unsettled.is_empty()), "{tag}: no kill left the broker ahead of the subscription");
    for (k, kill) in kills.iter().enumerate() {
        for id in &kill.unsettled {
            let (then, now) = (kill.held.get(id).copied().unwrap_or(0), last.get(id).copied().unwrap_or(0));
            assert!(
                then == 1 && now == 1,
                "{tag}: kill {k}: event {id} unsettled, held {then}x then, {now}x at the end"
            );
        }
    }
    let absorbed: usize = refused[1..].iter().sum();
    assert!(absorbed > 0, "{tag}: events held but unsettled at a kill, and no relay after had a repeat refused");
}

/// Each relay took a term of its own in scope `subscription:audit` (so the
/// broker fenced by it); the default subscription never ran: no term of
/// scope `outbox`, no row published, attempted or failed.
async fn check_terms_and_default(tag: &str, c: &Client) {
    let scope = format!("subscription:{SUBSCRIPTION}");
    let terms = term(c, &scope).await;
    let relays = i64::try_from(KILLS + 1).expect("few relays");
    assert!(terms.is_some_and(|t| t >= relays), "{tag}: {relays} relays took terms of {scope}, which is at {terms:?}");
    assert_eq!(term(c, "outbox").await, None, "{tag}: a relay led the default subscription");
    let (published, attempted) = default_progress(c).await;
    assert_eq!((published, attempted), (0, 0), "{tag}: the default subscription's rows (published, attempted)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_into_redis_exactly_once_for_a_subscription() {
    kill_9_mid_drain_of_a_subscription(BrokerKind::Redis, 0x5EB5_0001).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_into_nats_exactly_once_for_a_subscription() {
    kill_9_mid_drain_of_a_subscription(BrokerKind::Nats, 0x5EB5_0002).await;
}

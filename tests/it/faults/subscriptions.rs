//! The fault suite with two subscriptions on one outbox, each delivered by
//! its own `pg-outbox relay` to its own webhook: the default subscription,
//! and `audit`, whose webhook answers HTTP 500 to the first attempt of one
//! event in ten. Into one producer load go a `kill -9` of each relay
//! (restarted), a PostgreSQL restart, and a freeze of audit's relay
//! (SIGSTOP, then SIGCONT). Each subscription is checked as the rest of the
//! suite checks the default one: 0 lost, 0 order violations, nothing
//! settled without a 2xx, duplicates within the in-flight window of the
//! kills.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use pg_outbox_testkit::process::LIVENESS;

use super::{BATCH, Behavior, Faults, Harness, Load, connect, fault_points, load_spec, throwaway_migrated};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_subscriptions_through_kills_a_restart_a_freeze_and_a_failing_sink() {
    const SEED: u64 = 0xFA17_0050;
    let mut rng = StdRng::seed_from_u64(SEED);
    let (server, url) = throwaway_migrated("fault_subscriptions").await;
    let c = connect(&url, "fault-suite setup", LIVENESS).await;
    c.execute("INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) VALUES ('audit', 0, 0)", &[])
        .await
        .expect("create subscription");
    drop(c);

    let mut default = Harness::new("subscriptions_default", SEED, url.clone(), Behavior::Ok, &[]).await;
    let failing = Behavior::FailFirstAttemptOfEvery { every: 10 };
    let mut audit =
        Harness::new("subscriptions_audit", SEED, url.clone(), failing, &[]).await.for_subscription("audit");
    default.start_relay().await;
    audit.start_relay().await;
    let load = Load::spawn(load_spec(&url, SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, 4);
    let (mut default_kills, mut audit_faults) = (0, 0);
    for (k, p) in points.into_iter().enumerate() {
        load.reached(p).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        default.assert_relays_running().await;
        audit.assert_relays_running().await;
        match k {
            0 | 1 => {
                let h = if k == 0 { &mut default } else { &mut audit };
                let i = h.relays.iter().position(|r| r.alive).expect("a relay runs");
                h.relays[i].kill9().await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..200))).await;
                h.start_relay().await;
                if k == 0 { default_kills += 1 } else { audit_faults += 1 }
            }
            2 => {
                let s = server.clone();
                let took = Instant::now();
                tokio::task::spawn_blocking(move || s.restart())
                    .await
                    .expect("join")
                    .unwrap_or_else(|e| panic!("restart: {}", pg_outbox::error::report(&e)));
                println!("fault=subscriptions restart took {:?}", took.elapsed());
                audit_faults += 1;
            }
            _ => {
                let i = audit.relays.iter().position(|r| r.alive).expect("a relay runs");
                audit.relays[i].signal(libc::SIGSTOP);
                tokio::time::sleep(Duration::from_secs(2)).await;
                audit.relays[i].signal(libc::SIGCONT);
                audit_faults += 1;
            }
        }
    }
    let ledger = load.join().await;
    let report = default.finish(Faults::Injected(default_kills + 1), ledger.clone()).await;
    default.check(&report, 2 * BATCH * default_kills);
    let report = audit.finish(Faults::Injected(audit_faults), ledger).await;
    // Duplicates: the kill's in-flight window, and what the freeze and the
    // restart left in flight.
    audit.check(&report, 2 * BATCH * 3);
    let published_by_default: i64 = connect(&url, "fault-suite checker", LIVENESS)
        .await
        .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL AND retry_count = 0", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(
        usize::try_from(published_by_default).unwrap_or(0),
        report.events,
        "audit's failures never touched the default subscription's columns"
    );
    drop((default, audit));
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

/// A subscription delivered by two relays in partitioned mode (4
/// partitions) to one webhook that fails the first attempt of one event in
/// ten, beside the default's relay: under one producer load, a `kill -9`
/// of one of them (restarted), a freeze of one (SIGSTOP for 3 s, longer
/// than the hand-out lease, so its partitions are taken over, then
/// SIGCONT), and a second `kill -9`. 0 lost and 0 order violations for
/// the subscription, with the handovers between relays in the middle of
/// its aggregates; the default's columns untouched by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_subscription_through_kills_and_a_freeze() {
    const SEED: u64 = 0xFA17_0051;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = crate::support::TestDb::new("fault_sub_partitioned").await;
    let url = db.url();
    let c = db.client().await;
    c.execute("INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) VALUES ('audit', 0, 0)", &[])
        .await
        .expect("create subscription");
    drop(c);

    let failing = Behavior::FailFirstAttemptOfEvery { every: 10 };
    let mut audit = Harness::new("subscription_partitioned", SEED, url.clone(), failing, &[])
        .await
        .for_subscription("audit")
        .partitioned(4);
    audit.start_relay().await;
    audit.start_relay().await;
    let load = Load::spawn(load_spec(&url, SEED, &mut rng));
    let points = fault_points(&mut rng, load.events, 3);
    let mut faults = 0;
    for (k, p) in points.into_iter().enumerate() {
        load.reached(p).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        audit.assert_relays_running().await;
        let alive: Vec<usize> = audit.relays.iter().enumerate().filter(|(_, r)| r.alive).map(|(i, _)| i).collect();
        let i = alive[rng.random_range(0..alive.len())];
        if k == 1 {
            audit.relays[i].signal(libc::SIGSTOP);
            tokio::time::sleep(Duration::from_secs(3)).await;
            audit.relays[i].signal(libc::SIGCONT);
        } else {
            audit.relays[i].kill9().await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..200))).await;
            audit.start_relay().await;
        }
        faults += 1;
    }
    let ledger = load.join().await;
    let report = audit.finish(Faults::Injected(faults), ledger).await;
    // Duplicates: each kill's in-flight window (two relays), and what the
    // freeze left in flight.
    audit.check(&report, 2 * BATCH * 4);
    let published: i64 = connect(&url, "fault-suite checker", LIVENESS)
        .await
        .query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(published, 0, "the subscription's relays never touched the default's columns");
    drop(audit);
}

/// A subscription's webhook answers HTTP 500 to the first attempt of one
/// event in ten: as `faults::failing_sink` for the default, every such
/// event is retried and delivered, each aggregate's later events held back
/// behind it in order, and nothing settled without a 2xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_sink_of_a_subscription() {
    const SEED: u64 = 0xFA17_0008;
    let mut rng = StdRng::seed_from_u64(SEED);
    let db = crate::support::TestDb::new("fault_sub_sink_500").await;
    db.client()
        .await
        .execute("INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) VALUES ('audit', 0, 0)", &[])
        .await
        .expect("create subscription");
    let failing = Behavior::FailFirstAttemptOfEvery { every: 10 };
    let mut h = Harness::new("subscription_failing_sink", SEED, db.url(), failing, &[]).await.for_subscription("audit");
    h.start_relay().await;
    let load = Load::spawn(load_spec(&db.url(), SEED, &mut rng));
    let ledger = load.join().await;
    let report = h.finish(Faults::SinkAnswers(500), ledger).await;
    super::check_retried(&h.sink.attempts(), 500);
    h.check(&report, 0);
}

/// A crash of the server (`pg_ctl stop -m immediate`, then crash recovery)
/// under one producer load, with three relays on one outbox: the default
/// subscription's, `audit`'s (acknowledging with `synchronous_commit` off,
/// the default for a named subscription) and `durable`'s (`--durable-acks`).
/// Each loses nothing and keeps each aggregate in order. audit's
/// acknowledgements of the last moments before the crash may be lost with
/// the WAL not yet written: those events come again, at most what the
/// sink took in the second before the crash on top of the in-flight window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_loses_no_event_of_a_subscription_that_acknowledges_asynchronously() {
    const SEED: u64 = 0xFA17_0052;
    let mut rng = StdRng::seed_from_u64(SEED);
    let (server, url) = throwaway_migrated("fault_sub_crash").await;
    let Ok(mut server) = std::sync::Arc::try_unwrap(server) else { panic!("the throwaway server is this test's") };
    let c = connect(&url, "fault-suite setup", LIVENESS).await;
    c.batch_execute(
        "INSERT INTO events.outbox_subscriptions (name, start_id, cursor_id) VALUES ('audit', 0, 0), ('durable', 0, 0)",
    )
    .await
    .expect("create subscriptions");
    drop(c);

    let mut default = Harness::new("crash_default", SEED, url.clone(), Behavior::Ok, &[]).await;
    let mut audit = Harness::new("crash_audit", SEED, url.clone(), Behavior::Ok, &[]).await.for_subscription("audit");
    let mut durable = Harness::new("crash_durable", SEED, url.clone(), Behavior::Ok, &["--durable-acks"])
        .await
        .for_subscription("durable");
    for h in [&mut default, &mut audit, &mut durable] {
        h.start_relay().await;
    }
    let load = Load::spawn(load_spec(&url, SEED, &mut rng));
    load.reached(load.events / 2).await;
    for h in [&mut default, &mut audit, &mut durable] {
        h.assert_relays_running().await;
    }
    let crashed_at = Instant::now();
    let server = tokio::task::spawn_blocking(move || {
        server.stop().unwrap_or_else(|e| panic!("crash: {}", pg_outbox::error::report(&e)));
        std::thread::sleep(Duration::from_millis(300));
        server.start_again().unwrap_or_else(|e| panic!("start again: {}", pg_outbox::error::report(&e)));
        server
    })
    .await
    .expect("join");
    println!("fault=subscriptions_crash crash and recovery took {:?}", crashed_at.elapsed());
    let ledger = load.join().await;
    // What each sink took in the second before the crash.
    let last_second = |h: &Harness| {
        h.sink
            .attempts()
            .iter()
            .filter(|a| a.delivered() && a.at <= crashed_at && a.at + Duration::from_secs(1) > crashed_at)
            .count()
    };
    let (audit_window, durable_window) = (last_second(&audit), last_second(&durable));
    let report = default.finish(Faults::Injected(1), ledger.clone()).await;
    default.check(&report, 2 * BATCH + 1);
    let durable_report = durable.finish(Faults::Injected(1), ledger.clone()).await;
    durable.check(&durable_report, 2 * BATCH + 1);
    let audit_report = audit.finish(Faults::Injected(1), ledger).await;
    audit.check(&audit_report, 2 * BATCH + 1 + audit_window);
    println!(
        "fault=subscriptions_crash duplicates: default {}, durable {} (took {durable_window} in the last second), \
         audit {} (took {audit_window} in the last second)",
        report.duplicates, durable_report.duplicates, audit_report.duplicates
    );
    drop((default, audit, durable));
    let _ = tokio::task::spawn_blocking(move || drop(server)).await;
}

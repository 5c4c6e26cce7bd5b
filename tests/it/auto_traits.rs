//! Public types are Send + Sync (+ Unpin where it matters), checked at compile time.

fn assert_send_sync<T: Send + Sync>() {}
fn assert_send_unpin<T: Send + Unpin>() {}

#[test]
fn public_types_are_send_and_sync() {
    assert_send_sync::<pg_outbox::Error>();
    assert_send_sync::<pg_outbox::Event>();
    assert_send_sync::<pg_outbox::NewEvent>();
    assert_send_sync::<pg_outbox::Publisher>();
    assert_send_sync::<pg_outbox::Delivery>();
    assert_send_sync::<pg_outbox::ShutdownHandle>();
    assert_send_sync::<pg_outbox::RetryPolicy>();
    assert_send_sync::<pg_outbox::ConsumerBuilder>();
    assert_send_sync::<pg_outbox::ConnectOptions>();
    assert_send_sync::<pg_outbox::tls::SslMode>();
    assert_send_sync::<pg_outbox::tls::RootCert>();
    assert_send_sync::<pg_outbox::health::HealthMonitor>();
    assert_send_sync::<pg_outbox::health::Health>();
    assert_send_sync::<pg_outbox::health::Role>();
    assert_send_sync::<pg_outbox::health::LastError>();
    assert_send_sync::<pg_outbox::health::SinkHealth>();
    assert_send_sync::<pg_outbox::relay::StdoutSink>();
    assert_send_sync::<pg_outbox::relay::WebhookSink>();
    assert_send_unpin::<pg_outbox::EventStream>();
    assert_send_sync::<pg_outbox::relay::replay::Replay>();
    assert_send_sync::<pg_outbox::relay::replay::ReplayBuilder>();
    assert_send_sync::<pg_outbox::relay::replay::Filter>();
    assert_send_sync::<pg_outbox::relay::replay::Progress>();
    assert_send_sync::<pg_outbox_testkit::temp_server::TempServer>();
    assert_send_sync::<pg_outbox_testkit::temp_server::TempServerOptions>();
    assert_send_sync::<pg_outbox_testkit::temp_server::StandbyOptions>();
}

fn assert_send<T: Send>(_: T) {}

/// A replay can run on a spawned task: its futures are `Send` (checked by
/// the compiler; never called).
#[allow(dead_code)]
fn replay_futures_are_send(r: &mut pg_outbox::relay::replay::Replay, sink: &pg_outbox::relay::StdoutSink) {
    assert_send(r.run(sink, std::future::pending::<()>(), |_| {}));
}

#[allow(dead_code)]
fn replay_count_and_open_are_send(r: &mut pg_outbox::relay::replay::Replay, db: &pg_outbox::ConnectOptions) {
    assert_send(r.count(std::future::pending::<()>(), |_| {}));
    assert_send(pg_outbox::relay::replay::Replay::builder(Default::default()).open(db));
}

/// Connecting to the primary can run on a spawned task (checked by the
/// compiler; never called).
#[allow(dead_code)]
fn connect_primary_is_send(db: &pg_outbox::ConnectOptions) {
    assert_send(db.connect_primary());
}

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
    assert_send_sync::<pg_outbox::SslMode>();
    assert_send_sync::<pg_outbox::RootCert>();
    assert_send_sync::<pg_outbox::HealthMonitor>();
    assert_send_sync::<pg_outbox::Health>();
    assert_send_sync::<pg_outbox::Role>();
    assert_send_sync::<pg_outbox::LastError>();
    assert_send_sync::<pg_outbox::SinkHealth>();
    assert_send_sync::<pg_outbox::relay::StdoutSink>();
    assert_send_sync::<pg_outbox::relay::WebhookSink>();
    assert_send_unpin::<pg_outbox::EventStream>();
}

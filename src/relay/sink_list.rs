//! The one list of sinks (`each_sink!`): adding a sink to this build is
//! one entry here. The sink table (`registry.rs`), the sink flags of the
//! binary (`cli.rs`) and the `cfg` of what only some sinks use are made
//! from it. It names no module, so every part of the relay may use it.

/// Every sink this build can have, once, in the order `--help` and
/// messages list them: its module in `sinks/`, its kind (`broker`: a sink
/// with TLS, credentials and a name template; `http`, `local`), whether its
/// flags hold secrets in `KEY=VALUE` or `NAME: VALUE` form (`no_echo`, else
/// `echo`), its Cargo feature, its name in messages, the `--sink` schemes
/// that select it, and why it cannot deliver exactly once (`None`: it can;
/// the reasons are constants of `registry.rs`).
/// `each_sink!(m)` hands the list to the macro `m`: `SINKS` (`registry.rs`), the sink
/// flags of the binary (`relay::SinkFlags`, feature `cli`) and the `cfg`
/// of what only some sinks use ([`dead_unless`], [`with_exactly_once`]) are
/// made from it. Each
/// sink's module has `open` (see `OpenSink`) and, with feature `cli`,
/// `Flags` (its `clap` flags) with `apply`, which writes them into
/// `SinkSettings`.
macro_rules! each_sink {
    ($then:ident $(; $($extra:tt)*)?) => {
        $then! {
            [$($($extra)*)?]
            stdout(local, echo, "relay", "stdout", ["stdout"], Some(NO_REFUSAL)),
            webhook(http, no_echo, "webhook", "webhook", ["http://", "https://"], Some(NO_REFUSAL)),
            nats(broker, echo, "nats", "NATS JetStream", ["nats://", "tls://"], None),
            kafka(broker, no_echo, "kafka", "Kafka", ["kafka://"], Some(KAFKA_AT_LEAST_ONCE)),
            redis(broker, echo, "redis", "Redis Streams", ["redis://", "rediss://"], None),
            amqp(broker, echo, "amqp", "RabbitMQ", ["amqp://", "amqps://"], Some(NO_REFUSAL)),
        }
    };
}
pub(crate) use each_sink;

/// The items `$item`, allowed to go unused in a build without any sink of
/// the kind `broker` (or, with `no_echo`, without any sink whose flags hold
/// secrets): `dead_unless!(broker; fn f() {})`. The features come from
/// [`each_sink`].
macro_rules! dead_unless {
    ($what:ident; $($item:tt)*) => {
        $crate::relay::sink_list::each_sink!(dead_unless; @$what [] $($item)*);
    };
    // Every entry read: the features collected.
    ([@$what:ident [$($f:literal)*] $($item:tt)*]) => {
        #[cfg_attr(not(any($(feature = $f),*)), allow(dead_code))]
        $($item)*
    };
    ([@broker [$($f:literal)*] $($item:tt)*] $m:ident(broker, $e:ident, $feat:literal, $($_:tt)*), $($rest:tt)*) => {
        $crate::relay::sink_list::dead_unless!([@broker [$($f)* $feat] $($item)*] $($rest)*);
    };
    ([@no_echo [$($f:literal)*] $($item:tt)*] $m:ident($k:ident, no_echo, $feat:literal, $($_:tt)*), $($rest:tt)*) => {
        $crate::relay::sink_list::dead_unless!([@no_echo [$($f)* $feat] $($item)*] $($rest)*);
    };
    ([@$what:ident [$($f:literal)*] $($item:tt)*] $m:ident($($_:tt)*), $($rest:tt)*) => {
        $crate::relay::sink_list::dead_unless!([@$what [$($f)*] $($item)*] $($rest)*);
    };
}
pub(crate) use dead_unless;

/// The items `$item`, each built only with a sink that can deliver exactly
/// once (an entry of [`each_sink`] whose last field is `None`):
/// `with_exactly_once! { fn f() {} }`.
macro_rules! with_exactly_once {
    (@apply ($pred:meta) $($item:item)*) => {
        $(#[cfg($pred)] $item)*
    };
    // Every entry read: the features collected.
    ([@[$($f:literal)*] $($item:tt)*]) => {
        $crate::relay::sink_list::with_exactly_once!(@apply (any($(feature = $f),*)) $($item)*);
    };
    ([@[$($f:literal)*] $($item:tt)*]
        $m:ident($k:ident, $e:ident, $feat:literal, $what:literal, [$($s:literal),+], None), $($rest:tt)*) => {
        $crate::relay::sink_list::with_exactly_once!([@[$($f)* $feat] $($item)*] $($rest)*);
    };
    ([@[$($f:literal)*] $($item:tt)*] $m:ident($($_:tt)*), $($rest:tt)*) => {
        $crate::relay::sink_list::with_exactly_once!([@[$($f)*] $($item)*] $($rest)*);
    };
    ($($item:tt)*) => {
        $crate::relay::sink_list::each_sink!(with_exactly_once; @[] $($item)*);
    };
}
pub(crate) use with_exactly_once;

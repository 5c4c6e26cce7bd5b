//! The sinks this build knows, in one table made from the one list of
//! sinks (`sink_list.rs`): opening a `--sink` value, the list of schemes in
//! messages, and the "built without feature X" error are all derived from
//! [`SINKS`].

use futures::future::BoxFuture;

use super::{Sink, SinkSettings};
use crate::error::{Error, Result};
use crate::secret::SecretUrl;

/// Opens a sink of one kind from its URL and the settings.
pub type OpenSink = for<'a> fn(&'a SecretUrl, &'a SinkSettings) -> BoxFuture<'a, Result<Box<dyn Sink>>>;

/// One kind of sink.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SinkKind {
    /// What it is, for messages: `NATS JetStream`.
    pub what: &'static str,
    /// The `--sink` prefixes that select it, lowercase, as typed: a bare
    /// word (`stdout`) matches the whole value, a scheme (`nats://`) its
    /// start.
    pub schemes: &'static [&'static str],
    /// The Cargo feature that builds it in.
    pub feature: &'static str,
    /// How to open it; `None` when this build lacks [`feature`](Self::feature).
    pub open: Option<OpenSink>,
    /// Why it cannot deliver exactly once
    /// ([`SinkSettings::exactly_once`]), one line for the refusal at
    /// start; `None` for the sinks that can (NATS JetStream, Redis
    /// Streams).
    pub no_exactly_once: Option<&'static str>,
}

impl SinkKind {
    /// Whether `spec` (a `--sink` value) selects this kind.
    fn selects(&self, spec: &str) -> bool {
        let spec = spec.trim();
        self.schemes.iter().any(|s| match s.strip_suffix("://") {
            Some(_) => spec.get(..s.len()).is_some_and(|p| p.eq_ignore_ascii_case(s)),
            None => spec.eq_ignore_ascii_case(s),
        })
    }
}

/// A [`SinkKind`] whose `open` is `$module::open` when `$feature` is on.
macro_rules! kind {
    ($what:literal, $feature:literal, $module:ident, [$($scheme:literal),+], $no_exactly_once:expr) => {{
        #[cfg(feature = $feature)]
        const OPEN: Option<OpenSink> = Some(super::sinks::$module::open);
        #[cfg(not(feature = $feature))]
        const OPEN: Option<OpenSink> = None;
        SinkKind { what: $what, schemes: &[$($scheme),+], feature: $feature, open: OPEN, no_exactly_once: $no_exactly_once }
    }};
}

/// Why a sink whose destination cannot refuse a repeat runs at-least-once.
const NO_REFUSAL: &str = "the destination has no way to refuse a repeat, so the sink stays at-least-once; \
    deduplicate on the outbox id (the record's `id`, or the `id` header where the sink sends headers)";

/// Why the Kafka sink runs at-least-once.
const KAFKA_AT_LEAST_ONCE: &str = "the Kafka sink stays at-least-once (idempotent producer, the `term` header; \
    deduplicate on the `id` header): exactly-once would need a transactional producer, which pg-outbox does not \
    offer until it can be proven against a broker (README, \"Guarantees\")";

/// [`SINKS`] from the entries of `each_sink!` (`sink_list.rs`).
macro_rules! sink_table {
    ([] $($m:ident($k:ident, $e:ident, $feature:literal, $what:literal, [$($scheme:literal),+], $no:expr),)*) => {
        /// Every sink, in the order `--help` and messages list them.
        pub static SINKS: &[SinkKind] = &[$(kind!($what, $feature, $m, [$($scheme),+], $no)),*];
    };
}

super::sink_list::each_sink!(sink_table);

/// The `--sink` values every sink takes, for messages: `stdout`,
/// `http://`, `https://`, `nats://`, ...
pub fn sink_schemes() -> String {
    SINKS.iter().flat_map(|k| k.schemes.iter().copied()).collect::<Vec<_>>().join(", ")
}

/// Open the sink a `--sink` value names (see [`SINKS`]): `stdout`,
/// `http://` or `https://` (webhook), `nats://` or `tls://` (NATS
/// JetStream), `kafka://` (Kafka), `redis://` or `rediss://` (Redis
/// Streams), `amqp://` or `amqps://` (RabbitMQ). The sink's
/// [`Sink::name`] names it without credentials.
///
/// With [`SinkSettings::exactly_once`], a sink that cannot deliver exactly
/// once ([`SinkKind::no_exactly_once`]) is refused before anything is
/// opened.
///
/// # Errors
/// [`Error::Config`] for an unknown scheme, a malformed URL, a scheme
/// whose Cargo feature this build lacks, or `exactly_once` with a sink
/// that cannot (or with settings it cannot keep it under); [`Error::SinkUnavailable`] for a
/// broker that cannot be reached at start.
///
/// # Cancel safety
/// Cancel safe: dropping the future drops the connection being opened.
pub async fn open_sink(url: &SecretUrl, settings: &SinkSettings) -> Result<Box<dyn Sink>> {
    let spec = url.expose();
    let Some(kind) = SINKS.iter().find(|k| k.selects(spec)) else {
        return Err(Error::Config(format!("unsupported sink '{}': expected one of {}", url.shown(), sink_schemes())));
    };
    if settings.exactly_once
        && let Some(why) = kind.no_exactly_once
    {
        return Err(Error::Config(format!("--exactly-once is not supported by the {} sink: {why}", kind.what)));
    }
    match kind.open {
        Some(open) => open(url, settings).await,
        None => Err(Error::Config(format!(
            "this pg-outbox was built without the `{feature}` feature, which the {what} sink needs; rebuild with \
             `--features {feature}` (`--features full` has every sink)",
            feature = kind.feature,
            what = kind.what,
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_select_their_kind_whatever_the_case() {
        let kind = |spec: &str| SINKS.iter().find(|k| k.selects(spec)).map(|k| k.what);
        assert_eq!(kind("stdout"), Some("stdout"));
        assert_eq!(kind("NATS://h:4222"), Some("NATS JetStream"));
        assert_eq!(kind("rediss://h"), Some("Redis Streams"));
        assert_eq!(kind("stdoutx"), None);
        assert_eq!(kind("ftp://h"), None);
        let can: Vec<&str> = SINKS.iter().filter(|k| k.no_exactly_once.is_none()).map(|k| k.what).collect();
        assert_eq!(can, ["NATS JetStream", "Redis Streams"]);
        assert!(sink_schemes().starts_with("stdout, http://, https://, nats://"), "{}", sink_schemes());
    }
}

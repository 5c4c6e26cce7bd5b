//! The parsers of argument values: durations, sizes, addresses, retry
//! schedules and UUIDs, each with a message that says what to write.

use std::net::SocketAddr;
use std::time::Duration;

use pg_outbox::RetryPolicy;

/// A duration that may be zero (`0`, `0s`, `0ms`).
pub(crate) fn parse_duration_or_zero(s: &str) -> Result<Duration, String> {
    if s.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic()) == "0" {
        return Ok(Duration::ZERO);
    }
    parse_duration(s)
}

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("invalid duration '{s}': {e} (write e.g. 200ms, 1s, 5m, 1h)"))?;
    if d.is_zero() {
        return Err(format!("invalid duration '{s}': must be longer than zero"));
    }
    Ok(d)
}

/// A size in bytes for `--max-buffered-bytes`: a number of bytes, or a
/// number with a unit (`KiB`, `MiB`, `GiB` in powers of 1024; `KB`, `MB`,
/// `GB` in powers of 1000; parsed by the `bytesize` crate), at least
/// [`pg_outbox::ConsumerBuilder::MIN_MAX_BUFFERED_BYTES`] and at most `i64::MAX`. A
/// `ByteSize`, not a number, so a config file may write it either way
/// (`"64MiB"` or `67108864`).
pub(crate) fn parse_byte_size(s: &str) -> Result<bytesize::ByteSize, String> {
    let size: bytesize::ByteSize = s.trim().parse().map_err(|_: String| {
        format!("invalid size '{s}': write a number of bytes or a number with a unit, e.g. 64MiB, 512MB or 1048576")
    })?;
    let bytes = usize::try_from(size.as_u64())
        .ok()
        .filter(|b| i64::try_from(*b).is_ok())
        .ok_or_else(|| format!("invalid size '{s}': too large"))?;
    if bytes < pg_outbox::ConsumerBuilder::MIN_MAX_BUFFERED_BYTES {
        return Err(format!(
            "invalid size '{s}' ({bytes} bytes): must be at least 1MiB ({} bytes)",
            pg_outbox::ConsumerBuilder::MIN_MAX_BUFFERED_BYTES
        ));
    }
    Ok(size)
}

/// A timeout: a duration as [`parse_duration`], or `0` for none (as in
/// PostgreSQL).
pub(crate) fn parse_timeout(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    parse_duration(s).map_err(|e| format!("{e}; 0 disables the timeout"))
}

/// Shortest sweep interval: each sweep is a query, and a sweep every few
/// microseconds would keep a database core busy for nothing.
const MIN_SWEEP_INTERVAL: Duration = Duration::from_millis(10);

pub(crate) fn parse_sweep_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < MIN_SWEEP_INTERVAL {
        return Err(format!("invalid duration '{s}': the sweep interval must be at least 10ms"));
    }
    Ok(d)
}

/// `--stranded-after`: a duration from [`pg_outbox::ConsumerBuilder::MIN_STRANDED_AFTER`]
/// (3 s) to [`pg_outbox::ConsumerBuilder::MAX_STRANDED_AFTER`] (1 hour).
pub(crate) fn parse_stranded_after(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if !(pg_outbox::ConsumerBuilder::MIN_STRANDED_AFTER..=pg_outbox::ConsumerBuilder::MAX_STRANDED_AFTER).contains(&d) {
        return Err(format!("invalid duration '{s}': must be 3s to 1h"));
    }
    Ok(d)
}

pub(crate) fn parse_schedule(s: &str) -> Result<RetryPolicy, String> {
    let steps = s.split(',').map(parse_duration).collect::<Result<Vec<_>, _>>()?;
    RetryPolicy::schedule(steps).map_err(|e| e.to_string())
}

/// `PORT` (bound on 127.0.0.1) or `HOST:PORT`.
pub(crate) fn parse_metrics_addr(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let s = s.trim();
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.to_socket_addrs()
        .map_err(|e| format!("invalid address '{s}': {e} (write PORT or HOST:PORT, e.g. 9464 or 0.0.0.0:9464)"))?
        .next()
        .ok_or_else(|| format!("address '{s}' resolves to nothing"))
}

pub(crate) fn parse_uuid(s: &str) -> Result<uuid::Uuid, String> {
    uuid::Uuid::parse_str(s.trim()).map_err(|e| format!("'{s}' is not a valid UUID: {e}"))
}

//! What goes to stderr: logs (tracing) as human-readable text or one JSON
//! object per line (`--log-format`), and the few lines a command prints
//! itself (a replay's summary, the final error), in the same format.
//!
//! A JSON line has the keys `timestamp` (RFC 3339, UTC), `level` (`TRACE`
//! .. `ERROR`), `message` and `target` (the module that logged it), plus the
//! event's own fields at the top level: `id` (an outbox id) where a line is
//! about one event, `role` where the relay reports what it became, `error`,
//! `attempt`, `sink`, `database` and so on. No spans, no thread names: those
//! keys are all.

use std::io::{IsTerminal, Write};

use serde_json::{Map, Value};

/// `--log-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum LogFormat {
    /// Human-readable lines (colored on a terminal).
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, message, target and the
    /// event's fields.
    Json,
}

/// Log filter when `RUST_LOG` is unset: our own info lines; the broker
/// clients' own logs are off (lapin logs a returned message with its payload
/// bytes; librdkafka logs every reconnect attempt twice), since every sink
/// reports its failures itself, one line per event. `RUST_LOG` overrides it
/// (e.g. `RUST_LOG=info,lapin=debug`).
pub(crate) const DEFAULT_LOG_FILTER: &str =
    "info,tokio_postgres=warn,lapin=off,rdkafka=off,librdkafka=off,async_nats=warn,redis=warn";

/// Install the global subscriber: stderr, `RUST_LOG` or
/// [`DEFAULT_LOG_FILTER`], in `format`.
pub(crate) fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let fmt = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter);
    match format {
        LogFormat::Text => fmt.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => {
            fmt.json().flatten_event(true).with_current_span(false).with_span_list(false).with_ansi(false).init()
        }
    }
}

/// A line a command prints itself (not a log: shown whatever `RUST_LOG`
/// says): `message` as is in text, or a JSON object with the keys of a log
/// line (`target` is `target`) and `fields` in JSON.
pub(crate) fn line(format: LogFormat, level: &str, target: &str, message: &str, fields: &[(&str, Value)]) {
    let text = match format {
        LogFormat::Text => message.to_string(),
        LogFormat::Json => {
            let mut obj = Map::new();
            obj.insert(
                "timestamp".into(),
                chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true).into(),
            );
            obj.insert("level".into(), level.into());
            obj.insert("message".into(), message.into());
            for (k, v) in fields {
                obj.insert((*k).to_string(), v.clone());
            }
            obj.insert("target".into(), target.into());
            Value::Object(obj).to_string()
        }
    };
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{text}");
}

/// The final `error: ...` line of a failed command.
pub(crate) fn error(format: LogFormat, message: &str) {
    line(format, "ERROR", "pg_outbox", &format!("error: {message}"), &[]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_names_are_text_and_json() {
        use clap::ValueEnum;
        let names: Vec<String> = LogFormat::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|v| v.get_name().to_string())
            .collect();
        assert_eq!(names, ["text", "json"]);
    }
}

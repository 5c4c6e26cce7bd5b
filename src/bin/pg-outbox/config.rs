//! `relay` settings from the command line, the environment and a TOML file.
//!
//! Every `relay` flag `--some-flag` can also be set by the environment
//! variable `OUTBOX_SOME_FLAG` and by the key `some_flag` (or `some-flag`) in
//! the TOML file named by `--config FILE` or `OUTBOX_CONFIG`. Precedence:
//! command line > environment > config file > built-in default. The
//! database URL comes from `--database-url`, else `DATABASE_URL`, else
//! `OUTBOX_DATABASE_URL`, else the file's `database_url`, else none: then
//! libpq's `PG*` variables and defaults name the database.
//!
//! The mechanism is generic over the relay's arguments: environment names
//! are added to every argument with `Command::mut_args`, and the file's
//! values become the arguments' defaults, so clap's own value parsers check
//! them and its precedence (command line, then environment, then default)
//! holds.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::error::Error;
use clap::parser::ValueSource;
use clap::{Arg, ArgMatches, Command, CommandFactory, FromArgMatches};

use crate::Cli;

/// Prefix of the environment variables of relay flags.
pub(crate) const ENV_PREFIX: &str = "OUTBOX_";

/// Relay arguments that are not settings (no environment name, no file key).
const NOT_SETTINGS: [&str; 3] = ["help", "config", "print_config"];

/// The top-level argument that names the database.
const DATABASE_URL: &str = "database_url";

/// The fallback environment variable of `--database-url`, read when
/// `DATABASE_URL` is unset or empty.
pub(crate) const OUTBOX_DATABASE_URL: &str = "OUTBOX_DATABASE_URL";

/// Settings read from a config file: argument id -> values.
#[derive(Debug, Default)]
pub(crate) struct FileLayer {
    pub(crate) path: Option<PathBuf>,
    values: BTreeMap<String, Vec<String>>,
}

/// Everything parsed: the typed CLI, the raw matches (for sources), the file.
pub(crate) struct Loaded {
    pub(crate) cli: Cli,
    pub(crate) matches: ArgMatches,
    pub(crate) command: Command,
    pub(crate) file: FileLayer,
}

/// `OUTBOX_BATCH_SIZE` for `--batch-size`.
fn env_name(long: &str) -> String {
    format!("{ENV_PREFIX}{}", long.replace('-', "_").to_uppercase())
}

/// The command with an `OUTBOX_*` environment variable on every relay
/// setting (values hidden in `--help`: they may hold secrets), and
/// `OUTBOX_DATABASE_URL` for `--database-url` when `DATABASE_URL` is unset
/// or empty (so `DATABASE_URL` wins, and `--print-config` names the one used).
fn command() -> Command {
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.to_string_lossy().trim().is_empty());
    let cmd = Cli::command();
    let cmd = if !set("DATABASE_URL") && set(OUTBOX_DATABASE_URL) {
        cmd.mut_arg(DATABASE_URL, |a| a.env(OUTBOX_DATABASE_URL))
    } else {
        cmd
    };
    let with_env = |arg: Arg| match arg.get_long().map(env_name) {
        Some(name) => arg.env(name).hide_env_values(true),
        None => arg,
    };
    let cmd = cmd.mut_subcommand("relay", |relay| {
        relay.mut_args(|arg| {
            let id = arg.get_id().as_str();
            if NOT_SETTINGS.contains(&id) || arg.get_env().is_some() {
                return arg;
            }
            with_env(arg)
        })
    });
    // `replay` shares the relay's sink settings (`--sink`, credentials,
    // TLS files, ...), and reads them from the same variables; its own
    // flags (`--batch-size` is a page there) read none.
    let sink_ids: Vec<String> = <crate::sink_args::SinkArgs as clap::Args>::augment_args(Command::new("sink"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    cmd.mut_subcommand("replay", |replay| {
        replay.mut_args(|arg| {
            if !sink_ids.iter().any(|id| id == arg.get_id().as_str()) || arg.get_env().is_some() {
                return arg;
            }
            with_env(arg)
        })
    })
}

/// Parse the command line (exits with clap's message on a usage error or
/// for `--help`), then, for `relay`, read the config file and parse again
/// with its values as defaults.
///
/// # Errors
/// [`Error::Config`] naming the file and key for an unreadable file, bad
/// TOML, an unknown key or a wrong value.
pub(crate) fn load() -> Result<Loaded, Error> {
    let args: Vec<OsString> = std::env::args_os().collect();
    let cmd = command();
    let first = cmd.clone().get_matches_from(&args);
    let path = first.subcommand_matches("relay").and_then(|m| m.get_one::<PathBuf>("config")).cloned();
    let (cmd, file) = match path {
        None => (cmd, FileLayer::default()),
        Some(path) => {
            let file = read_file(&path, &cmd)?;
            (with_file_defaults(cmd, &file), file)
        }
    };
    let matches = cmd.clone().get_matches_from(&args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    Ok(Loaded { cli, matches, command: cmd, file })
}

fn relay_args(cmd: &Command) -> Vec<&Arg> {
    cmd.get_subcommands()
        .find(|s| s.get_name() == "relay")
        .map(|s| s.get_arguments().filter(|a| !NOT_SETTINGS.contains(&a.get_id().as_str())).collect())
        .unwrap_or_default()
}

fn database_arg(cmd: &Command) -> Option<&Arg> {
    cmd.get_arguments().find(|a| a.get_id() == DATABASE_URL)
}

/// Whether an argument is a flag (no value: `--no-listen`).
fn is_flag(arg: &Arg) -> bool {
    !arg.get_action().takes_values()
}

/// Whether an argument takes a number (so a file must give it as a TOML
/// number, not a string).
fn is_numeric(arg: &Arg) -> bool {
    use std::any::TypeId;
    let id = arg.get_value_parser().type_id();
    [
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i8>(),
        TypeId::of::<i16>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
        TypeId::of::<isize>(),
        TypeId::of::<f32>(),
        TypeId::of::<f64>(),
    ]
    .iter()
    .any(|t| id == *t)
}

/// Whether an argument may be given several times.
fn is_repeatable(arg: &Arg) -> bool {
    matches!(arg.get_action(), clap::ArgAction::Append)
}

/// The file keys of an argument: its long name and aliases, with `-` or `_`.
fn keys_of(arg: &Arg) -> Vec<String> {
    let mut names: Vec<&str> = arg.get_long().into_iter().collect();
    names.extend(arg.get_all_aliases().unwrap_or_default());
    names.iter().flat_map(|n| [n.to_string(), n.replace('-', "_")]).collect()
}

fn file_error(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Config(format!("config file {}: {msg}", path.display()))
}

/// Read and check a config file against the relay's arguments.
fn read_file(path: &Path, cmd: &Command) -> Result<FileLayer, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, format!("cannot read: {e}")))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let msg = e.message().to_string();
        match e.span() {
            Some(span) => {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                file_error(path, format!("invalid TOML at line {line}: {msg}"))
            }
            None => file_error(path, format!("invalid TOML: {msg}")),
        }
    })?;
    let mut args: Vec<&Arg> = relay_args(cmd);
    args.extend(database_arg(cmd));
    let mut values = BTreeMap::new();
    for (key, value) in &table {
        let Some(arg) = args.iter().find(|a| keys_of(a).iter().any(|k| k == key)) else {
            let mut known: Vec<String> = args
                .iter()
                .filter(|a| !a.is_hide_set())
                .filter_map(|a| a.get_long())
                .map(|l| l.replace('-', "_"))
                .collect();
            known.sort();
            return Err(file_error(path, format!("unknown key `{key}` (known keys: {})", known.join(", "))));
        };
        let id = arg.get_id().as_str().to_string();
        if values.contains_key(&id) {
            return Err(file_error(path, format!("key `{key}` is set twice (under two spellings)")));
        }
        let strings = file_values(path, key, arg, value)?;
        check_values(path, key, arg, &strings)?;
        values.insert(id, strings);
    }
    Ok(FileLayer { path: Some(path.to_path_buf()), values })
}

/// A TOML value as the argument's textual values.
fn file_values(path: &Path, key: &str, arg: &Arg, value: &toml::Value) -> Result<Vec<String>, Error> {
    use toml::Value as V;
    if is_flag(arg) {
        return match value {
            V::Boolean(b) => Ok(vec![b.to_string()]),
            other => Err(file_error(path, format!("key `{key}` must be true or false, got {}", other.type_str()))),
        };
    }
    let numeric = is_numeric(arg);
    let scalar = |v: &V| -> Result<String, Error> {
        match v {
            V::String(s) if numeric => {
                Err(file_error(path, format!("key `{key}` must be a number, got a string ({})", V::String(s.clone()))))
            }
            V::String(s) => Ok(s.clone()),
            V::Integer(i) => Ok(i.to_string()),
            V::Float(f) => Ok(f.to_string()),
            V::Boolean(b) => Ok(b.to_string()),
            other => {
                Err(file_error(path, format!("key `{key}` must be a string or a number, got {}", other.type_str())))
            }
        }
    };
    match value {
        V::Array(items) if is_repeatable(arg) => items.iter().map(scalar).collect(),
        V::Array(_) => Err(file_error(path, format!("key `{key}` takes one value, not an array"))),
        v => Ok(vec![scalar(v)?]),
    }
}

/// Check values with the argument's own parser (a one-argument command).
fn check_values(path: &Path, key: &str, arg: &Arg, values: &[String]) -> Result<(), Error> {
    if is_flag(arg) {
        return Ok(());
    }
    let Some(long) = arg.get_long() else { return Ok(()) };
    let probe_arg = arg.clone().env(None::<&str>).required(false).global(false).default_values(Vec::<&str>::new());
    let probe = Command::new("config").no_binary_name(true).arg(probe_arg);
    let mut argv: Vec<String> = Vec::new();
    for v in values {
        argv.push(format!("--{long}={v}"));
    }
    probe.try_get_matches_from(argv).map(|_| ()).map_err(|e| {
        let text = e.to_string();
        let first = text.lines().next().unwrap_or("invalid value").trim_start_matches("error: ").to_string();
        file_error(path, format!("key `{key}`: {first}"))
    })
}

/// The command with the file's values as the arguments' defaults.
fn with_file_defaults(cmd: Command, file: &FileLayer) -> Command {
    let set = |arg: Arg| -> Arg {
        match file.values.get(arg.get_id().as_str()) {
            Some(v) => arg.default_values(v.clone()),
            None => arg,
        }
    };
    let cmd = if file.values.contains_key(DATABASE_URL) { cmd.mut_arg(DATABASE_URL, set) } else { cmd };
    cmd.mut_subcommand("relay", |relay| relay.mut_args(set))
}

/// Where a setting's value came from.
fn source(m: &ArgMatches, arg: &Arg, file: &FileLayer) -> String {
    let id = arg.get_id().as_str();
    match m.value_source(id) {
        Some(ValueSource::CommandLine) => "command line".to_string(),
        Some(ValueSource::EnvVariable) => {
            format!("environment ({})", arg.get_env().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default())
        }
        Some(ValueSource::DefaultValue) if file.values.contains_key(id) => match &file.path {
            Some(p) => format!("config file {}", p.display()),
            None => "config file".to_string(),
        },
        Some(_) => "default".to_string(),
        None if id == DATABASE_URL => "not set: libpq's PG* variables and defaults apply".to_string(),
        None if id == "partitions" => {
            format!("not set: {} with --mode partitioned", crate::cmd::relay::DEFAULT_PARTITIONS)
        }
        None => "not set".to_string(),
    }
}

/// The effective relay settings as TOML, each with its source as a comment,
/// secrets redacted. Feeding the output back as `--config` gives the same
/// settings (redacted secrets aside).
pub(crate) fn render(loaded: &Loaded) -> String {
    let Some(m) = loaded.matches.subcommand_matches("relay") else { return String::new() };
    let mut out = String::from(
        "# pg-outbox relay: effective settings (precedence: command line > environment > config file > default)\n",
    );
    let mut args: Vec<&Arg> = database_arg(&loaded.command).into_iter().collect();
    args.extend(relay_args(&loaded.command));
    for arg in args {
        let id = arg.get_id().as_str();
        let key = arg.get_long().map(|l| l.replace('-', "_")).unwrap_or_else(|| id.to_string());
        let raw = printed(m, id);
        let src = source(m, arg, &loaded.file);
        let line = if raw.is_empty() {
            format!("# {key} =")
        } else if is_flag(arg) {
            let on = raw.last().is_some_and(|v| v == "true");
            format!("{key} = {on}")
        } else if is_repeatable(arg) {
            let items: Vec<String> = raw.into_iter().map(|v| toml::Value::String(v).to_string()).collect();
            format!("{key} = [{}]", items.join(", "))
        } else {
            let v = raw.into_iter().last().unwrap_or_default();
            match v.parse::<i64>() {
                Ok(n) if n.to_string() == v => format!("{key} = {n}"),
                _ => format!("{key} = {}", toml::Value::String(v)),
            }
        };
        out.push_str(&format!("{line:<60} # {src}\n"));
    }
    out
}

/// A setting's values as `--print-config` prints them: a value of a
/// secret type ([`pg_outbox::secret::Secret`], [`pg_outbox::secret::SecretUrl`],
/// [`pg_outbox::DatabaseUrl`], a webhook header, a Kafka property) as its
/// `Display` form, which masks; any other value as given.
fn printed(m: &ArgMatches, id: &str) -> Vec<String> {
    /// The values of `id` if they are of type `T`, as `T` displays them.
    fn typed<T: std::fmt::Display + Clone + Send + Sync + 'static>(m: &ArgMatches, id: &str) -> Option<Vec<String>> {
        let values = m.try_get_many::<T>(id).ok()?;
        Some(values.map(|vs| vs.map(ToString::to_string).collect()).unwrap_or_default())
    }
    let secret = typed::<pg_outbox::secret::Secret>(m, id)
        .or_else(|| typed::<pg_outbox::secret::SecretUrl>(m, id))
        .or_else(|| typed::<pg_outbox::DatabaseUrl>(m, id));
    #[cfg(feature = "webhook")]
    let secret = secret.or_else(|| typed::<pg_outbox::relay::HttpHeader>(m, id));
    #[cfg(feature = "kafka")]
    let secret = secret.or_else(|| typed::<pg_outbox::relay::KafkaProperty>(m, id));
    secret.unwrap_or_else(|| {
        m.get_raw(id).map(|vals| vals.map(|v| v.to_string_lossy().into_owned()).collect()).unwrap_or_default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_reads_the_sink_settings_from_the_relays_variables_and_nothing_else() {
        let cmd = command();
        let env_of = |sub: &str, id: &str| {
            cmd.get_subcommands()
                .find(|s| s.get_name() == sub)
                .and_then(|s| s.get_arguments().find(|a| a.get_id() == id))
                .and_then(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        };
        for id in ["sink", "sink_password", "sink_user", "sink_tls_ca_file"] {
            let want = Some(env_name(&id.replace('_', "-")));
            assert_eq!(env_of("relay", id), want, "relay --{id}");
            assert_eq!(env_of("replay", id), want, "replay --{id}");
        }
        assert_eq!(env_of("relay", "batch_size").as_deref(), Some("OUTBOX_BATCH_SIZE"));
        assert_eq!(env_of("replay", "batch_size"), None, "a replay page is not the relay's batch");
    }

    #[test]
    fn settings_of_secret_types_are_masked_whatever_their_name() {
        let cmd = command();
        let m = cmd.get_matches_from([
            "pg-outbox",
            "--database-url",
            "postgres://u:p#a/s@s@db:5432/app",
            "relay",
            "--sink",
            "nats://NATSTOKEN@127.0.0.1:4222",
            "--sink-password",
            "hunter2",
            "--sink-password-file",
            "/run/secrets/pw",
            "--webhook-secret",
            "whsec_abc",
            "--webhook-header",
            "Authorization: Bearer x",
            "--webhook-header",
            "X-Team: billing",
            "--kafka-option",
            "sasl.jaas.config=x y",
            "--kafka-option",
            "compression.type=zstd",
        ]);
        let relay = m.subcommand_matches("relay").expect("relay");
        let p = |id: &str| printed(relay, id);
        assert_eq!(p("database_url"), ["postgres://u:****@db:5432/app"]);
        assert_eq!(p("sink"), ["nats://****@127.0.0.1:4222"]);
        assert_eq!(p("sink_password"), ["****"]);
        assert_eq!(p("sink_password_file"), ["/run/secrets/pw"]);
        assert_eq!(p("webhook_secret"), ["****"]);
        assert_eq!(p("webhook_headers"), ["Authorization: ****", "X-Team: billing"]);
        assert_eq!(p("kafka_options"), ["sasl.jaas.config=****", "compression.type=zstd"]);
    }

    #[test]
    fn env_names_follow_flags() {
        assert_eq!(env_name("batch-size"), "OUTBOX_BATCH_SIZE");
        let cmd = command();
        let names: Vec<String> =
            relay_args(&cmd).iter().filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned())).collect();
        assert!(names.contains(&"OUTBOX_SINK".to_string()), "{names:?}");
        assert!(names.contains(&"OUTBOX_BATCH_SIZE".to_string()), "{names:?}");
        // Every relay setting has one.
        assert_eq!(names.len(), relay_args(&cmd).len(), "{names:?}");
    }
}

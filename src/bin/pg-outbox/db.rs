//! The database the commands work on: the URL as given, and the sessions
//! of the short commands.

use crate::error::Error;

/// The application name of the short commands' sessions (`migrate`,
/// `status`, `publish`, ...), unless the URL names them.
const CLI_SESSIONS: &str = "pg-outbox cli";

/// The connection string: `--database-url`, `DATABASE_URL` or
/// `OUTBOX_DATABASE_URL` (clap, then `config::command`); empty when none is
/// given, which [`pg_outbox::ConnectOptions::parse`] fills from the libpq
/// variables and defaults, as psql does.
pub(crate) fn database_url(cli: &Option<pg_outbox::DatabaseUrl>) -> String {
    cli.as_ref().map(|u| u.expose().to_string()).filter(|s| !s.trim().is_empty()).unwrap_or_default()
}

/// Resolve `url` (libpq's variables fill what it leaves out) and connect.
pub(crate) async fn connect(url: &str) -> Result<tokio_postgres::Client, Error> {
    Ok(options(url, CLI_SESSIONS)?.connect().await?)
}

/// `url` parsed, with libpq's variables and defaults for what it leaves
/// out; the sessions are named `application_name` unless the URL (or
/// `PGAPPNAME`) names them.
pub(crate) fn options(url: &str, application_name: &str) -> Result<pg_outbox::ConnectOptions, Error> {
    let opts = pg_outbox::ConnectOptions::parse(url)?;
    Ok(match opts.application_name() {
        Some(_) => opts,
        None => opts.with_application_name(application_name),
    })
}

/// How to name the database, for a failed connection with no URL given.
pub(crate) const NO_URL_HINT: &str = "hint: no database URL was given (--database-url, DATABASE_URL or \
OUTBOX_DATABASE_URL), so the libpq variables and defaults were used as psql uses them: set PGHOST, \
PGPORT, PGUSER, PGDATABASE (and PGPASSWORD or ~/.pgpass), or give a URL such as \
postgres://user@host:5432/dbname";

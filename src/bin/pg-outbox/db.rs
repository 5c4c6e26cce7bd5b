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

/// Connect to the database `db` names, as a short command's session
/// unless `db` names its sessions.
pub(crate) async fn connect(db: &pg_outbox::ConnectOptions) -> Result<tokio_postgres::Client, Error> {
    connect_with(db.clone()).await
}

/// [`connect`] on a server that accepts writes: a standby is refused in a
/// sentence that says what to do (see
/// [`pg_outbox::ConnectOptions::connect_primary`]).
pub(crate) async fn connect_primary(db: &pg_outbox::ConnectOptions) -> Result<tokio_postgres::Client, Error> {
    Ok(named(db.clone(), CLI_SESSIONS).connect_primary().await?)
}

/// Connect with `opts`, as a short command's session unless `opts` names
/// its sessions.
pub(crate) async fn connect_with(opts: pg_outbox::ConnectOptions) -> Result<tokio_postgres::Client, Error> {
    Ok(named(opts, CLI_SESSIONS).connect().await?)
}

/// `db` with its sessions named `application_name` unless the URL (or
/// `PGAPPNAME`) names them.
pub(crate) fn options(db: &pg_outbox::ConnectOptions, application_name: &str) -> pg_outbox::ConnectOptions {
    named(db.clone(), application_name)
}

/// `opts` with its sessions named `application_name` unless it names them.
fn named(opts: pg_outbox::ConnectOptions, application_name: &str) -> pg_outbox::ConnectOptions {
    match opts.application_name() {
        Some(_) => opts,
        None => opts.with_application_name(application_name),
    }
}

/// How to name the database, for a failed connection with no URL given.
pub(crate) const NO_URL_HINT: &str = "hint: no database URL was given (--database-url, DATABASE_URL or \
OUTBOX_DATABASE_URL), so the libpq variables and defaults were used as psql uses them: set PGHOST, \
PGPORT, PGUSER, PGDATABASE (and PGPASSWORD or ~/.pgpass), or give a URL such as \
postgres://user@host:5432/dbname";

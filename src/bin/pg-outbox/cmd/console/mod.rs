//! `pg-outbox console`: the operator console, served over HTTP.
//!
//! Pages: the overview (`/`), the dead letters (`/dead-letters`), one event
//! (`/events/{id}`); changes (retry, discard) go through a confirmation
//! page (`POST /dead-letters/confirm`, which changes nothing) to
//! `POST /dead-letters/apply`. [`guard`] says who may look and change.
//! Every figure comes from the library: [`pg_outbox::status`],
//! [`pg_outbox::console`], [`pg_outbox::dead_letters`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, NaiveDateTime, Utc};
use maud::Markup;
use pg_outbox::dead_letters::{self, Filter};
use tokio_postgres::Client;

use crate::error::Error;

mod chart;
mod guard;
mod pages;

use guard::{Admitted, Applying, ChangeAllowed, Confirming};

/// Dead letters per page.
const PAGE_SIZE: i64 = 50;
/// Events on each side of an event in its aggregate's timeline.
const TIMELINE_AROUND: i64 = 20;
/// Statement timeout of the console's session: a page never waits longer.
/// The overview's backlog figures in the background get longer (see
/// [`Figures`]).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(15);
/// Backlog figures that take at most this long (100 ms, the overview's own
/// target) are read for every overview; slower ones are served from the
/// last reading while the next one runs in the background.
const FIGURES_INLINE: Duration = Duration::from_millis(100);

#[derive(clap::Args, Debug)]
pub(crate) struct ConsoleArgs {
    /// Address to serve on: HOST:PORT, or a bare PORT on 127.0.0.1. A
    /// non-loopback address needs --console-token-file.
    #[arg(long, value_name = "[HOST:]PORT", default_value = "127.0.0.1:8080", value_parser = crate::parse::parse_metrics_addr)]
    addr: SocketAddr,
    /// File holding the console token (its first line; at least 16
    /// characters). With it, every page needs the token: the login form,
    /// or the X-Console-Token header (or Authorization: Bearer) for
    /// scripts.
    #[arg(long, value_name = "FILE")]
    console_token_file: Option<PathBuf>,
    /// Show, never change: no retry or discard buttons, and their requests
    /// are refused.
    #[arg(long)]
    read_only: bool,
    /// How often the overview reloads itself (e.g. 5s, 1m).
    #[arg(long, value_parser = crate::parse::parse_duration, default_value = "5s")]
    refresh: Duration,
}

/// The console's state: settings and the database session.
struct App {
    db: Db,
    token: Option<String>,
    /// The value of the session cookie the login form hands out (token mode).
    session: String,
    read_only: bool,
    refresh: Duration,
    figures: Figures,
}

/// The overview's backlog figures ([`pg_outbox::status`]), bounded whatever
/// the backlog (tens of milliseconds), but a slow server or link can still
/// make a reading slow. While a reading
/// takes at most [`FIGURES_INLINE`], every overview reads them afresh;
/// beyond that the overview shows the last reading (saying when it was
/// taken and how long it took) and, when it is older than the refresh
/// interval, starts the next one in the background: one at a time, and
/// only while someone looks.
#[derive(Default)]
struct Figures {
    last: std::sync::Mutex<Option<Reading>>,
    busy: std::sync::atomic::AtomicBool,
}

/// One reading of the backlog figures.
#[derive(Clone)]
pub(crate) struct Reading {
    pub(crate) status: Arc<pg_outbox::status::OutboxStatus>,
    /// When it started.
    pub(crate) at: std::time::Instant,
    /// How long it took.
    pub(crate) took: Duration,
    /// Served from an earlier reading.
    pub(crate) cached: bool,
}

impl Figures {
    fn last(&self) -> Option<Reading> {
        self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn store(&self, r: Reading) {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(r);
    }
}

/// Read the backlog figures on a session of their own (so a slow reading
/// does not hold up the pages).
async fn read_figures(opts: &pg_outbox::ConnectOptions) -> Result<Reading, Error> {
    let t = std::time::Instant::now();
    let c = opts.connect().await?;
    let status = pg_outbox::status::read(&c).await?;
    Ok(Reading { status: Arc::new(status), at: t, took: t.elapsed(), cached: false })
}

/// The figures for an overview: see [`Figures`].
async fn figures(app: &Arc<App>) -> Result<Reading, Error> {
    match app.figures.last() {
        Some(r) if r.took > FIGURES_INLINE => {
            if r.at.elapsed() >= app.refresh && !app.figures.busy.swap(true, std::sync::atomic::Ordering::AcqRel) {
                let app = app.clone();
                tokio::spawn(async move {
                    match read_figures(&app.db.opts).await {
                        Ok(r) => app.figures.store(r),
                        Err(e) => {
                            tracing::warn!(error = %pg_outbox::error::report(&e), "console: reading the backlog figures failed")
                        }
                    }
                    app.figures.busy.store(false, std::sync::atomic::Ordering::Release);
                });
            }
            Ok(Reading { cached: true, ..r })
        }
        _ => {
            let r = read_figures(&app.db.opts).await?;
            app.figures.store(r.clone());
            Ok(r)
        }
    }
}

/// One database session, opened again when it is lost.
struct Db {
    opts: pg_outbox::ConnectOptions,
    client: tokio::sync::Mutex<Option<Arc<Client>>>,
    /// The session retries and discards dead letters: on the primary (a
    /// standby is refused). A `--read-only` console reads a standby too.
    primary: bool,
}

impl Db {
    async fn client(&self) -> Result<Arc<Client>, Error> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref()
            && !c.is_closed()
        {
            return Ok(c.clone());
        }
        let c = if self.primary { self.opts.connect_primary().await? } else { self.opts.connect().await? };
        pg_outbox::console::set_statement_timeout(&c, STATEMENT_TIMEOUT).await?;
        let c = Arc::new(c);
        *slot = Some(c.clone());
        Ok(c)
    }
}

/// Read the token file: its first line, trimmed, at least 16 characters.
fn read_token(path: &std::path::Path) -> Result<String, Error> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("cannot read --console-token-file {}: {e}", path.display())))?;
    let token = text.lines().next().unwrap_or_default().trim().to_string();
    if token.chars().count() < 16 {
        return Err(Error::Config(format!(
            "--console-token-file {}: the token (its first line) must have at least 16 characters",
            path.display()
        )));
    }
    Ok(token)
}

/// The application name of the console's sessions, unless the URL names
/// them.
pub(crate) const SESSIONS: &str = "pg-outbox console";

/// Serve the console until SIGINT/SIGTERM, on sessions made by `opts`
/// (named [`SESSIONS`] by the caller unless the URL names them).
pub(crate) async fn run(opts: pg_outbox::ConnectOptions, args: ConsoleArgs) -> Result<(), Error> {
    let token = args.console_token_file.as_deref().map(read_token).transpose()?;
    if !args.addr.ip().is_loopback() && token.is_none() {
        return Err(Error::Usage(format!(
            "refusing to serve the console on {}, which is not a loopback address, without a token: \
             give --console-token-file FILE, or serve on 127.0.0.1",
            args.addr
        )));
    }
    // Its session keeps a statement timeout (a `SET`), which a
    // transaction-mode pooler would leave on server sessions other clients get.
    if let pg_outbox::SessionMode::Shared { evidence } = opts.session_mode().await? {
        let target = opts.describe();
        return Err(pg_outbox::Error::SharedSessions { what: "the console", target, evidence: evidence.into() }.into());
    }
    let db = Db { opts, client: tokio::sync::Mutex::new(None), primary: !args.read_only };
    // Fail fast on a wrong URL, a standby (unless read-only) or a missing schema.
    pg_outbox::status::read(&*db.client().await?).await?;
    let app = Arc::new(App {
        db,
        token,
        session: guard::fresh(),
        read_only: args.read_only,
        refresh: args.refresh,
        figures: Figures::default(),
    });
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .map_err(|e| Error::Config(format!("cannot serve the console on {}: {e}", args.addr)))?;
    let bound = listener.local_addr().map_err(|e| Error::Config(format!("console address: {e}")))?;
    tracing::info!(read_only = app.read_only, token = app.token.is_some(), "console serving on http://{bound}/");
    let router = Router::new()
        .route("/", get(overview))
        .route("/dead-letters", get(dead_letter_list))
        .route("/dead-letters/confirm", post(confirm))
        .route("/dead-letters/apply", post(apply))
        .route("/events/{id}", get(event_page))
        .route("/login", get(login_page).post(login))
        .route("/assets/console.css", get(css))
        .route("/assets/console.js", get(js))
        .fallback(not_found)
        .with_state(app);
    axum::serve(listener, router.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(crate::signals::shutdown_signal())
        .await
        .map_err(|e| Error::Config(format!("console server: {e}")))?;
    tracing::info!("console stopped");
    Ok(())
}

/// What every page needs of the request once it is let in.
pub(crate) struct Ctx {
    /// The CSRF value the forms carry.
    pub(crate) csrf: String,
    /// The CSRF cookie is new: set it with the response.
    new_csrf: bool,
    pub(crate) read_only: bool,
}

/// A finished page: status, body, and the cookie to set.
fn respond(status: StatusCode, ctx: Option<&Ctx>, body: Markup) -> Response {
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(ctx) = ctx
        && ctx.new_csrf
        && let Ok(v) = HeaderValue::from_str(&guard::set_cookie(guard::CSRF_COOKIE, &ctx.csrf))
    {
        h.append(header::SET_COOKIE, v);
    }
    r
}

fn refused(status: StatusCode, why: &str) -> Response {
    respond(status, None, pages::message("Refused", why))
}

fn redirect(to: &str, cookie: Option<String>) -> Response {
    let mut r = (StatusCode::SEE_OTHER, [(header::LOCATION, to.to_string())]).into_response();
    if let Some(c) = cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        r.headers_mut().append(header::SET_COOKIE, c);
    }
    r
}

/// Name/value pairs of a query string or a form body, repeated names kept.
pub(crate) struct Fields(Vec<(String, String)>);

impl Fields {
    pub(crate) fn parse(bytes: &[u8]) -> Fields {
        Fields(form_urlencoded::parse(bytes).into_owned().collect())
    }

    fn query(uri: &Uri) -> Fields {
        Fields::parse(uri.query().unwrap_or_default().as_bytes())
    }

    /// The first non-empty value of `name`.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, v)| k == name && !v.trim().is_empty()).map(|(_, v)| v.trim())
    }

    fn all(&self, name: &str) -> impl Iterator<Item = &str> {
        self.0.iter().filter(move |(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A dead-letter filter as the forms carry it (`event_type`,
/// `aggregate_type`, `error`, `since`), each field as typed.
#[derive(Debug, Default, Clone)]
pub(crate) struct FilterForm {
    pub(crate) event_type: String,
    pub(crate) aggregate_type: String,
    pub(crate) error: String,
    pub(crate) since: String,
}

impl FilterForm {
    fn from(f: &Fields) -> FilterForm {
        let v = |n: &str| f.get(n).unwrap_or_default().to_string();
        FilterForm {
            event_type: v("event_type"),
            aggregate_type: v("aggregate_type"),
            error: v("error"),
            since: v("since"),
        }
    }

    /// The library's filter, or what is wrong with `since`.
    fn filter(&self) -> Result<Filter, String> {
        let mut f = Filter::all();
        if !self.event_type.is_empty() {
            f = f.event_type(&self.event_type);
        }
        if !self.aggregate_type.is_empty() {
            f = f.aggregate_type(&self.aggregate_type);
        }
        if !self.error.is_empty() {
            f = f.error_contains(&self.error);
        }
        if !self.since.is_empty() {
            f = f.since(parse_time(&self.since)?);
        }
        Ok(f)
    }

    /// As a query string (for links to the next page).
    pub(crate) fn query(&self) -> String {
        form_urlencoded::Serializer::new(String::new())
            .append_pair("event_type", &self.event_type)
            .append_pair("aggregate_type", &self.aggregate_type)
            .append_pair("error", &self.error)
            .append_pair("since", &self.since)
            .finish()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.event_type.is_empty() && self.aggregate_type.is_empty() && self.error.is_empty() && self.since.is_empty()
    }
}

/// RFC 3339, or a browser's `datetime-local` value (`2026-12-02T03:15`,
/// seconds optional) read as UTC.
fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    for fmt in ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, fmt) {
            return Ok(t.and_utc());
        }
    }
    Err(format!("'{s}' is not a time: write e.g. 2026-12-02T03:15 (UTC) or 2026-12-02T03:15:00+01:00"))
}

fn db_error(ctx: &Ctx, e: &Error) -> Response {
    tracing::error!(error = %pg_outbox::error::report(e), "console: a page failed");
    respond(StatusCode::INTERNAL_SERVER_ERROR, Some(ctx), pages::error(ctx, &pg_outbox::error::report(e)))
}

async fn overview(State(app): State<Arc<App>>, Admitted(ctx): Admitted) -> Response {
    // The backlog figures (on a session of their own) beside the relays and
    // the chart: the page waits for the slower, not for both.
    let rest = async {
        let c = app.db.client().await?;
        let relays = pg_outbox::console::relays(&*c).await?;
        let chart = pg_outbox::console::delivery_chart(&*c, pg_outbox::console::DEFAULT_CHART_ROWS).await?;
        Ok::<_, Error>((relays, chart))
    };
    let read = async {
        let (status, (relays, chart)) = tokio::try_join!(figures(&app), rest)?;
        Ok::<_, Error>((status, relays, chart))
    };
    match read.await {
        Ok((status, relays, chart)) => {
            respond(StatusCode::OK, Some(&ctx), pages::overview(&ctx, &status, &relays, &chart, app.refresh))
        }
        Err(e) => db_error(&ctx, &e),
    }
}

async fn dead_letter_list(State(app): State<Arc<App>>, Admitted(ctx): Admitted, uri: Uri) -> Response {
    let q = Fields::query(&uri);
    let form = FilterForm::from(&q);
    let filter = match form.filter() {
        Ok(f) => f,
        Err(why) => {
            return respond(StatusCode::BAD_REQUEST, Some(&ctx), pages::dead_letters(&ctx, &form, None, Some(&why)));
        }
    };
    let after: i64 = q.get("after").and_then(|a| a.parse().ok()).unwrap_or(0).max(0);
    let read = async {
        let c = app.db.client().await?;
        let rows = pg_outbox::console::dead_letter_page(&*c, &filter, after, PAGE_SIZE + 1).await?;
        let total = dead_letters::count(&*c, &filter).await?;
        Ok::<_, Error>((rows, total))
    };
    match read.await {
        Ok((mut rows, total)) => {
            let more = rows.len() > PAGE_SIZE as usize;
            rows.truncate(PAGE_SIZE as usize);
            let page = pages::DeadLetterPage { rows, total, after, more };
            respond(StatusCode::OK, Some(&ctx), pages::dead_letters(&ctx, &form, Some(&page), None))
        }
        Err(e) => db_error(&ctx, &e),
    }
}

async fn event_page(State(app): State<Arc<App>>, Path(id): Path<String>, Admitted(ctx): Admitted) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return respond(StatusCode::NOT_FOUND, Some(&ctx), pages::message("Not found", "An event id is a number."));
    };
    let read = async {
        let c = app.db.client().await?;
        let Some(detail) = pg_outbox::console::event(&*c, id).await? else { return Ok(None) };
        let timeline = pg_outbox::console::timeline(&*c, &detail.event, TIMELINE_AROUND).await?;
        Ok::<_, Error>(Some((detail, timeline)))
    };
    match read.await {
        Ok(Some((detail, timeline))) => respond(StatusCode::OK, Some(&ctx), pages::event(&ctx, &detail, &timeline)),
        Ok(None) => respond(
            StatusCode::NOT_FOUND,
            Some(&ctx),
            pages::message("Not found", &format!("There is no event {id} in events.outbox.")),
        ),
        Err(e) => db_error(&ctx, &e),
    }
}

/// Retry or discard, as the forms name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Retry,
    Discard,
}

impl Action {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Action::Retry => "retry",
            Action::Discard => "discard",
        }
    }
}

/// What a change applies to: the ids ticked, or all that match a filter.
pub(crate) struct Target {
    pub(crate) action: Action,
    /// `Some(ids)` for the ids ticked; `None` for all matching `form`.
    pub(crate) ids: Option<Vec<i64>>,
    pub(crate) form: FilterForm,
    filter: Filter,
}

fn target(f: &Fields) -> Result<Target, String> {
    // A button sends `op=ACTION:SCOPE`; the confirmation form sends both.
    let (action, scope) = match f.get("op").and_then(|op| op.split_once(':')) {
        Some((a, s)) => (Some(a), Some(s)),
        None => (f.get("action"), f.get("scope")),
    };
    let action = match action {
        Some("retry") => Action::Retry,
        Some("discard") => Action::Discard,
        _ => return Err("the request names no action (retry or discard)".into()),
    };
    let form = FilterForm::from(f);
    match scope {
        Some("all") => {
            let filter = form.filter()?;
            Ok(Target { action, ids: None, form, filter })
        }
        _ => {
            let mut ids = f
                .all("id")
                .map(|i| i.trim().parse::<i64>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| "an id is not a number".to_string())?;
            ids.sort_unstable();
            ids.dedup();
            if ids.is_empty() {
                return Err(
                    "no dead letter is selected: tick at least one, or use the buttons for all that match".into()
                );
            }
            Ok(Target { action, filter: Filter::ids(ids.clone()), ids: Some(ids), form })
        }
    }
}

async fn confirm(State(app): State<Arc<App>>, change: ChangeAllowed<Confirming>) -> Response {
    let ChangeAllowed { ctx, form: f, .. } = change;
    let t = match target(&f) {
        Ok(t) => t,
        Err(why) => return respond(StatusCode::BAD_REQUEST, Some(&ctx), pages::message("Nothing to do", &why)),
    };
    let read = async {
        let c = app.db.client().await?;
        let count = dead_letters::count(&*c, &t.filter).await?;
        let sample = dead_letters::list(&*c, &t.filter.clone().limit(20)).await?;
        Ok::<_, Error>((count, sample))
    };
    match read.await {
        Ok((count, sample)) => respond(StatusCode::OK, Some(&ctx), pages::confirm(&ctx, &t, count, &sample)),
        Err(e) => db_error(&ctx, &e),
    }
}

async fn apply(
    State(app): State<Arc<App>>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    change: ChangeAllowed<Applying>,
) -> Response {
    let ChangeAllowed { ctx, form: f, .. } = change;
    let mut t = match target(&f) {
        Ok(t) => t,
        Err(why) => return respond(StatusCode::BAD_REQUEST, Some(&ctx), pages::message("Nothing to do", &why)),
    };
    // "All that match" never touches more than the confirmation counted
    // (the oldest ids first, so dead letters that arrived since are left).
    if t.ids.is_none() {
        let Some(expected) = f.get("expected").and_then(|e| e.parse::<i64>().ok()).filter(|e| *e >= 0) else {
            return respond(
                StatusCode::BAD_REQUEST,
                Some(&ctx),
                pages::message("Nothing to do", "The request lacks the confirmed count: confirm again."),
            );
        };
        t.filter = t.filter.clone().limit(expected);
    }
    let run = async {
        let c = app.db.client().await?;
        Ok::<_, Error>(match t.action {
            Action::Retry => dead_letters::retry(&*c, &t.filter).await?,
            Action::Discard => dead_letters::discard(&*c, &t.filter).await?,
        })
    };
    match run.await {
        Ok(ids) => {
            tracing::info!(
                action = t.action.name(),
                count = ids.len(),
                ids = %summary(&ids),
                scope = if t.ids.is_some() { "selected" } else { "all matching" },
                filter = %if t.ids.is_some() { String::new() } else { t.form.query() },
                from = %from,
                "console: dead letters changed"
            );
            respond(StatusCode::OK, Some(&ctx), pages::applied(&ctx, t.action, &ids))
        }
        Err(e) => db_error(&ctx, &e),
    }
}

/// Ids for a log line: all of them up to 20, then the count left out.
fn summary(ids: &[i64]) -> String {
    let shown: Vec<String> = ids.iter().take(20).map(i64::to_string).collect();
    match ids.len() {
        n if n > 20 => format!("{} and {} more", shown.join(","), n - 20),
        _ => shown.join(","),
    }
}

async fn login_page(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let Some(_) = &app.token else { return redirect("/", None) };
    let (csrf, new_csrf) = match guard::cookie(&headers, guard::CSRF_COOKIE).filter(|c| c.len() >= 16) {
        Some(c) => (c, false),
        None => (guard::fresh(), true),
    };
    let ctx = Ctx { csrf, new_csrf, read_only: app.read_only };
    respond(StatusCode::OK, Some(&ctx), pages::login(&ctx, None))
}

async fn login(
    State(app): State<Arc<App>>,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(token) = &app.token else { return redirect("/", None) };
    let f = Fields::parse(&body);
    let cookie = guard::cookie(&headers, guard::CSRF_COOKIE).unwrap_or_default();
    if !guard::same_origin(&headers) || cookie.len() < 16 || !guard::same(&cookie, f.get("csrf").unwrap_or_default()) {
        return refused(StatusCode::FORBIDDEN, "This login comes from another origin or lacks the form's CSRF token.");
    }
    if !f.get("token").is_some_and(|t| guard::same(t, token)) {
        tracing::warn!(from = %from, "console: a login with a wrong token");
        let ctx = Ctx { csrf: cookie, new_csrf: false, read_only: app.read_only };
        return respond(StatusCode::UNAUTHORIZED, Some(&ctx), pages::login(&ctx, Some("Wrong token.")));
    }
    tracing::info!(from = %from, "console: logged in");
    redirect("/", Some(guard::set_cookie(guard::SESSION_COOKIE, &app.session)))
}

async fn css() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], include_str!("console.css")).into_response()
}

async fn js() -> Response {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], include_str!("console.js")).into_response()
}

async fn not_found() -> Response {
    refused(StatusCode::NOT_FOUND, "No such page.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_browsers_send_them() {
        assert_eq!(parse_time("2026-12-02T03:15").map(|t| t.to_rfc3339()), Ok("2026-12-02T03:15:00+00:00".into()));
        assert_eq!(
            parse_time("2026-12-02T03:15:00+01:00").map(|t| t.to_rfc3339()),
            Ok("2026-12-02T02:15:00+00:00".into())
        );
        assert!(parse_time("yesterday").is_err_and(|e| e.contains("'yesterday' is not a time")));
    }

    #[test]
    fn targets_need_an_action_and_ids_or_all() {
        let t = target(&Fields::parse(b"action=retry&id=3&id=1&id=3")).expect("ids");
        assert_eq!((t.action, t.ids), (Action::Retry, Some(vec![1, 3])));
        let t = target(&Fields::parse(b"action=discard&scope=all&event_type=A")).expect("all");
        assert_eq!((t.action, t.ids.is_none(), t.form.event_type.as_str()), (Action::Discard, true, "A"));
        assert!(target(&Fields::parse(b"action=retry")).is_err());
        assert!(target(&Fields::parse(b"id=1")).is_err());
        assert!(target(&Fields::parse(b"action=retry&id=x")).is_err());
        let t = target(&Fields::parse(b"op=discard%3Aselected&id=7")).expect("op");
        assert_eq!((t.action, t.ids), (Action::Discard, Some(vec![7])));
    }

    #[test]
    fn short_tokens_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("t");
        std::fs::write(&p, "short\n").expect("write");
        assert!(read_token(&p).is_err_and(|e| e.to_string().contains("at least 16")));
        std::fs::write(&p, "  0123456789abcdef  \nignored\n").expect("write");
        assert_eq!(read_token(&p).expect("token"), "0123456789abcdef");
    }
}

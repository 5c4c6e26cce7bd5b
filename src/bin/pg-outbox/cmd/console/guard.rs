//! Who may look and who may change: the console token, the session cookie
//! it buys, the CSRF cookie and field, the Origin and Host checks.
//!
//! - Without a token (loopback only), anyone who can reach the port may
//!   look; a change needs a POST whose `csrf` field equals the `pgo_csrf`
//!   cookie (`SameSite=Strict`, `HttpOnly`), from the console's own origin.
//!   The Host header must name a loopback address, so a page on another
//!   name that resolves to 127.0.0.1 (DNS rebinding) gets nothing.
//! - With a token, every request needs it: the `X-Console-Token` header
//!   (or `Authorization: Bearer`), or the `pgo_session` cookie that the
//!   login form sets after checking it. A change needs, in addition, the
//!   CSRF field (or the token header, which no other site can send).
//!
//! Handlers ask for these rules by their arguments: [`Admitted`] for a
//! page, [`ChangeAllowed`] for a change (retry, discard), which axum
//! extracts before the handler runs, answering a refusal itself.

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::{App, Ctx, Fields, redirect, refused};

/// Name of the CSRF cookie (double submit: the forms carry its value).
pub(crate) const CSRF_COOKIE: &str = "pgo_csrf";
/// Name of the session cookie set by the login form (token mode).
pub(crate) const SESSION_COOKIE: &str = "pgo_session";
/// Header carrying the token, for scripts.
pub(crate) const TOKEN_HEADER: &str = "x-console-token";

/// Equality that takes as long for every input of one length.
pub(crate) fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The value of cookie `name`, if the request has it.
pub(crate) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// The token the request carries in a header, if any.
pub(crate) fn header_token(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()) {
        return Some(v.trim().to_string());
    }
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|v| v.trim().to_string())
}

/// A host name (the Host header without its port) that names this machine.
pub(crate) fn loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether the request comes from the console's own pages: its `Origin`
/// (or, without one, `Sec-Fetch-Site`) must be this host. A request with
/// neither (a script) passes this check and must prove itself otherwise.
pub(crate) fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if let Some(origin) = headers.get(header::ORIGIN) {
        let Ok(origin) = origin.to_str() else { return false };
        return !host.is_empty() && (origin == format!("http://{host}") || origin == format!("https://{host}"));
    }
    match headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        Some(site) => site == "same-origin" || site == "none",
        None => true,
    }
}

/// A request let in ([`admit`]), with what its page needs. A refusal is
/// answered for the handler: a GET (or HEAD) without the token goes to the
/// login form.
pub(crate) struct Admitted(pub(crate) Ctx);

impl FromRequestParts<Arc<App>> for Admitted {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<App>) -> Result<Self, Response> {
        // The console's pages are GET routes, its changes POST routes.
        let is_get = parts.method != Method::POST;
        admit(app, &parts.headers, is_get).map(Admitted).map_err(|r| *r)
    }
}

/// What a change request leads to: [`Confirming`] changes nothing yet,
/// [`Applying`] changes dead letters and logs a refused request.
pub(crate) trait ChangeStep {
    /// Whether a refused request is logged (with its peer address).
    const LOG_REFUSAL: bool;
}

/// The confirmation page of a change.
pub(crate) struct Confirming;

impl ChangeStep for Confirming {
    const LOG_REFUSAL: bool = false;
}

/// The change itself.
pub(crate) struct Applying;

impl ChangeStep for Applying {
    const LOG_REFUSAL: bool = true;
}

/// A change request let in ([`admit`]) and allowed ([`check_change`]),
/// with its form.
pub(crate) struct ChangeAllowed<S> {
    pub(crate) ctx: Ctx,
    pub(crate) form: Fields,
    step: PhantomData<fn() -> S>,
}

impl<S: ChangeStep> FromRequest<Arc<App>> for ChangeAllowed<S> {
    type Rejection = Response;

    async fn from_request(req: Request, app: &Arc<App>) -> Result<Self, Response> {
        let headers = req.headers().clone();
        let from = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
        let body = Bytes::from_request(req, app).await.map_err(IntoResponse::into_response)?;
        let ctx = admit(app, &headers, false).map_err(|r| *r)?;
        let form = Fields::parse(&body);
        if let Err(r) = check_change(app, &headers, &form) {
            if S::LOG_REFUSAL
                && let Some(from) = from
            {
                tracing::warn!(from = %from, "console: a change was refused");
            }
            return Err(*r);
        }
        Ok(ChangeAllowed { ctx, form, step: PhantomData })
    }
}

/// Let the request in, or say why not: the Host check (no token), the
/// token (token mode). GETs without the token go to the login form.
fn admit(app: &App, headers: &HeaderMap, is_get: bool) -> Result<Ctx, Box<Response>> {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if app.token.is_none() && !loopback_host(host) {
        return Err(Box::new(refused(
            StatusCode::FORBIDDEN,
            "This console answers only to a loopback host name (127.0.0.1, localhost, [::1]) unless it runs with a token.",
        )));
    }
    if let Some(token) = &app.token {
        let by_header = header_token(headers).is_some_and(|t| same(&t, token));
        let by_cookie = cookie(headers, SESSION_COOKIE).is_some_and(|s| same(&s, &app.session));
        if !by_header && !by_cookie {
            return Err(Box::new(if is_get {
                redirect("/login", None)
            } else {
                refused(StatusCode::UNAUTHORIZED, "This request needs the console token.")
            }));
        }
    }
    let (csrf, new_csrf) = match cookie(headers, CSRF_COOKIE).filter(|c| c.len() >= 16) {
        Some(c) => (c, false),
        None => (fresh(), true),
    };
    Ok(Ctx { csrf, new_csrf, read_only: app.read_only })
}

/// A change may go on: not read-only, from the console's own origin, and
/// with the CSRF field matching its cookie (or the token header).
fn check_change(app: &App, headers: &HeaderMap, form: &Fields) -> Result<(), Box<Response>> {
    if app.read_only {
        return Err(Box::new(refused(StatusCode::FORBIDDEN, "This console is read-only (--read-only).")));
    }
    if !same_origin(headers) {
        return Err(Box::new(refused(StatusCode::FORBIDDEN, "This request comes from another origin.")));
    }
    if let Some(token) = &app.token
        && header_token(headers).is_some_and(|t| same(&t, token))
    {
        return Ok(());
    }
    let cookie = cookie(headers, CSRF_COOKIE).unwrap_or_default();
    let field = form.get("csrf").unwrap_or_default();
    if cookie.len() < 16 || !same(&cookie, field) {
        return Err(Box::new(refused(
            StatusCode::FORBIDDEN,
            "This request lacks the form's CSRF token: reload the page and try again.",
        )));
    }
    Ok(())
}

/// A fresh random value for a cookie (122 random bits).
pub(crate) fn fresh() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// A `Set-Cookie` value: `HttpOnly`, `SameSite=Strict`, the whole site.
pub(crate) fn set_cookie(name: &str, value: &str) -> String {
    format!("{name}={value}; Path=/; HttpOnly; SameSite=Strict")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_told_from_others() {
        for h in ["127.0.0.1:8080", "localhost:1", "[::1]:8080", "LOCALHOST", "127.0.0.2:80"] {
            assert!(loopback_host(h), "{h}");
        }
        for h in ["evil.example:8080", "10.0.0.1:8080", "[::2]:1", "localhost.evil.example:80", ""] {
            assert!(!loopback_host(h), "{h}");
        }
    }

    #[test]
    fn origin_must_be_the_host() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:8080".parse().expect("header"));
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "http://127.0.0.1:8080".parse().expect("header"));
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "http://evil.example".parse().expect("header"));
        assert!(!same_origin(&h));
        h.insert(header::ORIGIN, "null".parse().expect("header"));
        assert!(!same_origin(&h));
        h.remove(header::ORIGIN);
        h.insert("sec-fetch-site", "cross-site".parse().expect("header"));
        assert!(!same_origin(&h));
    }

    #[test]
    fn cookies_and_tokens_are_read() {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, "a=1; pgo_csrf=abc; b=2".parse().expect("header"));
        assert_eq!(cookie(&h, CSRF_COOKIE).as_deref(), Some("abc"));
        assert_eq!(cookie(&h, SESSION_COOKIE), None);
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().expect("header"));
        assert_eq!(header_token(&h).as_deref(), Some("s3cret"));
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
    }
}

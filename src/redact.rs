//! Keeping secrets out of what pg-outbox prints, logs and stores.
//!
//! Every URL or connection string pg-outbox is given may hold a secret: a
//! password or a token in `user:password@`, a lone token as the user part
//! (`nats://TOKEN@host`), `password=...` in a query or a libpq key=value
//! string, an API key in a webhook's query string. Three kinds of redaction
//! keep them out, each for its own place:
//!
//! | kind | result | for | functions |
//! |---|---|---|---|
//! | mask | each secret replaced by `****`, everything else kept | printed settings (`pg-outbox relay --print-config`) | [`redact_password`], [`redact_database_url`], [`redact_sink`] |
//! | strip | scheme, host, port and path only: no credentials, no query string or fragment | logs, error messages, sink names | [`redact_spec`], [`redact_url`] |
//! | scrub | a text with the secrets of a spec replaced by `***` | error messages of client libraries that may quote the URL | [`scrub`] |
//!
//! Which to use:
//! - **Mask** when a person reads the value back to check a setting: the
//!   user names, hosts and the shape of the value stay visible (and the
//!   output can be fed back as a config file, secrets aside). Masking keeps
//!   user names, and [`redact_password`] keeps every query parameter but
//!   `password`, so a masked value is not for logs.
//! - **Strip** for anything written to logs, error messages or the outbox
//!   table (`last_error`): the host is all an operator needs there, and
//!   nothing that might be a secret survives.
//! - **Scrub** text that pg-outbox did not write itself (a client library's
//!   error) before it goes into a message beside a stripped name: the
//!   library may have quoted the URL, password included.
//!
//! Of the masks, [`redact_password`] is the general one (any URL or libpq
//! string); [`redact_database_url`] also masks a password holding `?`, `#`,
//! `/` or `@`, as a database URL typed by hand may; [`redact_sink`] knows
//! comma-separated broker lists and masks whole query strings.

/// What a masked secret is shown as.
const MASK: &str = "****";

/// A secret a sink needs (a password, a token, an NKey seed, a NATS
/// credentials file's contents): its `Debug` shows `Secret(****)`, so a
/// settings struct that holds one can be logged or printed safely. The
/// value is read only through [`Secret::expose`].
///
/// # Example
/// ```
/// use pg_outbox::relay::Secret;
/// let s = Secret::new("hunter2");
/// assert_eq!(format!("{s:?}"), "Secret(****)");
/// assert_eq!(s.expose(), "hunter2");
/// ```
#[cfg(feature = "relay")]
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

#[cfg(feature = "relay")]
impl Secret {
    /// Wrap `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself, for the client library that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

#[cfg(feature = "relay")]
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({MASK})")
    }
}

#[cfg(feature = "relay")]
impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

#[cfg(feature = "relay")]
impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Secret(value.to_string())
    }
}

/// Whether a librdkafka property (`--kafka-option KEY=VALUE`) may hold a
/// secret, so its value is masked when printed: `sasl.password`,
/// `ssl.key.password`, `ssl.key.pem`, `sasl.jaas.config`,
/// `sasl.oauthbearer.client.secret`, `sasl.oauthbearer.config` and the like.
#[cfg(feature = "relay")]
pub fn is_secret_property(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["password", "secret", "jaas", "token", "key", "oauthbearer.config", "credential", ".pem"]
        .iter()
        .any(|s| k.contains(s))
}

/// Mask passwords in a URL or connection string, for printed settings:
/// `scheme://user:****@host/...` (the userinfo password of any URL), and
/// `password=****` in query strings and libpq key=value strings.
///
/// # Example
/// ```
/// assert_eq!(pg_outbox::redact_password("amqp://app:pw@mq:5672/%2f"), "amqp://app:****@mq:5672/%2f");
/// assert_eq!(pg_outbox::redact_password("host=db password='p w' user=u"), "host=db password=**** user=u");
/// ```
pub fn redact_password(value: &str) -> String {
    let mut s = value.to_string();
    if let Some(scheme_end) = s.find("://") {
        let rest_start = scheme_end + 3;
        let authority_end = s[rest_start..].find(['/', '?', '#']).map_or(s.len(), |i| rest_start + i);
        if let Some(at) = s[rest_start..authority_end].rfind('@') {
            let userinfo = &s[rest_start..rest_start + at];
            if let Some(colon) = userinfo.find(':') {
                s.replace_range(rest_start + colon + 1..rest_start + at, MASK);
            }
        }
    }
    // password=... in a query string or a key=value string.
    let mut out = String::with_capacity(s.len());
    let mut rest = s.as_str();
    while let Some(i) = rest.find("password") {
        let (before, after) = rest.split_at(i + "password".len());
        out.push_str(before);
        let trimmed = after.trim_start();
        if let Some(value) = trimmed.strip_prefix('=') {
            out.push_str(&after[..after.len() - trimmed.len()]);
            out.push('=');
            let value_trim = value.trim_start();
            out.push_str(&value[..value.len() - value_trim.len()]);
            let end = if let Some(q) = value_trim.strip_prefix('\'') {
                let mut j = 0;
                let b = q.as_bytes();
                while j < b.len() && b[j] != b'\'' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                (j + 2).min(value_trim.len())
            } else {
                value_trim.find(|c: char| c.is_whitespace() || c == '&').unwrap_or(value_trim.len())
            };
            out.push_str(MASK);
            rest = &value_trim[end..];
        } else {
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// A database URL with its password masked however it is written: in a
/// URL that parses, everything between `user:` and the last `@` (so a
/// password holding `?`, `#`, `/` or `@` is masked whole); in one that does
/// not, everything between `://` and the last `@`; then `password=...` in
/// a query string or a libpq key=value string (as [`redact_password`]).
/// A value without `://` or without `@` gets [`redact_password`] alone.
///
/// # Example
/// ```
/// use pg_outbox::redact_database_url;
/// assert_eq!(redact_database_url("postgres://u:p#a/s@s@db:5432/app"), "postgres://u:****@db:5432/app");
/// assert_eq!(redact_database_url("host=db password=x user=u"), "host=db password=**** user=u");
/// ```
pub fn redact_database_url(value: &str) -> String {
    let Some((scheme, rest)) = value.split_once("://") else { return redact_password(value) };
    let Some(at) = rest.rfind('@') else { return redact_password(value) };
    let (userinfo, host) = rest.split_at(at);
    let masked = if crate::connect::parses(value) {
        match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:{MASK}{host}"),
            None => value.to_string(),
        }
    } else {
        format!("{scheme}://{MASK}{host}")
    };
    redact_password(&masked)
}

/// `spec` (a `--sink` value) with every secret masked as `****`, keeping
/// everything else readable, for printed settings: in each URL of a
/// comma-separated list (`nats://a:pw@h1,nats://b:pw@h2`) and each host of
/// a multi-host authority, the password of `user:password@` (or the whole
/// user part when it has no password: a token), and any query string or
/// fragment (`?****`, `#****`).
///
/// The credentials end at the last `@` of a URL, so a password holding an
/// unencoded `/`, `?` or `#` is masked too; an `@` in a path or query makes
/// it mask more than needed, never less.
///
/// # Example
/// ```
/// # #[cfg(feature = "relay")] {
/// use pg_outbox::relay::redact_sink;
/// assert_eq!(redact_sink("nats://tok@h:4222"), "nats://****@h:4222");
/// assert_eq!(redact_sink("amqp://app:pw@mq:5672/%2f"), "amqp://app:****@mq:5672/%2f");
/// assert_eq!(redact_sink("https://h/hook?api_key=k"), "https://h/hook?****");
/// # }
/// ```
#[cfg_attr(not(feature = "relay"), allow(dead_code, unreachable_pub))]
pub fn redact_sink(spec: &str) -> String {
    // Group the comma-separated parts into URLs: a part with a scheme starts
    // one; a part without continues the previous one (more hosts, or a
    // comma inside a path or query).
    let mut urls: Vec<String> = Vec::new();
    for part in spec.split(',') {
        match urls.last_mut() {
            Some(last) if !has_scheme(part) => {
                last.push(',');
                last.push_str(part);
            }
            _ => urls.push(part.to_string()),
        }
    }
    urls.iter()
        .map(|url| {
            let (scheme, rest) = match url.split_once("://") {
                Some((s, r)) => (format!("{s}://"), r),
                None => (String::new(), url.as_str()),
            };
            // The authority ends at the first `/`, `?` or `#` after the last `@`.
            let from = rest.rfind('@').map_or(0, |i| i + 1);
            let end = rest[from..].find(['/', '?', '#']).map_or(rest.len(), |i| from + i);
            let (authority, tail) = rest.split_at(end);
            let authority = mask_authority(authority, MASK);
            let (path, query, fragment) = match tail.find(['?', '#']) {
                Some(i) => {
                    let after = &tail[i..];
                    (&tail[..i], after.starts_with('?'), after.contains('#'))
                }
                None => (tail, false, false),
            };
            let mut out = format!("{scheme}{authority}{path}");
            if query {
                out.push('?');
                out.push_str(MASK);
            }
            if fragment {
                out.push('#');
                out.push_str(MASK);
            }
            out
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether `part` starts with `scheme://`.
fn has_scheme(part: &str) -> bool {
    part.trim_start().split_once("://").is_some_and(|(s, _)| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    })
}

/// An authority (`user:pw@h1,h2` or `u:p@h1,u:q@h2`) with its secrets masked.
fn mask_authority(authority: &str, mask: &str) -> String {
    let Some(last_at) = authority.rfind('@') else { return authority.to_string() };
    let userinfo = |u: &str| match u.split_once(':') {
        Some((user, _)) => format!("{user}:{mask}"),
        None => mask.to_string(),
    };
    // Host by host when every host before the last credentials has its own
    // (`u:p@h1,u:q@h2`); otherwise a comma may sit inside a password, so
    // everything up to the last `@` is masked as one.
    let hosts: Vec<&str> = authority.split(',').collect();
    let last_with_creds = hosts.iter().rposition(|h| h.contains('@')).unwrap_or(0);
    if hosts[..last_with_creds].iter().all(|h| h.contains('@')) {
        hosts
            .iter()
            .map(|h| match h.rsplit_once('@') {
                Some((u, host)) => format!("{}@{host}", userinfo(u)),
                None => h.to_string(),
            })
            .collect::<Vec<_>>()
            .join(",")
    } else {
        let (u, host) = authority.split_at(last_at);
        let user = u.split_once(':').map(|(user, _)| user).filter(|user| !user.contains([',', '@']));
        match user {
            Some(user) => format!("{user}:{mask}{host}"),
            None => format!("{mask}{host}"),
        }
    }
}

/// `spec` without credentials, query string or fragment, for logs and
/// messages: each comma-separated URL keeps its scheme, host, port and path
/// (`nats://user:pw@h:4222` becomes `nats://h:4222`).
#[cfg_attr(not(feature = "relay"), allow(dead_code))]
pub(crate) fn redact_spec(spec: &str) -> String {
    spec.split(',')
        .map(|part| {
            let part = part.trim();
            let (scheme, rest) = match part.split_once("://") {
                Some((s, r)) => (format!("{s}://"), r),
                None => (String::new(), part),
            };
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(end);
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            let tail = match tail.find(['?', '#']) {
                Some(i) => format!("{}?…", &tail[..i]),
                None => tail.to_string(),
            };
            format!("{scheme}{host}{tail}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `url` without credentials, query string or fragment, for logs and
/// messages: a URL that had a query string ends in `?…`.
///
/// # Example
/// ```
/// use pg_outbox::relay::redact_url;
/// let url = reqwest::Url::parse("https://u:pw@hooks.example/in?token=t#f").unwrap();
/// assert_eq!(redact_url(&url), "https://hooks.example/in?…");
/// ```
#[cfg(feature = "webhook")]
pub fn redact_url(url: &reqwest::Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    let had_query = u.query().is_some();
    u.set_query(None);
    u.set_fragment(None);
    // Appended as text: set_query would percent-encode the marker.
    if had_query { format!("{u}?…") } else { u.to_string() }
}

/// `text` with every secret of `spec` (the password of each URL, or the
/// user part when it has no password: a token; as written and
/// percent-decoded) replaced by `***`: for error messages of
/// client libraries that might quote the URL.
#[allow(dead_code)] // unused when no broker feature is on
pub(crate) fn scrub(text: &str, spec: &str) -> String {
    let mut secrets: Vec<String> = Vec::new();
    for part in spec.split(',') {
        let rest = part.trim().split_once("://").map_or(part, |(_, r)| r);
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if let Some((userinfo, _)) = rest[..end].rsplit_once('@') {
            // `user:password` hides the password; a lone user part is a token.
            let secret = userinfo.split_once(':').map_or(userinfo, |(_, p)| p);
            if !secret.is_empty() {
                secrets.push(secret.to_string());
                let decoded = percent_encoding::percent_decode_str(secret).decode_utf8_lossy();
                if decoded != secret {
                    secrets.push(decoded.into_owned());
                }
            }
        }
    }
    // Longest first, so a secret that contains another is replaced whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_string();
    for s in &secrets {
        out = out.replace(s.as_str(), "***");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked() {
        assert_eq!(redact_password("postgres://app:s3cret@db:5432/app"), "postgres://app:****@db:5432/app");
        assert_eq!(redact_password("amqp://guest:guest@localhost:5672/%2f"), "amqp://guest:****@localhost:5672/%2f");
        assert_eq!(
            redact_password("postgres://app@db/app?password=x&sslmode=require"),
            "postgres://app@db/app?password=****&sslmode=require"
        );
        assert_eq!(redact_password("host=db password='a b\\'c' user=u"), "host=db password=**** user=u");
        assert_eq!(redact_password("host=db password = abc user=u"), "host=db password = **** user=u");
        assert_eq!(redact_password("nats://localhost:4222"), "nats://localhost:4222");
    }

    #[test]
    fn broker_urls_lose_credentials_in_names_and_messages() {
        assert_eq!(redact_spec("nats://u:p%40ss@h1:4222,nats://tok@h2:4223"), "nats://h1:4222,nats://h2:4223");
        assert_eq!(redact_spec("rediss://:secret@cache:6380/2?protocol=resp3"), "rediss://cache:6380/2?…");
        assert_eq!(redact_spec("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        let text = "auth failed for u with p%40ss (p@ss) and secret";
        assert_eq!(scrub(text, "nats://u:p%40ss@h1:4222"), "auth failed for u with *** (***) and secret");
        assert_eq!(scrub(text, "nats://secret@h1:4222"), "auth failed for u with p%40ss (p@ss) and ***");
        assert_eq!(scrub(text, "redis://h:6379"), text);
    }

    #[test]
    fn printed_sinks_mask_every_secret() {
        let cases = [
            ("stdout", "stdout"),
            ("nats://NATSTOKEN@127.0.0.1:4222", "nats://****@127.0.0.1:4222"),
            ("nats://nu:PW1@h1:4222,nats://nu2:PW2@h2:4222", "nats://nu:****@h1:4222,nats://nu2:****@h2:4222"),
            ("nats://nu:PW1@h1:4222,nu2:PW2@h2:4222", "nats://nu:****@h1:4222,nu2:****@h2:4222"),
            ("kafka://u:p@h1:9092,h2:9092", "kafka://u:****@h1:9092,h2:9092"),
            ("nats://u:p,w@h1:4222", "nats://u:****@h1:4222"),
            ("http://h/path?api_key=K", "http://h/path?****"),
            ("https://h/p?a=1,b=2#frag", "https://h/p?****#****"),
            ("rediss://:secret@cache:6380/2?protocol=resp3", "rediss://:****@cache:6380/2?****"),
            ("amqp://u:pa/ss?x#y@mq:5672/%2f", "amqp://u:****@mq:5672/%2f"),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ];
        for (spec, want) in cases {
            assert_eq!(redact_sink(spec), want, "{spec}");
        }
    }
}

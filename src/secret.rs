//! Secrets as types: what pg-outbox prints, logs and stores never holds
//! one, because the type of a secret-bearing value decides how it prints.
//!
//! - [`Secret`]: a password, a token, a signing key, a credentials file's
//!   contents. `Debug` and `Display` print [`MASK`]; the value is read only
//!   through [`Secret::expose`].
//! - [`SecretUrl`]: a sink's URL (or comma-separated list of URLs), which
//!   may hold a password or token in `user:password@`, a lone token as the
//!   user part (`nats://TOKEN@host`), or an API key in its query string.
//!   [`SecretUrl::shown`] is the form for logs, error messages, `/readyz`,
//!   `last_error` and the console (scheme, host, port and path: credentials
//!   gone, a query string shown as `?****`); [`SecretUrl::masked`] is the
//!   form for printed settings (`pg-outbox relay --print-config`): every
//!   secret replaced by [`MASK`], the user names and hosts kept so the
//!   setting can be checked. `Display` and `Debug` print the masked form.
//! - [`DatabaseUrl`]: a database URL or libpq key=value string; `Display`
//!   and `Debug` mask the password however it is written.
//!
//! Every mask is the one string [`MASK`].

/// What every masked secret is shown as: `****`.
pub const MASK: &str = "****";

/// A secret (a password, a token, an NKey seed, a webhook signing key, a
/// NATS credentials file's contents). `Debug` prints `Secret(****)` and
/// `Display` prints `****`, so a settings struct that holds one can be
/// logged or printed safely. The value is read only through
/// [`Secret::expose`].
///
/// # Example
/// ```
/// use pg_outbox::secret::Secret;
/// let s = Secret::new("hunter2");
/// assert_eq!(format!("{s:?}"), "Secret(****)");
/// assert_eq!(s.to_string(), "****");
/// assert_eq!(s.expose(), "hunter2");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

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

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({MASK})")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Secret(value.to_string())
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    /// Any text is a secret.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret::new(s))
    }
}

/// A sink's URL, or a comma-separated list of them
/// (`nats://a:pw@h1:4222,nats://b:pw@h2:4222`), which may carry
/// credentials. It has two printed forms: [`SecretUrl::shown`] for logs and
/// messages, [`SecretUrl::masked`] for printed settings.
///
/// # Example
/// ```
/// use pg_outbox::secret::SecretUrl;
/// let url = SecretUrl::new("amqp://app:pw@mq:5672/%2f");
/// assert_eq!(url.shown(), "amqp://mq:5672/%2f");
/// assert_eq!(url.masked(), "amqp://app:****@mq:5672/%2f");
/// assert_eq!(SecretUrl::new("nats://tok@h:4222").masked(), "nats://****@h:4222");
/// assert_eq!(SecretUrl::new("https://u:pw@h/hook?api_key=k").shown(), "https://h/hook?****");
/// assert_eq!(url.to_string(), url.masked());
/// assert_eq!(url.scrub("login app:pw refused"), "login app:**** refused");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wrap `url` as given.
    pub fn new(url: impl Into<String>) -> Self {
        SecretUrl(url.into())
    }

    /// The URL as given, credentials included, for the client library that
    /// connects with it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The scheme (lowercase) of the first URL, if it has one: `nats` for
    /// `nats://h:4222`; `None` for `stdout`.
    pub fn scheme(&self) -> Option<String> {
        self.0.split_once("://").map(|(s, _)| s.trim().to_ascii_lowercase())
    }

    /// The form for logs, error messages, `/readyz` and `last_error`: each
    /// comma-separated URL keeps its scheme, host, port and path;
    /// credentials are removed and a query string or fragment becomes
    /// `?****` (`nats://user:pw@h:4222` becomes `nats://h:4222`).
    pub fn shown(&self) -> String {
        strip(&self.0)
    }

    /// The form for printed settings: every secret replaced by [`MASK`],
    /// everything else kept. In each URL of a comma-separated list and each
    /// host of a multi-host authority, the password of `user:password@` (or
    /// the whole user part when it has no password: a token), and any query
    /// string or fragment (`?****`, `#****`). The credentials end at the
    /// last `@` of a URL, so a password holding an unencoded `/`, `?` or `#`
    /// is masked too; an `@` in a path or query makes it mask more than
    /// needed, never less.
    pub fn masked(&self) -> String {
        mask_sink(&self.0)
    }

    /// `text` (a client library's error, which may quote the URL) with
    /// every secret of this URL (the password of each URL, or the user part
    /// when it has no password: a token; the value of a query parameter
    /// whose name looks like a credential, such as `api_key` or `token`;
    /// each as written and percent-decoded) replaced by [`MASK`].
    pub fn scrub(&self, text: &str) -> String {
        scrub(text, &self.0)
    }
}

impl std::fmt::Display for SecretUrl {
    /// The [masked](SecretUrl::masked) form.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.masked())
    }
}

impl std::fmt::Debug for SecretUrl {
    /// `SecretUrl("<masked form>")`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SecretUrl").field(&self.masked()).finish()
    }
}

impl std::str::FromStr for SecretUrl {
    type Err = std::convert::Infallible;
    /// Any text; the sink's registry checks it when the sink is opened.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(SecretUrl::new(s))
    }
}

impl From<&str> for SecretUrl {
    fn from(value: &str) -> Self {
        SecretUrl::new(value)
    }
}

/// A database URL (`postgres://user:password@host/db`) or libpq key=value
/// string (`host=db password=x`). `Display` and `Debug` print it with its
/// password masked however it is written: in a URL that parses, everything
/// between `user:` and the last `@` (so a password holding `?`, `#`, `/` or
/// `@` is masked whole); in one that does not, everything between `://` and
/// the last `@`; and `password=...` in a query string or a key=value string.
///
/// # Example
/// ```
/// use pg_outbox::DatabaseUrl;
/// assert_eq!(DatabaseUrl::new("postgres://u:p#a/s@s@db:5432/app").to_string(), "postgres://u:****@db:5432/app");
/// assert_eq!(DatabaseUrl::new("host=db password=x user=u").to_string(), "host=db password=**** user=u");
/// assert_eq!(DatabaseUrl::new("host=db password=x").expose(), "host=db password=x");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    /// Wrap `url` as given.
    pub fn new(url: impl Into<String>) -> Self {
        DatabaseUrl(url.into())
    }

    /// The URL as given, password included, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with its password masked (the `Display` form).
    pub fn masked(&self) -> String {
        mask_database_url(&self.0)
    }
}

impl std::fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.masked())
    }
}

impl std::fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DatabaseUrl").field(&self.masked()).finish()
    }
}

impl std::str::FromStr for DatabaseUrl {
    type Err = std::convert::Infallible;
    /// Any text; [`crate::ConnectOptions::parse`] checks it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(DatabaseUrl::new(s))
    }
}

/// Whether a named value (a librdkafka property such as `sasl.password`
/// or `sasl.jaas.config`, an HTTP header such as `Authorization`) may hold a
/// secret, so it is kept as a [`Secret`] when the setting is parsed:
/// names holding `password`, `secret`, `jaas`, `token`, `key`,
/// `oauthbearer.config`, `credential`, `.pem`, `auth`, `cookie` or
/// `signature`.
pub(crate) fn looks_secret(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password",
        "secret",
        "jaas",
        "token",
        "key",
        "oauthbearer.config",
        "credential",
        ".pem",
        "auth",
        "cookie",
        "signature",
    ]
    .iter()
    .any(|s| n.contains(s))
}

/// Mask passwords in a URL or connection string, for printed settings:
/// `scheme://user:****@host/...` (the userinfo password of any URL), and
/// `password=****` in query strings and libpq key=value strings.
fn mask_password(value: &str) -> String {
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

/// A database URL with its password masked (see [`DatabaseUrl`]); a value
/// without `://` or without `@` gets [`mask_password`] alone.
fn mask_database_url(value: &str) -> String {
    let Some((scheme, rest)) = value.split_once("://") else { return mask_password(value) };
    let Some(at) = rest.rfind('@') else { return mask_password(value) };
    let (userinfo, host) = rest.split_at(at);
    let masked = if crate::connect::parses(value) {
        match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:{MASK}{host}"),
            None => value.to_string(),
        }
    } else {
        format!("{scheme}://{MASK}{host}")
    };
    mask_password(&masked)
}

/// `spec` with every secret masked (see [`SecretUrl::masked`]).
fn mask_sink(spec: &str) -> String {
    urls(spec)
        .iter()
        .map(|url| {
            let (scheme, authority, tail) = split_url(url);
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

/// The URLs of a comma-separated list: a part with a scheme starts one; a
/// part without continues the previous one (more hosts, a comma inside a
/// password, path or query).
fn urls(spec: &str) -> Vec<String> {
    let mut urls: Vec<String> = Vec::new();
    for part in spec.split(',') {
        match urls.last_mut() {
            Some(last) if !has_scheme(part) => {
                last.push(',');
                last.push_str(part);
            }
            _ => urls.push(part.trim().to_string()),
        }
    }
    urls
}

/// `url` as `(scheme://, authority, tail)`. The authority ends at the first
/// `/`, `?` or `#` after the last `@`, so credentials holding any of them
/// stay in it.
fn split_url(url: &str) -> (String, &str, &str) {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (format!("{s}://"), r),
        None => (String::new(), url),
    };
    let from = rest.rfind('@').map_or(0, |i| i + 1);
    let end = rest[from..].find(['/', '?', '#']).map_or(rest.len(), |i| from + i);
    let (authority, tail) = rest.split_at(end);
    (scheme, authority, tail)
}

/// An authority's hosts and the userinfo parts before them: host by host
/// when every host before the last credentials has its own
/// (`u:p@h1,u:q@h2`); otherwise a comma may sit inside a password, so
/// everything up to the last `@` is one userinfo.
fn authority_parts(authority: &str) -> (Vec<&str>, Vec<&str>) {
    let Some(last_at) = authority.rfind('@') else { return (authority.split(',').collect(), Vec::new()) };
    let hosts: Vec<&str> = authority.split(',').collect();
    let last_with_creds = hosts.iter().rposition(|h| h.contains('@')).unwrap_or(0);
    if hosts[..last_with_creds].iter().all(|h| h.contains('@')) {
        let split: Vec<(Option<&str>, &str)> =
            hosts.iter().map(|h| h.rsplit_once('@').map_or((None, *h), |(u, host)| (Some(u), host))).collect();
        (split.iter().map(|(_, h)| *h).collect(), split.iter().filter_map(|(u, _)| *u).collect())
    } else {
        (vec![&authority[last_at + 1..]], vec![&authority[..last_at]])
    }
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

/// `spec` without credentials; a query string or fragment becomes `?****`
/// (see [`SecretUrl::shown`]).
pub(crate) fn strip(spec: &str) -> String {
    urls(spec)
        .iter()
        .map(|url| {
            let (scheme, authority, tail) = split_url(url);
            let (hosts, _) = authority_parts(authority);
            let tail = match tail.find(['?', '#']) {
                Some(i) => format!("{}?{MASK}", &tail[..i]),
                None => tail.to_string(),
            };
            format!("{scheme}{}{tail}", hosts.join(","))
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `text` with every secret of `spec` (the password of each URL, or the
/// user part when it has no password: a token; as written and
/// percent-decoded) replaced by [`MASK`] (see [`SecretUrl::scrub`]).
fn scrub(text: &str, spec: &str) -> String {
    let mut secrets: Vec<String> = Vec::new();
    let mut add = |secret: &str| {
        if !secret.is_empty() {
            secrets.push(secret.to_string());
            let decoded = percent_encoding::percent_decode_str(secret).decode_utf8_lossy();
            if decoded != secret {
                secrets.push(decoded.into_owned());
            }
        }
    };
    for url in urls(spec) {
        let (_, authority, tail) = split_url(&url);
        for userinfo in authority_parts(authority).1 {
            // `user:password` hides the password; a lone user part is a token.
            add(userinfo.split_once(':').map_or(userinfo, |(_, p)| p));
        }
        // A query parameter named like a credential (`api_key=`, `token=`).
        let query = tail.split_once('?').map_or("", |(_, q)| q);
        for pair in query.split(['&', '#']) {
            if let Some((key, value)) = pair.split_once('=')
                && looks_secret(key)
            {
                add(value);
            }
        }
    }
    let secrets: Vec<&str> = secrets.iter().map(String::as_str).collect();
    scrub_all(text, &secrets)
}

/// `text` with each of `secrets` (empty ones ignored) replaced by [`MASK`],
/// the longest first, so a secret that contains another is replaced whole.
pub(crate) fn scrub_all(text: &str, secrets: &[&str]) -> String {
    let mut sorted: Vec<&str> = secrets.iter().copied().filter(|s| !s.is_empty()).collect();
    sorted.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_string();
    for s in sorted {
        out = out.replace(s, MASK);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked() {
        assert_eq!(mask_password("postgres://app:s3cret@db:5432/app"), "postgres://app:****@db:5432/app");
        assert_eq!(mask_password("amqp://guest:guest@localhost:5672/%2f"), "amqp://guest:****@localhost:5672/%2f");
        assert_eq!(
            mask_password("postgres://app@db/app?password=x&sslmode=require"),
            "postgres://app@db/app?password=****&sslmode=require"
        );
        assert_eq!(mask_password("host=db password='a b\\'c' user=u"), "host=db password=**** user=u");
        assert_eq!(mask_password("host=db password = abc user=u"), "host=db password = **** user=u");
        assert_eq!(mask_password("nats://localhost:4222"), "nats://localhost:4222");
    }

    #[test]
    fn broker_urls_lose_credentials_in_names_and_messages() {
        assert_eq!(strip("nats://u:p%40ss@h1:4222,nats://tok@h2:4223"), "nats://h1:4222,nats://h2:4223");
        assert_eq!(strip("rediss://:secret@cache:6380/2?protocol=resp3"), "rediss://cache:6380/2?****");
        assert_eq!(strip("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        let text = "auth failed for u with p%40ss (p@ss) and secret";
        assert_eq!(scrub(text, "nats://u:p%40ss@h1:4222"), "auth failed for u with **** (****) and secret");
        assert_eq!(scrub(text, "nats://secret@h1:4222"), "auth failed for u with p%40ss (p@ss) and ****");
        assert_eq!(scrub(text, "redis://h:6379"), text);
        assert_eq!(scrub("key k3y-1 or x=1", "https://h/p?api_key=k3y-1&x=1"), "key **** or x=1");
        // Passwords holding `,`, `/`, `?` or `#`: gone from the shown form,
        // cut out of texts.
        for (spec, shown, password) in [
            ("http://u:C1,C2@127.0.0.1:18081/", "http://127.0.0.1:18081/", "C1,C2"),
            ("redis://:C1,C2@127.0.0.1:6379", "redis://127.0.0.1:6379", "C1,C2"),
            ("redis://:pw/S1@127.0.0.1:6379", "redis://127.0.0.1:6379", "pw/S1"),
            ("nats://u:pw?Q1@h:4222", "nats://h:4222", "pw?Q1"),
            ("amqp://u:pa/ss@h/", "amqp://h/", "pa/ss"),
            ("rediss://u:p#w@h:6380/0", "rediss://h:6380/0", "p#w"),
        ] {
            assert_eq!(strip(spec), shown, "{spec}");
            assert_eq!(scrub(&format!("failed with {password}"), spec), "failed with ****", "{spec}");
        }
    }

    #[test]
    fn database_urls_are_masked_however_the_password_is_written() {
        let masked = |u: &str| DatabaseUrl::new(u).to_string();
        assert_eq!(masked("postgres://u:pa?ss@127.0.0.1/db"), "postgres://u:****@127.0.0.1/db");
        assert_eq!(masked("postgres://u:p#a/s@s@db:5432/app"), "postgres://u:****@db:5432/app");
        assert_eq!(masked("postgres://app@db/app?password=x"), "postgres://app@db/app?password=****");
        assert_eq!(masked("host=db password=x user=u"), "host=db password=**** user=u");
        assert_eq!(format!("{:?}", DatabaseUrl::new("postgres://u:pw@h/d")), "DatabaseUrl(\"postgres://u:****@h/d\")");
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
            assert_eq!(mask_sink(spec), want, "{spec}");
        }
    }
}

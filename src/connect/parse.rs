//! The syntax of a connection string, a URL or libpq key=value pairs:
//! tokio-postgres parses it once `sslmode` and `sslrootcert`, which it does
//! not know as libpq does, are taken out.

use tokio_postgres::Config;

use crate::error::{Error, Result};

const TLS_KEYS: [&str; 2] = ["sslmode", "sslrootcert"];

/// Take `sslmode` and `sslrootcert` out of a URL's query string.
fn take_tls_params_url(url: &str) -> (String, Option<String>, Option<String>) {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => return (url.to_string(), None, None),
    };
    let (mut mode, mut root) = (None, None);
    let mut kept = Vec::new();
    for part in query.split('&') {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        let key = percent_encoding::percent_decode_str(k).decode_utf8_lossy();
        let value = || percent_encoding::percent_decode_str(v).decode_utf8_lossy().into_owned();
        match key.as_ref() {
            "sslmode" => mode = Some(value()),
            "sslrootcert" => root = Some(value()),
            _ => kept.push(part),
        }
    }
    let rest = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    (rest, mode, root)
}

/// Take `sslmode` and `sslrootcert` out of a libpq key=value string
/// (`key = value`, values optionally single-quoted with `\'` and `\\`
/// escapes; libpq "Keyword/Value Connection Strings").
fn take_tls_params_kv(s: &str) -> Result<(String, Option<String>, Option<String>)> {
    let b = s.as_bytes();
    let (mut mode, mut root) = (None, None);
    let mut rest = String::new();
    let mut i = skip_ws(b, 0);
    while i < b.len() {
        let start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &s[start..i];
        i = skip_ws(b, i);
        if i >= b.len() || b[i] != b'=' {
            // Not key=value: let tokio-postgres report it.
            return Ok((s.to_string(), None, None));
        }
        let (value, end, terminated) = kv_value(s, skip_ws(b, i + 1));
        if !terminated && TLS_KEYS.contains(&key) {
            return Err(Error::Config(format!("invalid connection string: unterminated quote in {key}")));
        }
        match key {
            "sslmode" => mode = Some(value),
            "sslrootcert" => root = Some(value),
            _ => {
                rest.push_str(&s[start..end]);
                rest.push(' ');
            }
        }
        i = skip_ws(b, end);
    }
    Ok((rest.trim_end().to_string(), mode, root))
}

/// The first byte at or after `i` that is not ASCII whitespace.
fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The key=value value starting at byte `i` of `s`: single-quoted (with
/// `\'` and `\\` escapes) or up to the next whitespace (with `\`
/// escapes). Returns the value, the byte after it, and whether a quote that
/// was opened was closed.
fn kv_value(s: &str, mut i: usize) -> (String, usize, bool) {
    let b = s.as_bytes();
    let quoted = i < b.len() && b[i] == b'\'';
    if quoted {
        i += 1;
    }
    let char_at = |i: usize| s[i..].chars().next().unwrap_or('\u{fffd}');
    let mut value = String::new();
    while i < b.len() {
        match b[i] {
            b'\'' if quoted => return (value, i + 1, true),
            c if !quoted && c.is_ascii_whitespace() => break,
            b'\\' if i + 1 < b.len() => {
                let ch = char_at(i + 1);
                value.push(ch);
                i += 1 + ch.len_utf8();
            }
            _ => {
                let ch = char_at(i);
                value.push(ch);
                i += ch.len_utf8();
            }
        }
    }
    (value, i, !quoted)
}

/// A string's settings, syntax only (no environment): the tokio-postgres
/// part, and `sslmode` and `sslrootcert` as given.
pub(super) fn parse_string(s: &str) -> Result<(Config, Option<String>, Option<String>)> {
    let trimmed = s.trim_start();
    let (rest, mode, root) = if let Some((scheme, _)) = trimmed.split_once("://") {
        if scheme != "postgres" && scheme != "postgresql" {
            return Err(Error::Config(format!(
                "invalid database URL: scheme `{scheme}://` is not PostgreSQL; write postgres://user@host:5432/dbname"
            )));
        }
        take_tls_params_url(trimmed)
    } else {
        take_tls_params_kv(s)?
    };
    let pg = rest.parse::<Config>().map_err(Error::InvalidUrl)?;
    Ok((pg, mode, root))
}

/// Whether `s` is a connection string pg-outbox can parse (its syntax; the
/// environment is not read).
pub(crate) fn parses(s: &str) -> bool {
    parse_string(s).is_ok()
}

#[cfg(test)]
mod tests {
    use crate::connect::testing::parse_url;
    use crate::connect::{RootCert, SslMode};

    #[test]
    fn tls_settings_are_taken_out_of_urls() {
        let o = parse_url("postgres://u@h/db?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem&application_name=x")
            .expect("url");
        assert_eq!(o.ssl_mode(), SslMode::VerifyFull);
        assert_eq!(o.root_cert(), Some(&RootCert::File("/tmp/ca.pem".into())));
        assert_eq!(o.application_name(), Some("x"));
        assert_eq!(o.tokio_postgres_config().get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        let o = parse_url("postgres://u@h/db").expect("url");
        assert_eq!(o.ssl_mode(), SslMode::Prefer);
        assert_eq!(o.root_cert(), None);
        let o = parse_url("postgres://u@h/db?sslrootcert=system").expect("url");
        assert_eq!((o.ssl_mode(), o.root_cert()), (SslMode::VerifyFull, Some(&RootCert::System)));
        let e = parse_url("postgres://u@h/db?sslrootcert=system&sslmode=require").expect_err("weaker than verify-full");
        assert!(e.to_string().contains("sslrootcert=system requires sslmode=verify-full"), "{e}");
        let e = parse_url("postgres://u@h/db?sslmode=verify").expect_err("unknown mode");
        assert!(e.to_string().contains("invalid sslmode `verify`"), "{e}");
        let o = parse_url("postgres://u@h/db?sslmode=allow").expect("url");
        assert_eq!(o.ssl_mode(), SslMode::Allow);
    }

    #[test]
    fn tls_settings_are_taken_out_of_key_value_strings() {
        let o = parse_url("host=h sslmode = verify-ca user=u sslrootcert='/tmp/my ca\\'s.pem' dbname=d").expect("kv");
        assert_eq!(o.ssl_mode(), SslMode::VerifyCa);
        assert_eq!(o.root_cert(), Some(&RootCert::File("/tmp/my ca's.pem".into())));
        assert_eq!((o.user(), o.dbname()), (Some("u"), Some("d")));
        let o = parse_url("host=h options='-c a=b' sslmode=disable").expect("kv");
        assert_eq!(o.ssl_mode(), SslMode::Disable);
        assert_eq!(o.pg.get_options(), Some("-c a=b"));
        let o = parse_url("host=h sslmode=require").expect("kv");
        assert_eq!(o.ssl_mode(), SslMode::Require);
    }

    #[test]
    fn other_schemes_are_named() {
        let e = parse_url("mysql://u@h/db").expect_err("not postgres");
        assert!(e.to_string().contains("mysql://"), "{e}");
        let secret = parse_url("postgres://u:s3cret@h:notaport/db").expect_err("bad port");
        assert!(!crate::error::report(&secret).contains("s3cret"));
    }
}

//! The NATS sink's authentication: credentials taken out of the URL, and
//! the one way to authenticate that the URL and the options give.

use crate::error::{Error, Result};
use crate::relay::SinkSettings;
use crate::secret::{MASK, SecretUrl};

/// Credentials taken out of a NATS URL (percent-decoded). `Debug` hides
/// the secrets.
#[cfg_attr(test, derive(PartialEq))]
pub(super) enum Credentials {
    /// `nats://user:password@host`.
    UserPassword(String, String),
    /// `nats://token@host`.
    Token(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::UserPassword(user, _) => write!(f, "UserPassword({user:?}, {MASK})"),
            Credentials::Token(_) => write!(f, "Token({MASK})"),
        }
    }
}

/// The servers of a comma-separated list, credentials removed, the
/// credentials found (the last URL's that has any), and whether a `tls://`
/// URL asks for TLS.
pub(super) fn split_credentials(spec: &SecretUrl) -> Result<(Vec<String>, Option<Credentials>, bool)> {
    let mut servers = Vec::new();
    let mut creds = None;
    let mut tls = false;
    for part in spec.expose().split(',').map(str::trim) {
        let shown = SecretUrl::new(part).shown();
        let mut url = url::Url::parse(part).map_err(|e| Error::Config(format!("invalid NATS URL '{shown}': {e}")))?;
        match url.scheme() {
            "nats" => {}
            "tls" => tls = true,
            _ => {
                return Err(Error::Config(format!(
                    "invalid NATS URL '{shown}': every server of the list must use nats:// (or tls://)"
                )));
            }
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(Error::Config(format!("invalid NATS URL '{shown}': no host")));
        }
        if !url.username().is_empty() {
            let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
            let user = decode(url.username());
            creds = Some(match url.password() {
                Some(pass) => Credentials::UserPassword(user, decode(pass)),
                None => Credentials::Token(user),
            });
            let _ = url.set_username("");
            let _ = url.set_password(None);
        }
        servers.push(url.to_string());
    }
    Ok((servers, creds, tls))
}

/// How the client proves who it is, from the URL and the options; at most
/// one way may be given.
pub(super) fn authentication(
    url_creds: Option<Credentials>,
    settings: &SinkSettings,
    options: async_nats::ConnectOptions,
) -> Result<async_nats::ConnectOptions> {
    let nats = &settings.nats;
    let (mut user, mut password, mut token) = match url_creds {
        Some(Credentials::UserPassword(u, p)) => (Some(u), Some(p), None),
        Some(Credentials::Token(t)) => (None, None, Some(t)),
        None => (None, None, None),
    };
    if let Some(u) = &settings.credentials.user {
        user = Some(u.clone());
        // A URL's lone user part was a token; with --sink-user it is not.
        token = token.filter(|_| password.is_some());
    }
    if let Some(p) = &settings.credentials.password {
        password = Some(p.expose().to_string());
    }
    if let Some(t) = &nats.token {
        token = Some(t.expose().to_string());
    }
    let user_password = match (user, password) {
        (Some(u), Some(p)) => Some((u, p)),
        (None, None) => None,
        (Some(u), None) => {
            return Err(Error::Config(format!(
                "NATS user '{u}' has no password (give --sink-password-file or put it in the URL)"
            )));
        }
        (None, Some(_)) => {
            return Err(Error::Config("NATS password given without a user (--sink-user)".into()));
        }
    };
    let ways = [user_password.is_some(), token.is_some(), nats.nkey.is_some(), nats.credentials.is_some()];
    if ways.iter().filter(|w| **w).count() > 1 {
        return Err(Error::Config(
            "NATS: give one way to authenticate: a user and password, a token, an NKey seed or a credentials file"
                .into(),
        ));
    }
    if let Some((u, p)) = user_password {
        return Ok(options.user_and_password(u, p));
    }
    if let Some(t) = token {
        return Ok(options.token(t));
    }
    if let Some(seed) = &nats.nkey {
        let seed = seed.expose().trim();
        // Checked here so a bad seed is a clear error, not a failed handshake.
        nkeys::KeyPair::from_seed(seed).map_err(|e| {
            Error::Config(format!("NATS NKey seed is not valid ({e}); a user seed is one line starting with SU"))
        })?;
        return Ok(options.nkey(seed.to_string()));
    }
    if let Some(creds) = &nats.credentials {
        return options.credentials(creds.expose()).map_err(|e| {
            Error::Config(format!(
                "NATS credentials file is not usable ({e}); it must hold a user JWT and an NKey seed, as `nsc` writes them"
            ))
        });
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_url_and_are_decoded() {
        let split = |s: &str| split_credentials(&SecretUrl::new(s));
        let (servers, creds, tls) = split("nats://al%40ice:p%3Ass@h1:4222,nats://h2:4223").expect("parses");
        assert_eq!(servers, ["nats://h1:4222", "nats://h2:4223"]);
        assert!(!tls);
        assert!(creds == Some(Credentials::UserPassword("al@ice".into(), "p:ss".into())), "user and password");
        let (_, creds, _) = split("nats://s3cr3t@h1:4222").expect("parses");
        let (_, _, tls) = split("tls://h1:4222").expect("parses");
        assert!(tls, "tls:// asks for TLS");
        assert!(creds == Some(Credentials::Token("s3cr3t".into())), "a lone user part is a token");
        let err = split("nats://u:pw@h1:4222,http://h2").expect_err("http is refused").to_string();
        assert!(err.contains("nats://") && !err.contains("pw"), "{err}");
    }
}

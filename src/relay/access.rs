//! Access to a broker: TLS and credentials (shared by the broker sinks),
//! and why a broker refused a connection, in words.

use std::path::PathBuf;

use super::sink_list::dead_unless;
use crate::error::{Error, Result};
use crate::secret::Secret;

/// TLS to a broker. Redis and RabbitMQ take TLS from the scheme
/// (`rediss://`, `amqps://`) and refuse these settings with a plain one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsOptions {
    /// Use TLS to the broker although the URL does not say so: NATS
    /// (`nats://`; `tls://` always does) and Kafka. Any of the three files
    /// implies it. Default off.
    pub enabled: bool,
    /// PEM file of the CA certificate(s) that sign the broker's
    /// certificate; `None` (the default) trusts the platform's root
    /// certificates. RabbitMQ adds the file's certificates to the
    /// platform's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (chain) to present for mutual TLS
    /// (with [`client_key`](Self::client_key)); default none.
    pub client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key (PKCS#8, PKCS#1 or
    /// SEC1); default none.
    pub client_key: Option<PathBuf>,
}

impl TlsOptions {
    /// Whether TLS is asked for: [`enabled`](Self::enabled) or any file.
    pub fn wanted(&self) -> bool {
        self.enabled || self.ca_file.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }

    /// Check the files before connecting to `broker` (a name for the
    /// message): each one given is readable and holds PEM, and a client
    /// certificate comes with its key.
    ///
    /// # Errors
    /// [`Error::Config`] naming the broker, the file and the flag.
    pub fn check_files(&self, broker: &str) -> Result<()> {
        match (&self.client_cert, &self.client_key) {
            (Some(_), None) => {
                return Err(Error::Config(format!(
                    "{broker}: a client certificate needs its private key (--sink-tls-client-key)"
                )));
            }
            (None, Some(_)) => {
                return Err(Error::Config(format!(
                    "{broker}: a client key needs its certificate (--sink-tls-client-cert)"
                )));
            }
            _ => {}
        }
        for (what, path) in [
            ("CA file (--sink-tls-ca-file)", &self.ca_file),
            ("client certificate (--sink-tls-client-cert)", &self.client_cert),
            ("client key (--sink-tls-client-key)", &self.client_key),
        ] {
            let Some(path) = path else { continue };
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("{broker}: TLS {what} {}: {e}", path.display())))?;
            if !text.contains("-----BEGIN ") {
                return Err(Error::Config(format!(
                    "{broker}: TLS {what} {} holds no PEM block (-----BEGIN ...)",
                    path.display()
                )));
            }
        }
        Ok(())
    }
}

/// The broker's user and password; both override ones in the URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Credentials {
    /// User name for the broker (NATS user, Redis ACL user, RabbitMQ user,
    /// Kafka SASL user). Default none.
    pub user: Option<String>,
    /// Password of [`user`](Self::user) (or of the URL's user). Default none.
    pub password: Option<Secret>,
}

dead_unless! {broker;
    /// Why a broker refused a connection, in words, when `error` (one line,
    /// with its chain) shows a known cause: an untrusted certificate, a
    /// certificate for another host name, a missing or refused client
    /// certificate, refused credentials. `None` otherwise.
    pub(crate) fn refusal_reason(error: &str) -> Option<&'static str> {
        let e = error.to_ascii_lowercase();
        let has = |needles: &[&str]| needles.iter().any(|n| e.contains(n));
        if has(&["broker certificate could not be verified"]) {
            // librdkafka (OpenSSL) reports both causes with the same words.
            Some(
                "TLS: the broker's certificate could not be verified: it is not signed by a trusted CA \
                 (see --sink-tls-ca-file) or not valid for the host name in the URL (librdkafka does not say which)",
            )
        } else if has(&["notvalidforname", "not valid for name", "hostname mismatch", "host name mismatch"]) {
            Some("TLS: the broker's certificate is not valid for the host name in the URL")
        } else if has(&[
            "unknownissuer",
            "unknown issuer",
            "unable to get local issuer",
            "self-signed certificate",
            "self signed certificate",
            "invalidcertificate",
        ]) {
            Some("TLS: the broker's certificate is not signed by a trusted CA (see --sink-tls-ca-file)")
        } else if has(&[
            "certificaterequired",
            "certificate required",
            "badcertificate",
            "bad certificate",
            "unknownca",
            "unknown ca",
            "decrypterror",
        ]) {
            Some(
                "TLS: the broker refused the client certificate or wants one \
                 (--sink-tls-client-cert, --sink-tls-client-key)",
            )
        } else if has(&[
            "authorization violation",
            "authentication failed",
            "wrongpass",
            "noauth",
            "access_refused",
            "access-refused",
            "sasl authentication",
            "authentication error",
            "invalid username or password",
            "failed signing nonce",
        ]) {
            Some("the broker refused the credentials (user and password, token, NKey or credentials file)")
        } else {
            None
        }
    }
}

dead_unless! {broker;
    /// `error` preceded by its [`refusal_reason`], if it has one.
    pub(crate) fn with_reason(error: String) -> String {
        match refusal_reason(&error) {
            Some(reason) => format!("{reason} ({error})"),
            None => error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::refusal_reason;

    #[test]
    fn refusals_are_told_apart() {
        let cases = [
            ("IO error: invalid peer certificate: UnknownIssuer", "not signed by a trusted CA"),
            ("invalid peer certificate: certificate not valid for name \"127.0.0.1\"", "not valid for the host name"),
            ("received fatal alert: BadCertificate", "refused the client certificate"),
            ("received fatal alert: CertificateRequired", "refused the client certificate"),
            ("WRONGPASS invalid username-password pair", "refused the credentials"),
            ("failed to connect: authorization violation", "refused the credentials"),
            (
                "SSL handshake failed: certificate verify failed: broker certificate could not be verified",
                "does not say which",
            ),
        ];
        for (error, want) in cases {
            let got = refusal_reason(error).unwrap_or_default();
            assert!(got.contains(want), "{error} -> {got}");
        }
        assert_eq!(refusal_reason("connection refused"), None);
    }
}

//! TLS by rustls (ring provider) with libpq's `sslmode` rules: the root
//! store, the certificate verifier, and the connector handed out for pools.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::Socket;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{ConnectOptions, RootCert, SslMode};
use crate::error::{Error, Result};

/// TLS for tokio-postgres with pg-outbox's `sslmode` rules, from
/// [`ConnectOptions::tls_connector`]: for a pool (or `Config::connect`)
/// with the `Config` of [`ConnectOptions::tokio_postgres_config`].
/// rustls with the ring provider; handshake signatures are always checked,
/// certificates as the `sslmode` says.
#[derive(Clone)]
pub struct TlsConnector(pub(super) MakeRustlsConnect);

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector").finish_non_exhaustive()
    }
}

impl MakeTlsConnect<Socket> for TlsConnector {
    type Stream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;
    type TlsConnect = <MakeRustlsConnect as MakeTlsConnect<Socket>>::TlsConnect;
    type Error = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> std::result::Result<Self::TlsConnect, Self::Error> {
        MakeTlsConnect::<Socket>::make_tls_connect(&mut self.0, domain)
    }
}

/// The TLS stream type of our connections.
pub(crate) type TlsStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

impl ConnectOptions {
    pub(super) fn check_system_roots(&self) -> Result<()> {
        if self.root_cert == Some(RootCert::System) && self.ssl_mode != SslMode::VerifyFull {
            return Err(Error::Config(format!(
                "sslrootcert=system requires sslmode=verify-full (libpq 16), got sslmode={}",
                self.ssl_mode
            )));
        }
        Ok(())
    }

    /// The root store, if certificates are to be checked.
    fn roots(&self) -> Result<Option<RootCertStore>> {
        let root = match &self.root_cert {
            Some(r) => Some(r.clone()),
            None => default_root_file().map(RootCert::File),
        };
        let needed = matches!(self.ssl_mode, SslMode::VerifyCa | SslMode::VerifyFull);
        let wanted = needed || self.ssl_mode == SslMode::Require;
        let Some(root) = root.filter(|_| wanted) else {
            if needed {
                return Err(Error::Config(format!(
                    "sslmode={} needs trusted root certificates: set sslrootcert=FILE (a PEM file of CA \
                     certificates), or sslrootcert=system, or create ~/.postgresql/root.crt",
                    self.ssl_mode
                )));
            }
            return Ok(None);
        };
        let mut store = RootCertStore::empty();
        match root {
            RootCert::System => {
                let loaded = rustls_native_certs::load_native_certs();
                let (added, _) = store.add_parsable_certificates(loaded.certs);
                if added == 0 {
                    let why: Vec<String> = loaded.errors.iter().map(ToString::to_string).collect();
                    let why = if why.is_empty() { String::new() } else { format!(": {}", why.join("; ")) };
                    return Err(Error::Config(format!("sslrootcert=system: no system root certificates found{why}")));
                }
            }
            RootCert::File(path) => load_pem_roots(&path, &mut store)?,
        }
        Ok(Some(store))
    }

    /// The rustls connector for this mode.
    pub(super) fn tls(&self) -> Result<MakeRustlsConnect> {
        self.check_system_roots()?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = if self.ssl_mode == SslMode::Disable { None } else { self.roots()? };
        let check = match (self.ssl_mode, roots) {
            (SslMode::VerifyFull, Some(r)) => Check::Full(webpki(r, &provider)?),
            (SslMode::VerifyCa | SslMode::Require, Some(r)) => Check::Chain(webpki(r, &provider)?),
            _ => Check::Nothing,
        };
        let verifier = Arc::new(Verifier { check, provider: provider.clone() });
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(MakeRustlsConnect::new(config))
    }
}

fn webpki(roots: RootCertStore, provider: &Arc<CryptoProvider>) -> Result<Arc<WebPkiServerVerifier>> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| Error::Config(format!("TLS root certificates: {e}")))
}

/// `~/.postgresql/root.crt` if it exists (libpq's default `sslrootcert`).
fn default_root_file() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let p = Path::new(&home).join(".postgresql").join("root.crt");
    p.is_file().then_some(p)
}

fn load_pem_roots(path: &Path, store: &mut RootCertStore) -> Result<()> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| Error::Config(format!("sslrootcert {shown}: cannot read: {e}")))?;
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        let cert = cert.map_err(|e| Error::Config(format!("sslrootcert {shown}: not a PEM certificate file: {e}")))?;
        store.add(cert).map_err(|e| Error::Config(format!("sslrootcert {shown}: unusable certificate: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(Error::Config(format!(
            "sslrootcert {shown}: no certificate found (expected PEM, BEGIN CERTIFICATE)"
        )));
    }
    Ok(())
}

/// What the server's certificate is checked for.
#[derive(Debug)]
enum Check {
    /// Nothing (libpq `prefer`, `allow`, `require` without a root).
    Nothing,
    /// The chain to a trusted root, not the name (`verify-ca`).
    Chain(Arc<WebPkiServerVerifier>),
    /// Chain and host name (`verify-full`).
    Full(Arc<WebPkiServerVerifier>),
}

/// Certificate checks by sslmode; handshake signatures are always checked.
#[derive(Debug)]
struct Verifier {
    check: Check,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match &self.check {
            Check::Nothing => Ok(ServerCertVerified::assertion()),
            Check::Full(v) => v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now),
            // The name is checked after the chain (rustls's WebPkiServerVerifier),
            // so a name error means the chain is good.
            Check::Chain(v) => match v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            },
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use crate::connect::testing::parse_url;

    #[test]
    fn verify_modes_need_roots() {
        let o = parse_url("postgres://u@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem").expect("url");
        let Err(e) = o.tls() else { panic!("a missing sslrootcert file must fail") };
        assert!(e.to_string().contains("sslrootcert /nonexistent/ca.pem: cannot read"), "{e}");
    }
}

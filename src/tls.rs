//! TLS to PostgreSQL, as libpq sets it: [`SslMode`] (`sslmode`) and
//! [`RootCert`] (`sslrootcert`) of a
//! [`ConnectOptions`](crate::ConnectOptions), and the [`TlsConnector`] it
//! makes for a pool of one's own
//! ([`ConnectOptions::tls_connector`](crate::ConnectOptions::tls_connector)).

pub use crate::connect::{RootCert, SslMode, TlsConnector};

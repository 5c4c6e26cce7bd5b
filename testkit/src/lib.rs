//! What pg-outbox's integration tests (`tests/it`) and benchmarks
//! (`benches/`) share. Not published: pg-outbox's dev-dependency only.
//!
//! - [`server`]: a PostgreSQL to run against (`DATABASE_URL`, a local
//!   server, else a [`TempServer`]) and connections to it;
//! - [`db`]: databases of a test's own ([`TestDb`]) and the benchmarks'
//!   scratch databases;
//! - [`options`]: a server's settings as pg-outbox's [`ConnectOptions`] or
//!   as a connection string for a child process;
//! - [`process`]: the `pg-outbox relay` child process, the clean
//!   environment every run of the binary gets, and a free port;
//! - [`bench`](mod@bench): the benchmarks' error type and `main`.
//!
//! - [`temp_server`]: a throwaway server from the local binaries; the file
//!   lives with the binary (`src/bin/pg-outbox/temp_server/`), whose
//!   `demo` starts one, and is included here.
//!
//! [`ConnectOptions`]: pg_outbox::ConnectOptions

#![warn(missing_docs, missing_debug_implementations, unreachable_pub, rust_2018_idioms)]

pub mod bench;
pub mod db;
pub mod options;
pub mod process;
pub mod server;
#[path = "../../src/bin/pg-outbox/temp_server/mod.rs"]
pub mod temp_server;

pub use db::TestDb;
pub use options::{conninfo, options_of};
pub use server::{Server, connect, find_server};
pub use temp_server::{StandbyOptions, TempServer, TempServerOptions};

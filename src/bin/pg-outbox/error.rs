//! The command line's errors: the library's, and those only a command can
//! meet (a refused request, a failed self-check, a throwaway server).

/// Everything a `pg-outbox` command can fail with. `main` prints the chain
/// on one line (`error: a: b: c`) and exits 1.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// What the library reported.
    #[error(transparent)]
    Outbox(#[from] pg_outbox::Error),
    /// A setting or flag is out of range or cannot be used.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An event given on the command line cannot be published.
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    /// A request that cannot be carried out as asked (an id that is not a
    /// dead letter, a destructive command without confirmation); the message
    /// says what to do.
    #[error("{0}")]
    Usage(String),
    /// A long-running command stopped on an error before its end; the
    /// message says where to resume.
    #[error("{0}")]
    Stopped(String),
    /// SIGINT/SIGTERM stopped a command before its end (it printed where
    /// to resume); exits with status 130.
    #[error("interrupted")]
    Interrupted,
    /// A self-check found a problem (the demo's delivery checks).
    #[error("check failed: {0}")]
    Check(String),
    /// The demo's throwaway server.
    #[error(transparent)]
    TempServer(#[from] crate::temp_server::Error),
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        Error::Outbox(e.into())
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::Outbox(e.into())
    }
}

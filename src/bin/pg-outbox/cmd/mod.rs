//! One module per command; `main` parses the command line and calls the
//! command's `run`.

pub(crate) mod archive;
pub(crate) mod console;
pub(crate) mod dead_letters;
pub(crate) mod demo;
pub(crate) mod migrate;
pub(crate) mod publish;
pub(crate) mod relay;
pub(crate) mod replay;
pub(crate) mod status;
pub(crate) mod subscription;
pub(crate) mod text;
